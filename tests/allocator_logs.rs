//! The caching allocator's fragmentation priors against the public logs
//! they come from (tests/data/reference/megatron_memory_logs.csv): twenty
//! Megatron-LM runs' `report_memory` lines, each with its max allocated
//! and max reserved memory, fourteen of dense models and six of mixtures
//! of experts.

use paratune::coefficients::{Coefficients, builtin_cost_model};
use std::path::Path;

#[derive(Debug, serde::Deserialize)]
struct Logged {
    kind: String,
    max_allocated_mib: f64,
    max_reserved_mib: f64,
}

impl Logged {
    /// Reserved beyond allocated, as a share of allocated.
    fn fragmentation(&self) -> f64 {
        self.max_reserved_mib / self.max_allocated_mib - 1.0
    }
}

fn logged() -> Vec<Logged> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/reference/megatron_memory_logs.csv");
    csv::Reader::from_path(&path)
        .expect("the logs are shipped")
        .deserialize()
        .collect::<Result<_, _>>()
        .expect("the logs parse")
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    assert!(n > 0, "a median of nothing");
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// The median fragmentation of the logged runs `kind` keeps.
fn median_of(logs: &[Logged], kind: impl Fn(&Logged) -> bool) -> f64 {
    median(
        logs.iter()
            .filter(|l| kind(l))
            .map(Logged::fragmentation)
            .collect(),
    )
}

const COEFFICIENTS: [(&str, &str); 2] = [
    ("dense", "allocator_fragmentation"),
    ("moe", "moe_allocator_fragmentation"),
];

#[test]
fn the_fragmentation_priors_are_the_logged_runs_medians() {
    let logs = logged();
    assert_eq!(logs.len(), 20, "the file's rows");
    for (kind, name) in COEFFICIENTS {
        let measured = median_of(&logs, |l| l.kind == kind);
        let prior = Coefficients::info(name).expect("declared").prior;
        println!("{kind}: median {measured:.4}, prior {prior}");
        assert!(
            (prior - measured).abs() < 5e-4,
            "{name}: prior {prior} against the {kind} logs' median {measured:.4}"
        );
        for model in ["a100-megatron", "datasheet"] {
            let shipped = builtin_cost_model(model)
                .expect("shipped")
                .coefficients
                .get(name)
                .expect("declared");
            assert_eq!(shipped, prior, "{model} holds {name} at its prior");
        }
    }
}

/// Each run's reserved peak from its allocated one by the median of the
/// other runs (of its kind, or of all): the split by kind must predict the
/// held-out runs better than one figure for all, or it is not worth its
/// second coefficient.
#[test]
fn splitting_dense_from_moe_predicts_held_out_reserved_peaks_better() {
    let logs = logged();
    let held_out_error = |split: bool| {
        let errors: Vec<f64> = logs
            .iter()
            .enumerate()
            .map(|(i, held)| {
                let others = logs
                    .iter()
                    .enumerate()
                    .filter(|&(j, l)| j != i && (!split || l.kind == held.kind));
                let share = median(others.map(|(_, l)| l.fragmentation()).collect());
                let predicted = held.max_allocated_mib * (1.0 + share);
                (predicted / held.max_reserved_mib - 1.0).abs()
            })
            .collect();
        errors.iter().sum::<f64>() / errors.len() as f64
    };
    let (one, split) = (held_out_error(false), held_out_error(true));
    // The allowance the medians replaced, for the README's comparison.
    let replaced = logs
        .iter()
        .map(|l| (l.max_allocated_mib * 1.12 / l.max_reserved_mib - 1.0).abs())
        .sum::<f64>()
        / logs.len() as f64;
    println!(
        "reserved-peak MAPE: one median {one:.4}, dense and MoE apart {split:.4} \
         (each run left out of its median), 12% for all {replaced:.4}"
    );
    assert!(split < one, "split {split:.4} against one {one:.4}");
}
