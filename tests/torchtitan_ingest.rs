//! `paratune ingest torchtitan-log`, end to end: runs the built binary on the
//! synthetic torchtitan logs of `tests/data/torchtitan/` (torchtitan's own
//! line formats: colours, `[rankN]:` prefixes, `tps` with thousands
//! separators, `mfu: N/A`) and checks the runs CSV it writes, what it
//! prints, that `evaluate` and `predict` read the rows back, and that every
//! bad input is one `error:` line with exit code 2 that names the file.

use paratune::config::{OptimizerSharding, Recompute, ScheduleKind};
use paratune::model::AttentionKind;
use paratune::runs::{BaseNode, MemoryRank, RowDefaults, RunTable, runs_from_table};
use std::path::Path;

mod common;
use common::{fails, number, ok_output as ok, read_table, says, test_data, text};

fn data(name: &str) -> String {
    test_data("torchtitan", name)
}

const FSDP8: &str = "llama3-8b-fsdp8.log";
const FSDP8_TOML: &str = "llama3-8b-fsdp8.toml";
const PRINTED: &str = "llama3-debug-tp2-pp2-printed.log";
const KILLED: &str = "llama3-8b-tp2-killed.log";
const GARBLED: &str = "llama3-8b-fsdp4-garbled.log";
const NO_STEPS: &str = "llama3-70b-tp8-no-steps.log";
const FLOAT8: &str = "llama3-8b-float8-mfu-na.log";

/// A step's time from its `tps` (tokens per second per GPU): the global
/// batch's tokens over tps x GPUs.
fn step_ms(global_batch: f64, seq_len: f64, tps: f64, gpus: f64) -> f64 {
    global_batch * seq_len / (tps * gpus) * 1e3
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

fn ingest(files: &[&str], extra: &[&str], out: &Path) -> common::Output {
    let mut args = vec!["ingest", "torchtitan-log"];
    args.extend_from_slice(files);
    args.extend_from_slice(&["--out", text(out)]);
    args.extend_from_slice(extra);
    ok(&args)
}

fn defaults() -> RowDefaults {
    RowDefaults::gpt(50257, 1024, AttentionKind::Standard, Recompute::Full)
}

#[test]
fn a_job_toml_and_its_log_become_a_row_timed_by_tps() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let toml = data(FSDP8_TOML);
    let out = ingest(&[&data(FSDP8)], &["--config", &toml], &out_path);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{}", out.stdout);
    says(
        lines[0],
        &[
            FSDP8,
            "torchtitan 0.2",
            "tp1 pp1 dp8 mb1 gb8 recompute=selective-op shard=full",
            "llama3 8B L32 h4096 a32 s8192, 8 GPUs",
            "1323.2 ms/step (median; mean 1323.0; 9 step line(s) after 2 warm-up)",
            "peak memory 62.11 GiB reserved (first pipeline stage)",
            "MFU 36.2%",
        ],
    );
    says(lines[1], &["wrote 1 row(s)", "runs.csv"]);
    assert!(out.stderr.is_empty(), "{}", out.stderr);

    let t = read_table(&out_path);
    assert_eq!(t.rows.len(), 1);
    // Steps 20..100 (step 1 and the warm-up line of step 10 left out): the
    // median tps is 6,191; 8 x 8192 tokens over 6,191 tokens/s x 8 GPUs.
    let steady = [
        6180.0, 6203.0, 6191.0, 6177.0, 6210.0, 6188.0, 6195.0, 6199.0, 6186.0,
    ];
    let times: Vec<f64> = steady
        .iter()
        .map(|&tps| step_ms(8.0, 8192.0, tps, 8.0))
        .collect();
    assert!((number(&t, 0, "iter_ms") - step_ms(8.0, 8192.0, 6191.0, 8.0)).abs() < 1e-3);
    assert!((number(&t, 0, "iter_ms_mean") - mean(&times)).abs() < 1e-3);
    // The largest memory over the steady steps (step 40's), not the last one.
    assert_eq!(number(&t, 0, "peak_reserved_gib"), 62.11);
    assert_eq!(t.cell(0, "memory_rank"), Some("first"));
    assert_eq!(t.cell(0, "peak_allocated_gib"), None);
    assert_eq!(number(&t, 0, "steady_iterations"), 9.0);
    assert_eq!(number(&t, 0, "tokens_per_gpu_s_measured"), 6191.0);
    for (column, value) in [
        ("gpus", "8"),
        ("global_batch", "8"),
        ("micro_batch", "1"),
        ("tp", "1"),
        ("dp", "8"),
        ("pp", "1"),
        ("hidden", "4096"),
        ("heads", "32"),
        ("kv_heads", "8"),
        ("ffn_hidden", "14336"),
        ("layers", "32"),
        ("seq_len", "8192"),
        ("vocab", "128256"),
        ("gated_mlp", "on"),
        ("tied_embeddings", "off"),
        ("dropout", "off"),
        ("engine", "torchtitan"),
        ("compile", "off"),
        ("cuda_graphs", "off"),
        ("recompute", "selective-op"),
        ("optimizer_sharding", "full"),
        ("sequence_parallel", "off"),
        ("attention", "flash"),
        ("schedule", "1f1b"),
    ] {
        assert_eq!(t.cell(0, column), Some(value), "{column}");
    }
    assert!(t.cell(0, "source_log").unwrap().ends_with(FSDP8));

    let runs =
        runs_from_table(&t, &defaults(), BaseNode::DGX_A100).unwrap_or_else(|e| panic!("{e}"));
    let run = &runs[0];
    assert_eq!(run.model.name, "h4096-L32");
    assert_eq!((run.model.vocab, run.model.seq_len), (128256, 8192));
    assert_eq!(run.config.recompute, Recompute::SelectiveOp);
    assert_eq!(run.config.optimizer_sharding, OptimizerSharding::Full);
    let memory = run.measured_memory.unwrap();
    assert_eq!(memory.rank, MemoryRank::First);
    assert!((memory.reserved.unwrap() - 62.11 * (1u64 << 30) as f64).abs() < 1.0);
}

