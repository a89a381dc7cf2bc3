//! How much memory the measured work holds.
//!
//! - **CPU**: the process's resident set (`/proc/self/statm`) and its
//!   high-water mark (`VmHWM` in `/proc/self/status`, reset by writing `5`
//!   to `/proc/self/clear_refs`). [`prepare_process`] makes glibc serve
//!   every allocation of 64 KiB or more with its own mapping, returned to
//!   the system when freed, so the resident set follows the live tensors
//!   instead of the allocator's free lists.
//! - **CUDA**: the device's used memory (`cuMemGetInfo` through cudarc, the
//!   `cuda` feature). The measuring process is fresh, and PyTorch's caching
//!   allocator keeps what it reserved, so the used memory after a pass is
//!   the high-water mark of what the pass reserved: what it kept plus the
//!   temporaries it freed into the cache along the way, rounded to the
//!   allocator's blocks (2 MiB and up). It is device-wide: another process
//!   on the same GPU moves it. Allocated bytes proper would need the
//!   allocator's statistics, which tch does not expose; so `profile layer`
//!   measures activations again in a worker with the caching allocator off
//!   (`PYTORCH_NO_CUDA_MEMORY_CACHING=1`, `LayerPass::MemoryOnly`), where
//!   freed memory goes back to the driver and the used memory after the
//!   forward is what the forward keeps.
//!
//! Elsewhere (another OS, CUDA without the `cuda` feature) memory is not
//! measured and the readings are `None`.

use super::Device;

/// Readings of one device's memory, bytes.
pub trait MemoryProbe {
    /// Memory in use now.
    fn used(&self) -> Option<f64>;
    /// Starts a new high-water mark.
    fn reset_peak(&self);
    /// The highest use since the last reset.
    fn peak(&self) -> Option<f64>;
}

/// The probe for `device`.
pub fn probe(device: Device) -> Box<dyn MemoryProbe> {
    match device {
        Device::Cpu => Box::new(ProcessMemory),
        Device::Cuda(index) => super::cuda_memory_probe(index),
    }
}

/// Makes allocations of 64 KiB and more come from their own mappings, so
/// freeing them lowers the resident set (see the module comment). Call once,
/// before the measured work allocates.
pub fn prepare_process() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation thresholds; it is
    // called before the measurement allocates anything large.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
    }
}

/// The current process's resident memory (Linux).
pub struct ProcessMemory;

impl MemoryProbe for ProcessMemory {
    fn used(&self) -> Option<f64> {
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let resident_pages: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
        Some(resident_pages * page_size())
    }

    fn reset_peak(&self) {
        // Linux ≥ 4.0 resets VmHWM to the current resident set.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }

    fn peak(&self) -> Option<f64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        status_kib(&status, "VmHWM:").map(|kib| kib * 1024.0)
    }
}

fn page_size() -> f64 {
    #[cfg(unix)]
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    #[cfg(not(unix))]
    let size = 4096;
    if size > 0 { size as f64 } else { 4096.0 }
}

/// A `Name:   123 kB` line of `/proc/self/status`, in KiB.
fn status_kib(status: &str, name: &str) -> Option<f64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// A probe that measures nothing.
pub struct Unmeasured;

impl MemoryProbe for Unmeasured {
    fn used(&self) -> Option<f64> {
        None
    }
    fn reset_peak(&self) {}
    fn peak(&self) -> Option<f64> {
        None
    }
}

/// The host's physical memory (`sysconf`), what CPU ranks share.
pub fn host_memory_bytes() -> Option<f64> {
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page > 0).then_some(pages as f64 * page as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_parse() {
        let status = "Name:\tparatune\nVmPeak:\t  1000 kB\nVmHWM:\t    2048 kB\n";
        assert_eq!(status_kib(status, "VmHWM:"), Some(2048.0));
        assert_eq!(status_kib(status, "VmRSS:"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn resident_memory_follows_a_large_buffer() {
        prepare_process();
        let probe = ProcessMemory;
        let before = probe.used().unwrap();
        probe.reset_peak();
        let size = 64 << 20;
        let buffer = vec![1u8; size];
        let during = probe.used().unwrap();
        std::hint::black_box(&buffer);
        drop(buffer);
        let peak = probe.peak().unwrap();
        // Other tests run in this process at the same time: allow slack,
        // but the 64 MiB buffer must show.
        assert!(during - before > 0.8 * size as f64, "{before} -> {during}");
        assert!(peak >= during * 0.99, "peak {peak} during {during}");
    }
}
