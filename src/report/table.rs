//! The table of a validation: one row per trial (a candidate, or one of its
//! pipeline stages) with predicted and measured time and memory and a
//! verdict, rendered as GitHub Markdown and as CSV, and the report folder.

use super::{GIB, ReportError, format_percent, format_seconds};
use crate::atomic::write_atomically;
use std::fmt;
use std::path::{Path, PathBuf};

/// How a trial went against its prediction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// It ran within its memory and its time is inside the predicted band.
    Fits,
    /// It ran out of memory, or its measured peak is above the capacity.
    DoesNotFit,
    /// It fits, but its measured time is outside the predicted band.
    Off,
    /// The trial gave no answer: an error, a timeout, no time measured.
    Failed(String),
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Fits => f.write_str("fits"),
            Verdict::DoesNotFit => f.write_str("does not fit"),
            Verdict::Off => f.write_str("prediction off"),
            Verdict::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

/// Relative slack at the band's edges, so that a time that sits exactly on
/// an edge (and went through a decimal round trip) counts as inside.
const EDGE_TOLERANCE: f64 = 1e-9;

/// The verdict on one trial. The rules, in order:
///
/// 1. `oom`, or a measured peak above `capacity` (bytes) → [`Verdict::DoesNotFit`].
///    A peak equal to the capacity fits.
/// 2. No measured time (or one that is not a positive finite number) →
///    [`Verdict::Failed`]. A trial that errored or timed out is a
///    `Failed` with its own message; the caller builds that directly.
/// 3. With a relative band `(low, high)` (e.g. `(-0.1, 0.12)`), a measured
///    time outside `[predicted × (1 + low), predicted × (1 + high)]` →
///    [`Verdict::Off`]. The edges are inside. A prediction that is not a
///    positive finite number is off whenever there is a band.
/// 4. Otherwise [`Verdict::Fits`]. Without a band the time is not judged:
///    there is nothing to say how far off is too far.
pub fn verdict(
    predicted_s: f64,
    measured_s: Option<f64>,
    band_rel: Option<(f64, f64)>,
    measured_peak: Option<f64>,
    capacity: f64,
    oom: bool,
) -> Verdict {
    if oom || measured_peak.is_some_and(|peak| peak > capacity) {
        return Verdict::DoesNotFit;
    }
    let measured = match measured_s {
        Some(t) if t.is_finite() && t > 0.0 => t,
        Some(t) => return Verdict::Failed(format!("measured time {t} s is not a positive number")),
        None => return Verdict::Failed("no iteration time was measured".into()),
    };
    if let Some((a, b)) = band_rel {
        if !(predicted_s.is_finite() && predicted_s > 0.0) {
            return Verdict::Off;
        }
        let (low, high) = (a.min(b), a.max(b));
        let lowest = predicted_s * (1.0 + low) * (1.0 - EDGE_TOLERANCE);
        let highest = predicted_s * (1.0 + high) * (1.0 + EDGE_TOLERANCE);
        if !(lowest..=highest).contains(&measured) {
            return Verdict::Off;
        }
    }
    Verdict::Fits
}

/// One trial: a candidate, or one pipeline stage of it.
#[derive(Debug, Clone, PartialEq)]
pub struct TrialRow {
    /// The candidate's 1-based rank in the plan.
    pub candidate: usize,
    /// A short label of its configuration, e.g. `tp2 pp4 dp1 mb2 1f1b`.
    pub config: String,
    /// The pipeline stage the memory figures are for, if per stage.
    pub stage: Option<u64>,
    pub predicted_s: f64,
    pub measured_s: Option<f64>,
    /// The predicted band relative to `predicted_s`, e.g. `(-0.1, 0.12)`.
    pub band_rel: Option<(f64, f64)>,
    pub predicted_peak_bytes: f64,
    pub measured_peak_bytes: Option<f64>,
    pub capacity_bytes: f64,
    pub verdict: Verdict,
}

impl TrialRow {
    /// measured / predicted − 1, when both exist.
    pub fn error_rel(&self) -> Option<f64> {
        let measured = self.measured_s?;
        (self.predicted_s > 0.0).then(|| measured / self.predicted_s - 1.0)
    }
}

const NONE: &str = "—";

/// A cell that cannot break the table: no pipes, no line breaks.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace(['\n', '\r'], " ")
}

fn gib(bytes: f64) -> String {
    format!("{:.2}", bytes / GIB)
}

