//! Cluster trials: plan -> trial -> refit -> re-plan on Megatron-LM,
//! torchtitan or PyTorch's own torch.distributed. Writes one launch script
//! per candidate; unless a dry run, runs each (its process group stopped
//! after the timeout), reads what it measured into a run row (append-only,
//! fsync per row), refits the cost model on every row so far (scored on
//! the rows it was not fitted to), re-ranks and trials the new leaders.
//! Returns the report as text: the CLI prints it.

use super::launch::{LaunchError, LaunchSettings, ScriptOutcome, write_launch_scripts};
use super::local::{self, job_of};
use super::megatron_log::{self, DEFAULT_WARMUP, ROW_COLUMNS};
use super::refit::{self, HeldOut};
use super::torch_launch::{
    self, TorchSettings, TorchTrial, TrialDevice, TrialJob, write_torch_scripts,
};
use super::torchtitan_launch::{
    TorchtitanBase, TorchtitanSettings, torchtitan_script, write_torchtitan_scripts,
};
use super::torchtitan_log;
use crate::calibrate::Dataset;
use crate::coefficients::CostModel;
use crate::config::{ParallelConfig, Recompute};
use crate::cost::{memory_per_stage, predict};
use crate::measure::process::run_script;
use crate::plan_file::{PlanFile, PlannedCandidate};
use crate::report::{ranking_change, render_markdown};
use crate::runs::{
    HistoryError, RowDefaults, Run, RunHistory, RunTable, RunsError, runs_from_table,
};
use crate::search::{SearchSpace, search};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A loop of cluster trials that could not go on.
#[derive(Debug, thiserror::Error)]
pub enum ClusterTrialError {
    #[error(transparent)]
    Launch(#[from] LaunchError),
    #[error(transparent)]
    History(#[from] HistoryError),
    #[error(transparent)]
    Runs(#[from] RunsError),
    #[error("{0}")]
    Report(String),
    #[error("cannot write {path}: {message}")]
    Write { path: String, message: String },
    /// The first round wrote no script: none of the candidates tried can
    /// run on the chosen engine.
    #[error(
        "--launch {engine}: none of the plan's top {tried} candidate(s) can run on it{more}; #{rank}: {reason}"
    )]
    NothingLaunchable {
        engine: &'static str,
        tried: usize,
        /// ` (raise --top to try more)` where the plan holds more.
        more: &'static str,
        rank: usize,
        reason: String,
    },
}

/// The engine the trials run on, with what its scripts share.
pub enum Cluster {
    Megatron(LaunchSettings),
    Torchtitan(TorchtitanSettings),
    Torch(Box<TorchSettings>),
}

/// What a finished trial measured: its run row, a line about it, and for a
/// torch trial the ranks' own reports.
struct Measured {
    row: Vec<String>,
    line: String,
    torch: Option<TorchTrial>,
    /// The model that ran, where it is not the plan's (fewer layers, to fit
    /// this machine).
    model: Option<crate::model::ModelSpec>,
}

/// What a log reader noticed (a cut-off line, an allocator record older
/// PyTorch would read the other way), after a trial's line, as `ingest`
/// prints it.
fn log_notes(notes: &[String]) -> String {
    notes.iter().map(|n| format!("; note: {n}")).collect()
}

/// The column a validation history adds to a torch trial's row: the
/// allocator its log recorded (see [`super::allocator`]), which the
/// engines' own rows carry.
const ALLOCATOR_COLUMN: &str = "expandable_segments";

/// `columns` and [`ALLOCATOR_COLUMN`] after them.
const fn with_allocator<const N: usize, const M: usize>(
    columns: &[&'static str; N],
) -> [&'static str; M] {
    let mut out = [ALLOCATOR_COLUMN; M];
    let mut i = 0;
    while i < N {
        out[i] = columns[i];
        i += 1;
    }
    out
}

const TORCH_HISTORY: [&str; torch_launch::ROW_COLUMNS.len() + 1] =
    with_allocator(&torch_launch::ROW_COLUMNS);

/// The histories written before the engines' rows gained the allocator
/// (the trial's candidate's, after the row).
const MEGATRON_HISTORY_V3: [&str; megatron_log::ROW_COLUMNS_V3.len() + 1] =
    with_allocator(&megatron_log::ROW_COLUMNS_V3);
const TORCHTITAN_HISTORY_V1: [&str; torchtitan_log::ROW_COLUMNS_V1.len() + 1] =
    with_allocator(&torchtitan_log::ROW_COLUMNS_V1);

impl Cluster {
    /// The engine as `--launch` names it.
    fn engine(&self) -> &'static str {
        match self {
            Cluster::Megatron(_) => "megatron",
            Cluster::Torchtitan(_) => "torchtitan",
            Cluster::Torch(_) => "torch",
        }
    }

    /// `megatron` or `torchtitan`, as `paratune ingest` names the log.
    fn log_kind(&self) -> &'static str {
        match self {
            Cluster::Megatron(_) => "megatron-log",
            Cluster::Torchtitan(_) => "torchtitan-log",
            Cluster::Torch(_) => "torch",
        }
    }

