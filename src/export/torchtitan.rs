//! torchtitan job-config TOML.
//!
//! Keys match the TOML `JobConfig` of pytorch/torchtitan's 2025 line
//! (`torchtitan/config/job_config.py` at commit 6404b93, the version with
//! `pipeline_parallel_first_stage_less_layers`, read with
//! `--job.config_file`). Later torchtitan main moves configuration into
//! Python recipes (`Trainer.Config`); the section and field names below are
//! the ones to set there too. Behaviour relied on (DDP only without other
//! parallelism, FSDP reshard policy, pipeline stage split) is that of
//! `torchtitan/models/llama3/infra/parallelize.py` and
//! `torchtitan/distributed/pipeline_parallel.py` of the same period.

use super::{ExportError, LaunchJob, check_job};
use crate::config::{OptimizerSharding, Recompute, ScheduleKind};
use crate::model::AttentionKind;
use std::fmt::Write;

const ENGINE: &str = "torchtitan";

/// A torchtitan job-config TOML fragment for the plan: the `[model]`,
/// `[training]`, `[parallelism]` and `[activation_checkpoint]` keys, starting
/// with the comment line `# paratune plan: <plan>`. Merge it into a full job
/// config (dataset, optimiser, checkpointing are the user's).
///
/// Mapping:
/// - Data parallelism. Full sharding (ZeRO-3) is FSDP over dp ranks
///   (`data_parallel_shard_degree = dp`). Optimizer-state sharding has no
///   torchtitan switch of its own; it is exported as FSDP with
///   `fsdp_reshard_after_forward = "never"`, which keeps weights gathered
///   from forward to backward like ZeRO-1/2 and needs no more memory; under
///   a pipeline it moves the same bytes per step (one all-gather, one
///   reduce-scatter), while without one torchtitan may gather weights again
///   for every accumulated micro-batch. Without sharding, plain DDP
///   (`data_parallel_replicate_degree = dp`) is used only when tp = pp = 1,
///   because torchtitan refuses DDP combined with other parallelism; with
///   tp or pp > 1 the export falls back to the same FSDP form, and says so.
/// - Pipeline. Schedules `GPipe`, `1F1B`, `Interleaved1F1B`; stages hold
///   L/(pp*v) layers each with the embedding and head not counted as layers
///   (the even split paratune models). `training.local_batch_size` is the
///   per-data-parallel-rank batch and `pipeline_parallel_microbatch_size`
///   the micro-batch. Without a pipeline, `local_batch_size` is the
///   micro-batch and torchtitan accumulates gradients up to
///   `global_batch_size`.
/// - Tensor parallelism always shards sequences in torchtitan; a plan with
///   sequence parallelism off gets a comment saying so.
/// - Recomputation: `mode = "none" | "selective" | "full"`, selective as
///   torchtitan's per-op policy (`selective_ac_option = "op"`).
///
/// Errors: the plan fails [`ParallelConfig::check`](crate::config::ParallelConfig::check)
/// for the job, or uses BPipe, which torchtitan does not have.
pub fn torchtitan_toml(job: &LaunchJob) -> Result<String, ExportError> {
    check_job(job)?;
    let (model, c) = (job.model, job.config);
    if c.bpipe {
        return Err(ExportError::Unsupported {
            engine: ENGINE,
            feature: "BPipe activation balancing".into(),
            hint: "torchtitan has no BPipe; search again with --bpipe off".into(),
        });
    }
    if c.cuda_graphs {
        return Err(ExportError::Unsupported {
            engine: ENGINE,
            feature: "CUDA graphs".into(),
            hint: "the TOML job config of torchtitan 0.2 has no CUDA-graph switch (0.3 captures \
                   whole steps by default, without pipeline parallelism); search again with \
                   --cuda-graphs off"
                .into(),
        });
    }

    let mut out = String::new();
    let w = &mut out;
    line(w, format_args!("# paratune plan: {c}"));
    let per_node = job.gpus_per_node.min(job.gpus);
    let nodes = job.gpus.div_ceil(job.gpus_per_node);
    line(
        w,
        format_args!(
            "# {} on {} GPUs: torchrun --nnodes {nodes} --nproc-per-node {per_node}",
            comment_text(&model.name),
            job.gpus
        ),
    );

    // [model]
    line(w, format_args!("\n[model]"));
    line(
        w,
        format_args!("# torchtitan builds the network from name and flavor; the flavor needs"),
    );
    line(
        w,
        format_args!(
            "# {} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}, seq {}",
            model.layers,
            model.hidden,
            model.heads,
            model.kv_heads,
            model.ffn_hidden,
            model.vocab,
            model.seq_len
        ),
    );
    let mut unlike_llama = Vec::new();
    if !model.gated_mlp {
        unlike_llama.push("a plain MLP");
    }
    if model.learned_positions {
        unlike_llama.push("learned positions");
    }
    if model.tied_embeddings {
        unlike_llama.push("tied embeddings");
    }
    if !unlike_llama.is_empty() {
        line(
            w,
            format_args!(
                "# llama3 has SwiGLU, rotary positions and an untied head; this model has {}: give it its own model",
                unlike_llama.join(", ")
            ),
        );
    }
    if c.attention == AttentionKind::Standard {
        line(
            w,
            format_args!(
                "# torchtitan runs attention through SDPA (fused kernels); materialised scores are not selectable"
            ),
        );
    }
    line(w, format_args!("name = \"llama3\""));
    line(w, format_args!("flavor = {}", toml_string(&model.name)));

    // [training]
    let (local_batch, microbatch) = if c.pp > 1 {
        (job.global_batch / c.dp, Some(c.micro_batch))
    } else {
        (c.micro_batch, None)
    };
    line(w, format_args!("\n[training]"));
    line(w, format_args!("local_batch_size = {local_batch}"));
    line(w, format_args!("global_batch_size = {}", job.global_batch));
    line(w, format_args!("seq_len = {}", model.seq_len));
    line(w, format_args!("mixed_precision_param = \"bfloat16\""));

    // [parallelism]
    line(w, format_args!("\n[parallelism]"));
    let (replicate, shard, reshard) = match c.optimizer_sharding {
        _ if c.dp == 1 => (1, 1, None),
        OptimizerSharding::Full => (1, c.dp, Some("default")),
        OptimizerSharding::OptimizerStates => {
            line(
                w,
                format_args!(
                    "# optimizer-state sharding: FSDP keeping weights gathered between forward and backward"
                ),
            );
            (1, c.dp, Some("never"))
        }
        OptimizerSharding::None if c.tp == 1 && c.pp == 1 => (c.dp, 1, None),
        OptimizerSharding::None => {
            line(
                w,
                format_args!(
                    "# torchtitan runs DDP only without tensor or pipeline parallelism, so the"
                ),
            );
            line(
                w,
                format_args!(
                    "# unsharded plan runs as FSDP keeping weights gathered (no more memory than planned)"
                ),
            );
            (1, c.dp, Some("never"))
        }
    };
    line(
        w,
        format_args!("data_parallel_replicate_degree = {replicate}"),
    );
    line(w, format_args!("data_parallel_shard_degree = {shard}"));
    if let Some(policy) = reshard {
        line(w, format_args!("fsdp_reshard_after_forward = \"{policy}\""));
    }
    if c.tp > 1 && !c.sequence_parallel {
        line(
            w,
            format_args!(
                "# torchtitan's tensor parallelism always shards sequences (sequence parallel);"
            ),
        );
        line(
            w,
            format_args!(
                "# the plan had it off, so activations will take less memory than planned"
            ),
        );
    }
    line(w, format_args!("tensor_parallel_degree = {}", c.tp));
    if c.tp_comm_overlap {
        line(
            w,
            format_args!(
                "# --tp-comm-overlap: torchtitan's async tensor parallelism (needs [compile] enable = true)"
            ),
        );
    }
    line(
        w,
        format_args!("enable_async_tensor_parallel = {}", c.tp_comm_overlap),
    );
    if c.dp > 1 && !c.overlap_grad_reduce {
        line(
            w,
            format_args!(
                "# torchtitan always overlaps gradient reduction with the backward pass (FSDP/DDP);"
            ),
        );
        line(
            w,
            format_args!("# the plan had it off, so the step may take less time than planned"),
        );
    }
    line(w, format_args!("pipeline_parallel_degree = {}", c.pp));
    if let Some(microbatch) = microbatch {
        let schedule = match c.schedule {
            ScheduleKind::Gpipe => "GPipe",
            ScheduleKind::OneFOneB => "1F1B",
            ScheduleKind::Interleaved => "Interleaved1F1B",
        };
        line(
            w,
            format_args!("pipeline_parallel_schedule = \"{schedule}\""),
        );
        line(
            w,
            format_args!("pipeline_parallel_microbatch_size = {microbatch}"),
        );
        // Per chunk: the middle stages' share, the end stages fewer.
        let v = c.virtual_stages;
        let per_chunk = c.middle_stage_layers(model.layers) / v;
        let less = |end: Option<u64>| end.map_or(0, |n| (per_chunk * v).saturating_sub(n));
        line(
            w,
            format_args!("pipeline_parallel_layers_per_stage = {per_chunk}"),
        );
        line(
            w,
            format_args!(
                "pipeline_parallel_first_stage_less_layers = {}",
                less(c.first_stage_layers)
            ),
        );
        line(
            w,
            format_args!(
                "pipeline_parallel_last_stage_less_layers = {}",
                less(c.last_stage_layers)
            ),
        );
    }

    // [activation_checkpoint]
    line(w, format_args!("\n[activation_checkpoint]"));
    match c.recompute {
        Recompute::None => line(w, format_args!("mode = \"none\"")),
        Recompute::Full => line(w, format_args!("mode = \"full\"")),
        Recompute::Selective => {
            line(
                w,
                format_args!(
                    "# per-op policy: keeps attention outputs, recomputes every other matmul"
                ),
            );
            line(w, format_args!("mode = \"selective\""));
            line(w, format_args!("selective_ac_option = \"op\""));
        }
    }
    Ok(out)
}

fn line(out: &mut String, args: std::fmt::Arguments) {
    out.write_fmt(args)
        .expect("writing to a String cannot fail");
    out.push('\n');
}

/// A TOML basic string holding `text`.
fn toml_string(text: &str) -> String {
    let mut quoted = String::from("\"");
    for ch in text.chars() {
        match ch {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(quoted, "\\u{:04X}", c as u32);
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// `text` made safe for a TOML comment (no control characters).
fn comment_text(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_strings_escape_quotes_backslashes_and_controls() {
        assert_eq!(toml_string("gpt3-175b"), "\"gpt3-175b\"");
        let tricky = "a \"b\" \\ c\nd";
        let parsed: toml::Table = toml::from_str(&format!("x = {}", toml_string(tricky))).unwrap();
        assert_eq!(parsed["x"].as_str(), Some(tricky));
        assert_eq!(comment_text("a\nb"), "a b");
    }
}
