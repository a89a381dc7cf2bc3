//! The in-memory lookup the cost model reads measurements through: built
//! once from a [`Profile`], then queried without allocating (binary search
//! over pre-sorted vectors), so `cost::predict` stays pure and cheap.

use super::{CollectiveOp, LayerArch, LayerPoint, LayerStatus, Profile, SyncPoint, TokenPoint};
use crate::cluster::AttentionRates;
use crate::config::{Recompute, SyncMethod};
use crate::model::AttentionKind;

/// What a layer measurement is keyed by: the layer's shape and architecture
/// on its shard and the switches that change its work. The micro-batch is
/// the curve's axis.
///
/// The precision is not in the key: plans are for 16-bit training, so where
/// a shape was measured in 16 bits and in another precision, only the 16-bit
/// points are used (see [`Measurements::from_profile`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerShape {
    pub hidden: u64,
    pub heads: u64,
    pub arch: LayerArch,
    pub seq_len: u64,
    pub tp: u64,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
}

impl LayerShape {
    #[allow(clippy::type_complexity)]
    fn key(&self) -> ((u64, u64, u64, u64, bool, u8), (u64, u64, bool, u8)) {
        let recompute = match self.recompute {
            Recompute::None => 0,
            Recompute::Selective => 1,
            Recompute::Full => 2,
            Recompute::SelectiveOp => 3,
            Recompute::SelectiveLayer => 4,
        };
        let attention = match self.arch.attention {
            AttentionKind::Flash => 0,
            AttentionKind::Standard => 1,
        };
        (
            (
                self.hidden,
                self.heads,
                self.seq_len,
                self.tp,
                self.sequence_parallel,
                recompute,
            ),
            (
                self.arch.kv_heads,
                self.arch.ffn_hidden,
                self.arch.gated_mlp,
                attention,
            ),
        )
    }
}

/// Whether a layer table's free-form precision is a 16-bit one: a dtype
/// name (or alias) other than fp32, or the published tables' `16-bit`.
fn is_16_bit(dtype: &str) -> bool {
    dtype.trim().eq_ignore_ascii_case("16-bit")
        || dtype
            .parse::<super::Dtype>()
            .is_ok_and(|d| d != super::Dtype::Fp32)
}

/// A measured collective time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveLookup {
    pub seconds: f64,
    /// The size lies outside the measured sizes: the time was extrapolated.
    pub extrapolated: bool,
}

/// A measured layer time for one micro-batch, seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerLookup {
    pub forward: f64,
    pub backward: f64,
    /// Recomputation (zero when none was measured apart from the backward).
    pub recompute: f64,
    /// The micro-batch lies outside the measured ones: the times were
    /// scaled in proportion to it from the nearest measured micro-batch.
    pub extrapolated: bool,
    /// The times hold the tensor-parallel collectives (see `LayerPoint`).
    pub includes_tp_comm: bool,
}

impl LayerLookup {
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.recompute
    }
}

#[derive(Debug, Clone)]
struct Curve {
    op: CollectiveOp,
    ranks: u64,
    /// Strictly increasing.
    bytes: Vec<f64>,
    seconds: Vec<f64>,
}

#[derive(Debug, Clone)]
struct LayerCurve {
    shape: LayerShape,
    /// Strictly increasing.
    micro_batch: Vec<u64>,
    forward: Vec<f64>,
    backward: Vec<f64>,
    recompute: Vec<f64>,
    /// Of the curve's last point.
    includes_tp_comm: bool,
}

