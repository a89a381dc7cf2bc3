//! How well the cost model predicts measured runs: error per row, and
//! ranking quality per group of rows that compete for the same job.

mod per_gpu;

pub use per_gpu::{CostModelChoice, PREDICTED_COLUMNS, PerGpu, predicted_rows};

use crate::cluster::NodeGroup;
use crate::coefficients::CostModel;
use crate::cost::{Scenario, predict};
use crate::profile::Measurements;
use crate::runs::Run;
use serde::Serialize;
use std::collections::BTreeMap;

/// Prediction against measurement for one row.
#[derive(Debug, Clone, Serialize)]
pub struct RowError {
    pub line: usize,
    pub group: String,
    pub predicted_s: f64,
    pub measured_s: f64,
    pub kind: RunKind,
    /// The catalogue name of the GPU the run is predicted on.
    pub gpu: String,
    /// The prediction's fits verdict; the run ran, so `false` is wrong.
    pub predicted_fits: bool,
    /// The predicted peak stage's device memory and what the GPU leaves
    /// usable, bytes: how far a wrong verdict is from the line.
    pub predicted_peak_bytes: f64,
    pub allocated_peak_bytes: f64,
    pub usable_bytes: f64,
}

impl RowError {
    /// Signed relative error, (predicted - measured) / measured.
    pub fn relative(&self) -> f64 {
        (self.predicted_s - self.measured_s) / self.measured_s
    }
}

/// Ranking quality within one group.
#[derive(Debug, Clone, Serialize)]
pub struct GroupScore {
    pub group: String,
    pub rows: usize,
    pub spearman: f64,
    /// Measured time of the predicted-best row over the best measured time, minus one.
    pub top1_regret: f64,
}

/// Predicted against measured peak memory for one row, bytes: the rank's
/// the measurement names (the last stage, or the peak over all).
#[derive(Debug, Clone, Serialize)]
pub struct MemoryRowError {
    pub line: usize,
    pub predicted_allocated: f64,
    pub measured_allocated: Option<f64>,
    pub predicted_reserved: f64,
    pub measured_reserved: Option<f64>,
    /// Whether the prediction says it fits the GPU (at the datasheet
    /// capacity, or the memory limit given); the measured run ran, so it did.
    pub predicted_fits: bool,
    pub kind: RunKind,
}

/// What a run exercises beyond a dense model, for figures by kind: the
/// parts of the model that are checked separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunKind {
    Dense,
    ContextParallel,
    /// A mixture of experts (with or without context parallelism).
    Experts,
}

