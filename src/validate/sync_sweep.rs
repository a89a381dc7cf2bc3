//! Measuring embedding-gradient synchronisation between the torch worker's
//! ranks (`"mode": "sync"`): for a vocab x hidden fp32 table and batches of
//! token ids, the dense all-reduce, DDP's sparse all-gather and Parallax's
//! parameter server with p partitions, each timed for real between N local
//! ranks (gloo on the CPU, NCCL on GPUs). The worker writes
//! `report/sync.json`; [`read_sync`] turns it into checked [`SyncPoint`]s.
//!
//! [`SyncPoint`]: crate::profile::SyncPoint

use super::torch_launch::{
    SCHEMA, SweepReport, TrialDevice, TrialError, read_report, report_error,
};
use crate::config::SyncMethod;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A synchronisation sweep job, as the worker reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncSweepJob {
    pub schema: u32,
    pub mode: String,
    pub device: TrialDevice,
    pub backend: String,
    pub threads_per_rank: u64,
    pub dtype: String,
    pub seed: u64,
    pub report_dir: PathBuf,
    pub sync: SyncSweep,
}

/// What a sync sweep measures: every method in `methods` for every batch
/// size (and every partition count for the parameter server).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncSweep {
    /// Rows of the embedding table.
    pub vocab: u64,
    /// Columns of the embedding table (fp32).
    pub hidden: u64,
    /// Token ids in one rank's batch, one point per size.
    pub tokens_per_rank: Vec<u64>,
    /// The worker's method names ([`worker_method`]).
    pub methods: Vec<String>,
    /// Server shards of the parameter server, each 1 to ranks.
    pub partitions: Vec<u64>,
    /// A token stream, one id per line; rank R's batch of n tokens is ids
    /// `[R*n, (R+1)*n)` of it, wrapping around. Exactly one of this and
    /// `zipf_exponent` is set.
    pub token_file: Option<PathBuf>,
    /// Ids drawn i.i.d. with P(r) proportional to (r+1)^-s.
    pub zipf_exponent: Option<f64>,
    pub warmup: u64,
    pub iterations: u64,
}

/// The job of one sweep on `ranks` ranks of `device` (the world size
/// itself is torchrun's `--nproc-per-node`; the job carries none). The
/// partition counts are sorted and deduplicated, those outside 1..=ranks
/// dropped (a server lives on a rank); none left means every one of
/// 1..=ranks.
pub fn sync_sweep_job(
    device: TrialDevice,
    ranks: u64,
    mut sweep: SyncSweep,
    report_dir: &Path,
) -> SyncSweepJob {
    sweep.partitions.retain(|p| (1..=ranks).contains(p));
    sweep.partitions.sort_unstable();
    sweep.partitions.dedup();
    if sweep.partitions.is_empty() {
        sweep.partitions = (1..=ranks).collect();
    }
    SyncSweepJob {
        schema: SCHEMA,
        mode: "sync".into(),
        device,
        backend: device.backend().into(),
        threads_per_rank: 1,
        dtype: "fp32".into(),
        seed: 1234,
        report_dir: report_dir.to_path_buf(),
        sync: sweep,
    }
}

/// The worker's name of each synchronisation method.
pub fn worker_method(m: SyncMethod) -> &'static str {
    match m {
        SyncMethod::AllReduce => "all_reduce",
        SyncMethod::SparseAllGather => "sparse_all_gather",
        SyncMethod::ParameterServer => "parameter_server",
    }
}

#[derive(Deserialize)]
struct SyncReport {
    schema: u32,
    points: Vec<SyncReportPoint>,
}

impl SweepReport for SyncReport {
    fn schema(&self) -> u32 {
        self.schema
    }
}

#[derive(Deserialize)]
struct SyncReportPoint {
    method: String,
    ranks: u64,
    partitions: u64,
    vocab: u64,
    hidden: u64,
    element_bytes: u64,
    rows: f64,
    seconds: f64,
}

