//! The README's excerpts and figures, checked against what the commands
//! print today, so that no number in it goes stale. The README marks what
//! it quotes with HTML comments (invisible when rendered):
//!
//! - `<!-- check -->` before an indented block whose first line is a
//!   command (`cargo run --release -- ...` or `$ paratune ...`, continued
//!   with `\`): the command runs, and every other line of the block must
//!   appear in its output, in order. A line `...` skips output; ` ... `
//!   inside a line skips part of that line.
//! - `<!-- check-file: PATH -->` before a block: its lines (after a leading
//!   command, if any) must appear in that committed file the same way (for
//!   runs that need libtorch, whose output the repository keeps).
//! - `<!-- check-layers: DIR -->` before a `profile layer` table: each row
//!   must be a point of that committed profile.
//! - `<!-- figures: A | B | ... from: ARGS -->` in a section:
//!   `paratune ARGS` must print every figure, and the text after the
//!   marker, up to the next heading, must quote every one.
//! - `<!-- check-rows from: ARGS -->` before a Markdown table: every row
//!   of it but the header must be a line `paratune ARGS` prints.
//!
//! Timings that change from run to run (`searched N configurations in X
//! ms`) are masked on both sides.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{BIN, root};

/// One marked excerpt of the README.
#[derive(Debug)]
struct Excerpt {
    /// 1-based line of the marker.
    line: usize,
    directive: String,
    /// The block or paragraph after the marker.
    body: Vec<String>,
}

/// The directive of a marker line, if it is one.
fn marker(line: &str) -> Option<&str> {
    line.trim()
        .strip_prefix("<!--")
        .and_then(|l| l.strip_suffix("-->"))
        .map(str::trim)
        .filter(|d| d.starts_with("check") || d.starts_with("figures"))
}

/// Every marker with the block or paragraph it stands before (markers may
/// be stacked above one paragraph).
fn excerpts(readme: &str) -> Vec<Excerpt> {
    let lines: Vec<&str> = readme.lines().collect();
    let mut found = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let Some(directive) = marker(line) else {
            continue;
        };
        let mut i = at + 1;
        while i < lines.len() && (lines[i].trim().is_empty() || marker(lines[i]).is_some()) {
            i += 1;
        }
        let mut body = Vec::new();
        if lines.get(i).is_some_and(|l| l.starts_with("    ")) {
            // An indented block, blank lines inside it included.
            while i < lines.len() {
                let l = lines[i];
                if let Some(rest) = l.strip_prefix("    ") {
                    body.push(rest.to_string());
                } else if l.trim().is_empty()
                    && lines.get(i + 1).is_some_and(|n| n.starts_with("    "))
                {
                    body.push(String::new());
                } else {
                    break;
                }
                i += 1;
            }
        } else if directive.starts_with("figures") {
            // Figures: the text up to the next heading.
            while i < lines.len() && !lines[i].starts_with('#') {
                body.push(lines[i].to_string());
                i += 1;
            }
        } else {
            // A table: up to the next blank line.
            while i < lines.len() && !lines[i].trim().is_empty() {
                body.push(lines[i].to_string());
                i += 1;
            }
        }
        found.push(Excerpt {
            line: at + 1,
            directive: directive.to_string(),
            body,
        });
    }
    found
}

/// Splits a shell command line into words (double and single quotes).
fn shell_words(text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in text.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The command at the top of a block (its `paratune` arguments) and the
/// rest of the block; `None` when the block does not start with one.
fn leading_command(body: &[String]) -> Option<(Vec<String>, &[String])> {
    let first = body.first()?.trim_start();
    let first = first.strip_prefix("$ ").unwrap_or(first);
    let rest = first
        .strip_prefix("cargo run --release -- ")
        .or_else(|| first.strip_prefix("paratune "))?;
    let mut command = rest.to_string();
    let mut used = 1;
    while command.trim_end().ends_with('\\') {
        let trimmed = command.trim_end();
        command = format!("{} {}", &trimmed[..trimmed.len() - 1], body[used].trim());
        used += 1;
    }
    Some((shell_words(&command), &body[used..]))
}

/// Masks the parts of a line that change between runs of the same command.
fn masked(line: &str) -> String {
    let mut line = line.trim_end().to_string();
    if let Some(start) = line.find(" configurations in ")
        && let Some(len) = line[start..].find(':')
    {
        line.replace_range(start + " configurations in ".len()..start + len, "<time>");
    }
    line
}

/// A fresh folder in which README commands run as in the repository root:
/// `tests/`, `profiles/` and `examples/` are the repository's, `cost_models/`
/// a copy (the README's calibration command writes into it).
fn sandbox() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for name in ["tests", "profiles", "examples", "reports"] {
        #[cfg(unix)]
        std::os::unix::fs::symlink(root().join(name), dir.path().join(name)).unwrap();
    }
    let models = dir.path().join("cost_models");
    std::fs::create_dir_all(&models).unwrap();
    for entry in std::fs::read_dir(root().join("cost_models")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, models.join(path.file_name().unwrap())).unwrap();
    }
    dir
}

