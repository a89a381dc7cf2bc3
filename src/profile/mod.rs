//! Measured profiles: collective curves (nccl-tests) and layer times, stored
//! as tables in a profile directory, and the in-memory lookup the cost model
//! reads them through.
//!
//! A profile directory `DIR` holds
//! - `DIR/environment.toml`: where and when the measurements were taken, the
//!   GPU, attribution notes and the commands that produced the directory;
//! - `DIR/collectives.parquet` and `DIR/collectives.csv`: one row per
//!   measured collective (op, ranks, bytes, seconds, bus bandwidth);
//! - `DIR/layers.parquet` and `DIR/layers.csv`: one row per measured layer
//!   (shape, micro-batch, tensor parallelism, switches, forward / backward /
//!   recomputation seconds).
//!
//! Both table formats are written; Parquet is read when present, CSV
//! otherwise. Reading and writing the tables is [`store`]'s job (the only
//! code that knows about polars); the importers in [`import`] turn
//! nccl-tests logs and published tables into points; [`Measurements`] is the
//! pure, allocation-free lookup the cost model uses.

mod cluster;
mod describe;
mod import;
mod lookup;
mod records;
mod store;
mod sweep;
pub mod tokens;

pub use cluster::{MeasuredNodeShape, measured_link, measured_node};
pub use describe::describe;
pub use import::{
    NcclLog, merge_collectives, merge_layers, merge_syncs, merge_tokens, parse_korthikanti_layers,
    parse_nccl_tests, parse_reference_collectives, read_text,
};
pub use lookup::{CollectiveLookup, LayerLookup, LayerShape, Measurements};
pub use records::{
    AttentionPoint, CopyPoint, Device, DeviceFacts, Dtype, LayerMeasurement, MEASURED_RECOMPUTE,
    MatmulPoint,
};
pub use store::{read_profile, write_profile};
pub use sweep::{SweepPoint, is_measured, layer_points, sweep_points};

use crate::config::Recompute;
use crate::model::{AttentionKind, ModelSpec};
use serde::{Deserialize, Serialize};
use std::fmt;

/// File names inside a profile directory.
pub const ENVIRONMENT_FILE: &str = "environment.toml";
pub const COLLECTIVES_TABLE: &str = "collectives";
pub const LAYERS_TABLE: &str = "layers";
pub const DEVICE_FILE: &str = "device.toml";

/// Where, on what and by what the measurements of a profile were taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Environment {
    /// The GPU measured (a catalogue name where one fits, e.g. `a100-80gb`).
    pub gpu: String,
    /// Where the measurements come from (a tool, a paper, a data set).
    #[serde(default)]
    pub source: String,
    /// Date of the last change, UTC, `YYYY-MM-DD`.
    #[serde(default)]
    pub date: String,
    /// paratune version that last wrote the directory.
    #[serde(default)]
    pub paratune_version: String,
    /// Free-form notes: attribution, licences, caveats.
    #[serde(default)]
    pub notes: Vec<String>,
    /// The commands that produced the directory, in order.
    #[serde(default)]
    pub commands: Vec<String>,
    /// SHA-256 of every file paratune wrote beside it, checked on reading:
    /// a table changed or damaged since is refused, not misread.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub checksums: std::collections::BTreeMap<String, String>,
}

impl Environment {
    pub fn new(gpu: &str) -> Self {
        Environment {
            gpu: gpu.to_string(),
            source: String::new(),
            date: String::new(),
            paratune_version: env!("CARGO_PKG_VERSION").to_string(),
            notes: Vec::new(),
            commands: Vec::new(),
            checksums: Default::default(),
        }
    }
}

/// A collective that nccl-tests measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    AllReduce,
    AllGather,
    ReduceScatter,
    SendRecv,
}

impl CollectiveOp {
    pub const ALL: [CollectiveOp; 4] = [
        CollectiveOp::AllReduce,
        CollectiveOp::AllGather,
        CollectiveOp::ReduceScatter,
        CollectiveOp::SendRecv,
    ];

    /// The name used in tables and on the command line (nccl-tests' names
    /// without `_perf`).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::SendRecv => "sendrecv",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        let wanted = name.trim().to_lowercase().replace('-', "_");
        Self::ALL.into_iter().find(|op| op.name() == wanted)
    }
}

