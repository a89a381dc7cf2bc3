//! `paratune profile layer` measuring for real, on the CPU, through
//! libtorch: built only with the `torch` feature (CI builds it; see
//! README → Profiling). The layer is a tiny GPT shard so that the test
//! takes seconds, but every number comes from a real forward and backward.

#![cfg(feature = "torch")]

use paratune::config::Recompute;
use paratune::profile::{LayerPoint, LayerStatus, read_profile};
use std::path::Path;

mod common;
use common::{ok, run};

fn sweep(out: &Path, micro_batches: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "profile",
        "layer",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--layers",
        "2",
        "--seq-len",
        "128",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--micro-batch",
        micro_batches,
        "--max-seconds",
        "4",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    ok(&args)
}

fn no_recompute(points: &[LayerPoint]) -> Vec<&LayerPoint> {
    let mut rows: Vec<_> = points
        .iter()
        .filter(|p| p.recompute == Recompute::None)
        .collect();
    rows.sort_by_key(|p| p.micro_batch);
    rows
}

#[test]
fn a_cpu_sweep_measures_real_layers_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cpu");
    sweep(&out, "1,4", &[]);
    assert!(out.join("layers.parquet").is_file() && out.join("layers.csv").is_file());
    // Read back from Parquet (read_profile prefers it).
    let first = read_profile(&out).expect("the written profile reads back");
    assert_eq!(first.environment.gpu, "cpu");
    let rows = no_recompute(&first.layers);
    assert_eq!(rows.len(), 2);
    for p in &rows {
        assert_eq!(p.status, LayerStatus::Ok);
        assert!(!p.includes_tp_comm);
        assert!(p.forward_s > 0.0 && p.backward_s > 0.0, "{p:?}");
        // A backward pass does about twice a forward's work.
        assert!(p.backward_s > p.forward_s, "{p:?}");
        assert!(p.ci95_rel.is_some());
    }
    // Activations: 4 sequences keep more than 1 does (by at least 2 more
    // sequences' worth of the layer input, 128 x 256 x 4 bytes each).
    let act = |p: &LayerPoint| p.activation_bytes.expect("CPU memory is measured");
    assert!(
        act(rows[1]) - act(rows[0]) > 2.0 * 128.0 * 256.0 * 4.0,
        "{} -> {}",
        act(rows[0]),
        act(rows[1])
    );
    assert!(rows[1].peak_bytes.unwrap() >= act(rows[1]));
    // Full recomputation rows come from the same measurement.
    let full: Vec<_> = first
        .layers
        .iter()
        .filter(|p| p.recompute == Recompute::Full)
        .collect();
    assert_eq!(full.len(), 2);
    assert!(full.iter().all(|p| p.recompute_s.unwrap() > 0.0));

    // Resume: the two finished points are kept as they are, only the new one runs.
    let stdout = sweep(&out, "1,2,4", &[]);
    assert!(
        stdout.contains("resumed: 2 of 3 points are already in"),
        "{stdout}"
    );
    let second = read_profile(&out).unwrap();
    let again = no_recompute(&second.layers);
    assert_eq!(again.len(), 3);
    assert_eq!(again[0], rows[0]);
    assert_eq!(again[2], rows[1]);
    assert_eq!(second.environment.commands.len(), 2);
}

#[test]
fn a_point_over_the_memory_limit_is_recorded_as_out_of_memory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("small");
    let stdout = sweep(&out, "8", &["--memory-limit", "1MiB"]);
    assert!(stdout.contains("oom"), "{stdout}");
    let profile = read_profile(&out).unwrap();
    assert!(!profile.layers.is_empty());
    assert!(profile.layers.iter().all(|p| p.status == LayerStatus::Oom));
}

