//! The plan file: what `plan --format json` writes and what later steps
//! (validation trial runs) read back. Versioned, so that a file from another
//! version is refused with a clear message instead of misread.

use crate::cluster::NodeGroup;
use crate::coefficients::CostModel;
use crate::config::{ParallelConfig, Rule};
use crate::cost::memory_per_stage;
use crate::cost::{Prediction, StageMemory};
use crate::export::{LaunchJob, megatron_args, megatron_model_notes};
use crate::model::ModelSpec;
use crate::search::{Job, SearchResult};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const PLAN_FORMAT: &str = "paratune-plan";

/// The format of a plan that names a cost-model file (`cost_model_file`):
/// a paratune that reads only version 1 would ignore the file and take the
/// shipped model of the same name, so it is refused there instead.
pub const PLAN_VERSION: u32 = 2;

/// The format of a plan without a cost-model file, which every paratune
/// reads.
pub const PLAN_VERSION_WITHOUT_FILE: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlanFile {
    pub format: String,
    pub version: u32,
    pub paratune_version: String,
    pub model: ModelSpec,
    pub global_batch: u64,
    pub gpus: u64,
    pub nodes: NodeGroup,
    pub memory_limit_bytes: Option<f64>,
    pub cost_model: String,
    /// The file the cost model was read from, as `plan --cost-model` was
    /// given it (`None`: a shipped model, named by `cost_model`): `validate`
    /// reads the same file, which a shipped name could otherwise shadow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_model_file: Option<String>,
    pub search: SearchCounts,
    pub candidates: Vec<PlannedCandidate>,
    /// What of the model Megatron-LM's `pretrain_gpt.py` cannot set, so
    /// that the candidates' `megatron_args` train it otherwise
    /// ([`megatron_model_notes`]); derived from `model`, not read back.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub megatron_notes: Vec<String>,
}

impl PlanFile {
    /// This plan made with the cost model in `file` (as `--cost-model`
    /// gave it; `None`: a shipped model), in the format that records it.
    pub fn with_cost_model_file(mut self, file: Option<String>) -> PlanFile {
        self.version = if file.is_some() {
            PLAN_VERSION
        } else {
            PLAN_VERSION_WITHOUT_FILE
        };
        self.cost_model_file = file;
        self
    }

    /// The plan a search of `job` under `cost` found: its `top` candidates,
    /// the winner's memory per stage, and each one's Megatron-LM arguments
    /// (or why Megatron-LM cannot run it).
    pub fn of(job: &Job, cost: &CostModel, result: &SearchResult, top: usize) -> PlanFile {
        let scenario = job.scenario(cost);
        let candidates = result
            .candidates
            .iter()
            .take(top)
            .enumerate()
            .map(|(i, c)| {
                let args = megatron_args(&LaunchJob::of(job, &c.config));
                PlannedCandidate {
                    rank: i + 1,
                    config: c.config,
                    prediction: c.prediction,
                    stages: (i == 0).then(|| memory_per_stage(&scenario, &c.config)),
                    megatron_unsupported: args.as_ref().err().map(|e| e.to_string()),
                    megatron_args: args.ok(),
                }
            })
            .collect();
        PlanFile {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION_WITHOUT_FILE,
            paratune_version: env!("CARGO_PKG_VERSION").into(),
            model: job.model.clone(),
            global_batch: job.global_batch,
            gpus: job.gpus,
            nodes: job.nodes.clone(),
            memory_limit_bytes: job.memory_limit,
            cost_model: cost.name.clone(),
            cost_model_file: None,
            search: SearchCounts::of(result),
            candidates,
            megatron_notes: megatron_model_notes(&job.model),
        }
    }
}

impl PlanFile {
    /// The plan as the JSON `plan --format json` writes. A dense model's
    /// candidates leave out the token dispatcher, which only an MoE layer
    /// runs (reading the file back gives it its default).
    pub fn to_json(&self) -> serde_json::Value {
        let mut value = serde_json::to_value(self).expect("a plan always serialises");
        if let Some(candidates) = value["candidates"].as_array_mut() {
            for (candidate, planned) in candidates.iter_mut().zip(&self.candidates) {
                candidate["config"] = config_json(&self.model, &planned.config);
            }
        }
        value
    }
}

