//! The Cruise loop for real on this machine (feature `torch`, a Python with
//! PyTorch as `python3` or `$PARATUNE_PYTHON`): a CPU "cluster" described
//! by what `profile device` and `profile comm --ranks 2` measured, a tiny
//! model planned for it, and `validate --launch torch --ranks 2 --loop 2`
//! running every candidate's real degrees on two torch.distributed ranks.

#![cfg(feature = "torch")]

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::ok_in as ok;

fn python() -> String {
    std::env::var("PARATUNE_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The worker as the binary ships it.
fn worker() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/validate/torch_worker.py")
}

/// A profile of this CPU: bf16 matrix multiplies, a copy, and gloo
/// collectives between two ranks.
fn measured_profile(dir: &Path) -> PathBuf {
    let profile = dir.join("cpu-profile");
    let out = profile.to_str().unwrap();
    ok(
        dir,
        &[
            "profile",
            "device",
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "--max-side",
            "1024",
            "--max-seconds",
            "2",
            "--out",
            out,
        ],
    );
    let python = python();
    let text = ok(
        dir,
        &[
            "profile",
            "comm",
            "--ranks",
            "2",
            "--max-bytes",
            "8MiB",
            "--python",
            &python,
            "--out",
            out,
        ],
    );
    assert!(text.contains("all_reduce over 2 ranks"), "{text}");
    profile
}

fn plan(dir: &Path, profile: &Path) -> PathBuf {
    let json = ok(
        dir,
        &[
            "plan",
            "--cluster-from-profile",
            profile.to_str().unwrap(),
            "--gpus-per-node",
            "2",
            "--engine",
            "torchtitan",
            "--compile",
            "off",
            "--cuda-graphs",
            "off",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--layers",
            "4",
            "--seq-len",
            "128",
            "--vocab",
            "2048",
            "--global-batch",
            "8",
            "--cost-model",
            "datasheet",
            "--top",
            "8",
            "--format",
            "json",
        ],
    );
    let path = dir.join("plan.json");
    std::fs::write(&path, json).unwrap();
    path
}

/// The percentage after `prefix` in `text`.
fn percent_after(text: &str, prefix: &str) -> f64 {
    let at = text
        .find(prefix)
        .unwrap_or_else(|| panic!("no `{prefix}` in\n{text}"));
    let rest = &text[at + prefix.len()..];
    rest[..rest.find('%').unwrap()].trim().parse().unwrap()
}

#[test]
fn a_measured_cpu_cluster_is_planned_trialled_on_two_ranks_and_refitted() {
    let dir = tempfile::tempdir().unwrap();
    let profile = measured_profile(dir.path());
    let plan_path = plan(dir.path(), &profile);
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_path).unwrap()).unwrap();
    // The "GPU" is the measured CPU, not a guess.
    assert_eq!(plan["nodes"]["gpu"]["name"], "cpu");
    let out = dir.path().join("out");
    let python = python();
    let report = ok(
        dir.path(),
        &[
            "validate",
            plan_path.to_str().unwrap(),
            "--launch",
            "torch",
            "--ranks",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "--iterations",
            "6",
            "--loop",
            "2",
            "--python",
            &python,
            "--timeout",
            "600",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    println!("{report}");

    // Every candidate that ran did so with the degrees it was planned with,
    // as the worker read them back from its live device mesh.
    let mut ran = 0;
    for round in [out.clone(), out.join("round-2")] {
        for entry in std::fs::read_dir(&round).into_iter().flatten() {
            let folder = entry.unwrap().path();
            let job = folder.join("job.json");
            if !job.is_file() {
                continue;
            }
            let job: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&job).unwrap()).unwrap();
            for rank in 0..2 {
                let path = folder.join(format!("report/rank-{rank}.json"));
                let Ok(text) = std::fs::read_to_string(&path) else {
                    continue;
                };
                let rank_report: serde_json::Value = serde_json::from_str(&text).unwrap();
                for degree in ["tp", "pp", "dp"] {
                    assert_eq!(
                        rank_report["degrees"][degree],
                        job["parallel"][degree],
                        "{}: {degree}",
                        path.display()
                    );
                }
                ran += 1;
            }
        }
    }
    assert!(
        ran >= 4,
        "at least two candidates ran on both ranks:\n{report}"
    );

    // Each rank's peak is judged against its stage's prediction: the verdict
    // printed agrees with the figures beside it.
    let memory: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("MiB predicted allocated"))
        .collect();
    assert!(memory.len() >= 4, "{report}");
    for line in memory {
        let error = percent_after(line, "allocated (error ");
        let band = percent_after(line, "band ");
        let within = error.abs() <= band.abs() + 0.5;
        assert_eq!(line.contains("within the band"), within, "{line}");
    }

    // The loop converges and says so: the refit's held-out error after the
    // last round is below the plan's own error on the first round's trials.
    let first = percent_after(&report, "held-out error: ");
    let last_line = report
        .lines()
        .find(|l| l.starts_with("held-out error: "))
        .unwrap();
    let last = percent_after(last_line, "(the plan's model, before any trial), ");
    assert!(last < first, "{first}% -> {last}%:\n{report}");
    // The history holds one row per finished trial.
    let history = std::fs::read_to_string(out.join("runs-history.csv")).unwrap();
    assert!(history.lines().count() > 2, "{history}");
}