/// Measured curves per (collective, ranks) and layer times per shape, ready
/// for lookups.
#[derive(Debug, Clone, Default)]
pub struct Measurements {
    curves: Vec<Curve>,
    layers: Vec<LayerCurve>,
    /// 16-bit matrix multiplies from `profile device`: (m, n, k, FLOP/s).
    matmuls: Vec<(f64, f64, f64, f64)>,
    /// Measured copy bandwidth, bytes/s (read + written).
    copy_bandwidth: Option<f64>,
    /// 16-bit fused causal attention from `profile device`: (head width,
    /// forward FLOP/s, backward FLOP/s, mean keys per query row).
    attention: Vec<(u64, f64, f64, f64)>,
    /// Embedding-gradient synchronisations, sorted by (method, ranks,
    /// partitions, payload bytes).
    sync: Vec<SyncPoint>,
    /// Distinct rows per token batch, sorted by (vocab, tokens).
    tokens: Vec<TokenPoint>,
}

impl Measurements {
    /// Sorts and indexes a profile's points. Points without a usable time
    /// (non-positive or not finite sizes or times, `oom` layers) are left
    /// out; of two points at the same place the later one wins. Of a layer
    /// shape measured in 16 bits and in another precision (fp32 on a CPU),
    /// only the 16-bit points are used: they are what plans train in.
    pub fn from_profile(profile: &Profile) -> Self {
        let mut points: Vec<_> = profile
            .collectives
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                p.ranks >= 1
                    && p.bytes.is_finite()
                    && p.bytes > 0.0
                    && p.seconds.is_finite()
                    && p.seconds > 0.0
            })
            .collect();
        // Later points win: sort by place, then by position, and keep the last.
        points.sort_by(|(i, a), (j, b)| {
            (a.op, a.ranks)
                .cmp(&(b.op, b.ranks))
                .then(a.bytes.total_cmp(&b.bytes))
                .then(i.cmp(j))
        });
        let mut curves: Vec<Curve> = Vec::new();
        for (_, p) in points {
            match curves.last_mut() {
                Some(c) if c.op == p.op && c.ranks == p.ranks => {
                    if c.bytes.last() == Some(&p.bytes) {
                        *c.seconds.last_mut().expect("same length") = p.seconds;
                    } else {
                        c.bytes.push(p.bytes);
                        c.seconds.push(p.seconds);
                    }
                }
                _ => curves.push(Curve {
                    op: p.op,
                    ranks: p.ranks,
                    bytes: vec![p.bytes],
                    seconds: vec![p.seconds],
                }),
            }
        }

        let usable = |p: &LayerPoint| {
            p.status == LayerStatus::Ok
                && p.micro_batch >= 1
                && p.forward_s.is_finite()
                && p.backward_s.is_finite()
                && p.forward_s >= 0.0
                && p.backward_s >= 0.0
                && p.total_s() > 0.0
                && p.recompute_s.is_none_or(|r| r.is_finite() && r >= 0.0)
        };
        // Shapes with a usable 16-bit point: their other precisions step aside.
        let sixteen_bit_shapes: std::collections::HashSet<LayerShape> = profile
            .layers
            .iter()
            .filter(|p| is_16_bit(&p.dtype) && usable(p))
            .map(LayerPoint::shape)
            .collect();
        let mut layer_points: Vec<_> = profile
            .layers
            .iter()
            .enumerate()
            .filter(|(_, p)| {
                usable(p) && (is_16_bit(&p.dtype) || !sixteen_bit_shapes.contains(&p.shape()))
            })
            .collect();
        layer_points.sort_by(|(i, a), (j, b)| {
            a.shape()
                .key()
                .cmp(&b.shape().key())
                .then(a.micro_batch.cmp(&b.micro_batch))
                .then(i.cmp(j))
        });
        let mut layers: Vec<LayerCurve> = Vec::new();
        for (_, p) in layer_points {
            let recompute = p.recompute_s.unwrap_or(0.0);
            match layers.last_mut() {
                Some(l) if l.shape == p.shape() => {
                    l.includes_tp_comm = p.includes_tp_comm;
                    if l.micro_batch.last() == Some(&p.micro_batch) {
                        *l.forward.last_mut().expect("same length") = p.forward_s;
                        *l.backward.last_mut().expect("same length") = p.backward_s;
                        *l.recompute.last_mut().expect("same length") = recompute;
                    } else {
                        l.micro_batch.push(p.micro_batch);
                        l.forward.push(p.forward_s);
                        l.backward.push(p.backward_s);
                        l.recompute.push(recompute);
                    }
                }
                _ => layers.push(LayerCurve {
                    shape: p.shape(),
                    micro_batch: vec![p.micro_batch],
                    forward: vec![p.forward_s],
                    backward: vec![p.backward_s],
                    recompute: vec![recompute],
                    includes_tp_comm: p.includes_tp_comm,
                }),
            }
        }
        let (matmuls, copy_bandwidth, attention) = match &profile.device {
            Some(device) => (
                device
                    .matmul
                    .iter()
                    .filter(|p| p.dtype.bytes() == 2 && p.tflops.is_finite() && p.tflops > 0.0)
                    .map(|p| (p.m as f64, p.n as f64, p.k as f64, p.tflops * 1e12))
                    .collect(),
                device
                    .copy
                    .as_ref()
                    .map(|c| c.gbps * 1e9)
                    .filter(|b| b.is_finite() && *b > 0.0),
                device
                    .attention
                    .iter()
                    .filter(|p| p.dtype.bytes() == 2)
                    .map(|p| {
                        let (f, b) = (p.forward_tflops * 1e12, p.backward_tflops * 1e12);
                        // A causal row holds half the sequence on average.
                        (p.head_dim, f, b, (p.seq_len as f64 / 2.0).max(1.0))
                    })
                    .filter(|&(_, f, b, _)| f.is_finite() && f > 0.0 && b.is_finite() && b > 0.0)
                    .collect(),
            ),
            None => (Vec::new(), None, Vec::new()),
        };
        let mut sync: Vec<SyncPoint> = profile
            .sync
            .iter()
            .filter(|p| p.check().is_ok())
            .cloned()
            .collect();
        sync.sort_by(|a, b| {
            (a.method, a.ranks, a.partitions)
                .cmp(&(b.method, b.ranks, b.partitions))
                .then(a.payload_bytes().total_cmp(&b.payload_bytes()))
        });
        let mut tokens: Vec<TokenPoint> = profile
            .tokens
            .iter()
            .filter(|p| p.check().is_ok())
            .cloned()
            .collect();
        tokens.sort_by_key(|p| (p.vocab, p.tokens));
        Measurements {
            curves,
            layers,
            matmuls,
            copy_bandwidth,
            attention,
            sync,
            tokens,
        }
    }

    /// The measured time of synchronising `payload_bytes` of touched rows
    /// (the whole table's for all-reduce) between `ranks` processes by
    /// `method` over `partitions` shards (0 but for the parameter server):
    /// interpolated log-log between the two nearest measured payloads, and
    /// only inside the measured range (or within a quarter of its ends).
    pub fn sync_seconds(
        &self,
        method: SyncMethod,
        ranks: u64,
        partitions: u64,
        payload_bytes: f64,
    ) -> Option<f64> {
        let points = self
            .sync
            .iter()
            .filter(|p| p.method == method && p.ranks == ranks && p.partitions == partitions)
            .map(|p| (p.payload_bytes(), p.seconds));
        // A payload within a quarter of a measured end is covered by it, its
        // time scaled in proportion (the rows' bytes dominate).
        log_log_within(points, payload_bytes, 1.25)
    }

    /// The parameter-server shard counts measured between `ranks` processes.
    pub fn sync_partitions(&self, ranks: u64) -> impl Iterator<Item = u64> + '_ {
        let mut last = 0;
        self.sync
            .iter()
            .filter(move |p| p.method == SyncMethod::ParameterServer && p.ranks == ranks)
            .map(|p| p.partitions)
            .filter(move |&p| std::mem::replace(&mut last, p) != p)
    }

    /// Measured distinct rows a batch of `tokens` ids over a vocabulary of
    /// `vocab` touches (`profile tokens`), interpolated log-log inside the
    /// measured batch sizes.
    pub fn distinct_rows(&self, vocab: u64, tokens: f64) -> Option<f64> {
        let points = self
            .tokens
            .iter()
            .filter(|p| p.vocab == vocab)
            .map(|p| (p.tokens as f64, p.distinct));
        log_log_within(points, tokens, 1.0)
    }

    /// The measured (tokens, distinct) point of `vocab` nearest `tokens`
    /// outside the measured batch sizes: the first below them, the last
    /// above; none inside them or without points.
    pub fn nearest_token_point(&self, vocab: u64, tokens: f64) -> Option<(f64, f64)> {
        let mut points = self.tokens.iter().filter(|p| p.vocab == vocab);
        let first = points.next()?;
        let last = points.next_back().unwrap_or(first);
        if tokens < first.tokens as f64 {
            Some((first.tokens as f64, first.distinct))
        } else if tokens > last.tokens as f64 {
            Some((last.tokens as f64, last.distinct))
        } else {
            None
        }
    }

    /// The fraction of `peak_flops` the measured 16-bit matrix multiplies
    /// reach once the shape's own inefficiency (`fill(d) = d / (d + d_half)`
    /// per dimension, the cost model's) and the store of the 16-bit result
    /// at `store_bytes_per_s` (which the cost model adds after the main
    /// loop) are taken out: the best over the sweep. `None` without a
    /// 16-bit sweep.
    pub fn gemm_peak_fraction(
        &self,
        peak_flops: f64,
        dim_half: f64,
        store_bytes_per_s: f64,
    ) -> Option<f64> {
        let fill = |d: f64| d / (d + dim_half);
        self.matmuls
            .iter()
            .filter_map(|&(m, n, k, flops)| {
                let work = 2.0 * m * n * k;
                let main_loop = work / flops - 2.0 * m * n / store_bytes_per_s;
                (main_loop > 0.0)
                    .then(|| work / main_loop / (peak_flops * fill(m) * fill(n) * fill(k)))
            })
            .reduce(f64::max)
            .map(|f| f.min(1.0))
    }

    /// The fused-attention rates `profile device` measured in 16 bits, as
    /// fractions of `peak_flops`, where it measured every head width the
    /// cost model reads ([`AttentionRates::HEAD_DIMS`]); of two points at
    /// one width the later wins.
    pub fn attention_rates(&self, peak_flops: f64) -> Option<AttentionRates> {
        let at = |width: u64| {
            self.attention.iter().rev().find(|p| p.0 == width).map(
                |&(_, forward, backward, row)| (forward / peak_flops, backward / peak_flops, row),
            )
        };
        let [narrow, wide] = AttentionRates::HEAD_DIMS.map(at);
        let (narrow, wide) = (narrow?, wide?);
        Some(AttentionRates {
            forward: [narrow.0, wide.0].map(|f| f.min(1.0)),
            backward: [narrow.1, wide.1].map(|f| f.min(1.0)),
            row_keys: [narrow.2, wide.2],
        })
    }

    /// Whether `profile device` measured 16-bit matrix multiplies or a copy.
    pub fn has_device_sweep(&self) -> bool {
        !self.matmuls.is_empty() || self.copy_bandwidth.is_some()
    }

    /// The fraction of `hbm_bandwidth` the measured copy reached.
    pub fn hbm_fraction(&self, hbm_bandwidth: f64) -> Option<f64> {
        self.copy_bandwidth.map(|b| (b / hbm_bandwidth).min(1.0))
    }

    pub fn is_empty(&self) -> bool {
        self.curves.is_empty() && self.layers.is_empty() && self.matmuls.is_empty()
    }

    /// Measured (collective, ranks) curves with their size ranges in bytes.
    pub fn curves(&self) -> impl Iterator<Item = (CollectiveOp, u64, f64, f64)> + '_ {
        self.curves.iter().map(|c| {
            (
                c.op,
                c.ranks,
                c.bytes[0],
                *c.bytes.last().expect("curves are never empty"),
            )
        })
    }

    /// Measured layer shapes with their micro-batch ranges.
    pub fn layer_shapes(&self) -> impl Iterator<Item = (LayerShape, u64, u64)> + '_ {
        self.layers.iter().map(|l| {
            (
                l.shape,
                l.micro_batch[0],
                *l.micro_batch.last().expect("curves are never empty"),
            )
        })
    }

    /// Whether a curve for `op` over `ranks` was measured.
    pub fn has_curve(&self, op: CollectiveOp, ranks: u64) -> bool {
        self.curve(op, ranks).is_some()
    }

    fn curve(&self, op: CollectiveOp, ranks: u64) -> Option<&Curve> {
        self.curves
            .binary_search_by(|c| (c.op, c.ranks).cmp(&(op, ranks)))
            .ok()
            .map(|i| &self.curves[i])
    }

    /// Time of one send/receive of `bytes` between two GPUs of a node, from
    /// the measured send/receive curve with the fewest ranks (nccl-tests'
    /// `sendrecv_perf` times one message per rank), if there is one.
    pub fn send_recv(&self, bytes: f64) -> Option<CollectiveLookup> {
        // Curves are sorted by (op, ranks): the first send/receive curve has the fewest.
        let curve = self
            .curves
            .iter()
            .find(|c| c.op == CollectiveOp::SendRecv)?;
        Some(curve.at(bytes))
    }

    /// Time of `op` over `bytes` among `ranks` GPUs, if that (op, ranks)
    /// curve was measured.
    ///
    /// Inside the measured sizes the time is interpolated linearly in
    /// log(bytes) between the two neighbouring points. Beyond them it is
    /// extrapolated with the bandwidth of the nearest two points, taken a
    /// factor of about two apart so that a finely sampled curve's noise does
    /// not set the slope: above the range, the incremental bandwidth between
    /// the largest point and the point nearest half its size carries the
    /// time on (`t = t_n + (b - b_n) / bw`); below it, the same between the
    /// smallest point and the point nearest twice its size carries it back
    /// (`t = t_0 - (b_0 - b) / bw`, never below the smallest point's
    /// algorithmic bandwidth would give, `t_0 b / b_0`). Where that
    /// bandwidth is not positive (noise), the end point's algorithmic
    /// bandwidth is used above the range and its time below it.
    pub fn collective(&self, op: CollectiveOp, ranks: u64, bytes: f64) -> Option<CollectiveLookup> {
        let curve = self.curve(op, ranks)?;
        Some(curve.at(bytes))
    }

    /// Measured times of a layer of `shape` at `micro_batch`, if the shape
    /// was measured. Between measured micro-batches the times are
    /// interpolated linearly; beyond them they are scaled in proportion to
    /// the micro-batch from the nearest measured one.
    pub fn layer(&self, shape: &LayerShape, micro_batch: u64) -> Option<LayerLookup> {
        let key = shape.key();
        let i = self
            .layers
            .binary_search_by(|l| l.shape.key().cmp(&key))
            .ok()?;
        Some(self.layers[i].at(micro_batch))
    }
}

