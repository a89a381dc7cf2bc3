//! Launch scripts for torchtitan trial runs of a plan: for each candidate, a
//! bash script that runs `torchrun ... -m torchtitan.train` with the
//! candidate's degrees, batches and switches for a few steps, logging every
//! step and the configuration, so that `paratune ingest torchtitan-log` can
//! read back what the candidate really takes.
//!
//! The base (`--torchtitan-config`) says which torchtitan and which job:
//! - `MODULE:CONFIG` (torchtitan 0.3): the config function (`llama3:llama3_8b`)
//!   builds the model, data and optimiser; the script overrides what the plan
//!   decides with [`torchtitan_flags`] and adds the trial's own flags
//!   ([`TRIAL_FLAGS_0_3`]).
//! - `BASE.toml` (torchtitan 0.2): a job config; each candidate gets
//!   `job.toml`, the base with the plan's keys and the trial's set over it
//!   ([`merge_job_config`]), run with `--job.config_file`.
//!
//! [`torchtitan_script`] is pure; [`write_torchtitan_scripts`] writes the
//! scripts (and job configs) atomically.

use super::launch::{
    LaunchError, Launcher, MIN_TRAIN_ITERS, ScriptOutcome, bash_array, launcher_node_gpus,
    node_shape, rank_environment, script_header, script_prologue, write_candidate,
};
use crate::export::{LaunchJob, merge_job_config, torchtitan_flags};
use crate::model::ModelSpec;
use crate::plan_file::{PlanFile, PlannedCandidate};
use crate::text::{comment_safe, shell_quote};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Which torchtitan job the candidates are set over.
#[derive(Debug, Clone, PartialEq)]
pub enum TorchtitanBase {
    /// torchtitan 0.3: `--module MODULE --config CONFIG`.
    Registry { module: String, config: String },
    /// torchtitan 0.2: a job-config TOML.
    JobToml { path: PathBuf, table: toml::Table },
}

impl TorchtitanBase {
    /// `--torchtitan-config`'s value: `MODULE:CONFIG`, or a `.toml` file.
    pub fn parse(text: &str) -> Result<TorchtitanBase, LaunchError> {
        let bad = |problem: String| LaunchError::BadTorchtitanConfig {
            value: comment_safe(text),
            problem,
        };
        if text.ends_with(".toml") || Path::new(text).is_file() {
            let path = PathBuf::from(text);
            let source =
                std::fs::read_to_string(&path).map_err(|e| bad(format!("cannot read it: {e}")))?;
            let table: toml::Table =
                toml::from_str(&source).map_err(|e| bad(format!("not TOML: {}", e.message())))?;
            let path = std::path::absolute(&path).map_err(|e| bad(e.to_string()))?;
            return Ok(TorchtitanBase::JobToml { path, table });
        }
        let Some((module, config)) = text.split_once(':') else {
            return Err(bad("neither MODULE:CONFIG nor a .toml file".into()));
        };
        let python_name = |name: &str| {
            !name.is_empty()
                && name.split('.').all(|part| {
                    part.chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                        && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                })
        };
        if !python_name(module) || !python_name(config) || config.contains('.') {
            return Err(bad(
                "MODULE must be a Python module name (llama3, or my_pkg.my_module) and CONFIG a function name (llama3_8b)".into(),
            ));
        }
        Ok(TorchtitanBase::Registry {
            module: module.into(),
            config: config.into(),
        })
    }