impl RunKind {
    pub fn of(run: &Run) -> RunKind {
        if run.model.moe.is_some() {
            RunKind::Experts
        } else if run.config.cp > 1 {
            RunKind::ContextParallel
        } else {
            RunKind::Dense
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RunKind::Dense => "dense",
            RunKind::ContextParallel => "context-parallel",
            RunKind::Experts => "mixture of experts",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Evaluation {
    pub rows: Vec<RowError>,
    pub groups: Vec<GroupScore>,
    /// Rows with a measured peak memory.
    pub memory: Vec<MemoryRowError>,
}

/// What one run is predicted on: its nodes, the cost model, a profile.
#[derive(Debug, Clone, Copy)]
pub struct Setting<'a> {
    pub group: &'a NodeGroup,
    pub cost: &'a CostModel,
    pub profile: Option<&'a Measurements>,
}

/// Predicts every run that has a measured time. `gpus` per run come from the
/// run; nodes are those of `group`.
pub fn evaluate(runs: &[Run], group: &NodeGroup, cost: &CostModel) -> Evaluation {
    evaluate_with_profile(runs, group, cost, None)
}

/// [`evaluate`] with the cost model using `profile`'s measurements where
/// they cover the case.
pub fn evaluate_with_profile(
    runs: &[Run],
    group: &NodeGroup,
    cost: &CostModel,
    profile: Option<&Measurements>,
) -> Evaluation {
    evaluate_with(runs, |_| Setting {
        group,
        cost,
        profile,
    })
}

/// [`evaluate`] with each run's own setting (runs of several GPUs in one
/// table, each with its nodes and cost model).
pub fn evaluate_with<'a>(runs: &[Run], setting: impl Fn(&Run) -> Setting<'a>) -> Evaluation {
    let mut rows = Vec::new();
    let mut memory = Vec::new();
    for run in runs {
        if run.measured_s.is_none() && run.measured_memory.is_none() {
            continue;
        }
        let Setting {
            group,
            cost,
            profile,
        } = setting(run);
        let scenario = Scenario::new(&run.model, run.global_batch, group, run.gpus, cost)
            .with_profile(profile);
        let prediction = predict(&scenario, &run.config);
        if let Some(measured_s) = run.measured_s {
            rows.push(RowError {
                line: run.line,
                group: run.group_key(),
                predicted_s: prediction.iteration_s,
                measured_s,
                kind: RunKind::of(run),
                gpu: group.gpu.name.clone(),
                predicted_fits: prediction.fits,
                predicted_peak_bytes: prediction.peak_memory_bytes,
                allocated_peak_bytes: prediction.peak_allocated_bytes,
                usable_bytes: prediction.usable_memory_bytes,
            });
        }
        if let Some(measured) = run.measured_memory {
            let (predicted_allocated, predicted_reserved) = prediction.peak_on(measured.rank);
            memory.push(MemoryRowError {
                line: run.line,
                predicted_allocated,
                measured_allocated: measured.allocated,
                predicted_reserved,
                measured_reserved: measured.reserved,
                predicted_fits: prediction.fits,
                kind: RunKind::of(run),
            });
        }
    }
    let mut by_group: BTreeMap<&str, Vec<&RowError>> = BTreeMap::new();
    for row in &rows {
        by_group.entry(row.group.as_str()).or_default().push(row);
    }
    let groups = by_group
        .into_iter()
        .filter(|(_, members)| members.len() >= 2)
        .map(|(name, members)| {
            let predicted: Vec<f64> = members.iter().map(|r| r.predicted_s).collect();
            let measured: Vec<f64> = members.iter().map(|r| r.measured_s).collect();
            GroupScore {
                group: name.to_string(),
                rows: members.len(),
                spearman: spearman(&predicted, &measured),
                top1_regret: top1_regret(&predicted, &measured),
            }
        })
        .collect();
    Evaluation {
        rows,
        groups,
        memory,
    }
}

/// Headline memory figures of an evaluation: relative errors of the
/// allocated and the reserved peaks where measured, and the fits verdicts
/// the measured runs contradict (a run that ran predicted not to fit).
#[derive(Debug, Clone, Serialize)]
pub struct MemorySummary {
    pub rows: usize,
    pub allocated: Option<Figures>,
    pub reserved: Option<Figures>,
    /// Rows predicted not to fit that ran.
    pub wrong_fits: usize,
    pub wrong_fits_lines: Vec<usize>,
    /// The allocated peaks' figures per kind of run, when there are
    /// several kinds.
    pub allocated_by_kind: Vec<(RunKind, Figures)>,
}

/// [`figures_of`] per value of a key (the kind of run, the GPU), when the
/// rows have several.
fn by_key<K: Ord + Clone>(rows: impl Iterator<Item = (K, (usize, f64, f64))>) -> Vec<(K, Figures)> {
    let rows: Vec<(K, (usize, f64, f64))> = rows.collect();
    let mut keys: Vec<K> = rows.iter().map(|r| r.0.clone()).collect();
    keys.sort();
    keys.dedup();
    if keys.len() < 2 {
        return Vec::new();
    }
    keys.into_iter()
        .filter_map(|key| {
            let of_key: Vec<(usize, f64, f64)> =
                rows.iter().filter(|r| r.0 == key).map(|r| r.1).collect();
            figures_of(&of_key).map(|f| (key, f))
        })
        .collect()
}

/// MAPE, median, 90th percentile and worst of relative errors.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub rows: usize,
    pub mape: f64,
    pub median_ape: f64,
    pub p90_ape: f64,
    /// Mean signed relative error: below zero, the model predicts these
    /// rows faster (or smaller) than measured on the whole.
    pub bias: f64,
    pub worst_line: usize,
    /// Signed relative error of the worst row.
    pub worst_error: f64,
}

