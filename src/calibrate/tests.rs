use super::*;
use crate::cluster::builtin_node;
use crate::coefficients::{parse_cost_model, render_cost_model};
use crate::config::Recompute;
use crate::runs::{RowDefaults, RunTable, runs_from_table};
use std::path::Path;

const SINGLE: &str = "tests/data/reference/a100_single_node_runs.csv";
const SC21: &str = "tests/data/reference/megatron_sc21_table1.csv";

fn load(file: &str, name: &str, vocab: u64, seq: u64) -> Dataset {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let defaults = RowDefaults::gpt(vocab, seq, AttentionKind::Standard, Recompute::Full);
    let table = RunTable::read(&path).unwrap();
    let group = builtin_node("a100-80gb", 400).unwrap();
    let runs = runs_from_table(&table, &defaults, (&group).into()).unwrap();
    Dataset {
        name: name.into(),
        runs,
        group,
    }
}

fn single_node() -> Dataset {
    load(SINGLE, "a100_single_node_runs", 50257, 1024)
}

fn sc21() -> Dataset {
    load(SC21, "megatron_sc21_table1", 51200, 2048)
}

/// Every `step`-th run, from `offset`.
fn every(mut d: Dataset, step: usize, offset: usize) -> Dataset {
    d.runs = d.runs.into_iter().skip(offset).step_by(step).collect();
    d
}

/// Replaces every run's measured time with the prediction of `truth`.
fn synthesise(mut d: Dataset, truth: &CostModel) -> Dataset {
    for run in &mut d.runs {
        let s = Scenario::new(&run.model, run.global_batch, &d.group, run.gpus, truth);
        run.measured_s = Some(predict(&s, &run.config).iteration_s);
    }
    d
}

fn fit_of<'a>(c: &'a Calibration, name: &str) -> &'a CoefficientFit {
    c.coefficients.iter().find(|f| f.name == name).unwrap()
}

fn quick(free: &[&str]) -> FitOptions {
    FitOptions {
        free: Some(free.iter().map(|s| s.to_string()).collect()),
        folds: 0,
        bootstrap: 0,
        max_iters: 300,
        ..FitOptions::default()
    }
}

#[test]
fn recovers_known_coefficients_from_synthetic_times() {
    let mut truth = CostModel::datasheet();
    let known = [
        ("gemm_efficiency", 0.65),
        ("host_us_per_layer_pass", 700.0),
        ("microbatch_overhead_ms", 3.0),
        ("elementwise_traffic_scale", 1.4),
    ];
    for (name, value) in known {
        assert!(truth.coefficients.set(name, value));
    }
    let data = synthesise(every(single_node(), 7, 3), &truth);
    assert!(data.runs.len() >= 200, "{}", data.runs.len());
    let names: Vec<&str> = known.iter().map(|k| k.0).collect();
    let c = calibrate(
        &[data],
        &CostModel::datasheet(),
        "synthetic",
        &quick(&names),
    )
    .unwrap();
    for (name, value) in known {
        let fit = fit_of(&c, name);
        println!("{name}: fitted {} (true {value})", fit.value);
        assert_eq!(fit.status, FitStatus::Fitted, "{name}");
        assert!(
            (fit.value / value - 1.0).abs() < 0.05,
            "{name}: fitted {} against the true {value}",
            fit.value
        );
    }
    // Everything not named stays exactly at the prior.
    assert_eq!(fit_of(&c, "hbm_efficiency").status, FitStatus::Fixed);
    assert_eq!(c.model.coefficients.hbm_efficiency, 0.80);
    assert!(overall(&c.in_sample).unwrap().mape < 0.01);
}

#[test]
fn a_fit_beats_the_prior_on_held_out_rows() {
    let data = every(single_node(), 4, 1);
    let opts = FitOptions {
        holdout: Some(0.3),
        ..quick(&[
            "gemm_efficiency",
            "attention_efficiency_standard",
            "elementwise_traffic_scale",
            "host_us_per_layer_pass",
            "iteration_overhead_ms",
            "intra_node_efficiency",
        ])
    };
    let c = calibrate(&[data], &CostModel::datasheet(), "holdout", &opts).unwrap();
    let prior = overall(c.prior_holdout.as_ref().unwrap()).unwrap();
    let fitted = overall(c.holdout.as_ref().unwrap()).unwrap();
    println!(
        "held-out MAPE: prior {:.4}, fitted {:.4}",
        prior.mape, fitted.mape
    );
    assert_eq!(prior.rows, fitted.rows);
    assert_eq!(fitted.rows + c.rows, 360);
    assert_eq!(fitted.rows, 108);
    assert!(
        fitted.mape < 0.75 * prior.mape,
        "held-out MAPE: fitted {} against prior {}",
        fitted.mape,
        prior.mape
    );
    let report = render_report(&c);
    assert!(report.contains("### Held out"), "{report}");
}

