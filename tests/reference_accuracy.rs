//! The cost model against real measurements (tests/data/reference): the
//! figures the README quotes, recomputed on every test run.

use paratune::cluster::builtin_node;
use paratune::coefficients::{CostModel, builtin_cost_model};
use paratune::config::{OptimizerSharding, Recompute, ScheduleKind};
use paratune::evaluate::{Summary, evaluate};
use paratune::model::{AttentionKind, ModelSpec};
use paratune::runs::{RowDefaults, Run, RunTable, runs_from_table};
use std::path::Path;

/// Loads a reference table with the settings its README states: full
/// recomputation, 1F1B (interleaved where the table says), unfused attention.
fn reference_runs(file: &str, vocab: u64, seq_len: u64) -> Vec<Run> {
    let mut model = ModelSpec::gpt("reference", 1024, 16, 24, vocab, seq_len);
    model.attention = AttentionKind::Standard;
    let defaults = RowDefaults {
        model,
        recompute: Recompute::Full,
        sequence_parallel: false,
        schedule: ScheduleKind::OneFOneB,
        virtual_stages: 1,
        bpipe: false,
        optimizer_sharding: OptimizerSharding::None,
    };
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/reference")
        .join(file);
    let table = RunTable::read(&path).expect("reference table reads");
    runs_from_table(&table, &defaults, 8).expect("reference rows are valid")
}

fn summary(file: &str, vocab: u64, seq_len: u64, cost: &CostModel) -> Summary {
    let runs = reference_runs(file, vocab, seq_len);
    let nodes = builtin_node("a100-80gb", 400).unwrap();
    let s = evaluate(&runs, &nodes, cost).summary();
    eprintln!("{file} with {}: {s:?}", cost.name);
    s
}

#[test]
fn every_reference_row_is_read() {
    assert_eq!(
        reference_runs("a100_single_node_runs.csv", 50257, 1024).len(),
        1440
    );
    let sc21 = reference_runs("megatron_sc21_table1.csv", 51200, 2048);
    assert_eq!(sc21.len(), 10);
    // Rows with layers_per_virtual_stage run the interleaved schedule.
    assert!(
        sc21.iter()
            .any(|r| r.config.schedule == ScheduleKind::Interleaved)
    );
    // The SC'21 throughput converts back to a time with the paper's formula
    // 96 B s L h^2 (1 + s/6h + V/16Lh): 1T on 3,072 GPUs at 163 TFLOP/s.
    let (b, s, l, h, v) = (3072.0, 2048.0, 128.0, 25600.0, 51200.0);
    let flops = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
    let expected = flops / (163e12 * 3072.0);
    let seconds = sc21.last().unwrap().measured_s.unwrap();
    assert!(
        (seconds / expected - 1.0).abs() < 1e-9,
        "1T iteration {seconds} s, expected {expected}"
    );
}

#[test]
fn datasheet_model_on_the_single_node_runs() {
    let s = summary(
        "a100_single_node_runs.csv",
        50257,
        1024,
        &builtin_cost_model("datasheet").unwrap(),
    );
    assert_eq!(s.rows, 1440);
    assert!(s.mape < 0.22, "MAPE {}", s.mape);
    assert!(s.mean_spearman > 0.7, "Spearman {}", s.mean_spearman);
}

#[test]
fn datasheet_model_on_the_sc21_table() {
    let s = summary(
        "megatron_sc21_table1.csv",
        51200,
        2048,
        &builtin_cost_model("datasheet").unwrap(),
    );
    assert_eq!(s.rows, 10);
    assert!(s.mape < 0.08, "MAPE {}", s.mape);
    assert!(s.worst_error.abs() < 0.15, "worst {}", s.worst_error);
}
