//! An append-only run history: a run table (paratune's schema) that grows
//! by one row per finished trial, each row on disk before `append` returns.
//!
//! A process killed between appends loses nothing it appended. One killed
//! inside an append can leave the last line cut short (no newline); opening
//! the history again truncates that line and says so in a [`TailRepair`],
//! so the file stays a readable [`RunTable`](super::RunTable).

use super::KNOWN_COLUMNS;
use super::table::REQUIRED;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// The columns asked for are not a run table paratune can read back.
    #[error("run history {path}: {message}")]
    Columns { path: String, message: String },
    /// The file's header is not the columns asked for; `column` names the
    /// first column that differs.
    #[error("run history {path}: {message}")]
    Header {
        path: String,
        column: String,
        message: String,
    },
    /// A row that cannot be appended as one line of the table.
    #[error("run history {path}: {message}")]
    Row { path: String, message: String },
    #[error("run history {path}: cannot {action}: {message}")]
    Io {
        path: String,
        action: &'static str,
        message: String,
    },
}

/// A last line cut short by an interrupted append, removed on open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailRepair {
    pub path: String,
    /// 1-based line of the removed text.
    pub line: usize,
    /// The removed text (lossily decoded), so it can be restored by hand.
    pub dropped: String,
}

impl fmt::Display for TailRepair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 1 {
            write!(
                f,
                "{}: the header was cut short by an interrupted write (`{}`); it has been written again",
                self.path, self.dropped
            )
        } else {
            write!(
                f,
                "{} line {}: removed a row cut short by an interrupted write (`{}`); the complete rows before it are kept",
                self.path, self.line, self.dropped
            )
        }
    }
}

/// A run table open for appending, one durable row at a time.
#[derive(Debug)]
pub struct RunHistory {
    path: PathBuf,
    file: File,
    columns: Vec<String>,
    /// Bytes in the file after the last complete append.
    len: u64,
}

impl RunHistory {
    /// Opens the history at `path` with `columns` (a run table header:
    /// paratune's required columns, optional known ones, and any of the
    /// caller's own). An absent or empty file is created with the header;
    /// an existing one must have exactly these columns in this order. A
    /// last line cut short by a crash is truncated and reported.
    pub fn open(path: &Path, columns: &[&str]) -> Result<(Self, Option<TailRepair>), HistoryError> {
        check_columns(&path.display().to_string(), columns)?;
        Self::open_table(path, columns)
    }

    /// Like [`open`](Self::open) for any table of the caller's own columns
    /// (not a run table: e.g. `validate`'s per-stage trial history).
    pub fn open_table(
        path: &Path,
        columns: &[&str],
    ) -> Result<(Self, Option<TailRepair>), HistoryError> {
        let shown = path.display().to_string();
        let header = encode(columns.iter().copied()).map_err(|message| HistoryError::Columns {
            path: shown.clone(),
            message,
        })?;
        let io = |action: &'static str| {
            let shown = shown.clone();
            move |e: std::io::Error| HistoryError::Io {
                path: shown,
                action,
                message: e.to_string(),
            }
        };

