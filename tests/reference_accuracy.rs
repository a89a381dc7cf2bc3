//! The cost model against real measurements (tests/data/reference): the
//! figures the README quotes, recomputed on every test run.

use paratune::cluster::builtin_node;
use paratune::coefficients::{CostModel, builtin_cost_model};
use paratune::config::{Recompute, ScheduleKind};
use paratune::evaluate::{Summary, evaluate};
use paratune::model::AttentionKind;
use paratune::runs::{BaseNode, RowDefaults, Run, RunTable, runs_from_table};
use std::path::Path;

/// Loads a reference table with the settings its README states: full
/// recomputation, 1F1B (interleaved where the table says), unfused attention.
fn reference_runs(file: &str, vocab: u64, seq_len: u64) -> Vec<Run> {
    let defaults = RowDefaults::gpt(vocab, seq_len, AttentionKind::Standard, Recompute::Full);
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/reference")
        .join(file);
    let table = RunTable::read(&path).expect("reference table reads");
    runs_from_table(&table, &defaults, BaseNode::DGX_A100).expect("reference rows are valid")
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

/// The shipped `cost_models/a100-megatron.toml` is what the README's
/// calibration command produces: refitting with the same data and seed gives
/// the same coefficients, and its recorded cross-validated error is real.
#[test]
fn the_shipped_a100_model_is_reproducible_and_its_cross_validated_error_holds() {
    use paratune::calibrate::{
        COLLECTIVE_COEFFICIENTS, Dataset, FitOptions, calibrate, fit_collectives, read_nccl_table,
    };
    let shipped = builtin_cost_model("a100-megatron").unwrap();
    let nodes = builtin_node("a100-80gb", 400).unwrap();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference");
    let samples = read_nccl_table(&data.join("a100_nccl_allreduce.csv")).unwrap();
    let (prior, _) =
        fit_collectives(&samples, &nodes, &builtin_cost_model("datasheet").unwrap()).unwrap();
    let datasets = [
        Dataset {
            name: "a100_single_node_runs".into(),
            runs: reference_runs("a100_single_node_runs.csv", 50257, 1024),
            group: nodes.clone(),
        },
        Dataset {
            name: "megatron_sc21_table1".into(),
            runs: reference_runs("megatron_sc21_table1.csv", 51200, 2048),
            group: nodes.clone(),
        },
    ];
    let options = FitOptions {
        seed: 7,
        bootstrap: 0,
        pinned: COLLECTIVE_COEFFICIENTS
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ..FitOptions::default()
    };
    let fit = calibrate(&datasets, &prior, "a100-megatron", &options).unwrap();
    for info in paratune::coefficients::Coefficients::INFO {
        let (mine, theirs) = (
            fit.model.coefficients.get(info.name).unwrap(),
            shipped.coefficients.get(info.name).unwrap(),
        );
        assert!(
            (mine - theirs).abs() <= 1e-9 * theirs.abs().max(1.0),
            "{}: refit {mine} but shipped {theirs}; regenerate cost_models/a100-megatron.toml with the README's command",
            info.name
        );
    }
    let cv = |name: &str| {
        fit.cross_validated
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, f)| f.clone())
            .unwrap()
    };
    let single = cv("a100_single_node_runs");
    let sc21 = cv("megatron_sc21_table1");
    eprintln!("cross-validated: single node {single:?}\nSC'21 {sc21:?}");
    assert!(single.mape < 0.07, "single-node CV MAPE {}", single.mape);
    assert!(
        single.mean_spearman > 0.9,
        "Spearman {}",
        single.mean_spearman
    );
    assert!(sc21.mape < 0.06, "SC'21 CV MAPE {}", sc21.mape);
    // The fit beats the datasheet priors on rows it did not see.
    let prior_single = &fit.prior_cross_validated[0].1;
    assert!(single.mape < prior_single.mape / 2.0);
}

/// The shipped A100 profile (the reference NCCL curves and Korthikanti's
/// layer rows) used by the cost model does no worse on the single-node runs
/// than the formulas alone. Its effect is small by construction: the
/// collective coefficients were fitted to the same curves, and no run has
/// the measured layer shape (h 6144, tp 8), so only collectives change.
#[test]
fn the_shipped_a100_profile_does_not_worsen_the_single_node_error() {
    use paratune::evaluate::evaluate_with_profile;
    use paratune::profile::{Measurements, read_profile};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/a100-sxm");
    let measurements = Measurements::from_profile(&read_profile(&dir).unwrap());
    let runs = reference_runs("a100_single_node_runs.csv", 50257, 1024);
    let nodes = builtin_node("a100-80gb", 400).unwrap();
    for name in ["datasheet", "a100-megatron"] {
        let cost = builtin_cost_model(name).unwrap();
        let without = evaluate(&runs, &nodes, &cost).summary();
        let with = evaluate_with_profile(&runs, &nodes, &cost, Some(&measurements)).summary();
        eprintln!(
            "{name}: MAPE {:.4} without the profile, {:.4} with it",
            without.mape, with.mape
        );
        assert_eq!(with.rows, 1440);
        assert!(
            with.mape <= without.mape + 1e-3,
            "{name}: MAPE {} with the profile, {} without",
            with.mape,
            without.mape
        );
    }
}

