//! What a refit changed: the ranking of the same candidates before and
//! after the cost model was fitted to the trials.

use super::{ReportError, format_percent, format_seconds};
use std::collections::HashMap;

/// One candidate's place and predicted time before and after a refit.
#[derive(Debug, Clone, PartialEq)]
pub struct Move {
    pub label: String,
    /// 1-based rank before the refit.
    pub rank_before: usize,
    /// 1-based rank after the refit.
    pub rank_after: usize,
    pub predicted_before_s: f64,
    pub predicted_after_s: f64,
    /// predicted_after / predicted_before − 1.
    pub change_rel: f64,
}

impl Move {
    /// Places gained (positive) or lost (negative).
    pub fn places_gained(&self) -> i64 {
        self.rank_before as i64 - self.rank_after as i64
    }
}

/// How the ranking changed.
#[derive(Debug, Clone, PartialEq)]
pub struct RankingChange {
    /// The first candidate before the refit (`None` for an empty ranking).
    pub winner_before: Option<String>,
    pub winner_after: Option<String>,
    pub winner_changed: bool,
    /// Every candidate ranked both before and after, in the order of the
    /// new ranking (unmoved ones included, with a zero rank change).
    pub moves: Vec<Move>,
    /// Candidates ranked only before the refit (for example no longer
    /// fitting under the refitted memory model), in their old order.
    pub only_before: Vec<String>,
    /// Candidates ranked only after the refit, in their new order.
    pub only_after: Vec<String>,
}

impl RankingChange {
    /// Candidates whose rank changed.
    pub fn moved(&self) -> impl Iterator<Item = &Move> {
        self.moves.iter().filter(|m| m.rank_before != m.rank_after)
    }
}

fn ranks<'a>(
    which: &'static str,
    ranking: &'a [(String, f64)],
) -> Result<HashMap<&'a str, (usize, f64)>, ReportError> {
    let mut map = HashMap::with_capacity(ranking.len());
    for (i, (label, predicted)) in ranking.iter().enumerate() {
        if map.insert(label.as_str(), (i + 1, *predicted)).is_some() {
            return Err(ReportError::DuplicateLabel {
                which,
                label: label.clone(),
            });
        }
    }
    Ok(map)
}

/// Compares two rankings given best first as `(label, predicted seconds)`.
/// Candidates are matched by label; a label given twice in one ranking is
/// an error.
pub fn ranking_change(
    before: &[(String, f64)],
    after: &[(String, f64)],
) -> Result<RankingChange, ReportError> {
    let old = ranks("old", before)?;
    let new = ranks("new", after)?;
    let winner_before = before.first().map(|(l, _)| l.clone());
    let winner_after = after.first().map(|(l, _)| l.clone());
    let moves = after
        .iter()
        .enumerate()
        .filter_map(|(i, (label, predicted_after_s))| {
            let &(rank_before, predicted_before_s) = old.get(label.as_str())?;
            Some(Move {
                label: label.clone(),
                rank_before,
                rank_after: i + 1,
                predicted_before_s,
                predicted_after_s: *predicted_after_s,
                change_rel: predicted_after_s / predicted_before_s - 1.0,
            })
        })
        .collect();
    Ok(RankingChange {
        winner_changed: winner_before != winner_after,
        winner_before,
        winner_after,
        moves,
        only_before: before
            .iter()
            .filter(|(l, _)| !new.contains_key(l.as_str()))
            .map(|(l, _)| l.clone())
            .collect(),
        only_after: after
            .iter()
            .filter(|(l, _)| !old.contains_key(l.as_str()))
            .map(|(l, _)| l.clone())
            .collect(),
    })
}

fn code(label: &str) -> String {
    format!("`{}`", label.replace('`', "'").replace(['\n', '\r'], " "))
}

