//! One transformer layer on one tensor-parallel shard, for one micro-batch:
//! forward, backward and recomputation, and the host time to launch it.
//!
//! With a profile that measured the layer's shape (hidden, heads, sequence,
//! tp, sequence parallelism, recomputation), the measured forward, backward
//! and recomputation times for the micro-batch replace the GEMM, attention
//! and element-wise estimate. A measured pass is wall-clock time on the
//! device: it already holds the tensor-parallel collectives and any host
//! launch gaps, so nothing is added to it. The host excess is zero, and the
//! tensor-parallel share shown in the breakdown is the collective estimate
//! carved out of the measured total (capped at it), the rest counting as
//! compute: the layer's total is the measured total exactly, with no
//! collective or launch time counted twice. A shard timed alone on one
//! device (`paratune profile layer`, `includes_tp_comm = false`) lacks its
//! collectives: the estimate is added to it.

use super::kernels::{self, HALF, LinearInput};
use super::{ProfileUsage, Scenario, comm};
use crate::cluster::GroupSpan;
use crate::config::{
    CpComm, CrossEntropyFusion, CudaGraphs, Dispatcher, Engine, ParallelConfig, Recompute,
    RecomputeModules,
};
use crate::model::{AttentionKind, CAUSAL_SHARE, Split};
use crate::profile::{LayerArch, LayerShape};

/// Seconds per layer per micro-batch, forward + backward + recomputation.
#[derive(Debug, Clone, Copy)]
pub struct LayerTime {
    /// GPU compute: GEMMs, attention core, element-wise passes (and the
    /// SMs that overlapped tensor-parallel collectives take from them).
    pub gpu_compute: f64,
    /// Tensor-parallel collectives not hidden: all of them on Megatron-LM's
    /// compute stream, what the GEMMs cannot cover with `--tp-comm-overlap`.
    pub tensor_parallel: f64,
    /// Host launch time not hidden behind the GPU work.
    pub host_excess: f64,
    /// The tensor-parallel collectives' whole time on their link, hidden or
    /// not: what other transfers on that link queue behind.
    pub tp_link: f64,
    /// GPU time of the forward pass, and of the backward pass with its
    /// recomputation (the windows that overlapped transfers hide under).
    pub forward: f64,
    pub backward: f64,
    /// Expert parallelism's token dispatch and combine (all-to-all over the
    /// ep group) and the expert-tensor-parallel gathers, not hidden: an MoE
    /// layer waits for its tokens.
    pub expert_parallel: f64,
    /// Context parallelism's key/value exchange not hidden under the
    /// attention.
    pub context_parallel: f64,
    /// Whole times on their links, hidden or not: the all-to-alls on the
    /// ep group's, the expert-tensor-parallel collectives on the etp
    /// group's, the key/value exchange on the cp group's.
    pub ep_link: f64,
    pub etp_link: f64,
    pub cp_link: f64,
}

impl LayerTime {
    /// This time for `n` layers (every field is per layer and adds up).
    pub fn times(&self, n: f64) -> LayerTime {
        LayerTime {
            gpu_compute: n * self.gpu_compute,
            tensor_parallel: n * self.tensor_parallel,
            host_excess: n * self.host_excess,
            tp_link: n * self.tp_link,
            forward: n * self.forward,
            backward: n * self.backward,
            expert_parallel: n * self.expert_parallel,
            context_parallel: n * self.context_parallel,
            ep_link: n * self.ep_link,
            etp_link: n * self.etp_link,
            cp_link: n * self.cp_link,
        }
    }

    pub fn plus(&self, o: &LayerTime) -> LayerTime {
        LayerTime {
            gpu_compute: self.gpu_compute + o.gpu_compute,
            tensor_parallel: self.tensor_parallel + o.tensor_parallel,
            host_excess: self.host_excess + o.host_excess,
            tp_link: self.tp_link + o.tp_link,
            forward: self.forward + o.forward,
            backward: self.backward + o.backward,
            expert_parallel: self.expert_parallel + o.expert_parallel,
            context_parallel: self.context_parallel + o.context_parallel,
            ep_link: self.ep_link + o.ep_link,
            etp_link: self.etp_link + o.etp_link,
            cp_link: self.cp_link + o.cp_link,
        }
    }
}

/// Which MLP a layer has: the model's dense one, or routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    Dense,
    Moe,
}

/// Tokens the all-gather dispatcher gathers on every rank: the sequence-
/// parallel shares of all etp x ep ranks of its group.
pub fn dispatch_gathered_tokens(s: &Scenario, c: &ParallelConfig) -> f64 {
    local_tokens(s, c) / c.tp as f64 * (c.etp * c.ep) as f64
}

/// Tokens of one micro-batch on one context-parallel rank.
pub fn local_tokens(s: &Scenario, c: &ParallelConfig) -> f64 {
    (c.micro_batch * s.model.seq_len) as f64 / c.cp.max(1) as f64
}

/// Rows an MoE layer's experts compute on one rank per micro-batch: the
/// rank's share of the tokens (split over tp by sequence parallelism),
/// each routed to top-k experts, gathered over the etp ranks that split
/// each expert. Over the stage's tp x cp x dp ranks this is every token's
/// top-k rows once per etp shard.
pub fn expert_rows(s: &Scenario, c: &ParallelConfig) -> f64 {
    let topk = s.model.moe.map_or(0, |m| m.topk) as f64;
    local_tokens(s, c) / c.tp as f64 * topk * c.etp as f64
}

/// GPU time of one forward pass of a layer, split by kind.
#[derive(Debug, Clone, Copy)]
struct PassTime {
    gemm: f64,
    /// Of `gemm`, an MoE layer's experts': its work after the dispatcher's
    /// host sync.
    expert_gemm: f64,
    /// Attention-score products.
    attention: f64,
    /// Memory-bound passes over the attention scores (unfused attention only).
    score_passes: f64,
    /// Other memory-bound passes (norms, dropout, residuals, activation).
    elementwise: f64,
    /// The gaps between the pass's kernels ([`KernelGaps`]).
    gaps: f64,
    /// Of `gaps`, those of an MoE layer's kernels after the dispatcher's
    /// host sync (dispatch, experts, combine), as `expert_gemm` is of `gemm`.
    expert_gaps: f64,
}

impl PassTime {
    fn total(&self) -> f64 {
        self.gemm + self.attention + self.score_passes + self.elementwise + self.gaps
    }
}

/// GPU time between one forward pass's kernels, each costing the gap
/// between dependent kernels: `kernel_gap_us` launched one by one on a
/// stream, its `kernel_graph_gap_fraction` replayed from a CUDA graph. The
/// kernels are counted as the host model weighs a pass's operators: a
/// dense layer's [`LAYER_OPERATORS`], and an MoE layer's routing and,
/// after the dispatcher's sync, its dispatch, per-expert work and combine
/// in [`moe_host_parts`]' shares of them.
#[derive(Debug, Clone, Copy)]
struct KernelGaps {
    /// The whole forward pass's.
    forward: f64,
    /// Of `forward`, the MoE part's after the dispatcher's sync.
    after_sync: f64,
}

