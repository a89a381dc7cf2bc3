//! Text rendering for the terminal: tables, breakdowns, numbers.

use anyhow::{Result, anyhow};
use paratune::coefficients::Coefficients;
use paratune::config::{ParallelConfig, on_off};
use paratune::cost::{Prediction, StageMemory, TimeBreakdown};
use paratune::runs::write_csv;
use std::fmt::Write;
use std::io::Write as _;

pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

pub use paratune::units::{percent, seconds, thousands};

/// Which optional columns the ranking table shows.
#[derive(Debug, Clone, Copy)]
pub struct RankingColumns {
    /// The cost model's 90% band of the iteration time.
    pub band: bool,
    /// Context and expert parallelism (shown when a model has experts or
    /// a candidate splits the sequence).
    pub context_and_experts: bool,
    /// The input embedding's sync method (shown when the search could
    /// pick a sparse one).
    pub embedding_sync: bool,
    /// The GEMMs' number format (shown when the search compared several:
    /// an FP8 row's MFU is over the FP8 peak, a bf16 row's over bf16's).
    pub precision: bool,
    /// PyTorch's allocator (shown when the search compared both: the
    /// twins differ in memory only).
    pub allocator: bool,
}

/// The precision cell, inserted after the CUDA-graphs switch when shown.
fn precision_cell(c: Option<&ParallelConfig>, columns: RankingColumns) -> String {
    if !columns.precision {
        return String::new();
    }
    format!(" {:>4}", c.map_or("prec", |c| c.precision.name()))
}

/// The precision and allocator cells, inserted after the CUDA-graphs
/// switch when shown.
fn after_graphs_cells(c: Option<&ParallelConfig>, columns: RankingColumns) -> String {
    let allocator = if columns.allocator {
        let name = c.map_or("alloc", |c| {
            if c.expandable_segments {
                "expand"
            } else {
                "fixed"
            }
        });
        format!(" {name:>6}")
    } else {
        String::new()
    };
    format!("{}{allocator}", precision_cell(c, columns))
}

/// The embedding-sync cell, inserted after the sharding when shown.
fn sync_cell(c: Option<&ParallelConfig>, columns: RankingColumns) -> String {
    if !columns.embedding_sync {
        return String::new();
    }
    format!(" {:<17}", c.map_or("emb sync", |c| c.embedding_sync.name()))
}

/// The cp and ep/etp cells, inserted after dp when shown.
fn degrees_cells(c: Option<&ParallelConfig>, columns: RankingColumns) -> String {
    if !columns.context_and_experts {
        return String::new();
    }
    match c {
        None => format!(" {:>3} {:>7}", "cp", "ep/etp"),
        Some(c) => format!(" {:>3} {:>7}", c.cp, format!("{}/{}", c.ep, c.etp)),
    }
}

/// Header and cells of the ranking table.
pub fn ranking_header(columns: RankingColumns) -> String {
    let with_band = columns.band;
    let header = format!(
        "{:>4} {:>3} {:>3} {:>5} {:>4} {:<16} {:<9} {:>3} {:<19} {:>5} {:<9} {:<16} {:>6} {:>9} {:>11} {:>7} {:>6} {:>12}",
        "#",
        "tp",
        "pp",
        format!("{:>5}{}", "dp", degrees_cells(None, columns)),
        "mb",
        "schedule",
        "recompute",
        "sp",
        format!("{:<19}{}", "sharding", sync_cell(None, columns)),
        "bpipe",
        "layers",
        "overlap",
        format!("{:>6}{}", "graphs", after_graphs_cells(None, columns)),
        "iter",
        "tokens/s",
        "TFLOP/s",
        "MFU",
        "mem GiB"
    );
    if with_band {
        format!("{header} {:>17}", "iter 90% band")
    } else {
        header
    }
}

pub fn schedule_name(c: &ParallelConfig) -> String {
    if c.virtual_stages > 1 {
        format!("{} v={}", c.schedule.name(), c.virtual_stages)
    } else {
        c.schedule.name().to_string()
    }
}

