"""Run one candidate parallel configuration for real with torch.distributed.

`paratune validate plan.json --launch torch --ranks N` writes one job JSON per
candidate and starts this file under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        src/validate/torch_worker.py --job JOB.json

Every rank trains a small decoder-only transformer with the candidate's real
tensor / pipeline / data parallelism (DTensor tensor parallelism, FSDP2 or DDP,
torch.distributed.pipelining), times the iterations, measures its own peak
memory and writes one report.  Only the standard library and torch are used;
the same file runs on CPU (gloo) and CUDA (NCCL).

This docstring is the contract with the Rust side (`src/validate`).

Modes
-----
* `--job JOB.json` (under torchrun): run `job.mode`, "train", "comm" or "sync".
* `--describe --job JOB.json --world N`: no processes, no torch.distributed;
  print {"ranks": [{rank, mesh_coords, stages, stage_layers, schedule,
  data_parallel, tensor_parallel, checkpointed_blocks, micro_batches,
  embedding_sync, experts: null | {coords: {etp, ep, edp}, ep, etp, edp,
  local_experts: [global expert indices], moe_layers: [layers of this
  rank], dispatcher}}, ...]}
  for every rank, computed by the same functions the train mode uses.

Job JSON (input)
----------------
    {"schema": 1, "mode": "train" | "comm" | "sync", "candidate": <label, copied>,
     "device": "cpu" | "cuda",            # cuda: the GPU of LOCAL_RANK
     "backend": "gloo" | "nccl",
     "threads_per_rank": int,             # torch.set_num_threads when > 0
     "dtype": "bf16" | "fp32",            # compute dtype
     "seed": int, "warmup": int, "iterations": int,
     "report_dir": "/abs/dir",
     "model": {"hidden", "heads", "kv_heads", "ffn_hidden", "gated_mlp",
               "layers", "vocab", "seq_len", "tied_embeddings",
               "learned_positions", "attention": "standard" | "flash",
               "dropout",
               "moe": absent | null | {"experts", "topk", "ffn_hidden",
                      "shared_ffn_hidden", "dense_layers", "layer_freq"}},
     "parallel": {"tp", "pp", "dp", "dp_shard": null | int, "micro_batch",
                  "global_batch", "schedule": "gpipe" | "1f1b" | "interleaved",
                  "virtual_stages", "stage_layers": [layers per chunk, model
                  order, length pp*virtual_stages], "sequence_parallel",
                  "optimizer_sharding": "none" | "optimizer-states" | "full",
                  "recompute": "none" | "selective" | "full" | "selective-op"
                               | "selective-layer",
                  "ac_frequency": int,
                  "embedding_sync": "all-reduce" | "sparse-all-gather",
                               # absent or null: all-reduce (older jobs)
                  "ep": int, "etp": int,          # absent: 1
                  "moe_dispatcher": "alltoall" | "allgather",  # absent: alltoall
                  "cp": int,                      # absent: 1
                  "cp_comm": "p2p" | "a2a" | "allgather"},  # absent: p2p
     "comm": null | {"ops": ["all_reduce", "all_gather", "reduce_scatter",
                             "send_recv"],
                     "sizes_bytes": [int, ...], "warmup": int,
                     "iterations": int},
     "sync": null | {"vocab": int, "hidden": int,
                     "tokens_per_rank": [int, ...],     # batch sizes
                     "methods": ["all_reduce", "sparse_all_gather",
                                 "parameter_server"],
                     "partitions": [int, ...],          # 1..world each
                     "token_file": null | "/abs/file",  # exactly one of
                     "zipf_exponent": null | float,     # these two
                     "warmup": int, "iterations": int}}
The train mode reads model and parallel, the comm mode comm, the sync mode
sync (with dtype fp32 and at least 2 ranks).

Model: GPT style when learned_positions (learned positions, LayerNorm, GELU
MLP, biases on every linear as in Megatron-LM's GPT), Llama style otherwise
(RoPE, RMSNorm, SwiGLU when gated_mlp, no biases as in torchtitan).  GQA
with kv_heads in both.  Dropout 0.1 on the embeddings, attention
probabilities and both residual branches whenever model.dropout is true.
The output head never has a bias.  With tied_embeddings and pp == 1 the head
is the embedding table; with pp > 1 the first and the last chunk each hold a
copy, initialised alike, whose gradients are summed across the two stages
after every backward (Megatron-LM's embedding group).

Parallelism: mesh (pp, dp, tp), tp fastest (Megatron rank order);
(pp, dp_replicate, dp_shard, tp) with dp_shard (HSDP); (pp, dp, cp, tp)
with cp > 1 (Megatron-Core: tp fastest, then cp, then dp, then pp).  Order of
application as torchtitan: TP, then activation checkpointing, then FSDP.
"optimizer-states" is fully_shard(reshard_after_forward=False) (torchtitan's
ZeRO-2-like mode), "full" is reshard_after_forward=True; "none" is DDP when
tp == pp == 1 and dp > 1, else an all-reduce of the gradients' local tensors
over the dp group (averaged) after backward.  "selective-layer" checkpoints
the blocks whose global index i has (i + 1) % ac_frequency == 0, so the
choice does not depend on how the layers are split into stages.  Sequence
parallelism needs tp > 1; with tp == 1 it is ignored (and noted).
Without a pipeline, FSDP reduce-scatters the gradients after every
micro-batch (as torchtitan's accumulation loop does) and DDP syncs only on
the last micro-batch; with a pipeline the schedule syncs once per iteration.
Pipeline stages get static input/output shapes (runtime shape inference
pickles objects through numpy, which is not installed).

embedding_sync "all-reduce" syncs the token embedding's gradient like every
other (dense).  "sparse-all-gather" builds it as nn.Embedding(sparse=True):
its gradient is a sparse COO tensor of the rows looked up, which DDP puts in
a bucket of its own and all-reduces through the process group, gloo doing
that as an all-gather of every rank's indices and values (PyTorch DDP's
sparse path).  It needs DDP (tp == pp == 1, optimizer_sharding "none",
dp > 1), model.tied_embeddings false (a tied head's gradient is dense) and
the gloo backend (ProcessGroupNCCL has no sparse all_reduce); a job asking
for it elsewhere, or for "parameter-server" anywhere, is refused (JobError
naming parallel.embedding_sync).  Under bf16 autocast the lookup is not
autocast (embedding is on no autocast list): the table, its sparse
gradient and the lookup's output stay fp32.

Mixture of experts (model.moe): layer i has experts when i >= dense_layers
and (i - dense_layers) % layer_freq == 0 (paratune's MoeSpec::is_moe_layer),
else the dense MLP.  An MoE layer's MLP is Megatron-Core's MoE layer: a
router (linear hidden -> experts, no bias; the top-k logits of each token,
softmaxed over those k: Megatron-LM's default, no auxiliary loss, no
capacity limit), `experts` routed MLPs of width moe.ffn_hidden of the dense
MLP's kind (gated or not, biases as the model's linears), and a shared MLP
of width shared_ffn_hidden on every token when that is non-zero.  Expert
parallelism: the expert mesh (pp, edp, ep, etp) over the same ranks, etp
fastest (Megatron-Core's expert order; edp = tp*cp*dp/(etp*ep)); the ep ranks
each hold experts/ep consecutive experts.  moe_dispatcher "alltoall",
Megatron-Core's all-to-all dispatcher: token copies sorted by expert, the
counts exchanged by all_to_all_single over the ep group, then the tokens
(in the compute dtype); each rank runs its experts and sends the outputs
back by the reverse all_to_all_single (torch.distributed.nn.functional, so
the backward is the reverse exchange), summed per token weighted by the
router's probabilities.  "allgather", Megatron-Core's
MoEAllGatherTokenDispatcher (over the ep group when etp is 1): the
hidden states (compute dtype) and the routing probabilities (fp32) are
all-gathered over the ep group (all_gather_into_tensor, whose backward
reduce-scatters the gradients to their owners), the chosen experts too
(no gradient); each rank runs its experts on the gathered token copies
routed to them (grouped by expert, in token order), weights each by its
probability, sums them per gathered token and reduce-scatters the sums in
fp32 back to the tokens' owners (reduce_scatter_tensor, whose backward
all-gathers).
The routed experts' gradients sync over the edp group, every other
parameter's over dp x cp (both as means over dp x cp: an expert's gradient
already sums its ep x etp group's losses); so a mixture of experts is never
wrapped in DDP ("all-reduce of local gradients" without sharding; with FSDP
the experts are fully_shard over the edp mesh with a gradient divide factor
of dp x cp).  Beside context parallelism each cp rank routes its own
tokens, and the ep ranks are drawn from the stage's cp x dp ranks.  Beside
tensor parallelism (sequence-parallel only, as Megatron-Core runs it) an MoE
layer takes its tp rank's own tokens (its sequence shard, local) and hands
back theirs; the router and the shared expert are whole on every tp rank and
their gradients are summed over tp (Megatron-Core's sequence-parallel
parameters), the ep ranks drawn from tp x cp x dp.  Expert tensor
parallelism (etp > 1, Megatron-Core's): each routed expert is split over
its etp ranks, fc1 (and fc3) by rows, fc2 by columns, fc2's bias on etp
rank 0 alone, every shard cut from the whole expert drawn from its seed.
The all-to-all dispatcher exchanges over the ep group (the ranks of one
etp coordinate), all-gathers the arrived token copies over the etp group
(uneven, padded), runs the shards on all of them and reduce-scatters the
partial outputs back before the reverse exchange; the all-gather
dispatcher gathers over ep x etp (its tp_ep group) and its reduce-scatter
sums the shards' partial outputs.  A rank's token counts are those its
shards computed.  ep*etp must divide tp*cp*dp and etp the expert width;
ep > 1 or etp > 1 without model.moe is refused (JobError).  Router
and shared expert are drawn from the block's seed, routed expert g of layer
i from seed + 1000000 + i*experts + g.

Context parallelism (parallel.cp > 1, Megatron-LM's cp_comm): the
sequence is cut into 2*cp chunks and cp rank r holds chunks r and
2*cp-1-r (Megatron's causal load balance), its tokens' own positions
(learned or RoPE) and targets.  Attention is ring attention, a
torch.autograd.Function: the queries of the rank's tokens attend to its own
keys/values, then to each other cp rank's as they pass around the ring
(dist.batch_isend_irecv to the next cp rank, from the previous, cp-1 steps,
the next block's exchange overlapped with the current block's attention),
blocks merged by their log-sum-exp (online softmax), the causal mask taken
from the global positions of the queries and keys.  Its backward runs the
ring again: each rank's key/value block travels with the gradient of it
accumulated so far, every rank adding its queries' share, until the block's
gradient arrives back at its owner (cp exchanges).  Every block is computed
whole under the mask (the fully masked halves Megatron skips are computed
too).  With cp_comm a2a (Megatron-LM's --cp-comm-type a2a, DeepSpeed-
Ulysses) attention is instead an all-to-all over the cp group
(torch.distributed.nn.functional.all_to_all_single, whose backward is the
reverse exchange) of each of q, k and v from [its tokens, all heads] to
[all tokens, heads/cp] (kv_heads/cp), the tokens put back into sequence
order, the ordinary causal attention of the rank's heads, and the reverse
all-to-all to [its tokens, all heads]; cp must divide heads and kv_heads.
With cp_comm allgather (Megatron-LM's --cp-comm-type allgather) every cp
rank's keys and values are all-gathered over the cp group
(all_gather_into_tensor, in cp rank order, each rank's two chunks), the
rank's own queries attend to the whole sequence's under the causal mask of
their global positions (scaled_dot_product_attention with that mask), and
the gather's backward reduce-scatters the key and value gradients (summed
over the cp ranks' queries) back to their owners.
Dense gradients sync over dp x cp (Megatron-LM's data-parallel
group with context parallelism): the all-reduce of local gradients, or
fully_shard over the flattened (dp, cp) mesh as torchtitan does, as means
over dp x cp; each cp rank's loss is the mean over its tokens, and the loss
reported is the mean over the cp group (the whole sequence's).  Under a
pipeline each stage's cp ranks form their own ring, and the stages pass
the hidden states of their own tokens (seq_len / cp of them) to the next
stage's rank of the same (dp, cp) coordinate; a tied word embedding sums
its two copies' gradients over the first and last stage of each (dp, cp).
Beside tensor parallelism each tp rank's heads (heads / tp) run the
exchange over the cp ranks of its tp coordinate.  The worker runs cp for a
dense model or a mixture of experts, without HSDP, with all-reduce embedding sync, without dropout
(context-parallel attention computes the softmax without a dropout mask)
and any cp_comm; a job asking for others is refused (JobError).

Training: AdamW (lr 1e-3, foreach=False), with sparse-all-gather
torch.optim.SparseAdam (lr 1e-3) for the token embedding's table and AdamW
for every other parameter (both stepped, both zeroed every iteration);
cross entropy of the next token,
on fixed random token ids drawn once per dp rank from the seed and reused
every iteration (so the loss falls); parameters are drawn from per-component
seeds, so every partition of the same model starts from the same weights,
and with dropout off a run's loss does not depend on tp/pp.  Compute in bf16
is FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), or
torch.autocast without FSDP; parameters, gradients and Adam moments are fp32.

Timing: a barrier before each iteration, perf_counter around it (after a
device synchronize on CUDA), the maximum over ranks in iteration_ms.  One
extra iteration then runs under torch.profiler: collectives_ms sums, per
kind, the NCCL kernels' device time on CUDA; on gloo the wall time covered
by the gloo:* records (gloo runs reduce_scatter as an all_reduce, so each is
labelled by the c10d::* op that issued it).

Report JSON (output), train mode: report_dir/rank-<R>.json on every rank
------------------------------------------------------------------------
    {"schema": 1, "mode": "train", "candidate", "rank", "world_size",
     "torch_version", "backend", "device", "dtype",
     "degrees": {"tp", "pp", "dp", "cp", "dp_shard", "dp_replicate"},
         # read back from the live mesh; dp_shard / dp_replicate are null
         # unless the job asked for HSDP (dp_shard set); with model.moe also
         # "ep", "etp", "edp" of the live expert mesh
     "mesh_coords": {"pp", "dp", "cp", "tp"},  # dp: dp_replicate*dp_shard + shard
     "cp_comm": "p2p" | "a2a" | "allgather" (the exchange the attention
         layers ran; with cp 1 the planned name, unused),
     "context": null (cp 1) | {"cp", "cp_comm", "chunks": [r, 2cp-1-r],
         "tokens": seq_len/cp, "ring_steps": cp-1 (forward; a2a and
         allgather: 0), "attention": "ring" | "all-to-all" (a2a)
         | "all-gather" (allgather)},
     "stages": [chunk indices held], "stage_layers": [layers of each],
     "schedule": "ScheduleGPipe" | "Schedule1F1B" | "ScheduleInterleaved1F1B"
                 | "none",
     "micro_batches", "micro_batch",
     "data_parallel": "fully_shard(reshard_after_forward=True)"
                      | "fully_shard(reshard_after_forward=False)" | "DDP"
                      | "all-reduce of local gradients" | "none",
     "tensor_parallel": {module FQN in its chunk: style class name},
     "sequence_parallel": bool (as applied), "recompute",
     "embedding_sync": "all-reduce" | "sparse-all-gather" (as applied),
     "embedding_grad_sparse": bool | null,   # sparse-all-gather: whether
         # the table's weight.grad.is_sparse after every backward (also in
         # the notes); null with all-reduce
     "checkpointed_blocks": blocks of this rank with any recomputation,
     "parameters": numel of this rank's local parameter shards,
     "parameter_bytes": their bytes (fp32 master copies),
     "iteration_ms": [max over ranks, per timed iteration],
     "rank_iteration_ms": [this rank's],
     "peak_memory_bytes", "baseline_memory_bytes",
     "memory_kind": "rss-above-baseline" | "cuda-max-allocated",
     "reserved_bytes": int | null,
     "collectives_ms": {"all_reduce": ms, "all_gather": ms, ...},
     "loss": [mean loss per timed iteration] | null (ranks without the head),
     "notes": [str, ...],
     "experts": (only with model.moe) {"ep", "etp", "edp", "coords",
         "experts", "topk", "local_experts": count held, "expert_ids",
         "moe_layers": MoE layers of this rank, "dispatcher" (the one its
         MoE layers ran), "steps",
         "tokens_received_per_step", "tokens_sent_per_step",
         "tokens_per_local_expert_per_step": [...]}
         # token copies, summed over this rank's MoE layers and micro-
         # batches, averaged over every step run (warmup and the profiled
         # one included); a recomputation's forward is not counted}

Memory: CPU: after the distributed packages are imported and a tiny
autograd/AdamW step has run (one-time costs), /proc/self/clear_refs gets "5"
(resets VmHWM) and VmRSS is the baseline; peak_memory_bytes = VmHWM after the
timed iterations - baseline - growth of RssFile meanwhile (library code paged
in).  CUDA: torch.cuda max_memory_allocated (peak_memory_bytes) and
max_memory_reserved (reserved_bytes) since a reset before the model is built.
The profiled iteration runs after the memory is read.

Comm mode: rank 0 alone writes report_dir/comm.json (other ranks write
nothing):
    {"schema": 1, "mode": "comm", "world_size", "backend", "device",
     "points": [{"op", "ranks", "bytes", "seconds", "samples"}]}
"bytes" is the requested size of the full fp32 tensor: the all_reduce
buffer, the all_gather output, the reduce_scatter input (rounded down to a
multiple of 4*world bytes), the send_recv message.  "seconds" is the median
over the timed repetitions, the maximum of that over ranks; send_recv is a
rank 0 <-> rank 1 ping-pong and counts the one-way time (half a round trip).

Sync mode: the gradient of an embedding table (vocab V rows x hidden h
columns, fp32) after one batch of n token ids per rank, synchronised for
real between the ranks in three ways.  Rank R's ids: with token_file (one
non-negative integer id < V per line), ids [R*n, (R+1)*n) of the file,
wrapping around; with zipf_exponent s, n ids drawn i.i.d. with
P(id = r) proportional to (r+1)^-s, r in 0..V-1, by torch.multinomial
seeded with seed + R (inverse-CDF sampling above multinomial's 2^24
categories).  Each rank holds the k distinct ids its batch touched (int64,
sorted) and their gradient rows (k x h fp32, each row filled with that id's
token count).  Per method:
* all_reduce: the dense V x h gradient (the touched rows, zeros elsewhere,
  written before the clock starts), one dist.all_reduce (the dense path).
* sparse_all_gather: PyTorch DDP's path for sparse gradients
  (nn.Embedding(sparse=True)): an all_gather of every rank's k, padding to
  the largest, all_gathers of the ids and of the rows, then
  torch.sparse_coo_tensor(...).coalesce() of the valid entries (the summed
  gradient of every touched row).
* parameter_server, for each p in partitions: Parallax's sparse path with
  servers on ranks 0..p-1; row r is owned by server r % p, which holds that
  shard (row r at r // p, fp32, from zeros) as a parameter.  Each rank groups
  its ids and rows by owner and, to every other owner, sends its count, then
  the ids and the rows (dist.batch_isend_irecv; a rank's own share stays
  local; empty messages are skipped); each server sums what it holds per
  row (torch.unique + index_add_), applies SGD (lr 0.01) to those rows of
  its shard and sends each rank the updated rows of the ids it pushed; the
  rank writes them (and those of its own shard) into its V x h local copy.
Timed: for each (method, p, n): warmup + iterations repetitions, each a
barrier, perf_counter, the whole exchange above (counts, padding, grouping,
summing and updating included), a device synchronize; "seconds" is the
median over the timed repetitions, the maximum of that over ranks.  Rank 0
alone writes report_dir/sync.json:
    {"schema": 1, "mode": "sync", "world_size", "backend", "device",
     "points": [{"method", "ranks": world, "partitions": p (0 for
                 all_reduce and sparse_all_gather), "vocab", "hidden",
                 "element_bytes": 4, "tokens": n, "rows": mean over ranks
                 of k (float), "seconds", "samples"}]}

Errors: rank-<R>.error.json {"schema": 1, "rank", "error": one line,
"traceback"} (when report_dir is known), the one line on stderr, exit 1.
All reports are written atomically (temporary file + os.replace).
"""

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

