//! `paratune profile ...` (importing measurements into a profile directory,
//! showing one) and `--profile DIR` for plan, predict and evaluate.

use super::args::{
    ImportLayersArgs, ImportNcclTestsArgs, ImportTableArgs, ProfileCommand, ProvenanceArgs,
    ShowProfileArgs,
};
use super::profile_dir::{open_profile, record_provenance};
use super::render::emit;
use super::render::thousands;
use anyhow::{Result, anyhow, bail};
use paratune::cluster::catalogue_name as catalogue_gpu;
use paratune::cost::ProfileUsage;
use paratune::profile::{
    CollectiveOp, Environment, Measurements, Profile, merge_collectives, merge_layers,
    parse_korthikanti_layers, parse_nccl_tests, parse_reference_collectives, read_profile,
    read_text, write_profile,
};
use paratune::suggest::did_you_mean;
use std::collections::BTreeSet;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub fn run(command: &ProfileCommand) -> Result<()> {
    match command {
        ProfileCommand::ImportNcclTests(args) => import_nccl_tests(args),
        ProfileCommand::ImportTable(args) => import_table(args),
        ProfileCommand::ImportLayers(args) => import_layers(args),
        ProfileCommand::Show(args) => show(args),
        ProfileCommand::Layer(args) => super::measure::profile_layer(args),
        ProfileCommand::Device(args) => super::measure::profile_device(args),
        ProfileCommand::Comm(args) => super::measure::profile_comm(args),
        ProfileCommand::Tokens(args) => super::embedding::profile_tokens(args),
        ProfileCommand::Sync(args) => super::embedding::profile_sync(args),
        ProfileCommand::Worker(args) => super::measure::worker(args),
    }
}

fn parse_op(flag: &str, text: &str) -> Result<CollectiveOp> {
    CollectiveOp::from_name(text).ok_or_else(|| {
        let names = CollectiveOp::ALL.map(CollectiveOp::name);
        anyhow!(
            "{flag}: unknown collective `{text}`; one of {}{}",
            names.join(", "),
            did_you_mean(text, &names)
        )
    })
}

/// Records the provenance and this command, writes the profile, and prints
/// `report` with a summary of the directory.
fn save(
    mut profile: Profile,
    provenance: &ProvenanceArgs,
    extra_notes: &[String],
    mut report: String,
) -> Result<()> {
    record_provenance(&mut profile, provenance, extra_notes);
    write_profile(&provenance.out, &profile)?;
    let _ = writeln!(
        report,
        "{}: {} collective points in {} curves, {} layer points",
        provenance.out.display(),
        thousands(profile.collectives.len() as f64),
        curve_count(&profile),
        thousands(profile.layers.len() as f64)
    );
    emit(&report)
}

fn curve_count(profile: &Profile) -> usize {
    profile
        .collectives
        .iter()
        .map(|p| (p.op, p.ranks))
        .collect::<BTreeSet<_>>()
        .len()
}

fn import_nccl_tests(args: &ImportNcclTestsArgs) -> Result<()> {
    let forced_op = args
        .op
        .as_deref()
        .map(|t| parse_op("--op", t))
        .transpose()?;
    if args.ranks == Some(0) {
        bail!("--ranks must be at least 1");
    }
    let mut logs = Vec::new();
    for path in &args.files {
        let shown = path.display().to_string();
        let log = parse_nccl_tests(&read_text(path)?, &shown)?;
        let op = forced_op.or(log.op).ok_or_else(|| {
            anyhow!("{shown}: the log does not say which collective it ran; give --op")
        })?;
        let ranks = args.ranks.or(log.ranks).ok_or_else(|| {
            anyhow!("{shown}: the log lists no `#  Rank N ... device` lines; give --ranks")
        })?;
        if log.truncated {
            eprintln!(
                "warning: {shown} ends early (no `# Avg bus bandwidth` line): kept its {} complete rows",
                log.rows.len()
            );
        }
        if log.wrong_rows > 0 {
            eprintln!(
                "warning: {shown}: left out {} rows that nccl-tests counted wrong results in",
                log.wrong_rows
            );
        }
        logs.push((shown, log, op, ranks));
    }
    let device = logs
        .iter()
        .find_map(|(_, log, _, _)| log.device.as_deref().map(catalogue_gpu));
    let mut profile = open_profile(&args.provenance, device.as_deref())?;
    let mut notes = Vec::new();
    let mut report = String::new();
    for (shown, log, op, ranks) in &logs {
        merge_collectives(&mut profile.collectives, &log.points(*op, *ranks));
        let dropped = match log.zero_rows {
            0 => String::new(),
            n => format!(" ({n} row(s) of size or time 0 left out)"),
        };
        let _ = writeln!(
            report,
            "{shown}: {} {op} points over {ranks} ranks{dropped}",
            thousands(log.rows.len() as f64)
        );
        if let Some(device) = &log.device {
            let note = format!("nccl-tests device: {device}");
            if !notes.contains(&note) {
                notes.push(note);
            }
        }
    }
    save(profile, &args.provenance, &notes, report)
}

