//! The subcommands: call the library, print the result.

use super::args::{EvaluateArgs, Format, PlanArgs, PredictArgs};
use super::profile::{self as profile_cli, usage_line};
use super::render::{self, GIB, emit, emit_csv, percent, seconds};
use super::resolve;
use anyhow::{Context, Result, anyhow, bail};
use paratune::cluster::{builtin_gpu_names, builtin_node};
use paratune::coefficients::CostModel;
use paratune::config::{Engine, ParallelConfig, Rule};
use paratune::cost::group_syncs;
use paratune::cost::sparse::embedding_sync_options;
use paratune::cost::{ProfileUsage, Scenario, memory_per_stage, predict_with_usage};
use paratune::evaluate::{Figures, Setting, evaluate_with, predicted_rows};
use paratune::export::{
    BestExport, LaunchJob, best_export, megatron_args, megatron_command_line, megatron_model_notes,
    torchtitan_flags, torchtitan_toml,
};
use paratune::model::ModelSpec;
use paratune::model::{builtin_model, builtin_model_names, model_file_keys, model_file_values};
use paratune::plan_file::{PlanFile, config_json};
use paratune::runs::{RunTable, runs_and_skipped, schema};
use paratune::search::{
    Candidate, Explanation, Job, KEPT_CANDIDATES, SearchResult, SearchSpace, explain,
    search_keeping, search_where, smallest_fitting_gpus,
};
use std::fmt::Write;
use std::time::Instant;

fn json<T: serde::Serialize>(value: &T) -> Result<String> {
    Ok(serde_json::to_string_pretty(value)? + "\n")
}

fn cost_model_line(cost: &CostModel) -> String {
    match cost.uncertainty() {
        Some(u) => format!(
            "{}, fitted to {} measured runs: cross-validated MAPE {}, 9 in 10 predictions within +-{}",
            cost.name,
            u.rows,
            percent(u.mape),
            percent(u.p90)
        ),
        None => format!(
            "{} ({}); its error is unmeasured: fit one with `paratune calibrate`",
            cost.name, cost.description
        ),
    }
}

fn job_line(job: &Job, engine: Engine, cost: &CostModel) -> String {
    format!(
        "{} ({:.1} B parameters, seq {}) on {} x {} ({} per node, intra {} per GPU, inter {} per node), global batch {}, trained with {}\ncost model: {}",
        job.model.name,
        job.model.total_params() / 1e9,
        job.model.seq_len,
        job.gpus,
        job.nodes.gpu.name,
        job.nodes.gpus_per_node,
        job.nodes.intra_node_bw,
        job.nodes.inter_node_bw,
        job.global_batch,
        engine.product(),
        cost_model_line(cost)
    )
}

pub fn plan(args: &PlanArgs) -> Result<()> {
    if args.explain.is_some() && args.common.format != Format::Table {
        bail!(
            "--explain prints a text explanation and cannot go with --format {}; drop one of them",
            if args.common.format == Format::Json {
                "json"
            } else {
                "csv"
            }
        );
    }
    let mut job = resolve::job(&args.common)?;
    let cost = resolve::cost_model(args.common.cost_model.as_deref(), &job.nodes.gpu.name)?;
    let profile = profile_cli::load(args.profile.as_deref(), &job.nodes.gpu.name)?;
    job.profile = profile.as_ref().map(|p| p.measurements.clone());
    let space = resolve::space(&args.space)?;
    resolve::check_job_choices(&space, &job)?;
    let started = Instant::now();
    let result = search_keeping(&job, &space, &cost, args.top.max(KEPT_CANDIDATES));
    let elapsed = started.elapsed();
    if result.candidates.is_empty() {
        return Err(nothing_fits(&job, &space, &cost, &result));
    }
    match args.common.format {
        Format::Json => {
            let file = PlanFile::of(&job, &cost, &result, args.top)
                .with_cost_model_file(resolve::cost_model_file(args.common.cost_model.as_deref()));
            emit(&json(&file.to_json())?)?;
        }
        Format::Csv => plan_csv(&job.model, &result, args.top)?,
        Format::Table => {
            // A configuration to explain that breaks a rule is bad input,
            // refused before anything is printed.
            let explained = match &args.explain {
                Some(spec) => {
                    let winner = result.candidates[0].config;
                    let mut config = resolve::config_spec(spec, &winner)?;
                    // A cp of its own takes its own default exchange, as the
                    // search would, unless the spec names one.
                    if config.cp != winner.cp
                        && !spec.contains("cp_comm")
                        && !spec.contains("cp-comm")
                    {
                        config.cp_comm = paratune::config::CpComm::default_for(
                            config.engine,
                            &job.model,
                            config.tp,
                            config.cp,
                        );
                    }
                    if let Some(problem) = config.precision.gpu_problem(&job.nodes.gpu) {
                        bail!(
                            "--explain: `precision {}`: {problem}",
                            config.precision.name()
                        );
                    }
                    if let Some(problem) = config.cuda_graphs.gpu_problem(&job.nodes.gpu.name) {
                        bail!(
                            "--explain: `graphs {}`: {problem}; give graphs=off or leave it out",
                            config.cuda_graphs.name()
                        );
                    }
                    // FP8 without a named recipe runs the GPU's, as the search's.
                    if config.precision == paratune::config::Precision::Fp8 {
                        config.fp8_recipe = Some(config.fp8_recipe_on(&job.nodes.gpu.name));
                    }
                    if job.model.moe.is_none()
                        && config.dispatcher != result.candidates[0].config.dispatcher
                    {
                        bail!(
                            "--explain: model `{}` has no experts, so `dispatch` means nothing; leave it out",
                            job.model.name
                        );
                    }
                    if let Err(reason) =
                        config.check(&job.model, job.global_batch, job.gpus, job.gpus_per_node())
                    {
                        bail!(
                            "--explain: not a valid configuration: {}",
                            super::flags::with_flags(&reason)
                        );
                    }
                    Some(config)
                }
                None => None,
            };
            let mut out = String::new();
            let _ = writeln!(
                out,
                "paratune plan: {}",
                job_line(&job, space.engine, &cost)
            );
            search_counts(&mut out, &result, elapsed.as_secs_f64());
            if let Some(profile) = &profile {
                plan_profile_usage(&mut out, profile, &job, &cost, &result);
            }
            let band = cost.uncertainty().map(|u| u.p90);
            let shown = result.candidates.iter().take(args.top);
            let columns = render::RankingColumns {
                band: band.is_some(),
                context_and_experts: job.model.moe.is_some()
                    || shown.clone().any(|c| c.config.cp > 1),
                embedding_sync: !job.model.tied_embeddings
                    && space
                        .embedding_sync
                        .as_ref()
                        .is_some_and(|m| m.iter().any(|m| m.is_sparse())),
                precision: space.precision.as_ref().is_some_and(|p| p.len() > 1),
                allocator: space
                    .expandable_segments
                    .as_ref()
                    .is_some_and(|a| a.len() > 1),
            };
            let _ = writeln!(out, "\n{}", render::ranking_header(columns));
            for (i, c) in shown.enumerate() {
                let _ = writeln!(
                    out,
                    "{}",
                    render::ranking_row(
                        i + 1,
                        &c.config,
                        job.model.layers,
                        &c.prediction,
                        band,
                        columns
                    )
                );
            }
            explain_winner(&mut out, &job, &space, &cost, &result, args.top);
            if let Some(config) = &explained {
                explain_config(&mut out, &job, &space, &cost, &result, config);
            }
            emit(&out)?;
        }
    }
    Ok(())
}

