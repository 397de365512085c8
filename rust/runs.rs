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
mod tests {
    use super::*;

    fn header(tensors: &[(&str, Dtype, &[u64])]) -> Arc<Header> {
        let mut json = String::from("{");
        let mut off = 0;
        for (i, (name, dt, shape)) in tensors.iter().enumerate() {
            let n: u64 = shape.iter().product::<u64>() * dt.bits() / 8;
            if i > 0 {
                json.push(',');
            }
            json.push_str(&format!(
                r#""{name}":{{"dtype":"{dt}","shape":{shape:?},"data_offsets":[{off},{}]}}"#,
                off + n
            ));
            off += n;
        }
        json.push('}');
        let mut b = (json.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(json.as_bytes());
        b.resize(b.len() + off as usize, 0);
        Arc::new(Header::parse("t.safetensors".as_ref(), &b, b.len() as u64).unwrap())
    }

    fn item(tensor: i64, lengths: &[i64], ss: &[i64], ds: &[i64]) -> Item {
        let mut it = Item {
            tensor,
            ndim: lengths.len() as i64,
            ..Item::default()
        };
        it.lengths[..lengths.len()].copy_from_slice(lengths);
        it.src_strides[..ss.len()].copy_from_slice(ss);
        it.dst_strides[..ds.len()].copy_from_slice(ds);
        it
    }

    fn message(r: Result<Vec<Run>, LoadError>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn contiguous_box_is_one_run_and_transpose_keeps_runs_long() {
        let h = header(&[("w", Dtype::F32, &[4, 8])]);
        let mut out = vec![0u8; 4 * 8 * 4];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        let runs = plan(
            std::slice::from_ref(&h),
            &dest,
            &[item(0, &[4, 8], &[8, 1], &[8, 1])],
        )
        .unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].count, 32);
        // Transposed destination: runs follow the destination's unit stride, the source is strided.
        // It is one run repeated along the source's unit stride.
        let runs = plan(&[h], &dest, &[item(0, &[4, 8], &[8, 1], &[1, 4])]).unwrap();
        assert_eq!(runs.len(), 1);
        let r = runs[0];
        assert_eq!((r.count, r.src_stride, r.dst_stride), (4, 32, 4), "{r:?}");
        assert_eq!((r.reps, r.rep_src_stride, r.rep_dst_stride), (8, 4, 16));
    }

    #[test]
    fn column_slices_are_repeated_runs() {
        let h = header(&[
            ("w", Dtype::BF16, &[6, 10]),
            ("c", Dtype::BF16, &[3, 4, 10]),
        ]);
        let files = [h.clone()];
        let mut out = vec![0u8; 4096];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        let base = dest[0].addr();
        // Columns 2..5 of every row of w into a contiguous [6, 3] f32 buffer: one run, one rep per row.
        let col = Item {
            src_base: 2,
            ..item(0, &[6, 3], &[10, 1], &[3, 1])
        };
        let runs = plan(&files, &dest, &[col]).unwrap();
        assert_eq!(runs.len(), 1);
        let r = runs[0];
        assert_eq!(r.src_off, h.data_start + 4);
        assert_eq!(
            (r.count, r.src_stride, r.dst_addr, r.dst_stride),
            (3, 2, base, 4)
        );
        assert_eq!((r.reps, r.rep_src_stride, r.rep_dst_stride), (6, 20, 12));
        assert_eq!(
            (r.run_extent(), r.src_extent(), r.needed_bytes()),
            (6, 106, 36)
        );
        assert_eq!(r.rep(5).src_off, r.src_off + 100);
        assert_eq!(r.rep(5).dst_addr, base + 60);
        // A 3-d box of c ([1..3, 0..3, 5..9]): one run per outer index, each repeated over the middle dim.
        let cube = Item {
            src_base: 40 + 5,
            ..item(1, &[2, 3, 4], &[40, 10, 1], &[12, 4, 1])
        };
        let runs = plan(&files, &dest, &[cube]).unwrap();
        assert_eq!(runs.len(), 2);
        for (i, r) in runs.iter().enumerate() {
            let tensor_start = h.data_start + h.tensors[1].begin;
            assert_eq!(r.src_off, tensor_start + (40 * (i as u64 + 1) + 5) * 2);
            assert_eq!(r.dst_addr, base + i * 48);
            assert_eq!(
                (r.count, r.reps, r.rep_src_stride, r.rep_dst_stride),
                (4, 3, 20, 16)
            );
        }
        // Overlaps between repetitions are found and name the items.
        let below = Item {
            dst_base: 15,
            ..col
        };
        let m = message(plan(&files, &dest, &[col, below]));
        assert!(
            m.contains("overlap") && m.contains("item 0") && m.contains("item 1"),
            "{m}"
        );
        let m = message(plan(&files, &dest, &[item(0, &[6, 3], &[10, 1], &[0, 1])]));
        assert!(m.contains("item 0") && m.contains("several times"), "{m}");
        let m = message(plan(&files, &dest, &[item(0, &[6, 3], &[10, 1], &[2, 1])]));
        assert!(m.contains("item 0") && m.contains("several times"), "{m}");
        // Sub-byte: every repetition must start on a byte boundary.
        let h4 = header(&[("f", Dtype::F4, &[4, 6]), ("g", Dtype::F4, &[4, 5])]);
        let mut packed = vec![0u8; 64];
        let dest4 = [DestBuf::from_mut_slice(&mut packed, Dtype::F4)];
        let ok = Item {
            src_base: 2,
            ..item(0, &[4, 2], &[6, 1], &[2, 1])
        };
        let runs = plan(std::slice::from_ref(&h4), &dest4, &[ok]).unwrap();
        assert_eq!(
            (runs.len(), runs[0].reps, runs[0].rep_src_stride),
            (1, 4, 3)
        );
        let odd_rows = item(1, &[4, 2], &[5, 1], &[2, 1]);
        let m = message(plan(std::slice::from_ref(&h4), &dest4, &[odd_rows]));
        assert!(
            m.contains("byte boundaries") && m.contains("from element 5 into element 2"),
            "{m}"
        );
    }

