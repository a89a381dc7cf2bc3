//! A validation's local trials (`paratune validate --device D`): the first
//! and last pipeline stage of each top candidate run in a worker process on
//! this machine's device, predicted against measured, appended to the
//! trial history before the next starts, fed back (the layer times they
//! imply, a refit of the coefficients) and the space searched again. The
//! report is returned as text, and written with its charts under `OUT`.

use super::local::{
    self, TrialSettings, implied_layer_point, stage_job, stage_prediction, times_comparable,
    trial_stages,
};
use crate::coefficients::{CostModel, save_cost_model};
use crate::config::ParallelConfig;
use crate::cost::Scenario;
use crate::measure::process::spawn_worker;
use crate::measure::{self, StageMeasurement, WorkerJob, WorkerReply};
use crate::plan_file::PlanFile;
use crate::profile::{
    Device, Dtype, Measurements, Profile, ProfileError, merge_layers, write_profile,
};
use crate::report::{
    CandidateTime, ReportError, StageMemoryBar, TrialRow, Verdict, markdown_table, memory_chart,
    ranking_change, render_markdown, time_chart, verdict, write_report,
};
use crate::runs::{HistoryError, RunHistory};
use crate::search::{SearchSpace, search};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Columns of the trial history (`OUT/trials-history.csv`, append-only).
pub const HISTORY_COLUMNS: [&str; 17] = [
    "round",
    "candidate",
    "config",
    "stage",
    "device",
    "dtype",
    "micro_batches_run",
    "in_flight",
    "evicted",
    "predicted_ms_per_microbatch",
    "measured_ms_per_microbatch",
    "ci95_rel",
    "predicted_trial_bytes",
    "measured_peak_bytes",
    "capacity_bytes",
    "verdict",
    "runtime",
];

/// One stage trial and what it is compared with.
struct Trial {
    round: usize,
    rank: usize,
    config: ParallelConfig,
    stage: u64,
    predicted: local::StagePrediction,
    job: measure::StageJob,
    outcome: Result<StageMeasurement, String>,
}

impl Trial {
    /// Whether the cost model predicts this trial's time: not a BPipe
    /// evictor's, whose recomputation makes it an upper bound.
    fn time_is_predicted(&self) -> bool {
        self.job.evicted == 0
    }
}

/// How a validation's local trials run.
#[derive(Debug, Clone)]
pub struct LocalLoopSettings {
    pub trial: TrialSettings,
    pub timeout: Duration,
    /// Candidates per round and rounds at most.
    pub top: usize,
    pub rounds: usize,
    /// What the trial device is, where the driver named it (a catalogue GPU).
    pub device_gpu: Option<String>,
}

/// A local validation that could not go on.
#[derive(Debug, thiserror::Error)]
pub enum LocalTrialError {
    #[error(transparent)]
    History(#[from] HistoryError),
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("no trial ran")]
    NoTrial,
}

