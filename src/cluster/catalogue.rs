//! Built-in GPUs and their usual nodes, from vendor datasheets.
//!
//! Peaks are dense (no structured sparsity) 16-bit tensor-core FLOP/s;
//! datasheets that quote sparse figures are halved. Memory is what the
//! driver reports (`nvidia-smi`): the "80GB" parts hold 80 GiB. Intra-node
//! bandwidth is per GPU and per direction (half the bidirectional figure
//! datasheets quote); inter-node bandwidth is per node, all NICs together.
//! A "node" is the GPUs one fast link joins: 8 on HGX/DGX/OAM boards, 72 in
//! a GB200 or GB300 NVL72 rack (one NVLink domain).

use super::{GpuSpec, NodeGroup};
use crate::units::Bandwidth;

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

/// One GPU kind and the typical 8-GPU node built around it.
struct Entry {
    name: &'static str,
    peak_tflops: f64,
    /// Dense FP8 TFLOP/s (0: no FP8 tensor cores).
    fp8_tflops: f64,
    /// Dense NVFP4 TFLOP/s (0: no FP4 tensor cores).
    fp4_tflops: f64,
    memory_bytes: f64,
    /// HBM bandwidth, TB/s (decimal).
    hbm_tb_s: f64,
    /// Per-GPU, per-direction intra-node link, GB/s.
    intra_gb_s: f64,
    /// NICs per node and gigabits per second of each.
    nics: f64,
    nic_gbit_s: f64,
    /// GPUs joined by the intra-node link.
    gpus_per_node: u64,
    /// The best-shaped 16-bit GEMM's measured rate over the dense peak
    /// (0: not measured); see [`matmul_ceiling`].
    bf16_ceiling: f64,
    /// The same for FP8 GEMMs, over the FP8 peak (0: not measured).
    fp8_ceiling: f64,
    /// Per-direction GPU-to-host link, GB/s (see HOST LINKS below).
    host_gb_s: f64,
}

