//! Model TOML files. (Stub.)
use super::ModelSpec;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ModelFileError {
    #[error("model file {path}: {message}")]
    Invalid { path: String, message: String },
}

pub fn parse_model_toml(text: &str, path: &str) -> Result<ModelSpec, ModelFileError> {
    toml::from_str(text).map_err(|e| ModelFileError::Invalid { path: path.into(), message: e.to_string() })
}

pub fn load_model_file(path: &Path) -> Result<ModelSpec, ModelFileError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelFileError::Invalid { path: path.display().to_string(), message: e.to_string() })?;
    parse_model_toml(&text, &path.display().to_string())
}