    fn write(&self, plan: &PlanFile, dir: &Path) -> Result<Vec<ScriptOutcome>, LaunchError> {
        match self {
            Cluster::Megatron(settings) => write_launch_scripts(plan, settings, dir),
            Cluster::Torchtitan(settings) => write_torchtitan_scripts(plan, settings, dir),
            Cluster::Torch(settings) => write_torch_scripts(plan, settings, dir),
        }
    }

    /// Whether the engine can run a candidate of `plan`.
    fn runs(&self, plan: &PlanFile, candidate: &PlannedCandidate) -> bool {
        match self {
            Cluster::Megatron(_) => candidate.megatron_args.is_some(),
            Cluster::Torchtitan(settings) => torchtitan_script(plan, candidate, settings).is_ok(),
            Cluster::Torch(_) => {
                torch_launch::unsupported(&plan.model, &candidate.config).is_none()
            }
        }
    }

    /// The history's columns: the engine's row, and after a torch
    /// trial's the allocator its `run.log` recorded.
    fn columns(&self) -> &'static [&'static str] {
        match self {
            Cluster::Megatron(_) => &ROW_COLUMNS,
            Cluster::Torchtitan(_) => &torchtitan_log::ROW_COLUMNS,
            Cluster::Torch(_) => &TORCH_HISTORY,
        }
    }

    /// Earlier versions of [`columns`](Self::columns) whose histories are
    /// rewritten with the new columns on opening.
    fn older_columns(&self) -> &'static [&'static [&'static str]] {
        match self {
            Cluster::Torch(_) => &[
                &torch_launch::ROW_COLUMNS_V1,
                &torch_launch::ROW_COLUMNS_V2,
                &torch_launch::ROW_COLUMNS,
            ],
            Cluster::Megatron(_) => &[
                &megatron_log::ROW_COLUMNS_V1,
                &megatron_log::ROW_COLUMNS_V2,
                &megatron_log::ROW_COLUMNS_V3,
                &MEGATRON_HISTORY_V3,
            ],
            Cluster::Torchtitan(_) => &[
                &torchtitan_log::ROW_COLUMNS_V0,
                &torchtitan_log::ROW_COLUMNS_V1,
                &TORCHTITAN_HISTORY_V1,
            ],
        }
    }

    /// What a finished trial of `candidate` of `plan` measured, as a row of
    /// [`columns`](Self::columns).
    fn read(
        &self,
        log: &Path,
        plan: &PlanFile,
        candidate: &PlannedCandidate,
    ) -> Result<Measured, String> {
        let mut measured = self.read_engine_row(log, plan, candidate)?;
        if let Cluster::Torch(_) = self {
            // The allocator the log recorded; a script from before the
            // record ran the candidate's as far as paratune knows.
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let recorded = super::allocator::recorded_in_log(&text);
            let expandable = recorded
                .as_ref()
                .map_or(candidate.config.expandable_segments, |r| {
                    r.expandable_segments
                });
            measured.row.push(crate::config::on_off(expandable).into());
            if let Some(note) = recorded.and_then(|r| r.note) {
                measured.line.push_str(&log_notes(&[note]));
            }
        }
        Ok(measured)
    }

    /// What a finished trial of `candidate` of `plan` measured, from its log
    /// (or, for torch trials, its ranks' reports beside it), as a row of the
    /// engine's columns.
    fn read_engine_row(
        &self,
        log: &Path,
        plan: &PlanFile,
        candidate: &PlannedCandidate,
    ) -> Result<Measured, String> {
        let name = log.display().to_string();
        let plain = |(row, line): (Vec<String>, String)| Measured {
            row,
            line,
            torch: None,
            model: None,
        };
        match self {
            Cluster::Torch(_) => {
                let job_path = log.with_file_name("job.json");
                let text = std::fs::read_to_string(&job_path)
                    .map_err(|e| format!("cannot read {}: {e}", job_path.display()))?;
                let job: TrialJob = serde_json::from_str(&text)
                    .map_err(|e| format!("{}: not a trial job ({e})", job_path.display()))?;
                let trial =
                    torch_launch::read_trial(&job.report_dir, &job).map_err(|e| e.to_string())?;
                let first = &trial.ranks[0];
                let line = format!(
                    "{}: {:.1} ms per iteration (median of {}, {} x {} micro-batches, {}, {}), peak {:.1} MiB on the fullest rank ({})",
                    candidate.config,
                    trial.median_ms,
                    trial.iterations,
                    first.micro_batches,
                    candidate.config.micro_batch,
                    first.schedule,
                    first.data_parallel,
                    trial.peak_bytes() / (1u64 << 20) as f64,
                    first.memory_kind
                );
                // What the engine exposes of its collectives, one profiled
                // iteration, averaged over the ranks.
                let collectives: Vec<String> = trial
                    .collectives_ms()
                    .iter()
                    .map(|(kind, ms)| format!("{kind} {ms:.1} ms"))
                    .collect();
                let line = if collectives.is_empty() {
                    line
                } else {
                    format!("{line}; collectives a rank: {}", collectives.join(", "))
                };
                // Expert parallelism: the experts a rank held and the tokens
                // they received, so that an imbalanced routing shows.
                let line = match trial.expert_tokens() {
                    Some((ep, local, dispatcher, fewest, most)) => format!(
                        "{line}; ep{ep}, {local} experts a rank, {fewest:.0} to {most:.0} routed tokens received a rank per step ({dispatcher} dispatch)"
                    ),
                    None => line,
                };
                // Context parallelism: the cp ranks and how they exchanged keys and values.
                let line = match trial.context() {
                    Some((cp, exchange)) => format!(
                        "{line}; cp{cp}, {} tokens a rank, {}",
                        plan.model.seq_len / cp,
                        // read_trial checked it is the planned exchange.
                        match <crate::config::CpComm as crate::choice::Choice>::parse(
                            "cp_comm", &exchange,
                        ) {
                            Ok(crate::config::CpComm::A2a) => {
                                "heads split over the cp ranks by all-to-all".to_string()
                            }
                            Ok(crate::config::CpComm::AllGather) => {
                                "keys and values all-gathered over the cp ranks".to_string()
                            }
                            Ok(crate::config::CpComm::P2p) => {
                                "keys and values by the p2p ring".to_string()
                            }
                            Ok(crate::config::CpComm::A2aP2p) => {
                                "heads split by all-to-all, then a ring".to_string()
                            }
                            Err(_) => format!("keys and values by {exchange}"),
                        }
                    ),
                    None => line,
                };
                let mut model = plan.model.clone();
                model.layers = job.model.layers;
                let scaled = model.layers != plan.model.layers;
                let line = if scaled {
                    format!(
                        "{line}; ran {} of the model's {} layers, to fit this machine",
                        model.layers, plan.model.layers
                    )
                } else {
                    line
                };
                let row = trial.row(plan, &model, &candidate.config, &name);
                Ok(Measured {
                    row,
                    line,
                    torch: Some(trial),
                    model: scaled.then_some(model),
                })
            }
            Cluster::Megatron(_) => {
                let run = megatron_log::read(log, DEFAULT_WARMUP).map_err(|e| e.to_string())?;
                let row = run
                    .row(&name, "paratune validate")
                    .map_err(|e| e.to_string())?;
                let line = format!(
                    "{}: {:.1} ms per iteration (steady-state median, {} iterations){}{}",
                    run.config.summary(),
                    run.steady_median_ms,
                    run.steady_iterations,
                    run.peak_allocated_bytes
                        .map(|b| format!(", peak {:.1} GiB allocated", b / 1024f64.powi(3)))
                        .unwrap_or_default(),
                    log_notes(&run.notes)
                );
                Ok(plain((row, line)))
            }
            Cluster::Torchtitan(settings) => {
                // A 0.2 trial's configuration is its job.toml; a 0.3 trial
                // prints its own (`--debug.print_config`).
                let config = match &settings.base {
                    TorchtitanBase::JobToml { .. } => Some(
                        torchtitan_log::read_config_file(&log.with_file_name("job.toml"))
                            .map_err(|e| e.to_string())?,
                    ),
                    TorchtitanBase::Registry { .. } => None,
                };
                let options = torchtitan_log::Options {
                    warmup: DEFAULT_WARMUP,
                    config,
                    ..torchtitan_log::Options::default()
                };
                let run = torchtitan_log::read(log, &options).map_err(|e| e.to_string())?;
                let line = format!(
                    "{}: {:.1} ms per iteration (steady-state median, {} steps){}{}",
                    run.summary(),
                    run.steady_median_ms,
                    run.steady_steps,
                    run.peak_reserved_gib
                        .map(|g| format!(", peak {g:.1} GiB reserved on rank 0"))
                        .unwrap_or_default(),
                    log_notes(&run.notes)
                );
                Ok(plain((run.row("paratune validate"), line)))
            }
        }
    }
}

