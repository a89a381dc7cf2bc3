//! Achievable matrix-multiply TFLOP/s and copy bandwidth on one device,
//! through libtorch: what the datasheet's peak becomes in practice.

use super::torch_layer::{first_line, kind, panic_message, runtime, sync, torch_device};
use super::{CopyPoint, DeviceJob, DeviceMeasurement, MatmulPoint, MeasureError, Sampler};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;
use tch::{Kind, Tensor};

pub(super) fn measure(job: &DeviceJob) -> Result<DeviceMeasurement, MeasureError> {
    super::check_device_job(job)?;
    let device = torch_device(job.device)?;
    tch::manual_seed(0);
    catch_unwind(AssertUnwindSafe(|| run(job, device)))
        .map_err(|payload| MeasureError::Failed(first_line(&panic_message(&*payload))))
}

/// Times `work` under the stopping rule: mean seconds per call and the
/// relative 95% interval. A sample runs the work back to back often enough
/// to last a millisecond, so launch and synchronisation overheads do not
/// count against small sizes.
fn timed(job: &DeviceJob, device: tch::Device, work: impl Fn()) -> (f64, Option<f64>) {
    for _ in 0..job.rule.warmup.max(1) {
        work();
    }
    sync(device);
    let start = Instant::now();
    work();
    sync(device);
    let once = start.elapsed().as_secs_f64().max(1e-9);
    let calls = (1e-3 / once).ceil().clamp(1.0, 10_000.0) as usize;
    let mut sampler = Sampler::new(job.rule);
    while !sampler.done() {
        let start = Instant::now();
        for _ in 0..calls {
            work();
        }
        sync(device);
        sampler.push(start.elapsed().as_secs_f64() / calls as f64);
    }
    let s = sampler.summary();
    (s.mean, s.ci95_rel.is_finite().then_some(s.ci95_rel))
}

fn run(job: &DeviceJob, device: tch::Device) -> DeviceMeasurement {
    let options = (kind(job.dtype), device);
    let mut matmul = Vec::new();
    let mut side = 256;
    while side <= job.max_side {
        let n = side as i64;
        let a = Tensor::randn([n, n], options);
        let b = Tensor::randn([n, n], options);
        let (seconds, ci95_rel) = timed(job, device, || drop(a.matmul(&b)));
        matmul.push(MatmulPoint {
            m: side,
            n: side,
            k: side,
            dtype: job.dtype,
            seconds,
            tflops: 2.0 * (side as f64).powi(3) / seconds / 1e12,
            ci95_rel,
        });
        side *= 2;
    }
    let elements = (job.copy_bytes / 4).max(1) as i64;
    let src = Tensor::ones([elements], (Kind::Float, device));
    let dst = Tensor::zeros([elements], (Kind::Float, device));
    let (seconds, ci95_rel) = timed(job, device, || {
        dst.shallow_clone().copy_(&src);
    });
    let bytes = elements as u64 * 4;
    DeviceMeasurement {
        matmul,
        copy: CopyPoint {
            bytes,
            seconds,
            gbps: 2.0 * bytes as f64 / seconds / 1e9,
            ci95_rel,
        },
        runtime: runtime(device),
    }
}