        let existing = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io("read it")(e)),
        };
        // Bytes up to and including the last newline: the complete lines.
        let complete = existing
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        let tail = &existing[complete..];
        let mut repair = None;
        if complete == 0 {
            // No complete line: a new file, or a header cut short.
            if !tail.is_empty() {
                if !header.as_bytes().starts_with(tail) {
                    check_header(&shown, tail, columns)?;
                }
                repair = Some(TailRepair {
                    path: shown.clone(),
                    line: 1,
                    dropped: String::from_utf8_lossy(tail).into_owned(),
                });
            }
            crate::atomic::write_atomically(path, header.as_bytes()).map_err(io("create it"))?;
            sync_parent(path);
        } else {
            let first_line_end = existing.iter().position(|&b| b == b'\n').unwrap_or(0);
            check_header(&shown, &existing[..first_line_end], columns)?;
            if !tail.is_empty() {
                let file = OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map_err(io("open it to repair its last line"))?;
                file.set_len(complete as u64)
                    .and_then(|()| file.sync_data())
                    .map_err(io("truncate its cut-short last line"))?;
                repair = Some(TailRepair {
                    path: shown.clone(),
                    line: 1 + existing[..complete].iter().filter(|&&b| b == b'\n').count(),
                    dropped: String::from_utf8_lossy(tail).into_owned(),
                });
            }
        }

        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(io("open it for appending"))?;
        let len = file.metadata().map_err(io("read its size"))?.len();
        Ok((
            RunHistory {
                path: path.to_path_buf(),
                file,
                columns: columns.iter().map(|c| c.to_string()).collect(),
                len,
            },
            repair,
        ))
    }

    /// Like [`open`](Self::open), but a history written with one of
    /// `older` (earlier versions of `columns`, each of its columns one of
    /// them) is first rewritten with `columns`: every cell under its
    /// column's name, the columns it lacked empty (a run table's default),
    /// its cut-short last line removed and reported as `open` does. The
    /// third value says whether it was rewritten.
    pub fn open_upgrading(
        path: &Path,
        columns: &[&str],
        older: &[&[&str]],
    ) -> Result<(Self, Option<TailRepair>, bool), HistoryError> {
        check_columns(&path.display().to_string(), columns)?;
        let header = std::fs::read(path).ok().and_then(|bytes| {
            let end = bytes.iter().position(|&b| b == b'\n')?;
            let mut reader = csv::ReaderBuilder::new()
                .has_headers(false)
                .trim(csv::Trim::All)
                .from_reader(&bytes[..end]);
            let record = reader.records().next()?.ok()?;
            Some(record.iter().map(str::to_string).collect::<Vec<_>>())
        });
        let Some(old) = header.and_then(|h| {
            older
                .iter()
                .find(|o| o.len() == h.len() && o.iter().zip(&h).all(|(a, b)| a == b))
                .copied()
                .filter(|o| o.iter().all(|c| columns.contains(c)))
        }) else {
            let (history, repair) = Self::open(path, columns)?;
            return Ok((history, repair, false));
        };
        // Opened with its own columns first, so a cut-short line is repaired.
        let (opened, repair) = Self::open_table(path, old)?;
        drop(opened);
        let shown = path.display().to_string();
        let bad = |message: String| HistoryError::Header {
            path: shown.clone(),
            column: String::new(),
            message,
        };
        let text = std::fs::read(path).map_err(|e| bad(format!("cannot read it again: {e}")))?;
        let mut reader = csv::ReaderBuilder::new()
            .trim(csv::Trim::All)
            .from_reader(text.as_slice());
        let mut out = encode(columns.iter().copied()).map_err(&bad)?;
        for record in reader.records() {
            let record = record.map_err(|e| bad(format!("a row does not read ({e})")))?;
            let cells = columns.iter().map(|c| {
                old.iter()
                    .position(|o| o == c)
                    .and_then(|i| record.get(i))
                    .unwrap_or("")
            });
            out.push_str(&encode(cells).map_err(&bad)?);
        }
        crate::atomic::write_atomically(path, out.as_bytes()).map_err(|e| HistoryError::Io {
            path: shown.clone(),
            action: "rewrite it with the new columns",
            message: e.to_string(),
        })?;
        sync_parent(path);
        let (history, _) = Self::open(path, columns)?;
        Ok((history, repair, true))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Appends one row (a cell per column, empty for none) and returns only
    /// once it is on disk (`sync_data`). A row that cannot be one line of
    /// the table is refused and nothing is written; a failed write is rolled
    /// back where the file allows it.
    pub fn append(&mut self, row: &[String]) -> Result<(), HistoryError> {
        let shown = || self.path.display().to_string();
        if row.len() != self.columns.len() {
            return Err(HistoryError::Row {
                path: shown(),
                message: format!(
                    "a row needs {} cells ({}), this one has {}",
                    self.columns.len(),
                    self.columns.join(", "),
                    row.len()
                ),
            });
        }
        if let Some((i, _)) = row
            .iter()
            .enumerate()
            .find(|(_, c)| c.contains(['\n', '\r']))
        {
            return Err(HistoryError::Row {
                path: shown(),
                message: format!(
                    "the cell for column `{}` holds a line break; a row must stay on one line",
                    self.columns[i]
                ),
            });
        }
        let line = encode(row.iter().map(String::as_str)).map_err(|message| HistoryError::Row {
            path: shown(),
            message,
        })?;
        let written = self
            .file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.sync_data());
        if let Err(e) = written {
            // Leave no half line for the next append to run into.
            let _ = self.file.set_len(self.len);
            return Err(HistoryError::Io {
                path: shown(),
                action: "append a row",
                message: e.to_string(),
            });
        }
        self.len += line.len() as u64;
        Ok(())
    }
}