impl fmt::Display for CollectiveOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One measured collective: `bytes` is nccl-tests' `size` column (the
/// buffer each rank holds for an all-reduce, the gathered buffer for an
/// all-gather, the buffer before scattering for a reduce-scatter, the
/// message for a send/receive), `seconds` the out-of-place time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CollectivePoint {
    pub op: CollectiveOp,
    pub ranks: u64,
    pub bytes: f64,
    pub seconds: f64,
    /// nccl-tests' bus bandwidth, GB/s (10^9 bytes per second).
    pub busbw: f64,
}

/// One measured synchronisation of an embedding table's gradient between
/// `ranks` processes (`profile sync`): the method, the table's shape, the
/// distinct rows each rank touched (its mean over ranks), and the median
/// time of one synchronisation, the slowest rank's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncPoint {
    pub method: crate::config::SyncMethod,
    pub ranks: u64,
    /// Server shards of the parameter-server method; 0 for the others.
    pub partitions: u64,
    pub vocab: u64,
    pub hidden: u64,
    /// Bytes of one gradient element as synchronised (4: fp32).
    pub element_bytes: u64,
    /// Distinct rows one rank's tokens touched (mean over ranks).
    pub rows: f64,
    pub seconds: f64,
}

impl SyncPoint {
    /// The bytes one rank's touched rows carry (the dense gradient's for
    /// all-reduce).
    pub fn payload_bytes(&self) -> f64 {
        let rows = match self.method {
            crate::config::SyncMethod::AllReduce => self.vocab as f64,
            _ => self.rows,
        };
        rows * (self.hidden * self.element_bytes) as f64
    }

    pub fn check(&self) -> Result<(), String> {
        if self.ranks < 2 || self.ranks > 1 << 20 {
            return Err(format!(
                "`ranks` is {}; a synchronisation needs between 2 and {} ranks",
                self.ranks,
                1u64 << 20
            ));
        }
        let parameter_server = self.method == crate::config::SyncMethod::ParameterServer;
        if parameter_server && !(1..=self.ranks).contains(&self.partitions) {
            return Err(format!(
                "`partitions` is {}; a parameter server has 1 to ranks = {} shards",
                self.partitions, self.ranks
            ));
        }
        if !parameter_server && self.partitions != 0 {
            return Err(format!(
                "`partitions` is {}; only parameter-server points have shards (0 otherwise)",
                self.partitions
            ));
        }
        for (name, value) in [("vocab", self.vocab), ("hidden", self.hidden)] {
            if value == 0 {
                return Err(format!("`{name}` is 0; it must be at least 1"));
            }
        }
        if ![2, 4].contains(&self.element_bytes) {
            return Err(format!(
                "`element_bytes` is {}; gradients are synchronised in 2 or 4 bytes",
                self.element_bytes
            ));
        }
        if !(self.rows.is_finite() && self.rows >= 1.0 && self.rows <= self.vocab as f64) {
            return Err(format!(
                "`rows` is {}; a rank touches between 1 and vocab = {} rows",
                self.rows, self.vocab
            ));
        }
        measured("seconds", self.seconds, MAX_MEASURED_SECONDS)
    }
}

/// Distinct token ids in batches of `tokens` consecutive ids of a measured
/// token stream (`profile tokens`): the rows of an embedding table that one
/// rank's batch touches. `distinct` is the mean over the stream's batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenPoint {
    pub vocab: u64,
    pub tokens: u64,
    pub distinct: f64,
    /// How many batches of the stream the mean is over.
    pub batches: u64,
}

impl TokenPoint {
    pub fn check(&self) -> Result<(), String> {
        if self.vocab == 0 || self.tokens == 0 || self.batches == 0 {
            return Err("`vocab`, `tokens` and `batches` must each be at least 1".into());
        }
        let most = self.vocab.min(self.tokens) as f64;
        if !(self.distinct.is_finite() && self.distinct >= 1.0 && self.distinct <= most) {
            return Err(format!(
                "`distinct` is {}; a batch of {} tokens over {} ids has 1 to {most} distinct ids",
                self.distinct, self.tokens, self.vocab
            ));
        }
        Ok(())
    }
}

/// The largest message a collective point may have: nccl-tests sweeps stop
/// far below it (1 TiB); a size beyond it is a unit or parsing mistake.
pub const MAX_COLLECTIVE_BYTES: f64 = (1u64 << 40) as f64;
/// The longest a measured pass or collective may take: an hour.
pub const MAX_MEASURED_SECONDS: f64 = 3600.0;

