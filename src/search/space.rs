//! The values each search dimension may take. A dimension left open takes
//! every value that can make sense for the job; a dimension the user fixed
//! or restricted takes exactly the values given, and combinations that break
//! a rule are counted as dropped rather than silently skipped.

use super::Job;
use crate::config::{OptimizerSharding, ParallelConfig, Recompute, ScheduleKind};
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
                divisors(job.model.layers)
                    .into_iter()
                    .filter(|pp| job.gpus.is_multiple_of(tp * pp))
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
                    (ScheduleKind::Interleaved, None) if o.pp > 1 => {
                        divisors(job.model.layers / o.pp)
                            .into_iter()
                            .filter(|v| *v >= 2)
                            .collect()
                    }
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
            for &recompute in &recompute {
                for &sequence_parallel in &sequence_parallel {
                    for &optimizer_sharding in &sharding {
                        for &bpipe in &bpipe {
                            for &attention in &attention {
                                configs.push(ParallelConfig {
                                    tp: o.tp,
                                    pp: o.pp,
                                    dp: o.dp,
                                    micro_batch: o.micro_batch,
                                    schedule,
                                    virtual_stages,
                                    recompute,
                                    sequence_parallel,
                                    optimizer_sharding,
                                    bpipe,
                                    attention,
                                });
                            }
                        }
                    }
                }
            }
        }
        configs.into_iter()
    }
}
