//! The device buffers one step uses (activations, the step's metadata arrays, logits),
//! kept across steps: each only grows, to exactly what the largest step so far needed,
//! so after the first full-size step a step allocates nothing. Everything runs on one
//! stream, so a buffer rewritten by the next step is ordered after this step's reads.

use cudarc::driver::{CudaSlice, DeviceRepr};

use super::backend::Gpu;
use super::device_err;
use crate::error::Result;

/// A device buffer that is reused while big enough and reallocated when not.
pub(crate) struct GrowBuf<T> {
    buf: Option<CudaSlice<T>>,
}

impl<T: DeviceRepr> Default for GrowBuf<T> {
    fn default() -> Self {
        Self { buf: None }
    }
}

impl<T: DeviceRepr> GrowBuf<T> {
    /// Elements held (0 before the first use).
    pub(crate) fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, CudaSlice::len)
    }

    /// The buffer, with room for at least `n` elements (contents unspecified).
    pub(crate) fn at_least(&mut self, gpu: &Gpu, n: usize) -> Result<&mut CudaSlice<T>> {
        let n = n.max(1);
        let buf = match self.buf.take() {
            Some(b) if b.len() >= n => b,
            old => {
                // Free the old one first: the peak stays at the new size.
                drop(old);
                gpu.alloc(n)?
            }
        };
        Ok(self.buf.insert(buf))
    }

    /// The buffer holding `v` at its start.
    pub(crate) fn upload(&mut self, gpu: &Gpu, v: &[T]) -> Result<&CudaSlice<T>> {
        let stream = std::sync::Arc::clone(&gpu.stream);
        let b = self.at_least(gpu, v.len())?;
        if !v.is_empty() {
            let mut head = b.slice_mut(..v.len());
            stream
                .memcpy_htod(v, &mut head)
                .map_err(device_err("copying to the device"))?;
        }
        Ok(b)
    }
}

/// Every buffer of a step.
#[derive(Default)]
pub(crate) struct StepBuffers {
    pub(crate) tokens: GrowBuf<i32>,
    pub(crate) pos: GrowBuf<i32>,
    pub(crate) slots: GrowBuf<i32>,
    pub(crate) table_off: GrowBuf<i32>,
    pub(crate) tables: GrowBuf<i32>,
    pub(crate) dec_rows: GrowBuf<i32>,
    pub(crate) tile_row0: GrowBuf<i32>,
    pub(crate) tile_rows: GrowBuf<i32>,
    pub(crate) logit_rows: GrowBuf<i32>,
    /// `[src, dst]` of a block copy.
    pub(crate) copy_pairs: GrowBuf<i32>,
    /// Residual stream, f32 `[n][hidden]`.
    pub(crate) x: GrowBuf<f32>,
    /// Normed input of a GEMM, bf16 `[n][hidden]`.
    pub(crate) hb: GrowBuf<u16>,
    /// q|k|v, f32 `[n][q + 2 kv]`.
    pub(crate) qkv: GrowBuf<f32>,
    /// Attention output, bf16 `[n][q]`.
    pub(crate) attn: GrowBuf<u16>,
    /// gate|up, f32 `[n][2 inter]`.
    pub(crate) gu: GrowBuf<f32>,
    /// SiLU(gate)·up, bf16 `[n][inter]`.
    pub(crate) act: GrowBuf<u16>,
    /// Split-K decode partials.
    pub(crate) part_out: GrowBuf<f32>,
    pub(crate) part_max: GrowBuf<f32>,
    pub(crate) part_sum: GrowBuf<f32>,
    /// Logits, f32 `[m][vocab]`.
    pub(crate) logits: GrowBuf<f32>,
}

impl StepBuffers {
    /// Bytes held by all of them.
    pub(crate) fn bytes(&self) -> usize {
        let i32s = [
            &self.tokens,
            &self.pos,
            &self.slots,
            &self.table_off,
            &self.tables,
            &self.dec_rows,
            &self.tile_row0,
            &self.tile_rows,
            &self.logit_rows,
            &self.copy_pairs,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum::<usize>();
        let f32s = [
            &self.x,
            &self.qkv,
            &self.gu,
            &self.part_out,
            &self.part_max,
            &self.part_sum,
            &self.logits,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum::<usize>();
        let bf16s = [&self.hb, &self.attn, &self.act]
            .iter()
            .map(|b| b.capacity())
            .sum::<usize>();
        4 * (i32s + f32s) + 2 * bf16s
    }
}
