//! `paratune profile ...` and `--profile DIR`, through the binary: importing
//! nccl-tests logs and reference tables, the shipped A100 profile being what
//! its recorded commands produce, and plan/predict/evaluate using it.

use paratune::profile::{CollectiveOp, read_profile};

mod common;
use common::{fails, root, text};
const ALL_REDUCE_8: &str = include_str!("data/nccl/all_reduce_perf_8xa100.txt");

/// Standard output and standard error of a command that must succeed.
fn ok(args: &[&str]) -> (String, String) {
    let out = common::ok_output(args);
    (out.stdout, out.stderr)
}

/// The commands recorded in profiles/a100-sxm/environment.toml, run again
/// into a fresh directory, give the shipped tables.
#[test]
fn the_shipped_a100_profile_is_what_its_commands_produce() {
    let shipped = read_profile(&root().join("profiles/a100-sxm")).expect("shipped profile reads");
    assert_eq!(shipped.environment.gpu, "a100-80gb");
    assert_eq!(shipped.environment.commands.len(), 2);
    let notes = shipped.environment.notes.join(" ");
    for credit in [
        "vTrain",
        "MIT",
        "VIA Research Group at KAIST",
        "Korthikanti",
        "MLSys",
    ] {
        assert!(notes.contains(credit), "attribution {credit}: {notes}");
    }
    let readme = std::fs::read_to_string(root().join("profiles/a100-sxm/README.md")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("a100-sxm");
    for command in &shipped.environment.commands {
        assert!(
            readme.contains(command.as_str()),
            "README lists `{command}`"
        );
        let args = shell_words(command);
        assert_eq!(args[0], "paratune");
        let mut args: Vec<String> = args[1..].to_vec();
        let at = args.iter().position(|a| a == "--out").unwrap();
        args[at + 1] = text(&out).to_string();
        ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }
    let rebuilt = read_profile(&out).unwrap();
    assert_eq!(rebuilt.collectives, shipped.collectives);
    assert_eq!(rebuilt.layers, shipped.layers);
    assert_eq!(rebuilt.environment.notes, shipped.environment.notes);
    assert_eq!(rebuilt.environment.source, shipped.environment.source);
    // The reference curves: 2..8 GPUs, 1 MiB .. 1 GiB; the five layer rows.
    assert_eq!(shipped.collectives.len(), 7 * 1024);
    assert!(
        shipped
            .collectives
            .iter()
            .all(|p| p.op == CollectiveOp::AllReduce)
    );
    assert_eq!(shipped.layers.len(), 5);
}

/// Splits a recorded command line as a shell would (words, single-quoted
/// words, backslash escapes outside quotes).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut any = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if !quoted => {
                word.extend(chars.next());
                any = true;
            }
            '\'' => {
                quoted = !quoted;
                any = true;
            }
            ' ' if !quoted => {
                if any {
                    words.push(std::mem::take(&mut word));
                    any = false;
                }
            }
            _ => {
                word.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(word);
    }
    words
}

#[test]
fn nccl_tests_logs_import_merge_and_replace() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("ar.txt");
    std::fs::write(&log, ALL_REDUCE_8).unwrap();
    let out = dir.path().join("profile");
    // Op, ranks and GPU come from the log.
    let (stdout, _) = ok(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--out",
        text(&out),
    ]);
    assert!(
        stdout.contains("28 all_reduce points over 8 ranks"),
        "{stdout}"
    );
    let profile = read_profile(&out).unwrap();
    assert_eq!(profile.environment.gpu, "a100-80gb");
    assert_eq!(profile.collectives.len(), 28);
    assert!(
        profile.environment.commands[0].starts_with("paratune profile import-nccl-tests "),
        "{:?}",
        profile.environment.commands
    );
    // A second run of the same sizes replaces them; other (op, ranks) are kept.
    let faster = ALL_REDUCE_8.replace("   8193.0  131.06", "   8000.0  134.22");
    let log2 = dir.path().join("ar2.txt");
    std::fs::write(&log2, faster).unwrap();
    ok(&[
        "profile",
        "import-nccl-tests",
        text(&log2),
        "--out",
        text(&out),
    ]);
    ok(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--op",
        "all_gather",
        "--ranks",
        "4",
        "--out",
        text(&out),
    ]);
    let profile = read_profile(&out).unwrap();
    assert_eq!(profile.collectives.len(), 56);
    let top = profile
        .collectives
        .iter()
        .find(|p| p.op == CollectiveOp::AllReduce && p.bytes == 1073741824.0)
        .unwrap();
    assert!((top.seconds - 8000e-6).abs() < 1e-12, "{top:?}");
    assert_eq!(profile.environment.commands.len(), 3);
    let (shown, _) = ok(&["profile", "show", text(&out)]);
    assert!(
        shown.contains("all_gather") && shown.contains("1 GiB"),
        "{shown}"
    );
}

