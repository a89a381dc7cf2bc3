//! Command-line arguments (clap). Values are kept as text where the library
//! parses them, so every error names the flag and the accepted values.

use clap::error::ErrorKind;
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use paratune::units::{Bandwidth, Bytes};
use paratune::validate::megatron_log::DEFAULT_WARMUP;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "paratune",
    version,
    about = "Find the fastest way to train a large transformer on a GPU cluster",
    long_about = "paratune predicts iteration time, throughput, MFU and per-GPU memory of \
                  tensor/pipeline/data-parallel training configurations, searches them all, \
                  and exports the winner as Megatron-LM arguments or a torchtitan TOML."
)]
struct CliSpec {
    #[command(subcommand)]
    command: Command,
}

/// The parsed command line. Clap's own usage errors span several lines
/// (message, usage, a hint); [`Parser::parse`] is overridden to print them as
/// the one `error:` line every other error is, with exit code 2.
#[derive(Debug)]
pub struct Cli {
    pub command: Command,
}

impl CommandFactory for Cli {
    fn command() -> clap::Command {
        values_may_start_with_a_hyphen(CliSpec::command())
    }

    fn command_for_update() -> clap::Command {
        values_may_start_with_a_hyphen(CliSpec::command_for_update())
    }
}

/// Lets every flag's value start with `-`, so that `--memory-limit -1GiB`
/// reaches the flag's own parser, which names the flag and says what it
/// takes, instead of clap's "unexpected argument '-1GiB'".
fn values_may_start_with_a_hyphen(command: clap::Command) -> clap::Command {
    command
        .mut_args(|arg| {
            if !arg.is_positional() && arg.get_action().takes_values() {
                arg.allow_hyphen_values(true)
            } else {
                arg
            }
        })
        .mut_subcommands(values_may_start_with_a_hyphen)
}

impl FromArgMatches for Cli {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        CliSpec::from_arg_matches(matches).map(|spec| Cli {
            command: spec.command,
        })
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.command.update_from_arg_matches(matches)
    }
}

impl Parser for Cli {
    fn parse() -> Self {
        match Self::try_parse() {
            Ok(cli) => cli,
            Err(error) => match error.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => error.exit(),
                _ => {
                    eprintln!("{}", one_line_error(&error));
                    std::process::exit(2);
                }
            },
        }
    }
}

/// Clap's message, hints and missing arguments on one line, without the
/// usage block and the "try --help" line.
fn one_line_error(error: &clap::Error) -> String {
    if error.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        let names: Vec<String> = CliSpec::command()
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .filter(|n| n != "help")
            .collect();
        return format!(
            "error: no command given; use one of {} (`paratune --help` describes them)",
            names.join(", ")
        );
    }
    let rendered = error.render().to_string();
    let mut parts: Vec<&str> = Vec::new();
    for line in rendered.lines().map(str::trim) {
        if line.starts_with("Usage:") {
            break;
        }
        if !line.is_empty() && !line.starts_with("For more information") {
            parts.push(line);
        }
    }
    let mut message = String::new();
    for part in parts {
        if !message.is_empty() {
            message.push_str(if message.ends_with(':') { " " } else { "; " });
        }
        message.push_str(part);
    }
    let message = message.strip_prefix("error:").unwrap_or(&message).trim();
    format!("error: {message}")
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Search every configuration, rank those that fit, explain and export the winner.
    Plan(PlanArgs),
    /// Predict one configuration, or every row of a runs CSV.
    Predict(PredictArgs),
    /// Compare predictions with the measured iteration times of a runs CSV.
    Evaluate(EvaluateArgs),
    /// Fit the cost model's coefficients to measured runs (argmin) and write a cost model.
    Calibrate(CalibrateArgs),
    /// Build and inspect measured profiles (nccl-tests curves, layer times) for --profile.
    #[command(subcommand)]
    Profile(ProfileCommand),
    /// Turn training logs into rows of a runs CSV (Megatron-LM logs).
    #[command(subcommand)]
    Ingest(IngestCommand),
    /// Check a plan by trial runs (local stage trials with libtorch, or Megatron-LM launch
    /// scripts), compare with the prediction, feed the measurements back and re-rank.
    Validate(Box<ValidateArgs>),
    /// List the built-in models.
    Models(ListArgs),
    /// List the built-in GPUs and their default nodes.
    Gpus(ListArgs),
}

/// How a catalogue is listed: a table to read, or JSON (every field of
/// each entry) and CSV (the table's columns in plain units) for scripts.
#[derive(Args, Debug)]
pub struct ListArgs {
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
    Csv,
}

