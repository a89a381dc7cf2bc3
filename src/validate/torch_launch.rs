//! Multi-rank trials on PyTorch's own `torch.distributed`: `validate
//! --launch torch --ranks N`. For each candidate a job (`job.json`: the
//! model, the degrees, micro-batch, schedule, sharding and recomputation as
//! planned) and a script that starts N ranks of the shipped worker
//! (`torch_worker.py`, compiled into this binary and written beside the
//! job) under `python -m torch.distributed.run`: DTensor tensor parallelism,
//! `torch.distributed.pipelining` schedules, FSDP2 or replicated data
//! parallelism, activation checkpointing. gloo on the CPU, NCCL on GPUs.
//!
//! The worker holds state as torchtitan's FSDP2 does (fp32 parameters,
//! gradients and Adam moments, compute in 16 bits), so only candidates
//! planned for the torchtitan engine are trialled; others are skipped with
//! the reason. Every rank writes `report/rank-R.json`; [`read_trial`]
//! checks that each ran with the degrees it was planned with and turns the
//! reports into a run row ([`ROW_COLUMNS`]) and per-rank memory.

use super::launch::{LaunchError, ScriptOutcome, script_header, script_prologue, write_candidate};
use crate::config::{
    CpComm, Dispatcher, Engine, OptimizerSharding, ParallelConfig, Precision, ScheduleKind,
    SyncMethod,
};
use crate::plan_file::{PlanFile, PlannedCandidate};
use crate::text::shell_quote;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The worker, shipped inside the binary so a trial needs nothing but a
/// Python with PyTorch.
pub const WORKER_SOURCE: &str = include_str!("torch_worker.py");
/// Its file name beside each candidate's job.
pub const WORKER_FILE: &str = "torch_worker.py";
/// Version of the job and report schema the worker speaks.
pub const SCHEMA: u32 = 1;

/// Where the ranks run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrialDevice {
    Cpu,
    Cuda,
}

impl TrialDevice {
    /// The collective backend the device's ranks talk through.
    pub fn backend(self) -> &'static str {
        match self {
            TrialDevice::Cpu => "gloo",
            TrialDevice::Cuda => "nccl",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TrialDevice::Cpu => "cpu",
            TrialDevice::Cuda => "cuda",
        }
    }
}

/// What every candidate's trial shares.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchSettings {
    /// A Python interpreter with PyTorch.
    pub python: PathBuf,
    pub ranks: u64,
    pub device: TrialDevice,
    /// Compute precision: `bf16` or `fp32`.
    pub dtype: String,
    pub warmup: u64,
    pub iterations: u64,
    /// Threads each CPU rank may use (`torch.set_num_threads`).
    pub threads_per_rank: u64,
    /// Memory one rank may use on this machine; a candidate predicted to
    /// need more runs the plan's model with fewer layers (see
    /// [`layers_that_fit`]). `None`: no limit.
    pub memory_per_rank_bytes: Option<f64>,
    /// The model the memory is predicted with.
    pub cost: crate::coefficients::CostModel,
}

/// Ranks a machine can run at once: two per core at most, more only
/// measure contention.
pub fn max_ranks(cores: u64) -> u64 {
    2 * cores.max(1)
}

/// Runs the shipped worker on `job` between `ranks` local processes
/// (torchrun), in `dir` (its job, worker, script and log), stopped after
/// `timeout`; `label` names the run in the error, which ends with the
/// worker's last line.
pub fn run_local_worker(
    python: &Path,
    ranks: u64,
    job: &impl Serialize,
    dir: &Path,
    timeout: std::time::Duration,
    label: &str,
) -> Result<(), crate::measure::MeasureError> {
    let write = |path: &Path, bytes: &[u8]| {
        crate::atomic::write_atomically(path, bytes).map_err(|e| {
            worker_failure(label, &format!("cannot write {}: {e}", path.display()), dir)
        })
    };
    let job_path = dir.join("job.json");
    let job_text = serde_json::to_string_pretty(job)
        .map_err(|e| worker_failure(label, &e.to_string(), dir))?;
    write(&job_path, job_text.as_bytes())?;
    let worker = dir.join(WORKER_FILE);
    write(&worker, WORKER_SOURCE.as_bytes())?;
    let log = dir.join("run.log");
    let script = dir.join("run.sh");
    let quote = |p: &Path| shell_quote(&p.display().to_string());
    let text = format!(
        "set -euo pipefail\nexport OMP_NUM_THREADS=1\n{} -m torch.distributed.run --standalone --nproc-per-node {ranks} {} --job {} > {} 2>&1\n",
        quote(python),
        quote(&worker),
        quote(&job_path),
        quote(&log)
    );
    write(&script, text.as_bytes())?;
    crate::measure::process::run_script(&script, timeout)
        .map_err(|why| worker_failure(label, &why, dir))
}

/// A local worker run that failed, with the last line of its log.
pub fn worker_failure(label: &str, why: &str, dir: &Path) -> crate::measure::MeasureError {
    let tail = std::fs::read_to_string(dir.join("run.log")).unwrap_or_default();
    let last = tail
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    crate::measure::MeasureError::Sweep(format!("{label}: {why}; the worker's last line: {last}"))
}

/// The model as the worker builds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialModel {
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub ffn_hidden: u64,
    pub gated_mlp: bool,
    pub layers: u64,
    pub vocab: u64,
    pub seq_len: u64,
    pub tied_embeddings: bool,
    pub learned_positions: bool,
    pub attention: String,
    pub dropout: bool,
    /// The experts of a mixture of experts: an MoE layer (a layer
    /// [`MoeSpec::is_moe_layer`](crate::model::MoeSpec::is_moe_layer) picks)
    /// routes each token to `topk` of them; absent for a dense model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<crate::model::MoeSpec>,
}

/// The parallel configuration as the worker maps it onto torch.distributed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialParallel {
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    pub dp_shard: Option<u64>,
    pub micro_batch: u64,
    pub global_batch: u64,
    pub schedule: String,
    pub virtual_stages: u64,
    /// Layers of each model chunk in model order, `pp · virtual_stages` of
    /// them; chunk `c` runs on pipeline rank `c mod pp` (Megatron-LM's
    /// interleaving).
    pub stage_layers: Vec<u64>,
    pub sequence_parallel: bool,
    pub optimizer_sharding: String,
    pub recompute: String,
    pub ac_frequency: u64,
    /// How the token embedding's gradient is synchronised
    /// ([`SyncMethod::name`]): `all-reduce`, or `sparse-all-gather` (DDP
    /// over `nn.Embedding(sparse=True)`). A job without it (older) is
    /// all-reduce.
    #[serde(default = "all_reduce")]
    pub embedding_sync: String,
    /// Expert parallelism: each MoE layer's experts spread over `ep` ranks
    /// of a stage (Megatron-Core's order: etp fastest, then ep, then
    /// expert-data); 1 (and absent, in older jobs) for a dense model.
    #[serde(default = "one")]
    pub ep: u64,
    #[serde(default = "one")]
    pub etp: u64,
    /// The token dispatcher ([`Dispatcher::name`]).
    #[serde(default = "alltoall")]
    pub moe_dispatcher: String,
    /// Context parallelism: the sequence split over `cp` ranks (Megatron-
    /// Core's order: tp fastest, then cp, then dp); 1 (and absent, in older
    /// jobs) without.
    #[serde(default = "one")]
    pub cp: u64,
    /// How the cp ranks exchange keys and values ([`CpComm::name`]); the
    /// worker runs `p2p`, the ring.
    #[serde(default = "p2p")]
    pub cp_comm: String,
}

fn p2p() -> String {
    CpComm::P2p.name().into()
}

fn all_reduce() -> String {
    SyncMethod::AllReduce.name().into()
}

fn one() -> u64 {
    1
}

fn alltoall() -> String {
    Dispatcher::AllToAll.name().into()
}

/// One candidate's job, `job.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrialJob {
    pub schema: u32,
    pub mode: String,
    pub candidate: usize,
    pub device: TrialDevice,
    pub backend: String,
    pub threads_per_rank: u64,
    pub dtype: String,
    pub seed: u64,
    pub warmup: u64,
    pub iterations: u64,
    pub report_dir: PathBuf,
    pub model: TrialModel,
    pub parallel: TrialParallel,
    pub comm: Option<serde_json::Value>,
}

/// Layers of each model chunk, in model order. Interleaved chunks split a
/// stage's layers evenly; an uneven first or last stage is one chunk.
pub fn chunk_layers(c: &ParallelConfig, layers: u64) -> Vec<u64> {
    let v = c.virtual_stages.max(1);
    let chunks = c.pp * v;
    if v == 1 {
        return (0..c.pp).map(|s| c.stage_layers(layers, s)).collect();
    }
    (0..chunks).map(|_| layers / chunks).collect()
}

/// Why the worker cannot run `c` as planned, if it cannot.
pub fn unsupported(model: &crate::model::ModelSpec, c: &ParallelConfig) -> Option<String> {
    let layers = model.layers;
    let reason = if let Some(reason) = experts_unsupported(model, c) {
        reason
    } else if c.precision != Precision::Bf16 {
        "FP8 and NVFP4 GEMMs are not run by the worker (it computes in bf16 or fp32); plan with `precision bf16`"
    } else if model.mtp_layers > 0 {
        "multi-token prediction modules are not built by the worker"
    } else if model.window.is_some() {
        "sliding-window attention is not built by the worker (it attends over the whole causal context)"
    } else if model.attention_sinks || model.quick_geglu.is_some() {
        "gpt-oss's attention sinks and clamped quick-GeGLU are not built by the worker (it runs a plain softmax and SwiGLU)"
    } else if model.qk_layernorm {
        "query/key norms are not built by the worker; plan with `--qk-layernorm off` to trial"
    } else if model.no_positions {
        "models without position embeddings are not built by the worker (it embeds learned or rotary positions)"
    } else if model.rms_norm == model.learned_positions
        || model.linear_bias != model.learned_positions
    {
        "the worker builds GPT's LayerNorm with biases for learned positions and Llama's RMSNorm without them for rotary ones, not this model's mix of the two"
    } else if let Some(reason) = context_unsupported(model, c) {
        reason
    } else if model.head_dim_override.is_some() || model.mla.is_some() {
        "heads of other than hidden / heads width, and multi-latent attention, are not built by the worker"
    } else if c.engine != Engine::Torchtitan {
        "the torch worker holds state as FSDP2 does (fp32 parameters, gradients and Adam moments); plan with --engine torchtitan to trial on it"
    } else if c.compile {
        "torch.compile is not run by the worker (plan with --compile off)"
    } else if c.bpipe {
        "BPipe's activation eviction is not run by the worker"
    } else if c.cuda_graphs.on() || c.tp_comm_overlap {
        "CUDA graphs and async tensor parallelism are not run by the worker"
    } else if c.virtual_stages > 1
        && (c.uneven() || !layers.is_multiple_of(c.pp * c.virtual_stages))
    {
        "interleaved chunks of unequal size are not run by the worker"
    } else {
        return sparse_sync_unsupported(model, c).map(str::to_string);
    };
    Some(reason.to_string())
}

