//! A trial run of one pipeline stage on the local device (`paratune
//! validate`): the stage's layers as one tensor-parallel shard, its
//! embedding or output head and loss, its parameters, fp32 gradient buffers
//! and Adam states as the plan's sharding leaves them on one GPU, and the
//! schedule's forward/backward order with as many micro-batches in flight as
//! the schedule keeps on this stage.
//!
//! What one GPU cannot run is left out and said so: tensor-parallel and
//! data-parallel collectives, pipeline sends and receives (the stage's input
//! is a tensor made locally, its incoming gradient all ones).
//!
//! Under sequence parallelism the stage's input, its layers' residual
//! stream and what recomputation checkpoints are one rank's `seq / tp`
//! tokens, and the output head's GEMM runs over the gathered sequence (see
//! `torch_layer.rs`).
//!
//! **ZeRO-3.** With `weight_shards > 1` every layer's 16-bit weights live as
//! one flat shard of `1 / weight_shards`; a layer is gathered into one of
//! two buffers (the layer computing and the one prefetched, as FSDP keeps
//! them) before its forward and again before its backward, so the stage
//! holds the shards and two layers whole, as a ZeRO-3 rank does. The
//! embedding and the output head are sharded too and gathered, for as long
//! as they are used, into a temporary. The gathers stand for all-gathers,
//! which the trial does not time: their copy time, measured apart before the
//! timed iterations, is taken out of the stage time.
//!
//! **BPipe.** An evictor stage moves the activations of `evicted` in-flight
//! micro-batches off the device: their forward runs without autograd, each
//! layer's input goes to host memory (to a file when the device is the CPU,
//! whose memory is the host's) and comes back before the backward, which
//! recomputes the layer from it. The device therefore holds fewer
//! activations, as under BPipe; the time is an upper bound on BPipe's, which
//! keeps the activations themselves rather than recomputing them. An
//! acceptor stage holds `accepted` micro-batches' worth of its partner's
//! activations in buffers of the size its own micro-batches keep.

use super::memory::{self, MemoryProbe};
use super::torch_layer::{
    LayerShard, backward, catching_oom, gathered_matmul, kind, runtime, sync, torch_device,
};
use super::{Device, MeasureError, Sampler, StageJob, StageMeasurement};
use crate::config::Recompute;
use std::time::Instant;
use tch::{Kind, Tensor};

pub(super) fn measure(job: &StageJob) -> Result<StageMeasurement, MeasureError> {
    super::check_stage_job(job)?;
    let device = torch_device(job.device)?;
    if job.device == Device::Cpu {
        memory::prepare_process();
    }
    let probe = memory::probe(job.device);
    tch::manual_seed(0);
    catching_oom(
        || run(job, device, &*probe),
        || StageMeasurement::out_of_memory(runtime(device), None),
    )
}

/// A parameter's fp32 gradient buffer and Adam states, each holding this
/// rank's shard.
struct Shard {
    main_grad: Tensor,
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// Where a stage's layer weights live.
enum LayerWeights {
    /// Every layer whole on this rank.
    Whole(Vec<LayerShard>),
    /// ZeRO-3: each layer's weights as one flat shard, gathered on use into
    /// one of two buffers.
    Sharded {
        shards: Vec<Tensor>,
        buffers: [LayerShard; 2],
    },
}

impl LayerWeights {
    fn new(job: &StageJob, device: tch::Device) -> Self {
        let layer = || {
            let shard = LayerShard::new(&job.model, job.tp, job.dtype, device);
            if job.sequence_parallel {
                shard.sequence_parallel(job.tp)
            } else {
                shard
            }
        };
        if job.weight_shards == 1 {
            return LayerWeights::Whole((0..job.layers).map(|_| layer()).collect());
        }
        let buffers = [layer(), layer()];
        let len = shard_len(layer_numel(&buffers[0]), job.weight_shards);
        let shards = (0..job.layers)
            .map(|_| {
                (Tensor::randn([len], (kind(job.dtype), device)) * 0.02).set_requires_grad(true)
            })
            .collect();
        LayerWeights::Sharded { shards, buffers }
    }

