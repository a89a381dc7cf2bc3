//! The cost model: `predict(scenario, config) -> Prediction`.
//!
//! Pure, deterministic and allocation-free on the hot path: the search calls
//! it for every candidate. No I/O, no terminal, no tables.
//!
//! Structure, bottom-up:
//! - [`kernels`]: time of one GEMM, one attention core, one memory-bound pass;
//! - [`comm`]: collectives and point-to-point messages on the links the
//!   placement gives them;
//! - [`layer`]: one transformer layer's forward/backward/recompute time for a
//!   micro-batch on one tensor-parallel shard, host launch cost included;
//! - [`memory`]: bytes per pipeline stage;
//! - this file: stages, schedules, data-parallel synchronisation, optimizer
//!   step, and the summary figures.
//!
//! A scenario may carry measurements ([`Scenario::with_profile`]): then an
//! intra-node collective with a measured curve, and a layer whose shape was
//! measured, take the measured time instead of the formula's (`comm.rs`,
//! `layer.rs` say how). [`predict_with_usage`] says how many lookups a
//! prediction made and how many were extrapolated.

mod comm;
mod deepep;
mod kernels;
mod layer;
pub use layer::{EndsTime, LayerTime, LayerTimes};
mod memory;
mod routing;
pub mod sparse;
mod sync_parts;
pub use sync_parts::{SyncParts, sync_key};

pub use memory::{
    StageMemory, fragmentation_coefficient, gathered_weight_bytes, in_flight,
    layer_activation_bytes, schedule_in_flight, stage_activation_bytes, stage_memory, state_floor,
    state_key,
};

use crate::cluster::{AttentionRates, GpuSpec, NodeGroup, Placement};
use crate::coefficients::{Coefficients, CollectiveAlgorithm, CostModel};
use crate::config::{ChunkLayout, ParallelConfig, Recompute, ScheduleKind, SyncMethod};
use crate::model::ModelSpec;
use crate::profile::Measurements;
use serde::{Deserialize, Serialize};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Everything about a job except how it is parallelised.
#[derive(Debug, Clone, Copy)]
pub struct Scenario<'a> {
    pub model: &'a ModelSpec,
    pub global_batch: u64,
    pub gpu: &'a GpuSpec,
    pub placement: Placement,
    /// Per-GPU, per-direction intra-node bandwidth, bytes/s.
    pub intra_node_bw: f64,
    /// Per-node inter-node injection bandwidth, bytes/s.
    pub inter_node_bw: f64,
    /// Usable device memory when it differs from the datasheet (e.g. a
    /// simulated smaller device), bytes.
    pub memory_limit: Option<f64>,
    pub cost: &'a CostModel,
    /// Measured collectives and layers that replace the formulas where they
    /// cover the case; `None` for the formulas alone.
    pub profile: Option<&'a Measurements>,
    /// GEMM and HBM efficiencies scaled to what the profile's device sweep
    /// measured (1 without one): set by [`Scenario::with_profile`].
    pub measured_gemm_scale: f64,
    pub measured_hbm_scale: f64,
    /// `model`'s per-layer parameter counts, worked out once.
    pub(crate) layer_params: memory::LayerParams,
    /// The GPU's measured fused-attention rates, where the catalogue has
    /// them, scaled by `attention_efficiency_flash` over its prior (so a
    /// fitted value moves them): see [`kernels::flash_efficiency`].
    pub(crate) attention_rates: Option<AttentionRates>,
}

impl<'a> Scenario<'a> {
    /// A job of `gpus` GPUs on nodes of `group`.
    pub fn new(
        model: &'a ModelSpec,
        global_batch: u64,
        group: &'a NodeGroup,
        gpus: u64,
        cost: &'a CostModel,
    ) -> Self {
        Scenario {
            model,
            global_batch,
            gpu: &group.gpu,
            placement: Placement::new(gpus, group.gpus_per_node),
            intra_node_bw: group.intra_node_bw.bytes_per_s(),
            inter_node_bw: group.inter_node_bw.bytes_per_s(),
            memory_limit: None,
            cost,
            profile: None,
            measured_gemm_scale: 1.0,
            measured_hbm_scale: 1.0,
            layer_params: memory::LayerParams::of(model),
            attention_rates: kernels::scaled_attention_rates(&group.gpu, &cost.coefficients),
        }
    }

    /// The same scenario using `profile`'s measurements where they apply.
    /// A device sweep in the profile (`profile device`) replaces the GEMM
    /// efficiency coefficient by the measured one (the output head's and the
    /// FP8 GEMMs' keep their ratio to it), the HBM efficiency by the
    /// measured copy's, and fused attention's rates by the measured ones.
    pub fn with_profile(mut self, profile: Option<&'a Measurements>) -> Self {
        self.profile = profile;
        let k = &self.cost.coefficients;
        self.measured_hbm_scale = profile
            .and_then(|p| p.hbm_fraction(self.gpu.hbm_bandwidth))
            .map_or(1.0, |f| f / k.hbm_efficiency);
        // A measured GEMM's time holds its result's store, which the cost
        // model adds at the memory rate after the main loop.
        let store_rate = self.gpu.hbm_bandwidth * k.hbm_efficiency * self.measured_hbm_scale;
        self.measured_gemm_scale = profile
            .and_then(|p| p.gemm_peak_fraction(self.gpu.peak_flops, k.gemm_dim_half, store_rate))
            .map_or(1.0, |f| f / k.gemm_efficiency);
        // Measured fused attention replaces the catalogue's rates (bursts
        // taken at the settled clock), as measured GEMMs replace the
        // coefficient: this device's figures, timed settled, whatever a
        // fit did to the coefficient.
        if let Some(rates) = profile.and_then(|p| p.attention_rates(self.gpu.peak_flops)) {
            self.attention_rates = Some(rates);
        }
        self
    }

    fn coef(&self) -> &Coefficients {
        &self.cost.coefficients
    }

    fn collective(&self) -> CollectiveAlgorithm {
        self.cost.collective
    }

    /// Memory a stage may use: capacity less the fragmentation reserve.
    pub fn usable_memory(&self) -> f64 {
        let capacity = self.memory_limit.unwrap_or(self.gpu.memory_bytes);
        capacity * (1.0 - self.coef().memory_reserve_fraction)
    }
}

