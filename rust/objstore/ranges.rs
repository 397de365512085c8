//! Which bytes a batch fetches: needed ranges coalesced into requests ([`coalesce_all`]), the direct runs'
//! repetitions as [`Segment`]s, and each request's staged parts and segments ([`route`]).

use super::*;

/// One repetition of a direct run as the object bytes it reads: repetition `rep` of `direct[run]` reads
/// `start..end` (and writes them, in order, from the start of its destination).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Segment {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) run: usize,
    pub(super) rep: u64,
}

/// Sorted, coalesced, non-empty ranges of one object: [`coalesce_all`] of one file.
pub fn coalesce(ranges: &[(u64, u64)], piece: u64) -> Vec<Range<u64>> {
    coalesce_all(&[ranges.to_vec()], piece)
        .pop()
        .unwrap_or_default()
}

/// Per object, its sorted needed ranges as requests: touching and overlapping ranges joined; then, over the
/// whole call, the gaps of at most [`COALESCE_GAP`] joined smallest first while the bytes fetched for gaps
/// stay within `1/COALESCE_SLACK` of the bytes needed (each joined gap is one request fewer, so this is the
/// fewest requests for that many extra bytes: a column shard's thousands of row halves become one request
/// when the call also reads enough contiguous bytes to pay for them); then cut at the multiples of `piece`
/// (object offsets), so no request is longer than `piece` or straddles a `piece` boundary.
pub fn coalesce_all(needed: &[Vec<(u64, u64)>], piece: u64) -> Vec<Vec<Range<u64>>> {
    let mut merged: Vec<Vec<(u64, u64)>> = Vec::with_capacity(needed.len());
    let mut total: u64 = 0;
    for ranges in needed {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &(a, b) in ranges.iter().filter(|(a, b)| b > a) {
            match out.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        total += out.iter().map(|(a, b)| b - a).sum::<u64>();
        merged.push(out);
    }
    // (gap bytes, file, index of the range after the gap)
    let mut gaps: Vec<(u64, usize, usize)> = Vec::new();
    for (f, ranges) in merged.iter().enumerate() {
        for k in 1..ranges.len() {
            let gap = ranges[k].0 - ranges[k - 1].1;
            if gap <= COALESCE_GAP {
                gaps.push((gap, f, k));
            }
        }
    }
    gaps.sort_unstable();
    let budget = total / COALESCE_SLACK;
    let mut spent = 0u64;
    let mut join: Vec<Vec<bool>> = merged.iter().map(|r| vec![false; r.len()]).collect();
    for (gap, f, k) in gaps {
        if spent + gap > budget {
            break;
        }
        spent += gap;
        join[f][k] = true;
    }
    merged
        .iter()
        .zip(&join)
        .map(|(ranges, join)| {
            let mut requests: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
            for (&(a, b), &joined) in ranges.iter().zip(join) {
                match requests.last_mut() {
                    Some(last) if joined => last.1 = b,
                    _ => requests.push((a, b)),
                }
            }
            let piece = piece.max(1);
            let mut out = Vec::with_capacity(requests.len());
            for (a, b) in requests {
                let mut at = a;
                while at < b {
                    // Cut at multiples of `piece` in the object, not `piece` after the range's start: a
                    // store keeps an object in parts (SeaweedFS: 4 MiB chunks; S3: the multipart upload's
                    // parts, 8 MiB by default in the AWS tools), and a request that straddles one boundary
                    // more costs the server one more part read (docs/perf-notes.md, "Object storage").
                    let end = b.min((at / piece).saturating_add(1).saturating_mul(piece));
                    out.push(at..end);
                    at = end;
                }
            }
            out
        })
        .collect()
}

/// Sorted, merged (touching or overlapping joined) copy of `ranges`.
pub(super) fn merged(ranges: &[(u64, u64)]) -> Vec<Range<u64>> {
    let mut sorted: Vec<(u64, u64)> = ranges.iter().copied().filter(|(a, b)| b > a).collect();
    sorted.sort_unstable();
    let mut out: Vec<Range<u64>> = Vec::with_capacity(sorted.len());
    for (a, b) in sorted {
        match out.last_mut() {
            Some(last) if a <= last.end => last.end = last.end.max(b),
            _ => out.push(a..b),
        }
    }
    out
}

/// Per file, the repetitions of the `direct` runs as [`Segment`]s sorted by start.
pub(super) fn segments_of(direct: &[Run], files: usize) -> Vec<Vec<Segment>> {
    let mut out: Vec<Vec<Segment>> = vec![Vec::new(); files];
    for (k, r) in direct.iter().enumerate() {
        let extent = r.run_extent();
        for rep in 0..r.reps {
            let start = r.src_off + rep * r.rep_src_stride;
            out[r.file].push(Segment {
                start,
                end: start + extent,
                run: k,
                rep,
            });
        }
    }
    for segs in &mut out {
        segs.sort_unstable_by_key(|s| (s.start, s.end));
    }
    out
}

/// For each of the sorted, disjoint `requests`: the parts of the sorted, disjoint `staged` ranges inside it,
/// and the indices of the `segments` (sorted by start) that meet it, in order.
pub(super) fn route(
    requests: &[Range<u64>],
    staged: &[Range<u64>],
    segments: &[Segment],
) -> Vec<(Vec<Range<u64>>, Vec<usize>)> {
    let mut out: Vec<(Vec<Range<u64>>, Vec<usize>)> =
        vec![(Vec::new(), Vec::new()); requests.len()];
    let first_ending_after = |at: u64| requests.partition_point(|q| q.end <= at);
    for r in staged {
        for (q, slot) in requests[first_ending_after(r.start)..]
            .iter()
            .zip(&mut out[first_ending_after(r.start)..])
            .take_while(|(q, _)| q.start < r.end)
        {
            slot.0.push(r.start.max(q.start)..r.end.min(q.end));
        }
    }
    for (k, s) in segments.iter().enumerate() {
        let from = first_ending_after(s.start);
        for (q, slot) in requests[from..].iter().zip(&mut out[from..]) {
            if q.start >= s.end {
                break;
            }
            slot.1.push(k);
        }
    }
    out
}
