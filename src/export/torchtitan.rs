//! torchtitan: the job-config TOML of the 0.2 releases and the command line
//! of 0.3.
//!
//! Two releases, two forms (checked against the PyPI wheels):
//! - torchtitan 0.2.2, the last with TOML job configs (`JobConfig` in
//!   `torchtitan/config/job_config.py`, read with `--job.config_file`);
//!   [`torchtitan_toml`] writes its `[model]`, `[training]`, `[parallelism]`,
//!   `[compile]` and `[activation_checkpoint]` keys.
//! - torchtitan 0.3.0 (PR pytorch/torchtitan#2386 moved configuration into
//!   Python config functions): `-m torchtitan.train --module M --config F`
//!   and tyro flags `--section.field value` (booleans as `--x` / `--section.no-x`),
//!   activation checkpointing as the last word
//!   (`activation-checkpoint:none|full|selective`); [`torchtitan_flags`]
//!   writes them. In 0.3.0 the model comes from the config function, async
//!   tensor parallelism moved to `compile.enable_async_tensor_parallel`,
//!   sequence parallelism has its own switch
//!   (`parallelism.enable_sequence_parallel`), CUDA graphs capture every step
//!   unless `training.disable_cuda_graphs` (not with pipelines), and the
//!   per-layer selective policy is gone (PR #2357: per-op is the only
//!   selective mode).
//!
//! Behaviour both rely on (DDP only without other parallelism, the FSDP
//! reshard policy, the stage split counting embedding and head as
//! `*_less_layers` layers) is that of `torchtitan/models/llama3/infra/parallelize.py`
//! and `torchtitan/distributed/pipeline_parallel.py` of those releases.

use super::{ExportError, LaunchJob, check_job};
use crate::config::{
    CrossEntropyFusion, GradReduce, OptimizerSharding, Recompute, ScheduleKind, WgradDeferral,
};
use crate::model::{AttentionKind, ModelSpec, RopeScaling, builtin_model};
use crate::text::shell_quote;
use std::fmt::Write;

const ENGINE: &str = "torchtitan";

/// How a plan maps onto torchtitan's degrees and batches: one mapping for
/// both releases.
struct Layout {
    replicate: u64,
    shard: u64,
    /// `fsdp_reshard_after_forward`, when FSDP shards.
    reshard: Option<&'static str>,
    local_batch: u64,
    pipeline: Option<Pipeline>,
    /// What runs differently from the plan, for comments and notes.
    notes: Vec<&'static str>,
}

struct Pipeline {
    schedule: &'static str,
    microbatch: u64,
    layers_per_stage: u64,
    first_less: u64,
    last_less: u64,
}

/// Mapping:
/// - Data parallelism. Full sharding (ZeRO-3) is FSDP over dp ranks
///   (`data_parallel_shard_degree = dp`). Optimizer-state sharding has no
///   torchtitan switch of its own; it is FSDP with
///   `fsdp_reshard_after_forward = "never"`, which keeps weights gathered
///   from forward to backward like ZeRO-1/2 and needs no more memory; under
///   a pipeline it moves the same bytes per step (one all-gather, one
///   reduce-scatter), while without one torchtitan may gather weights again
///   for every accumulated micro-batch. Without sharding, plain DDP
///   (`data_parallel_replicate_degree = dp`) is used only when tp = pp = 1,
///   because torchtitan refuses DDP combined with other parallelism; with
///   tp or pp > 1 it falls back to the same FSDP form, and says so.
/// - Pipeline. Schedules `GPipe`, `1F1B`, `Interleaved1F1B`; stages hold
///   L/(pp*v) layers each with the embedding and head not counted as layers
///   (the even split paratune models), the end stages fewer where the plan
///   says. `training.local_batch_size` is the per-data-parallel-rank batch
///   and `pipeline_parallel_microbatch_size` the micro-batch. Without a
///   pipeline, `local_batch_size` is the micro-batch and torchtitan
///   accumulates gradients up to `global_batch_size`.
fn layout(job: &LaunchJob) -> Result<Layout, ExportError> {
    let c = job.config;
    let mut notes = Vec::new();
    let (replicate, shard, reshard) = match c.optimizer_sharding {
        _ if c.dp == 1 => (1, 1, None),
        // Hybrid sharding (HSDP): replicas of a shard group.
        // torchtitan's shard degree leaves context parallelism out (its
        // FSDP mesh adds the cp ranks itself).
        OptimizerSharding::Full => (c.replicas(), c.dp_shard.unwrap_or(c.dp), Some("default")),
        OptimizerSharding::OptimizerStates => {
            notes.push(
                "optimizer-state sharding: FSDP keeping weights gathered between forward and backward",
            );
            (c.replicas(), c.dp_shard.unwrap_or(c.dp), Some("never"))
        }
        OptimizerSharding::None if c.tp == 1 && c.pp == 1 => (c.dp, 1, None),
        OptimizerSharding::None => {
            notes.push(
                "torchtitan runs DDP only without tensor or pipeline parallelism, so the unsharded plan runs as FSDP keeping weights gathered (no more memory than planned)",
            );
            (1, c.dp, Some("never"))
        }
    };
    if job.model.moe.is_some() && c.dispatcher != crate::config::Dispatcher::AllToAll {
        notes.push(match c.dispatcher {
            crate::config::Dispatcher::Flex | crate::config::Dispatcher::HybridEp => "torchtitan dispatches tokens to the experts with all-to-all; the plan priced a flex dispatcher's kernels (DeepEP or HybridEP), so its expert-parallel time differs",
            _ => "torchtitan dispatches tokens to the experts with all-to-all; the plan priced the allgather dispatcher, so its expert-parallel time differs",
        });
    }
    if c.dp > 1 && !c.overlap_grad_reduce {
        notes.push(
            "torchtitan always overlaps gradient reduction with the backward pass (FSDP/DDP); the plan had it off, so the step may take less time than planned",
        );
    }
    let (local_batch, pipeline) = if c.pp > 1 {
        let schedule = match c.schedule {
            ScheduleKind::Gpipe => "GPipe",
            ScheduleKind::OneFOneB => "1F1B",
            ScheduleKind::Interleaved => "Interleaved1F1B",
        };
        let (layers_per_stage, first_less, last_less) = stage_split(job)?;
        let pipeline = Pipeline {
            schedule,
            microbatch: c.micro_batch,
            layers_per_stage,
            first_less,
            last_less,
        };
        (job.global_batch / c.dp, Some(pipeline))
    } else {
        (c.micro_batch, None)
    };
    Ok(Layout {
        replicate,
        shard,
        reshard,
        local_batch,
        pipeline,
        notes,
    })
}

