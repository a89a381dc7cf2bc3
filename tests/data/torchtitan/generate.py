#!/usr/bin/env python3
"""Writes the synthetic torchtitan logs of this folder (see README.md).

The lines are rendered with torchtitan's own f-strings (the step line of
`MetricsProcessor.log`, the logger's `[titan] %(asctime)s - %(name)s -
%(levelname)s - %(message)s`, torchrun's `[rankN]:` prefix); the numbers are
made up. Run it from this folder: `python3 generate.py`.
"""

import json

ESC = "\x1b"
# torchtitan/tools/utils.py Color (0.2.2 and 0.3.0); NoColor is all "".
COLOR = dict(red=f"{ESC}[31m", green=f"{ESC}[32m", blue=f"{ESC}[34m", magenta=f"{ESC}[35m",
             cyan=f"{ESC}[36m", reset=f"{ESC}[39m", orange=f"{ESC}[38;2;180;60;0m",
             turquoise=f"{ESC}[38;2;54;234;195m")
NOCOLOR = {k: "" for k in COLOR}
CAPACITY_GIB = 79.11  # H100 80GB HBM3 as torch reports it


class Clock:
    def __init__(self, start_s):
        self.t = start_s

    def stamp(self, advance=0.013):
        self.t += advance
        whole = int(self.t)
        ms = int(round((self.t - whole) * 1000)) % 1000
        h, rem = divmod(whole, 3600)
        m, s = divmod(rem, 60)
        return f"2026-10-02 {h:02d}:{m:02d}:{s:02d},{ms:03d}"


def record(prefix, clock, message, level="INFO", advance=0.013):
    return f"{prefix}[titan] {clock.stamp(advance)} - root - {level} - {message}\n"


def step_line(step, loss, grad_norm, mem_gib, tps, tflops, mfu, color, grad=True):
    """MetricsProcessor.log's message (0.3.0 metrics.py L521-532; 0.2.2 L461-470)."""
    c = color
    mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"
    pct = 100 * mem_gib / CAPACITY_GIB
    text = f"{c['red']}step: {step:2}  {c['green']}loss: {loss:8.5f}  "
    if grad:
        text += f"{c['orange']}grad_norm: {grad_norm:7.4f}  "
    text += (f"{c['turquoise']}memory: {mem_gib:5.2f}GiB({pct:.2f}%)  "
             f"{c['blue']}tps: {round(tps):,}  {c['cyan']}tflops: {tflops:,.2f}  "
             f"{c['magenta']}mfu: {mfu_str}{c['reset']}")
    return text


def torchrun_banner():
    w = "W1002 14:02:31.101000 812345 torch/distributed/run.py:792] "
    return (f"{w}\n{w}*****************************************\n"
            f"{w}Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
            "to avoid your system being overloaded, please further tune the variable for optimal "
            "performance in your application as needed. \n"
            f"{w}*****************************************\n")


def llama3_8b_args(seq_len):
    return ("TransformerModelArgs(_enforced='This field is used to enforce all fields have defaults.', "
            "dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024, "
            "ffn_dim_multiplier=1.3, norm_eps=1e-05, rope_theta=500000, "
            "rope_scaling_args=RoPEScalingArgs(scaling_factor=8.0, low_freq_factor=1.0, "
            "high_freq_factor=4.0, original_max_position_embeddings=8192), "
            f"max_seq_len={seq_len}, depth_init=True, attn_type='sdpa', attn_mask_type='causal', eos_id=0)")


FLOPS_PER_TOKEN_8B_8K = 57.9e9
PEAK = 989e12


def metrics(tps, flops_per_token):
    tflops = flops_per_token * tps / 1e12
    return tflops, 100 * flops_per_token * tps / PEAK


