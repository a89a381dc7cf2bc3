//! torchtitan training logs: the stdout of a `torchrun ... -m torchtitan.train`
//! run, read with the configuration it ran (printed in the log, given as its
//! job TOML, or on the torchrun command line the log holds) into its steady
//! step time and peak memory, and turned into a row of paratune's run table.
//!
//! Two releases are read: torchtitan 0.2.x (0.2.2, the last with TOML job
//! configs and `--job.config_file`) and 0.3.x (`--module llama3 --config
//! llama3_8b` with tyro overrides `--section.field value`, activation
//! checkpointing as the trailing subcommand `activation-checkpoint:MODE`).
//! The formats, from the PyPI wheels (paths inside the wheel, line numbers
//! of `cat -n`; see the project's torchtitan research notes):
//!
//! * the step line of `MetricsProcessor.log`, 0.3.0
//!   `torchtitan/components/metrics.py` L521-532 (0.2.2: L461-470, the same
//!   but `mfu: {mfu:.2f}%` always; 0.1.0: L401-407, without `grad_norm`):
//!   `f"{color.red}step: {step:2}  "`, `f"{color.green}loss: {global_avg_loss:8.5f}  "`,
//!   `f"{color.orange}grad_norm: {grad_norm:7.4f}  "`,
//!   `f"{color.turquoise}memory: {max_reserved_gib:5.2f}GiB({max_reserved_pct:.2f}%)  "`,
//!   `f"{color.blue}tps: {round(tps):,}  "`, `f"{color.cyan}tflops: {tflops:,.2f}  "`,
//!   `f"{color.magenta}mfu: {mfu_str}{color.reset}"` with
//!   `mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"`; the colours
//!   (`torchtitan/tools/utils.py` L263-274) are ANSI codes `\x1b[..m`, empty
//!   with `--metrics.disable_color_printing`. It is printed for step 1 and
//!   every `metrics.log_freq` steps (metrics.py L362-363), by the ranks
//!   torchrun lets through (`--local-ranks-filter`, rank 0 by default);
//!   `validate step: ...` lines are validation, not training;
//! * its fields (metrics.py L474-493, L38-93): `memory` is this rank's
//!   `torch.cuda.memory_stats()["reserved_bytes.all.peak"]` in GiB
//!   (bytes / 1024^3), its peak since the previous logged step (the peak is
//!   reset after every log, L537); `tps` is
//!   `ntokens_since_last_log / (time_delta * non_data_parallel_size)` with
//!   `non_data_parallel_size = cp * tp * pp` (`parallel_dims.py` L708-709),
//!   tokens counted on this rank: `global_batch * seq_len / dp` a step, so a
//!   step takes `global_batch * seq_len / (tps * gpus)` seconds, data
//!   loading included; `mfu` is `None` (`N/A`) when `has_quantization`
//!   (float8/MX/NVFP4 converters, 0.3.0 L483-489);
//! * the logger's prefix (`torchtitan/tools/logging.py` L15-24):
//!   `[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s`, under
//!   torchrun's `--role rank` prefixed `[rank0]:` on every line, a message's
//!   continuation lines included;
//! * the printed configuration: `Running with configs: {json.dumps(self.to_dict(),
//!   indent=2)}` (0.3.0 `torchtitan/trainer.py` L231-252, with
//!   `--debug.print_config`; 0.2.2 `JobConfig.maybe_log` in
//!   `torchtitan/config/job_config.py`, with `--job.print_config`); 0.3.0
//!   writes the model as `model_spec: {name, flavor, model}` and the
//!   activation checkpointing as the chosen config's fields (`null` for none);
//! * start-up lines: `torchtitan version: X (0.0.0 means ...)` (0.3.0
//!   `torchtitan/train.py` L23-26); `Trainer is initialized with local batch
//!   size L, global batch size G, gradient accumulation steps A, sequence
//!   length S, total steps T (warmup W)` (0.3.0 trainer.py L644-652, and the
//!   0.2 trainer); `Building {name} {flavor}` (0.3.0 trainer.py L361; 0.2's
//!   `Building {name} {flavor} with {model_args}`, the `TransformerModelArgs`
//!   repr); `Building {n}-D device mesh with {names}, {dims}` (the active
//!   dimensions of `[pp, dp_replicate, dp_shard, cp, tp]`,
//!   `torchtitan/distributed/parallel_dims.py`, printed by the releases that
//!   build the mesh with `init_device_mesh`); `Applied {mode} activation
//!   checkpointing to the model` (0.2.2 `selective`/`full`; 0.3.0
//!   `activation_checkpoint.py` L161-163, `SelectiveAC`/`FullAC`); `Using
//!   pipeline schedule {schedule} with {n} microbatches and {stages} stages.`
//!   (`torchtitan/distributed/pipeline_parallel.py`).
//!
//! The configuration's meaning (0.2.2 `JobConfig`, 0.3.0
//! `torchtitan/config/configs.py`): `data_parallel_shard_degree = -1` takes
//! the ranks left over; `global_batch_size = -1` is `local_batch_size x dp`,
//! and it must be a multiple of it (trainer.py L413-433); with a pipeline
//! `local_batch_size` is split into `pipeline_parallel_microbatch_size`
//! micro-batches; FSDP reshards after forward unless
//! `fsdp_reshard_after_forward` is `never`, or `default` under a pipeline
//! (`torchtitan/distributed/fsdp.py` L54-78); 0.3.0 captures CUDA graphs
//! unless `training.disable_cuda_graphs`, and refuses them under a pipeline
//! (trainer.py L179-187, L613-614); the pipeline has `pp x (1 or 2)` stages
//! (or `ceil((layers + first_less + last_less) / layers_per_stage)`), the
//! embedding and the head counting as `pipeline_parallel_first_stage_less_layers`
//! and `..._last_stage_less_layers` layers, the remainder going to the
//! earliest stages, stage `s` on rank `s mod pp` (pipeline_parallel.py
//! L194-264, L366-476, L541-579); 0.2.2's `selective_ac_option = "N"`
//! checkpoints every N-th block whole (`activation_checkpoint.py` L37-40),
//! `"op"` is the per-op policy, 0.3.0's only selective one.
//!
//! In the row: `micro_batch` is `local_batch_size`, or
//! `pipeline_parallel_microbatch_size` under a pipeline; `optimizer_sharding`
//! is `full` for FSDP resharding after forward, `optimizer-states` for FSDP
//! keeping weights gathered, `none` for DDP (replicate only) or one rank;
//! sequence parallelism is on with tp > 1 (unless 0.3's
//! `enable_sequence_parallel` is off); `compile` needs `model` in
//! `compile.components`; `tp_comm_overlap` is async TP; gradient reduction
//! always overlaps the backward (`overlap_grad_reduce`); `memory_rank` is
//! `first` for rank 0's lines (the first pipeline stage) and `last` for a
//! last-stage rank's (torchrun's prefix is the local rank, the global one
//! on a single node).
//!
//! Lines may carry launcher prefixes (torchrun's `[rank0]:`, `srun -l`'s
//! `0: `) and colour codes; lines of other ranks are kept apart by their
//! prefix. A log cut off mid-way, or with other programs' output mixed in,
//! gives what it holds; what is missing for a row is an error that names it.

use crate::config::{OptimizerSharding, ParallelConfig, Recompute, Rule, ScheduleKind};
use crate::cost::MemoryRank;
use crate::model::{AttentionKind, ModelSpec, builtin_model};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

pub use super::megatron_log::DEFAULT_WARMUP;
use super::megatron_log::{list, median};

/// A steady step this many times the median is reported as an outlier.
const OUTLIER_FACTOR: f64 = 3.0;
/// The most GPUs, and the largest batch or sequence, a run may have: the
/// run table's limits for `gpus` and `global_batch`.
const MAX_GPUS: u64 = 1 << 20;
const MAX_BATCH: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TorchtitanLogError {
    #[error("{path}: cannot read the log: {message}")]
    Read { path: String, message: String },
    #[error(
        "{path}: the file is empty; give the stdout of a torchtitan training run (torchrun ... -m torchtitan.train)"
    )]
    Empty { path: String },
    #[error(
        "{path}: no readable step lines (`step: N  loss: ...  memory: ...GiB(...%)  tps: ...`); the run stopped before its first logged step, or this is not the output of a rank that logs (torchrun --local-ranks-filter, LOG_RANK=0 by default)"
    )]
    NoSteps { path: String },
    #[error(
        "{path}: no step lines after the {warmup} warm-up step line(s) ({logged} logged; step 1 never counts); run more --training.steps, log more often (--metrics.log_freq), or lower --warmup"
    )]
    NoSteadySteps {
        path: String,
        warmup: usize,
        logged: usize,
    },
    #[error(
        "{path}: no configuration: the log holds no printed config (`Running with configs: {{...}}`, from --job.print_config in torchtitan 0.2 or --debug.print_config in 0.3) and no torchrun command line{hint}; give the run's job config with --config JOB.toml (torchtitan 0.2) or the JSON its save_config_file wrote, or rerun with the config printed"
    )]
    NoConfig { path: String, hint: String },
    #[error("{path}: {message}")]
    ConfigFile { path: String, message: String },
    #[error("{origin}: `{key}` is `{value}`, expected {expected}")]
    BadSetting {
        origin: String,
        key: String,
        value: String,
        expected: String,
    },
    #[error("{path}: {message}")]
    Inconsistent { path: String, message: String },
    #[error("{path}: the run uses {feature}, which paratune cannot describe; {hint}")]
    Unsupported {
        path: String,
        feature: String,
        hint: String,
    },
    #[error(
        "{path}: {message}; give the model with --model NAME|FILE (`paratune models` lists the built-in ones, a model TOML file describes others)"
    )]
    UnknownModel { path: String, message: String },
    #[error(
        "{path}: the GPU count is unknown: data_parallel_shard_degree is -1 (the ranks left over) and the log has no device-mesh line, no `Trainer is initialized with ...` line and no torchrun command line; give --gpus N"
    )]
    NeedGpus { path: String },
}

type Result<T> = std::result::Result<T, TorchtitanLogError>;

/// The torchtitan release a log comes from, as far as it matters here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// 0.2.x (and earlier): TOML job configs, `selective_ac_option`, no CUDA graphs.
    V02,
    /// 0.3.x: Python config functions, per-op selective checkpointing only,
    /// CUDA graphs on by default.
    V03,
}

impl Release {
    pub fn name(self) -> &'static str {
        match self {
            Release::V02 => "0.2",
            Release::V03 => "0.3",
        }
    }
}

// ---------------------------------------------------------------------------
// Settings: the configuration as dotted keys, from every source.

/// A configuration value as its source wrote it.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    /// A TOML or JSON string (torchtitan does not convert TOML values).
    Str(String),
    /// A command-line word, typed when it is read (as tyro does).
    Word(String),
    List(Vec<String>),
    /// `module_fqns_per_model_part`: a list of lists of module names.
    Parts(Vec<Vec<String>>),
    Null,
    /// A table or a value of another shape, shown as written.
    Other(String),
}

impl Value {
    /// The value without quotes, booleans in lower case: what compares
    /// across sources (a command-line word with a TOML integer).
    fn plain(&self) -> String {
        match self {
            Value::Str(s) | Value::Word(s) => s.to_lowercase(),
            other => other.shown(),
        }
    }

    fn shown(&self) -> String {
        match self {
            Value::Int(i) => i.to_string(),
            Value::Float(f) => f.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Str(s) => format!("\"{s}\""),
            Value::Word(s) => s.clone(),
            Value::List(items) => format!("[{}]", items.join(", ")),
            Value::Parts(parts) => format!("{parts:?}"),
            Value::Null => "null".into(),
            Value::Other(text) => text.clone(),
        }
    }
}

/// Where a setting comes from.
#[derive(Debug, Clone, PartialEq)]
enum Origin {
    /// What paratune knows of a torchtitan 0.3 config function's settings.
    Function(String),
    /// `--config FILE`.
    File(String),
    /// The torchrun command line in the log, at this line.
    CommandLine(usize),
    /// The printed configuration, starting at this line.
    Printed(usize),
}

impl Origin {
    /// Set by the run's own configuration, not by what paratune assumes.
    fn explicit(&self) -> bool {
        !matches!(self, Origin::Function(_))
    }

