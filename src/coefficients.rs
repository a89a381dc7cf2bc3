//! The cost model's named coefficients: each has a unit, a physical range, a
//! prior and where that prior came from. `cost_models/*.toml` files hold
//! values for them; this module reads and writes those files.
//!
//! All coefficients are declared once, in the `coefficients!` table below;
//! the struct, the name lookup, the metadata and the file format derive from it.

use crate::cluster::{MatmulCeiling, matmul_ceiling};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Metadata of one coefficient.
#[derive(Debug, Clone, Copy)]
pub struct CoefficientInfo {
    pub name: &'static str,
    pub unit: &'static str,
    /// Inclusive physical range; calibration keeps values inside it.
    pub min: f64,
    pub max: f64,
    pub prior: f64,
    pub source: &'static str,
    /// What the coefficient governs, for reports.
    pub meaning: &'static str,
    pub scope: Scope,
}

/// Whether a fitted value holds on another GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A fraction of a datasheet figure (peak FLOP/s, HBM or link
    /// bandwidth), or a property of the training software: it carries to
    /// another GPU through that GPU's datasheet.
    Carries,
    /// A property of the machine around the GPU or of its interconnect
    /// generation (host launch and framework times, collective latencies):
    /// on another system it starts again from its prior.
    System,
}

macro_rules! coefficients {
    ($( $field:ident : $unit:literal, [$min:expr, $max:expr], $prior:expr, $scope:ident,
        $meaning:literal, $source:literal; )*) => {
        /// Values of every coefficient (see [`Coefficients::INFO`]).
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct Coefficients {
            $( pub $field: f64, )*
        }

        impl Coefficients {
            pub const INFO: &'static [CoefficientInfo] = &[
                $( CoefficientInfo {
                    name: stringify!($field),
                    unit: $unit,
                    min: $min,
                    max: $max,
                    prior: $prior,
                    source: $source,
                    meaning: $meaning,
                    scope: Scope::$scope,
                }, )*
            ];

            /// The datasheet-and-literature priors.
            pub fn priors() -> Self {
                Coefficients { $( $field: $prior, )* }
            }

            pub fn get(&self, name: &str) -> Option<f64> {
                match name {
                    $( stringify!($field) => Some(self.$field), )*
                    _ => None,
                }
            }

            pub fn set(&mut self, name: &str, value: f64) -> bool {
                match name {
                    $( stringify!($field) => { self.$field = value; true } )*
                    _ => false,
                }
            }
        }
    };
}