/// A trial's prediction before it ran and what it measured.
struct RoundTrial {
    round: usize,
    rank: usize,
    config: ParallelConfig,
    predicted_s: f64,
    measured_s: f64,
}

/// How a loop of cluster trials runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoopSettings {
    /// Candidates per round, from the top of the round's plan.
    pub top: usize,
    pub rounds: usize,
    /// How long one trial may run before its process group is stopped.
    pub timeout: Duration,
    /// Write the first round's scripts and stop.
    pub dry_run: bool,
}

/// Plan -> trial -> refit -> re-plan on `cluster`, from `plan` predicted
/// with `prior`: trials under `out` (round N > 1 in `out/round-N`), their
/// rows in `out/runs-history.csv` (appended before the next trial runs), the
/// report returned and kept as `out/report.md`. `progress` hears of each
/// trial as it starts.
pub fn run_loop(
    plan: &PlanFile,
    prior: &CostModel,
    cluster: &Cluster,
    settings: LoopSettings,
    out: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<String, ClusterTrialError> {
    let mut report = String::new();
    if let Cluster::Torch(settings) = cluster
        && settings.device == TrialDevice::Cpu
    {
        report.push_str(&contention_note(plan));
    }
    let history_path = out.join("runs-history.csv");
    let mut history = None;
    let timeout = settings.timeout;
    let job = job_of(plan);
    let mut current = prior.clone();
    let mut round_plan = plan.clone();
    // A rerun into the same OUT resumes: what its history holds is kept,
    // not run again, and counts in every refit.
    let mut tried: Vec<ParallelConfig> = measured_runs(plan, &history_path)?
        .map(|runs| {
            runs.into_iter()
                .map(|r| planned_config(plan, r.config))
                .collect()
        })
        .unwrap_or_default();
    let resumed = tried.len();
    if resumed > 0 {
        let _ = writeln!(
            report,
            "resuming: {resumed} run(s) already in {} are kept and not run again",
            history_path.display()
        );
    }
    let mut trials: Vec<RoundTrial> = Vec::new();
    let mut first_round_error = None;
    let mut last_held_out = None;
    let mut winner = plan.candidates.first().map(|c| c.config);
    for round in 1..=settings.rounds {
        // Round 1 writes into OUT, later rounds into OUT/round-N.
        let dir = if round == 1 {
            out.to_path_buf()
        } else {
            out.join(format!("round-{round}"))
        };
        let mut top = round_plan.clone();
        if matches!(cluster, Cluster::Torch(_)) {
            // The worker's limits are known before anything runs: trial the
            // best candidates it can run, and say which it passed over.
            let runnable = top.clone();
            for c in top.candidates.iter().take(settings.top) {
                if let Some(reason) = torch_launch::unsupported(&plan.model, &c.config) {
                    let _ = writeln!(report, "candidate #{}: passed over ({reason})", c.rank);
                }
            }
            top.candidates.retain(|c| cluster.runs(&runnable, c));
        }
        top.candidates.truncate(settings.top);
        top.candidates.retain(|c| !tried.contains(&c.config));
        tried.extend(top.candidates.iter().map(|c| c.config));
        let (scripts, skipped) = write_scripts(&top, cluster, &dir, &mut report)?;
        if round == 1
            && scripts.is_empty()
            && resumed == 0
            && let Some((rank, reason)) = skipped.into_iter().next()
        {
            let tried = top.candidates.len();
            return Err(ClusterTrialError::NothingLaunchable {
                engine: cluster.engine(),
                tried,
                more: if plan.candidates.len() > tried {
                    " (raise --top to try more)"
                } else {
                    ""
                },
                rank,
                reason,
            });
        }
        // A resumed first round whose candidates all ran still refits.
        if scripts.is_empty() && !(round == 1 && resumed > 0) {
            let _ = writeln!(report, "round {round}: no new candidate to run; stopping");
            break;
        }
        if settings.dry_run {
            report.push_str(&dry_run_note(cluster, &dir));
            return Ok(report);
        }
        if history.is_none() {
            let (opened, repaired, upgraded) = RunHistory::open_upgrading(
                &history_path,
                cluster.columns(),
                cluster.older_columns(),
            )?;
            if let Some(repair) = repaired {
                let _ = writeln!(report, "note: {repair}");
            }
            if upgraded {
                let _ = writeln!(
                    report,
                    "note: {}: rewritten with this paratune's columns (the columns it lacked added, empty in its earlier rows)",
                    history_path.display()
                );
            }
            history = Some(opened);
        }
        let history = history.as_mut().expect("opened above");
        for (rank, script) in &scripts {
            let candidate = top
                .candidates
                .iter()
                .find(|c| c.rank == *rank)
                .expect("a script per candidate");
            let Some(measured) = run_and_read(
                cluster,
                &top,
                candidate,
                script,
                timeout,
                history,
                &mut report,
                progress,
            )?
            else {
                continue;
            };
            // A scaled-down trial is predicted for the model that ran.
            let ran = crate::cost::Scenario::new(
                measured.model.as_ref().unwrap_or(&plan.model),
                plan.global_batch,
                &plan.nodes,
                plan.gpus,
                &current,
            );
            let predicted_s = predict(&ran, &candidate.config).iteration_s;
            if let Some(trial) = &measured.torch {
                report.push_str(&memory_lines(&ran, candidate, trial, &current));
            }
            trials.push(RoundTrial {
                round,
                rank: *rank,
                config: candidate.config,
                predicted_s,
                measured_s: trial_seconds(cluster, &measured),
            });
        }
        let this_round: Vec<&RoundTrial> = trials.iter().filter(|t| t.round == round).collect();
        let round_error = round_table(round, &this_round, &mut report);
        if round == 1 {
            first_round_error = round_error;
        }
        let Some((fitted, held_out)) = refit_and_rerank(plan, prior, &history_path, &mut report)?
        else {
            break;
        };
        if let Some(error) = refit::mape(&held_out) {
            let _ = writeln!(
                report,
                "round {round}: after the refit on {} trial(s), held-out (leave-one-out) error {error:.1}%",
                held_out.len()
            );
            last_held_out = Some((round, error));
        }
        current = fitted.clone();
        // Plan again with the refitted model: its leaders are the next round's trials.
        // Only what the engine can run is a candidate for a cluster trial.
        // The engine and the allocators stay the plan's: its trials run
        // them, and the refit should rank what they can run.
        let allocators = priced_allocators(plan);
        let space = SearchSpace {
            engine: plan
                .candidates
                .first()
                .map_or(Default::default(), |c| c.config.engine),
            expandable_segments: (!allocators.is_empty()).then_some(allocators),
            ..SearchSpace::default()
        };
        let result = search(&job, &space, &fitted);
        round_plan = PlanFile::of(&job, &fitted, &result, result.candidates.len());
        let runnable = round_plan.clone();
        round_plan.candidates.retain(|c| cluster.runs(&runnable, c));
        round_plan.candidates.truncate(settings.top.max(5));
        for (i, c) in round_plan.candidates.iter_mut().enumerate() {
            c.rank = i + 1;
        }
        let leader = round_plan.candidates.first().map(|c| c.config);
        if round > 1 && leader == winner {
            let _ = writeln!(report, "\nround {round}: the winner held; stopping");
            break;
        }
        winner = leader;
        if round < settings.rounds {
            let _ = writeln!(
                report,
                "\nround {round}: with the refitted model the leader is {}",
                leader.map_or("none".to_string(), |c| c.to_string())
            );
        }
    }
    if let (Some(first), Some((round, last))) = (first_round_error, last_held_out) {
        let _ = writeln!(
            report,
            "\nheld-out error: {first:.1}% in round 1 (the plan's model, before any trial), {last:.1}% after round {round} (leave-one-out over every trial)"
        );
    }
    // Kept beside the trials, whole: what the terminal showed.
    let saved = out.join("report.md");
    crate::atomic::write_atomically(&saved, report.as_bytes()).map_err(|e| {
        ClusterTrialError::Write {
            path: saved.display().to_string(),
            message: e.to_string(),
        }
    })?;
    Ok(report)
}

/// A trial's measured iteration time, seconds: its row's `iter_ms` (the
/// steady-state median in every engine's row).
fn trial_seconds(cluster: &Cluster, measured: &Measured) -> f64 {
    cluster
        .columns()
        .iter()
        .position(|c| *c == "iter_ms")
        .and_then(|i| measured.row.get(i))
        .and_then(|ms| ms.parse::<f64>().ok())
        .map_or(f64::NAN, |ms| ms / 1e3)
}

/// What the ranks of a torch trial on one machine can and cannot say.
fn contention_note(plan: &PlanFile) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!(
        "note: the {} ranks run on this machine's {cores} cores and talk through its memory; where ranks outnumber cores they take turns, so the times measure this machine (contention included), not the planned cluster's links\n",
        plan.gpus
    )
}