#[test]
fn a_printed_configuration_is_enough_and_a_pipeline_is_split_as_torchtitan_splits_it() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out = ingest(&[&data(PRINTED)], &[], &out_path);
    says(
        &out.stdout,
        &[
            PRINTED,
            "torchtitan 0.3",
            "tp2 pp2 dp2 mb2 gb32 interleaved v2 recompute=full sp shard=optimizer-states compile,",
            "llama3 debugmodel L6 h256 a16 s2048, 8 GPUs",
            "200.4 ms/step",
            "7 step line(s) after 2 warm-up",
            "peak memory 2.53 GiB reserved",
        ],
    );
    assert!(out.stderr.is_empty(), "{}", out.stderr);
    let t = read_table(&out_path);
    // Steps 10..40; the median tps is 40,877; 32 x 2048 tokens on 8 GPUs.
    assert!((number(&t, 0, "iter_ms") - step_ms(32.0, 2048.0, 40877.0, 8.0)).abs() < 1e-3);
    assert_eq!(number(&t, 0, "peak_reserved_gib"), 2.53);
    // 6 layers over 4 stages [1, 2, 2, 1], stage s on rank s mod 2: 3 a rank,
    // which 2 chunks cannot split evenly, so both end stages are given.
    assert_eq!(t.cell(0, "first_stage_layers"), Some("3"));
    assert_eq!(t.cell(0, "last_stage_layers"), Some("3"));
    // CUDA graphs are torchtitan 0.3's default, off with a pipeline.
    assert_eq!(t.cell(0, "cuda_graphs"), Some("off"));
    let runs =
        runs_from_table(&t, &defaults(), BaseNode::DGX_A100).unwrap_or_else(|e| panic!("{e}"));
    let c = &runs[0].config;
    assert_eq!((c.tp, c.pp, c.dp, c.micro_batch), (2, 2, 2, 2));
    assert_eq!(
        (c.schedule, c.virtual_stages),
        (ScheduleKind::Interleaved, 2)
    );
    assert_eq!(c.recompute, Recompute::Full);
    // FSDP under a pipeline keeps its weights gathered (reshard "default").
    assert_eq!(c.optimizer_sharding, OptimizerSharding::OptimizerStates);
    assert!(c.sequence_parallel && c.compile && !c.tp_comm_overlap);
    assert_eq!(runs[0].model.ffn_hidden, 768);
}