/// The synchronisation points of a sweep's `sync.json`, each checked.
pub fn read_sync(report_dir: &Path) -> Result<Vec<crate::profile::SyncPoint>, TrialError> {
    const FILE: &str = "sync.json";
    let report: SyncReport = read_report(report_dir, FILE)?;
    let bad = report_error(&report_dir.join(FILE));
    report
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let method = SyncMethod::ALL
                .into_iter()
                .find(|&m| worker_method(m) == p.method)
                .ok_or_else(|| bad(format!("point {i}: unknown method `{}`", p.method)))?;
            let point = crate::profile::SyncPoint {
                method,
                ranks: p.ranks,
                partitions: p.partitions,
                vocab: p.vocab,
                hidden: p.hidden,
                element_bytes: p.element_bytes,
                rows: p.rows,
                seconds: p.seconds,
            };
            point.check().map_err(|e| bad(format!("point {i}: {e}")))?;
            Ok(point)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep() -> SyncSweep {
        SyncSweep {
            vocab: 65536,
            hidden: 64,
            tokens_per_rank: vec![256, 1024],
            methods: SyncMethod::ALL
                .iter()
                .map(|&m| worker_method(m).to_string())
                .collect(),
            partitions: vec![1, 2],
            token_file: None,
            zipf_exponent: Some(1.0),
            warmup: 2,
            iterations: 5,
        }
    }

    #[test]
    fn a_sync_job_serialises_as_the_worker_reads_it() {
        let job = sync_sweep_job(TrialDevice::Cpu, 2, sweep(), Path::new("/tmp/r"));
        let v = serde_json::to_value(&job).unwrap();
        assert_eq!(v["schema"], 1);
        assert_eq!(v["mode"], "sync");
        assert_eq!(v["device"], "cpu");
        assert_eq!(v["backend"], "gloo");
        assert_eq!(v["threads_per_rank"], 1);
        assert_eq!(v["dtype"], "fp32");
        assert_eq!(v["seed"], 1234);
        assert_eq!(v["report_dir"], "/tmp/r");
        let s = &v["sync"];
        assert_eq!(s["vocab"], 65536);
        assert_eq!(s["hidden"], 64);
        assert_eq!(s["tokens_per_rank"], serde_json::json!([256, 1024]));
        assert_eq!(
            s["methods"],
            serde_json::json!(["all_reduce", "sparse_all_gather", "parameter_server"])
        );
        assert_eq!(s["partitions"], serde_json::json!([1, 2]));
        assert!(s["token_file"].is_null());
        assert_eq!(s["zipf_exponent"], 1.0);
        assert_eq!(s["warmup"], 2);
        assert_eq!(s["iterations"], 5);
        let back: SyncSweepJob = serde_json::from_value(v).unwrap();
        assert_eq!(back, job);
        let cuda = sync_sweep_job(TrialDevice::Cuda, 8, sweep(), Path::new("/tmp/r"));
        assert_eq!(cuda.backend, "nccl");
        assert_eq!(cuda.device, TrialDevice::Cuda);
    }

    #[test]
    fn partition_counts_stay_within_the_ranks() {
        let mut s = sweep();
        s.partitions = vec![4, 0, 2, 9, 2];
        let job = sync_sweep_job(TrialDevice::Cpu, 4, s.clone(), Path::new("/r"));
        assert_eq!(job.sync.partitions, vec![2, 4]);
        s.partitions = vec![];
        let job = sync_sweep_job(TrialDevice::Cpu, 3, s, Path::new("/r"));
        assert_eq!(job.sync.partitions, vec![1, 2, 3]);
    }

    #[test]
    fn a_sync_report_reads_back_as_sync_points() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("sync.json"),
            r#"{"schema": 1, "mode": "sync", "world_size": 2, "backend": "gloo", "device": "cpu",
                "points": [
                {"method": "all_reduce", "ranks": 2, "partitions": 0, "vocab": 65536, "hidden": 64,
                 "element_bytes": 4, "tokens": 256, "rows": 180.5, "seconds": 0.014, "samples": 5},
                {"method": "sparse_all_gather", "ranks": 2, "partitions": 0, "vocab": 65536,
                 "hidden": 64, "element_bytes": 4, "tokens": 256, "rows": 180.5, "seconds": 0.001,
                 "samples": 5},
                {"method": "parameter_server", "ranks": 2, "partitions": 2, "vocab": 65536,
                 "hidden": 64, "element_bytes": 4, "tokens": 256, "rows": 180.5, "seconds": 0.0016,
                 "samples": 5}]}"#,
        )
        .unwrap();
        let points = read_sync(dir.path()).unwrap();
        let methods: Vec<_> = points.iter().map(|p| p.method).collect();
        assert_eq!(methods, SyncMethod::ALL.to_vec());
        assert_eq!(points[2].partitions, 2);
        assert_eq!(points[1].rows, 180.5);
        assert_eq!(points[0].seconds, 0.014);
        // The dense gradient for all-reduce, the touched rows otherwise.
        assert_eq!(points[0].payload_bytes(), (65536 * 64 * 4) as f64);
        assert_eq!(points[1].payload_bytes(), 180.5 * 256.0);
    }

    fn refused(points: &str, schema: u32) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sync.json");
        std::fs::write(
            &path,
            format!(r#"{{"schema": {schema}, "mode": "sync", "points": [{points}]}}"#),
        )
        .unwrap();
        match read_sync(dir.path()) {
            Err(TrialError::Report { path: p, message }) => {
                assert_eq!(p, path.display().to_string());
                message
            }
            other => panic!("expected a report error, got {other:?}"),
        }
    }

    const GOOD: &str = r#"{"method": "parameter_server", "ranks": 2, "partitions": 1,
        "vocab": 512, "hidden": 64, "element_bytes": 4, "tokens": 16384, "rows": 511.0,
        "seconds": 0.001, "samples": 5}"#;

    #[test]
    fn bad_sync_reports_are_refused_naming_the_problem() {
        assert!(refused(GOOD, 2).contains("schema 2"));
        let unknown = GOOD.replace("parameter_server", "ring");
        assert!(refused(&unknown, 1).contains("unknown method `ring`"));
        // More shards than ranks.
        let shards = GOOD.replace(r#""partitions": 1"#, r#""partitions": 3"#);
        assert!(refused(&shards, 1).contains("`partitions` is 3"));
        // Shards on a method that has none.
        let dense = GOOD.replace("parameter_server", "all_reduce");
        assert!(refused(&dense, 1).contains("`partitions` is 1"));
        let rows = GOOD.replace(r#""rows": 511.0"#, r#""rows": 600.0"#);
        assert!(refused(&format!("{GOOD}, {rows}"), 1).starts_with("point 1: `rows` is 600"));
        let time = GOOD.replace(r#""seconds": 0.001"#, r#""seconds": 0.0"#);
        assert!(refused(&time, 1).contains("seconds"));
        let dir = tempfile::tempdir().unwrap();
        assert!(read_sync(dir.path()).is_err());
    }
}