/// Where one iteration's time goes, in seconds. The parts add up to the
/// iteration time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeBreakdown {
    /// GPU compute of the slowest stage's micro-batches (GEMMs, attention,
    /// element-wise work, embedding and head).
    pub compute: f64,
    /// Host launch time not hidden behind GPU work, and per-micro-batch host work.
    pub host: f64,
    /// Pipeline fill and drain.
    pub bubble: f64,
    pub tensor_parallel: f64,
    /// Expert parallelism's token all-to-alls (and etp's gathers) not hidden.
    #[serde(default)]
    pub expert_parallel: f64,
    /// Context parallelism's key/value exchange not hidden.
    #[serde(default)]
    pub context_parallel: f64,
    pub pipeline_p2p: f64,
    /// Data-parallel gradient (and parameter) synchronisation not hidden.
    pub data_parallel: f64,
    pub optimizer: f64,
    pub bpipe_transfer: f64,
    /// Activation offloading's copies to and from host memory not hidden.
    #[serde(default)]
    pub offload: f64,
    /// Fixed per-iteration work.
    pub fixed: f64,
}

impl TimeBreakdown {
    pub fn total(&self) -> f64 {
        self.compute
            + self.host
            + self.bubble
            + self.tensor_parallel
            + self.expert_parallel
            + self.context_parallel
            + self.pipeline_p2p
            + self.data_parallel
            + self.optimizer
            + self.bpipe_transfer
            + self.offload
            + self.fixed
    }

    /// Named parts, largest first not implied: in a fixed order for tables.
    pub fn parts(&self) -> [(&'static str, f64); 12] {
        let values = self.values();
        std::array::from_fn(|i| (PARTS[i].0, values[i]))
    }

    /// The parts under their column names (`predict --runs` writes them as
    /// `predicted_<key>_ms`), in [`TimeBreakdown::parts`]'s order.
    pub fn keyed_parts(&self) -> [(&'static str, f64); 12] {
        let values = self.values();
        std::array::from_fn(|i| (PARTS[i].1, values[i]))
    }

    fn values(&self) -> [f64; 12] {
        [
            self.compute,
            self.host,
            self.bubble,
            self.tensor_parallel,
            self.expert_parallel,
            self.context_parallel,
            self.pipeline_p2p,
            self.data_parallel,
            self.optimizer,
            self.bpipe_transfer,
            self.offload,
            self.fixed,
        ]
    }
}

/// Each part of an iteration's time: how it is shown, and its key in
/// tables; in the order of [`TimeBreakdown::values`].
const PARTS: [(&str, &str); 12] = [
    ("compute", "compute"),
    ("host overhead", "host"),
    ("pipeline bubble", "bubble"),
    ("tensor-parallel comm", "tensor_parallel"),
    ("expert-parallel comm", "expert_parallel"),
    ("context-parallel comm", "context_parallel"),
    ("pipeline p2p", "pipeline_p2p"),
    ("data-parallel comm (exposed)", "data_parallel"),
    ("optimizer step", "optimizer"),
    ("BPipe transfer", "bpipe_transfer"),
    ("activation offload", "offload"),
    ("fixed per iteration", "fixed"),
];

/// The cost model's answer for one configuration.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub iteration_s: f64,
    pub time: TimeBreakdown,
    pub tokens_per_s: f64,
    /// Hardware FLOP/s per GPU in TFLOP/s, recomputation included (Megatron's convention).
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilisation: model FLOPs (no recomputation) over the peak
    /// of the precision the GEMMs run at (bf16, or FP8's under FP8).
    pub mfu: f64,
    /// Device memory of the peak stage: PyTorch's reserved peak plus what
    /// lives outside its allocator. `fits` is judged on it.
    pub peak_memory_bytes: f64,
    /// The pipeline stage with the highest memory.
    pub peak_stage: u64,
    /// That stage's peaks as PyTorch reports them (`max allocated`, `max
    /// reserved`).
    #[serde(default)]
    pub peak_allocated_bytes: f64,
    #[serde(default)]
    pub peak_reserved_bytes: f64,
    /// The first stage's, which torchtitan logs (from rank 0).
    #[serde(default)]
    pub first_stage_allocated_bytes: f64,
    #[serde(default)]
    pub first_stage_reserved_bytes: f64,
    /// The last stage's, which Megatron-LM logs (from its last rank).
    #[serde(default)]
    pub last_stage_allocated_bytes: f64,
    #[serde(default)]
    pub last_stage_reserved_bytes: f64,
    pub usable_memory_bytes: f64,
    pub fits: bool,
}

/// Which rank a measured peak was read on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryRank {
    /// Rank 0 (the first pipeline stage): torchtitan's step line.
    First,
    /// The last rank (the last pipeline stage): Megatron-LM's TensorBoard
    /// memory, its functional tests' golden values.
    Last,
    /// The largest over all ranks.
    Max,
}

crate::named_choices!(MemoryRank);

impl MemoryRank {
    pub const ALL: [MemoryRank; 3] = [MemoryRank::First, MemoryRank::Last, MemoryRank::Max];

    pub fn name(self) -> &'static str {
        match self {
            MemoryRank::First => "first",
            MemoryRank::Last => "last",
            MemoryRank::Max => "max",
        }
    }
}

impl Prediction {
    /// The predicted (allocated, reserved) peak on the rank a measurement
    /// was read on, bytes.
    pub fn peak_on(&self, rank: MemoryRank) -> (f64, f64) {
        match rank {
            MemoryRank::First => (
                self.first_stage_allocated_bytes,
                self.first_stage_reserved_bytes,
            ),
            MemoryRank::Last => (
                self.last_stage_allocated_bytes,
                self.last_stage_reserved_bytes,
            ),
            MemoryRank::Max => (self.peak_allocated_bytes, self.peak_reserved_bytes),
        }
    }
}

impl Prediction {
    pub fn peak_memory_gib(&self) -> f64 {
        self.peak_memory_bytes / GIB
    }

