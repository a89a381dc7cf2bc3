//! Transformer model specifications and the counting formulas that depend only
//! on the model (parameters, FLOPs). Nothing here knows about parallelism
//! beyond dividing by a tensor-parallel degree.

mod catalogue;
mod file;

pub use catalogue::{builtin_model, builtin_model_names};
pub use file::{
    ModelFileError, load_model_file, model_file_keys, model_file_values, parse_model_toml,
    render_model_toml,
};

crate::named_choices!(AttentionKind);

use serde::{Deserialize, Serialize};

/// How attention scores are computed; decides whether the `s^2` activation
/// term and its memory traffic exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// Fused memory-efficient kernel (FlashAttention): no `s^2` tensors in memory.
    Flash,
    /// Materialised scores, softmax and dropout (Megatron's fused softmax).
    Standard,
}

impl AttentionKind {
    pub const ALL: [AttentionKind; 2] = [AttentionKind::Flash, AttentionKind::Standard];

    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Flash => "flash",
            AttentionKind::Standard => "standard",
        }
    }
}

/// A decoder-only transformer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    pub hidden: u64,
    pub heads: u64,
    /// Key/value heads (grouped-query attention); equal to `heads` for MHA.
    pub kv_heads: u64,
    /// Width of the MLP's hidden layer (4h for GPT, about 8h/3 for Llama).
    pub ffn_hidden: u64,
    /// Gated MLP (SwiGLU): three projection matrices instead of two.
    pub gated_mlp: bool,
    pub layers: u64,
    pub vocab: u64,
    pub seq_len: u64,
    /// Input embedding and output head share one matrix.
    pub tied_embeddings: bool,
    /// Learned absolute position embeddings (GPT) rather than rotary (Llama).
    pub learned_positions: bool,
    pub attention: AttentionKind,
    /// Dropout on the attention probabilities and the hidden states, as GPT
    /// trains (Megatron-LM's default 0.1); Llama-style models train without
    /// it, so no dropout masks are kept (a dropout of 0 keeps none).
    #[serde(default = "dropout_default")]
    pub dropout: bool,
    /// Width of one attention head where it is not hidden / heads (Qwen3's
    /// 128 at hidden 2048 and 32 heads, gpt-oss's 64 at hidden 2880).
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "head_dim")]
    pub head_dim_override: Option<u64>,
    /// Multi-latent attention (DeepSeek-V2/V3), where the model has it: keys
    /// and values projected through a shared low-rank latent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaSpec>,
    /// Mixture-of-experts layers, where the model has them: the MLP of
    /// every MoE layer is replaced by routed experts (and shared ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeSpec>,
    /// Sliding-window attention, where the model has it (Mistral 7B,
    /// gpt-oss): the windowed layers attend to a few recent tokens only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<WindowSpec>,
    /// Multi-token prediction modules (DeepSeek-V3's one; Megatron-LM's
    /// `--mtp-num-layers`): each predicts one more token ahead through the
    /// shared embedding, a projection of [hidden; embedding] (2h -> h), one
    /// more transformer layer of the last layer's kind and the shared head,
    /// on the last pipeline stage. They are training-only.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtp_layers: u64,
    /// gpt-oss's gated MLP, where the model has it: quick-GeLU in place of
    /// SiLU, its projections clamped first (Megatron-LM's `--quick-geglu
    /// --activation-func-clamp-value --glu-linear-offset`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quick_geglu: Option<QuickGeglu>,
    /// A learnable softmax offset per head (gpt-oss's attention sinks;
    /// Megatron-LM's `--softmax-type learnable`): one more logit per head
    /// that no key owns. FlashAttention has no kernel for it; Transformer
    /// Engine runs it in cuDNN's fused attention.
    #[serde(default, skip_serializing_if = "is_false")]
    pub attention_sinks: bool,
    /// Root-mean-square norms (Llama and the models after it) instead of
    /// GPT's LayerNorm: Megatron-LM's `--normalization RMSNorm`. The same
    /// reads and writes; the export names it. Always written, so a file
    /// without it is one from before it (read as GPT's LayerNorm).
    #[serde(default)]
    pub rms_norm: bool,
    /// Biases on the linear layers, as GPT and gpt-oss have them; Llama,
    /// Mixtral, Qwen3 and DeepSeek-V3 have none (Megatron-LM's
    /// `--disable-bias-linear`). Dense layers add them in fused kernels;
    /// experts' second-linear biases Megatron-Core adds expert by expert
    /// (`cost::layer`'s `expert_bias_bytes`).
    #[serde(default = "linear_bias_default")]
    pub linear_bias: bool,
    /// Queries and keys normalised before attention (Megatron-LM's
    /// `--qk-layernorm`): Qwen3's per-head RMSNorm of each (`q_norm`,
    /// `k_norm` in its config), a kernel apart from the QKV projection;
    /// under multi-latent attention the latents' norms, which Megatron-Core
    /// fuses into the up-projections and paratune prices with them either
    /// way.
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_layernorm: bool,
    /// No position embedding at all, neither learned nor rotary (NoPE:
    /// Megatron-LM's `--position-embedding-type none`, which hybrid models
    /// train with): no rotation of the queries and keys to price.
    #[serde(default, skip_serializing_if = "is_false")]
    pub no_positions: bool,
    /// Base of the rotary embedding's frequencies (rope_theta in Hugging
    /// Face configs; Megatron-LM's `--rotary-base`, default 10000). Only a
    /// rotary model uses it; it changes what is trained, not its cost.
    #[serde(default = "rotary_base_default")]
    pub rotary_base: u64,
    /// How the rotary frequencies are rescaled for a longer context, where
    /// the model does (Llama 3.1's, YaRN); none rescales them. Cost-free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Epsilon of the layer norms (rms_norm_eps in Hugging Face configs;
    /// Megatron-LM's `--norm-epsilon`, default 1e-5). Cost-free.
    #[serde(default = "norm_epsilon_default")]
    pub norm_epsilon: f64,
}

