//! How fast the search plans a large job: the whole default search space
//! for GPT-3 175B on 1,024 A100-80GB and for a 1T-parameter GPT on 3,072,
//! and DeepSeek-V3 on 1,024 H100s with tp, pp, ep, etp, virtual stages,
//! recomputation, both dispatchers, bf16 and FP8 and the engine switches
//! open (cp as the default space opens it: not at 4K tokens), and Llama 3
//! 8B with a 256K vocabulary on 64 A100s with every embedding sync.
//! Throughput is in configurations considered (every combination of the
//! space, valid or not) per second.
//!
//! `cargo bench --bench plan -- --warm-up-time 1 --measurement-time 3`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use paratune::cluster::builtin_node;
use paratune::coefficients::CostModel;
use paratune::config::{Precision, SyncMethod};
use paratune::model::builtin_model;
use paratune::search::{Job, SearchSpace, search};
use std::hint::black_box;
use std::time::Instant;

fn job(model: &str, nodes: u64, global_batch: u64) -> Job {
    job_on("a100-80gb", model, nodes, global_batch)
}

fn job_on(gpu: &str, model: &str, nodes: u64, global_batch: u64) -> Job {
    let group = builtin_node(gpu, nodes).expect("built-in GPU");
    Job {
        model: builtin_model(model).expect("built-in model"),
        global_batch,
        gpus: nodes * group.gpus_per_node,
        nodes: group,
        memory_limit: None,
        profile: None,
    }
}

fn plan(c: &mut Criterion) {
    let cost = CostModel::datasheet();
    let dense = SearchSpace::default();
    // Every dimension as the search opens it, and FP8 too (bf16 unless
    // asked); cp stays 1 at DeepSeek's 4K tokens, as the search opens it
    // from 8K (opening it here, 1 to 8, takes about ten times longer).
    let everything = SearchSpace {
        precision: Some(Precision::ALL.to_vec()),
        ..SearchSpace::default()
    };
    let every_sync = SearchSpace {
        embedding_sync: Some(SyncMethod::ALL.to_vec()),
        ..SearchSpace::default()
    };
    let mut wide_vocabulary = job("llama3-8b", 8, 64);
    wide_vocabulary.model.vocab = 256_000;
    wide_vocabulary.model.seq_len = 2048;
    let jobs = [
        (
            "llama3-8b with a 256K vocabulary on 64 A100-80GB, every embedding sync",
            wide_vocabulary,
            &every_sync,
        ),
        (
            "gpt3-175b on 1024 A100-80GB, batch 1536",
            job("gpt3-175b", 128, 1536),
            &dense,
        ),
        (
            "gpt-1t on 3072 A100-80GB, batch 3072",
            job("gpt-1t", 384, 3072),
            &dense,
        ),
        (
            "deepseek-v3 on 1024 H100, batch 1920, all dimensions",
            job_on("h100-sxm", "deepseek-v3", 128, 1920),
            &everything,
        ),
    ];
    let mut group = c.benchmark_group("search");
    // A search takes milliseconds: criterion's default 100 linearly growing
    // samples would need at least 5,050 searches, far past a 3 s measurement.
    group.sample_size(10);
    for (name, job, space) in &jobs {
        job.check().expect("a valid job");
        let start = Instant::now();
        let result = search(job, space, &cost);
        let elapsed = start.elapsed().as_secs_f64();
        let best = result.candidates.first().expect("something fits");
        eprintln!(
            "{name}: {} configurations considered ({} valid, {} fit) in {elapsed:.3} s \
             ({:.0}/s, one cold run); best {} at {:.2} s/iteration, MFU {:.1}%",
            result.considered,
            result.valid(),
            result.fitting(),
            result.considered as f64 / elapsed,
            best.config,
            best.prediction.iteration_s,
            best.prediction.mfu * 100.0,
        );
        group.throughput(Throughput::Elements(result.considered as u64));
        group.bench_function(*name, |b| {
            b.iter(|| search(black_box(job), black_box(*space), black_box(&cost)))
        });
    }
    group.finish();
}

criterion_group!(benches, plan);
criterion_main!(benches);
