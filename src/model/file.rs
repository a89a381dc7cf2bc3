//! Model TOML files: flat keys describing one decoder-only transformer,
//! optionally starting from a catalogue model.
//!
//! ```toml
//! base = "llama3-8b"   # optional: start from a catalogue model
//! name = "llama3-8b-32k"
//! hidden = 4096        # required without `base`, as are heads, layers, vocab, seq_len
//! heads = 32
//! kv_heads = 8         # default: heads
//! ffn_hidden = 14336   # default: 4 * hidden
//! gated_mlp = true     # default: false
//! layers = 32
//! vocab = 128256
//! seq_len = 32768
//! tied_embeddings = false    # default: true
//! learned_positions = false  # default: true
//! dropout = false            # default: true (GPT's 0.1; Llama trains without)
//! attention = "flash"        # or "standard"; default: flash
//! head_dim = 128             # default: hidden / heads
//! experts = 128              # a mixture of experts: routed experts per MoE layer
//! moe_topk = 8               # experts per token (default 2, Megatron-LM's)
//! moe_ffn_hidden = 768       # one expert's width (default: ffn_hidden)
//! moe_shared_ffn_hidden = 0  # shared experts' width together (default: none)
//! moe_dense_layers = 0       # leading layers with a dense MLP (default 0)
//! moe_layer_freq = 1         # then every n-th layer has experts (default 1)
//! moe_router_num_groups = 0  # group-limited routing: expert groups (0: none)
//! sliding_window = 127       # windowed attention: tokens before each query
//! window_attn_skip_freq = 2  # every n-th layer attends fully (0: none)
//! moe_router_group_topk = 0  # groups each token's experts come from
//! moe_router_score_function = "sigmoid"  # or "softmax" (default; DeepSeek-V3: sigmoid)
//! moe_router_topk_scaling_factor = 2.5   # the chosen experts' weights scaled (default 1)
//! moe_router_enable_expert_bias = true   # aux-loss-free balancing's bias (needs sigmoid)
//! moe_router_dtype = "fp32"              # or "model" (default; DeepSeek-V3: fp32)
//! kv_lora_rank = 512         # multi-latent attention (DeepSeek): the keys' and values' latent
//! q_lora_rank = 1536         # the queries' latent (default 0: projected directly)
//! qk_head_dim = 128          # per head, without position (default 128)
//! qk_pos_head_dim = 64       # per head, rotary (default 64)
//! v_head_dim = 128           # per head, values (default 128)
//! mtp_layers = 1             # multi-token prediction modules (DeepSeek-V3: 1; default 0)
//! quick_geglu = true         # gpt-oss's gated MLP: quick-GeLU instead of SiLU (default false)
//! activation_clamp = 7.0     # clamp the first projection's halves (gpt-oss: 7; 0: none)
//! glu_linear_offset = 1.0    # added to the linear half (gpt-oss: 1; default 0)
//! attention_sinks = true     # a learnable softmax offset per head (gpt-oss; default false)
//! rms_norm = true            # RMSNorm instead of LayerNorm (Llama and after; default false)
//! linear_bias = false        # biases on the linear layers (default true, as GPT)
//! qk_layernorm = true        # normalise queries and keys (Qwen3; default false)
//! no_positions = true        # no position embedding, NoPE (default false)
//! rotary_base = 500000       # rope_theta (default 10000, Megatron-LM's)
//! rope_scaling = "yarn"      # "llama3" (Llama 3.1's), "yarn" or "none" (default)
//! rope_scaling_factor = 32.0 # the scaling's factor (Llama 3.1: 8; gpt-oss: 32)
//! rope_original_positions = 4096  # YaRN: the context scaled from (default 4096)
//! rope_mscale = 1.0          # YaRN: attention temperature (default 1.0)
//! rope_mscale_all_dim = 0.0  # YaRN: its all-dimension part (default 0.0; DeepSeek-V3: 1.0)
//! norm_epsilon = 1e-6        # the norms' epsilon (default 1e-5, Megatron-LM's)
//! ```
//!
//! With `base`, an absent key keeps the base's value (changing `hidden` does
//! not change `ffn_hidden`). Without `base`, an absent `name` is the file's
//! stem. With `base`, it is the base's name when nothing else is overridden,
//! and the file's stem otherwise (a changed model should not pass for the
//! published one).
//!
//! Every error is one line that starts with the file's path.

use super::{
    AttentionKind, ModelSpec, RopeScaling, RouterDtype, RouterScore, builtin_model,
    builtin_model_names,
};
use crate::suggest::did_you_mean;
use std::path::Path;
use toml::{Table, Value};

