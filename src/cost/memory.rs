//! Memory of one pipeline stage on one GPU, as PyTorch's caching allocator
//! and the device see it: model states by engine and sharding, activations
//! of the schedule's in-flight micro-batches (and BPipe's balancing), the
//! loss's logits, buffers and workspaces (together PyTorch's allocated
//! peak), the blocks the allocator reserves beyond them (its reserved
//! peak), and what lives outside PyTorch (CUDA context, NCCL's buffers,
//! the flex dispatcher's buffers: `deepep`).

use super::Scenario;
use super::kernels::HALF;
use super::layer::{LayerKind, dispatch_gathered_tokens, expert_rows, local_tokens};
use crate::cluster::GroupSpan;
use crate::config::{
    CpComm, CrossEntropyFusion, Dispatcher, Engine, GradReduce, OptimizerSharding, ParallelConfig,
    Precision, Recompute, RecomputeModules, ScheduleKind,
};
use crate::model::{AttentionKind, ModelSpec};
use serde::{Deserialize, Serialize};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

pub use crate::config::SyncMethod;

/// Parameters of one stage that are synchronised the same way.
#[derive(Debug, Clone, Copy)]
pub struct ParamGroup {
    /// Parameters on one GPU (its tensor-parallel shard).
    pub params: f64,
    pub sync: SyncMethod,
    /// The ranks holding copies of these parameters, whose gradients are
    /// synchronised and whose state is sharded together: the data-parallel
    /// ranks with the context-parallel ones (all of them, or the hybrid
    /// shard group), or the experts' expert-data-parallel group.
    pub ranks: u64,
    pub span: GroupSpan,
    /// Experts' weights: their own group, with no hybrid replicas.
    pub experts: bool,
    /// Used whole at the stage's ends (embedding, head) rather than layer
    /// by layer, so no prefetch hides their gathers.
    pub tables: bool,
}

/// What [`parameter_groups`] holds, in its order.
pub const GROUP_NAMES: [&str; 4] = [
    "layers",
    "embeddings and head",
    "experts",
    "input embedding",
];

/// The parameter groups of stage `stage` on one GPU: the transformer layers
/// first (without their experts), then the dense embeddings and head where
/// the stage holds them, then the experts of its MoE layers, then an untied
/// input embedding (on the first stage), the one group whose gradient is
/// sparse and which may sync by `c.embedding_sync`.
pub fn parameter_groups(s: &Scenario, c: &ParallelConfig, stage: u64) -> [ParamGroup; 4] {
    let model = s.model;
    let (dense_layers, moe_layers) = super::stage_layer_kinds(s, c, stage);
    let mut layers = dense_layers as f64 * layer_params_per_rank(s, c.tp)
        + moe_layers as f64 * moe_layer_params_per_rank(s, c);
    if stage == c.pp - 1 {
        // The prediction modules' projections (column-parallel over tp)
        // and norms; their layers are among the stage's.
        let h = model.hidden as f64;
        layers += model.mtp_layers as f64 * (2.0 * h * h / c.tp as f64 + 3.0 * h);
    }
    let experts = moe_layers as f64 * expert_params_per_rank(s, c);
    let table = super::vocab_per_rank(s, c) * model.hidden as f64;
    let mut embeddings = 0.0;
    let mut input_embedding = 0.0;
    if stage == 0 {
        embeddings += model.position_params();
        // A tied table is also the head, whose gradient is dense; a dense
        // sync buckets the table with the other embeddings.
        if model.tied_embeddings || !c.embedding_sync.is_sparse() {
            embeddings += table;
        } else {
            input_embedding = table;
        }
    }
    if stage == c.pp - 1 {
        // The output head: its own matrix when untied, and a copy of the
        // tied embedding when it lives on another stage.
        if !model.tied_embeddings || c.pp > 1 {
            embeddings += table;
        }
        // Untied, the prediction modules look tokens up in a copy of the
        // word embedding when it lives on another stage.
        if model.mtp_layers > 0 && !model.tied_embeddings && c.pp > 1 {
            embeddings += table;
        }
        embeddings += 2.0 * model.hidden as f64; // final layer norm
    }
    let dense = |params: f64, tables: bool| ParamGroup {
        params,
        sync: SyncMethod::AllReduce,
        ranks: c.shard_degree(),
        span: super::comm::shard_group_span(s, c),
        experts: false,
        tables,
    };
    [
        dense(layers, false),
        dense(embeddings, true),
        ParamGroup {
            params: experts,
            sync: SyncMethod::AllReduce,
            ranks: c.expert_data_parallel(),
            span: super::comm::expert_data_span(s, c),
            experts: true,
            tables: false,
        },
        ParamGroup {
            sync: c.embedding_sync,
            ..dense(input_embedding, true)
        },
    ]
}

/// The per-layer parameter counts of a model that [`parameter_groups`]
/// splits over the ranks: they depend on the model alone, and a search asks
/// for them for every stage of every configuration, so [`Scenario::new`]
/// works them out once (each as the model's own method computes it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerParams {
    /// One layer's parameters that no rank splits (layer norms,
    /// row-parallel biases).
    replicated: f64,
    /// One dense layer's.
    dense_layer: f64,
    /// One MoE layer's apart from its experts, and those of them kept whole
    /// (the replicated ones and the router); `None` for a dense model.
    moe_rest: Option<(f64, f64)>,
    /// One routed expert's MLP.
    expert: f64,
}