    fn describe(&self, log: &str) -> String {
        match self {
            Origin::Function(name) => {
                format!(
                    "{log}: torchtitan 0.3's config function {name} (its settings as paratune knows them)"
                )
            }
            Origin::File(path) => path.clone(),
            Origin::CommandLine(line) => format!("{log} line {line} (the command line)"),
            Origin::Printed(line) => format!("{log} line {line} (the printed config)"),
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Settings {
    map: BTreeMap<String, (Value, Origin)>,
}

impl Settings {
    fn set(&mut self, key: &str, value: Value, origin: &Origin) {
        self.map.insert(key.to_string(), (value, origin.clone()));
    }

    /// Takes every setting of `other` over this one's.
    fn layer(&mut self, other: &Settings) {
        for (key, entry) in &other.map {
            self.map.insert(key.clone(), entry.clone());
        }
    }

    fn get(&self, key: &str) -> Option<&(Value, Origin)> {
        self.map.get(key)
    }

    fn has_prefix(&self, prefix: &str) -> bool {
        self.map
            .range(prefix.to_string()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(prefix))
    }
}

/// Typed reading of [`Settings`], with errors that name the key and where it was set.
struct Reader<'a> {
    settings: &'a Settings,
    log: &'a str,
}

impl Reader<'_> {
    fn bad(&self, key: &str, value: &Value, origin: &Origin, expected: &str) -> TorchtitanLogError {
        TorchtitanLogError::BadSetting {
            origin: origin.describe(self.log),
            key: key.into(),
            value: value.shown(),
            expected: expected.into(),
        }
    }

    fn origin(&self, key: &str) -> Option<&Origin> {
        self.settings.get(key).map(|(_, o)| o)
    }

    fn explicit(&self, key: &str) -> bool {
        self.origin(key).is_some_and(Origin::explicit)
    }

    fn int(&self, key: &str) -> Result<Option<i64>> {
        let Some((value, origin)) = self.settings.get(key) else {
            return Ok(None);
        };
        match value {
            Value::Int(i) => Ok(Some(*i)),
            Value::Null => Ok(None),
            Value::Word(w) if w == "None" => Ok(None),
            Value::Word(w) => w
                .parse()
                .map(Some)
                .map_err(|_| self.bad(key, value, origin, "a whole number")),
            Value::Str(_) => Err(self.bad(
                key,
                value,
                origin,
                "a whole number (a TOML string stays a string in torchtitan; write it without quotes)",
            )),
            _ => Err(self.bad(key, value, origin, "a whole number")),
        }
    }

    /// A parallel degree or a count: at least 1 (at most 2^20).
    fn count(&self, key: &str, default: u64) -> Result<u64> {
        match self.int(key)? {
            None => Ok(default),
            Some(n) if (1..=1 << 20).contains(&n) => Ok(n as u64),
            Some(_) => {
                let (value, origin) = self.settings.get(key).expect("read above");
                Err(self.bad(key, value, origin, "a whole number from 1 to 1048576"))
            }
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool> {
        let Some((value, origin)) = self.settings.get(key) else {
            return Ok(default);
        };
        match value {
            Value::Bool(b) => Ok(*b),
            Value::Null => Ok(default),
            Value::Word(w) => match w.to_lowercase().as_str() {
                "true" | "1" => Ok(true),
                "false" | "0" => Ok(false),
                _ => Err(self.bad(key, value, origin, "true or false")),
            },
            _ => Err(self.bad(key, value, origin, "true or false")),
        }
    }

    fn text(&self, key: &str) -> Result<Option<String>> {
        let Some((value, origin)) = self.settings.get(key) else {
            return Ok(None);
        };
        match value {
            Value::Str(s) | Value::Word(s) => Ok(Some(s.clone())),
            Value::Int(i) => Ok(Some(i.to_string())),
            Value::Null => Ok(None),
            _ => Err(self.bad(key, value, origin, "a string")),
        }
    }

    fn list(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some((value, origin)) = self.settings.get(key) else {
            return Ok(None);
        };
        match value {
            Value::List(items) => Ok(Some(items.clone())),
            Value::Str(s) | Value::Word(s) => Ok(Some(
                s.split(',')
                    .map(|p| p.trim().to_string())
                    .filter(|p| !p.is_empty())
                    .collect(),
            )),
            Value::Null => Ok(Some(Vec::new())),
            _ => Err(self.bad(key, value, origin, "a list of strings")),
        }
    }

    fn parts(&self, key: &str) -> Result<Option<Vec<Vec<String>>>> {
        let Some((value, origin)) = self.settings.get(key) else {
            return Ok(None);
        };
        match value {
            Value::Parts(parts) => Ok(Some(parts.clone())),
            Value::Null => Ok(None),
            Value::List(items) if items.is_empty() => Ok(None),
            _ => Err(self.bad(key, value, origin, "a list of lists of module names")),
        }
    }
}

/// The keys of the job-config sections paratune reads, torchtitan 0.2.0 to
/// 0.2.2 (`torchtitan/config/job_config.py`): torchtitan refuses a TOML
/// with any other key in them, so a TOML that has one is not what ran.
const TOML_SECTIONS: [(&str, &[&str]); 5] = [
    (
        "model",
        &[
            "name",
            "flavor",
            "hf_assets_path",
            "tokenizer_path",
            "converters",
            "print_after_conversion",
        ],
    ),
    (
        "training",
        &[
            "dataset",
            "dataset_path",
            "local_batch_size",
            "global_batch_size",
            "seq_len",
            "max_norm",
            "steps",
            "enable_cpu_offload",
            "dtype",
            "mixed_precision_param",
            "mixed_precision_reduce",
            "gc_freq",
            "gc_debug",
            "dataloader",
            // 0.2.0, moved to [debug] in 0.2.1.
            "seed",
            "deterministic",
            "debug_moe_force_load_balance",
        ],
    ),
    (
        "parallelism",
        &[
            "data_parallel_replicate_degree",
            "data_parallel_shard_degree",
            "fsdp_reshard_after_forward",
            "tensor_parallel_degree",
            "disable_loss_parallel",
            "enable_async_tensor_parallel",
            "pipeline_parallel_degree",
            "module_fqns_per_model_part",
            "pipeline_parallel_first_stage_less_layers",
            "pipeline_parallel_last_stage_less_layers",
            "pipeline_parallel_layers_per_stage",
            "pipeline_parallel_schedule",
            "pipeline_parallel_schedule_csv",
            "pipeline_parallel_microbatch_size",
            "pipeline_parallel_expert_parallel_overlap",
            "context_parallel_degree",
            "context_parallel_load_balancer",
            "context_parallel_rotate_method",
            "expert_parallel_degree",
            "expert_tensor_parallel_degree",
            "expert_parallel_comm_backend",
            // 0.2.0 only.
            "enable_compiled_autograd",
        ],
    ),
    (
        "activation_checkpoint",
        &[
            "mode",
            "selective_ac_option",
            "per_op_sac_force_recompute_mm_shapes_by_fqns",
            "early_stop",
            "memory_budget",
            "visualize_memory_budget_pareto",
            "preserve_rng_state",
            "determinism_check",
            "debug",
        ],
    ),
    ("compile", &["enable", "components", "backend"]),
];

/// A job configuration given with `--config`: a torchtitan 0.2 job TOML,
/// or the JSON of the configuration (`save_config_file`, or the printed one).
#[derive(Debug, Clone)]
pub struct ConfigFile {
    path: String,
    settings: Settings,
    release: Option<Release>,
}

impl ConfigFile {
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// Reads `--config FILE`: JSON when it starts with `{`, a TOML job config otherwise.
pub fn read_config_file(path: &Path) -> Result<ConfigFile> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| TorchtitanLogError::ConfigFile {
        path: shown.clone(),
        message: format!("cannot read the job config: {e}"),
    })?;
    parse_config_file(&text, &shown)
}

/// Parses the text of a `--config` file; `path` names it in errors.
pub fn parse_config_file(text: &str, path: &str) -> Result<ConfigFile> {
    let origin = Origin::File(path.to_string());
    if text.trim_start().starts_with('{') {
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(|e| TorchtitanLogError::ConfigFile {
                path: path.into(),
                message: format!(
                    "not a readable JSON configuration ({e}); give the JSON torchtitan saved, or a TOML job config"
                ),
            })?;
        let mut settings = Settings::default();
        flatten_json(&json, "", &origin, &mut settings);
        let release = json_release(&settings);
        normalise_v03(&mut settings, &origin);
        return Ok(ConfigFile {
            path: path.into(),
            settings,
            release,
        });
    }
    let table: toml::Table =
        text.parse()
            .map_err(|e: toml::de::Error| TorchtitanLogError::ConfigFile {
                path: path.into(),
                message: crate::toml_error::one_line(
                    &e,
                    text,
                    "give the torchtitan job config (TOML) the run was started with",
                ),
            })?;
    for (section, known) in TOML_SECTIONS {
        let Some(toml::Value::Table(keys)) = table.get(section) else {
            continue;
        };
        for key in keys.keys() {
            if !known.contains(&key.as_str()) {
                return Err(TorchtitanLogError::ConfigFile {
                    path: path.into(),
                    message: format!(
                        "[{section}] has no key `{key}` in torchtitan 0.2's job config, and torchtitan refuses unknown keys (is this the TOML the run used?){}",
                        crate::suggest::did_you_mean(key, known)
                    ),
                });
            }
        }
    }
    let mut settings = Settings::default();
    flatten_toml(&table, "", &origin, &mut settings);
    Ok(ConfigFile {
        path: path.into(),
        settings,
        release: Some(Release::V02),
    })
}

fn join_key(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

fn flatten_toml(table: &toml::Table, prefix: &str, origin: &Origin, out: &mut Settings) {
    for (key, value) in table {
        let full = join_key(prefix, key);
        let v = match value {
            toml::Value::Table(inner) => {
                flatten_toml(inner, &full, origin, out);
                continue;
            }
            toml::Value::String(s) => Value::Str(s.clone()),
            toml::Value::Integer(i) => Value::Int(*i),
            toml::Value::Float(f) => Value::Float(*f),
            toml::Value::Boolean(b) => Value::Bool(*b),
            toml::Value::Array(items) => array_value(
                items.iter().map(|i| i.as_str().map(str::to_string)),
                items.iter().map(|i| {
                    i.as_array().and_then(|inner| {
                        inner
                            .iter()
                            .map(|x| x.as_str().map(str::to_string))
                            .collect()
                    })
                }),
                value.to_string(),
            ),
            other => Value::Other(other.to_string()),
        };
        out.set(&full, v, origin);
    }
}

/// A list of strings, a list of lists of strings, or (anything else) as written.
fn array_value(
    strings: impl Iterator<Item = Option<String>>,
    lists: impl Iterator<Item = Option<Vec<String>>>,
    shown: String,
) -> Value {
    if let Some(items) = strings.collect::<Option<Vec<String>>>() {
        return Value::List(items);
    }
    if let Some(parts) = lists.collect::<Option<Vec<Vec<String>>>>() {
        return Value::Parts(parts);
    }
    Value::Other(shown)
}

fn flatten_json(value: &serde_json::Value, prefix: &str, origin: &Origin, out: &mut Settings) {
    use serde_json::Value as J;
    let v = match value {
        J::Object(map) if !map.is_empty() || prefix.is_empty() => {
            for (key, inner) in map {
                flatten_json(inner, &join_key(prefix, key), origin, out);
            }
            return;
        }
        J::Object(_) => Value::Other("{}".into()),
        J::Null => Value::Null,
        J::Bool(b) => Value::Bool(*b),
        J::Number(n) => match n.as_i64() {
            Some(i) => Value::Int(i),
            None => Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::Str(s.clone()),
        J::Array(items) => array_value(
            items.iter().map(|i| i.as_str().map(str::to_string)),
            items.iter().map(|i| {
                i.as_array().and_then(|inner| {
                    inner
                        .iter()
                        .map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
            }),
            value.to_string(),
        ),
    };
    out.set(prefix, v, origin);
}

/// The release a configuration's JSON comes from: 0.2's `JobConfig` has a
/// `job` section, 0.3's `Trainer.Config` a `model_spec`.
fn json_release(settings: &Settings) -> Option<Release> {
    if settings.has_prefix("model_spec.") || settings.get("model_spec").is_some() {
        Some(Release::V03)
    } else if settings.has_prefix("job.") {
        Some(Release::V02)
    } else {
        None
    }
}

/// 0.3's JSON in 0.2's keys: `model_spec.name/flavor` as `model.name/flavor`,
/// and the activation-checkpointing union (the chosen config's fields, or
/// `null`) as `activation_checkpoint.mode`.
fn normalise_v03(settings: &mut Settings, origin: &Origin) {
    for field in ["name", "flavor"] {
        if let Some((value, o)) = settings.get(&format!("model_spec.{field}")).cloned() {
            settings.map.insert(format!("model.{field}"), (value, o));
        }
    }
    if settings.get("activation_checkpoint.mode").is_some() {
        return;
    }
    let mode = if matches!(
        settings.get("activation_checkpoint"),
        Some((Value::Null, _))
    ) {
        Some("none")
    } else if settings.has_prefix("activation_checkpoint.memory_budget") {
        Some("memory_budget")
    } else if settings.has_prefix("activation_checkpoint.force_recompute_mm_shapes_by_fqns") {
        Some("selective")
    } else if settings.has_prefix("activation_checkpoint.") {
        Some("full")
    } else {
        None
    };
    if let Some(mode) = mode {
        settings.set(
            "activation_checkpoint.mode",
            Value::Str(mode.into()),
            origin,
        );
    }
}

// ---------------------------------------------------------------------------
// Reading the log.

/// One logged step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLine {
    /// 1-based line in the log.
    pub line: usize,
    pub step: u64,
    pub loss: Option<f64>,
    pub grad_norm: Option<f64>,
    /// `memory: X GiB`: the rank's peak reserved memory since the previous logged step.
    pub memory_gib: Option<f64>,
    /// Tokens per second per device, averaged since the previous logged step.
    pub tps: Option<f64>,
    pub tflops: Option<f64>,
    /// `mfu: X%`; `None` when `N/A` or unreadable.
    pub mfu_percent: Option<f64>,
    /// `mfu: N/A` (torchtitan 0.3: quantisation is active).
    pub mfu_not_available: bool,
}

/// The step lines of one stream of output (one launcher prefix).
#[derive(Debug, Clone, Default)]
struct Stream {
    prefix: String,
    rank: Option<u64>,
    steps: Vec<StepLine>,
    seen: HashSet<u64>,
    unreadable: Vec<usize>,
    repeated: Vec<u64>,
}

#[derive(Debug, Clone)]
struct TrainerLine {
    line: usize,
    local_batch: u64,
    global_batch: u64,
    accumulation: u64,
    seq_len: u64,
    total_steps: Option<u64>,
}

#[derive(Debug, Clone)]
struct MeshLine {
    line: usize,
    dims: Vec<(String, u64)>,
}

#[derive(Debug, Clone)]
struct BuildingLine {
    line: usize,
    name: String,
    flavor: String,
    /// The model arguments of 0.2's `Building ... with Args(k=v, ...)`.
    args: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone)]
struct PipelineLine {
    line: usize,
    schedule: String,
    microbatches: u64,
    stages: u64,
}

/// The torchrun (or run_train.sh) command line in a log.
#[derive(Debug, Clone, Default)]
struct CommandLine {
    line: usize,
    settings: Settings,
    /// GPUs the launcher started: nproc-per-node x nnodes, or NGPU.
    world: Option<u64>,
    /// 0.3's `--module` and `--config` (the config function).
    module: Option<String>,
    function: Option<String>,
    /// 0.2's `--job.config_file` (or run_train.sh's CONFIG_FILE).
    config_file: Option<String>,
}

#[derive(Debug, Default)]
struct Scan {
    streams: Vec<Stream>,
    cut_off_last_line: bool,
    version: Option<(String, usize)>,
    mesh: Option<MeshLine>,
    trainer: Option<TrainerLine>,
    building: Option<BuildingLine>,
    applied_ac: Option<(String, usize)>,
    pipeline: Option<PipelineLine>,
    printed: Option<(usize, std::result::Result<Settings, String>)>,
    command: Option<CommandLine>,
    notes: Vec<String>,
}

/// Removes ANSI colour codes (`ESC [ digits/semicolons m`).
fn strip_ansi(line: &str) -> std::borrow::Cow<'_, str> {
    if !line.contains('\x1b') {
        return line.into();
    }
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(at) = rest.find('\x1b') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let code = after.strip_prefix('[').and_then(|body| {
            let end = body.find(|c: char| !(c.is_ascii_digit() || c == ';'))?;
            body[end..].starts_with('m').then_some(end + 2)
        });
        match code {
            Some(len) => rest = &after[len..],
            None => rest = after,
        }
    }
    out.push_str(rest);
    out.into()
}

/// The length of the launcher prefixes at the start of `line` (`srun -l`'s
/// `12: `, torchrun's `[rank3]:`, `[default3]:`) and the rank they name
/// (torchrun's, else srun's).
fn launcher_prefix(line: &str) -> (usize, Option<u64>) {
    let mut at = 0;
    let mut rank = None;
    let mut torchrun_rank = None;
    for _ in 0..3 {
        let rest = &line[at..];
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(0);
        if digits > 0 && rest[digits..].starts_with(": ") {
            rank = rest[..digits].parse().ok();
            at += digits + 2;
            continue;
        }
        if let Some(body) = rest.strip_prefix('[')
            && let Some(close) = body.find("]:")
        {
            let inner = &body[..close];
            let number_at = inner
                .find(|c: char| c.is_ascii_digit())
                .unwrap_or(inner.len());
            let (word, number) = inner.split_at(number_at);
            if !number.is_empty()
                && number.chars().all(|c| c.is_ascii_digit())
                && word.chars().all(|c| c.is_ascii_alphabetic() || c == '_')
            {
                torchrun_rank = number.parse().ok();
                at += 1 + close + 2;
                if line[at..].starts_with(' ') && !line[at..].starts_with("  ") {
                    at += 1;
                }
                continue;
            }
        }
        break;
    }
    (at, torchrun_rank.or(rank))
}

/// The stream a line belongs to: the text before torchtitan's `[titan]`
/// marker, or the launcher prefix of a line without one.
fn stream_prefix(line: &str) -> (&str, Option<u64>) {
    let (len, rank) = launcher_prefix(line);
    let prefix = match line.find("[titan]") {
        Some(at) if at >= len => &line[..at],
        _ => &line[..len],
    };
    (prefix, rank)
}

/// The step line in `line`, if it has one (`validate step:` lines do not
/// count). Fields of a line cut off (`complete` false) are taken only when
/// another field follows them.
fn step_line(line: &str, number: usize, complete: bool) -> Option<StepLine> {
    let mut from = 0;
    let start = loop {
        let at = from + line[from..].find("step:")?;
        let before = &line[..at];
        let word_start = before
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        if word_start && !before.trim_end().ends_with("validate") {
            break at;
        }
        from = at + "step:".len();
    };
    let body = &line[start..];
    // Two ranks' output run together on one line: no field can be trusted.
    let garbled = line.matches("[titan]").count() > 1 || body[5..].contains("step:");
    const KEYS: [&str; 7] = [
        "step:",
        "loss:",
        "grad_norm:",
        "memory:",
        "tps:",
        "tflops:",
        "mfu:",
    ];
    let mut found: Vec<(&str, usize)> = Vec::new();
    let mut pos = 0;
    for key in KEYS {
        if let Some(at) = body[pos..].find(key) {
            found.push((key, pos + at));
            pos += at + key.len();
        }
    }
    let mut parsed = StepLine {
        line: number,
        step: 0,
        loss: None,
        grad_norm: None,
        memory_gib: None,
        tps: None,
        tflops: None,
        mfu_percent: None,
        mfu_not_available: false,
    };
    let mut step = None;
    for (i, (key, at)) in found.iter().enumerate() {
        if garbled && *key != "step:" {
            break;
        }
        let value_start = at + key.len();
        let (value_end, closed) = match found.get(i + 1) {
            Some((_, next)) => (*next, true),
            None => (body.len(), complete),
        };
        if !closed {
            continue;
        }
        let value = body[value_start..value_end].trim();
        let real = || value.parse::<f64>().ok().filter(|v| v.is_finite());
        match *key {
            "step:" => step = value.parse::<u64>().ok(),
            "loss:" => parsed.loss = real(),
            "grad_norm:" => parsed.grad_norm = real(),
            "memory:" => {
                parsed.memory_gib = value
                    .split_once("GiB")
                    .and_then(|(gib, _)| gib.trim().parse::<f64>().ok())
                    .filter(|v| v.is_finite() && *v >= 0.0);
            }
            "tps:" => parsed.tps = thousands(value).filter(|v| *v > 0.0),
            "tflops:" => parsed.tflops = thousands(value).filter(|v| *v >= 0.0),
            "mfu:" => {
                if value == "N/A" {
                    parsed.mfu_not_available = true;
                } else {
                    parsed.mfu_percent = value
                        .strip_suffix('%')
                        .and_then(|v| v.trim().parse::<f64>().ok())
                        .filter(|v| v.is_finite() && *v >= 0.0);
                }
            }
            _ => {}
        }
    }
    parsed.step = step?;
    Some(parsed)
}

/// A number as Python's `{:,}` writes it (`5,123`, `1,234.56`); `None`
/// when the commas are not in thousands.
fn thousands(text: &str) -> Option<f64> {
    let (whole, fraction) = match text.split_once('.') {
        Some((w, f)) => (w, Some(f)),
        None => (text, None),
    };
    let groups: Vec<&str> = whole.split(',').collect();
    let first = groups.first()?;
    let grouped = !first.is_empty() && first.len() <= 3 && groups[1..].iter().all(|g| g.len() == 3)
        || groups.len() == 1 && !first.is_empty();
    let digits = groups.iter().all(|g| g.chars().all(|c| c.is_ascii_digit()));
    let fraction_ok =
        fraction.is_none_or(|f| !f.is_empty() && f.chars().all(|c| c.is_ascii_digit()));
    if !(grouped && digits && fraction_ok) {
        return None;
    }
    text.replace(',', "")
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite())
}

/// The whole number after `label` in `text` (up to a non-digit).
fn number_after(text: &str, label: &str) -> Option<u64> {
    let at = text.find(label)? + label.len();
    let rest = text[at..].trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn trainer_line(message: &str, number: usize) -> Option<TrainerLine> {
    let rest = &message[message.find("Trainer is initialized with")?..];
    // Numbers beyond any run (a garbled line) are not read.
    let count = |label: &str| number_after(rest, label).filter(|n| (1..=MAX_BATCH).contains(n));
    Some(TrainerLine {
        line: number,
        local_batch: count("local batch size ")?,
        global_batch: count("global batch size ")?,
        accumulation: count("gradient accumulation steps ")?,
        seq_len: count("sequence length ")?,
        total_steps: number_after(rest, "total steps "),
    })
}

/// `Building 2-D device mesh with ['dp_shard', 'tp'], [4, 2]`.
fn mesh_line(message: &str, number: usize) -> Option<MeshLine> {
    let at = message.find("-D device mesh with ")?;
    let rest = &message[at + "-D device mesh with ".len()..];
    let names_end = rest.find(']')?;
    let names: Vec<String> = rest[..names_end]
        .trim_start_matches('[')
        .split(',')
        .map(|n| n.trim().trim_matches(['\'', '"']).to_string())
        .filter(|n| !n.is_empty())
        .collect();
    let dims_text = rest[names_end + 1..].trim_start_matches([',', ' ']);
    let dims_end = dims_text.find(']')?;
    let dims: Vec<u64> = dims_text[..dims_end]
        .trim_start_matches('[')
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(str::parse)
        .collect::<std::result::Result<_, _>>()
        .ok()?;
    (names.len() == dims.len()).then(|| MeshLine {
        line: number,
        dims: names.into_iter().zip(dims).collect(),
    })
}

/// Model families torchtitan ships (0.2 and 0.3), for telling `Building
/// llama3 8B` from other `Building ...` messages.
const MODEL_FAMILIES: [&str; 11] = [
    "llama3",
    "llama4",
    "deepseek_v3",
    "qwen3",
    "qwen3_5",
    "gpt_oss",
    "flux",
    "kimi_k2_7",
    "muse_glimmer",
    "llama2",
    "llama3_ft",
];

/// Families whose models are mixtures of experts.
const MOE_FAMILIES: [&str; 4] = ["llama4", "deepseek_v3", "gpt_oss", "kimi_k2_7"];

fn building_line(message: &str, number: usize) -> Option<BuildingLine> {
    let at = message.find("Building ")?;
    let rest = message[at + "Building ".len()..].trim_end();
    if rest.contains("device mesh") {
        return None;
    }
    let (head, args) = match rest.split_once(" with ") {
        Some((head, args)) => (head, Some(args)),
        None => (rest, None),
    };
    let mut words = head.split_whitespace();
    let (name, flavor) = (words.next()?, words.next()?);
    let args = args.and_then(model_args);
    let model_like = args
        .as_ref()
        .is_some_and(|a| a.contains_key("dim") && a.contains_key("n_layers"));
    if words.next().is_some() || !(MODEL_FAMILIES.contains(&name) || model_like) {
        return None;
    }
    Some(BuildingLine {
        line: number,
        name: name.into(),
        flavor: flavor.into(),
        args,
    })
}

/// `TransformerModelArgs(dim=4096, n_layers=32, rope_scaling_args=X(...), ...)`
/// as `key -> value text` (top level only).
fn model_args(text: &str) -> Option<BTreeMap<String, String>> {
    let open = text.find('(')?;
    let body = &text[open + 1..];
    let mut out = BTreeMap::new();
    let mut depth = 0usize;
    let mut quote: Option<char> = None;
    let mut start = 0;
    let mut end = None;
    for (i, c) in body.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '(' | '[' | '{') => depth += 1,
            (None, ')' | ']' | '}') if depth == 0 => {
                end = Some(i);
                break;
            }
            (None, ')' | ']' | '}') => depth -= 1,
            (None, ',') if depth == 0 => {
                push_arg(&body[start..i], &mut out);
                start = i + 1;
            }
            _ => {}
        }
    }
    push_arg(&body[start..end?], &mut out);
    Some(out)
}

