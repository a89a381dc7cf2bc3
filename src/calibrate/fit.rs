//! The fitting problem: free coefficients reparameterised into their ranges,
//! a robust relative-error loss with equal weight per dataset and a weak pull
//! toward the prior, minimised with Nelder-Mead.

use super::Row;
use crate::coefficients::{CoefficientInfo, CostModel};
use crate::cost::{Scenario, predict};
use argmin::core::{CostFunction, Error, Executor, State};
use argmin::solver::neldermead::NelderMead;
use rayon::prelude::*;

/// Scale of the soft-L1 loss on log errors: errors well below 5% count
/// quadratically, larger ones linearly (so a few bad rows do not dominate).
pub const HUBER_DELTA: f64 = 0.05;

/// Weight of the pull toward the prior, per free coefficient, per unit of
/// squared distance in the reparameterised space. Weak: moving one
/// coefficient by one logit costs as much as 0.02% mean absolute log error,
/// enough to hold directions the data does not constrain at the prior.
pub const RIDGE: f64 = 1e-5;

/// How close to its range's edges a prior is placed in the reparameterised
/// space (a logistic never reaches 0 or 1).
const EDGE: f64 = 1e-3;

/// Rows per parallel task when evaluating the loss.
const CHUNK: usize = 96;

/// A coefficient the fit moves: `value = min + (max - min) * sigmoid(z)`.
#[derive(Debug, Clone, Copy)]
pub struct FreeParam {
    pub info: &'static CoefficientInfo,
}

impl FreeParam {
    pub fn value(&self, z: f64) -> f64 {
        let (lo, hi) = (self.info.min, self.info.max);
        (lo + (hi - lo) / (1.0 + (-z).exp())).clamp(lo, hi)
    }

    pub fn z(&self, value: f64) -> f64 {
        let (lo, hi) = (self.info.min, self.info.max);
        let u = ((value - lo) / (hi - lo)).clamp(EDGE, 1.0 - EDGE);
        (u / (1.0 - u)).ln()
    }
}

/// Predicted iteration time of one row under `cost`.
pub fn predict_row(row: &Row, cost: &CostModel) -> f64 {
    let run = row.run;
    let scenario = Scenario::new(&run.model, run.global_batch, row.nodes, run.gpus, cost);
    predict(&scenario, &run.config).iteration_s
}

/// Soft-L1 (pseudo-Huber) loss of a log error.
pub fn soft_l1(r: f64) -> f64 {
    let d = HUBER_DELTA;
    d * d * ((1.0 + (r / d).powi(2)).sqrt() - 1.0)
}

/// Weights that give every dataset present in `counts` equal total weight,
/// rows within a dataset weighted by how often they are drawn.
pub fn dataset_weights(rows: &[Row], counts: &[(usize, u32)]) -> Vec<(usize, f64)> {
    let datasets = rows.iter().map(|r| r.dataset).max().map_or(0, |d| d + 1);
    let mut per_dataset = vec![0.0f64; datasets];
    for &(i, n) in counts {
        per_dataset[rows[i].dataset] += n as f64;
    }
    let present = per_dataset.iter().filter(|&&n| n > 0.0).count() as f64;
    counts
        .iter()
        .filter(|&&(_, n)| n > 0)
        .map(|&(i, n)| (i, n as f64 / (per_dataset[rows[i].dataset] * present)))
        .collect()
}

/// One fitting problem: which rows count with what weight, which
/// coefficients move, and where the prior sits.
pub struct Problem<'a> {
    pub rows: &'a [Row<'a>],
    /// Row index and weight; weights sum to one.
    pub active: Vec<(usize, f64)>,
    pub free: &'a [FreeParam],
    /// The prior cost model (every coefficient not free keeps its value).
    pub template: &'a CostModel,
    /// The prior in the reparameterised space.
    pub z0: &'a [f64],
}

/// `template` with the `free` coefficients set from `z`.
pub fn model_at(template: &CostModel, free: &[FreeParam], z: &[f64]) -> CostModel {
    let mut model = template.clone();
    for (p, &z) in free.iter().zip(z) {
        model.coefficients.set(p.info.name, p.value(z));
    }
    model
}

