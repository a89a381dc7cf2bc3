//! The plan file: what `plan --format json` writes and what later steps
//! (validation trial runs) read back. Versioned, so that a file from another
//! version is refused with a clear message instead of misread.

use crate::cluster::NodeGroup;
use crate::config::{ParallelConfig, Rule};
use crate::cost::{Prediction, StageMemory};
use crate::model::ModelSpec;
use crate::search::SearchResult;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const PLAN_FORMAT: &str = "paratune-plan";
pub const PLAN_VERSION: u32 = 1;

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
    pub search: SearchCounts,
    pub candidates: Vec<PlannedCandidate>,
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

impl SearchCounts {
    pub fn of(result: &SearchResult) -> Self {
        SearchCounts {
            considered: result.considered,
            fitting: result.candidates.len(),
            out_of_memory: result.out_of_memory,
            invalid: result
                .invalid
                .iter()
                .map(|(rule, n): (&Rule, &usize)| (rule.summary().to_string(), *n))
                .collect(),
        }
    }
}