/// One CSV line, newline-terminated.
fn encode<'a>(cells: impl Iterator<Item = &'a str>) -> Result<String, String> {
    let mut writer = csv::WriterBuilder::new()
        .terminator(csv::Terminator::Any(b'\n'))
        .from_writer(Vec::new());
    writer.write_record(cells).map_err(|e| e.to_string())?;
    let bytes = writer.into_inner().map_err(|e| e.error().to_string())?;
    String::from_utf8(bytes).map_err(|e| e.to_string())
}

/// The columns must make a run table that reads back: paratune's required
/// columns present, no name twice, none a typo of a known column.
fn check_columns(path: &str, columns: &[&str]) -> Result<(), HistoryError> {
    let error = |message: String| HistoryError::Columns {
        path: path.to_string(),
        message,
    };
    let missing: Vec<&str> = REQUIRED
        .iter()
        .copied()
        .filter(|r| !columns.contains(r))
        .collect();
    if !missing.is_empty() {
        return Err(error(format!(
            "the columns lack {}; a run table needs at least {}",
            missing.join(", "),
            REQUIRED.join(", ")
        )));
    }
    for (i, column) in columns.iter().enumerate() {
        if column.trim().is_empty() || column.trim() != *column {
            return Err(error(format!(
                "column {} is `{column}`; names must be non-empty without surrounding spaces",
                i + 1
            )));
        }
        if columns[..i].contains(column) {
            return Err(error(format!("column `{column}` is given twice")));
        }
        if !KNOWN_COLUMNS.contains(column)
            && let Some(known) = KNOWN_COLUMNS
                .iter()
                .find(|k| crate::suggest::edit_distance(column, k) <= 2)
        {
            return Err(error(format!(
                "unknown column `{column}` is too close to paratune's `{known}`; the table would not read back"
            )));
        }
    }
    Ok(())
}

/// The file's first line must be exactly `columns`.
fn check_header(path: &str, line: &[u8], columns: &[&str]) -> Result<(), HistoryError> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .trim(csv::Trim::All)
        .from_reader(line);
    let found: Vec<String> = match reader.records().next() {
        Some(Ok(record)) => record.iter().map(str::to_string).collect(),
        Some(Err(e)) => {
            return Err(HistoryError::Header {
                path: path.to_string(),
                column: String::new(),
                message: format!(
                    "the header is unreadable ({e}); give a new history file for these runs"
                ),
            });
        }
        None => Vec::new(),
    };
    let fix = "use a new history file for these columns, or the columns the file has";
    for i in 0..found.len().max(columns.len()) {
        let (have, want) = (found.get(i), columns.get(i));
        if have.map(String::as_str) == want.copied() {
            continue;
        }
        let (column, message) = match (have, want) {
            (Some(have), Some(want)) => (
                want.to_string(),
                format!(
                    "column {} of the header is `{have}` where this run writes `{want}`; {fix}",
                    i + 1
                ),
            ),
            (None, Some(want)) => (
                want.to_string(),
                format!("the header lacks column `{want}` (column {}); {fix}", i + 1),
            ),
            (Some(have), None) => (
                have.clone(),
                format!(
                    "the header has column `{have}` (column {}) that this run does not write; {fix}",
                    i + 1
                ),
            ),
            (None, None) => unreachable!("i is below the longer length"),
        };
        return Err(HistoryError::Header {
            path: path.to_string(),
            column,
            message,
        });
    }
    Ok(())
}

