//! Turning command-line arguments into library values, with errors that
//! name the flag and the fix.

use super::args::{ClusterArgs, CommonArgs, ModelArgs, SpaceArgs};
use super::flags::with_flags;
use anyhow::{Result, anyhow, bail};
use paratune::choice::Choice;
use paratune::cluster::{NodeGroup, builtin_gpu_names, builtin_node, load_cluster_file};
use paratune::coefficients::{
    CostModel, builtin_cost_model, builtin_cost_model_names, default_cost_model, parse_cost_model,
};
use paratune::config::{
    CpComm, CrossEntropyFusion, CudaGraphs, Dispatcher, Engine, Fp8Recipe, GradReduce,
    OptimizerSharding, ParallelConfig, Precision, Recompute, RecomputeModules, Rule, ScheduleKind,
    StageOrder, SyncMethod, WgradDeferral,
};
use paratune::evaluate::{CostModelChoice, PerGpu};
use paratune::model::{
    AttentionKind, ModelSpec, RouterDtype, RouterScore, builtin_model, builtin_model_names,
    load_model_file,
};
use paratune::runs::{MemoryRank, RowDefaults, Run, RunTable, parse_switch};
use paratune::search::{Job, SearchSpace};
use paratune::suggest::did_you_mean;
use std::path::Path;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// `--model` names a file rather than a catalogue model.
fn looks_like_path(name: &str) -> bool {
    name.ends_with(".toml") || name.contains('/') || name.contains('\\') || Path::new(name).exists()
}

pub fn model(args: &ModelArgs) -> Result<ModelSpec> {
    let mut model = match &args.model {
        Some(name) if looks_like_path(name) => load_model_file(Path::new(name))?,
        Some(name) => builtin_model(name).ok_or_else(|| {
            anyhow!(
                "--model: unknown model `{name}`{} (`paratune models` lists them; a model TOML file also works)",
                did_you_mean(name, &builtin_model_names())
            )
        })?,
        None => {
            let (Some(hidden), Some(heads), Some(layers)) = (args.hidden, args.heads, args.layers)
            else {
                bail!(
                    "no model: give --model NAME (see `paratune models`) or the dimensions --hidden, --heads and --layers"
                );
            };
            let name = format!("gpt-h{hidden}-L{layers}");
            ModelSpec::gpt(&name, hidden, heads, layers, 51200, 2048)
        }
    };
    if let Some(hidden) = args.hidden {
        if args.ffn_hidden.is_none() && args.model.is_some() {
            model.ffn_hidden = model.ffn_hidden * hidden / model.hidden;
        }
        model.hidden = hidden;
    }
    if let Some(heads) = args.heads {
        if model.kv_heads == model.heads {
            model.kv_heads = heads;
        }
        model.heads = heads;
    }
    let overrides = [
        (args.kv_heads, &mut model.kv_heads),
        (args.ffn_hidden, &mut model.ffn_hidden),
        (args.layers, &mut model.layers),
        (args.vocab, &mut model.vocab),
        (args.seq_len, &mut model.seq_len),
    ];
    for (value, field) in overrides {
        if let Some(v) = value {
            *field = v;
        }
    }
    if let Some(text) = &args.gated_mlp {
        model.gated_mlp = parse_switch("--gated-mlp", text).map_err(|e| anyhow!(e))?;
    }
    if let Some(text) = &args.dropout {
        model.dropout = parse_switch("--dropout", text).map_err(|e| anyhow!(e))?;
    }
    if let Some(text) = &args.tied_embeddings {
        model.tied_embeddings = parse_switch("--tied-embeddings", text).map_err(|e| anyhow!(e))?;
    }
    if let Some(width) = args.head_dim {
        model.head_dim_override = Some(width);
    }
    apply_moe_flags(args, &mut model)?;
    apply_mla_flags(args, &mut model)?;
    apply_window_flags(args, &mut model)?;
    apply_quick_geglu_flags(args, &mut model)?;
    let switches = [
        (
            "--attention-sinks",
            &args.attention_sinks,
            &mut model.attention_sinks,
        ),
        ("--rms-norm", &args.rms_norm, &mut model.rms_norm),
        ("--linear-bias", &args.linear_bias, &mut model.linear_bias),
        (
            "--qk-layernorm",
            &args.qk_layernorm,
            &mut model.qk_layernorm,
        ),
    ];
    for (flag, text, field) in switches {
        if let Some(text) = text {
            *field = parse_switch(flag, text).map_err(|e| anyhow!(e))?;
        }
    }
    if let Some(mtp) = args.mtp_layers {
        model.mtp_layers = mtp;
    }
    if let Some(base) = args.rotary_base {
        model.rotary_base = base;
    }
    if let Some(epsilon) = args.norm_epsilon {
        model.norm_epsilon = epsilon;
    }
    model.check().map_err(|e| anyhow!(with_flags(&e)))?;
    Ok(model)
}