/// Layers per stage: `even`, or first/others/last (`7/8/7`).
pub fn split_name(c: &ParallelConfig, layers: u64) -> String {
    if !c.uneven() {
        return "even".into();
    }
    format!(
        "{}/{}/{}",
        c.stage_layers(layers, 0),
        c.middle_stage_layers(layers),
        c.stage_layers(layers, c.pp - 1)
    )
}

/// The overlaps a configuration runs (`grad,param,tp`), or `-`.
pub fn overlap_name(c: &ParallelConfig) -> String {
    let on: Vec<&str> = [
        (c.overlap_grad_reduce, "grad"),
        (c.overlap_param_gather, "param"),
        (c.tp_comm_overlap, "tp"),
        (c.ep_comm_overlap, "ep"),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .map(|(_, name)| *name)
    .collect();
    if on.is_empty() {
        "-".into()
    } else {
        on.join(",")
    }
}

/// The sharding, with hybrid sharding's group: `full/8` is the state
/// sharded over groups of 8 data-parallel ranks.
fn sharding_name(c: &ParallelConfig) -> String {
    match c.dp_shard {
        Some(group) => format!("{}/{group}", c.optimizer_sharding.name()),
        None => c.optimizer_sharding.name().to_string(),
    }
}

/// One row of the ranking; `band` is the relative error that nine
/// predictions in ten stay within, when the cost model has measured it.
pub fn ranking_row(
    rank: usize,
    c: &ParallelConfig,
    layers: u64,
    p: &Prediction,
    band: Option<f64>,
    columns: RankingColumns,
) -> String {
    let row = format!(
        "{:>4} {:>3} {:>3} {:>5} {:>4} {:<16} {:<9} {:>3} {:<19} {:>5} {:<9} {:<16} {:>6} {:>9} {:>11} {:>7.1} {:>6} {:>12}",
        rank,
        c.tp,
        c.pp,
        format!("{:>5}{}", c.dp, degrees_cells(Some(c), columns)),
        c.micro_batch,
        schedule_name(c),
        c.recompute.name(),
        on_off(c.sequence_parallel),
        format!("{:<19}{}", sharding_name(c), sync_cell(Some(c), columns)),
        on_off(c.bpipe),
        split_name(c, layers),
        overlap_name(c),
        format!(
            "{:>6}{}",
            c.cuda_graphs.name(),
            after_graphs_cells(Some(c), columns)
        ),
        seconds(p.iteration_s),
        thousands(p.tokens_per_s),
        p.tflops_per_gpu,
        percent(p.mfu),
        format!(
            "{:.1}/{:.1}",
            p.peak_memory_bytes / GIB,
            p.usable_memory_bytes / GIB
        ),
    );
    match band {
        Some(b) => format!(
            "{row} {:>17}",
            format!(
                "{}..{}",
                seconds(p.iteration_s * (1.0 - b)),
                seconds(p.iteration_s * (1.0 + b))
            )
        ),
        None => row,
    }
}

/// How configuration `b` differs from `a`, by the words their one-line
/// forms differ in: `with X`, `without Y`, or `X instead of Y`.
pub fn config_difference(a: &ParallelConfig, b: &ParallelConfig) -> String {
    let (a, b) = (a.to_string(), b.to_string());
    let only = |x: &str, y: &str| -> Vec<String> {
        let others: Vec<&str> = y.split_whitespace().collect();
        x.split_whitespace()
            .filter(|w| !others.contains(w))
            .map(String::from)
            .collect()
    };
    let (gained, lost) = (only(&b, &a).join(" "), only(&a, &b).join(" "));
    match (gained.is_empty(), lost.is_empty()) {
        (true, true) => "the same configuration".into(),
        (false, true) => format!("with {gained}"),
        (true, false) => format!("without {lost}"),
        (false, false) => format!("{gained} instead of {lost}"),
    }
}

pub fn breakdown(out: &mut String, time: &TimeBreakdown) {
    let total = time.total();
    let _ = writeln!(out, "  time per iteration: {}", seconds(total));
    for (name, value) in time.parts() {
        if value > 0.0 {
            let _ = writeln!(
                out,
                "    {:<30} {:>10} {:>7}",
                name,
                seconds(value),
                percent(value / total)
            );
        }
    }
}

/// Each parameter group's data-parallel sync (stage 0), before overlap.
pub fn group_syncs(out: &mut String, groups: &[paratune::cost::GroupSync], sharded: bool) {
    if groups.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "  data-parallel sync per parameter group (stage 0, whole collectives before overlap):"
    );
    for g in groups {
        let _ = writeln!(
            out,
            "    {:<20} {:<21} {:>10}  ({:.1} M parameters over {} ranks)",
            g.group,
            match g.method {
                // The distributed optimizer's form of the dense sync.
                paratune::config::SyncMethod::AllReduce if sharded => "reduce-scatter+gather",
                method => method.name(),
            },
            seconds(g.seconds),
            g.params / 1e6,
            g.ranks
        );
    }
}

