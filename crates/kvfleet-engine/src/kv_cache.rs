//! The paged KV memory: fixed-size blocks of key/value vectors for every layer.
//!
//! Per layer, `k` and `v` are flat `Vec<f32>` laid out as
//! `[num_blocks][block_size][n_kv_heads][head_dim]`. Position `p` of a sequence lives in
//! block `block_table[p / block_size]` at offset `p % block_size`. The block pool decides
//! which blocks a sequence owns; this type only stores the numbers.

/// Keys and values of one layer.
#[derive(Debug, Clone)]
pub(crate) struct LayerKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// Paged key/value storage for all layers of a model.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    num_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

impl KvCache {
    /// Allocates a zeroed cache. Memory is `2 * num_layers * num_blocks * block_size *
    /// n_kv_heads * head_dim * 4` bytes (zeroed pages are only touched when written).
    ///
    /// # Panics
    /// If `block_size` is zero.
    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        assert!(block_size > 0, "KvCache block_size must be positive");
        let len = num_blocks * block_size * n_kv_heads * head_dim;
        let layers = (0..num_layers)
            .map(|_| LayerKv {
                k: vec![0.0; len],
                v: vec![0.0; len],
            })
            .collect();
        Self {
            layers,
            num_blocks,
            block_size,
            n_kv_heads,
            head_dim,
        }
    }

    /// Number of blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Key/value heads per position.
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Floats per block in one layer's K (or V) array.
    pub(crate) fn block_stride(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    /// Copies block `src` onto block `dst` in every layer, keys and values: the data half
    /// of a copy-on-write fork of a partially filled block.
    ///
    /// # Panics
    /// If either id is not below [`KvCache::num_blocks`].
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let (src, dst) = (src as usize, dst as usize);
        assert!(
            src < self.num_blocks && dst < self.num_blocks,
            "copy_block({src}, {dst}) outside a cache of {} blocks",
            self.num_blocks
        );
        if src == dst {
            return;
        }
        let stride = self.block_stride();
        for layer in &mut self.layers {
            layer
                .k
                .copy_within(src * stride..(src + 1) * stride, dst * stride);
            layer
                .v
                .copy_within(src * stride..(src + 1) * stride, dst * stride);
        }
    }

    /// Bytes held by keys and values.
    pub fn bytes(&self) -> usize {
        2 * self.layers.len() * self.num_blocks * self.block_stride() * std::mem::size_of::<f32>()
    }

    /// Bytes one block takes across all layers, keys and values: what the block pool
    /// multiplies by its block count when sizing the cache from a memory budget.
    pub fn bytes_per_block(&self) -> usize {
        2 * self.layers.len() * self.block_stride() * std::mem::size_of::<f32>()
    }

    /// One block's keys and values, every layer, as little-endian f32 bytes in the
    /// order layer 0 K, layer 0 V, layer 1 K, …: what a lower tier or a peer stores.
    pub fn read_block(&self, id: u32) -> crate::error::Result<Vec<u8>> {
        let id = self.check_block(id)?;
        let stride = self.block_stride();
        let mut out = Vec::with_capacity(self.bytes_per_block());
        for layer in &self.layers {
            for plane in [&layer.k, &layer.v] {
                let floats = &plane[id * stride..(id + 1) * stride];
                if cfg!(target_endian = "little") {
                    // The floats' memory is already the wire format: one copy.
                    out.extend_from_slice(bytemuck::cast_slice::<f32, u8>(floats));
                } else {
                    floats
                        .iter()
                        .for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
                }
            }
        }
        Ok(out)
    }

    /// Overwrites one block with bytes [`KvCache::read_block`] produced.
    pub fn write_block(&mut self, id: u32, bytes: &[u8]) -> crate::error::Result<()> {
        let id = self.check_block(id)?;
        if bytes.len() != self.bytes_per_block() {
            return Err(crate::error::EngineError::InvalidRequest(format!(
                "a KV block is {} bytes here, got {}",
                self.bytes_per_block(),
                bytes.len()
            )));
        }
        let stride = self.block_stride();
        let mut src = bytes.chunks_exact(4 * stride);
        for layer in &mut self.layers {
            for plane in [&mut layer.k, &mut layer.v] {
                let floats = &mut plane[id * stride..(id + 1) * stride];
                let Some(chunk) = src.next() else { break };
                if cfg!(target_endian = "little") {
                    // Cast the (aligned) floats, not the bytes, which may be unaligned.
                    bytemuck::cast_slice_mut::<f32, u8>(floats).copy_from_slice(chunk);
                } else {
                    for (x, b) in floats.iter_mut().zip(chunk.chunks_exact(4)) {
                        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
            }
        }
        Ok(())
    }

    fn check_block(&self, id: u32) -> crate::error::Result<usize> {
        let id = id as usize;
        if id >= self.num_blocks {
            return Err(crate::error::EngineError::InvalidRequest(format!(
                "block {id} outside a cache of {} blocks",
                self.num_blocks
            )));
        }
        Ok(id)
    }

    pub(crate) fn layer(&self, layer: usize) -> &LayerKv {
        &self.layers[layer]
    }

    pub(crate) fn layer_mut(&mut self, layer: usize) -> &mut LayerKv {
        &mut self.layers[layer]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_and_bytes() {
        let kv = KvCache::new(3, 10, 16, 2, 8);
        assert_eq!(kv.num_blocks(), 10);
        assert_eq!(kv.block_size(), 16);
        assert_eq!(kv.bytes(), 2 * 3 * 10 * 16 * 2 * 8 * 4);
        assert_eq!(kv.bytes_per_block() * 10, kv.bytes());
    }

    #[test]
    fn a_block_read_out_and_written_elsewhere_is_bit_identical() {
        let mut kv = KvCache::new(2, 3, 2, 1, 2);
        for (l, layer) in kv.layers.iter_mut().enumerate() {
            for (i, x) in layer.k.iter_mut().enumerate() {
                *x = (l * 100 + i) as f32 + 0.25;
            }
            for (i, x) in layer.v.iter_mut().enumerate() {
                *x = -((l * 100 + i) as f32) - 0.5;
            }
        }
        let bytes = kv.read_block(1).unwrap();
        assert_eq!(bytes.len(), kv.bytes_per_block());
        // The wire format: little-endian f32s, layer 0 K, layer 0 V, layer 1 K, …
        let expected: Vec<u8> = [4.25f32, 5.25, 6.25, 7.25, -4.5, -5.5, -6.5, -7.5]
            .iter()
            .chain(&[
                104.25f32, 105.25, 106.25, 107.25, -104.5, -105.5, -106.5, -107.5,
            ])
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(bytes, expected);
        // Written from an unaligned buffer, it still lands bit for bit.
        let mut unaligned = vec![0u8; bytes.len() + 1];
        unaligned[1..].copy_from_slice(&bytes);
        kv.write_block(0, &unaligned[1..]).unwrap();
        assert_eq!(kv.read_block(0).unwrap(), bytes);
        kv.write_block(2, &bytes).unwrap();
        let stride = kv.block_stride();
        for l in 0..2 {
            let layer = kv.layer(l);
            assert_eq!(layer.k[2 * stride..3 * stride], layer.k[stride..2 * stride]);
            assert_eq!(layer.v[2 * stride..3 * stride], layer.v[stride..2 * stride]);
        }
        assert!(
            kv.write_block(2, &bytes[1..]).is_err(),
            "short block refused"
        );
        assert!(kv.read_block(3).is_err(), "out of range refused");
    }

    #[test]
    fn copy_block_copies_every_layer_k_and_v() {
        let mut kv = KvCache::new(2, 4, 2, 1, 2);
        let stride = kv.block_stride();
        for (l, layer) in kv.layers.iter_mut().enumerate() {
            for (i, x) in layer.k.iter_mut().enumerate() {
                *x = (l * 1000 + i) as f32;
            }
            for (i, x) in layer.v.iter_mut().enumerate() {
                *x = -((l * 1000 + i) as f32);
            }
        }
        let before = kv.clone();
        kv.copy_block(1, 3);
        for l in 0..2 {
            let (a, b) = (kv.layer(l), before.layer(l));
            assert_eq!(a.k[3 * stride..4 * stride], b.k[stride..2 * stride]);
            assert_eq!(a.v[3 * stride..4 * stride], b.v[stride..2 * stride]);
            // Everything else is untouched.
            assert_eq!(a.k[..3 * stride], b.k[..3 * stride]);
            assert_eq!(a.v[..3 * stride], b.v[..3 * stride]);
        }
    }
}