#[test]
fn a_killed_log_gives_what_it_holds_with_the_command_lines_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let toml = data(FSDP8_TOML);
    let out = ingest(&[&data(KILLED)], &["--config", &toml], &out_path);
    // The TOML says tp 1, local batch 1, selective checkpointing, no
    // compile; the command line in the log overrides all four.
    says(
        &out.stdout,
        &[
            KILLED,
            "tp2 pp1 dp4 mb2 gb8 recompute=full sp shard=full compile,",
            "9 step line(s) after 2 warm-up",
            "peak memory 50.14 GiB reserved",
        ],
    );
    says(
        &out.stderr,
        &[KILLED, "cut off", "the log stops at step 11 of 30"],
    );
    let t = read_table(&out_path);
    // Steps 3..11 (step 12's line is cut inside its tps).
    let steady = [
        3398.0, 3411.0, 3405.0, 3417.0, 3409.0, 3402.0, 3414.0, 3399.0, 3407.0,
    ];
    let times: Vec<f64> = steady
        .iter()
        .map(|&tps| step_ms(8.0, 8192.0, tps, 8.0))
        .collect();
    assert!((number(&t, 0, "iter_ms") - step_ms(8.0, 8192.0, 3407.0, 8.0)).abs() < 1e-3);
    assert!((number(&t, 0, "iter_ms_mean") - mean(&times)).abs() < 1e-3);
    assert_eq!(number(&t, 0, "steady_iterations"), 9.0);
    assert_eq!(number(&t, 0, "peak_reserved_gib"), 50.14);
    assert_eq!(t.cell(0, "compile"), Some("on"));
    assert_eq!(t.cell(0, "sequence_parallel"), Some("on"));
}

#[test]
fn a_garbled_log_of_every_rank_is_read_from_rank_zeros_lines() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out = ingest(&[&data(GARBLED)], &[], &out_path);
    says(
        &out.stdout,
        &[
            GARBLED,
            "torchtitan 0.3",
            "tp1 pp1 dp4 mb2 gb8 recompute=selective-op shard=full compile cuda-graphs,",
            "llama3 8B L32 h4096 a32 s4096, 4 GPUs",
            "7 step line(s) after 2 warm-up",
        ],
    );
    says(
        &out.stderr,
        &[
            "4 ranks log step lines; those of `[rank0]:` are read",
            "2 step line(s) without a readable `tps`",
            "step(s) 20 logged more than once",
            "read from the command line",
        ],
    );
    let t = read_table(&out_path);
    // Rank 0's steps 10..50 without 15 (run together with rank 2's line) and
    // 30 (a corrupted tps): the median tps is 7,158; 8 x 4096 tokens, 4 GPUs.
    assert!((number(&t, 0, "iter_ms") - step_ms(8.0, 4096.0, 7158.0, 4.0)).abs() < 1e-3);
    // Rank 0's memory (rank 3's is 0.75 GiB more).
    assert_eq!(number(&t, 0, "peak_reserved_gib"), 38.5);
    assert_eq!(t.cell(0, "cuda_graphs"), Some("on"));
    assert_eq!(t.cell(0, "compile"), Some("on"));
    let runs =
        runs_from_table(&t, &defaults(), BaseNode::DGX_A100).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(runs[0].gpus, 4);
}

#[test]
fn the_warm_up_is_a_flag() {
    let dir = tempfile::tempdir().unwrap();
    let toml = data(FSDP8_TOML);
    let out = ingest(
        &[&data(FSDP8)],
        &["--config", &toml, "--warmup", "5"],
        &dir.path().join("runs.csv"),
    );
    says(&out.stdout, &["6 step line(s) after 5 warm-up"]);
    let e = fails(&[
        "ingest",
        "torchtitan-log",
        &data(FSDP8),
        "--config",
        &toml,
        "--out",
        text(&dir.path().join("other.csv")),
        "--warmup",
        "11",
    ]);
    says(
        &e,
        &[
            FSDP8,
            "no step lines after the 11 warm-up step line(s) (11 logged",
            "--metrics.log_freq",
            "--warmup",
        ],
    );
}

