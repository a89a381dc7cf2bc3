//! Writing files so that a reader never sees half of one, and a set of files
//! lands whole or not at all. The one place paratune writes output files.
//!
//! - [`write_atomically`] / [`write_atomically_with`]: one file through a
//!   temporary file in the same folder, synced, then renamed over the target.
//! - [`Transaction`]: several files of one folder (a cost model and its
//!   report, a profile's tables and its `environment.toml`). Each is staged
//!   as a temporary file; [`Transaction::commit`] writes a journal naming the
//!   renames, syncs it, and only then renames. A kill before the journal
//!   leaves the old files; a kill after it is finished by [`recover`], which
//!   every writer (and every profile reader) runs first.
//! - New files honour the umask, as `cp` does: `0666 & !umask` (`0777` for
//!   scripts), never the temporary file's private 0600.
//!
//! Temporary files are named `.paratune-tmp.<pid>.<random>.<target>`, so
//! [`recover`] removes those of processes that no longer run, and only those.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

const TMP_PREFIX: &str = ".paratune-tmp.";
const JOURNAL_PREFIX: &str = ".paratune-commit.";

/// How a new file may be used, before the umask takes its share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Data: `0666 & !umask`.
    Data,
    /// A script to run: `0777 & !umask`.
    Executable,
}

impl Mode {
    #[cfg(unix)]
    fn bits(self) -> u32 {
        match self {
            Mode::Data => 0o666,
            Mode::Executable => 0o777,
        }
    }
}

/// The folder `path` lives in ("." for a bare file name).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

fn file_name(path: &Path) -> io::Result<String> {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a file name", path.display()),
            )
        })
}

/// A temporary file beside `target`, named for this process.
fn staged_file(target: &Path, mode: Mode) -> io::Result<tempfile::NamedTempFile> {
    let dir = parent_dir(target);
    let prefix = format!("{TMP_PREFIX}{}.", std::process::id());
    let suffix = format!(".{}", file_name(target)?);
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(&suffix);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(mode.bits()));
    }
    #[cfg(not(unix))]
    let _ = mode;
    builder.tempfile_in(dir)
}

/// Writes `bytes` to `path` atomically (see the module documentation).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_atomically_with(path, Mode::Data, |file| file.write_all(bytes))
}

/// Writes `path` atomically with `write`, which fills the open file. On any
/// error the temporary file is removed and `path` is untouched.
pub fn write_atomically_with(
    path: &Path,
    mode: Mode,
    write: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    recover(parent_dir(path))?;
    let mut tmp = staged_file(path, mode)?;
    write(tmp.as_file_mut())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(parent_dir(path));
    Ok(())
}

/// Several files of one folder, written all or none.
pub struct Transaction {
    dir: PathBuf,
    staged: Vec<(tempfile::TempPath, PathBuf)>,
}

impl Transaction {
    /// A transaction on files of `dir` (created if missing). Finishes or
    /// clears what an interrupted earlier writer left there first.
    pub fn new(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        recover(dir)?;
        Ok(Transaction {
            dir: dir.to_path_buf(),
            staged: Vec::new(),
        })
    }

    /// Stages `name` (a file name in the transaction's folder) with `bytes`.
    pub fn stage(&mut self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.stage_with(name, Mode::Data, |file| file.write_all(bytes))
    }

