//! Invariants of the cost model over random valid configurations and jobs:
//! catalogue and small synthetic models, every built-in GPU, every switch,
//! and, half of the time, coefficients drawn anywhere in their physical
//! ranges (an invariant must not depend on the priors).

use paratune::cluster::{NodeGroup, builtin_node};
use paratune::coefficients::{Coefficients, CollectiveAlgorithm, CostModel};
use paratune::config::{
    CrossEntropyFusion, Engine, OptimizerSharding, ParallelConfig, Precision, Recompute,
    RecomputeModules, ScheduleKind, StageOrder, WgradDeferral,
};
use paratune::cost::{Scenario, busiest_link_seconds, memory_per_stage, peak_memory, predict};
use paratune::model::{AttentionKind, ModelSpec, builtin_model, builtin_model_names};
use paratune::search::default_splits;
use proptest::prelude::*;
use proptest::test_runner::Config;

/// One job and one valid configuration of it.
#[derive(Debug, Clone)]
struct Case {
    model: ModelSpec,
    group: NodeGroup,
    cost: CostModel,
    global_batch: u64,
    gpus: u64,
    config: ParallelConfig,
}

impl Case {
    fn scenario(&self) -> Scenario<'_> {
        Scenario::new(
            &self.model,
            self.global_batch,
            &self.group,
            self.gpus,
            &self.cost,
        )
    }
}

/// Every built-in GPU on 8-GPU nodes (GB200's 72-GPU domain is built
/// below with whole-node counts of its own).
const GPUS: [&str; 9] = [
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "v100-32gb",
    "b200",
    "h20",
    "mi300x",
];

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn catalogue_model() -> impl Strategy<Value = ModelSpec> {
    let names = builtin_model_names();
    (0..names.len()).prop_map(move |i| builtin_model(names[i]).unwrap())
}

/// Small models of every architecture switch.
fn synthetic_model() -> impl Strategy<Value = ModelSpec> {
    (
        prop::sample::select(vec![2u64, 4, 8, 16, 32]),
        prop::sample::select(vec![16u64, 32, 64, 128]),
        0usize..6,
        1u64..=24,
        prop::sample::select(vec![1000u64, 32000, 50257, 51200]),
        prop::sample::select(vec![128u64, 512, 1024, 2048, 4096]),
        any::<(bool, bool, bool, bool)>(),
    )
        .prop_map(
            |(heads, head_dim, kv_pick, layers, vocab, seq, (gated, tied, learned, flash))| {
                let hidden = heads * head_dim;
                let kv_choices = divisors(heads);
                let kv_heads = kv_choices[kv_pick % kv_choices.len()];
                let ffn = if gated {
                    (8 * hidden / 3).div_ceil(64) * 64
                } else {
                    4 * hidden
                };
                ModelSpec {
                    name: "synthetic".into(),
                    hidden,
                    heads,
                    kv_heads,
                    ffn_hidden: ffn,
                    gated_mlp: gated,
                    layers,
                    vocab,
                    seq_len: seq,
                    tied_embeddings: tied,
                    learned_positions: learned,
                    dropout: learned,
                    head_dim_override: None,
                    mla: None,
                    moe: None,
                    // Every third depth also trains a prediction module.
                    mtp_layers: u64::from(layers % 3 == 0),
                    window: None,
                    quick_geglu: None,
                    attention_sinks: false,
                    rms_norm: false,
                    linear_bias: true,
                    qk_layernorm: false,
                    no_positions: false,
                    rotary_base: paratune::model::DEFAULT_ROTARY_BASE,
                    rope_scaling: None,
                    norm_epsilon: paratune::model::DEFAULT_NORM_EPSILON,
                    attention: if flash {
                        AttentionKind::Flash
                    } else {
                        AttentionKind::Standard
                    },
                }
            },
        )
}

/// The datasheet priors, or every coefficient drawn in its physical range.
fn cost_model() -> impl Strategy<Value = CostModel> {
    let n = Coefficients::INFO.len();
    (
        prop::option::of(prop::collection::vec(0.0f64..=1.0, n)),
        any::<bool>(),
    )
        .prop_map(|(fractions, ring)| {
            let mut cost = CostModel::datasheet();
            if let Some(fractions) = fractions {
                for (info, u) in Coefficients::INFO.iter().zip(fractions) {
                    cost.coefficients
                        .set(info.name, info.min + u * (info.max - info.min));
                }
                cost.coefficients.check().unwrap();
            }
            if ring {
                cost.collective = CollectiveAlgorithm::Ring;
            }
            cost
        })
}