/// What the ranked configurations and the winner took from the profile
/// (the lookups are re-run for them; the search itself does not count).
fn plan_profile_usage(
    out: &mut String,
    profile: &profile_cli::Loaded,
    job: &Job,
    cost: &CostModel,
    result: &SearchResult,
) {
    let scenario = job.scenario(cost);
    let mut all = ProfileUsage::default();
    for c in &result.candidates {
        all.add(&predict_with_usage(&scenario, &c.config).1);
    }
    let winner = predict_with_usage(&scenario, &result.candidates[0].config).1;
    let _ = writeln!(out, "{}:", profile.title());
    let ranked = if result.candidates.len() < result.fitting() {
        format!(
            "the {} fastest of the {} ranked configurations",
            render::thousands(result.candidates.len() as f64),
            render::thousands(result.fitting() as f64)
        )
    } else {
        format!(
            "the {} ranked configurations",
            render::thousands(result.candidates.len() as f64)
        )
    };
    let _ = writeln!(out, "  {ranked}: {}", usage_line(&all));
    let _ = writeln!(out, "  the winner: {}", usage_line(&winner));
}

fn nothing_fits(
    job: &Job,
    space: &paratune::search::SearchSpace,
    cost: &CostModel,
    result: &SearchResult,
) -> anyhow::Error {
    if result.considered == 0 {
        let given: Vec<String> = [
            ("--tp", &space.tp),
            ("--pp", &space.pp),
            ("--dp", &space.dp),
            ("--cp", &space.cp),
            ("--ep", &space.ep),
            ("--etp", &space.etp),
            ("--virtual-stages", &space.virtual_stages),
        ]
        .into_iter()
        .filter_map(|(flag, values)| {
            let list: Vec<String> = values.as_ref()?.iter().map(u64::to_string).collect();
            Some(format!("{flag} {}", list.join(",")))
        })
        .collect();
        return anyhow!(
            "no configuration to consider: with {} no tp x pp x cp x dp equals the job's {} GPUs with pp x virtual stages dividing the {} layers and etp x ep dividing tp x cp x dp; change those values or leave them out",
            if given.is_empty() {
                "these flags".to_string()
            } else {
                given.join(" ")
            },
            job.gpus,
            job.model.layers
        );
    }
    if result.out_of_memory == 0 {
        let reasons: Vec<String> = result
            .invalid
            .iter()
            .map(|(rule, n)| format!("{n} {}", rule.summary()))
            .collect();
        // The rule that drops the most, explained for a configuration it
        // dropped: it names the flag and the fix. A tp or pp that does not
        // divide the model is the search trying shapes, not the user's
        // doing, so another rule is named first when one dropped any.
        let search_shape = |rule: &Rule| {
            matches!(
                rule,
                Rule::HeadsNotDivisible | Rule::FfnNotDivisible | Rule::LayersNotDivisible
            )
        };
        let most = result
            .invalid
            .iter()
            .max_by_key(|(rule, n)| (!search_shape(rule), **n))
            .and_then(|(rule, _)| Some((*rule, result.invalid_examples.get(rule)?)));
        let fix = match most {
            Some((rule, example)) => super::flags::with_flags(&rule.explain(
                example,
                &job.model,
                job.global_batch,
                job.gpus,
                job.gpus_per_node(),
            )),
            None => "widen the search flags or change --global-batch".to_string(),
        };
        return anyhow!(
            "no valid configuration among {} considered ({}); {fix}",
            result.considered,
            reasons.join("; ")
        );
    }
    let hint = match smallest_fitting_gpus(job, space, cost, 65536) {
        Some(gpus) => format!(
            "the smallest GPU count at which one fits is {gpus} (--nodes {})",
            gpus.div_ceil(job.nodes.gpus_per_node)
        ),
        None => "none fits up to 65,536 GPUs".to_string(),
    };
    anyhow!(
        "no configuration fits in {:.1} GiB per GPU{} ({} valid configurations considered); {hint}, or allow more recomputation/sharding",
        job.memory_limit.unwrap_or(job.nodes.gpu.memory_bytes) / GIB,
        if job.memory_limit.is_some() {
            " (--memory-limit)"
        } else {
            ""
        },
        result.valid()
    )
}