fn push_arg(piece: &str, out: &mut BTreeMap<String, String>) {
    if let Some((key, value)) = piece.split_once('=') {
        out.insert(key.trim().to_string(), value.trim().to_string());
    }
}

fn pipeline_line(message: &str, number: usize) -> Option<PipelineLine> {
    let at = message.find("Using pipeline schedule ")?;
    let rest = &message[at + "Using pipeline schedule ".len()..];
    let schedule = rest.split_whitespace().next()?.to_string();
    Some(PipelineLine {
        line: number,
        schedule,
        microbatches: number_after(rest, " with ")?,
        stages: number_after(rest, "microbatches and ")?,
    })
}

/// `Applied {mode} activation checkpointing to the model`.
fn applied_ac(message: &str) -> Option<String> {
    let at = message.find("Applied ")?;
    let rest = &message[at + "Applied ".len()..];
    let (mode, after) = rest.split_once(' ')?;
    after
        .starts_with("activation checkpointing")
        .then(|| mode.to_string())
}

/// Words of a shell command line, with quotes removed.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') => {
                if let Some(next) = chars.next() {
                    word.push(next);
                }
            }
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, '\\') => {
                if let Some(next) = chars.next() {
                    word.push(next);
                    in_word = true;
                }
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// Boolean fields that tyro takes as flags (`--compile.enable`, `--no-...`).
const FLAGS: [&str; 12] = [
    "compile.enable",
    "compile.enable_async_tensor_parallel",
    "parallelism.enable_async_tensor_parallel",
    "parallelism.enable_sequence_parallel",
    "parallelism.disable_loss_parallel",
    "training.disable_cuda_graphs",
    "training.enable_cpu_offload",
    "job.print_config",
    "debug.print_config",
    "metrics.disable_color_printing",
    "metrics.enable_tensorboard",
    "checkpoint.enable",
];

/// The torchrun or run_train.sh command line a log line holds, if any.
fn command_line(line: &str, number: usize) -> Option<CommandLine> {
    if line.contains("File \"") {
        return None;
    }
    let words = shell_words(line);
    let launcher = |w: &str| {
        let base = w.rsplit('/').next().unwrap_or(w);
        matches!(base, "torchrun" | "python" | "python3")
    };
    let train_at = words.iter().enumerate().find_map(|(i, w)| {
        let module = w == "torchtitan.train"
            && i > 0
            && words[i - 1] == "-m"
            && words[..i].iter().any(|w| launcher(w));
        let script = w.ends_with("torchtitan/train.py") && words[..i].iter().any(|w| launcher(w));
        let wrapper = w.ends_with("run_train.sh");
        (module || script || wrapper).then_some(i)
    })?;
    let mut command = CommandLine {
        line: number,
        ..CommandLine::default()
    };
    let origin = Origin::CommandLine(number);
    let before = &words[..train_at];
    let launcher_option = |names: &[&str]| -> Option<String> {
        before.iter().enumerate().find_map(|(i, w)| {
            names.iter().find_map(|name| {
                w.strip_prefix(&format!("{name}="))
                    .map(str::to_string)
                    .or_else(|| (w == name).then(|| before.get(i + 1).cloned()).flatten())
            })
        })
    };
    let env = |name: &str| -> Option<String> {
        before
            .iter()
            .find_map(|w| w.strip_prefix(&format!("{name}=")).map(str::to_string))
    };
    let nproc = launcher_option(&["--nproc_per_node", "--nproc-per-node"])
        .and_then(|n| n.parse::<u64>().ok());
    let nnodes = match launcher_option(&["--nnodes"]) {
        None => Some(1),
        Some(n) => n.parse::<u64>().ok(),
    };
    command.world = match (nproc, nnodes) {
        (Some(p), Some(n)) => p.checked_mul(n),
        _ => env("NGPU").and_then(|n| n.parse().ok()),
    };
    command.config_file = env("CONFIG_FILE");
    command.module = env("MODULE");
    command.function = env("CONFIG");
    let args = &words[train_at + 1..];
    let mut i = 0;
    while i < args.len() {
        let word = &args[i];
        i += 1;
        if let Some(mode) = word
            .strip_prefix("activation-checkpoint:")
            .or_else(|| word.strip_prefix("activation_checkpoint:"))
        {
            let mode = mode.replace('-', "_");
            command
                .settings
                .set("activation_checkpoint.mode", Value::Str(mode), &origin);
            continue;
        }
        let Some(option) = word.strip_prefix("--") else {
            continue;
        };
        let (name, inline) = match option.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (option, None),
        };
        let key = name.replace('-', "_");
        let takes_value = |next: Option<&String>| {
            next.filter(|n| {
                !n.starts_with("--")
                    && !n.contains("activation-checkpoint:")
                    && !n.contains("activation_checkpoint:")
            })
            .cloned()
        };
        match key.as_str() {
            "module" => {
                command.module = inline.or_else(|| takes_value(args.get(i)));
                i += usize::from(command.module.is_some() && !option.contains('='));
                continue;
            }
            "config" => {
                command.function = inline.or_else(|| takes_value(args.get(i)));
                i += usize::from(command.function.is_some() && !option.contains('='));
                continue;
            }
            "job.config_file" => {
                command.config_file = inline.or_else(|| takes_value(args.get(i)));
                i += usize::from(command.config_file.is_some() && !option.contains('='));
                continue;
            }
            "parallelism.module_fqns_per_model_part" => {
                let mut parts = Vec::new();
                if let Some(v) = inline {
                    parts.push(v);
                }
                while let Some(next) = takes_value(args.get(i)) {
                    parts.push(next);
                    i += 1;
                }
                let parts = parts
                    .iter()
                    .map(|p| p.split(',').map(|s| s.trim().to_string()).collect())
                    .collect();
                command.settings.set(&key, Value::Parts(parts), &origin);
                continue;
            }
            _ => {}
        }
        let negated = key.rsplit_once('.').and_then(|(section, field)| {
            field
                .strip_prefix("no_")
                .map(|f| format!("{section}.{f}"))
                .filter(|k| FLAGS.contains(&k.as_str()))
        });
        if let Some(flag) = negated {
            command.settings.set(&flag, Value::Bool(false), &origin);
            continue;
        }
        if FLAGS.contains(&key.as_str()) {
            let value = match inline {
                Some(v) => Value::Word(v),
                None => match args.get(i).map(|n| n.to_lowercase()) {
                    Some(n) if n == "true" || n == "false" => {
                        i += 1;
                        Value::Word(n)
                    }
                    _ => Value::Bool(true),
                },
            };
            command.settings.set(&key, value, &origin);
            continue;
        }
        let value = match inline {
            Some(v) => Some(v),
            None => {
                let next = takes_value(args.get(i));
                i += usize::from(next.is_some());
                next
            }
        };
        command
            .settings
            .set(&key, value.map_or(Value::Bool(true), Value::Word), &origin);
    }
    Some(command)
}

/// What paratune knows of the llama3 config functions of torchtitan 0.3.0
/// (`torchtitan/models/llama3/config_registry.py`: llama3_debugmodel
/// L34-70, llama3_8b L184-216, llama3_70b L257-292, llama3_405b L295-346),
/// for runs whose log holds their command line only.
fn function_settings(function: &str) -> Option<Settings> {
    let origin = Origin::Function(function.to_string());
    let (flavor, local, seq, tp, ac): (&str, i64, i64, i64, &str) = match function {
        "llama3_debugmodel" => ("debugmodel", 8, 2048, 1, "selective"),
        "llama3_8b" => ("8B", 1, 8192, 1, "selective"),
        "llama3_70b" => ("70B", 8, 8192, 8, "full"),
        "llama3_405b" => ("405B", 2, 8192, 8, "full"),
        _ => return None,
    };
    let mut s = Settings::default();
    s.set("model.name", Value::Str("llama3".into()), &origin);
    s.set("model.flavor", Value::Str(flavor.into()), &origin);
    s.set("training.local_batch_size", Value::Int(local), &origin);
    s.set("training.seq_len", Value::Int(seq), &origin);
    s.set(
        "parallelism.tensor_parallel_degree",
        Value::Int(tp),
        &origin,
    );
    s.set("activation_checkpoint.mode", Value::Str(ac.into()), &origin);
    if function == "llama3_debugmodel" {
        s.set(
            "parallelism.pipeline_parallel_schedule",
            Value::Str("Interleaved1F1B".into()),
            &origin,
        );
    }
    if function == "llama3_405b" {
        s.set(
            "model.converters",
            Value::List(vec!["float8".into()]),
            &origin,
        );
    }
    Some(s)
}

/// Whether a name (a converter, a config function) means quantised training.
fn quantised_name(name: &str) -> bool {
    let n = name.to_lowercase();
    ["float8", "fp8", "mxfp", "nvfp4", "fp4"]
        .iter()
        .any(|q| n.contains(q))
        || n == "mx"
        || n.ends_with(".mx")
}

/// State while a printed configuration's JSON is being collected.
struct Collecting {
    line: usize,
    prefix: String,
    text: String,
    depth: i64,
    in_string: bool,
    escaped: bool,
}

impl Collecting {
    /// Adds a piece of the JSON; true when its braces have closed.
    fn push(&mut self, piece: &str) -> bool {
        for c in piece.chars() {
            self.text.push(c);
            if self.in_string {
                match c {
                    _ if self.escaped => self.escaped = false,
                    '\\' => self.escaped = true,
                    '"' => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        return true;
                    }
                }
                _ => {}
            }
        }
        self.text.push('\n');
        false
    }

    fn finish(&self) -> std::result::Result<Settings, String> {
        let json: serde_json::Value =
            serde_json::from_str(&self.text).map_err(|e| e.to_string())?;
        let origin = Origin::Printed(self.line);
        let mut settings = Settings::default();
        flatten_json(&json, "", &origin, &mut settings);
        Ok(settings)
    }
}

fn scan(text: &str) -> Scan {
    let mut scan = Scan::default();
    let mut collecting: Option<Collecting> = None;
    for (index, raw) in text.split_inclusive('\n').enumerate() {
        let number = index + 1;
        let complete = raw.ends_with('\n');
        let clean = strip_ansi(raw.trim_end_matches(['\n', '\r']));
        let line = clean.as_ref();
        let (prefix, rank) = stream_prefix(line);
        if let Some(json) = collecting.as_mut() {
            let own = if json.prefix.is_empty() {
                launcher_prefix(line).0 == 0 && !line.contains("[titan]")
            } else {
                line.starts_with(&json.prefix) && !line.contains("[titan]")
            };
            if own {
                if json.push(&line[json.prefix.len()..]) {
                    scan.printed = Some((json.line, json.finish()));
                    collecting = None;
                } else if !complete {
                    scan.printed = Some((json.line, Err("the log ends inside it".into())));
                    collecting = None;
                }
                continue;
            }
            if prefix == json.prefix && line.contains("[titan]") {
                scan.printed = Some((json.line, Err(format!("line {number} interrupts it"))));
                collecting = None;
            }
        }
        if let Some(at) = line.find("Running with configs: ") {
            if scan.printed.is_some() || collecting.is_some() {
                if scan.streams.iter().any(|s| !s.steps.is_empty()) {
                    scan.notes.push(format!(
                        "line {number} prints a second configuration (a restarted run appended to the same log?); only the first run is read"
                    ));
                    break;
                }
                continue;
            }
            let mut json = Collecting {
                line: number,
                prefix: prefix.to_string(),
                text: String::new(),
                depth: 0,
                in_string: false,
                escaped: false,
            };
            if json.push(&line[at + "Running with configs: ".len()..]) {
                scan.printed = Some((number, json.finish()));
            } else {
                collecting = Some(json);
            }
            continue;
        }
        if let Some(step) = step_line(line, number, complete) {
            let stream = match scan.streams.iter().position(|s| s.prefix == prefix) {
                Some(i) => &mut scan.streams[i],
                None => {
                    scan.streams.push(Stream {
                        prefix: prefix.to_string(),
                        rank,
                        ..Stream::default()
                    });
                    scan.streams.last_mut().expect("just pushed")
                }
            };
            if !complete {
                scan.cut_off_last_line = true;
            } else if step.tps.is_none() {
                stream.unreadable.push(number);
            } else if !stream.seen.insert(step.step) {
                stream.repeated.push(step.step);
            } else {
                stream.steps.push(step);
            }
            continue;
        }
        if !complete && !line.trim().is_empty() {
            scan.cut_off_last_line = true;
            continue;
        }
        startup_line(line, number, &mut scan);
    }
    if let Some(json) = collecting {
        scan.printed = Some((json.line, Err("the log ends inside it".into())));
    }
    scan
}

