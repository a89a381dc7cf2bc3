//! Achievable matrix-multiply TFLOP/s, copy bandwidth and fused-attention
//! TFLOP/s on one device, through libtorch: what the datasheet's peak
//! becomes in practice.

use super::torch_layer::{first_line, kind, panic_message, runtime, sync, torch_device};
use super::{
    AttentionPoint, CopyPoint, DeviceJob, DeviceMeasurement, MatmulPoint, MeasureError, Sampler,
};
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

/// When a GPU timing first settles the clock ([`settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settling {
    /// For work long enough to hold the SMs ([`SETTLED_CALL_SECONDS`]).
    LongCalls,
    /// Always: the cost model reads the point as a sustained rate however
    /// short one call is (an attention at the sweep's 8K tokens runs under
    /// half a millisecond on Blackwell, and training runs it back to back).
    Always,
}

/// Times `work` under the stopping rule: mean seconds per call and the
/// relative 95% interval. A sample runs the work back to back often enough
/// to last a millisecond, so launch and synchronisation overheads do not
/// count against small sizes. On a GPU, the work first runs back to back
/// until the clock has settled ([`settle`]) as `settling` says.
fn timed(
    job: &DeviceJob,
    device: tch::Device,
    settling: Settling,
    work: impl Fn(),
) -> (f64, Option<f64>) {
    for _ in 0..job.rule.warmup.max(1) {
        work();
    }
    sync(device);
    let start = Instant::now();
    work();
    sync(device);
    let once = start.elapsed().as_secs_f64().max(1e-9);
    let long_call = once >= SETTLED_CALL_SECONDS;
    if device.is_cuda() && (long_call || settling == Settling::Always) {
        settle(device, &work);
    }
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

/// Seconds of back-to-back work before a GPU timing starts. Tensor-core
/// work that fills the SMs draws the board's power limit, and the clock
/// then settles below its boost: NVIDIA's CUTLASS "GEMM performance
/// measurement methodology guidelines" find back-to-back GEMM clocks
/// oscillating "for around the first 3 seconds" before settling, and
/// compare results at the settled frequency. Training runs there, so the
/// device sweep measures there too, not at the short burst's clock.
const SETTLE_SECONDS: f64 = 3.0;

/// GEMM and copy calls shorter than this are timed without settling: a
/// small GEMM does not hold the board at its power limit (on B200 the
/// clock starts to fall after about 5 ms of continuous compute,
/// flashinfer PR #2899), and the sweep's budget goes to the large points
/// the cost model reads. Attention points always settle
/// ([`Settling::Always`]). Each settling adds [`SETTLE_SECONDS`] beyond
/// the point's `--max-seconds`.
const SETTLED_CALL_SECONDS: f64 = 0.5e-3;

/// Runs `work` back to back for [`SETTLE_SECONDS`], synchronising every
/// few calls to read the time without idling the GPU between them.
fn settle(device: tch::Device, work: &impl Fn()) {
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < SETTLE_SECONDS {
        for _ in 0..8 {
            work();
        }
        sync(device);
    }
}

fn run(job: &DeviceJob, device: tch::Device) -> DeviceMeasurement {
    let options = (kind(job.dtype), device);
    let mut matmul = Vec::new();
    let mut side = 256;
    while side <= job.max_side {
        let n = side as i64;
        let a = Tensor::randn([n, n], options);
        let b = Tensor::randn([n, n], options);
        let (seconds, ci95_rel) = timed(job, device, Settling::LongCalls, || drop(a.matmul(&b)));
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
    let (seconds, ci95_rel) = timed(job, device, Settling::LongCalls, || {
        dst.shallow_clone().copy_(&src);
    });
    let bytes = elements as u64 * 4;
    let attention = if job.attention_seq == 0 {
        Vec::new()
    } else {
        crate::cluster::AttentionRates::HEAD_DIMS
            .map(|head_dim| attention(job, device, head_dim))
            .to_vec()
    };
    DeviceMeasurement {
        attention,
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

/// Model width and sequences of the attention points: FlashAttention-3's
/// benchmark shape (hidden 2048, two sequences of 8K tokens on a GPU).
const ATTENTION_WIDTH: u64 = 2048;
const ATTENTION_BATCH: u64 = 2;

/// Times PyTorch's fused causal attention forward, and its backward alone
/// (the graph kept, so each sample reruns only the backward), at one head
/// width.
fn attention(job: &DeviceJob, device: tch::Device, head_dim: u64) -> AttentionPoint {
    let heads = ATTENTION_WIDTH / head_dim;
    let seq_len = job.attention_seq;
    let shape = [ATTENTION_BATCH, heads, seq_len, head_dim].map(|d| d as i64);
    let input = || Tensor::randn(shape, (kind(job.dtype), device)).set_requires_grad(true);
    let (q, k, v) = (input(), input(), input());
    let forward =
        || Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
    let (forward_s, forward_ci95_rel) = timed(job, device, Settling::Always, || drop(forward()));
    let loss = forward().sum(Kind::Float);
    let (backward_s, backward_ci95_rel) = timed(job, device, Settling::Always, || {
        drop(Tensor::run_backward(&[&loss], &[&q, &k, &v], true, false))
    });
    let flops = AttentionPoint::forward_flops(ATTENTION_BATCH, heads, seq_len, head_dim);
    AttentionPoint {
        head_dim,
        heads,
        seq_len,
        batch: ATTENTION_BATCH,
        dtype: job.dtype,
        forward_s,
        backward_s,
        forward_tflops: flops / forward_s / 1e12,
        backward_tflops: AttentionPoint::BACKWARD_FLOPS_PER_FORWARD * flops / backward_s / 1e12,
        forward_ci95_rel,
        backward_ci95_rel,
    }
}
