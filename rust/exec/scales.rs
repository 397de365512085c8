//! Dequantization scales: the public [`Scale`] description, its validation against its tensor and against
//! the items that use it, the reading of only the grid rows those items touch, and the per-run choice
//! between a plain and a scaled copy.

use std::sync::{Arc, Mutex};

use super::workers::run_workers;
use super::Interrupt;
use crate::dest::{write_run, write_run_scaled, DestBuf};
use crate::dtype::Dtype;
use crate::error::LoadError;
use crate::header::Header;
use crate::kernels::{
    can_dequantize, decode_scales_into, is_scale_dtype, CellWindow, ScaleMap, ScaleValues,
};
use crate::mmap::{open_regular, read_exact_at, Mapping};
use crate::types::{Item, Run, MAX_NDIM};

mod check;

pub(super) use check::check_scale;

/// The scales of one quantized tensor, for items with [`Item::scale`] set: tensor `tensor` of file `file`
/// holds one scale per block of `block` elements of the quantized tensor, whose storage shape is `shape`
/// (`ndim` dims; the grid is `ceil(shape / block)`, row-major; ragged last blocks are real). Scale dtypes:
/// F32, BF16, F16, F8_E8M0, or U8 holding e8m0 exponents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scale {
    /// Index into the `files` given to [`execute_scaled`](crate::execute_scaled).
    pub file: i64,
    /// Index into that file's tensors.
    pub tensor: i64,
    /// Dims of the quantized tensor.
    pub ndim: i64,
    /// The quantized tensor's shape.
    pub shape: [i64; MAX_NDIM],
    /// The block shape, per dim (at least 1).
    pub block: [i64; MAX_NDIM],
}

/// The values of a scale's window as a batch keeps them ([`ScaleValues`]): decoded to `f32`, or the e8m0 bytes
/// of an MXFP4 scale as they are: copied, or (`Mapped`: a window of whole grid rows of a mapped file) the
/// `len` bytes at `start` of the map, which drops its page-table entries for them again once the batch is
/// done with them ([`Mapping::done_with`]).
enum Kept {
    F32(Vec<f32>),
    E8m0(Vec<u8>),
    Mapped {
        map: Arc<Mapping>,
        start: usize,
        len: usize,
    },
}

impl Drop for Kept {
    fn drop(&mut self) {
        if let Kept::Mapped { map, start, len } = self {
            map.done_with(*start as u64, (*start + *len) as u64);
        }
    }
}

/// A validated [`Scale`] with the grid's strides and, once [`read_scale_cells`] ran, the values of the window of
/// cells the batch's items touch ([`ScaleCells::window`]; no other cell is ever looked up).
pub(super) struct LoadedScale {
    values: Kept,
    window: CellWindow,
    ndim: usize,
    shape: [u64; MAX_NDIM],
    block: [u64; MAX_NDIM],
    grid_strides: [u64; MAX_NDIM],
    /// Grid cells (the scale tensor's elements).
    cells: u64,
    /// The scale tensor: its file and its index there.
    file: usize,
    tensor: usize,
    /// Bytes read from the file.
    pub(super) bytes: u64,
    /// Whether MXFP4 nibbles use it ([`item_scales`]): its e8m0 byte 0xff then decodes as 2^128.
    mxfp4: bool,
}

