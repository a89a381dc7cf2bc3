//! Time of single GPU kernels: GEMMs, attention cores, memory-bound passes.

use super::Scenario;
use crate::cluster::{AttentionRates, GpuSpec, attention_rates};
use crate::coefficients::Coefficients;
use crate::config::{Engine, Fp8Recipe, ParallelConfig, Precision};

/// Bytes per 16-bit element.
pub const HALF: f64 = 2.0;

/// Bytes per FP8 element.
const FP8: f64 = 1.0;

/// Bytes per NVFP4 element with its share of the block scales: half a
/// byte of E2M1 and one E4M3 byte per 16 elements.
pub const NVFP4: f64 = 0.5 + 1.0 / 16.0;

/// Tensor-core efficiency of a GEMM: the large-GEMM efficiency `peak_fraction`,
/// reduced for each dimension that under-fills a tile (`d / (d + d_half)`),
/// and scaled by what the profile's device sweep measured.
///
/// The measured scale is the ratio of the measured to the datasheet-derived
/// efficiency of the device's 16-bit GEMMs, and it carries over to FP8
/// GEMMs too: they run on the same tensor cores with the same tiling, so
/// what keeps this device's 16-bit GEMMs from the assumed efficiency (its
/// clocks under load, power capping, the library's kernels for these
/// tiles) keeps its FP8 ones from theirs.
fn gemm_efficiency(s: &Scenario, peak_fraction: f64, m: f64, n: f64, k: f64) -> f64 {
    let fill = |d: f64| d / (d + s.coef().gemm_dim_half);
    peak_fraction * s.measured_gemm_scale * fill(m) * fill(n) * fill(k)
}

/// The tensor cores a GEMM runs on, in one precision.
#[derive(Clone, Copy)]
struct Cores {
    /// Peak FLOP/s.
    peak: f64,
    /// The share of it large GEMMs achieve (a coefficient).
    peak_fraction: f64,
    /// Bytes per input element (the result is 16-bit).
    operand_bytes: f64,
}

/// Forward time of `C[m x n] = A[m x k] B[k x n]` on `cores`: the slower of
/// its compute time at the achieved efficiency and the time to stream its
/// operands, then the store of its 16-bit result.
///
/// The operands stream in under the tensor cores' work (the main loop's
/// pipelined loads), but each output tile is stored after its main loop
/// ends, so the store adds to the GEMM's time instead of hiding under it.
/// It is what makes a shallow GEMM slow at FP8 rates: DeepGEMM's FP8
/// kernels on H800 (deepseek-ai/DeepGEMM README, 4,096-row GEMMs) run
/// 1,358 TFLOP/s at K = 16,384, 1,025 at 2,048 and 590 at 512, the
/// 512-deep one's 268 MB bf16 result taking as long as its arithmetic.
/// `tests::deepgemm_shapes_follow_the_store_after_the_main_loop` checks the
/// rule against that table.
fn gemm(s: &Scenario, cores: Cores, m: f64, n: f64, k: f64) -> f64 {
    let flops = 2.0 * m * n * k;
    let compute = flops / (cores.peak * gemm_efficiency(s, cores.peak_fraction, m, n, k));
    let operands = cores.operand_bytes * (m * k + k * n);
    compute.max(memory_pass(s, operands)) + memory_pass(s, HALF * m * n)
}

/// The three GEMMs of one linear layer over `tokens` rows, `input` to
/// `output` features on `cores`: the forward, and the backward's input and
/// weight gradients.
fn linear_gemms(s: &Scenario, cores: Cores, tokens: f64, input: f64, output: f64) -> (f64, f64) {
    let forward = gemm(s, cores, tokens, output, input);
    let input_grad = gemm(s, cores, tokens, input, output);
    let weight_grad = gemm(s, cores, input, output, tokens);
    (forward, input_grad + weight_grad)
}

/// Forward plus backward (input and weight gradients) of one linear layer
/// over `tokens` rows, `input` to `output` features.
pub fn linear_forward_backward(s: &Scenario, tokens: f64, input: f64, output: f64) -> (f64, f64) {
    linear_at(s, s.coef().gemm_efficiency, tokens, input, output)
}

