//! Calibration: fit the cost model's coefficients to measured runs.
//!
//! The loss is the pseudo-Huber (soft-L1) of the log error
//! `ln(predicted / measured)`, each dataset's mean weighted equally (ten
//! multi-node rows count as much as a thousand single-node ones), plus a weak
//! pull toward the prior in the reparameterised space. Every free coefficient
//! moves inside its physical range through `min + (max - min) * sigmoid(z)`,
//! and Nelder-Mead (argmin) minimises over `z` with restarts.
//!
//! Before fitting, a sensitivity screen keeps at their prior the coefficients
//! that the rows cannot inform (inter-node efficiency from single-node runs,
//! memory accounting from times). Group k-fold cross-validation (rows of one
//! job stay together), an optional seeded hold-out split and a row bootstrap
//! give honest error figures and 95% intervals. Everything is deterministic
//! for a given seed.

mod collectives;
mod figures;
mod fit;
mod memory;
mod pipeline;
mod report;
pub mod tokens;
mod util;

#[cfg(test)]
mod tests;

pub use collectives::{
    COLLECTIVE_COEFFICIENTS, CollectiveFit, CollectiveSample, fit_collectives, read_nccl_table,
};
pub use figures::{ErrorFigures, OVERALL, overall};
/// The fitting pieces other refits (`validate`'s stage-time refit) share.
pub(crate) use fit::{FreeParam, Leg, minimise_loss, model_at, prior_pull, soft_l1};
pub use memory::{MemoryFit, MemoryRow, fit_memory, memory_rows};
pub use pipeline::{CollectivesFirst, FittedModel, fit_cost_model};
pub use report::render_report;

use crate::cluster::NodeGroup;
use crate::coefficients::{CoefficientInfo, Coefficients, CostModel};
use crate::config::OptimizerSharding;
use crate::cost::{Scenario, predict};
use crate::model::AttentionKind;
use crate::runs::Run;
use fit::{Problem, dataset_weights, predict_row};
use rayon::prelude::*;
use statrs::statistics::{Data, OrderStatistics};
use std::collections::{BTreeMap, HashMap};
use util::{Fnv1a, SplitMix64};

/// Measured runs on one kind of node.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Short name for reports and provenance (e.g. the file stem).
    pub name: String,
    /// Rows without a measured time are ignored.
    pub runs: Vec<Run>,
    pub group: NodeGroup,
}

/// What to fit and how to check it.
#[derive(Debug, Clone, PartialEq)]
pub struct FitOptions {
    /// Coefficients to fit; `None` fits every one the data informs (except
    /// memory accounting, which time measurements cannot calibrate).
    pub free: Option<Vec<String>>,
    pub seed: u64,
    /// Cross-validation folds; fewer than 2 skips cross-validation.
    pub folds: usize,
    /// Bootstrap refits for the 95% intervals; 0 skips them.
    pub bootstrap: usize,
    /// Fraction of rows (per dataset) held out of everything, e.g. 0.3.
    pub holdout: Option<f64>,
    /// Coefficients measured separately (e.g. collective coefficients fitted
    /// to nccl-tests curves by [`fit_collectives`]): they keep the prior's
    /// value whatever `free` says.
    pub pinned: Vec<String>,
    /// Nelder-Mead iterations per leg of a fit (a fit runs three legs;
    /// bootstrap refits start from the fit and run one shorter leg).
    pub max_iters: u64,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            free: None,
            seed: 1,
            folds: 5,
            bootstrap: 20,
            holdout: None,
            pinned: Vec::new(),
            max_iters: 1500,
        }
    }
}

/// What the calibration did with one coefficient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitStatus {
    Fitted,
    /// The rows' predicted times barely depend on it; it keeps its prior.
    NotInformed,
    /// Held at its prior by choice: not in the fit list, or (without a fit
    /// list) memory accounting that also changes predicted times.
    Fixed,
}