/// Why the worker cannot run `c`'s experts as planned, if it cannot: it
/// runs Megatron-Core's all-to-all or all-gather dispatcher over the ep
/// ranks, each expert whole or split over its etp ranks, beside tensor
/// parallelism with sequence parallelism; but it trials only torchtitan's candidates, whose experts
/// dispatch all-to-all (`Rule::EngineCannotRun`), so an allgather candidate
/// (Megatron-LM's) is refused for its engine, said here in the dispatcher's
/// terms.
fn experts_unsupported(
    model: &crate::model::ModelSpec,
    c: &ParallelConfig,
) -> Option<&'static str> {
    model.moe?;
    if c.tp > 1 && !c.sequence_parallel {
        Some(
            "mixture-of-experts layers beside tensor parallelism (tp > 1) are run by the worker with sequence parallelism only, as Megatron-Core runs them; plan with `sequence_parallel on`",
        )
    } else if c.dispatcher == Dispatcher::AllGather {
        Some(
            "the allgather dispatcher is Megatron-LM's, and the worker trials only torchtitan's candidates (it holds state as FSDP2 does), whose experts dispatch all-to-all; plan with --engine torchtitan and `moe_dispatcher alltoall` to trial on it",
        )
    } else if c.dispatcher.deduplicates() {
        Some(
            "the flex dispatcher runs DeepEP's or HybridEP's CUDA kernels, which the worker does not have; plan with `moe_dispatcher alltoall` to trial on it",
        )
    } else if c.embedding_sync == SyncMethod::SparseAllGather {
        Some(
            "the sparse all-gather is DDP's, and a mixture of experts is not wrapped in DDP (its experts sync over their own group)",
        )
    } else {
        None
    }
}

/// Why the worker cannot run `c`'s context parallelism as planned, if it
/// cannot: it runs Megatron-LM's p2p ring (ring attention over the cp
/// ranks), its a2a exchange (DeepSpeed-Ulysses's all-to-all of heads for
/// tokens) or its allgather exchange (every cp rank's keys and values
/// gathered) for a dense model without HSDP or dropout, beside tensor and
/// pipeline parallelism too (each tp rank's heads, each stage's cp ranks,
/// their own exchange).
fn context_unsupported(
    model: &crate::model::ModelSpec,
    c: &ParallelConfig,
) -> Option<&'static str> {
    if c.cp == 1 {
        return None;
    }
    if c.cp_comm == CpComm::A2aP2p {
        Some(
            "the worker exchanges keys and values with Megatron-LM's p2p ring, a2a or allgather, not the hierarchical a2a+p2p; plan with one of them",
        )
    } else if c.dp_shard.is_some() {
        Some("HSDP (`dp_shard`) beside context parallelism is not run by the worker")
    } else if c.embedding_sync != SyncMethod::AllReduce {
        Some(
            "with context parallelism the worker syncs the embedding by all-reduce over dp x cp; plan with `embedding_sync all-reduce`",
        )
    } else if model.dropout {
        Some(
            "the worker's context-parallel attention computes the softmax without a dropout mask; plan with `dropout off` to trial context parallelism",
        )
    } else {
        None
    }
}

/// Why the worker cannot synchronise `c`'s embedding as planned, if it
/// cannot: it runs the sparse all-gather as PyTorch DDP does, over a sparse
/// embedding, so only where it wraps the model in DDP.
fn sparse_sync_unsupported(
    model: &crate::model::ModelSpec,
    c: &ParallelConfig,
) -> Option<&'static str> {
    match c.embedding_sync {
        SyncMethod::AllReduce => None,
        SyncMethod::ParameterServer => Some(
            "the worker runs no parameter server; Parallax's sparse path is priced but not trialled",
        ),
        SyncMethod::SparseAllGather if c.tp > 1 || c.pp > 1 => Some(
            "the sparse all-gather is DDP's, and the worker wraps the model in DDP only with tp 1 and pp 1",
        ),
        SyncMethod::SparseAllGather if c.optimizer_sharding != OptimizerSharding::None => Some(
            "the sparse all-gather is DDP's, and a sharded configuration runs FSDP, which syncs the table dense",
        ),
        SyncMethod::SparseAllGather if c.dp < 2 => {
            Some("the sparse all-gather needs dp > 1: there are no data-parallel ranks to sync")
        }
        SyncMethod::SparseAllGather if model.tied_embeddings => Some(
            "a tied embedding's gradient is dense (the head's touches every row); use all-reduce",
        ),
        SyncMethod::SparseAllGather => None,
    }
}

/// The layers of `plan`'s model a candidate's trial runs: all of them when
/// its predicted peak fits `budget` bytes a rank, else the most that fit in
/// whole multiples of its model chunks (the plan's degrees, micro-batch,
/// schedule and per-layer shape kept, so the trial still exercises the
/// planned parallelism; its prediction is remade for those layers).
pub fn layers_that_fit(
    plan: &PlanFile,
    candidate: &PlannedCandidate,
    cost: &crate::coefficients::CostModel,
    budget: Option<f64>,
) -> Result<u64, LaunchError> {
    let layers = plan.model.layers;
    let Some(budget) = budget else {
        return Ok(layers);
    };
    let c = &candidate.config;
    let peak = |layers: u64| {
        let mut model = plan.model.clone();
        model.layers = layers;
        let scenario =
            crate::cost::Scenario::new(&model, plan.global_batch, &plan.nodes, plan.gpus, cost);
        crate::cost::predict(&scenario, c).peak_allocated_bytes
    };
    if peak(layers) <= budget {
        return Ok(layers);
    }
    let refuse = |reason: String| LaunchError::Unsupported {
        rank: candidate.rank,
        engine: "this machine",
        reason,
    };
    if c.uneven() {
        return Err(refuse(format!(
            "it is predicted to need {:.1} GiB a rank, more than the {:.1} GiB here, and its uneven split cannot be scaled down",
            peak(layers) / GIB,
            budget / GIB
        )));
    }
    let chunk = c.pp * c.virtual_stages.max(1);
    (1..=layers / chunk)
        .rev()
        .map(|k| k * chunk)
        .find(|&n| peak(n) <= budget)
        .ok_or_else(|| {
            refuse(format!(
                "even {chunk} layer(s), one per model chunk, are predicted to need {:.1} GiB a rank, more than the {:.1} GiB here",
                peak(chunk) / GIB,
                budget / GIB
            ))
        })
}

const GIB: f64 = (1u64 << 30) as f64;

/// The job of one candidate, its reports going to `report_dir`.
pub fn trial_job(
    plan: &PlanFile,
    candidate: &PlannedCandidate,
    settings: &TorchSettings,
    report_dir: &Path,
) -> Result<TrialJob, LaunchError> {
    let c = &candidate.config;
    if let Some(reason) = unsupported(&plan.model, c) {
        return Err(LaunchError::Unsupported {
            rank: candidate.rank,
            engine: "the torch worker",
            reason,
        });
    }
    if c.embedding_sync == SyncMethod::SparseAllGather && settings.device == TrialDevice::Cuda {
        return Err(LaunchError::Unsupported {
            rank: candidate.rank,
            engine: "the torch worker",
            reason: "NCCL has no sparse all-reduce, which DDP syncs a sparse gradient with; trial the sparse all-gather with --device cpu (gloo)".into(),
        });
    }
    check_ranks(plan, settings.ranks)?;
    let m = &plan.model;
    let layers = layers_that_fit(
        plan,
        candidate,
        &settings.cost,
        settings.memory_per_rank_bytes,
    )?;
    Ok(TrialJob {
        schema: SCHEMA,
        mode: "train".into(),
        candidate: candidate.rank,
        device: settings.device,
        backend: settings.device.backend().into(),
        threads_per_rank: settings.threads_per_rank,
        dtype: settings.dtype.clone(),
        seed: 1234,
        warmup: settings.warmup,
        iterations: settings.iterations,
        report_dir: report_dir.to_path_buf(),
        model: TrialModel {
            hidden: m.hidden,
            heads: m.heads,
            kv_heads: m.kv_heads,
            ffn_hidden: m.ffn_hidden,
            gated_mlp: m.gated_mlp,
            layers,
            vocab: m.vocab,
            seq_len: m.seq_len,
            tied_embeddings: m.tied_embeddings,
            learned_positions: m.learned_positions,
            attention: m.attention.name().into(),
            dropout: m.dropout,
            moe: m.moe,
        },
        parallel: TrialParallel {
            tp: c.tp,
            pp: c.pp,
            dp: c.dp,
            dp_shard: c.dp_shard,
            micro_batch: c.micro_batch,
            global_batch: plan.global_batch,
            schedule: c.schedule.name().into(),
            virtual_stages: if c.schedule == ScheduleKind::Interleaved {
                c.virtual_stages
            } else {
                1
            },
            stage_layers: chunk_layers(c, layers),
            sequence_parallel: c.sequence_parallel,
            optimizer_sharding: c.optimizer_sharding.name().into(),
            recompute: c.recompute.name().into(),
            ac_frequency: c.ac_frequency,
            embedding_sync: c.embedding_sync.name().into(),
            ep: c.ep,
            etp: c.etp,
            moe_dispatcher: c.dispatcher.name().into(),
            cp: c.cp,
            cp_comm: c.cp_comm.name().into(),
        },
        comm: None,
    })
}

/// A plan's candidates use all of its GPUs: one rank each.
pub fn check_ranks(plan: &PlanFile, ranks: u64) -> Result<(), LaunchError> {
    if ranks == plan.gpus {
        return Ok(());
    }
    Err(LaunchError::Ranks {
        given: ranks,
        needed: plan.gpus,
    })
}