# 1. torchtitan 0.2.2, Llama 3 8B, FSDP over 8 GPUs, job TOML given with --config.
def fsdp8():
    p = "[rank0]:"
    clock = Clock(14 * 3600 + 2 * 60 + 41)
    out = torchrun_banner()
    out += record(p, clock, "Starting job: Llama 3 8B training")
    out += record(p, clock, "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config", "WARNING")
    out += record(p, clock, "[GC] Initial GC collection 0.00 seconds")
    out += record(p, clock, "Loading tokenizer from tokenizer.json")
    out += record(p, clock, "Preparing c4 dataset from allenai/c4", advance=2.1)
    out += record(p, clock, f"Building llama3 8B with {llama3_8b_args(8192)}", advance=5.3)
    out += record(p, clock, "CUDA capacity: NVIDIA H100 80GB HBM3 with 79.11GiB memory")
    out += record(p, clock, f"{COLOR['blue']}Model llama3 8B {COLOR['red']}size: 8,030,261,248 total parameters{COLOR['reset']}")
    out += record(p, clock, "Applied selective activation checkpointing to the model")
    out += record(p, clock, "Applied FSDP to the model")
    out += record(p, clock, "Peak FLOPS used for computing MFU: 9.890e+14")
    out += record(p, clock, "CUDA memory usage for model: 3.77GiB(4.77%)")
    out += record(p, clock, "Mixed precision training is handled by fsdp")
    out += record(p, clock, "Trainer is initialized with local batch size 1, global batch size 8, gradient accumulation steps 1, sequence length 8192, total steps 100 (warmup 200)")
    out += record(p, clock, "Training starts at step 1")
    rows = [  # step, loss, grad_norm, memory GiB, tps
        (1, 12.24982, 4.1103, 42.13, 1203),
        (10, 10.87321, 2.9914, 61.87, 6102),
        (20, 9.10455, 1.8802, 61.95, 6180),
        (30, 8.33017, 1.2211, 62.04, 6203),
        (40, 7.90133, 1.0498, 62.11, 6191),
        (50, 7.61847, 0.9913, 62.02, 6177),
        (60, 7.40012, 0.9402, 62.04, 6210),
        (70, 7.22501, 0.8877, 62.04, 6188),
        (80, 7.09984, 0.8521, 62.03, 6195),
        (90, 6.98871, 0.8303, 62.04, 6199),
        (100, 6.90027, 0.8110, 62.04, 6186),
    ]
    for step, loss, grad, mem, tps in rows:
        tflops, mfu = metrics(tps, FLOPS_PER_TOKEN_8B_8K)
        out += record(p, clock, step_line(step, loss, grad, mem, tps, tflops, mfu, COLOR), advance=10.6)
        if step == 1:
            out += record(p, clock, "Synchronizing and adjusting timeout for all ProcessGroups to 0:01:40")
    out += record(p, clock, "Sleeping 2 seconds for other ranks to complete")
    out += record(p, clock, "Training completed", advance=2.0)
    out += record(p, clock, "Process group destroyed.")
    return out


# 2. torchtitan 0.3.0, llama3 debugmodel, tp2 pp2 dp2 (8 GPUs), Interleaved1F1B,
#    with --debug.print_config and --metrics.disable_color_printing.
def config_v03(model_spec, training, parallelism, activation_checkpoint, compile_, metrics_):
    return {
        "model_spec": model_spec,
        "hf_assets_path": "./tests/assets/tokenizer",
        "dump_folder": "./outputs",
        "profiler": {"enable_profiling": False, "save_traces_folder": "profile_traces", "profile_freq": 10,
                     "profiler_active": 1, "profiler_warmup": 3, "enable_memory_snapshot": False},
        "metrics": metrics_,
        "tokenizer": {"tokenizer_path": None},
        "dataloader": {"dataset": "c4_test", "dataset_path": None, "num_workers": 0},
        "optimizer": {"param_groups": [{"pattern": ".*", "optimizer_name": "AdamW",
                                        "optimizer_kwargs": {"lr": 0.0008, "betas": [0.9, 0.95], "eps": 1e-08,
                                                             "weight_decay": 0.1}}],
                      "implementation": "fused", "optimizer_factory_kwargs_by_name": {}},
        "lr_scheduler": {"warmup_steps": 2, "total_steps": None, "decay_ratio": 0.8, "decay_type": "linear",
                         "min_lr_factor": 0.0},
        "training": training,
        "parallelism": parallelism,
        "checkpoint": {"enable": False, "folder": "checkpoint", "interval": 10, "initial_load_path": None,
                       "keep_latest_k": 10, "async_mode": "disabled"},
        "activation_checkpoint": activation_checkpoint,
        "compile": compile_,
        "comm": {"init_timeout_seconds": 300, "train_timeout_seconds": 100, "trace_buf_size": 20000,
                 "save_traces_folder": "comm_traces", "save_traces_file_prefix": "rank_", "mode": "default"},
        "validator": {"enable": False, "freq": 10, "steps": -1},
        "debug": {"seed": None, "spmd_typechecking": False, "deterministic": False,
                  "deterministic_warn_only": False, "moe_force_load_balance": False, "detect_anomaly": False,
                  "batch_invariant": False, "print_config": True, "save_config_file": None,
                  "enable_structured_logging": True},
        "override": {"overrides": []},
        "loss": {"name": "cross_entropy"},
    }