/// Megatron-LM's CI runs (tests/data/reference/megatron_ci_runs.csv): the
/// rows paratune can express (dense GPT), their measured allocated peaks of
/// the last rank against the predicted last stage's, A100 rows with the
/// fitted model and H100 rows with it carried to the H100. Zero-shot: no
/// coefficient was fitted to these peaks.
#[test]
fn memory_on_megatrons_ci_runs_is_within_five_percent_and_no_fit_verdict_is_wrong() {
    use paratune::evaluate::{Setting, evaluate_with};
    use paratune::runs::{MemoryRank, runs_and_skipped};
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference/megatron_ci_runs.csv");
    let table = RunTable::read(&path).unwrap();
    let mut defaults = RowDefaults::gpt(50257, 1024, AttentionKind::Flash, Recompute::None);
    defaults.memory_rank = MemoryRank::Last;
    let runs = runs_and_skipped(&table, &defaults, BaseNode::DGX_A100).unwrap();
    assert!(runs.runs.len() >= 110, "{} runs", runs.runs.len());
    let a100 = builtin_node("a100-80gb", 1).unwrap();
    let h100 = builtin_node("h100-sxm", 1).unwrap();
    let fitted = builtin_cost_model("a100-megatron").unwrap();
    let carried = fitted.carried_to("h100-sxm");
    let evaluation = evaluate_with(&runs.runs, |run| match run.gpu.as_deref() {
        Some("h100-sxm") => Setting {
            group: &h100,
            cost: &carried,
            profile: None,
        },
        _ => Setting {
            group: &a100,
            cost: &fitted,
            profile: None,
        },
    });
    let memory = evaluation.memory_summary();
    let allocated = memory
        .allocated
        .expect("the CI runs record allocated peaks");
    eprintln!("Megatron-LM CI runs, allocated peak: {allocated:?}");
    assert!(allocated.rows >= 110);
    assert!(allocated.mape < 0.05, "MAPE {}", allocated.mape);
    assert_eq!(memory.wrong_fits, 0, "lines {:?}", memory.wrong_fits_lines);
}

/// NeMo's model FLOPs per token of a Llama model at sequence `seq`, as its
/// `flops_formulas.py` counted them before the causal halving (NVIDIA-NeMo
/// issue #14376): `L h^2 (12 + 12 g/a + 18 f/h + 12 s/h + 6 V/(L h))`.
fn nemo_llama_flops_per_token(model: &str, seq: f64) -> f64 {
    let m = paratune::model::builtin_model(model).expect("a catalogue model");
    let (l, h) = (m.layers as f64, m.hidden as f64);
    l * h
        * h
        * (12.0
            + 12.0 * m.kv_heads as f64 / m.heads as f64
            + 18.0 * m.ffn_hidden as f64 / h
            + 12.0 * seq / h
            + 6.0 * m.vocab as f64 / (l * h))
}

/// One published rate: a row's model and sequence, and its tokens per
/// second and model TFLOP/s per GPU.
#[derive(Debug)]
struct PublishedRate {
    model: String,
    seq: f64,
    tokens_per_s: f64,
    tflops: f64,
}

impl PublishedRate {
    /// The TFLOP/s per GPU its tokens per second make by NeMo's formula.
    fn tflops_from_tokens(&self) -> f64 {
        self.tokens_per_s * nemo_llama_flops_per_token(&self.model, self.seq) / 1e12
    }

    /// The TFLOP/s half a token per second makes: what rounding the
    /// tokens to whole ones can move the derived rate by.
    fn half_a_token(&self) -> f64 {
        0.5 * nemo_llama_flops_per_token(&self.model, self.seq) / 1e12
    }
}

/// The published rates of a reference table's rows whose model and source
/// pass `keep`.
fn rates(file: &str, keep: impl Fn(&str, &str) -> bool) -> Vec<PublishedRate> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/reference")
        .join(file);
    let mut rows = csv::Reader::from_path(path).expect("the table reads");
    let headers = rows.headers().unwrap().clone();
    let column = |name: &str| headers.iter().position(|h| h == name).unwrap();
    let columns = [
        "seq_len",
        "tokens_per_s_per_gpu",
        "published_model_tflops_per_gpu",
    ]
    .map(column);
    let (model, source) = (column("model"), column("source"));
    rows.records()
        .map(|row| row.unwrap())
        .filter(|row| keep(&row[model], &row[source]))
        .map(|row| {
            let [seq, tokens_per_s, tflops] = columns.map(|i| row[i].parse::<f64>().unwrap());
            PublishedRate {
                model: row[model].to_string(),
                seq,
                tokens_per_s,
                tflops,
            }
        })
        .collect()
}

/// The long-context table publishes TFLOP/s per GPU only; its tokens per
/// second are that rate over NeMo's model FLOPs per token of the time. The
/// formula is checked first where NeMo published both figures (the 24.07
/// Llama rows), then against every long-context row.
#[test]
fn long_context_rates_follow_nemos_flops_formula() {
    let nemo_2407 = rates("published_throughput.csv", |model, source| {
        model.starts_with("llama") && source.ends_with("NeMo 24.07")
    });
    assert_eq!(nemo_2407.len(), 5, "the 24.07 Llama rows: {nemo_2407:?}");
    for row in &nemo_2407 {
        // Both figures are rounded to whole ones.
        let derived = row.tflops_from_tokens();
        assert!(
            (derived - row.tflops).abs() <= 0.5 + row.half_a_token(),
            "{row:?}: {derived}"
        );
    }
    let long = rates("long_context_cp.csv", |_, _| true);
    assert_eq!(long.len(), 17, "the long-context rows");
    for row in &long {
        // The tokens are rounded to whole ones.
        let derived = row.tflops_from_tokens();
        assert!(
            (derived - row.tflops).abs() <= row.half_a_token(),
            "{row:?}: {derived}"
        );
    }
}