/// Megatron-LM's `--rotary-base` default (and Llama 2's, DeepSeek-V3's).
pub const DEFAULT_ROTARY_BASE: u64 = 10_000;

/// Megatron-LM's `--norm-epsilon` default (and GPT-2's, Llama's).
pub const DEFAULT_NORM_EPSILON: f64 = 1e-5;

/// Far above any model's rotary base (the largest published, 10^7).
const MAX_ROTARY_BASE: u64 = 1 << 40;

/// Far above any model's context rescaling (DeepSeek-V3's 40).
const MAX_ROPE_SCALING_FACTOR: f64 = 1024.0;

/// Far above any router's weight scaling (DeepSeek-V3's 2.5).
const MAX_ROUTER_TOPK_SCALING: f64 = 100.0;

fn rotary_base_default() -> u64 {
    DEFAULT_ROTARY_BASE
}

fn norm_epsilon_default() -> f64 {
    DEFAULT_NORM_EPSILON
}

/// A rescaling of the rotary frequencies for a context longer than the one
/// first trained. Both keep the rotation's cost; they change the model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// Llama 3.1's ("rope_type": "llama3"): low frequencies divided by
    /// `factor`, with the low/high frequency factors 1 and 4 and the
    /// original 8,192 positions Megatron-LM's `--use-rope-scaling` fixes.
    Llama3 { factor: f64 },
    /// YaRN (Peng et al., 2023): frequencies interpolated by `factor` from
    /// `original_positions`, with beta_fast 32 and beta_slow 1 (what every
    /// catalogue model and Megatron-Core's defaults use) and the attention
    /// temperature's `mscale` and `mscale_all_dim`.
    Yarn {
        factor: f64,
        original_positions: u64,
        mscale: f64,
        mscale_all_dim: f64,
    },
}

impl RopeScaling {
    /// Llama 3.1's rescaling to 128K: "rope_scaling" {"rope_type": "llama3",
    /// "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    /// "original_max_position_embeddings": 8192} in its config.json model
    /// cards (Megatron-Bridge's Llama31ModelProvider: rope_scaling_factor 8.0).
    pub const LLAMA31: RopeScaling = RopeScaling::Llama3 { factor: 8.0 };

    /// gpt-oss's YaRN: by 32 from 4,096 positions (config.json), its
    /// reference code's attention temperature 0.1 ln(32) + 1
    /// (openai/gpt-oss `gpt_oss/torch/model.py`, its `concentration`),
    /// which is mscale 1.0 over mscale_all_dim 0.0 in Megatron-Core's terms.
    pub const GPT_OSS_YARN: RopeScaling = RopeScaling::Yarn {
        factor: 32.0,
        original_positions: 4096,
        mscale: 1.0,
        mscale_all_dim: 0.0,
    };

    /// DeepSeek-V3's YaRN: by 40 from 4,096 positions with mscale and
    /// mscale_all_dim 1.0 (its config.json rope_scaling), which leave the
    /// attention temperature as it is.
    pub const DEEPSEEK_V3_YARN: RopeScaling = RopeScaling::Yarn {
        factor: 40.0,
        original_positions: 4096,
        mscale: 1.0,
        mscale_all_dim: 1.0,
    };

    /// Its name in a model file's `rope_scaling` key.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// Its factor.
    pub fn factor(&self) -> f64 {
        match *self {
            RopeScaling::Llama3 { factor } | RopeScaling::Yarn { factor, .. } => factor,
        }
    }

    /// The factor the rotated queries and keys are multiplied by: YaRN's
    /// attention temperature, `mscale(factor, mscale) / mscale(factor,
    /// mscale_all_dim)` with `mscale(s, m) = 0.1 m ln s + 1` (Megatron-Core's
    /// `_yarn_get_concentration_factor`); 1 for Llama 3.1's rescaling.
    /// gpt-oss's is 1.35, DeepSeek-V3's 1.
    pub fn concentration(&self) -> f64 {
        let mscale = |factor: f64, m: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * m * factor.ln() + 1.0
            }
        };
        match *self {
            RopeScaling::Llama3 { .. } => 1.0,
            RopeScaling::Yarn {
                factor,
                mscale: m,
                mscale_all_dim,
                ..
            } => mscale(factor, m) / mscale(factor, mscale_all_dim),
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn linear_bias_default() -> bool {
    true
}

/// gpt-oss's activation, `(x_glu * sigmoid(1.702 x_glu)) * (x_linear +
/// linear_offset)` over the first projection's two halves, each clamped to
/// `clamp` first (x_glu from above only): Megatron-Core's
/// `weighted_bias_quick_geglu_impl` (`megatron/core/fusions/
/// fused_bias_geglu.py`) clamps them with two eager `clamp` kernels and a
/// `torch.cat` outside the fused function, so a clamp costs two more passes
/// over the projection's output forward and keeps the unclamped copy for
/// the clamps' backward.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuickGeglu {
    /// Bound of the clamps (gpt-oss: 7.0); 0 clamps nothing.
    pub clamp: f64,
    /// Added to the linear half (gpt-oss: 1.0).
    pub linear_offset: f64,
}

impl QuickGeglu {
    /// gpt-oss's: clamped at 7 with the linear half offset by 1
    /// (openai/gpt-oss `gpt_oss/torch/model.py`, `swiglu(x, alpha=1.702,
    /// limit=7.0)` and `x_linear + 1`).
    pub const GPT_OSS: QuickGeglu = QuickGeglu {
        clamp: 7.0,
        linear_offset: 1.0,
    };