impl LoadedScale {
    fn map(&self) -> ScaleMap<'_> {
        ScaleMap {
            values: match &self.values {
                Kept::F32(v) => ScaleValues::F32(v),
                Kept::E8m0(b) => ScaleValues::E8m0(b),
                Kept::Mapped { map, start, len } => {
                    ScaleValues::E8m0(&map.bytes()[*start..][..*len])
                }
            },
            ndim: self.ndim,
            shape: self.shape,
            block: self.block,
            grid_strides: self.grid_strides,
            window: self.window,
        }
    }

    /// Cells of the grid's last dim (1 for a 0-dim grid).
    fn gcols(&self) -> u64 {
        match self.ndim {
            0 => 1,
            n => self.shape[n - 1].div_ceil(self.block[n - 1]),
        }
    }

    /// The grid columns (cells of the last dim) `[c0, c1)` that a validated box of elements touches: `first`
    /// its first flat element, `lens` and `strides` (non-negative) its dims. Exact when no dim of the box
    /// carries its elements from one row of the last dim into the next other than by whole rows (a slice of
    /// the last dim, as a Shard(1) of transformers' transposed MXFP4 experts); every column otherwise.
    fn cols_of(&self, first: u64, lens: &[i64], strides: &[i64]) -> (u64, u64) {
        let (n, gcols) = (self.ndim, self.gcols());
        if n == 0 {
            return (0, 1);
        }
        let (len, block) = (self.shape[n - 1], self.block[n - 1]);
        let mut span = 0u64; // how far the box's elements reach along a row from its first
        for (&l, &s) in lens.iter().zip(strides) {
            let (l, s) = (l as u64, s as u64);
            if l <= 1 || s % len == 0 {
                continue; // one element, or whole rows
            }
            if s > len {
                return (0, gcols);
            }
            span = span.saturating_add((l - 1).saturating_mul(s));
        }
        let col = first % len;
        match col.checked_add(span) {
            Some(end) if end < len => (col / block, end / block + 1),
            _ => (0, gcols),
        }
    }

    /// The flat range of grid cells holding the scales of elements `first..=last` (flat, row-major indices
    /// of the quantized tensor with `first <= last`): the whole grid rows of dim 0 from the row of `first`
    /// to the row of `last`. Exact for boxes cut along dim 0 (an expert-parallel or FSDP dim-0 shard);
    /// a box cut along inner dims gets whole rows.
    fn cells_of(&self, first: u64, last: u64) -> (u64, u64) {
        if self.ndim == 0 {
            return (0, self.cells);
        }
        let inner: u64 = self.shape[1..self.ndim].iter().product();
        let row = |flat: u64| (flat / inner).min(self.shape[0] - 1) / self.block[0];
        let per_row = self.grid_strides[0];
        (
            row(first) * per_row,
            ((row(last) + 1) * per_row).min(self.cells),
        )
    }
}

/// The cells of one scale that a batch reads and keeps (see [`scale_cells`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ScaleCells {
    /// The flat range of grid cells read from the file: the hull of the dim-0 grid rows the items touch
    /// ([`LoadedScale::cells_of`]), the bytes the Python side counts (`touched_scale_rows`).
    pub(super) span: (u64, u64),
    /// The cells of the span decoded and kept for the kernels: its grid rows, of each the hull of the
    /// last-dim cells the items touch ([`LoadedScale::cols_of`]).
    pub(super) window: CellWindow,
}

impl ScaleCells {
    /// Grid rows of the window.
    fn rows(&self) -> u64 {
        let w = &self.window;
        self.span.1.div_ceil(w.gcols).saturating_sub(w.row0)
    }
}