/// The trials as a GitHub Markdown table. Times are in ms or s, memory in
/// GiB, error is measured / predicted − 1.
pub fn markdown_table(rows: &[TrialRow]) -> String {
    let mut out = String::from(
        "| # | config | stage | predicted | measured | error | band | predicted peak (GiB) | measured peak (GiB) | capacity (GiB) | verdict |\n\
         |--:|---|--:|--:|--:|--:|--:|--:|--:|--:|---|\n",
    );
    if rows.is_empty() {
        out.push_str(&format!("| {NONE} | no trials | | | | | | | | | |\n"));
        return out;
    }
    for row in rows {
        let cells = [
            row.candidate.to_string(),
            cell(&row.config),
            row.stage.map_or(NONE.into(), |s| s.to_string()),
            format_seconds(row.predicted_s),
            row.measured_s.map_or(NONE.into(), format_seconds),
            row.error_rel().map_or(NONE.into(), format_percent),
            row.band_rel.map_or(NONE.into(), |(low, high)| {
                format!("{} … {}", format_percent(low), format_percent(high))
            }),
            gib(row.predicted_peak_bytes),
            row.measured_peak_bytes.map_or(NONE.into(), gib),
            gib(row.capacity_bytes),
            cell(&row.verdict.to_string()),
        ];
        out.push_str("| ");
        out.push_str(&cells.join(" | "));
        out.push_str(" |\n");
    }
    out
}

/// Columns of `trials.csv`: times in seconds, memory in bytes, relative
/// figures as fractions; empty where there is no value.
pub const CSV_COLUMNS: [&str; 13] = [
    "candidate",
    "config",
    "stage",
    "predicted_s",
    "measured_s",
    "error_rel",
    "band_low_rel",
    "band_high_rel",
    "predicted_peak_bytes",
    "measured_peak_bytes",
    "capacity_bytes",
    "verdict",
    "detail",
];

/// The trials as CSV (see [`CSV_COLUMNS`]). The verdict column holds
/// `fits`, `does not fit`, `prediction off` or `failed`, and `detail` the
/// failure's message.
pub fn csv_table(rows: &[TrialRow]) -> Result<String, ReportError> {
    let csv_error = |e: csv::Error| ReportError::Csv(e.to_string());
    let mut writer = csv::Writer::from_writer(Vec::new());
    writer.write_record(CSV_COLUMNS).map_err(csv_error)?;
    let opt = |v: Option<f64>| v.map_or(String::new(), |v| v.to_string());
    for row in rows {
        let (verdict, detail) = match &row.verdict {
            Verdict::Failed(why) => ("failed".to_string(), why.clone()),
            other => (other.to_string(), String::new()),
        };
        writer
            .write_record([
                row.candidate.to_string(),
                row.config.clone(),
                row.stage.map_or(String::new(), |s| s.to_string()),
                row.predicted_s.to_string(),
                opt(row.measured_s),
                opt(row.error_rel()),
                opt(row.band_rel.map(|b| b.0)),
                opt(row.band_rel.map(|b| b.1)),
                row.predicted_peak_bytes.to_string(),
                opt(row.measured_peak_bytes),
                row.capacity_bytes.to_string(),
                verdict,
                detail,
            ])
            .map_err(csv_error)?;
    }
    let bytes = writer
        .into_inner()
        .map_err(|e| ReportError::Csv(e.error().to_string()))?;
    String::from_utf8(bytes).map_err(|e| ReportError::Csv(e.to_string()))
}

/// Where [`write_report`] put the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportPaths {
    pub dir: PathBuf,
    /// `DIR/report.md`: summary, table, links to the rest.
    pub report: PathBuf,
    /// `DIR/trials.csv`.
    pub trials_csv: PathBuf,
    /// `DIR/memory.svg`.
    pub memory_svg: PathBuf,
    /// `DIR/time.svg`.
    pub time_svg: PathBuf,
}

