//! Key templates: checkpoint key names with their layer and expert numbers taken out.
//!
//! A *numeric component* of a dotted name is a component that is a plain decimal number: one to 18 ASCII
//! digits, without a leading zero (`0` itself is one; `01` is text, since putting it back from its value
//! would not give the same name). A name's *template* is the name with every numeric component replaced
//! by [`MARKER`]; its *numbers* are those components' values, in order. `model.layers.3.mlp.experts.17.w1`
//! is the template `model.layers.#.mlp.experts.#.w1` with numbers `[3, 17]`, and filling the template's
//! markers with the numbers in order gives the name back.
//!
//! The planner renames and groups a checkpoint's keys once per template instead of once per key (a
//! 90k-tensor DeepSeek-V3 header has ~30 templates).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use crate::header::WordHasher;

/// The character that stands for a numeric component in a template.
pub const MARKER: char = '#';

/// The most digits a numeric component has (so its value fits an `i64`).
const MAX_DIGITS: usize = 18;

/// The templates of a list of names.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct KeyTemplates {
    /// Every distinct template, in order of first appearance.
    pub templates: Vec<String>,
    /// Per name, the index of its template in `templates`.
    pub ids: Vec<u32>,
    /// The numbers of each name, `width` per name, in template order, padded with -1.
    pub numbers: Vec<i64>,
    /// The most numeric components of any name (the row width of `numbers`).
    pub width: usize,
}

fn numeric(bytes: &[u8]) -> Option<i64> {
    if bytes.is_empty() || bytes.len() > MAX_DIGITS || (bytes.len() > 1 && bytes[0] == b'0') {
        return None;
    }
    let mut value = 0i64;
    for &b in bytes {
        if !b.is_ascii_digit() {
            return None;
        }
        value = value * 10 + i64::from(b - b'0');
    }
    Some(value)
}

/// One run of names' templates (a thread's share).
struct Part {
    templates: Vec<String>,
    ids: Vec<u32>,
    /// The numbers of every name back to back; `ends[i]` is where name i's stop.
    flat: Vec<i64>,
    ends: Vec<usize>,
    width: usize,
}

/// Names per thread below which one thread does the whole list.
const NAMES_PER_THREAD: usize = 16 << 10;

/// The templates of `names`, or None when a name contains [`MARKER`] itself (its template would be
/// ambiguous) or there are more than `u32::MAX` distinct templates. A long list is cut into runs
/// templated on scoped threads (at most the machine's cores), then merged in order.
pub fn key_templates<S: AsRef<str> + Sync>(names: &[S]) -> Option<KeyTemplates> {
    let threads = crate::threads::default_threads()
        .min(names.len() / NAMES_PER_THREAD)
        .max(1);
    let parts: Vec<Option<Part>> = if threads == 1 {
        vec![part(names)]
    } else {
        let per = names.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let handles: Vec<_> = names
                .chunks(per)
                .map(|run| scope.spawn(move || part(run)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a template thread panicked"))
                .collect()
        })
    };
    let mut out = KeyTemplates::default();
    let mut global: HashMap<String, u32> = HashMap::new();
    let mut rows: Vec<(Vec<i64>, Vec<usize>)> = Vec::with_capacity(parts.len());
    for part in parts {
        let part = part?;
        let mut remap = Vec::with_capacity(part.templates.len());
        for text in part.templates {
            let id = match global.get(&text) {
                Some(&id) => id,
                None => {
                    let id = u32::try_from(out.templates.len()).ok()?;
                    global.insert(text.clone(), id);
                    out.templates.push(text);
                    id
                }
            };
            remap.push(id);
        }
        out.ids
            .extend(part.ids.iter().map(|&id| remap[id as usize]));
        out.width = out.width.max(part.width);
        rows.push((part.flat, part.ends));
    }
    out.numbers = vec![-1; names.len() * out.width];
    let mut row_chunks = out.numbers.chunks_mut(out.width.max(1));
    for (flat, ends) in &rows {
        let mut start = 0;
        for (&end, row) in ends.iter().zip(&mut row_chunks) {
            row[..end - start].copy_from_slice(&flat[start..end]);
            start = end;
        }
    }
    Some(out)
}

