//! Megatron-LM training logs: the stdout/stderr of a `pretrain_gpt.py` run,
//! read into the configuration it ran, its per-iteration times and its peak
//! memory, and turned into a row of paratune's run table.
//!
//! The formats are Megatron-LM's current ones (NVIDIA/Megatron-LM main,
//! checked against `megatron/training/arguments.py` at commit 000c4ac,
//! `megatron/training/training.py` at 001b00c and `megatron/training/utils.py`
//! at 00caa53):
//!
//! * the argument dump of `_print_args` (arguments.py), printed by rank 0:
//!   `'------------------------ {title} ------------------------'` with the
//!   title `arguments`, then one `'  {} {} {}'.format(arg, dots, value)` line
//!   per argument where `dots = '.' * (48 - len(arg))`, sorted, then
//!   `'-------------------- end of {title} ---------------------'`;
//! * the iteration line of `training_log` (training.py), printed by the last
//!   rank every `--log-interval` iterations and after the first:
//!   `f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"`,
//!   `' iteration {:8d}/{:8d} |'`, `' consumed samples: {:12d} |'`,
//!   `' elapsed time per iteration (ms): {:.1f} |'`, with `--log-throughput`
//!   `f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'`,
//!   `f' learning rate: {learning_rate:.6E} |'`,
//!   `f' global batch size: {batch_size:5d} |'`, each loss as
//!   `' {}: {:.6E} |'` (`lm loss`), `f' loss scale: {loss_scale:.1f} |'`,
//!   `f' grad norm: {grad_norm:.3f} |'`,
//!   `' number of skipped iterations: {:3d} |'` and
//!   `' number of nan iterations: {:3d} |'` (counts since the previous line);
//! * the memory report of `report_memory` (utils.py), printed by every rank
//!   of data-parallel rank 0 after the first two iterations:
//!   `"[Rank {}] {}".format(rank, string)` where `string` is
//!   `name + ' memory (MB)'`, `f" | allocated: {...:.2f}"`,
//!   `f" | max allocated: {...:.2f}"`, `f" | reserved: {...:.2f}"`,
//!   `f" | max reserved: {...:.2f}"` and the name is
//!   `f'(after {iteration} iterations)'`; a megabyte is `1024.0 * 1024.0`
//!   bytes there;
//! * the vocabulary padding line of `_vocab_size_with_padding` (tokenizer.py,
//!   printed by rank 0): `' > padded vocab (size: {}) with {} dummy tokens
//!   (new size: {})'`.
//!
//! Lines may carry prefixes (timestamps, torchrun's `[default0]:`, PyTorch's
//! `[rank0]:`, `srun -l`'s `0:`); every pattern is looked for anywhere in a
//! line. A log cut off mid-way, or with lines of other programs mixed in,
//! gives what it holds; what is missing for a row is an error that names it.

use crate::config::{OptimizerSharding, ParallelConfig, Recompute, ScheduleKind};
use crate::model::AttentionKind;
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use crate::validate::torch_launch::without;

/// How many logged iterations are left out of the steady state by default.
pub const DEFAULT_WARMUP: usize = 2;

/// `_print_args("arguments", args)` in `megatron/training/arguments.py`.
const ARGS_BEGIN: &str = "------------------------ arguments ------------------------";
const ARGS_END: &str = "-------------------- end of arguments ---------------------";
/// `dots = '.' * (48 - len(arg))` in `_print_args`.
const ARG_COLUMNS: usize = 48;
/// `' elapsed time per iteration (ms): {:.1f} |'` in `training_log`.
const ELAPSED_KEY: &str = "elapsed time per iteration (ms)";
/// `f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'` in `training_log`.
const THROUGHPUT_KEY: &str = "throughput per GPU (TFLOP/s/GPU)";
const GLOBAL_BATCH_KEY: &str = "global batch size";
const CONSUMED_KEY: &str = "consumed samples";
const LOSS_KEY: &str = "lm loss";
const SKIPPED_KEY: &str = "number of skipped iterations";
const NAN_KEY: &str = "number of nan iterations";
/// `name + ' memory (MB)'` in `report_memory`.
const MEMORY_MARK: &str = " memory (MB)";
/// `' > padded vocab (size: {}) with {} dummy tokens (new size: {})'`.
const PADDED_VOCAB_MARK: &str = "padded vocab (size: ";
const NEW_SIZE_MARK: &str = "(new size: ";
/// `mega_bytes = 1024.0 * 1024.0` in `report_memory`.
const MEGABYTE: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

#[derive(Debug, thiserror::Error)]
pub enum MegatronLogError {
    #[error("{path}: cannot read the log: {message}")]
    Read { path: String, message: String },
    #[error(
        "{path}: the file is empty; give the stdout/stderr of a Megatron-LM pretrain_gpt.py run"
    )]
    Empty { path: String },
    #[error(
        "{path}: no Megatron-LM argument dump (the `{ARGS_BEGIN}` block pretrain_gpt.py prints at start-up); give the whole log from its first line, including rank 0's output (with torchrun, do not --redirect rank 0 away)"
    )]
    NoArguments { path: String },
    #[error(
        "{path}: the argument dump lacks {}; {hint}",
        names.join(", ")
    )]
    MissingArguments {
        path: String,
        names: Vec<String>,
        hint: &'static str,
    },
    #[error("{path} line {line}: argument `{name}` is `{value}`, expected {expected}")]
    BadArgument {
        path: String,
        line: usize,
        name: String,
        value: String,
        expected: &'static str,
    },
    #[error(
        "{path}: no readable iteration lines (` iteration N/ M | ... | elapsed time per iteration (ms): T |`); the run stopped before its first logged iteration, or this is not the last rank's output (rank {last_rank} prints them)"
    )]
    NoIterations { path: String, last_rank: String },
    #[error(
        "{path}: no iteration lines after the {warmup} warm-up iterations ({logged} logged); run more --train-iters or lower --warmup"
    )]
    NoSteadyIterations {
        path: String,
        warmup: usize,
        logged: usize,
    },
    #[error("{path}: {message}")]
    Inconsistent { path: String, message: String },
    #[error("{path}: the run uses {feature}, which paratune's run table cannot describe; {hint}")]
    Unsupported {
        path: String,
        feature: String,
        hint: &'static str,
    },
}

/// The configuration a run used, read from its argument dump.
#[derive(Debug, Clone, PartialEq)]
pub struct MegatronConfig {
    pub num_layers: u64,
    pub hidden_size: u64,
    pub num_attention_heads: u64,
    /// `--num-query-groups`; Megatron-LM reads it only with `--group-query-attention`.
    pub num_query_groups: Option<u64>,
    pub group_query_attention: bool,
    /// Megatron-LM fills it in (4h, or about 8h/3 with SwiGLU) when not given.
    pub ffn_hidden_size: Option<u64>,
    pub seq_length: u64,
    pub vocab_size: Option<u64>,
    /// The embedding's real size: the dump's `padded_vocab_size`, else the
    /// `padded vocab (... new size: N)` line.
    pub padded_vocab_size: Option<u64>,
    pub micro_batch_size: u64,
    pub global_batch_size: u64,
    pub tensor_model_parallel_size: u64,
    pub pipeline_model_parallel_size: u64,
    pub context_parallel_size: u64,
    pub data_parallel_size: u64,
    pub world_size: u64,
    /// Model chunks per pipeline rank (interleaved schedule), from
    /// `virtual_pipeline_model_parallel_size` or
    /// `num_layers_per_virtual_pipeline_stage`.
    pub virtual_pipeline_model_parallel_size: Option<u64>,
    pub num_layers_per_virtual_pipeline_stage: Option<u64>,
    /// `full`, `selective` or absent.
    pub recompute_granularity: Option<String>,
    /// `uniform`, `block` or absent.
    pub recompute_method: Option<String>,
    pub recompute_num_layers: Option<u64>,
    /// `--recompute-modules` as printed (`['core_attn']`, `['moe_act', 'layernorm']`).
    pub recompute_modules: Option<String>,
    pub sequence_parallel: bool,
    pub use_distributed_optimizer: bool,
    /// Megatron FSDP or PyTorch FSDP2 (weights, gradients and optimizer
    /// states sharded).
    pub fully_sharded: bool,
    pub position_embedding_type: Option<String>,
    /// The model's switches the run table has columns for, `None` where the
    /// dump does not print the argument: a gated MLP (`--swiglu`, or
    /// gpt-oss's `--quick-geglu`), the input embedding shared with the
    /// head (no `--untie-embeddings-and-output-weights`), biased linears
    /// (`add_bias_linear`, off with `--disable-bias-linear`), per-head
    /// query and key norms (`--qk-layernorm`), dropout (a positive
    /// `hidden_dropout` or `attention_dropout`), and the head width
    /// (`kv_channels`).
    pub switches: ModelSwitches,
    pub use_flash_attn: bool,
    /// `--attention-backend` as printed (`AttnBackend.flash`), without the enum name.
    pub attention_backend: Option<String>,
    pub transformer_impl: Option<String>,
    pub num_experts: Option<u64>,
    pub moe_router_topk: Option<u64>,
    pub moe_ffn_hidden_size: Option<u64>,
    pub moe_shared_expert_intermediate_size: Option<u64>,
    /// As printed: an int, or a per-layer list (`[0, 1, 1, ...]`).
    pub moe_layer_freq: Option<String>,
    pub moe_token_dispatcher_type: Option<String>,
    /// The flex dispatcher's kernels (`deepep`, `hybridep`; absent before
    /// Megatron-Core 0.15, whose flex ran DeepEP under `--moe-enable-deepep`).
    pub moe_flex_dispatcher_backend: Option<String>,
    /// DeepSeek-V3's group-limited routing: the expert groups and how many
    /// of them a token's experts may come from (0: unlimited).
    pub moe_router_num_groups: Option<u64>,
    pub moe_router_group_topk: Option<u64>,
    pub expert_model_parallel_size: u64,
    /// `None` means tp (Megatron-LM's default).
    pub expert_tensor_parallel_size: Option<u64>,
    /// `--cp-comm-type` as printed (`['p2p']`, one per layer or for all).
    pub cp_comm_type: Option<String>,
    /// `--fp8-format` (`hybrid`, `e4m3`) when FP8 is on.
    pub fp8: Option<String>,
    /// `--fp8-recipe` as printed (Megatron-LM prints its default,
    /// `delayed`, whether FP8 is on or not).
    pub fp8_recipe: Option<String>,
    /// `--fp4-format` (`e2m1`, printed as `fp4`) when NVFP4 is on.
    pub fp4: Option<String>,
    /// `--cuda-graph-impl` (`none`, `local`, `transformer_engine`,
    /// `full_iteration`), and `--cuda-graph-scope`, which named
    /// `full_iteration` before it became an implementation.
    pub cuda_graph_impl: Option<String>,
    pub cuda_graph_scope: Option<String>,
    /// `--grad-reduce-in-bf16`, or a bf16 run printing
    /// `accumulate_allreduce_grads_in_fp32 False` (what that flag sets).
    pub grad_reduce_in_bf16: bool,
    /// `--cross-entropy-loss-fusion` and `--cross-entropy-fusion-impl`.
    pub cross_entropy_fusion: crate::config::CrossEntropyFusion,
    /// `--defer-embedding-wgrad-compute` and `--wgrad-deferral-limit`.
    pub wgrad_deferral: crate::config::WgradDeferral,
    pub multi_latent_attention: bool,
    /// Whether the ranks had expandable segments, as paratune's launch
    /// script recorded in the log (`None` where it did not: Megatron-LM's
    /// own default, fixed segments, is assumed).
    pub expandable_segments: Option<bool>,
    /// Every argument of the dump as printed, for what the fields above leave out.
    pub all: BTreeMap<String, String>,
}