/// Writes the report folder `dir` (created if absent): `memory.svg`,
/// `time.svg`, `trials.csv` and, last, `report.md` titled `name` with the
/// summary, the table and links to the others. Each file is written
/// atomically, so a reader never sees half of one; a `report.md` that
/// exists refers to files that exist.
pub fn write_report(
    dir: &Path,
    name: &str,
    rows: &[TrialRow],
    memory_svg: &str,
    time_svg: &str,
    summary_markdown: &str,
) -> Result<ReportPaths, ReportError> {
    if dir.exists() && !dir.is_dir() {
        return Err(ReportError::Write {
            path: dir.display().to_string(),
            message: "it is a file, not a folder".into(),
            fix: "give a folder for the report (it is created if absent)".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| ReportError::Write {
        path: dir.display().to_string(),
        message: format!("cannot create the report folder ({e})"),
        fix: "give a folder you can write to, or fix the permissions of its parent".into(),
    })?;
    let paths = ReportPaths {
        dir: dir.to_path_buf(),
        report: dir.join("report.md"),
        trials_csv: dir.join("trials.csv"),
        memory_svg: dir.join("memory.svg"),
        time_svg: dir.join("time.svg"),
    };
    let csv = csv_table(rows)?;
    let report = render_report(name, rows, summary_markdown);
    for (path, text) in [
        (&paths.memory_svg, memory_svg),
        (&paths.time_svg, time_svg),
        (&paths.trials_csv, csv.as_str()),
        (&paths.report, report.as_str()),
    ] {
        write_atomically(path, text.as_bytes()).map_err(|e| ReportError::Write {
            path: path.display().to_string(),
            message: e.to_string(),
            fix: "check that the folder is writable and the disk is not full".into(),
        })?;
    }
    Ok(paths)
}

fn render_report(name: &str, rows: &[TrialRow], summary_markdown: &str) -> String {
    let mut out = format!("# {name}\n\n");
    let summary = summary_markdown.trim();
    if !summary.is_empty() {
        out.push_str(summary);
        out.push_str("\n\n");
    }
    out.push_str("## Trials\n\n");
    out.push_str(&markdown_table(rows));
    out.push_str(
        "\nerror = measured / predicted − 1; band = the predicted range of the time, relative to the prediction.\n\n\
         ## Charts\n\n\
         ![Memory per stage against the capacity](memory.svg)\n\n\
         ![Iteration time per candidate, predicted with its band and measured](time.svg)\n\n\
         Files: [memory.svg](memory.svg), [time.svg](time.svg), [trials.csv](trials.csv).\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: f64 = 80.0 * GIB;

    fn row(candidate: usize, measured_s: Option<f64>, verdict: Verdict) -> TrialRow {
        TrialRow {
            candidate,
            config: "tp2 pp4 | mb2".into(),
            stage: Some(0),
            predicted_s: 0.4,
            measured_s,
            band_rel: Some((-0.1, 0.12)),
            predicted_peak_bytes: 60.0 * GIB,
            measured_peak_bytes: measured_s.map(|_| 62.0 * GIB),
            capacity_bytes: CAP,
            verdict,
        }
    }

    #[test]
    fn verdicts_are_displayed_in_words() {
        assert_eq!(Verdict::Fits.to_string(), "fits");
        assert_eq!(Verdict::DoesNotFit.to_string(), "does not fit");
        assert_eq!(Verdict::Off.to_string(), "prediction off");
        assert_eq!(
            Verdict::Failed("timed out after 600 s".into()).to_string(),
            "failed: timed out after 600 s"
        );
    }

    #[test]
    fn out_of_memory_or_a_peak_above_capacity_does_not_fit() {
        let band = Some((-0.1, 0.1));
        assert_eq!(
            verdict(1.0, None, band, None, CAP, true),
            Verdict::DoesNotFit
        );
        assert_eq!(
            verdict(1.0, Some(1.0), band, Some(CAP + 1.0), CAP, false),
            Verdict::DoesNotFit
        );
        // Exactly at capacity fits; memory is judged before time.
        assert_eq!(
            verdict(1.0, Some(1.0), band, Some(CAP), CAP, false),
            Verdict::Fits
        );
        assert_eq!(
            verdict(1.0, Some(5.0), band, None, CAP, true),
            Verdict::DoesNotFit
        );
    }

    #[test]
    fn no_usable_measured_time_is_a_failure() {
        assert!(matches!(
            verdict(1.0, None, None, None, CAP, false),
            Verdict::Failed(_)
        ));
        assert!(matches!(
            verdict(1.0, Some(f64::NAN), None, None, CAP, false),
            Verdict::Failed(_)
        ));
        assert!(matches!(
            verdict(1.0, Some(0.0), None, None, CAP, false),
            Verdict::Failed(_)
        ));
    }

    #[test]
    fn the_band_edges_are_inside_and_just_beyond_them_is_off() {
        let (p, band) = (0.4, (-0.1, 0.12));
        let high = p * (1.0 + band.1);
        let low = p * (1.0 + band.0);
        let v = |t: f64| verdict(p, Some(t), Some(band), None, CAP, false);
        assert_eq!(v(p), Verdict::Fits);
        assert_eq!(v(high), Verdict::Fits);
        assert_eq!(v(low), Verdict::Fits);
        // The same edges after a decimal round trip (a CSV cell).
        assert_eq!(v(format!("{high:.6}").parse().unwrap()), Verdict::Fits);
        assert_eq!(v(high * (1.0 + 1e-6)), Verdict::Off);
        assert_eq!(v(low * (1.0 - 1e-6)), Verdict::Off);
        assert_eq!(v(2.0 * p), Verdict::Off);
        // A band given upside down means the same band.
        assert_eq!(
            verdict(p, Some(high), Some((band.1, band.0)), None, CAP, false),
            Verdict::Fits
        );
        // Without a band the time is not judged.
        assert_eq!(
            verdict(p, Some(10.0 * p), None, None, CAP, false),
            Verdict::Fits
        );
        // A broken prediction with a band is off.
        assert_eq!(
            verdict(f64::NAN, Some(p), Some(band), None, CAP, false),
            Verdict::Off
        );
    }

    #[test]
    fn the_markdown_table_has_a_line_per_row_with_error_and_gib() {
        let rows = [
            row(1, Some(0.42), Verdict::Fits),
            row(2, None, Verdict::Failed("timed out".into())),
        ];
        let md = markdown_table(&rows);
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(lines.len(), 2 + 2, "{md}");
        assert!(lines[0].starts_with("| # | config |"));
        let first = lines[2];
        assert!(
            first.contains("400.0 ms") && first.contains("420.0 ms"),
            "{first}"
        );
        assert!(first.contains("+5.0%"), "{first}");
        assert!(first.contains("-10.0% … +12.0%"), "{first}");
        assert!(first.contains("60.00") && first.contains("62.00") && first.contains("80.00"));
        assert!(first.contains("tp2 pp4 \\| mb2"), "{first}");
        assert!(first.ends_with("| fits |"), "{first}");
        assert!(lines[3].contains("failed: timed out") && lines[3].contains("—"));
        // Every line has the same number of cells.
        let cells = |l: &str| l.replace("\\|", "").matches('|').count();
        assert!(lines.iter().all(|l| cells(l) == cells(lines[0])), "{md}");

        let empty = markdown_table(&[]);
        assert!(empty.contains("no trials"));
    }

    #[test]
    fn the_csv_reads_back_with_raw_numbers() {
        let rows = [
            row(1, Some(0.42), Verdict::Off),
            row(2, None, Verdict::Failed("CUDA error, out of range".into())),
        ];
        let text = csv_table(&rows).unwrap();
        let mut reader = csv::Reader::from_reader(text.as_bytes());
        assert_eq!(reader.headers().unwrap().len(), CSV_COLUMNS.len());
        let records: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
        assert_eq!(records.len(), 2);
        assert_eq!(&records[0][1], "tp2 pp4 | mb2");
        assert_eq!(records[0][4].parse::<f64>().unwrap(), 0.42);
        assert!((records[0][5].parse::<f64>().unwrap() - 0.05).abs() < 1e-12);
        assert_eq!(&records[0][11], "prediction off");
        assert_eq!(&records[1][4], "");
        assert_eq!(&records[1][11], "failed");
        assert_eq!(&records[1][12], "CUDA error, out of range");
    }

    #[test]
    fn the_report_folder_holds_four_files_and_links_them() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("validate").join("run1");
        let rows = [row(1, Some(0.42), Verdict::Fits)];
        let paths = write_report(
            &dir,
            "Validation of gpt-1.3b",
            &rows,
            "<svg>m</svg>",
            "<svg>t</svg>",
            "Two of two fit.\n",
        )
        .unwrap();
        assert_eq!(paths.report, dir.join("report.md"));
        let report = std::fs::read_to_string(&paths.report).unwrap();
        assert!(report.starts_with("# Validation of gpt-1.3b\n\nTwo of two fit.\n"));
        for link in ["(memory.svg)", "(time.svg)", "(trials.csv)", "| fits |"] {
            assert!(report.contains(link), "missing {link} in {report}");
        }
        assert_eq!(
            std::fs::read_to_string(&paths.memory_svg).unwrap(),
            "<svg>m</svg>"
        );
        assert_eq!(
            std::fs::read_to_string(&paths.time_svg).unwrap(),
            "<svg>t</svg>"
        );
        let csv = std::fs::read_to_string(&paths.trials_csv).unwrap();
        assert_eq!(csv.lines().count(), 2);
        // Writing again replaces the files.
        write_report(&dir, "again", &rows, "<svg/>", "<svg/>", "").unwrap();
        assert!(
            std::fs::read_to_string(&paths.report)
                .unwrap()
                .starts_with("# again\n\n## Trials")
        );
    }

    #[test]
    fn an_unwritable_folder_is_named_with_the_fix() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("taken");
        std::fs::write(&file, "x").unwrap();
        let err = write_report(&file, "r", &[], "", "", "").unwrap_err();
        assert!(matches!(err, ReportError::Write { .. }));
        let text = err.to_string();
        assert!(
            text.contains("taken") && text.contains("not a folder"),
            "{text}"
        );

        // Below a file no folder can be created (also as root).
        let below = file.join("report");
        let text = write_report(&below, "r", &[], "", "", "")
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("taken/report") && text.contains("give a folder you can write to"),
            "{text}"
        );
    }
}