// Matmul ceilings: the maximum achievable matmul FLOP/s (MAMF: the mean of
// 100 iterations of the best of a sweep of large, aligned GEMM shapes, no
// sparsity) over the dense peak, from Stas Bekman's "Machine Learning
// Engineering" (github.com/stas00/ml-engineering, compute/accelerator,
// "Maximum Achievable Matmul FLOPS comparison table", revision of 2026-08,
// CC BY-SA 4.0). BF16: A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of
// 989 ("H200 is the same"), B200 1,745.0 and B300 1,769.0 of 2,250, GB200
// 1,822.0 of 2,500. FP8: H100 SXM 1,402.6 and H200 SXM 1,453.4 of 1,979,
// B200 3,432.5 and B300 3,353.3 of 4,500, GB200 3,615.6 of 5,000. GB200
// runs B200's die at a higher clock and power, and reaches less of its
// higher peak. GB300 is B300's die (Blackwell Ultra) and is not measured
// there: given B300's fractions, as the 40 GB A100 is given the 80 GB one's.
// MI300X keeps the table's earlier 781.9 of 1,307.4 (ROCm 6.2; its 2026
// row, 668.4 on ROCm 6.3, measures a different software stack lower). The
// others are not measured (0).
// HOST LINKS, per direction: PCIe Gen3/4/5 x16 move 16/32/64 GB/s (PCI-SIG
// base specifications; V100 Gen3, A100 Gen4, Hopper, Blackwell HGX and
// MI300X Gen5). A GB200 superchip joins one Grace CPU to two B200s by
// NVLink-C2C at 900 GB/s bidirectional (NVIDIA GB200 NVL72 datasheet):
// 225 GB/s per direction for each GPU when both copy at once; GB300's
// superchip keeps that link. DGX B300's Xeon 6 hosts run the GPUs' PCIe Gen6
// links at Gen5.
#[rustfmt::skip]
const CATALOGUE: [Entry; 12] = [
    // NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS BF16, 40GB HBM2
    // at 1,555 GB/s, NVLink3 600 GB/s bidirectional; DGX A100: 8x HDR 200Gb/s.
    Entry { name: "a100-40gb", peak_tflops: 312.0, fp4_tflops: 0.0, fp8_tflops: 0.0, memory_bytes: 40.0 * GIB, hbm_tb_s: 1.555, intra_gb_s: 300.0, nics: 8.0, nic_gbit_s: 200.0, gpus_per_node: 8 , bf16_ceiling: 0.869, fp8_ceiling: 0.000, host_gb_s: 32.0 },
    // NVIDIA A100 datasheet, 80GB SXM: HBM2e at 2,039 GB/s (81,920 MiB reported).
    Entry { name: "a100-80gb", peak_tflops: 312.0, fp4_tflops: 0.0, fp8_tflops: 0.0, memory_bytes: 80.0 * GIB, hbm_tb_s: 2.039, intra_gb_s: 300.0, nics: 8.0, nic_gbit_s: 200.0, gpus_per_node: 8 , bf16_ceiling: 0.869, fp8_ceiling: 0.000, host_gb_s: 32.0 },
    // NVFP4 peaks: dense FP4 per GPU from the datasheets' dense figures (HGX
// B200 72 PF and HGX B300 108 PF per 8 GPUs, GB200 NVL72 720 PF and GB300
// NVL72 1,080 PF per 72); Hopper and older have no FP4 tensor cores.
// FP8 peaks: dense, half the datasheets' "with sparsity" figures (H100 SXM
    // 3,958, PCIe 3,026, H200 3,958, H20 296 dense, B200 9 PF per GPU
    // (72 PF per DGX B200), GB200 10 PF (720 PF per NVL72 rack), MI300X
    // 5,229.8); A100 and V100 have no FP8 tensor cores.
    // NVIDIA H100 datasheet, SXM5: 1,979 TFLOPS BF16 with sparsity (989.4 dense),
    // 80GB HBM3 at 3.35 TB/s, NVLink4 900 GB/s bidirectional; DGX H100: 8x NDR 400Gb/s.
    Entry { name: "h100-sxm", peak_tflops: 989.4, fp4_tflops: 0.0, fp8_tflops: 1978.9, memory_bytes: 80.0 * GIB, hbm_tb_s: 3.35, intra_gb_s: 450.0, nics: 8.0, nic_gbit_s: 400.0, gpus_per_node: 8 , bf16_ceiling: 0.803, fp8_ceiling: 0.709, host_gb_s: 64.0 },
    // NVIDIA H100 datasheet, PCIe: 1,513 TFLOPS BF16 with sparsity (756 dense),
    // 80GB HBM2e at 2.0 TB/s; GPUs talk over PCIe Gen5 x16, 64 GB/s per direction.
    Entry { name: "h100-pcie", peak_tflops: 756.0, fp4_tflops: 0.0, fp8_tflops: 1513.0, memory_bytes: 80.0 * GIB, hbm_tb_s: 2.0, intra_gb_s: 64.0, nics: 8.0, nic_gbit_s: 400.0, gpus_per_node: 8 , bf16_ceiling: 0.000, fp8_ceiling: 0.000, host_gb_s: 64.0 },
    // NVIDIA H200 datasheet, SXM: H100's 989.4 TFLOPS dense BF16, "141GB" HBM3e
    // (143,771 MiB reported by nvidia-smi) at 4.8 TB/s, NVLink4; HGX H200: 8x NDR 400Gb/s.
    Entry { name: "h200", peak_tflops: 989.4, fp4_tflops: 0.0, fp8_tflops: 1978.9, memory_bytes: 143_771.0 * MIB, hbm_tb_s: 4.8, intra_gb_s: 450.0, nics: 8.0, nic_gbit_s: 400.0, gpus_per_node: 8 , bf16_ceiling: 0.803, fp8_ceiling: 0.734, host_gb_s: 64.0 },
    // NVIDIA V100 datasheet, SXM2 32GB: 125 TFLOPS FP16 tensor, HBM2 at 900 GB/s,
    // NVLink2 300 GB/s bidirectional; DGX-1V: 4x EDR 100Gb/s.
    Entry { name: "v100-32gb", peak_tflops: 125.0, fp4_tflops: 0.0, fp8_tflops: 0.0, memory_bytes: 32.0 * GIB, hbm_tb_s: 0.9, intra_gb_s: 150.0, nics: 4.0, nic_gbit_s: 100.0, gpus_per_node: 8 , bf16_ceiling: 0.000, fp8_ceiling: 0.000, host_gb_s: 16.0 },
    // NVIDIA DGX B200 datasheet: 8 B200 with 1,440 GB HBM3e in all (180 GB each) at
    // 8 TB/s each, 72 PFLOPS FP8 training per system with sparsity (4.5 PF dense FP8,
    // 2.25 PF dense BF16 per GPU), NVLink5 1.8 TB/s bidirectional per GPU, 8x
    // ConnectX-7 400Gb/s for the compute fabric.
    Entry { name: "b200", peak_tflops: 2250.0, fp4_tflops: 9000.0, fp8_tflops: 4500.0, memory_bytes: 180.0 * GIB, hbm_tb_s: 8.0, intra_gb_s: 900.0, nics: 8.0, nic_gbit_s: 400.0, gpus_per_node: 8 , bf16_ceiling: 0.776, fp8_ceiling: 0.763, host_gb_s: 64.0 },
    // NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs in one NVLink domain, 360 PFLOPS
    // FP16/BF16 with sparsity (2.5 PF dense per GPU), up to 13.4 TB HBM3e (186 GB each)
    // at 576 TB/s (8 TB/s each), NVLink5 1.8 TB/s bidirectional per GPU; one
    // ConnectX-7 400Gb/s per GPU to the scale-out network.
    Entry { name: "gb200", peak_tflops: 2500.0, fp4_tflops: 10000.0, fp8_tflops: 5000.0, memory_bytes: 186.0 * GIB, hbm_tb_s: 8.0, intra_gb_s: 900.0, nics: 72.0, nic_gbit_s: 400.0, gpus_per_node: 72 , bf16_ceiling: 0.729, fp8_ceiling: 0.723, host_gb_s: 225.0 },
    // Blackwell Ultra, DGX B300: 8 B300 with 72 PFLOPS FP8 training per system
    // with sparsity (4.5 PF dense FP8, 2.25 PF dense BF16 per GPU, as B200), NVLink5
    // 1.8 TB/s bidirectional per GPU, 8x ConnectX-8 800Gb/s, HBM3e at 8 TB/s per GPU.
    // Memory as the driver reports it on the shipping "B300 SXM6 AC" part:
    // 275,040 MiB (268.6 GiB) of eight 36 GiB stacks.
    Entry { name: "b300", peak_tflops: 2250.0, fp4_tflops: 13500.0, fp8_tflops: 4500.0, memory_bytes: 275_040.0 * MIB, hbm_tb_s: 8.0, intra_gb_s: 900.0, nics: 8.0, nic_gbit_s: 800.0, gpus_per_node: 8 , bf16_ceiling: 0.786, fp8_ceiling: 0.745, host_gb_s: 64.0 },
    // NVIDIA GB300 NVL72 datasheet: 72 Blackwell Ultra GPUs in one NVLink domain,
    // 360 PFLOPS FP16/BF16 and 720 PFLOPS FP8 with sparsity (2.5 and 5 PF dense per
    // GPU, as GB200), 20 TB HBM3e at 576 TB/s (8 TB/s each; the driver reports
    // 298,500,227,072 bytes per GPU), NVLink5 1.8 TB/s bidirectional per GPU; one
    // ConnectX-8 800Gb/s per GPU to the scale-out network.
    Entry { name: "gb300", peak_tflops: 2500.0, fp4_tflops: 15000.0, fp8_tflops: 5000.0, memory_bytes: 298_500_227_072.0, hbm_tb_s: 8.0, intra_gb_s: 900.0, nics: 72.0, nic_gbit_s: 800.0, gpus_per_node: 72 , bf16_ceiling: 0.786, fp8_ceiling: 0.745, host_gb_s: 225.0 },
    // NVIDIA H20 (HGX H20 product brief): 148 TFLOPS dense BF16, 96 GB HBM3 at
    // 4.0 TB/s, NVLink 900 GB/s bidirectional; 8x 400Gb/s NICs as on HGX H100.
    Entry { name: "h20", peak_tflops: 148.0, fp4_tflops: 0.0, fp8_tflops: 296.0, memory_bytes: 96.0 * GIB, hbm_tb_s: 4.0, intra_gb_s: 450.0, nics: 8.0, nic_gbit_s: 400.0, gpus_per_node: 8 , bf16_ceiling: 0.000, fp8_ceiling: 0.000, host_gb_s: 64.0 },
    // AMD Instinct MI300X datasheet: 1,307.4 TFLOPS dense BF16, 192 GB HBM3 at 5.3 TB/s,
    // seven Infinity Fabric links of 128 GB/s bidirectional to the other seven GPUs of
    // an OAM platform (448 GB/s per direction in all); 8x 400Gb/s NICs.
    Entry { name: "mi300x", peak_tflops: 1307.4, fp4_tflops: 0.0, fp8_tflops: 2614.9, memory_bytes: 192.0 * GIB, hbm_tb_s: 5.3, intra_gb_s: 448.0, nics: 8.0, nic_gbit_s: 400.0, gpus_per_node: 8 , bf16_ceiling: 0.598, fp8_ceiling: 0.000, host_gb_s: 64.0 },
];

