//! One real transformer layer, as one tensor-parallel shard, built and timed
//! with libtorch (tch).
//!
//! The shard holds `heads / tp` query heads (and `kv_heads / tp` key/value
//! heads), an MLP of width `ffn_hidden / tp`, gated (SwiGLU) or not, and
//! both layer norms, in Megatron-LM's order: pre-norm attention through
//! `scaled_dot_product_attention` (causal; PyTorch picks the fused kernel
//! the device has) for flash attention, or scores, softmax and their product
//! in memory for the model's `standard` (unfused) attention, output
//! projection, residual, pre-norm MLP, residual.
//! The tensor-parallel collectives are not run (one device): a measured
//! point says so (`includes_tp_comm = false`) and the cost model adds them.
//! Dropout is left out.
//!
//! **Sequence parallelism** ([`LayerShard::sequence_parallel`]) keeps the
//! residual stream, the layer norms and their saved inputs on `seq / tp`
//! tokens. Where Megatron-LM all-gathers the sequence before a
//! column-parallel GEMM, the shard runs that GEMM once per rank's chunk,
//! each chunk being its own (the same work, and only the local chunk saved
//! for the backward, as Megatron-LM saves it); where Megatron-LM
//! reduce-scatters after a row-parallel GEMM, the shard keeps its own chunk
//! of the output.

use super::memory::{self, MemoryProbe};
use super::{
    Device, Dtype, LayerJob, LayerMeasurement, LayerPass, MeasureError, Sampler, check_layer_job,
    cuda_presence,
};
use crate::model::ModelSpec;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;
use tch::{Kind, Tensor};

/// The parameters of one layer shard.
pub(super) struct LayerShard {
    /// Ranks the sequence is split over outside attention and the MLP:
    /// tp under sequence parallelism, else 1.
    sequence_shards: i64,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    hidden: i64,
    gated: bool,
    /// `AttentionKind::Standard`: scores and softmax materialised, as
    /// Megatron's unfused path keeps them for the backward.
    unfused: bool,
    params: Vec<Tensor>,
}

/// Causal attention with the `s x s` scores and their softmax in memory.
fn unfused_attention(q: &Tensor, k: &Tensor, v: &Tensor, group: i64) -> Tensor {
    let (k, v) = if group > 1 {
        (
            k.repeat_interleave_self_int(group, 1, None),
            v.repeat_interleave_self_int(group, 1, None),
        )
    } else {
        (k.shallow_clone(), v.shallow_clone())
    };
    let head_dim = q.size()[3] as f64;
    let s = q.size()[2];
    let scores = q.matmul(&k.transpose(-2, -1)) * (1.0 / head_dim.sqrt());
    let future = Tensor::ones([s, s], (Kind::Bool, q.device())).triu(1);
    scores
        .masked_fill(&future, f64::NEG_INFINITY)
        .softmax(-1, None::<Kind>)
        .matmul(&v)
}

/// Indices into `LayerShard::params`.
const LN1_W: usize = 0;
const LN1_B: usize = 1;
const QKV_W: usize = 2;
const QKV_B: usize = 3;
const PROJ_W: usize = 4;
const PROJ_B: usize = 5;
const LN2_W: usize = 6;
const LN2_B: usize = 7;
const FC1_W: usize = 8;
const FC1_B: usize = 9;
const FC2_W: usize = 10;
const FC2_B: usize = 11;
/// Only in gated MLPs: the gate projection.
const GATE_W: usize = 12;

pub(super) fn kind(dtype: Dtype) -> Kind {
    match dtype {
        Dtype::Fp32 => Kind::Float,
        Dtype::Fp16 => Kind::Half,
        Dtype::Bf16 => Kind::BFloat16,
    }
}

