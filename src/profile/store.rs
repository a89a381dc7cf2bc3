//! Reading and writing profile directories. The only code in paratune that
//! knows about polars: tables are polars data frames here and plain
//! [`CollectivePoint`]/[`LayerPoint`] vectors everywhere else.
//!
//! Every file is written atomically (a temporary file in the directory, then
//! a rename), so a reader never sees half a table and an interrupted write
//! leaves the previous one in place. Reading a table that does not parse
//! fails with one line naming the file; nothing is overwritten.

use super::{
    COLLECTIVES_TABLE, CollectiveOp, CollectivePoint, DEVICE_FILE, ENVIRONMENT_FILE, Environment,
    LAYERS_TABLE, LayerArch, LayerPoint, LayerStatus, Profile, ProfileError,
};
use crate::choice::Choice;
use crate::config::Recompute;
use crate::model::AttentionKind;
use polars::prelude::*;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Reads the profile in `dir`: `environment.toml`, then each table from its
/// Parquet file, or its CSV file when there is no Parquet file; a table with
/// neither file is empty.
pub fn read_profile(dir: &Path) -> Result<Profile, ProfileError> {
    let env_path = dir.join(ENVIRONMENT_FILE);
    if !dir.is_dir() {
        return Err(ProfileError::NotAProfile {
            path: dir.display().to_string(),
            message: "no such directory".into(),
        });
    }
    // An update killed after its journal was written is finished first, so
    // the tables and environment.toml read here belong together.
    crate::atomic::recover(dir).map_err(|e| ProfileError::Write {
        path: dir.display().to_string(),
        message: format!("cannot finish an interrupted update ({e})"),
    })?;
    if !env_path.is_file() {
        return Err(ProfileError::NotAProfile {
            path: dir.display().to_string(),
            message: format!("it has no {ENVIRONMENT_FILE}"),
        });
    }
    let text = std::fs::read_to_string(&env_path).map_err(|cause| ProfileError::Read {
        path: env_path.display().to_string(),
        cause,
    })?;
    let mut environment: Environment =
        toml::from_str(&text).map_err(|e| ProfileError::Corrupt {
            path: env_path.display().to_string(),
            message: crate::toml_error::one_line(&e, &text, "it needs at least `gpu = \"NAME\"`"),
        })?;
    let collectives = match read_table(dir, COLLECTIVES_TABLE, &collectives_schema(), &environment)?
    {
        Some((path, df)) => collectives_from(&df).map_err(|message| corrupt(&path, message))?,
        None => Vec::new(),
    };
    let layers = match read_table(dir, LAYERS_TABLE, &layers_schema(), &environment)? {
        Some((path, df)) => layers_from(&df).map_err(|message| corrupt(&path, message))?,
        None => Vec::new(),
    };
    let device_path = dir.join(DEVICE_FILE);
    let device = if device_path.is_file() {
        let text = std::fs::read_to_string(&device_path).map_err(|cause| ProfileError::Read {
            path: device_path.display().to_string(),
            cause,
        })?;
        Some(toml::from_str(&text).map_err(|e| ProfileError::Corrupt {
            path: device_path.display().to_string(),
            message: crate::toml_error::one_line(&e, &text, "rerun `paratune profile device`"),
        })?)
    } else {
        None
    };
    let sync: Vec<super::SyncPoint> = read_points(dir, SYNC_FILE, "rerun `paratune profile sync`")?;
    let tokens: Vec<super::TokenPoint> =
        read_points(dir, TOKENS_FILE, "rerun `paratune profile tokens`")?;
    // Checked; a profile in memory carries no checksums (writing computes them).
    environment.checksums.clear();
    Ok(Profile {
        environment,
        collectives,
        layers,
        device,
        sync,
        tokens,
    })
}