/// `value` as a measured quantity: finite, above zero, at most `max`.
fn measured(name: &str, value: f64, max: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 && value <= max {
        Ok(())
    } else {
        Err(format!(
            "`{name}` is {value}; it must be a positive number of at most {max}"
        ))
    }
}

impl CollectivePoint {
    /// A point that could have been measured: at least 1 rank, a positive size up to [`MAX_COLLECTIVE_BYTES`], a
    /// positive time up to [`MAX_MEASURED_SECONDS`], a bus bandwidth that is
    /// a number (0 where not known).
    pub fn check(&self) -> Result<(), String> {
        if self.ranks == 0 || self.ranks > 1 << 20 {
            return Err(format!(
                "`ranks` is {}; it must be between 1 and {}",
                self.ranks,
                1u64 << 20
            ));
        }
        measured("bytes", self.bytes, MAX_COLLECTIVE_BYTES)?;
        measured("seconds", self.seconds, MAX_MEASURED_SECONDS)?;
        if !(self.busbw.is_finite() && self.busbw >= 0.0) {
            return Err(format!(
                "`busbw_GBps` is {}; it must be a number, 0 or more",
                self.busbw
            ));
        }
        Ok(())
    }
}

/// Whether a layer measurement ran or ran out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerStatus {
    Ok,
    Oom,
}

impl LayerStatus {
    pub fn name(self) -> &'static str {
        match self {
            LayerStatus::Ok => "ok",
            LayerStatus::Oom => "oom",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name.trim().to_lowercase().as_str() {
            "ok" => Some(LayerStatus::Ok),
            "oom" => Some(LayerStatus::Oom),
            _ => None,
        }
    }
}

/// What a layer computes beyond its width, heads and sequence: grouped-query
/// attention, the MLP and the attention kernel. Part of a layer's key, so
/// GPT-3 6.7B's and Llama-3 8B's layers (both hidden 4096, 32 heads) never
/// stand in for each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerArch {
    pub kv_heads: u64,
    pub ffn_hidden: u64,
    pub gated_mlp: bool,
    pub attention: AttentionKind,
}

impl LayerArch {
    /// The layer `model` is made of.
    pub fn of(model: &ModelSpec) -> Self {
        LayerArch {
            kv_heads: model.kv_heads,
            ffn_hidden: model.ffn_hidden,
            gated_mlp: model.gated_mlp,
            attention: model.attention,
        }
    }

    /// The layer a plan runs: the model's, with the configuration's
    /// attention kernel (the search may try either).
    pub fn planned(model: &ModelSpec, attention: AttentionKind) -> Self {
        LayerArch {
            attention,
            ..Self::of(model)
        }
    }

    /// The GPT layer of Megatron-LM's papers: every head its own keys and
    /// values, an MLP of 4 × hidden, not gated, unfused attention. Layer
    /// tables without the architecture columns hold such layers.
    pub fn paper_gpt(hidden: u64, heads: u64) -> Self {
        LayerArch {
            kv_heads: heads,
            ffn_hidden: 4 * hidden,
            gated_mlp: false,
            attention: AttentionKind::Standard,
        }
    }
}

/// One measured transformer layer on one tensor-parallel shard, for one
/// micro-batch. Times are wall-clock seconds of the pass as a training step
/// runs it: host launch gaps included, and the tensor-parallel collectives
/// where `includes_tp_comm` says so.
/// `backward_s` excludes recomputation, which is `recompute_s` (absent when
/// nothing is recomputed or it was not measured apart). An `oom` point has
/// NaN times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerPoint {
    pub hidden: u64,
    pub heads: u64,
    pub arch: LayerArch,
    pub seq_len: u64,
    pub micro_batch: u64,
    pub tp: u64,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
    /// Training precision, free-form (e.g. `bf16`, `fp16`, `16-bit`).
    pub dtype: String,
    pub forward_s: f64,
    pub backward_s: f64,
    pub recompute_s: Option<f64>,
    /// Half-width of the 95% confidence interval of the total, relative.
    pub ci95_rel: Option<f64>,
    /// Activation bytes the layer keeps for the backward pass.
    pub activation_bytes: Option<f64>,
    /// Peak device memory during the measurement.
    pub peak_bytes: Option<f64>,
    pub status: LayerStatus,
    /// The times hold the layer's tensor-parallel collectives (a layer
    /// timed inside a real tensor-parallel run). `false` for one shard
    /// timed alone on one device (`paratune profile layer`): the cost model
    /// adds the collectives to it.
    pub includes_tp_comm: bool,
}