#[test]
fn a_log_without_step_lines_is_an_error_that_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let e = fails(&[
        "ingest",
        "torchtitan-log",
        &data(NO_STEPS),
        "--out",
        text(&dir.path().join("runs.csv")),
    ]);
    says(
        &e,
        &[
            NO_STEPS,
            "no readable step lines",
            "stopped before its first logged step",
            "LOG_RANK",
        ],
    );
    assert!(!dir.path().join("runs.csv").exists());
}

#[test]
fn features_paratune_cannot_describe_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out_arg = dir.path().join("runs.csv");
    let toml = std::fs::read_to_string(data(FSDP8_TOML)).unwrap();
    let edited = |name: &str, from: &str, to: &str| -> String {
        assert!(toml.contains(from), "{from}");
        let path = dir.path().join(name);
        std::fs::write(&path, toml.replace(from, to)).unwrap();
        path.to_str().unwrap().to_string()
    };
    let refuse = |log: &str, config: Option<&str>, parts: &[&str]| {
        let mut args = vec!["ingest", "torchtitan-log", log, "--out", text(&out_arg)];
        if let Some(config) = config {
            args.extend_from_slice(&["--config", config]);
        }
        let e = fails(&args);
        says(&e, parts);
    };
    let cp = edited(
        "cp.toml",
        "context_parallel_degree = 1",
        "context_parallel_degree = 2",
    );
    refuse(
        &data(FSDP8),
        Some(&cp),
        &[
            FSDP8,
            "context parallelism (context_parallel_degree 2)",
            "write the run as a CSV row with its cp column",
        ],
    );
    let float8 = edited(
        "float8.toml",
        "# converters = [\"quantize.linear.float8\"]",
        "converters = [\"quantize.linear.float8\"]",
    );
    refuse(
        &data(FSDP8),
        Some(&float8),
        &["quantised training", "quantize.linear.float8"],
    );
    refuse(
        &data(FLOAT8),
        None,
        &[FLOAT8, "quantised training", "mfu: N/A"],
    );
    let hsdp = edited(
        "hsdp.toml",
        "data_parallel_replicate_degree = 1\ndata_parallel_shard_degree = -1",
        "data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4",
    );
    // HSDP is read: two replicas of a four-rank shard group.
    let hsdp_out = dir.path().join("hsdp.csv");
    let read = ok(&[
        "ingest",
        "torchtitan-log",
        &data(FSDP8),
        "--out",
        text(&hsdp_out),
        "--config",
        &hsdp,
    ]);
    assert!(read.stdout.contains("hsdp=2x4"), "{}", read.stdout);
    let zbv = edited(
        "zbv.toml",
        "pipeline_parallel_degree = 1",
        "pipeline_parallel_degree = 2\npipeline_parallel_schedule = \"ZBVZeroBubble\"",
    );
    refuse(
        &data(FSDP8),
        Some(&zbv),
        &["ZBVZeroBubble", "1F1B, GPipe and Interleaved1F1B"],
    );
    assert!(!out_arg.exists());
}

#[test]
fn an_existing_out_is_refused_without_append_and_appended_to_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out_arg = text(&out_path);
    ingest(&[&data(PRINTED)], &[], &out_path);
    let before = std::fs::read_to_string(&out_path).unwrap();

    let e = fails(&["ingest", "torchtitan-log", &data(GARBLED), "--out", out_arg]);
    says(&e, &["runs.csv", "already exists", "--append"]);
    assert_eq!(std::fs::read_to_string(&out_path).unwrap(), before);

    let out = ingest(&[&data(PRINTED), &data(GARBLED)], &["--append"], &out_path);
    says(&out.stdout, &["added 1 of 2 row(s)", "1 already there"]);
    let t = read_table(&out_path);
    assert_eq!(t.rows.len(), 2);
    assert_eq!(t.cell(1, "gpus"), Some("4"));
    // The same again adds nothing.
    let out = ingest(&[&data(GARBLED)], &["--append"], &out_path);
    says(&out.stdout, &["added 0 of 1 row(s)", "1 already there"]);
    assert_eq!(read_table(&out_path).rows.len(), 2);
}

