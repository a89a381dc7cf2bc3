//! Why a configuration the user had in mind lost, or does not fit.

use super::{Job, SearchResult, SearchSpace, search_where};
use crate::coefficients::CostModel;
use crate::config::ParallelConfig;
use crate::cost::{Prediction, peak_memory, predict};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

#[derive(Debug, Clone)]
pub enum Explanation {
    /// The configuration breaks a rule.
    Invalid { reason: String },
    /// It is valid but a stage needs more memory than the GPU offers.
    DoesNotFit {
        stage: u64,
        needs_gib: f64,
        usable_gib: f64,
        capacity_gib: f64,
        prediction: Prediction,
    },
    /// It fits; where it would rank and what makes it slower than the winner.
    Ranked {
        /// 1-based position among the fitting configurations.
        rank: usize,
        of: usize,
        prediction: Prediction,
        /// Its iteration time over the winner's, minus one.
        slower_by: f64,
        /// Breakdown parts that differ from the winner's, largest first (seconds).
        differences: Vec<(&'static str, f64)>,
    },
}

/// The smallest part of a time difference an explanation names: half the
/// last digit a time is shown with (0.1 ms), so no part reads "-0.0 ms".
pub const SHOWN_DIFFERENCE_S: f64 = 0.05e-3;

pub fn explain(
    job: &Job,
    space: &SearchSpace,
    cost: &CostModel,
    result: &SearchResult,
    config: &ParallelConfig,
) -> Explanation {
    if let Err(reason) = config.check(&job.model, job.global_batch, job.gpus, job.gpus_per_node()) {
        return Explanation::Invalid { reason };
    }
    let scenario = job.scenario(cost);
    let prediction = predict(&scenario, config);
    let memory = peak_memory(&scenario, config);
    if !memory.fits {
        return Explanation::DoesNotFit {
            stage: memory.stage,
            needs_gib: memory.bytes / GIB,
            usable_gib: memory.usable / GIB,
            capacity_gib: job.memory_limit.unwrap_or(job.nodes.gpu.memory_bytes) / GIB,
            prediction,
        };
    }
    let faster = result.faster_than(prediction.iteration_s);
    // Among the kept, by itself; beyond them, by looking again for it
    // alone, where a fitting configuration takes its time at all.
    let listed = result.candidates.iter().any(|c| c.config == *config)
        || (result.candidates.len() < result.fitting()
            && result.any_takes(prediction.iteration_s)
            && search_where(job, space, cost, 1, &|c| c == config).fitting() > 0);
    let (slower_by, differences) = match result.candidates.first() {
        Some(winner) => {
            let mut differences: Vec<(&'static str, f64)> = prediction
                .time
                .parts()
                .iter()
                .zip(winner.prediction.time.parts())
                .map(|((name, mine), (_, theirs))| (*name, mine - theirs))
                .filter(|(_, delta)| delta.abs() >= SHOWN_DIFFERENCE_S)
                .collect();
            differences.sort_by(|a, b| b.1.abs().total_cmp(&a.1.abs()));
            (
                prediction.iteration_s / winner.prediction.iteration_s - 1.0,
                differences,
            )
        }
        None => (0.0, Vec::new()),
    };
    Explanation::Ranked {
        rank: faster + 1,
        of: result.fitting() + usize::from(!listed),
        prediction,
        slower_by,
        differences,
    }
}