/// Picks of every dimension, made valid by construction in [`build`].
#[derive(Debug, Clone)]
struct Picks {
    gpu: usize,
    tp: usize,
    pp: usize,
    dp: u64,
    micro_batch: u64,
    micro_batches: u64,
    schedule: usize,
    virtual_stages: usize,
    recompute: usize,
    sequence_parallel: bool,
    sharding: usize,
    bpipe: bool,
    attention: usize,
    /// Engine switches, an uneven split, tp over two nodes, BPipe's stage order.
    switches: (bool, bool, bool, bool),
    uneven: usize,
    tp_over_nodes: bool,
    pairs: bool,
    /// torchtitan instead of Megatron-LM, compiled, one layer in how many checkpointed.
    torchtitan: bool,
    compile: bool,
    ac_frequency: u64,
    /// Hybrid sharding over the smallest proper group of dp (torchtitan).
    hybrid: bool,
    /// Context parallelism over two ranks, the expert-parallel degree (an
    /// index into those that fit), experts split over tp, FP8 GEMMs.
    parallel: (bool, usize, bool, bool),
}

fn picks() -> impl Strategy<Value = Picks> {
    (
        (0..GPUS.len(), any::<usize>(), any::<usize>(), 1u64..=32),
        (
            prop::sample::select(vec![1u64, 2, 4, 8]),
            1u64..=16,
            0usize..3,
            any::<usize>(),
        ),
        (
            0usize..3,
            any::<bool>(),
            0usize..3,
            any::<bool>(),
            0usize..2,
        ),
        (
            any::<(bool, bool, bool, bool)>(),
            any::<usize>(),
            prop::bool::weighted(0.1),
            any::<bool>(),
        ),
        (any::<bool>(), any::<bool>(), 1u64..=4, any::<bool>()),
        (any::<bool>(), any::<usize>(), any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                (gpu, tp, pp, dp),
                (micro_batch, micro_batches, schedule, virtual_stages),
                (recompute, sequence_parallel, sharding, bpipe, attention),
                (switches, uneven, tp_over_nodes, pairs),
                (torchtitan, compile, ac_frequency, hybrid),
                parallel,
            )| Picks {
                gpu,
                tp,
                pp,
                dp,
                micro_batch,
                micro_batches,
                schedule,
                virtual_stages,
                recompute,
                sequence_parallel,
                sharding,
                bpipe,
                attention,
                switches,
                uneven,
                tp_over_nodes,
                pairs,
                torchtitan,
                compile,
                ac_frequency,
                hybrid,
                parallel,
            },
        )
}

