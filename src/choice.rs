//! Named choices and on/off switches read from text (run-table cells,
//! profile tables, flags), with one error shape: the field, what it must
//! be, what was found, and the closest name.

/// The value of `choices` named `text` (case-insensitive).
pub fn parse_choice<T: Copy>(field: &str, text: &str, choices: &[(&str, T)]) -> Result<T, String> {
    let wanted = text.trim().to_lowercase();
    choices
        .iter()
        .find(|(name, _)| *name == wanted)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            format!(
                "`{field}` must be one of {}, found `{text}`{}",
                names.join(", "),
                crate::suggest::closest(&wanted, &names)
                    .map(|n| format!("; did you mean `{n}`?"))
                    .unwrap_or_default()
            )
        })
}

/// `on`/`off` (or true/false, yes/no, 1/0).
pub fn parse_switch(field: &str, text: &str) -> Result<bool, String> {
    match text.trim().to_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("`{field}` must be on or off, found `{text}`")),
    }
}
