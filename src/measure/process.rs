//! The worker processes measuring runs in, and their lifecycle: this
//! program spawned again as its hidden `profile worker --job JSON` command
//! (one measurement, one JSON reply line), a trial script run in its own
//! process group, and both stopped once their time is up. Kept with the
//! protocol ([`WorkerJob`], [`WorkerReply`]) they speak, as one place.

use super::{WorkerJob, WorkerReply};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `job` in a fresh process of this binary; kills it after `timeout`.
/// `Err` says why no reply came (crash, kill, timeout).
pub fn spawn_worker(job: &WorkerJob, timeout: Duration) -> Result<WorkerReply, String> {
    spawn_worker_with_env(job, timeout, &[])
}

/// [`spawn_worker`] with extra environment variables for the worker.
pub fn spawn_worker_with_env(
    job: &WorkerJob,
    timeout: Duration,
    env: &[(&str, String)],
) -> Result<WorkerReply, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let json = serde_json::to_string(job).map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args(["profile", "worker", "--job", &json])
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start a worker process: {e}"))?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_string(&mut text);
            }
            text
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let status = wait_with_timeout(&mut child, timeout)?;
    let out = stdout.join().unwrap_or_default();
    let err = stderr.join().unwrap_or_default();
    let reply = out
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .and_then(|l| serde_json::from_str::<WorkerReply>(l).ok());
    reply.ok_or_else(|| {
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no message");
        format!("the worker process ended ({status}) without a result: {last}")
    })
}

/// Waits for `child`; kills it once `timeout` has passed.
pub fn wait_with_timeout(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Result<std::process::ExitStatus, String> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Ok(None) if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "killed after the {} s timeout (--timeout)",
                    timeout.as_secs_f64()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("lost the process: {e}")),
        }
    }
}

/// Runs `bash SCRIPT`, killed after `timeout`.
pub fn run_script(script: &Path, timeout: Duration) -> Result<(), String> {
    let mut command = Command::new("bash");
    command
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Its own process group, so that a timeout stops torchrun/srun and the
    // ranks under it too, not only bash: they hold GPUs and a port.
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = command
        .spawn()
        .map_err(|e| format!("could not start bash: {e}"))?;
    match wait_with_timeout(&mut child, timeout) {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("the run failed ({status})")),
        Err(why) => {
            stop_group(child.id());
            Err(why)
        }
    }
}

/// How long a timed-out run's processes get to stop after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Stops a timed-out run's process group: SIGTERM (srun cancels its step),
/// then SIGKILL for what is left after a grace period.
fn stop_group(pid: u32) {
    #[cfg(unix)]
    {
        let group = -(pid as i32);
        // SAFETY: kill(2) on a process group this command created.
        unsafe { libc::kill(group, libc::SIGTERM) };
        // Polled, not slept: most runs are gone within milliseconds.
        let grace = std::time::Instant::now();
        // SAFETY: signal 0 only asks whether any process of the group is left.
        while unsafe { libc::kill(group, 0) } == 0 && grace.elapsed() < STOP_GRACE {
            std::thread::sleep(Duration::from_millis(50));
        }
        // SAFETY: as above.
        unsafe { libc::kill(group, libc::SIGKILL) };
    }
}

/// The worker's `LD_LIBRARY_PATH` with a `libnccl.so` link first where
/// cudarc would otherwise not find NCCL (see `measure::nccl_link_dir`).
pub fn nccl_library_env(scratch: &Path) -> Vec<(&'static str, String)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    // An empty entry would put the current folder on the worker's path.
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .filter(|d| !d.as_os_str().is_empty())
        .collect();
    match super::nccl_link_dir(&maps, &dirs, scratch) {
        Some(dir) => {
            let joined = std::env::join_paths(std::iter::once(dir).chain(dirs))
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or(path);
            vec![("LD_LIBRARY_PATH", joined)]
        }
        None => Vec::new(),
    }
}
