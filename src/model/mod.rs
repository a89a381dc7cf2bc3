//! Transformer model specifications and the counting formulas that depend only
//! on the model (parameters, FLOPs). Nothing here knows about parallelism
//! beyond dividing by a tensor-parallel degree.

mod catalogue;
mod file;

pub use catalogue::{builtin_model, builtin_model_names};
pub use file::{ModelFileError, load_model_file, parse_model_toml, render_model_toml};

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
}

fn dropout_default() -> bool {
    true
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
        }
    }

    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads
    }

    /// Width of the key and value projections together.
    pub fn kv_width(&self) -> u64 {
        2 * self.kv_heads * self.head_dim()
    }

    /// Parameters of one transformer layer (weights and biases, two layer norms).
    pub fn params_per_layer(&self) -> f64 {
        let h = self.hidden as f64;
        let f = self.ffn_hidden as f64;
        let qkv = h * (h + self.kv_width() as f64) + h + self.kv_width() as f64;
        let proj = h * h + h;
        let mlp_mats = if self.gated_mlp { 3.0 } else { 2.0 };
        let mlp = mlp_mats * h * f + f + h;
        let norms = 4.0 * h;
        qkv + proj + mlp + norms
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

    /// All parameters of the model, counted once.
    pub fn total_params(&self) -> f64 {
        let head = if self.tied_embeddings {
            0.0
        } else {
            self.embedding_params()
        };
        self.layers as f64 * self.params_per_layer()
            + self.embedding_params()
            + head
            + self.position_params()
            + 2.0 * self.hidden as f64 // final layer norm
    }

    /// Dense-GEMM FLOPs of one layer's forward pass per token, excluding the
    /// attention-score products (which scale with the sequence).
    pub fn layer_gemm_flops_per_token(&self) -> f64 {
        let h = self.hidden as f64;
        let f = self.ffn_hidden as f64;
        let mlp_mats = if self.gated_mlp { 3.0 } else { 2.0 };
        2.0 * (h * (h + self.kv_width() as f64) + h * h + mlp_mats * h * f)
    }

    /// FLOPs of the two attention-score products (QK^T and AV) per token, forward.
    pub fn layer_attention_flops_per_token(&self) -> f64 {
        4.0 * self.seq_len as f64 * self.hidden as f64
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
            * (self.layer_gemm_flops_per_token() + self.layer_attention_flops_per_token())
            + self.head_flops_per_token();
        3.0 * tokens * per_token_fwd
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
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(format!(
                "model `{}`: hidden ({}) must be divisible by heads ({}); change one of them",
                self.name, self.hidden, self.heads
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "model `{}`: heads ({}) must be a multiple of kv_heads ({})",
                self.name, self.heads, self.kv_heads
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