fn build(model: ModelSpec, cost: CostModel, p: Picks) -> Case {
    let divides_model = |t: &u64| {
        model.heads.is_multiple_of(*t)
            && model.kv_heads.is_multiple_of(*t)
            && model.ffn_hidden.is_multiple_of(*t)
    };
    let tps: Vec<u64> = [1u64, 2, 4, 8].into_iter().filter(divides_model).collect();
    let tp = if p.tp_over_nodes && divides_model(&16) {
        16
    } else {
        tps[p.tp % tps.len()]
    };
    // Stages an even or a default uneven split can fill.
    let pps: Vec<u64> = (1..=model.layers.min(24))
        .filter(|&pp| !default_splits(model.layers, pp, 1).is_empty())
        .collect();
    let pp = pps[p.pp % pps.len()];
    let (context, ep_pick, experts_over_tp, fp8) = p.parallel;
    let cp = if context && model.seq_len.is_multiple_of(4) {
        2
    } else {
        1
    };
    let mut dp = p.dp;
    let ranks = tp * pp * cp * dp;
    if ranks > 8 {
        // Whole 8-GPU nodes.
        dp *= 8 / gcd(ranks, 8);
    }
    let gpus = tp * pp * cp * dp;
    let etp = if experts_over_tp && model.moe.is_some_and(|m| m.ffn_hidden.is_multiple_of(tp)) {
        tp
    } else {
        1
    };
    let eps: Vec<u64> = match model.moe {
        Some(moe) => (1..=moe.experts)
            .filter(|&ep| moe.experts.is_multiple_of(ep) && (tp * cp * dp).is_multiple_of(ep * etp))
            .collect(),
        None => vec![1],
    };
    let ep = eps[ep_pick % eps.len()];
    let group = builtin_node(GPUS[p.gpu], gpus.div_ceil(8)).unwrap();
    let precision = if fp8 && group.gpu.fp8_peak_flops.is_some() {
        Precision::Fp8
    } else {
        Precision::Bf16
    };
    let mut schedule = [
        ScheduleKind::OneFOneB,
        ScheduleKind::Gpipe,
        ScheduleKind::Interleaved,
    ][p.schedule];
    let mut virtual_stages = 1;
    if schedule == ScheduleKind::Interleaved {
        let vs: Vec<u64> = (2..=model.layers / pp.max(1))
            .filter(|&v| !default_splits(model.layers, pp, v).is_empty())
            .collect();
        if pp < 2 || vs.is_empty() {
            schedule = ScheduleKind::OneFOneB;
        } else {
            virtual_stages = vs[p.virtual_stages % vs.len()];
        }
    }
    let splits = default_splits(model.layers, pp, virtual_stages);
    let (first_stage_layers, last_stage_layers) = splits[p.uneven % splits.len()];
    let micro_batches = if schedule == ScheduleKind::Interleaved {
        pp * p.micro_batches
    } else {
        p.micro_batches
    };
    let engine = if p.torchtitan {
        Engine::Torchtitan
    } else {
        Engine::Megatron
    };
    let policies = Recompute::of(engine);
    let recompute = policies[p.recompute % policies.len()];
    let compile = p.compile && engine == Engine::Torchtitan;
    // Megatron-Core runs MoE layers under tp only sequence-parallel.
    let sequence_parallel = (p.sequence_parallel || model.moe.is_some()) && tp > 1;
    let optimizer_sharding = if dp > 1 {
        OptimizerSharding::ALL[p.sharding]
    } else {
        OptimizerSharding::None
    };
    let bpipe =
        p.bpipe && schedule == ScheduleKind::OneFOneB && pp >= 2 && engine == Engine::Megatron;
    let (grad, param, tp_overlap, graphs) = p.switches;
    let overlap_grad_reduce = grad && dp > 1;
    let config = ParallelConfig {
        tp,
        pp,
        dp,
        micro_batch: p.micro_batch,
        schedule,
        virtual_stages,
        recompute,
        sequence_parallel,
        optimizer_sharding,
        bpipe,
        attention: AttentionKind::ALL[p.attention],
        first_stage_layers,
        last_stage_layers,
        overlap_grad_reduce,
        overlap_param_gather: param
            && overlap_grad_reduce
            && optimizer_sharding == OptimizerSharding::OptimizerStates,
        tp_comm_overlap: tp_overlap && sequence_parallel && (engine == Engine::Megatron || compile),
        cuda_graphs: if graphs
            && recompute != Recompute::Full
            && (engine == Engine::Megatron || pp == 1)
        {
            paratune::config::CudaGraphs::Layers
        } else {
            paratune::config::CudaGraphs::Off
        },
        stage_order: if bpipe && p.pairs {
            StageOrder::BpipePairs
        } else {
            StageOrder::Megatron
        },
        engine,
        compile,
        ac_frequency: p.ac_frequency,
        dp_shard: (2..dp).find(|n| dp.is_multiple_of(*n)).filter(|_| {
            p.hybrid
                && engine == Engine::Torchtitan
                && optimizer_sharding != OptimizerSharding::None
        }),
        cp,
        ep,
        etp: if model.moe.is_some() { etp } else { 1 },
        precision,
        ..ParallelConfig::default()
    };
    Case {
        group,
        model,
        cost,
        global_batch: p.micro_batch * dp * micro_batches,
        gpus,
        config,
    }
}

fn case() -> impl Strategy<Value = Case> {
    valid_cases(prop_oneof![catalogue_model(), synthetic_model()])
}

/// Cases of the catalogue's mixtures of experts only.
fn moe_case() -> impl Strategy<Value = Case> {
    let names: Vec<&str> = builtin_model_names()
        .into_iter()
        .filter(|n| builtin_model(n).unwrap().moe.is_some())
        .collect();
    valid_cases((0..names.len()).prop_map(move |i| builtin_model(names[i]).unwrap()))
}

fn valid_cases(models: impl Strategy<Value = ModelSpec>) -> impl Strategy<Value = Case> {
    (models, cost_model(), picks())
        .prop_map(|(model, cost, picks)| build(model, cost, picks))
        .prop_filter("violates a rule", |c| {
            let per_node = c.group.gpus_per_node.min(c.gpus);
            c.config
                .check(&c.model, c.global_batch, c.gpus, per_node)
                .is_ok()
        })
}

/// 256 cases (the default), no regression files written into the tree.
fn config() -> Config {
    Config {
        failure_persistence: None,
        ..Config::default()
    }
}

/// `a <= b` up to rounding.
fn at_most(a: f64, b: f64) -> bool {
    a <= b * (1.0 + 1e-9) + 1e-300
}

