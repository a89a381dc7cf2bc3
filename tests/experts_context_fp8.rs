//! Mixtures of experts, context parallelism and FP8 from the command line:
//! bad input is one line naming the flag and the fix, plans export the
//! flags Megatron-LM and torchtitan take, run tables read the columns.

mod common;
use common::{fails, llama3_8b_on, ok};

/// Each line of `text` that `says` must all appear in.
fn says(text: &str, parts: &[&str]) {
    for part in parts {
        assert!(text.contains(part), "`{part}` missing from:\n{text}");
    }
}

const MIXTRAL_ON_64: [&str; 10] = [
    "--model",
    "mixtral-8x7b",
    "--gpu",
    "h100-sxm",
    "--nodes",
    "8",
    "--global-batch",
    "256",
    "--seq-len",
    "4096",
];

/// DeepSeek-V3 on 1,024 H100s.
const DEEPSEEK_V3_ON_128_H100: [&str; 6] = [
    "--model",
    "deepseek-v3",
    "--gpu",
    "h100-sxm",
    "--nodes",
    "128",
];

/// A dense model on one node, for refusals.
const LLAMA3_8B_ON_ONE_NODE: [&str; 8] = [
    "--model",
    "llama3-8b",
    "--gpu",
    "h100-sxm",
    "--nodes",
    "1",
    "--global-batch",
    "8",
];

/// A plan of Llama 3 8B in FP8 on one B200 node.
const LLAMA3_8B_FP8_ON_ONE_B200: [&str; 11] = [
    "plan",
    "--model",
    "llama3-8b",
    "--gpu",
    "b200",
    "--nodes",
    "1",
    "--global-batch",
    "16",
    "--precision",
    "fp8",
];

/// Column `column` of stage 0's row in predict's memory table.
fn stage_zero_cell(out: &str, column: usize) -> f64 {
    let row = out
        .lines()
        .skip_while(|l| !l.contains("stage  weights"))
        .nth(1)
        .unwrap_or_else(|| panic!("no stage row in:\n{out}"));
    row.split_whitespace().nth(column).unwrap().parse().unwrap()
}