/// The mixture-of-experts flags: `--experts` makes the model one (with
/// Megatron-LM's defaults for the rest), the others change the model's
/// experts and need it to have some.
/// gpt-oss's activation flags: `--quick-geglu on` makes the gated MLP a
/// quick-GeGLU (no clamp, no offset unless given), `off` a SwiGLU again;
/// `--activation-clamp` and `--glu-linear-offset` need one.
fn apply_quick_geglu_flags(args: &ModelArgs, model: &mut ModelSpec) -> Result<()> {
    if let Some(text) = &args.quick_geglu {
        let on = parse_switch("--quick-geglu", text).map_err(|e| anyhow!(e))?;
        model.quick_geglu = match (on, model.quick_geglu) {
            (false, _) => None,
            (true, Some(glu)) => Some(glu),
            (true, None) => Some(paratune::model::QuickGeglu {
                clamp: 0.0,
                linear_offset: 0.0,
            }),
        };
    }
    let given = [
        ("--activation-clamp", args.activation_clamp),
        ("--glu-linear-offset", args.glu_linear_offset),
    ];
    let Some(glu) = model.quick_geglu.as_mut() else {
        if let Some((flag, _)) = given.iter().find(|(_, v)| v.is_some()) {
            bail!(
                "{flag} needs gpt-oss's activation, and model `{}` has none: add --quick-geglu on or leave {flag} out",
                model.name
            );
        }
        return Ok(());
    };
    if let Some(clamp) = args.activation_clamp {
        glu.clamp = clamp;
    }
    if let Some(offset) = args.glu_linear_offset {
        glu.linear_offset = offset;
    }
    Ok(())
}

/// The sliding-window flags: `--sliding-window N` windows the attention (0
/// takes the model's window away); `--window-attn-skip-freq` needs one.
fn apply_window_flags(args: &ModelArgs, model: &mut ModelSpec) -> Result<()> {
    match args.sliding_window {
        None => {}
        Some(0) => model.window = None,
        Some(tokens) => {
            let full_every = model.window.map_or(0, |w| w.full_every);
            model.window = Some(paratune::model::WindowSpec { tokens, full_every });
        }
    }
    if let Some(full_every) = args.window_attn_skip_freq {
        let Some(window) = model.window.as_mut() else {
            bail!(
                "--window-attn-skip-freq needs a windowed attention, and model `{}` has none: add --sliding-window N or leave it out",
                model.name
            );
        };
        window.full_every = full_every;
    }
    Ok(())
}

fn apply_moe_flags(args: &ModelArgs, model: &mut ModelSpec) -> Result<()> {
    if let Some(experts) = args.experts {
        model.set_experts(experts);
    }
    let given = [
        ("--moe-topk", args.moe_topk.is_some()),
        ("--moe-ffn-hidden", args.moe_ffn_hidden.is_some()),
        ("--shared-experts", args.shared_experts.is_some()),
        ("--dense-layers", args.dense_layers.is_some()),
        ("--moe-layer-freq", args.moe_layer_freq.is_some()),
        (
            "--moe-router-num-groups",
            args.moe_router_num_groups.is_some(),
        ),
        (
            "--moe-router-group-topk",
            args.moe_router_group_topk.is_some(),
        ),
        (
            "--moe-router-score-function",
            args.moe_router_score_function.is_some(),
        ),
        (
            "--moe-router-topk-scaling-factor",
            args.moe_router_topk_scaling_factor.is_some(),
        ),
        (
            "--moe-router-enable-expert-bias",
            args.moe_router_enable_expert_bias.is_some(),
        ),
        ("--moe-router-dtype", args.moe_router_dtype.is_some()),
    ];
    let Some(moe) = model.moe.as_mut() else {
        if let Some((flag, _)) = given.iter().find(|(_, on)| *on) {
            bail!(
                "{flag} needs a mixture of experts, and model `{}` is dense: add --experts N (routed experts per MoE layer) or leave {flag} out",
                model.name
            );
        }
        return Ok(());
    };
    if let Some(topk) = args.moe_topk {
        moe.topk = topk;
    }
    if let Some(width) = args.moe_ffn_hidden {
        moe.ffn_hidden = width;
    }
    if let Some(shared) = args.shared_experts {
        moe.shared_ffn_hidden = shared * moe.ffn_hidden;
    }
    if let Some(dense) = args.dense_layers {
        moe.dense_layers = dense;
    }
    if let Some(freq) = args.moe_layer_freq {
        moe.layer_freq = freq;
    }
    if let Some(groups) = args.moe_router_num_groups {
        moe.set_router_groups(groups);
    }
    if let Some(chosen) = args.moe_router_group_topk {
        moe.router_group_topk = chosen;
    }
    if let Some(text) = &args.moe_router_score_function {
        moe.router_score = RouterScore::named(text).ok_or_else(|| {
            anyhow!(
                "--moe-router-score-function {text} is not a router score; give softmax or sigmoid"
            )
        })?;
    }
    if let Some(scaling) = args.moe_router_topk_scaling_factor {
        moe.router_topk_scaling = scaling;
    }
    if let Some(text) = &args.moe_router_dtype {
        moe.router_dtype = RouterDtype::named(text).ok_or_else(|| {
            anyhow!(
                "--moe-router-dtype {text} is not a router precision; give fp32 or model (an fp64 router is not priced)"
            )
        })?;
    }
    if let Some(text) = &args.moe_router_enable_expert_bias {
        moe.router_expert_bias =
            parse_switch("--moe-router-enable-expert-bias", text).map_err(|e| anyhow!(e))?;
    }
    Ok(())
}