fn entry(name: &str) -> Option<&'static Entry> {
    let wanted = name.trim().to_lowercase();
    CATALOGUE.iter().find(|e| e.name == wanted)
}

impl Entry {
    fn gpu(&self) -> GpuSpec {
        GpuSpec {
            name: self.name.to_string(),
            peak_flops: self.peak_tflops * 1e12,
            memory_bytes: self.memory_bytes,
            hbm_bandwidth: self.hbm_tb_s * 1e12,
            fp8_peak_flops: (self.fp8_tflops > 0.0).then_some(self.fp8_tflops * 1e12),
            fp4_peak_flops: (self.fp4_tflops > 0.0).then_some(self.fp4_tflops * 1e12),
            host_link_bandwidth: Some(self.host_gb_s * 1e9),
        }
    }
}

/// How close a GPU's best GEMMs come to its datasheet peaks: measured
/// fractions, the same for every shape-independent kernel of that GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulCeiling {
    /// The best 16-bit GEMM's rate over the dense 16-bit peak.
    pub bf16: f64,
    /// The best FP8 GEMM's rate over the dense FP8 peak, where measured.
    pub fp8: Option<f64>,
    /// What back-to-back GEMMs keep of that rate once the board sits at its
    /// power limit and the clock settles, where measured
    /// ([`sustained_share`]).
    pub sustained: Option<f64>,
}