#[test]
fn no_cuda_device_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(&[
        "profile",
        "layer",
        "--hidden",
        "128",
        "--heads",
        "4",
        "--layers",
        "2",
        "--device",
        "cuda:0",
        "--out",
        dir.path().join("gpu").to_str().unwrap(),
    ]);
    if paratune_sees_a_gpu() {
        return;
    }
    assert_eq!(out.code, Some(2));
    let stderr = &out.stderr;
    assert!(
        stderr.contains("--device cuda:0: no CUDA device is present"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

/// This test machine has an NVIDIA driver and GPU (then the error case
/// cannot be shown).
fn paratune_sees_a_gpu() -> bool {
    Path::new("/proc/driver/nvidia/gpus").is_dir()
}

#[test]
fn profile_device_measures_matrix_multiplies_a_copy_and_fused_attention() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cpu");
    let stdout = ok(&[
        "profile",
        "device",
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--max-side",
        "512",
        "--attention-seq",
        "256",
        "--max-seconds",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(stdout.contains("GB/s"), "{stdout}");
    assert!(
        stdout.contains("fused causal attention, 2 x 256 tokens"),
        "{stdout}"
    );
    let device = read_profile(&out).unwrap().device.expect("device.toml");
    assert_eq!(device.device, "cpu");
    assert_eq!(
        device.matmul.iter().map(|p| p.m).collect::<Vec<_>>(),
        [256, 512]
    );
    assert!(
        device
            .matmul
            .iter()
            .all(|p| p.tflops > 0.0 && p.seconds > 0.0)
    );
    assert!(device.copy.unwrap().gbps > 0.0);
    // Fused attention at both head widths the cost model reads, forward
    // and backward.
    assert_eq!(
        device
            .attention
            .iter()
            .map(|p| (p.head_dim, p.heads, p.seq_len))
            .collect::<Vec<_>>(),
        [(64, 32, 256), (128, 16, 256)]
    );
    assert!(
        device
            .attention
            .iter()
            .all(|p| p.forward_tflops > 0.0 && p.backward_tflops > 0.0 && p.backward_s > 0.0)
    );
    let shown = ok(&["profile", "show", out.to_str().unwrap()]);
    assert!(shown.contains("matmul   512^3 fp32"), "{shown}");
    assert!(shown.contains("attention head 128 fp32"), "{shown}");
}

/// The memory-only pass `profile layer` runs on CUDA with the caching
/// allocator off works on any device: memory, no times.
#[test]
fn a_memory_only_worker_measures_memory_and_no_times() {
    let model = paratune::model::ModelSpec::gpt("t", 256, 4, 2, 1000, 128);
    let job = paratune::measure::WorkerJob::Layer(paratune::measure::LayerJob {
        model,
        micro_batch: 2,
        tp: 1,
        sequence_parallel: false,
        dtype: paratune::measure::Dtype::Fp32,
        device: paratune::measure::Device::Cpu,
        rule: paratune::measure::StoppingRule::default(),
        memory_limit_bytes: None,
        pass: paratune::measure::LayerPass::MemoryOnly,
    });
    let json = serde_json::to_string(&job).unwrap();
    let stdout = ok(&["profile", "worker", "--job", &json]);
    let reply: paratune::measure::WorkerReply =
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let paratune::measure::WorkerReply::Layer(m) = reply else {
        panic!("{stdout}")
    };
    assert!(
        !m.out_of_memory && m.repetitions == 0 && m.forward_s == 0.0,
        "{m:?}"
    );
    // Two sequences of 128 tokens keep at least their input, 2 x 128 x 256 x 4 bytes.
    assert!(
        m.activation_bytes.unwrap() > 2.0 * 128.0 * 256.0 * 4.0,
        "{m:?}"
    );
    assert!(m.peak_bytes.unwrap() >= m.activation_bytes.unwrap());
}

#[test]
fn a_sequence_parallel_shard_keeps_less_than_the_plain_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("sp");
    let stdout = sweep(&out, "4", &["--tp", "2", "--sequence-parallel", "off,on"]);
    assert!(stdout.contains(" on "), "{stdout}");
    let profile = read_profile(&out).unwrap();
    let row = |sp: bool| {
        profile
            .layers
            .iter()
            .find(|p| p.sequence_parallel == sp && p.recompute == Recompute::None)
            .unwrap_or_else(|| panic!("a row with sequence parallelism {sp}"))
            .clone()
    };
    let (plain, split) = (row(false), row(true));
    assert!(split.forward_s > 0.0 && split.backward_s > 0.0, "{split:?}");
    // The two layer norms' inputs (4 x 128 x 256 fp32, 0.5 MiB each) are
    // kept at half the sequence: at least 0.5 MiB less, and less in all.
    let saved = plain.activation_bytes.unwrap() - split.activation_bytes.unwrap();
    assert!(saved > 0.5 * 1024.0 * 1024.0, "saved {saved} bytes");
}
