//! The measuring sweeps the `profile` commands run: each point in a fresh
//! worker process, the profile saved after every finished point (an
//! interrupted sweep loses nothing finished, a rerun skips what is saved),
//! and the report of what was measured. The terminal's progress bar comes
//! in through [`Progress`], so the sweeps know nothing of the terminal.

use super::process::{nccl_library_env, spawn_worker, spawn_worker_with_env};
use super::{
    CommJob, Device, DeviceFacts, DeviceJob, Dtype, LayerJob, LayerMeasurement, LayerPass,
    MeasureError, WorkerJob, WorkerReply,
};
use crate::model::ModelSpec;
use crate::profile::{
    CollectiveOp, CollectivePoint, DeviceProfile, LayerStatus, Profile, SweepPoint, is_measured,
    layer_points, merge_collectives, merge_layers, write_profile,
};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

const MIB: f64 = 1024.0 * 1024.0;

/// How a sweep tells its caller where it is.
pub trait Progress {
    /// The sweep has `len` points left to measure.
    fn start(&mut self, _len: usize) {}
    /// The point now measured.
    fn point(&mut self, _what: &str) {}
    /// One more point finished (measured or failed).
    fn advance(&mut self) {}
    /// The sweep is over.
    fn finish(&mut self) {}
}

/// A sweep nobody watches.
pub struct Unwatched;

impl Progress for Unwatched {}

/// One layer point: times and memory in one worker; on CUDA, the
/// activation bytes again in a second worker with PyTorch's caching
/// allocator off, since with it on the driver's used memory after the
/// forward also holds the temporaries the forward freed into the cache.
/// The peak stays the first worker's: the reserved high-water mark, what
/// training with the caching allocator needs. A second worker that fails
/// leaves the first worker's reading and says so.
fn measure_layer_point(
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

/// A layer sweep: its points with their jobs, where it saves, and how long
/// one worker may take.
pub struct LayerSweep<'a> {
    pub model: &'a ModelSpec,
    pub dtype: Dtype,
    pub jobs: &'a [(SweepPoint, LayerJob)],
    pub out: &'a Path,
    pub timeout: Duration,
}

/// What a layer sweep did.
#[derive(Debug, Default)]
pub struct LayerSweepOutcome {
    /// Points already in the profile, not measured again.
    pub resumed: usize,
    pub notes: Vec<String>,
    pub measured: Vec<(SweepPoint, LayerMeasurement)>,
    pub failures: Vec<(SweepPoint, String)>,
}

fn point_name(p: &SweepPoint) -> String {
    let sp = if p.sequence_parallel { " sp" } else { "" };
    format!("tp {}{sp} micro-batch {}", p.tp, p.micro_batch)
}

/// Measures every point of `sweep` that `profile` does not hold yet,
/// saving the profile after each.
pub fn run_layer_sweep(
    profile: &mut Profile,
    sweep: &LayerSweep,
    progress: &mut dyn Progress,
) -> Result<LayerSweepOutcome, MeasureError> {
    let pending: Vec<_> = sweep
        .jobs
        .iter()
        .filter(|(point, _)| !is_measured(profile, sweep.model, sweep.dtype, *point))
        .collect();
    let mut outcome = LayerSweepOutcome {
        resumed: sweep.jobs.len() - pending.len(),
        ..LayerSweepOutcome::default()
    };
    progress.start(pending.len());
    for (point, job) in pending {
        progress.point(&point_name(point));
        match measure_layer_point(job, sweep.timeout) {
            Ok((m, note)) => {
                outcome.notes.extend(note);
                let points = layer_points(sweep.model, sweep.dtype, *point, &m);
                merge_layers(&mut profile.layers, &points);
                write_profile(sweep.out, profile)?;
                outcome.measured.push((*point, m));
            }
            Err(message) => outcome.failures.push((*point, message)),
        }
        progress.advance();
    }
    progress.finish();
    if outcome.measured.is_empty() && outcome.failures.is_empty() {
        write_profile(sweep.out, profile)?;
    }
    Ok(outcome)
}

impl LayerSweepOutcome {
    /// The sweep's report: what was resumed, notes, the measured points'
    /// table and the profile's size.
    pub fn report(&self, total: usize, out: &Path, layers_in_profile: usize) -> String {
        let mut report = String::new();
        if self.resumed > 0 {
            let _ = writeln!(
                report,
                "resumed: {} of {total} points are already in {} and were not measured again",
                self.resumed,
                out.display()
            );
        }
        for note in &self.notes {
            let _ = writeln!(report, "{note}");
        }
        report.push_str(&layer_table(&self.measured));
        let _ = writeln!(
            report,
            "{}: {layers_in_profile} layer points in all",
            out.display()
        );
        report
    }