#[derive(Debug, thiserror::Error)]
pub enum ModelFileError {
    /// The I/O error is part of the message, not a `source`: callers print
    /// the chain (`{:#}`), which would repeat it.
    #[error("{path}: cannot read model file: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

/// Keys a model file may hold, in the order they are documented.
const KEYS: [&str; 50] = [
    "base",
    "name",
    "hidden",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "gated_mlp",
    "layers",
    "vocab",
    "seq_len",
    "tied_embeddings",
    "learned_positions",
    "attention",
    "dropout",
    "head_dim",
    "experts",
    "moe_topk",
    "moe_ffn_hidden",
    "moe_shared_ffn_hidden",
    "moe_dense_layers",
    "moe_layer_freq",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_score_function",
    "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias",
    "moe_router_dtype",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_head_dim",
    "qk_pos_head_dim",
    "v_head_dim",
    "mtp_layers",
    "sliding_window",
    "window_attn_skip_freq",
    "quick_geglu",
    "activation_clamp",
    "glu_linear_offset",
    "attention_sinks",
    "rms_norm",
    "linear_bias",
    "qk_layernorm",
    "no_positions",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_original_positions",
    "rope_mscale",
    "rope_mscale_all_dim",
    "norm_epsilon",
];

/// The rotary scaling's keys besides `rope_scaling`.
const ROPE_SCALING_KEYS: [&str; 4] = [
    "rope_scaling_factor",
    "rope_original_positions",
    "rope_mscale",
    "rope_mscale_all_dim",
];

/// Multi-latent attention's keys besides `kv_lora_rank`.
const MLA_KEYS: [&str; 4] = [
    "q_lora_rank",
    "qk_head_dim",
    "qk_pos_head_dim",
    "v_head_dim",
];

/// The mixture-of-experts keys besides `experts`.
const MOE_KEYS: [&str; 11] = [
    "moe_topk",
    "moe_ffn_hidden",
    "moe_shared_ffn_hidden",
    "moe_dense_layers",
    "moe_layer_freq",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_score_function",
    "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias",
    "moe_router_dtype",
];

/// Keys that must be given when there is no `base`.
const REQUIRED: [&str; 5] = ["hidden", "heads", "layers", "vocab", "seq_len"];

/// Parses a model file's text; `path` names the file in messages and gives
/// the default model name (its stem).
pub fn parse_model_toml(text: &str, path: &str) -> Result<ModelSpec, ModelFileError> {
    parse(text, path).map_err(|message| ModelFileError::Invalid {
        path: path.to_string(),
        message,
    })
}

pub fn load_model_file(path: &Path) -> Result<ModelSpec, ModelFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|error| ModelFileError::Read {
        path: shown.clone(),
        error,
    })?;
    parse_model_toml(&text, &shown)
}

/// Renders a model as a file that [`parse_model_toml`] reads back unchanged.
pub fn render_model_toml(model: &ModelSpec) -> String {
    let mut flat = model.clone();
    flat.moe = None;
    flat.mla = None;
    flat.window = None;
    flat.quick_geglu = None;
    flat.rope_scaling = None;
    let mut text = toml::to_string(&flat).expect("a model always serialises");
    match model.rope_scaling {
        None => {}
        Some(RopeScaling::Llama3 { factor }) => {
            text.push_str(&format!(
                "rope_scaling = \"llama3\"\nrope_scaling_factor = {factor:?}\n"
            ));
        }
        Some(RopeScaling::Yarn {
            factor,
            original_positions,
            mscale,
            mscale_all_dim,
        }) => text.push_str(&format!(
            "rope_scaling = \"yarn\"\nrope_scaling_factor = {factor:?}\nrope_original_positions = {original_positions}\nrope_mscale = {mscale:?}\nrope_mscale_all_dim = {mscale_all_dim:?}\n"
        )),
    }
    if let Some(glu) = model.quick_geglu {
        text.push_str(&format!(
            "quick_geglu = true\nactivation_clamp = {:?}\nglu_linear_offset = {:?}\n",
            glu.clamp, glu.linear_offset
        ));
    }
    if let Some(mla) = model.mla {
        text.push_str(&format!(
            "kv_lora_rank = {}\nq_lora_rank = {}\nqk_head_dim = {}\nqk_pos_head_dim = {}\nv_head_dim = {}\n",
            mla.kv_lora_rank, mla.q_lora_rank, mla.qk_head_dim, mla.qk_pos_head_dim, mla.v_head_dim
        ));
    }
    if let Some(window) = model.window {
        text.push_str(&format!(
            "sliding_window = {}\nwindow_attn_skip_freq = {}\n",
            window.tokens, window.full_every
        ));
    }
    if let Some(moe) = model.moe {
        text.push_str(&format!(
            "experts = {}\nmoe_topk = {}\nmoe_ffn_hidden = {}\nmoe_shared_ffn_hidden = {}\nmoe_dense_layers = {}\nmoe_layer_freq = {}\n",
            moe.experts,
            moe.topk,
            moe.ffn_hidden,
            moe.shared_ffn_hidden,
            moe.dense_layers,
            moe.layer_freq
        ));
        if moe.router_groups > 0 {
            text.push_str(&format!(
                "moe_router_num_groups = {}\nmoe_router_group_topk = {}\n",
                moe.router_groups, moe.router_group_topk
            ));
        }
        text.push_str(&format!(
            "moe_router_score_function = \"{}\"\nmoe_router_topk_scaling_factor = {:?}\nmoe_router_enable_expert_bias = {}\nmoe_router_dtype = \"{}\"\n",
            moe.router_score.name(),
            moe.router_topk_scaling,
            moe.router_expert_bias,
            moe.router_dtype.name()
        ));
    }
    text
}

/// The keys a model file for `model` holds, with their values, in the
/// documented order ([`render_model_toml`]'s file read back): the flat
/// record `paratune models` lists. Keys at their defaults may be absent.
pub fn model_file_values(model: &ModelSpec) -> Vec<(&'static str, Value)> {
    let table: Table =
        toml::from_str(&render_model_toml(model)).expect("a rendered model reads back");
    KEYS.iter()
        .filter_map(|key| table.get(*key).map(|value| (*key, value.clone())))
        .collect()
}

/// The keys [`model_file_values`] may give, in order (without `base`).
pub fn model_file_keys() -> impl Iterator<Item = &'static str> {
    KEYS.iter().copied().filter(|key| *key != "base")
}