fn dry_run_note(cluster: &Cluster, dir: &Path) -> String {
    match cluster {
        Cluster::Torch(_) => format!(
            "dry run: nothing was started. Run a script ({}/candidate-N/run.sh); its ranks write candidate-N/report/, which a rerun without --dry-run reads, refits on and re-ranks\n",
            dir.display()
        ),
        _ => format!(
            "dry run: nothing was started. Run a script on the cluster, then `paratune ingest {} {}/candidate-N/run.log --out runs.csv` (or rerun without --dry-run to let validate run them, read their logs and refit)\n",
            cluster.log_kind(),
            dir.display()
        ),
    }
}

/// Each rank's measured peak against its stage's predicted allocation,
/// within the cost model's band or flagged.
fn memory_lines(
    scenario: &crate::cost::Scenario,
    candidate: &PlannedCandidate,
    trial: &TorchTrial,
    cost: &CostModel,
) -> String {
    let stages = memory_per_stage(scenario, &candidate.config);
    let (low, high) = local::band(cost);
    let mut text = String::new();
    for r in &trial.ranks {
        let Some(stage) = stages.get(r.stage() as usize) else {
            continue;
        };
        let predicted = stage.allocated();
        // As everywhere: the prediction's error against the measurement.
        let error = (predicted - r.peak_memory_bytes) / r.peak_memory_bytes;
        let verdict = if error > high {
            "measured UNDER the band (over-predicted)"
        } else if error < low {
            "measured OVER the band (under-predicted)"
        } else {
            "within the band"
        };
        let _ = writeln!(
            text,
            "candidate #{} rank {} (stage {}): peak {:.1} MiB measured, {:.1} MiB predicted allocated (error {:+.0}%, band {:+.0}%..{:+.0}%): {verdict}",
            candidate.rank,
            r.rank,
            r.stage(),
            r.peak_memory_bytes / (1u64 << 20) as f64,
            predicted / (1u64 << 20) as f64,
            100.0 * error,
            100.0 * low,
            100.0 * high
        );
    }
    text
}