fn search_counts(out: &mut String, result: &SearchResult, elapsed_s: f64) {
    let invalid: usize = result.invalid.values().sum();
    let _ = writeln!(
        out,
        "searched {} configurations in {}: {} fit, {} do not fit memory, {} break a rule",
        render::thousands(result.considered as f64),
        seconds(elapsed_s),
        render::thousands(result.fitting() as f64),
        render::thousands(result.out_of_memory as f64),
        render::thousands(invalid as f64)
    );
    for (rule, n) in &result.invalid {
        let _ = writeln!(
            out,
            "  {:>9} {}",
            render::thousands(*n as f64),
            rule.summary()
        );
    }
}

fn explain_winner(
    out: &mut String,
    job: &Job,
    space: &SearchSpace,
    cost: &CostModel,
    result: &SearchResult,
    top: usize,
) {
    let winner = &result.candidates[0];
    let scenario = job.scenario(cost);
    let _ = writeln!(out, "\nWhy #1 wins: {}", winner.config);
    render::mfu_note(out, &winner.prediction);
    render::breakdown(out, &winner.prediction.time);
    // The embedding's sync by every method, when the winner syncs it sparsely.
    if winner.config.embedding_sync.is_sparse()
        && let Some(options) = embedding_sync_options(&scenario, &winner.config)
    {
        render::embedding_sync(out, &options, winner.config.embedding_sync);
    }
    let stages = memory_per_stage(&scenario, &winner.config);
    render::stage_memory(
        out,
        &stages,
        (
            winner.prediction.usable_memory_bytes,
            winner.prediction.peak_stage,
        ),
        &scenario.cost.coefficients,
    );
    let shown = result.candidates.len().min(top);
    if shown > 1 {
        let _ = writeln!(out, "\nThe runners-up, against #1:");
        for (i, c) in result.candidates.iter().enumerate().take(shown).skip(1) {
            if let Explanation::Ranked {
                slower_by,
                differences,
                ..
            } = explain(job, space, cost, result, &c.config)
            {
                // Twins in time differ in what moves no time (a switch
                // that only moves memory, say): say so, not an empty list.
                let why = if differences.is_empty() {
                    format!(
                        "the same time, {}",
                        render::config_difference(&winner.config, &c.config)
                    )
                } else {
                    render::differences(&differences, 3)
                };
                let _ = writeln!(
                    out,
                    "  #{:<3} {:>6} slower: {why}",
                    i + 1,
                    percent(slower_by),
                );
            }
        }
    }
    // The engine planned for first; the other's export says what differs.
    let megatron = |out: &mut String| {
        let _ = writeln!(out, "\nMegatron-LM arguments (pretrain_gpt.py):");
        for note in megatron_model_notes(&job.model) {
            let _ = writeln!(out, "  note: {note}");
        }
        export_best(out, (job, space, cost), result, |launch| {
            megatron_command_line(launch).map(|line| {
                format!(
                    "    {line}\n{}",
                    environment_lines(launch.config, Engine::Megatron)
                )
            })
        });
    };
    let torchtitan = |out: &mut String| {
        let _ = writeln!(
            out,
            "\ntorchtitan 0.3 flags (after -m torchtitan.train --module {} --config CONFIG):",
            paratune::export::torchtitan_module(&job.model).unwrap_or("MODULE")
        );
        export_best(out, (job, space, cost), result, |launch| {
            torchtitan_flags(launch).map(|flags| {
                let lines: String = flags
                    .command_lines()
                    .iter()
                    .map(|line| format!("    {line}\n"))
                    .collect();
                lines + &environment_lines(launch.config, Engine::Torchtitan)
            })
        });
        let _ = writeln!(out, "\ntorchtitan 0.2 job config (TOML fragment):");
        export_best(out, (job, space, cost), result, |launch| {
            torchtitan_toml(launch).map(|toml| {
                let lines: String = toml.lines().map(|l| format!("    {l}\n")).collect();
                lines + &environment_lines(launch.config, Engine::Torchtitan)
            })
        });
    };
    match winner.config.engine {
        Engine::Megatron => {
            megatron(out);
            torchtitan(out);
        }
        Engine::Torchtitan => {
            torchtitan(out);
            let _ = writeln!(
                out,
                "\n(planned for torchtitan: Megatron-LM keeps 16-bit weights beside fp32 master weights and pads the vocabulary, so its memory differs from this plan's)"
            );
            megatron(out);
        }
    }
}