    /// The peak stage's fragmentation allowance (reserved over allocated),
    /// when it alone puts a configuration over the usable memory. The
    /// verdict stays "does not fit" (the allowance is the allocator's
    /// typical cache, `memory::fragmentation_coefficient`'s), but PyTorch frees cached
    /// blocks before it runs out and expandable segments avoid most of
    /// them, so such a configuration is worth a try where the margin
    /// matters.
    pub fn over_only_by_fragmentation(&self) -> Option<f64> {
        let allowance = self.peak_reserved_bytes - self.peak_allocated_bytes;
        (!self.fits && self.peak_memory_bytes - allowance <= self.usable_memory_bytes)
            .then_some(allowance)
    }
}

/// How one prediction used the scenario's profile: lookups of measured
/// times, and evaluations the profile did not cover (answered by the
/// formulas). All zero without a profile. Counted per evaluation: a layer
/// time or a collective evaluated once and multiplied counts once. A
/// measured layer's tensor-parallel collectives are still looked up (and
/// counted), to split its measured time in the breakdown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileUsage {
    /// Collectives timed from a measured curve.
    pub collective_lookups: u64,
    /// Of those, sizes outside the curve's measured range.
    pub collective_extrapolated: u64,
    /// Of those, all-gathers and reduce-scatters timed from the all-reduce curve.
    pub collective_derived: u64,
    /// Collectives without a curve (other ranks, or spanning nodes).
    pub collective_modelled: u64,
    /// Layers timed from measurements.
    pub layer_lookups: u64,
    /// Of those, micro-batches outside the measured ones.
    pub layer_extrapolated: u64,
    /// Layers whose shape was not measured.
    pub layer_modelled: u64,
    /// Sparse embedding syncs timed from `profile sync`'s points.
    #[serde(default)]
    pub sync_lookups: u64,
}

impl std::fmt::Display for ProfileUsage {
    /// What the predictions took from the profile, in one line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = |x: u64| crate::units::thousands(x as f64);
        write!(
            f,
            "{} collective lookups ({} extrapolated beyond the measured sizes",
            n(self.collective_lookups),
            n(self.collective_extrapolated)
        )?;
        if self.collective_derived > 0 {
            write!(
                f,
                ", {} derived from all-reduce",
                n(self.collective_derived)
            )?;
        }
        write!(
            f,
            "); {} layer lookups ({} extrapolated beyond the measured micro-batches)",
            n(self.layer_lookups),
            n(self.layer_extrapolated)
        )?;
        if self.collective_modelled + self.layer_modelled > 0 {
            write!(
                f,
                "; not measured, from the formulas: collectives {}, layer times {}",
                n(self.collective_modelled),
                n(self.layer_modelled)
            )?;
        }
        Ok(())
    }
}

impl ProfileUsage {
    pub fn add(&mut self, other: &ProfileUsage) {
        self.collective_lookups += other.collective_lookups;
        self.collective_extrapolated += other.collective_extrapolated;
        self.collective_derived += other.collective_derived;
        self.collective_modelled += other.collective_modelled;
        self.layer_lookups += other.layer_lookups;
        self.layer_extrapolated += other.layer_extrapolated;
        self.layer_modelled += other.layer_modelled;
        self.sync_lookups += other.sync_lookups;
    }
}

/// Per-micro-batch time of one stage, by kind of work (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StageTime {
    /// Layers' forward, backward and recomputation, and the embedding or
    /// output head where the stage has them.
    pub compute: f64,
    pub host: f64,
    /// Tensor-parallel collectives not hidden.
    pub tensor_parallel: f64,
    /// Expert- and context-parallel exchanges not hidden.
    #[serde(default)]
    pub expert_parallel: f64,
    #[serde(default)]
    pub context_parallel: f64,
    pub p2p: f64,
    /// BPipe's transfers not hidden behind the stage's compute.
    pub bpipe: f64,
    /// Activation offloading's copies not hidden behind it.
    #[serde(default)]
    pub offload: f64,
    /// ZeRO-3's per-micro-batch gathers and reduce-scatters not hidden.
    #[serde(default)]
    pub data_parallel: f64,
}

impl StageTime {
    pub fn total(&self) -> f64 {
        self.compute
            + self.host
            + self.tensor_parallel
            + self.expert_parallel
            + self.context_parallel
            + self.p2p
            + self.bpipe
            + self.offload
            + self.data_parallel
    }
}

/// What an overlapped transfer of `transfer` seconds leaves exposed beside
/// `window` seconds of concurrent compute it may hide under at `efficiency`
/// (the fraction of the window the streams can share), never less than
/// `floor` (the part that has nothing to hide under). Returns (exposed,
/// hidden); the hidden part still costs `overlap_sm_cost` of itself in
/// compute (the SMs its kernels take), which callers add.
pub fn overlapped(transfer: f64, window: f64, efficiency: f64, floor: f64) -> (f64, f64) {
    if transfer <= 0.0 {
        return (0.0, 0.0);
    }
    let exposed = (transfer - efficiency * window.max(0.0))
        .max(floor.min(transfer))
        .max(0.0);
    (exposed, transfer - exposed)
}

/// Megatron-LM pads the vocabulary to a multiple of this times tp
/// (`--make-vocab-size-divisible-by`, default 128), so that every
/// tensor-parallel shard of the embedding and the head is tile-aligned.
const MEGATRON_VOCAB_MULTIPLE: u64 = 128;

/// Rows of the embedding and columns of the output head one
/// tensor-parallel rank holds: the vocabulary, padded as Megatron-LM pads it
/// (torchtitan takes it as given), split over tp.
pub fn vocab_per_rank(s: &Scenario, c: &ParallelConfig) -> f64 {
    let vocab = match c.engine {
        crate::config::Engine::Megatron => {
            let multiple = MEGATRON_VOCAB_MULTIPLE * c.tp;
            s.model.vocab.div_ceil(multiple) * multiple
        }
        crate::config::Engine::Torchtitan => s.model.vocab,
    };
    vocab as f64 / c.tp as f64
}