def parallelism_v03(**overrides):
    p = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
         "fsdp_reshard_after_forward": "default", "enable_fsdp_symm_mem": False, "tensor_parallel_degree": 1,
         "enable_sequence_parallel": True, "spmd_backend": "spmd_types", "pipeline_parallel_degree": 1,
         "module_fqns_per_model_part": None, "pipeline_parallel_first_stage_less_layers": 1,
         "pipeline_parallel_last_stage_less_layers": 1, "pipeline_parallel_layers_per_stage": None,
         "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_schedule_csv": "",
         "pipeline_parallel_microbatch_size": 1, "context_parallel_degree": 1,
         "context_parallel_load_balancer": "headtail", "context_parallel_ptrr_mask_key": None,
         "expert_parallel_degree": 1}
    p.update(overrides)
    return p


def training_v03(**overrides):
    t = {"local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "max_norm": 1.0, "steps": 10000,
         "enable_cpu_offload": False, "disable_cuda_graphs": False, "dtype": "float32",
         "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32", "gc_freq": 50,
         "gc_debug": False}
    t.update(overrides)
    return t


def llama_model(dim, layers, heads, kv_heads, hidden, vocab):
    linear = {"bias": False}
    return {"dim": dim, "n_layers": layers, "vocab_size": vocab, "tok_embeddings": {},
            "norm": {"eps": 1e-05}, "output": linear,
            "layer": {"attention_norm": {"eps": 1e-05}, "ffn_norm": {"eps": 1e-05},
                      "feed_forward": {"hidden_dim": hidden, "w1": linear, "w2": linear, "w3": linear},
                      "attention": {"n_heads": heads, "n_kv_heads": kv_heads, "wq": linear, "wk": linear,
                                    "wv": linear, "wo": linear, "attn_backend": "sdpa",
                                    "rope_backend": "complex"}},
            "rope": {"dim": dim // heads, "max_seq_len": 131072, "theta": 500000, "backend": "complex",
                     "scaling": "llama"}}


def printed_config(prefix, clock, config):
    text = json.dumps(config, indent=2, ensure_ascii=False)
    lines = text.split("\n")
    out = record(prefix, clock, f"Running with configs: {lines[0]}")
    for line in lines[1:]:
        out += f"{prefix}{line}\n"
    return out


