//! Built-in models: the shapes published for well-known decoder-only
//! transformers, so that a plan can name a model instead of describing it.

use super::{
    AttentionKind, DEFAULT_NORM_EPSILON, DEFAULT_ROTARY_BASE, MlaSpec, ModelSpec, MoeSpec,
    RopeScaling, RouterDtype, RouterScore,
};

/// GPT shapes: (name, hidden, heads, layers). All use vocabulary 51200 and
/// sequence 2048, MLP 4h, learned positions and tied embeddings.
// Source: Narayanan et al., "Efficient Large-Scale Language Model Training on
// GPU Clusters Using Megatron-LM", SC'21, Table 1.
const MEGATRON_SC21: [(&str, u64, u64, u64); 10] = [
    ("gpt-1.7b", 2304, 24, 24),
    ("gpt-3.6b", 3072, 32, 30),
    ("gpt-7.5b", 4096, 32, 36),
    ("gpt-18.4b", 6144, 48, 40),
    ("gpt-39.1b", 8192, 64, 48),
    ("gpt-76.1b", 10240, 80, 60),
    ("gpt-145.6b", 12288, 96, 80),
    ("gpt-310.1b", 16384, 128, 96),
    ("gpt-529.6b", 20480, 128, 105),
    ("gpt-1t", 25600, 160, 128),
];

// Source: Brown et al., "Language Models are Few-Shot Learners", 2020, Table 2.1
// (GPT-3 13B and 175B), with Megatron's vocabulary padding to 51200.
const GPT3: [(&str, u64, u64, u64); 2] = [("gpt3-175b", 12288, 96, 96), ("gpt3-13b", 5120, 40, 40)];

const GPT_VOCAB: u64 = 51200;
const GPT_SEQ: u64 = 2048;

/// A Llama shape: SwiGLU MLP, rotary positions, RMSNorm, no biases, untied
/// head, grouped-query attention where `kv_heads < heads`.
struct Llama {
    name: &'static str,
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    ffn_hidden: u64,
    layers: u64,
    vocab: u64,
    seq_len: u64,
}

// Source: Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models",
// 2023, and the meta-llama/Llama-2-*-hf config.json model cards.
#[rustfmt::skip]
const LLAMA2: [Llama; 3] = [
    Llama { name: "llama2-7b", hidden: 4096, heads: 32, kv_heads: 32, ffn_hidden: 11008, layers: 32, vocab: 32000, seq_len: 4096 },
    Llama { name: "llama2-13b", hidden: 5120, heads: 40, kv_heads: 40, ffn_hidden: 13824, layers: 40, vocab: 32000, seq_len: 4096 },
    Llama { name: "llama2-70b", hidden: 8192, heads: 64, kv_heads: 8, ffn_hidden: 28672, layers: 80, vocab: 32000, seq_len: 4096 },
];

// Source: Llama Team, "The Llama 3 Herd of Models", 2024, Table 3, and the
// meta-llama/Llama-3.1-*B config.json model cards (pre-training sequence 8192).
#[rustfmt::skip]
const LLAMA3: [Llama; 3] = [
    Llama { name: "llama3-8b", hidden: 4096, heads: 32, kv_heads: 8, ffn_hidden: 14336, layers: 32, vocab: 128256, seq_len: 8192 },
    Llama { name: "llama3-70b", hidden: 8192, heads: 64, kv_heads: 8, ffn_hidden: 28672, layers: 80, vocab: 128256, seq_len: 8192 },
    Llama { name: "llama3-405b", hidden: 16384, heads: 128, kv_heads: 8, ffn_hidden: 53248, layers: 126, vocab: 128256, seq_len: 8192 },
];

