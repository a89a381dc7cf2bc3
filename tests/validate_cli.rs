//! `paratune validate` on bad input, through the binary (default build: no
//! libtorch needed): plans from another version or edited by hand, missing
//! files, and what a build without the `torch` feature says.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{
    BIN, fails_in as fails, megatron_plan_json, ok_in, run_in as run, validate_with_megatron,
};

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

    let mut plan = megatron_plan_json(d);
    plan["version"] = 99.into();
    let path = write(d, "future.json", &plan);
    let err = fails(d, &["validate", path.to_str().unwrap(), "--device", "cpu"]);
    assert!(
        err.contains("plan format version 99") && err.contains("re-run"),
        "{err}"
    );

    let mut plan = megatron_plan_json(d);
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
    let path = write(dir.path(), "plan.json", &megatron_plan_json(dir.path()));
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
    let path = write(dir.path(), "plan.json", &megatron_plan_json(dir.path()));
    let err = fails(
        dir.path(),
        &["validate", path.to_str().unwrap(), "--device", "cpu"],
    );
    assert!(
        err.contains("--features torch") && err.contains("--launch megatron"),
        "{err}"
    );
}

/// A stand-in Megatron-LM checkout and a `torchrun` on PATH that prints a
/// real-format Megatron-LM log (tests/data/megatron) instead of training;
/// its first call fails part-way, like a killed run.
fn fake_cluster(dir: &Path) -> (PathBuf, String) {
    let megatron = dir.join("Megatron-LM");
    std::fs::create_dir_all(&megatron).unwrap();
    std::fs::write(megatron.join("pretrain_gpt.py"), "").unwrap();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/megatron/gpt345m-tp2-pp2-dp2-complete.log");
    let calls = dir.join("calls");
    let script = format!(
        "#!/usr/bin/env bash\necho x >> '{calls}'\nif [[ $(wc -l < '{calls}') -eq 1 ]]; then head -n 40 '{log}'; exit 1; fi\ncat '{log}'\n",
        calls = calls.display(),
        log = log.display()
    );
    let torchrun = bin.join("torchrun");
    std::fs::write(&torchrun, script).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&torchrun, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (megatron, path)
}

#[test]
fn cluster_trials_write_checked_scripts_on_a_dry_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let path = write(d, "plan.json", &megatron_plan_json(d));
    let err = fails(
        d,
        &["validate", path.to_str().unwrap(), "--launch", "megatron"],
    );
    assert!(err.contains("--megatron-path"), "{err}");
    let (megatron, _) = fake_cluster(d);
    let out = run(
        d,
        &[
            &validate_with_megatron(&path, &megatron)[..],
            &["--top", "2", "--dry-run"],
        ]
        .concat(),
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    for rank in [1, 2] {
        let script = d.join(format!("reports/plan/candidate-{rank}/run.sh"));
        let check = Command::new("bash")
            .arg("-n")
            .arg(&script)
            .status()
            .unwrap();
        assert!(check.success(), "bash -n {}", script.display());
    }
    assert!(!d.join("reports/plan/runs-history.csv").exists());
}

