//! `paratune ingest megatron-log`, end to end: runs the built binary on the
//! synthetic Megatron-LM logs of `tests/data/megatron/` and checks the runs
//! CSV it writes, what it prints, and that every bad input is one `error:`
//! line with exit code 2 that names the file.

use paratune::config::{OptimizerSharding, Recompute, ScheduleKind};
use paratune::model::AttentionKind;
use paratune::runs::{BaseNode, RowDefaults, runs_from_table};

mod common;
use common::{fails, number, ok_output as ok, read_table, says, test_data, text};

fn log(name: &str) -> String {
    test_data("megatron", name)
}

const COMPLETE: &str = "gpt345m-tp2-pp2-dp2-complete.log";
const KILLED: &str = "gpt1.3b-tp4-pp1-dp2-killed.log";
const GARBAGE: &str = "gpt345m-tp2-pp1-dp4-garbage.log";
const INTERLEAVED: &str = "llama-1b-tp1-pp4-dp2-interleaved.log";

#[test]
fn four_logs_become_four_rows_that_read_back_as_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out = ok(&[
        "ingest",
        "megatron-log",
        &log(COMPLETE),
        &log(KILLED),
        &log(GARBAGE),
        &log(INTERLEAVED),
        "--out",
        text(&out_path),
    ]);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{}", out.stdout);
    says(
        lines[0],
        &[
            COMPLETE,
            "tp2 pp2 dp2",
            "311.6 ms/iteration (median; mean 310.8",
            "GiB",
        ],
    );
    says(
        lines[1],
        &[
            KILLED,
            "tp4 pp1 dp2",
            "781.3 ms/iteration",
            "recompute=selective",
            " sp",
        ],
    );
    says(lines[2], &[GARBAGE, "tp2 pp1 dp4", "989.9 ms/iteration"]);
    says(
        lines[3],
        &[INTERLEAVED, "tp1 pp4 dp2", "v2", "1390.3 ms/iteration"],
    );
    says(lines[4], &["wrote 4 row(s)", "runs.csv"]);
    // What was odd about the logs is said on stderr, by file.
    says(
        &out.stderr,
        &[KILLED, "cut off", GARBAGE, "without a readable"],
    );

    let t = read_table(&out_path);
    assert_eq!(t.rows.len(), 4);
    let expected = [
        (311.650, 8_337_091_461.0, 18.0),
        (781.300, 26_040_252_498.0, 6.0),
        (989.900, 12_046_607_319.0, 9.0),
        (1390.300, 18_153_440_543.0, 13.0),
    ];
    for (row, (ms, peak, steady)) in expected.iter().enumerate() {
        // The steady state's median (the mean is kept beside it).
        assert!((number(&t, row, "iter_ms") - ms).abs() < 1e-3, "row {row}");
        // The memory report's peak allocated, in GiB, read on the ranks that
        // report (the largest).
        let gib = peak / (1u64 << 30) as f64;
        assert!(
            (number(&t, row, "peak_allocated_gib") - gib).abs() < 1e-4,
            "row {row}"
        );
        assert_eq!(t.cell(row, "memory_rank"), Some("max"));
        assert_eq!(number(&t, row, "steady_iterations"), *steady, "row {row}");
        assert!(
            t.cell(row, "source_log")
                .is_some_and(|s| s.ends_with(".log"))
        );
    }

    let defaults = RowDefaults::gpt(50257, 1024, AttentionKind::Flash, Recompute::None);
    let runs = runs_from_table(&t, &defaults, BaseNode::DGX_A100).unwrap_or_else(|e| panic!("{e}"));
    let c = &runs[0].config;
    assert_eq!((c.tp, c.pp, c.dp, c.micro_batch), (2, 2, 2, 2));
    assert_eq!(c.optimizer_sharding, OptimizerSharding::OptimizerStates);
    assert_eq!(runs[0].model.vocab, 50304);
    let c = &runs[1].config;
    assert_eq!((c.tp, c.pp, c.dp), (4, 1, 2));
    assert!(c.sequence_parallel);
    assert_eq!(c.recompute, Recompute::Selective);
    assert_eq!(runs[1].model.seq_len, 2048);
    let c = &runs[2].config;
    assert_eq!(c.recompute, Recompute::Full);
    assert_eq!(c.attention, AttentionKind::Standard);
    let c = &runs[3].config;
    assert_eq!((c.tp, c.pp, c.dp), (1, 4, 2));
    assert_eq!(
        (c.schedule, c.virtual_stages),
        (ScheduleKind::Interleaved, 2)
    );
    assert_eq!(runs[3].model.kv_heads, 4);
    assert_eq!(runs[3].model.ffn_hidden, 5632);
    assert!((runs[3].measured_s.unwrap() - 1.390300).abs() < 1e-6);
}

#[test]
fn the_warm_up_is_a_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out = ok(&[
        "ingest",
        "megatron-log",
        &log(KILLED),
        "--out",
        text(&out_path),
        "--warmup",
        "5",
    ]);
    says(&out.stdout, &["3 iteration(s) after 5 warm-up"]);
    let e = fails(&[
        "ingest",
        "megatron-log",
        &log(KILLED),
        "--out",
        text(&dir.path().join("other.csv")),
        "--warmup",
        "30",
    ]);
    says(
        &e,
        &[
            KILLED,
            "no iteration lines after the 30 warm-up iterations",
            "--train-iters",
            "--warmup",
        ],
    );
}

