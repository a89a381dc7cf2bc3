//! One way to run a training job: parallel degrees, micro-batch, schedule,
//! recomputation and the memory-saving switches. Plain data, no behaviour
//! beyond naming and validity checks.

mod spec;

pub use spec::{SPEC_KEYS, SpecError};

crate::named_choices!(
    ScheduleKind,
    Recompute,
    Engine,
    OptimizerSharding,
    StageOrder,
    CpComm,
    Precision,
    Fp8Recipe,
    GradReduce,
    CrossEntropyFusion,
    Dispatcher,
    SyncMethod,
);

use crate::model::{AttentionKind, ModelSpec};
use serde::{Deserialize, Serialize};
use std::fmt;

/// What CUDA graphs capture (Megatron-LM's `--cuda-graph-impl`;
/// torch.compile's cudagraphs in torchtitan): the host then launches a
/// graph instead of every kernel it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CudaGraphs {
    /// Every kernel launched eagerly.
    #[default]
    Off,
    /// Each layer captured apart (Transformer Engine's
    /// `make_graphed_callables`, `--cuda-graph-impl transformer_engine`):
    /// an MoE layer's dispatch and experts stay eager, since the token
    /// counts come back to the host.
    Layers,
    /// The whole forward and backward of an iteration as one graph
    /// (`--cuda-graph-impl full_iteration`, Megatron-LM from mid-2026): no
    /// per-kernel or per-layer launches. An MoE layer must then dispatch
    /// without a host sync: HybridEP into buffers pre-sized by an expert
    /// rank capacity factor (Megatron-LM's paged stash, the user guide's
    /// `docs/user-guide/features/paged_stash.md`).
    FullIteration,
}

impl CudaGraphs {
    pub const ALL: [CudaGraphs; 3] = [
        CudaGraphs::Off,
        CudaGraphs::Layers,
        CudaGraphs::FullIteration,
    ];

    /// Whether any kernels are captured.
    pub fn on(self) -> bool {
        self != CudaGraphs::Off
    }

    /// Why a job on `gpu` cannot capture these graphs, if it cannot: a CPU
    /// standing in for a GPU captures none.
    pub fn gpu_problem(self, gpu: &str) -> Option<String> {
        (self.on() && crate::cluster::is_cpu(gpu)).then(|| {
            format!(
                "this job runs on a CPU standing in for a GPU (`{}`), which captures no CUDA graphs",
                gpu.trim()
            )
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            CudaGraphs::Off => "off",
            CudaGraphs::Layers => "on",
            CudaGraphs::FullIteration => "full",
        }
    }

    /// `off`/`on` as every switch reads (on: per layer), or `full` (also
    /// Megatron-LM's `full_iteration`, `transformer_engine` and `local`
    /// for the per-layer kinds); the error names `field`.
    pub fn parse(field: &str, text: &str) -> Result<CudaGraphs, String> {
        match text.trim().to_lowercase().as_str() {
            "full" | "full_iteration" | "full-iteration" => Ok(CudaGraphs::FullIteration),
            "transformer_engine" | "local" | "layers" => Ok(CudaGraphs::Layers),
            "none" => Ok(CudaGraphs::Off),
            other => crate::choice::parse_switch(field, other)
                .map(|on| {
                    if on {
                        CudaGraphs::Layers
                    } else {
                        CudaGraphs::Off
                    }
                })
                .map_err(|_| {
                    format!(
                        "`{field}` must be on, off or full (the whole iteration), found `{text}`"
                    )
                }),
        }
    }
}

/// The buffers a sync-free MoE layer pre-sizes for one rank's routed rows,
/// as a multiple of a perfectly balanced share (Megatron-LM's
/// `--moe-expert-rank-capacity-factor`): NVIDIA's full-iteration recipes
/// use 1.5 (Megatron-Bridge's Qwen3-235B-A22B V2 config, Megatron-LM's
/// DeepSeek-V3 paged-stash example); rows beyond it stop the run.
pub const EXPERT_RANK_CAPACITY_FACTOR: f64 = 1.5;

impl Serialize for CudaGraphs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// Reads the names, and the `true`/`false` that plan files written before
/// the full-iteration kind hold.
impl<'de> Deserialize<'de> for CudaGraphs {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Written;
        impl serde::de::Visitor<'_> for Written {
            type Value = CudaGraphs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("`cuda_graphs` as \"off\", \"on\" or \"full\"")
            }
            fn visit_bool<E: serde::de::Error>(self, on: bool) -> Result<CudaGraphs, E> {
                Ok(if on {
                    CudaGraphs::Layers
                } else {
                    CudaGraphs::Off
                })
            }
            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<CudaGraphs, E> {
                CudaGraphs::parse("cuda_graphs", name).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(Written)
    }
}

impl fmt::Display for CudaGraphs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    Interleaved,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 3] = [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
        }
    }
}

/// Activation recomputation policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recompute {
    None,
    /// Megatron-LM's selective recomputation: the attention core only
    /// (Korthikanti et al.).
    Selective,
    /// Keep only each layer's input and recompute the whole layer.
    Full,
    /// torchtitan's per-op selective checkpointing: the outputs of every
    /// other matrix multiply and of the attention kernel are kept, the rest
    /// (norms, activations, the other matrix multiplies) recomputed.
    SelectiveOp,
    /// torchtitan's per-layer selective checkpointing: every
    /// `ac_frequency`-th layer fully checkpointed, the others keep all.
    SelectiveLayer,
}

impl Recompute {
    pub const ALL: [Recompute; 5] = [
        Recompute::None,
        Recompute::Selective,
        Recompute::Full,
        Recompute::SelectiveOp,
        Recompute::SelectiveLayer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
            Recompute::SelectiveOp => "selective-op",
            Recompute::SelectiveLayer => "selective-layer",
        }
    }

    /// FLOPs per token of one layer of `model` this policy runs again (the
    /// `modules` under Megatron-LM's selective policy, the whole forward
    /// pass under full recomputation, every other matrix multiply under
    /// torchtitan's per-op policy, the whole forward of one layer in
    /// `ac_frequency` under its per-layer policy), averaged over the layers.
    fn recomputed_flops_with(
        self,
        model: &ModelSpec,
        ac_frequency: u64,
        modules: RecomputeModules,
    ) -> f64 {
        let attention = model.counted_attention_flops_per_token();
        let gemm = model.layer_gemm_flops_per_token();
        match self {
            Recompute::None => 0.0,
            Recompute::Selective => modules.recomputed_flops_per_token(model),
            Recompute::Full => gemm + attention,
            Recompute::SelectiveOp => gemm / 2.0,
            Recompute::SelectiveLayer => (gemm + attention) / ac_frequency.max(1) as f64,
        }
    }

    /// The policies `engine` runs.
    pub fn of(engine: Engine) -> &'static [Recompute] {
        match engine {
            Engine::Megatron => &[Recompute::None, Recompute::Selective, Recompute::Full],
            Engine::Torchtitan => &[
                Recompute::None,
                Recompute::SelectiveOp,
                Recompute::SelectiveLayer,
                Recompute::Full,
            ],
        }
    }
}

/// What Megatron-LM's selective recomputation redoes
/// (`--recompute-modules`, with `--recompute-granularity selective`): a
/// set of the modules of `megatron/training/arguments.py`, the attention
/// core alone by default. Each drops what the module keeps for backward
/// and runs its forward again before its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub struct RecomputeModules(u8);

impl RecomputeModules {
    /// No module (what policies other than selective recompute by module).
    pub const NONE: RecomputeModules = RecomputeModules(0);
    /// The attention core (Korthikanti et al.'s selective recomputation).
    pub const CORE_ATTN: u8 = 1;
    /// The norm before an MoE layer's router (Megatron-Core recomputes only
    /// norms not fused into the next linear, as Transformer Engine's dense
    /// layers fuse theirs).
    pub const LAYERNORM: u8 = 1 << 1;
    /// The routed experts' activation function.
    pub const MOE_ACT: u8 = 1 << 2;
    /// A dense layer's whole MLP.
    pub const MLP: u8 = 1 << 3;
    /// An MoE layer's whole MLP part: router, dispatch, experts, combine.
    pub const MOE: u8 = 1 << 4;
    /// The shared experts.
    pub const SHARED_EXPERTS: u8 = 1 << 5;
    /// Multi-latent attention's up-projections of queries, keys and values.
    pub const MLA_UP_PROJ: u8 = 1 << 6;

    /// The modules by Megatron-LM's names.
    pub const NAMES: [(&'static str, u8); 7] = [
        ("core_attn", Self::CORE_ATTN),
        ("layernorm", Self::LAYERNORM),
        ("moe_act", Self::MOE_ACT),
        ("mlp", Self::MLP),
        ("moe", Self::MOE),
        ("shared_experts", Self::SHARED_EXPERTS),
        ("mla_up_proj", Self::MLA_UP_PROJ),
    ];

    pub fn has(self, module: u8) -> bool {
        self.0 & module != 0
    }

    /// FLOPs per token of one layer of `model`, averaged over its layers,
    /// that these modules run again: the attention core's score products,
    /// MLA's up-projections, a dense layer's MLP, an MoE layer's router,
    /// experts and shared experts (or the shared experts alone). Norms and
    /// activations run no matrix multiply.
    pub fn recomputed_flops_per_token(self, model: &ModelSpec) -> f64 {
        let layers = model.layers.max(1) as f64;
        let moe_share = model.moe_layers() as f64 / layers;
        let mut flops = 0.0;
        if self.has(Self::CORE_ATTN) {
            flops += model.counted_attention_flops_per_token();
        }
        if self.has(Self::MLA_UP_PROJ) {
            flops += model
                .mla_up_projections()
                .iter()
                .map(|&(input, output)| 2.0 * (input * output) as f64)
                .sum::<f64>();
        }
        if self.has(Self::MLP) {
            flops += (1.0 - moe_share) * model.mlp_flops_per_token(model.ffn_hidden);
        }
        if let Some(moe) = model.moe {
            if self.has(Self::MOE) {
                flops += moe_share * model.moe_mlp_flops_per_token().unwrap_or(0.0);
            } else if self.has(Self::SHARED_EXPERTS) {
                flops += moe_share * model.mlp_flops_per_token(moe.shared_ffn_hidden);
            }
        }
        flops
    }

    pub fn is_default(self) -> bool {
        self == Self::default()
    }

    /// The module sets a search tries under Megatron-LM's selective
    /// recomputation when none is given: the attention core (its default),
    /// and where the model has them the sets NVIDIA's recipes pick: an MoE
    /// layer's router norm with the experts' activation (gpt-oss), the
    /// activation alone, multi-latent attention's up-projections, and those
    /// with the dense layers' MLP (DeepSeek-V3).
    pub fn searched(model: &ModelSpec) -> Vec<RecomputeModules> {
        [
            Self::CORE_ATTN,
            Self::LAYERNORM | Self::MOE_ACT,
            Self::MOE_ACT,
            Self::MLA_UP_PROJ,
            Self::MLA_UP_PROJ | Self::MLP,
        ]
        .map(RecomputeModules)
        .into_iter()
        .filter(|m| m.problem(model).is_none())
        .collect()
    }

    /// The modules named in `text`, separated by commas, spaces or `+`.
    pub fn parse(field: &str, text: &str) -> Result<RecomputeModules, String> {
        let choices: Vec<(&str, u8)> = Self::NAMES.to_vec();
        let mut bits = 0;
        for name in text
            .split(|c: char| c == ',' || c == '+' || c.is_whitespace())
            .filter(|n| !n.is_empty())
        {
            bits |= crate::choice::parse_choice(field, name, &choices)?;
        }
        if bits == 0 {
            return Err(format!(
                "`{field}` names no module; give some of core_attn, layernorm, moe_act, mlp, moe, shared_experts, mla_up_proj"
            ));
        }
        Ok(RecomputeModules(bits))
    }

    /// Megatron-LM's names of the modules, in its order.
    pub fn names(self) -> Vec<&'static str> {
        Self::NAMES
            .iter()
            .filter(|(_, bit)| self.has(*bit))
            .map(|(name, _)| *name)
            .collect()
    }

    /// What keeps `model` from recomputing these modules: one it lacks.
    pub fn problem(self, model: &ModelSpec) -> Option<&'static str> {
        let moe = model.moe;
        if moe.is_none()
            && (self.has(Self::LAYERNORM) || self.has(Self::MOE_ACT) || self.has(Self::MOE))
        {
            Some("a mixture of experts for `layernorm`, `moe_act` and `moe`")
        } else if self.has(Self::SHARED_EXPERTS) && moe.is_none_or(|m| m.shared_ffn_hidden == 0) {
            Some("shared experts for `shared_experts`")
        } else if self.has(Self::MLA_UP_PROJ) && model.mla.is_none() {
            Some("multi-latent attention for `mla_up_proj`")
        } else if self.has(Self::MLP)
            && moe.is_some_and(|m| m.dense_layers == 0 && m.layer_freq == 1)
        {
            Some("dense MLP layers for `mlp`")
        } else {
            None
        }
    }
}

impl Default for RecomputeModules {
    fn default() -> Self {
        RecomputeModules(Self::CORE_ATTN)
    }
}

impl From<RecomputeModules> for String {
    fn from(m: RecomputeModules) -> String {
        m.names().join(",")
    }
}

impl TryFrom<String> for RecomputeModules {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        RecomputeModules::parse("recompute_modules", &text)
    }
}

/// The training engine a configuration runs on: its memory and time
/// semantics and its primary export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// Megatron-LM (Megatron-Core): 16-bit weights, fp32 main gradients,
    /// Adam with fp32 master weights (sharded by the distributed optimizer),
    /// the vocabulary padded to a multiple of 128 x tp.
    #[default]
    Megatron,
    /// torchtitan: FSDP2 mixed precision (fp32 parameters, gradients and
    /// Adam states sharded, 16-bit copies gathered for compute), its
    /// activation checkpointing modes and torch.compile.
    Torchtitan,
}

impl Engine {
    pub const ALL: [Engine; 2] = [Engine::Megatron, Engine::Torchtitan];

    pub fn name(self) -> &'static str {
        match self {
            Engine::Megatron => "megatron",
            Engine::Torchtitan => "torchtitan",
        }
    }

    /// The training software, as its users write it.
    pub fn product(self) -> &'static str {
        match self {
            Engine::Megatron => "Megatron-LM",
            Engine::Torchtitan => "torchtitan",
        }
    }

    /// Whether the engine's own launcher runs PyTorch's allocator with
    /// expandable segments: torchtitan's `run_train.sh` starts torchrun
    /// under `PYTORCH_ALLOC_CONF="expandable_segments:True"`
    /// (`PYTORCH_CUDA_ALLOC_CONF` in its earlier releases); Megatron-LM's
    /// examples leave PyTorch's default, fixed segments.
    pub fn launches_expandable_segments(self) -> bool {
        self == Engine::Torchtitan
    }
}

