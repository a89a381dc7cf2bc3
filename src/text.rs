//! Text from users that reaches files and scripts. Names (of models, GPUs,
//! cost models) must be printable, so that no line of an output can be
//! broken by one; words bound for a shell are quoted for it; text bound for
//! a script's comment cannot leave the comment.

/// Checks that `value` (the `field` of something) holds no control
/// characters: a newline in a model name would otherwise end a comment
/// line of a launch script and start a command.
pub fn check_printable(field: &str, value: &str) -> Result<(), String> {
    match value.chars().find(|c| c.is_control()) {
        None => Ok(()),
        Some(c) => Err(format!(
            "{field} {:?} holds the control character {:?}; use printable characters only",
            value, c
        )),
    }
}

/// Quotes `word` for a POSIX shell when it holds anything beyond the
/// characters that never need quoting. Inside single quotes nothing is
/// expanded; a single quote is closed, escaped and reopened.
pub fn shell_quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// `text` made safe for the rest of a `#` comment line: every control
/// character (newline, carriage return, escape...) is written as its Rust
/// escape, so the comment cannot end early.
pub fn comment_safe(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_only_where_needed_and_quotes_survive() {
        assert_eq!(shell_quote("--hidden-size"), "--hidden-size");
        assert_eq!(shell_quote("12288"), "12288");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$(touch x)"), "'$(touch x)'");
    }

    #[test]
    fn comments_cannot_be_left_and_names_must_be_printable() {
        assert_eq!(comment_safe("gpt\ntouch pwned\n#"), r"gpt\ntouch pwned\n#");
        assert!(!comment_safe("a\r\u{1b}b").chars().any(char::is_control));
        assert!(check_printable("model name", "gpt3-13b").is_ok());
        let err = check_printable("model name", "gpt\ntouch pwned").unwrap_err();
        assert!(
            err.contains("model name") && err.contains("control"),
            "{err}"
        );
    }
}
