//! The caching allocator's options on a trial's machine. What a plan
//! priced and what PyTorch ran with can differ: a candidate priced with
//! fixed segments sets nothing, so the shell's own options decide, and
//! torchtitan's `run_train.sh` turns expandable segments on whatever the
//! plan said. So a launch script sets what its candidate was priced with
//! ([`export_options`]), writes what the ranks will read into the log
//! before they start ([`record_in_log`]), and the log readers take the
//! allocator from there ([`recorded_in_log`]) instead of assuming it.

use crate::config::ParallelConfig;
use crate::export::{ALLOCATOR_OPTIONS, NEUTRAL_ALLOCATOR_OPTIONS};
use std::fmt::Write as _;

/// Starts each line [`record_in_log`] writes.
const MARKER: &str = "paratune allocator: ";

/// What a recorded variable's line says when the shell did not set it.
const UNSET: &str = " unset";

/// A launch script's allocator lines: what `c` was priced with set
/// ([`export_options`]), then what the ranks will read recorded in the log
/// ([`record_in_log`]). Both engines' scripts and the torch trials' start
/// their ranks after them.
pub(crate) fn launch_lines(s: &mut String, c: &ParallelConfig) {
    export_options(s, c);
    record_in_log(s);
}

/// The environment the plan priced `c` with
/// ([`launch_environment`](crate::export::launch_environment)): the
/// allocator's option added (unless it is already the last word: PyTorch
/// takes the last of repeated keys) to what `PYTORCH_CUDA_ALLOC_CONF` asks
/// (the plan's memory verdict holds only with it), and to
/// `PYTORCH_ALLOC_CONF` where the shell sets that, even empty (PyTorch 2.9
/// reads it instead), anything else set.
fn export_options(s: &mut String, c: &ParallelConfig) {
    for (name, value) in crate::export::launch_environment(c) {
        if name == ALLOCATOR_OPTIONS {
            let _ = writeln!(
                s,
                "case \",${{{name}:-}},\" in *,{value},) ;; *) export {name}=\"${{{name}:+${{{name}}},}}{value}\" ;; esac"
            );
            // Set even empty, it is the one PyTorch 2.9 reads.
            let neutral = NEUTRAL_ALLOCATOR_OPTIONS;
            let _ = writeln!(
                s,
                "if [[ -n \"${{{neutral}+set}}\" ]]; then case \",${{{neutral}}},\" in *,{value},) ;; *) export {neutral}=\"${{{neutral}:+${{{neutral}}},}}{value}\" ;; esac; fi"
            );
        } else {
            let _ = writeln!(s, "export {name}={value}");
        }
    }
}

/// Script lines that start `${LOG_FILE}` (truncating it; the launch then
/// appends, by `tee -a` or `>>`) with both variables PyTorch reads its options
/// from, each as set or unset: the options the ranks ran with, whatever
/// set them.
fn record_in_log(s: &mut String) {
    let _ = writeln!(
        s,
        "# The allocator options the ranks start with, read back by paratune."
    );
    let _ = writeln!(
        s,
        "for name in {NEUTRAL_ALLOCATOR_OPTIONS} {ALLOCATOR_OPTIONS}; do"
    );
    let _ = writeln!(
        s,
        "    if [[ -n \"${{!name+set}}\" ]]; then echo \"{MARKER}${{name}}=${{!name}}\"; else echo \"{MARKER}${{name}}{UNSET}\"; fi"
    );
    let _ = writeln!(s, "done > \"${{LOG_FILE}}\"");
}

/// What a log's record says of its ranks' allocator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub expandable_segments: bool,
    /// Where the PyTorch release decides (see [`recorded_in_log`]), which.
    pub note: Option<String>,
}

/// The allocator of the ranks of the run logged in `text`, from the lines
/// [`record_in_log`] wrote (anywhere in a line: a launcher may prefix it;
/// `None` where there are none, a log of another launcher). PyTorch from
/// 2.9 takes its options from `PYTORCH_ALLOC_CONF` where that is set, even
/// empty, and from `PYTORCH_CUDA_ALLOC_CONF` otherwise
/// (`c10/core/AllocatorConfig.cpp`); earlier releases read only the
/// latter; neither set is the default, fixed segments. Where the two
/// readings differ the record is read as 2.9 would, with a note.
pub fn recorded_in_log(text: &str) -> Option<Recorded> {
    let mut neutral = None;
    let mut cuda = None;
    for line in text.lines() {
        let Some(at) = line.find(MARKER) else {
            continue;
        };
        let rest = line[at + MARKER.len()..].trim_end_matches('\r');
        let (slot, after) = if let Some(after) = rest.strip_prefix(NEUTRAL_ALLOCATOR_OPTIONS) {
            (&mut neutral, after)
        } else if let Some(after) = rest.strip_prefix(ALLOCATOR_OPTIONS) {
            (&mut cuda, after)
        } else {
            continue;
        };
        let value = match after.strip_prefix('=') {
            Some(value) => Some(value),
            None if after == UNSET => None,
            None => continue,
        };
        // The first record of each: a log appended to later keeps its own.
        slot.get_or_insert(value);
    }
    let (neutral, cuda) = (neutral?, cuda?);
    let current = neutral.or(cuda).is_some_and(expandable);
    let before_2_9 = cuda.is_some_and(expandable);
    let word = |on: bool| if on { "on" } else { "off" };
    Some(Recorded {
        expandable_segments: current,
        note: (current != before_2_9).then(|| {
            format!(
                "the log's allocator record turns expandable segments {} for PyTorch 2.9 and later ({NEUTRAL_ALLOCATOR_OPTIONS}) but {} for earlier releases ({ALLOCATOR_OPTIONS} alone); read as {}: give the row's expandable_segments cell if the run's PyTorch predates 2.9",
                word(current),
                word(before_2_9),
                word(current)
            )
        }),
    })
}