/// The allocated peak `evaluate` predicts for each row of run table `table`.
fn predicted_allocated(table: &std::path::Path, extra: &[&str]) -> Vec<f64> {
    let mut args = vec![
        "evaluate",
        "--runs",
        table.to_str().unwrap(),
        "--format",
        "json",
    ];
    args.extend(extra);
    let json: serde_json::Value = serde_json::from_str(&ok(&args)).unwrap();
    json["memory_rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["predicted_allocated"].as_f64().unwrap())
        .collect()
}

fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

/// The iteration time `predict` prints ("1.23 s per iteration, ...").
fn iteration_seconds(out: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.contains(" s per iteration,"))
        .unwrap();
    line.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn impossible_expert_context_and_precision_settings_name_the_flag() {
    let predict = |extra: &[&str]| fails(&with(&with(&["predict"], &MIXTRAL_ON_64), extra));
    // ep must divide the experts.
    says(
        &predict(&["--ep", "3", "--dp", "64"]),
        &["ep 3 must divide the 8 experts"],
    );
    // etp x ep must divide the stage's ranks.
    says(
        &predict(&[
            "--tp",
            "2",
            "--sequence-parallel",
            "on",
            "--ep",
            "8",
            "--etp",
            "2",
            "--pp",
            "8",
        ]),
        &[
            "etp x ep = 2 x 8 must divide tp x cp x dp = 8",
            "--ep or --etp",
        ],
    );
    // 2 x cp must divide the sequence.
    says(
        &fails(&with(
            &[
                "predict",
                "--model",
                "llama3-8b",
                "--gpu",
                "h100-sxm",
                "--nodes",
                "1",
            ],
            &["--global-batch", "8", "--seq-len", "1000", "--cp", "8"],
        )),
        &["cp 8 must split the sequence 1000 into 2 x cp equal chunks"],
    );
    // MoE with tp needs sequence parallelism.
    says(
        &predict(&["--tp", "2"]),
        &["MoE layers with tp 2 need --sequence-parallel on"],
    );
    // FP8 on a GPU without it.
    says(
        &fails(&[
            "plan",
            "--model",
            "llama3-8b",
            "--gpu",
            "a100-80gb",
            "--nodes",
            "1",
            "--global-batch",
            "8",
            "--precision",
            "fp8",
        ]),
        &["--precision fp8", "a100-80gb has no FP8 tensor cores"],
    );
    // A mistyped choice.
    says(&predict(&["--cp-comm", "ring"]), &["--cp-comm", "p2p"]);
}

#[test]
fn expert_flags_on_a_dense_model_are_refused() {
    let dense = with(&["predict"], &LLAMA3_8B_ON_ONE_NODE);
    says(
        &fails(&with(&dense, &["--moe-topk", "2"])),
        &["--moe-topk needs a mixture of experts", "--experts N"],
    );
    says(
        &fails(&with(&dense, &["--ep", "2"])),
        &["--ep needs a mixture of experts", "--experts N"],
    );
    // A search names the rule that left nothing, with its fix for one of
    // the configurations it dropped.
    let plan = |extra: &[&str]| {
        fails(&with(
            &[
                "plan",
                "--model",
                "qwen3-30b-a3b",
                "--gpu",
                "h100-sxm",
                "--nodes",
                "2",
                "--global-batch",
                "256",
            ],
            extra,
        ))
    };
    says(
        &plan(&["--ep", "3"]),
        &[
            "experts not divisible by ep",
            "ep 3 must divide the 128 experts",
        ],
    );
    says(
        &plan(&["--fp8-param-gather", "on"]),
        &["--fp8-param-gather on needs --precision fp8"],
    );
    says(
        &fails(&with(&dense, &["--v-head-dim", "64"])),
        &[
            "--v-head-dim needs multi-latent attention",
            "--kv-lora-rank",
        ],
    );
    // More experts routed to than there are.
    says(
        &fails(&with(&dense, &["--experts", "4", "--moe-topk", "8"])),
        &["--moe-topk (8) cannot exceed the 4 experts"],
    );
}

/// `predict` without `--moe-dispatcher` prices Megatron-LM's default, the
/// allgather dispatcher, as run tables and ingested logs read it.
#[test]
fn predict_defaults_to_megatron_lms_dispatcher() {
    let job = with(
        &with(&["predict"], &MIXTRAL_ON_64),
        &[
            "--tp",
            "2",
            "--pp",
            "4",
            "--ep",
            "8",
            "--sequence-parallel",
            "on",
        ],
    );
    let plain = ok(&job);
    assert_eq!(plain, ok(&with(&job, &["--moe-dispatcher", "allgather"])));
    let a2a = ok(&with(&job, &["--moe-dispatcher", "alltoall"]));
    assert_ne!(plain, a2a);
    says(&a2a, &["dispatch=alltoall"]);
    says(&plain, &["etp2"]);
}

/// torchtitan dispatches with all-to-all only: its predictions default to
/// it, its search never tries the gathering dispatcher, and asking for that
/// one says why. On a dense model the flag means nothing and is refused.
#[test]
fn torchtitan_dispatches_all_to_all_and_dense_models_take_no_dispatcher() {
    let titan = with(
        &with(&["predict"], &MIXTRAL_ON_64),
        &[
            "--engine",
            "torchtitan",
            "--tp",
            "1",
            "--pp",
            "4",
            "--ep",
            "8",
            "--etp",
            "1",
        ],
    );
    let plain = ok(&titan);
    assert!(!plain.contains("dispatch=allgather"), "{plain}");
    let refused = fails(&with(&titan, &["--moe-dispatcher", "allgather"]));
    says(
        &refused,
        &["allgather token dispatcher", "--moe-dispatcher alltoall"],
    );
    let plan = ok(&with(
        &with(&["plan"], &MIXTRAL_ON_64),
        &["--engine", "torchtitan", "--etp", "1", "--top", "50"],
    ));
    assert!(!plan.contains("dispatch=allgather"), "{plan}");
    let dense = [
        "predict",
        "--model",
        "llama3-8b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "1",
        "--global-batch",
        "8",
        "--moe-dispatcher",
        "alltoall",
    ];
    says(
        &fails(&dense),
        &["--moe-dispatcher needs a mixture of experts", "--experts N"],
    );
}

#[test]
fn a_moe_plan_exports_megatron_lm_and_torchtitan_flags() {
    let out = ok(&with(&with(&["plan"], &MIXTRAL_ON_64), &["--top", "1"]));
    says(
        &out,
        &[
            "cp  ep/etp",
            "--num-experts 8",
            "--moe-router-topk 2",
            "--moe-ffn-hidden-size 14336",
            "--expert-model-parallel-size 8",
            "--expert-tensor-parallel-size",
            "--moe-token-dispatcher-type alltoall",
            "--moe-grouped-gemm",
        ],
    );
    // torchtitan 0.3 keeps experts whole and carves ep out of dp x tp.
    let titan = ok(&with(
        &with(&["plan"], &MIXTRAL_ON_64),
        &["--engine", "torchtitan", "--etp", "1", "--top", "1"],
    ));
    says(&titan, &["--parallelism.expert_parallel_degree"]);
}

/// A search over both precisions says which each row runs: their MFUs
/// are over different peaks.
#[test]
fn a_search_over_both_precisions_shows_each_rows() {
    let out = ok(&with(
        &["plan"],
        &with(&MIXTRAL_ON_64, &["--precision", "bf16,fp8", "--top", "60"]),
    ));
    let header = out
        .lines()
        .find(|l| l.trim_start().starts_with("#  tp"))
        .unwrap();
    assert!(header.contains(" prec "), "{header}");
    // FP8 is the faster here: the first rows say so.
    let first = out
        .lines()
        .find(|l| l.trim_start().starts_with("1 "))
        .unwrap();
    assert!(first.contains(" fp8 "), "{first}");
    // One precision: no column.
    let bf16 = ok(&with(&["plan"], &with(&MIXTRAL_ON_64, &["--top", "1"])));
    assert!(!bf16.contains(" prec "), "{bf16}");
}

#[test]
fn context_parallel_and_fp8_plans_export_their_flags() {
    let out = ok(&[
        "plan",
        "--model",
        "llama3.1-8b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "4",
        "--global-batch",
        "8",
        "--cp",
        "8",
        "--cp-comm",
        "p2p",
        "--precision",
        "fp8",
        "--top",
        "1",
    ]);
    says(
        &out,
        &[
            "--context-parallel-size 8",
            "--cp-comm-type p2p",
            "--fp8-format hybrid",
            "--fp8-recipe tensorwise",
            "context-parallel comm",
        ],
    );
    // Blackwell's FP8 is MXFP8.
    let b200 = ok(&with(&LLAMA3_8B_FP8_ON_ONE_B200, &["--top", "1"]));
    says(&b200, &["--fp8-recipe mxfp8"]);
}

/// Transformer Engine runs sliding windows under context parallelism only
/// with its all-to-all or all-gather exchange: a gpt-oss plan searches
/// all-to-all unless told, and a ring asked for is refused by name.
#[test]
fn windowed_models_plan_context_parallelism_without_the_ring() {
    let job = [
        "--model",
        "gpt-oss-20b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "2",
        "--global-batch",
        "8",
        "--seq-len",
        "65536",
        "--cp",
        "8",
        "--top",
        "1",
    ];
    let out = ok(&[&["plan"][..], &job[..]].concat());
    says(&out, &["--context-parallel-size 8", "--cp-comm-type "]);
    assert!(!out.contains("--cp-comm-type p2p"), "{out}");
    // predict takes a2a where it splits the heads (8 kv heads over cp 8),
    // else the all-gather.
    let layout = ["--tp", "1", "--pp", "1", "--micro-batch", "1", "--ep", "8"];
    let one = ok(&[&["predict"][..], &job[..job.len() - 2], &layout[..]].concat());
    assert!(one.contains("cp-comm=a2a"), "{one}");
    let wider = [
        "--tp",
        "2",
        "--pp",
        "1",
        "--micro-batch",
        "1",
        "--ep",
        "8",
        "--sequence-parallel",
        "on",
    ];
    let two = ok(&[&["predict"][..], &job[..job.len() - 2], &wider[..]].concat());
    assert!(two.contains("cp-comm=allgather"), "{two}");
    let refused = fails(&[&["plan"][..], &job[..], &["--cp-comm", "p2p"][..]].concat());
    assert!(
        refused.contains("sliding windows under a cp ring"),
        "{refused}"
    );
}

/// `--fp8-recipe` picks Transformer Engine's scaling: refused where it
/// cannot run or changes nothing, exported as given, and priced by its
/// casts (tensor-wise current scaling reads inputs once more for the amax).
#[test]
fn fp8_recipes_are_checked_exported_and_priced() {
    let llama_on = |gpu: &'static str, extra: &[&'static str]| {
        let layout = [
            "--global-batch",
            "16",
            "--tp",
            "1",
            "--pp",
            "1",
            "--micro-batch",
            "2",
            "--optimizer-sharding",
            "optimizer-states",
        ];
        llama3_8b_on("predict", gpu, &with(&layout, extra))
    };
    says(
        &fails(&llama_on(
            "h100-sxm",
            &["--precision", "fp8", "--fp8-recipe", "mxfp8"],
        )),
        &[
            "--fp8-recipe mxfp8",
            "MXFP8 needs Blackwell",
            "use --fp8-recipe tensorwise",
        ],
    );
    says(
        &fails(&llama_on("b200", &["--fp8-recipe", "delayed"])),
        &[
            "--fp8-recipe delayed: no candidate runs FP8",
            "--precision fp8",
        ],
    );
    says(
        &fails(&llama_on(
            "h100-sxm",
            &["--precision", "fp8", "--fp8-recipe", "current"],
        )),
        &["--fp8-recipe", "tensorwise, delayed, mxfp8, blockwise"],
    );
    says(
        &fails(&llama_on(
            "h100-sxm",
            &[
                "--precision",
                "fp8",
                "--fp8-recipe",
                "delayed",
                "--engine",
                "torchtitan",
            ],
        )),
        &[
            "--fp8-recipe delayed is Transformer Engine's",
            "--engine megatron",
        ],
    );
    // The time: tensor-wise at least delayed's, the recipe named in the
    // configuration line and exported as given (Blackwell too).
    let ms = |out: &str| -> f64 {
        let line = out.lines().find(|l| l.contains(" per iteration,")).unwrap();
        let mut words = line.split_whitespace();
        let value: f64 = words.next().unwrap().parse().unwrap();
        match words.next() {
            Some("s") => 1e3 * value,
            _ => value,
        }
    };
    let tensorwise = ok(&llama_on(
        "b200",
        &["--precision", "fp8", "--fp8-recipe", "tensorwise"],
    ));
    let delayed = ok(&llama_on(
        "b200",
        &["--precision", "fp8", "--fp8-recipe", "delayed"],
    ));
    let default = ok(&llama_on("b200", &["--precision", "fp8"]));
    says(&tensorwise, &["fp8(tensorwise)"]);
    says(&default, &["fp8(mxfp8)"]);
    assert!(ms(&tensorwise) > ms(&delayed), "{tensorwise}\n{delayed}");
    let plan = ok(&with(
        &LLAMA3_8B_FP8_ON_ONE_B200,
        &["--fp8-recipe", "tensorwise", "--top", "1"],
    ));
    says(&plan, &["--fp8-recipe tensorwise", "fp8(tensorwise)"]);
    // Run tables: the column, else Megatron-LM's CI name, else the GPU's.
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("runs.csv");
    std::fs::write(
        &table,
        "gpus,gpu,global_batch,micro_batch,layers,hidden,heads,seq_len,vocab,tp,pp,precision,fp8_recipe\n\
         8,h100-sxm,32,4,4,1024,16,2048,32000,1,1,fp8,delayed\n\
         8,h100-sxm,32,4,4,1024,16,2048,32000,1,1,bf16+fp8-hybrid-blockwise,\n\
         8,h100-sxm,32,4,4,1024,16,2048,32000,1,1,fp8,\n",
    )
    .unwrap();
    let out = ok(&["predict", "--runs", table.to_str().unwrap()]);
    let times: Vec<f64> = out
        .lines()
        .skip(1)
        .map(|row| row.split(',').nth(13).unwrap().parse().unwrap())
        .collect();
    // Delayed casts only; tensor-wise (H100's default) adds its amax reads;
    // blockwise adds its scales, and on Hopper its GEMMs rescale in the
    // main loop (the slowest of the three).
    assert!(times[0] < times[2] && times[2] < times[1], "{out}");
}

