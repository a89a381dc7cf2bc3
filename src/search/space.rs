//! The values each search dimension may take. A dimension left open takes
//! every value that can make sense for the job; a dimension the user fixed
//! or restricted takes exactly the values given, and combinations that break
//! a rule are counted as dropped rather than silently skipped.

use super::Job;
use crate::config::{OptimizerSharding, ParallelConfig, Recompute, ScheduleKind, StageOrder};
use crate::model::AttentionKind;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchSpace {
    pub tp: Option<Vec<u64>>,
    pub pp: Option<Vec<u64>>,
    pub dp: Option<Vec<u64>>,
    pub micro_batch: Option<Vec<u64>>,
    pub schedule: Option<Vec<ScheduleKind>>,
    pub virtual_stages: Option<Vec<u64>>,
    pub recompute: Option<Vec<Recompute>>,
    pub sequence_parallel: Option<Vec<bool>>,
    pub optimizer_sharding: Option<Vec<OptimizerSharding>>,
    pub bpipe: Option<Vec<bool>>,
    pub attention: Option<Vec<AttentionKind>>,
    /// Layers of the first / last stage (`None` in a list: the even share).
    pub first_stage_layers: Option<Vec<u64>>,
    pub last_stage_layers: Option<Vec<u64>>,
    pub overlap_grad_reduce: Option<Vec<bool>>,
    pub overlap_param_gather: Option<Vec<bool>>,
    pub tp_comm_overlap: Option<Vec<bool>>,
    pub cuda_graphs: Option<Vec<bool>>,
    pub stage_order: Option<Vec<StageOrder>>,
}

/// How many layers the search may take off an end stage (or put on the
/// others) against the even share: enough for the embedding's and the
/// output head's share of a stage, few enough to keep the search small.
const END_STAGE_DEFICIT: u64 = 2;

/// The splits of `layers` over `pp` stages of `v` chunks the search tries
/// when the user gave none: the even one where it exists, and the splits
/// that give the first and last stage up to [`END_STAGE_DEFICIT`] chunks'
/// layers fewer than the others (as Llama 3 405B trained at pp 16, 126 =
/// 7 + 14 x 8 + 7). Counts are in layers; every stage's count divides by v.
pub fn default_splits(layers: u64, pp: u64, v: u64) -> Vec<(Option<u64>, Option<u64>)> {
    let mut splits = Vec::new();
    if pp == 0 || v == 0 {
        return splits;
    }
    if layers.is_multiple_of(pp * v) {
        splits.push((None, None));
    }
    if pp < 2 || !layers.is_multiple_of(v) {
        return splits;
    }
    let chunks = layers / v;
    let even = chunks.div_ceil(pp);
    for middle in [even, even + 1] {
        let rest = chunks as i64 - (pp as i64 - 2) * middle as i64;
        for first in middle.saturating_sub(END_STAGE_DEFICIT).max(1)..=middle {
            let last = rest - first as i64;
            if last < 1 || last as u64 > middle || (last as u64) + END_STAGE_DEFICIT < middle {
                continue;
            }
            let last = last as u64;
            if first == middle && last == middle {
                continue; // the even split
            }
            let split = (Some(first * v), Some(last * v));
            if !splits.contains(&split) {
                splits.push(split);
            }
        }
    }
    splits
}