fn import_table(args: &ImportTableArgs) -> Result<()> {
    let op = parse_op("--op", &args.op)?;
    let shown = args.file.display().to_string();
    let points = parse_reference_collectives(&read_text(&args.file)?, &shown, op)?;
    if points.is_empty() {
        bail!("{shown}: the table has no rows");
    }
    let mut profile = open_profile(&args.provenance, None)?;
    merge_collectives(&mut profile.collectives, &points);
    let report = format!("{shown}: {} {op} points\n", thousands(points.len() as f64));
    save(profile, &args.provenance, &[], report)
}

fn import_layers(args: &ImportLayersArgs) -> Result<()> {
    let shown = args.file.display().to_string();
    let points = parse_korthikanti_layers(&read_text(&args.file)?, &shown, &args.dtype)?;
    if points.is_empty() {
        bail!("{shown}: the table has no rows");
    }
    let mut profile = open_profile(&args.provenance, None)?;
    merge_layers(&mut profile.layers, &points);
    let report = format!("{shown}: {} layer points\n", points.len());
    save(profile, &args.provenance, &[], report)
}

fn show(args: &ShowProfileArgs) -> Result<()> {
    let profile = read_profile(&args.dir)?;
    emit(&paratune::profile::describe(&profile, &args.dir))
}

/// A profile loaded for `--profile`.
pub struct Loaded {
    pub path: PathBuf,
    pub environment: Environment,
    pub measurements: Arc<Measurements>,
}

/// Reads `--profile DIR`, warning when it was measured on another GPU than
/// the job's.
pub fn load(path: Option<&Path>, job_gpu: &str) -> Result<Option<Loaded>> {
    let Some(path) = path else { return Ok(None) };
    let profile = read_profile(path).map_err(|e| anyhow!("--profile: {e}"))?;
    let measurements = Measurements::from_profile(&profile);
    if measurements.is_empty() {
        bail!(
            "--profile: {} holds no usable measurement; import some with `paratune profile`",
            path.display()
        );
    }
    if !profile.environment.gpu.eq_ignore_ascii_case(job_gpu) {
        eprintln!(
            "warning: profile {} was measured on {}; the job runs on {job_gpu}",
            path.display(),
            profile.environment.gpu
        );
    }
    Ok(Some(Loaded {
        path: path.to_path_buf(),
        environment: profile.environment,
        measurements: Arc::new(measurements),
    }))
}

impl Loaded {
    /// `profile DIR (gpu; N collective curves, M layer shapes)`.
    pub fn title(&self) -> String {
        let sweep = if self.measurements.has_device_sweep() {
            "; GEMM and HBM efficiencies from its device sweep"
        } else {
            ""
        };
        format!(
            "profile {} ({}; {} collective curves, {} layer shapes{sweep})",
            self.path.display(),
            self.environment.gpu,
            self.measurements.curves().count(),
            self.measurements.layer_shapes().count()
        )
    }
}

/// What the predictions took from the profile, in one line.
pub fn usage_line(u: &ProfileUsage) -> String {
    u.to_string()
}
