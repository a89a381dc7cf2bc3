//! TOML parser errors on one line: the parser's messages span several lines
//! with a source excerpt and carets; users get where and what, and the fix.

/// `invalid TOML at line L, column C: <message>; <fix>`.
pub fn one_line(error: &toml::de::Error, text: &str, fix: &str) -> String {
    let message = error
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    let place = match error.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
            format!(" at line {line}, column {column}")
        }
        None => String::new(),
    };
    format!("invalid TOML{place}: {message}; {fix}")
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
}