impl LayerPoint {
    /// A point that could have been measured: every dimension at least 1,
    /// the times of an `ok` point positive (an `oom` point has none), the
    /// optional figures numbers of 0 or more.
    pub fn check(&self) -> Result<(), String> {
        for (name, value) in [
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.arch.kv_heads),
            ("ffn_hidden", self.arch.ffn_hidden),
            ("seq_len", self.seq_len),
            ("micro_batch", self.micro_batch),
            ("tp", self.tp),
        ] {
            if value == 0 {
                return Err(format!("`{name}` is 0; it must be at least 1"));
            }
        }
        if self.status == LayerStatus::Ok {
            measured("forward_s", self.forward_s, MAX_MEASURED_SECONDS)?;
            measured("backward_s", self.backward_s, MAX_MEASURED_SECONDS)?;
        }
        for (name, value) in [
            ("recompute_s", self.recompute_s),
            ("ci95_rel", self.ci95_rel),
            ("activation_bytes", self.activation_bytes),
            ("peak_bytes", self.peak_bytes),
        ] {
            if let Some(v) = value
                && !(v.is_finite() && v >= 0.0)
            {
                return Err(format!("`{name}` is {v}; it must be a number, 0 or more"));
            }
        }
        Ok(())
    }

    /// Forward + backward + recomputation, seconds.
    pub fn total_s(&self) -> f64 {
        self.forward_s + self.backward_s + self.recompute_s.unwrap_or(0.0)
    }

    pub fn shape(&self) -> LayerShape {
        LayerShape {
            hidden: self.hidden,
            heads: self.heads,
            arch: self.arch,
            seq_len: self.seq_len,
            tp: self.tp,
            sequence_parallel: self.sequence_parallel,
            recompute: self.recompute,
        }
    }
}

/// What `paratune profile device` found: the driver's facts about the GPU
/// (with the `cuda` feature) and achievable matrix-multiply and copy rates.
/// Kept in `DIR/device.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    /// The device measured (`cpu`, `cuda:0`).
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<DeviceFacts>,
    #[serde(default)]
    pub matmul: Vec<MatmulPoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy: Option<CopyPoint>,
    /// Fused attention at head widths 64 and 128 (absent from profiles
    /// measured before paratune timed it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention: Vec<AttentionPoint>,
    #[serde(default)]
    pub runtime: String,
    /// The host's physical memory, bytes: a CPU's capacity, which its
    /// ranks share (a GPU's is in `facts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_bytes: Option<f64>,
}

impl DeviceProfile {
    /// The highest matrix-multiply rate measured, TFLOP/s.
    pub fn best_tflops(&self) -> Option<f64> {
        self.matmul.iter().map(|p| p.tflops).reduce(f64::max)
    }
}

/// A whole profile in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub environment: Environment,
    pub collectives: Vec<CollectivePoint>,
    pub layers: Vec<LayerPoint>,
    pub device: Option<DeviceProfile>,
    /// Embedding-gradient synchronisations (`profile sync`).
    pub sync: Vec<SyncPoint>,
    /// Distinct rows per batch of a token stream (`profile tokens`).
    pub tokens: Vec<TokenPoint>,
}

impl Profile {
    pub fn empty(gpu: &str) -> Self {
        Profile {
            environment: Environment::new(gpu),
            collectives: Vec::new(),
            layers: Vec::new(),
            device: None,
            sync: Vec::new(),
            tokens: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("cannot write {path}: {message}")]
    Write { path: String, message: String },
    /// A table or environment file that does not parse: the directory is
    /// left as it is.
    #[error(
        "{path} is not a readable profile file ({message}); it was left as it is, not overwritten"
    )]
    Corrupt { path: String, message: String },
    #[error("{path}: not a profile directory ({message})")]
    NotAProfile { path: String, message: String },
    /// An input to import (an nccl-tests log, a reference table) that does not parse.
    #[error("{path} line {line}: {message}")]
    Line {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    Input { path: String, message: String },
}

#[cfg(test)]
mod tests;