coefficients! {
    gemm_efficiency: "fraction of peak", [0.05, 1.0], 0.80, Carries,
        "tensor-core efficiency of large 16-bit GEMMs",
        "cuBLAS reaches about 80% of A100/H100 dense peak on large fp16/bf16 GEMMs (NVIDIA Deep Learning Performance guide, Matrix Multiplication Background)";
    gemm_dim_half: "elements", [1.0, 4096.0], 64.0, Carries,
        "a GEMM dimension this small halves its efficiency (tile under-fill, wave quantisation)",
        "half of a 128-wide cuBLAS tile: a dimension d fills d/(d+64) of the tile work on average";
    output_head_efficiency: "fraction of peak", [0.05, 1.0], 0.80, Carries,
        "tensor-core efficiency of the output head's vocabulary GEMMs (forward, both gradients)",
        "as gemm_efficiency; kept apart because vocabularies are often not multiples of the tile (50,257) and the head's gradients may be formed in fp32";
    attention_efficiency_flash: "fraction of peak", [0.05, 1.0], 0.55, Carries,
        "efficiency of fused (flash) attention, forward and backward, on a GPU without measured fused-attention rates; on one with them (the catalogue's cuDNN rates by pass and head width), those rates scaled by this over its prior",
        "FlashAttention-2 (Dao, 2023) reports 50-73% of A100 peak forward, 40-60% backward";
    attention_row_half: "keys", [1.0, 65536.0], 700.0, Carries,
        "cuDNN's fused attention over query rows of this many keys on average runs at half its long-row rate: rows of m keys reach m / (m + this) of it (a causal row averages half the sequence, a windowed one its window); it carries a GPU's measured rates to other rows",
        "fitted to cuDNN 9.19's causal sweeps from 2K to 32K tokens on H200, GB200 and GB300, forward and backward (NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/results/*_919_only_cudnn): 700 keys leaves every point within 6.9% of its series' own long-row rate (9.1% from the 8K point the catalogue quotes). In tiles, five and a half 128-key tiles of fixed cost per query tile; rows under the sweeps' 768 keys (windows) are extrapolated";
    attention_efficiency_standard: "fraction of peak", [0.05, 1.0], 0.45, Carries,
        "efficiency of the batched QK^T and AV products of unfused attention",
        "batched GEMMs with head dimension 64-128 run well below large-GEMM efficiency (cuBLAS batched GEMM measurements in Korthikanti et al., 2022)";
    hbm_efficiency: "fraction of HBM bandwidth", [0.05, 1.0], 0.80, Carries,
        "achieved fraction of HBM bandwidth in element-wise kernels",
        "streaming kernels reach 80-90% of A100/H100 HBM bandwidth (NVIDIA CUDA best-practices, STREAM-like copies)";
    elementwise_traffic_scale: "x counted bytes", [0.1, 10.0], 1.0, Carries,
        "multiplier on the bytes that layer norms, dropout, activations, residuals and softmax read and write",
        "1.0 means exactly the tensor reads and writes counted from Megatron-LM's fused kernels";
    host_us_per_layer_pass: "microseconds", [0.0, 20000.0], 400.0, Carries,
        "host (CPU) time to issue one layer's forward pass; backward counts twice. Carried to other GPUs as fitted: it is the framework's dispatch (Python, PyTorch and Transformer Engine per operator) more than the GPU's, and the 400 us prior is below every host paratune has measured (764 us on DGX A100; Megatron-LM's CI runs fit 1,841 with their logging)",
        "about 35 PyTorch eager operators per Megatron layer forward at about 12 us of dispatch each (PyTorch profiler, typical)";
    kernel_gap_us: "microseconds", [0.0, 50.0], 2.1, System,
        "GPU time each kernel of a layer costs beyond its work, launched one by one on a stream: the gap between dependent kernels (the grid's launch by the GPU's front end, its first wave's ramp-up, its last wave's drain), paid even when the host runs far ahead. A property of the GPU and its driver: on another GPU it starts again from its prior, an H100 measurement",
        "2.1 us on H100 for a kernel that timestamps its own start and end, launched on a CUDA stream (Hazy Research, \"Look Ma, No Bubbles!\", 2025); A100 1.5 us per extra kernel on a stream (Zhang et al., SC23 poster)";
    kernel_graph_gap_fraction: "fraction", [0.0, 1.0], 0.62, Carries,
        "the share of kernel_gap_us left when a CUDA graph replays the kernels (a layer's graph, or the whole iteration's)",
        "1.3 of 2.1 us on H100, the same kernel replayed from a CUDA graph and launched on a stream (Hazy Research, \"Look Ma, No Bubbles!\", 2025); B200 0.8 us per kernel with CUDA graphs (Mirage Persistent Kernel, arXiv 2512.22219, section 6)";
    host_sync_us_per_rank: "microseconds", [0.0, 5000.0], 5.0, System,
        "host-visible skew per tensor-parallel collective per extra rank, when launch-bound (ranks wait for the slowest)",
        "one NVLink ring step (see collective_step_latency_us); skew between ranks' Python processes adds to it";
    host_overlap_exponent: "exponent", [1.0, 32.0], 4.0, System,
        "k in (host^k + gpu^k)^(1/k): how well host launch work hides behind GPU work (infinity = perfect)",
        "asynchronous CUDA launches overlap host and device work; k=4 leaves 19% loss when they are equal";
    microbatch_overhead_ms: "milliseconds", [0.0, 1000.0], 1.0, System,
        "host work per micro-batch per stage outside the layers (schedule, loss, data)",
        "Megatron-LM pipeline-schedule bookkeeping, about 1 ms per micro-batch in PyTorch traces";
    iteration_overhead_ms: "milliseconds", [0.0, 10000.0], 20.0, System,
        "fixed work per iteration (gradient-norm, loss scaling, logging, launches of the optimizer)",
        "Megatron-LM step bookkeeping, tens of milliseconds in published traces";
    cross_entropy_bytes_per_logit: "bytes", [0.0, 200.0], 24.0, Carries,
        "memory traffic of the fp32 softmax cross-entropy per logit, forward and backward",
        "fp32 upcast, max, exp, sum, normalise and gradient passes: about 6 reads or writes of 4 bytes";
    intra_node_efficiency: "fraction of link bandwidth", [0.05, 1.0], 0.75, Carries,
        "achieved fraction of the intra-node link in large collectives",
        "NCCL bus bandwidth is about 75% of NVLink per-direction bandwidth on A100 (nccl-tests on DGX A100)";
    inter_node_efficiency: "fraction of link bandwidth", [0.05, 1.0], 0.80, Carries,
        "achieved fraction of the node's network injection bandwidth in large collectives",
        "InfiniBand HDR/NDR reaches 80-90% of line rate in nccl-tests across nodes";
    collective_base_latency_us: "microseconds", [0.0, 1000.0], 20.0, System,
        "fixed latency of one collective call",
        "NCCL launch and synchronisation, 10-30 us in nccl-tests small-message runs";
    collective_step_latency_us: "microseconds", [0.0, 1000.0], 5.0, System,
        "latency of one ring step (a ring all-reduce over n ranks has 2(n-1) steps)",
        "NVLink hop latency a few microseconds; nccl-tests small-message times grow about linearly with ranks";
    p2p_latency_us: "microseconds", [0.0, 1000.0], 20.0, System,
        "latency of one pipeline send/receive",
        "NCCL send/recv small-message latency, 10-30 us";
    dp_overlap: "fraction", [0.0, 1.0], 0.8, Carries,
        "share of the overlap window under which --overlap-grad-reduce and --overlap-param-gather hide the data-parallel collectives (the first stage's last backward pass for gradient buckets, the first forward passes for the weights' all-gather)",
        "PyTorch DDP (Li et al., VLDB'20) hides bucketed all-reduce behind the backward pass except the last bucket; Megatron-LM's distributed optimizer docs describe the same for reduce-scatter and all-gather";
    zero3_prefetch_overlap: "fraction", [0.0, 1.0], 0.8, Carries,
        "share of a micro-batch's compute under which ZeRO-3/FSDP's prefetched all-gathers and reduce-scatters hide",
        "FSDP (Zhao et al., VLDB'23) prefetches the next layer's parameters during the current layer's compute and overlaps gradient reduce-scatter with the backward pass";
    bpipe_overlap: "fraction", [0.0, 1.0], 0.8, Carries,
        "share of an evictor's per-micro-batch compute under which BPipe's eviction and reload hide",
        "BPipe (Kim et al., ICML'23) sends evicted activations during the following micro-batches' computation";
    host_copy_efficiency: "fraction of the link", [0.05, 1.0], 0.7, Carries,
        "share of the GPU-to-host link's per-direction bandwidth that activation offloading's copies reach",
        "nvbandwidth's device-to-host copies: 52.8 of 64 GB/s over PCIe Gen5 on H100 (NVIDIA/nvbandwidth#24), 295 of 450 GB/s over GH200's NVLink-C2C (vllm-project/vllm#6496); 0.7 between the two";
    tp_overlap_efficiency: "fraction", [0.0, 1.0], 0.8, Carries,
        "share of a layer's GEMM time under which --tp-comm-overlap hides the tensor-parallel all-gathers and reduce-scatters (the first of tp chunks is never hidden)",
        "Transformer Engine userbuffers pipeline each collective with its GEMM in chunks (Wang et al., ASPLOS'23, decomposition-based overlap, hides most of it)";
    overlap_sm_cost: "fraction", [0.0, 1.0], 0.1, Carries,
        "compute time lost per second of communication hidden under it (the SMs and memory bandwidth the communication kernels take)",
        "NCCL and userbuffer kernels run on SMs beside the GEMMs; overlapped kernels slow each other by about a tenth (Jangda et al., ASPLOS'22, CoCoNet)";
    cuda_graph_host_fraction: "fraction", [0.0, 1.0], 0.1, Carries,
        "host launch time left per layer pass with CUDA graphs, as a share of eager launching",
        "Nimble (Kwon et al., NeurIPS'20): ahead-of-time scheduling removes nearly all framework launch overhead; a graph launch costs microseconds instead of one launch per kernel";
    optimizer_step_bytes_per_param: "bytes", [0.0, 200.0], 30.0, Carries,
        "HBM traffic of the Adam step per parameter owned",
        "read fp32 master, momentum, variance, gradient (16), write master, momentum, variance (12), write 16-bit weight (2)";
    weight_bytes_per_param: "bytes", [1.0, 8.0], 2.0, Carries,
        "resident bytes of each 16-bit weight",
        "fp16/bf16 mixed precision (Micikevicius et al., 2018)";
    gradient_bytes_per_param: "bytes", [1.0, 8.0], 4.0, Carries,
        "resident gradient bytes per parameter (and bytes reduced over data-parallel ranks)",
        "Megatron-LM keeps and all-reduces fp32 main gradients by default (--accumulate-allreduce-grads-in-fp32)";
    optimizer_bytes_per_param: "bytes", [0.0, 32.0], 12.0, Carries,
        "Adam states per parameter: fp32 master weight, momentum and variance",
        "mixed-precision Adam, ZeRO paper (Rajbhandari et al., 2020)";
    logit_bytes: "bytes", [0.0, 32.0], 6.0, Carries,
        "resident bytes per output logit on the last stage (16-bit logits plus an fp32 copy)",
        "Megatron-LM's vocab-parallel cross-entropy upcasts the logits to fp32";
    native_cross_entropy_transient_bytes: "bytes", [0.0, 32.0], 4.0, Carries,
        "bytes per output logit the native fused cross-entropy (--cross-entropy-loss-fusion) allocates beyond the unfused one's at its peak",
        "Megatron-Core's fusions/fused_cross_entropy.py runs its in-place steps (subtract the max, exp, normalise) inside jit-fused functions that also reduce over the result, which TorchInductor materialises in a fresh fp32 [s, b, v] buffer (the file's own note, added with the rewrite that splits them out); one fp32 logit, 4 bytes";
    te_cross_entropy_traffic_share: "fraction", [0.05, 1.0], 0.42, Carries,
        "memory traffic of Transformer Engine's fused cross-entropy (--cross-entropy-fusion-impl te) as a share of the unfused one's (cross_entropy_bytes_per_logit)",
        "transformer_engine/pytorch/triton/cross_entropy.py: an online max and sum-of-exp pass over the 16-bit logits (2 bytes), a second pass reading them and writing the gradient in place (4), the backward scaling it (4): 10 bytes against the unfused fp32 passes' 24";
    runtime_overhead_gib: "GiB", [0.0, 32.0], 2.0, Carries,
        "device memory outside PyTorch's caching allocator per GPU: the CUDA context and NCCL's own buffers",
        "CUDA context about 0.5-1 GiB (CUDA programming guide, lazy loading), NCCL's buffers about 1 GiB for the communicators of a 3D-parallel job (NCCL_BUFFSIZE 4 MiB per channel and peer)";
    workspace_gib: "GiB", [0.0, 8.0], 0.1, Carries,
        "kernel workspaces PyTorch allocates per GPU (cuBLAS, Transformer Engine's cuBLASLt)",
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 is 8 x 4 MiB per stream; Transformer Engine takes 32 MiB per stream for cuBLASLt";
    allocator_fragmentation: "fraction of allocated", [0.0, 1.0], 0.032, Carries,
        "blocks PyTorch's caching allocator reserves beyond the tensors it holds, as a share of the allocated peak (reserved = allocated x (1 + this)), for a dense model: its tensors come back in the same sizes every micro-batch, and the cached blocks serve them again",
        "the median max reserved over max allocated of 14 dense Megatron-LM runs' `report_memory` lines in public logs (tests/data/reference/megatron_memory_logs.csv: 0.6% to 38%, large models at the low end), 1.032";
    moe_allocator_fragmentation: "fraction of allocated", [0.0, 1.0], 0.139, Carries,
        "allocator_fragmentation for a mixture of experts: the tokens each expert receives change every step, and with them the sizes of the permuted and expert tensors, so blocks cached at one step's sizes fit the next step's less well",
        "the median max reserved over max allocated of 6 MoE Megatron-LM runs' `report_memory` lines in public logs (tests/data/reference/megatron_memory_logs.csv: 5.4% to 26%), 1.139";
    cuda_graph_memory_gib: "GiB", [0.0, 32.0], 1.0, Carries,
        "memory CUDA graphs take per GPU beyond eager execution (static input and output buffers and private pools of the captured layers)",
        "Megatron-LM's CUDA-graph documentation warns of extra memory for captured graphs; about a GiB per rank is a guess for calibration, no published figure";
    memory_reserve_fraction: "fraction of capacity", [0.0, 0.5], 0.02, Carries,
        "capacity a plan leaves free for what varies from run to run",
        "a margin over the modelled reserved peak; the fragmentation itself is allocator_fragmentation (moe_allocator_fragmentation for a model with experts)";
    fp8_gemm_efficiency: "fraction of FP8 peak", [0.05, 1.0], 0.7, Carries,
        "tensor-core efficiency of large FP8 GEMMs, as a fraction of the GPU's dense FP8 peak",
        "a public cuBLASLt cross-check (E4M3 in, bf16 out, 8192^3) measured about 1,610 TFLOP/s on H100-class GPUs (81% of 1,979) where PyTorch's _scaled_mm reached 1,170 (59%); Transformer Engine's FP8 GEMMs go through cuBLASLt at training shapes, 0.7 between the two";
    fp8_cast_bytes_per_element: "bytes", [0.0, 32.0], 4.0, Carries,
        "memory traffic per element of an FP8 GEMM's 16-bit operand (activations forward, gradients backward): the cast with its amax, and the transposed FP8 copy Transformer Engine makes for the other GEMM",
        "read 2 bytes and write 1 for the cast, write 1 more for the transposed copy (Transformer Engine's cast-transpose kernel); the amax reduction rides on the same read (NVIDIA Transformer Engine FP8 primer)";
    moe_load_imbalance: "x mean", [1.0, 4.0], 1.1, Carries,
        "tokens the busiest expert rank computes, over the mean a balanced router gives it (the experts' GEMMs wait for it)",
        "GShard and Switch Transformer (Fedus et al., JMLR 2022) train with capacity factors of 1.0-1.25, dropping what a rank receives above the mean times the factor; 1.1 is inside that band, and auxiliary-loss or bias balancing (DeepSeek-V3, 2024) keeps routing near it";
    token_zipf_exponent: "exponent", [0.3, 2.5], 1.0, Carries,
        "exponent s of the token-frequency law P(rank r) ~ r^-s that estimates the distinct embedding rows a batch touches, where no token stream was measured (`profile tokens`)",
        "Zipf's law: word frequency falls as 1/rank (Zipf 1949); Piantadosi (Psychonomic Bulletin & Review 2014) finds exponents near 1 across languages and corpora";
    cp_overlap: "fraction", [0.0, 1.0], 0.8, Carries,
        "share of a layer's attention compute under which context parallelism's ring hides its key/value exchange (p2p)",
        "Ring Attention (Liu et al., ICLR 2024) sends the next key/value block while the current one is attended; Megatron-Core's p2p context parallelism (Transformer Engine) overlaps the same way, the first block's compute having nothing before it";
    ep_overlap: "fraction", [0.0, 1.0], 0.8, Carries,
        "share of the paired micro-batch's compute under which Megatron-Core's batch-level overlap hides a stage's expert-parallel dispatch and combine",
        "DeepSeek-V3 (2024) hides its all-to-alls entirely under the paired micro-batch's compute (DualPipe), the scheme Megatron-Core 0.14's --overlap-moe-expert-parallel-comm adopts; 0.8 as for the other overlaps, the communication kernels taking some of the SMs";
    moe_host_share: "x a dense layer's host time", [0.0, 20.0], 1.0, Carries,
        "host launch work an MoE layer's router, token permutation and dispatch add to a layer pass, as a multiple of a dense layer's; launched eagerly, since the dispatcher's device-to-host copy of the token counts keeps it out of CUDA graphs",
        "Megatron-Core's MoELayer issues about as many operators for routing (gating GEMM, top-k, auxiliary loss), permutation, the all-to-all's preprocess (a device-to-host sync of the token counts) and unpermutation as a dense layer's ~35 (megatron/core/transformer/moe/router.py, token_dispatcher.py, moe_utils.py)";
    expert_host_share: "x a dense layer's host time", [0.0, 2.0], 0.08, Carries,
        "host launch work each of a rank's local experts adds to an MoE layer pass, as a multiple of a dense layer's",
        "Transformer Engine's GroupedLinear launches a GEMM per expert for each of its two linears, and in FP8 a quantisation of each expert's input, from its C++ loop at a few microseconds each: about 4 launches against a dense layer's ~35 eager operators";
    compile_elementwise_fraction: "fraction", [0.05, 1.0], 0.6, Carries,
        "share of the element-wise memory traffic left once torch.compile fuses the pointwise kernels",
        "TorchInductor fuses chains of pointwise kernels into one, reading and writing each tensor once (Ansel et al., ASPLOS'24, PyTorch 2: 1.4x mean training speed-up)";
}