    /// Whether the projections are clamped (the eager kernels run).
    pub fn clamps(&self) -> bool {
        self.clamp > 0.0
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn dropout_default() -> bool {
    true
}

/// Multi-latent attention's shapes, in Megatron-Core's terms (`--q-lora-rank`,
/// `--kv-lora-rank`, `--qk-head-dim`, `--qk-pos-emb-head-dim`,
/// `--v-head-dim`; DeepSeek-V3's config calls them q_lora_rank,
/// kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaSpec {
    /// Rank of the queries' latent; 0 projects queries directly.
    pub q_lora_rank: u64,
    pub kv_lora_rank: u64,
    /// Per head: the query/key part without position, the rotary part
    /// (its key part shared by all heads), and the value width.
    pub qk_head_dim: u64,
    pub qk_pos_head_dim: u64,
    pub v_head_dim: u64,
}

impl MlaSpec {
    /// A `kv_lora_rank` latent with Megatron-LM's defaults for the rest
    /// (queries projected directly, heads of 128 + 64 rotary, values 128).
    pub fn megatron_defaults(kv_lora_rank: u64) -> MlaSpec {
        MlaSpec {
            q_lora_rank: 0,
            kv_lora_rank,
            qk_head_dim: 128,
            qk_pos_head_dim: 64,
            v_head_dim: 128,
        }
    }
}

/// How tensor parallelism splits one projection of the attention block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Column-parallel: the outputs over the tp ranks.
    Output,
    /// Row-parallel: the inputs over the tp ranks.
    Input,
    /// Whole on every rank (MLA's down-projections).
    Replicated,
}

/// The mixture-of-experts part of a model, in Megatron-Core's terms
/// (`--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size`,
/// `--moe-shared-expert-intermediate-size`, `--moe-layer-freq`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    /// Routed experts per MoE layer.
    pub experts: u64,
    /// Experts each token is routed to.
    pub topk: u64,
    /// Width of one routed expert's MLP (gated like the dense MLP).
    pub ffn_hidden: u64,
    /// Width of the shared experts together (DeepSeek's always-on experts,
    /// Megatron-LM's `--moe-shared-expert-intermediate-size`); 0 for none.
    #[serde(default)]
    pub shared_ffn_hidden: u64,
    /// Leading layers that keep a dense MLP (DeepSeek-V3's first three).
    #[serde(default)]
    pub dense_layers: u64,
    /// After those, every `layer_freq`-th layer is an MoE layer (1: all).
    #[serde(default = "layer_freq_default")]
    pub layer_freq: u64,
    /// Group-limited routing (Megatron-LM's `--moe-router-num-groups`):
    /// the experts in this many equal groups, each token routed within
    /// `router_group_topk` of them (DeepSeek-V3's node-limited routing: 8
    /// groups, 4 chosen); 0 for unlimited routing.
    #[serde(default)]
    pub router_groups: u64,
    /// Groups each token's experts are chosen from (`--moe-router-group-topk`).
    #[serde(default)]
    pub router_group_topk: u64,
    /// How the router scores the experts (`--moe-router-score-function`):
    /// softmax (Megatron-LM's default, Mixtral's, Qwen3's, gpt-oss's) or
    /// sigmoid (DeepSeek-V3's scoring_func). Changes the model, not its cost.
    #[serde(default)]
    pub router_score: RouterScore,
    /// The factor the chosen experts' weights are multiplied by
    /// (`--moe-router-topk-scaling-factor`; DeepSeek-V3's routed_scaling_factor
    /// 2.5); 1 for none.
    #[serde(default = "one")]
    pub router_topk_scaling: f64,
    /// A per-expert bias that steers the choice of experts, balancing them
    /// without an auxiliary loss (`--moe-router-enable-expert-bias`;
    /// DeepSeek-V3's topk_method noaux_tc). Megatron-Core takes it with a
    /// sigmoid score only.
    #[serde(default)]
    pub router_expert_bias: bool,
    /// The precision the router computes its scores in
    /// (`--moe-router-dtype`): the model's, or fp32 as DeepSeek-V3 keeps
    /// its gating (DeepSeek-V3 technical report, section 3.3.1;
    /// Megatron-Bridge's DeepSeek providers). Not priced: Megatron-Core's
    /// fp32 gating GEMM keeps bf16 operands forward and runs its backward
    /// in TF32 (Transformer Engine's `cublas_gemm`), a few microseconds a
    /// layer. Megatron-LM's fp64, a plain fp64 GEMM that Blackwell Ultra
    /// runs at a sliver of its rate, is not offered.
    #[serde(default)]
    pub router_dtype: RouterDtype,
}

/// An MoE router's arithmetic (Megatron-LM's `--moe-router-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouterDtype {
    /// The model's (bf16), Megatron-LM's default.
    #[default]
    Model,
    Fp32,
}

impl RouterDtype {
    pub const ALL: [RouterDtype; 2] = [RouterDtype::Model, RouterDtype::Fp32];

    pub fn name(self) -> &'static str {
        match self {
            RouterDtype::Model => "model",
            RouterDtype::Fp32 => "fp32",
        }
    }

    /// The dtype of that name, whatever its case and surrounding spaces.
    pub fn named(text: &str) -> Option<RouterDtype> {
        RouterDtype::ALL
            .into_iter()
            .find(|dtype| dtype.name().eq_ignore_ascii_case(text.trim()))
    }
}

/// An MoE router's score function (Megatron-LM's `--moe-router-score-function`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouterScore {
    /// Softmax over the chosen experts' logits (or, with
    /// `--moe-router-pre-softmax`, over all of them before choosing).
    #[default]
    Softmax,
    /// Each expert's sigmoid, the chosen ones renormalised.
    Sigmoid,
}

impl RouterScore {
    pub const ALL: [RouterScore; 2] = [RouterScore::Softmax, RouterScore::Sigmoid];

    pub fn name(self) -> &'static str {
        match self {
            RouterScore::Softmax => "softmax",
            RouterScore::Sigmoid => "sigmoid",
        }
    }

    /// The score of that name, whatever its case and surrounding spaces.
    pub fn named(text: &str) -> Option<RouterScore> {
        RouterScore::ALL
            .into_iter()
            .find(|score| score.name().eq_ignore_ascii_case(text.trim()))
    }
}

fn one() -> f64 {
    1.0
}

