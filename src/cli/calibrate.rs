//! `paratune calibrate`: fit a cost model to measured runs and write it,
//! with its report beside it.

use super::args::{CalibrateArgs, Format};
use super::render::{emit, emit_csv};
use super::resolve;
use anyhow::{Context, Result, anyhow, bail};
use paratune::calibrate::{
    COLLECTIVE_COEFFICIENTS, Dataset, FitOptions, calibrate, fit_collectives, read_nccl_table,
    render_report,
};
use paratune::calibrate::{MemoryFit, fit_memory, memory_rows};
use paratune::cluster::builtin_node;
use paratune::coefficients::CostModel;
use paratune::coefficients::save_cost_model_with_report;
use paratune::runs::{Run, RunTable, runs_and_skipped};
use paratune::units::Bandwidth;
use std::path::{Path, PathBuf};

/// Keys a `--runs FILE:key=value,...` may set for that file alone.
const FILE_KEYS: [&str; 10] = [
    "vocab",
    "seq_len",
    "recompute",
    "attention",
    "schedule",
    "sequence_parallel",
    "optimizer_sharding",
    "gpus_per_node",
    "intra_node_bw",
    "inter_node_bw",
];

/// Splits `FILE:key=value,key=value` into the file and its settings.
fn split_spec(spec: &Path) -> Result<(PathBuf, Vec<(String, String)>)> {
    let text = spec.to_string_lossy();
    let Some((file, settings)) = text.rsplit_once(':').filter(|(_, s)| s.contains('=')) else {
        return Ok((spec.to_path_buf(), Vec::new()));
    };
    let mut pairs = Vec::new();
    for item in settings.split(',').filter(|s| !s.trim().is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| anyhow!("--runs {text}: `{item}` is not key=value"))?;
        let key = key.trim();
        if !FILE_KEYS.contains(&key) {
            bail!(
                "--runs {text}: unknown setting `{key}`{}",
                paratune::suggest::did_you_mean(key, &FILE_KEYS)
            );
        }
        pairs.push((key.to_string(), value.trim().to_string()));
    }
    Ok((PathBuf::from(file), pairs))
}

