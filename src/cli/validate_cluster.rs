//! `paratune validate --launch megatron`: cluster trials through Megatron-LM.
//! Writes one launch script per candidate; unless `--dry-run`, runs each
//! (killed after `--timeout`), reads its log into a run row (append-only,
//! fsync per row), refits the cost model on every row measured so far and
//! re-ranks the plan's candidates.

use super::args::{Launcher as LauncherArg, ValidateArgs};
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
use paratune::validate::launch::{LaunchSettings, Launcher, ScriptOutcome, write_launch_scripts};
use paratune::validate::local::job_of;
use paratune::validate::megatron_log::{self, DEFAULT_WARMUP, ROW_COLUMNS};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

pub fn run(args: &ValidateArgs, plan: &PlanFile, out: &Path) -> Result<()> {
    check_writable(out, "--out")?;
    let launcher = match args.launcher {
        LauncherArg::Torchrun => Launcher::Torchrun,
        LauncherArg::Srun => Launcher::Srun,
    };
    let mut settings = LaunchSettings::new(args.megatron_path.clone(), launcher);
    settings.train_iters = args.iterations as u64;
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
        let scripts = write_scripts(&top, &settings, &dir, &mut report)?;
        if scripts.is_empty() {
            let _ = writeln!(report, "round {round}: no new candidate to run; stopping");
            break;
        }
        if args.dry_run {
            let _ = writeln!(
                report,
                "dry run: nothing was started. Run a script on the cluster, then `paratune ingest megatron-log {}/candidate-N/run.log --out runs.csv` (or rerun without --dry-run to let validate run them, read their logs and refit)",
                dir.display()
            );
            return emit(&report);
        }
        if history.is_none() {
            let (opened, repaired) = RunHistory::open(&history_path, &ROW_COLUMNS)?;
            if let Some(repair) = repaired {
                let _ = writeln!(report, "note: {repair}");
            }
            history = Some(opened);
        }
        let history = history.as_mut().expect("opened above");
        for (rank, script) in &scripts {
            run_and_read(*rank, script, timeout, history, &mut report)?;
        }
        let Some(fitted) = refit_and_rerank(args, plan, &history_path, &mut report)? else {
            break;
        };
        // Plan again with the refitted model: its leaders are the next round's trials.
        // Only what Megatron-LM can run is a candidate for a cluster trial.
        let result = search(&job, &SearchSpace::default(), &fitted);
        round_plan = super::commands::plan_file(&job, &fitted, &result, result.candidates.len());
        round_plan.candidates.retain(|c| c.megatron_args.is_some());
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
    settings: &LaunchSettings,
    dir: &Path,
    report: &mut String,
) -> Result<Vec<(usize, PathBuf)>> {
    let mut scripts = Vec::new();
    for outcome in write_launch_scripts(plan, settings, dir)? {
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
    match megatron_log::read(&log, DEFAULT_WARMUP) {
        Ok(run) => {
            let row = run.row(&log.display().to_string(), "paratune validate")?;
            // Kept before anything else: an interruption loses no finished run.
            history.append(&row)?;
            let _ = writeln!(
                report,
                "candidate #{rank}: {}: {:.1} ms per iteration (steady-state median, {} iterations){}",
                run.config.summary(),
                run.steady_median_ms,
                run.steady_iterations,
                run.peak_allocated_bytes
                    .map(|b| format!(", peak {:.1} GiB allocated", b / 1024f64.powi(3)))
                    .unwrap_or_default()
            );
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