/// The script that runs one candidate's ranks; `job.json` and the worker
/// sit beside it.
pub fn torch_script(
    plan: &PlanFile,
    candidate: &PlannedCandidate,
    settings: &TorchSettings,
) -> String {
    let mut s = String::new();
    script_header(
        &mut s,
        "torch.distributed",
        plan,
        candidate,
        (plan.nodes.nodes, plan.nodes.gpus_per_node),
    );
    let _ = writeln!(
        s,
        "#   {} ranks on this machine ({}, {}), started by torch.distributed.run; one report per rank in report/",
        settings.ranks,
        settings.device.name(),
        settings.device.backend()
    );
    script_prologue(&mut s);
    let _ = writeln!(
        s,
        "PYTHON_DEFAULT={}",
        shell_quote(&settings.python.display().to_string())
    );
    let _ = writeln!(s, "PYTHON=\"${{PYTHON:-$PYTHON_DEFAULT}}\"");
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "# One thread per rank unless told otherwise, and glibc handing freed"
    );
    let _ = writeln!(
        s,
        "# blocks back at once, so a CPU rank's resident memory follows its tensors."
    );
    let _ = writeln!(
        s,
        "export OMP_NUM_THREADS=\"${{OMP_NUM_THREADS:-{}}}\"",
        settings.threads_per_rank.max(1)
    );
    let _ = writeln!(s, "export MALLOC_MMAP_THRESHOLD_=65536");
    let _ = writeln!(s, "export MALLOC_TRIM_THRESHOLD_=0");
    let _ = writeln!(s);
    let _ = writeln!(s, "rm -rf \"$SCRIPT_DIR/report\"");
    let _ = writeln!(s, "mkdir -p \"$SCRIPT_DIR/report\"");
    let _ = writeln!(s, "LOG_FILE=\"${{SCRIPT_DIR}}/run.log\"");
    // On a CUDA device the caching allocator runs as the candidate was
    // priced, and the log says what the ranks had (a CPU ignores both).
    super::allocator::launch_lines(&mut s, &candidate.config);
    let _ = writeln!(
        s,
        "\"$PYTHON\" -m torch.distributed.run --standalone --nproc-per-node {} \\",
        settings.ranks
    );
    let _ = writeln!(
        s,
        "    \"$SCRIPT_DIR/{WORKER_FILE}\" --job \"$SCRIPT_DIR/job.json\" >> \"${{LOG_FILE}}\" 2>&1"
    );
    s
}

/// Writes `candidate-N/{run.sh, job.json, torch_worker.py}` for each
/// candidate the worker can run; the others are skipped with the reason.
pub fn write_torch_scripts(
    plan: &PlanFile,
    settings: &TorchSettings,
    out_dir: &Path,
) -> Result<Vec<ScriptOutcome>, LaunchError> {
    check_ranks(plan, settings.ranks)?;
    let absolute = std::path::absolute(out_dir).map_err(|e| LaunchError::Write {
        path: out_dir.display().to_string(),
        message: e.to_string(),
    })?;
    let mut outcomes = Vec::with_capacity(plan.candidates.len());
    for candidate in &plan.candidates {
        let report_dir = absolute
            .join(format!("candidate-{}", candidate.rank))
            .join("report");
        let job = match trial_job(plan, candidate, settings, &report_dir) {
            Ok(job) => job,
            Err(LaunchError::Unsupported { rank, reason, .. }) => {
                outcomes.push(ScriptOutcome::Skipped { rank, reason });
                continue;
            }
            Err(other) => return Err(other),
        };
        let job_text = serde_json::to_string_pretty(&job).expect("a job serialises");
        let script = torch_script(plan, candidate, settings);
        let path = write_candidate(
            out_dir,
            candidate.rank,
            &script,
            &[("job.json", &job_text), (WORKER_FILE, WORKER_SOURCE)],
        )?;
        outcomes.push(ScriptOutcome::Written {
            rank: candidate.rank,
            path,
        });
    }
    Ok(outcomes)
}

/// The degrees a rank found in its live device mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Degrees {
    pub tp: u64,
    pub pp: u64,
    pub dp: u64,
    /// Context parallelism; a report without it (an older worker's) is cp 1.
    #[serde(default = "one")]
    pub cp: u64,
}

/// One rank's report, the fields paratune reads (the worker writes more).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    pub schema: u32,
    pub rank: u64,
    pub world_size: u64,
    pub degrees: Degrees,
    /// Model chunks this rank holds.
    pub stages: Vec<u64>,
    pub schedule: String,
    pub data_parallel: String,
    pub micro_batches: u64,
    pub iteration_ms: Vec<f64>,
    pub peak_memory_bytes: f64,
    pub memory_kind: String,
    #[serde(default)]
    pub reserved_bytes: Option<f64>,
    #[serde(default)]
    pub collectives_ms: BTreeMap<String, f64>,
    #[serde(default)]
    pub notes: Vec<String>,
    /// How the rank synchronised the token embedding, as applied; a report
    /// without it (an older worker's) is all-reduce.
    #[serde(default = "all_reduce")]
    pub embedding_sync: String,
    /// A mixture of experts' expert parallelism as the rank ran it; absent
    /// for a dense model.
    #[serde(default)]
    pub experts: Option<ExpertReport>,
    /// The key/value exchange the cp ranks ran (with cp 1, the planned name,
    /// unused); absent in an older worker's report.
    #[serde(default)]
    pub cp_comm: Option<String>,
}

/// What a rank of a mixture of experts reports of its experts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertReport {
    /// Degrees of the live expert mesh.
    pub ep: u64,
    pub etp: u64,
    pub edp: u64,
    /// Routed experts of each MoE layer this rank holds.
    pub local_experts: u64,
    pub dispatcher: String,
    /// Token copies the rank's experts received per training step (summed
    /// over its MoE layers and micro-batches; recomputation not counted),
    /// and that it sent to be routed.
    pub tokens_received_per_step: f64,
    pub tokens_sent_per_step: f64,
}

impl RankReport {
    /// The pipeline stage this rank runs (its first chunk's).
    pub fn stage(&self) -> u64 {
        self.stages.first().copied().unwrap_or(0) % self.degrees.pp.max(1)
    }
}

/// What a candidate's trial measured, over all its ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchTrial {
    pub ranks: Vec<RankReport>,
    /// Steady-state median of the iteration times (each the slowest
    /// rank's), and their mean, ms.
    pub median_ms: f64,
    pub mean_ms: f64,
    pub iterations: usize,
}

/// A trial that did not produce what it should have.
#[derive(Debug, thiserror::Error)]
pub enum TrialError {
    #[error("rank {rank} failed: {message}")]
    RankFailed { rank: u64, message: String },
    #[error("{path}: {message}")]
    Report { path: String, message: String },
    #[error(
        "rank {rank} ran tp{} cp{} pp{} dp{}, but the plan says tp{} cp{} pp{} dp{}: the worker did not run the candidate as planned",
        found.tp, found.cp, found.pp, found.dp, planned.tp, planned.cp, planned.pp, planned.dp
    )]
    DegreesDiffer {
        rank: u64,
        found: Degrees,
        planned: Degrees,
    },
    #[error(
        "rank {rank} synchronised the embedding by {found}, but the plan says {planned}: the worker did not run the candidate as planned"
    )]
    SyncDiffers {
        rank: u64,
        found: String,
        planned: String,
    },
    #[error(
        "rank {rank} ran {found}, but the plan says {planned}: the worker did not run the candidate as planned"
    )]
    ExpertsDiffer {
        rank: u64,
        found: String,
        planned: String,
    },
    #[error(
        "rank {rank} exchanged keys and values by {found}, but the plan says {planned}: the worker did not run the candidate as planned"
    )]
    ContextDiffers {
        rank: u64,
        found: String,
        planned: String,
    },
}

/// Checks a context-parallel rank's key/value exchange against `job`'s.
fn check_context(report: &RankReport, rank: u64, job: &TrialJob) -> Result<(), TrialError> {
    let planned = &job.parallel.cp_comm;
    if job.parallel.cp == 1 || report.cp_comm.as_ref() == Some(planned) {
        return Ok(());
    }
    Err(TrialError::ContextDiffers {
        rank,
        found: report
            .cp_comm
            .clone()
            .unwrap_or_else(|| "no exchange reported".into()),
        planned: planned.clone(),
    })
}

/// A rank's expert parallelism as [`TrialError::ExpertsDiffer`] names it.
fn experts_text(ep: u64, local: u64, dispatcher: &str) -> String {
    format!("ep{ep} with {local} experts a rank ({dispatcher} dispatch)")
}

/// Checks a rank's experts against `job`: a mixture of experts reports the
/// planned ep, its share of the experts and the dispatcher; a dense model
/// none.
fn check_experts(report: &RankReport, rank: u64, job: &TrialJob) -> Result<(), TrialError> {
    let p = &job.parallel;
    let planned = job
        .model
        .moe
        .map(|m| experts_text(p.ep, m.experts / p.ep.max(1), &p.moe_dispatcher));
    let found = report
        .experts
        .as_ref()
        .map(|e| experts_text(e.ep, e.local_experts, &e.dispatcher));
    if planned == found {
        return Ok(());
    }
    Err(TrialError::ExpertsDiffer {
        rank,
        found: found.unwrap_or_else(|| "no experts".into()),
        planned: planned.unwrap_or_else(|| "a dense model".into()),
    })
}