SCHEMA = 1
DROPOUT_P = 0.1
LEARNING_RATE = 1e-3
EMBEDDING_INIT_STD = 0.02
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
}
RECOMPUTE_POLICIES = ("none", "selective", "full", "selective-op", "selective-layer")
OPTIMIZER_SHARDINGS = ("none", "optimizer-states", "full")
EMBEDDING_SYNCS = ("all-reduce", "sparse-all-gather")
MOE_DISPATCHERS = ("alltoall", "allgather")
CP_COMMS = ("p2p", "a2a", "allgather")
CP_ATTENTION = {"p2p": "ring", "a2a": "all-to-all", "allgather": "all-gather"}  # the report's context.attention
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
SYNC_METHODS = ("all_reduce", "sparse_all_gather", "parameter_server")
SYNC_LEARNING_RATE = 0.01  # the parameter server's SGD step


class JobError(ValueError):
    """A job field that cannot be run; the message names the field."""


# ---------------------------------------------------------------------------
# Job parsing (pure: shared by the train mode and --describe)
# ---------------------------------------------------------------------------


def _get(obj, key, prefix, kind, choices=None, minimum=None, optional=False):
    """Read obj[key], checking its type, range and choices; errors name prefix.key."""
    name = f"{prefix}{key}"
    if key not in obj or obj[key] is None:
        if optional:
            return None
        raise JobError(f"{name}: missing")
    value = obj[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise JobError(f"{name}: expected an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise JobError(f"{name}: expected true or false, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise JobError(f"{name}: expected a string, got {value!r}")
    if kind is list and not isinstance(value, list):
        raise JobError(f"{name}: expected a list, got {value!r}")
    if kind is dict and not isinstance(value, dict):
        raise JobError(f"{name}: expected an object, got {value!r}")
    if choices is not None and value not in choices:
        raise JobError(f"{name}: {value!r} is not one of {', '.join(map(str, choices))}")
    if minimum is not None and value < minimum:
        raise JobError(f"{name}: {value} is below the minimum {minimum}")
    return value


@dataclass
class MoeConfig:
    """A mixture of experts (model.moe), as paratune's MoeSpec."""

    experts: int
    topk: int
    ffn_hidden: int
    shared_ffn_hidden: int
    dense_layers: int
    layer_freq: int

    def is_moe_layer(self, i):
        """Whether layer i (from 0) has experts: paratune's MoeSpec::is_moe_layer."""
        return i >= self.dense_layers and (i - self.dense_layers) % max(1, self.layer_freq) == 0


@dataclass
class ModelConfig:
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    gated_mlp: bool
    layers: int
    vocab: int
    seq_len: int
    tied_embeddings: bool
    learned_positions: bool
    attention: str
    dropout: bool
    moe: MoeConfig | None = None

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @property
    def linear_bias(self):
        # GPT (Megatron-LM) linears carry biases; Llama (torchtitan) ones do not.
        return self.learned_positions


@dataclass
class Layout:
    """The parallel configuration, derived from the job and checked."""

    tp: int
    pp: int
    dp: int
    dp_shard: int | None
    dp_replicate: int | None
    virtual_stages: int
    stage_layers: list
    chunk_first_layer: list
    micro_batch: int
    global_batch: int
    micro_batches: int
    schedule: str
    sequence_parallel: bool
    optimizer_sharding: str
    recompute: str
    ac_frequency: int
    embedding_sync: str = "all-reduce"
    ep: int = 1
    etp: int = 1
    moe_dispatcher: str = "alltoall"
    cp: int = 1
    cp_comm: str = "p2p"
    notes: list = field(default_factory=list)

    @property
    def edp(self):
        """Expert-data-parallel degree: the stage's ranks (tp x cp x dp) over etp x ep."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def sparse_embedding(self):
        return self.embedding_sync == "sparse-all-gather"

    @property
    def world(self):
        return self.tp * self.pp * self.dp * self.cp

    @property
    def dense_sync(self):
        """Ranks a dense gradient is averaged over: dp x cp (Megatron-LM)."""
        return self.dp * self.cp

    @property
    def chunks(self):
        return self.pp * self.virtual_stages


def parse_model(job):
    m = _get(job, "model", "", dict)
    p = "model."
    cfg = ModelConfig(
        hidden=_get(m, "hidden", p, int, minimum=1),
        heads=_get(m, "heads", p, int, minimum=1),
        kv_heads=_get(m, "kv_heads", p, int, minimum=1),
        ffn_hidden=_get(m, "ffn_hidden", p, int, minimum=1),
        gated_mlp=_get(m, "gated_mlp", p, bool),
        layers=_get(m, "layers", p, int, minimum=1),
        vocab=_get(m, "vocab", p, int, minimum=2),
        seq_len=_get(m, "seq_len", p, int, minimum=2),
        tied_embeddings=_get(m, "tied_embeddings", p, bool),
        learned_positions=_get(m, "learned_positions", p, bool),
        attention=_get(m, "attention", p, str, choices=("standard", "flash")),
        dropout=_get(m, "dropout", p, bool),
    )
    if cfg.hidden % cfg.heads:
        raise JobError(f"model.heads: {cfg.heads} does not divide model.hidden = {cfg.hidden}")
    if cfg.heads % cfg.kv_heads:
        raise JobError(f"model.kv_heads: {cfg.kv_heads} does not divide model.heads = {cfg.heads}")
    if not cfg.learned_positions and cfg.head_dim % 2:
        raise JobError(f"model.hidden: RoPE needs an even head dimension, got {cfg.head_dim}")
    cfg.moe = parse_moe(m)
    return cfg


def parse_moe(m):
    """model.moe: null or absent for a dense model."""
    moe = _get(m, "moe", "model.", dict, optional=True)
    if moe is None:
        return None
    p = "model.moe."
    cfg = MoeConfig(
        experts=_get(moe, "experts", p, int, minimum=1),
        topk=_get(moe, "topk", p, int, minimum=1),
        ffn_hidden=_get(moe, "ffn_hidden", p, int, minimum=1),
        shared_ffn_hidden=_get(moe, "shared_ffn_hidden", p, int, minimum=0),
        dense_layers=_get(moe, "dense_layers", p, int, minimum=0),
        layer_freq=_get(moe, "layer_freq", p, int, minimum=1),
    )
    if cfg.topk > cfg.experts:
        raise JobError(f"model.moe.topk: {cfg.topk} exceeds the {cfg.experts} experts")
    return cfg


def parse_layout(job, model, world):
    par = _get(job, "parallel", "", dict)
    p = "parallel."
    tp = _get(par, "tp", p, int, minimum=1)
    pp = _get(par, "pp", p, int, minimum=1)
    dp = _get(par, "dp", p, int, minimum=1)
    cp = _get(par, "cp", p, int, minimum=1, optional=True) or 1
    if tp * pp * dp * cp != world:
        raise JobError(
            f"parallel: tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp} = {tp * pp * dp * cp} but the world size is {world}"
        )
    sharding = _get(par, "optimizer_sharding", p, str, choices=OPTIMIZER_SHARDINGS)
    dp_shard = _get(par, "dp_shard", p, int, minimum=1, optional=True)
    dp_replicate = None
    if dp_shard is not None:
        if dp % dp_shard:
            raise JobError(f"parallel.dp_shard: {dp_shard} does not divide parallel.dp = {dp}")
        if sharding == "none":
            raise JobError("parallel.dp_shard: HSDP needs optimizer_sharding full or optimizer-states, got none")
        dp_replicate = dp // dp_shard
    virtual = _get(par, "virtual_stages", p, int, minimum=1)
    schedule = _get(par, "schedule", p, str, choices=tuple(SCHEDULE_CLASSES))
    if pp == 1 and virtual != 1:
        raise JobError(f"parallel.virtual_stages: {virtual} needs pp > 1")
    if virtual > 1 and schedule != "interleaved":
        raise JobError(f"parallel.schedule: {schedule} runs one chunk per rank, virtual_stages = {virtual} needs interleaved")
    stage_layers = _get(par, "stage_layers", p, list)
    if len(stage_layers) != pp * virtual:
        raise JobError(
            f"parallel.stage_layers: {len(stage_layers)} chunks given, pp*virtual_stages = {pp * virtual}"
        )
    for i, n in enumerate(stage_layers):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise JobError(f"parallel.stage_layers[{i}]: expected a non-negative integer, got {n!r}")
        if n == 0 and 0 < i < len(stage_layers) - 1:
            raise JobError(f"parallel.stage_layers[{i}]: a middle chunk needs at least one layer")
    if sum(stage_layers) != model.layers:
        raise JobError(f"parallel.stage_layers: sum {sum(stage_layers)} != model.layers = {model.layers}")
    first = [sum(stage_layers[:i]) for i in range(len(stage_layers))]
    micro = _get(par, "micro_batch", p, int, minimum=1)
    global_batch = _get(par, "global_batch", p, int, minimum=1)
    if global_batch % (dp * micro):
        raise JobError(f"parallel.global_batch: {global_batch} is not a multiple of dp*micro_batch = {dp * micro}")
    n_micro = global_batch // (dp * micro)
    if pp > 1 and schedule == "1f1b" and n_micro < pp:
        raise JobError(f"parallel.global_batch: 1f1b needs at least pp = {pp} micro-batches, got {n_micro}")
    if pp > 1 and schedule == "interleaved":
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            raise JobError(
                f"parallel.global_batch: interleaved needs the {n_micro} micro-batches to be a multiple of "
                f"max(1, micro_batches // pp) = {rounds}"
            )
    for name, value in (("heads", model.heads), ("kv_heads", model.kv_heads),
                        ("ffn_hidden", model.ffn_hidden), ("vocab", model.vocab)):
        if value % tp:
            raise JobError(f"model.{name}: {value} is not divisible by parallel.tp = {tp}")
    notes = []
    sp = _get(par, "sequence_parallel", p, bool)
    if sp and tp == 1:
        notes.append("sequence_parallel ignored: it needs tp > 1")
        sp = False
    if sp and model.seq_len % tp:
        raise JobError(f"parallel.sequence_parallel: model.seq_len = {model.seq_len} is not divisible by tp = {tp}")
    embedding_sync = parse_embedding_sync(job, par, model, tp, pp, dp, sharding)
    ep, etp, dispatcher = parse_experts(par, model, tp, cp, dp, sp)
    cp_comm = parse_context(par, model, cp, tp, dp_shard, embedding_sync)
    return Layout(
        tp=tp, pp=pp, dp=dp, dp_shard=dp_shard, dp_replicate=dp_replicate,
        virtual_stages=virtual, stage_layers=list(stage_layers), chunk_first_layer=first,
        micro_batch=micro, global_batch=global_batch, micro_batches=n_micro,
        schedule=schedule, sequence_parallel=sp, optimizer_sharding=sharding,
        recompute=_get(par, "recompute", p, str, choices=RECOMPUTE_POLICIES),
        ac_frequency=_get(par, "ac_frequency", p, int, minimum=1),
        embedding_sync=embedding_sync,
        ep=ep, etp=etp, moe_dispatcher=dispatcher,
        cp=cp, cp_comm=cp_comm,
        notes=notes,
    )


def parse_context(par, model, cp, tp, dp_shard, embedding_sync):
    """parallel.cp_comm, "p2p" when absent; what the worker runs of cp > 1 is checked."""
    p = "parallel."
    cp_comm = _get(par, "cp_comm", p, str, choices=CP_COMMS, optional=True) or "p2p"
    if cp == 1:
        return cp_comm
    why = []
    # Under tp each rank holds heads / tp of them, which a2a splits over cp.
    if cp_comm == "a2a" and ((model.heads // tp) % cp or (model.kv_heads // tp) % cp):
        why.append(f"cp_comm a2a with heads {model.heads}, kv_heads {model.kv_heads} over tp = {tp} "
                   f"(cp = {cp} must divide both per tp rank)")
    if dp_shard is not None:
        why.append("dp_shard (HSDP beside context parallelism is not run)")
    if embedding_sync != "all-reduce":
        why.append(f"embedding_sync {embedding_sync} (DDP's, and cp syncs by all-reduce over dp x cp)")
    if model.dropout:
        why.append("model.dropout (context-parallel attention is run without a dropout mask)")
    if model.seq_len % (2 * cp):
        why.append(f"model.seq_len = {model.seq_len} (not a multiple of 2*cp = {2 * cp})")
    if why:
        raise JobError(f"parallel.cp: cp = {cp} is not run by the worker with {'; '.join(why)}")
    return cp_comm


def parse_experts(par, model, tp, cp, dp, sp):
    """(ep, etp, moe_dispatcher): 1, 1, "alltoall" when absent (jobs older than the fields).

    The experts' ranks follow Megatron-Core: etp fastest, then ep, then
    expert-data parallelism, over a pipeline stage's tp x cp x dp ranks.
    Each expert is split over its etp ranks; tp > 1 runs with sequence parallelism only.
    """
    p = "parallel."
    ep = _get(par, "ep", p, int, minimum=1, optional=True) or 1
    etp = _get(par, "etp", p, int, minimum=1, optional=True) or 1
    dispatcher = _get(par, "moe_dispatcher", p, str, choices=MOE_DISPATCHERS, optional=True) or "alltoall"
    moe = model.moe
    if moe is None:
        if ep > 1 or etp > 1:
            raise JobError(f"parallel.ep: ep = {ep} and etp = {etp} need model.moe (the model has no experts)")
        return ep, etp, dispatcher
    if tp > 1 and not sp:
        raise JobError(f"parallel.sequence_parallel: mixture-of-experts layers beside tp = {tp} are run "
                       "with sequence parallelism only")
    if (tp * cp * dp) % ep:
        raise JobError(f"parallel.ep: {ep} does not divide tp*cp*dp = {tp * cp * dp}, the stage's ranks")
    if (tp * cp * dp) % (ep * etp):
        raise JobError(f"parallel.etp: ep*etp = {ep * etp} does not divide tp*cp*dp = {tp * cp * dp}, "
                       "the stage's ranks")
    if moe.experts % ep:
        raise JobError(f"parallel.ep: {ep} does not divide model.moe.experts = {moe.experts}")
    if moe.ffn_hidden % etp:
        raise JobError(f"parallel.etp: {etp} does not divide model.moe.ffn_hidden = {moe.ffn_hidden}")
    return ep, etp, dispatcher


def parse_embedding_sync(job, par, model, tp, pp, dp, sharding):
    """parallel.embedding_sync, "all-reduce" when absent (jobs older than the field).

    "sparse-all-gather" is DDP over a sparse token embedding, so it is run
    only where the model is wrapped in DDP, with an untied table, on gloo.
    """
    name = "parallel.embedding_sync"
    if par.get("embedding_sync") == "parameter-server":
        raise JobError(f"{name}: parameter-server is not run by the worker (it runs no parameter server)")
    sync = _get(par, "embedding_sync", "parallel.", str, choices=EMBEDDING_SYNCS, optional=True)
    if sync is None or sync == "all-reduce":
        return "all-reduce"
    why = []
    if tp > 1 or pp > 1:
        why.append(f"tp = {tp} and pp = {pp} (DDP wraps the model only with tp == pp == 1)")
    if sharding != "none":
        why.append(f"optimizer_sharding {sharding} (FSDP shards the table; DDP needs none)")
    if dp < 2:
        why.append(f"dp = {dp} (no data-parallel ranks to synchronise)")
    if model.tied_embeddings:
        why.append("model.tied_embeddings (the head's gradient of a tied table touches every row)")
    if model.moe is not None:
        why.append("model.moe (the experts sync over their own group, so the model is not wrapped in DDP)")
    if job.get("backend") == "nccl":
        why.append("backend nccl (ProcessGroupNCCL has no sparse all_reduce, which DDP syncs a sparse gradient with)")
    if why:
        raise JobError(f"{name}: sparse-all-gather needs the model wrapped in DDP over a sparse, untied "
                       f"token embedding on gloo; not with {'; '.join(why)}")
    return sync


def parse_train_job(job, world):
    _check_header(job)
    model = parse_model(job)
    return model, parse_layout(job, model, world)


def _check_header(job):
    if not isinstance(job, dict):
        raise JobError("job: expected a JSON object")
    schema = job.get("schema")
    if schema != SCHEMA:
        raise JobError(f"schema: {schema!r} is not the supported schema {SCHEMA}")
    _get(job, "mode", "", str, choices=("train", "comm", "sync"))
    _get(job, "device", "", str, choices=("cpu", "cuda"))
    _get(job, "backend", "", str, choices=("gloo", "nccl"))
    _get(job, "dtype", "", str, choices=("bf16", "fp32"))
    if job["backend"] == "nccl" and job["device"] != "cuda":
        raise JobError("backend: nccl needs device cuda")


# ---------------------------------------------------------------------------
# Configuration mapping (pure: what each rank runs)
# ---------------------------------------------------------------------------


def mesh_coords_of_rank(rank, layout):
    """Megatron-Core's order: tp varies fastest, then cp, then dp, then pp."""
    tp_k = rank % layout.tp
    cp_c = (rank // layout.tp) % layout.cp
    dp_j = (rank // (layout.tp * layout.cp)) % layout.dp
    pp_i = rank // (layout.tp * layout.cp * layout.dp)
    return {"pp": pp_i, "dp": dp_j, "cp": cp_c, "tp": tp_k}


def rank_of_coords(pp_i, dp_j, tp_k, layout, cp_c=0):
    return ((pp_i * layout.dp + dp_j) * layout.cp + cp_c) * layout.tp + tp_k


def cp_chunks(layout, cp_rank):
    """The two of the sequence's 2*cp chunks cp rank r holds: r and 2*cp-1-r (Megatron's causal balance)."""
    return [cp_rank, 2 * layout.cp - 1 - cp_rank]


def cp_positions(seq_len, layout, cp_rank):
    """Global positions of the tokens cp rank `cp_rank` holds, in the order it holds them."""
    size = seq_len // (2 * layout.cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in cp_chunks(layout, cp_rank)])


def context_description(model, layout, cp_rank):
    if layout.cp == 1:
        return None
    ring = layout.cp_comm == "p2p"
    return {"cp": layout.cp, "cp_comm": layout.cp_comm, "chunks": cp_chunks(layout, cp_rank),
            "tokens": model.seq_len // layout.cp, "ring_steps": layout.cp - 1 if ring else 0,
            "attention": CP_ATTENTION[layout.cp_comm]}


def chunks_of_pp_rank(pp_rank, layout):
    """Megatron interleaving: chunk c lives on pipeline rank c % pp."""
    return [c for c in range(layout.chunks) if c % layout.pp == pp_rank]


def schedule_name(layout):
    return SCHEDULE_CLASSES[layout.schedule] if layout.pp > 1 else "none"


def uses_fully_shard(layout):
    return layout.optimizer_sharding in ("full", "optimizer-states")


def data_parallel_name(layout, model=None):
    """How the gradients are synchronised; a mixture of experts is never DDP
    (its experts sync over the expert-data-parallel group, the rest over dp)."""
    if uses_fully_shard(layout):
        reshard = layout.optimizer_sharding == "full"
        return f"fully_shard(reshard_after_forward={reshard})"
    if layout.dense_sync == 1:
        return "none"
    if layout.tp == 1 and layout.pp == 1 and layout.cp == 1 and (model is None or model.moe is None):
        return "DDP"
    return "all-reduce of local gradients"


def expert_coords_of_rank(rank, layout):
    """Megatron-Core's expert order over a stage's tp x cp x dp ranks: etp fastest, then ep, then
    expert-data."""
    within = rank % (layout.tp * layout.cp * layout.dp)
    return {"etp": within % layout.etp, "ep": (within // layout.etp) % layout.ep,
            "edp": within // (layout.etp * layout.ep)}


def local_experts_of_rank(rank, model, layout):
    """Global indices of the routed experts this rank holds (experts / ep consecutive ones)."""
    if model.moe is None:
        return []
    per = model.moe.experts // layout.ep
    first = expert_coords_of_rank(rank, layout)["ep"] * per
    return list(range(first, first + per))


def moe_layers_of(model, layers):
    return [i for i in layers if model.moe is not None and model.moe.is_moe_layer(i)]


def block_recompute(layout, layer):
    """What one block (global index `layer`) recomputes: None, "full", "op" or "attention"."""
    policy = layout.recompute
    if policy == "full":
        return "full"
    if policy == "selective-layer":
        return "full" if (layer + 1) % layout.ac_frequency == 0 else None
    if policy == "selective-op":
        return "op"
    if policy == "selective":
        return "attention"
    return None


def chunk_layers(layout, chunk):
    first = layout.chunk_first_layer[chunk]
    return list(range(first, first + layout.stage_layers[chunk]))


def tensor_parallel_plan(model, layout, chunk):
    """torchtitan's Llama TP plan for one chunk: {module FQN: ParallelStyle}; {} when tp == 1.

    The styles are cheap objects (no mesh needed), so --describe builds the
    very plan that parallelize_module gets.
    """
    if layout.tp == 1:
        return {}
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
        RowwiseParallel, SequenceParallel,
    )

    sp = layout.sequence_parallel
    hidden_layout = Shard(1) if sp else Replicate()
    plan = {}
    if chunk == 0:
        # Vocab-parallel embedding.  Llama + SP reduce-scatters straight into
        # sequence shards (torchtitan); GPT must add the positions to the full
        # sequence first, so it all-reduces and then slices (Megatron's
        # scatter_to_sequence_parallel_region).
        direct = sp and not model.learned_positions
        plan["embeddings.tok"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if direct else Replicate()
        )
        if sp and model.learned_positions:
            plan["embeddings"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            )
    for layer in chunk_layers(layout, chunk):
        b = f"layers.{layer}."
        # An MoE layer (sequence parallelism on, parse_experts checks) takes
        # its rank's own tokens and hands back theirs (Megatron-Core), local
        # as the residual stream between the blocks is.
        moe = model.moe is not None and model.moe.is_moe_layer(layer)
        if sp:
            plan[b + "attention_norm"] = SequenceParallel()
            plan[b + "attention"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan[b + "ffn_norm"] = SequenceParallel()
            if moe:
                plan[b + "feed_forward"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
                    output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True,
                )
            else:
                plan[b + "feed_forward"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                )
        for proj in ("wq", "wk", "wv"):
            plan[b + "attention." + proj] = ColwiseParallel()
        plan[b + "attention.wo"] = RowwiseParallel(output_layouts=hidden_layout)
        if moe:
            continue
        plan[b + "feed_forward.w1"] = ColwiseParallel()
        if model.gated_mlp:
            plan[b + "feed_forward.w3"] = ColwiseParallel()
        plan[b + "feed_forward.w2"] = RowwiseParallel(output_layouts=hidden_layout)
    if chunk == layout.chunks - 1:
        if sp:
            plan["norm"] = SequenceParallel()
        # Vocab-parallel head, logits gathered (Replicate) so that the plain
        # cross entropy works on gloo; torchtitan's loss_parallel is the
        # Shard(-1) variant of the same matmul.
        plan["output"] = ColwiseParallel(input_layouts=hidden_layout, output_layouts=Replicate())
    return plan


def plan_style_names(plan):
    return {name: type(style).__name__ for name, style in plan.items()}


def describe_rank(rank, model, layout):
    coords = mesh_coords_of_rank(rank, layout)
    chunks = chunks_of_pp_rank(coords["pp"], layout)
    tp_styles = {}
    for c in chunks:
        tp_styles.update(plan_style_names(tensor_parallel_plan(model, layout, c)))
    blocks = [l for c in chunks for l in chunk_layers(layout, c)]
    return {
        "rank": rank,
        "mesh_coords": coords,
        "stages": chunks,
        "stage_layers": [layout.stage_layers[c] for c in chunks],
        "schedule": schedule_name(layout),
        "data_parallel": data_parallel_name(layout, model),
        "tensor_parallel": tp_styles,
        "checkpointed_blocks": sum(block_recompute(layout, l) is not None for l in blocks),
        "micro_batches": layout.micro_batches,
        "embedding_sync": layout.embedding_sync,
        "context": context_description(model, layout, coords["cp"]),
        "experts": None if model.moe is None else {
            "coords": expert_coords_of_rank(rank, layout), "ep": layout.ep, "etp": layout.etp,
            "edp": layout.edp, "local_experts": local_experts_of_rank(rank, model, layout),
            "moe_layers": moe_layers_of(model, blocks), "dispatcher": layout.moe_dispatcher,
        },
    }


def describe(job, world):
    model, layout = parse_train_job(job, world)
    return {"ranks": [describe_rank(r, model, layout) for r in range(world)]}


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

def _ops(*qualified):
    """The OpOverloads that this torch build has, of "namespace.name" strings."""
    found = set()
    for q in qualified:
        namespace, name = q.split(".")
        try:
            found.add(getattr(getattr(torch.ops, namespace), name).default)
        except (AttributeError, RuntimeError):
            pass
    return found


# torchtitan's op-level SAC policy: save the attention kernels and every
# other matmul; the rest is recomputed.  Linears with biases (GPT) run as
# addmm, so addmm counts as a matmul too.  For explicit ("standard")
# attention the kernel output is the probs @ V product, the second bmm of
# each block.
_SAC_MATMULS = _ops("aten.mm", "aten.addmm")
_SAC_ALWAYS_SAVE = _ops(
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_cudnn_attention",
    "_c10d_functional.reduce_scatter_tensor",
)


def op_sac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in _SAC_MATMULS:
            counts[mode + "_mm"] += 1
            save = counts[mode + "_mm"] % 2 == 1
        elif func == torch.ops.aten.bmm.default:
            counts[mode + "_bmm"] += 1
            save = counts[mode + "_bmm"] % 2 == 0
        else:
            save = func in _SAC_ALWAYS_SAVE
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint(fn, *args, op_level=False):
    from torch.utils.checkpoint import checkpoint

    if op_level:
        return checkpoint(fn, *args, use_reentrant=False, context_fn=op_sac_context)
    return checkpoint(fn, *args, use_reentrant=False)


def rope_tables(seq_len, head_dim):
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@dataclass
class Ring:
    """A cp group's ring: its global ranks in cp order, this rank's place, and every cp rank's positions."""

    group: object
    ranks: list
    cp_rank: int
    positions: list  # tensors of global positions, one per cp rank

    @property
    def cp(self):
        return len(self.ranks)

    def start(self, send, recv, backward=False):
        """Send `send` to the next cp rank and receive `recv` from the previous; returns the requests."""
        import torch.distributed as dist

        nxt, prv = self.ranks[(self.cp_rank + 1) % self.cp], self.ranks[(self.cp_rank - 1) % self.cp]
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, self.group),
                                       dist.P2POp(dist.irecv, recv, prv, self.group)])


def _ring_block_forward(q, k, v, q_pos, k_pos, scale, n_rep):
    """Causal attention of q against one key/value block: (output normalised within the block, log-sum-exp).

    A row whose keys are all masked has lse -inf and output 0."""
    if n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = torch.exp(scores - top)
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs.to(v.dtype), v).float() / total.clamp_min(1e-30)
    return out, top + torch.log(total)


def _ring_block_backward(q, k, v, q_pos, k_pos, scale, n_rep, dout, lse, delta):
    """Gradients (dq, dk, dv) in fp32 of one block's share of the merged attention (flash attention's backward)."""
    b, kvh, sk, hd = k.shape
    kf, vf = k.float(), v.float()
    if n_rep > 1:
        kf, vf = kf.repeat_interleave(n_rep, dim=1), vf.repeat_interleave(n_rep, dim=1)
    qf = q.float()
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.exp(scores - lse)  # the merged softmax's share of this block
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dscores = probs * (torch.matmul(dout, vf.transpose(-2, -1)) - delta)
    dq = torch.matmul(dscores, kf) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), qf) * scale
    if n_rep > 1:
        dk = dk.view(b, kvh, n_rep, sk, hd).sum(2)
        dv = dv.view(b, kvh, n_rep, sk, hd).sum(2)
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Megatron-LM's p2p context parallelism: causal attention over the whole sequence, the keys and values
    passed around the cp ring (cp - 1 steps), blocks merged by their log-sum-exp.

    q: (batch, heads, local tokens, head_dim); k, v: (batch, kv_heads, local tokens, head_dim)."""

    @staticmethod
    def forward(ctx, q, k, v, ring, scale, n_rep):
        with torch.autocast(q.device.type, enabled=False):
            q_pos = ring.positions[ring.cp_rank]
            kv = torch.stack([k, v]).contiguous()
            out = lse = None
            for step in range(ring.cp):
                requests = None
                if step + 1 < ring.cp:
                    arriving = torch.empty_like(kv)
                    requests = ring.start(kv, arriving)
                src = (ring.cp_rank - step) % ring.cp
                block, block_lse = _ring_block_forward(q, kv[0], kv[1], q_pos, ring.positions[src], scale, n_rep)
                if out is None:
                    out, lse = block, block_lse
                else:
                    merged = torch.logaddexp(lse, block_lse)
                    out = out * torch.exp(lse - merged) + block * torch.exp(block_lse - merged)
                    lse = merged
                if requests is not None:
                    for r in requests:
                        r.wait()
                    kv = arriving
        ctx.ring, ctx.scale, ctx.n_rep = ring, scale, n_rep
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, n_rep = ctx.ring, ctx.scale, ctx.n_rep
        with torch.autocast(q.device.type, enabled=False):
            q_pos = ring.positions[ring.cp_rank]
            dout = dout.float()
            delta = (dout * out).sum(dim=-1, keepdim=True)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            kv = torch.stack([k, v]).contiguous()
            # The gradient of the key/value block held travels with it around the ring.
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for step in range(ring.cp):
                requests = None
                if step + 1 < ring.cp:
                    arriving = torch.empty_like(kv)
                    requests = ring.start(kv, arriving)
                src = (ring.cp_rank - step) % ring.cp
                bq, bk, bv = _ring_block_backward(q, kv[0], kv[1], q_pos, ring.positions[src], scale, n_rep,
                                                  dout, lse, delta)
                dq += bq
                dkv[0] += bk
                dkv[1] += bv
                if requests is not None:
                    for r in requests:
                        r.wait()
                    kv = arriving
                if ring.cp > 1:
                    # Pass the block's gradient on: after cp passes it is back at its owner.
                    back = torch.empty_like(dkv)
                    for r in ring.start(dkv, back):
                        r.wait()
                    dkv = back
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _cp_all_to_all(x, ring):
    """Ulysses's exchange over the cp group: x (batch, heads, local tokens, head_dim) -> (batch, heads/cp,
    cp * local tokens, head_dim), cp rank j's tokens j-th; autograd's backward is the reverse exchange."""
    from torch.distributed.nn.functional import all_to_all_single

    b, h, s, hd = x.shape
    send = x.reshape(b, ring.cp, h // ring.cp, s, hd).transpose(0, 1).contiguous()
    got = all_to_all_single(torch.empty_like(send), send, group=ring.group)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // ring.cp, ring.cp * s, hd)


def _cp_all_to_all_back(x, ring):
    """The reverse of _cp_all_to_all: (batch, heads/cp, cp * local tokens, head_dim) -> (batch, heads,
    local tokens, head_dim)."""
    from torch.distributed.nn.functional import all_to_all_single

    b, hl, total, hd = x.shape
    s = total // ring.cp
    send = x.reshape(b, hl, ring.cp, s, hd).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all_single(torch.empty_like(send), send, group=ring.group)
    return got.transpose(0, 1).reshape(b, ring.cp * hl, s, hd)


def _cp_all_gather_kv(k, v, ring):
    """Megatron-LM's allgather exchange: every cp rank's keys and values, (batch, kv_heads, cp * local
    tokens, head_dim) each, cp rank j's tokens j-th; the backward reduce-scatters their gradients (summed
    over the cp ranks' queries) back to the owners."""
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)  # tokens first: (local tokens, 2, batch, kv_heads, hd)
    kv = GatherFirstDim.apply(kv, ring.group).permute(1, 2, 3, 0, 4)
    return kv[0], kv[1]


