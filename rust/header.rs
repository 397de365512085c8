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

/// FNV-1a over 8-byte words, then the tail: one multiply per word (SipHash, std's default, was most of the
/// cost of hashing ~60-byte names and short shapes). For in-process tables only; not collision-resistant
/// against chosen input, which costs a slower lookup there, never a wrong one.
#[derive(Clone, Copy, Debug)]
pub struct WordHasher(u64);

impl Default for WordHasher {
    fn default() -> Self {
        WordHasher(FNV_OFFSET)
    }
}

impl std::hash::Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = fnv_words(self.0, bytes);
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }
}

/// Positions of named items by name: open addressing over `u32` slots (linear probing, at most half
/// full). The names stay where they are (no copy, no allocation per name): building the std
/// `HashMap<String, usize>` (a clone of every name, SipHash) and the duplicate check's `HashSet` was a
/// fifth of parsing a 90k-tensor header.
#[derive(Clone, Debug, Default)]
struct NameTable {
    /// `EMPTY`, or a position into the items the table was built over.
    slots: Vec<u32>,
}

impl NameTable {
    const EMPTY: u32 = u32::MAX;

    fn hash(name: &str) -> u64 {
        let mut h = WordHasher::default();
        h.write(name.as_bytes());
        h.finish()
    }

    /// The table of `items`, or the position of the first item whose name an earlier one already has.
    /// A header is at most [`MAX_HEADER_LEN`] bytes, so it has fewer than `u32::MAX` tensors.
    fn build<T>(items: &[T], name: impl Fn(&T) -> &str) -> Result<NameTable, usize> {
        let mask = (items.len() * 2).next_power_of_two().max(2) - 1;
        let mut slots = vec![Self::EMPTY; mask + 1];
        for (i, item) in items.iter().enumerate() {
            let key = name(item);
            let mut at = Self::hash(key) as usize & mask;
            loop {
                match slots[at] {
                    Self::EMPTY => {
                        slots[at] = u32::try_from(i).expect("fewer than u32::MAX tensors");
                        break;
                    }
                    j if name(&items[j as usize]) == key => return Err(i),
                    _ => at = (at + 1) & mask,
                }
            }
        }
        Ok(NameTable { slots })
    }

    /// The position of `key` among `items` (the ones the table was built over).
    fn get<T>(&self, items: &[T], name: impl Fn(&T) -> &str, key: &str) -> Option<usize> {
        self.get_hashed(items, name, key, Self::hash(key))
    }

    /// [`NameTable::get`] with `hash` = `NameTable::hash(key)` given (to probe several tables for one key).
    fn get_hashed<T>(
        &self,
        items: &[T],
        name: impl Fn(&T) -> &str,
        key: &str,
        hash: u64,
    ) -> Option<usize> {
        let mask = self.slots.len().checked_sub(1)?;
        let mut at = hash as usize & mask;
        loop {
            match self.slots[at] {
                Self::EMPTY => return None,
                j if name(&items[j as usize]) == key => return Some(j as usize),
                _ => at = (at + 1) & mask,
            }
        }
    }
}

/// Process-wide small ids of tensor facts, a (dtype, shape) pair: equal ids exactly when dtype and shape are
/// equal, in every header of the process (ids are never reused or forgotten; a process sees few distinct
/// facts, a few dozen per checkpoint). Keyed by `[dtype as u64, dims...]`: the length tells the rank apart.
static FACTS: std::sync::Mutex<Option<FactsTable>> = std::sync::Mutex::new(None);

/// [`FACTS`]' table: `[dtype as u64, dims...]` -> id.
type FactsTable = HashMap<Vec<u64>, u32, std::hash::BuildHasherDefault<WordHasher>>;

/// How many of the headers last hit [`facts_of`] probes first.
const RECENT_HEADERS: usize = 4;

/// The facts id of every name of `names` (see [`FACTS`]), each looked up in the header of `headers` that
/// has it (callers pass headers that share no name; the headers that matched the last names are tried
/// first, most recent first, then the others from the last one on, since a group's names sit in a few
/// files), or `Err(i)` for the first name `names[i]` that no header has. Only the asked names' dtypes and
/// shapes are read: nothing is built per tensor of a header.
pub fn facts_of(headers: &[&Header], names: &[&str]) -> Result<Vec<u32>, usize> {
    let mut guard = FACTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let table = guard.get_or_insert_with(HashMap::default);
    let mut out = Vec::with_capacity(names.len());
    // The headers the last names were found in, most recent first: a group's names alternate between a
    // few shards (a stacked-experts group's gate and up weights, 3-4 files), and scanning every header from
    // the last hit on made a name of the shard before it probe all others (~3 us a name at 161 shards).
    let mut recent = [usize::MAX; RECENT_HEADERS];
    let mut previous: Option<(&TensorInfo, u32)> = None;
    let mut key = Vec::new();
    let probe = |h: usize, name: &str, hash: u64| {
        let header = headers[h];
        let at = header
            .index
            .get_hashed(&header.tensors, |t| &t.name, name, hash)?;
        Some((h, &header.tensors[at]))
    };
    for (i, &name) in names.iter().enumerate() {
        let hash = NameTable::hash(name);
        let first = recent[0].min(headers.len().saturating_sub(1));
        let found = recent
            .iter()
            .filter(|&&h| h < headers.len())
            .find_map(|&h| probe(h, name, hash))
            .or_else(|| {
                // From the last hit on, wrapping: names that leave a shard (sorted shard names, keys in
                // natural order) mostly continue in the next one.
                (0..headers.len())
                    .map(|d| (first + d) % headers.len())
                    .filter(|h| !recent.contains(h))
                    .find_map(|h| probe(h, name, hash))
            });
        let Some((h, tensor)) = found else {
            return Err(i);
        };
        if let Some(at) = recent.iter().position(|&r| r == h) {
            recent[..=at].rotate_right(1);
        } else {
            recent.rotate_right(1);
            recent[0] = h;
        }
        let id = match previous {
            Some((p, id)) if p.dtype == tensor.dtype && p.shape == tensor.shape => id,
            _ => {
                key.clear();
                key.push(tensor.dtype as u64);
                key.extend_from_slice(&tensor.shape);
                match table.get(key.as_slice()) {
                    Some(&id) => id,
                    None => {
                        let id =
                            u32::try_from(table.len()).expect("fewer than u32::MAX distinct facts");
                        table.insert(key.clone(), id);
                        id
                    }
                }
            }
        };
        previous = Some((tensor, id));
        out.push(id);
    }
    Ok(out)
}

