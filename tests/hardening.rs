//! The malformed-input campaign, kept as a suite: one table of cases per
//! kind of input (run tables, Megatron-LM logs, nccl-tests logs and tables,
//! profile directories, plan files, cost-model files, flags, TOML files),
//! each case an input and the parts its one-line error must name. A new
//! kind of input gets its own table the same way. Then what reaches a shell
//! script (it must never run a command of the input's), and outputs that
//! must be whole after a kill and readable by others.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{
    BIN, fails_in, import_reference_profile, megatron_plan_json, ok_in, root, run_in, says,
    validate_with_megatron,
};

/// A case: what it is, the input's text, the parts the error names.
struct Case {
    what: &'static str,
    input: String,
    names: &'static [&'static str],
}

fn case(what: &'static str, input: impl Into<String>, names: &'static [&'static str]) -> Case {
    Case {
        what,
        input: input.into(),
        names,
    }
}

/// Runs every case: writes its input to `file` in a fresh folder, runs the
/// command `args` gives for that path, and checks the one-line error.
fn campaign(cases: &[Case], file: &str, args: impl Fn(&str) -> Vec<String>) {
    for c in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file);
        std::fs::write(&path, &c.input).unwrap();
        let args = args(path.to_str().unwrap());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = fails_in(dir.path(), &args);
        for part in c.names {
            assert!(
                err.contains(part),
                "{}: expected `{part}` in the error:\n{err}",
                c.what
            );
        }
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `base` then `extra`, as owned arguments.
fn strings_with(base: &[&str], extra: &[&str]) -> Vec<String> {
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

const RUNS_HEADER: &str =
    "gpus,global_batch,micro_batch,hidden,heads,layers,seq_len,tp,dp,pp,iter_ms";

fn run_table_cases() -> Vec<Case> {
    let row = |cells: &str| format!("{RUNS_HEADER}\n8,16,2,1024,16,24,1024,2,2,2,219.7\n{cells}\n");
    vec![
        case(
            "global batch 0",
            row("8,0,2,1024,16,24,1024,2,2,2,219.7"),
            &["line 3", "global_batch", "at least 1"],
        ),
        case(
            "micro-batch 0",
            row("8,16,0,1024,16,24,1024,2,2,2,219.7"),
            &["line 3", "micro_batch", "at least 1"],
        ),
        case(
            "a time that is not a number",
            row("8,16,2,1024,16,24,1024,2,2,2,fast"),
            &["line 3", "iter_ms", "positive number"],
        ),
        case(
            "a negative time",
            row("8,16,2,1024,16,24,1024,2,2,2,-5"),
            &["line 3", "iter_ms"],
        ),
        case(
            "NaN as a time",
            row("8,16,2,1024,16,24,1024,2,2,2,NaN"),
            &["line 3", "iter_ms"],
        ),
        case(
            "a degree in scientific notation",
            row("8,16,2,1e3,16,24,1024,2,2,2,219.7"),
            &["line 3", "hidden", "whole number"],
        ),
        case(
            "a cell missing",
            row("8,16,2,1024,16,24,1024,2,2,219.7"),
            &["line 3", "cell(s)"],
        ),
        case(
            "an absurd GPU count",
            row("99999999999,16,2,1024,16,24,1024,2,2,2,219.7"),
            &["line 3", "gpus", "more than"],
        ),
    ]
}

#[test]
fn run_tables_refuse_impossible_rows_in_every_command_that_reads_them() {
    let cases = run_table_cases();
    let common = [
        "--gpu",
        "a100-80gb",
        "--vocab",
        "50257",
        "--recompute",
        "full",
    ];
    for command in ["predict", "evaluate", "calibrate"] {
        campaign(&cases, "runs.csv", |path| {
            let mut args = strings(&[command, "--runs", path]);
            args.extend(strings(&common));
            if command == "calibrate" {
                args.extend(strings(&["--bootstrap", "0", "--folds", "0"]));
            }
            args
        });
    }
}

fn complete_log() -> String {
    std::fs::read_to_string(root().join("tests/data/megatron/gpt345m-tp2-pp2-dp2-complete.log"))
        .unwrap()
}

/// The complete log with one argument of its dump set to `value`.
fn log_with(argument: &str, value: &str) -> String {
    complete_log()
        .lines()
        .map(|line| {
            let trimmed = line.trim_start();
            match trimmed.split_once(' ') {
                Some((name, rest)) if name == argument && rest.trim_start().starts_with('.') => {
                    let dots_end = rest.rfind(' ').unwrap_or(0);
                    format!("  {name} {} {value}", &rest[..dots_end].trim())
                }
                _ => line.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[test]
fn megatron_logs_whose_configuration_cannot_be_refuse_to_become_rows() {
    let cases = vec![
        case(
            "data-parallel size that does not make the world size",
            log_with("data_parallel_size", "4"),
            &["world_size is 8", "is the dump from this run"],
        ),
        case(
            "world size that tp x pp x dp cannot make",
            log_with("world_size", "12"),
            &["world_size"],
        ),
        case(
            "global batch 0",
            log_with("global_batch_size", "0"),
            &["global_batch_size", "at least 1"],
        ),
        case(
            "micro-batch above the global batch",
            log_with("micro_batch_size", "32"),
            &["global_batch_size 16", "larger than the global batch"],
        ),
    ];
    campaign(&cases, "run.log", |path| {
        strings(&["ingest", "megatron-log", path, "--out", "runs.csv"])
    });
}

#[test]
fn one_absurd_iteration_does_not_move_a_runs_time() {
    let dir = tempfile::tempdir().unwrap();
    let log = complete_log().replacen(
        "elapsed time per iteration (ms): 310.2",
        "elapsed time per iteration (ms): 1e30",
        1,
    );
    assert!(log.contains("1e30"));
    let path = dir.path().join("run.log");
    std::fs::write(&path, log).unwrap();
    let out = run_in(
        dir.path(),
        &[
            "ingest",
            "megatron-log",
            path.to_str().unwrap(),
            "--out",
            "runs.csv",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    says(&out.stdout, &["ms/iteration (median"]);
    says(&out.stderr, &["more than 3x the median"]);
    let table = std::fs::read_to_string(dir.path().join("runs.csv")).unwrap();
    let header: Vec<&str> = table.lines().next().unwrap().split(',').collect();
    let row: Vec<&str> = table.lines().nth(1).unwrap().split(',').collect();
    let at = header.iter().position(|h| *h == "iter_ms").unwrap();
    let ms: f64 = row[at].parse().unwrap();
    assert!((300.0..330.0).contains(&ms), "iter_ms {ms}");
}

fn nccl_log_with_row(row: &str) -> String {
    let log =
        std::fs::read_to_string(root().join("tests/data/nccl/all_reduce_perf_8xa100.txt")).unwrap();
    let mut lines: Vec<String> = log.lines().map(str::to_string).collect();
    let first_row = lines
        .iter()
        .position(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .unwrap();
    lines.insert(first_row, row.to_string());
    lines.join("\n") + "\n"
}

#[test]
fn collective_measurements_with_impossible_values_are_refused_or_counted() {
    let huge = "1000000000000000000000000000000 250000000000000000000000000000 float sum -1 9999.9 0.10 0.20 0 9999.9 0.10 0.20 0";
    let cases = vec![case(
        "a size beyond 1 TiB",
        nccl_log_with_row(huge),
        &["line", "size", "1 TiB"],
    )];
    campaign(&cases, "all_reduce_perf.txt", |path| {
        strings(&[
            "profile",
            "import-nccl-tests",
            path,
            "--gpu",
            "a100-80gb",
            "--out",
            "p",
        ])
    });
    let header = "gpus,bytes,elements,dtype,out_of_place_us,out_of_place_busbw_GBps,in_place_us,in_place_busbw_GBps";
    let table =
        |row: &str| format!("{header}\n2,1048576,262144,float,44.2,23.7,45.1,23.2\n{row}\n");
    let cases = vec![
        case(
            "bytes 1e30",
            table("2,1e30,262144,float,44.2,23.7,45.1,23.2"),
            &["line 3", "bytes"],
        ),
        case(
            "a time of 0",
            table("2,1048576,262144,float,0,23.7,45.1,23.2"),
            &["line 3", "out_of_place_us", "positive"],
        ),
        case(
            "NaN as a time",
            table("2,1048576,262144,float,NaN,23.7,45.1,23.2"),
            &["line 3", "out_of_place_us"],
        ),
        case(
            "0 GPUs",
            table("0,1048576,262144,float,44.2,23.7,45.1,23.2"),
            &["line 3", "gpus"],
        ),
    ];
    campaign(&cases, "table.csv", |path| {
        strings(&[
            "profile",
            "import-table",
            path,
            "--op",
            "all_reduce",
            "--gpu",
            "a100-80gb",
            "--out",
            "p",
        ])
    });
    // nccl-tests' own zero-size rows are left out, and the output says how many.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all_reduce_perf.txt");
    std::fs::write(
        &path,
        nccl_log_with_row("0 0 float sum -1 5.10 0.00 0.00 0 5.20 0.00 0.00 0"),
    )
    .unwrap();
    let out = ok_in(
        dir.path(),
        &[
            "profile",
            "import-nccl-tests",
            path.to_str().unwrap(),
            "--gpu",
            "a100-80gb",
            "--out",
            "p",
        ],
    );
    says(&out, &["1 row(s) of size or time 0 left out"]);
}

/// A CSV-only profile directory (as a user writes one by hand).
fn csv_profile(collectives: &str, layers: Option<&str>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p");
    std::fs::create_dir_all(&p).unwrap();
    std::fs::write(p.join("environment.toml"), "gpu = \"a100-80gb\"\n").unwrap();
    std::fs::write(p.join("collectives.csv"), collectives).unwrap();
    if let Some(layers) = layers {
        std::fs::write(p.join("layers.csv"), layers).unwrap();
    }
    dir
}

#[test]
fn profile_tables_with_impossible_values_name_the_file_and_row() {
    let header = "op,ranks,bytes,seconds,busbw_GBps";
    let layers_header = "hidden,heads,seq_len,micro_batch,tp,sequence_parallel,recompute,dtype,forward_s,backward_s,status";
    for (what, collectives, layers, names) in [
        (
            "NaN seconds",
            format!("{header}\nall_reduce,8,1048576,NaN,10\n"),
            None,
            &["collectives.csv", "row 1", "seconds"][..],
        ),
        (
            "negative bytes",
            format!("{header}\nall_reduce,8,-5,0.001,10\n"),
            None,
            &["collectives.csv", "row 1", "bytes"][..],
        ),
        (
            "0 ranks",
            format!("{header}\nall_reduce,8,1048576,0.001,10\nall_reduce,0,1048576,0.001,10\n"),
            None,
            &["collectives.csv", "row 2", "ranks"][..],
        ),
        (
            "a negative layer time",
            format!("{header}\n"),
            Some(format!(
                "{layers_header}\n1024,16,1024,1,1,false,none,bf16,-0.005,0.01,ok\n"
            )),
            &["layers.csv", "row 1", "forward_s"][..],
        ),
    ] {
        let dir = csv_profile(&collectives, layers.as_deref());
        for args in [
            vec!["profile", "show", "p"],
            vec![
                "plan",
                "--model",
                "gpt3-13b",
                "--gpu",
                "a100-80gb",
                "--nodes",
                "1",
                "--global-batch",
                "64",
                "--profile",
                "p",
            ],
        ] {
            let err = fails_in(dir.path(), &args);
            for part in names {
                assert!(err.contains(part), "{what}: expected `{part}` in:\n{err}");
            }
        }
    }
}

#[test]
fn a_damaged_parquet_table_is_refused_by_its_checksum() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    import_reference_profile(d);
    let parquet = d.join("p/collectives.parquet");
    let mut bytes = std::fs::read(&parquet).unwrap();
    // A byte in the middle of the data pages: the file may still parse.
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&parquet, bytes).unwrap();
    let err = fails_in(d, &["profile", "show", "p"]);
    says(
        &err,
        &["collectives.parquet", "SHA-256", "changed or damaged"],
    );
}

#[test]
fn plan_files_with_impossible_values_are_refused_before_any_trial() {
    let dir = tempfile::tempdir().unwrap();
    let plan = megatron_plan_json(dir.path());
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut p = plan.clone();
        f(&mut p);
        serde_json::to_string_pretty(&p).unwrap()
    };
    let cases = vec![
        case(
            "0 layers",
            edit(&|p| p["model"]["layers"] = 0.into()),
            &["model", "layers must be positive"],
        ),
        case(
            "vocabulary 0",
            edit(&|p| p["model"]["vocab"] = 0.into()),
            &["model", "vocab must be positive"],
        ),
        case(
            "a model name that ends a comment line",
            edit(&|p| p["model"]["name"] = "gpt3-13b\ntouch pwned\n#".into()),
            &["model name", "control character"],
        ),
        case(
            "a cost-model name that ends a comment line",
            edit(&|p| p["cost_model"] = "datasheet\ntouch pwned".into()),
            &["cost_model", "control character"],
        ),
        case(
            "a negative peak",
            edit(&|p| p["candidates"][0]["prediction"]["peak_memory_bytes"] = (-1.0).into()),
            &["candidate #1", "peak_memory_bytes"],
        ),
        case(
            "a negative iteration time",
            edit(&|p| p["candidates"][1]["prediction"]["iteration_s"] = (-3.0).into()),
            &["candidate #2", "iteration_s"],
        ),
        case(
            "a negative memory limit",
            edit(&|p| p["memory_limit_bytes"] = (-1.0).into()),
            &["memory_limit_bytes"],
        ),
        case(
            "GPU memory of 0",
            edit(&|p| p["nodes"]["gpu"]["memory_bytes"] = 0.0.into()),
            &["nodes", "memory_bytes"],
        ),
    ];
    for args in [
        vec!["--device", "cpu"],
        vec!["--launch", "megatron", "--megatron-path", ".", "--dry-run"],
    ] {
        campaign(&cases, "plan.json", |path| {
            let mut a = strings(&["validate", path]);
            a.extend(strings(&args));
            a
        });
    }
}

fn cost_model_with(key: &str, value: &str) -> String {
    let text = std::fs::read_to_string(root().join("cost_models/a100-megatron.toml")).unwrap();
    let marker = format!("{key} = ");
    text.lines()
        .map(|l| {
            if l.starts_with(&marker) {
                format!("{key} = {value}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn cost_model_files_with_impossible_figures_are_refused() {
    let cases = vec![
        case("NaN MAPE", cost_model_with("cv_mape", "nan"), &["cv_mape"]),
        case(
            "negative MAPE",
            cost_model_with("cv_mape", "-0.2"),
            &["cv_mape"],
        ),
        case(
            "overflowing row counts",
            cost_model_with("a100_single_node_runs", "9223372036854775807").replace(
                "megatron_sc21_table1 = 10",
                "megatron_sc21_table1 = 9223372036854775807",
            ),
            &["fitted_on"],
        ),
        case(
            "a coefficient outside its range",
            cost_model_with("value", "-1.0"),
            &["outside its range"],
        ),
    ];
    campaign(&cases, "model.toml", |path| {
        strings(&[
            "plan",
            "--model",
            "gpt3-13b",
            "--gpu",
            "a100-80gb",
            "--nodes",
            "1",
            "--global-batch",
            "64",
            "--cost-model",
            path,
        ])
    });
}

#[test]
fn flags_out_of_bounds_or_negative_name_the_flag() {
    let plan = [
        "plan",
        "--model",
        "gpt3-13b",
        "--gpu",
        "a100-80gb",
        "--nodes",
        "1",
        "--global-batch",
        "64",
    ];
    let calibrate = [
        "calibrate",
        "--runs",
        "tests/data/reference/megatron_sc21_table1.csv",
        "--gpu",
        "a100-80gb",
    ];
    let with = strings_with;
    for (args, names) in [
        (
            with(&plan, &["--memory-limit", "-1GiB"]),
            &["--memory-limit", "-1GiB"][..],
        ),
        (
            with(&plan, &["--intra-node-bw", "-300GB/s"]),
            &["--intra-node-bw"][..],
        ),
        (with(&plan, &["--top", "-3"]), &["--top", "-3"][..]),
        (
            with(&calibrate, &["--bootstrap", "1000000"]),
            &["--bootstrap", "at most 1000"][..],
        ),
        (
            with(&calibrate, &["--folds", "1000"]),
            &["--folds", "at most 50"][..],
        ),
        (with(&calibrate, &["--holdout", "-0.3"]), &["--holdout"][..]),
        (
            with(
                &["profile", "device", "--device", "cpu"],
                &["--attention-seq", "0"],
            ),
            &["--attention-seq", "at least 1"][..],
        ),
        (
            with(&["profile", "device"], &["--attention-seq", "1000000"]),
            &["--attention-seq", "at most 131072"][..],
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = common::fails(&args);
        for part in names {
            assert!(err.contains(part), "{args:?}: expected `{part}` in:\n{err}");
        }
    }
}

#[test]
fn toml_files_name_the_key_of_an_integer_beyond_64_bits_or_a_repeated_key() {
    let model = |body: &str| format!("base = \"llama3-8b\"\n{body}\n");
    let cases = vec![
        case(
            "an integer beyond 64 bits",
            model("layers = 99999999999999999999"),
            &["line 2", "`layers`", "64 bits"],
        ),
        case(
            "a key twice",
            model("layers = 4\nlayers = 8"),
            &["line 3", "`layers`", "set twice"],
        ),
    ];
    campaign(&cases, "model.toml", |path| {
        strings(&[
            "plan",
            "--model",
            path,
            "--gpu",
            "a100-80gb",
            "--nodes",
            "1",
            "--global-batch",
            "64",
        ])
    });
    let cluster = |body: &str| format!("[[nodes]]\ngpu = \"h100-sxm\"\n{body}\n");
    let cases = vec![
        case(
            "an integer beyond 64 bits",
            cluster("count = 99999999999999999999"),
            &["line 3", "`count`", "64 bits"],
        ),
        case(
            "a key twice",
            cluster("count = 2\ncount = 3"),
            &["line 4", "`count`", "set twice"],
        ),
    ];
    campaign(&cases, "cluster.toml", |path| {
        strings(&[
            "plan",
            "--model",
            "gpt3-13b",
            "--cluster",
            path,
            "--global-batch",
            "64",
        ])
    });
}

/// A Megatron-LM checkout at `megatron` and a `torchrun` on PATH that
/// records where it ran and prints a real-format log instead of training.
fn fake_torchrun(dir: &Path, megatron: &Path) -> String {
    std::fs::create_dir_all(megatron).unwrap();
    std::fs::write(megatron.join("pretrain_gpt.py"), "").unwrap();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = root().join("tests/data/megatron/gpt345m-tp2-pp2-dp2-complete.log");
    let script = format!(
        "#!/usr/bin/env bash\npwd > '{}'\ncat '{}'\n",
        dir.join("ran-in").display(),
        log.display()
    );
    let torchrun = bin.join("torchrun");
    std::fs::write(&torchrun, script).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&torchrun, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// Every file under `dir` named `pwned`.
fn pwned(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().is_some_and(|n| n == "pwned") {
                found.push(path);
            }
        }
    }
    found
}

#[test]
fn a_megatron_path_with_a_command_substitution_and_a_space_runs_nothing_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let megatron = d.join("meg dir$(touch pwned)");
    let path = fake_torchrun(d, &megatron);
    let plan = d.join("plan.json");
    std::fs::write(
        &plan,
        serde_json::to_string(&megatron_plan_json(d)).unwrap(),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(validate_with_megatron(&plan, &megatron))
        .args(["--top", "1"])
        .current_dir(d)
        .env("PATH", path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        pwned(d).is_empty(),
        "a command of the path ran: {:?}",
        pwned(d)
    );
    let ran_in = std::fs::read_to_string(d.join("ran-in")).unwrap();
    assert_eq!(
        Path::new(ran_in.trim()).canonicalize().unwrap(),
        megatron.canonicalize().unwrap(),
        "the script ran in the given checkout"
    );
}

#[test]
fn megatron_arguments_in_a_plan_file_that_differ_from_its_configuration_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let megatron = d.join("Megatron-LM");
    fake_torchrun(d, &megatron);
    let plan = megatron_plan_json(d);
    let args_of = |p: &serde_json::Value| -> Vec<String> {
        serde_json::from_value(p["candidates"][0]["megatron_args"].clone()).unwrap()
    };
    let tp = plan["candidates"][0]["config"]["tp"].as_u64().unwrap();
    let changed_tp = {
        let mut p = plan.clone();
        let mut args = args_of(&p);
        let at = args
            .iter()
            .position(|a| a == "--tensor-model-parallel-size")
            .unwrap();
        args[at + 1] = (if tp == 8 { 1 } else { 8 }).to_string();
        p["candidates"][0]["megatron_args"] = serde_json::to_value(args).unwrap();
        p
    };
    let extra_flag = {
        let mut p = plan.clone();
        let mut args = args_of(&p);
        args.extend(["--save".to_string(), "/tmp/$(touch pwned)".to_string()]);
        p["candidates"][0]["megatron_args"] = serde_json::to_value(args).unwrap();
        p
    };
    for (what, edited) in [
        ("a degree changed", changed_tp),
        ("a flag added", extra_flag),
    ] {
        let path = d.join("edited.json");
        std::fs::write(&path, serde_json::to_string(&edited).unwrap()).unwrap();
        let err = fails_in(
            d,
            &[
                &validate_with_megatron(&path, &megatron)[..],
                &["--dry-run"],
            ]
            .concat(),
        );
        says(
            &err,
            &["candidate 1", "megatron_args do not match its config"],
        );
        assert!(pwned(d).is_empty(), "{what}");
    }
}

/// The process's umask, as a shell reports it.
fn umask_of(shell_umask: &str) -> u32 {
    u32::from_str_radix(shell_umask, 8).unwrap()
}

#[cfg(unix)]
#[test]
fn calibrate_writes_its_model_and_report_whole_and_readable_as_the_umask_says() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // What a calibrate killed mid-write left: a temporary file of a process
    // that no longer runs. The next run clears it.
    std::fs::write(d.join(".paratune-tmp.999999999.abc.m.toml"), "half").unwrap();
    let runs = root().join("tests/data/reference/megatron_sc21_table1.csv");
    let command = format!(
        "umask 027; exec '{BIN}' calibrate --gpu a100-80gb --recompute full --attention standard --runs '{}:vocab=51200,seq_len=2048' --fit gemm_efficiency,iteration_overhead_ms --bootstrap 0 --folds 0 --out m.toml",
        runs.display()
    );
    let out = Command::new("sh")
        .arg("-c")
        .arg(&command)
        .current_dir(d)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut names: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["m.report.md", "m.toml"]);
    for name in names {
        let mode = std::fs::metadata(d.join(&name))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o666 & !umask_of("027"), "{name}: {mode:o}");
    }
}

#[test]
fn a_profile_update_killed_after_its_journal_is_finished_by_the_next_reader() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    import_reference_profile(d);
    // A writer killed between its journal and its renames: its staged
    // environment.toml (with one more command) is there, not yet renamed.
    let p = d.join("p");
    let env = std::fs::read_to_string(p.join("environment.toml")).unwrap();
    let newer = env.replacen(
        "commands = [",
        "commands = [\n    \"paratune profile import-table more.csv\",",
        1,
    );
    assert_ne!(env, newer);
    let staged = ".paratune-tmp.999999999.xyz.environment.toml";
    std::fs::write(p.join(staged), &newer).unwrap();
    std::fs::write(
        p.join(".paratune-commit.999999999.1"),
        format!("{staged}\tenvironment.toml\n"),
    )
    .unwrap();
    let shown = ok_in(d, &["profile", "show", "p"]);
    says(&shown, &["import-table more.csv"]);
    assert!(
        std::fs::read_dir(&p).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(".paratune")),
        "the journal and the staged file are gone"
    );
}

/// Values the flags' parsers or the rules turn away name the flag and say
/// what to give: signed or non-numeric counts and reals, a hierarchical cp
/// exchange without the ranks for it, end stages holding every layer, and
/// a run table's unknown GPU by its line and column.
#[test]
fn bad_values_name_the_flag_or_cell_and_what_to_give() {
    let predict = |extra: &[&str]| {
        let mut args = common::llama3_8b_on("predict", "h100-sxm", &["--global-batch", "64"]);
        args.extend_from_slice(extra);
        common::fails(&args)
    };
    for (extra, parts) in [
        (
            &["--sliding-window", "-3"][..],
            &["--sliding-window", "not a whole number from 0 to"][..],
        ),
        (
            &["--mtp-layers", "x"],
            &["--mtp-layers", "from 0 to 16"][..],
        ),
        (
            &["--norm-epsilon", "x"],
            &["--norm-epsilon", "not a number"],
        ),
        (&["--rotary-base", "-1"], &["--rotary-base", "whole number"]),
        (
            &["--cp", "2", "--cp-comm", "a2a+p2p"],
            &["cp of 4 or more", "--cp-comm p2p"],
        ),
        (
            &["--pp", "2", "--last-stage-layers", "40"],
            &["--last-stage-layers", "a larger pp"],
        ),
    ] {
        let err = predict(extra);
        for part in parts {
            assert!(
                err.contains(part),
                "{extra:?}: expected `{part}` in:\n{err}"
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs.csv");
    std::fs::write(
        &runs,
        "model,gpu,gpus,global_batch,micro_batch,tp,pp,iter_ms\nllama3-8b,h100x,8,64,1,1,1,1000\n",
    )
    .unwrap();
    let err = common::fails(&["evaluate", "--runs", runs.to_str().unwrap()]);
    assert!(
        err.contains("line 2: column `gpu`: unknown GPU `h100x`"),
        "{err}"
    );
    // tp over more GPUs than the row has leaves dp 0: said as such.
    std::fs::write(
        &runs,
        "model,gpu,gpus,global_batch,micro_batch,tp,pp,iter_ms\nllama3-8b,h100-sxm,8,64,1,16,1,1000\n",
    )
    .unwrap();
    let err = common::fails(&["evaluate", "--runs", runs.to_str().unwrap()]);
    assert!(err.contains("= 16 is more than the job's 8 GPUs"), "{err}");
}

/// The new dimensions' bad input: an uneven split that cannot hold, a
/// switch its prerequisites rule out, tp over nodes without a network.
#[test]
fn impossible_layouts_and_switches_name_the_flag_and_the_fix() {
    let predict = [
        "predict",
        "--model",
        "gpt3-13b",
        "--gpu",
        "a100-80gb",
        "--nodes",
        "2",
        "--global-batch",
        "64",
    ];
    let with = |extra: &[&str]| -> Vec<String> { strings_with(&predict, extra) };
    for (args, names) in [
        (
            with(&[
                "--pp",
                "4",
                "--first-stage-layers",
                "30",
                "--last-stage-layers",
                "20",
            ]),
            &["first/last stage layers 30/20", "--first-stage-layers"][..],
        ),
        (
            with(&["--pp", "4", "--first-stage-layers", "0"]),
            &["--first-stage-layers", "at least 1"][..],
        ),
        (
            with(&["--pp", "1", "--last-stage-layers", "10"]),
            &["--last-stage-layers", "pp >= 2"][..],
        ),
        (
            with(&["--cuda-graphs", "on", "--recompute", "full"]),
            &["--cuda-graphs on", "--recompute full"][..],
        ),
        (
            with(&["--tp", "8", "--tp-comm-overlap", "on"]),
            &["--tp-comm-overlap", "--sequence-parallel on"][..],
        ),
        (
            with(&[
                "--overlap-param-gather",
                "on",
                "--overlap-grad-reduce",
                "on",
            ]),
            &[
                "--overlap-param-gather",
                "--optimizer-sharding optimizer-states",
            ][..],
        ),
        (
            [
                "predict",
                "--model",
                "gpt3-13b",
                "--gpu",
                "a100-80gb",
                "--nodes",
                "3",
                "--global-batch",
                "64",
                "--tp",
                "12",
            ]
            .map(String::from)
            .to_vec(),
            &["tp 12", "or be a multiple of them"][..],
        ),
        (
            with(&["--overlap-grad-reduce", "maybe"]),
            &["overlap-grad-reduce", "on or off"][..],
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = common::fails(&args);
        for part in names {
            assert!(err.contains(part), "{args:?}: expected `{part}` in:\n{err}");
        }
    }
    // A cluster of a GPU described inline, without its network: tp 16 over
    // two such nodes has no link to run on.
    let dir = tempfile::tempdir().unwrap();
    let cluster = dir.path().join("cluster.toml");
    std::fs::write(
        &cluster,
        "[[nodes]]\ngpu = { name = \"x\", peak_tflops = 312.0, memory = \"80GiB\", hbm_bandwidth = \"2TB/s\" }\ncount = 2\nintra_node_bw = \"300GB/s\"\n",
    )
    .unwrap();
    let err = fails_in(
        dir.path(),
        &[
            "predict",
            "--model",
            "gpt3-13b",
            "--cluster",
            "cluster.toml",
            "--global-batch",
            "64",
            "--tp",
            "16",
        ],
    );
    says(&err, &["inter_node_bw", "missing"]);
    // A CPU standing in for a GPU captures no CUDA graphs, asked for in the
    // search or in a configuration to explain.
    let cpu_cluster = root().join("tests/data/validate/cpu-cluster.toml");
    let cpu_plan = |extra: &[&str]| -> Vec<String> {
        strings_with(
            &[
                "plan",
                "--cluster",
                cpu_cluster.to_str().unwrap(),
                "--hidden",
                "512",
                "--heads",
                "8",
                "--layers",
                "4",
                "--seq-len",
                "256",
                "--vocab",
                "2048",
                "--global-batch",
                "16",
            ],
            extra,
        )
    };
    for (extra, names) in [
        (
            &["--cuda-graphs", "off,on"][..],
            &["--cuda-graphs on", "CPU", "--cuda-graphs off"][..],
        ),
        (
            &["--explain", "graphs=on"][..],
            &["--explain", "graphs on", "CPU", "graphs=off"][..],
        ),
    ] {
        let args = cpu_plan(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        says(&common::fails(&args), names);
    }
}

#[test]
fn engines_recomputation_policies_and_memory_columns_name_the_field_and_the_fix() {
    let plan = |extra: &[&str]| -> Vec<String> {
        strings_with(
            &common::llama3_8b_on("plan", "h100-sxm", &["--global-batch", "16"]),
            extra,
        )
    };
    let dir = tempfile::tempdir().unwrap();
    for (args, names) in [
        (
            plan(&["--engine", "deepspeed"]),
            &["--engine", "megatron, torchtitan", "deepspeed"][..],
        ),
        (
            plan(&["--recompute", "selective-op"]),
            &[
                "--recompute selective-op",
                "megatron",
                "--engine torchtitan",
            ][..],
        ),
        (
            plan(&["--engine", "torchtitan", "--recompute", "selective"]),
            &["--recompute selective", "torchtitan", "--engine megatron"][..],
        ),
        (
            plan(&["--compile", "on"]),
            &["--compile on", "--engine torchtitan"][..],
        ),
        (
            plan(&["--engine", "torchtitan", "--ac-frequency", "0"]),
            &["--ac-frequency", "at least 1"][..],
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = fails_in(dir.path(), &args);
        for part in names {
            assert!(err.contains(part), "{args:?}: expected `{part}` in:\n{err}");
        }
    }

    const HEADER: &str = "gpus,global_batch,micro_batch,tp,pp";
    let cases = vec![
        case(
            "a memory column with a unit",
            format!("{HEADER},peak_allocated_gib\n8,16,1,1,1,40GiB\n"),
            &["line 2", "peak_allocated_gib", "without a unit"],
        ),
        case(
            "a reserved peak below zero",
            format!("{HEADER},peak_reserved_gib\n8,16,1,1,1,-3\n"),
            &["line 2", "peak_reserved_gib"],
        ),
        case(
            "an unknown memory rank",
            format!("{HEADER},peak_allocated_gib,memory_rank\n8,16,1,1,1,30,middle\n"),
            &["line 2", "memory_rank", "first, last, max"],
        ),
        case(
            "an unknown engine",
            format!("{HEADER},engine\n8,16,1,1,1,deepspeed\n"),
            &["line 2", "engine", "megatron, torchtitan"],
        ),
        case(
            "an AC mode the engine lacks",
            format!("{HEADER},recompute\n8,16,1,1,1,selective-layer\n"),
            // A run table's fix is its `engine` column, named as the key.
            &["line 2", "selective-layer", "`engine torchtitan`"],
        ),
        case(
            "compile without torchtitan",
            format!("{HEADER},compile\n8,16,1,1,1,on\n"),
            &["line 2", "compile", "torchtitan"],
        ),
    ];
    for command in ["predict", "evaluate"] {
        campaign(&cases, "runs.csv", |path| {
            strings(&[
                command,
                "--runs",
                path,
                "--model",
                "llama3-8b",
                "--gpu",
                "h100-sxm",
            ])
        });
    }
}

#[test]
fn a_torchtitan_base_that_is_neither_a_config_function_nor_toml_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let plan = ok_in(
        dir.path(),
        &[
            "plan",
            "--model",
            "llama3-8b",
            "--gpu",
            "h100-sxm",
            "--nodes",
            "1",
            "--global-batch",
            "16",
            "--engine",
            "torchtitan",
            "--format",
            "json",
        ],
    );
    std::fs::write(dir.path().join("plan.json"), plan).unwrap();
    std::fs::write(dir.path().join("broken.toml"), "[training\n").unwrap();
    // A 0.2 job whose model is not the plan's would time another network,
    // torchtitan's default debug model too.
    std::fs::write(
        dir.path().join("70b.toml"),
        "[model]\nname = \"llama3\"\nflavor = \"70B\"\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("default.toml"), "[training]\nsteps = 10\n").unwrap();
    for (base, names) in [
        (None, &["--torchtitan-config", "MODULE:CONFIG"][..]),
        (
            Some("llama3"),
            &["--torchtitan-config llama3", "MODULE:CONFIG"][..],
        ),
        (
            Some("llama3:$(touch pwned)"),
            &["--torchtitan-config", "function name"][..],
        ),
        (
            Some("broken.toml"),
            &["--torchtitan-config broken.toml", "not TOML"][..],
        ),
        (
            Some("70b.toml"),
            &[
                "70b.toml",
                "llama3 70B builds llama3-70b",
                "plan is for llama3-8b",
            ][..],
        ),
        (
            Some("default.toml"),
            &["default.toml", "llama3 debugmodel builds llama3-debugmodel"][..],
        ),
        (
            Some("llama3:llama3_70b"),
            &[
                "llama3:llama3_70b",
                "config function llama3_70b builds llama3-70b",
                "plan is for llama3-8b",
            ][..],
        ),
    ] {
        let mut args = vec![
            "validate",
            "plan.json",
            "--launch",
            "torchtitan",
            "--dry-run",
        ];
        if let Some(base) = base {
            args.extend(["--torchtitan-config", base]);
        }
        let err = fails_in(dir.path(), &args);
        for part in names {
            assert!(err.contains(part), "{base:?}: expected `{part}` in:\n{err}");
        }
    }
    assert!(!dir.path().join("pwned").exists());
    assert!(!dir.path().join("reports").exists(), "nothing is written");
}
