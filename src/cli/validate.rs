//! `paratune validate`: the plan read and checked, then local trials
//! (`paratune::validate::local_loop`) or cluster trials
//! (`validate_cluster.rs`); the report printed.

use super::args::ValidateArgs;
use super::measure::{check_writable, parse_device, parse_dtype};
use super::render::emit;
use super::resolve;
use anyhow::{Context, Result, anyhow};
use paratune::coefficients::CostModel;
use paratune::measure::{self, MeasureError};
use paratune::plan_file::PlanFile;
use paratune::validate::local::TrialSettings;
use paratune::validate::local_loop::{LocalLoopSettings, run_local_loop};
use std::path::{Path, PathBuf};

pub fn run(args: &ValidateArgs) -> Result<()> {
    let shown = args.plan.display().to_string();
    let text = std::fs::read_to_string(&args.plan)
        .map_err(|e| anyhow!("cannot read plan {shown}: {e}"))?;
    let plan = PlanFile::read_checked(&text, &shown)?;
    let cost = planned_cost_model(args, &plan)?;
    let out = args.out.clone().unwrap_or_else(|| default_out(&args.plan));
    match args.launch {
        Some(engine) => super::validate_cluster::run(args, engine, &plan, &cost, &out),
        None => local_trials(args, &plan, &cost, &out),
    }
}

/// The cost model `--cost-model` names, else the one the plan was made
/// with: the file `plan --cost-model` read (its path as given there), or
/// the shipped model it names.
fn planned_cost_model(args: &ValidateArgs, plan: &PlanFile) -> Result<CostModel> {
    if let Some(name) = args.cost_model.as_deref() {
        return resolve::cost_model(Some(name), &plan.nodes.gpu.name);
    }
    match &plan.cost_model_file {
        Some(file) => resolve::cost_model_from_file(file).map_err(|e| {
            let here = std::env::current_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|_| "here".into());
            anyhow!(
                "the plan's cost_model_file: {e} (the path `plan` was given, read from {here}); run validate where plan ran, or give --cost-model NAME or FILE"
            )
        }),
        None => resolve::cost_model(Some(&plan.cost_model), &plan.nodes.gpu.name)
            .with_context(|| "the plan's cost model; give --cost-model NAME or FILE"),
    }
}

/// `reports/<plan file name without extension>`.
fn default_out(plan: &Path) -> PathBuf {
    let name = plan
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "plan".into());
    PathBuf::from("reports").join(name)
}

fn local_trials(args: &ValidateArgs, plan: &PlanFile, cost: &CostModel, out: &Path) -> Result<()> {
    let device = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    check_writable(out, "--out")?;
    if !measure::TORCH_COMPILED {
        return Err(MeasureError::NotCompiled {
            what: "local trial runs (`validate --device`; `--launch megatron` writes cluster scripts without it)",
        }
        .into());
    }
    measure::check_device(device).map_err(super::measure::flagged)?;
    let settings = TrialSettings {
        device,
        dtype,
        iterations: args.iterations,
        memory_limit_bytes: args.memory_limit.map(|b| b.0),
    };
    let device_gpu = measure::device_facts(device)
        .ok()
        .map(|f| paratune::cluster::catalogue_name(&f.name));
    let settings = LocalLoopSettings {
        trial: settings,
        timeout: super::measure::timeout(args.timeout)?,
        top: args.top,
        rounds: args.rounds,
        device_gpu,
    };
    let report = run_local_loop(plan, &args.plan, cost, &settings, out, &mut |line| {
        eprintln!("{line}")
    })?;
    emit(&report)
}
