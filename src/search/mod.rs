//! Enumerate every configuration of a search space, drop those that break a
//! rule or do not fit memory, rank the rest by predicted iteration time.
//! Pure (no I/O); parallel over the outer dimensions with rayon.

mod explain;
mod recent;
mod space;

pub use explain::{Explanation, explain};
pub use space::{SearchSpace, default_splits};

use crate::cluster::NodeGroup;
use crate::coefficients::CostModel;
use crate::config::{ParallelConfig, Rule, StemChecks};
use crate::cost::{
    LayerTimes, MemoryCheck, Prediction, Scenario, SyncParts, layer_key, layer_times, memory_key,
    peak_memory_if_fits, predict_checked_from, state_floor, state_key, sync_key, sync_parts,
};
use crate::model::ModelSpec;
use crate::profile::Measurements;
use rayon::prelude::*;
use recent::Recent;
use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::Arc;

/// A training job: what to train, how big a batch, on which GPUs.
#[derive(Debug, Clone)]
pub struct Job {
    pub model: ModelSpec,
    pub global_batch: u64,
    pub gpus: u64,
    pub nodes: NodeGroup,
    /// Device memory to plan for instead of the datasheet capacity, bytes.
    pub memory_limit: Option<f64>,
    /// Measurements the cost model uses where they cover the case.
    pub profile: Option<Arc<Measurements>>,
}

impl Job {
    pub fn scenario<'a>(&'a self, cost: &'a CostModel) -> Scenario<'a> {
        let mut s = Scenario::new(&self.model, self.global_batch, &self.nodes, self.gpus, cost)
            .with_profile(self.profile.as_deref());
        s.memory_limit = self.memory_limit;
        s
    }

    /// GPUs of this job per node.
    pub fn gpus_per_node(&self) -> u64 {
        self.nodes.gpus_per_node.min(self.gpus)
    }

    /// Why this job cannot run at all, naming the field and the fix.
    pub fn check(&self) -> Result<(), String> {
        self.model.check()?;
        let node = self.nodes.gpus_per_node;
        if self.gpus == 0 {
            return Err("the job needs at least one GPU".into());
        }
        if self.global_batch == 0 {
            return Err("the global batch must be at least 1".into());
        }
        if self.gpus > node && !self.gpus.is_multiple_of(node) {
            return Err(format!(
                "{} GPUs is not a multiple of the node size {node}; use whole nodes (e.g. {} or {})",
                self.gpus,
                self.gpus / node * node,
                self.gpus.div_ceil(node) * node
            ));
        }
        let available = self.nodes.nodes * node;
        if self.gpus > available {
            return Err(format!(
                "the job asks for {} GPUs but the cluster has {available} ({} {} of {node}); give it more nodes",
                self.gpus,
                self.nodes.nodes,
                if self.nodes.nodes == 1 {
                    "node"
                } else {
                    "nodes"
                }
            ));
        }
        Ok(())
    }
}

/// A configuration that fits, with its prediction.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub config: ParallelConfig,
    pub prediction: Prediction,
}

/// What the search found and what it dropped.
#[derive(Debug, Clone)]
pub struct SearchResult {
    /// The fastest fitting configurations, fastest first: all of them up
    /// to the number the search was asked to keep ([`KEPT_CANDIDATES`] by
    /// default), so that a search of hundreds of millions of combinations
    /// holds megabytes, not gigabytes.
    pub candidates: Vec<Candidate>,
    /// Every fitting configuration's iteration time, fastest first: eight
    /// bytes each, for the rank of any configuration among all that fit.
    fitting_times: Vec<f64>,
    /// Combinations of the space's values that were looked at.
    pub considered: usize,
    /// Combinations dropped because they break a rule, by rule.
    pub invalid: BTreeMap<Rule, usize>,
    /// The first configuration found breaking each rule: what an
    /// explanation of the rule is given for.
    pub invalid_examples: BTreeMap<Rule, ParallelConfig>,
    /// Valid configurations that do not fit device memory.
    pub out_of_memory: usize,
}

/// How many of the fastest fitting configurations a search keeps by
/// default: far more than a ranking shows or an export falls back to, and
/// about 4.5 MB of them.
pub const KEPT_CANDIDATES: usize = 10_000;

impl SearchResult {
    /// Configurations that fit, kept or not.
    pub fn fitting(&self) -> usize {
        self.fitting_times.len()
    }

    pub fn valid(&self) -> usize {
        self.fitting() + self.out_of_memory
    }

