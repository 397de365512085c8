//! Read requests ([`Item`]s) → validated runs.
//!
//! An item asks for a strided box of one tensor to be written into a strided box of one destination buffer.
//! [`plan`] checks every item before anything is read (indices, non-negative lengths and strides, source
//! elements inside the tensor, destination bytes inside the buffer, the cast, sub-byte alignment, and that
//! no two destination bytes are written twice), then turns each item into runs: dimensions that are
//! contiguous on both sides are merged, one dimension becomes the run (the one with unit destination
//! stride when there is one, so a transposed block gives runs with a strided source, never 1-element
//! runs), the innermost of the others becomes the run's repetition (a column slice of a matrix is one
//! [`Run`] with one repetition per row), and the rest are iterated. A dequantized `U8` item is MXFP4: it
//! addresses 4-bit elements (two a byte, low nibble first), split into boxes whose elements are all the same
//! nibble of their bytes (`nibble_runs`). It owns no I/O and no pointers.
//!
//! The data it works on ([`Item`], [`Run`]) lives in `crate::types`.

use std::sync::Arc;

use crate::dest::DestBuf;
use crate::dtype::Dtype;
use crate::error::LoadError;
use crate::header::Header;
use crate::overlap::Overlap;
use crate::types::{Item, Run, MAX_NDIM};

fn request(h: &Header, tensor: Option<usize>, reason: String) -> LoadError {
    LoadError::Request {
        path: Some(h.path.clone()),
        tensor: tensor
            .and_then(|t| h.tensors.get(t))
            .map(|t| t.name.clone()),
        reason,
    }
}

fn index(value: i64, len: usize, what: &str, k: usize) -> Result<usize, LoadError> {
    usize::try_from(value)
        .ok()
        .filter(|&v| v < len)
        .ok_or_else(|| {
            LoadError::request(format!(
                "item {k}: {what} index {value} is out of range (0..{len})"
            ))
        })
}

/// Validates every item and turns them into runs. Nothing is read; the destination pointers are only
/// computed. Errors name the item, the file, the tensor and the numbers.
pub fn plan(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
) -> Result<Vec<Run>, LoadError> {
    plan_oriented(files, dests, items, false)
}

/// [`plan`] for the write direction ([`crate::exec::execute_write`]): the same checks, but each run is
/// taken along the dimension that is contiguous in the file when there is one (then the one contiguous in
/// memory), so that one repetition is one positioned write of adjacent file bytes.
pub fn plan_file_major(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
) -> Result<Vec<Run>, LoadError> {
    plan_oriented(files, dests, items, true)
}

fn plan_oriented(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    file_major: bool,
) -> Result<Vec<Run>, LoadError> {
    // Plan items in (file, first source element) order so that the runs of a batch whose items each read
    // forward come out already sorted by file offset, and the executor can skip its sort.
    let mut order: Vec<(i64, i64, usize)> = items
        .iter()
        .enumerate()
        .map(|(k, it)| {
            let begin = usize::try_from(it.file)
                .ok()
                .and_then(|f| files.get(f))
                .zip(usize::try_from(it.tensor).ok())
                .and_then(|(h, t)| h.tensors.get(t))
                .map_or(0, |t| t.begin as i64);
            (it.file, begin.saturating_add(it.src_base), k)
        })
        .collect();
    order.sort_unstable();
    let mut runs = Vec::new();
    for &(_, _, k) in &order {
        plan_item(k, &items[k], files, dests, file_major, &mut runs)?;
    }
    if !items_disjoint(items, dests) {
        check_disjoint(&runs, items, dests)?;
    }
    Ok(runs)
}

