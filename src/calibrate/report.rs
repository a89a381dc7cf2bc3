//! The calibration report (Markdown) and the provenance written into the
//! fitted cost model.

use super::figures::{ErrorFigures, OVERALL, overall};
use super::{Calibration, Dataset, FitOptions, FitStatus};
use crate::cluster::NodeGroup;
use crate::coefficients::{Coefficients, CostModel, FILLED_WITH_PRIORS, mark_informed};
use std::collections::BTreeMap;
use std::fmt::Write;
use toml::Value;

/// Rounds a figure for provenance (six decimals: 0.0001% resolution).
fn round(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

fn cluster_table(group: &NodeGroup) -> Value {
    let mut t = toml::Table::new();
    t.insert("gpu".into(), Value::String(group.gpu.name.clone()));
    t.insert(
        "gpus_per_node".into(),
        Value::Integer(group.gpus_per_node as i64),
    );
    t.insert(
        "intra_node_bw".into(),
        Value::String(group.intra_node_bw.to_string()),
    );
    t.insert(
        "inter_node_bw".into(),
        Value::String(group.inter_node_bw.to_string()),
    );
    Value::Table(t)
}

/// Puts the figures that exist (not NaN) under `prefix_<what>` keys.
fn put_figures(t: &mut toml::Table, prefix: &str, f: &ErrorFigures) {
    let mut put = |key: &str, x: f64| {
        if x.is_finite() {
            t.insert(format!("{prefix}{key}"), Value::Float(round(x)));
        }
    };
    put("mape", f.mape);
    put("median_ape", f.median_ape);
    put("p90_ape", f.p90_ape);
    put("worst", f.worst_error);
    put("mean_spearman", f.mean_spearman);
    put("mean_top1_regret", f.mean_top1_regret);
    put("max_top1_regret", f.max_top1_regret);
}

fn find<'a>(list: &'a [(String, ErrorFigures)], name: &str) -> Option<&'a ErrorFigures> {
    list.iter().find(|(n, _)| n == name).map(|(_, f)| f)
}

/// Provenance of a fitted model: data, cluster, date, version, options and
/// error figures overall (`cv_*`, `in_sample_*`, `prior_*`) and per dataset
/// (`[provenance.datasets.<name>]`).
pub(super) fn provenance(
    c: &Calibration,
    datasets: &[Dataset],
    prior: &CostModel,
    opts: &FitOptions,
) -> BTreeMap<String, Value> {
    let mut p = toml::Table::new();
    let mut fitted_on = toml::Table::new();
    for d in &c.datasets {
        fitted_on.insert(d.name.clone(), Value::Integer(d.rows as i64));
    }
    p.insert("fitted_on".into(), Value::Table(fitted_on));
    p.insert("data_hash".into(), Value::String(c.data_hash.clone()));
    let first = &datasets[0].group;
    if datasets.iter().all(|d| d.group == *first) {
        p.insert("cluster".into(), cluster_table(first));
    } else {
        let mut t = toml::Table::new();
        for d in datasets {
            t.insert(d.name.clone(), cluster_table(&d.group));
        }
        p.insert("cluster".into(), Value::Table(t));
    }
    p.insert("date".into(), Value::String(crate::date::today_utc()));
    p.insert(
        "paratune_version".into(),
        Value::String(env!("CARGO_PKG_VERSION").into()),
    );
    p.insert("prior".into(), Value::String(prior.name.clone()));
    p.insert("seed".into(), Value::Integer(opts.seed as i64));
    p.insert("folds".into(), Value::Integer(c.folds as i64));
    p.insert("bootstrap".into(), Value::Integer(c.bootstrap as i64));
    if let Some(h) = opts.holdout {
        p.insert("holdout".into(), Value::Float(h));
    }
    let names = |status: FitStatus| {
        Value::Array(
            c.coefficients
                .iter()
                .filter(|f| f.status == status)
                .map(|f| Value::String(f.name.into()))
                .collect(),
        )
    };
    p.insert("fitted".into(), names(FitStatus::Fitted));
    p.insert("not_informed".into(), names(FitStatus::NotInformed));
    // What the prior held only as filled-in priors stays listed unless this
    // fit moved it or a separate measurement pinned it.
    let mut carried = BTreeMap::new();
    if let Some(filled) = prior.provenance.get(FILLED_WITH_PRIORS) {
        carried.insert(FILLED_WITH_PRIORS.to_string(), filled.clone());
        let informed = c
            .coefficients
            .iter()
            .filter(|f| f.status == FitStatus::Fitted)
            .map(|f| f.name)
            .chain(opts.pinned.iter().map(String::as_str));
        mark_informed(&mut carried, informed);
    }
    p.extend(carried);

    if let Some(f) = overall(&c.cross_validated) {
        put_figures(&mut p, "cv_", f);
        if let Some((dataset, line)) = &f.worst_line {
            p.insert(
                "cv_worst_row".into(),
                Value::String(format!("{dataset} line {line}")),
            );
        }
    }
    if let Some(f) = overall(&c.in_sample) {
        put_figures(&mut p, "in_sample_", f);
    }
    if let Some(f) = overall(&c.prior_in_sample) {
        put_figures(&mut p, "prior_", f);
    }
    if let Some(f) = c.holdout.as_deref().and_then(overall) {
        put_figures(&mut p, "holdout_", f);
    }
    if let Some(f) = c.prior_holdout.as_deref().and_then(overall) {
        put_figures(&mut p, "prior_holdout_", f);
    }

    let mut per = toml::Table::new();
    for d in &c.datasets {
        let mut t = toml::Table::new();
        t.insert("rows".into(), Value::Integer(d.rows as i64));
        t.insert("groups".into(), Value::Integer(d.groups as i64));
        if let Some(f) = find(&c.cross_validated, &d.name) {
            put_figures(&mut t, "cv_", f);
        }
        if let Some(f) = find(&c.in_sample, &d.name) {
            put_figures(&mut t, "in_sample_", f);
        }
        if let Some(f) = find(&c.prior_in_sample, &d.name) {
            put_figures(&mut t, "prior_", f);
        }
        if let Some(f) = c.holdout.as_deref().and_then(|h| find(h, &d.name)) {
            t.insert("held_out".into(), Value::Integer(d.held_out as i64));
            put_figures(&mut t, "holdout_", f);
        }
        if let Some(f) = c.prior_holdout.as_deref().and_then(|h| find(h, &d.name)) {
            put_figures(&mut t, "prior_holdout_", f);
        }
        per.insert(d.name.clone(), Value::Table(t));
    }
    p.insert("datasets".into(), Value::Table(per));
    p.into_iter().collect()
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}%", x * 100.0)
    } else {
        "n/a".into()
    }
}

