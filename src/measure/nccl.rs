//! `paratune profile comm`: NCCL collectives over the local GPUs, one
//! process driving every GPU (cudarc's NCCL, the `cuda` feature), timed
//! like nccl-tests: out-of-place, `size` as nccl-tests defines it, bus
//! bandwidth by its formulas. cudarc loads `libcuda` and `libnccl.so`
//! dynamically and panics without them, so both are checked first. Every
//! size's result is checked once (rank `r` sends `r + 1` everywhere), so a
//! collective that runs but moves the wrong bytes is an error, not a time.
//!
//! cudarc opens NCCL as `libnccl.so`, while NCCL's soname, and what PyTorch's
//! wheels ship and load, is `libnccl.so.2`. [`nccl_link_dir`] finds the NCCL
//! this process already has (libtorch's) or one on `LD_LIBRARY_PATH` and
//! links it as `libnccl.so` in a directory the worker puts first on its
//! library path, so both use the same NCCL.

use super::{MeasureError, StoppingRule};
use crate::profile::{CollectiveOp, CollectivePoint};

/// What to sweep.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CommJob {
    pub gpus: Vec<usize>,
    /// The collectives to sweep.
    pub ops: Vec<CollectiveOp>,
    /// Sizes double from 1 KiB up to this, bytes.
    pub max_bytes: u64,
    pub rule: StoppingRule,
}

/// The sizes a sweep measures: 1 KiB doubling up to `max_bytes`.
pub fn sweep_sizes(max_bytes: u64) -> Vec<u64> {
    std::iter::successors(Some(1024u64), |s| s.checked_mul(2))
        .take_while(|&s| s <= max_bytes)
        .collect()
}

/// nccl-tests' bus-bandwidth factor for `op` over `ranks`.
pub fn bus_factor(op: CollectiveOp, ranks: u64) -> f64 {
    let r = ranks as f64;
    match op {
        CollectiveOp::AllReduce => 2.0 * (r - 1.0) / r,
        CollectiveOp::AllGather | CollectiveOp::ReduceScatter => (r - 1.0) / r,
        CollectiveOp::SendRecv => 1.0,
    }
}