fn startup_line(line: &str, number: usize, scan: &mut Scan) {
    if scan.version.is_none()
        && let Some(at) = line.find("torchtitan version: ")
    {
        let version = line[at + "torchtitan version: ".len()..]
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string();
        scan.version = Some((version, number));
    } else if let Some(found) = mesh_line(line, number) {
        scan.mesh.get_or_insert(found);
    } else if let Some(found) = trainer_line(line, number) {
        scan.trainer.get_or_insert(found);
    } else if let Some(found) = pipeline_line(line, number) {
        scan.pipeline.get_or_insert(found);
    } else if let Some(mode) = applied_ac(line) {
        scan.applied_ac.get_or_insert((mode, number));
    } else if let Some(found) = building_line(line, number) {
        scan.building.get_or_insert(found);
    } else if scan.command.is_none()
        && let Some(found) = command_line(line, number)
    {
        scan.command = Some(found);
    }
}

// ---------------------------------------------------------------------------
// The run.

/// What `--config`, `--model`, `--gpus` and `--warmup` give.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Logged steps left out of the steady state (step 1 always is).
    pub warmup: usize,
    pub config: Option<ConfigFile>,
    /// The model, instead of (or where the log cannot tell) the flavor's.
    pub model: Option<ModelSpec>,
    pub gpus: Option<u64>,
}

/// A torchtitan run as its log (and configuration) tell it.
#[derive(Debug, Clone)]
pub struct TorchtitanRun {
    pub release: Release,
    /// The model, its `seq_len` the run's.
    pub model: ModelSpec,
    /// `llama3 8B`, or where `--model` came from.
    pub model_label: String,
    pub config: ParallelConfig,
    /// Whether the ranks had expandable segments, as paratune's launch
    /// script recorded in the log; `None` where it did not, and `config`
    /// holds what torchtitan's `run_train.sh` sets (on).
    pub expandable_segments: Option<bool>,
    pub gpus: u64,
    pub global_batch: u64,
    /// `training.local_batch_size`.
    pub local_batch: u64,
    /// The layers of each pipeline rank as torchtitan splits them.
    pub rank_layers: Vec<u64>,
    /// The logging rank's step lines, in log order, the first of each step.
    pub steps: Vec<StepLine>,
    /// The launcher's rank of the lines read, when the lines have one.
    pub log_rank: Option<u64>,
    pub warmup: usize,
    /// Step lines in the steady state (after warm-up, never step 1).
    pub steady_steps: usize,
    /// Median and mean of the steady steps' times, from their `tps`: the
    /// median is the run's time (one stalled step moves it not at all).
    pub steady_median_ms: f64,
    pub steady_mean_ms: f64,
    pub tps_median: f64,
    pub tflops_per_gpu: Option<f64>,
    pub mfu_percent: Option<f64>,
    /// The largest `memory:` over the steady steps, GiB (peak reserved).
    pub peak_reserved_gib: Option<f64>,
    /// The rank the memory was read on, in the run table's terms; `None`
    /// when it is neither the first nor the last pipeline stage's.
    pub memory_rank: Option<MemoryRank>,
    pub last_step: u64,
    pub total_steps: Option<u64>,
    /// What was odd about the log but did not stop it being read, one sentence each.
    pub notes: Vec<String>,
}

/// Reads and parses a log file; see [`parse`].
pub fn read(path: &Path, options: &Options) -> Result<TorchtitanRun> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| TorchtitanLogError::Read {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    // Logs of killed jobs end inside characters; other tools write odd bytes.
    let text = String::from_utf8_lossy(&bytes);
    parse(&text, &shown, options)
}

/// Parses the text of a torchtitan log. `path` names it in errors.
pub fn parse(text: &str, path: &str, options: &Options) -> Result<TorchtitanRun> {
    if text.trim().is_empty() {
        return Err(TorchtitanLogError::Empty { path: path.into() });
    }
    let mut scan = scan(text);
    let mut notes = std::mem::take(&mut scan.notes);
    let stream = choose_stream(&scan, &mut notes)
        .ok_or(TorchtitanLogError::NoSteps { path: path.into() })?;
    if scan.cut_off_last_line {
        notes.push("the last line is cut off (the run was killed?); it is left out".into());
    }
    if !stream.unreadable.is_empty() {
        notes.push(format!(
            "{} step line(s) without a readable `tps` (line {}); left out of the steady state",
            stream.unreadable.len(),
            list(&stream.unreadable)
        ));
    }
    if !stream.repeated.is_empty() {
        notes.push(format!(
            "step(s) {} logged more than once; the first line of each is used",
            list(&stream.repeated)
        ));
    }
    let (settings, release) = gather_settings(&scan, options, path, &mut notes)?;
    let reader = Reader {
        settings: &settings,
        log: path,
    };
    let mut resolved = resolve(&scan, &reader, release, options, path, &mut notes)?;
    let recorded = super::allocator::recorded_in_log(text);
    if let Some(r) = &recorded {
        resolved.config.expandable_segments = r.expandable_segments;
        notes.extend(r.note.clone());
    }
    let mut run = finish(scan, stream, resolved, release, options.warmup, path, notes)?;
    run.expandable_segments = recorded.map(|r| r.expandable_segments);
    Ok(run)
}

/// The stream whose step lines are read: rank 0's when several ranks log,
/// else the one with the most step lines.
fn choose_stream(scan: &Scan, notes: &mut Vec<String>) -> Option<Stream> {
    let logging: Vec<&Stream> = scan
        .streams
        .iter()
        .filter(|s| !s.steps.is_empty())
        .collect();
    // torchrun's prefix is the local rank: under `srun -l` (`N: [rank0]:`)
    // node 0's comes first.
    let chosen = logging
        .iter()
        .filter(|s| s.rank == Some(0))
        .min_by(|a, b| a.prefix.cmp(&b.prefix))
        .or_else(|| logging.iter().max_by_key(|s| s.steps.len()))?;
    if logging.len() > 1 {
        notes.push(format!(
            "{} ranks log step lines; those of `{}` are read",
            logging.len(),
            chosen.prefix.trim()
        ));
    }
    Some((*chosen).clone())
}

/// Every configuration source, layered as torchtitan layers them (its
/// config function's settings, the TOML, the command line), the printed
/// configuration over all of them (it is what ran); and the release.
fn gather_settings(
    scan: &Scan,
    options: &Options,
    path: &str,
    notes: &mut Vec<String>,
) -> Result<(Settings, Release)> {
    let inconsistent = |message: String| TorchtitanLogError::Inconsistent {
        path: path.into(),
        message,
    };
    let mut evidence: Vec<(Release, String)> = Vec::new();
    if let Some((version, line)) = &scan.version {
        let mut parts = version.split('.').map(|p| p.parse::<u64>().ok());
        match (parts.next().flatten(), parts.next().flatten()) {
            (Some(0), Some(0)) | (None, _) | (_, None) => {}
            (Some(0), Some(minor)) if minor <= 2 => {
                evidence.push((
                    Release::V02,
                    format!("line {line} says torchtitan {version}"),
                ));
            }
            (Some(0), Some(3)) => {
                evidence.push((
                    Release::V03,
                    format!("line {line} says torchtitan {version}"),
                ));
            }
            _ => {
                notes.push(format!(
                    "line {line} says torchtitan {version}, newer than 0.3; it is read as 0.3"
                ));
                evidence.push((
                    Release::V03,
                    format!("line {line} says torchtitan {version}"),
                ));
            }
        }
    }
    let printed = match &scan.printed {
        None => None,
        Some((line, Ok(settings))) => {
            let mut settings = settings.clone();
            if let Some(release) = json_release(&settings) {
                evidence.push((release, format!("the printed config (line {line})")));
            }
            normalise_v03(&mut settings, &Origin::Printed(*line));
            Some(settings)
        }
        Some((line, Err(why))) => {
            notes.push(format!(
                "the configuration printed at line {line} cannot be read ({why}); it is left out"
            ));
            None
        }
    };
    if let Some(file) = &options.config
        && let Some(release) = file.release
    {
        evidence.push((
            release,
            match release {
                Release::V02 => format!("--config {} is a torchtitan 0.2 job config", file.path),
                Release::V03 => format!("--config {} is a torchtitan 0.3 configuration", file.path),
            },
        ));
    }
    if let Some(command) = &scan.command {
        if command.module.is_some() || command.function.is_some() {
            evidence.push((
                Release::V03,
                format!(
                    "the command line (line {}) gives --module/--config",
                    command.line
                ),
            ));
        }
        if command.config_file.is_some() {
            evidence.push((
                Release::V02,
                format!(
                    "the command line (line {}) gives a job config file",
                    command.line
                ),
            ));
        }
    }
    if let Some((mode, line)) = &scan.applied_ac
        && mode.ends_with("AC")
    {
        evidence.push((Release::V03, format!("line {line} says `Applied {mode}`")));
    }
    let release = match evidence.first() {
        Some((first, why)) => {
            if let Some((_, other)) = evidence.iter().find(|(r, _)| r != first) {
                return Err(inconsistent(format!(
                    "{why}, but {other}; give the log and --config of one run"
                )));
            }
            *first
        }
        None => Release::V02,
    };

    let mut settings = Settings::default();
    let command = scan.command.as_ref();
    if release == Release::V03
        && let Some(function) = command.and_then(|c| c.function.as_deref())
    {
        let known = function_settings(function);
        if let Some(defaults) = &known {
            settings.layer(defaults);
        }
        if printed.is_none() {
            notes.push(if known.is_some() {
                format!(
                    "the configuration is read from the command line: what it does not set is taken from torchtitan 0.3's defaults and config function {function} as paratune knows them (print the config with --debug.print_config to be sure)"
                )
            } else {
                format!(
                    "the configuration is read from the command line: what it does not set is taken from torchtitan 0.3's defaults, as paratune does not know what config function {function} sets (print the config with --debug.print_config to be sure)"
                )
            });
        }
    }
    if let Some(file) = &options.config {
        settings.layer(&file.settings);
    }
    if let Some(command) = command {
        if let Some(module) = &command.module {
            let name = module.rsplit('.').next().unwrap_or(module);
            if MODEL_FAMILIES.contains(&name) {
                settings.set(
                    "model.name",
                    Value::Str(name.into()),
                    &Origin::CommandLine(command.line),
                );
            }
        }
        settings.layer(&command.settings);
    }
    if let Some(printed) = &printed {
        for (key, (value, origin)) in &settings.map {
            if origin.explicit()
                && let Some((shown, _)) = printed.get(key)
                && shown.plain() != value.plain()
                && READ_KEYS.contains(&key.as_str())
            {
                notes.push(format!(
                    "`{key}` is {} in {} but {} in the printed config; the printed config (what ran) is used",
                    value.shown(),
                    origin.describe(path),
                    shown.shown()
                ));
            }
        }
        settings.layer(printed);
    }
    let sources = options.config.is_some() || printed.is_some() || command.is_some();
    if !sources {
        let hint = match &scan.printed {
            Some((line, Err(why))) => {
                format!(" (the configuration printed at line {line} cannot be read: {why})")
            }
            _ => String::new(),
        };
        return Err(TorchtitanLogError::NoConfig {
            path: path.into(),
            hint,
        });
    }
    if printed.is_none()
        && options.config.is_none()
        && release == Release::V02
        && let Some(file) = command.and_then(|c| c.config_file.as_deref())
    {
        notes.push(format!(
            "the command line names the job config {file}; without it (--config) only the command line's settings and torchtitan's defaults are known"
        ));
    }
    Ok((settings, release))
}

/// The keys [`resolve`] reads (differences in others are not worth a note).
const READ_KEYS: [&str; 30] = [
    "model.name",
    "model.flavor",
    "model.converters",
    "training.local_batch_size",
    "training.global_batch_size",
    "training.seq_len",
    "training.enable_cpu_offload",
    "training.dtype",
    "training.mixed_precision_param",
    "training.disable_cuda_graphs",
    "parallelism.data_parallel_replicate_degree",
    "parallelism.data_parallel_shard_degree",
    "parallelism.fsdp_reshard_after_forward",
    "parallelism.tensor_parallel_degree",
    "parallelism.enable_async_tensor_parallel",
    "parallelism.enable_sequence_parallel",
    "parallelism.pipeline_parallel_degree",
    "parallelism.module_fqns_per_model_part",
    "parallelism.pipeline_parallel_first_stage_less_layers",
    "parallelism.pipeline_parallel_last_stage_less_layers",
    "parallelism.pipeline_parallel_layers_per_stage",
    "parallelism.pipeline_parallel_schedule",
    "parallelism.pipeline_parallel_microbatch_size",
    "parallelism.context_parallel_degree",
    "parallelism.expert_parallel_degree",
    "activation_checkpoint.mode",
    "activation_checkpoint.selective_ac_option",
    "compile.enable",
    "compile.components",
    "compile.enable_async_tensor_parallel",
];

/// The run's configuration, resolved and checked.
struct Resolved {
    model: ModelSpec,
    model_label: String,
    config: ParallelConfig,
    gpus: u64,
    global_batch: u64,
    local_batch: u64,
    rank_layers: Vec<u64>,
    pp: u64,
}

struct Degrees {
    replicate: u64,
    shard: u64,
    tp: u64,
    pp: u64,
}

fn resolve(
    scan: &Scan,
    r: &Reader,
    release: Release,
    options: &Options,
    path: &str,
    notes: &mut Vec<String>,
) -> Result<Resolved> {
    let inconsistent = |message: String| TorchtitanLogError::Inconsistent {
        path: path.into(),
        message,
    };
    let unsupported = |feature: String, hint: &str| TorchtitanLogError::Unsupported {
        path: path.into(),
        feature,
        hint: hint.into(),
    };
    refuse_features(scan, r, path)?;
    let degrees = degrees(scan, r, options, path)?;
    let Degrees {
        replicate,
        shard,
        tp,
        pp,
    } = degrees;
    let gpus = replicate * shard * tp * pp;
    let dp = replicate * shard;

    // The batch.
    let mut local = r.count("training.local_batch_size", 8)?;
    let mut seq_len = r.count("training.seq_len", 2048)?;
    let global_setting = r.int("training.global_batch_size")?;
    let mut global = match global_setting {
        None => local * dp,
        Some(n) if n < 0 => local * dp,
        Some(n) if (1..=MAX_BATCH as i64).contains(&n) => n as u64,
        Some(_) => {
            let (value, origin) = r.settings.get("training.global_batch_size").expect("read");
            return Err(r.bad(
                "training.global_batch_size",
                value,
                origin,
                "-1 (local batch x dp) or a whole number of at least 1",
            ));
        }
    };
    if let Some(t) = &scan.trainer {
        let checks: [(&str, &mut u64, u64); 3] = [
            ("training.local_batch_size", &mut local, t.local_batch),
            ("training.seq_len", &mut seq_len, t.seq_len),
            ("training.global_batch_size", &mut global, t.global_batch),
        ];
        for (key, value, logged) in checks {
            let explicit = r.explicit(key)
                && !(key == "training.global_batch_size" && global_setting.is_none_or(|g| g < 0));
            if *value != logged {
                if explicit {
                    return Err(inconsistent(format!(
                        "`{key}` is {value} in {}, but line {} says {logged} (`Trainer is initialized with ...`); is the configuration from this run?",
                        r.origin(key).expect("explicit").describe(path),
                        t.line
                    )));
                }
                *value = logged;
            }
        }
    }
    if global > MAX_BATCH {
        return Err(inconsistent(format!(
            "the global batch is {global} sequences, more than paratune plans for ({MAX_BATCH})"
        )));
    }
    let per_step = local * dp;
    if !global.is_multiple_of(per_step) {
        return Err(inconsistent(format!(
            "training.global_batch_size {global} is not a multiple of local_batch_size x data-parallel degree = {local} x {dp} (torchtitan refuses it); is the configuration from this run?"
        )));
    }
    if let Some(t) = &scan.trainer
        && t.accumulation != global / per_step
    {
        return Err(inconsistent(format!(
            "line {} says {} gradient accumulation step(s), but the configuration makes {} ({global} / ({local} x dp {dp})); is the configuration from this run?",
            t.line,
            t.accumulation,
            global / per_step
        )));
    }

    // The pipeline.
    let microbatch = r.count("parallelism.pipeline_parallel_microbatch_size", 1)?;
    let micro_batch = if pp > 1 {
        if !local.is_multiple_of(microbatch) {
            return Err(inconsistent(format!(
                "training.local_batch_size {local} is not a multiple of parallelism.pipeline_parallel_microbatch_size {microbatch} (torchtitan refuses it)"
            )));
        }
        microbatch
    } else {
        local
    };

    let (mut model, model_label) = resolve_model(scan, r, release, options, path, notes)?;
    model.seq_len = seq_len;
    let (schedule, virtual_stages, rank_layers) = if pp > 1 {
        pipeline(scan, r, pp, model.layers, local / microbatch, path)?
    } else {
        (ScheduleKind::OneFOneB, 1, vec![model.layers])
    };

    let sharding = if dp == 1 || shard == 1 {
        OptimizerSharding::None
    } else {
        let policy = r
            .text("parallelism.fsdp_reshard_after_forward")?
            .unwrap_or_else(|| "default".into());
        match policy.as_str() {
            "always" => OptimizerSharding::Full,
            "never" => OptimizerSharding::OptimizerStates,
            "default" if pp > 1 => OptimizerSharding::OptimizerStates,
            "default" => OptimizerSharding::Full,
            _ => {
                let (value, origin) = r
                    .settings
                    .get("parallelism.fsdp_reshard_after_forward")
                    .expect("read");
                return Err(r.bad(
                    "parallelism.fsdp_reshard_after_forward",
                    value,
                    origin,
                    "default, always or never",
                ));
            }
        }
    };

    let (recompute, ac_frequency) = recompute_policy(scan, r, release, path)?;
    let components = r
        .list("compile.components")?
        .unwrap_or_else(|| vec!["model".into(), "loss".into()]);
    let compile = r.flag("compile.enable", false)? && components.iter().any(|c| c == "model");
    let async_tp = r.flag("compile.enable_async_tensor_parallel", false)?
        || r.flag("parallelism.enable_async_tensor_parallel", false)?;
    let sequence_parallel = tp > 1 && r.flag("parallelism.enable_sequence_parallel", true)?;
    if async_tp && tp > 1 && !compile {
        return Err(inconsistent(
            "asynchronous tensor parallelism is on without compiling the model, which torchtitan refuses (it needs compile.enable and `model` in compile.components); is the configuration from this run?".into(),
        ));
    }
    let tp_comm_overlap = async_tp && sequence_parallel && compile;
    let cuda_graphs = release == Release::V03 && !r.flag("training.disable_cuda_graphs", false)?;
    if cuda_graphs && pp > 1 {
        return Err(inconsistent(
            "torchtitan 0.3 captures CUDA graphs unless --training.disable_cuda_graphs, and refuses them with pipeline parallelism; the configuration has pp > 1 without it: is it from this run?".into(),
        ));
    }

    let mut config = ParallelConfig {
        tp,
        pp,
        dp,
        micro_batch,
        schedule,
        virtual_stages,
        recompute,
        sequence_parallel,
        optimizer_sharding: sharding,
        bpipe: false,
        attention: AttentionKind::Flash,
        overlap_grad_reduce: dp > 1,
        tp_comm_overlap,
        cuda_graphs: if cuda_graphs {
            crate::config::CudaGraphs::Layers
        } else {
            crate::config::CudaGraphs::Off
        },
        engine: crate::config::Engine::Torchtitan,
        // The log does not say; the allocator torchtitan's launcher sets.
        expandable_segments: crate::config::Engine::Torchtitan.launches_expandable_segments(),
        compile,
        ac_frequency,
        // HSDP: replicas of a shard group.
        dp_shard: (replicate > 1 && shard > 1).then_some(shard),
        // FSDP2's reduce dtype.
        grad_reduce: if r.text("training.mixed_precision_reduce")?.as_deref() == Some("bfloat16") {
            crate::config::GradReduce::Bf16
        } else {
            crate::config::GradReduce::Fp32
        },
        ..ParallelConfig::default()
    };
    if pp > 1 {
        split_layers(&mut config, &model, global, gpus, &rank_layers, notes)
            .map_err(|message| unsupported(message, "set the pipeline split (pipeline_parallel_first_stage_less_layers / _last_stage_less_layers, pipeline_parallel_layers_per_stage) so that the middle stages hold the same layers"))?;
    }
    model.check().map_err(inconsistent)?;
    config.check(&model, global, gpus, tp).map_err(|e| {
        inconsistent(format!(
            "the run's configuration ({config}) is not one paratune can describe: {e}"
        ))
    })?;
    Ok(Resolved {
        model,
        model_label,
        config,
        gpus,
        global_batch: global,
        local_batch: local,
        rank_layers,
        pp,
    })
}