/// The multi-latent attention flags: `--kv-lora-rank` turns it on (with
/// Megatron-LM's defaults for the rest); the others need it.
fn apply_mla_flags(args: &ModelArgs, model: &mut ModelSpec) -> Result<()> {
    if let Some(rank) = args.kv_lora_rank {
        model.set_kv_lora_rank(rank);
    }
    let given = [
        ("--q-lora-rank", args.q_lora_rank.is_some()),
        ("--qk-head-dim", args.qk_head_dim.is_some()),
        ("--qk-pos-head-dim", args.qk_pos_head_dim.is_some()),
        ("--v-head-dim", args.v_head_dim.is_some()),
    ];
    let Some(mla) = model.mla.as_mut() else {
        if let Some((flag, _)) = given.iter().find(|(_, on)| *on) {
            bail!(
                "{flag} needs multi-latent attention, and model `{}` has none: add --kv-lora-rank N or leave {flag} out",
                model.name
            );
        }
        return Ok(());
    };
    for (value, field) in [
        (args.q_lora_rank, &mut mla.q_lora_rank),
        (args.qk_head_dim, &mut mla.qk_head_dim),
        (args.qk_pos_head_dim, &mut mla.qk_pos_head_dim),
        (args.v_head_dim, &mut mla.v_head_dim),
    ] {
        if let Some(v) = value {
            *field = v;
        }
    }
    Ok(())
}

/// The node group and the number of GPUs the job uses.
pub fn nodes(args: &ClusterArgs) -> Result<(NodeGroup, u64)> {
    if let Some(dir) = &args.cluster_from_profile {
        return measured_nodes(args, dir);
    }
    let mut group = match (&args.cluster, &args.gpu) {
        (Some(path), _) => {
            let cluster = load_cluster_file(path)?;
            cluster
                .homogeneous()
                .map_err(|e| anyhow!("{}: {e}", path.display()))?
                .clone()
        }
        (None, Some(gpu)) => builtin_node(gpu, 1).ok_or_else(|| {
            anyhow!(
                "--gpu: unknown GPU `{gpu}`{} (`paratune gpus` lists them; --cluster FILE describes others)",
                did_you_mean(gpu, &builtin_gpu_names())
            )
        })?,
        (None, None) => bail!("no GPU: give --gpu NAME (see `paratune gpus`) or --cluster FILE"),
    };
    if let Some(nodes) = args.nodes {
        if nodes == 0 {
            bail!("--nodes must be at least 1");
        }
        group.nodes = nodes;
    }
    if let Some(per_node) = args.gpus_per_node {
        if per_node == 0 {
            bail!("--gpus-per-node must be at least 1");
        }
        group.gpus_per_node = per_node;
    }
    if let Some(bw) = args.intra_node_bw {
        group.intra_node_bw = bw;
    }
    if let Some(bw) = args.inter_node_bw {
        group.inter_node_bw = bw;
    }
    let gpus = args.gpus.unwrap_or(group.nodes * group.gpus_per_node);
    let node = group.gpus_per_node;
    if gpus > node && !gpus.is_multiple_of(node) {
        // A job may use part of each node (64 of a GB200 NVL72 rack's 72
        // GPUs): as many per node as divide the job.
        let part = (1..node)
            .rev()
            .find(|d| gpus.is_multiple_of(*d))
            .unwrap_or(1);
        bail!(
            "--gpus {gpus} is not a multiple of the node size {node} (--gpus-per-node); use whole nodes, e.g. --gpus {} or --gpus {}, or {part} GPUs of each node with --gpus-per-node {part}",
            gpus / node * node,
            gpus.div_ceil(node) * node
        );
    }
    if args.gpus.is_some() && args.nodes.is_none() {
        group.nodes = group.nodes.max(gpus.div_ceil(group.gpus_per_node));
    }
    Ok((group, gpus))
}

/// `--cluster-from-profile DIR`: the node a profile measured, as many of
/// them as `--nodes` says, `--gpus-per-node` devices each.
fn measured_nodes(args: &ClusterArgs, dir: &std::path::Path) -> Result<(NodeGroup, u64)> {
    let Some(gpus_per_node) = args.gpus_per_node else {
        bail!("--cluster-from-profile needs --gpus-per-node: how many devices (ranks) a node has");
    };
    let shown = dir.display().to_string();
    let profile =
        paratune::profile::read_profile(dir).map_err(|e| anyhow!("--cluster-from-profile: {e}"))?;
    let shape = paratune::profile::MeasuredNodeShape {
        nodes: args.nodes.unwrap_or(1),
        gpus_per_node,
        intra_node_bw: args.intra_node_bw,
        inter_node_bw: args.inter_node_bw,
    };
    let group = paratune::profile::measured_node(&profile, &shown, shape)
        .map_err(|e| anyhow!("--cluster-from-profile: {e}"))?;
    let gpus = args.gpus.unwrap_or(group.nodes * group.gpus_per_node);
    if gpus != group.nodes * group.gpus_per_node {
        bail!(
            "--gpus {gpus}: a measured cluster is used whole ({} x {} devices); drop --gpus or change --nodes",
            group.nodes,
            group.gpus_per_node
        );
    }
    Ok((group, gpus))
}

