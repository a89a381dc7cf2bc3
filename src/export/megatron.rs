//! Megatron-LM `pretrain_gpt.py` arguments.
//!
//! Flag names match `megatron/training/arguments.py` of NVIDIA/Megatron-LM
//! main as of late 2025 (Megatron-Core 0.14 and later; checked against
//! commit 000c4ac). Everything emitted also parses on the core_r0.10+
//! release branches, which introduced `--attention-backend`.

use super::{ExportError, LaunchJob, check_job, shell_quote};
use crate::config::{
    CrossEntropyFusion, CudaGraphs, EXPERT_RANK_CAPACITY_FACTOR, GradReduce, OptimizerSharding,
    Precision, Recompute, ScheduleKind, WgradDeferral,
};
use crate::model::{AttentionKind, ModelSpec, MoeSpec, RopeScaling, RouterDtype, RouterScore};

const ENGINE: &str = "Megatron-LM";

/// Megatron-LM command-line arguments for `pretrain_gpt.py`, one per
/// element, e.g. `["--tensor-model-parallel-size", "8", ...]`.
///
/// Covers the parallel layout, the batch, the model shape and the memory
/// switches; data, tokenizer, optimiser and checkpoint arguments are the
/// user's. The data-parallel degree has no flag: Megatron-LM derives it as
/// world size / (tp x pp).
///
/// Mapping: the interleaved schedule becomes
/// `--num-layers-per-virtual-pipeline-stage L/(pp*v)`; attention `Flash`
/// becomes `--attention-backend flash` (`fused`, cuDNN's, for a model with
/// attention sinks, which FlashAttention lacks) and `Standard`
/// `--attention-backend unfused` (Megatron-Core picks its attention kernel from this switch;
/// `--use-flash-attn` is still accepted but only the legacy models read it);
/// selective recomputation is `--recompute-granularity selective` (the
/// default module list is the attention core, as paratune models it); full
/// recomputation is `--recompute-granularity full --recompute-method uniform
/// --recompute-num-layers 1`; optimizer-state sharding is
/// `--use-distributed-optimizer`, full sharding Megatron-FSDP
/// (`--use-megatron-fsdp --data-parallel-sharding-strategy
/// optim_grads_params` with the flags it needs). Precision is always `--bf16`.
///
/// Errors: the plan fails [`ParallelConfig::check`](crate::config::ParallelConfig::check)
/// for the job, or uses what Megatron-LM cannot run as planned: the GPipe
/// schedule with pp > 1 (Megatron-LM runs 1F1B), or BPipe (not upstream).
pub fn megatron_args(job: &LaunchJob) -> Result<Vec<String>, ExportError> {
    check_job(job)?;
    let (model, c) = (job.model, job.config);
    super::check_embedding_sync(ENGINE, c)?;

    if c.schedule == ScheduleKind::Gpipe && c.pp > 1 {
        return Err(ExportError::Unsupported {
            engine: ENGINE,
            feature: "the GPipe pipeline schedule".into(),
            hint: "Megatron-LM runs 1F1B, which takes the same time with less activation \
                   memory; search again with --schedule 1f1b"
                .into(),
        });
    }
    if c.compile {
        return Err(ExportError::Unsupported {
            engine: ENGINE,
            feature: "torch.compile".into(),
            hint: "Megatron-LM fuses its kernels by hand and does not run torch.compile; \
                   search again with --compile off, or export to torchtitan"
                .into(),
        });
    }
    if c.bpipe {
        return Err(ExportError::Unsupported {
            engine: ENGINE,
            feature: "BPipe activation balancing".into(),
            hint: "upstream Megatron-LM has no BPipe; search again with --bpipe off, \
                   or launch with a Megatron-LM fork that implements BPipe"
                .into(),
        });
    }
    // End stages short of whole chunks under interleaving: Megatron-LM's
    // account-for flags express its own such split, a layout any other.
    let accounted = c.is_accounted_split(model.layers);
    let layout = c.virtual_stages > 1
        && !accounted
        && [c.first_stage_layers, c.last_stage_layers]
            .iter()
            .flatten()
            .any(|n| !n.is_multiple_of(c.virtual_stages));

    let mut args = Args::default();
    args.pair("--tensor-model-parallel-size", c.tp);
    args.pair("--pipeline-model-parallel-size", c.pp);
    if c.cp > 1 {
        args.pair("--context-parallel-size", c.cp);
        args.pair("--cp-comm-type", c.cp_comm.name());
        if c.cp_comm == crate::config::CpComm::A2aP2p {
            // The all-to-all group's size, then the ring's (nargs='+').
            args.values(
                "--hierarchical-context-parallel-sizes",
                [c.cp_a2a, c.cp_comm.ring_ranks(c)],
            );
        }
    }
    if let Some(window) = model.window {
        // (left, right): the tokens before a query, none after it.
        args.pair("--window-size", format!("{},0", window.tokens));
        if window.full_every > 0 {
            args.pair("--window-attn-skip-freq", window.full_every);
        }
    }
    if model.mtp_layers > 0 {
        args.pair("--mtp-num-layers", model.mtp_layers);
    }
    if let Some(moe) = model.moe {
        args.pair("--num-experts", moe.experts);
        args.pair("--moe-router-topk", moe.topk);
        args.pair("--moe-ffn-hidden-size", moe.ffn_hidden);
        if moe.shared_ffn_hidden > 0 {
            args.pair(
                "--moe-shared-expert-intermediate-size",
                moe.shared_ffn_hidden,
            );
        }
        if moe.dense_layers > 0 || moe.layer_freq > 1 {
            args.pair("--moe-layer-freq", moe_layer_pattern(model));
        }
        if moe.router_groups > 0 {
            args.pair("--moe-router-num-groups", moe.router_groups);
            args.pair("--moe-router-group-topk", moe.router_group_topk);
        }
        router_args(&moe, &mut args);
        args.pair("--expert-model-parallel-size", c.ep);
        args.pair("--expert-tensor-parallel-size", c.etp);
        let (dispatcher, backend) = c.dispatcher.megatron_type_and_backend();
        args.pair("--moe-token-dispatcher-type", dispatcher);
        if let Some(backend) = backend {
            // Megatron-Core 0.15's successor to `--moe-enable-deepep`.
            args.pair("--moe-flex-dispatcher-backend", backend);
        }
        // The local experts' GEMMs run grouped, as paratune prices them.
        args.flag("--moe-grouped-gemm");
    }
    if layout {
        args.pair(
            "--pipeline-model-parallel-layout",
            pipeline_layout(model, c),
        );
    } else if accounted && c.virtual_stages > 1 {
        args.flag("--account-for-embedding-in-pipeline-split");
        args.flag("--account-for-loss-in-pipeline-split");
    } else {
        if let Some(first) = c.first_stage_layers {
            args.pair("--decoder-first-pipeline-num-layers", first);
        }
        if let Some(last) = c.last_stage_layers {
            args.pair("--decoder-last-pipeline-num-layers", last);
        }
    }
    if c.schedule == ScheduleKind::Interleaved {
        // A layout gives the chunks itself (Megatron-LM takes no count
        // beside it). With another uneven split chunks differ in size, so
        // Megatron-LM takes the chunk count instead of the layers per chunk.
        if layout {
            // nothing to add
        } else if c.uneven() {
            args.pair("--num-virtual-stages-per-pipeline-rank", c.virtual_stages);
        } else {
            args.pair(
                "--num-layers-per-virtual-pipeline-stage",
                model.layers / (c.pp * c.virtual_stages),
            );
        }
        let m = c.micro_batches(job.global_batch);
        if let Some(group) = c.microbatch_group(m)
            && group != c.pp
        {
            args.pair("--microbatch-group-size-per-virtual-pipeline-stage", group);
        }
    }
    if c.overlap_grad_reduce {
        args.flag("--overlap-grad-reduce");
    }
    if c.overlap_param_gather {
        args.flag("--overlap-param-gather");
    }
    if c.fp8_param_gather {
        args.flag(match c.precision {
            Precision::Nvfp4 => "--fp4-param-gather",
            _ => "--fp8-param-gather",
        });
    }
    if c.cpu_offload_layers > 0 {
        // Sets `cpu_offloading` itself (activations, not weights).
        args.pair("--cpu-offloading-num-layers", c.cpu_offload_layers);
    }
    match c.cross_entropy_fusion {
        CrossEntropyFusion::Off => {}
        // `native` is `--cross-entropy-fusion-impl`'s default.
        CrossEntropyFusion::Native => args.flag("--cross-entropy-loss-fusion"),
        CrossEntropyFusion::Te => {
            args.flag("--cross-entropy-loss-fusion");
            args.pair("--cross-entropy-fusion-impl", "te");
        }
    }
    match c.wgrad_deferral {
        WgradDeferral::Off => {}
        // `--wgrad-deferral-limit` 0, its default, defers every micro-batch.
        WgradDeferral::All => args.flag("--defer-embedding-wgrad-compute"),
        WgradDeferral::Limit(n) => {
            args.flag("--defer-embedding-wgrad-compute");
            args.pair("--wgrad-deferral-limit", n);
        }
    }
    if c.grad_reduce == GradReduce::Bf16 {
        // Sets `accumulate_allreduce_grads_in_fp32` off for bf16 training.
        args.flag("--grad-reduce-in-bf16");
    }
    if c.ep_comm_overlap {
        // Megatron-Core 0.14's batch-level overlap; splitting out the
        // weight gradients gives the paired pass more compute to hide under.
        args.flag("--overlap-moe-expert-parallel-comm");
        args.flag("--delay-wgrad-compute");
    }
    if c.tp_comm_overlap {
        args.flag("--tp-comm-overlap");
    }
    match c.cuda_graphs {
        CudaGraphs::Off => {}
        // Transformer Engine's make_graphed_callables, per layer: the whole
        // layer of a dense model; of an MoE layer the attention, router and
        // preprocess, as NVIDIA's MoE recipes scope it, since Megatron-LM
        // captures a dropless MoE module whole only sync-free
        // (`validate_moe_cuda_graph_support`).
        CudaGraphs::Layers => {
            args.pair("--cuda-graph-impl", "transformer_engine");
            if job.model.moe.is_some() {
                args.values(
                    "--cuda-graph-scope",
                    ["attn", "moe_router", "moe_preprocess"],
                );
            }
        }
        CudaGraphs::FullIteration => {
            args.pair("--cuda-graph-impl", "full_iteration");
            if job.model.moe.is_some() {
                // Sync-free experts (the rules hold the dispatcher to
                // HybridEP), their activations paged: Megatron-LM's
                // docs/user-guide/features/paged_stash.md.
                args.flag("--use-transformer-engine-op-fuser");
                args.pair(
                    "--moe-expert-rank-capacity-factor",
                    EXPERT_RANK_CAPACITY_FACTOR,
                );
                args.flag("--moe-paged-stash");
            }
        }
    }
    if c.sequence_parallel {
        args.flag("--sequence-parallel");
    }
    match c.optimizer_sharding {
        OptimizerSharding::None => {}
        OptimizerSharding::OptimizerStates => args.flag("--use-distributed-optimizer"),
        // Megatron-FSDP: weights, gradients and optimizer states sharded,
        // with the flags its user guide requires
        // (docs/discussions/megatron-fsdp-user-guide); `validate_args`
        // asserts the checkpoint format, and the launch leaves
        // CUDA_DEVICE_MAX_CONNECTIONS above 1 as it asserts too.
        OptimizerSharding::Full => {
            args.flag("--use-megatron-fsdp");
            args.pair("--data-parallel-sharding-strategy", "optim_grads_params");
            args.flag("--no-gradient-accumulation-fusion");
            args.flag("--use-distributed-optimizer");
            args.pair("--ckpt-format", "fsdp_dtensor");
        }
    }
    args.pair("--micro-batch-size", c.micro_batch);
    args.pair("--global-batch-size", job.global_batch);

    args.pair("--num-layers", model.layers);
    args.pair("--hidden-size", model.hidden);
    args.pair("--num-attention-heads", model.heads);
    if let Some(mla) = model.mla {
        args.flag("--multi-latent-attention");
        if mla.q_lora_rank > 0 {
            args.pair("--q-lora-rank", mla.q_lora_rank);
        }
        args.pair("--kv-lora-rank", mla.kv_lora_rank);
        args.pair("--qk-head-dim", mla.qk_head_dim);
        args.pair("--qk-pos-emb-head-dim", mla.qk_pos_head_dim);
        args.pair("--v-head-dim", mla.v_head_dim);
    } else if model.head_dim_override.is_some() {
        args.pair("--kv-channels", model.head_dim());
    }
    if model.kv_heads < model.heads {
        args.flag("--group-query-attention");
        args.pair("--num-query-groups", model.kv_heads);
    }
    args.pair("--ffn-hidden-size", model.ffn_hidden);
    match (model.gated_mlp, model.quick_geglu) {
        // Megatron-LM asserts the two apart.
        (true, Some(glu)) => {
            args.flag("--quick-geglu");
            if glu.clamps() {
                args.pair("--activation-func-clamp-value", glu.clamp);
            }
            if glu.linear_offset != 0.0 {
                args.pair("--glu-linear-offset", glu.linear_offset);
            }
        }
        (true, None) => args.flag("--swiglu"),
        (false, _) => {}
    }
    args.pair("--seq-length", model.seq_len);
    args.pair("--max-position-embeddings", model.seq_len);
    if model.no_positions {
        args.pair("--position-embedding-type", "none");
    } else if !model.learned_positions {
        args.pair("--position-embedding-type", "rope");
        rotary_args(model, &mut args);
    }
    args.pair("--norm-epsilon", model.norm_epsilon);
    if !model.tied_embeddings {
        args.flag("--untie-embeddings-and-output-weights");
    }
    if model.rms_norm {
        args.pair("--normalization", "RMSNorm");
    }
    if !model.linear_bias {
        args.flag("--disable-bias-linear");
    }
    if model.qk_layernorm {
        args.flag("--qk-layernorm");
    }
    // Megatron-LM drops out 0.1 of both unless told (`--attention-dropout`,
    // `--hidden-dropout`); a model planned without dropout keeps no masks.
    if !model.dropout {
        args.pair("--attention-dropout", 0);
        args.pair("--hidden-dropout", 0);
    }

    if model.attention_sinks {
        args.pair("--softmax-type", "learnable");
    }
    args.pair(
        "--attention-backend",
        match (c.attention, model.attention_sinks) {
            // Transformer Engine runs learnable softmax offsets in cuDNN's
            // fused attention (TE 2.8, cuDNN 9.13.1+) and disables
            // FlashAttention for them.
            (AttentionKind::Flash, true) => "fused",
            (AttentionKind::Flash, false) => "flash",
            (AttentionKind::Standard, _) => "unfused",
        },
    );
    match c.recompute {
        Recompute::SelectiveOp | Recompute::SelectiveLayer => {
            return Err(ExportError::Unsupported {
                engine: ENGINE,
                feature: format!("torchtitan's {} checkpointing", c.recompute.name()),
                hint: "Megatron-LM recomputes the attention core (selective) or whole layers \
                       (full); search again with --recompute selective or full, or export to \
                       torchtitan"
                    .into(),
            });
        }
        Recompute::None => {}
        Recompute::Selective => {
            args.pair("--recompute-granularity", "selective");
            if !c.recompute_modules.is_default() {
                args.values("--recompute-modules", c.recompute_modules.names());
            }
        }
        Recompute::Full => {
            args.pair("--recompute-granularity", "full");
            args.pair("--recompute-method", "uniform");
            args.pair("--recompute-num-layers", 1);
        }
    }
    args.flag("--bf16");
    if c.precision == Precision::Fp8 {
        // Transformer Engine's E4M3 forward / E5M2 backward, scaled as the
        // plan's recipe says (Megatron-LM's own default is `delayed`).
        args.pair("--fp8-format", "hybrid");
        args.pair("--fp8-recipe", job.fp8_recipe().name());
    }
    if c.precision == Precision::Nvfp4 {
        // Transformer Engine's NVFP4BlockScaling on every layer: Megatron-
        // LM keeps none in bf16 unless --first-last-layers-bf16 asks, as
        // NVIDIA's NVFP4 recipes leave it (`bf16_with_nvfp4_mixed`).
        args.pair("--fp4-format", "e2m1");
        args.pair("--fp4-recipe", "nvfp4");
    }
    Ok(args.0)
}

