//! Launch scripts for trial runs of a plan: for each candidate of a plan
//! file, a bash script that runs Megatron-LM's `pretrain_gpt.py` with the
//! candidate's arguments for a few iterations on synthetic data, logging
//! every iteration, so that `paratune ingest megatron-log` can read back what
//! the candidate really takes.
//!
//! The flags the scripts add are those of Megatron-LM's
//! `megatron/training/arguments.py` (NVIDIA/Megatron-LM main, commit
//! 000c4ac, the commit `export/megatron.rs` was checked against):
//! `group.add_argument('--train-iters', type=int, ...)` and
//! `group.add_argument('--log-interval', type=int, default=100, ...)`
//! (`_add_training_args`), `group.add_argument('--log-throughput',
//! action='store_true', ...)` (`_add_logging_args`),
//! `group.add_argument('--eval-iters', type=int, default=100, ...)`
//! (`_add_validation_args`), `group.add_argument('--mock-data',
//! action='store_true', ...)` (`_add_data_args`), `--tokenizer-type` with the
//! choice `'NullTokenizer'` and `--vocab-size` (`_add_tokenizer_args`), and
//! `--lr` (`_add_learning_rate_args`, default `None`, which the optimizer
//! cannot use).
//!
//! [`launch_script`] is pure; [`write_launch_scripts`] checks the Megatron-LM
//! checkout and writes the scripts atomically.

use crate::export::{LaunchJob, megatron_args};
use crate::plan_file::{PlanFile, PlannedCandidate};
use crate::text::{comment_safe, shell_quote};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Iterations a trial runs by default: enough for a steady state after the
/// warm-up that `ingest` leaves out.
pub const DEFAULT_TRAIN_ITERS: u64 = 20;
/// Fewer iterations leave nothing after the default warm-up of
/// [`crate::validate::megatron_log::DEFAULT_WARMUP`] logged iterations.
pub const MIN_TRAIN_ITERS: u64 = crate::validate::megatron_log::DEFAULT_WARMUP as u64 + 1;
const MEGATRON: &str = "Megatron-LM";
/// The learning rate of the trial: any positive value times the same.
const TRIAL_LR: &str = "1.0e-4";

/// How the processes of a trial are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// PyTorch's `torchrun`, one call per node (`NNODES`, `NODE_RANK`,
    /// `MASTER_ADDR` from the environment, defaults for one node).
    Torchrun,
    /// Slurm's `srun`, one task per GPU, inside an allocation.
    Srun,
}

impl Launcher {
    pub const ALL: [Launcher; 2] = [Launcher::Torchrun, Launcher::Srun];

    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Srun => "srun",
        }
    }
}

/// What every script of a plan shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSettings {
    /// The Megatron-LM checkout (the folder holding `pretrain_gpt.py`). The
    /// script's default for `MEGATRON_PATH`; without it the script needs
    /// `MEGATRON_PATH` set when it runs.
    pub megatron_path: Option<PathBuf>,
    pub launcher: Launcher,
    pub train_iters: u64,
}

impl LaunchSettings {
    pub fn new(megatron_path: Option<PathBuf>, launcher: Launcher) -> Self {
        LaunchSettings {
            megatron_path,
            launcher,
            train_iters: DEFAULT_TRAIN_ITERS,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(
        "no Megatron-LM checkout given; pass --megatron-path DIR, the folder of a Megatron-LM clone (git clone https://github.com/NVIDIA/Megatron-LM) that holds pretrain_gpt.py"
    )]
    NoMegatronPath,
    #[error(
        "--megatron-path {path}: {problem}; pass the folder of a Megatron-LM clone (git clone https://github.com/NVIDIA/Megatron-LM) that holds pretrain_gpt.py"
    )]
    BadMegatronPath { path: String, problem: String },
    #[error("candidate {rank}: {engine} cannot run it as planned: {reason}")]
    Unsupported {
        rank: usize,
        engine: &'static str,
        reason: String,
    },
    #[error(
        "--torchtitan-config {value}: {problem}; give MODULE:CONFIG for torchtitan 0.3 (a config function, e.g. llama3:llama3_8b) or a torchtitan 0.2 job-config TOML"
    )]
    BadTorchtitanConfig { value: String, problem: String },
    #[error(
        "--torchtitan-config {path}: {base} builds {built}, but the plan is for {planned}; give a base that builds the plan's model, or plan for {built}"
    )]
    BaseModelDiffers {
        path: String,
        base: String,
        built: String,
        planned: String,
    },
    #[error(
        "candidate {rank}: the plan file's megatron_args do not match its config ({difference}); the file was edited: re-run `paratune plan ... --format json`"
    )]
    ArgumentsDiffer { rank: usize, difference: String },
    #[error(
        "--train-iters {0} leaves no iteration after the warm-up; give at least {MIN_TRAIN_ITERS} (default {DEFAULT_TRAIN_ITERS})"
    )]
    TooFewIterations(u64),
    #[error(
        "the plan's {gpus} GPUs do not fill whole nodes of {gpus_per_node}; {launcher} starts the same number of processes on every node, so plan for a multiple of {gpus_per_node} GPUs (or fewer than one node)"
    )]
    UnevenNodes {
        gpus: u64,
        gpus_per_node: u64,
        launcher: &'static str,
    },
    #[error(
        "--ranks {given}: the plan's candidates use {needed} GPUs, one rank each; give --ranks {needed}, or plan for a cluster of {given} (e.g. --cluster-from-profile DIR --gpus-per-node {given})"
    )]
    Ranks { given: u64, needed: u64 },
    #[error("cannot write {path}: {message}")]
    Write { path: String, message: String },
}

