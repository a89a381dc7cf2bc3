//! One MoE layer against Megatron-LM's own regression baselines
//! (tests/data/reference/megatron_moe_layer_h100.csv): the layer's
//! forward and backward on eight H100s, timed by CUDA events around
//! `MoELayer` alone, for a Mixtral-shaped and a DeepSeek-shaped layer
//! under each token dispatcher, in bf16 and in FP8 with block scaling.
//! Zero-shot: nothing in the cost model was fitted to these rows.

use paratune::cluster::builtin_node;
use paratune::coefficients::builtin_cost_model;
use paratune::config::{CudaGraphs, Dispatcher, Fp8Recipe, ParallelConfig, Precision};
use paratune::cost::{Scenario, layer_times};
use paratune::model::builtin_model;
use std::path::Path;

#[derive(Debug, serde::Deserialize)]
struct Case {
    case: String,
    gpu: String,
    gpus: u64,
    seq_len: u64,
    micro_batch: u64,
    hidden: u64,
    moe_ffn_hidden: u64,
    experts: u64,
    topk: u64,
    shared_ffn_hidden: u64,
    router_groups: u64,
    router_group_topk: u64,
    tp: u64,
    ep: u64,
    dispatcher: String,
    precision: String,
    fp8_recipe: String,
    forward_ms: f64,
    backward_ms: f64,
}

fn cases() -> Vec<Case> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/reference/megatron_moe_layer_h100.csv");
    csv::Reader::from_path(path)
        .expect("the baseline table opens")
        .deserialize()
        .collect::<Result<_, _>>()
        .expect("every row reads")
}

/// The predicted forward plus backward of `case`'s MoE layer alone: an MoE
/// layer's time less that of the same layer with a one-wide dense MLP
/// (its attention, norms and residuals, which the baseline's `MoELayer`
/// does not run), with the dispatch and combine not hidden and the host
/// time not hidden.
fn predicted_ms(case: &Case) -> f64 {
    let mut model = builtin_model("mixtral-8x7b").unwrap();
    // Megatron-LM's TransformerConfig defaults, as the harness leaves them:
    // a GeLU MLP without a gate, no biases.
    model.hidden = case.hidden;
    model.heads = 8;
    model.kv_heads = 8;
    model.layers = 1;
    model.seq_len = case.seq_len;
    model.gated_mlp = false;
    model.ffn_hidden = 1;
    let mut moe = model.moe.unwrap();
    moe.experts = case.experts;
    moe.topk = case.topk;
    moe.ffn_hidden = case.moe_ffn_hidden;
    moe.shared_ffn_hidden = case.shared_ffn_hidden;
    moe.router_groups = case.router_groups;
    moe.router_group_topk = case.router_group_topk;
    model.moe = Some(moe);
    let group = builtin_node(&case.gpu, 1).unwrap();
    let cost = builtin_cost_model("a100-megatron")
        .unwrap()
        .carried_to(&case.gpu);
    let global_batch = case.micro_batch * case.gpus / case.tp;
    let s = Scenario::new(&model, global_batch, &group, case.gpus, &cost);
    let precision = match case.precision.as_str() {
        "bf16" => Precision::Bf16,
        "fp8" => Precision::Fp8,
        other => panic!("{}: precision {other}", case.case),
    };
    let c = ParallelConfig {
        tp: case.tp,
        dp: case.gpus / case.tp,
        ep: case.ep,
        micro_batch: case.micro_batch,
        dispatcher: match case.dispatcher.as_str() {
            "alltoall" => Dispatcher::AllToAll,
            "flex" => Dispatcher::Flex,
            "hybridep" => Dispatcher::HybridEp,
            other => panic!("{}: dispatcher {other}", case.case),
        },
        precision,
        fp8_recipe: match case.fp8_recipe.as_str() {
            "" => None,
            "blockwise" => Some(Fp8Recipe::Blockwise),
            other => panic!("{}: recipe {other}", case.case),
        },
        cuda_graphs: CudaGraphs::Off,
        ..ParallelConfig::default()
    };
    let times = layer_times(&s, &c);
    let (moe, dense) = (times.moe.unwrap(), times.dense);
    let whole = |t: &paratune::cost::LayerTime| t.gpu_compute + t.expert_parallel + t.host_excess;
    (whole(&moe) - whole(&dense)) * 1e3
}

#[test]
fn an_moe_layer_takes_what_megatrons_baselines_measured() {
    let cases = cases();
    assert_eq!(cases.len(), 12);
    let mut errors = Vec::new();
    for case in &cases {
        let measured = case.forward_ms + case.backward_ms;
        let predicted = predicted_ms(case);
        let error = predicted / measured - 1.0;
        eprintln!(
            "{:<30} measured {measured:6.2} ms, predicted {predicted:6.2} ms, {:+.1}%",
            case.case,
            100.0 * error
        );
        errors.push(error.abs());
    }
    let mape = errors.iter().sum::<f64>() / errors.len() as f64;
    let worst = errors.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "MoE layer on H100 (Megatron-LM moe_perf baselines): MAPE {:.1}%, worst {:.1}%",
        100.0 * mape,
        100.0 * worst
    );
    assert!(mape < 0.10, "MAPE {mape}");
    assert!(worst < 0.20, "worst {worst}");
}
