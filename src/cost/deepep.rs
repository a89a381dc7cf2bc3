//! The device memory a flex dispatcher's communication buffers hold
//! (Megatron-LM's `flex` dispatcher), counted from the kernels' own code in
//! deepseek-ai/DeepEP (MIT licence). Both live outside PyTorch's caching
//! allocator (`cudaMalloc`, CUDA IPC and NVSHMEM), so they count toward the
//! device's memory but not the allocated peak PyTorch reports, and each is
//! made at a stage's first dispatch: a stage of dense layers holds none.
//!
//! DeepEP (the `deepep` backend, Megatron-LM's default):
//! - Megatron-Core's `fused_a2a.get_buffer` builds one `deep_ep.Buffer` per
//!   process for its dispatcher group (the etp x ep ranks), sized by the
//!   larger of the dispatch and combine configs' size hints, with
//!   `hidden_bytes = hidden * max(element size, 2)`: two bytes per element
//!   whether the tokens travel in bf16 or FP8. Megatron-LM runs DeepEP on
//!   `moe_deepep_num_sms` = 20 SMs, 10 channels.
//! - `Config::get_nvl_buffer_size_hint` (`csrc/config.hpp`): per channel and
//!   NVLink peer (at most 8), the received-token chunk of the hidden state,
//!   its source metadata (8 bytes) and room for 128 top-k indices (int64),
//!   128 weights and 128 scales (fp32), plus the channels' counters.
//! - `Config::get_rdma_buffer_size_hint`: beyond 8 ranks, per channel and
//!   RDMA peer (a node's GPU of the same index), twice (send and receive)
//!   the RDMA chunk of the same per-token record plus a 16-byte tail, the
//!   channels' counters and 1 MiB; it lives in NVSHMEM's symmetric heap,
//!   which DeepEP maps in 2^29-byte pieces (`NVSHMEM_CUMEM_GRANULARITY`).
//! - `deep_ep/buffer.py`'s recommended configs (at 04b06f7): 256 received
//!   tokens per NVLink chunk up to 8 ranks, 288 up to 64, 480 at 96, 560 at
//!   128 and 720 beyond; 128 per RDMA chunk, which `Config` rounds up to a
//!   multiple of the RDMA send chunk: 140 tokens from 16 to 64 ranks (send
//!   chunks of 20 and 28), 132 beyond (12).
//! - `Buffer::Buffer` (`csrc/deep_ep.cpp`) adds a 32 MiB workspace.
//!
//! HybridEP (the `hybridep` backend, `csrc/hybrid_ep/hybrid_ep.cu`):
//! - Megatron-Core builds one `HybridEPBuffer` for the dispatcher group with
//!   `max_num_of_tokens_per_rank` the tokens of this rank's micro-batch, and
//!   dispatches in bf16 (it refuses FP8 dispatch).
//! - Its expert-side buffers are sized for the worst case, every token of
//!   the group routed to this rank: the group's tokens times the hidden
//!   state in 16 bits, and their fp32 routing probabilities over the
//!   experts of one NVLink domain (local experts x ranks per domain).
//!   Within one NVLink domain dispatch and combine share them; across
//!   domains each has its own, and the dispatch and combine keep three
//!   staging buffers of this rank's tokens per remote domain.

use super::Scenario;
use crate::config::{Dispatcher, ParallelConfig};

const MIB: f64 = 1024.0 * 1024.0;

/// SMs Megatron-LM gives DeepEP (`--moe-deepep-num-sms`'s default); each
/// pair of SMs drives one channel.
const MEGATRON_SMS: f64 = 20.0;

/// `NUM_MAX_NVL_PEERS`: the ranks DeepEP reaches over NVLink.
const NVL_PEERS: u64 = 8;

/// Bytes each received token's record reserves beside its hidden state:
/// `SourceMeta` (two ints), 128 int64 top-k indices, 128 fp32 top-k
/// weights and 128 fp32 scales (`kNumMaxTopK`, `kNumMaxScales`).
const TOKEN_RECORD_BYTES: f64 = 8.0 + 128.0 * 8.0 + 128.0 * 4.0 + 128.0 * 4.0;

/// `NUM_WORKSPACE_BYTES`.
const WORKSPACE_BYTES: f64 = 32.0 * MIB;