/// The round's trials, predicted (before they ran) against measured;
/// returns their mean absolute error, percent.
fn round_table(round: usize, trials: &[&RoundTrial], report: &mut String) -> Option<f64> {
    let measured: Vec<&&RoundTrial> = trials.iter().filter(|t| t.measured_s.is_finite()).collect();
    if measured.is_empty() {
        return None;
    }
    let _ = writeln!(
        report,
        "\nround {round}: predicted (before the trial) against measured"
    );
    let _ = writeln!(
        report,
        "| # | configuration | predicted ms | measured ms | error |"
    );
    let _ = writeln!(report, "|---|---|---|---|---|");
    let mut sum = 0.0;
    for t in &measured {
        let error = (t.predicted_s - t.measured_s) / t.measured_s;
        sum += error.abs();
        let _ = writeln!(
            report,
            "| {} | {} | {:.1} | {:.1} | {:+.1}% |",
            t.rank,
            t.config,
            t.predicted_s * 1e3,
            t.measured_s * 1e3,
            100.0 * error
        );
    }
    let mape = 100.0 * sum / measured.len() as f64;
    let _ = writeln!(
        report,
        "round {round}: error before the trials {mape:.1}% (mean absolute, {} trial(s))",
        measured.len()
    );
    Some(mape)
}