    /// Refuses a base that builds another network than the plan's: its
    /// trials would time a model the plan did not price. A 0.2 job TOML's
    /// `[model]` (a key left out is torchtitan's default, `JobConfig`'s
    /// `Model`: name `llama3`, flavor `debugmodel`), or a 0.3 config
    /// function named for a catalogue model; a model paratune does not know
    /// is left to the user.
    pub fn check_model(&self, plan_model: &ModelSpec) -> Result<(), LaunchError> {
        let (path, base, built) = match self {
            // A 0.3 config function named for a model paratune knows.
            TorchtitanBase::Registry { module, config } => (
                format!("{module}:{config}"),
                format!("its config function {config}"),
                crate::export::catalogue_model_of_config(module, config),
            ),
            TorchtitanBase::JobToml { path, table } => {
                let model = table.get("model").and_then(|m| m.as_table());
                let text = |key: &str| model.and_then(|m| m.get(key)).and_then(|v| v.as_str());
                let name = text("name").unwrap_or("llama3");
                let flavor = text("flavor").unwrap_or("debugmodel");
                let built = crate::export::catalogue_model_of(name, flavor).or_else(|| {
                    (name == "llama3")
                        .then(|| super::torchtitan_log::llama3_flavor(flavor))
                        .flatten()
                });
                (
                    comment_safe(&path.display().to_string()),
                    format!("its [model] {name} {flavor}"),
                    built,
                )
            }
        };
        match built {
            Some(built) if !same_network(&built, plan_model) => {
                Err(LaunchError::BaseModelDiffers {
                    path,
                    base,
                    built: built.name,
                    planned: plan_model.name.clone(),
                })
            }
            _ => Ok(()),
        }
    }

    fn release(&self) -> &'static str {
        match self {
            TorchtitanBase::Registry { .. } => "0.3",
            TorchtitanBase::JobToml { .. } => "0.2",
        }
    }
}

/// What every torchtitan script of a plan shares.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchtitanSettings {
    pub base: TorchtitanBase,
    pub launcher: Launcher,
    pub train_iters: u64,
}

/// The trial's flags for torchtitan 0.3 (beside the plan's): its steps are
/// added by [`torchtitan_script`]; every step logged without colours, the
/// configuration printed (what `ingest torchtitan-log` reads), no
/// checkpoints. Fields of `components/metrics.py` `MetricsProcessor.Config`,
/// `config/configs.py` `DebugConfig` and `components/checkpointer/base.py`
/// in the 0.3.0 wheel.
pub const TRIAL_FLAGS_0_3: [&str; 5] = [
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--debug.print_config",
    "--checkpoint.no-enable",
];

/// The trial's keys for a torchtitan 0.2 job config: `[training] steps`,
/// `[metrics] log_freq = 1, disable_color_printing = true`,
/// `[job] print_config = true`, `[checkpoint] enable = false` (0.2.2's
/// `JobConfig`).
fn trial_keys_0_2(train_iters: u64) -> toml::Table {
    let text = format!(
        "[training]\nsteps = {train_iters}\n[metrics]\nlog_freq = 1\ndisable_color_printing = true\n[job]\nprint_config = true\n[checkpoint]\nenable = false\n"
    );
    toml::from_str(&text).expect("fixed TOML")
}

/// One candidate's script and, for a 0.2 base, its job config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TorchtitanTrial {
    pub script: String,
    pub job_toml: Option<String>,
}

fn launch_job<'a>(plan: &'a PlanFile, candidate: &'a PlannedCandidate) -> LaunchJob<'a> {
    LaunchJob {
        model: &plan.model,
        config: &candidate.config,
        global_batch: plan.global_batch,
        gpus: plan.gpus,
        gpus_per_node: plan.nodes.gpus_per_node,
        gpu: &plan.nodes.gpu.name,
    }
}