def debug_pp():
    p = "[rank0]:"
    clock = Clock(14 * 3600 + 3 * 60 + 1)
    config = config_v03(
        {"name": "llama3", "flavor": "debugmodel", "model": llama_model(256, 6, 16, None, 768, 2048)},
        training_v03(local_batch_size=8, global_batch_size=32, seq_len=2048, steps=40, disable_cuda_graphs=True),
        parallelism_v03(data_parallel_shard_degree=2, tensor_parallel_degree=2, pipeline_parallel_degree=2,
                        pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_microbatch_size=2),
        {"preserve_rng_state": True, "determinism_check": "default", "debug": False},
        {"enable": True, "enable_async_tensor_parallel": False, "components": ["model", "loss"], "backend": "inductor"},
        {"log_freq": 5, "enable_tensorboard": False, "disable_color_printing": True, "save_tb_folder": "tb",
         "save_for_all_ranks": False, "enable_wandb": False},
    )
    out = torchrun_banner()
    out += record(p, clock, "torchtitan version: 0.3.0 (0.0.0 means __version__ is not defined correctly).")
    out += printed_config(p, clock, config)
    out += record(p, clock, "[GC] Initial GC collection 0.00 seconds")
    out += record(p, clock, "Building llama3 debugmodel", advance=0.4)
    out += record(p, clock, "CUDA capacity: NVIDIA H100 80GB HBM3 with 79.11GiB memory")
    out += record(p, clock, "Model llama3 debugmodel size: 6,163,712 total parameters")
    out += record(p, clock, "Applied Tensor Parallelism to the model")
    out += record(p, clock, "Applied FullAC activation checkpointing to the model")
    out += record(p, clock, "Compiling each TransformerBlock with torch.compile")
    out += record(p, clock, "Applied FSDP to the model")
    out += record(p, clock, "Using pipeline schedule Interleaved1F1B with 4 microbatches and 4 stages.")
    out += record(p, clock, "Pipeline Parallel loss is not visible. Please add rank 4 to LOG_RANK environment variable in run_train.sh.", "WARNING")
    out += record(p, clock, "Peak FLOPS used for computing MFU: 9.890e+14")
    out += record(p, clock, "CUDA memory usage for model: 0.03GiB(0.04%)")
    out += record(p, clock, "Trainer is initialized with local batch size 8, global batch size 32, gradient accumulation steps 2, sequence length 2048, total steps 40 (warmup 2).")
    out += record(p, clock, "Training starts at step 1")
    rows = [(1, 2.31, 3_017), (5, 2.48, 38_250), (10, 2.51, 40_960), (15, 2.52, 41_321), (20, 2.51, 40_512),
            (25, 2.53, 40_877), (30, 2.52, 41_002), (35, 2.52, 40_118), (40, 2.52, 40_733)]
    for step, mem, tps in rows:
        tflops, mfu = metrics(tps, 0.1e9)
        out += record(p, clock, step_line(step, -1.0, 0.0, mem, tps, tflops, mfu, NOCOLOR), advance=0.2)
    out += record(p, clock, "Sleeping 2 seconds for other ranks to complete")
    out += record(p, clock, "Training completed", advance=2.0)
    return out


# 3. torchtitan 0.2.2, Llama 3 8B, tp2 x FSDP 4, the job TOML of (1) with
#    command-line overrides, torchrun's default `[defaultN]:` prefix; killed
#    in the middle of step 12's line.
def killed():
    p = "[default0]:"
    clock = Clock(15 * 3600 + 10 * 60)
    out = ("+ torchrun --nproc_per_node=8 --rdzv_backend c10d --rdzv_endpoint=localhost:0 --local-ranks-filter 0 --tee 3 "
           "-m torchtitan.train --job.config_file ./torchtitan/models/llama3/train_configs/llama3_8b.toml "
           "--parallelism.tensor_parallel_degree 2 --training.local_batch_size 2 --training.steps 30 "
           "--metrics.log_freq 1 --activation_checkpoint.mode full --compile.enable\n")
    out += torchrun_banner()
    out += record(p, clock, "Starting job: Llama 3 8B training")
    out += record(p, clock, f"Building llama3 8B with {llama3_8b_args(8192)}", advance=5.0)
    out += record(p, clock, "Applied Tensor Parallelism to the model")
    out += record(p, clock, "Applied full activation checkpointing to the model")
    out += record(p, clock, "Compiling each TransformerBlock with torch.compile")
    out += record(p, clock, "Applied FSDP to the model")
    out += record(p, clock, "Trainer is initialized with local batch size 2, global batch size 8, gradient accumulation steps 1, sequence length 8192, total steps 30 (warmup 200)")
    out += record(p, clock, "Training starts at step 1")
    tps = [611, 3_102, 3_398, 3_411, 3_405, 3_417, 3_409, 3_402, 3_414, 3_399, 3_407]
    mem = [30.02, 49.87, 50.12, 50.12, 50.13, 50.12, 50.14, 50.12, 50.12, 50.13, 50.12]
    for i, (t, m) in enumerate(zip(tps, mem)):
        tflops, mfu = metrics(t, FLOPS_PER_TOKEN_8B_8K)
        out += record(p, clock, step_line(i + 1, 11.0 - 0.3 * i, 2.0, m, t, tflops, mfu, COLOR), advance=2.4)
    cut = record(p, clock, step_line(12, 7.7, 1.1, 50.12, 3_410, 197.4, 19.96, COLOR), advance=2.4)
    return out + cut[: cut.index("tps: ") + len("tps: 3,4")]


