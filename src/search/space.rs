//! The values each search dimension may take. A dimension left open takes
//! every value that can make sense for the job; a dimension the user fixed
//! or restricted takes exactly the values given, and combinations that break
//! a rule are counted as dropped rather than silently skipped.

use super::Job;
use crate::config::{
    CpComm, CrossEntropyFusion, CudaGraphs, Dispatcher, Engine, Fp8Recipe, GradReduce,
    OptimizerSharding, ParallelConfig, Precision, Recompute, RecomputeModules, ScheduleKind,
    StageOrder, SyncMethod, WgradDeferral,
};
use crate::model::{AttentionKind, ModelSpec};
use std::borrow::Cow;
use std::ops::ControlFlow;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchSpace {
    pub tp: Option<Vec<u64>>,
    pub pp: Option<Vec<u64>>,
    pub dp: Option<Vec<u64>>,
    pub micro_batch: Option<Vec<u64>>,
    pub schedule: Option<Vec<ScheduleKind>>,
    pub virtual_stages: Option<Vec<u64>>,
    pub recompute: Option<Vec<Recompute>>,
    /// What selective recomputation redoes: the attention core unless given.
    pub recompute_modules: Option<RecomputeModules>,
    /// With none given, try each set [`RecomputeModules::searched`] names
    /// (Megatron-LM only). Off unless asked: for DeepSeek-V3 it multiplies
    /// the search by 2.6.
    pub search_recompute_modules: bool,
    pub sequence_parallel: Option<Vec<bool>>,
    pub optimizer_sharding: Option<Vec<OptimizerSharding>>,
    pub bpipe: Option<Vec<bool>>,
    pub attention: Option<Vec<AttentionKind>>,
    /// Layers of the first / last stage (`None` in a list: the even share).
    pub first_stage_layers: Option<Vec<u64>>,
    pub last_stage_layers: Option<Vec<u64>>,
    pub overlap_grad_reduce: Option<Vec<bool>>,
    pub overlap_param_gather: Option<Vec<bool>>,
    pub tp_comm_overlap: Option<Vec<bool>>,
    pub ep_comm_overlap: Option<Vec<bool>>,
    pub fp8_param_gather: Option<Vec<bool>>,
    /// PyTorch's expandable segments: as the engine's launcher sets them
    /// (`Engine::launches_expandable_segments`) unless given.
    pub expandable_segments: Option<Vec<bool>>,
    /// Tried: off and per layer unless given (a whole iteration's graph
    /// only when asked for: Megatron-LM calls it experimental); off only
    /// on a CPU standing in for a GPU.
    pub cuda_graphs: Option<Vec<CudaGraphs>>,
    pub stage_order: Option<Vec<StageOrder>>,
    /// The one engine the search plans for.
    pub engine: Engine,
    pub compile: Option<Vec<bool>>,
    pub ac_frequency: Option<Vec<u64>>,
    /// Hybrid-sharding groups (torchtitan's `data_parallel_shard_degree`);
    /// a value equal to dp is plain sharding.
    pub dp_shard: Option<Vec<u64>>,
    /// Context-parallel degrees, and how their ranks exchange keys and values.
    pub cp: Option<Vec<u64>>,
    pub cp_comm: Option<Vec<CpComm>>,
    /// Expert-parallel and expert-tensor-parallel degrees (MoE models).
    pub ep: Option<Vec<u64>>,
    pub etp: Option<Vec<u64>>,
    pub dispatcher: Option<Vec<Dispatcher>>,
    /// bf16 unless given: FP8 changes the numerics, so it is the user's call.
    pub precision: Option<Vec<Precision>>,
    /// The FP8 candidates' recipe; the GPU's default unless given.
    pub fp8_recipe: Option<Fp8Recipe>,
    /// fp32 unless given: reducing gradients in bf16 changes the numerics.
    pub grad_reduce: Option<Vec<GradReduce>>,
    /// Off unless given, as Megatron-LM defaults.
    pub cross_entropy_fusion: Option<Vec<CrossEntropyFusion>>,
    /// Off unless given: deferral trades the last stage's memory for its
    /// time, so it is the user's call.
    pub wgrad_deferral: Option<Vec<WgradDeferral>>,
    /// Layers whose activations go to host memory: none unless given.
    pub cpu_offload_layers: Option<Vec<u64>>,
    /// How an untied input embedding syncs: all-reduce unless given, the
    /// one method Megatron-LM and torchtitan run; tied embeddings and a
    /// single data-parallel rank always all-reduce.
    pub embedding_sync: Option<Vec<SyncMethod>>,
}