/// The measured matmul ceiling of a built-in GPU (case-insensitive name),
/// if it was measured. A fraction of peak fitted on one GPU carries to
/// another as a fraction of this ceiling: the shape and tiling losses
/// carry, the ceiling is the silicon's (its clocks under load, its
/// tensor-core pipeline).
pub fn matmul_ceiling(gpu: &str) -> Option<MatmulCeiling> {
    let e = entry(gpu)?;
    (e.bf16_ceiling > 0.0).then(|| MatmulCeiling {
        bf16: e.bf16_ceiling,
        fp8: (e.fp8_ceiling > 0.0).then_some(e.fp8_ceiling),
        sustained: sustained_share(e.name),
    })
}

/// The share of its matmul ceiling a GPU keeps under sustained tensor-core
/// work, where measured. The ceilings are bursts: the best shape's fastest
/// iterations after a short warm-up (Stas Bekman's `mamf-finder.py`). A
/// GEMM that fills every SM draws the board's power limit, and within a
/// few seconds the clock settles lower (NVIDIA/cutlass, "GEMM performance
/// measurement methodology guidelines": clocks "oscillate for around the
/// first 3 seconds" before settling, and results are to be compared at the
/// settled frequency), which is where training runs.
/// - A100 SXM (400 W): 257 TFLOP/s on random inputs under its power limit
///   (Horace He, "Strangely, Matrix Multiplications on GPUs Run Faster When
///   Given 'Predictable' Data", 2024; 295 on zeros, which draw less power)
///   against its 271.2 ceiling: 0.948.
/// - H100 SXM (700 W): a 16K x 16K x 16K matmul back to back, 12.36 ms a
///   trial at the power limit against 11.04 ms with idle gaps at 1,980 MHz
///   (Standard Kernel, "In pursuit of high-fidelity GPU kernel
///   benchmarking", 2025): 0.893.
/// - B200 (1,000 W): FlashAttention-4 in BF16 back to back, 1,450 TFLOP/s
///   at its peak iterations and 1,237 fully throttled, the SM clock from
///   1,965 to about 1,580 MHz (flashinfer-ai/flashinfer PR #2899): 0.853.
/// - GB200 (1,200 W): cuBLAS BF16 GEMMs of training shapes on N(0,1)
///   operands, 1.65-1.81 PF/s in bursts after an idle second and 1.40-1.55
///   sustained (a 5 s loop's last half, the SM clock at 1,190-1,450 MHz
///   of 2,062, "reason SW power cap"; a 30 s loop the same), in
///   marin-community/marin's `.agents/logbooks/mfu30-gemm.md` (M30C-003):
///   the ranges' midpoints, 1.475 / 1.73 = 0.853. The liquid-cooled
///   superchip's higher limit buys a higher clock for its higher peak, not
///   a steadier one.
///
/// The catalogue's attention rates are taken at the share too; a GPU
/// without one settles its attention as the GPU it takes the rates from
/// (H100 PCIe and H20 as H200), as a carried GEMM fit on a GPU without one
/// settles as the fitting GPU did.
///
/// H200 is H100's die at the same 700 W and takes its share; DGX B300's
/// air-cooled boards (1,100 W) take DGX B200's, and the GB300 superchip
/// (1,400 W) GB200's: the same die family one step up in power at each.
///
/// A fraction fitted on one GPU carries to another by the two shares'
/// ratio where both are known; other GPUs are taken to settle as the
/// fitting GPU did.
fn sustained_share(gpu: &str) -> Option<f64> {
    match gpu {
        "a100-40gb" | "a100-80gb" => Some(257.0 / 271.2),
        "h100-sxm" | "h200" => Some(11.04 / 12.36),
        "b200" | "b300" => Some(1237.0 / 1450.0),
        "gb200" | "gb300" => Some(((1.40 + 1.55) / 2.0) / ((1.65 + 1.81) / 2.0)),
        _ => None,
    }
}