/// Positions (file order) of the tensors of `header` whose safetensors dtype name is not in `dtype_names`.
pub fn positions_not_of(header: &Header, dtype_names: &[&str]) -> Vec<usize> {
    // A header has a handful of dtypes: each is judged once, not once per tensor.
    let mut judged: Vec<(Dtype, bool)> = Vec::new();
    let mut out = Vec::new();
    for (i, t) in header.tensors.iter().enumerate() {
        let listed = match judged.iter().find(|(d, _)| *d == t.dtype) {
            Some(&(_, listed)) => listed,
            None => {
                let listed = dtype_names.contains(&t.dtype.name());
                judged.push((t.dtype, listed));
                listed
            }
        };
        if !listed {
            out.push(i);
        }
    }
    out
}

/// The digest of a header's bytes: 64-bit FNV-1a over 8-byte words (then the tail), fixed across builds
/// and platforms, so ranks compare it; ~2 GB/s, a few ms for the largest headers, which parse far slower.
/// Not a cryptographic hash: it detects accidents (another checkpoint, a rewritten file), not forgeries.
pub fn header_digest(bytes: &[u8]) -> u64 {
    fnv_words(FNV_OFFSET, bytes)
}

/// FNV-1a's offset basis: the state both [`WordHasher`] and [`header_digest`] start from.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// `bytes` folded into the state `h`: the length, then FNV-1a over 8-byte little-endian words (with a shift
/// after each multiply), then the tail bytes. The one definition behind [`WordHasher`] and
/// [`header_digest`].
fn fnv_words(h: u64, bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = h ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(PRIME);
        h ^= h >> 29;
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(PRIME);
    }
    h
}

/// The `weight_map` of a sharded checkpoint's `model.safetensors.index.json`: which file holds each tensor.
#[derive(Debug)]
pub struct WeightMap {
    /// The file names it uses, sorted.
    pub files: Vec<String>,
    /// `(tensor name, position in files)` in index order.
    pairs: Vec<(String, usize)>,
}

impl WeightMap {
    /// Parses an index: `None` unless it is a JSON object whose `"weight_map"` is a non-empty object of
    /// strings (the caller, which reports what is wrong in every other case, then parses it itself). Other
    /// fields are skipped unparsed; streamed into a list, not a map (a hash map of 90k names cost more than
    /// Python's `json`).
    pub fn parse(text: &[u8]) -> Option<WeightMap> {
        let mut de = serde_json::Deserializer::from_slice(text);
        let (pairs, mut files) = IndexTop::deserialize(&mut de).ok()?.0?;
        de.end().ok()?;
        if pairs.is_empty() {
            return None;
        }
        // Positions into the first-seen file list, renumbered to the sorted one.
        let mut sorted: Vec<usize> = (0..files.len()).collect();
        sorted.sort_unstable_by(|&a, &b| files[a].cmp(&files[b]));
        let mut rank = vec![0; files.len()];
        for (r, &i) in sorted.iter().enumerate() {
            rank[i] = r;
        }
        let pairs = pairs.into_iter().map(|(k, f)| (k, rank[f])).collect();
        files.sort_unstable();
        Some(WeightMap { files, pairs })
    }

    /// Number of entries listed (a repeated name counts each time).
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether nothing is listed (never, for a parsed map).
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Whether the map lists exactly the tensors of `headers`, each once, `headers[i]` being `files[i]`.
    pub fn agrees(&self, headers: &[&Header]) -> bool {
        if headers.len() != self.files.len()
            || headers.iter().map(|h| h.tensors.len()).sum::<usize>() != self.pairs.len()
        {
            return false;
        }
        let mut seen: Vec<Vec<bool>> = headers
            .iter()
            .map(|h| vec![false; h.tensors.len()])
            .collect();
        self.pairs
            .iter()
            .all(|(name, f)| match headers[*f].index(name) {
                Some(i) => !std::mem::replace(&mut seen[*f][i], true),
                None => false,
            })
    }
}

/// `(pairs, file names in first-seen order)` of an index's `weight_map`, or `None` without one.
type IndexPairs = Option<(Vec<(String, usize)>, Vec<String>)>;

/// The top level of an index: the last `weight_map` field, every other field skipped.
struct IndexTop(IndexPairs);

impl<'de> Deserialize<'de> for IndexTop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Top;
        impl<'de> Visitor<'de> for Top {
            type Value = IndexTop;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an index object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<IndexTop, A::Error> {
                let mut found = None;
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "weight_map" {
                        found = Some(map.next_value_seed(PairsSeed)?);
                    } else {
                        map.next_value::<de::IgnoredAny>()?;
                    }
                }
                Ok(IndexTop(found))
            }
        }
        d.deserialize_map(Top)
    }
}

/// The `weight_map` object, as its pairs in order with each file name stored once.
struct PairsSeed;