    /// What the optimizer updates for layer `i`, with each tensor's size
    /// before any ZeRO-3 sharding (what the gradient and state shards
    /// divide).
    fn trainable(&self, i: usize) -> Vec<(&Tensor, i64)> {
        match self {
            LayerWeights::Whole(layers) => layers[i]
                .parameters()
                .iter()
                .map(|p| (p, p.numel() as i64))
                .collect(),
            LayerWeights::Sharded { shards, buffers } => {
                vec![(&shards[i], layer_numel(&buffers[0]))]
            }
        }
    }

    /// Layer `i` ready to run: the shard and the weights to run it with.
    /// Under ZeRO-3 the layer is gathered now into a buffer, and the weights
    /// are fresh leaves on the buffer's memory with their own version
    /// counters: the next gather into that buffer (which stands for freeing
    /// the layer) does not trip autograd's check, and the gather before the
    /// backward puts the layer's values back.
    fn gather(&self, i: usize) -> (&LayerShard, Vec<Tensor>) {
        match self {
            LayerWeights::Whole(layers) => (
                &layers[i],
                layers[i]
                    .parameters()
                    .iter()
                    .map(Tensor::shallow_clone)
                    .collect(),
            ),
            LayerWeights::Sharded { shards, buffers } => {
                let buffer = &buffers[i % 2];
                let shard = &shards[i];
                tch::no_grad(|| {
                    for p in buffer.parameters() {
                        fill_from(&p.detach().flatten(0, -1), shard);
                    }
                });
                let weights = buffer
                    .parameters()
                    .iter()
                    .map(|p| p.data().set_requires_grad(true))
                    .collect();
                (buffer, weights)
            }
        }
    }
}

/// A tensor that is not sharded, with its size.
fn whole(t: &Tensor) -> (&Tensor, i64) {
    (t, t.numel() as i64)
}

/// Elements of all of a layer shard's weights.
fn layer_numel(layer: &LayerShard) -> i64 {
    layer.parameters().iter().map(|p| p.numel() as i64).sum()
}

/// Writes `flat` whole from copies of `shard`, as an all-gather writes a
/// layer from every rank's shard.
fn fill_from(flat: &Tensor, shard: &Tensor) {
    let (total, len) = (flat.numel() as i64, shard.numel() as i64);
    if len == 0 {
        return;
    }
    let mut start = 0;
    while start < total {
        let n = len.min(total - start);
        flat.narrow(0, start, n)
            .copy_(&shard.detach().narrow(0, 0, n));
        start += n;
    }
}

/// The embedding or output head table.
enum Table {
    Whole(Tensor),
    /// ZeRO-3: this rank's flat shard, and the whole table's shape.
    Sharded {
        shard: Tensor,
        shape: [i64; 2],
    },
}

impl Table {
    fn new(shape: [i64; 2], kind: Kind, device: tch::Device, shards: u64) -> Table {
        let weights =
            |dims: &[i64]| (Tensor::randn(dims, (kind, device)) * 0.02).set_requires_grad(true);
        if shards == 1 {
            Table::Whole(weights(&shape))
        } else {
            Table::Sharded {
                shard: weights(&[shard_len(shape[0] * shape[1], shards)]),
                shape,
            }
        }
    }

    /// What the optimizer updates, with the whole table's size.
    fn trainable(&self) -> (&Tensor, i64) {
        match self {
            Table::Whole(t) => whole(t),
            Table::Sharded { shard, shape } => (shard, shape[0] * shape[1]),
        }
    }

    fn rows(&self) -> i64 {
        match self {
            Table::Whole(t) => t.size()[0],
            Table::Sharded { shape, .. } => shape[0],
        }
    }

