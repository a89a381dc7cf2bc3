//! Measured runs and run tables: one row per training configuration, with
//! its measured iteration time where known.
//!
//! Two schemas are read: paratune's own (`gpus, global_batch, micro_batch,
//! hidden, heads, layers, seq_len, tp, dp, pp` plus optional columns, as in
//! the vTrain single-node measurements), and Megatron-LM's SC'21 Table 1
//! (`tflops_per_gpu` instead of `iter_ms`, `layers_per_virtual_stage`, no
//! `dp` or `seq_len`). Columns that are absent take the defaults given.

mod history;
pub mod schema;
mod table;

pub use history::{HistoryError, RunHistory, TailRepair};
pub use table::{RunTable, merge_rows, write_csv, write_rows};

use crate::choice::Choice;
use crate::config::{
    CpComm, CrossEntropyFusion, CudaGraphs, Dispatcher, Engine, Fp8Recipe, GradReduce,
    OptimizerSharding, ParallelConfig, Precision, Recompute, RecomputeModules, ScheduleKind,
    StageOrder, SyncMethod, WgradDeferral,
};
pub use crate::cost::MemoryRank;
use crate::model::{AttentionKind, ModelSpec, MoeSpec};

/// Column values for what a row does not say.
#[derive(Debug, Clone)]
pub struct RowDefaults {
    /// Dimensions the row does not give come from here; `ffn_hidden` scales
    /// with `hidden` when only `hidden` is given.
    pub model: ModelSpec,
    /// Whether `model` is the user's (`--model`, or its dimensions as
    /// flags): a table without the model's columns then takes it whole. A
    /// placeholder model cannot stand in for columns a table lacks.
    pub model_is_given: bool,
    pub recompute: Recompute,
    pub sequence_parallel: bool,
    pub schedule: ScheduleKind,
    pub virtual_stages: u64,
    pub bpipe: bool,
    pub optimizer_sharding: OptimizerSharding,
    /// The engine switches, as the engine runs by default (all off in
    /// Megatron-LM) unless the flags say otherwise.
    pub overlap_grad_reduce: bool,
    pub overlap_param_gather: bool,
    pub tp_comm_overlap: bool,
    pub cuda_graphs: CudaGraphs,
    pub engine: Engine,
    pub compile: bool,
    pub ac_frequency: u64,
    /// Which rank measured memory columns were read on (`memory_rank`).
    pub memory_rank: MemoryRank,
}

impl RowDefaults {
    /// GPT-style rows (MLP 4h, learned positions, tied embeddings) with the
    /// given vocabulary, sequence length, attention kernel and recomputation,
    /// on the 1F1B schedule without sharding: how Megatron's published runs
    /// (and the reference measurements) are described.
    pub fn gpt(vocab: u64, seq_len: u64, attention: AttentionKind, recompute: Recompute) -> Self {
        let mut model = ModelSpec::gpt("runs", 1024, 16, 24, vocab, seq_len);
        model.attention = attention;
        RowDefaults {
            model,
            model_is_given: false,
            recompute,
            sequence_parallel: false,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            bpipe: false,
            optimizer_sharding: OptimizerSharding::None,
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            tp_comm_overlap: false,
            cuda_graphs: CudaGraphs::Off,
            engine: Engine::Megatron,
            compile: false,
            ac_frequency: 2,
            memory_rank: MemoryRank::Max,
        }
    }
}

/// One row of a run table, understood.
#[derive(Debug, Clone)]
pub struct Run {
    /// 1-based line in the file (the header is line 1).
    pub line: usize,
    pub model: ModelSpec,
    pub config: ParallelConfig,
    pub global_batch: u64,
    pub gpus: u64,
    /// The row's own GPU (a `gpu` column), when the table mixes GPUs.
    pub gpu: Option<String>,
    /// GPUs per node when the row's job uses fewer of each node than the
    /// GPU's built-in node holds (a `gpus_per_node` column: 64 of a GB200
    /// NVL72 rack's 72).
    pub gpus_per_node: Option<u64>,
    /// Measured iteration time, if the row has one.
    pub measured_s: Option<f64>,
    /// Measured peak memory, if the row has it.
    pub measured_memory: Option<MeasuredMemory>,
}

/// A measured peak as PyTorch's caching allocator reports it, bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasuredMemory {
    /// `max allocated`.
    pub allocated: Option<f64>,
    /// `max reserved`.
    pub reserved: Option<f64>,
    pub rank: MemoryRank,
}