/// The sequence length from which the search tries context parallelism
/// unless told otherwise: Megatron-Core's MoE guide ("use CP when sequence
/// length >= 8K", `megatron/core/transformer/moe/README.md`), the point
/// below which splitting the sequence costs more than it saves.
pub const CONTEXT_PARALLEL_FROM: u64 = 8192;

/// How many layers the search may take off an end stage (or put on the
/// others) against the even share: enough for the embedding's and the
/// output head's share of a stage, few enough to keep the search small.
const END_STAGE_DEFICIT: u64 = 2;

/// The splits of `layers` over `pp` stages of `v` chunks the search tries
/// when the user gave none: the even one where it exists, and the splits
/// that give the first and last stage up to [`END_STAGE_DEFICIT`] chunks'
/// layers fewer than the others (as Llama 3 405B trained at pp 16, 126 =
/// 7 + 14 x 8 + 7). Counts are in layers; every stage's count divides by v.
pub fn default_splits(layers: u64, pp: u64, v: u64) -> Vec<(Option<u64>, Option<u64>)> {
    default_splits_with(layers, pp, v, 0)
}

/// [`default_splits`] with the last stage's window moved `last_extra`
/// chunks lower: the layers of the multi-token prediction modules it also
/// runs (a last stage as full as the others would be the slowest).
pub fn default_splits_with(
    layers: u64,
    pp: u64,
    v: u64,
    last_extra: u64,
) -> Vec<(Option<u64>, Option<u64>)> {
    let mut splits = Vec::new();
    if pp == 0 || v == 0 {
        return splits;
    }
    if layers.is_multiple_of(pp * v) {
        splits.push((None, None));
    }
    // Megatron-LM's account-for-embedding-and-loss split, the one uneven
    // split whose end stages need not hold whole chunks (Llama 3.1 405B's
    // 126 layers at pp 8 x v 8 in NeMo's recipes: 15 + 16 x 6 + 15).
    if let Some(split) = crate::config::accounted_split(layers, pp, v, true, true) {
        splits.push(split);
    }
    // The same with the last stage's prediction modules counted as layers
    // (DeepSeek-V3's 61 + embedding + module + loss = 64 at pp 4 x v 4 or
    // pp 8 x v 4 in NeMo's recipes), exported as a pipeline layout.
    if last_extra > 0
        && let Some((Some(first), Some(last))) =
            crate::config::accounted_split(layers + last_extra, pp, v, true, true)
        && last > last_extra
    {
        splits.push((Some(first), Some(last - last_extra)));
    }
    if pp < 2 || !layers.is_multiple_of(v) {
        return splits;
    }
    let chunks = layers / v;
    let even = chunks.div_ceil(pp);
    for middle in [even, even + 1] {
        let rest = chunks as i64 - (pp as i64 - 2) * middle as i64;
        for first in middle.saturating_sub(END_STAGE_DEFICIT).max(1)..=middle {
            let last = rest - first as i64;
            if last < 1
                || last as u64 + last_extra > middle
                || (last as u64) + END_STAGE_DEFICIT + last_extra < middle
            {
                continue;
            }
            let last = last as u64;
            // The even split, whether the middle stages hold the even share
            // or, at pp 2, there are none.
            let even_share = (layers.is_multiple_of(pp * v)).then(|| layers / (pp * v));
            if (first == middle && last == middle)
                || (even_share == Some(first) && even_share == Some(last))
            {
                continue;
            }
            let split = (Some(first * v), Some(last * v));
            if !splits.contains(&split) {
                splits.push(split);
            }
        }
    }
    splits
}

