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

/// A closed set of named values (a schedule, a recomputation policy, an
/// engine...): every value, and each one's name as flags, run tables and
/// files spell it.
pub trait Choice: Copy + 'static {
    fn all() -> &'static [Self];
    fn name(self) -> &'static str;

    /// The value named `text` (case-insensitive), or the error naming
    /// `field`, the names and the closest one.
    fn parse(field: &str, text: &str) -> Result<Self, String> {
        let named: Vec<(&str, Self)> = Self::all().iter().map(|&v| (v.name(), v)).collect();
        parse_choice(field, text, &named)
    }
}

/// Implements [`Choice`] for enums with a `const ALL` array and a
/// `fn name(self) -> &'static str`.
#[macro_export]
macro_rules! named_choices {
    ($($kind:ty),+ $(,)?) => {
        $(impl $crate::choice::Choice for $kind {
            fn all() -> &'static [Self] {
                &<$kind>::ALL
            }
            fn name(self) -> &'static str {
                <$kind>::name(self)
            }
        })+
    };
}
