//! The report of `paratune validate`: predicted against measured trials as
//! SVG charts ([`charts`]), a Markdown and CSV table with a verdict per trial
//! ([`table`]), and what a refit changed in the ranking ([`diff`]).
//!
//! Everything here is pure apart from [`table::write_report`], which writes
//! the report folder atomically; nothing prints to the terminal.

pub mod charts;
pub mod diff;
pub mod table;

pub use charts::{CandidateTime, StageMemoryBar, memory_chart, time_chart};
pub use diff::{Move, RankingChange, ranking_change, render_markdown};
pub use table::{ReportPaths, TrialRow, Verdict, csv_table, markdown_table, verdict, write_report};

/// Bytes in a GiB: memory in charts and tables is shown in GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("the {chart} chart has nothing to draw: {what}")]
    Empty { chart: &'static str, what: String },
    #[error("the {chart} chart cannot draw `{label}`: its {field} is {value}, not a finite number")]
    NotFinite {
        chart: &'static str,
        label: String,
        field: &'static str,
        value: f64,
    },
    #[error("the {chart} chart cannot draw `{label}`: {message}")]
    Invalid {
        chart: &'static str,
        label: String,
        message: String,
    },
    #[error("drawing the {chart} chart failed: {message}")]
    Draw {
        chart: &'static str,
        message: String,
    },
    #[error("cannot render the trials as CSV: {0}")]
    Csv(String),
    #[error("cannot write {path}: {message}; {fix}")]
    Write {
        path: String,
        message: String,
        fix: String,
    },
    #[error("the {which} ranking lists `{label}` twice; each candidate needs its own label")]
    DuplicateLabel { which: &'static str, label: String },
}

/// A time in the unit that suits it: `850.0 ms`, `1.234 s`.
pub(crate) fn format_seconds(s: f64) -> String {
    if !s.is_finite() {
        format!("{s}")
    } else if s.abs() < 1.0 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{s:.3} s")
    }
}

/// A relative change as a signed percentage: `+3.2%`, `-10.0%`.
pub(crate) fn format_percent(rel: f64) -> String {
    format!("{:+.1}%", rel * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_changes_are_formatted_in_their_unit() {
        assert_eq!(format_seconds(0.2197), "219.7 ms");
        assert_eq!(format_seconds(1.5), "1.500 s");
        assert_eq!(format_percent(0.032), "+3.2%");
        assert_eq!(format_percent(-0.1), "-10.0%");
    }
}