/// Walks configurations depth first, calling `f` with each in order.
/// Built as a chain of dimensions ([`Walk::then`]) that starts from one
/// configuration: every dimension visits the values it gives for each
/// configuration the dimensions before it made, in order, so the
/// configurations come in the order of the cartesian product with the
/// first dimension outermost. Nothing is held but the path to the current
/// configuration: the search used to write each level of the product out
/// into a buffer, and copying those buffers cost about a tenth of a search.
trait Walk: Sized {
    fn walk<B>(&self, f: &mut impl FnMut(&ParallelConfig) -> ControlFlow<B>) -> ControlFlow<B>;

    /// This walk with one more dimension: every configuration of it, once
    /// per value `values` gives for it, set with `set`. The values may
    /// depend on the dimensions already set; `values` mostly lends lists
    /// made once per outer point, so nothing allocates per configuration.
    fn then<'v, T, V, S>(self, values: V, set: S) -> Then<Self, V, S>
    where
        T: Clone + 'v,
        V: Fn(&ParallelConfig) -> Cow<'v, [T]>,
        S: Fn(&mut ParallelConfig, T),
    {
        Then {
            before: self,
            values,
            set,
        }
    }
}

/// The configuration a walk starts from.
struct Start(ParallelConfig);

impl Walk for Start {
    fn walk<B>(&self, f: &mut impl FnMut(&ParallelConfig) -> ControlFlow<B>) -> ControlFlow<B> {
        f(&self.0)
    }
}

/// A walk and one more dimension (see [`Walk::then`]).
struct Then<W, V, S> {
    before: W,
    values: V,
    set: S,
}

impl<'v, T, W, V, S> Walk for Then<W, V, S>
where
    T: Clone + 'v,
    W: Walk,
    V: Fn(&ParallelConfig) -> Cow<'v, [T]>,
    S: Fn(&mut ParallelConfig, T),
{
    fn walk<B>(&self, f: &mut impl FnMut(&ParallelConfig) -> ControlFlow<B>) -> ControlFlow<B> {
        self.before.walk(&mut |config| {
            for value in (self.values)(config).iter() {
                let mut next = *config;
                (self.set)(&mut next, value.clone());
                f(&next)?;
            }
            ControlFlow::Continue(())
        })
    }
}

/// `values`, lent.
fn lend<T: Clone>(values: &[T]) -> Cow<'_, [T]> {
    Cow::Borrowed(values)
}

/// The recomputation policies to try, each with its module sets: the set
/// given under selective recomputation, the recipes' sets when asked
/// (Megatron-LM only), else the attention core.
fn recompute_choices(space: &SearchSpace, model: &ModelSpec) -> Vec<(Recompute, RecomputeModules)> {
    let policies = space
        .recompute
        .clone()
        .unwrap_or(Recompute::of(space.engine).to_vec());
    let sets = match space.recompute_modules {
        Some(given) => vec![given],
        None if space.search_recompute_modules && space.engine == Engine::Megatron => {
            RecomputeModules::searched(model)
        }
        None => vec![RecomputeModules::default()],
    };
    policies
        .into_iter()
        .flat_map(|policy| match policy {
            Recompute::Selective => sets.iter().map(|&m| (policy, m)).collect(),
            _ => vec![(policy, RecomputeModules::default())],
        })
        .collect()
}

/// Every combination of the given (or default) gradient formats, loss
/// kernels and wgrad deferrals, in the order nested loops would take them.
fn loss_and_gradients(space: &SearchSpace) -> Vec<(GradReduce, CrossEntropyFusion, WgradDeferral)> {
    let grad_reduce = space.grad_reduce.clone().unwrap_or(vec![GradReduce::Fp32]);
    let fusions = space
        .cross_entropy_fusion
        .clone()
        .unwrap_or(vec![CrossEntropyFusion::Off]);
    let deferrals = space
        .wgrad_deferral
        .clone()
        .unwrap_or(vec![WgradDeferral::Off]);
    let mut all = Vec::with_capacity(grad_reduce.len() * fusions.len() * deferrals.len());
    for &g in &grad_reduce {
        for &f in &fusions {
            for &w in &deferrals {
                all.push((g, f, w));
            }
        }
    }
    all
}