/// Sliding-window keys applied to `model`: `sliding_window = N` windows
/// its attention (0 takes a base model's window away), and
/// `window_attn_skip_freq` needs a window.
fn apply_window(table: &Table, model: &mut ModelSpec) -> Result<(), String> {
    match table.get("sliding_window") {
        None => {}
        Some(Value::Integer(0)) => model.window = None,
        Some(_) => {
            let tokens = positive(table, "sliding_window")?.unwrap_or(0);
            let full_every = model.window.map_or(0, |w| w.full_every);
            model.window = Some(crate::model::WindowSpec { tokens, full_every });
        }
    }
    if table.contains_key("window_attn_skip_freq") {
        let Some(window) = model.window.as_mut() else {
            return Err(
                "`window_attn_skip_freq` needs a windowed attention: add `sliding_window = N` or remove it"
                    .into(),
            );
        };
        window.full_every = match table.get("window_attn_skip_freq") {
            Some(Value::Integer(0)) => 0,
            _ => positive(table, "window_attn_skip_freq")?.unwrap_or(0),
        };
    }
    Ok(())
}

/// gpt-oss's activation keys applied to `model`: `quick_geglu = true`
/// makes its gated MLP a quick-GeGLU (Megatron-LM's defaults, no clamp and
/// no offset, for what is left out), `false` a SwiGLU again; the clamp and
/// the offset need one.
fn apply_quick_geglu(table: &Table, model: &mut ModelSpec) -> Result<(), String> {
    match boolean(table, "quick_geglu")? {
        Some(false) => model.quick_geglu = None,
        Some(true) if model.quick_geglu.is_none() => {
            model.quick_geglu = Some(crate::model::QuickGeglu {
                clamp: 0.0,
                linear_offset: 0.0,
            })
        }
        _ => {}
    }
    let Some(glu) = model.quick_geglu.as_mut() else {
        if let Some(key) = ["activation_clamp", "glu_linear_offset"]
            .into_iter()
            .find(|k| table.contains_key(*k))
        {
            return Err(format!(
                "`{key}` needs gpt-oss's activation: add `quick_geglu = true` or remove `{key}`"
            ));
        }
        return Ok(());
    };
    if let Some(clamp) = number(table, "activation_clamp")? {
        if clamp < 0.0 {
            return Err(format!(
                "`activation_clamp = {clamp}` must be 0 or more (0: no clamp; gpt-oss: 7.0)"
            ));
        }
        glu.clamp = clamp;
    }
    if let Some(offset) = number(table, "glu_linear_offset")? {
        glu.linear_offset = offset;
    }
    Ok(())
}

/// The rotary keys applied to `model`: its base, and `rope_scaling`
/// ("llama3", "yarn" or "none") with its numbers, which need a scaling
/// (the base's, or one named here; a named kind starts from the
/// catalogue's: Llama 3.1's factor 8, gpt-oss's YaRN, factor 32 from
/// 4,096 positions with mscale 1.0 over mscale_all_dim 0.0).
fn apply_rope(table: &Table, model: &mut ModelSpec) -> Result<(), String> {
    // A file that takes a base's rotary positions away takes their scaling
    // with them, unless it names one (which the model check refuses).
    if !table.contains_key("rope_scaling") {
        model.drop_scaling_unless_rotary();
    }
    if let Some(base) = positive(table, "rotary_base")? {
        model.rotary_base = base;
    }
    if let Some(epsilon) = number(table, "norm_epsilon")? {
        model.norm_epsilon = epsilon;
    }
    if let Some(kind) = string(table, "rope_scaling")? {
        model.rope_scaling = match (kind.trim().to_lowercase().as_str(), model.rope_scaling) {
            ("none", _) => None,
            ("llama3", Some(same @ RopeScaling::Llama3 { .. })) => Some(same),
            ("yarn", Some(same @ RopeScaling::Yarn { .. })) => Some(same),
            ("llama3", _) => Some(RopeScaling::LLAMA31),
            ("yarn", _) => Some(RopeScaling::GPT_OSS_YARN),
            _ => {
                return Err(format!(
                    "`rope_scaling = \"{kind}\"` is not a rotary scaling; write \"llama3\" (Llama 3.1's), \"yarn\" or \"none\""
                ));
            }
        };
    }
    let Some(scaling) = model.rope_scaling.as_mut() else {
        if let Some(key) = ROPE_SCALING_KEYS.iter().find(|k| table.contains_key(**k)) {
            return Err(format!(
                "`{key}` needs a rotary scaling: add `rope_scaling = \"yarn\"` (or \"llama3\") or remove `{key}`"
            ));
        }
        return Ok(());
    };
    match scaling {
        RopeScaling::Llama3 { factor } => {
            if let Some(key) = ROPE_SCALING_KEYS[1..]
                .iter()
                .find(|k| table.contains_key(**k))
            {
                return Err(format!(
                    "`{key}` is YaRN's: Llama 3.1's scaling takes `rope_scaling_factor` only (Megatron-LM fixes the rest); remove `{key}` or write `rope_scaling = \"yarn\"`"
                ));
            }
            if let Some(value) = number(table, "rope_scaling_factor")? {
                *factor = value;
            }
        }
        RopeScaling::Yarn {
            factor,
            original_positions,
            mscale,
            mscale_all_dim,
        } => {
            for (key, field) in [
                ("rope_scaling_factor", factor),
                ("rope_mscale", mscale),
                ("rope_mscale_all_dim", mscale_all_dim),
            ] {
                if let Some(value) = number(table, key)? {
                    *field = value;
                }
            }
            if let Some(value) = positive(table, "rope_original_positions")? {
                *original_positions = value;
            }
        }
    }
    Ok(())
}