    #[test]
    fn rejects_bad_requests() {
        let h = header(&[
            ("w", Dtype::F32, &[4, 8]),
            ("i", Dtype::I32, &[2]),
            ("f", Dtype::F4, &[8]),
        ]);
        let files = [h];
        let mut out = vec![0u8; 128];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        let m = message(plan(&files, &dest, &[item(0, &[5, 8], &[8, 1], &[8, 1])]));
        assert!(
            m.contains("tensor 'w'")
                && m.contains("reaches element 39")
                && m.contains("32 elements"),
            "{m}"
        );
        let m = message(plan(&files, &dest, &[item(1, &[2], &[1], &[1])]));
        assert!(m.contains("cannot convert I32 to F32"), "{m}");
        let m = message(plan(
            &files,
            &dest,
            &[
                item(0, &[4, 8], &[8, 1], &[8, 1]),
                item(0, &[1], &[1], &[1]),
            ],
        ));
        assert!(
            m.contains("overlap") && m.contains("item 0") && m.contains("item 1"),
            "{m}"
        );
        let m = message(plan(&files, &dest, &[item(0, &[2], &[1], &[0])]));
        assert!(m.contains("several times"), "{m}");
        let m = message(plan(&files, &dest, &[item(0, &[-1], &[1], &[1])]));
        assert!(m.contains("non-negative"), "{m}");
        let m = message(plan(
            &files,
            &dest,
            &[Item {
                file: 1,
                ..item(0, &[1], &[1], &[1])
            }],
        ));
        assert!(m.contains("file index 1 is out of range"), "{m}");
        let m = message(plan(&files, &dest, &[item(3, &[1], &[1], &[1])]));
        assert!(m.contains("tensor index 3"), "{m}");
        let m = message(plan(
            &files,
            &dest,
            &[Item {
                dst_base: 30,
                ..item(0, &[4], &[1], &[1])
            }],
        ));
        assert!(
            m.contains("has 128 bytes but the box writes up to byte 136"),
            "{m}"
        );
        let mut packed = vec![0u8; 4];
        let dest4 = [DestBuf::from_mut_slice(&mut packed, Dtype::F4)];
        assert!(plan(&files, &dest4, &[item(2, &[8], &[1], &[1])]).is_ok());
        let m = message(plan(&files, &dest4, &[item(2, &[3], &[1], &[1])]));
        assert!(m.contains("byte boundaries"), "{m}");
    }

    #[test]
    fn interleaved_strided_destinations_are_not_overlaps() {
        let h = header(&[("w", Dtype::U8, &[8])]);
        let mut out = vec![0u8; 32];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
        let even = item(0, &[8], &[1], &[2]);
        let odd = Item {
            dst_base: 1,
            ..even
        };
        assert!(plan(std::slice::from_ref(&h), &dest, &[even, odd]).is_ok());
        let clash = Item {
            dst_base: 2,
            ..even
        };
        assert!(message(plan(&[h], &dest, &[even, clash])).contains("overlap"));
    }