#[test]
fn cluster_trials_run_read_their_logs_keep_them_and_refit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Planned with expandable segments: every round's trials run with them.
    let mut plan = megatron_plan_json(d);
    for candidate in plan["candidates"].as_array_mut().unwrap() {
        candidate["config"]["expandable_segments"] = serde_json::Value::Bool(true);
    }
    let plan = write(d, "plan.json", &plan);
    let (megatron, fake_path) = fake_cluster(d);
    // The plan's top three trialled on the fake cluster, `extra` added.
    let validate = |extra: &[&str]| {
        let out = Command::new(BIN)
            .args(validate_with_megatron(&plan, &megatron))
            .args(["--top", "3"])
            .args(extra)
            .current_dir(d)
            .env("PATH", &fake_path)
            .env_remove("PYTORCH_ALLOC_CONF")
            .env_remove("PYTORCH_CUDA_ALLOC_CONF")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let stdout = validate(&["--loop", "2"]);
    // The first run failed: said so, its log kept, the loop went on.
    assert!(stdout.contains("candidate #1: the run failed"), "{stdout}");
    assert!(d.join("reports/plan/candidate-1/run.log").is_file());
    // The other two were read into the append-only history and refitted on.
    let history = std::fs::read_to_string(d.join("reports/plan/runs-history.csv")).unwrap();
    assert!(history.lines().count() >= 3, "{history}");
    assert!(stdout.contains("311.6 ms per iteration"), "{stdout}");
    assert!(stdout.contains("refit on 2 measured run(s)"), "{stdout}");
    // --loop 2: the refitted model's leaders not yet run are the second round.
    assert!(
        stdout.contains("round 1: with the refitted model the leader is"),
        "{stdout}"
    );
    assert!(d.join("reports/plan/round-2").is_dir());
    let scripts: Vec<String> = std::fs::read_dir(d.join("reports/plan/round-2"))
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path().join("run.sh")).ok())
        .collect();
    assert!(!scripts.is_empty());
    for script in scripts {
        assert!(script.contains("expandable_segments:True"), "{script}");
    }
    // The history records the allocator the trials' logs say they ran with...
    let history_path = d.join("reports/plan/runs-history.csv");
    let table = paratune::runs::RunTable::read(&history_path).unwrap();
    assert!(!table.rows.is_empty());
    for row in 0..table.rows.len() {
        assert_eq!(
            table.cell(row, "expandable_segments"),
            Some("on"),
            "row {row}"
        );
    }
    // ...and a history of an older layout is rewritten on resuming: the
    // allocator after the row (the last release's), or no allocator.
    let at = table
        .headers
        .iter()
        .position(|h| h == "expandable_segments")
        .unwrap();
    for keep_at_the_end in [true, false] {
        let mut older = csv::Writer::from_writer(Vec::new());
        for record in std::iter::once(&table.headers).chain(&table.rows) {
            let mut cells: Vec<&String> = record.iter().collect();
            let allocator = cells.remove(at);
            if keep_at_the_end {
                cells.push(allocator);
            }
            older.write_record(cells).unwrap();
        }
        std::fs::write(&history_path, older.into_inner().unwrap()).unwrap();
        let stdout = validate(&[]);
        assert!(
            stdout.contains("rewritten with this paratune's columns"),
            "{stdout}"
        );
        assert!(stdout.contains("resuming:"), "{stdout}");
        let upgraded = paratune::runs::RunTable::read(&history_path).unwrap();
        assert_eq!(upgraded.headers, table.headers);
        let kept = if keep_at_the_end { Some("on") } else { None };
        assert_eq!(upgraded.cell(0, "expandable_segments"), kept);
    }
}

/// A `torchrun` and a `python3` on PATH standing in for torchtitan: the
/// interpreter imports anything, and torchrun prints a real-format
/// torchtitan 0.3 log with its printed configuration
/// (tests/data/torchtitan) and records the arguments it was given.
fn fake_torchtitan(dir: &Path) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/torchtitan/llama3-debug-tp2-pp2-printed.log");
    let scripts = [
        ("python3", "#!/usr/bin/env bash\nexit 0\n".to_string()),
        (
            "torchrun",
            format!(
                "#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" >> '{args}'\ncat '{log}'\n",
                args = dir.join("torchrun-args").display(),
                log = log.display()
            ),
        ),
    ];
    for (name, text) in scripts {
        let path = bin.join(name);
        std::fs::write(&path, text).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

#[test]
fn torchtitan_trials_run_read_their_logs_and_refit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = run(
        d,
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
            // Priced with fixed segments, which only the log can say the
            // trials ran with: torchtitan's default is on.
            "--expandable-segments",
            "off",
            "--top",
            "3",
            "--format",
            "json",
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    std::fs::write(d.join("plan.json"), &out.stdout).unwrap();
    let path = fake_torchtitan(d);
    let out = Command::new(BIN)
        .args([
            "validate",
            "plan.json",
            "--launch",
            "torchtitan",
            "--torchtitan-config",
            "llama3:llama3_8b",
            "--top",
            "2",
        ])
        .current_dir(d)
        .env("PATH", path)
        .env_remove("PYTORCH_ALLOC_CONF")
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // torchrun got torchtitan 0.3's entry point, the config function, the
    // trial's settings and the activation-checkpoint word last.
    let args = std::fs::read_to_string(d.join("torchrun-args")).unwrap();
    let args: Vec<&str> = args.lines().collect();
    for word in [
        "torchtitan.train",
        "llama3_8b",
        "--debug.print_config",
        "--training.steps",
    ] {
        assert!(args.contains(&word), "{word} missing: {args:?}");
    }
    assert!(args.iter().any(|a| a.starts_with("activation-checkpoint:")));
    // Both logs were read into the history (rank 0's memory), and refitted on.
    let history = std::fs::read_to_string(d.join("reports/plan/runs-history.csv")).unwrap();
    let header: Vec<&str> = history.lines().next().unwrap().split(',').collect();
    let rank = header.iter().position(|h| *h == "memory_rank").unwrap();
    let engine = header.iter().position(|h| *h == "engine").unwrap();
    let rows: Vec<Vec<&str>> = history
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 2, "{history}");
    let table = paratune::runs::RunTable::read(&d.join("reports/plan/runs-history.csv")).unwrap();
    for row in 0..2 {
        assert_eq!(
            table.cell(row, "expandable_segments"),
            Some("off"),
            "{history}"
        );
    }
    for row in &rows {
        assert_eq!(row[engine], "torchtitan");
        assert_eq!(row[rank], "first");
    }
    assert!(
        stdout.contains("ms per iteration (steady-state median"),
        "{stdout}"
    );
    assert!(stdout.contains("GiB reserved on rank 0"), "{stdout}");
    assert!(stdout.contains("refit on 2 measured run(s)"), "{stdout}");
}

