//! A profile directory as the measuring and importing commands open it:
//! the profile already in `--out` (or a new one for the GPU measured), and
//! the provenance each command stamps on it.

use super::args::ProvenanceArgs;
use anyhow::{Result, bail};
use paratune::profile::{Profile, read_profile};

/// The profile in `--out`, or a new one for `gpu` (`--gpu`, else what the
/// input says). An existing profile that does not read stops the import
/// before anything is written.
pub fn open_profile(provenance: &ProvenanceArgs, detected_gpu: Option<&str>) -> Result<Profile> {
    let out = &provenance.out;
    if out.join(paratune::profile::ENVIRONMENT_FILE).is_file() {
        let profile = read_profile(out)?;
        if let Some(gpu) = &provenance.gpu
            && !gpu.eq_ignore_ascii_case(&profile.environment.gpu)
        {
            bail!(
                "--gpu {gpu}: {} holds a profile of {}; import into another --out",
                out.display(),
                profile.environment.gpu
            );
        }
        return Ok(profile);
    }
    let Some(gpu) = provenance.gpu.as_deref().or(detected_gpu) else {
        bail!(
            "{} is a new profile: give --gpu NAME (the GPU measured, e.g. a100-80gb)",
            out.display()
        );
    };
    Ok(Profile::empty(&gpu.to_lowercase()))
}

/// Stamps the profile's environment with today, this version, the
/// provenance flags and this command line.
pub fn record_provenance(
    profile: &mut Profile,
    provenance: &ProvenanceArgs,
    extra_notes: &[String],
) {
    let env = &mut profile.environment;
    env.date = paratune::date::today_utc();
    env.paratune_version = env!("CARGO_PKG_VERSION").to_string();
    if let Some(source) = &provenance.source {
        if env.source.is_empty() {
            env.source = source.clone();
        } else if !env.source.split("; ").any(|s| s == source) {
            env.source = format!("{}; {source}", env.source);
        }
    }
    for note in provenance.note.iter().chain(extra_notes) {
        if !env.notes.contains(note) {
            env.notes.push(note.clone());
        }
    }
    env.commands.push(command_line());
}

/// The command line as typed, with `paratune` for the program, quoted where
/// a shell would need it.
fn command_line() -> String {
    let quoted = std::env::args()
        .skip(1)
        .map(|arg| paratune::export::shell_quote(&arg));
    std::iter::once("paratune".to_string())
        .chain(quoted)
        .collect::<Vec<_>>()
        .join(" ")
}
