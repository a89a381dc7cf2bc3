use paratune::cluster::builtin_node;
use paratune::coefficients::CostModel;
use paratune::config::*;
use paratune::evaluate::evaluate;
use paratune::model::{AttentionKind, ModelSpec};
use paratune::runs::*;

fn main() {
    let cost = CostModel::datasheet();
    let group = builtin_node("a100-80gb", 400).unwrap();
    for (file, vocab, seq) in [
        ("../shared/reference/a100_single_node_runs.csv", 50257, 1024),
        ("../shared/reference/megatron_sc21_table1.csv", 51200, 2048),
    ] {
        let mut model = ModelSpec::gpt("x", 1024, 16, 24, vocab, seq);
        model.attention = AttentionKind::Standard;
        let defaults = RowDefaults {
            model,
            recompute: Recompute::Full,
            sequence_parallel: false,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            bpipe: false,
            optimizer_sharding: OptimizerSharding::None,
        };
        let table = RunTable::read(std::path::Path::new(file)).unwrap();
        let runs = runs_from_table(&table, &defaults, 8).unwrap();
        let ev = evaluate(&runs, &group, &cost);
        println!("{file}: {:?}", ev.summary());
        if std::env::var("ROWS").is_ok() {
            for r in &ev.rows {
                println!(
                    "{} {:.1} {:.1} {:+.1}%",
                    r.line,
                    r.predicted_s * 1e3,
                    r.measured_s * 1e3,
                    r.relative() * 100.0
                );
            }
        }
    }
}