    /// Fitting configurations predicted strictly faster than `iteration_s`.
    pub fn faster_than(&self, iteration_s: f64) -> usize {
        self.fitting_times.partition_point(|&t| t < iteration_s)
    }

    /// Whether a fitting configuration takes exactly `iteration_s`.
    pub fn any_takes(&self, iteration_s: f64) -> bool {
        let at = self.faster_than(iteration_s);
        self.fitting_times.get(at) == Some(&iteration_s)
    }
}

/// A fitting configuration with where the search met it, which breaks
/// ties in time and memory as an unbounded ranking would.
#[derive(Clone, Copy)]
struct Ranked {
    met: (usize, usize),
    candidate: Candidate,
}

impl Ranked {
    fn cmp(&self, other: &Ranked) -> std::cmp::Ordering {
        let (a, b) = (&self.candidate.prediction, &other.candidate.prediction);
        a.iteration_s
            .total_cmp(&b.iteration_s)
            .then(a.peak_memory_bytes.total_cmp(&b.peak_memory_bytes))
            .then(self.met.cmp(&other.met))
    }
}

#[derive(Default)]
struct Tally {
    /// At most twice the kept number, cut back to it when full.
    best: Vec<Ranked>,
    fitting_times: Vec<f64>,
    considered: usize,
    invalid: BTreeMap<Rule, usize>,
    invalid_examples: BTreeMap<Rule, ParallelConfig>,
    out_of_memory: usize,
}

impl Tally {
    fn add(&mut self, ranked: Ranked, keep: usize) {
        self.fitting_times
            .push(ranked.candidate.prediction.iteration_s);
        self.best.push(ranked);
        self.cut_back_when_full(keep);
    }

    fn merge(mut self, mut other: Tally, keep: usize) -> Tally {
        self.best.append(&mut other.best);
        self.cut_back_when_full(keep);
        self.fitting_times.append(&mut other.fitting_times);
        self.considered += other.considered;
        for (rule, example) in other.invalid_examples {
            self.invalid_examples.entry(rule).or_insert(example);
        }
        for (rule, n) in other.invalid {
            *self.invalid.entry(rule).or_default() += n;
        }
        self.out_of_memory += other.out_of_memory;
        self
    }
}

impl Tally {
    /// Cuts the kept candidates back to the `keep` fastest once they hold
    /// twice that many: linear time, amortised over the additions.
    fn cut_back_when_full(&mut self, keep: usize) {
        if self.best.len() >= keep.saturating_mul(2).max(1) {
            keep_fastest(&mut self.best, keep);
        }
    }
}

/// Cuts `ranked` to its `keep` fastest, in no order (linear time).
fn keep_fastest(ranked: &mut Vec<Ranked>, keep: usize) {
    if keep == 0 {
        ranked.clear();
    } else if ranked.len() > keep {
        ranked.select_nth_unstable_by(keep - 1, Ranked::cmp);
        ranked.truncate(keep);
    }
}

/// Searches `space` for `job` and ranks what fits, keeping the
/// [`KEPT_CANDIDATES`] fastest.
pub fn search(job: &Job, space: &SearchSpace, cost: &CostModel) -> SearchResult {
    search_keeping(job, space, cost, KEPT_CANDIDATES)
}

/// Searches `space` for `job` and ranks what fits, keeping the `keep`
/// fastest (ties broken by memory, then by the order the space lists them)
/// and every fitting one's time.
pub fn search_keeping(
    job: &Job,
    space: &SearchSpace,
    cost: &CostModel,
    keep: usize,
) -> SearchResult {
    search_where(job, space, cost, keep, &|_| true)
}