/// Reads every rank's report from `report_dir` and checks it against `job`.
pub fn read_trial(report_dir: &Path, job: &TrialJob) -> Result<TorchTrial, TrialError> {
    let p = &job.parallel;
    let world = p.tp * p.pp * p.dp * p.cp;
    let planned = Degrees {
        tp: p.tp,
        pp: p.pp,
        dp: p.dp,
        cp: p.cp,
    };
    let mut ranks = Vec::with_capacity(world as usize);
    for rank in 0..world {
        let failed = report_dir.join(format!("rank-{rank}.error.json"));
        if let Ok(text) = std::fs::read_to_string(&failed) {
            let message = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                .unwrap_or_else(|| "its error report does not read".into());
            return Err(TrialError::RankFailed { rank, message });
        }
        let path = report_dir.join(format!("rank-{rank}.json"));
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|e| TrialError::Report {
            path: shown.clone(),
            message: format!("no report ({e}); the rank died before the end, see run.log"),
        })?;
        let report: RankReport = serde_json::from_str(&text).map_err(|e| TrialError::Report {
            path: shown.clone(),
            message: format!("not a worker report ({e})"),
        })?;
        check_report(&report, rank, world, &shown)?;
        if report.degrees != planned {
            return Err(TrialError::DegreesDiffer {
                rank,
                found: report.degrees,
                planned,
            });
        }
        if report.embedding_sync != job.parallel.embedding_sync {
            return Err(TrialError::SyncDiffers {
                rank,
                found: report.embedding_sync,
                planned: job.parallel.embedding_sync.clone(),
            });
        }
        check_experts(&report, rank, job)?;
        check_context(&report, rank, job)?;
        ranks.push(report);
    }
    let times = &ranks[0].iteration_ms;
    let median_ms = super::megatron_log::median(times);
    let mean_ms = times.iter().sum::<f64>() / times.len() as f64;
    Ok(TorchTrial {
        median_ms,
        mean_ms,
        iterations: times.len(),
        ranks,
    })
}

/// A report read back is checked before anything is derived from it.
fn check_report(report: &RankReport, rank: u64, world: u64, path: &str) -> Result<(), TrialError> {
    let bad = |message: String| TrialError::Report {
        path: path.to_string(),
        message,
    };
    if report.schema != SCHEMA {
        return Err(bad(format!(
            "schema {}, this paratune reads {SCHEMA}",
            report.schema
        )));
    }
    if report.rank != rank || report.world_size != world {
        return Err(bad(format!(
            "rank {} of {}, expected rank {rank} of {world}",
            report.rank, report.world_size
        )));
    }
    if report.iteration_ms.is_empty()
        || report
            .iteration_ms
            .iter()
            .any(|t| !t.is_finite() || *t <= 0.0 || *t > 3.6e6)
    {
        return Err(bad(
            "`iteration_ms` must hold positive times of at most an hour".into(),
        ));
    }
    if !report.peak_memory_bytes.is_finite() || report.peak_memory_bytes < 0.0 {
        return Err(bad("`peak_memory_bytes` must be a byte count".into()));
    }
    Ok(())
}

/// A report rank 0 writes of a sweep (`comm.json`, `sync.json`), whose
/// schema version is checked on reading.
pub(crate) trait SweepReport: serde::de::DeserializeOwned {
    fn schema(&self) -> u32;
}

/// What is wrong with the report at `path`, as a [`TrialError::Report`].
pub(crate) fn report_error(path: &Path) -> impl Fn(String) -> TrialError + use<> {
    let shown = path.display().to_string();
    move |message| TrialError::Report {
        path: shown.clone(),
        message,
    }
}

/// The sweep report `report_dir/file_name`: read, parsed as `T` and its
/// schema checked, each failure a [`TrialError::Report`] naming the file.
pub(crate) fn read_report<T: SweepReport>(
    report_dir: &Path,
    file_name: &str,
) -> Result<T, TrialError> {
    let path = report_dir.join(file_name);
    let bad = report_error(&path);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| bad(format!("no sweep report ({e}); see the worker's log")))?;
    let report: T =
        serde_json::from_str(&text).map_err(|e| bad(format!("not a sweep report ({e})")))?;
    if report.schema() != SCHEMA {
        return Err(bad(format!(
            "schema {}, this paratune reads {SCHEMA}",
            report.schema()
        )));
    }
    Ok(report)
}

/// Columns of a torch trial's run row: paratune's run-table schema, every
/// switch of the configuration included, so that the row reads back as the
/// configuration that ran (a rerun resumes by it; the refit predicts it).
pub const ROW_COLUMNS: [&str; 52] = [
    "gpus",
    "global_batch",
    "micro_batch",
    "hidden",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "gated_mlp",
    "tied_embeddings",
    "first_stage_layers",
    "last_stage_layers",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_comm_overlap",
    "cuda_graphs",
    "stage_order",
    "layers",
    "seq_len",
    "vocab",
    "tp",
    "dp",
    "pp",
    "recompute",
    "sequence_parallel",
    "schedule",
    "virtual_stages",
    "bpipe",
    "attention",
    "optimizer_sharding",
    "iter_ms",
    "dropout",
    "engine",
    "compile",
    "ac_frequency",
    "dp_shard",
    "peak_allocated_gib",
    "memory_rank",
    "cp",
    "cp_comm",
    "ep",
    "etp",
    "num_experts",
    "moe_topk",
    "moe_ffn_hidden",
    "moe_shared_ffn_hidden",
    "moe_dense_layers",
    "moe_layer_freq",
    "moe_dispatcher",
    "embedding_sync",
    "iter_ms_mean",
    "steady_iterations",
    "source_log",
];

/// [`ROW_COLUMNS`] before the context-parallel columns (`cp`, `cp_comm`):
/// a history of such rows (none context-parallel) is rewritten with the new
/// columns on opening.
pub const ROW_COLUMNS_V2: [&str; 50] = without(&ROW_COLUMNS, CONTEXT_COLUMNS_AT);

/// [`ROW_COLUMNS_V2`] before the experts' columns: a history of such rows
/// (all of dense models) is rewritten with the new columns on opening.
pub const ROW_COLUMNS_V1: [&str; 41] = without(&ROW_COLUMNS_V2, EXPERT_COLUMNS_AT);

/// `columns` less the `N - M` of them from index `at`.
pub(crate) const fn without<const N: usize, const M: usize>(
    columns: &[&'static str; N],
    at: usize,
) -> [&'static str; M] {
    let mut out = [""; M];
    let mut i = 0;
    let mut j = 0;
    while i < N {
        if i < at || i >= at + (N - M) {
            out[j] = columns[i];
            j += 1;
        }
        i += 1;
    }
    out
}

/// Where `cp` and `cp_comm` sit, after `memory_rank`; the nine expert
/// columns follow them (at the same index of [`ROW_COLUMNS_V2`]), before
/// `embedding_sync`.
const CONTEXT_COLUMNS_AT: usize = 37;
const EXPERT_COLUMNS_AT: usize = 37;

impl TorchTrial {
    /// The largest peak over the ranks, bytes.
    pub fn peak_bytes(&self) -> f64 {
        self.ranks
            .iter()
            .map(|r| r.peak_memory_bytes)
            .fold(0.0, f64::max)
    }

    /// This trial as a row of [`ROW_COLUMNS`] for `config` of `plan`.
    /// `model` is the one that ran: the plan's, or it with fewer layers.
    pub fn row(
        &self,
        plan: &PlanFile,
        model: &crate::model::ModelSpec,
        config: &ParallelConfig,
        source: &str,
    ) -> Vec<String> {
        let m = model;
        let c = config;
        let on_off = |b: bool| crate::config::on_off(b).to_string();
        let optional = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
        // A dense model's expert cells stay empty (no experts; the
        // dispatcher's default); ep and etp are 1.
        let moe = |f: fn(&crate::model::MoeSpec) -> u64| optional(m.moe.as_ref().map(f));
        vec![
            plan.gpus.to_string(),
            plan.global_batch.to_string(),
            c.micro_batch.to_string(),
            m.hidden.to_string(),
            m.heads.to_string(),
            m.kv_heads.to_string(),
            m.ffn_hidden.to_string(),
            on_off(m.gated_mlp),
            on_off(m.tied_embeddings),
            optional(c.first_stage_layers),
            optional(c.last_stage_layers),
            on_off(c.overlap_grad_reduce),
            on_off(c.overlap_param_gather),
            on_off(c.tp_comm_overlap),
            c.cuda_graphs.name().to_string(),
            c.stage_order.name().to_string(),
            m.layers.to_string(),
            m.seq_len.to_string(),
            m.vocab.to_string(),
            c.tp.to_string(),
            c.dp.to_string(),
            c.pp.to_string(),
            c.recompute.name().to_string(),
            on_off(c.sequence_parallel),
            c.schedule.name().to_string(),
            c.virtual_stages.to_string(),
            on_off(c.bpipe),
            c.attention.name().to_string(),
            c.optimizer_sharding.name().to_string(),
            format!("{:.3}", self.median_ms),
            on_off(m.dropout),
            c.engine.name().to_string(),
            on_off(c.compile),
            c.ac_frequency.to_string(),
            optional(c.dp_shard),
            format!("{:.6}", self.peak_bytes() / (1u64 << 30) as f64),
            "max".into(),
            c.cp.to_string(),
            c.cp_comm.name().to_string(),
            c.ep.to_string(),
            c.etp.to_string(),
            moe(|m| m.experts),
            moe(|m| m.topk),
            moe(|m| m.ffn_hidden),
            moe(|m| m.shared_ffn_hidden),
            moe(|m| m.dense_layers),
            moe(|m| m.layer_freq),
            if m.moe.is_some() {
                c.dispatcher.name().to_string()
            } else {
                String::new()
            },
            c.embedding_sync.name().to_string(),
            format!("{:.3}", self.mean_ms),
            self.iterations.to_string(),
            source.to_string(),
        ]
    }

    /// The token copies each rank's experts received per step, fewest and
    /// most over the ranks that hold MoE layers, with the ep degree, the
    /// experts a rank holds and the dispatcher that brought them the tokens;
    /// `None` for a dense model.
    pub fn expert_tokens(&self) -> Option<(u64, u64, String, f64, f64)> {
        let experts: Vec<&ExpertReport> = self
            .ranks
            .iter()
            .filter_map(|r| r.experts.as_ref())
            .collect();
        let first = experts.first()?;
        let received = experts.iter().map(|e| e.tokens_received_per_step);
        let fewest = received.clone().fold(f64::INFINITY, f64::min);
        let most = received.fold(0.0, f64::max);
        Some((
            first.ep,
            first.local_experts,
            first.dispatcher.clone(),
            fewest,
            most,
        ))
    }

    /// The context parallelism the ranks ran: cp and the key/value
    /// exchange, `None` without.
    pub fn context(&self) -> Option<(u64, String)> {
        let first = self.ranks.first()?;
        (first.degrees.cp > 1)
            .then(|| (first.degrees.cp, first.cp_comm.clone().unwrap_or_default()))
    }

    /// Collective time per iteration by kind, averaged over the ranks, ms.
    pub fn collectives_ms(&self) -> BTreeMap<String, f64> {
        let mut sum: BTreeMap<String, f64> = BTreeMap::new();
        for r in &self.ranks {
            for (kind, ms) in &r.collectives_ms {
                *sum.entry(kind.clone()).or_default() += ms;
            }
        }
        let n = self.ranks.len().max(1) as f64;
        sum.into_iter().map(|(k, v)| (k, v / n)).collect()
    }
}

/// A collective sweep between the worker's ranks (`"mode": "comm"`):
/// `profile comm --ranks N` measures the links a machine's ranks talk over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommSweepJob {
    pub schema: u32,
    pub mode: String,
    pub device: TrialDevice,
    pub backend: String,
    pub threads_per_rank: u64,
    pub dtype: String,
    pub seed: u64,
    pub report_dir: PathBuf,
    pub comm: CommSweep,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommSweep {
    pub ops: Vec<String>,
    /// The full fp32 tensor of each op (all-gather's output, reduce-scatter's
    /// input), nccl-tests' size convention.
    pub sizes_bytes: Vec<u64>,
    pub warmup: u64,
    pub iterations: u64,
}

/// The worker's name of each collective.
fn worker_op(op: crate::profile::CollectiveOp) -> &'static str {
    use crate::profile::CollectiveOp::*;
    match op {
        AllReduce => "all_reduce",
        AllGather => "all_gather",
        ReduceScatter => "reduce_scatter",
        SendRecv => "send_recv",
    }
}