/// The change in words and a Markdown table of every candidate in the new
/// order.
pub fn render_markdown(change: &RankingChange) -> String {
    let mut out = String::new();
    let predicted = |label: &str| change.moves.iter().find(|m| m.label == label);
    match (&change.winner_before, &change.winner_after) {
        (None, None) => out.push_str("Both rankings are empty.\n"),
        (Some(before), Some(after)) if change.winner_changed => {
            out.push_str(&format!(
                "**The winner changed**: {} before the refit, {} after.\n",
                code(before),
                code(after)
            ));
        }
        (Some(winner), Some(_)) => {
            out.push_str(&format!("The winner stays {}", code(winner)));
            if let Some(m) = predicted(winner) {
                out.push_str(&format!(
                    " (predicted {} → {}, {})",
                    format_seconds(m.predicted_before_s),
                    format_seconds(m.predicted_after_s),
                    format_percent(m.change_rel)
                ));
            }
            out.push_str(".\n");
        }
        (before, after) => out.push_str(&format!(
            "**The winner changed**: {} before the refit, {} after.\n",
            before.as_deref().map_or("none".into(), code),
            after.as_deref().map_or("none".into(), code)
        )),
    }
    let moved = change.moved().count();
    out.push_str(&format!(
        "{moved} of {} candidate(s) changed rank.\n",
        change.moves.len()
    ));
    if !change.moves.is_empty() {
        out.push_str(
            "\n| rank after | rank before | move | candidate | predicted before | predicted after | change |\n\
             |--:|--:|--:|---|--:|--:|--:|\n",
        );
        for m in &change.moves {
            let places = match m.places_gained() {
                0 => "=".to_string(),
                n if n > 0 => format!("▲{n}"),
                n => format!("▼{}", -n),
            };
            out.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                m.rank_after,
                m.rank_before,
                places,
                code(&m.label).replace('|', "\\|"),
                format_seconds(m.predicted_before_s),
                format_seconds(m.predicted_after_s),
                format_percent(m.change_rel)
            ));
        }
    }
    let list = |labels: &[String]| {
        labels
            .iter()
            .map(|l| code(l))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !change.only_before.is_empty() {
        out.push_str(&format!(
            "\nRanked only before the refit: {}.\n",
            list(&change.only_before)
        ));
    }
    if !change.only_after.is_empty() {
        out.push_str(&format!(
            "\nRanked only after the refit: {}.\n",
            list(&change.only_after)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranking(items: &[(&str, f64)]) -> Vec<(String, f64)> {
        items.iter().map(|(l, t)| (l.to_string(), *t)).collect()
    }

    #[test]
    fn a_new_winner_and_the_moves_are_found() {
        let before = ranking(&[("tp2 pp4", 0.40), ("tp4 pp2", 0.42), ("tp8", 0.50)]);
        let after = ranking(&[("tp4 pp2", 0.44), ("tp2 pp4", 0.46), ("tp8", 0.49)]);
        let change = ranking_change(&before, &after).unwrap();
        assert!(change.winner_changed);
        assert_eq!(change.winner_before.as_deref(), Some("tp2 pp4"));
        assert_eq!(change.winner_after.as_deref(), Some("tp4 pp2"));
        assert_eq!(change.moves.len(), 3);
        let first = &change.moves[0];
        assert_eq!(
            (first.label.as_str(), first.rank_before, first.rank_after),
            ("tp4 pp2", 2, 1)
        );
        assert_eq!(first.places_gained(), 1);
        assert!((first.change_rel - (0.44 / 0.42 - 1.0)).abs() < 1e-12);
        assert_eq!(change.moves[1].places_gained(), -1);
        assert_eq!(change.moved().count(), 2);
        assert!(change.only_before.is_empty() && change.only_after.is_empty());

        let md = render_markdown(&change);
        assert!(
            md.contains("**The winner changed**: `tp2 pp4` before the refit, `tp4 pp2` after."),
            "{md}"
        );
        assert!(md.contains("2 of 3 candidate(s) changed rank."), "{md}");
        assert!(
            md.contains("| 1 | 2 | ▲1 | `tp4 pp2` | 420.0 ms | 440.0 ms | +4.8% |"),
            "{md}"
        );
        assert!(md.contains("| 3 | 3 | = | `tp8` |"), "{md}");
    }

    #[test]
    fn a_kept_winner_says_how_its_prediction_moved() {
        let before = ranking(&[("a", 1.0), ("b", 2.0)]);
        let after = ranking(&[("a", 1.1), ("b", 2.0)]);
        let change = ranking_change(&before, &after).unwrap();
        assert!(!change.winner_changed);
        assert_eq!(change.moved().count(), 0);
        let md = render_markdown(&change);
        assert!(
            md.starts_with("The winner stays `a` (predicted 1.000 s → 1.100 s, +10.0%)."),
            "{md}"
        );
    }

    #[test]
    fn candidates_in_one_ranking_only_are_listed_apart() {
        let before = ranking(&[("a", 1.0), ("gone", 1.5), ("b", 2.0)]);
        let after = ranking(&[("new", 0.9), ("a", 1.0), ("b", 2.0)]);
        let change = ranking_change(&before, &after).unwrap();
        assert!(change.winner_changed);
        assert_eq!(change.only_before, ["gone"]);
        assert_eq!(change.only_after, ["new"]);
        let b = change.moves.iter().find(|m| m.label == "b").unwrap();
        assert_eq!((b.rank_before, b.rank_after), (3, 3));
        let md = render_markdown(&change);
        assert!(md.contains("Ranked only before the refit: `gone`."), "{md}");
        assert!(md.contains("Ranked only after the refit: `new`."), "{md}");
    }

    #[test]
    fn empty_rankings_and_repeated_labels() {
        let change = ranking_change(&[], &[]).unwrap();
        assert!(!change.winner_changed && change.moves.is_empty());
        assert!(render_markdown(&change).starts_with("Both rankings are empty."));

        let change = ranking_change(&ranking(&[("a", 1.0)]), &[]).unwrap();
        assert!(change.winner_changed);
        assert!(render_markdown(&change).contains("`a` before the refit, none after"));

        let twice = ranking(&[("a", 1.0), ("a", 2.0)]);
        let err = ranking_change(&twice, &ranking(&[("a", 1.0)])).unwrap_err();
        assert!(
            matches!(err, ReportError::DuplicateLabel { which: "old", .. }),
            "{err}"
        );
    }
}