/// Sliding-window attention (Megatron-LM's `--window-size` and
/// `--window-attn-skip-freq`): each query of a windowed layer attends to
/// itself and the `tokens` before it; every `full_every`-th layer (counted
/// from 1) attends the whole causal context instead, 0 meaning none does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSpec {
    pub tokens: u64,
    pub full_every: u64,
}

/// The share of a layer's full score products (every query against every
/// key) a causal fused kernel computes: the blocks above the diagonal are
/// skipped (Dao, FlashAttention-2, 2023, counts causal attention so).
pub const CAUSAL_SHARE: f64 = 0.5;

/// The most multi-token prediction modules paratune plans (DeepSeek-V3 has
/// one).
pub const MAX_MTP_LAYERS: u64 = 16;

/// The longest sliding window paratune plans, the longest sequence's.
pub const MAX_WINDOW_TOKENS: u64 = 1 << 24;

fn layer_freq_default() -> u64 {
    1
}

impl MoeSpec {
    /// Routes over `groups` expert groups; none is unlimited routing, which
    /// chooses no groups either (a group top-k given after stands).
    pub fn set_router_groups(&mut self, groups: u64) {
        self.router_groups = groups;
        if groups == 0 {
            self.router_group_topk = 0;
        }
    }

    /// `experts` experts with Megatron-LM's defaults for the rest
    /// (`--moe-router-topk 2`, `--moe-ffn-hidden-size` the MLP's width, no
    /// shared experts, every layer an MoE layer).
    pub fn megatron_defaults(experts: u64, ffn_hidden: u64) -> MoeSpec {
        MoeSpec {
            experts,
            topk: 2,
            ffn_hidden,
            shared_ffn_hidden: 0,
            dense_layers: 0,
            layer_freq: 1,
            router_groups: 0,
            router_group_topk: 0,
            router_score: RouterScore::Softmax,
            router_topk_scaling: 1.0,
            router_expert_bias: false,
            router_dtype: RouterDtype::Model,
        }
    }

    /// Whether layer `i` (from 0) has experts.
    pub fn is_moe_layer(&self, i: u64) -> bool {
        i >= self.dense_layers && (i - self.dense_layers).is_multiple_of(self.layer_freq.max(1))
    }

    /// MoE layers among layers `start..end`, counted without a loop.
    pub fn moe_layers_in(&self, start: u64, end: u64) -> u64 {
        let freq = self.layer_freq.max(1);
        let below = |n: u64| {
            // MoE layers among 0..n: the multiples of freq in dense..n.
            if n <= self.dense_layers {
                0
            } else {
                (n - self.dense_layers).div_ceil(freq)
            }
        };
        below(end).saturating_sub(below(start))
    }
}

impl ModelSpec {
    /// A GPT-style model (MLP 4h, learned positions, tied embeddings) as in
    /// Megatron-LM's papers.
    pub fn gpt(name: &str, hidden: u64, heads: u64, layers: u64, vocab: u64, seq_len: u64) -> Self {
        ModelSpec {
            name: name.to_string(),
            hidden,
            heads,
            kv_heads: heads,
            ffn_hidden: 4 * hidden,
            gated_mlp: false,
            layers,
            vocab,
            seq_len,
            tied_embeddings: true,
            learned_positions: true,
            attention: AttentionKind::Flash,
            dropout: true,
            head_dim_override: None,
            mla: None,
            moe: None,
            mtp_layers: 0,
            window: None,
            quick_geglu: None,
            attention_sinks: false,
            rms_norm: false,
            linear_bias: true,
            qk_layernorm: false,
            no_positions: false,
            rotary_base: DEFAULT_ROTARY_BASE,
            rope_scaling: None,
            norm_epsilon: DEFAULT_NORM_EPSILON,
        }
    }

    /// Gives the model `experts` routed experts per MoE layer, keeping the
    /// rest of its MoE shape, or Megatron-LM's defaults for a dense model.
    pub fn set_experts(&mut self, experts: u64) {
        let mut moe = self
            .moe
            .unwrap_or(MoeSpec::megatron_defaults(experts, self.ffn_hidden));
        moe.experts = experts;
        self.moe = Some(moe);
    }

    /// Gives the model multi-latent attention with a `rank` key/value
    /// latent (its other shapes kept, or Megatron-LM's defaults); every
    /// head then has its own keys and values.
    pub fn set_kv_lora_rank(&mut self, rank: u64) {
        let mut mla = self.mla.unwrap_or(MlaSpec::megatron_defaults(rank));
        mla.kv_lora_rank = rank;
        self.mla = Some(mla);
        self.kv_heads = self.heads;
    }

    /// Whether the positions are rotary: neither learned nor absent (NoPE).
    pub fn is_rotary(&self) -> bool {
        !(self.learned_positions || self.no_positions)
    }

    /// Takes a rescaling away from positions that are no longer rotary (a
    /// file or a run row that sets learned or no positions on a rotary
    /// base), so that only a scaling named beside them is refused.
    pub fn drop_scaling_unless_rotary(&mut self) {
        if !self.is_rotary() {
            self.rope_scaling = None;
        }
    }

    /// Width of one query/key head.
    pub fn head_dim(&self) -> u64 {
        if let Some(mla) = self.mla {
            return mla.qk_head_dim + mla.qk_pos_head_dim;
        }
        self.head_dim_override
            .unwrap_or(self.hidden / self.heads.max(1))
    }

    /// Width of the queries: hidden, unless the heads are wider or narrower.
    pub fn q_width(&self) -> u64 {
        self.heads * self.head_dim()
    }

    /// Width of the keys one token's queries attend with: the key heads
    /// (grouped-query attention's fewer), or under MLA as wide as the
    /// queries.
    pub fn k_width(&self) -> u64 {
        match self.mla {
            Some(_) => self.q_width(),
            None => self.kv_heads * self.head_dim(),
        }
    }

    /// Width of the attention's values and of its output before the output
    /// projection: the queries' width, or MLA's value heads.
    pub fn v_width(&self) -> u64 {
        match self.mla {
            Some(mla) => self.heads * mla.v_head_dim,
            None => self.q_width(),
        }
    }