/// See [`MegatronConfig::switches`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelSwitches {
    pub gated_mlp: Option<bool>,
    pub tied_embeddings: Option<bool>,
    pub linear_bias: Option<bool>,
    pub qk_layernorm: Option<bool>,
    pub dropout: Option<bool>,
    pub kv_channels: Option<u64>,
}

/// One logged iteration line.
#[derive(Debug, Clone, PartialEq)]
pub struct IterationLine {
    /// 1-based line in the log.
    pub line: usize,
    pub iteration: u64,
    pub train_iters: u64,
    /// `elapsed time per iteration (ms)`: the mean over the iterations since
    /// the previous logged line. `None` when the field is missing or unreadable.
    pub elapsed_ms: Option<f64>,
    /// `throughput per GPU (TFLOP/s/GPU)`, with `--log-throughput`.
    pub tflops_per_gpu: Option<f64>,
    pub global_batch_size: Option<u64>,
    pub consumed_samples: Option<u64>,
    pub lm_loss: Option<f64>,
    pub skipped_iterations: Option<u64>,
    pub nan_iterations: Option<u64>,
}

/// One `report_memory` line.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryLine {
    pub line: usize,
    pub rank: u64,
    pub max_allocated_bytes: Option<f64>,
    pub max_reserved_bytes: Option<f64>,
}

/// A Megatron-LM run as its log tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct MegatronRun {
    pub config: MegatronConfig,
    /// Every iteration line, in log order, the first of each iteration
    /// number (`elapsed_ms` is `None` where the time is unreadable).
    pub iterations: Vec<IterationLine>,
    pub memory: Vec<MemoryLine>,
    /// Logged iterations left out as warm-up.
    pub warmup: usize,
    /// Iteration lines in the steady state (after warm-up, never iteration 1).
    pub steady_iterations: usize,
    /// Median and mean of `elapsed time per iteration (ms)` over the steady
    /// state. The median is the run's time (the `iter_ms` of its row): one
    /// stalled iteration (a checkpoint, a straggler, a garbled 1e30) moves
    /// the mean as far as it likes, the median not at all.
    pub steady_median_ms: f64,
    pub steady_mean_ms: f64,
    /// Median `throughput per GPU (TFLOP/s/GPU)` over the steady state, when logged.
    pub tflops_per_gpu: Option<f64>,
    /// The largest `max allocated` / `max reserved` over all memory lines and ranks.
    pub peak_allocated_bytes: Option<f64>,
    pub peak_reserved_bytes: Option<f64>,
    /// Sums of the `number of skipped iterations` / `number of nan iterations` fields.
    pub skipped_iterations: u64,
    pub nan_iterations: u64,
    /// Whether the argument dump was complete (its end line seen).
    pub arguments_complete: bool,
    /// The largest iteration logged and the run's `--train-iters`.
    pub last_iteration: u64,
    pub train_iters: u64,
    /// What was odd about the log but did not stop it being read (cut-off
    /// lines, unreadable fields, repeated iterations), one sentence each.
    pub notes: Vec<String>,
}

/// Reads and parses a log file; see [`parse`].
pub fn read(path: &Path, warmup: usize) -> Result<MegatronRun, MegatronLogError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| MegatronLogError::Read {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    // Logs of killed jobs can end inside a multi-byte character, and
    // progress bars of other tools write odd bytes; neither matters here.
    let text = String::from_utf8_lossy(&bytes);
    parse(&text, &shown, warmup)
}

/// Parses the text of a Megatron-LM log. `path` names the log in errors;
/// `warmup` logged iterations are left out of the steady state (and
/// iteration 1 always is).
pub fn parse(text: &str, path: &str, warmup: usize) -> Result<MegatronRun, MegatronLogError> {
    if text.trim().is_empty() {
        return Err(MegatronLogError::Empty { path: path.into() });
    }
    let scan = scan(text);
    if scan.state == DumpState::Before {
        return Err(MegatronLogError::NoArguments { path: path.into() });
    }
    let arguments_complete = matches!(scan.state, DumpState::After | DumpState::Second);
    let mut config = config_from_arguments(&scan.args, path, arguments_complete)?;
    let recorded = super::allocator::recorded_in_log(text);
    config.expandable_segments = recorded.as_ref().map(|r| r.expandable_segments);
    if config.padded_vocab_size.is_none() {
        config.padded_vocab_size = scan.padded_vocab;
    }
    let mut notes = scan.notes();
    notes.extend(recorded.and_then(|r| r.note));
    let steady = steady_state(&scan.iterations, &config, path, warmup)?;
    notes.extend(steady.note.clone());
    notes.extend(run_notes(&scan, &config));
    let peak =
        |of: fn(&MemoryLine) -> Option<f64>| scan.memory.iter().filter_map(of).reduce(f64::max);
    let iterations = scan.iterations;
    Ok(MegatronRun {
        config,
        skipped_iterations: iterations.iter().filter_map(|i| i.skipped_iterations).sum(),
        nan_iterations: iterations.iter().filter_map(|i| i.nan_iterations).sum(),
        steady_iterations: steady.count,
        last_iteration: iterations.iter().map(|i| i.iteration).max().unwrap_or(0),
        train_iters: iterations.iter().map(|i| i.train_iters).max().unwrap_or(0),
        iterations,
        peak_allocated_bytes: peak(|m| m.max_allocated_bytes),
        peak_reserved_bytes: peak(|m| m.max_reserved_bytes),
        memory: scan.memory,
        warmup,
        steady_mean_ms: steady.mean_ms,
        steady_median_ms: steady.median_ms,
        tflops_per_gpu: steady.tflops_per_gpu,
        arguments_complete,
        notes,
    })
}

/// What one pass over a log's lines found.
struct Scan {
    /// Each argument's value and line, the first of each name.
    args: BTreeMap<String, (String, usize)>,
    state: DumpState,
    /// The first iteration line of each iteration number, in log order.
    iterations: Vec<IterationLine>,
    memory: Vec<MemoryLine>,
    padded_vocab: Option<u64>,
    /// Lines that matter for the notes.
    second_dump: Option<usize>,
    unreadable_times: Vec<usize>,
    repeated: Vec<u64>,
    cut_off_last_line: bool,
}

/// Reads every line once: the argument dump, iteration and memory lines,
/// the padded vocabulary; stops at a second argument dump.
fn scan(text: &str) -> Scan {
    let mut scan = Scan {
        args: BTreeMap::new(),
        state: DumpState::Before,
        iterations: Vec::new(),
        memory: Vec::new(),
        padded_vocab: None,
        second_dump: None,
        unreadable_times: Vec::new(),
        repeated: Vec::new(),
        cut_off_last_line: false,
    };
    let mut seen_iterations: HashSet<u64> = HashSet::new();
    for (index, raw) in text.split_inclusive('\n').enumerate() {
        let number = index + 1;
        let complete = raw.ends_with('\n');
        let line = raw.trim_end_matches(['\n', '\r']);
        if line.contains(ARGS_BEGIN) {
            if scan.state == DumpState::Before {
                scan.state = DumpState::Inside;
                continue;
            }
            scan.second_dump = Some(number);
            scan.state = DumpState::Second;
            break;
        }
        if line.contains(ARGS_END) {
            if scan.state == DumpState::Inside {
                scan.state = DumpState::After;
            }
            continue;
        }
        if scan.state == DumpState::Inside {
            if let Some((name, value)) = argument_line(line)
                && complete
            {
                scan.args
                    .entry(name.to_string())
                    .or_insert((value.to_string(), number));
            }
            continue;
        }
        if let Some(parsed) = iteration_line(line, number) {
            let seen = !seen_iterations.insert(parsed.iteration);
            if !complete && parsed.elapsed_ms.is_none() {
                scan.cut_off_last_line = true;
            } else if seen {
                scan.repeated.push(parsed.iteration);
            } else if parsed.elapsed_ms.is_none() {
                scan.unreadable_times.push(number);
            }
            if !seen {
                scan.iterations.push(parsed);
            }
            continue;
        }
        if let Some(parsed) = memory_line(line, number, complete) {
            scan.memory.push(parsed);
            continue;
        }
        if let Some(size) = padded_vocab(line) {
            scan.padded_vocab.get_or_insert(size);
            continue;
        }
        if !complete && !line.trim().is_empty() {
            scan.cut_off_last_line = true;
        }
    }
    scan
}

impl Scan {
    /// What was odd about the lines, in the order the reader meets it.
    fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(number) = self.second_dump {
            notes.push(format!(
                "line {number} starts a second argument dump (a restarted run appended to the same log?); only the first run is read"
            ));
        }
        if self.state == DumpState::Inside {
            notes.push(
                "the argument dump has no end line (the log was cut inside it); the arguments before the cut are used".into(),
            );
        }
        if self.cut_off_last_line {
            notes.push("the last line is cut off (the run was killed?); it is left out".into());
        }
        if !self.unreadable_times.is_empty() {
            notes.push(format!(
                "{} iteration line(s) without a readable `{ELAPSED_KEY}` (line {}); left out of the steady state",
                self.unreadable_times.len(),
                list(&self.unreadable_times)
            ));
        }
        if !self.repeated.is_empty() {
            notes.push(format!(
                "iteration(s) {} logged more than once; the first line of each is used",
                list(&self.repeated)
            ));
        }
        notes
    }
}

/// The steady state's times: after `warmup` logged iterations, never
/// iteration 1.
struct Steady {
    count: usize,
    median_ms: f64,
    mean_ms: f64,
    tflops_per_gpu: Option<f64>,
    /// Outliers, which the median does not move.
    note: Option<String>,
}

fn steady_state(
    iterations: &[IterationLine],
    config: &MegatronConfig,
    path: &str,
    warmup: usize,
) -> Result<Steady, MegatronLogError> {
    if !iterations.iter().any(|i| i.elapsed_ms.is_some()) {
        let last_rank = config
            .world_size
            .checked_sub(1)
            .map_or("the last".to_string(), |r| r.to_string());
        return Err(MegatronLogError::NoIterations {
            path: path.into(),
            last_rank,
        });
    }
    let steady: Vec<&IterationLine> = iterations
        .iter()
        .skip(warmup)
        .filter(|i| i.iteration != 1 && i.elapsed_ms.is_some())
        .collect();
    if steady.is_empty() {
        return Err(MegatronLogError::NoSteadyIterations {
            path: path.into(),
            warmup,
            logged: iterations.len(),
        });
    }
    let times: Vec<f64> = steady.iter().filter_map(|i| i.elapsed_ms).collect();
    let median_ms = median(&times);
    let outliers = times
        .iter()
        .filter(|&&t| t > OUTLIER_FACTOR * median_ms)
        .count();
    let throughputs: Vec<f64> = steady.iter().filter_map(|i| i.tflops_per_gpu).collect();
    Ok(Steady {
        count: steady.len(),
        median_ms,
        mean_ms: times.iter().sum::<f64>() / times.len() as f64,
        tflops_per_gpu: (!throughputs.is_empty()).then(|| median(&throughputs)),
        note: (outliers > 0).then(|| format!(
            "{outliers} steady iteration(s) took more than {OUTLIER_FACTOR}x the median ({median_ms:.1} ms); the run's time is the median, which they do not move"
        )),
    })
}