/// Whether allocator options (`key:value,...`) turn expandable segments
/// on; the last of repeated keys wins, as in PyTorch's parser.
fn expandable(options: &str) -> bool {
    options
        .rsplit(',')
        .filter_map(|option| option.split_once(':'))
        .find(|(key, _)| key.trim() == "expandable_segments")
        .is_some_and(|(_, value)| value.trim() == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log `script` (run by bash under the launch scripts' strict
    /// options) writes to `LOG_FILE` when the shell sets the two variables
    /// to `neutral` and `cuda` (`None`: unset).
    fn log_of(script: &str, neutral: Option<&str>, cuda: Option<&str>) -> String {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("run.log");
        let mut bash = std::process::Command::new("bash");
        bash.arg("-c")
            .arg(format!("set -euo pipefail\n{script}"))
            .env("LOG_FILE", &log)
            .env_remove(NEUTRAL_ALLOCATOR_OPTIONS)
            .env_remove(ALLOCATOR_OPTIONS);
        for (name, value) in [
            (NEUTRAL_ALLOCATOR_OPTIONS, neutral),
            (ALLOCATOR_OPTIONS, cuda),
        ] {
            if let Some(value) = value {
                bash.env(name, value);
            }
        }
        assert!(bash.status().expect("bash runs").success());
        std::fs::read_to_string(log).unwrap()
    }

    fn record() -> String {
        let mut script = String::new();
        record_in_log(&mut script);
        script
    }

    fn expandable_in(log: &str) -> Option<bool> {
        recorded_in_log(log).map(|r| r.expandable_segments)
    }

    #[test]
    fn the_log_says_which_allocator_the_ranks_read() {
        let on = "expandable_segments:True";
        let cases = [
            // Neither set: PyTorch's default.
            (None, None, false),
            (None, Some(on), true),
            (
                None,
                Some("max_split_size_mb:512,expandable_segments:True"),
                true,
            ),
            // The neutral name wins where it is set, even empty.
            (Some(""), Some(on), false),
            (Some("max_split_size_mb:512"), Some(on), false),
            (Some(on), None, true),
            (
                Some("expandable_segments:True,expandable_segments:False"),
                None,
                false,
            ),
            (Some(" expandable_segments : True "), None, true),
        ];
        for (neutral, cuda, expected) in cases {
            let log = log_of(&record(), neutral, cuda);
            assert_eq!(
                expandable_in(&log),
                Some(expected),
                "{neutral:?} {cuda:?}: {log}"
            );
            // A second record (a rerun appended to the log) changes nothing.
            let appended = format!("{log}paratune allocator: PYTORCH_ALLOC_CONF={on}\n");
            assert_eq!(expandable_in(&appended), Some(expected));
            // Nor does a launcher's prefix on each line.
            let prefixed: String = log.lines().map(|l| format!("0: [rank0]: {l}\n")).collect();
            assert_eq!(expandable_in(&prefixed), Some(expected));
        }
    }

    #[test]
    fn where_pytorch_releases_would_differ_the_record_says_so() {
        let log = log_of(
            &record(),
            Some("max_split_size_mb:512"),
            Some("expandable_segments:True"),
        );
        let read = recorded_in_log(&log).unwrap();
        assert!(!read.expandable_segments);
        let note = read.note.unwrap();
        assert!(
            note.contains("2.9") && note.contains("read as off"),
            "{note}"
        );
        let agreed = log_of(&record(), None, Some("expandable_segments:True"));
        assert_eq!(recorded_in_log(&agreed).unwrap().note, None);
    }

    #[test]
    fn a_script_priced_with_expandable_segments_runs_with_them_whatever_the_shell_sets() {
        let c = ParallelConfig {
            expandable_segments: true,
            ..ParallelConfig::default()
        };
        let mut script = String::new();
        export_options(&mut script, &c);
        script.push_str(&record());
        let values = [
            None,
            Some(""),
            Some("max_split_size_mb:512"),
            Some("expandable_segments:True"),
            Some("expandable_segments:False"),
            Some("expandable_segments:True,expandable_segments:False"),
        ];
        for neutral in values {
            for cuda in values {
                let log = log_of(&script, neutral, cuda);
                let read = recorded_in_log(&log).unwrap();
                assert!(read.expandable_segments, "{neutral:?} {cuda:?}: {log}");
                assert_eq!(read.note, None, "{neutral:?} {cuda:?}: {log}");
                // What the shell asked for is kept beside it.
                if neutral == Some("max_split_size_mb:512") || cuda == Some("max_split_size_mb:512")
                {
                    assert!(log.contains("max_split_size_mb:512"), "{log}");
                }
            }
        }
        // Priced without, the script sets nothing and the record says what
        // the shell did.
        let mut fixed = String::new();
        export_options(&mut fixed, &ParallelConfig::default());
        assert!(fixed.is_empty());
    }

    #[test]
    fn a_log_without_the_record_says_nothing() {
        assert_eq!(recorded_in_log(""), None);
        assert_eq!(recorded_in_log("iteration 1/10 | elapsed ...\n"), None);
        // Half a record (a cut log) is no record.
        assert_eq!(
            recorded_in_log("paratune allocator: PYTORCH_ALLOC_CONF unset\n"),
            None
        );
    }
}
