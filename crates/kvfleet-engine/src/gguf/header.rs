//! A bounded pre-scan of a GGUF header, run before candle's parser sees the bytes.
//!
//! candle's `gguf_file::Content::read` trusts the lengths it reads: a corrupt string
//! or array length becomes one huge allocation (an abort, not an error), a zero
//! `general.alignment` a division by zero, and an unknown tensor type an error that
//! names neither the tensor nor the file. This scan walks the same layout without
//! allocating more than the bytes it has seen, checks every length against what is
//! left of the file, every tensor's type, rank and data range, and only then lets
//! candle parse.

use std::collections::HashSet;
use std::io::Read;

use candle_core::quantized::GgmlDType;

/// Longest string accepted in a header (chat templates and token texts are far shorter).
const MAX_STRING: u64 = 16 << 20;
/// Most elements accepted in one metadata array (vocabularies are a few hundred thousand).
const MAX_ARRAY: u64 = 16 << 20;
/// Deepest nesting of metadata arrays.
const MAX_DEPTH: u32 = 4;
/// GGML tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;

/// What the scan learned about one tensor.
#[derive(Debug, Clone)]
pub(crate) struct ScannedTensor {
    pub(crate) name: String,
    /// GGML order: `dims[0]` is the row width.
    pub(crate) dims: Vec<u64>,
    pub(crate) dtype: GgmlDType,
    pub(crate) offset: u64,
}

/// The header's layout, as the scan found it.
#[derive(Debug, Clone)]
pub(crate) struct ScannedHeader {
    pub(crate) tensors: Vec<ScannedTensor>,
    /// Start of the tensor data (the header's end, aligned as candle aligns it).
    pub(crate) data_offset: u64,
}

/// The GGML type ids and names, for messages about types candle cannot read.
fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        4 => "Q4_2 (removed from GGML)",
        5 => "Q4_3 (removed from GGML)",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