    /// The table to compute with: itself, or under ZeRO-3 a temporary
    /// gathered from the shard (a leaf, so its gradient can be taken).
    fn gather(&self) -> Tensor {
        match self {
            Table::Whole(t) => t.shallow_clone(),
            Table::Sharded { shard, shape } => {
                let table = Tensor::empty(*shape, (shard.kind(), shard.device()));
                tch::no_grad(|| fill_from(&table.flatten(0, -1), shard));
                table.set_requires_grad(true)
            }
        }
    }
}

struct Stage {
    layers: LayerWeights,
    /// ZeRO-3 gathers so far, of layers and of tables.
    gathers: std::cell::Cell<(u64, u64)>,
    /// Seconds one layer gather and one table gather take (measured apart).
    gather_seconds: std::cell::Cell<(f64, f64)>,
    /// Where each layer's weights start in `shards`.
    layer_offsets: Vec<usize>,
    embedding: Option<Table>,
    head: Option<Table>,
    shards: Vec<Shard>,
    device: tch::Device,
    kind: Kind,
    job: StageJob,
}

/// Elements of a `numel` tensor one of `shards` ranks holds.
fn shard_len(numel: i64, shards: u64) -> i64 {
    (numel + shards as i64 - 1) / shards as i64
}

impl Stage {
    fn new(job: &StageJob, device: tch::Device) -> Stage {
        let kind = kind(job.dtype);
        let m = &job.model;
        let layers = LayerWeights::new(job, device);
        let shape = [(m.vocab / job.tp) as i64, m.hidden as i64];
        let table = || Table::new(shape, kind, device, job.weight_shards);
        let embedding = job.first.then(table);
        let head = job.last.then(table);
        let mut layer_offsets = vec![usize::from(embedding.is_some())];
        for i in 0..job.layers as usize {
            let next = layer_offsets[i] + layers.trainable(i).len();
            layer_offsets.push(next);
        }
        let mut stage = Stage {
            layers,
            gathers: Default::default(),
            gather_seconds: Default::default(),
            layer_offsets,
            embedding,
            head,
            shards: Vec::new(),
            device,
            kind,
            job: job.clone(),
        };
        let f32s = (Kind::Float, device);
        stage.shards = stage
            .trainable()
            .into_iter()
            .map(|(p, numel)| {
                let grad = shard_len(numel, job.grad_shards);
                let state = shard_len(numel, job.optimizer_shards);
                // fp32 master weights start as this rank's slice of the weights.
                let master = Tensor::zeros([state], f32s);
                tch::no_grad(|| {
                    let flat = p.detach().flatten(0, -1);
                    let n = state.min(flat.numel() as i64);
                    master
                        .narrow(0, 0, n)
                        .copy_(&flat.narrow(0, 0, n).to_kind(Kind::Float));
                });
                Shard {
                    main_grad: Tensor::zeros([grad], f32s),
                    master,
                    exp_avg: Tensor::zeros([state], f32s),
                    exp_avg_sq: Tensor::zeros([state], f32s),
                }
            })
            .collect();
        stage
    }

    /// What the optimizer updates, with each tensor's size before ZeRO-3
    /// sharding, in the order of `shards`.
    fn trainable(&self) -> Vec<(&Tensor, i64)> {
        let mut params: Vec<(&Tensor, i64)> = self.embedding.iter().map(Table::trainable).collect();
        params.extend((0..self.job.layers as usize).flat_map(|i| self.layers.trainable(i)));
        params.extend(self.head.iter().map(Table::trainable));
        params
    }

    fn parameters(&self) -> Vec<&Tensor> {
        self.trainable().into_iter().map(|(p, _)| p).collect()
    }

    /// The index in `shards` of each of layer `i`'s `weights` (under ZeRO-3
    /// all of them belong to the layer's one shard).
    fn layer_owners(&self, i: usize, weights: usize) -> Vec<usize> {
        let first = self.layer_offsets[i];
        match self.layers {
            LayerWeights::Whole(_) => (first..first + weights).collect(),
            LayerWeights::Sharded { .. } => vec![first; weights],
        }
    }

    /// Layer `i` ready to run (see [`LayerWeights::gather`]), counted.
    fn gather_layer(&self, i: usize) -> (&LayerShard, Vec<Tensor>) {
        if let LayerWeights::Sharded { .. } = self.layers {
            let (layers, tables) = self.gathers.get();
            self.gathers.set((layers + 1, tables));
        }
        self.layers.gather(i)
    }

    /// `table` ready to compute with (see [`Table::gather`]), counted.
    fn gather_table(&self, table: &Table) -> Tensor {
        if let Table::Sharded { .. } = table {
            let (layers, tables) = self.gathers.get();
            self.gathers.set((layers, tables + 1));
        }
        table.gather()
    }