# 4. torchtitan 0.3.0, Llama 3 8B, FSDP over 4 GPUs, configured on the
#    command line only; all four ranks log (no --local-ranks-filter), with
#    binary junk, two ranks' output run together and a corrupted number.
def garbled():
    clock = Clock(16 * 3600)
    ranks = [f"[rank{r}]:" for r in range(4)]
    out = ("+ torchrun --nproc-per-node 4 --rdzv_backend c10d --rdzv_endpoint=localhost:0 --role rank --tee 3 "
           "-m torchtitan.train --module llama3 --config llama3_8b --training.local_batch_size 2 "
           "--training.seq_len 4096 --training.steps 50 --metrics.log_freq 5 --compile.enable "
           "activation-checkpoint:selective\n").encode()
    out += torchrun_banner().encode()

    def everyone(message, advance=0.013):
        text = ""
        for p in ranks:
            text += record(p, clock, message, advance=advance)
        return text.encode()

    out += everyone("torchtitan version: 0.3.0 (0.0.0 means __version__ is not defined correctly).")
    out += everyone("Building llama3 8B", advance=1.0)
    out += b"\x00\x00\x8b\xff\xfe PK\x03\x04 \xc3\x28 garbage from a crashed progress bar \x1b[2K\r\n"
    out += everyone("Applied SelectiveAC activation checkpointing to the model")
    out += everyone("Applied FSDP to the model")
    out += everyone("Trainer is initialized with local batch size 2, global batch size 8, gradient accumulation steps 1, sequence length 4096, total steps 50 (warmup 200).")
    out += everyone("Training starts at step 1")
    flops = 50.1e9
    rows = [(1, 1_150), (5, 7_010), (10, 7_155), (15, 7_160), (20, 7_148), (25, 7_171), (30, 7_152),
            (35, 7_166), (40, 7_149), (45, 7_163), (50, 7_158)]
    for step, tps in rows:
        for r, p in enumerate(ranks):
            mem = 38.4 + 0.01 * step / 5 + 0.25 * r if step > 1 else 21.7
            tflops, mfu = metrics(tps + 3 * r, flops)
            line = record(p, clock, step_line(step, 9.0 - step / 10, 1.0, mem, tps + 3 * r, tflops, mfu, COLOR), advance=0.9)
            if step == 15 and r == 0:
                # rank 0's line cut by rank 2's, which then runs on.
                half = line[: line.index("grad_norm")]
                other = record(ranks[2], clock, step_line(step, 7.5, 1.0, 39.0, 9_999, 500.0, 50.0, COLOR))
                out += (half + other).encode()
                continue
            if step == 30 and r == 0:
                line = line.replace("tps: 7,152", "tps: 7,1\ufffd2")
            out += line.encode()
        if step == 20:
            out += bytes(range(0x80, 0xa0)) + b"\n"
            # The same step logged again (a duplicated buffer).
            tflops, mfu = metrics(tps, flops)
            out += record(ranks[0], clock, step_line(step, 7.0, 1.0, 38.44, tps, tflops, mfu, COLOR)).encode()
    out += everyone("Training completed", advance=2.0)
    return out