/// How much of the model state is sharded over data-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerSharding {
    None,
    /// Optimizer states only: Megatron's distributed optimizer, ZeRO-1.
    OptimizerStates,
    /// Weights, gradients and optimizer states: ZeRO-3, FSDP.
    Full,
}

impl OptimizerSharding {
    pub const ALL: [OptimizerSharding; 3] = [
        OptimizerSharding::None,
        OptimizerSharding::OptimizerStates,
        OptimizerSharding::Full,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OptimizerSharding::None => "none",
            OptimizerSharding::OptimizerStates => "optimizer-states",
            OptimizerSharding::Full => "full",
        }
    }
}

/// Where pipeline stages sit on the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StageOrder {
    /// Megatron-LM's order: stage `i` on ranks `i·tp·cp·dp ..`, so neighbouring
    /// stages are neighbours on the machine.
    #[default]
    Megatron,
    /// BPipe's pairs side by side: stages 0, p-1, 1, p-2, ..., so an
    /// evictor and its acceptor share a node when two stages fit in one,
    /// at the price of pipeline sends between nodes.
    BpipePairs,
}

impl StageOrder {
    pub const ALL: [StageOrder; 2] = [StageOrder::Megatron, StageOrder::BpipePairs];

    pub fn name(self) -> &'static str {
        match self {
            StageOrder::Megatron => "megatron",
            StageOrder::BpipePairs => "bpipe-pairs",
        }
    }

    /// The position on the ranks (in units of one stage's `tp·dp` GPUs) of
    /// stage `stage` of `pp`.
    pub fn position(self, stage: u64, pp: u64) -> u64 {
        match self {
            StageOrder::Megatron => stage,
            StageOrder::BpipePairs if stage < pp.div_ceil(2) => 2 * stage,
            StageOrder::BpipePairs => 2 * (pp - 1 - stage) + 1,
        }
    }
}

/// How context-parallel ranks exchange keys and values (Megatron-LM's
/// `--cp-comm-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpComm {
    /// A ring: each rank passes its key/value chunk on cp - 1 times,
    /// overlapped with the attention of the chunk it holds (ring attention).
    #[default]
    P2p,
    /// All-to-all of Q, K, V and the output, so that each rank attends over
    /// the whole sequence for heads / cp of the heads (DeepSpeed-Ulysses).
    A2a,
    /// Keys and values all-gathered before the attention, not overlapped.
    #[serde(rename = "allgather")]
    AllGather,
    /// Hierarchical: all-to-all over groups of `cp_a2a` neighbouring cp
    /// ranks (within a node), then a p2p ring between the groups (Megatron-
    /// LM's `--cp-comm-type a2a+p2p` with
    /// `--hierarchical-context-parallel-sizes`).
    #[serde(rename = "a2a+p2p")]
    A2aP2p,
}

impl CpComm {
    pub const ALL: [CpComm; 4] = [CpComm::P2p, CpComm::A2a, CpComm::AllGather, CpComm::A2aP2p];

    /// The all-to-all group `cp_comm a2a+p2p` takes unless told: the most
    /// cp ranks that share a node with their tp ranks, below cp and dividing
    /// it, so that the all-to-all stays on the node's link and the ring
    /// runs between nodes (1 for the other exchanges, or where no such
    /// group exists, which the rules then refuse).
    pub fn default_cp_a2a_for(comm: CpComm, cp: u64, tp: u64, gpus_per_node: u64) -> u64 {
        if comm != CpComm::A2aP2p {
            return 1;
        }
        let room = (gpus_per_node / tp.max(1)).max(1);
        (2..cp)
            .rev()
            .find(|d| cp.is_multiple_of(*d) && *d <= room)
            .unwrap_or(1)
    }

    /// The exchanges searched unless some are asked for: the ring (p2p),
    /// or, for a model with sliding windows on Megatron-LM, the all-to-all
    /// and the all-gather (Transformer Engine's rings refuse windows,
    /// `Rule::WindowedCpRing`). Without context parallelism there is none
    /// to choose: p2p.
    pub fn defaults_for(engine: Engine, model: &ModelSpec, cp: u64) -> &'static [CpComm] {
        if cp > 1 && engine == Engine::Megatron && model.windowed_layers() > 0 {
            &[CpComm::A2a, CpComm::AllGather]
        } else {
            &[CpComm::P2p]
        }
    }

    /// The one exchange a single configuration takes unless told: the
    /// first of [`defaults_for`](Self::defaults_for) whose all-to-all,
    /// if any, splits the heads over tp x cp.
    pub fn default_for(engine: Engine, model: &ModelSpec, tp: u64, cp: u64) -> CpComm {
        let defaults = Self::defaults_for(engine, model, cp);
        let split = tp.max(1) * cp.max(1);
        let heads_split = |comm: &CpComm| {
            *comm != CpComm::A2a
                || (model.heads.is_multiple_of(split) && model.kv_heads.is_multiple_of(split))
        };
        defaults
            .iter()
            .copied()
            .find(heads_split)
            .unwrap_or(defaults[0])
    }

    /// The cp ranks (or groups of them, for a2a+p2p) a ring of key/value
    /// steps goes around: cp for p2p, cp / cp_a2a for a2a+p2p, 1 (no ring)
    /// otherwise.
    pub fn ring_ranks(self, c: &ParallelConfig) -> u64 {
        match self {
            CpComm::P2p => c.cp,
            CpComm::A2aP2p => c.cp / c.cp_a2a.max(1),
            CpComm::A2a | CpComm::AllGather => 1,
        }
    }

    /// The cp ranks of one all-to-all group: all of them for a2a, the
    /// hierarchy's inner size for a2a+p2p, none otherwise.
    pub fn all_to_all_ranks(self, c: &ParallelConfig) -> u64 {
        match self {
            CpComm::A2a => c.cp,
            CpComm::A2aP2p => c.cp_a2a,
            CpComm::P2p | CpComm::AllGather => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CpComm::P2p => "p2p",
            CpComm::A2a => "a2a",
            CpComm::AllGather => "allgather",
            CpComm::A2aP2p => "a2a+p2p",
        }
    }
}

/// The number format of the layers' matrix multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 everywhere (fp32 master weights and gradients).
    #[default]
    Bf16,
    /// The transformer layers' linear layers in FP8 (Transformer Engine's
    /// hybrid E4M3/E5M2, MXFP8 on Blackwell), the rest in bf16.
    Fp8,
    /// The transformer layers' linear layers in NVFP4 (Transformer Engine's
    /// `NVFP4BlockScaling`, Megatron-LM's `--fp4-format e2m1 --fp4-recipe
    /// nvfp4`): E2M1 values with an E4M3 scale per 16 elements and an fp32
    /// scale per tensor, forward and both backward GEMMs; Blackwell's FP4
    /// tensor cores only. The rest in bf16.
    Nvfp4,
}

impl Precision {
    pub const ALL: [Precision; 3] = [Precision::Bf16, Precision::Fp8, Precision::Nvfp4];

    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
            Precision::Nvfp4 => "nvfp4",
        }
    }

    /// Why `gpu` cannot run this precision, if it cannot: no tensor cores
    /// of that format.
    pub fn gpu_problem(self, gpu: &crate::cluster::GpuSpec) -> Option<String> {
        match self {
            Precision::Fp8 if gpu.fp8_peak_flops.is_none() => Some(format!(
                "the {} has no FP8 tensor cores (Hopper and later do); plan with bf16, or give the GPU an fp8_peak_tflops in a cluster file",
                gpu.name
            )),
            Precision::Nvfp4 if gpu.fp4_peak_flops.is_none() => Some(format!(
                "the {} has no FP4 tensor cores (Blackwell's B200, GB200, B300 and GB300 do); plan with fp8 or bf16, or give the GPU an fp4_peak_tflops in a cluster file",
                gpu.name
            )),
            _ => None,
        }
    }
}

/// How FP8 GEMM inputs are scaled: Megatron-LM's `--fp8-recipe` (its
/// default is `delayed`), Transformer Engine's recipe classes. The scaling
/// decides what the casts cost: a tensor-wide scale from the current amax
/// needs that amax before the cast can start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Recipe {
    /// `Float8CurrentScaling`: one scale per tensor from its own amax,
    /// reduced in a pass of its own unless the kernel that wrote the input
    /// computed it (NVIDIA's "FP8-CS" recipes on Hopper and Blackwell).
    Tensorwise,
    /// `DelayedScaling`: the scale from earlier iterations' amax history,
    /// so the cast records the amax as it reads.
    Delayed,
    /// `MXFP8BlockScaling`: an E8M0 scale per 32 elements in each
    /// direction, computed by the cast; Blackwell's tensor cores only.
    Mxfp8,
    /// `Float8BlockScaling`: DeepSeek-V3's 1 x 128 activation and
    /// 128 x 128 weight blocks with fp32 scales; Hopper and later.
    Blockwise,
}

impl Fp8Recipe {
    pub const ALL: [Fp8Recipe; 4] = [
        Fp8Recipe::Tensorwise,
        Fp8Recipe::Delayed,
        Fp8Recipe::Mxfp8,
        Fp8Recipe::Blockwise,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fp8Recipe::Tensorwise => "tensorwise",
            Fp8Recipe::Delayed => "delayed",
            Fp8Recipe::Mxfp8 => "mxfp8",
            Fp8Recipe::Blockwise => "blockwise",
        }
    }

    /// The recipe paratune plans FP8 with unless told: MXFP8 on Blackwell,
    /// whose tensor cores scale its blocks, and tensor-wise current scaling
    /// elsewhere (the recipes of NVIDIA's published H100 and Blackwell runs).
    pub fn default_on(gpu: &str) -> Fp8Recipe {
        if crate::cluster::is_blackwell(gpu) {
            Fp8Recipe::Mxfp8
        } else {
            Fp8Recipe::Tensorwise
        }
    }

    /// Why `engine` cannot run this recipe, if it cannot: torchtitan's
    /// float8 converters (torchao) scale tensor-wise or in MX blocks.
    pub fn engine_problem(self, engine: Engine) -> Option<String> {
        (engine == Engine::Torchtitan && matches!(self, Fp8Recipe::Delayed | Fp8Recipe::Blockwise))
            .then(|| format!(
                "`fp8_recipe {}` is Transformer Engine's (Megatron-LM); torchtitan's float8 converters scale `tensorwise` or as `mxfp8`: choose one of those, or `engine megatron`",
                self.name()
            ))
    }

    /// Why `gpu` cannot run this recipe, if it cannot: Transformer
    /// Engine's `check_mxfp8_support` wants compute capability 10.x.
    pub fn gpu_problem(self, gpu: &str) -> Option<&'static str> {
        (self == Fp8Recipe::Mxfp8 && !crate::cluster::is_blackwell(gpu)).then_some(
            "MXFP8 needs Blackwell's block-scaled tensor cores (B200, GB200, B300, GB300)",
        )
    }
}

/// The number format gradients are accumulated, kept and reduced in over
/// data-parallel ranks. fp32 is Megatron-LM's default for bf16 training
/// (`accumulate_allreduce_grads_in_fp32`) and torchtitan's
/// (`mixed_precision_reduce = "float32"`); bf16 halves the gradient buffer
/// and the bytes every gradient collective moves, at a cost in numerics
/// the user decides on, so the search never picks it by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GradReduce {
    #[default]
    Fp32,
    /// Megatron-LM's `--grad-reduce-in-bf16` (Megatron-Bridge's
    /// `grad_reduce_in_fp32 = False`), torchtitan's `mixed_precision_reduce
    /// = "bfloat16"`.
    Bf16,
}

impl GradReduce {
    pub const ALL: [GradReduce; 2] = [GradReduce::Fp32, GradReduce::Bf16];

    pub fn name(self) -> &'static str {
        match self {
            GradReduce::Fp32 => "fp32",
            GradReduce::Bf16 => "bf16",
        }
    }
}

/// How the loss's cross-entropy runs over the last stage's logits
/// (Megatron-LM's `--cross-entropy-loss-fusion` and
/// `--cross-entropy-fusion-impl`). It changes the bytes held per logit and
/// the passes over them, not the numerics a user would notice, but Megatron-LM
/// defaults to off, so the search tries what it is given (off unless told).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CrossEntropyFusion {
    /// Megatron-Core's `vocab_parallel_cross_entropy`: the 16-bit logits are
    /// upcast to an fp32 copy that becomes the softmax and its gradient.
    #[default]
    Off,
    /// `--cross-entropy-loss-fusion` with the `native` implementation (its
    /// default): the same fp32 steps in jit-fused functions, which at the
    /// Megatron-Core of Megatron-LM's CI runs allocated a further fp32
    /// logits-sized buffer (`native_cross_entropy_transient_bytes`).
    Native,
    /// `--cross-entropy-fusion-impl te`: Transformer Engine's
    /// `parallel_cross_entropy`, a Triton kernel that reads the 16-bit
    /// logits and writes their gradient in place, with no fp32 copy.
    Te,
}

impl CrossEntropyFusion {
    pub const ALL: [CrossEntropyFusion; 3] = [
        CrossEntropyFusion::Off,
        CrossEntropyFusion::Native,
        CrossEntropyFusion::Te,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CrossEntropyFusion::Off => "off",
            CrossEntropyFusion::Native => "native",
            CrossEntropyFusion::Te => "te",
        }
    }
}

/// Megatron-LM's `--defer-embedding-wgrad-compute`: the output layer's
/// weight-gradient GEMM of each micro-batch is put off to the pipeline
/// flush, so the last stage keeps that micro-batch's logits gradient and
/// the layer's input until then (`grad_output_buffer` and
/// `embedding_activation_buffer` in Megatron-Core's `ColumnParallelLinear`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WgradDeferral {
    #[default]
    Off,
    /// Every micro-batch's (`--wgrad-deferral-limit 0`, its default).
    All,
    /// The first this many micro-batches' (`--wgrad-deferral-limit N`);
    /// later ones compute theirs at once.
    Limit(u64),
}

impl WgradDeferral {
    /// `off`, `all` or a micro-batch count of at least 1.
    pub fn parse(field: &str, text: &str) -> Result<Self, String> {
        match text.trim().to_lowercase().as_str() {
            "off" => Ok(WgradDeferral::Off),
            "all" => Ok(WgradDeferral::All),
            n => match n.parse::<u64>() {
                Ok(limit) if limit > 0 => Ok(WgradDeferral::Limit(limit)),
                _ => Err(format!(
                    "`{field}` must be off, all or a number of micro-batches (1 or more), found `{text}`"
                )),
            },
        }
    }

    pub fn name(self) -> String {
        match self {
            WgradDeferral::Off => "off".into(),
            WgradDeferral::All => "all".into(),
            WgradDeferral::Limit(n) => n.to_string(),
        }
    }

    /// Micro-batches whose output-layer weight gradient waits for the
    /// flush: the first `limit` of them (all for `all`).
    pub fn deferred(self, micro_batches: u64) -> u64 {
        match self {
            WgradDeferral::Off => 0,
            WgradDeferral::All => micro_batches,
            WgradDeferral::Limit(n) => n.min(micro_batches),
        }
    }