    /// Times one layer gather and one table gather apart, for
    /// [`Self::gather_time`]; nothing without ZeRO-3.
    fn time_gathers(&self) {
        const REPS: u32 = 5;
        let time = |gather: &dyn Fn()| {
            sync(self.device);
            let start = Instant::now();
            for _ in 0..REPS {
                gather();
            }
            sync(self.device);
            start.elapsed().as_secs_f64() / f64::from(REPS)
        };
        let layer = match self.layers {
            LayerWeights::Sharded { .. } => time(&|| drop(self.layers.gather(0))),
            LayerWeights::Whole(_) => 0.0,
        };
        let table = self
            .embedding
            .iter()
            .chain(&self.head)
            .find(|t| matches!(t, Table::Sharded { .. }))
            .map_or(0.0, |t| time(&|| drop(t.gather())));
        self.gather_seconds.set((layer, table));
    }

    /// The copy time of the gathers counted since `since`.
    fn gather_time(&self, since: (u64, u64)) -> f64 {
        let (layers, tables) = self.gathers.get();
        let (layer_s, table_s) = self.gather_seconds.get();
        (layers - since.0) as f64 * layer_s + (tables - since.1) as f64 * table_s
    }

    /// Ranks the sequence is split over outside attention and the MLP.
    fn sequence_shards(&self) -> i64 {
        if self.job.sequence_parallel {
            self.job.tp as i64
        } else {
            1
        }
    }

    /// Tokens of one micro-batch this rank holds between layers.
    fn local_tokens(&self) -> [i64; 2] {
        let seq = self.job.model.seq_len as i64 / self.sequence_shards();
        [self.job.micro_batch as i64, seq]
    }

    /// Random token ids for one micro-batch's whole sequence (the embedding
    /// runs on all of it, sequence parallelism or not).
    fn all_tokens(&self, table: &Table) -> Tensor {
        let shape = [self.job.micro_batch as i64, self.job.model.seq_len as i64];
        Tensor::randint(table.rows(), shape, (Kind::Int64, self.device))
    }

    /// The stage's input for one micro-batch: embedded tokens on the first
    /// stage, a received activation elsewhere.
    fn input(&self) -> Tensor {
        let [b, s] = self.local_tokens();
        let h = self.job.model.hidden as i64;
        match &self.embedding {
            Some(table) => {
                let tokens = self.all_tokens(table);
                let embedded =
                    Tensor::embedding(&self.gather_table(table), &tokens, -1, false, false);
                // Under sequence parallelism the embedding's output is
                // scattered: this rank keeps its own chunk.
                if self.sequence_shards() > 1 {
                    embedded.narrow(1, 0, s).copy()
                } else {
                    embedded
                }
            }
            None => Tensor::randn([b, s, h], (self.kind, self.device)).set_requires_grad(true),
        }
    }

    /// The loss on the last stage (output head, cross-entropy over this
    /// rank's vocabulary shard), else the stage output itself.
    fn finish(&self, y: Tensor) -> Tensor {
        match &self.head {
            Some(head) => self.loss(&y, &self.gather_table(head)),
            None => y,
        }
    }

    /// Cross-entropy of the logits `y` gives through `head`.
    fn loss(&self, y: &Tensor, head: &Tensor) -> Tensor {
        let logits = gathered_matmul(y, &head.tr(), self.sequence_shards()).to_kind(Kind::Float);
        let (b, s, v) = logits.size3().expect("logits are [batch, seq, vocab]");
        let targets = Tensor::randint(v, [b * s], (Kind::Int64, self.device));
        logits.view([b * s, v]).cross_entropy_for_logits(&targets)
    }

    /// Backward from `root` into the fp32 gradient buffers.
    fn backward_into_buffers(&self, root: &Tensor, inputs: &[&Tensor], owners: &[usize]) {
        let grads = backward(root, inputs);
        tch::no_grad(|| {
            for (grad, &owner) in grads.iter().zip(owners) {
                if owner == usize::MAX || !grad.defined() {
                    continue;
                }
                let buffer = &self.shards[owner].main_grad;
                let n = buffer.numel() as i64;
                let flat = grad.flatten(0, -1).narrow(0, 0, n.min(grad.numel() as i64));
                let _ = buffer
                    .narrow(0, 0, flat.numel() as i64)
                    .g_add_(&flat.to_kind(Kind::Float));
            }
        });
    }