impl LayerParams {
    pub fn of(model: &ModelSpec) -> Self {
        let replicated = model.replicated_params_per_layer();
        LayerParams {
            replicated,
            dense_layer: model.dense_layer_params(),
            moe_rest: model.moe_layer_params().map(|(_, rest)| {
                let router = model.moe.map_or(0, |m| m.experts * model.hidden) as f64;
                (rest, replicated + router)
            }),
            expert: model.moe.map_or(0.0, |m| model.mlp_params(m.ffn_hidden)),
        }
    }
}

/// Parameters of one MoE layer on one rank apart from its experts:
/// attention, router and shared experts, split over tp where Megatron-Core
/// splits them (the router is replicated).
fn moe_layer_params_per_rank(s: &Scenario, c: &ParallelConfig) -> f64 {
    let Some((rest, replicated)) = s.layer_params.moe_rest else {
        return 0.0;
    };
    (rest - replicated) / c.tp as f64 + replicated
}

/// One MoE layer's routed-expert parameters on one rank: E / ep experts,
/// each split etp ways.
fn expert_params_per_rank(s: &Scenario, c: &ParallelConfig) -> f64 {
    s.model.moe.map_or(0.0, |m| {
        let local = (m.experts / c.ep.max(1)) as f64;
        local * s.layer_params.expert / c.etp as f64
    })
}

pub fn stage_params(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    parameter_groups(s, c, stage).iter().map(|g| g.params).sum()
}

/// Under ZeRO-3 / FSDP, the 16-bit weights a rank of `stage` holds
/// gathered at a time: two layers (the one computing and the one
/// prefetched), and on the first and last stage the embedding or output
/// table while it is used. torchtitan's FSDP keeps the gathered copies of
/// the whole stage from forward to backward for optimizer-state sharding
/// (`reshard_after_forward = never`, how it is exported). 0 otherwise.
pub fn gathered_weight_bytes(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    let w = s.coef().weight_bytes_per_param;
    match (c.engine, c.optimizer_sharding) {
        (_, OptimizerSharding::Full) => {
            let table = if stage == 0 || stage == c.pp - 1 {
                super::vocab_per_rank(s, c) * s.model.hidden as f64
            } else {
                0.0
            };
            let layer = layer_params_per_rank(s, c.tp)
                .max(moe_layer_params_per_rank(s, c) + expert_params_per_rank(s, c));
            (2.0 * layer + table) * w
        }
        (Engine::Torchtitan, OptimizerSharding::OptimizerStates) => stage_params(s, c, stage) * w,
        _ => 0.0,
    }
}

/// Parameters of one layer on one tensor-parallel rank: the split ones
/// divided by tp, the replicated ones (layer norms, row-parallel biases)
/// whole.
fn layer_params_per_rank(s: &Scenario, tp: u64) -> f64 {
    let replicated = s.layer_params.replicated;
    (s.layer_params.dense_layer - replicated) / tp as f64 + replicated
}

/// Bytes of one stage on one GPU at its peak, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StageMemory {
    pub stage: u64,
    pub weights: f64,
    pub gradients: f64,
    pub optimizer_states: f64,
    /// What the in-flight micro-batches keep for their backward passes, and
    /// the layer being recomputed.
    pub activations: f64,
    /// Micro-batches whose activations the stage holds at its peak.
    pub in_flight: f64,
    /// The logits and their gradient around the loss (last stage only),
    /// live at the last stage's peak.
    #[serde(default)]
    pub loss: f64,
    /// Pipeline send/receive buffers, ZeRO-3/FSDP's gathered weights,
    /// userbuffers, CUDA graphs' pools, cuBLAS and Transformer Engine
    /// workspaces.
    pub buffers: f64,
    /// Blocks PyTorch's caching allocator holds beyond the tensors
    /// (fragmentation): reserved less allocated.
    #[serde(default)]
    pub allocator_reserve: f64,
    /// Outside PyTorch's allocator: the CUDA context, NCCL's buffers.
    pub runtime_overhead: f64,
    /// Outside PyTorch's allocator too: the flex dispatcher's communication
    /// buffers (DeepEP's or HybridEP's, `deepep`).
    #[serde(default)]
    pub dispatcher_buffers: f64,
}

impl StageMemory {
    /// What PyTorch counts as allocated at the peak (`max allocated`).
    pub fn allocated(&self) -> f64 {
        self.weights
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.loss
            + self.buffers
    }

    /// What PyTorch's caching allocator reserves at the peak (`max reserved`).
    pub fn reserved(&self) -> f64 {
        self.allocated() + self.allocator_reserve
    }

    /// Device memory needed: reserved plus what lives outside PyTorch. Fits
    /// are judged on it.
    pub fn total(&self) -> f64 {
        self.reserved() + self.outside_allocator()
    }

    /// What the device holds beside PyTorch's allocator.
    pub fn outside_allocator(&self) -> f64 {
        self.runtime_overhead + self.dispatcher_buffers
    }

