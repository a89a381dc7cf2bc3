//! `paratune calibrate` as one library call: the collective coefficients
//! fitted first to nccl-tests curves (and then pinned), the time fit, the
//! memory fit on the measured peaks after it, and the report with every
//! step's figures recorded in the model's provenance.

use super::collectives::{
    COLLECTIVE_COEFFICIENTS, CollectiveFit, fit_collectives, read_nccl_table,
};
use super::memory::{MemoryFit, fit_memory, memory_rows};
use super::report::render_report;
use super::{CalibrateError, Calibration, Dataset, FitOptions, calibrate};
use crate::cluster::{NodeGroup, builtin_node};
use crate::coefficients::CostModel;
use crate::runs::Run;
use std::fmt::Write as _;
use std::path::Path;

impl Dataset {
    /// One dataset per GPU the rows name (a `gpu` column, as Megatron-LM's
    /// CI runs have on A100 and H100), each on nodes of `group`'s shape;
    /// rows of `group`'s own GPU, or naming none, stay on `group`. With
    /// several GPUs each dataset's name says its GPU.
    pub fn per_gpu(name: &str, runs: Vec<Run>, group: &NodeGroup) -> Vec<Dataset> {
        let mut by_gpu: Vec<(Option<String>, Vec<Run>)> = Vec::new();
        for run in runs {
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
                    name.to_string()
                };
                Dataset { name, runs, group }
            })
            .collect()
    }
}

/// The collective coefficients fitted to an nccl-tests table before the
/// time fit, which then keeps them.
pub struct CollectivesFirst {
    /// The prior with the collective coefficients fitted.
    pub model: CostModel,
    pub fit: CollectiveFit,
    /// The table's file name, as the provenance records it.
    pub file: String,
}

impl CollectivesFirst {
    /// Fits the collective coefficients of `prior` to the all-reduce curves
    /// in `path`, measured on `group`'s links.
    pub fn fit(
        path: &Path,
        group: &NodeGroup,
        prior: &CostModel,
    ) -> Result<CollectivesFirst, CalibrateError> {
        let samples = read_nccl_table(path)?;
        let (model, fit) = fit_collectives(&samples, group, prior)?;
        let file = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(CollectivesFirst { model, fit, file })
    }

    /// One line: the fitted values and their error.
    pub fn summary(&self, path: &Path) -> String {
        let values: Vec<String> = self
            .fit
            .values
            .iter()
            .map(|(name, value)| format!("{name} = {value:.4}"))
            .collect();
        format!(
            "collectives: fitted {} to {} all-reduce measurements in {} (MAPE {:.1}%, worst {:+.1}%)",
            values.join(", "),
            self.fit.samples,
            path.display(),
            self.fit.mape * 100.0,
            self.fit.worst_error * 100.0
        )
    }

    fn record(&self, calibration: &mut Calibration, report: &mut String) {
        let fit = &self.fit;
        let mut table = toml::Table::new();
        table.insert("file".into(), toml::Value::String(self.file.clone()));
        table.insert("samples".into(), toml::Value::Integer(fit.samples as i64));
        table.insert("mape".into(), rounded(fit.mape));
        table.insert("worst".into(), rounded(fit.worst_error));
        calibration
            .model
            .provenance
            .insert("collectives".into(), toml::Value::Table(table));
        let _ = write!(
            report,
            "\n## Collectives\n\n`{}` were fitted first to {} all-reduce measurements (`{}`): \
             MAPE {:.1}%, worst {:+.1}%; the iteration-time fit kept them.\n",
            COLLECTIVE_COEFFICIENTS.join("`, `"),
            fit.samples,
            self.file,
            fit.mape * 100.0,
            fit.worst_error * 100.0
        );
    }
}

fn rounded(x: f64) -> toml::Value {
    toml::Value::Float((x * 1e4).round() / 1e4)
}

/// A calibration with its Markdown report.
pub struct FittedModel {
    pub calibration: Calibration,
    pub report: String,
}

/// Fits `prior` (with its collective coefficients already fitted and
/// pinned when `collectives` is given) to the datasets' times, then its
/// memory coefficients to their measured peaks; `command` is recorded as
/// the model's provenance.
pub fn fit_cost_model(
    datasets: &[Dataset],
    prior: &CostModel,
    name: &str,
    options: &FitOptions,
    collectives: Option<&CollectivesFirst>,
    command: &str,
) -> Result<FittedModel, CalibrateError> {
    let mut options = options.clone();
    let prior = match collectives {
        Some(first) => {
            options.pinned = COLLECTIVE_COEFFICIENTS
                .iter()
                .map(|s| s.to_string())
                .collect();
            &first.model
        }
        None => prior,
    };
    let mut calibration = calibrate(datasets, prior, name, &options)?;
    calibration
        .model
        .provenance
        .insert("command".into(), toml::Value::String(command.to_string()));
    let mut report = render_report(&calibration);
    let peaks: Vec<_> = datasets
        .iter()
        .flat_map(|d| memory_rows(&d.runs, &d.group))
        .collect();
    if let Some(fit) = fit_memory(&peaks, &calibration.model, options.folds, options.seed) {
        for (name, _, value) in &fit.coefficients {
            calibration.model.coefficients.set(name, *value);
        }
        crate::coefficients::mark_informed(
            &mut calibration.model.provenance,
            fit.coefficients.iter().map(|(name, _, _)| *name),
        );
        record_memory_fit(&mut calibration.model, &fit);
        report.push_str(&memory_report(&fit));
    }
    if let Some(first) = collectives {
        first.record(&mut calibration, &mut report);
    }
    Ok(FittedModel {
        calibration,
        report,
    })
}

/// The memory fit's figures in the model's provenance: `memory_cv_mape`,
/// `memory_cv_worst` (cross-validated), `memory_rows`.
fn record_memory_fit(model: &mut CostModel, fit: &MemoryFit) {
    let p = &mut model.provenance;
    p.insert("memory_rows".into(), toml::Value::Integer(fit.rows as i64));
    if let Some(f) = &fit.cross_validated {
        p.insert("memory_cv_mape".into(), rounded(f.mape));
        p.insert("memory_cv_p90_ape".into(), rounded(f.p90_ape));
        p.insert("memory_cv_worst".into(), rounded(f.worst_error));
    }
    if let Some(f) = &fit.in_sample {
        p.insert("memory_in_sample_mape".into(), rounded(f.mape));
    }
}

/// The report's memory section.
fn memory_report(fit: &MemoryFit) -> String {
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
    let row = |out: &mut String, label: &str, f: &Option<crate::evaluate::Figures>| {
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