    /// Micro-batches whose logits gradient the last stage still holds when
    /// its last backward pass makes one more: the buffer fills until the
    /// limit, and nothing is drained before the flush.
    pub fn held_before_last(self, micro_batches: u64) -> u64 {
        let earlier = micro_batches.saturating_sub(1);
        match self {
            WgradDeferral::Off => 0,
            WgradDeferral::All => earlier,
            WgradDeferral::Limit(n) => n.min(earlier),
        }
    }
}

/// How an MoE layer's tokens reach their experts (Megatron-LM's
/// `--moe-token-dispatcher-type`).
///
/// The default is Megatron-LM's: `default='allgather'` in
/// `megatron/training/arguments.py` (`_add_moe_args`). It is the one
/// default: a configuration built from [`ParallelConfig::default`], a
/// `predict` without `--moe-dispatcher`, a run-table row without a
/// `moe_dispatcher` cell and an ingested Megatron-LM log without the
/// argument all take it, so the same MoE job is priced alike by each. A
/// dense model, which dispatches nothing, holds the default too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dispatcher {
    /// Each rank sends each routed token to the rank of its expert.
    #[serde(rename = "alltoall")]
    AllToAll,
    /// Every rank of the etp x ep group gathers all their tokens and keeps
    /// those of its own experts; the outputs are reduce-scattered back
    /// (Megatron-LM's default).
    #[default]
    #[serde(rename = "allgather")]
    AllGather,
    /// DeepSeek's DeepEP kernels (Megatron-LM's `flex` dispatcher with
    /// `--moe-flex-dispatcher-backend deepep`): each token crosses the network once per
    /// remote node it is routed to and NVLink once per further rank, however
    /// many of its experts that node or rank holds.
    #[serde(rename = "flex")]
    Flex,
    /// NVIDIA's HybridEP kernels, in DeepEP's repository (Megatron-LM's
    /// `flex` dispatcher with `--moe-flex-dispatcher-backend hybridep`):
    /// the same deduplicated traffic as DeepEP's, through buffers sized for
    /// every token of the group landing on one rank.
    #[serde(rename = "hybridep")]
    HybridEp,
}

impl Dispatcher {
    pub const ALL: [Dispatcher; 4] = [
        Dispatcher::AllToAll,
        Dispatcher::AllGather,
        Dispatcher::Flex,
        Dispatcher::HybridEp,
    ];

    /// The dispatchers Megatron-LM runs on its own, which the search tries
    /// unless told otherwise; flex and hybridep need DeepEP's repository
    /// installed (and NVSHMEM or RDMA across nodes), so they are searched
    /// only when asked for.
    pub const BUILT_IN: [Dispatcher; 2] = [Dispatcher::AllToAll, Dispatcher::AllGather];

    /// The dispatcher `engine` runs when none is chosen: Megatron-LM's
    /// default (the enum's), and all-to-all for torchtitan, whose expert
    /// parallelism has no other (`ExpertParallel` in
    /// `torchtitan/distributed/expert_parallel.py` dispatches with
    /// `all_to_all_single`).
    /// A dense model holds the enum's default, which it never uses.
    pub fn of_engine(engine: Engine, has_experts: bool) -> Dispatcher {
        match engine {
            Engine::Torchtitan if has_experts => Dispatcher::AllToAll,
            _ => Dispatcher::default(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dispatcher::AllToAll => "alltoall",
            Dispatcher::AllGather => "allgather",
            Dispatcher::Flex => "flex",
            Dispatcher::HybridEp => "hybridep",
        }
    }

    /// Megatron-LM's `--moe-token-dispatcher-type` for this dispatcher, and
    /// its `--moe-flex-dispatcher-backend` where it is a flex one.
    pub fn megatron_type_and_backend(self) -> (&'static str, Option<&'static str>) {
        match self {
            Dispatcher::Flex => ("flex", Some("deepep")),
            Dispatcher::HybridEp => ("flex", Some("hybridep")),
            other => (other.name(), None),
        }
    }

    /// Whether this is one of the flex dispatcher's backends, which send a
    /// token once per node and rank it reaches.
    pub fn deduplicates(self) -> bool {
        matches!(self, Dispatcher::Flex | Dispatcher::HybridEp)
    }
}

/// How a parameter group's gradients reach every rank that holds it. Dense
/// groups are all-reduced (or reduce-scattered under the distributed
/// optimizer); an untied input embedding, whose gradient touches only the
/// rows of a rank's tokens, can move just those rows (Parallax, Kim et al.,
/// EuroSys'19).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum SyncMethod {
    /// The whole gradient, dense: a ring all-reduce (NCCL, gloo).
    #[default]
    AllReduce,
    /// Every rank all-gathers every rank's touched rows and their indices
    /// and sums them locally: PyTorch DDP's path for sparse gradients
    /// (`nn.Embedding(sparse=True)`), DeepSpeed's `sparse_gradients`.
    SparseAllGather,
    /// The table is split by row over p of the group's ranks (servers);
    /// each rank pushes its touched rows to their owners, which sum and
    /// update them, and pulls the updated rows back (Parallax's sparse
    /// path), with p chosen from its `t(p) = a/p + b(p - 1) + c` curve.
    ParameterServer,
}

impl SyncMethod {
    pub const ALL: [SyncMethod; 3] = [
        SyncMethod::AllReduce,
        SyncMethod::SparseAllGather,
        SyncMethod::ParameterServer,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SyncMethod::AllReduce => "all-reduce",
            SyncMethod::SparseAllGather => "sparse-all-gather",
            SyncMethod::ParameterServer => "parameter-server",
        }
    }

    pub fn is_sparse(self) -> bool {
        self != SyncMethod::AllReduce
    }
}

/// One parallel training configuration.
// The equality below compares every field exactly, as the derived one
// would, only in another order: the derived hash agrees with it.
#[allow(clippy::derived_hash_with_manual_eq)]
#[derive(Debug, Clone, Copy, Eq, Hash, Serialize, Deserialize)]
pub struct ParallelConfig {
    pub tp: u64,
    pub pp: u64,
    /// Data-parallel replicas of the model, not counting context parallelism
    /// (Megatron-LM's: world = tp x cp x dp x pp).
    pub dp: u64,
    /// Context parallelism: the sequence split over `cp` ranks (Megatron-LM's
    /// `--context-parallel-size`), between tp and dp in the rank order.
    #[serde(default = "one")]
    pub cp: u64,
    #[serde(default)]
    pub cp_comm: CpComm,
    /// Under `cp_comm a2a+p2p`, the cp ranks of one all-to-all group (the
    /// first of Megatron-LM's `--hierarchical-context-parallel-sizes`); 1
    /// otherwise.
    #[serde(default = "one")]
    pub cp_a2a: u64,
    /// Expert parallelism: each MoE layer's experts spread over `ep` ranks
    /// (`--expert-model-parallel-size`), carved out of tp x cp x dp.
    #[serde(default = "one")]
    pub ep: u64,
    /// Expert tensor parallelism: each expert split over `etp` ranks
    /// (`--expert-tensor-parallel-size`); 1 for a dense model.
    #[serde(default = "one")]
    pub etp: u64,
    /// How an MoE model's tokens reach their experts.
    #[serde(default)]
    pub dispatcher: Dispatcher,
    /// The layers' GEMMs in bf16 or FP8.
    #[serde(default)]
    pub precision: Precision,
    /// How FP8 inputs are scaled; `None`: the GPU's default
    /// ([`Fp8Recipe::default_on`]). Read only under `precision fp8`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_recipe: Option<Fp8Recipe>,
    /// How an untied input embedding's gradient is synchronised over its
    /// data-parallel ranks (every other group is all-reduced).
    #[serde(default)]
    pub embedding_sync: SyncMethod,
    pub micro_batch: u64,
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank; 1 unless the schedule is interleaved.
    pub virtual_stages: u64,
    pub recompute: Recompute,
    /// The modules [`Recompute::Selective`] redoes.
    #[serde(default)]
    pub recompute_modules: RecomputeModules,
    pub sequence_parallel: bool,
    pub optimizer_sharding: OptimizerSharding,
    /// BPipe activation balancing between pipeline stages x and p-1-x.
    pub bpipe: bool,
    pub attention: AttentionKind,
    /// Layers of the first and of the last pipeline stage where they differ
    /// from the others' (Megatron-LM's `--decoder-first-pipeline-num-layers`
    /// and `--decoder-last-pipeline-num-layers`); the other stages share the
    /// remaining layers evenly. `None`: an even split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_stage_layers: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stage_layers: Option<u64>,
    /// Megatron-LM's `--overlap-grad-reduce`: data-parallel gradient
    /// reduction in buckets under the last micro-batch's backward pass.
    #[serde(default)]
    pub overlap_grad_reduce: bool,
    /// `--overlap-param-gather`: the distributed optimizer's parameter
    /// all-gather under the next iteration's first forward pass.
    #[serde(default)]
    pub overlap_param_gather: bool,
    /// `--tp-comm-overlap`: tensor-parallel all-gathers and reduce-scatters
    /// pipelined with the GEMMs beside them (Transformer Engine userbuffers;
    /// needs sequence parallelism).
    #[serde(default)]
    pub tp_comm_overlap: bool,
    /// `--overlap-moe-expert-parallel-comm` (with `--delay-wgrad-compute`):
    /// Megatron-Core 0.14's batch-level overlap, which runs one
    /// micro-batch's forward beside another's backward so that each one's
    /// token dispatch and combine hide under the other's compute.
    #[serde(default)]
    pub ep_comm_overlap: bool,
    /// `--fp8-param-gather` (`--fp4-param-gather` under NVFP4): the layers'
    /// weights kept in FP8 or NVFP4 (Transformer Engine's
    /// `quantized_model_init`) with fp32 master copies in the sharded
    /// optimizer, so no 16-bit copy is held and the all-gather moves the
    /// quantized bytes. Needs FP8 or NVFP4 with Megatron-LM and sharded
    /// optimizer states.
    #[serde(default)]
    pub fp8_param_gather: bool,
    /// `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: PyTorch's caching
    /// allocator maps one growing segment per stream and unmaps the pages
    /// of its free blocks before an allocation fails, so no device memory
    /// is lost to fragmentation between cached blocks. A launch setting,
    /// not a parallel one: it moves memory, never time.
    #[serde(default)]
    pub expandable_segments: bool,
    /// The gradients' number format in their buffer and collectives.
    #[serde(default)]
    pub grad_reduce: GradReduce,
    /// How the loss's cross-entropy runs over the logits.
    #[serde(default)]
    pub cross_entropy_fusion: CrossEntropyFusion,
    /// Whether, and for how many micro-batches, the output layer's weight
    /// gradient waits for the pipeline flush.
    #[serde(default)]
    pub wgrad_deferral: WgradDeferral,
    /// Megatron-LM's `--cpu-offloading-num-layers`: the activations the
    /// first this many layers save for backward are copied to host memory
    /// during the forward pass and back during the backward (Transformer
    /// Engine's CPU offload); 0 keeps them all on the GPU.
    #[serde(default)]
    pub cpu_offload_layers: u64,
    /// CUDA graphs: what is captured once and replayed.
    #[serde(default)]
    pub cuda_graphs: CudaGraphs,
    #[serde(default)]
    pub stage_order: StageOrder,
    #[serde(default)]
    pub engine: Engine,
    /// torch.compile (torchtitan): element-wise work fused into fewer,
    /// larger kernels, which keep fewer intermediates.
    #[serde(default)]
    pub compile: bool,
    /// Every how many layers one is checkpointed under
    /// [`Recompute::SelectiveLayer`] (torchtitan's `selective_ac_option`).
    #[serde(default = "default_ac_frequency")]
    pub ac_frequency: u64,
    /// Hybrid sharding (torchtitan's HSDP): the model state is sharded
    /// over groups of this many data-parallel ranks and replicated over
    /// `dp / dp_shard` such groups (`data_parallel_shard_degree` and
    /// `data_parallel_replicate_degree`). `None`: over all of dp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_shard: Option<u64>,
}

/// Every field compared, the ones a search varies fastest first: its
/// caches compare a configuration with the keys of its neighbours, which
/// differ in those, and a derived comparison (in declaration order) walks
/// most of the struct before it finds them. Naming every field makes a new
/// one a compile error here until it is compared.
impl PartialEq for ParallelConfig {
    fn eq(&self, o: &Self) -> bool {
        let ParallelConfig {
            tp,
            pp,
            dp,
            cp,
            cp_comm,
            cp_a2a,
            ep,
            etp,
            dispatcher,
            precision,
            fp8_recipe,
            embedding_sync,
            micro_batch,
            schedule,
            virtual_stages,
            recompute,
            recompute_modules,
            sequence_parallel,
            optimizer_sharding,
            bpipe,
            attention,
            first_stage_layers,
            last_stage_layers,
            overlap_grad_reduce,
            overlap_param_gather,
            tp_comm_overlap,
            ep_comm_overlap,
            fp8_param_gather,
            expandable_segments,
            grad_reduce,
            cross_entropy_fusion,
            wgrad_deferral,
            cpu_offload_layers,
            cuda_graphs,
            stage_order,
            engine,
            compile,
            ac_frequency,
            dp_shard,
        } = self;
        // In the search's nesting order, innermost first (search/space.rs).
        *fp8_param_gather == o.fp8_param_gather
            && *expandable_segments == o.expandable_segments
            && *ep_comm_overlap == o.ep_comm_overlap
            && *cuda_graphs == o.cuda_graphs
            && *tp_comm_overlap == o.tp_comm_overlap
            && *compile == o.compile
            && *overlap_param_gather == o.overlap_param_gather
            && *overlap_grad_reduce == o.overlap_grad_reduce
            && *attention == o.attention
            && *stage_order == o.stage_order
            && *bpipe == o.bpipe
            && *dp_shard == o.dp_shard
            && *optimizer_sharding == o.optimizer_sharding
            && *sequence_parallel == o.sequence_parallel
            && *ac_frequency == o.ac_frequency
            && *recompute == o.recompute
            && *recompute_modules == o.recompute_modules
            && *embedding_sync == o.embedding_sync
            && *cpu_offload_layers == o.cpu_offload_layers
            && *cross_entropy_fusion == o.cross_entropy_fusion
            && *wgrad_deferral == o.wgrad_deferral
            && *grad_reduce == o.grad_reduce
            && *precision == o.precision
            && *fp8_recipe == o.fp8_recipe
            && *dispatcher == o.dispatcher
            && *ep == o.ep
            && *etp == o.etp
            && *cp_comm == o.cp_comm
            && *cp_a2a == o.cp_a2a
            && *first_stage_layers == o.first_stage_layers
            && *last_stage_layers == o.last_stage_layers
            && *virtual_stages == o.virtual_stages
            && *schedule == o.schedule
            && *micro_batch == o.micro_batch
            && *dp == o.dp
            && *cp == o.cp
            && *pp == o.pp
            && *tp == o.tp
            && *engine == o.engine
    }
}

fn default_ac_frequency() -> u64 {
    2
}