def _masked_attention(q, k, v, q_pos, k_pos, scale):
    """Causal attention of q against k, v whose global positions are q_pos and k_pos (any order)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hd, bias = cfg.head_dim, cfg.linear_bias
        self.head_dim = hd
        self.n_rep = cfg.heads // cfg.kv_heads
        self.standard = cfg.attention == "standard"
        self.p = DROPOUT_P if cfg.dropout else 0.0
        self.wq = nn.Linear(cfg.hidden, cfg.heads * hd, bias=bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=bias)
        self.wo = nn.Linear(cfg.heads * hd, cfg.hidden, bias=bias)
        self.recompute_core = False
        # Ring of a context-parallel rank: attention runs around it (p2p), across it (a2a) or on the keys and
        # values gathered over it (allgather).
        self.ring = None
        self.cp_comm = "p2p"
        if cfg.learned_positions:
            self.cos = self.sin = None
        else:
            cos, sin = rope_tables(cfg.seq_len, hd)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        bsz, seqlen, _ = x.shape
        # view(..., -1, head_dim): the local head count under TP (heads/tp).
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        if self.cos is not None:
            if self.ring is None:
                cos, sin = self.cos[:seqlen], self.sin[:seqlen]
            else:  # the positions of the tokens this cp rank holds
                held = self.ring.positions[self.ring.cp_rank]
                cos, sin = self.cos[held], self.sin[held]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.ring is not None and self.cp_comm == "a2a":
            # Ulysses: [own tokens, all heads] -> [all tokens, heads/cp], sorted into sequence order so the
            # ordinary causal attention is right, then back to [own tokens, all heads].
            order = torch.argsort(torch.cat(self.ring.positions))
            back = torch.argsort(order)
            q, k, v = (_cp_all_to_all(t, self.ring)[:, :, order] for t in (q, k, v))
            if self.n_rep > 1:
                k = k.repeat_interleave(self.n_rep, dim=1)
                v = v.repeat_interleave(self.n_rep, dim=1)
            out = _checkpoint(self.core, q, k, v) if self.recompute_core else self.core(q, k, v)
            out = _cp_all_to_all_back(out[:, :, back], self.ring)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        if self.ring is not None and self.cp_comm == "allgather":
            # The rank's own queries against the whole sequence's keys and values, masked by global position.
            k, v = _cp_all_gather_kv(k, v, self.ring)
            if self.n_rep > 1:
                k = k.repeat_interleave(self.n_rep, dim=1)
                v = v.repeat_interleave(self.n_rep, dim=1)
            q_pos, k_pos = self.ring.positions[self.ring.cp_rank], torch.cat(self.ring.positions)
            core = lambda q, k, v: _masked_attention(q, k, v, q_pos, k_pos, 1.0 / math.sqrt(self.head_dim))
            out = _checkpoint(core, q, k, v) if self.recompute_core else core(q, k, v)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        if self.ring is not None:
            # Keys and values travel as kv_heads; each block repeats them for GQA.
            core = lambda q, k, v: RingAttention.apply(q, k, v, self.ring, 1.0 / math.sqrt(self.head_dim),
                                                       self.n_rep)
            out = _checkpoint(core, q, k, v) if self.recompute_core else core(q, k, v)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if self.recompute_core:
            out = _checkpoint(self.core, q, k, v)
        else:
            out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def core(self, q, k, v):
        p = self.p if self.training else 0.0
        if not self.standard:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        s = q.shape[-2]
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        return torch.matmul(F.dropout(probs, p, self.training), v)


class FeedForward(nn.Module):
    def __init__(self, cfg, width=None):
        super().__init__()
        bias = cfg.linear_bias
        width = cfg.ffn_hidden if width is None else width
        self.gated = cfg.gated_mlp
        self.w1 = nn.Linear(cfg.hidden, width, bias=bias)
        self.w2 = nn.Linear(width, cfg.hidden, bias=bias)
        self.w3 = nn.Linear(cfg.hidden, width, bias=bias) if cfg.gated_mlp else None

    def forward(self, x):
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


def expert_seed(seed, layer, expert, experts):
    """Routed expert `expert` of layer `layer` is drawn from its own seed, whichever rank holds it."""
    return seed + 1_000_000 + layer * experts + expert


class GatherFirstDim(torch.autograd.Function):
    """All-gather along the first dimension over `group` (rank order); the backward reduce-scatters the
    gradient (summed over the ranks) back to each rank's slice: Megatron-Core's
    gather_from_sequence_parallel_region."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return ReduceScatterFirstDim.apply(grad, ctx.group), None


