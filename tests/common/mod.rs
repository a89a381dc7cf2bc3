//! What the CLI test files share: running the binary and the documented
//! ways a command must succeed or fail. Each test file uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub const BIN: &str = env!("CARGO_BIN_EXE_paratune");

/// `command` for Llama 3 8B on one node of `gpu`, then `extra`: the job
/// most CLI tests start from.
pub fn llama3_8b_on<'a>(command: &'a str, gpu: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let job = [
        command,
        "--model",
        "llama3-8b",
        "--gpu",
        gpu,
        "--nodes",
        "1",
    ];
    job.iter().chain(extra).copied().collect()
}

/// The repository root (where shipped profiles and test data are).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn text(path: &Path) -> &str {
    path.to_str().expect("test paths are UTF-8")
}

/// `tests/data/<folder>/<name>`, as an argument.
pub fn test_data(folder: &str, name: &str) -> String {
    text(&root().join("tests/data").join(folder).join(name)).to_string()
}

/// A runs CSV a command wrote.
pub fn read_table(path: &Path) -> paratune::runs::RunTable {
    paratune::runs::RunTable::read(path).unwrap_or_else(|e| panic!("{e}"))
}

/// A numeric cell of a runs CSV.
pub fn number(table: &paratune::runs::RunTable, row: usize, column: &str) -> f64 {
    table
        .cell(row, column)
        .unwrap_or_else(|| panic!("row {row} has no {column}"))
        .parse()
        .unwrap_or_else(|e| panic!("{column}: {e}"))
}

/// `validate PLAN --launch megatron --megatron-path MEGATRON`: a plan's
/// trials through Megatron-LM launch scripts, the start of every such
/// test's command.
pub fn validate_with_megatron<'a>(plan: &'a Path, megatron: &'a Path) -> [&'a str; 6] {
    [
        "validate",
        plan.to_str().unwrap(),
        "--launch",
        "megatron",
        "--megatron-path",
        megatron.to_str().unwrap(),
    ]
}

/// A real plan (GPT-3 13B on one A100 node) that Megatron-LM can run (no
/// ZeRO-3, BPipe or GPipe), as JSON.
pub fn megatron_plan_json(dir: &Path) -> serde_json::Value {
    megatron_plan_json_with(dir, &[])
}

/// [`megatron_plan_json`] with `extra` flags for `plan`.
pub fn megatron_plan_json_with(dir: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
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
        "--optimizer-sharding",
        "none,optimizer-states",
        "--bpipe",
        "off",
        "--schedule",
        "1f1b,interleaved",
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    serde_json::from_str(&ok_in(dir, &args)).unwrap()
}

/// The reference all-reduce table imported as the profile `dir/p`.
pub fn import_reference_profile(dir: &Path) -> PathBuf {
    let table = root().join("tests/data/reference/a100_nccl_allreduce.csv");
    ok_in(
        dir,
        &[
            "profile",
            "import-table",
            text(&table),
            "--op",
            "all_reduce",
            "--gpu",
            "a100-80gb",
            "--out",
            "p",
        ],
    );
    dir.join("p")
}

/// What one run printed and how it ended.
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `paratune args` in `dir` (no colours).
pub fn run_in(dir: &Path, args: &[&str]) -> Output {
    let output = Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .expect("the paratune binary runs");
    Output {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs `paratune args` in the repository root.
pub fn run(args: &[&str]) -> Output {
    run_in(&root(), args)
}

/// Runs a command in `dir` that must succeed without a panic.
pub fn ok_output_in(dir: &Path, args: &[&str]) -> Output {
    let out = run_in(dir, args);
    assert_eq!(
        out.code,
        Some(0),
        "paratune {} failed:\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        out.stdout,
        out.stderr
    );
    assert!(
        !out.stderr.contains("panicked"),
        "paratune {} panicked:\n{}",
        args.join(" "),
        out.stderr
    );
    out
}

/// [`ok_output_in`] in the repository root, returning standard output.
pub fn ok(args: &[&str]) -> String {
    ok_output_in(&root(), args).stdout
}

/// [`ok_output_in`], returning standard output.
pub fn ok_in(dir: &Path, args: &[&str]) -> String {
    ok_output_in(dir, args).stdout
}

/// [`ok_output_in`] in the repository root.
pub fn ok_output(args: &[&str]) -> Output {
    ok_output_in(&root(), args)
}

/// Runs a command in `dir` that must fail the documented way: exit code 2,
/// nothing on stdout, exactly one stderr line starting with `error:`, no
/// panic. Returns that line.
pub fn fails_in(dir: &Path, args: &[&str]) -> String {
    let out = run_in(dir, args);
    let shown = format!("paratune {}", args.join(" "));
    assert!(
        !out.stderr.contains("panicked"),
        "{shown} panicked:\n{}",
        out.stderr
    );
    assert_eq!(
        out.code,
        Some(2),
        "{shown}: exit code\nstdout:\n{}\nstderr:\n{}",
        out.stdout,
        out.stderr
    );
    assert!(
        out.stdout.is_empty(),
        "{shown}: printed on stdout before failing:\n{}",
        out.stdout
    );
    let lines: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "{shown}: the error should be one line:\n{}",
        out.stderr
    );
    assert!(
        lines[0].starts_with("error: "),
        "{shown}: the error should start with `error: `: {}",
        lines[0]
    );
    lines[0].to_string()
}

/// [`fails_in`] in the repository root.
pub fn fails(args: &[&str]) -> String {
    fails_in(&root(), args)
}

/// Asserts that `message` contains every one of `parts`.
pub fn says(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(
            message.contains(part),
            "expected `{part}` in the message:\n{message}"
        );
    }
}
