//! How fast run tables are read: 100,000 rows of paratune's schema parsed
//! into runs (every row's configuration checked), as `predict --runs`,
//! `evaluate` and `calibrate` read them. Reading is linear in the rows:
//! the issue that asked for this bench measured six minutes for 200,000
//! rows when each row's line number was counted from the start of the file.
//!
//! `cargo bench --bench runs -- --warm-up-time 1 --measurement-time 5`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use paratune::config::Recompute;
use paratune::model::AttentionKind;
use paratune::runs::{BaseNode, RowDefaults, RunTable, runs_from_table};
use std::fmt::Write as _;
use std::hint::black_box;

/// `rows` distinct, valid rows: 8-GPU splits of GPT shapes, as in the
/// reference measurements.
fn table_text(rows: usize) -> String {
    let mut text = String::from(
        "gpus,global_batch,micro_batch,hidden,heads,layers,seq_len,tp,dp,pp,iter_ms\n",
    );
    let splits = [
        (1, 8, 1),
        (2, 4, 1),
        (2, 2, 2),
        (4, 2, 1),
        (8, 1, 1),
        (1, 4, 2),
        (2, 1, 4),
    ];
    for i in 0..rows {
        let (tp, dp, pp) = splits[i % splits.len()];
        let layers = 8 * (1 + (i / splits.len()) % 64);
        let micro_batch = 1 << (i / (splits.len() * 64) % 3);
        let global_batch = micro_batch * dp * 16;
        // A new sequence length once the other columns have cycled: every
        // row is its own configuration, so no two contradict each other.
        let seq_len = 1024 + i / (splits.len() * 64 * 3);
        let _ = writeln!(
            text,
            "8,{global_batch},{micro_batch},1024,16,{layers},{seq_len},{tp},{dp},{pp},{:.1}",
            100.0 + (i % 997) as f64
        );
    }
    text
}

fn read_runs(c: &mut Criterion) {
    let rows = 100_000;
    let text = table_text(rows);
    let defaults = RowDefaults::gpt(50257, 1024, AttentionKind::Standard, Recompute::Full);
    let mut group = c.benchmark_group("run table");
    group.sample_size(10);
    group.throughput(Throughput::Elements(rows as u64));
    group.bench_function("parse 100,000 rows", |b| {
        b.iter(|| RunTable::parse(black_box(&text), "bench.csv").expect("valid"))
    });
    group.bench_function("parse and check 100,000 rows", |b| {
        b.iter(|| {
            let table = RunTable::parse(black_box(&text), "bench.csv").expect("valid");
            runs_from_table(&table, &defaults, BaseNode::DGX_A100).expect("valid rows")
        })
    });
    group.finish();
}

criterion_group!(benches, read_runs);
criterion_main!(benches);