impl FitStatus {
    pub fn name(self) -> &'static str {
        match self {
            FitStatus::Fitted => "fitted",
            FitStatus::NotInformed => "not informed",
            FitStatus::Fixed => "fixed",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct CoefficientFit {
    pub name: &'static str,
    pub unit: &'static str,
    pub prior: f64,
    pub value: f64,
    /// Bootstrap 95% percentile interval (fitted coefficients only).
    pub ci95: Option<(f64, f64)>,
    pub status: FitStatus,
    /// Mean |change of ln predicted time| when the coefficient moves by
    /// ±0.5 in the reparameterised space (largest over datasets); `None`
    /// when not measured (not in the fit list).
    pub sensitivity: Option<f64>,
    /// Why it is not fitted, or a remark on the fit.
    pub note: String,
}

/// One dataset's part in a calibration.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetSummary {
    pub name: String,
    /// Rows fitted on.
    pub rows: usize,
    pub held_out: usize,
    /// Groups of rows competing for the same job (see `Run::group_key`).
    pub groups: usize,
    pub cluster: String,
}

#[derive(Debug, Clone)]
pub struct Calibration {
    /// The fitted cost model, provenance included.
    pub model: CostModel,
    /// Every coefficient, in the order of `Coefficients::INFO`.
    pub coefficients: Vec<CoefficientFit>,
    /// Figures lists hold one entry per dataset and, with several datasets,
    /// a last entry named [`OVERALL`] over all rows.
    pub prior_in_sample: Vec<(String, ErrorFigures)>,
    pub in_sample: Vec<(String, ErrorFigures)>,
    /// The prior on the same rows as `cross_validated` (equal to
    /// `prior_in_sample`: the prior is fitted to nothing).
    pub prior_cross_validated: Vec<(String, ErrorFigures)>,
    /// Out-of-fold predictions of group k-fold; empty when skipped.
    pub cross_validated: Vec<(String, ErrorFigures)>,
    /// The same out-of-fold predictions over all datasets, by tensor-parallel
    /// degree, by pipeline depth and by model size: `("tp", [("1", ..), ..])`.
    pub cross_validated_by: Vec<(&'static str, Vec<(String, ErrorFigures)>)>,
    /// The prior and the fit on held-out rows, with `FitOptions::holdout`.
    pub prior_holdout: Option<Vec<(String, ErrorFigures)>>,
    pub holdout: Option<Vec<(String, ErrorFigures)>>,
    /// FNV-1a 64 of every row's configuration and measured time, hex.
    pub data_hash: String,
    /// Rows fitted on (held-out rows excluded).
    pub rows: usize,
    pub datasets: Vec<DatasetSummary>,
    /// Folds actually used (0: cross-validation skipped).
    pub folds: usize,
    /// Bootstrap refits done.
    pub bootstrap: usize,
    pub seed: u64,
    /// Loss of the prior and of the fit on the fitted rows.
    pub loss_prior: f64,
    pub loss_fitted: f64,
    /// Remarks for the report (skipped checks and why).
    pub notes: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error("no datasets to calibrate on")]
    NoDatasets,
    #[error("dataset `{dataset}` has no row with a measured time (iter_ms or tflops_per_gpu)")]
    NoMeasuredRows { dataset: String },
    #[error(
        "{rows} measured runs cannot fit {free} free coefficients; give at least {needed} runs, \
         or fit fewer coefficients"
    )]
    TooFewRuns {
        rows: usize,
        free: usize,
        needed: usize,
    },
    #[error("unknown coefficient `{name}`{suggestion}")]
    UnknownCoefficient { name: String, suggestion: String },
    #[error("nothing to fit: {reason}")]
    NothingToFit { reason: String },
    #[error("invalid calibration option: {0}")]
    InvalidOption(String),
}

/// Sensitivity below which a coefficient counts as not informed.
pub const SENSITIVITY_THRESHOLD: f64 = 1e-3;

/// Move in the reparameterised space for the sensitivity screen.
const SCREEN_STEP: f64 = 0.5;

/// One measured row, understood.
pub(crate) struct Row<'a> {
    pub dataset: usize,
    pub run: &'a Run,
    pub nodes: &'a NodeGroup,
    pub measured: f64,
    /// Index of its (dataset, group key).
    pub group: usize,
}

