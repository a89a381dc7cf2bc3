//! Cluster TOML files: one `[[nodes]]` table per kind of node.
//!
//! ```toml
//! [[nodes]]
//! gpu = "a100-80gb"           # a built-in GPU, or an inline table:
//!                             # { name = "x", peak_tflops = 312.0, memory = "80GiB", hbm_bandwidth = "2039GB/s" }
//!                             # optional: fp8_peak_tflops, fp4_peak_tflops (dense), host_link_bw
//! count = 16                  # number of nodes (required)
//! gpus_per_node = 8           # default: the built-in node's (8)
//! intra_node_bw = "300GB/s"   # per GPU, per direction; default: the built-in node's
//! inter_node_bw = "8x200Gb/s" # per node, all NICs; default: the built-in node's
//! ```
//!
//! Bandwidths and memory sizes need units. With an inline GPU there is no
//! built-in node to take defaults from, so both bandwidths must be given
//! (`gpus_per_node` still defaults to 8). Several `[[nodes]]` tables make a
//! heterogeneous cluster, which is read here and refused by the cost model.
//!
//! Every error is one line that starts with the file's path.

use super::{Cluster, GpuSpec, NodeGroup, builtin_gpu_names, builtin_node};
use crate::suggest::did_you_mean;
use crate::units::{Bandwidth, Bytes};
use std::path::Path;
use toml::{Table, Value};

#[derive(Debug, thiserror::Error)]
pub enum ClusterFileError {
    /// The I/O error is part of the message, not a `source`: callers print
    /// the chain (`{:#}`), which would repeat it.
    #[error("{path}: cannot read cluster file: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

const NODE_KEYS: [&str; 5] = [
    "gpu",
    "count",
    "gpus_per_node",
    "intra_node_bw",
    "inter_node_bw",
];
const GPU_KEYS: [&str; 7] = [
    "name",
    "peak_tflops",
    "memory",
    "hbm_bandwidth",
    "fp8_peak_tflops",
    "fp4_peak_tflops",
    "host_link_bw",
];
const DEFAULT_GPUS_PER_NODE: u64 = 8;

/// Parses a cluster file's text; `path` names the file in messages.
pub fn parse_cluster_toml(text: &str, path: &str) -> Result<Cluster, ClusterFileError> {
    parse(text).map_err(|message| ClusterFileError::Invalid {
        path: path.to_string(),
        message,
    })
}

pub fn load_cluster_file(path: &Path) -> Result<Cluster, ClusterFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|error| ClusterFileError::Read {
        path: shown.clone(),
        error,
    })?;
    parse_cluster_toml(&text, &shown)
}

const EXAMPLE: &str = "`[[nodes]]` with `gpu = \"h100-sxm\"` and `count = 4`";

