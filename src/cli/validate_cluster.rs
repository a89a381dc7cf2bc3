//! `paratune validate --launch megatron|torchtitan|torch`: the flags made
//! into the engine's settings, then the library's loop of cluster trials
//! (`paratune::validate::cluster`), its report printed.

use super::args::{LaunchEngine, Launcher as LauncherArg, ValidateArgs};
use super::measure::check_writable;
use super::render::emit;
use anyhow::{Result, bail};
use paratune::coefficients::CostModel;
use paratune::plan_file::PlanFile;
use paratune::validate::cluster::{Cluster, LoopSettings, run_loop};
use paratune::validate::launch::{LaunchError, LaunchSettings, Launcher};
use paratune::validate::torch_launch::{self, TorchSettings, TrialDevice};
use paratune::validate::torchtitan_launch::{TorchtitanBase, TorchtitanSettings};
use std::path::Path;

pub fn run(
    args: &ValidateArgs,
    engine: LaunchEngine,
    plan: &PlanFile,
    prior: &CostModel,
    out: &Path,
) -> Result<()> {
    // The base is checked before anything is written.
    let cluster = cluster_of(args, engine, plan, prior)?;
    check_writable(out, "--out")?;
    let settings = LoopSettings {
        top: args.top,
        rounds: args.rounds,
        timeout: super::measure::timeout(args.timeout)?,
        dry_run: args.dry_run,
    };
    let report = run_loop(plan, prior, &cluster, settings, out, &mut |line| {
        eprintln!("{line}")
    })?;
    emit(&report)
}

/// The engine the flags name, with its settings.
fn cluster_of(
    args: &ValidateArgs,
    engine: LaunchEngine,
    plan: &PlanFile,
    prior: &CostModel,
) -> Result<Cluster> {
    let launcher = match args.launcher {
        LauncherArg::Torchrun => Launcher::Torchrun,
        LauncherArg::Srun => Launcher::Srun,
    };
    let train_iters = args.iterations as u64;
    Ok(match engine {
        LaunchEngine::Megatron => {
            let mut settings = LaunchSettings::new(args.megatron_path.clone(), launcher);
            settings.train_iters = train_iters;
            Cluster::Megatron(settings)
        }
        LaunchEngine::Torchtitan => {
            let Some(base) = &args.torchtitan_config else {
                return Err(LaunchError::BadTorchtitanConfig {
                    value: "(not given)".into(),
                    problem: "--launch torchtitan needs it".into(),
                }
                .into());
            };
            let base = TorchtitanBase::parse(base)?;
            base.check_model(&plan.model)?;
            Cluster::Torchtitan(TorchtitanSettings {
                base,
                launcher,
                train_iters,
            })
        }
        LaunchEngine::Torch => Cluster::Torch(Box::new(torch_settings(args, plan, prior)?)),
    })
}

/// `--launch torch`'s settings: the ranks (the plan's GPU count unless
/// given, at most two per core), the device and precision.
fn torch_settings(
    args: &ValidateArgs,
    plan: &PlanFile,
    prior: &CostModel,
) -> Result<TorchSettings> {
    let ranks = args.ranks.unwrap_or(plan.gpus);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    if ranks > torch_launch::max_ranks(cores) {
        bail!(
            "--ranks {ranks}: this machine has {cores} cores and runs at most {} ranks (two per core); plan for fewer GPUs",
            torch_launch::max_ranks(cores)
        );
    }
    let device = match args.device.as_str() {
        "cpu" => TrialDevice::Cpu,
        d if d == "cuda" || d.starts_with("cuda:") => TrialDevice::Cuda,
        other => bail!("--device {other}: --launch torch runs on cpu or cuda"),
    };
    let dtype = match args.dtype.as_str() {
        "bf16" | "fp32" => args.dtype.clone(),
        other => bail!("--dtype {other}: --launch torch computes in bf16 or fp32"),
    };
    Ok(TorchSettings {
        python: args.python.clone(),
        ranks,
        device,
        dtype,
        warmup: 2,
        iterations: args.iterations as u64,
        threads_per_rank: 1,
        // On the CPU the ranks share the host's memory; --memory-limit sets a
        // rank's share anywhere.
        memory_per_rank_bytes: args.memory_limit.map(|b| b.0).or_else(|| {
            (device == TrialDevice::Cpu)
                .then(paratune::measure::memory::host_memory_bytes)
                .flatten()
                .map(|bytes| bytes / ranks as f64)
        }),
        cost: prior.clone(),
    })
}