/// The GEMMs of a transformer layer's linear in `c`'s precision: in FP8 (on
/// a GPU with an FP8 peak) the three run at that peak and the FP8 GEMM
/// efficiency on 1-byte operands; in 16 bits they are
/// [`linear_forward_backward`]'s.
pub fn layer_linear_gemms(
    s: &Scenario,
    c: &ParallelConfig,
    tokens: f64,
    input: f64,
    output: f64,
) -> (f64, f64) {
    match low_precision_cores(s, c) {
        Some(cores) => linear_gemms(s, cores, tokens, input, output),
        None => linear_forward_backward(s, tokens, input, output),
    }
}

/// The tensor cores a configuration's layer GEMMs run on when they run
/// below 16 bits: FP8's peak at the FP8 GEMM efficiency on 1-byte operands,
/// or NVFP4's peak on its half-byte operands and their scales. NVFP4 GEMMs
/// are taken at the FP8 GEMMs' fraction of their peak: the same tensor
/// cores and tiles, and no FP4 matmul ceiling has been published.
fn low_precision_cores(s: &Scenario, c: &ParallelConfig) -> Option<Cores> {
    let (peak, operand_bytes) = match (c.precision, s.gpu.fp8_peak_flops, s.gpu.fp4_peak_flops) {
        (Precision::Fp8, Some(peak), _) => (peak, FP8),
        (Precision::Nvfp4, _, Some(peak)) => (peak, NVFP4),
        _ => return None,
    };
    let scaled_in_main_loop = c.precision == Precision::Fp8
        && c.fp8_recipe_on(&s.gpu.name) == Fp8Recipe::Blockwise
        && !crate::cluster::is_blackwell(&s.gpu.name);
    let share = if scaled_in_main_loop {
        HOPPER_BLOCK_SCALED_GEMM_SHARE
    } else {
        1.0
    };
    Some(Cores {
        peak,
        peak_fraction: s.coef().fp8_gemm_efficiency * share,
        operand_bytes,
    })
}

/// What an FP8 GEMM with DeepSeek-V3's block scales (`Float8BlockScaling`:
/// 1 x 128 activation and 128 x 128 weight blocks) runs at on Hopper, as a
/// share of a tensor- or row-scaled one's rate. Its scales vary along the
/// reduction dimension, so every 128-deep slice of the accumulation is
/// rescaled in the main loop instead of once in the epilogue (CUTLASS PR
/// #1932, "Blockwise Scaling for FP8": "it must be applied during the
/// mainloop, impacting performance"). pytorch/FBGEMM PR #2546 timed both
/// kernels alone on an H100 (500 W): block-scaled 870.4, 828.3 and 828.3
/// TFLOP/s against row-scaled 1,125.5, 1,082.8 and 1,141.4 on its three
/// shapes, 0.77, 0.77 and 0.73. Blackwell's Transformer Engine runs the
/// recipe's GEMMs as MXFP8 ones (TransformerEngine PR #2157), at their rate.
const HOPPER_BLOCK_SCALED_GEMM_SHARE: f64 = 0.75;

/// What wrote a linear layer's 16-bit input in the forward pass. Megatron-LM
/// builds a linear that follows a layer norm as Transformer Engine's
/// `LayerNormLinear`, whose norm kernel computes the amax of what it writes
/// (`FUSED_NORM_AMAX_FP8` in `transformer_engine/pytorch/csrc/extensions/
/// normalization.cpp`); any other input (an attention output, a separate
/// norm's, an activation, a permutation, every gradient) reaches the
/// quantizer without one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearInput {
    Norm,
    Other,
}

