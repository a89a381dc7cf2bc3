//! Sparse-aware synchronisation of an untied input embedding (Parallax,
//! Kim et al., EuroSys'19). The gradient of a token embedding touches only
//! the rows of the tokens a rank's batch holds; a dense all-reduce moves the
//! whole table anyway. Two sparse methods move just the touched rows:
//!
//! - sparse all-gather (PyTorch DDP with `nn.Embedding(sparse=True)`,
//!   DeepSpeed's `sparse_gradients`): every rank gathers every rank's rows
//!   and their indices, then sums them locally. Its traffic grows with the
//!   ranks: `(R - 1) k` rows arrive at each rank.
//! - parameter server (Parallax's sparse path): the table is split by row
//!   over `p` of the ranks; each rank pushes its `k` rows to their owners,
//!   which sum and update them, and pulls the updated rows back. Parallax
//!   chooses `p` from `t(p) = a / p + b (p - 1) + c`: the servers' share of
//!   all ranks' rows, a message per further server, and what every rank
//!   pays regardless. Here `a`, `b`, `c` come from the link, or are fitted to
//!   `profile sync`'s measured points where it measured three or more `p`.

use super::comm::{self, Collective};
use super::kernels::memory_pass;
use super::memory::{ParamGroup, reduced_gradient_bytes};
use super::{ProfileUsage, Scenario};
use crate::config::{ParallelConfig, SyncMethod};

/// Bytes of one row index in a sparse gradient: PyTorch's COO indices are
/// int64.
const INDEX_BYTES: f64 = 8.0;

/// Ranks of the frequency law summed term by term; beyond them the sum is
/// integrated (the terms vary slowly there).
const EXACT_RANKS: u64 = 32;
/// Simpson intervals over log-rank for the rest (even).
const SIMPSON_INTERVALS: u32 = 48;
/// Messages a rank exchanges with one server per sync: a row count, the
/// indices and the rows pushed, the updated rows pulled.
const MESSAGES_PER_SERVER: f64 = 4.0;
/// Measured parameter-server shard counts one lookup reads at most.
const MEASURED_PARTITIONS: usize = 64;

/// Expected distinct ids among `tokens` independent draws from a
/// vocabulary of `vocab` ids whose frequencies follow Zipf's law with
/// `exponent` (P(rank r) ~ r^-s): `sum_r 1 - (1 - p_r)^tokens`, exact for
/// the most frequent ids and integrated over log-rank for the rest.
/// Allocation-free; about a hundred transcendental calls.
pub fn zipf_distinct(vocab: f64, tokens: f64, exponent: f64) -> f64 {
    if vocab < 1.0 || tokens <= 0.0 {
        return 0.0;
    }
    let s = exponent;
    let exact = (EXACT_RANKS as f64).min(vocab.floor());
    let mass = |r: f64| r.powf(-s);
    // The normaliser: exact terms, then the integral of x^-s over the
    // ranks after them (midpoint rule: rank r covers [r - 1/2, r + 1/2]).
    let mut norm: f64 = (1..=exact as u64).map(|r| mass(r as f64)).sum();
    let (lo, hi) = (exact + 0.5, vocab + 0.5);
    if vocab > exact {
        norm += if (s - 1.0).abs() < 1e-9 {
            (hi / lo).ln()
        } else {
            (hi.powf(1.0 - s) - lo.powf(1.0 - s)) / (1.0 - s)
        };
    }
    // 1 - (1 - p)^n, stable for small p.
    let touched = |p: f64| -(tokens * (-p.min(1.0)).ln_1p()).exp_m1();
    let mut distinct: f64 = (1..=exact as u64)
        .map(|r| touched(mass(r as f64) / norm))
        .sum();
    if vocab > exact {
        // Over t = ln x the ranks have density e^t.
        let (t0, t1) = (lo.ln(), hi.ln());
        let h = (t1 - t0) / SIMPSON_INTERVALS as f64;
        let g = |t: f64| t.exp() * touched((-s * t).exp() / norm);
        let inner: f64 = (1..SIMPSON_INTERVALS)
            .map(|i| {
                let weight = if i % 2 == 1 { 4.0 } else { 2.0 };
                weight * g(t0 + i as f64 * h)
            })
            .sum();
        distinct += h / 3.0 * (g(t0) + inner + g(t1));
    }
    distinct.min(vocab).min(tokens)
}

