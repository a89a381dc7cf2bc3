//! Turn a winning [`ParallelConfig`] into launch settings for a training
//! framework: Megatron-LM command-line arguments ([`megatron_args`],
//! [`megatron_command_line`]), a torchtitan 0.2 job-config TOML fragment
//! ([`torchtitan_toml`], [`merge_job_config`]) or torchtitan 0.3 command-line
//! overrides ([`torchtitan_flags`]).
//!
//! Export refuses, with an [`ExportError`] that names the way out, whatever
//! the target framework cannot run as planned (Megatron-LM has no GPipe
//! schedule and no BPipe; torchtitan has no BPipe), and any plan that does
//! not pass [`ParallelConfig::check`]
//! for the job. Pure functions: nothing here touches the file system.

mod megatron;
#[cfg(test)]
pub(crate) mod megatron_flags;
mod torchtitan;

pub use megatron::{megatron_args, megatron_command_line, megatron_model_notes};
pub use torchtitan::{
    TorchtitanFlags, catalogue_model_of, catalogue_model_of_config, known_torchtitan_models,
    merge_job_config, torchtitan_flags, torchtitan_module, torchtitan_toml,
};

use crate::config::{ParallelConfig, SyncMethod};
use crate::model::ModelSpec;

/// One training job to export: the model, the chosen plan and the job's size.
#[derive(Debug, Clone, Copy)]
pub struct LaunchJob<'a> {
    pub model: &'a ModelSpec,
    pub config: &'a ParallelConfig,
    /// Sequences per iteration, over all data-parallel ranks.
    pub global_batch: u64,
    pub gpus: u64,
    pub gpus_per_node: u64,
    /// The GPU's catalogue name (its default FP8 recipe: MXFP8 on Blackwell).
    pub gpu: &'a str,
}

impl<'a> LaunchJob<'a> {
    /// The FP8 recipe the plan runs: the one it names, else the GPU's.
    pub fn fp8_recipe(&self) -> crate::config::Fp8Recipe {
        self.config.fp8_recipe_on(self.gpu)
    }
    /// `config` of a search's `job`.
    pub fn of(job: &'a crate::search::Job, config: &'a ParallelConfig) -> Self {
        LaunchJob {
            model: &job.model,
            config,
            global_batch: job.global_batch,
            gpus: job.gpus,
            gpus_per_node: job.nodes.gpus_per_node,
            gpu: &job.nodes.gpu.name,
        }
    }
}

/// Why a plan cannot be exported.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportError {
    /// The target framework has no equivalent of a feature the plan uses.
    #[error("{engine} cannot run {feature}; {hint}")]
    Unsupported {
        engine: &'static str,
        feature: String,
        hint: String,
    },
    /// The target framework cannot run the model itself, whatever the
    /// configuration: no other candidate is worth trying.
    #[error("{engine} cannot run {feature}; {hint}")]
    UnsupportedModel {
        engine: &'static str,
        feature: String,
        hint: String,
    },
    /// The plan itself does not fit the job (model, batch or GPU count).
    #[error("the plan cannot run this job: {0}")]
    InvalidPlan(String),
    /// Several features the target framework lacks, each with its fix: all
    /// named at once, so that one search again can drop them all.
    #[error("{engine} cannot run {} things of this plan: {}", problems.len(), several(problems))]
    Several {
        engine: &'static str,
        /// (feature, hint) for each.
        problems: Vec<(String, String)>,
    },
}

