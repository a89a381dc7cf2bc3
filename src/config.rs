//! One way to run a training job: parallel degrees, micro-batch, schedule,
//! recomputation and the memory-saving switches. Plain data, no behaviour
//! beyond naming and validity checks.

use crate::model::{AttentionKind, ModelSpec};
use serde::{Deserialize, Serialize};
use std::fmt;

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
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    None,
    /// Recompute only the attention core (Korthikanti et al.).
    Selective,
    /// Keep only each layer's input and recompute the whole layer.
    Full,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
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

/// One parallel training configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ParallelConfig {
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    pub micro_batch: u64,
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank; 1 unless the schedule is interleaved.
    pub virtual_stages: u64,
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    pub optimizer_sharding: OptimizerSharding,
    /// BPipe activation balancing between pipeline stages x and p-1-x.
    pub bpipe: bool,
    pub attention: AttentionKind,
}

impl ParallelConfig {
    pub fn gpus(&self) -> u64 {
        self.tp.saturating_mul(self.pp).saturating_mul(self.dp)
    }

    /// Micro-batches each pipeline processes per iteration.
    pub fn micro_batches(&self, global_batch: u64) -> u64 {
        global_batch / self.micro_batch.saturating_mul(self.dp).max(1)
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
        let c = self;
        let rules = [
            (
                Rule::ZeroDegree,
                c.tp == 0 || c.pp == 0 || c.dp == 0 || c.micro_batch == 0 || c.virtual_stages == 0,
            ),
            (Rule::GpuCount, c.gpus() != gpus),
            (
                Rule::TensorParallelOutsideNode,
                c.tp > gpus_per_node || !gpus_per_node.is_multiple_of(c.tp),
            ),
            (
                Rule::HeadsNotDivisible,
                !model.heads.is_multiple_of(c.tp) || !model.kv_heads.is_multiple_of(c.tp),
            ),
            (
                Rule::FfnNotDivisible,
                !model.ffn_hidden.is_multiple_of(c.tp),
            ),
            (
                Rule::BatchNotDivisible,
                !global_batch.is_multiple_of(c.micro_batch.saturating_mul(c.dp)),
            ),
            (
                Rule::LayersNotDivisible,
                !model
                    .layers
                    .is_multiple_of(c.pp.saturating_mul(c.virtual_stages)),
            ),
            (
                Rule::InterleavedShape,
                c.schedule == ScheduleKind::Interleaved && (c.pp < 2 || c.virtual_stages < 2),
            ),
            (
                Rule::InterleavedMicroBatches,
                c.schedule == ScheduleKind::Interleaved
                    && !c.micro_batches(global_batch).is_multiple_of(c.pp),
            ),
            (
                Rule::VirtualStagesWithoutInterleaving,
                c.schedule != ScheduleKind::Interleaved && c.virtual_stages != 1,
            ),
            (
                Rule::SequenceParallelWithoutTp,
                c.sequence_parallel && c.tp == 1,
            ),
            (
                Rule::SequenceNotSplit,
                c.sequence_parallel && !model.seq_len.is_multiple_of(c.tp),
            ),
            (
                Rule::BpipeSchedule,
                c.bpipe && (c.schedule != ScheduleKind::OneFOneB || c.pp < 2),
            ),
            (
                Rule::ShardingWithoutDp,
                c.optimizer_sharding != OptimizerSharding::None && c.dp == 1,
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
    ShardingWithoutDp,
}

impl Rule {
    /// A short name for counts of dropped configurations.
    pub fn summary(self) -> &'static str {
        match self {
            Rule::ZeroDegree => "a degree is zero",
            Rule::GpuCount => "tp x pp x dp differs from the GPU count",
            Rule::TensorParallelOutsideNode => "tp does not divide the node",
            Rule::HeadsNotDivisible => "heads not divisible by tp",
            Rule::FfnNotDivisible => "ffn hidden not divisible by tp",
            Rule::BatchNotDivisible => "global batch not divisible by micro-batch x dp",
            Rule::LayersNotDivisible => "layers not divisible by pp x virtual stages",
            Rule::InterleavedShape => "interleaving needs pp >= 2 and v >= 2",
            Rule::InterleavedMicroBatches => "interleaving needs micro-batches divisible by pp",
            Rule::VirtualStagesWithoutInterleaving => "virtual stages need interleaving",
            Rule::SequenceParallelWithoutTp => "sequence parallelism needs tp >= 2",
            Rule::SequenceNotSplit => "sequence parallelism needs tp to divide the sequence",
            Rule::BpipeSchedule => "BPipe needs 1f1b and pp >= 2",
            Rule::ShardingWithoutDp => "optimizer sharding needs dp >= 2",
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
            Rule::ZeroDegree => {
                "tp, pp, dp, micro-batch and virtual stages must all be at least 1".into()
            }
            Rule::GpuCount => format!(
                "tp x pp x dp = {} x {} x {} = {} but the job has {gpus} GPUs; make the product equal",
                c.tp,
                c.pp,
                c.dp,
                c.gpus()
            ),
            Rule::TensorParallelOutsideNode => format!(
                "tp {} must divide the {gpus_per_node} GPUs of a node (tensor parallelism stays within a node)",
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
                "global batch {global_batch} must be divisible by micro-batch x dp = {} x {}; change --global-batch or --micro-batch",
                c.micro_batch, c.dp
            ),
            Rule::LayersNotDivisible => format!(
                "layers ({}) must divide evenly over pp x virtual stages = {} x {}",
                model.layers, c.pp, c.virtual_stages
            ),
            Rule::InterleavedShape => {
                "the interleaved schedule needs pp >= 2 and --virtual-stages >= 2".into()
            }
            Rule::InterleavedMicroBatches => format!(
                "the interleaved schedule needs the micro-batch count ({}) to be a multiple of pp ({})",
                c.micro_batches(global_batch),
                c.pp
            ),
            Rule::VirtualStagesWithoutInterleaving => {
                "virtual stages other than 1 need --schedule interleaved".into()
            }
            Rule::SequenceParallelWithoutTp => "sequence parallelism needs tp >= 2".into(),
            Rule::SequenceNotSplit => format!(
                "sequence parallelism cannot split the sequence {} evenly over tp {}: pick a tp that divides it, or --sequence-parallel off",
                model.seq_len, c.tp
            ),
            Rule::BpipeSchedule => "BPipe needs --schedule 1f1b and pp >= 2".into(),
            Rule::ShardingWithoutDp => "optimizer sharding needs dp >= 2".into(),
        }
    }
}

impl fmt::Display for ParallelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tp{} pp{} dp{} mb{} {}{} rc={} sp={} shard={} bpipe={} attn={}",
            self.tp,
            self.pp,
            self.dp,
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
        )
    }
}

pub fn on_off(flag: bool) -> &'static str {
    if flag { "on" } else { "off" }
}