/// A candidate's rank in the plan, and its script or why it has none.
type WrittenScript = (usize, PathBuf);
type SkippedCandidate = (usize, String);

/// Writes the launch scripts of `plan`'s candidates into `dir`; reports
/// each and returns the written ones and the skipped ones.
fn write_scripts(
    plan: &PlanFile,
    cluster: &Cluster,
    dir: &Path,
    report: &mut String,
) -> Result<(Vec<WrittenScript>, Vec<SkippedCandidate>), ClusterTrialError> {
    let mut scripts = Vec::new();
    let mut skipped = Vec::new();
    for outcome in cluster.write(plan, dir)? {
        match outcome {
            ScriptOutcome::Written { rank, path } => {
                let _ = writeln!(report, "candidate #{rank}: {}", path.display());
                scripts.push((rank, path));
            }
            ScriptOutcome::Skipped { rank, reason } => {
                let _ = writeln!(report, "candidate #{rank}: no script ({reason})");
                skipped.push((rank, reason));
            }
        }
    }
    Ok((scripts, skipped))
}

/// Runs one script, reads its log into the history, says what happened.
#[allow(clippy::too_many_arguments)]
fn run_and_read(
    cluster: &Cluster,
    plan: &PlanFile,
    candidate: &PlannedCandidate,
    script: &Path,
    timeout: Duration,
    history: &mut RunHistory,
    report: &mut String,
    progress: &mut dyn FnMut(&str),
) -> Result<Option<Measured>, ClusterTrialError> {
    let rank = candidate.rank;
    let log = script.with_file_name("run.log");
    progress(&format!(
        "candidate #{rank}: running {} ...",
        script.display()
    ));
    if let Err(why) = run_script(script, timeout) {
        let detail = cluster
            .read(&log, plan, candidate)
            .err()
            .filter(|_| matches!(cluster, Cluster::Torch(_)) && !why.starts_with("killed"))
            .map(|e| format!(" ({e})"))
            .unwrap_or_default();
        let _ = writeln!(
            report,
            "candidate #{rank}: {why}{detail}; its log is {} (kept)",
            log.display()
        );
        return Ok(None);
    }
    match cluster.read(&log, plan, candidate) {
        Ok(measured) => {
            // Kept before anything else: an interruption loses no finished run.
            history.append(&measured.row)?;
            let _ = writeln!(report, "candidate #{rank}: {}", measured.line);
            Ok(Some(measured))
        }
        Err(e) => {
            let _ = writeln!(report, "candidate #{rank}: its log does not read: {e}");
            Ok(None)
        }
    }
}