/// `config` as JSON for `model`: without the token dispatcher when the model
/// is dense, since only an MoE layer runs one (a reader that needs the field
/// takes its default).
pub fn config_json(model: &ModelSpec, config: &ParallelConfig) -> serde_json::Value {
    let mut value = serde_json::to_value(config).expect("a configuration always serialises");
    if model.moe.is_none()
        && let Some(fields) = value.as_object_mut()
    {
        fields.remove("dispatcher");
    }
    value
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SearchCounts {
    pub considered: usize,
    pub fitting: usize,
    pub out_of_memory: usize,
    /// Dropped combinations by the rule they break.
    pub invalid: BTreeMap<String, usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlannedCandidate {
    pub rank: usize,
    pub config: ParallelConfig,
    pub prediction: Prediction,
    /// Memory of every pipeline stage (given for the winner only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<Vec<StageMemory>>,
    /// Megatron-LM arguments, when Megatron-LM can run this plan.
    pub megatron_args: Option<Vec<String>>,
    /// Why Megatron-LM cannot run this plan, when it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub megatron_unsupported: Option<String>,
}

/// The plan file does not describe a job this paratune can trial: a plan
/// may come from someone else, so everything later steps derive from it is
/// checked first.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "{path}: not a readable paratune plan ({message}); write one with `paratune plan ... --format json > plan.json`"
    )]
    Unreadable { path: String, message: String },
    #[error(
        "{path}: not a paratune plan (format `{found}`); write one with `paratune plan ... --format json > plan.json`"
    )]
    Format { path: String, found: String },
    #[error(
        "{path}: plan format version {found}, this paratune ({ours}) reads versions {PLAN_VERSION_WITHOUT_FILE} to {PLAN_VERSION}; re-run `paratune plan ... --format json` with this paratune"
    , ours = env!("CARGO_PKG_VERSION"))]
    Version { path: String, found: u32 },
    #[error("{path}: {field}: {message}; re-run `paratune plan ... --format json`")]
    Field {
        path: String,
        field: String,
        message: String,
    },
    #[error(
        "{path}: candidate #{rank} does not match the plan's job ({message}); the file was edited by hand, or planned by a paratune whose rules differ: re-run `paratune plan`"
    )]
    Inconsistent {
        path: String,
        rank: usize,
        message: String,
    },
    #[error("{path}: the plan has no candidates to trial")]
    Empty { path: String },
    #[error(
        "{path}: model: the plan predates paratune's record of {what}, and would read `{model}` as {reading}; re-run `paratune plan ... --format json` with this paratune"
    )]
    PredatesModelSwitches {
        path: String,
        model: String,
        what: &'static str,
        reading: &'static str,
    },
}

/// Refuses a plan file written before models recorded what a model that is
/// not GPT-like needs (every key is always written since): `rms_norm` and
/// `linear_bias`, without which a rotary model's RMSNorm without biases
/// reads as GPT's LayerNorm with them, and `rotary_base` and
/// `norm_epsilon`, without which Llama 3's base 500000 or Qwen3's 1e-6
/// read as Megatron-LM's defaults, and an MoE router's score, without which
/// DeepSeek-V3's sigmoid router reads as a softmax one. Either way the
/// export and the trials would build another model.
pub fn check_model_switches_recorded(raw: &serde_json::Value, path: &str) -> Result<(), PlanError> {
    let model = &raw["model"];
    if model["learned_positions"].as_bool().unwrap_or(true) {
        return Ok(());
    }
    let recorded = |keys: [&str; 2]| keys.iter().all(|key| model.get(*key).is_some());
    let router_recorded = model["moe"].is_null()
        || ["router_score", "router_dtype"]
            .iter()
            .all(|key| model["moe"].get(*key).is_some());
    let missing = if !recorded(["rms_norm", "linear_bias"]) {
        (
            "a model's norms and biases (`rms_norm`, `linear_bias`)",
            "GPT's LayerNorm with biases",
        )
    } else if !recorded(["rotary_base", "norm_epsilon"]) {
        (
            "a model's rotary base and norms' epsilon (`rotary_base`, `norm_epsilon`)",
            "Megatron-LM's defaults (base 10000, epsilon 1e-5)",
        )
    } else if !router_recorded {
        (
            "an MoE router's score and precision (`router_score`, `router_topk_scaling`, `router_expert_bias`, `router_dtype`)",
            "Megatron-LM's default router (softmax, unscaled, no bias, in the model's precision)",
        )
    } else {
        return Ok(());
    };
    Err(PlanError::PredatesModelSwitches {
        path: path.into(),
        model: model["name"].as_str().unwrap_or("the model").to_string(),
        what: missing.0,
        reading: missing.1,
    })
}

