//! `paratune profile layer` (and the other measuring sweeps): run each point
//! in a fresh worker process (this binary, `profile worker --job JSON`),
//! save the profile after every finished point, show progress.

use super::args::{
    ProfileCommArgs, ProfileDeviceArgs, ProfileLayerArgs, RepetitionArgs, WorkerArgs,
};
use super::profile_dir::{open_profile, record_provenance};
use super::render::emit;
use super::resolve;
use anyhow::{Context, Result, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use paratune::cluster::catalogue_name as catalogue_gpu;
use paratune::measure::process::{nccl_library_env, spawn_worker, spawn_worker_with_env};
use paratune::measure::{
    self, CommJob, Device, DeviceJob, Dtype, LayerJob, LayerMeasurement, LayerPass, MeasureError,
    StoppingRule, WorkerJob, WorkerReply,
};
use paratune::profile::{
    CollectiveOp, DeviceProfile, LayerStatus, is_measured, layer_points, merge_collectives,
    merge_layers, sweep_points, write_profile,
};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

const MIB: f64 = 1024.0 * 1024.0;

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

/// `--timeout` as a duration: positive seconds, at most a year.
/// A measuring job's error with its field named as the flag that sets it
/// (ripgrep's rule: the library names the field, the CLI the flag).
pub fn flagged(e: MeasureError) -> anyhow::Error {
    match e {
        MeasureError::Invalid { field, message } => {
            anyhow!("--{}: {message}", field.replace('_', "-"))
        }
        other => other.into(),
    }
}

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

fn progress(len: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix} [{bar:30}] {pos}/{len} points, {elapsed} elapsed, ~{eta} left  {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what.to_string());
    bar
}