/// What the runs exercise, for explaining why a coefficient is not informed.
struct Facts {
    multi_node: bool,
    flash: bool,
    standard: bool,
    bpipe: bool,
    zero3: bool,
    pipeline: bool,
    data_parallel: bool,
    tensor_parallel: bool,
    offload: bool,
}

impl Facts {
    fn of(rows: &[Row], subset: &[usize]) -> Facts {
        let any = |f: &dyn Fn(&Row) -> bool| subset.iter().any(|&i| f(&rows[i]));
        Facts {
            multi_node: any(&|r| r.run.gpus > r.nodes.gpus_per_node),
            flash: any(&|r| r.run.config.attention == AttentionKind::Flash),
            standard: any(&|r| r.run.config.attention == AttentionKind::Standard),
            bpipe: any(&|r| r.run.config.bpipe),
            zero3: any(&|r| r.run.config.optimizer_sharding == OptimizerSharding::Full),
            pipeline: any(&|r| r.run.config.pp > 1),
            data_parallel: any(&|r| r.run.config.dp > 1),
            tensor_parallel: any(&|r| r.run.config.tp > 1),
            offload: any(&|r| r.run.config.cpu_offload_layers > 0),
        }
    }

    /// A mechanism the runs do not exercise that explains a coefficient's
    /// silence (for the report only; the screen itself is by measurement).
    fn absent_mechanism(&self, name: &str) -> Option<&'static str> {
        let absent = |present: bool, why: &'static str| (!present).then_some(why);
        match name {
            "inter_node_efficiency" => absent(
                self.multi_node,
                "every run fits in one node, so no collective crosses the inter-node network",
            ),
            "attention_efficiency_flash" | "attention_row_half" => {
                absent(self.flash, "no run uses flash attention")
            }
            "attention_efficiency_standard" => {
                absent(self.standard, "no run uses standard (unfused) attention")
            }
            "bpipe_overlap" => absent(self.bpipe, "no run uses BPipe"),
            "host_copy_efficiency" => {
                absent(self.offload, "no run offloads activations to the CPU")
            }
            "zero3_prefetch_overlap" => {
                absent(self.zero3, "no run shards parameters (ZeRO-3/FSDP)")
            }
            "p2p_latency_us" => absent(self.pipeline, "no run uses pipeline parallelism"),
            "dp_overlap" => absent(self.data_parallel, "no run uses data parallelism"),
            "host_sync_us_per_rank" => {
                absent(self.tensor_parallel, "no run uses tensor parallelism")
            }
            _ => None,
        }
    }
}

/// A bootstrap sample of the fitted rows: as many draws with replacement
/// per dataset as it has rows, as (row, times drawn).
fn resample(
    rows: &[Row],
    train: &[usize],
    datasets: usize,
    rng: &mut SplitMix64,
) -> Vec<(usize, u32)> {
    let mut counts: BTreeMap<usize, u32> = BTreeMap::new();
    for d in 0..datasets {
        let members: Vec<usize> = train
            .iter()
            .copied()
            .filter(|&i| rows[i].dataset == d)
            .collect();
        for _ in 0..members.len() {
            *counts.entry(members[rng.below(members.len())]).or_default() += 1;
        }
    }
    counts.into_iter().collect()
}

/// Writes the fitted values, their bootstrap intervals and a note where a
/// value was pushed against its range into `coefficients`.
fn record_fit(
    coefficients: &mut [CoefficientFit],
    free: &[FreeParam],
    z_fit: &[f64],
    boots: &[Vec<f64>],
) {
    for (j, p) in free.iter().enumerate() {
        let c = coefficients
            .iter_mut()
            .find(|c| c.name == p.info.name)
            .expect("listed");
        c.value = p.value(z_fit[j]);
        if boots.len() >= 2 {
            let mut data = Data::new(boots.iter().map(|z| p.value(z[j])).collect::<Vec<_>>());
            c.ci95 = Some((data.quantile(0.025), data.quantile(0.975)));
        }
        // Pushed against a bound: within 2% of the way from the prior to it.
        let (lo, hi) = (p.info.min, p.info.max);
        if (c.value < c.prior && c.value - lo <= 0.02 * (c.prior - lo))
            || (c.value > c.prior && hi - c.value <= 0.02 * (hi - c.prior))
        {
            c.note = format!(
                "pushed against the edge of its range [{lo}, {hi}]: the data wants it further \
             than the range allows, a sign that some other part of the model is missing"
            );
        }
    }
}

