//! `paratune validate` running local stage trials for real, on the CPU,
//! through libtorch (feature `torch`): plan -> trial -> refit end to end,
//! and the memory effects the trials must show.

#![cfg(feature = "torch")]

use paratune::config::Recompute;
use paratune::measure::{Device, Dtype, StageJob, StageMeasurement, WorkerJob, WorkerReply};
use paratune::model::ModelSpec;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{BIN, ok_in as ok};

fn cluster() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/validate/cpu-cluster.toml")
}

/// `paratune plan` for a tiny GPT on the two-"GPU" CPU cluster, with `extra` flags.
fn plan_args(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["plan", "--cluster"].map(String::from).to_vec();
    args.push(cluster().display().to_string());
    let model = [
        "--hidden",
        "256",
        "--heads",
        "4",
        "--layers",
        "4",
        "--seq-len",
        "128",
        "--vocab",
        "1000",
        "--global-batch",
        "8",
    ];
    args.extend(model.iter().chain(extra).map(|s| s.to_string()));
    args
}

/// The plan, as JSON in DIR/plan.json.
fn plan(dir: &Path) -> PathBuf {
    // The datasheet priors: what a CPU "cluster" starts from.
    let args = plan_args(&[
        "--top",
        "5",
        "--format",
        "json",
        "--cost-model",
        "datasheet",
    ]);
    let json = ok(dir, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let path = dir.join("plan.json");
    std::fs::write(&path, json).unwrap();
    path
}

#[test]
fn plan_validate_refit_end_to_end_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan(dir.path());
    let stdout = ok(
        dir.path(),
        &[
            "validate",
            plan.to_str().unwrap(),
            "--top",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--iterations",
            "2",
            "--loop",
            "2",
        ],
    );
    assert!(
        stdout.contains("round 1: predicted against measured"),
        "{stdout}"
    );
    assert!(
        stdout.contains("the ranking with the trials' layer times"),
        "{stdout}"
    );
    let out = dir.path().join("reports/plan");
    for file in [
        "report.md",
        "trials.csv",
        "memory.svg",
        "time.svg",
        "trials-history.csv",
    ] {
        assert!(out.join(file).is_file(), "{file} missing");
    }
    let svg = std::fs::read_to_string(out.join("memory.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("stage 0"));
    // Every trial is in the history, with a measured time.
    let history = std::fs::read_to_string(out.join("trials-history.csv")).unwrap();
    let rows: Vec<&str> = history.lines().skip(1).collect();
    assert!(rows.len() >= 2, "{history}");
    assert!(rows.iter().all(|r| r.contains(",cpu,fp32,")), "{history}");
    // The measured layer times were kept as a profile the planner reads.
    let profile = paratune::profile::read_profile(&out.join("profile")).unwrap();
    assert!(!profile.layers.is_empty());
    // The coefficients were refitted to the trials (the CPU's datasheet
    // figures are guesses far from it, so gemm_efficiency moves) and saved.
    assert!(
        stdout.contains("coefficients refitted to the trials so far")
            && stdout.contains("gemm_efficiency 0.8000 -> "),
        "{stdout}"
    );
    let refitted = paratune::coefficients::load_cost_model(&out.join("cost-model.toml")).unwrap();
    assert_ne!(
        refitted.coefficients.gemm_efficiency,
        paratune::coefficients::CostModel::datasheet()
            .coefficients
            .gemm_efficiency
    );
    let profile_dir = out.join("profile");
    let cost_model = out.join("cost-model.toml");
    let args = plan_args(&[
        "--profile",
        profile_dir.to_str().unwrap(),
        "--cost-model",
        cost_model.to_str().unwrap(),
    ]);
    let replanned = ok(
        dir.path(),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    assert!(replanned.contains("layer lookups"), "{replanned}");
}

#[test]
fn a_candidate_over_the_memory_limit_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan(dir.path());
    let stdout = ok(
        dir.path(),
        &[
            "validate",
            plan.to_str().unwrap(),
            "--top",
            "1",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--iterations",
            "1",
            "--memory-limit",
            "4MiB",
        ],
    );
    assert!(stdout.contains("does not fit"), "{stdout}");
}

fn stage(in_flight: u64, evicted: u64) -> StageJob {
    StageJob {
        model: ModelSpec::gpt("tiny", 256, 4, 4, 1000, 256),
        tp: 1,
        micro_batch: 4,
        layers: 2,
        first: false,
        last: false,
        recompute: Recompute::None,
        sequence_parallel: false,
        schedule_in_flight: in_flight,
        evicted,
        accepted: 0,
        accepted_bytes_per_microbatch: 0.0,
        micro_batches: in_flight + 1,
        weight_shards: 1,
        grad_shards: 1,
        optimizer_shards: 1,
        dtype: Dtype::Fp32,
        device: Device::Cpu,
        iterations: 1,
        memory_limit_bytes: None,
    }
}

/// Runs a stage trial in a fresh worker process, as `validate` does.
fn trial(job: StageJob) -> StageMeasurement {
    let json = serde_json::to_string(&WorkerJob::Stage(job)).unwrap();
    let out = Command::new(BIN)
        .args(["profile", "worker", "--job", &json])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    match serde_json::from_str::<WorkerReply>(stdout.trim()) {
        Ok(WorkerReply::Stage(m)) => m,
        other => panic!(
            "{other:?}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

#[test]
fn peak_memory_grows_with_micro_batches_in_flight() {
    let one = trial(stage(1, 0)).peak_bytes.unwrap();
    let four = trial(stage(4, 0)).peak_bytes.unwrap();
    // Each extra micro-batch in flight keeps two layers' activations:
    // well over 4 x 256 x 256 x 4 bytes (the layer input alone) each.
    let input = 4.0 * 256.0 * 256.0 * 4.0;
    assert!(four - one > 3.0 * 2.0 * input, "{one} -> {four}");
}

#[test]
fn a_bpipe_evictor_holds_fewer_activations() {
    let kept = trial(stage(4, 0)).peak_bytes.unwrap();
    let evicted = trial(stage(4, 2)).peak_bytes.unwrap();
    let input = 4.0 * 256.0 * 256.0 * 4.0;
    assert!(kept - evicted > 2.0 * input, "{kept} -> {evicted}");
}

#[test]
fn unfused_attention_keeps_its_scores() {
    let mut standard = stage(2, 0);
    standard.model.attention = paratune::model::AttentionKind::Standard;
    let fused = trial(stage(2, 0)).peak_bytes.unwrap();
    let unfused = trial(standard).peak_bytes.unwrap();
    // 4 heads x 256 x 256 fp32 scores per sequence, 4 sequences, 2 layers,
    // 2 micro-batches in flight: the softmax output alone is 8 MiB more.
    let scores = 4.0 * 256.0 * 256.0 * 4.0 * 4.0;
    assert!(unfused - fused > 2.0 * 2.0 * scores, "{fused} -> {unfused}");
}

#[test]
fn sequence_parallelism_keeps_a_chunk_of_the_sequence() {
    let mut plain = stage(4, 0);
    plain.tp = 2;
    let sequence_parallel = StageJob {
        sequence_parallel: true,
        ..plain.clone()
    };
    let without = trial(plain);
    let with = trial(sequence_parallel);
    assert!(with.time_per_microbatch_s > 0.0);
    // Each layer norm's input (4 x 256 x 256 fp32, 1 MiB) is kept at half
    // the sequence: at least 2 x 0.5 MiB less per layer and micro-batch in
    // flight, 2 layers, 4 in flight; half of that is asserted.
    let saved = without.peak_bytes.unwrap() - with.peak_bytes.unwrap();
    assert!(saved > 4.0 * 1024.0 * 1024.0, "saved {saved} bytes");
}

#[test]
fn zero3_holds_weight_shards_and_two_gathered_layers() {
    // Eight layers of 256 wide (about 0.79 M fp32 weights, 3.2 MB, each),
    // data parallelism 4: ZeRO-3 keeps 8 / 4 layers' worth of shards and two
    // gathered layers, four layers' worth less than whole weights.
    let layer_bytes = (12.0 * 256.0 * 256.0 + 13.0 * 256.0) * 4.0;
    for recompute in [Recompute::None, Recompute::Full] {
        let zero1 = StageJob {
            layers: 8,
            first: true,
            last: true,
            recompute,
            grad_shards: 4,
            optimizer_shards: 4,
            ..stage(2, 0)
        };
        let zero3 = StageJob {
            weight_shards: 4,
            ..zero1.clone()
        };
        let (whole, sharded) = (trial(zero1), trial(zero3));
        assert!(sharded.time_per_microbatch_s > 0.0, "{sharded:?}");
        let static_saved = whole.static_bytes.unwrap() - sharded.static_bytes.unwrap();
        assert!(
            static_saved > 3.0 * layer_bytes && static_saved < 5.0 * layer_bytes,
            "{recompute:?}: static {} -> {}",
            whole.static_bytes.unwrap(),
            sharded.static_bytes.unwrap()
        );
        let peak_saved = whole.peak_bytes.unwrap() - sharded.peak_bytes.unwrap();
        assert!(
            peak_saved > 2.0 * layer_bytes,
            "{recompute:?}: peak saved {peak_saved}"
        );
    }
}