#[test]
fn run_tables_read_experts_context_and_precision_columns() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("runs.csv");
    // A Mixtral-like layer on 8 GPUs with ep 4, one with cp 2, one in FP8.
    std::fs::write(
        &table,
        "gpus,gpu,global_batch,micro_batch,layers,hidden,heads,seq_len,vocab,tp,pp,cp,ep,etp,num_experts,moe_topk,moe_ffn_hidden,precision,sequence_parallel,peak_allocated_gib\n\
         8,h100-sxm,32,4,4,1024,16,2048,32000,2,1,1,4,1,8,2,2048,bf16,on,9.0\n\
         8,h100-sxm,32,4,4,1024,16,2048,32000,2,1,2,,,,,,bf16,on,4.0\n\
         8,h100-sxm,32,4,4,1024,16,2048,32000,2,1,1,,,,,,bf16+fp8-hybrid-tensorwise,on,4.0\n",
    )
    .unwrap();
    let out = ok(&["evaluate", "--runs", table.to_str().unwrap()]);
    says(
        &out,
        &[
            "rows with a measured peak memory 3",
            "dense: 1 rows",
            "context-parallel: 1 rows",
            "mixture of experts: 1 rows",
        ],
    );
    // An ep that does not divide the experts is the row's error.
    std::fs::write(
        &table,
        "gpus,global_batch,micro_batch,layers,hidden,heads,seq_len,vocab,tp,pp,ep,num_experts,iter_ms\n\
         8,32,4,4,1024,16,2048,32000,1,1,3,8,100\n",
    )
    .unwrap();
    says(
        &fails(&[
            "evaluate",
            "--runs",
            table.to_str().unwrap(),
            "--gpu",
            "h100-sxm",
        ]),
        &["line 2", "ep 3 must divide the 8 experts"],
    );
}

#[test]
fn deepseek_v3_plans_its_prediction_module_and_can_leave_it_out() {
    let job = [
        "predict",
        "--model",
        "deepseek-v3",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "32",
        "--global-batch",
        "512",
        "--tp",
        "4",
        "--pp",
        "8",
        "--first-stage-layers",
        "6",
        "--last-stage-layers",
        "7",
        "--ep",
        "8",
        "--etp",
        "1",
        "--sequence-parallel",
        "on",
        "--optimizer-sharding",
        "optimizer-states",
        "--format",
        "json",
    ];
    let run = |extra: &[&str]| -> serde_json::Value {
        serde_json::from_str(&ok(&with(&job, extra))).unwrap()
    };
    let (with_mtp, without) = (run(&[]), run(&["--mtp-layers", "0"]));
    let args = |v: &serde_json::Value| v["megatron_args"].to_string();
    says(&args(&with_mtp), &["--mtp-num-layers", "\"1\""]);
    assert!(!args(&without).contains("--mtp-num-layers"));
    let time = |v: &serde_json::Value| v["prediction"]["iteration_s"].as_f64().unwrap();
    assert!(time(&with_mtp) > time(&without));
    // Planned for torchtitan, which has no prediction modules, the model
    // is refused with the fix, instead of ranking what cannot be exported.
    let titan = [
        "plan",
        "--model",
        "deepseek-v3",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "32",
        "--global-batch",
        "512",
        "--engine",
        "torchtitan",
        "--top",
        "1",
    ];
    says(
        &fails(&titan),
        &[
            "torchtitan engine cannot run multi-token prediction",
            "--mtp-layers 0",
        ],
    );
    let without = ok(&with(&titan, &["--mtp-layers", "0"]));
    says(&without, &["engine=torchtitan", "name = \"deepseek_v3\""]);
}

#[test]
fn explain_takes_every_new_dimension() {
    let plan = with(&with(&["plan"], &MIXTRAL_ON_64), &["--top", "1"]);
    let out = ok(&with(
        &plan,
        &["--explain", "ep=4,etp=1,dispatch=alltoall,precision=fp8"],
    ));
    says(&out, &["Explain ", "ep4 etp1", "dispatch=alltoall", "fp8"]);
    // A new cp keeps the GPU count: dp shrinks by it.
    let out = ok(&with(&plan, &["--explain", "cp=2,cp_comm=a2a"]));
    says(&out, &["cp2 ", "cp-comm=a2a"]);
    let bad = fails(&with(&plan, &["--explain", "ep=x"]));
    says(&bad, &["--explain: ep must be a whole number"]);
}

/// The EP comm line of a `predict` table, in milliseconds.
fn expert_parallel_ms(out: &str) -> f64 {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("expert-parallel comm"))
        .unwrap_or_else(|| panic!("no expert-parallel line in:\n{out}"));
    let mut words = line.split_whitespace().skip(2);
    let (value, unit) = (words.next().unwrap(), words.next().unwrap());
    let value: f64 = value.parse().unwrap();
    match unit {
        "s" => value * 1e3,
        "ms" => value,
        other => panic!("unit {other}"),
    }
}

/// DeepEP's flex dispatcher sends a token once per remote node its
/// experts are on, where all-to-all sends it once per expert: with
/// DeepSeek-V3's node-limited routing (4 of 8 groups) over 8 nodes the
/// network carries about half. The plan exports the flex backend and the
/// router groups.
#[test]
fn deepeps_flex_dispatcher_moves_each_token_once_per_node() {
    let job = [
        "predict",
        "--model",
        "deepseek-v3",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "64",
        "--global-batch",
        "512",
        "--tp",
        "1",
        "--pp",
        "1",
        "--ep",
        "64",
        "--micro-batch",
        "1",
        "--recompute",
        "full",
        "--optimizer-sharding",
        "optimizer-states",
    ];
    let alltoall = expert_parallel_ms(&ok(&with(&job, &["--moe-dispatcher", "alltoall"])));
    let flex = expert_parallel_ms(&ok(&with(&job, &["--moe-dispatcher", "flex"])));
    assert!(
        flex < 0.65 * alltoall && flex > 0.35 * alltoall,
        "flex {flex} ms against alltoall {alltoall} ms"
    );
    // Unlimited routing reaches more nodes: flex then saves less.
    let unlimited = with(
        &job,
        &[
            "--moe-router-num-groups",
            "0",
            "--moe-router-group-topk",
            "0",
        ],
    );
    let flex_unlimited = expert_parallel_ms(&ok(&with(&unlimited, &["--moe-dispatcher", "flex"])));
    assert!(flex_unlimited > flex, "{flex_unlimited} against {flex}");
    let plan_with = |dispatcher: &str| {
        ok(&with(
            &with(&["plan"], &DEEPSEEK_V3_ON_128_H100),
            &[
                "--global-batch",
                "512",
                "--tp",
                "1",
                "--pp",
                "16",
                "--ep",
                "64",
                "--moe-dispatcher",
                dispatcher,
                "--top",
                "1",
            ],
        ))
    };
    let plan = plan_with("flex");
    says(
        &plan,
        &[
            "--moe-token-dispatcher-type flex",
            "--moe-flex-dispatcher-backend deepep",
            "--moe-router-num-groups 8",
            "--moe-router-group-topk 4",
        ],
    );
    // DeepEP has configs for some group sizes only; HybridEP has no such table.
    let all_256 = [
        "predict",
        "--model",
        "deepseek-v3",
        "--gpu",
        "h100-sxm",
        "--gpus",
        "256",
        "--global-batch",
        "512",
        "--tp",
        "1",
        "--pp",
        "1",
        "--ep",
        "256",
        "--recompute",
        "full",
        "--optimizer-sharding",
        "optimizer-states",
    ];
    says(
        &fails(&with(&all_256, &["--moe-dispatcher", "flex"])),
        &[
            "DeepEP kernels run etp x ep groups of 2, 4, 8",
            "not 1 x 256 = 256",
        ],
    );
    ok(&with(&all_256, &["--moe-dispatcher", "hybridep"]));
    // HybridEP moves the same tokens, and exports as flex with its backend.
    let hybrid = expert_parallel_ms(&ok(&with(&job, &["--moe-dispatcher", "hybridep"])));
    assert_eq!(hybrid, flex);
    let hybrid_plan = plan_with("hybridep");
    says(
        &hybrid_plan,
        &[
            "dispatch=hybridep",
            "--moe-token-dispatcher-type flex",
            "--moe-flex-dispatcher-backend hybridep",
        ],
    );
    // Groups that do not split the experts, or too few chosen ones.
    says(
        &fails(&with(&job, &["--moe-router-num-groups", "3"])),
        &["--moe-router-num-groups (3) must divide the 256 experts"],
    );
    says(
        &fails(&with(
            &job,
            &[
                "--moe-router-num-groups",
                "64",
                "--moe-router-group-topk",
                "1",
            ],
        )),
        &[
            "--moe-topk (8) exceeds the 4 experts of 1 groups",
            "--moe-router-group-topk",
        ],
    );
}