/// Writes `profile` into `dir` (created if missing): both tables as Parquet
/// and CSV, `device.toml`, and `environment.toml` with every table's
/// checksum, as one transaction ([`crate::atomic::Transaction`]): a kill
/// leaves the previous profile or the new one, never a mix. A new directory
/// is built beside its place and renamed into it, so a kill never leaves a
/// directory that is not a profile.
pub fn write_profile(dir: &Path, profile: &Profile) -> Result<(), ProfileError> {
    let write_error = |path: &Path, e: &dyn std::fmt::Display| ProfileError::Write {
        path: path.display().to_string(),
        message: first_line(&e.to_string()),
    };
    let mut files: Vec<(&str, Vec<u8>)> = Vec::new();
    let (collectives_parquet, collectives_csv) = table_bytes(dir, COLLECTIVES_TABLE, || {
        collectives_frame(&profile.collectives)
    })?;
    let (layers_parquet, layers_csv) =
        table_bytes(dir, LAYERS_TABLE, || layers_frame(&profile.layers))?;
    let names = table_file_names();
    files.push((&names[0], collectives_parquet));
    files.push((&names[1], collectives_csv));
    files.push((&names[2], layers_parquet));
    files.push((&names[3], layers_csv));
    if let Some(device) = &profile.device {
        let text =
            toml::to_string_pretty(device).map_err(|e| write_error(&dir.join(DEVICE_FILE), &e))?;
        files.push((DEVICE_FILE, text.into_bytes()));
    }
    for (name, text) in [
        (SYNC_FILE, points_text(&profile.sync)),
        (TOKENS_FILE, points_text(&profile.tokens)),
    ] {
        if let Some(text) = text.map_err(|e| write_error(&dir.join(name), &e))? {
            files.push((name, text.into_bytes()));
        }
    }
    // Parquet pages can be damaged without any reader noticing; the CSV
    // twins and the TOML files are text, read and checked value by value
    // (and may be edited by hand).
    let mut environment = profile.environment.clone();
    environment.checksums = files
        .iter()
        .filter(|(name, _)| name.ends_with(".parquet"))
        .map(|(name, bytes)| (name.to_string(), checksum(bytes)))
        .collect();
    let env_text = toml::to_string_pretty(&environment)
        .map_err(|e| write_error(&dir.join(ENVIRONMENT_FILE), &e))?;
    files.push((ENVIRONMENT_FILE, env_text.into_bytes()));

    let fresh = !dir.exists() || dir.read_dir().is_ok_and(|mut d| d.next().is_none());
    let (target, staging) = if fresh {
        let parent = crate::atomic::parent_dir(dir);
        std::fs::create_dir_all(parent).map_err(|e| write_error(parent, &e))?;
        let staging = crate::atomic::staging_dir(parent).map_err(|e| write_error(dir, &e))?;
        (staging.path().to_path_buf(), Some(staging))
    } else {
        (dir.to_path_buf(), None)
    };
    let mut transaction =
        crate::atomic::Transaction::new(&target).map_err(|e| write_error(dir, &e))?;
    for (name, bytes) in &files {
        transaction
            .stage(name, bytes)
            .map_err(|e| write_error(&dir.join(name), &e))?;
    }
    transaction.commit().map_err(|e| write_error(dir, &e))?;
    if let Some(staging) = staging {
        crate::atomic::move_dir_into_place(staging, dir).map_err(|e| write_error(dir, &e))?;
    }
    Ok(())
}

/// The four table files, in the order [`write_profile`] writes them.
fn table_file_names() -> [String; 4] {
    let [a, b] = [COLLECTIVES_TABLE, LAYERS_TABLE];
    [
        format!("{a}.parquet"),
        format!("{a}.csv"),
        format!("{b}.parquet"),
        format!("{b}.csv"),
    ]
}

/// A table's Parquet and CSV bytes.
fn table_bytes(
    dir: &Path,
    table: &str,
    frame: impl FnOnce() -> PolarsResult<DataFrame>,
) -> Result<(Vec<u8>, Vec<u8>), ProfileError> {
    let failed = |e: PolarsError| ProfileError::Write {
        path: dir.join(table).display().to_string(),
        message: first_line(&e.to_string()),
    };
    let mut df = frame().map_err(failed)?;
    let mut parquet = Vec::new();
    ParquetWriter::new(&mut parquet)
        .finish(&mut df)
        .map_err(failed)?;
    let mut csv = Vec::new();
    CsvWriter::new(&mut csv)
        .include_header(true)
        .finish(&mut df)
        .map_err(failed)?;
    Ok((parquet, csv))
}

