use super::*;
use crate::cluster::builtin_node;
use crate::coefficients::CostModel;
use crate::config::{OptimizerSharding, Recompute, ScheduleKind};
use crate::model::{AttentionKind, ModelSpec, builtin_model};

fn job(model: &str, nodes: u64, global_batch: u64) -> Job {
    let group = builtin_node("a100-80gb", nodes).unwrap();
    Job {
        model: builtin_model(model).unwrap(),
        global_batch,
        gpus: nodes * group.gpus_per_node,
        nodes: group,
        memory_limit: None,
        profile: None,
    }
}

#[test]
fn candidates_fit_are_ranked_and_the_counts_add_up() {
    let job = job("gpt3-175b", 16, 256);
    let cost = CostModel::datasheet();
    let result = search(&job, &SearchSpace::default(), &cost);
    assert!(!result.candidates.is_empty());
    assert!(
        result
            .candidates
            .windows(2)
            .all(|w| w[0].prediction.iteration_s <= w[1].prediction.iteration_s)
    );
    assert!(result.candidates.iter().all(|c| c.prediction.fits));
    let invalid: usize = result.invalid.values().sum();
    assert_eq!(
        result.considered,
        result.fitting() + result.out_of_memory + invalid
    );
    // 175B does not fit one GPU's worth of states without model parallelism.
    assert!(result.out_of_memory > 0);
}

#[test]
fn restricted_dimensions_are_honoured() {
    let job = job("gpt3-175b", 16, 256);
    let space = SearchSpace {
        tp: Some(vec![8]),
        recompute: Some(vec![Recompute::Full]),
        schedule: Some(vec![ScheduleKind::OneFOneB]),
        optimizer_sharding: Some(vec![OptimizerSharding::None]),
        bpipe: Some(vec![false]),
        ..SearchSpace::default()
    };
    let result = search(&job, &space, &CostModel::datasheet());
    assert!(!result.candidates.is_empty());
    for c in &result.candidates {
        assert_eq!(c.config.tp, 8);
        assert_eq!(c.config.recompute, Recompute::Full);
        assert_eq!(c.config.schedule, ScheduleKind::OneFOneB);
        assert_eq!(c.config.optimizer_sharding, OptimizerSharding::None);
        assert!(!c.config.bpipe);
    }
}

/// Asked to, the search tries under selective recomputation each module
/// set the recipes use that the model has, every one judged on its own;
/// unasked, the attention core alone, as Megatron-LM defaults.
#[test]
fn recipe_module_sets_are_searched_when_asked() {
    use crate::config::RecomputeModules;
    use std::collections::HashSet;
    let job = moe_on_h100();
    let selective = SearchSpace {
        recompute: Some(vec![Recompute::Selective]),
        tp: Some(vec![1]),
        pp: Some(vec![2]),
        ..SearchSpace::default()
    };
    let asked = SearchSpace {
        search_recompute_modules: true,
        ..selective.clone()
    };
    let cost = CostModel::datasheet();
    let (plain, searched) = (search(&job, &selective, &cost), search(&job, &asked, &cost));
    let sets = |r: &SearchResult| {
        r.candidates
            .iter()
            .map(|c| c.config.recompute_modules)
            .collect::<HashSet<_>>()
    };
    assert_eq!(sets(&plain), HashSet::from([RecomputeModules::default()]));
    let recipes = RecomputeModules::searched(&job.model);
    // Qwen3-MoE has experts but neither MLA nor dense layers.
    assert_eq!(recipes.len(), 3);
    assert_eq!(sets(&searched), recipes.iter().copied().collect());
    assert_eq!(searched.considered, 3 * plain.considered);
    let dense = builtin_model("gpt3-175b").unwrap();
    assert_eq!(
        RecomputeModules::searched(&dense),
        vec![RecomputeModules::default()]
    );
}