/// How fast fused (flash) attention runs on a GPU: measured rates as
/// fractions of the dense 16-bit peak (the catalogue's at the settled
/// clock, a profile's as timed), at the head widths
/// [`AttentionRates::HEAD_DIMS`], each over query rows of a measured mean
/// length, FLOPs counted as FlashAttention counts them (over the unmasked
/// scores; the backward 2.5x the forward).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionRates {
    /// The forward pass.
    pub forward: [f64; 2],
    /// The backward pass.
    pub backward: [f64; 2],
    /// The mean keys per query row each head width was measured over: half
    /// the sequence for a causal mask, about the window for a windowed one.
    /// The cost model carries a rate to other rows by
    /// `attention_row_half`.
    pub row_keys: [f64; 2],
}

impl AttentionRates {
    /// The head widths the rates were measured at (and `profile device`
    /// times).
    pub const HEAD_DIMS: [u64; 2] = [64, 128];
}

// FUSED ATTENTION: cuDNN's fused attention, which Transformer Engine picks
// on Hopper and later (`get_attention_backend` in transformer_engine/
// pytorch/attention/dot_product_attention/utils.py prefers FusedAttention
// from compute capability 9.0; Megatron-LM's `--attention-backend auto`
// leaves the choice to it). Measured with cuDNN 9.19 in BF16, backward
// non-deterministic, by NVIDIA's cudnn-frontend training benchmark
// (benchmark/sdpa_benchmark_training/results/{h200,gb200,gb300}_919_only_cudnn,
// commits afa9f7c0 and df73764a; median device time, L2 flushed; FLOPs over
// the unmasked scores). Head width 128 (`llama3.1`: 64 query heads, 8 KV,
// batch 1), causal at 8K tokens, rows of 4,096 keys on average: H200 644
// TFLOP/s forward and 541 backward, GB200 1,598 and 1,311, GB300 1,887 and
// 1,385. Head width 64 (`gpt_oss`: 64 query heads, 8 KV, batch 2), causal
// over a 1,024-token window at 32K tokens, rows of 1,008 keys: H200 358 and
// 299, GB200 632 and 660, GB300 748 and 689. A windowed row has two masked
// tiles to a causal row's one, so that width's long-row rate is, if
// anything, low. H100 SXM is H200's die at the same clocks; H100 PCIe and
// H20 are the same die cut down, and B300 is GB300's die at lower power:
// they take those rates as fractions of the measured matmul ceiling, as a
// fitted GEMM efficiency carries (as fractions of the peak where their
// ceiling was not measured). (FlashAttention-3's H100 figures, cuDNN of
// 2024 at 8K: 379 and 529 forward, 432 and 518 backward; carried to the
// same rows, cuDNN 9.19's are faster at both widths.)
//
// B200 has a measurement of its own, and takes it: the same benchmark's
// B200 artifacts (`artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv`
// at bb37575d: cuDNN 9.13 through PyTorch's cuDNN backend, PyTorch nv25.09;
// 128 query heads, 8 KV, batch 1) time head width 128 causal at 8K at
// 1,171 forward and 943 backward, where GB200's rates carried by the
// ceilings gave 1,531 and 1,256. The GB200 artifacts of the same benchmark
// (d48a60eb: cuDNN 9.17 called directly, PyTorch nv25.11) time that exact
// shape at 1,584 and 1,211: B200 runs 0.74 and 0.78 of GB200 like for like,
// below the ceilings' 0.96. What that is made of is not settled. PyTorch's
// FlashAttention 2 ran 373 and 299 on B200 against 414 and 338 on GB200,
// 0.90 and 0.88, but the standalone flash-attn package on B200 ran 400 and
// 318; the rest is the cuDNN release or PyTorch's route into it. So B200's
// rates may be low for Transformer Engine on a newer cuDNN. Head width 64
// was not timed on B200: it takes GB200's at B200's like-for-like share
// at 128.
/// TFLOP/s as published, (forward, backward) at [`AttentionRates::HEAD_DIMS`].
type PublishedAttention = ([f64; 2], [f64; 2]);

