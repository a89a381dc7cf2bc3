//! Collectives and point-to-point messages, charged on the link that the
//! rank placement gives them (Megatron-Core's order: tp fastest, then cp,
//! then dp, then pp; the experts laid out etp, ep, expert-data over the same
//! ranks).
//!
//! With a profile, an intra-node collective whose (op, ranks) curve was
//! measured takes the measured time (see [`Measurements::collective`] for
//! the interpolation and extrapolation). An all-gather or reduce-scatter
//! without a curve of its own is derived from the all-reduce curve at the
//! same size: a ring all-reduce is a reduce-scatter followed by an
//! all-gather over the same chunks, so each moves half the all-reduce's bus
//! volume and takes half its time. A point-to-point message within a node
//! (a pipeline send, a step of context parallelism's ring) takes the
//! measured send/receive curve. Collectives that span nodes, except over a
//! curve measured across as many whole nodes, keep the formulas, and so do
//! messages between nodes.

use super::kernels::HALF;
use super::memory::{ParamGroup, SyncMethod, reduced_gradient_bytes};
use super::{ProfileUsage, Scenario};
use crate::cluster::GroupSpan;
use crate::coefficients::CollectiveAlgorithm;
use crate::config::{Engine, OptimizerSharding, ParallelConfig, Recompute};
use crate::profile::{CollectiveLookup, CollectiveOp, Measurements};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
}

impl Collective {
    fn op(self) -> CollectiveOp {
        match self {
            Collective::AllReduce => CollectiveOp::AllReduce,
            Collective::AllGather => CollectiveOp::AllGather,
            Collective::ReduceScatter => CollectiveOp::ReduceScatter,
        }
    }

    /// Ring passes over the data: an all-reduce is a reduce-scatter plus an all-gather.
    fn passes(self) -> f64 {
        match self {
            Collective::AllReduce => 2.0,
            Collective::AllGather | Collective::ReduceScatter => 1.0,
        }
    }
}

/// Achieved per-GPU bandwidth of the intra-node link.
fn intra_bw(s: &Scenario) -> f64 {
    s.intra_node_bw * s.coef().intra_node_efficiency
}

/// Achieved per-GPU share of the node's network bandwidth when every GPU of
/// the node communicates at once (as in data-parallel synchronisation).
fn inter_bw_per_gpu(s: &Scenario) -> f64 {
    s.inter_node_bw * s.coef().inter_node_efficiency / s.placement.gpus_per_node as f64
}

fn latency(s: &Scenario, kind: Collective, ranks: u64) -> f64 {
    let k = s.coef();
    (k.collective_base_latency_us
        + k.collective_step_latency_us * kind.passes() * (ranks - 1) as f64)
        * 1e-6
}

/// The measured time of an intra-node collective, if the profile has a
/// curve for it (or, for an all-gather or reduce-scatter, an all-reduce
/// curve to derive it from); counted in `usage`.
/// A measured collective time (see [`collective`]), counted in `usage`.
fn measured_curve(
    profile: &Measurements,
    kind: Collective,
    ranks: u64,
    bytes: f64,
    usage: &mut ProfileUsage,
) -> Option<f64> {
    let (lookup, derived) = match profile.collective(kind.op(), ranks, bytes) {
        Some(own) => (Some(own), false),
        None if kind != Collective::AllReduce => {
            let half = profile
                .collective(CollectiveOp::AllReduce, ranks, bytes)
                .map(|all_reduce| CollectiveLookup {
                    seconds: all_reduce.seconds / 2.0,
                    ..all_reduce
                });
            (half, true)
        }
        None => (None, false),
    };
    let Some(lookup) = lookup else {
        usage.collective_modelled += 1;
        return None;
    };
    usage.collective_lookups += 1;
    usage.collective_extrapolated += u64::from(lookup.extrapolated);
    usage.collective_derived += u64::from(derived);
    Some(lookup.seconds)
}