class ReduceScatterFirstDim(torch.autograd.Function):
    """Reduce-scatter (sum) along the first dimension over `group`, rank r keeping the r-th slice; the
    backward all-gathers the gradient: Megatron-Core's reduce_scatter_to_sequence_parallel_region."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // dist.get_world_size(group),) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return GatherFirstDim.apply(grad, ctx.group), None


def _padded(x, rows):
    """`x` with zero rows appended up to `rows` (the collectives below move equal shares)."""
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


class GatherUneven(torch.autograd.Function):
    """All-gather along the first dimension over `group` when group rank r holds sizes[r] rows (each
    padded to the most for the collective); the backward reduce-scatters (sums) the gradient back to
    each rank's rows: Megatron-Core's gather_from_sequence_parallel_region with output_split_sizes."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        import torch.distributed as dist

        ctx.sizes, ctx.group = sizes, group
        most = max(max(sizes), 1)
        out = x.new_empty((len(sizes) * most,) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, _padded(x, most), group=group)
        return torch.cat([part[:n] for part, n in zip(out.split(most), sizes)])

    @staticmethod
    def backward(ctx, grad):
        return ReduceScatterUneven.apply(grad, ctx.sizes, ctx.group), None, None


class ReduceScatterUneven(torch.autograd.Function):
    """Reduce-scatter (sum) along the first dimension over `group`, group rank r keeping the r-th of
    blocks of sizes[r] rows; the backward all-gathers the gradient: Megatron-Core's
    reduce_scatter_to_sequence_parallel_region with input_split_sizes."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        import torch.distributed as dist

        ctx.sizes, ctx.group = sizes, group
        most = max(max(sizes), 1)
        padded = torch.cat([_padded(part, most) for part in x.split(sizes)])
        out = x.new_empty((most,) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[dist.get_rank(group)]]

    @staticmethod
    def backward(ctx, grad):
        return GatherUneven.apply(grad, ctx.sizes, ctx.group), None, None


def all_to_all(x, output_splits, input_splits, group):
    """torch.distributed.all_to_all_single with autograd (the backward sends the gradients back)."""
    from torch.distributed.nn.functional import all_to_all_single

    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    return all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)


class ExpertShard(nn.Module):
    """One etp rank's share of a routed expert (Megatron-Core's expert tensor parallelism): fc1's
    (and a gated MLP's fc3's) rows `part` of `parts` (column-parallel), fc2's matching columns
    (row-parallel), fc2's bias on part 0 alone, so that the parts' outputs sum to the whole
    expert's."""

    def __init__(self, whole, part, parts):
        super().__init__()
        width = whole.w1.out_features // parts
        rows = slice(part * width, (part + 1) * width)
        self.gated = whole.gated
        self.w1 = self._rows(whole.w1, rows)
        self.w3 = self._rows(whole.w3, rows) if whole.gated else None
        self.w2 = nn.Linear(width, whole.w2.out_features, bias=whole.w2.bias is not None and part == 0)
        with torch.no_grad():
            self.w2.weight.copy_(whole.w2.weight[:, rows])
            if self.w2.bias is not None:
                self.w2.bias.copy_(whole.w2.bias)

    @staticmethod
    def _rows(linear, rows):
        shard = nn.Linear(linear.in_features, rows.stop - rows.start, bias=linear.bias is not None)
        with torch.no_grad():
            shard.weight.copy_(linear.weight[rows])
            if linear.bias is not None:
                shard.bias.copy_(linear.bias[rows])
        return shard

    forward = FeedForward.forward


class LocalExperts(nn.Module):
    """The routed experts one rank holds, run on their tokens (sorted by expert) in one module
    (so that FSDP gathers them around one forward, as torchtitan's GroupedExperts); with etp > 1
    each is this rank's ExpertShard of it, drawn whole from its seed first, so that every split
    trains the same experts."""

    def __init__(self, cfg, layer, expert_ids, seed, etp=1, etp_rank=0):
        super().__init__()
        self.mlps = nn.ModuleList()
        for g in expert_ids:
            torch.manual_seed(expert_seed(seed, layer, g, cfg.moe.experts))
            whole = FeedForward(cfg, cfg.moe.ffn_hidden)
            self.mlps.append(whole if etp == 1 else ExpertShard(whole, etp_rank, etp))

    def forward(self, x, tokens_per_expert):
        chunks = torch.split(x, tokens_per_expert)
        return torch.cat([mlp(chunk) for mlp, chunk in zip(self.mlps, chunks)])


