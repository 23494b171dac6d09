//! Kernel launches with plain arguments: device pointers as `u64`, sizes as `i32`.
//! The backend owns its buffers and runs everything on one stream, so cudarc's
//! per-buffer event tracking is switched off and raw pointers are passed.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use crate::error::Result;

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer (0 for a null pointer).
    Ptr(u64),
    /// A C `int`.
    I32(i32),
    /// A C `long long`.
    I64(i64),
    /// A C `float`.
    F32(f32),
}

/// The device address of `s` (valid while `s` lives).
pub(crate) fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// An `i32` argument from a size, saturating (sizes are validated against `i32` first).
pub(crate) fn i32_of(v: usize) -> Arg {
    Arg::I32(i32::try_from(v).unwrap_or(i32::MAX))
}

/// Launches `f` on `stream` with `grid` × `block` threads and `args`.
pub(crate) fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    args: &[Arg],
) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(f);
    for a in args {
        match a {
            Arg::Ptr(v) => b.arg(v),
            Arg::I32(v) => b.arg(v),
            Arg::I64(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
        };
    }
    // SAFETY: every kernel's argument list is matched by its caller in `backend.rs`
    // (pointer, int, long long and float parameters in order), and every pointer is a
    // live allocation of the backend sized for the launch.
    unsafe { b.launch(cfg) }.map_err(super::device_err("kernel launch"))?;
    Ok(())
}
