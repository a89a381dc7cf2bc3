//! Search (stub).