/// What to train. `--model` names a built-in model or a TOML file; the
/// dimension flags override it or, without `--model`, define a GPT-style model.
#[derive(Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// Built-in model name (see `paratune models`) or a model TOML file.
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, value_parser = count(1 << 20), allow_negative_numbers = true)]
    pub hidden: Option<u64>,
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub heads: Option<u64>,
    /// Key/value heads (grouped-query attention).
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub kv_heads: Option<u64>,
    #[arg(long, value_parser = count(1 << 22), allow_negative_numbers = true)]
    pub ffn_hidden: Option<u64>,
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub layers: Option<u64>,
    #[arg(long, value_parser = count(1 << 24), allow_negative_numbers = true)]
    pub vocab: Option<u64>,
    #[arg(long, value_parser = count(1 << 24), allow_negative_numbers = true)]
    pub seq_len: Option<u64>,
    /// Gated (SwiGLU) MLP: on/off.
    #[arg(long)]
    pub gated_mlp: Option<String>,
    /// Input embedding shared with the output head: on/off.
    #[arg(long)]
    pub tied_embeddings: Option<String>,
    /// Dropout on attention and hidden states (GPT's default; Llama trains without): on/off.
    #[arg(long)]
    pub dropout: Option<String>,
    /// Width of one attention head, where it is not hidden / heads.
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub head_dim: Option<u64>,
    /// A mixture of experts: routed experts per MoE layer (Megatron-LM's --num-experts).
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub experts: Option<u64>,
    /// Experts each token is routed to (--moe-router-topk; default 2).
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub moe_topk: Option<u64>,
    /// Width of one routed expert's MLP (--moe-ffn-hidden-size; default --ffn-hidden).
    #[arg(long, value_parser = count(1 << 22), allow_negative_numbers = true)]
    pub moe_ffn_hidden: Option<u64>,
    /// Shared experts, each --moe-ffn-hidden wide (DeepSeek's always-on experts).
    #[arg(long, value_parser = whole(1024), allow_negative_numbers = true)]
    pub shared_experts: Option<u64>,
    /// Leading layers that keep a dense MLP (DeepSeek-V3's first three).
    #[arg(long, value_parser = whole(65536), allow_negative_numbers = true)]
    pub dense_layers: Option<u64>,
    /// Multi-latent attention (DeepSeek): rank of the keys' and values' latent
    /// (Megatron-LM's --kv-lora-rank; the other MLA flags default to its defaults).
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub kv_lora_rank: Option<u64>,
    /// MLA: rank of the queries' latent (--q-lora-rank; 0: projected directly).
    #[arg(long, value_parser = whole(65536), allow_negative_numbers = true)]
    pub q_lora_rank: Option<u64>,
    /// MLA: query/key width per head without position (--qk-head-dim; default 128).
    #[arg(long, value_parser = count(1 << 12), allow_negative_numbers = true)]
    pub qk_head_dim: Option<u64>,
    /// MLA: rotary width per head (--qk-pos-emb-head-dim; default 64).
    #[arg(long, value_parser = count(1 << 12), allow_negative_numbers = true)]
    pub qk_pos_head_dim: Option<u64>,
    /// MLA: value width per head (--v-head-dim; default 128).
    #[arg(long, value_parser = count(1 << 12), allow_negative_numbers = true)]
    pub v_head_dim: Option<u64>,
    /// After them, every N-th layer has experts (--moe-layer-freq; default 1).
    #[arg(long, value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub moe_layer_freq: Option<u64>,
    /// Group-limited routing: the experts in N equal groups (--moe-router-num-groups;
    /// DeepSeek-V3's node-limited routing has 8; 0: unlimited)
    #[arg(long, value_parser = whole(65536), allow_negative_numbers = true)]
    pub moe_router_num_groups: Option<u64>,
    /// Groups each token's experts are chosen from (--moe-router-group-topk; DeepSeek-V3: 4)
    #[arg(long, value_parser = whole(65536), allow_negative_numbers = true)]
    pub moe_router_group_topk: Option<u64>,
    /// The router's score function: softmax or sigmoid (--moe-router-score-function; DeepSeek-V3: sigmoid); exported, not priced
    #[arg(long)]
    pub moe_router_score_function: Option<String>,
    /// Scale of the chosen experts' weights (--moe-router-topk-scaling-factor; DeepSeek-V3: 2.5); exported, not priced
    #[arg(long, value_parser = real, allow_negative_numbers = true)]
    pub moe_router_topk_scaling_factor: Option<f64>,
    /// A per-expert bias balancing the experts without an auxiliary loss, with a sigmoid router (--moe-router-enable-expert-bias; DeepSeek-V3): on/off; exported, not priced
    #[arg(long)]
    pub moe_router_enable_expert_bias: Option<String>,
    /// The router's arithmetic: model (its bf16) or fp32 (--moe-router-dtype; DeepSeek-V3: fp32); exported, not priced
    #[arg(long)]
    pub moe_router_dtype: Option<String>,
    /// Multi-token prediction modules on the last stage (--mtp-num-layers;
    /// DeepSeek-V3 has 1; 0 takes them away).
    #[arg(long, value_parser = whole(paratune::model::MAX_MTP_LAYERS), allow_negative_numbers = true)]
    pub mtp_layers: Option<u64>,
    /// Sliding-window attention: each query of a windowed layer attends to itself and
    /// the N tokens before it (Megatron-LM's --window-size N,0; gpt-oss: 127, Hugging
    /// Face's sliding_window 128 counting the query; 0: none)
    #[arg(long, value_parser = whole(paratune::model::MAX_WINDOW_TOKENS), allow_negative_numbers = true)]
    pub sliding_window: Option<u64>,
    /// Every N-th layer attends fully instead (--window-attn-skip-freq; gpt-oss: 2;
    /// 0: every layer windowed)
    #[arg(long, value_parser = whole(65536), allow_negative_numbers = true)]
    pub window_attn_skip_freq: Option<u64>,
    /// gpt-oss's gated MLP: quick-GeLU instead of SiLU (Megatron-LM's --quick-geglu): on/off
    #[arg(long)]
    pub quick_geglu: Option<String>,
    /// Clamp the first projection's halves to this bound before the quick-GeGLU
    /// (--activation-func-clamp-value; gpt-oss: 7; 0: none)
    #[arg(long, value_parser = real, allow_negative_numbers = true)]
    pub activation_clamp: Option<f64>,
    /// Added to the quick-GeGLU's linear half (--glu-linear-offset; gpt-oss: 1)
    #[arg(long, value_parser = real, allow_negative_numbers = true)]
    pub glu_linear_offset: Option<f64>,
    /// A learnable softmax offset per head, gpt-oss's attention sinks
    /// (--softmax-type learnable): on/off
    #[arg(long)]
    pub attention_sinks: Option<String>,
    /// RMSNorm instead of LayerNorm (Llama and the models after it; --normalization RMSNorm): on/off
    #[arg(long)]
    pub rms_norm: Option<String>,
    /// Biases on the linear layers (GPT and gpt-oss; off: --disable-bias-linear): on/off
    #[arg(long)]
    pub linear_bias: Option<String>,
    /// Normalise queries and keys before attention (Qwen3; --qk-layernorm): on/off
    #[arg(long)]
    pub qk_layernorm: Option<String>,
    /// Base of the rotary embedding, rope_theta (--rotary-base; Llama 3: 500000); exported, not priced
    #[arg(long, value_parser = count(1 << 40), allow_negative_numbers = true)]
    pub rotary_base: Option<u64>,
    /// Epsilon of the norms, rms_norm_eps (--norm-epsilon; Qwen3: 1e-6); exported, not priced
    #[arg(long, value_parser = real, allow_negative_numbers = true)]
    pub norm_epsilon: Option<f64>,
}