/// For each scale, the cells that the validated `items` referencing it touch ([`ScaleCells`]): the span of
/// whole dim-0 grid rows read from the file, and within it the window of rows and last-dim columns that
/// [`read_scale_cells`] decodes and keeps. A rank's Shard(1) of transformers' gpt-oss experts (90 of the 2,880
/// inputs of each expert: 3-4 of the 90 scale columns of every row) thus keeps 4 of every 90 cells decoded,
/// not all 90 (which held 1.8 GB of `f32` for one rank of a 256-rank EP x FSDP job). `whole` takes each used
/// scale whole (the reference the tests compare with).
pub(super) fn scale_cells(
    scales: &[LoadedScale],
    items: &[Item],
    per_item: &ItemScales,
    whole: bool,
) -> Vec<Option<ScaleCells>> {
    // per scale: the hull of the items' cell spans, and of their grid columns
    type Hull = ((u64, u64), (u64, u64));
    let mut hull: Vec<Option<Hull>> = vec![None; scales.len()];
    for (it, s) in items.iter().zip(per_item) {
        let Some((s, _)) = *s else { continue };
        let sc = &scales[s];
        let ndim = it.ndim as usize; // validated by `runs::plan`, like every length and stride below
        let (lens, strides) = (&it.lengths[..ndim], &it.src_strides[..ndim]);
        if lens.contains(&0) {
            continue;
        }
        let (cells, cols) = match lens.iter().chain(strides).all(|&v| v >= 0) && it.src_base >= 0 {
            true => {
                let first = it.src_base as u64;
                let last = lens
                    .iter()
                    .zip(strides)
                    .fold(first, |acc, (&l, &st)| acc + (l as u64 - 1) * st as u64);
                (sc.cells_of(first, last), sc.cols_of(first, lens, strides))
            }
            false => ((0, sc.cells), (0, sc.gcols())),
        };
        let h = hull[s].get_or_insert((cells, cols));
        h.0 = (h.0 .0.min(cells.0), h.0 .1.max(cells.1));
        h.1 = (h.1 .0.min(cols.0), h.1 .1.max(cols.1));
    }
    hull.iter()
        .zip(scales)
        .map(|(h, sc)| {
            let gcols = sc.gcols();
            let (span, (c0, c1)) = match whole {
                true => h.map(|_| ((0, sc.cells), (0, gcols)))?,
                false => (*h)?,
            };
            let row0 = span.0 / gcols;
            // a 1-dim grid is one row: the window is the span's columns (which the items' columns are)
            let (c0, c1) = match sc.ndim {
                0 | 1 => (span.0 - row0 * gcols, span.1 - row0 * gcols),
                _ => (c0, c1),
            };
            Some(ScaleCells {
                span,
                window: CellWindow {
                    row0,
                    col0: c0,
                    width: c1 - c0,
                    gcols,
                },
            })
        })
        .collect()
}

/// The file of scale `sc` and the absolute byte range of its grid cells `[c0, c1)` in it.
pub(super) fn scale_byte_range(
    sc: &LoadedScale,
    (c0, c1): (u64, u64),
    files: &[Arc<Header>],
) -> (usize, (u64, u64)) {
    let h = &files[sc.file];
    let t = &h.tensors[sc.tensor];
    let size = t.dtype.byte_size().expect("scale dtypes are byte-sized") as u64;
    let start = h.data_start + t.begin + c0 * size;
    (sc.file, (start, start + (c1 - c0) * size))
}

/// Raw scale bytes read at once by [`read_scale_cells`]: a batch's scale spans pass through one buffer of at
/// most this many bytes (a grid row longer than that is read in pieces), whatever their size; what stays is each
/// scale's decoded window (`f32`), the rank's share of the scales.
pub(super) const SCALE_READ_CHUNK: u64 = 4 << 20;