    /// Adam on this rank's optimizer shard, written back into the weights.
    fn optimizer_step(&self) {
        let (b1, b2, lr, eps) = (0.9, 0.95, 1e-4, 1e-8);
        tch::no_grad(|| {
            for (param, shard) in self.parameters().into_iter().zip(&self.shards) {
                let n = shard.master.numel() as i64;
                let g = shard
                    .main_grad
                    .narrow(0, 0, n.min(shard.main_grad.numel() as i64));
                let n = g.numel() as i64;
                let mut m = shard.exp_avg.narrow(0, 0, n);
                let mut v = shard.exp_avg_sq.narrow(0, 0, n);
                // In place, one temporary (the update), as a fused Adam keeps
                // the step's memory close to the states'.
                let _ = m.g_mul_scalar_(b1 / (1.0 - b1)).g_add_(&g);
                let _ = m.g_mul_scalar_(1.0 - b1);
                let _ = v.g_mul_scalar_(b2 / (1.0 - b2)).addcmul_(&g, &g);
                let _ = v.g_mul_scalar_(1.0 - b2);
                let mut update = v.sqrt();
                let _ = update.g_add_scalar_(eps).reciprocal_().g_mul_(&m);
                let _ = update.g_mul_scalar_(-lr);
                let mut master = shard.master.narrow(0, 0, n);
                let _ = master.g_add_(&update);
                drop(update);
                let flat = param.detach().flatten(0, -1);
                let n = n.min(flat.numel() as i64);
                flat.narrow(0, 0, n)
                    .copy_(&master.narrow(0, 0, n).to_kind(self.kind));
                let _ = shard.main_grad.shallow_clone().zero_();
            }
        });
    }
}

/// One micro-batch between its forward and its backward.
enum InFlight {
    /// The autograd graph is on the device.
    Graph { input: Tensor, output: Tensor },
    /// Only each layer's input is kept (full recomputation), on the device;
    /// the output only on the last stage, whose loss needs it (elsewhere it
    /// has been sent on).
    Checkpoints {
        layer_inputs: Vec<Tensor>,
        output: Option<Tensor>,
    },
    /// Each layer's input was moved off the device (BPipe eviction).
    Evicted {
        layer_inputs: Vec<Offloaded>,
        output: Option<Tensor>,
    },
    /// ZeRO-3: a graph per layer, each on its gathered weights; the output
    /// only on the last stage.
    Layers {
        segments: Vec<Segment>,
        output: Option<Tensor>,
    },
}

/// One layer's graph of a micro-batch in flight under ZeRO-3.
struct Segment {
    input: Tensor,
    output: Tensor,
    weights: Vec<Tensor>,
}

/// A tensor held off the device: in host memory for a GPU, in a file for
/// the CPU (whose memory is the host's).
enum Offloaded {
    Host(Tensor),
    File(tempfile::TempPath),
}

impl Offloaded {
    fn put(t: &Tensor, device: tch::Device) -> Offloaded {
        match device {
            tch::Device::Cpu => {
                // libtorch's writer wants a file name with an extension.
                let file = tempfile::Builder::new()
                    .suffix(".pt")
                    .tempfile()
                    .expect("a temporary file for BPipe");
                let path = file.into_temp_path();
                t.save(&path).expect("BPipe eviction writes the activation");
                Offloaded::File(path)
            }
            _ => Offloaded::Host(t.to_device(tch::Device::Cpu)),
        }
    }

