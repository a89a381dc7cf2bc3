//! Run tables whose rows name several GPUs (a `gpu` column): each row is
//! predicted on nodes of its own GPU with that GPU's cost model, and
//! `predict --runs` writes every row back with its prediction.

use crate::cluster::{NodeGroup, builtin_node};
use crate::coefficients::{CostModel, default_cost_model};
use crate::cost::{Scenario, TimeBreakdown, predict};
use crate::profile::Measurements;
use crate::runs::{BaseNode, Run, RunTable, Runs};
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
            let (gpu, per_node) = node_of(&base, run);
            let same = |g: &NodeGroup| g.gpu.name == gpu && g.gpus_per_node == per_node;
            if same(&base) || others.iter().any(|(g, _)| same(g)) {
                continue;
            }
            let mut group = if gpu == base.gpu.name {
                base.clone()
            } else {
                builtin_node(&gpu, base.nodes).expect("run tables name built-in GPUs")
            };
            group.gpus_per_node = per_node;
            group.nodes = base.nodes;
            let cost = match choice {
                CostModelChoice::Given => cost.clone(),
                CostModelChoice::PerGpu if gpu == base.gpu.name => cost.clone(),
                CostModelChoice::PerGpu => default_cost_model(&gpu),
            };
            others.push((group, cost));
        }
        PerGpu {
            base: (base, cost.clone()),
            others,
        }
    }

    pub fn of(&self, run: &Run) -> (&NodeGroup, &CostModel) {
        let (gpu, per_node) = node_of(&self.base.0, run);
        let matches = |g: &NodeGroup| g.gpu.name == gpu && g.gpus_per_node == per_node;
        if matches(&self.base.0) {
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

/// The GPU a run is on and the GPUs per node it uses
/// ([`BaseNode::gpus_per_node_of`], as the rows were checked).
fn node_of(base: &NodeGroup, run: &Run) -> (String, u64) {
    let base = BaseNode::from(base);
    (base.gpu_of(run).to_string(), base.gpus_per_node_of(run))
}

/// What `predict --runs` adds to every row: `predicted_peak_memory_gib` is
/// the device memory the peak stage needs (reserved plus what lives outside
/// PyTorch), which `fits` is judged on; the allocated and reserved peaks are
/// PyTorch's, of the peak stage, of the first (which torchtitan logs) and
/// of the last (which Megatron-LM logs). After `fits` come the predicted
/// iteration's parts ([`TimeBreakdown::keyed_parts`]) as
/// `predicted_<part>_ms`, to show where a row's gap to its measurement is.
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
    headers.extend(part_columns());
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
                    row.extend(std::iter::repeat_n(String::new(), part_columns().len()));
                }
            }
            row
        })
        .collect();
    (headers, rows)
}

/// `predicted_<part>_ms` for every part of an iteration's time.
fn part_columns() -> Vec<String> {
    TimeBreakdown::default()
        .keyed_parts()
        .iter()
        .map(|(key, _)| format!("predicted_{key}_ms"))
        .collect()
}

fn predicted_cells(
    run: &Run,
    settings: &PerGpu,
    measurements: Option<&Measurements>,
) -> Vec<String> {
    let (group, cost) = settings.of(run);
    let scenario = Scenario::new(&run.model, run.global_batch, group, run.gpus, cost)
        .with_profile(measurements.filter(|_| settings.is_base(run)));
    let p = predict(&scenario, &run.config);
    let gib = |bytes: f64| format!("{:.3}", bytes / GIB);
    let mut cells = vec![
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
    ];
    cells.extend(
        p.time
            .keyed_parts()
            .iter()
            .map(|(_, seconds)| format!("{:.3}", seconds * 1e3)),
    );
    cells
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::AttentionKind;
    use crate::runs::{RowDefaults, runs_from_table};

    /// Rows of one GPU on nodes of two sizes are each predicted on their
    /// own: a row without `gpus_per_node` on the GPU's built-in node.
    #[test]
    fn rows_of_one_gpu_on_two_node_sizes_get_their_own_nodes() {
        let text = "model,gpu,gpus,gpus_per_node,global_batch,micro_batch,tp,pp,iter_ms\n\
                    llama3-8b,gb200,128,64,128,1,1,1,100\n\
                    llama3-8b,gb200,72,,72,1,1,1,100\n\
                    llama3-8b,h100-sxm,8,,8,1,1,1,100\n";
        let table = RunTable::parse(text, "t.csv").unwrap();
        let defaults = RowDefaults::gpt(
            50257,
            1024,
            AttentionKind::Flash,
            crate::config::Recompute::None,
        );
        let runs = runs_from_table(&table, &defaults, BaseNode::DGX_A100).unwrap();
        let base = builtin_node("h100-sxm", 1).unwrap();
        let cost = CostModel::datasheet();
        let per = PerGpu::new(&runs, &base, &cost, CostModelChoice::PerGpu);
        let nodes: Vec<(String, u64)> = runs
            .iter()
            .map(|r| {
                let (g, _) = per.of(r);
                (g.gpu.name.clone(), g.gpus_per_node)
            })
            .collect();
        assert_eq!(
            nodes,
            [
                ("gb200".to_string(), 64),
                ("gb200".to_string(), 72),
                ("h100-sxm".to_string(), 8)
            ]
        );
    }
}