/// The checksum `environment.toml` records for a file: SHA-256, hex.
pub fn checksum(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Checks `path` against the checksum `environment.toml` recorded for it,
/// when it recorded one (profiles written by hand or by older versions
/// have none).
fn verify_checksum(environment: &Environment, path: &Path) -> Result<(), ProfileError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Some(expected) = environment.checksums.get(&name) else {
        return Ok(());
    };
    let bytes = std::fs::read(path).map_err(|cause| ProfileError::Read {
        path: path.display().to_string(),
        cause,
    })?;
    if &checksum(&bytes) != expected {
        return Err(corrupt(
            path,
            format!(
                "its SHA-256 differs from the one {ENVIRONMENT_FILE} records, so it was changed or damaged after paratune wrote it; rebuild it with the commands in {ENVIRONMENT_FILE}, or, if you edited it on purpose, delete its line under [checksums]"
            ),
        ));
    }
    Ok(())
}

fn corrupt(path: &Path, message: String) -> ProfileError {
    ProfileError::Corrupt {
        path: path.display().to_string(),
        message,
    }
}

fn first_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("unknown error")
        .to_string()
}

fn table_paths(dir: &Path, table: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{table}.parquet")),
        dir.join(format!("{table}.csv")),
    )
}

/// The table's frame and the file it came from, or `None` when neither file exists.
fn read_table(
    dir: &Path,
    table: &str,
    schema: &Schema,
    environment: &Environment,
) -> Result<Option<(PathBuf, DataFrame)>, ProfileError> {
    let (parquet, csv) = table_paths(dir, table);
    if parquet.is_file() {
        verify_checksum(environment, &parquet)?;
        let file = File::open(&parquet).map_err(|cause| ProfileError::Read {
            path: parquet.display().to_string(),
            cause,
        })?;
        let df = ParquetReader::new(file)
            .finish()
            .map_err(|e| corrupt(&parquet, first_line(&e.to_string())))?;
        return Ok(Some((parquet, df)));
    }
    if csv.is_file() {
        let df = CsvReadOptions::default()
            .with_has_header(true)
            .with_schema_overwrite(Some(Arc::new(schema.clone())))
            .try_into_reader_with_file_path(Some(csv.clone()))
            .and_then(|reader| reader.finish())
            .map_err(|e| corrupt(&csv, first_line(&e.to_string())))?;
        return Ok(Some((csv, df)));
    }
    Ok(None)
}

fn name(text: &str) -> PlSmallStr {
    PlSmallStr::from(text)
}

fn collectives_schema() -> Schema {
    Schema::from_iter([
        (name("op"), DataType::String),
        (name("ranks"), DataType::UInt64),
        (name("bytes"), DataType::Float64),
        (name("seconds"), DataType::Float64),
        (name("busbw_GBps"), DataType::Float64),
    ])
}

fn layers_schema() -> Schema {
    let mut fields = vec![];
    for column in ["hidden", "heads", "kv_heads", "ffn_hidden"] {
        fields.push((name(column), DataType::UInt64));
    }
    fields.push((name("gated_mlp"), DataType::Boolean));
    fields.push((name("attention"), DataType::String));
    for column in ["seq_len", "micro_batch", "tp"] {
        fields.push((name(column), DataType::UInt64));
    }
    fields.push((name("sequence_parallel"), DataType::Boolean));
    fields.push((name("recompute"), DataType::String));
    fields.push((name("dtype"), DataType::String));
    for column in [
        "forward_s",
        "backward_s",
        "recompute_s",
        "ci95_rel",
        "activation_bytes",
        "peak_bytes",
    ] {
        fields.push((name(column), DataType::Float64));
    }
    fields.push((name("status"), DataType::String));
    fields.push((name("includes_tp_comm"), DataType::Boolean));
    Schema::from_iter(fields)
}

