//! GGML block-quantized weights (Q4_0, Q4_1, Q8_0) repacked for the product kernels in
//! [`super::quant_dot`]: rows in groups of eight, and within a group, block by block,
//! the eight rows' scales side by side, then their quants.
//!
//! Why repack: a decode step reads every weight once, so its speed is the speed of the
//! walk through memory. In GGML's layout the kernels would read eight rows at once, in
//! eight streams, and gather each block's eight scales from eight places; packed, one
//! product reads one stream front to back and loads eight scales with one instruction.
//! The packed matrix is the same size as the GGML one (only the last group is padded to
//! eight rows), and replaces it: the model keeps no other copy.
//!
//! Layout of group `g`, block `b` (`8 × block_bytes` bytes, groups and blocks in order):
//! `d[8]` as f16; for Q4_1 `m[8]` as f16; then each row's quants as GGML stores them
//! (16 nibble bytes for Q4_x, 32 signed bytes for Q8_0).

use candle_core::quantized::GgmlDType;
use half::f16;

/// Weights per block.
pub(crate) const BLOCK: usize = 32;
/// Rows per group: the kernels' lanes.
pub(crate) const GROUP: usize = 8;

/// The block types that are repacked, with their GGML byte sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QuantKind {
    /// `{d: f16, qs: [u8; 16]}`: `w = d·(q − 8)`, q a nibble.
    Q4_0,
    /// `{d: f16, m: f16, qs: [u8; 16]}`: `w = d·q + m`.
    Q4_1,
    /// `{d: f16, qs: [i8; 32]}`: `w = d·q`.
    Q8_0,
}

impl QuantKind {
    /// The kind of a GGML dtype, if it is one that is repacked.
    pub(crate) fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            GgmlDType::Q4_1 => Some(Self::Q4_1),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            _ => None,
        }
    }

    /// The GGML dtype.
    pub(crate) fn dtype(self) -> GgmlDType {
        match self {
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q8_0 => GgmlDType::Q8_0,
        }
    }

    /// Bytes of one GGML block.
    pub(crate) const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// Bytes of one row's quants in a block.
    pub(crate) const fn quant_bytes(self) -> usize {
        match self {
            Self::Q8_0 => 32,
            _ => 16,
        }
    }

    /// Bytes of a packed group-block before the quants: the scales (and Q4_1 minima).
    pub(crate) const fn header_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 4 * GROUP,
            _ => 2 * GROUP,
        }
    }
}

/// A quantized `[out, inp]` matrix in the packed layout (module docs).
#[derive(Debug, Clone)]
pub(crate) struct PackedQuant {
    kind: QuantKind,
    out: usize,
    inp: usize,
    data: Vec<u8>,
}

impl PackedQuant {
    /// Repacks `data`, `out` GGML rows of `inp` weights of `kind`; `None` when the
    /// sizes do not fit.
    pub(crate) fn pack(kind: QuantKind, data: &[u8], out: usize, inp: usize) -> Option<Self> {
        let bb = kind.block_bytes();
        if out == 0 || !inp.is_multiple_of(BLOCK) || data.len() != out * inp / BLOCK * bb {
            return None;
        }
        let blocks = inp / BLOCK;
        let groups = out.div_ceil(GROUP);
        let (hdr, qb) = (kind.header_bytes(), kind.quant_bytes());
        // Padding rows stay zero: zero scales, so they contribute nothing.
        let mut packed = vec![0u8; groups * blocks * GROUP * bb];
        for o in 0..out {
            let (g, m) = (o / GROUP, o % GROUP);
            for b in 0..blocks {
                let src = &data[(o * blocks + b) * bb..][..bb];
                let dst = &mut packed[(g * blocks + b) * GROUP * bb..][..GROUP * bb];
                dst[2 * m..2 * m + 2].copy_from_slice(&src[..2]);
                if kind == QuantKind::Q4_1 {
                    dst[2 * GROUP + 2 * m..2 * GROUP + 2 * m + 2].copy_from_slice(&src[2..4]);
                }
                dst[hdr + m * qb..hdr + (m + 1) * qb].copy_from_slice(&src[bb - qb..]);
            }
        }
        Some(Self {
            kind,
            out,
            inp,
            data: packed,
        })
    }

    /// The block type.
    pub(crate) fn kind(&self) -> QuantKind {
        self.kind
    }

    /// `(out, inp)`.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    /// Blocks per row.
    pub(crate) fn blocks(&self) -> usize {
        self.inp / BLOCK
    }

    /// The packed bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The packed bytes of group `g`, block `b`.
    pub(crate) fn group_block(&self, g: usize, b: usize) -> &[u8] {
        let n = GROUP * self.kind.block_bytes();
        &self.data[(g * self.blocks() + b) * n..][..n]
    }

