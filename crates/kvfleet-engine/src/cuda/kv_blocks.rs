//! The paged KV cache on the device, in bf16, with the CPU cache's block layout: per
//! layer, K and V are each `[num_blocks][block_size][n_kv_heads][head_dim]`, so a block
//! table means the same on both backends. All layers share one allocation of
//! `2 · layers` planes (layer-major, K then V) so one kernel launch copies a block in
//! every layer.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::launch::{ptr, Arg};
use crate::error::Result;

/// Keys and values of every layer.
pub(crate) struct DeviceKv {
    data: CudaSlice<u16>,
    num_layers: usize,
    num_blocks: usize,
    block_size: usize,
    /// bf16 elements of one block in one plane: `block_size · n_kv_heads · head_dim`.
    block_elems: usize,
}

impl DeviceKv {
    /// A zeroed cache.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_dim: usize,
    ) -> Result<Self> {
        let block_elems = block_size * kv_dim;
        let data = stream
            .alloc_zeros::<u16>((2 * num_layers * num_blocks * block_elems).max(1))
            .map_err(super::device_err("allocating the KV cache"))?;
        Ok(Self {
            data,
            num_layers,
            num_blocks,
            block_size,
            block_elems,
        })
    }

    pub(crate) fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    fn plane_elems(&self) -> usize {
        self.num_blocks * self.block_elems
    }

    /// Device address of layer `layer`'s keys.
    pub(crate) fn k_ptr(&self, stream: &CudaStream, layer: usize) -> u64 {
        ptr(&self.data, stream) + (2 * layer * self.plane_elems() * 2) as u64
    }

    /// Device address of layer `layer`'s values.
    pub(crate) fn v_ptr(&self, stream: &CudaStream, layer: usize) -> u64 {
        ptr(&self.data, stream) + ((2 * layer + 1) * self.plane_elems() * 2) as u64
    }

    /// Arguments of `copy_blocks` for `pairs` (a device array of `[src, dst]` ints), and
    /// its grid for `n` pairs.
    pub(crate) fn copy_args(
        &self,
        stream: &CudaStream,
        pairs: u64,
        n: usize,
    ) -> (Vec<Arg>, (u32, u32, u32)) {
        let args = vec![
            Arg::Ptr(ptr(&self.data, stream)),
            Arg::Ptr(pairs),
            Arg::I64(i64::try_from(self.plane_elems()).unwrap_or(i64::MAX)),
            Arg::I32(i32::try_from(self.block_elems).unwrap_or(i32::MAX)),
        ];
        let grid = (
            u32::try_from(n).unwrap_or(u32::MAX),
            u32::try_from(2 * self.num_layers).unwrap_or(u32::MAX),
            1,
        );
        (args, grid)
    }

    /// The whole cache (all planes), for tests that read it back.
    #[cfg(all(test, feature = "gpu-tests"))]
    pub(crate) fn data(&self) -> &CudaSlice<u16> {
        &self.data
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        2 * self.num_layers * self.plane_elems() * 2
    }
}