/// Tokens one data-parallel rank's batches of one iteration hold (its
/// context-parallel share of the sequence): the gradient accumulates over
/// the micro-batches and is synchronised once.
fn tokens_per_rank(s: &Scenario, c: &ParallelConfig) -> f64 {
    s.global_batch as f64 / c.dp as f64 * (s.model.seq_len / c.cp.max(1)) as f64
}

/// Distinct rows of this rank's shard of the input embedding that its
/// tokens of one iteration touch: measured by `profile tokens` where the
/// profile covers the vocabulary and batch; Zipf's law with
/// `token_zipf_exponent` otherwise, through the nearest measured batch
/// where the vocabulary was measured at other sizes (the law's shape, the
/// data's level); a tensor-parallel shard holds its share of them.
pub fn touched_rows(s: &Scenario, c: &ParallelConfig) -> f64 {
    let tokens = tokens_per_rank(s, c);
    let vocab = s.model.vocab;
    let zipf = |n: f64| zipf_distinct(vocab as f64, n, s.coef().token_zipf_exponent);
    let distinct = match s.profile {
        Some(p) => match (
            p.distinct_rows(vocab, tokens),
            p.nearest_token_point(vocab, tokens),
        ) {
            (Some(measured), _) => measured,
            (None, Some((n, d))) => (zipf(tokens) * d / zipf(n)).min(vocab as f64).min(tokens),
            (None, None) => zipf(tokens),
        },
        None => zipf(tokens),
    };
    (distinct / c.tp as f64).max(1.0)
}

/// Parallax's parameter-server cost curve `t(p) = a / p + b (p - 1) + c`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServerCurve {
    /// All ranks' rows through the servers, shared by the p of them.
    pub a: f64,
    /// One more server: a message out and one back from every rank.
    pub b: f64,
    /// What every rank pays whatever p.
    pub c: f64,
}

impl ServerCurve {
    pub fn at(&self, p: f64) -> f64 {
        self.a / p + self.b * (p - 1.0) + self.c
    }

    /// The best whole number of servers among `1..=ranks`, and its time:
    /// the curve is convex, so the integers beside `sqrt(a / b)` hold it.
    pub fn best(&self, ranks: u64) -> (u64, f64) {
        let ranks = ranks.max(1);
        let stationary = if self.b > 0.0 {
            (self.a.max(0.0) / self.b).sqrt()
        } else {
            ranks as f64
        };
        let below = (stationary.floor() as u64).clamp(1, ranks);
        let above = (stationary.ceil() as u64).clamp(1, ranks);
        [below, above]
            .into_iter()
            .map(|p| (p, self.at(p as f64)))
            .fold(
                (1, f64::INFINITY),
                |best, x| if x.1 < best.1 { x } else { best },
            )
    }

    /// The least-squares curve through measured `(p, seconds)` points; none
    /// with fewer than three distinct p (three unknowns).
    pub fn fit(points: &[(f64, f64)]) -> Option<ServerCurve> {
        let distinct = points
            .iter()
            .enumerate()
            .filter(|&(i, &(p, _))| points[..i].iter().all(|&(q, _)| q != p))
            .count();
        if distinct < 3 {
            return None;
        }
        // Normal equations of t = a x + b y + c with x = 1/p, y = p - 1.
        let mut m = [[0.0_f64; 4]; 3];
        for &(p, t) in points {
            let row = [1.0 / p, p - 1.0, 1.0];
            for i in 0..3 {
                for j in 0..3 {
                    m[i][j] += row[i] * row[j];
                }
                m[i][3] += row[i] * t;
            }
        }
        let [a, b, c] = solve3(m)?;
        Some(ServerCurve { a, b, c })
    }
}

/// Gaussian elimination with partial pivoting on an augmented 3 x 4 matrix.
fn solve3(mut m: [[f64; 4]; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| m[i][col].abs().total_cmp(&m[j][col].abs()))?;
        if m[pivot][col].abs() < 1e-300 {
            return None;
        }
        m.swap(col, pivot);
        let pivot_row = m[col];
        for (row, values) in m.iter_mut().enumerate() {
            if row != col {
                let f = values[col] / pivot_row[col];
                for (value, p) in values.iter_mut().zip(pivot_row).skip(col) {
                    *value -= f * p;
                }
            }
        }
    }
    let x = [m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]];
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// One embedding group's synchronisation by one method.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct EmbeddingSync {
    pub method: SyncMethod,
    /// Parameter servers (0 for the other methods).
    pub partitions: u64,
    /// Rows of this rank's shard touched per iteration.
    pub rows: f64,
    /// Rows of this rank's shard.
    pub table_rows: f64,
    pub ranks: u64,
    pub seconds: f64,
    /// Timed from `profile sync`'s points rather than the link.
    pub measured: bool,
}