/// Trials the first and last stage of `plan`'s top candidates on the local
/// device, round after round: predicted against measured, the layer times
/// they imply and a refit fed back, the space searched again, until the
/// winner holds. Everything is written under `out` (the history first,
/// each trial before the next starts); the report is returned.
pub fn run_local_loop(
    plan: &PlanFile,
    plan_path: &Path,
    cost: &CostModel,
    settings: &LocalLoopSettings,
    out: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<String, LocalTrialError> {
    let device = settings.trial.device;
    let dtype = settings.trial.dtype;
    let device_gpu = settings.device_gpu.clone();
    let comparable = times_comparable(&plan.nodes.gpu.name, device, device_gpu.as_deref(), dtype);
    let (history, repaired) =
        RunHistory::open_table(&out.join("trials-history.csv"), &HISTORY_COLUMNS)?;
    let mut report = String::new();
    if let Some(repair) = repaired {
        let _ = writeln!(report, "note: {repair}");
    }
    if !comparable {
        report.push_str(&not_comparable_note(
            device,
            device_gpu.as_deref(),
            dtype,
            &plan.nodes.gpu.name,
        ));
    }
    let mut trials = TrialRunner {
        settings: settings.trial,
        timeout: settings.timeout,
        comparable,
        band: local::band(cost),
        history,
        done: Vec::new(),
    };

    let mut job = local::job_of(plan);
    let mut ranking: Vec<(ParallelConfig, f64)> = plan
        .candidates
        .iter()
        .map(|c| (c.config, c.prediction.iteration_s))
        .collect();
    let mut profile = Profile::empty(&plan.nodes.gpu.name);
    // The model the trials are predicted with: the plan's, then its refit.
    let mut current = cost.clone();
    for round in 1..=settings.rounds {
        let scenario = job.scenario(&current);
        if trials.run_round(
            round,
            &ranking[..settings.top.min(ranking.len())],
            &scenario,
            progress,
        )? > 0
        {
            let _ = writeln!(
                report,
                "\nround {round}: predicted against measured, per stage and micro-batch"
            );
            report.push_str(&markdown_table(&trials.rows(Some(round))));
        }
        if !comparable {
            break;
        }
        // Feed back: the layer times the trials imply become a profile (for
        // the shapes trialled), the coefficients are refitted to every trial
        // so far (for the rest), and the whole space is searched again.
        trials.feed_back(round, &scenario, &mut profile);
        if profile.layers.is_empty() {
            break;
        }
        if let Some(refit) = local::refit_to_trials(&job, cost, &trials.observations()) {
            report.push_str(&describe_refit(round, &refit));
            current = refit.cost;
        }
        job.profile = Some(Arc::new(Measurements::from_profile(&profile)));
        let before = labelled(&ranking, settings.top.max(5));
        ranking = search(&job, &SearchSpace::default(), &current)
            .candidates
            .iter()
            .map(|c| (c.config, c.prediction.iteration_s))
            .collect();
        let change = ranking_change(&before, &labelled(&ranking, settings.top.max(5)))?;
        let _ = writeln!(
            report,
            "\nround {round}: the ranking with the trials' layer times"
        );
        report.push_str(&render_markdown(&change));
        if !change.winner_changed {
            break;
        }
    }

    if !profile.layers.is_empty() {
        save_layer_profile(profile, plan_path, out, &mut report)?;
        let path = out.join("cost-model.toml");
        let _ = match save_cost_model(&current, &path) {
            Ok(()) => writeln!(
                report,
                "the refitted cost model is {}: plan with it and the profile, `paratune plan ... --cost-model {} --profile {}`",
                path.display(),
                path.display(),
                out.join("profile").display()
            ),
            // The trials and the report matter more than this file.
            Err(e) => writeln!(report, "note: the refitted cost model was not saved: {e}"),
        };
    }
    let rows = trials.rows(None);
    let paths = write_charts_and_report(out, plan_path, &rows, &trials.done, plan, &report)?;
    let _ = writeln!(
        report,
        "\nreport: {} (trials.csv, memory.svg, time.svg beside it); history: {}",
        paths.display(),
        trials.history.path().display()
    );
    Ok(report)
}

/// What the refit from the trials so far moved, and the stage-time error
/// before and after.
fn describe_refit(round: usize, refit: &local::TrialRefit) -> String {
    let moved: Vec<String> = refit
        .moved
        .iter()
        .map(|(name, before, after)| format!("{name} {before:.4} -> {after:.4}"))
        .collect();
    format!(
        "\nround {round}: coefficients refitted to the trials so far (argmin, Nelder-Mead): {}; stage-time MAPE of the coefficients alone on the trials fitted to (in-sample) {:.1}% -> {:.1}%\n",
        moved.join(", "),
        100.0 * refit.mape_before,
        100.0 * refit.mape_after
    )
}

/// Why trial times are not judged: the device is not the plan's GPU.
fn not_comparable_note(
    device: Device,
    device_gpu: Option<&str>,
    dtype: Dtype,
    plan_gpu: &str,
) -> String {
    let named = match (device_gpu, device.is_cuda()) {
        (Some(g), _) => format!(" ({g})"),
        (None, true) => " (a GPU this build cannot name: build with --features torch,cuda)".into(),
        (None, false) => String::new(),
    };
    let precision = if device.is_cuda() && dtype == Dtype::Fp32 {
        " in fp32 (plans train in 16 bits: --dtype bf16)"
    } else {
        ""
    };
    format!(
        "note: the trials run on {device}{named}{precision}, the plan is for {plan_gpu}: memory is compared, times are shown but not judged or fed back\n"
    )
}

/// The local trials of one validation: how they run, and those done so far.
struct TrialRunner {
    settings: TrialSettings,
    timeout: Duration,
    /// Trial times stand for the plan's GPU.
    comparable: bool,
    band: (f64, f64),
    history: RunHistory,
    done: Vec<Trial>,
}

impl TrialRunner {
    /// Trials the stages of the candidates in `top` (ranked) not trialled
    /// yet; each is in the history before the next starts. Returns how many
    /// stages ran.
    fn run_round(
        &mut self,
        round: usize,
        top: &[(ParallelConfig, f64)],
        scenario: &Scenario,
        progress: &mut dyn FnMut(&str),
    ) -> Result<usize, HistoryError> {
        let mut ran = 0;
        for (i, (config, _)) in top.iter().enumerate() {
            if self.done.iter().any(|t| t.config == *config) {
                continue;
            }
            if let Some(reason) = local::not_trialled(scenario.model, config) {
                progress(&format!(
                    "round {round}: #{} {config} is not trialled: {reason}",
                    i + 1
                ));
                continue;
            }
            for stage in trial_stages(config) {
                let device = self.settings.device;
                progress(&format!(
                    "round {round}: trial of #{} {config}, stage {stage} on {device}...",
                    i + 1
                ));
                let trial = run_trial(
                    round,
                    i + 1,
                    config,
                    stage,
                    scenario,
                    &self.settings,
                    self.timeout,
                );
                // Kept before anything else happens: an interrupted
                // validation loses no finished trial.
                let row = trial_row(&trial, self.comparable, self.band);
                self.history.append(&history_row(&trial, &row))?;
                self.done.push(trial);
                ran += 1;
            }
        }
        Ok(ran)
    }

    /// The report rows of one round's trials, or of all.
    fn rows(&self, round: Option<usize>) -> Vec<TrialRow> {
        self.done
            .iter()
            .filter(|t| round.is_none_or(|r| t.round == r))
            .map(|t| trial_row(t, self.comparable, self.band))
            .collect()
    }

    /// Every trial so far that measured a time the cost model predicts.
    fn observations(&self) -> Vec<local::StageObservation> {
        self.done
            .iter()
            .filter(|t| t.time_is_predicted())
            .filter_map(|t| {
                let m = t.outcome.as_ref().ok().filter(|m| !m.out_of_memory)?;
                Some(local::StageObservation {
                    config: t.config,
                    stage: t.stage,
                    measured_s: m.time_per_microbatch_s,
                })
            })
            .collect()
    }

    /// Adds the layer times the round's trials imply to `profile`.
    fn feed_back(&self, round: usize, scenario: &Scenario, profile: &mut Profile) {
        for t in self
            .done
            .iter()
            .filter(|t| t.round == round && t.time_is_predicted())
        {
            if let Ok(m) = &t.outcome
                && let Some(point) =
                    implied_layer_point(scenario, &t.config, t.stage, self.settings.dtype, m)
            {
                merge_layers(&mut profile.layers, &[point]);
            }
        }
    }
}

/// Runs one stage trial in a worker process.
fn run_trial(
    round: usize,
    rank: usize,
    config: &ParallelConfig,
    stage: u64,
    scenario: &Scenario,
    settings: &TrialSettings,
    timeout: Duration,
) -> Trial {
    let job = stage_job(scenario, config, stage, settings);
    let outcome = match spawn_worker(&WorkerJob::Stage(job.clone()), timeout) {
        Ok(WorkerReply::Stage(m)) => Ok(m),
        Ok(WorkerReply::Error(e)) | Err(e) => Err(e),
        Ok(other) => Err(format!("unexpected worker reply {other:?}")),
    };
    Trial {
        round,
        rank,
        config: *config,
        stage,
        predicted: stage_prediction(scenario, config, stage),
        job,
        outcome,
    }
}

/// Writes the layer times the trials imply as `OUT/profile`.
fn save_layer_profile(
    mut profile: Profile,
    plan_path: &Path,
    out: &Path,
    report: &mut String,
) -> Result<(), ProfileError> {
    let dir = out.join("profile");
    profile.environment.source = format!("paratune validate {}", plan_path.display());
    profile.environment.date = crate::date::today_utc();
    profile.environment.notes.push(
        "layer times implied by local stage trials (measured stage time less the predicted embedding/head share, per layer)".into(),
    );
    write_profile(&dir, &profile)?;
    let _ = writeln!(
        report,
        "\nthe measured layer times are in {}: use them with `paratune plan ... --profile {}`",
        dir.display(),
        dir.display()
    );
    Ok(())
}

fn labelled(ranking: &[(ParallelConfig, f64)], n: usize) -> Vec<(String, f64)> {
    ranking
        .iter()
        .take(n)
        .map(|(c, t)| (c.to_string(), *t))
        .collect()
}

fn trial_row(t: &Trial, comparable: bool, band: (f64, f64)) -> TrialRow {
    let p = &t.predicted;
    let capacity = p.usable_bytes - p.other_bytes;
    let (measured_s, peak, v) = match &t.outcome {
        Ok(m) => {
            let time = (!m.out_of_memory).then_some(m.time_per_microbatch_s);
            let v = verdict(
                p.time_per_microbatch_s,
                time,
                comparable.then_some(band),
                m.peak_bytes,
                capacity,
                m.out_of_memory,
            );
            (time, m.peak_bytes, v)
        }
        Err(e) => (None, None, Verdict::Failed(e.clone())),
    };
    TrialRow {
        candidate: t.rank,
        config: t.config.to_string(),
        stage: Some(t.stage),
        predicted_s: p.time_per_microbatch_s,
        measured_s,
        band_rel: comparable.then_some(band),
        predicted_peak_bytes: p.trial_bytes,
        measured_peak_bytes: peak,
        capacity_bytes: capacity,
        verdict: v,
    }
}

fn history_row(t: &Trial, row: &TrialRow) -> Vec<String> {
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
    let m = t.outcome.as_ref().ok();
    vec![
        t.round.to_string(),
        t.rank.to_string(),
        t.config.to_string(),
        t.stage.to_string(),
        t.job.device.to_string(),
        t.job.dtype.name().to_string(),
        t.job.micro_batches.to_string(),
        t.job.schedule_in_flight.to_string(),
        t.job.evicted.to_string(),
        format!("{}", t.predicted.time_per_microbatch_s * 1e3),
        opt(row.measured_s.map(|s| s * 1e3)),
        opt(m.and_then(|m| m.ci95_rel)),
        format!("{}", t.predicted.trial_bytes),
        opt(row.measured_peak_bytes),
        format!("{}", row.capacity_bytes),
        row.verdict.to_string(),
        m.map_or(String::new(), |m| m.runtime.clone()),
    ]
}

fn write_charts_and_report(
    out: &Path,
    plan_path: &Path,
    rows: &[TrialRow],
    trials: &[Trial],
    plan: &PlanFile,
    summary: &str,
) -> Result<PathBuf, LocalTrialError> {
    if rows.is_empty() {
        return Err(LocalTrialError::NoTrial);
    }
    let bars: Vec<StageMemoryBar> = rows
        .iter()
        .map(|r| StageMemoryBar {
            label: format!("#{} stage {}", r.candidate, r.stage.unwrap_or(0)),
            predicted_bytes: r.predicted_peak_bytes,
            measured_bytes: r.measured_peak_bytes,
        })
        .collect();
    let capacity = rows
        .iter()
        .map(|r| r.capacity_bytes)
        .fold(f64::MAX, f64::min);
    let memory = memory_chart("Per-stage memory: predicted vs measured", &bars, capacity)?;
    let times: Vec<CandidateTime> = rows
        .iter()
        .zip(trials)
        .map(|(r, t)| CandidateTime {
            label: format!("#{} stage {}", r.candidate, t.stage),
            predicted_s: r.predicted_s,
            band_s: r
                .band_rel
                .map(|(a, b)| (r.predicted_s * (1.0 + a), r.predicted_s * (1.0 + b))),
            measured_s: r.measured_s,
        })
        .collect();
    let time = time_chart("Time per micro-batch: predicted vs measured", &times)?;
    let name = format!(
        "Validation of {} ({} on {} x {})",
        plan_path.display(),
        plan.model.name,
        plan.gpus,
        plan.nodes.gpu.name
    );
    let summary = format!(
        "Memory capacity per stage: {:.2} GiB usable less the pipeline buffers and runtime memory the trial does not allocate.\n\n```\n{summary}```\n",
        capacity / GIB
    );
    let paths = write_report(out, &name, rows, &memory, &time, &summary)?;
    Ok(paths.report)
}