/// A tiny GPT and its global batch, as plan flags.
const TINY_GPT: [&str; 12] = [
    "--hidden",
    "128",
    "--heads",
    "4",
    "--layers",
    "4",
    "--seq-len",
    "64",
    "--vocab",
    "512",
    "--global-batch",
    "8",
];

/// A plan for a tiny GPT on the two-"GPU" CPU cluster, for torchtitan
/// without torch.compile (what the torch worker runs), in DIR/plan.json.
fn torch_plan(dir: &Path) -> PathBuf {
    let cluster =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/validate/cpu-cluster.toml");
    let plan = [
        "plan",
        "--cluster",
        cluster.to_str().unwrap(),
        "--engine",
        "torchtitan",
        "--compile",
        "off",
        "--cuda-graphs",
        "off",
        "--top",
        "3",
        "--format",
        "json",
    ];
    let out = run(dir, &[&plan[..], &TINY_GPT[..]].concat());
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let path = dir.join("plan.json");
    std::fs::write(&path, &out.stdout).unwrap();
    path
}

/// An executable `python` that runs `body` whatever it is asked.
fn fake_python(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("python");
    std::fs::write(&path, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    path
}

#[test]
fn torch_trials_refuse_rank_counts_the_plan_or_machine_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let plan = torch_plan(d);
    let plan = plan.to_str().unwrap();
    let torch = ["validate", plan, "--launch", "torch", "--device", "cpu"];
    let err = fails(d, &[&torch[..], &["--ranks", "3"]].concat());
    assert!(err.contains("--ranks 3") && err.contains("2 GPUs"), "{err}");
    let err = fails(d, &[&torch[..], &["--ranks", "4000"]].concat());
    assert!(
        err.contains("--ranks 4000") && err.contains("cores"),
        "{err}"
    );
    let err = fails(d, &[&torch[..], &["--dtype", "fp16"]].concat());
    assert!(err.contains("--dtype fp16"), "{err}");
    let err = fails(d, &["profile", "comm", "--ranks", "1", "--out", "p"]);
    assert!(
        err.contains("--ranks 1") && err.contains("at least 2"),
        "{err}"
    );
}

#[test]
fn a_hung_or_dying_torch_trial_is_killed_recorded_and_the_loop_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let plan = torch_plan(d);
    for (body, says) in [
        ("sleep 60", "killed after"),
        ("echo boom >&2; exit 1", "the run failed"),
    ] {
        let python = fake_python(d, body);
        let out = d.join(format!("out-{}", says.replace(' ', "-")));
        let started = std::time::Instant::now();
        let result = run(
            d,
            &[
                "validate",
                plan.to_str().unwrap(),
                "--launch",
                "torch",
                "--device",
                "cpu",
                "--python",
                python.to_str().unwrap(),
                "--timeout",
                "1",
                "--top",
                "2",
                "--out",
                out.to_str().unwrap(),
            ],
        );
        assert_eq!(result.code, Some(0), "{}", result.stderr);
        let tried = result.stdout.matches(says).count();
        assert_eq!(
            tried, 2,
            "both candidates were tried and reported:\n{}",
            result.stdout
        );
        assert!(
            result.stdout.contains("no run was measured"),
            "{}",
            result.stdout
        );
        // The hung ranks were stopped, not waited for.
        assert!(started.elapsed().as_secs() < 40);
        assert!(out.join("candidate-1/run.sh").is_file());
        assert!(out.join("candidate-1/job.json").is_file());
    }
}

