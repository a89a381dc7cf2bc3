//! A configuration written as `key=value,...` (`plan --explain`): the keys
//! given change a base configuration (the search's winner), and the
//! switches the given keys rule out follow them.

use super::{
    CpComm, CrossEntropyFusion, CudaGraphs, Dispatcher, Fp8Recipe, GradReduce, OptimizerSharding,
    ParallelConfig, Precision, Recompute, RecomputeModules, ScheduleKind, StageOrder, SyncMethod,
    WgradDeferral,
};
use crate::choice::{Choice, parse_switch};
use crate::model::AttentionKind;
use crate::suggest::did_you_mean;

/// The keys a specification may set; several have a short and a long name.
pub const SPEC_KEYS: [&str; 53] = [
    "tp",
    "pp",
    "dp",
    "mb",
    "micro_batch",
    "schedule",
    "v",
    "virtual_stages",
    "recompute",
    "sp",
    "sequence_parallel",
    "sharding",
    "optimizer_sharding",
    "bpipe",
    "attention",
    "first",
    "first_stage_layers",
    "last",
    "last_stage_layers",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_comm_overlap",
    "ep_comm_overlap",
    "fp8_param_gather",
    "expandable_segments",
    "fp8_recipe",
    "grad_reduce",
    "cross_entropy_fusion",
    "wgrad_deferral",
    "cpu_offload_layers",
    "offload",
    "modules",
    "recompute_modules",
    "cp_a2a",
    "cp-a2a",
    "cuda_graphs",
    "graphs",
    "order",
    "stage_order",
    "compile",
    "every",
    "ac_frequency",
    "dp_shard",
    "cp",
    "cp_comm",
    "ep",
    "etp",
    "dispatch",
    "moe_dispatcher",
    "precision",
    "embedding_sync",
    "cp-comm",
    "embedding-sync",
];

/// A specification that does not read, said without the flag it came in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpecError(String);

fn choice<T: Choice>(key: &str, value: &str) -> Result<T, SpecError> {
    T::parse(key, value).map_err(SpecError)
}

fn switch(key: &str, value: &str) -> Result<bool, SpecError> {
    parse_switch(key, value).map_err(SpecError)
}

/// The data-parallel degree that keeps `base`'s GPU count under `changed`'s
/// tp, pp and cp, or why none does.
fn keep_gpu_count(base: &ParallelConfig, changed: &ParallelConfig) -> Result<u64, SpecError> {
    let gpus = base.tp * base.pp * base.cp * base.dp;
    let model_parallel = changed.tp * changed.pp * changed.cp;
    if model_parallel == 0 {
        return Ok(base.dp); // the rules name the degree that is 0
    }
    if !gpus.is_multiple_of(model_parallel) {
        return Err(SpecError(format!(
            "tp {} x pp {} x cp {} = {model_parallel} does not divide the {gpus} GPUs, so no dp keeps them all busy; pick tp, pp and cp whose product divides {gpus}",
            changed.tp, changed.pp, changed.cp
        )));
    }
    Ok(gpus / model_parallel)
}

