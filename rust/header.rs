//! Strict safetensors header parsing.
//!
//! A safetensors file is an 8-byte little-endian header length `n`, `n` bytes of UTF-8 JSON (an object
//! mapping tensor names to `{"dtype", "shape", "data_offsets"}` plus an optional `"__metadata__"`
//! string-to-string object, padded with trailing spaces), then the data section. This parser rejects
//! everything the format does not allow: a length over [`MAX_HEADER_LEN`] or past the end of the file,
//! invalid UTF-8, duplicate keys at any level, unknown dtypes, non-integer or negative shapes, byte ranges
//! that disagree with dtype and shape, and tensors that overlap, leave holes or do not cover the data
//! section exactly. Sizes are computed with checked arithmetic, and nothing is allocated from a header
//! field before it has been checked against the file size. It reads files but maps nothing.
//!
//! This file is the parser ([`Header::read`], [`Header::parse`]); beside it, in `header/`: `json.rs` (the
//! strict JSON visitors and the entry checks), `names.rs` (name tables, facts ids, the digest),
//! `weightmap.rs` ([`WeightMap`]), `natural.rs` (natural order, [`natural_order_of`]) and `tests.rs`.
//!
//! ```
//! use hp_fastload::Header;
//! let json = br#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}  "#;
//! let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
//! bytes.extend_from_slice(json);
//! bytes.extend_from_slice(&[7, 9]);
//! let header = Header::parse("mem.safetensors".as_ref(), &bytes, bytes.len() as u64).unwrap();
//! assert_eq!(header.tensors[0].name, "w");
//! assert_eq!(header.data_start, 8 + json.len() as u64);
//! ```

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::hash::Hasher;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::dtype::Dtype;
use crate::error::{LoadError, Quoted};
use crate::mmap::{open_regular, MapSlot};

mod json;
mod names;
mod natural;
#[cfg(test)]
mod tests;
mod weightmap;

use json::{kind, parse_metadata, parse_tensor, Top, TopSeed};
use names::NameTable;
pub use names::{facts_of, header_digest, positions_not_of, WordHasher};
use natural::NaturalKeys;
pub use natural::{natural_order, natural_order_of};
pub use weightmap::WeightMap;

/// The largest header accepted, in bytes (the limit safetensors itself uses).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// One tensor of a safetensors file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's key.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (empty for a 0-d tensor).
    pub shape: Vec<u64>,
    /// First byte, relative to the start of the data section.
    pub begin: u64,
    /// One past the last byte, relative to the start of the data section.
    pub end: u64,
}

impl TensorInfo {
    /// Number of elements (1 for a 0-d tensor); fits in `u64` because the header was validated.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Identity of a file when its header was read; a later read refuses a file that changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// Device number.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Modification time in nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Status-change time (`ctime`) in nanoseconds since the epoch: unlike the mtime, no copy tool or
    /// `utime` call can set it back, so an in-place rewrite whose old mtime was restored still differs.
    pub ctime_ns: i128,
}

impl FileIdentity {
    /// The identity of an open file.
    pub fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
        }
    }
}

/// A validated safetensors header.
#[derive(Clone, Debug)]
pub struct Header {
    /// The file it was read from.
    pub path: PathBuf,
    /// File size when the header was read; the data section ends here.
    pub file_len: u64,
    /// Absolute offset of the data section (8 + header length).
    pub data_start: u64,
    /// The `__metadata__` entries in file order, if present.
    pub metadata: Option<Vec<(String, String)>>,
    /// Tensors in data-offset order.
    pub tensors: Vec<TensorInfo>,
    /// The file's identity when read (`None` for headers parsed from memory).
    pub identity: Option<FileIdentity>,
    /// A 64-bit digest of the header bytes (length prefix and JSON, see [`header_digest`]): what ranks
    /// compare to agree that they read the same checkpoint, and what [`Header::still_current`] re-checks.
    pub digest: u64,
    index: NameTable,
    /// The tensors' natural order, computed with the parse (see [`natural_order_of`]).
    natural: NaturalKeys,
    /// The file's map, kept between reads (see [`MapSlot`]).
    pub(crate) map: MapSlot,
}

impl Header {
    /// Opens `path` and parses its header.
    /// A FIFO, socket or device is refused before it is opened (`mmap::open_regular`).
    pub fn read(path: &Path) -> Result<Header, LoadError> {
        let (mut file, meta) = open_regular(path)?;
        let file_len = meta.len();
        if file_len < 8 {
            return Err(LoadError::header(
                path,
                format!("file has {file_len} bytes, fewer than the 8-byte length prefix"),
            ));
        }
        let mut len_bytes = [0u8; 8];
        read_exact(&mut file, &mut len_bytes, path, 0, file_len)?;
        let n = check_len(path, u64::from_le_bytes(len_bytes), file_len)?;
        let mut buf = vec![0u8; 8 + n as usize];
        buf[..8].copy_from_slice(&len_bytes);
        read_exact(&mut file, &mut buf[8..], path, 8, file_len)?;
        let mut header = Header::parse(path, &buf, file_len)?;
        header.identity = Some(FileIdentity::of(&meta));
        Ok(header)
    }