/// Where to train.
#[derive(Args, Debug, Clone, Default)]
pub struct ClusterArgs {
    /// Cluster TOML file (instead of --gpu/--nodes/...).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// A profile directory whose measured device (`profile device`) and links
    /// (`profile comm`) describe the node, instead of a datasheet; with --gpus-per-node.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["cluster", "gpu"])]
    pub cluster_from_profile: Option<PathBuf>,
    /// GPU kind (see `paratune gpus`).
    #[arg(long)]
    pub gpu: Option<String>,
    /// Nodes in the cluster.
    #[arg(long, value_parser = count(1 << 17), allow_negative_numbers = true)]
    pub nodes: Option<u64>,
    #[arg(long, value_parser = count(1 << 10), allow_negative_numbers = true)]
    pub gpus_per_node: Option<u64>,
    /// GPUs the job uses, if fewer than the whole cluster (may be less than a node).
    #[arg(long, value_parser = count(1 << 20), allow_negative_numbers = true)]
    pub gpus: Option<u64>,
    /// Per-GPU intra-node bandwidth with its unit, e.g. 300GB/s.
    #[arg(long, value_parser = parse_bandwidth)]
    pub intra_node_bw: Option<Bandwidth>,
    /// Per-node inter-node bandwidth with its unit, e.g. 8x200Gb/s.
    #[arg(long, value_parser = parse_bandwidth)]
    pub inter_node_bw: Option<Bandwidth>,
    /// Plan for less device memory than the datasheet, e.g. 40GiB.
    #[arg(long, value_parser = parse_bytes)]
    pub memory_limit: Option<Bytes>,
}

fn parse_bandwidth(text: &str) -> Result<Bandwidth, String> {
    text.parse()
}

fn parse_bytes(text: &str) -> Result<Bytes, String> {
    text.parse()
}

/// Counts and sizes: a whole number from 1 to `max`. The bound keeps
/// the search finite and its arithmetic far from overflow; it is well above
/// any machine or model that exists.
fn count(max: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |text: &str| match text.trim().parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) if n > max => Err(format!(
            "{n} is more than paratune plans for (at most {max})"
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "`{text}` is not a whole number; give one such as 8"
        )),
    }
}

/// A whole number from 0 to `max` (0 meaning none of it).
fn whole(max: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync + 'static {
    move |text: &str| match text.trim().parse::<u64>() {
        Ok(n) if n > max => Err(format!(
            "{n} is more than paratune plans for (at most {max})"
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "`{text}` is not a whole number from 0 to {max}; give one such as 1"
        )),
    }
}

/// A finite decimal number (the field's own range is checked where it is
/// used).
fn real(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!(
            "`{text}` is not a number; give one such as 2.5 or 1e-5"
        )),
    }
}

/// A number of layers, 0 included.
fn layer_count(text: &str) -> Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(n) if n > 1 << 16 => Err(format!("{n} is more layers than paratune plans for")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "`{text}` is not a whole number; give one such as 8"
        )),
    }
}

/// More folds than this leave folds of a row or two, and each is a whole fit.
const MAX_FOLDS: usize = 50;
/// Each bootstrap sample is a whole fit (seconds each on the reference data):
/// 1,000 already takes hours; interval estimates settle long before.
const MAX_BOOTSTRAP: usize = 1000;