/// The input embedding's sync by each method, for explanations: none when
/// the gradient is dense (tied to the head), there is no data-parallel
/// group, or its collectives run per micro-batch (FSDP / ZeRO-3), which
/// no sparse method can carry.
pub fn embedding_sync_options(s: &Scenario, c: &ParallelConfig) -> Option<[EmbeddingSync; 3]> {
    if s.model.tied_embeddings || c.dense_sync_degree() < 2 || comm::syncs_per_microbatch(c) {
        return None;
    }
    let sparse = ParallelConfig {
        embedding_sync: SyncMethod::ParameterServer,
        ..*c
    };
    let group = super::memory::parameter_groups(s, &sparse, 0)[3];
    let mut usage = ProfileUsage::default();
    Some(SyncMethod::ALL.map(|m| sparse_sync(s, c, &group, m, &mut usage)))
}

/// The bytes of one gradient row as synchronised.
fn row_bytes(s: &Scenario, c: &ParallelConfig) -> f64 {
    s.model.hidden as f64 * reduced_gradient_bytes(s, c)
}

/// `group` (the input embedding of stage 0) synchronised by `method` over
/// its ranks: dense as the sharding runs it, or by a sparse method.
pub fn sparse_sync(
    s: &Scenario,
    c: &ParallelConfig,
    group: &ParamGroup,
    method: SyncMethod,
    usage: &mut ProfileUsage,
) -> EmbeddingSync {
    let ranks = group.ranks;
    let rows = touched_rows(s, c);
    let table_rows = group.params / s.model.hidden as f64;
    let row = row_bytes(s, c);
    let payload = rows * row;
    // Points measured between processes of one machine cover a group
    // within one node of as many ranks.
    let measured = |method, partitions, payload| {
        s.profile
            .filter(|_| group.span.nodes == 1)
            .and_then(|p| p.sync_seconds(method, ranks, partitions, payload))
    };
    let mut result = EmbeddingSync {
        method,
        partitions: 0,
        rows,
        table_rows,
        ranks,
        seconds: 0.0,
        measured: false,
    };
    match method {
        SyncMethod::AllReduce => {
            // The dense sync as the sharding runs it: all-reduce, or
            // reduce-scatter and all-gather under the distributed optimizer.
            let bytes = group.params * reduced_gradient_bytes(s, c);
            let unsharded = c.optimizer_sharding == crate::config::OptimizerSharding::None;
            match measured(SyncMethod::AllReduce, 0, bytes).filter(|_| unsharded) {
                Some(t) => (result.seconds, result.measured) = (t, true),
                None => {
                    let (grads, gather) = comm::dense_group_sync(s, c, group, usage);
                    result.seconds = grads + gather;
                }
            }
        }
        SyncMethod::SparseAllGather => match measured(method, 0, payload) {
            Some(t) => (result.seconds, result.measured) = (t, true),
            None => {
                // DDP gathers each rank's row count, then the indices, then
                // the rows, and sums what it gathered (read each row,
                // accumulate it).
                let r = ranks as f64;
                let mut gather =
                    |bytes| comm::collective(s, Collective::AllGather, group.span, bytes, usage);
                result.seconds = gather(r * INDEX_BYTES)
                    + gather(r * rows * INDEX_BYTES)
                    + gather(r * rows * row)
                    + memory_pass(s, 2.0 * r * rows * row);
            }
        },
        SyncMethod::ParameterServer => {
            let (partitions, seconds, from_profile) = parameter_server(s, c, group, rows, payload);
            result.partitions = partitions;
            result.seconds = seconds;
            result.measured = from_profile;
        }
    }
    if result.measured {
        usage.sync_lookups += 1;
    }
    result
}

