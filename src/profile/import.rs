//! Turning measurements into profile points: nccl-tests logs, the
//! nccl-tests-style reference table, and Korthikanti et al.'s layer table.
//! Parsing is pure (text in, points out); [`read_text`] is the one reader.

use super::{
    CollectiveOp, CollectivePoint, LayerArch, LayerPoint, LayerStatus, ProfileError, SyncPoint,
    TokenPoint,
};
use crate::choice::Choice;
use crate::config::Recompute;
use std::path::Path;

/// Reads an input file to import, with a typed error naming it.
pub fn read_text(path: &Path) -> Result<String, ProfileError> {
    std::fs::read_to_string(path).map_err(|cause| ProfileError::Read {
        path: path.display().to_string(),
        cause,
    })
}

/// What an nccl-tests log says.
#[derive(Debug, Clone, PartialEq)]
pub struct NcclLog {
    /// The collective, from `# Collective test starting: X_perf` or the
    /// file name, if either says.
    pub op: Option<CollectiveOp>,
    /// Ranks, counted from the `#  Rank  N Group ...` device lines.
    pub ranks: Option<u64>,
    /// The device of rank 0 as the log names it (e.g. `NVIDIA A100-SXM4-80GB`).
    pub device: Option<String>,
    /// (bytes, out-of-place seconds, out-of-place bus bandwidth GB/s).
    pub rows: Vec<(f64, f64, f64)>,
    /// The log ends before nccl-tests' closing `# Avg bus bandwidth` line
    /// (the run was cut short); the complete rows before the cut are kept.
    pub truncated: bool,
    /// Rows dropped because nccl-tests counted wrong results (`#wrong` > 0).
    pub wrong_rows: usize,
    /// Rows dropped because their size or time is 0 (nccl-tests prints
    /// zero-size rows with no meaningful time).
    pub zero_rows: usize,
}

impl NcclLog {
    /// The log's rows as points of `op` over `ranks` GPUs.
    pub fn points(&self, op: CollectiveOp, ranks: u64) -> Vec<CollectivePoint> {
        self.rows
            .iter()
            .map(|&(bytes, seconds, busbw)| CollectivePoint {
                op,
                ranks,
                bytes,
                seconds,
                busbw,
            })
            .collect()
    }
}

/// Strips an MPI launcher's output prefix such as `[1,0]<stdout>:`.
fn strip_launcher_prefix(line: &str) -> &str {
    let trimmed = line.trim_start();
    if trimmed.starts_with('[')
        && let Some(end) = trimmed.find(">:")
        && trimmed[..end].contains("]<")
    {
        return &trimmed[end + 2..];
    }
    line
}

fn op_from_text(text: &str) -> Option<CollectiveOp> {
    let t = text.to_lowercase();
    // reduce_scatter before all_reduce's "reduce"; sendrecv before others.
    [
        ("reduce_scatter", CollectiveOp::ReduceScatter),
        ("all_gather", CollectiveOp::AllGather),
        ("all_reduce", CollectiveOp::AllReduce),
        ("sendrecv", CollectiveOp::SendRecv),
    ]
    .into_iter()
    .find(|(name, _)| t.contains(name))
    .map(|(_, op)| op)
}

