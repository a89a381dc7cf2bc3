//! TOML parser errors on one line: the parser's messages span several lines
//! with a source excerpt and carets; users get where and what, and the fix.

/// `invalid TOML at line L, column C (key `k`): <message>; <fix>`. The key
/// is the one the failing line sets, where it sets one; the parser's own
/// messages for an integer beyond 64 bits and a repeated key say so plainly.
pub fn one_line(error: &toml::de::Error, text: &str, fix: &str) -> String {
    let mut message = error
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    let mut place = String::new();
    if let Some(span) = error.span() {
        let start = span.start.min(text.len());
        let before = &text[..start];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
        place = format!(" at line {line}, column {column}");
        let line_text = text.lines().nth(line - 1).unwrap_or("");
        if let Some(key) = key_of(line_text) {
            place.push_str(&format!(" (key `{key}`)"));
        }
    }
    if message.contains("as i128") || message.contains("number too large") {
        message =
            "the integer does not fit in 64 bits (TOML integers go up to 9223372036854775807)"
                .into();
    } else if message.starts_with("duplicate key") {
        message = "the key is set twice; keep one of the lines".into();
    }
    format!("invalid TOML{place}: {message}; {fix}")
}

/// The key a `key = value` line sets (dotted or quoted as written).
fn key_of(line: &str) -> Option<&str> {
    let (key, _) = line.split_once('=')?;
    let key = key.trim();
    (!key.is_empty() && !key.starts_with('#') && !key.starts_with('[')).then_some(key)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_place_and_the_fix_are_on_one_line() {
        let text = "a = 1\nb = = 2\n";
        let error = toml::from_str::<toml::Table>(text).unwrap_err();
        let line = super::one_line(&error, text, "fix the syntax");
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("invalid TOML at line 2"), "{line}");
        assert!(line.ends_with("; fix the syntax"), "{line}");
    }

    #[test]
    fn an_integer_beyond_64_bits_and_a_repeated_key_name_the_key() {
        for (text, key, says) in [
            (
                "a = 1\nlayers = 99999999999999999999\n",
                "`layers`",
                "64 bits",
            ),
            ("layers = 4\nlayers = 8\n", "`layers`", "set twice"),
        ] {
            let error = toml::from_str::<toml::Table>(text).unwrap_err();
            let line = super::one_line(&error, text, "fix it");
            assert!(line.contains(key) && line.contains(says), "{line}");
            assert!(!line.contains('\n'), "{line}");
        }
    }
}