#[test]
fn a_truncated_log_imports_its_complete_rows_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let cut = ALL_REDUCE_8.find("  1073741824").unwrap() + 40;
    let log = dir.path().join("all_reduce_perf.out");
    std::fs::write(&log, &ALL_REDUCE_8[..cut]).unwrap();
    let out = dir.path().join("p");
    let (stdout, stderr) = ok(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--out",
        text(&out),
    ]);
    assert!(stderr.contains("ends early"), "{stderr}");
    assert!(stdout.contains("27 all_reduce points"), "{stdout}");
}

#[test]
fn a_log_without_its_collective_or_ranks_asks_for_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let bare: String = ALL_REDUCE_8
        .lines()
        .filter(|l| !l.starts_with("# Collective") && !l.starts_with("#  Rank"))
        .map(|l| format!("{l}\n"))
        .collect();
    let log = dir.path().join("run.txt");
    std::fs::write(&log, bare).unwrap();
    let out = dir.path().join("p");
    let err = fails(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--out",
        text(&out),
    ]);
    assert!(err.contains("--op"), "{err}");
    let err = fails(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--op",
        "all_reduce",
        "--out",
        text(&out),
    ]);
    assert!(err.contains("--ranks"), "{err}");
    let err = fails(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--op",
        "allreduce",
        "--out",
        text(&out),
    ]);
    assert!(err.contains("all_reduce"), "{err}");
    assert!(!out.exists(), "nothing written on failure");
}

#[test]
fn importing_into_a_corrupted_profile_stops_and_leaves_it_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("all_reduce_perf.txt");
    std::fs::write(&log, ALL_REDUCE_8).unwrap();
    let out = dir.path().join("p");
    ok(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--out",
        text(&out),
    ]);
    let table = out.join("collectives.parquet");
    let bytes = std::fs::read(&table).unwrap();
    let damaged = &bytes[..bytes.len() / 3];
    std::fs::write(&table, damaged).unwrap();
    let err = fails(&[
        "profile",
        "import-nccl-tests",
        text(&log),
        "--out",
        text(&out),
    ]);
    assert!(
        err.contains("collectives.parquet") && err.contains("not overwritten"),
        "{err}"
    );
    assert_eq!(std::fs::read(&table).unwrap(), damaged);
    let err = fails(&[
        "predict",
        "--model",
        "gpt-1.7b",
        "--gpu",
        "a100-80gb",
        "--gpus",
        "8",
        "--global-batch",
        "64",
        "--profile",
        text(&out),
    ]);
    assert!(
        err.contains("--profile") && err.contains("collectives.parquet"),
        "{err}"
    );
}

