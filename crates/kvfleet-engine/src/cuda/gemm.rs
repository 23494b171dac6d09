//! Projections on cuBLAS: `y = x · Wᵀ (+ beta · y)` with `x` and `W` in bf16, `y` in
//! f32 and f32 accumulation (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`).

use std::sync::Arc;

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::{result as blas, CudaBlas};
use cudarc::driver::CudaStream;

use crate::error::Result;

/// A cuBLAS handle bound to the backend's stream.
pub(crate) struct Gemm {
    blas: CudaBlas,
}

impl Gemm {
    pub(crate) fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let blas = CudaBlas::new(stream).map_err(super::device_err("creating a cuBLAS handle"))?;
        Ok(Self { blas })
    }

    /// `y[m][n] = x[m][k] · w[n][k]ᵀ + beta · y` with row-major `x`, `w` (bf16; `w` in
    /// Hugging Face `[out, in]` layout) and `y` (f32). `beta = 1` adds the product to
    /// `y` (the residual connection).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear(
        &self,
        x: u64,
        w: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
        beta: f32,
    ) -> Result<()> {
        if m == 0 {
            return Ok(());
        }
        let alpha = 1.0f32;
        let int = |v: usize| i32::try_from(v).unwrap_or(i32::MAX);
        // Row-major y = x·wᵀ is column-major yᵀ = w·xᵀ: w (column-major k×n) transposed
        // times x (column-major k×m).
        // SAFETY: x, w and y are live device allocations of at least m·k, n·k and m·n
        // elements of the stated types; alpha and beta are host f32 (host pointer mode).
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                int(n),
                int(m),
                int(k),
                (&alpha as *const f32).cast(),
                w as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                int(k),
                x as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                int(k),
                (&beta as *const f32).cast(),
                y as *mut std::ffi::c_void,
                cudaDataType_t::CUDA_R_32F,
                int(n),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(super::device_err("cublasGemmEx"))
    }
}
