//! `paratune ingest ...`: training logs into rows of a runs CSV, the
//! measurements `evaluate` and `calibrate` read.

use super::args::{IngestCommand, MegatronLogArgs, ModelArgs, TorchtitanLogArgs};
use super::render::emit;
use anyhow::{Result, bail};
use paratune::runs;
use paratune::validate::megatron_log::{self, MegatronRun};
use paratune::validate::torchtitan_log::{self, TorchtitanRun};
use std::fmt::Write as _;
use std::path::Path;

pub fn run(command: &IngestCommand) -> Result<()> {
    match command {
        IngestCommand::MegatronLog(args) => megatron_logs(args),
        IngestCommand::TorchtitanLog(args) => torchtitan_logs(args),
    }
}

/// One log read into a row, for [`write_rows`].
struct Ingested {
    name: String,
    row: Vec<String>,
    /// The line printed for the log.
    summary: String,
    /// What was odd about the log, printed as warnings.
    notes: Vec<String>,
}

/// Whether `out` exists, refusing it unless the rows are to be appended.
fn check_out(out: &Path, append: bool) -> Result<bool> {
    let exists = out.exists();
    if exists && !append {
        bail!(
            "--out {} already exists; give --append to add the rows to it, or another --out",
            out.display()
        );
    }
    Ok(exists)
}

/// The flow every `ingest` shares: the rows written to `out` (merged into it
/// when it `exists`, rows already there skipped), the failures and notes as
/// warnings, a summary line per log and the count. Fails, writing nothing,
/// when no log gave a row.
fn write_rows(
    out: &Path,
    exists: bool,
    columns: &[&str],
    ingested: &[Ingested],
    failures: &[String],
) -> Result<()> {
    if ingested.is_empty() {
        bail!("{}", failures.join("; "));
    }
    let headers: Vec<String> = columns.iter().map(|c| c.to_string()).collect();
    let rows: Vec<Vec<String>> = ingested.iter().map(|i| i.row.clone()).collect();
    // Reading the table appended to is what `--append` asked for.
    let added = runs::write_rows(out, exists, &headers, &rows).map_err(|e| match e {
        runs::RunsError::Table { .. } | runs::RunsError::Row { .. } if exists => {
            anyhow::anyhow!("--append to {}: {e}", out.display())
        }
        other => other.into(),
    })?;

    for failure in failures {
        eprintln!("warning: skipped {failure}");
    }
    let mut text = String::new();
    for log in ingested {
        for note in &log.notes {
            eprintln!("warning: {}: {note}", log.name);
        }
        let _ = writeln!(text, "{}", log.summary);
    }
    let total = ingested.len();
    if exists {
        let _ = writeln!(
            text,
            "added {added} of {total} row(s) to {} ({} already there)",
            out.display(),
            total - added
        );
    } else {
        let _ = writeln!(text, "wrote {total} row(s) to {}", out.display());
    }
    emit(&text)
}

fn megatron_logs(args: &MegatronLogArgs) -> Result<()> {
    let exists = check_out(&args.out, args.append)?;
    let mut ingested = Vec::new();
    let mut failures = Vec::new();
    for file in &args.files {
        let name = file.display().to_string();
        let parsed = megatron_log::read(file, args.warmup)
            .and_then(|run| run.row(&name, &name).map(|row| (run, row)));
        match parsed {
            Ok((run, row)) => ingested.push(Ingested {
                summary: megatron_summary(&name, &run),
                notes: run.notes,
                name,
                row,
            }),
            Err(e) => failures.push(e.to_string()),
        }
    }
    write_rows(
        &args.out,
        exists,
        &megatron_log::ROW_COLUMNS,
        &ingested,
        &failures,
    )
}

fn torchtitan_logs(args: &TorchtitanLogArgs) -> Result<()> {
    let exists = check_out(&args.out, args.append)?;
    let config = args
        .config
        .as_deref()
        .map(torchtitan_log::read_config_file)
        .transpose()?;
    let model = args
        .model
        .as_ref()
        .map(|name| {
            super::resolve::model(&ModelArgs {
                model: Some(name.clone()),
                ..ModelArgs::default()
            })
        })
        .transpose()?;
    let options = torchtitan_log::Options {
        warmup: args.warmup,
        config,
        model,
        gpus: args.gpus,
    };
    let mut ingested = Vec::new();
    let mut failures = Vec::new();
    for file in &args.files {
        let name = file.display().to_string();
        match torchtitan_log::read(file, &options) {
            Ok(run) => ingested.push(Ingested {
                row: run.row(&name),
                summary: torchtitan_summary(&name, &run),
                notes: run.notes,
                name,
            }),
            Err(e) => failures.push(e.to_string()),
        }
    }
    write_rows(
        &args.out,
        exists,
        &torchtitan_log::ROW_COLUMNS,
        &ingested,
        &failures,
    )
}

/// `run.log: tp2 pp2 dp2 mb2 gb16, L24 h1024 a16 s1024, 8 GPUs: 215.3 ms/iteration ...`
fn megatron_summary(name: &str, run: &MegatronRun) -> String {
    let mut line = format!(
        "{name}: {}: {:.1} ms/iteration (median; mean {:.1}; {} iteration(s) after {} warm-up)",
        run.config.summary(),
        run.steady_median_ms,
        run.steady_mean_ms,
        run.steady_iterations,
        run.warmup
    );
    match (run.peak_allocated_gib(), run.peak_reserved_gib()) {
        (Some(allocated), Some(reserved)) => {
            let _ = write!(
                line,
                ", peak memory {allocated:.2} GiB ({reserved:.2} GiB reserved)"
            );
        }
        (Some(allocated), None) => {
            let _ = write!(line, ", peak memory {allocated:.2} GiB");
        }
        _ => line.push_str(", peak memory not logged"),
    }
    if let Some(tflops) = run.tflops_per_gpu {
        let _ = write!(line, ", {tflops:.1} TFLOP/s/GPU");
    }
    if run.skipped_iterations > 0 || run.nan_iterations > 0 {
        let _ = write!(
            line,
            ", {} skipped and {} nan iteration(s)",
            run.skipped_iterations, run.nan_iterations
        );
    }
    line
}

/// `run.log: torchtitan 0.2: tp1 pp1 dp8 mb1 gb8 ..., llama3 8B L32 h4096 a32 s8192, 8 GPUs: 1318.5 ms/step ...`
fn torchtitan_summary(name: &str, run: &TorchtitanRun) -> String {
    let mut line = format!(
        "{name}: torchtitan {}: {}: {:.1} ms/step (median; mean {:.1}; {} step line(s) after {} warm-up)",
        run.release.name(),
        run.summary(),
        run.steady_median_ms,
        run.steady_mean_ms,
        run.steady_steps,
        run.warmup
    );
    match (run.peak_reserved_gib, run.memory_rank) {
        (Some(gib), Some(rank)) => {
            let _ = write!(
                line,
                ", peak memory {gib:.2} GiB reserved ({} pipeline stage)",
                rank.name()
            );
        }
        _ => line.push_str(", peak memory not logged"),
    }
    if let Some(tflops) = run.tflops_per_gpu {
        let _ = write!(line, ", {tflops:.1} TFLOP/s/GPU");
    }
    if let Some(mfu) = run.mfu_percent {
        let _ = write!(line, ", MFU {mfu:.1}%");
    }
    line
}