/// The flags' nodes, or, without `--gpu` and `--cluster`, the nodes of the
/// first GPU a run table's `gpu` column names.
pub fn nodes_or_table_gpu(args: &ClusterArgs, table: &RunTable) -> Result<(NodeGroup, u64)> {
    if args.gpu.is_none()
        && args.cluster.is_none()
        && let Some((row, gpu)) =
            (0..table.rows.len()).find_map(|i| table.cell(i, "gpu").map(|gpu| (i, gpu)))
    {
        let mut with_gpu = args.clone();
        with_gpu.gpu = Some(gpu.to_string());
        // The cell named the GPU, not a flag: say where it is.
        return nodes(&with_gpu).map_err(|e| {
            let flag_said = e.to_string();
            let reason = flag_said.strip_prefix("--gpu: ").unwrap_or(&flag_said);
            anyhow!(
                "{}: line {}: column `gpu`: {reason}",
                table.path,
                table.line(row)
            )
        });
    }
    nodes(args)
}

/// The nodes and cost model of each GPU a run table names: `--cost-model`
/// for all of them when given, else each GPU's default.
pub fn per_gpu(runs: &[Run], base: &NodeGroup, cost: &CostModel, common: &CommonArgs) -> PerGpu {
    let choice = match common.cost_model {
        Some(_) => CostModelChoice::Given,
        None => CostModelChoice::PerGpu,
    };
    PerGpu::new(runs, base, cost, choice)
}

pub fn job(common: &CommonArgs) -> Result<Job> {
    let model = model(&common.model)?;
    let (nodes, gpus) = nodes(&common.cluster)?;
    let global_batch = common
        .global_batch
        .ok_or_else(|| anyhow!("--global-batch is required (sequences per iteration)"))?;
    if let Some(limit) = common.cluster.memory_limit {
        let capacity = nodes.gpu.memory_bytes;
        if limit.0 > capacity {
            bail!(
                "--memory-limit ({:.1} GiB) is more than the {}'s {:.1} GiB; it can only lower the memory budget",
                limit.0 / GIB,
                nodes.gpu.name,
                capacity / GIB
            );
        }
    }
    let job = Job {
        model,
        global_batch,
        gpus,
        nodes,
        memory_limit: common.cluster.memory_limit.map(|b| b.0),
        profile: None,
    };
    job.check()
        .map_err(|e| anyhow!("{e} (--nodes, --gpus-per-node, --gpus, --global-batch)"))?;
    Ok(job)
}

/// The file `--cost-model` names, `None` where it names a shipped model
/// (which [`cost_model`] takes first) or nothing.
pub fn cost_model_file(name: Option<&str>) -> Option<String> {
    name.filter(|n| builtin_cost_model(n).is_none())
        .map(str::to_string)
}

pub fn cost_model(name: Option<&str>, gpu_name: &str) -> Result<CostModel> {
    match name {
        None => Ok(default_cost_model(gpu_name)),
        Some(name) => {
            if let Some(model) = builtin_cost_model(name) {
                return Ok(model);
            }
            if !Path::new(name).exists() {
                bail!(
                    "--cost-model: `{name}` is neither a file nor a built-in cost model{}",
                    did_you_mean(name, &builtin_cost_model_names())
                );
            }
            cost_model_from_file(name).map_err(|e| anyhow!("--cost-model: {e}"))
        }
    }
}

/// Larger than any cost-model file (the shipped ones are under 40 KB).
const MAX_COST_MODEL_BYTES: u64 = 1 << 20;

/// The cost model in the file `path`, which must be a regular file of at
/// most [`MAX_COST_MODEL_BYTES`] (a plan from someone else names one too:
/// no device, pipe or endless stream is read), with the warning of
/// [`CostModel::at_prior_note`] where it lacks coefficients.
pub fn cost_model_from_file(path: &str) -> Result<CostModel> {
    let unreadable = |e: std::io::Error| {
        anyhow!("cannot read cost model {path}: {e}; give a cost-model TOML file")
    };
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let metadata = file.metadata().map_err(unreadable)?;
    if !metadata.is_file() || metadata.len() > MAX_COST_MODEL_BYTES {
        bail!(
            "cost model {path} is not a cost-model TOML file (a regular file of at most {} KiB)",
            MAX_COST_MODEL_BYTES >> 10
        );
    }
    let mut text = String::new();
    // Read here rather than with `load_cost_model`, whose read error
    // repeats its cause when printed as a chain.
    std::io::Read::read_to_string(
        &mut std::io::Read::take(file, MAX_COST_MODEL_BYTES),
        &mut text,
    )
    .map_err(unreadable)?;
    let model = parse_cost_model(&text, path)?;
    if let Some(note) = model.at_prior_note(path) {
        eprintln!("warning: {note}");
    }
    Ok(model)
}

fn choices<T: Choice>(flag: &str, values: &Option<Vec<String>>) -> Result<Option<Vec<T>>> {
    parsed(flag, values, T::parse)
}

/// Each of a list flag's values read by `parse`, whose error names `flag`.
fn parsed<T>(
    flag: &str,
    values: &Option<Vec<String>>,
    parse: impl Fn(&str, &str) -> Result<T, String>,
) -> Result<Option<Vec<T>>> {
    values
        .as_ref()
        .map(|texts| {
            texts
                .iter()
                .map(|t| parse(flag, t).map_err(|e| anyhow!(e)))
                .collect()
        })
        .transpose()
}

fn switches(flag: &str, values: &Option<Vec<String>>) -> Result<Option<Vec<bool>>> {
    values
        .as_ref()
        .map(|texts| switch_list(flag, texts))
        .transpose()
}

/// `on`/`off` values of a comma-separated flag.
pub fn switch_list(flag: &str, texts: &[String]) -> Result<Vec<bool>> {
    texts
        .iter()
        .map(|t| parse_switch(flag, t).map_err(|e| anyhow!(e)))
        .collect()
}