fn one() -> u64 {
    1
}

impl Default for ParallelConfig {
    /// One GPU, one micro-batch, 1F1B, nothing recomputed, sharded or
    /// overlapped, flash attention: the base that configurations are built on.
    fn default() -> Self {
        ParallelConfig {
            tp: 1,
            pp: 1,
            dp: 1,
            cp: 1,
            cp_comm: CpComm::P2p,
            cp_a2a: 1,
            ep: 1,
            etp: 1,
            dispatcher: Dispatcher::default(),
            precision: Precision::Bf16,
            fp8_recipe: None,
            embedding_sync: SyncMethod::AllReduce,
            micro_batch: 1,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            recompute: Recompute::None,
            recompute_modules: RecomputeModules(RecomputeModules::CORE_ATTN),
            sequence_parallel: false,
            optimizer_sharding: OptimizerSharding::None,
            bpipe: false,
            attention: AttentionKind::Flash,
            first_stage_layers: None,
            last_stage_layers: None,
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            tp_comm_overlap: false,
            ep_comm_overlap: false,
            fp8_param_gather: false,
            expandable_segments: false,
            grad_reduce: GradReduce::Fp32,
            cross_entropy_fusion: CrossEntropyFusion::Off,
            wgrad_deferral: WgradDeferral::Off,
            cpu_offload_layers: 0,
            cuda_graphs: CudaGraphs::Off,
            stage_order: StageOrder::Megatron,
            engine: Engine::Megatron,
            compile: false,
            ac_frequency: default_ac_frequency(),
            dp_shard: None,
        }
    }
}

impl ParallelConfig {
    /// FLOPs per token, over all of `model`'s layers, that this
    /// configuration's recomputation runs again (its modules where it
    /// recomputes selectively).
    pub fn recomputed_flops_per_token(&self, model: &ModelSpec) -> f64 {
        model.layers as f64
            * self
                .recompute
                .recomputed_flops_with(model, self.ac_frequency, self.recompute_modules)
    }

    /// The data-parallel ranks the sharded state is spread over: all of dp,
    /// or the shard group under hybrid sharding.
    /// Context-parallel ranks hold the same weights, so they shard the
    /// state with the data-parallel ones (Megatron-LM's distributed
    /// optimizer over dp x cp, torchtitan's `dp_shard_cp` mesh).
    pub fn shard_degree(&self) -> u64 {
        self.dp_shard.unwrap_or(self.dp).saturating_mul(self.cp)
    }

    /// The FP8 recipe this configuration runs on `gpu`: the one it names,
    /// else the GPU's default.
    pub fn fp8_recipe_on(&self, gpu: &str) -> Fp8Recipe {
        self.fp8_recipe
            .unwrap_or_else(|| Fp8Recipe::default_on(gpu))
    }

    /// How many copies of the sharded state there are: 1, or the replicas
    /// under hybrid sharding.
    pub fn replicas(&self) -> u64 {
        self.dp / self.dp_shard.unwrap_or(self.dp).max(1)
    }

    pub fn gpus(&self) -> u64 {
        self.tp
            .saturating_mul(self.pp)
            .saturating_mul(self.dp)
            .saturating_mul(self.cp)
    }

    /// Ranks of one pipeline stage's copy of the dense weights' gradients
    /// (Megatron-LM's data-parallel group with context parallelism).
    pub fn dense_sync_degree(&self) -> u64 {
        self.dp.saturating_mul(self.cp)
    }

    /// [`CpComm::default_cp_a2a_for`] this configuration's exchange.
    pub fn default_cp_a2a(&self, gpus_per_node: u64) -> u64 {
        CpComm::default_cp_a2a_for(self.cp_comm, self.cp, self.tp, gpus_per_node)
    }

    /// Expert tensor parallelism where none is given: Megatron-LM's
    /// default (`--expert-tensor-parallel-size` unset) splits each expert
    /// like the dense layers, over `tp`; a model without experts has 1.
    pub fn default_etp(has_experts: bool, tp: u64) -> u64 {
        if has_experts { tp } else { 1 }
    }

    /// Expert-data parallelism: replicas of each expert shard, the group its
    /// gradients are synchronised and its optimizer states sharded over
    /// (tp x cp x dp = etp x ep x edp).
    pub fn expert_data_parallel(&self) -> u64 {
        (self.tp * self.cp * self.dp) / (self.etp * self.ep).max(1)
    }

    /// Micro-batches each pipeline processes per iteration.
    pub fn micro_batches(&self, global_batch: u64) -> u64 {
        global_batch / self.micro_batch.saturating_mul(self.dp).max(1)
    }

    /// Whether this configuration's end stages are Megatron-LM's
    /// [`accounted_split`] with the embedding and the loss both counted, and
    /// not whole chunks (what only that split can express).
    pub fn is_accounted_split(&self, layers: u64) -> bool {
        self.uneven()
            && accounted_split(layers, self.pp, self.virtual_stages, true, true)
                == Some((self.first_stage_layers, self.last_stage_layers))
    }

    /// Whether the first or the last stage holds other than the even share.
    pub fn uneven(&self) -> bool {
        self.first_stage_layers.is_some() || self.last_stage_layers.is_some()
    }

    /// Layers of each stage that is neither a custom first nor a custom last
    /// one: what is left after them, shared evenly. Assumes the split passed
    /// [`violation`](Self::violation).
    pub fn middle_stage_layers(&self, layers: u64) -> u64 {
        let custom = u64::from(self.first_stage_layers.is_some())
            + u64::from(self.last_stage_layers.is_some());
        let rest = layers
            .saturating_sub(self.first_stage_layers.unwrap_or(0))
            .saturating_sub(self.last_stage_layers.unwrap_or(0));
        rest / self.pp.saturating_sub(custom).max(1)
    }

    /// Layers of pipeline stage `stage` (all of them on every chunk of it).
    pub fn stage_layers(&self, layers: u64, stage: u64) -> u64 {
        let middle = self.middle_stage_layers(layers);
        if self.pp == 1 {
            return layers;
        }
        match stage {
            0 => self.first_stage_layers.unwrap_or(middle),
            s if s == self.pp - 1 => self.last_stage_layers.unwrap_or(middle),
            _ => middle,
        }
    }

    /// The chunks as torchtitan splits a pipeline ([`TORCHTITAN_SPLIT`]), `(layers_per_stage,
    /// first_less, last_less)`: pp x v chunks of equal layers but the first
    /// and the last, which may hold up to all of theirs fewer
    /// (`pipeline_parallel_layers_per_stage`, `*_stage_less_layers`), the
    /// first on stage 0 and the last on the last stage. `None` if this
    /// configuration's stages have no such split (an end stage larger than
    /// the middle ones, middle stages not v equal chunks).
    pub fn torchtitan_stage_split(&self, layers: u64) -> Option<(u64, u64, u64)> {
        let v = self.virtual_stages.max(1);
        let first = self.stage_layers(layers, 0);
        let last = self.stage_layers(layers, self.pp.saturating_sub(1));
        let per = if self.pp > 2 {
            let middle = self.middle_stage_layers(layers);
            middle.is_multiple_of(v).then_some(middle / v)?
        } else {
            first.max(last).div_ceil(v)
        };
        let less = |own: u64| (v * per).checked_sub(own).filter(|&fewer| fewer <= per);
        Some((per, less(first)?, less(last)?)).filter(|_| per > 0)
    }

    /// Where a model of `layers` layers lies over the stages' model chunks
    /// ([`ChunkLayout`]), worked out once for the stages to ask.
    pub fn chunk_layout(&self, layers: u64) -> ChunkLayout {
        ChunkLayout {
            pp: self.pp.max(1),
            v: self.virtual_stages.max(1),
            first: self.stage_layers(layers, 0),
            middle: self.middle_stage_layers(layers),
            last: self.stage_layers(layers, self.pp.saturating_sub(1)),
        }
    }

    /// The micro-batch group size Megatron-Core's interleaved schedule needs
    /// for `m` micro-batches (`--microbatch-group-size-per-virtual-pipeline-stage`,
    /// default pp): the smallest `n` with `pp <= n <= m` and `m % n` either 0
    /// or at least pp (its `schedules.py`); `None` when none exists (m < pp).
    pub fn microbatch_group(&self, m: u64) -> Option<u64> {
        let p = self.pp;
        (p..=m).find(|&n| m.is_multiple_of(n) || m % n >= p)
    }

    /// Why the uneven split cannot hold, if it cannot.
    fn split_problem(&self, layers: u64) -> Option<Rule> {
        if !self.uneven() {
            let chunks = self.pp.saturating_mul(self.virtual_stages);
            return (!layers.is_multiple_of(chunks)).then_some(Rule::LayersNotDivisible);
        }
        if self.pp < 2 {
            return Some(Rule::UnevenWithoutPipeline);
        }
        let custom = [self.first_stage_layers, self.last_stage_layers];
        let given: u64 = custom.iter().flatten().sum();
        let others = self.pp - custom.iter().flatten().count() as u64;
        let v = self.virtual_stages;
        let rest = layers.checked_sub(given);
        // The end stages may hold a layer fewer than a whole number of chunks
        // (Megatron-LM's account-for-embedding split); the others may not.
        let broken = custom.iter().flatten().any(|&n| n == 0)
            || match rest {
                None => true,
                Some(rest) if others == 0 => rest != 0,
                Some(rest) => {
                    let middle = rest / others;
                    !rest.is_multiple_of(others) || middle == 0 || !middle.is_multiple_of(v)
                }
            };
        broken.then_some(Rule::UnevenSplit)
    }

    /// The first rule this configuration breaks for `model` with
    /// `global_batch` on `gpus` GPUs whose nodes hold `gpus_per_node`.
    /// Cheap: the search calls it for every combination it considers.
    pub fn violation(
        &self,
        model: &ModelSpec,
        global_batch: u64,
        gpus: u64,
        gpus_per_node: u64,
    ) -> Option<Rule> {
        let stem = StemChecks::of(self, model, global_batch, gpus_per_node);
        self.violation_with(&stem, model, gpus)
    }

    /// [`violation`](Self::violation) with the checks of this
    /// configuration's stem already made (`stem` must be this
    /// configuration's, [`StemChecks::holds_for`], for the same model,
    /// global batch and node size). The search makes them
    /// once for every inner configuration of a stem; they hold most of
    /// the rules' integer divisions.
    pub fn violation_with(&self, stem: &StemChecks, model: &ModelSpec, gpus: u64) -> Option<Rule> {
        debug_assert!(stem.holds_for(self), "stem checks of another stem");
        let c = self;
        let sequence_split = sequence_split_problem(model, c.tp, c.sequence_parallel);
        let rules = [
            (
                Rule::ZeroDegree,
                c.tp == 0
                    || c.pp == 0
                    || c.dp == 0
                    || c.cp == 0
                    || c.ep == 0
                    || c.etp == 0
                    || c.micro_batch == 0
                    || c.virtual_stages == 0,
            ),
            (Rule::GpuCount, c.gpus() != gpus),
            // Megatron-LM runs tensor parallelism over whole nodes too.
            (Rule::TensorParallelOutsideNode, stem.tp_outside_node),
            (
                Rule::HeadsNotDivisible,
                stem.tensor_split == Some(Rule::HeadsNotDivisible),
            ),
            (
                Rule::FfnNotDivisible,
                stem.tensor_split == Some(Rule::FfnNotDivisible),
            ),
            (Rule::ContextNotDivisible, stem.context_not_divisible),
            (Rule::CpCommWithoutCp, c.cp == 1 && c.cp_comm != CpComm::P2p),
            (
                Rule::HierarchicalCp,
                match c.cp_comm {
                    CpComm::A2aP2p => {
                        c.cp_a2a < 2 || c.cp_a2a >= c.cp || !c.cp.is_multiple_of(c.cp_a2a)
                    }
                    _ => c.cp_a2a != 1,
                },
            ),
            (
                Rule::WindowedCpRing,
                c.engine == Engine::Megatron
                    && c.cp > 1
                    && model.windowed_layers() > 0
                    && matches!(c.cp_comm, CpComm::P2p | CpComm::A2aP2p),
            ),
            (Rule::ContextHeadsNotDivisible, {
                let split = c.tp * c.cp_comm.all_to_all_ranks(c);
                split > c.tp
                    && (!model.heads.is_multiple_of(split) || !model.kv_heads.is_multiple_of(split))
            }),
            (
                Rule::SparseSyncOfDenseEmbedding,
                c.embedding_sync.is_sparse()
                    && (model.tied_embeddings || c.dense_sync_degree() < 2),
            ),
            (
                Rule::SparseSyncWithSharding,
                match c.embedding_sync {
                    SyncMethod::AllReduce => false,
                    SyncMethod::SparseAllGather => c.optimizer_sharding != OptimizerSharding::None,
                    SyncMethod::ParameterServer => {
                        c.optimizer_sharding == OptimizerSharding::Full
                            || (c.engine == Engine::Torchtitan
                                && c.optimizer_sharding != OptimizerSharding::None)
                    }
                },
            ),
            (
                Rule::ExpertsWithoutMoe,
                // The dispatcher of a dense model is never used, so any is
                // accepted (plan files before the default moved say alltoall).
                model.moe.is_none() && (c.ep > 1 || c.etp > 1),
            ),
            (
                Rule::ExpertsNotDivisible,
                model.moe.is_some_and(|m| !m.experts.is_multiple_of(c.ep)),
            ),
            (
                Rule::ExpertFfnNotDivisible,
                model
                    .moe
                    .is_some_and(|m| !m.ffn_hidden.is_multiple_of(c.etp)),
            ),
            (
                Rule::ExpertGroupNotDivisible,
                !(c.tp * c.cp * c.dp).is_multiple_of(c.etp * c.ep),
            ),
            (
                Rule::FlexWithoutExpertRanks,
                model.moe.is_some() && c.dispatcher.deduplicates() && c.etp * c.ep < 2,
            ),
            (
                // torchtitan runs neither flex backend (`EngineCannotRun`).
                Rule::DeepEpGroupSize,
                model.moe.is_some()
                    && c.engine == Engine::Megatron
                    && c.dispatcher == Dispatcher::Flex
                    && c.etp * c.ep >= 2
                    && !DEEPEP_GROUP_SIZES.contains(&(c.etp * c.ep)),
            ),
            (
                Rule::FlexGroupAcrossNodes,
                model.moe.is_some()
                    && c.dispatcher.deduplicates()
                    && flex_group_problem(c, stem.gpus_per_node).is_some(),
            ),
            (
                Rule::MoeTpWithoutSp,
                model.moe.is_some() && c.tp > 1 && !c.sequence_parallel,
            ),
            (
                Rule::EpOverlapNeeds,
                c.ep_comm_overlap && ep_overlap_problem(model, c).is_some(),
            ),
            (
                Rule::Fp8ParamGatherNeeds,
                c.fp8_param_gather && fp8_param_gather_problem(c).is_some(),
            ),
            (Rule::Fp8RecipeEngine, fp8_recipe_engine_problem(c)),
            (Rule::Nvfp4Needs, nvfp4_problem(c).is_some()),
            (
                Rule::FullGraphNeedsSyncFreeExperts,
                c.cuda_graphs == CudaGraphs::FullIteration
                    && model.moe.is_some()
                    && c.dispatcher != Dispatcher::HybridEp,
            ),
            (
                Rule::TorchtitanStageSplit,
                c.engine == Engine::Torchtitan
                    && c.pp > 1
                    && (c.first_stage_layers.is_some() || c.last_stage_layers.is_some())
                    && c.torchtitan_stage_split(model.layers).is_none(),
            ),
            (
                Rule::CpuOffloadNeeds,
                cpu_offload_problem(model, c).is_some(),
            ),
            (
                Rule::WgradDeferralNeeds,
                wgrad_deferral_problem(c).is_some(),
            ),
            (
                Rule::RecomputeModulesNeed,
                !c.recompute_modules.is_default()
                    && (c.recompute != Recompute::Selective
                        || c.engine != Engine::Megatron
                        || c.recompute_modules.problem(model).is_some()),
            ),
            (Rule::BatchNotDivisible, stem.batch_not_divisible),
            (
                Rule::InterleavedShape,
                c.schedule == ScheduleKind::Interleaved && (c.pp < 2 || c.virtual_stages < 2),
            ),
            (
                Rule::VirtualStagesWithoutInterleaving,
                c.schedule != ScheduleKind::Interleaved && c.virtual_stages != 1,
            ),
            (
                Rule::LayersNotDivisible,
                stem.layer_split == Some(Rule::LayersNotDivisible),
            ),
            (
                Rule::UnevenWithoutPipeline,
                stem.layer_split == Some(Rule::UnevenWithoutPipeline),
            ),
            (
                Rule::UnevenSplit,
                stem.layer_split == Some(Rule::UnevenSplit),
            ),
            (
                Rule::InterleavedMicroBatches,
                stem.interleaved_group_missing,
            ),
            (
                Rule::SequenceParallelWithoutTp,
                sequence_split == Some(Rule::SequenceParallelWithoutTp),
            ),
            (
                // Each context-parallel rank's share of the sequence is split
                // again over tp.
                Rule::SequenceNotSplit,
                sequence_split == Some(Rule::SequenceNotSplit)
                    || (c.sequence_parallel
                        && !(model.seq_len / c.cp.max(1)).is_multiple_of(c.tp.max(1))),
            ),
            (
                Rule::BpipeSchedule,
                c.bpipe && (c.schedule != ScheduleKind::OneFOneB || c.pp < 2),
            ),
            (
                Rule::StageOrderWithoutBpipe,
                c.stage_order != StageOrder::Megatron && !c.bpipe,
            ),
            (
                Rule::TpOverlapWithoutSp,
                c.tp_comm_overlap && !c.sequence_parallel,
            ),
            (
                Rule::ParamGatherOverlap,
                c.overlap_param_gather
                    && (c.optimizer_sharding != OptimizerSharding::OptimizerStates
                        || !c.overlap_grad_reduce),
            ),
            (
                // Megatron-LM's restriction on per-layer graphs (a whole
                // iteration's graph holds the recomputation); torchtitan
                // 0.3 captures fully checkpointed steps (its llama3_70b
                // config).
                Rule::CudaGraphsWithFullRecompute,
                c.cuda_graphs == CudaGraphs::Layers
                    && c.recompute == Recompute::Full
                    && c.engine == Engine::Megatron,
            ),
            (
                Rule::RecomputeForEngine,
                !Recompute::of(c.engine).contains(&c.recompute),
            ),
            (
                Rule::AcFrequency,
                c.recompute == Recompute::SelectiveLayer && c.ac_frequency < 1,
            ),
            (
                Rule::CompileWithoutTorchtitan,
                c.compile && c.engine != Engine::Torchtitan,
            ),
            (
                Rule::EngineCannotRun,
                c.engine == Engine::Torchtitan
                    && (c.bpipe
                        || (c.tp_comm_overlap && !c.compile)
                        || (c.cuda_graphs.on() && c.pp > 1)
                        || c.cuda_graphs == CudaGraphs::FullIteration
                        || c.cross_entropy_fusion != CrossEntropyFusion::Off
                        || (model.moe.is_some() && c.dispatcher != Dispatcher::AllToAll)
                        || model.mtp_layers > 0),
            ),
            (
                Rule::HybridSharding,
                c.dp_shard.is_some_and(|n| {
                    n < 2
                        || n >= c.dp
                        || !c.dp.is_multiple_of(n)
                        || c.engine != Engine::Torchtitan
                        || c.optimizer_sharding == OptimizerSharding::None
                }),
            ),
        ];
        rules
            .into_iter()
            .find(|(_, broken)| *broken)
            .map(|(rule, _)| rule)
    }