/// Everything `release` cannot run of the plan, named at once (see
/// [`super::every_refusal`]); a wrong plan or model is refused first.
fn refusals(job: &LaunchJob, release: Release) -> Result<(), ExportError> {
    check_job(job)?;
    check_model(job)?;
    let c = job.config;
    let mut checks = vec![
        super::check_embedding_sync(ENGINE, c),
        refuse(
            c.bpipe,
            "BPipe activation balancing",
            "torchtitan has no BPipe; search again with --bpipe off",
        ),
        refuse(
            c.ep_comm_overlap,
            "Megatron-Core's batch-level EP overlap",
            "torchtitan does not pair micro-batches to hide its all-to-alls; search again with --ep-comm-overlap off",
        ),
        refuse(
            c.tp_comm_overlap && !c.compile,
            "async tensor parallelism without torch.compile",
            "torchtitan raises \"Async TP requires torch.compile\"; search again with --compile on or --tp-comm-overlap off",
        ),
        if c.pp > 1 {
            stage_split(job).map(|_| ())
        } else {
            Ok(())
        },
        check_experts_and_context(job, release),
        refuse(
            c.cuda_graphs == crate::config::CudaGraphs::FullIteration,
            "Megatron-LM's whole-iteration CUDA graph",
            "torchtitan's own graphs are --cuda-graphs on; search again with --cuda-graphs off,on",
        ),
        refuse(
            c.precision == crate::config::Precision::Nvfp4,
            "NVFP4 training",
            "torchtitan's converters train in float8 or MXFP8, not NVFP4 (Transformer Engine's, Megatron-LM's); search again with --precision fp8, or launch with Megatron-LM",
        ),
    ];
    checks.extend(loss_and_gradient_refusals(job));
    checks.extend(release_refusals(job, release));
    super::every_refusal(checks)
}

/// `Err` naming `feature` and its fix where `broken`.
fn refuse(broken: bool, feature: &str, hint: &str) -> Result<(), ExportError> {
    if !broken {
        return Ok(());
    }
    Err(ExportError::Unsupported {
        engine: ENGINE,
        feature: feature.into(),
        hint: hint.into(),
    })
}

/// What one release lacks that the other has: 0.2's TOML has no CUDA
/// graphs; 0.3 captures them only without a pipeline, sets float8 in its
/// Python config function and has no per-layer selective policy.
fn release_refusals(job: &LaunchJob, release: Release) -> Vec<Result<(), ExportError>> {
    let c = job.config;
    match release {
        Release::V02 => vec![refuse(
            c.cuda_graphs.on(),
            "CUDA graphs",
            "the TOML job config of torchtitan 0.2 has no CUDA-graph switch (0.3 captures \
             whole steps by default, without pipeline parallelism); search again with \
             --cuda-graphs off",
        )],
        Release::V03 => vec![
            refuse(
                c.cuda_graphs.on() && c.pp > 1,
                "CUDA graphs under a pipeline",
                "torchtitan captures CUDA graphs only without pipeline parallelism; search again with --cuda-graphs off or --pp 1",
            ),
            refuse(
                c.precision == crate::config::Precision::Fp8,
                "FP8 from the command line",
                "torchtitan 0.3 sets float8 in the Python config function (a \
                 Float8LinearConverter, or its MXFP8 converter on Blackwell); add it there \
                 and run these flags, or give a torchtitan 0.2 job TOML",
            ),
            refuse(
                c.recompute == Recompute::SelectiveLayer,
                "per-layer selective checkpointing",
                "torchtitan 0.3.0 removed it (per-op is its only selective mode); search \
                 again with --recompute selective-op, or give a torchtitan 0.2 job TOML",
            ),
        ],
    }
}

/// The plan's model chunks as torchtitan splits a pipeline
/// ([`ParallelConfig::torchtitan_stage_split`](crate::config::ParallelConfig::torchtitan_stage_split)),
/// or why it cannot: a plan made for Megatron-LM may split otherwise.
fn stage_split(job: &LaunchJob) -> Result<(u64, u64, u64), ExportError> {
    let c = job.config;
    c.torchtitan_stage_split(job.model.layers)
        .ok_or_else(|| ExportError::Unsupported {
            engine: ENGINE,
            feature: format!(
                "stages of {}, {} and {} layers (first, middle, last; v {})",
                c.stage_layers(job.model.layers, 0),
                c.middle_stage_layers(job.model.layers),
                c.stage_layers(job.model.layers, c.pp - 1),
                c.virtual_stages
            ),
            hint: format!(
                "{}; search again without --first-stage-layers / --last-stage-layers, or with end stages no larger than the others",
                crate::config::TORCHTITAN_SPLIT
            ),
        })
}

/// Which torchtitan release an export is for: their expert and context
/// parallelism differ.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    /// 0.2: experts split like the dense layers (`dp2ep`, etp = tp), ep
    /// carved out of dp_shard x cp; `context_parallel_rotate_method`.
    V02,
    /// 0.3: experts whole (etp = 1), ep carved out of dp_shard x cp x tp;
    /// no rotate method.
    V03,
}

/// What torchtitan cannot run of the model, whatever the configuration:
/// checked first, so that a plan's other candidates are not tried in vain.
fn check_model(job: &LaunchJob) -> Result<(), ExportError> {
    if job.model.mtp_layers > 0 {
        return Err(ExportError::UnsupportedModel {
            engine: ENGINE,
            feature: "multi-token prediction".into(),
            hint: "torchtitan's models have no multi-token prediction; plan with --mtp-layers 0 to train without them".into(),
        });
    }
    Ok(())
}

