//! Library messages name the settings they advise on by key, in backticks
//! (`` `global_batch` ``, `` `schedule interleaved` ``); this CLI shows
//! them as its flags (`--global-batch`, `--schedule interleaved`). A key
//! becomes the flag of the same name (underscores as hyphens) when this
//! program has one; the few keys whose flag is named otherwise are listed.
//! Backticked text that is not a key (a model's name) stays as it is.

use super::args::Cli;
use clap::CommandFactory;
use std::collections::BTreeSet;
use std::sync::OnceLock;

/// Keys whose flag is not the key with hyphens.
const RENAMED: [(&str, &str); 1] = [("moe_dense_layers", "--dense-layers")];

/// Every long flag of every subcommand.
fn long_flags() -> &'static BTreeSet<String> {
    static FLAGS: OnceLock<BTreeSet<String>> = OnceLock::new();
    FLAGS.get_or_init(|| {
        fn collect(command: &clap::Command, into: &mut BTreeSet<String>) {
            for arg in command.get_arguments() {
                if let Some(long) = arg.get_long() {
                    into.insert(long.to_string());
                }
            }
            for sub in command.get_subcommands() {
                collect(sub, into);
            }
        }
        let mut flags = BTreeSet::new();
        collect(&Cli::command(), &mut flags);
        flags
    })
}

/// The flag that sets `key`, if this program has one.
fn flag_of(key: &str) -> Option<String> {
    if let Some((_, flag)) = RENAMED.iter().find(|(k, _)| *k == key) {
        return Some(flag.to_string());
    }
    let long = key.replace('_', "-");
    long_flags().contains(&long).then(|| format!("--{long}"))
}

/// `message` with each backticked key (and the value after it) as the flag.
pub fn with_flags(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(open) = rest.find('`') {
        let Some(len) = rest[open + 1..].find('`') else {
            break;
        };
        let inner = &rest[open + 1..open + 1 + len];
        let (key, value) = inner.split_once(' ').unwrap_or((inner, ""));
        out.push_str(&rest[..open]);
        match flag_of(key) {
            Some(flag) if value.is_empty() => out.push_str(&flag),
            Some(flag) => out.push_str(&format!("{flag} {value}")),
            None => out.push_str(&rest[open..open + len + 2]),
        }
        rest = &rest[open + len + 2..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::with_flags;

    #[test]
    fn keys_become_flags_and_other_backticks_stay() {
        assert_eq!(
            with_flags("change `global_batch` or `micro_batch`"),
            "change --global-batch or --micro-batch"
        );
        assert_eq!(
            with_flags("needs `schedule interleaved`"),
            "needs --schedule interleaved"
        );
        assert_eq!(
            with_flags("model `gpt3-175b`: lower `moe_dense_layers`"),
            "model `gpt3-175b`: lower --dense-layers"
        );
        assert_eq!(with_flags("an odd ` tick"), "an odd ` tick");
    }
}
