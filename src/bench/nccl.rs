//! `paratune profile comm`: NCCL collectives over the local GPUs, one
//! process driving every GPU (cudarc's NCCL, the `cuda` feature), timed
//! like nccl-tests: out-of-place, `size` as nccl-tests defines it, bus
//! bandwidth by its formulas. cudarc loads `libcuda` and `libnccl.so`
//! dynamically and panics without them, so both are checked first.

use super::{BenchError, StoppingRule};
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

pub fn check_comm_job(job: &CommJob) -> Result<(), BenchError> {
    let mut seen = job.gpus.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != job.gpus.len() || job.gpus.len() < 2 {
        return Err(BenchError::Invalid {
            field: "--gpus",
            message: "give at least two different GPU indices, e.g. --gpus 0,1,2,3".into(),
        });
    }
    if job.max_bytes < 1024 {
        return Err(BenchError::Invalid {
            field: "--max-bytes",
            message: "give 1KiB or more".into(),
        });
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub fn measure_comm(
    job: &CommJob,
    mut progress: impl FnMut(CollectiveOp, u64),
) -> Result<Vec<CollectivePoint>, BenchError> {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    check_comm_job(job)?;
    for &gpu in &job.gpus {
        super::cuda_presence(super::Device::Cuda(gpu))?;
    }
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(BenchError::Failed(
            "libnccl.so was not found: install NCCL (or link libnccl.so.2 as libnccl.so on the library path)".into(),
        ));
    }
    catch_unwind(AssertUnwindSafe(|| sweep(job, &mut progress)))
        .map_err(|_| BenchError::Failed("the NCCL sweep panicked in cudarc".into()))?
}

#[cfg(not(feature = "cuda"))]
pub fn measure_comm(
    job: &CommJob,
    _progress: impl FnMut(CollectiveOp, u64),
) -> Result<Vec<CollectivePoint>, BenchError> {
    check_comm_job(job)?;
    Err(BenchError::NotCompiledCuda {
        what: "`profile comm` (NCCL collectives)",
    })
}

#[cfg(feature = "cuda")]
fn sweep(
    job: &CommJob,
    progress: &mut impl FnMut(CollectiveOp, u64),
) -> Result<Vec<CollectivePoint>, BenchError> {
    use super::Sampler;
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use cudarc::nccl::{Comm, ReduceOp, result as nccl};
    use std::sync::Arc;
    use std::time::Instant;

    let failed = |e: &dyn std::fmt::Debug| BenchError::Failed(format!("NCCL: {e:?}"));
    let streams: Vec<Arc<CudaStream>> = job
        .gpus
        .iter()
        .map(|&i| CudaContext::new(i).map(|ctx| ctx.default_stream()))
        .collect::<Result<_, _>>()
        .map_err(|e| failed(&e))?;
    let comms = Comm::from_devices(streams.clone()).map_err(|e| failed(&e))?;
    let ranks = comms.len();
    let sync = || -> Result<(), BenchError> {
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
            let alloc = |len: usize| -> Result<Vec<CudaSlice<f32>>, BenchError> {
                streams
                    .iter()
                    .map(|s| s.alloc_zeros::<f32>(len).map_err(|e| failed(&e)))
                    .collect()
            };
            let send = alloc(send_len)?;
            let mut recv = alloc(recv_len)?;
            let mut once = || -> Result<(), BenchError> {
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
                once()?;
            }
            let mut sampler = Sampler::new(job.rule);
            while !sampler.done() {
                let start = Instant::now();
                once()?;
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
}