#[test]
fn evaluate_and_predict_read_the_ingested_rows_and_their_memory() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let toml = data(FSDP8_TOML);
    ingest(
        &[&data(FSDP8), &data(KILLED)],
        &["--config", &toml],
        &out_path,
    );
    ingest(&[&data(PRINTED), &data(GARBLED)], &["--append"], &out_path);
    assert_eq!(read_table(&out_path).rows.len(), 4);
    let runs = text(&out_path);
    let out = ok(&["evaluate", "--runs", runs, "--gpu", "h100-sxm"]);
    says(
        &out.stdout,
        &[
            "rows with a measured peak memory 4",
            "reserved peak: MAPE",
            "rows with a measured time   4",
        ],
    );
    let out = ok(&["predict", "--runs", runs, "--gpu", "h100-sxm"]);
    let predicted = RunTable::parse(&out.stdout, "predicted.csv").unwrap();
    assert_eq!(predicted.rows.len(), 4);
    for row in 0..4 {
        // Rank 0's reserved memory, predicted beside the measured one.
        let gib = number(&predicted, row, "predicted_first_stage_reserved_gib");
        assert!(gib > 0.0 && gib < 80.0, "row {row}: {gib}");
        assert!(number(&predicted, row, "peak_reserved_gib") > 0.0);
    }
}

#[test]
fn a_log_that_fails_is_named_and_the_others_are_still_written() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.log");
    std::fs::write(&empty, "").unwrap();
    let out_path = dir.path().join("runs.csv");
    let out = ingest(
        &[text(&empty), &data(PRINTED), &data(FLOAT8)],
        &[],
        &out_path,
    );
    says(
        &out.stderr,
        &[
            "warning: skipped",
            "empty.log",
            "empty",
            FLOAT8,
            "quantised",
        ],
    );
    says(&out.stdout, &["wrote 1 row(s)"]);
    assert_eq!(read_table(&out_path).rows.len(), 1);
}