    pub fn parts_gib(&self) -> [(&'static str, f64); 9] {
        [
            ("weights", self.weights / GIB),
            ("gradients", self.gradients / GIB),
            ("optimizer states", self.optimizer_states / GIB),
            ("activations", self.activations / GIB),
            ("loss", self.loss / GIB),
            ("buffers", self.buffers / GIB),
            ("allocator reserve", self.allocator_reserve / GIB),
            ("runtime overhead", self.runtime_overhead / GIB),
            ("dispatcher buffers", self.dispatcher_buffers / GIB),
        ]
    }
}

/// Bytes per parameter an engine keeps of its weights, gradients and
/// optimizer states, before sharding.
#[derive(Debug, Clone, Copy)]
pub struct StateBytes {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer: f64,
}

/// Megatron-LM keeps 16-bit weights, fp32 main gradients and Adam with an
/// fp32 master copy (2 + 4 + 12 bytes, `theoretical_memory_usage.py`'s 18);
/// torchtitan's FSDP2 keeps fp32 parameters (the master copy itself),
/// fp32 gradients and Adam's two moments (4 + 4 + 8), with 16-bit copies
/// gathered for compute (see [`gathered_weight_bytes`]).
///
/// Under `grad_reduce bf16` Megatron-LM's gradient buffer is bf16 (see
/// [`reduced_gradient_bytes`]); torchtitan reduces in bf16 but keeps its
/// gradient shards in the fp32 of its parameters.
pub fn state_bytes(s: &Scenario, c: &ParallelConfig) -> StateBytes {
    let k = s.coef();
    match c.engine {
        Engine::Megatron => StateBytes {
            weights: k.weight_bytes_per_param,
            gradients: reduced_gradient_bytes(s, c),
            optimizer: k.optimizer_bytes_per_param,
        },
        Engine::Torchtitan => StateBytes {
            weights: 2.0 * k.weight_bytes_per_param,
            gradients: k.gradient_bytes_per_param,
            optimizer: (k.optimizer_bytes_per_param - 2.0 * k.weight_bytes_per_param).max(0.0),
        },
    }
}

/// Bytes per parameter a gradient collective moves (and Megatron-LM's
/// gradient buffer holds): the fitted `gradient_bytes_per_param`, fp32 by
/// default, or a 16-bit weight's under `grad_reduce bf16`.
pub fn reduced_gradient_bytes(s: &Scenario, c: &ParallelConfig) -> f64 {
    match c.grad_reduce {
        GradReduce::Fp32 => s.coef().gradient_bytes_per_param,
        GradReduce::Bf16 => s.coef().weight_bytes_per_param,
    }
}

/// Activation bytes one layer keeps for backward, per micro-batch, on one
/// GPU (Korthikanti et al., generalised to GQA, gated MLPs, models without
/// dropout, torch.compile and torchtitan's checkpointing policies).
pub fn layer_activation_bytes(s: &Scenario, c: &ParallelConfig) -> f64 {
    layer_kept(s, c, c.recompute, LayerKind::Dense)
}

/// [`layer_activation_bytes`] of a layer of `kind`.
#[cfg(test)]
pub fn layer_activation_bytes_of(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> f64 {
    layer_kept(s, c, c.recompute, kind)
}

/// Activation bytes stage `stage` keeps per micro-batch over all its layers.
pub fn stage_activation_bytes(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    let (dense, moe) = super::stage_layer_kinds(s, c, stage);
    let mut bytes = dense as f64 * layer_kept(s, c, c.recompute, LayerKind::Dense);
    if moe > 0 {
        bytes += moe as f64 * layer_kept(s, c, c.recompute, LayerKind::Moe);
    }
    bytes
}

fn layer_kept(s: &Scenario, c: &ParallelConfig, recompute: Recompute, kind: LayerKind) -> f64 {
    let model = s.model;
    let t = c.tp as f64;
    let seq = model.seq_len as f64;
    let h = model.hidden as f64;
    let f = model.ffn_hidden as f64;
    // The tokens of this context-parallel rank.
    let sb = local_tokens(s, c);
    let sp = if c.sequence_parallel { t } else { 1.0 };
    match recompute {
        Recompute::Full => return HALF * sb * h / sp,
        Recompute::SelectiveLayer => {
            // One layer in n checkpointed whole, the others keeping all.
            let n = c.ac_frequency.max(1) as f64;
            return (layer_kept(s, c, Recompute::Full, kind)
                + (n - 1.0) * layer_kept(s, c, Recompute::None, kind))
                / n;
        }
        _ => {}
    }
    // Two 1-byte dropout masks per hidden element, where the model has dropout.
    let masks = if model.dropout { 2.0 } else { 0.0 };
    let input = saved_gemm_input_bytes(s, c);
    // What Megatron-LM's selective recomputation redoes, and so drops.
    let modules = match recompute {
        Recompute::Selective => c.recompute_modules,
        _ => RecomputeModules::NONE,
    };
    let recomputed = |module| modules.has(module);
    // Layer-norm inputs (2 x 2 bytes), QKV and MLP inputs (2 x `input`), the
    // masks: replicated over tp without SP. Recomputed norms drop their
    // outputs: the one before an MoE layer's router, and under MLA the one
    // before its down-projections (the norms Megatron-Core keeps apart from
    // the next linear).
    let recomputed_norms = if recomputed(RecomputeModules::LAYERNORM) {
        f64::from(u8::from(kind == LayerKind::Moe) + u8::from(model.mla.is_some()))
    } else {
        0.0
    };
    let replicated = (2.0 * HALF + (2.0 - recomputed_norms) * input + masks) * sb * h / sp;
    // Q, K, V and the attention output (the projection's input)...
    // (MLA also keeps its latents, whole on every tp rank, for the
    // up-projections' backward; recomputing the up-projections drops the
    // queries, keys and values they make.) In FP8 the projection keeps its
    // own FP8 copy of the output beside the attention kernel's.
    let widths = if recomputed(RecomputeModules::MLA_UP_PROJ) {
        model.v_width()
    } else {
        model.q_width() + model.kv_width() + model.v_width()
    };
    let projection_copy = if input < HALF {
        input * model.v_width() as f64
    } else {
        0.0
    };
    // `--qk-layernorm`'s per-head norms keep their inputs, the projected
    // queries and keys (MLA's latent norms are the up-projections' own).
    let qk_norm_inputs = if model.qk_layernorm && model.mla.is_none() {
        HALF * (model.q_width() + model.k_width()) as f64
    } else {
        0.0
    };
    let attention_io = sb * (HALF * widths as f64 + projection_copy + qk_norm_inputs) / t
        + sb * HALF * model.latent_width() as f64;
    // ...and the MLP activation's input and output: a gated MLP keeps both
    // projections and their product, torch.compile fuses the product away.
    let mlp_width = match (model.gated_mlp, c.compile) {
        (true, false) => 3.0,
        _ => 2.0,
    };
    // Bytes per element of an MLP's width: its projections' outputs in 16
    // bits, the activation's output (the second GEMM's input) as kept, and
    // gpt-oss's clamps' own copy of the projections' unclamped 2f outputs,
    // which `clamp` saves for its backward beside the clamped ones the
    // activation saves (`crate::model::QuickGeglu`).
    let clamp_copy = match model.quick_geglu {
        Some(glu) if glu.clamps() => 2.0 * HALF,
        _ => 0.0,
    };
    let per_width = HALF * (mlp_width - 1.0) + input + clamp_copy;
    let mlp = match (kind, model.moe) {
        (LayerKind::Moe, Some(_)) if recomputed(RecomputeModules::MOE) => 0.0,
        // Each routed row keeps its permuted input to the expert and the
        // expert's activation input and output (E / ep experts, 1/etp wide;
        // the output not when the activation is recomputed); the shared
        // experts keep theirs over the tokens, and the router its fp32
        // probabilities.
        (LayerKind::Moe, Some(moe)) => {
            // Sync-free experts (a whole iteration's graph) work in
            // buffers pre-sized to the rank's capacity, but page what they
            // keep for the backward pass (Megatron-LM's paged stash, which
            // the export turns on): the rows routed, as eager ones.
            let rows = expert_rows(s, c);
            // The all-gather dispatcher keeps the gathered hidden states of
            // its whole group for the backward pass as well.
            let gathered = match c.dispatcher {
                Dispatcher::AllGather => HALF * dispatch_gathered_tokens(s, c) * h,
                // A flex dispatcher's buffers are its own allocations,
                // outside PyTorch's allocator (`dispatcher_buffers`).
                Dispatcher::AllToAll | Dispatcher::Flex | Dispatcher::HybridEp => 0.0,
            };
            // A recomputed activation (clamps included) keeps only its
            // checkpoint's input, the projections' outputs.
            let expert_width = if recomputed(RecomputeModules::MOE_ACT) {
                per_width - input - clamp_copy
            } else {
                per_width
            };
            let shared = if recomputed(RecomputeModules::SHARED_EXPERTS) {
                0.0
            } else {
                sb * per_width * moe.shared_ffn_hidden as f64 / t
            };
            rows * (input * h + expert_width * moe.ffn_hidden as f64 / c.etp as f64)
                + shared
                + 4.0 * sb * moe.experts as f64 / sp
                + gathered
        }
        _ if recomputed(RecomputeModules::MLP) => 0.0,
        _ => sb * per_width * f / t,
    };
    // Softmax output (2 bytes), with dropout its mask (1) and output (2),
    // over this rank's queries and every key, unless the attention core is
    // recomputed.
    let keeps_scores = recompute == Recompute::None
        || (recompute == Recompute::Selective && !recomputed(RecomputeModules::CORE_ATTN));
    let scores = match c.attention {
        AttentionKind::Standard if keeps_scores => {
            (if model.dropout { 5.0 } else { 2.0 }) * model.heads as f64 * seq * sb / t
        }
        _ => 0.0,
    };
    match recompute {
        // torchtitan's per-op policy keeps the attention kernel's inputs and
        // output and every other matrix multiply's output; the element-wise
        // results between are recomputed: about half the rest.
        Recompute::SelectiveOp => attention_io + (replicated + mlp) / 2.0,
        _ => replicated + attention_io + mlp + scores,
    }
}

/// Activation bytes per micro-batch that CPU offloading moves to host
/// memory: what the first `cpu_offload_layers` layers keep (the model's
/// leading dense layers first). Megatron-LM offloads only without a
/// pipeline, so these are the one stage's first layers.
pub fn offloaded_activation_bytes(s: &Scenario, c: &ParallelConfig) -> f64 {
    let n = c.cpu_offload_layers;
    if n == 0 {
        return 0.0;
    }
    let (dense, moe) = super::stage_layer_kinds(s, c, 0);
    let dense_off = n.min(dense);
    let moe_off = (n - dense_off).min(moe);
    let mut bytes = dense_off as f64 * layer_kept(s, c, c.recompute, LayerKind::Dense);
    if moe_off > 0 {
        bytes += moe_off as f64 * layer_kept(s, c, c.recompute, LayerKind::Moe);
    }
    bytes
}

/// Bytes per element of the input a GEMM keeps for its weight gradient:
/// Transformer Engine's FP8 and NVFP4 layers keep the quantized cast (its
/// `LayerNormLinear`, `LayerNormMLP`, `Linear` and `GroupedLinear` save the
/// quantized `ln_out`, activation output and input for the backward), 16
/// bits otherwise.
fn saved_gemm_input_bytes(s: &Scenario, c: &ParallelConfig) -> f64 {
    te_quantized_bytes(s, c).unwrap_or(HALF)
}

/// Bytes per element of the quantized copies Transformer Engine keeps when
/// `c` runs its GEMMs below 16 bits (Megatron-LM in FP8 or NVFP4 on a GPU
/// with those tensor cores): 1 for FP8, [`kernels::NVFP4`] with its block
/// scales; `None` otherwise (torchao's float8, torchtitan's, casts at each
/// use instead).
pub fn te_quantized_bytes(s: &Scenario, c: &ParallelConfig) -> Option<f64> {
    if c.engine != Engine::Megatron {
        return None;
    }
    match c.precision {
        Precision::Fp8 => s.gpu.fp8_peak_flops.map(|_| 1.0),
        Precision::Nvfp4 => s.gpu.fp4_peak_flops.map(|_| super::kernels::NVFP4),
        Precision::Bf16 => None,
    }
}

/// Micro-batches (in units of a whole stage's layers) whose activations
/// stage `stage` holds at its peak, without BPipe.
pub fn schedule_in_flight(c: &ParallelConfig, m: u64, stage: u64) -> f64 {
    let p = c.pp;
    match c.schedule {
        ScheduleKind::Gpipe => m as f64,
        // Batch-level EP overlap without a pipeline (its only 1F1B case)
        // pairs the next micro-batch's forward, layer by layer, with this
        // one's backward from the last layer down: what the one builds the
        // other frees, so no more micro-batches are held, only one layer
        // more at the peak ([`ep_overlap_layer_bytes`]).
        ScheduleKind::OneFOneB => (p - stage).min(m) as f64,
        ScheduleKind::Interleaved => {
            // Megatron's warm-up: (p - i - 1) * 2 + (v - 1) * n chunks, plus
            // the one in progress, n the micro-batch group (pp unless the
            // micro-batch count needs more); each chunk is 1/v of the stage's
            // layers.
            let v = c.virtual_stages;
            let n = c.microbatch_group(m).unwrap_or(p);
            let overlap = u64::from(c.ep_comm_overlap);
            let chunks = ((p - stage - 1) * 2 + (v - 1) * n + 1 + overlap).min(m * v);
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

/// Weights, gradients and optimizer states of stage `stage` on one GPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelState {
    pub weights: f64,
    pub gradients: f64,
    pub optimizer_states: f64,
}

impl ModelState {
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer_states
    }
}

/// The model state stage `stage` holds: each group's state sharded over its
/// own ranks (the shard group, all of dp x cp unless hybrid sharding keeps
/// replicas, or the experts' expert-data-parallel group), and under FP8 the
/// weights' FP8 copies.
pub fn model_state(s: &Scenario, c: &ParallelConfig, stage: u64) -> ModelState {
    let bytes = state_bytes(s, c);
    let groups = parameter_groups(s, c, stage);
    // Transformer Engine keeps a quantized copy of each layer weight and
    // its transpose (for the backward GEMMs), 1 byte each in FP8; torchao's
    // float8 (torchtitan) casts at each use and keeps none.
    let quantized = te_quantized_bytes(s, c);
    let mut state = ModelState::default();
    for group in groups {
        if group.sync == SyncMethod::ParameterServer && group.params > 0.0 {
            add_server_state(s, c, &group, &bytes, &mut state);
            continue;
        }
        let d = group.ranks as f64;
        let state_shards = match c.optimizer_sharding {
            OptimizerSharding::Full => d,
            // torchtitan's FSDP shards the fp32 parameters and gradients too.
            OptimizerSharding::OptimizerStates if c.engine == Engine::Torchtitan => d,
            _ => 1.0,
        };
        let optimizer_shards = match c.optimizer_sharding {
            OptimizerSharding::None => 1.0,
            _ => d,
        };
        // A layer weight in FP8 (`fp8_param_gather`) is its FP8 data and
        // transpose, 1 byte each, in place of 16 bits and those copies.
        // Fully sharded, the FP8 bytes are sharded like the others and
        // gathered a layer at a time.
        let weight_bytes = match (quantized.filter(|_| !group.tables), c.fp8_param_gather) {
            (Some(copy), true) => 2.0 * copy,
            (Some(copy), false) => bytes.weights + 2.0 * copy,
            (None, _) => bytes.weights,
        };
        state.weights += group.params * weight_bytes / state_shards;
        state.gradients += group.params * bytes.gradients / state_shards;
        state.optimizer_states += group.params * bytes.optimizer / optimizer_shards;
    }
    state
}

/// Parameters of the transformer layers' linears (their dense and expert
/// groups, not the embedding tables): what FP8 casts and copies.
pub fn layer_weights(groups: &[ParamGroup]) -> f64 {
    groups.iter().filter(|g| !g.tables).map(|g| g.params).sum()
}

/// A parameter-server group's state on its busiest rank, a server: its
/// shard of the table with the shard's gradients and optimizer states, and
/// the rows its own tokens touch, pulled for the forward pass with their
/// gradients (Parallax keeps sparse variables on the servers only).
fn add_server_state(
    s: &Scenario,
    c: &ParallelConfig,
    group: &ParamGroup,
    bytes: &StateBytes,
    state: &mut ModelState,
) {
    let sync = super::sparse::sparse_sync(
        s,
        c,
        group,
        SyncMethod::ParameterServer,
        &mut super::ProfileUsage::default(),
    );
    let shard = group.params / sync.partitions.max(1) as f64;
    let working = sync.rows * s.model.hidden as f64;
    state.weights += (shard + working) * bytes.weights;
    state.gradients += (shard + working) * bytes.gradients;
    state.optimizer_states += shard * bytes.optimizer;
}

/// The least device memory any stage among the peak candidates needs: its
/// model state and the workspaces, with the allocator's share and the
/// runtime outside PyTorch, before any activation or buffer. A
/// configuration this exceeds the usable memory for cannot fit, whatever
/// the switches that do not move the state (see [`state_key`]).
pub fn state_floor(s: &Scenario, c: &ParallelConfig) -> f64 {
    let k = s.coef();
    peak_candidates(s, c)
        .map(|stage| {
            let allocated = model_state(s, c, stage).total() + k.workspace_gib * GIB;
            allocated * (1.0 + fragmentation(s, c, stage)) + k.runtime_overhead_gib * GIB
        })
        .fold(0.0, f64::max)
}

/// `c` with everything that does not move the model state cleared: two
/// configurations with the same key have the same [`state_floor`].
pub fn state_key(c: &ParallelConfig) -> ParallelConfig {
    let plain = ParallelConfig::default();
    ParallelConfig {
        micro_batch: plain.micro_batch,
        recompute: plain.recompute,
        ac_frequency: plain.ac_frequency,
        sequence_parallel: plain.sequence_parallel,
        bpipe: plain.bpipe,
        stage_order: plain.stage_order,
        attention: plain.attention,
        overlap_grad_reduce: plain.overlap_grad_reduce,
        overlap_param_gather: plain.overlap_param_gather,
        tp_comm_overlap: plain.tp_comm_overlap,
        cuda_graphs: plain.cuda_graphs,
        compile: plain.compile,
        cp_comm: plain.cp_comm,
        dispatcher: plain.dispatcher,
        cross_entropy_fusion: plain.cross_entropy_fusion,
        wgrad_deferral: plain.wgrad_deferral,
        ..*c
    }
}

/// What Megatron-Core's batch-level EP overlap holds on top of a stage's
/// in-flight micro-batches without a pipeline: the layer the paired forward
/// builds before the backward beside it frees its own
/// (`combined_1f1b_schedule_for_no_pipelining`, whose
/// `TransformerModelChunkSchedulePlan` runs forward layer i beside backward
/// layer L-1-i), the largest of the stage's kinds. One measured run agrees:
/// Megatron-LM's CI test `gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4`
/// peaks at 3.79 GiB, against 3.43 GiB without the overlap's layer and 5.00
/// with a whole micro-batch more.
fn ep_overlap_layer_bytes(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    if !c.ep_comm_overlap || c.schedule != ScheduleKind::OneFOneB {
        return 0.0;
    }
    largest_layer_of_stage(s, c, stage, |kind| layer_kept(s, c, c.recompute, kind))
}

/// The largest `bytes` of the kinds of layer stage `stage` holds (an
/// all-dense stage of an MoE model counts only its dense layers).
fn largest_layer_of_stage(
    s: &Scenario,
    c: &ParallelConfig,
    stage: u64,
    bytes: impl Fn(LayerKind) -> f64,
) -> f64 {
    let (dense, moe) = super::stage_layer_kinds(s, c, stage);
    [(dense, LayerKind::Dense), (moe, LayerKind::Moe)]
        .into_iter()
        .filter(|&(count, _)| count > 0)
        .map(|(_, kind)| bytes(kind))
        .fold(0.0, f64::max)
}

pub fn stage_memory(s: &Scenario, c: &ParallelConfig, stage: u64) -> StageMemory {
    let k = s.coef();
    let model = s.model;
    let m = c.micro_batches(s.global_batch);
    let ModelState {
        weights,
        gradients,
        optimizer_states,
    } = model_state(s, c, stage);
    let t = c.tp as f64;
    let tokens = local_tokens(s, c);
    let h = model.hidden as f64;
    let held = in_flight(c, m, stage);
    let mut activations = held
        * (stage_activation_bytes(s, c, stage) - offloaded_activation_bytes(s, c))
        + ep_overlap_layer_bytes(s, c, stage);
    if c.recompute != Recompute::None && c.recompute != Recompute::Selective {
        // Recomputing rebuilds one layer's activations for one micro-batch:
        // the largest of the kinds of layer this stage holds (an all-dense
        // stage of an MoE model rebuilds a dense layer).
        activations += largest_layer_of_stage(s, c, stage, |kind| {
            layer_kept(s, c, Recompute::None, kind) - layer_kept(s, c, c.recompute, kind)
        });
    }
    if stage == 0 {
        // Embedding output (and its dropout mask), per in-flight micro-batch.
        let per_element = if model.dropout { 3.0 } else { HALF };
        activations += held * per_element * tokens * h / if c.sequence_parallel { t } else { 1.0 };
    }
    // Logits of the micro-batch at the loss on the last stage, one set per
    // prediction (the next token's and each multi-token module's).
    let loss = if stage == c.pp - 1 {
        let heads = (1 + model.mtp_layers) as f64;
        let vocab = super::vocab_per_rank(s, c);
        heads * loss_bytes_per_logit(k, c.cross_entropy_fusion) * tokens * vocab
            + deferred_wgrad_bytes(s, c, m)
    } else {
        0.0
    };
    // Pipeline send/receive buffers; ZeRO-3 keeps two layers gathered.
    let mut buffers = if c.pp > 1 {
        4.0 * HALF * tokens * h / t
    } else {
        0.0
    };
    buffers += gathered_weight_bytes(s, c, stage);
    buffers += context_parallel_buffers(s, c);
    if c.tp_comm_overlap {
        // Transformer Engine's userbuffers: a gathered (whole-sequence)
        // 16-bit buffer for each of the layer's four overlapped GEMMs.
        buffers += 4.0 * HALF * tokens * h;
    }
    if c.cuda_graphs.on() {
        buffers += k.cuda_graph_memory_gib * GIB;
    }
    buffers += k.workspace_gib * GIB;
    let mut memory = StageMemory {
        stage,
        weights,
        gradients,
        optimizer_states,
        activations,
        in_flight: held,
        loss,
        buffers,
        allocator_reserve: 0.0,
        runtime_overhead: k.runtime_overhead_gib * GIB,
        dispatcher_buffers: super::deepep::buffer_bytes(s, c, stage),
    };
    memory.allocator_reserve = fragmentation(s, c, stage) * memory.allocated();
    memory
}

/// What PyTorch's caching allocator reserves on top of the allocated
/// peak of `stage`, as a share of it: with its fixed segments,
/// `allocator_fragmentation` on a stage of dense layers and
/// `moe_allocator_fragmentation` on one with experts, whose tensor sizes
/// change with the routing every step; none with expandable segments,
/// whose free blocks' pages are unmapped before an allocation fails
/// (`expandable_segments` in PyTorch's `CUDACachingAllocator.cpp`: one
/// segment per stream grows by mapping pages, and releasing the cache
/// unmaps the whole pages of free blocks), so what stays lost is under a
/// page per free block.
fn fragmentation(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    if c.expandable_segments {
        return 0.0;
    }
    s.coef()
        .get(fragmentation_coefficient(s, c, stage))
        .expect("the fragmentation coefficients exist")
}

/// The coefficient that prices the allocator's fragmentation on `stage`,
/// by whether it holds experts (see [`fragmentation`]): the one a
/// measured reserved peak there informs.
pub fn fragmentation_coefficient(s: &Scenario, c: &ParallelConfig, stage: u64) -> &'static str {
    if s.model.moe.is_some() && super::stage_layer_kinds(s, c, stage).1 > 0 {
        "moe_allocator_fragmentation"
    } else {
        "allocator_fragmentation"
    }
}

/// The key/value buffers context parallelism holds while a layer attends:
/// the ring's chunk being sent and the one being received, forward and (for
/// their gradients) backward; the whole gathered keys and values, twice,
/// for the all-gather exchange; Q, K, V and the output re-split by head for
/// the all-to-all.
fn context_parallel_buffers(s: &Scenario, c: &ParallelConfig) -> f64 {
    if c.cp == 1 {
        return 0.0;
    }
    let model = s.model;
    let tokens = local_tokens(s, c);
    let kv_chunk = HALF * tokens * model.kv_width() as f64 / c.tp as f64;
    let heads_for_tokens = || {
        let widths = model.q_width() + model.kv_width() + model.v_width();
        2.0 * HALF * tokens * widths as f64 / c.tp as f64
    };
    match c.cp_comm {
        CpComm::P2p => 4.0 * kv_chunk,
        CpComm::AllGather => 2.0 * c.cp as f64 * kv_chunk,
        CpComm::A2a => heads_for_tokens(),
        // Both: the all-to-all's re-split tensors, then the ring's chunks.
        CpComm::A2aP2p => heads_for_tokens() + 4.0 * kv_chunk,
    }
}

/// The stages that can hold the most memory: the first (the most in-flight
/// micro-batches under every schedule, and the embedding) and the last (the
/// output head and the logits); with an uneven split also their neighbours,
/// which may hold more layers than the ends; in a mixture of experts whose
/// first layers are dense, the first stages holding only MoE layers (their
/// experts outweigh the dense layers before them). Stages between hold less
/// of everything. Where MoE layers alternate with dense ones, every stage.
pub fn peak_candidates(s: &Scenario, c: &ParallelConfig) -> impl Iterator<Item = u64> {
    let p = c.pp;
    // A stage listed twice (p <= 3) is harmless where the largest is taken.
    let mut stages = [0, p - 1, 1.min(p - 1), p.saturating_sub(2), 0, 0];
    let mut count = if c.uneven() { 4 } else { 2 };
    if let Some(moe) = s
        .model
        .moe
        .filter(|m| m.dense_layers > 0 || m.layer_freq > 1)
    {
        match first_moe_stage(c, s.model.layers, moe.dense_layers) {
            Some(stage) if moe.layer_freq == 1 => {
                stages[count] = stage;
                stages[count + 1] = (stage + 1).min(p - 1);
                count += 2;
            }
            _ => return AllOrSome::All(0..p),
        }
    }
    AllOrSome::Some(stages.into_iter().take(count))
}

/// The stage holding layer `layer` when that layer is in the first round
/// of model chunks (always without interleaving); `None` past it.
fn first_moe_stage(c: &ParallelConfig, layers: u64, layer: u64) -> Option<u64> {
    if c.pp == 1 {
        return Some(0);
    }
    c.chunk_layout(layers).first_round_stage(layer)
}

/// The candidates: a few stages, or all of them.
enum AllOrSome<S> {
    All(std::ops::Range<u64>),
    Some(S),
}

impl<S: Iterator<Item = u64>> Iterator for AllOrSome<S> {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        match self {
            AllOrSome::All(range) => range.next(),
            AllOrSome::Some(stages) => stages.next(),
        }
    }
}

/// The stage with the most memory: among [`peak_candidates`], or, under
/// BPipe with fewer micro-batches than stages (a middle pair can then hold
/// more than the ends), every stage.
/// (Returned with the first and the last stage's memory, which torchtitan
/// and Megatron-LM log, each stage computed once.)
pub fn peak_first_last(s: &Scenario, c: &ParallelConfig) -> StagePeaks {
    peak_first_last_within(s, c, f64::INFINITY).expect("every stage is within infinity")
}

/// The stages that bound a configuration's memory.
#[derive(Debug, Clone, Copy)]
pub struct StagePeaks {
    /// The stage needing the most device memory (fits are judged on it).
    pub device: StageMemory,
    /// The stage with the most in PyTorch's allocator: what the largest of
    /// the ranks' logged peaks reads. Another stage than `device` where
    /// a flex dispatcher's buffers sit beside the allocator on MoE stages
    /// only.
    pub allocator: StageMemory,
    pub first: StageMemory,
    pub last: StageMemory,
}

/// [`peak_first_last`], or none as soon as a stage needs more than
/// `limit` bytes (the rest are not computed: a search only counts misfits).
pub fn peak_first_last_within(s: &Scenario, c: &ParallelConfig, limit: f64) -> Option<StagePeaks> {
    let memory = |i: u64| Some(stage_memory(s, c, i)).filter(|m| m.total() <= limit);
    let p = c.pp;
    let first = memory(0)?;
    let last = if p > 1 { memory(p - 1)? } else { first };
    let mut peaks = StagePeaks {
        device: first,
        allocator: first,
        first,
        last,
    };
    let mut take = |x: StageMemory| {
        if x.total() > peaks.device.total() {
            peaks.device = x;
        }
        if x.reserved() > peaks.allocator.reserved() {
            peaks.allocator = x;
        }
    };
    take(last);
    let between = |i: &u64| *i != 0 && *i != p - 1;
    if c.bpipe {
        for stage in (1..p).filter(between) {
            take(memory(stage)?);
        }
    } else {
        let mut seen = [u64::MAX; 6];
        for (i, stage) in peak_candidates(s, c).filter(between).enumerate() {
            // A stage listed twice is computed once.
            if seen.contains(&stage) {
                continue;
            }
            if let Some(slot) = seen.get_mut(i) {
                *slot = stage;
            }
            take(memory(stage)?);
        }
    }
    Some(peaks)
}

/// What a deferred output-layer weight gradient keeps on the last stage at
/// its last backward pass: for each earlier micro-batch still in the
/// buffer, its 16-bit logits gradient (`grad_output_buffer`, one per
/// prediction head, all sharing the output layer) and the layer's input
/// (`embedding_activation_buffer`, split over tp under sequence
/// parallelism).
fn deferred_wgrad_bytes(s: &Scenario, c: &ParallelConfig, micro_batches: u64) -> f64 {
    let held = c.wgrad_deferral.held_before_last(micro_batches) as f64;
    if held == 0.0 {
        return 0.0;
    }
    let tokens = local_tokens(s, c);
    let heads = (1 + s.model.mtp_layers) as f64;
    let gradient = heads * HALF * tokens * super::vocab_per_rank(s, c);
    let sp = if c.sequence_parallel {
        c.tp as f64
    } else {
        1.0
    };
    let input = heads * HALF * tokens * s.model.hidden as f64 / sp;
    held * (gradient + input)
}

/// Bytes the loss holds per logit at its peak, by how its cross-entropy runs.
fn loss_bytes_per_logit(k: &crate::coefficients::Coefficients, fusion: CrossEntropyFusion) -> f64 {
    match fusion {
        CrossEntropyFusion::Off => k.logit_bytes,
        CrossEntropyFusion::Native => k.logit_bytes + k.native_cross_entropy_transient_bytes,
        // Transformer Engine's kernel reads the 16-bit logits and writes
        // their gradient over them: nothing else logits-sized is held, and
        // never more than the unfused loss holds, whatever `logit_bytes`
        // is calibrated to.
        CrossEntropyFusion::Te => HALF.min(k.logit_bytes),
    }
}