/// Dense and MoE layers of pipeline stage `stage`: its model chunks are
/// chunks `stage`, `stage + pp`, ... of the model in layer order
/// (Megatron-LM's interleaving, [`crate::config::ChunkLayout`]), each a
/// `1 / v` share of the stage's layers. Counted without allocating; a loop
/// over chunks only for MoE models.
pub fn stage_layer_kinds(s: &Scenario, c: &ParallelConfig, stage: u64) -> (u64, u64) {
    stage_layer_kinds_in(s, c, None, stage)
}

/// [`stage_layer_kinds`], given the configuration's chunk layout where the
/// caller works it out once for every stage.
pub(crate) fn stage_layer_kinds_in(
    s: &Scenario,
    c: &ParallelConfig,
    layout: Option<&ChunkLayout>,
    stage: u64,
) -> (u64, u64) {
    let (dense, moe) = model_layer_kinds(s, c, layout, stage);
    // The multi-token prediction modules' layers follow the model's last
    // layer on the last stage (Megatron-LM's MTP block), of its kind.
    match s.model.mtp_layers {
        0 => (dense, moe),
        _ if stage != c.pp - 1 => (dense, moe),
        mtp if s.model.mtp_is_moe() => (dense, moe + mtp),
        mtp => (dense + mtp, moe),
    }
}

/// [`stage_layer_kinds`] of the model's own layers.
fn model_layer_kinds(
    s: &Scenario,
    c: &ParallelConfig,
    layout: Option<&ChunkLayout>,
    stage: u64,
) -> (u64, u64) {
    let Some(moe) = s.model.moe else {
        return (c.stage_layers(s.model.layers, stage), 0);
    };
    // Every layer after the dense ones an MoE layer, and the dense ones all
    // within the first stage's first chunk (DeepSeek-V3's three, Qwen3's
    // and gpt-oss's none): no chunk to look at.
    if moe.layer_freq <= 1 {
        let first = c.stage_layers(s.model.layers, 0);
        if moe.dense_layers * c.virtual_stages.max(1) <= first {
            let layers = c.stage_layers(s.model.layers, stage);
            let dense = if stage == 0 { moe.dense_layers } else { 0 };
            return (dense, layers - dense);
        }
    }
    // The layout holds the stage's layers too ([`ChunkLayout::stage_layers`]
    // is `c.stage_layers`): read there, not worked out again (the search
    // asks for every stage of every configuration, and the divisions
    // showed).
    let (layers, layout) = match layout {
        Some(given) => (c.stage_layers(s.model.layers, stage), *given),
        None => {
            let own = c.chunk_layout(s.model.layers);
            (own.stage_layers(stage), own)
        }
    };
    let moe_layers: u64 = (0..c.virtual_stages.max(1))
        .map(|j| {
            let chunk = layout.chunk(stage, j);
            moe.moe_layers_in(chunk.start, chunk.end)
        })
        .sum();
    let moe_layers = moe_layers.min(layers);
    (layers - moe_layers, moe_layers)
}

/// Per-micro-batch GPU time of the work only the first stage (embedding)
/// and only the last stage (output head, loss) do.
pub fn pipeline_ends(s: &Scenario, c: &ParallelConfig) -> layer::EndsTime {
    layer::pipeline_ends_time(s, c)
}

/// The per-micro-batch time of every pipeline stage (for explanations and
/// trial runs; `predict` computes the same without allocating).
pub fn stage_times(s: &Scenario, c: &ParallelConfig) -> Vec<StageTime> {
    let mut usage = ProfileUsage::default();
    let layer = layer::LayerTimes::of(s, c, &mut usage);
    let ends = layer::pipeline_ends_time(s, c);
    let p2p = comm::pipeline_p2p_per_microbatch(s, c, &mut usage);
    let parts = SyncParts::of(s, c, &mut usage);
    (0..c.pp)
        .map(|i| stage_time(s, c, &layer, &parts, &ends, p2p, i))
        .collect()
}

fn stage_time(
    s: &Scenario,
    c: &ParallelConfig,
    times: &layer::LayerTimes,
    parts: &SyncParts,
    ends: &layer::EndsTime,
    p2p: f64,
    i: u64,
) -> StageTime {
    let p = c.pp;
    let k = s.coef();
    let layers = c.stage_layers(s.model.layers, i) as f64;
    let work = times.stage(s, c, i);
    let mut t = StageTime {
        compute: work.gpu_compute,
        host: work.host_excess + k.microbatch_overhead_ms * 1e-3,
        tensor_parallel: work.tensor_parallel,
        expert_parallel: work.expert_parallel,
        context_parallel: work.context_parallel,
        p2p: if p > 1 { p2p } else { 0.0 },
        bpipe: 0.0,
        offload: offload_exposed(s, c, &work),
        data_parallel: 0.0,
    };
    if i == 0 {
        t.compute += ends.first;
    }
    if i == p - 1 {
        t.compute += ends.last;
    }
    let window = work.forward + work.backward;
    if c.ep_comm_overlap {
        let (exposed, hidden) = ep_overlapped(s, c, i, work.expert_parallel, window);
        t.expert_parallel = exposed;
        t.compute += k.overlap_sm_cost * hidden;
    }
    if c.bpipe {
        let transfer = comm::bpipe_transfer_per_microbatch(s, c, i);
        let (exposed, hidden) = overlapped(transfer, window, k.bpipe_overlap, 0.0);
        t.bpipe = exposed;
        t.compute += k.overlap_sm_cost * hidden;
    }
    if comm::syncs_per_microbatch(c) {
        let (gathers, unhidden) = match parts.kept(i) {
            Some(kept) => kept.zero3,
            None => {
                let groups = memory::parameter_groups(s, c, i);
                comm::zero3_per_microbatch(s, c, &groups, layers, &mut ProfileUsage::default())
            }
        };
        let (exposed, hidden) = overlapped(gathers, window, k.zero3_prefetch_overlap, unhidden);
        t.data_parallel = exposed;
        t.compute += k.overlap_sm_cost * hidden;
    }
    t
}

/// Per micro-batch, what activation offloading's copies leave exposed:
/// the offloaded layers' saved activations go to host memory during the
/// forward pass and come back during the backward, on copy engines beside
/// the compute (Transformer Engine's CPU offload), so each direction shows
/// only where it outlasts its pass.
fn offload_exposed(s: &Scenario, c: &ParallelConfig, work: &layer::LayerTime) -> f64 {
    let bytes = memory::offloaded_activation_bytes(s, c);
    if bytes <= 0.0 {
        return 0.0;
    }
    let copy = bytes / host_copy_bandwidth(s);
    let (to_host, _) = overlapped(copy, work.forward, 1.0, 0.0);
    let (back, _) = overlapped(copy, work.backward, 1.0, 0.0);
    to_host + back
}

