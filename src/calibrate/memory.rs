//! Fitting the memory coefficients to measured peaks: the allocated peak
//! (PyTorch's `max allocated`) informs the bytes around the loss and the
//! kernel workspaces, the reserved peak the caching allocator's
//! fragmentation. Cross-validated like time: group k-fold, every row of a
//! job (same model, GPU, GPU count and batch) in one fold.

use super::fit::{FreeParam, Leg, minimise_loss, model_at, prior_pull, soft_l1};
use super::util::SplitMix64;
use crate::cluster::NodeGroup;
use crate::coefficients::{Coefficients, CostModel};
use crate::cost::{Prediction, Scenario, fragmentation_coefficient, predict};
use crate::evaluate::{Figures, figures_of};
use crate::runs::{MemoryRank, Run};
use std::collections::HashMap;

/// Coefficients a measured allocated peak informs; a reserved peak adds
/// its stage's fragmentation ([`fragmentation_coefficient`]).
pub const ALLOCATED_COEFFICIENTS: [&str; 2] = ["logit_bytes", "workspace_gib"];

/// One measured peak to fit.
#[derive(Debug, Clone, Copy)]
pub struct MemoryRow<'a> {
    pub run: &'a Run,
    pub nodes: &'a NodeGroup,
    pub measured: f64,
    /// The reserved peak (else the allocated one).
    pub reserved: bool,
}

impl MemoryRow<'_> {
    /// The prediction's figure the measurement compares with.
    fn predicted(&self, p: &Prediction) -> f64 {
        let rank = self.run.measured_memory.map_or(MemoryRank::Max, |m| m.rank);
        let (allocated, reserved) = p.peak_on(rank);
        if self.reserved { reserved } else { allocated }
    }

    fn predict(&self, cost: &CostModel) -> f64 {
        let run = self.run;
        let s = Scenario::new(&run.model, run.global_batch, self.nodes, run.gpus, cost);
        self.predicted(&predict(&s, &run.config))
    }

    fn job(&self) -> String {
        self.run.group_key()
    }

    /// The fragmentation coefficient a reserved peak informs: the one of
    /// the measured rank's stage (experts or not); none with expandable
    /// segments, which reserve nothing beyond allocated, nor for an
    /// allocated peak.
    fn fragmentation_informed(&self, cost: &CostModel) -> Option<&'static str> {
        let run = self.run;
        if !self.reserved || run.config.expandable_segments {
            return None;
        }
        let s = Scenario::new(&run.model, run.global_batch, self.nodes, run.gpus, cost);
        let stage = match run.measured_memory.map_or(MemoryRank::Max, |m| m.rank) {
            MemoryRank::First => 0,
            MemoryRank::Last => run.config.pp - 1,
            MemoryRank::Max => predict(&s, &run.config).peak_stage,
        };
        Some(fragmentation_coefficient(&s, &run.config, stage))
    }
}

/// The measured peaks of `runs` on `nodes`, one row per measured figure.
pub fn memory_rows<'a>(runs: &'a [Run], nodes: &'a NodeGroup) -> Vec<MemoryRow<'a>> {
    let mut rows = Vec::new();
    for run in runs {
        let Some(m) = run.measured_memory else {
            continue;
        };
        if let Some(measured) = m.allocated {
            rows.push(MemoryRow {
                run,
                nodes,
                measured,
                reserved: false,
            });
        }
        if let Some(measured) = m.reserved {
            rows.push(MemoryRow {
                run,
                nodes,
                measured,
                reserved: true,
            });
        }
    }
    rows
}