/// What was odd about the run itself: a batch ramp-up, no memory lines,
/// a run cut short.
fn run_notes(scan: &Scan, config: &MegatronConfig) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(logged) = scan.iterations.iter().find_map(|i| i.global_batch_size)
        && logged != config.global_batch_size
    {
        notes.push(format!(
            "the iteration lines report a global batch size of {logged}, the arguments {} (batch-size ramp-up?); the arguments are used",
            config.global_batch_size
        ));
    }
    if scan.memory.is_empty() {
        notes.push(
            "no `[Rank N] (after K iterations) memory (MB) | ...` lines; the peak memory is unknown"
                .into(),
        );
    }
    let train_iters = scan
        .iterations
        .iter()
        .map(|i| i.train_iters)
        .max()
        .unwrap_or(0);
    let last_iteration = scan
        .iterations
        .iter()
        .map(|i| i.iteration)
        .max()
        .unwrap_or(0);
    if last_iteration < train_iters {
        notes.push(format!(
            "the log stops at iteration {last_iteration} of {train_iters} (the run was cut short?)"
        ));
    }
    notes
}

/// A steady iteration this many times the median is reported as an outlier.
const OUTLIER_FACTOR: f64 = 3.0;

/// The median of `values` (not empty).
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DumpState {
    Before,
    Inside,
    After,
    Second,
}

/// Up to five items, then how many more.
pub(crate) fn list<T: ToString>(items: &[T]) -> String {
    const SHOWN: usize = 5;
    let mut text: Vec<String> = items.iter().take(SHOWN).map(T::to_string).collect();
    if items.len() > SHOWN {
        text.push(format!("and {} more", items.len() - SHOWN));
    }
    text.join(", ")
}

/// `  name ........ value` (with whatever prefix the launcher added):
/// the name and the value as printed.
fn argument_line(line: &str) -> Option<(&str, &str)> {
    let dots = line.find(" .")?;
    let name = line[..dots].split_whitespace().last()?;
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return None;
    }
    let after = line[dots + 1..].trim_start_matches('.');
    // `dots = '.' * (48 - len(arg))`: a name and its dots fill 48 columns,
    // which tells an argument from other output with dots in it.
    let dot_count = line.len() - (dots + 1) - after.len();
    if name.len() + dot_count != ARG_COLUMNS {
        return None;
    }
    let value = after.strip_prefix(' ')?;
    Some((name, value.trim()))
}

/// Position just past `iteration <N>/ <M> |` in `line`, with N and M.
fn iteration_header(line: &str) -> Option<(usize, u64, u64)> {
    let mut from = 0;
    while let Some(found) = line[from..].find("iteration ") {
        let start = from + found;
        from = start + "iteration ".len();
        let rest = &line[from..];
        let rest_trimmed = rest.trim_start();
        let digits = rest_trimmed
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest_trimmed.len());
        if digits == 0 {
            continue;
        }
        let Ok(iteration) = rest_trimmed[..digits].parse::<u64>() else {
            continue;
        };
        let Some(after_slash) = rest_trimmed[digits..].strip_prefix('/') else {
            continue;
        };
        let total_text = after_slash.trim_start();
        let total_digits = total_text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(total_text.len());
        if total_digits == 0 {
            continue;
        }
        let Ok(total) = total_text[..total_digits].parse::<u64>() else {
            continue;
        };
        let Some(after_bar) = total_text[total_digits..].trim_start().strip_prefix('|') else {
            continue;
        };
        let end = line.len() - after_bar.len();
        return Some((end, iteration, total));
    }
    None
}

/// The `key: value` fields of an iteration line after its header. Every
/// field of `training_log` ends with ` |`, so only fields closed by a bar
/// are taken: a line cut off mid-number must not give a wrong number.
fn closed_fields(text: &str) -> Vec<(&str, &str)> {
    let mut pieces: Vec<&str> = text.split('|').collect();
    pieces.pop();
    pieces
        .into_iter()
        .filter_map(|piece| {
            let (key, value) = piece.split_once(": ")?;
            Some((key.trim(), value.trim()))
        })
        .collect()
}

fn iteration_line(line: &str, number: usize) -> Option<IterationLine> {
    let (end, iteration, train_iters) = iteration_header(line)?;
    let mut parsed = IterationLine {
        line: number,
        iteration,
        train_iters,
        elapsed_ms: None,
        tflops_per_gpu: None,
        global_batch_size: None,
        consumed_samples: None,
        lm_loss: None,
        skipped_iterations: None,
        nan_iterations: None,
    };
    for (key, value) in closed_fields(&line[end..]) {
        let real = || value.parse::<f64>().ok().filter(|v| v.is_finite());
        let whole = || value.parse::<u64>().ok();
        match key {
            ELAPSED_KEY => parsed.elapsed_ms = real().filter(|v| *v > 0.0),
            THROUGHPUT_KEY => parsed.tflops_per_gpu = real().filter(|v| *v >= 0.0),
            GLOBAL_BATCH_KEY => parsed.global_batch_size = whole(),
            CONSUMED_KEY => parsed.consumed_samples = whole(),
            LOSS_KEY => parsed.lm_loss = real(),
            SKIPPED_KEY => parsed.skipped_iterations = whole(),
            NAN_KEY => parsed.nan_iterations = whole(),
            _ => {}
        }
    }
    Some(parsed)
}

fn memory_line(line: &str, number: usize, complete: bool) -> Option<MemoryLine> {
    let start = line.find("[Rank ")?;
    let after = &line[start + "[Rank ".len()..];
    let close = after.find(']')?;
    let rank = after[..close].trim().parse::<u64>().ok()?;
    let rest = &after[close + 1..];
    let mark = rest.find(MEMORY_MARK)?;
    let mut parsed = MemoryLine {
        line: number,
        rank,
        max_allocated_bytes: None,
        max_reserved_bytes: None,
    };
    let body = &rest[mark + MEMORY_MARK.len()..];
    // `string += f" | allocated: ..."`: each field starts with a bar, so the
    // text after the last bar is a field, closed by the end of the line.
    let body = body.trim_start().strip_prefix('|').unwrap_or(body);
    let mut pieces: Vec<&str> = body.split('|').collect();
    if !complete {
        pieces.pop();
    }
    for piece in pieces {
        let Some((key, value)) = piece.split_once(": ") else {
            continue;
        };
        let megabytes = value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0);
        match key.trim() {
            "max allocated" => parsed.max_allocated_bytes = megabytes.map(|mb| mb * MEGABYTE),
            "max reserved" => parsed.max_reserved_bytes = megabytes.map(|mb| mb * MEGABYTE),
            _ => {}
        }
    }
    Some(parsed)
}

fn padded_vocab(line: &str) -> Option<u64> {
    let start = line.find(PADDED_VOCAB_MARK)?;
    let rest = &line[start..];
    let new = rest.find(NEW_SIZE_MARK)?;
    let digits = &rest[new + NEW_SIZE_MARK.len()..];
    let end = digits.find(')')?;
    digits[..end].trim().parse().ok()
}

/// The printed value of a Python `None`, `True` or `False`.
fn is_none(value: &str) -> bool {
    value == "None"
}

