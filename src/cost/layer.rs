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

use super::kernels::{self, HALF};
use super::{ProfileUsage, Scenario, comm};
use crate::config::{ParallelConfig, Recompute};
use crate::model::AttentionKind;
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
}

/// GPU time of one forward pass of a layer, split by kind.
#[derive(Debug, Clone, Copy)]
struct PassTime {
    gemm: f64,
    /// Attention-score products.
    attention: f64,
    /// Memory-bound passes over the attention scores (unfused attention only).
    score_passes: f64,
    /// Other memory-bound passes (norms, dropout, residuals, activation).
    elementwise: f64,
}

impl PassTime {
    fn total(&self) -> f64 {
        self.gemm + self.attention + self.score_passes + self.elementwise
    }
}

/// Forward and backward GPU time of one layer (without communication).
fn layer_passes(s: &Scenario, c: &ParallelConfig) -> (PassTime, PassTime) {
    let model = s.model;
    let k = s.coef();
    let t = c.tp as f64;
    let b = c.micro_batch as f64;
    let seq = model.seq_len as f64;
    let h = model.hidden as f64;
    let f = model.ffn_hidden as f64;
    let tokens = b * seq;
    let up_width = if model.gated_mlp { 2.0 * f } else { f };

    let linears = [
        (h, (h + model.kv_width() as f64) / t), // QKV
        (h / t, h),                             // attention output projection
        (h, up_width / t),                      // MLP up (and gate)
        (f / t, h),                             // MLP down
    ];
    let (mut gemm_fwd, mut gemm_bwd) = (0.0, 0.0);
    for (input, output) in linears {
        let (fwd, bwd) = kernels::linear_forward_backward(s, tokens, input, output);
        gemm_fwd += fwd;
        gemm_bwd += bwd;
    }

    let attention_flops = tokens * model.layer_attention_flops_per_token() / t;
    let fill = seq / (seq + k.gemm_dim_half);
    let (attention_fwd, attention_bwd) = match c.attention {
        // FlashAttention's backward recomputes the scores: 2.5x the forward FLOPs.
        AttentionKind::Flash => {
            let e = k.attention_efficiency_flash * fill;
            (
                kernels::attention_core(s, attention_flops, e),
                kernels::attention_core(s, 2.5 * attention_flops, e),
            )
        }
        AttentionKind::Standard => {
            let e = k.attention_efficiency_standard * fill;
            (
                kernels::attention_core(s, attention_flops, e),
                kernels::attention_core(s, 2.0 * attention_flops, e),
            )
        }
    };

    let traffic = elementwise_bytes(s, c);
    // torch.compile fuses the pointwise kernels: each tensor read and written once.
    let fused = if c.compile {
        k.compile_elementwise_fraction
    } else {
        1.0
    };
    let pass = |bytes: f64| kernels::memory_pass(s, bytes) * k.elementwise_traffic_scale * fused;
    let forward = PassTime {
        gemm: gemm_fwd,
        attention: attention_fwd,
        score_passes: pass(traffic.scores),
        elementwise: pass(traffic.other),
    };
    // Backward reads the saved tensors and the incoming gradient and writes
    // the outgoing gradient: about twice the forward traffic.
    let backward = PassTime {
        gemm: gemm_bwd,
        attention: attention_bwd,
        score_passes: 2.0 * forward.score_passes,
        elementwise: 2.0 * forward.elementwise,
    };
    (forward, backward)
}

/// Bytes that one layer's memory-bound kernels read and write in a forward
/// pass on one shard, counted from Megatron-LM's fused kernels.
struct Traffic {
    scores: f64,
    other: f64,
}

fn elementwise_bytes(s: &Scenario, c: &ParallelConfig) -> Traffic {
    let model = s.model;
    let t = c.tp as f64;
    let b = c.micro_batch as f64;
    let seq = model.seq_len as f64;
    let h = model.hidden as f64;
    let f = model.ffn_hidden as f64;
    let tokens = b * seq;
    // Two layer norms (read, write) and two bias-dropout-residual adds (read
    // input and residual, write output, write a 1-byte mask): 22 bytes per
    // element of the hidden state, replicated over tp unless sequence-parallel.
    let replicated = 22.0 * tokens * h / if c.sequence_parallel { t } else { 1.0 };
    // Activation of the MLP: GeLU reads and writes f; SwiGLU reads 2f, writes f.
    let activation = if model.gated_mlp { 3.0 } else { 2.0 } * HALF * tokens * f / t;
    // Unfused softmax path on a*s*s scores per micro-batch: write scores,
    // scale-mask-softmax read+write, dropout read+write+mask, read by AV.
    let scores = match c.attention {
        AttentionKind::Standard => 13.0 * b * model.heads as f64 * seq * seq / t,
        AttentionKind::Flash => 0.0,
    };
    Traffic {
        scores,
        other: replicated + activation,
    }
}