/// What a release cannot run of the plan's expert and context parallelism.
fn check_experts_and_context(job: &LaunchJob, release: Release) -> Result<(), ExportError> {
    let c = job.config;
    let unsupported = |feature: String, hint: &str| {
        Err(ExportError::Unsupported {
            engine: ENGINE,
            feature,
            hint: hint.into(),
        })
    };
    let shard = c.dp_shard.unwrap_or(c.dp);
    if job.model.moe.is_some() {
        let (etp, carved) = match release {
            Release::V02 => (
                c.tp,
                c.ep.is_multiple_of(c.cp) && (shard * c.cp).is_multiple_of(c.ep),
            ),
            Release::V03 => (
                1,
                c.ep.is_multiple_of(c.tp) && (shard * c.cp * c.tp).is_multiple_of(c.ep),
            ),
        };
        if c.etp != etp {
            return unsupported(
                format!("expert tensor parallelism etp {} with tp {}", c.etp, c.tp),
                match release {
                    Release::V02 => {
                        "torchtitan 0.2 splits the experts as the dense layers (etp = tp); search again with --etp equal to --tp"
                    }
                    Release::V03 => {
                        "torchtitan 0.3 keeps each expert whole (etp 1); search again with --etp 1"
                    }
                },
            );
        }
        if !carved {
            return unsupported(
                format!(
                    "expert parallelism ep {} over dp_shard {shard}, cp {}, tp {}",
                    c.ep, c.cp, c.tp
                ),
                "torchtitan carves the expert-parallel group out of the data-parallel shard ranks (with cp, and in 0.3 with tp): pick an --ep that is a multiple of cp (0.3: of cp x tp) and divides dp_shard x cp (0.3: x tp)",
            );
        }
    }
    match (c.cp_comm, release) {
        (crate::config::CpComm::A2a | crate::config::CpComm::A2aP2p, _) if c.cp > 1 => unsupported(
            format!("context parallelism by {}", c.cp_comm.name()),
            "torchtitan's context parallelism rotates keys and values around the ranks; search again with --cp-comm p2p or allgather",
        ),
        (crate::config::CpComm::AllGather, Release::V03) if c.cp > 1 => unsupported(
            "context parallelism by all-gather".into(),
            "torchtitan 0.3 has no rotate-method switch; search again with --cp-comm p2p",
        ),
        _ => Ok(()),
    }
}

/// torchtitan 0.2's `context_parallel_rotate_method` for a plan's key/value
/// exchange: the ring passes chunks on (`alltoall`), or gathers them all.
fn rotate_method(c: &crate::config::ParallelConfig) -> &'static str {
    match c.cp_comm {
        crate::config::CpComm::AllGather => "allgather",
        _ => "alltoall",
    }
}

/// Built-in models torchtitan ships a network for: paratune's name, then
/// torchtitan's model (0.2's `[model] name`, 0.3's `--module`) and flavor,
/// as `torchtitan/models/llama3`, `qwen3` and `deepseek_v3` and `gpt_oss`
/// name their flavors (same widths, layers, heads, experts and
/// vocabulary; torchtitan sets the sequence length from training).
const TORCHTITAN_MODELS: [(&str, &str, &str); 11] = [
    ("llama3-8b", "llama3", "8B"),
    ("llama3-70b", "llama3", "70B"),
    ("llama3-405b", "llama3", "405B"),
    ("llama3.1-8b", "llama3", "8B"),
    ("llama3.1-70b", "llama3", "70B"),
    ("llama3.1-405b", "llama3", "405B"),
    ("qwen3-30b-a3b", "qwen3", "30B-A3B"),
    ("qwen3-235b-a22b", "qwen3", "235B-A22B"),
    ("deepseek-v3", "deepseek_v3", "671B"),
    ("gpt-oss-20b", "gpt_oss", "20b"),
    ("gpt-oss-120b", "gpt_oss", "120b"),
];

/// The built-in model torchtitan's model `name` and `flavor` build, if it
/// is one of [`TORCHTITAN_MODELS`] (the first, for a flavor two share).
pub fn catalogue_model_of(name: &str, flavor: &str) -> Option<ModelSpec> {
    TORCHTITAN_MODELS
        .iter()
        .find(|m| m.1 == name && m.2 == flavor)
        .and_then(|m| builtin_model(m.0))
}

/// The built-in model torchtitan 0.3's config function `config` of
/// `module` builds, where its name follows the config registries'
/// `<module>_<flavor>` (`llama3_8b`, `qwen3_30b_a3b`: `config_registry.py`
/// of each model, whose functions call `model_registry("30B-A3B")`), with
/// the model and flavor of one of [`TORCHTITAN_MODELS`].
pub fn catalogue_model_of_config(module: &str, config: &str) -> Option<ModelSpec> {
    TORCHTITAN_MODELS
        .iter()
        .find(|m| {
            m.1 == module && config == format!("{}_{}", m.1, m.2.to_lowercase().replace('-', "_"))
        })
        .and_then(|m| builtin_model(m.0))
}

/// The torchtitan models and flavors paratune knows, for messages.
pub fn known_torchtitan_models() -> String {
    let mut known: Vec<String> = Vec::new();
    for (_, name, flavor) in TORCHTITAN_MODELS {
        let entry = format!("{name} {flavor}");
        if !known.contains(&entry) {
            known.push(entry);
        }
    }
    known.join(", ")
}

/// torchtitan's model for `model` (0.3's `--module`), when torchtitan ships
/// it unchanged.
pub fn torchtitan_module(model: &ModelSpec) -> Option<&'static str> {
    torchtitan_model(model).map(|(module, _)| module)
}

/// torchtitan's model and flavor for `model`, when it is one of
/// [`TORCHTITAN_MODELS`] unchanged apart from what training sets (the
/// sequence length, the attention kernel, the prediction modules, which
/// [`check_model`] refuses anyway).
fn torchtitan_model(model: &ModelSpec) -> Option<(&'static str, &'static str)> {
    let &(name, module, flavor) = TORCHTITAN_MODELS.iter().find(|m| m.0 == model.name)?;
    let built_in = builtin_model(name)?;
    let unchanged = ModelSpec {
        seq_len: model.seq_len,
        attention: model.attention,
        mtp_layers: model.mtp_layers,
        ..built_in
    } == *model;
    unchanged.then_some((module, flavor))
}