/// Divisors of `n` in increasing order, found up to its square root.
fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d <= n / d {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// The outer loop of the search: tensor, pipeline and data-parallel degrees
/// and the micro-batch size.
#[derive(Debug, Clone, Copy)]
pub struct Outer {
    tp: u64,
    pp: u64,
    dp: u64,
    micro_batch: u64,
}

impl SearchSpace {
    pub fn outer(&self, job: &Job) -> Vec<Outer> {
        let tps = self
            .tp
            .clone()
            .unwrap_or_else(|| divisors(job.gpus_per_node()));
        let mut outer = Vec::new();
        for &tp in &tps {
            let pps = self.pp.clone().unwrap_or_else(|| {
                if tp == 0 || !job.gpus.is_multiple_of(tp) {
                    return Vec::new();
                }
                divisors(job.gpus / tp)
                    .into_iter()
                    .filter(|&pp| pp <= job.model.layers)
                    .filter(|&pp| {
                        self.first_stage_layers.is_some()
                            || self.last_stage_layers.is_some()
                            || !default_splits(job.model.layers, pp, 1).is_empty()
                    })
                    .collect()
            });
            for &pp in &pps {
                if tp == 0 || pp == 0 || !job.gpus.is_multiple_of(tp * pp) {
                    continue;
                }
                let dp = job.gpus / (tp * pp);
                if self.dp.as_ref().is_some_and(|dps| !dps.contains(&dp)) {
                    continue;
                }
                let micro_batches = self.micro_batch.clone().unwrap_or_else(|| {
                    if job.global_batch.is_multiple_of(dp) {
                        divisors(job.global_batch / dp)
                    } else {
                        vec![1]
                    }
                });
                outer.extend(micro_batches.into_iter().map(|micro_batch| Outer {
                    tp,
                    pp,
                    dp,
                    micro_batch,
                }));
            }
        }
        outer
    }

    /// Every tp x pp x dp product the space allows for `job`'s model and batch
    /// on nodes of `node_size` GPUs, whatever the job's own GPU count.
    pub fn degree_products(&self, job: &Job, node_size: u64) -> Vec<u64> {
        let tps = self.tp.clone().unwrap_or_else(|| divisors(node_size));
        let pps = self
            .pp
            .clone()
            .unwrap_or_else(|| divisors(job.model.layers));
        let dps = self
            .dp
            .clone()
            .unwrap_or_else(|| divisors(job.global_batch));
        let mut products = Vec::new();
        for tp in &tps {
            for pp in &pps {
                products.extend(dps.iter().map(|dp| tp * pp * dp));
            }
        }
        products
    }

    /// The first/last stage layers to try for `pp` stages of `v` chunks:
    /// the user's lists (crossed), or [`default_splits`].
    fn splits(&self, layers: u64, pp: u64, v: u64) -> Vec<(Option<u64>, Option<u64>)> {
        if self.first_stage_layers.is_none() && self.last_stage_layers.is_none() {
            return default_splits(layers, pp, v);
        }
        let side = |given: &Option<Vec<u64>>| -> Vec<Option<u64>> {
            given
                .as_ref()
                .map_or(vec![None], |list| list.iter().map(|&n| Some(n)).collect())
        };
        let mut splits = Vec::new();
        for first in side(&self.first_stage_layers) {
            for last in side(&self.last_stage_layers) {
                splits.push((first, last));
            }
        }
        splits
    }

    /// Every combination of the remaining dimensions for one outer point.
    pub fn inner(&self, job: &Job, o: Outer) -> impl Iterator<Item = ParallelConfig> {
        let schedules: Vec<(ScheduleKind, u64)> = self
            .schedule
            .clone()
            .unwrap_or_else(|| {
                if o.pp == 1 {
                    vec![ScheduleKind::OneFOneB]
                } else {
                    ScheduleKind::ALL.to_vec()
                }
            })
            .into_iter()
            .flat_map(|schedule| {
                let stages: Vec<u64> = match (schedule, &self.virtual_stages) {
                    (ScheduleKind::Interleaved, Some(given)) => given.clone(),
                    (ScheduleKind::Interleaved, None) if o.pp > 1 => divisors(job.model.layers)
                        .into_iter()
                        .filter(|&v| v >= 2 && v * o.pp <= job.model.layers)
                        .filter(|&v| !default_splits(job.model.layers, o.pp, v).is_empty())
                        .collect(),
                    (ScheduleKind::Interleaved, None) => vec![2],
                    _ => vec![1],
                };
                stages.into_iter().map(move |v| (schedule, v))
            })
            .collect();
        let recompute = self.recompute.clone().unwrap_or(Recompute::ALL.to_vec());
        let sequence_parallel = self.sequence_parallel.clone().unwrap_or(if o.tp > 1 {
            vec![false, true]
        } else {
            vec![false]
        });
        let sharding = self.optimizer_sharding.clone().unwrap_or(if o.dp > 1 {
            OptimizerSharding::ALL.to_vec()
        } else {
            vec![OptimizerSharding::None]
        });
        let bpipe_given = self.bpipe.clone();
        let attention = self.attention.clone().unwrap_or(vec![job.model.attention]);
        let switch = |given: &Option<Vec<bool>>, possible: bool| -> Vec<bool> {
            given.clone().unwrap_or(if possible {
                vec![false, true]
            } else {
                vec![false]
            })
        };
        let grad_overlaps = switch(&self.overlap_grad_reduce, o.dp > 1);
        let graphs = switch(&self.cuda_graphs, true);
        let gpus_per_node = job.gpus_per_node();

        let mut configs = Vec::new();
        for &(schedule, virtual_stages) in &schedules {
            let bpipe =
                bpipe_given
                    .clone()
                    .unwrap_or(if schedule == ScheduleKind::OneFOneB && o.pp >= 2 {
                        vec![false, true]
                    } else {
                        vec![false]
                    });
            for (first_stage_layers, last_stage_layers) in
                self.splits(job.model.layers, o.pp, virtual_stages)
            {
                let base = ParallelConfig {
                    tp: o.tp,
                    pp: o.pp,
                    dp: o.dp,
                    micro_batch: o.micro_batch,
                    schedule,
                    virtual_stages,
                    first_stage_layers,
                    last_stage_layers,
                    ..ParallelConfig::default()
                };
                for &recompute in &recompute {
                    for &sequence_parallel in &sequence_parallel {
                        let tp_overlaps = switch(&self.tp_comm_overlap, sequence_parallel);
                        for &optimizer_sharding in &sharding {
                            for &bpipe in &bpipe {
                                // BPipe's pairs share a node only if two
                                // stages fit in one.
                                let pairs_fit = bpipe && 2 * o.tp * o.dp <= gpus_per_node;
                                let orders = self.stage_order.clone().unwrap_or(if pairs_fit {
                                    StageOrder::ALL.to_vec()
                                } else {
                                    vec![StageOrder::Megatron]
                                });
                                for &attention in &attention {
                                    for &overlap_grad_reduce in &grad_overlaps {
                                        let gathers = switch(
                                            &self.overlap_param_gather,
                                            overlap_grad_reduce
                                                && optimizer_sharding
                                                    == OptimizerSharding::OptimizerStates,
                                        );
                                        for &overlap_param_gather in &gathers {
                                            for &tp_comm_overlap in &tp_overlaps {
                                                for &cuda_graphs in &graphs {
                                                    if cuda_graphs
                                                        && recompute == Recompute::Full
                                                        && self.cuda_graphs.is_none()
                                                    {
                                                        continue;
                                                    }
                                                    for &stage_order in &orders {
                                                        configs.push(ParallelConfig {
                                                            recompute,
                                                            sequence_parallel,
                                                            optimizer_sharding,
                                                            bpipe,
                                                            attention,
                                                            overlap_grad_reduce,
                                                            overlap_param_gather,
                                                            tp_comm_overlap,
                                                            cuda_graphs,
                                                            stage_order,
                                                            ..base
                                                        });
                                                    }
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        configs.into_iter()
    }
}