impl LayerShard {
    pub fn new(model: &ModelSpec, tp: u64, dtype: Dtype, device: tch::Device) -> Self {
        let tp = tp as i64;
        let hidden = model.hidden as i64;
        let heads = model.heads as i64 / tp;
        let kv_heads = model.kv_heads as i64 / tp;
        let head_dim = model.head_dim() as i64;
        let ffn = model.ffn_hidden as i64 / tp;
        let qkv = (heads + 2 * kv_heads) * head_dim;
        let options = (kind(dtype), device);
        let weight = |rows: i64, cols: i64| Tensor::randn([rows, cols], options) * 0.02;
        let ones = |n: i64| Tensor::ones([n], options);
        let zeros = |n: i64| Tensor::zeros([n], options);
        let mut params = vec![
            ones(hidden),
            zeros(hidden),
            weight(hidden, qkv),
            zeros(qkv),
            weight(heads * head_dim, hidden),
            zeros(hidden),
            ones(hidden),
            zeros(hidden),
            weight(hidden, ffn),
            zeros(ffn),
            weight(ffn, hidden),
            zeros(hidden),
        ];
        if model.gated_mlp {
            params.push(weight(hidden, ffn));
        }
        let params = params
            .into_iter()
            .map(|p| p.set_requires_grad(true))
            .collect();
        LayerShard {
            sequence_shards: 1,
            heads,
            kv_heads,
            head_dim,
            hidden,
            gated: model.gated_mlp,
            unfused: model.attention == crate::model::AttentionKind::Standard,
            params,
        }
    }

    /// The same shard under sequence parallelism over `tp` ranks: its input
    /// and output are `[micro_batch, seq / tp, hidden]`.
    pub fn sequence_parallel(self, tp: u64) -> Self {
        LayerShard {
            sequence_shards: tp as i64,
            ..self
        }
    }

    pub fn parameters(&self) -> &[Tensor] {
        &self.params
    }

    /// `x`: `[micro_batch, seq, hidden]` (`seq / tp` under sequence
    /// parallelism), returns the same shape.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_with(&self.params, x)
    }

    /// [`Self::forward`] with weights `p` of this shard's shapes (ZeRO-3
    /// trials pass the layer's gathered weights).
    pub fn forward_with(&self, p: &[Tensor], x: &Tensor) -> Tensor {
        let (b, local, h) = x.size3().expect("layer input is [batch, seq, hidden]");
        let s = local * self.sequence_shards;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let scattered = |t: Tensor| {
            if self.sequence_shards == 1 {
                t
            } else {
                t.narrow(1, 0, local)
            }
        };
        let a = x.layer_norm([h], Some(&p[LN1_W]), Some(&p[LN1_B]), 1e-5, true);
        let qkv = gathered_matmul(&a, &p[QKV_W], self.sequence_shards) + &p[QKV_B];
        let split = |start: i64, n: i64| {
            qkv.narrow(2, start * hd, n * hd)
                .reshape([b, s, n, hd])
                .transpose(1, 2)
        };
        let q = split(0, nh);
        let k = split(nh, nkv);
        let v = split(nh + nkv, nkv);
        let context = if self.unfused {
            unfused_attention(&q, &k, &v, nh / nkv)
        } else {
            Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                None::<Tensor>,
                0.0,
                true,
                None,
                nkv != nh,
            )
        }
        .transpose(1, 2)
        .reshape([b, s, nh * hd]);
        let x = x + scattered(context.matmul(&p[PROJ_W])) + &p[PROJ_B];
        let m = x.layer_norm([self.hidden], Some(&p[LN2_W]), Some(&p[LN2_B]), 1e-5, true);
        let n = self.sequence_shards;
        let inner = if self.gated {
            gathered_matmul(&m, &p[GATE_W], n).silu()
                * (gathered_matmul(&m, &p[FC1_W], n) + &p[FC1_B])
        } else {
            (gathered_matmul(&m, &p[FC1_W], n) + &p[FC1_B]).gelu("tanh")
        };
        x + scattered(inner.matmul(&p[FC2_W])) + &p[FC2_B]
    }
}

