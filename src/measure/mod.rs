//! Measuring real work on a real device: one transformer layer for the
//! profiler (`paratune profile layer`), one pipeline stage for trial runs
//! (`paratune validate`).
//!
//! The device work itself needs libtorch and sits behind the `torch` cargo
//! feature (`torch_layer.rs`, `torch_stage.rs`); without it the same entry
//! points return [`MeasureError::NotCompiled`], so the CLI can say how to get
//! them instead of failing to link. Everything else here is plain Rust that
//! the default build compiles and tests: device and precision names, the
//! specification of a measurement as it travels to the worker process
//! (serde), the stopping rule (Student t, statrs) and the memory probe.
//!
//! Each measurement runs in a fresh worker process (the CLI spawns itself):
//! its memory starts from nothing, so the process's resident memory (CPU)
//! or the device's used memory (CUDA) rises by exactly what the measured
//! work keeps, and a point that runs out of memory or crashes costs that
//! point only.

mod cuda;
pub mod memory;
mod nccl;
pub mod process;
mod sampler;
pub mod sweeps;
#[cfg(feature = "torch")]
mod torch_device;
#[cfg(feature = "torch")]
mod torch_layer;
#[cfg(feature = "torch")]
mod torch_stage;
// The libtorch entry points, or the stand-in that says the build has no
// libtorch: one switch, as candle's dummy backends are.
#[cfg(feature = "torch")]
mod torch_backend;
#[cfg(not(feature = "torch"))]
#[path = "without_torch.rs"]
mod torch_backend;

pub use crate::profile::{
    AttentionPoint, CopyPoint, Device, DeviceFacts, Dtype, LayerMeasurement, MEASURED_RECOMPUTE,
    MatmulPoint,
};
pub use cuda::{cuda_presence, device_facts};
pub use nccl::{
    CommJob, bus_factor, check_comm_job, check_received, measure_comm, nccl_link_dir, sweep_sizes,
};
pub use sampler::{Sampler, StoppingRule, Summary, summarise};
pub use torch_backend::{measure_device, measure_layer, measure_stage};

use cuda::cuda_memory_probe;

use crate::config::Recompute;
use crate::model::ModelSpec;
use serde::{Deserialize, Serialize};

/// One layer measurement, as the profiler's worker receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerJob {
    /// The model whose layer is built (its `seq_len` is the one measured).
    pub model: ModelSpec,
    pub micro_batch: u64,
    /// Tensor-parallel degree: the layer is one shard (heads / tp, MLP / tp).
    pub tp: u64,
    /// Megatron-LM's sequence parallelism over the tp ranks.
    #[serde(default)]
    pub sequence_parallel: bool,
    pub dtype: Dtype,
    pub device: Device,
    pub rule: StoppingRule,
    /// Report `oom` when the measured peak exceeds this many bytes (a
    /// smaller device, simulated).
    pub memory_limit_bytes: Option<f64>,
    #[serde(default)]
    pub pass: LayerPass,
}

/// What a layer worker measures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerPass {
    /// Memory, then times.
    #[default]
    TimesAndMemory,
    /// Memory only: one forward and backward, no timing. `profile layer`
    /// runs it on CUDA in a second worker with PyTorch's caching allocator
    /// off, where the driver's used memory after the forward is the bytes
    /// the forward keeps, not the blocks the allocator reserved.
    MemoryOnly,
}

/// A trial run of one pipeline stage (`paratune validate`; see
/// `torch_stage.rs` for what runs and what one device cannot).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageJob {
    pub model: ModelSpec,
    pub tp: u64,
    pub micro_batch: u64,
    /// Transformer layers in the stage.
    pub layers: u64,
    /// Holds the embedding (pipeline stage 0).
    pub first: bool,
    /// Holds the output head and the loss (the last stage).
    pub last: bool,
    pub recompute: Recompute,
    /// Megatron-LM's sequence parallelism over the tp ranks.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Micro-batches the schedule keeps in flight on this stage, BPipe aside.
    pub schedule_in_flight: u64,
    /// Of those, how many a BPipe evictor moves off the device.
    pub evicted: u64,
    /// Micro-batches' worth of its partner's activations a BPipe acceptor holds.
    pub accepted: u64,
    /// Bytes of one accepted micro-batch's activations.
    pub accepted_bytes_per_microbatch: f64,
    /// Micro-batches run per trial iteration.
    pub micro_batches: u64,
    /// Ranks the 16-bit weights are sharded over (ZeRO-3: dp); each layer
    /// is gathered before its forward and again before its backward.
    #[serde(default = "one")]
    pub weight_shards: u64,
    /// Ranks the fp32 gradient buffers are sharded over (ZeRO-3: dp).
    pub grad_shards: u64,
    /// Ranks the optimizer states are sharded over (distributed optimizer: dp).
    pub optimizer_shards: u64,
    pub dtype: Dtype,
    pub device: Device,
    /// Timed iterations after one warm-up iteration.
    pub iterations: usize,
    pub memory_limit_bytes: Option<f64>,
}