/// Megatron-LM's `--pipeline-model-parallel-layout` for `c`'s split: its
/// pp x v model chunks in Megatron's order (chunk j on stage j % pp, the
/// stage's (j / pp)-th), each a run of decoder layers `t`, the embedding `E`
/// first in the first chunk and the prediction modules `m` and the loss `L`
/// last in the last. A stage's layers fill its chunks as evenly as they
/// divide, the first stage's short chunks first and the others' last; runs
/// of equal chunks are written `(tt|)*n`. Example: DeepSeek-V3 (61 layers, one
/// prediction module) at pp 8 x v 4 with end stages of 7 and 6 layers is
/// `Et|(tt|)*22t|(tt|)*7tmL` (the last stage's chunks hold 2, 2, 1 and 1).
pub fn pipeline_layout(
    model: &crate::model::ModelSpec,
    c: &crate::config::ParallelConfig,
) -> String {
    let (pp, v) = (c.pp, c.virtual_stages.max(1));
    let sizes: Vec<Vec<u64>> = (0..pp)
        .map(|stage| {
            let n = c.stage_layers(model.layers, stage);
            let (q, r) = (n / v, n % v);
            let mut sizes: Vec<u64> = (0..v).map(|j| q + u64::from(j < r)).collect();
            if stage == 0 {
                sizes.reverse(); // the embedding's chunk holds fewer
            }
            sizes
        })
        .collect();
    let chunks: Vec<String> = (0..pp * v)
        .map(|j| {
            let mut chunk = String::new();
            if j == 0 {
                chunk.push('E');
            }
            chunk.push_str(&"t".repeat(sizes[(j % pp) as usize][(j / pp) as usize] as usize));
            if j == pp * v - 1 {
                chunk.push_str(&"m".repeat(model.mtp_layers as usize));
                chunk.push('L');
            }
            chunk
        })
        .collect();
    let (last, body) = chunks.split_last().expect("pp x v is at least 1");
    let mut out = String::new();
    let mut i = 0;
    while i < body.len() {
        let run = body[i..].iter().take_while(|c| **c == body[i]).count();
        if run >= 3 {
            out.push_str(&format!("({}|)*{run}", body[i]));
        } else {
            for chunk in &body[i..i + run] {
                out.push_str(chunk);
                out.push('|');
            }
        }
        i += run;
    }
    out.push_str(last);
    out
}