/// One layer point: times and memory in one worker; on CUDA, the
/// activation bytes again in a second worker with PyTorch's caching
/// allocator off, since with it on the driver's used memory after the
/// forward also holds the temporaries the forward freed into the cache.
/// The peak stays the first worker's: the reserved high-water mark, what
/// training with the caching allocator needs. A second worker that fails
/// leaves the first worker's reading and says so.
fn measure_layer(
    job: &LayerJob,
    timeout: Duration,
) -> Result<(LayerMeasurement, Option<String>), String> {
    let mut m = match spawn_worker(&WorkerJob::Layer(job.clone()), timeout)? {
        WorkerReply::Layer(m) => m,
        WorkerReply::Error(message) => return Err(message),
        other => return Err(format!("unexpected worker reply {other:?}")),
    };
    if matches!(job.device, Device::Cuda(_)) && !m.out_of_memory {
        let memory_job = LayerJob {
            pass: LayerPass::MemoryOnly,
            ..job.clone()
        };
        let uncached = [("PYTORCH_NO_CUDA_MEMORY_CACHING", "1".to_string())];
        match spawn_worker_with_env(&WorkerJob::Layer(memory_job), timeout, &uncached) {
            Ok(WorkerReply::Layer(memory)) if memory.activation_bytes.is_some() => {
                m.activation_bytes = memory.activation_bytes;
            }
            failed => {
                let why = match failed {
                    Ok(WorkerReply::Error(e)) | Err(e) => e,
                    _ => "no reading".to_string(),
                };
                let note = format!(
                    "note: tp {} micro-batch {}: activations are the caching allocator's reading (reserved blocks), the uncached pass failed: {why}",
                    job.tp, job.micro_batch
                );
                return Ok((m, Some(note)));
            }
        }
    }
    Ok((m, None))
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
    measure::check_device(device)?;
    let mut profile = open_profile(&args.provenance, detected_gpu(device).as_deref())?;
    let note = format!(
        "layer points with includes_tp_comm = false: one tensor-parallel shard timed alone on {device} by `paratune profile layer` (libtorch, no collectives, no dropout)"
    );
    record_provenance(&mut profile, &args.provenance, &[note]);

    let pending: Vec<_> = jobs
        .iter()
        .filter(|(point, _)| !is_measured(&profile, &model, dtype, *point))
        .collect();
    let resumed = jobs.len() - pending.len();
    let mut report = String::new();
    if resumed > 0 {
        let _ = writeln!(
            report,
            "resumed: {resumed} of {} points are already in {} and were not measured again",
            jobs.len(),
            out.display()
        );
    }
    let timeout = timeout(args.timeout)?;
    let bar = progress(pending.len(), "profile layer");
    let mut measured = Vec::new();
    let mut failures = Vec::new();
    for (point, job) in pending {
        let sp = if point.sequence_parallel { " sp" } else { "" };
        bar.set_message(format!(
            "tp {}{sp} micro-batch {}",
            point.tp, point.micro_batch
        ));
        match measure_layer(job, timeout) {
            Ok((m, note)) => {
                if let Some(note) = note {
                    let _ = writeln!(report, "{note}");
                }
                merge_layers(
                    &mut profile.layers,
                    &layer_points(&model, dtype, *point, &m),
                );
                // Saved after every point: an interrupted sweep loses nothing finished.
                write_profile(out, &profile)?;
                measured.push((*point, m));
            }
            Err(message) => failures.push((*point, message)),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if measured.is_empty() && failures.is_empty() {
        write_profile(out, &profile)?;
    }
    report.push_str(&layer_table(&measured));
    let _ = writeln!(
        report,
        "{}: {} layer points in all",
        out.display(),
        profile.layers.len()
    );
    emit(&report)?;
    if !failures.is_empty() {
        let list: Vec<String> = failures
            .iter()
            .map(|(p, why)| {
                let sp = if p.sequence_parallel { " sp" } else { "" };
                format!("tp {}{sp} micro-batch {}: {why}", p.tp, p.micro_batch)
            })
            .collect();
        bail!(
            "{} of the points failed ({}); the finished points are saved in {}: rerun the same command to retry the rest",
            failures.len(),
            list.join("; "),
            out.display()
        );
    }
    Ok(())
}

fn layer_table(rows: &[(paratune::profile::SweepPoint, measure::LayerMeasurement)]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut text = String::from(
        "  tp  sp   micro-batch  forward ms  backward ms  fwd (no grad) ms  ±95%  reps  activations MiB  peak MiB  status\n",
    );
    let mib = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1}", v / MIB));
    for (p, m) in rows {
        let status = if m.out_of_memory {
            LayerStatus::Oom
        } else {
            LayerStatus::Ok
        };
        let _ = writeln!(
            text,
            "{:>4}  {:<3}  {:>11}  {:>10.3}  {:>11.3}  {:>16.3}  {:>4}  {:>4}  {:>15}  {:>8}  {}",
            p.tp,
            if p.sequence_parallel { "on" } else { "off" },
            p.micro_batch,
            m.forward_s * 1e3,
            m.backward_s * 1e3,
            m.forward_no_grad_s * 1e3,
            m.ci95_rel
                .map_or("-".to_string(), |c| format!("{:.1}%", c * 100.0)),
            m.repetitions,
            mib(m.activation_bytes),
            mib(m.peak_bytes),
            status.name()
        );
    }
    text
}

pub fn profile_device(args: &ProfileDeviceArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let rule = stopping_rule(&args.repetitions)?;
    let out = &args.provenance.out;
    check_out(out)?;
    measure::check_device(device)?;
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
        rule,
    };
    measure::check_device_job(&job).map_err(flagged)?;
    let spinner = ProgressBar::new_spinner();
    spinner.set_message(format!(
        "profile device: matrix multiplies and a copy on {device}"
    ));
    spinner.enable_steady_tick(Duration::from_millis(200));
    let reply = spawn_worker(&WorkerJob::Device(job), Duration::from_secs(3600));
    spinner.finish_and_clear();
    let measured = match reply {
        Ok(WorkerReply::Device(m)) => m,
        Ok(WorkerReply::Error(e)) | Err(e) => bail!("profile device on {device}: {e}"),
        Ok(other) => bail!("unexpected worker reply {other:?}"),
    };
    let mut report = String::new();
    if let Some(f) = &facts {
        let _ = writeln!(
            report,
            "{} (cuda:{}): {:.1} GiB, {} SMs at {:.0} MHz, compute capability {}, memory {:.0} MHz x {} bits, driver {}",
            f.name,
            f.index,
            f.memory_bytes / 1024f64.powi(3),
            f.multiprocessors,
            f.sm_clock_mhz,
            f.compute_capability,
            f.memory_clock_mhz,
            f.memory_bus_bits,
            f.driver_version
        );
    }
    let _ = writeln!(
        report,
        "{}; {} matrix multiplies:",
        measured.runtime,
        dtype.name()
    );
    let _ = writeln!(report, "  side        ms   TFLOP/s   ±95%");
    for p in &measured.matmul {
        let _ = writeln!(
            report,
            "{:>6}  {:>8.3}  {:>8.2}  {:>5}",
            p.m,
            p.seconds * 1e3,
            p.tflops,
            p.ci95_rel
                .map_or("-".into(), |c| format!("{:.1}%", c * 100.0))
        );
    }
    let _ = writeln!(
        report,
        "copy of {:.0} MiB: {:.1} GB/s (read + write)",
        measured.copy.bytes as f64 / MIB,
        measured.copy.gbps
    );
    profile.device = Some(DeviceProfile {
        device: device.to_string(),
        facts,
        matmul: measured.matmul,
        copy: Some(measured.copy),
        runtime: measured.runtime,
        host_memory_bytes: host_memory_bytes(),
    });
    record_provenance(&mut profile, &args.provenance, &[]);
    write_profile(out, &profile)?;
    let _ = writeln!(report, "{}: device.toml written", out.display());
    emit(&report)
}