fn one() -> u64 {
    1
}

/// What a stage trial found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageMeasurement {
    /// Wall-clock time of the schedule's forwards and backwards per
    /// micro-batch, mean over the timed iterations (zero when out of memory).
    pub time_per_microbatch_s: f64,
    pub ci95_rel: Option<f64>,
    pub optimizer_step_s: f64,
    pub iterations: usize,
    /// Parameters, gradient buffers and optimizer states, bytes.
    pub static_bytes: Option<f64>,
    /// Highest memory during an iteration above the state before the stage
    /// was built, bytes.
    pub peak_bytes: Option<f64>,
    pub out_of_memory: bool,
    pub runtime: String,
}

impl StageMeasurement {
    pub fn out_of_memory(runtime: String, peak_bytes: Option<f64>) -> Self {
        StageMeasurement {
            time_per_microbatch_s: 0.0,
            ci95_rel: None,
            optimizer_step_s: 0.0,
            iterations: 0,
            static_bytes: None,
            peak_bytes,
            out_of_memory: true,
            runtime,
        }
    }
}

/// What `paratune profile device` measures with libtorch: square matrix
/// multiplies of growing side, and a large device-to-device copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceJob {
    pub device: Device,
    pub dtype: Dtype,
    /// Sides double from 256 up to this.
    pub max_side: u64,
    /// Bytes of the copied buffer.
    pub copy_bytes: u64,
    /// Tokens per sequence of the fused-attention points (two sequences,
    /// heads 64 and 128 wide over a 2048-wide model, as FlashAttention-3
    /// measured); 0 times none.
    #[serde(default)]
    pub attention_seq: u64,
    pub rule: StoppingRule,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceMeasurement {
    pub matmul: Vec<MatmulPoint>,
    pub copy: CopyPoint,
    #[serde(default)]
    pub attention: Vec<AttentionPoint>,
    pub runtime: String,
}

/// A measurement for the worker process, as JSON on its command line.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkerJob {
    Layer(LayerJob),
    Stage(StageJob),
    Device(DeviceJob),
    Comm(CommJob),
}

/// The worker's answer, one JSON line on its standard output.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerReply {
    Layer(LayerMeasurement),
    Stage(StageMeasurement),
    Device(DeviceMeasurement),
    Comm(Vec<crate::profile::CollectivePoint>),
    /// The measurement could not run (bad job, no device, libtorch error).
    Error(String),
}

/// Runs a worker job in this process.
pub fn run_worker_job(job: &WorkerJob) -> WorkerReply {
    match job {
        WorkerJob::Layer(job) => match measure_layer(job) {
            Ok(m) => WorkerReply::Layer(m),
            Err(e) => WorkerReply::Error(e.to_string()),
        },
        WorkerJob::Stage(job) => match measure_stage(job) {
            Ok(m) => WorkerReply::Stage(m),
            Err(e) => WorkerReply::Error(e.to_string()),
        },
        WorkerJob::Device(job) => match measure_device(job) {
            Ok(m) => WorkerReply::Device(m),
            Err(e) => WorkerReply::Error(e.to_string()),
        },
        WorkerJob::Comm(job) => match measure_comm(job, |_, _| {}) {
            Ok(points) => WorkerReply::Comm(points),
            Err(e) => WorkerReply::Error(e.to_string()),
        },
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    #[error(
        "this paratune was built without the `torch` feature, which {what} needs: rebuild with `cargo build --release --features torch` (README → Profiling says how to get libtorch)"
    )]
    NotCompiled { what: &'static str },
    #[error(
        "this paratune was built without the `cuda` feature, which {what} needs: rebuild with `cargo build --release --features torch,cuda`"
    )]
    NotCompiledCuda { what: &'static str },
    #[error("`device {device}`: no CUDA device is present ({reason}); use `device cpu`")]
    NoCuda { device: Device, reason: String },
    #[error("`device {device}`: this machine has {count} CUDA device(s); use cuda:0..cuda:{}", count.saturating_sub(1))]
    NoSuchGpu { device: Device, count: usize },
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("the measurement failed: {0}")]
    Failed(String),
    /// A sweep that stopped, with what it saved and how to go on.
    #[error("{0}")]
    Sweep(String),
    #[error(transparent)]
    Save(#[from] crate::profile::ProfileError),
}