/// The environment an export needs beside its arguments
/// ([`launch_environment`]), as a line after it. A torchtitan plan priced
/// with fixed segments says instead what its launcher does to that.
fn environment_lines(c: &ParallelConfig, engine: Engine) -> String {
    let environment = paratune::export::launch_environment(c);
    if environment.is_empty() {
        // Said for the plan's own engine: a Megatron-LM plan's torchtitan
        // exports would repeat it under every one.
        if engine.launches_expandable_segments() && c.engine == engine && !c.expandable_segments {
            // torchtitan's run_train.sh, the one such launcher.
            return "  allocator: priced with fixed segments, but run_train.sh starts torchrun under PYTORCH_ALLOC_CONF=\"expandable_segments:True\", which reserves less: under it the memory verdict is conservative (start torchrun yourself to run as priced)\n".into();
        }
        return String::new();
    }
    let settings: Vec<String> = environment
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    format!(
        "  environment (the plan assumes it): {}\n",
        settings.join(" ")
    )
}

/// Writes the winner's export, or, when the engine cannot run the winner,
/// why, and the export of the fastest candidate it can run: among the
/// kept candidates, else by a second search for it alone.
fn export_best(
    out: &mut String,
    (job, space, cost): (&Job, &SearchSpace, &CostModel),
    result: &SearchResult,
    export: impl Fn(&LaunchJob) -> Result<String, paratune::export::ExportError> + Sync,
) {
    match best_export(job, &result.candidates, &export) {
        None => {}
        Some(BestExport::Winner(text)) => out.push_str(&text),
        Some(BestExport::Fallback { why, runnable }) => {
            let _ = writeln!(out, "    #1 is not exportable: {why}");
            let runnable = match runnable {
                Some((i, text)) => Some((i + 1, result.candidates[i], text)),
                None if result.candidates.len() < result.fitting()
                    && !matches!(why, paratune::export::ExportError::UnsupportedModel { .. }) =>
                {
                    fastest_runnable_past_kept((job, space, cost), result, &export)
                }
                None => None,
            };
            if let Some((rank, c, text)) = runnable {
                let winner = &result.candidates[0];
                let _ = writeln!(
                    out,
                    "    the fastest it runs is #{rank} ({} slower): {}",
                    percent(c.prediction.iteration_s / winner.prediction.iteration_s - 1.0),
                    c.config
                );
                out.push_str(&text);
            }
        }
    }
}

/// The fastest fitting configuration `export` can write, found by a second
/// search when none of the kept ones is: its rank among all that fit, the
/// candidate and its export.
fn fastest_runnable_past_kept(
    (job, space, cost): (&Job, &SearchSpace, &CostModel),
    result: &SearchResult,
    export: &(impl Fn(&LaunchJob) -> Result<String, paratune::export::ExportError> + Sync),
) -> Option<(usize, Candidate, String)> {
    let runs = |c: &ParallelConfig| export(&LaunchJob::of(job, c)).is_ok();
    let found = *search_where(job, space, cost, 1, &runs)
        .candidates
        .first()?;
    let text = export(&LaunchJob::of(job, &found.config)).ok()?;
    let rank = result.faster_than(found.prediction.iteration_s) + 1;
    Some((rank, found, text))
}

fn explain_config(
    out: &mut String,
    job: &Job,
    space: &SearchSpace,
    cost: &CostModel,
    result: &SearchResult,
    config: &ParallelConfig,
) {
    let _ = writeln!(out, "\nExplain {config}:");
    match explain(job, space, cost, result, config) {
        Explanation::Invalid { reason } => {
            let _ = writeln!(
                out,
                "  not a valid configuration: {}",
                super::flags::with_flags(&reason)
            );
        }
        Explanation::DoesNotFit {
            stage,
            needs_gib,
            usable_gib,
            capacity_gib,
            prediction,
        } => {
            let _ = writeln!(
                out,
                "  does not fit: stage {stage} needs {needs_gib:.1} GiB of {usable_gib:.1} usable ({capacity_gib:.1} GiB less the reserve); it would take {} per iteration",
                seconds(prediction.iteration_s)
            );
            render::fragmentation_note(out, &prediction);
            let scenario = job.scenario(cost);
            let stages = memory_per_stage(&scenario, config);
            render::stage_memory(
                out,
                &stages,
                (prediction.usable_memory_bytes, prediction.peak_stage),
                &scenario.cost.coefficients,
            );
        }
        Explanation::Ranked {
            rank,
            of,
            prediction,
            slower_by,
            differences,
        } => {
            // A configuration from outside the searched space can beat #1.
            let (standing, against) = if slower_by < 0.0 {
                (
                    "would rank first".to_string(),
                    format!(
                        "{} faster than the search's #1, from outside the searched space (widen the search flags to rank it)",
                        percent(-slower_by)
                    ),
                )
            } else {
                (
                    format!("ranks #{rank} of {of}"),
                    format!("{} slower than #1", percent(slower_by)),
                )
            };
            let _ = writeln!(
                out,
                "  fits ({:.1} of {:.1} GiB) and {standing}: {} per iteration, {against}",
                prediction.peak_memory_bytes / GIB,
                prediction.usable_memory_bytes / GIB,
                seconds(prediction.iteration_s),
            );
            if !differences.is_empty() {
                let _ = writeln!(
                    out,
                    "  where the time goes differently: {}",
                    render::differences(&differences, 4)
                );
            }
        }
    }
}