/// A sweep of every collective from 4 KiB up to `max_bytes`, doubling.
pub fn comm_sweep_job(
    device: TrialDevice,
    ranks: u64,
    max_bytes: u64,
    iterations: u64,
    report_dir: &Path,
) -> CommSweepJob {
    let mut sizes = Vec::new();
    // A multiple of 4 bytes per rank, so every op splits the tensor evenly.
    let mut size = 4096u64.max(4 * ranks).next_multiple_of(4 * ranks);
    while size <= max_bytes.max(4096) {
        sizes.push(size);
        size *= 2;
    }
    CommSweepJob {
        schema: SCHEMA,
        mode: "comm".into(),
        device,
        backend: device.backend().into(),
        threads_per_rank: 1,
        dtype: "fp32".into(),
        seed: 1234,
        report_dir: report_dir.to_path_buf(),
        comm: CommSweep {
            ops: crate::profile::CollectiveOp::ALL
                .iter()
                .map(|&op| worker_op(op).to_string())
                .collect(),
            sizes_bytes: sizes,
            warmup: 2,
            iterations: iterations.max(1),
        },
    }
}

#[derive(Deserialize)]
struct CommReport {
    schema: u32,
    points: Vec<CommReportPoint>,
}

impl SweepReport for CommReport {
    fn schema(&self) -> u32 {
        self.schema
    }
}

#[derive(Deserialize)]
struct CommReportPoint {
    op: String,
    ranks: u64,
    bytes: f64,
    seconds: f64,
}