/// Parameters all stages of one tensor-parallel rank hold together, as the
/// model shards them: everything split over tp except the position
/// embedding and the final layer norm, and the tied word embedding held a
/// second time on the last stage when there is more than one stage.
fn expected_params_over_stages(model: &ModelSpec, c: &ParallelConfig) -> f64 {
    // Megatron-LM pads the vocabulary to a multiple of 128 x tp.
    let mut padded = model.clone();
    if c.engine == Engine::Megatron {
        padded.vocab = model.vocab.div_ceil(128 * c.tp) * 128 * c.tp;
    }
    let model = &padded;
    // Position embeddings, the final layer norm, and per layer the two layer
    // norms and two row-parallel biases (6h) are whole on every tp rank.
    // A multi-token prediction module adds a layer (its 6h the same) and
    // three norms, and on a pipeline a copy of an untied embedding.
    let mtp = model.mtp_layers as f64;
    let replicated = model.position_params()
        + 2.0 * model.hidden as f64
        + (model.layers as f64 + mtp) * 6.0 * model.hidden as f64
        + mtp * 3.0 * model.hidden as f64;
    let second_copy = if (model.tied_embeddings || mtp > 0.0) && c.pp > 1 {
        model.embedding_params()
    } else {
        0.0
    };
    // An MoE layer's routed experts are split over etp x ep instead, and
    // its router is whole on every rank.
    let (experts, router) = match (model.moe_layer_params(), model.moe) {
        (Some((experts, _)), Some(moe)) => {
            let layers = moe_layers_with_mtp(model);
            (
                layers * experts,
                layers * (moe.experts * model.hidden) as f64,
            )
        }
        _ => (0.0, 0.0),
    };
    let dense = model.total_params() - replicated - experts - router + second_copy;
    dense / c.tp as f64 + replicated + router + expert_params_over_stages(model, c)
}

/// MoE layers, the prediction modules' counted where they have experts.
fn moe_layers_with_mtp(model: &ModelSpec) -> f64 {
    let mtp = if model.mtp_is_moe() {
        model.mtp_layers
    } else {
        0
    };
    (model.moe_layers() + mtp) as f64
}

/// The routed experts' parameters one rank holds over all stages.
fn expert_params_over_stages(model: &ModelSpec, c: &ParallelConfig) -> f64 {
    match (model.moe_layer_params(), model.moe) {
        (Some((experts, _)), Some(_)) => {
            moe_layers_with_mtp(model) * experts / (c.ep * c.etp) as f64
        }
        _ => 0.0,
    }
}

