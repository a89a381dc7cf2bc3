//! A layer sweep (`paratune profile layer`): the points to measure, which of
//! them a profile already holds (so an interrupted sweep resumes where it
//! stopped), and the profile rows one measurement becomes.

use super::{Dtype, LayerMeasurement, MEASURED_RECOMPUTE};
use super::{LayerArch, LayerPoint, LayerStatus, Profile};
use crate::config::Recompute;
use crate::model::ModelSpec;

/// One point of a sweep: a micro-batch on a tensor-parallel shard, with or
/// without sequence parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepPoint {
    pub micro_batch: u64,
    pub tp: u64,
    pub sequence_parallel: bool,
}

/// Every (tp, sequence parallelism, micro-batch), tensor parallelism
/// outermost, in the order given; sequence parallelism only where tp > 1
/// (one rank has nothing to split the sequence with).
pub fn sweep_points(
    micro_batches: &[u64],
    tps: &[u64],
    sequence_parallel: &[bool],
) -> Vec<SweepPoint> {
    let mut points = Vec::new();
    for &tp in tps {
        for &sp in sequence_parallel {
            if sp && tp == 1 {
                continue;
            }
            points.extend(micro_batches.iter().map(|&micro_batch| SweepPoint {
                micro_batch,
                tp,
                sequence_parallel: sp,
            }));
        }
    }
    points
}

/// Whether `profile` already holds a measurement of this point (measured or
/// out of memory) for this model and precision, from `profile layer`.
pub fn is_measured(profile: &Profile, model: &ModelSpec, dtype: Dtype, point: SweepPoint) -> bool {
    profile.layers.iter().any(|p| {
        !p.includes_tp_comm
            && p.hidden == model.hidden
            && p.heads == model.heads
            && p.arch == LayerArch::of(model)
            && p.seq_len == model.seq_len
            && p.tp == point.tp
            && p.micro_batch == point.micro_batch
            && p.sequence_parallel == point.sequence_parallel
            && p.recompute == Recompute::None
            && p.dtype == dtype.name()
    })
}

/// The profile rows of one measurement: one without recomputation (forward
/// with autograd, backward) and one with full recomputation (forward without
/// autograd, the recomputed forward, backward).
pub fn layer_points(
    model: &ModelSpec,
    dtype: Dtype,
    point: SweepPoint,
    m: &LayerMeasurement,
) -> Vec<LayerPoint> {
    MEASURED_RECOMPUTE
        .into_iter()
        .map(|recompute| {
            let full = recompute == Recompute::Full;
            let time = |t: f64| if m.out_of_memory { f64::NAN } else { t };
            LayerPoint {
                hidden: model.hidden,
                heads: model.heads,
                arch: LayerArch::of(model),
                seq_len: model.seq_len,
                micro_batch: point.micro_batch,
                tp: point.tp,
                sequence_parallel: point.sequence_parallel,
                recompute,
                dtype: dtype.name().to_string(),
                forward_s: time(if full {
                    m.forward_no_grad_s
                } else {
                    m.forward_s
                }),
                backward_s: time(m.backward_s),
                recompute_s: (full && !m.out_of_memory).then_some(m.forward_s),
                ci95_rel: m.ci95_rel,
                // Under full recomputation only the layer's input is kept
                // (this rank's chunk of it under sequence parallelism).
                activation_bytes: if full {
                    let tokens = point.micro_batch * model.seq_len
                        / if point.sequence_parallel { point.tp } else { 1 };
                    Some((tokens * model.hidden * dtype.bytes()) as f64)
                        .filter(|_| m.activation_bytes.is_some())
                } else {
                    m.activation_bytes
                },
                peak_bytes: m.peak_bytes,
                status: if m.out_of_memory {
                    LayerStatus::Oom
                } else {
                    LayerStatus::Ok
                },
                includes_tp_comm: false,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn measurement() -> LayerMeasurement {
        LayerMeasurement {
            forward_s: 0.010,
            forward_no_grad_s: 0.009,
            backward_s: 0.020,
            ci95_rel: Some(0.01),
            repetitions: 7,
            activation_bytes: Some(1e6),
            peak_bytes: Some(2e6),
            out_of_memory: false,
            runtime: "test".into(),
        }
    }

    #[test]
    fn a_measurement_gives_a_row_per_recomputation_policy() {
        let model = ModelSpec::gpt("t", 128, 4, 2, 1000, 64);
        let point = SweepPoint {
            micro_batch: 2,
            tp: 1,
            sequence_parallel: false,
        };
        let rows = layer_points(&model, Dtype::Fp32, point, &measurement());
        assert_eq!(rows.len(), 2);
        let (none, full) = (&rows[0], &rows[1]);
        assert_eq!(none.recompute, Recompute::None);
        assert_eq!(none.total_s(), 0.030);
        assert_eq!(full.recompute, Recompute::Full);
        assert!((full.total_s() - 0.039).abs() < 1e-12);
        assert_eq!(full.activation_bytes, Some((2 * 64 * 128 * 4) as f64));

        let mut profile = Profile::empty("cpu");
        assert!(!is_measured(&profile, &model, Dtype::Fp32, point));
        profile.layers = rows;
        assert!(is_measured(&profile, &model, Dtype::Fp32, point));
        assert!(!is_measured(&profile, &model, Dtype::Bf16, point));
        let other = SweepPoint {
            micro_batch: 4,
            tp: 1,
            sequence_parallel: false,
        };
        assert!(!is_measured(&profile, &model, Dtype::Fp32, other));
        // The same width with a gated MLP is another layer to measure.
        let gated = ModelSpec {
            gated_mlp: true,
            ..model.clone()
        };
        assert!(!is_measured(&profile, &gated, Dtype::Fp32, point));
        assert_eq!(profile.layers[0].arch, LayerArch::of(&model));
    }

    #[test]
    fn points_run_tp_outermost() {
        let points = sweep_points(&[1, 2], &[1, 2], &[false]);
        let pairs: Vec<_> = points.iter().map(|p| (p.tp, p.micro_batch)).collect();
        assert_eq!(pairs, [(1, 1), (1, 2), (2, 1), (2, 2)]);
        // Sequence parallelism only where tp > 1.
        let points = sweep_points(&[1], &[1, 2], &[false, true]);
        let triples: Vec<_> = points
            .iter()
            .map(|p| (p.tp, p.sequence_parallel, p.micro_batch))
            .collect();
        assert_eq!(triples, [(1, false, 1), (2, false, 1), (2, true, 1)]);
    }

    #[test]
    fn sequence_parallel_rows_are_their_own_points() {
        let model = ModelSpec::gpt("t", 128, 4, 2, 1000, 64);
        let point = SweepPoint {
            micro_batch: 2,
            tp: 2,
            sequence_parallel: true,
        };
        let rows = layer_points(&model, Dtype::Bf16, point, &measurement());
        assert!(rows.iter().all(|r| r.sequence_parallel));
        // Under full recomputation the rank keeps half the sequence's input.
        assert_eq!(rows[1].activation_bytes, Some((2 * 32 * 128 * 2) as f64));
        let mut profile = Profile::empty("cpu");
        profile.layers = rows;
        assert!(is_measured(&profile, &model, Dtype::Bf16, point));
        let plain = SweepPoint {
            sequence_parallel: false,
            ..point
        };
        assert!(!is_measured(&profile, &model, Dtype::Bf16, plain));
    }
}