/// Mean keys per query row of the published rates at each head width.
const PUBLISHED_ROW_KEYS: [f64; 2] = [1008.0, 4096.0];

const H200_ATTENTION: PublishedAttention = ([358.0, 644.0], [299.0, 541.0]);

const GB200_ATTENTION: PublishedAttention = ([632.0, 1598.0], [660.0, 1311.0]);

/// B200's measured rates at head width 128, (forward, backward), and
/// GB200's at the same shape in the same benchmark.
const B200_WIDE: (f64, f64) = (1171.0, 943.0);
const GB200_AT_B200_SHAPE: (f64, f64) = (1584.0, 1211.0);

const ATTENTION_TFLOPS: [(&str, PublishedAttention); 5] = [
    ("h100-sxm", H200_ATTENTION),
    ("h200", H200_ATTENTION),
    ("gb200", GB200_ATTENTION),
    ("gb300", ([748.0, 1887.0], [689.0, 1385.0])),
    ("b200", b200_attention()),
];

/// B200's rates: its own at head width 128, GB200's at 64 scaled by B200's
/// share of GB200's at 128, like for like.
const fn b200_attention() -> PublishedAttention {
    let ([narrow_f, _], [narrow_b, _]) = GB200_ATTENTION;
    let (forward, backward) = B200_WIDE;
    let (gb200_forward, gb200_backward) = GB200_AT_B200_SHAPE;
    (
        [narrow_f * forward / gb200_forward, forward],
        [narrow_b * backward / gb200_backward, backward],
    )
}

/// GPUs that take another's measured rates, as fractions of their measured
/// matmul ceilings: (GPU, the GPU measured).
const ATTENTION_CARRIED: [(&str, &str); 3] =
    [("h100-pcie", "h200"), ("h20", "h200"), ("b300", "gb300")];

/// The measured fused-attention rates of a built-in GPU (case-insensitive
/// name), where they were measured or carry from its die's, as fractions of
/// its 16-bit peak at its settled clock.
///
/// The published rates are bursts: the median device time of kernels of a
/// few milliseconds, between which the clock recovers. Training runs them
/// back to back at the board's power limit, where the clock settles lower,
/// so they are taken at the GPU's [`sustained_share`], the share whose ratio
/// moves a carried GEMM fit (the ceilings themselves stay bursts). B200's
/// share was itself measured on attention (FlashAttention-4 back to back),
/// and the benchmark's own longest kernels fall the same way: GB200's causal forward at head width 128 ran 1,681
/// TFLOP/s at 32K tokens and 1,467 at 128K (`artifacts/sdpa_bf16_benchmark_
/// results_NVIDIA_GB200.csv` at d48a60eb), a kernel of 0.4 s against one
/// of 21 ms.
pub fn attention_rates(gpu: &str) -> Option<AttentionRates> {
    let e = entry(gpu)?;
    let measured = |name: &str| {
        ATTENTION_TFLOPS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, rates)| rates)
    };
    let (source, (forward, backward)) = match measured(e.name) {
        Some(rates) => (e, rates),
        None => {
            let &(_, from) = ATTENTION_CARRIED.iter().find(|(n, _)| *n == e.name)?;
            (entry(from)?, measured(from)?)
        }
    };
    // A fraction of the source's peak, then of its ceiling, then of ours;
    // of the peak as it is where ours was not measured.
    let carry = if e.bf16_ceiling > 0.0 && source.bf16_ceiling > 0.0 {
        e.bf16_ceiling / source.bf16_ceiling
    } else {
        1.0
    };
    // A GPU whose settling was not measured settles as the die it takes
    // its rates from.
    let settled = sustained_share(e.name)
        .or(sustained_share(source.name))
        .unwrap_or(1.0);
    let fraction = |tflops: f64| tflops / source.peak_tflops * carry * settled;
    Some(AttentionRates {
        forward: forward.map(fraction),
        backward: backward.map(fraction),
        row_keys: PUBLISHED_ROW_KEYS,
    })
}