proptest! {
    #![proptest_config(config())]

    /// (i) Twice the intra-node, the inter-node or both bandwidths never
    /// make a configuration slower.
    #[test]
    fn more_bandwidth_is_never_slower(case in case()) {
        let s = case.scenario();
        let base = predict(&s, &case.config).iteration_s;
        for (intra, inter) in [(2.0, 1.0), (1.0, 2.0), (2.0, 2.0)] {
            let mut faster = s;
            faster.intra_node_bw *= intra;
            faster.inter_node_bw *= inter;
            let t = predict(&faster, &case.config).iteration_s;
            prop_assert!(
                at_most(t, base),
                "intra x{} inter x{}: {} s > {} s for {}",
                intra, inter, t, base, case.config
            );
        }
    }

    /// (i b) Slower collectives (every latency doubled, every link at half
    /// its efficiency) never make a configuration faster: more
    /// communication time is never hidden into a gain.
    #[test]
    fn more_communication_is_never_faster(case in case()) {
        let s = case.scenario();
        let base = predict(&s, &case.config).iteration_s;
        let mut slower_cost = case.cost.clone();
        let k = &mut slower_cost.coefficients;
        for name in ["collective_base_latency_us", "collective_step_latency_us", "p2p_latency_us"] {
            let info = Coefficients::info(name).unwrap();
            k.set(name, (k.get(name).unwrap() * 2.0).min(info.max));
        }
        for name in ["intra_node_efficiency", "inter_node_efficiency"] {
            let info = Coefficients::info(name).unwrap();
            k.set(name, (k.get(name).unwrap() / 2.0).max(info.min));
        }
        let mut slower = s;
        slower.cost = &slower_cost;
        let t = predict(&slower, &case.config).iteration_s;
        prop_assert!(at_most(base, t), "{} s with slower links < {} s for {}", t, base, case.config);
    }

    /// (i c) Overlap hides transfers behind compute, never behind each
    /// other: an iteration takes at least as long as its computation alone
    /// (every link infinitely fast) and as its busiest link alone.
    #[test]
    fn never_faster_than_its_computation_or_its_busiest_link_alone(case in case()) {
        let s = case.scenario();
        let t = predict(&s, &case.config).iteration_s;
        let mut free = s;
        free.intra_node_bw *= 1e9;
        free.inter_node_bw *= 1e9;
        let compute_alone = predict(&free, &case.config).iteration_s;
        prop_assert!(at_most(compute_alone, t), "{} s < computation alone {} s for {}", t, compute_alone, case.config);
        let link = busiest_link_seconds(&s, &case.config);
        prop_assert!(at_most(link, t), "{} s < busiest link {} s for {}", t, link, case.config);
    }

    /// (ii) Weights, gradients and optimizer states of all stages add up to
    /// the model's, sharded over tp (and over dp as the sharding says).
    #[test]
    fn model_states_of_all_stages_add_up_to_the_sharded_model(case in case()) {
        let c = &case.config;
        // FP8's weight copies are checked on their own below.
        prop_assume!(c.precision == Precision::Bf16);
        let k = &case.cost.coefficients;
        let stages = memory_per_stage(&case.scenario(), c);
        prop_assert_eq!(stages.len() as u64, c.pp);
        // Sharded over all of dp, or over the group hybrid sharding names.
        let d = c.shard_degree() as f64;
        // torchtitan's FSDP shards its fp32 parameters and gradients for
        // either sharding; Megatron-LM's distributed optimizer only the
        // optimizer states.
        let (state_shards, optimizer_shards) = match (c.optimizer_sharding, c.engine) {
            (OptimizerSharding::None, _) => (1.0, 1.0),
            (OptimizerSharding::OptimizerStates, Engine::Megatron) => (1.0, d),
            _ => (d, d),
        };
        // Megatron-LM: 16-bit weights, fp32 gradients, Adam with an fp32
        // master copy; torchtitan: fp32 weights (the master copy), fp32
        // gradients, Adam's moments.
        let (weights, optimizer) = match c.engine {
            Engine::Megatron => (k.weight_bytes_per_param, k.optimizer_bytes_per_param),
            Engine::Torchtitan => (
                2.0 * k.weight_bytes_per_param,
                (k.optimizer_bytes_per_param - 2.0 * k.weight_bytes_per_param).max(0.0),
            ),
        };
        // The experts' state is sharded over their expert-data-parallel group.
        let params = expected_params_over_stages(&case.model, c);
        let experts = expert_params_over_stages(&case.model, c);
        let e = c.expert_data_parallel() as f64;
        let (expert_state_shards, expert_optimizer_shards) =
            match (c.optimizer_sharding, c.engine) {
                (OptimizerSharding::None, _) => (1.0, 1.0),
                (OptimizerSharding::OptimizerStates, Engine::Megatron) => (1.0, e),
                _ => (e, e),
            };
        let expected = (params - experts)
            * ((weights + k.gradient_bytes_per_param) / state_shards
                + optimizer / optimizer_shards)
            + experts
                * ((weights + k.gradient_bytes_per_param) / expert_state_shards
                    + optimizer / expert_optimizer_shards);
        let got: f64 = stages
            .iter()
            .map(|m| m.weights + m.gradients + m.optimizer_states)
            .sum();
        prop_assert!(
            (got - expected).abs() <= 1e-9 * expected,
            "{} bytes, expected {} ({})", got, expected, c
        );
    }

    /// (iii) A configuration that fits keeps fitting with more memory.
    #[test]
    fn what_fits_keeps_fitting_with_more_memory(
        case in case(),
        around in 0.3f64..3.0,
        more in 0.0f64..3.0,
    ) {
        let mut s = case.scenario();
        let need = peak_memory(&s, &case.config).bytes;
        // A limit near the need, so that both outcomes occur.
        s.memory_limit = Some(need * around);
        let smaller = peak_memory(&s, &case.config);
        prop_assert_eq!(predict(&s, &case.config).fits, smaller.fits);
        let mut bigger_s = s;
        bigger_s.memory_limit = Some(need * around * (1.0 + more));
        let bigger = peak_memory(&bigger_s, &case.config);
        prop_assert_eq!(bigger.bytes, smaller.bytes);
        prop_assert!(bigger.usable >= smaller.usable);
        prop_assert!(!smaller.fits || bigger.fits, "{} stopped fitting with more memory", case.config);
    }

    /// (iii b) Expandable segments move memory, never time: the allocated
    /// peak stays, the reserved one never grows, and what fits keeps fitting.
    #[test]
    fn expandable_segments_never_raise_memory_or_move_time(case in case()) {
        let s = case.scenario();
        let fixed = ParallelConfig { expandable_segments: false, ..case.config };
        let expandable = ParallelConfig { expandable_segments: true, ..case.config };
        let (a, b) = (predict(&s, &fixed), predict(&s, &expandable));
        prop_assert_eq!(a.iteration_s, b.iteration_s);
        prop_assert_eq!(a.peak_allocated_bytes, b.peak_allocated_bytes);
        prop_assert_eq!(b.peak_reserved_bytes, b.peak_allocated_bytes);
        prop_assert!(b.peak_memory_bytes <= a.peak_memory_bytes);
        prop_assert!(!a.fits || b.fits, "{} stopped fitting with expandable segments", case.config);
    }

    /// (v) Predictions are finite and positive, every part non-negative.
    #[test]
    fn predictions_are_finite_and_positive(case in case()) {
        let s = case.scenario();
        let p = predict(&s, &case.config);
        for (name, x) in [
            ("iteration_s", p.iteration_s),
            ("tokens_per_s", p.tokens_per_s),
            ("tflops_per_gpu", p.tflops_per_gpu),
            ("mfu", p.mfu),
            ("peak_memory_bytes", p.peak_memory_bytes),
            ("usable_memory_bytes", p.usable_memory_bytes),
        ] {
            prop_assert!(x.is_finite() && x > 0.0, "{} = {} for {}", name, x, case.config);
        }
        for (name, x) in p.time.parts() {
            prop_assert!(x.is_finite() && x >= 0.0, "{} = {} for {}", name, x, case.config);
        }
        prop_assert!(p.peak_stage < case.config.pp);
        for m in memory_per_stage(&s, &case.config) {
            for (name, x) in m.parts_gib() {
                prop_assert!(x.is_finite() && x >= 0.0, "stage {} {} = {}", m.stage, name, x);
            }
            prop_assert!(m.total() > 0.0);
            // The allocator reserves at least what it allocated, and the
            // device holds at least what the allocator reserved.
            prop_assert!(at_most(m.allocated(), m.reserved()), "stage {}", m.stage);
            prop_assert!(at_most(m.reserved(), m.total()), "stage {}", m.stage);
        }
        prop_assert!(at_most(p.peak_allocated_bytes, p.peak_reserved_bytes));
        prop_assert!(at_most(p.peak_reserved_bytes, p.peak_memory_bytes));
        prop_assert!(at_most(p.last_stage_allocated_bytes, p.last_stage_reserved_bytes));
    }

    /// (vi) MFU is at most 1 and at most the hardware FLOP/s, which are at
    /// most the GPU's peak.
    #[test]
    fn mfu_and_tflops_never_exceed_the_peak(case in case()) {
        let p = predict(&case.scenario(), &case.config);
        // The peak of the precision the GEMMs run at.
        let peak = match (case.config.precision, case.group.gpu.fp8_peak_flops) {
            (Precision::Fp8, Some(fp8)) => fp8,
            _ => case.group.gpu.peak_flops,
        };
        let peak_tflops = peak / 1e12;
        // Model FLOPs count the whole attention square (Megatron-LM's and
        // the papers' convention); causal flash attention computes half of
        // it, so only the FLOPs run are bounded by the peak.
        let (m, c) = (&case.model, &case.config);
        let full = m.model_flops_per_iteration(case.global_batch);
        let tokens = (case.global_batch * m.seq_len) as f64;
        let attention = m.layer_attention_flops_per_token();
        // Attention passes per token and layer: forward and backward (3),
        // and the recomputed forward where the policy recomputes it.
        let recomputed = match c.recompute {
            Recompute::Selective if c.recompute_modules.has(RecomputeModules::CORE_ATTN) => 1.0,
            Recompute::Full => 1.0,
            Recompute::SelectiveLayer => 1.0 / c.ac_frequency.max(1) as f64,
            _ => 0.0,
        };
        let skipped = |passes: f64| {
            if c.attention == AttentionKind::Flash {
                0.5 * passes * tokens * m.layers as f64 * attention
                    + 0.5 * 3.0 * tokens * m.mtp_layers as f64 * attention
            } else {
                0.0
            }
        };
        let run = p.mfu * (full - skipped(3.0)) / full;
        prop_assert!(at_most(run, 1.0), "MFU {} ({} of the FLOPs run) for {}", p.mfu, run, c);
        let hardware = full + tokens * c.recomputed_flops_per_token(m);
        let run_tflops = p.tflops_per_gpu * (hardware - skipped(3.0 + recomputed)) / hardware;
        prop_assert!(
            at_most(run_tflops, peak_tflops),
            "{} TFLOP/s > peak {} for {}", p.tflops_per_gpu, peak_tflops, case.config
        );
        prop_assert!(at_most(p.mfu, p.tflops_per_gpu / peak_tflops));
    }
}