impl ParallelConfig {
    /// This configuration with the keys of `spec` (`tp=8,pp=4,mb=1`)
    /// changed. A new tp, pp or cp without a dp keeps the GPU count.
    /// Switches kept from `self` that the given keys rule out follow them,
    /// unless given too: sp=off drops the tp overlap, another sharding the
    /// param-gather overlap, full recomputation the CUDA graphs, bpipe=off
    /// its stage order, a new pp the uneven split, what Megatron-Core's
    /// batch-level EP overlap cannot run with (an allgather dispatcher,
    /// say) that overlap, bf16 or no sharding the FP8 weights.
    pub fn with_spec(&self, spec: &str) -> Result<ParallelConfig, SpecError> {
        let mut c = *self;
        let mut given: Vec<&str> = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| {
                SpecError(format!("`{item}` is not key=value (e.g. tp=8,pp=4,mb=1)"))
            })?;
            let (key, value) = (key.trim(), value.trim());
            set(&mut c, key, value)?;
            given.push(key);
        }
        let given = |keys: &[&str]| given.iter().any(|k| keys.contains(k));
        if given(&["tp", "pp", "cp"]) && !given(&["dp"]) {
            c.dp = keep_gpu_count(self, &c)?;
        }
        // One pipeline stage, or one chunk per stage, leaves nothing to
        // interleave: the schedule follows unless given.
        if c.schedule == ScheduleKind::Interleaved
            && if given(&["v", "virtual_stages"]) {
                c.virtual_stages == 1
            } else {
                c.pp == 1
            }
            && !given(&["schedule"])
        {
            c.schedule = ScheduleKind::OneFOneB;
            c.virtual_stages = 1;
        }
        if !c.sequence_parallel && !given(&["tp_comm_overlap"]) {
            c.tp_comm_overlap = false;
        }
        if (c.optimizer_sharding != OptimizerSharding::OptimizerStates || !c.overlap_grad_reduce)
            && !given(&["overlap_param_gather"])
        {
            c.overlap_param_gather = false;
        }
        if c.dp == 1 && !given(&["overlap_grad_reduce"]) {
            c.overlap_grad_reduce = false;
            c.overlap_param_gather = false;
        }
        if c.recompute == Recompute::Full
            && c.cuda_graphs == CudaGraphs::Layers
            && !given(&["graphs", "cuda_graphs"])
        {
            c.cuda_graphs = CudaGraphs::Off;
        }
        if super::ep_overlap_config_problem(&c).is_some() && !given(&["ep_comm_overlap"]) {
            c.ep_comm_overlap = false;
        }
        // Another precision takes its own switches, as the search sets
        // them: FP8 weights where they can be kept, an FP8 recipe only under
        // FP8, no TP comm overlap under NVFP4.
        if c.precision != self.precision && !given(&["fp8_param_gather"]) {
            c.fp8_param_gather = super::fp8_param_gather_problem(&c).is_none();
        }
        if super::fp8_param_gather_problem(&c).is_some() && !given(&["fp8_param_gather"]) {
            c.fp8_param_gather = false;
        }
        if c.precision != Precision::Fp8 {
            if given(&["fp8_recipe"]) {
                return Err(SpecError(format!(
                    "fp8_recipe needs precision=fp8, and this configuration runs {}; add precision=fp8 or leave fp8_recipe out",
                    c.precision.name()
                )));
            }
            c.fp8_recipe = None;
        }
        if c.precision == Precision::Nvfp4 && !given(&["tp_comm_overlap"]) {
            c.tp_comm_overlap = false;
        }
        if !c.bpipe && !given(&["order", "stage_order"]) {
            c.stage_order = StageOrder::Megatron;
        }
        if c.pp != self.pp || c.virtual_stages != self.virtual_stages {
            if !given(&["first", "first_stage_layers"]) {
                c.first_stage_layers = None;
            }
            if !given(&["last", "last_stage_layers"]) {
                c.last_stage_layers = None;
            }
        }
        Ok(c)
    }
}