/// Refuses what the run table cannot describe, before anything else is
/// derived: context and expert parallelism, mixtures of experts, quantised
/// training, CPU offload, other precisions, memory-budget checkpointing.
fn refuse_features(scan: &Scan, r: &Reader, path: &str) -> Result<()> {
    let unsupported = |feature: String, hint: &str| TorchtitanLogError::Unsupported {
        path: path.into(),
        feature,
        hint: hint.into(),
    };
    let mesh_degree = |name: &str| {
        scan.mesh
            .as_ref()
            .and_then(|m| m.dims.iter().find(|(n, _)| n == name).map(|(_, d)| *d))
    };
    let cp = r.count("parallelism.context_parallel_degree", 1)?;
    let cp = mesh_degree("cp").unwrap_or(1).max(cp);
    if cp > 1 {
        return Err(unsupported(
            format!("context parallelism (context_parallel_degree {cp})"),
            "log ingestion reads runs without context parallelism yet; write the run as a CSV row with its cp column (evaluate and calibrate read it)",
        ));
    }
    let ep = r.count("parallelism.expert_parallel_degree", 1)?;
    let mesh_ep = scan
        .mesh
        .as_ref()
        .is_some_and(|m| m.dims.iter().any(|(n, _)| n == "ep" || n.ends_with("_ep")));
    if ep > 1 || mesh_ep {
        return Err(unsupported(
            format!("expert parallelism (expert_parallel_degree {ep})"),
            "log ingestion reads dense runs yet; write the run as a CSV row with its num_experts, moe_topk, moe_ffn_hidden, ep and etp columns",
        ));
    }
    let name = r
        .text("model.name")?
        .or_else(|| scan.building.as_ref().map(|b| b.name.clone()));
    let moe_args = scan
        .building
        .as_ref()
        .and_then(|b| b.args.as_ref())
        .is_some_and(|a| a.keys().any(|k| k.contains("moe")) || a.get("num_experts").is_some());
    let moe_json = r.settings.map.keys().any(|k| {
        k.starts_with("model_spec.model.") && (k.contains(".moe") || k.contains("num_experts"))
    });
    let moe_family = name.as_deref().is_some_and(|n| MOE_FAMILIES.contains(&n));
    if moe_family || moe_args || moe_json {
        return Err(unsupported(
            format!(
                "a mixture of experts ({})",
                name.as_deref()
                    .unwrap_or("the model's arguments have MoE layers")
            ),
            "log ingestion reads dense runs yet; write the run as a CSV row with its num_experts, moe_topk, moe_ffn_hidden, ep and etp columns",
        ));
    }
    let converters = r.list("model.converters")?.unwrap_or_default();
    if let Some(c) = converters.iter().find(|c| quantised_name(c)) {
        return Err(unsupported(
            format!("quantised training (model.converters has `{c}`)"),
            "paratune models bf16 compute only; measure without the float8/MX converters",
        ));
    }
    if r.flag("float8.enable_float8_linear", false)? {
        return Err(unsupported(
            "float8 training (float8.enable_float8_linear)".into(),
            "paratune models bf16 compute only; measure without float8",
        ));
    }
    if let Some(function) = scan.command.as_ref().and_then(|c| c.function.as_deref())
        && quantised_name(function)
    {
        return Err(unsupported(
            format!("quantised training (config function {function})"),
            "paratune models bf16 compute only; measure with a config function without float8/MX/NVFP4 converters",
        ));
    }
    let quantised_spec = r.settings.map.iter().any(|(k, (v, _))| {
        k.starts_with("model_spec.") && (quantised_name(k) || quantised_name(&v.shown()))
    });
    if quantised_spec {
        return Err(unsupported(
            "quantised training (the printed model spec has float8/MX converters)".into(),
            "paratune models bf16 compute only; measure without the converters",
        ));
    }
    if r.flag("training.enable_cpu_offload", false)? {
        return Err(unsupported(
            "FSDP CPU offload (training.enable_cpu_offload)".into(),
            "paratune keeps parameters, gradients and optimizer states on the GPU; measure without CPU offload",
        ));
    }
    if r.text("training.dtype")?.as_deref() == Some("bfloat16") {
        return Err(unsupported(
            "bf16 parameters and optimizer states (training.dtype = bfloat16)".into(),
            "paratune's torchtitan engine keeps fp32 parameters and optimizer states with bf16 compute (training.dtype = float32, the default)",
        ));
    }
    if r.text("training.mixed_precision_param")?.as_deref() == Some("float32") {
        return Err(unsupported(
            "fp32 compute (training.mixed_precision_param = float32)".into(),
            "paratune models bf16 compute (mixed_precision_param = bfloat16, the default)",
        ));
    }
    let mode = r
        .text("activation_checkpoint.mode")?
        .or_else(|| scan.applied_ac.as_ref().map(|(m, _)| m.clone()));
    if mode.as_deref().is_some_and(|m| {
        let m = m.to_lowercase().replace('-', "_");
        m == "memory_budget" || m == "memorybudgetac"
    }) {
        return Err(unsupported(
            "memory-budget activation checkpointing".into(),
            "paratune models none, full, per-op selective and per-layer selective checkpointing; measure with one of them",
        ));
    }
    Ok(())
}

/// The parallel degrees, with the GPU count from wherever the log or the
/// flags give it, checked against each other.
fn degrees(scan: &Scan, r: &Reader, options: &Options, path: &str) -> Result<Degrees> {
    let inconsistent = |message: String| TorchtitanLogError::Inconsistent {
        path: path.into(),
        message,
    };
    let replicate = r.count("parallelism.data_parallel_replicate_degree", 1)?;
    let tp = r.count("parallelism.tensor_parallel_degree", 1)?;
    let pp = r.count("parallelism.pipeline_parallel_degree", 1)?;
    let cp = r.count("parallelism.context_parallel_degree", 1)?;
    let shard_key = "parallelism.data_parallel_shard_degree";
    let mut shard = match r.int(shard_key)? {
        None | Some(-1) => None,
        Some(n) if (1..=1 << 20).contains(&n) => Some(n as u64),
        Some(_) => {
            let (value, origin) = r.settings.get(shard_key).expect("read");
            return Err(r.bad(
                shard_key,
                value,
                origin,
                "-1 (the ranks left over) or a whole number of at least 1",
            ));
        }
    };
    let others = [tp, pp, cp]
        .iter()
        .try_fold(replicate, |a, &b| a.checked_mul(b))
        .filter(|&n| n <= MAX_GPUS)
        .ok_or_else(|| {
            inconsistent(format!(
                "the parallel degrees (replicate {replicate} x tp {tp} x pp {pp} x cp {cp}) make more than {MAX_GPUS} GPUs"
            ))
        })?;
    if let Some(mesh) = &scan.mesh {
        let named = |name: &str| mesh.dims.iter().find(|(n, _)| n == name).map(|(_, d)| *d);
        for (name, key, value) in [
            ("tp", "parallelism.tensor_parallel_degree", tp),
            ("pp", "parallelism.pipeline_parallel_degree", pp),
            (
                "dp_replicate",
                "parallelism.data_parallel_replicate_degree",
                replicate,
            ),
        ] {
            let logged = named(name).unwrap_or(1);
            if logged != value {
                return Err(inconsistent(format!(
                    "the device mesh (line {}) has {name} {logged}, but `{key}` is {value}; is the configuration from this run?",
                    mesh.line
                )));
            }
        }
        let logged = named("dp_shard").unwrap_or(1);
        match shard {
            Some(s) if s != logged => {
                return Err(inconsistent(format!(
                    "the device mesh (line {}) has dp_shard {logged}, but `{shard_key}` is {s}; is the configuration from this run?",
                    mesh.line
                )));
            }
            _ => shard = Some(logged),
        }
    }
    // The data-parallel degree the trainer reports: global / (local x accumulation).
    let trainer_dp = scan.trainer.as_ref().and_then(|t| {
        let per = t.local_batch.saturating_mul(t.accumulation);
        (per > 0 && t.global_batch.is_multiple_of(per)).then(|| (t.global_batch / per, t.line))
    });
    let mut worlds: Vec<(u64, String)> = Vec::new();
    if let Some(n) = options.gpus {
        worlds.push((n, "--gpus".into()));
    }
    if let Some(mesh) = &scan.mesh {
        worlds.push((
            mesh.dims
                .iter()
                .try_fold(1u64, |a, (_, d)| a.checked_mul(*d))
                .unwrap_or(u64::MAX),
            format!("the device mesh (line {})", mesh.line),
        ));
    }
    if let Some(command) = &scan.command
        && let Some(n) = command.world
    {
        worlds.push((n, format!("the command line (line {})", command.line)));
    }
    let shard = match shard {
        Some(s) => s,
        None => {
            if let Some((dp, line)) = trainer_dp {
                if !dp.is_multiple_of(replicate) {
                    return Err(inconsistent(format!(
                        "line {line} implies a data-parallel degree of {dp}, not a multiple of data_parallel_replicate_degree {replicate}"
                    )));
                }
                dp / replicate
            } else if let Some((world, source)) = worlds.first() {
                if !world.is_multiple_of(others) || *world < others {
                    return Err(inconsistent(format!(
                        "{source} gives {world} GPUs, which data_parallel_replicate x tensor x pipeline x context parallel degrees {replicate} x {tp} x {pp} x {cp} do not divide"
                    )));
                }
                world / others
            } else {
                return Err(TorchtitanLogError::NeedGpus { path: path.into() });
            }
        }
    };
    let gpus = others.saturating_mul(shard);
    if gpus > MAX_GPUS {
        return Err(inconsistent(format!(
            "the parallel degrees make {gpus} GPUs, more than {MAX_GPUS}"
        )));
    }
    for (world, source) in &worlds {
        if *world != gpus {
            return Err(inconsistent(format!(
                "the parallel degrees (replicate {replicate} x shard {shard} x tp {tp} x pp {pp} x cp {cp}) make {gpus} GPUs, but {source} gives {world}; is the configuration from this run?"
            )));
        }
    }
    if let Some((dp, line)) = trainer_dp
        && dp != replicate * shard
    {
        return Err(inconsistent(format!(
            "the configuration has a data-parallel degree of {}, but line {line} implies {dp} (global batch / (local batch x accumulation steps)); is the configuration from this run?",
            replicate * shard
        )));
    }
    Ok(Degrees {
        replicate,
        shard,
        tp,
        pp,
    })
}

/// `compute_ffn_hidden_dim` of torchtitan's llama3 (`FeedForward` in
/// `torchtitan/models/llama3/model/model.py`, 0.2; `models/common`, 0.3):
/// 2/3 of 4 x dim, times the multiplier, rounded up to `multiple_of`.
fn llama_ffn(dim: u64, multiple_of: u64, multiplier: Option<f64>) -> u64 {
    let mut hidden = (2.0 * (4 * dim) as f64 / 3.0) as u64;
    if let Some(m) = multiplier {
        hidden = (m * hidden as f64) as u64;
    }
    let multiple_of = multiple_of.max(1);
    hidden.div_ceil(multiple_of) * multiple_of
}

fn llama_spec(
    name: String,
    dim: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    ffn: u64,
    vocab: u64,
) -> ModelSpec {
    ModelSpec {
        name,
        hidden: dim,
        heads,
        kv_heads,
        ffn_hidden: ffn,
        gated_mlp: true,
        layers,
        vocab,
        seq_len: 2048,
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
        rotary_base: crate::model::DEFAULT_ROTARY_BASE,
        rope_scaling: None,
        norm_epsilon: crate::model::DEFAULT_NORM_EPSILON,
    }
}

/// torchtitan's llama3 flavors in paratune's terms: `llama3_configs` of
/// `torchtitan/models/llama3/__init__.py` (pytorch/torchtitan at 00f555e;
/// 0.2's `llama3_args` have the same shapes), the vocabulary
/// `TransformerModelArgs`'s default 128256 (`model/args.py` at 0803909)
/// unless the flavor sets one. 8B, 70B and 405B are paratune's catalogue
/// models llama3-8b, llama3-70b and llama3-405b.
pub(crate) fn llama3_flavor(flavor: &str) -> Option<ModelSpec> {
    // `8B_flex`, `debugmodel_varlen_attn`: the same shapes, another attention kernel.
    let base = ["_flex", "_varlen"]
        .iter()
        .find_map(|s| flavor.find(s).map(|at| &flavor[..at]))
        .unwrap_or(flavor);
    match base {
        "debugmodel" => Some(llama_spec(
            "llama3-debugmodel".into(),
            256,
            6,
            16,
            16,
            llama_ffn(256, 256, None),
            2048,
        )),
        // 8B, 70B and 405B, as the export names them; else a flavor that
        // paratune's own export wrote (`flavor = "llama3-8b"`).
        other => crate::export::catalogue_model_of("llama3", other)
            .or_else(|| builtin_model(other).filter(|m| m.name.starts_with("llama3"))),
    }
}