fn config_from_arguments(
    args: &BTreeMap<String, (String, usize)>,
    path: &str,
    complete: bool,
) -> Result<MegatronConfig, MegatronLogError> {
    let bad = |name: &str, expected: &'static str| {
        let (value, line) = &args[name];
        MegatronLogError::BadArgument {
            path: path.into(),
            line: *line,
            name: name.into(),
            value: value.clone(),
            expected,
        }
    };
    let text = |name: &str| -> Option<String> {
        args.get(name)
            .map(|(v, _)| v.clone())
            .filter(|v| !is_none(v))
    };
    let int = |name: &str| -> Result<Option<u64>, MegatronLogError> {
        match args.get(name) {
            None => Ok(None),
            Some((v, _)) if is_none(v) => Ok(None),
            Some((v, _)) => v
                .parse::<u64>()
                .map(Some)
                .map_err(|_| bad(name, "a whole number or None")),
        }
    };
    let flag = |name: &str| -> Result<bool, MegatronLogError> {
        match args.get(name).map(|(v, _)| v.as_str()) {
            None | Some("False") | Some("None") => Ok(false),
            Some("True") => Ok(true),
            Some(_) => Err(bad(name, "True or False")),
        }
    };

    // A switch the dump prints, `None` where it does not.
    let printed_flag = |name: &str| -> Result<Option<bool>, MegatronLogError> {
        match args.contains_key(name) {
            true => flag(name).map(Some),
            false => Ok(None),
        }
    };
    let positive = |name: &str| -> Result<Option<bool>, MegatronLogError> {
        match args.get(name) {
            None => Ok(None),
            Some((v, _)) if is_none(v) => Ok(None),
            Some((v, _)) => match v.parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => Ok(Some(p > 0.0)),
                _ => Err(bad(name, "a probability from 0 to 1")),
            },
        }
    };
    let switches = ModelSwitches {
        gated_mlp: match (printed_flag("swiglu")?, printed_flag("quick_geglu")?) {
            (None, None) => None,
            (swiglu, quick) => Some(swiglu.unwrap_or(false) || quick.unwrap_or(false)),
        },
        tied_embeddings: printed_flag("untie_embeddings_and_output_weights")?.map(|untie| !untie),
        linear_bias: printed_flag("add_bias_linear")?,
        qk_layernorm: printed_flag("qk_layernorm")?,
        dropout: match (positive("hidden_dropout")?, positive("attention_dropout")?) {
            (None, None) => None,
            (hidden, attention) => Some(hidden.unwrap_or(false) || attention.unwrap_or(false)),
        },
        kv_channels: int("kv_channels")?.filter(|&n| n > 0),
    };

    const REQUIRED: [&str; 8] = [
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "world_size",
    ];
    let mut values = BTreeMap::new();
    let mut missing = Vec::new();
    for name in REQUIRED {
        match int(name)? {
            Some(0) => return Err(bad(name, "at least 1")),
            Some(v) => {
                values.insert(name, v);
            }
            None => missing.push(name.to_string()),
        }
    }
    if !missing.is_empty() {
        return Err(MegatronLogError::MissingArguments {
            path: path.into(),
            names: missing,
            hint: if complete {
                "pretrain_gpt.py needs them all; is this a log of another script?"
            } else {
                "the log is cut inside the dump; give the whole log"
            },
        });
    }
    let tp = values["tensor_model_parallel_size"];
    let pp = values["pipeline_model_parallel_size"];
    let world_size = values["world_size"];
    let context_parallel_size = int("context_parallel_size")?.unwrap_or(1).max(1);
    let model_parallel = tp * pp * context_parallel_size;
    let data_parallel_size = match int("data_parallel_size")? {
        Some(dp) if dp >= 1 => dp,
        _ => {
            if !world_size.is_multiple_of(model_parallel) {
                return Err(MegatronLogError::Inconsistent {
                    path: path.into(),
                    message: format!(
                        "world_size {world_size} is not a multiple of tensor x pipeline x context parallel sizes {tp} x {pp} x {context_parallel_size}; is the dump from this run?"
                    ),
                });
            }
            (world_size / model_parallel).max(1)
        }
    };
    let inconsistent = |message: String| MegatronLogError::Inconsistent {
        path: path.into(),
        message,
    };
    if model_parallel.saturating_mul(data_parallel_size) != world_size {
        return Err(inconsistent(format!(
            "tensor x pipeline x context x data parallel sizes {tp} x {pp} x {context_parallel_size} x {data_parallel_size} make {} ranks, but world_size is {world_size}; is the dump from this run?",
            model_parallel.saturating_mul(data_parallel_size)
        )));
    }
    let micro_batch_size = values["micro_batch_size"];
    let global_batch_size = match int("global_batch_size")? {
        Some(0) => return Err(bad("global_batch_size", "at least 1")),
        Some(n) => n,
        None => micro_batch_size * data_parallel_size,
    };
    let per_step = micro_batch_size.saturating_mul(data_parallel_size);
    if !global_batch_size.is_multiple_of(per_step) {
        return Err(inconsistent(format!(
            "global_batch_size {global_batch_size} is not a multiple of micro_batch_size x data_parallel_size = {micro_batch_size} x {data_parallel_size}{}; is the dump from this run?",
            if micro_batch_size > global_batch_size {
                " (the micro-batch is larger than the global batch)"
            } else {
                ""
            }
        )));
    }
    let num_layers = values["num_layers"];
    let layers_per_chunk = int("num_layers_per_virtual_pipeline_stage")?;
    let chunks = match int("virtual_pipeline_model_parallel_size")? {
        Some(v) => Some(v),
        None => match layers_per_chunk {
            Some(0) => return Err(bad("num_layers_per_virtual_pipeline_stage", "at least 1")),
            Some(per) => Some(num_layers / (pp * per).max(1)),
            None => int("num_virtual_stages_per_pipeline_rank")?,
        },
    };
    let attention_backend = text("attention_backend").map(|v| {
        v.strip_prefix("AttnBackend.")
            .map(str::to_string)
            .unwrap_or(v)
    });
    Ok(MegatronConfig {
        num_layers,
        hidden_size: values["hidden_size"],
        num_attention_heads: values["num_attention_heads"],
        num_query_groups: int("num_query_groups")?,
        group_query_attention: flag("group_query_attention")?,
        ffn_hidden_size: int("ffn_hidden_size")?,
        seq_length: values["seq_length"],
        vocab_size: int("vocab_size")?,
        padded_vocab_size: int("padded_vocab_size")?,
        micro_batch_size,
        global_batch_size,
        tensor_model_parallel_size: tp,
        pipeline_model_parallel_size: pp,
        context_parallel_size,
        data_parallel_size,
        world_size,
        virtual_pipeline_model_parallel_size: chunks,
        num_layers_per_virtual_pipeline_stage: layers_per_chunk,
        recompute_granularity: text("recompute_granularity"),
        recompute_method: text("recompute_method"),
        recompute_num_layers: int("recompute_num_layers")?,
        recompute_modules: text("recompute_modules"),
        sequence_parallel: flag("sequence_parallel")?,
        use_distributed_optimizer: flag("use_distributed_optimizer")?,
        fully_sharded: flag("use_megatron_fsdp")? || flag("use_torch_fsdp2")?,
        position_embedding_type: text("position_embedding_type"),
        switches,
        use_flash_attn: flag("use_flash_attn")?,
        attention_backend,
        transformer_impl: text("transformer_impl"),
        num_experts: int("num_experts")?.filter(|&n| n > 0),
        moe_router_topk: int("moe_router_topk")?,
        moe_ffn_hidden_size: int("moe_ffn_hidden_size")?,
        moe_shared_expert_intermediate_size: int("moe_shared_expert_intermediate_size")?,
        moe_layer_freq: text("moe_layer_freq"),
        moe_token_dispatcher_type: text("moe_token_dispatcher_type"),
        moe_flex_dispatcher_backend: text("moe_flex_dispatcher_backend"),
        moe_router_num_groups: int("moe_router_num_groups")?,
        moe_router_group_topk: int("moe_router_group_topk")?,
        expert_model_parallel_size: int("expert_model_parallel_size")?.unwrap_or(1).max(1),
        expert_tensor_parallel_size: int("expert_tensor_parallel_size")?,
        cp_comm_type: text("cp_comm_type"),
        fp8: text("fp8"),
        fp8_recipe: text("fp8_recipe"),
        fp4: text("fp4"),
        cuda_graph_impl: text("cuda_graph_impl"),
        cuda_graph_scope: text("cuda_graph_scope"),
        grad_reduce_in_bf16: flag("grad_reduce_in_bf16")?
            || (flag("bf16")?
                && args
                    .get("accumulate_allreduce_grads_in_fp32")
                    .is_some_and(|(v, _)| v == "False")),
        cross_entropy_fusion: match (
            flag("cross_entropy_loss_fusion")?,
            text("cross_entropy_fusion_impl").as_deref(),
        ) {
            (false, _) => crate::config::CrossEntropyFusion::Off,
            (true, Some("te")) => crate::config::CrossEntropyFusion::Te,
            (true, _) => crate::config::CrossEntropyFusion::Native,
        },
        wgrad_deferral: match (
            flag("defer_embedding_wgrad_compute")?,
            int("wgrad_deferral_limit")?,
        ) {
            (false, _) => crate::config::WgradDeferral::Off,
            (true, None | Some(0)) => crate::config::WgradDeferral::All,
            (true, Some(n)) => crate::config::WgradDeferral::Limit(n),
        },
        multi_latent_attention: flag("multi_latent_attention")?,
        expandable_segments: None,
        all: args
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect(),
    })
}

impl MegatronConfig {
    /// Key/value heads: `num_query_groups` with `--group-query-attention`,
    /// else one per attention head.
    pub fn kv_heads(&self) -> u64 {
        match (self.group_query_attention, self.num_query_groups) {
            (true, Some(groups)) => groups,
            _ => self.num_attention_heads,
        }
    }

    /// The vocabulary the model was built with (padded when known).
    pub fn vocab(&self) -> Option<u64> {
        self.padded_vocab_size.or(self.vocab_size)
    }

    /// Model chunks per pipeline rank; 1 without interleaving.
    pub fn virtual_stages(&self) -> u64 {
        self.virtual_pipeline_model_parallel_size
            .unwrap_or(1)
            .max(1)
    }

    /// The modules selective recomputation redoes: the printed list's
    /// names (Megatron-LM's default, the attention core, when absent or
    /// unreadable, or under another policy).
    pub fn recompute_modules(&self) -> crate::config::RecomputeModules {
        match (self.recompute(), self.recompute_modules.as_deref()) {
            (Recompute::Selective, Some(printed)) => printed_modules(printed).unwrap_or_default(),
            _ => crate::config::RecomputeModules::default(),
        }
    }

    pub fn recompute(&self) -> Recompute {
        match self.recompute_granularity.as_deref() {
            Some("full") => Recompute::Full,
            Some("selective") => Recompute::Selective,
            _ => Recompute::None,
        }
    }

    /// The attention kernel in paratune's terms. `flash`, `fused` (cuDNN)
    /// and `auto` (Transformer Engine picks flash or fused) keep no `s^2`
    /// scores; `unfused` and `local` do. Without `--attention-backend`
    /// (releases before core_r0.10), `--use-flash-attn` or the Transformer
    /// Engine implementation mean a fused kernel.
    pub fn attention(&self) -> AttentionKind {
        match self.attention_backend.as_deref() {
            Some("flash" | "fused" | "auto") => AttentionKind::Flash,
            Some(_) => AttentionKind::Standard,
            None if self.use_flash_attn => AttentionKind::Flash,
            None if self.transformer_impl.as_deref() == Some("transformer_engine") => {
                AttentionKind::Flash
            }
            None => AttentionKind::Standard,
        }
    }

    /// The parallel configuration in paratune's terms. Megatron-LM ignores
    /// sequence parallelism without tensor parallelism, and its distributed
    /// optimizer shards nothing on one data-parallel rank; both are off then.
    /// The flex dispatcher's backend as printed: `deepep` where the log
    /// predates `--moe-flex-dispatcher-backend` (flex was DeepEP then).
    /// The FP8 recipe the run printed, Megatron-LM's `delayed` if none
    /// (older releases have no `--fp8-recipe`), `None` if paratune has no
    /// such recipe (refused in `check`).
    fn recipe(&self) -> Option<crate::config::Fp8Recipe> {
        use crate::choice::Choice;
        crate::config::Fp8Recipe::parse(
            "fp8_recipe",
            self.fp8_recipe.as_deref().unwrap_or("delayed"),
        )
        .ok()
    }

    fn flex_backend(&self) -> &str {
        self.moe_flex_dispatcher_backend
            .as_deref()
            .unwrap_or("deepep")
    }

    pub fn parallel_config(&self) -> ParallelConfig {
        let v = self.virtual_stages();
        let dp = self.data_parallel_size;
        ParallelConfig {
            tp: self.tensor_model_parallel_size,
            pp: self.pipeline_model_parallel_size,
            dp,
            micro_batch: self.micro_batch_size,
            schedule: if v > 1 {
                ScheduleKind::Interleaved
            } else {
                ScheduleKind::OneFOneB
            },
            virtual_stages: v,
            recompute: self.recompute(),
            recompute_modules: self.recompute_modules(),
            sequence_parallel: self.sequence_parallel && self.tensor_model_parallel_size > 1,
            optimizer_sharding: if dp < 2 {
                OptimizerSharding::None
            } else if self.fully_sharded {
                OptimizerSharding::Full
            } else if self.use_distributed_optimizer {
                OptimizerSharding::OptimizerStates
            } else {
                OptimizerSharding::None
            },
            bpipe: false,
            attention: self.attention(),
            cp: self.context_parallel_size,
            cp_comm: match self.cp_comm_names().as_slice() {
                ["a2a"] => crate::config::CpComm::A2a,
                ["allgather"] => crate::config::CpComm::AllGather,
                _ => crate::config::CpComm::P2p,
            },
            ep: self.expert_model_parallel_size,
            etp: match (self.num_experts, self.expert_tensor_parallel_size) {
                (Some(_), Some(etp)) => etp,
                (experts, _) => {
                    ParallelConfig::default_etp(experts.is_some(), self.tensor_model_parallel_size)
                }
            },
            // A dense run dispatches nothing: whatever the log says, it
            // holds the default, as every dense configuration does.
            dispatcher: match (self.num_experts, self.moe_token_dispatcher_type.as_deref()) {
                (Some(_), Some("alltoall")) => crate::config::Dispatcher::AllToAll,
                (Some(_), Some("allgather")) => crate::config::Dispatcher::AllGather,
                (Some(_), Some("flex")) if self.flex_backend() == "hybridep" => {
                    crate::config::Dispatcher::HybridEp
                }
                (Some(_), Some("flex")) => crate::config::Dispatcher::Flex,
                _ => crate::config::Dispatcher::default(),
            },
            precision: if self.fp4.is_some() {
                crate::config::Precision::Nvfp4
            } else if self.fp8.is_some() {
                crate::config::Precision::Fp8
            } else {
                crate::config::Precision::Bf16
            },
            fp8_recipe: self
                .fp8
                .as_ref()
                .filter(|_| self.fp4.is_none())
                .and_then(|_| self.recipe()),
            grad_reduce: if self.grad_reduce_in_bf16 {
                crate::config::GradReduce::Bf16
            } else {
                crate::config::GradReduce::Fp32
            },
            cross_entropy_fusion: self.cross_entropy_fusion,
            wgrad_deferral: self.wgrad_deferral,
            cuda_graphs: self.cuda_graphs(),
            expandable_segments: self
                .expandable_segments
                .unwrap_or(crate::config::Engine::Megatron.launches_expandable_segments()),
            ..ParallelConfig::default()
        }
    }

