//! `profile tokens` and `profile sync`: what a sparse embedding sync needs
//! measured, the rows a batch touches and the syncs' times, into a profile.

use super::args::{ProfileSyncArgs, ProfileTokensArgs};
use super::measure::{check_out, local_ranks, run_worker, timeout};
use super::profile_dir::{open_profile, record_provenance};
use super::render::{emit, thousands};
use anyhow::{Result, anyhow, bail};
use paratune::choice::Choice;
use paratune::config::SyncMethod;
use paratune::profile::tokens::{default_batch_sizes, distinct_per_batch, read_token_ids};
use paratune::profile::{SyncPoint, TokenPoint, merge_syncs, merge_tokens, write_profile};
use paratune::validate::sync_sweep::{self, SyncSweep};
use paratune::validate::torch_launch::TrialDevice;
use paratune::validate::torch_launch::worker_failure;
use std::fmt::Write as _;

pub fn profile_tokens(args: &ProfileTokensArgs) -> Result<()> {
    let ids = read_token_ids(&args.data, args.vocab).map_err(|e| anyhow!("--data {e}"))?;
    let sizes = args
        .batch_tokens
        .clone()
        .unwrap_or_else(|| default_batch_sizes(ids.len()));
    let points = distinct_per_batch(&ids, args.vocab, &sizes);
    if points.is_empty() {
        bail!(
            "--batch-tokens: every size is longer than the {} ids of {}; give sizes up to {}",
            ids.len(),
            args.data.display(),
            ids.len()
        );
    }
    let out = &args.provenance.out;
    check_out(out)?;
    let mut profile = open_profile(&args.provenance, None)?;
    merge_tokens(&mut profile.tokens, &points);
    record_provenance(
        &mut profile,
        &args.provenance,
        &[format!(
            "tokens: distinct ids per batch of consecutive ids of {} ({} ids, vocabulary {}), `paratune profile tokens`",
            args.data.display(),
            ids.len(),
            args.vocab
        )],
    );
    write_profile(out, &profile)?;
    emit(&tokens_report(&points, ids.len(), out))
}

fn tokens_report(points: &[TokenPoint], ids: usize, out: &std::path::Path) -> String {
    let mut text = String::new();
    let vocab = points[0].vocab;
    let _ = writeln!(
        text,
        "{}: distinct rows per batch of a {} id stream over a vocabulary of {}",
        out.display(),
        thousands(ids as f64),
        thousands(vocab as f64)
    );
    let _ = writeln!(
        text,
        "  {:>12} {:>12} {:>8} {:>8}",
        "tokens", "distinct", "of vocab", "batches"
    );
    for p in points {
        let _ = writeln!(
            text,
            "  {:>12} {:>12.1} {:>7.2}% {:>8}",
            thousands(p.tokens as f64),
            p.distinct,
            100.0 * p.distinct / vocab as f64,
            p.batches
        );
    }
    if let Some((s, error)) = paratune::calibrate::tokens::fit_zipf_exponent(points) {
        let prior = paratune::coefficients::Coefficients::info("token_zipf_exponent")
            .map_or(1.0, |i| i.prior);
        let _ = writeln!(
            text,
            "  Zipf exponent fitted to these batches: {s:.3} (rms error {:.1}%; the cost model's prior token_zipf_exponent is {prior})",
            100.0 * error
        );
    }
    text
}

pub fn profile_sync(args: &ProfileSyncArgs) -> Result<()> {
    let ranks = args.ranks;
    let device = local_ranks(
        &args.device,
        ranks,
        "profile sync runs",
        "a synchronisation",
    )?;
    if let Some(p) = args
        .partitions
        .as_deref()
        .and_then(|ps| ps.iter().find(|&&p| p > ranks))
    {
        bail!("--partitions {p}: a parameter server has 1 to --ranks {ranks} shards");
    }
    if !(args.zipf_exponent.is_finite() && args.zipf_exponent > 0.0) {
        bail!(
            "--zipf-exponent {}: give a positive exponent (about 1 for text)",
            args.zipf_exponent
        );
    }
    let methods: Vec<SyncMethod> = match &args.methods {
        None => SyncMethod::ALL.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| SyncMethod::parse("--methods", n).map_err(|e| anyhow!(e)))
            .collect::<Result<_>>()?,
    };
    let timeout = timeout(args.timeout)?;
    let out = &args.provenance.out;
    check_out(out)?;
    let detected = (device == TrialDevice::Cpu).then_some("cpu");
    let mut profile = open_profile(&args.provenance, detected)?;
    let scratch = tempfile::tempdir()?;
    let dir = std::path::absolute(scratch.path())?;
    let token_file = match &args.data {
        None => None,
        Some(path) => {
            // The worker reads text, one id per line.
            let ids = read_token_ids(path, args.vocab).map_err(|e| anyhow!("--data {e}"))?;
            let text: String = ids.iter().map(|id| format!("{id}\n")).collect();
            let file = dir.join("tokens.txt");
            paratune::atomic::write_atomically(&file, text.as_bytes())?;
            Some(file)
        }
    };
    let sweep = SyncSweep {
        vocab: args.vocab,
        hidden: args.hidden,
        tokens_per_rank: args.tokens_per_rank.clone(),
        methods: methods
            .iter()
            .map(|&m| sync_sweep::worker_method(m).to_string())
            .collect(),
        partitions: args.partitions.clone().unwrap_or_default(),
        zipf_exponent: token_file.is_none().then_some(args.zipf_exponent),
        token_file,
        warmup: 2,
        iterations: args.iterations,
    };
    let job = sync_sweep::sync_sweep_job(device, ranks, sweep, &dir);
    let label = format!("profile sync --ranks {ranks}");
    run_worker(&args.python, ranks, &job, &dir, timeout, &label)?;
    let points =
        sync_sweep::read_sync(&dir).map_err(|e| worker_failure(&label, &e.to_string(), &dir))?;
    let tokens = match &args.data {
        Some(path) => format!("batches of {}", path.display()),
        None => format!("ids drawn from Zipf's law, exponent {}", args.zipf_exponent),
    };
    record_provenance(
        &mut profile,
        &args.provenance,
        &[format!(
            "sync: embedding-gradient syncs of a {} x {} fp32 table between {ranks} local torch.distributed ranks ({}), {tokens}, median of {} (`paratune profile sync`)",
            args.vocab,
            args.hidden,
            device.backend(),
            args.iterations
        )],
    );
    merge_syncs(&mut profile.sync, &points);
    write_profile(out, &profile)?;
    emit(&sync_report(&points, out))
}

fn sync_report(points: &[SyncPoint], out: &std::path::Path) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{}: {} embedding-sync points",
        out.display(),
        points.len()
    );
    let _ = writeln!(
        text,
        "  {:<18} {:>5} {:>10} {:>12} {:>12}",
        "method", "p", "rows", "payload", "time"
    );
    for p in points {
        let _ = writeln!(
            text,
            "  {:<18} {:>5} {:>10.1} {:>12} {:>12}",
            p.method.name(),
            if p.partitions == 0 {
                "-".to_string()
            } else {
                p.partitions.to_string()
            },
            p.rows,
            format!("{:.1} KiB", p.payload_bytes() / 1024.0),
            super::render::seconds(p.seconds)
        );
    }
    text
}
