//! The command-line front end (binary only).

pub mod args;
pub mod calibrate;
pub mod commands;
pub mod embedding;
pub mod flags;
pub mod ingest;
pub mod measure;
pub mod profile;
pub mod profile_dir;
pub mod render;
pub mod resolve;
pub mod validate;
pub mod validate_cluster;