/// The datasets and options a calibration can run on: at least one
/// dataset, each with its own name, and options in their ranges.
fn check_inputs(datasets: &[Dataset], opts: &FitOptions) -> Result<(), CalibrateError> {
    if datasets.is_empty() {
        return Err(CalibrateError::NoDatasets);
    }
    if let Some(h) = opts.holdout
        && !(h > 0.0 && h < 1.0)
    {
        return Err(CalibrateError::InvalidOption(format!(
            "the hold-out fraction must be between 0 and 1 (exclusive), found {h}"
        )));
    }
    if opts.max_iters == 0 {
        return Err(CalibrateError::InvalidOption(
            "max_iters must be at least 1".into(),
        ));
    }
    for (i, d) in datasets.iter().enumerate() {
        if d.name == OVERALL || datasets[..i].iter().any(|e| e.name == d.name) {
            return Err(CalibrateError::InvalidOption(format!(
                "dataset name `{}` is {}; give every dataset its own name",
                d.name,
                if d.name == OVERALL {
                    "reserved for the figures over all rows"
                } else {
                    "used twice"
                }
            )));
        }
    }
    Ok(())
}

/// Every row with a measured time, numbered by (dataset, job) group, and a
/// hash of what was fitted to (for the provenance).
fn measured_rows(datasets: &[Dataset]) -> Result<(Vec<Row<'_>>, String), CalibrateError> {
    let mut rows = Vec::new();
    let mut group_ids: HashMap<(usize, String), usize> = HashMap::new();
    let mut hash = Fnv1a::default();
    for (d, dataset) in datasets.iter().enumerate() {
        hash.write_str(&dataset.name);
        let before = rows.len();
        for run in &dataset.runs {
            let Some(measured) = run.measured_s.filter(|m| m.is_finite() && *m > 0.0) else {
                continue;
            };
            let next = group_ids.len();
            let group = *group_ids.entry((d, run.group_key())).or_insert(next);
            hash.write_u64(run.line as u64);
            hash.write_str(&run.group_key());
            hash.write_str(&format!("{:?}", run.config));
            hash.write_u64(measured.to_bits());
            rows.push(Row {
                dataset: d,
                run,
                nodes: &dataset.group,
                measured,
                group,
            });
        }
        if rows.len() == before {
            return Err(CalibrateError::NoMeasuredRows {
                dataset: dataset.name.clone(),
            });
        }
    }

    Ok((rows, hash.hex()))
}