// Llama 3.1 at its 128K context (`max_position_embeddings` 131072 in the
// meta-llama/Llama-3.1-*B config.json model cards; the paper's long-context
// pre-training stage), the shapes of Llama 3.
#[rustfmt::skip]
const LLAMA31_128K: [Llama; 3] = [
    Llama { name: "llama3.1-8b", hidden: 4096, heads: 32, kv_heads: 8, ffn_hidden: 14336, layers: 32, vocab: 128256, seq_len: 131_072 },
    Llama { name: "llama3.1-70b", hidden: 8192, heads: 64, kv_heads: 8, ffn_hidden: 28672, layers: 80, vocab: 128256, seq_len: 131_072 },
    Llama { name: "llama3.1-405b", hidden: 16384, heads: 128, kv_heads: 8, ffn_hidden: 53248, layers: 126, vocab: 128256, seq_len: 131_072 },
];

/// A mixture-of-experts model with Llama's layer (SwiGLU, rotary, RMSNorm,
/// untied head, no dropout) as its `family` changes it: every layer's MLP
/// routed to `experts`.
struct Moe {
    name: &'static str,
    family: MoeFamily,
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    /// Where a head is not hidden / heads wide.
    head_dim: Option<u64>,
    layers: u64,
    vocab: u64,
    seq_len: u64,
    experts: u64,
    topk: u64,
    expert_ffn: u64,
}

/// How a mixture-of-experts family's layer differs from Llama's (the
/// sources are the `MOE` table's).
#[derive(Clone, Copy)]
enum MoeFamily {
    /// Mixtral: Llama's layer as it is.
    Mixtral,
    /// Qwen3: each head's query and key normalised (q_norm and k_norm in
    /// modeling_qwen3.py; qk_layernorm in Megatron-Bridge's Qwen3 providers).
    Qwen3,
    /// gpt-oss: alternate layers windowed, attention sinks, the clamped
    /// quick-GeGLU, and biased linears (add_bias_linear: true in the
    /// recipes, as openai/gpt-oss's linears carry biases).
    GptOss,
}

impl MoeFamily {
    fn apply(self, spec: &mut ModelSpec) {
        match self {
            MoeFamily::Mixtral => spec.rotary_base = 1_000_000,
            MoeFamily::Qwen3 => {
                spec.qk_layernorm = true;
                spec.rotary_base = 1_000_000;
                spec.norm_epsilon = 1e-6;
            }
            MoeFamily::GptOss => {
                spec.rotary_base = 150_000;
                spec.rope_scaling = Some(RopeScaling::GPT_OSS_YARN);
                spec.window = Some(crate::model::WindowSpec {
                    tokens: 127,
                    full_every: 2,
                });
                spec.quick_geglu = Some(crate::model::QuickGeglu::GPT_OSS);
                spec.attention_sinks = true;
                spec.linear_bias = true;
            }
        }
    }
}

