//! `paratune ingest ...`: training logs into rows of a runs CSV, the
//! measurements `evaluate` and `calibrate` read.

use super::commands::emit;
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use paratune::atomic::write_atomically;
use paratune::runs::{RunTable, write_csv};
use paratune::validate::megatron_log::{
    self, DEFAULT_WARMUP, MegatronRun, ROW_COLUMNS, merge_rows,
};
use std::fmt::Write as _;
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum IngestCommand {
    /// Read Megatron-LM pretrain_gpt.py logs (one run each) into a runs CSV:
    /// the configuration, the steady-state iteration time and the peak memory.
    MegatronLog(MegatronLogArgs),
}

#[derive(Args, Debug)]
pub struct MegatronLogArgs {
    /// Log files: the stdout/stderr of pretrain_gpt.py runs, one run each.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The runs CSV to write (refused if it exists, unless --append).
    #[arg(long)]
    pub out: PathBuf,
    /// Logged iterations left out of the steady state as warm-up (iteration 1 always is).
    #[arg(long, default_value_t = DEFAULT_WARMUP)]
    pub warmup: usize,
    /// Add the rows to an existing --out, skipping rows it already holds.
    #[arg(long)]
    pub append: bool,
}

pub fn run(command: &IngestCommand) -> Result<()> {
    match command {
        IngestCommand::MegatronLog(args) => megatron_logs(args),
    }
}

fn megatron_logs(args: &MegatronLogArgs) -> Result<()> {
    let out = &args.out;
    let exists = out.exists();
    if exists && !args.append {
        bail!(
            "--out {} already exists; give --append to add the rows to it, or another --out",
            out.display()
        );
    }

    let mut runs: Vec<(String, MegatronRun)> = Vec::new();
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for file in &args.files {
        let name = file.display().to_string();
        let parsed = megatron_log::read(file, args.warmup)
            .and_then(|run| run.row(&name, &name).map(|row| (run, row)));
        match parsed {
            Ok((run, row)) => {
                rows.push(row);
                runs.push((name, run));
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    if runs.is_empty() {
        bail!("{}", failures.join("; "));
    }

    let headers: Vec<String> = ROW_COLUMNS.iter().map(|c| c.to_string()).collect();
    let (headers, all_rows, added) = if exists {
        let table =
            RunTable::read(out).with_context(|| format!("--append to {}", out.display()))?;
        merge_rows(&table.headers, &table.rows, &headers, &rows)
    } else {
        let n = rows.len();
        (headers, rows, n)
    };
    let mut buffer = Vec::new();
    write_csv(&mut buffer, &headers, &all_rows)?;
    write_atomically(out, &buffer).with_context(|| format!("cannot write {}", out.display()))?;

    for failure in &failures {
        eprintln!("warning: skipped {failure}");
    }
    let mut text = String::new();
    for (name, run) in &runs {
        for note in &run.notes {
            eprintln!("warning: {name}: {note}");
        }
        let _ = writeln!(text, "{}", summary(name, run));
    }
    let total = runs.len();
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

/// `run.log: tp2 pp2 dp2 mb2 gb16, L24 h1024 a16 s1024, 8 GPUs: 215.3 ms/iteration ...`
fn summary(name: &str, run: &MegatronRun) -> String {
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
