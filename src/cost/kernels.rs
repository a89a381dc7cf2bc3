//! Time of single GPU kernels: GEMMs, attention cores, memory-bound passes.

use super::Scenario;
use crate::config::{Engine, ParallelConfig, Precision};

/// Bytes per 16-bit element.
pub const HALF: f64 = 2.0;

/// Tensor-core efficiency of a GEMM: the large-GEMM efficiency `peak_fraction`,
/// reduced for each dimension that under-fills a tile (`d / (d + d_half)`).
fn gemm_efficiency(s: &Scenario, peak_fraction: f64, m: f64, n: f64, k: f64) -> f64 {
    let fill = |d: f64| d / (d + s.coef().gemm_dim_half);
    peak_fraction * s.measured_gemm_scale * fill(m) * fill(n) * fill(k)
}

/// Forward time of `C[m x n] = A[m x k] B[k x n]` in 16-bit: the slower of its
/// compute time at the achieved efficiency and its memory time.
fn gemm_at(s: &Scenario, peak_fraction: f64, m: f64, n: f64, k: f64) -> f64 {
    let flops = 2.0 * m * n * k;
    let compute = flops / (s.gpu.peak_flops * gemm_efficiency(s, peak_fraction, m, n, k));
    let bytes = HALF * (m * k + k * n + m * n);
    compute.max(memory_pass(s, bytes))
}

/// Forward plus backward (input and weight gradients) of one linear layer
/// over `tokens` rows, `input` to `output` features.
pub fn linear_forward_backward(s: &Scenario, tokens: f64, input: f64, output: f64) -> (f64, f64) {
    linear_at(s, s.coef().gemm_efficiency, tokens, input, output)
}

/// [`linear_forward_backward`] of a transformer layer's linear in `c`'s precision:
/// in FP8 (on a GPU with an FP8 peak) the three GEMMs run at that peak on
/// 1-byte operands, and the 16-bit activation (forward) and gradient
/// (backward) are cast, with their transposed FP8 copies, on the way in.
pub fn layer_linear(
    s: &Scenario,
    c: &ParallelConfig,
    tokens: f64,
    input: f64,
    output: f64,
) -> (f64, f64) {
    let fp8_peak = match (c.precision, s.gpu.fp8_peak_flops) {
        (Precision::Fp8, Some(peak)) => peak,
        _ => return linear_forward_backward(s, tokens, input, output),
    };
    let k = s.coef();
    let gemm = |m: f64, n: f64, kk: f64| {
        let fill = |d: f64| d / (d + k.gemm_dim_half);
        let compute =
            2.0 * m * n * kk / (fp8_peak * k.fp8_gemm_efficiency * fill(m) * fill(n) * fill(kk));
        // FP8 operands, a 16-bit result.
        let bytes = m * kk + kk * n + HALF * m * n;
        compute.max(memory_pass(s, bytes))
    };
    let cast = |elements: f64| memory_pass(s, k.fp8_cast_bytes_per_element * elements);
    // Transformer Engine (Megatron-LM) keeps its FP8 weights from the first
    // micro-batch on; torchao's float8 linears (torchtitan) cast the weight
    // at every use, forward and backward.
    let weight = match c.engine {
        Engine::Torchtitan => cast(input * output),
        Engine::Megatron => 0.0,
    };
    let forward = gemm(tokens, output, input) + cast(tokens * input) + weight;
    let backward =
        gemm(tokens, input, output) + gemm(input, output, tokens) + cast(tokens * output) + weight;
    (forward, backward)
}

/// [`linear_forward_backward`] for the output head, at its own efficiency.
pub fn output_head_forward_backward(
    s: &Scenario,
    tokens: f64,
    hidden: f64,
    vocab: f64,
) -> (f64, f64) {
    linear_at(s, s.coef().output_head_efficiency, tokens, hidden, vocab)
}

fn linear_at(s: &Scenario, peak_fraction: f64, tokens: f64, input: f64, output: f64) -> (f64, f64) {
    let forward = gemm_at(s, peak_fraction, tokens, output, input);
    let input_grad = gemm_at(s, peak_fraction, tokens, input, output);
    let weight_grad = gemm_at(s, peak_fraction, input, output, tokens);
    (forward, input_grad + weight_grad)
}

/// Time to stream `bytes` through HBM at the achieved bandwidth.
pub fn memory_pass(s: &Scenario, bytes: f64) -> f64 {
    bytes / (s.gpu.hbm_bandwidth * s.coef().hbm_efficiency * s.measured_hbm_scale)
}

/// Time for `flops` of attention-score products at the given efficiency.
pub fn attention_core(s: &Scenario, flops: f64, efficiency: f64) -> f64 {
    flops / (s.gpu.peak_flops * efficiency)
}