#[test]
fn an_existing_out_is_refused_without_append_and_appended_to_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out_arg = text(&out_path);
    ok(&["ingest", "megatron-log", &log(COMPLETE), "--out", out_arg]);
    let before = std::fs::read_to_string(&out_path).unwrap();

    let e = fails(&["ingest", "megatron-log", &log(KILLED), "--out", out_arg]);
    says(&e, &["runs.csv", "already exists", "--append"]);
    assert_eq!(std::fs::read_to_string(&out_path).unwrap(), before);

    let out = ok(&[
        "ingest",
        "megatron-log",
        &log(COMPLETE),
        &log(KILLED),
        "--out",
        out_arg,
        "--append",
    ]);
    says(&out.stdout, &["added 1 of 2 row(s)", "1 already there"]);
    let t = read_table(&out_path);
    assert_eq!(t.rows.len(), 2);
    assert_eq!(t.cell(1, "tp"), Some("4"));
}

#[test]
fn a_log_that_fails_is_named_and_the_others_are_still_written() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.log");
    std::fs::write(&empty, "").unwrap();
    let out_path = dir.path().join("runs.csv");
    let out = ok(&[
        "ingest",
        "megatron-log",
        text(&empty),
        &log(INTERLEAVED),
        "--out",
        text(&out_path),
    ]);
    says(&out.stderr, &["warning: skipped", "empty.log", "empty"]);
    says(&out.stdout, &["wrote 1 row(s)"]);
    assert_eq!(read_table(&out_path).rows.len(), 1);
}

#[test]
fn bad_inputs_are_one_line_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("runs.csv");
    let out_arg = text(&out_path);

    let missing = dir.path().join("missing.log");
    let e = fails(&["ingest", "megatron-log", text(&missing), "--out", out_arg]);
    says(&e, &["missing.log", "cannot read"]);

    let empty = dir.path().join("empty.log");
    std::fs::write(&empty, "").unwrap();
    let e = fails(&["ingest", "megatron-log", text(&empty), "--out", out_arg]);
    says(&e, &["empty.log", "empty"]);

    // Only the last rank's iteration lines, without rank 0's argument dump.
    let complete = std::fs::read_to_string(log(COMPLETE)).unwrap();
    let iterations: String = complete
        .lines()
        .filter(|l| l.contains(" iteration "))
        .map(|l| format!("{l}\n"))
        .collect();
    let no_args = dir.path().join("no-args.log");
    std::fs::write(&no_args, iterations).unwrap();
    let e = fails(&["ingest", "megatron-log", text(&no_args), "--out", out_arg]);
    says(&e, &["no-args.log", "argument dump"]);

    // The argument dump only: the run died before its first iteration.
    let start = complete.find("----- arguments -----").unwrap();
    let end = complete.find(" iteration ").unwrap();
    let dump_only = dir.path().join("dump-only.log");
    std::fs::write(&dump_only, &complete[start.saturating_sub(30)..end]).unwrap();
    let e = fails(&["ingest", "megatron-log", text(&dump_only), "--out", out_arg]);
    says(&e, &["dump-only.log", "no readable iteration lines"]);

    // Several failures: all named on the one line.
    let e = fails(&[
        "ingest",
        "megatron-log",
        text(&missing),
        text(&empty),
        "--out",
        out_arg,
    ]);
    says(&e, &["missing.log", "empty.log"]);

    assert!(!out_path.exists(), "nothing is written when no log parses");

    let e = fails(&["ingest", "megatron-log", "--out", out_arg]);
    says(&e, &["FILES"]);
}

/// The lines a paratune launch script starts its log with: the allocator
/// options the ranks read (here `PYTORCH_CUDA_ALLOC_CONF` alone).
fn recorded_allocator(cuda_options: &str) -> String {
    format!(
        "paratune allocator: PYTORCH_ALLOC_CONF unset\nparatune allocator: PYTORCH_CUDA_ALLOC_CONF={cuda_options}\n"
    )
}

#[test]
fn the_allocator_a_launch_script_recorded_reaches_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let recorded = dir.path().join("recorded.log");
    let complete = std::fs::read_to_string(log(COMPLETE)).unwrap();
    std::fs::write(
        &recorded,
        recorded_allocator("max_split_size_mb:512,expandable_segments:True") + &complete,
    )
    .unwrap();
    let out_path = dir.path().join("runs.csv");
    ok(&[
        "ingest",
        "megatron-log",
        text(&recorded),
        &log(COMPLETE),
        "--out",
        text(&out_path),
    ]);
    let t = read_table(&out_path);
    // Recorded, it is said; not recorded, the cell is empty and reads as
    // Megatron-LM's default.
    assert_eq!(t.cell(0, "expandable_segments"), Some("on"));
    assert_eq!(t.cell(1, "expandable_segments"), None);
    let defaults = RowDefaults::gpt(50257, 1024, AttentionKind::Flash, Recompute::None);
    let runs = runs_from_table(&t, &defaults, BaseNode::DGX_A100).unwrap_or_else(|e| panic!("{e}"));
    assert!(runs[0].config.expandable_segments);
    assert!(!runs[1].config.expandable_segments);
}