    /// The attention block's projections as (inputs, outputs, how tp splits
    /// them): QKV and the output projection, or MLA's down- and
    /// up-projections of queries and of keys and values and its output
    /// projection. Unused entries are zero-sized; no allocation.
    pub fn attention_projections(&self) -> [(u64, u64, Split); 5] {
        let h = self.hidden;
        let none = (0, 0, Split::Replicated);
        let Some(mla) = self.mla else {
            return [
                (h, self.q_width() + self.kv_width(), Split::Output),
                (self.v_width(), h, Split::Input),
                none,
                none,
                none,
            ];
        };
        let per_head_kv = mla.qk_head_dim + mla.v_head_dim;
        let queries = if mla.q_lora_rank > 0 {
            [
                (h, mla.q_lora_rank, Split::Replicated),
                (mla.q_lora_rank, self.q_width(), Split::Output),
            ]
        } else {
            [(h, self.q_width(), Split::Output), none]
        };
        [
            queries[0],
            queries[1],
            (h, mla.kv_lora_rank + mla.qk_pos_head_dim, Split::Replicated),
            (mla.kv_lora_rank, self.heads * per_head_kv, Split::Output),
            (self.v_width(), h, Split::Input),
        ]
    }

    /// MLA's column-parallel up-projections out of its latents, (input,
    /// output) features: the queries' (with a query rank; (0, 0) without)
    /// and the keys' and values'. Empty without MLA.
    pub fn mla_up_projections(&self) -> Vec<(u64, u64)> {
        if self.mla.is_none() {
            return Vec::new();
        }
        let projections = self.attention_projections();
        [projections[1], projections[3]]
            .iter()
            .map(|&(input, output, _)| (input, output))
            .collect()
    }

    /// Widths per token of the latents MLA keeps between its down- and
    /// up-projections (0 without MLA).
    pub fn latent_width(&self) -> u64 {
        self.mla
            .map_or(0, |m| m.q_lora_rank + m.kv_lora_rank + m.qk_pos_head_dim)
    }

    /// Width of the key and value projections together.
    pub fn kv_width(&self) -> u64 {
        match self.mla {
            // Keys as wide as the queries, values as the value heads.
            Some(_) => self.q_width() + self.v_width(),
            None => 2 * self.kv_heads * self.head_dim(),
        }
    }

    /// Parameters of one layer's attention block: QKV and output projection
    /// with their biases, and the block's layer norm.
    pub fn attention_params(&self) -> f64 {
        let h = self.hidden as f64;
        if self.mla.is_some() {
            // DeepSeek's projections have no biases; the two latents have
            // their own norms.
            let matrices: f64 = self
                .attention_projections()
                .iter()
                .map(|&(i, o, _)| (i * o) as f64)
                .sum();
            let latent_norms = self.mla.map_or(0, |m| m.q_lora_rank + m.kv_lora_rank) as f64;
            return matrices + latent_norms + 2.0 * h;
        }
        let q = self.q_width() as f64;
        let kv = self.kv_width() as f64;
        h * (q + kv) + q + kv + q * h + h + 2.0 * h
    }

    /// Matrices of an MLP of this model (gated: up, gate and down).
    fn mlp_matrices(&self) -> f64 {
        if self.gated_mlp { 3.0 } else { 2.0 }
    }

    /// Parameters of an MLP `width` wide, biases included.
    pub fn mlp_params(&self, width: u64) -> f64 {
        let h = self.hidden as f64;
        let f = width as f64;
        self.mlp_matrices() * h * f + f + h
    }

    /// Parameters of one dense layer (weights and biases, two layer norms).
    pub fn dense_layer_params(&self) -> f64 {
        self.attention_params() + self.mlp_params(self.ffn_hidden) + 2.0 * self.hidden as f64
    }

    /// Parameters of one MoE layer's experts (all of them), and of the rest
    /// of that layer (attention, router, shared experts, norms).
    pub fn moe_layer_params(&self) -> Option<(f64, f64)> {
        let moe = self.moe?;
        let h = self.hidden as f64;
        let experts = moe.experts as f64 * self.mlp_params(moe.ffn_hidden);
        let shared = if moe.shared_ffn_hidden > 0 {
            self.mlp_params(moe.shared_ffn_hidden)
        } else {
            0.0
        };
        let router = h * moe.experts as f64;
        Some((experts, self.attention_params() + shared + router + 2.0 * h))
    }

    /// Layers with experts (0 for a dense model).
    pub fn moe_layers(&self) -> u64 {
        self.moe.map_or(0, |m| m.moe_layers_in(0, self.layers))
    }

    /// Parameters of one transformer layer, averaged over the model's dense
    /// and MoE layers (all experts counted).
    pub fn params_per_layer(&self) -> f64 {
        let moe = self.moe_layers() as f64;
        let dense = self.layers as f64 - moe;
        let moe_params = self.moe_layer_params().map_or(0.0, |(e, rest)| e + rest);
        (dense * self.dense_layer_params() + moe * moe_params) / self.layers.max(1) as f64
    }

    /// Parameters of one layer that tensor parallelism does not split: the two
    /// layer norms (2h each) and the biases of the row-parallel projection
    /// and MLP-down linears (h each), as Megatron-LM keeps them on every rank.
    pub fn replicated_params_per_layer(&self) -> f64 {
        6.0 * self.hidden as f64
    }

    /// Parameters of the word embedding (and of the output head when untied).
    pub fn embedding_params(&self) -> f64 {
        (self.vocab * self.hidden) as f64
    }

    pub fn position_params(&self) -> f64 {
        if self.learned_positions {
            (self.seq_len * self.hidden) as f64
        } else {
            0.0
        }
    }

    /// Whether the multi-token prediction layers are MoE layers (the kind
    /// of the model's last layer).
    pub fn mtp_is_moe(&self) -> bool {
        self.moe
            .is_some_and(|m| m.is_moe_layer(self.layers.saturating_sub(1)))
    }