/// Time of a collective over `bytes` (the full buffer each rank holds) among
/// ranks laid out as `span`: measured when the scenario's profile has the
/// intra-node curve, from the formulas otherwise.
pub fn collective(
    s: &Scenario,
    kind: Collective,
    span: GroupSpan,
    bytes: f64,
    usage: &mut ProfileUsage,
) -> f64 {
    let ranks = span.nodes * span.per_node;
    if ranks <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let n = ranks as f64;
    let passes = kind.passes();
    if span.nodes == 1 {
        if let Some(profile) = s.profile
            && let Some(seconds) = measured_curve(profile, kind, ranks, bytes, usage)
        {
            return seconds;
        }
        return latency(s, kind, ranks) + passes * (n - 1.0) / n * bytes / intra_bw(s);
    }
    // A curve over exactly these ranks measured across full nodes (nccl-tests
    // launched over several nodes: more ranks than a node holds) covers a
    // group that also fills its nodes.
    if let Some(profile) = s.profile {
        let fills_nodes = span.per_node == s.placement.gpus_per_node;
        let measured_across_nodes = profile.has_curve(kind.op(), ranks);
        if fills_nodes
            && measured_across_nodes
            && let Some(seconds) = measured_curve(profile, kind, ranks, bytes, usage)
        {
            return seconds;
        }
        usage.collective_modelled += 1;
    }
    let k = span.per_node as f64;
    let nodes = span.nodes as f64;
    let transfer = match s.collective() {
        CollectiveAlgorithm::Hierarchical => {
            let intra = passes * (k - 1.0) / k * bytes / intra_bw(s);
            let inter = passes * (nodes - 1.0) / nodes * (bytes / k) / inter_bw_per_gpu(s);
            intra + inter
        }
        CollectiveAlgorithm::Ring => {
            // The ring crosses each node boundary once; the k ranks of the
            // group on a node share the node's NICs with the other groups.
            let bottleneck = intra_bw(s).min(inter_bw_per_gpu(s) * k);
            passes * (n - 1.0) / n * bytes / bottleneck
        }
    };
    latency(s, kind, ranks) + transfer
}

fn within_node(ranks: u64) -> GroupSpan {
    GroupSpan {
        nodes: 1,
        per_node: ranks,
    }
}

pub fn all_reduce_intra(s: &Scenario, ranks: u64, bytes: f64, usage: &mut ProfileUsage) -> f64 {
    collective(s, Collective::AllReduce, within_node(ranks), bytes, usage)
}

#[cfg(test)]
pub fn all_gather_intra(s: &Scenario, ranks: u64, bytes: f64, usage: &mut ProfileUsage) -> f64 {
    collective(s, Collective::AllGather, within_node(ranks), bytes, usage)
}

#[cfg(test)]
pub fn reduce_scatter_intra(s: &Scenario, ranks: u64, bytes: f64, usage: &mut ProfileUsage) -> f64 {
    collective(
        s,
        Collective::ReduceScatter,
        within_node(ranks),
        bytes,
        usage,
    )
}

/// The tensor-parallel group: consecutive ranks, within a node or over
/// whole nodes (Megatron-LM runs both; the second pays the network).
pub fn tensor_parallel_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(1, c.tp)
}

/// The context-parallel group: `cp` ranks `tp` apart (Megatron-Core's
/// order tp, cp, ep, dp, pp).
pub fn context_parallel_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(c.tp, c.cp)
}

/// The group the dense weights' gradients are synchronised over: the
/// data-parallel ranks with their context-parallel ones, `tp` apart.
pub fn data_parallel_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(c.tp, c.dense_sync_degree())
}

/// Megatron-Core lays the experts out in their own order over the same
/// ranks: etp fastest, then ep, then expert-data parallelism.
pub fn expert_tensor_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(1, c.etp)
}

/// The etp x ep ranks that share a stage's experts between them.
pub fn expert_model_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(1, c.etp * c.ep)
}

pub fn expert_parallel_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(c.etp, c.ep)
}

pub fn expert_data_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(c.etp * c.ep, c.expert_data_parallel())
}

