//! Local trial runs of a plan's candidates (`paratune validate --device`):
//! which stages to run, the trial job for each, the prediction to compare it
//! with, and what the measurements feed back (layer points for the cost
//! model's profile, so the candidates can be re-ranked). Pure: the CLI runs
//! the jobs in worker processes and writes the results.

use crate::coefficients::CostModel;
use crate::config::{
    CrossEntropyFusion, OptimizerSharding, ParallelConfig, Recompute, WgradDeferral,
};
use crate::cost::{self, Scenario};
use crate::measure::{Device, Dtype, StageJob, StageMeasurement};
use crate::plan_file::PlanFile;
use crate::profile::{LayerArch, LayerPoint, LayerStatus};
use crate::search::Job;

/// How the trials run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrialSettings {
    pub device: Device,
    pub dtype: Dtype,
    pub iterations: usize,
    /// Simulates a device with this much memory, bytes.
    pub memory_limit_bytes: Option<f64>,
}

/// The job a plan was made for.
pub fn job_of(plan: &PlanFile) -> Job {
    Job {
        model: plan.model.clone(),
        global_batch: plan.global_batch,
        gpus: plan.gpus,
        nodes: plan.nodes.clone(),
        memory_limit: plan.memory_limit_bytes,
        profile: None,
    }
}

/// The stages worth a trial: the first and the last, where memory peaks
/// and where the embedding and the output head sit; stages between run the
/// same layers with fewer micro-batches in flight.
pub fn trial_stages(c: &ParallelConfig) -> Vec<u64> {
    if c.pp == 1 {
        vec![0]
    } else {
        vec![0, c.pp - 1]
    }
}

/// What the cost model says about one stage, in the terms a trial measures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StagePrediction {
    /// Compute and host time per micro-batch: the stage's work without the
    /// collectives, sends and BPipe transfers one device cannot run.
    pub time_per_microbatch_s: f64,
    /// Weights, gradients, optimizer states and activations, bytes: what the
    /// trial allocates.
    pub trial_bytes: f64,
    /// Pipeline buffers and the runtime's own memory, bytes, which the trial
    /// does not allocate but the real run will.
    pub other_bytes: f64,
    /// Memory the stage may use (capacity less the reserve), bytes.
    pub usable_bytes: f64,
}

/// `c` as a stage trial runs it: the trial computes PyTorch's
/// cross-entropy on an fp32 copy of the logits and each micro-batch's
/// weight gradients at once, whatever kernel or deferral the real run
/// would use, so its prediction must price those.
pub fn as_trialled(c: &ParallelConfig) -> ParallelConfig {
    ParallelConfig {
        cross_entropy_fusion: CrossEntropyFusion::Off,
        wgrad_deferral: WgradDeferral::Off,
        ..*c
    }
}

pub fn stage_prediction(s: &Scenario, c: &ParallelConfig, stage: u64) -> StagePrediction {
    let c = &as_trialled(c);
    let time = cost::stage_times(s, c)[stage as usize];
    let memory = cost::stage_memory(s, c, stage);
    // ZeRO-3's gathered layers are allocated by the trial too.
    let gathered = cost::gathered_weight_bytes(s, c, stage);
    StagePrediction {
        time_per_microbatch_s: time.compute + time.host,
        trial_bytes: memory.weights
            + memory.gradients
            + memory.optimizer_states
            + memory.activations
            + memory.loss
            + gathered,
        other_bytes: memory.buffers - gathered
            + memory.allocator_reserve
            + memory.outside_allocator(),
        usable_bytes: s.usable_memory(),
    }
}

/// Why a stage of `c` cannot be trialled on one device, if it cannot: the
/// stage trial builds dense layers on one rank.
pub fn not_trialled(model: &crate::model::ModelSpec, c: &ParallelConfig) -> Option<&'static str> {
    if model.moe.is_some() {
        Some("its mixture-of-experts layers are not built by the local stage trial yet")
    } else if model.mtp_layers > 0 {
        Some("multi-token prediction modules are not built by the local stage trial")
    } else if c.cp > 1 {
        Some("context parallelism is not run by the local stage trial yet")
    } else if model.head_dim_override.is_some() || model.mla.is_some() {
        Some(
            "heads of other than hidden / heads width, and multi-latent attention, are not built by the local stage trial",
        )
    } else {
        None
    }
}