    fn take(self, device: tch::Device) -> Tensor {
        match self {
            Offloaded::Host(t) => t.to_device(device),
            Offloaded::File(path) => Tensor::load(&path).expect("BPipe reads the activation back"),
        }
    }
}

impl Stage {
    fn forward(&self, evict: bool) -> InFlight {
        let input = self.input();
        let layers = self.job.layers as usize;
        let checkpointed = evict || self.job.recompute == Recompute::Full;
        if !checkpointed {
            if let LayerWeights::Whole(shards) = &self.layers {
                let y = shards
                    .iter()
                    .fold(input.shallow_clone(), |x, l| l.forward(&x));
                let output = self.finish(y);
                return InFlight::Graph { input, output };
            }
            // ZeRO-3: one graph per layer, each on the weights gathered for it.
            let mut x = input.detach();
            let segments = (0..layers)
                .map(|i| {
                    let (layer, weights) = self.gather_layer(i);
                    let input = x.set_requires_grad(true);
                    let output = layer.forward_with(&weights, &input);
                    x = output.detach();
                    Segment {
                        input,
                        output,
                        weights,
                    }
                })
                .collect();
            let output = self.head.is_some().then_some(x);
            return InFlight::Layers { segments, output };
        }
        let mut layer_inputs = Vec::with_capacity(layers);
        let y = tch::no_grad(|| {
            (0..layers).fold(input.detach(), |x, i| {
                let (layer, weights) = self.gather_layer(i);
                let next = layer.forward_with(&weights, &x);
                layer_inputs.push(x);
                next
            })
        });
        drop(input);
        let output = self.head.is_some().then_some(y);
        if evict {
            let layer_inputs = layer_inputs
                .iter()
                .map(|t| Offloaded::put(t, self.device))
                .collect();
            InFlight::Evicted {
                layer_inputs,
                output,
            }
        } else {
            InFlight::Checkpoints {
                layer_inputs,
                output,
            }
        }
    }

    fn backward(&self, in_flight: InFlight) {
        match in_flight {
            InFlight::Graph { input, output } => {
                let mut inputs = self.parameters();
                let mut owners: Vec<usize> = (0..inputs.len()).collect();
                if self.embedding.is_none() {
                    inputs.push(&input);
                    owners.push(usize::MAX);
                }
                self.backward_into_buffers(&output, &inputs, &owners);
            }
            InFlight::Layers { segments, output } => {
                self.head_backward(output);
                for (i, segment) in segments.iter().enumerate().rev() {
                    // Gathered again: the segment's weights see the layer's values.
                    drop(self.gather_layer(i));
                    self.layer_backward(i, &segment.output, &segment.weights, &segment.input);
                }
                self.embedding_backward();
            }
            InFlight::Checkpoints {
                layer_inputs,
                output,
            } => self.recompute_backward(layer_inputs, output),
            InFlight::Evicted {
                layer_inputs,
                output,
            } => {
                let restored = layer_inputs
                    .into_iter()
                    .map(|o| o.take(self.device))
                    .collect();
                self.recompute_backward(restored, output)
            }
        }
    }

    /// Layer by layer from the last: rebuild its graph from its input,
    /// then its backward (with the head's loss first on the last stage).
    fn recompute_backward(&self, layer_inputs: Vec<Tensor>, output: Option<Tensor>) {
        self.head_backward(output);
        for (i, x) in layer_inputs.into_iter().enumerate().rev() {
            let x = x.detach().set_requires_grad(true);
            let (layer, weights) = self.gather_layer(i);
            let y = layer.forward_with(&weights, &x);
            self.layer_backward(i, &y, &weights, &x);
        }
        self.embedding_backward();
    }

    /// Layer `i`'s backward from its output `y` into its weights' buffers
    /// and through its input `x`.
    fn layer_backward(&self, i: usize, y: &Tensor, weights: &[Tensor], x: &Tensor) {
        let mut inputs: Vec<&Tensor> = weights.iter().collect();
        let mut owners = self.layer_owners(i, weights.len());
        inputs.push(x);
        owners.push(usize::MAX);
        self.backward_into_buffers(y, &inputs, &owners);
    }

    /// The loss's backward through the output head, on the last stage.
    fn head_backward(&self, output: Option<Tensor>) {
        if let (Some(head), Some(output)) = (&self.head, output) {
            let head = self.gather_table(head);
            let y = output.detach().set_requires_grad(true);
            let loss = self.loss(&y, &head);
            let owner = self.shards.len() - 1;
            self.backward_into_buffers(&loss, &[&head, &y], &[owner, usize::MAX]);
        }
    }