/// The weak pull toward the prior `z0`.
pub fn prior_pull(z: &[f64], z0: &[f64]) -> f64 {
    RIDGE * z.iter().zip(z0).map(|(a, b)| (a - b).powi(2)).sum::<f64>()
}

impl Problem<'_> {
    pub fn model(&self, z: &[f64]) -> CostModel {
        model_at(self.template, self.free, z)
    }

    /// Weighted mean soft-L1 of the log errors plus the pull toward the prior.
    /// Deterministic: chunks are summed in a fixed order.
    pub fn loss(&self, z: &[f64]) -> f64 {
        if z.iter().any(|z| !z.is_finite()) {
            return f64::MAX;
        }
        let model = self.model(z);
        let parts: Vec<f64> = self
            .active
            .par_chunks(CHUNK)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|&(i, w)| {
                        let row = &self.rows[i];
                        let r = (predict_row(row, &model) / row.measured).ln();
                        w * soft_l1(if r.is_finite() { r } else { 10.0 })
                    })
                    .sum::<f64>()
            })
            .collect();
        let data: f64 = parts.iter().sum();
        data + prior_pull(z, self.z0)
    }
}

/// A loss over the reparameterised coefficients.
type Loss<'l> = dyn Fn(&[f64]) -> f64 + 'l;

struct Objective<'p, 'l>(&'p Loss<'l>);

impl CostFunction for Objective<'_, '_> {
    type Param = Vec<f64>;
    type Output = f64;

    fn cost(&self, z: &Self::Param) -> Result<f64, Error> {
        Ok((self.0)(z))
    }
}

/// One Nelder-Mead leg: `step` is the simplex edge in the reparameterised space.
#[derive(Debug, Clone, Copy)]
pub struct Leg {
    pub step: f64,
    pub iters: u64,
}

/// Minimises `problem` from `start` with Nelder-Mead, restarting a fresh
/// simplex around the best point for every leg (Nelder-Mead stalls on a
/// collapsed simplex in ~20 dimensions). Returns the best point and loss.
pub fn minimise(problem: &Problem, start: &[f64], legs: &[Leg]) -> (Vec<f64>, f64) {
    minimise_loss(&|z: &[f64]| problem.loss(z), start, legs)
}

/// [`minimise`] for any loss over the reparameterised coefficients.
pub fn minimise_loss(loss: &Loss, start: &[f64], legs: &[Leg]) -> (Vec<f64>, f64) {
    let n = start.len();
    let mut best = start.to_vec();
    let mut best_loss = loss(&best);
    for leg in legs {
        if leg.iters == 0 {
            continue;
        }
        // Deterministic simplex: the start and one step along each axis,
        // the direction alternating so the simplex is not lopsided.
        let mut simplex = vec![best.clone()];
        for i in 0..n {
            let mut v = best.clone();
            v[i] += if i % 2 == 0 { leg.step } else { -leg.step };
            simplex.push(v);
        }
        // Dimension-adapted coefficients (Gao and Han, 2012) where argmin
        // allows them: a gentler expansion and shrink in many dimensions.
        let nf = n as f64;
        let mut solver = NelderMead::new(simplex)
            .with_sd_tolerance(1e-12)
            .expect("valid tolerance");
        if n >= 2 {
            solver = solver
                .with_gamma(1.0 + 2.0 / nf)
                .expect("valid gamma")
                .with_sigma((1.0 - 1.0 / nf).max(0.5))
                .expect("valid sigma");
        }
        let result = Executor::new(Objective(loss), solver)
            .configure(|state| state.max_iters(leg.iters))
            .timer(false)
            .run()
            .expect("the loss never fails");
        let state = result.state();
        if let Some(p) = state.get_best_param() {
            let loss = state.get_best_cost();
            if loss < best_loss {
                best = p.clone();
                best_loss = loss;
            }
        }
    }
    (best, best_loss)
}