/// The torchtitan trial of `candidate`, a candidate of `plan`. Pure. Every
/// value reaches the script quoted for where it lands (shell words through
/// [`shell_quote`], comments through [`comment_safe`]); the flags are
/// rebuilt from the configuration.
pub fn torchtitan_script(
    plan: &PlanFile,
    candidate: &PlannedCandidate,
    settings: &TorchtitanSettings,
) -> Result<TorchtitanTrial, LaunchError> {
    if settings.train_iters < MIN_TRAIN_ITERS {
        return Err(LaunchError::TooFewIterations(settings.train_iters));
    }
    let job = launch_job(plan, candidate);
    let unsupported = |e: crate::export::ExportError| LaunchError::Unsupported {
        rank: candidate.rank,
        engine: "torchtitan",
        reason: e.to_string(),
    };
    let launcher = settings.launcher;
    let (gpus_per_node, nodes) = node_shape(plan.gpus, launcher_node_gpus(plan), launcher)?;
    let gpus = plan.gpus;
    let p = &candidate.prediction;

    let (titan_args, ac, job_toml, notes) = match &settings.base {
        TorchtitanBase::Registry { module, config } => {
            let words = torchtitan_flags(&job).map_err(unsupported)?;
            let mut args = vec![
                "--module".to_string(),
                module.clone(),
                "--config".to_string(),
                config.clone(),
            ];
            args.extend(words.flags);
            args.push("--training.steps".into());
            args.push(settings.train_iters.to_string());
            args.extend(TRIAL_FLAGS_0_3.iter().map(|s| s.to_string()));
            (args, Some(words.activation_checkpoint), None, words.notes)
        }
        TorchtitanBase::JobToml { table, .. } => {
            let text = merge_job_config(table, &job, &trial_keys_0_2(settings.train_iters))
                .map_err(unsupported)?;
            (Vec::new(), None, Some(text), Vec::new())
        }
    };

    let mut s = String::new();
    script_header(
        &mut s,
        "torchtitan",
        plan,
        candidate,
        (nodes, gpus_per_node),
    );
    let _ = writeln!(
        s,
        "#   predicted by cost model {}: {:.1} ms per iteration, peak {:.2} GiB reserved on rank 0",
        comment_safe(&plan.cost_model),
        p.iteration_s * 1e3,
        p.first_stage_reserved_bytes / (1u64 << 30) as f64
    );
    match &settings.base {
        TorchtitanBase::Registry { module, config } => {
            let _ = writeln!(
                s,
                "# torchtitan 0.3: the config function {}:{} must build this model; the",
                comment_safe(module),
                comment_safe(config)
            );
            let _ = writeln!(
                s,
                "# flags below set what the plan decides. Arguments given to this script are"
            );
            let _ = writeln!(
                s,
                "# passed on before the activation-checkpoint word (which tyro needs last)."
            );
        }
        TorchtitanBase::JobToml { path, .. } => {
            let _ = writeln!(
                s,
                "# torchtitan 0.2: job.toml beside this script is {} with the plan's",
                comment_safe(&path.display().to_string())
            );
            let _ = writeln!(
                s,
                "# keys set over it. Arguments given to this script are passed on (CLI > TOML)."
            );
        }
    }
    for note in &notes {
        let _ = writeln!(s, "# note: {}", comment_safe(note));
    }
    let _ = writeln!(
        s,
        "# Written by paratune {}. Runs {} steps, each logged, into a log beside this script; then",
        env!("CARGO_PKG_VERSION"),
        settings.train_iters
    );
    let _ = writeln!(
        s,
        "#   paratune ingest torchtitan-log <that log> --out runs.csv"
    );
    let _ = writeln!(s, "# reads it into a measured row (rank 0's memory).");
    script_prologue(&mut s);
    let _ = writeln!(s, "PYTHON=\"${{PYTHON:-python3}}\"");
    let _ = writeln!(
        s,
        "if ! \"${{PYTHON}}\" -c 'import torchtitan' >/dev/null 2>&1; then"
    );
    let _ = writeln!(
        s,
        "    echo \"error: ${{PYTHON}} cannot import torchtitan; pip install torchtitan (release {}), or set PYTHON to the interpreter that has it\" >&2",
        settings.base.release()
    );
    let _ = writeln!(s, "    exit 2");
    let _ = writeln!(s, "fi");
    let _ = writeln!(s);
    rank_environment(&mut s, launcher, gpus, gpus_per_node, nodes);
    super::allocator::launch_lines(&mut s, &candidate.config);
    let _ = writeln!(s);

    match &settings.base {
        TorchtitanBase::Registry { .. } => {
            let _ = writeln!(
                s,
                "# The candidate's torchtitan 0.3 overrides and the trial's (steps, logging, no checkpoints)."
            );
            bash_array(&mut s, "TITAN_ARGS", &titan_args);
            let _ = writeln!(s, "TITAN_ARGS+=(--dump_folder \"${{SCRIPT_DIR}}/outputs\")");
        }
        TorchtitanBase::JobToml { .. } => {
            let _ = writeln!(
                s,
                "TITAN_ARGS=(--job.config_file \"${{SCRIPT_DIR}}/job.toml\" --job.dump_folder \"${{SCRIPT_DIR}}/outputs\")"
            );
        }
    }
    let ac_word = ac.map(shell_quote).unwrap_or_default();
    let tail = if ac_word.is_empty() {
        String::new()
    } else {
        format!(" {ac_word}")
    };
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
            let _ = writeln!(s, "    --local-ranks-filter 0 --role rank --tee 3 \\");
            let _ = writeln!(
                s,
                "    -m torchtitan.train \"${{TITAN_ARGS[@]}}\" \"$@\"{tail} 2>&1 | tee -a \"${{LOG_FILE}}\""
            );
        }
        Launcher::Srun => {
            let _ = writeln!(
                s,
                "# One torchrun per node; rank 0's output is what torchtitan logs."
            );
            let _ = writeln!(
                s,
                "export MASTER_ADDR MASTER_PORT GPUS_PER_NODE NNODES PYTHON"
            );
            let _ = writeln!(
                s,
                "srun --nodes=\"${{NNODES}}\" --ntasks-per-node=1 --kill-on-bad-exit=1 \\"
            );
            let _ = writeln!(
                s,
                "    bash -c 'exec \"${{PYTHON:-python3}}\" -m torch.distributed.run --nproc_per_node \"${{GPUS_PER_NODE}}\" --nnodes \"${{NNODES}}\" --node_rank \"${{SLURM_NODEID}}\" --master_addr \"${{MASTER_ADDR}}\" --master_port \"${{MASTER_PORT}}\" --local-ranks-filter 0 --role rank --tee 3 -m torchtitan.train \"$@\"' \\"
            );
            let _ = writeln!(
                s,
                "    torchtitan \"${{TITAN_ARGS[@]}}\" \"$@\"{tail} 2>&1 | tee -a \"${{LOG_FILE}}\""
            );
        }
    }
    Ok(TorchtitanTrial {
        script: s,
        job_toml,
    })
}

