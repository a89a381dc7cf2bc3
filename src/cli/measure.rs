//! `paratune profile layer`, `profile device` and `profile comm`: flags
//! into the measuring sweeps of `paratune::measure::sweeps`, with progress
//! bars; and the hidden `profile worker` that runs one measurement.

use super::args::{
    ProfileCommArgs, ProfileDeviceArgs, ProfileLayerArgs, RepetitionArgs, WorkerArgs,
};
use super::profile_dir::{open_profile, record_provenance};
use super::render::emit;
use super::resolve;
use anyhow::{Context, Result, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use paratune::cluster::catalogue_name as catalogue_gpu;
use paratune::measure::sweeps::{
    LayerSweep, Progress, measure_device_profile, peak_bandwidths, run_layer_sweep, run_nccl_sweep,
};
use paratune::measure::{
    self, CommJob, Device, DeviceJob, Dtype, LayerJob, LayerPass, MeasureError, StoppingRule,
    WorkerJob,
};
use paratune::profile::{CollectiveOp, merge_collectives, sweep_points, write_profile};
use paratune::validate::torch_launch;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

/// The hidden `profile worker` command: one measurement, one JSON line.
pub fn worker(args: &WorkerArgs) -> Result<()> {
    // libtorch reports errors by panicking through tch; the measurement
    // catches them and answers in JSON, so the default hook's backtrace
    // would only be noise. Anything uncaught still says what it was.
    std::panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("panic");
        let first = message.lines().next().unwrap_or(message);
        eprintln!("worker: {first}");
    }));
    let job: WorkerJob = serde_json::from_str(&args.job).context("--job is not a worker job")?;
    let reply = measure::run_worker_job(&job);
    println!("{}", serde_json::to_string(&reply)?);
    Ok(())
}

/// A measuring job's error with its field named as the flag that sets it
/// (ripgrep's rule: the library names the field, the CLI the flag).
pub fn flagged(e: MeasureError) -> anyhow::Error {
    match e {
        MeasureError::Invalid { field, message } => {
            anyhow!("--{}: {message}", field.replace('_', "-"))
        }
        MeasureError::NoCuda { .. } | MeasureError::NoSuchGpu { .. } => {
            anyhow!("{}", super::flags::with_flags(&e.to_string()))
        }
        other => other.into(),
    }
}

/// `--timeout` as a duration: positive seconds, at most a year.
pub fn timeout(seconds: f64) -> Result<Duration> {
    if !(seconds > 0.0 && seconds <= 365.0 * 86400.0) {
        bail!("--timeout {seconds}: give seconds between 0 and 31536000 (a year)");
    }
    Ok(Duration::from_secs_f64(seconds))
}

pub fn stopping_rule(args: &RepetitionArgs) -> Result<StoppingRule> {
    if !(args.target_ci > 0.0 && args.target_ci < 1.0) {
        bail!(
            "--target-ci {}: give a fraction between 0 and 1, e.g. 0.02 for 2%",
            args.target_ci
        );
    }
    if !(args.max_seconds > 0.0 && args.max_seconds.is_finite()) {
        bail!("--max-seconds {}: give a positive number", args.max_seconds);
    }
    Ok(StoppingRule {
        warmup: args.warmup,
        min_repetitions: 5.min(args.max_repetitions),
        max_repetitions: args.max_repetitions,
        target_ci_rel: args.target_ci,
        max_seconds: args.max_seconds,
    })
}

pub fn parse_device(text: &str) -> Result<Device> {
    text.parse().map_err(|e| anyhow!("--device: {e}"))
}

pub fn parse_dtype(text: &str) -> Result<Dtype> {
    text.parse().map_err(|e| anyhow!("--dtype: {e}"))
}

/// Fails early, before any work, when `--out` cannot take files.
pub fn check_writable(dir: &Path, flag: &str) -> Result<()> {
    std::fs::create_dir_all(dir)
        .and_then(|()| tempfile::NamedTempFile::new_in(dir).map(drop))
        .map_err(|e| {
            anyhow!(
                "{flag} {}: cannot write there ({e}); choose a directory you can write to",
                dir.display()
            )
        })
}

/// `--out` of a measuring sweep: writable, and not a damaged profile (which
/// stops the sweep before any work, left as it is).
pub(super) fn check_out(out: &Path) -> Result<()> {
    check_writable(out, "--out")?;
    if out.join(paratune::profile::ENVIRONMENT_FILE).is_file() {
        paratune::profile::read_profile(out)?;
    }
    Ok(())
}

/// The GPU name a new profile records: the driver's name where the `cuda`
/// feature can read it, `cpu` on the CPU.
fn detected_gpu(device: Device) -> Option<String> {
    match device {
        Device::Cpu => Some("cpu".to_string()),
        Device::Cuda(_) => measure::device_facts(device)
            .ok()
            .map(|f| catalogue_gpu(&f.name)),
    }
}