/// Divisors of `n` in increasing order, found up to its square root.
fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d <= n / d {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// The outer loop of the search: tensor, pipeline and data-parallel degrees
/// and the micro-batch size.
#[derive(Debug, Clone, Copy)]
pub struct Outer {
    tp: u64,
    pp: u64,
    cp: u64,
    dp: u64,
    micro_batch: u64,
}

impl SearchSpace {
    pub fn outer(&self, job: &Job) -> Vec<Outer> {
        let tps = self
            .tp
            .clone()
            .unwrap_or_else(|| divisors(job.gpus_per_node()));
        let mut outer = Vec::new();
        for &tp in &tps {
            let pps = self.pp.clone().unwrap_or_else(|| {
                if tp == 0 || !job.gpus.is_multiple_of(tp) {
                    return Vec::new();
                }
                divisors(job.gpus / tp)
                    .into_iter()
                    .filter(|&pp| pp <= job.model.layers)
                    .filter(|&pp| {
                        self.first_stage_layers.is_some()
                            || self.last_stage_layers.is_some()
                            || !default_splits(job.model.layers, pp, 1).is_empty()
                    })
                    .collect()
            });
            for &pp in &pps {
                if tp == 0 || pp == 0 || !job.gpus.is_multiple_of(tp * pp) {
                    continue;
                }
                for cp in self.context_degrees(job, job.gpus / (tp * pp)) {
                    if cp == 0 || !job.gpus.is_multiple_of(tp * pp * cp) {
                        continue;
                    }
                    let dp = job.gpus / (tp * pp * cp);
                    if self.dp.as_ref().is_some_and(|dps| !dps.contains(&dp)) {
                        continue;
                    }
                    let micro_batches = self.micro_batch.clone().unwrap_or_else(|| {
                        if job.global_batch.is_multiple_of(dp) {
                            divisors(job.global_batch / dp)
                        } else {
                            vec![1]
                        }
                    });
                    outer.extend(micro_batches.into_iter().map(|micro_batch| Outer {
                        tp,
                        pp,
                        cp,
                        dp,
                        micro_batch,
                    }));
                }
            }
        }
        outer
    }

    /// The context-parallel degrees to try with `ranks` GPUs left after tp
    /// and pp: the user's, or from [`CONTEXT_PARALLEL_FROM`] tokens on every
    /// degree that divides them and splits the sequence into 2 x cp chunks.
    fn context_degrees(&self, job: &Job, ranks: u64) -> Vec<u64> {
        if let Some(given) = &self.cp {
            return given.clone();
        }
        let seq = job.model.seq_len;
        if seq < CONTEXT_PARALLEL_FROM {
            return vec![1];
        }
        divisors(ranks)
            .into_iter()
            .filter(|&cp| seq.is_multiple_of(2 * cp) || cp == 1)
            .collect()
    }

    /// Every tp x pp x dp product the space allows for `job`'s model and batch
    /// on nodes of `node_size` GPUs, whatever the job's own GPU count.
    pub fn degree_products(&self, job: &Job, node_size: u64) -> Vec<u64> {
        let tps = self.tp.clone().unwrap_or_else(|| divisors(node_size));
        let pps = self
            .pp
            .clone()
            .unwrap_or_else(|| divisors(job.model.layers));
        let dps = self
            .dp
            .clone()
            .unwrap_or_else(|| divisors(job.global_batch));
        let mut products = Vec::new();
        for tp in &tps {
            for pp in &pps {
                products.extend(dps.iter().map(|dp| tp * pp * dp));
            }
        }
        products
    }

    /// The recipe FP8 candidates run on `gpu`: the space's, else the
    /// GPU's default.
    pub fn fp8_recipe_on(&self, gpu: &str) -> Fp8Recipe {
        self.fp8_recipe
            .unwrap_or_else(|| Fp8Recipe::default_on(gpu))
    }

    /// The first/last stage layers to try for `pp` stages of `v` chunks:
    /// the user's lists (crossed), or [`default_splits`].
    fn splits(&self, model: &ModelSpec, pp: u64, v: u64) -> Vec<(Option<u64>, Option<u64>)> {
        let layers = model.layers;
        if self.first_stage_layers.is_none() && self.last_stage_layers.is_none() {
            return default_splits_with(layers, pp, v, model.mtp_layers);
        }
        let side = |given: &Option<Vec<u64>>| -> Vec<Option<u64>> {
            given
                .as_ref()
                .map_or(vec![None], |list| list.iter().map(|&n| Some(n)).collect())
        };
        let mut splits = Vec::new();
        for first in side(&self.first_stage_layers) {
            for last in side(&self.last_stage_layers) {
                splits.push((first, last));
            }
        }
        splits
    }

    /// Expert-parallel degrees to try: the user's, or for an MoE model every
    /// divisor of the experts that, with etp, divides the stage's
    /// tp x cp x dp ranks.
    fn expert_degrees(&self, job: &Job, c: &ParallelConfig) -> Vec<u64> {
        if let Some(given) = &self.ep {
            return given.clone();
        }
        let Some(moe) = job.model.moe else {
            return vec![1];
        };
        let ranks = c.tp * c.cp * c.dp;
        divisors(moe.experts)
            .into_iter()
            .filter(|&ep| ranks.is_multiple_of(ep * c.etp))
            .collect()
    }

    /// Expert-tensor-parallel degrees: the user's, or for an MoE model 1
    /// (experts whole, as Mixtral and DeepSeek-V3 train) and tp
    /// (Megatron-LM's default).
    fn expert_tensor_degrees(&self, job: &Job, c: &ParallelConfig) -> Vec<u64> {
        if let Some(given) = &self.etp {
            return given.clone();
        }
        match job.model.moe {
            None => vec![1],
            Some(_) if c.tp > 1 => vec![1, c.tp],
            Some(_) => vec![1],
        }
    }

    /// Calls `f` with every combination of the remaining dimensions for one
    /// outer point, in order, until it breaks.
    pub fn for_each_inner<B>(
        &self,
        job: &Job,
        o: Outer,
        mut f: impl FnMut(&ParallelConfig) -> ControlFlow<B>,
    ) -> ControlFlow<B> {
        let schedules: Vec<(ScheduleKind, u64)> = self
            .schedule
            .clone()
            .unwrap_or_else(|| {
                if o.pp == 1 {
                    vec![ScheduleKind::OneFOneB]
                } else {
                    ScheduleKind::ALL.to_vec()
                }
            })
            .into_iter()
            .flat_map(|schedule| {
                let stages: Vec<u64> = match (schedule, &self.virtual_stages) {
                    (ScheduleKind::Interleaved, Some(given)) => given.clone(),
                    (ScheduleKind::Interleaved, None) if o.pp > 1 => divisors(job.model.layers)
                        .into_iter()
                        .filter(|&v| v >= 2 && v * o.pp <= job.model.layers)
                        .filter(|&v| !default_splits(job.model.layers, o.pp, v).is_empty())
                        .collect(),
                    (ScheduleKind::Interleaved, None) => vec![2],
                    _ => vec![1],
                };
                stages.into_iter().map(move |v| (schedule, v))
            })
            .collect();
        let dims = InnerDims::new(self, job, o);
        for &(schedule, virtual_stages) in &schedules {
            for (first_stage_layers, last_stage_layers) in
                self.splits(&job.model, o.pp, virtual_stages)
            {
                let stem = Stem {
                    schedule,
                    virtual_stages,
                    first_stage_layers,
                    last_stage_layers,
                };
                dims.variants(stem, &mut f)?;
            }
        }
        ControlFlow::Continue(())
    }
}

/// The schedule and layer split one batch of inner configurations shares.
#[derive(Debug, Clone, Copy)]
struct Stem {
    schedule: ScheduleKind,
    virtual_stages: u64,
    first_stage_layers: Option<u64>,
    last_stage_layers: Option<u64>,
}

/// A switch's values: the user's, or both where it can make a difference.
fn switch(given: &Option<Vec<bool>>, possible: bool) -> &[bool] {
    given
        .as_deref()
        .unwrap_or(if possible { &[false, true] } else { &[false] })
}

/// The values of the inner dimensions that do not change within one outer
/// point, made once and lent to each of its configurations.
struct InnerDims<'a> {
    space: &'a SearchSpace,
    job: &'a Job,
    o: Outer,
    torchtitan: bool,
    /// Each policy with the modules it recomputes: under selective
    /// recomputation the set given, else those [`RecomputeModules::searched`]
    /// names for Megatron-LM when asked; one level of the walk.
    recompute: Vec<(Recompute, RecomputeModules)>,
    frequencies: Vec<u64>,
    default_frequency: [u64; 1],
    default_dispatcher: [Dispatcher; 1],
    precision: Vec<Precision>,
    /// The FP8 candidates' recipe: the space's, else the GPU's default
    /// (worked out once: it reads the GPU's name).
    fp8_recipe: Fp8Recipe,
    /// The gradients' format, the loss's kernel and the embedding wgrad's
    /// deferral: independent switches walked as one dimension of their
    /// product, since every level of the walk costs a call per
    /// configuration and these are single-valued unless asked.
    loss_and_gradients: Vec<(GradReduce, CrossEntropyFusion, WgradDeferral)>,
    cpu_offload_layers: Vec<u64>,
    sequence_parallel: Vec<bool>,
    sharding: Vec<OptimizerSharding>,
    /// The user's hybrid-sharding groups, dp itself as plain sharding.
    dp_shard_given: Option<Vec<Option<u64>>>,
    /// The groups a sharded optimizer tries when the user gave none.
    sharded_groups: Vec<Option<u64>>,
    attention: Vec<AttentionKind>,
    grad_overlaps: Vec<bool>,
    compiles: Vec<bool>,
    graphs: Vec<CudaGraphs>,
}

