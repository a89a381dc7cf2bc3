//! A node described by what a profile measured rather than by a datasheet:
//! `plan --cluster-from-profile DIR --gpus-per-node N`. The device's peak is
//! the best matrix-multiply rate `profile device` reached, its memory
//! bandwidth the copy rate, its capacity what the driver (or, for the CPU,
//! the host) reported, and the link between devices of a node the bus
//! bandwidth of the largest all-reduce `profile comm` timed across them.

use super::{CollectiveOp, CollectivePoint, Profile, ProfileError};
use crate::cluster::{GpuSpec, NodeGroup};
use crate::units::Bandwidth;

/// What a measured node is made of beyond the profile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredNodeShape {
    pub nodes: u64,
    pub gpus_per_node: u64,
    /// Used when the profile has no all-reduce across the node's devices.
    pub intra_node_bw: Option<Bandwidth>,
    /// Used for more than one node; one node needs none.
    pub inter_node_bw: Option<Bandwidth>,
}

/// The node group `profile` measured, shaped as `shape` says. `dir` names
/// the profile in errors.
pub fn measured_node(
    profile: &Profile,
    dir: &str,
    shape: MeasuredNodeShape,
) -> Result<NodeGroup, ProfileError> {
    let missing = |what: &str, fix: &str| ProfileError::Input {
        path: dir.to_string(),
        message: format!("{what}; {fix}"),
    };
    let device = profile.device.as_ref().ok_or_else(|| {
        missing(
            "no device measurements (device.toml)",
            "run `paratune profile device --device DEVICE --out DIR` first",
        )
    })?;
    let peak_tflops = device.best_tflops().ok_or_else(|| {
        missing(
            "device.toml has no matrix-multiply rate",
            "re-run `paratune profile device`",
        )
    })?;
    let copy = device.copy.as_ref().ok_or_else(|| {
        missing(
            "device.toml has no copy rate",
            "re-run `paratune profile device`",
        )
    })?;
    let memory_bytes = device_memory(device, shape.gpus_per_node).ok_or_else(|| {
        missing(
            "device.toml records no device memory",
            "re-run `paratune profile device` with this paratune",
        )
    })?;
    // One device a node has no link inside the node; the figure is never
    // read, so the device's own memory bandwidth stands in for it.
    let alone = (shape.gpus_per_node == 1).then_some(Bandwidth(copy.gbps * 1e9));
    let intra = measured_link(&profile.collectives, shape.gpus_per_node)
        .or(shape.intra_node_bw)
        .or(alone)
        .ok_or_else(|| {
            missing(
                &format!(
                    "no all-reduce across {} devices was measured",
                    shape.gpus_per_node
                ),
                &format!(
                    "run `paratune profile comm --ranks {} --out DIR`, or give --intra-node-bw",
                    shape.gpus_per_node
                ),
            )
        })?;
    let inter = match (shape.inter_node_bw, shape.nodes) {
        (Some(bw), _) => bw,
        // One node sends nothing between nodes; the figure is never read.
        (None, 1) => intra,
        (None, _) => {
            return Err(missing(
                "a profile measures one node",
                "give --inter-node-bw for a cluster of several",
            ));
        }
    };
    Ok(NodeGroup {
        gpu: GpuSpec {
            name: profile.environment.gpu.clone(),
            peak_flops: peak_tflops * 1e12,
            memory_bytes,
            hbm_bandwidth: copy.gbps * 1e9,
            // No FP8 rate is measured yet, nor the host link.
            fp8_peak_flops: None,
            fp4_peak_flops: None,
            host_link_bandwidth: None,
        },
        nodes: shape.nodes,
        gpus_per_node: shape.gpus_per_node,
        intra_node_bw: intra,
        inter_node_bw: inter,
    })
}