impl Run {
    /// Rows with the same model, GPU count and global batch compete for the
    /// same job: ranking quality is judged within such a group.
    pub fn group_key(&self) -> String {
        let m = &self.model;
        format!(
            "h{} a{} L{} s{} V{} gpus{}{} B{}",
            m.hidden,
            m.heads,
            m.layers,
            m.seq_len,
            m.vocab,
            self.gpus,
            self.gpu
                .as_deref()
                .map(|g| format!(" {g}"))
                .unwrap_or_default(),
            self.global_batch
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunsError {
    #[error("cannot read runs file {path}: {message}")]
    Read { path: String, message: String },
    #[error("{path} line {line}: {message}")]
    Row {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{path}: {message}")]
    Table { path: String, message: String },
}

/// A row paratune cannot express (context parallelism, a mixture of
/// experts, an encoder-decoder model...), left out with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub line: usize,
    pub reason: String,
}

/// The runs of a table and the rows it could not express.
#[derive(Debug, Clone)]
pub struct Runs {
    pub runs: Vec<Run>,
    pub skipped: Vec<Skipped>,
    /// Rows with the same configuration as an earlier one (as paratune
    /// describes it) whose times differ by more than half: measurements
    /// that cannot both be right, or knobs paratune does not model
    /// (deterministic mode, a fused loss).
    pub contradictions: Vec<(usize, String)>,
}

impl Runs {
    /// `12 rows left out: context parallelism (cp 2) in 10, ...`, or `None`.
    /// Why nothing is left to predict or fit, where every row was left
    /// out: a table of rows paratune cannot express (a calibration over
    /// several tables asks this of them all together).
    pub fn none_left(&self) -> Option<String> {
        (self.runs.is_empty() && !self.skipped.is_empty()).then(|| {
            format!(
                "no row is left to use: {}",
                self.skipped_summary().unwrap_or_default()
            )
        })
    }

    pub fn skipped_summary(&self) -> Option<String> {
        if self.skipped.is_empty() {
            return None;
        }
        let mut reasons: Vec<(String, usize)> = Vec::new();
        for s in &self.skipped {
            match reasons.iter_mut().find(|(r, _)| *r == s.reason) {
                Some((_, n)) => *n += 1,
                None => reasons.push((s.reason.clone(), 1)),
            }
        }
        reasons.sort_by_key(|r| std::cmp::Reverse(r.1));
        Some(format!(
            "{} row(s) left out, which paratune cannot express: {}",
            self.skipped.len(),
            reasons
                .iter()
                .map(|(r, n)| format!("{r} ({n})"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

/// Why a row was not turned into a run.
enum RowProblem {
    /// Impossible or unreadable: an error naming the line.
    Invalid(String),
    /// Valid but beyond what paratune models: left out.
    Unsupported(String),
}

impl From<String> for RowProblem {
    fn from(message: String) -> Self {
        RowProblem::Invalid(message)
    }
}

/// The node a table's rows run on where a row does not say: the GPU and
/// GPUs per node of the cluster given (a cluster file's, or a built-in
/// node's).
#[derive(Debug, Clone, Copy)]
pub struct BaseNode<'a> {
    pub gpu: &'a str,
    pub gpus_per_node: u64,
}

impl<'a> From<&'a crate::cluster::NodeGroup> for BaseNode<'a> {
    fn from(group: &'a crate::cluster::NodeGroup) -> Self {
        BaseNode {
            gpu: &group.gpu.name,
            gpus_per_node: group.gpus_per_node,
        }
    }
}

impl BaseNode<'static> {
    /// Eight A100-80GBs a node (a DGX A100), where the reference runs and
    /// the SC'21 table ran.
    pub const DGX_A100: BaseNode<'static> = BaseNode {
        gpu: "a100-80gb",
        gpus_per_node: 8,
    };
}

impl BaseNode<'_> {
    /// The GPU `run` is on: its `gpu` column, else the base's.
    pub fn gpu_of<'r>(&'r self, run: &'r Run) -> &'r str {
        run.gpu.as_deref().unwrap_or(self.gpu)
    }

    /// The GPUs per node `run` uses: its `gpus_per_node` column; else, on
    /// the base's GPU, the base's count (a cluster file's node); else its
    /// GPU's built-in node; else the base's count.
    pub fn gpus_per_node_of(&self, run: &Run) -> u64 {
        let gpu = self.gpu_of(run);
        run.gpus_per_node.unwrap_or_else(|| {
            if gpu == self.gpu {
                self.gpus_per_node
            } else {
                crate::cluster::builtin_node(gpu, 1)
                    .map_or(self.gpus_per_node, |node| node.gpus_per_node)
            }
        })
    }
}

/// Turns every row of `table` into a [`Run`]. A row whose configuration is
/// impossible, or one paratune cannot express, is reported by its line
/// number.
pub fn runs_from_table(
    table: &RunTable,
    defaults: &RowDefaults,
    base: BaseNode,
) -> Result<Vec<Run>, RunsError> {
    let runs = runs_and_skipped(table, defaults, base)?;
    if let Some(first) = runs.skipped.first() {
        return Err(RunsError::Row {
            path: table.path.clone(),
            line: first.line,
            message: format!("{}, which paratune cannot express", first.reason),
        });
    }
    if let Some((line, message)) = runs.contradictions.first() {
        return Err(RunsError::Row {
            path: table.path.clone(),
            line: *line,
            message: format!("{message}; remove the wrong measurement"),
        });
    }
    Ok(runs.runs)
}

/// [`runs_from_table`], leaving out (and listing) the rows paratune cannot
/// express instead of refusing the table, and listing contradicting rows
/// instead of refusing them: Megatron-LM's CI runs hold mixtures of
/// experts, context parallelism and encoder-decoder models beside the GPT
/// rows, and the same configuration in several tests.
pub fn runs_and_skipped(
    table: &RunTable,
    defaults: &RowDefaults,
    base: BaseNode,
) -> Result<Runs, RunsError> {
    check_column_names(table)?;
    let names_models = table.headers.iter().any(|h| h == "model");
    if !defaults.model_is_given
        && !names_models
        && let Some(missing) = MODEL_COLUMNS
            .iter()
            .find(|c| !table.headers.iter().any(|h| h == *c))
    {
        return Err(RunsError::Table {
            path: table.path.clone(),
            message: format!(
                "no `{missing}` column; give the model's dimensions as columns ({}) or the model with --model",
                MODEL_COLUMNS.join(", ")
            ),
        });
    }
    let mut runs = Vec::with_capacity(table.rows.len());
    let mut skipped = Vec::new();
    for (index, _) in table.rows.iter().enumerate() {
        let line = table.line(index);
        let row_error = |message: String| RunsError::Row {
            path: table.path.clone(),
            line,
            message,
        };
        let run = match parse_row(table, index, defaults) {
            Ok(run) => run,
            Err(RowProblem::Unsupported(reason)) => {
                skipped.push(Skipped { line, reason });
                continue;
            }
            Err(RowProblem::Invalid(message)) => return Err(row_error(message)),
        };
        // The row's GPU, its own or the flags', must have its precision's
        // tensor cores (a cluster file's GPU is the user's to describe).
        if let Some(gpu) = crate::cluster::builtin_gpu(base.gpu_of(&run))
            && run.config.precision.gpu_problem(&gpu).is_some()
        {
            let format = match run.config.precision {
                Precision::Nvfp4 => "FP4",
                _ => "FP8",
            };
            skipped.push(Skipped {
                line,
                reason: format!(
                    "{} on {}, which has no {format} tensor cores",
                    run.config.precision.name().to_uppercase(),
                    gpu.name
                ),
            });
            continue;
        }
        if let Some(problem) = run
            .config
            .fp8_recipe
            .and_then(|r| r.gpu_problem(base.gpu_of(&run)))
            .filter(|_| run.config.precision == Precision::Fp8)
        {
            // The recipe came from its own column or from the precision's name.
            let column = match table.cell(index, "fp8_recipe") {
                Some(_) => "fp8_recipe",
                None => "precision",
            };
            return Err(row_error(format!(
                "column `{column}`: {problem}; give the row's GPU its own recipe (FP8-CS, tensorwise) or leave it to the GPU's default"
            )));
        }
        run.model.check().map_err(row_error)?;
        let per_node = base.gpus_per_node_of(&run);
        run.config
            .check(&run.model, run.global_batch, run.gpus, per_node)
            .map_err(row_error)?;
        runs.push(Run { line, ..run });
    }
    let contradictions = contradictions(&runs);
    Ok(Runs {
        runs,
        skipped,
        contradictions,
    })
}

/// The FP8 recipe NVIDIA's performance tables name a precision by:
/// "FP8-CS" current (tensor-wise) scaling, "FP8-MX" MXFP8, "FP8-DS"
/// delayed scaling, "FP8-BS" DeepSeek's blocks (Megatron-Bridge
/// `docs/performance-summary.md`, NeMo's performance summaries).
fn published_fp8_recipe(text: &str) -> Option<Fp8Recipe> {
    match text.trim().to_lowercase().as_str() {
        "fp8-cs" => Some(Fp8Recipe::Tensorwise),
        "fp8-mx" => Some(Fp8Recipe::Mxfp8),
        "fp8-ds" => Some(Fp8Recipe::Delayed),
        "fp8-bs" => Some(Fp8Recipe::Blockwise),
        _ => None,
    }
}

/// What a row asks for that paratune does not model yet, if anything:
/// Megatron-LM's CI runs (`megatron_ci_runs.csv`) hold these beside the
/// GPT rows.
fn unsupported(cell: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let above_one = |name: &str| {
        cell(name)
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&n| n > 1)
    };
    if let Some(family) = cell("model_family")
        && !matches!(family.as_str(), "gpt" | "llama" | "moe")
    {
        return Some(match family.as_str() {
            "t5" => "an encoder-decoder model (T5)".into(),
            "bert" => "an encoder with BERT's heads".into(),
            "hybrid" => "a hybrid Mamba model".into(),
            "multimodal" => "a multimodal model".into(),
            other => format!("a `{other}` model"),
        });
    }
    // (A built-in model names its experts; ep on a dense one is refused
    // with the configuration's checks.)
    if above_one("ep").is_some() && cell("num_experts").is_none() && cell("model").is_none() {
        return Some("expert parallelism without a num_experts column".into());
    }
    if cell("multi_latent_attention").is_some_and(|v| parse_switch("", &v).unwrap_or(false))
        && cell("kv_lora_rank").is_none()
    {
        return Some("multi-latent attention without its kv_lora_rank column".into());
    }
    if let Some(precision) = cell("precision") {
        let p = precision.to_lowercase();
        if p.contains("fp4") && p != "nvfp4" {
            return Some(format!("precision {precision}"));
        }
        if p == "fp32" {
            return Some("fp32 training".into());
        }
    }
    // Megatron-LM runs such a split only from a pipeline layout, which a
    // run table does not carry (Megatron-LM's CI tables drop it).
    let count = |name: &str| cell(name).and_then(|v| v.parse::<u64>().ok());
    let given = |name: &str| cell(name).is_some_and(|v| v != "false" && v != "0");
    if let (Some(layers), Some(pp), Some(v)) =
        (count("layers"), count("pp"), count("virtual_stages"))
        && pp * v > 1
        && !layers.is_multiple_of(pp * v)
        && ![
            "first_stage_layers",
            "last_stage_layers",
            "account_for_embedding_in_split",
            "account_for_loss_in_split",
        ]
        .iter()
        .any(|c| given(c))
    {
        return Some(
            "an uneven pipeline split the row does not give (a layout; no first_stage_layers or last_stage_layers)"
                .into(),
        );
    }
    let method = cell("recompute_method");
    let layers = cell("recompute_num_layers");
    if cell("recompute").as_deref() == Some("full")
        && (method.as_deref().is_some_and(|m| m != "uniform")
            || layers.as_deref().is_some_and(|n| n != "1"))
    {
        return Some(format!(
            "full recomputation by {} of {} layers",
            method.unwrap_or_default(),
            layers.unwrap_or_default()
        ));
    }
    None
}

fn parse_row(table: &RunTable, index: usize, defaults: &RowDefaults) -> Result<Run, RowProblem> {
    let cell = |name: &str| table.cell(index, name);
    if let Some(reason) = unsupported(&|name| cell(name).map(str::to_string)) {
        return Err(RowProblem::Unsupported(reason));
    }
    let int = |name: &str| -> Result<Option<u64>, String> {
        match cell(name) {
            None => Ok(None),
            Some(text) => match text.parse::<u64>() {
                Ok(0) => Err(format!("column `{name}` is 0; it must be at least 1")),
                Ok(n) if n > column_limit(name) => Err(format!(
                    "column `{name}` is {n}, more than paratune plans for (at most {})",
                    column_limit(name)
                )),
                Ok(n) => Ok(Some(n)),
                Err(_) => Err(format!(
                    "column `{name}` must be a whole number, found `{text}`"
                )),
            },
        }
    };
    let real = |name: &str| -> Result<Option<f64>, String> {
        match cell(name) {
            None => Ok(None),
            Some(text) => match text.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
                _ => Err(format!(
                    "column `{name}` must be a positive number, found `{text}`"
                )),
            },
        }
    };
    let required = |name: &str| -> Result<u64, String> {
        int(name)?.ok_or_else(|| format!("column `{name}` is empty; every row needs it"))
    };

    // A `model` column names a built-in model; the row's other model
    // columns change it. A row that leaves it empty needs them, or --model.
    if !defaults.model_is_given
        && table.headers.iter().any(|h| h == "model")
        && cell("model").is_none()
        && let Some(missing) = MODEL_COLUMNS.iter().find(|c| cell(c).is_none())
    {
        return Err(format!(
            "column `model` is empty and so is `{missing}`; name a built-in model (see `paratune models`) or give the model's dimensions ({})",
            MODEL_COLUMNS.join(", ")
        )
        .into());
    }
    let mut model = match cell("model") {
        Some(name) => crate::model::builtin_model(name).ok_or_else(|| {
            format!(
                "column `model` is `{name}`, not a built-in model (see `paratune models`){}",
                crate::suggest::did_you_mean(name, &crate::model::builtin_model_names())
            )
        })?,
        None => defaults.model.clone(),
    };
    if let Some(hidden) = int("hidden")? {
        if int("ffn_hidden")?.is_none() {
            model.ffn_hidden = model.ffn_hidden * hidden / model.hidden;
        }
        model.hidden = hidden;
    }
    if let Some(heads) = int("heads")? {
        model.kv_heads = if model.kv_heads == model.heads {
            heads
        } else {
            model.kv_heads
        };
        model.heads = heads;
    }
    for (name, field) in [
        ("layers", &mut model.layers),
        ("seq_len", &mut model.seq_len),
        ("vocab", &mut model.vocab),
        ("kv_heads", &mut model.kv_heads),
        ("ffn_hidden", &mut model.ffn_hidden),
    ] {
        if let Some(v) = int(name)? {
            *field = v;
        }
    }
    for (name, field) in [
        ("gated_mlp", &mut model.gated_mlp),
        ("tied_embeddings", &mut model.tied_embeddings),
        ("dropout", &mut model.dropout),
        ("linear_bias", &mut model.linear_bias),
        ("qk_layernorm", &mut model.qk_layernorm),
    ] {
        if let Some(text) = cell(name) {
            *field = parse_switch(name, text)?;
        }
    }
    // Megatron-LM's names, as its CI runs' table has them.
    if let Some(text) = cell("position_embedding") {
        model.no_positions = text == "none";
        model.learned_positions = match text {
            "learned_absolute" => true,
            other if POSITION_EMBEDDINGS.contains(&other) => false,
            other => {
                return Err(RowProblem::Invalid(format!(
                    "`position_embedding` must be one of {}, found `{other}`",
                    POSITION_EMBEDDINGS.join(", ")
                )));
            }
        };
        model.drop_scaling_unless_rotary();
    }
    if let Some(text) = cell("attention_backend") {
        // Megatron-LM's `local` backend is its own unfused attention, and so
        // is every backend of its local (non-Transformer Engine) layers.
        let local_layers = cell("transformer_impl") == Some("local");
        model.attention = match text {
            "unfused" | "local" => AttentionKind::Standard,
            _ if local_layers => AttentionKind::Standard,
            _ => AttentionKind::Flash,
        };
    }
    if let Some(text) = cell("attention") {
        model.attention = AttentionKind::parse("attention", text)?;
    }
    if let Some(width) = int("head_dim")? {
        model.head_dim_override = Some(width);
    }
    if let Some(rank) = int("kv_lora_rank")? {
        model.set_kv_lora_rank(rank);
        if let Some(mla) = model.mla.as_mut() {
            mla.q_lora_rank = match cell("q_lora_rank") {
                Some("0") | None => 0,
                Some(_) => int("q_lora_rank")?.unwrap_or(0),
            };
            for (name, field) in [
                ("qk_head_dim", &mut mla.qk_head_dim),
                ("qk_pos_head_dim", &mut mla.qk_pos_head_dim),
                ("v_head_dim", &mut mla.v_head_dim),
            ] {
                if let Some(v) = int(name)? {
                    *field = v;
                }
            }
        }
    }
    match cell("mtp_num_layers") {
        Some("0") => model.mtp_layers = 0,
        Some(_) => model.mtp_layers = int("mtp_num_layers")?.unwrap_or(0),
        None => {}
    }
    // A count of which 0 is a value (none of them), not an empty column.
    let count = |name: &str| -> Result<Option<u64>, String> {
        match cell(name) {
            Some("0") => Ok(Some(0)),
            _ => int(name),
        }
    };
    if let Some(experts) = int("num_experts")? {
        // Megatron-LM's defaults for the columns the row leaves empty.
        let defaults = MoeSpec::megatron_defaults(experts, model.ffn_hidden);
        model.moe = Some(MoeSpec {
            experts,
            topk: int("moe_topk")?.unwrap_or(defaults.topk),
            ffn_hidden: int("moe_ffn_hidden")?.unwrap_or(defaults.ffn_hidden),
            shared_ffn_hidden: count("moe_shared_ffn_hidden")?.unwrap_or(0),
            dense_layers: count("moe_dense_layers")?.unwrap_or(0),
            layer_freq: int("moe_layer_freq")?.unwrap_or(defaults.layer_freq),
            // Empty: unlimited routing, Megatron-LM's default.
            router_groups: count("moe_router_num_groups")?.unwrap_or(0),
            router_group_topk: count("moe_router_group_topk")?.unwrap_or(0),
            // The router (score, scaling, bias, precision) costs nothing; a
            // row has no column for it, so it is Megatron-LM's default.
            ..defaults
        });
    }
    if cell("num_experts").is_none() {
        // The model's own experts, re-shaped or re-routed by the row.
        let given = [
            ("moe_topk", int("moe_topk")?),
            ("moe_ffn_hidden", int("moe_ffn_hidden")?),
            ("moe_shared_ffn_hidden", count("moe_shared_ffn_hidden")?),
            ("moe_dense_layers", count("moe_dense_layers")?),
            ("moe_layer_freq", int("moe_layer_freq")?),
            ("moe_router_num_groups", count("moe_router_num_groups")?),
            ("moe_router_group_topk", count("moe_router_group_topk")?),
        ];
        if let Some((first, _)) = given.iter().find(|(_, v)| v.is_some()) {
            let Some(moe) = model.moe.as_mut() else {
                return Err(format!(
                    "column `{first}` shapes experts, and model `{}` has none: give the row's `num_experts` or leave it empty",
                    model.name
                )
                .into());
            };
            for (name, value) in given {
                let Some(value) = value else { continue };
                match name {
                    "moe_topk" => moe.topk = value,
                    "moe_ffn_hidden" => moe.ffn_hidden = value,
                    "moe_shared_ffn_hidden" => moe.shared_ffn_hidden = value,
                    "moe_dense_layers" => moe.dense_layers = value,
                    "moe_layer_freq" => moe.layer_freq = value,
                    "moe_router_num_groups" => moe.set_router_groups(value),
                    _ => moe.router_group_topk = value,
                }
            }
        }
    }
    match cell("sliding_window") {
        None | Some("0") if cell("window_attn_skip_freq").is_some_and(|f| f != "0") => {
            return Err(
                "`window_attn_skip_freq` needs a windowed attention: give the row's `sliding_window` or leave the column empty".to_string().into(),
            );
        }
        None | Some("0") => {}
        Some(_) => {
            model.window = Some(crate::model::WindowSpec {
                tokens: int("sliding_window")?.unwrap_or(0),
                full_every: match cell("window_attn_skip_freq") {
                    None | Some("0") => 0,
                    Some(_) => int("window_attn_skip_freq")?.unwrap_or(0),
                },
            });
        }
    }
    if cell("model").is_none() {
        model.name = format!("h{}-L{}", model.hidden, model.layers);
    }

    let gpus = required("gpus")?;
    let tp = required("tp")?;
    let pp = required("pp")?;
    let cp = int("cp")?.unwrap_or(1);
    let dp = match int("dp")? {
        Some(dp) => dp,
        None => gpus / (tp * pp * cp).max(1),
    };
    let ep = int("ep")?.unwrap_or(1);
    let etp = int("etp")?.unwrap_or(ParallelConfig::default_etp(model.moe.is_some(), tp));
    // A dense model has no dispatcher to choose: its cell (`alltoall` in
    // the tables paratune wrote before the default became Megatron-LM's) is
    // checked and left aside.
    let named_dispatcher = match cell("moe_dispatcher") {
        Some(text) => {
            Some(Dispatcher::parse("moe_dispatcher", text)?).filter(|_| model.moe.is_some())
        }
        None => None,
    };
    // Megatron-LM's CI names (`bf16+fp8-hybrid-tensorwise`) and paratune's.
    let precision = match cell("precision").map(str::to_lowercase) {
        Some(p) if p.contains("fp8") => Precision::Fp8,
        Some(p) if p == "nvfp4" => Precision::Nvfp4,
        Some(p) if p == "bf16" || p == "fp16" || p.is_empty() => Precision::Bf16,
        Some(other) => {
            return Err(RowProblem::Invalid(format!(
                "column `precision` must be bf16, fp8 or nvfp4 (or Megatron-LM's bf16+fp8-...), found `{other}`"
            )));
        }
        None => Precision::Bf16,
    };
    // The recipe a `fp8_recipe` cell names, else the one in Megatron-LM's
    // CI name; without either, the GPU's default (`None`).
    let fp8_recipe = match (cell("fp8_recipe"), cell("precision")) {
        (Some(text), _) => match published_fp8_recipe(text) {
            Some(recipe) => Some(recipe),
            None => Some(Fp8Recipe::parse("fp8_recipe", text)?),
        },
        (None, Some(p)) => published_fp8_recipe(p).or_else(|| {
            Fp8Recipe::ALL
                .into_iter()
                .find(|r| p.to_lowercase().ends_with(&format!("-{}", r.name())))
        }),
        (None, None) => None,
    }
    .filter(|_| precision == Precision::Fp8);
    if cell("fp8_recipe").is_some() && precision != Precision::Fp8 {
        return Err(format!(
            "column `fp8_recipe` names an FP8 recipe for a {} row; give `precision` fp8 or leave the recipe empty",
            precision.name()
        )
        .into());
    }
    // Unless the row names it, the exchange the flags would take.
    let cp_comm = match cell("cp_comm") {
        Some(text) => Some(CpComm::parse("cp_comm", text)?),
        None => None,
    };
    let global_batch = required("global_batch")?;
    let micro_batch = required("micro_batch")?;

    let mut schedule = match cell("schedule") {
        Some(text) => ScheduleKind::parse("schedule", text)?,
        None => defaults.schedule,
    };
    let mut virtual_stages = int("virtual_stages")?.unwrap_or(defaults.virtual_stages);
    if let Some(per_chunk) = int("layers_per_virtual_stage")? {
        if per_chunk == 0 || !model.layers.is_multiple_of(pp * per_chunk) {
            return Err(RowProblem::Invalid(format!(
                "layers_per_virtual_stage {per_chunk} does not divide the {} layers of each of {pp} stages",
                model.layers / pp.max(1)
            )));
        }
        virtual_stages = model.layers / (pp * per_chunk);
        schedule = if virtual_stages > 1 {
            ScheduleKind::Interleaved
        } else {
            ScheduleKind::OneFOneB
        };
    }
    // Model chunks per stage without a schedule column: interleaved (how
    // Megatron-LM runs them).
    if cell("schedule").is_none() && virtual_stages > 1 && pp > 1 {
        schedule = ScheduleKind::Interleaved;
    }
    if schedule != ScheduleKind::Interleaved {
        virtual_stages = 1;
    }
    let switch = |name: &str, default: bool| -> Result<bool, String> {
        cell(name).map_or(Ok(default), |text| parse_switch(name, text))
    };
    let engine = match cell("engine") {
        Some(text) => Engine::parse("engine", text)?,
        None => defaults.engine,
    };
    // A row without a dispatcher runs its engine's.
    let dispatcher =
        named_dispatcher.unwrap_or_else(|| Dispatcher::of_engine(engine, model.moe.is_some()));
    let optimizer_sharding = match (cell("optimizer_sharding"), cell("distributed_optimizer")) {
        (Some(text), _) => OptimizerSharding::parse("optimizer_sharding", text)?,
        // Megatron-LM's own switch, as megatron_ci_runs.csv has it.
        (None, Some(text)) => {
            if parse_switch("distributed_optimizer", text)? {
                OptimizerSharding::OptimizerStates
            } else {
                OptimizerSharding::None
            }
        }
        (None, None) if dp == 1 => OptimizerSharding::None,
        (None, None) => defaults.optimizer_sharding,
    };
    let (first_stage_layers, last_stage_layers) = end_stage_layers(
        &model,
        pp,
        virtual_stages,
        int("first_stage_layers")?,
        int("last_stage_layers")?,
        switch("account_for_embedding_in_split", false)?,
        switch("account_for_loss_in_split", false)?,
    )?;
    let config = ParallelConfig {
        tp,
        pp,
        dp,
        fp8_recipe,
        micro_batch,
        schedule,
        virtual_stages,
        recompute: match cell("recompute") {
            Some(text) => Recompute::parse("recompute", text)?,
            None => defaults.recompute,
        },
        // Megatron-LM reads the modules under selective recomputation only.
        recompute_modules: match (cell("recompute"), cell("recompute_modules")) {
            (Some(r), Some(text)) if r.eq_ignore_ascii_case("selective") => {
                RecomputeModules::parse("recompute_modules", text)?
            }
            _ => RecomputeModules::default(),
        },
        sequence_parallel: match cell("sequence_parallel") {
            Some(text) => parse_switch("sequence_parallel", text)?,
            None => defaults.sequence_parallel && tp > 1,
        },
        optimizer_sharding,
        bpipe: switch("bpipe", defaults.bpipe)?,
        attention: model.attention,
        first_stage_layers,
        last_stage_layers,
        overlap_grad_reduce: switch("overlap_grad_reduce", defaults.overlap_grad_reduce)?,
        overlap_param_gather: switch("overlap_param_gather", defaults.overlap_param_gather)?,
        tp_comm_overlap: switch("tp_comm_overlap", defaults.tp_comm_overlap)?,
        ep_comm_overlap: switch("ep_comm_overlap", false)?,
        // Megatron-LM's default: 16-bit weights.
        fp8_param_gather: switch("fp8_param_gather", false)?,
        // The allocator the engine's launcher sets.
        expandable_segments: switch("expandable_segments", engine.launches_expandable_segments())?,
        grad_reduce: match cell("grad_reduce") {
            Some(text) => GradReduce::parse("grad_reduce", text)?,
            None => GradReduce::Fp32,
        },
        // Megatron-LM's default: `--cross-entropy-loss-fusion` off.
        cross_entropy_fusion: match cell("cross_entropy_fusion") {
            Some(text) => CrossEntropyFusion::parse("cross_entropy_fusion", text)?,
            None => CrossEntropyFusion::Off,
        },
        // Megatron-LM's default: `--defer-embedding-wgrad-compute` off.
        wgrad_deferral: match cell("wgrad_deferral") {
            Some(text) => WgradDeferral::parse("wgrad_deferral", text)?,
            None => WgradDeferral::Off,
        },
        cpu_offload_layers: match cell("cpu_offload_layers") {
            Some("0") | None => 0,
            Some(_) => int("cpu_offload_layers")?.unwrap_or(0),
        },
        cuda_graphs: match cell("cuda_graphs") {
            Some(text) => CudaGraphs::parse("cuda_graphs", text)?,
            None => defaults.cuda_graphs,
        },
        stage_order: match cell("stage_order") {
            Some(text) => StageOrder::parse("stage_order", text)?,
            None => StageOrder::Megatron,
        },
        engine,
        compile: switch("compile", defaults.compile)?,
        ac_frequency: int("ac_frequency")?.unwrap_or(defaults.ac_frequency),
        // A shard group of all of dp is plain sharding.
        dp_shard: int("dp_shard")?.filter(|&n| n != dp),
        cp,
        cp_comm: cp_comm.unwrap_or_else(|| CpComm::default_for(engine, &model, tp, cp)),
        cp_a2a: int("cp_a2a")?.unwrap_or(1),
        ep,
        etp,
        dispatcher,
        precision,
        embedding_sync: match cell("embedding_sync") {
            Some(text) => SyncMethod::parse("embedding_sync", text)?,
            None => SyncMethod::AllReduce,
        },
    };

    let measured_s = match (real("iter_ms")?, real("tflops_per_gpu")?) {
        (Some(ms), _) => Some(ms / 1e3),
        // Published benchmarks' rate: the iteration's tokens over it.
        (None, _) if cell("tokens_per_s_per_gpu").is_some() => real("tokens_per_s_per_gpu")?
            .map(|rate| (global_batch * model.seq_len) as f64 / (rate * gpus as f64)),
        (None, Some(tflops)) => {
            // The SC'21 table reports throughput from its FLOP formula; turn it
            // back into time with the same formula (recomputation included).
            let flops = measured_flops(&model, &config, global_batch);
            Some(flops / (tflops * 1e12 * gpus as f64))
        }
        (None, None) => None,
    };
    // A microsecond to a week: beyond, a unit or a digit went wrong, and
    // the errors would overflow.
    if let Some(seconds) = measured_s.filter(|s| !(1e-6..=604_800.0).contains(s)) {
        let column = ["iter_ms", "tokens_per_s_per_gpu", "tflops_per_gpu"]
            .into_iter()
            .find(|c| cell(c).is_some())
            .unwrap_or("iter_ms");
        return Err(format!(
            "column `{column}` gives an iteration of {seconds:.3e} s, outside a microsecond to a week; check the value and its unit"
        )
        .into());
    }
    let gpu = cell("gpu").map(|name| {
        crate::cluster::builtin_gpu(name)
            .map(|g| g.name)
            .ok_or_else(|| {
                format!(
                    "column `gpu` is `{name}`, not a built-in GPU{}",
                    crate::suggest::did_you_mean(name, &crate::cluster::builtin_gpu_names())
                )
            })
    });
    let gpu = gpu.transpose()?;
    let gib = |name: &str| -> Result<Option<f64>, String> {
        match cell(name) {
            None => Ok(None),
            Some(text) => match text.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 && v < 1e6 => Ok(Some(v * GIB)),
                _ => Err(format!(
                    "column `{name}` must be a positive number of GiB without a unit, found `{text}`"
                )),
            },
        }
    };
    let allocated = gib("peak_allocated_gib")?;
    let reserved = gib("peak_reserved_gib")?;
    let rank = match cell("memory_rank") {
        Some(text) => MemoryRank::parse("memory_rank", text)?,
        None => defaults.memory_rank,
    };
    let measured_memory = (allocated.is_some() || reserved.is_some()).then_some(MeasuredMemory {
        allocated,
        reserved,
        rank,
    });
    Ok(Run {
        line: 0,
        model,
        config,
        global_batch,
        gpus,
        gpu,
        gpus_per_node: int("gpus_per_node")?,
        measured_s,
        measured_memory,
    })
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The first and last stage layers a row gives: its own columns, or
/// Megatron-LM's [`accounted_split`](crate::config::accounted_split).
fn end_stage_layers(
    model: &ModelSpec,
    pp: u64,
    virtual_stages: u64,
    first: Option<u64>,
    last: Option<u64>,
    embedding_in_split: bool,
    loss_in_split: bool,
) -> Result<(Option<u64>, Option<u64>), String> {
    if !(embedding_in_split || loss_in_split) {
        return Ok((first, last));
    }
    if first.is_some() || last.is_some() {
        return Err(
            "account_for_*_in_split and first_stage_layers/last_stage_layers exclude each other (as in Megatron-LM); give one or the other"
                .into(),
        );
    }
    if pp < 2 {
        return Ok((None, None)); // one stage holds everything anyway
    }
    crate::config::accounted_split(
        model.layers,
        pp,
        virtual_stages.max(1),
        embedding_in_split,
        loss_in_split,
    )
    .ok_or_else(|| {
        format!(
            "layers {} with the embedding and loss counted make {}, which does not divide over pp x virtual stages = {}",
            model.layers,
            model.layers + u64::from(embedding_in_split) + u64::from(loss_in_split),
            pp.saturating_mul(virtual_stages).max(1)
        )
    })
}

/// The largest value a whole-number column may hold: far above any model
/// or machine, and small enough that products of degrees cannot overflow.
fn column_limit(name: &str) -> u64 {
    match name {
        "vocab" | "seq_len" | "sliding_window" => 1 << 24,
        "ffn_hidden" | "moe_ffn_hidden" | "moe_shared_ffn_hidden" => 1 << 22,
        "hidden" | "gpus" | "global_batch" | "micro_batch" | "tp" | "dp" => 1 << 20,
        _ => 1 << 16,
    }
}

fn measured_flops(model: &ModelSpec, config: &ParallelConfig, global_batch: u64) -> f64 {
    let tokens = (global_batch * model.seq_len) as f64;
    model.model_flops_per_iteration(global_batch)
        + tokens * config.recomputed_flops_per_token(model)
}

pub use crate::choice::{parse_choice, parse_switch};

/// The model's columns a table needs unless the model is given with it.
const MODEL_COLUMNS: [&str; 3] = ["hidden", "heads", "layers"];

/// Checks that an ingest's row columns start with run-table columns in the
/// table's order, so a renamed or reordered schema column cannot drift from
/// what ingest writes, and that the rest (the log's own measurements) are
/// not near enough to a schema column to be taken for a typo.
#[cfg(test)]
pub(crate) fn assert_row_columns_follow_the_schema(columns: &[&str]) {
    let schema: Vec<&str> = columns
        .iter()
        .copied()
        .filter(|c| KNOWN_COLUMNS.contains(c))
        .collect();
    let in_order: Vec<&str> = KNOWN_COLUMNS
        .iter()
        .copied()
        .filter(|c| schema.contains(c))
        .collect();
    assert_eq!(schema, in_order);
    assert!(
        columns[..schema.len()]
            .iter()
            .all(|c| KNOWN_COLUMNS.contains(c))
    );
    assert!(schema.contains(&"iter_ms") && schema.len() >= 20);
    for extra in &columns[schema.len()..] {
        for known in KNOWN_COLUMNS {
            assert!(
                crate::suggest::edit_distance(extra, known) > 2,
                "{extra} ~ {known}"
            );
        }
    }
}

/// The `position_embedding` values a run table may give, Megatron-LM's
/// names: learned positions, or rotary ones (`rope`, and YaRN's and
/// M-RoPE's scalings of it), or none (NoPE).
pub const POSITION_EMBEDDINGS: [&str; 5] = ["learned_absolute", "rope", "yarn", "mrope", "none"];

/// Every column a run table may use; others are carried through untouched.
pub const KNOWN_COLUMNS: [&str; 92] = [
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
    "first_stage_layers",
    "last_stage_layers",
    "account_for_embedding_in_split",
    "account_for_loss_in_split",
    "distributed_optimizer",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "tp_comm_overlap",
    "ep_comm_overlap",
    "fp8_param_gather",
    "expandable_segments",
    "grad_reduce",
    "cross_entropy_fusion",
    "wgrad_deferral",
    "cpu_offload_layers",
    "cuda_graphs",
    "stage_order",
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
    "layers_per_virtual_stage",
    "bpipe",
    "attention",
    "optimizer_sharding",
    "iter_ms",
    "tflops_per_gpu",
    "tokens_per_s_per_gpu",
    "model",
    "gpus_per_node",
    // Informational (gpus / gpus_per_node, and free text): named here so
    // neither is taken for a misspelt `model` or `nodes`.
    "nodes",
    "note",
    "dropout",
    "engine",
    "compile",
    "ac_frequency",
    "dp_shard",
    "gpu",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "memory_rank",
    "position_embedding",
    "attention_backend",
    // Context and expert parallelism, and the experts (Megatron-LM's CI
    // runs' names).
    "cp",
    "cp_comm",
    "ep",
    "etp",
    "num_experts",
    "mtp_num_layers",
    "moe_topk",
    "moe_ffn_hidden",
    "moe_shared_ffn_hidden",
    "moe_dense_layers",
    "moe_layer_freq",
    "moe_dispatcher",
    "cp_a2a",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "sliding_window",
    "window_attn_skip_freq",
    "embedding_sync",
    "head_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_head_dim",
    "qk_pos_head_dim",
    "v_head_dim",
    "multi_latent_attention",
    "precision",
    "fp8_recipe",
    "model_family",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
    "transformer_impl",
];

/// A column one or two letters away from a known one is a typo, not a
/// column of the user's own: `recompte` would otherwise be ignored and the
/// flag's value used instead.
fn check_column_names(table: &RunTable) -> Result<(), RunsError> {
    for header in &table.headers {
        if KNOWN_COLUMNS.contains(&header.as_str()) {
            continue;
        }
        let near = KNOWN_COLUMNS
            .iter()
            .map(|k| (crate::suggest::edit_distance(header, k), *k))
            .filter(|(d, _)| *d <= 2)
            .min_by_key(|(d, _)| *d);
        if let Some((_, known)) = near {
            return Err(RunsError::Table {
                path: table.path.clone(),
                message: format!(
                    "unknown column `{header}`; did you mean `{known}`? (rename it, or give it a name further from paratune's columns)"
                ),
            });
        }
    }
    Ok(())
}

/// Two rows with the same configuration whose times differ by more than a
/// factor of 1.5 cannot both be right.
fn contradictions(runs: &[Run]) -> Vec<(usize, String)> {
    let mut seen: std::collections::HashMap<(String, ParallelConfig), (usize, f64)> =
        std::collections::HashMap::new();
    let mut found = Vec::new();
    for run in runs {
        let Some(time) = run.measured_s else { continue };
        let key = (run.group_key(), run.config);
        if let Some(&(line, other)) = seen.get(&key) {
            if time.max(other) / time.min(other) > 1.5 {
                found.push((
                    run.line,
                    format!(
                        "same configuration as line {line} but {:.1} ms against {:.1} ms",
                        time * 1e3,
                        other * 1e3
                    ),
                ));
            }
        } else {
            seen.insert(key, (run.line, time));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    /// The node the tables below run on where a row does not say.
    const EIGHT_A100S: BaseNode = BaseNode::DGX_A100;
    use super::*;

    fn defaults() -> RowDefaults {
        RowDefaults::gpt(50257, 1024, AttentionKind::Flash, Recompute::Full)
    }

    const HEADER: &str = "gpus,global_batch,micro_batch,hidden,heads,layers,seq_len,tp,dp,pp";

    #[test]
    fn rows_become_runs_with_defaults_for_absent_columns() {
        let text = format!("{HEADER},iter_ms,note\n8,16,2,1024,16,24,1024,2,2,2,219.7,first\n");
        let table = RunTable::parse(&text, "t.csv").unwrap();
        let runs = runs_from_table(&table, &defaults(), EIGHT_A100S).unwrap();
        assert_eq!(runs[0].config.recompute, Recompute::Full);
        assert_eq!(runs[0].config.micro_batches(16), 4);
        assert!((runs[0].measured_s.unwrap() - 0.2197).abs() < 1e-12);
    }

    /// An MoE row without `etp` or `moe_dispatcher` takes the defaults a
    /// configuration and `predict` take (Megatron-LM's: etp = tp, the
    /// allgather dispatcher); a dense row's dispatcher cell, which
    /// paratune's own tables wrote as `alltoall`, leaves it the default.
    #[test]
    fn rows_without_expert_cells_take_the_one_default() {
        let text = format!(
            "{HEADER},num_experts,moe_topk,sequence_parallel,ep,iter_ms\n8,16,2,1024,16,24,1024,2,4,1,8,2,on,2,100\n"
        );
        let table = RunTable::parse(&text, "t.csv").unwrap();
        let runs = runs_from_table(&table, &defaults(), EIGHT_A100S).unwrap();
        let c = runs[0].config;
        assert_eq!(c.dispatcher, ParallelConfig::default().dispatcher);
        assert_eq!(c.dispatcher, Dispatcher::AllGather);
        assert_eq!(c.etp, ParallelConfig::default_etp(true, 2));
        assert_eq!(c.etp, 2);
        for cell in ["alltoall", "allgather"] {
            let text = format!(
                "{HEADER},moe_dispatcher,iter_ms\n8,16,2,1024,16,24,1024,2,2,2,{cell},100\n"
            );
            let table = RunTable::parse(&text, "t.csv").unwrap();
            let runs = runs_from_table(&table, &defaults(), EIGHT_A100S).unwrap();
            assert_eq!(runs[0].config.dispatcher, Dispatcher::default(), "{cell}");
            assert_eq!(runs[0].config.etp, 1);
        }
    }

    /// A row on the base node's GPU without `gpus_per_node` uses the base
    /// node (a cluster file's six A100s a node), not the GPU's built-in
    /// eight; a row on another GPU uses that GPU's built-in node.
    #[test]
    fn a_row_without_its_node_size_takes_the_base_node_of_its_gpu() {
        let text = "model,gpu,gpus,global_batch,micro_batch,seq_len,tp,pp\n\
                    llama3-8b,a100-80gb,8,8,1,8192,4,1\n\
                    llama3-8b,gb200,144,144,1,8192,1,1\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let six = BaseNode {
            gpu: "a100-80gb",
            gpus_per_node: 6,
        };
        let runs = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap();
        assert_eq!(EIGHT_A100S.gpus_per_node_of(&runs.runs[0]), 8);
        assert_eq!(six.gpus_per_node_of(&runs.runs[0]), 6);
        assert_eq!(six.gpus_per_node_of(&runs.runs[1]), 72);
        // Four-way tensor parallelism neither divides a six-GPU node nor
        // spans whole ones: the row is checked against the node it will be
        // predicted on.
        let err = runs_from_table(&table, &defaults(), six)
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 2") && err.contains("tp"), "{err}");
    }

    /// The precisions NVIDIA's tables print ("FP8-CS", "FP8-MX") name
    /// their recipes, in either column; NVFP4 reads as itself.
    #[test]
    fn published_precision_names_read_as_their_recipes() {
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,precision,fp8_recipe\n\
                    llama3-8b,b200,8,128,1,1,1,FP8-CS,\n\
                    llama3-8b,b200,8,128,1,1,1,fp8,FP8-MX\n\
                    llama3-8b,b200,8,128,1,1,1,NVFP4,\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let runs = runs_from_table(&table, &defaults(), EIGHT_A100S).unwrap();
        let c: Vec<_> = runs
            .iter()
            .map(|r| (r.config.precision, r.config.fp8_recipe))
            .collect();
        assert_eq!(
            c,
            [
                (Precision::Fp8, Some(Fp8Recipe::Tensorwise)),
                (Precision::Fp8, Some(Fp8Recipe::Mxfp8)),
                (Precision::Nvfp4, None)
            ]
        );
    }

    /// What a row cannot mean is refused by its column, as the flags are:
    /// experts' shapes on a model without experts, an MXFP8 recipe off
    /// Blackwell, more prediction modules or a longer window than
    /// paratune plans, an implausible rate; and a table whose every row
    /// is left out says so rather than fitting or scoring nothing.
    #[test]
    fn rows_are_refused_by_column_as_the_flags_are() {
        let refused = |extra_header: &str, extra_cell: &str| {
            let text = format!(
                "model,gpu,gpus,global_batch,micro_batch,tp,pp,precision,tokens_per_s_per_gpu,{extra_header}\n\
                 llama3-8b,h100-sxm,8,128,1,1,1,fp8,9000,{extra_cell}\n"
            );
            let table = RunTable::parse(&text, "t.csv").unwrap();
            runs_and_skipped(&table, &defaults(), EIGHT_A100S)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        for (header, cell, says) in [
            ("moe_topk", "2", "`num_experts`"),
            ("moe_ffn_hidden", "-5", "`moe_ffn_hidden`"),
            ("fp8_recipe", "mxfp8", "Blackwell"),
            ("mtp_num_layers", "1000", "more than paratune plans for"),
            ("sliding_window", "20000000", "more than paratune plans for"),
            ("moe_router_num_groups", "4", "`num_experts`"),
            ("moe_layer_freq", "2", "`num_experts`"),
            ("note", "x", ""),
        ] {
            let err = refused(header, cell);
            assert_eq!(err.is_empty(), says.is_empty(), "{header}: {err}");
            assert!(err.contains(says), "{header}: {err}");
        }
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,tokens_per_s_per_gpu\n\
                    llama3-8b,h100-sxm,8,128,1,1,1,1e308\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let err = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap_err();
        assert!(
            err.to_string().contains("outside a microsecond to a week"),
            "{err}"
        );
        // An MoE model's own experts take the row's top-k.
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,ep,moe_topk\n\
                    qwen3-30b-a3b,h100-sxm,8,128,1,1,1,8,4\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let runs = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap();
        assert_eq!(runs.runs[0].model.moe.unwrap().topk, 4);
        // Group-limited routing on the model's own experts is checked as
        // the flags' is: 7 groups do not split 128 experts.
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,ep,moe_router_num_groups\n\
                    qwen3-30b-a3b,h100-sxm,8,128,1,1,1,8,7\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let err = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap_err();
        assert!(
            err.to_string().contains("must divide the 128 experts"),
            "{err}"
        );
        // A recipe on a bf16 row, and MXFP8 named by the precision column
        // on Hopper: each blamed on its own column.
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,precision,fp8_recipe\n\
                    llama3-8b,h100-sxm,8,128,1,1,1,bf16,tensorwise\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let err = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap_err();
        assert!(
            err.to_string()
                .contains("`fp8_recipe` names an FP8 recipe for a bf16 row"),
            "{err}"
        );
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,precision\n\
                    llama3-8b,h100-sxm,8,128,1,1,1,FP8-MX\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let err = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap_err();
        assert!(
            err.to_string().contains("column `precision`: MXFP8"),
            "{err}"
        );
        // A windowed model's row with cp takes the exchange the flags would.
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,cp,ep,seq_len\n\
                    gpt-oss-20b,h100-sxm,8,8,1,1,1,2,4,8192\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let runs = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap();
        assert_eq!(runs.runs[0].config.cp_comm, CpComm::A2a);
        // Every row left out (FP8 on an A100).
        let text = "model,gpu,gpus,global_batch,micro_batch,tp,pp,precision\n\
                    llama3-8b,a100-80gb,8,128,1,1,1,fp8\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let runs = runs_and_skipped(&table, &defaults(), EIGHT_A100S).unwrap();
        let why = runs.none_left().unwrap();
        assert!(
            why.contains("no row is left to use") && why.contains("FP8"),
            "{why}"
        );
    }

    /// A published benchmark's row: a built-in model by name, its rate in
    /// tokens per second per GPU, and 64 GPUs used of each 72-GPU node.
    #[test]
    fn a_row_may_name_a_built_in_model_and_give_its_rate() {
        let text = "model,gpu,gpus,gpus_per_node,global_batch,micro_batch,seq_len,tp,pp,tokens_per_s_per_gpu,note\n\
                    llama3-70b,gb200,128,64,128,1,8192,4,2,4000,published\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let runs = runs_from_table(&table, &defaults(), EIGHT_A100S).unwrap();
        let run = &runs[0];
        assert_eq!(run.model.name, "llama3-70b");
        assert_eq!((run.model.layers, run.model.seq_len), (80, 8192));
        assert_eq!(run.gpus_per_node, Some(64));
        assert_eq!(run.config.dp, 16);
        // 128 sequences of 8,192 tokens over 128 GPUs at 4,000 each.
        assert!((run.measured_s.unwrap() - 128.0 * 8192.0 / (4000.0 * 128.0)).abs() < 1e-9);
        let unknown = RunTable::parse(
            "model,gpus,global_batch,micro_batch,tp,pp\nllama3-7b,8,8,1,1,1\n",
            "t.csv",
        )
        .unwrap();
        let err = runs_from_table(&unknown, &defaults(), EIGHT_A100S)
            .unwrap_err()
            .to_string();
        let empty = RunTable::parse(
            "model,gpus,global_batch,micro_batch,tp,pp\n,8,8,1,1,1\n",
            "t.csv",
        )
        .unwrap();
        let empty = runs_from_table(&empty, &defaults(), EIGHT_A100S)
            .unwrap_err()
            .to_string();
        assert!(
            empty.contains("column `model` is empty and so is `hidden`"),
            "{empty}"
        );
        assert!(
            err.contains("column `model`") && err.contains("did you mean"),
            "{err}"
        );
    }

    /// The model switches Megatron-LM's CI arguments carry read onto the
    /// row's model: `--disable-bias-linear` and `--qk-layernorm`.
    #[test]
    fn bias_and_query_key_norm_cells_set_the_model() {
        let text = format!(
            "{HEADER},linear_bias,qk_layernorm,iter_ms\n\
             8,16,2,1024,16,24,1024,2,2,2,off,on,219.7\n\
             8,16,2,1024,16,24,1024,2,2,2,,,219.7\n"
        );
        let table = RunTable::parse(&text, "t.csv").unwrap();
        let runs = runs_from_table(&table, &defaults(), EIGHT_A100S).unwrap();
        assert!(!runs[0].model.linear_bias && runs[0].model.qk_layernorm);
        assert!(runs[1].model.linear_bias && !runs[1].model.qk_layernorm);
        let bad = RunTable::parse(
            &format!("{HEADER},qk_layernorm,iter_ms\n8,16,2,1024,16,24,1024,2,2,2,yes please,1\n"),
            "t.csv",
        )
        .unwrap();
        let err = runs_from_table(&bad, &defaults(), EIGHT_A100S)
            .unwrap_err()
            .to_string();
        assert!(err.contains("qk_layernorm"), "{err}");
    }

    /// Megatron-LM's account-for split holds the embedding and the loss as
    /// a layer each: 126 + 2 layers over 8 stages of 8 chunks.
    #[test]
    fn the_account_for_split_counts_embedding_and_loss() {
        assert_eq!(
            crate::config::accounted_split(126, 8, 8, true, true),
            Some((Some(15), Some(15)))
        );
        assert_eq!(
            crate::config::accounted_split(127, 8, 8, true, false),
            Some((Some(15), None))
        );
        assert_eq!(crate::config::accounted_split(126, 8, 4, true, false), None);
        assert_eq!(crate::config::accounted_split(126, 1, 1, true, true), None);
    }

    #[test]
    fn a_mistyped_column_is_named_with_the_known_one() {
        let text = format!("{HEADER},recompte\n8,16,2,1024,16,24,1024,2,2,2,none\n");
        let table = RunTable::parse(&text, "t.csv").unwrap();
        let err = runs_from_table(&table, &defaults(), EIGHT_A100S)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`recompte`") && err.contains("`recompute`"),
            "{err}"
        );
    }

    #[test]
    fn an_impossible_row_is_reported_by_its_line() {
        let text = format!(
            "{HEADER},iter_ms\n8,16,2,1024,16,24,1024,2,2,2,219.7\n8,16,2,1024,16,24,1024,2,2,4,219.7\n"
        );
        let table = RunTable::parse(&text, "t.csv").unwrap();
        let err = runs_from_table(&table, &defaults(), EIGHT_A100S)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 3") && err.contains("tp x pp x dp"),
            "{err}"
        );
    }

    #[test]
    fn contradicting_duplicates_are_refused_and_non_positive_times_too() {
        let text = format!(
            "{HEADER},iter_ms\n8,16,2,1024,16,24,1024,2,2,2,200\n8,16,2,1024,16,24,1024,2,2,2,400\n"
        );
        let table = RunTable::parse(&text, "t.csv").unwrap();
        let err = runs_from_table(&table, &defaults(), EIGHT_A100S)
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3") && err.contains("line 2"), "{err}");
        let text = format!("{HEADER},iter_ms\n8,16,2,1024,16,24,1024,2,2,2,-5\n");
        let table = RunTable::parse(&text, "t.csv").unwrap();
        let err = runs_from_table(&table, &defaults(), EIGHT_A100S)
            .unwrap_err()
            .to_string();
        assert!(err.contains("iter_ms") && err.contains("positive"), "{err}");
    }
}
