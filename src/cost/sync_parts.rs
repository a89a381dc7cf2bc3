//! The parts of a configuration's data-parallel synchronisation that
//! neither its layers' times nor its overlap switches move: each stage's
//! parameter groups, their collectives before any overlap, and the
//! optimizer step. A search predicts many configurations that differ only
//! in such switches, so it works these out once per [`sync_key`] and lends
//! them to every prediction with that key ([`super::predict_checked_from`]).

use super::{ProfileUsage, Scenario, comm, memory};
use crate::config::{OptimizerSharding, ParallelConfig, Recompute, RecomputeModules, SyncMethod};

/// One stage's data-parallel synchronisation before any overlap.
#[derive(Debug, Clone, Copy)]
pub struct StageSyncParts {
    pub stage: u64,
    pub groups: [memory::ParamGroup; 4],
    /// The end-of-iteration collectives (none where they run per micro-batch).
    pub sync: comm::StageSync,
    /// ZeRO-3's collectives per micro-batch: all of them, and the part no
    /// prefetch can hide ([`comm::zero3_per_microbatch`]).
    pub zero3: (f64, f64),
    /// Hybrid sharding's all-reduce over the replicas, per micro-batch.
    pub replica_per_microbatch: f64,
    /// The word embedding's gradient sync between the pipeline's ends.
    pub embedding: f64,
    /// The optimizer step over the parameters this stage updates.
    pub optimizer: f64,
}

impl StageSyncParts {
    /// Stage `stage`'s parts; the collectives timed from the scenario's
    /// profile are counted in `usage`.
    pub fn of(s: &Scenario, c: &ParallelConfig, stage: u64, usage: &mut ProfileUsage) -> Self {
        let groups = memory::parameter_groups(s, c, stage);
        let layers = c.stage_layers(s.model.layers, stage) as f64;
        let sync = comm::stage_sync(s, c, &groups, usage);
        let zero3 = comm::zero3_per_microbatch(s, c, &groups, layers, usage);
        let replica_per_microbatch = comm::replica_all_reduce_per_microbatch(s, c, &groups, usage);
        StageSyncParts {
            stage,
            groups,
            sync,
            zero3,
            replica_per_microbatch,
            embedding: comm::embedding_group_sync(s, c, stage),
            optimizer: optimizer_step(s, c, &groups, &sync),
        }
    }
}

/// The optimizer step's memory-bound time on a stage with `groups`: each
/// rank updates the parameters it owns, and in FP8 casts each updated layer
/// weight again with its transpose (read 2 bytes, write 1 + 1).
fn optimizer_step(
    s: &Scenario,
    c: &ParallelConfig,
    groups: &[memory::ParamGroup; 4],
    sync: &comm::StageSync,
) -> f64 {
    let k = s.coef();
    let owned: f64 = groups
        .iter()
        .map(|g| match (g.sync, c.optimizer_sharding) {
            // A server updates its shard of the table.
            (SyncMethod::ParameterServer, _) => {
                g.params / sync.sparse.map_or(1, |e| e.partitions.max(1)) as f64
            }
            (_, OptimizerSharding::None) => g.params,
            _ => g.params / g.ranks.max(1) as f64,
        })
        .sum();
    // Transformer Engine re-quantizes the updated 16-bit weights: a read
    // of each and a write of its two quantized copies.
    let recast = memory::te_quantized_bytes(s, c).map_or(0.0, |copy| {
        (2.0 + 2.0 * copy) * memory::layer_weights(groups)
    });
    (owned * k.optimizer_step_bytes_per_param + recast)
        / (s.gpu.hbm_bandwidth * k.hbm_efficiency * s.measured_hbm_scale)
}

/// Most stages [`memory::peak_candidates`] names short of every stage.
const KEPT: usize = 6;

/// The [`StageSyncParts`] of the stages a prediction synchronises on
/// ([`memory::peak_candidates`], in its order, repeats included). Where
/// the candidates are every stage (MoE layers alternating with dense ones)
/// none is kept: each is worked out when asked for.
#[derive(Debug, Clone, Copy)]
pub struct SyncParts {
    kept: [Option<StageSyncParts>; KEPT],
    every_stage: bool,
}

impl SyncParts {
    pub fn of(s: &Scenario, c: &ParallelConfig, usage: &mut ProfileUsage) -> Self {
        let mut parts = SyncParts {
            kept: [None; KEPT],
            every_stage: false,
        };
        // The stages first: where there are more than are kept, none is
        // worked out here (`each` works out every stage, once).
        let mut stages = [None; KEPT];
        let mut candidates = memory::peak_candidates(s, c);
        for slot in &mut stages {
            *slot = candidates.next();
        }
        if candidates.next().is_some() {
            parts.every_stage = true;
            return parts;
        }
        for (slot, stage) in parts.kept.iter_mut().zip(stages) {
            *slot = stage.map(|stage| StageSyncParts::of(s, c, stage, usage));
        }
        parts
    }

    /// Calls `f` with each candidate's parts, in order: those kept, or
    /// every stage's, worked out now (counted in `usage`).
    pub fn each(
        &self,
        s: &Scenario,
        c: &ParallelConfig,
        usage: &mut ProfileUsage,
        mut f: impl FnMut(&StageSyncParts),
    ) {
        if self.every_stage {
            for stage in 0..c.pp {
                f(&StageSyncParts::of(s, c, stage, usage));
            }
        } else {
            self.kept.iter().flatten().for_each(f);
        }
    }

    /// Stage `stage`'s kept parts, if it is a kept candidate.
    pub fn kept(&self, stage: u64) -> Option<&StageSyncParts> {
        self.kept.iter().flatten().find(|p| p.stage == stage)
    }
}

/// `c` with what [`SyncParts`] does not read cleared: the micro-batch,
/// the layers' switches (recomputation apart from whether it is full,
/// which makes ZeRO-3 gather the weights once more; sequence parallelism,
/// attention, the dispatcher, the ring), and every overlap, graph and
/// compile switch. Two configurations with the same key have the same
/// parts.
pub fn sync_key(c: &ParallelConfig) -> ParallelConfig {
    let plain = ParallelConfig::default();
    let recompute = match c.recompute {
        Recompute::Full => Recompute::Full,
        _ => Recompute::None,
    };
    ParallelConfig {
        micro_batch: plain.micro_batch,
        recompute,
        recompute_modules: RecomputeModules::default(),
        ac_frequency: plain.ac_frequency,
        sequence_parallel: plain.sequence_parallel,
        attention: plain.attention,
        dispatcher: plain.dispatcher,
        cp_comm: plain.cp_comm,
        overlap_grad_reduce: plain.overlap_grad_reduce,
        overlap_param_gather: plain.overlap_param_gather,
        tp_comm_overlap: plain.tp_comm_overlap,
        ep_comm_overlap: plain.ep_comm_overlap,
        cuda_graphs: plain.cuda_graphs,
        compile: plain.compile,
        expandable_segments: plain.expandable_segments,
        ..*c
    }
}