pub fn check_comm_job(job: &CommJob) -> Result<(), MeasureError> {
    let mut seen = job.gpus.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != job.gpus.len() || job.gpus.len() < 2 {
        return Err(MeasureError::Invalid {
            field: "gpus",
            message: "give at least two different GPU indices, e.g. 0,1,2,3".into(),
        });
    }
    if job.max_bytes < 1024 {
        return Err(MeasureError::Invalid {
            field: "max_bytes",
            message: "give 1KiB or more".into(),
        });
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub fn measure_comm(
    job: &CommJob,
    mut progress: impl FnMut(CollectiveOp, u64),
) -> Result<Vec<CollectivePoint>, MeasureError> {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    check_comm_job(job)?;
    for &gpu in &job.gpus {
        super::cuda_presence(super::Device::Cuda(gpu))?;
    }
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(MeasureError::Failed(
            "NCCL was not found: install it, or put the folder holding libnccl.so.2 (PyTorch's nvidia/nccl/lib) on LD_LIBRARY_PATH".into(),
        ));
    }
    catch_unwind(AssertUnwindSafe(|| sweep(job, &mut progress)))
        .map_err(|_| MeasureError::Failed("the NCCL sweep panicked in cudarc".into()))?
}

#[cfg(not(feature = "cuda"))]
pub fn measure_comm(
    job: &CommJob,
    _progress: impl FnMut(CollectiveOp, u64),
) -> Result<Vec<CollectivePoint>, MeasureError> {
    check_comm_job(job)?;
    Err(MeasureError::NotCompiledCuda {
        what: "`profile comm` (NCCL collectives)",
    })
}

/// What rank `rank` of `ranks` must hold after `op` when every rank `r`
/// sent `r + 1` in every element: the sum for the reductions, the sender's
/// value per gathered chunk, the previous rank's value for a send/receive.
/// `Err` names the first wrong element.
pub fn check_received(
    op: CollectiveOp,
    ranks: usize,
    rank: usize,
    received: &[f32],
) -> Result<(), String> {
    let sum = (ranks * (ranks + 1) / 2) as f32;
    let chunk = (received.len() / ranks).max(1);
    let expected = |i: usize| match op {
        CollectiveOp::AllReduce | CollectiveOp::ReduceScatter => sum,
        CollectiveOp::AllGather => (i / chunk + 1) as f32,
        CollectiveOp::SendRecv => ((rank + ranks - 1) % ranks + 1) as f32,
    };
    match received
        .iter()
        .enumerate()
        .find(|&(i, &v)| v != expected(i))
    {
        None => Ok(()),
        Some((i, &v)) => Err(format!(
            "{op} over {ranks} GPUs gave wrong results: rank {rank} element {i} is {v}, expected {}",
            expected(i)
        )),
    }
}

/// A directory holding `libnccl.so`, linked to the NCCL this process has
/// mapped (`maps`, the text of `/proc/self/maps`) or else to a
/// `libnccl.so.N` in one of `library_dirs`, created under `scratch`. `None`
/// when there is nothing to link (no NCCL found, or a plain `libnccl.so` is
/// already on the library path) or the link cannot be made.
pub fn nccl_link_dir(
    maps: &str,
    library_dirs: &[std::path::PathBuf],
    scratch: &std::path::Path,
) -> Option<std::path::PathBuf> {
    // The NCCL libtorch already loaded comes first: a different one found
    // by name would be a second NCCL in the process.
    let mapped = mapped_nccl(maps);
    if mapped.is_none() && library_dirs.iter().any(|d| d.join("libnccl.so").exists()) {
        return None;
    }
    let target = mapped.or_else(|| {
        library_dirs
            .iter()
            .filter_map(|d| std::fs::read_dir(d).ok())
            .flatten()
            .flatten()
            .map(|entry| entry.path())
            .find(|path| is_versioned_nccl(path))
    })?;
    let dir = scratch.join("nccl");
    std::fs::create_dir_all(&dir).ok()?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    #[cfg(unix)]
    std::os::unix::fs::symlink(&target, &link).ok()?;
    #[cfg(not(unix))]
    std::fs::copy(&target, &link).ok()?;
    Some(dir)
}

/// The path of a `libnccl.so.N` mapped into the process, from `/proc/self/maps`.
fn mapped_nccl(maps: &str) -> Option<std::path::PathBuf> {
    // address perms offset device inode path: only the path has a `/`, and
    // it may hold spaces.
    maps.lines()
        .filter_map(|line| line.find('/').map(|at| line[at..].trim_end()))
        .map(std::path::PathBuf::from)
        .find(|path| is_versioned_nccl(path))
}

fn is_versioned_nccl(path: &std::path::Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("libnccl.so."))
        .is_some_and(|version| version.split('.').all(|p| p.parse::<u32>().is_ok()))
}