# 5. torchtitan 0.2.2 with --job.print_config, killed by an out-of-memory
#    error before its first step line.
def job_config_v02():
    return {
        "job": {"config_file": "./torchtitan/models/llama3/train_configs/llama3_70b.toml", "dump_folder": "./outputs",
                "description": "Llama 3 70B training", "print_config": True, "save_config_file": None,
                "custom_config_module": ""},
        "profiling": {"enable_profiling": False, "save_traces_folder": "profile_traces", "profile_freq": 100,
                      "profiler_active": 1, "profiler_warmup": 3, "enable_memory_snapshot": False,
                      "save_memory_snapshot_folder": "memory_snapshot"},
        "metrics": {"log_freq": 10, "enable_tensorboard": False, "disable_color_printing": False, "save_tb_folder": "tb",
                    "save_for_all_ranks": False, "enable_wandb": False},
        "model": {"name": "llama3", "flavor": "70B", "hf_assets_path": "./assets/hf/Llama-3.1-70B",
                  "tokenizer_path": None, "converters": [], "print_after_conversion": False},
        "optimizer": {"name": "AdamW", "lr": 0.00015, "beta1": 0.9, "beta2": 0.95, "eps": 1e-08, "weight_decay": 0.1,
                      "implementation": "fused", "early_step_in_backward": False},
        "lr_scheduler": {"warmup_steps": 200, "total_steps": None, "decay_ratio": None, "decay_type": "linear",
                         "min_lr_factor": 0.0},
        "training": {"dataset": "c4", "dataset_path": None, "local_batch_size": 8, "global_batch_size": -1,
                     "seq_len": 8192, "max_norm": 1.0, "steps": 1000, "enable_cpu_offload": False, "dtype": "float32",
                     "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32", "gc_freq": 50,
                     "gc_debug": False, "dataloader": {"num_workers": 0, "persistent_workers": False,
                                                       "pin_memory": False, "prefetch_factor": None}},
        "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                        "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 8,
                        "disable_loss_parallel": False, "enable_async_tensor_parallel": False,
                        "pipeline_parallel_degree": 1, "module_fqns_per_model_part": None,
                        "pipeline_parallel_first_stage_less_layers": 1, "pipeline_parallel_last_stage_less_layers": 1,
                        "pipeline_parallel_layers_per_stage": None, "pipeline_parallel_schedule": "1F1B",
                        "pipeline_parallel_schedule_csv": "", "pipeline_parallel_microbatch_size": 1,
                        "pipeline_parallel_expert_parallel_overlap": True, "context_parallel_degree": 1,
                        "context_parallel_load_balancer": "headtail", "context_parallel_rotate_method": "allgather",
                        "expert_parallel_degree": 1, "expert_tensor_parallel_degree": 1,
                        "expert_parallel_comm_backend": "standard"},
        "checkpoint": {"enable": False, "folder": "checkpoint", "interval": 500},
        "activation_checkpoint": {"mode": "full", "selective_ac_option": "op",
                                  "per_op_sac_force_recompute_mm_shapes_by_fqns": ["moe.router.gate"],
                                  "early_stop": False, "memory_budget": 0.5, "visualize_memory_budget_pareto": False,
                                  "preserve_rng_state": True, "determinism_check": "default", "debug": False},
        "compile": {"enable": False, "components": ["model", "loss"], "backend": "inductor"},
        "comm": {"init_timeout_seconds": 300, "train_timeout_seconds": 100, "trace_buf_size": 20000,
                 "save_traces_folder": "comm_traces", "save_traces_file_prefix": "rank_", "mode": "default"},
        "debug": {"seed": None, "deterministic": False, "deterministic_warn_only": False,
                  "moe_force_load_balance": False},
    }