/// Writes one script per candidate of `plan` to `out_dir/candidate-<rank>/run.sh`
/// (executable, with `job.toml` beside it for a 0.2 base), atomically.
/// Candidates torchtitan cannot run get none and are returned as
/// [`ScriptOutcome::Skipped`] with the reason.
pub fn write_torchtitan_scripts(
    plan: &PlanFile,
    settings: &TorchtitanSettings,
    out_dir: &Path,
) -> Result<Vec<ScriptOutcome>, LaunchError> {
    let mut outcomes = Vec::with_capacity(plan.candidates.len());
    for candidate in &plan.candidates {
        let trial = match torchtitan_script(plan, candidate, settings) {
            Ok(trial) => trial,
            Err(LaunchError::Unsupported { rank, reason, .. }) => {
                outcomes.push(ScriptOutcome::Skipped { rank, reason });
                continue;
            }
            Err(other) => return Err(other),
        };
        let beside: Vec<(&str, &str)> = trial
            .job_toml
            .as_deref()
            .map(|text| ("job.toml", text))
            .into_iter()
            .collect();
        let path = write_candidate(out_dir, candidate.rank, &trial.script, &beside)?;
        outcomes.push(ScriptOutcome::Written {
            rank: candidate.rank,
            path,
        });
    }
    Ok(outcomes)
}