/// The model: `--model`, else the log's model arguments (0.2's `Building
/// ... with Args(...)`, 0.3's printed `model_spec.model`), else the flavor.
fn resolve_model(
    scan: &Scan,
    r: &Reader,
    release: Release,
    options: &Options,
    path: &str,
    notes: &mut Vec<String>,
) -> Result<(ModelSpec, String)> {
    let inconsistent = |message: String| TorchtitanLogError::Inconsistent {
        path: path.into(),
        message,
    };
    let default_name = (release == Release::V02).then_some("llama3");
    let default_flavor = (release == Release::V02).then_some("debugmodel");
    let mut name = r.text("model.name")?;
    let mut flavor = r.text("model.flavor")?;
    if let Some(b) = &scan.building {
        for (key, value, logged) in [
            ("model.name", &mut name, &b.name),
            ("model.flavor", &mut flavor, &b.flavor),
        ] {
            match value {
                Some(v) if v != logged && r.explicit(key) => {
                    return Err(inconsistent(format!(
                        "`{key}` is `{v}` in {}, but line {} builds {} {}; is the configuration from this run?",
                        r.origin(key).expect("explicit").describe(path),
                        b.line,
                        b.name,
                        b.flavor
                    )));
                }
                _ => *value = Some(logged.clone()),
            }
        }
    }
    let name = name.or(default_name.map(str::to_string));
    let flavor = flavor.or(default_flavor.map(str::to_string));
    let label = format!(
        "{} {}",
        name.as_deref().unwrap_or("?"),
        flavor.as_deref().unwrap_or("?")
    );
    let from_log = log_model(scan, r, name.as_deref(), flavor.as_deref())?;
    if let Some(given) = &options.model {
        if let Some(logged) = &from_log
            && (
                logged.hidden,
                logged.layers,
                logged.heads,
                logged.kv_heads,
                logged.ffn_hidden,
                logged.vocab,
            ) != (
                given.hidden,
                given.layers,
                given.heads,
                given.kv_heads,
                given.ffn_hidden,
                given.vocab,
            )
        {
            notes.push(format!(
                "--model {} differs from the model the log describes ({label}: L{} h{} a{} kv{} ffn{} V{}); --model is used",
                given.name, logged.layers, logged.hidden, logged.heads, logged.kv_heads, logged.ffn_hidden, logged.vocab
            ));
        }
        return Ok((given.clone(), format!("--model {}", given.name)));
    }
    match from_log {
        Some(model) => Ok((model, label)),
        None => Err(TorchtitanLogError::UnknownModel {
            path: path.into(),
            message: match (&name, &flavor) {
                (Some(n), Some(f)) => format!(
                    "torchtitan model {n} flavor `{f}` is not one paratune knows (it knows llama3 debugmodel, {}), and the log does not print its dimensions; give the model with --model",
                    crate::export::known_torchtitan_models()
                ),
                _ => "the log and configuration do not say which model ran (model.name and model.flavor, or a `Building <model> <flavor>` line)".into(),
            },
        }),
    }
}

/// The model as the log's own lines describe it, if they do.
fn log_model(
    scan: &Scan,
    r: &Reader,
    name: Option<&str>,
    flavor: Option<&str>,
) -> Result<Option<ModelSpec>> {
    let family = name.unwrap_or("llama3");
    if family != "llama3" {
        // Another model torchtitan ships, as paratune's export names it.
        return Ok(flavor.and_then(|f| crate::export::catalogue_model_of(family, f)));
    }
    let shown = format!("llama3-{}", flavor.unwrap_or("model"));
    // 0.2: `Building llama3 8B with TransformerModelArgs(dim=4096, ...)`.
    if let Some(args) = scan.building.as_ref().and_then(|b| b.args.as_ref()) {
        let int = |k: &str| {
            args.get(k)
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|v| *v > 0)
        };
        if let (Some(dim), Some(layers), Some(heads)) =
            (int("dim"), int("n_layers"), int("n_heads"))
        {
            let kv = int("n_kv_heads").unwrap_or(heads);
            let multiplier = args
                .get("ffn_dim_multiplier")
                .and_then(|v| v.parse::<f64>().ok());
            let ffn = llama_ffn(dim, int("multiple_of").unwrap_or(256), multiplier);
            let vocab = int("vocab_size").unwrap_or(128_256);
            let spec = llama_spec(shown.clone(), dim, layers, heads, kv, ffn, vocab);
            return Ok(Some(named_like_catalogue(spec)));
        }
    }
    // 0.3: the printed `model_spec.model`.
    let int = |k: &str| -> Result<Option<u64>> {
        Ok(r.int(&format!("model_spec.model.{k}"))?
            .filter(|v| *v > 0)
            .map(|v| v as u64))
    };
    if let (Some(dim), Some(layers), Some(heads), Some(ffn), Some(vocab)) = (
        int("dim")?,
        int("n_layers")?,
        int("layer.attention.n_heads")?,
        int("layer.feed_forward.hidden_dim")?,
        int("vocab_size")?,
    ) {
        let kv = int("layer.attention.n_kv_heads")?.unwrap_or(heads);
        let spec = llama_spec(shown, dim, layers, heads, kv, ffn, vocab);
        return Ok(Some(named_like_catalogue(spec)));
    }
    Ok(flavor.and_then(llama3_flavor))
}

/// A model with a catalogue model's shape takes its name.
fn named_like_catalogue(spec: ModelSpec) -> ModelSpec {
    for name in ["llama3-8b", "llama3-70b", "llama3-405b"] {
        if let Some(m) = builtin_model(name)
            && (
                m.hidden,
                m.layers,
                m.heads,
                m.kv_heads,
                m.ffn_hidden,
                m.vocab,
            ) == (
                spec.hidden,
                spec.layers,
                spec.heads,
                spec.kv_heads,
                spec.ffn_hidden,
                spec.vocab,
            )
        {
            return m;
        }
    }
    spec
}

/// The schedule, model chunks per rank and layers per rank of a pipeline.
fn pipeline(
    scan: &Scan,
    r: &Reader,
    pp: u64,
    layers: u64,
    microbatches: u64,
    path: &str,
) -> Result<(ScheduleKind, u64, Vec<u64>)> {
    let inconsistent = |message: String| TorchtitanLogError::Inconsistent {
        path: path.into(),
        message,
    };
    let unsupported = |feature: String, hint: &str| TorchtitanLogError::Unsupported {
        path: path.into(),
        feature,
        hint: hint.into(),
    };
    let key = "parallelism.pipeline_parallel_schedule";
    let name = r.text(key)?.unwrap_or_else(|| "1F1B".into());
    if let Some(csv) = r.text("parallelism.pipeline_parallel_schedule_csv")?
        && !csv.is_empty()
    {
        return Err(unsupported(
            format!("a pipeline schedule from a CSV file ({csv})"),
            "paratune models the 1F1B, GPipe and Interleaved1F1B schedules; measure with one of them",
        ));
    }
    let (schedule, multi) = match name.to_lowercase().as_str() {
        "1f1b" => (ScheduleKind::OneFOneB, false),
        "gpipe" => (ScheduleKind::Gpipe, false),
        "interleaved1f1b" => (ScheduleKind::Interleaved, true),
        "loopedbfs" | "interleavedzerobubble" | "zbvzerobubble" | "dualpipev" => {
            return Err(unsupported(
                format!("the pipeline schedule {name}"),
                "paratune models the 1F1B, GPipe and Interleaved1F1B schedules; measure with one of them",
            ));
        }
        _ => {
            let (value, origin) = r.settings.get(key).expect("a name other than the default");
            return Err(r.bad(
                key,
                value,
                origin,
                "a schedule of torch.distributed.pipelining (1F1B, GPipe, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)",
            ));
        }
    };
    let first_less = r
        .int("parallelism.pipeline_parallel_first_stage_less_layers")?
        .unwrap_or(1);
    let last_less = r
        .int("parallelism.pipeline_parallel_last_stage_less_layers")?
        .unwrap_or(1);
    if !(0..=1 << 16).contains(&first_less) || !(0..=1 << 16).contains(&last_less) {
        return Err(inconsistent(
            "pipeline_parallel_first_stage_less_layers and _last_stage_less_layers must be 0 or more (a few layers at most)".into(),
        ));
    }
    let (first_less, last_less) = (first_less as u64, last_less as u64);
    let stage_layers: Vec<u64> = match r.parts("parallelism.module_fqns_per_model_part")? {
        Some(parts) => {
            let counts: Vec<u64> = parts
                .iter()
                .map(|part| part.iter().filter(|m| m.starts_with("layers.")).count() as u64)
                .collect();
            let total: u64 = counts.iter().sum();
            if total != layers {
                return Err(inconsistent(format!(
                    "parallelism.module_fqns_per_model_part places {total} layers, but the model has {layers}"
                )));
            }
            counts
        }
        None => {
            let stages = match r.int("parallelism.pipeline_parallel_layers_per_stage")? {
                Some(per) if per >= 1 => (layers + first_less + last_less).div_ceil(per as u64),
                Some(_) => {
                    return Err(inconsistent(
                        "pipeline_parallel_layers_per_stage must be at least 1".into(),
                    ));
                }
                None => pp * if multi { 2 } else { 1 },
            };
            split_stages(layers, stages, first_less, last_less).map_err(inconsistent)?
        }
    };
    let stages = stage_layers.len() as u64;
    if !stages.is_multiple_of(pp) {
        return Err(inconsistent(format!(
            "the pipeline has {stages} stages, which pipeline_parallel_degree {pp} does not divide (torchtitan refuses it)"
        )));
    }
    let v = stages / pp;
    if !multi && v != 1 {
        return Err(inconsistent(format!(
            "{name} runs one stage per pipeline rank, but the split makes {v}"
        )));
    }
    if multi && v < 2 {
        return Err(inconsistent(format!(
            "{name} runs several stages per pipeline rank, but the split makes one"
        )));
    }
    if let Some(line) = &scan.pipeline
        && (line.stages != stages
            || line.microbatches != microbatches
            || !line.schedule.eq_ignore_ascii_case(&name))
    {
        return Err(inconsistent(format!(
            "line {} uses pipeline schedule {} with {} microbatches and {} stages, but the configuration makes {name} with {microbatches} and {stages}; is the configuration from this run?",
            line.line, line.schedule, line.microbatches, line.stages
        )));
    }
    let mut ranks = vec![0; pp as usize];
    for (s, n) in stage_layers.iter().enumerate() {
        ranks[s % pp as usize] += n;
    }
    Ok((schedule, v, ranks))
}

/// `_generate_llm_fqn_per_model_part`: the transformer layers of each of
/// `stages` stages, the embedding and head counting as `first_less` and
/// `last_less` layers, the remainder to the earliest stages.
fn split_stages(
    layers: u64,
    stages: u64,
    first_less: u64,
    last_less: u64,
) -> std::result::Result<Vec<u64>, String> {
    let effective = layers + first_less + last_less;
    let per = effective / stages.max(1);
    let extra = effective % stages.max(1);
    if per == 0 || first_less > per || last_less > per {
        return Err(format!(
            "{layers} layers (with the embedding and head counted as {first_less} and {last_less}) cannot be split over {stages} pipeline stages (torchtitan refuses it)"
        ));
    }
    Ok((0..stages)
        .map(|s| {
            let own = per + u64::from(s < extra);
            if s == 0 {
                own - first_less
            } else if s == stages - 1 {
                own - last_less
            } else {
                own
            }
        })
        .collect())
}

/// Sets the end stages' layers of `config` to describe torchtitan's split
/// (`rank_layers`), exactly where paratune's stages can (equal middle
/// stages), else as near as they can (the first stage exact, where memory
/// is read), with a note.
fn split_layers(
    config: &mut ParallelConfig,
    model: &ModelSpec,
    global: u64,
    gpus: u64,
    rank_layers: &[u64],
    notes: &mut Vec<String>,
) -> std::result::Result<(), String> {
    let pp = rank_layers.len();
    let first = rank_layers[0];
    let last = rank_layers[pp - 1];
    let middle = rank_layers.get(1).copied().filter(|_| pp > 2);
    let candidates = [
        (
            (middle != Some(first) && !(pp == 2 && first == last)).then_some(first),
            (middle != Some(last) && !(pp == 2 && first == last)).then_some(last),
        ),
        (Some(first), Some(last)),
        (Some(first), None),
        (None, None),
    ];
    let split_rules = [
        Rule::LayersNotDivisible,
        Rule::UnevenSplit,
        Rule::UnevenWithoutPipeline,
    ];
    for (first_stage, last_stage) in candidates {
        let mut c = *config;
        c.first_stage_layers = first_stage;
        c.last_stage_layers = last_stage;
        if c.violation(model, global, gpus, c.tp)
            .is_some_and(|rule| split_rules.contains(&rule))
        {
            continue;
        }
        let described: Vec<u64> = (0..pp as u64)
            .map(|s| c.stage_layers(model.layers, s))
            .collect();
        if described != rank_layers {
            notes.push(format!(
                "torchtitan splits the {} layers over the {pp} pipeline ranks as {rank_layers:?} (the embedding and the head count as layers: pipeline_parallel_first/last_stage_less_layers); paratune's stages have equal middle stages, so the row describes {described:?}",
                model.layers
            ));
        }
        *config = c;
        return Ok(());
    }
    Err(format!(
        "a pipeline split paratune cannot describe ({rank_layers:?} layers per rank)"
    ))
}

/// The recomputation policy and, for per-layer checkpointing, its frequency.
fn recompute_policy(
    scan: &Scan,
    r: &Reader,
    release: Release,
    path: &str,
) -> Result<(Recompute, u64)> {
    let key = "activation_checkpoint.mode";
    let mut mode = r
        .text(key)?
        .unwrap_or_else(|| "selective".into())
        .to_lowercase()
        .replace('-', "_");
    if let Some((applied, line)) = &scan.applied_ac {
        let logged = match applied.as_str() {
            "SelectiveAC" | "selective" => "selective",
            "FullAC" | "full" => "full",
            other => other,
        };
        if logged != mode {
            if r.explicit(key) {
                return Err(TorchtitanLogError::Inconsistent {
                    path: path.into(),
                    message: format!(
                        "`{key}` is {mode} in {}, but line {line} applies {applied} activation checkpointing; is the configuration from this run?",
                        r.origin(key).expect("explicit").describe(path)
                    ),
                });
            }
            mode = logged.to_string();
        }
    }
    match mode.as_str() {
        "none" => Ok((Recompute::None, 2)),
        "full" => Ok((Recompute::Full, 2)),
        "selective" if release == Release::V03 => Ok((Recompute::SelectiveOp, 2)),
        "selective" => {
            let option_key = "activation_checkpoint.selective_ac_option";
            let option = r.text(option_key)?.unwrap_or_else(|| "2".into());
            if option == "op" {
                return Ok((Recompute::SelectiveOp, 2));
            }
            match option.parse::<u64>() {
                // `if not ac_freq or _layer_sac_count % ac_freq == 0`: 0 and 1 wrap every block.
                Ok(n) if n <= 1 << 16 => Ok((Recompute::SelectiveLayer, n.max(1))),
                _ => {
                    let (value, origin) = r.settings.get(option_key).expect("read");
                    Err(r.bad(
                        option_key,
                        value,
                        origin,
                        "\"op\" or a whole number (checkpoint every N-th layer)",
                    ))
                }
            }
        }
        _ => match r.settings.get(key) {
            Some((value, origin)) => Err(r.bad(key, value, origin, "none, selective or full")),
            None => Err(TorchtitanLogError::Inconsistent {
                path: path.into(),
                message: format!(
                    "the log applies `{mode}` activation checkpointing, which paratune does not know"
                ),
            }),
        },
    }
}

fn finish(
    scan: Scan,
    stream: Stream,
    resolved: Resolved,
    release: Release,
    warmup: usize,
    path: &str,
    mut notes: Vec<String>,
) -> Result<TorchtitanRun> {
    let steps = stream.steps;
    let steady: Vec<&StepLine> = steps.iter().skip(warmup).filter(|s| s.step != 1).collect();
    if steady.is_empty() {
        return Err(TorchtitanLogError::NoSteadySteps {
            path: path.into(),
            warmup,
            logged: steps.len(),
        });
    }
    if steady.iter().any(|s| s.mfu_not_available) {
        return Err(TorchtitanLogError::Unsupported {
            path: path.into(),
            feature: "quantised training (the step lines print `mfu: N/A`, as torchtitan does when float8/MX/NVFP4 converters are active)".into(),
            hint: "paratune models bf16 compute only; measure without the converters".into(),
        });
    }
    let tokens = (resolved.global_batch * resolved.model.seq_len) as f64;
    let gpus = resolved.gpus as f64;
    let times: Vec<f64> = steady
        .iter()
        .filter_map(|s| s.tps)
        .map(|tps| tokens / (tps * gpus) * 1e3)
        .collect();
    let steady_mean_ms = times.iter().sum::<f64>() / times.len() as f64;
    let steady_median_ms = median(&times);
    let outliers = times
        .iter()
        .filter(|&&t| t > OUTLIER_FACTOR * steady_median_ms)
        .count();
    if outliers > 0 {
        notes.push(format!(
            "{outliers} steady step line(s) took more than {OUTLIER_FACTOR}x the median ({steady_median_ms:.1} ms a step); the run's time is the median, which they do not move"
        ));
    }
    let tps: Vec<f64> = steady.iter().filter_map(|s| s.tps).collect();
    let optional_median = |values: Vec<f64>| (!values.is_empty()).then(|| median(&values));
    let tflops_per_gpu = optional_median(steady.iter().filter_map(|s| s.tflops).collect());
    let mfu_percent = optional_median(steady.iter().filter_map(|s| s.mfu_percent).collect());
    let mut peak_reserved_gib = steady.iter().filter_map(|s| s.memory_gib).reduce(f64::max);
    if peak_reserved_gib.is_none() {
        notes.push(
            "no steady step line has a readable `memory:` field; the peak memory is unknown".into(),
        );
    }
    // Rank 0 is the first pipeline stage; ranks from (gpus / pp) x (pp - 1)
    // on are the last (the mesh is [pp, dp_replicate, dp_shard, cp, tp]).
    let memory_rank = match stream.rank {
        None | Some(0) => Some(MemoryRank::First),
        Some(_) if resolved.pp == 1 => Some(MemoryRank::First),
        Some(r) if r >= resolved.gpus / resolved.pp * (resolved.pp - 1) => Some(MemoryRank::Last),
        Some(r) => {
            notes.push(format!(
                "the step lines are rank {r}'s, a middle pipeline stage's, where paratune predicts no memory; the memory columns are left empty"
            ));
            peak_reserved_gib = None;
            None
        }
    };
    let total_steps = scan.trainer.as_ref().and_then(|t| t.total_steps);
    let last_step = steps.iter().map(|s| s.step).max().unwrap_or(0);
    if let Some(total) = total_steps
        && last_step < total
    {
        notes.push(format!(
            "the log stops at step {last_step} of {total} (the run was cut short?)"
        ));
    }
    Ok(TorchtitanRun {
        release,
        model: resolved.model,
        model_label: resolved.model_label,
        config: resolved.config,
        expandable_segments: None,
        gpus: resolved.gpus,
        global_batch: resolved.global_batch,
        local_batch: resolved.local_batch,
        rank_layers: resolved.rank_layers,
        log_rank: stream.rank,
        warmup,
        steady_steps: steady.len(),
        steps,
        steady_median_ms,
        steady_mean_ms,
        tps_median: median(&tps),
        tflops_per_gpu,
        mfu_percent,
        peak_reserved_gib,
        memory_rank: peak_reserved_gib.and(memory_rank),
        last_step,
        total_steps,
        notes,
    })
}