/// A memory fit: the coefficients it moved and its errors on the
/// allocated (or reserved) peaks, in sample and cross-validated, beside
/// the prior's.
#[derive(Debug, Clone)]
pub struct MemoryFit {
    /// (name, prior value, fitted value).
    pub coefficients: Vec<(&'static str, f64, f64)>,
    pub rows: usize,
    pub prior: Option<Figures>,
    pub in_sample: Option<Figures>,
    /// Every row predicted by a fit that did not see its job.
    pub cross_validated: Option<Figures>,
    pub folds: usize,
    /// The fitted model: the prior with the memory coefficients moved.
    pub model: CostModel,
}

/// Fits the memory coefficients the rows inform to their measured peaks
/// (soft-L1 of the log errors, the prior's weak pull), starting from
/// `prior`. `None` without rows.
pub fn fit_memory(
    rows: &[MemoryRow],
    prior: &CostModel,
    folds: usize,
    seed: u64,
) -> Option<MemoryFit> {
    if rows.is_empty() {
        return None;
    }
    let mut names: Vec<&'static str> = ALLOCATED_COEFFICIENTS.to_vec();
    for name in rows.iter().filter_map(|r| r.fragmentation_informed(prior)) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let free: Vec<FreeParam> = names
        .iter()
        .map(|n| FreeParam {
            info: Coefficients::info(n).expect("memory coefficients exist"),
        })
        .collect();
    let z0: Vec<f64> = free
        .iter()
        .map(|p| p.z(prior.coefficients.get(p.info.name).unwrap_or(p.info.prior)))
        .collect();
    let legs = [
        Leg {
            step: 1.0,
            iters: 200,
        },
        Leg {
            step: 0.2,
            iters: 200,
        },
    ];
    let fit_on = |members: &[usize]| -> Vec<f64> {
        let loss = |z: &[f64]| {
            if z.iter().any(|v| !v.is_finite()) {
                return f64::MAX;
            }
            let model = model_at(prior, &free, z);
            let data: f64 = members
                .iter()
                .map(|&i| {
                    let r = (rows[i].predict(&model) / rows[i].measured).ln();
                    soft_l1(if r.is_finite() { r } else { 10.0 })
                })
                .sum::<f64>()
                / members.len().max(1) as f64;
            data + prior_pull(z, &z0)
        };
        minimise_loss(&loss, &z0, &legs).0
    };
    let all: Vec<usize> = (0..rows.len()).collect();
    let z = fit_on(&all);
    let mut fitted = model_at(prior, &free, &z);
    crate::coefficients::mark_informed(&mut fitted.provenance, free.iter().map(|p| p.info.name));
    let figures = |model: &CostModel, members: &[usize]| {
        let triples: Vec<(usize, f64, f64)> = members
            .iter()
            .map(|&i| (rows[i].run.line, rows[i].predict(model), rows[i].measured))
            .collect();
        figures_of(&triples)
    };
    // Group k-fold over jobs.
    let mut jobs: Vec<String> = rows.iter().map(MemoryRow::job).collect();
    jobs.sort();
    jobs.dedup();
    let k = folds.min(jobs.len());
    let cross_validated = if k >= 2 {
        let mut rng = SplitMix64::stream(seed, 3);
        rng.shuffle(&mut jobs);
        let fold_of: HashMap<&str, usize> = jobs
            .iter()
            .enumerate()
            .map(|(i, j)| (j.as_str(), i % k))
            .collect();
        let mut triples = Vec::with_capacity(rows.len());
        for fold in 0..k {
            let (held, train): (Vec<usize>, Vec<usize>) = all
                .iter()
                .partition(|&&i| fold_of[rows[i].job().as_str()] == fold);
            let model = model_at(prior, &free, &fit_on(&train));
            triples.extend(
                held.iter()
                    .map(|&i| (rows[i].run.line, rows[i].predict(&model), rows[i].measured)),
            );
        }
        figures_of(&triples)
    } else {
        None
    };
    Some(MemoryFit {
        coefficients: free
            .iter()
            .map(|p| {
                (
                    p.info.name,
                    prior.coefficients.get(p.info.name).unwrap_or(p.info.prior),
                    fitted.coefficients.get(p.info.name).unwrap_or(p.info.prior),
                )
            })
            .collect(),
        rows: rows.len(),
        prior: figures(prior, &all),
        in_sample: figures(&fitted, &all),
        cross_validated,
        folds: if k >= 2 { k } else { 0 },
        model: fitted,
    })
}
