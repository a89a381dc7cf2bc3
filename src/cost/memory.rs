//! Memory of one pipeline stage on one GPU: model states by sharding,
//! activations by the schedule's in-flight micro-batches (and BPipe's
//! balancing), buffers and runtime overhead.

use super::Scenario;
use super::kernels::HALF;
use crate::config::{OptimizerSharding, ParallelConfig, Recompute, ScheduleKind};
use crate::model::{AttentionKind, ModelSpec};
use serde::{Deserialize, Serialize};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// How a parameter group's gradients are synchronised over data-parallel
/// ranks. Today every group is dense and all-reduced; sparse-aware
/// synchronisation (parameter server for embeddings) adds variants here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMethod {
    AllReduce,
}

/// Parameters of one stage that are synchronised the same way.
#[derive(Debug, Clone, Copy)]
pub struct ParamGroup {
    /// Parameters on one GPU (its tensor-parallel shard).
    pub params: f64,
    pub sync: SyncMethod,
}

/// The parameter groups of stage `stage` on one GPU: the transformer layers
/// first, then the embeddings where the stage holds them.
pub fn parameter_groups(s: &Scenario, c: &ParallelConfig, stage: u64) -> [ParamGroup; 2] {
    let t = c.tp as f64;
    let model = s.model;
    let layers = c.stage_layers(model.layers, stage) as f64 * layer_params_per_rank(model, c.tp);
    let mut embeddings = 0.0;
    if stage == 0 {
        embeddings += model.embedding_params() / t + model.position_params();
    }
    if stage == c.pp - 1 {
        // The output head: its own matrix when untied, and a copy of the
        // tied embedding when it lives on another stage.
        if !model.tied_embeddings || c.pp > 1 {
            embeddings += model.embedding_params() / t;
        }
        embeddings += 2.0 * model.hidden as f64; // final layer norm
    }
    [
        ParamGroup {
            params: layers,
            sync: SyncMethod::AllReduce,
        },
        ParamGroup {
            params: embeddings,
            sync: SyncMethod::AllReduce,
        },
    ]
}

pub fn stage_params(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    parameter_groups(s, c, stage).iter().map(|g| g.params).sum()
}

/// Under ZeRO-3 / FSDP, the weights a rank of `stage` holds gathered at a
/// time: two layers (the one computing and the one prefetched), and on the
/// first and last stage the embedding or output table while it is used;
/// 0 under other sharding.
pub fn gathered_weight_bytes(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    if c.optimizer_sharding != OptimizerSharding::Full {
        return 0.0;
    }
    let table = if stage == 0 || stage == c.pp - 1 {
        s.model.embedding_params() / c.tp as f64
    } else {
        0.0
    };
    (2.0 * layer_params_per_rank(s.model, c.tp) + table) * s.coef().weight_bytes_per_param
}

/// Parameters of one layer on one tensor-parallel rank: the split ones
/// divided by tp, the replicated ones (layer norms, row-parallel biases)
/// whole.
fn layer_params_per_rank(model: &ModelSpec, tp: u64) -> f64 {
    let replicated = model.replicated_params_per_layer();
    (model.params_per_layer() - replicated) / tp as f64 + replicated
}

/// Bytes of one stage on one GPU, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StageMemory {
    pub stage: u64,
    pub weights: f64,
    pub gradients: f64,
    pub optimizer_states: f64,
    pub activations: f64,
    /// Micro-batches whose activations the stage holds at its peak.
    pub in_flight: f64,
    pub buffers: f64,
    pub runtime_overhead: f64,
}

impl StageMemory {
    pub fn total(&self) -> f64 {
        self.weights
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.buffers
            + self.runtime_overhead
    }

