//! The paged KV memory: fixed-size blocks of key/value vectors for every layer.
//!
//! Per layer, `k` and `v` are flat `Vec<f32>` laid out as
//! `[num_blocks][block_size][n_kv_heads][head_dim]`. Position `p` of a sequence lives in
//! block `block_table[p / block_size]` at offset `p % block_size`. The block pool decides
//! which blocks a sequence owns; this type only stores the numbers.
//!
//! Each layer sits behind its own lock so that another thread can copy blocks out
//! ([`KvBlockReader`]) while a step runs: a step holds a layer's write lock only while
//! it writes that layer's new keys and values, and reads it, like the copier, under a
//! read lock. Which blocks are safe to copy is the block pool's business
//! ([`crate::block_export`]).

use crate::block_export::KvBlockReader;
use std::sync::{Arc, PoisonError, RwLock};

/// Keys and values of one layer.
#[derive(Debug, Clone)]
pub(crate) struct LayerKv {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// The layers and their shape, shared with block readers on other threads.
#[derive(Debug)]
struct KvStorage {
    layers: Box<[RwLock<LayerKv>]>,
    num_blocks: usize,
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
}

/// Paged key/value storage for all layers of a model.
#[derive(Debug)]
pub struct KvCache {
    storage: Arc<KvStorage>,
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
            .map(|_| {
                RwLock::new(LayerKv {
                    k: vec![0.0; len],
                    v: vec![0.0; len],
                })
            })
            .collect();
        Self {
            storage: Arc::new(KvStorage {
                layers,
                num_blocks,
                block_size,
                n_kv_heads,
                head_dim,
            }),
        }
    }

    /// Number of blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.storage.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.storage.block_size
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.storage.layers.len()
    }

    /// Key/value heads per position.
    pub fn n_kv_heads(&self) -> usize {
        self.storage.n_kv_heads
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.storage.head_dim
    }

    /// Floats per block in one layer's K (or V) array.
    pub(crate) fn block_stride(&self) -> usize {
        self.storage.block_stride()
    }

    /// Copies block `src` onto block `dst` in every layer, keys and values: the data half
    /// of a copy-on-write fork of a partially filled block.
    ///
    /// # Panics
    /// If either id is not below [`KvCache::num_blocks`].
    pub fn copy_block(&mut self, src: u32, dst: u32) {
        let (src, dst) = (src as usize, dst as usize);
        assert!(
            src < self.num_blocks() && dst < self.num_blocks(),
            "copy_block({src}, {dst}) outside a cache of {} blocks",
            self.num_blocks()
        );
        if src == dst {
            return;
        }
        let stride = self.block_stride();
        for li in 0..self.num_layers() {
            self.with_layer_mut(li, |layer| {
                layer
                    .k
                    .copy_within(src * stride..(src + 1) * stride, dst * stride);
                layer
                    .v
                    .copy_within(src * stride..(src + 1) * stride, dst * stride);
            });
        }
    }

    /// Bytes held by keys and values.
    pub fn bytes(&self) -> usize {
        self.num_blocks() * self.bytes_per_block()
    }

    /// Bytes one block takes across all layers, keys and values: what the block pool
    /// multiplies by its block count when sizing the cache from a memory budget.
    pub fn bytes_per_block(&self) -> usize {
        self.storage.bytes_per_block()
    }

    /// One block's keys and values, every layer, as little-endian f32 bytes in the
    /// order layer 0 K, layer 0 V, layer 1 K, …: what a lower tier or a peer stores.
    pub fn read_block(&self, id: u32) -> crate::error::Result<Vec<u8>> {
        Ok(self.storage.read_blocks(&[id])?.remove(0))
    }

    /// A handle that copies blocks out of this cache from any thread (it shares the
    /// memory; the caller must know the blocks it reads are not being rewritten).
    pub fn reader(&self) -> Arc<dyn KvBlockReader> {
        Arc::clone(&self.storage) as Arc<dyn KvBlockReader>
    }

    /// Overwrites one block with bytes [`KvCache::read_block`] produced.
    pub fn write_block(&mut self, id: u32, bytes: &[u8]) -> crate::error::Result<()> {
        let id = self.storage.check_block(id)?;
        if bytes.len() != self.bytes_per_block() {
            return Err(crate::error::EngineError::InvalidRequest(format!(
                "a KV block is {} bytes here, got {}",
                self.bytes_per_block(),
                bytes.len()
            )));
        }
        let stride = self.block_stride();
        let mut src = bytes.chunks_exact(4 * stride);
        for li in 0..self.num_layers() {
            self.with_layer_mut(li, |layer| {
                for plane in [&mut layer.k, &mut layer.v] {
                    let floats = &mut plane[id * stride..(id + 1) * stride];
                    let Some(chunk) = src.next() else { return };
                    if cfg!(target_endian = "little") {
                        // Cast the (aligned) floats, not the bytes, which may be unaligned.
                        bytemuck::cast_slice_mut::<f32, u8>(floats).copy_from_slice(chunk);
                    } else {
                        for (x, b) in floats.iter_mut().zip(chunk.chunks_exact(4)) {
                            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                        }
                    }
                }
            });
        }
        Ok(())
    }

    /// Runs `f` over one layer's keys and values, read-only (block readers may read
    /// the same layer meanwhile).
    pub(crate) fn with_layer<R>(&self, layer: usize, f: impl FnOnce(&LayerKv) -> R) -> R {
        let guard = self.storage.layers[layer]
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        f(&guard)
    }

    /// Runs `f` over one layer's keys and values for writing; block readers of that
    /// layer wait until it returns, so keep it short.
    pub(crate) fn with_layer_mut<R>(
        &mut self,
        layer: usize,
        f: impl FnOnce(&mut LayerKv) -> R,
    ) -> R {
        let mut guard = self.storage.layers[layer]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        f(&mut guard)
    }
}