/// Reads the span of each scale ([`scale_cells`]) and decodes its window: from its file's map in `maps` when
/// there is one, else by `pread`s of whole grid rows of at most
/// [`SCALE_READ_CHUNK`] bytes at a time (a grid row longer than that: its window's cells alone, in pieces of
/// that size); MXFP4's kept e8m0 bytes of whole grid rows are read straight into the window, or, where
/// `maps` holds their file's map, kept as a slice of it (populated in one call; no fresh pages to fault, no
/// copy). `maps`: the staged bytes of each file when there are some (object storage, `super::staged`), else
/// maps of the files of such windows, or none. The scales are read on `threads` workers, the largest
/// windows first (one thread read a rank's 112 MB of gpt-oss scales while the other waited: a quarter of
/// the rank's time, docs/perf-notes.md, "Session 17").
pub(super) fn read_scale_cells(
    scales: &mut [LoadedScale],
    cells: &[Option<ScaleCells>],
    files: &[Arc<Header>],
    maps: Option<&[Option<Arc<Mapping>>]>,
    threads: usize,
    interrupt: Option<&Interrupt>,
) -> Result<(), LoadError> {
    let mut order: Vec<usize> = (0..scales.len()).filter(|&k| cells[k].is_some()).collect();
    order.sort_by_key(|&k| {
        std::cmp::Reverse(cells[k].as_ref().map_or(0, |c| c.rows() * c.window.width))
    });
    let read: Vec<Mutex<Option<(Kept, u64)>>> = scales.iter().map(|_| Mutex::new(None)).collect();
    {
        let scales = &*scales;
        run_workers(
            threads.clamp(1, order.len().max(1)),
            order.len(),
            interrupt,
            |i, buf, _| {
                let k = order[i];
                let cells = cells[k]
                    .as_ref()
                    .expect("only scales some item uses are read");
                let window = read_window(&scales[k], cells, files, maps, buf)?;
                *read[k].lock().unwrap_or_else(|p| p.into_inner()) = Some(window);
                Ok(())
            },
        )?;
    }
    for ((sc, cells), read) in scales.iter_mut().zip(cells).zip(read) {
        if let (Some(cells), Some((values, bytes))) =
            (cells, read.into_inner().unwrap_or_else(|p| p.into_inner()))
        {
            sc.values = values;
            sc.window = cells.window;
            sc.bytes = bytes;
        }
    }
    Ok(())
}

/// The files holding a scale window that [`read_scale_cells`] keeps as a slice of a map when given one
/// ([`mappable_window`]).
pub(super) fn mappable_scale_files(
    scales: &[LoadedScale],
    cells: &[Option<ScaleCells>],
    files: &[Arc<Header>],
) -> Vec<bool> {
    let mut wanted = vec![false; files.len()];
    for (sc, cells) in scales.iter().zip(cells) {
        if cells
            .as_ref()
            .is_some_and(|c| mappable_window(sc, c, files))
        {
            wanted[sc.file] = true;
        }
    }
    wanted
}

/// Whether a scale keeps its e8m0 bytes as they are ([`Kept::E8m0`]: MXFP4's; every other scale is decoded to
/// `f32`).
fn keeps_bytes(sc: &LoadedScale, files: &[Arc<Header>]) -> bool {
    let dtype = files[sc.file].tensors[sc.tensor].dtype;
    sc.mxfp4 && matches!(dtype, Dtype::U8 | Dtype::F8_E8M0)
}

/// Whether a scale's window can be a slice of its file's map: kept bytes ([`keeps_bytes`]) of whole grid rows
/// (a rank's whole experts), which lie in the file in the window's order.
fn mappable_window(sc: &LoadedScale, cells: &ScaleCells, files: &[Arc<Header>]) -> bool {
    let w = cells.window;
    keeps_bytes(sc, files) && w.col0 == 0 && w.width == w.gcols
}