impl Curve {
    fn at(&self, b: f64) -> CollectiveLookup {
        let (x, t) = (&self.bytes, &self.seconds);
        let n = x.len();
        let last = n - 1;
        let inside = |seconds: f64| CollectiveLookup {
            seconds,
            extrapolated: false,
        };
        let outside = |seconds: f64| CollectiveLookup {
            seconds,
            extrapolated: true,
        };
        if b > x[last] {
            let p = nearest_in_log(x, x[last] / 2.0);
            let bw = incremental_bandwidth(x[p], t[p], x[last], t[last]);
            return outside(match bw {
                Some(bw) => t[last] + (b - x[last]) / bw,
                None => t[last] * b / x[last],
            });
        }
        if b < x[0] {
            let p = nearest_in_log(x, x[0] * 2.0);
            let floor = t[0] * b / x[0];
            return outside(match incremental_bandwidth(x[0], t[0], x[p], t[p]) {
                Some(bw) => (t[0] - (x[0] - b) / bw).max(floor),
                None => t[0],
            });
        }
        // x[0] <= b <= x[last]: the first point not below b.
        let i = x.partition_point(|&v| v < b);
        if x[i] == b {
            return inside(t[i]);
        }
        let (x0, x1, t0, t1) = (x[i - 1], x[i], t[i - 1], t[i]);
        let w = (b / x0).ln() / (x1 / x0).ln();
        inside(t0 + w * (t1 - t0))
    }
}