/// The parameter server's partition count and time: from the measured
/// points of these ranks (fitted when three or more counts were measured,
/// the best measured otherwise), or from the link's curve.
fn parameter_server(
    s: &Scenario,
    c: &ParallelConfig,
    group: &ParamGroup,
    rows: f64,
    payload: f64,
) -> (u64, f64, bool) {
    let ranks = group.ranks;
    if let Some(profile) = s.profile.filter(|_| group.span.nodes == 1) {
        // On the stack: predict does not allocate.
        let mut buffer = [(0.0, 0.0); MEASURED_PARTITIONS];
        let mut n = 0;
        for p in profile.sync_partitions(ranks).take(MEASURED_PARTITIONS) {
            if let Some(t) = profile.sync_seconds(SyncMethod::ParameterServer, ranks, p, payload) {
                buffer[n] = (p as f64, t);
                n += 1;
            }
        }
        let points = &buffer[..n];
        if let Some(curve) = ServerCurve::fit(points) {
            let (p, t) = curve.best(ranks);
            return (p, t, true);
        }
        if let Some(&(p, t)) = points.iter().min_by(|a, b| a.1.total_cmp(&b.1)) {
            return (p as u64, t, true);
        }
    }
    let (p, t) = server_curve(s, c, group, rows, &mut ProfileUsage::default()).best(ranks);
    (p, t, false)
}

/// The parameter server's curve from the link: servers receive every
/// rank's rows with their indices and send the updated rows back (a / p),
/// summing and updating them in memory; a rank exchanges four messages
/// with each server (a row count, the indices and the rows out, the updated
/// rows back: b per further server), and every rank's first exchange pays
/// them too (c).
pub fn server_curve(
    s: &Scenario,
    c: &ParallelConfig,
    group: &ParamGroup,
    rows: f64,
    usage: &mut ProfileUsage,
) -> ServerCurve {
    let row = row_bytes(s, c);
    let ranks = group.ranks as f64;
    let bandwidth = comm::point_to_point_bandwidth(s, group.span);
    let exchange = MESSAGES_PER_SERVER * comm::message_time(s, group.span, INDEX_BYTES, usage);
    // Push (row and index) and pull (row) through the servers' links; the
    // servers read the pushed rows and read and write their table rows.
    let through_servers = ranks * rows * (2.0 * row + INDEX_BYTES) / bandwidth;
    let update = memory_pass(s, 3.0 * ranks * rows * row);
    ServerCurve {
        a: through_servers + update,
        b: exchange,
        c: exchange,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sum itself, term by term.
    fn exact(vocab: u64, tokens: f64, s: f64) -> f64 {
        let norm: f64 = (1..=vocab).map(|r| (r as f64).powf(-s)).sum();
        (1..=vocab)
            .map(|r| 1.0 - (1.0 - (r as f64).powf(-s) / norm).powf(tokens))
            .sum()
    }

    #[test]
    fn zipf_distinct_matches_the_exact_sum() {
        for vocab in [1_000, 50_257, 256_000] {
            for tokens in [10.0, 1_000.0, 100_000.0, 10_000_000.0] {
                for s in [0.7, 1.0, 1.3] {
                    let (got, want) = (
                        zipf_distinct(vocab as f64, tokens, s),
                        exact(vocab, tokens, s),
                    );
                    assert!(
                        (got - want).abs() <= 0.005 * want + 0.5,
                        "V {vocab} n {tokens} s {s}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn zipf_distinct_is_bounded_by_the_vocabulary_and_the_tokens() {
        assert_eq!(zipf_distinct(100.0, 0.0, 1.0), 0.0);
        assert!(zipf_distinct(100.0, 5.0, 1.0) <= 5.0);
        assert!((zipf_distinct(100.0, 1e9, 1.0) - 100.0).abs() < 1e-6);
    }

    #[test]
    fn the_best_server_count_minimises_the_curve() {
        let curve = ServerCurve {
            a: 64.0,
            b: 1.0,
            c: 3.0,
        };
        let (p, t) = curve.best(100);
        assert_eq!(p, 8);
        for q in 1..=100 {
            assert!(curve.at(q as f64) >= t - 1e-12);
        }
        assert_eq!(curve.best(4).0, 4, "clamped to the ranks");
        let flat = ServerCurve {
            a: 1.0,
            b: 0.0,
            c: 0.0,
        };
        assert_eq!(flat.best(16).0, 16, "free servers: all of them");
    }

    #[test]
    fn a_curve_fitted_to_its_own_points_comes_back() {
        let curve = ServerCurve {
            a: 2.0,
            b: 0.1,
            c: 0.5,
        };
        let points: Vec<_> = [1.0, 2.0, 4.0, 8.0].map(|p| (p, curve.at(p))).to_vec();
        let fitted = ServerCurve::fit(&points).unwrap();
        for (got, want) in [(fitted.a, 2.0), (fitted.b, 0.1), (fitted.c, 0.5)] {
            assert!((got - want).abs() < 1e-9, "{fitted:?}");
        }
        assert!(
            ServerCurve::fit(&points[..2]).is_none(),
            "two counts cannot fit three unknowns"
        );
    }
}