/// `--moe-layer-freq`'s list form, one entry per layer (1: experts, 0: a
/// dense MLP), which Megatron-LM reads as a Python expression:
/// `([0]*3+[1]*58)` for DeepSeek-V3's three dense layers first.
fn moe_layer_pattern(model: &crate::model::ModelSpec) -> String {
    let Some(moe) = model.moe else {
        return String::new();
    };
    if moe.layer_freq <= 1 {
        let dense = moe.dense_layers.min(model.layers);
        return format!("([0]*{dense}+[1]*{})", model.layers - dense);
    }
    let flags: Vec<&str> = (0..model.layers)
        .map(|i| if moe.is_moe_layer(i) { "1" } else { "0" })
        .collect();
    format!("[{}]", flags.join(","))
}

/// The router's score as Megatron-Core computes it: a sigmoid, its expert
/// bias and the weights' scaling where the model has them (DeepSeek-V3);
/// with one expert per token, a softmax over all experts before the choice
/// (`--moe-router-pre-softmax`), which Megatron-Core requires then: after
/// it, the one weight would always be 1.
fn router_args(moe: &MoeSpec, args: &mut Args) {
    match moe.router_score {
        RouterScore::Sigmoid => args.pair("--moe-router-score-function", "sigmoid"),
        RouterScore::Softmax if moe.topk == 1 => args.flag("--moe-router-pre-softmax"),
        RouterScore::Softmax => {}
    }
    if moe.router_expert_bias {
        args.flag("--moe-router-enable-expert-bias");
    }
    if moe.router_topk_scaling != 1.0 {
        args.pair("--moe-router-topk-scaling-factor", moe.router_topk_scaling);
    }
    if moe.router_dtype != RouterDtype::Model {
        args.pair("--moe-router-dtype", moe.router_dtype.name());
    }
}