/// Fits `prior`'s coefficients to the measured rows of `datasets` and returns
/// the fitted model (named `name`) with its error figures.
pub fn calibrate(
    datasets: &[Dataset],
    prior: &CostModel,
    name: &str,
    opts: &FitOptions,
) -> Result<Calibration, CalibrateError> {
    check_inputs(datasets, opts)?;
    let candidates = candidate_names(opts)?;

    let names: Vec<String> = datasets.iter().map(|d| d.name.clone()).collect();
    let (rows, data_hash) = measured_rows(datasets)?;

    // Hold-out split, per dataset.
    let (train, held) = match opts.holdout {
        None => ((0..rows.len()).collect::<Vec<_>>(), Vec::new()),
        Some(fraction) => holdout_split(&rows, datasets.len(), fraction, opts.seed),
    };

    // The prior, exactly as given, on every row.
    let mut template = prior.clone();
    template.provenance.clear();
    let prior_pred: Vec<f64> = rows.par_iter().map(|r| predict_row(r, prior)).collect();

    // Sensitivity screen on the fitted rows.
    let facts = Facts::of(&rows, &train);
    let screened = screen(
        &rows,
        &train,
        datasets.len(),
        prior,
        &prior_pred,
        &candidates,
    );
    let (mut coefficients, free) = free_coefficients(prior, &screened, &facts, opts)?;
    if train.len() < free.len() {
        return Err(CalibrateError::TooFewRuns {
            rows: train.len(),
            free: free.len(),
            needed: free.len(),
        });
    }
    let z0: Vec<f64> = free
        .iter()
        .map(|p| p.z(prior.coefficients.get(p.info.name).expect("known")))
        .collect();

    // Folds: group k-fold over the fitted rows.
    let mut notes = Vec::new();
    let fold_of = group_folds(&rows, &train, datasets.len(), opts.folds, opts.seed);
    let folds = fold_of.as_ref().map_or(0, |(k, _)| *k);
    if opts.folds >= 2 && folds < opts.folds {
        notes.push(if folds == 0 {
            "cross-validation skipped: fewer than two groups of rows".to_string()
        } else {
            format!(
                "cross-validation uses {folds} folds, not {}: there are only {folds} groups of rows",
                opts.folds
            )
        });
    }

    let problem_on = |counts: Vec<(usize, u32)>| Problem {
        rows: &rows,
        active: dataset_weights(&rows, &counts),
        free: &free,
        template: &template,
        z0: &z0,
    };
    let full_legs = [
        Leg {
            step: 1.0,
            iters: opts.max_iters,
        },
        Leg {
            step: 0.3,
            iters: opts.max_iters,
        },
        Leg {
            step: 0.1,
            iters: opts.max_iters,
        },
    ];

    // The full fit and the fold fits are independent: run them together.
    let jobs: Vec<Option<usize>> = std::iter::once(None).chain((0..folds).map(Some)).collect();
    let results: Vec<(Vec<f64>, f64)> = jobs
        .par_iter()
        .map(|job| {
            let counts: Vec<(usize, u32)> = match (job, &fold_of) {
                (Some(k), Some((_, of))) => train
                    .iter()
                    .filter(|&&i| of[i] != *k)
                    .map(|&i| (i, 1))
                    .collect(),
                _ => train.iter().map(|&i| (i, 1)).collect(),
            };
            fit::minimise(&problem_on(counts), &z0, &full_legs)
        })
        .collect();
    let (z_fit, loss_fitted) = results[0].clone();
    let full_problem = problem_on(train.iter().map(|&i| (i, 1)).collect());
    let loss_prior = full_problem.loss(&z0);
    let fitted = full_problem.model(&z_fit);

    let (cross_validated, cross_validated_by) = match &fold_of {
        Some((_, of)) => {
            out_of_fold_figures(&rows, &train, of, &results[1..], &full_problem, &names)
        }
        None => (Vec::new(), Vec::new()),
    };

    // Bootstrap: resample rows per dataset, refit from the fit.
    let boot_legs = [Leg {
        step: 0.2,
        iters: (opts.max_iters / 2).max(1),
    }];
    let boots: Vec<Vec<f64>> = (0..opts.bootstrap)
        .into_par_iter()
        .map(|b| {
            let mut rng = SplitMix64::stream(opts.seed, 1000 + b as u64);
            let counts = resample(&rows, &train, datasets.len(), &mut rng);
            fit::minimise(&problem_on(counts), &z_fit, &boot_legs).0
        })
        .collect();

    record_fit(&mut coefficients, &free, &z_fit, &boots);
    if opts.bootstrap == 1 {
        notes.push("one bootstrap refit gives no interval; ask for two or more".into());
    }

    // Figures.
    let fit_pred: Vec<f64> = rows.par_iter().map(|r| predict_row(r, &fitted)).collect();
    let prior_in_sample = figures::figures(&rows, &train, &prior_pred, &names);
    let in_sample = figures::figures(&rows, &train, &fit_pred, &names);
    let prior_cross_validated = if cross_validated.is_empty() {
        Vec::new()
    } else {
        prior_in_sample.clone()
    };
    let (prior_holdout, holdout) = if opts.holdout.is_some() {
        (
            Some(figures::figures(&rows, &held, &prior_pred, &names)),
            Some(figures::figures(&rows, &held, &fit_pred, &names)),
        )
    } else {
        (None, None)
    };
    if cross_validated
        .iter()
        .any(|(n, f)| n != OVERALL && !f.has_ranking())
    {
        notes.push(
            "ranking figures (Spearman, top-1 regret) need groups of rows that compete for the \
             same job; datasets whose groups have one row each have none"
                .into(),
        );
    }

    let summaries = dataset_summaries(datasets, &rows, &train, &held);

    let mut calibration = Calibration {
        model: CostModel {
            name: name.to_string(),
            description: format!(
                "{} calibrated on {} measured runs ({})",
                prior.name,
                train.len(),
                names.join(", ")
            ),
            coefficients: fitted.coefficients,
            collective: prior.collective,
            provenance: BTreeMap::new(),
        },
        coefficients,
        prior_in_sample,
        in_sample,
        prior_cross_validated,
        cross_validated,
        cross_validated_by,
        prior_holdout,
        holdout,
        data_hash,
        rows: train.len(),
        datasets: summaries,
        folds,
        bootstrap: boots.len(),
        seed: opts.seed,
        loss_prior,
        loss_fitted,
        notes,
    };
    calibration.model.provenance = report::provenance(&calibration, datasets, prior, opts);
    Ok(calibration)
}

