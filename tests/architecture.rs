//! ARCHITECTURE.md's layering, checked against the code: no two top-level
//! library modules import each other, directly or round a longer loop, and
//! neither do the binary's command files; the cost model's modules never
//! reach up to the measuring, validating or reporting code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module -> the sibling modules its files name through `prefix` (e.g.
/// `crate::`), for the `.rs` files and folders directly under `dir`.
fn imports(dir: &Path, prefix: &str, skip: &[&str]) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if skip.contains(&name.as_str()) {
            continue;
        }
        let mut files = Vec::new();
        if path.is_dir() {
            collect(&path, &mut files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path.clone());
        }
        let deps = graph.entry(name.clone()).or_default();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for (at, _) in text.match_indices(prefix) {
                let rest = &text[at + prefix.len()..];
                let word: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if !word.is_empty() && word != name {
                    deps.insert(word);
                }
            }
        }
    }
    graph
}

fn collect(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// A loop in `graph`, if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_string());
            return Some(found);
        }
        if !done.insert(node.to_string()) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if graph.contains_key(next)
                && let Some(found) = visit(next, graph, path, done)
            {
                return Some(found);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

fn src() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn library_modules_import_each_other_in_one_direction() {
    let graph = imports(&src(), "crate::", &["main", "lib", "cli"]);
    assert!(graph.len() > 15, "{graph:?}");
    assert_eq!(cycle(&graph), None);
}

#[test]
fn command_files_import_each_other_in_one_direction() {
    let graph = imports(&src().join("cli"), "super::", &["mod"]);
    assert!(graph.contains_key("validate"), "{graph:?}");
    assert_eq!(cycle(&graph), None);
}

#[test]
fn the_cost_model_reads_data_and_nothing_above_it() {
    let graph = imports(&src(), "crate::", &["main", "lib", "cli"]);
    for module in [
        "cost",
        "search",
        "config",
        "model",
        "cluster",
        "coefficients",
    ] {
        let above: Vec<&String> = graph[module]
            .iter()
            .filter(|d| {
                [
                    "measure",
                    "validate",
                    "report",
                    "calibrate",
                    "evaluate",
                    "plan_file",
                ]
                .contains(&d.as_str())
            })
            .collect();
        assert!(above.is_empty(), "{module} imports {above:?}");
    }
}