/// Checks a stage job before any device work.
pub fn check_stage_job(job: &StageJob) -> Result<(), MeasureError> {
    check_shard(&job.model, job.tp, job.micro_batch)?;
    let invalid = |message: String| {
        Err(MeasureError::Invalid {
            field: "plan",
            message,
        })
    };
    if job.micro_batches == 0 || job.iterations == 0 {
        return invalid("a trial needs at least one micro-batch and one iteration".into());
    }
    if job.model.vocab < job.tp {
        return invalid(format!(
            "vocabulary {} is smaller than tensor parallelism {}",
            job.model.vocab, job.tp
        ));
    }
    check_sequence_split(&job.model, job.tp, job.sequence_parallel, "plan")?;
    if job.weight_shards == 0 || job.grad_shards == 0 || job.optimizer_shards == 0 {
        return invalid("shard counts must be at least 1".into());
    }
    if job.evicted > job.schedule_in_flight {
        return invalid(format!(
            "{} evicted micro-batches but only {} in flight",
            job.evicted, job.schedule_in_flight
        ));
    }
    Ok(())
}

/// Checks that `device` exists before any work is sent to it.
pub fn check_device(device: Device) -> Result<(), MeasureError> {
    cuda_presence(device)?;
    torch_backend::check_device(device)
}

/// Whether this build can talk to the CUDA driver and NCCL.
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

/// Whether this build can run device work at all.
pub const TORCH_COMPILED: bool = cfg!(feature = "torch");

/// Checks a layer job before any device work: shapes that do not split,
/// by the rules the search uses. Errors name the job's fields.
pub fn check_layer_job(job: &LayerJob) -> Result<(), MeasureError> {
    check_shard(&job.model, job.tp, job.micro_batch)?;
    check_sequence_split(
        &job.model,
        job.tp,
        job.sequence_parallel,
        "sequence_parallel",
    )
}

/// Sequence parallelism needs more than one rank and a sequence that splits
/// evenly over them.
fn check_sequence_split(
    m: &ModelSpec,
    tp: u64,
    sequence_parallel: bool,
    field: &'static str,
) -> Result<(), MeasureError> {
    if crate::config::sequence_split_problem(m, tp, sequence_parallel).is_some() {
        return Err(MeasureError::Invalid {
            field,
            message: format!(
                "sequence parallelism needs tensor parallelism of 2 or more that divides the sequence {}; tp is {}",
                m.seq_len, tp
            ),
        });
    }
    Ok(())
}

/// A layer of `m` split `tp` ways over `micro_batch` sequences.
fn check_shard(m: &ModelSpec, tp: u64, micro_batch: u64) -> Result<(), MeasureError> {
    let invalid = |field, message: String| Err(MeasureError::Invalid { field, message });
    if micro_batch == 0 {
        return invalid("micro_batch", "micro-batch sizes must be 1 or more".into());
    }
    m.check().or_else(|message| invalid("model", message))?;
    match crate::config::tensor_split_problem(m, tp) {
        Some(crate::config::Rule::HeadsNotDivisible) => invalid(
            "tp",
            format!(
                "tensor parallelism {} must divide the {} attention heads and {} key/value heads",
                tp, m.heads, m.kv_heads
            ),
        ),
        Some(_) => invalid(
            "tp",
            format!(
                "tensor parallelism {} must divide the MLP width {}",
                tp, m.ffn_hidden
            ),
        ),
        None => Ok(()),
    }
}

/// Checks a device job before any device work.
pub fn check_device_job(job: &DeviceJob) -> Result<(), MeasureError> {
    if job.max_side < 256 {
        return Err(MeasureError::Invalid {
            field: "max_side",
            message: "give 256 or more".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("CUDA:3".parse::<Device>(), Ok(Device::Cuda(3)));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        for bad in ["tpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let err = bad.parse::<Device>().unwrap_err();
            assert!(err.contains("cuda:N"), "{bad}: {err}");
        }
    }

    #[test]
    fn dtypes_parse() {
        assert_eq!("bfloat16".parse::<Dtype>(), Ok(Dtype::Bf16));
        assert_eq!("FP32".parse::<Dtype>(), Ok(Dtype::Fp32));
        assert!(
            "int8"
                .parse::<Dtype>()
                .unwrap_err()
                .contains("fp32, fp16, bf16")
        );
    }

    #[test]
    fn jobs_that_do_not_split_are_refused() {
        let mut job = LayerJob {
            model: ModelSpec::gpt("t", 128, 4, 2, 1000, 64),
            micro_batch: 2,
            tp: 3,
            sequence_parallel: false,
            dtype: Dtype::Fp32,
            device: Device::Cpu,
            rule: StoppingRule::default(),
            memory_limit_bytes: None,
            pass: LayerPass::default(),
        };
        assert!(matches!(
            check_layer_job(&job),
            Err(MeasureError::Invalid { field: "tp", .. })
        ));
        job.tp = 2;
        assert!(check_layer_job(&job).is_ok());
        job.micro_batch = 0;
        assert!(matches!(
            check_layer_job(&job),
            Err(MeasureError::Invalid {
                field: "micro_batch",
                ..
            })
        ));
    }
}