/// The datasets of one `--runs` file: one per GPU when its `gpu` column
/// names several (Megatron-LM's CI runs, on A100 and H100).
fn datasets(spec: &Path, args: &CalibrateArgs) -> Result<Vec<Dataset>> {
    let (file, settings) = split_spec(spec)?;
    let mut model_args = args.common.model.clone();
    let mut space_args = args.space.clone();
    let mut cluster_args = args.common.cluster.clone();
    let mut intra = None;
    let mut inter = None;
    for (key, value) in &settings {
        let number = || -> Result<u64> {
            value
                .parse()
                .with_context(|| format!("--runs {}: {key} must be a whole number", spec.display()))
        };
        let bandwidth = || -> Result<Bandwidth> {
            value
                .parse::<Bandwidth>()
                .map_err(|e| anyhow!("--runs {}: {key}: {e}", spec.display()))
        };
        match key.as_str() {
            "vocab" => model_args.vocab = Some(number()?),
            "seq_len" => model_args.seq_len = Some(number()?),
            "gpus_per_node" => cluster_args.gpus_per_node = Some(number()?),
            "recompute" => space_args.recompute = Some(vec![value.clone()]),
            "attention" => space_args.attention = Some(vec![value.clone()]),
            "schedule" => space_args.schedule = Some(vec![value.clone()]),
            "sequence_parallel" => space_args.sequence_parallel = Some(vec![value.clone()]),
            "optimizer_sharding" => space_args.optimizer_sharding = Some(vec![value.clone()]),
            "intra_node_bw" => intra = Some(bandwidth()?),
            "inter_node_bw" => inter = Some(bandwidth()?),
            _ => unreachable!("split_spec admits only FILE_KEYS"),
        }
    }
    let table = RunTable::read(&file)?;
    let (mut group, _) = resolve::nodes_or_table_gpu(&cluster_args, &table)?;
    if let Some(bw) = intra {
        group.intra_node_bw = bw;
    }
    if let Some(bw) = inter {
        group.inter_node_bw = bw;
    }
    let defaults = resolve::row_defaults(&space_args, resolve::row_model(&model_args)?)?;
    let all = runs_and_skipped(&table, &defaults, group.gpus_per_node)?;
    if let Some(note) = all.skipped_summary() {
        eprintln!("note: {}: {note}", file.display());
    }
    let name = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "runs".into());
    // One dataset per GPU the rows name, each on its own nodes.
    let mut by_gpu: Vec<(Option<String>, Vec<Run>)> = Vec::new();
    for run in all.runs {
        let gpu = run.gpu.clone().filter(|g| *g != group.gpu.name);
        match by_gpu.iter_mut().find(|(g, _)| *g == gpu) {
            Some((_, runs)) => runs.push(run),
            None => by_gpu.push((gpu, vec![run])),
        }
    }
    let several = by_gpu.len() > 1;
    by_gpu
        .into_iter()
        .map(|(gpu, runs)| {
            let group = match &gpu {
                None => group.clone(),
                Some(gpu) => {
                    let mut other =
                        builtin_node(gpu, group.nodes).expect("rows name built-in GPUs");
                    other.gpus_per_node = group.gpus_per_node;
                    other
                }
            };
            let name = if several {
                format!("{name} on {}", group.gpu.name)
            } else {
                name.clone()
            };
            Ok(Dataset { name, runs, group })
        })
        .collect()
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    if let Some(h) = args.holdout.filter(|h| !(*h > 0.0 && *h < 1.0)) {
        bail!("--holdout must be a fraction between 0 and 1 (e.g. 0.3), found {h}");
    }
    let datasets: Vec<Dataset> = args
        .runs
        .iter()
        .map(|spec| datasets(spec, args))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let mut prior = resolve::cost_model(
        Some(args.common.cost_model.as_deref().unwrap_or("datasheet")),
        &datasets[0].group.gpu.name,
    )?;
    let mut pinned = Vec::new();
    let mut collective_note = None;
    if let Some(path) = &args.collectives {
        let samples = read_nccl_table(path)?;
        let (fitted, fit) = fit_collectives(&samples, &datasets[0].group, &prior)?;
        let values: Vec<String> = fit
            .values
            .iter()
            .map(|(name, value)| format!("{name} = {value:.4}"))
            .collect();
        eprintln!(
            "collectives: fitted {} to {} all-reduce measurements in {} (MAPE {:.1}%, worst {:+.1}%)",
            values.join(", "),
            fit.samples,
            path.display(),
            fit.mape * 100.0,
            fit.worst_error * 100.0
        );
        prior = fitted;
        pinned = COLLECTIVE_COEFFICIENTS
            .iter()
            .map(|s| s.to_string())
            .collect();
        collective_note = Some((path.clone(), fit));
    }
    let name = args.name.clone().unwrap_or_else(|| {
        args.out
            .as_ref()
            .and_then(|p| p.file_stem())
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "fitted".into())
    });
    let options = FitOptions {
        free: args.fit.clone(),
        seed: args.seed,
        folds: args.folds,
        bootstrap: args.bootstrap,
        holdout: args.holdout,
        pinned,
        ..FitOptions::default()
    };
    let mut calibration = calibrate(&datasets, &prior, &name, &options)?;
    let command: Vec<String> = std::env::args().skip(1).collect();
    calibration.model.provenance.insert(
        "command".into(),
        toml::Value::String(format!("paratune {}", command.join(" "))),
    );
    let mut report = render_report(&calibration);
    // The memory coefficients, on the measured peaks, from the time fit.
    let memory_rows: Vec<_> = datasets
        .iter()
        .flat_map(|d| memory_rows(&d.runs, &d.group))
        .collect();
    if let Some(fit) = fit_memory(&memory_rows, &calibration.model, args.folds, args.seed) {
        for (name, _, value) in &fit.coefficients {
            calibration.model.coefficients.set(name, *value);
        }
        record_memory_fit(&mut calibration.model, &fit);
        report.push_str(&memory_report(&fit));
    }
    if let Some((path, fit)) = collective_note {
        let mut table = toml::Table::new();
        let file = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        table.insert("file".into(), toml::Value::String(file.clone()));
        table.insert("samples".into(), toml::Value::Integer(fit.samples as i64));
        table.insert(
            "mape".into(),
            toml::Value::Float((fit.mape * 1e4).round() / 1e4),
        );
        table.insert(
            "worst".into(),
            toml::Value::Float((fit.worst_error * 1e4).round() / 1e4),
        );
        calibration
            .model
            .provenance
            .insert("collectives".into(), toml::Value::Table(table));
        report.push_str(&format!(
            "\n## Collectives\n\n`{}` were fitted first to {} all-reduce measurements (`{file}`): \
             MAPE {:.1}%, worst {:+.1}%; the iteration-time fit kept them.\n",
            COLLECTIVE_COEFFICIENTS.join("`, `"),
            fit.samples,
            fit.mape * 100.0,
            fit.worst_error * 100.0
        ));
    }
    if let Some(out) = &args.out {
        let report_path = save_cost_model_with_report(&calibration.model, out, &report)?;
        eprintln!("wrote {} and {}", out.display(), report_path.display());
    }
    let coefficients = calibration
        .coefficients
        .iter()
        .map(|c| (c.name, c.unit, c.prior, c.value, c.ci95, c.status.name()));
    match args.common.format {
        Format::Table => emit(&report),
        Format::Json => {
            let coefficients: Vec<_> = coefficients
                .map(|(name, unit, prior, value, ci95, status)| {
                    serde_json::json!({
                        "name": name, "unit": unit, "prior": prior, "value": value,
                        "ci95": ci95, "status": status,
                    })
                })
                .collect();
            let summary = serde_json::json!({
                "name": calibration.model.name,
                "coefficients": coefficients,
                "in_sample": calibration.in_sample,
                "cross_validated": calibration.cross_validated,
                "holdout": calibration.holdout,
                "prior_holdout": calibration.prior_holdout,
                "data_hash": calibration.data_hash,
            });
            emit(&(serde_json::to_string_pretty(&summary)? + "\n"))
        }
        Format::Csv => {
            let headers = [
                "coefficient",
                "unit",
                "prior",
                "value",
                "ci95_low",
                "ci95_high",
                "status",
            ]
            .map(String::from);
            let rows: Vec<Vec<String>> = coefficients
                .map(|(name, unit, prior, value, ci95, status)| {
                    let (low, high) = ci95.map_or((String::new(), String::new()), |(l, h)| {
                        (l.to_string(), h.to_string())
                    });
                    vec![
                        name.into(),
                        unit.into(),
                        prior.to_string(),
                        value.to_string(),
                        low,
                        high,
                        status.into(),
                    ]
                })
                .collect();
            emit_csv(&headers, &rows)
        }
    }
}