impl<'a> InnerDims<'a> {
    fn new(space: &'a SearchSpace, job: &'a Job, o: Outer) -> Self {
        let engine = space.engine;
        let torchtitan = engine == Engine::Torchtitan;
        // An MoE model runs tensor parallelism only sequence-parallel, so
        // the other value is not generated just to be dropped.
        let sequence_parallel = space.sequence_parallel.clone().unwrap_or(match o.tp {
            1 => vec![false],
            _ if job.model.moe.is_some() => vec![true],
            _ => vec![false, true],
        });
        let sharding = space.optimizer_sharding.clone().unwrap_or(if o.dp > 1 {
            OptimizerSharding::ALL.to_vec()
        } else {
            vec![OptimizerSharding::None]
        });
        // Hybrid sharding: by default torchtitan's FSDP also tries sharding
        // within a node's data-parallel ranks, replicated across nodes
        // (HSDP), where that is a proper subgroup.
        let node = job.gpus_per_node() / o.tp.max(1);
        let hybrid = torchtitan && node >= 2 && node < o.dp && o.dp.is_multiple_of(node);
        let sharded_groups = if hybrid {
            vec![None, Some(node)]
        } else {
            vec![None]
        };
        let dp_shard_given = space
            .dp_shard
            .as_ref()
            .map(|given| given.iter().map(|&n| (n != o.dp).then_some(n)).collect());
        // torchtitan's FSDP and DDP always overlap the gradient reduction and
        // prefetch the weights; it runs CUDA graphs only without a pipeline.
        let grad_overlaps = match (&space.overlap_grad_reduce, torchtitan) {
            (None, true) => vec![o.dp > 1],
            (given, _) => switch(given, o.dp > 1).to_vec(),
        };
        InnerDims {
            space,
            job,
            o,
            torchtitan,
            recompute: recompute_choices(space, &job.model),
            frequencies: space.ac_frequency.clone().unwrap_or(vec![2]),
            default_frequency: [ParallelConfig::default().ac_frequency],
            default_dispatcher: [Dispatcher::default()],
            precision: space.precision.clone().unwrap_or(vec![Precision::Bf16]),
            fp8_recipe: space.fp8_recipe_on(&job.nodes.gpu.name),
            loss_and_gradients: loss_and_gradients(space),
            cpu_offload_layers: space.cpu_offload_layers.clone().unwrap_or(vec![0]),
            sequence_parallel,
            sharding,
            dp_shard_given,
            sharded_groups,
            attention: space.attention.clone().unwrap_or(vec![job.model.attention]),
            grad_overlaps,
            compiles: switch(&space.compile, torchtitan).to_vec(),
            graphs: match &space.cuda_graphs {
                Some(given) => given.clone(),
                // A CPU standing in for a GPU captures no CUDA graphs.
                None if crate::cluster::is_cpu(&job.nodes.gpu.name) => vec![CudaGraphs::Off],
                None if !torchtitan || o.pp == 1 => vec![CudaGraphs::Off, CudaGraphs::Layers],
                None => vec![CudaGraphs::Off],
            },
        }
    }