/// An all-to-all in which every rank of `span` sends `bytes` in all, an
/// equal share to each rank (its own share stays): the shares for ranks
/// on its node cross the intra-node link, the others the node's network,
/// both at once.
pub fn all_to_all(s: &Scenario, span: GroupSpan, bytes: f64) -> f64 {
    let n = (span.nodes * span.per_node) as f64;
    let on_node = (span.per_node - 1) as f64 / n * bytes;
    let off_node = (n - span.per_node as f64) / n * bytes;
    exchange(s, span, on_node, off_node)
}

/// An exchange over `span` in which every rank sends `on_node` bytes over
/// the intra-node link and `off_node` bytes over the node's network, both
/// at once (an all-to-all, or DeepEP's dispatch, which sends a token once
/// per remote node and forwards it over NVLink there).
pub fn exchange(s: &Scenario, span: GroupSpan, on_node: f64, off_node: f64) -> f64 {
    let ranks = span.nodes * span.per_node;
    if ranks <= 1 || on_node + off_node <= 0.0 {
        return 0.0;
    }
    let on_node = on_node / intra_bw(s);
    let off_node = off_node / inter_bw_per_gpu(s);
    latency(s, Collective::AllGather, ranks) + on_node.max(off_node)
}

/// One step of a ring over `span`: every rank sends `bytes` to the next
/// one and receives as much from the one before, across a node boundary
/// as soon as the ring has one. A point-to-point message like a pipeline
/// send ([`message_time`]): nccl-tests' send/receive curve times exactly
/// this ring pattern, so within a node a measured one replaces the formula.
pub fn ring_step(s: &Scenario, span: GroupSpan, bytes: f64, usage: &mut ProfileUsage) -> f64 {
    message_time(s, span, bytes, usage)
}

/// The ranks one sharded copy of the state is spread over: all of dp, or
/// under hybrid sharding a group of `dp_shard` neighbours (torchtitan's
/// mesh puts `dp_shard` inside `dp_replicate`).
pub fn shard_group_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(c.tp, c.shard_degree())
}

/// Hybrid sharding's replicas of one shard: `tp x dp_shard` ranks apart.
pub fn replica_span(s: &Scenario, c: &ParallelConfig) -> GroupSpan {
    s.placement.span(c.tp * c.shard_degree(), c.replicas())
}

/// Hybrid sharding's all-reduce of each reduce-scattered gradient shard
/// over the replicas, per micro-batch (FSDP2 with a replicate mesh
/// dimension reduces as it reduce-scatters); 0 without replicas.
pub fn replica_all_reduce_per_microbatch(
    s: &Scenario,
    c: &ParallelConfig,
    groups: &[ParamGroup],
    usage: &mut ProfileUsage,
) -> f64 {
    if c.replicas() < 2 || !syncs_per_microbatch(c) {
        return 0.0;
    }
    let span = replica_span(s, c);
    let shard = c.shard_degree() as f64;
    groups
        .iter()
        .filter(|g| !g.experts)
        .map(|g| {
            let shard_bytes = g.params * reduced_gradient_bytes(s, c) / shard;
            collective(s, Collective::AllReduce, span, shard_bytes, usage)
        })
        .sum()
}

/// Which link a group's collectives load: the node's network as soon as
/// the group spans nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Link {
    #[default]
    IntraNode,
    InterNode,
}

impl Link {
    pub fn of(span: GroupSpan) -> Self {
        if span.nodes > 1 {
            Link::InterNode
        } else {
            Link::IntraNode
        }
    }
}

/// The bandwidth one rank of `span` sends to another at while all ranks
/// exchange at once (the network's per-GPU share when the group spans
/// nodes).
pub fn point_to_point_bandwidth(s: &Scenario, span: GroupSpan) -> f64 {
    p2p_bw(s, span.nodes > 1)
}

/// Point-to-point bandwidth between two ranks, depending on whether they share a node.
fn p2p_bw(s: &Scenario, crosses_nodes: bool) -> f64 {
    if crosses_nodes {
        inter_bw_per_gpu(s)
    } else {
        intra_bw(s)
    }
}

