//! Built-in models. (Stub: filled in by the catalogue work.)
use super::ModelSpec;

pub fn builtin_model_names() -> Vec<&'static str> {
    vec!["gpt3-175b"]
}

pub fn builtin_model(name: &str) -> Option<ModelSpec> {
    match name {
        "gpt3-175b" => Some(ModelSpec::gpt("gpt3-175b", 12288, 96, 96, 51200, 2048)),
        _ => None,
    }
}