impl Coefficients {
    pub fn info(name: &str) -> Option<&'static CoefficientInfo> {
        Self::INFO.iter().find(|i| i.name == name)
    }

    /// Every value inside its physical range, or the first that is not.
    pub fn check(&self) -> Result<(), String> {
        for info in Self::INFO {
            let v = self.get(info.name).expect("INFO lists only fields");
            if !(v.is_finite() && v >= info.min && v <= info.max) {
                return Err(format!(
                    "coefficient `{}` = {v} is outside its range [{}, {}] ({})",
                    info.name, info.min, info.max, info.unit
                ));
            }
        }
        Ok(())
    }
}

/// How collectives that span nodes are carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CollectiveAlgorithm {
    /// NCCL's rings: one ring per NIC, each crossing every node boundary on
    /// its own NIC, so a group with k GPUs per node moves its data at the
    /// slower of the intra-node link and k NICs (NCCL's multi-node bus
    /// bandwidth on DGX-class nodes approaches the node's NIC total).
    #[default]
    Ring,
    /// Reduce within each node, all-reduce across nodes, broadcast within
    /// nodes, one phase after the other: a pessimistic bound when the
    /// phases do not pipeline.
    Hierarchical,
}

/// A cost model: coefficients plus where they came from.
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    pub name: String,
    pub description: String,
    pub coefficients: Coefficients,
    pub collective: CollectiveAlgorithm,
    /// Free-form provenance lines (data fitted on, date, error figures).
    pub provenance: BTreeMap<String, toml::Value>,
}