/// Bytes per element that quantizing a 16-bit GEMM input to FP8 moves in
/// `c`'s recipe: the cast with its transposed copy (the coefficient), the
/// recipe's scales, and, under tensor-wise current scaling, the amax that
/// must be known before the cast starts: Transformer Engine's
/// `Float8CurrentScalingQuantizer::quantize_impl` (`csrc/quantizer.cpp`)
/// runs `nvte_compute_amax` over the input first, a read of its own unless
/// the kernel that wrote the input computed it. torchao's tensor-wise
/// float8 (torchtitan) reduces the amax apart too, where torch.compile does
/// not fuse it into the producer.
fn fp8_quantize_bytes(s: &Scenario, c: &ParallelConfig, input: LinearInput) -> f64 {
    if c.precision == Precision::Nvfp4 {
        return nvfp4_quantize_bytes(s);
    }
    let recipe = c.fp8_recipe_on(&s.gpu.name);
    let scales = match recipe {
        // An E8M0 byte per 32 elements, row-wise and column-wise.
        Fp8Recipe::Mxfp8 => 2.0 / 32.0,
        // An fp32 scale per 128 elements (1 x 128 blocks), both ways.
        Fp8Recipe::Blockwise => 2.0 * 4.0 / 128.0,
        Fp8Recipe::Tensorwise | Fp8Recipe::Delayed => 0.0,
    };
    let amax_pass = match (recipe, c.engine, input) {
        (Fp8Recipe::Tensorwise, Engine::Megatron, LinearInput::Other) => HALF,
        (Fp8Recipe::Tensorwise, Engine::Torchtitan, _) if !c.compile => HALF,
        _ => 0.0,
    };
    s.coef().fp8_cast_bytes_per_element + scales + amax_pass
}

/// Bytes per element that quantizing a 16-bit GEMM input to NVFP4 moves:
/// the cast's read and its row- and column-wise copies ([`NVFP4`] bytes
/// each; the coefficient counts FP8's 1-byte copies, so each copy is half a
/// byte less plus its scales), and the amax pass the per-tensor fp32 scale
/// needs before the cast, as tensor-wise FP8 (Transformer Engine's
/// `NVFP4Quantizer` computes it apart; the random Hadamard transform on the
/// weight-gradient GEMM's inputs is fused into the column-wise cast).
fn nvfp4_quantize_bytes(s: &Scenario) -> f64 {
    s.coef().fp8_cast_bytes_per_element - 2.0 * (FP8 - NVFP4) + HALF
}