/// A count from 0 to `max`.
fn up_to(max: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |text: &str| match text.trim().parse::<usize>() {
        Ok(n) if n > max => Err(format!(
            "{n} is more than makes sense (at most {max}; each is a whole fit)"
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{text}` is not a whole number from 0 to {max}")),
    }
}

fn at_least_one_row(text: &str) -> Result<usize, String> {
    count(u64::MAX)(text).map(|n| n as usize)
}

/// Values of the search dimensions: lists for `plan`, one value each for `predict`.
#[derive(Args, Debug, Clone, Default)]
pub struct SpaceArgs {
    /// Tensor-parallel degree(s), e.g. 4,8.
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 20), allow_negative_numbers = true)]
    pub tp: Option<Vec<u64>>,
    /// Pipeline-parallel degree(s).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub pp: Option<Vec<u64>>,
    /// Data-parallel degree(s).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 20), allow_negative_numbers = true)]
    pub dp: Option<Vec<u64>>,
    /// Micro-batch size(s).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 20), allow_negative_numbers = true)]
    pub micro_batch: Option<Vec<u64>>,
    /// Pipeline schedule(s): gpipe, 1f1b, interleaved.
    #[arg(long, value_delimiter = ',')]
    pub schedule: Option<Vec<String>>,
    /// Model chunks per pipeline rank for the interleaved schedule (more than 1 implies
    /// --schedule interleaved).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub virtual_stages: Option<Vec<u64>>,
    /// Activation recomputation: none, selective, full.
    #[arg(long, value_delimiter = ',')]
    pub recompute: Option<Vec<String>>,
    /// What --recompute selective redoes (Megatron-LM's --recompute-modules), one set
    /// for every candidate: some of core_attn (default), layernorm, moe_act, mlp, moe,
    /// shared_experts, mla_up_proj, e.g. layernorm,moe_act; or auto (plan, Megatron-LM)
    /// to try the sets NVIDIA's recipes use that the model has: core_attn,
    /// layernorm,moe_act, moe_act, mla_up_proj, mla_up_proj,mlp.
    #[arg(long)]
    pub recompute_modules: Option<String>,
    /// Sequence parallelism: on, off.
    #[arg(long, value_delimiter = ',')]
    pub sequence_parallel: Option<Vec<String>>,
    /// Sharding over data-parallel ranks: none, optimizer-states (ZeRO-1), full (ZeRO-3/FSDP).
    #[arg(long, value_delimiter = ',')]
    pub optimizer_sharding: Option<Vec<String>>,
    /// BPipe activation balancing: on, off.
    #[arg(long, value_delimiter = ',')]
    pub bpipe: Option<Vec<String>>,
    /// Attention kernel: flash, standard.
    #[arg(long, value_delimiter = ',')]
    pub attention: Option<Vec<String>>,
    /// Layers of the first pipeline stage, when fewer (or more) than the even share
    /// (Megatron-LM's --decoder-first-pipeline-num-layers); the other stages share the rest.
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16))]
    pub first_stage_layers: Option<Vec<u64>>,
    /// Layers of the last pipeline stage (--decoder-last-pipeline-num-layers).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16))]
    pub last_stage_layers: Option<Vec<u64>>,
    /// Data-parallel gradient reduction under the backward pass (Megatron-LM's
    /// --overlap-grad-reduce): on, off.
    #[arg(long, value_delimiter = ',')]
    pub overlap_grad_reduce: Option<Vec<String>>,
    /// The distributed optimizer's all-gather under the next forward pass
    /// (--overlap-param-gather): on, off.
    #[arg(long, value_delimiter = ',')]
    pub overlap_param_gather: Option<Vec<String>>,
    /// Tensor-parallel collectives pipelined with their GEMMs (--tp-comm-overlap,
    /// needs sequence parallelism): on, off.
    #[arg(long, value_delimiter = ',')]
    pub tp_comm_overlap: Option<Vec<String>>,
    /// Expert-parallel all-to-alls hidden under another micro-batch's compute
    /// (Megatron-Core's --overlap-moe-expert-parallel-comm): on, off.
    #[arg(long, value_delimiter = ',')]
    pub ep_comm_overlap: Option<Vec<String>>,
    /// FP8 weights gathered by the sharded optimizer (Megatron-LM's
    /// --fp8-param-gather; default on with --precision fp8 where it runs): on, off.
    #[arg(long, value_delimiter = ',')]
    pub fp8_param_gather: Option<Vec<String>>,
    /// PyTorch's allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: on, off (default
    /// as the engine's launcher runs it: off for Megatron-LM, on for torchtitan, whose run_train.sh
    /// sets it). On, no memory is counted lost to fragmentation between cached blocks.
    #[arg(long, value_delimiter = ',')]
    pub expandable_segments: Option<Vec<String>>,
    /// CUDA graphs (--cuda-graph-impl; torch.compile's cudagraphs): off, on (each layer), full
    /// (the whole iteration, Megatron-LM; an MoE model then needs --moe-dispatcher hybridep).
    #[arg(long, value_delimiter = ',')]
    pub cuda_graphs: Option<Vec<String>>,
    /// Where pipeline stages sit: megatron (neighbours side by side), bpipe-pairs
    /// (BPipe's evictor and acceptor side by side).
    #[arg(long, value_delimiter = ',')]
    pub stage_order: Option<Vec<String>>,
    /// The training engine whose memory and time semantics, recomputation policies and
    /// export the plan follows: megatron (default), torchtitan.
    #[arg(long)]
    pub engine: Option<String>,
    /// torch.compile (torchtitan): on, off.
    #[arg(long, value_delimiter = ',')]
    pub compile: Option<Vec<String>>,
    /// One layer in N checkpointed under --recompute selective-layer (torchtitan).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 10))]
    pub ac_frequency: Option<Vec<u64>>,
    /// Hybrid sharding (torchtitan's HSDP): shard the state over groups of N data-parallel ranks,
    /// replicated over the rest (default: all of dp, and within a node's ranks).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 20))]
    pub dp_shard: Option<Vec<u64>>,
    /// Context-parallel degree(s): the sequence split over N ranks (Megatron-LM's
    /// --context-parallel-size; searched from 8K tokens when not given).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub cp: Option<Vec<u64>>,
    /// How context-parallel ranks exchange keys and values: p2p (ring, default), a2a, allgather,
    /// a2a+p2p (Megatron-LM's hierarchical exchange: all-to-all within a node, ring between).
    #[arg(long, value_delimiter = ',')]
    pub cp_comm: Option<Vec<String>>,
    /// Expert-parallel degree(s) of an MoE model (--expert-model-parallel-size).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub ep: Option<Vec<u64>>,
    /// Expert-tensor-parallel degree(s) (--expert-tensor-parallel-size; searched: 1 and tp).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16), allow_negative_numbers = true)]
    pub etp: Option<Vec<u64>>,
    /// Number format of the layers' GEMMs: bf16 (default), fp8 (Transformer Engine's
    /// FP8, MXFP8 on Blackwell; needs a GPU with FP8), nvfp4 (Transformer Engine's
    /// NVFP4; Blackwell and Megatron-LM only), or several to compare.
    #[arg(long, value_delimiter = ',')]
    pub precision: Option<Vec<String>>,
    /// How FP8 inputs are scaled (Megatron-LM's --fp8-recipe): tensorwise (current
    /// scaling), delayed (Megatron-LM's default), mxfp8 (Blackwell only) or blockwise;
    /// default mxfp8 on Blackwell, tensorwise elsewhere.
    #[arg(long)]
    pub fp8_recipe: Option<String>,
    /// Number format gradients are kept and reduced in over data-parallel ranks: fp32
    /// (default; Megatron-LM's main gradients), bf16 (--grad-reduce-in-bf16, torchtitan's
    /// mixed_precision_reduce = "bfloat16"), or both to compare.
    #[arg(long, value_delimiter = ',')]
    pub grad_reduce: Option<Vec<String>>,
    /// How the loss's cross-entropy runs over the logits: off (default; Megatron-LM's
    /// vocab-parallel cross-entropy on an fp32 copy), native (--cross-entropy-loss-fusion),
    /// te (--cross-entropy-fusion-impl te: Transformer Engine's kernel, in place on the
    /// 16-bit logits), or a list to compare. Megatron-LM only.
    #[arg(long, value_delimiter = ',')]
    pub cross_entropy_fusion: Option<Vec<String>>,
    /// Whether the output layer's weight-gradient GEMMs wait for the pipeline flush
    /// (--defer-embedding-wgrad-compute): off (default), all micro-batches', or a number
    /// of micro-batches (--wgrad-deferral-limit); a list to compare. Megatron-LM with
    /// pp > 1: the last stage keeps their logits gradients and runs their GEMMs in its
    /// slack at the flush.
    #[arg(long, value_delimiter = ',')]
    pub wgrad_deferral: Option<Vec<String>>,
    /// Layers whose saved activations are copied to host memory in the forward pass and
    /// back in the backward (--cpu-offloading-num-layers; Megatron-LM with pp 1 and no
    /// recomputation): 0 (default) keeps them on the GPU; a list to compare.
    #[arg(long, value_delimiter = ',', value_parser = layer_count)]
    pub cpu_offload_layers: Option<Vec<u64>>,
    /// How an untied input embedding's gradient is synchronised over the data-parallel
    /// ranks: all-reduce (default), sparse-all-gather, parameter-server, or all to let the
    /// search pick (Parallax; Megatron-LM and torchtitan run all-reduce only).
    #[arg(long, value_delimiter = ',')]
    pub embedding_sync: Option<Vec<String>>,
    /// How an MoE layer's tokens reach their experts: alltoall, allgather,
    /// flex (DeepEP), hybridep (flex with HybridEP)
    /// (--moe-token-dispatcher-type; searched: alltoall and allgather).
    #[arg(long, value_delimiter = ',')]
    pub moe_dispatcher: Option<Vec<String>>,
    /// Run tables: the rank whose memory a table's peak_allocated_gib/peak_reserved_gib
    /// columns hold when it has no memory_rank column: max (default), or last (Megatron-LM's
    /// TensorBoard and CI golden values come from the last rank).
    #[arg(long)]
    pub memory_rank: Option<String>,
}

#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Sequences per iteration over all data-parallel ranks.
    #[arg(long, value_parser = count(1 << 20), allow_negative_numbers = true)]
    pub global_batch: Option<u64>,
    /// Cost model: a built-in name (datasheet, a100-megatron) or a cost-model TOML file.
    #[arg(long)]
    pub cost_model: Option<String>,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub space: SpaceArgs,
    /// Rows of the ranking to show.
    #[arg(long, default_value_t = 10, value_parser = at_least_one_row, allow_negative_numbers = true)]
    pub top: usize,
    /// Explain a configuration you had in mind, e.g. "tp=8,pp=8,mb=1,recompute=full";
    /// keys not given are taken from the winner.
    #[arg(long)]
    pub explain: Option<String>,
    /// Profile directory (see `paratune profile`): measured collectives and layers
    /// replace the cost model's formulas where they cover the case.
    #[arg(long)]
    pub profile: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct PredictArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub space: SpaceArgs,
    /// A runs CSV: predict every row (columns absent take the flags' values).
    #[arg(long)]
    pub runs: Option<PathBuf>,
    /// Profile directory (see `paratune profile`): measured collectives and layers
    /// replace the cost model's formulas where they cover the case.
    #[arg(long)]
    pub profile: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct EvaluateArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub space: SpaceArgs,
    /// A runs CSV with measured `iter_ms` (or SC'21-style `tflops_per_gpu`).
    #[arg(long)]
    pub runs: PathBuf,
    /// Also list every group's rank correlation and regret.
    #[arg(long)]
    pub groups: bool,
    /// Profile directory (see `paratune profile`): measured collectives and layers
    /// replace the cost model's formulas where they cover the case.
    #[arg(long)]
    pub profile: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    #[command(flatten)]
    pub space: SpaceArgs,
    /// Runs CSV(s) with measured times; give the flag once per file.
    #[arg(long, required = true)]
    pub runs: Vec<PathBuf>,
    /// Where to write the fitted cost model (a report is written beside it).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Coefficients allowed to move, e.g. gemm_efficiency,host_us_per_layer_pass.
    #[arg(long, value_delimiter = ',')]
    pub fit: Option<Vec<String>>,
    /// Hold out this fraction of the rows and report the error on them.
    #[arg(long)]
    pub holdout: Option<f64>,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Cross-validation folds (0: none; at most 50).
    #[arg(long, default_value_t = 5, value_parser = up_to(MAX_FOLDS))]
    pub folds: usize,
    /// Bootstrap refits for the confidence intervals (0: none; at most 1000).
    #[arg(long, default_value_t = 20, value_parser = up_to(MAX_BOOTSTRAP))]
    pub bootstrap: usize,
    /// nccl-tests all-reduce measurements (gpus, bytes, out_of_place_us) to fit the
    /// collective coefficients to first; the iteration-time fit then keeps them.
    #[arg(long)]
    pub collectives: Option<PathBuf>,
    /// Name of the fitted cost model.
    #[arg(long)]
    pub name: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum ProfileCommand {
    /// Add nccl-tests results (the stdout of all_reduce_perf and its siblings) to a profile.
    ImportNcclTests(ImportNcclTestsArgs),
    /// Add an nccl-tests-style CSV (gpus,bytes,...,out_of_place_us,out_of_place_busbw_GBps,...).
    ImportTable(ImportTableArgs),
    /// Add measured layer times from a table like Korthikanti et al.'s
    /// (experiment,hidden,heads,seq_len,micro_batch,tp,sequence_parallel,recompute,forward_ms,backward_ms,...).
    ImportLayers(ImportLayersArgs),
    /// Summarise a profile directory.
    Show(ShowProfileArgs),
    /// Measure real transformer layers (one tensor-parallel shard each) with libtorch
    /// (feature `torch`): forward, backward, recomputation, activation memory.
    Layer(Box<ProfileLayerArgs>),
    /// Record the GPU (name, memory, SMs, clocks; feature `cuda`) and measure achievable
    /// matrix-multiply TFLOP/s and memory copy bandwidth (feature `torch`).
    Device(ProfileDeviceArgs),
    /// Sweep NCCL all-reduce, all-gather, reduce-scatter and send/recv over the local
    /// GPUs (feature `cuda`).
    Comm(ProfileCommArgs),
    /// Count the distinct token ids per batch of a token stream (one id per line, or a
    /// NumPy .npy array): the embedding rows a rank's batch touches, which sparse
    /// embedding syncs move.
    Tokens(ProfileTokensArgs),
    /// Time the three embedding-gradient syncs (all-reduce, sparse-all-gather,
    /// parameter-server) for real between N local torch.distributed ranks (gloo on the
    /// CPU, NCCL on GPUs), through the worker `validate --launch torch` runs.
    Sync(ProfileSyncArgs),
    /// Internal: measure one point in a fresh process (the sweeps spawn it).
    #[command(hide = true)]
    Worker(WorkerArgs),
}

#[derive(Args, Debug)]
pub struct ProfileTokensArgs {
    /// Token ids: text with one id per line, or a .npy integer array.
    #[arg(long)]
    pub data: PathBuf,
    /// The tokenizer's vocabulary size (every id must be below it).
    #[arg(long, value_parser = count(1 << 24), allow_negative_numbers = true)]
    pub vocab: u64,
    /// Batch sizes in tokens, comma-separated (default: powers of two up to the stream).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 40), allow_negative_numbers = true)]
    pub batch_tokens: Option<Vec<u64>>,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

#[derive(Args, Debug)]
pub struct ProfileSyncArgs {
    /// Local ranks of torch.distributed (at least 2).
    #[arg(long, value_parser = count(1 << 12), allow_negative_numbers = true)]
    pub ranks: u64,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// A Python interpreter with PyTorch.
    #[arg(long, default_value = "python3")]
    pub python: PathBuf,
    /// Rows of the embedding table (the vocabulary).
    #[arg(long, value_parser = count(1 << 24), allow_negative_numbers = true)]
    pub vocab: u64,
    /// Columns of the embedding table (the hidden size).
    #[arg(long, value_parser = count(1 << 20), allow_negative_numbers = true)]
    pub hidden: u64,
    /// Tokens in one rank's batch, comma-separated: one point per size.
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 24), allow_negative_numbers = true, required = true)]
    pub tokens_per_rank: Vec<u64>,
    /// Token ids to batch (one per line, or .npy); default: drawn from Zipf's law.
    #[arg(long, conflicts_with = "zipf_exponent")]
    pub data: Option<PathBuf>,
    /// Exponent of the Zipf law the ids are drawn from without --data.
    #[arg(long, default_value_t = 1.0)]
    pub zipf_exponent: f64,
    /// Parameter-server shard counts (default: 1 to --ranks).
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 12), allow_negative_numbers = true)]
    pub partitions: Option<Vec<u64>>,
    /// Methods to time, comma-separated (default: all three).
    #[arg(long, value_delimiter = ',')]
    pub methods: Option<Vec<String>>,
    /// Timed repetitions per point (the median is kept).
    #[arg(long, value_parser = count(1000), allow_negative_numbers = true, default_value_t = 7)]
    pub iterations: u64,
    /// Seconds the whole sweep may take before it is killed and reported.
    #[arg(long, default_value_t = 1800.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

/// How long each measured point repeats.
#[derive(Args, Debug, Clone)]
pub struct RepetitionArgs {
    /// Untimed repetitions before timing.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Stop when the 95% confidence interval of the mean is within this fraction of it.
    #[arg(long, default_value_t = 0.02)]
    pub target_ci: f64,
    /// Timed repetitions at most per point.
    #[arg(long, value_parser = at_least_one_row, default_value_t = 100)]
    pub max_repetitions: usize,
    /// Timed work at most per point, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub max_seconds: f64,
}

#[derive(Args, Debug)]
pub struct ProfileLayerArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Micro-batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 16), allow_negative_numbers = true, default_value = "1")]
    pub micro_batch: Vec<u64>,
    /// Tensor-parallel degrees, comma-separated: each point is one shard.
    #[arg(long, value_delimiter = ',', value_parser = count(1 << 10), allow_negative_numbers = true, default_value = "1")]
    pub tp: Vec<u64>,
    /// Sequence parallelism, comma-separated: off, on (on only measures tp > 1).
    #[arg(long, value_delimiter = ',', default_value = "off")]
    pub sequence_parallel: Vec<String>,
    /// Precision: fp32, fp16 or bf16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Where to run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// Record a point as out of memory when its peak exceeds this (simulates a smaller device).
    #[arg(long)]
    pub memory_limit: Option<Bytes>,
    #[command(flatten)]
    pub repetitions: RepetitionArgs,
    /// Seconds a point may take before its worker is killed and the point recorded as failed.
    #[arg(long, default_value_t = 900.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

#[derive(Args, Debug)]
pub struct ProfileDeviceArgs {
    /// Where to run: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// Precision of the matrix multiplies: fp32, fp16 or bf16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Largest square matrix side in the sweep (sides double from 256).
    #[arg(long, value_parser = count(1 << 16), default_value_t = 8192)]
    pub max_side: u64,
    /// Tokens per sequence of the fused-attention points (two sequences,
    /// heads 64 and 128 wide); default 8192 on a GPU, 512 on the CPU.
    #[arg(long, value_parser = count(1 << 17))]
    pub attention_seq: Option<u64>,
    #[command(flatten)]
    pub repetitions: RepetitionArgs,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

#[derive(Args, Debug)]
pub struct ProfileCommArgs {
    /// GPU indices to run the collectives over, comma-separated (at least 2).
    #[arg(long, value_delimiter = ',', required_unless_present = "ranks")]
    pub gpus: Vec<usize>,
    /// Instead of NCCL in this process: this many ranks of PyTorch's
    /// torch.distributed (gloo on --device cpu, NCCL on cuda), through the
    /// worker `validate --launch torch` runs.
    #[arg(long, value_parser = count(1 << 12), allow_negative_numbers = true, conflicts_with = "gpus")]
    pub ranks: Option<u64>,
    /// With --ranks: cpu or cuda.
    #[arg(long, default_value = "cpu", requires = "ranks")]
    pub device: String,
    /// With --ranks: a Python interpreter with PyTorch.
    #[arg(long, default_value = "python3", requires = "ranks")]
    pub python: PathBuf,
    /// Largest message, e.g. 1GiB (sizes double from 1 KiB).
    #[arg(long, default_value = "1GiB")]
    pub max_bytes: Bytes,
    /// Seconds one collective's sweep may take before it is killed and reported.
    #[arg(long, default_value_t = 1800.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub repetitions: RepetitionArgs,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The measurement, as JSON.
    #[arg(long)]
    pub job: String,
}

/// Where a profile's measurements come from, recorded in its environment.toml.
#[derive(Args, Debug, Clone, Default)]
pub struct ProvenanceArgs {
    /// The profile directory to create or add to.
    #[arg(long)]
    pub out: PathBuf,
    /// GPU measured (e.g. a100-80gb); needed for a new profile unless the log names its device.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Where the measurements come from (tool, paper, data set).
    #[arg(long)]
    pub source: Option<String>,
    /// A note for environment.toml (attribution, licence, caveats); give the flag once per note.
    #[arg(long)]
    pub note: Vec<String>,
}

#[derive(Args, Debug)]
pub struct ImportNcclTestsArgs {
    /// nccl-tests output files.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Collective: all_reduce, all_gather, reduce_scatter, sendrecv (default: from the log).
    #[arg(long)]
    pub op: Option<String>,
    /// Ranks of the run (default: the log's `#  Rank N ... device` lines counted).
    #[arg(long)]
    pub ranks: Option<u64>,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

#[derive(Args, Debug)]
pub struct ImportTableArgs {
    pub file: PathBuf,
    /// Collective the table measured: all_reduce, all_gather, reduce_scatter, sendrecv.
    #[arg(long)]
    pub op: String,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

#[derive(Args, Debug)]
pub struct ImportLayersArgs {
    pub file: PathBuf,
    /// Training precision the layers ran in (free-form, e.g. bf16).
    #[arg(long, default_value = "16-bit")]
    pub dtype: String,
    #[command(flatten)]
    pub provenance: ProvenanceArgs,
}

#[derive(Args, Debug)]
pub struct ShowProfileArgs {
    /// The profile directory.
    pub dir: PathBuf,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchEngine {
    Megatron,
    Torchtitan,
    /// PyTorch's own torch.distributed, through the worker paratune ships.
    Torch,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Srun,
}

#[derive(Args, Debug)]
pub struct ValidateArgs {
    /// A plan written by `paratune plan ... --format json`.
    pub plan: PathBuf,
    /// Candidates to trial, from the top of the plan.
    #[arg(long, value_parser = at_least_one_row, default_value_t = 3)]
    pub top: usize,
    /// Local trials: where to run them (cpu, cuda or cuda:N).
    #[arg(long, default_value = "cuda:0")]
    pub device: String,
    /// Local trials: precision (fp32, fp16, bf16).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Timed iterations per trial (after one warm-up iteration).
    #[arg(long, value_parser = at_least_one_row, default_value_t = 20)]
    pub iterations: usize,
    /// Local trials: simulate a device with this much memory (e.g. 40GiB).
    #[arg(long)]
    pub memory_limit: Option<Bytes>,
    /// Seconds a trial may run before it is killed and recorded as failed.
    #[arg(long, default_value_t = 1800.0)]
    pub timeout: f64,
    /// Repeat plan -> trial -> refit until the winner is stable or this many rounds ran.
    #[arg(long = "loop", value_parser = at_least_one_row, default_value_t = 1)]
    pub rounds: usize,
    /// Where scripts, logs, measurements and the report go (default reports/<plan name>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Cost model to predict with (default: the plan's).
    #[arg(long)]
    pub cost_model: Option<String>,
    /// Cluster trials: write (and unless --dry-run, run) launch scripts for this engine.
    #[arg(long)]
    pub launch: Option<LaunchEngine>,
    /// Cluster trials: a Megatron-LM checkout (holding pretrain_gpt.py).
    #[arg(long)]
    pub megatron_path: Option<PathBuf>,
    /// Cluster trials with torchtitan: MODULE:CONFIG (0.3, e.g. llama3:llama3_8b) or a 0.2 job TOML.
    #[arg(long)]
    pub torchtitan_config: Option<String>,
    /// Cluster trials: how the scripts start the ranks.
    #[arg(long, value_enum, default_value_t = Launcher::Torchrun)]
    pub launcher: Launcher,
    /// Cluster trials: write the scripts without running them.
    #[arg(long)]
    pub dry_run: bool,
    /// --launch torch: ranks to start on this machine (default: the plan's GPU count).
    #[arg(long, value_parser = count(1 << 12), allow_negative_numbers = true)]
    pub ranks: Option<u64>,
    /// --launch torch: a Python interpreter with PyTorch.
    #[arg(long, default_value = "python3")]
    pub python: PathBuf,
}

#[derive(Subcommand, Debug)]
pub enum IngestCommand {
    /// Read Megatron-LM pretrain_gpt.py logs (one run each) into a runs CSV:
    /// the configuration, the steady-state iteration time and the peak memory.
    MegatronLog(MegatronLogArgs),
    /// Read torchtitan training logs (one run each) into a runs CSV: the
    /// configuration (printed in the log, its job TOML with --config, or the
    /// torchrun command line in the log), the steady step time from the
    /// step lines' tps and rank 0's peak reserved memory.
    TorchtitanLog(TorchtitanLogArgs),
}

#[derive(Args, Debug)]
pub struct MegatronLogArgs {
    /// Log files: the stdout/stderr of pretrain_gpt.py runs, one run each.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The runs CSV to write (refused if it exists, unless --append).
    #[arg(long)]
    pub out: PathBuf,
    /// Logged iterations left out of the steady state as warm-up (iteration 1 always is).
    #[arg(long, default_value_t = DEFAULT_WARMUP)]
    pub warmup: usize,
    /// Add the rows to an existing --out, skipping rows it already holds.
    #[arg(long)]
    pub append: bool,
}

#[derive(Args, Debug)]
pub struct TorchtitanLogArgs {
    /// Log files: the stdout of torchrun ... -m torchtitan.train runs, one run each.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The runs CSV to write (refused if it exists, unless --append).
    #[arg(long)]
    pub out: PathBuf,
    /// The runs' job config, for logs that do not print theirs: a torchtitan
    /// 0.2 TOML (what --job.config_file read), or the JSON of a saved config.
    /// The log's printed config and command line take precedence over it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The model, where the log's flavor is not one paratune knows: a
    /// built-in model (`paratune models`) or a model TOML file.
    #[arg(long, value_name = "NAME|FILE")]
    pub model: Option<String>,
    /// The run's GPU count, where neither the log nor the config gives it
    /// (data_parallel_shard_degree = -1 without a device-mesh line).
    #[arg(long, value_name = "N", value_parser = gpu_count)]
    pub gpus: Option<u64>,
    /// Logged step lines left out of the steady state as warm-up (step 1 always is).
    #[arg(long, default_value_t = DEFAULT_WARMUP)]
    pub warmup: usize,
    /// Add the rows to an existing --out, skipping rows it already holds.
    #[arg(long)]
    pub append: bool,
}

fn gpu_count(text: &str) -> std::result::Result<u64, String> {
    match text.trim().parse::<u64>() {
        Ok(n) if (1..=1 << 20).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{text}` is not a GPU count; give a whole number such as 8"
        )),
    }
}