#[test]
fn plan_predict_and_evaluate_say_what_they_took_from_the_profile() {
    let job = [
        "--model",
        "gpt-1.7b",
        "--gpu",
        "a100-80gb",
        "--gpus",
        "8",
        "--global-batch",
        "64",
        "--profile",
        "profiles/a100-sxm",
    ];
    let mut plan = vec!["plan"];
    plan.extend(job);
    let (stdout, _) = ok(&plan);
    assert!(
        stdout.contains(
            "profile profiles/a100-sxm (a100-80gb; 7 collective curves, 5 layer shapes):"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("ranked configurations:") && stdout.contains("the winner:"),
        "{stdout}"
    );
    assert!(stdout.contains("collective lookups ("), "{stdout}");

    let mut predict = vec!["predict", "--tp", "2", "--format", "json"];
    predict.extend(job);
    let (stdout, _) = ok(&predict);
    let value: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let usage = &value["profile"]["usage"];
    // tp 2: four all-reduces per layer pass set; dp 4: gradient all-reduces.
    assert!(
        usage["collective_lookups"].as_u64().unwrap() >= 2,
        "{usage}"
    );
    assert_eq!(usage["layer_lookups"].as_u64(), Some(0));

    let (stdout, _) = ok(&[
        "evaluate",
        "--gpu",
        "a100-80gb",
        "--recompute",
        "full",
        "--attention",
        "standard",
        "--vocab",
        "50257",
        "--seq-len",
        "1024",
        "--runs",
        "tests/data/reference/a100_single_node_runs.csv",
        "--profile",
        "profiles/a100-sxm",
    ]);
    assert!(stdout.contains("profile profiles/a100-sxm"), "{stdout}");
    assert!(stdout.contains("MAPE"), "{stdout}");
}

/// A tiny GPT layer for `profile layer` (hidden 128, 4 heads, sequence 64).
const TINY: [&str; 8] = [
    "--hidden",
    "128",
    "--heads",
    "4",
    "--layers",
    "2",
    "--seq-len",
    "64",
];

fn profile_layer(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["profile", "layer"].map(String::from).to_vec();
    args.extend(TINY.map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn refs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn profile_layer_names_the_bad_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    let cases: [(&[&str], &str); 8] = [
        (&["--device", "tpu0"], "--device: unknown device `tpu0`"),
        (&["--device", "cuda:x"], "cuda:N"),
        (&["--micro-batch", "1,0,4"], "--micro-batch"),
        (&["--micro-batch", "2,many"], "--micro-batch"),
        (&["--dtype", "int8"], "--dtype: unknown dtype"),
        (&["--tp", "3"], "--tp"),
        (&["--sequence-parallel", "maybe"], "--sequence-parallel"),
        (&["--sequence-parallel", "on"], "add a --tp of 2 or more"),
    ];
    for (flags, expected) in cases {
        let mut args = profile_layer(flags);
        args.extend(["--device", "cpu", "--out", text(&out)].map(String::from));
        // The flag under test comes first, so it wins over the --device cpu after it
        // only where it is not --device: put it last for --device.
        if flags[0] == "--device" {
            args.truncate(args.len() - 4);
            args.extend(["--out", text(&out)].map(String::from));
        }
        let err = fails(&refs(&args));
        assert!(err.contains(expected), "{flags:?}: {err}");
    }
}

#[test]
fn profile_layer_refuses_an_unwritable_or_corrupted_output() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let args = profile_layer(&["--device", "cpu", "--out", text(&file.join("p"))]);
    let err = fails(&refs(&args));
    assert!(
        err.contains("--out") && err.contains("cannot write there"),
        "{err}"
    );

    let out = dir.path().join("p");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("environment.toml"), "gpu = \"cpu\"\n").unwrap();
    std::fs::write(out.join("layers.csv"), "hidden,heads\nnot,numbers\n").unwrap();
    let args = profile_layer(&["--device", "cpu", "--out", text(&out)]);
    let err = fails(&refs(&args));
    assert!(
        err.contains("layers.csv") && err.contains("not overwritten"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("layers.csv")).unwrap(),
        "hidden,heads\nnot,numbers\n"
    );
}

#[cfg(not(feature = "torch"))]
#[test]
fn without_the_torch_feature_profile_layer_says_how_to_get_it() {
    let dir = tempfile::tempdir().unwrap();
    let args = profile_layer(&["--device", "cpu", "--out", text(&dir.path().join("p"))]);
    let err = fails(&refs(&args));
    assert!(
        err.contains("built without the `torch` feature") && err.contains("--features torch"),
        "{err}"
    );
}

#[test]
fn profile_comm_checks_its_gpus_and_says_what_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p");
    let err = fails(&["profile", "comm", "--gpus", "0", "--out", text(&out)]);
    assert!(
        err.contains("--gpus: give at least two different GPU indices"),
        "{err}"
    );
    let err = fails(&["profile", "comm", "--gpus", "0,1", "--out", text(&out)]);
    if cfg!(feature = "cuda") {
        assert!(
            err.contains("no CUDA device") || err.contains("--gpu"),
            "{err}"
        );
    } else {
        assert!(err.contains("built without the `cuda` feature"), "{err}");
    }
}