/// Multi-latent attention's keys applied to `model`: `kv_lora_rank` makes
/// its attention MLA (Megatron-LM's defaults for what is left out), the
/// other keys need it or a base that has it.
fn apply_mla(table: &Table, model: &mut ModelSpec) -> Result<(), String> {
    if let Some(rank) = positive(table, "kv_lora_rank")? {
        model.set_kv_lora_rank(rank);
    }
    let Some(mla) = model.mla.as_mut() else {
        if let Some(key) = MLA_KEYS.iter().find(|k| table.contains_key(**k)) {
            return Err(format!(
                "`{key}` needs multi-latent attention: add `kv_lora_rank = N` or remove `{key}`"
            ));
        }
        return Ok(());
    };
    for (key, field) in [
        ("qk_head_dim", &mut mla.qk_head_dim),
        ("qk_pos_head_dim", &mut mla.qk_pos_head_dim),
        ("v_head_dim", &mut mla.v_head_dim),
    ] {
        if let Some(value) = positive(table, key)? {
            *field = value;
        }
    }
    match table.get("q_lora_rank") {
        None => {}
        Some(Value::Integer(0)) => mla.q_lora_rank = 0,
        Some(_) => mla.q_lora_rank = positive(table, "q_lora_rank")?.unwrap_or(0),
    }
    Ok(())
}

/// The mixture-of-experts keys applied to `model`: `experts` makes a model
/// one (Megatron-LM's defaults for what is left out), the other keys need
/// it or a base that has experts.
fn apply_moe(table: &Table, model: &mut ModelSpec) -> Result<(), String> {
    if let Some(experts) = positive(table, "experts")? {
        model.set_experts(experts);
    }
    let Some(moe) = model.moe.as_mut() else {
        if let Some(key) = MOE_KEYS.iter().find(|k| table.contains_key(**k)) {
            return Err(format!(
                "`{key}` needs a mixture of experts: add `experts = N` (the routed experts per MoE layer) or remove `{key}`"
            ));
        }
        return Ok(());
    };
    for (key, field) in [
        ("moe_topk", &mut moe.topk),
        ("moe_ffn_hidden", &mut moe.ffn_hidden),
        ("moe_layer_freq", &mut moe.layer_freq),
    ] {
        if let Some(value) = positive(table, key)? {
            *field = value;
        }
    }
    if let Some(text) = string(table, "moe_router_score_function")? {
        moe.router_score = RouterScore::named(text).ok_or_else(|| {
            format!(
                "`moe_router_score_function = \"{text}\"` is not a router score; write \"softmax\" or \"sigmoid\""
            )
        })?;
    }
    if let Some(scaling) = number(table, "moe_router_topk_scaling_factor")? {
        moe.router_topk_scaling = scaling;
    }
    if let Some(bias) = boolean(table, "moe_router_enable_expert_bias")? {
        moe.router_expert_bias = bias;
    }
    if let Some(text) = string(table, "moe_router_dtype")? {
        moe.router_dtype = RouterDtype::named(text).ok_or_else(|| {
            format!(
                "`moe_router_dtype = \"{text}\"` is not a router precision; write \"fp32\" or \"model\" (an fp64 router is not priced)"
            )
        })?;
    }
    let count = |key: &str| match table.get(key) {
        None => Ok(None),
        Some(Value::Integer(0)) => Ok(Some(0)),
        Some(_) => positive(table, key),
    };
    if let Some(n) = count("moe_shared_ffn_hidden")? {
        moe.shared_ffn_hidden = n;
    }
    if let Some(n) = count("moe_dense_layers")? {
        moe.dense_layers = n;
    }
    if let Some(groups) = count("moe_router_num_groups")? {
        moe.set_router_groups(groups);
    }
    if let Some(n) = count("moe_router_group_topk")? {
        moe.router_group_topk = n;
    }
    Ok(())
}