    /// Whether the file at [`Header::path`] still has this header: same identity and size, and the same
    /// header bytes (re-read and digested). For callers that cache headers and cannot trust the identity
    /// alone (a rewrite within one tick of a coarse file-system clock keeps every timestamp). Any error
    /// (gone, unreadable, not regular) is `false`: the caller parses the file again and reports it.
    pub fn still_current(&self) -> bool {
        let Ok((mut file, meta)) = open_regular(&self.path) else {
            return false;
        };
        if meta.len() != self.file_len || self.identity != Some(FileIdentity::of(&meta)) {
            return false;
        }
        let mut buf = vec![0u8; self.data_start as usize];
        file.read_exact(&mut buf).is_ok() && header_digest(&buf) == self.digest
    }

    /// Parses a header from `bytes` (at least the length prefix and the JSON) of a file of `file_len` bytes.
    pub fn parse(path: &Path, bytes: &[u8], file_len: u64) -> Result<Header, LoadError> {
        let err = |reason: String| LoadError::header(path, reason);
        if bytes.len() < 8 || file_len < 8 {
            return Err(err(format!(
                "file has {file_len} bytes, fewer than the 8-byte length prefix"
            )));
        }
        let raw_len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        let n = check_len(path, raw_len, file_len)?;
        let json_bytes = bytes
            .get(8..8 + n as usize)
            .ok_or_else(|| err(format!("header of {n} bytes is cut short")))?;
        let text = std::str::from_utf8(json_bytes).map_err(|e| {
            err(format!(
                "header is not valid UTF-8 (byte {} of the JSON)",
                e.valid_up_to()
            ))
        })?;
        let mut de = serde_json::Deserializer::from_str(text);
        let top = de::DeserializeSeed::deserialize(
            TopSeed((json_bytes.len() / 96).min(1 << 18)),
            &mut de,
        )
        .map_err(|e| err(format!("header is not valid JSON: {e}")))?;
        de.end()
            .map_err(|e| err(format!("unexpected text after the JSON object: {e}")))?;
        let (entries, metadata_value) = match top {
            Top::Object { entries, metadata } => (entries, metadata),
            Top::Other(value) => {
                return Err(err(format!(
                    "header JSON is {}, expected an object",
                    kind(&value)
                )))
            }
        };
        let data_start = 8 + n;
        let digest = header_digest(&bytes[..data_start as usize]);
        let data_len = file_len - data_start;
        let metadata = match metadata_value {
            Some(entry) => parse_metadata(&entry).map_err(err)?,
            None => None,
        };
        // Duplicate names first (before any entry is judged), without copying the names.
        if let Err(at) = NameTable::build(&entries, |(name, _)| name) {
            return Err(err(format!(
                "header is not valid JSON: duplicate key {}",
                Quoted(&entries[at].0)
            )));
        }
        let mut tensors = Vec::with_capacity(entries.len());
        for (name, entry) in entries {
            tensors.push(parse_tensor(name, entry).map_err(err)?);
        }
        tensors.sort_by_key(|t| (t.begin, t.end));
        let index = NameTable::build(&tensors, |t| &t.name).unwrap_or_else(|_| {
            unreachable!("the names were found distinct above, and sorting keeps them")
        });
        let natural = NaturalKeys::of(&tensors, |t| &t.name);
        let mut covered = 0u64;
        for t in &tensors {
            if t.begin < covered {
                return Err(err(format!(
                    "tensor {} at data_offsets [{}, {}] overlaps the previous tensor, which ends at {covered}",
                    Quoted(&t.name), t.begin, t.end
                )));
            }
            if t.begin > covered {
                return Err(err(format!(
                    "hole in the data section: bytes {covered}..{} belong to no tensor (next is {})",
                    t.begin, Quoted(&t.name)
                )));
            }
            covered = t.end;
        }
        if covered != data_len {
            return Err(err(format!(
                "tensors cover {covered} bytes but the data section has {data_len} (file of {file_len} \
                 bytes, header of {n})"
            )));
        }
        Ok(Header {
            path: path.to_path_buf(),
            file_len,
            data_start,
            metadata,
            tensors,
            identity: None,
            digest,
            index,
            natural,
            map: MapSlot::default(),
        })
    }

    /// Drops the file map kept between reads: its page-table entries are freed and its pages become
    /// evictable with `posix_fadvise(DONTNEED)`. The next mapped read maps the file again.
    pub fn release_map(&self) {
        self.map.clear();
    }

    /// Position in [`Header::tensors`] of the tensor called `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.index.get(&self.tensors, |t| &t.name, name)
    }
}

fn read_exact(
    file: &mut File,
    buf: &mut [u8],
    path: &Path,
    at: u64,
    file_len: u64,
) -> Result<(), LoadError> {
    match file.read_exact(buf) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(LoadError::Truncated {
            path: path.to_path_buf(),
            expected: at + buf.len() as u64,
            actual: file_len,
        }),
        Err(e) => Err(LoadError::io(path, &e)),
    }
}

fn check_len(path: &Path, n: u64, file_len: u64) -> Result<u64, LoadError> {
    if n > MAX_HEADER_LEN {
        return Err(LoadError::header(
            path,
            format!("header length {n} exceeds the limit of {MAX_HEADER_LEN} bytes"),
        ));
    }
    if n > file_len.saturating_sub(8) {
        return Err(LoadError::header(
            path,
            format!("header length {n} runs past the end of the file ({file_len} bytes)"),
        ));
    }
    Ok(n)
}
