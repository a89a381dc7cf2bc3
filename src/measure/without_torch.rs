//! The stand-in for the libtorch backend in a build without the `torch`
//! feature: the same functions as `torch_backend.rs`, each saying what it
//! would have measured and how to get a build that does.

use super::{
    Device, DeviceJob, DeviceMeasurement, LayerJob, LayerMeasurement, MeasureError, StageJob,
    StageMeasurement,
};

pub fn measure_device(_job: &DeviceJob) -> Result<DeviceMeasurement, MeasureError> {
    Err(MeasureError::NotCompiled {
        what: "measuring matrix multiplies and copies",
    })
}

pub fn measure_layer(_job: &LayerJob) -> Result<LayerMeasurement, MeasureError> {
    Err(MeasureError::NotCompiled {
        what: "measuring layers",
    })
}

pub fn measure_stage(_job: &StageJob) -> Result<StageMeasurement, MeasureError> {
    Err(MeasureError::NotCompiled {
        what: "local trial runs",
    })
}

/// Without libtorch no device is used: the CUDA check alone decides.
pub fn check_device(_device: Device) -> Result<(), MeasureError> {
    Ok(())
}