/// Parses nccl-tests' standard output (`all_reduce_perf` and its siblings).
///
/// The table has an out-of-place and an in-place half,
/// `size count type redop root time algbw busbw #wrong time algbw busbw #wrong`
/// (older versions lack `redop`/`root` or say `error` for `#wrong`); the
/// column header is read when present so either layout parses, and the
/// out-of-place time and bus bandwidth are kept. Lines starting with `#` are
/// comments (the header, the device list, `# Avg bus bandwidth`); other
/// lines that do not start with a size (NCCL INFO lines, warnings) are
/// skipped. An incomplete last row of a log cut short is dropped and the log
/// marked truncated; an incomplete row in the middle is an error.
pub fn parse_nccl_tests(text: &str, path: &str) -> Result<NcclLog, ProfileError> {
    let file_name = Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let mut log = NcclLog {
        op: None,
        ranks: None,
        device: None,
        rows: Vec::new(),
        truncated: true,
        wrong_rows: 0,
        zero_rows: 0,
    };
    let mut ranks = 0u64;
    // Column positions: size, time, busbw, #wrong of the out-of-place half,
    // and how many columns a complete row has.
    let mut columns = (0usize, 5usize, 7usize, Some(8usize), 13usize);
    let mut pending_incomplete: Option<usize> = None;
    for (index, raw) in text.lines().enumerate() {
        let number = index + 1;
        let line = strip_launcher_prefix(raw).trim();
        if line.is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let comment = comment.trim();
            let words: Vec<&str> = comment.split_whitespace().collect();
            if let Some(rest) = comment.strip_prefix("Collective test starting:") {
                log.op = op_from_text(rest).or(log.op);
            } else if words.first() == Some(&"Rank") && comment.contains(" device ") {
                ranks += 1;
                if log.device.is_none()
                    && let Some(close) = comment.rfind(']')
                {
                    let device = comment[close + 1..].trim();
                    if !device.is_empty() {
                        log.device = Some(device.to_string());
                    }
                }
            } else if words.contains(&"size") && words.contains(&"busbw") {
                let header: Vec<&str> = words.clone();
                let find = |name: &str| header.iter().position(|w| *w == name);
                if let (Some(size), Some(time), Some(busbw)) =
                    (find("size"), find("time"), find("busbw"))
                {
                    let wrong = header[busbw + 1..]
                        .first()
                        .filter(|w| **w == "#wrong" || **w == "error")
                        .map(|_| busbw + 1);
                    columns = (size, time, busbw, wrong, header.len());
                }
            } else if comment.starts_with("Avg bus bandwidth") {
                log.truncated = false;
            }
            continue;
        }
        let cells: Vec<&str> = line.split_whitespace().collect();
        // A result row starts with its size; NCCL INFO lines, warnings and
        // the launcher's chatter do not start with a digit.
        if !cells
            .first()
            .is_some_and(|c| c.starts_with(|ch: char| ch.is_ascii_digit()))
        {
            continue;
        }
        if let Some(previous) = pending_incomplete {
            return Err(ProfileError::Line {
                path: path.to_string(),
                line: previous,
                message: "incomplete row in the middle of the table".into(),
            });
        }
        let (size_at, time_at, busbw_at, wrong_at, width) = columns;
        if cells.len() < width {
            // A log cut short ends with half a row; anywhere else it is an error.
            pending_incomplete = Some(number);
            continue;
        }
        let bytes = cells[size_at]
            .parse::<u64>()
            .ok()
            .filter(|&b| b as f64 <= super::MAX_COLLECTIVE_BYTES)
            .ok_or_else(|| ProfileError::Line {
                path: path.to_string(),
                line: number,
                message: format!(
                    "the size must be a whole number of bytes up to 1 TiB, found `{}`",
                    cells[size_at]
                ),
            })?;
        let real = |at: usize, what: &str| -> Result<f64, ProfileError> {
            cells[at]
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| ProfileError::Line {
                    path: path.to_string(),
                    line: number,
                    message: format!("{what} must be a number, found `{}`", cells[at]),
                })
        };
        let time_us = real(time_at, "the out-of-place time")?;
        let busbw = real(busbw_at, "the out-of-place bus bandwidth")?;
        if let Some(at) = wrong_at {
            // `N/A` when validation is off; a number otherwise.
            if cells[at].parse::<f64>().is_ok_and(|w| w > 0.0) {
                log.wrong_rows += 1;
                continue;
            }
        }
        if bytes == 0 || time_us <= 0.0 {
            log.zero_rows += 1;
            continue;
        }
        if time_us / 1e6 > super::MAX_MEASURED_SECONDS {
            return Err(ProfileError::Line {
                path: path.to_string(),
                line: number,
                message: format!(
                    "the out-of-place time {time_us} us is over an hour; is the column layout right?"
                ),
            });
        }
        log.rows.push((bytes as f64, time_us / 1e6, busbw));
    }
    if log.op.is_none() {
        log.op = op_from_text(&file_name);
    }
    if ranks > 0 {
        log.ranks = Some(ranks);
    }
    if pending_incomplete.is_some() {
        log.truncated = true;
    }
    if log.rows.is_empty() {
        return Err(ProfileError::Input {
            path: path.to_string(),
            message: "no nccl-tests result rows (`size count type ... time algbw busbw ...`) found"
                .into(),
        });
    }
    Ok(log)
}

/// A CSV reader over `text` and the positions of the `names` columns, or an
/// error naming the first missing one.
fn csv_columns<'t, const N: usize>(
    text: &'t str,
    path: &str,
    names: [&str; N],
) -> Result<(csv::Reader<&'t [u8]>, [usize; N]), ProfileError> {
    let mut reader = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    let input = |message: String| ProfileError::Input {
        path: path.to_string(),
        message,
    };
    let headers = reader.headers().map_err(|e| input(e.to_string()))?.clone();
    let mut at = [0usize; N];
    for (slot, name) in at.iter_mut().zip(names) {
        *slot = headers
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| input(format!("no `{name}` column")))?;
    }
    Ok((reader, at))
}