/// Every coefficient's row of the report, and the ones the fit moves:
/// those the screen found the rows inform, except memory accounting
/// unless named, and pinned ones.
fn free_coefficients(
    prior: &CostModel,
    screened: &HashMap<&'static str, Sensitivity>,
    facts: &Facts,
    opts: &FitOptions,
) -> Result<(Vec<CoefficientFit>, Vec<FreeParam>), CalibrateError> {
    let mut coefficients = Vec::new();
    let mut free = Vec::new();
    for info in Coefficients::INFO {
        let value = prior.coefficients.get(info.name).expect("known");
        let mut fit = CoefficientFit {
            name: info.name,
            unit: info.unit,
            prior: value,
            value,
            ci95: None,
            status: FitStatus::Fixed,
            sensitivity: None,
            note: String::new(),
        };
        if let Some(s) = screened.get(info.name) {
            fit.sensitivity = Some(s.time);
            if s.time < SENSITIVITY_THRESHOLD {
                fit.status = FitStatus::NotInformed;
                fit.note = not_informed_note(info, value, s, facts);
            } else if s.memory && opts.free.is_none() {
                fit.note = "memory accounting that also sets predicted memory; time measurements \
                            cannot calibrate it without corrupting memory predictions (name it \
                            in the fit list to fit it anyway)"
                    .into();
            } else {
                fit.status = FitStatus::Fitted;
                free.push(FreeParam { info });
            }
        } else if opts.pinned.iter().any(|p| p == info.name) {
            fit.note = "pinned to a separate measurement (see provenance)".into();
        } else {
            fit.note = "not in the fit list".into();
        }
        coefficients.push(fit);
    }
    if free.is_empty() {
        let silent: Vec<&str> = coefficients
            .iter()
            .filter(|c| c.status == FitStatus::NotInformed)
            .map(|c| c.name)
            .collect();
        return Err(CalibrateError::NothingToFit {
            reason: if silent.is_empty() {
                "no coefficient is free".into()
            } else {
                format!(
                    "the rows do not inform {} (predicted times barely depend on them)",
                    silent.join(", ")
                )
            },
        });
    }
    Ok((coefficients, free))
}

/// Error figures per dataset (and overall), as the report lists them.
type FigureList = Vec<(String, ErrorFigures)>;