/// `profile comm --ranks N`: every collective between N ranks of
/// torch.distributed (gloo on the CPU), through the shipped worker, saved
/// as collective points.
fn profile_comm_torch(args: &ProfileCommArgs, ranks: u64) -> Result<()> {
    use paratune::validate::torch_launch::{self, TrialDevice};
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
    let points =
        torch_launch::read_comm(&dir).map_err(|e| worker_failure(&label, &e.to_string(), &dir))?;
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

/// Runs the shipped torch.distributed worker on `job` between `ranks`
/// local processes (torchrun), in `dir`, killed after `timeout`.
pub(super) fn run_worker(
    python: &Path,
    ranks: u64,
    job: &impl serde::Serialize,
    dir: &Path,
    timeout: Duration,
    label: &str,
) -> Result<()> {
    use paratune::validate::torch_launch;
    let job_path = dir.join("job.json");
    paratune::atomic::write_atomically(&job_path, serde_json::to_string_pretty(job)?.as_bytes())?;
    let worker = dir.join(torch_launch::WORKER_FILE);
    paratune::atomic::write_atomically(&worker, torch_launch::WORKER_SOURCE.as_bytes())?;
    let log = dir.join("run.log");
    let script = dir.join("run.sh");
    let quote = |p: &Path| paratune::text::shell_quote(&p.display().to_string());
    let text = format!(
        "set -euo pipefail\nexport OMP_NUM_THREADS=1\n{} -m torch.distributed.run --standalone --nproc-per-node {ranks} {} --job {} > {} 2>&1\n",
        quote(python),
        quote(&worker),
        quote(&job_path),
        quote(&log)
    );
    paratune::atomic::write_atomically(&script, text.as_bytes())?;
    let spinner = ProgressBar::new_spinner();
    spinner.set_message(format!("{label}: {ranks} ranks of torch.distributed"));
    spinner.enable_steady_tick(Duration::from_millis(200));
    let ran = paratune::measure::process::run_script(&script, timeout);
    spinner.finish_and_clear();
    ran.map_err(|why| worker_failure(label, &why.to_string(), dir))
}

/// A worker that failed, with the last line of its log.
pub(super) fn worker_failure(label: &str, why: &str, dir: &Path) -> anyhow::Error {
    let tail = std::fs::read_to_string(dir.join("run.log")).unwrap_or_default();
    let last = tail
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    anyhow::anyhow!("{label}: {why}; the worker's last line: {last}")
}

/// The host's physical memory (`sysconf`), what CPU ranks share.
pub fn host_memory_bytes() -> Option<f64> {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page > 0).then_some(pages as f64 * page as f64)
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
        measure::check_device(Device::Cuda(gpu))?;
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
    // One worker per collective, saved after each: a hang costs one
    // collective (killed after --timeout), an interruption loses none
    // finished, and a rerun skips the collectives already measured.
    let ranks = job.gpus.len() as u64;
    let pending: Vec<CollectiveOp> = CollectiveOp::ALL
        .into_iter()
        .filter(|&op| {
            !profile
                .collectives
                .iter()
                .any(|p| p.op == op && p.ranks == ranks)
        })
        .collect();
    let scratch = tempfile::tempdir()?;
    let env = nccl_library_env(scratch.path());
    let bar = progress(pending.len(), "profile comm");
    let mut points = Vec::new();
    let mut failures = Vec::new();
    for op in pending {
        bar.set_message(format!("{op} over {ranks} GPUs"));
        let one = CommJob {
            ops: vec![op],
            ..job.clone()
        };
        match spawn_worker_with_env(&WorkerJob::Comm(one), timeout, &env) {
            Ok(WorkerReply::Comm(measured)) => {
                merge_collectives(&mut profile.collectives, &measured);
                write_profile(out, &profile)?;
                points.extend(measured);
            }
            Ok(WorkerReply::Error(e)) | Err(e) => failures.push(format!("{op}: {e}")),
            Ok(other) => failures.push(format!("{op}: unexpected worker reply {other:?}")),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    if !failures.is_empty() {
        bail!(
            "{} collective(s) failed ({}); the others are saved in {}: rerun to retry",
            failures.len(),
            failures.join("; "),
            out.display()
        );
    }
    write_profile(out, &profile)?;
    emit(&peak_bandwidths(
        &points,
        "GPUs",
        out,
        profile.collectives.len(),
    ))
}

/// Each collective's best bus bandwidth among `points`, and the profile's
/// size.
fn peak_bandwidths(
    points: &[paratune::profile::CollectivePoint],
    over: &str,
    out: &Path,
    saved: usize,
) -> String {
    let mut report = String::new();
    for op in CollectiveOp::ALL {
        if let Some(best) = points
            .iter()
            .filter(|p| p.op == op)
            .max_by(|a, b| a.busbw.total_cmp(&b.busbw))
        {
            let _ = writeln!(
                report,
                "{op} over {} {over}: peak bus bandwidth {:.2} GB/s at {:.1} MiB",
                best.ranks,
                best.busbw,
                best.bytes / MIB
            );
        }
    }
    let _ = writeln!(report, "{}: {saved} collective points", out.display());
    report
}