/// `x · w` over the whole sequence when `x` is one of `ranks` sequence
/// chunks: Megatron-LM's all-gather then GEMM, with every rank's chunk
/// standing in as this one. One GEMM per chunk does the gathered GEMM's
/// work, and autograd keeps `x` (the local chunk) once, as Megatron-LM
/// keeps it, instead of a gathered copy. The chunks' products are joined
/// with `cat`, whose backward only takes views (copying each product into
/// a preallocated output would make autograd copy the whole gradient once
/// per chunk); the products and the joined output are alive together for a
/// moment.
pub(super) fn gathered_matmul(x: &Tensor, w: &Tensor, ranks: i64) -> Tensor {
    if ranks == 1 {
        return x.matmul(w);
    }
    let chunks: Vec<Tensor> = (0..ranks).map(|_| x.matmul(w)).collect();
    Tensor::cat(&chunks, 1)
}

/// The torch device for `device`, after checking it exists.
pub(super) fn torch_device(device: Device) -> Result<tch::Device, MeasureError> {
    match device {
        Device::Cpu => Ok(tch::Device::Cpu),
        Device::Cuda(index) => {
            cuda_presence(device)?;
            if !tch::Cuda::is_available() {
                return Err(MeasureError::NoCuda {
                    device,
                    reason: "libtorch sees no CUDA device (a CPU-only libtorch, or no driver)"
                        .into(),
                });
            }
            let count = tch::Cuda::device_count().max(0) as usize;
            if index >= count {
                return Err(MeasureError::NoSuchGpu { device, count });
            }
            Ok(tch::Device::Cuda(index))
        }
    }
}

/// Waits for the device's queued work, so wall-clock time covers it.
pub(super) fn sync(device: tch::Device) {
    if let tch::Device::Cuda(index) = device {
        tch::Cuda::synchronize(index as i64);
    }
}

/// The backward pass from `y` with an incoming gradient of ones, through
/// the parameters and the input: the weight- and input-gradient GEMMs a
/// training step runs. The gradients are returned, not accumulated.
pub(super) fn backward(y: &Tensor, inputs: &[&Tensor]) -> Vec<Tensor> {
    Tensor::run_backward(&[y], inputs, false, false)
}

/// Whether a panic message from libtorch says memory ran out.
pub(super) fn is_out_of_memory(message: &str) -> bool {
    let lower = message.to_lowercase();
    lower.contains("out of memory")
        || lower.contains("can't allocate memory")
        || lower.contains("not enough memory")
        || lower.contains("alloc_failed")
}

pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else {
        "libtorch failed".to_string()
    }
}

/// What ran the work: libtorch's threads, or the GPU.
pub(super) fn runtime(device: tch::Device) -> String {
    match device {
        tch::Device::Cpu => format!("libtorch on CPU, {} threads", tch::get_num_threads()),
        _ => format!("libtorch on {device:?}"),
    }
}

pub(super) fn measure(job: &LayerJob) -> Result<LayerMeasurement, MeasureError> {
    check_layer_job(job)?;
    let device = torch_device(job.device)?;
    if job.device == Device::Cpu {
        memory::prepare_process();
    }
    let probe = memory::probe(job.device);
    tch::manual_seed(0);
    catching_oom(|| run(job, device, &*probe), || out_of_memory(device))
}

/// Runs `work`, turning libtorch's out-of-memory panic into `oom()` and
/// any other panic into a one-line error.
pub(super) fn catching_oom<T>(
    work: impl FnOnce() -> T,
    oom: impl FnOnce() -> T,
) -> Result<T, MeasureError> {
    match catch_unwind(AssertUnwindSafe(work)) {
        Ok(value) => Ok(value),
        Err(payload) => {
            let message = panic_message(&*payload);
            if is_out_of_memory(&message) {
                Ok(oom())
            } else {
                Err(MeasureError::Failed(first_line(&message)))
            }
        }
    }
}