/// The trial job of stage `stage` of configuration `c`.
pub fn stage_job(
    s: &Scenario,
    c: &ParallelConfig,
    stage: u64,
    settings: &TrialSettings,
) -> StageJob {
    let m = c.micro_batches(s.global_batch);
    let partner = c.pp - 1 - stage;
    let schedule = cost::schedule_in_flight(c, m, stage).ceil() as u64;
    let held = cost::in_flight(c, m, stage).ceil() as u64;
    let (evicted, accepted) = if !c.bpipe || partner == stage {
        (0, 0)
    } else if stage < partner {
        (schedule.saturating_sub(held), 0)
    } else {
        (0, held.saturating_sub(schedule))
    };
    let layers = c.stage_layers(s.model.layers, stage);
    let shards = |sharded: bool| if sharded { c.shard_degree() } else { 1 };
    // The trial runs the configuration's attention kernel.
    let mut model = s.model.clone();
    model.attention = c.attention;
    StageJob {
        model,
        tp: c.tp,
        micro_batch: c.micro_batch,
        layers,
        first: stage == 0,
        last: stage == c.pp - 1,
        recompute: c.recompute,
        sequence_parallel: c.sequence_parallel,
        schedule_in_flight: schedule.max(1),
        evicted,
        accepted,
        // What the cost model keeps per micro-batch on this stage, which
        // its memory counts for each micro-batch the stage holds.
        accepted_bytes_per_microbatch: cost::stage_activation_bytes(s, c, stage),
        // Enough micro-batches to reach the steady state, at most the
        // iteration's.
        micro_batches: m.min(schedule.max(1) + 2).max(1),
        weight_shards: shards(c.optimizer_sharding == OptimizerSharding::Full),
        grad_shards: shards(c.optimizer_sharding == OptimizerSharding::Full),
        optimizer_shards: shards(c.optimizer_sharding != OptimizerSharding::None),
        dtype: settings.dtype,
        device: settings.device,
        iterations: settings.iterations,
        memory_limit_bytes: settings.memory_limit_bytes,
    }
}

/// A measured stage turned into the layer time it implies: the measured
/// time per micro-batch, less the predicted embedding/head share, spread
/// over the stage's layers, split into forward and backward in the
/// proportion of the model's FLOPs (one forward to two backward, plus a
/// recomputed forward under full recomputation). `None` when the trial
/// ran out of memory or left no time for the layers.
pub fn implied_layer_point(
    s: &Scenario,
    c: &ParallelConfig,
    stage: u64,
    dtype: Dtype,
    measured: &StageMeasurement,
) -> Option<LayerPoint> {
    if measured.out_of_memory || measured.time_per_microbatch_s <= 0.0 {
        return None;
    }
    let c = &as_trialled(c);
    let predicted = cost::stage_times(s, c)[stage as usize];
    let layers = c.stage_layers(s.model.layers, stage) as f64;
    // The predicted time of the layers alone: the stage's compute less its ends.
    let ends = cost::pipeline_ends(s, c);
    let end_time =
        if stage == 0 { ends.first } else { 0.0 } + if stage == c.pp - 1 { ends.last } else { 0.0 };
    let layer_share = if predicted.compute > 0.0 {
        ((predicted.compute - end_time) / predicted.compute).clamp(0.0, 1.0)
    } else {
        1.0
    };
    let per_layer = measured.time_per_microbatch_s * layer_share / layers;
    if per_layer <= 0.0 {
        return None;
    }
    let recomputed = c.recompute == Recompute::Full;
    let parts = if recomputed { 4.0 } else { 3.0 };
    let forward = per_layer / parts;
    Some(LayerPoint {
        hidden: s.model.hidden,
        heads: s.model.heads,
        arch: LayerArch::planned(s.model, c.attention),
        seq_len: s.model.seq_len,
        micro_batch: c.micro_batch,
        tp: c.tp,
        sequence_parallel: c.sequence_parallel,
        recompute: c.recompute,
        dtype: dtype.name().to_string(),
        forward_s: forward,
        backward_s: 2.0 * forward,
        recompute_s: recomputed.then_some(forward),
        ci95_rel: measured.ci95_rel,
        activation_bytes: None,
        peak_bytes: measured.peak_bytes,
        status: LayerStatus::Ok,
        includes_tp_comm: false,
    })
}

