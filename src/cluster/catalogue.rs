//! Built-in GPUs and their usual nodes. (Stub.)
use super::{GpuSpec, NodeGroup};

pub fn builtin_gpu_names() -> Vec<&'static str> {
    vec!["a100-80gb"]
}

pub fn builtin_gpu(name: &str) -> Option<GpuSpec> {
    match name {
        "a100-80gb" => Some(GpuSpec { name: name.into(), peak_flops: 312e12, memory_bytes: 80.0 * 1024.0 * 1024.0 * 1024.0, hbm_bandwidth: 2.039e12 }),
        _ => None,
    }
}

pub fn builtin_node(gpu: &str, nodes: u64) -> Option<NodeGroup> {
    let gpu = builtin_gpu(gpu)?;
    Some(NodeGroup { gpu, nodes, gpus_per_node: 8, intra_node_bw: crate::units::Bandwidth(300e9), inter_node_bw: crate::units::Bandwidth(200e9) })
}