fn collectives_frame(points: &[CollectivePoint]) -> PolarsResult<DataFrame> {
    DataFrame::new_infer_height(vec![
        Column::new(
            name("op"),
            points.iter().map(|p| p.op.name()).collect::<Vec<_>>(),
        ),
        Column::new(
            name("ranks"),
            points.iter().map(|p| p.ranks).collect::<Vec<_>>(),
        ),
        Column::new(
            name("bytes"),
            points.iter().map(|p| p.bytes).collect::<Vec<_>>(),
        ),
        Column::new(
            name("seconds"),
            points.iter().map(|p| p.seconds).collect::<Vec<_>>(),
        ),
        Column::new(
            name("busbw_GBps"),
            points.iter().map(|p| p.busbw).collect::<Vec<_>>(),
        ),
    ])
}

/// `None` for the NaN times of `oom` points, so the tables say null.
fn time(value: f64) -> Option<f64> {
    (!value.is_nan()).then_some(value)
}

fn layers_frame(points: &[LayerPoint]) -> PolarsResult<DataFrame> {
    let ints = |column: &str, get: fn(&LayerPoint) -> u64| {
        Column::new(name(column), points.iter().map(get).collect::<Vec<_>>())
    };
    let reals = |column: &str, get: fn(&LayerPoint) -> Option<f64>| {
        Column::new(name(column), points.iter().map(get).collect::<Vec<_>>())
    };
    DataFrame::new_infer_height(vec![
        ints("hidden", |p| p.hidden),
        ints("heads", |p| p.heads),
        ints("kv_heads", |p| p.arch.kv_heads),
        ints("ffn_hidden", |p| p.arch.ffn_hidden),
        Column::new(
            name("gated_mlp"),
            points.iter().map(|p| p.arch.gated_mlp).collect::<Vec<_>>(),
        ),
        Column::new(
            name("attention"),
            points
                .iter()
                .map(|p| p.arch.attention.name())
                .collect::<Vec<_>>(),
        ),
        ints("seq_len", |p| p.seq_len),
        ints("micro_batch", |p| p.micro_batch),
        ints("tp", |p| p.tp),
        Column::new(
            name("sequence_parallel"),
            points
                .iter()
                .map(|p| p.sequence_parallel)
                .collect::<Vec<_>>(),
        ),
        Column::new(
            name("recompute"),
            points
                .iter()
                .map(|p| p.recompute.name())
                .collect::<Vec<_>>(),
        ),
        Column::new(
            name("dtype"),
            points.iter().map(|p| p.dtype.as_str()).collect::<Vec<_>>(),
        ),
        reals("forward_s", |p| time(p.forward_s)),
        reals("backward_s", |p| time(p.backward_s)),
        reals("recompute_s", |p| p.recompute_s),
        reals("ci95_rel", |p| p.ci95_rel),
        reals("activation_bytes", |p| p.activation_bytes),
        reals("peak_bytes", |p| p.peak_bytes),
        Column::new(
            name("status"),
            points.iter().map(|p| p.status.name()).collect::<Vec<_>>(),
        ),
        Column::new(
            name("includes_tp_comm"),
            points
                .iter()
                .map(|p| p.includes_tp_comm)
                .collect::<Vec<_>>(),
        ),
    ])
}

/// A column as values of one type; `Err` names the column and the problem.
fn column_of(df: &DataFrame, column: &str, dtype: &DataType) -> Result<Column, String> {
    df.column(column)
        .map_err(|_| format!("no `{column}` column"))?
        .strict_cast(dtype)
        .map_err(|_| format!("column `{column}` is not of type {dtype}"))
}

fn u64s(df: &DataFrame, column: &str) -> Result<Vec<u64>, String> {
    let c = column_of(df, column, &DataType::UInt64)?;
    let values = c.u64().map_err(|e| first_line(&e.to_string()))?;
    values
        .iter()
        .enumerate()
        .map(|(row, v)| v.ok_or_else(|| format!("row {}: `{column}` is empty", row + 1)))
        .collect()
}

fn opt_f64s(df: &DataFrame, column: &str) -> Result<Vec<Option<f64>>, String> {
    let c = column_of(df, column, &DataType::Float64)?;
    let values = c.f64().map_err(|e| first_line(&e.to_string()))?;
    Ok(values.iter().collect())
}

/// An optional column: all empty when the table does not have it.
fn optional_f64s(df: &DataFrame, column: &str) -> Result<Vec<Option<f64>>, String> {
    if df.column(column).is_err() {
        return Ok(vec![None; df.height()]);
    }
    opt_f64s(df, column)
}