/// [`linear_forward_backward`] of a transformer layer's linear in `c`'s precision:
/// in FP8 (on a GPU with an FP8 peak) its [`layer_linear_gemms`], and the
/// quantization of the 16-bit activation (forward, written as `input`
/// says) and gradient (backward) on the way in ([`fp8_quantize_bytes`]).
pub fn layer_linear(
    s: &Scenario,
    c: &ParallelConfig,
    tokens: f64,
    (input, output): (f64, f64),
    fed: LinearInput,
) -> (f64, f64) {
    let (gemm_forward, gemm_backward) = layer_linear_gemms(s, c, tokens, input, output);
    if low_precision_cores(s, c).is_none() {
        return (gemm_forward, gemm_backward);
    }
    let cast = |elements: f64| memory_pass(s, s.coef().fp8_cast_bytes_per_element * elements);
    // Transformer Engine (Megatron-LM) keeps its FP8 weights from the first
    // micro-batch on; torchao's float8 linears (torchtitan) cast the weight
    // at every use, forward and backward.
    let weight = match c.engine {
        Engine::Torchtitan => cast(input * output),
        Engine::Megatron => 0.0,
    };
    let quantize = |elements: f64, fed| memory_pass(s, fp8_quantize_bytes(s, c, fed) * elements);
    let forward = gemm_forward + quantize(tokens * input, fed) + weight;
    let backward = gemm_backward + quantize(tokens * output, LinearInput::Other) + weight;
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

/// The output head's weight-gradient GEMM alone (the one a deferred
/// embedding wgrad moves to the pipeline flush).
pub fn output_head_weight_grad(s: &Scenario, tokens: f64, hidden: f64, vocab: f64) -> f64 {
    let cores = Cores {
        peak: s.gpu.peak_flops,
        peak_fraction: s.coef().output_head_efficiency,
        operand_bytes: HALF,
    };
    gemm(s, cores, hidden, vocab, tokens)
}

/// A 16-bit linear's GEMMs at the large-GEMM efficiency `peak_fraction`.
fn linear_at(s: &Scenario, peak_fraction: f64, tokens: f64, input: f64, output: f64) -> (f64, f64) {
    let cores = Cores {
        peak: s.gpu.peak_flops,
        peak_fraction,
        operand_bytes: HALF,
    };
    linear_gemms(s, cores, tokens, input, output)
}

/// Time to stream `bytes` through HBM at the achieved bandwidth.
pub fn memory_pass(s: &Scenario, bytes: f64) -> f64 {
    bytes / (s.gpu.hbm_bandwidth * s.coef().hbm_efficiency * s.measured_hbm_scale)
}

/// Time for `flops` of attention-score products at the given efficiency.
pub fn attention_core(s: &Scenario, flops: f64, efficiency: f64) -> f64 {
    flops / (s.gpu.peak_flops * efficiency)
}

/// Fused (flash) attention's efficiency, (forward, backward), as fractions
/// of the 16-bit peak, for heads `head_dim` wide over query rows of
/// `row_keys` keys on average: the GPU's measured rates where it has them,
/// else `attention_efficiency_flash` for both.
///
/// Between and below the measured widths the time per score element is
/// taken as linear in the head width: the tensor cores' two (forward) or
/// five (backward) products grow with it, the softmax's work per score
/// (its exponential on the special-function units, the running maximum,
/// the rescaling) does not (Dao, FlashAttention-2, 2023, section 3.1; the
/// FlashAttention-4 paper's roofline counts the exponential per score).
/// cuDNN's rates fall again past 128 (FlashAttention-3, figure 5: head
/// width 256 below 128), so a wider head (MLA's, 160 on average) keeps
/// 128's.
///
/// Each rate is carried from the row length it was measured over to
/// `row_keys` by [`row_fill`]: a query tile pays a fixed cost (loading its
/// queries, the masked diagonal tile, writing its output and statistics)
/// besides its key tiles, which a short row (a 4K sequence's, a window's)
/// amortises over less work.
pub fn flash_efficiency(s: &Scenario, head_dim: f64, row_keys: f64) -> (f64, f64) {
    let fill = |measured_over: f64| row_fill(s, row_keys) / row_fill(s, measured_over);
    match s.attention_rates {
        Some(r) => {
            // A short measured row carried to a long one may pass the peak.
            let at_row =
                |rates: [f64; 2]| [0, 1].map(|i| (rates[i] * fill(r.row_keys[i])).min(1.0));
            (
                at_head_width(at_row(r.forward), head_dim),
                at_head_width(at_row(r.backward), head_dim),
            )
        }
        // The prior comes from FlashAttention-2 on A100, whose rates vary
        // far less with the sequence than cuDNN's on Hopper and Blackwell
        // (`attention_row_half` was fitted to those, and would make A100's
        // 2K-token attention 1.4 times slower than its 8K): a short row
        // only under-fills the tiles, as a GEMM dimension does.
        None => {
            let m = row_keys.max(1.0);
            let e = s.coef().attention_efficiency_flash * m / (m + s.coef().gemm_dim_half);
            (e, e)
        }
    }
}

/// The share of its long-row rate cuDNN's fused attention reaches over
/// query rows of `row_keys` keys on average: `m / (m + attention_row_half)`.
pub fn row_fill(s: &Scenario, row_keys: f64) -> f64 {
    let m = row_keys.max(1.0);
    m / (m + s.coef().attention_row_half)
}

/// The efficiency at `head_dim` from the two measured at
/// [`AttentionRates::HEAD_DIMS`], the time per score (proportional to
/// width over efficiency) linear in the width.
fn at_head_width(rates: [f64; 2], head_dim: f64) -> f64 {
    let [narrow, wide] = AttentionRates::HEAD_DIMS.map(|d| d as f64);
    let time = |width: f64, rate: f64| width / rate;
    let (t_narrow, t_wide) = (time(narrow, rates[0]), time(wide, rates[1]));
    let d = head_dim.clamp(1.0, wide);
    let t = t_narrow + (t_wide - t_narrow) * (d - narrow) / (wide - narrow);
    // A time per score at or below zero would mean the softmax costs less
    // than nothing; keep the narrow rate there.
    if t > 0.0 { d / t } else { rates[0] }
}

/// The GPU's catalogue fused-attention rates (at its settled clock)
/// scaled by `attention_efficiency_flash` over its prior: the catalogue's
/// rates as they are until a fit moves the coefficient.
pub(super) fn scaled_attention_rates(gpu: &GpuSpec, k: &Coefficients) -> Option<AttentionRates> {
    let rates = attention_rates(&gpu.name)?;
    let prior = Coefficients::info("attention_efficiency_flash")?.prior;
    let scale = k.attention_efficiency_flash / prior;
    Some(AttentionRates {
        forward: rates.forward.map(|r| (r * scale).min(1.0)),
        backward: rates.backward.map(|r| (r * scale).min(1.0)),
        row_keys: rates.row_keys,
    })
}