/// What happened to one candidate of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScriptOutcome {
    Written {
        rank: usize,
        path: PathBuf,
    },
    /// No script: Megatron-LM cannot run the candidate (its `megatron_unsupported`).
    Skipped {
        rank: usize,
        reason: String,
    },
}

/// The checkout at `path` as an absolute folder, if it holds `pretrain_gpt.py`.
pub fn check_megatron_path(path: Option<&Path>) -> Result<PathBuf, LaunchError> {
    let path = path.ok_or(LaunchError::NoMegatronPath)?;
    let bad = |problem: String| LaunchError::BadMegatronPath {
        path: path.display().to_string(),
        problem,
    };
    let absolute = std::fs::canonicalize(path).map_err(|e| bad(format!("not found ({e})")))?;
    if !absolute.is_dir() {
        return Err(bad("is not a folder".into()));
    }
    if !absolute.join("pretrain_gpt.py").is_file() {
        return Err(bad("has no pretrain_gpt.py".into()));
    }
    Ok(absolute)
}

/// The GPUs one launcher node of `plan`'s cluster holds: its node, or the
/// host within it where the GPU's NVLink domain spans several hosts (an
/// NVL72 rack's four-GPU trays), when the hosts tile the planned node.
pub(crate) fn launcher_node_gpus(plan: &PlanFile) -> u64 {
    let node = plan.nodes.gpus_per_node;
    crate::cluster::gpus_per_host(&plan.nodes.gpu.name)
        .filter(|&host| host > 0 && node.is_multiple_of(host))
        .unwrap_or(node)
}

/// Processes per node and nodes for `gpus` GPUs on nodes of `gpus_per_node`.
pub(crate) fn node_shape(
    gpus: u64,
    gpus_per_node: u64,
    launcher: Launcher,
) -> Result<(u64, u64), LaunchError> {
    let per_node = gpus_per_node.max(1);
    if gpus <= per_node {
        Ok((gpus.max(1), 1))
    } else if gpus.is_multiple_of(per_node) {
        Ok((per_node, gpus / per_node))
    } else {
        Err(LaunchError::UnevenNodes {
            gpus,
            gpus_per_node: per_node,
            launcher: launcher.name(),
        })
    }
}

/// The script lines that say where the ranks run (`GPUS_PER_NODE`,
/// `NNODES`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, each overridable
/// from the environment), check that they add up to the plan's GPUs, and
/// name the log (`LOG_FILE`: `run.log`, or `run-node<rank>.log` per node).
pub(crate) fn rank_environment(
    s: &mut String,
    launcher: Launcher,
    gpus: u64,
    gpus_per_node: u64,
    nodes: u64,
) {
    let _ = writeln!(s, "# Where the {gpus} GPUs are.");
    match launcher {
        Launcher::Torchrun => {
            let _ = writeln!(s, "GPUS_PER_NODE=\"${{GPUS_PER_NODE:-{gpus_per_node}}}\"");
            let _ = writeln!(s, "NNODES=\"${{NNODES:-{nodes}}}\"");
            let _ = writeln!(s, "NODE_RANK=\"${{NODE_RANK:-0}}\"");
            let _ = writeln!(s, "MASTER_ADDR=\"${{MASTER_ADDR:-localhost}}\"");
            let _ = writeln!(s, "MASTER_PORT=\"${{MASTER_PORT:-6000}}\"");
        }
        Launcher::Srun => {
            let _ = writeln!(s, "if [[ -z \"${{SLURM_JOB_ID:-}}\" ]]; then");
            let _ = writeln!(
                s,
                "    echo \"error: run this script inside a Slurm allocation of {nodes} node(s) with {gpus_per_node} GPUs each (sbatch or salloc)\" >&2"
            );
            let _ = writeln!(s, "    exit 2");
            let _ = writeln!(s, "fi");
            let _ = writeln!(s, "GPUS_PER_NODE=\"${{GPUS_PER_NODE:-{gpus_per_node}}}\"");
            let _ = writeln!(s, "NNODES=\"${{NNODES:-${{SLURM_NNODES:-{nodes}}}}}\"");
            let _ = writeln!(
                s,
                "MASTER_ADDR=\"${{MASTER_ADDR:-$(scontrol show hostnames \"${{SLURM_JOB_NODELIST}}\" | head -n 1)}}\""
            );
            let _ = writeln!(s, "MASTER_PORT=\"${{MASTER_PORT:-6000}}\"");
        }
    }
    let _ = writeln!(s, "if (( GPUS_PER_NODE * NNODES != {gpus} )); then");
    let _ = writeln!(
        s,
        "    echo \"error: GPUS_PER_NODE x NNODES = $(( GPUS_PER_NODE * NNODES )) GPUs, but the plan is for {gpus}\" >&2"
    );
    let _ = writeln!(s, "    exit 2");
    let _ = writeln!(s, "fi");
    match launcher {
        Launcher::Torchrun => {
            let _ = writeln!(s, "if (( NNODES > 1 )); then");
            let _ = writeln!(
                s,
                "    LOG_FILE=\"${{SCRIPT_DIR}}/run-node${{NODE_RANK}}.log\""
            );
            let _ = writeln!(s, "else");
            let _ = writeln!(s, "    LOG_FILE=\"${{SCRIPT_DIR}}/run.log\"");
            let _ = writeln!(s, "fi");
        }
        Launcher::Srun => {
            let _ = writeln!(s, "LOG_FILE=\"${{SCRIPT_DIR}}/run.log\"");
        }
    }
    let _ = writeln!(s);
}