    /// What the run's CUDA graphs captured: the whole iteration
    /// (`full_iteration` as the implementation, or as the scope in older
    /// logs), each layer (`local` or `transformer_engine`), or nothing.
    pub fn cuda_graphs(&self) -> crate::config::CudaGraphs {
        use crate::config::CudaGraphs;
        let whole = |v: &Option<String>| v.as_deref().is_some_and(|v| v.contains("full_iteration"));
        if whole(&self.cuda_graph_impl) || whole(&self.cuda_graph_scope) {
            return CudaGraphs::FullIteration;
        }
        match self.cuda_graph_impl.as_deref() {
            Some("local" | "transformer_engine") => CudaGraphs::Layers,
            _ => CudaGraphs::Off,
        }
    }

    /// The distinct `--cp-comm-type` values the run used (`p2p` unless given).
    pub fn cp_comm_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .cp_comm_type
            .as_deref()
            .unwrap_or("p2p")
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '+'))
            .filter(|w| !w.is_empty())
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// `tp2 pp2 dp2 mb1 gb16 L24 h1024 a16 s1024 8 GPUs` and the switches that are on.
    pub fn summary(&self) -> String {
        let c = self.parallel_config();
        let mut text = format!(
            "tp{} pp{} dp{} mb{} gb{}",
            c.tp, c.pp, c.dp, c.micro_batch, self.global_batch_size
        );
        if c.virtual_stages > 1 {
            text.push_str(&format!(" v{}", c.virtual_stages));
        }
        if c.recompute != Recompute::None {
            text.push_str(&format!(" recompute={}", c.recompute.name()));
        }
        if c.sequence_parallel {
            text.push_str(" sp");
        }
        if c.optimizer_sharding != OptimizerSharding::None {
            text.push_str(&format!(" shard={}", c.optimizer_sharding.name()));
        }
        text.push_str(&format!(
            ", L{} h{} a{} s{}, {} GPUs",
            self.num_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.seq_length,
            self.world_size
        ));
        text
    }
}

/// [`ROW_COLUMNS_V2`] before `cuda_graphs`: a validation history of such
/// rows is rewritten with the column (empty, read as off) on opening.
pub const ROW_COLUMNS_V1: [&str; 48] = without(&ROW_COLUMNS_V2, CUDA_GRAPHS_COLUMN_AT_V2);

/// Where `cuda_graphs` sat in [`ROW_COLUMNS_V2`], after `wgrad_deferral`.
const CUDA_GRAPHS_COLUMN_AT_V2: usize = 10;

/// [`ROW_COLUMNS_V3`] before the model's switches (`gated_mlp` to
/// `qk_layernorm`, `dropout`, `position_embedding`, `head_dim`): a
/// history of such rows gains them empty (the plan's model) on opening.
pub const ROW_COLUMNS_V2: [&str; 49] = without::<53, 49>(
    &without::<54, 53>(
        &without::<55, 54>(
            &without::<56, 55>(&ROW_COLUMNS_V3, HEAD_DIM_AT),
            POSITIONS_AT,
        ),
        DROPOUT_AT,
    ),
    SWITCHES_AT,
);

/// [`ROW_COLUMNS`] before `expandable_segments`, which the log gained when
/// the launch scripts started to record the allocator.
pub const ROW_COLUMNS_V3: [&str; 56] = without(&ROW_COLUMNS, ALLOCATOR_AT);

/// Where `expandable_segments` sits in [`ROW_COLUMNS`], after the switches.
const ALLOCATOR_AT: usize = 11;

/// Where the model's switches sit in [`ROW_COLUMNS_V3`]: four after
/// `ffn_hidden`, and one each after `iter_ms`, `memory_rank` and
/// `moe_router_group_topk`, as in the run table's order.
const SWITCHES_AT: usize = 7;
const DROPOUT_AT: usize = 29;
const POSITIONS_AT: usize = 33;
const HEAD_DIM_AT: usize = 46;

/// The columns of the run-table row [`MegatronRun::row`] gives: paratune's
/// run-table schema (see `runs::KNOWN_COLUMNS`), then measurements the
/// schema does not read, carried through as the user's own columns.
pub const ROW_COLUMNS: [&str; 57] = [
    "gpus",
    "global_batch",
    "micro_batch",
    "hidden",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "gated_mlp",
    "tied_embeddings",
    "linear_bias",
    "qk_layernorm",
    "expandable_segments",
    "grad_reduce",
    "cross_entropy_fusion",
    "wgrad_deferral",
    "cuda_graphs",
    "layers",
    "seq_len",
    "vocab",
    "tp",
    "dp",
    "pp",
    "recompute",
    "sequence_parallel",
    "schedule",
    "virtual_stages",
    "bpipe",
    "attention",
    "optimizer_sharding",
    "iter_ms",
    "dropout",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "memory_rank",
    "position_embedding",
    "cp",
    "cp_comm",
    "ep",
    "etp",
    "num_experts",
    "moe_topk",
    "moe_ffn_hidden",
    "moe_shared_ffn_hidden",
    "moe_layer_freq",
    "moe_dispatcher",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "head_dim",
    "precision",
    "fp8_recipe",
    "recompute_modules",
    "iter_ms_mean",
    "tflops_per_gpu_measured",
    "steady_iterations",
    "skipped_iterations",
    "nan_iterations",
    "source_log",
];

/// `--recompute-modules` as the argument dump prints a list
/// (`['moe_act', 'layernorm']`).
fn printed_modules(printed: &str) -> Result<crate::config::RecomputeModules, String> {
    crate::config::RecomputeModules::parse(
        "recompute_modules",
        &printed.replace(['[', ']', '\'', '"'], " "),
    )
}

/// A count's cell, empty when absent.
fn optional_count(n: Option<u64>) -> String {
    n.map(|n| n.to_string()).unwrap_or_default()
}

impl MegatronRun {
    /// Peak `max allocated` in GiB, when the log has memory lines.
    pub fn peak_allocated_gib(&self) -> Option<f64> {
        self.peak_allocated_bytes.map(|b| b / GIB)
    }

    pub fn peak_reserved_gib(&self) -> Option<f64> {
        self.peak_reserved_bytes.map(|b| b / GIB)
    }

    /// This run as a row of [`ROW_COLUMNS`], `source` in the last column.
    /// Refuses what the run table cannot describe (context parallelism,
    /// mixture of experts) and a run whose vocabulary the log does not give.
    pub fn row(&self, path: &str, source: &str) -> Result<Vec<String>, MegatronLogError> {
        let m = &self.config;
        let unsupported = |feature: String, hint: &'static str| MegatronLogError::Unsupported {
            path: path.into(),
            feature,
            hint,
        };
        if m.context_parallel_size > 1
            && !matches!(
                m.cp_comm_names().as_slice(),
                ["p2p"] | ["a2a"] | ["allgather"]
            )
        {
            return Err(unsupported(
                format!(
                    "context parallelism by {}",
                    m.cp_comm_type.clone().unwrap_or_default()
                ),
                "log ingestion reads one key/value exchange for all layers (p2p, a2a or allgather; not yet a2a+p2p's hierarchical sizes); measure with one --cp-comm-type",
            ));
        }
        if m.all
            .get("mtp_num_layers")
            .is_some_and(|v| !matches!(v.trim(), "None" | "0" | ""))
        {
            return Err(unsupported(
                "multi-token prediction".into(),
                "log ingestion reads no prediction modules yet; write the run as a CSV row with its mtp_num_layers column",
            ));
        }
        if m.multi_latent_attention {
            return Err(unsupported(
                "multi-latent attention".into(),
                "log ingestion reads standard attention yet; write the run as a CSV row with its kv_lora_rank, q_lora_rank and head-width columns",
            ));
        }
        if m.fp8.is_some() && m.recipe().is_none() {
            return Err(unsupported(
                format!(
                    "the `{}` FP8 recipe",
                    m.fp8_recipe.as_deref().unwrap_or_default()
                ),
                "paratune prices the tensorwise, delayed, mxfp8 and blockwise recipes; measure with one of them",
            ));
        }
        if let Some(format) = &m.fp4 {
            let recipe = m
                .all
                .get("fp4_recipe")
                .map(|v| v.trim())
                .filter(|v| *v != "None");
            if format != "e2m1" || recipe.is_some_and(|r| r != "nvfp4") {
                return Err(unsupported(
                    format!(
                        "FP4 training as `--fp4-format {format}` with the `{}` recipe",
                        recipe.unwrap_or("default")
                    ),
                    "paratune prices NVFP4 (--fp4-format e2m1 --fp4-recipe nvfp4); measure with it",
                ));
            }
        }
        if let Some(positions) = &m.position_embedding_type
            && !crate::runs::POSITION_EMBEDDINGS.contains(&positions.as_str())
        {
            return Err(unsupported(
                format!("`{positions}` position embeddings"),
                "paratune reads learned_absolute, rope, yarn, mrope and none positions; measure with one of them",
            ));
        }
        if m.num_experts.is_some() {
            let dispatcher = m
                .moe_token_dispatcher_type
                .as_deref()
                .unwrap_or(crate::config::Dispatcher::default().name());
            let known = match dispatcher {
                "alltoall" | "allgather" => true,
                "flex" => matches!(m.flex_backend(), "deepep" | "hybridep"),
                _ => false,
            };
            if !known {
                return Err(unsupported(
                    if dispatcher == "flex" {
                        format!("the flex token dispatcher's `{}` backend", m.flex_backend())
                    } else {
                        format!("the `{dispatcher}` token dispatcher")
                    },
                    "log ingestion reads the alltoall and allgather dispatchers and flex with DeepEP or HybridEP; measure with one of them",
                ));
            }
            if m.moe_layer_freq
                .as_deref()
                .is_some_and(|f| f.parse::<u64>().is_err())
            {
                return Err(unsupported(
                    "a per-layer MoE pattern (--moe-layer-freq as a list)".into(),
                    "log ingestion reads every-n-th MoE layers yet; write the run as a CSV row with its moe_dense_layers and moe_layer_freq columns",
                ));
            }
        }
        if m.recompute() == Recompute::Selective
            && let Some(printed) = &m.recompute_modules
            && printed_modules(printed).is_err()
        {
            return Err(unsupported(
                format!("recomputation of the modules {printed}"),
                "paratune models core_attn, layernorm, moe_act, mlp, moe, shared_experts and mla_up_proj; measure with those",
            ));
        }
        let vocab = m.vocab().ok_or_else(|| MegatronLogError::MissingArguments {
            path: path.into(),
            names: vec!["padded_vocab_size".into(), "vocab_size".into()],
            hint: "and the log has no `padded vocab (... new size: N)` line; give the log from its first line",
        })?;
        let ffn = m.ffn_hidden_size.unwrap_or(4 * m.hidden_size);
        let c = m.parallel_config();
        let sw = m.switches;
        let switch = |value: Option<bool>| {
            value
                .map(|on| crate::config::on_off(on).to_string())
                .unwrap_or_default()
        };
        let optional =
            |v: Option<f64>, digits: usize| v.map(|v| format!("{v:.digits$}")).unwrap_or_default();
        Ok(vec![
            m.world_size.to_string(),
            m.global_batch_size.to_string(),
            c.micro_batch.to_string(),
            m.hidden_size.to_string(),
            m.num_attention_heads.to_string(),
            m.kv_heads().to_string(),
            ffn.to_string(),
            switch(sw.gated_mlp),
            switch(sw.tied_embeddings),
            switch(sw.linear_bias),
            switch(sw.qk_layernorm),
            switch(m.expandable_segments),
            c.grad_reduce.name().to_string(),
            c.cross_entropy_fusion.name().to_string(),
            c.wgrad_deferral.name(),
            c.cuda_graphs.name().to_string(),
            m.num_layers.to_string(),
            m.seq_length.to_string(),
            vocab.to_string(),
            c.tp.to_string(),
            c.dp.to_string(),
            c.pp.to_string(),
            c.recompute.name().to_string(),
            crate::config::on_off(c.sequence_parallel).to_string(),
            c.schedule.name().to_string(),
            c.virtual_stages.to_string(),
            crate::config::on_off(c.bpipe).to_string(),
            c.attention.name().to_string(),
            c.optimizer_sharding.name().to_string(),
            format!("{:.3}", self.steady_median_ms),
            switch(sw.dropout),
            optional(self.peak_allocated_gib(), 4),
            optional(self.peak_reserved_gib(), 4),
            // The largest over the ranks that report (data-parallel rank 0 of
            // every model-parallel group).
            if self.peak_allocated_bytes.is_some() {
                "max".into()
            } else {
                String::new()
            },
            m.position_embedding_type.clone().unwrap_or_default(),
            c.cp.to_string(),
            c.cp_comm.name().to_string(),
            c.ep.to_string(),
            c.etp.to_string(),
            optional_count(m.num_experts),
            optional_count(m.num_experts.and(Some(m.moe_router_topk.unwrap_or(2)))),
            optional_count(
                m.num_experts
                    .and(m.moe_ffn_hidden_size.or(m.ffn_hidden_size)),
            ),
            optional_count(m.num_experts.and(m.moe_shared_expert_intermediate_size)),
            optional_count(
                m.num_experts
                    .and(m.moe_layer_freq.as_deref().and_then(|f| f.parse().ok())),
            ),
            if m.num_experts.is_some() {
                c.dispatcher.name().to_string()
            } else {
                String::new()
            },
            optional_count(
                m.num_experts
                    .and(m.moe_router_num_groups)
                    .filter(|&n| n > 0),
            ),
            optional_count(
                m.num_experts
                    .and(m.moe_router_num_groups)
                    .filter(|&n| n > 0)
                    .and(m.moe_router_group_topk),
            ),
            // The head width as the run had it, hidden / heads or not
            // (Qwen3's 128 at hidden 2048 and 32 heads): a model given
            // beside the table cannot widen the run's heads.
            optional_count(sw.kv_channels),
            c.precision.name().to_string(),
            c.fp8_recipe.map_or("", |r| r.name()).to_string(),
            c.recompute_modules.names().join(","),
            format!("{:.3}", self.steady_mean_ms),
            optional(self.tflops_per_gpu, 2),
            self.steady_iterations.to_string(),
            self.skipped_iterations.to_string(),
            self.nan_iterations.to_string(),
            source.to_string(),
        ])
    }
}