    /// Parameters of one multi-token prediction module besides its layer:
    /// the 2h -> h projection and the RMSNorms of the hidden state, the
    /// embedding and the module's output (the embedding and head are the
    /// model's own).
    pub fn mtp_extra_params(&self) -> f64 {
        let h = self.hidden as f64;
        2.0 * h * h + 3.0 * h
    }

    /// Parameters of the multi-token prediction modules (0 without them).
    pub fn mtp_params(&self) -> f64 {
        let layer = match self.moe_layer_params() {
            Some((experts, rest)) if self.mtp_is_moe() => experts + rest,
            _ => self.dense_layer_params(),
        };
        self.mtp_layers as f64 * (layer + self.mtp_extra_params())
    }

    /// All parameters of the model, counted once.
    pub fn total_params(&self) -> f64 {
        let head = if self.tied_embeddings {
            0.0
        } else {
            self.embedding_params()
        };
        let moe = self.moe_layers() as f64;
        let dense = self.layers as f64 - moe;
        let moe_params = self.moe_layer_params().map_or(0.0, |(e, rest)| e + rest);
        dense * self.dense_layer_params()
            + moe * moe_params
            + self.embedding_params()
            + head
            + self.position_params()
            + 2.0 * self.hidden as f64 // final layer norm
            + self.mtp_params()
    }

    /// Parameters a token passes through: the model with only its top-k
    /// routed experts counted (the "active" parameters model cards quote).
    pub fn active_params(&self) -> f64 {
        let Some(moe) = self.moe else {
            return self.total_params();
        };
        let mtp_moe = if self.mtp_is_moe() {
            self.mtp_layers
        } else {
            0
        };
        let unused = (moe.experts - moe.topk.min(moe.experts)) as f64
            * self.mlp_params(moe.ffn_hidden)
            * (self.moe_layers() + mtp_moe) as f64;
        self.total_params() - unused
    }

    /// GEMM FLOPs per token of the attention block's projections, forward.
    pub fn attention_gemm_flops_per_token(&self) -> f64 {
        let entries: u64 = self
            .attention_projections()
            .iter()
            .map(|&(i, o, _)| i * o)
            .sum();
        2.0 * entries as f64
    }

    /// GEMM FLOPs per token of an MLP `width` wide, forward.
    pub fn mlp_flops_per_token(&self, width: u64) -> f64 {
        2.0 * self.mlp_matrices() * self.hidden as f64 * width as f64
    }

    /// GEMM FLOPs per token of one MoE layer's MLP part, forward: the
    /// router, the top-k routed experts and the shared experts.
    pub fn moe_mlp_flops_per_token(&self) -> Option<f64> {
        let moe = self.moe?;
        let router = 2.0 * self.hidden as f64 * moe.experts as f64;
        let routed = moe.topk as f64 * self.mlp_flops_per_token(moe.ffn_hidden);
        let shared = self.mlp_flops_per_token(moe.shared_ffn_hidden);
        Some(router + routed + shared)
    }

    /// GEMM FLOPs of one layer's forward pass per token, excluding the
    /// attention-score products (which scale with the sequence), averaged
    /// over dense and MoE layers (a token's active experts only).
    pub fn layer_gemm_flops_per_token(&self) -> f64 {
        let dense_mlp = self.mlp_flops_per_token(self.ffn_hidden);
        let moe = self.moe_layers() as f64;
        let mlp = match self.moe_mlp_flops_per_token() {
            Some(moe_mlp) => {
                (dense_mlp * (self.layers as f64 - moe) + moe_mlp * moe) / self.layers.max(1) as f64
            }
            None => dense_mlp,
        };
        self.attention_gemm_flops_per_token() + mlp
    }

    /// Layers whose attention is windowed.
    pub fn windowed_layers(&self) -> u64 {
        match self.window {
            None => 0,
            Some(w) if w.full_every == 0 => self.layers,
            Some(w) => self.layers - self.layers / w.full_every,
        }
    }

    /// The share of the full score products a fused kernel computes,
    /// averaged over the layers ([`attended_layers`](Self::attended_layers)).
    pub fn attended_share(&self) -> f64 {
        self.attended_layers()
            .iter()
            .map(|&(layers, share)| layers * share)
            .sum()
    }

    /// The layers by how much of the full score products each computes:
    /// (share of the layers, share of the products), windowed layers then
    /// causal ones. A causal layer computes [`CAUSAL_SHARE`]; a windowed
    /// one the mean of min(position, t) keys per query over the sequence,
    /// t/s (1 - t/2s), where t counts the query and the tokens before it;
    /// it meets the causal half at t = s. A layer's mean keys per query
    /// row are its share times the sequence.
    pub fn attended_layers(&self) -> [(f64, f64); 2] {
        let Some(window) = self.window else {
            return [(0.0, CAUSAL_SHARE), (1.0, CAUSAL_SHARE)];
        };
        let (t, s) = ((window.tokens + 1) as f64, self.seq_len.max(1) as f64);
        let windowed = if t >= s {
            CAUSAL_SHARE
        } else {
            t / s * (1.0 - t / (2.0 * s))
        };
        let share = self.windowed_layers() as f64 / self.layers.max(1) as f64;
        [(share, windowed), (1.0 - share, CAUSAL_SHARE)]
    }

    /// [`layer_attention_flops_per_token`](Self::layer_attention_flops_per_token)
    /// as FLOP counts take it (every query against every key, the published
    /// convention), with windowed layers counted for the keys they attend:
    /// the same for a model without windows.
    pub fn counted_attention_flops_per_token(&self) -> f64 {
        self.layer_attention_flops_per_token() * (self.attended_share() / CAUSAL_SHARE)
    }

    /// The head width the attention's products run over: the mean of the
    /// query/key and the value heads' (MLA's differ), FLOPs per score
    /// element over four.
    pub fn attention_head_width(&self) -> f64 {
        (self.q_width() + self.v_width()) as f64 / (2 * self.heads.max(1)) as f64
    }