#[test]
fn a_restriction_that_breaks_a_rule_is_counted_not_hidden() {
    let job = job("gpt3-175b", 16, 256);
    let space = SearchSpace {
        tp: Some(vec![1]),
        sequence_parallel: Some(vec![true]),
        ..SearchSpace::default()
    };
    let result = search(&job, &space, &CostModel::datasheet());
    assert!(result.candidates.is_empty());
    assert_eq!(result.out_of_memory, 0);
    // Every combination broke a rule; most of them this one (the others
    // broke an earlier rule first, e.g. interleaving's micro-batch count).
    let invalid: usize = result.invalid.values().sum();
    assert_eq!(invalid, result.considered);
    let sp = result.invalid[&Rule::SequenceParallelWithoutTp];
    assert!(sp * 2 > result.considered, "{sp} of {}", result.considered);
}

#[test]
fn the_smallest_fitting_gpu_count_fits_and_the_job_size_does_not() {
    let small = job("gpt-1t", 1, 64);
    let cost = CostModel::datasheet();
    let space = SearchSpace::default();
    assert!(!anything_fits(&small, &space, &cost));
    let gpus = smallest_fitting_gpus(&small, &space, &cost, 65536).expect("1T fits somewhere");
    let mut bigger = small.clone();
    bigger.gpus = gpus;
    bigger.nodes.nodes = gpus / 8;
    assert!(anything_fits(&bigger, &space, &cost));
    // No usable count between the job's and the answer fits.
    for g in space.degree_products(&small, 8) {
        if g > small.gpus && g < gpus && g % 8 == 0 {
            let mut between = small.clone();
            between.gpus = g;
            between.nodes.nodes = g / 8;
            assert!(!anything_fits(&between, &space, &cost), "{g} GPUs fit");
        }
    }
}

#[test]
fn explanations_say_why_a_configuration_lost_or_does_not_fit() {
    let job = job("gpt3-175b", 16, 256);
    let cost = CostModel::datasheet();
    let result = search(&job, &SearchSpace::default(), &cost);
    let winner = result.candidates[0].config;
    match explain(&job, &SearchSpace::default(), &cost, &result, &winner) {
        Explanation::Ranked {
            rank, slower_by, ..
        } => {
            assert_eq!(rank, 1);
            assert_eq!(slower_by, 0.0);
        }
        other => panic!("{other:?}"),
    }
    let unsharded = ParallelConfig {
        dp: 128,
        attention: winner.attention,
        ..ParallelConfig::default()
    };
    match explain(&job, &SearchSpace::default(), &cost, &result, &unsharded) {
        Explanation::DoesNotFit {
            needs_gib,
            usable_gib,
            ..
        } => assert!(needs_gib > usable_gib),
        other => panic!("{other:?}"),
    }
    let mut broken = winner;
    broken.tp = 3;
    assert!(matches!(
        explain(&job, &SearchSpace::default(), &cost, &result, &broken),
        Explanation::Invalid { .. }
    ));
    // A runner-up's differences are the parts that move its time by what a
    // plan shows, 0.1 ms, never a "-0.0 ms".
    for candidate in result.candidates.iter().skip(1).take(50) {
        if let Explanation::Ranked { differences, .. } = explain(
            &job,
            &SearchSpace::default(),
            &cost,
            &result,
            &candidate.config,
        ) {
            assert!(
                differences
                    .iter()
                    .all(|(_, delta)| delta.abs() >= crate::search::explain::SHOWN_DIFFERENCE_S),
                "{differences:?}"
            );
        }
    }
}

#[test]
fn sequence_parallelism_needs_a_tp_that_divides_the_sequence() {
    let mut job = job("gpt3-175b", 16, 256);
    job.model.seq_len = 2052; // 4 x 513: tp 4 splits it, tp 8 does not
    let space = SearchSpace {
        tp: Some(vec![8]),
        sequence_parallel: Some(vec![true]),
        ..SearchSpace::default()
    };
    let result = search(&job, &space, &CostModel::datasheet());
    assert!(result.candidates.is_empty());
    assert!(result.invalid[&Rule::SequenceNotSplit] > 0);
    let c = ParallelConfig {
        tp: 8,
        pp: 16,
        dp: 1,
        micro_batch: 1,
        schedule: crate::config::ScheduleKind::OneFOneB,
        virtual_stages: 1,
        recompute: crate::config::Recompute::Full,
        sequence_parallel: true,
        optimizer_sharding: crate::config::OptimizerSharding::None,
        bpipe: false,
        attention: crate::model::AttentionKind::Flash,
        ..ParallelConfig::default()
    };
    let err = c.check(&job.model, 256, 128, 8).unwrap_err();
    assert!(
        err.contains("2052") && err.contains("`sequence_parallel off`"),
        "{err}"
    );
}