class MoeLayer(nn.Module):
    """Megatron-Core's MoE layer with its all-to-all or all-gather token dispatcher.

    Router: a linear hidden -> experts (no bias), the top-k logits of each
    token, softmax over those k (Megatron-LM's default: no pre-softmax, no
    auxiliary loss, no capacity limit).  All-to-all dispatch: each token-copy
    sorted by expert, the counts exchanged by all_to_all_single over the ep
    group, then the tokens; each rank runs its experts/ep experts, the outputs
    go back by the reverse all-to-all and are summed per token weighted by the
    router's probability.  All-gather dispatch (MoEAllGatherTokenDispatcher):
    the hidden states, the routing probabilities and the chosen experts are
    all-gathered over the ep group, each rank runs its experts on the gathered
    token copies routed to them, weights them by their probabilities, sums
    them per gathered token and reduce-scatters the sums back to the tokens'
    owners.  A shared expert (model.moe.shared_ffn_hidden) runs on every
    token beside them.
    """

    def __init__(self, cfg, layer, expert_ids, ep, seed, etp=1, etp_rank=0):
        super().__init__()
        moe = cfg.moe
        self.topk, self.experts_total, self.ep, self.etp = moe.topk, moe.experts, ep, etp
        self.local = len(expert_ids)
        self.first_expert = expert_ids[0] if expert_ids else 0
        self.dispatcher = "alltoall"  # set from parallel.moe_dispatcher with the expert mesh
        self.router = nn.Linear(cfg.hidden, moe.experts, bias=False)
        self.shared = FeedForward(cfg, moe.shared_ffn_hidden) if moe.shared_ffn_hidden else None
        self.experts = LocalExperts(cfg, layer, expert_ids, seed, etp, etp_rank)
        # Set once the expert mesh is built: the ep group (ranks of this etp
        # coordinate), the etp group (ranks splitting the same experts) and
        # both together (the all-gather dispatcher's, Megatron-Core's tp_ep group).
        self.ep_group = self.etp_group = self.tp_ep_group = None
        # Forward passes of training (recomputation excluded): tokens this
        # rank's experts received, in all and per local expert, and sent.
        self.received = 0
        self.sent = 0
        self.per_expert = [0] * self.local

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        top_logits, top_experts = torch.topk(logits, self.topk, dim=-1)
        probs = torch.softmax(top_logits.float(), dim=-1)
        if self.dispatcher == "allgather":
            combined, per_expert = self._all_gather_dispatch(tokens, probs, top_experts)
            return self._finish(x, tokens, combined, per_expert, top_experts.numel())
        flat = top_experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = torch.div(order, self.topk, rounding_mode="floor")
        dispatched = tokens.index_select(0, token_of)
        if torch.is_autocast_enabled(dispatched.device.type):
            # Megatron-Core dispatches the hidden states in the compute dtype.
            dispatched = dispatched.to(torch.get_autocast_dtype(dispatched.device.type))
        counts = torch.bincount(flat, minlength=self.experts_total)
        if self.ep > 1:
            import torch.distributed as dist

            # Row q of `received`: what rank q sends to each of this rank's experts.
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.ep_group)
            received = received.view(self.ep, self.local)
            send_splits = counts.view(self.ep, self.local).sum(1).tolist()
            recv_splits = received.sum(1).tolist()
            arrived = all_to_all(dispatched, recv_splits, send_splits, self.ep_group)
        else:
            received = counts.view(1, self.local)
            arrived = dispatched
        if self.etp > 1:
            out, per_expert = self._split_experts(arrived, received)
        else:
            out, per_expert = self._run_experts(arrived, received), received.sum(0).tolist()
        if self.ep > 1:
            out = all_to_all(out, send_splits, recv_splits, self.ep_group)
        weights = probs.reshape(-1).index_select(0, order).to(out.dtype)
        combined = torch.zeros(tokens.shape, dtype=out.dtype, device=out.device)
        combined = combined.index_add(0, token_of, out * weights[:, None])
        return self._finish(x, tokens, combined, per_expert, flat.numel())

    def _run_experts(self, arrived, received):
        """The local experts' outputs on `arrived`, token copies grouped by source ep rank, then by
        expert, `received[q][e]` of them from rank q for local expert e; in the same order."""
        expert_of = torch.arange(self.local, device=received.device).repeat(received.shape[0])
        expert_of = expert_of.repeat_interleave(received.flatten())
        by_expert = torch.argsort(expert_of, stable=True)
        out = self.experts(arrived.index_select(0, by_expert), received.sum(0).tolist())
        return out.index_select(0, torch.argsort(by_expert))

    def _split_experts(self, arrived, received):
        """Expert tensor parallelism (Megatron-Core's all-to-all dispatcher with etp > 1): the token
        copies the etp ranks' all-to-alls brought are all-gathered over the etp group, each rank runs
        its shard of the experts on all of them, and the partial outputs are reduce-scattered (summed)
        back to the ranks they arrived at.  (this rank's outputs, token copies per local expert its
        shards computed)."""
        import torch.distributed as dist

        everyone = received.new_empty((self.etp * received.shape[0], received.shape[1]))
        dist.all_gather_into_tensor(everyone, received.contiguous(), group=self.etp_group)
        everyone = everyone.view((self.etp,) + tuple(received.shape))
        sizes = everyone.sum((1, 2)).tolist()
        gathered = GatherUneven.apply(arrived, sizes, self.etp_group)
        outs = [self._run_experts(rows, counts) for rows, counts in zip(gathered.split(sizes), everyone)]
        out = ReduceScatterUneven.apply(torch.cat(outs), sizes, self.etp_group)
        return out, everyone.sum((0, 1)).tolist()

    def _all_gather_dispatch(self, tokens, probs, top_experts):
        """Megatron-Core's MoEAllGatherTokenDispatcher over the ep x etp ranks (its tp_ep group): (this
        rank's tokens' summed expert outputs, token copies per local expert).  With etp > 1 each rank
        computes its shards' partial outputs, which the reduce-scatter sums with the other shards'."""
        dispatched = tokens
        if torch.is_autocast_enabled(dispatched.device.type):
            # The hidden states are gathered in the compute dtype, the probabilities in fp32.
            dispatched = dispatched.to(torch.get_autocast_dtype(dispatched.device.type))
        ranks = self.ep * self.etp
        group = self.ep_group if self.etp == 1 else self.tp_ep_group
        if ranks > 1:
            import torch.distributed as dist

            # The gathers' backward reduce-scatters the gradients to their owners (summed).
            dispatched = GatherFirstDim.apply(dispatched, group)
            probs = GatherFirstDim.apply(probs, group)
            chosen = top_experts.new_empty((ranks * top_experts.shape[0], self.topk))
            dist.all_gather_into_tensor(chosen, top_experts.contiguous(), group=group)
            top_experts = chosen
        # The gathered token copies routed to this rank's experts, grouped by expert, in token order within each.
        flat = top_experts.reshape(-1)
        local = flat - self.first_expert
        mine = torch.nonzero((local >= 0) & (local < self.local)).flatten()
        mine = mine.index_select(0, torch.argsort(local.index_select(0, mine), stable=True))
        token_of = torch.div(mine, self.topk, rounding_mode="floor")
        per_expert = torch.bincount(local.index_select(0, mine), minlength=self.local).tolist()
        out = self.experts(dispatched.index_select(0, token_of), per_expert)
        weights = probs.reshape(-1).index_select(0, mine)
        summed = torch.zeros((top_experts.shape[0], tokens.shape[-1]), dtype=torch.float32, device=tokens.device)
        summed = summed.index_add(0, token_of, out.float() * weights[:, None])
        if ranks > 1:
            # Reduce-scattered in the probabilities' dtype (fp32), as Megatron-Core does.
            summed = ReduceScatterFirstDim.apply(summed, group)
        return summed.to(out.dtype), per_expert

    def _finish(self, x, tokens, combined, per_expert, sent):
        """Counts the forward's token copies (not a recomputation's) and adds the shared expert."""
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            self.received += sum(per_expert)
            self.sent += int(sent)
            self.per_expert = [a + b for a, b in zip(self.per_expert, per_expert)]
        if self.shared is not None:
            combined = combined + self.shared(tokens)
        return combined.to(x.dtype).reshape(x.shape)


def make_norm(cfg):
    return nn.LayerNorm(cfg.hidden) if cfg.learned_positions else nn.RMSNorm(cfg.hidden)


class Block(nn.Module):
    def __init__(self, cfg, moe=None):
        """moe: None for a dense MLP, else (layer, expert_ids, ep, seed, etp, etp_rank) of an MoE layer."""
        super().__init__()
        self.attention_norm = make_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.feed_forward = FeedForward(cfg) if moe is None else MoeLayer(cfg, *moe)
        self.p = DROPOUT_P if cfg.dropout else 0.0
        self.recompute = None  # None | "full" | "op" | "attention"

    def forward(self, x):
        # Checkpointing inside the block's forward is what torchtitan's
        # checkpoint_wrapper does; fully_shard(block) then wraps it from outside.
        if self.recompute in ("full", "op"):
            return _checkpoint(self.body, x, op_level=self.recompute == "op")
        return self.body(x)

    def body(self, x):
        h = x + F.dropout(self.attention(self.attention_norm(x)), self.p, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.p, self.training)


class Embeddings(nn.Module):
    def __init__(self, cfg, sparse=False):
        super().__init__()
        # sparse: the table's gradient is a sparse COO tensor of the rows
        # looked up (DDP then all-gathers it instead of all-reducing).
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden, sparse=sparse)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.learned_positions else None
        self.p = DROPOUT_P if cfg.dropout else 0.0
        self.positions = None  # a context-parallel rank's global positions; None: 0..seq-1

    def forward(self, tokens):
        h = self.tok(tokens)
        if self.pos is not None:
            held = self.positions
            if held is None:
                held = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos(held)
        return F.dropout(h, self.p, self.training)


class ModelChunk(nn.Module):
    """Consecutive layers of the model; chunk 0 adds the embeddings, the last the norm and head."""

    def __init__(self, cfg, layers, is_first, is_last, sparse_embedding=False):
        super().__init__()
        self.embeddings = Embeddings(cfg, sparse_embedding) if is_first else None
        # Keyed by global layer index, as torchtitan's ModuleDict, so FQNs
        # name the model's layer whatever stage holds it.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = make_norm(cfg) if is_last else None
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False) if is_last else None
        self.autocast_dtype = None  # set when compute runs under torch.autocast
        self.output_dtype = None  # dtype the pipeline expects out of this chunk

    def forward(self, x):
        if self.autocast_dtype is None:
            out = self.body(x)
        else:
            with torch.autocast(device_type=x.device.type, dtype=self.autocast_dtype):
                out = self.body(x)
        return out if self.output_dtype is None else out.to(self.output_dtype)

    def body(self, h):
        if self.embeddings is not None:
            h = self.embeddings(h)
        for block in self.layers.values():
            h = block(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def build_chunk(cfg, layout, chunk, seed, expert_ids=(), etp_rank=0):
    """Build one chunk so that every parameter is the same whatever the partition.

    Each component is drawn from its own seed (embedding table seed+1,
    positions seed+2, untied head seed+3, block i seed+101+i, routed expert
    g of MoE layer i seed+1000000+i*experts+g; `expert_ids`: the experts this
    rank holds, `etp_rank` its share of each), so that all candidates train the same model; the
    untied-by-pipeline head copy of a tied table is drawn from the table's
    seed.
    """
    is_first, is_last = chunk == 0, chunk == layout.chunks - 1
    layers = chunk_layers(layout, chunk)
    chunk_module = ModelChunk(cfg, [], is_first, is_last, layout.sparse_embedding)
    for i in layers:
        torch.manual_seed(seed + 101 + i)
        moe = None
        if cfg.moe is not None and cfg.moe.is_moe_layer(i):
            moe = (i, expert_ids, layout.ep, seed, layout.etp, etp_rank)
        chunk_module.layers[str(i)] = Block(cfg, moe)
    with torch.no_grad():
        if is_first:
            chunk_module.embeddings.tok.weight.copy_(embedding_table(cfg, seed + 1))
            if chunk_module.embeddings.pos is not None:
                g = torch.Generator().manual_seed(seed + 2)
                chunk_module.embeddings.pos.weight.normal_(0.0, EMBEDDING_INIT_STD, generator=g)
        if is_last:
            if cfg.tied_embeddings and is_first:
                chunk_module.output.weight = chunk_module.embeddings.tok.weight
            elif cfg.tied_embeddings:
                chunk_module.output.weight.copy_(embedding_table(cfg, seed + 1))
            else:
                chunk_module.output.weight.copy_(embedding_table(cfg, seed + 3))
    return chunk_module


def embedding_table(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.empty(cfg.vocab, cfg.hidden).normal_(0.0, EMBEDDING_INIT_STD, generator=g)


# ---------------------------------------------------------------------------
# Parallelisation (TP, then activation checkpointing, then FSDP / DDP)
# ---------------------------------------------------------------------------


def apply_tensor_parallel(chunk_module, plan, tp_mesh, tie):
    from torch.distributed.tensor.parallel import parallelize_module

    if not plan:
        return
    parallelize_module(chunk_module, tp_mesh, plan)
    if tie:
        # parallelize_module replaces each module's parameter; the embedding
        # (RowwiseParallel) and the head (ColwiseParallel) both shard the
        # [vocab, hidden] table as Shard(0), so the tie can be restored.
        emb, head = chunk_module.embeddings.tok.weight, chunk_module.output.weight
        if emb.placements != head.placements:
            raise RuntimeError(
                f"tied embeddings with tp: embedding {emb.placements} and head {head.placements} differ"
            )
        chunk_module.output.weight = emb


def apply_recompute(chunk_module, layout):
    count = 0
    for name, block in chunk_module.layers.items():
        mode = block_recompute(layout, int(name))
        if mode == "attention":
            block.attention.recompute_core = True
        else:
            block.recompute = mode
        count += mode is not None
    return count


def mixed_precision_dtype(job):
    return torch.bfloat16 if job["dtype"] == "bf16" else None


def apply_fully_shard(chunk_module, dp_mesh, layout, compute_dtype, edp_mesh=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    reshard = layout.optimizer_sharding == "full"
    for block in chunk_module.layers.values():
        if isinstance(block.feed_forward, MoeLayer):
            # The routed experts are sharded over their expert-data-parallel
            # group (torchtitan's dp_mod_ep mesh), the rest of the block over dp.
            experts = fully_shard(block.feed_forward.experts, mesh=edp_mesh, mp_policy=policy,
                                  reshard_after_forward=reshard)
            set_expert_gradient_divide_factor(experts, edp_mesh.size(), layout.dense_sync)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return fully_shard(chunk_module, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def set_expert_gradient_divide_factor(module, edp, ranks):
    """An expert's gradient sums the losses of its ep group's tokens; the model's
    is the mean over the dp x cp ranks, so the sum over edp replicas is divided by
    their number (torchtitan's divide factor), as a sum and a division (gloo has no
    premul-sum)."""
    module.set_gradient_divide_factor(float(ranks))
    if edp > 1:
        module.set_force_sum_reduction_for_comms(True)


def local_tensor(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def all_reduce_whole_table(dist, grad, group):
    """All-reduce a tied table's gradient between the end stages, whole.

    Under tensor parallelism the two ends may hold it differently (DTensor
    hands the vocabulary-parallel embedding's gradient back replicated,
    whole on every tp rank, and the head's split by vocabulary rows), and
    gloo needs both sides to send the same bytes: a split side gathers its
    tp group's rows first and keeps its own after.
    """
    from torch.distributed.tensor import DTensor

    local = local_tensor(grad)
    split = isinstance(grad, DTensor) and any(p.is_shard() for p in grad.placements)
    if not split:
        dist.all_reduce(local, group=group)
        return
    if len(grad.placements) != 1 or grad.placements[0].dim != 0:
        raise RuntimeError(f"a tied table split as {grad.placements} over "
                           f"{grad.device_mesh}: only rows over one tp mesh are supported")
    whole = grad.full_tensor()
    dist.all_reduce(whole, group=group)
    # DTensor's Shard(0) splits rows as torch.chunk does.
    mine = whole.chunk(grad.device_mesh.size(), dim=0)[grad.device_mesh.get_local_rank()]
    local.copy_(mine)


def unique_parameters(modules):
    seen, params = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


# ---------------------------------------------------------------------------
# Distributed setup
# ---------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    mesh: object
    dp_mesh: object  # 1-D "dp" or 2-D ("dp_replicate", "dp_shard")
    degrees: dict
    coords: dict
    experts: object = None  # ExpertMesh of a mixture of experts
    ring: object = None  # Ring of a context-parallel rank


def init_distributed(job):
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if job["device"] == "cuda":
        if not torch.cuda.is_available():
            raise JobError("device: cuda requested but torch.cuda is not available")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=job["backend"], timeout=datetime.timedelta(minutes=10))
    return rank, world, local_rank, device


def build_mesh(layout, device, rank, world, local_rank):
    from torch.distributed.device_mesh import init_device_mesh

    cp_c, ring = 0, None
    if layout.cp > 1:
        # Megatron-Core's order: tp fastest, then cp, then dp, then pp.  Dense
        # gradients sync over dp x cp: the flattened mesh (torchtitan's dp_shard_cp).
        mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.cp, layout.tp),
                                mesh_dim_names=("pp", "dp", "cp", "tp"))
        dp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        degrees = {"tp": mesh["tp"].size(), "pp": mesh["pp"].size(), "dp": mesh["dp"].size(),
                   "cp": mesh["cp"].size(), "dp_shard": None, "dp_replicate": None}
        pp_i, dp_j, cp_c, tp_k = mesh.get_coordinate()
        import torch.distributed as dist

        group = mesh["cp"].get_group()
        ranks = dist.get_process_group_ranks(group)
        ring = Ring(group, ranks, cp_c, [])  # positions: set by the Trainer, which knows the sequence
    elif layout.dp_shard is None:
        mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.tp),
                                mesh_dim_names=("pp", "dp", "tp"))
        dp_mesh = mesh["dp"]
        degrees = {"tp": mesh["tp"].size(), "pp": mesh["pp"].size(), "dp": mesh["dp"].size(),
                   "cp": 1, "dp_shard": None, "dp_replicate": None}
        pp_i, dp_j, tp_k = mesh.get_coordinate()
    else:
        mesh = init_device_mesh(device.type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        rep, shard = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
        degrees = {"tp": mesh["tp"].size(), "pp": mesh["pp"].size(), "dp": rep * shard,
                   "cp": 1, "dp_shard": shard, "dp_replicate": rep}
        pp_i, rep_j, shard_j, tp_k = mesh.get_coordinate()
        dp_j = rep_j * shard + shard_j
    coords = {"pp": pp_i, "dp": dp_j, "cp": cp_c, "tp": tp_k}
    expected = mesh_coords_of_rank(rank, layout)
    if coords != expected:
        raise RuntimeError(f"device mesh puts rank {rank} at {coords}, Megatron order expects {expected}")
    return Dist(rank, world, local_rank, device, mesh, dp_mesh, degrees, coords, ring=ring)


@dataclass
class ExpertMesh:
    ep_group: object
    etp_group: object
    tp_ep_group: object  # ep x etp, etp fastest (the all-gather dispatcher's)
    edp_mesh: object
    degrees: dict  # {"ep", "etp", "edp"}, read back from the live mesh
    coords: dict  # {"edp", "ep", "etp"}


def build_expert_mesh(layout, device, rank):
    """The experts' mesh over the same ranks: (pp, edp, ep, etp), etp fastest (Megatron-Core)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (layout.pp, layout.edp, layout.ep, layout.etp),
                            mesh_dim_names=("pp", "edp", "ep", "etp"))
    _, edp_i, ep_i, etp_i = mesh.get_coordinate()
    coords = {"edp": edp_i, "ep": ep_i, "etp": etp_i}
    expected = expert_coords_of_rank(rank, layout)
    if coords != expected:
        raise RuntimeError(f"expert mesh puts rank {rank} at {coords}, Megatron-Core's order expects {expected}")
    degrees = {"ep": mesh["ep"].size(), "etp": mesh["etp"].size(), "edp": mesh["edp"].size()}
    tp_ep = mesh["ep", "etp"]._flatten("tp_ep").get_group()
    return ExpertMesh(mesh["ep"].get_group(), mesh["etp"].get_group(), tp_ep, mesh["edp"], degrees, coords)


def tied_embedding_group(layout, coords):
    """Megatron's embedding group: first and last pipeline rank of each (dp, cp, tp)."""
    import torch.distributed as dist

    mine = None
    for dp_j in range(layout.dp):
        for cp_c in range(layout.cp):
            for tp_k in range(layout.tp):
                ranks = [rank_of_coords(0, dp_j, tp_k, layout, cp_c),
                         rank_of_coords(layout.pp - 1, dp_j, tp_k, layout, cp_c)]
                group = dist.new_group(ranks)  # every rank must create every group
                if (dp_j, cp_c, tp_k) == (coords["dp"], coords["cp"], coords["tp"]):
                    mine = group
    return mine


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def preload_runtime(job, device):
    """Pay one-time costs before the memory baseline, so the peak holds the training state.

    Importing the distributed packages alone adds ~110 MB of RSS (pipelining
    ~70 MB), and the first autograd / optimizer / autocast call allocates
    thread-pool and kernel state; none of that is the model's.
    """
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    import torch.profiler  # noqa: F401
    import torch.utils.checkpoint  # noqa: F401

    lin = nn.Linear(8, 8).to(device)
    opt = torch.optim.AdamW(lin.parameters(), lr=LEARNING_RATE, foreach=False)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=job["dtype"] == "bf16"):
        out = lin(torch.ones(2, 8, device=device))
    out.float().sum().backward()
    opt.step()
    del lin, opt, out
    par = job.get("parallel")
    if isinstance(par, dict) and par.get("embedding_sync") == "sparse-all-gather":
        # The sparse lookup's backward and SparseAdam's first step.
        emb = nn.Embedding(16, 8, sparse=True).to(device)
        sparse_opt = torch.optim.SparseAdam(emb.parameters(), lr=LEARNING_RATE)
        emb(torch.arange(4, device=device)).sum().backward()
        sparse_opt.step()
        del emb, sparse_opt