#[test]
fn too_few_runs_and_unknown_names_are_refused() {
    let two = Dataset {
        runs: single_node().runs.into_iter().take(2).collect(),
        ..single_node()
    };
    let names = [
        "gemm_efficiency",
        "host_us_per_layer_pass",
        "elementwise_traffic_scale",
        "iteration_overhead_ms",
    ];
    match calibrate(&[two], &CostModel::datasheet(), "x", &quick(&names)) {
        Err(CalibrateError::TooFewRuns { rows, free, needed }) => {
            assert_eq!((rows, free, needed), (2, 4, 4));
        }
        other => panic!("{other:?}"),
    }

    let err = calibrate(
        &[sc21()],
        &CostModel::datasheet(),
        "x",
        &quick(&["gemm_eficiency"]),
    )
    .unwrap_err();
    assert!(
        matches!(err, CalibrateError::UnknownCoefficient { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("gemm_eficiency") && text.contains("`gemm_efficiency`"),
        "{text}"
    );

    let mut unmeasured = sc21();
    for run in &mut unmeasured.runs {
        run.measured_s = None;
    }
    let err = calibrate(
        &[unmeasured],
        &CostModel::datasheet(),
        "x",
        &quick(&["gemm_efficiency"]),
    )
    .unwrap_err();
    assert!(
        matches!(&err, CalibrateError::NoMeasuredRows { dataset } if dataset == "megatron_sc21_table1"),
        "{err:?}"
    );

    let err = calibrate(&[], &CostModel::datasheet(), "x", &FitOptions::default()).unwrap_err();
    assert!(matches!(err, CalibrateError::NoDatasets));
    let bad = FitOptions {
        holdout: Some(1.0),
        ..quick(&["gemm_efficiency"])
    };
    let err = calibrate(&[sc21()], &CostModel::datasheet(), "x", &bad).unwrap_err();
    assert!(matches!(err, CalibrateError::InvalidOption(_)), "{err:?}");
}

#[test]
fn single_node_runs_do_not_inform_inter_node_efficiency_nor_memory_accounting() {
    // Every coefficient screened; a few iterations are enough to see the statuses.
    let opts = FitOptions {
        max_iters: 3,
        ..quick(&[])
    };
    let opts = FitOptions { free: None, ..opts };
    let c = calibrate(
        &[every(single_node(), 24, 5)],
        &CostModel::datasheet(),
        "x",
        &opts,
    )
    .unwrap();
    let inter = fit_of(&c, "inter_node_efficiency");
    assert_eq!(inter.status, FitStatus::NotInformed);
    assert!(inter.note.contains("one node"), "{}", inter.note);
    assert_eq!(c.model.coefficients.inter_node_efficiency, 0.80);
    for name in [
        "weight_bytes_per_param",
        "gradient_bytes_per_param",
        "optimizer_bytes_per_param",
        "logit_bytes",
        "runtime_overhead_gib",
        "memory_reserve_fraction",
        "attention_efficiency_flash",
        "bpipe_overlap",
        "zero3_prefetch_overlap",
    ] {
        let f = fit_of(&c, name);
        assert_ne!(f.status, FitStatus::Fitted, "{name}");
        assert_eq!(f.value, f.prior, "{name}");
        assert_eq!(c.model.coefficients.get(name), Some(f.prior), "{name}");
    }
    for name in [
        "gemm_efficiency",
        "host_us_per_layer_pass",
        "intra_node_efficiency",
    ] {
        assert_eq!(fit_of(&c, name).status, FitStatus::Fitted, "{name}");
    }
    let report = render_report(&c);
    assert!(
        report.contains("`inter_node_efficiency` is not informed"),
        "{report}"
    );

    // Multi-node runs do inform it.
    let c = calibrate(
        &[sc21()],
        &CostModel::datasheet(),
        "x",
        &quick(&["inter_node_efficiency", "gemm_efficiency"]),
    )
    .unwrap();
    assert_eq!(
        fit_of(&c, "inter_node_efficiency").status,
        FitStatus::Fitted
    );
}

#[test]
fn the_same_seed_gives_the_same_calibration() {
    let data = [every(single_node(), 12, 0), sc21()];
    let opts = FitOptions {
        folds: 3,
        bootstrap: 3,
        max_iters: 150,
        seed: 7,
        holdout: Some(0.2),
        ..quick(&[
            "gemm_efficiency",
            "host_us_per_layer_pass",
            "inter_node_efficiency",
        ])
    };
    let a = calibrate(&data, &CostModel::datasheet(), "x", &opts).unwrap();
    let b = calibrate(&data, &CostModel::datasheet(), "x", &opts).unwrap();
    assert_eq!(a.coefficients, b.coefficients);
    assert_eq!(a.model.coefficients, b.model.coefficients);
    // Figures hold NaN where a dataset has no ranking groups: compare as text.
    let text = |c: &Calibration| format!("{:?} {:?}", c.cross_validated, c.holdout);
    assert_eq!(text(&a), text(&b));
    assert_eq!(a.data_hash, b.data_hash);
    assert!(fit_of(&a, "gemm_efficiency").ci95.is_some());
    assert_eq!(a.folds, 3);
    assert_eq!(a.bootstrap, 3);
}

#[test]
fn a_calibrated_model_renders_and_reads_back_with_its_provenance() {
    let data = [every(single_node(), 12, 0), sc21()];
    let opts = FitOptions {
        folds: 3,
        bootstrap: 2,
        max_iters: 100,
        ..quick(&["gemm_efficiency", "inter_node_efficiency"])
    };
    let c = calibrate(&data, &CostModel::datasheet(), "calibrated", &opts).unwrap();
    let p = &c.model.provenance;
    for key in [
        "fitted_on",
        "data_hash",
        "cluster",
        "date",
        "paratune_version",
        "cv_mape",
        "cv_worst",
        "cv_mean_spearman",
        "cv_mean_top1_regret",
        "in_sample_mape",
        "datasets",
    ] {
        assert!(p.contains_key(key), "provenance lacks {key}: {p:?}");
    }
    let date = p["date"].as_str().unwrap();
    assert!(date.len() == 10 && date.starts_with("20"), "{date}");
    let sc = p["datasets"]["megatron_sc21_table1"].as_table().unwrap();
    assert!(sc.contains_key("cv_mape") && !sc.contains_key("cv_mean_spearman"));
    let text = render_cost_model(&c.model);
    let back = parse_cost_model(&text, "calibrated.toml").unwrap();
    assert_eq!(back, c.model);
}

#[test]
fn datasets_of_one_row_per_job_have_no_ranking_figures() {
    let opts = FitOptions {
        folds: 5,
        bootstrap: 2,
        max_iters: 100,
        ..quick(&["gemm_efficiency", "inter_node_efficiency"])
    };
    let c = calibrate(&[sc21()], &CostModel::datasheet(), "x", &opts).unwrap();
    assert_eq!(c.folds, 5);
    let cv = overall(&c.cross_validated).unwrap();
    assert_eq!(cv.rows, 10);
    assert!(cv.mape.is_finite());
    assert!(cv.mean_spearman.is_nan() && !cv.has_ranking());
    let report = render_report(&c);
    assert!(
        report.contains("n/a") && report.contains("one row each"),
        "{report}"
    );
}

#[test]
fn folds_keep_the_rows_of_one_job_together() {
    let data = single_node();
    let rows: Vec<Row> = data
        .runs
        .iter()
        .enumerate()
        .map(|(i, run)| Row {
            dataset: 0,
            run,
            nodes: &data.group,
            measured: 1.0,
            group: i % 17,
        })
        .collect();
    let subset: Vec<usize> = (0..rows.len()).collect();
    let (k, of) = group_folds(&rows, &subset, 1, 5, 3).unwrap();
    assert_eq!(k, 5);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(of[i], of[r.group], "row {i}");
    }
    let mut used: Vec<usize> = of.clone();
    used.sort_unstable();
    used.dedup();
    assert_eq!(used, vec![0, 1, 2, 3, 4]);
    assert!(group_folds(&rows[..1], &[0], 1, 5, 3).is_none());
}

/// Reserved peaks inform each model kind's fragmentation: runs of a dense
/// model and of one with experts, their peaks predicted by a model whose
/// two shares differ from the prior's, give both shares back.
#[test]
fn reserved_peaks_fit_the_dense_and_the_moe_fragmentation_apart() {
    use crate::model::MoeSpec;
    use crate::runs::{MeasuredMemory, MemoryRank};
    let prior = crate::coefficients::builtin_cost_model("datasheet").unwrap();
    let mut truth = prior.clone();
    truth.coefficients.set("allocator_fragmentation", 0.05);
    truth.coefficients.set("moe_allocator_fragmentation", 0.2);
    let mut data = every(single_node(), 120, 0);
    let experts = data.runs.clone().into_iter().map(|mut run| {
        run.model.moe = Some(MoeSpec::megatron_defaults(8, run.model.ffn_hidden));
        run
    });
    data.runs.extend(experts.collect::<Vec<_>>());
    for run in &mut data.runs {
        let s = Scenario::new(&run.model, run.global_batch, &data.group, run.gpus, &truth);
        let p = predict(&s, &run.config);
        run.measured_memory = Some(MeasuredMemory {
            allocated: Some(p.peak_allocated_bytes),
            reserved: Some(p.peak_reserved_bytes),
            rank: MemoryRank::Max,
        });
    }
    let rows = memory_rows(&data.runs, &data.group);
    let fit = fit_memory(&rows, &prior, 0, 7).unwrap();
    let fitted = |name: &str| {
        fit.coefficients
            .iter()
            .find(|(n, ..)| *n == name)
            .map(|&(_, _, value)| value)
            .unwrap_or_else(|| panic!("{name} not fitted: {:?}", fit.coefficients))
    };
    assert!((fitted("allocator_fragmentation") - 0.05).abs() < 0.01);
    assert!((fitted("moe_allocator_fragmentation") - 0.2).abs() < 0.02);
}