/// Proves at item level, without looking at runs, that no destination byte is written twice: every item's
/// destination box is injective (each dimension's stride steps over everything the inner dimensions reach)
/// and the items' destination byte intervals do not overlap. `false` means "not proven": the caller then
/// checks run by run, which also names the culprits. Items were validated by [`plan_item`] (bounds fit).
fn items_disjoint(items: &[Item], dests: &[DestBuf<'_>]) -> bool {
    let mut spans: Vec<(u128, u128)> = Vec::with_capacity(items.len());
    for item in items {
        let ndim = item.ndim as usize;
        let (lengths, ds) = (&item.lengths[..ndim], &item.dst_strides[..ndim]);
        if lengths.contains(&0) {
            continue;
        }
        let mut dims: Vec<(u128, u128)> = lengths
            .iter()
            .zip(ds)
            .filter(|(&l, _)| l > 1)
            .map(|(&l, &s)| (s as u128, l as u128))
            .collect();
        dims.sort_unstable();
        let mut reach: u128 = 0; // last element offset reached by the dims seen so far
        for (stride, len) in dims {
            if stride <= reach {
                return false;
            }
            reach += (len - 1) * stride;
        }
        let dest = &dests[item.dest as usize];
        let bits = u128::from(dest.dtype().bits());
        let base = item.dst_base as u128;
        let addr = dest.addr() as u128;
        spans.push((
            addr + base * bits / 8,
            addr + ((base + reach + 1) * bits).div_ceil(8),
        ));
    }
    spans.sort_unstable();
    spans.windows(2).all(|w| w[0].1 <= w[1].0)
}

fn plan_item(
    k: usize,
    item: &Item,
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    file_major: bool,
    runs: &mut Vec<Run>,
) -> Result<(), LoadError> {
    let fi = index(item.file, files.len(), "file", k)?;
    let h = &files[fi];
    let ti = index(item.tensor, h.tensors.len(), "tensor", k)?;
    let tensor = &h.tensors[ti];
    let di = index(item.dest, dests.len(), "destination", k)?;
    let dest = &dests[di];
    let err = |reason: String| request(h, Some(ti), format!("item {k}: {reason}"));
    // A dequantized U8 tensor is MXFP4: two e2m1 elements a byte, low nibble first; the item addresses
    // those 4-bit elements (the executor checked the scale, `exec::item_scales`).
    let packed = item.scale != 0 && tensor.dtype == Dtype::U8;
    let (sd, dd) = match packed {
        true => (Dtype::F4, dest.dtype()),
        false => (tensor.dtype, dest.dtype()),
    };
    if !packed && !sd.can_cast_to(dd) {
        return Err(err(format!(
            "cannot convert {sd} to {dd} (only floating types convert to each other)"
        )));
    }
    let ndim = usize::try_from(item.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| err(format!("ndim {} is outside 0..={MAX_NDIM}", item.ndim)))?;
    let (lengths, ss, ds) = (
        &item.lengths[..ndim],
        &item.src_strides[..ndim],
        &item.dst_strides[..ndim],
    );
    for d in 0..ndim {
        if lengths[d] < 0 || ss[d] < 0 || ds[d] < 0 {
            return Err(err(format!(
                "dim {d}: length {}, source stride {} and destination stride {} must be non-negative",
                lengths[d], ss[d], ds[d]
            )));
        }
    }
    if item.src_base < 0 || item.dst_base < 0 {
        return Err(err(format!(
            "source base {} and destination base {} must be non-negative",
            item.src_base, item.dst_base
        )));
    }
    if lengths.contains(&0) {
        return Ok(());
    }
    let last = |base: i64, strides: &[i64]| -> u128 {
        lengths
            .iter()
            .zip(strides)
            .fold(base as u128, |acc, (&l, &s)| {
                acc + (l as u128 - 1) * s as u128
            })
    };
    let numel = u128::from(tensor.numel()) << u32::from(packed);
    let src_last = last(item.src_base, ss);
    if src_last >= numel {
        return Err(err(format!(
            "box reaches element {src_last} but the tensor has {numel} elements (shape {:?}, box {lengths:?} \
             from element {})",
            tensor.shape, item.src_base
        )));
    }
    let dst_last = last(item.dst_base, ds);
    let dst_end_bytes = ((dst_last + 1) * u128::from(dd.bits())).div_ceil(8);
    if dst_end_bytes > dest.nbytes() as u128 {
        return Err(err(format!(
            "destination {di} has {} bytes but the box writes up to byte {dst_end_bytes} (element {dst_last} \
             of {dd})",
            dest.nbytes()
        )));
    }
    // From here on every offset fits: the last source element is inside the tensor, the last destination
    // byte inside the buffer.
    let mut dims: Vec<(u64, u64, u64)> = Vec::with_capacity(ndim);
    for d in 0..ndim {
        let dim = (lengths[d] as u64, ss[d] as u64, ds[d] as u64);
        if dim.0 == 1 {
            continue;
        }
        match dims.last_mut() {
            Some(outer) if outer.1 == dim.0 * dim.1 && outer.2 == dim.0 * dim.2 => {
                *outer = (outer.0 * dim.0, dim.1, dim.2);
            }
            _ => dims.push(dim),
        }
    }
    if packed {
        let at = NibbleItem {
            item: k,
            file: fi,
            data_start: h.data_start + tensor.begin,
            dst_addr: dest.addr(),
            dst_size: dd.bits() / 8,
            dst_dtype: dd,
        };
        nibble_runs(&at, &dims, item.src_base as u64, item.dst_base as u64, runs);
        return Ok(());
    }
    // The run dimension: unit stride on the side that is written (memory for a read, the file for a
    // write), else unit stride on the other side, else the innermost.
    let unit_on = |side: usize| dims.iter().rposition(|d| [d.1, d.2][side] == 1);
    let (first, second) = if file_major { (0, 1) } else { (1, 0) };
    let run_dim = unit_on(first)
        .or_else(|| unit_on(second))
        .or(dims.len().checked_sub(1));
    let (count, run_ss, run_ds) = match run_dim {
        Some(r) => dims.remove(r),
        None => (1, 1, 1),
    };
    // The innermost remaining dim becomes the repetition dim; the odometer runs over the others.
    let (reps, rep_ss, rep_ds) = dims.pop().unwrap_or((1, 0, 0));
    let sub_byte = sd.is_sub_byte();
    if sub_byte && count > 1 && (run_ss != 1 || run_ds != 1) {
        return Err(err(format!(
            "{sd} has elements smaller than a byte and can only be read in dense runs (strides {run_ss} and \
             {run_ds})"
        )));
    }
    let (sbits, dbits) = (sd.bits(), dd.bits());
    // Sub-byte runs must start and end on byte boundaries in every repetition: repetition 0 does when its
    // start and length do, and then every later one does when repetition 1 does (the strides are even).
    let misaligned = |se: u64, de: u64| {
        !(se * sbits).is_multiple_of(8)
            || !(de * dbits).is_multiple_of(8)
            || (count * sbits) % 8 != 0
    };
    let data_start = h.data_start + tensor.begin;
    let mut idx = vec![0u64; dims.len()];
    loop {
        let (mut se, mut de) = (item.src_base as u64, item.dst_base as u64);
        for (i, &(_, s, d)) in idx.iter().zip(&dims) {
            se += i * s;
            de += i * d;
        }
        if sub_byte {
            let bad = match () {
                _ if misaligned(se, de) => Some(0),
                _ if reps > 1 && misaligned(se + rep_ss, de + rep_ds) => Some(1),
                _ => None,
            };
            if let Some(r) = bad {
                let (se, de) = (se + r * rep_ss, de + r * rep_ds);
                return Err(err(format!(
                    "{sd} has elements smaller than a byte and can only be read in whole bytes: a run of \
                     {count} elements from element {se} into element {de} does not start and end on byte \
                     boundaries"
                )));
            }
        }
        runs.push(Run {
            item: k,
            file: fi,
            src_off: data_start + se * sbits / 8,
            src_stride: run_ss * sbits / 8,
            count,
            dst_addr: dest.addr() + (de * dbits / 8) as usize,
            dst_stride: (run_ds * dbits / 8) as usize,
            reps,
            rep_src_stride: rep_ss * sbits / 8,
            rep_dst_stride: (rep_ds * dbits / 8) as usize,
            src_dtype: sd,
            dst_dtype: dd,
            src_nibble: 0,
        });
        // Odometer over the remaining dims, innermost fastest.
        let mut d = dims.len();
        loop {
            if d == 0 {
                return Ok(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < dims[d].0 {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Where the nibble runs of one packed 4-bit item go (see [`nibble_runs`]).
struct NibbleItem {
    item: usize,
    file: usize,
    data_start: u64,
    dst_addr: usize,
    dst_size: u64,
    dst_dtype: Dtype,
}

/// The runs of a validated box of 4-bit elements (`dims`: merged (length, source stride, destination
/// stride) in elements, the first element at `se` / `de`). A dim with an odd source stride is split in two
/// by the parity of its index (even and odd indices, each with twice the strides), until every stride is
/// even: then all elements of the box are the same nibble of their bytes, and byte strides address them.
/// At most 2^ndim boxes; the destination elements are the item's, each once (the overlap check is the
/// item's).
fn nibble_runs(at: &NibbleItem, dims: &[(u64, u64, u64)], se: u64, de: u64, runs: &mut Vec<Run>) {
    if let Some(d) = dims.iter().position(|&(l, s, _)| l > 1 && s % 2 == 1) {
        let (l, s, ds) = dims[d];
        let mut half = dims.to_vec();
        half[d] = (l.div_ceil(2), 2 * s, 2 * ds);
        nibble_runs(at, &half, se, de, runs);
        half[d] = (l / 2, 2 * s, 2 * ds);
        nibble_runs(at, &half, se + s, de + ds, runs);
        return;
    }
    let mut dims: Vec<(u64, u64, u64)> = dims.iter().copied().filter(|d| d.0 > 1).collect();
    let run_dim = dims
        .iter()
        .rposition(|d| d.2 == 1)
        .or(dims.len().checked_sub(1));
    let (count, run_ss, run_ds) = run_dim.map_or((1, 0, 1), |r| dims.remove(r));
    let (reps, rep_ss, rep_ds) = dims.pop().unwrap_or((1, 0, 0));
    let mut idx = vec![0u64; dims.len()];
    loop {
        let (mut pse, mut pde) = (se, de);
        for (i, &(_, s, d)) in idx.iter().zip(&dims) {
            pse += i * s;
            pde += i * d;
        }
        runs.push(Run {
            item: at.item,
            file: at.file,
            src_off: at.data_start + pse / 2,
            src_stride: run_ss / 2,
            count,
            dst_addr: at.dst_addr + (pde * at.dst_size) as usize,
            dst_stride: (run_ds * at.dst_size) as usize,
            reps,
            rep_src_stride: rep_ss / 2,
            rep_dst_stride: (rep_ds * at.dst_size) as usize,
            src_dtype: Dtype::F4,
            dst_dtype: at.dst_dtype,
            src_nibble: 1 + (pse % 2) as u8,
        });
        let mut d = dims.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < dims[d].0 {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The most destination elements expanded one by one to check strided runs for overlap.
const MAX_EXPANDED: u64 = 1 << 26;

/// Fails if two runs (or two repetitions of one run) write the same destination byte (this check only runs
/// when the item-level proof fails). Decided on the runs' descriptors by [`crate::overlap::check`], exactly
/// and without expanding anything; only when its work budget runs out, by [`check_disjoint_expanded`].
fn check_disjoint(runs: &[Run], items: &[Item], dests: &[DestBuf<'_>]) -> Result<(), LoadError> {
    match crate::overlap::check(runs) {
        Overlap::Disjoint => Ok(()),
        Overlap::Clash(a, b) => Err(overlap_error(&runs[a], &runs[b], items, dests)),
        Overlap::Undecided => check_disjoint_expanded(runs, items, dests),
    }
}

/// [`check_disjoint`] by expansion: repeated runs become their repetitions; dense runs are intervals;
/// strided runs are compared by bounding interval first and, only when that is inconclusive, element by
/// element (at most [`MAX_EXPANDED`] elements).
fn check_disjoint_expanded(
    runs: &[Run],
    items: &[Item],
    dests: &[DestBuf<'_>],
) -> Result<(), LoadError> {
    let flat: Vec<Run>;
    let runs = if runs.iter().any(|r| r.reps > 1) {
        let mut all = Vec::with_capacity(runs.iter().map(|r| r.reps as usize).sum());
        for r in runs {
            r.expand(&mut all);
        }
        flat = all;
        &flat[..]
    } else {
        runs
    };
    let interval = |r: &Run| -> (usize, usize, bool) {
        if r.dst_is_dense() {
            (r.dst_addr, r.dst_addr + r.dst_bytes(), false)
        } else {
            let end = r.dst_addr + (r.count as usize - 1) * r.dst_stride + r.dst_elem_size();
            (r.dst_addr, end, true)
        }
    };
    for r in runs {
        if !r.dst_is_dense() && r.dst_stride == 0 {
            return Err(overlap_error(r, r, items, dests));
        }
    }
    let mut order: Vec<(usize, usize, bool, usize)> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let (a, b, s) = interval(r);
            (a, b, s, i)
        })
        .collect();
    order.sort_unstable();
    let mut needs_exact = false;
    let mut reach: Option<(usize, bool, usize)> = None; // (end, strided, run)
    for &(start, end, strided, i) in &order {
        if start == end {
            continue;
        }
        if let Some((max_end, max_strided, j)) = reach {
            if start < max_end {
                if !strided && !max_strided {
                    return Err(overlap_error(&runs[j], &runs[i], items, dests));
                }
                needs_exact = true;
            }
            if end > max_end {
                reach = Some((end, strided, i));
            }
        } else {
            reach = Some((end, strided, i));
        }
    }
    if !needs_exact {
        return Ok(());
    }
    let expanded: u64 = runs
        .iter()
        .filter(|r| !r.dst_is_dense())
        .map(|r| r.count)
        .sum();
    if expanded > MAX_EXPANDED {
        return Err(LoadError::request(format!(
            "cannot check {expanded} strided destination elements for overlap (limit {MAX_EXPANDED}); use \
             destinations with a unit-stride dimension"
        )));
    }
    let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        if r.dst_is_dense() {
            pieces.push((r.dst_addr, r.dst_addr + r.dst_bytes(), i));
        } else {
            let size = r.dst_elem_size();
            pieces.extend((0..r.count as usize).map(|e| {
                let a = r.dst_addr + e * r.dst_stride;
                (a, a + size, i)
            }));
        }
    }
    pieces.sort_unstable();
    let mut reach: Option<(usize, usize)> = None;
    for &(start, end, i) in &pieces {
        if start == end {
            continue;
        }
        if let Some((max_end, j)) = reach {
            if start < max_end {
                return Err(overlap_error(&runs[j], &runs[i], items, dests));
            }
        }
        if reach.is_none_or(|(max_end, _)| end > max_end) {
            reach = Some((end, i));
        }
    }
    Ok(())
}

fn overlap_error(a: &Run, b: &Run, items: &[Item], dests: &[DestBuf<'_>]) -> LoadError {
    let describe = |r: &Run| {
        let dest = items[r.item].dest as usize;
        let start = r.dst_addr - dests[dest].addr();
        let end = if r.dst_is_dense() {
            start + r.dst_bytes()
        } else {
            start + (r.count as usize - 1) * r.dst_stride + r.dst_elem_size()
        };
        format!("item {} (destination {dest}, bytes {start}..{end})", r.item)
    };
    if a.item == b.item {
        return LoadError::request(format!(
            "{} writes some destination elements several times (a view with a zero or overlapping stride \
             cannot be a destination)",
            describe(a)
        ));
    }
    LoadError::request(format!(
        "destination ranges overlap: {} and {} write the same bytes",
        describe(a),
        describe(b)
    ))
}

#[cfg(test)]
mod tests;
