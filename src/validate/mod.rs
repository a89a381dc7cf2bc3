//! Validating a plan by trial runs (`paratune validate`) and feeding what
//! they measure back into the cost model.

pub mod allocator;
pub mod cluster;
pub mod launch;
pub mod local;
pub mod local_loop;
pub mod megatron_log;
pub mod refit;
pub mod sync_sweep;
pub mod torch_launch;
pub mod torchtitan_launch;
pub mod torchtitan_log;