    /// Like [`violation`](Self::violation), with a message that names the
    /// values and the fix.
    pub fn check(
        &self,
        model: &ModelSpec,
        global_batch: u64,
        gpus: u64,
        gpus_per_node: u64,
    ) -> Result<(), String> {
        match self.violation(model, global_batch, gpus, gpus_per_node) {
            None => Ok(()),
            Some(rule) => Err(rule.explain(self, model, global_batch, gpus, gpus_per_node)),
        }
    }
}

/// The dimensions the search holds fixed over a batch of inner
/// configurations: the degrees, the micro-batch, the schedule and the layer
/// split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StemKey {
    tp: u64,
    pp: u64,
    cp: u64,
    dp: u64,
    micro_batch: u64,
    schedule: ScheduleKind,
    virtual_stages: u64,
    first_stage_layers: Option<u64>,
    last_stage_layers: Option<u64>,
}

impl StemKey {
    fn of(c: &ParallelConfig) -> StemKey {
        StemKey {
            tp: c.tp,
            pp: c.pp,
            cp: c.cp,
            dp: c.dp,
            micro_batch: c.micro_batch,
            schedule: c.schedule,
            virtual_stages: c.virtual_stages,
            first_stage_layers: c.first_stage_layers,
            last_stage_layers: c.last_stage_layers,
        }
    }

    /// A configuration with these dimensions and every other at its
    /// default, so that what is worked out from it reads these alone.
    fn config(&self) -> ParallelConfig {
        ParallelConfig {
            tp: self.tp,
            pp: self.pp,
            cp: self.cp,
            dp: self.dp,
            micro_batch: self.micro_batch,
            schedule: self.schedule,
            virtual_stages: self.virtual_stages,
            first_stage_layers: self.first_stage_layers,
            last_stage_layers: self.last_stage_layers,
            ..ParallelConfig::default()
        }
    }
}

/// What [`ParallelConfig::violation`]'s rules work out from a stem's
/// dimensions alone, for one model, global batch and node size: most of
/// their integer divisions.
#[derive(Debug, Clone, Copy)]
pub struct StemChecks {
    key: StemKey,
    tp_outside_node: bool,
    tensor_split: Option<Rule>,
    context_not_divisible: bool,
    batch_not_divisible: bool,
    layer_split: Option<Rule>,
    interleaved_group_missing: bool,
    /// GPUs joined by the intra-node link, for the rules on groups beyond
    /// the stem's (a flex dispatcher's).
    gpus_per_node: u64,
}

impl StemChecks {
    pub fn of(
        c: &ParallelConfig,
        model: &ModelSpec,
        global_batch: u64,
        gpus_per_node: u64,
    ) -> StemChecks {
        let key = StemKey::of(c);
        let stem = key.config();
        // Megatron-LM runs tensor parallelism over whole nodes too.
        let tp_outside_node = if stem.tp > gpus_per_node {
            !stem.tp.is_multiple_of(gpus_per_node)
        } else {
            !gpus_per_node.is_multiple_of(stem.tp)
        };
        StemChecks {
            key,
            tp_outside_node,
            tensor_split: tensor_split_problem(model, stem.tp),
            context_not_divisible: stem.cp > 1 && !model.seq_len.is_multiple_of(2 * stem.cp),
            batch_not_divisible: !global_batch
                .is_multiple_of(stem.micro_batch.saturating_mul(stem.dp)),
            layer_split: stem.split_problem(model.layers),
            interleaved_group_missing: stem.schedule == ScheduleKind::Interleaved
                && stem
                    .microbatch_group(stem.micro_batches(global_batch))
                    .is_none(),
            gpus_per_node,
        }
    }

    /// Whether these are `c`'s stem's checks.
    pub fn holds_for(&self, c: &ParallelConfig) -> bool {
        self.key == StemKey::of(c)
    }
}

/// Megatron-LM's interleaved layout of a model's layers over the pipeline
/// stages' model chunks: the model, in layer order, is cut into chunks
/// `0, 1, ..., pp x v - 1`, and chunk `j x pp + stage` is the stage's j-th;
/// each is a `1 / v` share of its stage's layers, the stage's last chunk
/// also the remainder. Without interleaving (v = 1) chunk 0 is the whole
/// stage. Built by [`ParallelConfig::chunk_layout`] from a split that passed
/// [`ParallelConfig::violation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLayout {
    pp: u64,
    v: u64,
    /// Layers of the first, of each middle and of the last stage.
    first: u64,
    middle: u64,
    last: u64,
}

impl ChunkLayout {
    /// Layers of stage `stage` ([`ParallelConfig::stage_layers`]).
    pub fn stage_layers(&self, stage: u64) -> u64 {
        match stage {
            0 => self.first,
            s if s == self.pp - 1 => self.last,
            _ => self.middle,
        }
    }

    /// The model layers chunk `chunk` of stage `stage` holds.
    pub fn chunk(&self, stage: u64, chunk: u64) -> std::ops::Range<u64> {
        let v = self.v;
        let own = self.stage_layers(stage);
        // Without interleaving the one chunk is the stage, after the
        // stages before it: what the rounds below come to at v = 1, without
        // their divisions (asked for every stage of every configuration).
        if v == 1 && chunk == 0 {
            let start = match stage {
                0 => 0,
                _ => self.first + (stage - 1) * self.middle,
            };
            return start..start + own;
        }
        // One round of chunks: one chunk of every stage.
        let round = match self.pp {
            1 => own / v,
            pp => self.first / v + (pp - 2) * (self.middle / v) + self.last / v,
        };
        // The first stage and the middle ones precede `stage` in every
        // round; in the last round with their remainders.
        let before = |first: u64, middle: u64| match stage {
            0 => 0,
            _ => first + (stage - 1) * middle,
        };
        let last_round = chunk == v - 1;
        let start = chunk * round
            + before(self.first / v, self.middle / v)
            + if last_round {
                before(self.first % v, self.middle % v)
            } else {
                0
            };
        let len = own / v + if last_round { own % v } else { 0 };
        start..start + len
    }

    /// The stage whose first chunk holds layer `layer`; `None` when the
    /// layer lies past the first round of chunks (always found without
    /// interleaving).
    pub fn first_round_stage(&self, layer: u64) -> Option<u64> {
        (0..self.pp).find(|&stage| self.chunk(stage, 0).contains(&layer))
    }
}

/// Why `model`'s layer does not split `tp` ways, if it does not: the search
/// and the measuring code ask the same question here.
pub fn tensor_split_problem(model: &ModelSpec, tp: u64) -> Option<Rule> {
    if tp == 0 || !model.heads.is_multiple_of(tp) || !model.kv_heads.is_multiple_of(tp) {
        Some(Rule::HeadsNotDivisible)
    } else if !model.ffn_hidden.is_multiple_of(tp) {
        Some(Rule::FfnNotDivisible)
    } else {
        None
    }
}

/// Why sequence parallelism over `tp` ranks cannot split `model`'s
/// sequence, if it cannot.
pub fn sequence_split_problem(model: &ModelSpec, tp: u64, sequence_parallel: bool) -> Option<Rule> {
    if !sequence_parallel {
        None
    } else if tp < 2 {
        Some(Rule::SequenceParallelWithoutTp)
    } else if !model.seq_len.is_multiple_of(tp) {
        Some(Rule::SequenceNotSplit)
    } else {
        None
    }
}

/// A rule a configuration must follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    ZeroDegree,
    GpuCount,
    TensorParallelOutsideNode,
    HeadsNotDivisible,
    FfnNotDivisible,
    BatchNotDivisible,
    LayersNotDivisible,
    InterleavedShape,
    InterleavedMicroBatches,
    VirtualStagesWithoutInterleaving,
    SequenceParallelWithoutTp,
    /// Sequence parallelism splits the sequence evenly over the tp ranks.
    SequenceNotSplit,
    BpipeSchedule,
    /// Only BPipe moves stages from Megatron-LM's order.
    StageOrderWithoutBpipe,
    /// An uneven split on one stage.
    UnevenWithoutPipeline,
    /// First or last stage layers that leave the others no even share.
    UnevenSplit,
    /// Megatron-LM's `--tp-comm-overlap` needs `--sequence-parallel`.
    TpOverlapWithoutSp,
    /// `--overlap-param-gather` needs the distributed optimizer and
    /// `--overlap-grad-reduce`.
    ParamGatherOverlap,
    /// Per-layer CUDA graphs capture a fixed kernel sequence; Megatron-LM
    /// refuses them with full recomputation.
    CudaGraphsWithFullRecompute,
    /// A whole iteration's CUDA graph captures the MoE layers too, which
    /// must then dispatch without the host learning the token counts:
    /// Megatron-LM's sync-free experts run on HybridEP.
    FullGraphNeedsSyncFreeExperts,
    /// A recomputation policy of the other engine.
    RecomputeForEngine,
    AcFrequency,
    /// torch.compile is torchtitan's.
    CompileWithoutTorchtitan,
    /// torchtitan has no BPipe, runs async tensor parallelism only
    /// compiled, and CUDA graphs only without a pipeline.
    EngineCannotRun,
    /// Hybrid sharding: a shard group that divides dp and is smaller than
    /// it, of a sharded torchtitan configuration.
    HybridSharding,
    /// Context parallelism splits the sequence into 2 cp chunks (each rank
    /// takes one from each end, balancing the causal mask).
    ContextNotDivisible,
    /// A key/value exchange chosen without context parallelism.
    CpCommWithoutCp,
    /// All-to-all context parallelism splits the heads over tp x cp.
    ContextHeadsNotDivisible,
    /// Hierarchical cp: an all-to-all group of 2 or more that divides cp
    /// and leaves a ring between groups.
    HierarchicalCp,
    /// Transformer Engine runs sliding-window attention under context
    /// parallelism only with the a2a or all-gather exchange.
    WindowedCpRing,
    /// A sparse embedding sync on a model whose input embedding's gradient
    /// is dense (tied to the output head) or that has no data-parallel ranks.
    SparseSyncOfDenseEmbedding,
    /// A sparse embedding sync the sharding cannot carry: FSDP / ZeRO-3
    /// gathers the table for every micro-batch, and the distributed
    /// optimizer's shards take rows only through their owners.
    SparseSyncWithSharding,
    /// Expert parallelism on a model without experts.
    ExpertsWithoutMoe,
    /// ep must divide the experts.
    ExpertsNotDivisible,
    /// etp must divide an expert's MLP width.
    ExpertFfnNotDivisible,
    /// etp x ep must divide tp x cp x dp (the ranks the experts are laid on).
    ExpertGroupNotDivisible,
    /// A flex dispatcher (DeepEP or HybridEP) over one rank: Megatron-Core
    /// asserts TPxEP > 1.
    FlexWithoutExpertRanks,
    /// DeepEP runs only the group sizes its recommended configs cover.
    DeepEpGroupSize,
    /// A flex dispatcher's group must tile the nodes, and DeepEP's beyond 8
    /// ranks take nodes of 8 NVLink peers.
    FlexGroupAcrossNodes,
    /// Megatron-Core runs MoE layers under tensor parallelism only with
    /// sequence parallelism.
    MoeTpWithoutSp,
    /// What Megatron-Core's batch-level EP overlap asserts (in
    /// `TransformerConfig.__post_init__`).
    EpOverlapNeeds,
    Fp8ParamGatherNeeds,
    /// torchtitan's float8 converters (torchao) scale tensor-wise or in MX
    /// blocks; delayed and blockwise scaling are Transformer Engine's.
    Fp8RecipeEngine,
    /// NVFP4 training is Transformer Engine's (Megatron-LM), without the
    /// tensor-parallel GEMM overlap ([`nvfp4_problem`]).
    Nvfp4Needs,
    /// torchtitan splits a pipeline into chunks of equal layers but the
    /// first and the last, which may hold fewer.
    TorchtitanStageSplit,
    CpuOffloadNeeds,
    /// What Megatron-Core's `ModelParallelConfig` asserts of a deferred
    /// embedding weight gradient.
    WgradDeferralNeeds,
    RecomputeModulesNeed,
}