/// The rotary base and scaling as `pretrain_gpt.py` takes them: Llama
/// 3.1's scaling by `--use-rope-scaling`; YaRN under multi-latent attention
/// (MLATransformerConfig's rope_type "yarn", its default) by its factor and
/// mscales, and plain rotary there by `--rope-type rope`. What it cannot
/// take, [`megatron_model_notes`] names.
fn rotary_args(model: &ModelSpec, args: &mut Args) {
    args.pair("--rotary-base", model.rotary_base);
    match (model.rope_scaling, model.mla.is_some()) {
        (Some(RopeScaling::Llama3 { factor }), false) => {
            args.flag("--use-rope-scaling");
            args.pair("--rope-scaling-factor", factor);
        }
        (
            Some(RopeScaling::Yarn {
                factor,
                mscale,
                mscale_all_dim,
                ..
            }),
            true,
        ) => {
            args.pair("--rotary-scaling-factor", factor);
            args.pair("--mscale", mscale);
            args.pair("--mscale-all-dim", mscale_all_dim);
        }
        (None | Some(RopeScaling::Llama3 { .. }), true) => args.pair("--rope-type", "rope"),
        (None | Some(RopeScaling::Yarn { .. }), false) => {}
    }
}

/// What of the model Megatron-LM's `pretrain_gpt.py` has no option for, so
/// that the exported arguments train it otherwise: each a line saying what
/// they do instead. Empty for every model but those with such positions.
pub fn megatron_model_notes(model: &ModelSpec) -> Vec<String> {
    if !model.is_rotary() {
        return Vec::new();
    }
    match (model.rope_scaling, model.mla.is_some()) {
        // GPTModel reads YaRN's numbers from config attributes
        // (yarn_rotary_scaling_factor, ...) that no option sets outside
        // multi-latent attention; Megatron-Bridge's providers set them.
        (
            Some(RopeScaling::Yarn {
                factor,
                original_positions,
                ..
            }),
            false,
        ) => vec![format!(
            "pretrain_gpt.py has no option for YaRN outside multi-latent attention: these \
             arguments train unscaled rotary positions; for YaRN (factor {factor}, from \
             {original_positions} positions) set position_embedding_type \"yarn\", \
             yarn_rotary_scaling_factor and yarn_original_max_position_embeddings in a \
             Megatron-Bridge provider"
        )],
        (
            Some(RopeScaling::Yarn {
                original_positions, ..
            }),
            true,
        ) if original_positions != MLA_YARN_ORIGINAL_POSITIONS => {
            vec![format!(
                "pretrain_gpt.py has no option for YaRN's original positions: multi-latent \
                 attention scales from {MLA_YARN_ORIGINAL_POSITIONS}, not this model's \
                 {original_positions}"
            )]
        }
        (Some(RopeScaling::Llama3 { .. }), true) => vec![
            "multi-latent attention has no Llama 3.1 rotary scaling in Megatron-LM: these \
             arguments train unscaled rotary positions"
                .to_string(),
        ],
        _ => Vec::new(),
    }
}