def no_steps():
    p = "[rank0]:"
    clock = Clock(17 * 3600)
    out = torchrun_banner()
    out += printed_config(p, clock, job_config_v02())
    out += record(p, clock, "Starting job: Llama 3 70B training")
    out += record(p, clock, "Building llama3 70B with TransformerModelArgs(_enforced='This field is used to enforce all fields have defaults.', dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096, ffn_dim_multiplier=1.3, norm_eps=1e-05, rope_theta=500000, rope_scaling_args=RoPEScalingArgs(scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192), max_seq_len=8192, depth_init=True, attn_type='sdpa', attn_mask_type='causal', eos_id=0)", advance=6.0)
    out += record(p, clock, "Applied Tensor Parallelism to the model")
    out += record(p, clock, "Applied full activation checkpointing to the model")
    out += record(p, clock, "Applied FSDP to the model")
    out += record(p, clock, "Trainer is initialized with local batch size 8, global batch size 8, gradient accumulation steps 1, sequence length 8192, total steps 1000 (warmup 200)")
    out += record(p, clock, "Training starts at step 1")
    out += f"{p}Traceback (most recent call last):\n"
    out += f"{p}  File \"/opt/torchtitan/torchtitan/train.py\", line 712, in <module>\n"
    out += f"{p}    trainer.train()\n"
    out += (f"{p}torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.83 GiB. GPU 0 has a total capacity of "
            "79.11 GiB of which 3.12 GiB is free. Including non-PyTorch memory, this process has 75.98 GiB memory in use.\n")
    out += ("E1002 17:00:31.204000 912345 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) "
            "local_rank: 0 (pid: 912400) of binary: /usr/bin/python3\n")
    return out


# 6. torchtitan 0.3.0, Llama 3 8B with a float8 converter in the config
#    function: MFU is printed `N/A`.
def float8():
    p = "[rank0]:"
    clock = Clock(18 * 3600)
    config = config_v03(
        {"name": "llama3", "flavor": "8B", "model": llama_model(4096, 32, 32, 8, 14336, 128256)},
        training_v03(local_batch_size=1, seq_len=8192, steps=50),
        parallelism_v03(),
        {"preserve_rng_state": True, "determinism_check": "default", "debug": False,
         "force_recompute_mm_shapes_by_fqns": ["moe.router.gate"]},
        {"enable": True, "enable_async_tensor_parallel": False, "components": ["model", "loss"], "backend": "inductor"},
        {"log_freq": 10, "enable_tensorboard": False, "disable_color_printing": False, "save_tb_folder": "tb",
         "save_for_all_ranks": False, "enable_wandb": False},
    )
    out = record(p, clock, "torchtitan version: 0.3.0 (0.0.0 means __version__ is not defined correctly).")
    out += printed_config(p, clock, config)
    out += record(p, clock, "Building llama3 8B", advance=4.0)
    out += record(p, clock, "Applied SelectiveAC activation checkpointing to the model")
    out += record(p, clock, "Trainer is initialized with local batch size 1, global batch size 8, gradient accumulation steps 1, sequence length 8192, total steps 50 (warmup 200).")
    for step, tps in [(1, 1_406), (10, 8_410), (20, 8_502), (30, 8_497), (40, 8_511), (50, 8_506)]:
        tflops, _ = metrics(tps, FLOPS_PER_TOKEN_8B_8K)
        out += record(p, clock, step_line(step, 8.0, 1.0, 55.2, tps, tflops, None, COLOR), advance=9.0)
    return out


FSDP8_TOML = """# torchtitan 0.2.2 job config (after torchtitan/models/llama3/train_configs/llama3_8b.toml)

[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
# converters = ["quantize.linear.float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 100
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled"  # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable = false
components = ["model", "loss"]
"""

if __name__ == "__main__":
    files = {
        "llama3-8b-fsdp8.log": fsdp8(),
        "llama3-8b-fsdp8.toml": FSDP8_TOML,
        "llama3-debug-tp2-pp2-printed.log": debug_pp(),
        "llama3-8b-tp2-killed.log": killed(),
        "llama3-8b-fsdp4-garbled.log": garbled(),
        "llama3-70b-tp8-no-steps.log": no_steps(),
        "llama3-8b-float8-mfu-na.log": float8(),
    }
    for name, text in files.items():
        with open(name, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())