#[cfg(test)]
mod tests {

    /// A dump of Qwen3's layer at hidden 1024 and 16 heads: SwiGLU,
    /// untied, no biases, QK norms, no dropout, heads of 128, and the
    /// given positions.
    fn qwen_like(positions: &str) -> [(&'static str, &str); 8] {
        [
            ("swiglu", "True"),
            ("untie_embeddings_and_output_weights", "True"),
            ("add_bias_linear", "False"),
            ("qk_layernorm", "True"),
            ("hidden_dropout", "0.0"),
            ("attention_dropout", "0.0"),
            ("position_embedding_type", positions),
            ("kv_channels", "128"),
        ]
    }

    /// The model's switch columns, in the row's order.
    const SWITCH_COLUMNS: [&str; 7] = [
        "gated_mlp",
        "tied_embeddings",
        "linear_bias",
        "qk_layernorm",
        "dropout",
        "position_embedding",
        "head_dim",
    ];

    #[test]
    fn row_columns_follow_the_run_table_schema() {
        crate::runs::assert_row_columns_follow_the_schema(&ROW_COLUMNS);
        assert_eq!(ROW_COLUMNS_V2[CUDA_GRAPHS_COLUMN_AT_V2], "cuda_graphs");
        assert!(!ROW_COLUMNS_V1.contains(&"cuda_graphs"));
        assert_eq!(ROW_COLUMNS_V1.len() + 1, ROW_COLUMNS_V2.len());
        let added: Vec<&str> = ROW_COLUMNS_V3
            .iter()
            .copied()
            .filter(|c| !ROW_COLUMNS_V2.contains(c))
            .collect();
        assert_eq!(added, SWITCH_COLUMNS);
        assert!(ROW_COLUMNS_V2.iter().all(|c| ROW_COLUMNS_V3.contains(c)));
        assert_eq!(ROW_COLUMNS[ALLOCATOR_AT], "expandable_segments");
        assert!(!ROW_COLUMNS_V3.contains(&"expandable_segments"));
    }

    /// A validation history written with `older` columns, the row's cells
    /// under them.
    fn history_of(older: &[&str], run: &MegatronRun) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runs-history.csv");
        let row = run.row("r.log", "r.log").unwrap();
        let cell = |column: &&str| {
            let at = ROW_COLUMNS.iter().position(|c| c == column).unwrap();
            row[at].clone()
        };
        let old: Vec<String> = older.iter().map(cell).collect();
        std::fs::write(&path, format!("{}\n{}\n", older.join(","), old.join(","))).unwrap();
        (dir, path)
    }

    fn upgraded(path: &std::path::Path) -> RunTable {
        let (_, _, upgraded) = crate::runs::RunHistory::open_upgrading(
            path,
            &ROW_COLUMNS,
            &[&ROW_COLUMNS_V1, &ROW_COLUMNS_V2, &ROW_COLUMNS_V3],
        )
        .unwrap();
        assert!(upgraded);
        let table = RunTable::read(path).unwrap();
        assert_eq!(table.headers, ROW_COLUMNS.map(String::from).to_vec());
        table
    }

    /// A validation history written before the `cuda_graphs` column is
    /// rewritten with it, empty (off), and its rows read back as before.
    #[test]
    fn a_history_without_the_graphs_column_gains_it() {
        let run = parse(&log(&[], &[900.0, 300.0, 200.0]), "r.log", 2).unwrap();
        let (_dir, path) = history_of(&ROW_COLUMNS_V1, &run);
        let table = upgraded(&path);
        assert_eq!(table.cell(0, "cuda_graphs"), None);
        assert_eq!(table.cell(0, "tp"), Some("2"));
    }

    /// A history written before the model's switch columns gains them
    /// empty: its rows keep the plan's model.
    #[test]
    fn a_history_without_the_model_switches_gains_them_empty() {
        let run = parse(
            &log(
                &[("swiglu", "True"), ("kv_channels", "128")],
                &[900.0, 300.0, 200.0],
            ),
            "r.log",
            2,
        )
        .unwrap();
        let (_dir, path) = history_of(&ROW_COLUMNS_V2, &run);
        let table = upgraded(&path);
        for column in ["gated_mlp", "head_dim", "position_embedding", "dropout"] {
            assert_eq!(table.cell(0, column), None, "{column}");
        }
        assert_eq!(table.cell(0, "cuda_graphs"), Some("off"));
    }

    /// What the dump says of the model reaches the row, so a run of a
    /// model paratune does not know is priced as the model it ran; what
    /// the dump leaves out stays empty (the defaults' model).
    #[test]
    fn the_model_switches_come_from_the_dump() {
        let cells = |extra: &[(&str, &str)]| {
            let run = parse(&log(extra, &[900.0, 300.0, 200.0]), "s.log", 2).unwrap();
            let row = run.row("s.log", "s.log").unwrap();
            let cell =
                |name: &str| row[ROW_COLUMNS.iter().position(|c| *c == name).unwrap()].clone();
            SWITCH_COLUMNS.map(cell)
        };
        assert_eq!(cells(&[]), ["", "", "", "", "", "", ""].map(String::from));
        let qwen = qwen_like("rope");
        assert_eq!(
            cells(&qwen),
            ["on", "off", "off", "on", "off", "rope", "128"].map(String::from)
        );
        // GPT's: GeLU, tied, biased, dropout 0.1, learned positions, and a
        // head width of hidden / heads, written all the same.
        let gpt = [
            ("swiglu", "False"),
            ("untie_embeddings_and_output_weights", "False"),
            ("add_bias_linear", "True"),
            ("qk_layernorm", "False"),
            ("hidden_dropout", "0.1"),
            ("attention_dropout", "0.1"),
            ("position_embedding_type", "learned_absolute"),
            ("kv_channels", "64"),
        ];
        assert_eq!(
            cells(&gpt),
            ["off", "on", "on", "off", "on", "learned_absolute", "64"].map(String::from)
        );
        // gpt-oss's quick-GeGLU is a gated MLP too.
        assert_eq!(
            cells(&[("swiglu", "False"), ("quick_geglu", "True")])[0],
            "on"
        );
        let e = parse(
            &log(&[("hidden_dropout", "1.5")], &[900.0, 300.0]),
            "d.log",
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("hidden_dropout"), "{e}");
        // Positions paratune cannot price are refused by name, not written
        // for the table's reader to reject later.
        let run = parse(
            &log(
                &[("position_embedding_type", "relative")],
                &[900.0, 300.0, 200.0],
            ),
            "r.log",
            2,
        )
        .unwrap();
        let e = run.row("r.log", "r.log").unwrap_err().to_string();
        assert!(e.contains("`relative` position embeddings"), "{e}");
    }

    /// A row read back prices the model the dump describes over the
    /// defaults' model: the switches override it.
    #[test]
    fn an_ingested_row_reads_back_as_the_model_that_ran() {
        let read_back = |positions: &str| {
            let extra = qwen_like(positions);
            let run = parse(&log(&extra, &[900.0, 300.0, 200.0]), "q.log", 2).unwrap();
            let row = run.row("q.log", "q.log").unwrap();
            let mut buffer = Vec::new();
            let headers: Vec<String> = ROW_COLUMNS.iter().map(|s| s.to_string()).collect();
            write_csv(&mut buffer, &headers, &[row]).unwrap();
            let table = RunTable::parse(std::str::from_utf8(&buffer).unwrap(), "q.csv").unwrap();
            let defaults = RowDefaults::gpt(1000, 128, AttentionKind::Flash, Recompute::None);
            assert!(defaults.model.linear_bias && defaults.model.learned_positions);
            let runs = runs_from_table(&table, &defaults, crate::runs::BaseNode::DGX_A100).unwrap();
            runs[0].model.clone()
        };
        let model = read_back("rope");
        assert!(model.gated_mlp && !model.tied_embeddings && !model.linear_bias);
        assert!(model.qk_layernorm && !model.dropout && !model.learned_positions);
        assert!(!model.no_positions);
        assert_eq!(model.attention_head_width(), 128.0);
        // Megatron-LM's `none` (NoPE): neither learned nor rotary.
        let nope = read_back("none");
        assert!(nope.no_positions && !nope.learned_positions);
    }