/// First rank of pipeline stage `stage`, in the configuration's stage order.
fn stage_rank(c: &ParallelConfig, stage: u64) -> u64 {
    c.stage_order.position(stage, c.pp) * c.tp * c.cp * c.dp
}

/// The link pipeline sends use: the network if any two neighbouring stages
/// sit on different nodes (the slowest send sets the pace).
pub fn pipeline_link(s: &Scenario, c: &ParallelConfig) -> Link {
    if c.pp > 1 && (0..c.pp - 1).any(|i| !stages_share_node(s, c, i, i + 1)) {
        Link::InterNode
    } else {
        Link::IntraNode
    }
}

pub fn stages_share_node(s: &Scenario, c: &ParallelConfig, a: u64, b: u64) -> bool {
    s.placement.node_of(stage_rank(c, a)) == s.placement.node_of(stage_rank(c, b))
}

/// Time of moving `bytes` between stages `a` and `b` (one rank each).
pub fn stage_transfer(s: &Scenario, c: &ParallelConfig, a: u64, b: u64, bytes: f64) -> f64 {
    bytes / p2p_bw(s, !stages_share_node(s, c, a, b))
}

/// Pipeline send/receive time per micro-batch on one stage: the activation
/// forward and its gradient backward, once per model chunk. Megatron splits
/// the message over the tensor-parallel ranks (scatter/gather). Within a
/// node a measured send/receive curve replaces the formula.
pub fn pipeline_p2p_per_microbatch(
    s: &Scenario,
    c: &ParallelConfig,
    usage: &mut ProfileUsage,
) -> f64 {
    if c.pp == 1 {
        return 0.0;
    }
    let bytes = HALF * super::layer::local_tokens(s, c) * s.model.hidden as f64 / c.tp as f64;
    let crosses = (0..c.pp - 1).any(|i| !stages_share_node(s, c, i, i + 1));
    2.0 * c.virtual_stages as f64 * send_recv(s, crosses, bytes, usage)
}

/// One point-to-point message of `bytes` between two ranks of `span`: a
/// measured send/receive within a node where the profile has one, else the
/// latency and the link's share.
pub fn message_time(s: &Scenario, span: GroupSpan, bytes: f64, usage: &mut ProfileUsage) -> f64 {
    send_recv(s, span.nodes > 1, bytes, usage)
}

/// The one pricing of a point-to-point message (pipeline sends, the
/// context-parallel ring, the parameter server's index messages): the
/// measured send/receive curve when the ranks share a node and the profile
/// has one, counted in `usage`, else the latency and the link's share.
fn send_recv(s: &Scenario, crosses_nodes: bool, bytes: f64, usage: &mut ProfileUsage) -> f64 {
    if !crosses_nodes && let Some(m) = s.profile.and_then(|p| p.send_recv(bytes.max(1.0))) {
        usage.collective_lookups += 1;
        usage.collective_extrapolated += u64::from(m.extrapolated);
        return m.seconds;
    }
    s.coef().p2p_latency_us * 1e-6 + bytes / p2p_bw(s, crosses_nodes)
}

/// Megatron-LM's default gradient bucket: `max(40M, 1M x dp)` parameters
/// (`DistributedDataParallelConfig.bucket_size` when unset, in
/// `megatron/core/distributed/distributed_data_parallel.py`).
fn bucket_params(c: &ParallelConfig) -> f64 {
    (40e6_f64).max(1e6 * c.dp as f64)
}

/// What one stage synchronises over the data-parallel ranks at the end of
/// an iteration (no sharding, or the distributed optimizer), before any
/// overlap: whole times of the collectives on the data-parallel group.
#[derive(Debug, Clone, Copy, Default)]
pub struct StageSync {
    /// Gradient all-reduce (no sharding) or reduce-scatter (distributed optimizer).
    pub grads: f64,
    /// The grads' last bucket, which no backward is left to hide.
    pub grads_last_bucket: f64,
    /// The distributed optimizer's all-gather of the updated weights.
    pub gather: f64,
    /// Its first bucket, needed before any forward can start.
    pub gather_first_bucket: f64,
    pub link: Link,
    /// The input embedding's sparse sync (Parallax), when it has one: its
    /// gradient is the last the backward pass makes, so nothing hides it.
    pub sparse: Option<super::sparse::EmbeddingSync>,
}

