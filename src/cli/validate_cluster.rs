//! `paratune validate --launch megatron|torchtitan`: cluster trials through
//! Megatron-LM or torchtitan. Writes one launch script per candidate; unless
//! `--dry-run`, runs each (killed after `--timeout`), reads its log into a
//! run row (append-only, fsync per row), refits the cost model on every row
//! measured so far and re-ranks the plan's candidates.

use super::args::{LaunchEngine, Launcher as LauncherArg, ValidateArgs};
use super::commands::emit;
use super::measure::{check_writable, wait_with_timeout};
use super::resolve;
use anyhow::Result;
use paratune::calibrate::{CalibrateError, Dataset, FitOptions, calibrate};
use paratune::coefficients::CostModel;
use paratune::config::ParallelConfig;
use paratune::config::Recompute;
use paratune::cost::predict;
use paratune::plan_file::PlanFile;
use paratune::report::{ranking_change, render_markdown};
use paratune::runs::{RowDefaults, RunHistory, RunTable, runs_from_table};
use paratune::search::{SearchSpace, search};
use paratune::validate::launch::{
    LaunchError, LaunchSettings, Launcher, ScriptOutcome, write_launch_scripts,
};
use paratune::validate::local::job_of;
use paratune::validate::megatron_log::{self, DEFAULT_WARMUP, ROW_COLUMNS};
use paratune::validate::torchtitan_launch::{
    TorchtitanBase, TorchtitanSettings, torchtitan_script, write_torchtitan_scripts,
};
use paratune::validate::torchtitan_log;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The engine the trials run on, with what its scripts share.
enum Cluster {
    Megatron(LaunchSettings),
    Torchtitan(TorchtitanSettings),
}

impl Cluster {
    fn of(args: &ValidateArgs, engine: LaunchEngine) -> Result<Cluster> {
        let launcher = match args.launcher {
            LauncherArg::Torchrun => Launcher::Torchrun,
            LauncherArg::Srun => Launcher::Srun,
        };
        let train_iters = args.iterations as u64;
        Ok(match engine {
            LaunchEngine::Megatron => {
                let mut settings = LaunchSettings::new(args.megatron_path.clone(), launcher);
                settings.train_iters = train_iters;
                Cluster::Megatron(settings)
            }
            LaunchEngine::Torchtitan => {
                let Some(base) = &args.torchtitan_config else {
                    return Err(LaunchError::BadTorchtitanConfig {
                        value: "(not given)".into(),
                        problem: "--launch torchtitan needs it".into(),
                    }
                    .into());
                };
                Cluster::Torchtitan(TorchtitanSettings {
                    base: TorchtitanBase::parse(base)?,
                    launcher,
                    train_iters,
                })
            }
        })
    }

    /// `megatron` or `torchtitan`, as `paratune ingest` names the log.
    fn log_kind(&self) -> &'static str {
        match self {
            Cluster::Megatron(_) => "megatron-log",
            Cluster::Torchtitan(_) => "torchtitan-log",
        }
    }

    fn write(&self, plan: &PlanFile, dir: &Path) -> Result<Vec<ScriptOutcome>, LaunchError> {
        match self {
            Cluster::Megatron(settings) => write_launch_scripts(plan, settings, dir),
            Cluster::Torchtitan(settings) => write_torchtitan_scripts(plan, settings, dir),
        }
    }

    /// Whether the engine can run a candidate of `plan`.
    fn runs(&self, plan: &PlanFile, candidate: &paratune::plan_file::PlannedCandidate) -> bool {
        match self {
            Cluster::Megatron(_) => candidate.megatron_args.is_some(),
            Cluster::Torchtitan(settings) => torchtitan_script(plan, candidate, settings).is_ok(),
        }
    }

    fn columns(&self) -> &'static [&'static str] {
        match self {
            Cluster::Megatron(_) => &ROW_COLUMNS,
            Cluster::Torchtitan(_) => &torchtitan_log::ROW_COLUMNS,
        }
    }

    /// The run row of a finished trial's log, and a line about it.
    fn read(&self, log: &Path) -> Result<(Vec<String>, String), String> {
        let name = log.display().to_string();
        match self {
            Cluster::Megatron(_) => {
                let run = megatron_log::read(log, DEFAULT_WARMUP).map_err(|e| e.to_string())?;
                let row = run
                    .row(&name, "paratune validate")
                    .map_err(|e| e.to_string())?;
                let line = format!(
                    "{}: {:.1} ms per iteration (steady-state median, {} iterations){}",
                    run.config.summary(),
                    run.steady_median_ms,
                    run.steady_iterations,
                    run.peak_allocated_bytes
                        .map(|b| format!(", peak {:.1} GiB allocated", b / 1024f64.powi(3)))
                        .unwrap_or_default()
                );
                Ok((row, line))
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
                    "{}: {:.1} ms per iteration (steady-state median, {} steps){}",
                    run.summary(),
                    run.steady_median_ms,
                    run.steady_steps,
                    run.peak_reserved_gib
                        .map(|g| format!(", peak {g:.1} GiB reserved on rank 0"))
                        .unwrap_or_default()
                );
                Ok((run.row("paratune validate"), line))
            }
        }
    }
}