    /// Why the sweep failed, when some points did.
    pub fn failure(&self, out: &Path) -> Option<String> {
        if self.failures.is_empty() {
            return None;
        }
        let list: Vec<String> = self
            .failures
            .iter()
            .map(|(p, why)| format!("{}: {why}", point_name(p)))
            .collect();
        Some(format!(
            "{} of the points failed ({}); the finished points are saved in {}: rerun the same command to retry the rest",
            self.failures.len(),
            list.join("; "),
            out.display()
        ))
    }
}

fn layer_table(rows: &[(SweepPoint, LayerMeasurement)]) -> String {
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

/// Measures the device's matrix multiplies and copy in one worker and
/// returns them as the profile's device section, with its report. `facts`
/// are the driver's, read before.
pub fn measure_device_profile(
    job: DeviceJob,
    facts: Option<DeviceFacts>,
) -> Result<(DeviceProfile, String), MeasureError> {
    let device = job.device;
    let dtype = job.dtype;
    let measured = match spawn_worker(&WorkerJob::Device(job), Duration::from_secs(3600)) {
        Ok(WorkerReply::Device(m)) => m,
        Ok(WorkerReply::Error(e)) | Err(e) => {
            return Err(MeasureError::Sweep(format!(
                "profile device on {device}: {e}"
            )));
        }
        Ok(other) => {
            return Err(MeasureError::Sweep(format!(
                "unexpected worker reply {other:?}"
            )));
        }
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
    if let Some(first) = measured.attention.first() {
        let _ = writeln!(
            report,
            "fused causal attention, {} x {} tokens (TFLOP/s as FlashAttention counts them):",
            first.batch, first.seq_len
        );
        let _ = writeln!(report, "  head   forward  backward");
        for p in &measured.attention {
            let _ = writeln!(
                report,
                "{:>6}  {:>8.2}  {:>8.2}",
                p.head_dim, p.forward_tflops, p.backward_tflops
            );
        }
    }
    let profile = DeviceProfile {
        device: device.to_string(),
        facts,
        matmul: measured.matmul,
        copy: Some(measured.copy),
        attention: measured.attention,
        runtime: measured.runtime,
        host_memory_bytes: super::memory::host_memory_bytes(),
    };
    Ok((profile, report))
}

/// Measures each NCCL collective of `job` that `profile` lacks at this rank
/// count, one worker per collective, saving after each: a hang costs one
/// collective (killed after `timeout`), an interruption loses none
/// finished, and a rerun skips the collectives already measured. Returns
/// the new points, or what failed.
pub fn run_nccl_sweep(
    profile: &mut Profile,
    job: &CommJob,
    out: &Path,
    timeout: Duration,
    progress: &mut dyn Progress,
) -> Result<Vec<CollectivePoint>, MeasureError> {
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
    let scratch = tempfile::tempdir()
        .map_err(|e| MeasureError::Sweep(format!("cannot make a scratch directory: {e}")))?;
    let env = nccl_library_env(scratch.path());
    progress.start(pending.len());
    let mut points = Vec::new();
    let mut failures = Vec::new();
    for op in pending {
        progress.point(&format!("{op} over {ranks} GPUs"));
        let one = CommJob {
            ops: vec![op],
            ..job.clone()
        };
        match spawn_worker_with_env(&WorkerJob::Comm(one), timeout, &env) {
            Ok(WorkerReply::Comm(measured)) => {
                merge_collectives(&mut profile.collectives, &measured);
                write_profile(out, profile)?;
                points.extend(measured);
            }
            Ok(WorkerReply::Error(e)) | Err(e) => failures.push(format!("{op}: {e}")),
            Ok(other) => failures.push(format!("{op}: unexpected worker reply {other:?}")),
        }
        progress.advance();
    }
    progress.finish();
    if !failures.is_empty() {
        return Err(MeasureError::Sweep(format!(
            "{} collective(s) failed ({}); the others are saved in {}: rerun to retry",
            failures.len(),
            failures.join("; "),
            out.display()
        )));
    }
    write_profile(out, profile)?;
    Ok(points)
}

/// Each collective's best bus bandwidth among `points` (measured over
/// `over`: GPUs or ranks), and the profile's size.
pub fn peak_bandwidths(points: &[CollectivePoint], over: &str, out: &Path, saved: usize) -> String {
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