    /// Stages `name`, filled by `write`.
    pub fn stage_with(
        &mut self,
        name: &str,
        mode: Mode,
        write: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> io::Result<()> {
        let target = self.dir.join(name);
        let mut tmp = staged_file(&target, mode)?;
        write(tmp.as_file_mut())?;
        tmp.as_file().sync_all()?;
        self.staged.push((tmp.into_temp_path(), target));
        Ok(())
    }

    /// Puts every staged file in place. Until the journal is written
    /// nothing has changed; after it, [`recover`] completes the renames.
    pub fn commit(self) -> io::Result<()> {
        if self.staged.is_empty() {
            return Ok(());
        }
        let mut journal = String::new();
        for (tmp, target) in &self.staged {
            journal.push_str(&file_name(tmp)?);
            journal.push('\t');
            journal.push_str(&file_name(target)?);
            journal.push('\n');
        }
        let journal_path = self.dir.join(format!(
            "{JOURNAL_PREFIX}{}.{}",
            std::process::id(),
            unique_suffix()
        ));
        write_atomically_raw(&journal_path, journal.as_bytes())?;
        for (tmp, target) in self.staged {
            // Persisting: from here the staged file must not be deleted on drop.
            let tmp = tmp.keep().map_err(|e| e.error)?;
            std::fs::rename(&tmp, &target)?;
        }
        sync_dir(&self.dir);
        std::fs::remove_file(&journal_path)?;
        sync_dir(&self.dir);
        Ok(())
    }
}

/// An empty folder inside `parent` to build a new folder in, named as a
/// temporary file of this process (so [`recover`] clears it if the process
/// dies before [`move_dir_into_place`]).
pub fn staging_dir(parent: &Path) -> io::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("{TMP_PREFIX}{}.", std::process::id()))
        .tempdir_in(parent)
}

/// Renames a folder built in [`staging_dir`] to `target`, which must not
/// exist or be empty.
pub fn move_dir_into_place(staging: tempfile::TempDir, target: &Path) -> io::Result<()> {
    let staged = staging.keep();
    #[cfg(unix)]
    {
        // The staging folder is private (0700) like every temporary one.
        use std::os::unix::fs::PermissionsExt;
        let umask = current_umask();
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o777 & !umask))?;
    }
    if target.is_dir() {
        std::fs::remove_dir(target)?;
    }
    std::fs::rename(&staged, target)?;
    sync_dir(parent_dir(target));
    Ok(())
}

/// The process's umask, from `/proc/self/status` (reading it with umask(2)
/// would change it for a moment under other threads); 022 where unreadable.
#[cfg(unix)]
fn current_umask() -> u32 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}

/// A journal's own atomic write: no [`recover`] first (the caller is
/// inside one), and a name that `recover` does not take for a stray file
/// until it is complete.
fn write_atomically_raw(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = staged_file(path, Mode::Data)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(parent_dir(path));
    Ok(())
}

fn unique_suffix() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{nanos:x}")
}

/// Syncs a folder so that renames in it survive a power cut; best effort
/// (not every file system lets a folder be opened).
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// What [`recover`] did in a folder.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Files an interrupted commit had journalled and that are now in place.
    pub completed: Vec<String>,
    /// Temporary files of processes that no longer run, removed.
    pub removed: usize,
}

/// Finishes the commits that an interrupted writer journalled in `dir` and
/// removes the temporary files of writers that no longer run. A folder that
/// does not exist has nothing to recover.
pub fn recover(dir: &Path) -> io::Result<Recovery> {
    let mut recovery = Recovery::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(recovery),
        Err(e) => return Err(e),
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // A journal of a writer that still runs is that writer's to finish.
    let finished = |n: &&String| n.starts_with(JOURNAL_PREFIX) && owner_is_gone(n);
    for journal in names.iter().filter(finished) {
        let path = dir.join(journal);
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for line in text.lines() {
            let Some((tmp, target)) = line.split_once('\t') else {
                continue;
            };
            let tmp_path = dir.join(tmp);
            if tmp_path.is_file() {
                std::fs::rename(&tmp_path, dir.join(target))?;
                recovery.completed.push(target.to_string());
            }
        }
        sync_dir(dir);
        std::fs::remove_file(&path)?;
    }
    for name in names.iter().filter(|n| n.starts_with(TMP_PREFIX)) {
        let path = dir.join(name);
        if !owner_is_gone(name) {
            continue;
        }
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else if path.exists() {
            std::fs::remove_file(&path)?;
        } else {
            continue; // renamed into place by a journal above
        }
        recovery.removed += 1;
    }
    Ok(recovery)
}

/// Whether the process that named a temporary file `.paratune-tmp.<pid>...`
/// (or a journal `.paratune-commit.<pid>...`) has ended. A name without a
/// readable pid is not paratune's.
fn owner_is_gone(name: &str) -> bool {
    let Some(pid) = name
        .strip_prefix(TMP_PREFIX)
        .or_else(|| name.strip_prefix(JOURNAL_PREFIX))
        .and_then(|rest| rest.split('.').next())
        .and_then(|pid| pid.parse::<i32>().ok())
    else {
        return false;
    };
    if pid == std::process::id() as i32 {
        return false;
    }
    !process_runs(pid)
}