/// The GPU-to-host bandwidth activation offloading reaches, per direction.
/// A GPU without a known host link (a cluster file without
/// `host_link_bw`) is taken to sit on PCIe Gen5 x16; the CLI refuses to
/// offload on one.
fn host_copy_bandwidth(s: &Scenario) -> f64 {
    const PCIE_GEN5_X16: f64 = 64e9;
    s.gpu.host_link_bandwidth.unwrap_or(PCIE_GEN5_X16) * s.coef().host_copy_efficiency
}

/// A stage's expert-parallel dispatch and combine per micro-batch under
/// Megatron-Core's batch-level overlap: each micro-batch's hide under the
/// compute of the one paired with it, bounded as the other overlaps are,
/// except in the warm-up and cool-down passes, which run alone. Returns
/// the exposed and the hidden time, per micro-batch on average.
fn ep_overlapped(
    s: &Scenario,
    c: &ParallelConfig,
    stage: u64,
    transfer: f64,
    window: f64,
) -> (f64, f64) {
    let m = c.micro_batches(s.global_batch);
    let v = c.virtual_stages.max(1) as f64;
    let chunks = m as f64 * v;
    let alone = memory::schedule_in_flight(c, m, stage) * v;
    let paired = ((chunks - alone) / chunks).clamp(0.0, 1.0);
    let (_, hidden) = overlapped(transfer, window, s.coef().ep_overlap, 0.0);
    (transfer - paired * hidden, paired * hidden)
}

/// Predicts one configuration. The configuration must have passed
/// [`ParallelConfig::check`]; the search and the CLI check it first.
pub fn predict(s: &Scenario, c: &ParallelConfig) -> Prediction {
    predict_with_usage(s, c).0
}

/// [`predict`], also saying how the prediction used the scenario's profile.
/// As pure and allocation-free as `predict`: the counts are a local tally.
pub fn predict_with_usage(s: &Scenario, c: &ParallelConfig) -> (Prediction, ProfileUsage) {
    predict_with(s, c, None)
}

/// [`predict`] of a configuration whose [`peak_memory`] is already known
/// (the search checked it before timing it).
pub fn predict_checked(s: &Scenario, c: &ParallelConfig, memory: &MemoryCheck) -> Prediction {
    predict_with(s, c, Some(*memory)).0
}

/// `c` with the switches its layers' times do not read cleared (how data
/// parallelism shards, overlaps and groups, BPipe and its stage order, the
/// embedding's sync, the batch-level EP overlap, FP8 weights, the
/// gradients' dtype, activation offloading): two configurations with the same key have the same
/// [`layer_times`], so a search may work them out once for both.
pub fn layer_key(c: &ParallelConfig) -> ParallelConfig {
    let plain = ParallelConfig::default();
    ParallelConfig {
        optimizer_sharding: plain.optimizer_sharding,
        dp_shard: plain.dp_shard,
        overlap_grad_reduce: plain.overlap_grad_reduce,
        overlap_param_gather: plain.overlap_param_gather,
        bpipe: plain.bpipe,
        stage_order: plain.stage_order,
        embedding_sync: plain.embedding_sync,
        ep_comm_overlap: plain.ep_comm_overlap,
        fp8_param_gather: plain.fp8_param_gather,
        expandable_segments: plain.expandable_segments,
        grad_reduce: plain.grad_reduce,
        cpu_offload_layers: plain.cpu_offload_layers,
        ..*c
    }
}

/// The times of `c`'s dense and MoE layers and each stage's sum of them,
/// where every prediction starts.
pub fn layer_times(s: &Scenario, c: &ParallelConfig) -> LayerTimes {
    LayerTimes::of(s, c, &mut ProfileUsage::default())
}

/// The parts of `c`'s data-parallel synchronisation that no layer time
/// moves, which a search keeps for the configurations that share a
/// [`sync_key`].
pub fn sync_parts(s: &Scenario, c: &ParallelConfig) -> SyncParts {
    SyncParts::of(s, c, &mut ProfileUsage::default())
}

/// [`predict_checked`] from the configuration's [`layer_times`] and
/// [`sync_parts`], which a search keeps for the configurations that share a
/// [`layer_key`] and a [`sync_key`].
pub fn predict_checked_from(
    s: &Scenario,
    c: &ParallelConfig,
    memory: &MemoryCheck,
    layer: &LayerTimes,
    sync: &SyncParts,
) -> Prediction {
    predict_from(s, c, Some(*memory), layer, sync, ProfileUsage::default()).0
}

fn predict_with(
    s: &Scenario,
    c: &ParallelConfig,
    memory: Option<MemoryCheck>,
) -> (Prediction, ProfileUsage) {
    let mut usage = ProfileUsage::default();
    let layer = LayerTimes::of(s, c, &mut usage);
    let sync = SyncParts::of(s, c, &mut usage);
    predict_from(s, c, memory, &layer, &sync, usage)
}

