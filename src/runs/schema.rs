//! Run-table cells written from paratune's own values: a configuration's
//! columns and a prediction's, so that a plan's or predict's CSV reads back
//! as a run table.

use crate::config::{ParallelConfig, on_off};
use crate::cost::Prediction;
use crate::model::ModelSpec;

/// The configuration's columns, named as run tables name them (so a plan's
/// CSV reads back as a run table).
pub const CONFIG_COLUMNS: [&str; 39] = [
    "tp",
    "pp",
    "dp",
    "micro_batch",
    "schedule",
    "virtual_stages",
    "recompute",
    "sequence_parallel",
    "optimizer_sharding",
    "bpipe",
    "attention",
    "first_stage_layers",
    "last_stage_layers",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_comm_overlap",
    "cuda_graphs",
    "stage_order",
    "engine",
    "compile",
    "ac_frequency",
    "dp_shard",
    "cp",
    "cp_comm",
    "ep",
    "etp",
    "moe_dispatcher",
    "embedding_sync",
    "cp_a2a",
    "precision",
    "fp8_recipe",
    "fp8_param_gather",
    "ep_comm_overlap",
    "grad_reduce",
    "cross_entropy_fusion",
    "wgrad_deferral",
    "cpu_offload_layers",
    "recompute_modules",
    "expandable_segments",
];

/// `c`'s cells for `model`; a dense model's `moe_dispatcher` is left empty,
/// since only an MoE layer runs a dispatcher (reading it back gives the
/// default).
pub fn config_cells(model: &ModelSpec, c: &ParallelConfig) -> Vec<String> {
    vec![
        c.tp.to_string(),
        c.pp.to_string(),
        c.dp.to_string(),
        c.micro_batch.to_string(),
        c.schedule.name().into(),
        c.virtual_stages.to_string(),
        c.recompute.name().into(),
        on_off(c.sequence_parallel).into(),
        c.optimizer_sharding.name().into(),
        on_off(c.bpipe).into(),
        c.attention.name().into(),
        c.first_stage_layers
            .map(|n| n.to_string())
            .unwrap_or_default(),
        c.last_stage_layers
            .map(|n| n.to_string())
            .unwrap_or_default(),
        on_off(c.overlap_grad_reduce).into(),
        on_off(c.overlap_param_gather).into(),
        on_off(c.tp_comm_overlap).into(),
        c.cuda_graphs.name().into(),
        c.stage_order.name().into(),
        c.engine.name().into(),
        on_off(c.compile).into(),
        c.ac_frequency.to_string(),
        c.dp_shard.map(|n| n.to_string()).unwrap_or_default(),
        c.cp.to_string(),
        c.cp_comm.name().into(),
        c.ep.to_string(),
        c.etp.to_string(),
        if model.moe.is_some() {
            c.dispatcher.name()
        } else {
            ""
        }
        .into(),
        c.embedding_sync.name().into(),
        c.cp_a2a.to_string(),
        c.precision.name().into(),
        c.fp8_recipe
            .filter(|_| c.precision == crate::config::Precision::Fp8)
            .map_or("", |r| r.name())
            .into(),
        on_off(c.fp8_param_gather).into(),
        on_off(c.ep_comm_overlap).into(),
        c.grad_reduce.name().into(),
        c.cross_entropy_fusion.name().into(),
        c.wgrad_deferral.name(),
        c.cpu_offload_layers.to_string(),
        c.recompute_modules.names().join(","),
        on_off(c.expandable_segments).into(),
    ]
}

/// Prediction columns shared by the plan and predict tables.
pub const PREDICTION_COLUMNS: [&str; 5] = [
    "iter_ms",
    "tokens_per_s",
    "tflops_per_gpu",
    "mfu",
    "peak_memory_gib",
];

pub fn prediction_cells(p: &Prediction) -> [String; 5] {
    [
        format!("{:.3}", p.iteration_s * 1e3),
        format!("{:.1}", p.tokens_per_s),
        format!("{:.2}", p.tflops_per_gpu),
        format!("{:.4}", p.mfu),
        format!("{:.2}", p.peak_memory_gib()),
    ]
}