    /// Calls `f` with every configuration of one stem, in the order of the
    /// dimensions, until it breaks.
    fn variants<B>(
        &self,
        stem: Stem,
        f: &mut impl FnMut(&ParallelConfig) -> ControlFlow<B>,
    ) -> ControlFlow<B> {
        let d = self;
        let (space, job, o, torchtitan) = (d.space, d.job, d.o, d.torchtitan);
        let gpus_per_node = job.gpus_per_node();
        let bpipe = space.bpipe.as_deref().unwrap_or(
            if stem.schedule == ScheduleKind::OneFOneB && o.pp >= 2 && !torchtitan {
                &[false, true]
            } else {
                &[false]
            },
        );
        Start(ParallelConfig {
            tp: o.tp,
            pp: o.pp,
            cp: o.cp,
            dp: o.dp,
            micro_batch: o.micro_batch,
            schedule: stem.schedule,
            virtual_stages: stem.virtual_stages,
            first_stage_layers: stem.first_stage_layers,
            last_stage_layers: stem.last_stage_layers,
            engine: space.engine,
            ..ParallelConfig::default()
        })
        .then(
            |c| match (&space.cp_comm, c.cp) {
                (_, 1) => lend(&[CpComm::P2p]),
                (Some(given), _) => lend(given),
                (None, cp) => lend(CpComm::defaults_for(c.engine, &job.model, cp)),
            },
            |c, comm| {
                c.cp_comm = comm;
                c.cp_a2a = c.default_cp_a2a(gpus_per_node);
            },
        )
        .then(
            |c| Cow::Owned(space.expert_tensor_degrees(job, c)),
            |c, etp| c.etp = etp,
        )
        .then(
            |c| Cow::Owned(space.expert_degrees(job, c)),
            |c, ep| c.ep = ep,
        )
        .then(
            // With one expert rank no token moves, and the gathering
            // dispatcher only keeps more: it is tried where it gathers.
            // A dense model holds the default, which it never uses.
            |c| match (&space.dispatcher, job.model.moe) {
                (Some(given), _) => lend(given),
                (None, Some(_)) if c.ep * c.etp > 1 && c.engine == Engine::Megatron => {
                    lend(&Dispatcher::BUILT_IN)
                }
                (None, Some(_)) => lend(&[Dispatcher::AllToAll]),
                (None, None) => lend(&d.default_dispatcher),
            },
            |c, dispatcher| c.dispatcher = dispatcher,
        )
        .then(
            |_| lend(&d.precision),
            |c, p| {
                c.precision = p;
                c.fp8_recipe = (p == Precision::Fp8).then_some(d.fp8_recipe);
            },
        )
        .then(
            |_| lend(&d.loss_and_gradients),
            |c, (grad_reduce, fusion, deferral)| {
                c.grad_reduce = grad_reduce;
                c.cross_entropy_fusion = fusion;
                c.wgrad_deferral = deferral;
            },
        )
        .then(
            |_| lend(&d.cpu_offload_layers),
            |c, n| c.cpu_offload_layers = n,
        )
        .then(
            |c| match &space.embedding_sync {
                Some(given) if !job.model.tied_embeddings && c.dense_sync_degree() > 1 => {
                    lend(given)
                }
                _ => lend(&[SyncMethod::AllReduce]),
            },
            |c, m| c.embedding_sync = m,
        )
        .then(
            |_| lend(&d.recompute),
            |c, (policy, modules)| {
                c.recompute = policy;
                c.recompute_modules = modules;
            },
        )
        .then(
            |c| match c.recompute {
                Recompute::SelectiveLayer => lend(&d.frequencies),
                _ => lend(&d.default_frequency),
            },
            |c, n| c.ac_frequency = n,
        )
        .then(
            |_| lend(&d.sequence_parallel),
            |c, on| c.sequence_parallel = on,
        )
        .then(|_| lend(&d.sharding), |c, z| c.optimizer_sharding = z)
        .then(
            |c| match &d.dp_shard_given {
                Some(given) => lend(given),
                None if c.optimizer_sharding != OptimizerSharding::None => lend(&d.sharded_groups),
                None => lend(&[None]),
            },
            |c, n| c.dp_shard = n,
        )
        .then(|_| lend(bpipe), |c, b| c.bpipe = b)
        // BPipe's pairs share a node only if two stages fit in one.
        .then(
            |c| {
                let pairs_fit = c.bpipe && 2 * o.tp * o.dp <= gpus_per_node;
                match &space.stage_order {
                    Some(given) => lend(given),
                    None if pairs_fit => lend(&StageOrder::ALL),
                    None => lend(&[StageOrder::Megatron]),
                }
            },
            |c, order| c.stage_order = order,
        )
        .then(|_| lend(&d.attention), |c, a| c.attention = a)
        .then(
            |_| lend(&d.grad_overlaps),
            |c, on| c.overlap_grad_reduce = on,
        )
        .then(
            |c| {
                let applies = c.overlap_grad_reduce
                    && c.optimizer_sharding == OptimizerSharding::OptimizerStates
                    && !torchtitan;
                lend(switch(&space.overlap_param_gather, applies))
            },
            |c, on| c.overlap_param_gather = on,
        )
        .then(|_| lend(&d.compiles), |c, on| c.compile = on)
        // torchtitan runs its tensor-parallel overlap compiled only.
        .then(
            |c| {
                lend(switch(
                    &space.tp_comm_overlap,
                    c.sequence_parallel && (!torchtitan || c.compile),
                ))
            },
            |c, on| c.tp_comm_overlap = on,
        )
        // Megatron-LM's per-layer CUDA graphs do not capture full
        // recomputation.
        .then(
            |c| match (&space.cuda_graphs, c.recompute) {
                (None, Recompute::Full) if !torchtitan => lend(&[CudaGraphs::Off]),
                _ => lend(&d.graphs),
            },
            |c, on| c.cuda_graphs = on,
        )
        // Tried where Megatron-Core can run it.
        .then(
            |c| {
                let runs = crate::config::ep_overlap_problem(&job.model, c).is_none();
                lend(switch(&space.ep_comm_overlap, runs))
            },
            |c, on| c.ep_comm_overlap = on,
        )
        // FP8 weights only save memory and all-gather bytes: where they
        // run, the search keeps them (as NeMo's FP8 recipes do).
        .then(
            |c| match (
                &space.fp8_param_gather,
                crate::config::fp8_param_gather_problem(c),
            ) {
                (Some(given), _) => lend(given),
                (None, None) => lend(&[true]),
                (None, Some(_)) => lend(&[false]),
            },
            |c, on| c.fp8_param_gather = on,
        )
        // A launch setting that moves memory only: the allocator the user
        // runs, the engine's launcher's unless given.
        .then(
            |c| match &space.expandable_segments {
                Some(given) => lend(given),
                // A borrowed one-value list: no allocation per configuration.
                None if c.engine.launches_expandable_segments() => lend(&[true]),
                None => lend(&[false]),
            },
            |c, on| c.expandable_segments = on,
        )
        .walk(f)
    }
}