    /// Row `o`, block `b`: scale, minimum (Q4_1; else 0) and quant bytes.
    pub(crate) fn block_of(&self, o: usize, b: usize) -> (f32, f32, &[u8]) {
        let (g, m) = (o / GROUP, o % GROUP);
        let gb = self.group_block(g, b);
        let half = |at: usize| f16::from_le_bytes([gb[at], gb[at + 1]]).to_f32();
        let min = if self.kind == QuantKind::Q4_1 {
            half(2 * GROUP + 2 * m)
        } else {
            0.0
        };
        let qb = self.kind.quant_bytes();
        let at = self.kind.header_bytes() + m * qb;
        (half(2 * m), min, &gb[at..at + qb])
    }

    /// Row `o` dequantized into `dst` (`inp` values), as GGML (and candle) dequantize.
    pub(crate) fn dequantize_row(&self, o: usize, dst: &mut [f32]) {
        for (b, ys) in dst.chunks_exact_mut(BLOCK).enumerate() {
            let (d, m, qs) = self.block_of(o, b);
            match self.kind {
                QuantKind::Q8_0 => {
                    for (y, &q) in ys.iter_mut().zip(qs) {
                        *y = (q as i8) as f32 * d;
                    }
                }
                QuantKind::Q4_0 => {
                    for (j, &q) in qs.iter().enumerate() {
                        ys[j] = ((q & 0x0f) as i16 - 8) as f32 * d;
                        ys[j + 16] = ((q >> 4) as i16 - 8) as f32 * d;
                    }
                }
                QuantKind::Q4_1 => {
                    for (j, &q) in qs.iter().enumerate() {
                        ys[j] = (q & 0x0f) as f32 * d + m;
                        ys[j + 16] = (q >> 4) as f32 * d + m;
                    }
                }
            }
        }
    }

    /// The matrix back in GGML's layout (row after row of blocks).
    pub(crate) fn ggml_bytes(&self) -> Vec<u8> {
        let (bb, qb) = (self.kind.block_bytes(), self.kind.quant_bytes());
        let mut out = Vec::with_capacity(self.out * self.blocks() * bb);
        for o in 0..self.out {
            let (g, m) = (o / GROUP, o % GROUP);
            for b in 0..self.blocks() {
                let gb = self.group_block(g, b);
                out.extend_from_slice(&gb[2 * m..2 * m + 2]);
                if self.kind == QuantKind::Q4_1 {
                    out.extend_from_slice(&gb[2 * GROUP + 2 * m..2 * GROUP + 2 * m + 2]);
                }
                let at = self.kind.header_bytes() + m * qb;
                out.extend_from_slice(&gb[at..at + qb]);
            }
        }
        out
    }

    /// `self` with `other`'s rows appended (same kind and width), for fused products.
    pub(crate) fn stacked(parts: &[&PackedQuant]) -> Option<Self> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.kind != first.kind || p.inp != first.inp)
        {
            return None;
        }
        let mut bytes = Vec::new();
        let mut out = 0;
        for p in parts {
            bytes.extend(p.ggml_bytes());
            out += p.out;
        }
        Self::pack(first.kind, &bytes, out, first.inp)
    }
}

/// Quantized test matrices, shared by this module's tests and the kernels'.
#[cfg(test)]
pub(crate) mod fixture {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// `w` (`out × inp`, row-major) quantized to `dtype`: packed, its GGML bytes, and
    /// candle's dequantization of it.
    pub(crate) fn quantized(
        w: Vec<f32>,
        out: usize,
        inp: usize,
        dtype: GgmlDType,
    ) -> (PackedQuant, Vec<u8>, Vec<f32>) {
        let t = Tensor::from_vec(w, (out, inp), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, dtype).unwrap();
        let data = q.data().unwrap().to_vec();
        let deq: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let packed = PackedQuant::pack(QuantKind::of(dtype).unwrap(), &data, out, inp).unwrap();
        (packed, data, deq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_and_dequantizes_as_candle_does() {
        // 13 rows: a short last group.
        let (out, inp) = (13, 64);
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let w: Vec<f32> = (0..out * inp)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 30.0)
                .collect();
            let (p, data, all) = fixture::quantized(w, out, inp, dtype);
            assert_eq!(p.ggml_bytes(), data, "{dtype:?}");
            let mut row = vec![0.0; inp];
            for o in 0..out {
                p.dequantize_row(o, &mut row);
                assert_eq!(row, all[o * inp..(o + 1) * inp], "{dtype:?} row {o}");
            }
            let both = PackedQuant::stacked(&[&p, &p]).unwrap();
            assert_eq!(both.dims(), (2 * out, inp));
            assert_eq!(both.ggml_bytes(), [data.clone(), data].concat());
        }
        assert!(PackedQuant::pack(QuantKind::Q4_1, &[0; 20], 1, 40).is_none());
        assert!(PackedQuant::pack(QuantKind::Q4_1, &[0; 20], 2, 32).is_none());
    }
}