    pub fn parts_gib(&self) -> [(&'static str, f64); 6] {
        [
            ("weights", self.weights / GIB),
            ("gradients", self.gradients / GIB),
            ("optimizer states", self.optimizer_states / GIB),
            ("activations", self.activations / GIB),
            ("buffers", self.buffers / GIB),
            ("runtime overhead", self.runtime_overhead / GIB),
        ]
    }
}

/// Activation bytes one layer keeps for backward, per micro-batch, on one
/// GPU (Korthikanti et al., generalised to GQA and gated MLPs).
pub fn layer_activation_bytes(s: &Scenario, c: &ParallelConfig) -> f64 {
    let model = s.model;
    let t = c.tp as f64;
    let b = c.micro_batch as f64;
    let seq = model.seq_len as f64;
    let h = model.hidden as f64;
    let f = model.ffn_hidden as f64;
    let sb = seq * b;
    let sp = if c.sequence_parallel { t } else { 1.0 };
    if c.recompute == Recompute::Full {
        return HALF * sb * h / sp;
    }
    // Layer-norm inputs (2 x 2), QKV and MLP inputs (2 x 2), two 1-byte dropout
    // masks: 10 bytes per hidden element, replicated over tp without SP.
    let replicated = 10.0 * sb * h / sp;
    // Q, K, V, the projection input, and the MLP activation's input and output.
    let mlp = if model.gated_mlp { 6.0 } else { 4.0 } * f;
    let sharded = sb * (2.0 * h + HALF * model.kv_width() as f64 + 2.0 * h + mlp) / t;
    // Softmax output (2), dropout mask (1) and dropout output (2) per score.
    let scores = match (c.attention, c.recompute) {
        (AttentionKind::Standard, Recompute::None) => 5.0 * model.heads as f64 * seq * seq * b / t,
        _ => 0.0,
    };
    replicated + sharded + scores
}

/// Micro-batches (in units of a whole stage's layers) whose activations
/// stage `stage` holds at its peak, without BPipe.
pub fn schedule_in_flight(c: &ParallelConfig, m: u64, stage: u64) -> f64 {
    let p = c.pp;
    match c.schedule {
        ScheduleKind::Gpipe => m as f64,
        ScheduleKind::OneFOneB => (p - stage).min(m) as f64,
        ScheduleKind::Interleaved => {
            // Megatron's warm-up: (p - i - 1) * 2 + (v - 1) * n chunks, plus
            // the one in progress, n the micro-batch group (pp unless the
            // micro-batch count needs more); each chunk is 1/v of the stage's
            // layers.
            let v = c.virtual_stages;
            let n = c.microbatch_group(m).unwrap_or(p);
            let chunks = ((p - stage - 1) * 2 + (v - 1) * n + 1).min(m * v);
            chunks as f64 / v as f64
        }
    }
}

/// In-flight micro-batches under BPipe: evictor x and acceptor p-1-x share
/// their p + 1 micro-batches, the evictor keeping the larger half.
fn bpipe_in_flight(c: &ParallelConfig, m: u64, stage: u64) -> f64 {
    let p = c.pp;
    let partner = p - 1 - stage;
    let own = schedule_in_flight(c, m, stage);
    if partner == stage {
        return own;
    }
    let pair = own + schedule_in_flight(c, m, partner);
    let keep = (pair / 2.0).ceil();
    if stage < partner {
        keep.min(own)
    } else {
        pair - keep.min(schedule_in_flight(c, m, partner))
    }
}

pub fn in_flight(c: &ParallelConfig, m: u64, stage: u64) -> f64 {
    if c.bpipe {
        bpipe_in_flight(c, m, stage)
    } else {
        schedule_in_flight(c, m, stage)
    }
}

pub fn stage_memory(s: &Scenario, c: &ParallelConfig, stage: u64) -> StageMemory {
    let k = s.coef();
    let model = s.model;
    let d = c.dp as f64;
    let m = c.micro_batches(s.global_batch);
    let params = stage_params(s, c, stage);
    let state_shards = match c.optimizer_sharding {
        OptimizerSharding::Full => d,
        _ => 1.0,
    };
    let optimizer_shards = match c.optimizer_sharding {
        OptimizerSharding::None => 1.0,
        _ => d,
    };
    let t = c.tp as f64;
    let b = c.micro_batch as f64;
    let seq = model.seq_len as f64;
    let h = model.hidden as f64;
    let layers = c.stage_layers(model.layers, stage) as f64;
    let held = in_flight(c, m, stage);
    let mut activations = held * layers * layer_activation_bytes(s, c);
    if c.recompute == Recompute::Full {
        // Recomputing one layer rebuilds its full activations for one micro-batch.
        let mut no_recompute = *c;
        no_recompute.recompute = Recompute::None;
        activations += layer_activation_bytes(s, &no_recompute);
    }
    if stage == 0 {
        // Embedding output and its dropout mask, per in-flight micro-batch.
        activations += held * 3.0 * seq * b * h / if c.sequence_parallel { t } else { 1.0 };
    }
    if stage == c.pp - 1 {
        // Logits of the micro-batch in flight on the last stage.
        activations += k.logit_bytes * seq * b * model.vocab as f64 / t;
    }
    // Pipeline send/receive buffers; ZeRO-3 keeps two layers gathered.
    let mut buffers = if c.pp > 1 {
        4.0 * HALF * seq * b * h / t
    } else {
        0.0
    };
    buffers += gathered_weight_bytes(s, c, stage);
    if c.tp_comm_overlap {
        // Transformer Engine's userbuffers: a gathered (whole-sequence)
        // 16-bit buffer for each of the layer's four overlapped GEMMs.
        buffers += 4.0 * HALF * seq * b * h;
    }
    if c.cuda_graphs {
        buffers += k.cuda_graph_memory_gib * GIB;
    }
    StageMemory {
        stage,
        weights: params * k.weight_bytes_per_param / state_shards,
        gradients: params * k.gradient_bytes_per_param / state_shards,
        optimizer_states: params * k.optimizer_bytes_per_param / optimizer_shards,
        activations,
        in_flight: held,
        buffers,
        runtime_overhead: k.runtime_overhead_gib * GIB,
    }
}

/// The stages that can hold the most memory: the first (the most in-flight
/// micro-batches under every schedule, and the embedding) and the last (the
/// output head and the logits); with an uneven split also their neighbours,
/// which may hold more layers than the ends. Stages between hold less of
/// everything.
pub fn peak_candidates(c: &ParallelConfig) -> impl Iterator<Item = u64> {
    let p = c.pp;
    // A stage listed twice (p <= 3) is harmless where the largest is taken.
    let stages = [0, p - 1, 1.min(p - 1), p.saturating_sub(2)];
    stages.into_iter().take(if c.uneven() { 4 } else { 2 })
}

/// The stage with the most memory and its bytes: among
/// [`peak_candidates`], or, under BPipe with fewer micro-batches than
/// stages (a middle pair can then hold more than the ends), every stage.
pub fn peak_stage(s: &Scenario, c: &ParallelConfig) -> (u64, f64) {
    let best = |best: (u64, f64), x: (u64, f64)| if x.1 > best.1 { x } else { best };
    let total = |i: u64| (i, stage_memory(s, c, i).total());
    if c.bpipe {
        return (0..c.pp).map(total).fold((0, f64::NEG_INFINITY), best);
    }
    peak_candidates(c)
        .map(total)
        .fold((0, f64::NEG_INFINITY), best)
}
