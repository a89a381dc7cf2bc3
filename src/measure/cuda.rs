//! Device facts and device memory through the CUDA driver (cudarc, the
//! `cuda` feature). cudarc loads `libcuda` on first use and panics when it
//! is absent, so every entry point checks [`cuda_presence`] first; without
//! the feature the same functions return a clear error.

use super::memory::MemoryProbe;
use super::{Device, DeviceFacts, MeasureError};

#[cfg(feature = "cuda")]
mod driver {
    use super::*;
    use cudarc::driver::CudaContext;
    use cudarc::driver::sys::CUdevice_attribute as Attr;
    use std::sync::Arc;

    fn failed(e: impl std::fmt::Display) -> MeasureError {
        MeasureError::Failed(format!("CUDA driver: {e}"))
    }

    pub fn cuda_presence(device: Device) -> Result<usize, MeasureError> {
        let Device::Cuda(index) = device else {
            return Ok(0);
        };
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(MeasureError::NoCuda {
                device,
                reason: "libcuda, the NVIDIA driver library, was not found".into(),
            });
        }
        let count = CudaContext::device_count().map_err(|e| MeasureError::NoCuda {
            device,
            reason: e.to_string(),
        })? as usize;
        if count == 0 {
            return Err(MeasureError::NoCuda {
                device,
                reason: "the driver reports no GPU".into(),
            });
        }
        if index >= count {
            return Err(MeasureError::NoSuchGpu { device, count });
        }
        Ok(count)
    }

    pub fn device_facts(device: Device) -> Result<DeviceFacts, MeasureError> {
        cuda_presence(device)?;
        let Device::Cuda(index) = device else {
            return Err(MeasureError::Invalid {
                field: "device",
                message: "device facts come from the CUDA driver: use cuda:N".into(),
            });
        };
        let ctx = CudaContext::new(index).map_err(failed)?;
        let attr = |a: Attr| ctx.attribute(a).map_err(failed);
        let (major, minor) = ctx.compute_capability().map_err(failed)?;
        let mut version: std::ffi::c_int = 0;
        // SAFETY: writes one int; the driver is initialised by the context above.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(failed)?;
        Ok(DeviceFacts {
            name: ctx.name().map_err(failed)?,
            index,
            memory_bytes: ctx.total_mem().map_err(failed)? as f64,
            multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            compute_capability: format!("{major}.{minor}"),
            sm_clock_mhz: attr(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)? as f64 / 1e3,
            memory_clock_mhz: attr(Attr::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? as f64 / 1e3,
            memory_bus_bits: attr(Attr::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)? as u32,
            driver_version: format!("{}.{}", version / 1000, (version % 1000) / 10),
        })
    }

    /// Device memory in use, from the driver (see `memory.rs`).
    struct DeviceUsed {
        ctx: Arc<CudaContext>,
    }

    impl MemoryProbe for DeviceUsed {
        fn used(&self) -> Option<f64> {
            let (free, total) = self.ctx.mem_get_info().ok()?;
            Some(total.saturating_sub(free) as f64)
        }
        // The caching allocator keeps what it reserved: used memory is
        // already the high-water mark.
        fn reset_peak(&self) {}
        fn peak(&self) -> Option<f64> {
            self.used()
        }
    }

    pub fn cuda_memory_probe(index: usize) -> Box<dyn MemoryProbe> {
        if cuda_presence(Device::Cuda(index)).is_err() {
            return Box::new(super::super::memory::Unmeasured);
        }
        match CudaContext::new(index) {
            Ok(ctx) => Box::new(DeviceUsed { ctx }),
            Err(_) => Box::new(super::super::memory::Unmeasured),
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod driver {
    use super::*;

    /// Without the `cuda` feature presence cannot be checked here; torch
    /// checks it when it runs the work.
    pub fn cuda_presence(_device: Device) -> Result<usize, MeasureError> {
        Ok(0)
    }

    pub fn device_facts(_device: Device) -> Result<DeviceFacts, MeasureError> {
        Err(MeasureError::NotCompiledCuda {
            what: "reading device facts",
        })
    }

    pub fn cuda_memory_probe(_index: usize) -> Box<dyn MemoryProbe> {
        Box::new(super::super::memory::Unmeasured)
    }
}

pub use driver::{cuda_memory_probe, cuda_presence, device_facts};