fn signed_pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:+.1}%", x * 100.0)
    } else {
        "n/a".into()
    }
}

/// A coefficient value with four significant digits.
fn num(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".into();
    }
    if x == 0.0 {
        return "0".into();
    }
    let digits = (3 - x.abs().log10().floor() as i32).max(0) as usize;
    let s = format!("{x:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn worst(f: &ErrorFigures) -> String {
    match &f.worst_line {
        Some((dataset, line)) => format!("{} ({dataset} line {line})", signed_pct(f.worst_error)),
        None => "n/a".into(),
    }
}

fn spearman(f: &ErrorFigures) -> String {
    if f.mean_spearman.is_finite() {
        format!("{:.3} ({} groups)", f.mean_spearman, f.spearman_groups)
    } else {
        "n/a".into()
    }
}

fn regret(f: &ErrorFigures) -> String {
    if f.mean_top1_regret.is_finite() {
        format!("{} / {}", pct(f.mean_top1_regret), pct(f.max_top1_regret))
    } else {
        "n/a".into()
    }
}

/// A before/after table: for every dataset, the prior's row and the fit's row.
fn comparison(
    out: &mut String,
    title: &str,
    what: &str,
    prior: &[(String, ErrorFigures)],
    fitted: &[(String, ErrorFigures)],
) {
    let _ = writeln!(out, "\n### {title}\n\n{what}\n");
    out.push_str(
        "| dataset | model | rows | MAPE | median APE | 90th pct APE | worst row | mean Spearman | top-1 regret mean / max |\n\
         |---|---|---:|---:|---:|---:|---|---|---|\n",
    );
    for (name, after) in fitted {
        let shown = if name == OVERALL {
            "**all rows**"
        } else {
            name.as_str()
        };
        if let Some(before) = find(prior, name) {
            row(out, shown, "prior", before);
        }
        row(out, shown, "fitted", after);
    }
}

fn row(out: &mut String, dataset: &str, model: &str, f: &ErrorFigures) {
    let _ = writeln!(
        out,
        "| {dataset} | {model} | {} | {} | {} | {} | {} | {} | {} |",
        f.rows,
        pct(f.mape),
        pct(f.median_ape),
        pct(f.p90_ape),
        worst(f),
        spearman(f),
        regret(f)
    );
}

