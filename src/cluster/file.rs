//! Cluster TOML files. (Stub.)
use super::Cluster;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ClusterFileError {
    #[error("cluster file {path}: {message}")]
    Invalid { path: String, message: String },
}

pub fn parse_cluster_toml(_text: &str, path: &str) -> Result<Cluster, ClusterFileError> {
    Err(ClusterFileError::Invalid { path: path.into(), message: "not implemented".into() })
}

pub fn load_cluster_file(path: &Path) -> Result<Cluster, ClusterFileError> {
    let text = std::fs::read_to_string(path).map_err(|e| ClusterFileError::Invalid { path: path.display().to_string(), message: e.to_string() })?;
    parse_cluster_toml(&text, &path.display().to_string())
}
