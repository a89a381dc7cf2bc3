//! `paratune validate --launch megatron`: cluster trials through Megatron-LM.

use super::args::ValidateArgs;
use anyhow::{Result, bail};
use paratune::plan_file::PlanFile;
use std::path::Path;

pub fn run(_args: &ValidateArgs, _plan: &PlanFile, _out: &Path) -> Result<()> {
    bail!("cluster trials: being wired")
}
