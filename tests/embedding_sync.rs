//! Sparse embedding syncs (Parallax) from the command line: bad input, the
//! per-method block, the CSV column, exports that refuse, and token
//! streams measured by `profile tokens`.

mod common;
use common::{fails, fails_in, ok, ok_in, says};

/// A 1.9B model with a 256K untied vocabulary on 64 A100s.
const JOB: [&str; 22] = [
    "--hidden",
    "2048",
    "--heads",
    "16",
    "--ffn-hidden",
    "8192",
    "--layers",
    "16",
    "--vocab",
    "256000",
    "--seq-len",
    "2048",
    "--tied-embeddings",
    "off",
    "--gpu",
    "a100-80gb",
    "--nodes",
    "8",
    "--global-batch",
    "64",
    "--tp",
    "1",
];

fn with(command: &str, job: &[&str], extra: &[&str]) -> Vec<String> {
    std::iter::once(command)
        .chain(job.iter().copied())
        .chain(extra.iter().copied())
        .map(String::from)
        .collect()
}

fn run_ok(args: &[String]) -> String {
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn run_fails(args: &[String]) -> String {
    fails(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[test]
fn a_mistyped_method_a_tied_model_and_a_sharded_gather_are_refused() {
    let e = run_fails(&with(
        "predict",
        &JOB,
        &["--pp", "1", "--embedding-sync", "parameter-servr"],
    ));
    says(&e, &["--embedding-sync", "parameter-server"]);
    let e = fails(&[
        "predict",
        "--model",
        "gpt3-13b",
        "--gpu",
        "a100-80gb",
        "--nodes",
        "2",
        "--global-batch",
        "16",
        "--tp",
        "1",
        "--pp",
        "1",
        "--embedding-sync",
        "parameter-server",
    ]);
    says(
        &e,
        &["embedding sync parameter-server", "ties", "all-reduce"],
    );
    let e = run_fails(&with(
        "predict",
        &JOB,
        &[
            "--pp",
            "1",
            "--optimizer-sharding",
            "optimizer-states",
            "--embedding-sync",
            "sparse-all-gather",
        ],
    ));
    says(&e, &["sparse-all-gather", "parameter-server"]);
}

#[test]
fn predict_prices_every_method_and_marks_the_chosen_one() {
    let text = run_ok(&with(
        "predict",
        &JOB,
        &["--pp", "1", "--embedding-sync", "sparse-all-gather"],
    ));
    let block = &text[text.find("input embedding sync").expect(&text)..];
    for method in ["all-reduce", "sparse-all-gather", "parameter-server"] {
        assert!(block.contains(method), "{block}");
    }
    assert!(block.contains("sparse-all-gather") && block.contains("<- this configuration"));
    assert!(
        block.contains("servers)"),
        "the parameter server says its p: {block}"
    );
}

#[test]
fn plans_carry_the_method_in_csv_and_exports_refuse_it_with_the_way_to_run_it() {
    let csv = run_ok(&with(
        "plan",
        &JOB,
        &["--embedding-sync", "all", "--top", "3", "--format", "csv"],
    ));
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let column = header
        .iter()
        .position(|c| *c == "embedding_sync")
        .expect(&csv);
    let first: Vec<&str> = csv.lines().nth(1).unwrap().split(',').collect();
    assert_eq!(first[column], "parameter-server", "{csv}");
    let json = run_ok(&with(
        "plan",
        &JOB,
        &[
            "--embedding-sync",
            "sparse-all-gather",
            "--top",
            "1",
            "--format",
            "json",
        ],
    ));
    let plan: serde_json::Value = serde_json::from_str(&json).unwrap();
    let why = plan["candidates"][0]["megatron_unsupported"]
        .as_str()
        .unwrap();
    says(
        why,
        &[
            "sparse-all-gather",
            "nn.Embedding(sparse=True)",
            "--embedding-sync all-reduce",
        ],
    );
}

#[test]
fn token_streams_are_counted_and_bad_ones_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = common::root().join("tests/data/tokens/crate-readmes.npy");
    let data = data.to_str().unwrap();
    let text = ok_in(
        dir.path(),
        &[
            "profile",
            "tokens",
            "--data",
            data,
            "--vocab",
            "16384",
            "--out",
            "p",
            "--gpu",
            "a100-80gb",
        ],
    );
    assert!(text.contains("Zipf exponent fitted"), "{text}");
    let profile = paratune::profile::read_profile(&dir.path().join("p")).unwrap();
    assert!(profile.tokens.len() > 10);
    assert!(
        profile
            .tokens
            .windows(2)
            .all(|w| w[0].distinct <= w[1].distinct)
    );
    let e = fails_in(
        dir.path(),
        &[
            "profile",
            "tokens",
            "--data",
            data,
            "--vocab",
            "100",
            "--out",
            "q",
            "--gpu",
            "a100-80gb",
        ],
    );
    says(&e, &["--data", "not below the vocabulary of 100"]);
    std::fs::write(dir.path().join("empty.txt"), "").unwrap();
    let e = fails_in(
        dir.path(),
        &[
            "profile",
            "tokens",
            "--data",
            "empty.txt",
            "--vocab",
            "100",
            "--out",
            "q",
            "--gpu",
            "a100-80gb",
        ],
    );
    says(&e, &["--data", "no token ids"]);
    std::fs::write(dir.path().join("words.txt"), "3\nseven\n").unwrap();
    let e = fails_in(
        dir.path(),
        &[
            "profile",
            "tokens",
            "--data",
            "words.txt",
            "--vocab",
            "100",
            "--out",
            "q",
            "--gpu",
            "a100-80gb",
        ],
    );
    says(&e, &["line 2", "seven"]);
    assert!(
        !dir.path().join("q").exists(),
        "nothing written for bad input"
    );
}

#[test]
fn a_tied_dense_dominated_model_plans_the_same_with_every_sync_open() {
    let job = [
        "plan",
        "--model",
        "gpt3-175b",
        "--gpu",
        "a100-80gb",
        "--nodes",
        "128",
        "--global-batch",
        "1536",
        "--top",
        "5",
    ];
    // Past the search's line (which times itself).
    let table = |text: String| text.lines().skip(3).map(String::from).collect::<Vec<_>>();
    let default = table(ok(&job));
    let open: Vec<&str> = job
        .iter()
        .copied()
        .chain(["--embedding-sync", "all"])
        .collect();
    assert_eq!(table(ok(&open)), default);
}