class MemoryMeter:
    def __init__(self, device, notes):
        self.device = device
        self.notes = notes
        self.baseline = 0
        self.file_baseline = 0

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            return
        try:
            # "5" resets VmHWM to the current RSS (proc(5), clear_refs).
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as e:
            self.notes.append(f"could not reset the peak RSS (/proc/self/clear_refs: {e}); the peak may include earlier use")
        self.baseline = proc_status_bytes("VmRSS")
        self.file_baseline = proc_status_bytes("RssFile")
        for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
            if var not in os.environ:
                self.notes.append(f"{var} not set: freed memory may stay in the process")

    def finish(self):
        """(peak_memory_bytes, baseline_memory_bytes, memory_kind, reserved_bytes)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device), self.baseline,
                    "cuda-max-allocated", torch.cuda.max_memory_reserved(self.device))
        # Library code executed for the first time during training is paged
        # in as file-backed RSS (about 10 MB for libtorch's backward, norm and
        # optimizer kernels); it is not training memory, so its growth is
        # taken off (file-backed pages are hardly ever dropped meanwhile).
        raw = proc_status_bytes("VmHWM") - self.baseline
        file_growth = max(0, proc_status_bytes("RssFile") - self.file_baseline)
        self.notes.append(f"peak RSS above baseline {raw} bytes, less {file_growth} bytes of file-backed "
                          "RSS paged in meanwhile (library code)")
        return (max(0, raw - file_growth), self.baseline, "rss-above-baseline", None)


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


class Trainer:
    """This rank's model chunks, their data parallelism, optimizer and one-iteration step."""

    def __init__(self, job, model, layout, d, notes):
        import torch.distributed as dist

        self.job, self.cfg, self.layout, self.d, self.notes = job, model, layout, d, notes
        self.chunks = chunks_of_pp_rank(d.coords["pp"], layout)
        self.holds_first = 0 in self.chunks
        self.holds_last = layout.chunks - 1 in self.chunks
        seed = job["seed"]
        compute_dtype = mixed_precision_dtype(job)
        tp_mesh = d.mesh["tp"]
        tie_in_chunk = model.tied_embeddings and layout.pp == 1
        self.tensor_parallel = {}
        self.checkpointed_blocks = 0
        self.modules = []
        self.expert_ids = local_experts_of_rank(d.rank, model, layout)
        etp_rank = expert_coords_of_rank(d.rank, layout)["etp"]
        for c in self.chunks:
            m = build_chunk(model, layout, c, seed, self.expert_ids, etp_rank).to(d.device)
            plan = tensor_parallel_plan(model, layout, c)
            apply_tensor_parallel(m, plan, tp_mesh, tie_in_chunk)
            self.tensor_parallel.update(plan_style_names(plan))
            self.checkpointed_blocks += apply_recompute(m, layout)
            self.modules.append(m)
        self.moe_layers = [b.feed_forward for m in self.modules for b in m.layers.values()
                           if isinstance(b.feed_forward, MoeLayer)]
        # Context parallelism: this rank's tokens are chunks r and 2cp-1-r of
        # the sequence; its embeddings and attention see their own positions.
        self.ring = d.ring
        self.held_positions = None
        if self.ring is not None:
            self.ring.positions = [cp_positions(model.seq_len, layout, c).to(d.device) for c in range(layout.cp)]
            self.held_positions = self.ring.positions[self.ring.cp_rank]
            for m in self.modules:
                if m.embeddings is not None:
                    m.embeddings.positions = self.held_positions
                for block in m.layers.values():
                    block.attention.ring = self.ring
                    block.attention.cp_comm = layout.cp_comm
        for layer in self.moe_layers:
            layer.ep_group = d.experts.ep_group
            layer.etp_group = d.experts.etp_group
            layer.tp_ep_group = d.experts.tp_ep_group
            layer.dispatcher = layout.moe_dispatcher
        self.data_parallel = data_parallel_name(layout, model)
        edp_mesh = d.experts.edp_mesh if d.experts is not None else None
        if uses_fully_shard(layout):
            for m in self.modules:
                apply_fully_shard(m, d.dp_mesh, layout, compute_dtype, edp_mesh)
        elif compute_dtype is not None:
            # No FSDP: fp32 parameters, bf16 compute through autocast.
            for m in self.modules:
                m.autocast_dtype = compute_dtype
        # Dtypes at chunk boundaries: bf16 everywhere when FSDP casts the
        # parameters; under autocast the residual stream stays fp32 (fp32
        # embeddings plus bf16 branches) and only the head's logits are bf16.
        bf16 = compute_dtype is not None
        self.boundary_dtype = torch.bfloat16 if bf16 and uses_fully_shard(layout) else torch.float32
        self.logits_dtype = torch.bfloat16 if bf16 else torch.float32
        for m in self.modules:
            m.output_dtype = self.logits_dtype if m.output is not None else self.boundary_dtype
        self.params = unique_parameters(self.modules)
        self.train_modules = list(self.modules)
        if self.data_parallel == "DDP":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [d.local_rank] if d.device.type == "cuda" else None
            self.train_modules = [DDP(self.modules[0], process_group=d.dp_mesh.get_group(),
                                      device_ids=ids, broadcast_buffers=False)]
        # dp_mesh is the flattened (dp, cp) mesh under context parallelism.
        self.dp_group = d.dp_mesh.get_group() if self.data_parallel == "all-reduce of local gradients" else None
        # The routed experts' gradients sync over the expert-data-parallel
        # group (none when ep covers dp), the other parameters' over dp.
        self.expert_params = {id(p) for layer in self.moe_layers for p in layer.experts.parameters()}
        # Beside tp the MoE layers' router and shared expert are whole on
        # every tp rank, each seeing its own tokens: their gradients are
        # summed over tp (Megatron-Core's sequence-parallel parameters).
        self.tp_summed = []
        self.tp_group = None
        if layout.tp > 1 and self.moe_layers:
            self.tp_group = d.mesh["tp"].get_group()
            self.tp_summed = [p for layer in self.moe_layers for p in layer.parameters()
                              if id(p) not in self.expert_params]
        self.edp_group = None
        if self.dp_group is not None and d.experts is not None and layout.edp > 1:
            self.edp_group = d.experts.edp_mesh.get_group()
        self.tie_group = None
        if model.tied_embeddings and layout.pp > 1:
            self.tie_group = tied_embedding_group(layout, d.coords)
        # A sparse token embedding (parallel.embedding_sync sparse-all-gather)
        # is stepped by SparseAdam, every other parameter by AdamW.
        self.embedding_sync = layout.embedding_sync
        self.sparse_table = self.modules[0].embeddings.tok.weight if layout.sparse_embedding else None
        dense = [p for p in self.params if p is not self.sparse_table]
        self.optimizers = [torch.optim.AdamW(dense, lr=LEARNING_RATE, foreach=False)]
        if self.sparse_table is not None:
            self.optimizers.append(torch.optim.SparseAdam([self.sparse_table], lr=LEARNING_RATE))
        self.sparse_grad_steps = 0  # steps whose table gradient was sparse after backward
        self.steps_taken = 0  # every step, warmup and profiled ones included
        self.steps = 0
        self.inputs, self.targets = self.make_data(seed)
        self.schedule = self.build_schedule() if layout.pp > 1 else None
        self.dist = dist

    def make_data(self, seed):
        """Fixed random token ids per dp rank, reused every iteration (the loss should fall)."""
        g = torch.Generator().manual_seed(seed * 7919 + self.d.coords["dp"])
        rows = self.layout.micro_batches * self.layout.micro_batch
        tokens = torch.randint(0, self.cfg.vocab, (rows, self.cfg.seq_len + 1), generator=g)
        tokens = tokens.to(self.d.device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if self.held_positions is not None:  # the same rows on every cp rank, its own tokens of them
            inputs, targets = inputs[:, self.held_positions], targets[:, self.held_positions]
        return inputs.contiguous(), targets.contiguous()

    def build_schedule(self):
        from torch.distributed import pipelining

        pp_group = self.d.mesh["pp"].get_group()
        stages = []
        for m, c in zip(self.train_modules, self.chunks):
            inputs, outputs = self.stage_meta(c)
            stages.append(pipelining.PipelineStage(m, c, self.layout.chunks, self.d.device,
                                                   input_args=inputs, output_args=outputs,
                                                   group=pp_group))
        cls = getattr(pipelining, SCHEDULE_CLASSES[self.layout.schedule])
        n = self.layout.micro_batches
        if self.layout.schedule == "interleaved":
            return cls(stages, n_microbatches=n, loss_fn=cross_entropy)
        return cls(stages[0], n_microbatches=n, loss_fn=cross_entropy)

    def stage_meta(self, chunk):
        """Meta tensors of one chunk's input and output, given to PipelineStage.

        Runtime shape inference exchanges pickled objects, which needs numpy;
        the shapes are known anyway: token ids into chunk 0, the hidden state
        (sequence-sharded under SP) between chunks, logits out of the last.
        ModelChunk casts its output to exactly these dtypes.
        """
        # Each cp rank holds its own seq_len / cp tokens.
        mb, s = self.layout.micro_batch, self.cfg.seq_len // self.layout.cp
        local_s = s // self.layout.tp if self.layout.sequence_parallel else s
        hidden = (mb, local_s, self.cfg.hidden)
        if chunk == 0:
            inputs = torch.empty((mb, s), dtype=torch.long, device="meta")
        else:
            inputs = torch.empty(hidden, dtype=self.boundary_dtype, device="meta")
        if chunk == self.layout.chunks - 1:
            outputs = torch.empty((mb, s, self.cfg.vocab), dtype=self.logits_dtype, device="meta")
        else:
            outputs = torch.empty(hidden, dtype=self.boundary_dtype, device="meta")
        return inputs, outputs

    def step(self):
        """One iteration: all micro-batches forward+backward, gradient sync, optimizer step.

        Returns the mean loss over micro-batches, or None on ranks without the head.
        """
        loss = self.pipeline_pass() if self.schedule is not None else self.accumulation_pass()
        # A stage without the head has no loss; its cp ranks are of its stage.
        if self.ring is not None and loss is not None:
            # Each cp rank's loss is the mean over its tokens: the sequence's is their mean.
            t = torch.tensor([loss], dtype=torch.float64 if self.d.device.type == "cpu" else torch.float32,
                             device=self.d.device)
            self.dist.all_reduce(t, group=self.ring.group)
            loss = float(t[0]) / self.ring.cp
        self.steps_taken += 1
        self.sync_gradients()
        if self.sparse_table is not None:
            grad = self.sparse_table.grad
            self.sparse_grad_steps += grad is not None and grad.is_sparse
            self.steps += 1
        for optimizer in self.optimizers:
            optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return loss

    def embedding_gradient_note(self):
        """(embedding_grad_sparse, note): whether the table's gradient was sparse after every backward."""
        if self.sparse_table is None:
            return None, None
        sparse = self.steps > 0 and self.sparse_grad_steps == self.steps
        word = "sparse" if sparse else "NOT sparse"
        return sparse, (f"embedding_sync sparse-all-gather: the token embedding's gradient was {word} after backward "
                        f"(weight.grad.is_sparse in {self.sparse_grad_steps} of {self.steps} iterations); DDP "
                        "all-gathered it, SparseAdam stepped the table and AdamW the other parameters")

    def pipeline_pass(self):
        kwargs = {}
        args = (self.inputs,) if self.holds_first else ()
        losses = []
        if self.holds_last:
            kwargs = {"target": self.targets, "losses": losses}
        self.schedule.step(*args, **kwargs)
        if not self.holds_last:
            return None
        return float(torch.stack([l.detach().float() for l in losses]).mean())

    def accumulation_pass(self):
        module = self.train_modules[0]
        n, b = self.layout.micro_batches, self.layout.micro_batch
        total = torch.zeros((), device=self.d.device)
        for i in range(n):
            x, y = self.inputs[i * b:(i + 1) * b], self.targets[i * b:(i + 1) * b]
            sync = i == n - 1 or self.data_parallel != "DDP"
            with contextlib.nullcontext() if sync else module.no_sync():
                loss = cross_entropy(module(x), y) / n
                loss.backward()
            total += loss.detach()  # one device sync per iteration, not per micro-batch
        return float(total)

    def sync_gradients(self):
        for p in self.tp_summed:
            if p.grad is not None:
                self.dist.all_reduce(local_tensor(p.grad), group=self.tp_group)
        if self.tie_group is not None:
            # Megatron sums the word-embedding gradient of the first stage and
            # the head gradient of the last so both copies stay equal.
            for t in self.tied_tables():
                if t.grad is not None:
                    all_reduce_whole_table(self.dist, t.grad, self.tie_group)
        if self.dp_group is not None:
            for p in self.params:
                if p.grad is not None:
                    g = local_tensor(p.grad)
                    if id(p) not in self.expert_params:
                        self.dist.all_reduce(g, group=self.dp_group)
                    elif self.edp_group is not None:
                        self.dist.all_reduce(g, group=self.edp_group)
                    # An expert's gradient already sums its ep x etp group's tokens'
                    # losses: over its edp replicas it covers all dp x cp
                    # ranks. A dense one is the mean over dp x cp. Both are
                    # divided by their number.
                    g.div_(self.layout.dense_sync)

    def cp_comm(self):
        """The key/value exchange this rank's attention layers ran (the planned one with cp 1)."""
        ran = {b.attention.cp_comm for m in self.modules for b in m.layers.values() if b.attention.ring is not None}
        return ran.pop() if len(ran) == 1 else self.layout.cp_comm

    def dispatcher(self):
        """The token dispatcher this rank's MoE layers ran (the planned one when it holds none)."""
        ran = {l.dispatcher for l in self.moe_layers}
        return ran.pop() if len(ran) == 1 else self.layout.moe_dispatcher

    def expert_report(self):
        """The experts this rank held and the tokens they received per training step."""
        if self.d.experts is None:
            return None
        steps = max(1, self.steps_taken)
        return {
            "ep": self.d.experts.degrees["ep"], "etp": self.d.experts.degrees["etp"],
            "edp": self.d.experts.degrees["edp"], "coords": self.d.experts.coords,
            "experts": self.cfg.moe.experts, "topk": self.cfg.moe.topk,
            "local_experts": len(self.expert_ids), "expert_ids": self.expert_ids,
            "moe_layers": len(self.moe_layers), "dispatcher": self.dispatcher(),
            "steps": self.steps_taken,
            "tokens_received_per_step": sum(l.received for l in self.moe_layers) / steps,
            "tokens_sent_per_step": sum(l.sent for l in self.moe_layers) / steps,
            "tokens_per_local_expert_per_step": [
                sum(l.per_expert[e] for l in self.moe_layers) / steps for e in range(len(self.expert_ids))],
        }

    def tied_tables(self):
        tables = []
        for m in self.modules:
            if m.embeddings is not None:
                tables.append(m.embeddings.tok.weight)
            if m.output is not None:
                tables.append(m.output.weight)
        return tables

    def local_parameter_numbers(self):
        numel = sum(local_tensor(p).numel() for p in self.params)
        size = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in self.params)
        return numel, size