fn plan_csv(model: &ModelSpec, result: &SearchResult, top: usize) -> Result<()> {
    let mut headers: Vec<String> = vec!["rank".into()];
    headers.extend(schema::CONFIG_COLUMNS.iter().map(|s| s.to_string()));
    headers.extend(schema::PREDICTION_COLUMNS.map(String::from));
    headers.push("fits".into());
    let rows: Vec<Vec<String>> = result
        .candidates
        .iter()
        .take(top)
        .enumerate()
        .map(|(i, c)| {
            let p = &c.prediction;
            let mut row = vec![(i + 1).to_string()];
            row.extend(schema::config_cells(model, &c.config));
            row.extend(schema::prediction_cells(p));
            row.push(p.fits.to_string());
            row
        })
        .collect();
    emit_csv(&headers, &rows)?;
    Ok(())
}

pub fn predict_command(args: &PredictArgs) -> Result<()> {
    if let Some(path) = &args.runs {
        return predict_runs(args, path);
    }
    let mut job = resolve::job(&args.common)?;
    let cost = resolve::cost_model(args.common.cost_model.as_deref(), &job.nodes.gpu.name)?;
    let profile = profile_cli::load(args.profile.as_deref(), &job.nodes.gpu.name)?;
    job.profile = profile.as_ref().map(|p| p.measurements.clone());
    let config = resolve::single_config(&args.space, &job)?;
    let scenario = job.scenario(&cost);
    let (prediction, usage) = predict_with_usage(&scenario, &config);
    let stages = memory_per_stage(&scenario, &config);
    match args.common.format {
        Format::Json => {
            let mut value = serde_json::json!({
                "config": config_json(&job.model, &config),
                "prediction": prediction,
                "stages": stages,
                "embedding_sync": embedding_sync_options(&scenario, &config),
                "group_syncs": group_syncs(&scenario, &config, 0),
                "megatron_args": megatron_args(&LaunchJob::of(&job, &config)).ok(),
                "megatron_unsupported": megatron_args(&LaunchJob::of(&job, &config)).err().map(|e| e.to_string()),
            });
            if let Some(profile) = &profile {
                value["profile"] = serde_json::json!({
                    "path": profile.path.display().to_string(),
                    "usage": usage,
                });
            }
            emit(&json(&value)?)?;
        }
        Format::Csv => {
            let mut headers: Vec<String> = schema::CONFIG_COLUMNS
                .iter()
                .map(|s| s.to_string())
                .collect();
            headers.extend(schema::PREDICTION_COLUMNS.map(String::from));
            headers.extend(["peak_stage", "fits"].map(String::from));
            let mut row = schema::config_cells(&job.model, &config);
            row.extend(schema::prediction_cells(&prediction));
            row.extend([
                prediction.peak_stage.to_string(),
                prediction.fits.to_string(),
            ]);
            emit_csv(&headers, &[row])?;
        }
        Format::Table => {
            let mut out = String::new();
            let _ = writeln!(
                out,
                "paratune predict: {}",
                job_line(&job, config.engine, &cost)
            );
            if let Some(profile) = &profile {
                let _ = writeln!(out, "{}: {}", profile.title(), usage_line(&usage));
            }
            let _ = writeln!(out, "configuration: {config}");
            let _ = writeln!(
                out,
                "  {} per iteration, {} tokens/s, {:.1} TFLOP/s per GPU, MFU {}, peak {:.1} GiB of {:.1} usable (stage {}): {}",
                seconds(prediction.iteration_s),
                render::thousands(prediction.tokens_per_s),
                prediction.tflops_per_gpu,
                percent(prediction.mfu),
                prediction.peak_memory_gib(),
                prediction.usable_memory_bytes / GIB,
                prediction.peak_stage,
                if prediction.fits {
                    "fits"
                } else {
                    "DOES NOT FIT"
                }
            );
            render::fragmentation_note(&mut out, &prediction);
            render::mfu_note(&mut out, &prediction);
            render::breakdown(&mut out, &prediction.time);
            let sharded = config.optimizer_sharding != paratune::config::OptimizerSharding::None;
            render::group_syncs(&mut out, &group_syncs(&scenario, &config, 0), sharded);
            if let Some(options) = embedding_sync_options(&scenario, &config) {
                render::embedding_sync(&mut out, &options, config.embedding_sync);
            }
            render::stage_memory(
                &mut out,
                &stages,
                (prediction.usable_memory_bytes, prediction.peak_stage),
                &scenario.cost.coefficients,
            );
            emit(&out)?;
        }
    }
    Ok(())
}

/// Predicts every row of a runs CSV and writes the rows back with the predictions.
fn predict_runs(args: &PredictArgs, path: &std::path::Path) -> Result<()> {
    let defaults = resolve::row_defaults(&args.space, resolve::row_model(&args.common.model)?)?;
    let table = RunTable::read(path)?;
    let (nodes, _) = resolve::nodes_or_table_gpu(&args.common.cluster, &table)?;
    let cost = resolve::cost_model(args.common.cost_model.as_deref(), &nodes.gpu.name)?;
    let profile = profile_cli::load(args.profile.as_deref(), &nodes.gpu.name)?;
    let measurements = profile.as_ref().map(|p| p.measurements.as_ref());
    let all = runs_and_skipped(&table, &defaults, (&nodes).into())?;
    if let Some(why) = all.none_left() {
        bail!("{}: {why}", path.display());
    }
    let settings = resolve::per_gpu(&all.runs, &nodes, &cost, &args.common);
    let (headers, rows) = predicted_rows(&table, &all, &settings, measurements);
    match args.common.format {
        Format::Json => {
            let objects: Vec<serde_json::Map<String, serde_json::Value>> = rows
                .iter()
                .map(|row| {
                    headers
                        .iter()
                        .cloned()
                        .zip(
                            row.iter()
                                .zip(&headers)
                                .map(|(c, header)| json_cell(header, c)),
                        )
                        .collect()
                })
                .collect();
            emit(&json(&objects)?)?;
        }
        _ => emit_csv(&headers, &rows)?,
    }
    Ok(())
}