/// (iv) `peak_memory` looks at the first and the last stage only; the
/// claim in `cost::memory::peak_stage` is that no stage between holds more.
fn peak_is_the_max_over_stages(case: &Case) -> Result<(), TestCaseError> {
    let s = case.scenario();
    let peak = peak_memory(&s, &case.config);
    let stages = memory_per_stage(&s, &case.config);
    let (argmax, max) = stages
        .iter()
        .map(|m| (m.stage, m.total()))
        .fold((0, f64::MIN), |a, b| if b.1 > a.1 { b } else { a });
    prop_assert!(
        (peak.bytes - max).abs() <= 1e-12 * max,
        "peak_memory says {} bytes (stage {}), stage {} holds {} ({} more) for {} with m = {}",
        peak.bytes,
        peak.stage,
        argmax,
        max,
        max - peak.bytes,
        case.config,
        case.config.micro_batches(case.global_batch)
    );
    prop_assert_eq!(stages[peak.stage as usize].total(), peak.bytes);
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn peak_memory_is_the_maximum_over_all_stages(case in case()) {
        peak_is_the_max_over_stages(&case)?;
    }

    /// (iv) restricted to where the claim holds: without BPipe, or with
    /// BPipe and at least p micro-batches.
    #[test]
    fn peak_memory_is_the_maximum_over_all_stages_without_bpipe_short_pipelines(
        case in case().prop_filter("BPipe with m < p", |c| {
            !c.config.bpipe || c.config.micro_batches(c.global_batch) >= c.config.pp
        })
    ) {
        peak_is_the_max_over_stages(&case)?;
    }
}