pub(super) fn first_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("libtorch failed")
        .chars()
        .take(300)
        .collect()
}

fn out_of_memory(device: tch::Device) -> LayerMeasurement {
    LayerMeasurement {
        forward_s: 0.0,
        forward_no_grad_s: 0.0,
        backward_s: 0.0,
        ci95_rel: None,
        repetitions: 0,
        activation_bytes: None,
        peak_bytes: None,
        out_of_memory: true,
        runtime: runtime(device),
    }
}

fn run(job: &LayerJob, device: tch::Device, probe: &dyn MemoryProbe) -> LayerMeasurement {
    let model = &job.model;
    let mut layer = LayerShard::new(model, job.tp, job.dtype, device);
    let mut tokens = model.seq_len;
    if job.sequence_parallel {
        layer = layer.sequence_parallel(job.tp);
        tokens /= job.tp;
    }
    let shape = [job.micro_batch as i64, tokens as i64, model.hidden as i64];
    let x = Tensor::randn(shape, (kind(job.dtype), device)).set_requires_grad(true);
    let mut inputs: Vec<&Tensor> = layer.parameters().iter().collect();
    inputs.push(&x);

    // A few tokens through the layer first: library handles, workspaces,
    // thread pools and lazily loaded kernels are made now, outside the
    // measured window, and take little of the allocator's cache.
    {
        let tokens = tokens.min(16) as i64;
        let small = Tensor::randn([1, tokens, model.hidden as i64], (kind(job.dtype), device))
            .set_requires_grad(true);
        let mut small_inputs: Vec<&Tensor> = layer.parameters().iter().collect();
        small_inputs.push(&small);
        drop(backward(&layer.forward(&small), &small_inputs));
    }
    // Memory first, in the fresh process: what the forward keeps, and the
    // high-water mark of forward + backward, above the state before.
    sync(device);
    let before = probe.used();
    probe.reset_peak();
    let y = layer.forward(&x);
    sync(device);
    let after_forward = probe.used();
    let grads = backward(&y, &inputs);
    sync(device);
    let peak = probe.peak();
    drop((y, grads));
    let activation_bytes = after_forward.zip(before).map(|(a, b)| (a - b).max(0.0));
    let peak_bytes = peak.zip(before).map(|(p, b)| (p - b).max(0.0));
    if let (Some(limit), Some(peak)) = (job.memory_limit_bytes, peak_bytes)
        && peak > limit
    {
        return LayerMeasurement {
            activation_bytes,
            peak_bytes: Some(peak),
            ..out_of_memory(device)
        };
    }
    if job.pass == LayerPass::MemoryOnly {
        return LayerMeasurement {
            activation_bytes,
            peak_bytes,
            out_of_memory: false,
            ..out_of_memory(device)
        };
    }

    let step = || {
        let t0 = Instant::now();
        tch::no_grad(|| drop(layer.forward(&x)));
        sync(device);
        let t1 = Instant::now();
        let y = layer.forward(&x);
        sync(device);
        let t2 = Instant::now();
        drop(backward(&y, &inputs));
        sync(device);
        let t3 = Instant::now();
        (
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64(),
        )
    };
    for _ in 0..job.rule.warmup {
        step();
    }
    let mut sampler = Sampler::new(job.rule);
    let (mut no_grad, mut forward, mut backward_s) = (0.0, 0.0, 0.0);
    while !sampler.done() {
        let (n, f, b) = step();
        no_grad += n;
        forward += f;
        backward_s += b;
        sampler.push(f + b);
    }
    let summary = sampler.summary();
    let reps = summary.n as f64;
    LayerMeasurement {
        forward_s: forward / reps,
        forward_no_grad_s: no_grad / reps,
        backward_s: backward_s / reps,
        ci95_rel: summary.ci95_rel.is_finite().then_some(summary.ci95_rel),
        repetitions: summary.n,
        activation_bytes,
        peak_bytes,
        out_of_memory: false,
        runtime: runtime(device),
    }
}