/// A predicted row's cell as JSON: paratune's own columns (the run-table
/// schema's and the predictions) typed by [`typed_cell`], the user's own
/// columns the strings they wrote.
fn json_cell(header: &str, cell: &str) -> serde_json::Value {
    let ours = paratune::runs::KNOWN_COLUMNS.contains(&header)
        || header.starts_with("predicted_")
        || header == "fits";
    if ours {
        typed_cell(cell)
    } else {
        serde_json::Value::String(cell.to_string())
    }
}

/// A table cell as the JSON value it holds: empty is null, `true`/`false`
/// a boolean, a number a number (whole ones without a fraction), anything
/// else (a model's name, `on`, `1f1b`) the string.
fn typed_cell(cell: &str) -> serde_json::Value {
    use serde_json::Value;
    let text = cell.trim();
    if text.is_empty() {
        return Value::Null;
    }
    if let Ok(b) = text.parse::<bool>() {
        return Value::Bool(b);
    }
    if let Ok(n) = text.parse::<i64>() {
        return Value::from(n);
    }
    match text.parse::<f64>() {
        // Only digits, a sign, a point and an exponent: "inf" and "nan"
        // stay the strings they are.
        Ok(x) if x.is_finite() && text.chars().all(|ch| "0123456789+-.eE".contains(ch)) => {
            Value::from(x)
        }
        _ => Value::String(cell.to_string()),
    }
}

pub fn evaluate_command(args: &EvaluateArgs) -> Result<()> {
    let defaults = resolve::row_defaults(&args.space, resolve::row_model(&args.common.model)?)?;
    let table = RunTable::read(&args.runs)?;
    let (nodes, _) = resolve::nodes_or_table_gpu(&args.common.cluster, &table)?;
    let cost = resolve::cost_model(args.common.cost_model.as_deref(), &nodes.gpu.name)?;
    let profile = profile_cli::load(args.profile.as_deref(), &nodes.gpu.name)?;
    let measurements = profile.as_ref().map(|p| p.measurements.as_ref());
    let all = runs_and_skipped(&table, &defaults, (&nodes).into())?;
    if let Some(why) = all.none_left() {
        bail!("{}: {why}", args.runs.display());
    }
    if let Some(note) = all.skipped_summary() {
        eprintln!("note: {}: {note}", args.runs.display());
    }
    if !all.contradictions.is_empty() {
        eprintln!(
            "note: {}: {} row(s) contradict an earlier one (first: line {}, {}); all are kept",
            args.runs.display(),
            all.contradictions.len(),
            all.contradictions[0].0,
            all.contradictions[0].1
        );
    }
    let runs = all.runs;
    // Rows of other GPUs than the flags' (a `gpu` column) are predicted on
    // that GPU's nodes, with the cost model given or that GPU's default.
    let settings = resolve::per_gpu(&runs, &nodes, &cost, &args.common);
    let evaluation = evaluate_with(&runs, |run| {
        let (group, cost) = settings.of(run);
        Setting {
            group,
            cost,
            profile: measurements.filter(|_| settings.is_base(run)),
        }
    });
    // What the rows' predictions took from the profile (re-run to count).
    let mut usage = ProfileUsage::default();
    if measurements.is_some() {
        for run in runs.iter().filter(|r| r.measured_s.is_some()) {
            let scenario = Scenario::new(&run.model, run.global_batch, &nodes, run.gpus, &cost)
                .with_profile(measurements);
            usage.add(&predict_with_usage(&scenario, &run.config).1);
        }
    }
    if evaluation.rows.is_empty() && evaluation.memory.is_empty() {
        bail!(
            "{}: no row has a measured time or memory; add an iter_ms or a peak_allocated_gib column",
            args.runs.display()
        );
    }
    let summary = evaluation.summary();
    let memory = evaluation.memory_summary();
    match args.common.format {
        Format::Json => emit(&json(&serde_json::json!({
            "cost_model": cost.name, "summary": summary, "groups": evaluation.groups, "rows": evaluation.rows,
            "memory_summary": memory, "memory_rows": evaluation.memory,
            "profile": profile.as_ref().map(|p| serde_json::json!({
                "path": p.path.display().to_string(), "usage": usage,
            })),
        }))?)?,
        Format::Csv => {
            let headers =
                ["line", "group", "measured_ms", "predicted_ms", "error"].map(String::from);
            let rows: Vec<Vec<String>> = evaluation
                .rows
                .iter()
                .map(|r| {
                    vec![
                        r.line.to_string(),
                        r.group.clone(),
                        format!("{:.3}", r.measured_s * 1e3),
                        format!("{:.3}", r.predicted_s * 1e3),
                        format!("{:.4}", r.relative()),
                    ]
                })
                .collect();
            emit_csv(&headers, &rows)?;
        }
        Format::Table => {
            let mut out = String::new();
            let _ = writeln!(
                out,
                "paratune evaluate: {} with cost model {}",
                args.runs.display(),
                cost.name
            );
            if let Some(profile) = &profile {
                let _ = writeln!(out, "{}: {}", profile.title(), usage_line(&usage));
            }
            if settings.several() {
                let _ = writeln!(out, "  per GPU: {}", settings.describe());
            }
            if !evaluation.memory.is_empty() {
                memory_lines(&mut out, &memory);
            }
            if evaluation.rows.is_empty() {
                emit(&out)?;
                return Ok(());
            }
            let _ = writeln!(out, "  rows with a measured time   {}", summary.rows);
            let _ = writeln!(
                out,
                "  MAPE                        {}",
                percent(summary.mape)
            );
            let _ = writeln!(
                out,
                "  median error                {}",
                percent(summary.median_ape)
            );
            let _ = writeln!(
                out,
                "  90th percentile error       {}",
                percent(summary.p90_ape)
            );
            let _ = writeln!(
                out,
                "  worst row                   line {} ({:+.1}%)",
                summary.worst_line.unwrap_or(0),
                summary.worst_error * 100.0
            );
            kind_lines(&mut out, &summary.by_kind);
            gpu_lines(&mut out, &summary.by_gpu);
            mean_note(
                &mut out,
                !summary.by_kind.is_empty() || !summary.by_gpu.is_empty(),
            );
            // Rows with a time but no measured peak ran without a memory
            // figure: their fits verdict is checked here.
            if evaluation.memory.is_empty() {
                let lines = &summary.not_fitting_lines;
                let _ = writeln!(
                    out,
                    "  runs predicted not to fit  {}{}",
                    lines.len(),
                    if lines.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " (line {})",
                            lines
                                .iter()
                                .map(|l| l.to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    }
                );
            }
            if summary.groups > 0 {
                let _ = writeln!(
                    out,
                    "  groups (same model, GPUs, global batch; 3+ rows): {}",
                    summary.groups
                );
                let _ = writeln!(
                    out,
                    "  mean Spearman rank correlation {:.3}",
                    summary.mean_spearman
                );
                let _ = writeln!(
                    out,
                    "  top-1 regret: mean {}, worst {}",
                    percent(summary.mean_top1_regret),
                    percent(summary.max_top1_regret)
                );
            } else {
                let _ = writeln!(
                    out,
                    "  no group has several rows: rank correlation and regret need rows that compete for the same job"
                );
            }
            if args.groups {
                let _ = writeln!(
                    out,
                    "\n  {:<44} {:>5} {:>9} {:>8}",
                    "group", "rows", "Spearman", "regret"
                );
                for g in &evaluation.groups {
                    let _ = writeln!(
                        out,
                        "  {:<44} {:>5} {:>9.3} {:>8}",
                        g.group,
                        g.rows,
                        g.spearman,
                        percent(g.top1_regret)
                    );
                }
            }
            emit(&out)?;
        }
    }
    Ok(())
}

