//! The on-disk form of one KV block: a small header naming the block, its bytes, and a
//! checksum over both. Decoding checks everything a damaged file could get wrong (magic,
//! version, which block it is, its format and length, the checksum), so a corrupt,
//! truncated or misplaced file reads as "not cached" and is recomputed, never served.

use kvfleet_core::BlockHash;
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 4] = b"KVFB";
const VERSION: u32 = 1;
/// magic, version, hash, parent flag + parent, format length, payload length.
const FIXED_HEADER: usize = 4 + 4 + 8 + 1 + 8 + 1 + 8;
const CHECKSUM: usize = 8;

/// Why a block file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockFileError {
    /// Shorter than its header or its stated payload.
    #[error("truncated block file ({0} bytes)")]
    Truncated(usize),
    /// Not a block file of this version, or a different block, format or size.
    #[error("block file mismatch: {0}")]
    Mismatch(String),
    /// The checksum does not match the contents.
    #[error("block file checksum mismatch")]
    Checksum,
}

/// What a block file must say to be accepted.
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    /// The block asked for.
    pub hash: BlockHash,
    /// The backend's block format ("f32le").
    pub format: &'a str,
    /// Bytes of one block in that format.
    pub len: usize,
}

/// Serializes one block.
pub fn encode(hash: BlockHash, parent: Option<BlockHash>, format: &str, payload: &[u8]) -> Vec<u8> {
    let fmt = &format.as_bytes()[..format.len().min(255)];
    let mut out = Vec::with_capacity(FIXED_HEADER + fmt.len() + payload.len() + CHECKSUM);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&hash.0.to_le_bytes());
    out.push(u8::from(parent.is_some()));
    out.extend_from_slice(&parent.map_or(0, |p| p.0).to_le_bytes());
    out.push(fmt.len() as u8);
    out.extend_from_slice(fmt);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let sum = xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Parses and checks one block file; returns its parent and payload.
pub fn decode(
    bytes: &[u8],
    want: Expected<'_>,
) -> Result<(Option<BlockHash>, Vec<u8>), BlockFileError> {
    let n = bytes.len();
    if n < FIXED_HEADER + CHECKSUM {
        return Err(BlockFileError::Truncated(n));
    }
    let (body, sum) = bytes.split_at(n - CHECKSUM);
    let mut r = Reader { buf: body, at: 0 };
    if r.take(4)? != MAGIC {
        return Err(BlockFileError::Mismatch("not a kvfleet block file".into()));
    }
    let version = r.u32()?;
    if version != VERSION {
        return Err(BlockFileError::Mismatch(format!("version {version}")));
    }
    let hash = BlockHash(r.u64()?);
    let has_parent = r.take(1)?[0] != 0;
    let parent = r.u64()?;
    let fmt_len = r.take(1)?[0] as usize;
    let fmt = r.take(fmt_len)?;
    let len = r.u64()? as usize;
    let payload = r.take(len)?;
    if r.at != body.len() {
        return Err(BlockFileError::Mismatch("trailing bytes".into()));
    }
    let stored = u64::from_le_bytes(sum.try_into().unwrap_or([0; 8]));
    if xxh3_64(body) != stored {
        return Err(BlockFileError::Checksum);
    }
    if hash != want.hash {
        return Err(BlockFileError::Mismatch(format!(
            "holds block {hash}, not {}",
            want.hash
        )));
    }
    if fmt != want.format.as_bytes() || len != want.len {
        return Err(BlockFileError::Mismatch(format!(
            "{} bytes of {}, expected {} of {}",
            len,
            String::from_utf8_lossy(fmt),
            want.len,
            want.format
        )));
    }
    Ok((has_parent.then_some(BlockHash(parent)), payload.to_vec()))
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BlockFileError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(BlockFileError::Truncated(self.buf.len() + CHECKSUM));
        };
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, BlockFileError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, BlockFileError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn want(len: usize) -> Expected<'static> {
        Expected {
            hash: BlockHash(7),
            format: "f32le",
            len,
        }
    }

    #[test]
    fn round_trips_and_refuses_the_wrong_block() {
        let payload: Vec<u8> = (0..64u8).collect();
        let f = encode(BlockHash(7), Some(BlockHash(3)), "f32le", &payload);
        assert_eq!(
            decode(&f, want(64)),
            Ok((Some(BlockHash(3)), payload.clone()))
        );
        let other = Expected {
            hash: BlockHash(8),
            ..want(64)
        };
        assert!(matches!(
            decode(&f, other),
            Err(BlockFileError::Mismatch(_))
        ));
        assert!(matches!(
            decode(&f, want(65)),
            Err(BlockFileError::Mismatch(_))
        ));
        let root = encode(BlockHash(7), None, "f32le", &payload);
        assert_eq!(decode(&root, want(64)).map(|d| d.0), Ok(None));
    }

    proptest! {
        /// Any single flipped byte or any truncation is refused: a damaged block is a
        /// miss, never wrong K/V.
        #[test]
        fn any_damage_is_refused(flip in 0usize..200, cut in 0usize..200, bit in 0u8..8) {
            let payload: Vec<u8> = (0..100u8).collect();
            let f = encode(BlockHash(7), Some(BlockHash(1)), "f32le", &payload);
            let mut bad = f.clone();
            let i = flip % bad.len();
            bad[i] ^= 1 << bit;
            prop_assert!(decode(&bad, want(100)).is_err());
            let cut = cut % f.len();
            prop_assert!(decode(&f[..cut], want(100)).is_err());
        }
    }
}