/// The calibration as Markdown: the data, the coefficients (prior, fitted,
/// 95% interval, unit, status), and error tables before and after, in-sample
/// and cross-validated (and on held-out rows), per dataset.
pub fn render_report(c: &Calibration) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Calibration of `{}`\n", c.model.name);
    let _ = writeln!(out, "{}.\n", c.model.description);
    out.push_str(
        "| dataset | rows fitted | held out | groups | nodes |\n|---|---:|---:|---:|---|\n",
    );
    for d in &c.datasets {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} |",
            d.name, d.rows, d.held_out, d.groups, d.cluster
        );
    }
    let _ = writeln!(
        out,
        "\nData hash `{}`, seed {}, {} cross-validation folds (rows of one job stay together), \
         {} bootstrap refits. Loss (soft-L1 of the log error, delta {}, every dataset weighted \
         equally): prior {:.3e}, fitted {:.3e}.",
        c.data_hash,
        c.seed,
        c.folds,
        c.bootstrap,
        super::fit::HUBER_DELTA,
        c.loss_prior,
        c.loss_fitted
    );

    out.push_str("\n## Coefficients\n\n");
    out.push_str(
        "| coefficient | prior | fitted | 95% CI | unit | status |\n|---|---:|---:|---|---|---|\n",
    );
    for f in &c.coefficients {
        let ci = match f.ci95 {
            Some((lo, hi)) => format!("{} .. {}", num(lo), num(hi)),
            None => String::new(),
        };
        let fitted = if f.status == FitStatus::Fitted {
            num(f.value)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            f.name,
            num(f.prior),
            fitted,
            ci,
            f.unit,
            f.status.name()
        );
    }
    let explained: Vec<_> = c
        .coefficients
        .iter()
        .filter(|f| !f.note.is_empty() && f.note != "not in the fit list")
        .collect();
    if !explained.is_empty() {
        out.push_str("\nNotes on coefficients:\n\n");
        for f in explained {
            let sensitivity = match f.sensitivity {
                Some(s) => format!(" (sensitivity {s:.1e})"),
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "- `{}` is {}{sensitivity}: {}.",
                f.name,
                f.status.name(),
                f.note
            );
        }
    }
    let wide: Vec<String> = c
        .coefficients
        .iter()
        .filter_map(|f| {
            let (lo, hi) = f.ci95?;
            let info = Coefficients::info(f.name)?;
            ((hi - lo) > 0.25 * (info.max - info.min)).then(|| format!("`{}`", f.name))
        })
        .collect();
    if !wide.is_empty() {
        let _ = writeln!(
            out,
            "\nWide intervals (over a quarter of the range): {}. The data constrains these \
             weakly, or only in combination with others.",
            wide.join(", ")
        );
    }

    out.push_str("\n## Errors\n");
    comparison(
        &mut out,
        "In sample",
        "The fitted rows, predicted by the prior and by the fit.",
        &c.prior_in_sample,
        &c.in_sample,
    );
    if c.cross_validated.is_empty() {
        out.push_str("\n### Cross-validated\n\nSkipped.\n");
    } else {
        comparison(
            &mut out,
            "Cross-validated",
            &format!(
                "Every row predicted by a fit that did not see its job ({}-fold group \
                 cross-validation); the prior is fitted to nothing, so its figures are its \
                 in-sample ones.",
                c.folds
            ),
            &c.prior_cross_validated,
            &c.cross_validated,
        );
        breakdown_table(&mut out, &c.cross_validated_by);
    }
    if let (Some(prior), Some(fitted)) = (&c.prior_holdout, &c.holdout) {
        comparison(
            &mut out,
            "Held out",
            "Rows held out of the fit and of the cross-validation.",
            prior,
            fitted,
        );
    }
    out.push_str(
        "\nMAPE: mean |predicted - measured| / measured. Ranking figures are taken within groups \
         of rows that compete for the same job (same model, GPU count and global batch): mean \
         Spearman over groups of three or more rows, top-1 regret (the measured time of the \
         predicted-fastest row over the fastest measured, minus one) over groups of two or more; \
         n/a where a dataset has no such group.\n",
    );
    if !c.notes.is_empty() {
        out.push('\n');
        for note in &c.notes {
            let _ = writeln!(out, "- {note}");
        }
    }
    out
}

/// The cross-validated error over all rows by tensor-parallel degree, by
/// pipeline depth and by model size.
fn breakdown_table(out: &mut String, by: &[(&'static str, Vec<(String, ErrorFigures)>)]) {
    if by.is_empty() {
        return;
    }
    out.push_str(
        "\nThe same out-of-fold predictions over all rows, by tensor-parallel degree, pipeline depth and model size:\n\n\
         | by | rows | MAPE | median APE | 90th pct APE | worst row |\n|---|---:|---:|---:|---:|---|\n",
    );
    for (_, groups) in by {
        for (label, f) in groups {
            let _ = writeln!(
                out,
                "| {label} | {} | {} | {} | {} | {} |",
                f.rows,
                pct(f.mape),
                pct(f.median_ape),
                pct(f.p90_ape),
                signed_pct(f.worst_error)
            );
        }
    }
}