#[test]
fn a_measured_cluster_needs_its_measurements() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let empty = d.join("empty-profile");
    let base = [&["plan"][..], &TINY_GPT[..]].concat();
    let err = fails(
        d,
        &[
            &base[..],
            &["--cluster-from-profile", empty.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(err.contains("--gpus-per-node"), "{err}");
    let reference = common::import_reference_profile(d);
    let err = fails(
        d,
        &[
            &base[..],
            &[
                "--cluster-from-profile",
                reference.to_str().unwrap(),
                "--gpus-per-node",
                "2",
            ],
        ]
        .concat(),
    );
    assert!(
        err.contains("--cluster-from-profile") && err.contains("profile device"),
        "{err}"
    );
}

/// A `python` whose `-m torch.distributed.run ... --job JOB` writes every
/// rank's report as the worker would, with the job's own degrees and a time
/// that grows with the micro-batch count; each call is counted in `calls`.
fn reporting_python(dir: &Path) -> PathBuf {
    let worker = dir.join("fake_worker.py");
    std::fs::write(
        &worker,
        r#"import json, os, sys
job = json.load(open(sys.argv[sys.argv.index("--job") + 1]))
with open(os.environ["FAKE_CALLS"], "a") as calls:
    calls.write(str(job["candidate"]) + "\n")
p = job["parallel"]
world = p["tp"] * p["pp"] * p["dp"]
micro = p["global_batch"] // (p["dp"] * p["micro_batch"])
os.makedirs(job["report_dir"], exist_ok=True)
for rank in range(world):
    report = {"schema": 1, "rank": rank, "world_size": world,
              "degrees": {"tp": p["tp"], "pp": p["pp"], "dp": p["dp"]},
              "stages": [rank // (p["tp"] * p["dp"])], "schedule": "fake", "data_parallel": "fake",
              "micro_batches": micro, "iteration_ms": [100.0 + 10.0 * micro] * 3,
              "peak_memory_bytes": 5.0e7, "memory_kind": "rss-above-baseline"}
    json.dump(report, open(os.path.join(job["report_dir"], "rank-%d.json" % rank), "w"))
"#,
    )
    .unwrap();
    fake_python(
        dir,
        &format!(
            "FAKE_CALLS='{}' exec python3 '{}' \"$@\"",
            dir.join("calls").display(),
            worker.display()
        ),
    )
}

#[test]
fn torch_trials_are_read_refitted_and_a_rerun_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let plan = torch_plan(d);
    let python = reporting_python(d);
    let out = d.join("out");
    let args = [
        "validate",
        plan.to_str().unwrap(),
        "--launch",
        "torch",
        "--device",
        "cpu",
        "--python",
        python.to_str().unwrap(),
        "--top",
        "3",
        "--out",
        out.to_str().unwrap(),
    ];
    let first = run(d, &args);
    assert_eq!(first.code, Some(0), "{}", first.stderr);
    let calls = std::fs::read_to_string(d.join("calls")).unwrap();
    assert_eq!(calls.lines().count(), 3, "{calls}\n{}", first.stdout);
    assert!(
        first.stdout.contains("error before the trials"),
        "{}",
        first.stdout
    );
    assert!(
        first.stdout.contains("held-out (leave-one-out) error"),
        "{}",
        first.stdout
    );
    let history = std::fs::read_to_string(out.join("runs-history.csv")).unwrap();
    assert_eq!(history.lines().count(), 4, "{history}");

    // The same command again runs nothing already measured and refits on all.
    let second = run(d, &args);
    assert_eq!(second.code, Some(0), "{}", second.stderr);
    assert!(
        second.stdout.contains("resuming: 3 run(s)"),
        "{}",
        second.stdout
    );
    let calls = std::fs::read_to_string(d.join("calls")).unwrap();
    assert_eq!(
        calls.lines().count(),
        3,
        "nothing re-run:\n{}",
        second.stdout
    );
    assert!(
        second.stdout.contains("refit on 3 measured run(s)"),
        "{}",
        second.stdout
    );
    assert!(out.join("report.md").is_file());
}

#[test]
fn a_candidate_too_big_for_this_machine_runs_fewer_layers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let plan = torch_plan(d);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    // Just under what the plan's leader is predicted to allocate a rank.
    let peak = json["candidates"][0]["prediction"]["peak_allocated_bytes"]
        .as_f64()
        .unwrap();
    let limit = format!("{}B", (peak * 0.97) as u64);
    let python = reporting_python(d);
    let out = d.join("out");
    let result = run(
        d,
        &[
            "validate",
            plan.to_str().unwrap(),
            "--launch",
            "torch",
            "--device",
            "cpu",
            "--python",
            python.to_str().unwrap(),
            "--top",
            "1",
            "--memory-limit",
            &limit,
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert_eq!(result.code, Some(0), "{}", result.stderr);
    assert!(
        result
            .stdout
            .contains("of the model's 4 layers, to fit this machine"),
        "{}",
        result.stdout
    );
    let job: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("candidate-1/job.json")).unwrap())
            .unwrap();
    let layers = job["model"]["layers"].as_u64().unwrap();
    assert!(layers < 4, "{job}");
    // The run row is the model that ran.
    let table = common::read_table(&out.join("runs-history.csv"));
    assert_eq!(common::number(&table, 0, "layers"), layers as f64);
}

/// A plan none of whose candidates the engine can run is refused with the
/// first one's reason and the fix, not reported as a run with nothing in it.
#[test]
fn cluster_trials_of_a_plan_the_engine_cannot_run_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let plan = ok_in(
        d,
        &[
            "plan",
            "--model",
            "gpt3-13b",
            "--gpu",
            "a100-80gb",
            "--nodes",
            "2",
            "--global-batch",
            "64",
            "--top",
            "2",
            "--bpipe",
            "on",
            "--format",
            "json",
        ],
    );
    let path = write(d, "plan.json", &serde_json::from_str(&plan).unwrap());
    let (megatron, _) = fake_cluster(d);
    let err = fails(
        d,
        &[
            &validate_with_megatron(&path, &megatron)[..],
            &["--top", "2", "--dry-run"],
        ]
        .concat(),
    );
    assert!(err.contains("--launch megatron"), "{err}");
    assert!(err.contains("#1: ") && err.contains("BPipe"), "{err}");
    assert!(err.contains("--bpipe off"), "the reason's fix: {err}");
    assert!(!d.join("reports/plan/runs-history.csv").exists());
}