fn f64s(df: &DataFrame, column: &str) -> Result<Vec<f64>, String> {
    opt_f64s(df, column)?
        .into_iter()
        .enumerate()
        .map(|(row, v)| v.ok_or_else(|| format!("row {}: `{column}` is empty", row + 1)))
        .collect()
}

fn strings(df: &DataFrame, column: &str) -> Result<Vec<String>, String> {
    let c = column_of(df, column, &DataType::String)?;
    let values = c.str().map_err(|e| first_line(&e.to_string()))?;
    values
        .iter()
        .enumerate()
        .map(|(row, v)| {
            v.map(str::to_string)
                .ok_or_else(|| format!("row {}: `{column}` is empty", row + 1))
        })
        .collect()
}

fn bools(df: &DataFrame, column: &str) -> Result<Vec<bool>, String> {
    let c = column_of(df, column, &DataType::Boolean)?;
    let values = c.bool().map_err(|e| first_line(&e.to_string()))?;
    values
        .iter()
        .enumerate()
        .map(|(row, v)| v.ok_or_else(|| format!("row {}: `{column}` is empty", row + 1)))
        .collect()
}

fn collectives_from(df: &DataFrame) -> Result<Vec<CollectivePoint>, String> {
    let ops = strings(df, "op")?;
    let ranks = u64s(df, "ranks")?;
    let bytes = f64s(df, "bytes")?;
    let seconds = f64s(df, "seconds")?;
    let busbw = f64s(df, "busbw_GBps")?;
    ops.iter()
        .enumerate()
        .map(|(i, op)| {
            let op = CollectiveOp::from_name(op).ok_or_else(|| {
                format!(
                    "row {}: unknown op `{op}` (all_reduce, all_gather, reduce_scatter, sendrecv)",
                    i + 1
                )
            })?;
            let point = CollectivePoint {
                op,
                ranks: ranks[i],
                bytes: bytes[i],
                seconds: seconds[i],
                busbw: busbw[i],
            };
            point.check().map_err(|e| format!("row {}: {e}", i + 1))?;
            Ok(point)
        })
        .collect()
}

/// A column read with `read`, or `None` when the table does not have it.
fn if_present<T>(
    df: &DataFrame,
    column: &str,
    read: fn(&DataFrame, &str) -> Result<Vec<T>, String>,
) -> Result<Option<Vec<T>>, String> {
    df.column(column)
        .is_ok()
        .then(|| read(df, column))
        .transpose()
}

/// The layers' architecture columns. Tables written before they existed
/// hold the GPT layers of Megatron-LM's papers ([`LayerArch::paper_gpt`]),
/// so each missing column takes that layer's value.
fn layer_archs(df: &DataFrame, hidden: &[u64], heads: &[u64]) -> Result<Vec<LayerArch>, String> {
    let kv_heads = if_present(df, "kv_heads", u64s)?;
    let ffn_hidden = if_present(df, "ffn_hidden", u64s)?;
    let gated_mlp = if_present(df, "gated_mlp", bools)?;
    let attention = if_present(df, "attention", strings)?;
    (0..hidden.len())
        .map(|i| {
            let mut arch = LayerArch::paper_gpt(hidden[i], heads[i]);
            if let Some(v) = &kv_heads {
                arch.kv_heads = v[i];
            }
            if let Some(v) = &ffn_hidden {
                arch.ffn_hidden = v[i];
            }
            if let Some(v) = &gated_mlp {
                arch.gated_mlp = v[i];
            }
            if let Some(v) = &attention {
                arch.attention = AttentionKind::parse("attention", &v[i])
                    .map_err(|e| format!("row {}: {e}", i + 1))?;
            }
            Ok(arch)
        })
        .collect()
}