/// Why a flex dispatcher cannot run over `c`'s etp x ep ranks on nodes of
/// `gpus_per_node`, if it cannot. Its groups are consecutive ranks, so a
/// group smaller than a node must divide it (or one would straddle two
/// nodes, which neither DeepEP's intranode kernels nor HybridEP's domain
/// split take), a larger one must be whole nodes, and DeepEP beyond 8 ranks
/// reaches a rank's 8 NVLink peers by rank mod 8 (`NUM_MAX_NVL_PEERS`), so
/// the nodes must hold whole blocks of 8.
pub fn flex_group_problem(c: &ParallelConfig, gpus_per_node: u64) -> Option<&'static str> {
    let group = c.etp * c.ep;
    if group <= gpus_per_node && !gpus_per_node.is_multiple_of(group) {
        Some("would straddle two nodes (it must divide the GPUs per node)")
    } else if group > gpus_per_node && !group.is_multiple_of(gpus_per_node) {
        Some("is not whole nodes (it must be a multiple of the GPUs per node)")
    } else if c.dispatcher == Dispatcher::Flex && group > 8 && !gpus_per_node.is_multiple_of(8) {
        Some("needs DeepEP's blocks of 8 NVLink peers, and a node here holds no whole 8")
    } else {
        None
    }
}

/// The dispatcher-group sizes (etp x ep) DeepEP's `Buffer.get_dispatch_config`
/// and `get_combine_config` have recommended configs for; it asserts on any
/// other (deepseek-ai/DeepEP `deep_ep/buffer.py`; some releases add 48 and
/// 96, so those are left out).
const DEEPEP_GROUP_SIZES: [u64; 10] = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160];
const DEEPEP_GROUP_LIST: &str = "2, 4, 8, 16, 24, 32, 64, 128, 144 or 160";

/// How torchtitan splits a pipeline, as its refusals say it.
pub const TORCHTITAN_SPLIT: &str = "torchtitan gives every pipeline chunk the same layers but the first and the last, which may hold fewer";

/// Whether `c` asks torchtitan for an FP8 recipe only Transformer Engine has.
fn fp8_recipe_engine_problem(c: &ParallelConfig) -> bool {
    c.precision == Precision::Fp8
        && c.fp8_recipe
            .is_some_and(|recipe| recipe.engine_problem(c.engine).is_some())
}

/// What keeps `c` from training in NVFP4, if anything: Transformer
/// Engine's recipe runs in Megatron-LM only (torchtitan's converters train
/// in float8 or MXFP8), and NVIDIA's NVFP4 recipes turn the tensor-parallel
/// communication overlap off on every GPU (Megatron-Bridge
/// `scripts/performance/configs/llama/llama3_llm_pretrain.py` and
/// `llama31_llm_pretrain.py` at 0013c9a8: `tp_comm_overlap = False if
/// precision == "nvfp4"`).
pub fn nvfp4_problem(c: &ParallelConfig) -> Option<&'static str> {
    if c.precision != Precision::Nvfp4 {
        None
    } else if c.engine != Engine::Megatron {
        Some(
            "`engine megatron` (Transformer Engine's NVFP4 recipe; torchtitan trains in float8 or MXFP8)",
        )
    } else if c.tp_comm_overlap {
        Some("`tp_comm_overlap off` (NVIDIA's NVFP4 recipes run without it)")
    } else {
        None
    }
}

/// What keeps Megatron-LM from keeping `c`'s weights in FP8 or NVFP4, if
/// anything: GEMMs in that format, Transformer Engine's layers, and a
/// sharded optimizer to hold the fp32 master weights they are cast from.
pub fn fp8_param_gather_problem(c: &ParallelConfig) -> Option<&'static str> {
    if c.precision == Precision::Bf16 {
        Some("`precision fp8` or `precision nvfp4`")
    } else if c.engine != Engine::Megatron {
        Some("`engine megatron` (torchao's float8 keeps 16-bit weights)")
    } else if c.optimizer_sharding == OptimizerSharding::None {
        Some(
            "sharded optimizer states (`optimizer_sharding optimizer-states` or `optimizer_sharding full`)",
        )
    } else {
        None
    }
}

/// What keeps Megatron-Core from offloading `c`'s activations, if
/// anything: `TransformerConfig.__post_init__` refuses it with pipeline
/// parallelism, with activation recomputation, and for all the layers or
/// more; torchtitan has no activation offloading (its
/// `enable_cpu_offload` moves FSDP's parameters).
pub fn cpu_offload_problem(model: &ModelSpec, c: &ParallelConfig) -> Option<&'static str> {
    if c.cpu_offload_layers == 0 {
        None
    } else if c.engine != Engine::Megatron {
        Some("`engine megatron` (torchtitan offloads no activations)")
    } else if c.pp > 1 {
        Some("`pp 1` (Megatron-Core has no CPU offloading with pipeline parallelism)")
    } else if c.recompute != Recompute::None {
        Some("`recompute none` (Megatron-Core offloads no activations it recomputes)")
    } else if c.cpu_offload_layers >= model.layers {
        Some("fewer layers than the model has (Megatron-Core keeps the last one on the GPU)")
    } else {
        None
    }
}

/// What keeps Megatron-Core from deferring `c`'s output-layer weight
/// gradient, if anything: `ModelParallelConfig.__post_init__` refuses it
/// without pipeline parallelism (there is no flush to hide it in);
/// torchtitan has no such switch.
pub fn wgrad_deferral_problem(c: &ParallelConfig) -> Option<&'static str> {
    if c.wgrad_deferral == WgradDeferral::Off {
        None
    } else if c.engine != Engine::Megatron {
        Some("`engine megatron` (torchtitan defers no weight gradients)")
    } else if c.pp < 2 {
        Some("`pp` of 2 or more (Megatron-Core hides the deferred GEMMs in the pipeline flush)")
    } else {
        None
    }
}

/// What keeps Megatron-Core from running `c` with its batch-level EP
/// overlap, if anything: it overlaps expert parallelism's all-to-alls
/// (alltoall or flex dispatchers), pairs micro-batches that full
/// recomputation would replay in a fixed order, and under a pipeline
/// schedules the pairs only interleaved. CUDA graphs do not stop it: an
/// MoE model's per-layer graphs hold attention, router and preprocess
/// (what the export scopes them to, as NVIDIA's recipes run the overlap:
/// Megatron-LM's DeepSeek-V3 GB200 guide, Megatron-Bridge's Qwen3-30B-A3B
/// H100 recipe), and a whole iteration's graph captures the pairs.
pub fn ep_overlap_problem(model: &ModelSpec, c: &ParallelConfig) -> Option<&'static str> {
    if model.moe.is_none() {
        Some("expert parallelism (`ep` above 1)")
    } else {
        ep_overlap_config_problem(c)
    }
}

/// [`ep_overlap_problem`] from the configuration alone (the model is taken
/// to have experts): what a specification's other keys rule out.
pub fn ep_overlap_config_problem(c: &ParallelConfig) -> Option<&'static str> {
    if c.ep < 2 {
        Some("expert parallelism (`ep` above 1)")
    } else if c.engine != Engine::Megatron {
        Some("`engine megatron` (torchtitan has no batch-level overlap)")
    } else if c.dispatcher == Dispatcher::AllGather {
        Some("`moe_dispatcher alltoall`, `moe_dispatcher flex` or `moe_dispatcher hybridep`")
    } else if c.recompute == Recompute::Full {
        Some("`recompute selective` or `none` (not full)")
    } else if c.pp > 1 && c.schedule != ScheduleKind::Interleaved {
        Some("`schedule interleaved` under a pipeline")
    } else {
        None
    }
}