/// Megatron-Core's batch-level overlap (`--overlap-moe-expert-parallel-comm`)
/// hides a micro-batch's token dispatch and combine under the compute of the
/// one paired with it, holding one more chunk in flight; it is refused where
/// Megatron-Core asserts against it, and exported with the weight-gradient
/// split it runs with.
#[test]
fn batch_level_overlap_hides_the_expert_all_to_alls() {
    let mixtral = |command: &'static str, extra: &[&'static str]| -> Vec<&'static str> {
        let on_64 = with(&[command], &MIXTRAL_ON_64);
        with(
            &with(&on_64, &["--tp", "1", "--pp", "4", "--ep", "8"]),
            extra,
        )
    };
    let interleaved_alltoall = [
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "4",
        "--moe-dispatcher",
        "alltoall",
    ];
    let job = mixtral("predict", &interleaved_alltoall);
    let off = ok(&with(&job, &["--ep-comm-overlap", "off"]));
    let on = ok(&with(&job, &["--ep-comm-overlap", "on"]));
    let (hidden, exposed) = (expert_parallel_ms(&on), expert_parallel_ms(&off));
    assert!(hidden < 0.5 * exposed, "{hidden} ms against {exposed} ms");
    let peak = |out: &str| -> f64 {
        let at = out.find("peak ").unwrap() + 5;
        out[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(peak(&on) > peak(&off), "{on}");
    says(&on, &["overlap=ep"]);
    // What Megatron-Core asserts against.
    says(
        &fails(&with(
            &job,
            &["--ep-comm-overlap", "on", "--recompute", "full"],
        )),
        &["--ep-comm-overlap on needs --recompute selective"],
    );
    says(
        &fails(&mixtral("predict", &["--ep-comm-overlap", "on"])),
        &["--ep-comm-overlap on needs --moe-dispatcher alltoall"],
    );
    // The search tries it where it runs, and exports its flags.
    let plan = ok(&with(
        &mixtral("plan", &interleaved_alltoall),
        &["--ep-comm-overlap", "on", "--top", "1"],
    ));
    says(
        &plan,
        &[
            "--overlap-moe-expert-parallel-comm",
            "--delay-wgrad-compute",
            "torchtitan cannot run",
            "Megatron-Core's batch-level EP overlap (torchtitan does not pair micro-batches",
        ],
    );
}

/// gpt-oss attends over 128 tokens in every other layer: at long context
/// those layers' attention is nearly free, which `--sliding-window 0` (full
/// attention everywhere) does not see. Exported as Megatron-LM's window
/// flags; the skip frequency needs a window.
#[test]
fn sliding_window_layers_attend_only_to_their_window() {
    let job = [
        "predict",
        "--model",
        "gpt-oss-120b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "4",
        "--global-batch",
        "64",
        "--seq-len",
        "32768",
        "--tp",
        "1",
        "--ep",
        "8",
        "--cp",
        "4",
        "--moe-dispatcher",
        "alltoall",
    ];
    let windowed = iteration_seconds(&ok(&job));
    let full = iteration_seconds(&ok(&with(&job, &["--sliding-window", "0"])));
    assert!(windowed < 0.9 * full, "{windowed} s against {full} s");
    let plan_job = [
        "plan",
        "--model",
        "gpt-oss-20b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "1",
        "--global-batch",
        "64",
        "--top",
        "1",
    ];
    let plan = ok(&plan_job);
    says(&plan, &["--window-size 127,0", "--window-attn-skip-freq 2"]);
    // Its YaRN, which pretrain_gpt.py cannot set, is a note under the
    // heading, outside the arguments, which still paste as they are; the
    // plan file carries it beside them.
    let block: Vec<&str> = plan
        .lines()
        .skip_while(|l| !l.starts_with("Megatron-LM arguments"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert!(
        block[0].starts_with("  note: pretrain_gpt.py has no option for YaRN"),
        "{plan}"
    );
    assert!(
        block[1..]
            .iter()
            .all(|l| l.trim_start().starts_with("--") && !l.contains('#'))
    );
    let file: serde_json::Value =
        serde_json::from_str(&ok(&with(&plan_job, &["--format", "json"]))).unwrap();
    let note = file["megatron_notes"][0].as_str().unwrap_or_default();
    assert!(
        note.starts_with("pretrain_gpt.py has no option for YaRN"),
        "{file}"
    );
    says(
        &fails(&with(
            &with(&["predict"], &LLAMA3_8B_ON_ONE_NODE),
            &["--window-attn-skip-freq", "2"],
        )),
        &[
            "--window-attn-skip-freq needs a windowed attention",
            "--sliding-window N",
        ],
    );
}

/// gpt-oss exports as Megatron-LM builds it: quick-GeGLU clamped at 7 with
/// its offset (never beside --swiglu, which Megatron-LM asserts apart),
/// learnable softmax offsets on cuDNN's fused attention (FlashAttention has
/// none); the clamps price a step above the same model without them, and
/// the flags refuse a model without the activation.
#[test]
fn gpt_oss_exports_its_activation_and_sinks_and_prices_its_clamps() {
    let job = [
        "--model",
        "gpt-oss-20b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "1",
        "--global-batch",
        "64",
    ];
    let plan = ok(&with(&with(&["plan"], &job), &["--top", "1"]));
    says(
        &plan,
        &[
            "--quick-geglu",
            "--activation-func-clamp-value 7",
            "--glu-linear-offset 1",
            "--softmax-type learnable",
            "--attention-backend fused",
        ],
    );
    assert!(!plan.contains("--swiglu"), "{plan}");
    // RMSNorm, no dropout, and the biases gpt-oss's linears carry.
    says(&plan, &["--normalization RMSNorm", "--hidden-dropout 0"]);
    assert!(!plan.contains("--disable-bias-linear"), "{plan}");
    assert!(!plan.contains("--qk-layernorm"), "{plan}");
    // Qwen3 normalises its queries and keys; --qk-layernorm off drops them.
    let qwen = [
        "plan",
        "--model",
        "qwen3-30b-a3b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "1",
        "--global-batch",
        "64",
        "--top",
        "1",
    ];
    says(&ok(&qwen), &["--qk-layernorm", "--disable-bias-linear"]);
    let bare = ok(&with(&qwen, &["--qk-layernorm", "off"]));
    assert!(!bare.contains("--qk-layernorm"), "{bare}");
    let llama = ok(&with(&["plan", "--top", "1"], &LLAMA3_8B_ON_ONE_NODE));
    assert!(
        llama.contains("--swiglu") && llama.contains("--attention-backend flash"),
        "{llama}"
    );
    assert!(!llama.contains("--softmax-type"), "{llama}");

    let one = with(
        &with(&["predict"], &job),
        &["--micro-batch", "1", "--ep", "8"],
    );
    let clamped = iteration_seconds(&ok(&one));
    let unclamped = iteration_seconds(&ok(&with(&one, &["--activation-clamp", "0"])));
    assert!(clamped > unclamped, "{clamped} s against {unclamped} s");
    let plain = ok(&with(
        &with(&["plan", "--top", "1"], &job),
        &["--quick-geglu", "off", "--attention-sinks", "off"],
    ));
    says(&plain, &["--swiglu", "--attention-backend flash"]);
    assert!(!plain.contains("--softmax-type"), "{plain}");
    says(
        &fails(&with(
            &with(&["predict"], &LLAMA3_8B_ON_ONE_NODE),
            &["--activation-clamp", "7"],
        )),
        &[
            "--activation-clamp needs gpt-oss's activation",
            "--quick-geglu on",
        ],
    );
    says(
        &fails(&with(&one, &["--activation-clamp", "-2"])),
        &["--activation-clamp must be"],
    );
    says(
        &fails(&with(&one, &["--gated-mlp", "off"])),
        &[
            "--quick-geglu is a gated MLP",
            "--gated-mlp on",
            "--quick-geglu off",
        ],
    );
    says(
        &fails(&with(&one, &["--glu-linear-offset", "inf"])),
        &["--glu-linear-offset", "`inf` is not a number"],
    );
    // A runner-up's parts are named only where they move the time by what
    // the plan shows: never "-0.0 ms" (Mixtral's third candidate had one).
    let mixtral = ok(&with(&with(&["plan"], &MIXTRAL_ON_64), &["--top", "3"]));
    says(&mixtral, &["#3 "]);
    assert!(
        !mixtral.contains("-0.0 ms") && !mixtral.contains("+0.0 ms"),
        "{mixtral}"
    );
}

/// Run tables carry this stop's columns: the flex dispatcher with router
/// groups, the batch-level EP overlap and a sliding window each price a
/// row below the same row without them.
#[test]
fn run_tables_read_router_groups_ep_overlap_and_windows() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("runs.csv");
    let head = "gpus,gpu,global_batch,micro_batch,layers,hidden,heads,seq_len,vocab,tp,pp,ep,etp,num_experts,moe_topk,moe_ffn_hidden,moe_dispatcher,moe_router_num_groups,moe_router_group_topk,ep_comm_overlap,sliding_window,window_attn_skip_freq,iter_ms";
    let row = "64,h100-sxm,256,1,8,2048,16,4096,32000,1,1,64,1,64,8,1024";
    let rows = [
        "alltoall,,,off,,",
        "flex,8,2,off,,",
        "alltoall,,,on,,",
        "alltoall,,,off,128,2",
    ];
    let text: String = std::iter::once(head.to_string())
        .chain(rows.iter().map(|r| format!("{row},{r},1000")))
        .map(|line| line + "\n")
        .collect();
    std::fs::write(&table, text).unwrap();
    let out = ok(&["predict", "--runs", table.to_str().unwrap()]);
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let at = header
        .iter()
        .position(|c| *c == "predicted_iter_ms")
        .unwrap();
    let ms: Vec<f64> = lines
        .map(|l| l.split(',').nth(at).unwrap().parse().unwrap())
        .collect();
    assert_eq!(ms.len(), 4, "{out}");
    for (i, faster) in ms.iter().enumerate().skip(1) {
        assert!(*faster < ms[0], "row {i}: {faster} ms against {} ms", ms[0]);
    }
    // A skip frequency without a window is the row's error.
    std::fs::write(&table, format!("{head}\n{row},alltoall,,,off,,2,1000\n")).unwrap();
    says(
        &fails(&["predict", "--runs", table.to_str().unwrap()]),
        &[
            "line 2",
            "`window_attn_skip_freq` needs a windowed attention",
        ],
    );
}

/// Megatron-LM's hierarchical context parallelism: an all-to-all among the
/// cp ranks of a node, then a ring between nodes. The group is the cp ranks
/// beside their tp ranks on a node; with no room for one it is refused.
#[test]
fn hierarchical_context_parallelism_rings_between_node_groups() {
    let job = |tp: &'static str, cp: &'static str| {
        vec![
            "plan",
            "--model",
            "llama3.1-8b",
            "--gpu",
            "h100-sxm",
            "--nodes",
            "4",
            "--global-batch",
            "16",
            "--seq-len",
            "131072",
            "--pp",
            "1",
            "--cp",
            cp,
            "--cp-comm",
            "a2a+p2p",
            "--tp",
            tp,
            "--top",
            "1",
        ]
    };
    says(
        &ok(&job("1", "16")),
        &[
            "cp-comm=a2a+p2p cp-a2a=8",
            "--cp-comm-type a2a+p2p",
            "--hierarchical-context-parallel-sizes 8 2",
        ],
    );
    // tp 8 fills the node: no cp rank shares it, so there is no group.
    let mut predict = job("8", "4");
    predict[0] = "predict";
    predict.truncate(predict.len() - 2);
    says(
        &fails(&predict),
        &["--cp-comm a2a+p2p needs an all-to-all group", "got 1"],
    );
}

/// NeMo's Llama 3.1 405B recipe runs 126 layers at pp 8 x v 8: only
/// Megatron-LM's account-for split (the embedding and the loss a layer
/// each, 15 + 16 x 6 + 15) divides them, and the plan exports it.
#[test]
fn a_pipeline_that_needs_the_account_for_split_plans_and_exports_it() {
    let out = ok(&[
        "plan",
        "--model",
        "llama3-405b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "128",
        "--global-batch",
        "512",
        "--tp",
        "8",
        "--pp",
        "8",
        "--cp",
        "2",
        "--schedule",
        "interleaved",
        "--virtual-stages",
        "8",
        "--top",
        "1",
    ]);
    says(
        &out,
        &[
            "15/16/15",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
            "--num-virtual-stages-per-pipeline-rank 8",
        ],
    );
    assert!(
        !out.contains("--decoder-first-pipeline-num-layers"),
        "{out}"
    );
}

/// FP8 weights (`--fp8-param-gather`) replace the 16-bit weights and
/// Transformer Engine's FP8 copies with FP8 data and its transpose: 2
/// bytes a layer weight fewer. They need sharded optimizer states.
#[test]
fn fp8_weights_save_two_bytes_a_weight_and_need_sharded_states() {
    let predict = |gather: &'static str, sharding: &'static str| {
        with(
            &with(&["predict"], &LLAMA3_8B_ON_ONE_NODE),
            &[
                "--precision",
                "fp8",
                "--optimizer-sharding",
                sharding,
                "--fp8-param-gather",
                gather,
                "--recompute",
                "full",
            ],
        )
    };
    let weights =
        |gather: &'static str| stage_zero_cell(&ok(&predict(gather, "optimizer-states")), 1);
    let (on, off) = (weights("on"), weights("off"));
    // Llama 3 8B's layers hold 6.98 B weights: 2 bytes each is 13.0 GiB.
    let saved = off - on;
    assert!((saved - 13.0).abs() < 0.2, "on {on} off {off}");
    says(
        &fails(&predict("on", "none")),
        &["--fp8-param-gather on needs sharded optimizer states"],
    );
    let mut plan = with(&["plan"], &LLAMA3_8B_ON_ONE_NODE);
    plan.extend([
        "--precision",
        "fp8",
        "--optimizer-sharding",
        "optimizer-states",
        "--top",
        "1",
    ]);
    says(&ok(&plan), &["--fp8-param-gather", "fp8-weights"]);
}

/// DeepSeek-V3 at NeMo's pp 8 x v 4: its 61 layers, embedding, prediction
/// module and loss make 64 slots of 2, which only a pipeline layout says.
#[test]
fn deepseek_v3_at_pp8_v4_plans_with_a_pipeline_layout() {
    let out = ok(&with(
        &with(&["plan"], &DEEPSEEK_V3_ON_128_H100),
        &[
            "--global-batch",
            "8192",
            "--tp",
            "2",
            "--pp",
            "8",
            "--ep",
            "64",
            "--schedule",
            "interleaved",
            "--virtual-stages",
            "4",
            "--optimizer-sharding",
            "optimizer-states",
            "--top",
            "1",
        ],
    ));
    says(
        &out,
        &[
            "7/8/6",
            "--pipeline-model-parallel-layout 'Et|(tt|)*22t|(tt|)*7tmL'",
        ],
    );
    assert!(
        !out.contains("--num-virtual-stages-per-pipeline-rank"),
        "{out}"
    );
}

/// Llama 3 70B on 64 GB200s without a pipeline, as Megatron-Bridge runs it.
const LLAMA3_70B_ON_64_GB200: [&str; 12] = [
    "--model",
    "llama3-70b",
    "--gpu",
    "gb200",
    "--gpus",
    "64",
    "--global-batch",
    "128",
    "--tp",
    "1",
    "--pp",
    "1",
];

/// Gradients reduced in bf16 halve Megatron-LM's gradient buffer and
/// export `--grad-reduce-in-bf16`; offloaded layers' activations leave the
/// GPU, their copies show in the time, the plan exports the layer count,
/// and what Megatron-Core refuses is refused with the flag named.
#[test]
fn bf16_gradients_and_cpu_offloading_predict_plan_and_export() {
    let predict = |extra: &[&'static str]| {
        let mut args = with(&["predict"], &LLAMA3_70B_ON_64_GB200);
        args.extend(["--optimizer-sharding", "full", "--micro-batch", "2"]);
        args.extend(extra);
        args
    };
    let fp32 = ok(&predict(&[]));
    let bf16 = ok(&predict(&["--grad-reduce", "bf16"]));
    let (g32, g16) = (stage_zero_cell(&fp32, 2), stage_zero_cell(&bf16, 2));
    assert!((g16 - g32 / 2.0).abs() < 0.02, "gradients {g32} -> {g16}");
    let offloaded = ok(&predict(&["--cpu-offload-layers", "40"]));
    says(&offloaded, &["offload=40"]);
    let (all, half) = (stage_zero_cell(&fp32, 4), stage_zero_cell(&offloaded, 4));
    assert!(
        half < 0.55 * all && half > 0.45 * all,
        "activations {all} -> {half}"
    );

    let plan = ok(&[
        "plan",
        "--model",
        "llama3-8b",
        "--gpu",
        "gb200",
        "--gpus",
        "8",
        "--global-batch",
        "16",
        "--pp",
        "1",
        "--grad-reduce",
        "bf16",
        "--cpu-offload-layers",
        "16",
        "--optimizer-sharding",
        "optimizer-states",
        "--top",
        "1",
    ]);
    says(
        &plan,
        &["--grad-reduce-in-bf16", "--cpu-offloading-num-layers 16"],
    );

    says(
        &fails(&predict(&["--cpu-offload-layers", "80"])),
        &["--cpu-offload-layers 80", "at most 79"],
    );
    let mut pipelined = predict(&["--cpu-offload-layers", "10"]);
    let pp = pipelined.iter().position(|a| *a == "--pp").unwrap();
    pipelined[pp + 1] = "2";
    says(&fails(&pipelined), &["--cpu-offload-layers 10", "pp 1"]);
    says(
        &fails(&predict(&["--grad-reduce", "fp16"])),
        &["--grad-reduce", "fp32, bf16"],
    );
}

/// gpt-oss's recipe recomputes its norms and its experts' activation:
/// they keep less, the plan exports Megatron-LM's --recompute-modules, and
/// a module the model lacks or a misspelt one is refused by its flag.
#[test]
fn recompute_modules_keep_less_and_export() {
    let base = [
        "--model",
        "gpt-oss-20b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "1",
        "--global-batch",
        "64",
        "--tp",
        "1",
        "--pp",
        "1",
        "--ep",
        "8",
        "--recompute",
        "selective",
    ];
    let activations = |out: &str| stage_zero_cell(out, 4);
    let core = ok(&with(&["predict"], &base));
    let mut args = with(&["predict"], &base);
    args.extend(["--recompute-modules", "layernorm,moe_act"]);
    let modules = ok(&args);
    says(&modules, &["modules=layernorm+moe_act"]);
    assert!(activations(&modules) < activations(&core));

    let mut plan = with(&["plan"], &base);
    plan.extend(["--recompute-modules", "layernorm,moe_act", "--top", "1"]);
    says(&ok(&plan), &["--recompute-modules layernorm moe_act"]);

    let mut dense = with(&["predict"], &LLAMA3_8B_ON_ONE_NODE);
    dense.extend(["--recompute", "selective", "--recompute-modules", "moe_act"]);
    says(
        &fails(&dense),
        &["--recompute-modules moe_act", "mixture of experts"],
    );
    let mut misspelt = with(&["predict"], &base);
    misspelt.extend(["--recompute-modules", "moe_acts"]);
    says(&fails(&misspelt), &["--recompute-modules", "moe_act"]);
}

/// Megatron-LM's fused cross-entropy: Transformer Engine's kernel keeps
/// the 16-bit logits alone (a third of the unfused loss's 6 bytes a logit),
/// the plan exports its two flags, and torchtitan, whose loss is PyTorch's,
/// is refused with the flag named.
#[test]
fn fused_cross_entropy_keeps_a_third_of_the_logits_and_exports() {
    let predict = |extra: &[&'static str]| {
        let mut args = with(&["predict"], &LLAMA3_8B_ON_ONE_NODE);
        args.extend(["--tp", "1", "--pp", "1", "--micro-batch", "1"]);
        args.extend(extra);
        args
    };
    let loss_column = 6;
    let off = stage_zero_cell(&ok(&predict(&[])), loss_column);
    let te = ok(&predict(&["--cross-entropy-fusion", "te"]));
    says(&te, &["ce-fusion=te"]);
    let fused = stage_zero_cell(&te, loss_column);
    assert!(
        (fused - off / 3.0).abs() < 0.02,
        "loss memory {off} -> {fused}"
    );
    let native = stage_zero_cell(
        &ok(&predict(&["--cross-entropy-fusion", "native"])),
        loss_column,
    );
    assert!(native > off, "native {native} against unfused {off}");

    let plan = ok(&with(
        &["plan"],
        &with(
            &LLAMA3_8B_ON_ONE_NODE,
            &["--cross-entropy-fusion", "te", "--top", "1"],
        ),
    ));
    says(
        &plan,
        &[
            "--cross-entropy-loss-fusion",
            "--cross-entropy-fusion-impl te",
        ],
    );
    says(
        &fails(&predict(&["--cross-entropy-fusion", "liger"])),
        &["--cross-entropy-fusion", "off, native, te"],
    );
    says(
        &fails(&predict(&[
            "--engine",
            "torchtitan",
            "--cross-entropy-fusion",
            "te",
        ])),
        &["--cross-entropy-fusion te", "--cross-entropy-fusion off"],
    );
}

/// A run table's `cross_entropy_fusion` column sets the loss's kernel: the
/// same run with Transformer Engine's is predicted to hold less, and a name
/// the column does not know is the row's error, naming the column.
#[test]
fn run_tables_read_the_cross_entropy_fusion_column() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("runs.csv");
    let header = "gpus,gpu,global_batch,micro_batch,layers,hidden,heads,seq_len,vocab,tp,pp,cross_entropy_fusion,peak_allocated_gib\n";
    std::fs::write(
        &table,
        format!(
            "{header}8,h100-sxm,32,4,4,1024,16,2048,128256,1,1,off,9.0\n\
             8,h100-sxm,32,4,4,1024,16,2048,128256,1,1,te,9.0\n"
        ),
    )
    .unwrap();
    let predicted = predicted_allocated(&table, &[]);
    // 4 x 2,048 tokens x 128,256 logits x (6 - 2) bytes.
    let saved = 4.0 * 2048.0 * 128_256.0 * 4.0;
    assert_eq!(predicted.len(), 2);
    assert!(
        (predicted[0] - predicted[1] - saved).abs() < 0.01 * saved,
        "{predicted:?}"
    );
    std::fs::write(
        &table,
        format!("{header}8,h100-sxm,32,4,4,1024,16,2048,128256,1,1,fused,9.0\n"),
    )
    .unwrap();
    says(
        &fails(&["evaluate", "--runs", table.to_str().unwrap()]),
        &[
            "line 2",
            "`cross_entropy_fusion` must be one of off, native, te",
        ],
    );
}

/// Deferring the output layer's weight gradient keeps, on the last stage,
/// each earlier micro-batch's 16-bit logits gradient and the layer's input
/// until the flush: up to the limit, and all but the last without one. A
/// run table's `wgrad_deferral` column sets it.
#[test]
fn deferred_embedding_wgrad_keeps_the_earlier_logits_gradients() {
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("runs.csv");
    let header = "gpus,gpu,global_batch,micro_batch,layers,hidden,heads,seq_len,vocab,tp,pp,sequence_parallel,wgrad_deferral,peak_allocated_gib\n";
    let row = "4,h100-sxm,32,4,4,1024,16,2048,128256,2,2,off";
    std::fs::write(
        &table,
        format!("{header}{row},off,9.0\n{row},2,9.0\n{row},all,9.0\n"),
    )
    .unwrap();
    let predicted = predicted_allocated(&table, &["--memory-rank", "last"]);
    assert_eq!(predicted.len(), 3);
    // 4 x 2,048 tokens, 2 bytes each for 64,128 logits per tp rank and
    // 1,024 inputs, per micro-batch held.
    let per_micro_batch = 2.0 * 4.0 * 2048.0 * (128_256.0 / 2.0 + 1024.0);
    // 32 / (4 x dp 1) = 8 micro-batches: a limit of 2 holds 2, all holds 7.
    for (row, held) in [(1, 2.0), (2, 7.0)] {
        let added = predicted[row] - predicted[0];
        assert!(
            (added - held * per_micro_batch).abs() < 0.001 * added,
            "{predicted:?}"
        );
    }
    std::fs::write(&table, format!("{header}{row},0,9.0\n")).unwrap();
    says(
        &fails(&["evaluate", "--runs", table.to_str().unwrap()]),
        &["line 2", "`wgrad_deferral` must be off, all or a number"],
    );
}

/// `--wgrad-deferral` exports as Megatron-LM's flags, needs a pipeline and
/// Megatron-LM, and names itself when its value is wrong.
#[test]
fn wgrad_deferral_exports_and_says_what_it_needs() {
    let predict = |extra: &[&'static str]| {
        let mut args = with(&["predict"], &LLAMA3_8B_ON_ONE_NODE);
        args.extend(["--tp", "1", "--micro-batch", "1"]);
        args.extend(extra);
        args
    };
    says(
        &ok(&predict(&["--pp", "2", "--wgrad-deferral", "2"])),
        &["wgrad-deferral=2"],
    );
    says(
        &fails(&predict(&["--pp", "1", "--wgrad-deferral", "all"])),
        &[
            "--wgrad-deferral all",
            "--pp of 2 or more",
            "--wgrad-deferral off",
        ],
    );
    says(
        &fails(&predict(&["--pp", "2", "--wgrad-deferral", "0"])),
        &["--wgrad-deferral", "off, all or a number"],
    );
    says(
        &fails(&predict(&[
            "--engine",
            "torchtitan",
            "--pp",
            "2",
            "--wgrad-deferral",
            "all",
        ])),
        &["--wgrad-deferral all", "--wgrad-deferral off"],
    );
    let plan = ok(&with(
        &["plan"],
        &with(
            &LLAMA3_8B_ON_ONE_NODE,
            &["--pp", "2", "--wgrad-deferral", "3", "--top", "1"],
        ),
    ));
    says(
        &plan,
        &[
            "--defer-embedding-wgrad-compute",
            "--wgrad-deferral-limit 3",
        ],
    );
}

/// `--recompute-modules auto` lets the plan try the recipes' module sets:
/// its winner is at least as fast as the plain plan's, recomputes a set
/// the model has, and exports it; `predict`, which evaluates one
/// configuration, asks for the modules instead.
#[test]
fn plans_try_the_recipes_module_sets_when_asked() {
    let job = [
        "--model",
        "gpt-oss-120b",
        "--gpu",
        "h100-sxm",
        "--nodes",
        "8",
        "--global-batch",
        "1280",
    ];
    let seconds = |plan: &str| -> f64 {
        let line = plan
            .lines()
            .find(|l| l.trim_start().starts_with("time per iteration:"))
            .unwrap_or_else(|| panic!("no iteration time in\n{plan}"));
        let value = line.split(':').nth(1).unwrap().trim();
        value.trim_end_matches(" s").parse().unwrap()
    };
    let plain = ok(&with(&["plan"], &with(&job, &["--top", "1"])));
    let asked = ok(&with(
        &["plan"],
        &with(&job, &["--top", "1", "--recompute-modules", "auto"]),
    ));
    assert!(seconds(&asked) <= seconds(&plain), "{asked}\n{plain}");
    let winner = asked
        .lines()
        .find(|l| l.starts_with("Why #1 wins:"))
        .unwrap();
    // The one-line form joins the modules with `+`, the export with spaces.
    let modules = winner
        .split_whitespace()
        .find_map(|w| w.strip_prefix("modules="))
        .unwrap_or("core_attn")
        .replace('+', ",");
    assert!(
        ["core_attn", "layernorm,moe_act", "moe_act"].contains(&modules.as_str()),
        "{winner}"
    );
    if modules != "core_attn" {
        says(
            &asked,
            &[&format!(
                "--recompute-modules {}",
                modules.replace(',', " ")
            )],
        );
    }
    says(
        &fails(&with(
            &["predict"],
            &with(
                &job,
                &["--recompute", "selective", "--recompute-modules", "auto"],
            ),
        )),
        &["predict evaluates one configuration", "--recompute-modules"],
    );
}

/// A deferral the search was not asked to try can beat its winner, and the
/// explanation says so: the deferred head GEMMs leave the last stage's
/// passes for its slack at the flush.
#[test]
fn an_explained_deferral_can_run_faster_than_the_winner() {
    let out = ok(&[
        "plan",
        "--model",
        "gpt3-175b",
        "--gpu",
        "a100-80gb",
        "--nodes",
        "16",
        "--global-batch",
        "256",
        "--top",
        "1",
        "--explain",
        "wgrad_deferral=4",
    ]);
    says(
        &out,
        &[
            "wgrad-deferral=4:",
            "would rank first",
            "faster than the search's #1",
        ],
    );
}

/// NVFP4 (`--precision nvfp4`): Blackwell's FP4 tensor cores and
/// Megatron-LM only, refused elsewhere in one line naming the flag;
/// exported as Megatron-LM's `--fp4-format e2m1 --fp4-recipe nvfp4`, and
/// read back from a run table.
#[test]
fn nvfp4_plans_are_checked_exported_and_read_back() {
    let llama_on = |gpu: &'static str, extra: &[&'static str]| {
        let search = [
            "--global-batch",
            "128",
            "--precision",
            "nvfp4",
            "--top",
            "1",
        ];
        llama3_8b_on("plan", gpu, &with(&search, extra))
    };
    says(
        &fails(&llama_on("h100-sxm", &[])),
        &["--precision nvfp4", "h100-sxm has no FP4 tensor cores"],
    );
    says(
        &fails(&llama_on("b200", &["--engine", "torchtitan"])),
        &["--precision nvfp4", "--engine megatron"],
    );
    says(
        &fails(&llama_on("b200", &["--fp8-recipe", "mxfp8"])),
        &["--fp8-recipe mxfp8: no candidate runs FP8"],
    );
    says(
        &fails(&llama_on(
            "b200",
            &[
                "--tp",
                "2",
                "--sequence-parallel",
                "on",
                "--tp-comm-overlap",
                "on",
            ],
        )),
        &["--precision nvfp4 needs --tp-comm-overlap off"],
    );
    let plan = ok(&llama_on("gb300", &[]));
    says(
        &plan,
        &[
            "--fp4-format e2m1",
            "--fp4-recipe nvfp4",
            "--fp4-param-gather",
        ],
    );
    assert!(!plan.contains("--fp8-format"), "{plan}");
    assert!(!plan.contains("--fp8-param-gather"), "{plan}");
    let sixteen_bit_weights = ok(&llama_on("gb300", &["--fp8-param-gather", "off"]));
    assert!(!sixteen_bit_weights.contains("--fp4-param-gather"));
    assert!(!plan.contains("--tp-comm-overlap"), "{plan}");

    // A run table's nvfp4 row is predicted; an MXFP4 one is left out.
    let dir = tempfile::tempdir().unwrap();
    let runs = dir.path().join("runs.csv");
    std::fs::write(
        &runs,
        "model,gpu,gpus,global_batch,micro_batch,tp,pp,precision,tokens_per_s_per_gpu\n\
         llama3-8b,b200,8,128,1,1,1,nvfp4,40000\n\
         llama3-8b,b200,8,128,1,1,1,mxfp4,40000\n\
         llama3-8b,b200,8,128,1,1,1,fp8,30000\n",
    )
    .unwrap();
    let out = ok(&["evaluate", "--runs", runs.to_str().unwrap()]);
    says(&out, &["rows with a measured time   2"]);
    // A row whose GPU comes from the flags is checked against it too.
    std::fs::write(
        &runs,
        "model,gpus,global_batch,micro_batch,tp,pp,precision,tokens_per_s_per_gpu\n\
         llama3-8b,8,128,1,1,1,nvfp4,40000\n\
         llama3-8b,8,128,1,1,1,bf16,30000\n",
    )
    .unwrap();
    let on_hopper = ["--gpu", "h100-sxm", "--nodes", "1"];
    let out = ok(&with(
        &["evaluate", "--runs", runs.to_str().unwrap()],
        &on_hopper,
    ));
    says(&out, &["rows with a measured time   1"]);
    // --explain refuses a precision the GPU lacks.
    let explain = with(
        &llama3_8b_on("plan", "h100-sxm", &["--global-batch", "64"]),
        &["--explain", "precision=nvfp4"],
    );
    says(
        &fails(&explain),
        &["--explain: `precision nvfp4`", "no FP4 tensor cores"],
    );
}