    #[test]
    fn item_level_proof_covers_common_layouts() {
        let mut out = vec![0u8; 4 * 8 * 4];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        // Two row blocks side by side, a transposed block, a column slice into a padded buffer.
        let top = item(0, &[2, 8], &[8, 1], &[8, 1]);
        let bottom = Item {
            src_base: 16,
            dst_base: 16,
            ..top
        };
        assert!(items_disjoint(&[top, bottom], &dest));
        assert!(items_disjoint(&[item(0, &[4, 8], &[8, 1], &[1, 4])], &dest));
        assert!(items_disjoint(&[item(0, &[4, 2], &[8, 1], &[3, 1])], &dest));
        // Not proven (the run check decides): interleaved items, a zero stride, overlapping blocks.
        let even = item(0, &[16], &[1], &[2]);
        assert!(!items_disjoint(
            &[
                even,
                Item {
                    dst_base: 1,
                    ..even
                }
            ],
            &dest
        ));
        assert!(!items_disjoint(&[item(0, &[2], &[1], &[0])], &dest));
        assert!(!items_disjoint(
            &[
                top,
                Item {
                    dst_base: 15,
                    ..top
                }
            ],
            &dest
        ));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]
        /// Soundness: whenever the item-level proof says "disjoint", the exhaustive run check agrees.
        #[test]
        fn item_level_proof_is_sound(
            boxes in proptest::collection::vec(
                (proptest::collection::vec((1i64..4, 0i64..7), 1..=3), 0i64..20), 1..=3),
        ) {
            let h = header(&[("w", Dtype::U8, &[64])]);
            let mut out = vec![0u8; 256];
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
            let items: Vec<Item> = boxes
                .iter()
                .map(|(dims, base)| {
                    let lengths: Vec<i64> = dims.iter().map(|d| d.0).collect();
                    let ds: Vec<i64> = dims.iter().map(|d| d.1).collect();
                    Item { dst_base: *base, ..item(0, &lengths, &vec![0; lengths.len()], &ds) }
                })
                .collect();
            let runs = plan(std::slice::from_ref(&h), &dest, &items);
            if items_disjoint(&items, &dest) {
                proptest::prop_assert!(runs.is_ok(), "{:?}", runs);
                let runs = runs.unwrap();
                proptest::prop_assert!(check_disjoint(&runs, &items, &dest).is_ok());
            }
        }
    }

    #[test]
    fn split_keeps_elements() {
        let h = header(&[("w", Dtype::BF16, &[100])]);
        let mut out = vec![0u8; 400];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        let runs = plan(&[h], &dest, &[item(0, &[50], &[2], &[1])]).unwrap();
        let mut pieces = Vec::new();
        runs[0].split(10, &mut pieces);
        assert_eq!(pieces.iter().map(|p| p.count).sum::<u64>(), 50);
        assert!(pieces.iter().all(|p| p.src_extent() <= 10));
        for w in pieces.windows(2) {
            assert_eq!(w[1].src_off, w[0].src_off + w[0].count * 4);
            assert_eq!(w[1].dst_addr, w[0].dst_addr + w[0].count as usize * 4);
        }
    }

    /// Every (source, destination) element pair of a run, repetitions expanded, in order.
    fn elements(r: &Run) -> Vec<(u64, usize)> {
        let (ss, ds) = (r.src_stride.max(1), r.dst_stride.max(1));
        (0..r.reps)
            .flat_map(|k| {
                let p = r.rep(k);
                (0..p.count).map(move |i| (p.src_off + i * ss, p.dst_addr + i as usize * ds))
            })
            .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 400, ..Default::default() })]
        /// Splitting a repeated run keeps every element exactly once, in order, and every piece within
        /// the limit unless it is a single element.
        #[test]
        fn split_of_repeated_runs_keeps_elements(
            rows in 1i64..9,
            cols in 1i64..9,
            row_len in 9i64..20,
            col_step in 1i64..3,
            max_extent in 1u64..200,
        ) {
            let h = header(&[("w", Dtype::BF16, &[8, 40])]);
            let mut out = vec![0u8; 8 * 20 * 4];
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
            let it = item(0, &[rows, cols], &[40, col_step], &[row_len, 1]);
            let runs = plan(&[h], &dest, &[it]).unwrap();
            proptest::prop_assert_eq!(runs.len(), 1);
            let run = runs[0];
            proptest::prop_assert_eq!(run.reps, if cols > 1 { rows as u64 } else { 1 });
            let mut pieces = Vec::new();
            run.split(max_extent, &mut pieces);
            let want = elements(&run);
            let got: Vec<(u64, usize)> = pieces.iter().flat_map(elements).collect();
            proptest::prop_assert_eq!(got, want);
            for p in &pieces {
                proptest::prop_assert!(p.reps >= 1 && p.count >= 1);
                proptest::prop_assert!(
                    p.src_extent() <= max_extent || (p.reps == 1 && p.count == 1),
                    "{:?} over {}", p, max_extent
                );
                proptest::prop_assert_eq!(p.needed_bytes(), p.reps * p.run_extent());
            }
            // Splitting repetitions apart keeps the bytes needed; splitting one apart drops its stride gaps.
            let needed: u64 = pieces.iter().map(Run::needed_bytes).sum();
            if pieces.iter().all(|p| p.count == run.count) {
                proptest::prop_assert_eq!(needed, run.needed_bytes());
            } else {
                proptest::prop_assert!(needed <= run.needed_bytes());
            }
        }
    }
}