impl Rule {
    /// A short name for counts of dropped configurations.
    pub fn summary(self) -> &'static str {
        match self {
            Rule::ZeroDegree => "a degree is zero",
            Rule::GpuCount => "tp x pp x dp differs from the GPU count",
            Rule::TensorParallelOutsideNode => "tp neither divides the node nor spans whole nodes",
            Rule::HeadsNotDivisible => "heads not divisible by tp",
            Rule::FfnNotDivisible => "ffn hidden not divisible by tp",
            Rule::BatchNotDivisible => "global batch not divisible by micro-batch x dp",
            Rule::LayersNotDivisible => "layers not divisible by pp x virtual stages",
            Rule::InterleavedShape => "interleaving needs pp >= 2 and v >= 2",
            Rule::InterleavedMicroBatches => "interleaving needs at least pp micro-batches",
            Rule::VirtualStagesWithoutInterleaving => "virtual stages need interleaving",
            Rule::SequenceParallelWithoutTp => "sequence parallelism needs tp >= 2",
            Rule::SequenceNotSplit => "sequence parallelism needs tp to divide the sequence",
            Rule::BpipeSchedule => "BPipe needs 1f1b and pp >= 2",
            Rule::StageOrderWithoutBpipe => "the BPipe stage order needs BPipe",
            Rule::UnevenWithoutPipeline => "an uneven split needs pp >= 2",
            Rule::UnevenSplit => "first/last stage layers leave no even split",
            Rule::TpOverlapWithoutSp => "tp comm overlap needs sequence parallelism",
            Rule::ParamGatherOverlap => {
                "param-gather overlap needs the distributed optimizer and grad-reduce overlap"
            }
            Rule::CudaGraphsWithFullRecompute => {
                "per-layer CUDA graphs do not run with full recomputation"
            }
            Rule::FullGraphNeedsSyncFreeExperts => {
                "a whole-iteration CUDA graph of an MoE model needs the HybridEP dispatcher"
            }
            Rule::RecomputeForEngine => "a recomputation policy the engine lacks",
            Rule::AcFrequency => "selective-layer checkpointing needs a frequency of 1 or more",
            Rule::CompileWithoutTorchtitan => "torch.compile needs the torchtitan engine",
            Rule::EngineCannotRun => "a switch torchtitan cannot run",
            Rule::HybridSharding => "a hybrid-sharding group that cannot be",
            Rule::ContextNotDivisible => "sequence not divisible by 2 x cp",
            Rule::CpCommWithoutCp => "a context-parallel exchange without cp",
            Rule::ContextHeadsNotDivisible => "all-to-all cp needs tp x cp to divide the heads",
            Rule::HierarchicalCp => "a2a+p2p cp needs an all-to-all group dividing cp",
            Rule::WindowedCpRing => "sliding windows under a cp ring",
            Rule::SparseSyncOfDenseEmbedding => "a sparse embedding sync of a dense gradient",
            Rule::SparseSyncWithSharding => "a sparse embedding sync under this sharding",
            Rule::ExpertsWithoutMoe => "expert parallelism on a dense model",
            Rule::ExpertsNotDivisible => "experts not divisible by ep",
            Rule::ExpertFfnNotDivisible => "expert ffn hidden not divisible by etp",
            Rule::ExpertGroupNotDivisible => "etp x ep does not divide tp x cp x dp",
            Rule::FlexWithoutExpertRanks => "a flex dispatcher needs etp x ep above 1",
            Rule::DeepEpGroupSize => "DeepEP has no config for this etp x ep",
            Rule::FlexGroupAcrossNodes => "a flex dispatcher's group straddles nodes",
            Rule::MoeTpWithoutSp => "MoE with tp needs sequence parallelism",
            Rule::EpOverlapNeeds => {
                "EP comm overlap needs ep > 1, an alltoall or flex dispatcher, no full recomputation, and interleaving under a pipeline"
            }
            Rule::Fp8ParamGatherNeeds => {
                "FP8 parameter gather needs FP8 with Megatron-LM and sharded optimizer states"
            }
            Rule::Fp8RecipeEngine => "torchtitan scales FP8 tensorwise or as MXFP8",
            Rule::Nvfp4Needs => "NVFP4 training needs Megatron-LM without TP comm overlap",
            Rule::TorchtitanStageSplit => {
                "torchtitan's pipeline chunks are equal but for shorter end ones"
            }
            Rule::CpuOffloadNeeds => {
                "CPU offloading needs Megatron-LM, pp 1, no recomputation and fewer layers than the model"
            }
            Rule::WgradDeferralNeeds => {
                "deferring the embedding weight gradient needs Megatron-LM and pp > 1"
            }
            Rule::RecomputeModulesNeed => {
                "recompute modules need Megatron-LM's selective recomputation and the modules in the model"
            }
        }
    }

    /// The explanation of a rule about what an engine runs, which needs
    /// only the configuration (the CLI checks a search space with it).
    pub fn explain_engine(self, c: &ParallelConfig) -> String {
        match self {
            Rule::CompileWithoutTorchtitan => {
                "`compile on` needs `engine torchtitan` (Megatron-LM does not run torch.compile)"
                    .into()
            }
            _ => {
                let other = Engine::ALL
                    .into_iter()
                    .find(|e| Recompute::of(*e).contains(&c.recompute));
                format!(
                    "`recompute {}` is not a policy of the {} engine; it runs {}{}",
                    c.recompute.name(),
                    c.engine.name(),
                    Recompute::of(c.engine)
                        .iter()
                        .map(|r| r.name())
                        .collect::<Vec<_>>()
                        .join(", "),
                    other.map_or(String::new(), |e| format!(
                        " (add `engine {}`, which does)",
                        e.name()
                    ))
                )
            }
        }
    }

    pub fn explain(
        self,
        c: &ParallelConfig,
        model: &ModelSpec,
        global_batch: u64,
        gpus: u64,
        gpus_per_node: u64,
    ) -> String {
        match self {
            // A dp of 0 is what is left when tp x cp x pp passes the GPUs.
            Rule::ZeroDegree
                if c.dp == 0 && c.tp > 0 && c.pp > 0 && c.cp > 0 && c.tp * c.cp * c.pp > gpus =>
            {
                format!(
                "tp x cp x pp = {} x {} x {} = {} is more than the job's {gpus} GPUs, which leaves no data-parallel rank; make tp x cp x pp divide the GPU count",
                c.tp,
                c.cp,
                c.pp,
                c.tp * c.cp * c.pp
            )
            }
            Rule::ZeroDegree => {
                let zero: Vec<&str> = [
                    ("tp", c.tp),
                    ("pp", c.pp),
                    ("dp", c.dp),
                    ("cp", c.cp),
                    ("ep", c.ep),
                    ("etp", c.etp),
                    ("micro_batch", c.micro_batch),
                    ("virtual_stages", c.virtual_stages),
                ]
                .into_iter()
                .filter(|&(_, v)| v == 0)
                .map(|(name, _)| name)
                .collect();
                format!(
                    "`{}` is 0; tp, pp, dp, cp, ep, etp, micro-batch and virtual stages must all be at least 1",
                    zero.join("`, `")
                )
            }
            Rule::GpuCount if c.cp > 1 => format!(
                "tp x cp x pp x dp = {} x {} x {} x {} = {} but the job has {gpus} GPUs; make the product equal",
                c.tp,
                c.cp,
                c.pp,
                c.dp,
                c.gpus()
            ),
            Rule::GpuCount => format!(
                "tp x pp x dp = {} x {} x {} = {} but the job has {gpus} GPUs; make the product equal",
                c.tp,
                c.pp,
                c.dp,
                c.gpus()
            ),
            Rule::TensorParallelOutsideNode => format!(
                "tp {} must divide the {gpus_per_node} GPUs of a node, or be a multiple of them (tensor parallelism over whole nodes)",
                c.tp
            ),
            Rule::HeadsNotDivisible => format!(
                "heads ({}) and kv heads ({}) must be divisible by tp {}; pick a tp that divides them",
                model.heads, model.kv_heads, c.tp
            ),
            Rule::FfnNotDivisible => format!(
                "ffn hidden ({}) must be divisible by tp {}; pick a tp that divides it",
                model.ffn_hidden, c.tp
            ),
            Rule::BatchNotDivisible => format!(
                "global batch {global_batch} must be divisible by micro-batch x dp = {} x {}; change `global_batch` or `micro_batch`",
                c.micro_batch, c.dp
            ),
            Rule::LayersNotDivisible => format!(
                "layers ({}) must divide evenly over pp x virtual stages = {} x {}, or give the end stages fewer with `first_stage_layers`/`last_stage_layers`",
                model.layers, c.pp, c.virtual_stages
            ),
            Rule::InterleavedShape => {
                "the interleaved schedule needs pp >= 2 and `virtual_stages` >= 2".into()
            }
            Rule::InterleavedMicroBatches => format!(
                "the interleaved schedule needs at least pp ({}) micro-batches per iteration, found {}; raise `global_batch` or lower `micro_batch`",
                c.pp,
                c.micro_batches(global_batch)
            ),
            Rule::VirtualStagesWithoutInterleaving => {
                "virtual stages other than 1 need `schedule interleaved`".into()
            }
            Rule::SequenceParallelWithoutTp => "sequence parallelism needs tp >= 2".into(),
            Rule::SequenceNotSplit => format!(
                "sequence parallelism cannot split the sequence {} evenly over tp {}: pick a tp that divides it, or `sequence_parallel off`",
                model.seq_len, c.tp
            ),
            Rule::BpipeSchedule => "BPipe needs `schedule 1f1b` and pp >= 2".into(),
            Rule::StageOrderWithoutBpipe => {
                "`stage_order bpipe-pairs` places BPipe's stage pairs side by side; it needs `bpipe on`".into()
            }
            Rule::UnevenWithoutPipeline => {
                "`first_stage_layers` and `last_stage_layers` need pp >= 2".into()
            }
            Rule::UnevenSplit => {
                let given = c.first_stage_layers.unwrap_or(0) + c.last_stage_layers.unwrap_or(0);
                let others = c.pp
                    - u64::from(c.first_stage_layers.is_some())
                    - u64::from(c.last_stage_layers.is_some());
                if given >= model.layers || others == 0 {
                    return format!(
                        "first/last stage layers {}/{} take {given} of the {} layers and leave the other {others} of pp {} stage(s) none; give `first_stage_layers`/`last_stage_layers` fewer layers, or a larger pp",
                        c.first_stage_layers.map_or("even".to_string(), |n| n.to_string()),
                        c.last_stage_layers.map_or("even".to_string(), |n| n.to_string()),
                        model.layers,
                        c.pp
                    );
                }
                format!(
                    "first/last stage layers {}/{} leave {} of the {} layers for the other {} stage(s), which must share them evenly{}, at least one each; change `first_stage_layers`/`last_stage_layers`",
                    c.first_stage_layers.map_or("even".to_string(), |n| n.to_string()),
                    c.last_stage_layers.map_or("even".to_string(), |n| n.to_string()),
                    model.layers as i64 - given as i64,
                    model.layers,
                    c.pp - u64::from(c.first_stage_layers.is_some()) - u64::from(c.last_stage_layers.is_some()),
                    if c.virtual_stages > 1 {
                        format!(" in multiples of the {} virtual stages", c.virtual_stages)
                    } else {
                        String::new()
                    }
                )
            }
            Rule::TpOverlapWithoutSp => {
                "`tp_comm_overlap` needs `sequence_parallel on` (Megatron-LM overlaps the sequence-parallel all-gathers and reduce-scatters)".into()
            }
            Rule::ParamGatherOverlap => {
                "`overlap_param_gather` needs `optimizer_sharding optimizer-states` (the distributed optimizer) and `overlap_grad_reduce on`".into()
            }
            Rule::CudaGraphsWithFullRecompute => {
                "`cuda_graphs on` (per layer) does not run with `recompute full` (Megatron-LM refuses it); use selective or none, or `cuda_graphs full` (the whole iteration)".into()
            }
            Rule::FullGraphNeedsSyncFreeExperts => format!(
                "`cuda_graphs full` captures the MoE layers too, which must then dispatch without a host sync: Megatron-LM's sync-free experts run on `moe_dispatcher hybridep` (found {}); use it, or `cuda_graphs on` (per layer)",
                c.dispatcher.name()
            ),
            Rule::RecomputeForEngine | Rule::CompileWithoutTorchtitan => self.explain_engine(c),
            Rule::AcFrequency => "`ac_frequency` must be at least 1".into(),
            Rule::EngineCannotRun => {
                let what = if model.mtp_layers > 0 {
                    "multi-token prediction (its models have none: plan with `--mtp-layers 0` to train without them)".to_string()
                } else if c.bpipe {
                    "BPipe (`bpipe off`)".to_string()
                } else if c.tp_comm_overlap && !c.compile {
                    "tensor-parallel overlap without torch.compile (its async tensor parallelism needs `compile on`)".to_string()
                } else if c.cross_entropy_fusion != CrossEntropyFusion::Off {
                    format!(
                        "Megatron-LM's fused cross-entropy (`cross_entropy_fusion {}`; its loss is PyTorch's cross-entropy: `cross_entropy_fusion off`)",
                        c.cross_entropy_fusion.name()
                    )
                } else if model.moe.is_some() && c.dispatcher != Dispatcher::AllToAll {
                    format!(
                        "the {} token dispatcher (its expert parallelism dispatches with all-to-all: `moe_dispatcher alltoall`)",
                        c.dispatcher.name()
                    )
                } else if c.cuda_graphs == CudaGraphs::FullIteration {
                    "Megatron-LM's whole-iteration graph (`cuda_graphs full`; torchtitan's own graphs are `cuda_graphs on`)".to_string()
                } else {
                    "CUDA graphs with a pipeline (`cuda_graphs off`, or pp 1)".to_string()
                };
                format!("the torchtitan engine cannot run {what}")
            }
            Rule::HybridSharding => format!(
                "`dp_shard {}` must be at least 2, below dp {} and divide it, for `engine torchtitan` with `optimizer_sharding full` or optimizer-states (torchtitan's HSDP; leave it out to shard over all of dp)",
                c.dp_shard.unwrap_or(0),
                c.dp
            ),
            Rule::ContextNotDivisible => format!(
                "cp {} must split the sequence {} into 2 x cp equal chunks (Megatron-LM balances the causal mask so); pick a cp with seq_len divisible by {}",
                c.cp,
                model.seq_len,
                2 * c.cp
            ),
            Rule::CpCommWithoutCp => format!(
                "`cp_comm {}` needs cp >= 2; leave it out with cp 1",
                c.cp_comm.name()
            ),
            Rule::WindowedCpRing => format!(
                "Transformer Engine runs sliding-window attention under context parallelism only with `cp_comm a2a` or allgather (its p2p and a2a+p2p rings assert without a full causal mask), and got `cp_comm {}` with cp {}; use `cp_comm a2a` or allgather",
                c.cp_comm.name(),
                c.cp
            ),
            Rule::ContextHeadsNotDivisible => format!(
                "`cp_comm {}` splits the heads over tp x {} = {}, which must divide heads ({}) and kv heads ({}); use `cp_comm {}` or a smaller cp",
                c.cp_comm.name(),
                if c.cp_comm == CpComm::A2a { "cp" } else { "cp_a2a" },
                c.tp * c.cp_comm.all_to_all_ranks(c),
                model.heads,
                model.kv_heads,
                // Transformer Engine's rings refuse windows: gather instead.
                if c.engine == Engine::Megatron && model.windowed_layers() > 0 {
                    "allgather"
                } else {
                    "p2p"
                }
            ),
            // No proper divisor of cp from 2 up: no group to form.
            Rule::HierarchicalCp if c.cp_comm == CpComm::A2aP2p && c.cp < 4 => format!(
                "`cp_comm a2a+p2p` groups the cp ranks for an all-to-all and rings between the groups, which needs cp of 4 or more, and got cp {}; use `cp_comm p2p` or a2a, or a larger cp",
                c.cp
            ),
            Rule::HierarchicalCp if c.cp_comm == CpComm::A2aP2p => format!(
                "`cp_comm a2a+p2p` needs an all-to-all group (`cp_a2a`, taken from the cp ranks that share a node with their tp ranks) from 2 to below cp {} and dividing it, and got {}; use `cp_comm p2p` or a2a, or a smaller tp",
                c.cp, c.cp_a2a
            ),
            Rule::HierarchicalCp => format!(
                "`cp_a2a {}` is the all-to-all group of `cp_comm a2a+p2p`; leave it out for `cp_comm {}`",
                c.cp_a2a,
                c.cp_comm.name()
            ),
            Rule::ExpertsWithoutMoe => {
                let given: Vec<String> = [("ep", c.ep), ("etp", c.etp)]
                    .iter()
                    .filter(|(_, n)| *n > 1)
                    .map(|(key, n)| format!("{key} {n}"))
                    .collect();
                format!(
                    "model `{}` has no experts, so {} mean{} nothing; leave {} out, or give the model experts (`experts`)",
                    model.name,
                    given.join(" and "),
                    if given.len() == 1 { "s" } else { "" },
                    if given.len() == 1 { "it" } else { "them" }
                )
            }
            Rule::ExpertsNotDivisible => format!(
                "ep {} must divide the {} experts; pick an ep that divides them",
                c.ep,
                model.moe.map_or(0, |m| m.experts)
            ),
            Rule::ExpertFfnNotDivisible => format!(
                "etp {} must divide the expert ffn hidden {}; pick an etp that divides it",
                c.etp,
                model.moe.map_or(0, |m| m.ffn_hidden)
            ),
            Rule::ExpertGroupNotDivisible => format!(
                "etp x ep = {} x {} must divide tp x cp x dp = {} (the ranks of a pipeline stage the experts are spread over); change `ep` or `etp`",
                c.etp,
                c.ep,
                c.tp * c.cp * c.dp
            ),
            Rule::FlexGroupAcrossNodes => format!(
                "`moe_dispatcher {}` over etp x ep = {} ranks {}; change `ep` or `etp`, or use `moe_dispatcher alltoall`",
                c.dispatcher.name(),
                c.etp * c.ep,
                flex_group_problem(c, gpus_per_node).unwrap_or("does not tile the nodes")
            ),
            Rule::FlexWithoutExpertRanks => format!(
                "`moe_dispatcher {}` dispatches over the etp x ep ranks, and there is one (Megatron-Core asserts TPxEP > 1 for the flex dispatcher); raise `ep`, or use `moe_dispatcher alltoall`",
                c.dispatcher.name()
            ),
            Rule::DeepEpGroupSize => format!(
                "the flex dispatcher's DeepEP kernels run etp x ep groups of {DEEPEP_GROUP_LIST} ranks (its `Buffer.get_dispatch_config` table), not {} x {} = {}; change `ep` or `etp`, or use `moe_dispatcher hybridep` or `moe_dispatcher alltoall`",
                c.etp,
                c.ep,
                c.etp * c.ep
            ),
            Rule::MoeTpWithoutSp => format!(
                "MoE layers with tp {} need `sequence_parallel on` (Megatron-Core refuses MoE with tensor parallelism otherwise)",
                c.tp
            ),
            Rule::EpOverlapNeeds => format!(
                "`ep_comm_overlap on` needs {}, as Megatron-Core asserts; turn `ep_comm_overlap` off or change that",
                ep_overlap_problem(model, c).unwrap_or("its settings")
            ),
            Rule::RecomputeModulesNeed => format!(
                "`recompute_modules {}` needs {}; give `recompute selective` with modules the model has, or leave them out",
                c.recompute_modules.names().join(","),
                c.recompute_modules.problem(model).unwrap_or(
                    "`recompute selective` with `engine megatron` (other policies recompute no modules)"
                )
            ),
            Rule::CpuOffloadNeeds => format!(
                "`cpu_offload_layers {}` needs {}; set `cpu_offload_layers 0` or change that",
                c.cpu_offload_layers,
                cpu_offload_problem(model, c).unwrap_or("its settings")
            ),
            Rule::WgradDeferralNeeds => format!(
                "`wgrad_deferral {}` needs {}; set `wgrad_deferral off` or change that",
                c.wgrad_deferral.name(),
                wgrad_deferral_problem(c).unwrap_or("its settings")
            ),
            Rule::Fp8ParamGatherNeeds => format!(
                "`fp8_param_gather on` needs {}; turn `fp8_param_gather` off or change that",
                fp8_param_gather_problem(c).unwrap_or("its settings")
            ),
            Rule::TorchtitanStageSplit => format!(
                "{TORCHTITAN_SPLIT}, and stages of {} (first), {} (middle) and {} (last) layers over {} chunks each have no such split; give end stages no larger than the middle ones, or leave `first_stage_layers` and `last_stage_layers` out",
                c.stage_layers(model.layers, 0),
                c.middle_stage_layers(model.layers),
                c.stage_layers(model.layers, c.pp - 1),
                c.virtual_stages
            ),
            Rule::Nvfp4Needs => format!(
                "`precision nvfp4` needs {}; change that, or use `precision fp8`",
                nvfp4_problem(c).unwrap_or("its settings")
            ),
            Rule::Fp8RecipeEngine => c
                .fp8_recipe
                .and_then(|recipe| recipe.engine_problem(c.engine))
                .unwrap_or_default(),
            Rule::SparseSyncOfDenseEmbedding if model.tied_embeddings => format!(
                "embedding sync {}: this model ties its input embedding to the output head, whose gradient touches every row; use all-reduce",
                c.embedding_sync.name()
            ),
            Rule::SparseSyncOfDenseEmbedding => format!(
                "embedding sync {}: dp x cp = {} leaves no data-parallel ranks to synchronise; use all-reduce",
                c.embedding_sync.name(),
                c.dense_sync_degree()
            ),
            Rule::SparseSyncWithSharding if c.embedding_sync == SyncMethod::SparseAllGather => format!(
                "embedding sync sparse-all-gather with optimizer sharding {}: a sharded embedding's rows go to their shard's owner, which is the parameter-server method; use parameter-server or no sharding",
                c.optimizer_sharding.name()
            ),
            Rule::SparseSyncWithSharding => format!(
                "embedding sync {} with optimizer sharding {}{}: FSDP gathers and reduce-scatters the whole table every micro-batch; use the distributed optimizer (optimizer-states) with megatron, or all-reduce",
                c.embedding_sync.name(),
                c.optimizer_sharding.name(),
                if c.engine == Engine::Torchtitan { " on torchtitan" } else { "" }
            ),
        }
    }
}