/// (iv) The concrete counterexample: GPT-3 13B-like layers, 8 stages, 4
/// micro-batches, BPipe. Stage 0 (evictor of stage 7) keeps 3 of the pair's
/// 5 micro-batches; stage 2 (evictor of stage 5) keeps 4 of its pair's 7.
#[test]
fn bpipe_with_fewer_micro_batches_than_stages_peaks_in_the_middle() {
    let mut model = builtin_model("gpt3-13b").unwrap();
    model.attention = AttentionKind::Standard;
    let group = builtin_node("a100-80gb", 1).unwrap();
    let cost = CostModel::datasheet();
    let config = ParallelConfig {
        tp: 1,
        pp: 8,
        dp: 1,
        micro_batch: 1,
        schedule: ScheduleKind::OneFOneB,
        virtual_stages: 1,
        recompute: Recompute::None,
        sequence_parallel: false,
        optimizer_sharding: OptimizerSharding::None,
        bpipe: true,
        attention: AttentionKind::Standard,
        ..ParallelConfig::default()
    };
    let case = Case {
        model,
        group,
        cost,
        global_batch: 4,
        gpus: 8,
        config,
    };
    config.check(&case.model, 4, 8, 8).unwrap();
    let stages = memory_per_stage(&case.scenario(), &config);
    let held: Vec<f64> = stages.iter().map(|m| m.in_flight).collect();
    assert_eq!(held, [3.0, 3.0, 4.0, 4.0, 4.0, 3.0, 3.0, 2.0]);
    peak_is_the_max_over_stages(&case).unwrap();
}

/// The expert-parallel degrees of `case` that keep it valid, ascending.
fn valid_expert_degrees(case: &Case) -> Vec<u64> {
    let Some(moe) = case.model.moe else {
        return vec![1];
    };
    let c = &case.config;
    let per_node = case.group.gpus_per_node.min(case.gpus);
    (1..=moe.experts)
        .filter(|&ep| {
            ParallelConfig { ep, ..*c }
                .check(&case.model, case.global_batch, case.gpus, per_node)
                .is_ok()
        })
        .collect()
}

proptest! {
    #![proptest_config(config())]

    /// (v) More experts on more expert-parallel ranks never raise a rank's
    /// expert memory (weights, gradients, optimizer states of every stage).
    #[test]
    fn more_expert_parallel_ranks_never_raise_a_ranks_memory(case in moe_case()) {
        let degrees = valid_expert_degrees(&case);
        let state = |ep: u64| -> f64 {
            let c = ParallelConfig { ep, ..case.config };
            memory_per_stage(&case.scenario(), &c)
                .iter()
                .map(|m| m.weights + m.gradients + m.optimizer_states)
                .fold(0.0, f64::max)
        };
        for pair in degrees.windows(2) {
            prop_assert!(
                at_most(state(pair[1]), state(pair[0])),
                "ep {} holds {} bytes, ep {} {}",
                pair[1], state(pair[1]), pair[0], state(pair[0])
            );
        }
    }

    /// (vi) Context parallelism divides the activation memory: cp ranks
    /// each keep a cp-th of the layers' activations.
    #[test]
    fn context_parallelism_divides_the_activations(case in case()) {
        let c = case.config;
        prop_assume!(c.cp == 1 && case.model.seq_len.is_multiple_of(8));
        let s = case.scenario();
        let split = ParallelConfig { cp: 2, ..c };
        for stage in [0, c.pp - 1] {
            let whole = paratune::cost::stage_activation_bytes(&s, &c, stage);
            let half = paratune::cost::stage_activation_bytes(&s, &split, stage);
            prop_assert!(
                (2.0 * half - whole).abs() <= 1e-9 * whole,
                "stage {stage}: {whole} bytes whole, {half} with cp 2"
            );
        }
    }

    /// (vii) FP8 copies of the layers' weights add at most two bytes a
    /// parameter, and never take any away.
    #[test]
    fn fp8_adds_at_most_two_bytes_per_parameter(case in case()) {
        prop_assume!(case.group.gpu.fp8_peak_flops.is_some());
        let s = case.scenario();
        let bf16 = ParallelConfig { precision: Precision::Bf16, ..case.config };
        let fp8 = ParallelConfig { precision: Precision::Fp8, ..case.config };
        let params = expected_params_over_stages(&case.model, &bf16);
        let weights = |c: &ParallelConfig| -> f64 {
            memory_per_stage(&s, c).iter().map(|m| m.weights).sum()
        };
        prop_assert!(weights(&fp8) >= weights(&bf16));
        prop_assert!(at_most(weights(&fp8) - weights(&bf16), 2.0 * params));
    }
}

