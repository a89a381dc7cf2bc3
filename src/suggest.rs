//! "Did you mean" suggestions for mistyped names.

/// Levenshtein distance between two strings, by characters.
pub fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// The known name closest to `wanted`, if it is close enough to be a typo.
pub fn closest<'a>(wanted: &str, known: &[&'a str]) -> Option<&'a str> {
    let wanted = wanted.to_lowercase();
    known
        .iter()
        .map(|k| (edit_distance(&wanted, &k.to_lowercase()), *k))
        .filter(|(d, k)| *d <= (k.len() / 2).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// `"; did you mean `x`?"`, or a list of what is known when nothing is close.
pub fn did_you_mean(wanted: &str, known: &[&str]) -> String {
    match closest(wanted, known) {
        Some(k) => format!("; did you mean `{k}`?"),
        None => format!("; known: {}", known.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distances() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }

    #[test]
    fn typos_find_their_name_and_nonsense_lists_all() {
        let known = ["gpt3-175b", "llama3-70b", "llama2-70b"];
        assert_eq!(closest("gpt3-157b", &known), Some("gpt3-175b"));
        assert_eq!(closest("LLAMA3-70B", &known), Some("llama3-70b"));
        assert!(did_you_mean("zzzzzzzzzzzz", &known).contains("known: gpt3-175b"));
    }
}