fn part<S: AsRef<str>>(names: &[S]) -> Option<Part> {
    let hasher = BuildHasherDefault::<WordHasher>::default();
    let mut index: HashMap<Vec<u8>, u32, _> = HashMap::with_hasher(hasher);
    let mut out = Part {
        templates: Vec::new(),
        ids: Vec::with_capacity(names.len()),
        flat: Vec::with_capacity(names.len() * 2),
        ends: Vec::with_capacity(names.len()),
        width: 0,
    };
    let mut template: Vec<u8> = Vec::new();
    // Consecutive names mostly share one of a few templates (an expert's projections, then the next
    // expert's): the last few ids are checked before hashing.
    let mut recent: [u32; 8] = [u32::MAX; 8];
    for name in names {
        let bytes = name.as_ref().as_bytes();
        if bytes.contains(&(MARKER as u8)) {
            return None;
        }
        template.clear();
        let start = out.flat.len();
        let mut from = 0;
        for i in 0..=bytes.len() {
            if i < bytes.len() && bytes[i] != b'.' {
                continue;
            }
            match numeric(&bytes[from..i]) {
                Some(value) => {
                    template.push(MARKER as u8);
                    out.flat.push(value);
                }
                None => template.extend_from_slice(&bytes[from..i]),
            }
            if i < bytes.len() {
                template.push(b'.');
            }
            from = i + 1;
        }
        out.width = out.width.max(out.flat.len() - start);
        out.ends.push(out.flat.len());
        let known = recent
            .iter()
            .copied()
            .find(|&id| id != u32::MAX && out.templates[id as usize].as_bytes() == template);
        let id = match known.or_else(|| index.get(template.as_slice()).copied()) {
            Some(id) => id,
            None => {
                let id = u32::try_from(out.templates.len()).ok()?;
                // Components are whole UTF-8 text or ASCII digits, cut at ASCII dots: still UTF-8.
                let text = String::from_utf8(template.clone())
                    .expect("a template of UTF-8 names is UTF-8");
                index.insert(template.clone(), id);
                out.templates.push(text);
                id
            }
        };
        if !recent.contains(&id) {
            recent.rotate_right(1);
            recent[0] = id;
        }
        out.ids.push(id);
    }
    Some(out)
}

/// What quantization detection's companion scan asks of a checkpoint's names, in one pass over them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CompanionScan {
    /// Positions of the names ending with one of the suffixes, in order.
    pub hits: Vec<usize>,
    /// True when every hit ends with the first suffix and no name contains the marker (block fp8 alone).
    pub paired: bool,
    /// When `paired`: `(stem position, hit position)` for each hit whose stem (the name without the suffix)
    /// is a name, in the hits' order (the stem's first position when several names are it); empty otherwise.
    /// A block-fp8 checkpoint pairs each `X_scale_inv` with its `X` this way: the caller takes both as its
    /// own string objects (whose hashes are cached) instead of slicing and hashing new ones.
    pub pairs: Vec<(usize, usize)>,
}

/// The companion scan of `names` (see [`CompanionScan`]): `suffixes[0]` is the pairing suffix; `marker`,
/// when given, is a substring that sends the scan elsewhere (bitsandbytes' `.weight.quant_state.`).
pub fn companion_scan<S: AsRef<str>>(
    names: &[S],
    suffixes: &[&str],
    marker: Option<&str>,
) -> CompanionScan {
    let hits: Vec<usize> = (0..names.len())
        .filter(|&i| suffixes.iter().any(|x| names[i].as_ref().ends_with(x)))
        .collect();
    let first = suffixes.first().copied().unwrap_or("");
    let paired = hits.iter().all(|&i| names[i].as_ref().ends_with(first))
        && !marker.is_some_and(|m| names.iter().any(|n| n.as_ref().contains(m)));
    let pairs = if paired {
        let stems = stems_of(names, &hits, first);
        let kept = hits.iter().zip(stems);
        kept.filter_map(|(&h, s)| s.map(|s| (s, h))).collect()
    } else {
        Vec::new()
    };
    CompanionScan {
        hits,
        paired,
        pairs,
    }
}