/// [`predict_with`] from the layer times and the sync's parts, with the
/// profile's use so far.
fn predict_from(
    s: &Scenario,
    c: &ParallelConfig,
    memory: Option<MemoryCheck>,
    layer: &LayerTimes,
    parts: &SyncParts,
    mut usage: ProfileUsage,
) -> (Prediction, ProfileUsage) {
    let m = c.micro_batches(s.global_batch) as f64;
    let v = c.virtual_stages as f64;
    let p = c.pp;
    let ends = layer::pipeline_ends_time(s, c);
    let p2p = comm::pipeline_p2p_per_microbatch(s, c, &mut usage);

    // Per-micro-batch time of every stage; the slowest sets the pace and the
    // sum sets the fill/drain (generalises (m + p - 1) t to unequal stages).
    let stage_time = |i: u64| stage_time(s, c, layer, parts, &ends, p2p, i);
    let first = stage_time(0);
    let mut slowest = first;
    let mut sum = 0.0;
    // A middle stage's time depends on its place only through BPipe's
    // pairs and the batch-level EP overlap's warm-up; otherwise middle
    // stages of the same layer kinds take the same time: worked out once.
    let by_kinds = !c.bpipe && !c.ep_comm_overlap;
    let mut last_middle: Option<((u64, u64), StageTime)> = None;
    for i in 0..p {
        let t = if i == 0 {
            first
        } else if by_kinds && i + 1 < p {
            let kinds = layer.stage_kinds(s, c, i);
            match last_middle {
                Some((seen, t)) if seen == kinds => t,
                _ => {
                    let t = stage_time(i);
                    last_middle = Some((kinds, t));
                    t
                }
            }
        } else {
            stage_time(i)
        };
        sum += t.total();
        if t.total() > slowest.total() {
            slowest = t;
        }
    }
    let bubble = (sum - slowest.total()) / v;

    let sync = data_parallel_and_optimizer(s, c, layer, parts, &mut usage);
    let mut time = TimeBreakdown {
        compute: m * slowest.compute + sync.deferred_wgrad,
        host: m * slowest.host,
        bubble,
        tensor_parallel: m * slowest.tensor_parallel,
        expert_parallel: m * slowest.expert_parallel,
        context_parallel: m * slowest.context_parallel,
        pipeline_p2p: m * slowest.p2p,
        data_parallel: m * slowest.data_parallel + sync.exposed_comm,
        optimizer: sync.optimizer,
        bpipe_transfer: m * slowest.bpipe,
        offload: m * slowest.offload,
        fixed: s.coef().iteration_overhead_ms * 1e-3,
    };
    // Overlap hides transfers behind compute, never behind each other: the
    // iteration takes at least as long as its busiest link is busy.
    let links = link_busy(s, c, layer, m, p2p, &sync);
    let busiest = links.intra.max(links.inter);
    if busiest > time.total() {
        time.data_parallel += busiest - time.total();
    }
    let iteration_s = time.total();

    let memory = memory.unwrap_or_else(|| peak_memory(s, c));
    let gpus = c.gpus() as f64;
    let model_flops = s.model.model_flops_per_iteration(s.global_batch);
    let prediction = Prediction {
        iteration_s,
        time,
        tokens_per_s: (s.global_batch * s.model.seq_len) as f64 / iteration_s,
        tflops_per_gpu: hardware_flops_of(s, c, model_flops) / iteration_s / gpus / 1e12,
        mfu: model_flops / iteration_s / gpus / gemm_peak(s, c),
        peak_memory_bytes: memory.bytes,
        peak_stage: memory.stage,
        peak_allocated_bytes: memory.allocated,
        peak_reserved_bytes: memory.reserved,
        first_stage_allocated_bytes: memory.first.0,
        first_stage_reserved_bytes: memory.first.1,
        last_stage_allocated_bytes: memory.last.0,
        last_stage_reserved_bytes: memory.last.1,
        usable_memory_bytes: memory.usable,
        fits: memory.fits,
    };
    (prediction, usage)
}

/// The dense tensor-core peak the configuration's GEMMs run at: FP8's
/// under FP8 and FP4's under NVFP4 on a GPU that has them, else the 16-bit
/// one.
fn gemm_peak(s: &Scenario, c: &ParallelConfig) -> f64 {
    use crate::config::Precision;
    match (c.precision, s.gpu.fp8_peak_flops, s.gpu.fp4_peak_flops) {
        (Precision::Fp8, Some(fp8), _) => fp8,
        (Precision::Nvfp4, _, Some(fp4)) => fp4,
        _ => s.gpu.peak_flops,
    }
}

/// The time the busiest link of a GPU is busy in one iteration, hidden or
/// not: a floor under the iteration time (overlap hides transfers behind
/// compute, not behind each other).
pub fn busiest_link_seconds(s: &Scenario, c: &ParallelConfig) -> f64 {
    let mut usage = ProfileUsage::default();
    let m = c.micro_batches(s.global_batch) as f64;
    let layer = layer::LayerTimes::of(s, c, &mut usage);
    let p2p = comm::pipeline_p2p_per_microbatch(s, c, &mut usage);
    let parts = SyncParts::of(s, c, &mut usage);
    let sync = data_parallel_and_optimizer(s, c, &layer, &parts, &mut usage);
    let links = link_busy(s, c, &layer, m, p2p, &sync);
    links.intra.max(links.inter)
}

/// Seconds per iteration each kind of link of a GPU is busy, hidden or not.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinkBusy {
    pub intra: f64,
    pub inter: f64,
}

impl LinkBusy {
    fn add(&mut self, link: comm::Link, seconds: f64) {
        match link {
            comm::Link::IntraNode => self.intra += seconds,
            comm::Link::InterNode => self.inter += seconds,
        }
    }
}

/// How long each link is busy in one iteration on the busiest stage: every
/// tensor-parallel collective, pipeline send, BPipe transfer and
/// data-parallel collective, on the link its group uses.
fn link_busy(
    s: &Scenario,
    c: &ParallelConfig,
    times: &layer::LayerTimes,
    m: f64,
    p2p: f64,
    sync: &SyncTime,
) -> LinkBusy {
    let mut busy = LinkBusy::default();
    // The stage whose layers keep their links busiest (the most layers,
    // or the most MoE layers).
    let mut work = times.stage(s, c, 0);
    for i in 1..c.pp {
        let w = times.stage(s, c, i);
        if w.tp_link + w.ep_link + w.etp_link + w.cp_link
            > work.tp_link + work.ep_link + work.etp_link + work.cp_link
        {
            work = w;
        }
    }
    let tp_link = comm::Link::of(comm::tensor_parallel_span(s, c));
    busy.add(tp_link, m * work.tp_link);
    busy.add(
        comm::Link::of(comm::expert_parallel_span(s, c)),
        m * work.ep_link,
    );
    busy.add(
        comm::Link::of(comm::expert_tensor_span(s, c)),
        m * work.etp_link,
    );
    busy.add(
        comm::Link::of(comm::context_parallel_span(s, c)),
        m * work.cp_link,
    );
    busy.add(comm::pipeline_link(s, c), m * p2p);
    busy.add(
        comm::Link::of(comm::shard_group_span(s, c)),
        sync.link_seconds,
    );
    busy.add(
        comm::Link::of(comm::replica_span(s, c)),
        sync.replica_link_seconds,
    );
    if c.bpipe {
        for i in 0..c.pp / 2 {
            busy.add(
                comm::bpipe_link(s, c, i),
                m * comm::bpipe_transfer_per_microbatch(s, c, i),
            );
        }
    }
    busy
}