impl<'de> de::DeserializeSeed<'de> for PairsSeed {
    type Value = (Vec<(String, usize)>, Vec<String>);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for PairsSeed {
    type Value = (Vec<(String, usize)>, Vec<String>);
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object of file names")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(0));
        let mut files: Vec<String> = Vec::new();
        let mut positions: HashMap<String, usize> = HashMap::new();
        let mut last = usize::MAX; // neighbouring keys mostly share a file
        while let Some(key) = map.next_key::<String>()? {
            let file = map.next_value::<std::borrow::Cow<'de, str>>()?;
            if files.get(last).is_none_or(|f| *f != file) {
                last = match positions.get(file.as_ref()) {
                    Some(&at) => at,
                    None => {
                        positions.insert(file.to_string(), files.len());
                        files.push(file.into_owned());
                        files.len() - 1
                    }
                };
            }
            pairs.push((key, last));
        }
        Ok((pairs, files))
    }
}

/// The largest number of digits `natural_sort_key` (in `hp_fastload.natural`) pads to: longer numbers compare
/// as text there.
const NATURAL_DIGITS: usize = 24;

/// A compact key that sorts exactly like Python's `natural_sort_key` (a number is its digit count, then its
/// digits without leading zeros, instead of 24 padded characters), or `None` when the two could disagree: a
/// non-ASCII name, a control character (the markers are control characters) or a number of more than
/// [`NATURAL_DIGITS`] digits. Keys a third as long make sorting 90k names about twice as fast.
fn natural_order_key(name: &str, out: &mut Vec<u8>) -> bool {
    if !name.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return false;
    }
    let number = |out: &mut Vec<u8>, digits: &str| {
        let digits = digits.trim_start_matches('0');
        if digits.len() > NATURAL_DIGITS {
            return false;
        }
        out.push(digits.len() as u8);
        out.extend_from_slice(digits.as_bytes());
        true
    };
    for (i, part) in name.split('.').enumerate() {
        if i > 0 {
            out.push(1);
        }
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            out.push(2);
            if !number(out, part) {
                return false;
            }
        } else if part.is_empty() {
            // Text, so after every number (2, then a digit count of at most 24), before printable text.
            out.extend_from_slice(&[2, 0xff]);
        } else {
            let stem = part.trim_end_matches(|c: char| c.is_ascii_digit());
            out.extend_from_slice(stem.as_bytes());
            if stem.len() < part.len() {
                out.push(3);
                if !number(out, &part[stem.len()..]) {
                    return false;
                }
            }
        }
    }
    true
}

/// Sorts `names` naturally: `(positions in natural order, positions left to the caller)`. The first list
/// orders like `hp_fastload.natural.natural_sort_key`, ties by name; the second holds the names
/// `natural_order_key` refuses.
pub fn natural_order(names: &[&str]) -> (Vec<usize>, Vec<usize>) {
    let keys = NaturalKeys::of(names, |n| n);
    let order = keys.sorted.iter().map(|&(_, _, i)| i as usize).collect();
    (order, keys.other.iter().map(|&i| i as usize).collect())
}

/// [`natural_order`] over the tensors of several headers (positions into their names taken in order, each
/// header's in file order), merged from the order each header computed when it was parsed, in its parsing
/// thread: a stable sort of the concatenated runs merges them (it finds the sorted runs), so the interpreter
/// waits for a merge, not for a sort of every name.
pub fn natural_order_of(headers: &[&Header]) -> (Vec<usize>, Vec<usize>) {
    let mut base = Vec::with_capacity(headers.len());
    let mut total = 0usize;
    for h in headers {
        base.push(total);
        total += h.tensors.len();
    }
    // (header, key start, key end, position in the header)
    let mut spans: Vec<(u32, u32, u32, u32)> = Vec::with_capacity(total);
    let mut other = Vec::new();
    for (at, h) in headers.iter().enumerate() {
        let at = u32::try_from(at).expect("fewer than u32::MAX headers");
        spans.extend(h.natural.sorted.iter().map(|&(a, b, i)| (at, a, b, i)));
        other.extend(
            h.natural
                .other
                .iter()
                .map(|&i| base[at as usize] + i as usize),
        );
    }
    let key = |&(h, a, b, _): &(u32, u32, u32, u32)| {
        &headers[h as usize].natural.buf[a as usize..b as usize]
    };
    let name = |&(h, _, _, i): &(u32, u32, u32, u32)| {
        headers[h as usize].tensors[i as usize].name.as_str()
    };
    if headers.len() > 1 {
        spans.sort_by(|x, y| key(x).cmp(key(y)).then_with(|| name(x).cmp(name(y))));
    }
    let order = spans
        .iter()
        .map(|&(h, _, _, i)| base[h as usize] + i as usize)
        .collect();
    (order, other)
}

/// Some names' natural order: their compact keys ([`natural_order_key`]) back to back, the keyed names'
/// `(key start, key end, position)` sorted by key then name, and the positions of the names refused. Spans
/// and positions fit in `u32`: a header is at most [`MAX_HEADER_LEN`] bytes, and a key at most three
/// bytes per byte of its name, plus two.
#[derive(Clone, Debug, Default)]
struct NaturalKeys {
    buf: Vec<u8>,
    sorted: Vec<(u32, u32, u32)>,
    other: Vec<u32>,
}