/// [`ROW_COLUMNS`] before `expandable_segments`, which the log gained when
/// the launch scripts started to record the allocator.
pub const ROW_COLUMNS_V1: [&str; 42] =
    crate::validate::torch_launch::without(&ROW_COLUMNS, ALLOCATOR_AT);

/// Where `expandable_segments` sits in [`ROW_COLUMNS`], in the run table's
/// order (after `tp_comm_overlap`).
const ALLOCATOR_AT: usize = 14;

/// [`ROW_COLUMNS_V1`] before HSDP's `dp_shard` (after `ac_frequency`).
pub const ROW_COLUMNS_V0: [&str; 41] =
    crate::validate::torch_launch::without(&ROW_COLUMNS_V1, DP_SHARD_AT_V1);
const DP_SHARD_AT_V1: usize = 33;

/// The columns of the run-table row [`TorchtitanRun::row`] gives: paratune's
/// run-table schema (see `runs::KNOWN_COLUMNS`, in its order), then the
/// log's own measurements, carried through as the user's columns (named as
/// `megatron_log::ROW_COLUMNS` names them).
pub const ROW_COLUMNS: [&str; 43] = [
    "gpus",
    "global_batch",
    "micro_batch",
    "hidden",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "gated_mlp",
    "tied_embeddings",
    "first_stage_layers",
    "last_stage_layers",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_comm_overlap",
    "expandable_segments",
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
    "engine",
    "compile",
    "ac_frequency",
    "dp_shard",
    "peak_reserved_gib",
    "memory_rank",
    "iter_ms_mean",
    "tflops_per_gpu_measured",
    "mfu_percent_measured",
    "tokens_per_gpu_s_measured",
    "steady_iterations",
    "source_log",
];

impl TorchtitanRun {
    /// This run as a row of [`ROW_COLUMNS`], `source` in the last column.
    pub fn row(&self, source: &str) -> Vec<String> {
        let m = &self.model;
        let c = &self.config;
        let on_off = |b: bool| crate::config::on_off(b).to_string();
        let optional = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
        let real =
            |v: Option<f64>, digits: usize| v.map(|v| format!("{v:.digits$}")).unwrap_or_default();
        vec![
            self.gpus.to_string(),
            self.global_batch.to_string(),
            c.micro_batch.to_string(),
            m.hidden.to_string(),
            m.heads.to_string(),
            m.kv_heads.to_string(),
            m.ffn_hidden.to_string(),
            on_off(m.gated_mlp),
            on_off(m.tied_embeddings),
            optional(c.first_stage_layers),
            optional(c.last_stage_layers),
            on_off(c.overlap_grad_reduce),
            on_off(c.overlap_param_gather),
            on_off(c.tp_comm_overlap),
            self.expandable_segments.map(on_off).unwrap_or_default(),
            c.cuda_graphs.name().to_string(),
            m.layers.to_string(),
            m.seq_len.to_string(),
            m.vocab.to_string(),
            c.tp.to_string(),
            c.dp.to_string(),
            c.pp.to_string(),
            c.recompute.name().to_string(),
            on_off(c.sequence_parallel),
            c.schedule.name().to_string(),
            c.virtual_stages.to_string(),
            on_off(c.bpipe),
            c.attention.name().to_string(),
            c.optimizer_sharding.name().to_string(),
            format!("{:.3}", self.steady_median_ms),
            on_off(m.dropout),
            c.engine.name().to_string(),
            on_off(c.compile),
            c.ac_frequency.to_string(),
            optional(c.dp_shard),
            real(self.peak_reserved_gib, 2),
            self.memory_rank
                .map(|r| r.name().to_string())
                .unwrap_or_default(),
            format!("{:.3}", self.steady_mean_ms),
            real(self.tflops_per_gpu, 2),
            real(self.mfu_percent, 2),
            format!("{:.0}", self.tps_median),
            self.steady_steps.to_string(),
            source.to_string(),
        ]
    }