impl KernelGaps {
    fn of(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> KernelGaps {
        let k = s.coef();
        let (routing, after_sync) = moe_host_parts(s, c, kind);
        let eager = k.kernel_gap_us * 1e-6;
        let graphed = eager * k.kernel_graph_gap_fraction;
        // A layer's CUDA graph holds its attention and MLP, and an MoE
        // layer's router and preprocess (the export's `--cuda-graph-scope
        // attn moe_router moe_preprocess`); the dispatch and the experts
        // run eager beside it. A whole iteration's graph holds them all.
        let (layer_gap, after_sync_gap) = match c.cuda_graphs {
            CudaGraphs::Off => (eager, eager),
            CudaGraphs::Layers => (graphed, eager),
            CudaGraphs::FullIteration => (graphed, graphed),
        };
        let after_sync = LAYER_OPERATORS * after_sync * after_sync_gap;
        let layer = 1.0 + eager_rope_share(s, c) + routing;
        KernelGaps {
            forward: LAYER_OPERATORS * layer * layer_gap + after_sync,
            after_sync,
        }
    }
}

/// Forward and backward GEMM time of an MLP `width` wide split `split`
/// ways, over `rows` tokens.
fn mlp_gemms(
    s: &Scenario,
    c: &ParallelConfig,
    rows: f64,
    (width, split): (f64, f64),
    fed: LinearInput,
) -> (f64, f64) {
    let h = s.model.hidden as f64;
    let up_width = if s.model.gated_mlp {
        2.0 * width
    } else {
        width
    };
    let (up_f, up_b) = kernels::layer_linear(s, c, rows, (h, up_width / split), fed);
    // The activation (Megatron-Core's own fused kernel) feeds the second.
    let (down_f, down_b) =
        kernels::layer_linear(s, c, rows, (width / split, h), LinearInput::Other);
    (up_f + down_f, up_b + down_b)
}

/// Forward and backward GEMM time of one MoE layer's MLP part on one rank:
/// the router ([`router_gemms`]) and the experts ([`expert_gemms`]).
fn moe_gemms(s: &Scenario, c: &ParallelConfig) -> (f64, f64) {
    let (router_f, router_b) = router_gemms(s, c);
    let (experts_f, experts_b) = expert_gemms(s, c);
    (router_f + experts_f, router_b + experts_b)
}

/// Forward and backward time of an MoE layer's gating GEMM on one rank:
/// its sequence-parallel share of the tokens against every expert.
fn router_gemms(s: &Scenario, c: &ParallelConfig) -> (f64, f64) {
    let experts = s.model.moe.map_or(0, |m| m.experts) as f64;
    let tokens = local_tokens(s, c) / c.tp as f64;
    kernels::linear_forward_backward(s, tokens, s.model.hidden as f64, experts)
}

/// Forward and backward GEMM time of an MoE layer's experts on one rank,
/// the work after the dispatcher's sync: this rank's experts (E / ep of
/// them, each 1/etp wide, over the rows routed to it, the busiest rank's
/// share as the imbalance coefficient says), and the shared experts split
/// over tp.
fn expert_gemms(s: &Scenario, c: &ParallelConfig) -> (f64, f64) {
    let Some(moe) = s.model.moe else {
        return (0.0, 0.0);
    };
    let t = c.tp as f64;
    let tokens = local_tokens(s, c);
    let local_experts = (moe.experts / c.ep.max(1)) as f64;
    let rows_per_expert = expert_rows(s, c) / local_experts;
    // An MoE layer normalises apart (the router reads the norm too): the
    // experts take permuted rows, the shared experts that norm's output.
    let (expert_f, expert_b) = mlp_gemms(
        s,
        c,
        rows_per_expert,
        (moe.ffn_hidden as f64, c.etp as f64),
        LinearInput::Other,
    );
    let imbalance = s.coef().moe_load_imbalance;
    let (shared_f, shared_b) = if moe.shared_ffn_hidden > 0 {
        mlp_gemms(
            s,
            c,
            tokens,
            (moe.shared_ffn_hidden as f64, t),
            LinearInput::Other,
        )
    } else {
        (0.0, 0.0)
    };
    (
        shared_f + imbalance * local_experts * expert_f,
        shared_b + imbalance * local_experts * expert_b,
    )
}

/// What feeds the attention block's `index`-th projection (in
/// [`ModelSpec::attention_projections`]' order): Megatron-Core's layer spec
/// fuses the input norm into QKV; MLA normalises apart before its
/// down-projections and fuses the query and key/value latents' norms into
/// the up-projections.
fn norm_fed_projection(model: &crate::model::ModelSpec, index: usize) -> LinearInput {
    let fused = match model.mla {
        None => index == 0,
        Some(_) => index == 1 || index == 3,
    };
    if fused {
        LinearInput::Norm
    } else {
        LinearInput::Other
    }
}

/// Forward and backward GPU time of one layer (without communication).
fn layer_passes(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> (PassTime, PassTime) {
    let model = s.model;
    let k = s.coef();
    let t = c.tp as f64;
    let seq = model.seq_len as f64;
    let f = model.ffn_hidden as f64;
    let tokens = local_tokens(s, c);

    let experts = match kind {
        LayerKind::Dense => (0.0, 0.0),
        LayerKind::Moe => expert_gemms(s, c),
    };
    let (mut gemm_fwd, mut gemm_bwd) = match kind {
        LayerKind::Dense => mlp_gemms(s, c, tokens, (f, t), LinearInput::Norm),
        LayerKind::Moe => {
            let router = router_gemms(s, c);
            (router.0 + experts.0, router.1 + experts.1)
        }
    };
    // QKV and the output projection (MLA: its down- and up-projections).
    for (index, (input, output, split)) in model.attention_projections().into_iter().enumerate() {
        if input == 0 {
            continue;
        }
        let (input, output) = match split {
            Split::Output => (input as f64, output as f64 / t),
            Split::Input => (input as f64 / t, output as f64),
            Split::Replicated => (input as f64, output as f64),
        };
        let (fwd, bwd) = kernels::layer_linear(
            s,
            c,
            tokens,
            (input, output),
            norm_fed_projection(model, index),
        );
        gemm_fwd += fwd;
        gemm_bwd += bwd;
    }

    // Each context-parallel rank's queries attend over the whole sequence
    // (the causal half balanced by Megatron-LM's 2 x cp chunking); a ring
    // step attends one chunk of keys, so a kernel's rows hold seq / the
    // chunks of them at most ([`attention_key_chunks`]).
    let attention_flops = tokens * model.layer_attention_flops_per_token() / t;
    let keys_per_kernel = seq / attention_key_chunks(c) as f64;
    let (attention_fwd, attention_bwd) = match c.attention {
        // FlashAttention's backward recomputes the scores: 2.5x the forward
        // FLOPs. A decoder attends causally, and the fused kernel skips the
        // blocks above the diagonal: half the products (Dao, FlashAttention-2,
        // 2023, counts causal attention so, and its efficiencies with it).
        // Windowed layers compute fewer, over shorter rows, and each kind
        // runs at its rows' rate (`kernels::flash_efficiency`).
        AttentionKind::Flash => {
            model
                .attended_layers()
                .iter()
                .fold((0.0, 0.0), |(fwd, bwd), &(layers, share)| {
                    // A causal row holds half a kernel's keys, a windowed
                    // one its window (no longer than that).
                    let row_keys = (share * seq).min(CAUSAL_SHARE * keys_per_kernel);
                    let (forward, backward) =
                        kernels::flash_efficiency(s, model.attention_head_width(), row_keys);
                    let done = layers * share * attention_flops;
                    (
                        fwd + kernels::attention_core(s, done, forward),
                        bwd + kernels::attention_core(s, 2.5 * done, backward),
                    )
                })
        }
        // Batched GEMMs: a kernel's key dimension fills its tiles as a
        // GEMM's does.
        AttentionKind::Standard => {
            let fill = keys_per_kernel / (keys_per_kernel + k.gemm_dim_half);
            let e = k.attention_efficiency_standard * fill;
            (
                kernels::attention_core(s, attention_flops, e),
                kernels::attention_core(s, 2.0 * attention_flops, e),
            )
        }
    };

    let traffic = elementwise_bytes(s, c, kind);
    // torch.compile fuses the pointwise kernels: each tensor read and written once.
    let fused = if c.compile {
        k.compile_elementwise_fraction
    } else {
        1.0
    };
    let pass = |bytes: f64| kernels::memory_pass(s, bytes) * k.elementwise_traffic_scale * fused;
    let gaps = KernelGaps::of(s, c, kind);
    let forward = PassTime {
        gemm: gemm_fwd,
        expert_gemm: experts.0,
        attention: attention_fwd,
        score_passes: pass(traffic.scores),
        elementwise: pass(traffic.other + traffic.counted.0),
        gaps: gaps.forward,
        expert_gaps: gaps.after_sync,
    };
    // Backward reads the saved tensors and the incoming gradient and writes
    // the outgoing gradient: about twice the forward traffic.
    let backward = PassTime {
        gemm: gemm_bwd,
        expert_gemm: experts.1,
        attention: attention_bwd,
        score_passes: 2.0 * forward.score_passes,
        elementwise: pass(2.0 * traffic.other + traffic.counted.1),
        // The backward runs about twice the forward's kernels, as its host
        // work counts twice.
        gaps: 2.0 * gaps.forward,
        expert_gaps: 2.0 * gaps.after_sync,
    };
    (forward, backward)
}

/// Bytes that one layer's memory-bound kernels read and write in a forward
/// pass on one shard, counted from Megatron-LM's fused kernels.
struct Traffic {
    scores: f64,
    /// Kernels whose backward moves about twice their forward's bytes.
    other: f64,
    /// Kernels counted with their own backward, (forward, backward) bytes:
    /// gpt-oss's clamps ([`clamp_bytes_per_width`]) and expert biases
    /// ([`expert_bias_bytes`]), and the queries' and keys' rotary embedding
    /// and norms ([`query_key_bytes`]).
    counted: (f64, f64),
}

fn elementwise_bytes(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> Traffic {
    let model = s.model;
    let t = c.tp as f64;
    let seq = model.seq_len as f64;
    let h = model.hidden as f64;
    let f = model.ffn_hidden as f64;
    let tokens = local_tokens(s, c);
    // Two layer norms (read, write) and two bias-dropout-residual adds (read
    // input and residual, write output, write a 1-byte mask): 22 bytes per
    // element of the hidden state, replicated over tp unless sequence-parallel.
    let replicated = 22.0 * tokens * h / if c.sequence_parallel { t } else { 1.0 };
    // Activation of the MLP: GeLU reads and writes f; SwiGLU reads 2f, writes f.
    let per_width = if model.gated_mlp { 3.0 } else { 2.0 } * HALF;
    // Elements of MLP width the activations run over: the experts' over
    // their rows and the shared experts' over the tokens, or the dense MLP's.
    let (widths, permuted) = match (kind, model.moe) {
        (LayerKind::Moe, Some(moe)) => {
            let rows = expert_rows(s, c);
            (
                rows * moe.ffn_hidden as f64 / c.etp as f64
                    + tokens * moe.shared_ffn_hidden as f64 / t,
                // The permutation of the rows into expert order and back
                // (read and write h each way).
                4.0 * HALF * rows * h,
            )
        }
        _ => (tokens * f / t, 0.0),
    };
    let activation = per_width * widths + permuted;
    // Unfused softmax path on a*s*s scores per micro-batch: write scores,
    // scale-mask-softmax read+write, dropout read+write+mask, read by AV.
    let scores = match c.attention {
        AttentionKind::Standard => 13.0 * tokens * model.heads as f64 * seq / t,
        AttentionKind::Flash => 0.0,
    };
    let clamp = clamp_bytes_per_width(model) * widths;
    let (rotary_forward, rotary_backward, norms) = query_key_bytes(s, c);
    let bias = expert_bias_bytes(s, c, kind);
    Traffic {
        scores,
        other: replicated + activation,
        counted: (
            clamp + rotary_forward + norms + bias,
            CLAMP_BACKWARD_SHARE * clamp + rotary_backward + NORM_BACKWARD_SHARE * norms + bias,
        ),
    }
}

/// Forward bytes of the experts' second-linear biases on one rank, where
/// the model's linears have biases (gpt-oss). Megatron-Core's
/// `TEGroupedMLP._apply_bias` adds them expert by expert in eager PyTorch,
/// scaled by each row's routing probability: `b * p` written, `t + b * p`
/// reading both and writing the sum, and a `torch.cat` of the experts'
/// sums, 3 x 2 x 2 bytes per element of the h-wide output of every routed
/// row. The backward pass reads the incoming gradient for the bias's and
/// for the probabilities' gradients through products written and reduced:
/// about as many bytes again.
fn expert_bias_bytes(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> f64 {
    if !adds_expert_biases_eagerly(s, c, kind) {
        return 0.0;
    }
    3.0 * 2.0 * HALF * expert_rows(s, c) * s.model.hidden as f64
}

/// Whether this layer's experts add their biases expert by expert
/// ([`expert_bias_bytes`]): an MoE layer of a model with biased linears
/// under Megatron-LM.
fn adds_expert_biases_eagerly(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> bool {
    s.model.linear_bias
        && c.engine == Engine::Megatron
        && kind == LayerKind::Moe
        && s.model.moe.is_some()
}

/// Bytes one layer's queries and keys move on one shard between the QKV
/// projection and the attention kernel: (rotary embedding forward, its
/// backward, norms forward). Megatron-Core rotates them with one fused
/// kernel (`apply_rope_fusion`, on by default) that reads and writes each
/// once, in the backward pass as well, unless the rotation carries a
/// temperature ([`rope_runs_eager`]); under MLA only the rotary part of
/// each head and the shared rotary key. `--qk-layernorm` normalises each
/// query and key head with a kernel of its own (Qwen3), read and written
/// once; MLA's latent norms are fused into its up-projections and priced
/// there.
fn query_key_bytes(s: &Scenario, c: &ParallelConfig) -> (f64, f64, f64) {
    let model = s.model;
    let per_token = local_tokens(s, c) / c.tp as f64;
    let rotated = match model.mla {
        _ if !model.is_rotary() => 0.0,
        Some(mla) => ((model.heads + 1) * mla.qk_pos_head_dim) as f64,
        None => (model.q_width() + model.k_width()) as f64,
    };
    let normalised = if model.qk_layernorm && model.mla.is_none() {
        (model.q_width() + model.k_width()) as f64
    } else {
        0.0
    };
    let (forward, backward) = if rope_runs_eager(s, c) {
        EAGER_ROPE_PASSES
    } else {
        (2.0, 2.0)
    };
    (
        forward * HALF * per_token * rotated,
        backward * HALF * per_token * rotated,
        2.0 * HALF * per_token * normalised,
    )
}

/// Whether Megatron-Core rotates the queries and keys in eager PyTorch
/// instead of Transformer Engine's fused kernel: `apply_rotary_pos_emb`
/// falls back to `_apply_rotary_pos_emb_bshd` when the rotation's `mscale`
/// is not 1 ("mscale=... is not supported by TE's fused RoPE. Using
/// unfused implementation", megatron/core/models/common/embeddings/
/// rope_utils.py), and the attention passes YaRN's concentration factor as
/// that `mscale` (`_yarn_get_concentration_factor_from_config`): gpt-oss's
/// 1.35, where DeepSeek-V3's is 1. Multi-latent attention rotates with its
/// own fused kernels (`fused_apply_mla_rope_for_q`/`_kv`), whose cosines
/// and sines carry the temperature (`YarnRotaryEmbedding.
/// get_cached_cos_sin`), so it stays fused at any temperature.
fn rope_runs_eager(s: &Scenario, c: &ParallelConfig) -> bool {
    c.engine == Engine::Megatron
        && s.model.mla.is_none()
        && s.model.is_rotary()
        && s.model
            .rope_scaling
            .is_some_and(|scaling| (scaling.concentration() - 1.0).abs() > 1e-9)
}

/// Passes over the rotated queries and keys of the eager rotation,
/// (forward, backward), against the fused kernel's read and write each
/// way. Forward (`_apply_rotary_pos_emb_bshd`): `t * cos` (2), the rotated
/// half's negation (1) and concatenation (2), `* sin` (2), the sum (3)
/// and the final `torch.cat` with the empty unrotated part (2). Backward:
/// the two products' gradients (2 each), the negation's (1), the halves
/// joined again (2), the two gradients summed (3), and the slice of the
/// rotated part's gradient written into a zeroed whole (1).
const EAGER_ROPE_PASSES: (f64, f64) = (12.0, 11.0);

/// The eager rotation's kernels beyond the fused kernel's, in a forward
/// pass, as a share of a dense layer's [`LAYER_OPERATORS`]: six for each
/// of the queries and the keys (the forward's six operators above) where
/// the fused rotation runs one each.
fn eager_rope_share(s: &Scenario, c: &ParallelConfig) -> f64 {
    if rope_runs_eager(s, c) {
        (2.0 * 6.0 - 2.0) / LAYER_OPERATORS
    } else {
        0.0
    }
}

/// A norm's backward over its forward's traffic: it reads its input and the
/// incoming gradient and writes the outgoing one, 3 passes against 2.
const NORM_BACKWARD_SHARE: f64 = 3.0 / 2.0;

/// Forward bytes per element of MLP width that gpt-oss's clamps move
/// before the activation ([`crate::model::QuickGeglu`]): two eager `clamp`
/// kernels and a `torch.cat`, each reading and writing the projection's
/// 2f outputs in 16 bits, 4 x 2 x 2 bytes; none without a clamp.
/// torchtitan's gpt-oss clamps the same halves in eager PyTorch too (the
/// reference `swiglu(x, alpha, limit)`), less under torch.compile, which
/// the compile fraction covers.
fn clamp_bytes_per_width(model: &crate::model::ModelSpec) -> f64 {
    match model.quick_geglu {
        Some(glu) if glu.clamps() => 4.0 * 2.0 * HALF,
        _ => 0.0,
    }
}

/// The clamps' backward traffic over their forward's 4 passes over the
/// projection's output: each clamp's backward reads its gradient and its
/// saved input and writes the input's gradient (3 passes), the
/// concatenation's backward only slices, and `chunk`'s backward
/// concatenates the two halves' gradients again (2 passes).
const CLAMP_BACKWARD_SHARE: f64 = 5.0 / 4.0;

/// The share of a dense layer's tensor-parallel collectives a layer of
/// `kind` runs: an MoE layer keeps the attention's half of them, and the
/// MLP's half only for its shared experts (the routed experts' tokens
/// travel by all-to-all).
fn tensor_parallel_share(s: &Scenario, kind: LayerKind) -> f64 {
    match (kind, s.model.moe) {
        (LayerKind::Moe, Some(moe)) if moe.shared_ffn_hidden == 0 => 0.5,
        _ => 1.0,
    }
}

/// Forward-pass collectives of one layer: two all-reduces, or with sequence
/// parallelism two all-gathers and two reduce-scatters, over the
/// tensor-parallel group (within a node, or over whole nodes), of which
/// a layer runs its [`tensor_parallel_share`].
fn tensor_parallel_forward(
    s: &Scenario,
    c: &ParallelConfig,
    kind: LayerKind,
    usage: &mut ProfileUsage,
) -> f64 {
    if c.tp == 1 {
        return 0.0;
    }
    let span = comm::tensor_parallel_span(s, c);
    let bytes = HALF * local_tokens(s, c) * s.model.hidden as f64;
    let pairs = 2.0 * tensor_parallel_share(s, kind);
    if c.sequence_parallel {
        pairs
            * (comm::collective(s, comm::Collective::AllGather, span, bytes, usage)
                + comm::collective(s, comm::Collective::ReduceScatter, span, bytes, usage))
    } else {
        pairs * comm::collective(s, comm::Collective::AllReduce, span, bytes, usage)
    }
}

/// One MoE layer's forward token traffic: the dispatch and the combine
/// all-to-all over the ep group (each rank's top-k rows of its tokens), and
/// with etp > 1 the all-gather of the received rows over the etp group and
/// the reduce-scatter of the experts' outputs. Returns (all-to-alls, etp).
fn expert_parallel_forward(
    s: &Scenario,
    c: &ParallelConfig,
    usage: &mut ProfileUsage,
) -> (f64, f64) {
    let h = s.model.hidden as f64;
    if c.dispatcher == Dispatcher::AllGather {
        // The whole etp x ep group's tokens gathered to every rank of it,
        // the experts' outputs reduce-scattered back: one pair per
        // forward, on the group's link (reported as the ep link).
        let span = comm::expert_model_span(s, c);
        let gathered = HALF * dispatch_gathered_tokens(s, c) * h;
        let pair = comm::collective(s, comm::Collective::AllGather, span, gathered, usage)
            + comm::collective(s, comm::Collective::ReduceScatter, span, gathered, usage);
        return (pair, 0.0);
    }
    let rows = expert_rows(s, c);
    let span = comm::expert_parallel_span(s, c);
    let a2a = match c.dispatcher {
        Dispatcher::Flex | Dispatcher::HybridEp => 2.0 * deduplicated_dispatch(s, c, span),
        _ => 2.0 * comm::all_to_all(s, span, HALF * rows / c.etp as f64 * h),
    };
    let etp = if c.etp > 1 {
        let span = comm::expert_tensor_span(s, c);
        let gathered = HALF * rows * h;
        comm::collective(s, comm::Collective::AllGather, span, gathered, usage)
            + comm::collective(s, comm::Collective::ReduceScatter, span, gathered, usage)
    } else {
        0.0
    };
    (a2a, etp)
}

/// One DeepEP dispatch (or combine) over the ep ranks of `span`: each of
/// the rank's tokens crosses the network once per remote node holding one
/// of its experts, and NVLink once per further rank (from the rank itself
/// on its own node, from the receiving GPU on a remote one).
fn deduplicated_dispatch(s: &Scenario, c: &ParallelConfig, span: GroupSpan) -> f64 {
    let Some(moe) = s.model.moe else {
        return 0.0;
    };
    let row = HALF * s.model.hidden as f64;
    let tokens = local_tokens(s, c) / c.tp as f64;
    let (nodes, per_node) = (span.nodes as f64, span.per_node as f64);
    let ranks_hit = super::routing::units_hit(&moe, span.nodes * span.per_node);
    // A rank reached is the sender (on its node) or the landing GPU (on a
    // remote one) one time in per_node, else one NVLink hop away.
    let on_node = ranks_hit * (per_node - 1.0) / per_node;
    let off_node = super::routing::units_hit(&moe, span.nodes) * (nodes - 1.0) / nodes;
    comm::exchange(s, span, tokens * row * on_node, tokens * row * off_node)
}

/// A layer's context-parallel exchange, (forward, backward) times on the
/// cp group's links: the ring steps, which hide under the attention they
/// feed, and the all-to-alls or all-gathers, which come before it.
#[derive(Debug, Clone, Copy, Default)]
struct CpExchange {
    ring: (f64, f64),
    other: (f64, f64),
}

/// The chunks of keys a rank's attention kernels run over one at a time:
/// the ring's ranks (cp for p2p, cp / cp_a2a for a2a+p2p, 1 for
/// Megatron-LM's all-gather and all-to-all, which attend the whole
/// sequence at once); torchtitan's all-gather gathers the keys once but
/// still attends them chunk by chunk (PyTorch's `_templated_ring_attention`
/// loops over the cp ranks whatever rotates the keys).
fn attention_key_chunks(c: &ParallelConfig) -> u64 {
    match (c.engine, c.cp_comm) {
        (Engine::Torchtitan, CpComm::AllGather) => c.cp,
        (_, comm) => comm.ring_ranks(c),
    }
    .max(1)
}

/// Ring steps a context-parallel rank's keys and values take per pass.
fn ring_steps(c: &ParallelConfig) -> u64 {
    c.cp_comm.ring_ranks(c).saturating_sub(1)
}

/// Context parallelism's key/value exchange per layer: forward, and the
/// backward's (keys and values again, and their gradients); measured
/// transfers are counted in `usage`.
fn context_parallel_passes(
    s: &Scenario,
    c: &ParallelConfig,
    usage: &mut ProfileUsage,
) -> CpExchange {
    if c.cp == 1 {
        return CpExchange::default();
    }
    let model = s.model;
    let t = c.tp as f64;
    let cp = c.cp as f64;
    let tokens = local_tokens(s, c);
    let kv_chunk = HALF * tokens * model.kv_width() as f64 / t;
    let span = comm::context_parallel_span(s, c);
    // Q, K, V before the attention and its output after, re-split from
    // sequence chunks to head groups and back; the backward moves their
    // gradients.
    let heads_for_tokens = |span| {
        let bytes = HALF * tokens * (2.0 * model.q_width() as f64 + model.kv_width() as f64) / t;
        let forward = comm::all_to_all(s, span, bytes);
        (forward, forward)
    };
    // Ring steps, each passing one chunk to the next rank.
    let mut ring = |span| {
        let forward = ring_steps(c) as f64 * comm::ring_step(s, span, kv_chunk, usage);
        (forward, 2.0 * forward)
    };
    match c.cp_comm {
        CpComm::P2p => CpExchange {
            ring: ring(span),
            other: (0.0, 0.0),
        },
        CpComm::A2a => CpExchange {
            ring: (0.0, 0.0),
            other: heads_for_tokens(span),
        },
        // Keys and values gathered whole; the backward gathers them again
        // and reduce-scatters their gradients.
        CpComm::AllGather => {
            let gathered = cp * kv_chunk;
            let gather = comm::collective(s, comm::Collective::AllGather, span, gathered, usage);
            let scatter =
                comm::collective(s, comm::Collective::ReduceScatter, span, gathered, usage);
            CpExchange {
                ring: (0.0, 0.0),
                other: (gather, gather + scatter),
            }
        }
        // The all-to-all within each group of cp_a2a neighbours, then a
        // ring between the groups: a rank then holds its group's tokens for
        // 1/cp_a2a of the heads, so a ring chunk is as large as p2p's.
        CpComm::A2aP2p => {
            let inner = s.placement.span(c.tp, c.cp_a2a);
            let outer = s.placement.span(c.tp * c.cp_a2a, c.cp_comm.ring_ranks(c));
            CpExchange {
                ring: ring(outer),
                other: heads_for_tokens(inner),
            }
        }
    }
}

/// Tensor-parallel collective calls per layer per micro-batch: two per
/// forward (four with sequence parallelism), as many backward, and a
/// forward's worth again for every layer recomputed whole, of which a layer
/// runs its [`tensor_parallel_share`].
fn tensor_parallel_calls(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> f64 {
    if c.tp == 1 {
        return 0.0;
    }
    let forward = if c.sequence_parallel { 4.0 } else { 2.0 };
    tensor_parallel_share(s, kind) * forward * (2.0 + recomputed_forwards(c))
}

/// Whole forward passes recomputed per layer: one under full recomputation,
/// one in `ac_frequency` under per-layer checkpointing, none otherwise (the
/// selective policies recompute inside the layer, between its collectives).
fn recomputed_forwards(c: &ParallelConfig) -> f64 {
    match c.recompute {
        Recompute::Full => 1.0,
        Recompute::SelectiveLayer => 1.0 / c.ac_frequency.max(1) as f64,
        _ => 0.0,
    }
}

/// A dense layer's eager operators in a forward pass (Megatron-Core with
/// Transformer Engine: norms, projections, attention, activation,
/// residuals; the count [`RecomputeModules`]' host shares are taken from).
pub(super) const LAYER_OPERATORS: f64 = 35.0;

/// What Megatron-LM's selective recomputation runs again in one layer of
/// `kind`: (host passes, GPU time, of which GEMMs). A layer's forward,
/// backward and optimizer-free bookkeeping are 3 passes of host work; each
/// recomputed module adds its share of a forward's operators: the attention
/// core a quarter, a norm or an activation one operator, an MLP or the
/// shared experts six (two or three GEMMs, their casts, the activation),
/// MLA's up-projections four (two GEMMs, RoPE, the concatenation), an MoE
/// layer's whole MLP part half a pass (router, permutation, dispatch,
/// experts, combine).
fn selective_recompute(
    s: &Scenario,
    c: &ParallelConfig,
    kind: LayerKind,
    fwd: &PassTime,
) -> (f64, f64, f64) {
    let modules = c.recompute_modules;
    let model = s.model;
    let k = s.coef();
    let t = c.tp as f64;
    let h = model.hidden as f64;
    let tokens = local_tokens(s, c);
    let sp = if c.sequence_parallel { t } else { 1.0 };
    let pass = |bytes: f64| kernels::memory_pass(s, bytes) * k.elementwise_traffic_scale;
    // An activation reads its input (both projections when gated) and
    // writes its output, after gpt-oss's clamps where it has them.
    let activation = if model.gated_mlp { 3.0 } else { 2.0 } * HALF + clamp_bytes_per_width(model);
    let operator = 1.0 / LAYER_OPERATORS;
    let (mut host, mut gpu, mut gemm) = (3.0, 0.0, 0.0);
    if modules.has(RecomputeModules::CORE_ATTN) {
        host += 0.25;
        gpu += fwd.attention + fwd.score_passes;
    }
    let moe = model.moe.filter(|_| kind == LayerKind::Moe);
    if modules.has(RecomputeModules::LAYERNORM) {
        let norms = f64::from(u8::from(moe.is_some()) + u8::from(model.mla.is_some()));
        host += norms * operator;
        gpu += norms * pass(2.0 * HALF * tokens * h / sp);
    }
    match moe {
        Some(moe) => {
            let rows = expert_rows(s, c);
            let width = moe.ffn_hidden as f64 / c.etp as f64;
            if modules.has(RecomputeModules::MOE) {
                let (forward, _) = moe_gemms(s, c);
                host += 0.5;
                gpu += forward + pass(activation * rows * width + 4.0 * HALF * rows * h);
                gemm += forward;
            } else {
                if modules.has(RecomputeModules::MOE_ACT) {
                    host += operator;
                    gpu += pass(activation * rows * width);
                }
                if modules.has(RecomputeModules::SHARED_EXPERTS) && moe.shared_ffn_hidden > 0 {
                    let shared = moe.shared_ffn_hidden as f64;
                    let (forward, _) = mlp_gemms(s, c, tokens, (shared, t), LinearInput::Other);
                    host += 6.0 * operator;
                    gpu += forward + pass(activation * tokens * shared / t);
                    gemm += forward;
                }
            }
        }
        None if modules.has(RecomputeModules::MLP) => {
            let f = model.ffn_hidden as f64;
            let (forward, _) = mlp_gemms(s, c, tokens, (f, t), LinearInput::Norm);
            host += 6.0 * operator;
            gpu += forward + pass(activation * tokens * f / t);
            gemm += forward;
        }
        None => {}
    }
    if modules.has(RecomputeModules::MLA_UP_PROJ) && model.mla.is_some() {
        for (input, output) in model.mla_up_projections() {
            if input == 0 {
                continue;
            }
            let (forward, _) = kernels::layer_linear(
                s,
                c,
                tokens,
                (input as f64, output as f64 / t),
                LinearInput::Norm,
            );
            gpu += forward;
            gemm += forward;
        }
        host += 4.0 * operator;
    }
    // The recomputed operators' kernels pay their gaps too, at the
    // forward pass's average per unit of host work.
    let (routing, after_sync) = moe_host_parts(s, c, kind);
    let operators = 1.0 + eager_rope_share(s, c) + routing + after_sync;
    gpu += (host - 3.0) * fwd.gaps / operators;
    (host, gpu, gemm)
}

/// Dispatches and combines an MoE layer runs again per micro-batch when
/// selective recomputation redoes its whole MLP part (`moe`): one
/// forward's worth.
fn recomputed_dispatches(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> f64 {
    let redone = c.recompute == Recompute::Selective
        && c.recompute_modules.has(RecomputeModules::MOE)
        && kind == LayerKind::Moe
        && s.model.moe.is_some();
    f64::from(u8::from(redone))
}

/// Host launch work an MoE layer adds to a pass, as a multiple of a dense
/// layer's, split at the dispatcher's sync: (routing, before it; the
/// dispatch, each local expert's GEMM launches and the combine, after it).
/// Eager under per-layer CUDA graphs too (see the coefficients); a whole
/// iteration's graph holds them.
fn moe_host_parts(s: &Scenario, c: &ParallelConfig, kind: LayerKind) -> (f64, f64) {
    match (kind, s.model.moe) {
        (LayerKind::Moe, Some(moe)) => {
            let k = s.coef();
            let local_experts = (moe.experts / c.ep.max(1)) as f64;
            // Biased experts add their second linear's bias expert by
            // expert (`expert_bias_bytes`): `b * p` and `t + b * p`, two
            // launches per expert against the four `expert_host_share`
            // counts.
            let bias = if adds_expert_biases_eagerly(s, c, kind) {
                BIAS_LAUNCHES_PER_EXPERT / GROUPED_LAUNCHES_PER_EXPERT
            } else {
                0.0
            };
            (
                k.moe_host_share * ROUTING_SHARE,
                k.moe_host_share * (1.0 - ROUTING_SHARE)
                    + local_experts * k.expert_host_share * (1.0 + bias),
            )
        }
        _ => (0.0, 0.0),
    }
}

/// Launches per local expert that `expert_host_share` counts (Transformer
/// Engine's GroupedLinear: a GEMM for each of the two linears, and a
/// quantisation of each one's input in FP8; see the coefficient's source).
const GROUPED_LAUNCHES_PER_EXPERT: f64 = 4.0;

/// Launches per local expert of Megatron-Core's eager bias add
/// (`TEGroupedMLP._apply_bias`: `b * p`, then `t + b * p`).
const BIAS_LAUNCHES_PER_EXPERT: f64 = 2.0;

/// Share of an MoE layer's own host work (`moe_host_share`) that routes,
/// before the sync: the gating GEMM, top-k, softmax and auxiliary loss
/// against the token counts, permutation, all-to-all, unpermutation and
/// combine after it (megatron/core/transformer/moe/router.py,
/// token_dispatcher.py: about as many operators each).
const ROUTING_SHARE: f64 = 0.5;

/// One MoE layer forward between two host syncs: the dispatcher copies
/// the token counts to the host after the router, so the host's lead on
/// the GPU is lost there. From that sync to the next layer's, the host
/// launches the dispatch and experts (`post_host`) and then the next
/// attention and router, while the GPU runs the experts and then that
/// attention and router (`pre_gpu`), which cannot start before the host
/// has launched it: no less than `post_host + pre_gpu`.
struct SyncSegment {
    host: f64,
    gpu: f64,
    post_host: f64,
    pre_gpu: f64,
}

impl SyncSegment {
    fn time(&self, exponent: f64) -> f64 {
        soft_max(self.host, self.gpu, exponent).max(self.post_host + self.pre_gpu)
    }
}

/// The sync segment of an MoE layer whose dispatcher syncs the host
/// (`None` for a dense layer): Megatron-Core's every dispatcher
/// (`cuda_sync_point`, Transformer Engine's GroupedLinear takes the
/// per-expert row counts as host integers), and any engine's all-to-all
/// over ep > 1 (its split sizes are host lists); none under a whole
/// iteration's graph, whose dispatch is sync-free.
fn host_sync_segment(
    s: &Scenario,
    c: &ParallelConfig,
    kind: LayerKind,
    fwd: &PassTime,
    (pass_host, post_host): (f64, f64),
) -> Option<SyncSegment> {
    s.model.moe.filter(|_| kind == LayerKind::Moe)?;
    if (c.engine != Engine::Megatron && c.ep <= 1) || c.cuda_graphs == CudaGraphs::FullIteration {
        return None;
    }
    Some(SyncSegment {
        host: pass_host,
        gpu: fwd.total(),
        post_host,
        pre_gpu: fwd.total() - fwd.expert_gemm - fwd.expert_gaps,
    })
}

/// `(a^k + b^k)^(1/k)`: the time of two streams of work that overlap, as
/// asynchronous kernel launches overlap host and GPU.
fn soft_max(a: f64, b: f64, k: f64) -> f64 {
    let top = a.max(b);
    if top <= 0.0 {
        return 0.0;
    }
    top * ((a / top).powf(k) + (b / top).powf(k)).powf(1.0 / k)
}

/// The layer's key in a profile.
fn shape(s: &Scenario, c: &ParallelConfig) -> LayerShape {
    LayerShape {
        hidden: s.model.hidden,
        heads: s.model.heads,
        arch: LayerArch::planned(s.model, c.attention),
        seq_len: s.model.seq_len,
        tp: c.tp,
        sequence_parallel: c.sequence_parallel,
        recompute: c.recompute,
    }
}

/// Tensor-parallel collective time of a layer's passes: forward, backward,
/// and the recomputed forwards.
fn tensor_parallel_total(tp_fwd: f64, c: &ParallelConfig) -> f64 {
    (2.0 + recomputed_forwards(c)) * tp_fwd
}

/// What `--tp-comm-overlap` leaves of `tp` seconds of tensor-parallel
/// collectives beside `gemm` seconds of the GEMMs they feed: Transformer
/// Engine pipelines each all-gather and reduce-scatter with its GEMM in tp
/// chunks, so the collectives hide under the GEMMs up to the overlap
/// efficiency, and never the first chunk. Returns (exposed, hidden).
fn tp_overlap(s: &Scenario, c: &ParallelConfig, tp: f64, gemm: f64) -> (f64, f64) {
    if !c.tp_comm_overlap || tp <= 0.0 {
        return (tp, 0.0);
    }
    let exposed = (tp - s.coef().tp_overlap_efficiency * gemm).max(tp / c.tp as f64);
    (exposed, tp - exposed)
}

/// A dense layer's time (see [`layer_time_of`]).
#[cfg(test)]
pub fn layer_time(s: &Scenario, c: &ParallelConfig, usage: &mut ProfileUsage) -> LayerTime {
    layer_time_of(s, c, LayerKind::Dense, usage)
}

/// Pipelines up to this deep keep their stages' summed layer times at hand
/// (on the stack): a prediction asks for them several times each.
const KEPT_STAGES: usize = 64;

/// The times of the model's dense and MoE layers (the second `None` for a
/// dense model), and each stage's sum of them.
#[derive(Debug, Clone, Copy)]
pub struct LayerTimes {
    pub dense: LayerTime,
    pub moe: Option<LayerTime>,
    kept: [LayerTime; KEPT_STAGES],
    /// Each kept stage's (dense, MoE) layers.
    kept_kinds: [(u64, u64); KEPT_STAGES],
    kept_stages: usize,
}

impl LayerTimes {
    pub fn of(s: &Scenario, c: &ParallelConfig, usage: &mut ProfileUsage) -> LayerTimes {
        let dense = layer_time_of(s, c, LayerKind::Dense, usage);
        let mut times = LayerTimes {
            dense,
            moe: s
                .model
                .moe
                .map(|_| layer_time_of(s, c, LayerKind::Moe, usage)),
            kept: [dense.times(0.0); KEPT_STAGES],
            kept_kinds: [(0, 0); KEPT_STAGES],
            kept_stages: 0,
        };
        let stages = c.pp as usize;
        if stages <= KEPT_STAGES {
            // Every stage asks where the MoE layers lie: work it out once.
            let layout = s.model.moe.map(|_| c.chunk_layout(s.model.layers));
            for i in 0..stages {
                let kinds = super::stage_layer_kinds_in(s, c, layout.as_ref(), i as u64);
                times.kept_kinds[i] = kinds;
                times.kept[i] = times.summed_of(kinds);
            }
            times.kept_stages = stages;
        }
        times
    }

    /// The summed time of stage `stage`'s layers.
    pub fn stage(&self, s: &Scenario, c: &ParallelConfig, stage: u64) -> LayerTime {
        match self.kept.get(stage as usize) {
            Some(kept) if (stage as usize) < self.kept_stages => *kept,
            _ => self.summed(s, c, stage),
        }
    }

    /// Stage `stage`'s (dense, MoE) layers ([`super::stage_layer_kinds`]).
    pub fn stage_kinds(&self, s: &Scenario, c: &ParallelConfig, stage: u64) -> (u64, u64) {
        match self.kept_kinds.get(stage as usize) {
            Some(&kinds) if (stage as usize) < self.kept_stages => kinds,
            _ => super::stage_layer_kinds(s, c, stage),
        }
    }

    fn summed(&self, s: &Scenario, c: &ParallelConfig, stage: u64) -> LayerTime {
        self.summed_of(super::stage_layer_kinds(s, c, stage))
    }

    fn summed_of(&self, (dense, moe): (u64, u64)) -> LayerTime {
        match self.moe {
            Some(m) if moe > 0 => self.dense.times(dense as f64).plus(&m.times(moe as f64)),
            _ => self.dense.times((dense + moe) as f64),
        }
    }
}

pub fn layer_time_of(
    s: &Scenario,
    c: &ParallelConfig,
    kind: LayerKind,
    usage: &mut ProfileUsage,
) -> LayerTime {
    let k = s.coef();
    let (fwd, bwd) = layer_passes(s, c, kind);
    let tp_fwd = tensor_parallel_forward(s, c, kind, usage);
    let tp_total = tensor_parallel_total(tp_fwd, c);
    let passes = 2.0 + recomputed_forwards(c) + recomputed_dispatches(s, c, kind);
    let (a2a_fwd, etp_fwd) = match kind {
        LayerKind::Moe => expert_parallel_forward(s, c, usage),
        LayerKind::Dense => (0.0, 0.0),
    };
    let (ep_link, etp_link) = (passes * a2a_fwd, passes * etp_fwd);
    let x = context_parallel_passes(s, c, usage);
    let per_layer =
        |(forward, backward): (f64, f64)| forward * (1.0 + recomputed_forwards(c)) + backward;
    let (ring_link, other_link) = (per_layer(x.ring), per_layer(x.other));
    let cp_link = ring_link + other_link;
    // The ring hides under the attention it feeds; the all-to-all and
    // all-gather exchanges come before it and are not hidden.
    let (ring_exposed, cp_hidden) = if ring_link > 0.0 {
        let window = (1.0 + recomputed_forwards(c)) * fwd.attention + bwd.attention;
        let floor = ring_steps(c) as f64 * k.p2p_latency_us * 1e-6;
        super::overlapped(ring_link, window, k.cp_overlap, floor)
    } else {
        (0.0, 0.0)
    };
    let cp_exposed = ring_exposed + other_link;
    let exchange = LayerTime {
        gpu_compute: k.overlap_sm_cost * cp_hidden,
        tensor_parallel: 0.0,
        host_excess: 0.0,
        tp_link: 0.0,
        forward: 0.0,
        backward: 0.0,
        expert_parallel: ep_link + etp_link,
        context_parallel: cp_exposed,
        ep_link,
        etp_link,
        cp_link,
    };
    let measurable = kind == LayerKind::Dense && c.cp == 1;
    // Forward-equivalent passes the host launches, and the recomputed work.
    let every = c.ac_frequency.max(1) as f64;
    let (host_passes, recomputed_gpu, recomputed_gemm) = match c.recompute {
        Recompute::None => (3.0, 0.0, 0.0),
        // Selective recomputation redoes the attention core: about a quarter
        // of a layer's operators.
        Recompute::Selective => selective_recompute(s, c, kind, &fwd),
        Recompute::Full => (4.0, fwd.total(), fwd.gemm),
        // Every other matrix multiply and the element-wise work between.
        Recompute::SelectiveOp => (
            3.5,
            fwd.gemm / 2.0 + fwd.elementwise + fwd.gaps / 2.0,
            fwd.gemm / 2.0,
        ),
        Recompute::SelectiveLayer => (3.0 + 1.0 / every, fwd.total() / every, fwd.gemm / every),
    };
    let gemm = fwd.gemm + bwd.gemm + recomputed_gemm;
    let formula_compute = fwd.total() + bwd.total() + recomputed_gpu;
    if let Some(profile) = s.profile.filter(|_| measurable) {
        match profile.layer(&shape(s, c), c.micro_batch) {
            Some(measured) => {
                usage.layer_lookups += 1;
                usage.layer_extrapolated += u64::from(measured.extrapolated);
                let total = measured.total();
                // A shard timed alone lacks its collectives: add them. A
                // layer timed in a real run holds them: carve them out.
                let (compute, tp) = if measured.includes_tp_comm {
                    let tp = tp_total.min(total);
                    (total - tp, tp)
                } else {
                    (total, tp_total)
                };
                // The GEMMs' share of the measured time, from the formulas.
                let measured_gemm = compute * gemm / formula_compute.max(f64::MIN_POSITIVE);
                let (exposed, hidden) = tp_overlap(s, c, tp, measured_gemm);
                let forward = measured.forward.min(compute);
                return LayerTime {
                    gpu_compute: compute + k.overlap_sm_cost * hidden,
                    tensor_parallel: exposed,
                    host_excess: 0.0,
                    tp_link: tp,
                    forward,
                    backward: compute - forward,
                    ..exchange
                };
            }
            None => usage.layer_modelled += 1,
        }
    }
    let (exposed, hidden) = tp_overlap(s, c, tp_total, gemm);
    let gpu_compute = formula_compute + k.overlap_sm_cost * hidden;
    // CUDA graphs replay a captured layer: the host launches one graph
    // instead of every kernel. A whole iteration's graph leaves the host
    // nothing per layer: no launches, no Python between the ranks'
    // collectives, no MoE dispatch or sync (it runs sync-free).
    let launch = if c.cuda_graphs == CudaGraphs::Layers {
        k.cuda_graph_host_fraction
    } else {
        1.0
    };
    let unit = k.host_us_per_layer_pass * 1e-6;
    let (routing, after_sync) = moe_host_parts(s, c, kind);
    // The eager rotation runs inside the attention, in its graph where
    // there is one.
    let pass_host = unit * (launch * (1.0 + eager_rope_share(s, c)) + routing + after_sync);
    let host = match c.cuda_graphs {
        CudaGraphs::FullIteration => 0.0,
        CudaGraphs::Off | CudaGraphs::Layers => {
            host_passes * pass_host
                + tensor_parallel_calls(s, c, kind)
                    * (c.tp - 1) as f64
                    * k.host_sync_us_per_rank
                    * 1e-6
        }
    };
    let gpu = gpu_compute + exposed;
    let host_time = match host_sync_segment(s, c, kind, &fwd, (pass_host, unit * after_sync)) {
        // The forward passes that sync; the backward and the rest overlap
        // as one stream.
        Some(segment) => {
            let syncs = 1.0 + recomputed_forwards(c) + recomputed_dispatches(s, c, kind);
            let rest_host = (host - syncs * segment.host).max(0.0);
            let rest_gpu = (gpu - syncs * segment.gpu).max(0.0);
            syncs * segment.time(k.host_overlap_exponent)
                + soft_max(rest_host, rest_gpu, k.host_overlap_exponent)
        }
        None => soft_max(host, gpu, k.host_overlap_exponent),
    };
    LayerTime {
        gpu_compute: gpu_compute + exchange.gpu_compute,
        tensor_parallel: exposed,
        host_excess: host_time - gpu,
        tp_link: tp_total,
        forward: fwd.total(),
        backward: bwd.total() + recomputed_gpu,
        ..exchange
    }
}

/// GPU time per micro-batch of the work only the first stage (embedding) and
/// only the last stage (output head, cross-entropy) do.
#[derive(Debug, Clone, Copy)]
pub struct EndsTime {
    pub first: f64,
    pub last: f64,
}

pub fn pipeline_ends_time(s: &Scenario, c: &ParallelConfig) -> EndsTime {
    let model = s.model;
    let k = s.coef();
    let tokens = local_tokens(s, c);
    let h = model.hidden as f64;
    let vocab_shard = super::vocab_per_rank(s, c);
    // Embedding backward writes a dense gradient of the vocabulary shard and
    // accumulates it into the fp32 main gradient: about 12 bytes per entry.
    let embedding_grad =
        kernels::memory_pass(s, 12.0 * vocab_shard * h) * k.elementwise_traffic_scale;
    let embedding_lookup = kernels::memory_pass(s, 2.0 * HALF * tokens * h);
    let (head_fwd, head_bwd) = kernels::output_head_forward_backward(s, tokens, h, vocab_shard);
    let cross_entropy_bytes = match c.cross_entropy_fusion {
        CrossEntropyFusion::Off | CrossEntropyFusion::Native => k.cross_entropy_bytes_per_logit,
        CrossEntropyFusion::Te => {
            k.cross_entropy_bytes_per_logit * k.te_cross_entropy_traffic_share
        }
    };
    let cross_entropy = kernels::memory_pass(s, cross_entropy_bytes * tokens * vocab_shard);
    // The head's weight gradient is accumulated into fp32 main gradients.
    let head_grad_accumulation =
        kernels::memory_pass(s, 10.0 * vocab_shard * h) * k.elementwise_traffic_scale;
    let head = head_fwd + head_bwd + cross_entropy + head_grad_accumulation;
    // Each multi-token prediction module looks the shifted tokens up again,
    // projects [hidden; embedding] (2h -> h, column-parallel over tp) and
    // runs the shared head and its loss once more; its layer is timed among
    // the stage's layers.
    let mtp = model.mtp_layers as f64;
    let (projection_fwd, projection_bwd) =
        kernels::linear_forward_backward(s, tokens, 2.0 * h, h / c.tp as f64);
    let mtp_module = embedding_lookup + embedding_grad + projection_fwd + projection_bwd + head;
    // A deferred weight gradient leaves the micro-batches' passes for the
    // flush ([`deferred_wgrad_time`]), spread here over the micro-batches.
    let m = c.micro_batches(s.global_batch).max(1) as f64;
    EndsTime {
        first: embedding_lookup + embedding_grad,
        last: head + mtp * mtp_module - deferred_wgrad_time(s, c) / m,
    }
}

/// The output head's weight-gradient GEMMs a deferred embedding wgrad
/// moves from the last stage's backward passes to the pipeline flush, per
/// iteration: one for each prediction head of each deferred micro-batch
/// (Megatron-LM's `drain_embedding_wgrad_compute`, before the gradients
/// are finalised, while the earlier stages still run their last backward
/// passes).
pub fn deferred_wgrad_time(s: &Scenario, c: &ParallelConfig) -> f64 {
    let deferred = c.wgrad_deferral.deferred(c.micro_batches(s.global_batch));
    if deferred == 0 {
        return 0.0;
    }
    let heads = (1 + s.model.mtp_layers) as f64;
    let wgrad = kernels::output_head_weight_grad(
        s,
        local_tokens(s, c),
        s.model.hidden as f64,
        super::vocab_per_rank(s, c),
    );
    deferred as f64 * heads * wgrad
}
