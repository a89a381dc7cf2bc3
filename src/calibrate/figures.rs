//! Error figures of a set of predictions against measurements: per dataset
//! and over all rows, with ranking quality inside groups of competing rows.

use super::Row;
use crate::evaluate::{spearman, top1_regret};
use serde::Serialize;
use std::collections::BTreeMap;

/// How far predictions are from measurements over some rows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorFigures {
    pub rows: usize,
    /// Mean absolute relative error, |predicted - measured| / measured.
    pub mape: f64,
    /// Median absolute relative error (nearest rank).
    pub median_ape: f64,
    /// 90th-percentile absolute relative error: the width of the band that
    /// holds nine predictions in ten.
    pub p90_ape: f64,
    /// Dataset and 1-based file line of the row with the largest error.
    pub worst_line: Option<(String, usize)>,
    /// Signed relative error of that row.
    pub worst_error: f64,
    /// Mean Spearman rank correlation over groups of three or more rows
    /// (NaN when there is no such group).
    pub mean_spearman: f64,
    /// Mean and largest top-1 regret over groups of two or more rows (NaN
    /// when there is no such group).
    pub mean_top1_regret: f64,
    pub max_top1_regret: f64,
    /// Groups over which the Spearman mean is taken.
    pub spearman_groups: usize,
    /// Groups over which the regrets are taken.
    pub regret_groups: usize,
}

impl ErrorFigures {
    /// Whether ranking figures exist (some group has two or more rows).
    pub fn has_ranking(&self) -> bool {
        self.regret_groups > 0
    }
}

/// Name of the entry over every dataset's rows, when there are several.
pub const OVERALL: &str = "all";

/// Figures of `predicted` (indexed like `rows`) over the rows in `subset`:
/// one entry per dataset present, in dataset order, and a last entry named
/// [`OVERALL`] when more than one dataset is present. The last entry is
/// always the overall one.
pub fn figures(
    rows: &[Row],
    subset: &[usize],
    predicted: &[f64],
    dataset_names: &[String],
) -> Vec<(String, ErrorFigures)> {
    let mut out = Vec::new();
    for (d, name) in dataset_names.iter().enumerate() {
        let members: Vec<usize> = subset
            .iter()
            .copied()
            .filter(|&i| rows[i].dataset == d)
            .collect();
        if !members.is_empty() {
            out.push((
                name.clone(),
                figures_of(rows, &members, predicted, dataset_names),
            ));
        }
    }
    if out.len() > 1 {
        out.push((
            OVERALL.to_string(),
            figures_of(rows, subset, predicted, dataset_names),
        ));
    }
    out
}

/// Figures of `predicted` over `subset`, grouped by `key` (an order and a
/// label), in key order: the error by tensor-parallel degree, by pipeline
/// depth, by model size.
pub fn breakdown(
    rows: &[Row],
    subset: &[usize],
    predicted: &[f64],
    dataset_names: &[String],
    key: impl Fn(&Row) -> (u64, String),
) -> Vec<(String, ErrorFigures)> {
    let mut groups: BTreeMap<(u64, String), Vec<usize>> = BTreeMap::new();
    for &i in subset {
        groups.entry(key(&rows[i])).or_default().push(i);
    }
    groups
        .into_iter()
        .map(|((_, label), members)| (label, figures_of(rows, &members, predicted, dataset_names)))
        .collect()
}

/// A model's size class by parameter count, for the error by model size.
pub fn size_class(params: f64) -> (u64, String) {
    const CLASSES: [(f64, &str); 4] = [
        (1e9, "under 1B"),
        (10e9, "1B to 10B"),
        (100e9, "10B to 100B"),
        (f64::INFINITY, "100B and more"),
    ];
    let i = CLASSES
        .iter()
        .position(|(upper, _)| params < *upper)
        .unwrap_or(3);
    (i as u64, CLASSES[i].1.to_string())
}

/// The overall entry of a figures list (its last).
pub fn overall(list: &[(String, ErrorFigures)]) -> Option<&ErrorFigures> {
    list.last().map(|(_, f)| f)
}

fn figures_of(
    rows: &[Row],
    members: &[usize],
    predicted: &[f64],
    dataset_names: &[String],
) -> ErrorFigures {
    let relative = |i: usize| (predicted[i] - rows[i].measured) / rows[i].measured;
    let mut ape: Vec<f64> = members.iter().map(|&i| relative(i).abs()).collect();
    let worst = members
        .iter()
        .copied()
        .max_by(|&a, &b| relative(a).abs().total_cmp(&relative(b).abs()));
    ape.sort_by(f64::total_cmp);

    let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for &i in members {
        groups.entry(rows[i].group).or_default().push(i);
    }
    let mut spearmans = Vec::new();
    let mut regrets = Vec::new();
    for members in groups.values().filter(|g| g.len() >= 2) {
        let p: Vec<f64> = members.iter().map(|&i| predicted[i]).collect();
        let m: Vec<f64> = members.iter().map(|&i| rows[i].measured).collect();
        regrets.push(top1_regret(&p, &m));
        if members.len() >= 3 {
            spearmans.push(spearman(&p, &m));
        }
    }
    ErrorFigures {
        rows: members.len(),
        mape: mean(&ape),
        median_ape: nearest_rank(&ape, 0.5),
        p90_ape: nearest_rank(&ape, 0.9),
        worst_line: worst.map(|i| (dataset_names[rows[i].dataset].clone(), rows[i].run.line)),
        worst_error: worst.map(relative).unwrap_or(f64::NAN),
        mean_spearman: mean(&spearmans),
        mean_top1_regret: mean(&regrets),
        max_top1_regret: if regrets.is_empty() {
            f64::NAN
        } else {
            regrets.iter().copied().fold(0.0, f64::max)
        },
        spearman_groups: spearmans.len(),
        regret_groups: regrets.len(),
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index]
}
