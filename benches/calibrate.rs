//! How long calibration takes on the 1,440 measured single-node runs: one
//! fit (no cross-validation, no bootstrap), and one collective fit on the
//! 7,168 NCCL all-reduce timings.
//!
//! `cargo bench --bench calibrate -- --warm-up-time 1 --measurement-time 10`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use paratune::calibrate::{Dataset, FitOptions, calibrate, fit_collectives, read_nccl_table};
use paratune::cluster::builtin_node;
use paratune::coefficients::CostModel;
use paratune::config::Recompute;
use paratune::model::AttentionKind;
use paratune::runs::{BaseNode, RowDefaults, RunTable, runs_from_table};
use std::hint::black_box;
use std::path::Path;

fn reference() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/reference"))
}

fn single_node_dataset() -> Dataset {
    let defaults = RowDefaults::gpt(50257, 1024, AttentionKind::Standard, Recompute::Full);
    let table = RunTable::read(&reference().join("a100_single_node_runs.csv")).expect("reads");
    Dataset {
        name: "a100_single_node_runs".into(),
        runs: runs_from_table(&table, &defaults, BaseNode::DGX_A100).expect("valid rows"),
        group: builtin_node("a100-80gb", 1).expect("built-in"),
    }
}

fn bench(c: &mut Criterion) {
    let datasets = [single_node_dataset()];
    let prior = CostModel::datasheet();
    let options = FitOptions {
        folds: 0,
        bootstrap: 0,
        ..FitOptions::default()
    };
    let mut group = c.benchmark_group("calibrate");
    group.sample_size(10);
    group.throughput(Throughput::Elements(datasets[0].runs.len() as u64));
    group.bench_function("fit on 1,440 single-node runs", |b| {
        b.iter(|| black_box(calibrate(&datasets, &prior, "bench", &options).expect("fits")))
    });
    let samples = read_nccl_table(&reference().join("a100_nccl_allreduce.csv")).expect("reads");
    let node = builtin_node("a100-80gb", 1).expect("built-in");
    group.throughput(Throughput::Elements(samples.len() as u64));
    group.bench_function("collective fit on 7,168 all-reduce timings", |b| {
        b.iter(|| black_box(fit_collectives(&samples, &node, &prior).expect("fits")))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