/// Forward-pass collectives of one layer: two all-reduces, or with sequence
/// parallelism two all-gathers and two reduce-scatters, over the
/// tensor-parallel group (within a node, or over whole nodes).
fn tensor_parallel_forward(s: &Scenario, c: &ParallelConfig, usage: &mut ProfileUsage) -> f64 {
    if c.tp == 1 {
        return 0.0;
    }
    let span = comm::tensor_parallel_span(s, c);
    let bytes = HALF * (c.micro_batch * s.model.seq_len * s.model.hidden) as f64;
    if c.sequence_parallel {
        2.0 * (comm::collective(s, comm::Collective::AllGather, span, bytes, usage)
            + comm::collective(s, comm::Collective::ReduceScatter, span, bytes, usage))
    } else {
        2.0 * comm::collective(s, comm::Collective::AllReduce, span, bytes, usage)
    }
}

/// Tensor-parallel collective calls per layer per micro-batch: two per
/// forward (four with sequence parallelism), as many backward, and a
/// forward's worth again for every layer recomputed whole.
fn tensor_parallel_calls(c: &ParallelConfig) -> f64 {
    if c.tp == 1 {
        return 0.0;
    }
    let forward = if c.sequence_parallel { 4.0 } else { 2.0 };
    forward * (2.0 + recomputed_forwards(c))
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

pub fn layer_time(s: &Scenario, c: &ParallelConfig, usage: &mut ProfileUsage) -> LayerTime {
    let k = s.coef();
    let (fwd, bwd) = layer_passes(s, c);
    let tp_fwd = tensor_parallel_forward(s, c, usage);
    let tp_total = tensor_parallel_total(tp_fwd, c);
    // Forward-equivalent passes the host launches, and the recomputed work.
    let every = c.ac_frequency.max(1) as f64;
    let (host_passes, recomputed_gpu, recomputed_gemm) = match c.recompute {
        Recompute::None => (3.0, 0.0, 0.0),
        // Selective recomputation redoes the attention core: about a quarter
        // of a layer's operators.
        Recompute::Selective => (3.25, fwd.attention + fwd.score_passes, 0.0),
        Recompute::Full => (4.0, fwd.total(), fwd.gemm),
        // Every other matrix multiply and the element-wise work between.
        Recompute::SelectiveOp => (3.5, fwd.gemm / 2.0 + fwd.elementwise, fwd.gemm / 2.0),
        Recompute::SelectiveLayer => (3.0 + 1.0 / every, fwd.total() / every, fwd.gemm / every),
    };
    let gemm = fwd.gemm + bwd.gemm + recomputed_gemm;
    let formula_compute = fwd.total() + bwd.total() + recomputed_gpu;
    if let Some(profile) = s.profile {
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
                };
            }
            None => usage.layer_modelled += 1,
        }
    }
    let (exposed, hidden) = tp_overlap(s, c, tp_total, gemm);
    let gpu_compute = formula_compute + k.overlap_sm_cost * hidden;
    // CUDA graphs replay a captured layer: the host launches one graph
    // instead of every kernel.
    let launch = if c.cuda_graphs {
        k.cuda_graph_host_fraction
    } else {
        1.0
    };
    let host = (host_passes * k.host_us_per_layer_pass * launch
        + tensor_parallel_calls(c) * (c.tp - 1) as f64 * k.host_sync_us_per_rank)
        * 1e-6;
    let gpu = gpu_compute + exposed;
    LayerTime {
        gpu_compute,
        tensor_parallel: exposed,
        host_excess: soft_max(host, gpu, k.host_overlap_exponent) - gpu,
        tp_link: tp_total,
        forward: fwd.total(),
        backward: bwd.total() + recomputed_gpu,
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
    let tokens = (c.micro_batch * model.seq_len) as f64;
    let h = model.hidden as f64;
    let vocab_shard = super::vocab_per_rank(s, c);
    // Embedding backward writes a dense gradient of the vocabulary shard and
    // accumulates it into the fp32 main gradient: about 12 bytes per entry.
    let embedding_grad =
        kernels::memory_pass(s, 12.0 * vocab_shard * h) * k.elementwise_traffic_scale;
    let embedding_lookup = kernels::memory_pass(s, 2.0 * HALF * tokens * h);
    let (head_fwd, head_bwd) = kernels::output_head_forward_backward(s, tokens, h, vocab_shard);
    let cross_entropy =
        kernels::memory_pass(s, k.cross_entropy_bytes_per_logit * tokens * vocab_shard);
    // The head's weight gradient is accumulated into fp32 main gradients.
    let head_grad_accumulation =
        kernels::memory_pass(s, 10.0 * vocab_shard * h) * k.elementwise_traffic_scale;
    EndsTime {
        first: embedding_lookup + embedding_grad,
        last: head_fwd + head_bwd + cross_entropy + head_grad_accumulation,
    }
}