/// Qwen3-30B-A3B on two GB300 trays (8 GPUs) at ep 8.
const QWEN3_30B_ON_8_GB300: [&str; 10] = [
    "--model",
    "qwen3-30b-a3b",
    "--gpu",
    "gb300",
    "--gpus",
    "8",
    "--global-batch",
    "512",
    "--ep",
    "8",
];

/// [`QWEN3_30B_ON_8_GB300`] as NVIDIA's MXFP8 recipe runs it with HybridEP,
/// predicted with `extra`.
fn qwen3_30b_on_8_gb300(extra: &[&str]) -> serde_json::Value {
    let mut args = with(&["predict"], &QWEN3_30B_ON_8_GB300);
    args.extend([
        "--micro-batch",
        "4",
        "--precision",
        "fp8",
        "--moe-dispatcher",
        "hybridep",
        "--optimizer-sharding",
        "optimizer-states",
        "--format",
        "json",
    ]);
    args.extend(extra);
    serde_json::from_str(&ok(&args)).unwrap()
}

/// `--cuda-graphs full` (Megatron-LM's `--cuda-graph-impl full_iteration`)
/// leaves the host nothing per layer, MoE dispatch included, exports the
/// sync-free experts it needs, and is refused where it cannot run.
#[test]
fn a_whole_iteration_graph_runs_sync_free_experts() {
    let layers = qwen3_30b_on_8_gb300(&["--cuda-graphs", "on"]);
    let whole = qwen3_30b_on_8_gb300(&["--cuda-graphs", "full"]);
    let host = |p: &serde_json::Value| p["prediction"]["time"]["host"].as_f64().unwrap();
    let iteration = |p: &serde_json::Value| p["prediction"]["iteration_s"].as_f64().unwrap();
    assert!(
        host(&whole) < host(&layers) / 2.0,
        "{} vs {}",
        host(&whole),
        host(&layers)
    );
    assert!(iteration(&whole) < iteration(&layers));
    assert_eq!(whole["config"]["cuda_graphs"], "full");
    let args: Vec<String> = serde_json::from_value(whole["megatron_args"].clone()).unwrap();
    let joined = args.join(" ");
    for part in [
        "--cuda-graph-impl full_iteration",
        "--moe-flex-dispatcher-backend hybridep",
        "--use-transformer-engine-op-fuser",
        "--moe-expert-rank-capacity-factor 1.5",
        "--moe-paged-stash",
    ] {
        assert!(joined.contains(part), "{part} missing: {joined}");
    }
    // The batch-level EP overlap runs beside the scoped per-layer graphs,
    // as NVIDIA's MoE recipes run them.
    let overlapped = qwen3_30b_on_8_gb300(&["--cuda-graphs", "on", "--ep-comm-overlap", "on"]);
    let overlapped: Vec<String> =
        serde_json::from_value(overlapped["megatron_args"].clone()).unwrap();
    assert!(overlapped.contains(&"--overlap-moe-expert-parallel-comm".to_string()));
    let layer_args: Vec<String> = serde_json::from_value(layers["megatron_args"].clone()).unwrap();
    // Megatron-LM captures a dropless MoE module whole only sync-free: the
    // per-layer graphs of an MoE model leave the experts out.
    assert!(layer_args.join(" ").contains(
        "--cuda-graph-impl transformer_engine --cuda-graph-scope attn moe_router moe_preprocess"
    ));
    assert!(!layer_args.contains(&"--moe-paged-stash".to_string()));

    // An MoE layer that syncs the host cannot be captured whole.
    let e = fails(&with(
        &with(&["predict"], &QWEN3_30B_ON_8_GB300),
        &["--moe-dispatcher", "alltoall", "--cuda-graphs", "full"],
    ));
    says(
        &e,
        &[
            "--cuda-graphs full",
            "--moe-dispatcher hybridep",
            "alltoall",
        ],
    );
    // torchtitan's graphs are its own `on`.
    let predict_llama =
        |extra: &[&'static str]| with(&with(&["predict"], &LLAMA3_8B_ON_ONE_NODE), extra);
    let e = fails(&predict_llama(&[
        "--engine",
        "torchtitan",
        "--cuda-graphs",
        "full",
    ]));
    says(&e, &["torchtitan", "--cuda-graphs full"]);
    // Megatron-LM captures full recomputation only in a whole iteration.
    let e = fails(&predict_llama(&[
        "--recompute",
        "full",
        "--cuda-graphs",
        "on",
    ]));
    says(&e, &["--recompute full", "--cuda-graphs full"]);
    ok(&predict_llama(&[
        "--recompute",
        "full",
        "--cuda-graphs",
        "full",
    ]));
    let e = fails(&predict_llama(&["--cuda-graphs", "always"]));
    says(&e, &["--cuda-graphs", "on, off or full", "always"]);
}

/// The search tries a whole iteration's graph when asked, and a run table
/// reads it from its `cuda_graphs` column.
#[test]
fn whole_iteration_graphs_are_searched_and_read_from_run_tables() {
    let best = |graphs: &str| -> (String, f64) {
        let plan = with(&["plan"], &QWEN3_30B_ON_8_GB300);
        let plan = with(
            &plan,
            &[
                "--moe-dispatcher",
                "hybridep",
                "--cuda-graphs",
                graphs,
                "--top",
                "1",
                "--format",
                "json",
            ],
        );
        let plan: serde_json::Value = serde_json::from_str(&ok(&plan)).unwrap();
        let winner = &plan["candidates"][0];
        (
            winner["config"]["cuda_graphs"]
                .as_str()
                .unwrap()
                .to_string(),
            winner["prediction"]["iteration_s"].as_f64().unwrap(),
        )
    };
    let (layers_only, layers_s) = best("on");
    let (either, either_s) = best("on,full");
    assert_eq!(layers_only, "on");
    assert_eq!(either, "full", "the host-free graph wins");
    assert!(either_s < layers_s, "{either_s} vs {layers_s}");

    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("runs.csv");
    std::fs::write(
        &table,
        "model,gpu,gpus,global_batch,micro_batch,tp,pp,seq_len,ep,precision,fp8_recipe,moe_dispatcher,optimizer_sharding,cuda_graphs,iter_ms\n\
         qwen3-30b-a3b,gb300,8,512,4,1,1,4096,8,fp8,mxfp8,hybridep,optimizer-states,on,9000\n\
         qwen3-30b-a3b,gb300,8,512,4,1,1,4096,8,fp8,mxfp8,hybridep,optimizer-states,full_iteration,9000\n",
    )
    .unwrap();
    let out = ok(&["predict", "--runs", table.to_str().unwrap()]);
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let column = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let host = |row: &Vec<&str>| row[column("predicted_host_ms")].parse::<f64>().unwrap();
    assert!(host(&rows[1]) < host(&rows[0]) / 2.0, "{rows:?}");
}

/// Megatron-Core's batch-level EP overlap without a pipeline pairs the next
/// micro-batch's forward layer by layer with this one's backward: one
/// layer more at the peak, not a micro-batch. Megatron-LM's own CI run of it
/// (`..._a2a_ovlp_8experts_etp1_ep4`, H100, the last rank's allocated peak)
/// is the check.
#[test]
fn batch_level_overlap_without_a_pipeline_holds_one_layer_more() {
    let table = common::root().join("tests/data/reference/megatron_ci_runs.csv");
    let text = std::fs::read_to_string(table).unwrap();
    let header = text.lines().next().unwrap();
    let row = text
        .lines()
        .find(|l| l.starts_with("gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4,"))
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("overlap.csv");
    std::fs::write(
        &path,
        format!("{header},moe_dispatcher,ep_comm_overlap\n{row},alltoall,off\n{row},alltoall,on\n"),
    )
    .unwrap();
    let out = ok(&[
        "predict",
        "--runs",
        path.to_str().unwrap(),
        "--memory-rank",
        "last",
    ]);
    let mut lines = out.lines();
    let names: Vec<&str> = lines.next().unwrap().split(',').collect();
    let cell = |line: &str, name: &str| -> f64 {
        let at = names.iter().position(|n| *n == name).unwrap();
        line.split(',').nth(at).unwrap().parse().unwrap()
    };
    let rows: Vec<&str> = lines.collect();
    let predicted = |i: usize| cell(rows[i], "predicted_last_stage_allocated_gib");
    let measured = cell(rows[1], "peak_allocated_gib");
    let (off, on) = (predicted(0), predicted(1));
    // Twelve layers: one more is about a twelfth of the activations.
    assert!(on > off && on - off < 0.1 * off, "{off} -> {on}");
    assert!(
        (on / measured - 1.0).abs() < 0.1,
        "{on} GiB against {measured}"
    );
}