/// How far a fitted model's predictions fall from measurements it did not
/// see (cross-validated), as recorded in its provenance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Uncertainty {
    pub mape: f64,
    /// Nine predictions in ten were within this relative error.
    pub p90: f64,
    /// Rows the figures come from.
    pub rows: u64,
}

impl CostModel {
    /// The cross-validated error of a fitted model; `None` for a model
    /// fitted to nothing.
    pub fn uncertainty(&self) -> Option<Uncertainty> {
        let number = |key: &str| self.provenance.get(key).and_then(toml::Value::as_float);
        let rows = self
            .provenance
            .get("fitted_on")
            .and_then(toml::Value::as_table)
            .map(|t| t.values().filter_map(toml::Value::as_integer).sum::<i64>() as u64)
            .unwrap_or(0);
        Some(Uncertainty {
            mape: number("cv_mape")?,
            p90: number("cv_p90_ape")?,
            rows,
        })
    }

    pub fn datasheet() -> Self {
        CostModel {
            name: "datasheet".into(),
            description: "priors from datasheets and the literature, fitted to nothing".into(),
            coefficients: Coefficients::priors(),
            collective: CollectiveAlgorithm::default(),
            provenance: BTreeMap::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CostModelFileError {
    #[error("cannot read cost model {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("cost model {path}: {message}")]
    Invalid { path: String, message: String },
    #[error("cannot write cost model {path}: {cause}")]
    Write { path: String, cause: std::io::Error },
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    value: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    unit: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileLayout {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    collective: CollectiveAlgorithm,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    provenance: BTreeMap<String, toml::Value>,
    coefficients: BTreeMap<String, FileEntry>,
}

/// A prior that moved when another coefficient came: a file written
/// before `added` may give `moved` at its `old` value, which the note about
/// the missing `added` says.
struct Moved {
    added: &'static str,
    moved: &'static str,
    old: f64,
    why: &'static str,
}

const MOVED_WITH: [Moved; 3] = [
    Moved {
        added: "allocator_fragmentation",
        moved: "runtime_overhead_gib",
        old: 2.5,
        why: "the caching allocator's share went to allocator_fragmentation",
    },
    Moved {
        added: "allocator_fragmentation",
        moved: "memory_reserve_fraction",
        old: 0.05,
        why: "now a margin only; the fragmentation is allocator_fragmentation",
    },
    Moved {
        added: "moe_allocator_fragmentation",
        moved: "allocator_fragmentation",
        old: 0.12,
        why: "re-measured for dense models (tests/data/reference/megatron_memory_logs.csv)",
    },
];

/// The provenance key listing the coefficients a model holds only as
/// priors that no data informed: those its file lacked when read
/// ([`parse_cost_model`] records them), less what a calibration from it
/// then fitted ([`mark_informed`]). A file written from such a model gives
/// every coefficient, so the list is what keeps the warning about them.
pub const FILLED_WITH_PRIORS: &str = "filled_with_priors";

/// The coefficients `provenance` lists under [`FILLED_WITH_PRIORS`].
fn filled_with_priors(
    provenance: &BTreeMap<String, toml::Value>,
) -> Result<Vec<&'static CoefficientInfo>, String> {
    let Some(listed) = provenance.get(FILLED_WITH_PRIORS) else {
        return Ok(Vec::new());
    };
    let malformed = || {
        format!(
            "provenance `{FILLED_WITH_PRIORS}` must be a list of coefficient names; fix it or remove the key"
        )
    };
    let names = listed.as_array().ok_or_else(malformed)?;
    names
        .iter()
        .map(|name| {
            let name = name.as_str().ok_or_else(malformed)?;
            Coefficients::info(name).ok_or_else(|| {
                let known: Vec<&str> = Coefficients::INFO.iter().map(|i| i.name).collect();
                format!(
                    "provenance `{FILLED_WITH_PRIORS}` lists `{name}`, which is no coefficient{}; list coefficient names or remove it",
                    crate::suggest::did_you_mean(name, &known)
                )
            })
        })
        .collect()
}

/// Takes `names`, which data has now informed, off the model's
/// [`FILLED_WITH_PRIORS`] list (and the list away once empty).
pub fn mark_informed<'a>(
    provenance: &mut BTreeMap<String, toml::Value>,
    names: impl IntoIterator<Item = &'a str>,
) {
    let Some(toml::Value::Array(listed)) = provenance.get_mut(FILLED_WITH_PRIORS) else {
        return;
    };
    for name in names {
        listed.retain(|n| n.as_str() != Some(name));
    }
    if listed.is_empty() {
        provenance.remove(FILLED_WITH_PRIORS);
    }
}

impl CostModel {
    /// The coefficients this model holds only as priors no data informed,
    /// in the table's order: those its file did not give, or gave only as
    /// priors a calibration filled in ([`FILLED_WITH_PRIORS`]).
    pub fn at_prior(&self) -> Vec<&'static CoefficientInfo> {
        let listed = self
            .provenance
            .get(FILLED_WITH_PRIORS)
            .and_then(toml::Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        Coefficients::INFO
            .iter()
            .filter(|i| listed.iter().any(|n| n.as_str() == Some(i.name)))
            .collect()
    }

    /// One line saying which coefficients of the model read from `path`
    /// stand at priors ([`at_prior`](Self::at_prior)), `None` when none do.
    pub fn at_prior_note(&self, path: &str) -> Option<String> {
        let at_prior = self.at_prior();
        if at_prior.is_empty() {
            return None;
        }
        let named: Vec<String> = at_prior
            .iter()
            .map(|i| {
                let value = self.coefficients.get(i.name).expect("known");
                format!("{} = {value}", i.name)
            })
            .collect();
        let given = |name: &str| at_prior.iter().all(|i| i.name != name);
        let moved: String = MOVED_WITH
            .iter()
            .filter(|m| !given(m.added) && given(m.moved))
            .filter(|m| self.coefficients.get(m.moved) == Some(m.old))
            .map(|m| {
                let now = Coefficients::priors().get(m.moved).expect("known");
                format!(
                    "; it gives {} at {}, the prior before {} came, since moved to {now} ({})",
                    m.moved, m.old, m.added, m.why
                )
            })
            .collect();
        Some(format!(
            "cost model {path} does not give {} coefficient(s) of its own (not in the file, or filled in with priors by the calibration that wrote it), so no data informed them: {}; \
             `paratune calibrate` fits what its runs inform, or add them to the file{moved}",
            named.len(),
            named.join(", ")
        ))
    }
}

/// Parses a cost-model file. Every coefficient must be known (a mistyped
/// name is reported with the closest known one) and in its range; one the
/// file does not give holds its prior, listed in the model's provenance
/// ([`CostModel::at_prior`]).
pub fn parse_cost_model(text: &str, path: &str) -> Result<CostModel, CostModelFileError> {
    let invalid = |message: String| CostModelFileError::Invalid {
        path: path.to_string(),
        message,
    };
    let layout: FileLayout = toml::from_str(text).map_err(|e| {
        invalid(crate::toml_error::one_line(
            &e,
            text,
            "each coefficient is a `[coefficients.NAME]` table with `value = NUMBER`",
        ))
    })?;
    let mut coefficients = Coefficients::priors();
    for (name, entry) in &layout.coefficients {
        if !coefficients.set(name, entry.value) {
            let names: Vec<&str> = Coefficients::INFO.iter().map(|i| i.name).collect();
            return Err(invalid(format!(
                "unknown coefficient `{name}`{}",
                crate::suggest::did_you_mean(name, &names)
            )));
        }
    }
    if layout.coefficients.is_empty() {
        return Err(invalid(
            "`[coefficients]` gives none; give at least the ones you mean to set, each as \
             `[coefficients.NAME]` with `value = NUMBER` (`--cost-model datasheet` is every prior)"
                .into(),
        ));
    }
    coefficients.check().map_err(invalid)?;
    check_provenance(&layout.provenance).map_err(invalid)?;
    crate::text::check_printable("the cost model's name", &layout.name).map_err(invalid)?;
    let filled = filled_with_priors(&layout.provenance).map_err(invalid)?;
    let at_prior: Vec<&'static CoefficientInfo> = Coefficients::INFO
        .iter()
        .filter(|i| {
            !layout.coefficients.contains_key(i.name) || filled.iter().any(|f| f.name == i.name)
        })
        .collect();
    let mut provenance = layout.provenance;
    provenance.remove(FILLED_WITH_PRIORS);
    if !at_prior.is_empty() {
        let names = at_prior
            .iter()
            .map(|i| toml::Value::String(i.name.into()))
            .collect();
        provenance.insert(FILLED_WITH_PRIORS.into(), toml::Value::Array(names));
    }
    Ok(CostModel {
        name: layout.name,
        description: layout.description,
        coefficients,
        collective: layout.collective,
        provenance,
    })
}

/// The provenance figures other code reads: error figures finite (errors
/// and regrets 0 or more), `fitted_on` counts rows per data set.
fn check_provenance(provenance: &BTreeMap<String, toml::Value>) -> Result<(), String> {
    for (key, value) in provenance {
        if key.starts_with("cv_") || key.starts_with("holdout_") || key.starts_with("in_sample_") {
            let number = match value {
                toml::Value::Float(v) => Some(*v),
                toml::Value::Integer(v) => Some(*v as f64),
                _ => None,
            };
            let Some(v) = number else { continue };
            let never_negative =
                key.ends_with("mape") || key.ends_with("_ape") || key.ends_with("regret");
            let ok = v.is_finite()
                && (!never_negative || v >= 0.0)
                && (!key.ends_with("spearman") || (-1.0..=1.0).contains(&v));
            if !ok {
                return Err(format!(
                    "provenance `{key}` is {v}, which no error figure can be (errors and regrets are 0 or more, a rank correlation lies in -1..1)"
                ));
            }
        }
    }
    if let Some(fitted_on) = provenance.get("fitted_on") {
        let Some(table) = fitted_on.as_table() else {
            return Err("provenance `fitted_on` must be a table of row counts per data set".into());
        };
        for (set, rows) in table {
            match rows.as_integer() {
                Some(n) if (0..=MAX_FITTED_ROWS).contains(&n) => {}
                _ => {
                    return Err(format!(
                        "provenance `fitted_on.{set}` is {rows}; it must be a row count between 0 and {MAX_FITTED_ROWS}"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// More measured rows than any calibration reads; keeps sums from overflowing.
const MAX_FITTED_ROWS: i64 = 1 << 40;

/// Reads and parses a cost-model file ([`parse_cost_model`]).
pub fn load_cost_model(path: &Path) -> Result<CostModel, CostModelFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|cause| CostModelFileError::Read {
        path: shown.clone(),
        cause,
    })?;
    parse_cost_model(&text, &shown)
}

/// Renders a cost model as TOML, every coefficient with its unit and source.
pub fn render_cost_model(model: &CostModel) -> String {
    let coefficients = Coefficients::INFO
        .iter()
        .map(|info| {
            let entry = FileEntry {
                value: model.coefficients.get(info.name).expect("known"),
                unit: Some(info.unit.to_string()),
                source: Some(info.source.to_string()),
            };
            (info.name.to_string(), entry)
        })
        .collect();
    let layout = FileLayout {
        name: model.name.clone(),
        description: model.description.clone(),
        collective: model.collective,
        provenance: model.provenance.clone(),
        coefficients,
    };
    toml::to_string_pretty(&layout).expect("a cost model always serialises")
}

/// Writes a cost model atomically: a temporary file in the same folder, then
/// a rename, so an interrupted write never leaves a half file.
pub fn save_cost_model(model: &CostModel, path: &Path) -> Result<(), CostModelFileError> {
    crate::atomic::write_atomically(path, render_cost_model(model).as_bytes()).map_err(|source| {
        CostModelFileError::Write {
            path: path.display().to_string(),
            cause: source,
        }
    })
}

/// Writes a cost model and its report (`x.toml` and `x.report.md` beside
/// it) as one transaction: a kill leaves both old files or both new ones.
pub fn save_cost_model_with_report(
    model: &CostModel,
    path: &Path,
    report: &str,
) -> Result<PathBuf, CostModelFileError> {
    let failed = |cause: std::io::Error| CostModelFileError::Write {
        path: path.display().to_string(),
        cause,
    };
    let not_a_file = || {
        failed(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "give a file name, e.g. cost_models/my-cluster.toml",
        ))
    };
    let report_path = report_path(path);
    let model_name = path.file_name().ok_or_else(not_a_file)?.to_string_lossy();
    let report_name = report_path
        .file_name()
        .ok_or_else(not_a_file)?
        .to_string_lossy();
    let mut transaction =
        crate::atomic::Transaction::new(crate::atomic::parent_dir(path)).map_err(failed)?;
    transaction
        .stage(&model_name, render_cost_model(model).as_bytes())
        .map_err(failed)?;
    transaction
        .stage(&report_name, report.as_bytes())
        .map_err(failed)?;
    transaction.commit().map_err(failed)?;
    Ok(report_path)
}

/// `cost_models/x.toml` -> `cost_models/x.report.md`.
pub fn report_path(model: &Path) -> PathBuf {
    model.with_extension("report.md")
}

/// Cost models shipped in `cost_models/`, compiled in so that a binary
/// carried to another machine has them.
const BUILTIN: &[(&str, &str)] = &[
    ("datasheet", include_str!("../cost_models/datasheet.toml")),
    (
        "a100-megatron",
        include_str!("../cost_models/a100-megatron.toml"),
    ),
];

pub fn builtin_cost_model_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(name, _)| *name).collect()
}

/// A shipped cost model by name, or one carried to a GPU by the name
/// [`CostModel::carried_to`] gives it (`a100-megatron@h100-sxm`, as plan
/// files record it).
pub fn builtin_cost_model(name: &str) -> Option<CostModel> {
    // Any GPU name: a cluster file names its own; the scenario's GPU
    // supplies the datasheet the carried coefficients scale with.
    if let Some((shipped, gpu)) = name.split_once('@') {
        if gpu.is_empty() || gpu.chars().any(char::is_control) {
            return None;
        }
        return Some(builtin_cost_model(shipped)?.carried_to(gpu));
    }
    let (file, text) = BUILTIN.iter().find(|(n, _)| *n == name)?;
    // Shipped files parse and give every coefficient (tested).
    Some(
        parse_cost_model(text, &format!("cost_models/{file}.toml"))
            .expect("shipped cost models parse (tested)"),
    )
}

/// The shipped cost model to use for a GPU when none is named: the model
/// fitted on A100 measurements, on A100s as it is and on other GPUs carried
/// to them ([`CostModel::carried_to`]).
pub fn default_cost_model(gpu_name: &str) -> CostModel {
    let fitted = builtin_cost_model("a100-megatron").expect("shipped");
    if gpu_name.to_lowercase().starts_with("a100") {
        fitted
    } else {
        fitted.carried_to(gpu_name)
    }
}

impl CostModel {
    /// This model on another GPU: coefficients that [carry](Scope::Carries)
    /// keep their fitted values, which the GPU's datasheet scales; the
    /// [system](Scope::System) ones start again from their priors. Its
    /// error on that GPU is unmeasured, so the fitted error figures are
    /// dropped (no uncertainty band).
    ///
    /// Tensor-core efficiencies it fitted are fractions of the fitting
    /// GPU's peak, which hold that GPU's measured matmul ceiling; where
    /// both GPUs' ceilings are known ([`matmul_ceiling`]) they carry as
    /// fractions of the ceiling instead, and FP8 GEMMs, unless fitted,
    /// lose what the fitted 16-bit GEMMs lose below their ceiling. A
    /// fitted flash efficiency carries as it is where either GPU has
    /// catalogue attention rates, which it scales there (see
    /// [`Self::rescale_tensor_core_fractions`]).
    pub fn carried_to(&self, gpu_name: &str) -> CostModel {
        let mut carried = self.clone();
        for info in Coefficients::INFO {
            if info.scope == Scope::System {
                carried.coefficients.set(info.name, info.prior);
            }
        }
        let fitted_on = self.fitted_on_gpu();
        let ceilings = fitted_on
            .as_deref()
            .and_then(|from| Some((matmul_ceiling(from)?, matmul_ceiling(gpu_name)?)));
        let datasheet_fractions = match ceilings {
            Some((from, to)) => {
                let attention_measured = |gpu: &str| crate::cluster::attention_rates(gpu).is_some();
                let flash_scales_rates = fitted_on.as_deref().is_some_and(attention_measured)
                    || attention_measured(gpu_name);
                self.rescale_tensor_core_fractions(
                    &mut carried.coefficients,
                    (from, to),
                    flash_scales_rates,
                );
                let ceilings = if settles_apart(from, to) {
                    "fractions of datasheet figures kept, tensor-core ones as fractions of the measured matmul ceiling at each GPU's settled clock"
                } else {
                    "fractions of datasheet figures kept, tensor-core ones as fractions of the measured matmul ceiling"
                };
                if flash_scales_rates && self.fitted("attention_efficiency_flash") {
                    format!(
                        "{ceilings} (the flash efficiency as fitted, a scale of catalogue attention rates)"
                    )
                } else {
                    ceilings.to_string()
                }
            }
            None => "fractions of datasheet figures kept".to_string(),
        };
        carried.name = format!("{}@{gpu_name}", self.name);
        carried.description = format!(
            "{}, carried to {gpu_name}: {datasheet_fractions}, the layer launch time kept, other host and latency coefficients at their priors",
            self.name
        );
        carried.provenance.retain(|key, _| {
            !(key.starts_with("cv_") || key.starts_with("in_sample_") || key.starts_with("holdout"))
        });
        carried.provenance.insert(
            "carried_from".into(),
            toml::Value::String(self.name.clone()),
        );
        carried
    }
}

/// What the target GPU keeps of its ceiling once its clock settles, over
/// what the fitting GPU kept, where both are known (1 otherwise).
fn settled_ratio(from: MatmulCeiling, to: MatmulCeiling) -> f64 {
    match (from.sustained, to.sustained) {
        (Some(from), Some(to)) => to / from,
        _ => 1.0,
    }
}

/// Whether a carried fit moves by the two GPUs' settled clocks.
fn settles_apart(from: MatmulCeiling, to: MatmulCeiling) -> bool {
    (settled_ratio(from, to) - 1.0).abs() > 1e-12
}

/// Coefficients that are fractions of the 16-bit tensor-core peak.
const TENSOR_CORE_FRACTIONS: [&str; 4] = [
    "gemm_efficiency",
    "output_head_efficiency",
    "attention_efficiency_flash",
    "attention_efficiency_standard",
];

impl CostModel {
    /// The GPU the model was fitted on, as its provenance records it (one
    /// GPU for all its datasets).
    fn fitted_on_gpu(&self) -> Option<String> {
        let cluster = self.provenance.get("cluster")?.as_table()?;
        if let Some(gpu) = cluster.get("gpu") {
            return gpu.as_str().map(str::to_string);
        }
        let mut gpus = cluster
            .values()
            .map(|per_dataset| per_dataset.get("gpu")?.as_str());
        let first = gpus.next()??;
        gpus.all(|gpu| gpu == Some(first))
            .then(|| first.to_string())
    }

    fn fitted(&self, name: &str) -> bool {
        self.provenance
            .get("fitted")
            .and_then(toml::Value::as_array)
            .is_some_and(|names| names.iter().any(|n| n.as_str() == Some(name)))
    }

    /// Moves the fitted tensor-core fractions from one GPU's ceiling to
    /// another's. Priors are left alone: they are literature figures for
    /// no one GPU's ceiling.
    ///
    /// On a GPU with catalogue attention rates the flash efficiency only
    /// scales them against its prior (`cost::kernels::scaled_attention_rates`),
    /// and the rates hold that GPU's ceiling and settled clock already; so
    /// where either GPU has them (`flash_scales_rates`), a fitted flash
    /// efficiency carries as it is: a scale of the rates on the one side is
    /// taken as the same scale, or as the efficiency itself on a GPU
    /// without rates, on the other.
    fn rescale_tensor_core_fractions(
        &self,
        c: &mut Coefficients,
        (from, to): (MatmulCeiling, MatmulCeiling),
        flash_scales_rates: bool,
    ) {
        // A fit holds the fitting GPU's settled clock: carry from it to the
        // other's where both were measured.
        let settled = settled_ratio(from, to);
        for name in TENSOR_CORE_FRACTIONS {
            if name == "attention_efficiency_flash" && flash_scales_rates {
                continue;
            }
            if self.fitted(name) {
                let fitted = self.coefficients.get(name).expect("a coefficient");
                c.set(name, fitted * to.bf16 / from.bf16 * settled);
            }
        }
        if let Some(fp8) = to.fp8
            && self.fitted("gemm_efficiency")
            && !self.fitted("fp8_gemm_efficiency")
        {
            c.fp8_gemm_efficiency = self.coefficients.gemm_efficiency * fp8 / from.bf16 * settled;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_carried_model_is_found_by_the_name_plan_files_record() {
        let carried = default_cost_model("h100-sxm");
        assert_eq!(carried.name, "a100-megatron@h100-sxm");
        assert_eq!(builtin_cost_model(&carried.name), Some(carried));
        // A GPU of a cluster file is named by the file.
        assert!(builtin_cost_model("a100-megatron@cpu").is_some());
        assert_eq!(builtin_cost_model("a100-megatron@"), None);
        assert_eq!(builtin_cost_model("no-such-model@h100-sxm"), None);
    }

    #[test]
    fn fitted_tensor_core_fractions_carry_as_fractions_of_the_matmul_ceiling() {
        let fitted = builtin_cost_model("a100-megatron").unwrap();
        let (a100, h100) = (
            matmul_ceiling("a100-80gb").unwrap(),
            matmul_ceiling("h100-sxm").unwrap(),
        );
        let carried = fitted.carried_to("h100-sxm").coefficients;
        let f = fitted.coefficients;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        // Both GPUs' settled clocks were measured: the fit carries from
        // A100's to H100's.
        let settled = h100.sustained.unwrap() / a100.sustained.unwrap();
        assert!(settled < 1.0);
        assert!(close(
            carried.gemm_efficiency,
            f.gemm_efficiency * h100.bf16 / a100.bf16 * settled
        ));
        assert!(close(
            carried.attention_efficiency_standard,
            f.attention_efficiency_standard * h100.bf16 / a100.bf16 * settled
        ));
        // MI300X's was not: it is taken to settle as A100 does.
        let mi300x = matmul_ceiling("mi300x").unwrap();
        assert_eq!(mi300x.sustained, None);
        assert!(close(
            fitted.carried_to("mi300x").coefficients.gemm_efficiency,
            f.gemm_efficiency * mi300x.bf16 / a100.bf16
        ));
        // H100 GEMMs reach a lower share of a higher peak than A100's.
        assert!(carried.gemm_efficiency < f.gemm_efficiency);
        // A prior is no GPU's measurement: it stays.
        assert_eq!(
            carried.attention_efficiency_flash,
            f.attention_efficiency_flash
        );
        // FP8 GEMMs lose below their ceiling what the fitted bf16 ones do.
        assert!(close(
            carried.fp8_gemm_efficiency / h100.fp8.unwrap(),
            f.gemm_efficiency / a100.bf16 * settled
        ));
        // Where the target's ceiling was never measured, fractions of peak
        // are kept as they are, and the description says which.
        let v100 = fitted.carried_to("v100-32gb");
        assert_eq!(v100.coefficients.gemm_efficiency, f.gemm_efficiency);
        assert!(!v100.description.contains("ceiling"));
        assert!(
            fitted
                .carried_to("h100-sxm")
                .description
                .contains("ceiling")
        );
        // A fitted flash efficiency scales a GPU's measured attention rates,
        // which hold its ceiling and settled clock already: it carries as
        // it is there, and as a tensor-core fraction elsewhere.
        let mut attention_fit = fitted.clone();
        attention_fit.coefficients.attention_efficiency_flash = 0.6;
        let mut names = attention_fit.provenance["fitted"]
            .as_array()
            .unwrap()
            .clone();
        names.push("attention_efficiency_flash".into());
        attention_fit
            .provenance
            .insert("fitted".into(), toml::Value::Array(names));
        let to_b200 = attention_fit.carried_to("b200").coefficients;
        assert_eq!(to_b200.attention_efficiency_flash, 0.6);
        let to_mi300x = attention_fit.carried_to("mi300x").coefficients;
        assert!(close(
            to_mi300x.attention_efficiency_flash,
            0.6 * mi300x.bf16 / a100.bf16
        ));
        // Fitted on a GPU with rates, it scaled them, and carries as it is
        // to GPUs without any too.
        let mut on_h100 = attention_fit.clone();
        let mut cluster = toml::Table::new();
        cluster.insert("gpu".into(), "h100-sxm".into());
        on_h100
            .provenance
            .insert("cluster".into(), toml::Value::Table(cluster));
        for gpu in ["a100-80gb", "mi300x", "b200"] {
            let carried = on_h100.carried_to(gpu).coefficients;
            assert_eq!(carried.attention_efficiency_flash, 0.6, "{gpu}");
        }
        // (The carry did move the other fitted fractions, and says what it
        // kept.)
        let to_a100 = on_h100.carried_to("a100-80gb");
        assert!(to_a100.coefficients.gemm_efficiency != f.gemm_efficiency);
        assert!(
            to_a100
                .description
                .contains("the flash efficiency as fitted")
        );
        assert!(!fitted.carried_to("b200").description.contains("flash"));
        // The datasheet model fitted nothing, so nothing moves.
        let datasheet = CostModel::datasheet().carried_to("h100-sxm");
        assert_eq!(
            datasheet.coefficients.gemm_efficiency,
            Coefficients::priors().gemm_efficiency
        );
    }

    #[test]
    fn shipped_cost_models_parse_and_the_datasheet_file_holds_the_priors() {
        for name in builtin_cost_model_names() {
            assert!(builtin_cost_model(name).is_some(), "{name}");
        }
        for (file, text) in BUILTIN {
            let read = parse_cost_model(text, file).unwrap();
            assert!(
                read.at_prior().is_empty(),
                "{file} lacks {:?}",
                read.at_prior()
            );
        }
        let shipped = builtin_cost_model("datasheet").unwrap();
        assert_eq!(shipped.coefficients, Coefficients::priors());
        assert_eq!(
            include_str!("../cost_models/datasheet.toml"),
            render_cost_model(&CostModel::datasheet()),
            "regenerate it: cargo run --example render_datasheet > cost_models/datasheet.toml"
        );
    }

    #[test]
    fn priors_are_inside_their_ranges() {
        Coefficients::priors().check().unwrap();
    }

    #[test]
    fn a_rendered_model_reads_back_identically() {
        let model = CostModel::datasheet();
        let back = parse_cost_model(&render_cost_model(&model), "x.toml").unwrap();
        assert_eq!(back, model);
        assert!(back.at_prior().is_empty() && back.at_prior_note("x.toml").is_none());
    }

    #[test]
    fn a_mistyped_coefficient_is_named_with_a_suggestion() {
        let text = render_cost_model(&CostModel::datasheet()).replace(
            "[coefficients.gemm_efficiency]",
            "[coefficients.gemm_eficiency]",
        );
        let err = parse_cost_model(&text, "x.toml").unwrap_err().to_string();
        assert!(
            err.contains("gemm_eficiency") && err.contains("gemm_efficiency"),
            "{err}"
        );
    }

    /// `text` without the table of coefficient `name`.
    fn without_table(text: &str, name: &str) -> String {
        let start = text
            .find(&format!("[coefficients.{name}]"))
            .expect("rendered");
        let end = text[start + 1..]
            .find("\n[")
            .map_or(text.len(), |i| start + 2 + i);
        format!("{}{}", &text[..start], &text[end..])
    }

    #[test]
    fn a_file_written_before_a_coefficient_reads_with_its_prior_and_says_so() {
        let mut model = CostModel::datasheet();
        model.coefficients.gemm_efficiency = 0.7;
        let text = render_cost_model(&model);
        let older = without_table(
            &without_table(&text, "attention_row_half"),
            "moe_allocator_fragmentation",
        );
        let read = parse_cost_model(&older, "old.toml").unwrap();
        // What the file gives is kept; what it lacks is the prior, and the
        // model says so in its provenance, for whatever writes it on.
        assert_eq!(read.coefficients, model.coefficients);
        let names: Vec<&str> = read.at_prior().iter().map(|i| i.name).collect();
        assert_eq!(names, ["attention_row_half", "moe_allocator_fragmentation"]);
        assert_eq!(
            read.provenance[FILLED_WITH_PRIORS],
            toml::Value::Array(names.iter().map(|&n| n.into()).collect())
        );
        let note = read.at_prior_note("old.toml").unwrap();
        for part in [
            "old.toml",
            "2 coefficient(s)",
            "attention_row_half = 700",
            "moe_allocator_fragmentation = 0.139",
            "calibrate",
        ] {
            assert!(note.contains(part), "{part}: {note}");
        }
        assert!(!note.contains('\n'));
        // A moved prior is named only where the file holds its old value.
        assert!(!note.contains("since moved"), "{note}");
        let mut old_model = CostModel::datasheet();
        old_model.coefficients.allocator_fragmentation = 0.12;
        let older = without_table(
            &render_cost_model(&old_model),
            "moe_allocator_fragmentation",
        );
        let note = parse_cost_model(&older, "old.toml")
            .unwrap()
            .at_prior_note("old.toml")
            .unwrap();
        assert!(
            note.contains("it gives allocator_fragmentation at 0.12") && note.contains("0.032"),
            "{note}"
        );
        // Older still: the fragmentation itself missing, and the two priors
        // that moved when it came at their old values.
        let mut oldest = CostModel::datasheet();
        oldest.coefficients.runtime_overhead_gib = 2.5;
        oldest.coefficients.memory_reserve_fraction = 0.05;
        let oldest = render_cost_model(&oldest);
        let oldest = without_table(
            &without_table(&oldest, "allocator_fragmentation"),
            "moe_allocator_fragmentation",
        );
        let note = parse_cost_model(&oldest, "x.toml")
            .unwrap()
            .at_prior_note("x.toml")
            .unwrap();
        for part in [
            "runtime_overhead_gib at 2.5",
            "memory_reserve_fraction at 0.05",
        ] {
            assert!(note.contains(part), "{part}: {note}");
        }
        assert!(!note.contains("allocator_fragmentation at 0.12"), "{note}");
        let one = parse_cost_model(&without_table(&text, "kernel_gap_us"), "x.toml").unwrap();
        let note = one.at_prior_note("x.toml").unwrap();
        assert!(
            note.contains("kernel_gap_us = 2.1") && !note.contains("moved"),
            "{note}"
        );
    }

    #[test]
    fn coefficients_a_calibration_filled_with_priors_stay_named_until_data_informs_them() {
        // A file that gives every coefficient, two only as filled-in priors
        // (one of them since moved by hand).
        let mut model = CostModel::datasheet();
        model.coefficients.kernel_gap_us = 3.0;
        model.provenance.insert(
            FILLED_WITH_PRIORS.into(),
            toml::Value::Array(vec!["kernel_gap_us".into(), "attention_row_half".into()]),
        );
        let read = parse_cost_model(&render_cost_model(&model), "filled.toml").unwrap();
        let names: Vec<&str> = read.at_prior().iter().map(|i| i.name).collect();
        assert_eq!(names, ["attention_row_half", "kernel_gap_us"]);
        // The note gives the values in use, the file's.
        let note = read.at_prior_note("filled.toml").unwrap();
        assert!(
            note.contains("kernel_gap_us = 3") && note.contains("attention_row_half = 700"),
            "{note}"
        );
        // A fit that moves one takes it off the list; the last takes the list.
        let mut provenance = read.provenance.clone();
        mark_informed(&mut provenance, ["kernel_gap_us"]);
        assert_eq!(
            provenance[FILLED_WITH_PRIORS],
            toml::Value::Array(vec!["attention_row_half".into()])
        );
        mark_informed(&mut provenance, ["attention_row_half"]);
        assert!(!provenance.contains_key(FILLED_WITH_PRIORS));
        // A list that names no coefficient is refused with the key.
        for (listed, says) in [
            ("[\"kernel_gap\"]", "`kernel_gap`, which is no coefficient"),
            ("\"kernel_gap_us\"", "must be a list of coefficient names"),
        ] {
            let text = render_cost_model(&CostModel::datasheet()).replacen(
                "[coefficients.",
                &format!("[provenance]\n{FILLED_WITH_PRIORS} = {listed}\n\n[coefficients."),
                1,
            );
            let err = parse_cost_model(&text, "x.toml").unwrap_err().to_string();
            assert!(
                err.contains(FILLED_WITH_PRIORS) && err.contains(says),
                "{err}"
            );
        }
    }

    #[test]
    fn a_file_that_gives_no_coefficient_is_refused() {
        let err = parse_cost_model("name = \"x\"\n[coefficients]\n", "x.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gives none") && err.contains("datasheet"),
            "{err}"
        );
    }

    #[test]
    fn an_out_of_range_value_is_refused() {
        let text = render_cost_model(&CostModel::datasheet()).replacen(
            "value = 0.8\n",
            "value = 1.8\n",
            1,
        );
        let err = parse_cost_model(&text, "x.toml").unwrap_err().to_string();
        assert!(err.contains("outside its range"), "{err}");
    }
}