/// Reads the nccl-tests-style reference table
/// (`gpus,bytes,elements,dtype,out_of_place_us,out_of_place_busbw_GBps,in_place_us,in_place_busbw_GBps`)
/// as points of `op`; the out-of-place columns are kept.
pub fn parse_reference_collectives(
    text: &str,
    path: &str,
    op: CollectiveOp,
) -> Result<Vec<CollectivePoint>, ProfileError> {
    let (mut reader, [gpus, bytes, time, busbw]) = csv_columns(
        text,
        path,
        [
            "gpus",
            "bytes",
            "out_of_place_us",
            "out_of_place_busbw_GBps",
        ],
    )?;
    let mut points = Vec::new();
    for (index, record) in reader.records().enumerate() {
        let line = index + 2;
        let record = record.map_err(|e| ProfileError::Line {
            path: path.to_string(),
            line,
            message: e.to_string(),
        })?;
        let number = |at: usize, name: &str| -> Result<f64, ProfileError> {
            record
                .get(at)
                .and_then(|c| c.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| ProfileError::Line {
                    path: path.to_string(),
                    line,
                    message: format!(
                        "column `{name}` must be a positive number, found `{}`",
                        record.get(at).unwrap_or("")
                    ),
                })
        };
        let ranks = number(gpus, "gpus")?;
        if ranks.fract() != 0.0 {
            return Err(ProfileError::Line {
                path: path.to_string(),
                line,
                message: format!("column `gpus` must be a whole number, found {ranks}"),
            });
        }
        let point = CollectivePoint {
            op,
            ranks: ranks as u64,
            bytes: number(bytes, "bytes")?,
            seconds: number(time, "out_of_place_us")? / 1e6,
            busbw: number(busbw, "out_of_place_busbw_GBps")?,
        };
        point.check().map_err(|message| ProfileError::Line {
            path: path.to_string(),
            line,
            message,
        })?;
        points.push(point);
    }
    Ok(points)
}

/// Reads Korthikanti et al.'s layer table
/// (`experiment,hidden,heads,seq_len,micro_batch,tp,sequence_parallel,recompute,forward_ms,backward_ms,combined_ms`).
///
/// The table's backward time includes any recomputation. It is split so
/// that `backward_s` is the backward pass alone: a row that recomputes takes
/// as its backward the `none` row of the same shape, micro-batch and
/// sequence parallelism, and the rest as recomputation (selective: 13.2 -
/// 11.9 ms); without such a row, a full-recomputation row's recomputation is
/// its forward (the recomputed forward; 19.5 = 11.8 + 7.7 ms), and a
/// selective row keeps its backward whole with no separate recomputation.
/// The total per micro-batch is the table's `forward + backward` either way.
pub fn parse_korthikanti_layers(
    text: &str,
    path: &str,
    dtype: &str,
) -> Result<Vec<LayerPoint>, ProfileError> {
    let names = [
        "hidden",
        "heads",
        "seq_len",
        "micro_batch",
        "tp",
        "sequence_parallel",
        "recompute",
        "forward_ms",
        "backward_ms",
    ];
    let (mut reader, at) = csv_columns(text, path, names)?;
    let mut rows: Vec<(LayerPoint, f64)> = Vec::new();
    for (index, record) in reader.records().enumerate() {
        let line = index + 2;
        let bad = |message: String| ProfileError::Line {
            path: path.to_string(),
            line,
            message,
        };
        let record = record.map_err(|e| bad(e.to_string()))?;
        let cell = |i: usize| record.get(at[i]).unwrap_or("");
        let int = |i: usize| -> Result<u64, ProfileError> {
            cell(i)
                .parse::<u64>()
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| {
                    bad(format!(
                        "column `{}` must be a positive whole number, found `{}`",
                        names[i],
                        cell(i)
                    ))
                })
        };
        let ms = |i: usize| -> Result<f64, ProfileError> {
            cell(i)
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| {
                    bad(format!(
                        "column `{}` must be a positive number, found `{}`",
                        names[i],
                        cell(i)
                    ))
                })
        };
        let sequence_parallel =
            crate::choice::parse_switch("sequence_parallel", cell(5)).map_err(bad)?;
        let recompute = Recompute::parse("recompute", cell(6)).map_err(bad)?;
        let forward_s = ms(7)? / 1e3;
        let (hidden, heads) = (int(0)?, int(1)?);
        let backward_with_recompute = ms(8)? / 1e3;
        rows.push((
            LayerPoint {
                hidden,
                heads,
                arch: LayerArch::paper_gpt(hidden, heads),
                seq_len: int(2)?,
                micro_batch: int(3)?,
                tp: int(4)?,
                sequence_parallel,
                recompute,
                dtype: dtype.to_string(),
                forward_s,
                backward_s: backward_with_recompute,
                recompute_s: None,
                ci95_rel: None,
                activation_bytes: None,
                peak_bytes: None,
                status: LayerStatus::Ok,
                // Korthikanti et al. timed layers inside tensor-parallel runs.
                includes_tp_comm: true,
            },
            backward_with_recompute,
        ));
    }
    let baselines: Vec<LayerPoint> = rows
        .iter()
        .filter(|(p, _)| p.recompute == Recompute::None)
        .map(|(p, _)| p.clone())
        .collect();
    let mut points = Vec::with_capacity(rows.len());
    for (mut point, backward) in rows {
        if point.recompute != Recompute::None {
            let baseline = baselines.iter().find(|b| {
                (b.hidden, b.heads, b.seq_len, b.micro_batch, b.tp)
                    == (
                        point.hidden,
                        point.heads,
                        point.seq_len,
                        point.micro_batch,
                        point.tp,
                    )
                    && b.sequence_parallel == point.sequence_parallel
            });
            match (baseline, point.recompute) {
                (Some(b), _) if backward > b.backward_s => {
                    point.backward_s = b.backward_s;
                    point.recompute_s = Some(to_ns(backward - b.backward_s));
                }
                (_, Recompute::Full) if backward > point.forward_s => {
                    point.backward_s = to_ns(backward - point.forward_s);
                    point.recompute_s = Some(point.forward_s);
                }
                _ => {}
            }
        }
        points.push(point);
    }
    Ok(points)
}