#[test]
fn torchtitan_searches_hybrid_sharding_within_a_node_and_megatron_does_not() {
    let job = job("llama3-8b", 4, 64);
    let cost = CostModel::datasheet();
    let titan = SearchSpace {
        engine: crate::config::Engine::Torchtitan,
        ..SearchSpace::default()
    };
    let result = search(&job, &titan, &cost);
    let hybrid: Vec<_> = result
        .candidates
        .iter()
        .filter(|c| c.config.dp_shard.is_some())
        .collect();
    assert!(!hybrid.is_empty());
    for c in &hybrid {
        // A node's data-parallel ranks, replicated over the rest.
        assert_eq!(c.config.dp_shard, Some(8 / c.config.tp));
        assert_ne!(c.config.optimizer_sharding, OptimizerSharding::None);
    }
    let megatron = search(&job, &SearchSpace::default(), &cost);
    assert!(
        megatron
            .candidates
            .iter()
            .all(|c| c.config.dp_shard.is_none())
    );
    // Asked for, a group that cannot be is counted.
    let odd = SearchSpace {
        dp_shard: Some(vec![3]),
        ..titan
    };
    let result = search(&job, &odd, &cost);
    assert!(
        result
            .invalid
            .contains_key(&crate::config::Rule::HybridSharding)
    );
}

/// BPipe's setting: GPT-3 134B on 48 A100s (6 nodes, HDR InfiniBand),
/// unfused attention, no sequence parallelism, activations bound by
/// memory. BPipe (Kim et al., ICML'23) reports a gain there; the
/// re-evaluation (arXiv 2401.02088) finds none once flash attention and
/// sequence parallelism shrink the activations.
fn bpipe_gain(attention: AttentionKind, sequence_parallel: bool) -> f64 {
    let mut model = ModelSpec::gpt("gpt3-134b", 12288, 96, 72, 51200, 2048);
    model.attention = attention;
    let group = builtin_node("a100-80gb", 6).unwrap();
    let cost = CostModel::datasheet();
    let job = Job {
        model,
        global_batch: 192,
        gpus: 48,
        nodes: group,
        memory_limit: None,
        profile: None,
    };
    let best = |bpipe: bool| {
        let space = SearchSpace {
            schedule: Some(vec![ScheduleKind::OneFOneB]),
            attention: Some(vec![attention]),
            sequence_parallel: Some(vec![sequence_parallel]),
            bpipe: Some(vec![bpipe]),
            ..Default::default()
        };
        let result = search(&job, &space, &cost);
        result.candidates[0].prediction.iteration_s
    };
    best(false) / best(true) - 1.0
}

#[test]
fn bpipe_pays_where_unfused_activations_bind_memory_and_not_with_flash_and_sp() {
    let unfused = bpipe_gain(AttentionKind::Standard, false);
    let flash = bpipe_gain(AttentionKind::Flash, true);
    assert!(unfused > 0.02, "BPipe's own setting: gain {unfused}");
    assert!(
        flash < 0.01,
        "flash + SP: no gain worth having, found {flash}"
    );
}

/// The search reuses memory verdicts and layer times between the
/// configurations that share their keys: each candidate's prediction must
/// be what predicting it alone gives, bit for bit, on both engines.
#[test]
fn kept_memory_and_layer_times_predict_as_a_fresh_prediction() {
    // At 8K tokens the search opens context parallelism too.
    let mut job = job("mixtral-8x7b", 4, 64);
    job.model.seq_len = 8192;
    let cost = CostModel::datasheet();
    let scenario = job.scenario(&cost);
    for engine in [
        crate::config::Engine::Megatron,
        crate::config::Engine::Torchtitan,
    ] {
        let space = SearchSpace {
            engine,
            precision: Some(crate::config::Precision::ALL.to_vec()),
            ..SearchSpace::default()
        };
        let result = search(&job, &space, &cost);
        assert!(result.candidates.len() > 100, "{engine:?}");
        for candidate in &result.candidates {
            let fresh = crate::cost::predict(&scenario, &candidate.config);
            assert_eq!(candidate.prediction, fresh, "{}", candidate.config);
        }
    }
}