/// One scale's window of [`read_scale_cells`] and the bytes read for it, `buf` the worker's scratch buffer.
fn read_window(
    sc: &LoadedScale,
    cells: &ScaleCells,
    files: &[Arc<Header>],
    maps: Option<&[Option<Arc<Mapping>>]>,
    buf: &mut Vec<u8>,
) -> Result<(Kept, u64), LoadError> {
    let h = &files[sc.file];
    let t = &h.tensors[sc.tensor];
    let (dtype, mxfp4) = (t.dtype, sc.mxfp4);
    let size = dtype.byte_size().expect("scale dtypes are byte-sized") as u64;
    let base = h.data_start + t.begin; // the file offset of cell 0
    let w = cells.window;
    let rows = cells.rows();
    // MXFP4's e8m0 bytes are kept as they are (a quarter of the `f32`), every other scale decoded
    let bytes_kept = keeps_bytes(sc, files);
    let n = (rows * w.width) as usize;
    let row_cells = w.gcols;
    let whole_rows = w.col0 == 0 && w.width == row_cells;
    let map = maps.and_then(|s| s[sc.file].clone());
    if let (Some(map), true) = (&map, mappable_window(sc, cells, files)) {
        let start = (base + w.row0 * row_cells) as usize;
        map.will_need(start as u64, (start + n) as u64);
        let read = (cells.span.1 - cells.span.0) * size;
        let map = Arc::clone(map);
        return Ok((Kept::Mapped { map, start, len: n }, read));
    }
    let mut values = match bytes_kept {
        true => Kept::E8m0(vec![0u8; n]),
        false => Kept::F32(vec![0.0f32; n]),
    };
    let file = match map {
        Some(_) => None,
        None => Some(open_regular(&h.path)?.0),
    };
    // Pieces of the span, each a range of flat cells read at once: whole grid rows, as many as fit in a
    // chunk; a row longer than a chunk: its window's cells in chunks.
    let chunk_cells = (SCALE_READ_CHUNK / size).max(1);
    let mut pieces: Vec<(u64, u64)> = Vec::new();
    let per_read = (chunk_cells / row_cells).max(1);
    let mut r = 0;
    while r < rows {
        let k = per_read.min(rows - r);
        let first = (w.row0 + r) * row_cells;
        match row_cells <= chunk_cells {
            true => pieces.push((
                first.max(cells.span.0),
                (first + k * row_cells).min(cells.span.1),
            )),
            false => {
                let (a, b) = (first + w.col0, first + w.col0 + w.width);
                pieces.extend(
                    (a..b)
                        .step_by(chunk_cells as usize)
                        .map(|p| (p, (p + chunk_cells).min(b))),
                );
            }
        }
        r += k;
    }
    let mut read = 0u64;
    for (p0, p1) in pieces {
        let (start, end) = (base + p0 * size, base + p1 * size);
        read += end - start;
        let at = |cell: u64| {
            ((cell / row_cells - w.row0) * w.width + (cell % row_cells - w.col0)) as usize
        };
        let bytes: &[u8] = match (&map, &file, &mut values) {
            (Some(map), _, _) => &map.bytes()[start as usize..end as usize],
            // whole rows of kept bytes: the piece's cells are the window's, in order
            (None, Some(file), Kept::E8m0(kept)) if whole_rows => {
                let into = &mut kept[at(p0)..][..(end - start) as usize];
                read_exact_at(file, into, start, &h.path, h.file_len)?;
                continue;
            }
            (None, Some(file), _) => {
                buf.resize((end - start) as usize, 0);
                read_exact_at(file, buf, start, &h.path, h.file_len)?;
                buf
            }
            (None, None, _) => unreachable!("a scale's file is opened when it is not staged"),
        };
        // the window's cells `at..at + src.len() / size` from their bytes `src`
        let mut put = |at: usize, src: &[u8]| match &mut values {
            Kept::E8m0(b) => b[at..at + src.len()].copy_from_slice(src),
            Kept::F32(v) => {
                let out = &mut v[at..at + src.len() / size as usize];
                decode_scales_into(dtype, src, out, mxfp4);
            }
            Kept::Mapped { .. } => unreachable!("a mapped window is returned above"),
        };
        if whole_rows {
            put(at(p0), bytes);
            continue;
        }
        // the window's cells of each row in the piece
        let mut row = p0 / row_cells;
        while row * row_cells < p1 {
            let (a, b) = (
                (row * row_cells + w.col0).max(p0),
                (row * row_cells + w.col0 + w.width).min(p1),
            );
            if a < b {
                put(
                    at(a),
                    &bytes[((a - p0) * size) as usize..((b - p0) * size) as usize],
                );
            }
            row += 1;
        }
    }
    Ok((values, read))
}

/// Per item: its scale (index into the loaded scales) and the absolute file offset of its tensor.
pub(super) type ItemScales = Vec<Option<(usize, u64)>>;