/// The input embedding's sync by each method, the chosen one marked.
pub fn embedding_sync(
    out: &mut String,
    options: &[paratune::cost::sparse::EmbeddingSync; 3],
    chosen: paratune::config::SyncMethod,
) {
    let first = &options[0];
    let _ = writeln!(
        out,
        "  input embedding sync (stage 0, per iteration): {} of {} rows touched per rank, {} ranks",
        thousands(first.rows),
        thousands(first.table_rows),
        first.ranks
    );
    for option in options {
        let servers = match option.partitions {
            0 => String::new(),
            p => format!(" ({p} servers)"),
        };
        let _ = writeln!(
            out,
            "    {:<18} {:>10}{servers}{}{}",
            option.method.name(),
            seconds(option.seconds),
            if option.measured { " measured" } else { "" },
            if option.method == chosen {
                "  <- this configuration"
            } else {
                ""
            }
        );
    }
}

/// A line for a configuration that the allocator's fragmentation
/// allowance alone puts over the usable memory: what would let it run.
pub fn fragmentation_note(out: &mut String, prediction: &Prediction) {
    if let Some(allowance) = prediction.over_only_by_fragmentation() {
        let _ = writeln!(
            out,
            "  over only by the allocator's fragmentation allowance ({:.1} GiB): it fits with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which loses no memory between cached blocks (--expandable-segments on counts it so and exports it)",
            allowance / GIB
        );
    }
}

/// Says why an MFU above 100% is no error: the model FLOPs count every
/// query against every key, as Megatron-LM logs them, and a causal kernel
/// computes half of those products.
pub fn mfu_note(out: &mut String, prediction: &Prediction) {
    if prediction.mfu > 1.0 {
        let _ = writeln!(
            out,
            "  MFU passes 100% because the model FLOPs count every query against every key, as Megatron-LM logs them, while a causal kernel computes half of those products; at this sequence that half is most of the work"
        );
    }
}

/// Memory per stage; long pipelines show the first, the peak and the last
/// stages and say how many were left out. `k` holds the fragmentation
/// shares the allocator column comes from.
pub fn stage_memory(
    out: &mut String,
    stages: &[StageMemory],
    (usable, peak_stage): (f64, u64),
    k: &Coefficients,
) {
    let _ = writeln!(
        out,
        "  memory per GPU by pipeline stage (GiB; usable {:.1}):",
        usable / GIB
    );
    let _ = writeln!(
        out,
        "    {:>5} {:>8} {:>9} {:>9} {:>11} {:>9} {:>6} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8}  fits",
        "stage",
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "in-flight",
        "loss",
        "buffers",
        "allocated",
        "allocator",
        "reserved",
        "runtime",
        "total",
    );
    let show = |i: usize| i < 2 || i + 2 >= stages.len() || i as u64 == peak_stage;
    let dispatcher = stages
        .iter()
        .map(|s| s.dispatcher_buffers)
        .fold(0.0, f64::max);
    let mut skipped = 0;
    for (i, s) in stages.iter().enumerate() {
        if !show(i) {
            skipped += 1;
            continue;
        }
        if skipped > 0 {
            let _ = writeln!(
                out,
                "    ... {skipped} stage(s) between, each below the peak"
            );
            skipped = 0;
        }
        let _ = writeln!(
            out,
            "    {:>5} {:>8.2} {:>9.2} {:>9.2} {:>11.2} {:>9.1} {:>6.2} {:>8.2} {:>9.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2}  {}",
            s.stage,
            s.weights / GIB,
            s.gradients / GIB,
            s.optimizer_states / GIB,
            s.activations / GIB,
            s.in_flight,
            s.loss / GIB,
            s.buffers / GIB,
            s.allocated() / GIB,
            s.allocator_reserve / GIB,
            s.reserved() / GIB,
            s.outside_allocator() / GIB,
            s.total() / GIB,
            if s.total() <= usable { "yes" } else { "NO" }
        );
    }
    if dispatcher > 0.0 {
        let _ = writeln!(
            out,
            "    runtime includes the flex dispatcher's buffers, {:.2} GiB per GPU on stages with MoE layers (outside PyTorch's allocator)",
            dispatcher / GIB
        );
    }
    allocator_note(out, stages, k);
}