fn positive(flag: &str, values: &Option<Vec<u64>>) -> Result<Option<Vec<u64>>> {
    if values.as_ref().is_some_and(|list| list.contains(&0)) {
        bail!("{flag} values must be at least 1");
    }
    Ok(values.clone())
}

pub fn space(args: &SpaceArgs) -> Result<SearchSpace> {
    let space = SearchSpace {
        tp: positive("--tp", &args.tp)?,
        pp: positive("--pp", &args.pp)?,
        dp: positive("--dp", &args.dp)?,
        micro_batch: positive("--micro-batch", &args.micro_batch)?,
        // Virtual stages are the interleaved schedule's: asking for more
        // than one asks for it.
        schedule: choices::<ScheduleKind>("--schedule", &args.schedule)?.or_else(|| {
            args.virtual_stages
                .as_deref()
                .filter(|v| !v.is_empty() && v.iter().all(|&n| n > 1))
                .map(|_| vec![ScheduleKind::Interleaved])
        }),
        virtual_stages: positive("--virtual-stages", &args.virtual_stages)?,
        recompute: choices::<Recompute>("--recompute", &args.recompute)?,
        recompute_modules: args
            .recompute_modules
            .as_deref()
            .filter(|text| text.trim() != "auto")
            .map(|text| RecomputeModules::parse("--recompute-modules", text))
            .transpose()
            .map_err(|e| anyhow!(e))?,
        search_recompute_modules: args
            .recompute_modules
            .as_deref()
            .is_some_and(|text| text.trim() == "auto"),
        sequence_parallel: switches("--sequence-parallel", &args.sequence_parallel)?,
        optimizer_sharding: choices::<OptimizerSharding>(
            "--optimizer-sharding",
            &args.optimizer_sharding,
        )?,
        bpipe: switches("--bpipe", &args.bpipe)?,
        attention: choices::<AttentionKind>("--attention", &args.attention)?,
        first_stage_layers: positive("--first-stage-layers", &args.first_stage_layers)?,
        last_stage_layers: positive("--last-stage-layers", &args.last_stage_layers)?,
        overlap_grad_reduce: switches("--overlap-grad-reduce", &args.overlap_grad_reduce)?,
        overlap_param_gather: switches("--overlap-param-gather", &args.overlap_param_gather)?,
        tp_comm_overlap: switches("--tp-comm-overlap", &args.tp_comm_overlap)?,
        ep_comm_overlap: switches("--ep-comm-overlap", &args.ep_comm_overlap)?,
        fp8_param_gather: switches("--fp8-param-gather", &args.fp8_param_gather)?,
        expandable_segments: switches("--expandable-segments", &args.expandable_segments)?,
        cuda_graphs: args
            .cuda_graphs
            .as_ref()
            .map(|texts| {
                texts
                    .iter()
                    .map(|t| CudaGraphs::parse("--cuda-graphs", t).map_err(|e| anyhow!(e)))
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?,
        stage_order: choices::<StageOrder>("--stage-order", &args.stage_order)?,
        engine: engine(args)?,
        compile: switches("--compile", &args.compile)?,
        ac_frequency: positive("--ac-frequency", &args.ac_frequency)?,
        dp_shard: positive("--dp-shard", &args.dp_shard)?,
        cp: positive("--cp", &args.cp)?,
        cp_comm: choices::<CpComm>("--cp-comm", &args.cp_comm)?,
        ep: positive("--ep", &args.ep)?,
        etp: positive("--etp", &args.etp)?,
        dispatcher: choices::<Dispatcher>("--moe-dispatcher", &args.moe_dispatcher)?,
        precision: choices::<Precision>("--precision", &args.precision)?,
        fp8_recipe: args
            .fp8_recipe
            .as_deref()
            .map(|text| Fp8Recipe::parse("--fp8-recipe", text))
            .transpose()
            .map_err(|e| anyhow!(e))?,
        grad_reduce: choices::<GradReduce>("--grad-reduce", &args.grad_reduce)?,
        cross_entropy_fusion: choices::<CrossEntropyFusion>(
            "--cross-entropy-fusion",
            &args.cross_entropy_fusion,
        )?,
        wgrad_deferral: parsed(
            "--wgrad-deferral",
            &args.wgrad_deferral,
            WgradDeferral::parse,
        )?,
        cpu_offload_layers: args.cpu_offload_layers.clone(),
        embedding_sync: embedding_sync(&args.embedding_sync)?,
    };
    check_engine_choices(&space)?;
    Ok(space)
}

/// `--embedding-sync`: the methods named, or every one for `all`.
fn embedding_sync(values: &Option<Vec<String>>) -> Result<Option<Vec<SyncMethod>>> {
    if values
        .as_deref()
        .is_some_and(|v| v.iter().any(|t| t.trim() == "all"))
    {
        return Ok(Some(SyncMethod::ALL.to_vec()));
    }
    choices::<SyncMethod>("--embedding-sync", values)
}

/// Choices the job cannot take, refused up front: `--moe-dispatcher` on a
/// dense model, `--precision fp8` on a GPU without FP8 tensor cores,
/// CUDA graphs on a CPU standing in for a GPU, activation offloading on a
/// GPU whose host link is unknown or of more layers than the model has.
pub fn check_job_choices(space: &SearchSpace, job: &Job) -> Result<()> {
    if space.dispatcher.is_some() && job.model.moe.is_none() {
        bail!(
            "--moe-dispatcher needs a mixture of experts, and model `{}` is dense: add --experts N (routed experts per MoE layer) or leave --moe-dispatcher out",
            job.model.name
        );
    }
    for (flag, degrees) in [("--ep", &space.ep), ("--etp", &space.etp)] {
        if job.model.moe.is_none()
            && degrees
                .as_deref()
                .unwrap_or_default()
                .iter()
                .any(|&d| d > 1)
        {
            bail!(
                "{flag} needs a mixture of experts, and model `{}` is dense: add --experts N (routed experts per MoE layer) or leave {flag} out",
                job.model.name
            );
        }
    }
    let asks = |precision| {
        space
            .precision
            .as_deref()
            .is_some_and(|p| p.contains(&precision))
    };
    let asks_fp8 = asks(Precision::Fp8);
    for precision in [Precision::Fp8, Precision::Nvfp4] {
        if let Some(problem) = precision
            .gpu_problem(&job.nodes.gpu)
            .filter(|_| asks(precision))
        {
            bail!("--precision {}: {}", precision.name(), with_flags(&problem));
        }
    }
    // The engine NVFP4 needs, refused before the search as the rule would
    // refuse every NVFP4 candidate.
    let nvfp4_on_this_engine = ParallelConfig {
        precision: Precision::Nvfp4,
        engine: space.engine,
        ..ParallelConfig::default()
    };
    if let Some(problem) =
        paratune::config::nvfp4_problem(&nvfp4_on_this_engine).filter(|_| asks(Precision::Nvfp4))
    {
        bail!(
            "--precision nvfp4 needs {}; or use --precision fp8",
            with_flags(problem)
        );
    }
    if let Some(recipe) = space.fp8_recipe {
        if !asks_fp8 {
            bail!(
                "--fp8-recipe {}: no candidate runs FP8; add --precision fp8 (or bf16,fp8), or leave --fp8-recipe out",
                recipe.name()
            );
        }
        if let Some(problem) = recipe.engine_problem(space.engine) {
            bail!("{}", with_flags(&problem));
        }
        if let Some(problem) = recipe.gpu_problem(&job.nodes.gpu.name) {
            bail!(
                "--fp8-recipe {}: {problem}, and this job runs on the {}; use --fp8-recipe tensorwise (or delayed, blockwise)",
                recipe.name(),
                job.nodes.gpu.name
            );
        }
    }
    let graphs = space.cuda_graphs.as_deref().unwrap_or_default();
    for graph in graphs {
        if let Some(problem) = graph.gpu_problem(&job.nodes.gpu.name) {
            bail!(
                "--cuda-graphs {}: {problem}; use --cuda-graphs off or leave it out",
                graph.name()
            );
        }
    }
    let offload = space.cpu_offload_layers.as_deref().unwrap_or_default();
    if let Some(&most) = offload.iter().max() {
        if most >= job.model.layers {
            bail!(
                "--cpu-offload-layers {most}: model `{}` has {} layers and Megatron-Core keeps the last one on the GPU; give at most {}",
                job.model.name,
                job.model.layers,
                job.model.layers.saturating_sub(1)
            );
        }
        if most > 0 && job.nodes.gpu.host_link_bandwidth.is_none() {
            bail!(
                "--cpu-offload-layers: the {}'s link to host memory is unknown; give its GPU a host_link_bw (per direction, e.g. \"64GB/s\" for PCIe Gen5 x16) in a cluster file",
                job.nodes.gpu.name
            );
        }
    }
    Ok(())
}

/// A search restricted to what its engine cannot run would only count
/// broken rules: say so up front, with the rule's own explanation.
fn check_engine_choices(space: &SearchSpace) -> Result<()> {
    for &recompute in space.recompute.as_deref().unwrap_or_default() {
        if !Recompute::of(space.engine).contains(&recompute) {
            let c = ParallelConfig {
                recompute,
                engine: space.engine,
                ..ParallelConfig::default()
            };
            bail!(
                "{}",
                with_flags(&Rule::RecomputeForEngine.explain_engine(&c))
            );
        }
    }
    if space.engine != Engine::Torchtitan && space.compile.as_deref() == Some(&[true]) {
        let c = ParallelConfig {
            compile: true,
            engine: space.engine,
            ..ParallelConfig::default()
        };
        bail!(
            "{}",
            with_flags(&Rule::CompileWithoutTorchtitan.explain_engine(&c))
        );
    }
    if space.engine == Engine::Torchtitan {
        megatron_only(
            &space.cross_entropy_fusion,
            CrossEntropyFusion::Off,
            |f| f.name().to_string(),
            (
                "cross_entropy_fusion",
                "torchtitan's loss is PyTorch's cross-entropy",
            ),
        )?;
        megatron_only(
            &space.wgrad_deferral,
            WgradDeferral::Off,
            WgradDeferral::name,
            ("wgrad_deferral", "torchtitan defers no weight gradients"),
        )?;
    }
    Ok(())
}

/// Refuses, for torchtitan, a Megatron-LM-only switch given at anything but
/// `off`: `(key, why)` name it and what torchtitan does instead.
fn megatron_only<T: Copy + PartialEq>(
    values: &Option<Vec<T>>,
    off: T,
    name: impl Fn(T) -> String,
    (key, why): (&str, &str),
) -> Result<()> {
    match values.iter().flatten().find(|v| **v != off) {
        Some(&value) => bail!(
            "{}",
            with_flags(&format!(
                "`{key} {}` is Megatron-LM's ({why}); use `{key} off` or `engine megatron`",
                name(value)
            ))
        ),
        None => Ok(()),
    }
}

/// `--engine`, Megatron-LM unless given.
fn engine(args: &SpaceArgs) -> Result<Engine> {
    match &args.engine {
        None => Ok(Engine::Megatron),
        Some(text) => Engine::parse("--engine", text).map_err(|e| anyhow!(e)),
    }
}

/// The single value of a dimension for `predict`, or its default.
fn single<T: Clone>(flag: &str, values: &Option<Vec<T>>, default: T) -> Result<T> {
    match values.as_deref() {
        None => Ok(default),
        Some([one]) => Ok(one.clone()),
        Some(_) => bail!(
            "predict evaluates one configuration: give one value for {flag} (or use `paratune plan` to compare several)"
        ),
    }
}

/// The single value of an optional dimension (an uneven split's end).
fn single_optional(flag: &str, values: &Option<Vec<u64>>) -> Result<Option<u64>> {
    match values.as_deref() {
        None => Ok(None),
        Some(_) => single(flag, values, 0).map(Some),
    }
}

/// The one configuration `predict` evaluates; degrees not given default to
/// tp 1, pp 1 and dp = GPUs / (tp x pp).
pub fn single_config(args: &SpaceArgs, job: &Job) -> Result<ParallelConfig> {
    let space = space(args)?;
    check_job_choices(&space, job)?;
    let tp = single("--tp", &space.tp, 1)?;
    let pp = single("--pp", &space.pp, 1)?;
    let cp = single("--cp", &space.cp, 1)?;
    let gpus = job.gpus;
    // The model-parallel product, as the messages name it.
    let (product, named) = if cp > 1 {
        (tp * pp * cp, format!("--tp {tp} x --pp {pp} x --cp {cp}"))
    } else {
        (tp * pp, format!("--tp {tp} x --pp {pp}"))
    };
    let dp = match single("--dp", &space.dp, 0)? {
        0 if !gpus.is_multiple_of(product) => bail!(
            "{named} = {product} does not divide the job's {gpus} GPUs; pick degrees whose product divides {gpus}"
        ),
        0 => gpus / product,
        dp if product * dp != gpus => bail!(
            "{named} x --dp {dp} = {} but the job has {gpus} GPUs; make the product {gpus}{}",
            product * dp,
            if gpus.is_multiple_of(product) {
                format!(" (--dp {})", gpus / product)
            } else {
                " (or change --nodes/--gpus)".to_string()
            }
        ),
        dp => dp,
    };
    // An MoE model's experts default to Megatron-LM's: ep 1, etp = tp.
    let moe_etp = ParallelConfig::default_etp(job.model.moe.is_some(), tp);
    let schedule = single("--schedule", &space.schedule, ScheduleKind::OneFOneB)?;
    let virtual_stages = single("--virtual-stages", &space.virtual_stages, 1)?;
    if schedule == ScheduleKind::Interleaved && space.virtual_stages.is_none() {
        bail!(
            "--schedule interleaved needs --virtual-stages N (model chunks per pipeline rank, at least 2)"
        );
    }
    let mut config = ParallelConfig {
        tp,
        pp,
        dp,
        micro_batch: single("--micro-batch", &space.micro_batch, 1)?,
        schedule,
        virtual_stages,
        recompute: single("--recompute", &space.recompute, Recompute::None)?,
        recompute_modules: match (space.recompute_modules, space.search_recompute_modules) {
            (_, true) => bail!(
                "predict evaluates one configuration: give --recompute-modules the modules (e.g. layernorm,moe_act), or use `paratune plan` to try them all"
            ),
            (modules, false) => modules.unwrap_or_default(),
        },
        sequence_parallel: single("--sequence-parallel", &space.sequence_parallel, false)?,
        optimizer_sharding: single(
            "--optimizer-sharding",
            &space.optimizer_sharding,
            OptimizerSharding::None,
        )?,
        bpipe: single("--bpipe", &space.bpipe, false)?,
        attention: single("--attention", &space.attention, job.model.attention)?,
        first_stage_layers: single_optional("--first-stage-layers", &space.first_stage_layers)?,
        last_stage_layers: single_optional("--last-stage-layers", &space.last_stage_layers)?,
        overlap_grad_reduce: single("--overlap-grad-reduce", &space.overlap_grad_reduce, false)?,
        overlap_param_gather: single("--overlap-param-gather", &space.overlap_param_gather, false)?,
        tp_comm_overlap: single("--tp-comm-overlap", &space.tp_comm_overlap, false)?,
        ep_comm_overlap: single("--ep-comm-overlap", &space.ep_comm_overlap, false)?,
        fp8_param_gather: single("--fp8-param-gather", &space.fp8_param_gather, false)?,
        expandable_segments: single(
            "--expandable-segments",
            &space.expandable_segments,
            space.engine.launches_expandable_segments(),
        )?,
        cuda_graphs: single("--cuda-graphs", &space.cuda_graphs, CudaGraphs::Off)?,
        stage_order: single("--stage-order", &space.stage_order, StageOrder::Megatron)?,
        engine: space.engine,
        compile: single("--compile", &space.compile, false)?,
        ac_frequency: single("--ac-frequency", &space.ac_frequency, 2)?,
        dp_shard: single_optional("--dp-shard", &space.dp_shard)?,
        cp,
        cp_comm: single(
            "--cp-comm",
            &space.cp_comm,
            CpComm::default_for(space.engine, &job.model, tp, cp),
        )?,
        // a2a+p2p's all-to-all group, from the node as the search takes it.
        cp_a2a: 1,
        ep: single("--ep", &space.ep, 1)?,
        etp: single("--etp", &space.etp, moe_etp)?,
        dispatcher: single(
            "--moe-dispatcher",
            &space.dispatcher,
            Dispatcher::of_engine(space.engine, job.model.moe.is_some()),
        )?,
        precision: single("--precision", &space.precision, Precision::Bf16)?,
        fp8_recipe: None,
        grad_reduce: single("--grad-reduce", &space.grad_reduce, GradReduce::Fp32)?,
        cross_entropy_fusion: single(
            "--cross-entropy-fusion",
            &space.cross_entropy_fusion,
            CrossEntropyFusion::Off,
        )?,
        wgrad_deferral: single(
            "--wgrad-deferral",
            &space.wgrad_deferral,
            WgradDeferral::Off,
        )?,
        cpu_offload_layers: single("--cpu-offload-layers", &space.cpu_offload_layers, 0)?,
        embedding_sync: single(
            "--embedding-sync",
            &space.embedding_sync,
            SyncMethod::AllReduce,
        )?,
    };
    config.cp_a2a = config.default_cp_a2a(job.gpus_per_node());
    if config.precision == Precision::Fp8 {
        config.fp8_recipe = Some(space.fp8_recipe_on(&job.nodes.gpu.name));
    }
    // FP8 weights where they run, as the search keeps them.
    if space.fp8_param_gather.is_none() {
        config.fp8_param_gather = paratune::config::fp8_param_gather_problem(&config).is_none();
    }
    // A group of all of dp is plain sharding.
    if config.dp_shard == Some(config.dp) {
        config.dp_shard = None;
    }
    config
        .check(&job.model, job.global_batch, job.gpus, job.gpus_per_node())
        .map_err(|e| anyhow!(with_flags(&e)))?;
    Ok(config)
}

/// Column defaults for run tables: the flags' single values.
pub fn row_defaults(
    args: &SpaceArgs,
    (model, model_is_given): (ModelSpec, bool),
) -> Result<RowDefaults> {
    let space = space(args)?;
    let mut model = model;
    model.attention = single("--attention", &space.attention, model.attention)?;
    Ok(RowDefaults {
        recompute: single("--recompute", &space.recompute, Recompute::None)?,
        sequence_parallel: single("--sequence-parallel", &space.sequence_parallel, false)?,
        schedule: single("--schedule", &space.schedule, ScheduleKind::OneFOneB)?,
        virtual_stages: single("--virtual-stages", &space.virtual_stages, 1)?,
        bpipe: single("--bpipe", &space.bpipe, false)?,
        optimizer_sharding: single(
            "--optimizer-sharding",
            &space.optimizer_sharding,
            OptimizerSharding::None,
        )?,
        overlap_grad_reduce: single("--overlap-grad-reduce", &space.overlap_grad_reduce, false)?,
        overlap_param_gather: single("--overlap-param-gather", &space.overlap_param_gather, false)?,
        tp_comm_overlap: single("--tp-comm-overlap", &space.tp_comm_overlap, false)?,
        cuda_graphs: single("--cuda-graphs", &space.cuda_graphs, CudaGraphs::Off)?,
        engine: space.engine,
        compile: single("--compile", &space.compile, false)?,
        ac_frequency: single("--ac-frequency", &space.ac_frequency, 2)?,
        memory_rank: match &args.memory_rank {
            None => MemoryRank::Max,
            Some(text) => MemoryRank::parse("--memory-rank", text).map_err(|e| anyhow!(e))?,
        },
        model,
        model_is_given,
    })
}

/// The model template for run tables: `--model` (or its dimensions as
/// flags), which a table without model columns takes whole, or GPT-style
/// defaults that the rows fill in with their own dimensions. Returns the
/// model and whether it is the user's.
pub fn row_model(args: &ModelArgs) -> Result<(ModelSpec, bool)> {
    if args.model.is_some()
        || (args.hidden.is_some() && args.heads.is_some() && args.layers.is_some())
    {
        return Ok((model(args)?, true));
    }
    let mut m = ModelSpec::gpt(
        "runs",
        1024,
        16,
        24,
        args.vocab.unwrap_or(51200),
        args.seq_len.unwrap_or(2048),
    );
    if let Some(text) = &args.dropout {
        m.dropout = parse_switch("--dropout", text).map_err(|e| anyhow!(e))?;
    }
    if let Some(text) = &args.tied_embeddings {
        m.tied_embeddings = parse_switch("--tied-embeddings", text).map_err(|e| anyhow!(e))?;
    }
    Ok((m, false))
}

/// Reads a `key=value,...` configuration for `--explain`; keys not given
/// come from `base`.
pub fn config_spec(spec: &str, base: &ParallelConfig) -> Result<ParallelConfig> {
    base.with_spec(spec).map_err(|e| anyhow!("--explain: {e}"))
}