/// The cross-validated figures from the fold fits' out-of-fold
/// predictions, overall and by tp, pp and model size.
fn out_of_fold_figures(
    rows: &[Row],
    train: &[usize],
    fold_of: &[usize],
    fold_fits: &[(Vec<f64>, f64)],
    problem: &Problem,
    names: &[String],
) -> (FigureList, Vec<(&'static str, FigureList)>) {
    let mut oof = vec![f64::NAN; rows.len()];
    for (k, (z, _)) in fold_fits.iter().enumerate() {
        let model = problem.model(z);
        for &i in train.iter().filter(|&&i| fold_of[i] == k) {
            oof[i] = predict_row(&rows[i], &model);
        }
    }
    let by = |key: fn(&Row) -> (u64, String)| figures::breakdown(rows, train, &oof, names, key);
    let by_shape = vec![
        (
            "tp",
            by(|r| (r.run.config.tp, format!("tp {}", r.run.config.tp))),
        ),
        (
            "pp",
            by(|r| (r.run.config.pp, format!("pp {}", r.run.config.pp))),
        ),
        (
            "model size",
            by(|r| figures::size_class(r.run.model.total_params())),
        ),
    ];
    (figures::figures(rows, train, &oof, names), by_shape)
}

/// Each dataset's fitted and held-out rows and its groups.
fn dataset_summaries(
    datasets: &[Dataset],
    rows: &[Row],
    train: &[usize],
    held: &[usize],
) -> Vec<DatasetSummary> {
    datasets
        .iter()
        .enumerate()
        .map(|(d, dataset)| {
            let in_d = |i: &&usize| rows[**i].dataset == d;
            let mut groups: Vec<usize> =
                train.iter().filter(in_d).map(|&i| rows[i].group).collect();
            groups.sort_unstable();
            groups.dedup();
            DatasetSummary {
                name: dataset.name.clone(),
                rows: train.iter().filter(in_d).count(),
                held_out: held.iter().filter(in_d).count(),
                groups: groups.len(),
                cluster: describe_nodes(&dataset.group),
            }
        })
        .collect()
}

/// Names the fit may move: the fit list (checked) or every coefficient.
fn candidate_names(opts: &FitOptions) -> Result<Vec<&'static str>, CalibrateError> {
    let known: Vec<&'static str> = Coefficients::INFO.iter().map(|i| i.name).collect();
    let pinned = |name: &str| opts.pinned.iter().any(|p| p == name);
    match &opts.free {
        None => Ok(known.iter().copied().filter(|k| !pinned(k)).collect()),
        Some(list) => {
            let mut out = Vec::new();
            for wanted in list {
                let wanted = wanted.trim();
                match known.iter().find(|k| **k == wanted) {
                    Some(k) => {
                        if !out.contains(k) && !pinned(k) {
                            out.push(*k);
                        }
                    }
                    None => {
                        return Err(CalibrateError::UnknownCoefficient {
                            name: wanted.to_string(),
                            suggestion: crate::suggest::did_you_mean(wanted, &known),
                        });
                    }
                }
            }
            if out.is_empty() {
                return Err(CalibrateError::NothingToFit {
                    reason: "the fit list is empty".into(),
                });
            }
            Ok(out)
        }
    }
}

struct Sensitivity {
    /// Largest over datasets of the mean |Δ ln predicted time|.
    time: f64,
    /// Whether it changes any row's predicted memory.
    memory: bool,
}

/// How much each candidate moves the predictions when its reparameterised
/// value moves by ±[`SCREEN_STEP`] from the prior.
fn screen(
    rows: &[Row],
    subset: &[usize],
    datasets: usize,
    prior: &CostModel,
    prior_pred: &[f64],
    candidates: &[&'static str],
) -> HashMap<&'static str, Sensitivity> {
    let prior_memory: Vec<(f64, f64)> = subset
        .iter()
        .map(|&i| {
            let p = predict_full(&rows[i], prior);
            (p.peak_memory_bytes, p.usable_memory_bytes)
        })
        .collect();
    candidates
        .par_iter()
        .map(|&name| {
            let info = Coefficients::info(name).expect("known");
            let param = FreeParam { info };
            let z = param.z(prior.coefficients.get(name).expect("known"));
            let mut time: f64 = 0.0;
            let mut memory = false;
            for dz in [SCREEN_STEP, -SCREEN_STEP] {
                let mut model = prior.clone();
                model.coefficients.set(name, param.value(z + dz));
                let mut sum = vec![0.0; datasets];
                let mut count = vec![0usize; datasets];
                for (k, &i) in subset.iter().enumerate() {
                    let p = predict_full(&rows[i], &model);
                    let d = rows[i].dataset;
                    let change = (p.iteration_s / prior_pred[i]).ln().abs();
                    sum[d] += if change.is_finite() { change } else { 1.0 };
                    count[d] += 1;
                    let (peak, usable) = prior_memory[k];
                    if (p.peak_memory_bytes / peak - 1.0).abs() > 1e-12
                        || (p.usable_memory_bytes / usable - 1.0).abs() > 1e-12
                    {
                        memory = true;
                    }
                }
                for d in 0..datasets {
                    if count[d] > 0 {
                        time = time.max(sum[d] / count[d] as f64);
                    }
                }
            }
            (name, Sensitivity { time, memory })
        })
        .collect()
}