/// The memory verdict alone, cheaper than a whole prediction: the search
/// drops what does not fit before timing it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryCheck {
    pub stage: u64,
    /// Device memory the peak stage needs (reserved plus what lives
    /// outside PyTorch); fits are judged on it.
    pub bytes: f64,
    /// PyTorch's allocated and reserved peaks of the stage whose allocator
    /// holds the most: the peak stage's, unless a flex dispatcher's buffers
    /// (outside the allocator, on MoE stages only) make another the peak.
    pub allocated: f64,
    pub reserved: f64,
    pub usable: f64,
    pub fits: bool,
    /// The first and the last stage's allocated and reserved peaks.
    pub first: (f64, f64),
    pub last: (f64, f64),
}

/// `c` with the switches that move no byte of memory cleared (the
/// data-parallel overlaps and where BPipe's stages sit): two configurations
/// with the same key have the same [`peak_memory`], so a search may check
/// one for both.
pub fn memory_key(c: &ParallelConfig) -> ParallelConfig {
    ParallelConfig {
        overlap_grad_reduce: false,
        overlap_param_gather: false,
        stage_order: crate::config::StageOrder::Megatron,
        ..*c
    }
}

pub fn peak_memory(s: &Scenario, c: &ParallelConfig) -> MemoryCheck {
    memory_check(s, memory::peak_first_last(s, c))
}

/// [`peak_memory`] when it fits; none, sooner, when it does not (the
/// stages after the first that does not fit are not computed).
pub fn peak_memory_if_fits(s: &Scenario, c: &ParallelConfig) -> Option<MemoryCheck> {
    let peaks = memory::peak_first_last_within(s, c, s.usable_memory())?;
    Some(memory_check(s, peaks))
}

fn memory_check(s: &Scenario, peaks: memory::StagePeaks) -> MemoryCheck {
    let usable = s.usable_memory();
    let (peak, held) = (peaks.device, peaks.allocator);
    MemoryCheck {
        stage: peak.stage,
        bytes: peak.total(),
        allocated: held.allocated(),
        reserved: held.reserved(),
        usable,
        fits: peak.total() <= usable,
        first: (peaks.first.allocated(), peaks.first.reserved()),
        last: (peaks.last.allocated(), peaks.last.reserved()),
    }
}

/// One parameter group's data-parallel sync at the end of an iteration,
/// for explanations.
#[derive(Debug, Clone, Serialize)]
pub struct GroupSync {
    pub group: &'static str,
    pub method: SyncMethod,
    /// Parameters on one GPU.
    pub params: f64,
    pub ranks: u64,
    /// The collectives' whole time, before any overlap.
    pub seconds: f64,
}

/// The data-parallel sync of each parameter group of stage `stage` that
/// has parameters, as the end of an iteration runs it; empty when the
/// collectives run per micro-batch (FSDP / ZeRO-3) or nothing syncs.
pub fn group_syncs(s: &Scenario, c: &ParallelConfig, stage: u64) -> Vec<GroupSync> {
    if comm::syncs_per_microbatch(c) || c.dense_sync_degree() < 2 {
        return Vec::new();
    }
    let mut usage = ProfileUsage::default();
    memory::parameter_groups(s, c, stage)
        .iter()
        .zip(memory::GROUP_NAMES)
        .filter(|(g, _)| g.params > 0.0 && g.ranks > 1)
        .map(|(g, name)| {
            let seconds = if g.sync.is_sparse() {
                sparse::sparse_sync(s, c, g, g.sync, &mut usage).seconds
            } else {
                let (grads, gather) = comm::dense_group_sync(s, c, g, &mut usage);
                grads + gather
            };
            GroupSync {
                group: name,
                method: g.sync,
                params: g.params,
                ranks: g.ranks,
                seconds,
            }
        })
        .collect()
}

/// Memory of every pipeline stage, for explanations.
pub fn memory_per_stage(s: &Scenario, c: &ParallelConfig) -> Vec<StageMemory> {
    (0..c.pp).map(|i| memory::stage_memory(s, c, i)).collect()
}

/// Time of an all-reduce of `bytes` per rank over `ranks` GPUs of one node
/// of `group`: the collective model alone, for fitting its coefficients to
/// nccl-tests measurements.
pub fn intra_node_all_reduce(group: &NodeGroup, cost: &CostModel, ranks: u64, bytes: f64) -> f64 {
    // Collectives read only the coefficients, the GPU and the links; the
    // scenario's model is a placeholder.
    let placeholder = ModelSpec::gpt("collective", 64, 1, 1, 64, 64);
    let scenario = Scenario::new(&placeholder, 1, group, ranks, cost);
    comm::all_reduce_intra(&scenario, ranks, bytes, &mut ProfileUsage::default())
}

/// FLOPs the GPUs execute in one iteration: model FLOPs plus recomputation.
pub fn hardware_flops(s: &Scenario, c: &ParallelConfig) -> f64 {
    hardware_flops_of(s, c, s.model.model_flops_per_iteration(s.global_batch))
}

/// [`hardware_flops`] given the model FLOPs of an iteration (a prediction
/// has them at hand).
fn hardware_flops_of(s: &Scenario, c: &ParallelConfig, model_flops: f64) -> f64 {
    let tokens = (s.global_batch * s.model.seq_len) as f64;
    model_flops + tokens * c.recomputed_flops_per_token(s.model)
}

