//! The CUDA backend: the same Llama-family forward step as [`crate::model`], on a GPU.
//!
//! cudarc loads the driver, NVRTC and cuBLAS with `dlopen` at run time, so builds need
//! no CUDA toolkit; [`probe`] checks the libraries and the device before anything calls
//! into them (cudarc panics on a missing library). The kernels (`kernels/*.cu`) are
//! embedded in the binary and compiled by NVRTC at start for the device's architecture
//! ([`kernels`]); projections are cuBLAS GEMMs in bf16 with f32 accumulation
//! ([`gemm`]). Weights and the KV cache live on the device in bf16
//! ([`weights`], [`kv_blocks`]); the residual stream stays in f32. A step's
//! activations and metadata live in buffers kept across steps ([`step_buffers`]).

pub mod backend;
pub mod bench;
pub(crate) mod gemm;
pub mod kernels;
pub(crate) mod kv_blocks;
pub(crate) mod launch;
pub mod probe;
pub(crate) mod step_buffers;
pub(crate) mod weights;

#[cfg(all(test, feature = "gpu-tests"))]
mod kernel_tests;
pub use backend::CudaBackend;
pub use probe::{probe, DeviceInfo};

use crate::error::EngineError;

/// Maps a cudarc error to [`EngineError::Device`], saying what was being done.
pub(crate) fn device_err<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> EngineError {
    move |e| EngineError::Device(format!("{what}: {e:?}"))
}