impl PlanFile {
    /// Checks the format, the version, the job (model, nodes, cost-model
    /// name, batch and GPU count), and that every candidate is a valid
    /// configuration of it with a prediction that could be true.
    /// A plan file's text read and checked as [`check`](Self::check) and
    /// [`check_model_switches_recorded`] check it: what `validate` trials.
    pub fn read_checked(text: &str, path: &str) -> Result<PlanFile, PlanError> {
        let unreadable = |e: serde_json::Error| PlanError::Unreadable {
            path: path.into(),
            message: e.to_string(),
        };
        let plan: PlanFile = serde_json::from_str(text).map_err(unreadable)?;
        plan.check(path)?;
        let raw: serde_json::Value = serde_json::from_str(text).map_err(unreadable)?;
        check_model_switches_recorded(&raw, path)?;
        Ok(plan)
    }

    pub fn check(&self, path: &str) -> Result<(), PlanError> {
        let field = |field: &str, message: String| PlanError::Field {
            path: path.into(),
            field: field.into(),
            message,
        };
        if self.format != PLAN_FORMAT {
            return Err(PlanError::Format {
                path: path.into(),
                found: self.format.clone(),
            });
        }
        if !(PLAN_VERSION_WITHOUT_FILE..=PLAN_VERSION).contains(&self.version) {
            return Err(PlanError::Version {
                path: path.into(),
                found: self.version,
            });
        }
        self.model.check().map_err(|m| field("model", m))?;
        self.nodes.check().map_err(|m| field("nodes", m))?;
        crate::text::check_printable("the cost model's name", &self.cost_model)
            .map_err(|m| field("cost_model", m))?;
        if let Some(file) = &self.cost_model_file {
            crate::text::check_printable("the cost model's file", file)
                .map_err(|m| field("cost_model_file", m))?;
        }
        if self.global_batch == 0 {
            return Err(field("global_batch", "must be at least 1".into()));
        }
        if self.gpus == 0 || self.gpus > self.nodes.nodes.saturating_mul(self.nodes.gpus_per_node) {
            return Err(field(
                "gpus",
                format!(
                    "{} GPUs, where the nodes hold {} x {}",
                    self.gpus, self.nodes.nodes, self.nodes.gpus_per_node
                ),
            ));
        }
        if let Some(limit) = self.memory_limit_bytes
            && !(limit.is_finite() && limit > 0.0)
        {
            return Err(field(
                "memory_limit_bytes",
                format!("{limit} is not a positive size"),
            ));
        }
        if self.candidates.is_empty() {
            return Err(PlanError::Empty { path: path.into() });
        }
        for (i, candidate) in self.candidates.iter().enumerate() {
            let inconsistent = |message: String| PlanError::Inconsistent {
                path: path.into(),
                rank: candidate.rank,
                message,
            };
            if candidate.rank != i + 1 {
                return Err(inconsistent(format!(
                    "ranks must run 1, 2, 3...; found {} in place {}",
                    candidate.rank,
                    i + 1
                )));
            }
            candidate
                .config
                .check(
                    &self.model,
                    self.global_batch,
                    self.gpus,
                    self.nodes.gpus_per_node,
                )
                .map_err(inconsistent)?;
            check_prediction(&candidate.prediction).map_err(inconsistent)?;
        }
        Ok(())
    }
}