struct SyncTime {
    /// Data-parallel collectives at the iteration's ends not hidden, on the
    /// stage whose tail is longest.
    exposed_comm: f64,
    optimizer: f64,
    /// The deferred output-head weight gradients that outlast the last
    /// stage's slack, when its tail is the longest.
    deferred_wgrad: f64,
    /// All data-parallel traffic of that stage per iteration within its
    /// shard group, hidden or not (ZeRO-3's per-micro-batch collectives
    /// included).
    link_seconds: f64,
    /// Hybrid sharding's all-reduces over the replicas, on their own link.
    replica_link_seconds: f64,
}

/// Data-parallel synchronisation and the optimizer step at the end of an
/// iteration, for the stage whose tail is longest. Stage `i` finishes its
/// last backward pass earlier than stage 0, by the backward passes of the
/// stages before it, and its tail runs in that time; with
/// `--overlap-grad-reduce` the first stage also reduces its gradients in
/// buckets under its last backward pass (Megatron-LM buckets on the first
/// stage only), and with `--overlap-param-gather` the updated weights are
/// gathered under the next iteration's first forward passes.
fn data_parallel_and_optimizer(
    s: &Scenario,
    c: &ParallelConfig,
    times: &layer::LayerTimes,
    parts: &SyncParts,
    usage: &mut ProfileUsage,
) -> SyncTime {
    let k = s.coef();
    let v = c.virtual_stages as f64;
    let tp_link = comm::Link::of(comm::tensor_parallel_span(s, c));
    // The share of a layer's tensor-parallel traffic in its backward pass
    // (with full recomputation the recomputed forward's too).
    let tp_backward_share = if c.recompute == Recompute::Full {
        2.0 / 3.0
    } else {
        0.5
    };
    let mut worst = SyncTime {
        exposed_comm: 0.0,
        optimizer: 0.0,
        deferred_wgrad: 0.0,
        link_seconds: 0.0,
        replica_link_seconds: 0.0,
    };
    let mut worst_tail = f64::NEG_INFINITY;
    let mut gather_ahead = 0.0_f64;
    let m = c.micro_batches(s.global_batch) as f64;
    // Forward and backward time of all stages' layers, once needed.
    let mut total: Option<(f64, f64)> = None;
    parts.each(s, c, usage, |part| {
        let (stage, groups, sync) = (part.stage, &part.groups, &part.sync);
        let work = times.stage(s, c, stage);
        // The layers of the stages before this one, forward and backward.
        // Summed from the nearer end: the candidates sit at the ends.
        let sum = |range: std::ops::Range<u64>| {
            range
                .map(|j| times.stage(s, c, j))
                .fold((0.0, 0.0), |(f, b), w: layer::LayerTime| {
                    (f + w.forward, b + w.backward)
                })
        };
        let (before_forward, before_backward) = if stage <= c.pp / 2 {
            sum(0..stage)
        } else {
            let (all_f, all_b) = *total.get_or_insert_with(|| sum(0..c.pp));
            let (after_f, after_b) = sum(stage..c.pp);
            (all_f - after_f, all_b - after_b)
        };
        let same_link = sync.link == tp_link;
        // Gradients: bucketed under the last backward on the first stage.
        let grads = if c.overlap_grad_reduce && stage == 0 {
            let busy = if same_link {
                work.tp_link * tp_backward_share
            } else {
                0.0
            };
            let window = work.backward - busy;
            // The input embedding is used first, so its gradient comes
            // last; Megatron-LM gives a parameter above the bucket size a
            // bucket of its own, and no backward is left to hide it.
            let dense: f64 = groups
                .iter()
                .filter(|g| !g.sync.is_sparse())
                .map(|g| g.params)
                .sum();
            let table = if c.embedding_sync.is_sparse() && !s.model.tied_embeddings {
                0.0
            } else {
                vocab_per_rank(s, c) * s.model.hidden as f64
            };
            let last_bucket = sync
                .grads_last_bucket
                .max(sync.grads * (table / dense.max(1.0)).min(1.0));
            let (exposed, hidden) = overlapped(sync.grads, window, k.dp_overlap, last_bucket);
            exposed + k.overlap_sm_cost * hidden
        } else {
            sync.grads
        };
        // Weights: after the optimizer step, or under the next forwards.
        let gather = if c.overlap_param_gather {
            let busy = if same_link {
                work.tp_link * (1.0 - tp_backward_share)
            } else {
                0.0
            };
            let window = work.forward - busy + before_forward / v;
            let (exposed, hidden) =
                overlapped(sync.gather, window, k.dp_overlap, sync.gather_first_bucket);
            gather_ahead = gather_ahead.max(exposed + k.overlap_sm_cost * hidden);
            0.0
        } else {
            sync.gather
        };
        let sparse = sync.sparse_seconds();
        let comm = grads + gather + sparse + part.embedding;
        let optimizer = part.optimizer;
        // Stage `stage` ended its schedule this much before stage 0.
        let slack = before_backward / v;
        // The last stage computes its deferred weight gradients first.
        let deferred = if stage + 1 == c.pp {
            layer::deferred_wgrad_time(s, c)
        } else {
            0.0
        };
        let tail = deferred + comm + optimizer - slack;
        let (zero3, _) = part.zero3;
        let replica = m * part.replica_per_microbatch;
        let link_seconds = sync.grads + sync.gather + sparse + m * zero3 - replica;
        if link_seconds > worst.link_seconds {
            worst.link_seconds = link_seconds;
            worst.replica_link_seconds = replica;
        }
        if tail > worst_tail {
            worst_tail = tail;
            let exposed = tail.max(0.0);
            let optimizer = optimizer.min(exposed);
            let deferred = deferred.min(exposed - optimizer);
            worst.optimizer = optimizer;
            worst.deferred_wgrad = deferred;
            worst.exposed_comm = exposed - optimizer - deferred;
        }
    });
    worst.exposed_comm += gather_ahead;
    worst
}

/// The schedule's in-flight micro-batch count matters for memory; its time
/// effect is the bubble computed in [`predict`]. GPipe and 1F1B share it.
pub fn schedule_bubble_fraction(c: &ParallelConfig, global_batch: u64) -> f64 {
    let m = c.micro_batches(global_batch) as f64;
    let p = c.pp as f64;
    match c.schedule {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB => (p - 1.0) / m,
        ScheduleKind::Interleaved => (p - 1.0) / (m * c.virtual_stages as f64),
    }
}

#[cfg(test)]
mod tests;