fn parse(text: &str) -> Result<Cluster, String> {
    let table: Table = text.parse().map_err(|e| crate::toml_error::one_line(&e, text, "fix the syntax (`[[nodes]]` headers, then `key = value` lines, strings in double quotes)"))?;
    for key in table.keys() {
        if key == "nodes" {
            continue;
        }
        if NODE_KEYS.contains(&key.as_str()) {
            return Err(format!(
                "`{key}` is outside any node table; put a `[[nodes]]` line above it"
            ));
        }
        return Err(format!(
            "unknown key `{key}` (a cluster file holds `[[nodes]]` tables only){}",
            did_you_mean(key, &["nodes"])
        ));
    }
    let groups = match table.get("nodes") {
        None => return Err(format!("no node table; add {EXAMPLE}")),
        Some(Value::Array(groups)) if groups.is_empty() => {
            return Err(format!("no node table; add {EXAMPLE}"));
        }
        Some(Value::Array(groups)) => groups,
        Some(Value::Table(_)) => {
            return Err(
                "`[nodes]` is a single table; write `[[nodes]]` (double brackets), once per \
                 kind of node"
                    .into(),
            );
        }
        Some(other) => {
            return Err(format!(
                "`nodes = {other}` is not a node table; write {EXAMPLE}"
            ));
        }
    };
    let groups = groups
        .iter()
        .enumerate()
        .map(|(i, group)| {
            let at = format!("[[nodes]] #{}", i + 1);
            match group {
                Value::Table(group) => node_group(group, &at),
                other => Err(format!("{at}: `{other}` is not a table; write {EXAMPLE}")),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Cluster { groups })
}

fn node_group(table: &Table, at: &str) -> Result<NodeGroup, String> {
    for key in table.keys() {
        if !NODE_KEYS.contains(&key.as_str()) {
            return Err(format!(
                "{at}: unknown key `{key}` (remove it or correct its spelling){}",
                did_you_mean(key, &NODE_KEYS)
            ));
        }
    }
    let count = match table.get("count") {
        None => {
            return Err(format!(
                "{at}: `count` is missing; add the number of nodes, e.g. `count = 4`"
            ));
        }
        Some(_) => positive(table, "count", at, "a positive number of nodes")?,
    };
    let mut group = match table.get("gpu") {
        None => {
            return Err(format!(
                "{at}: `gpu` is missing; add a built-in GPU (one of {}) or an inline table \
                 `{{ name = \"x\", peak_tflops = ..., memory = \"80GiB\", hbm_bandwidth = \"2TB/s\" }}`",
                builtin_gpu_names().join(", ")
            ));
        }
        Some(Value::String(name)) => builtin_node(name, count).ok_or_else(|| {
            format!(
                "{at}: unknown GPU `{name}` (use a built-in name, or describe it inline as \
                 `gpu = {{ name = \"{name}\", peak_tflops = ..., memory = ..., hbm_bandwidth = ... }}`){}",
                did_you_mean(name, &builtin_gpu_names())
            )
        })?,
        Some(Value::Table(gpu)) => {
            let gpu = inline_gpu(gpu, at)?;
            for (key, example) in [("intra_node_bw", "300GB/s"), ("inter_node_bw", "8x200Gb/s")] {
                if !table.contains_key(key) {
                    return Err(format!(
                        "{at}: `{key}` is missing; an inline GPU has no built-in node to take \
                         it from, so add e.g. `{key} = \"{example}\"`"
                    ));
                }
            }
            NodeGroup {
                gpu,
                nodes: count,
                gpus_per_node: DEFAULT_GPUS_PER_NODE,
                intra_node_bw: bandwidth(&table["intra_node_bw"], "intra_node_bw", at)?,
                inter_node_bw: bandwidth(&table["inter_node_bw"], "inter_node_bw", at)?,
            }
        }
        Some(other) => {
            return Err(format!(
                "{at}: `gpu = {other}` is neither a GPU name in double quotes nor an inline table"
            ));
        }
    };
    if table.contains_key("gpus_per_node") {
        group.gpus_per_node = positive(table, "gpus_per_node", at, "a positive integer")?;
    }
    if let Some(value) = table.get("intra_node_bw") {
        group.intra_node_bw = bandwidth(value, "intra_node_bw", at)?;
    }
    if let Some(value) = table.get("inter_node_bw") {
        group.inter_node_bw = bandwidth(value, "inter_node_bw", at)?;
    }
    Ok(group)
}

/// An optional dense low-precision peak of an inline GPU, FLOP/s: `key`
/// in TFLOP/s, a positive number, or absent for a GPU without `format`'s
/// tensor cores (`example` shows a value in the message).
fn optional_peak(
    table: &Table,
    at: &str,
    (key, format, example): (&str, &str, f64),
) -> Result<Option<f64>, String> {
    match table.get(key) {
        None => Ok(None),
        Some(Value::Integer(n)) if *n > 0 => Ok(Some(*n as f64 * 1e12)),
        Some(Value::Float(x)) if x.is_finite() && *x > 0.0 => Ok(Some(x * 1e12)),
        Some(other) => Err(format!(
            "{at}: `{key}` must be a positive number of dense {format} TFLOP/s, \
             e.g. `{key} = {example:.1}`, or left out for a GPU without {format}, not `{other}`"
        )),
    }
}

fn inline_gpu(table: &Table, at: &str) -> Result<GpuSpec, String> {
    for key in table.keys() {
        if !GPU_KEYS.contains(&key.as_str()) {
            return Err(format!(
                "{at}: unknown key `{key}` in the inline `gpu` table{}",
                did_you_mean(key, &GPU_KEYS)
            ));
        }
    }
    // All but the FP8 peak, which a GPU without FP8 leaves out.
    let required = &GPU_KEYS[..4];
    if let Some(missing) = required.iter().find(|k| !table.contains_key(**k)) {
        return Err(format!(
            "{at}: the inline `gpu` table lacks `{missing}`; give all of \
             `name = \"x\", peak_tflops = 312.0, memory = \"80GiB\", hbm_bandwidth = \"2039GB/s\"`"
        ));
    }
    let name = match &table["name"] {
        Value::String(s) if !s.trim().is_empty() => s.clone(),
        other => {
            return Err(format!(
                "{at}: the inline GPU's `name` must be a non-empty string in double quotes, not `{other}`"
            ));
        }
    };
    let peak_tflops = match &table["peak_tflops"] {
        Value::Integer(n) if *n > 0 => *n as f64,
        Value::Float(x) if x.is_finite() && *x > 0.0 => *x,
        other => {
            return Err(format!(
                "{at}: `peak_tflops` must be a positive number of dense 16-bit TFLOP/s, \
                 e.g. `peak_tflops = 312.0`, not `{other}`"
            ));
        }
    };
    let memory = with_units::<Bytes>(&table["memory"], "memory", at)?.0;
    let hbm = bandwidth(&table["hbm_bandwidth"], "hbm_bandwidth", at)?;
    let fp8_peak_flops = optional_peak(table, at, ("fp8_peak_tflops", "FP8", 1979.0))?;
    let fp4_peak_flops = optional_peak(table, at, ("fp4_peak_tflops", "FP4", 9000.0))?;
    // Per direction, as the catalogue gives it; only activation
    // offloading reads it.
    let host_link_bandwidth = match table.get("host_link_bw") {
        None => None,
        Some(value) => Some(bandwidth(value, "host_link_bw", at)?.bytes_per_s()),
    };
    Ok(GpuSpec {
        name,
        peak_flops: peak_tflops * 1e12,
        memory_bytes: memory,
        hbm_bandwidth: hbm.bytes_per_s(),
        fp8_peak_flops,
        fp4_peak_flops,
        host_link_bandwidth,
    })
}

fn positive(table: &Table, key: &str, at: &str, what: &str) -> Result<u64, String> {
    // Far above any machine; keeps GPU counts clear of overflow.
    let max: i64 = if key == "gpus_per_node" {
        1 << 10
    } else {
        1 << 17
    };
    match &table[key] {
        Value::Integer(n) if *n > max => Err(format!(
            "{at}: `{key} = {n}` is more than paratune plans for (at most {max})"
        )),
        Value::Integer(n) if *n > 0 => Ok(*n as u64),
        other => Err(format!("{at}: `{key}` must be {what}, not `{other}`")),
    }
}

fn bandwidth(value: &Value, key: &str, at: &str) -> Result<Bandwidth, String> {
    with_units(value, key, at)
}

/// A quantity written as a string with its unit. A bare TOML number goes
/// through the same parser so that its message says which unit is missing.
fn with_units<T: std::str::FromStr<Err = String>>(
    value: &Value,
    key: &str,
    at: &str,
) -> Result<T, String> {
    let (text, quoted) = match value {
        Value::String(s) => (s.clone(), true),
        other => (other.to_string(), false),
    };
    text.parse::<T>().map_err(|e| {
        let hint = if quoted {
            ""
        } else {
            "; write it in double quotes, with its unit"
        };
        format!("{at}: `{key}`: {e}{hint}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::builtin_gpu;

    fn error(text: &str) -> String {
        let e = parse_cluster_toml(text, "clusters/mine.toml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("clusters/mine.toml: "), "{e}");
        assert!(!e.contains('\n'), "not one line: {e}");
        e
    }

    fn gb(b: Bandwidth) -> f64 {
        b.bytes_per_s() / 1e9
    }

    #[test]
    fn a_catalogue_gpu_takes_the_builtin_node() {
        let c =
            parse_cluster_toml("[[nodes]]\ngpu = \"A100-80GB\"\ncount = 16\n", "c.toml").unwrap();
        assert_eq!(c, Cluster::single(builtin_node("a100-80gb", 16).unwrap()));
        assert_eq!(c.total_gpus(), 128);
    }

    #[test]
    fn the_documented_example_reads_with_overrides() {
        let text = r#"
            [[nodes]]
            gpu = "a100-80gb"          # a catalogue name
            count = 16                 # number of nodes (required)
            gpus_per_node = 4
            intra_node_bw = "150GB/s"
            inter_node_bw = "4x200Gb/s"
        "#;
        let c = parse_cluster_toml(text, "c.toml").unwrap();
        let g = c.homogeneous().unwrap();
        assert_eq!((g.nodes, g.gpus_per_node), (16, 4));
        assert_eq!((gb(g.intra_node_bw), gb(g.inter_node_bw)), (150.0, 100.0));
        assert_eq!(g.gpu, builtin_gpu("a100-80gb").unwrap());
    }

    #[test]
    fn an_inline_gpu_is_described_in_full() {
        let text = r#"
            [[nodes]]
            gpu = { name = "mi250x", peak_tflops = 383, memory = "128GiB", hbm_bandwidth = "3.2TB/s" }
            count = 2
            intra_node_bw = "100GB/s"
            inter_node_bw = "4x200Gb/s"
        "#;
        let c = parse_cluster_toml(text, "c.toml").unwrap();
        let g = &c.groups[0];
        assert_eq!(g.gpu.name, "mi250x");
        assert_eq!(g.gpu.peak_flops, 383e12);
        assert_eq!(g.gpu.memory_gib(), 128.0);
        assert!((g.gpu.hbm_bandwidth - 3.2e12).abs() < 1.0);
        assert_eq!((g.nodes, g.gpus_per_node), (2, 8));
        assert_eq!((g.gpu.fp8_peak_flops, g.gpu.fp4_peak_flops), (None, None));
        // Lower-precision peaks are optional keys, positive numbers.
        let with_peaks = text.replace(
            "hbm_bandwidth = \"3.2TB/s\" }",
            "hbm_bandwidth = \"3.2TB/s\", fp8_peak_tflops = 766, fp4_peak_tflops = 1532.0 }",
        );
        let g = &parse_cluster_toml(&with_peaks, "c.toml").unwrap().groups[0];
        assert_eq!(
            (g.gpu.fp8_peak_flops, g.gpu.fp4_peak_flops),
            (Some(766e12), Some(1532e12))
        );
        let negative = with_peaks.replace("1532.0", "-1.0");
        let err = parse_cluster_toml(&negative, "c.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`fp4_peak_tflops` must be a positive number"),
            "{err}"
        );
    }

    #[test]
    fn several_node_tables_make_a_heterogeneous_cluster() {
        let text = "[[nodes]]\ngpu = \"h100-sxm\"\ncount = 2\n\n\
                    [[nodes]]\ngpu = \"a100-40gb\"\ncount = 3\n";
        let c = parse_cluster_toml(text, "c.toml").unwrap();
        assert_eq!(c.groups.len(), 2);
        assert_eq!(c.total_gpus(), 40);
        assert!(c.homogeneous().is_err());
    }

    #[test]
    fn unknown_keys_suggest_the_closest_one() {
        let e = error("[[nodes]]\ngpu = \"h200\"\ncount = 1\ninternode_bw = \"1TB/s\"\n");
        assert!(
            e.contains("[[nodes]] #1: unknown key `internode_bw`"),
            "{e}"
        );
        assert!(e.contains("did you mean `inter_node_bw`?"), "{e}");
        let e = error("[[node]]\ngpu = \"h200\"\ncount = 1\n");
        assert!(
            e.contains("unknown key `node`") && e.ends_with("; did you mean `nodes`?"),
            "{e}"
        );
        let e = error("gpu = \"h200\"\n[[nodes]]\ncount = 1\n");
        assert!(e.contains("put a `[[nodes]]` line above it"), "{e}");
        let e = error(
            "[[nodes]]\ngpu = { name = \"x\", peak_tflop = 1, memory = \"1GiB\", \
             hbm_bandwidth = \"1TB/s\" }\ncount = 1\n",
        );
        assert!(e.contains("did you mean `peak_tflops`?"), "{e}");
    }

    #[test]
    fn an_unknown_gpu_suggests_a_catalogue_name() {
        let e = error("[[nodes]]\ngpu = \"h100-sxm5\"\ncount = 1\n");
        assert!(
            e.contains("unknown GPU `h100-sxm5` (use a built-in")
                && e.ends_with("; did you mean `h100-sxm`?"),
            "{e}"
        );
        let e = error("[[nodes]]\ngpu = \"tpu-v5p-pod\"\ncount = 1\n");
        assert!(e.contains("known: a100-40gb"), "{e}");
    }

    #[test]
    fn a_bare_number_bandwidth_is_the_units_error_naming_the_field() {
        let e = error("[[nodes]]\ngpu = \"h200\"\ncount = 1\nintra_node_bw = 300\n");
        assert!(
            e.contains("`intra_node_bw`: `300` is not a bandwidth"),
            "{e}"
        );
        assert!(e.contains("150GB/s"), "{e}");
        let e = error("[[nodes]]\ngpu = \"h200\"\ncount = 1\ninter_node_bw = \"400\"\n");
        assert!(
            e.contains("`inter_node_bw`: `400` is not a bandwidth"),
            "{e}"
        );
        let e = error(
            "[[nodes]]\ngpu = { name = \"x\", peak_tflops = 1.5, memory = 80, \
             hbm_bandwidth = \"1TB/s\" }\ncount = 1\n",
        );
        assert!(e.contains("`memory`: `80` is not a memory size"), "{e}");
    }

    #[test]
    fn counts_must_be_positive() {
        let e = error("[[nodes]]\ngpu = \"h200\"\ncount = 0\n");
        assert!(
            e.contains("`count` must be a positive number of nodes, not `0`"),
            "{e}"
        );
        let e = error("[[nodes]]\ngpu = \"h200\"\ncount = -2\n");
        assert!(
            e.contains("`count` must be a positive number of nodes"),
            "{e}"
        );
        let e = error("[[nodes]]\ngpu = \"h200\"\n");
        assert!(e.contains("`count` is missing"), "{e}");
        let e = error("[[nodes]]\ngpu = \"h200\"\ncount = 1\ngpus_per_node = 0\n");
        assert!(
            e.contains("`gpus_per_node` must be a positive integer"),
            "{e}"
        );
    }

    #[test]
    fn structural_mistakes_say_how_to_fix_them() {
        let e = error("");
        assert!(e.contains("no node table; add `[[nodes]]`"), "{e}");
        let e = error("[nodes]\ngpu = \"h200\"\ncount = 1\n");
        assert!(e.contains("write `[[nodes]]` (double brackets)"), "{e}");
        let e = error("[[nodes]]\ncount = 1\n");
        assert!(e.contains("`gpu` is missing"), "{e}");
        let e = error("[[nodes]]\ngpu = { name = \"x\", peak_tflops = 1.0 }\ncount = 1\n");
        assert!(e.contains("lacks `memory`"), "{e}");
        let e = error(
            "[[nodes]]\ngpu = { name = \"x\", peak_tflops = 1.0, memory = \"1GiB\", \
             hbm_bandwidth = \"1TB/s\" }\ncount = 1\n",
        );
        assert!(e.contains("`intra_node_bw` is missing"), "{e}");
        let e = error("[[nodes]]\ngpu = \"h200\"\ncount = = 1\n");
        assert!(e.contains("invalid TOML at line 3"), "{e}");
    }

    #[test]
    fn files_are_loaded_from_disk_and_a_missing_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.toml");
        std::fs::write(&path, "[[nodes]]\ngpu = \"v100-32gb\"\ncount = 2\n").unwrap();
        assert_eq!(load_cluster_file(&path).unwrap().total_gpus(), 16);
        let missing = dir.path().join("absent.toml");
        let e = load_cluster_file(&missing).unwrap_err().to_string();
        assert!(e.starts_with(&missing.display().to_string()), "{e}");
        assert!(e.contains("cannot read cluster file"), "{e}");
    }
}