impl StageSync {
    pub fn sparse_seconds(&self) -> f64 {
        self.sparse.map_or(0.0, |e| e.seconds)
    }
}

/// Whether the data-parallel collectives run per micro-batch (FSDP-style:
/// ZeRO-3, and torchtitan's FSDP for any sharding) rather than once at the
/// end of the iteration.
pub fn syncs_per_microbatch(c: &ParallelConfig) -> bool {
    c.optimizer_sharding == OptimizerSharding::Full
        || (c.engine == Engine::Torchtitan && c.optimizer_sharding != OptimizerSharding::None)
}

/// The end-of-iteration data-parallel collectives of one stage's parameter
/// groups; zero when they run per micro-batch (see [`zero3_per_microbatch`])
/// or with dp 1.
pub fn stage_sync(
    s: &Scenario,
    c: &ParallelConfig,
    groups: &[ParamGroup],
    usage: &mut ProfileUsage,
) -> StageSync {
    let span = data_parallel_span(s, c);
    let mut sync = StageSync {
        link: Link::of(span),
        ..StageSync::default()
    };
    if syncs_per_microbatch(c) {
        return sync;
    }
    let dense = |g: &&ParamGroup| g.sync == SyncMethod::AllReduce;
    let params: f64 = groups.iter().filter(dense).map(|g| g.params).sum();
    let bucket = (bucket_params(c) / params.max(1.0)).min(1.0);
    for group in groups {
        let span = group.span;
        if Link::of(span) == Link::InterNode {
            sync.link = Link::InterNode;
        }
        if group.sync.is_sparse() {
            if group.params > 0.0 {
                sync.sparse = Some(super::sparse::sparse_sync(s, c, group, group.sync, usage));
            }
            continue;
        }
        let (grads, gather) = dense_group_sync(s, c, group, usage);
        sync.grads += grads;
        sync.gather += gather;
    }
    sync.grads_last_bucket = sync.grads * bucket;
    sync.gather_first_bucket = sync.gather * bucket;
    sync
}

/// Bytes an all-gather of `group`'s weights moves: 16-bit weights, or a
/// layer weight kept quantized (`fp8_param_gather`): 1 byte in FP8, NVFP4's
/// half byte with its block scales.
fn gathered_weight_bytes(s: &Scenario, c: &ParallelConfig, group: &ParamGroup) -> f64 {
    let share = match super::memory::te_quantized_bytes(s, c) {
        Some(quantized) if c.fp8_param_gather && !group.tables => quantized / super::kernels::HALF,
        _ => 1.0,
    };
    group.params * s.coef().weight_bytes_per_param * share
}

/// A dense group's end-of-iteration collectives over its ranks: the
/// gradients' all-reduce (or reduce-scatter under the distributed
/// optimizer) and the updated weights' all-gather (0 without sharding).
pub fn dense_group_sync(
    s: &Scenario,
    c: &ParallelConfig,
    group: &ParamGroup,
    usage: &mut ProfileUsage,
) -> (f64, f64) {
    let span = group.span;
    let grads = group.params * reduced_gradient_bytes(s, c);
    let weights = gathered_weight_bytes(s, c, group);
    match c.optimizer_sharding {
        OptimizerSharding::None => (
            collective(s, Collective::AllReduce, span, grads, usage),
            0.0,
        ),
        _ => (
            collective(s, Collective::ReduceScatter, span, grads, usage),
            collective(s, Collective::AllGather, span, weights, usage),
        ),
    }
}

