//! Refitting the cost model to a handful of cluster trials, and scoring
//! that refit honestly: each trial predicted by a refit that never saw it
//! (leave-one-out), so a loop's "the model now agrees" is a held-out figure,
//! not an in-sample one.

use crate::calibrate::{CalibrateError, Calibration, Dataset, FitOptions, FitStatus, calibrate};
use crate::coefficients::CostModel;
use crate::cost::{Scenario, predict};

/// The coefficients a refit on a handful of trial runs frees first: those
/// that move every configuration's time the most.
pub const REFIT_ORDER: [&str; 6] = [
    "gemm_efficiency",
    "microbatch_overhead_ms",
    "iteration_overhead_ms",
    "host_us_per_layer_pass",
    "hbm_efficiency",
    "inter_node_efficiency",
];

/// A refit and the coefficients it freed.
#[derive(Debug, Clone)]
pub struct Refit {
    pub calibration: Calibration,
    pub freed: Vec<&'static str>,
}

/// Fits the first of [`REFIT_ORDER`]'s coefficients the rows inform, one
/// for every two measured rows of `dataset` (at least one): as many as rows
/// would fit them exactly and predict new ones no better, so half leaves
/// each fit over-determined. A coefficient the rows do not inform (their
/// predicted times barely depend on it) makes room for the next in the
/// order. The rest keep `prior`'s values. `None` when the rows cannot
/// inform even one.
pub fn refit(
    dataset: &Dataset,
    prior: &CostModel,
    name: &str,
) -> Result<Option<Refit>, CalibrateError> {
    let want = REFIT_ORDER.len().min(measured_rows(dataset).div_ceil(2));
    if want == 0 {
        return Ok(None);
    }
    let mut best = None;
    for window in want..=REFIT_ORDER.len() {
        let options = FitOptions {
            free: Some(
                REFIT_ORDER[..window]
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            ),
            folds: 0,
            bootstrap: 0,
            ..FitOptions::default()
        };
        match calibrate(std::slice::from_ref(dataset), prior, name, &options) {
            Ok(calibration) => {
                let freed: Vec<&'static str> = calibration
                    .coefficients
                    .iter()
                    .filter(|c| c.status == FitStatus::Fitted)
                    .map(|c| c.name)
                    .collect();
                let enough = freed.len() >= want;
                best = Some(Refit { calibration, freed });
                if enough {
                    break;
                }
            }
            Err(CalibrateError::NothingToFit { .. }) => continue,
            // More free coefficients than the rows can carry: stop widening.
            Err(CalibrateError::TooFewRuns { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(best)
}

fn measured_rows(dataset: &Dataset) -> usize {
    dataset
        .runs
        .iter()
        .filter(|r| r.measured_s.is_some())
        .count()
}

/// One measured figure (an iteration time in seconds, a peak in bytes),
/// predicted without having been fitted to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeldOut {
    /// Index into the dataset's runs.
    pub run: usize,
    pub predicted: f64,
    pub measured: f64,
}

impl HeldOut {
    /// (predicted - measured) / measured.
    pub fn error(&self) -> f64 {
        (self.predicted - self.measured) / self.measured
    }
}

/// Predicted iteration time of `dataset`'s run `i` under `cost`.
pub fn predict_run(dataset: &Dataset, i: usize, cost: &CostModel) -> f64 {
    let run = &dataset.runs[i];
    let scenario = Scenario::new(&run.model, run.global_batch, &dataset.group, run.gpus, cost);
    predict(&scenario, &run.config).iteration_s
}

/// Leave-one-out: every measured run predicted by the refit of all the
/// others (with fewer other rows than one coefficient needs, by `prior`).
pub fn leave_one_out(dataset: &Dataset, prior: &CostModel) -> Vec<HeldOut> {
    let measured: Vec<usize> = (0..dataset.runs.len())
        .filter(|&i| dataset.runs[i].measured_s.is_some())
        .collect();
    measured
        .iter()
        .map(|&i| {
            let others = Dataset {
                runs: dataset
                    .runs
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i)
                    .map(|(_, r)| r.clone())
                    .collect(),
                ..dataset.clone()
            };
            let model = match refit(&others, prior, "held-out") {
                Ok(Some(refit)) => refit.calibration.model,
                _ => prior.clone(),
            };
            HeldOut {
                run: i,
                predicted: predict_run(dataset, i, &model),
                measured: dataset.runs[i].measured_s.expect("measured rows only"),
            }
        })
        .collect()
}

/// The memory coefficients refitted to the trials' measured allocated
/// peaks, over a model whose time coefficients are already fitted (memory
/// coefficients do not move a predicted time), and that refit's
/// leave-one-out score.
#[derive(Debug, Clone)]
pub struct MemoryRefit {
    pub model: CostModel,
    /// (name, before, after).
    pub coefficients: Vec<(&'static str, f64, f64)>,
    /// Each measured peak predicted before the refit.
    pub before: Vec<HeldOut>,
    /// Each measured peak predicted by the refit of all the others.
    pub held_out: Vec<HeldOut>,
}

/// Predicted allocated peak of `dataset`'s run `i`, on the rank its
/// measurement was read on.
pub fn predict_peak(dataset: &Dataset, i: usize, cost: &CostModel) -> f64 {
    let run = &dataset.runs[i];
    let scenario = Scenario::new(&run.model, run.global_batch, &dataset.group, run.gpus, cost);
    let rank = run
        .measured_memory
        .map_or(crate::runs::MemoryRank::Max, |m| m.rank);
    predict(&scenario, &run.config).peak_on(rank).0
}

/// Refits the memory coefficients to `dataset`'s allocated peaks; `None`
/// without any.
pub fn refit_memory(dataset: &Dataset, model: &CostModel) -> Option<MemoryRefit> {
    use crate::calibrate::{fit_memory, memory_rows};
    let measured = |i: usize| dataset.runs[i].measured_memory.and_then(|m| m.allocated);
    let with_peak: Vec<usize> = (0..dataset.runs.len())
        .filter(|&i| measured(i).is_some())
        .collect();
    let fit = |runs: Vec<crate::runs::Run>| {
        let rows: Vec<_> = memory_rows(&runs, &dataset.group)
            .into_iter()
            .filter(|r| !r.reserved)
            .collect();
        fit_memory(&rows, model, 0, 1)
    };
    let all = fit(dataset.runs.clone())?;
    let held_out = with_peak
        .iter()
        .map(|&i| {
            let others: Vec<_> = dataset
                .runs
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .map(|(_, r)| r.clone())
                .collect();
            let refit = fit(others).map_or_else(|| model.clone(), |f| f.model);
            HeldOut {
                run: i,
                predicted: predict_peak(dataset, i, &refit),
                measured: measured(i).expect("runs with a peak"),
            }
        })
        .collect();
    let before = with_peak
        .iter()
        .map(|&i| HeldOut {
            run: i,
            predicted: predict_peak(dataset, i, model),
            measured: measured(i).expect("runs with a peak"),
        })
        .collect();
    Some(MemoryRefit {
        model: all.model,
        coefficients: all.coefficients,
        before,
        held_out,
    })
}

/// Mean absolute percentage error of `held_out`, percent; `None` if empty.
pub fn mape(held_out: &[HeldOut]) -> Option<f64> {
    (!held_out.is_empty()).then(|| {
        100.0 * held_out.iter().map(|h| h.error().abs()).sum::<f64>() / held_out.len() as f64
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::builtin_node;
    use crate::model::builtin_model;
    use crate::runs::Run;
    use crate::search::{Job, SearchSpace, search};

    /// Runs "measured" under a model whose GEMMs reach `gemm` of peak.
    fn dataset(gemm: f64, rows: usize) -> (Dataset, CostModel) {
        let prior = CostModel::datasheet();
        let mut truth = prior.clone();
        assert!(truth.coefficients.set("gemm_efficiency", gemm));
        let job = Job {
            model: builtin_model("gpt3-13b").unwrap(),
            global_batch: 64,
            gpus: 8,
            nodes: builtin_node("a100-80gb", 1).unwrap(),
            memory_limit: None,
            profile: None,
        };
        let result = search(&job, &SearchSpace::default(), &truth);
        let scenario = job.scenario(&truth);
        let runs = result
            .candidates
            .iter()
            .step_by(7)
            .take(rows)
            .enumerate()
            .map(|(i, c)| Run {
                line: i + 2,
                model: job.model.clone(),
                config: c.config,
                global_batch: 64,
                gpus: 8,
                gpu: None,
                gpus_per_node: None,
                measured_s: Some(predict(&scenario, &c.config).iteration_s),
                measured_memory: None,
            })
            .collect();
        let data = Dataset {
            name: "trials".into(),
            runs,
            group: job.nodes.clone(),
        };
        (data, prior)
    }

    #[test]
    fn held_out_error_falls_when_the_trials_share_one_cause() {
        let (data, prior) = dataset(0.45, 4);
        let before: Vec<HeldOut> = (0..data.runs.len())
            .map(|i| HeldOut {
                run: i,
                predicted: predict_run(&data, i, &prior),
                measured: data.runs[i].measured_s.unwrap(),
            })
            .collect();
        let held_out = leave_one_out(&data, &prior);
        assert_eq!(held_out.len(), 4);
        let (zero_shot, after) = (mape(&before).unwrap(), mape(&held_out).unwrap());
        assert!(zero_shot > 10.0, "the prior should be off: {zero_shot}");
        assert!(after < zero_shot / 3.0, "{zero_shot}% -> {after}%");
    }

    #[test]
    fn one_run_frees_one_coefficient_and_none_refit_nothing() {
        let (data, prior) = dataset(0.45, 1);
        let fitted = refit(&data, &prior, "x").unwrap().unwrap();
        assert_eq!(fitted.freed, vec!["gemm_efficiency"]);
        let empty = Dataset {
            runs: Vec::new(),
            ..data
        };
        assert!(refit(&empty, &prior, "x").unwrap().is_none());
        assert!(leave_one_out(&empty, &prior).is_empty());
        assert_eq!(mape(&[]), None);
    }
}