    /// `tp2 pp1 dp4 mb2 gb64 recompute=selective-op sp shard=full compile, llama3 8B L32 h4096 a32 s8192, 8 GPUs`.
    pub fn summary(&self) -> String {
        let c = &self.config;
        let mut text = format!(
            "tp{} pp{} dp{} mb{} gb{}",
            c.tp, c.pp, c.dp, c.micro_batch, self.global_batch
        );
        if c.pp > 1 {
            text.push_str(&format!(" {}", c.schedule.name()));
        }
        if c.virtual_stages > 1 {
            text.push_str(&format!(" v{}", c.virtual_stages));
        }
        if c.recompute != Recompute::None {
            text.push_str(&format!(" recompute={}", c.recompute.name()));
            if c.recompute == Recompute::SelectiveLayer {
                text.push_str(&format!("/{}", c.ac_frequency));
            }
        }
        if c.sequence_parallel {
            text.push_str(" sp");
        }
        if c.optimizer_sharding != OptimizerSharding::None {
            text.push_str(&format!(" shard={}", c.optimizer_sharding.name()));
        }
        if let Some(shard) = c.dp_shard {
            text.push_str(&format!(" hsdp={}x{shard}", c.replicas()));
        }
        for (on, name) in [
            (c.compile, "compile"),
            (c.tp_comm_overlap, "async-tp"),
            (c.cuda_graphs.on(), "cuda-graphs"),
        ] {
            if on {
                text.push(' ');
                text.push_str(name);
            }
        }
        text.push_str(&format!(
            ", {} L{} h{} a{} s{}, {} GPUs",
            self.model_label,
            self.model.layers,
            self.model.hidden,
            self.model.heads,
            self.model.seq_len,
            self.gpus
        ));
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runs::{RowDefaults, RunTable, runs_from_table, write_csv};

    #[test]
    fn row_columns_follow_the_run_table_schema() {
        crate::runs::assert_row_columns_follow_the_schema(&ROW_COLUMNS);
        assert_eq!(ROW_COLUMNS[ALLOCATOR_AT], "expandable_segments");
        assert!(!ROW_COLUMNS_V1.contains(&"expandable_segments"));
        assert_eq!(ROW_COLUMNS_V1[DP_SHARD_AT_V1], "dp_shard");
        assert!(!ROW_COLUMNS_V0.contains(&"dp_shard"));
    }

    const ESC: &str = "\x1b";

    fn coloured_step(
        step: u64,
        loss: f64,
        memory: f64,
        tps: &str,
        tflops: &str,
        mfu: &str,
    ) -> String {
        format!(
            "[rank0]:[titan] 2026-10-02 14:03:{:02},204 - root - INFO - {ESC}[31mstep: {step:2}  {ESC}[32mloss: {loss:8.5}  {ESC}[38;2;180;60;0mgrad_norm: {:7.4}  {ESC}[38;2;54;234;195mmemory: {memory:5.2}GiB({:.2}%)  {ESC}[34mtps: {tps}  {ESC}[36mtflops: {tflops}  {ESC}[35mmfu: {mfu}{ESC}[39m\n",
            step % 60,
            1.5,
            memory / 79.11 * 100.0
        )
    }

    #[test]
    fn a_coloured_prefixed_step_line_is_read_field_by_field() {
        let line = coloured_step(20, 7.12345, 61.87, "6,180", "357.83", "36.18%");
        let clean = strip_ansi(line.trim_end());
        let (prefix, rank) = stream_prefix(&clean);
        assert_eq!((prefix, rank), ("[rank0]:", Some(0)));
        let step = step_line(&clean, 7, true).unwrap();
        assert_eq!(step.step, 20);
        assert_eq!(step.loss, Some(7.12345));
        assert_eq!(step.grad_norm, Some(1.5));
        assert_eq!(step.memory_gib, Some(61.87));
        assert_eq!(step.tps, Some(6180.0));
        assert_eq!(step.tflops, Some(357.83));
        assert_eq!(step.mfu_percent, Some(36.18));
        assert!(!step.mfu_not_available);
        let na = step_line("step:  5  loss:  2.00000  memory:  1.00GiB(1.00%)  tps: 1,234,567  tflops: 1,234.50  mfu: N/A", 1, true).unwrap();
        assert_eq!(
            (na.tps, na.tflops, na.mfu_percent),
            (Some(1_234_567.0), Some(1234.5), None)
        );
        assert!(na.mfu_not_available && na.grad_norm.is_none());
    }

    #[test]
    fn validation_lines_cut_numbers_and_bad_thousands_are_not_read() {
        assert!(
            step_line(
                "validate step: 10  loss: 2.0000  memory: 1.00GiB(1.00%)  tps: 5,000",
                1,
                true
            )
            .is_none()
        );
        assert!(step_line("timestep: 3", 1, true).is_none());
        // Cut inside tps: the last field is not taken.
        let cut = step_line(
            "step: 30  loss:  2.10000  memory: 61.00GiB(77.00%)  tps: 6,1",
            1,
            false,
        )
        .unwrap();
        assert_eq!((cut.step, cut.memory_gib, cut.tps), (30, Some(61.0), None));
        for bad in ["6,1x3", "61,80", ",180", "1,2345", "6180.", "-5"] {
            assert_eq!(thousands(bad), None, "{bad}");
        }
        assert_eq!(thousands("6180"), Some(6180.0));
        assert_eq!(thousands("12,345,678.25"), Some(12_345_678.25));
    }

    #[test]
    fn start_up_lines_are_read() {
        let mesh = mesh_line(
            "Building 3-D device mesh with ['pp', 'dp_shard', 'tp'], [2, 2, 2]",
            4,
        )
        .unwrap();
        assert_eq!(
            mesh.dims,
            vec![("pp".into(), 2), ("dp_shard".into(), 2), ("tp".into(), 2)]
        );
        assert!(
            mesh_line("Building 0-D device mesh with [], []", 1)
                .unwrap()
                .dims
                .is_empty()
        );
        let t = trainer_line("Trainer is initialized with local batch size 8, global batch size 32, gradient accumulation steps 2, sequence length 2048, total steps 40 (warmup 2).", 9).unwrap();
        assert_eq!(
            (
                t.local_batch,
                t.global_batch,
                t.accumulation,
                t.seq_len,
                t.total_steps
            ),
            (8, 32, 2, 2048, Some(40))
        );
        let b = building_line("Building llama3 8B with TransformerModelArgs(_enforced='a, b', dim=4096, n_layers=32, rope_scaling_args=RoPEScalingArgs(scaling_factor=8.0, low_freq_factor=1.0), n_kv_heads=8)", 3).unwrap();
        let args = b.args.unwrap();
        assert_eq!((b.name.as_str(), b.flavor.as_str()), ("llama3", "8B"));
        assert_eq!(args["dim"], "4096");
        assert_eq!(args["n_kv_heads"], "8");
        assert!(args["rope_scaling_args"].starts_with("RoPEScalingArgs("));
        assert!(building_line("Building llama3 debugmodel", 1).is_some());
        assert!(building_line("Building tokenizer from disk", 1).is_none());
        let p = pipeline_line(
            "Using pipeline schedule Interleaved1F1B with 4 microbatches and 4 stages.",
            2,
        )
        .unwrap();
        assert_eq!(
            (p.schedule.as_str(), p.microbatches, p.stages),
            ("Interleaved1F1B", 4, 4)
        );
        assert_eq!(
            applied_ac("Applied FullAC activation checkpointing to the model").as_deref(),
            Some("FullAC")
        );
        assert_eq!(applied_ac("Applied FSDP to the model"), None);
    }

    #[test]
    fn launcher_prefixes_name_their_rank() {
        assert_eq!(launcher_prefix("[rank3]:[titan] x"), (8, Some(3)));
        assert_eq!(launcher_prefix("[default12]: hello"), (13, Some(12)));
        assert_eq!(launcher_prefix("1: [rank0]:[titan] x"), (11, Some(0)));
        assert_eq!(launcher_prefix("[titan] x"), (0, None));
        assert_eq!(launcher_prefix("  \"job\": {"), (0, None));
    }

    #[test]
    fn the_command_line_gives_overrides_flags_and_the_world_size() {
        let c = command_line("+ torchrun --nproc_per_node=4 --nnodes 2 --rdzv_backend c10d --local-ranks-filter 0 --role rank --tee 3 -m torchtitan.train --module llama3 --config llama3_8b --parallelism.tensor-parallel-degree 2 --compile.enable activation-checkpoint:full", 1).unwrap();
        assert_eq!(c.world, Some(8));
        assert_eq!(
            (c.module.as_deref(), c.function.as_deref()),
            (Some("llama3"), Some("llama3_8b"))
        );
        let r = Reader {
            settings: &c.settings,
            log: "l",
        };
        assert_eq!(r.count("parallelism.tensor_parallel_degree", 1).unwrap(), 2);
        assert!(r.flag("compile.enable", false).unwrap());
        assert_eq!(
            r.text("activation_checkpoint.mode").unwrap().as_deref(),
            Some("full")
        );
        let c = command_line("NGPU=8 CONFIG_FILE=./train_configs/llama3_8b.toml ./run_train.sh --training.no-disable-cuda-graphs --compile.components=model --parallelism.module_fqns_per_model_part tok_embeddings,layers.0 layers.1,norm,output", 3).unwrap();
        assert_eq!(c.world, Some(8));
        assert_eq!(
            c.config_file.as_deref(),
            Some("./train_configs/llama3_8b.toml")
        );
        let r = Reader {
            settings: &c.settings,
            log: "l",
        };
        assert!(!r.flag("training.disable_cuda_graphs", true).unwrap());
        assert_eq!(
            r.list("compile.components").unwrap().unwrap(),
            vec!["model".to_string()]
        );
        assert_eq!(
            r.parts("parallelism.module_fqns_per_model_part")
                .unwrap()
                .unwrap()
                .len(),
            2
        );
        assert!(
            command_line(
                "  File \"/opt/torchtitan/train.py\", line 78, in <module>",
                9
            )
            .is_none()
        );
        assert!(command_line("the torchtitan.train module", 9).is_none());
    }

    #[test]
    fn pipeline_splits_follow_torchtitan() {
        // The notes' worked examples (the function run from the 0.3.0 wheel).
        assert_eq!(split_stages(32, 4, 1, 1).unwrap(), vec![8, 9, 8, 7]);
        assert_eq!(
            split_stages(32, 8, 1, 1).unwrap(),
            vec![4, 5, 4, 4, 4, 4, 4, 3]
        );
        assert_eq!(split_stages(32, 2, 1, 1).unwrap(), vec![16, 16]);
        assert_eq!(split_stages(80, 4, 1, 1).unwrap(), vec![20, 21, 20, 19]);
        assert_eq!(split_stages(32, 4, 0, 0).unwrap(), vec![8; 4]);
        assert_eq!(split_stages(10, 3, 1, 1).unwrap(), vec![3, 4, 3]);
        assert!(split_stages(2, 8, 1, 1).is_err());
    }

    #[test]
    fn flavors_have_torchtitans_shapes() {
        let debug = llama3_flavor("debugmodel").unwrap();
        assert_eq!(
            (
                debug.hidden,
                debug.heads,
                debug.ffn_hidden,
                debug.layers,
                debug.vocab
            ),
            (256, 16, 768, 6, 2048)
        );
        assert_eq!(llama_ffn(4096, 1024, Some(1.3)), 14336);
        assert_eq!(llama_ffn(8192, 4096, Some(1.3)), 28672);
        assert_eq!(llama_ffn(16384, 4096, Some(1.2)), 53248);
        for (flavor, name) in [
            ("8B", "llama3-8b"),
            ("70B", "llama3-70b"),
            ("405B", "llama3-405b"),
            ("8B_flex", "llama3-8b"),
            ("llama3-8b", "llama3-8b"),
        ] {
            assert_eq!(llama3_flavor(flavor).unwrap().name, name);
        }
        assert!(llama3_flavor("1B").is_none());
        assert!(llama3_flavor("gpt-1t").is_none());
    }

    fn toml(parallelism: &str, extra: &str) -> ConfigFile {
        let text = format!(
            "[model]\nname = \"llama3\"\nflavor = \"debugmodel\"\n\n[training]\nlocal_batch_size = 4\nseq_len = 2048\n\n[parallelism]\n{parallelism}\n\n{extra}"
        );
        parse_config_file(&text, "job.toml").unwrap()
    }

    fn steps(n: u64, tps: &str) -> String {
        let mut text = String::new();
        for step in 1..=n {
            text.push_str(&coloured_step(
                step,
                3.0,
                10.0 + step as f64 / 10.0,
                tps,
                "10.00",
                "1.00%",
            ));
        }
        text
    }

    fn options(config: ConfigFile, gpus: Option<u64>) -> Options {
        Options {
            warmup: 2,
            config: Some(config),
            model: None,
            gpus,
        }
    }

    #[test]
    fn a_toml_and_step_lines_give_the_configuration_and_times() {
        let run = parse(
            &steps(6, "4,096"),
            "r.log",
            &options(
                toml(
                    "data_parallel_shard_degree = -1\ntensor_parallel_degree = 2",
                    "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"3\"",
                ),
                Some(8),
            ),
        )
        .unwrap();
        let c = run.config;
        assert_eq!((c.tp, c.pp, c.dp, c.micro_batch), (2, 1, 4, 4));
        assert_eq!(run.global_batch, 16);
        assert_eq!(
            (c.recompute, c.ac_frequency),
            (Recompute::SelectiveLayer, 3)
        );
        assert_eq!(c.optimizer_sharding, OptimizerSharding::Full);
        assert!(c.sequence_parallel && !c.compile && !c.cuda_graphs.on() && c.overlap_grad_reduce);
        // 16 x 2048 tokens / (4096 tokens/s x 8 GPUs) = 1 s.
        assert!((run.steady_median_ms - 1000.0).abs() < 1e-9);
        assert_eq!(run.steady_steps, 4);
        assert_eq!(run.peak_reserved_gib, Some(10.6));
        assert_eq!(run.memory_rank, Some(MemoryRank::First));
        assert_eq!(run.release, Release::V02);
    }

    #[test]
    fn defaults_are_torchtitans() {
        // 0.2.2: selective per-layer every 2nd block, FSDP resharding, shard -1.
        let run = parse(&steps(4, "1,000"), "d.log", &options(toml("", ""), Some(4))).unwrap();
        let c = run.config;
        assert_eq!((c.tp, c.dp, c.micro_batch), (1, 4, 4));
        assert_eq!(
            (c.recompute, c.ac_frequency),
            (Recompute::SelectiveLayer, 2)
        );
        assert_eq!(c.optimizer_sharding, OptimizerSharding::Full);
        // Without any GPU count, -1 cannot be resolved.
        let err = parse(&steps(4, "1,000"), "d.log", &options(toml("", ""), None))
            .unwrap_err()
            .to_string();
        assert!(err.contains("d.log") && err.contains("--gpus N"), "{err}");
    }

    #[test]
    fn a_pipeline_is_split_as_torchtitan_splits_it() {
        let run = parse(
            &steps(5, "2,000"),
            "p.log",
            &options(
                toml(
                    "data_parallel_shard_degree = 2\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\npipeline_parallel_schedule = \"Interleaved1F1B\"",
                    "[activation_checkpoint]\nmode = \"full\"",
                ),
                None,
            ),
        )
        .unwrap();
        let c = run.config;
        assert_eq!((c.pp, c.dp, c.micro_batch, c.virtual_stages), (2, 2, 2, 2));
        assert_eq!(c.schedule, ScheduleKind::Interleaved);
        // 6 layers, 4 stages [1, 2, 2, 1]: 3 a rank, which interleaving by 2 cannot
        // split evenly, so the end stages are given.
        assert_eq!(run.rank_layers, vec![3, 3]);
        assert_eq!(
            (c.first_stage_layers, c.last_stage_layers),
            (Some(3), Some(3))
        );
        // FSDP under a pipeline keeps weights gathered by default.
        assert_eq!(c.optimizer_sharding, OptimizerSharding::OptimizerStates);
        assert_eq!(run.gpus, 4);
        assert!(run.notes.is_empty(), "{:?}", run.notes);
    }

    #[test]
    fn contradictions_and_unsupported_features_are_errors() {
        let err = |parallelism: &str, extra: &str, gpus: Option<u64>| {
            parse(
                &steps(4, "1,000"),
                "x.log",
                &options(toml(parallelism, extra), gpus),
            )
            .unwrap_err()
            .to_string()
        };
        let e = err("context_parallel_degree = 2", "", Some(8));
        assert!(
            e.contains("context parallelism") && e.contains("CSV row with its cp column"),
            "{e}"
        );
        let e = err(
            "pipeline_parallel_degree = 2\npipeline_parallel_schedule = \"ZBVZeroBubble\"",
            "",
            Some(2),
        );
        assert!(
            e.contains("ZBVZeroBubble") && e.contains("Interleaved1F1B"),
            "{e}"
        );
        let e = err(
            "pipeline_parallel_degree = 2\npipeline_parallel_schedule = \"Fancy\"",
            "",
            Some(2),
        );
        assert!(
            e.contains("job.toml")
                && e.contains("\"Fancy\"")
                && e.contains("pipeline_parallel_schedule"),
            "{e}"
        );
        let e = err("data_parallel_shard_degree = 4", "", Some(8));
        assert!(
            e.contains("make 4 GPUs") && e.contains("--gpus gives 8"),
            "{e}"
        );
        let e = err("tensor_parallel_degree = \"2\"", "", Some(8));
        assert!(
            e.contains("tensor_parallel_degree") && e.contains("without quotes"),
            "{e}"
        );
        let float8 = parse_config_file(
            "[model]\nflavor = \"8B\"\nconverters = [\"quantize.linear.float8\"]\n",
            "f.toml",
        )
        .unwrap();
        let e = parse(&steps(4, "1,000"), "f.log", &options(float8, Some(8)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("quantised training") && e.contains("quantize.linear.float8"),
            "{e}"
        );
        let e = parse_config_file("[parallelism]\ntensor_paralel_degree = 2\n", "t.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("t.toml")
                && e.contains("tensor_paralel_degree")
                && e.contains("tensor_parallel_degree"),
            "{e}"
        );
    }

    #[test]
    fn a_global_batch_that_is_not_a_multiple_is_refused() {
        let text = "[model]\nflavor = \"debugmodel\"\n[training]\nlocal_batch_size = 4\nglobal_batch_size = 6\n";
        let config = parse_config_file(text, "g.toml").unwrap();
        let e = parse(&steps(4, "1,000"), "g.log", &options(config, Some(4)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("global_batch_size 6") && e.contains("4 x 4"),
            "{e}"
        );
    }

    #[test]
    fn the_device_mesh_and_trainer_lines_check_and_fill_the_configuration() {
        let mut text = String::from(
            "[rank0]:[titan] 2026-10-02 14:00:00,000 - root - INFO - Building 1-D device mesh with ['dp_shard'], [8]\n",
        );
        text.push_str(&steps(4, "1,000"));
        let run = parse(&text, "m.log", &options(toml("", ""), None)).unwrap();
        assert_eq!((run.gpus, run.config.dp), (8, 8));
        let e = parse(
            &text,
            "m.log",
            &options(toml("tensor_parallel_degree = 2", ""), None),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("device mesh (line 1) has tp 1") && e.contains("tensor_parallel_degree"),
            "{e}"
        );
        let trainer = "[rank0]:[titan] 2026-10-02 14:00:00,000 - root - INFO - Trainer is initialized with local batch size 2, global batch size 16, gradient accumulation steps 2, sequence length 2048, total steps 10 (warmup 2)\n";
        let text = format!("{trainer}{}", steps(4, "1,000"));
        let e = parse(&text, "t.log", &options(toml("", ""), Some(4)))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("training.local_batch_size") && e.contains("line 1 says 2"),
            "{e}"
        );
        let config = parse_config_file("[model]\nflavor = \"debugmodel\"\n", "n.toml").unwrap();
        let run = parse(&text, "t.log", &options(config, None)).unwrap();
        assert_eq!(
            (run.local_batch, run.global_batch, run.config.dp, run.gpus),
            (2, 16, 4, 4)
        );
        assert!(
            run.notes
                .iter()
                .any(|n| n.contains("stops at step 4 of 10")),
            "{:?}",
            run.notes
        );
    }

    #[test]
    fn a_replicated_mesh_is_not_expert_parallelism_and_absurd_degrees_are_refused() {
        let mut text = String::from(
            "[rank0]:[titan] 2026-10-02 14:00:00,000 - root - INFO - Building 2-D device mesh with ['dp_replicate', 'tp'], [2, 2]\n",
        );
        text.push_str(&steps(4, "1,000"));
        let ddp = "data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 2";
        let run = parse(&text, "r.log", &options(toml(ddp, ""), None)).unwrap();
        assert_eq!((run.gpus, run.config.dp, run.config.tp), (4, 2, 2));
        assert_eq!(run.config.optimizer_sharding, OptimizerSharding::None);
        let huge = "tensor_parallel_degree = 1048576\npipeline_parallel_degree = 1048576\ncontext_parallel_degree = 1";
        let e = parse(&steps(4, "1,000"), "h.log", &options(toml(huge, ""), None))
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 1048576 GPUs"), "{e}");
        let e = parse(
            &steps(4, "1,000"),
            "h.log",
            &options(toml("tensor_parallel_degree = 99999999999", ""), None),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("tensor_parallel_degree") && e.contains("from 1 to 1048576"),
            "{e}"
        );
        // A trainer line with numbers beyond any run is not read.
        assert!(trainer_line("Trainer is initialized with local batch size 99999999999999999999, global batch size 8, gradient accumulation steps 1, sequence length 8192", 1).is_none());
    }

    #[test]
    fn hsdp_is_read_as_replicas_of_a_shard_group() {
        let hsdp = "data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4";
        let run = parse(&steps(4, "1,000"), "r.log", &options(toml(hsdp, ""), None)).unwrap();
        let c = &run.config;
        assert_eq!(
            (run.gpus, c.dp, c.dp_shard, c.replicas()),
            (8, 8, Some(4), 2)
        );
        assert_eq!(c.optimizer_sharding, OptimizerSharding::Full);
        let row = run.row("r.log");
        let column = |name: &str| &row[ROW_COLUMNS.iter().position(|c| *c == name).unwrap()];
        assert_eq!(column("dp_shard"), "4");
        assert_eq!(column("dp"), "8");
    }

    #[test]
    fn a_printed_config_is_read_with_its_continuation_lines() {
        let mut text = String::from(
            "[rank0]:[titan] 2026-10-02 14:00:00,000 - root - INFO - torchtitan version: 0.3.0 (0.0.0 means __version__ is not defined correctly).\n",
        );
        text.push_str(
            "[rank0]:[titan] 2026-10-02 14:00:01,000 - root - INFO - Running with configs: {\n",
        );
        text.push_str("[rank0]:  \"model_spec\": {\"name\": \"llama3\", \"flavor\": \"debugmodel\", \"model\": {\"dim\": 256}},\n");
        text.push_str("[rank1]:[titan] 2026-10-02 14:00:01,001 - root - INFO - interleaved from another rank\n");
        text.push_str("[rank0]:  \"training\": {\"local_batch_size\": 2, \"seq_len\": 1024, \"disable_cuda_graphs\": false},\n");
        text.push_str("[rank0]:  \"parallelism\": {\"data_parallel_shard_degree\": 2, \"tensor_parallel_degree\": 2, \"module_fqns_per_model_part\": null},\n");
        text.push_str("[rank0]:  \"activation_checkpoint\": null,\n");
        text.push_str("[rank0]:  \"compile\": {\"enable\": true, \"components\": [\"model\", \"loss\"], \"enable_async_tensor_parallel\": true}\n");
        text.push_str("[rank0]:}\n");
        text.push_str(&steps(4, "2,048"));
        let run = parse(
            &text,
            "j.log",
            &Options {
                warmup: 2,
                ..Options::default()
            },
        )
        .unwrap();
        let c = run.config;
        assert_eq!(run.release, Release::V03);
        assert_eq!((c.tp, c.dp, c.micro_batch, run.gpus), (2, 2, 2, 4));
        assert_eq!(c.recompute, Recompute::None);
        assert!(c.compile && c.tp_comm_overlap && c.cuda_graphs.on() && c.sequence_parallel);
        // 4 x 1024 tokens / (2048 x 4) = 0.5 s.
        assert!((run.steady_median_ms - 500.0).abs() < 1e-9);
        assert!(run.notes.is_empty(), "{:?}", run.notes);
        // Cut inside the printed config, with nothing else to go on.
        let cut: String = text
            .lines()
            .take(4)
            .map(|l| format!("{l}\n"))
            .collect::<String>()
            + &steps(3, "1,000");
        let e = parse(
            &cut,
            "c.log",
            &Options {
                warmup: 0,
                ..Options::default()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("no configuration") && e.contains("cannot be read"),
            "{e}"
        );
    }

    #[test]
    fn missing_parts_are_errors_that_say_what_is_missing() {
        let e = parse("", "e.log", &Options::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("e.log") && e.contains("empty"), "{e}");
        let e = parse(
            "[rank0]:[titan] x - root - INFO - Training starts at step 1\n",
            "n.log",
            &Options::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("n.log") && e.contains("no readable step lines"),
            "{e}"
        );
        let e = parse(&steps(4, "1,000"), "c.log", &Options::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no configuration") && e.contains("--config"),
            "{e}"
        );
        let e = parse(
            &steps(3, "1,000"),
            "w.log",
            &options(toml("", ""), Some(4)).with_warmup(5),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("no step lines after the 5 warm-up") && e.contains("--warmup"),
            "{e}"
        );
        let config = parse_config_file("[model]\nflavor = \"1B\"\n", "m.toml").unwrap();
        let e = parse(&steps(4, "1,000"), "m.log", &options(config, Some(4)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("flavor `1B`") && e.contains("--model"), "{e}");
    }

    impl Options {
        fn with_warmup(mut self, warmup: usize) -> Self {
            self.warmup = warmup;
            self
        }
    }

    #[test]
    fn a_row_reads_back_with_runs_from_table_into_the_same_configuration() {
        for (parallelism, extra, gpus) in [
            (
                "tensor_parallel_degree = 2",
                "[compile]\nenable = true\n",
                8,
            ),
            (
                "data_parallel_shard_degree = 2\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\npipeline_parallel_schedule = \"Interleaved1F1B\"",
                "[activation_checkpoint]\nmode = \"full\"",
                4,
            ),
            (
                "data_parallel_replicate_degree = 4\ndata_parallel_shard_degree = 1",
                "[activation_checkpoint]\nmode = \"none\"",
                4,
            ),
        ] {
            let run = parse(
                &steps(5, "3,000"),
                "r.log",
                &options(toml(parallelism, extra), Some(gpus)),
            )
            .unwrap();
            let headers: Vec<String> = ROW_COLUMNS.iter().map(|s| s.to_string()).collect();
            let row = run.row("logs/r,1.log");
            assert_eq!(row.len(), headers.len());
            let mut buffer = Vec::new();
            write_csv(&mut buffer, &headers, &[row]).unwrap();
            let table = RunTable::parse(&String::from_utf8(buffer).unwrap(), "runs.csv").unwrap();
            let defaults = RowDefaults::gpt(1000, 128, AttentionKind::Standard, Recompute::Full);
            let runs = runs_from_table(&table, &defaults, crate::runs::BaseNode::DGX_A100).unwrap();
            assert_eq!(runs[0].config, run.config, "{parallelism}");
            assert_eq!(runs[0].gpus, gpus);
            assert_eq!(runs[0].global_batch, run.global_batch);
            let m = &runs[0].model;
            assert_eq!(
                (
                    m.hidden,
                    m.heads,
                    m.kv_heads,
                    m.ffn_hidden,
                    m.layers,
                    m.vocab,
                    m.seq_len
                ),
                (256, 16, 16, 768, 6, 2048, 2048)
            );
            assert!(m.gated_mlp && !m.tied_embeddings && !m.dropout);
            assert!((runs[0].measured_s.unwrap() * 1e3 - run.steady_median_ms).abs() < 1e-3);
            let memory = runs[0].measured_memory.unwrap();
            assert_eq!(memory.rank, MemoryRank::First);
            assert!(
                (memory.reserved.unwrap() / (1u64 << 30) as f64 - run.peak_reserved_gib.unwrap())
                    .abs()
                    < 1e-9
            );
            assert_eq!(table.cell(0, "source_log"), Some("logs/r,1.log"));
        }
    }
}