#[cfg(feature = "cuda")]
fn sweep(
    job: &CommJob,
    progress: &mut impl FnMut(CollectiveOp, u64),
) -> Result<Vec<CollectivePoint>, MeasureError> {
    use super::Sampler;
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use cudarc::nccl::{Comm, ReduceOp, result as nccl};
    use std::sync::Arc;
    use std::time::Instant;

    let failed = |e: &dyn std::fmt::Debug| MeasureError::Failed(format!("NCCL: {e:?}"));
    let streams: Vec<Arc<CudaStream>> = job
        .gpus
        .iter()
        .map(|&i| CudaContext::new(i).map(|ctx| ctx.default_stream()))
        .collect::<Result<_, _>>()
        .map_err(|e| failed(&e))?;
    let comms = Comm::from_devices(streams.clone()).map_err(|e| failed(&e))?;
    let ranks = comms.len();
    let sync = || -> Result<(), MeasureError> {
        for s in &streams {
            s.synchronize().map_err(|e| failed(&e))?;
        }
        Ok(())
    };
    let mut points = Vec::new();
    for &op in &job.ops {
        for bytes in sweep_sizes(job.max_bytes) {
            progress(op, bytes);
            let elements = (bytes / 4) as usize;
            // nccl-tests' `size`: each rank's buffer for all-reduce and
            // send/receive, the gathered buffer for all-gather, the buffer
            // before scattering for reduce-scatter.
            let (send_len, recv_len) = match op {
                CollectiveOp::AllReduce | CollectiveOp::SendRecv => (elements, elements),
                CollectiveOp::AllGather => (elements / ranks, elements / ranks * ranks),
                CollectiveOp::ReduceScatter => (elements / ranks * ranks, elements / ranks),
            };
            if send_len == 0 || recv_len == 0 {
                continue;
            }
            let send: Vec<CudaSlice<f32>> = streams
                .iter()
                .enumerate()
                .map(|(rank, s)| {
                    s.clone_htod(&vec![(rank + 1) as f32; send_len])
                        .map_err(|e| failed(&e))
                })
                .collect::<Result<_, _>>()?;
            let mut recv: Vec<CudaSlice<f32>> = streams
                .iter()
                .map(|s| s.alloc_zeros::<f32>(recv_len).map_err(|e| failed(&e)))
                .collect::<Result<_, _>>()?;
            let once = |recv: &mut [CudaSlice<f32>]| -> Result<(), MeasureError> {
                nccl::group_start().map_err(|e| failed(&e))?;
                let mut issued = Ok(());
                for (rank, comm) in comms.iter().enumerate() {
                    let (s, r) = (&send[rank], &mut recv[rank]);
                    let status = match op {
                        CollectiveOp::AllReduce => comm.all_reduce(s, r, &ReduceOp::Sum).map(drop),
                        CollectiveOp::AllGather => comm.all_gather(s, r).map(drop),
                        CollectiveOp::ReduceScatter => {
                            comm.reduce_scatter(s, r, &ReduceOp::Sum).map(drop)
                        }
                        CollectiveOp::SendRecv => {
                            let next = ((rank + 1) % ranks) as i32;
                            let previous = ((rank + ranks - 1) % ranks) as i32;
                            comm.send(s, next)
                                .and_then(|()| comm.recv(r, previous).map(drop))
                        }
                    };
                    if let Err(e) = status {
                        issued = Err(failed(&e));
                        break;
                    }
                }
                // The group is closed even when a call failed, so NCCL is
                // left usable and the error is the first call's.
                let ended = nccl::group_end().map_err(|e| failed(&e));
                issued?;
                ended?;
                sync()
            };
            for _ in 0..job.rule.warmup.max(1) {
                once(&mut recv)?;
            }
            for (rank, (stream, received)) in streams.iter().zip(&recv).enumerate() {
                let host = stream.clone_dtoh(received).map_err(|e| failed(&e))?;
                check_received(op, ranks, rank, &host).map_err(MeasureError::Failed)?;
            }
            let mut sampler = Sampler::new(job.rule);
            while !sampler.done() {
                let start = Instant::now();
                once(&mut recv)?;
                sampler.push(start.elapsed().as_secs_f64());
            }
            let seconds = sampler.summary().mean;
            let size = (recv_len.max(send_len) * 4) as f64;
            points.push(CollectivePoint {
                op,
                ranks: ranks as u64,
                bytes: size,
                seconds,
                busbw: size / seconds / 1e9 * bus_factor(op, ranks as u64),
            });
        }
    }
    Ok(points)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_double_from_one_kib() {
        assert_eq!(sweep_sizes(8192), [1024, 2048, 4096, 8192]);
        assert_eq!(sweep_sizes(1 << 30).len(), 21);
        assert!(sweep_sizes(1000).is_empty());
    }

    #[test]
    fn bus_factors_are_nccl_tests_formulas() {
        assert_eq!(bus_factor(CollectiveOp::AllReduce, 8), 1.75);
        assert_eq!(bus_factor(CollectiveOp::AllGather, 4), 0.75);
        assert_eq!(bus_factor(CollectiveOp::SendRecv, 2), 1.0);
    }

    #[test]
    fn gpu_lists_are_checked() {
        let job = |gpus: Vec<usize>| CommJob {
            gpus,
            ops: CollectiveOp::ALL.to_vec(),
            max_bytes: 1 << 20,
            rule: StoppingRule::default(),
        };
        assert!(check_comm_job(&job(vec![0])).is_err());
        assert!(check_comm_job(&job(vec![0, 0])).is_err());
        assert!(check_comm_job(&job(vec![0, 1])).is_ok());
    }

    #[test]
    fn received_buffers_are_checked_per_collective() {
        use CollectiveOp::*;
        // Three ranks sent 1, 2 and 3.
        assert!(check_received(AllReduce, 3, 0, &[6.0; 4]).is_ok());
        assert!(check_received(ReduceScatter, 3, 2, &[6.0; 2]).is_ok());
        assert!(check_received(AllGather, 3, 1, &[1.0, 1.0, 2.0, 2.0, 3.0, 3.0]).is_ok());
        assert!(check_received(SendRecv, 3, 0, &[3.0; 4]).is_ok());
        assert!(check_received(SendRecv, 3, 2, &[2.0; 4]).is_ok());
        let err = check_received(AllReduce, 3, 1, &[6.0, 6.0, 0.0]).unwrap_err();
        assert!(
            err.contains("rank 1 element 2 is 0") && err.contains("expected 6"),
            "{err}"
        );
        assert!(check_received(AllGather, 2, 0, &[1.0, 1.0, 1.0, 2.0]).is_err());
    }

    #[test]
    fn nccl_is_linked_from_the_mapped_library_or_the_library_path() {
        let scratch = tempfile::tempdir().unwrap();
        let libs = tempfile::tempdir().unwrap();
        let soname = libs.path().join("libnccl.so.2");
        std::fs::write(&soname, b"not really a library").unwrap();
        let maps = format!(
            "7f0000-7f1000 r-xp 00000000 08:01 42       /usr/lib/libc.so.6\n\
             7f1000-7f2000 rw-p 00000000 00:00 0        [heap]\n\
             7f2000-7f3000 r-xp 00000000 08:01 43       {}\n",
            soname.display()
        );
        let dir = nccl_link_dir(&maps, &[], scratch.path()).expect("linked from maps");
        let link = dir.join("libnccl.so");
        assert_eq!(std::fs::read_link(&link).unwrap(), soname);
        // Not mapped: found on the library path.
        let dir = nccl_link_dir("", &[libs.path().to_path_buf()], scratch.path()).unwrap();
        assert_eq!(std::fs::read_link(dir.join("libnccl.so")).unwrap(), soname);
        // A plain libnccl.so already on the path needs no link, unless
        // libtorch has loaded another NCCL; nothing found, none.
        std::fs::write(libs.path().join("libnccl.so"), b"").unwrap();
        let path = [libs.path().to_path_buf()];
        assert!(nccl_link_dir("", &path, scratch.path()).is_none());
        assert!(nccl_link_dir(&maps, &path, scratch.path()).is_some());
        let spaced = "7f2000-7f3000 r-xp 00000000 08:01 43   /opt/my libs/libnccl.so.2\n";
        assert_eq!(
            mapped_nccl(spaced),
            Some(std::path::PathBuf::from("/opt/my libs/libnccl.so.2"))
        );
        assert!(nccl_link_dir("", &[], scratch.path()).is_none());
        assert!(!is_versioned_nccl(std::path::Path::new(
            "/x/libnccl.so.2.bak"
        )));
        assert!(is_versioned_nccl(std::path::Path::new(
            "/x/libnccl.so.2.21.5"
        )));
    }
}