/// What the model needs and llama3 lacks, for the comment above the model.
fn unlike_llama(job: &LaunchJob) -> Vec<&'static str> {
    let model = job.model;
    let other_head_width = model
        .head_dim_override
        .is_some_and(|width| width * model.heads != model.hidden);
    [
        (!model.gated_mlp, "a plain MLP"),
        (model.learned_positions, "learned positions"),
        (model.no_positions, "no position embeddings"),
        (model.tied_embeddings, "tied embeddings"),
        (
            model.moe.is_some(),
            "a mixture of experts (a torchtitan MoE model: qwen3, deepseek_v3 or llama4)",
        ),
        (
            model.mla.is_some(),
            "multi-latent attention (torchtitan's deepseek_v3)",
        ),
        (!model.rms_norm, "LayerNorm"),
        (model.linear_bias, "biased linears"),
        (model.dropout, "dropout"),
        (
            model.qk_layernorm && model.mla.is_none(),
            "per-head query and key norms (torchtitan's qwen3)",
        ),
        (
            other_head_width,
            "heads of another width than hidden / heads",
        ),
        (
            model.window.is_some(),
            "sliding-window attention (torchtitan's gpt_oss)",
        ),
        (
            model.attention_sinks,
            "attention sinks (torchtitan's gpt_oss)",
        ),
        (
            model.quick_geglu.is_some(),
            "gpt-oss's clamped quick-GeGLU (torchtitan's gpt_oss)",
        ),
    ]
    .into_iter()
    .filter_map(|(lacks, what)| lacks.then_some(what))
    .collect()
}

/// The model's dimensions, for a comment: torchtitan picks the network by
/// name, and this is what that name must build.
fn dimensions(job: &LaunchJob) -> String {
    let model = job.model;
    format!(
        "{} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}, seq {}{}, norm eps {:e}{}",
        model.layers,
        model.hidden,
        model.heads,
        model.kv_heads,
        model.ffn_hidden,
        model.vocab,
        model.seq_len,
        rotary(model),
        model.norm_epsilon,
        router(model)
    )
}

/// An MoE model's router, as a torchtitan MoE flavor's router arguments
/// must hold it; nothing for a dense model.
fn router(model: &ModelSpec) -> String {
    let Some(moe) = model.moe else {
        return String::new();
    };
    let mut parts = vec![format!("{} router", moe.router_score.name())];
    if moe.router_expert_bias {
        parts.push("a bias per expert".into());
    }
    if moe.router_topk_scaling != 1.0 {
        parts.push(format!("weights scaled by {}", moe.router_topk_scaling));
    }
    if moe.router_dtype != crate::model::RouterDtype::Model {
        parts.push(format!("in {}", moe.router_dtype.name()));
    }
    format!(", {}", parts.join(", "))
}

/// The rotary base and scaling, as a torchtitan flavor's rope_theta and
/// scaling arguments must hold them; nothing without rotary positions.
fn rotary(model: &ModelSpec) -> String {
    if !model.is_rotary() {
        return String::new();
    }
    // torchtitan's llama3 (every model not exported to a module of its
    // own) rescales as Llama 3.1 does whatever the flavor
    // (`precompute_freqs_cis` applies its `rope_scaling_args`), and a
    // scaling factor of 1 leaves the frequencies as they are.
    let llama3 = torchtitan_module(model).is_none_or(|module| module == "llama3");
    let scaling = match model.rope_scaling {
        None if llama3 => {
            " without rescaling (torchtitan's llama3 rescales as Llama 3.1 unless the flavor's \
             rope_scaling_args has scaling_factor 1)"
                .to_string()
        }
        None => " without rescaling".to_string(),
        Some(RopeScaling::Llama3 { factor }) => format!(" (Llama 3.1's scaling, factor {factor})"),
        Some(RopeScaling::Yarn {
            factor,
            original_positions,
            ..
        }) => format!(" (YaRN, factor {factor} from {original_positions} positions)"),
    };
    format!(", rope theta {}{scaling}", model.rotary_base)
}

/// bf16 gradient reduction is FSDP2's `reduce_dtype`, but torchtitan's
/// `training.mixed_precision_reduce` is typed `Literal["float32"]` in some
/// releases and allows "bfloat16" in others: the export would not know
/// whether the job starts, so it refuses.
fn loss_and_gradient_refusals(job: &LaunchJob) -> [Result<(), ExportError>; 3] {
    let c = job.config;
    let fused_loss = refuse(
        c.cross_entropy_fusion != CrossEntropyFusion::Off,
        &format!(
            "Megatron-LM's fused cross-entropy ({})",
            c.cross_entropy_fusion.name()
        ),
        "torchtitan computes its loss with PyTorch's cross-entropy; search again \
         with --cross-entropy-fusion off",
    );
    let deferral = refuse(
        c.wgrad_deferral != WgradDeferral::Off,
        &format!(
            "Megatron-LM's deferred embedding weight gradient ({})",
            c.wgrad_deferral.name()
        ),
        "torchtitan defers no weight gradients; search again with --wgrad-deferral off",
    );
    let bf16_reduce = refuse(
        c.grad_reduce != GradReduce::Fp32,
        "bf16 gradient reduction",
        "torchtitan's training.mixed_precision_reduce accepts only \"float32\" in some \
         releases; search again with --grad-reduce fp32, or set it by hand where your \
         release allows \"bfloat16\"",
    );
    [fused_loss, deferral, bf16_reduce]
}