    /// FLOPs of the two attention-score products (QK^T and AV) per token, forward.
    pub fn layer_attention_flops_per_token(&self) -> f64 {
        // QK^T over the query/key width, AV over the value width.
        2.0 * self.seq_len as f64 * (self.q_width() + self.v_width()) as f64
    }

    /// Forward FLOPs of the output head per token.
    pub fn head_flops_per_token(&self) -> f64 {
        2.0 * (self.hidden * self.vocab) as f64
    }

    /// Model FLOPs of one training iteration over `global_batch` sequences,
    /// forward plus backward, without recomputation: the numerator of MFU.
    /// For GPT shapes this is the published `72 B s L h^2 (1 + s/6h + V/12hL)`.
    pub fn model_flops_per_iteration(&self, global_batch: u64) -> f64 {
        let tokens = (global_batch * self.seq_len) as f64;
        let per_token_fwd = self.layers as f64
            * (self.layer_gemm_flops_per_token() + self.counted_attention_flops_per_token())
            + self.head_flops_per_token()
            + self.mtp_flops_per_token();
        3.0 * tokens * per_token_fwd
    }

    /// Forward FLOPs per token of the multi-token prediction modules: each
    /// one's projection, layer (its kind's active GEMMs) and head.
    pub fn mtp_flops_per_token(&self) -> f64 {
        if self.mtp_layers == 0 {
            return 0.0;
        }
        let h = self.hidden as f64;
        let mlp = match self.moe_mlp_flops_per_token() {
            Some(moe) if self.mtp_is_moe() => moe,
            _ => self.mlp_flops_per_token(self.ffn_hidden),
        };
        let layer =
            self.attention_gemm_flops_per_token() + mlp + self.counted_attention_flops_per_token();
        self.mtp_layers as f64 * (2.0 * 2.0 * h * h + layer + self.head_flops_per_token())
    }

