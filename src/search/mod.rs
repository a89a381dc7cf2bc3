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
    /// Fitting configurations, fastest first.
    pub candidates: Vec<Candidate>,
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

impl SearchResult {
    pub fn valid(&self) -> usize {
        self.candidates.len() + self.out_of_memory
    }
}

#[derive(Default)]
struct Tally {
    candidates: Vec<Candidate>,
    considered: usize,
    invalid: BTreeMap<Rule, usize>,
    invalid_examples: BTreeMap<Rule, ParallelConfig>,
    out_of_memory: usize,
}

impl Tally {
    fn merge(mut self, other: Tally) -> Tally {
        self.candidates.extend(other.candidates);
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

/// Searches `space` for `job` and ranks what fits.
pub fn search(job: &Job, space: &SearchSpace, cost: &CostModel) -> SearchResult {
    let scenario = job.scenario(cost);
    let gpus_per_node = job.gpus_per_node();
    let tallies = space
        .outer(job)
        .into_par_iter()
        .map(|outer| {
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
                let layer = layers
                    .lend_or_insert_with(layer_key(config), || layer_times(&scenario, config));
                let sync =
                    syncs.lend_or_insert_with(sync_key(config), || sync_parts(&scenario, config));
                tally.candidates.push(Candidate {
                    config: *config,
                    prediction: predict_checked_from(&scenario, config, &memory, layer, sync),
                });
                ControlFlow::Continue(())
            });
            tally
        })
        .collect::<Vec<Tally>>();
    // Candidates are large and a big search finds hundreds of thousands:
    // move each part into one list as it is merged (each part freed once
    // moved), then sort the list in place.
    let total = tallies.iter().map(|t| t.candidates.len()).sum();
    let mut candidates = Vec::with_capacity(total);
    let mut tally = Tally::default();
    for mut part in tallies {
        candidates.append(&mut part.candidates);
        tally = tally.merge(part);
    }
    sort_fastest_first(&mut candidates);
    SearchResult {
        candidates,
        considered: tally.considered,
        invalid: tally.invalid,
        invalid_examples: tally.invalid_examples,
        out_of_memory: tally.out_of_memory,
    }
}

/// Sorts `candidates` by iteration time, then peak memory, ties in their
/// order. The keys are sorted apart (small and contiguous) and the
/// candidates then moved once each, along the permutation's cycles, with
/// no second list: a big search's candidates run to hundreds of megabytes.
fn sort_fastest_first(candidates: &mut [Candidate]) {
    let mut order: Vec<(f64, f64, usize)> = candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (c.prediction.iteration_s, c.prediction.peak_memory_bytes, i))
        .collect();
    order.par_sort_unstable_by(|a, b| {
        a.0.total_cmp(&b.0)
            .then(a.1.total_cmp(&b.1))
            .then(a.2.cmp(&b.2))
    });
    let mut source: Vec<usize> = order.into_iter().map(|(_, _, i)| i).collect();
    place_by(candidates, &mut source);
}

/// Rearranges `items` so that position j holds what position `source[j]`
/// held, moving each item once; `source` (a permutation) is used up.
fn place_by<T: Copy>(items: &mut [T], source: &mut [usize]) {
    const DONE: usize = usize::MAX;
    for start in 0..items.len() {
        if source[start] == DONE {
            continue;
        }
        // Walk the cycle through `start`: each position takes its source's
        // item, and the last takes the first's, kept aside.
        let first = items[start];
        let mut at = start;
        loop {
            let from = std::mem::replace(&mut source[at], DONE);
            if from == start {
                items[at] = first;
                break;
            }
            items[at] = items[from];
            at = from;
        }
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