    /// The embedding's backward, on the first stage: a scatter-add into its
    /// table.
    fn embedding_backward(&self) {
        if let Some(table) = &self.embedding {
            let tokens = self.all_tokens(table);
            let table = self.gather_table(table);
            let y = Tensor::embedding(&table, &tokens, -1, false, false);
            self.backward_into_buffers(&y, &[&table], &[0]);
        }
    }

    /// One iteration: the schedule's forwards and backwards, then the
    /// optimizer step. Returns (schedule seconds, optimizer seconds).
    fn iteration(&self) -> (f64, f64) {
        let job = &self.job;
        // The partner's activations an acceptor holds, made before the clock starts.
        let accepted = self.accepted_buffers();
        let gathers = self.gathers.get();
        let start = Instant::now();
        let mut queue: std::collections::VecDeque<InFlight> = Default::default();
        let warmup = job
            .schedule_in_flight
            .saturating_sub(1)
            .min(job.micro_batches);
        let mut next = 0;
        // Of every window of `schedule_in_flight` consecutive micro-batches
        // (those in flight together), `evicted` are sent away, so the
        // device never holds more than the rest.
        let window = job.schedule_in_flight.max(1);
        let forward = |next: &mut u64, queue: &mut std::collections::VecDeque<InFlight>| {
            let evict = *next % window < job.evicted;
            queue.push_back(self.forward(evict));
            *next += 1;
        };
        while next < warmup {
            forward(&mut next, &mut queue);
        }
        while next < job.micro_batches {
            forward(&mut next, &mut queue);
            if let Some(oldest) = queue.pop_front() {
                self.backward(oldest);
            }
        }
        while let Some(oldest) = queue.pop_front() {
            self.backward(oldest);
        }
        drop(accepted);
        sync(self.device);
        // The gathers stand for all-gathers, which trials do not time.
        let scheduled = (start.elapsed().as_secs_f64() - self.gather_time(gathers)).max(0.0);
        let start = Instant::now();
        self.optimizer_step();
        sync(self.device);
        (scheduled, start.elapsed().as_secs_f64())
    }

    fn accepted_buffers(&self) -> Vec<Tensor> {
        let bytes = self.job.accepted_bytes_per_microbatch;
        let elements = (bytes / 4.0).ceil() as i64;
        (0..self.job.accepted)
            .filter(|_| elements > 0)
            .map(|_| Tensor::ones([elements], (Kind::Float, self.device)))
            .collect()
    }
}

fn run(job: &StageJob, device: tch::Device, probe: &dyn MemoryProbe) -> StageMeasurement {
    sync(device);
    let before = probe.used();
    probe.reset_peak();
    let stage = Stage::new(job, device);
    sync(device);
    let static_bytes = probe.used().zip(before).map(|(a, b)| (a - b).max(0.0));
    // The first iteration is the warm-up and the memory measurement.
    let _ = stage.iteration();
    let peak_bytes = probe.peak().zip(before).map(|(p, b)| (p - b).max(0.0));
    if let (Some(limit), Some(peak)) = (job.memory_limit_bytes, peak_bytes)
        && peak > limit
    {
        return StageMeasurement::out_of_memory(runtime(device), Some(peak));
    }
    stage.time_gathers();
    let mut sampler = Sampler::new(super::StoppingRule {
        warmup: 0,
        min_repetitions: job.iterations,
        max_repetitions: job.iterations,
        target_ci_rel: 0.0,
        max_seconds: f64::INFINITY,
    });
    let mut optimizer = 0.0;
    while !sampler.done() {
        let (scheduled, step) = stage.iteration();
        sampler.push(scheduled / job.micro_batches as f64);
        optimizer += step;
    }
    let summary = sampler.summary();
    StageMeasurement {
        time_per_microbatch_s: summary.mean,
        ci95_rel: summary.ci95_rel.is_finite().then_some(summary.ci95_rel),
        optimizer_step_s: optimizer / summary.n as f64,
        iterations: summary.n,
        static_bytes,
        peak_bytes,
        out_of_memory: false,
        runtime: runtime(device),
    }
}