fn parse(text: &str, path: &str) -> Result<ModelSpec, String> {
    let table: Table = text.parse().map_err(|e| {
        crate::toml_error::one_line(
            &e,
            text,
            "fix the syntax (each line `key = value`, strings in double quotes)",
        )
    })?;
    for (key, value) in &table {
        if !KEYS.contains(&key.as_str()) {
            return Err(match value {
                Value::Table(_) => format!(
                    "unexpected table `[{key}]`: model files are flat, write `hidden = 4096` \
                     and the other keys at the top level without a table header"
                ),
                _ => format!(
                    "unknown key `{key}` (remove it or correct its spelling){}",
                    did_you_mean(key, &KEYS)
                ),
            });
        }
    }

    let mut model = match string(&table, "base")? {
        Some(base) => builtin_model(base).ok_or_else(|| {
            format!(
                "unknown base model `{base}`: `base` takes a built-in model name{}",
                did_you_mean(base, &builtin_model_names())
            )
        })?,
        None => {
            let missing: Vec<&str> = REQUIRED
                .iter()
                .copied()
                .filter(|k| !table.contains_key(*k))
                .collect();
            if !missing.is_empty() {
                let add: Vec<String> = missing.iter().map(|k| format!("`{k} = ...`")).collect();
                return Err(format!(
                    "missing {}; add {}, or start from a built-in model with \
                     `base = \"llama3-8b\"` (or another catalogue name)",
                    missing
                        .iter()
                        .map(|k| format!("`{k}`"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    add.join(", ")
                ));
            }
            let hidden = positive(&table, "hidden")?.expect("checked above");
            let heads = positive(&table, "heads")?.expect("checked above");
            // Megatron-LM's defaults: GPT's layer.
            ModelSpec::gpt("", hidden, heads, 0, 0, 0)
        }
    };

    let integers: [(&str, &mut u64); 7] = [
        ("hidden", &mut model.hidden),
        ("heads", &mut model.heads),
        ("kv_heads", &mut model.kv_heads),
        ("ffn_hidden", &mut model.ffn_hidden),
        ("layers", &mut model.layers),
        ("vocab", &mut model.vocab),
        ("seq_len", &mut model.seq_len),
    ];
    for (key, field) in integers {
        if let Some(value) = positive(&table, key)? {
            *field = value;
        }
    }
    let flags: [(&str, &mut bool); 9] = [
        ("gated_mlp", &mut model.gated_mlp),
        ("tied_embeddings", &mut model.tied_embeddings),
        ("learned_positions", &mut model.learned_positions),
        ("dropout", &mut model.dropout),
        ("attention_sinks", &mut model.attention_sinks),
        ("rms_norm", &mut model.rms_norm),
        ("linear_bias", &mut model.linear_bias),
        ("qk_layernorm", &mut model.qk_layernorm),
        ("no_positions", &mut model.no_positions),
    ];
    for (key, field) in flags {
        if let Some(value) = boolean(&table, key)? {
            *field = value;
        }
    }
    if let Some(text) = string(&table, "attention")? {
        model.attention = attention(text)?;
    }
    if let Some(width) = positive(&table, "head_dim")? {
        model.head_dim_override = Some(width);
    }
    apply_moe(&table, &mut model)?;
    apply_mla(&table, &mut model)?;
    apply_window(&table, &mut model)?;
    apply_quick_geglu(&table, &mut model)?;
    apply_rope(&table, &mut model)?;
    // 0 is allowed: it takes a base model's prediction modules away.
    match table.get("mtp_layers") {
        None => {}
        Some(Value::Integer(0)) => model.mtp_layers = 0,
        Some(_) => model.mtp_layers = positive(&table, "mtp_layers")?.unwrap_or(0),
    }

    let overrides = table.keys().any(|k| k != "base" && k != "name");
    match string(&table, "name")? {
        Some(name) if name.trim().is_empty() => {
            return Err("`name` is empty; give the model a name or remove the key".into());
        }
        Some(name) => model.name = name.to_string(),
        None if table.contains_key("base") && !overrides => {}
        None => model.name = file_stem(path),
    }

    model.check().map_err(|message| {
        if message.contains("; ") {
            message
        } else {
            format!("{message}; correct these values in the file")
        }
    })?;
    Ok(model)
}

fn file_stem(path: &str) -> String {
    Path::new(path)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "model".to_string())
}

fn attention(text: &str) -> Result<AttentionKind, String> {
    let names = AttentionKind::ALL.map(AttentionKind::name);
    AttentionKind::ALL
        .into_iter()
        .find(|a| a.name().eq_ignore_ascii_case(text.trim()))
        .ok_or_else(|| {
            format!(
                "`attention = \"{text}\"` is not an attention kind{}",
                did_you_mean(text, &names)
            )
        })
}

fn positive(table: &Table, key: &str) -> Result<Option<u64>, String> {
    // Far above any model; keeps the arithmetic clear of overflow and the
    // search finite.
    let max: i64 = match key {
        "rotary_base" => 1 << 40,
        "vocab" | "seq_len" | "rope_original_positions" => 1 << 24,
        "sliding_window" => crate::model::MAX_WINDOW_TOKENS as i64,
        "mtp_layers" => crate::model::MAX_MTP_LAYERS as i64,
        "ffn_hidden" | "moe_ffn_hidden" | "moe_shared_ffn_hidden" => 1 << 22,
        "hidden" => 1 << 20,
        _ => 1 << 16,
    };
    match table.get(key) {
        None => Ok(None),
        Some(Value::Integer(n)) if *n > max => Err(format!(
            "`{key} = {n}` is more than paratune plans for (at most {max})"
        )),
        Some(Value::Integer(n)) if *n > 0 => Ok(Some(*n as u64)),
        Some(other) => Err(format!(
            "`{key}` must be a positive integer, not `{other}`; write e.g. `{key} = {}`",
            example(key)
        )),
    }
}

fn example(key: &str) -> u64 {
    match key {
        "hidden" => 4096,
        "heads" => 32,
        "kv_heads" => 8,
        "ffn_hidden" => 14336,
        "layers" => 32,
        "vocab" => 32000,
        "rotary_base" => 500_000,
        "mtp_layers" => 1,
        "sliding_window" => 127,
        _ => 4096,
    }
}

fn boolean(table: &Table, key: &str) -> Result<Option<bool>, String> {
    match table.get(key) {
        None => Ok(None),
        Some(Value::Boolean(b)) => Ok(Some(*b)),
        Some(other) => Err(format!(
            "`{key}` must be `true` or `false` (no quotes), not `{other}`"
        )),
    }
}

/// A finite number, written with or without a decimal point.
fn number(table: &Table, key: &str) -> Result<Option<f64>, String> {
    match table.get(key) {
        None => Ok(None),
        Some(Value::Float(x)) if x.is_finite() => Ok(Some(*x)),
        Some(Value::Integer(n)) => Ok(Some(*n as f64)),
        Some(other) => Err(format!(
            "`{key}` must be a number, not `{other}`; write e.g. `{key} = {}`",
            number_example(key)
        )),
    }
}

fn number_example(key: &str) -> &'static str {
    match key {
        "norm_epsilon" => "1e-6",
        "rope_scaling_factor" => "8.0",
        "moe_router_topk_scaling_factor" => "2.5",
        "rope_mscale" | "rope_mscale_all_dim" | "glu_linear_offset" => "1.0",
        _ => "7.0",
    }
}