/// Whether two models are the same network for a trial: widths, heads,
/// layers, vocabulary and experts (torchtitan takes the sequence length
/// from training, and names differ).
fn same_network(a: &ModelSpec, b: &ModelSpec) -> bool {
    let shape = |m: &ModelSpec| {
        (
            (
                m.hidden,
                m.heads,
                m.kv_heads,
                m.ffn_hidden,
                m.layers,
                m.vocab,
            ),
            m.moe.map(|e| (e.experts, e.topk, e.ffn_hidden)),
        )
    };
    shape(a) == shape(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Engine, OptimizerSharding, Recompute, ScheduleKind};
    use crate::search::SearchSpace;
    use crate::validate::launch::tests::{array, bash_accepts, plan_on};

    /// Llama-3 8B on 16 GPUs, planned for torchtitan.
    fn plan(space: SearchSpace) -> PlanFile {
        plan_on(
            "llama3-8b",
            2,
            16,
            64,
            SearchSpace {
                engine: Engine::Torchtitan,
                ..space
            },
        )
    }

    fn registry() -> TorchtitanSettings {
        TorchtitanSettings {
            base: TorchtitanBase::parse("llama3:llama3_8b").unwrap(),
            launcher: Launcher::Torchrun,
            train_iters: 20,
        }
    }

    fn spaces() -> Vec<SearchSpace> {
        vec![
            SearchSpace::default(),
            SearchSpace {
                pp: Some(vec![2]),
                schedule: Some(vec![ScheduleKind::Interleaved]),
                ..SearchSpace::default()
            },
            SearchSpace {
                tp: Some(vec![2]),
                recompute: Some(vec![Recompute::Full]),
                optimizer_sharding: Some(vec![OptimizerSharding::Full]),
                ..SearchSpace::default()
            },
        ]
    }

    /// The option names a 0.3 script may use beside the plan's: the trial's
    /// and the top-level `dump_folder` (`Trainer.Config`, 0.3.0 wheel).
    fn known_0_3(word: &str) -> bool {
        use crate::export::tests::{TORCHTITAN_0_3_0_FIELDS, torchtitan_field};
        matches!(word, "--module" | "--config" | "--dump_folder")
            || torchtitan_field(word).is_some_and(|f| TORCHTITAN_0_3_0_FIELDS.contains(&f.as_str()))
    }

    #[test]
    fn graphs_over_expandable_segments_launch_without_nccl_graph_registration() {
        use crate::config::CudaGraphs;
        for (graphs, expandable) in [
            (CudaGraphs::Layers, true),
            (CudaGraphs::Off, true),
            (CudaGraphs::Layers, false),
        ] {
            let plan = plan(SearchSpace {
                cuda_graphs: Some(vec![graphs]),
                expandable_segments: Some(vec![expandable]),
                ..SearchSpace::default()
            });
            let candidate = &plan.candidates[0];
            assert_eq!(
                (
                    candidate.config.cuda_graphs,
                    candidate.config.expandable_segments
                ),
                (graphs, expandable)
            );
            let script = torchtitan_script(&plan, candidate, &registry())
                .unwrap()
                .script;
            assert_eq!(
                script.contains("export NCCL_GRAPH_REGISTER=0"),
                graphs.on() && expandable,
                "{graphs:?} {expandable}"
            );
        }
    }

    #[test]
    fn scripts_for_torchtitan_0_3_are_bash_and_use_only_its_options() {
        for space in spaces() {
            let plan = plan(space);
            for launcher in Launcher::ALL {
                let settings = TorchtitanSettings {
                    launcher,
                    ..registry()
                };
                for candidate in &plan.candidates {
                    let trial = torchtitan_script(&plan, candidate, &settings)
                        .unwrap_or_else(|e| panic!("{}: {e}", candidate.config));
                    assert!(trial.job_toml.is_none());
                    bash_accepts(&trial.script);
                    let words = array(&trial.script, "TITAN_ARGS");
                    for word in words.iter().filter(|w| w.starts_with("--")) {
                        assert!(known_0_3(word), "{word} is not a torchtitan 0.3.0 option");
                    }
                    assert_eq!(&words[..4], ["--module", "llama3", "--config", "llama3_8b"]);
                    // The activation-checkpoint word is the command's last.
                    let command = trial
                        .script
                        .lines()
                        .find(|l| l.contains("\"${TITAN_ARGS[@]}\""))
                        .unwrap();
                    assert!(
                        command.contains("\"$@\" activation-checkpoint:"),
                        "{command}"
                    );
                    // The log starts with the allocator the ranks read,
                    // which the launcher's output then follows.
                    let record = trial.script.find("paratune allocator: ").unwrap();
                    let launch = trial.script.find("TITAN_ARGS[@]").unwrap();
                    assert!(record < launch);
                    assert!(command.ends_with("| tee -a \"${LOG_FILE}\""), "{command}");
                }
            }
        }
    }

    #[test]
    fn a_0_2_base_gets_a_job_config_per_candidate() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("llama3_8b.toml");
        std::fs::write(
            &base,
            "[model]\nname = \"llama3\"\nflavor = \"8B\"\n[training]\ndataset = \"c4\"\nsteps = 1000\n",
        )
        .unwrap();
        let settings = TorchtitanSettings {
            base: TorchtitanBase::parse(base.to_str().unwrap()).unwrap(),
            ..registry()
        };
        // 0.2 has no CUDA graphs.
        let plan = plan(SearchSpace {
            cuda_graphs: Some(vec![crate::config::CudaGraphs::Off]),
            ..SearchSpace::default()
        });
        let out = dir.path().join("trials");
        let outcomes = write_torchtitan_scripts(&plan, &settings, &out).unwrap();
        assert_eq!(outcomes.len(), plan.candidates.len());
        for outcome in outcomes {
            let ScriptOutcome::Written { path, .. } = outcome else {
                panic!("{outcome:?}");
            };
            let script = std::fs::read_to_string(&path).unwrap();
            bash_accepts(&script);
            assert!(script.contains("--job.config_file \"${SCRIPT_DIR}/job.toml\""));
            let job: toml::Table =
                toml::from_str(&std::fs::read_to_string(path.with_file_name("job.toml")).unwrap())
                    .unwrap();
            assert_eq!(job["model"]["flavor"].as_str(), Some("8B"));
            assert_eq!(job["training"]["dataset"].as_str(), Some("c4"));
            assert_eq!(job["training"]["steps"].as_integer(), Some(20));
            assert_eq!(job["metrics"]["log_freq"].as_integer(), Some(1));
            assert_eq!(job["job"]["print_config"].as_bool(), Some(true));
        }
    }

    #[test]
    fn bad_bases_are_refused_with_both_forms_named() {
        for bad in [
            "llama3",
            "llama3:",
            ":llama3_8b",
            "llama3:llama3_8b; rm -rf ~",
            "llama3:$(id)",
            "my-pkg:cfg",
            "missing.toml",
        ] {
            let e = TorchtitanBase::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("--torchtitan-config "), "{e}");
            assert!(e.contains("MODULE:CONFIG") && e.contains("TOML"), "{e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let broken = dir.path().join("broken.toml");
        std::fs::write(&broken, "[training\n").unwrap();
        let e = TorchtitanBase::parse(broken.to_str().unwrap()).unwrap_err();
        assert!(e.to_string().contains("not TOML"), "{e}");
        assert!(TorchtitanBase::parse("my_pkg.models:big_config").is_ok());
    }

    #[test]
    fn what_0_3_cannot_run_is_skipped_with_the_reason() {
        let plan = plan(SearchSpace {
            recompute: Some(vec![Recompute::SelectiveLayer]),
            ..SearchSpace::default()
        });
        let dir = tempfile::tempdir().unwrap();
        let outcomes = write_torchtitan_scripts(&plan, &registry(), dir.path()).unwrap();
        assert!(!outcomes.is_empty());
        for outcome in outcomes {
            let ScriptOutcome::Skipped { reason, .. } = outcome else {
                panic!("{outcome:?}");
            };
            assert!(reason.contains("per-layer"), "{reason}");
        }
        let too_few = TorchtitanSettings {
            train_iters: 1,
            ..registry()
        };
        assert!(matches!(
            torchtitan_script(&plan, &plan.candidates[0], &too_few),
            Err(LaunchError::TooFewIterations(1))
        ));
    }
}