/// The stem position of each of `hits` (names ending with `suffix`) among `names`, None when no name is the
/// stem. Names in natural order have a stem just before its suffixed name (`X` < `X_scale_inv`): that
/// neighbour is compared first, and a table of every name's position is built only when one is not there.
fn stems_of<S: AsRef<str>>(names: &[S], hits: &[usize], suffix: &str) -> Vec<Option<usize>> {
    let stem_of = |i: usize| {
        let name = names[i].as_ref();
        &name[..name.len() - suffix.len()]
    };
    let mut position: Option<HashMap<&str, usize, BuildHasherDefault<WordHasher>>> = None;
    hits.iter()
        .map(|&i| {
            let stem = stem_of(i);
            // The neighbour is the stem's first position unless an earlier name is the stem too.
            let neighbour = i > 0 && names[i - 1].as_ref() == stem;
            if neighbour && (i < 2 || names[i - 2].as_ref() != stem) {
                return Some(i - 1);
            }
            let table = position.get_or_insert_with(|| {
                let mut table: HashMap<&str, usize, BuildHasherDefault<WordHasher>> =
                    HashMap::with_capacity_and_hasher(names.len(), BuildHasherDefault::default());
                for (j, name) in names.iter().enumerate() {
                    table.entry(name.as_ref()).or_insert(j);
                }
                table
            });
            table.get(stem).copied()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(template: &str, numbers: &[i64]) -> String {
        let mut it = numbers.iter();
        template
            .split('.')
            .map(|p| {
                if p == "#" {
                    it.next().unwrap().to_string()
                } else {
                    p.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join(".")
    }

    /// Every name is its template filled with its numbers.
    fn assert_round_trip<S: AsRef<str>>(t: &KeyTemplates, names: &[S]) {
        for (i, name) in names.iter().enumerate() {
            let row = &t.numbers[i * t.width..(i + 1) * t.width];
            let used: Vec<i64> = row.iter().copied().filter(|&v| v >= 0).collect();
            assert_eq!(fill(&t.templates[t.ids[i] as usize], &used), name.as_ref());
        }
    }

    #[test]
    fn numbers_out_and_back() {
        let names = [
            "model.layers.3.mlp.experts.17.w1.weight",
            "model.layers.10.mlp.experts.0.w1.weight",
            "model.embed_tokens.weight",
            "model.layers.01.x",
            "0.a",
            "a.0",
            "a..b",
            "a.1234567890123456789.b",
            "layers.5",
        ];
        let t = key_templates(&names).unwrap();
        assert_eq!(
            t.templates,
            [
                "model.layers.#.mlp.experts.#.w1.weight",
                "model.embed_tokens.weight",
                "model.layers.01.x",
                "#.a",
                "a.#",
                "a..b",
                "a.1234567890123456789.b",
                "layers.#",
            ]
        );
        assert_eq!(t.ids, [0, 0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(t.width, 2);
        assert_eq!(&t.numbers[..4], &[3, 17, 10, 0]);
        assert_round_trip(&t, &names);
    }

    #[test]
    fn threads_merge_in_order() {
        let names: Vec<String> = (0..70_000)
            .map(|i| match i % 3 {
                0 => format!("l.{}.a", i / 7),
                1 => format!("l.{}.b.{}", i / 7, i % 5),
                _ if i > 50_000 => format!("late.{i}"),
                _ => format!("x{}", i % 4),
            })
            .collect();
        let t = key_templates(&names).unwrap();
        let one = part(&names).unwrap();
        assert_eq!(t.templates, one.templates);
        assert_eq!(t.ids, one.ids);
        assert_eq!(t.width, 2);
        assert_round_trip(&t, &names);
    }

    #[test]
    fn a_marker_in_a_name_refuses() {
        assert_eq!(key_templates(&["a.#.b"]), None);
        assert_eq!(key_templates::<&str>(&[]).unwrap().width, 0);
    }

    #[test]
    fn companion_scan_pairs_each_name_with_its_stem() {
        let names = [
            "a.w_scale_inv",
            "a.w",
            "b.w_scale_inv",
            "_scale_inv",
            "c.w",
            "c.w_scale_inv",
            "a.w",
        ];
        let scan = companion_scan(&names, &["_scale_inv"], None);
        assert_eq!(scan.hits, [0, 2, 3, 5]);
        assert_eq!(scan.pairs, [(1, 0), (4, 5)]); // "b.w" and "" are no name: hits 2 and 3 unpaired
        let none = companion_scan(&["x", "y"], &["_s"], None);
        assert_eq!((none.hits, none.pairs), (vec![], vec![]));
        // natural order: each stem just before its suffixed name (no table), and a repeated stem's first
        let scan = companion_scan(&["a", "a_s", "b", "b", "b_s", "c_s"], &["_s"], None);
        assert_eq!(
            (scan.hits, scan.pairs),
            (vec![1, 4, 5], vec![(0, 1), (2, 4)])
        );
    }

    #[test]
    fn companion_scan_pairs_only_a_lone_first_suffix() {
        let names = ["a.w", "a.w_s", "b.w_s", "b.w_s_s", "c.w_b", "ü.w", "ü.w_s"];
        let scan = companion_scan(&names[..4], &["_s", "_b"], Some(".q."));
        assert_eq!((scan.hits, scan.paired), (vec![1, 2, 3], true));
        assert_eq!(scan.pairs, [(0, 1), (2, 3)]);
        let scan = companion_scan(&names, &["_s", "_b"], None);
        assert_eq!((scan.hits, scan.paired), (vec![1, 2, 3, 4, 6], false));
        assert!(scan.pairs.is_empty());
        let scan = companion_scan(&names[5..], &["_s"], Some(".q."));
        assert_eq!((scan.paired, scan.pairs), (true, vec![(0, 1)]));
        let marked = companion_scan(&["a.w", "a.w_s", "a.weight.q.x"], &["_s"], Some(".q."));
        assert_eq!((marked.hits, marked.paired), (vec![1], false));
        assert!(companion_scan::<&str>(&[], &["_s"], Some("m")).paired);
    }
}