/// Figures of `(line, predicted, measured)` triples, `None` when empty.
pub fn figures_of(triples: &[(usize, f64, f64)]) -> Option<Figures> {
    let relative: Vec<(usize, f64)> = triples
        .iter()
        .map(|&(line, p, m)| (line, (p - m) / m))
        .collect();
    let (worst_line, worst_error) = relative
        .iter()
        .copied()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))?;
    let mut ape: Vec<f64> = relative.iter().map(|(_, e)| e.abs()).collect();
    ape.sort_by(f64::total_cmp);
    Some(Figures {
        rows: ape.len(),
        mape: mean(&ape),
        median_ape: percentile(&ape, 0.5),
        p90_ape: percentile(&ape, 0.9),
        bias: mean(&relative.iter().map(|(_, e)| *e).collect::<Vec<_>>()),
        worst_line,
        worst_error,
    })
}

impl Evaluation {
    pub fn memory_summary(&self) -> MemorySummary {
        let allocated: Vec<(usize, f64, f64)> = self
            .memory
            .iter()
            .filter_map(|r| {
                r.measured_allocated
                    .map(|m| (r.line, r.predicted_allocated, m))
            })
            .collect();
        let reserved: Vec<(usize, f64, f64)> = self
            .memory
            .iter()
            .filter_map(|r| {
                r.measured_reserved
                    .map(|m| (r.line, r.predicted_reserved, m))
            })
            .collect();
        let wrong: Vec<usize> = self
            .memory
            .iter()
            .filter(|r| !r.predicted_fits)
            .map(|r| r.line)
            .collect();
        let allocated_by_kind = by_key(self.memory.iter().filter_map(|r| {
            r.measured_allocated
                .map(|m| (r.kind, (r.line, r.predicted_allocated, m)))
        }));
        MemorySummary {
            rows: self.memory.len(),
            allocated: figures_of(&allocated),
            reserved: figures_of(&reserved),
            wrong_fits: wrong.len(),
            wrong_fits_lines: wrong,
            allocated_by_kind,
        }
    }
}

impl Evaluation {
    pub fn summary(&self) -> Summary {
        let mut ape: Vec<f64> = self.rows.iter().map(|r| r.relative().abs()).collect();
        let worst = self
            .rows
            .iter()
            .max_by(|a, b| a.relative().abs().total_cmp(&b.relative().abs()))
            .map(|r| (r.line, r.relative()));
        ape.sort_by(f64::total_cmp);
        let ranked: Vec<&GroupScore> = self.groups.iter().filter(|g| g.rows >= 3).collect();
        Summary {
            rows: self.rows.len(),
            mape: mean(&ape),
            median_ape: percentile(&ape, 0.5),
            p90_ape: percentile(&ape, 0.9),
            worst_line: worst.map(|w| w.0),
            worst_error: worst.map(|w| w.1).unwrap_or(0.0),
            by_kind: by_key(
                self.rows
                    .iter()
                    .map(|r| (r.kind, (r.line, r.predicted_s, r.measured_s))),
            ),
            by_gpu: by_key(
                self.rows
                    .iter()
                    .map(|r| (r.gpu.clone(), (r.line, r.predicted_s, r.measured_s))),
            ),
            not_fitting_lines: self
                .rows
                .iter()
                .filter(|r| !r.predicted_fits)
                .map(|r| r.line)
                .collect(),
            groups: ranked.len(),
            mean_spearman: mean(&ranked.iter().map(|g| g.spearman).collect::<Vec<_>>()),
            mean_top1_regret: mean(
                &self
                    .groups
                    .iter()
                    .map(|g| g.top1_regret)
                    .collect::<Vec<_>>(),
            ),
            max_top1_regret: self
                .groups
                .iter()
                .map(|g| g.top1_regret)
                .fold(0.0, f64::max),
        }
    }
}