/// Index of the point whose size is nearest `target` in log scale.
fn nearest_in_log(x: &[f64], target: f64) -> usize {
    let i = x.partition_point(|&v| v < target);
    if i == 0 {
        return 0;
    }
    if i == x.len() {
        return x.len() - 1;
    }
    if (target / x[i - 1]).ln() <= (x[i] / target).ln() {
        i - 1
    } else {
        i
    }
}

/// Bytes per second between two points, if positive and finite.
fn incremental_bandwidth(x0: f64, t0: f64, x1: f64, t1: f64) -> Option<f64> {
    let bw = (x1 - x0) / (t1 - t0);
    (x1 > x0 && bw.is_finite() && bw > 0.0).then_some(bw)
}

impl LayerCurve {
    fn at(&self, mb: u64) -> LayerLookup {
        let m = &self.micro_batch;
        let last = m.len() - 1;
        let scaled = |i: usize| {
            let factor = mb as f64 / m[i] as f64;
            LayerLookup {
                forward: self.forward[i] * factor,
                backward: self.backward[i] * factor,
                recompute: self.recompute[i] * factor,
                extrapolated: true,
                includes_tp_comm: self.includes_tp_comm,
            }
        };
        if mb > m[last] {
            return scaled(last);
        }
        if mb < m[0] {
            return scaled(0);
        }
        let i = m.partition_point(|&v| v < mb);
        let exact = |i: usize| LayerLookup {
            forward: self.forward[i],
            backward: self.backward[i],
            recompute: self.recompute[i],
            extrapolated: false,
            includes_tp_comm: self.includes_tp_comm,
        };
        if m[i] == mb {
            return exact(i);
        }
        let w = (mb - m[i - 1]) as f64 / (m[i] - m[i - 1]) as f64;
        let lerp = |v: &[f64]| v[i - 1] + w * (v[i] - v[i - 1]);
        LayerLookup {
            forward: lerp(&self.forward),
            backward: lerp(&self.backward),
            recompute: lerp(&self.recompute),
            extrapolated: false,
            includes_tp_comm: self.includes_tp_comm,
        }
    }
}

/// `y` at `x` among `points` sorted by x: log-log between the two beside
/// it; outside them, within a factor `near` of the nearer end, that end's
/// y scaled in proportion to x; none further out or without points.
fn log_log_within(mut points: impl Iterator<Item = (f64, f64)>, x: f64, near: f64) -> Option<f64> {
    let first = points.next()?;
    if x < first.0 {
        return (x * near >= first.0).then(|| first.1 * x / first.0);
    }
    let mut below = first;
    for above in std::iter::once(first).chain(points) {
        if above.0 >= x {
            return Some(log_log(below, above, x));
        }
        below = above;
    }
    (x <= below.0 * near).then(|| below.1 * x / below.0)
}

/// `y` at `x` on the straight line through two points in log-log space
/// (the lower point itself when they coincide).
fn log_log((x0, y0): (f64, f64), (x1, y1): (f64, f64), x: f64) -> f64 {
    if x1 <= x0 {
        return y1;
    }
    let t = (x / x0).ln() / (x1 / x0).ln();
    (y0.ln() + t * (y1 / y0).ln()).exp()
}
