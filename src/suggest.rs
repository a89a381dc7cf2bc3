//! "Did you mean" suggestions for mistyped names.

/// Edit distance between two strings, by characters: insertions, deletions,
/// substitutions, and swaps of two neighbouring characters (`157` for `175`)
/// each count one (optimal string alignment).
pub fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

/// The known name closest to `wanted`, if it is close enough to be a typo;
/// a name that `wanted` begins (`h100` for `h100-sxm`), the first one, before
/// any a few edits away (`h200`).
pub fn closest<'a>(wanted: &str, known: &[&'a str]) -> Option<&'a str> {
    let wanted = wanted.to_lowercase();
    if wanted.len() >= 3
        && let Some(longer) = known.iter().find(|k| k.to_lowercase().starts_with(&wanted))
    {
        return Some(longer);
    }
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
        assert_eq!(edit_distance("gpt3-157b", "gpt3-175b"), 1);
    }

    #[test]
    fn typos_find_their_name_and_nonsense_lists_all() {
        let known = ["gpt3-175b", "llama3-70b", "llama2-70b"];
        assert_eq!(closest("gpt3-157b", &known), Some("gpt3-175b"));
        // A swap beats a name two substitutions away (`gpt-1.7b`).
        assert_eq!(
            closest("gpt3-157b", &["gpt-1.7b", "gpt3-175b"]),
            Some("gpt3-175b")
        );
        assert_eq!(closest("LLAMA3-70B", &known), Some("llama3-70b"));
        // A name cut short finds its longer name before a near one.
        assert_eq!(
            closest("h100", &["a100-80gb", "h100-sxm", "h100-pcie", "h200"]),
            Some("h100-sxm")
        );
        assert!(did_you_mean("zzzzzzzzzzzz", &known).contains("known: gpt3-175b"));
    }
}