/// The GGML types candle can read from a GGUF file and multiply, by id (its reader
/// has no Q8_1 / Q8_K, which llama.cpp only uses for activations).
pub(crate) fn ggml_dtype(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The supported types, for error messages.
pub(crate) const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

/// Reads `reader` (the start of a file of `len` bytes) as far as the header goes.
struct Scan<R> {
    r: R,
    pos: u64,
    len: u64,
    /// GGUF v1 stores counts and lengths in 32 bits.
    v1: bool,
}

impl<R: Read> Scan<R> {
    fn left(&self) -> u64 {
        self.len - self.pos
    }

    fn need(&self, n: u64, what: &str) -> Result<(), String> {
        if n > self.left() {
            return Err(format!(
                "truncated or corrupt: {what} needs {n} bytes at offset {} but the file has {} left",
                self.pos,
                self.left()
            ));
        }
        Ok(())
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>, String> {
        self.need(n, what)?;
        let mut buf = vec![0u8; n as usize];
        self.r
            .read_exact(&mut buf)
            .map_err(|e| format!("reading {what} at offset {}: {e}", self.pos))?;
        self.pos += n;
        Ok(buf)
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), String> {
        self.need(n, what)?;
        let copied = std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| format!("reading {what} at offset {}: {e}", self.pos))?;
        if copied != n {
            return Err(format!("truncated: {what} at offset {}", self.pos));
        }
        self.pos += n;
        Ok(())
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let b = self.bytes(8, what)?;
        Ok(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    /// A count or length: 32 bits in v1, 64 after.
    fn count(&mut self, what: &str) -> Result<u64, String> {
        if self.v1 {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    fn string_len(&mut self, what: &str) -> Result<u64, String> {
        let n = self.count(what)?;
        if n > MAX_STRING {
            return Err(format!(
                "corrupt: {what} claims {n} bytes (limit {MAX_STRING})"
            ));
        }
        self.need(n, what)?;
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.string_len(what)?;
        let b = self.bytes(n, what)?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// Skips one metadata value of type `ty`; returns it when it is an unsigned or
    /// signed integer (for `general.alignment`), as candle reads it.
    fn value(&mut self, ty: u32, depth: u32, key: &str) -> Result<Option<i128>, String> {
        let fixed = |n: u64| Some(n);
        let size = match ty {
            0 | 1 | 7 => fixed(1),
            2 | 3 => fixed(2),
            4..=6 => fixed(4),
            10..=12 => fixed(8),
            8 | 9 => None,
            t => {
                return Err(format!(
                    "corrupt: metadata {key} has unknown value type {t}"
                ))
            }
        };
        if let Some(n) = size {
            let b = self.bytes(n, key)?;
            return Ok(match ty {
                0 => Some(i128::from(b[0])),
                1 => Some(i128::from(b[0] as i8)),
                2 => Some(i128::from(u16::from_le_bytes([b[0], b[1]]))),
                3 => Some(i128::from(i16::from_le_bytes([b[0], b[1]]))),
                4 => Some(i128::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
                5 => Some(i128::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
                7 if b[0] > 1 => {
                    return Err(format!("corrupt: metadata {key} has bool value {}", b[0]))
                }
                _ => None,
            });
        }
        if ty == 8 {
            let n = self.string_len(key)?;
            self.skip(n, key)?;
            return Ok(None);
        }
        if depth >= MAX_DEPTH {
            return Err(format!(
                "corrupt: metadata {key} nests arrays deeper than {MAX_DEPTH}"
            ));
        }
        let elem = self.u32(key)?;
        let n = self.count(key)?;
        // Every element takes at least one byte, so the file bounds the count.
        if n > MAX_ARRAY || n > self.left() {
            return Err(format!(
                "corrupt: metadata {key} claims an array of {n} elements ({} bytes left)",
                self.left()
            ));
        }
        for _ in 0..n {
            self.value(elem, depth + 1, key)?;
        }
        Ok(None)
    }
}

/// Scans the header of a GGUF file whose first bytes `reader` yields and whose total
/// length is `len`. Errors are plain descriptions; the caller adds the file name.
pub(crate) fn scan<R: Read>(reader: R, len: u64) -> Result<ScannedHeader, String> {
    let mut s = Scan {
        r: reader,
        pos: 0,
        len,
        v1: false,
    };
    let magic = s
        .bytes(4, "the magic number")
        .map_err(|_| format!("not a GGUF file: only {len} bytes"))?;
    if magic != b"GGUF" {
        return Err(format!(
            "not a GGUF file: it starts with {magic:02x?}, not \"GGUF\""
        ));
    }
    let version = s.u32("the version")?;
    match version {
        1 => s.v1 = true,
        2 | 3 => {}
        v => return Err(format!("unsupported GGUF version {v} (supported: 1, 2, 3)")),
    }
    let n_tensors = s.count("the tensor count")?;
    let n_kv = s.count("the metadata count")?;
    // A metadata entry takes at least 13 bytes, a tensor entry at least 24.
    if n_kv.saturating_mul(13) > s.left() || n_tensors.saturating_mul(24) > s.left() {
        return Err(format!(
            "truncated or corrupt: the header claims {n_kv} metadata entries and {n_tensors} tensors, more than a {len}-byte file holds"
        ));
    }
    let mut alignment = None;
    for _ in 0..n_kv {
        let key = s.string("a metadata key")?;
        let ty = s.u32(&key)?;
        let v = s.value(ty, 0, &key)?;
        if key == "general.alignment" {
            // candle takes u8/u16/u32 and non-negative i8/i16/i32; anything else means 32.
            alignment = match (ty, v) {
                (0..=5, Some(a)) if a >= 0 => Some(a as u64),
                _ => None,
            };
        }
    }
    let alignment = alignment.unwrap_or(32);
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(format!(
            "corrupt: general.alignment is {alignment}, not a power of two"
        ));
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::new();
    for _ in 0..n_tensors {
        let name = s.string("a tensor name")?;
        let n_dims = s.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!(
                "corrupt: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(if s.v1 {
                u64::from(s.u32(&name)?)
            } else {
                s.u64(&name)?
            });
        }
        let ty = s.u32(&name)?;
        let offset = s.u64(&name)?;
        let Some(dtype) = ggml_dtype(ty) else {
            return Err(format!(
                "tensor {name} has GGML type {} ({ty}), which is not supported (supported: {SUPPORTED_TYPES})",
                ggml_type_name(ty)
            ));
        };
        if !names.insert(name.clone()) {
            return Err(format!("corrupt: tensor {name} appears twice"));
        }
        tensors.push(ScannedTensor {
            name,
            dims,
            dtype,
            offset,
        });
    }
    let data_offset = s.pos.div_ceil(alignment) * alignment;
    for t in &tensors {
        let bytes = tensor_bytes(t)?;
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|a| a.checked_add(bytes));
        match end {
            Some(end) if end <= len => {}
            _ => {
                return Err(format!(
                    "truncated or corrupt: tensor {} ({bytes} bytes at data offset {}) ends past the end of the {len}-byte file",
                    t.name, t.offset
                ))
            }
        }
    }
    Ok(ScannedHeader {
        tensors,
        data_offset,
    })
}

/// Bytes of one tensor's data, checking that its rows are whole blocks.
fn tensor_bytes(t: &ScannedTensor) -> Result<u64, String> {
    let block = t.dtype.block_size() as u64;
    // candle cannot hold an empty quantized tensor (its zero-length buffer fails an
    // alignment assertion), and no model has one.
    if t.dims.contains(&0) {
        return Err(format!(
            "corrupt: tensor {} has an empty dimension {:?}",
            t.name, t.dims
        ));
    }
    let elems = t
        .dims
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&e| e <= (isize::MAX as u64) / 4)
        .ok_or_else(|| format!("corrupt: tensor {} has dimensions {:?}", t.name, t.dims))?;
    if t.dims[0] / block * block != t.dims[0] {
        return Err(format!(
            "corrupt: tensor {} of type {:?} has rows of {} elements, not a multiple of its block size {block}",
            t.name, t.dtype, t.dims[0]
        ));
    }
    Ok(elems / block * t.dtype.type_size() as u64)
}