fn predict_full(row: &Row, cost: &CostModel) -> crate::cost::Prediction {
    let run = row.run;
    let scenario = Scenario::new(&run.model, run.global_batch, row.nodes, run.gpus, cost);
    predict(&scenario, &run.config)
}

fn not_informed_note(info: &CoefficientInfo, value: f64, s: &Sensitivity, facts: &Facts) -> String {
    if let Some(why) = facts.absent_mechanism(info.name) {
        return format!("{why}; keeps its prior");
    }
    if s.time == 0.0 {
        return if s.memory {
            "memory accounting: it changes predicted memory, never predicted time; keeps its prior"
                .into()
        } else {
            "no row's predicted time depends on it; keeps its prior".into()
        };
    }
    let range = info.max - info.min;
    let at_edge =
        (value - info.min).abs() < 0.01 * range || (info.max - value).abs() < 0.01 * range;
    format!(
        "moves predicted times by only {:.1e} on average (threshold {SENSITIVITY_THRESHOLD:.0e}){}; \
         keeps its prior",
        s.time,
        if at_edge {
            format!(
                ", its prior {value} sitting at the edge of its range [{}, {}]",
                info.min, info.max
            )
        } else {
            String::new()
        }
    )
}

/// Seeded split of every dataset's rows: about `fraction` of them held out
/// (at least one, and at least one kept, where a dataset has two or more).
fn holdout_split(
    rows: &[Row],
    datasets: usize,
    fraction: f64,
    seed: u64,
) -> (Vec<usize>, Vec<usize>) {
    let mut rng = SplitMix64::stream(seed, 2);
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for d in 0..datasets {
        let mut members: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].dataset == d).collect();
        rng.shuffle(&mut members);
        let n = members.len();
        let out = if n < 2 {
            0
        } else {
            ((fraction * n as f64).round() as usize).clamp(1, n - 1)
        };
        held.extend_from_slice(&members[..out]);
        train.extend_from_slice(&members[out..]);
    }
    train.sort_unstable();
    held.sort_unstable();
    (train, held)
}

/// Group k-fold: every group of rows (same dataset and job) goes to one fold;
/// groups are shuffled per dataset and dealt round-robin so that every fold
/// holds out some of every dataset. Returns the folds used and each row's
/// fold (indexed like `rows`), or `None` when fewer than two groups exist.
fn group_folds(
    rows: &[Row],
    subset: &[usize],
    datasets: usize,
    folds: usize,
    seed: u64,
) -> Option<(usize, Vec<usize>)> {
    if folds < 2 {
        return None;
    }
    let mut per_dataset: Vec<Vec<usize>> = vec![Vec::new(); datasets];
    for &i in subset {
        let groups = &mut per_dataset[rows[i].dataset];
        if !groups.contains(&rows[i].group) {
            groups.push(rows[i].group);
        }
    }
    let total: usize = per_dataset.iter().map(Vec::len).sum();
    let k = folds.min(total);
    if k < 2 {
        return None;
    }
    let mut rng = SplitMix64::stream(seed, 1);
    let mut fold_of_group: HashMap<usize, usize> = HashMap::new();
    let mut dealt = 0;
    for groups in &mut per_dataset {
        groups.sort_unstable();
        rng.shuffle(groups);
        for &g in groups.iter() {
            fold_of_group.insert(g, dealt % k);
            dealt += 1;
        }
    }
    let fold_of = rows
        .iter()
        .map(|r| fold_of_group.get(&r.group).copied().unwrap_or(usize::MAX))
        .collect();
    Some((k, fold_of))
}

fn describe_nodes(group: &NodeGroup) -> String {
    format!(
        "{} x{} per node, intra-node {}, inter-node {}",
        group.gpu.name, group.gpus_per_node, group.intra_node_bw, group.inter_node_bw
    )
}