impl fmt::Display for ParallelConfig {
    /// `tp4 pp8 dp32 mb1 interleavedx6 rc=none sp=on shard=optimizer-states
    /// bpipe=off attn=flash`, then what differs from the defaults: the end
    /// stages' layers (`first=7 last=7`), the overlaps Megatron-LM runs
    /// (`overlap=grad,param,tp`), `graphs=on`, `order=bpipe-pairs`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{} pp{} dp{} ", self.tp, self.pp, self.dp)?;
        if self.cp > 1 {
            write!(f, "cp{} ", self.cp)?;
        }
        if self.ep > 1 || self.etp > 1 {
            write!(f, "ep{} etp{} ", self.ep, self.etp)?;
        }
        write!(
            f,
            "mb{} {}{} rc={} sp={} shard={} bpipe={} attn={}",
            self.micro_batch,
            self.schedule.name(),
            if self.virtual_stages > 1 {
                format!("x{}", self.virtual_stages)
            } else {
                String::new()
            },
            self.recompute.name(),
            on_off(self.sequence_parallel),
            self.optimizer_sharding.name(),
            on_off(self.bpipe),
            self.attention.name(),
        )?;
        if let Some(n) = self.first_stage_layers {
            write!(f, " first={n}")?;
        }
        if let Some(n) = self.last_stage_layers {
            write!(f, " last={n}")?;
        }
        let overlaps: Vec<&str> = [
            (self.overlap_grad_reduce, "grad"),
            (self.overlap_param_gather, "param"),
            (self.tp_comm_overlap, "tp"),
            (self.ep_comm_overlap, "ep"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect();
        if !overlaps.is_empty() {
            write!(f, " overlap={}", overlaps.join(","))?;
        }
        if self.cuda_graphs.on() {
            write!(f, " graphs={}", self.cuda_graphs)?;
        }
        if self.stage_order != StageOrder::Megatron {
            write!(f, " order={}", self.stage_order.name())?;
        }
        if let Some(shard) = self.dp_shard {
            write!(f, " hsdp={}x{shard}", self.replicas())?;
        }
        if self.cp_comm != CpComm::P2p {
            write!(f, " cp-comm={}", self.cp_comm.name())?;
        }
        if self.cp_a2a != 1 {
            write!(f, " cp-a2a={}", self.cp_a2a)?;
        }
        if self.dispatcher != Dispatcher::default() {
            write!(f, " dispatch={}", self.dispatcher.name())?;
        }
        if self.precision != Precision::Bf16 {
            write!(f, " {}", self.precision.name())?;
            if let Some(recipe) = self.fp8_recipe {
                write!(f, "({})", recipe.name())?;
            }
        }
        if self.fp8_param_gather {
            f.write_str(match self.precision {
                Precision::Nvfp4 => " fp4-weights",
                _ => " fp8-weights",
            })?;
        }
        if self.grad_reduce != GradReduce::Fp32 {
            write!(f, " grad-reduce={}", self.grad_reduce.name())?;
        }
        if self.expandable_segments {
            f.write_str(" expandable-segments")?;
        }
        if self.cross_entropy_fusion != CrossEntropyFusion::Off {
            write!(f, " ce-fusion={}", self.cross_entropy_fusion.name())?;
        }
        if self.wgrad_deferral != WgradDeferral::Off {
            write!(f, " wgrad-deferral={}", self.wgrad_deferral.name())?;
        }
        if self.cpu_offload_layers > 0 {
            write!(f, " offload={}", self.cpu_offload_layers)?;
        }
        if !self.recompute_modules.is_default() {
            write!(f, " modules={}", self.recompute_modules.names().join("+"))?;
        }
        if self.embedding_sync != SyncMethod::AllReduce {
            write!(f, " embedding-sync={}", self.embedding_sync.name())?;
        }
        if self.recompute == Recompute::SelectiveLayer {
            write!(f, " every={}", self.ac_frequency)?;
        }
        if self.engine != Engine::Megatron {
            write!(f, " engine={}", self.engine.name())?;
        }
        if self.compile {
            f.write_str(" compile=on")?;
        }
        Ok(())
    }
}

pub fn on_off(flag: bool) -> &'static str {
    if flag { "on" } else { "off" }
}

/// Megatron-LM's `--account-for-embedding-in-pipeline-split` and
/// `--account-for-loss-in-pipeline-split`: the embedding and the loss count
/// as a layer each and `layers + 1 (+ 1)` split evenly over pp x v chunks, so
/// the first (last) stage holds one layer fewer. Returns the (first, last)
/// stage layers, or `None` where that count does not divide.
pub fn accounted_split(
    layers: u64,
    pp: u64,
    virtual_stages: u64,
    embedding: bool,
    loss: bool,
) -> Option<(Option<u64>, Option<u64>)> {
    let counted = layers + u64::from(embedding) + u64::from(loss);
    let chunks = pp.saturating_mul(virtual_stages);
    if pp < 2 || chunks == 0 || !counted.is_multiple_of(chunks) {
        return None;
    }
    let per_stage = counted / pp;
    Some((
        embedding.then(|| per_stage - 1),
        loss.then(|| per_stage - 1),
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_hierarchical_exchange_groups_the_cp_ranks_of_a_node() {
        use super::CpComm;
        // tp 2 on 8-GPU nodes leaves 4 cp ranks a node; cp 16 splits 4 x 4.
        assert_eq!(CpComm::default_cp_a2a_for(CpComm::A2aP2p, 16, 2, 8), 4);
        // cp 4 within a node would be all of cp: the largest proper group.
        assert_eq!(CpComm::default_cp_a2a_for(CpComm::A2aP2p, 4, 1, 8), 2);
        // tp 8 fills the node: no group, which the rules refuse.
        assert_eq!(CpComm::default_cp_a2a_for(CpComm::A2aP2p, 4, 8, 8), 1);
        assert_eq!(CpComm::default_cp_a2a_for(CpComm::P2p, 16, 1, 8), 1);
    }

    /// Transformer Engine's p2p and a2a+p2p rings refuse sliding windows;
    /// its a2a and all-gather exchanges, and torchtitan, take them.
    #[test]
    fn sliding_windows_under_context_parallelism_need_a2a_or_allgather() {
        let model = crate::model::builtin_model("gpt-oss-20b").unwrap();
        let with = |comm, engine| ParallelConfig {
            cp: 2,
            dp: 4,
            cp_comm: comm,
            cp_a2a: 1,
            engine,
            ..ParallelConfig::default()
        };
        let broken = |c: ParallelConfig| c.violation(&model, 64, 8, 8);
        assert_eq!(
            broken(with(CpComm::P2p, Engine::Megatron)),
            Some(Rule::WindowedCpRing)
        );
        let message = with(CpComm::P2p, Engine::Megatron)
            .check(&model, 64, 8, 8)
            .unwrap_err();
        assert!(message.contains("`cp_comm a2a`"), "{message}");
        for comm in [CpComm::A2a, CpComm::AllGather] {
            assert_ne!(
                broken(with(comm, Engine::Megatron)),
                Some(Rule::WindowedCpRing)
            );
        }
        assert_ne!(
            broken(with(CpComm::P2p, Engine::Torchtitan)),
            Some(Rule::WindowedCpRing)
        );
        let mut unwindowed = model.clone();
        unwindowed.window = None;
        assert_ne!(
            with(CpComm::P2p, Engine::Megatron).violation(&unwindowed, 64, 8, 8),
            Some(Rule::WindowedCpRing)
        );
    }

    #[test]
    fn a_dense_configuration_holds_any_dispatcher() {
        // Plan files written before the default moved say alltoall.
        let model = ModelSpec::gpt("gpt", 1024, 16, 8, 51200, 2048);
        let c = ParallelConfig {
            dp: 8,
            dispatcher: Dispatcher::AllToAll,
            ..ParallelConfig::default()
        };
        assert_eq!(c.check(&model, 64, 8, 8), Ok(()));
        let experts = ParallelConfig { ep: 2, ..c };
        assert!(c.check(&model, 64, 8, 8).is_ok() && experts.check(&model, 64, 8, 8).is_err());
    }

    use super::*;

    /// Plan files written before the whole-iteration kind hold a switch;
    /// they read back as the per-layer graphs they meant, and every kind
    /// round-trips through its name.
    #[test]
    fn cuda_graphs_read_old_switches_and_their_own_names() {
        let read = |text: &str| serde_json::from_str::<CudaGraphs>(text).unwrap();
        assert_eq!(read("true"), CudaGraphs::Layers);
        assert_eq!(read("false"), CudaGraphs::Off);
        for kind in CudaGraphs::ALL {
            assert_eq!(read(&serde_json::to_string(&kind).unwrap()), kind);
        }
        assert_eq!(read("\"full_iteration\""), CudaGraphs::FullIteration);
        assert!(serde_json::from_str::<CudaGraphs>("\"sometimes\"").is_err());
        let number = serde_json::from_str::<CudaGraphs>("1")
            .unwrap_err()
            .to_string();
        assert!(number.contains("`cuda_graphs` as"), "{number}");
        let mut written = serde_json::to_value(ParallelConfig::default()).unwrap();
        written["cuda_graphs"] = serde_json::Value::Bool(true);
        let old: ParallelConfig = serde_json::from_value(written).unwrap();
        assert_eq!(old.cuda_graphs, CudaGraphs::Layers);
    }

    /// The chunks, taken in the model's order (chunk j of every stage, then
    /// chunk j + 1), tile the layers, and each stage's chunks hold its
    /// layers: even, uneven and interleaved splits.
    #[test]
    fn chunks_tile_the_model_in_interleaved_order() {
        let cases = [
            (24, 1, 1, None, None),
            (24, 4, 1, None, None),
            (24, 4, 2, None, None),
            (61, 8, 1, Some(7), Some(6)),
            (61, 4, 3, Some(12), Some(13)),
            (30, 3, 4, Some(7), Some(15)),
        ];
        for (layers, pp, v, first, last) in cases {
            let c = ParallelConfig {
                pp,
                virtual_stages: v,
                schedule: if v > 1 {
                    ScheduleKind::Interleaved
                } else {
                    ScheduleKind::OneFOneB
                },
                first_stage_layers: first,
                last_stage_layers: last,
                ..ParallelConfig::default()
            };
            assert_eq!(c.split_problem(layers), None, "{c}");
            let layout = c.chunk_layout(layers);
            let mut next = 0;
            let mut held = vec![0; pp as usize];
            for j in 0..v {
                for stage in 0..pp {
                    assert_eq!(layout.stage_layers(stage), c.stage_layers(layers, stage));
                    let chunk = layout.chunk(stage, j);
                    // The first round's layers are found on their stage,
                    // the later rounds' on none.
                    let expected = (j == 0).then_some(stage);
                    assert!(
                        chunk
                            .clone()
                            .all(|l| layout.first_round_stage(l) == expected),
                        "{c} stage {stage} chunk {j}"
                    );
                    assert_eq!(chunk.start, next, "{c} stage {stage} chunk {j}");
                    next = chunk.end;
                    held[stage as usize] += chunk.end - chunk.start;
                }
            }
            assert_eq!(next, layers, "{c}");
            for stage in 0..pp {
                assert_eq!(held[stage as usize], c.stage_layers(layers, stage), "{c}");
            }
        }
    }

    /// Selective recomputation's FLOPs are its modules' matrix multiplies:
    /// norms and activations add none, the attention core its score
    /// products, an MoE layer's MLP part its active experts on MoE layers.
    #[test]
    fn selective_recomputation_counts_the_flops_of_its_modules() {
        use super::{Recompute, RecomputeModules};
        use crate::model::builtin_model;
        let selective = |model: &ModelSpec, modules: &str| {
            let c = ParallelConfig {
                recompute: Recompute::Selective,
                recompute_modules: RecomputeModules::parse("modules", modules).unwrap(),
                ..ParallelConfig::default()
            };
            c.recomputed_flops_per_token(model)
        };
        let close = |a: f64, b: f64| assert!((a - b).abs() <= 1e-12 * b.abs(), "{a} vs {b}");
        let gpt_oss = builtin_model("gpt-oss-120b").unwrap();
        let layers = gpt_oss.layers as f64;
        assert_eq!(selective(&gpt_oss, "layernorm,moe_act"), 0.0);
        let core = selective(&gpt_oss, "core_attn");
        close(core, layers * gpt_oss.counted_attention_flops_per_token());
        let experts = layers * gpt_oss.moe_mlp_flops_per_token().unwrap();
        close(selective(&gpt_oss, "moe"), experts);
        close(selective(&gpt_oss, "core_attn,moe"), core + experts);
        // DeepSeek-V3: the MLP of its three dense layers, and MLA's two
        // up-projections (queries from 1536, keys and values from 512).
        let deepseek = builtin_model("deepseek-v3").unwrap();
        close(
            selective(&deepseek, "mlp"),
            3.0 * deepseek.mlp_flops_per_token(deepseek.ffn_hidden),
        );
        let up = 2.0 * (1536 * 128 * 192 + 512 * 128 * 256) as f64;
        close(
            selective(&deepseek, "mla_up_proj"),
            deepseek.layers as f64 * up,
        );
    }
}