/// A torchtitan 0.2.2 job-config TOML fragment for the plan: the `[model]`,
/// `[training]`, `[parallelism]`, `[compile]` and `[activation_checkpoint]`
/// keys, starting with the comment line `# paratune plan: <plan>`. Merge it
/// into a full job config (dataset, optimiser, checkpointing are the
/// user's); [`merge_job_config`] does.
///
/// See [`layout`] for the mapping; besides, tensor parallelism always shards
/// sequences in 0.2 (a plan with sequence parallelism off gets a comment
/// saying so), and recomputation is `mode = "none" | "selective" | "full"`,
/// selective as the per-op policy (`selective_ac_option = "op"`) or every
/// N-th layer (`selective_ac_option = "N"`).
///
/// Errors: the plan fails [`ParallelConfig::check`](crate::config::ParallelConfig::check)
/// for the job, or uses what 0.2 cannot run (BPipe, CUDA graphs, ...: all of
/// them named at once, [`refusals`]).
pub fn torchtitan_toml(job: &LaunchJob) -> Result<String, ExportError> {
    refusals(job, Release::V02)?;
    let layout = layout(job)?;
    let (model, c) = (job.model, job.config);

    let mut out = String::new();
    let w = &mut out;
    line(w, format_args!("# paratune plan: {c}"));
    let per_node = job.gpus_per_node.min(job.gpus);
    let nodes = job.gpus.div_ceil(job.gpus_per_node);
    line(
        w,
        format_args!(
            "# {} on {} GPUs: torchrun --nnodes {nodes} --nproc-per-node {per_node}",
            comment_text(&model.name),
            job.gpus
        ),
    );

    line(w, format_args!("\n[model]"));
    line(
        w,
        format_args!("# torchtitan builds the network from name and flavor; the flavor needs"),
    );
    line(w, format_args!("# {}", dimensions(job)));
    let torchtitan_model = torchtitan_model(model);
    let unlike = unlike_llama(job);
    if torchtitan_model.is_none() {
        if unlike.is_empty() {
            line(
                w,
                format_args!(
                    "# torchtitan ships no such flavor: register one of this name with these dimensions in its llama3 model"
                ),
            );
        } else {
            line(
                w,
                format_args!(
                    "# llama3 has SwiGLU, rotary positions, RMSNorm without biases or dropout, and an untied head; this model has {}: give it its own model",
                    unlike.join(", ")
                ),
            );
        }
    }
    if c.attention == AttentionKind::Standard {
        line(
            w,
            format_args!(
                "# torchtitan runs attention through SDPA (fused kernels); materialised scores are not selectable"
            ),
        );
    }
    let (name, flavor) = torchtitan_model.unwrap_or(("llama3", model.name.as_str()));
    line(w, format_args!("name = {}", toml_string(name)));
    line(w, format_args!("flavor = {}", toml_string(flavor)));
    if c.precision == crate::config::Precision::Fp8 {
        // torchao's float8 linears (tensorwise scaling), or its MXFP8
        // converter; the configuration rules refuse the other recipes.
        if job.fp8_recipe() == crate::config::Fp8Recipe::Mxfp8 {
            line(w, format_args!("converters = [\"mx\"]"));
            line(w, format_args!("\n[mx]"));
            line(w, format_args!("recipe_name = \"mxfp8\""));
        } else {
            line(w, format_args!("converters = [\"float8\"]"));
            line(w, format_args!("\n[float8]"));
            line(w, format_args!("recipe_name = \"tensorwise\""));
        }
    }

    line(w, format_args!("\n[training]"));
    line(w, format_args!("local_batch_size = {}", layout.local_batch));
    line(w, format_args!("global_batch_size = {}", job.global_batch));
    line(w, format_args!("seq_len = {}", model.seq_len));
    line(w, format_args!("mixed_precision_param = \"bfloat16\""));

    line(w, format_args!("\n[parallelism]"));
    for note in &layout.notes {
        line(w, format_args!("# {note}"));
    }
    line(
        w,
        format_args!("data_parallel_replicate_degree = {}", layout.replicate),
    );
    line(
        w,
        format_args!("data_parallel_shard_degree = {}", layout.shard),
    );
    if let Some(policy) = layout.reshard {
        line(w, format_args!("fsdp_reshard_after_forward = \"{policy}\""));
    }
    if c.tp > 1 && !c.sequence_parallel {
        line(
            w,
            format_args!(
                "# torchtitan's tensor parallelism always shards sequences (sequence parallel);"
            ),
        );
        line(
            w,
            format_args!(
                "# the plan had it off, so activations will take less memory than planned"
            ),
        );
    }
    line(w, format_args!("tensor_parallel_degree = {}", c.tp));
    if c.tp_comm_overlap {
        line(
            w,
            format_args!(
                "# --tp-comm-overlap: torchtitan's async tensor parallelism (needs [compile] enable = true)"
            ),
        );
    }
    line(
        w,
        format_args!("enable_async_tensor_parallel = {}", c.tp_comm_overlap),
    );
    line(w, format_args!("pipeline_parallel_degree = {}", c.pp));
    if c.cp > 1 {
        line(w, format_args!("context_parallel_degree = {}", c.cp));
        line(
            w,
            format_args!("context_parallel_rotate_method = \"{}\"", rotate_method(c)),
        );
    }
    if model.moe.is_some() {
        line(w, format_args!("expert_parallel_degree = {}", c.ep));
    }
    if let Some(p) = &layout.pipeline {
        line(
            w,
            format_args!("pipeline_parallel_schedule = \"{}\"", p.schedule),
        );
        line(
            w,
            format_args!("pipeline_parallel_microbatch_size = {}", p.microbatch),
        );
        line(
            w,
            format_args!(
                "pipeline_parallel_layers_per_stage = {}",
                p.layers_per_stage
            ),
        );
        line(
            w,
            format_args!(
                "pipeline_parallel_first_stage_less_layers = {}",
                p.first_less
            ),
        );
        line(
            w,
            format_args!("pipeline_parallel_last_stage_less_layers = {}", p.last_less),
        );
    }

    line(w, format_args!("\n[compile]"));
    line(w, format_args!("enable = {}", c.compile));

    line(w, format_args!("\n[activation_checkpoint]"));
    match c.recompute {
        Recompute::None => line(w, format_args!("mode = \"none\"")),
        Recompute::Full => line(w, format_args!("mode = \"full\"")),
        Recompute::SelectiveLayer => {
            line(
                w,
                format_args!(
                    "# per-layer policy: one layer in {} checkpointed whole",
                    c.ac_frequency
                ),
            );
            line(w, format_args!("mode = \"selective\""));
            line(
                w,
                format_args!("selective_ac_option = \"{}\"", c.ac_frequency),
            );
        }
        Recompute::SelectiveOp | Recompute::Selective => {
            line(
                w,
                format_args!(
                    "# per-op policy: keeps attention outputs, recomputes every other matmul"
                ),
            );
            line(w, format_args!("mode = \"selective\""));
            line(w, format_args!("selective_ac_option = \"op\""));
        }
    }
    Ok(out)
}

/// `base`, a torchtitan 0.2.2 job config, with the plan's keys
/// ([`torchtitan_toml`]) and `extra` (a trial's steps and logging) set over
/// it: a whole job config, as TOML. The base keeps its model (name and
/// flavor), dataset, tokenizer, optimiser and whatever else the plan does
/// not say.
pub fn merge_job_config(
    base: &toml::Table,
    job: &LaunchJob,
    extra: &toml::Table,
) -> Result<String, ExportError> {
    let mut fragment: toml::Table =
        toml::from_str(&torchtitan_toml(job)?).expect("the fragment is TOML this module wrote");
    // The base names its model; the fragment keeps only what the plan
    // decides of it (the FP8 converters).
    if base.contains_key("model")
        && let Some(toml::Value::Table(model)) = fragment.get_mut("model")
    {
        model.remove("name");
        model.remove("flavor");
    }
    let mut merged = base.clone();
    merge_into(&mut merged, &fragment);
    merge_into(&mut merged, extra);
    let text = toml::to_string(&merged).expect("a TOML table serialises");
    Ok(format!(
        "# paratune plan: {}\n# {}\n{text}",
        job.config,
        dimensions(job)
    ))
}

