//! The libtorch backend (feature `torch`): the measuring entry points the
//! worker calls, over `torch_device.rs`, `torch_layer.rs` and
//! `torch_stage.rs`. `without_torch.rs` has the same functions for a build
//! without libtorch.

use super::{
    Device, DeviceJob, DeviceMeasurement, LayerJob, LayerMeasurement, MeasureError, StageJob,
    StageMeasurement,
};

/// Measures achievable matrix-multiply and copy throughput.
pub fn measure_device(job: &DeviceJob) -> Result<DeviceMeasurement, MeasureError> {
    super::torch_device::measure(job)
}

/// Measures one transformer layer shard.
pub fn measure_layer(job: &LayerJob) -> Result<LayerMeasurement, MeasureError> {
    super::torch_layer::measure(job)
}

/// Runs a trial of one pipeline stage.
pub fn measure_stage(job: &StageJob) -> Result<StageMeasurement, MeasureError> {
    super::torch_stage::measure(job)
}

/// Whether libtorch can use `device`.
pub fn check_device(device: Device) -> Result<(), MeasureError> {
    super::torch_layer::torch_device(device).map(drop)
}