/// The configuration of `plan`'s that a history row which ran `ran` was
/// a trial of. A row's allocator cell says what its ranks had (the log's
/// record, which the shell may have changed from what the candidate was
/// priced with; an upgraded history's empty cell the engine's default),
/// so a row is the plan's candidate of its configuration whatever its
/// allocator; where the plan holds that configuration under both
/// allocators, the one the row recorded. A row of no candidate of the
/// plan (a later round's, searched under the plan's allocators) keeps the
/// allocator it recorded where the plan priced that one, else takes the
/// plan's.
fn planned_config(plan: &PlanFile, ran: ParallelConfig) -> ParallelConfig {
    let planned = |c: ParallelConfig| plan.candidates.iter().any(|p| p.config == c);
    let other = ParallelConfig {
        expandable_segments: !ran.expandable_segments,
        ..ran
    };
    let priced = priced_allocators(plan).contains(&ran.expandable_segments);
    if planned(ran) || (!planned(other) && priced) {
        ran
    } else {
        other
    }
}

/// The allocators (expandable segments off, on) `plan`'s candidates were
/// priced under.
fn priced_allocators(plan: &PlanFile) -> Vec<bool> {
    [false, true]
        .into_iter()
        .filter(|&on| {
            plan.candidates
                .iter()
                .any(|c| c.config.expandable_segments == on)
        })
        .collect()
}

/// The runs a history holds, understood as the plan's job; `None` when
/// there is no history yet.
fn measured_runs(plan: &PlanFile, history: &Path) -> Result<Option<Vec<Run>>, ClusterTrialError> {
    if !history.is_file() {
        return Ok(None);
    }
    let Ok(table) = RunTable::read(history) else {
        return Ok(None);
    };
    let defaults = RowDefaults {
        model: plan.model.clone(),
        model_is_given: true,
        ..RowDefaults::gpt(
            plan.model.vocab,
            plan.model.seq_len,
            plan.model.attention,
            Recompute::None,
        )
    };
    let job = job_of(plan);
    Ok(Some(runs_from_table(
        &table,
        &defaults,
        (&job.nodes).into(),
    )?))
}