    /// Names a problem that makes the model impossible, if any.
    pub fn check(&self) -> Result<(), String> {
        crate::text::check_printable("model name", &self.name)?;
        let positive = [
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn_hidden", self.ffn_hidden),
            ("layers", self.layers),
            ("vocab", self.vocab),
            ("seq_len", self.seq_len),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(format!("model `{}`: {field} must be positive", self.name));
            }
        }
        if self.head_dim_override == Some(0) {
            return Err(format!("model `{}`: head_dim must be positive", self.name));
        }
        if self.head_dim_override.is_none() && !self.hidden.is_multiple_of(self.heads) {
            return Err(format!(
                "model `{}`: hidden ({}) must be divisible by heads ({}); change one of them",
                self.name, self.hidden, self.heads
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "model `{}`: heads ({}) must be a multiple of kv_heads ({}); give kv_heads a divisor of heads",
                self.name, self.heads, self.kv_heads
            ));
        }
        if self.mtp_layers > MAX_MTP_LAYERS {
            return Err(format!(
                "model `{}`: `mtp_layers {}` is more than paratune plans for; give at most {MAX_MTP_LAYERS} (DeepSeek-V3 has 1)",
                self.name, self.mtp_layers
            ));
        }
        if let Some(window) = self.window
            && window.tokens > MAX_WINDOW_TOKENS
        {
            return Err(format!(
                "model `{}`: `sliding_window {}` is more than paratune plans for; give at most {MAX_WINDOW_TOKENS}, or 0 for full attention",
                self.name, window.tokens
            ));
        }
        if let Some(moe) = self.moe {
            self.check_moe(&moe)?;
        }
        if let Some(glu) = self.quick_geglu {
            if !self.gated_mlp {
                return Err(format!(
                    "model `{}`: `quick_geglu` is a gated MLP: turn `gated_mlp` on or `quick_geglu` off",
                    self.name
                ));
            }
            if !(glu.clamp >= 0.0 && glu.clamp.is_finite()) {
                return Err(format!(
                    "model `{}`: `activation_clamp` must be a finite bound of 0 or more (0: no clamp)",
                    self.name
                ));
            }
            if !glu.linear_offset.is_finite() {
                return Err(format!(
                    "model `{}`: `glu_linear_offset` must be a finite number (gpt-oss: 1)",
                    self.name
                ));
            }
        }
        if self.no_positions && self.learned_positions {
            return Err(format!(
                "model `{}`: `no_positions` and `learned_positions` cannot both be on; turn one off",
                self.name
            ));
        }
        self.check_positions()?;
        if self.window.is_some_and(|w| w.tokens == 0) {
            return Err(format!(
                "model `{}`: `sliding_window` must be positive; leave it out for full attention",
                self.name
            ));
        }
        Ok(())
    }

    /// The rotary base, its scaling and the norms' epsilon: positive and
    /// finite, and a scaling only on a rotary model.
    fn check_positions(&self) -> Result<(), String> {
        let name = &self.name;
        if !(1..=MAX_ROTARY_BASE).contains(&self.rotary_base) {
            return Err(format!(
                "model `{name}`: `rotary_base` must be from 1 to {MAX_ROTARY_BASE} (Llama 3: 500000; Megatron-LM's default 10000)"
            ));
        }
        if !(1e-12..1.0).contains(&self.norm_epsilon) {
            return Err(format!(
                "model `{name}`: `norm_epsilon` must be from 1e-12 to below 1 (Llama: 1e-5, Qwen3: 1e-6)"
            ));
        }
        let Some(scaling) = self.rope_scaling else {
            return Ok(());
        };
        if !self.is_rotary() {
            return Err(format!(
                "model `{name}`: `rope_scaling` rescales rotary positions, and this model has {}; remove `rope_scaling`",
                if self.no_positions {
                    "none"
                } else {
                    "learned ones"
                }
            ));
        }
        if !(1.0..=MAX_ROPE_SCALING_FACTOR).contains(&scaling.factor()) {
            return Err(format!(
                "model `{name}`: `rope_scaling_factor` must be from 1 to {MAX_ROPE_SCALING_FACTOR} (Llama 3.1: 8, gpt-oss: 32)"
            ));
        }
        if let RopeScaling::Yarn {
            original_positions,
            mscale,
            mscale_all_dim,
            ..
        } = scaling
        {
            if original_positions == 0 {
                return Err(format!(
                    "model `{name}`: `rope_original_positions` must be positive (gpt-oss, DeepSeek-V3: 4096)"
                ));
            }
            for (key, value) in [
                ("rope_mscale", mscale),
                ("rope_mscale_all_dim", mscale_all_dim),
            ] {
                if !(value >= 0.0 && value.is_finite()) {
                    return Err(format!(
                        "model `{name}`: `{key}` must be a finite number of 0 or more (DeepSeek-V3: 1.0)"
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_moe(&self, moe: &MoeSpec) -> Result<(), String> {
        let name = &self.name;
        for (field, value) in [
            ("experts", moe.experts),
            ("moe_topk", moe.topk),
            ("moe_ffn_hidden", moe.ffn_hidden),
            ("moe_layer_freq", moe.layer_freq),
        ] {
            if value == 0 {
                return Err(format!("model `{name}`: {field} must be positive"));
            }
        }
        if moe.topk > moe.experts {
            return Err(format!(
                "model `{name}`: `moe_topk` ({}) cannot exceed the {} experts; route to at most as many experts as there are",
                moe.topk, moe.experts
            ));
        }
        if self.moe_layers() == 0 {
            return Err(format!(
                "model `{name}`: `moe_dense_layers` ({}) leaves no MoE layer of the {}; lower `moe_dense_layers`",
                moe.dense_layers, self.layers
            ));
        }
        check_router_groups(name, moe)?;
        check_router_score(name, moe)
    }
}

/// The router's score: a scaling of the weights above 0 and at most
/// [`MAX_ROUTER_TOPK_SCALING`], and the expert bias only with a sigmoid score (Megatron-Core's
/// `TransformerConfig` raises otherwise).
fn check_router_score(name: &str, moe: &MoeSpec) -> Result<(), String> {
    let scaling = moe.router_topk_scaling;
    if !(scaling > 0.0 && scaling <= MAX_ROUTER_TOPK_SCALING) {
        return Err(format!(
            "model `{name}`: `moe_router_topk_scaling_factor` must be above 0 and at most {MAX_ROUTER_TOPK_SCALING} (1: none; DeepSeek-V3: 2.5)"
        ));
    }
    if moe.router_expert_bias && moe.router_score != RouterScore::Sigmoid {
        return Err(format!(
            "model `{name}`: `moe_router_enable_expert_bias` needs a sigmoid router (Megatron-Core refuses it with softmax); set `moe_router_score_function sigmoid` or turn the bias off"
        ));
    }
    Ok(())
}

/// Group-limited routing's shape: groups that split the experts evenly, and
/// enough chosen groups to hold a token's top-k experts.
fn check_router_groups(name: &str, moe: &MoeSpec) -> Result<(), String> {
    let (groups, chosen) = (moe.router_groups, moe.router_group_topk);
    if groups == 0 {
        return match chosen {
            0 => Ok(()),
            _ => Err(format!(
                "model `{name}`: `moe_router_group_topk` needs `moe_router_num_groups`; give both or neither"
            )),
        };
    }
    if !moe.experts.is_multiple_of(groups) {
        return Err(format!(
            "model `{name}`: `moe_router_num_groups` ({groups}) must divide the {} experts; use a divisor of it",
            moe.experts
        ));
    }
    if chosen == 0 || chosen > groups {
        return Err(format!(
            "model `{name}`: `moe_router_group_topk` ({chosen}) must be from 1 to the {groups} groups; set it to the groups each token may use"
        ));
    }
    if moe.topk > chosen * (moe.experts / groups) {
        return Err(format!(
            "model `{name}`: `moe_topk` ({}) exceeds the {} experts of {chosen} groups; raise `moe_router_group_topk`",
            moe.topk,
            chosen * (moe.experts / groups)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windowed_layers_attend_to_their_window_and_full_ones_causally() {
        let mut m = crate::model::builtin_model("gpt-oss-120b").unwrap();
        assert_eq!(m.windowed_layers(), 18);
        // 127 tokens before each query and the query itself, 128 of 4,096
        // keys: t/s (1 - t/2s) for half the layers, the causal half for the
        // others.
        let windowed = 128.0 / 4096.0 * (1.0 - 128.0 / 8192.0);
        assert!((m.attended_share() - (windowed + CAUSAL_SHARE) / 2.0).abs() < 1e-12);
        // A window as long as the sequence is plain causal attention.
        m.seq_len = 128;
        assert_eq!(m.attended_share(), CAUSAL_SHARE);
        m.seq_len = 4096;
        // Every layer windowed, or none.
        m.window = Some(WindowSpec {
            tokens: 128,
            full_every: 0,
        });
        assert_eq!(m.windowed_layers(), m.layers);
        m.window = None;
        assert_eq!(m.attended_share(), CAUSAL_SHARE);
        assert_eq!(
            m.counted_attention_flops_per_token(),
            m.layer_attention_flops_per_token()
        );
    }

    #[test]
    fn gpt_parameter_count_matches_the_published_formula() {
        // P = 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h))
        let m = ModelSpec::gpt("gpt3-175b", 12288, 96, 96, 51200, 2048);
        let (l, h, v, s) = (96.0, 12288.0, 51200.0, 2048.0);
        let published = 12.0 * l * h * h * (1.0 + 13.0 / (12.0 * h) + (v + s) / (12.0 * l * h));
        let rel = (m.total_params() - published).abs() / published;
        assert!(rel < 1e-4, "relative difference {rel}");
    }

    #[test]
    fn gpt_model_flops_match_the_published_formula() {
        let m = ModelSpec::gpt("x", 4096, 32, 36, 51200, 2048);
        let (b, l, h, v, s) = (512.0, 36.0, 4096.0, 51200.0, 2048.0);
        let published = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l));
        let rel = (m.model_flops_per_iteration(512) - published).abs() / published;
        assert!(rel < 1e-9, "relative difference {rel}");
    }
}