/// A trial script's first lines: the shebang, which candidate of which
/// plan it runs on `engine`, and the model and job, every name from the
/// plan made comment-safe.
pub(crate) fn script_header(
    s: &mut String,
    engine: &str,
    plan: &PlanFile,
    candidate: &PlannedCandidate,
    (nodes, gpus_per_node): (u64, u64),
) {
    let model = &plan.model;
    let _ = writeln!(s, "#!/usr/bin/env bash");
    let _ = writeln!(
        s,
        "# {engine} trial run of candidate {} of a paratune plan: {}",
        candidate.rank,
        comment_safe(&candidate.config.to_string())
    );
    let _ = writeln!(
        s,
        "#   model {}: {} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}, sequence {}; global batch {}; {} GPUs ({nodes} x {gpus_per_node})",
        comment_safe(&model.name),
        model.layers,
        model.hidden,
        model.heads,
        model.kv_heads,
        model.ffn_hidden,
        model.vocab,
        model.seq_len,
        plan.global_batch,
        plan.gpus,
    );
}

/// The script lines after its comments: strict mode, and the script's own
/// folder (logs and configurations live beside it).
pub(crate) fn script_prologue(s: &mut String) {
    let _ = writeln!(s, "set -euo pipefail");
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "SCRIPT_DIR=\"$(cd \"$(dirname \"${{BASH_SOURCE[0]}}\")\" && pwd)\""
    );
}