/// Refits the plan's cost model on every run measured so far, prints how
/// the ranking of the plan's candidates moved, and scores the refit on the
/// runs it was not fitted to (leave-one-out).
fn refit_and_rerank(
    plan: &PlanFile,
    prior: &CostModel,
    history: &Path,
    report: &mut String,
) -> Result<Option<(CostModel, Vec<HeldOut>)>, ClusterTrialError> {
    let Some(runs) = measured_runs(plan, history)?.filter(|runs| !runs.is_empty()) else {
        let _ = writeln!(report, "no run was measured: nothing to refit");
        return Ok(None);
    };
    let job = job_of(plan);
    let measured = runs.len();
    let dataset = Dataset {
        name: history.display().to_string(),
        runs,
        group: plan.nodes.clone(),
    };
    // A few trial runs cannot inform every coefficient: fit as many of the
    // most influential ones as the rows allow, the rest keep the plan's.
    let fitted = match refit::refit(&dataset, prior, &format!("{}-refit", prior.name)) {
        Ok(Some(fitted)) => fitted,
        Ok(None) => {
            let _ = writeln!(
                report,
                "\n{measured} measured run(s): too few to refit any coefficient yet; trial more candidates (--top) or ingest more runs"
            );
            return Ok(None);
        }
        // The runs are kept; a refit that cannot be made is reported,
        // not fatal.
        Err(e) => {
            let _ = writeln!(report, "\nno refit on {}: {e}", history.display());
            return Ok(None);
        }
    };
    let _ = writeln!(
        report,
        "\nrefitted {}",
        fitted
            .calibration
            .coefficients
            .iter()
            .filter(|c| fitted.freed.contains(&c.name))
            .map(|c| format!("{} {:.4} -> {:.4}", c.name, c.prior, c.value))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let model = fitted.calibration.model;
    let rank = |cost: &CostModel| -> Vec<(String, f64)> {
        let s = job.scenario(cost);
        let mut ranked: Vec<(String, f64)> = plan
            .candidates
            .iter()
            .map(|c| (c.config.to_string(), predict(&s, &c.config).iteration_s))
            .collect();
        ranked.sort_by(|a, b| a.1.total_cmp(&b.1));
        ranked
    };
    let change = ranking_change(&rank(prior), &rank(&model))
        .map_err(|e| ClusterTrialError::Report(e.to_string()))?;
    let _ = writeln!(
        report,
        "\nrefit on {measured} measured run(s) of {}:",
        history.display()
    );
    report.push_str(&render_markdown(&change));
    let held_out = refit::leave_one_out(&dataset, prior);
    let Some(memory) = refit::refit_memory(&dataset, &model) else {
        return Ok(Some((model, held_out)));
    };
    let _ = writeln!(
        report,
        "\nmemory: refitted {} to {} measured peak(s); allocated-peak error {} before, {} held out (leave-one-out)",
        memory
            .coefficients
            .iter()
            .map(|(name, before, after)| format!("{name} {before:.4} -> {after:.4}"))
            .collect::<Vec<_>>()
            .join(", "),
        memory.before.len(),
        percent(refit::mape(&memory.before)),
        percent(refit::mape(&memory.held_out)),
    );
    Ok(Some((memory.model, held_out)))
}

fn percent(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.1}%"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::SearchSpace;
    use crate::validate::launch::tests::plan_on;

    /// GPT-3 13B on 8 A100s for torchtitan, the allocator given.
    fn plan(expandable_segments: Vec<bool>) -> PlanFile {
        plan_on(
            "gpt3-13b",
            1,
            8,
            64,
            SearchSpace {
                engine: crate::config::Engine::Torchtitan,
                compile: Some(vec![false]),
                expandable_segments: Some(expandable_segments),
                ..SearchSpace::default()
            },
        )
    }

    #[test]
    fn a_history_row_is_the_candidate_it_ran_whatever_allocator_it_recorded() {
        // One allocator planned: a row that recorded the other (the shell
        // changed it) is still that candidate's run.
        let fixed = plan(vec![false]);
        let first = fixed.candidates[0].config;
        let recorded_on = ParallelConfig {
            expandable_segments: true,
            ..first
        };
        assert_eq!(planned_config(&fixed, recorded_on), first);
        // Both planned: each row is the twin whose allocator it recorded,
        // so resuming runs neither twice and skips neither.
        let both = plan(vec![false, true]);
        let configs: Vec<ParallelConfig> = both.candidates.iter().map(|c| c.config).collect();
        let flipped = |c: ParallelConfig| ParallelConfig {
            expandable_segments: !c.expandable_segments,
            ..c
        };
        let twin = *configs
            .iter()
            .find(|&&c| configs.contains(&flipped(c)))
            .expect("a configuration planned under both allocators");
        let (off, on) = if twin.expandable_segments {
            (flipped(twin), twin)
        } else {
            (twin, flipped(twin))
        };
        assert_eq!(planned_config(&both, off), off);
        assert_eq!(planned_config(&both, on), on);
        // A row of no candidate of the plan takes the plan's allocator.
        let elsewhere = ParallelConfig {
            micro_batch: 64,
            expandable_segments: true,
            ..first
        };
        assert!(!fixed.candidates.iter().any(|c| c.config.micro_batch == 64));
        assert!(!planned_config(&fixed, elsewhere).expandable_segments);
        // Under both, a later round's row keeps the allocator it recorded.
        for recorded in [false, true] {
            let later = ParallelConfig {
                expandable_segments: recorded,
                ..elsewhere
            };
            assert_eq!(planned_config(&both, later), later);
        }
    }
}
