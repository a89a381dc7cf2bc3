//! The caching allocator's options on a trial's machine. What a plan
//! priced and what PyTorch ran with can differ: a candidate priced with
//! fixed segments sets nothing, so the shell's own options decide, and
//! torchtitan's `run_train.sh` turns expandable segments on whatever the
//! plan said. So a launch script sets what its candidate was priced with
//! ([`export_options`]), writes what the ranks will read into the log
//! before they start ([`record_in_log`]), and the log readers take the
//! allocator from there ([`recorded_in_log`]) instead of assuming it.

use crate::config::{Engine, ParallelConfig};
use crate::export::{ALLOCATOR_OPTIONS, NEUTRAL_ALLOCATOR_OPTIONS};
use std::fmt::Write as _;

/// Starts each line [`record_in_log`] writes.
const MARKER: &str = "paratune allocator: ";

/// What a recorded variable's line says when the shell did not set it.
const UNSET: &str = " unset";

/// The environment the plan priced `c` with on `engine`
/// ([`launch_environment`](crate::export::launch_environment)): the
/// allocator's option added to what `PYTORCH_CUDA_ALLOC_CONF` already asks
/// (the plan's memory verdict holds only with it), and to
/// `PYTORCH_ALLOC_CONF` where the shell sets that (newer PyTorch reads it
/// first), anything else set.
pub(crate) fn export_options(s: &mut String, c: &ParallelConfig, engine: Engine) {
    for (name, value) in crate::export::launch_environment(c, engine) {
        if name == ALLOCATOR_OPTIONS {
            let _ = writeln!(
                s,
                "case \",${{{name}:-}},\" in *,{value},*) ;; *) export {name}=\"${{{name}:+${{{name}}},}}{value}\" ;; esac"
            );
            let neutral = NEUTRAL_ALLOCATOR_OPTIONS;
            let _ = writeln!(
                s,
                "case \",${{{neutral}:-}},\" in ,,|*,{value},*) ;; *) export {neutral}=\"${{{neutral}}},{value}\" ;; esac"
            );
        } else {
            let _ = writeln!(s, "export {name}={value}");
        }
    }
}

/// Script lines that start `${LOG_FILE}` (truncating it; the launcher's
/// `tee -a` then appends) with both variables PyTorch reads its options
/// from, each as set or unset: the options the ranks ran with, whatever
/// set them.
pub(crate) fn record_in_log(s: &mut String) {
    let _ = writeln!(
        s,
        "# The allocator options the ranks start with, for `paratune ingest`."
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

/// Whether the ranks of the run logged in `text` had expandable segments,
/// from the lines [`record_in_log`] wrote (`None` where there are none: a
/// log of another launcher). PyTorch from 2.9 takes its options from
/// `PYTORCH_ALLOC_CONF` where that is set, even empty, and from
/// `PYTORCH_CUDA_ALLOC_CONF` otherwise (`c10/core/AllocatorConfig.cpp`);
/// neither set is its default, fixed segments.
pub fn recorded_in_log(text: &str) -> Option<bool> {
    let mut neutral = None;
    let mut cuda = None;
    for line in text.lines() {
        let Some(rest) = line.trim_end_matches('\r').strip_prefix(MARKER) else {
            continue;
        };
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
    Some(neutral.or(cuda).is_some_and(expandable))
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

    /// The log lines [`record_in_log`] writes when bash runs them with
    /// `neutral` and `cuda` as the two variables (`None`: unset).
    fn recorded_by_bash(neutral: Option<&str>, cuda: Option<&str>) -> String {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("run.log");
        let mut script = String::new();
        record_in_log(&mut script);
        let mut bash = std::process::Command::new("bash");
        bash.arg("-c")
            .arg(&script)
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
            let log = recorded_by_bash(neutral, cuda);
            assert_eq!(
                recorded_in_log(&log),
                Some(expected),
                "{neutral:?} {cuda:?}: {log}"
            );
            // A second record (a rerun appended to the log) changes nothing.
            let appended =
                format!("{log}paratune allocator: PYTORCH_ALLOC_CONF=expandable_segments:True\n");
            assert_eq!(recorded_in_log(&appended), Some(expected));
        }
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