def run_timed(trainer, d, count, sync_device):
    """Run `count` iterations with a barrier before each; (elapsed ms list, losses)."""
    import torch.distributed as dist

    elapsed, losses = [], []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        loss = trainer.step()
        sync_device()
        elapsed.append((time.perf_counter() - start) * 1000.0)
        losses.append(loss)
    return elapsed, losses


def max_over_ranks(values, device):
    import torch.distributed as dist

    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def device_synchronizer(device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# ---------------------------------------------------------------------------
# Profiler: time of collectives per kind
# ---------------------------------------------------------------------------

_KIND_PATTERNS = (
    ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
    ("allgather", "all_gather"), ("alltoall", "all_to_all"), ("sendrecv", "send_recv"),
    ("broadcast", "broadcast"), ("barrier", "barrier"), ("recv", "recv"), ("send", "send"),
    ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
)


def collective_kind(name):
    """Normalise a recorded op name (c10d::_allgather_base_, gloo:all_reduce,
    ncclDevKernel_ReduceScatter_...) to one kind, or None."""
    low = name.lower()
    for prefix in ("c10d::", "_c10d_functional::", "gloo:", "nccl:", "ncclkernel_", "nccldevkernel_"):
        if low.startswith(prefix):
            low = low[len(prefix):]
            break
    else:
        return None
    compact = "".join(ch for ch in low if ch.isalpha())
    for pattern, kind in _KIND_PATTERNS:
        if pattern in compact:
            return kind
    return None


def _union_us(intervals):
    total, end = 0.0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _duration_ms(event):
    return event.time_range.elapsed_us() / 1000.0


def collectives_from_events(events, device):
    """Sum the time of collective ops per kind; (dict, note or None).

    CUDA: the NCCL kernels' device time.  CPU/gloo: c10d::* records only the
    enqueue; the gloo:* record spans the work on gloo's thread (from its
    start to its completion, so it includes waiting for the peers).  gloo
    runs reduce_scatter_tensor as an all_reduce, so each gloo record is
    labelled with the c10d op that issued it (the earliest c10d op not yet
    matched that started before it).
    """
    out = defaultdict(float)
    if device.type == "cuda":
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower():
                kind = collective_kind(e.name) or "other_nccl"
                out[kind] += _duration_ms(e)
        if out:
            return dict(out), "collectives_ms: device time of the NCCL kernels"
    issued = sorted((e for e in events if e.name.startswith("c10d::") and collective_kind(e.name)),
                    key=lambda e: e.time_range.start)
    backend = sorted((e for e in events if e.name.startswith(("gloo:", "nccl:")) and collective_kind(e.name)),
                     key=lambda e: e.time_range.start)
    if backend:
        pending = list(issued)
        spans = defaultdict(list)
        for e in backend:
            kind = collective_kind(e.name)
            for i, op in enumerate(pending):
                if op.time_range.start <= e.time_range.start:
                    kind = collective_kind(op.name)
                    del pending[i]
                    break
            spans[kind].append((e.time_range.start, e.time_range.end))
        # Async work (the pipeline's batched isend/irecv) overlaps: summing
        # the spans would count the same wall time several times over.
        return ({k: _union_us(v) / 1000.0 for k, v in spans.items()},
                "collectives_ms: per kind, the wall time covered by the gloo:* records (work on gloo's "
                "thread from start to completion, waiting for peers included; overlapping records counted "
                "once), each labelled by the c10d op that issued it")
    if issued:
        for e in issued:
            out[collective_kind(e.name)] += _duration_ms(e)
        return dict(out), "collectives_ms: CPU time of the c10d::* calls only (no backend records)"
    return {}, None


def profile_one_iteration(trainer, device, sync_device):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    dist.barrier()
    with profile(activities=activities) as prof:
        trainer.step()
        sync_device()
    events = prof.events()
    if not events:
        return {}, "collectives_ms: the profiler recorded no events"
    names = sorted({e.name for e in events if collective_kind(e.name)})
    result, note = collectives_from_events(events, device)
    if not result:
        return {}, "collectives_ms: the profiler recorded no collective ops in the profiled iteration"
    return ({k: round(v, 4) for k, v in sorted(result.items())},
            f"{note}; names seen: {', '.join(names)}")


# ---------------------------------------------------------------------------
# Modes
# ---------------------------------------------------------------------------


def set_threads(job):
    n = job.get("threads_per_rank", 0) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise JobError(f"threads_per_rank: expected a non-negative integer, got {n!r}")
    if n > 0:
        torch.set_num_threads(n)


def run_train(job):
    import torch.distributed as dist

    rank, world, local_rank, device = init_distributed(job)
    model, layout = parse_train_job(job, world)
    set_threads(job)
    warmup = _get(job, "warmup", "", int, minimum=0)
    iterations = _get(job, "iterations", "", int, minimum=1)
    seed = _get(job, "seed", "", int)
    notes = list(layout.notes)
    d = build_mesh(layout, device, rank, world, local_rank)
    if model.moe is not None:
        d.experts = build_expert_mesh(layout, device, rank)
    preload_runtime(job, device)
    meter = MemoryMeter(device, notes)
    meter.start()
    trainer = Trainer(job, model, layout, d, notes)
    torch.manual_seed(seed)  # dropout stream: same on all ranks, so TP ranks agree
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    sync_device = device_synchronizer(device)
    run_timed(trainer, d, warmup, sync_device)
    rank_ms, losses = run_timed(trainer, d, iterations, sync_device)
    peak, baseline, kind, reserved = meter.finish()
    iteration_ms = max_over_ranks(rank_ms, device)
    collectives, note = profile_one_iteration(trainer, device, sync_device)
    experts = trainer.expert_report()
    if note:
        notes.append(note)
    loss = None if trainer.schedule is not None and not trainer.holds_last else losses
    if loss is not None and not all(math.isfinite(v) for v in loss):
        notes.append("loss is not finite")
    numel, nbytes = trainer.local_parameter_numbers()
    grad_sparse, grad_note = trainer.embedding_gradient_note()
    if grad_note:
        notes.append(grad_note)
    report = {
        "schema": SCHEMA, "mode": "train", "candidate": job.get("candidate"),
        "rank": rank, "world_size": world, "torch_version": torch.__version__,
        "backend": dist.get_backend(), "device": device.type, "dtype": job["dtype"],
        "degrees": d.degrees if d.experts is None else {**d.degrees, **d.experts.degrees},
        "mesh_coords": d.coords,
        "cp_comm": trainer.cp_comm(), "context": context_description(model, layout, d.coords["cp"]),
        "stages": trainer.chunks, "stage_layers": [layout.stage_layers[c] for c in trainer.chunks],
        "schedule": type(trainer.schedule).__name__ if trainer.schedule is not None else "none",
        "micro_batches": layout.micro_batches, "micro_batch": layout.micro_batch,
        "data_parallel": trainer.data_parallel,
        "tensor_parallel": trainer.tensor_parallel,
        "sequence_parallel": layout.sequence_parallel, "recompute": layout.recompute,
        "embedding_sync": trainer.embedding_sync, "embedding_grad_sparse": grad_sparse,
        "checkpointed_blocks": trainer.checkpointed_blocks,
        "parameters": numel, "parameter_bytes": nbytes,
        "iteration_ms": [round(v, 4) for v in iteration_ms],
        "rank_iteration_ms": [round(v, 4) for v in rank_ms],
        "peak_memory_bytes": peak, "baseline_memory_bytes": baseline,
        "memory_kind": kind, "reserved_bytes": reserved,
        "collectives_ms": collectives, "loss": loss, "notes": notes,
    }
    if d.experts is not None:
        report["experts"] = experts
    write_json_atomic(os.path.join(job["report_dir"], f"rank-{rank}.json"), report)
    dist.barrier()
    dist.destroy_process_group()


def parse_comm(job, world):
    c = _get(job, "comm", "", dict)
    ops = _get(c, "ops", "comm.", list)
    for i, op in enumerate(ops):
        if op not in COMM_OPS:
            raise JobError(f"comm.ops[{i}]: {op!r} is not one of {', '.join(COMM_OPS)}")
    if "send_recv" in ops and world < 2:
        raise JobError("comm.ops: send_recv needs at least 2 ranks")
    sizes = _get(c, "sizes_bytes", "comm.", list)
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, int) or s < 4:
            raise JobError(f"comm.sizes_bytes[{i}]: expected an integer of at least 4 bytes, got {s!r}")
    return ops, sizes, _get(c, "warmup", "comm.", int, minimum=0), _get(c, "iterations", "comm.", int, minimum=1)