    /// The graphs a run captured, as the implementation (and, in older
    /// logs, the scope) names them.
    #[test]
    fn cuda_graphs_are_read_from_the_implementation_and_the_old_scope() {
        use crate::config::CudaGraphs;
        let graphs = |extra: &[(&str, &str)]| {
            parse(&log(extra, &[900.0, 300.0, 200.0]), "g.log", 2)
                .unwrap()
                .config
                .cuda_graphs()
        };
        assert_eq!(graphs(&[]), CudaGraphs::Off);
        assert_eq!(graphs(&[("cuda_graph_impl", "none")]), CudaGraphs::Off);
        assert_eq!(graphs(&[("cuda_graph_impl", "local")]), CudaGraphs::Layers);
        assert_eq!(
            graphs(&[("cuda_graph_impl", "transformer_engine")]),
            CudaGraphs::Layers
        );
        assert_eq!(
            graphs(&[("cuda_graph_impl", "full_iteration")]),
            CudaGraphs::FullIteration
        );
        assert_eq!(
            graphs(&[
                ("cuda_graph_impl", "local"),
                ("cuda_graph_scope", "['full_iteration']")
            ]),
            CudaGraphs::FullIteration
        );
    }
    use super::*;
    use crate::model::ModelSpec;
    use crate::runs::{RowDefaults, RunTable, runs_from_table, write_csv};

    fn dump(args: &[(&str, &str)]) -> String {
        let mut lines: Vec<String> = args
            .iter()
            .map(|(name, value)| format!("  {name} {} {value}", ".".repeat(48 - name.len())))
            .collect();
        lines.sort_by_key(|l| l.to_lowercase());
        format!("{ARGS_BEGIN}\n{}\n{ARGS_END}\n", lines.join("\n"))
    }

    const BASE: [(&str, &str); 16] = [
        ("num_layers", "24"),
        ("hidden_size", "1024"),
        ("num_attention_heads", "16"),
        ("ffn_hidden_size", "4096"),
        ("seq_length", "1024"),
        ("padded_vocab_size", "None"),
        ("vocab_size", "50257"),
        ("micro_batch_size", "2"),
        ("global_batch_size", "16"),
        ("tensor_model_parallel_size", "2"),
        ("pipeline_model_parallel_size", "2"),
        ("data_parallel_size", "2"),
        ("world_size", "8"),
        ("recompute_granularity", "None"),
        ("attention_backend", "AttnBackend.flash"),
        ("use_distributed_optimizer", "True"),
    ];

    fn iteration(n: u64, ms: f64) -> String {
        format!(
            " [2025-11-28 18:48:17.123456] iteration {n:8}/{:8} | consumed samples: {:12} | elapsed time per iteration (ms): {ms:.1} | throughput per GPU (TFLOP/s/GPU): 101.5 | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 1.045E+01 | loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 | number of nan iterations:   0 |\n",
            10,
            n * 16
        )
    }

    fn log(extra: &[(&str, &str)], times: &[f64]) -> String {
        let mut args: Vec<(&str, &str)> = BASE.to_vec();
        for (k, v) in extra {
            args.retain(|(name, _)| name != k);
            args.push((k, v));
        }
        let mut text = String::from("using world size: 8\n");
        text.push_str(&dump(&args));
        text.push_str(" > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)\n");
        for (i, ms) in times.iter().enumerate() {
            text.push_str(&iteration(i as u64 + 1, *ms));
            if i == 1 {
                text.push_str("[Rank 0] (after 2 iterations) memory (MB) | allocated: 4000.00 | max allocated: 9000.50 | reserved: 10000.00 | max reserved: 10240.00\n");
                text.push_str("[Rank 2] (after 2 iterations) memory (MB) | allocated: 4000.00 | max allocated: 9500.00 | reserved: 10000.00 | max reserved: 10100.00\n");
            }
        }
        text
    }

    #[test]
    fn a_complete_log_gives_config_steady_time_and_peak_memory() {
        let run = parse(&log(&[], &[900.0, 300.0, 200.0, 210.0, 190.0]), "a.log", 2).unwrap();
        let c = &run.config;
        assert_eq!(
            (c.tensor_model_parallel_size, c.pipeline_model_parallel_size),
            (2, 2)
        );
        assert_eq!(c.data_parallel_size, 2);
        assert_eq!(c.padded_vocab_size, Some(50304));
        assert_eq!(c.attention_backend.as_deref(), Some("flash"));
        assert_eq!(run.steady_iterations, 3);
        assert!((run.steady_mean_ms - 200.0).abs() < 1e-9);
        assert!((run.steady_median_ms - 200.0).abs() < 1e-9);
        assert_eq!(run.tflops_per_gpu, Some(101.5));
        assert_eq!(run.peak_allocated_bytes, Some(9500.0 * MEGABYTE));
        assert_eq!(run.peak_reserved_bytes, Some(10240.0 * MEGABYTE));
        assert!(run.arguments_complete);
        let config = c.parallel_config();
        assert_eq!(
            config.optimizer_sharding,
            OptimizerSharding::OptimizerStates
        );
        assert_eq!(config.schedule, ScheduleKind::OneFOneB);
    }

    #[test]
    fn warm_up_is_a_parameter_and_iteration_one_never_counts() {
        let text = log(&[], &[900.0, 300.0, 200.0]);
        let run = parse(&text, "a.log", 0).unwrap();
        assert_eq!(
            run.steady_iterations, 2,
            "iteration 1 is left out even without warm-up"
        );
        assert!((run.steady_mean_ms - 250.0).abs() < 1e-9);
        let err = parse(&text, "a.log", 3).unwrap_err().to_string();
        assert!(
            err.contains("no iteration lines after the 3 warm-up iterations")
                && err.contains("--train-iters")
                && err.contains("--warmup"),
            "{err}"
        );
    }

    #[test]
    fn prefixes_of_launchers_are_tolerated() {
        let text = log(&[], &[900.0, 300.0, 200.0, 220.0]);
        for prefix in [
            "[default0]:",
            "[rank0]: ",
            "0: ",
            "2025-01-01 10:00:00,123 INFO ",
        ] {
            let prefixed: String = text.lines().map(|l| format!("{prefix}{l}\n")).collect();
            let run = parse(&prefixed, "p.log", 2).unwrap();
            assert_eq!(run.config.num_layers, 24, "{prefix}");
            assert!((run.steady_mean_ms - 210.0).abs() < 1e-9, "{prefix}");
            assert_eq!(run.memory.len(), 2, "{prefix}");
        }
    }

    #[test]
    fn a_killed_log_keeps_what_it_has_and_never_reads_a_cut_number() {
        let mut text = log(&[], &[900.0, 300.0, 200.0, 220.0]);
        text.push_str(" [2025-11-28 18:48:17.123456] iteration        5/      10 | consumed samples:           80 | elapsed time per iteration (ms): 99");
        let run = parse(&text, "k.log", 2).unwrap();
        assert_eq!(run.steady_iterations, 2);
        assert!((run.steady_mean_ms - 210.0).abs() < 1e-9);
        assert!(
            run.notes.iter().any(|n| n.contains("cut off")),
            "{:?}",
            run.notes
        );
        assert!(
            run.notes
                .iter()
                .any(|n| n.contains("stops at iteration 5 of 10"))
        );
    }