/// Sets every key of `over` in `into`, tables merged key by key.
fn merge_into(into: &mut toml::Table, over: &toml::Table) {
    for (key, value) in over {
        match (into.get_mut(key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(over_inner)) => {
                merge_into(inner, over_inner)
            }
            _ => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

/// The torchtitan 0.3.0 words for a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchtitanFlags {
    /// `--section.field value` and boolean `--section.field` /
    /// `--section.no-field` words, in order.
    pub flags: Vec<String>,
    /// The activation-checkpointing subcommand, which must come last.
    pub activation_checkpoint: &'static str,
    /// What runs differently from the plan.
    pub notes: Vec<&'static str>,
}

impl TorchtitanFlags {
    /// One line per flag with its shell-quoted values, the
    /// activation-checkpointing subcommand last.
    pub fn command_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = Vec::new();
        let words = self
            .flags
            .iter()
            .map(String::as_str)
            .chain([self.activation_checkpoint]);
        for word in words {
            match lines.last_mut() {
                Some(line)
                    if !word.starts_with("--") && !word.starts_with("activation-checkpoint:") =>
                {
                    line.push(' ');
                    line.push_str(&shell_quote(word));
                }
                _ => lines.push(word.to_string()),
            }
        }
        lines
    }
}

/// The torchtitan 0.3.0 command-line overrides that run the plan, given to
/// `-m torchtitan.train --module M --config F` (the config function builds
/// the model; these set every degree, batch and switch the plan decides).
/// See [`layout`] for the mapping.
///
/// Errors: as [`torchtitan_toml`], except CUDA graphs (0.3.0 runs them
/// without pipelines), and the per-layer selective policy, which 0.3.0
/// removed.
pub fn torchtitan_flags(job: &LaunchJob) -> Result<TorchtitanFlags, ExportError> {
    refusals(job, Release::V03)?;
    let layout = layout(job)?;
    let c = job.config;
    let activation_checkpoint = match c.recompute {
        Recompute::None => "activation-checkpoint:none",
        Recompute::Full => "activation-checkpoint:full",
        // The per-layer policy is refused above (0.3.0 removed it).
        Recompute::SelectiveOp | Recompute::Selective | Recompute::SelectiveLayer => {
            "activation-checkpoint:selective"
        }
    };
    let mut flags = Vec::new();
    let mut value = |name: &str, v: String| {
        flags.push(format!("--{name}"));
        flags.push(v);
    };
    value(
        "parallelism.data_parallel_replicate_degree",
        layout.replicate.to_string(),
    );
    value(
        "parallelism.data_parallel_shard_degree",
        layout.shard.to_string(),
    );
    if let Some(policy) = layout.reshard {
        value("parallelism.fsdp_reshard_after_forward", policy.into());
    }
    value("parallelism.tensor_parallel_degree", c.tp.to_string());
    value("parallelism.pipeline_parallel_degree", c.pp.to_string());
    value("parallelism.context_parallel_degree", c.cp.to_string());
    if job.model.moe.is_some() {
        value("parallelism.expert_parallel_degree", c.ep.to_string());
    }
    if let Some(p) = &layout.pipeline {
        value("parallelism.pipeline_parallel_schedule", p.schedule.into());
        value(
            "parallelism.pipeline_parallel_microbatch_size",
            p.microbatch.to_string(),
        );
        value(
            "parallelism.pipeline_parallel_layers_per_stage",
            p.layers_per_stage.to_string(),
        );
        value(
            "parallelism.pipeline_parallel_first_stage_less_layers",
            p.first_less.to_string(),
        );
        value(
            "parallelism.pipeline_parallel_last_stage_less_layers",
            p.last_less.to_string(),
        );
    }
    value("training.local_batch_size", layout.local_batch.to_string());
    value("training.global_batch_size", job.global_batch.to_string());
    value("training.seq_len", job.model.seq_len.to_string());
    value("training.mixed_precision_param", "bfloat16".into());
    let mut switch = |section: &str, field: &str, on: bool| {
        flags.push(if on {
            format!("--{section}.{field}")
        } else {
            format!("--{section}.no-{field}")
        });
    };
    if c.tp > 1 {
        switch(
            "parallelism",
            "enable_sequence_parallel",
            c.sequence_parallel,
        );
    }
    switch("compile", "enable", c.compile);
    switch("compile", "enable_async_tensor_parallel", c.tp_comm_overlap);
    switch("training", "disable_cuda_graphs", !c.cuda_graphs.on());
    Ok(TorchtitanFlags {
        flags,
        activation_checkpoint,
        notes: layout.notes,
    })
}

fn line(out: &mut String, args: std::fmt::Arguments) {
    out.write_fmt(args)
        .expect("writing to a String cannot fail");
    out.push('\n');
}

/// A TOML basic string holding `text`.
fn toml_string(text: &str) -> String {
    let mut quoted = String::from("\"");
    for ch in text.chars() {
        match ch {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(quoted, "\\u{:04X}", c as u32);
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// `text` made safe for a TOML comment (no control characters).
fn comment_text(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ParallelConfig;

    #[test]
    fn toml_strings_escape_quotes_backslashes_and_controls() {
        assert_eq!(toml_string("gpt3-175b"), "\"gpt3-175b\"");
        let tricky = "a \"b\" \\ c\nd";
        let parsed: toml::Table = toml::from_str(&format!("x = {}", toml_string(tricky))).unwrap();
        assert_eq!(parsed["x"].as_str(), Some(tricky));
        assert_eq!(comment_text("a\nb"), "a b");
    }

    fn launch<'a>(model: &'a ModelSpec, config: &'a ParallelConfig) -> LaunchJob<'a> {
        LaunchJob {
            model,
            config,
            global_batch: 256,
            gpus: config.gpus(),
            gpus_per_node: 8,
            gpu: "h100-sxm",
        }
    }

    /// A plan made for Megatron-LM (whose switches torchtitan may lack).
    fn data_parallel(dp: u64) -> ParallelConfig {
        ParallelConfig {
            dp,
            ..ParallelConfig::default()
        }
    }

    /// The flavor comment holds what a flavor's arguments must: the rotary
    /// base and rescaling, the norms' epsilon and an MoE model's router.
    #[test]
    fn the_flavor_comment_names_positions_norms_and_the_router() {
        let comment = |name: &str| {
            let model = builtin_model(name).unwrap();
            dimensions(&launch(&model, &data_parallel(8)))
        };
        for (name, expected) in [
            (
                "llama3-8b",
                ", rope theta 500000 without rescaling (torchtitan's llama3 rescales as Llama 3.1 unless",
            ),
            (
                "llama3.1-8b",
                "rope theta 500000 (Llama 3.1's scaling, factor 8)",
            ),
            (
                "qwen3-30b-a3b",
                "rope theta 1000000 without rescaling, norm eps 1e-6, softmax router",
            ),
            (
                "deepseek-v3",
                "sigmoid router, a bias per expert, weights scaled by 2.5, in fp32",
            ),
        ] {
            let text = comment(name);
            assert!(text.contains(expected), "{name}: {text}");
        }
        assert!(!comment("gpt3-175b").contains("rope"));
    }

    #[test]
    fn the_models_torchtitan_ships_are_named_by_its_model_and_flavor() {
        for (name, module, flavor) in TORCHTITAN_MODELS {
            let model = builtin_model(name).unwrap_or_else(|| panic!("{name} is built in"));
            assert_eq!(torchtitan_model(&model), Some((module, flavor)), "{name}");
            let back = catalogue_model_of(module, flavor).unwrap();
            assert_eq!(
                (
                    back.hidden,
                    back.layers,
                    back.heads,
                    back.kv_heads,
                    back.vocab
                ),
                (
                    model.hidden,
                    model.layers,
                    model.heads,
                    model.kv_heads,
                    model.vocab
                ),
                "{name}"
            );
            // Trained at another length, it is the same network.
            let longer = ModelSpec {
                seq_len: 2 * model.seq_len,
                ..model.clone()
            };
            assert_eq!(torchtitan_model(&longer), Some((module, flavor)), "{name}");
            // One layer more is not torchtitan's flavor.
            let deeper = ModelSpec {
                layers: model.layers + 1,
                ..model
            };
            assert_eq!(torchtitan_model(&deeper), None, "{name}");
        }
        let model = builtin_model("qwen3-30b-a3b").unwrap();
        let toml: toml::Table =
            toml::from_str(&torchtitan_toml(&launch(&model, &data_parallel(8))).unwrap()).unwrap();
        assert_eq!(toml["model"]["name"].as_str(), Some("qwen3"));
        assert_eq!(toml["model"]["flavor"].as_str(), Some("30B-A3B"));
        assert_eq!(catalogue_model_of("qwen3", "8B"), None);
        let deeper = ModelSpec {
            layers: 30,
            ..builtin_model("llama3-8b").unwrap()
        };
        let text = torchtitan_toml(&launch(&deeper, &data_parallel(8))).unwrap();
        assert!(text.contains("torchtitan ships no such flavor"), "{text}");
        // A Llama-sized model with Qwen3's norms and biased linears is no
        // llama3 flavor, and the comment names both.
        let normed = ModelSpec {
            qk_layernorm: true,
            linear_bias: true,
            ..deeper.clone()
        };
        let text = torchtitan_toml(&launch(&normed, &data_parallel(8))).unwrap();
        assert!(
            text.contains("this model has biased linears, per-head query and key norms"),
            "{text}"
        );
        let oss_like = ModelSpec {
            layers: 30,
            ..builtin_model("gpt-oss-20b").unwrap()
        };
        assert_eq!(torchtitan_model(&oss_like), None);
        let unlike = unlike_llama(&launch(&oss_like, &data_parallel(8)));
        for named in [
            "sliding-window",
            "attention sinks",
            "quick-GeGLU",
            "biased linears",
        ] {
            assert!(
                unlike.iter().any(|u| u.contains(named)),
                "{named}: {unlike:?}"
            );
        }
        let deepseek = builtin_model("deepseek-v3").unwrap();
        assert_eq!(torchtitan_module(&deepseek), Some("deepseek_v3"));
        let gpt = builtin_model("gpt3-175b").unwrap();
        assert_eq!(torchtitan_module(&gpt), None);
    }

    #[test]
    fn every_missing_feature_is_named_at_once() {
        let model = builtin_model("llama3-8b").unwrap();
        let plan = ParallelConfig {
            cross_entropy_fusion: CrossEntropyFusion::Te,
            grad_reduce: GradReduce::Bf16,
            cuda_graphs: crate::config::CudaGraphs::Layers,
            ..data_parallel(8)
        };
        let error = torchtitan_toml(&launch(&model, &plan)).unwrap_err();
        let ExportError::Several { problems, .. } = &error else {
            panic!("expected several refusals, got {error:?}");
        };
        assert_eq!(problems.len(), 3, "{error}");
        let text = error.to_string();
        assert!(!text.contains('\n'), "one line: {text}");
        for fix in [
            "--cross-entropy-fusion off",
            "--grad-reduce fp32",
            "--cuda-graphs off",
        ] {
            assert!(text.contains(fix), "{fix}: {text}");
        }
        // 0.3 captures CUDA graphs without a pipeline: two, not three.
        let error = torchtitan_flags(&launch(&model, &plan)).unwrap_err();
        assert!(
            matches!(&error, ExportError::Several { problems, .. } if problems.len() == 2),
            "{error}"
        );
        // A plan that cannot run the job is refused for that alone.
        let wrong = ParallelConfig { tp: 3, ..plan };
        assert!(matches!(
            torchtitan_toml(&launch(&model, &wrong)),
            Err(ExportError::InvalidPlan(_))
        ));
    }

    #[test]
    fn a_base_model_keeps_its_name_and_takes_the_plans_fp8_converters() {
        let model = builtin_model("llama3-8b").unwrap();
        let plan = ParallelConfig {
            precision: crate::config::Precision::Fp8,
            ..data_parallel(8)
        };
        let base: toml::Table =
            toml::from_str("[model]\nname = \"llama3\"\nflavor = \"8B_flex\"\n").unwrap();
        let merged = merge_job_config(&base, &launch(&model, &plan), &toml::Table::new()).unwrap();
        let merged: toml::Table = toml::from_str(&merged).unwrap();
        assert_eq!(merged["model"]["flavor"].as_str(), Some("8B_flex"));
        let converters = merged["model"]["converters"].as_array().unwrap();
        assert_eq!(converters[0].as_str(), Some("float8"));
        assert_eq!(merged["float8"]["recipe_name"].as_str(), Some("tensorwise"));
    }
}

#[cfg(test)]
mod dispatcher_tests {
    use super::*;
    use crate::config::{Dispatcher, Engine, ParallelConfig};

    /// A Megatron-LM plan's gathering dispatcher is not torchtitan's: its
    /// flags run, and say the expert-parallel time differs.
    #[test]
    fn a_gathering_dispatcher_runs_as_all_to_all_and_says_so() {
        let model = crate::model::builtin_model("mixtral-8x7b").unwrap();
        let flags_of = |dispatcher| {
            let config = ParallelConfig {
                dp: 8,
                ep: 8,
                etp: 1,
                dispatcher,
                // Planned for Megatron-LM, exported to torchtitan too.
                engine: Engine::Megatron,
                optimizer_sharding: crate::config::OptimizerSharding::Full,
                ..ParallelConfig::default()
            };
            let job = LaunchJob {
                model: &model,
                config: &config,
                global_batch: 64,
                gpus: 8,
                gpus_per_node: 8,
                gpu: "h100-sxm",
            };
            torchtitan_flags(&job).unwrap().notes
        };
        let said = |notes: Vec<&str>| notes.iter().any(|n| n.contains("all-to-all"));
        assert!(said(flags_of(Dispatcher::AllGather)));
        assert!(!said(flags_of(Dispatcher::AllToAll)));
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;
    use crate::config::{Engine, OptimizerSharding, ParallelConfig};

    fn flags(model: &str, config: ParallelConfig) -> Result<TorchtitanFlags, ExportError> {
        let model = crate::model::builtin_model(model).unwrap();
        let job = LaunchJob {
            model: &model,
            config: &config,
            global_batch: 64,
            gpus: config.tp * config.pp * config.cp * config.dp,
            gpus_per_node: 8,
            gpu: "h100-sxm",
        };
        torchtitan_flags(&job)
    }

    fn pipeline(first: Option<u64>, last: Option<u64>) -> ParallelConfig {
        ParallelConfig {
            pp: 2,
            dp: 4,
            virtual_stages: 3,
            schedule: ScheduleKind::Interleaved,
            first_stage_layers: first,
            last_stage_layers: last,
            optimizer_sharding: OptimizerSharding::Full,
            // Planned for Megatron-LM, exported to torchtitan too.
            engine: Engine::Megatron,
            ..ParallelConfig::default()
        }
    }

    fn flag<'f>(flags: &'f TorchtitanFlags, name: &str) -> &'f str {
        let at = flags.flags.iter().position(|a| a == name).unwrap();
        &flags.flags[at + 1]
    }

    /// torchtitan's chunks are all alike but the end ones, which may hold
    /// fewer: an even plan and ones with short end stages map, a first
    /// stage larger than the middle ones does not.
    #[test]
    fn pipeline_chunks_export_only_as_torchtitan_splits_them() {
        // Qwen3-30B-A3B: 48 layers over pp 2 x v 3 chunks of 8.
        let even = flags("qwen3-30b-a3b", pipeline(None, None)).unwrap();
        let per_stage = "--parallelism.pipeline_parallel_layers_per_stage";
        let first_less = "--parallelism.pipeline_parallel_first_stage_less_layers";
        let last_less = "--parallelism.pipeline_parallel_last_stage_less_layers";
        assert_eq!(flag(&even, per_stage), "8");
        assert_eq!(flag(&even, first_less), "0");
        // pp 4: 10, 13, 13 and 12 layers are chunks of 13, three and one fewer.
        let short_ends = ParallelConfig {
            pp: 4,
            dp: 2,
            virtual_stages: 1,
            schedule: ScheduleKind::OneFOneB,
            ..pipeline(Some(10), Some(12))
        };
        let short = flags("qwen3-30b-a3b", short_ends).unwrap();
        assert_eq!(
            (
                flag(&short, per_stage),
                flag(&short, first_less),
                flag(&short, last_less)
            ),
            ("13", "3", "1")
        );
        // pp 2 x v 3 with 27 and 21: chunks of 9, the last 6 fewer (it was
        // written as 0 layers a chunk).
        let uneven = flags("qwen3-30b-a3b", pipeline(Some(27), Some(21))).unwrap();
        assert_eq!(
            (
                flag(&uneven, per_stage),
                flag(&uneven, first_less),
                flag(&uneven, last_less)
            ),
            ("9", "0", "6")
        );
        // pp 4: a first stage of 14 over middle ones of 12 has no such split.
        let larger = ParallelConfig {
            pp: 4,
            dp: 2,
            virtual_stages: 1,
            schedule: ScheduleKind::OneFOneB,
            ..pipeline(Some(14), Some(10))
        };
        let said = flags("qwen3-30b-a3b", larger).unwrap_err().to_string();
        assert!(said.contains("stages of 14, 12 and 10 layers"), "{said}");
    }

    /// What torchtitan refuses at start-up is refused here: async tensor
    /// parallelism without torch.compile, CUDA graphs under a pipeline.
    #[test]
    fn switches_torchtitan_cannot_start_with_are_refused() {
        let async_tp = ParallelConfig {
            tp: 2,
            dp: 4,
            sequence_parallel: true,
            tp_comm_overlap: true,
            optimizer_sharding: OptimizerSharding::Full,
            ..ParallelConfig::default()
        };
        let said = flags("llama3-8b", async_tp).unwrap_err().to_string();
        assert!(said.contains("Async TP requires torch.compile"), "{said}");
        let compiled = ParallelConfig {
            compile: true,
            engine: Engine::Torchtitan,
            ..async_tp
        };
        let compiled = flags("llama3-8b", compiled);
        assert!(compiled.is_ok(), "{compiled:?}");
        let graphs = ParallelConfig {
            cuda_graphs: crate::config::CudaGraphs::Layers,
            ..pipeline(None, None)
        };
        let said = flags("qwen3-30b-a3b", graphs).unwrap_err().to_string();
        assert!(said.contains("CUDA graphs under a pipeline"), "{said}");
    }
}