/// Runs the worker's configuration mapping without processes.
fn describe(job: &serde_json::Value, world: u64) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.json");
    std::fs::write(&path, job.to_string()).unwrap();
    let output = Command::new(python())
        .arg(worker())
        .args(["--describe", "--job"])
        .arg(&path)
        .args(["--world", &world.to_string()])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn job(parallel: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "schema": 1, "mode": "train", "candidate": 1, "device": "cpu", "backend": "gloo",
        "threads_per_rank": 1, "dtype": "bf16", "seed": 1, "warmup": 1, "iterations": 1,
        "report_dir": "/tmp/unused",
        "model": {"hidden": 64, "heads": 4, "kv_heads": 4, "ffn_hidden": 256, "gated_mlp": false,
                  "layers": 4, "vocab": 512, "seq_len": 64, "tied_embeddings": true,
                  "learned_positions": true, "attention": "flash", "dropout": true},
        "parallel": parallel,
        "comm": null
    })
}

#[test]
fn the_worker_maps_degrees_schedules_and_sharding_as_planned() {
    // Interleaved 1F1B over two pipeline ranks, two chunks each: chunk c on
    // rank c mod 2, as Megatron-LM interleaves.
    let interleaved = describe(
        &job(serde_json::json!({
            "tp": 1, "pp": 2, "dp": 1, "dp_shard": null, "micro_batch": 1, "global_batch": 4,
            "schedule": "interleaved", "virtual_stages": 2, "stage_layers": [1, 1, 1, 1],
            "sequence_parallel": false, "optimizer_sharding": "full", "recompute": "full",
            "ac_frequency": 1
        })),
        2,
    );
    let ranks = interleaved["ranks"].as_array().unwrap();
    assert_eq!(ranks[0]["stages"], serde_json::json!([0, 2]));
    assert_eq!(ranks[1]["stages"], serde_json::json!([1, 3]));
    assert_eq!(ranks[0]["schedule"], "ScheduleInterleaved1F1B");
    assert_eq!(ranks[0]["micro_batches"], 4);
    assert!(
        ranks[0]["data_parallel"]
            .as_str()
            .unwrap()
            .contains("reshard_after_forward=True")
    );
    assert_eq!(ranks[0]["checkpointed_blocks"], 2);

    // Tensor parallelism on 2 of 4 ranks, data parallelism over the other
    // dimension: tp varies fastest (Megatron-LM's rank order), column- and
    // row-parallel projections as torchtitan's plan has them.
    let tp = describe(
        &job(serde_json::json!({
            "tp": 2, "pp": 1, "dp": 2, "dp_shard": null, "micro_batch": 2, "global_batch": 8,
            "schedule": "1f1b", "virtual_stages": 1, "stage_layers": [4],
            "sequence_parallel": true, "optimizer_sharding": "optimizer-states",
            "recompute": "none", "ac_frequency": 1
        })),
        4,
    );
    let ranks = tp["ranks"].as_array().unwrap();
    assert_eq!(
        ranks[1]["mesh_coords"],
        serde_json::json!({"pp": 0, "dp": 0, "tp": 1})
    );
    assert_eq!(
        ranks[2]["mesh_coords"],
        serde_json::json!({"pp": 0, "dp": 1, "tp": 0})
    );
    assert_eq!(ranks[0]["micro_batches"], 2);
    let plan = ranks[0]["tensor_parallel"].as_object().unwrap();
    assert!(plan.values().any(|v| v == "ColwiseParallel"), "{plan:?}");
    assert!(plan.values().any(|v| v == "RowwiseParallel"), "{plan:?}");
    assert!(
        ranks[0]["data_parallel"]
            .as_str()
            .unwrap()
            .contains("reshard_after_forward=False")
    );
}