/// Figures per kind of run, a line each.
fn kind_lines(out: &mut String, by_kind: &[(paratune::evaluate::RunKind, Figures)]) {
    for (kind, f) in by_kind {
        figures_line(out, kind.name(), f);
    }
}

/// Figures per GPU, a line each.
fn gpu_lines(out: &mut String, by_gpu: &[(String, Figures)]) {
    for (gpu, f) in by_gpu {
        figures_line(out, &format!("on {gpu}"), f);
    }
}

/// What the split lines' "mean" is, once under them.
fn mean_note(out: &mut String, shown: bool) {
    if shown {
        let _ = writeln!(
            out,
            "    (mean: the signed error, predicted minus measured over measured; below zero, the prediction is the lower)"
        );
    }
}

fn figures_line(out: &mut String, label: &str, f: &Figures) {
    let _ = writeln!(
        out,
        "    {label}: {} rows, MAPE {}, median {}, mean {:+.1}%, worst line {} ({:+.1}%)",
        f.rows,
        percent(f.mape),
        percent(f.median_ape),
        f.bias * 100.0,
        f.worst_line,
        f.worst_error * 100.0
    );
}

/// The memory figures of an evaluation, as table lines.
fn memory_lines(out: &mut String, m: &paratune::evaluate::MemorySummary) {
    let _ = writeln!(out, "  rows with a measured peak memory {}", m.rows);
    for (name, figures) in [("allocated", &m.allocated), ("reserved", &m.reserved)] {
        if let Some(f) = figures {
            let _ = writeln!(
                out,
                "  {name} peak: MAPE {}, median {}, 90th percentile {}, worst line {} ({:+.1}%)",
                percent(f.mape),
                percent(f.median_ape),
                percent(f.p90_ape),
                f.worst_line,
                f.worst_error * 100.0
            );
        }
    }
    kind_lines(out, &m.allocated_by_kind);
    mean_note(out, !m.allocated_by_kind.is_empty());
    let _ = writeln!(
        out,
        "  fits verdicts the runs contradict: {} (predicted not to fit, yet they ran){}",
        m.wrong_fits,
        if m.wrong_fits_lines.is_empty() {
            String::new()
        } else {
            format!(
                ": line {}",
                m.wrong_fits_lines
                    .iter()
                    .map(|l| l.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
}

pub fn models(format: Format) -> Result<()> {
    let models = builtin_model_names()
        .iter()
        .map(|name| builtin_model(name).context("catalogue"))
        .collect::<Result<Vec<_>>>()?;
    // JSON and CSV list the same flat records: each model's parameter count
    // and the keys a model file of it holds (`base = "<name>"` with none
    // of them is the same model).
    match format {
        Format::Json => {
            let entries: Vec<serde_json::Map<String, serde_json::Value>> = models
                .iter()
                .map(|m| {
                    let mut entry = serde_json::Map::new();
                    entry.insert("params".into(), serde_json::json!(parameter_count(m)));
                    for (key, value) in model_file_values(m) {
                        entry.insert(key.into(), serde_json::to_value(value)?);
                    }
                    Ok(entry)
                })
                .collect::<Result<_>>()?;
            emit(&json(&entries)?)
        }
        Format::Csv => {
            let keys: Vec<&str> = model_file_keys().filter(|key| *key != "name").collect();
            let headers: Vec<String> = ["name", "params"]
                .into_iter()
                .chain(keys.iter().copied())
                .map(String::from)
                .collect();
            let rows: Vec<Vec<String>> = models
                .iter()
                .map(|m| {
                    let values = model_file_values(m);
                    let cell = |key: &str| {
                        values
                            .iter()
                            .find(|(k, _)| *k == key)
                            .map_or(String::new(), |(_, v)| match v {
                                toml::Value::String(text) => text.clone(),
                                other => other.to_string(),
                            })
                    };
                    [m.name.clone(), parameter_count(m).to_string()]
                        .into_iter()
                        .chain(keys.iter().map(|key| cell(key)))
                        .collect()
                })
                .collect();
            emit_csv(&headers, &rows)
        }
        Format::Table => emit(&models_table(&models)),
    }
}

/// A model's parameters, a whole number.
fn parameter_count(model: &ModelSpec) -> u64 {
    model.total_params().round() as u64
}

fn models_table(models: &[paratune::model::ModelSpec]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>9} {:>7} {:>6} {:>4} {:>7} {:>7} {:>8} {:>6} {:<5} {:<6} {:>11}",
        "name",
        "params",
        "hidden",
        "heads",
        "kv",
        "ffn",
        "layers",
        "vocab",
        "seq",
        "mlp",
        "embed",
        "experts"
    );
    for m in models {
        let experts = m
            .moe
            .map_or_else(|| "-".into(), |e| format!("{} top-{}", e.experts, e.topk));
        let _ = writeln!(
            out,
            "{:<14} {:>8.1}B {:>7} {:>6} {:>4} {:>7} {:>7} {:>8} {:>6} {:<5} {:<6} {:>11}",
            m.name,
            m.total_params() / 1e9,
            m.hidden,
            m.heads,
            m.kv_heads,
            m.ffn_hidden,
            m.layers,
            m.vocab,
            m.seq_len,
            if m.gated_mlp { "gated" } else { "gelu" },
            if m.tied_embeddings { "tied" } else { "untied" },
            experts
        );
    }
    out
}

pub fn gpus(format: Format) -> Result<()> {
    let nodes = builtin_gpu_names()
        .iter()
        .map(|name| builtin_node(name, 1).context("catalogue"))
        .collect::<Result<Vec<_>>>()?;
    let tflops = |peak: Option<f64>| peak.map(|f| f / 1e12);
    match format {
        Format::Json => emit(&json(&nodes)?),
        Format::Csv => {
            let headers = [
                "name",
                "bf16_tflops",
                "fp8_tflops",
                "fp4_tflops",
                "memory_gib",
                "hbm_tb_per_s",
                "gpus_per_node",
                "intra_node_bw",
                "inter_node_bw",
            ]
            .map(String::from);
            let cell = |peak: Option<f64>| tflops(peak).map_or(String::new(), |t| format!("{t}"));
            let rows: Vec<Vec<String>> = nodes
                .iter()
                .map(|node| {
                    vec![
                        node.gpu.name.clone(),
                        cell(Some(node.gpu.peak_flops)),
                        cell(node.gpu.fp8_peak_flops),
                        cell(node.gpu.fp4_peak_flops),
                        format!("{}", node.gpu.memory_bytes / GIB),
                        format!("{}", node.gpu.hbm_bandwidth / 1e12),
                        node.gpus_per_node.to_string(),
                        node.intra_node_bw.to_string(),
                        node.inter_node_bw.to_string(),
                    ]
                })
                .collect();
            emit_csv(&headers, &rows)
        }
        Format::Table => {
            let mut out = String::new();
            let _ = writeln!(
                out,
                "{:<11} {:>14} {:>11} {:>11} {:>9} {:>9} {:>10} {:>13} {:>15}",
                "name",
                "16-bit TFLOP/s",
                "FP8 TFLOP/s",
                "FP4 TFLOP/s",
                "memory",
                "HBM",
                "GPUs/node",
                "intra-node",
                "inter-node"
            );
            let shown =
                |peak: Option<f64>| tflops(peak).map_or_else(|| "-".into(), |t| format!("{t:.1}"));
            for node in &nodes {
                let _ = writeln!(
                    out,
                    "{:<11} {:>14.1} {:>11} {:>11} {:>6.1}GiB {:>6.2}TB/s {:>10} {:>13} {:>15}",
                    node.gpu.name,
                    node.gpu.peak_flops / 1e12,
                    shown(node.gpu.fp8_peak_flops),
                    shown(node.gpu.fp4_peak_flops),
                    node.gpu.memory_bytes / GIB,
                    node.gpu.hbm_bandwidth / 1e12,
                    node.gpus_per_node,
                    node.intra_node_bw.to_string(),
                    node.inter_node_bw.to_string()
                );
            }
            emit(&out)
        }
    }
}