/// Whether trial times on `device` in `dtype` can stand for the plan's
/// GPU: the CPU only for a plan made for a GPU named `cpu` (a cluster file
/// with an inline GPU, whose figures describe the CPU as the trials run
/// it), a CUDA device when the driver names it as the plan's GPU (unknown
/// without the `cuda` feature: then not) and the trial runs in 16 bits, as
/// the plans do.
pub fn times_comparable(
    plan_gpu: &str,
    device: Device,
    device_gpu: Option<&str>,
    dtype: Dtype,
) -> bool {
    match device {
        Device::Cpu => crate::cluster::is_cpu(plan_gpu),
        Device::Cuda(_) => {
            dtype != Dtype::Fp32 && device_gpu.is_some_and(|g| g.eq_ignore_ascii_case(plan_gpu))
        }
    }
}

/// The cost model's uncertainty band for one prediction, relative: the
/// cross-validated 90th-percentile error where the model has one, else
/// ±25% (an uncalibrated model's typical error on the reference data).
pub fn band(cost: &CostModel) -> (f64, f64) {
    let p90 = cost.uncertainty().map_or(0.25, |u| u.p90);
    (-p90, p90)
}

/// Coefficients a refit from local trials may move, most influential on a
/// stage's GPU time first; a refit frees as many of them as it has
/// distinct trials. Host time is left alone: a trial's host work is
/// libtorch launched from Rust, not the training framework's Python.
pub const TRIAL_REFIT_ORDER: [&str; 2] = ["gemm_efficiency", "hbm_efficiency"];

/// A measured stage a refit learns from: its time per micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageObservation {
    pub config: ParallelConfig,
    pub stage: u64,
    pub measured_s: f64,
}

