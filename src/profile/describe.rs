//! A profile described for people (`paratune profile show`).

use super::{Measurements, Profile};
use crate::units::thousands;
use std::fmt::Write as _;
use std::path::Path;

fn mib(bytes: f64) -> String {
    let mib = bytes / (1024.0 * 1024.0);
    if mib >= 1024.0 {
        format!("{} GiB", mib / 1024.0)
    } else if mib >= 1.0 {
        format!("{mib} MiB")
    } else {
        format!("{bytes} B")
    }
}

/// A profile as `paratune profile show` prints it: where it came from, its
/// collective curves and layer shapes with their ranges, the device sweep
/// and the commands that made it.
pub fn describe(profile: &Profile, dir: &Path) -> String {
    let mut out = String::new();
    let env = &profile.environment;
    let _ = writeln!(out, "profile {}", dir.display());
    let _ = writeln!(out, "  gpu               {}", env.gpu);
    if !env.source.is_empty() {
        let _ = writeln!(out, "  source            {}", env.source);
    }
    let _ = writeln!(
        out,
        "  date              {} (paratune {})",
        env.date, env.paratune_version
    );
    for note in &env.notes {
        let _ = writeln!(out, "  note              {note}");
    }
    let measurements = Measurements::from_profile(profile);
    let _ = writeln!(
        out,
        "  collectives       {} points",
        thousands(profile.collectives.len() as f64)
    );
    for (op, ranks, low, high) in measurements.curves() {
        let points = profile
            .collectives
            .iter()
            .filter(|p| p.op == op && p.ranks == ranks)
            .count();
        let _ = writeln!(
            out,
            "    {op:<15} {ranks:>3} ranks  {:>6} points  {} .. {}",
            thousands(points as f64),
            mib(low),
            mib(high)
        );
    }
    let _ = writeln!(out, "  layers            {} points", profile.layers.len());
    for (shape, low, high) in measurements.layer_shapes() {
        let _ = writeln!(
            out,
            "    h {} a {} kv {} ffn {}{} {} s {} tp {} sp {:<3} recompute {:<9} micro-batch {low}..{high}",
            shape.hidden,
            shape.heads,
            shape.arch.kv_heads,
            shape.arch.ffn_hidden,
            if shape.arch.gated_mlp { " gated" } else { "" },
            shape.arch.attention.name(),
            shape.seq_len,
            shape.tp,
            if shape.sequence_parallel { "on" } else { "off" },
            shape.recompute.name()
        );
    }
    if let Some(device) = &profile.device {
        let _ = writeln!(
            out,
            "  device            {} ({})",
            device.device, device.runtime
        );
        if let Some(f) = &device.facts {
            let _ = writeln!(
                out,
                "    {}: {:.1} GiB, {} SMs, compute capability {}, driver {}",
                f.name,
                f.memory_bytes / (1u64 << 30) as f64,
                f.multiprocessors,
                f.compute_capability,
                f.driver_version
            );
        }
        for p in &device.matmul {
            let _ = writeln!(
                out,
                "    matmul {:>5}^3 {:<4} {:>8.2} TFLOP/s",
                p.m,
                p.dtype.name(),
                p.tflops
            );
        }
        if let Some(c) = &device.copy {
            let _ = writeln!(out, "    copy {} {:.1} GB/s", mib(c.bytes as f64), c.gbps);
        }
        for p in &device.attention {
            let _ = writeln!(
                out,
                "    attention head {:>3} {:<4} {:>8.2} TFLOP/s forward {:>8.2} backward ({} x {} tokens, causal)",
                p.head_dim,
                p.dtype.name(),
                p.forward_tflops,
                p.backward_tflops,
                p.batch,
                p.seq_len
            );
        }
    }
    for command in &env.commands {
        let _ = writeln!(out, "  made by           {command}");
    }
    out
}