// Sources, each model's config.json on Hugging Face (as reproduced by the
// official code where the page itself was not at hand) and its model card:
// - mixtral-8x7b: mistralai/Mixtral-8x7B-v0.1 (32 layers, 8 experts, top-2,
//   expert width 14336; Jiang et al., "Mixtral of Experts", 2024: 46.7B
//   parameters, 12.9B active, trained with a 32K context).
// - mixtral-8x22b: mistralai/Mixtral-8x22B-v0.1 (56 layers, 8 experts of
//   16384, vocabulary 32768 of the v3 tokenizer; Mistral AI: 141B, 39B
//   active, 64K context).
// - qwen3-30b-a3b, qwen3-235b-a22b: Qwen/Qwen3-30B-A3B and
//   Qwen/Qwen3-235B-A22B (128 experts, top-8, head_dim 128; torchtitan's
//   qwen3 flavours agree; Qwen3 technical report: pre-training stages 1
//   and 2 at 4,096 tokens; 30.5B/3.3B and 235B/22B).
// - gpt-oss-20b, gpt-oss-120b: openai/gpt-oss (`gpt_oss/torch/model.py`:
//   hidden 2880, 64 heads of 64, 8 KV heads, experts 2880 wide, top-4,
//   initial context 4096; 20.9B and 116.8B). Their alternate layers attend
//   over a 128-token window that holds the query itself (config.json's
//   sliding_window 128, layer_types sliding then full): 127 tokens before
//   each query, Megatron-LM's --window-size 127,0 --window-attn-skip-freq 2
//   as Megatron-Bridge's gpt-oss recipes set it (window_size (127, 0) in
//   scripts/performance/dryrun_configs/gpt_oss/*.yaml), and FlashAttention's
//   window_size (127, 0) in vLLM's gpt-oss. Their attention has sinks (a
//   learnable logit per head: `softmax_type: learnable` in those recipes)
//   and their MLP is a quick-GeGLU clamped at 7 with the linear half offset
//   by 1 (`activation_func: quick_gelu`, `activation_func_clamp_value: 7.0`,
//   `glu_linear_offset: 1.0`).
// Their positions and norms, from the same config.json files and
// Megatron-Bridge's providers of them (`src/megatron/bridge/models/*/`):
// Mixtral rope_theta 1e6, rms_norm_eps 1e-5; Qwen3 rope_theta 1e6,
// rms_norm_eps 1e-6, no rope_scaling (the 2507 releases' larger bases are
// not these models); gpt-oss rope_theta 150000, rms_norm_eps 1e-5, YaRN
// (factor 32 from 4,096 positions, beta_fast 32, beta_slow 1, the
// reference code's concentration: `RopeScaling::GPT_OSS_YARN`).
#[rustfmt::skip]
const MOE: [Moe; 6] = [
    Moe { name: "mixtral-8x7b", family: MoeFamily::Mixtral, hidden: 4096, heads: 32, kv_heads: 8, head_dim: None, layers: 32, vocab: 32000, seq_len: 32768, experts: 8, topk: 2, expert_ffn: 14336 },
    Moe { name: "mixtral-8x22b", family: MoeFamily::Mixtral, hidden: 6144, heads: 48, kv_heads: 8, head_dim: None, layers: 56, vocab: 32768, seq_len: 65536, experts: 8, topk: 2, expert_ffn: 16384 },
    Moe { name: "qwen3-30b-a3b", family: MoeFamily::Qwen3, hidden: 2048, heads: 32, kv_heads: 4, head_dim: Some(128), layers: 48, vocab: 151_936, seq_len: 4096, experts: 128, topk: 8, expert_ffn: 768 },
    Moe { name: "qwen3-235b-a22b", family: MoeFamily::Qwen3, hidden: 4096, heads: 64, kv_heads: 4, head_dim: Some(128), layers: 94, vocab: 151_936, seq_len: 4096, experts: 128, topk: 8, expert_ffn: 1536 },
    Moe { name: "gpt-oss-20b", family: MoeFamily::GptOss, hidden: 2880, heads: 64, kv_heads: 8, head_dim: Some(64), layers: 24, vocab: 201_088, seq_len: 4096, experts: 32, topk: 4, expert_ffn: 2880 },
    Moe { name: "gpt-oss-120b", family: MoeFamily::GptOss, hidden: 2880, heads: 64, kv_heads: 8, head_dim: Some(64), layers: 36, vocab: 201_088, seq_len: 4096, experts: 128, topk: 4, expert_ffn: 2880 },
];

/// DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json and its
/// `README_WEIGHTS.md`; DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024):
/// 61 layers, the first three dense (18432 wide), then 256 routed experts
/// of 2048 with top-8 and one shared expert, multi-latent attention (q/kv
/// latents 1536/512, heads 128 + 64 rotary, values 128), pre-trained at
/// 4K tokens, node-limited routing (n_group 8, topk_group 4: each token's
/// experts from at most 4 of 8 groups), rotary base 10000 rescaled by YaRN
/// (factor 40 from 4,096 positions), norms at 1e-6; 671B parameters, 37B active, besides its one
/// multi-token-prediction module (an MoE layer and the 2h -> h projection,
/// sharing the embedding and head: 685B with it, the Hugging Face weights).
fn deepseek_v3() -> ModelSpec {
    let mut spec = Llama {
        name: "deepseek-v3",
        hidden: 7168,
        heads: 128,
        kv_heads: 128,
        ffn_hidden: 18432,
        layers: 61,
        vocab: 129_280,
        seq_len: 4096,
    }
    .spec();
    spec.mla = Some(MlaSpec {
        q_lora_rank: 1536,
        kv_lora_rank: 512,
        qk_head_dim: 128,
        qk_pos_head_dim: 64,
        v_head_dim: 128,
    });
    spec.moe = Some(MoeSpec {
        experts: 256,
        topk: 8,
        ffn_hidden: 2048,
        shared_ffn_hidden: 2048,
        dense_layers: 3,
        layer_freq: 1,
        // config.json's n_group and topk_group: node-limited routing.
        router_groups: 8,
        router_group_topk: 4,
        // scoring_func sigmoid, routed_scaling_factor 2.5 and topk_method
        // noaux_tc (a bias per expert, no auxiliary loss) in config.json;
        // Megatron-Bridge's DeepSeek-V3 provider sets the same three.
        router_score: RouterScore::Sigmoid,
        router_topk_scaling: 2.5,
        router_expert_bias: true,
        // Its gating kept in fp32 (technical report, section 3.3.1), as
        // Megatron-Bridge's DeepSeek providers set moe_router_dtype.
        router_dtype: RouterDtype::Fp32,
    });
    spec.mtp_layers = 1;
    spec.rope_scaling = Some(RopeScaling::DEEPSEEK_V3_YARN);
    spec.norm_epsilon = 1e-6;
    // The query and key/value latents' norms (q_a_layernorm and
    // kv_a_layernorm): Megatron-Core builds them with --qk-layernorm.
    spec.qk_layernorm = true;
    spec
}

impl Moe {
    fn spec(&self) -> ModelSpec {
        let mut spec = Llama {
            name: self.name,
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            ffn_hidden: self.expert_ffn,
            layers: self.layers,
            vocab: self.vocab,
            seq_len: self.seq_len,
        }
        .spec();
        spec.head_dim_override = self.head_dim;
        self.family.apply(&mut spec);
        spec.moe = Some(MoeSpec {
            experts: self.experts,
            topk: self.topk,
            ffn_hidden: self.expert_ffn,
            shared_ffn_hidden: 0,
            dense_layers: 0,
            layer_freq: 1,
            router_groups: 0,
            router_group_topk: 0,
            // Softmax over the chosen experts' logits, Megatron-LM's default:
            // Qwen3's norm_topk_prob, gpt-oss's top-k then softmax, and
            // Mixtral's renormalised top-2 all equal it.
            router_score: RouterScore::Softmax,
            router_topk_scaling: 1.0,
            router_expert_bias: false,
            router_dtype: RouterDtype::Model,
        });
        spec
    }
}

impl Llama {
    fn spec(&self) -> ModelSpec {
        ModelSpec {
            name: self.name.to_string(),
            hidden: self.hidden,
            heads: self.heads,
            kv_heads: self.kv_heads,
            ffn_hidden: self.ffn_hidden,
            gated_mlp: true,
            layers: self.layers,
            vocab: self.vocab,
            seq_len: self.seq_len,
            tied_embeddings: false,
            learned_positions: false,
            attention: AttentionKind::Flash,
            dropout: false,
            head_dim_override: None,
            mla: None,
            moe: None,
            mtp_layers: 0,
            window: None,
            quick_geglu: None,
            attention_sinks: false,
            rms_norm: true,
            linear_bias: false,
            qk_layernorm: false,
            no_positions: false,
            rotary_base: DEFAULT_ROTARY_BASE,
            rope_scaling: None,
            norm_epsilon: DEFAULT_NORM_EPSILON,
        }
    }
}

/// Llama 3's rotary base (rope_theta 500000 in the meta-llama/Llama-3*
/// config.json model cards and meta-llama/llama-models' sku_list.py;
/// Llama 2 kept Megatron-LM's default 10000). Both norm at 1e-5.
const LLAMA3_ROTARY_BASE: u64 = 500_000;