// HOSTS: a GB200 or GB300 NVL72 rack is one NVLink domain of 72 GPUs but 18
// compute trays, each one operating system with two superchips: four GPUs
// (NVIDIA GB200 NVL72 and GB300 NVL72 datasheets). A launcher starts its
// processes per host, so the rack's "node" of 72 is 18 launcher nodes.
const GPUS_PER_HOST: [(&str, u64); 2] = [("gb200", 4), ("gb300", 4)];

/// GPUs one host (one operating system, one launcher node) holds, for a
/// built-in GPU whose NVLink domain spans several hosts; `None` where the
/// domain is one host.
pub fn gpus_per_host(gpu: &str) -> Option<u64> {
    let e = entry(gpu)?;
    GPUS_PER_HOST
        .iter()
        .find(|(name, _)| *name == e.name)
        .map(|&(_, gpus)| gpus)
}

/// Names of the built-in GPUs, in catalogue order.
pub fn builtin_gpu_names() -> Vec<&'static str> {
    CATALOGUE.iter().map(|e| e.name).collect()
}

/// The built-in GPU of that name (case-insensitive), if any.
pub fn builtin_gpu(name: &str) -> Option<GpuSpec> {
    entry(name).map(Entry::gpu)
}

/// `nodes` typical nodes of that GPU (case-insensitive name): its usual
/// intra-node link domain (8 GPUs, 72 for GB200 and GB300 NVL72) and the NICs of the
/// vendor's reference system.
pub fn builtin_node(gpu: &str, nodes: u64) -> Option<NodeGroup> {
    let e = entry(gpu)?;
    Some(NodeGroup {
        gpu: e.gpu(),
        nodes,
        gpus_per_node: e.gpus_per_node,
        intra_node_bw: Bandwidth(e.intra_gb_s * 1e9),
        inter_node_bw: Bandwidth(e.nics * e.nic_gbit_s * 1e9 / 8.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_matmul_ceilings_are_fractions_of_peak_and_unmeasured_ones_absent() {
        for name in builtin_gpu_names() {
            if let Some(c) = matmul_ceiling(name) {
                assert!(c.bf16 > 0.5 && c.bf16 < 1.0, "{name}: {c:?}");
                assert!(c.fp8.is_none_or(|f| f > 0.5 && f < 1.0), "{name}");
                if c.fp8.is_some() {
                    assert!(builtin_gpu(name).unwrap().fp8_peak_flops.is_some());
                }
            }
        }
        // A100 SXM: 271.2 of 312 TFLOP/s.
        assert!((matmul_ceiling("A100-80GB").unwrap().bf16 - 0.869).abs() < 1e-9);
        assert!(matmul_ceiling("h100-sxm").unwrap().fp8.is_some());
        assert_eq!(matmul_ceiling("v100-32gb"), None);
        assert_eq!(matmul_ceiling("no-such-gpu"), None);
    }

    #[test]
    fn measured_attention_rates_are_fractions_of_peak_and_grow_with_the_head() {
        for name in builtin_gpu_names() {
            if let Some(r) = attention_rates(name) {
                for rates in [r.forward, r.backward] {
                    assert!(rates.iter().all(|&f| f > 0.15 && f < 1.0), "{name}: {r:?}");
                    assert!(rates[0] < rates[1], "{name}: {r:?}");
                }
            }
        }
        // H200's published burst, at H100's settled share of its clock.
        let h100 = attention_rates("H100-SXM").unwrap();
        assert!((h100.forward[1] * 989.4 - 644.0 * 11.04 / 12.36).abs() < 1e-9);
        assert_eq!(attention_rates("h200"), Some(h100));
        assert_eq!(attention_rates("a100-80gb"), None);
        assert_eq!(attention_rates("no-such-gpu"), None);
        // B200 runs its own measured rates at head width 128, and GB200's at
        // 64 scaled by B200's share of GB200's at 128 at the same shape.
        let b200 = attention_rates("b200").unwrap();
        let settled = 1237.0 / 1450.0;
        assert!((b200.backward[1] * 2250.0 - 943.0 * settled).abs() < 1e-9);
        let narrow = 632.0 * 1171.0 / 1584.0 * settled;
        assert!((b200.forward[0] * 2250.0 - narrow).abs() < 1e-9);
        assert_eq!(b200.row_keys, attention_rates("gb200").unwrap().row_keys);
        // B300 runs GB300's kernels at its own share of its matmul ceiling:
        // 1,385 TFLOP/s over GB300's ceiling (0.786 of 2,500), times B300's
        // (0.786 of 2,250).
        let b300 = attention_rates("b300").unwrap();
        let carried = 1385.0 * (0.786 * 2250.0) / (0.786 * 2500.0) * settled;
        assert!((b300.backward[1] * 2250.0 - carried).abs() < 1e-6);
        // H100 PCIe's ceiling and settling were not measured: H200's
        // fractions of peak, settled as H200's.
        assert_eq!(attention_rates("h100-pcie"), Some(h100));
        // GB200 at its own share of its burst.
        let gb200 = attention_rates("gb200").unwrap();
        let gb200_settled = (1.40 + 1.55) / (1.65 + 1.81);
        assert!((gb200.forward[1] * 2500.0 - 1598.0 * gb200_settled).abs() < 1e-9);
    }

    #[test]
    fn every_name_resolves_to_a_gpu_and_a_node_of_that_name() {
        let names = builtin_gpu_names();
        assert_eq!(names.len(), 12);
        for name in names {
            let gpu = builtin_gpu(name).unwrap();
            assert_eq!(gpu.name, name);
            assert!(gpu.peak_flops > 0.0 && gpu.memory_bytes > 0.0 && gpu.hbm_bandwidth > 0.0);
            let node = builtin_node(name, 4).unwrap();
            let per_node = if name.starts_with("gb") { 72 } else { 8 };
            assert_eq!((node.nodes, node.gpus_per_node), (4, per_node));
            assert_eq!(node.gpu, gpu);
        }
    }

    #[test]
    fn lookup_ignores_case_and_unknown_names_are_none() {
        assert_eq!(builtin_gpu("H100-SXM").unwrap().name, "h100-sxm");
        assert_eq!(builtin_node("A100-80GB", 1).unwrap().gpu.name, "a100-80gb");
        assert!(builtin_gpu("h100").is_none());
        assert!(builtin_gpu("").is_none());
        assert!(builtin_node("mi250x", 2).is_none());
    }

    #[test]
    fn datasheet_values() {
        let a100 = builtin_gpu("a100-80gb").unwrap();
        assert_eq!(a100.peak_flops, 312e12);
        assert_eq!(a100.memory_gib(), 80.0);
        assert!((a100.hbm_bandwidth - 2.039e12).abs() < 1.0);
        assert_eq!(builtin_gpu("a100-40gb").unwrap().memory_gib(), 40.0);
        let h200 = builtin_gpu("h200").unwrap();
        assert!(
            (h200.memory_gib() - 140.4).abs() < 0.01,
            "{}",
            h200.memory_gib()
        );
        assert!((h200.hbm_bandwidth - 4.8e12).abs() < 1.0);
        assert!((builtin_gpu("h100-sxm").unwrap().peak_flops - 989.4e12).abs() < 1.0);

        let gb = |b: Bandwidth| b.bytes_per_s() / 1e9;
        let a = builtin_node("a100-40gb", 1).unwrap();
        assert_eq!((gb(a.intra_node_bw), gb(a.inter_node_bw)), (300.0, 200.0));
        let h = builtin_node("h100-sxm", 1).unwrap();
        assert_eq!((gb(h.intra_node_bw), gb(h.inter_node_bw)), (450.0, 400.0));
        let p = builtin_node("h100-pcie", 1).unwrap();
        assert_eq!(gb(p.intra_node_bw), 64.0);
        let v = builtin_node("v100-32gb", 1).unwrap();
        assert_eq!((gb(v.intra_node_bw), gb(v.inter_node_bw)), (150.0, 50.0));

        // Blackwell Ultra: B200's and GB200's peaks, more memory, 800Gb/s NICs.
        let b300 = builtin_node("b300", 1).unwrap();
        assert_eq!(b300.gpu.peak_flops, builtin_gpu("b200").unwrap().peak_flops);
        assert!((b300.gpu.memory_gib() - 268.59).abs() < 0.01);
        assert_eq!(
            (gb(b300.intra_node_bw), gb(b300.inter_node_bw)),
            (900.0, 800.0)
        );
        let gb300 = builtin_node("gb300", 1).unwrap();
        assert_eq!(gb300.gpu.fp8_peak_flops, Some(5000e12));
        assert!((gb300.gpu.memory_gib() - 278.0).abs() < 0.01);
        assert_eq!(gb(gb300.inter_node_bw), 72.0 * 100.0);
        assert!(crate::cluster::is_blackwell("gb300") && crate::cluster::is_blackwell("b300"));
        // An NVL72 rack's launcher nodes are its four-GPU trays.
        assert_eq!(gpus_per_host("GB300"), Some(4));
        assert_eq!(gpus_per_host("b300"), None);
    }
}