/// Runs `paratune args` in `dir`; its standard output, and with
/// `with_stderr` its standard error after it (some figures are notes there).
fn run(dir: &Path, args: &[String], at: usize, with_stderr: bool) -> String {
    let out = Command::new(BIN)
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "README line {at}: paratune {} failed:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    if with_stderr {
        text.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    text
}

/// Whether `expected` matches the line `actual`: equal, or, with ` ... `
/// wildcards, starting with the first piece, ending with the last, and
/// holding the others in order between.
fn line_matches(expected: &str, actual: &str) -> bool {
    let pieces: Vec<&str> = expected.split(" ... ").collect();
    let [first, middle @ .., last] = pieces.as_slice() else {
        return expected == actual;
    };
    let Some(mut rest) = actual.strip_prefix(first) else {
        return false;
    };
    for piece in middle {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

/// Every expected line appears in `output`, in order.
fn appears_in_order(expected: &[String], output: &str, at: usize, source: &str) {
    let actual: Vec<String> = output.lines().map(masked).collect();
    let mut next = 0;
    for line in expected {
        let want = masked(line);
        if want.trim().is_empty() || want.trim() == "..." {
            continue;
        }
        match actual[next..].iter().position(|a| line_matches(&want, a)) {
            Some(found) => next += found + 1,
            None => panic!(
                "README line {at}: this line is not in {source} (in order):\n{want}\n\n{source} says:\n{output}"
            ),
        }
    }
}

fn check_layers(dir: &Path, rows: &[String], at: usize) {
    let table = std::fs::read_to_string(dir.join("layers.csv")).unwrap();
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let column = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let points: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let number = |p: &Vec<&str>, name: &str| p[column(name)].parse::<f64>().ok();
    let mut checked = 0;
    for row in rows {
        let cells: Vec<&str> = row.split_whitespace().collect();
        let Some(micro_batch) = cells.get(2).and_then(|c| c.parse::<u64>().ok()) else {
            continue; // the header
        };
        let ms = |i: usize| cells[i].parse::<f64>().unwrap();
        let point = |recompute: &str| {
            points
                .iter()
                .find(|p| {
                    p[column("micro_batch")] == micro_batch.to_string()
                        && p[column("tp")] == cells[0]
                        && p[column("recompute")] == recompute
                })
                .unwrap_or_else(|| panic!("README line {at}: no {recompute} point for {row}"))
        };
        let plain = point("none");
        let close = |value: Option<f64>, shown: f64, scale: f64| {
            let value = value.unwrap() * scale;
            assert!(
                (value - shown).abs() <= 0.0011 * scale.max(1.0) / scale.min(1.0),
                "README line {at}: {row}: {shown} but the profile has {value}"
            );
        };
        close(number(plain, "forward_s"), ms(3), 1e3);
        close(number(plain, "backward_s"), ms(4), 1e3);
        // Under full recomputation the first forward runs without autograd.
        close(number(point("full"), "forward_s"), ms(5), 1e3);
        checked += 1;
    }
    assert!(checked > 0, "README line {at}: no layer rows to check");
}

fn check_figures(directive: &str, body: &[String], at: usize) {
    let spec = directive.strip_prefix("figures:").unwrap();
    let (figures, command) = spec
        .split_once(" from: ")
        .unwrap_or_else(|| panic!("README line {at}: `figures: A | B from: ARGS`"));
    let dir = sandbox();
    let output = run(dir.path(), &shell_words(command), at, true);
    // A figure may wrap across the paragraph's lines.
    let collapse = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
    let paragraph = collapse(&body.join(" "));
    for figure in figures.split(" | ").map(str::trim) {
        assert!(
            output.contains(figure),
            "README line {at}: `{figure}` is not what `paratune {command}` prints:\n{output}"
        );
        assert!(
            paragraph.contains(&collapse(figure)),
            "README line {at}: the paragraph does not quote `{figure}`:\n{paragraph}"
        );
    }
}

fn check_rows(directive: &str, body: &[String], at: usize) {
    let command = directive.strip_prefix("check-rows from:").unwrap().trim();
    let dir = sandbox();
    let output = run(dir.path(), &shell_words(command), at, true);
    let lines: Vec<&str> = output.lines().map(str::trim_end).collect();
    let rows: Vec<&String> = body.iter().skip(2).collect();
    assert!(!rows.is_empty(), "README line {at}: no table rows");
    for row in rows {
        assert!(
            lines.contains(&row.trim_end()),
            "README line {at}: this row is not what `paratune {command}` prints:\n{row}\n\nit prints:\n{output}"
        );
    }
}

fn check(excerpt: &Excerpt) {
    let at = excerpt.line;
    let directive = excerpt.directive.as_str();
    if directive.starts_with("figures:") {
        return check_figures(directive, &excerpt.body, at);
    }
    if directive.starts_with("check-rows") {
        return check_rows(directive, &excerpt.body, at);
    }
    let (command, expected): (Option<Vec<String>>, &[String]) = match leading_command(&excerpt.body)
    {
        Some((command, rest)) => (Some(command), rest),
        None => (None, &excerpt.body[..]),
    };
    if let Some(path) = directive.strip_prefix("check-file:") {
        let path = root().join(path.trim());
        let text = std::fs::read_to_string(&path).unwrap();
        return appears_in_order(expected, &text, at, &path.display().to_string());
    }
    if let Some(dir) = directive.strip_prefix("check-layers:") {
        return check_layers(&root().join(dir.trim()), expected, at);
    }
    assert_eq!(directive, "check", "README line {at}: unknown marker");
    let command = command
        .unwrap_or_else(|| panic!("README line {at}: a checked block starts with its command"));
    let dir = sandbox();
    let output = run(dir.path(), &command, at, false);
    appears_in_order(
        expected,
        &output,
        at,
        &format!("paratune {}", command.join(" ")),
    );
}

fn readme() -> (PathBuf, String) {
    let path = root().join("README.md");
    let text = std::fs::read_to_string(&path).unwrap();
    (path, text)
}

#[test]
fn every_marked_excerpt_and_figure_is_what_the_commands_print() {
    let (_, text) = readme();
    let found = excerpts(&text);
    assert!(
        found.len() >= 8,
        "the README marks {} excerpts",
        found.len()
    );
    // Every stale excerpt at once: a model change moves many figures, and
    // one run that names them all saves a run per figure.
    let stale: Vec<String> = found
        .iter()
        .filter_map(|excerpt| {
            std::panic::catch_unwind(|| check(excerpt)).err().map(|e| {
                match e.downcast::<String>() {
                    Ok(message) => *message,
                    Err(e) => e
                        .downcast_ref::<&str>()
                        .map_or_else(|| "a panic".to_string(), |m| m.to_string()),
                }
            })
        })
        .collect();
    assert!(
        stale.is_empty(),
        "{} stale excerpts:\n\n{}",
        stale.len(),
        stale.join("\n\n")
    );
}

/// Every block in the README that shows a command's output is marked, so a
/// new excerpt cannot slip in unchecked: a block that starts with `$ ` is
/// an excerpt.
#[test]
fn no_excerpt_goes_unmarked() {
    let (_, text) = readme();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if !line.starts_with("    $ ") || (i > 0 && lines[i - 1].starts_with("    ")) {
            continue;
        }
        let marker = lines[..i]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty())
            .copied()
            .unwrap_or("");
        assert!(
            marker.trim().starts_with("<!-- check"),
            "README line {}: an output excerpt without a check marker:\n{line}",
            i + 1
        );
    }
}

#[test]
fn the_checker_reads_markers_commands_and_wildcards() {
    let text = "x\n<!-- check -->\n\n    cargo run --release -- plan --a 1 \\\n        --b \"c d\"\n    out 1\n    ...\n    out ... 3\n\nafter\n";
    let found = excerpts(text);
    assert_eq!(found.len(), 1);
    let (command, rest) = leading_command(&found[0].body).unwrap();
    assert_eq!(command, ["plan", "--a", "1", "--b", "c d"]);
    assert_eq!(rest, ["out 1", "...", "out ... 3"]);
    assert!(line_matches("out ... 3", "out 1 2 3"));
    assert!(!line_matches("out ... 4", "out 1 2 3"));
    assert!(line_matches("a b", "a b"));
    assert!(!line_matches("a b", "a b c"));
    assert_eq!(
        masked("searched 21,465 configurations in 31.8 ms: 4,417 fit"),
        "searched 21,465 configurations in <time>: 4,417 fit"
    );
}
