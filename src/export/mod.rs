//! Export (stub).