/// The positions MLATransformerConfig's YaRN scales from
/// (`original_max_position_embeddings`, which no option sets).
const MLA_YARN_ORIGINAL_POSITIONS: u64 = 4096;

/// [`megatron_args`] as one shell-quoted line, each flag with its value,
/// flags separated by ` \` and a newline indented four spaces, ready to paste
/// after `pretrain_gpt.py`.
pub fn megatron_command_line(job: &LaunchJob) -> Result<String, ExportError> {
    let args = megatron_args(job)?;
    let mut groups: Vec<Vec<String>> = Vec::new();
    for arg in &args {
        let quoted = shell_quote(arg);
        match groups.last_mut() {
            Some(group) if !arg.starts_with("--") => group.push(quoted),
            _ => groups.push(vec![quoted]),
        }
    }
    Ok(groups
        .iter()
        .map(|group| group.join(" "))
        .collect::<Vec<_>>()
        .join(" \\\n    "))
}

#[derive(Default)]
struct Args(Vec<String>);

impl Args {
    fn flag(&mut self, name: &str) {
        self.0.push(name.to_string());
    }

    fn pair(&mut self, name: &str, value: impl ToString) {
        self.0.push(name.to_string());
        self.0.push(value.to_string());
    }

    /// A flag taking several values, each its own argument.
    fn values(&mut self, name: &str, values: impl IntoIterator<Item = impl ToString>) {
        self.0.push(name.to_string());
        self.0.extend(values.into_iter().map(|v| v.to_string()));
    }
}