/// [`search_keeping`] over the fitting configurations `accept` takes only:
/// what a second look needs past the kept ones (the fastest an engine can
/// run, whether the space holds a configuration), in bounded memory.
pub fn search_where(
    job: &Job,
    space: &SearchSpace,
    cost: &CostModel,
    keep: usize,
    accept: &(dyn Fn(&ParallelConfig) -> bool + Sync),
) -> SearchResult {
    let scenario = job.scenario(cost);
    let gpus_per_node = job.gpus_per_node();
    let tally = space
        .outer(job)
        .into_par_iter()
        .enumerate()
        .map(|(outer_index, outer)| {
            let mut tally = Tally::default();
            // Neighbouring configurations often differ only in switches
            // that move no memory: check memory once for them (the last
            // few verdicts, by memory key, and by state key).
            let mut recent: Recent<ParallelConfig, Option<MemoryCheck>> = Recent::default();
            let mut states: Recent<ParallelConfig, bool> = Recent::default();
            // and the layers' times by layer key, for the timing.
            let mut layers: Recent<ParallelConfig, LayerTimes> = Recent::default();
            // and the data-parallel sync's parts by sync key.
            let mut syncs: Recent<ParallelConfig, SyncParts> = Recent::default();
            // The rules' checks of the stem, made once for its inner ones.
            let mut stem: Option<StemChecks> = None;
            let _: ControlFlow<()> = space.for_each_inner(job, outer, |config| {
                tally.considered += 1;
                let checks = match stem {
                    Some(checks) if checks.holds_for(config) => checks,
                    _ => *stem.insert(StemChecks::of(
                        config,
                        &job.model,
                        job.global_batch,
                        gpus_per_node,
                    )),
                };
                if let Some(rule) = config.violation_with(&checks, &job.model, job.gpus) {
                    let count = tally.invalid.entry(rule).or_default();
                    if *count == 0 {
                        tally.invalid_examples.insert(rule, *config);
                    }
                    *count += 1;
                    return ControlFlow::Continue(());
                }
                // The model state alone rules most misfits out, and it moves
                // with few of the dimensions.
                let too_big = states.get_or_insert_with(state_key(config), || {
                    state_floor(&scenario, config) > scenario.usable_memory()
                });
                if too_big {
                    tally.out_of_memory += 1;
                    return ControlFlow::Continue(());
                }
                let memory = recent.get_or_insert_with(memory_key(config), || {
                    peak_memory_if_fits(&scenario, config)
                });
                let Some(memory) = memory else {
                    tally.out_of_memory += 1;
                    return ControlFlow::Continue(());
                };
                if !accept(config) {
                    return ControlFlow::Continue(());
                }
                let layer = layers
                    .lend_or_insert_with(layer_key(config), || layer_times(&scenario, config));
                let sync =
                    syncs.lend_or_insert_with(sync_key(config), || sync_parts(&scenario, config));
                let candidate = Candidate {
                    config: *config,
                    prediction: predict_checked_from(&scenario, config, &memory, layer, sync),
                };
                let met = (outer_index, tally.considered);
                tally.add(Ranked { met, candidate }, keep);
                ControlFlow::Continue(())
            });
            tally
        })
        // Merged as they come, so that no more than a few workers' kept
        // candidates are held at once.
        .reduce(Tally::default, |all, part| all.merge(part, keep));
    let mut tally = tally;
    keep_fastest(&mut tally.best, keep);
    tally.best.par_sort_unstable_by(Ranked::cmp);
    tally.fitting_times.par_sort_unstable_by(f64::total_cmp);
    SearchResult {
        candidates: tally.best.into_iter().map(|r| r.candidate).collect(),
        fitting_times: tally.fitting_times,
        considered: tally.considered,
        invalid: tally.invalid,
        invalid_examples: tally.invalid_examples,
        out_of_memory: tally.out_of_memory,
    }
}

/// Whether any configuration of `space` fits memory for `job` (no timing).
pub fn anything_fits(job: &Job, space: &SearchSpace, cost: &CostModel) -> bool {
    let scenario = job.scenario(cost);
    let gpus_per_node = job.gpus_per_node();
    space.outer(job).into_par_iter().any(|outer| {
        space
            .for_each_inner(job, outer, |config| {
                let fits = config
                    .violation(&job.model, job.global_batch, job.gpus, gpus_per_node)
                    .is_none()
                    && peak_memory_if_fits(&scenario, config).is_some();
                if fits {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .is_break()
    })
}

/// The smallest GPU count above the job's at which some configuration of
/// `space` fits; `None` if none does up to `max_gpus`. Only counts that a
/// configuration can use are tried: tp x pp x dp with tp dividing the node,
/// pp dividing the layers and dp dividing the global batch, in whole nodes.
pub fn smallest_fitting_gpus(
    job: &Job,
    space: &SearchSpace,
    cost: &CostModel,
    max_gpus: u64,
) -> Option<u64> {
    let node = job.nodes.gpus_per_node;
    let mut counts: Vec<u64> = space
        .degree_products(job, node)
        .into_iter()
        .filter(|&g| g > job.gpus && g <= max_gpus && (g % node == 0 || g < node))
        .collect();
    counts.sort_unstable();
    counts.dedup();
    counts.into_iter().find(|&gpus| {
        let mut bigger = job.clone();
        bigger.gpus = gpus;
        bigger.nodes.nodes = bigger.nodes.nodes.max(gpus.div_ceil(node));
        anything_fits(&bigger, space, cost)
    })
}

#[cfg(test)]
mod tests;
