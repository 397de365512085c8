//! Lookups over parsed headers: the name table each header keeps ([`NameTable`]), the process-wide facts ids
//! ([`facts_of`]), dtype filters ([`positions_not_of`]) and the header digest with its word hasher.

use super::*;

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
pub(super) struct NameTable {
    /// `EMPTY`, or a position into the items the table was built over.
    slots: Vec<u32>,
}

impl NameTable {
    const EMPTY: u32 = u32::MAX;

    pub(super) fn hash(name: &str) -> u64 {
        let mut h = WordHasher::default();
        h.write(name.as_bytes());
        h.finish()
    }

    /// The table of `items`, or the position of the first item whose name an earlier one already has.
    /// A header is at most [`MAX_HEADER_LEN`] bytes, so it has fewer than `u32::MAX` tensors.
    pub(super) fn build<T>(items: &[T], name: impl Fn(&T) -> &str) -> Result<NameTable, usize> {
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
    pub(super) fn get<T>(
        &self,
        items: &[T],
        name: impl Fn(&T) -> &str,
        key: &str,
    ) -> Option<usize> {
        self.get_hashed(items, name, key, Self::hash(key))
    }

    /// [`NameTable::get`] with `hash` = `NameTable::hash(key)` given (to probe several tables for one key).
    pub(super) fn get_hashed<T>(
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
pub(super) static FACTS: std::sync::Mutex<Option<FactsTable>> = std::sync::Mutex::new(None);

/// [`FACTS`]' table: `[dtype as u64, dims...]` -> id.
pub(super) type FactsTable = HashMap<Vec<u64>, u32, std::hash::BuildHasherDefault<WordHasher>>;

/// How many of the headers last hit [`facts_of`] probes first.
pub(super) const RECENT_HEADERS: usize = 4;

/// The facts id of every name of `names` (see `FACTS`), each looked up in the header of `headers` that
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
pub(super) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// `bytes` folded into the state `h`: the length, then FNV-1a over 8-byte little-endian words (with a shift
/// after each multiply), then the tail bytes. The one definition behind [`WordHasher`] and
/// [`header_digest`].
pub(super) fn fnv_words(h: u64, bytes: &[u8]) -> u64 {
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
