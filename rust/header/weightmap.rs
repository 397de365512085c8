//! The `weight_map` of a sharded checkpoint's `model.safetensors.index.json` ([`WeightMap`]): parsed in one
//! pass, and checked against the headers of the files it names.

use super::*;

/// The `weight_map` of a sharded checkpoint's `model.safetensors.index.json`: which file holds each tensor.
#[derive(Debug)]
pub struct WeightMap {
    /// The file names it uses, sorted.
    pub files: Vec<String>,
    /// `(tensor name, position in files)` in index order.
    pub(super) pairs: Vec<(String, usize)>,
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
