//! Natural order: the compact sort keys computed with each parse and their merge across the shards of a
//! checkpoint ([`natural_order_of`]), equal to Python's `natural_sort_key` order.

use super::*;

/// The largest number of digits `natural_sort_key` (in `hp_fastload.natural`) pads to: longer numbers compare
/// as text there.
pub(super) const NATURAL_DIGITS: usize = 24;

/// A compact key that sorts exactly like Python's `natural_sort_key` (a number is its digit count, then its
/// digits without leading zeros, instead of 24 padded characters), or `None` when the two could disagree: a
/// non-ASCII name, a control character (the markers are control characters) or a number of more than
/// [`NATURAL_DIGITS`] digits. Keys a third as long make sorting 90k names about twice as fast.
pub(super) fn natural_order_key(name: &str, out: &mut Vec<u8>) -> bool {
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
pub(super) struct NaturalKeys {
    buf: Vec<u8>,
    sorted: Vec<(u32, u32, u32)>,
    other: Vec<u32>,
}

impl NaturalKeys {
    pub(super) fn of<T>(items: &[T], name: impl Fn(&T) -> &str) -> NaturalKeys {
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