    #[test]
    fn missing_parts_are_errors_that_say_what_is_missing() {
        let err = parse("", "e.log", 2).unwrap_err().to_string();
        assert!(err.contains("e.log") && err.contains("empty"), "{err}");
        let err = parse(&iteration(1, 5.0), "n.log", 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("n.log") && err.contains("no Megatron-LM argument dump"),
            "{err}"
        );
        let err = parse(&dump(&BASE), "i.log", 2).unwrap_err().to_string();
        assert!(err.contains("no readable iteration lines"), "{err}");
        let cut = format!("{ARGS_BEGIN}\n  num_layers {} 24\n", ".".repeat(38));
        let err = parse(&cut, "c.log", 2).unwrap_err().to_string();
        assert!(
            err.contains("hidden_size") && err.contains("cut inside"),
            "{err}"
        );
        let err = parse(&log(&[("num_layers", "many")], &[1.0]), "b.log", 2)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("num_layers") && err.contains("`many`"),
            "{err}"
        );
    }

    #[test]
    fn garbage_lines_and_unreadable_fields_are_skipped_with_a_note() {
        let mut text = log(&[], &[900.0, 300.0, 200.0]);
        text.push_str("garbage \u{fffd}\u{fffd} | iteration x/y |\n");
        text.push_str(" iteration        4/      10 | elapsed time per iteration (ms): nan |\n");
        text.push_str(&iteration(5, 220.0));
        text.push_str(
            "[Rank 1] (after 5 iterations) memory (MB) | allocated: oops | max allocated: | \n",
        );
        let run = parse(&text, "g.log", 2).unwrap();
        assert_eq!(run.steady_iterations, 2);
        assert!((run.steady_mean_ms - 210.0).abs() < 1e-9);
        assert!(run.notes.iter().any(|n| n.contains("without a readable")));
    }

    #[test]
    fn the_shipped_synthetic_logs_parse() {
        let garbage = include_str!("../../tests/data/megatron/gpt345m-tp2-pp1-dp4-garbage.log");
        let run = parse(garbage, "garbage.log", 2).unwrap();
        // A warning printed by another rank inside the dump is not an argument.
        assert_eq!(run.config.all.len(), BASE_ARGUMENTS_IN_SHIPPED_LOGS);
        assert_eq!(run.config.attention(), AttentionKind::Standard);
        assert_eq!(run.steady_iterations, 9);
        assert!(
            run.notes.iter().any(|n| n.contains("more than once")),
            "{:?}",
            run.notes
        );

        let killed = include_str!("../../tests/data/megatron/gpt1.3b-tp4-pp1-dp2-killed.log");
        let run = parse(killed, "killed.log", 2).unwrap();
        assert_eq!(run.last_iteration, 9);
        assert_eq!(run.steady_iterations, 6);
        assert_eq!(run.config.padded_vocab_size, Some(50688));

        let interleaved =
            include_str!("../../tests/data/megatron/llama-1b-tp1-pp4-dp2-interleaved.log");
        let run = parse(interleaved, "interleaved.log", 2).unwrap();
        assert_eq!(run.config.virtual_stages(), 2);
        let switches = run.config.switches;
        assert!(switches.gated_mlp == Some(true) && switches.tied_embeddings == Some(false));
        assert_eq!(run.memory.len(), 8);
        assert!(run.notes.is_empty(), "{:?}", run.notes);
    }

    /// Arguments in the dumps of `tests/data/megatron/` (the generator's list).
    const BASE_ARGUMENTS_IN_SHIPPED_LOGS: usize = 122;

    #[test]
    fn skipped_and_nan_iterations_are_summed() {
        let text = log(&[], &[900.0, 300.0, 200.0]).replace(
            "number of skipped iterations:   0 |",
            "number of skipped iterations:   1 |",
        );
        let run = parse(&text, "s.log", 2).unwrap();
        assert_eq!(run.skipped_iterations, 3);
        assert_eq!(run.nan_iterations, 0);
    }

    #[test]
    fn interleaving_recomputation_and_gqa_are_read() {
        let text = log(
            &[
                ("num_layers_per_virtual_pipeline_stage", "6"),
                ("virtual_pipeline_model_parallel_size", "2"),
                ("recompute_granularity", "full"),
                ("recompute_method", "uniform"),
                ("group_query_attention", "True"),
                ("num_query_groups", "4"),
                ("sequence_parallel", "True"),
                ("swiglu", "True"),
            ],
            &[900.0, 300.0, 200.0],
        );
        let run = parse(&text, "v.log", 2).unwrap();
        let config = run.config.parallel_config();
        assert_eq!(config.schedule, ScheduleKind::Interleaved);
        assert_eq!(config.virtual_stages, 2);
        assert_eq!(config.recompute, Recompute::Full);
        assert!(config.sequence_parallel);
        assert_eq!(run.config.kv_heads(), 4);
    }

    #[test]
    fn a_row_reads_back_with_runs_from_table_into_the_same_configuration() {
        for extra in [
            vec![],
            vec![
                ("virtual_pipeline_model_parallel_size", "2"),
                ("recompute_granularity", "selective"),
                ("sequence_parallel", "True"),
                ("attention_backend", "AttnBackend.unfused"),
                ("global_batch_size", "32"),
            ],
            vec![("cuda_graph_impl", "transformer_engine")],
            vec![("cuda_graph_impl", "full_iteration")],
        ] {
            let run = parse(&log(&extra, &[900.0, 300.0, 200.0]), "r.log", 2).unwrap();
            let headers: Vec<String> = ROW_COLUMNS.iter().map(|s| s.to_string()).collect();
            let row = run.row("r.log", "logs/r,1.log").unwrap();
            let mut buffer = Vec::new();
            write_csv(&mut buffer, &headers, &[row]).unwrap();
            let text = String::from_utf8(buffer).unwrap();
            let table = RunTable::parse(&text, "runs.csv").unwrap();
            let defaults = RowDefaults::gpt(1000, 128, AttentionKind::Standard, Recompute::Full);
            let runs = runs_from_table(&table, &defaults, crate::runs::BaseNode::DGX_A100).unwrap();
            assert_eq!(runs[0].config, run.config.parallel_config());
            assert_eq!(runs[0].gpus, 8);
            assert_eq!(runs[0].global_batch, run.config.global_batch_size);
            let model: &ModelSpec = &runs[0].model;
            assert_eq!(
                (model.hidden, model.heads, model.kv_heads, model.ffn_hidden),
                (1024, 16, 16, 4096)
            );
            assert_eq!(
                (model.layers, model.seq_len, model.vocab),
                (24, 1024, 50304)
            );
            assert!((runs[0].measured_s.unwrap() - 0.2).abs() < 1e-9);
            assert_eq!(table.cell(0, "source_log"), Some("logs/r,1.log"));
        }
    }

    /// A context-parallel and an MoE run become rows with their columns; a
    /// mixed key/value exchange and multi-latent attention are refused.
    /// The printed list of `--recompute-modules` under selective
    /// recomputation; a module paratune does not model refuses the row.
    #[test]
    fn recompute_modules_are_read_from_the_printed_list() {
        let run = |modules: &str| {
            parse(
                &log(
                    &[
                        ("recompute_granularity", "selective"),
                        ("recompute_modules", modules),
                    ],
                    &[9.0, 3.0, 2.0],
                ),
                "x.log",
                2,
            )
            .unwrap()
        };
        let read = run("['moe_act', 'layernorm']");
        assert_eq!(
            read.config.parallel_config().recompute_modules.names(),
            ["layernorm", "moe_act"]
        );
        let cells = read.row("x.log", "x.log").unwrap();
        let at = ROW_COLUMNS
            .iter()
            .position(|c| *c == "recompute_modules")
            .unwrap();
        assert_eq!(cells[at], "layernorm,moe_act");
        let err = run("['mhc']")
            .row("x.log", "x.log")
            .unwrap_err()
            .to_string();
        assert!(err.contains("['mhc']"), "{err}");
    }

    /// The configuration of a run whose argument dump adds `extra`.
    fn config_with(extra: &[(&str, &str)]) -> crate::config::ParallelConfig {
        parse(&log(extra, &[9.0, 3.0, 2.0]), "x.log", 2)
            .unwrap()
            .config
            .parallel_config()
    }

    /// `--grad-reduce-in-bf16`, or what it sets in a bf16 run's dump.
    #[test]
    fn bf16_gradient_reduction_is_read_from_the_arguments() {
        let grad_reduce = |extra: &[(&str, &str)]| config_with(extra).grad_reduce;
        use crate::config::GradReduce;
        assert_eq!(grad_reduce(&[]), GradReduce::Fp32);
        assert_eq!(
            grad_reduce(&[("grad_reduce_in_bf16", "True")]),
            GradReduce::Bf16
        );
        let bf16 = [
            ("bf16", "True"),
            ("accumulate_allreduce_grads_in_fp32", "False"),
        ];
        assert_eq!(grad_reduce(&bf16), GradReduce::Bf16);
        let fp32 = [
            ("bf16", "True"),
            ("accumulate_allreduce_grads_in_fp32", "True"),
        ];
        assert_eq!(grad_reduce(&fp32), GradReduce::Fp32);
    }

    /// `--defer-embedding-wgrad-compute`, with `--wgrad-deferral-limit`
    /// (0, its default, defers every micro-batch).
    #[test]
    fn deferred_embedding_wgrad_is_read_from_the_arguments() {
        let deferral = |extra: &[(&str, &str)]| config_with(extra).wgrad_deferral;
        use crate::config::WgradDeferral;
        assert_eq!(
            deferral(&[("wgrad_deferral_limit", "2")]),
            WgradDeferral::Off
        );
        assert_eq!(
            deferral(&[
                ("defer_embedding_wgrad_compute", "True"),
                ("wgrad_deferral_limit", "0")
            ]),
            WgradDeferral::All
        );
        assert_eq!(
            deferral(&[
                ("defer_embedding_wgrad_compute", "True"),
                ("wgrad_deferral_limit", "2")
            ]),
            WgradDeferral::Limit(2)
        );
    }

    /// `--cross-entropy-loss-fusion`, with `--cross-entropy-fusion-impl`
    /// naming the kernel (`native` unless it says `te`).
    #[test]
    fn fused_cross_entropy_is_read_from_the_arguments() {
        let fusion = |extra: &[(&str, &str)]| config_with(extra).cross_entropy_fusion;
        use crate::config::CrossEntropyFusion;
        assert_eq!(fusion(&[]), CrossEntropyFusion::Off);
        assert_eq!(
            fusion(&[("cross_entropy_fusion_impl", "te")]),
            CrossEntropyFusion::Off
        );
        assert_eq!(
            fusion(&[("cross_entropy_loss_fusion", "True")]),
            CrossEntropyFusion::Native
        );
        assert_eq!(
            fusion(&[
                ("cross_entropy_loss_fusion", "True"),
                ("cross_entropy_fusion_impl", "te")
            ]),
            CrossEntropyFusion::Te
        );
    }

    #[test]
    fn context_parallel_and_moe_runs_become_rows() {
        let row_of = |extra: &[(&str, &str)]| {
            let run = parse(&log(extra, &[9.0, 3.0, 2.0]), "x.log", 2).unwrap();
            run.row("x.log", "x.log").map(|cells| {
                ROW_COLUMNS
                    .iter()
                    .map(|c| c.to_string())
                    .zip(cells)
                    .collect::<BTreeMap<String, String>>()
            })
        };
        let cp = row_of(&[("context_parallel_size", "2"), ("data_parallel_size", "1")]).unwrap();
        assert_eq!((cp["cp"].as_str(), cp["cp_comm"].as_str()), ("2", "p2p"));
        assert_eq!(cp["num_experts"], "");
        let moe = row_of(&[
            ("num_experts", "8"),
            ("moe_router_topk", "2"),
            ("expert_model_parallel_size", "2"),
            ("moe_token_dispatcher_type", "alltoall"),
            ("fp8", "hybrid"),
        ])
        .unwrap();
        assert_eq!(
            (
                moe["num_experts"].as_str(),
                moe["moe_topk"].as_str(),
                moe["ep"].as_str(),
                moe["moe_dispatcher"].as_str(),
                moe["precision"].as_str()
            ),
            ("8", "2", "2", "alltoall", "fp8")
        );
        // Without `--fp8-recipe` Megatron-LM scales `delayed`; a bf16 run
        // prints that default too and holds no recipe.
        assert_eq!(moe["fp8_recipe"], "delayed");
        let tensorwise = row_of(&[("fp8", "hybrid"), ("fp8_recipe", "tensorwise")]).unwrap();
        assert_eq!(tensorwise["fp8_recipe"], "tensorwise");
        let bf16 = row_of(&[("fp8_recipe", "delayed")]).unwrap();
        assert_eq!(
            (bf16["precision"].as_str(), bf16["fp8_recipe"].as_str()),
            ("bf16", "")
        );
        // `--fp4-format e2m1` prints as `fp4`: an NVFP4 run, no FP8 recipe.
        let nvfp4 = row_of(&[("fp4", "e2m1"), ("fp4_recipe", "nvfp4")]).unwrap();
        assert_eq!(
            (nvfp4["precision"].as_str(), nvfp4["fp8_recipe"].as_str()),
            ("nvfp4", "")
        );
        // Megatron-LM's other FP4 recipe is a user's own quantization.
        let custom_fp4 = row_of(&[("fp4", "e2m1"), ("fp4_recipe", "custom")]).unwrap_err();
        assert!(
            custom_fp4.to_string().contains("`custom` recipe")
                && custom_fp4.to_string().contains("--fp4-recipe nvfp4"),
            "{custom_fp4}"
        );
        let custom = row_of(&[("fp8", "hybrid"), ("fp8_recipe", "custom")]).unwrap_err();
        assert!(
            custom.to_string().contains("`custom` FP8 recipe"),
            "{custom}"
        );
        // Without the argument, Megatron-LM's defaults: the one dispatcher
        // default and etp = tp; a dense run holds the default whatever it says.
        let parsed = |extra: &[(&str, &str)]| {
            parse(&log(extra, &[9.0, 3.0, 2.0]), "x.log", 2)
                .unwrap()
                .config
                .parallel_config()
        };
        let plain = parsed(&[("num_experts", "8"), ("tensor_model_parallel_size", "2")]);
        assert_eq!(plain.dispatcher, ParallelConfig::default().dispatcher);
        assert_eq!(plain.etp, 2);
        let dense = parsed(&[("moe_token_dispatcher_type", "alltoall")]);
        assert_eq!(dense.dispatcher, ParallelConfig::default().dispatcher);
        assert_eq!(dense.etp, 1);
        let mixed = row_of(&[
            ("context_parallel_size", "2"),
            ("data_parallel_size", "1"),
            ("cp_comm_type", "['a2a+p2p']"),
        ]);
        assert!(
            mixed
                .unwrap_err()
                .to_string()
                .contains("context parallelism by")
        );
        // Flex runs: DeepEP where the log predates the backend argument,
        // HybridEP where it says so, with DeepSeek's router groups; other
        // backends are refused by name.
        let flex = |extra: &[(&str, &str)]| {
            let mut args = vec![
                ("num_experts", "8"),
                ("expert_model_parallel_size", "2"),
                ("moe_token_dispatcher_type", "flex"),
                ("moe_router_num_groups", "4"),
                ("moe_router_group_topk", "2"),
            ];
            args.extend_from_slice(extra);
            row_of(&args)
        };
        let deepep = flex(&[]).unwrap();
        assert_eq!(
            (
                deepep["moe_dispatcher"].as_str(),
                deepep["moe_router_num_groups"].as_str(),
                deepep["moe_router_group_topk"].as_str()
            ),
            ("flex", "4", "2")
        );
        let hybrid = flex(&[("moe_flex_dispatcher_backend", "hybridep")]).unwrap();
        assert_eq!(hybrid["moe_dispatcher"], "hybridep");
        let uccl = flex(&[("moe_flex_dispatcher_backend", "uccl_ep")]).unwrap_err();
        assert!(uccl.to_string().contains("`uccl_ep` backend"), "{uccl}");
        let mla = row_of(&[("multi_latent_attention", "True")]);
        assert!(
            mla.unwrap_err()
                .to_string()
                .contains("multi-latent attention")
        );
    }
}