/// Headline figures of an evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub rows: usize,
    pub mape: f64,
    pub median_ape: f64,
    pub p90_ape: f64,
    pub worst_line: Option<usize>,
    /// Signed relative error of the worst row.
    pub worst_error: f64,
    /// The time figures per kind of run, when there are several kinds.
    pub by_kind: Vec<(RunKind, Figures)>,
    /// The time figures per GPU, when the rows ran on several.
    pub by_gpu: Vec<(String, Figures)>,
    /// Rows with a measured time (so they ran) predicted not to fit.
    pub not_fitting_lines: Vec<usize>,
    /// Groups of three or more rows, over which the Spearman mean is taken.
    pub groups: usize,
    pub mean_spearman: f64,
    pub mean_top1_regret: f64,
    pub max_top1_regret: f64,
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Percentile of sorted values, nearest rank.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let index = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index]
}

/// Ranks from 1, ties sharing their average rank.
fn ranks(xs: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..xs.len()).collect();
    order.sort_by(|&a, &b| xs[a].total_cmp(&xs[b]));
    let mut ranks = vec![0.0; xs.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && xs[order[j + 1]] == xs[order[i]] {
            j += 1;
        }
        let average = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            ranks[k] = average;
        }
        i = j + 1;
    }
    ranks
}

/// Spearman rank correlation: the Pearson correlation of the ranks.
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    let (ra, rb) = (ranks(a), ranks(b));
    let (ma, mb) = (mean(&ra), mean(&rb));
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = ra.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = rb.iter().map(|y| (y - mb).powi(2)).sum();
    if va == 0.0 || vb == 0.0 {
        return 1.0;
    }
    cov / (va * vb).sqrt()
}

/// Measured time of the row predicted fastest, over the fastest measured, minus one.
pub fn top1_regret(predicted: &[f64], measured: &[f64]) -> f64 {
    let chosen = (0..predicted.len())
        .min_by(|&a, &b| predicted[a].total_cmp(&predicted[b]))
        .expect("groups are not empty");
    let best = measured.iter().copied().fold(f64::INFINITY, f64::min);
    measured[chosen] / best - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spearman_of_same_order_is_one_and_of_reversed_is_minus_one() {
        assert!((spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 35.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
    }

    #[test]
    fn figures_split_by_key_only_when_there_are_several_and_keep_the_sign() {
        // Predicted 10% and 30% fast on one GPU, 20% slow on the other.
        let rows = [
            ("b200", (1, 0.9, 1.0)),
            ("b200", (2, 0.7, 1.0)),
            ("h100-sxm", (3, 1.2, 1.0)),
        ];
        let split = by_key(rows.iter().cloned());
        assert_eq!(split.len(), 2);
        let (gpu, b200) = &split[0];
        assert_eq!(*gpu, "b200");
        assert!((b200.mape - 0.2).abs() < 1e-12);
        assert!((b200.bias + 0.2).abs() < 1e-12);
        assert_eq!((b200.worst_line, b200.rows), (2, 2));
        assert!((split[1].1.bias - 0.2).abs() < 1e-12);
        assert!(
            by_key(rows[..2].iter().cloned()).is_empty(),
            "one GPU: no split"
        );
    }

    #[test]
    fn ties_share_ranks() {
        assert_eq!(ranks(&[5.0, 1.0, 5.0]), vec![2.5, 1.0, 2.5]);
    }

    #[test]
    fn regret_is_zero_when_the_predicted_best_is_the_measured_best() {
        assert_eq!(top1_regret(&[1.0, 2.0], &[5.0, 6.0]), 0.0);
        assert!((top1_regret(&[2.0, 1.0], &[5.0, 6.0]) - 0.2).abs() < 1e-12);
    }
}