/// `NVSHMEM_CUMEM_GRANULARITY` as DeepEP sets it.
const NVSHMEM_GRANULARITY: f64 = 512.0 * MIB;

/// Device bytes the flex dispatcher's buffers hold on one GPU of `stage`:
/// zero unless `c` dispatches with DeepEP or HybridEP over more than one
/// rank and the stage has an MoE layer.
pub fn buffer_bytes(s: &Scenario, c: &ParallelConfig, stage: u64) -> f64 {
    let ranks = c.ep * c.etp;
    if !c.dispatcher.deduplicates() || ranks < 2 {
        return 0.0;
    }
    if super::stage_layer_kinds(s, c, stage).1 == 0 {
        return 0.0;
    }
    let hidden_bytes = 2.0 * s.model.hidden as f64;
    match c.dispatcher {
        Dispatcher::HybridEp => hybridep_bytes(s, c),
        _ => {
            nvl_bytes(ranks, hidden_bytes) + rdma_heap_bytes(ranks, hidden_bytes) + WORKSPACE_BYTES
        }
    }
}

/// HybridEP's buffers on one rank of the dispatcher group.
fn hybridep_bytes(s: &Scenario, c: &ParallelConfig) -> f64 {
    let Some(moe) = s.model.moe else {
        return 0.0;
    };
    let span = super::comm::expert_model_span(s, c);
    let tokens = super::layer::local_tokens(s, c) / c.tp as f64;
    let local_experts = (moe.experts / c.ep.max(1)) as f64;
    // A token's hidden state in 16 bits and its probabilities (fp32) over
    // the experts of one NVLink domain.
    let token_bytes = 2.0 * s.model.hidden as f64 + 4.0 * local_experts * span.per_node as f64;
    let worst_case = tokens * (span.nodes * span.per_node) as f64 * token_bytes;
    if span.nodes <= 1 {
        return worst_case;
    }
    let staging = 3.0 * tokens * (span.nodes - 1) as f64 * token_bytes;
    2.0 * worst_case + staging
}

/// Tokens per NVLink receive chunk in `deep_ep/buffer.py`'s recommended
/// dispatch and combine configs (the two agree).
fn nvl_chunk_tokens(ranks: u64) -> f64 {
    match ranks {
        0..=8 => 256.0,
        9..=64 => 288.0,
        65..=96 => 480.0,
        97..=128 => 560.0,
        _ => 720.0,
    }
}

fn channels() -> f64 {
    MEGATRON_SMS / 2.0
}

fn rdma_ranks(ranks: u64) -> f64 {
    (ranks / NVL_PEERS).max(1) as f64
}

/// Tokens per RDMA receive chunk, the larger of the dispatch and combine
/// configs' after `Config` aligns them to their send chunks.
fn rdma_chunk_tokens(ranks: u64) -> f64 {
    if ranks <= 64 { 140.0 } else { 132.0 }
}

/// `get_nvl_buffer_size_hint`, without its 128-byte round-up.
fn nvl_bytes(ranks: u64, hidden_bytes: f64) -> f64 {
    let per_channel_peer = channels() * ranks.min(NVL_PEERS) as f64;
    let counters = per_channel_peer * (2.0 * rdma_ranks(ranks) + 3.0) * 4.0;
    counters + per_channel_peer * nvl_chunk_tokens(ranks) * (hidden_bytes + TOKEN_RECORD_BYTES)
}

/// `get_rdma_buffer_size_hint` as NVSHMEM maps it: nothing within one
/// NVLink group of 8.
fn rdma_heap_bytes(ranks: u64, hidden_bytes: f64) -> f64 {
    if ranks <= NVL_PEERS {
        return 0.0;
    }
    let per_channel_peer = channels() * rdma_ranks(ranks);
    let counters = per_channel_peer * (NVL_PEERS as f64 * 2.0 + 2.0) * 2.0 * 4.0;
    let chunks = per_channel_peer
        * rdma_chunk_tokens(ranks)
        * (hidden_bytes + TOKEN_RECORD_BYTES + 16.0)
        * 2.0;
    let hint = counters + chunks + MIB;
    (hint / NVSHMEM_GRANULARITY).ceil() * NVSHMEM_GRANULARITY
}
