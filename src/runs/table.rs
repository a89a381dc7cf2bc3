//! A run table as text: header names and cells, read with the `csv` crate.
//! Interpretation of the cells lives in the parent module.

use super::RunsError;
use std::collections::HashMap;
use std::path::Path;

/// Columns every row needs; `dp` may be derived, and the model's columns
/// (`hidden`, `heads`, `layers`, ...) come from the model given with the
/// table when absent.
pub(super) const REQUIRED: [&str; 5] = ["gpus", "global_batch", "micro_batch", "tp", "pp"];

#[derive(Debug, Clone)]
pub struct RunTable {
    pub path: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
    index: HashMap<String, usize>,
    /// 1-based line of each row in the file (blank lines are skipped).
    lines: Vec<usize>,
}

impl RunTable {
    pub fn read(path: &Path) -> Result<Self, RunsError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| RunsError::Read {
            path: shown.clone(),
            message: e.to_string(),
        })?;
        Self::parse(&text, &shown)
    }

    pub fn parse(text: &str, path: &str) -> Result<Self, RunsError> {
        let table_error = |message: String| RunsError::Table {
            path: path.to_string(),
            message,
        };
        if text.trim().is_empty() {
            return Err(table_error(format!(
                "the file is empty; it needs a header line with at least {} (and dp, seq_len, iter_ms as available), then one row per run",
                REQUIRED.join(", ")
            )));
        }
        let mut reader = csv::ReaderBuilder::new()
            .trim(csv::Trim::All)
            .from_reader(text.as_bytes());
        let headers: Vec<String> = reader
            .headers()
            .map_err(|e| table_error(format!("unreadable header: {e}")))?
            .iter()
            .map(str::to_string)
            .collect();
        let index: HashMap<String, usize> = headers
            .iter()
            .enumerate()
            .map(|(i, h)| (h.clone(), i))
            .collect();
        let missing: Vec<&str> = REQUIRED
            .iter()
            .copied()
            .filter(|c| !index.contains_key(*c))
            .collect();
        if !missing.is_empty() {
            return Err(table_error(format!(
                "missing column(s) {}; the header needs at least {} (and dp, seq_len, iter_ms as available)",
                missing.join(", "),
                REQUIRED.join(", ")
            )));
        }
        let mut rows = Vec::new();
        let mut lines = Vec::new();
        // Records come in file order, so one cursor counts every newline
        // once: reading stays linear in the file's size.
        let mut cursor = LineCursor::new(text);
        for (i, record) in reader.records().enumerate() {
            let record = record.map_err(|e| RunsError::Row {
                path: path.to_string(),
                line: e.position().map_or(i + 2, |p| cursor.line_at(p.byte())),
                message: match e.kind() {
                    csv::ErrorKind::UnequalLengths {
                        expected_len, len, ..
                    } => format!(
                        "{len} cell(s) where the header has {expected_len} columns; is the file truncated, or a comma missing or extra?"
                    ),
                    _ => format!("unreadable row ({e}); is the file truncated?"),
                },
            })?;
            lines.push(
                record
                    .position()
                    .map_or(i + 2, |p| cursor.line_at(p.byte())),
            );
            rows.push(record.iter().map(str::to_string).collect());
        }
        if rows.is_empty() {
            return Err(table_error("no rows after the header".into()));
        }
        Ok(RunTable {
            path: path.to_string(),
            headers,
            rows,
            index,
            lines,
        })
    }

    /// The 1-based line of row `row` in the file (the header is line 1 when
    /// nothing precedes it).
    pub fn line(&self, row: usize) -> usize {
        self.lines.get(row).copied().unwrap_or(row + 2)
    }

    /// The cell of row `row` in column `name`, if the column exists and the
    /// cell is not empty.
    pub fn cell(&self, row: usize, name: &str) -> Option<&str> {
        let column = *self.index.get(name)?;
        self.rows[row]
            .get(column)
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }
}

/// The 1-based line where a record starting at a byte offset begins, for
/// offsets that only grow. The csv crate's own line count leaves out blank
/// lines, and its offset points before the blank lines it skipped.
struct LineCursor<'t> {
    bytes: &'t [u8],
    /// Bytes counted so far and the newlines among them.
    position: usize,
    newlines: usize,
}

impl<'t> LineCursor<'t> {
    fn new(text: &'t str) -> Self {
        LineCursor {
            bytes: text.as_bytes(),
            position: 0,
            newlines: 0,
        }
    }

    fn line_at(&mut self, offset: u64) -> usize {
        let bytes = self.bytes;
        let mut start = (offset as usize).min(bytes.len());
        while start < bytes.len() && (bytes[start] == b'\n' || bytes[start] == b'\r') {
            start += 1;
        }
        if start < self.position {
            // Not expected (offsets grow); count afresh rather than guess.
            self.position = 0;
            self.newlines = 0;
        }
        self.newlines += bytes[self.position..start]
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        self.position = start;
        1 + self.newlines
    }
}

/// Writes a table as CSV.
pub fn write_csv<W: std::io::Write>(
    out: W,
    headers: &[String],
    rows: &[Vec<String>],
) -> Result<(), csv::Error> {
    let mut writer = csv::Writer::from_writer(out);
    writer.write_record(headers)?;
    for row in rows {
        writer.write_record(row)?;
    }
    writer.flush()?;
    Ok(())
}