#[test]
fn a_plan_made_with_a_cost_model_file_is_validated_with_that_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A calibrated file whose name a shipped model also has.
    let shipped =
        std::fs::read_to_string(common::root().join("cost_models/datasheet.toml")).unwrap();
    std::fs::write(d.join("mine.toml"), shipped).unwrap();
    let json = common::megatron_plan_json_with(d, &["--cost-model", "mine.toml"]);
    assert_eq!(json["cost_model"], "datasheet");
    assert_eq!(json["cost_model_file"], "mine.toml");
    // Version 2, which a paratune that would ignore the file refuses; a
    // plan without one stays at version 1, which every paratune reads.
    assert_eq!(json["version"], 2);
    assert_eq!(megatron_plan_json(d)["version"], 1);
    write(d, "plan.json", &json);
    let (megatron, _) = fake_cluster(d);
    let plan_path = d.join("plan.json");
    let dry_run = [
        &validate_with_megatron(&plan_path, &megatron)[..],
        &["--dry-run"],
    ]
    .concat();
    ok_in(d, &dry_run);
    // Validated with the file, not the shipped model of the same name:
    // without it, the plan's file is what is missing.
    std::fs::remove_file(d.join("mine.toml")).unwrap();
    let err = fails(d, &dry_run);
    assert!(
        err.contains("mine.toml") && err.contains("where plan ran") && err.contains("--cost-model"),
        "{err}"
    );
    // A plan from elsewhere naming a device (or a directory) is refused
    // before anything is read.
    for not_a_file in ["/dev/zero", "."] {
        let mut odd = json.clone();
        odd["cost_model_file"] = not_a_file.into();
        std::fs::write(&plan_path, serde_json::to_string(&odd).unwrap()).unwrap();
        let err = fails(d, &dry_run);
        assert!(
            err.contains("not a cost-model TOML file") && err.contains("cost_model_file"),
            "{err}"
        );
    }
    // A plan from an older paratune names no file and takes the model by name.
    let mut older = json.clone();
    older.as_object_mut().unwrap().remove("cost_model_file");
    older["version"] = 1.into();
    std::fs::write(&plan_path, serde_json::to_string(&older).unwrap()).unwrap();
    ok_in(d, &dry_run);
}