impl KvStorage {
    fn block_stride(&self) -> usize {
        self.block_size * self.n_kv_heads * self.head_dim
    }

    fn bytes_per_block(&self) -> usize {
        2 * self.layers.len() * self.block_stride() * std::mem::size_of::<f32>()
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
}

impl KvBlockReader for KvStorage {
    fn read_blocks(&self, ids: &[u32]) -> crate::error::Result<Vec<Vec<u8>>> {
        let ids = ids
            .iter()
            .map(|&id| self.check_block(id))
            .collect::<crate::error::Result<Vec<_>>>()?;
        let stride = self.block_stride();
        let mut out: Vec<Vec<u8>> = ids
            .iter()
            .map(|_| Vec::with_capacity(self.bytes_per_block()))
            .collect();
        // Layer by layer, each under its read lock once for every block asked for: a
        // step waits at most one layer's copy to write that layer.
        for layer in self.layers.iter() {
            let layer = layer.read().unwrap_or_else(PoisonError::into_inner);
            for (&id, buf) in ids.iter().zip(out.iter_mut()) {
                for plane in [&layer.k, &layer.v] {
                    let floats = &plane[id * stride..(id + 1) * stride];
                    if cfg!(target_endian = "little") {
                        // The floats' memory is already the wire format: one copy.
                        buf.extend_from_slice(bytemuck::cast_slice::<f32, u8>(floats));
                    } else {
                        floats
                            .iter()
                            .for_each(|x| buf.extend_from_slice(&x.to_le_bytes()));
                    }
                }
            }
        }
        Ok(out)
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
        for l in 0..kv.num_layers() {
            kv.with_layer_mut(l, |layer| {
                for (i, x) in layer.k.iter_mut().enumerate() {
                    *x = (l * 100 + i) as f32 + 0.25;
                }
                for (i, x) in layer.v.iter_mut().enumerate() {
                    *x = -((l * 100 + i) as f32) - 0.5;
                }
            });
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
            kv.with_layer(l, |layer| {
                assert_eq!(layer.k[2 * stride..3 * stride], layer.k[stride..2 * stride]);
                assert_eq!(layer.v[2 * stride..3 * stride], layer.v[stride..2 * stride]);
            });
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
        for l in 0..kv.num_layers() {
            kv.with_layer_mut(l, |layer| {
                for (i, x) in layer.k.iter_mut().enumerate() {
                    *x = (l * 1000 + i) as f32;
                }
                for (i, x) in layer.v.iter_mut().enumerate() {
                    *x = -((l * 1000 + i) as f32);
                }
            });
        }
        let snapshot = |kv: &KvCache| -> Vec<LayerKv> {
            (0..kv.num_layers())
                .map(|l| kv.with_layer(l, LayerKv::clone))
                .collect()
        };
        let before = snapshot(&kv);
        kv.copy_block(1, 3);
        let after = snapshot(&kv);
        for l in 0..2 {
            let (a, b) = (&after[l], &before[l]);
            assert_eq!(a.k[3 * stride..4 * stride], b.k[stride..2 * stride]);
            assert_eq!(a.v[3 * stride..4 * stride], b.v[stride..2 * stride]);
            // Everything else is untouched.
            assert_eq!(a.k[..3 * stride], b.k[..3 * stride]);
            assert_eq!(a.v[..3 * stride], b.v[..3 * stride]);
        }
    }
}