fn layers_from(df: &DataFrame) -> Result<Vec<LayerPoint>, String> {
    let hidden = u64s(df, "hidden")?;
    let heads = u64s(df, "heads")?;
    let arch = layer_archs(df, &hidden, &heads)?;
    let seq_len = u64s(df, "seq_len")?;
    let micro_batch = u64s(df, "micro_batch")?;
    let tp = u64s(df, "tp")?;
    let sequence_parallel = bools(df, "sequence_parallel")?;
    let recompute = strings(df, "recompute")?;
    let dtype = strings(df, "dtype")?;
    let forward = opt_f64s(df, "forward_s")?;
    let backward = opt_f64s(df, "backward_s")?;
    let recompute_s = optional_f64s(df, "recompute_s")?;
    let ci95 = optional_f64s(df, "ci95_rel")?;
    let activation = optional_f64s(df, "activation_bytes")?;
    let peak = optional_f64s(df, "peak_bytes")?;
    let status = strings(df, "status")?;
    // Tables written before the column existed hold layers timed inside
    // tensor-parallel runs.
    let includes_tp_comm =
        if_present(df, "includes_tp_comm", bools)?.unwrap_or_else(|| vec![true; df.height()]);
    (0..hidden.len())
        .map(|i| {
            let row = i + 1;
            let recompute = Recompute::parse("recompute", &recompute[i])
                .map_err(|e| format!("row {row}: {e}"))?;
            let status = LayerStatus::from_name(&status[i]).ok_or_else(|| {
                format!("row {row}: status must be ok or oom, found `{}`", status[i])
            })?;
            let time = |v: Option<f64>, column: &str| match (v, status) {
                (Some(v), _) => Ok(v),
                (None, LayerStatus::Oom) => Ok(f64::NAN),
                (None, LayerStatus::Ok) => Err(format!("row {row}: `{column}` is empty")),
            };
            let point = LayerPoint {
                hidden: hidden[i],
                heads: heads[i],
                arch: arch[i],
                seq_len: seq_len[i],
                micro_batch: micro_batch[i],
                tp: tp[i],
                sequence_parallel: sequence_parallel[i],
                recompute,
                dtype: dtype[i].clone(),
                forward_s: time(forward[i], "forward_s")?,
                backward_s: time(backward[i], "backward_s")?,
                recompute_s: recompute_s[i],
                ci95_rel: ci95[i],
                activation_bytes: activation[i],
                peak_bytes: peak[i],
                status,
                includes_tp_comm: includes_tp_comm[i],
            };
            point.check().map_err(|e| format!("row {row}: {e}"))?;
            Ok(point)
        })
        .collect()
}

/// Embedding-synchronisation points (`profile sync`), a small TOML table.
pub const SYNC_FILE: &str = "sync.toml";
/// Distinct rows per token batch (`profile tokens`), a small TOML table.
pub const TOKENS_FILE: &str = "tokens.toml";

#[derive(Serialize, Deserialize)]
struct Points<T> {
    points: Vec<T>,
}

/// Points that check themselves (`SyncPoint`, `TokenPoint`).
trait Checked {
    fn check_point(&self) -> Result<(), String>;
}

impl Checked for super::SyncPoint {
    fn check_point(&self) -> Result<(), String> {
        self.check()
    }
}

impl Checked for super::TokenPoint {
    fn check_point(&self) -> Result<(), String> {
        self.check()
    }
}

/// The points of `dir/name`, each checked; none when the file is absent.
fn read_points<T: serde::de::DeserializeOwned + Checked>(
    dir: &Path,
    name: &str,
    fix: &str,
) -> Result<Vec<T>, ProfileError> {
    let path = dir.join(name);
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|cause| ProfileError::Read {
        path: shown.clone(),
        cause,
    })?;
    let points: Points<T> = toml::from_str(&text).map_err(|e| ProfileError::Corrupt {
        path: shown.clone(),
        message: crate::toml_error::one_line(&e, &text, fix),
    })?;
    for (i, point) in points.points.iter().enumerate() {
        point
            .check_point()
            .map_err(|message| ProfileError::Corrupt {
                path: shown.clone(),
                message: format!("point {}: {message}", i + 1),
            })?;
    }
    Ok(points.points)
}

/// The TOML text of `points`; none when there are none (no file is written).
fn points_text<T: Serialize + Clone>(points: &[T]) -> Result<Option<String>, toml::ser::Error> {
    if points.is_empty() {
        return Ok(None);
    }
    toml::to_string_pretty(&Points {
        points: points.to_vec(),
    })
    .map(Some)
}