def comm_op_runner(op, size, world, rank, device):
    """A closure running one repetition of `op` on fp32 tensors, and its one-way divisor."""
    import torch.distributed as dist

    numel = max(1, size // 4)
    if op == "all_reduce":
        t = torch.ones(numel, device=device)
        return (lambda: dist.all_reduce(t)), 1
    if op in ("all_gather", "reduce_scatter"):
        full = max(world, numel - numel % world)
        big = torch.ones(full, device=device)
        part = torch.ones(full // world, device=device)
        if op == "all_gather":
            return (lambda: dist.all_gather_into_tensor(big, part)), 1
        return (lambda: dist.reduce_scatter_tensor(part, big)), 1
    t = torch.ones(numel, device=device)

    def ping_pong():
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    return ping_pong, 2


def run_comm(job):
    import torch.distributed as dist

    _check_header(job)
    rank, world, _, device = init_distributed(job)
    set_threads(job)
    ops, sizes, warmup, iterations = parse_comm(job, world)
    sync_device = device_synchronizer(device)
    # The first collectives of a process group set up connections; keep
    # that out of the first point.
    for _ in range(3):
        dist.all_reduce(torch.ones(1, device=device))
    dist.barrier()
    points = []
    for op in ops:
        for size in sizes:
            fn, divisor = comm_op_runner(op, size, world, rank, device)
            samples = []
            for rep in range(warmup + iterations):
                dist.barrier()
                start = time.perf_counter()
                fn()
                sync_device()
                if rep >= warmup:
                    samples.append((time.perf_counter() - start) / divisor)
            median = statistics.median(samples)
            seconds = max_over_ranks([median], device)[0]
            points.append({"op": op, "ranks": 2 if op == "send_recv" else world,
                           "bytes": size, "seconds": seconds, "samples": len(samples)})
    if rank == 0:
        report = {"schema": SCHEMA, "mode": "comm", "world_size": world,
                  "backend": dist.get_backend(), "device": device.type, "points": points}
        write_json_atomic(os.path.join(job["report_dir"], "comm.json"), report)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Sync mode: three ways to synchronise an embedding table's gradient
# ---------------------------------------------------------------------------


@dataclass
class SyncSweepSpec:
    vocab: int
    hidden: int
    tokens_per_rank: list
    methods: list
    partitions: list
    token_file: str | None
    zipf_exponent: float | None
    warmup: int
    iterations: int


def _int_list(obj, key, prefix, minimum, maximum=None, maximum_name=None):
    """A list of distinct integers in [minimum, maximum]; errors name prefix.key[i]."""
    values = _get(obj, key, prefix, list)
    seen = set()
    for i, v in enumerate(values):
        name = f"{prefix}{key}[{i}]"
        if isinstance(v, bool) or not isinstance(v, int):
            raise JobError(f"{name}: expected an integer, got {v!r}")
        if v < minimum:
            raise JobError(f"{name}: {v} is below the minimum {minimum}")
        if maximum is not None and v > maximum:
            raise JobError(f"{name}: {v} is above the {maximum_name} {maximum}")
        if v in seen:
            raise JobError(f"{name}: {v} is listed twice")
        seen.add(v)
    return values


def parse_sync(job, world):
    s = _get(job, "sync", "", dict)
    p = "sync."
    if world < 2:
        raise JobError(f"sync: a synchronisation needs at least 2 ranks, the world size is {world}")
    if job["dtype"] != "fp32":
        raise JobError(f"dtype: sync mode synchronises fp32 gradients, got {job['dtype']!r}")
    vocab = _get(s, "vocab", p, int, minimum=1)
    hidden = _get(s, "hidden", p, int, minimum=1)
    tokens = _int_list(s, "tokens_per_rank", p, 1)
    if not tokens:
        raise JobError("sync.tokens_per_rank: empty; at least one batch size is needed")
    methods = _get(s, "methods", p, list)
    if not methods:
        raise JobError("sync.methods: empty; at least one method is needed")
    for i, m in enumerate(methods):
        if m not in SYNC_METHODS:
            raise JobError(f"sync.methods[{i}]: {m!r} is not one of {', '.join(SYNC_METHODS)}")
        if m in methods[:i]:
            raise JobError(f"sync.methods[{i}]: {m!r} is listed twice")
    partitions = _int_list(s, "partitions", p, 1, world, "world size")
    if "parameter_server" in methods and not partitions:
        raise JobError("sync.partitions: empty, but sync.methods has parameter_server")
    token_file = _get(s, "token_file", p, str, optional=True)
    if token_file is not None and not os.path.isabs(token_file):
        raise JobError(f"sync.token_file: expected an absolute path, got {token_file!r}")
    zipf = s.get("zipf_exponent")
    if zipf is not None and (isinstance(zipf, bool) or not isinstance(zipf, (int, float))
                             or not math.isfinite(zipf) or zipf < 0):
        raise JobError(f"sync.zipf_exponent: expected a non-negative number, got {zipf!r}")
    if (token_file is None) == (zipf is None):
        raise JobError("sync: give exactly one of token_file and zipf_exponent, "
                       + ("got neither" if token_file is None else "got both"))
    return SyncSweepSpec(
        vocab=vocab, hidden=hidden, tokens_per_rank=tokens, methods=methods,
        partitions=partitions, token_file=token_file,
        zipf_exponent=None if zipf is None else float(zipf),
        warmup=_get(s, "warmup", p, int, minimum=0),
        iterations=_get(s, "iterations", p, int, minimum=1),
    )


def read_token_file(path, vocab):
    """The ids of a token file (one non-negative integer per line, blank lines skipped)."""
    ids = []
    try:
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                text = line.strip()
                if not text:
                    continue
                if not (text.isascii() and text.isdigit()):
                    raise JobError(f"sync.token_file: {path} line {line_no}: {text[:40]!r} is not a "
                                   "non-negative integer")
                v = int(text)
                if v >= vocab:
                    raise JobError(f"sync.token_file: {path} line {line_no}: id {v} is not below "
                                   f"sync.vocab = {vocab}")
                ids.append(v)
    except OSError as e:
        raise JobError(f"sync.token_file: cannot read {path}: {e.strerror}") from e
    if not ids:
        raise JobError(f"sync.token_file: {path} holds no token ids")
    return torch.tensor(ids, dtype=torch.int64)


def zipf_token_ids(vocab, exponent, n, seed):
    """n ids drawn i.i.d. with P(id = r) proportional to (r + 1)^-exponent."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.arange(1, vocab + 1, dtype=torch.float64).pow_(-exponent)
    if vocab <= 1 << 24:  # torch.multinomial's limit on categories
        return torch.multinomial(probs, n, replacement=True, generator=g)
    cdf = probs.cumsum_(0)
    u = torch.rand(n, dtype=torch.float64, generator=g) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=vocab - 1)


@dataclass
class SyncBatch:
    """One rank's batch: the distinct ids its tokens touched and their gradient rows."""

    tokens: int
    ids: torch.Tensor  # (k,) int64, sorted
    rows: torch.Tensor  # (k, hidden) fp32: each row's token count
    mean_rows: float  # mean of k over the ranks


def sync_batch(spec, stream, n, rank, world, seed, device):
    import torch.distributed as dist

    if stream is not None:
        ids = stream[(torch.arange(n, dtype=torch.int64) + rank * n) % stream.numel()]
    else:
        ids = zipf_token_ids(spec.vocab, spec.zipf_exponent, n, seed + rank)
    unique, counts = torch.unique(ids, sorted=True, return_counts=True)
    k = torch.tensor([unique.numel()], dtype=torch.int64, device=device)
    dist.all_reduce(k)
    rows = counts.to(torch.float32)[:, None].expand(-1, spec.hidden).contiguous()
    return SyncBatch(tokens=n, ids=unique.to(device), rows=rows.to(device),
                     mean_rows=int(k.item()) / world)


def _exchange(ops):
    """Run point-to-point ops as one batch (deadlock-free on NCCL too) and wait."""
    import torch.distributed as dist

    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def dense_all_reduce_runner(batch, dense):
    """(prepare, run): the dense gradient, then one all_reduce of it."""
    import torch.distributed as dist

    def prepare():
        dense.zero_()
        dense.index_copy_(0, batch.ids, batch.rows)

    return prepare, (lambda: dist.all_reduce(dense))


def sparse_all_gather_runner(batch, vocab, world, device):
    """(prepare, run): DDP's sparse path, all-gathers of counts, ids and rows, then a local sum."""
    import torch.distributed as dist

    ids, rows = batch.ids, batch.rows
    k, hidden = rows.shape

    def run():
        counts = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(counts, torch.tensor([k], dtype=torch.int64, device=device))
        k_max = int(counts.max().item())
        ids_pad = torch.zeros(k_max, dtype=torch.int64, device=device)
        ids_pad[:k] = ids
        rows_pad = torch.zeros(k_max, hidden, dtype=rows.dtype, device=device)
        rows_pad[:k] = rows
        all_ids = torch.empty(world * k_max, dtype=torch.int64, device=device)
        all_rows = torch.empty(world * k_max, hidden, dtype=rows.dtype, device=device)
        dist.all_gather_into_tensor(all_ids, ids_pad)
        dist.all_gather_into_tensor(all_rows, rows_pad)
        keep = (torch.arange(k_max, device=device)[None, :] < counts[:, None]).flatten()
        return torch.sparse_coo_tensor(all_ids[keep][None], all_rows[keep], (vocab, hidden)).coalesce()

    return (lambda: None), run


def shard_rows(vocab, partitions, server):
    """Rows r of the table with r % partitions == server."""
    return max(0, (vocab - server + partitions - 1) // partitions)


def parameter_server_runner(batch, partitions, shard, table, rank, world, device):
    """(prepare, run): Parallax's sparse path, push to the owners, SGD there, pull back.

    Row r is owned by server r % partitions (ranks 0..partitions-1), at row
    r // partitions of its shard.  Tags keep each kind of message apart on gloo.
    """
    import torch.distributed as dist

    p = partitions
    ids, rows = batch.ids, batch.rows
    hidden = rows.shape[1]
    server = rank < p
    P2P = dist.P2POp

    def run():
        owner = ids % p
        order = torch.argsort(owner, stable=True)
        per = torch.bincount(owner, minlength=p).tolist()
        ids_by = torch.split(ids[order], per)
        rows_by = torch.split(rows[order], per)
        # 1. counts to every other owner; a server learns what each rank sends
        ops, got = [], {}
        for s in range(p):
            if s != rank:
                ops.append(P2P(dist.isend, torch.tensor([per[s]], dtype=torch.int64, device=device), s, tag=1))
        if server:
            for q in range(world):
                if q != rank:
                    got[q] = torch.empty(1, dtype=torch.int64, device=device)
                    ops.append(P2P(dist.irecv, got[q], q, tag=1))
        _exchange(ops)
        got = {q: int(t.item()) for q, t in got.items()}
        # 2. push (ids, rows) to each owner
        ops, in_ids, in_rows = [], {}, {}
        for s in range(p):
            if s != rank and per[s]:
                ops.append(P2P(dist.isend, ids_by[s], s, tag=2))
                ops.append(P2P(dist.isend, rows_by[s], s, tag=3))
        for q, c in got.items():
            if c:
                in_ids[q] = torch.empty(c, dtype=torch.int64, device=device)
                in_rows[q] = torch.empty(c, hidden, dtype=rows.dtype, device=device)
                ops.append(P2P(dist.irecv, in_ids[q], q, tag=2))
                ops.append(P2P(dist.irecv, in_rows[q], q, tag=3))
        _exchange(ops)
        # 3. each server sums what it holds and applies SGD to those rows
        if server:
            all_ids = torch.cat([ids_by[rank]] + [in_ids[q] for q in sorted(in_ids)])
            all_rows = torch.cat([rows_by[rank]] + [in_rows[q] for q in sorted(in_rows)])
            touched, inverse = torch.unique(all_ids, return_inverse=True)
            grad = torch.zeros(touched.numel(), hidden, dtype=rows.dtype, device=device)
            grad.index_add_(0, inverse, all_rows)
            shard.index_add_(0, touched // p, grad, alpha=-SYNC_LEARNING_RATE)
            table.index_copy_(0, ids_by[rank], shard[ids_by[rank] // p])
        # 4. pull: each server returns the updated rows each rank asked for
        ops, pulled = [], {}
        for q in sorted(in_ids):
            ops.append(P2P(dist.isend, shard[in_ids[q] // p], q, tag=4))
        for s in range(p):
            if s != rank and per[s]:
                pulled[s] = torch.empty(per[s], hidden, dtype=rows.dtype, device=device)
                ops.append(P2P(dist.irecv, pulled[s], s, tag=4))
        _exchange(ops)
        for s, buf in pulled.items():
            table.index_copy_(0, ids_by[s], buf)

    return (lambda: None), run


def run_sync(job):
    import torch.distributed as dist

    _check_header(job)
    rank, world, _, device = init_distributed(job)
    set_threads(job)
    spec = parse_sync(job, world)
    seed = _get(job, "seed", "", int)
    stream = read_token_file(spec.token_file, spec.vocab) if spec.token_file is not None else None
    sync_device = device_synchronizer(device)
    # The gathered ids are in range by construction: opt out of the sparse
    # invariant checks explicitly (as DDP's path runs without them).
    torch.sparse.check_sparse_tensor_invariants.disable()
    # Connections: the collectives' first, then every pair's point-to-point
    # links (the parameter server's), kept out of the first point.
    for _ in range(3):
        dist.all_reduce(torch.ones(1, device=device))
    if "parameter_server" in spec.methods:
        bufs = {q: torch.zeros(1, device=device) for q in range(world) if q != rank}
        ops = [dist.P2POp(dist.isend, torch.ones(1, device=device), q) for q in bufs]
        ops += [dist.P2POp(dist.irecv, b, q) for q, b in bufs.items()]
        _exchange(ops)
    dist.barrier()
    batches = [sync_batch(spec, stream, n, rank, world, seed, device) for n in spec.tokens_per_rank]
    table = dense = None
    if "all_reduce" in spec.methods:
        dense = torch.zeros(spec.vocab, spec.hidden, device=device)
    if "parameter_server" in spec.methods:
        table = torch.zeros(spec.vocab, spec.hidden, device=device)
    points = []
    for method in spec.methods:
        for p in (spec.partitions if method == "parameter_server" else [0]):
            shard = None
            if method == "parameter_server" and rank < p:
                shard = torch.zeros(shard_rows(spec.vocab, p, rank), spec.hidden, device=device)
            for batch in batches:
                if method == "all_reduce":
                    prepare, fn = dense_all_reduce_runner(batch, dense)
                elif method == "sparse_all_gather":
                    prepare, fn = sparse_all_gather_runner(batch, spec.vocab, world, device)
                else:
                    prepare, fn = parameter_server_runner(batch, p, shard, table, rank, world, device)
                samples = []
                for rep in range(spec.warmup + spec.iterations):
                    prepare()
                    sync_device()
                    dist.barrier()
                    start = time.perf_counter()
                    fn()
                    sync_device()
                    if rep >= spec.warmup:
                        samples.append(time.perf_counter() - start)
                median = statistics.median(samples)
                seconds = max_over_ranks([median], device)[0]
                points.append({"method": method, "ranks": world, "partitions": p,
                               "vocab": spec.vocab, "hidden": spec.hidden, "element_bytes": 4,
                               "tokens": batch.tokens, "rows": batch.mean_rows,
                               "seconds": seconds, "samples": len(samples)})
            del shard
    if rank == 0:
        report = {"schema": SCHEMA, "mode": "sync", "world_size": world,
                  "backend": dist.get_backend(), "device": device.type, "points": points}
        write_json_atomic(os.path.join(job["report_dir"], "sync.json"), report)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def write_json_atomic(path, obj):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_job(path):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise JobError(f"--job: cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise JobError(f"--job: {path} is not JSON: {e}") from e


def one_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True, help="job JSON written by paratune")
    ap.add_argument("--describe", action="store_true", help="print the per-rank mapping, run nothing")
    ap.add_argument("--world", type=int, help="world size for --describe")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    report_dir = None
    try:
        job = load_job(args.job)
        if args.describe:
            if args.world is None or args.world < 1:
                raise JobError("--world: a positive world size is needed with --describe")
            print(json.dumps(describe(job, args.world), indent=1))
            return 0
        report_dir = job.get("report_dir") if isinstance(job, dict) else None
        if not isinstance(report_dir, str) or not report_dir:
            report_dir = None
            raise JobError("report_dir: missing")
        mode = job.get("mode")
        if mode == "train":
            run_train(job)
        elif mode == "comm":
            run_comm(job)
        elif mode == "sync":
            run_sync(job)
        else:
            raise JobError(f"mode: {mode!r} is not one of train, comm, sync")
        return 0
    except Exception as e:  # every failure becomes a report, never a hang or silence
        line = one_line(e)
        if report_dir is not None and not args.describe:
            try:
                write_json_atomic(os.path.join(report_dir, f"rank-{rank}.error.json"),
                                  {"schema": SCHEMA, "rank": rank, "error": line,
                                   "traceback": traceback.format_exc()})
            except OSError as w:
                print(f"rank {rank}: could not write the error report: {w}", file=sys.stderr)
        print(f"rank {rank}: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