/// Each item's scale ([`ItemScales`]), validated against its tensor and destination; marks the scales of
/// MXFP4 nibbles ([`LoadedScale::mxfp4`]) and refuses a scale that both MXFP4 nibbles and 8-bit floats
/// use (its byte 0xff means 2^128 to one and NaN to the other).
pub(super) fn item_scales(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &mut [LoadedScale],
) -> Result<ItemScales, LoadError> {
    let mut users: Vec<Option<bool>> = vec![None; scales.len()];
    let mut out = vec![None; items.len()];
    for (k, it) in items.iter().enumerate() {
        if it.scale == 0 {
            continue;
        }
        let bad = |reason: String| LoadError::request(format!("item {k}: {reason}"));
        let s = usize::try_from(it.scale - 1)
            .ok()
            .filter(|&s| s < scales.len())
            .ok_or_else(|| {
                bad(format!(
                    "scale {} is outside 1..={}",
                    it.scale,
                    scales.len()
                ))
            })?;
        let h = usize::try_from(it.file).ok().and_then(|f| files.get(f));
        let t = h.and_then(|h| {
            usize::try_from(it.tensor)
                .ok()
                .and_then(|t| h.tensors.get(t))
        });
        let d = usize::try_from(it.dest).ok().and_then(|d| dests.get(d));
        let (Some(h), Some(t), Some(d)) = (h, t, d) else {
            continue; // runs::plan names the bad index
        };
        if !can_dequantize(t.dtype, d.dtype()) {
            return Err(bad(format!(
                "'{}' ({}) cannot be dequantized into {} (an 8-bit float, or U8 holding MXFP4 e2m1 pairs, \
                 into F16, BF16, F32 or F64)",
                t.name,
                t.dtype,
                d.dtype()
            )));
        }
        let sc = &scales[s];
        if t.dtype == Dtype::U8 {
            // MXFP4: the scale describes the 4-bit elements, two a byte (low nibble first), row-major: twice
            // the bytes, the last dim whole rows of the stored last dim.
            let logical: u64 = sc.shape[..sc.ndim].iter().product();
            let row = 2 * t.shape.last().copied().unwrap_or(0);
            let fits = sc.ndim > 0
                && row > 0
                && logical == 2 * t.numel()
                && sc.shape[sc.ndim - 1].is_multiple_of(row);
            if !fits {
                return Err(bad(format!(
                    "'{}' (U8, MXFP4 pairs) has shape {:?} but its scale {} describes 4-bit elements {:?} \
                     (twice the bytes, rows of {row})",
                    t.name,
                    t.shape,
                    s,
                    &sc.shape[..sc.ndim]
                )));
            }
        } else if sc.shape[..sc.ndim] != t.shape[..] {
            return Err(bad(format!(
                "'{}' has shape {:?} but its scale {} describes {:?}",
                t.name,
                t.shape,
                s,
                &sc.shape[..sc.ndim]
            )));
        }
        let nibbles = t.dtype == Dtype::U8;
        if *users[s].get_or_insert(nibbles) != nibbles {
            return Err(bad(format!(
                "scale {} is used by MXFP4 nibbles ('{}' or another) and by 8-bit floats; each needs its own",
                s, t.name
            )));
        }
        scales[s].mxfp4 = nibbles;
        out[k] = Some((s, h.data_start + t.begin));
    }
    Ok(out)
}

/// The dequantization context of a batch: loaded scales and each item's use of them.
pub(super) struct Scaled<'a> {
    pub(super) scales: &'a [LoadedScale],
    pub(super) items: &'a ItemScales,
}

impl Scaled<'_> {
    /// Writes one run (see `write_run`), through its item's scales when it has them.
    pub(super) fn write(&self, r: &Run, src: &[u8]) {
        match self.items.get(r.item).copied().flatten() {
            Some((s, begin)) => write_run_scaled(r, src, &self.scales[s].map(), begin),
            None => write_run(r, src),
        }
    }
}

#[cfg(test)]
mod mxfp4_tests;
#[cfg(test)]
mod tests;