fn string<'a>(table: &'a Table, key: &str) -> Result<Option<&'a str>, String> {
    match table.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(format!(
            "`{key}` must be a string in double quotes, not `{other}`"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(text: &str) -> String {
        let e = parse_model_toml(text, "models/mine.toml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("models/mine.toml: "), "{e}");
        assert!(!e.contains('\n'), "not one line: {e}");
        e
    }

    const LLAMA3_8B: &str = r#"
        name = "llama3-8b"
        hidden = 4096
        heads = 32
        kv_heads = 8
        ffn_hidden = 14336
        gated_mlp = true
        layers = 32
        vocab = 128256
        seq_len = 8192
        tied_embeddings = false
        learned_positions = false
        attention = "flash"
        dropout = false
        rms_norm = true
        linear_bias = false
        rotary_base = 500000
    "#;

    #[test]
    fn a_llama_style_file_reads_as_the_catalogue_model() {
        let m = parse_model_toml(LLAMA3_8B, "llama.toml").unwrap();
        assert_eq!(m, builtin_model("llama3-8b").unwrap());
    }

    #[test]
    fn every_catalogue_model_round_trips_through_a_file() {
        for name in builtin_model_names() {
            let m = builtin_model(name).unwrap();
            let text = render_model_toml(&m);
            assert_eq!(parse_model_toml(&text, "x.toml").unwrap(), m, "{text}");
        }
        let mut m = builtin_model("llama2-70b").unwrap();
        m.attention = AttentionKind::Standard;
        let text = render_model_toml(&m);
        assert!(text.contains("attention = \"standard\""), "{text}");
        assert_eq!(parse_model_toml(&text, "x.toml").unwrap(), m);
        // A model without positions (NoPE) keeps saying so.
        m.no_positions = true;
        let text = render_model_toml(&m);
        assert!(text.contains("no_positions = true"), "{text}");
        assert_eq!(parse_model_toml(&text, "x.toml").unwrap(), m);
    }

    #[test]
    fn rotary_keys_set_change_and_need_their_scaling() {
        let read = |text: &str| parse_model_toml(text, "x.toml").unwrap();
        // Llama 3.1 -> Llama 3: the scaling taken away; a base kept.
        let llama3 = read("base = \"llama3.1-8b\"\nrope_scaling = \"none\"\nseq_len = 8192\n");
        assert_eq!((llama3.rope_scaling, llama3.rotary_base), (None, 500_000));
        // YaRN named on a model without it starts from gpt-oss's numbers.
        let yarn = read(
            "base = \"qwen3-30b-a3b\"\nrope_scaling = \"yarn\"\nrope_scaling_factor = 4\nrope_original_positions = 32768\n",
        );
        assert_eq!(
            yarn.rope_scaling,
            Some(RopeScaling::Yarn {
                factor: 4.0,
                original_positions: 32768,
                mscale: 1.0,
                mscale_all_dim: 0.0
            })
        );
        assert_eq!((yarn.rotary_base, yarn.norm_epsilon), (1_000_000, 1e-6));
        // A file's own model and the round trip of each scaling.
        let own = read(
            "base = \"llama3-8b\"\nrotary_base = 1000000\nnorm_epsilon = 1e-6\nrope_scaling = \"llama3\"\nrope_scaling_factor = 32\n",
        );
        assert_eq!(own.rope_scaling, Some(RopeScaling::Llama3 { factor: 32.0 }));
        for model in [own, yarn] {
            assert_eq!(read(&render_model_toml(&model)), model);
        }
        // Taking a base's rotary positions away takes their scaling too.
        for positions in ["no_positions = true", "learned_positions = true"] {
            let plain = read(&format!("base = \"llama3.1-8b\"\n{positions}\n"));
            assert_eq!(plain.rope_scaling, None, "{positions}");
        }
        for (text, expected) in [
            (
                "base = \"llama3-8b\"\nrope_scaling_factor = 8\n",
                "`rope_scaling_factor` needs a rotary scaling",
            ),
            (
                "base = \"llama3.1-8b\"\nrope_original_positions = 8192\n",
                "`rope_original_positions` is YaRN's",
            ),
            (
                "base = \"llama3-8b\"\nrope_scaling = \"ntk\"\n",
                "`rope_scaling = \"ntk\"` is not a rotary scaling",
            ),
            (
                "base = \"gpt3-175b\"\nrope_scaling = \"yarn\"\n",
                "this model has learned ones; remove `rope_scaling`",
            ),
            (
                "base = \"llama3.1-8b\"\nrope_scaling_factor = 0.5\n",
                "`rope_scaling_factor` must be from 1 to 1024",
            ),
            (
                "base = \"llama3-8b\"\nnorm_epsilon = 0\n",
                "`norm_epsilon` must be from 1e-12 to below 1",
            ),
            (
                "base = \"llama3-8b\"\nnorm_epsilon = \"1e-6\"\n",
                "write e.g. `norm_epsilon = 1e-6`",
            ),
            (
                "base = \"llama3-8b\"\nrotary_base = 5e5\n",
                "write e.g. `rotary_base = 500000`",
            ),
            (
                "base = \"llama3-8b\"\nrotary_base = 0\n",
                "`rotary_base` must be a positive integer",
            ),
            (
                "base = \"gpt-oss-20b\"\nrope_mscale = -1\n",
                "`rope_mscale` must be a finite number of 0 or more",
            ),
        ] {
            let e = error(text);
            assert!(e.contains(expected), "{text}: {e}");
        }
    }

    #[test]
    fn router_keys_set_the_score_and_need_experts_and_a_sigmoid_for_the_bias() {
        let read = |text: &str| parse_model_toml(text, "x.toml");
        let v3 = builtin_model("deepseek-v3").unwrap().moe.unwrap();
        assert_eq!(
            (
                v3.router_score,
                v3.router_topk_scaling,
                v3.router_expert_bias
            ),
            (RouterScore::Sigmoid, 2.5, true)
        );
        let sigmoid = read(
            "base = \"qwen3-30b-a3b\"\nmoe_router_score_function = \"sigmoid\"\nmoe_router_enable_expert_bias = true\nmoe_router_topk_scaling_factor = 2\nmoe_router_dtype = \"fp32\"\n",
        )
        .unwrap();
        assert_eq!(sigmoid.moe.unwrap().router_dtype, RouterDtype::Fp32);
        assert_eq!(v3.router_dtype, RouterDtype::Fp32);
        let moe = sigmoid.moe.unwrap();
        assert_eq!(
            (
                moe.router_score,
                moe.router_topk_scaling,
                moe.router_expert_bias
            ),
            (RouterScore::Sigmoid, 2.0, true)
        );
        assert_eq!(read(&render_model_toml(&sigmoid)).unwrap(), sigmoid);
        for (text, expected) in [
            (
                "base = \"qwen3-30b-a3b\"\nmoe_router_enable_expert_bias = true\n",
                "needs a sigmoid router",
            ),
            (
                "base = \"deepseek-v3\"\nmoe_router_score_function = \"softmax\"\n",
                "needs a sigmoid router",
            ),
            (
                "base = \"llama3-8b\"\nmoe_router_score_function = \"sigmoid\"\n",
                "needs a mixture of experts",
            ),
            (
                "base = \"deepseek-v3\"\nmoe_router_score_function = \"relu\"\n",
                "is not a router score",
            ),
            (
                "base = \"deepseek-v3\"\nmoe_router_dtype = \"fp64\"\n",
                "is not a router precision",
            ),
            (
                "base = \"deepseek-v3\"\nmoe_router_topk_scaling_factor = 0\n",
                "must be above 0 and at most 100",
            ),
        ] {
            let e = error(text);
            assert!(e.contains(expected), "{text}: {e}");
        }
    }

    #[test]
    fn no_positions_cannot_be_learned_positions_too() {
        let text = "base = \"gpt3-175b\"\nno_positions = true\n";
        let e = parse_model_toml(text, "nope.toml").unwrap_err().to_string();
        assert!(
            e.contains("`no_positions` and `learned_positions` cannot both be on"),
            "{e}"
        );
        let ok = "base = \"gpt3-175b\"\nno_positions = true\nlearned_positions = false\n";
        assert!(parse_model_toml(ok, "nope.toml").unwrap().no_positions);
    }

    #[test]
    fn gpt_oss_activation_keys_set_change_and_need_a_quick_geglu() {
        let oss = builtin_model("gpt-oss-20b").unwrap();
        assert_eq!(oss.quick_geglu, Some(crate::model::QuickGeglu::GPT_OSS));
        assert!(oss.attention_sinks);
        let plain = parse_model_toml(
            "base = \"gpt-oss-20b\"\nquick_geglu = false\nattention_sinks = false\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!((plain.quick_geglu, plain.attention_sinks), (None, false));
        let unclamped =
            parse_model_toml("base = \"gpt-oss-20b\"\nactivation_clamp = 0\n", "x.toml").unwrap();
        assert!(!unclamped.quick_geglu.unwrap().clamps());
        let own = parse_model_toml(
            "base = \"llama3-8b\"\nquick_geglu = true\nactivation_clamp = 5.5\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!(
            own.quick_geglu,
            Some(crate::model::QuickGeglu {
                clamp: 5.5,
                linear_offset: 0.0
            })
        );
        let err = error("base = \"llama3-8b\"\nactivation_clamp = 7.0\n");
        assert!(err.contains("`quick_geglu = true`"), "{err}");
        let err = error("base = \"gpt-oss-20b\"\nactivation_clamp = -1.0\n");
        assert!(err.contains("`activation_clamp = -1`"), "{err}");
        let err = error("base = \"gpt-oss-20b\"\ngated_mlp = false\n");
        assert!(err.contains("`gated_mlp`"), "{err}");
        let err = error("base = \"gpt-oss-20b\"\nglu_linear_offset = \"one\"\n");
        assert!(
            err.contains("`glu_linear_offset` must be a number"),
            "{err}"
        );
    }

    #[test]
    fn a_window_is_given_taken_away_and_needed_by_its_skip_frequency() {
        let plain = parse_model_toml("base = \"gpt-oss-20b\"\nsliding_window = 0\n", "x.toml");
        assert_eq!(plain.unwrap().window, None);
        let wider = parse_model_toml("base = \"gpt-oss-20b\"\nsliding_window = 512\n", "x.toml");
        assert_eq!(
            wider.unwrap().window,
            Some(crate::model::WindowSpec {
                tokens: 512,
                full_every: 2
            })
        );
        let err = parse_model_toml(
            "base = \"llama3-8b\"\nwindow_attn_skip_freq = 2\n",
            "x.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`window_attn_skip_freq` needs a windowed attention"),
            "{err}"
        );
    }

    #[test]
    fn a_minimal_file_gets_gpt_defaults_and_the_file_name() {
        let text = "hidden = 1024\nheads = 16\nlayers = 24\nvocab = 51200\nseq_len = 2048\n";
        let m = parse_model_toml(text, "some/dir/tiny-gpt.toml").unwrap();
        assert_eq!(m, ModelSpec::gpt("tiny-gpt", 1024, 16, 24, 51200, 2048));
    }

    #[test]
    fn a_base_model_is_overridden_field_by_field() {
        let m = parse_model_toml("base = \"LLAMA3-8B\"\n", "x.toml").unwrap();
        assert_eq!(m, builtin_model("llama3-8b").unwrap());

        let m =
            parse_model_toml("base = \"llama3-8b\"\nseq_len = 32768\n", "dir/long.toml").unwrap();
        let mut want = builtin_model("llama3-8b").unwrap();
        want.seq_len = 32768;
        want.name = "long".into();
        assert_eq!(m, want);

        let m = parse_model_toml(
            "base = \"gpt3-175b\"\nname = \"gpt3-std\"\nattention = \"Standard\"\n",
            "x.toml",
        )
        .unwrap();
        assert_eq!(m.name, "gpt3-std");
        assert_eq!(m.attention, AttentionKind::Standard);
        assert_eq!(m.hidden, 12288);
    }

    #[test]
    fn an_unknown_key_suggests_the_closest_one() {
        let e = error("hiden = 4096\nheads = 32\nlayers = 2\nvocab = 10\nseq_len = 8\n");
        assert!(
            e.contains("unknown key `hiden`") && e.ends_with("; did you mean `hidden`?"),
            "{e}"
        );
        let e = error("base = \"llama3-8b\"\nkv_head = 4\n");
        assert!(e.contains("did you mean `kv_heads`?"), "{e}");
        let e = error("[model]\nhidden = 4096\n");
        assert!(e.contains("`[model]`") && e.contains("top level"), "{e}");
    }

    #[test]
    fn an_unknown_base_suggests_a_catalogue_name() {
        let e = error("base = \"lama3-405b\"\n");
        assert!(e.contains("unknown base model `lama3-405b`"), "{e}");
        assert!(e.ends_with("; did you mean `llama3-405b`?"), "{e}");
        let e = error("base = 8\n");
        assert!(e.contains("`base` must be a string"), "{e}");
    }

    #[test]
    fn missing_required_keys_are_named_with_the_fix() {
        let e = error("hidden = 4096\nheads = 32\nlayers = 32\n");
        assert!(e.contains("missing `vocab`, `seq_len`"), "{e}");
        assert!(e.contains("base = "), "{e}");
    }

    #[test]
    fn bad_numbers_name_their_field() {
        let rest = "heads = 32\nlayers = 32\nvocab = 100\nseq_len = 64\n";
        let e = error(&format!("hidden = -4096\n{rest}"));
        assert!(
            e.contains("`hidden` must be a positive integer, not `-4096`"),
            "{e}"
        );
        let e = error(&format!("hidden = 0\n{rest}"));
        assert!(
            e.contains("`hidden` must be a positive integer, not `0`"),
            "{e}"
        );
        let e = error(&format!("hidden = 4096.5\n{rest}"));
        assert!(
            e.contains("`hidden` must be a positive integer, not `4096.5`"),
            "{e}"
        );
        let e = error(&format!("hidden = \"4096\"\n{rest}"));
        assert!(e.contains("`hidden` must be a positive integer"), "{e}");
        let e = error("base = \"llama3-8b\"\nkv_heads = -1\n");
        assert!(e.contains("`kv_heads` must be a positive integer"), "{e}");
    }

    #[test]
    fn bad_flags_names_and_attention_are_reported() {
        let e = error("base = \"llama3-8b\"\ngated_mlp = \"yes\"\n");
        assert!(e.contains("`gated_mlp` must be `true` or `false`"), "{e}");
        let e = error("base = \"llama3-8b\"\nattention = \"flsh\"\n");
        assert!(e.contains("did you mean `flash`?"), "{e}");
        let e = error("base = \"llama3-8b\"\nname = \" \"\n");
        assert!(e.contains("`name` is empty"), "{e}");
    }

    #[test]
    fn an_impossible_model_reports_the_check() {
        let e = error("hidden = 4000\nheads = 48\nlayers = 2\nvocab = 10\nseq_len = 8\n");
        assert!(e.contains("must be divisible by heads"), "{e}");
        let e = error("base = \"llama3-8b\"\nkv_heads = 5\n");
        assert!(e.contains("must be a multiple of kv_heads"), "{e}");
    }

    #[test]
    fn a_syntax_error_is_one_line_with_its_place() {
        let e = error("hidden = 4096\nheads = = 32\n");
        assert!(e.contains("invalid TOML at line 2"), "{e}");
        assert!(e.contains("fix the syntax"), "{e}");
        let e = error("name = \"unterminated\nhidden = 1\n");
        assert!(e.contains("invalid TOML at line 1"), "{e}");
    }

    #[test]
    fn files_are_loaded_from_disk_and_a_missing_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("llama-like.toml");
        std::fs::write(&path, LLAMA3_8B.replace("name = \"llama3-8b\"", "")).unwrap();
        let m = load_model_file(&path).unwrap();
        assert_eq!(m.name, "llama-like");
        assert_eq!(m.kv_heads, 8);

        let missing = dir.path().join("absent.toml");
        let e = load_model_file(&missing).unwrap_err().to_string();
        assert!(e.starts_with(&missing.display().to_string()), "{e}");
        assert!(e.contains("cannot read model file"), "{e}");
    }
}
