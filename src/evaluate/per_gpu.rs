//! Run tables whose rows name several GPUs (a `gpu` column): each row is
//! predicted on nodes of its own GPU with that GPU's cost model, and
//! `predict --runs` writes every row back with its prediction.

use crate::cluster::{NodeGroup, builtin_node};
use crate::coefficients::{CostModel, default_cost_model};
use crate::cost::{Scenario, predict};
use crate::profile::Measurements;
use crate::runs::{Run, RunTable, Runs};
use std::collections::HashMap;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The nodes and cost model each GPU of a run table is predicted with.
pub struct PerGpu {
    base: (NodeGroup, CostModel),
    /// Other GPUs, or other node sizes (a row's `gpus_per_node`), with
    /// their nodes and cost models.
    others: Vec<(NodeGroup, CostModel)>,
}

/// Whether the cost model was chosen for every row or is each GPU's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostModelChoice {
    /// Given (`--cost-model`): every GPU's rows use it.
    Given,
    /// Each GPU's default model.
    PerGpu,
}

impl PerGpu {
    /// Nodes of the same shape as `base` for every other GPU the runs
    /// name (of the size a row's `gpus_per_node` gives, where it does),
    /// predicted with `cost` if it was given, else each GPU's default
    /// model. The node count is raised to 1,024 so that no row's GPU count
    /// runs out of nodes.
    pub fn new(
        runs: &[Run],
        base: &NodeGroup,
        cost: &CostModel,
        choice: CostModelChoice,
    ) -> PerGpu {
        let mut base = base.clone();
        base.nodes = base.nodes.max(1 << 10);
        let mut others: Vec<(NodeGroup, CostModel)> = Vec::new();
        for run in runs {
            let gpu = run.gpu.as_deref().unwrap_or(&base.gpu.name);
            let mut group = if gpu == base.gpu.name {
                base.clone()
            } else {
                builtin_node(gpu, base.nodes).expect("run tables name built-in GPUs")
            };
            group.gpus_per_node = run.gpus_per_node.unwrap_or(group.gpus_per_node);
            let same = |g: &NodeGroup| {
                g.gpu.name == group.gpu.name && g.gpus_per_node == group.gpus_per_node
            };
            if same(&base) || others.iter().any(|(g, _)| same(g)) {
                continue;
            }
            group.nodes = base.nodes;
            let cost = match choice {
                CostModelChoice::Given => cost.clone(),
                CostModelChoice::PerGpu if gpu == base.gpu.name => cost.clone(),
                CostModelChoice::PerGpu => default_cost_model(gpu),
            };
            others.push((group, cost));
        }
        PerGpu {
            base: (base, cost.clone()),
            others,
        }
    }

    pub fn of(&self, run: &Run) -> (&NodeGroup, &CostModel) {
        let base = &self.base.0;
        let gpu = run.gpu.as_deref().unwrap_or(&base.gpu.name);
        let matches = |g: &NodeGroup| {
            g.gpu.name == gpu && run.gpus_per_node.is_none_or(|n| n == g.gpus_per_node)
        };
        if matches(base) {
            return (&self.base.0, &self.base.1);
        }
        self.others
            .iter()
            .find(|(g, _)| matches(g))
            .map(|(group, cost)| (group, cost))
            .expect("every GPU of the runs has its setting")
    }

    /// Whether a run is on the base GPU, whose profile it may use.
    pub fn is_base(&self, run: &Run) -> bool {
        run.gpu.as_ref().is_none_or(|g| *g == self.base.0.gpu.name)
    }

    pub fn several(&self) -> bool {
        !self.others.is_empty()
    }

    /// `a100-80gb with a100-megatron, h100-sxm with a100-megatron@h100-sxm`.
    pub fn describe(&self) -> String {
        let mut seen: Vec<(&str, &str)> = Vec::new();
        for (group, cost) in std::iter::once(&self.base).chain(&self.others) {
            let pair = (group.gpu.name.as_str(), cost.name.as_str());
            if !seen.contains(&pair) {
                seen.push(pair);
            }
        }
        seen.iter()
            .map(|(gpu, cost)| format!("{gpu} with {cost}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// What `predict --runs` adds to every row: `predicted_peak_memory_gib` is
/// the device memory the peak stage needs (reserved plus what lives outside
/// PyTorch), which `fits` is judged on; the allocated and reserved peaks are
/// PyTorch's, of the peak stage, of the first (which torchtitan logs) and
/// of the last (which Megatron-LM logs).
pub const PREDICTED_COLUMNS: [&str; 10] = [
    "predicted_iter_ms",
    "predicted_tflops_per_gpu",
    "predicted_peak_memory_gib",
    "predicted_peak_allocated_gib",
    "predicted_peak_reserved_gib",
    "predicted_first_stage_allocated_gib",
    "predicted_first_stage_reserved_gib",
    "predicted_last_stage_allocated_gib",
    "predicted_last_stage_reserved_gib",
    "fits",
];

/// Every row of `table` with [`PREDICTED_COLUMNS`] appended: the
/// prediction of the rows `runs` read (a profile's measurements for the
/// base GPU's rows), or, for a row left out, empty cells and why.
pub fn predicted_rows(
    table: &RunTable,
    runs: &Runs,
    settings: &PerGpu,
    measurements: Option<&Measurements>,
) -> (Vec<String>, Vec<Vec<String>>) {
    let mut headers = table.headers.clone();
    headers.extend(PREDICTED_COLUMNS.map(String::from));
    let by_line: HashMap<usize, &Run> = runs.runs.iter().map(|r| (r.line, r)).collect();
    let skipped: HashMap<usize, &str> = runs
        .skipped
        .iter()
        .map(|s| (s.line, s.reason.as_str()))
        .collect();
    let rows = table
        .rows
        .iter()
        .enumerate()
        .map(|(index, cells)| {
            let line = table.line(index);
            let mut row = cells.clone();
            match by_line.get(&line) {
                Some(run) => row.extend(predicted_cells(run, settings, measurements)),
                None => {
                    row.extend(std::iter::repeat_n(
                        String::new(),
                        PREDICTED_COLUMNS.len() - 1,
                    ));
                    row.push(format!(
                        "not predicted: {}",
                        skipped.get(&line).unwrap_or(&"")
                    ));
                }
            }
            row
        })
        .collect();
    (headers, rows)
}

fn predicted_cells(
    run: &Run,
    settings: &PerGpu,
    measurements: Option<&Measurements>,
) -> [String; 10] {
    let (group, cost) = settings.of(run);
    let scenario = Scenario::new(&run.model, run.global_batch, group, run.gpus, cost)
        .with_profile(measurements.filter(|_| settings.is_base(run)));
    let p = predict(&scenario, &run.config);
    let gib = |bytes: f64| format!("{:.3}", bytes / GIB);
    [
        format!("{:.3}", p.iteration_s * 1e3),
        format!("{:.2}", p.tflops_per_gpu),
        format!("{:.2}", p.peak_memory_gib()),
        gib(p.peak_allocated_bytes),
        gib(p.peak_reserved_bytes),
        gib(p.first_stage_allocated_bytes),
        gib(p.first_stage_reserved_bytes),
        gib(p.last_stage_allocated_bytes),
        gib(p.last_stage_reserved_bytes),
        p.fits.to_string(),
    ]
}
