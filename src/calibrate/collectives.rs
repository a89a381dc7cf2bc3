//! Collective coefficients from collective measurements: the intra-node
//! link efficiency and the collective latencies fitted to nccl-tests style
//! all-reduce timings, before (and apart from) the iteration-time fit.
//!
//! Iteration times confound communication with everything else; a direct
//! measurement of the collective pins these coefficients to what the
//! fabric does, and the iteration-time fit then explains the rest.

use super::CalibrateError;
use super::fit::FreeParam;
use crate::cluster::NodeGroup;
use crate::coefficients::{Coefficients, CostModel};
use crate::cost::intra_node_all_reduce;
use crate::profile::{CollectiveOp, parse_reference_collectives, read_text};
use argmin::core::{CostFunction, Error, Executor, State};
use argmin::solver::neldermead::NelderMead;
use std::path::Path;

/// The coefficients a collective fit sets.
pub const COLLECTIVE_COEFFICIENTS: [&str; 3] = [
    "intra_node_efficiency",
    "collective_base_latency_us",
    "collective_step_latency_us",
];

/// One measured all-reduce: `ranks` GPUs of one node, `bytes` per rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveSample {
    pub ranks: u64,
    pub bytes: f64,
    pub seconds: f64,
}

/// The fitted values and how well they reproduce the measurements.
#[derive(Debug, Clone, PartialEq)]
pub struct CollectiveFit {
    pub values: Vec<(&'static str, f64)>,
    pub samples: usize,
    pub mape: f64,
    pub worst_error: f64,
}

/// Reads an nccl-tests style table with columns `gpus, bytes` and
/// `out_of_place_us`, as in the reference A100 curves (the profile importer's
/// reader: one parser for the format).
pub fn read_nccl_table(path: &Path) -> Result<Vec<CollectiveSample>, CalibrateError> {
    let invalid = |e: crate::profile::ProfileError| CalibrateError::InvalidOption(e.to_string());
    let text = read_text(path).map_err(invalid)?;
    let points =
        parse_reference_collectives(&text, &path.display().to_string(), CollectiveOp::AllReduce)
            .map_err(invalid)?;
    Ok(points
        .into_iter()
        .map(|p| CollectiveSample {
            ranks: p.ranks,
            bytes: p.bytes,
            seconds: p.seconds,
        })
        .collect())
}

struct Problem<'a> {
    samples: &'a [CollectiveSample],
    group: &'a NodeGroup,
    prior: &'a CostModel,
    free: Vec<FreeParam>,
}

impl Problem<'_> {
    fn model(&self, z: &[f64]) -> CostModel {
        let mut model = self.prior.clone();
        for (param, zi) in self.free.iter().zip(z) {
            model.coefficients.set(param.info.name, param.value(*zi));
        }
        model
    }

    fn errors(&self, model: &CostModel) -> impl Iterator<Item = f64> + '_ {
        let model = model.clone();
        self.samples.iter().map(move |s| {
            intra_node_all_reduce(self.group, &model, s.ranks, s.bytes) / s.seconds - 1.0
        })
    }

    /// Weighted mean squared log error. Sweeps are often spaced linearly in
    /// size (1 MiB steps up to 1 GiB), which would let the large messages
    /// drown the latency regime; weighting by 1/size makes every octave of
    /// message size count alike.
    fn loss(&self, z: &[f64]) -> f64 {
        let model = self.model(z);
        let (mut total, mut weights) = (0.0, 0.0);
        for (sample, e) in self.samples.iter().zip(self.errors(&model)) {
            let w = 1.0 / sample.bytes;
            total += w * (1.0 + e).ln().powi(2);
            weights += w;
        }
        total / weights
    }
}

struct Objective<'a>(&'a Problem<'a>);

impl CostFunction for Objective<'_> {
    type Param = Vec<f64>;
    type Output = f64;

    fn cost(&self, z: &Self::Param) -> Result<f64, Error> {
        Ok(self.0.loss(z))
    }
}

