//! The plain records of measuring: where work ran (`Device`), in which
//! precision (`Dtype`), what a layer measurement, a matrix multiply and a
//! copy found, and what the driver says about a GPU. They sit with the
//! profile's data, below the measuring code (`measure`) that produces them
//! and the cost model that reads them, so neither depends on the other.

use crate::config::Recompute;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Where the measured work runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(index) => write!(f, "cuda:{index}"),
        }
    }
}

impl FromStr for Device {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let lower = text.trim().to_lowercase();
        match lower.as_str() {
            "cpu" => return Ok(Device::Cpu),
            "cuda" | "gpu" => return Ok(Device::Cuda(0)),
            _ => {}
        }
        if let Some(index) = lower.strip_prefix("cuda:")
            && let Ok(index) = index.parse::<usize>()
        {
            return Ok(Device::Cuda(index));
        }
        Err(format!(
            "unknown device `{text}`; use cpu, cuda or cuda:N (N the GPU index, e.g. cuda:0)"
        ))
    }
}

impl TryFrom<String> for Device {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<Device> for String {
    fn from(device: Device) -> String {
        device.to_string()
    }
}

/// Precision the measured layers compute in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Fp32,
    Fp16,
    Bf16,
}

impl Dtype {
    pub const ALL: [Dtype; 3] = [Dtype::Fp32, Dtype::Fp16, Dtype::Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Fp16 => "fp16",
            Dtype::Bf16 => "bf16",
        }
    }

    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Fp32 => 4,
            Dtype::Fp16 | Dtype::Bf16 => 2,
        }
    }
}

impl FromStr for Dtype {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let lower = text.trim().to_lowercase();
        let alias = match lower.as_str() {
            "float32" | "float" | "f32" => "fp32",
            "float16" | "half" | "f16" => "fp16",
            "bfloat16" => "bf16",
            other => other,
        };
        Dtype::ALL
            .into_iter()
            .find(|d| d.name() == alias)
            .ok_or_else(|| format!("unknown dtype `{text}`; one of fp32, fp16, bf16"))
    }
}

/// What one layer measurement found. Times are means over the timed
/// repetitions, seconds; zero when the point ran out of memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerMeasurement {
    /// Forward with autograd recording (what training without
    /// recomputation runs, and what full recomputation runs again).
    pub forward_s: f64,
    /// Forward without autograd (the first forward under full recomputation).
    pub forward_no_grad_s: f64,
    pub backward_s: f64,
    /// Half-width of the 95% confidence interval of forward + backward,
    /// relative to its mean (none below two repetitions).
    pub ci95_rel: Option<f64>,
    pub repetitions: usize,
    /// Bytes the forward leaves allocated for the backward (the activations).
    pub activation_bytes: Option<f64>,
    /// Highest memory above the state before the forward, during forward
    /// and backward.
    pub peak_bytes: Option<f64>,
    pub out_of_memory: bool,
    /// What ran the work (torch version, threads, GPU name).
    pub runtime: String,
}

/// One timed matrix multiply `[m, k] x [k, n]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MatmulPoint {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub dtype: Dtype,
    pub seconds: f64,
    pub tflops: f64,
    pub ci95_rel: Option<f64>,
}

/// Fused causal attention (PyTorch's `scaled_dot_product_attention`,
/// which runs cuDNN's or FlashAttention's kernel on a GPU) timed forward
/// and backward over `batch` sequences of `seq_len` tokens in `heads`
/// heads `head_dim` wide. TFLOP/s are counted as FlashAttention counts
/// them: the forward's two products over the causal half of the scores,
/// the backward 2.5 times that.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionPoint {
    pub head_dim: u64,
    pub heads: u64,
    pub seq_len: u64,
    pub batch: u64,
    pub dtype: Dtype,
    pub forward_s: f64,
    pub backward_s: f64,
    pub forward_tflops: f64,
    pub backward_tflops: f64,
    pub forward_ci95_rel: Option<f64>,
    pub backward_ci95_rel: Option<f64>,
}

impl AttentionPoint {
    /// Forward FLOPs of causal attention: QK^T and AV over half the scores.
    pub fn forward_flops(batch: u64, heads: u64, seq_len: u64, head_dim: u64) -> f64 {
        4.0 * (batch * heads) as f64 * (seq_len as f64).powi(2) * head_dim as f64 / 2.0
    }

    /// The backward's: it recomputes the scores, five products to the
    /// forward's two.
    pub const BACKWARD_FLOPS_PER_FORWARD: f64 = 2.5;
}

/// A timed copy: `bytes` read and `bytes` written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopyPoint {
    pub bytes: u64,
    pub seconds: f64,
    /// (read + written) / seconds, GB/s (10^9 bytes per second).
    pub gbps: f64,
    pub ci95_rel: Option<f64>,
}

/// What the driver says about one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceFacts {
    pub name: String,
    pub index: usize,
    pub memory_bytes: f64,
    pub multiprocessors: u32,
    pub compute_capability: String,
    /// Peak SM clock, MHz.
    pub sm_clock_mhz: f64,
    /// Peak memory clock, MHz.
    pub memory_clock_mhz: f64,
    pub memory_bus_bits: u32,
    /// CUDA driver API version, e.g. `13.0`.
    pub driver_version: String,
}

/// The recomputation policies one layer measurement yields rows for: the
/// forward, backward and forward-again times give both.
pub const MEASURED_RECOMPUTE: [Recompute; 2] = [Recompute::None, Recompute::Full];