pub fn run(args: &ValidateArgs, engine: LaunchEngine, plan: &PlanFile, out: &Path) -> Result<()> {
    // The base is checked before anything is written.
    let cluster = Cluster::of(args, engine)?;
    check_writable(out, "--out")?;
    let mut report = String::new();
    let history_path = out.join("runs-history.csv");
    let mut history = None;
    let timeout = super::measure::timeout(args.timeout)?;
    let job = job_of(plan);
    let mut round_plan = plan.clone();
    let mut tried: Vec<ParallelConfig> = Vec::new();
    let mut winner = plan.candidates.first().map(|c| c.config);
    for round in 1..=args.rounds {
        // Round 1 writes into OUT, later rounds into OUT/round-N.
        let dir = if round == 1 {
            out.to_path_buf()
        } else {
            out.join(format!("round-{round}"))
        };
        let mut top = round_plan.clone();
        top.candidates.truncate(args.top);
        top.candidates.retain(|c| !tried.contains(&c.config));
        tried.extend(top.candidates.iter().map(|c| c.config));
        let scripts = write_scripts(&top, &cluster, &dir, &mut report)?;
        if scripts.is_empty() {
            let _ = writeln!(report, "round {round}: no new candidate to run; stopping");
            break;
        }
        if args.dry_run {
            let _ = writeln!(
                report,
                "dry run: nothing was started. Run a script on the cluster, then `paratune ingest {} {}/candidate-N/run.log --out runs.csv` (or rerun without --dry-run to let validate run them, read their logs and refit)",
                cluster.log_kind(),
                dir.display()
            );
            return emit(&report);
        }
        if history.is_none() {
            let (opened, repaired) = RunHistory::open(&history_path, cluster.columns())?;
            if let Some(repair) = repaired {
                let _ = writeln!(report, "note: {repair}");
            }
            history = Some(opened);
        }
        let history = history.as_mut().expect("opened above");
        for (rank, script) in &scripts {
            run_and_read(&cluster, *rank, script, timeout, history, &mut report)?;
        }
        let Some(fitted) = refit_and_rerank(args, plan, &history_path, &mut report)? else {
            break;
        };
        // Plan again with the refitted model: its leaders are the next round's trials.
        // Only what the engine can run is a candidate for a cluster trial.
        let space = SearchSpace {
            engine: plan
                .candidates
                .first()
                .map_or(Default::default(), |c| c.config.engine),
            ..SearchSpace::default()
        };
        let result = search(&job, &space, &fitted);
        round_plan = super::commands::plan_file(&job, &fitted, &result, result.candidates.len());
        let runnable = round_plan.clone();
        round_plan.candidates.retain(|c| cluster.runs(&runnable, c));
        round_plan.candidates.truncate(args.top.max(5));
        for (i, c) in round_plan.candidates.iter_mut().enumerate() {
            c.rank = i + 1;
        }
        let leader = round_plan.candidates.first().map(|c| c.config);
        if round > 1 && leader == winner {
            let _ = writeln!(report, "\nround {round}: the winner held; stopping");
            break;
        }
        winner = leader;
        if round < args.rounds {
            let _ = writeln!(
                report,
                "\nround {round}: with the refitted model the leader is {}",
                leader.map_or("none".to_string(), |c| c.to_string())
            );
        }
    }
    emit(&report)
}

/// Writes the launch scripts of `plan`'s candidates into `dir`; reports
/// each and returns the written ones.
fn write_scripts(
    plan: &PlanFile,
    cluster: &Cluster,
    dir: &Path,
    report: &mut String,
) -> Result<Vec<(usize, PathBuf)>> {
    let mut scripts = Vec::new();
    for outcome in cluster.write(plan, dir)? {
        match outcome {
            ScriptOutcome::Written { rank, path } => {
                let _ = writeln!(report, "candidate #{rank}: {}", path.display());
                scripts.push((rank, path));
            }
            ScriptOutcome::Skipped { rank, reason } => {
                let _ = writeln!(report, "candidate #{rank}: no script ({reason})");
            }
        }
    }
    Ok(scripts)
}

/// Runs one script, reads its log into the history, says what happened.
fn run_and_read(
    cluster: &Cluster,
    rank: usize,
    script: &Path,
    timeout: Duration,
    history: &mut RunHistory,
    report: &mut String,
) -> Result<()> {
    let log = script.with_file_name("run.log");
    eprintln!("candidate #{rank}: running {} ...", script.display());
    if let Err(why) = run_script(script, timeout) {
        let _ = writeln!(
            report,
            "candidate #{rank}: {why}; its log is {} (kept)",
            log.display()
        );
        return Ok(());
    }
    match cluster.read(&log) {
        Ok((row, line)) => {
            // Kept before anything else: an interruption loses no finished run.
            history.append(&row)?;
            let _ = writeln!(report, "candidate #{rank}: {line}");
        }
        Err(e) => {
            let _ = writeln!(report, "candidate #{rank}: its log does not read: {e}");
        }
    }
    Ok(())
}