/// (viii) FP8 never slows a GEMM-bound layer: on every GPU with FP8, large
/// layers of every catalogue shape take less time with FP8 GEMMs.
#[test]
fn fp8_never_slows_a_gemm_bound_layer() {
    let cost = CostModel::datasheet();
    for gpu in ["h100-sxm", "h200", "b200", "gb200", "mi300x"] {
        let group = builtin_node(gpu, 1).unwrap();
        for name in [
            "llama3-70b",
            "gpt3-175b",
            "mixtral-8x22b",
            "qwen3-235b-a22b",
        ] {
            let mut model = builtin_model(name).unwrap();
            model.seq_len = 4096;
            model.layers = 8;
            let scenario = Scenario::new(&model, 64, &group, 8, &cost);
            let base = ParallelConfig {
                tp: 8,
                micro_batch: 4,
                sequence_parallel: true,
                // Experts whole, over the ranks (wide GEMMs).
                ep: if model.moe.is_some() { 8 } else { 1 },
                ..ParallelConfig::default()
            };
            let fp8 = ParallelConfig {
                precision: Precision::Fp8,
                ..base
            };
            let (slow, fast) = (
                predict(&scenario, &base).time.compute,
                predict(&scenario, &fp8).time.compute,
            );
            assert!(
                fast < slow,
                "{name} on {gpu}: {fast} s in FP8, {slow} s in bf16"
            );
        }
    }
}

/// NVFP4 never slows a GEMM-bound layer against FP8 on a GPU with FP4
/// tensor cores: its GEMMs run at twice FP8's peak, which outweighs the
/// casts' extra amax pass on layers this wide.
#[test]
fn nvfp4_never_slows_a_gemm_bound_layer() {
    let cost = CostModel::datasheet();
    for gpu in ["b200", "gb200", "b300", "gb300"] {
        let group = builtin_node(gpu, 1).unwrap();
        for name in ["llama3-70b", "gpt3-175b", "qwen3-235b-a22b"] {
            let mut model = builtin_model(name).unwrap();
            model.seq_len = 4096;
            model.layers = 8;
            let scenario = Scenario::new(&model, 64, &group, 8, &cost);
            let fp8 = ParallelConfig {
                tp: 8,
                micro_batch: 4,
                sequence_parallel: true,
                ep: if model.moe.is_some() { 8 } else { 1 },
                precision: Precision::Fp8,
                ..ParallelConfig::default()
            };
            let nvfp4 = ParallelConfig {
                precision: Precision::Nvfp4,
                fp8_recipe: None,
                ..fp8
            };
            let (slow, fast) = (
                predict(&scenario, &fp8).time.compute,
                predict(&scenario, &nvfp4).time.compute,
            );
            assert!(
                fast < slow,
                "{name} on {gpu}: {fast} s in NVFP4, {slow} s in FP8"
            );
        }
    }
}

proptest! {
    #![proptest_config(config())]

    /// (ix) The search's shortcut is exact: the model-state floor never
    /// exceeds the memory the peak stage needs.
    #[test]
    fn the_state_floor_never_exceeds_the_peak(case in case()) {
        let s = case.scenario();
        let floor = paratune::cost::state_floor(&s, &case.config);
        let peak = peak_memory(&s, &case.config).bytes;
        prop_assert!(at_most(floor, peak), "floor {} above peak {} for {}", floor, peak, case.config);
    }

    /// (x) The loss's kernel and a deferred embedding wgrad move the last
    /// stage's memory alone: Transformer Engine's cross-entropy never
    /// holds more than the unfused one, deferring never holds less than
    /// not deferring, and a higher limit never less than a lower one.
    #[test]
    fn the_loss_switches_move_only_the_last_stage(case in case(), limit in 1u64..64) {
        let s = case.scenario();
        let with = |fusion, deferral| {
            let c = ParallelConfig { cross_entropy_fusion: fusion, wgrad_deferral: deferral, ..case.config };
            memory_per_stage(&s, &c)
        };
        let plain = with(CrossEntropyFusion::Off, WgradDeferral::Off);
        let te = with(CrossEntropyFusion::Te, WgradDeferral::Off);
        let some = with(CrossEntropyFusion::Off, WgradDeferral::Limit(limit));
        let more = with(CrossEntropyFusion::Off, WgradDeferral::Limit(limit + 1));
        let all = with(CrossEntropyFusion::Off, WgradDeferral::All);
        let last = plain.len() - 1;
        for stage in 0..last {
            prop_assert_eq!(te[stage], plain[stage]);
            prop_assert_eq!(all[stage], plain[stage]);
        }
        let loss = |m: &[paratune::cost::StageMemory]| m[last].loss;
        prop_assert!(at_most(loss(&te), loss(&plain)), "te {} above off {}", loss(&te), loss(&plain));
        prop_assert!(at_most(loss(&plain), loss(&some)));
        prop_assert!(at_most(loss(&some), loss(&more)));
        prop_assert!(at_most(loss(&more), loss(&all)));
    }
}
