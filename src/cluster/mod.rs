//! GPUs, nodes and clusters, and where ranks land on them.
//!
//! A cluster is a list of node groups, each of one GPU kind, so that
//! heterogeneous clusters extend this type rather than replace it; the cost
//! model today accepts a single group (see [`Cluster::homogeneous`]).

mod catalogue;
mod file;

pub use catalogue::{
    AttentionRates, MatmulCeiling, attention_rates, builtin_gpu, builtin_gpu_names, builtin_node,
    gpus_per_host, matmul_ceiling,
};
pub use file::{ClusterFileError, load_cluster_file, parse_cluster_toml};

use crate::units::Bandwidth;
use serde::{Deserialize, Serialize};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Datasheet facts of one GPU kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    pub name: String,
    /// Dense 16-bit (fp16/bf16) tensor-core peak, FLOP/s.
    pub peak_flops: f64,
    /// HBM capacity, bytes.
    pub memory_bytes: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// Dense FP8 tensor-core peak, FLOP/s, on GPUs that have FP8 (Hopper
    /// and later; MXFP8 on Blackwell runs at the same peak).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_peak_flops: Option<f64>,
    /// Dense FP4 tensor-core peak, FLOP/s, on GPUs whose tensor cores
    /// scale FP4 blocks (Blackwell's NVFP4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp4_peak_flops: Option<f64>,
    /// Per-direction bandwidth between the GPU and its host's memory
    /// (PCIe, or NVLink-C2C on Grace superchips), bytes/s, where known:
    /// what activation offloading copies through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_link_bandwidth: Option<f64>,
}

/// Whether a GPU (by its catalogue name, or a name that starts with one)
/// is a Blackwell part: block-scaled (MXFP8) tensor cores, and FP8 by
/// default in that recipe.
pub fn is_blackwell(gpu: &str) -> bool {
    let gpu = gpu.trim().to_lowercase();
    ["b200", "gb200", "b300", "gb300"]
        .iter()
        .any(|name| gpu.starts_with(name))
}

/// Whether a "GPU" is the CPU standing in for one (a cluster file's inline
/// GPU named `cpu`, as `tests/data/validate/cpu-cluster.toml`): it runs
/// PyTorch's CPU kernels, so nothing CUDA-only (graphs) applies to it.
pub fn is_cpu(gpu: &str) -> bool {
    gpu.trim().eq_ignore_ascii_case("cpu")
}

impl GpuSpec {
    pub fn memory_gib(&self) -> f64 {
        self.memory_bytes / GIB
    }
}

/// Nodes of one kind: GPUs per node and the link between GPUs of a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeGroup {
    pub gpu: GpuSpec,
    pub nodes: u64,
    pub gpus_per_node: u64,
    /// Per-GPU, per-direction bandwidth of the intra-node link (NVLink/NVSwitch).
    pub intra_node_bw: Bandwidth,
    /// Per-node injection bandwidth into the inter-node network (all NICs).
    pub inter_node_bw: Bandwidth,
}

impl NodeGroup {
    /// Every figure positive and finite and the GPU's name printable: what
    /// a plan file read back must hold before anything is derived from it.
    pub fn check(&self) -> Result<(), String> {
        crate::text::check_printable("GPU name", &self.gpu.name)?;
        for (field, peak) in [
            ("gpu.fp8_peak_flops", self.gpu.fp8_peak_flops),
            ("gpu.fp4_peak_flops", self.gpu.fp4_peak_flops),
        ] {
            if let Some(peak) = peak
                && !(peak.is_finite() && peak > 0.0)
            {
                return Err(format!("`{field}` is {peak}; it must be a positive number"));
            }
        }
        let figures = [
            ("gpu.peak_flops", self.gpu.peak_flops),
            ("gpu.memory_bytes", self.gpu.memory_bytes),
            ("gpu.hbm_bandwidth", self.gpu.hbm_bandwidth),
            ("intra_node_bw", self.intra_node_bw.bytes_per_s()),
            ("inter_node_bw", self.inter_node_bw.bytes_per_s()),
        ];
        for (field, value) in figures {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "`{field}` is {value}; it must be a positive number"
                ));
            }
        }
        if self.nodes == 0 || self.gpus_per_node == 0 {
            return Err("`nodes` and `gpus_per_node` must be at least 1".into());
        }
        Ok(())
    }
}

/// The machines a job may use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub groups: Vec<NodeGroup>,
}

impl Cluster {
    pub fn single(group: NodeGroup) -> Self {
        Cluster {
            groups: vec![group],
        }
    }

    /// The one node group of a homogeneous cluster, or an error naming why the
    /// cost model cannot use this cluster yet.
    pub fn homogeneous(&self) -> Result<&NodeGroup, String> {
        match self.groups.as_slice() {
            [one] => Ok(one),
            [] => Err("cluster: no node group given; add one [[nodes]] table".into()),
            _ => Err(
                "cluster: more than one GPU kind is not supported by the cost model yet; \
                 keep one [[nodes]] table"
                    .into(),
            ),
        }
    }

    pub fn total_gpus(&self) -> u64 {
        self.groups.iter().map(|g| g.nodes * g.gpus_per_node).sum()
    }
}

/// Where a job's ranks sit: how many GPUs it uses and how many of them share
/// a node. Ranks are numbered Megatron-Core's way: tensor-parallel fastest,
/// then context-parallel, then data-parallel, then pipeline (the cost
/// model's spans in `cost/comm.rs` follow it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    pub gpus: u64,
    /// GPUs of this job per node (the node size, or the job size when smaller).
    pub gpus_per_node: u64,
}

impl Placement {
    pub fn new(gpus: u64, node_size: u64) -> Self {
        Placement {
            gpus,
            gpus_per_node: node_size.min(gpus),
        }
    }

    pub fn node_of(&self, rank: u64) -> u64 {
        rank / self.gpus_per_node
    }

    /// Ranks spaced `stride` apart, `count` of them starting at 0: how many
    /// nodes they span and how many share each node.
    pub fn span(&self, stride: u64, count: u64) -> GroupSpan {
        if stride >= self.gpus_per_node {
            // Every rank on a node of its own (strides of whole nodes and
            // more, as data parallelism over tensor parallelism across nodes).
            return GroupSpan {
                nodes: count,
                per_node: 1,
            };
        }
        let last = stride * (count - 1);
        let nodes = self.node_of(last) + 1;
        GroupSpan {
            nodes,
            per_node: count.div_ceil(nodes),
        }
    }
}

/// How a communication group spreads over nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpan {
    pub nodes: u64,
    pub per_node: u64,
}

/// The catalogue GPU a device name such as `NVIDIA A100-SXM4-80GB` is, when
/// every part of exactly one catalogue name appears in it; else the name.
pub fn catalogue_name(device: &str) -> String {
    let lower = device.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let matches: Vec<&str> = builtin_gpu_names()
        .into_iter()
        .filter(|name| {
            name.split('-')
                .all(|part| words.iter().any(|w| w.starts_with(part)))
        })
        .collect();
    match matches.as_slice() {
        [one] => one.to_string(),
        _ => lower,
    }
}