#[test]
fn bad_inputs_are_one_line_naming_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out_arg = text(&out_path);
    let run = |args: &[&str]| {
        let mut all = vec!["ingest", "torchtitan-log"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--out", out_arg]);
        fails(&all)
    };
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };

    let missing = dir.path().join("missing.log");
    says(&run(&[text(&missing)]), &["missing.log", "cannot read"]);
    let empty = write("empty.log", "");
    says(&run(&[&empty]), &["empty.log", "empty"]);
    // Several failures: all named on the one line.
    says(
        &run(&[text(&missing), &empty]),
        &["missing.log", "empty.log"],
    );

    // Step lines only: no configuration to go with them.
    let log = std::fs::read_to_string(data(FSDP8)).unwrap();
    let steps: String = log
        .lines()
        .filter(|l| l.contains("step:"))
        .map(|l| format!("{l}\n"))
        .collect();
    let bare = write("steps-only.log", &steps);
    says(
        &run(&[&bare]),
        &[
            "steps-only.log",
            "no configuration",
            "--config JOB.toml",
            "print_config",
        ],
    );
    // ... and with a TOML whose GPU count is -1, nothing tells the GPUs.
    let toml = data(FSDP8_TOML);
    says(
        &run(&[&bare, "--config", &toml]),
        &["steps-only.log", "--gpus N"],
    );
    let out = ingest(&[&bare], &["--config", &toml, "--gpus", "8"], &out_path);
    says(&out.stdout, &["1323.2 ms/step"]);
    std::fs::remove_file(&out_path).unwrap();

    // The job config: missing, not TOML, a key torchtitan does not have,
    // a value of the wrong type, another release's.
    says(
        &run(&[
            &data(FSDP8),
            "--config",
            text(&dir.path().join("nope.toml")),
        ]),
        &["nope.toml", "cannot read the job config"],
    );
    let broken = write("broken.toml", "[training\nsteps = 1\n");
    says(
        &run(&[&data(FSDP8), "--config", &broken]),
        &["broken.toml", "invalid TOML at line 1"],
    );
    let text = std::fs::read_to_string(&toml).unwrap();
    let typo = write(
        "typo.toml",
        &text.replace("tensor_parallel_degree", "tensor_paralel_degree"),
    );
    says(
        &run(&[&data(FSDP8), "--config", &typo]),
        &[
            "typo.toml",
            "[parallelism] has no key `tensor_paralel_degree`",
            "did you mean `tensor_parallel_degree`",
        ],
    );
    let quoted = write(
        "quoted.toml",
        &text.replace(
            "tensor_parallel_degree = 1",
            "tensor_parallel_degree = \"1\"",
        ),
    );
    says(
        &run(&[&data(FSDP8), "--config", &quoted]),
        &[
            "quoted.toml",
            "`parallelism.tensor_parallel_degree`",
            "without quotes",
        ],
    );
    says(
        &run(&[&data(PRINTED), "--config", &toml]),
        &[
            PRINTED,
            "torchtitan 0.3.0",
            "torchtitan 0.2 job config",
            "one run",
        ],
    );

    // Contradictions: the GPU count, the batch the trainer reports.
    says(
        &run(&[&data(FSDP8), "--config", &toml, "--gpus", "16"]),
        &[FSDP8, "make 8 GPUs", "--gpus gives 16"],
    );
    let batch = write(
        "batch.toml",
        &text.replace("local_batch_size = 1", "local_batch_size = 2"),
    );
    says(
        &run(&[&data(FSDP8), "--config", &batch]),
        &[
            FSDP8,
            "`training.local_batch_size` is 2",
            "says 1",
            "is the configuration from this run",
        ],
    );
    let indivisible = write(
        "indivisible.toml",
        &text.replace(
            "local_batch_size = 1",
            "local_batch_size = 1\nglobal_batch_size = 12",
        ),
    );
    says(
        &run(&[&bare, "--config", &indivisible, "--gpus", "8"]),
        &[
            "global_batch_size 12 is not a multiple of local_batch_size x data-parallel degree = 1 x 8",
        ],
    );

    // A flavor paratune does not know, and its fix.
    let flavor = write(
        "flavor.toml",
        &text.replace("flavor = \"8B\"", "flavor = \"3B\""),
    );
    says(
        &run(&[&bare, "--config", &flavor, "--gpus", "8"]),
        &["steps-only.log", "flavor `3B`", "--model NAME|FILE"],
    );
    let out = ingest(
        &[&bare],
        &["--config", &flavor, "--gpus", "8", "--model", "llama3-8b"],
        &out_path,
    );
    says(&out.stdout, &["--model llama3-8b"]);
    std::fs::remove_file(&out_path).unwrap();
    says(
        &run(&[&bare, "--config", &flavor, "--model", "llama3-7b"]),
        &["--model", "llama3-7b"],
    );
    says(&run(&[&data(FSDP8), "--gpus", "0"]), &["--gpus", "0"]);

    let e = fails(&["ingest", "torchtitan-log", "--out", out_arg]);
    says(&e, &["FILES"]);
}

#[test]
fn a_launch_without_run_train_sh_is_read_with_the_allocator_it_recorded() {
    // paratune's script for a candidate priced with fixed segments calls
    // torchrun itself and sets nothing; the log's first lines say so.
    let dir = tempfile::tempdir().unwrap();
    let recorded = dir.path().join("recorded.log");
    let log = std::fs::read_to_string(data(FSDP8)).unwrap();
    std::fs::write(
        &recorded,
        format!(
            "paratune allocator: PYTORCH_ALLOC_CONF unset\nparatune allocator: PYTORCH_CUDA_ALLOC_CONF unset\n{log}"
        ),
    )
    .unwrap();
    let out_path = dir.path().join("runs.csv");
    let toml = data(FSDP8_TOML);
    ingest(
        &[text(&recorded), &data(FSDP8)],
        &["--config", &toml],
        &out_path,
    );
    let t = read_table(&out_path);
    assert_eq!(t.cell(0, "expandable_segments"), Some("off"));
    // A log without the record (run_train.sh's) reads as what that sets.
    assert_eq!(t.cell(1, "expandable_segments"), None);
    let runs =
        runs_from_table(&t, &defaults(), BaseNode::DGX_A100).unwrap_or_else(|e| panic!("{e}"));
    assert!(!runs[0].config.expandable_segments);
    assert!(runs[1].config.expandable_segments);
}
