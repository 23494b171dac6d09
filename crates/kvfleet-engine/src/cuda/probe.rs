//! Checks, before anything calls into cudarc, that the CUDA libraries load and the
//! requested device exists: cudarc panics on a missing library, and a worker asked for
//! `--device cuda:0` on a machine without one must fail with a message instead.

use cudarc::driver::{result as drv, CudaContext};

use crate::error::{EngineError, Result};

/// What a probe found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// The device number.
    pub ordinal: usize,
    /// Marketing name ("NVIDIA H200").
    pub name: String,
    /// Compute capability (major, minor): (9, 0) on Hopper.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
}

/// Whether NVRTC (`libnvrtc.so.13`) can be loaded: what compiling the kernels needs.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries `dlopen` on cudarc's candidate names and closes the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Checks the driver, NVRTC and cuBLAS libraries, then that device `ordinal` exists;
/// returns its description. Every failure is an [`EngineError::Device`] naming what is
/// missing and how to provide it.
pub fn probe(ordinal: usize) -> Result<DeviceInfo> {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(EngineError::Device(format!(
            "cuda:{ordinal} requested but the CUDA driver library (libcuda.so.1) is not \
             installed: install the NVIDIA driver, or run with --device cpu"
        )));
    }
    if !nvrtc_present() {
        return Err(EngineError::Device(format!(
            "cuda:{ordinal} requested but NVRTC (libnvrtc.so.13) cannot be loaded: install \
             the CUDA 13 toolkit or `pip install nvidia-cuda-nvrtc` and put its lib folder \
             on LD_LIBRARY_PATH"
        )));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(EngineError::Device(format!(
            "cuda:{ordinal} requested but cuBLAS (libcublas.so.13) cannot be loaded: install \
             the CUDA 13 toolkit or `pip install nvidia-cublas` and put its lib folder on \
             LD_LIBRARY_PATH"
        )));
    }
    drv::init().map_err(|e| {
        EngineError::Device(format!(
            "cuda:{ordinal} requested but the CUDA driver did not initialize ({e:?}): no \
             usable GPU?"
        ))
    })?;
    let count = drv::device::get_count()
        .map_err(|e| EngineError::Device(format!("counting CUDA devices: {e:?}")))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(EngineError::Device(format!(
            "cuda:{ordinal} requested but this machine has {count} CUDA device(s)"
        )));
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| EngineError::Device(format!("creating a context on cuda:{ordinal}: {e:?}")))?;
    let err = |e| EngineError::Device(format!("querying cuda:{ordinal}: {e:?}"));
    Ok(DeviceInfo {
        ordinal,
        name: ctx.name().map_err(err)?,
        compute_capability: ctx.compute_capability().map_err(err)?,
        total_mem: ctx.total_mem().map_err(err)?,
    })
}
