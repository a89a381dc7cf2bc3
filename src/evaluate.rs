//! Evaluate (stub).