/// A device's capacity: the driver's figure for a GPU; for the CPU, the
/// host's memory shared by the node's `gpus_per_node` ranks.
fn device_memory(device: &super::DeviceProfile, gpus_per_node: u64) -> Option<f64> {
    if let Some(facts) = &device.facts {
        return Some(facts.memory_bytes);
    }
    device
        .host_memory_bytes
        .map(|bytes| bytes / gpus_per_node.max(1) as f64)
}

/// Per-device bus bandwidth of the largest all-reduce measured across
/// exactly `ranks` devices: what a ring moves per device per second, as
/// nccl-tests reports it (the point's `busbw`).
pub fn measured_link(points: &[CollectivePoint], ranks: u64) -> Option<Bandwidth> {
    points
        .iter()
        .filter(|p| p.op == CollectiveOp::AllReduce && p.ranks == ranks && ranks > 1)
        .max_by(|a, b| a.bytes.total_cmp(&b.bytes))
        .map(|p| Bandwidth(p.busbw * 1e9))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{CopyPoint, DeviceProfile, MatmulPoint};

    fn cpu_profile() -> Profile {
        let mut profile = Profile::empty("cpu");
        profile.device = Some(DeviceProfile {
            device: "cpu".into(),
            facts: None,
            matmul: [(256, 0.02), (1024, 0.09), (2048, 0.08)]
                .map(|(side, tflops)| MatmulPoint {
                    m: side,
                    n: side,
                    k: side,
                    dtype: crate::profile::Dtype::Bf16,
                    seconds: 2.0 * (side as f64).powi(3) / (tflops * 1e12),
                    tflops,
                    ci95_rel: None,
                })
                .to_vec(),
            copy: Some(CopyPoint {
                bytes: 64 << 20,
                seconds: 0.01,
                gbps: 12.0,
                ci95_rel: None,
            }),
            attention: Vec::new(),
            runtime: "test".into(),
            host_memory_bytes: Some(16e9),
        });
        profile.collectives = [(1e6, 1e-3), (64e6, 0.04)]
            .map(|(bytes, seconds)| CollectivePoint {
                op: CollectiveOp::AllReduce,
                ranks: 2,
                bytes,
                seconds,
                busbw: bytes / seconds / 1e9,
            })
            .to_vec();
        profile
    }

    fn shape() -> MeasuredNodeShape {
        MeasuredNodeShape {
            nodes: 1,
            gpus_per_node: 2,
            intra_node_bw: None,
            inter_node_bw: None,
        }
    }

    #[test]
    fn takes_the_best_rates_and_shares_host_memory() {
        let node = measured_node(&cpu_profile(), "p", shape()).unwrap();
        assert_eq!(node.gpu.name, "cpu");
        assert!((node.gpu.peak_flops - 0.09e12).abs() < 1.0);
        assert!((node.gpu.hbm_bandwidth - 12e9).abs() < 1.0);
        assert!((node.gpu.memory_bytes - 8e9).abs() < 1.0);
        // The largest all-reduce: 2 (n-1)/n · 64 MB / 40 ms = 1.6 GB/s.
        assert!((node.intra_node_bw.bytes_per_s() - 1.6e9).abs() < 1e3);
        assert_eq!(node.inter_node_bw, node.intra_node_bw);
    }

    #[test]
    fn says_what_to_measure_when_something_is_missing() {
        let mut profile = cpu_profile();
        profile.collectives.clear();
        let e = measured_node(&profile, "p", shape())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("profile comm --ranks 2") && e.contains("--intra-node-bw"),
            "{e}"
        );
        let given = MeasuredNodeShape {
            intra_node_bw: Some(Bandwidth(5e9)),
            ..shape()
        };
        assert_eq!(
            measured_node(&profile, "p", given).unwrap().intra_node_bw,
            Bandwidth(5e9)
        );
        let two = MeasuredNodeShape {
            nodes: 2,
            ..shape()
        };
        let e = measured_node(&cpu_profile(), "p", two)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--inter-node-bw"), "{e}");
        profile.device = None;
        let e = measured_node(&profile, "p", shape())
            .unwrap_err()
            .to_string();
        assert!(e.contains("profile device"), "{e}");
    }
}