fn several(problems: &[(String, String)]) -> String {
    problems
        .iter()
        .enumerate()
        .map(|(i, (feature, hint))| format!("({}) {feature} ({hint})", i + 1))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The outcome of independent checks as one error: the first error that
/// is not a missing feature as it is (the plan or the model is wrong, and
/// the features do not matter), else every missing feature together.
fn every_refusal(
    checks: impl IntoIterator<Item = Result<(), ExportError>>,
) -> Result<(), ExportError> {
    let mut unsupported = Vec::new();
    for check in checks {
        match check {
            Ok(()) => {}
            Err(ExportError::Unsupported {
                engine,
                feature,
                hint,
            }) => unsupported.push((engine, feature, hint)),
            Err(other) => return Err(other),
        }
    }
    match unsupported.len() {
        0 => Ok(()),
        1 => {
            let (engine, feature, hint) = unsupported.remove(0);
            Err(ExportError::Unsupported {
                engine,
                feature,
                hint,
            })
        }
        _ => Err(ExportError::Several {
            engine: unsupported[0].0,
            problems: unsupported
                .into_iter()
                .map(|(_, feature, hint)| (feature, hint))
                .collect(),
        }),
    }
}

/// `PYTORCH_CUDA_ALLOC_CONF`, PyTorch's allocator options: a comma list.
pub const ALLOCATOR_OPTIONS: &str = "PYTORCH_CUDA_ALLOC_CONF";

/// `PYTORCH_ALLOC_CONF`, the same options under their device-neutral name:
/// PyTorch from 2.9 reads it first and, where it is set, ignores
/// [`ALLOCATOR_OPTIONS`] (`c10/core/AllocatorConfig.cpp`).
pub const NEUTRAL_ALLOCATOR_OPTIONS: &str = "PYTORCH_ALLOC_CONF";

/// The environment a launch of `c` needs beside its arguments, as
/// (variable, value): with expandable segments, the allocator option the
/// memory verdict assumed, and under CUDA graphs NCCL's graph registration
/// off. NCCL registers the buffers of collectives a graph captures as one
/// allocation, which an expandable segment's pieces are not (NVIDIA/nccl
/// #1820, pytorch/pytorch#158029): an illegal memory access. Megatron-LM
/// asserts it ("Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access
/// when using CUDA Graph with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
/// `megatron/training/arguments.py`); torchtitan's graph of the whole
/// forward and backward holds its FSDP and tensor-parallel collectives, and
/// its own CUDA-graph experiments set it for that reason (pytorch/torchtitan
/// #2050). Empty without expandable segments.
pub fn launch_environment(c: &ParallelConfig) -> Vec<(&'static str, &'static str)> {
    if !c.expandable_segments {
        return Vec::new();
    }
    let mut environment = vec![(ALLOCATOR_OPTIONS, "expandable_segments:True")];
    if c.cuda_graphs.on() {
        environment.push(("NCCL_GRAPH_REGISTER", "0"));
    }
    environment
}

/// How a user runs a sparse embedding sync, which neither engine paratune
/// exports to can: both all-reduce (or reduce-scatter) the embedding's
/// gradient densely with the other parameters.
pub fn sparse_sync_how_to(method: SyncMethod) -> &'static str {
    match method {
        SyncMethod::AllReduce => "every engine all-reduces dense gradients",
        SyncMethod::SparseAllGather => {
            "train with PyTorch DDP over an nn.Embedding(sparse=True), whose sparse gradient DDP all-gathers, or with DeepSpeed's `sparse_gradients: true` (an optimizer that takes sparse gradients, such as torch.optim.SparseAdam, for the table)"
        }
        SyncMethod::ParameterServer => {
            "shard the table by row over the servers and push/pull the touched rows, as Parallax does (github.com/snuspl/parallax, TensorFlow) or torch.distributed.rpc / TorchRec's row-wise sharded embeddings do in PyTorch"
        }
    }
}

/// A sparse embedding sync, refused by an engine that syncs densely.
fn check_embedding_sync(engine: &'static str, c: &ParallelConfig) -> Result<(), ExportError> {
    if !c.embedding_sync.is_sparse() {
        return Ok(());
    }
    Err(ExportError::Unsupported {
        engine,
        feature: format!("the {} embedding sync", c.embedding_sync.name()),
        hint: format!(
            "it synchronises the embedding's gradient densely; to run this plan, {}; or search again with --embedding-sync all-reduce",
            sparse_sync_how_to(c.embedding_sync)
        ),
    })
}

/// Checks the model and the plan against the job before any export.
fn check_job(job: &LaunchJob) -> Result<(), ExportError> {
    job.model.check().map_err(ExportError::InvalidPlan)?;
    job.config
        .check(job.model, job.global_batch, job.gpus, job.gpus_per_node)
        .map_err(ExportError::InvalidPlan)
}

pub use crate::text::shell_quote;

/// What an engine runs of a ranked search.
pub enum BestExport<T> {
    /// The winner's export.
    Winner(T),
    /// Why the engine cannot run the winner, and the fastest candidate it
    /// can run (its index in the ranking, and its export), if any.
    Fallback {
        why: ExportError,
        runnable: Option<(usize, T)>,
    },
}