/// Sets one key of a specification.
fn set(c: &mut ParallelConfig, key: &str, value: &str) -> Result<(), SpecError> {
    let number = || -> Result<u64, SpecError> {
        let n: u64 = value
            .parse()
            .map_err(|_| SpecError(format!("{key} must be a whole number, found `{value}`")))?;
        let max = if matches!(key, "pp" | "v" | "virtual_stages") {
            1 << 16
        } else {
            1 << 20
        };
        if n > max {
            return Err(SpecError(format!(
                "{key}={n} is more than paratune plans for (at most {max})"
            )));
        }
        Ok(n)
    };
    match key {
        "tp" => c.tp = number()?,
        "pp" => c.pp = number()?,
        "dp" => c.dp = number()?,
        "cp" => c.cp = number()?,
        "ep" => c.ep = number()?,
        "etp" => c.etp = number()?,
        "mb" | "micro_batch" => c.micro_batch = number()?,
        "v" | "virtual_stages" => c.virtual_stages = number()?,
        "schedule" => {
            c.schedule = choice::<ScheduleKind>(key, value)?;
            if c.schedule != ScheduleKind::Interleaved {
                c.virtual_stages = 1;
            }
        }
        "recompute" => {
            c.recompute = choice::<Recompute>(key, value)?;
            if c.recompute != Recompute::Selective {
                c.recompute_modules = RecomputeModules::default();
            }
        }
        "modules" | "recompute_modules" => {
            c.recompute_modules = RecomputeModules::parse(key, value).map_err(SpecError)?
        }
        "sp" | "sequence_parallel" => c.sequence_parallel = switch(key, value)?,
        "sharding" | "optimizer_sharding" => {
            c.optimizer_sharding = choice::<OptimizerSharding>(key, value)?
        }
        "bpipe" => c.bpipe = switch(key, value)?,
        "attention" => c.attention = choice::<AttentionKind>(key, value)?,
        "first" | "first_stage_layers" => {
            c.first_stage_layers = (value != "even").then(&number).transpose()?
        }
        "last" | "last_stage_layers" => {
            c.last_stage_layers = (value != "even").then(&number).transpose()?
        }
        "overlap_grad_reduce" => c.overlap_grad_reduce = switch(key, value)?,
        "overlap_param_gather" => c.overlap_param_gather = switch(key, value)?,
        "tp_comm_overlap" => c.tp_comm_overlap = switch(key, value)?,
        "ep_comm_overlap" => c.ep_comm_overlap = switch(key, value)?,
        "fp8_param_gather" => c.fp8_param_gather = switch(key, value)?,
        "expandable_segments" => c.expandable_segments = switch(key, value)?,
        "cp_a2a" | "cp-a2a" => c.cp_a2a = number()?,
        "graphs" | "cuda_graphs" => {
            c.cuda_graphs = CudaGraphs::parse(key, value).map_err(SpecError)?
        }
        "compile" => c.compile = switch(key, value)?,
        "every" | "ac_frequency" => c.ac_frequency = number()?,
        "dp_shard" => c.dp_shard = Some(number()?),
        "order" | "stage_order" => c.stage_order = choice::<StageOrder>(key, value)?,
        "cp_comm" | "cp-comm" => c.cp_comm = choice::<CpComm>(key, value)?,
        "dispatch" | "moe_dispatcher" => c.dispatcher = choice::<Dispatcher>(key, value)?,
        "precision" => c.precision = choice::<Precision>(key, value)?,
        "fp8_recipe" => c.fp8_recipe = Some(choice::<Fp8Recipe>(key, value)?),
        "grad_reduce" => c.grad_reduce = choice::<GradReduce>(key, value)?,
        "cross_entropy_fusion" => {
            c.cross_entropy_fusion = choice::<CrossEntropyFusion>(key, value)?
        }
        "wgrad_deferral" => {
            c.wgrad_deferral = WgradDeferral::parse(key, value).map_err(SpecError)?
        }
        "cpu_offload_layers" | "offload" => c.cpu_offload_layers = number()?,
        "embedding_sync" | "embedding-sync" => c.embedding_sync = choice::<SyncMethod>(key, value)?,
        _ => {
            return Err(SpecError(format!(
                "unknown key `{key}`{}",
                did_you_mean(key, &SPEC_KEYS)
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> ParallelConfig {
        ParallelConfig {
            tp: 2,
            pp: 2,
            dp: 4,
            ..ParallelConfig::default()
        }
    }

    #[test]
    fn a_new_degree_keeps_the_gpu_count() {
        let c = base().with_spec("tp=4").unwrap();
        assert_eq!((c.tp, c.pp, c.dp), (4, 2, 2));
        let c = base().with_spec("cp=2").unwrap();
        assert_eq!((c.cp, c.dp), (2, 2));
        let c = base().with_spec("tp=4,dp=1").unwrap();
        assert_eq!(c.dp, 1);
    }

    #[test]
    fn nothing_left_to_interleave_takes_one_f_one_b() {
        let interleaved = ParallelConfig {
            schedule: ScheduleKind::Interleaved,
            virtual_stages: 4,
            ..base()
        };
        for spec in ["pp=1", "v=1"] {
            let c = interleaved.with_spec(spec).unwrap();
            assert_eq!(
                (c.schedule, c.virtual_stages),
                (ScheduleKind::OneFOneB, 1),
                "{spec}"
            );
        }
        // A schedule or chunk count given is kept, for the rules to judge.
        let c = interleaved.with_spec("pp=1,v=4").unwrap();
        assert_eq!(
            (c.schedule, c.virtual_stages),
            (ScheduleKind::Interleaved, 4)
        );
        let c = interleaved.with_spec("pp=1,schedule=interleaved").unwrap();
        assert_eq!(c.schedule, ScheduleKind::Interleaved);
    }

    #[test]
    fn another_precision_takes_its_own_switches() {
        let fp8 = ParallelConfig {
            precision: Precision::Fp8,
            fp8_recipe: Some(Fp8Recipe::Mxfp8),
            fp8_param_gather: true,
            optimizer_sharding: OptimizerSharding::OptimizerStates,
            sequence_parallel: true,
            tp_comm_overlap: true,
            ..base()
        };
        let c = fp8.with_spec("precision=nvfp4").unwrap();
        assert_eq!(c.fp8_recipe, None);
        // NVFP4 weights where the optimizer is sharded; no TP overlap.
        assert!(c.fp8_param_gather && !c.tp_comm_overlap, "{c}");
        let unsharded = fp8
            .with_spec("precision=nvfp4,sharding=none")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!unsharded.fp8_param_gather);
        let e = fp8
            .with_spec("precision=nvfp4,fp8_recipe=mxfp8")
            .unwrap_err()
            .to_string();
        assert!(e.contains("fp8_recipe needs precision=fp8"), "{e}");
        // bf16 keeps no quantized weights.
        let bf16 = c.with_spec("precision=bf16").unwrap();
        assert!(!bf16.fp8_param_gather);
    }

    #[test]
    fn a_degree_that_cannot_keep_the_gpu_count_is_named() {
        let e = base().with_spec("tp=3").unwrap_err().to_string();
        assert!(
            e.contains("tp 3 x pp 2 x cp 1 = 6 does not divide the 16 GPUs"),
            "{e}"
        );
        assert!(e.contains("divides 16"), "{e}");
    }

    #[test]
    fn the_new_dimensions_read() {
        let c = base()
            .with_spec("ep=4,etp=2,dispatch=allgather,precision=fp8,cp_comm=a2a,embedding_sync=parameter-server")
            .unwrap();
        assert_eq!((c.ep, c.etp), (4, 2));
        assert_eq!(c.dispatcher, Dispatcher::AllGather);
        assert_eq!(c.precision, Precision::Fp8);
        assert_eq!(c.cp_comm, CpComm::A2a);
        assert_eq!(c.embedding_sync, SyncMethod::ParameterServer);
    }

    #[test]
    fn bad_items_say_what_is_wrong() {
        let e = |spec: &str| base().with_spec(spec).unwrap_err().to_string();
        assert!(e("tp").contains("is not key=value"), "{}", e("tp"));
        assert!(e("tp=x").contains("tp must be a whole number"));
        assert!(e("pp=100000").contains("at most 65536"));
        assert!(e("tpp=2").contains("unknown key `tpp`"));
        assert!(e("precision=fp4").contains("precision"));
    }
}