/// What the allocator column is: the caching allocator's fragmentation
/// as a share of allocated, by the coefficient of each stage's kind
/// (experts or not).
fn allocator_note(out: &mut String, stages: &[StageMemory], k: &Coefficients) {
    let share = |s: &StageMemory| s.allocator_reserve / s.allocated();
    let shares: Vec<f64> = stages
        .iter()
        .filter(|s| s.allocated() > 0.0 && s.allocator_reserve > 0.0)
        .map(share)
        .collect();
    let has = |value: f64| shares.iter().any(|s| (s - value).abs() < 1e-9);
    let mut parts = Vec::new();
    let moe = k.moe_allocator_fragmentation;
    let dense = k.allocator_fragmentation;
    let both = has(moe) && has(dense) && moe != dense;
    if has(moe) && moe != dense {
        parts.push(format!(
            "{:.1}% of allocated on {}, whose tensor sizes follow the routing (`moe_allocator_fragmentation`)",
            100.0 * moe,
            if both { "stages with experts" } else { "a model with experts" }
        ));
    }
    if has(dense) {
        parts.push(format!(
            "{:.1}% of allocated on {} (`allocator_fragmentation`)",
            100.0 * dense,
            if both {
                "the dense stages"
            } else {
                "a dense model"
            }
        ));
    }
    if parts.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "    allocator: the caching allocator's fragmentation, {}; none with --expandable-segments on",
        parts.join(", ")
    );
}

/// The largest differences between two breakdowns, as "+0.31 s pipeline bubble".
pub fn differences(diffs: &[(&'static str, f64)], limit: usize) -> String {
    diffs
        .iter()
        .take(limit)
        .map(|(name, delta)| {
            format!(
                "{}{} {name}",
                if *delta >= 0.0 { "+" } else { "-" },
                seconds(delta.abs())
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Writes to standard output. A reader that stops early (`| head`) is not an
/// error: the rest is dropped quietly instead of panicking like `print!`.
pub fn emit(text: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(anyhow!("cannot write to standard output: {e}")),
    }
}

pub fn emit_csv(headers: &[String], rows: &[Vec<String>]) -> Result<()> {
    let mut buffer = Vec::new();
    write_csv(&mut buffer, headers, rows)?;
    emit(&String::from_utf8_lossy(&buffer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_differ_by_the_words_of_their_one_line_forms() {
        let a = ParallelConfig {
            cuda_graphs: paratune::config::CudaGraphs::Layers,
            ..ParallelConfig::default()
        };
        let b = ParallelConfig::default();
        assert_eq!(config_difference(&a, &b), "without graphs=on");
        assert_eq!(config_difference(&b, &a), "with graphs=on");
        let c = ParallelConfig {
            micro_batch: 2,
            ..b
        };
        assert_eq!(config_difference(&b, &c), "mb2 instead of mb1");
        assert_eq!(config_difference(&b, &b), "the same configuration");
    }
}
