//! `paratune calibrate` (wired to the calibration library).

use super::args::CalibrateArgs;
use anyhow::{Result, bail};

pub fn run(_args: &CalibrateArgs) -> Result<()> {
    bail!("calibrate: not available yet")
}