/// What a refit from trials found.
#[derive(Debug, Clone)]
pub struct TrialRefit {
    pub cost: CostModel,
    /// Name, value before and after, of each coefficient the fit moved.
    pub moved: Vec<(&'static str, f64, f64)>,
    /// Mean absolute relative error of the stage-time predictions of the
    /// observations, before and after.
    pub mape_before: f64,
    pub mape_after: f64,
}

/// The cost model `prior` refitted so that its stage-time predictions
/// (compute and host per micro-batch, what a trial measures; see
/// [`stage_prediction`]) match `observations`: `calibrate`'s robust loss on
/// log errors with its weak pull toward the prior, minimised with argmin's
/// Nelder-Mead over the first [`TRIAL_REFIT_ORDER`] coefficients, as many
/// as there are distinct observations. The predictions use the
/// coefficients alone (the job's profile is set aside), so the refit
/// carries what the trials taught to configurations nobody trialled.
/// `None` without usable observations.
pub fn refit_to_trials(
    job: &Job,
    prior: &CostModel,
    observations: &[StageObservation],
) -> Option<TrialRefit> {
    use crate::calibrate::{FreeParam, Leg, minimise_loss, model_at, prior_pull, soft_l1};
    use crate::coefficients::Coefficients;
    let observations: Vec<&StageObservation> = observations
        .iter()
        .filter(|o| o.measured_s.is_finite() && o.measured_s > 0.0)
        .collect();
    let mut distinct: Vec<(ParallelConfig, u64)> = Vec::new();
    for o in &observations {
        if !distinct.contains(&(o.config, o.stage)) {
            distinct.push((o.config, o.stage));
        }
    }
    if distinct.is_empty() {
        return None;
    }
    let free: Vec<FreeParam> = TRIAL_REFIT_ORDER[..distinct.len().min(TRIAL_REFIT_ORDER.len())]
        .iter()
        .map(|name| FreeParam {
            info: Coefficients::info(name).expect("TRIAL_REFIT_ORDER names coefficients"),
        })
        .collect();
    let coefficients_only = Job {
        profile: None,
        ..job.clone()
    };
    let log_errors = |cost: &CostModel| -> Vec<f64> {
        let s = coefficients_only.scenario(cost);
        observations
            .iter()
            .map(|o| {
                let predicted = stage_prediction(&s, &o.config, o.stage).time_per_microbatch_s;
                let r = (predicted / o.measured_s).ln();
                if r.is_finite() { r } else { 10.0 }
            })
            .collect()
    };
    let value = |cost: &CostModel, p: &FreeParam| {
        cost.coefficients.get(p.info.name).unwrap_or(p.info.prior)
    };
    let z0: Vec<f64> = free.iter().map(|p| p.z(value(prior, p))).collect();
    let n = observations.len() as f64;
    let loss = |z: &[f64]| -> f64 {
        if z.iter().any(|z| !z.is_finite()) {
            return f64::MAX;
        }
        let data: f64 = log_errors(&model_at(prior, &free, z))
            .iter()
            .map(|&r| soft_l1(r))
            .sum::<f64>()
            / n;
        data + prior_pull(z, &z0)
    };
    let legs = [
        Leg {
            step: 1.0,
            iters: 300,
        },
        Leg {
            step: 0.2,
            iters: 300,
        },
    ];
    let (best, _) = minimise_loss(&loss, &z0, &legs);
    let mut cost = model_at(prior, &free, &best);
    // The prior's fit figures do not describe the refit, and what it moved
    // is no longer a filled-in prior.
    for key in ["cv_mape", "cv_p90_ape", "fitted_on"] {
        cost.provenance.remove(key);
    }
    crate::coefficients::mark_informed(&mut cost.provenance, free.iter().map(|p| p.info.name));
    cost.provenance.insert(
        "refitted_to_trials".into(),
        toml::Value::Integer(observations.len() as i64),
    );
    cost.name = format!("{}-trials", prior.name);
    cost.description = format!(
        "{} refitted to {} local trial stage time(s) by paratune validate",
        prior.name,
        observations.len()
    );
    let mape = |cost: &CostModel| {
        log_errors(cost)
            .iter()
            .map(|r| (r.exp() - 1.0).abs())
            .sum::<f64>()
            / n
    };
    Some(TrialRefit {
        moved: free
            .iter()
            .map(|p| (p.info.name, value(prior, p), value(&cost, p)))
            .collect(),
        mape_before: mape(prior),
        mape_after: mape(&cost),
        cost,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::builtin_node;
    use crate::config::ScheduleKind;
    use crate::model::{AttentionKind, builtin_model};

    fn config(sharding: OptimizerSharding, sequence_parallel: bool) -> ParallelConfig {
        ParallelConfig {
            tp: 2,
            pp: 2,
            dp: 2,
            micro_batch: 1,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            recompute: Recompute::None,
            sequence_parallel,
            optimizer_sharding: sharding,
            bpipe: false,
            attention: AttentionKind::Flash,
            ..ParallelConfig::default()
        }
    }

    /// One bf16 iteration on the CPU, no memory limit.
    fn one_cpu_iteration() -> TrialSettings {
        TrialSettings {
            device: Device::Cpu,
            dtype: Dtype::Bf16,
            iterations: 1,
            memory_limit_bytes: None,
        }
    }

    #[test]
    fn trials_are_compared_with_what_they_allocate() {
        let model = builtin_model("gpt3-13b").unwrap();
        let group = builtin_node("a100-80gb", 1).unwrap();
        let cost = CostModel::datasheet();
        let s = Scenario::new(&model, 64, &group, 8, &cost);
        let settings = one_cpu_iteration();
        for (sharding, sp) in [
            (OptimizerSharding::None, false),
            (OptimizerSharding::Full, true),
        ] {
            let c = config(sharding, sp);
            let memory = cost::stage_memory(&s, &c, 0);
            let predicted = stage_prediction(&s, &c, 0);
            // Everything is either allocated by the trial or named as not.
            let sum = predicted.trial_bytes + predicted.other_bytes;
            assert!(
                (sum - memory.total()).abs() < 1.0,
                "{sum} vs {}",
                memory.total()
            );
            let gathered = cost::gathered_weight_bytes(&s, &c, 0);
            assert_eq!(gathered > 0.0, sharding == OptimizerSharding::Full);
            let job = stage_job(&s, &c, 0, &settings);
            let dp_if = |on: bool| if on { 2 } else { 1 };
            let full = sharding == OptimizerSharding::Full;
            assert_eq!(job.weight_shards, dp_if(full));
            assert_eq!(job.grad_shards, dp_if(full));
            assert_eq!(job.sequence_parallel, sp);
        }
    }

    /// A trial runs the unfused loss with no deferred weight gradients, and
    /// is predicted as it runs.
    #[test]
    fn trials_are_predicted_with_the_loss_they_run() {
        let model = builtin_model("gpt3-13b").unwrap();
        let group = builtin_node("a100-80gb", 1).unwrap();
        let cost = CostModel::datasheet();
        let s = Scenario::new(&model, 64, &group, 8, &cost);
        let plain = config(OptimizerSharding::None, false);
        let megatron = ParallelConfig {
            cross_entropy_fusion: CrossEntropyFusion::Te,
            wgrad_deferral: WgradDeferral::All,
            ..plain
        };
        assert!(
            cost::stage_memory(&s, &megatron, 1).loss != cost::stage_memory(&s, &plain, 1).loss
        );
        assert_eq!(
            stage_prediction(&s, &megatron, 1),
            stage_prediction(&s, &plain, 1)
        );
    }

    /// A BPipe acceptor's trial holds, per accepted micro-batch, the
    /// activations the cost model keeps on that stage.
    #[test]
    fn a_bpipe_acceptor_holds_the_cost_models_stage_activations() {
        let model = builtin_model("gpt3-13b").unwrap();
        let group = builtin_node("a100-80gb", 1).unwrap();
        let cost = CostModel::datasheet();
        let s = Scenario::new(&model, 64, &group, 8, &cost);
        let settings = one_cpu_iteration();
        let c = ParallelConfig {
            pp: 4,
            dp: 1,
            bpipe: true,
            first_stage_layers: Some(8),
            last_stage_layers: Some(12),
            ..config(OptimizerSharding::None, true)
        };
        c.check(&model, 64, 8, 8).unwrap();
        let job = stage_job(&s, &c, 3, &settings);
        assert!(job.accepted > 0, "{job:?}");
        assert_eq!(
            job.accepted_bytes_per_microbatch,
            cost::stage_activation_bytes(&s, &c, 3)
        );
        assert_eq!(job.layers, 12);
    }

    #[test]
    fn a_refit_recovers_the_efficiency_the_trials_ran_at() {
        let model = builtin_model("gpt3-13b").unwrap();
        let group = builtin_node("a100-80gb", 1).unwrap();
        let job = Job {
            model,
            global_batch: 64,
            gpus: 8,
            nodes: group,
            memory_limit: None,
            profile: None,
        };
        // "Measured" stages from a model whose GEMMs run at 0.5 of peak; the
        // prior held two coefficients only as filled-in priors.
        let mut prior = CostModel::datasheet();
        let filled = |names: &[&str]| toml::Value::Array(names.iter().map(|&n| n.into()).collect());
        prior.provenance.insert(
            crate::coefficients::FILLED_WITH_PRIORS.into(),
            filled(&["gemm_efficiency", "kernel_gap_us"]),
        );
        let mut truth = prior.clone();
        truth.coefficients.set("gemm_efficiency", 0.5);
        let configs = [
            config(OptimizerSharding::None, false),
            config(OptimizerSharding::OptimizerStates, true),
        ];
        let s = job.scenario(&truth);
        let observations: Vec<StageObservation> = configs
            .iter()
            .flat_map(|c| trial_stages(c).into_iter().map(move |stage| (c, stage)))
            .map(|(c, stage)| StageObservation {
                config: *c,
                stage,
                measured_s: stage_prediction(&s, c, stage).time_per_microbatch_s,
            })
            .collect();
        let refit = refit_to_trials(&job, &prior, &observations).unwrap();
        assert!(refit.mape_before > 0.2, "{refit:?}");
        assert!(refit.mape_after < 0.02, "{refit:?}");
        let (name, before, after) = refit.moved[0];
        assert_eq!((name, before), ("gemm_efficiency", 0.8));
        assert!((after - 0.5).abs() < 0.03, "{refit:?}");
        // Enough distinct stages free every refit coefficient.
        assert_eq!(refit.moved.len(), TRIAL_REFIT_ORDER.len());
        // The refit does not claim calibrate's cross-validated error, nor
        // that what it moved is still a filled-in prior.
        assert!(refit.cost.uncertainty().is_none());
        assert_eq!(
            refit.cost.provenance[crate::coefficients::FILLED_WITH_PRIORS],
            filled(&["kernel_gap_us"])
        );
        assert!(refit_to_trials(&job, &prior, &[]).is_none());
    }

    #[test]
    fn times_stand_for_the_plans_gpu_only_on_it_and_in_16_bits() {
        let h100 = Some("h100-sxm");
        let cuda = |plan: &str, gpu, dtype| times_comparable(plan, Device::Cuda(0), gpu, dtype);
        assert!(cuda("h100-sxm", h100, Dtype::Bf16));
        assert!(!cuda("h100-sxm", h100, Dtype::Fp32));
        assert!(!cuda("a100-80gb", h100, Dtype::Bf16));
        assert!(!cuda("h100-sxm", None, Dtype::Bf16));
        // The CPU "cluster" describes the CPU as the trials run it.
        assert!(times_comparable("cpu", Device::Cpu, None, Dtype::Fp32));
        assert!(!times_comparable(
            "h100-sxm",
            Device::Cpu,
            None,
            Dtype::Bf16
        ));
    }
}
