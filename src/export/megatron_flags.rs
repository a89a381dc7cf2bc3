//! The Megatron-LM arguments paratune may write, for the tests of the
//! export and of the launch scripts: one list, so that a flag the export
//! learns is checked in both places.
//!
//! Every name is an option of `pretrain_gpt.py`, registered in
//! `megatron/training/arguments.py` of NVIDIA/Megatron-LM (read at commit
//! 000c4ac and on main since): by `add_argument` in its groups, or built
//! from the fields of `TransformerConfig` and `ModelParallelConfig`, which
//! newer versions turn into options of the same names
//! (`moe_flex_dispatcher_backend` is `--moe-flex-dispatcher-backend`).
//! The trial scripts' own options (`--train-iters`, `--log-throughput`,
//! `--mock-data`, ...) are among them.

/// Every Megatron-LM option the export or a launch script may write.
pub(crate) const MEGATRON_FLAGS: &[&str] = &[
    // The network: sizes, attention, activation, norms, positions, MLA, MTP.
    "--num-layers",
    "--encoder-num-layers",
    "--decoder-num-layers",
    "--hidden-size",
    "--ffn-hidden-size",
    "--num-attention-heads",
    "--kv-channels",
    "--group-query-attention",
    "--num-query-groups",
    "--max-position-embeddings",
    "--position-embedding-type",
    "--use-rotary-position-embeddings",
    "--rotary-base",
    "--rotary-percent",
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "--rope-type",
    "--rotary-scaling-factor",
    "--mscale",
    "--mscale-all-dim",
    "--make-vocab-size-divisible-by",
    "--normalization",
    "--norm-epsilon",
    "--swiglu",
    "--squared-relu",
    "--quick-geglu",
    "--activation-func-clamp-value",
    "--glu-linear-offset",
    "--untie-embeddings-and-output-weights",
    "--qk-layernorm",
    "--softmax-type",
    "--window-size",
    "--window-attn-skip-freq",
    "--attention-backend",
    "--multi-latent-attention",
    "--q-lora-rank",
    "--kv-lora-rank",
    "--qk-head-dim",
    "--qk-pos-emb-head-dim",
    "--v-head-dim",
    "--mtp-num-layers",
    // Regularization.
    "--attention-dropout",
    "--hidden-dropout",
    // Training: batches, recomputation, fusions, deferred and offloaded work.
    "--micro-batch-size",
    "--global-batch-size",
    "--rampup-batch-size",
    "--recompute-activations",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--recompute-modules",
    "--distribute-saved-activations",
    "--use-flash-attn",
    "--disable-bias-linear",
    "--sequence-parallel",
    "--train-iters",
    "--train-samples",
    "--optimizer",
    "--log-interval",
    "--cross-entropy-loss-fusion",
    "--cross-entropy-fusion-impl",
    "--defer-embedding-wgrad-compute",
    "--wgrad-deferral-limit",
    "--cpu-offloading-num-layers",
    "--no-gradient-accumulation-fusion",
    "--delay-wgrad-compute",
    "--lr",
    // Parallelism, pipeline layout, the overlaps and data-parallel sharding.
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--pipeline-model-parallel-layout",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--microbatch-group-size-per-virtual-pipeline-stage",
    "--context-parallel-size",
    "--cp-comm-type",
    "--hierarchical-context-parallel-sizes",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--tp-comm-overlap",
    "--fp8-param-gather",
    "--grad-reduce-in-bf16",
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "--use-torch-fsdp2",
    // Mixture of experts: routing, expert parallelism, dispatchers, overlap.
    "--num-experts",
    "--moe-router-topk",
    "--moe-ffn-hidden-size",
    "--moe-shared-expert-intermediate-size",
    "--moe-layer-freq",
    "--moe-router-num-groups",
    "--moe-router-group-topk",
    "--moe-router-score-function",
    "--moe-router-enable-expert-bias",
    "--moe-router-topk-scaling-factor",
    "--moe-router-pre-softmax",
    "--moe-router-dtype",
    "--expert-model-parallel-size",
    "--expert-tensor-parallel-size",
    "--moe-token-dispatcher-type",
    "--moe-flex-dispatcher-backend",
    "--moe-grouped-gemm",
    "--overlap-moe-expert-parallel-comm",
    "--use-transformer-engine-op-fuser",
    "--moe-expert-rank-capacity-factor",
    "--moe-paged-stash",
    // Transformer Engine's low precision (`--fp4-format` is `dest='fp4'`).
    "--fp8-format",
    "--fp8-recipe",
    "--fp4-format",
    "--fp4-recipe",
    "--fp4-param-gather",
    // CUDA graphs (`_add_inference_args`, which training reads too).
    "--cuda-graph-impl",
    "--cuda-graph-scope",
    // Mixed precision.
    "--fp16",
    "--bf16",
    // Logging, validation and checkpoints (the trial scripts' own).
    "--log-throughput",
    "--eval-iters",
    "--ckpt-format",
    // Data and tokenizer (the trial scripts' mock data).
    "--seq-length",
    "--mock-data",
    "--tokenizer-type",
    "--vocab-size",
];

/// Whether `flag` is a Megatron-LM option paratune knows.
pub(crate) fn is_megatron_flag(flag: &str) -> bool {
    MEGATRON_FLAGS.contains(&flag)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every option literal in the export's source (outside its tests) is
    /// listed: a flag added there without a look at Megatron-LM's
    /// arguments fails here, whether or not a test plan exercises it.
    #[test]
    fn every_option_the_megatron_export_can_write_is_listed() {
        let source = include_str!("megatron.rs");
        let code = source.split("#[cfg(test)]").next().unwrap();
        let mut found = 0;
        for literal in code.split('"').skip(1).step_by(2) {
            if literal.starts_with("--") && literal.len() > 2 && !literal.contains(' ') {
                found += 1;
                assert!(
                    is_megatron_flag(literal),
                    "export/megatron.rs writes {literal}, which the list lacks"
                );
            }
        }
        assert!(
            found > 50,
            "only {found} options found in export/megatron.rs"
        );
    }

    #[test]
    fn the_list_names_each_option_once() {
        let mut seen = std::collections::BTreeSet::new();
        for flag in MEGATRON_FLAGS {
            assert!(flag.starts_with("--"), "{flag}");
            assert!(seen.insert(flag), "{flag} listed twice");
        }
    }
}
