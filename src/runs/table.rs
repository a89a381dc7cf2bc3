//! A run table as text: header names and cells, read with the `csv` crate.
//! Interpretation of the cells lives in the parent module.

use super::RunsError;
use std::collections::HashMap;
use std::path::Path;

/// Columns every row needs; `dp` may be derived and `seq_len` defaulted.
const REQUIRED: [&str; 7] = [
    "gpus",
    "global_batch",
    "micro_batch",
    "hidden",
    "heads",
    "layers",
    "tp",
];

#[derive(Debug, Clone)]
pub struct RunTable {
    pub path: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
    index: HashMap<String, usize>,
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
                "missing column(s) {}; the header needs at least {}, pp (and dp, seq_len, iter_ms as available)",
                missing.join(", "),
                REQUIRED.join(", ")
            )));
        }
        if !index.contains_key("pp") {
            return Err(table_error("missing column pp".into()));
        }
        let mut rows = Vec::new();
        for (i, record) in reader.records().enumerate() {
            let record = record.map_err(|e| RunsError::Row {
                path: path.to_string(),
                line: i + 2,
                message: format!("unreadable row ({e}); is the file truncated?"),
            })?;
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
        })
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