/// Every figure of a prediction finite and not negative, times positive.
fn check_prediction(p: &Prediction) -> Result<(), String> {
    let figures = [
        ("iteration_s", p.iteration_s),
        ("tokens_per_s", p.tokens_per_s),
        ("peak_memory_bytes", p.peak_memory_bytes),
        ("usable_memory_bytes", p.usable_memory_bytes),
    ];
    for (name, value) in figures {
        if !(value.is_finite() && value > 0.0) {
            return Err(format!(
                "prediction.{name} is {value}, not a positive number"
            ));
        }
    }
    for (name, value) in p.time.parts() {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("prediction.time `{name}` is {value}, not a time"));
        }
    }
    for (name, value) in [("tflops_per_gpu", p.tflops_per_gpu), ("mfu", p.mfu)] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("prediction.{name} is {value}, not a rate"));
        }
    }
    Ok(())
}

impl SearchCounts {
    pub fn of(result: &SearchResult) -> Self {
        SearchCounts {
            considered: result.considered,
            fitting: result.fitting(),
            out_of_memory: result.out_of_memory,
            invalid: result
                .invalid
                .iter()
                .map(|(rule, n): (&Rule, &usize)| (rule.summary().to_string(), *n))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A rotary model's plan from before `rms_norm` and `linear_bias` were
    /// recorded is refused with the fix; a GPT-like one, whose defaults
    /// are its own, and a plan that records them both read.
    #[test]
    fn plans_that_predate_the_model_switches_are_refused_unless_gpt_like() {
        let old_llama = json!({"model": {"name": "llama3-8b", "learned_positions": false}});
        let err = check_model_switches_recorded(&old_llama, "old.json")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("old.json: model:") && err.contains("re-run `paratune plan"),
            "{err}"
        );
        let old_gpt = json!({"model": {"name": "gpt3-175b", "learned_positions": true}});
        assert!(check_model_switches_recorded(&old_gpt, "old.json").is_ok());
        // One from before the rotary base and the norms' epsilon were
        // recorded would read Llama 3's base as 10000.
        let switched_llama = json!({"model": {
            "name": "llama3-8b", "learned_positions": false, "rms_norm": true, "linear_bias": false
        }});
        let err = check_model_switches_recorded(&switched_llama, "old.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("(`rotary_base`, `norm_epsilon`)"), "{err}");
        let new_llama = json!({"model": {
            "name": "llama3-8b", "learned_positions": false, "rms_norm": true, "linear_bias": false,
            "rotary_base": 500000, "norm_epsilon": 1e-5
        }});
        assert!(check_model_switches_recorded(&new_llama, "new.json").is_ok());
        // An MoE model's router: DeepSeek-V3's sigmoid would read as softmax.
        let mut old_v3 =
            serde_json::to_value(crate::model::builtin_model("deepseek-v3").unwrap()).unwrap();
        old_v3["moe"]
            .as_object_mut()
            .unwrap()
            .remove("router_score");
        let err = check_model_switches_recorded(&json!({ "model": old_v3 }), "old.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("an MoE router's score"), "{err}");
        let mut bf16_v3 =
            serde_json::to_value(crate::model::builtin_model("deepseek-v3").unwrap()).unwrap();
        bf16_v3["moe"]
            .as_object_mut()
            .unwrap()
            .remove("router_dtype");
        assert!(check_model_switches_recorded(&json!({ "model": bf16_v3 }), "old.json").is_err());
        // What `plan` writes records them.
        let written =
            serde_json::to_value(crate::model::builtin_model("llama3-8b").unwrap()).unwrap();
        assert!(check_model_switches_recorded(&json!({ "model": written }), "p.json").is_ok());
    }
}