/// The memory fit's figures in the model's provenance: `memory_cv_mape`,
/// `memory_cv_worst` (cross-validated), `memory_rows`.
fn record_memory_fit(model: &mut CostModel, fit: &MemoryFit) {
    let round = |x: f64| toml::Value::Float((x * 1e4).round() / 1e4);
    let p = &mut model.provenance;
    p.insert("memory_rows".into(), toml::Value::Integer(fit.rows as i64));
    if let Some(f) = &fit.cross_validated {
        p.insert("memory_cv_mape".into(), round(f.mape));
        p.insert("memory_cv_p90_ape".into(), round(f.p90_ape));
        p.insert("memory_cv_worst".into(), round(f.worst_error));
    }
    if let Some(f) = &fit.in_sample {
        p.insert("memory_in_sample_mape".into(), round(f.mape));
    }
}

/// The report's memory section.
fn memory_report(fit: &MemoryFit) -> String {
    use std::fmt::Write as _;
    let mut out = String::from("\n## Memory\n\n");
    let _ = writeln!(
        out,
        "The memory coefficients were fitted to {} measured peaks (allocated, and reserved where measured), after the time fit.\n",
        fit.rows
    );
    out.push_str("| coefficient | prior | fitted |\n|---|---:|---:|\n");
    for (name, prior, value) in &fit.coefficients {
        let _ = writeln!(out, "| {name} | {prior:.4} | {value:.4} |");
    }
    out.push_str("\n| peaks | rows | MAPE | median APE | 90th pct APE | worst row |\n|---|---:|---:|---:|---:|---|\n");
    let row = |out: &mut String, label: &str, f: &Option<paratune::evaluate::Figures>| {
        if let Some(f) = f {
            let _ = writeln!(
                out,
                "| {label} | {} | {:.1}% | {:.1}% | {:.1}% | {:+.1}% (line {}) |",
                f.rows,
                f.mape * 100.0,
                f.median_ape * 100.0,
                f.p90_ape * 100.0,
                f.worst_error * 100.0,
                f.worst_line
            );
        }
    };
    row(&mut out, "prior", &fit.prior);
    row(&mut out, "fitted, in sample", &fit.in_sample);
    row(
        &mut out,
        &format!("fitted, cross-validated ({}-fold by job)", fit.folds),
        &fit.cross_validated,
    );
    out
}
