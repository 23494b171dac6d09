//! GGUF model files (llama.cpp's format): opening and validating one, reading its
//! metadata, and turning it into a [`ModelConfig`] ([`config`]) and engine weights
//! that stay quantized ([`weights`]).
//!
//! The file is parsed by candle-core's `quantized::gguf_file`, after a bounded scan of
//! the header ([`header`]) so that a truncated or corrupt file is an error that names
//! the file and the problem rather than a panic or a huge allocation.

pub(crate) mod config;
mod header;
pub(crate) mod weights;

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::{EngineError, Result};

pub use config::GgufArch;

/// How a GGUF file's weights are held in memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GgufLoadOptions {
    /// Dequantize every weight to f32 at load (for reference tests and debugging:
    /// several times the memory, and matrix products run in f32).
    pub dequantize: bool,
}

/// An opened GGUF file: its path and parsed header (metadata and tensor table).
///
/// The tokenizer and chat template are built from [`GgufFile::content`]'s metadata.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: Content,
}

/// `path` itself when it is a file, or the one `*.gguf` file in it when it is a
/// directory.
pub fn resolve_gguf_path(path: &Path) -> Result<PathBuf> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    let io = |source| EngineError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut found = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let p = entry.map_err(io)?.path();
        if p.is_file()
            && p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            found.push(p);
        }
    }
    found.sort();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(EngineError::Config(format!(
            "no *.gguf file in {}",
            path.display()
        ))),
        n => Err(EngineError::Config(format!(
            "{n} *.gguf files in {} ({}); name one",
            path.display(),
            found
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Whether `path` names a GGUF model: a `*.gguf` file, or a directory holding one
/// (and no `config.json`, which marks a Hugging Face directory).
pub fn is_gguf_path(path: &Path) -> bool {
    if path.is_dir() {
        return !path.join("config.json").exists() && resolve_gguf_path(path).is_ok();
    }
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// Parses a GGUF header from `reader`, which holds `len` bytes (a whole file): the
/// bounded scan first, then candle's parser. `name` labels errors. This is what the
/// fuzz target drives.
pub fn read_content<R: Read + Seek>(reader: &mut R, len: u64, name: &str) -> Result<Content> {
    let bad = |m: String| EngineError::Weights(format!("{name}: {m}"));
    reader
        .seek(SeekFrom::Start(0))
        .map_err(|e| bad(format!("cannot seek: {e}")))?;
    let scanned = header::scan(&mut *reader, len).map_err(bad)?;
    reader
        .seek(SeekFrom::Start(0))
        .map_err(|e| bad(format!("cannot seek: {e}")))?;
    let content = Content::read(reader).map_err(|e| bad(format!("not a valid GGUF file: {e}")))?;
    if content.tensor_data_offset != scanned.data_offset
        || content.tensor_infos.len() != scanned.tensors.len()
    {
        return Err(bad(format!(
            "inconsistent header (tensor data at {} or {}, {} or {} tensors)",
            content.tensor_data_offset,
            scanned.data_offset,
            content.tensor_infos.len(),
            scanned.tensors.len()
        )));
    }
    Ok(content)
}

impl GgufFile {
    /// Opens and validates `path` (a `.gguf` file, or a directory holding exactly one).
    pub fn open(path: &Path) -> Result<Self> {
        let path = resolve_gguf_path(path)?;
        let io = |source| EngineError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::new(file);
        let content = read_content(&mut reader, len, &path.display().to_string())?;
        Ok(Self { path, content })
    }

    /// The file read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header: metadata and the tensor table.
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// The file stem, e.g. `SmolLM2-135M-Instruct.Q4_1`.
    pub fn stem(&self) -> String {
        self.path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.str("general.architecture")
    }

    fn err(&self, m: impl std::fmt::Display) -> EngineError {
        EngineError::Config(format!("{}: {m}", self.path.display()))
    }

    /// Metadata `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// A string metadata value; an error naming the file and key when absent or not a string.
    pub fn str(&self, key: &str) -> Result<&str> {
        match self.get(key) {
            Some(Value::String(s)) => Ok(s),
            Some(v) => Err(self.err(format!("metadata {key} is not a string: {v:?}"))),
            None => Err(self.err(format!("metadata {key} is missing"))),
        }
    }

    /// A non-negative integer metadata value of any integer type, if present.
    pub fn opt_uint(&self, key: &str) -> Result<Option<u64>> {
        let v = match self.get(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n = match *v {
            Value::U8(x) => Some(u64::from(x)),
            Value::U16(x) => Some(u64::from(x)),
            Value::U32(x) => Some(u64::from(x)),
            Value::U64(x) => Some(x),
            Value::I8(x) => u64::try_from(x).ok(),
            Value::I16(x) => u64::try_from(x).ok(),
            Value::I32(x) => u64::try_from(x).ok(),
            Value::I64(x) => u64::try_from(x).ok(),
            _ => None,
        };
        n.map(Some).ok_or_else(|| {
            self.err(format!(
                "metadata {key} is not a non-negative integer: {v:?}"
            ))
        })
    }

    /// A required non-negative integer metadata value that fits in `usize`.
    pub fn uint(&self, key: &str) -> Result<usize> {
        let n = self
            .opt_uint(key)?
            .ok_or_else(|| self.err(format!("metadata {key} is missing")))?;
        usize::try_from(n).map_err(|_| self.err(format!("metadata {key} = {n} is too large")))
    }

    /// A float metadata value (f32 or f64), if present.
    pub fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(f64::from(*x))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(self.err(format!("metadata {key} is not a float: {v:?}"))),
        }
    }

    /// Whether the file holds tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The shape of tensor `name` (candle order: `[rows, row width]`), if present.
    pub fn tensor_shape(&self, name: &str) -> Option<&[usize]> {
        self.content.tensor_infos.get(name).map(|t| t.shape.dims())
    }

    /// Reads tensor `name` from the file as a quantized tensor (its stored type).
    pub(crate) fn read_tensor(&self, reader: &mut BufReader<File>, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(EngineError::Weights(format!(
                "{}: missing tensor {name}",
                self.path.display()
            )));
        }
        self.content
            .tensor(reader, name, &Device::Cpu)
            .map_err(|e| {
                EngineError::Weights(format!(
                    "{}: reading tensor {name}: {e}",
                    self.path.display()
                ))
            })
    }

    /// A buffered reader over the file, for [`GgufFile::read_tensor`].
    pub(crate) fn reader(&self) -> Result<BufReader<File>> {
        File::open(&self.path)
            .map(BufReader::new)
            .map_err(|source| EngineError::Io {
                path: self.path.display().to_string(),
                source,
            })
    }
}