#[cfg(unix)]
fn process_runs(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill(2) with signal 0 sends nothing; it only checks the pid.
    let status = unsafe { libc::kill(pid, 0) };
    status == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(not(unix))]
fn process_runs(_pid: i32) -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_file_is_replaced_whole_and_no_temporary_file_stays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.csv");
        write_atomically(&path, b"old").unwrap();
        write_atomically(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(names(dir.path()), ["a.csv"]);
        let failed = write_atomically_with(&path, Mode::Data, |_| Err(io::Error::other("boom")));
        assert!(failed.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(names(dir.path()), ["a.csv"]);
    }

    #[cfg(unix)]
    #[test]
    fn new_files_honour_the_umask_not_the_temporary_files_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // The test process's umask, read without changing it for long.
        // SAFETY: umask(2) is always safe; it is set straight back.
        let umask = unsafe {
            let old = libc::umask(0o022);
            libc::umask(old);
            old
        } as u32;
        let data = dir.path().join("d.toml");
        write_atomically(&data, b"x").unwrap();
        let mode = std::fs::metadata(&data).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666 & !umask);
        let script = dir.path().join("run.sh");
        write_atomically_with(&script, Mode::Executable, |f| f.write_all(b"#!/bin/sh\n")).unwrap();
        let mode = std::fs::metadata(&script).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o777 & !umask);
    }

    #[test]
    fn a_transaction_lands_every_file_or_none() {
        let dir = tempfile::tempdir().unwrap();
        write_atomically(&dir.path().join("model.toml"), b"old model").unwrap();
        write_atomically(&dir.path().join("model.report.md"), b"old report").unwrap();
        let mut t = Transaction::new(dir.path()).unwrap();
        t.stage("model.toml", b"new model").unwrap();
        t.stage("model.report.md", b"new report").unwrap();
        drop(t); // interrupted before the commit
        assert_eq!(
            std::fs::read(dir.path().join("model.toml")).unwrap(),
            b"old model"
        );
        assert_eq!(names(dir.path()), ["model.report.md", "model.toml"]);
        let mut t = Transaction::new(dir.path()).unwrap();
        t.stage("model.toml", b"new model").unwrap();
        t.stage("model.report.md", b"new report").unwrap();
        t.commit().unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("model.report.md")).unwrap(),
            b"new report"
        );
        assert_eq!(names(dir.path()), ["model.report.md", "model.toml"]);
    }

    /// A journal written by a writer killed halfway through its renames:
    /// the next writer (or reader) completes them.
    #[test]
    fn recovery_finishes_a_journalled_commit_and_clears_dead_writers_files() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("env.toml"), "old").unwrap();
        std::fs::write(d.join("table.csv"), "new table").unwrap(); // already renamed
        let staged = format!("{TMP_PREFIX}999999999.abc.env.toml");
        std::fs::write(d.join(&staged), "new env").unwrap();
        std::fs::write(
            d.join(format!("{JOURNAL_PREFIX}999999999.1")),
            format!("{TMP_PREFIX}999999999.def.table.csv\ttable.csv\n{staged}\tenv.toml\n"),
        )
        .unwrap();
        // A dead writer's stray file, and one of a live process (this one).
        std::fs::write(d.join(format!("{TMP_PREFIX}999999998.x.other")), "x").unwrap();
        let mine = format!("{TMP_PREFIX}{}.y.other", std::process::id());
        std::fs::write(d.join(&mine), "y").unwrap();
        let r = recover(d).unwrap();
        assert_eq!(r.completed, ["env.toml"]);
        assert_eq!(r.removed, 1);
        assert_eq!(
            std::fs::read_to_string(d.join("env.toml")).unwrap(),
            "new env"
        );
        assert_eq!(names(d), [mine.as_str(), "env.toml", "table.csv"]);
    }
}