/// The coefficients a refit on a handful of trial runs frees first: those
/// that move every configuration's time the most.
const REFIT_ORDER: [&str; 6] = [
    "gemm_efficiency",
    "microbatch_overhead_ms",
    "iteration_overhead_ms",
    "host_us_per_layer_pass",
    "hbm_efficiency",
    "inter_node_efficiency",
];

/// Runs `bash SCRIPT`, killed after `timeout`.
fn run_script(script: &Path, timeout: Duration) -> Result<(), String> {
    let mut command = Command::new("bash");
    command
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Its own process group, so that a timeout stops torchrun/srun and the
    // ranks under it too, not only bash: they hold GPUs and a port.
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command
        .spawn()
        .map_err(|e| format!("could not start bash: {e}"))?;
    match wait_with_timeout(&mut child, timeout) {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("the run failed ({status})")),
        Err(why) => {
            stop_group(child.id());
            Err(why)
        }
    }
}

/// How long a timed-out run's processes get to stop after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Stops a timed-out run's process group: SIGTERM (srun cancels its step),
/// then SIGKILL for what is left after a grace period.
fn stop_group(pid: u32) {
    #[cfg(unix)]
    {
        let group = -(pid as i32);
        // SAFETY: kill(2) on a process group this command created.
        unsafe { libc::kill(group, libc::SIGTERM) };
        // Polled, not slept: most runs are gone within milliseconds.
        let grace = std::time::Instant::now();
        // SAFETY: signal 0 only asks whether any process of the group is left.
        while unsafe { libc::kill(group, 0) } == 0 && grace.elapsed() < STOP_GRACE {
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe { libc::kill(group, libc::SIGKILL) };
    }
}

/// Refits the plan's cost model on every run measured so far and prints how
/// the ranking of the plan's candidates moved.
fn refit_and_rerank(
    args: &ValidateArgs,
    plan: &PlanFile,
    history: &Path,
    report: &mut String,
) -> Result<Option<CostModel>> {
    let Ok(table) = RunTable::read(history) else {
        let _ = writeln!(report, "no run was measured: nothing to refit");
        return Ok(None);
    };
    let job = job_of(plan);
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
    let runs = runs_from_table(&table, &defaults, job.gpus_per_node())?;
    let prior: CostModel = resolve::cost_model(
        Some(args.cost_model.as_deref().unwrap_or(&plan.cost_model)),
        &plan.nodes.gpu.name,
    )?;
    let dataset = Dataset {
        name: history.display().to_string(),
        runs,
        group: plan.nodes.clone(),
    };
    // A few trial runs cannot inform every coefficient: fit as many of the
    // most influential ones as the rows allow, the rest keep the plan's.
    if table.rows.is_empty() {
        let _ = writeln!(report, "no run was measured: nothing to refit");
        return Ok(None);
    }
    let mut free = REFIT_ORDER.len().min(table.rows.len());
    let fitted = loop {
        let options = FitOptions {
            free: Some(REFIT_ORDER[..free].iter().map(|s| s.to_string()).collect()),
            folds: 0,
            bootstrap: 0,
            ..FitOptions::default()
        };
        match calibrate(
            std::slice::from_ref(&dataset),
            &prior,
            &format!("{}-refit", prior.name),
            &options,
        ) {
            Err(CalibrateError::TooFewRuns { .. }) if free > 1 => free -= 1,
            Err(CalibrateError::TooFewRuns { .. }) => {
                let _ = writeln!(
                    report,
                    "\n{} measured run(s): too few to refit any coefficient yet; trial more candidates (--top) or ingest more runs",
                    table.rows.len()
                );
                return Ok(None);
            }
            Ok(fitted) => break fitted,
            // The runs are kept; a refit that cannot be made is reported,
            // not fatal.
            Err(e) => {
                let _ = writeln!(report, "\nno refit on {}: {e}", history.display());
                return Ok(None);
            }
        }
    };
    let _ = writeln!(
        report,
        "\nrefitted {}",
        fitted
            .coefficients
            .iter()
            .filter(|c| REFIT_ORDER[..free].contains(&c.name))
            .map(|c| format!("{} {:.4} -> {:.4}", c.name, c.prior, c.value))
            .collect::<Vec<_>>()
            .join(", ")
    );
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
    let change = ranking_change(&rank(&prior), &rank(&fitted.model))?;
    let _ = writeln!(
        report,
        "\nrefit on {} measured run(s) of {}:",
        table.rows.len(),
        history.display()
    );
    report.push_str(&render_markdown(&change));
    Ok(Some(fitted.model))
}