/// ZeRO-3/FSDP's collectives per micro-batch on one stage: each layer's
/// weights gathered for every forward, recomputation and backward pass (once
/// per micro-batch when torchtitan keeps them gathered from forward to
/// backward, its export of optimizer-state sharding), and its gradients
/// reduce-scattered, within the shard group; under hybrid sharding each
/// gradient shard is then all-reduced over the replicas. Returns (all of them, the part no prefetch can hide:
/// the first layer's gather and the embedding tables').
pub fn zero3_per_microbatch(
    s: &Scenario,
    c: &ParallelConfig,
    groups: &[ParamGroup],
    layers: f64,
    usage: &mut ProfileUsage,
) -> (f64, f64) {
    if !syncs_per_microbatch(c) {
        return (0.0, 0.0);
    }
    let replica = replica_span(s, c);
    let shard = c.shard_degree() as f64;
    let gathers = match (c.optimizer_sharding, c.recompute) {
        (OptimizerSharding::OptimizerStates, _) => 1.0,
        (_, Recompute::Full) => 3.0,
        _ => 2.0,
    };
    let mut total = 0.0;
    let mut unhidden = 0.0;
    for group in groups {
        let span = group.span;
        let weights = gathered_weight_bytes(s, c, group);
        let grads = group.params * reduced_gradient_bytes(s, c);
        let mut time = gathers * collective(s, Collective::AllGather, span, weights, usage)
            + collective(s, Collective::ReduceScatter, span, grads, usage);
        if c.replicas() > 1 && !group.experts {
            time += collective(s, Collective::AllReduce, replica, grads / shard, usage);
        }
        total += time;
        // The layers' group: one layer's gather comes before any compute;
        // the embeddings' tables are used whole at the stage's ends.
        unhidden += if group.tables {
            time
        } else {
            time / (gathers * layers.max(1.0))
        };
    }
    (total, unhidden.min(total))
}

/// BPipe's transfer per micro-batch on stage `stage`: an evictor sends a
/// share of its micro-batches' activations to its acceptor after the
/// forward pass and takes them back before the backward pass, on the link
/// that joins the pair. Before any overlap.
pub fn bpipe_transfer_per_microbatch(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    let m = c.micro_batches(s.global_batch);
    let partner = c.pp - 1 - stage;
    let (evictor, acceptor) = (stage.min(partner), stage.max(partner));
    let own = super::memory::schedule_in_flight(c, m, evictor);
    let evicted = own - super::memory::in_flight(c, m, evictor);
    if evicted <= 0.0 {
        return 0.0;
    }
    let bytes_per_microbatch = super::memory::stage_activation_bytes(s, c, evictor);
    let both_ways = 2.0 * evicted / own * bytes_per_microbatch;
    stage_transfer(s, c, evictor, acceptor, both_ways)
}

/// The link joining BPipe's pair of `stage`.
pub fn bpipe_link(s: &Scenario, c: &ParallelConfig, stage: u64) -> Link {
    if stages_share_node(s, c, stage, c.pp - 1 - stage) {
        Link::IntraNode
    } else {
        Link::InterNode
    }
}

/// Whether the last stage keeps a copy of the first stage's word embedding
/// whose gradient joins it every iteration (Megatron-LM's embedding group):
/// the tied output head's, or the one multi-token prediction modules look
/// tokens up in. With one stage the table is not copied.
pub fn shares_word_embedding(s: &Scenario, c: &ParallelConfig) -> bool {
    c.pp > 1 && (s.model.tied_embeddings || s.model.mtp_layers > 0)
}

/// All-reduce of the word-embedding gradient between the first and the
/// last stage, where the last holds a copy ([`shares_word_embedding`]).
pub fn embedding_group_sync(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    if !shares_word_embedding(s, c) || (stage != 0 && stage != c.pp - 1) {
        return 0.0;
    }
    let bytes = super::vocab_per_rank(s, c) * s.model.hidden as f64 * reduced_gradient_bytes(s, c);
    let crosses = !stages_share_node(s, c, 0, c.pp - 1);
    s.coef().collective_base_latency_us * 1e-6 + bytes / p2p_bw(s, crosses)
}