/// Names of the built-in models, in catalogue order.
pub fn builtin_model_names() -> Vec<&'static str> {
    let gpt = MEGATRON_SC21.iter().chain(GPT3.iter()).map(|m| m.0);
    let llama = LLAMA2
        .iter()
        .chain(LLAMA3.iter())
        .chain(LLAMA31_128K.iter())
        .map(|m| m.name);
    gpt.chain(llama)
        .chain(MOE.iter().map(|m| m.name))
        .chain(["deepseek-v3"])
        .collect()
}

/// The built-in model of that name (case-insensitive), if any.
pub fn builtin_model(name: &str) -> Option<ModelSpec> {
    let wanted = name.trim().to_lowercase();
    if let Some(&(name, hidden, heads, layers)) = MEGATRON_SC21
        .iter()
        .chain(GPT3.iter())
        .find(|m| m.0 == wanted)
    {
        return Some(ModelSpec::gpt(
            name, hidden, heads, layers, GPT_VOCAB, GPT_SEQ,
        ));
    }
    if let Some(moe) = MOE.iter().find(|m| m.name == wanted) {
        return Some(moe.spec());
    }
    if wanted == "deepseek-v3" {
        return Some(deepseek_v3());
    }
    let named = |table: &[Llama]| table.iter().find(|m| m.name == wanted).map(Llama::spec);
    if let Some(spec) = named(&LLAMA2) {
        return Some(spec);
    }
    let llama3 = |mut spec: ModelSpec| {
        spec.rotary_base = LLAMA3_ROTARY_BASE;
        spec
    };
    if let Some(spec) = named(&LLAMA3) {
        return Some(llama3(spec));
    }
    named(&LLAMA31_128K).map(|spec| ModelSpec {
        rope_scaling: Some(RopeScaling::LLAMA31),
        ..llama3(spec)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(name: &str, published: f64, tolerance: f64) {
        let params = builtin_model(name).unwrap().total_params();
        let rel = (params - published).abs() / published;
        assert!(
            rel < tolerance,
            "{name}: {params:.4e} parameters, published {published:.4e} ({:.2}% off)",
            rel * 100.0
        );
    }

    #[test]
    fn every_name_resolves_to_a_valid_model_of_that_name() {
        let names = builtin_model_names();
        assert_eq!(names.len(), 28);
        for name in names {
            let m = builtin_model(name).unwrap_or_else(|| panic!("{name} does not resolve"));
            assert_eq!(m.name, name);
            m.check().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn names_are_unique_and_lookup_ignores_case() {
        let names = builtin_model_names();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        assert_eq!(builtin_model("LLaMA3-70B").unwrap().name, "llama3-70b");
        assert_eq!(builtin_model("GPT-1T").unwrap().name, "gpt-1t");
        assert!(builtin_model("llama3-7b").is_none());
        assert!(builtin_model("").is_none());
    }

    #[test]
    fn megatron_sc21_models_have_the_size_of_their_name() {
        for (name, ..) in MEGATRON_SC21 {
            let billions = name.trim_start_matches("gpt-");
            let published = match billions.strip_suffix('t') {
                Some(t) => t.parse::<f64>().unwrap() * 1e12,
                None => billions.trim_end_matches('b').parse::<f64>().unwrap() * 1e9,
            };
            within(name, published, 0.03);
        }
    }

    #[test]
    fn gpt3_and_llama_have_their_published_sizes() {
        within("gpt3-175b", 175e9, 0.03);
        within("gpt3-13b", 13e9, 0.03);
        within("llama2-7b", 6.74e9, 0.03);
        within("llama2-13b", 13.0e9, 0.03);
        within("llama2-70b", 69e9, 0.03);
        within("llama3-8b", 8.03e9, 0.03);
        within("llama3-70b", 70.6e9, 0.03);
        within("llama3-405b", 405.8e9, 0.03);
    }

    /// Total and active parameters as the model cards state them (gpt-oss's
    /// card counts its active parameters without the input embedding).
    #[test]
    fn mixtures_of_experts_have_their_published_total_and_active_sizes() {
        let active = |name: &str, published: f64, tolerance: f64| {
            let m = builtin_model(name).unwrap();
            let embedding = if name.starts_with("gpt-oss") {
                m.embedding_params()
            } else {
                0.0
            };
            let got = m.active_params() - embedding;
            let rel = (got - published).abs() / published;
            assert!(
                rel < tolerance,
                "{name}: {got:.4e} active, published {published:.4e}"
            );
        };
        within("mixtral-8x7b", 46.7e9, 0.02);
        active("mixtral-8x7b", 12.9e9, 0.02);
        within("mixtral-8x22b", 141e9, 0.02);
        active("mixtral-8x22b", 39e9, 0.02);
        within("qwen3-30b-a3b", 30.5e9, 0.02);
        active("qwen3-30b-a3b", 3.3e9, 0.03);
        within("qwen3-235b-a22b", 235e9, 0.02);
        active("qwen3-235b-a22b", 22e9, 0.03);
        within("gpt-oss-20b", 20.9e9, 0.02);
        active("gpt-oss-20b", 3.61e9, 0.03);
        within("gpt-oss-120b", 116.8e9, 0.02);
        active("gpt-oss-120b", 5.13e9, 0.03);
        within("deepseek-v3", 685e9, 0.01);
        // The card's 671B and 37B leave the prediction module out.
        let v3 = builtin_model("deepseek-v3").unwrap();
        let main = v3.total_params() - v3.mtp_params();
        assert!((main / 671e9 - 1.0).abs() < 0.01, "{main:.4e}");
        let main_active = v3.active_params() - v3.mtp_params() + 248.0 * v3.mlp_params(2048); // the module's unrouted experts
        assert!((main_active / 37e9 - 1.0).abs() < 0.03, "{main_active:.4e}");
        within("llama3.1-405b", 405.8e9, 0.03);
        assert_eq!(builtin_model("llama3.1-8b").unwrap().seq_len, 131_072);
    }

    /// The rotary bases, scalings and norm epsilons of the config.json files.
    #[test]
    fn families_have_their_positions_and_norms() {
        let yarn = |factor, mscale_all_dim| RopeScaling::Yarn {
            factor,
            original_positions: 4096,
            mscale: 1.0,
            mscale_all_dim,
        };
        let llama31 = Some(RopeScaling::Llama3 { factor: 8.0 });
        for (name, base, scaling, epsilon) in [
            ("llama2-70b", 10_000, None, 1e-5),
            ("llama3-70b", 500_000, None, 1e-5),
            ("llama3.1-405b", 500_000, llama31, 1e-5),
            ("mixtral-8x22b", 1_000_000, None, 1e-5),
            ("qwen3-235b-a22b", 1_000_000, None, 1e-6),
            ("gpt-oss-20b", 150_000, Some(yarn(32.0, 0.0)), 1e-5),
            ("deepseek-v3", 10_000, Some(yarn(40.0, 1.0)), 1e-6),
        ] {
            let m = builtin_model(name).unwrap();
            assert_eq!(
                (m.rotary_base, m.rope_scaling, m.norm_epsilon),
                (base, scaling, epsilon),
                "{name}"
            );
        }
    }

    #[test]
    fn families_have_their_architecture() {
        let llama = builtin_model("llama3-8b").unwrap();
        assert!(llama.gated_mlp && !llama.tied_embeddings && !llama.learned_positions);
        assert_eq!(llama.attention, AttentionKind::Flash);
        let gpt = builtin_model("gpt-7.5b").unwrap();
        assert!(!gpt.gated_mlp && gpt.tied_embeddings && gpt.learned_positions);
        assert_eq!(
            (gpt.vocab, gpt.seq_len, gpt.ffn_hidden),
            (51200, 2048, 4 * 4096)
        );
    }
}