/// Whole spaces the per-stem and per-key shortcuts are checked over: dense
/// GPT-3 (interleaved and uneven pipelines, every sharding), Qwen3-MoE on
/// H100s, Llama 3 8B at 32K tokens (cp opened) and torchtitan's space.
fn whole_spaces() -> Vec<(Job, SearchSpace)> {
    let mut long_context = job("llama3-8b", 4, 32);
    long_context.model.seq_len = 32768;
    let torchtitan = SearchSpace {
        engine: crate::config::Engine::Torchtitan,
        ..SearchSpace::default()
    };
    vec![
        (job("gpt3-175b", 16, 256), SearchSpace::default()),
        (moe_on_h100(), SearchSpace::default()),
        (long_context, SearchSpace::default()),
        (job("llama3-8b", 2, 64), torchtitan),
    ]
}

/// Qwen3-30B-A3B on 8 DGX H100 nodes, global batch 256.
fn moe_on_h100() -> Job {
    let mut moe = job("qwen3-30b-a3b", 8, 256);
    moe.nodes = builtin_node("h100-sxm", 8).unwrap();
    moe
}

/// The search checks the rules with its stem's checks made once per stem:
/// for every configuration of whole spaces (dense, interleaved and uneven
/// pipelines, MoE on Megatron-LM, long-context with cp, torchtitan) that
/// gives the rule `violation` gives.
#[test]
fn stem_checks_made_once_give_the_rules_violation_gives() {
    for (job, space) in whole_spaces() {
        let per_node = job.gpus_per_node();
        let (mut considered, mut broken) = (0, 0);
        for outer in space.outer(&job) {
            let mut stem: Option<StemChecks> = None;
            let _: ControlFlow<()> = space.for_each_inner(&job, outer, |c| {
                let checks = match stem {
                    Some(checks) if checks.holds_for(c) => checks,
                    _ => *stem.insert(StemChecks::of(c, &job.model, job.global_batch, per_node)),
                };
                let cached = c.violation_with(&checks, &job.model, job.gpus);
                let fresh = c.violation(&job.model, job.global_batch, job.gpus, per_node);
                assert_eq!(cached, fresh, "{c}");
                considered += 1;
                broken += usize::from(fresh.is_some());
                ControlFlow::Continue(())
            });
        }
        assert!(considered > 1000 && broken > 0, "{considered} {broken}");
    }
}

/// A search lends each prediction the sync parts it worked out for the
/// first configuration of the same [`sync_key`]: over whole spaces (dense
/// GPT-3 with every sharding, an MoE with expert parallelism, a long
/// context with cp, torchtitan's FSDP and HSDP, MoE layers alternating with
/// dense ones) every configuration is predicted exactly as from its own
/// parts, and exactly as `predict` does.
#[test]
fn sync_parts_shared_by_key_predict_what_each_configurations_own_do() {
    use crate::config::{GradReduce, Precision, SyncMethod};
    use crate::cost::{peak_memory, predict};
    use std::collections::HashMap;
    let mut cases = whole_spaces();
    // The MoE's with the switches the default space holds at one value opened.
    cases[1].1 = SearchSpace {
        precision: Some(vec![Precision::Bf16, Precision::Fp8]),
        grad_reduce: Some(vec![GradReduce::Fp32, GradReduce::Bf16]),
        embedding_sync: Some(vec![SyncMethod::AllReduce, SyncMethod::SparseAllGather]),
        cpu_offload_layers: Some(vec![0, 2]),
        ..SearchSpace::default()
    };
    // MoE layers alternating with dense ones: every stage a candidate.
    let mut alternating = moe_on_h100();
    if let Some(moe) = alternating.model.moe.as_mut() {
        moe.layer_freq = 2;
    }
    cases.push((alternating, SearchSpace::default()));
    let cost = CostModel::datasheet();
    for (job, space) in cases {
        let s = job.scenario(&cost);
        let per_node = job.gpus_per_node();
        let mut first_of_key: HashMap<ParallelConfig, SyncParts> = HashMap::new();
        let (mut predicted, mut shared) = (0, 0);
        for outer in space.outer(&job) {
            let _: ControlFlow<()> = space.for_each_inner(&job, outer, |c| {
                if c.violation(&job.model, job.global_batch, job.gpus, per_node)
                    .is_some()
                {
                    return ControlFlow::Continue(());
                }
                let key = sync_key(c);
                let own = sync_parts(&s, c);
                shared += usize::from(first_of_key.contains_key(&key));
                let kept = *first_of_key.entry(key).or_insert(own);
                // Every fifth configuration, to keep the walk short.
                predicted += 1;
                if predicted % 5 != 0 {
                    return ControlFlow::Continue(());
                }
                let memory = peak_memory(&s, c);
                let layer = layer_times(&s, c);
                let from_kept = predict_checked_from(&s, c, &memory, &layer, &kept);
                assert_eq!(
                    from_kept,
                    predict_checked_from(&s, c, &memory, &layer, &own),
                    "{c}"
                );
                assert_eq!(from_kept, predict(&s, c), "{c}");
                ControlFlow::Continue(())
            });
        }
        assert!(
            predicted > 1000 && shared > predicted / 2,
            "{predicted} {shared}"
        );
    }
}