/// A difference of two table times, rounded to the nanosecond so that the
/// subtraction's last-bit noise does not show in the tables.
fn to_ns(seconds: f64) -> f64 {
    (seconds * 1e9).round() / 1e9
}

/// Adds `new` to `existing`: a new point replaces an existing one of the
/// same (op, ranks, bytes); the rest are kept. Sorted by (op, ranks, bytes).
pub fn merge_collectives(existing: &mut Vec<CollectivePoint>, new: &[CollectivePoint]) {
    let key = |p: &CollectivePoint| (p.op, p.ranks, p.bytes.to_bits());
    let replaced: std::collections::HashSet<_> = new.iter().map(key).collect();
    existing.retain(|p| !replaced.contains(&key(p)));
    // Within `new`, the later of two equal points wins.
    let mut seen = std::collections::HashSet::new();
    let mut fresh: Vec<CollectivePoint> = new
        .iter()
        .rev()
        .filter(|p| seen.insert(key(p)))
        .copied()
        .collect();
    fresh.reverse();
    existing.extend(fresh);
    existing.sort_by(|a, b| {
        (a.op, a.ranks)
            .cmp(&(b.op, b.ranks))
            .then(a.bytes.total_cmp(&b.bytes))
    });
}

/// Adds `new` to `existing`: a batch size measured again (same vocabulary
/// and tokens) replaces its point. Sorted by (vocab, tokens).
pub fn merge_tokens(existing: &mut Vec<TokenPoint>, new: &[TokenPoint]) {
    existing.retain(|p| {
        !new.iter()
            .any(|q| q.vocab == p.vocab && q.tokens == p.tokens)
    });
    existing.extend(new.iter().cloned());
    existing.sort_by_key(|p| (p.vocab, p.tokens));
}

/// Adds `new` to `existing`: a sync measured again (same method, ranks,
/// partitions, table and rows) replaces the old point.
pub fn merge_syncs(existing: &mut Vec<SyncPoint>, new: &[SyncPoint]) {
    let same = |a: &SyncPoint, b: &SyncPoint| {
        (a.method, a.ranks, a.partitions, a.vocab, a.hidden)
            == (b.method, b.ranks, b.partitions, b.vocab, b.hidden)
            && (a.rows - b.rows).abs() < 1e-9
    };
    existing.retain(|p| !new.iter().any(|q| same(p, q)));
    existing.extend(new.iter().cloned());
}

/// Adds `new` to `existing`: a new point replaces an existing one of the
/// same shape, micro-batch and dtype; the rest are kept, in their order.
pub fn merge_layers(existing: &mut Vec<LayerPoint>, new: &[LayerPoint]) {
    let same = |a: &LayerPoint, b: &LayerPoint| {
        a.shape() == b.shape() && a.micro_batch == b.micro_batch && a.dtype == b.dtype
    };
    for point in new {
        match existing.iter_mut().find(|p| same(p, point)) {
            Some(slot) => *slot = point.clone(),
            None => existing.push(point.clone()),
        }
    }
}