/// Makes a newly created file's name durable too. Best effort: not every
/// platform can open a folder for syncing, and the rows' own durability
/// does not depend on it.
fn sync_parent(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Recompute;
    use crate::model::AttentionKind;
    use crate::runs::{RowDefaults, RunTable, runs_from_table};

    const COLUMNS: [&str; 12] = [
        "gpus",
        "global_batch",
        "micro_batch",
        "hidden",
        "heads",
        "layers",
        "seq_len",
        "tp",
        "dp",
        "pp",
        "iter_ms",
        "note",
    ];

    fn row(tp: u64, dp: u64, iter_ms: f64, note: &str) -> Vec<String> {
        let cells = ["8", "16", "2", "1024", "16", "24", "1024"];
        let mut row: Vec<String> = cells.iter().map(|s| s.to_string()).collect();
        row.extend([
            tp.to_string(),
            dp.to_string(),
            "2".into(),
            iter_ms.to_string(),
            note.into(),
        ]);
        row
    }

    fn read_back(path: &Path) -> Vec<crate::runs::Run> {
        let table = RunTable::read(path).unwrap();
        let defaults = RowDefaults::gpt(50257, 1024, AttentionKind::Flash, Recompute::Full);
        runs_from_table(&table, &defaults, crate::runs::BaseNode::DGX_A100).unwrap()
    }

    #[test]
    fn appended_rows_are_on_disk_at_once_and_after_reopening() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("history.csv");
        let (mut history, repair) = RunHistory::open(&path, &COLUMNS).unwrap();
        assert!(repair.is_none());
        history
            .append(&row(2, 2, 219.7, "first, with a comma"))
            .unwrap();
        // Readable by another reader while the history is still open.
        assert_eq!(read_back(&path).len(), 1);
        drop(history);

        let (mut history, repair) = RunHistory::open(&path, &COLUMNS).unwrap();
        assert!(repair.is_none());
        history.append(&row(4, 1, 180.25, "")).unwrap();
        let runs = read_back(&path);
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].config.tp, runs[0].config.dp), (2, 2));
        assert!((runs[0].measured_s.unwrap() - 0.2197).abs() < 1e-12);
        assert_eq!(runs[1].config.tp, 4);
        assert_eq!(runs[1].line, 3);
        let table = RunTable::read(&path).unwrap();
        assert_eq!(table.cell(0, "note"), Some("first, with a comma"));
        assert!(std::fs::read_to_string(&path).unwrap().ends_with('\n'));
    }

    #[test]
    fn a_different_header_is_refused_naming_file_and_column() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("history.csv");
        RunHistory::open(&path, &COLUMNS).unwrap();
        let mut other = COLUMNS;
        other[11] = "trial";
        let err = RunHistory::open(&path, &other).unwrap_err();
        match &err {
            HistoryError::Header { column, .. } => assert_eq!(column, "trial"),
            e => panic!("{e}"),
        }
        let text = err.to_string();
        assert!(
            text.contains("history.csv") && text.contains("`note`") && text.contains("`trial`"),
            "{text}"
        );

        let err = RunHistory::open(&path, &COLUMNS[..11])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`note`") && err.contains("does not write"),
            "{err}"
        );
        // Nothing was changed by the refusals.
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n", COLUMNS.join(","))
        );
    }

    #[test]
    fn a_history_of_older_columns_is_rewritten_with_the_new_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("history.csv");
        // An older history, written before the `dp` column.
        let older: Vec<&str> = COLUMNS.iter().copied().filter(|&c| c != "dp").collect();
        let (mut history, _) = RunHistory::open(&path, &older).unwrap();
        let mut first = row(2, 2, 219.7, "old");
        first.remove(COLUMNS.iter().position(|&c| c == "dp").unwrap());
        history.append(&first).unwrap();
        drop(history);
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(b"8,16,2,10").unwrap();
        drop(file);
        let (mut history, repair, upgraded) =
            RunHistory::open_upgrading(&path, &COLUMNS, &[&older]).unwrap();
        assert!(upgraded && repair.is_some());
        history.append(&row(4, 1, 180.25, "new")).unwrap();
        drop(history);
        let table = RunTable::read(&path).unwrap();
        assert_eq!(table.headers, COLUMNS.map(String::from).to_vec());
        assert_eq!(table.cell(0, "note"), Some("old"));
        assert_eq!(table.cell(0, "dp"), None);
        assert_eq!(table.cell(1, "dp"), Some("1"));
        assert_eq!(read_back(&path).len(), 2);
        // A current history is opened as it is; another header still refused.
        let (_, _, upgraded) = RunHistory::open_upgrading(&path, &COLUMNS, &[&older]).unwrap();
        assert!(!upgraded);
        let mut other = COLUMNS;
        other[11] = "trial";
        assert!(RunHistory::open_upgrading(&path, &other, &[&COLUMNS]).is_err());
    }

    #[test]
    fn a_row_cut_short_by_a_crash_is_removed_and_reported() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("history.csv");
        let (mut history, _) = RunHistory::open(&path, &COLUMNS).unwrap();
        history.append(&row(2, 2, 219.7, "kept")).unwrap();
        drop(history);
        // A killed append: part of a line, no newline.
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(b"8,16,2,1024,16,24,10").unwrap();
        drop(file);

        let (mut history, repair) = RunHistory::open(&path, &COLUMNS).unwrap();
        let repair = repair.expect("the cut-short row is reported");
        assert_eq!(repair.line, 3);
        assert_eq!(repair.dropped, "8,16,2,1024,16,24,10");
        let note = repair.to_string();
        assert!(
            note.contains("history.csv line 3") && note.contains("8,16,2,1024,16,24,10"),
            "{note}"
        );
        let runs = read_back(&path);
        assert_eq!(runs.len(), 1);
        history
            .append(&row(4, 1, 180.0, "after the crash"))
            .unwrap();
        assert_eq!(read_back(&path).len(), 2);
        drop(history);
        // A clean file is not reported again.
        assert!(RunHistory::open(&path, &COLUMNS).unwrap().1.is_none());
    }

    #[test]
    fn a_header_cut_short_is_written_again_and_an_empty_file_gets_one() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("history.csv");
        std::fs::write(&path, "gpus,global_ba").unwrap();
        let (_, repair) = RunHistory::open(&path, &COLUMNS).unwrap();
        assert_eq!(repair.unwrap().line, 1);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n", COLUMNS.join(","))
        );

        let empty = tmp.path().join("empty.csv");
        std::fs::write(&empty, "").unwrap();
        let (mut history, repair) = RunHistory::open(&empty, &COLUMNS).unwrap();
        assert!(repair.is_none());
        history.append(&row(2, 2, 200.0, "")).unwrap();
        assert_eq!(read_back(&empty).len(), 1);

        // A partial first line that is not this header is not ours to fix.
        let foreign = tmp.path().join("foreign.csv");
        std::fs::write(&foreign, "name,size").unwrap();
        assert!(matches!(
            RunHistory::open(&foreign, &COLUMNS),
            Err(HistoryError::Header { .. })
        ));
        assert_eq!(std::fs::read_to_string(&foreign).unwrap(), "name,size");
    }

    #[test]
    fn columns_and_rows_that_would_not_read_back_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("history.csv");
        let err = RunHistory::open(&path, &["gpus", "tp"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("lack") && err.contains("global_batch"),
            "{err}"
        );
        let mut typo = COLUMNS;
        typo[11] = "iter_m";
        let err = RunHistory::open(&path, &typo).unwrap_err().to_string();
        assert!(
            err.contains("`iter_m`") && err.contains("`iter_ms`"),
            "{err}"
        );
        let mut twice = COLUMNS;
        twice[11] = "tp";
        assert!(RunHistory::open(&path, &twice).is_err());
        assert!(!path.exists());

        let (mut history, _) = RunHistory::open(&path, &COLUMNS).unwrap();
        let short = &row(2, 2, 200.0, "")[..5];
        let err = history.append(short).unwrap_err().to_string();
        assert!(err.contains("12 cells") && err.contains("has 5"), "{err}");
        let err = history
            .append(&row(2, 2, 200.0, "two\nlines"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`note`") && err.contains("line break"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
    }
}