/// A search that keeps only its fastest few ranks them as a search that
/// keeps all does, ties included, and still counts, and ranks against,
/// every configuration that fits.
#[test]
fn keeping_the_fastest_few_ranks_them_as_keeping_all() {
    let job = job("mixtral-8x7b", 4, 64);
    let cost = CostModel::datasheet();
    let space = SearchSpace::default();
    let all = search_keeping(&job, &space, &cost, usize::MAX);
    assert!(all.candidates.len() > 1000, "{}", all.candidates.len());
    for keep in [0, 1, 7, 100] {
        let few = search_keeping(&job, &space, &cost, keep);
        assert_eq!(few.candidates.len(), keep);
        assert_eq!(few.fitting(), all.candidates.len());
        assert_eq!(few.valid(), all.valid());
        for (kept, ranked) in few.candidates.iter().zip(&all.candidates) {
            assert_eq!(kept.config, ranked.config);
        }
    }
    // Ranks count every fitting configuration, kept or not.
    let last = all.candidates.last().unwrap().prediction.iteration_s;
    let few = search_keeping(&job, &space, &cost, 10);
    assert_eq!(few.faster_than(last), all.faster_than(last));
    assert!(few.faster_than(last) >= all.candidates.len() / 2);
    assert!(few.any_takes(last));
    assert!(!few.any_takes(last * 2.0));
    // An explanation ranks a configuration past the kept ones among all.
    let slowest = all.candidates.last().unwrap().config;
    let rank = |result: &SearchResult| match explain(&job, &space, &cost, result, &slowest) {
        Explanation::Ranked { rank, of, .. } => (rank, of),
        other => panic!("{other:?}"),
    };
    assert_eq!(rank(&few), rank(&all));
    assert_eq!(rank(&few).1, all.candidates.len());
    // A second look finds what the kept ones lack, in bounded memory.
    let found = search_where(&job, &space, &cost, 1, &|c| *c == slowest);
    assert_eq!(found.fitting(), 1);
    assert_eq!(found.candidates[0].config, slowest);
}

/// A GPU named `cpu` is the CPU standing in for one: the search opens no
/// CUDA graphs there, where it opens per-layer graphs on a GPU.
#[test]
fn a_cpu_standing_in_for_a_gpu_is_searched_without_cuda_graphs() {
    let searched_graphs = |job: &Job| {
        let result = search_keeping(job, &SearchSpace::default(), &CostModel::datasheet(), 1000);
        result
            .candidates
            .iter()
            .map(|c| c.config.cuda_graphs)
            .collect::<std::collections::HashSet<_>>()
    };
    let gpu = job("gpt3-13b", 1, 64);
    assert!(searched_graphs(&gpu).contains(&crate::config::CudaGraphs::Layers));
    let mut cpu = gpu.clone();
    cpu.nodes.gpu.name = "cpu".into();
    let graphs = searched_graphs(&cpu);
    assert_eq!(
        graphs,
        [crate::config::CudaGraphs::Off].into_iter().collect()
    );
}
