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

/// Rows of `new` that `existing` does not already hold, for appending to a
/// run table: the headers are united (the existing ones first, then the new
/// ones), and a new row is already there when an existing row has the same
/// value in every column the new row gives. Returns the merged headers, the
/// merged rows and how many new rows were added.
pub fn merge_rows(
    existing_headers: &[String],
    existing_rows: &[Vec<String>],
    new_headers: &[String],
    new_rows: &[Vec<String>],
) -> (Vec<String>, Vec<Vec<String>>, usize) {
    let mut headers = existing_headers.to_vec();
    for h in new_headers {
        if !headers.contains(h) {
            headers.push(h.clone());
        }
    }
    let widen = |source_headers: &[String], row: &[String]| -> Vec<String> {
        headers
            .iter()
            .map(|h| {
                source_headers
                    .iter()
                    .position(|s| s == h)
                    .and_then(|i| row.get(i).cloned())
                    .unwrap_or_default()
            })
            .collect()
    };
    let mut rows: Vec<Vec<String>> = existing_rows
        .iter()
        .map(|r| widen(existing_headers, r))
        .collect();
    let mut added = 0;
    for row in new_rows {
        let wide = widen(new_headers, row);
        // A row is already there when it agrees on every column both
        // tables have: a column the table appended to lacks says nothing
        // (a row written before it existed is the same run).
        let shared: Vec<usize> = new_headers
            .iter()
            .filter(|h| existing_headers.contains(h))
            .filter_map(|h| headers.iter().position(|x| x == h))
            .collect();
        let present = !shared.is_empty()
            && rows
                .iter()
                .any(|old| shared.iter().all(|&i| old[i].trim() == wide[i].trim()));
        if !present {
            rows.push(wide);
            added += 1;
        }
    }
    (headers, rows, added)
}

/// Writes `rows` under `headers` to `out` as a whole new file, or, when
/// `append`, merged into the table already there by [`merge_rows`] (rows
/// already present are skipped). Returns how many rows were added.
pub fn write_rows(
    out: &Path,
    append: bool,
    headers: &[String],
    rows: &[Vec<String>],
) -> Result<usize, RunsError> {
    let (headers, all_rows, added) = if append {
        let table = RunTable::read(out)?;
        merge_rows(&table.headers, &table.rows, headers, rows)
    } else {
        (headers.to_vec(), rows.to_vec(), rows.len())
    };
    let write_error = |message: String| RunsError::Table {
        path: out.display().to_string(),
        message: format!("cannot write: {message}"),
    };
    let mut buffer = Vec::new();
    write_csv(&mut buffer, &headers, &all_rows).map_err(|e| write_error(e.to_string()))?;
    crate::atomic::write_atomically(out, &buffer).map_err(|e| write_error(e.to_string()))?;
    Ok(added)
}

#[cfg(test)]
mod tests {
    use super::merge_rows;

    #[test]
    fn merging_skips_rows_already_there_and_unites_headers() {
        let h = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let existing = h(&["gpus", "tp", "note"]);
        let rows = vec![h(&["8", "2", "mine"])];
        let new_headers = h(&["gpus", "tp", "iter_ms"]);
        let new_rows = vec![h(&["8", "2", ""]), h(&["8", "4", "100"])];
        let (headers, merged, added) = merge_rows(&existing, &rows, &new_headers, &new_rows);
        assert_eq!(headers, h(&["gpus", "tp", "note", "iter_ms"]));
        assert_eq!(added, 1);
        assert_eq!(merged[1], h(&["8", "4", "", "100"]));
    }

    /// A run appended again, now with a column the table was written
    /// without, is the same run: the new column says nothing about it.
    #[test]
    fn a_row_with_a_column_the_table_lacks_is_still_the_same_run() {
        let h = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let existing = h(&["gpus", "tp", "iter_ms"]);
        let rows = vec![h(&["8", "2", "100"])];
        let new_headers = h(&["gpus", "tp", "gated_mlp", "iter_ms"]);
        let again = vec![h(&["8", "2", "on", "100"])];
        let (headers, merged, added) = merge_rows(&existing, &rows, &new_headers, &again);
        assert_eq!(added, 0);
        assert_eq!(headers, h(&["gpus", "tp", "iter_ms", "gated_mlp"]));
        assert_eq!(merged.len(), 1);
        let other = vec![h(&["8", "4", "on", "90"])];
        assert_eq!(merge_rows(&existing, &rows, &new_headers, &other).2, 1);
        // Nothing shared: nothing can be the same run.
        let unrelated = h(&["note"]);
        assert_eq!(merge_rows(&existing, &rows, &unrelated, &[h(&["x"])]).2, 1);
    }
}
