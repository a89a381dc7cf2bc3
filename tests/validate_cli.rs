//! `paratune validate` on bad input, through the binary (default build: no
//! libtorch needed): plans from another version or edited by hand, missing
//! files, and what a build without the `torch` feature says.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_paratune");

fn run(dir: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the binary runs")
}

fn fails(dir: &Path, args: &[&str]) -> String {
    let out = run(dir, args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(2),
        "paratune {}: {stderr}",
        args.join(" ")
    );
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    stderr
}

/// A real plan (GPT-3 13B on one A100 node), as JSON.
fn plan_json(dir: &Path) -> serde_json::Value {
    let out = run(
        dir,
        &[
            "plan",
            "--model",
            "gpt3-13b",
            "--gpu",
            "a100-80gb",
            "--nodes",
            "1",
            "--global-batch",
            "64",
            "--top",
            "3",
            "--format",
            "json",
        ],
    );
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).unwrap()
}

fn write(dir: &Path, name: &str, plan: &serde_json::Value) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(plan).unwrap()).unwrap();
    path
}

#[test]
fn plans_from_elsewhere_are_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let err = fails(d, &["validate", "missing.json", "--device", "cpu"]);
    assert!(err.contains("cannot read plan missing.json"), "{err}");

    std::fs::write(d.join("junk.json"), "{\"not\": \"a plan\"}").unwrap();
    let err = fails(d, &["validate", "junk.json", "--device", "cpu"]);
    assert!(err.contains("--format json"), "{err}");

    let mut plan = plan_json(d);
    plan["version"] = 99.into();
    let path = write(d, "future.json", &plan);
    let err = fails(d, &["validate", path.to_str().unwrap(), "--device", "cpu"]);
    assert!(
        err.contains("plan format version 99") && err.contains("re-run"),
        "{err}"
    );

    let mut plan = plan_json(d);
    plan["candidates"][0]["config"]["tp"] = 3.into();
    let path = write(d, "edited.json", &plan);
    let err = fails(d, &["validate", path.to_str().unwrap(), "--device", "cpu"]);
    assert!(
        err.contains("candidate #1 does not match") && err.contains("edited by hand"),
        "{err}"
    );
}

#[test]
fn a_bad_device_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "plan.json", &plan_json(dir.path()));
    let err = fails(
        dir.path(),
        &["validate", path.to_str().unwrap(), "--device", "tpu"],
    );
    assert!(err.contains("--device: unknown device `tpu`"), "{err}");
}

#[cfg(not(feature = "torch"))]
#[test]
fn without_the_torch_feature_local_trials_say_how_to_get_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "plan.json", &plan_json(dir.path()));
    let err = fails(
        dir.path(),
        &["validate", path.to_str().unwrap(), "--device", "cpu"],
    );
    assert!(
        err.contains("--features torch") && err.contains("--launch megatron"),
        "{err}"
    );
}
