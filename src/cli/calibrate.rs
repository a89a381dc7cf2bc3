//! `paratune calibrate`: fit a cost model to measured runs and write it,
//! with its report beside it.

use super::args::{CalibrateArgs, Format};
use super::render::{emit, emit_csv};
use super::resolve;
use anyhow::{Context, Result, anyhow, bail};
use paratune::calibrate::{CollectivesFirst, Dataset, FitOptions, FittedModel, fit_cost_model};
use paratune::coefficients::save_cost_model_with_report;
use paratune::runs::{RunTable, runs_and_skipped};
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
    let all = runs_and_skipped(&table, &defaults, (&group).into())?;
    if let Some(note) = all.skipped_summary() {
        eprintln!("note: {}: {note}", file.display());
    }
    let name = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "runs".into());
    Ok(Dataset::per_gpu(&name, all.runs, &group))
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
    let Some(first) = datasets.first() else {
        bail!(
            "--runs: no row is left to fit (the notes above say why each file's were left out); give a runs CSV with rows paratune can express"
        );
    };
    let prior = resolve::cost_model(
        Some(args.common.cost_model.as_deref().unwrap_or("datasheet")),
        &first.group.gpu.name,
    )?;
    let collectives = match &args.collectives {
        None => None,
        Some(path) => {
            let fitted = CollectivesFirst::fit(path, &first.group, &prior)?;
            eprintln!("{}", fitted.summary(path));
            Some(fitted)
        }
    };
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
        ..FitOptions::default()
    };
    let command: Vec<String> = std::env::args().skip(1).collect();
    let command = format!("paratune {}", command.join(" "));
    let FittedModel {
        calibration,
        report,
    } = fit_cost_model(
        &datasets,
        &prior,
        &name,
        &options,
        collectives.as_ref(),
        &command,
    )?;
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