/// The winner's export by `export`, or, when the engine cannot run the
/// winner, why and the export of the fastest candidate it can run; `None`
/// for an empty ranking.
pub fn best_export<T>(
    job: &crate::search::Job,
    candidates: &[crate::search::Candidate],
    export: impl Fn(&LaunchJob) -> Result<T, ExportError>,
) -> Option<BestExport<T>> {
    let winner = candidates.first()?;
    Some(match export(&LaunchJob::of(job, &winner.config)) {
        Ok(text) => BestExport::Winner(text),
        // No candidate of this model can run: none is tried.
        Err(why @ ExportError::UnsupportedModel { .. }) => BestExport::Fallback {
            why,
            runnable: None,
        },
        Err(why) => BestExport::Fallback {
            why,
            runnable: candidates
                .iter()
                .enumerate()
                .skip(1)
                .find_map(|(i, c)| export(&LaunchJob::of(job, &c.config)).ok().map(|t| (i, t))),
        },
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{OptimizerSharding, Recompute, ScheduleKind};
    use crate::model::AttentionKind;

    fn gpt3_175b() -> ModelSpec {
        ModelSpec::gpt("gpt3-175b", 12288, 96, 96, 51200, 2048)
    }

    /// Narayanan et al. (2021), table 1, the 175B row: 1024 GPUs.
    fn gpt3_plan() -> ParallelConfig {
        ParallelConfig {
            tp: 8,
            pp: 8,
            dp: 16,
            micro_batch: 1,
            schedule: ScheduleKind::Interleaved,
            virtual_stages: 3,
            recompute: Recompute::Selective,
            sequence_parallel: true,
            optimizer_sharding: OptimizerSharding::OptimizerStates,
            bpipe: false,
            attention: AttentionKind::Flash,
            ..ParallelConfig::default()
        }
    }

    fn job<'a>(model: &'a ModelSpec, config: &'a ParallelConfig) -> LaunchJob<'a> {
        LaunchJob {
            model,
            config,
            global_batch: 1536,
            gpus: config.gpus(),
            gpus_per_node: 8,
            gpu: "a100-80gb",
        }
    }

    /// Llama-3 8B: grouped-query attention, SwiGLU, untied, rotary.
    fn llama3_8b() -> ModelSpec {
        ModelSpec {
            name: "llama3-8b".to_string(),
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            ffn_hidden: 14336,
            gated_mlp: true,
            layers: 32,
            vocab: 128256,
            seq_len: 8192,
            tied_embeddings: false,
            learned_positions: false,
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
            rotary_base: 500_000,
            rope_scaling: None,
            norm_epsilon: crate::model::DEFAULT_NORM_EPSILON,
            attention: AttentionKind::Flash,
        }
    }

    fn llama_plan() -> ParallelConfig {
        ParallelConfig {
            tp: 2,
            pp: 1,
            dp: 32,
            micro_batch: 1,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            recompute: Recompute::Full,
            sequence_parallel: false,
            optimizer_sharding: OptimizerSharding::None,
            bpipe: false,
            attention: AttentionKind::Flash,
            ..ParallelConfig::default()
        }
    }

    fn assert_known_flags(args: &[String]) {
        for arg in args.iter().filter(|a| a.starts_with("--")) {
            assert!(
                crate::export::megatron_flags::is_megatron_flag(arg),
                "{arg} is not a Megatron-LM argument"
            );
        }
    }

    /// Megatron-LM's layout string for splits its other flags cannot say:
    /// chunk j on stage j % pp, E first, the prediction module and loss
    /// last, equal runs grouped.
    #[test]
    fn an_uneven_interleaved_split_exports_its_pipeline_layout() {
        let mut model = llama3_8b();
        model.layers = 31;
        let c = ParallelConfig {
            pp: 4,
            virtual_stages: 2,
            schedule: ScheduleKind::Interleaved,
            first_stage_layers: Some(7),
            last_stage_layers: Some(8),
            ..llama_plan()
        };
        // Stages of 7, 8, 8, 8 layers in chunks [3, 4], [4, 4], [4, 4], [4, 4]
        // (not the account-for split, which needs 33 to divide by 8).
        assert_eq!(
            crate::export::megatron::pipeline_layout(&model, &c),
            "Ettt|(tttt|)*6ttttL"
        );
        model.mtp_layers = 1;
        assert!(crate::export::megatron::pipeline_layout(&model, &c).ends_with("ttttmL"));
        let args = megatron_args(&LaunchJob {
            global_batch: 128,
            ..job(&model, &c)
        })
        .unwrap();
        let at = args
            .iter()
            .position(|a| a == "--pipeline-model-parallel-layout")
            .unwrap();
        assert_eq!(args[at + 1], "Ettt|(tttt|)*6ttttmL");
        for excluded in [
            "--num-virtual-stages-per-pipeline-rank",
            "--num-layers-per-virtual-pipeline-stage",
            "--decoder-first-pipeline-num-layers",
        ] {
            assert!(!args.iter().any(|a| a == excluded), "{excluded}");
        }
        assert_known_flags(&args);
    }

    #[test]
    fn gpt3_175b_exports_the_published_megatron_arguments() {
        let (model, plan) = (gpt3_175b(), gpt3_plan());
        let args = megatron_args(&job(&model, &plan)).unwrap();
        let expected = [
            "--tensor-model-parallel-size",
            "8",
            "--pipeline-model-parallel-size",
            "8",
            "--num-layers-per-virtual-pipeline-stage",
            "4",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1536",
            "--num-layers",
            "96",
            "--hidden-size",
            "12288",
            "--num-attention-heads",
            "96",
            "--ffn-hidden-size",
            "49152",
            "--seq-length",
            "2048",
            "--max-position-embeddings",
            "2048",
            "--norm-epsilon",
            "0.00001",
            "--attention-backend",
            "flash",
            "--recompute-granularity",
            "selective",
            "--bf16",
        ];
        assert_eq!(args, expected);
        assert_known_flags(&args);
    }

    #[test]
    fn every_exported_flag_is_a_megatron_flag() {
        let model = llama3_8b();
        for &recompute in Recompute::of(crate::config::Engine::Megatron) {
            for attention in AttentionKind::ALL {
                let plan = ParallelConfig {
                    recompute,
                    attention,
                    ..llama_plan()
                };
                assert_known_flags(&megatron_args(&job(&model, &plan)).unwrap());
            }
        }
        let (model, plan) = (gpt3_175b(), gpt3_plan());
        assert_known_flags(&megatron_args(&job(&model, &plan)).unwrap());
    }

    #[test]
    fn llama_exports_gqa_swiglu_untied_rope_and_full_recompute() {
        let (model, plan) = (llama3_8b(), llama_plan());
        let args = megatron_args(&job(&model, &plan)).unwrap();
        let joined = args.join(" ");
        for expected in [
            "--group-query-attention --num-query-groups 8",
            "--swiglu",
            "--untie-embeddings-and-output-weights",
            "--position-embedding-type rope",
            "--ffn-hidden-size 14336",
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
            "--normalization RMSNorm",
            "--disable-bias-linear",
            "--attention-dropout 0 --hidden-dropout 0",
        ] {
            assert!(
                joined.contains(expected),
                "missing `{expected}` in {joined}"
            );
        }
        for absent in [
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--num-layers-per-virtual-pipeline-stage",
        ] {
            assert!(
                !joined.contains(absent),
                "unexpected `{absent}` in {joined}"
            );
        }
        // Without positions (NoPE), Megatron-LM's `none`.
        let nope = ModelSpec {
            no_positions: true,
            ..model
        };
        let joined = megatron_args(&job(&nope, &plan)).unwrap().join(" ");
        assert!(
            joined.contains("--position-embedding-type none"),
            "{joined}"
        );
        assert!(!joined.contains("rope"), "{joined}");
    }

    /// The rotary base, Llama 3.1's and DeepSeek-V3's scalings and the norms'
    /// epsilon as `pretrain_gpt.py` takes them; gpt-oss's YaRN, which it has
    /// no option for outside MLA, named in a note instead.
    #[test]
    fn positions_and_norms_export_as_the_model_trains_them() {
        let exported = |name: &str, plan: &ParallelConfig| {
            let model = crate::model::builtin_model(name).unwrap();
            let launch = job(&model, plan);
            let args = megatron_args(&launch).unwrap();
            assert_known_flags(&args);
            // The notes stay out of the command line, which pastes after
            // `pretrain_gpt.py` as it is.
            let line = megatron_command_line(&launch).unwrap();
            let words: Vec<String> = line
                .split_whitespace()
                .filter(|w| *w != "\\")
                .map(|w| w.trim_matches('\'').to_string())
                .collect();
            assert_eq!(words, args, "{name}");
            (args.join(" "), megatron_model_notes(&model))
        };
        let moe_plan = ParallelConfig {
            tp: 1,
            dp: 64,
            ep: 8,
            ..llama_plan()
        };
        let (llama, notes) = exported("llama3.1-8b", &llama_plan());
        assert!(notes.is_empty(), "{notes:?}");
        for expected in [
            "--position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8",
            "--norm-epsilon 0.00001",
        ] {
            assert!(llama.contains(expected), "missing `{expected}` in {llama}");
        }
        let (llama3, _) = exported("llama3-8b", &llama_plan());
        assert!(llama3.contains("--rotary-base 500000") && !llama3.contains("--use-rope-scaling"));
        let (qwen, _) = exported("qwen3-30b-a3b", &moe_plan);
        assert!(
            qwen.contains("--rotary-base 1000000") && qwen.contains("--norm-epsilon 0.000001"),
            "{qwen}"
        );
        let (deepseek, notes) = exported("deepseek-v3", &moe_plan);
        assert!(notes.is_empty(), "{notes:?}");
        assert!(
            deepseek.contains(
                "--rotary-base 10000 --rotary-scaling-factor 40 --mscale 1 --mscale-all-dim 1"
            ),
            "{deepseek}"
        );
        let (oss, notes) = exported("gpt-oss-120b", &moe_plan);
        assert!(
            oss.contains("--rotary-base 150000") && !oss.contains("rope-scaling"),
            "{oss}"
        );
        assert_eq!(notes.len(), 1);
        assert!(
            notes[0].contains("YaRN (factor 32, from 4096 positions)"),
            "{notes:?}"
        );
        // Learned positions take no rotary option and no note.
        let (gpt, notes) = exported("gpt3-175b", &gpt3_plan());
        assert!(!gpt.contains("rotary") && notes.is_empty(), "{gpt}");
    }

    /// DeepSeek-V3's sigmoid router with its expert bias and scaling, and
    /// a top-1 softmax router's softmax before the choice, which
    /// Megatron-Core requires; the other routers are its default.
    #[test]
    fn routers_export_their_score() {
        let plan = ParallelConfig {
            tp: 1,
            dp: 64,
            ep: 8,
            ..llama_plan()
        };
        let exported = |model: &ModelSpec| {
            let args = megatron_args(&job(model, &plan)).unwrap();
            assert_known_flags(&args);
            args.join(" ")
        };
        let v3 = exported(&crate::model::builtin_model("deepseek-v3").unwrap());
        assert!(
            v3.contains("--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32"),
            "{v3}"
        );
        let qwen = crate::model::builtin_model("qwen3-30b-a3b").unwrap();
        let softmax = exported(&qwen);
        assert!(
            !softmax.contains("--moe-router-score")
                && !softmax.contains("--moe-router-pre-softmax")
        );
        let mut switch = qwen.clone();
        switch.moe.as_mut().unwrap().topk = 1;
        assert!(exported(&switch).contains("--moe-router-pre-softmax"));
    }

    #[test]
    fn gpt_exports_no_llama_switches() {
        let (model, plan) = (gpt3_175b(), gpt3_plan());
        let joined = megatron_args(&job(&model, &plan)).unwrap().join(" ");
        for absent in [
            "--group-query-attention",
            "--swiglu",
            "--untie-embeddings-and-output-weights",
            "--position-embedding-type",
            // GPT keeps LayerNorm, its biases and Megatron-LM's 0.1 dropout.
            "--normalization",
            "--disable-bias-linear",
            "--attention-dropout",
            "--hidden-dropout",
        ] {
            assert!(
                !joined.contains(absent),
                "unexpected `{absent}` in {joined}"
            );
        }
    }

    #[test]
    fn standard_attention_exports_the_unfused_backend() {
        let model = gpt3_175b();
        let plan = ParallelConfig {
            attention: AttentionKind::Standard,
            ..gpt3_plan()
        };
        let joined = megatron_args(&job(&model, &plan)).unwrap().join(" ");
        assert!(joined.contains("--attention-backend unfused"), "{joined}");
    }

    fn unsupported_feature(error: ExportError) -> (&'static str, String) {
        match error {
            ExportError::Unsupported {
                engine, feature, ..
            } => (engine, feature),
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }

    #[test]
    fn megatron_refuses_gpipe_and_bpipe() {
        let model = gpt3_175b();
        let gpipe = ParallelConfig {
            schedule: ScheduleKind::Gpipe,
            virtual_stages: 1,
            ..gpt3_plan()
        };
        let bpipe = ParallelConfig {
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            bpipe: true,
            ..gpt3_plan()
        };
        for (plan, word) in [(gpipe, "GPipe"), (bpipe, "BPipe")] {
            let error = megatron_args(&job(&model, &plan)).unwrap_err();
            let message = error.to_string();
            let (engine, feature) = unsupported_feature(error);
            assert_eq!(engine, "Megatron-LM");
            assert!(feature.contains(word), "{feature}");
            assert!(message.contains("--"), "the hint names a switch: {message}");
            assert!(megatron_command_line(&job(&model, &plan)).is_err());
        }
    }

    /// Full sharding runs as Megatron-FSDP, with the flags its user guide
    /// requires and `validate_args` asserts.
    #[test]
    fn megatron_runs_full_sharding_as_megatron_fsdp() {
        let model = gpt3_175b();
        let zero3 = ParallelConfig {
            optimizer_sharding: OptimizerSharding::Full,
            ..gpt3_plan()
        };
        let args = megatron_args(&job(&model, &zero3)).unwrap().join(" ");
        for needed in [
            "--use-megatron-fsdp",
            "--data-parallel-sharding-strategy optim_grads_params",
            "--no-gradient-accumulation-fusion",
            "--use-distributed-optimizer",
            "--ckpt-format fsdp_dtensor",
        ] {
            assert!(args.contains(needed), "{needed} missing from {args}");
        }
        let zero1 = megatron_args(&job(&model, &gpt3_plan())).unwrap().join(" ");
        assert!(!zero1.contains("fsdp"), "{zero1}");
    }

    #[test]
    fn an_invalid_plan_is_refused() {
        let model = gpt3_175b();
        let plan = ParallelConfig {
            dp: 8,
            ..gpt3_plan()
        };
        let mut launch = job(&model, &plan);
        launch.gpus = 1024; // tp x pp x dp = 512
        assert!(matches!(
            megatron_args(&launch),
            Err(ExportError::InvalidPlan(_))
        ));
        assert!(matches!(
            torchtitan_toml(&launch),
            Err(ExportError::InvalidPlan(_))
        ));
    }

    #[test]
    fn command_line_pairs_flags_with_values() {
        let (model, plan) = (gpt3_175b(), gpt3_plan());
        let line = megatron_command_line(&job(&model, &plan)).unwrap();
        let lines: Vec<&str> = line.split(" \\\n    ").collect();
        assert_eq!(lines[0], "--tensor-model-parallel-size 8");
        assert_eq!(lines[2], "--num-layers-per-virtual-pipeline-stage 4");
        assert_eq!(lines[3], "--sequence-parallel");
        assert_eq!(*lines.last().unwrap(), "--bf16");
        assert!(lines.iter().all(|l| l.starts_with("--")));
        // Same words as the argument list, in order.
        let words: Vec<String> = line
            .split_whitespace()
            .filter(|w| *w != "\\")
            .map(str::to_string)
            .collect();
        assert_eq!(words, megatron_args(&job(&model, &plan)).unwrap());
    }

    fn parse(text: &str) -> toml::Value {
        toml::from_str::<toml::Value>(text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    fn int(value: &toml::Value, section: &str, key: &str) -> i64 {
        value[section][key]
            .as_integer()
            .unwrap_or_else(|| panic!("{section}.{key} missing"))
    }

    fn string<'v>(value: &'v toml::Value, section: &str, key: &str) -> &'v str {
        value[section][key]
            .as_str()
            .unwrap_or_else(|| panic!("{section}.{key} missing"))
    }

    #[test]
    fn torchtitan_toml_parses_and_has_the_plan_degrees() {
        let (model, plan) = (gpt3_175b(), gpt3_plan());
        let text = torchtitan_toml(&job(&model, &plan)).unwrap();
        assert_eq!(
            text.lines().next().unwrap(),
            format!("# paratune plan: {plan}")
        );
        let value = parse(&text);
        assert_eq!(int(&value, "parallelism", "tensor_parallel_degree"), 8);
        assert_eq!(int(&value, "parallelism", "pipeline_parallel_degree"), 8);
        // Megatron's distributed optimizer (ZeRO-1): FSDP over the 16
        // data-parallel ranks, weights kept gathered between forward and backward.
        assert_eq!(int(&value, "parallelism", "data_parallel_shard_degree"), 16);
        assert_eq!(
            int(&value, "parallelism", "data_parallel_replicate_degree"),
            1
        );
        assert_eq!(
            string(&value, "parallelism", "fsdp_reshard_after_forward"),
            "never"
        );
        assert_eq!(
            string(&value, "parallelism", "pipeline_parallel_schedule"),
            "Interleaved1F1B"
        );
        assert_eq!(
            int(&value, "parallelism", "pipeline_parallel_microbatch_size"),
            1
        );
        assert_eq!(
            int(&value, "parallelism", "pipeline_parallel_layers_per_stage"),
            4
        );
        assert_eq!(
            int(
                &value,
                "parallelism",
                "pipeline_parallel_first_stage_less_layers"
            ),
            0
        );
        assert_eq!(
            value["parallelism"]["enable_async_tensor_parallel"].as_bool(),
            Some(false)
        );
        // 1536 sequences over 16 data-parallel ranks, 96 micro-batches of 1.
        assert_eq!(int(&value, "training", "local_batch_size"), 96);
        assert_eq!(int(&value, "training", "global_batch_size"), 1536);
        assert_eq!(int(&value, "training", "seq_len"), 2048);
        assert_eq!(string(&value, "activation_checkpoint", "mode"), "selective");
        assert_eq!(
            string(&value, "activation_checkpoint", "selective_ac_option"),
            "op"
        );
    }

    #[test]
    fn torchtitan_full_sharding_is_fsdp_and_plain_dp_is_ddp() {
        let model = llama3_8b();
        let zero3 = ParallelConfig {
            optimizer_sharding: OptimizerSharding::Full,
            ..llama_plan()
        };
        let value = parse(&torchtitan_toml(&job(&model, &zero3)).unwrap());
        assert_eq!(int(&value, "parallelism", "data_parallel_shard_degree"), 32);
        assert_eq!(
            int(&value, "parallelism", "data_parallel_replicate_degree"),
            1
        );
        assert_eq!(
            string(&value, "parallelism", "fsdp_reshard_after_forward"),
            "default"
        );
        assert_eq!(string(&value, "activation_checkpoint", "mode"), "full");
        // No pipeline: one micro-batch per step, gradient accumulation for the rest.
        assert_eq!(int(&value, "training", "local_batch_size"), 1);
        assert_eq!(int(&value, "training", "global_batch_size"), 1536);
        assert!(
            value["parallelism"]
                .get("pipeline_parallel_schedule")
                .is_none()
        );

        // Pure data parallelism without sharding: torchtitan's DDP.
        let ddp = ParallelConfig {
            tp: 1,
            dp: 64,
            recompute: Recompute::None,
            ..llama_plan()
        };
        let value = parse(&torchtitan_toml(&job(&model, &ddp)).unwrap());
        assert_eq!(
            int(&value, "parallelism", "data_parallel_replicate_degree"),
            64
        );
        assert_eq!(int(&value, "parallelism", "data_parallel_shard_degree"), 1);
        assert!(
            value["parallelism"]
                .get("fsdp_reshard_after_forward")
                .is_none()
        );
        assert_eq!(string(&value, "activation_checkpoint", "mode"), "none");
    }

    #[test]
    fn torchtitan_notes_that_tensor_parallelism_always_shards_sequences() {
        let (model, plan) = (llama3_8b(), llama_plan());
        let text = torchtitan_toml(&job(&model, &plan)).unwrap();
        assert!(
            text.lines()
                .any(|l| l.starts_with('#') && l.contains("always shards sequences")),
            "{text}"
        );
        // Tensor parallelism without a data-parallel sharding would be DDP,
        // which torchtitan cannot combine with tp > 1.
        let value = parse(&text);
        assert_eq!(int(&value, "parallelism", "data_parallel_shard_degree"), 32);
        assert_eq!(
            int(&value, "parallelism", "data_parallel_replicate_degree"),
            1
        );

        let (model, plan) = (gpt3_175b(), gpt3_plan());
        let text = torchtitan_toml(&job(&model, &plan)).unwrap();
        assert!(!text.contains("always shards sequences"), "{text}");
    }

    #[test]
    fn torchtitan_schedules_and_bpipe() {
        let model = gpt3_175b();
        for (schedule, name) in [
            (ScheduleKind::Gpipe, "GPipe"),
            (ScheduleKind::OneFOneB, "1F1B"),
        ] {
            let plan = ParallelConfig {
                schedule,
                virtual_stages: 1,
                ..gpt3_plan()
            };
            let value = parse(&torchtitan_toml(&job(&model, &plan)).unwrap());
            assert_eq!(
                string(&value, "parallelism", "pipeline_parallel_schedule"),
                name
            );
            assert_eq!(
                int(&value, "parallelism", "pipeline_parallel_layers_per_stage"),
                12
            );
        }
        let bpipe = ParallelConfig {
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            bpipe: true,
            ..gpt3_plan()
        };
        let error = torchtitan_toml(&job(&model, &bpipe)).unwrap_err();
        let (engine, feature) = unsupported_feature(error);
        assert_eq!(engine, "torchtitan");
        assert!(feature.contains("BPipe"));
    }

    /// Every `section.field` of torchtitan 0.3.0's `Trainer.Config` that a
    /// plan sets, from the PyPI wheel `torchtitan-0.3.0-py3-none-any.whl`
    /// (sha256 5563ccf9...af42): `torchtitan/config/configs.py`
    /// `TrainingConfig` (local_batch_size, global_batch_size, seq_len, steps,
    /// disable_cuda_graphs, mixed_precision_param), `ParallelismConfig`
    /// (the data_parallel_*, fsdp_reshard_after_forward, tensor_parallel_degree,
    /// enable_sequence_parallel, pipeline_parallel_* and
    /// context_parallel_degree fields), `CompileConfig` (enable,
    /// enable_async_tensor_parallel), `DebugConfig.print_config`,
    /// `components/metrics.py` `MetricsProcessor.Config` (log_freq,
    /// disable_color_printing) and `components/checkpointer/base.py`
    /// (enable). The activation-checkpoint subcommands are those of
    /// `torchtitan/distributed/activation_checkpoint.py` L332-337.
    pub(crate) const TORCHTITAN_0_3_0_FIELDS: [&str; 25] = [
        "training.local_batch_size",
        "training.global_batch_size",
        "training.seq_len",
        "training.steps",
        "training.disable_cuda_graphs",
        "training.mixed_precision_param",
        "parallelism.data_parallel_replicate_degree",
        "parallelism.data_parallel_shard_degree",
        "parallelism.fsdp_reshard_after_forward",
        "parallelism.tensor_parallel_degree",
        "parallelism.enable_sequence_parallel",
        "parallelism.pipeline_parallel_degree",
        "parallelism.pipeline_parallel_schedule",
        "parallelism.pipeline_parallel_microbatch_size",
        "parallelism.pipeline_parallel_layers_per_stage",
        "parallelism.pipeline_parallel_first_stage_less_layers",
        "parallelism.pipeline_parallel_last_stage_less_layers",
        "parallelism.context_parallel_degree",
        "compile.enable",
        "compile.enable_async_tensor_parallel",
        "debug.print_config",
        "metrics.log_freq",
        "metrics.disable_color_printing",
        "checkpoint.enable",
        "activation_checkpoint",
    ];
    const TORCHTITAN_0_3_0_AC: [&str; 3] = [
        "activation-checkpoint:none",
        "activation-checkpoint:full",
        "activation-checkpoint:selective",
    ];

    /// `--section.field` or `--section.no-field` as `section.field`.
    pub(crate) fn torchtitan_field(word: &str) -> Option<String> {
        let name = word.strip_prefix("--")?;
        let (section, field) = name.split_once('.')?;
        let field = field.strip_prefix("no-").unwrap_or(field);
        Some(format!("{section}.{field}"))
    }

    #[test]
    fn torchtitan_flags_use_only_options_of_the_0_3_0_release() {
        let model = llama3_8b();
        let mut plans = vec![llama_plan()];
        for (pp, schedule, v) in [
            (4, ScheduleKind::OneFOneB, 1),
            (4, ScheduleKind::Interleaved, 2),
            (2, ScheduleKind::Gpipe, 1),
        ] {
            plans.push(ParallelConfig {
                pp,
                dp: 32 / pp,
                schedule,
                virtual_stages: v,
                ..llama_plan()
            });
        }
        plans.push(ParallelConfig {
            tp: 1,
            dp: 64,
            compile: true,
            cuda_graphs: crate::config::CudaGraphs::Layers,
            engine: crate::config::Engine::Torchtitan,
            recompute: Recompute::None,
            ..llama_plan()
        });
        for plan in &plans {
            let words = torchtitan_flags(&job(&model, plan)).unwrap();
            for word in words.flags.iter().filter(|w| w.starts_with("--")) {
                let field = torchtitan_field(word).unwrap_or_else(|| panic!("{word}"));
                assert!(
                    TORCHTITAN_0_3_0_FIELDS.contains(&field.as_str()),
                    "{word} is not an option of torchtitan 0.3.0"
                );
            }
            assert!(TORCHTITAN_0_3_0_AC.contains(&words.activation_checkpoint));
            // Values follow their flag; no value is a flag.
            for pair in words.flags.windows(2) {
                if !pair[0].starts_with("--") {
                    assert!(pair[1].starts_with("--"), "{pair:?}");
                }
            }
        }
    }

    #[test]
    fn torchtitan_flags_carry_the_plan() {
        let model = llama3_8b();
        let plan = ParallelConfig {
            pp: 4,
            dp: 8,
            schedule: ScheduleKind::Interleaved,
            virtual_stages: 2,
            micro_batch: 2,
            ..llama_plan()
        };
        let words = torchtitan_flags(&job(&model, &plan)).unwrap();
        let value = |name: &str| -> &str {
            let i = words
                .flags
                .iter()
                .position(|w| w == &format!("--{name}"))
                .unwrap_or_else(|| panic!("{name} missing: {:?}", words.flags));
            &words.flags[i + 1]
        };
        assert_eq!(value("parallelism.tensor_parallel_degree"), "2");
        assert_eq!(value("parallelism.pipeline_parallel_degree"), "4");
        assert_eq!(value("parallelism.data_parallel_shard_degree"), "8");
        assert_eq!(
            value("parallelism.pipeline_parallel_schedule"),
            "Interleaved1F1B"
        );
        assert_eq!(value("parallelism.pipeline_parallel_microbatch_size"), "2");
        // 32 layers over 4 x 2 chunks; embedding and head not counted.
        assert_eq!(value("parallelism.pipeline_parallel_layers_per_stage"), "4");
        assert_eq!(
            value("parallelism.pipeline_parallel_first_stage_less_layers"),
            "0"
        );
        // 1536 sequences over 8 data-parallel ranks, split into micro-batches of 2.
        assert_eq!(value("training.local_batch_size"), "192");
        assert_eq!(value("training.global_batch_size"), "1536");
        assert_eq!(words.activation_checkpoint, "activation-checkpoint:full");
        // Pipelines cannot run CUDA graphs: 0.3.0 must be told.
        assert!(
            words
                .flags
                .contains(&"--training.disable_cuda_graphs".to_string())
        );
        assert!(words.flags.contains(&"--compile.no-enable".to_string()));

        let layered = ParallelConfig {
            recompute: Recompute::SelectiveLayer,
            engine: crate::config::Engine::Torchtitan,
            ..llama_plan()
        };
        let (engine, feature) =
            unsupported_feature(torchtitan_flags(&job(&model, &layered)).unwrap_err());
        assert_eq!(engine, "torchtitan");
        assert!(feature.contains("per-layer"), "{feature}");
        // 0.2 has it.
        assert!(torchtitan_toml(&job(&model, &layered)).is_ok());
    }

    #[test]
    fn a_base_job_config_keeps_its_keys_and_takes_the_plan() {
        let model = llama3_8b();
        let plan = llama_plan();
        let base: toml::Table = toml::from_str(
            "[job]\ndump_folder = \"./out\"\n[model]\nname = \"llama3\"\nflavor = \"8B\"\n[training]\ndataset = \"c4\"\nlocal_batch_size = 8\n[parallelism]\ntensor_parallel_degree = 1\n",
        )
        .unwrap();
        let extra: toml::Table = toml::from_str("[training]\nsteps = 20\n").unwrap();
        let text = merge_job_config(&base, &job(&model, &plan), &extra).unwrap();
        let value = parse(&text);
        assert_eq!(string(&value, "job", "dump_folder"), "./out");
        assert_eq!(string(&value, "training", "dataset"), "c4");
        assert_eq!(string(&value, "model", "flavor"), "8B");
        assert_eq!(int(&value, "training", "steps"), 20);
        assert_eq!(int(&value, "training", "local_batch_size"), 1);
        assert_eq!(int(&value, "parallelism", "tensor_parallel_degree"), 2);
        assert_eq!(value["compile"]["enable"].as_bool(), Some(false));
        assert!(text.starts_with(&format!("# paratune plan: {plan}\n")));
    }

    #[test]
    fn hybrid_sharding_exports_as_replicas_of_a_shard_group() {
        let model = llama3_8b();
        let plan = ParallelConfig {
            tp: 1,
            dp: 64,
            engine: crate::config::Engine::Torchtitan,
            optimizer_sharding: OptimizerSharding::Full,
            dp_shard: Some(8),
            ..llama_plan()
        };
        let value = parse(&torchtitan_toml(&job(&model, &plan)).unwrap());
        assert_eq!(
            int(&value, "parallelism", "data_parallel_replicate_degree"),
            8
        );
        assert_eq!(int(&value, "parallelism", "data_parallel_shard_degree"), 8);
        let words = torchtitan_flags(&job(&model, &plan)).unwrap().flags;
        let at = |name: &str| &words[words.iter().position(|w| w == name).unwrap() + 1];
        assert_eq!(at("--parallelism.data_parallel_replicate_degree"), "8");
        assert_eq!(at("--parallelism.data_parallel_shard_degree"), "8");
    }

    /// A model torchtitan cannot run at all (multi-token prediction) is
    /// refused for the winner, and no other candidate is tried in vain.
    #[test]
    fn a_model_the_engine_cannot_run_tries_no_other_candidate() {
        let mut model = crate::model::builtin_model("llama3-8b").unwrap();
        model.mtp_layers = 1;
        let job = crate::search::Job {
            model,
            global_batch: 64,
            gpus: 8,
            nodes: crate::cluster::builtin_node("h100-sxm", 1).unwrap(),
            memory_limit: None,
            profile: None,
        };
        // Planned for Megatron-LM: a torchtitan search drops the model
        // already (`Rule::EngineCannotRun`).
        let space = crate::search::SearchSpace::default();
        let cost = crate::coefficients::CostModel::datasheet();
        let result = crate::search::search(&job, &space, &cost);
        assert!(result.candidates.len() > 1);
        let tries = std::cell::Cell::new(0);
        let export = |launch: &LaunchJob| {
            tries.set(tries.get() + 1);
            torchtitan_flags(launch)
        };
        match best_export(&job, &result.candidates, export) {
            Some(BestExport::Fallback {
                why: ExportError::UnsupportedModel { feature, .. },
                runnable: None,
            }) => assert_eq!(feature, "multi-token prediction"),
            _ => panic!("expected the model refused"),
        }
        assert_eq!(tries.get(), 1);
    }
}