impl NaturalKeys {
    fn of<T>(items: &[T], name: impl Fn(&T) -> &str) -> NaturalKeys {
        let small =
            |n: usize| u32::try_from(n).expect("a header's keys span less than u32::MAX bytes");
        let mut buf: Vec<u8> =
            Vec::with_capacity(items.iter().map(|t| name(t).len() / 2 + 8).sum());
        let mut sorted = Vec::with_capacity(items.len());
        let mut other = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let start = buf.len();
            if natural_order_key(name(item), &mut buf) {
                sorted.push((small(start), small(buf.len()), small(i)));
            } else {
                buf.truncate(start);
                other.push(small(i));
            }
        }
        let key = |&(a, b, _): &(u32, u32, u32)| &buf[a as usize..b as usize];
        sorted.sort_unstable_by(|x, y| {
            key(x)
                .cmp(key(y))
                .then_with(|| name(&items[x.2 as usize]).cmp(name(&items[y.2 as usize])))
        });
        NaturalKeys { buf, sorted, other }
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

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_metadata(entry: &Value) -> Result<Option<Vec<(String, String)>>, String> {
    match entry {
        Value::Null => Ok(None),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => Ok((k.clone(), s.clone())),
                other => Err(format!(
                    "__metadata__ value for '{k}' is {}, expected a string",
                    kind(other)
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        other => Err(format!(
            "__metadata__ is {}, expected an object of strings",
            kind(other)
        )),
    }
}

fn parse_tensor(name: String, entry: Entry) -> Result<TensorInfo, String> {
    let q = Quoted(&name);
    let mut fields = match entry {
        Entry::Fields(fields) => fields,
        Entry::Other(value) => {
            return Err(format!(
                "tensor {q} is {}, expected an object",
                kind(&value)
            ))
        }
    };
    let mut field = |i: usize| {
        fields[i]
            .take()
            .ok_or_else(|| format!("tensor {q} has no '{}'", FIELDS[i]))
    };
    let dtype = match field(0)? {
        Field::Dtype(dtype) => dtype,
        Field::Value(value) if value.is_string() => {
            let s = value.as_str().unwrap_or_default();
            return Err(format!("tensor {q} has unknown dtype '{s}'"));
        }
        Field::Value(other) => {
            return Err(format!(
                "tensor {q}: dtype is {}, expected a string",
                kind(&other)
            ))
        }
        Field::Ints(_) => return Err(format!("tensor {q}: dtype is an array, expected a string")),
    };
    let mut ints = |i: usize| -> Result<Vec<u64>, String> {
        let key = FIELDS[i];
        match field(i)? {
            Field::Ints(ints) => Ok(ints),
            Field::Value(value) if value.is_array() => value
                .as_array()
                .into_iter()
                .flatten()
                .map(|v| {
                    v.as_u64().ok_or_else(|| {
                        format!("tensor {q}: {key} entry {v} is not a non-negative integer")
                    })
                })
                .collect(),
            Field::Value(_) | Field::Dtype(_) => Err(format!("tensor {q}: {key} is not an array")),
        }
    };
    let shape = ints(1)?;
    let offsets = ints(2)?;
    let [begin, end] = offsets[..] else {
        return Err(format!(
            "tensor {q}: data_offsets has {} entries, expected 2",
            offsets.len()
        ));
    };
    if end < begin {
        return Err(format!(
            "tensor {q}: data_offsets [{begin}, {end}] end before they begin"
        ));
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("tensor {q}: shape {shape:?} overflows the element count"))?;
    let bits = numel
        .checked_mul(dtype.bits())
        .ok_or_else(|| format!("tensor {q}: shape {shape:?} of {dtype} overflows the byte size"))?;
    let nbytes = bits.div_ceil(8);
    if end - begin != nbytes {
        return Err(format!(
            "tensor {q}: data_offsets [{begin}, {end}] hold {} bytes but dtype {dtype} and shape \
             {shape:?} need {nbytes}",
            end - begin
        ));
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// Visitor methods that build the JSON value (as [`StrictVisitor`] does) and wrap it with `$wrap`, one per
/// listed kind: a visitor that types some values forwards the others here, for the error message that names
/// what was found instead.
macro_rules! forward_to_strict {
    ($out:ty, $wrap:expr; $($kind:ident),+) => {
        $(forward_to_strict!(@one $out, $wrap, $kind);)+
    };
    (@one $out:ty, $wrap:expr, bool) => {
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<$out, E> {
            StrictVisitor.visit_bool(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, i64) => {
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<$out, E> {
            StrictVisitor.visit_i64(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, u64) => {
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<$out, E> {
            StrictVisitor.visit_u64(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, f64) => {
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<$out, E> {
            StrictVisitor.visit_f64(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, str) => {
        fn visit_str<E: de::Error>(self, v: &str) -> Result<$out, E> {
            StrictVisitor.visit_str(v).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, unit) => {
        fn visit_unit<E: de::Error>(self) -> Result<$out, E> {
            Ok(($wrap)(Value::Null))
        }
        fn visit_none<E: de::Error>(self) -> Result<$out, E> {
            Ok(($wrap)(Value::Null))
        }
    };
    (@one $out:ty, $wrap:expr, seq) => {
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<$out, A::Error> {
            StrictVisitor.visit_seq(seq).map($wrap)
        }
    };
    (@one $out:ty, $wrap:expr, map) => {
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<$out, A::Error> {
            StrictVisitor.visit_map(map).map($wrap)
        }
    };
}

/// The fields of a tensor entry that the format defines, in [`Entry::Fields`] order.
const FIELDS: [&str; 3] = ["dtype", "shape", "data_offsets"];

/// One tensor entry: its known fields (other fields are checked for duplicates, then ignored), or the
/// value itself when it is not an object (for the error message).
enum Entry {
    Fields([Option<Field>; 3]),
    Other(Box<Value>),
}

/// A known field of a tensor entry, typed while it streams by when it has the expected form (a known dtype
/// name; an array of non-negative integers), else the JSON value for the error message. Typing here, rather
/// than keeping a JSON value per field, halved the allocations of a 22k-tensor header's parse.
enum Field {
    Dtype(Dtype),
    Ints(Vec<u64>),
    Value(Box<Value>),
}

/// Deserializes a [`Field`]: the `dtype` field when `.0`, else `shape` / `data_offsets`.
struct FieldSeed(bool);

impl<'de> de::DeserializeSeed<'de> for FieldSeed {
    type Value = Field;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Field, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed {
    type Value = Field;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    forward_to_strict!(Field, |v| Field::Value(Box::new(v)); bool, i64, u64, f64, unit, map);
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
        match Dtype::from_name(v) {
            Some(dtype) if self.0 => Ok(Field::Dtype(dtype)),
            _ => StrictVisitor
                .visit_str(v)
                .map(|v| Field::Value(Box::new(v))),
        }
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Field, A::Error> {
        if self.0 {
            return StrictVisitor
                .visit_seq(seq)
                .map(|v| Field::Value(Box::new(v)));
        }
        let mut ints = Vec::with_capacity(seq.size_hint().unwrap_or(4));
        while let Some(IntOrValue(item)) = seq.next_element()? {
            match item {
                Ok(int) => ints.push(int),
                Err(value) => {
                    // Not all integers: keep the whole array as JSON values for the error message.
                    let mut values: Vec<Value> =
                        ints.into_iter().map(|i| Value::Number(i.into())).collect();
                    values.push(value);
                    while let Some(StrictValue(v)) = seq.next_element()? {
                        values.push(v);
                    }
                    return Ok(Field::Value(Box::new(Value::Array(values))));
                }
            }
        }
        Ok(Field::Ints(ints))
    }
}

/// An array element: a non-negative integer, or any other JSON value.
struct IntOrValue(Result<u64, Value>);

impl<'de> Deserialize<'de> for IntOrValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IntOrValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<IntOrValue, E> {
                Ok(IntOrValue(Ok(v)))
            }
            forward_to_strict!(IntOrValue, |v| IntOrValue(Err(v)); bool, i64, f64, str, unit, seq, map);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entry;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a tensor entry")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entry, A::Error> {
                let mut fields: [Option<Field>; 3] = [None, None, None];
                let mut others: Vec<String> = Vec::new();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    let seen = match FIELDS.iter().position(|f| *f == key) {
                        Some(i) => {
                            let v = map.next_value_seed(FieldSeed(i == 0))?;
                            fields[i].replace(v).is_some()
                        }
                        None => {
                            let StrictValue(_) = map.next_value()?;
                            if others.iter().any(|o| *o == key) {
                                true
                            } else {
                                others.push(key.to_string());
                                false
                            }
                        }
                    };
                    if seen {
                        return Err(de::Error::custom(format_args!("duplicate key '{key}'")));
                    }
                }
                Ok(Entry::Fields(fields))
            }
            forward_to_strict!(Entry, |v| Entry::Other(Box::new(v)); bool, i64, u64, f64, str, unit, seq);
        }
        d.deserialize_any(V)
    }
}

/// The header's top level, streamed: tensor entries in file order plus `__metadata__`, without building a
/// JSON tree of the whole header (a 90k-tensor header spent most of its parse in that tree). Duplicate
/// keys are refused here at every level, as [`StrictValue`] does.
enum Top {
    Object {
        entries: Vec<(String, Entry)>,
        metadata: Option<Value>,
    },
    Other(Value),
}

/// Deserializes a [`Top`], reserving room for about `.0` entries (estimated from the header's length: growing
/// the list of a 22k-tensor header step by step moved megabytes).
struct TopSeed(usize);

impl<'de> de::DeserializeSeed<'de> for TopSeed {
    type Value = Top;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Top, D::Error> {
        struct V(usize);
        impl<'de> Visitor<'de> for V {
            type Value = Top;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Top, A::Error> {
                let mut entries: Vec<(String, Entry)> = Vec::with_capacity(self.0);
                let mut metadata = None;
                // Duplicate tensor names are caught when the name index is built.
                while let Some(key) = map.next_key::<String>()? {
                    if key == "__metadata__" {
                        let StrictValue(v) = map.next_value()?;
                        if metadata.replace(v).is_some() {
                            return Err(de::Error::custom("duplicate key '__metadata__'"));
                        }
                    } else {
                        let entry: Entry = map.next_value()?;
                        entries.push((key, entry));
                    }
                }
                Ok(Top::Object { entries, metadata })
            }
            forward_to_strict!(Top, Top::Other; bool, i64, u64, f64, str, unit, seq);
        }
        d.deserialize_any(V(self.0))
    }
}

/// A JSON value that refuses duplicate object keys at every level (serde_json keeps the last silently).
struct StrictValue(Value);

impl<'de> Deserialize<'de> for StrictValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StrictVisitor).map(StrictValue)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(StrictValue(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key '{key}'")));
            }
            let StrictValue(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn file(json: &str, data_len: usize) -> Vec<u8> {
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(json.as_bytes());
        b.resize(b.len() + data_len, 0xab);
        b
    }

    fn parse(bytes: &[u8]) -> Result<Header, LoadError> {
        Header::parse(Path::new("t.safetensors"), bytes, bytes.len() as u64)
    }

    fn reject(bytes: &[u8], needle: &str) {
        match parse(bytes) {
            Err(LoadError::Header { reason, .. }) => {
                assert!(
                    reason.contains(needle),
                    "reason {reason:?} lacks {needle:?}"
                )
            }
            other => panic!("expected a header error containing {needle:?}, got {other:?}"),
        }
    }

    const OK: &str = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[4,16]},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}"#;

    #[test]
    fn accepts_valid_and_sorts_by_offset() {
        let h = parse(&file(OK, 16)).unwrap();
        assert_eq!(
            h.tensors
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(h.metadata, Some(vec![("format".into(), "pt".into())]));
        assert_eq!(h.index("b"), Some(1));
        assert_eq!(h.index("c"), None);
        assert_eq!(h.tensors[0].numel(), 1);
        assert_eq!(h.data_start, 8 + OK.len() as u64);
    }

    #[test]
    fn accepts_trailing_spaces_and_empty() {
        let padded = format!("{OK}      ");
        assert!(parse(&file(&padded, 16)).is_ok());
        assert!(parse(&file("{}", 0)).unwrap().tensors.is_empty());
        let sub = r#"{"f":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
        assert!(parse(&file(sub, 2)).is_ok());
    }

    #[test]
    fn rejects_bad_lengths() {
        reject(&[1, 2, 3], "fewer than the 8-byte");
        let mut b = file(OK, 16);
        b[..8].copy_from_slice(&(MAX_HEADER_LEN + 1).to_le_bytes());
        reject(&b, "exceeds the limit");
        let len = b.len() as u64;
        b[..8].copy_from_slice(&len.to_le_bytes());
        reject(&b, "past the end of the file");
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        reject(&b, "exceeds the limit");
    }

    #[test]
    fn rejects_bad_json() {
        let mut b = file(r#"{"a":1}"#, 0);
        b[10] = 0xff;
        reject(&b, "not valid UTF-8");
        reject(&file("[1, 2]", 0), "expected an object");
        reject(&file(r#"{"a":"#, 0), "not valid JSON");
        reject(&file(r#"{} x"#, 0), "unexpected text");
        reject(&file("{}\0\0", 0), "unexpected text");
    }

    #[test]
    fn rejects_bad_metadata() {
        reject(&file(r#"{"__metadata__":{"a":1}}"#, 0), "expected a string");
        reject(
            &file(r#"{"__metadata__":[1]}"#, 0),
            "expected an object of strings",
        );
    }

    #[test]
    fn rejects_bad_tensors() {
        reject(
            &file(
                r#"{"a":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}}"#,
                1,
            ),
            "unknown dtype 'F8'",
        );
        reject(
            &file(
                r#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#,
                1,
            ),
            "non-negative",
        );
        reject(
            &file(
                r#"{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}"#,
                1,
            ),
            "non-negative",
        );
        reject(
            &file(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}}"#, 1),
            "expected 2",
        );
        reject(
            &file(r#"{"a":{"dtype":"U8","shape":[1]}}"#, 1),
            "no 'data_offsets'",
        );
        reject(&file(r#"{"a":[1]}"#, 1), "expected an object");
        reject(
            &file(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,0]}}"#,
                1,
            ),
            "end before",
        );
        reject(
            &file(
                r#"{"a":{"dtype":"I16","shape":[2],"data_offsets":[0,3]}}"#,
                3,
            ),
            "need 4",
        );
        reject(
            &file(
                r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#,
                0,
            ),
            "overflows the element count",
        );
        reject(
            &file(
                r#"{"a":{"dtype":"F64","shape":[4294967296,1073741824],"data_offsets":[0,0]}}"#,
                0,
            ),
            "overflows the byte size",
        );
    }

    #[test]
    fn rejects_bad_layouts() {
        let overlap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
        reject(&file(overlap, 4), "overlaps");
        let hole = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#;
        reject(&file(hole, 5), "hole");
        let short = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
        reject(&file(short, 3), "cover 2 bytes but the data section has 3");
        reject(&file(short, 1), "cover 2 bytes but the data section has 1");
    }

    #[test]
    fn rejects_duplicate_keys_at_any_level() {
        let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        reject(&file(dup, 1), "duplicate key 'a'");
        let escaped = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\u0061":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        reject(&file(escaped, 1), "duplicate key 'a'");
        let inner = r#"{"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}}"#;
        reject(&file(inner, 1), "duplicate key 'dtype'");
        reject(
            &file(r#"{"__metadata__":{"k":"1","k":"2"}}"#, 0),
            "duplicate key 'k'",
        );
    }

    #[test]
    fn facts_of_gives_equal_ids_exactly_for_equal_dtype_and_shape() {
        let a = parse(&file(
            r#"{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},
                "y":{"dtype":"F32","shape":[3,2],"data_offsets":[24,48]},
                "z":{"dtype":"I32","shape":[2,3],"data_offsets":[48,72]},
                "v":{"dtype":"F32","shape":[6],"data_offsets":[72,96]}}"#,
            96,
        ))
        .unwrap();
        let b = parse(&file(
            r#"{"p":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},
                "q":{"dtype":"F32","shape":[2,3,1],"data_offsets":[24,48]}}"#,
            48,
        ))
        .unwrap();
        let ids = facts_of(&[&a, &b], &["x", "p", "y", "z", "v", "q", "x"]).unwrap();
        let (x, p, y, z, v, q) = (ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]);
        assert_eq!(x, p, "same dtype and shape in two files");
        assert_eq!(ids[6], x, "asked again");
        for (other, what) in [
            (y, "shape"),
            (z, "dtype"),
            (v, "rank and shape"),
            (q, "rank"),
        ] {
            assert_ne!(x, other, "a different {what}");
        }
        assert_ne!(y, v);
        assert_ne!(q, v);
        // Process-wide: asked later, from the other header first, the ids are the same.
        assert_eq!(
            facts_of(&[&b, &a], &["q", "z", "p"]).unwrap(),
            vec![q, z, p]
        );
        assert_eq!(facts_of(&[&a, &b], &["x", "nope", "p"]), Err(1));
        assert_eq!(facts_of(&[], &["x"]), Err(0));
        assert_eq!(facts_of(&[], &[]), Ok(vec![]));
    }

    #[test]
    fn facts_of_finds_names_alternating_between_many_headers() {
        // Header h holds "t{h}_{j}" with shape [h + 1, j + 1]: every name's facts tell where it was found.
        let headers: Vec<Header> = (0..9)
            .map(|h: usize| {
                let mut at = 0;
                let entries: Vec<String> = (0..3)
                    .map(|j: usize| {
                        let n = (h + 1) * (j + 1) * 4;
                        at += n;
                        format!(
                            r#""t{h}_{j}":{{"dtype":"F32","shape":[{},{}],"data_offsets":[{},{}]}}"#,
                            h + 1,
                            j + 1,
                            at - n,
                            at
                        )
                    })
                    .collect();
                let json = format!("{{{}}}", entries.join(","));
                parse(&file(&json, at)).unwrap()
            })
            .collect();
        let refs: Vec<&Header> = headers.iter().collect();
        // More distinct headers than the recent ones probed first, visited backwards and back and forth.
        let order = [
            (7, 0),
            (2, 1),
            (7, 1),
            (2, 2),
            (8, 0),
            (0, 2),
            (5, 1),
            (1, 0),
            (8, 2),
            (7, 2),
            (3, 0),
        ];
        let names: Vec<String> = order.iter().map(|(h, j)| format!("t{h}_{j}")).collect();
        let strs: Vec<&str> = names.iter().map(String::as_str).collect();
        let ids = facts_of(&refs, &strs).unwrap();
        for (&(h, j), &id) in order.iter().zip(&ids) {
            let alone = facts_of(&[refs[h]], &[format!("t{h}_{j}").as_str()]).unwrap();
            assert_eq!(alone, vec![id], "t{h}_{j}");
        }
        let shape_ids: std::collections::HashSet<u32> = ids.iter().copied().collect();
        assert_eq!(
            shape_ids.len(),
            order.len(),
            "every (h, j) has its own shape"
        );
        let mut missing = strs.clone();
        missing.insert(5, "t9_0");
        assert_eq!(facts_of(&refs, &missing), Err(5));
    }

    #[test]
    fn positions_not_of_keeps_the_unlisted_dtypes_in_file_order() {
        let h = parse(&file(
            r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},
                "b":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[4,8]},
                "c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},
                "d":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[12,16]}}"#,
            16,
        ))
        .unwrap();
        assert_eq!(positions_not_of(&h, &["BF16", "F32"]), vec![1, 3]);
        assert_eq!(positions_not_of(&h, &["F8_E4M3"]), vec![0, 2]);
        assert_eq!(positions_not_of(&h, &[]), vec![0, 1, 2, 3]);
        assert!(positions_not_of(&h, &["BF16", "F32", "F8_E4M3"]).is_empty());
    }

    #[test]
    fn name_table_finds_every_name_and_the_first_repeat() {
        // Many names sharing prefixes and a tiny table's collisions: every name at its position, others absent.
        let names: Vec<String> = (0..5000)
            .map(|i| format!("model.layers.{}.w{}", i % 61, i))
            .collect();
        let table = NameTable::build(&names, |n| n).unwrap();
        for (i, n) in names.iter().enumerate() {
            assert_eq!(table.get(&names, |n| n, n), Some(i));
        }
        for absent in [
            "",
            "model.layers.0.w",
            "model.layers.0.w5000",
            "model.layers.0.w0 ",
        ] {
            assert_eq!(table.get(&names, |n| n, absent), None);
        }
        assert_eq!(NameTable::default().get(&names, |n| n, "a"), None);
        let repeated = ["a", "b", "c", "b", "a"];
        assert_eq!(NameTable::build(&repeated, |n| n).err(), Some(3));
        assert!(NameTable::build(&[] as &[&str], |n| n).is_ok());
    }

    #[test]
    fn read_maps_io_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.safetensors");
        assert!(matches!(
            Header::read(&missing),
            Err(LoadError::NotFound { .. })
        ));
        assert!(matches!(
            Header::read(dir.path()),
            Err(LoadError::Io { .. })
        ));
        let p = dir.path().join("ok.safetensors");
        std::fs::write(&p, file(OK, 16)).unwrap();
        let h = Header::read(&p).unwrap();
        assert!(h.identity.is_some());
        assert_eq!(h.file_len, 8 + OK.len() as u64 + 16);
    }

    #[test]
    fn weight_map_parses_the_usual_layout_only() {
        let w = WeightMap::parse(
            br#"{"metadata":{"n":[1,{"x":null}]},"weight_map":{"a":"s2","b":"s1","c\u0041":"s2"}}"#,
        )
        .unwrap();
        assert_eq!(w.files, ["s1", "s2"]);
        assert_eq!(
            w.pairs,
            [("a".into(), 1), ("b".into(), 0), ("cA".into(), 1)]
        );
        for bad in [
            &br#"{"weight_map":{}}"#[..],
            br#"{"weight_map":{"a":1}}"#,
            br#"{"weight_map":["a"]}"#,
            br#"{"metadata":{}}"#,
            br#"[1]"#,
            br#"{"weight_map":{"a":"s"}"#,
            br#"{"weight_map":{"a":"s"}} x"#,
            b"{\"weight_map\":{\"\xff\":\"s\"}}",
        ] {
            assert!(
                WeightMap::parse(bad).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn weight_map_agrees_only_with_exactly_its_tensors() {
        let h = |json: &str, n| parse(&file(json, n)).unwrap();
        let s1 = h(
            r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
            2,
        );
        let s2 = h(
            r#"{"c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
            1,
        );
        let agrees = |json: &str| {
            WeightMap::parse(json.as_bytes())
                .unwrap()
                .agrees(&[&s1, &s2])
        };
        assert!(agrees(r#"{"weight_map":{"c":"s2","a":"s1","b":"s1"}}"#));
        assert!(
            !agrees(r#"{"weight_map":{"c":"s2","a":"s1"}}"#),
            "a missing tensor"
        );
        assert!(
            !agrees(r#"{"weight_map":{"c":"s2","a":"s1","b":"s2"}}"#),
            "a wrong file"
        );
        assert!(
            !agrees(r#"{"weight_map":{"c":"s2","a":"s1","a":"s1"}}"#),
            "a name twice, one missing"
        );
        assert!(
            !agrees(r#"{"weight_map":{"c":"s2","a":"s1","b":"s1","d":"s1"}}"#),
            "an extra name"
        );
        assert!(
            !agrees(r#"{"weight_map":{"a":"s1","b":"s1"}}"#),
            "a file fewer"
        );
    }

    /// The test oracle of [`natural_order`]: `hp_fastload.natural.natural_sort_key` written out in Rust (digit
    /// parts zero-padded after `\x02`, an empty part `\x02~`, a text part's trailing number after `\x03`, parts
    /// joined by `\x01`), or `None` for a name with non-ASCII characters.
    fn natural_sort_key(name: &str) -> Option<String> {
        if !name.is_ascii() {
            return None;
        }
        let pad = |out: &mut String, digits: &str| {
            let digits = digits.trim_start_matches('0');
            out.extend(std::iter::repeat_n(
                '0',
                24usize.saturating_sub(digits.len()),
            ));
            out.push_str(digits);
        };
        let mut out = String::with_capacity(name.len() + 32);
        for (i, part) in name.split('.').enumerate() {
            if i > 0 {
                out.push('\x01');
            }
            if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
                out.push('\x02');
                pad(&mut out, part);
            } else if part.is_empty() {
                out.push_str("\x02~");
            } else {
                let stem = part.trim_end_matches(|c: char| c.is_ascii_digit());
                out.push_str(stem);
                if stem.len() < part.len() {
                    out.push('\x03');
                    pad(&mut out, &part[stem.len()..]);
                }
            }
        }
        Some(out)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = parse(&bytes);
        }

        /// The compact keys sort exactly like the padded ones (ties by name), and refuse only what they must.
        #[test]
        fn natural_order_sorts_like_the_padded_keys(
            names in proptest::collection::vec(
                proptest::collection::vec(
                    prop_oneof![
                        Just("."), Just("a"), Just("x"), Just("_"), Just("0"), Just("00"), Just("1"),
                        Just("9"), Just("10"), Just("007"), Just("99999999999999"), Just("\u{1}"), Just("é"),
                    ],
                    0..12,
                ).prop_map(|parts| parts.concat()),
                0..60,
            )
        ) {
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let (order, other) = natural_order(&refs);
            let mut all: Vec<usize> = order.iter().chain(&other).copied().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..names.len()).collect::<Vec<_>>());
            for &i in &other {
                let n = refs[i];
                let long = n.split(|c: char| !c.is_ascii_digit()).any(|d| d.trim_start_matches('0').len() > 24);
                prop_assert!(!n.bytes().all(|b| (0x20..0x7f).contains(&b)) || long, "refused {:?}", n);
            }
            let mut expected: Vec<usize> = order.clone();
            expected.sort_by_key(|&i| (natural_sort_key(refs[i]).unwrap(), refs[i]));
            prop_assert_eq!(order, expected);
        }

        /// Several headers' orders merged equal the order of all their names sorted at once (ties by name,
        /// also for one name in two headers, where only the positions differ).
        #[test]
        fn natural_order_of_headers_merges_like_one_sort(
            names in proptest::collection::vec(
                proptest::collection::vec(
                    prop_oneof![Just("."), Just("a"), Just("0"), Just("00"), Just("10"), Just("2"), Just("é")],
                    0..8,
                ).prop_map(|parts| parts.concat()),
                0..80,
            ),
            shards in 1usize..5,
        ) {
            let mut split: Vec<Vec<&str>> = vec![Vec::new(); shards];
            for (i, n) in names.iter().enumerate() {
                if !split[i % shards].contains(&n.as_str()) {
                    split[i % shards].push(n);
                }
            }
            let headers: Vec<Header> = split.iter().map(|part| {
                let fields: Vec<String> = part.iter().enumerate().map(|(i, n)| format!(
                    r#"{}:{{"dtype":"U8","shape":[1],"data_offsets":[{i},{}]}}"#,
                    serde_json::to_string(n).unwrap(), i + 1,
                )).collect();
                parse(&file(&format!("{{{}}}", fields.join(",")), part.len())).unwrap()
            }).collect();
            let every: Vec<&str> = headers.iter().flat_map(|h| h.tensors.iter().map(|t| t.name.as_str())).collect();
            let refs: Vec<&Header> = headers.iter().collect();
            let (order, other) = natural_order_of(&refs);
            let (alone, alone_other) = natural_order(&every);
            prop_assert_eq!(&other, &alone_other);
            let named = |o: &[usize]| o.iter().map(|&i| every[i]).collect::<Vec<_>>();
            prop_assert_eq!(named(&order), named(&alone));
            let mut all: Vec<usize> = order.iter().chain(&alone_other).copied().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..every.len()).collect::<Vec<_>>());
        }

        #[test]
        fn mutated_headers_never_panic(pos in 0usize..200, byte in any::<u8>(), cut in 0usize..200) {
            let mut b = file(OK, 16);
            let p = pos % b.len();
            b[p] = byte;
            b.truncate(b.len() - cut.min(b.len()));
            let _ = parse(&b);
            let _ = Header::parse(Path::new("t"), &b, (b.len() as u64).saturating_add(cut as u64));
        }
    }
}