/// Fits [`COLLECTIVE_COEFFICIENTS`] to all-reduce measurements on nodes of
/// `group`, starting from `prior`; returns the prior with them replaced.
pub fn fit_collectives(
    samples: &[CollectiveSample],
    group: &NodeGroup,
    prior: &CostModel,
) -> Result<(CostModel, CollectiveFit), CalibrateError> {
    if samples.len() < COLLECTIVE_COEFFICIENTS.len() {
        return Err(CalibrateError::TooFewRuns {
            rows: samples.len(),
            free: COLLECTIVE_COEFFICIENTS.len(),
            needed: COLLECTIVE_COEFFICIENTS.len(),
        });
    }
    if let Some(s) = samples
        .iter()
        .find(|s| s.ranks > group.gpus_per_node || s.ranks < 2)
    {
        return Err(CalibrateError::InvalidOption(format!(
            "a collective measurement over {} GPUs does not fit a node of {}; give intra-node measurements over 2..{} GPUs",
            s.ranks, group.gpus_per_node, group.gpus_per_node
        )));
    }
    let free: Vec<FreeParam> = COLLECTIVE_COEFFICIENTS
        .iter()
        .map(|name| FreeParam {
            info: Coefficients::info(name).expect("known coefficient"),
        })
        .collect();
    let problem = Problem {
        samples,
        group,
        prior,
        free,
    };
    let start: Vec<f64> = problem
        .free
        .iter()
        .map(|p| p.z(prior.coefficients.get(p.info.name).expect("known")))
        .collect();
    let mut best = start;
    for step in [1.0, 0.3, 0.1] {
        let mut simplex = vec![best.clone()];
        for i in 0..best.len() {
            let mut v = best.clone();
            v[i] += step;
            simplex.push(v);
        }
        let solver = NelderMead::new(simplex)
            .with_sd_tolerance(1e-14)
            .expect("valid tolerance");
        let result = Executor::new(Objective(&problem), solver)
            .configure(|state| state.max_iters(2000))
            .timer(false)
            .run()
            .expect("the loss never fails");
        if let Some(p) = result
            .state()
            .get_best_param()
            .filter(|p| problem.loss(p) <= problem.loss(&best))
        {
            best = p.clone();
        }
    }
    let model = problem.model(&best);
    let errors: Vec<f64> = problem.errors(&model).collect();
    let fit = CollectiveFit {
        values: COLLECTIVE_COEFFICIENTS
            .iter()
            .map(|name| (*name, model.coefficients.get(name).expect("known")))
            .collect(),
        samples: samples.len(),
        mape: errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64,
        worst_error: errors
            .iter()
            .copied()
            .max_by(|a, b| a.abs().total_cmp(&b.abs()))
            .unwrap_or(0.0),
    };
    Ok((model, fit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::builtin_node;

    #[test]
    fn recovers_the_coefficients_that_generated_the_samples() {
        let group = builtin_node("a100-80gb", 1).unwrap();
        let mut truth = CostModel::datasheet();
        truth.coefficients.intra_node_efficiency = 0.7;
        truth.coefficients.collective_base_latency_us = 30.0;
        truth.coefficients.collective_step_latency_us = 4.0;
        let samples: Vec<CollectiveSample> = (2..=8)
            .flat_map(|ranks| {
                [1e6, 1e7, 1e8, 1e9].map(|bytes| CollectiveSample {
                    ranks,
                    bytes,
                    seconds: intra_node_all_reduce(&group, &truth, ranks, bytes),
                })
            })
            .collect();
        let (_, fit) = fit_collectives(&samples, &group, &CostModel::datasheet()).unwrap();
        for ((name, value), expected) in fit.values.iter().zip([0.7, 30.0, 4.0]) {
            assert!(
                (value / expected - 1.0).abs() < 0.02,
                "{name} = {value}, expected {expected}"
            );
        }
        assert!(fit.mape < 1e-3, "{}", fit.mape);
    }

    #[test]
    fn the_reference_a100_curves_fit_within_a_few_percent() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/reference/a100_nccl_allreduce.csv");
        let samples = read_nccl_table(&path).unwrap();
        assert_eq!(samples.len(), 7 * 1024);
        let group = builtin_node("a100-80gb", 1).unwrap();
        let (model, fit) = fit_collectives(&samples, &group, &CostModel::datasheet()).unwrap();
        // NCCL's bus bandwidth on DGX A100 is about 230 GB/s of the 300 GB/s NVLink.
        let efficiency = model.coefficients.intra_node_efficiency;
        assert!((0.65..0.85).contains(&efficiency), "{efficiency}");
        assert!(fit.mape < 0.10, "MAPE {}", fit.mape);
    }

    #[test]
    fn a_measurement_wider_than_a_node_is_refused() {
        let group = builtin_node("a100-80gb", 1).unwrap();
        let samples = vec![
            CollectiveSample {
                ranks: 16,
                bytes: 1e6,
                seconds: 1e-4
            };
            4
        ];
        let err = fit_collectives(&samples, &group, &CostModel::datasheet()).unwrap_err();
        assert!(err.to_string().contains("16 GPUs"), "{err}");
    }
}