/// A sweep's progress as a terminal bar.
struct Bar {
    what: &'static str,
    bar: ProgressBar,
}

impl Bar {
    fn new(what: &'static str) -> Bar {
        Bar {
            what,
            bar: ProgressBar::hidden(),
        }
    }
}

impl Progress for Bar {
    fn start(&mut self, len: usize) {
        self.bar = ProgressBar::new(len as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} points, {elapsed} elapsed, ~{eta} left  {msg}",
        ) {
            self.bar.set_style(style.progress_chars("=> "));
        }
        self.bar.set_prefix(self.what);
    }
    fn point(&mut self, what: &str) {
        self.bar.set_message(what.to_string());
    }
    fn advance(&mut self) {
        self.bar.inc(1);
    }
    fn finish(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// A spinner for work with no points to count.
fn spinner(message: String) -> ProgressBar {
    let spinner = ProgressBar::new_spinner();
    spinner.set_message(message);
    spinner.enable_steady_tick(Duration::from_millis(200));
    spinner
}

pub fn profile_layer(args: &ProfileLayerArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let rule = stopping_rule(&args.repetitions)?;
    let model = resolve::model(&args.model)?;
    let sequence_parallel = resolve::switch_list("--sequence-parallel", &args.sequence_parallel)?;
    let jobs: Vec<_> = sweep_points(&args.micro_batch, &args.tp, &sequence_parallel)
        .into_iter()
        .map(|point| {
            let job = LayerJob {
                model: model.clone(),
                micro_batch: point.micro_batch,
                tp: point.tp,
                sequence_parallel: point.sequence_parallel,
                dtype,
                device,
                rule,
                memory_limit_bytes: args.memory_limit.map(|b| b.0),
                pass: LayerPass::TimesAndMemory,
            };
            (point, job)
        })
        .collect();
    if jobs.is_empty() {
        bail!(
            "--sequence-parallel on: sequence parallelism splits the sequence over tensor-parallel ranks; add a --tp of 2 or more, or off"
        );
    }
    for (_, job) in &jobs {
        measure::check_layer_job(job).map_err(flagged)?;
    }
    let out = &args.provenance.out;
    check_out(out)?;
    if !measure::TORCH_COMPILED {
        return Err(MeasureError::NotCompiled {
            what: "`profile layer`",
        }
        .into());
    }
    measure::check_device(device).map_err(flagged)?;
    let mut profile = open_profile(&args.provenance, detected_gpu(device).as_deref())?;
    let note = format!(
        "layer points with includes_tp_comm = false: one tensor-parallel shard timed alone on {device} by `paratune profile layer` (libtorch, no collectives, no dropout)"
    );
    record_provenance(&mut profile, &args.provenance, &[note]);

    let timeout = timeout(args.timeout)?;
    let sweep = LayerSweep {
        model: &model,
        dtype,
        jobs: &jobs,
        out,
        timeout,
    };
    let outcome = run_layer_sweep(&mut profile, &sweep, &mut Bar::new("profile layer"))?;
    emit(&outcome.report(jobs.len(), out, profile.layers.len()))?;
    if let Some(failure) = outcome.failure(out) {
        bail!("{failure}");
    }
    Ok(())
}

pub fn profile_device(args: &ProfileDeviceArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let rule = stopping_rule(&args.repetitions)?;
    let out = &args.provenance.out;
    check_out(out)?;
    measure::check_device(device).map_err(flagged)?;
    let facts = match device {
        Device::Cpu => None,
        Device::Cuda(_) => match measure::device_facts(device) {
            Ok(facts) => Some(facts),
            Err(MeasureError::NotCompiledCuda { .. }) => None,
            Err(e) => return Err(flagged(e)),
        },
    };
    if !measure::TORCH_COMPILED {
        return Err(MeasureError::NotCompiled {
            what: "`profile device` (matrix multiplies and copies)",
        }
        .into());
    }
    let mut profile = open_profile(&args.provenance, detected_gpu(device).as_deref())?;
    let job = DeviceJob {
        device,
        dtype,
        max_side: args.max_side,
        copy_bytes: if device.is_cuda() { 1 << 30 } else { 64 << 20 },
        attention_seq: args
            .attention_seq
            .unwrap_or(if device.is_cuda() { 8192 } else { 512 }),
        rule,
    };
    measure::check_device_job(&job).map_err(flagged)?;
    let spinner = spinner(format!(
        "profile device: matrix multiplies, a copy and fused attention on {device}"
    ));
    let measured = measure_device_profile(job, facts);
    spinner.finish_and_clear();
    let (device_profile, mut report) = measured?;
    profile.device = Some(device_profile);
    record_provenance(&mut profile, &args.provenance, &[]);
    write_profile(out, &profile)?;
    let _ = writeln!(report, "{}: device.toml written", out.display());
    emit(&report)
}

/// `profile comm --ranks N`: every collective between N ranks of
/// torch.distributed (gloo on the CPU), through the shipped worker, saved
/// as collective points.
fn profile_comm_torch(args: &ProfileCommArgs, ranks: u64) -> Result<()> {
    use paratune::validate::torch_launch::TrialDevice;
    let device = local_ranks(&args.device, ranks, "--ranks runs", "a collective")?;
    let timeout = timeout(args.timeout)?;
    let out = &args.provenance.out;
    check_out(out)?;
    let detected = (device == TrialDevice::Cpu).then_some("cpu");
    let mut profile = open_profile(&args.provenance, detected)?;
    let scratch = tempfile::tempdir()?;
    let dir = std::path::absolute(scratch.path())?;
    // A fixed count, not the stopping rule: the ranks must agree on it.
    let iterations = args.repetitions.max_repetitions.min(10) as u64;
    let job =
        torch_launch::comm_sweep_job(device, ranks, args.max_bytes.0 as u64, iterations, &dir);
    let label = format!("profile comm --ranks {ranks}");
    run_worker(&args.python, ranks, &job, &dir, timeout, &label)?;
    let points = torch_launch::read_comm(&dir)
        .map_err(|e| torch_launch::worker_failure(&label, &e.to_string(), &dir))?;
    record_provenance(
        &mut profile,
        &args.provenance,
        &[format!(
            "collectives: torch.distributed ({}) between {ranks} local ranks (`paratune profile comm --ranks {ranks}`), fp32, median of {iterations} per size, nccl-tests' size and bus-bandwidth conventions",
            device.backend()
        )],
    );
    merge_collectives(&mut profile.collectives, &points);
    write_profile(out, &profile)?;
    emit(&peak_bandwidths(
        &points,
        "ranks",
        out,
        profile.collectives.len(),
    ))
}

/// The device of `ranks` local torch.distributed ranks, checked: cpu or
/// cuda, at least two ranks (`what` needs them), at most what this
/// machine's cores run. `runs` is the message's subject for a bad device.
pub(super) fn local_ranks(
    device: &str,
    ranks: u64,
    runs: &str,
    what: &str,
) -> Result<paratune::validate::torch_launch::TrialDevice> {
    use paratune::validate::torch_launch::{self, TrialDevice};
    let device = match device {
        "cpu" => TrialDevice::Cpu,
        d if d == "cuda" || d.starts_with("cuda:") => TrialDevice::Cuda,
        other => bail!("--device {other}: {runs} on cpu or cuda"),
    };
    if ranks < 2 {
        bail!("--ranks {ranks}: {what} needs at least 2 ranks");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    if ranks > torch_launch::max_ranks(cores) {
        bail!(
            "--ranks {ranks}: this machine has {cores} cores and runs at most {} ranks (two per core)",
            torch_launch::max_ranks(cores)
        );
    }
    Ok(device)
}

/// Runs the shipped torch.distributed worker between `ranks` local
/// processes, with a spinner while they run.
pub(super) fn run_worker(
    python: &Path,
    ranks: u64,
    job: &impl serde::Serialize,
    dir: &Path,
    timeout: Duration,
    label: &str,
) -> Result<()> {
    let spinner = spinner(format!("{label}: {ranks} ranks of torch.distributed"));
    let ran = torch_launch::run_local_worker(python, ranks, job, dir, timeout, label);
    spinner.finish_and_clear();
    Ok(ran?)
}

pub fn profile_comm(args: &ProfileCommArgs) -> Result<()> {
    if let Some(ranks) = args.ranks {
        return profile_comm_torch(args, ranks);
    }
    let job = CommJob {
        gpus: args.gpus.clone(),
        ops: CollectiveOp::ALL.to_vec(),
        max_bytes: args.max_bytes.0 as u64,
        rule: stopping_rule(&args.repetitions)?,
    };
    measure::check_comm_job(&job).map_err(flagged)?;
    let timeout = timeout(args.timeout)?;
    let out = &args.provenance.out;
    check_out(out)?;
    if !measure::CUDA_COMPILED {
        return Err(MeasureError::NotCompiledCuda {
            what: "`profile comm` (NCCL collectives)",
        }
        .into());
    }
    for &gpu in &job.gpus {
        measure::check_device(Device::Cuda(gpu)).map_err(flagged)?;
    }
    let detected = detected_gpu(Device::Cuda(job.gpus[0]));
    let mut profile = open_profile(&args.provenance, detected.as_deref())?;
    record_provenance(
        &mut profile,
        &args.provenance,
        &[format!(
            "collectives: NCCL over GPUs {:?} in one process (`paratune profile comm`), out-of-place fp32, nccl-tests' size and bus-bandwidth conventions",
            job.gpus
        )],
    );
    let points = run_nccl_sweep(
        &mut profile,
        &job,
        out,
        timeout,
        &mut Bar::new("profile comm"),
    )?;
    emit(&peak_bandwidths(
        &points,
        "GPUs",
        out,
        profile.collectives.len(),
    ))
}