/// The collective points of a sweep's `comm.json`, each checked.
pub fn read_comm(report_dir: &Path) -> Result<Vec<crate::profile::CollectivePoint>, TrialError> {
    const FILE: &str = "comm.json";
    let report: CommReport = read_report(report_dir, FILE)?;
    let bad = report_error(&report_dir.join(FILE));
    report
        .points
        .iter()
        .map(|p| {
            let op = crate::profile::CollectiveOp::ALL
                .into_iter()
                .find(|&op| worker_op(op) == p.op)
                .ok_or_else(|| bad(format!("unknown collective `{}`", p.op)))?;
            let point = crate::profile::CollectivePoint {
                op,
                ranks: p.ranks,
                bytes: p.bytes,
                seconds: p.seconds,
                busbw: crate::measure::bus_factor(op, p.ranks) * p.bytes / p.seconds / 1e9,
            };
            point.check().map_err(&bad)?;
            Ok(point)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coefficients::CostModel;
    use crate::config::{OptimizerSharding, Recompute};
    use crate::search::SearchSpace;
    use crate::validate::launch::tests::{bash_accepts, plan_on};

    fn settings(ranks: u64) -> TorchSettings {
        TorchSettings {
            python: PathBuf::from("/opt/py env/bin/python"),
            ranks,
            device: TrialDevice::Cpu,
            dtype: "bf16".into(),
            warmup: 2,
            iterations: 5,
            threads_per_rank: 1,
            memory_per_rank_bytes: None,
            cost: crate::coefficients::CostModel::datasheet(),
        }
    }

    /// GPT-3 13B on 8 A100s, planned for torchtitan without compile.
    fn plan(space: SearchSpace) -> PlanFile {
        plan_on(
            "gpt3-13b",
            1,
            8,
            64,
            SearchSpace {
                engine: Engine::Torchtitan,
                compile: Some(vec![false]),
                cuda_graphs: Some(vec![crate::config::CudaGraphs::Off]),
                tp_comm_overlap: Some(vec![false]),
                ..space
            },
        )
    }

    #[test]
    fn a_job_carries_the_planned_degrees_schedule_and_sharding() {
        let plan = plan(SearchSpace {
            tp: Some(vec![2]),
            pp: Some(vec![2]),
            schedule: Some(vec![ScheduleKind::Interleaved]),
            virtual_stages: Some(vec![2]),
            recompute: Some(vec![Recompute::Full]),
            optimizer_sharding: Some(vec![OptimizerSharding::Full]),
            ..SearchSpace::default()
        });
        let candidate = &plan.candidates[0];
        let c = candidate.config;
        let job = trial_job(&plan, candidate, &settings(8), Path::new("/r")).unwrap();
        let p = &job.parallel;
        assert_eq!((p.tp, p.pp, p.dp), (2, 2, 2));
        assert_eq!(p.schedule, "interleaved");
        assert_eq!(p.virtual_stages, 2);
        assert_eq!(p.recompute, "full");
        assert_eq!(p.optimizer_sharding, "full");
        assert_eq!(p.micro_batch, c.micro_batch);
        assert_eq!(p.global_batch, 64);
        // 40 layers in 4 chunks of 10, chunk c on pipeline rank c mod 2.
        assert_eq!(p.stage_layers, vec![10, 10, 10, 10]);
        assert_eq!(job.backend, "gloo");
        assert_eq!(job.model.layers, 40);
        assert_eq!(job.mode, "train");
    }

    #[test]
    fn a_candidate_too_big_for_the_machine_runs_fewer_layers_of_the_same_shape() {
        let plan = plan(SearchSpace {
            pp: Some(vec![2]),
            schedule: Some(vec![ScheduleKind::OneFOneB]),
            ..SearchSpace::default()
        });
        let candidate = plan
            .candidates
            .iter()
            .find(|c| !c.config.uneven())
            .expect("an evenly split candidate");
        let cost = CostModel::datasheet();
        let all = plan.model.layers;
        assert_eq!(layers_that_fit(&plan, candidate, &cost, None).unwrap(), all);
        let need = candidate.prediction.peak_allocated_bytes;
        let fewer = layers_that_fit(&plan, candidate, &cost, Some(need / 3.0)).unwrap();
        let chunk = candidate.config.pp * candidate.config.virtual_stages;
        assert!(
            fewer < all && fewer >= chunk && fewer.is_multiple_of(chunk),
            "{fewer}"
        );
        let e = layers_that_fit(&plan, candidate, &cost, Some(1e6))
            .unwrap_err()
            .to_string();
        assert!(e.contains("even") && e.contains("GiB"), "{e}");
        // The job carries the layers that fit, split over the chunks.
        let mut small = settings(8);
        small.memory_per_rank_bytes = Some(need / 3.0);
        let job = trial_job(&plan, candidate, &small, Path::new("/r")).unwrap();
        assert_eq!(job.model.layers, fewer);
        assert_eq!(job.parallel.stage_layers.iter().sum::<u64>(), fewer);
    }

    #[test]
    fn uneven_stages_are_one_chunk_each() {
        let c = ParallelConfig {
            pp: 4,
            first_stage_layers: Some(3),
            last_stage_layers: Some(5),
            ..plan(SearchSpace::default()).candidates[0].config
        };
        let layers = chunk_layers(&c, 24);
        assert_eq!(layers.len(), 4);
        assert_eq!(layers.iter().sum::<u64>(), 24);
        assert_eq!((layers[0], layers[3]), (3, 5));
    }

    #[test]
    fn what_the_worker_cannot_run_is_skipped_with_the_reason() {
        let planned = plan(SearchSpace::default());
        let model = planned.model.clone();
        let base = planned.candidates[0].config;
        let megatron = ParallelConfig {
            engine: Engine::Megatron,
            ..base
        };
        assert!(
            unsupported(&model, &megatron)
                .unwrap()
                .contains("--engine torchtitan")
        );
        let compiled = ParallelConfig {
            compile: true,
            ..base
        };
        assert!(
            unsupported(&model, &compiled)
                .unwrap()
                .contains("torch.compile")
        );
        let context = ParallelConfig { cp: 2, ..base };
        assert!(
            unsupported(&model, &context)
                .unwrap()
                .contains("context parallelism")
        );
        let mut experts = model.clone();
        experts.moe = crate::model::builtin_model("mixtral-8x7b").unwrap().moe;
        // Experts run (expert parallelism, all-to-all dispatch), split over
        // etp ranks too; what of them the worker does not run is refused
        // with the reason.
        let split = ParallelConfig {
            etp: 2,
            dp: 2,
            dispatcher: Dispatcher::AllToAll,
            ..base
        };
        assert_eq!(experts_unsupported(&experts, &split), None);
        assert_eq!(unsupported(&model, &base), None);
    }

    /// The plan's model with 8 experts of top-2 (the first layer dense),
    /// its leader as an expert-parallel candidate (tp 1, pp 1, dp 8, ep 4).
    fn moe_candidate() -> (PlanFile, PlannedCandidate) {
        let mut plan = plan(SearchSpace::default());
        plan.model.moe = Some(crate::model::MoeSpec {
            shared_ffn_hidden: 1024,
            dense_layers: 1,
            ..crate::model::MoeSpec::megatron_defaults(8, 2048)
        });
        let mut candidate = plan.candidates[0].clone();
        candidate.config = ParallelConfig {
            tp: 1,
            pp: 1,
            dp: 8,
            dp_shard: None,
            virtual_stages: 1,
            first_stage_layers: None,
            last_stage_layers: None,
            sequence_parallel: false,
            ep: 4,
            etp: 1,
            dispatcher: crate::config::Dispatcher::AllToAll,
            ..candidate.config
        };
        (plan, candidate)
    }

    #[test]
    fn a_job_carries_the_experts_and_what_the_worker_cannot_run_of_them_is_refused() {
        let (plan, candidate) = moe_candidate();
        let model = &plan.model;
        let c = candidate.config;
        assert_eq!(unsupported(model, &c), None);
        let job = trial_job(&plan, &candidate, &settings(8), Path::new("/r")).unwrap();
        assert_eq!(job.model.moe, model.moe);
        assert_eq!((job.parallel.ep, job.parallel.etp), (4, 1));
        assert_eq!(job.parallel.moe_dispatcher, "alltoall");
        // The worker reads the experts by the names paratune's MoeSpec has.
        let v = serde_json::to_value(&job).unwrap();
        let moe = &v["model"]["moe"];
        for (key, value) in [
            ("experts", 8),
            ("topk", 2),
            ("ffn_hidden", 2048),
            ("shared_ffn_hidden", 1024),
            ("dense_layers", 1),
            ("layer_freq", 1),
        ] {
            assert_eq!(moe[key], value, "{key}: {moe}");
        }
        assert_eq!(v["parallel"]["ep"], 4);
        // A dense job names no experts, and one without the fields (older)
        // reads back as ep 1, etp 1, all-to-all.
        let dense = plan_on_dense_job();
        let mut d = serde_json::to_value(&dense).unwrap();
        assert!(d["model"].get("moe").is_none(), "{}", d["model"]);
        for key in ["ep", "etp", "moe_dispatcher"] {
            d["parallel"].as_object_mut().unwrap().remove(key);
        }
        let old: TrialJob = serde_json::from_value(d).unwrap();
        assert_eq!((old.parallel.ep, old.parallel.etp), (1, 1));
        assert_eq!(old.parallel.moe_dispatcher, "alltoall");
        assert_eq!(old.model.moe, None);

        // What the worker does not run of a mixture of experts is refused, naming the key.
        let reason = |c: ParallelConfig| unsupported(model, &c).unwrap_or_default();
        // Split over etp ranks, beside cp, and beside tp with sequence
        // parallelism, the experts run
        // (whatever else the worker refuses is not about them).
        let context = ParallelConfig { cp: 2, dp: 4, ..c };
        assert_eq!(experts_unsupported(model, &context), None);
        let split = ParallelConfig { etp: 2, ..c };
        assert_eq!(experts_unsupported(model, &split), None);
        let tensor = ParallelConfig {
            tp: 2,
            dp: 4,
            sequence_parallel: false,
            ..c
        };
        assert!(
            reason(tensor).contains("`sequence_parallel on`"),
            "{}",
            reason(tensor)
        );
        let sequence = ParallelConfig {
            sequence_parallel: true,
            ..tensor
        };
        assert_eq!(experts_unsupported(model, &sequence), None);
        // The worker runs the allgather dispatcher, but only Megatron-LM plans
        // it, and the worker trials torchtitan's candidates.
        let gather = ParallelConfig {
            dispatcher: Dispatcher::AllGather,
            ..c
        };
        for engine in [Engine::Torchtitan, Engine::Megatron] {
            let gather = ParallelConfig { engine, ..gather };
            assert!(
                reason(gather).contains("--engine torchtitan")
                    && reason(gather).contains("`moe_dispatcher alltoall`"),
                "{}",
                reason(gather)
            );
        }
        let fp8 = ParallelConfig {
            precision: Precision::Fp8,
            ..c
        };
        assert!(reason(fp8).contains("FP8"), "{}", reason(fp8));
        // FP8 is refused for a dense model too: the worker computes in bf16.
        let dense_fp8 = ParallelConfig {
            precision: Precision::Fp8,
            ..dense_config()
        };
        assert!(
            unsupported(&plan_dense_model(), &dense_fp8)
                .unwrap()
                .contains("FP8")
        );
        let mut untied = model.clone();
        untied.tied_embeddings = false;
        let sparse = ParallelConfig {
            embedding_sync: SyncMethod::SparseAllGather,
            ..c
        };
        assert!(
            unsupported(&untied, &sparse).unwrap().contains("DDP"),
            "{:?}",
            unsupported(&untied, &sparse)
        );
    }

    fn plan_dense_model() -> crate::model::ModelSpec {
        plan(SearchSpace::default()).model
    }

    fn dense_config() -> ParallelConfig {
        plan(SearchSpace::default()).candidates[0].config
    }

    fn plan_on_dense_job() -> TrialJob {
        let plan = plan(SearchSpace::default());
        trial_job(&plan, &plan.candidates[0], &settings(8), Path::new("/r")).unwrap()
    }

    /// A report of `rank` of an expert-parallel trial: `ep` ranks of
    /// `local` experts each.
    fn expert_report(rank: u64, ep: u64, local: u64) -> serde_json::Value {
        let mut r = report(
            rank,
            Degrees {
                tp: 1,
                pp: 1,
                dp: 2,
                cp: 1,
            },
        );
        r["experts"] = serde_json::json!({
            "ep": ep, "etp": 1, "edp": 2 / ep, "local_experts": local, "dispatcher": "alltoall",
            "tokens_received_per_step": 500.0 + rank as f64 * 20.0, "tokens_sent_per_step": 512.0
        });
        r
    }

    #[test]
    fn the_columns_before_the_experts_are_the_new_ones_less_the_experts() {
        // V2: the columns before cp and cp_comm.
        let context = &ROW_COLUMNS[CONTEXT_COLUMNS_AT..CONTEXT_COLUMNS_AT + 2];
        assert_eq!(context, ["cp", "cp_comm"]);
        let before: Vec<&str> = ROW_COLUMNS
            .iter()
            .copied()
            .filter(|c| !context.contains(c))
            .collect();
        assert_eq!(before, ROW_COLUMNS_V2.to_vec());
        crate::runs::assert_row_columns_follow_the_schema(&ROW_COLUMNS_V2);
        let experts = &ROW_COLUMNS_V2[EXPERT_COLUMNS_AT..EXPERT_COLUMNS_AT + 9];
        assert_eq!(experts.first(), Some(&"ep"));
        assert_eq!(experts.last(), Some(&"moe_dispatcher"));
        let rest: Vec<&str> = ROW_COLUMNS_V2
            .iter()
            .copied()
            .filter(|c| !experts.contains(c))
            .collect();
        assert_eq!(rest, ROW_COLUMNS_V1.to_vec());
        assert_eq!(ROW_COLUMNS_V1[37], "embedding_sync");
    }

    #[test]
    fn a_rank_that_ran_other_experts_than_planned_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (plan, candidate) = moe_candidate();
        let mut job = trial_job(&plan, &candidate, &settings(8), dir.path()).unwrap();
        job.parallel.dp = 2;
        job.parallel.ep = 2;
        let write = |rank: u64, r: serde_json::Value| {
            std::fs::write(dir.path().join(format!("rank-{rank}.json")), r.to_string()).unwrap();
        };
        write(0, expert_report(0, 2, 4));
        write(1, expert_report(1, 2, 4));
        let trial = read_trial(dir.path(), &job).unwrap();
        assert_eq!(
            trial.expert_tokens(),
            Some((2, 4, "alltoall".into(), 500.0, 520.0))
        );
        // The run row holds the experts and their parallelism, in the schema's order.
        let c = ParallelConfig {
            ep: 2,
            dp: 2,
            ..candidate.config
        };
        let row = trial.row(&plan, &plan.model, &c, "log");
        let cell = |name: &str| &row[ROW_COLUMNS.iter().position(|&k| k == name).unwrap()];
        assert_eq!(
            (
                cell("ep").as_str(),
                cell("etp").as_str(),
                cell("num_experts").as_str()
            ),
            ("2", "1", "8")
        );
        assert_eq!(cell("moe_topk"), "2");
        assert_eq!(cell("moe_ffn_hidden"), "2048");
        assert_eq!(cell("moe_shared_ffn_hidden"), "1024");
        assert_eq!(cell("moe_dense_layers"), "1");
        assert_eq!(cell("moe_dispatcher"), "alltoall");
        crate::runs::assert_row_columns_follow_the_schema(&ROW_COLUMNS);
        // Another ep, or another share of the experts, did not run the plan.
        write(1, expert_report(1, 1, 8));
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 ran ep1 with 8 experts a rank")
                && e.contains("the plan says ep2 with 4 experts a rank"),
            "{e}"
        );
        // Nor did a rank that built no experts.
        let mut dense = expert_report(1, 2, 4);
        dense.as_object_mut().unwrap().remove("experts");
        write(1, dense);
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(e.contains("rank 1 ran no experts"), "{e}");
        // Nor did one that dispatched the tokens otherwise.
        let mut gathered = expert_report(1, 2, 4);
        gathered["experts"]["dispatcher"] = "allgather".into();
        write(1, gathered);
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 ran ep2 with 4 experts a rank (allgather dispatch)")
                && e.contains("the plan says ep2 with 4 experts a rank (alltoall dispatch)"),
            "{e}"
        );
        // A dense plan's ranks report none; a report of experts is refused.
        job.model.moe = None;
        job.parallel.ep = 1;
        write(0, expert_report(0, 2, 4));
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(e.contains("the plan says a dense model"), "{e}");
    }

    /// The plan's model without dropout, its leader as a context-parallel
    /// candidate (tp 1, pp 1, dp 4, cp 2, the p2p ring).
    fn cp_candidate() -> (PlanFile, PlannedCandidate) {
        let mut plan = plan(SearchSpace::default());
        plan.model.dropout = false;
        let mut candidate = plan.candidates[0].clone();
        candidate.config = ParallelConfig {
            tp: 1,
            pp: 1,
            dp: 4,
            cp: 2,
            cp_comm: CpComm::P2p,
            dp_shard: None,
            virtual_stages: 1,
            first_stage_layers: None,
            last_stage_layers: None,
            sequence_parallel: false,
            ..candidate.config
        };
        (plan, candidate)
    }

    #[test]
    fn a_job_carries_the_context_parallelism_and_what_the_worker_cannot_run_of_it_is_refused() {
        let (plan, candidate) = cp_candidate();
        let model = &plan.model;
        let c = candidate.config;
        assert_eq!(unsupported(model, &c), None);
        let job = trial_job(&plan, &candidate, &settings(8), Path::new("/r")).unwrap();
        assert_eq!((job.parallel.cp, job.parallel.cp_comm.as_str()), (2, "p2p"));
        let v = serde_json::to_value(&job).unwrap();
        assert_eq!(
            (&v["parallel"]["cp"], &v["parallel"]["cp_comm"]),
            (&2.into(), &"p2p".into())
        );
        // A job without the fields (older) reads back as cp 1 over the ring.
        let mut old = v.clone();
        for key in ["cp", "cp_comm"] {
            old["parallel"].as_object_mut().unwrap().remove(key);
        }
        let old: TrialJob = serde_json::from_value(old).unwrap();
        assert_eq!((old.parallel.cp, old.parallel.cp_comm.as_str()), (1, "p2p"));

        let reason = |model: &crate::model::ModelSpec, c: ParallelConfig| {
            unsupported(model, &c).unwrap_or_default()
        };
        let a2a = ParallelConfig {
            cp_comm: CpComm::A2a,
            ..c
        };
        assert_eq!(unsupported(model, &a2a), None);
        let job = trial_job(
            &plan,
            &PlannedCandidate {
                config: a2a,
                ..candidate.clone()
            },
            &settings(8),
            Path::new("/r"),
        )
        .unwrap();
        assert_eq!(job.parallel.cp_comm, "a2a");
        let allgather = ParallelConfig {
            cp_comm: CpComm::AllGather,
            ..c
        };
        assert_eq!(unsupported(model, &allgather), None);
        let job = trial_job(
            &plan,
            &PlannedCandidate {
                config: allgather,
                ..candidate.clone()
            },
            &settings(8),
            Path::new("/r"),
        )
        .unwrap();
        assert_eq!(job.parallel.cp_comm, "allgather");
        let tensor = ParallelConfig { tp: 2, dp: 2, ..c };
        assert_eq!(unsupported(model, &tensor), None);
        // Each stage's cp ranks run their own ring.
        let pipeline = ParallelConfig { pp: 2, dp: 2, ..c };
        assert_eq!(unsupported(model, &pipeline), None);
        let hsdp = ParallelConfig {
            dp_shard: Some(2),
            optimizer_sharding: OptimizerSharding::Full,
            ..c
        };
        assert!(
            reason(model, hsdp).contains("HSDP"),
            "{}",
            reason(model, hsdp)
        );
        let mut dropout = model.clone();
        dropout.dropout = true;
        assert!(
            reason(&dropout, c).contains("`dropout off`"),
            "{}",
            reason(&dropout, c)
        );
        // Experts beside cp: each cp rank routes its own tokens.
        let mut experts = model.clone();
        experts.moe = Some(crate::model::MoeSpec::megatron_defaults(8, 2048));
        let routed = ParallelConfig {
            dispatcher: Dispatcher::AllToAll,
            ..c
        };
        assert_eq!(unsupported(&experts, &routed), None);
        // FSDP shards over dp x cp: run.
        let sharded = ParallelConfig {
            optimizer_sharding: OptimizerSharding::Full,
            ..c
        };
        assert_eq!(unsupported(model, &sharded), None);
    }

    #[test]
    fn a_history_of_the_columns_before_cp_is_rewritten_and_reads_back_as_cp_1() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runs-history.csv");
        // A dense trial's row as the previous columns held it.
        let trial_dir = tempfile::tempdir().unwrap();
        let job = two_stage_job(trial_dir.path());
        let planned = Degrees {
            tp: 1,
            pp: 2,
            dp: 1,
            cp: 1,
        };
        for rank in 0..2 {
            let path = trial_dir.path().join(format!("rank-{rank}.json"));
            std::fs::write(path, report(rank, planned).to_string()).unwrap();
        }
        let trial = read_trial(trial_dir.path(), &job).unwrap();
        let plan = plan(SearchSpace::default());
        let row = trial.row(&plan, &plan.model, &plan.candidates[0].config, "log");
        let old: Vec<&str> = ROW_COLUMNS
            .iter()
            .zip(&row)
            .filter(|(c, _)| !["cp", "cp_comm"].contains(c))
            .map(|(_, v)| v.as_str())
            .collect();
        let text = format!("{}\n{}\n", ROW_COLUMNS_V2.join(","), old.join(","));
        std::fs::write(&path, text).unwrap();
        let (_, _, upgraded) = crate::runs::RunHistory::open_upgrading(
            &path,
            &ROW_COLUMNS,
            &[&ROW_COLUMNS_V1, &ROW_COLUMNS_V2],
        )
        .unwrap();
        assert!(upgraded);
        let written = std::fs::read_to_string(&path).unwrap();
        assert!(written.starts_with(&ROW_COLUMNS.join(",")), "{written}");
        let table = crate::runs::RunTable::read(&path).unwrap();
        assert_eq!(table.cell(0, "cp"), None);
        assert_eq!(table.cell(0, "tp"), Some(row[19].as_str()));
    }

    #[test]
    fn a_rank_that_ran_another_cp_or_exchange_than_planned_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (plan, candidate) = cp_candidate();
        let mut job = trial_job(&plan, &candidate, &settings(8), dir.path()).unwrap();
        job.parallel.dp = 1;
        let planned = Degrees {
            tp: 1,
            pp: 1,
            dp: 1,
            cp: 2,
        };
        let write = |rank: u64, degrees: Degrees, exchange: Option<&str>| {
            let mut r = report(rank, degrees);
            if let Some(exchange) = exchange {
                r["cp_comm"] = exchange.into();
            }
            std::fs::write(dir.path().join(format!("rank-{rank}.json")), r.to_string()).unwrap();
        };
        write(0, planned, Some("p2p"));
        write(1, planned, Some("p2p"));
        let trial = read_trial(dir.path(), &job).unwrap();
        assert_eq!(trial.context(), Some((2, "p2p".to_string())));
        // The run row holds cp and its exchange, in the schema's order.
        let c = ParallelConfig {
            dp: 1,
            ..candidate.config
        };
        let row = trial.row(&plan, &plan.model, &c, "log");
        let cell = |name: &str| &row[ROW_COLUMNS.iter().position(|&k| k == name).unwrap()];
        assert_eq!(
            (cell("cp").as_str(), cell("cp_comm").as_str()),
            ("2", "p2p")
        );
        crate::runs::assert_row_columns_follow_the_schema(&ROW_COLUMNS);
        // A rank that ran without context parallelism did not run the plan.
        write(1, Degrees { cp: 1, ..planned }, Some("p2p"));
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 ran tp1 cp1 pp1 dp1") && e.contains("the plan says tp1 cp2 pp1 dp1"),
            "{e}"
        );
        // Nor did one that exchanged keys and values otherwise, or said nothing of it.
        write(1, planned, Some("allgather"));
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 exchanged keys and values by allgather")
                && e.contains("the plan says p2p"),
            "{e}"
        );
        write(1, planned, None);
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(e.contains("no exchange reported"), "{e}");
        // A report of an older worker (no cp) reads as cp 1.
        let r: RankReport =
            serde_json::from_value(report(0, Degrees { cp: 1, ..planned })).unwrap();
        let mut v = serde_json::to_value(&r).unwrap();
        v["degrees"].as_object_mut().unwrap().remove("cp");
        let old: RankReport = serde_json::from_value(v).unwrap();
        assert_eq!(old.degrees.cp, 1);
    }

    /// The plan's leader as a DDP candidate (tp 1, pp 1, dp 8, no sharding)
    /// of the plan's model untied, syncing its embedding by `sync`.
    fn ddp_candidate(sync: SyncMethod) -> (PlanFile, PlannedCandidate) {
        let mut plan = plan(SearchSpace::default());
        plan.model.tied_embeddings = false;
        let mut candidate = plan.candidates[0].clone();
        candidate.config = ParallelConfig {
            tp: 1,
            pp: 1,
            dp: 8,
            dp_shard: None,
            virtual_stages: 1,
            first_stage_layers: None,
            last_stage_layers: None,
            sequence_parallel: false,
            optimizer_sharding: OptimizerSharding::None,
            embedding_sync: sync,
            ..candidate.config
        };
        (plan, candidate)
    }

    #[test]
    fn a_job_carries_the_embedding_sync_by_its_name() {
        for sync in [SyncMethod::AllReduce, SyncMethod::SparseAllGather] {
            let (plan, candidate) = ddp_candidate(sync);
            assert_eq!(unsupported(&plan.model, &candidate.config), None);
            let job = trial_job(&plan, &candidate, &settings(8), Path::new("/r")).unwrap();
            assert_eq!(job.parallel.embedding_sync, sync.name());
            let v = serde_json::to_value(&job).unwrap();
            assert_eq!(v["parallel"]["embedding_sync"], sync.name());
        }
        assert_eq!(SyncMethod::SparseAllGather.name(), "sparse-all-gather");
        // A job written before the field reads back as all-reduce.
        let (plan, candidate) = ddp_candidate(SyncMethod::SparseAllGather);
        let job = trial_job(&plan, &candidate, &settings(8), Path::new("/r")).unwrap();
        let mut v = serde_json::to_value(&job).unwrap();
        v["parallel"]
            .as_object_mut()
            .unwrap()
            .remove("embedding_sync");
        let old: TrialJob = serde_json::from_value(v).unwrap();
        assert_eq!(old.parallel.embedding_sync, "all-reduce");
    }

    #[test]
    fn sparse_syncs_the_worker_cannot_run_are_skipped_with_the_reason() {
        let (plan, candidate) = ddp_candidate(SyncMethod::SparseAllGather);
        let model = &plan.model;
        let base = candidate.config;
        let reason = |c: ParallelConfig| unsupported(model, &c).unwrap_or_default();
        let server = ParallelConfig {
            embedding_sync: SyncMethod::ParameterServer,
            ..base
        };
        assert!(
            reason(server).contains("runs no parameter server")
                && reason(server).contains("not trialled"),
            "{}",
            reason(server)
        );
        let tensor = ParallelConfig {
            tp: 2,
            dp: 4,
            ..base
        };
        assert!(
            reason(tensor).contains("tp 1 and pp 1"),
            "{}",
            reason(tensor)
        );
        let pipeline = ParallelConfig {
            pp: 2,
            dp: 4,
            ..base
        };
        assert!(reason(pipeline).contains("tp 1 and pp 1"));
        for sharding in [OptimizerSharding::OptimizerStates, OptimizerSharding::Full] {
            let sharded = ParallelConfig {
                optimizer_sharding: sharding,
                ..base
            };
            assert!(reason(sharded).contains("FSDP"), "{}", reason(sharded));
        }
        let alone = ParallelConfig { dp: 1, ..base };
        assert!(reason(alone).contains("dp > 1"), "{}", reason(alone));
        let mut tied = model.clone();
        tied.tied_embeddings = true;
        assert!(unsupported(&tied, &base).unwrap().contains("tied"));
        // All-reduce is run on every layout the worker runs.
        let dense = ParallelConfig {
            embedding_sync: SyncMethod::AllReduce,
            ..tensor
        };
        assert_eq!(unsupported(model, &dense), None);
        // NCCL has no sparse all-reduce: a GPU trial of it is skipped, a CPU one written.
        let mut cuda = settings(8);
        cuda.device = TrialDevice::Cuda;
        let e = trial_job(&plan, &candidate, &cuda, Path::new("/r"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("NCCL") && e.contains("--device cpu"), "{e}");
        let mut both = plan.clone();
        both.candidates = vec![
            candidate.clone(),
            PlannedCandidate {
                rank: 2,
                config: server,
                ..candidate.clone()
            },
        ];
        let dir = tempfile::tempdir().unwrap();
        let outcomes = write_torch_scripts(&both, &settings(8), dir.path()).unwrap();
        assert!(
            matches!(&outcomes[0], ScriptOutcome::Written { rank: 1, .. }),
            "{outcomes:?}"
        );
        assert!(
            matches!(&outcomes[1], ScriptOutcome::Skipped { rank: 2, reason } if reason.contains("parameter server")),
            "{outcomes:?}"
        );
    }

    #[test]
    fn ranks_must_match_the_plan() {
        let plan = plan(SearchSpace::default());
        let e = write_torch_scripts(&plan, &settings(4), Path::new("/nonexistent")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("--ranks 4") && text.contains("8 GPUs"),
            "{text}"
        );
    }

    #[test]
    fn scripts_quote_the_interpreter_and_parse() {
        let plan = plan(SearchSpace::default());
        let dir = tempfile::tempdir().unwrap();
        let outcomes = write_torch_scripts(&plan, &settings(8), dir.path()).unwrap();
        let ScriptOutcome::Written { path, .. } = &outcomes[0] else {
            panic!("{outcomes:?}")
        };
        let script = std::fs::read_to_string(path).unwrap();
        assert!(
            script.contains("PYTHON_DEFAULT='/opt/py env/bin/python'"),
            "{script}"
        );
        assert!(script.contains("--nproc-per-node 8"), "{script}");
        // The log starts with the allocator the ranks start with; the
        // launch appends to it.
        let recorded = script.find("paratune allocator: ").unwrap();
        let launched = script.find("-m torch.distributed.run").unwrap();
        assert!(recorded < launched, "{script}");
        assert!(
            script.contains("--job \"$SCRIPT_DIR/job.json\" >> \"${LOG_FILE}\" 2>&1"),
            "{script}"
        );
        bash_accepts(&script);
        let folder = path.parent().unwrap();
        assert_eq!(
            std::fs::read_to_string(folder.join(WORKER_FILE)).unwrap(),
            WORKER_SOURCE
        );
        let job: TrialJob =
            serde_json::from_str(&std::fs::read_to_string(folder.join("job.json")).unwrap())
                .unwrap();
        assert!(job.report_dir.is_absolute() && job.report_dir.ends_with("report"));
    }

    fn report(rank: u64, degrees: Degrees) -> serde_json::Value {
        serde_json::json!({
            "schema": 1, "rank": rank, "world_size": 2, "degrees": degrees,
            "stages": [rank], "schedule": "ScheduleGPipe", "data_parallel": "none",
            "micro_batches": 4, "iteration_ms": [10.0, 12.0, 11.0],
            "peak_memory_bytes": 1.0e6 * (rank + 1) as f64, "memory_kind": "rss-above-baseline",
            "collectives_ms": {"send": 1.0 + rank as f64}
        })
    }

    fn two_stage_job(dir: &Path) -> TrialJob {
        let plan = plan(SearchSpace::default());
        let mut job = trial_job(&plan, &plan.candidates[0], &settings(8), dir).unwrap();
        job.parallel.tp = 1;
        job.parallel.pp = 2;
        job.parallel.dp = 1;
        job
    }

    #[test]
    fn reports_are_read_checked_and_summarised() {
        let dir = tempfile::tempdir().unwrap();
        let job = two_stage_job(dir.path());
        let planned = Degrees {
            tp: 1,
            pp: 2,
            dp: 1,
            cp: 1,
        };
        for rank in 0..2 {
            let path = dir.path().join(format!("rank-{rank}.json"));
            std::fs::write(path, report(rank, planned).to_string()).unwrap();
        }
        let trial = read_trial(dir.path(), &job).unwrap();
        assert_eq!(trial.median_ms, 11.0);
        assert_eq!(trial.iterations, 3);
        assert_eq!(trial.peak_bytes(), 2.0e6);
        assert_eq!(trial.ranks[1].stage(), 1);
        assert_eq!(trial.collectives_ms()["send"], 1.5);
        let plan = plan(SearchSpace::default());
        let row = trial.row(&plan, &plan.model, &plan.candidates[0].config, "log");
        assert_eq!(row.len(), ROW_COLUMNS.len());
        crate::runs::assert_row_columns_follow_the_schema(&ROW_COLUMNS);

        // A rank that ran other degrees than planned is refused.
        let other = Degrees {
            tp: 2,
            pp: 1,
            dp: 1,
            cp: 1,
        };
        std::fs::write(dir.path().join("rank-1.json"), report(1, other).to_string()).unwrap();
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 ran tp2 cp1 pp1 dp1") && e.contains("tp1 cp1 pp2 dp1"),
            "{e}"
        );
        // A rank's own error is what the trial says.
        std::fs::write(
            dir.path().join("rank-0.error.json"),
            r#"{"schema": 1, "rank": 0, "error": "parallel.tp: 3 does not divide heads 4"}"#,
        )
        .unwrap();
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(e.contains("rank 0 failed: parallel.tp"), "{e}");
    }

    #[test]
    fn a_rank_that_synced_the_embedding_otherwise_than_planned_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (plan, candidate) = ddp_candidate(SyncMethod::SparseAllGather);
        let mut job = trial_job(&plan, &candidate, &settings(8), dir.path()).unwrap();
        job.parallel.dp = 2;
        let planned = Degrees {
            tp: 1,
            pp: 1,
            dp: 2,
            cp: 1,
        };
        let write = |rank: u64, sync: Option<&str>| {
            let mut r = report(rank, planned);
            if let Some(sync) = sync {
                r["embedding_sync"] = sync.into();
            }
            std::fs::write(dir.path().join(format!("rank-{rank}.json")), r.to_string()).unwrap();
        };
        write(0, Some("sparse-all-gather"));
        write(1, Some("sparse-all-gather"));
        let trial = read_trial(dir.path(), &job).unwrap();
        assert!(
            trial
                .ranks
                .iter()
                .all(|r| r.embedding_sync == "sparse-all-gather")
        );
        // The run row records the sync, so that it reads back as what ran.
        let row = trial.row(&plan, &plan.model, &candidate.config, "log");
        let at = ROW_COLUMNS
            .iter()
            .position(|&c| c == "embedding_sync")
            .unwrap();
        assert_eq!(row[at], "sparse-all-gather");
        // A rank that ran the dense all-reduce did not run the plan.
        write(1, Some("all-reduce"));
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 synchronised the embedding by all-reduce")
                && e.contains("the plan says sparse-all-gather"),
            "{e}"
        );
        // Nor did one of a worker that does not report the field (all-reduce).
        write(1, None);
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 synchronised the embedding by all-reduce"),
            "{e}"
        );
        // A dense plan reads such reports as all-reduce, as planned.
        write(0, None);
        job.parallel.embedding_sync = "all-reduce".into();
        assert!(read_trial(dir.path(), &job).is_ok());
        write(0, Some("sparse-all-gather"));
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(
            e.contains("rank 0 synchronised the embedding by sparse-all-gather"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_or_garbled_report_names_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let job = two_stage_job(dir.path());
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(e.contains("rank-0.json") && e.contains("run.log"), "{e}");
        let mut bad = report(
            0,
            Degrees {
                tp: 1,
                pp: 2,
                dp: 1,
                cp: 1,
            },
        );
        bad["iteration_ms"] = serde_json::json!([-1.0]);
        std::fs::write(dir.path().join("rank-0.json"), bad.to_string()).unwrap();
        let e = read_trial(dir.path(), &job).unwrap_err().to_string();
        assert!(e.contains("iteration_ms"), "{e}");
    }

    #[test]
    fn a_comm_sweep_reads_back_as_collective_points() {
        let dir = tempfile::tempdir().unwrap();
        let job = comm_sweep_job(TrialDevice::Cpu, 2, 1 << 20, 5, dir.path());
        assert_eq!(job.comm.sizes_bytes.first(), Some(&4096));
        assert_eq!(job.comm.sizes_bytes.last(), Some(&(1 << 20)));
        std::fs::write(
            dir.path().join("comm.json"),
            r#"{"schema": 1, "mode": "comm", "world_size": 2, "points": [
                {"op": "all_reduce", "ranks": 2, "bytes": 1000000, "seconds": 0.001, "samples": 5},
                {"op": "all_gather", "ranks": 2, "bytes": 1000000, "seconds": 0.001, "samples": 5}]}"#,
        )
        .unwrap();
        let points = read_comm(dir.path()).unwrap();
        // nccl-tests' bus bandwidth: 2(n-1)/n for all-reduce, (n-1)/n for all-gather.
        assert!((points[0].busbw - 1.0).abs() < 1e-9);
        assert!((points[1].busbw - 0.5).abs() < 1e-9);
        std::fs::write(
            dir.path().join("comm.json"),
            r#"{"schema": 1, "points": [{"op": "all_reduce", "ranks": 2, "bytes": 1000, "seconds": 0.0}]}"#,
        )
        .unwrap();
        assert!(read_comm(dir.path()).is_err());
    }
}