/// Writes `out_dir/candidate-<rank>/run.sh` (executable) and the `(file
/// name, text)` pairs beside it, each atomically; returns the script's path.
pub(crate) fn write_candidate(
    out_dir: &Path,
    rank: usize,
    script: &str,
    beside: &[(&str, &str)],
) -> Result<PathBuf, LaunchError> {
    let write_error = |path: &Path, e: std::io::Error| LaunchError::Write {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let dir = out_dir.join(format!("candidate-{rank}"));
    std::fs::create_dir_all(&dir).map_err(|e| write_error(&dir, e))?;
    for (name, text) in beside {
        let path = dir.join(name);
        crate::atomic::write_atomically(&path, text.as_bytes())
            .map_err(|e| write_error(&path, e))?;
    }
    let path = dir.join("run.sh");
    crate::atomic::write_atomically_with(&path, crate::atomic::Mode::Executable, |f| {
        std::io::Write::write_all(f, script.as_bytes())
    })
    .map_err(|e| write_error(&path, e))?;
    Ok(path)
}

/// A bash array `NAME=(...)` with one flag and its values per line.
pub(crate) fn bash_array(out: &mut String, name: &str, args: &[String]) {
    let mut groups: Vec<Vec<String>> = Vec::new();
    for arg in args {
        match groups.last_mut() {
            Some(group) if !arg.starts_with("--") => group.push(shell_quote(arg)),
            _ => groups.push(vec![shell_quote(arg)]),
        }
    }
    let _ = writeln!(out, "{name}=(");
    for group in groups {
        let _ = writeln!(out, "    {}", group.join(" "));
    }
    let _ = writeln!(out, ")");
}

/// The Megatron-LM arguments of `candidate`, rebuilt from the plan's job
/// and the candidate's configuration: a plan file may come from someone
/// else, so its `megatron_args` are never run as they are. Arguments in the
/// file that differ from the rebuilt ones (a flag added, a degree changed)
/// are refused, naming the first difference.
pub fn candidate_megatron_args(
    plan: &PlanFile,
    candidate: &PlannedCandidate,
) -> Result<Vec<String>, LaunchError> {
    let job = LaunchJob {
        model: &plan.model,
        config: &candidate.config,
        global_batch: plan.global_batch,
        gpus: plan.gpus,
        gpus_per_node: plan.nodes.gpus_per_node,
        gpu: &plan.nodes.gpu.name,
    };
    let rebuilt = megatron_args(&job).map_err(|e| LaunchError::Unsupported {
        rank: candidate.rank,
        engine: MEGATRON,
        reason: e.to_string(),
    })?;
    if let Some(given) = &candidate.megatron_args
        && given != &rebuilt
    {
        let difference = given
            .iter()
            .zip(&rebuilt)
            .position(|(a, b)| a != b)
            .map(|i| {
                format!(
                    "argument {} is {:?} where the configuration gives {:?}",
                    i + 1,
                    given[i],
                    rebuilt[i]
                )
            })
            .unwrap_or_else(|| {
                format!(
                    "{} arguments where the configuration gives {}",
                    given.len(),
                    rebuilt.len()
                )
            });
        return Err(LaunchError::ArgumentsDiffer {
            rank: candidate.rank,
            difference,
        });
    }
    Ok(rebuilt)
}

/// The lines that find the Megatron-LM checkout (`MEGATRON_PATH`, the
/// plan's quoted default if given) and stop early without `pretrain_gpt.py`.
fn megatron_checkout(s: &mut String, megatron_path: Option<&Path>) {
    match megatron_path {
        Some(path) => {
            // Quoted on a line of its own: inside `"${X:-...}"` single
            // quotes are literal, so the default is a variable there.
            let _ = writeln!(
                s,
                "MEGATRON_PATH_DEFAULT={}",
                shell_quote(&path.to_string_lossy())
            );
            let _ = writeln!(
                s,
                "MEGATRON_PATH=\"${{MEGATRON_PATH:-${{MEGATRON_PATH_DEFAULT}}}}\""
            );
        }
        None => {
            let _ = writeln!(
                s,
                "MEGATRON_PATH=\"${{MEGATRON_PATH:?set MEGATRON_PATH to a Megatron-LM checkout}}\""
            );
        }
    }
    let _ = writeln!(
        s,
        "if [[ ! -f \"${{MEGATRON_PATH}}/pretrain_gpt.py\" ]]; then"
    );
    let _ = writeln!(
        s,
        "    echo \"error: ${{MEGATRON_PATH}}/pretrain_gpt.py not found; set MEGATRON_PATH to a Megatron-LM checkout (git clone https://github.com/NVIDIA/Megatron-LM)\" >&2"
    );
    let _ = writeln!(s, "    exit 2");
    let _ = writeln!(s, "fi");
    let _ = writeln!(s);
}

/// The candidate's Megatron-LM arguments, the trial's own and the mock
/// data's, as three bash arrays.
fn argument_arrays(s: &mut String, megatron_args: &[String], train_iters: u64, vocab: u64) {
    let _ = writeln!(
        s,
        "# The candidate's Megatron-LM arguments, as `paratune plan` exported them."
    );
    bash_array(s, "MEGATRON_ARGS", megatron_args);
    let _ = writeln!(
        s,
        "# The trial: every iteration logged with its throughput, no evaluation."
    );
    let trial: Vec<String> = [
        "--train-iters",
        &train_iters.to_string(),
        "--log-interval",
        "1",
        "--log-throughput",
        "--eval-iters",
        "0",
        "--lr",
        TRIAL_LR,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    bash_array(s, "TRIAL_ARGS", &trial);
    let _ = writeln!(
        s,
        "# DATA: synthetic tokens, so no data set is needed. NullTokenizer adds one"
    );
    let _ = writeln!(
        s,
        "# token to the vocabulary size it is given, so the model gets the plan's {}.",
        vocab
    );
    let _ = writeln!(
        s,
        "# To time real data instead, replace these with a data path and a tokenizer."
    );
    let data: Vec<String> = [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        &vocab.saturating_sub(1).max(1).to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    bash_array(s, "DATA_ARGS", &data);
}

/// The command that starts the ranks: torchrun, or srun with the rank
/// variables Megatron-LM reads.
fn launch_lines(s: &mut String, launcher: Launcher) {
    match launcher {
        Launcher::Torchrun => {
            let _ = writeln!(
                s,
                "torchrun --nproc_per_node \"${{GPUS_PER_NODE}}\" --nnodes \"${{NNODES}}\" --node_rank \"${{NODE_RANK}}\" \\"
            );
            let _ = writeln!(
                s,
                "    --master_addr \"${{MASTER_ADDR}}\" --master_port \"${{MASTER_PORT}}\" \\"
            );
            let _ = writeln!(
                s,
                "    pretrain_gpt.py \"${{MEGATRON_ARGS[@]}}\" \"${{TRIAL_ARGS[@]}}\" \"${{DATA_ARGS[@]}}\" 2>&1 | tee -a \"${{LOG_FILE}}\""
            );
        }
        Launcher::Srun => {
            let _ = writeln!(
                s,
                "# Megatron-LM reads its rank and the world size from RANK, LOCAL_RANK and WORLD_SIZE."
            );
            let _ = writeln!(s, "export MASTER_ADDR MASTER_PORT MEGATRON_PATH");
            let _ = writeln!(
                s,
                "srun --nodes=\"${{NNODES}}\" --ntasks-per-node=\"${{GPUS_PER_NODE}}\" --kill-on-bad-exit=1 \\"
            );
            let _ = writeln!(
                s,
                "    bash -c 'export RANK=\"${{SLURM_PROCID}}\" LOCAL_RANK=\"${{SLURM_LOCALID}}\" WORLD_SIZE=\"${{SLURM_NTASKS}}\"; exec python \"${{MEGATRON_PATH}}/pretrain_gpt.py\" \"$@\"' \\"
            );
            let _ = writeln!(
                s,
                "    pretrain_gpt \"${{MEGATRON_ARGS[@]}}\" \"${{TRIAL_ARGS[@]}}\" \"${{DATA_ARGS[@]}}\" 2>&1 | tee -a \"${{LOG_FILE}}\""
            );
        }
    }
}

/// The launch script of `candidate`, a candidate of `plan`. Pure: nothing
/// is checked on disk. Every value from the plan reaches the script quoted
/// for where it lands: shell words through [`shell_quote`], comment text
/// through [`comment_safe`]; the Megatron-LM arguments are rebuilt from the
/// configuration ([`candidate_megatron_args`]).
pub fn launch_script(
    plan: &PlanFile,
    candidate: &PlannedCandidate,
    settings: &LaunchSettings,
) -> Result<String, LaunchError> {
    if candidate.megatron_args.is_none() {
        return Err(LaunchError::Unsupported {
            rank: candidate.rank,
            engine: MEGATRON,
            reason: candidate
                .megatron_unsupported
                .as_deref()
                .map(comment_safe)
                .unwrap_or_else(|| "the plan file gives no Megatron-LM arguments".into()),
        });
    }
    if settings.train_iters < MIN_TRAIN_ITERS {
        return Err(LaunchError::TooFewIterations(settings.train_iters));
    }
    let launcher = settings.launcher;
    let (gpus_per_node, nodes) = node_shape(plan.gpus, launcher_node_gpus(plan), launcher)?;
    let megatron_args = &candidate_megatron_args(plan, candidate)?;
    let model = &plan.model;
    let p = &candidate.prediction;
    let gpus = plan.gpus;

    let mut s = String::new();
    script_header(&mut s, MEGATRON, plan, candidate, (nodes, gpus_per_node));
    let _ = writeln!(
        s,
        "#   predicted by cost model {}: {:.1} ms per iteration, {:.1} TFLOP/s per GPU, peak memory {:.2} GiB",
        comment_safe(&plan.cost_model),
        p.iteration_s * 1e3,
        p.tflops_per_gpu,
        p.peak_memory_gib()
    );
    let _ = writeln!(
        s,
        "# Written by paratune {}. Runs Megatron-LM's pretrain_gpt.py for {} iterations on",
        env!("CARGO_PKG_VERSION"),
        settings.train_iters
    );
    let _ = writeln!(
        s,
        "# synthetic data, logging every iteration, into a log file beside this script; then"
    );
    let _ = writeln!(
        s,
        "#   paratune ingest megatron-log <that log> --out runs.csv"
    );
    let _ = writeln!(
        s,
        "# turns the log into a measured row to compare with the plan."
    );
    if launcher == Launcher::Torchrun && nodes > 1 {
        let _ = writeln!(
            s,
            "# On {nodes} nodes: run it on every node with NODE_RANK=0..{} and MASTER_ADDR set to node 0,",
            nodes - 1
        );
        let _ = writeln!(
            s,
            "# then join the logs (cat run-node*.log > run.log) before ingesting: rank 0 prints"
        );
        let _ = writeln!(s, "# the arguments, the last rank the iteration lines.");
    }
    script_prologue(&mut s);
    megatron_checkout(&mut s, settings.megatron_path.as_deref());
    rank_environment(&mut s, launcher, gpus, gpus_per_node, nodes);
    for note in crate::export::megatron_model_notes(model) {
        let _ = writeln!(s, "# note: {}", crate::text::comment_safe(&note));
    }
    argument_arrays(&mut s, megatron_args, settings.train_iters, model.vocab);
    let _ = writeln!(s);
    if megatron_args.iter().any(|a| a == "--use-megatron-fsdp") {
        // Megatron-FSDP asserts more than one connection, to overlap its
        // gathers; its user guide unsets the variable.
        let _ = writeln!(s, "unset CUDA_DEVICE_MAX_CONNECTIONS");
    } else {
        let _ = writeln!(
            s,
            "export CUDA_DEVICE_MAX_CONNECTIONS=\"${{CUDA_DEVICE_MAX_CONNECTIONS:-1}}\""
        );
    }
    hybrid_ep_environment(&mut s, plan, candidate);
    super::allocator::launch_lines(&mut s, &candidate.config);
    let _ = writeln!(s, "cd \"${{MEGATRON_PATH}}\"");
    launch_lines(&mut s, launcher);
    Ok(s)
}

/// HybridEP's view of the NVLink domain, which it reads from the
/// environment and otherwise takes as 8 GPUs on one host: the domain's
/// size, whether it spans hosts (multi-node NVLink), and the expert-
/// parallel ranks inside one domain, as NVIDIA's recipes set them
/// (Megatron-Bridge `scripts/performance/perf_plugins.py`,
/// `_set_nvl_domain_size`). Nothing for another dispatcher.
fn hybrid_ep_environment(s: &mut String, plan: &PlanFile, candidate: &PlannedCandidate) {
    if plan.model.moe.is_none()
        || candidate.config.dispatcher != crate::config::Dispatcher::HybridEp
    {
        return;
    }
    let gpu = &plan.nodes.gpu.name;
    let domain = crate::cluster::builtin_node(gpu, 1)
        .map_or(plan.nodes.gpus_per_node, |node| node.gpus_per_node);
    let multi_host = u8::from(launcher_node_gpus(plan) < plan.nodes.gpus_per_node);
    let ep_ranks = candidate.config.ep.min(domain);
    let _ = writeln!(
        s,
        "export NVLINK_DOMAIN_SIZE=\"${{NVLINK_DOMAIN_SIZE:-{domain}}}\" USE_MNNVL=\"${{USE_MNNVL:-{multi_host}}}\""
    );
    let _ = writeln!(
        s,
        "export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=\"${{NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN:-{ep_ranks}}}\""
    );
}

/// Writes one script per candidate of `plan` to `out_dir/candidate-<rank>/run.sh`
/// (made executable), atomically. Candidates Megatron-LM cannot run get no
/// script and are returned as [`ScriptOutcome::Skipped`] with the reason.
/// The Megatron-LM checkout must exist and hold `pretrain_gpt.py`.
pub fn write_launch_scripts(
    plan: &PlanFile,
    settings: &LaunchSettings,
    out_dir: &Path,
) -> Result<Vec<ScriptOutcome>, LaunchError> {
    let megatron_path = check_megatron_path(settings.megatron_path.as_deref())?;
    let settings = LaunchSettings {
        megatron_path: Some(megatron_path),
        ..settings.clone()
    };
    let mut outcomes = Vec::with_capacity(plan.candidates.len());
    for candidate in &plan.candidates {
        let text = match launch_script(plan, candidate, &settings) {
            Ok(text) => text,
            Err(LaunchError::Unsupported { rank, reason, .. }) => {
                outcomes.push(ScriptOutcome::Skipped { rank, reason });
                continue;
            }
            Err(other) => return Err(other),
        };
        let path = write_candidate(out_dir, candidate.rank, &text, &[])?;
        outcomes.push(ScriptOutcome::Written {
            rank: candidate.rank,
            path,
        });
    }
    Ok(outcomes)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cluster::builtin_node;
    use crate::coefficients::CostModel;
    use crate::config::{OptimizerSharding, Recompute, ScheduleKind};
    use crate::model::builtin_model;
    use crate::plan_file::PlanFile;
    use crate::search::{Job, SearchSpace, search};

    use crate::export::megatron_flags::MEGATRON_FLAGS;

    /// Launcher options the scripts use: torchrun's (`torch.distributed.run`)
    /// and srun's.
    const TORCHRUN_FLAGS: [&str; 5] = [
        "--nproc_per_node",
        "--nnodes",
        "--node_rank",
        "--master_addr",
        "--master_port",
    ];
    const SRUN_FLAGS: [&str; 3] = ["--nodes", "--ntasks-per-node", "--kill-on-bad-exit"];

    fn plan(model: &str, nodes: u64, global_batch: u64, space: SearchSpace) -> PlanFile {
        plan_on(model, nodes, nodes * 8, global_batch, space)
    }

    pub(crate) fn plan_on(
        model: &str,
        nodes: u64,
        gpus: u64,
        global_batch: u64,
        space: SearchSpace,
    ) -> PlanFile {
        let group = builtin_node("a100-80gb", nodes).unwrap();
        let job = Job {
            model: builtin_model(model).unwrap(),
            global_batch,
            gpus,
            nodes: group,
            memory_limit: None,
            profile: None,
        };
        let cost = CostModel::datasheet();
        let result = search(&job, &space, &cost);
        assert!(!result.candidates.is_empty(), "{model}: nothing fits");
        PlanFile::of(&job, &cost, &result, 3)
    }

    fn plans() -> Vec<PlanFile> {
        vec![
            plan("gpt3-13b", 1, 64, SearchSpace::default()),
            plan(
                "llama3-70b",
                4,
                128,
                SearchSpace {
                    schedule: Some(vec![ScheduleKind::Interleaved]),
                    recompute: Some(vec![Recompute::Selective]),
                    optimizer_sharding: Some(vec![OptimizerSharding::OptimizerStates]),
                    ..SearchSpace::default()
                },
            ),
            plan(
                "gpt3-175b",
                16,
                256,
                SearchSpace {
                    recompute: Some(vec![Recompute::Full]),
                    ..SearchSpace::default()
                },
            ),
        ]
    }

    fn settings(launcher: Launcher) -> LaunchSettings {
        LaunchSettings::new(Some(PathBuf::from("/opt/Megatron-LM")), launcher)
    }

    /// Every `--flag` outside comments, without `=value`.
    fn flags(script: &str) -> Vec<String> {
        script
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .flat_map(str::split_whitespace)
            .filter(|w| w.starts_with("--"))
            .map(|w| w.split('=').next().unwrap_or(w).to_string())
            .collect()
    }

    /// The words inside the bash array `name=( ... )`.
    pub(crate) fn array<'a>(script: &'a str, name: &str) -> Vec<&'a str> {
        let start = script
            .find(&format!("{name}=(\n"))
            .expect("the array is there");
        let body = &script[start..];
        let end = body.find("\n)").expect("the array is closed");
        body[..end]
            .lines()
            .skip(1)
            .flat_map(str::split_whitespace)
            .collect()
    }

    pub(crate) fn bash_accepts(script: &str) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.sh");
        std::fs::write(&path, script).unwrap();
        let out = std::process::Command::new("bash")
            .arg("-n")
            .arg(&path)
            .output()
            .expect("bash runs");
        assert!(
            out.status.success(),
            "bash -n refuses the script:\n{}\n{script}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn every_script_is_valid_bash_and_uses_only_megatron_and_launcher_flags() {
        let mut seen_fsdp = false;
        for plan in plans() {
            for launcher in Launcher::ALL {
                for candidate in &plan.candidates {
                    let Ok(script) = launch_script(&plan, candidate, &settings(launcher)) else {
                        assert!(candidate.megatron_args.is_none());
                        continue;
                    };
                    assert!(script.starts_with("#!/usr/bin/env bash\n"));
                    assert!(script.contains("\nset -euo pipefail\n"));
                    assert!(script.contains("pretrain_gpt.py"));
                    assert!(script.contains("| tee -a \"${LOG_FILE}\""));
                    bash_accepts(&script);
                    let launcher_flags: &[&str] = match launcher {
                        Launcher::Torchrun => &TORCHRUN_FLAGS,
                        Launcher::Srun => &SRUN_FLAGS,
                    };
                    for flag in flags(&script) {
                        assert!(
                            MEGATRON_FLAGS.contains(&flag.as_str())
                                || launcher_flags.contains(&flag.as_str()),
                            "{flag} is neither a Megatron-LM nor a {} option:\n{script}",
                            launcher.name()
                        );
                    }
                    for name in ["MEGATRON_ARGS", "TRIAL_ARGS", "DATA_ARGS"] {
                        for word in array(&script, name) {
                            if word.starts_with("--") {
                                assert!(MEGATRON_FLAGS.contains(&word), "{word} in {name}");
                            }
                        }
                    }
                    for needed in [
                        "--train-iters",
                        "--log-interval",
                        "--log-throughput",
                        "--eval-iters",
                        "--mock-data",
                    ] {
                        assert!(
                            array(&script, "TRIAL_ARGS")
                                .iter()
                                .chain(array(&script, "DATA_ARGS").iter())
                                .any(|w| *w == needed)
                        );
                    }
                    // Megatron-FSDP asserts more than one CUDA connection;
                    // everything else wants one.
                    let fsdp = candidate.config.optimizer_sharding
                        == crate::config::OptimizerSharding::Full;
                    assert_eq!(
                        script.contains("\nunset CUDA_DEVICE_MAX_CONNECTIONS\n"),
                        fsdp,
                        "{script}"
                    );
                    assert_eq!(
                        script.contains("export CUDA_DEVICE_MAX_CONNECTIONS="),
                        !fsdp
                    );
                    seen_fsdp |= fsdp;
                }
            }
        }
        assert!(seen_fsdp, "the plans hold a fully sharded candidate");
    }

    #[test]
    fn the_flag_list_covers_everything_the_megatron_export_emits() {
        let mut seen = std::collections::BTreeSet::new();
        for plan in plans() {
            for candidate in &plan.candidates {
                for arg in candidate.megatron_args.iter().flatten() {
                    if arg.starts_with("--") {
                        seen.insert(arg.clone());
                        assert!(
                            MEGATRON_FLAGS.contains(&arg.as_str()),
                            "export/megatron.rs emits {arg}, which the list lacks"
                        );
                    }
                }
            }
        }
        for wanted in [
            "--num-layers-per-virtual-pipeline-stage",
            "--group-query-attention",
            "--swiglu",
            "--recompute-granularity",
            "--use-distributed-optimizer",
        ] {
            assert!(
                seen.contains(wanted),
                "the test plans never exercise {wanted}"
            );
        }
    }

    #[test]
    fn a_script_carries_the_candidate_and_the_trial_settings() {
        let plan = &plans()[0];
        let candidate = &plan.candidates[0];
        let mut settings = settings(Launcher::Torchrun);
        settings.train_iters = 7;
        let script = launch_script(plan, candidate, &settings).unwrap();
        let trial = array(&script, "TRIAL_ARGS");
        assert!(trial.windows(2).any(|w| w == ["--train-iters", "7"]));
        assert!(trial.windows(2).any(|w| w == ["--log-interval", "1"]));
        let model_args = array(&script, "MEGATRON_ARGS");
        let tp = candidate.config.tp.to_string();
        assert!(
            model_args
                .windows(2)
                .any(|w| w == ["--tensor-model-parallel-size", tp.as_str()])
        );
        assert!(script.contains("MEGATRON_PATH_DEFAULT=/opt/Megatron-LM\n"));
        assert!(script.contains("MEGATRON_PATH=\"${MEGATRON_PATH:-${MEGATRON_PATH_DEFAULT}}\""));
        assert!(script.contains("GPUS_PER_NODE=\"${GPUS_PER_NODE:-8}\""));
        let vocab = (plan.model.vocab - 1).to_string();
        assert!(array(&script, "DATA_ARGS").contains(&vocab.as_str()));
        settings.train_iters = 2;
        assert!(matches!(
            launch_script(plan, candidate, &settings),
            Err(LaunchError::TooFewIterations(2))
        ));
    }

    /// What `pretrain_gpt.py` cannot set of the model (gpt-oss's YaRN) is a
    /// comment above the arguments the trial runs.
    #[test]
    fn a_script_notes_what_megatron_lm_cannot_set() {
        let plan = plan("gpt-oss-20b", 1, 64, SearchSpace::default());
        let script =
            launch_script(&plan, &plan.candidates[0], &settings(Launcher::Torchrun)).unwrap();
        let note = "# note: pretrain_gpt.py has no option for YaRN outside multi-latent attention";
        let at = script.find(note).expect("the note is there");
        assert!(at < script.find("MEGATRON_ARGS=(").unwrap(), "{script}");
        bash_accepts(&script);
        let plain = &plans()[1];
        let script =
            launch_script(plain, &plain.candidates[0], &settings(Launcher::Torchrun)).unwrap();
        assert!(!script.contains("# note:"), "{script}");
    }

    #[test]
    fn a_candidate_without_megatron_arguments_gets_no_script_but_its_reason() {
        let mut plan = plans().remove(0);
        plan.candidates[1].megatron_args = None;
        plan.candidates[1].megatron_unsupported = Some("BPipe is not upstream".into());
        let err = launch_script(&plan, &plan.candidates[1], &settings(Launcher::Srun)).unwrap_err();
        assert!(err.to_string().contains("BPipe is not upstream"), "{err}");

        let megatron = tempfile::tempdir().unwrap();
        std::fs::write(megatron.path().join("pretrain_gpt.py"), "# stub\n").unwrap();
        let out = tempfile::tempdir().unwrap();
        let settings = LaunchSettings::new(Some(megatron.path().to_path_buf()), Launcher::Torchrun);
        let outcomes = write_launch_scripts(&plan, &settings, out.path()).unwrap();
        assert_eq!(outcomes.len(), plan.candidates.len());
        assert!(matches!(
            &outcomes[1],
            ScriptOutcome::Skipped { rank: 2, reason } if reason.contains("BPipe")
        ));
        assert!(!out.path().join("candidate-2").exists());
        let ScriptOutcome::Written { path, .. } = &outcomes[0] else {
            panic!("candidate 1 has a script: {outcomes:?}");
        };
        assert_eq!(path, &out.path().join("candidate-1").join("run.sh"));
        let text = std::fs::read_to_string(path).unwrap();
        bash_accepts(&text);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path).unwrap().permissions().mode();
            assert_eq!(mode & 0o700, 0o700, "the owner can run it: {mode:o}");
        }
    }

    #[test]
    fn a_missing_or_wrong_megatron_path_names_the_flag_and_the_fix() {
        let plan = plans().remove(0);
        let out = tempfile::tempdir().unwrap();
        for path in [
            None,
            Some(out.path().join("nowhere")),
            Some(out.path().to_path_buf()),
        ] {
            let settings = LaunchSettings::new(path, Launcher::Torchrun);
            let err = write_launch_scripts(&plan, &settings, out.path())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--megatron-path") && err.contains("pretrain_gpt.py"),
                "{err}"
            );
        }
    }

    /// Values from a plan file reach comments escaped: a name whose newline
    /// would start a command stays inside its comment line. (Plan files are
    /// checked when read, `PlanFile::check`, and a model name with a control
    /// character gets no Megatron-LM arguments; this holds even without them.)
    #[test]
    fn text_from_the_plan_cannot_leave_its_comment_line() {
        let mut plan = plans().remove(0);
        plan.model.name = "gpt3-13b\ntouch pwned\n#".into();
        let err = launch_script(&plan, &plan.candidates[0], &settings(Launcher::Torchrun))
            .unwrap_err()
            .to_string();
        assert!(err.contains("model name"), "{err}");
        let mut plan = plans().remove(0);
        plan.cost_model = "datasheet\ntouch pwned\r#".into();
        let script =
            launch_script(&plan, &plan.candidates[0], &settings(Launcher::Torchrun)).unwrap();
        for line in script.lines().filter(|l| l.contains("touch pwned")) {
            assert!(line.starts_with('#'), "outside a comment: {line}");
        }
        assert!(!script.contains('\r'));
        bash_accepts(&script);
    }

    #[test]
    fn a_plan_that_does_not_fill_whole_nodes_is_refused() {
        let mut plan = plans().remove(0);
        plan.gpus = 12;
        let err = launch_script(&plan, &plan.candidates[0], &settings(Launcher::Torchrun))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("12 GPUs") && err.contains("whole nodes"),
            "{err}"
        );
        // Less than a node is fine: one node with that many processes.
        let small = plan_on("gpt3-13b", 1, 4, 64, SearchSpace::default());
        let script =
            launch_script(&small, &small.candidates[0], &settings(Launcher::Torchrun)).unwrap();
        assert!(script.contains("GPUS_PER_NODE=\"${GPUS_PER_NODE:-4}\""));
    }

    #[test]
    fn an_nvl72_rack_launches_per_tray_and_tells_hybrid_ep_its_domain() {
        use crate::config::Dispatcher;
        let mut nodes = builtin_node("gb300", 2).unwrap();
        nodes.gpus_per_node = 64;
        let job = Job {
            model: builtin_model("qwen3-30b-a3b").unwrap(),
            global_batch: 512,
            gpus: 128,
            nodes,
            memory_limit: None,
            profile: None,
        };
        let space = SearchSpace {
            tp: Some(vec![1]),
            pp: Some(vec![1]),
            ep: Some(vec![16]),
            dispatcher: Some(vec![Dispatcher::HybridEp]),
            ..SearchSpace::default()
        };
        let cost = CostModel::datasheet();
        let plan = PlanFile::of(&job, &cost, &search(&job, &space, &cost), 1);
        let script =
            launch_script(&plan, &plan.candidates[0], &settings(Launcher::Torchrun)).unwrap();
        // 128 GPUs of two racks: 32 trays of 4, not 2 "nodes" of 64.
        assert!(
            script.contains("GPUS_PER_NODE=\"${GPUS_PER_NODE:-4}\""),
            "{script}"
        );
        assert!(script.contains("NNODES=\"${NNODES:-32}\""));
        assert!(script.contains("USE_MNNVL=\"${USE_MNNVL:-1}\""));
        assert!(script.contains("NVLINK_DOMAIN_SIZE=\"${NVLINK_DOMAIN_SIZE:-72}\""));
        assert!(script.contains("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=\"${NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN:-16}\""));
        bash_accepts(&script);
        // Eight-GPU hosts keep their node, and other dispatchers get nothing.
        let a100 = plans().remove(0);
        let script =
            launch_script(&a100, &a100.candidates[0], &settings(Launcher::Torchrun)).unwrap();
        assert!(!script.contains("USE_MNNVL"));
    }

    #[test]
    fn a_plan_priced_with_expandable_segments_launches_with_them() {
        use crate::config::CudaGraphs;
        let script_of = |expandable: bool, graphs: CudaGraphs| {
            let space = SearchSpace {
                expandable_segments: Some(vec![expandable]),
                cuda_graphs: Some(vec![graphs]),
                ..SearchSpace::default()
            };
            let plan = plan_on("gpt3-13b", 1, 8, 64, space);
            assert_eq!(plan.candidates[0].config.expandable_segments, expandable);
            let script =
                launch_script(&plan, &plan.candidates[0], &settings(Launcher::Torchrun)).unwrap();
            bash_accepts(&script);
            script
        };
        let allocator = "export PYTORCH_CUDA_ALLOC_CONF=\"${PYTORCH_CUDA_ALLOC_CONF:+${PYTORCH_CUDA_ALLOC_CONF},}expandable_segments:True\"";
        let no_graph_registration = "export NCCL_GRAPH_REGISTER=0";
        let eager = script_of(true, CudaGraphs::Off);
        assert!(eager.contains(allocator), "{eager}");
        assert!(!eager.contains(no_graph_registration));
        // Megatron-LM asserts graph registration off with CUDA graphs.
        let graphed = script_of(true, CudaGraphs::Layers);
        assert!(graphed.contains(allocator) && graphed.contains(no_graph_registration));
        let plain = script_of(false, CudaGraphs::Layers);
        assert!(
            !plain.contains("export PYTORCH_CUDA_ALLOC_CONF")
                && !plain.contains("NCCL_GRAPH_REGISTER")
        );
        // Either way the log starts with what the ranks read.
        for script in [&eager, &plain] {
            assert!(script.contains("paratune allocator: "), "{script}");
        }
        // How the lines behave in bash: `allocator`'s tests.
    }
}
