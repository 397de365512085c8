//! The batch executor: validated runs → sorted, coalesced tasks → scoped worker threads.
//!
//! [`execute`] validates the whole batch ([`crate::region::plan`]) before any thread starts, opens and
//! `fstat`s each file it needs (a file shorter than its header says is [`LoadError::Truncated`]; a
//! replaced or rewritten one is [`LoadError::Changed`]), picks a backend per file, splits large runs so
//! every thread gets work (a repeated run into groups of repetitions; `make_pieces` says when repetitions
//! become runs of their own), sorts them by (file, offset), groups them into tasks and runs the tasks on
//! `threads` scoped threads that take the next task from an atomic counter (no global pool, so nothing to
//! re-create after `fork`). A worker panic becomes [`LoadError::WorkerPanicked`].
//!
//! Backends: `mmap` copies from a read-only map of the file (the header's kept map when its file passes the
//! identity check, else a new one it then keeps); `pread` reads each task's byte span
//! into a per-thread buffer (reading through gaps of up to [`ExecOptions::pread_gap`] bytes) and then
//! scatters it, or, for a large same-dtype dense run, reads straight into the destination. `auto` uses
//! `mmap` for a file when at least [`AUTO_MMAP_RESIDENT`] of the pages it needs are in the page cache,
//! else `pread` (measured in docs/perf-notes.md).

use std::fs::File;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::dest::{with_dense_dst, write_run, write_run_scaled, DestBuf};
use crate::dtype::Dtype;
use crate::dtype::{can_dequantize, decode_scales_into, is_scale_dtype, ScaleMap};
use crate::error::LoadError;
use crate::header::{FileIdentity, Header};
use crate::mmap::{open_regular, prefetch, read_exact_at, Mapping};
use crate::region::{plan, Item, Run, MAX_NDIM};

/// Fraction of needed pages that must be cached for `auto` to pick `mmap`.
pub const AUTO_MMAP_RESIDENT: f64 = 0.9;
/// Worker threads per requested thread when some file is read with `pread` (waiting on storage).
pub const IO_THREAD_FACTOR: usize = 2;
/// Most threads used by default.
pub const MAX_DEFAULT_THREADS: usize = 16;
/// Default [`ExecOptions::pread_gap`]: 64 KiB. A cold Shard(1) slice is read through its gaps anyway by the
/// kernel's read-ahead (the storage reads are the same either way, docs/perf-notes.md "pread gap"), and one
/// `pread` per span costs far fewer syscalls than one per ~1 KiB run. Every benchmark in docs/ ran with it.
pub const DEFAULT_PREAD_GAP: u64 = 64 * 1024;
/// Mapped runs join a task across gaps up to this many bytes (see `make_tasks`).
const MMAP_JOIN_GAP: u64 = 64 * 1024;
/// Smallest same-dtype dense run that `pread` reads straight into the destination.
const DIRECT_MIN: u64 = 64 * 1024;

/// How file bytes are fetched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// Per file: `Mmap` when the needed pages are cached, else `Pread`.
    #[default]
    Auto,
    /// Copy from a read-only memory map.
    Mmap,
    /// Positioned reads into a buffer or straight into the destination.
    Pread,
}

impl Backend {
    /// The backend's name (`"auto"`, `"mmap"`, `"pread"`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Mmap => "mmap",
            Backend::Pread => "pread",
        }
    }
}

impl FromStr for Backend {
    type Err = LoadError;
    fn from_str(s: &str) -> Result<Self, LoadError> {
        match s {
            "auto" => Ok(Backend::Auto),
            "mmap" => Ok(Backend::Mmap),
            "pread" => Ok(Backend::Pread),
            _ => Err(LoadError::request(format!(
                "unknown backend '{s}' (expected auto, mmap or pread)"
            ))),
        }
    }
}

/// Knobs of one [`execute`] call.
#[derive(Clone, Debug)]
pub struct ExecOptions {
    /// Worker threads; `None` = available parallelism capped at [`MAX_DEFAULT_THREADS`]. When some file is
    /// read with `pread` (not cached), [`IO_THREAD_FACTOR`] times as many run (they wait on storage).
    pub threads: Option<usize>,
    /// Backend choice.
    pub backend: Backend,
    /// `pread` reads through gaps up to this many bytes between runs instead of issuing another read.
    pub pread_gap: u64,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            threads: None,
            backend: Backend::Auto,
            pread_gap: DEFAULT_PREAD_GAP,
        }
    }
}

/// What an [`execute`] call did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Bytes written into destinations.
    pub bytes_copied: u64,
    /// Bytes taken from files (including gaps read through by `pread`).
    pub bytes_read_from_files: u64,
    /// 1-d runs after validation (each repetition of a repeated run counted; before splitting for
    /// parallelism).
    pub runs: usize,
    /// Tasks (coalesced spans) handed to the workers.
    pub spans: usize,
    /// `"mmap"`, `"pread"`, `"mixed"` or `"none"` (nothing to read).
    pub backend: &'static str,
    /// Threads used.
    pub threads: usize,
}

/// The default thread count: available parallelism capped at [`MAX_DEFAULT_THREADS`].
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_DEFAULT_THREADS)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Mmap,
    PreadDirect,
    PreadBuffered,
}

struct Task {
    file: usize,
    mode: Mode,
    first: usize,
    last: usize,
    start: u64,
    end: u64,
}

/// At most this many files of one call stay open from the pre-read check until their reads: the others are
/// opened again when their first task runs.
const KEEP_OPEN: usize = 64;

/// One needed file of a call: its map (mapped reads; a map needs no descriptor), or, for positioned reads,
/// a descriptor opened on first use and closed after the file's last task. A call over thousands of shards
/// thus holds about one descriptor per worker, not one per file (a soft `ulimit -n` of 1024 is common).
struct Source {
    map: Option<Arc<Mapping>>,
    file: Mutex<Option<Arc<File>>>,
    /// `pread` tasks of the file not yet finished (set once the tasks are made).
    pending: AtomicUsize,
}

impl Source {
    /// The open file for a `pread` task, opened (and checked again) when it is not open.
    fn file(&self, h: &Header) -> Result<Arc<File>, LoadError> {
        let mut slot = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(file) = slot.as_ref() {
            return Ok(Arc::clone(file));
        }
        let file = Arc::new(open_checked(h)?);
        *slot = Some(Arc::clone(&file));
        Ok(file)
    }

    /// One `pread` task of the file is done; after the last one the descriptor is closed.
    fn finish(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.file.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }
}

/// Reads every item into its destination. All items are validated first; on error nothing has been
/// written, except for I/O errors and truncation found while reading, after which the destinations may
/// be partially written.
pub fn execute(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    execute_scaled(files, dests, items, &[], opts)
}

/// The scales of one quantized tensor, for items with [`Item::scale`] set: tensor `tensor` of file `file`
/// holds one scale per block of `block` elements of the quantized tensor, whose storage shape is `shape`
/// (`ndim` dims; the grid is `ceil(shape / block)`, row-major; ragged last blocks are real). Scale dtypes:
/// F32, BF16, F16, F8_E8M0, or U8 holding e8m0 exponents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scale {
    /// Index into the `files` given to [`execute_scaled`].
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

/// A validated [`Scale`] with the grid's strides and, once [`read_scale_cells`] ran, the values of the cells the
/// batch's items touch decoded in place (the other cells stay 0.0 and are never looked up).
struct LoadedScale {
    values: Vec<f32>,
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
    bytes: u64,
}

impl LoadedScale {
    fn map(&self) -> ScaleMap<'_> {
        ScaleMap {
            values: &self.values,
            ndim: self.ndim,
            shape: self.shape,
            block: self.block,
            grid_strides: self.grid_strides,
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

/// Validates scale `k` against its tensor (index, dims, grid size, dtype) without reading it.
fn check_scale(k: usize, s: &Scale, files: &[Arc<Header>]) -> Result<LoadedScale, LoadError> {
    let bad = |reason: String| LoadError::request(format!("scale {k}: {reason}"));
    let file = usize::try_from(s.file)
        .ok()
        .filter(|&f| f < files.len())
        .ok_or_else(|| bad(format!("file index {} is out of range", s.file)))?;
    let h = &files[file];
    let tensor = usize::try_from(s.tensor)
        .ok()
        .filter(|&t| t < h.tensors.len())
        .ok_or_else(|| bad(format!("tensor index {} is out of range", s.tensor)))?;
    let t = &h.tensors[tensor];
    let ndim = usize::try_from(s.ndim)
        .ok()
        .filter(|&n| n <= MAX_NDIM)
        .ok_or_else(|| bad(format!("ndim {} is outside 0..={MAX_NDIM}", s.ndim)))?;
    let (mut shape, mut block, mut grid_strides) =
        ([1u64; MAX_NDIM], [1u64; MAX_NDIM], [0u64; MAX_NDIM]);
    let mut cells: u64 = 1;
    for d in (0..ndim).rev() {
        if s.shape[d] < 1 || s.block[d] < 1 {
            return Err(bad(format!(
                "dim {d}: shape {} and block {} must be positive",
                s.shape[d], s.block[d]
            )));
        }
        shape[d] = s.shape[d] as u64;
        block[d] = s.block[d] as u64;
        grid_strides[d] = cells;
        cells = cells.saturating_mul(shape[d].div_ceil(block[d]));
    }
    if cells != t.numel() {
        return Err(bad(format!(
            "'{}' has {} elements (shape {:?}) but a grid of blocks {:?} over shape {:?} has {cells}",
            t.name,
            t.numel(),
            t.shape,
            &block[..ndim],
            &shape[..ndim]
        )));
    }
    if !is_scale_dtype(t.dtype) {
        return Err(bad(format!(
            "'{}' is {}; scales must be F32, BF16, F16, F8_E8M0 or U8 (e8m0)",
            t.name, t.dtype
        )));
    }
    Ok(LoadedScale {
        values: Vec::new(),
        ndim,
        shape,
        block,
        grid_strides,
        cells,
        file,
        tensor,
        bytes: 0,
    })
}

/// For each scale, the grid cells that the validated `items` referencing it touch (one contiguous range: the
/// hull of their dim-0 grid rows, [`LoadedScale::cells_of`]), which [`read_scale_cells`] reads and decodes into
/// their place of a zeroed full-length vector, so the kernels index it as the whole grid. `whole` takes each
/// used scale whole (the reference the tests compare with).
fn scale_cells(
    scales: &[LoadedScale],
    items: &[Item],
    per_item: &ItemScales,
    whole: bool,
) -> Vec<Option<(u64, u64)>> {
    let mut hull: Vec<Option<(u64, u64)>> = vec![None; scales.len()];
    for (it, s) in items.iter().zip(per_item) {
        let Some((s, _)) = *s else { continue };
        let sc = &scales[s];
        let ndim = it.ndim as usize; // validated by `region::plan`, like every length and stride below
        let (lens, strides) = (&it.lengths[..ndim], &it.src_strides[..ndim]);
        if lens.contains(&0) {
            continue;
        }
        let cells = match lens.iter().chain(strides).all(|&v| v >= 0) && it.src_base >= 0 {
            true => {
                let first = it.src_base as u64;
                let last = lens
                    .iter()
                    .zip(strides)
                    .fold(first, |acc, (&l, &st)| acc + (l as u64 - 1) * st as u64);
                sc.cells_of(first, last)
            }
            false => (0, sc.cells),
        };
        let h = hull[s].get_or_insert(cells);
        *h = (h.0.min(cells.0), h.1.max(cells.1));
    }
    hull.iter()
        .zip(scales)
        .map(|(h, sc)| h.map(|h| if whole { (0, sc.cells) } else { h }))
        .collect()
}

/// The absolute file byte range of grid cells `[c0, c1)` of scale `sc`.
fn scale_byte_range(sc: &LoadedScale, (c0, c1): (u64, u64), files: &[Arc<Header>]) -> (u64, u64) {
    let h = &files[sc.file];
    let t = &h.tensors[sc.tensor];
    let size = t.dtype.byte_size().expect("scale dtypes are byte-sized") as u64;
    let start = h.data_start + t.begin + c0 * size;
    (start, start + (c1 - c0) * size)
}

/// Reads and decodes the given cells of each scale ([`scale_cells`]), from the staged bytes of its file when
/// there are some (object storage), else with one `pread`.
fn read_scale_cells(
    scales: &mut [LoadedScale],
    cells: &[Option<(u64, u64)>],
    files: &[Arc<Header>],
    staged: Option<&[Option<Arc<Mapping>>]>,
) -> Result<(), LoadError> {
    for (sc, &cells) in scales.iter_mut().zip(cells) {
        let Some((c0, c1)) = cells else {
            continue; // no item uses it
        };
        let h = &files[sc.file];
        let t = &h.tensors[sc.tensor];
        let (start, end) = scale_byte_range(sc, (c0, c1), files);
        let mut raw = vec![0u8; (end - start) as usize];
        match staged.and_then(|s| s[sc.file].as_ref()) {
            Some(map) => raw.copy_from_slice(&map.bytes()[start as usize..end as usize]),
            None => {
                let (file, _) = open_regular(&h.path)?;
                read_exact_at(&file, &mut raw, start, &h.path, h.file_len)?;
            }
        }
        sc.values = vec![0.0f32; sc.cells as usize]; // zeroed pages: untouched cells cost no memory
        decode_scales_into(t.dtype, &raw, &mut sc.values[c0 as usize..c1 as usize]);
        sc.bytes = raw.len() as u64;
    }
    Ok(())
}

/// Per item: its scale (index into the loaded scales) and the absolute file offset of its tensor.
type ItemScales = Vec<Option<(usize, u64)>>;

fn item_scales(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[LoadedScale],
) -> Result<ItemScales, LoadError> {
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
            continue; // region::plan names the bad index
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
                && sc.shape[sc.ndim - 1] % row == 0;
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
        out[k] = Some((s, h.data_start + t.begin));
    }
    Ok(out)
}

/// Like [`execute`], with dequantization: an item whose [`Item::scale`] is `k > 0` multiplies each element
/// by its block's scale from `scales[k - 1]` (in `f32`) before the one rounding into the destination.
/// Scales and items are validated, then each scale's grid rows that the items touch are read (once per
/// call, `read_scale_cells`; counted in `bytes_read_from_files`), before any destination byte is written.
pub fn execute_scaled(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    execute_scaled_reading(files, dests, items, scales, opts, false)
}

// ---- Staged sources (object storage, `crate::objstore`): the one hook of another byte source. ----

/// Brings the bytes a call needs into memory: given, per file, the sorted absolute byte ranges the validated
/// items (and their scales) read (empty for a file the call does not read), returns per file a map holding
/// those bytes at their file offsets, or `None` to read that file from the file system as usual. Called once,
/// after validation and before any destination byte is written.
pub(crate) type Stage<'a> =
    &'a dyn Fn(&[Vec<(u64, u64)>]) -> Result<Vec<Option<Arc<Mapping>>>, LoadError>;

/// [`execute_scaled`] over files whose bytes `stage` provides (see [`Stage`]).
#[cfg(feature = "s3")]
pub(crate) fn execute_staged(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
    stage: Stage<'_>,
) -> Result<ExecStats, LoadError> {
    execute_scaled_from(files, dests, items, scales, opts, false, Some(stage))
}

/// Per file, the absolute byte ranges that `runs` and the scale `cells` read, sorted (repetitions one range
/// each; a repeated run whose repetitions touch is one range).
fn needed_ranges(
    runs: &[Run],
    scales: &[LoadedScale],
    cells: &[Option<(u64, u64)>],
    files: &[Arc<Header>],
) -> Vec<Vec<(u64, u64)>> {
    let mut out: Vec<Vec<(u64, u64)>> = vec![Vec::new(); files.len()];
    for r in runs {
        let extent = r.run_extent();
        if r.reps == 1 || r.rep_src_stride <= extent {
            out[r.file].push((r.src_off, r.src_end()));
        } else {
            let ranges = &mut out[r.file];
            for k in 0..r.reps {
                let at = r.src_off + k * r.rep_src_stride;
                ranges.push((at, at + extent));
            }
        }
    }
    for (sc, c) in scales.iter().zip(cells) {
        if let Some(c) = c {
            out[sc.file].push(scale_byte_range(sc, *c, files));
        }
    }
    for ranges in &mut out {
        ranges.sort_unstable();
    }
    out
}

// ---- end of staged sources ----

/// [`execute_scaled`]; `whole_scales` reads every scale whole (the tests' reference for the touched rows).
fn execute_scaled_reading(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
    whole_scales: bool,
) -> Result<ExecStats, LoadError> {
    execute_scaled_from(files, dests, items, scales, opts, whole_scales, None)
}

/// [`execute_scaled_reading`]; `stage` provides files' bytes from elsewhere ([`execute_staged`]).
fn execute_scaled_from(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
    whole_scales: bool,
    stage: Option<Stage<'_>>,
) -> Result<ExecStats, LoadError> {
    let mut loaded: Vec<LoadedScale> = scales
        .iter()
        .enumerate()
        .map(|(k, s)| check_scale(k, s, files))
        .collect::<Result<_, _>>()?;
    let per_item = item_scales(files, dests, items, &loaded)?;
    let runs = plan(files, dests, items)?;
    let mut staged = None;
    if !runs.is_empty() {
        let cells = scale_cells(&loaded, items, &per_item, whole_scales);
        if let Some(stage) = stage {
            staged = Some(stage(&needed_ranges(&runs, &loaded, &cells, files))?);
        }
        read_scale_cells(&mut loaded, &cells, files, staged.as_deref())?;
    }
    let scale_bytes: u64 = loaded.iter().map(|s| s.bytes).sum();
    let threads = opts.threads.unwrap_or_else(default_threads).max(1);
    let mut stats = ExecStats {
        runs: runs.iter().map(|r| r.reps as usize).sum(),
        backend: "none",
        threads: 1,
        ..ExecStats::default()
    };
    if runs.is_empty() {
        return Ok(stats);
    }
    // Open, check and (maybe) map each file that is needed.
    let mut used = vec![false; files.len()];
    for r in &runs {
        used[r.file] = true;
    }
    let probes = match opts.backend {
        Backend::Auto => probe_ranges(&runs, files.len()),
        _ => vec![Vec::new(); files.len()],
    };
    let mut sources: Vec<Option<Source>> = Vec::with_capacity(files.len());
    let mut kept_open = 0;
    for (f, ((h, &used), ranges)) in files.iter().zip(&used).zip(&probes).enumerate() {
        let kept = staged
            .as_ref()
            .and_then(|s: &Vec<Option<Arc<Mapping>>>| s[f].clone());
        sources.push(match used {
            true if kept.is_some() => Some(Source {
                map: kept,
                file: Mutex::new(None),
                pending: AtomicUsize::new(0),
            }),
            true => {
                let mut source = open_source(h, opts.backend, ranges, kept_open < KEEP_OPEN)?;
                kept_open += usize::from(source.file.get_mut().is_ok_and(|f| f.is_some()));
                Some(source)
            }
            false => None,
        });
    }
    drop(probes);
    let uses_mmap = sources.iter().flatten().any(|s| s.map.is_some());
    let uses_pread = sources.iter().flatten().any(|s| s.map.is_none());
    stats.backend = match (uses_mmap, uses_pread) {
        (true, true) => "mixed",
        (true, false) => "mmap",
        _ => "pread",
    };
    let mapped: Vec<bool> = sources
        .iter()
        .map(|s| s.as_ref().is_some_and(|s| s.map.is_some()))
        .collect();
    let total: u64 = runs.iter().map(Run::needed_bytes).sum();
    let chunk = (total / (threads as u64 * 8)).clamp(64 * 1024, 8 * 1024 * 1024);
    let pieces = make_pieces(runs, &mapped, chunk, opts.pread_gap);
    let tasks = make_tasks(&pieces, &sources, chunk, opts.pread_gap);
    for t in tasks.iter().filter(|t| t.mode != Mode::Mmap) {
        if let Some(s) = &sources[t.file] {
            s.pending.fetch_add(1, Ordering::Relaxed);
        }
    }
    stats.spans = tasks.len();
    stats.bytes_copied = pieces
        .iter()
        .map(|r| r.reps * (r.count * r.dst_dtype.bits()).div_ceil(8))
        .sum();
    // Reads that go to storage (pread: the pages are not cached) wait on the device, not on a core: twice
    // the threads keep more requests in flight. Plain 8 MiB preads went 0.84 -> 1.3 GB/s cold here; with the
    // engine's WILLNEED look-ahead it measured a tie on this disk (docs/perf-notes.md, "Cold reads"), kept
    // for devices with deeper queues.
    let workers = match uses_pread {
        true => (threads * IO_THREAD_FACTOR).clamp(threads, MAX_DEFAULT_THREADS.max(threads)),
        false => threads,
    };
    stats.threads = workers.min(tasks.len());
    let scaled = Scaled {
        scales: &loaded,
        items: &per_item,
    };
    stats.bytes_read_from_files =
        scale_bytes + run_tasks(&tasks, &pieces, &sources, files, stats.threads, &scaled)?;
    Ok(stats)
}

/// Bytes of one positioned write of [`execute_write`] at most (repetitions adjacent in the file are
/// gathered into one buffer up to this size).
const WRITE_CHUNK: u64 = 8 * 1024 * 1024;

/// The write direction over the same items: every item's box is copied from its buffer (the "destination"
/// of a read: the memory being saved) into its tensor's bytes in the file (the "source" of a read), with
/// positioned writes from `threads` scoped threads. The files must exist at their final size (at least the
/// header's `file_len`) with the header already written; they are opened for writing, never truncated or
/// created. Source and file dtypes must be equal (no cast on the way out). All items are validated first
/// ([`crate::region::plan_file_major`]); on an I/O error some regions may have been written.
/// `stats.bytes_copied` counts bytes written; `bytes_read_from_files` stays 0.
pub fn execute_write(
    files: &[Arc<Header>],
    bufs: &[DestBuf<'_>],
    items: &[Item],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    use std::os::unix::fs::FileExt;

    let runs = crate::region::plan_file_major(files, bufs, items)?;
    if let Some(r) = runs
        .iter()
        .find(|r| r.src_dtype != r.dst_dtype || r.src_dtype.is_sub_byte())
    {
        let h = &files[r.file];
        return Err(LoadError::Request {
            path: Some(h.path.clone()),
            tensor: None,
            reason: format!(
                "item {}: writing {} memory into a {} tensor (the write direction does not cast, nor \
                 write sub-byte types)",
                r.item, r.dst_dtype, r.src_dtype
            ),
        });
    }
    let threads = opts.threads.unwrap_or_else(default_threads).max(1);
    let mut stats = ExecStats {
        runs: runs.iter().map(|r| r.reps as usize).sum(),
        backend: "pwrite",
        threads: 1,
        ..ExecStats::default()
    };
    if runs.is_empty() {
        stats.backend = "none";
        return Ok(stats);
    }
    let mut outs: Vec<Option<File>> = Vec::with_capacity(files.len());
    for (f, h) in files.iter().enumerate() {
        if !runs.iter().any(|r| r.file == f) {
            outs.push(None);
            continue;
        }
        // A regular file, opened without blocking, and the file the header was read from: the writes land
        // at the header's offsets, so a path replaced by another file since (its inode differs) is refused
        // before any byte is written. Only the inode is compared: earlier writes changed the times.
        let (file, meta) = crate::mmap::open_regular_for_write(&h.path)?;
        if meta.len() < h.file_len {
            return Err(LoadError::Truncated {
                path: h.path.clone(),
                expected: h.file_len,
                actual: meta.len(),
            });
        }
        let now = FileIdentity::of(&meta);
        if h.identity
            .is_some_and(|id| (id.dev, id.ino) != (now.dev, now.ino))
        {
            return Err(LoadError::Changed {
                path: h.path.clone(),
            });
        }
        outs.push(Some(file));
    }
    let mut pieces = Vec::with_capacity(runs.len());
    for r in &runs {
        r.split(WRITE_CHUNK, &mut pieces);
    }
    pieces.sort_unstable_by_key(|r| (r.file, r.src_off));
    stats.bytes_copied = pieces.iter().map(|r| r.reps * r.dst_bytes() as u64).sum();
    stats.spans = pieces.len();
    stats.threads = threads.min(pieces.len());
    let write_piece = |p: &Run, buf: &mut Vec<u8>| -> Result<(), LoadError> {
        let file = outs[p.file].as_ref().expect("every file with runs is open");
        let path = &files[p.file].path;
        let put = |bytes: &[u8], at: u64| {
            file.write_all_at(bytes, at)
                .map_err(|e| LoadError::io(path, &e))
        };
        let size = p.dst_elem_size() as u64;
        if p.count == 1 || p.src_stride == size {
            // Adjacent in the file within a repetition; repetitions too when they follow each other.
            let adjacent = p.reps == 1 || p.rep_src_stride == p.count * size;
            let group = if adjacent { p.reps } else { 1 };
            let mut r = 0;
            while r < p.reps {
                let at = p.src_off + r * p.rep_src_stride;
                match crate::dest::with_contiguous_reps(p, r..r + group, |bytes| put(bytes, at)) {
                    Some(result) => result?,
                    None => {
                        buf.clear();
                        crate::dest::gather_reps(p, r..r + group, buf);
                        put(buf, at)?;
                    }
                }
                r += group;
            }
            return Ok(());
        }
        // A file-strided run (neither side of the box has a unit file stride): element by element.
        for r in 0..p.reps {
            buf.clear();
            crate::dest::gather_reps(p, r..r + 1, buf);
            for (i, elem) in buf.chunks_exact(size as usize).enumerate() {
                put(
                    elem,
                    p.src_off + r * p.rep_src_stride + i as u64 * p.src_stride,
                )?;
            }
        }
        Ok(())
    };
    run_workers(stats.threads, pieces.len(), |i, buf| {
        write_piece(&pieces[i], buf)
    })?;
    Ok(stats)
}

/// Most byte ranges per file handed to the `auto` residency probe ([`Mapping::resident_fraction`], which
/// asks about at most `RESIDENCY_SAMPLES` = 256 pages spread evenly over them).
const PROBE_RANGES: u64 = 4096;

/// Per file, at most [`PROBE_RANGES`] one-byte ranges at positions spread evenly over the source
/// bytes the runs need (repetitions expanded, the bytes between them left out), so that the probe samples
/// what is read, not the span, in O(runs + PROBE_RANGES) rather than O(repetitions).
fn probe_ranges(runs: &[Run], nfiles: usize) -> Vec<Vec<(u64, u64)>> {
    let mut total = vec![0u64; nfiles];
    for r in runs {
        total[r.file] += r.needed_bytes();
    }
    let step: Vec<u64> = total
        .iter()
        .map(|&t| t.div_ceil(PROBE_RANGES).max(1))
        .collect();
    let mut seen = vec![0u64; nfiles]; // needed bytes of the file's runs so far
    let mut next = vec![0u64; nfiles]; // needed-byte position of the file's next probe
    let mut out: Vec<Vec<(u64, u64)>> = vec![Vec::new(); nfiles];
    for r in runs {
        let f = r.file;
        let (extent, needed) = (r.run_extent(), r.needed_bytes());
        while next[f] < seen[f] + needed {
            let at = next[f] - seen[f];
            let pos = r.src_off + at / extent * r.rep_src_stride + at % extent;
            out[f].push((pos, pos + 1));
            next[f] += step[f];
        }
        seen[f] += needed;
    }
    out
}

/// Splits the runs into pieces of at most `chunk` source bytes (only when some run is longer) and sorts
/// them by (file, offset), keeping the planned order when it is already sorted (items that read forward,
/// planned in file order). Repeated runs stay repeated unless the bytes between repetitions are more than
/// their file's task would read through or populate (`pread_gap` for `pread`, [`MMAP_JOIN_GAP`] for a
/// map), a repetition is large enough for a direct `pread`, or (`pread`) spans of repeated runs overlap
/// other runs: those are expanded, which gives the tasks of one run per repetition.
fn make_pieces(runs: Vec<Run>, mapped: &[bool], chunk: u64, gap: u64) -> Vec<Run> {
    let expand = |r: &Run| {
        r.reps > 1 && {
            let extent = r.run_extent();
            let between = r.rep_src_stride.saturating_sub(extent);
            match mapped[r.file] {
                true => between > MMAP_JOIN_GAP,
                false => between > gap || (r.is_direct() && extent >= DIRECT_MIN),
            }
        }
    };
    let long = |r: &Run| (r.count > 1 || r.reps > 1) && r.src_extent() > chunk;
    let mut pieces = if runs.iter().any(|r| expand(r) || long(r)) {
        let mut pieces = Vec::with_capacity(runs.len() + runs.len() / 4);
        for r in &runs {
            if expand(r) {
                for k in 0..r.reps {
                    r.rep(k).split(chunk, &mut pieces);
                }
            } else {
                r.split(chunk, &mut pieces);
            }
        }
        pieces
    } else {
        runs
    };
    let by_offset = |r: &Run| (r.file, r.src_off);
    if !pieces.is_sorted_by_key(by_offset) {
        pieces.sort_unstable_by_key(by_offset);
    }
    // A buffered pread task reads its whole span: a repeated run whose span overlaps another run's (two
    // items reading interleaved columns of one tensor, or overlapping repetitions split in two) would
    // read those bytes twice. Expand them, which reads them once as before.
    if pread_spans_overlap(&pieces, mapped) {
        let mut flat = Vec::with_capacity(pieces.len());
        for p in &pieces {
            match p.reps > 1 && !mapped[p.file] {
                true => p.expand(&mut flat),
                false => flat.push(*p),
            }
        }
        pieces = flat;
        if !pieces.is_sorted_by_key(by_offset) {
            pieces.sort_unstable_by_key(by_offset);
        }
    }
    pieces
}

/// Whether, among sorted pieces, a repeated piece of a `pread` file overlaps another piece's span.
fn pread_spans_overlap(pieces: &[Run], mapped: &[bool]) -> bool {
    let mut file = usize::MAX;
    let (mut end, mut repeated_end) = (0u64, 0u64);
    for p in pieces.iter().filter(|p| !mapped[p.file]) {
        if p.file != file {
            (file, end, repeated_end) = (p.file, 0, 0);
        }
        if p.src_off < repeated_end || (p.reps > 1 && p.src_off < end) {
            return true;
        }
        end = end.max(p.src_end());
        if p.reps > 1 {
            repeated_end = repeated_end.max(p.src_end());
        }
    }
    false
}

/// Opens the file of `h` (a regular file, without blocking) and checks it against the header: at least as
/// long ([`LoadError::Truncated`]) and the same identity ([`LoadError::Changed`]).
fn open_checked(h: &Header) -> Result<File, LoadError> {
    let (file, meta) = open_regular(&h.path)?;
    if meta.len() < h.file_len {
        return Err(LoadError::Truncated {
            path: h.path.clone(),
            expected: h.file_len,
            actual: meta.len(),
        });
    }
    if h.identity.is_some_and(|id| id != FileIdentity::of(&meta)) {
        return Err(LoadError::Changed {
            path: h.path.clone(),
        });
    }
    Ok(file)
}

/// Checks the file of `h` and maps it when `backend` may copy from a map. The descriptor is kept for
/// positioned reads only when `keep_open`, else closed (a map does not need it; [`Source::file`] reopens).
fn open_source(
    h: &Header,
    backend: Backend,
    ranges: &[(u64, u64)],
    keep_open: bool,
) -> Result<Source, LoadError> {
    let file = open_checked(h)?;
    // Headers parsed from memory have no identity to check a kept map against: map afresh.
    let mapping = || -> Result<Arc<Mapping>, LoadError> {
        let make = || Mapping::new(&file, h.file_len, &h.path);
        if h.identity.is_some() {
            h.map.get_or_map(make)
        } else {
            make().map(Arc::new)
        }
    };
    let map = match backend {
        Backend::Pread => None,
        Backend::Mmap => Some(mapping()?),
        Backend::Auto => {
            let map = mapping()?;
            (map.resident_fraction(ranges) >= AUTO_MMAP_RESIDENT).then_some(map)
        }
    };
    let file = (map.is_none() && keep_open).then(|| Arc::new(file));
    Ok(Source {
        map,
        file: Mutex::new(file),
        pending: AtomicUsize::new(0),
    })
}

fn make_tasks(pieces: &[Run], sources: &[Option<Source>], chunk: u64, gap: u64) -> Vec<Task> {
    let mut tasks: Vec<Task> = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let mapped = sources[p.file].as_ref().is_some_and(|s| s.map.is_some());
        let (start, end) = (p.src_off, p.src_end());
        let mode = match () {
            _ if mapped => Mode::Mmap,
            _ if p.reps == 1 && p.is_direct() && end - start >= DIRECT_MIN => Mode::PreadDirect,
            _ => Mode::PreadBuffered,
        };
        if let Some(t) = tasks.last_mut() {
            let joins = t.file == p.file
                && t.mode == mode
                && match mode {
                    // Group mapped copies into tasks of about `chunk` bytes of nearby runs: a task's
                    // whole span is populated, so it must not stretch over other ranks' data.
                    Mode::Mmap => {
                        start <= t.end + MMAP_JOIN_GAP && end.max(t.end) - t.start <= chunk
                    }
                    Mode::PreadDirect => false,
                    Mode::PreadBuffered => {
                        start <= t.end + gap && end.max(t.end) - t.start <= chunk
                    }
                };
            if joins {
                t.last = i + 1;
                t.start = t.start.min(start);
                t.end = t.end.max(end);
                continue;
            }
        }
        tasks.push(Task {
            file: p.file,
            mode,
            first: i,
            last: i + 1,
            start,
            end,
        });
    }
    tasks
}

/// The dequantization context of a batch: loaded scales and each item's use of them.
struct Scaled<'a> {
    scales: &'a [LoadedScale],
    items: &'a ItemScales,
}

impl Scaled<'_> {
    /// Writes one run (see `write_run`), through its item's scales when it has them.
    fn write(&self, r: &Run, src: &[u8]) {
        match self.items.get(r.item).copied().flatten() {
            Some((s, begin)) => write_run_scaled(r, src, &self.scales[s].map(), begin),
            None => write_run(r, src),
        }
    }
}

fn run_tasks(
    tasks: &[Task],
    pieces: &[Run],
    sources: &[Option<Source>],
    files: &[Arc<Header>],
    threads: usize,
    scaled: &Scaled<'_>,
) -> Result<u64, LoadError> {
    let bytes_read = AtomicU64::new(0);
    // pread tasks ask the kernel to read ahead: the first `lookahead` now, then one more per task taken.
    let lookahead = 2 * threads;
    let prefetch_task = |i: usize| {
        if let Some(t) = tasks.get(i).filter(|t| t.mode != Mode::Mmap) {
            // An open that fails here fails again in the task, which reports it. A file whose tasks are all
            // done (its task ran before this hint) is not opened again.
            let source = sources[t.file].as_ref();
            if let Some(Ok(file)) = source
                .filter(|s| s.pending.load(Ordering::Acquire) > 0)
                .map(|s| s.file(&files[t.file]))
            {
                prefetch(&file, t.start, t.end);
            }
        }
    };
    (0..lookahead).for_each(prefetch_task);
    run_workers(threads, tasks.len(), |i, buf| {
        let task = &tasks[i];
        prefetch_task(i + lookahead);
        let result = run_task(task, pieces, sources, files, buf, scaled);
        if task.mode != Mode::Mmap {
            if let Some(source) = &sources[task.file] {
                source.finish();
            }
        }
        bytes_read.fetch_add(result?, Ordering::Relaxed);
        Ok(())
    })?;
    Ok(bytes_read.into_inner())
}

/// Runs `work(i, buffer)` for every task `i` in `0..tasks` on `threads` scoped workers (the calling thread is
/// one of them; no pool outlives the call), each taking the next task until they run out or one fails, with a
/// scratch buffer of its own. Returns a worker's panic (as [`LoadError::WorkerPanicked`]) before the first
/// task error; after a failure the workers take no new task.
fn run_workers(
    threads: usize,
    tasks: usize,
    work: impl Fn(usize, &mut Vec<u8>) -> Result<(), LoadError> + Sync,
) -> Result<(), LoadError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<LoadError>> = Mutex::new(None);
    let worker = || {
        let mut buf: Vec<u8> = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= tasks {
                break;
            }
            if let Err(e) = work(i, &mut buf) {
                failed.store(true, Ordering::Relaxed);
                first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
            }
        }
    };
    let guarded =
        || catch_unwind(AssertUnwindSafe(worker)).map_err(|payload| panic_error(payload.as_ref()));
    let mut panicked = None;
    std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .spawn_scoped(scope, guarded)
                    .ok()
            })
            .collect();
        if let Err(e) = guarded() {
            panicked.get_or_insert(e);
        }
        for h in helpers {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    panicked.get_or_insert(e);
                }
                Err(payload) => {
                    panicked.get_or_insert(panic_error(payload.as_ref()));
                }
            }
        }
    });
    match panicked {
        Some(e) => Err(e),
        None => first_error
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .map_or(Ok(()), Err),
    }
}

fn panic_error(payload: &(dyn std::any::Any + Send)) -> LoadError {
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into());
    LoadError::WorkerPanicked { message }
}

fn run_task(
    task: &Task,
    pieces: &[Run],
    sources: &[Option<Source>],
    files: &[Arc<Header>],
    buf: &mut Vec<u8>,
    scaled: &Scaled<'_>,
) -> Result<u64, LoadError> {
    #[cfg(test)]
    if files[task.file].path.ends_with("inject-panic.safetensors") {
        panic!("injected worker panic");
    }
    let source = sources[task.file]
        .as_ref()
        .expect("every file with runs is open");
    let path = &files[task.file].path;
    let runs = &pieces[task.first..task.last];
    match task.mode {
        Mode::Mmap => {
            let map = source.map.as_ref().expect("mapped task has a map");
            let extent: u64 = runs.iter().map(Run::needed_bytes).sum();
            // One populate call beats a fault per touched page on a fresh map, even when the runs touch only
            // a quarter of the span's pages (docs/perf-notes.md, "dense populate only").
            map.will_need(task.start, task.end);
            let bytes = map.bytes();
            for r in runs {
                scaled.write(r, &bytes[r.src_off as usize..r.src_end() as usize]);
            }
            Ok(extent)
        }
        Mode::PreadDirect => {
            let r = &runs[0];
            debug_assert_eq!(r.reps, 1);
            let (file, len) = (source.file(&files[task.file])?, files[task.file].file_len);
            with_dense_dst(r, |out| read_exact_at(&file, out, r.src_off, path, len))?;
            Ok(r.src_extent())
        }
        Mode::PreadBuffered => {
            let len = (task.end - task.start) as usize;
            if buf.len() < len {
                buf.resize(len, 0);
            }
            let file = source.file(&files[task.file])?;
            let file_len = files[task.file].file_len;
            read_exact_at(&file, &mut buf[..len], task.start, path, file_len)?;
            for r in runs {
                let at = (r.src_off - task.start) as usize;
                scaled.write(r, &buf[at..at + r.src_extent() as usize]);
            }
            Ok(len as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{cast_dense, Dtype};
    use proptest::prelude::*;
    use std::io::Write;

    /// A one-dimensional item: `len` contiguous elements of tensor 0 of file 0 into the start of dest 0.
    fn flat_item(len: i64) -> Item {
        let mut item = Item {
            ndim: 1,
            ..Item::default()
        };
        (item.lengths[0], item.src_strides[0], item.dst_strides[0]) = (len, 1, 1);
        item
    }

    fn write_file(
        dir: &std::path::Path,
        name: &str,
        tensors: &[(&str, Dtype, Vec<u64>, Vec<u8>)],
    ) -> Arc<Header> {
        let mut json = String::from("{");
        let mut off = 0;
        for (i, (n, dt, shape, data)) in tensors.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&format!(
                r#""{n}":{{"dtype":"{dt}","shape":{shape:?},"data_offsets":[{off},{}]}}"#,
                off + data.len()
            ));
            off += data.len();
        }
        json.push('}');
        let path = dir.join(name);
        let mut f = File::create(&path).unwrap();
        f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
        f.write_all(json.as_bytes()).unwrap();
        for t in tensors {
            f.write_all(&t.3).unwrap();
        }
        drop(f);
        Arc::new(Header::read(&path).unwrap())
    }

    fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    const PAIRS: &[(Dtype, Dtype)] = &[
        (Dtype::U8, Dtype::U8),
        (Dtype::I16, Dtype::I16),
        (Dtype::I32, Dtype::I32),
        (Dtype::F64, Dtype::F64),
        (Dtype::BF16, Dtype::BF16),
        (Dtype::BF16, Dtype::F32),
        (Dtype::F32, Dtype::BF16),
        (Dtype::F16, Dtype::F64),
        (Dtype::F64, Dtype::F8_E4M3),
        (Dtype::F8_E5M2, Dtype::F16),
        (Dtype::F8_E8M0, Dtype::BF16),
    ];

    #[derive(Debug, Clone)]
    struct Case {
        shape: Vec<u64>,
        offsets: Vec<u64>,
        lengths: Vec<u64>,
        perm: Vec<usize>,
        dst_order: Vec<usize>,
        pad: Vec<u64>,
        pair: usize,
        backend: Backend,
        threads: usize,
        gap: u64,
        seed: u64,
    }

    fn case() -> impl Strategy<Value = Case> {
        (0usize..=4)
            .prop_flat_map(|ndim| {
                (
                    proptest::collection::vec(1u64..7, ndim),
                    proptest::collection::vec((0u64..7, 0u64..8), ndim),
                    Just((0..ndim).collect::<Vec<_>>()).prop_shuffle(),
                    Just((0..ndim).collect::<Vec<_>>()).prop_shuffle(),
                    proptest::collection::vec(0u64..3, ndim),
                    0..PAIRS.len(),
                    prop_oneof![
                        Just(Backend::Mmap),
                        Just(Backend::Pread),
                        Just(Backend::Auto)
                    ],
                    1usize..4,
                    prop_oneof![Just(0u64), Just(64 * 1024)],
                    any::<u64>(),
                )
            })
            .prop_map(
                |(shape, boxes, perm, dst_order, pad, pair, backend, threads, gap, seed)| {
                    let offsets: Vec<u64> =
                        boxes.iter().zip(&shape).map(|(b, s)| b.0 % s).collect();
                    let lengths = boxes
                        .iter()
                        .zip(&shape)
                        .zip(&offsets)
                        .map(|((b, s), o)| b.1 % (s - o + 1))
                        .collect();
                    Case {
                        shape,
                        offsets,
                        lengths,
                        perm,
                        dst_order,
                        pad,
                        pair,
                        backend,
                        threads,
                        gap,
                        seed,
                    }
                },
            )
    }

    /// A case's box as an engine item: the source row-major, its dims taken in `perm` order; the other side's
    /// dims laid out in `dst_order` (innermost last) with padding, from element 3 of a buffer of `dst_len`.
    struct Layout {
        item: Item,
        dst_len: usize,
    }

    impl Layout {
        /// `(source element, destination element)` of every element of the box, in row-major box order.
        fn elements(&self) -> Vec<(u64, u64)> {
            let it = &self.item;
            let ndim = it.ndim as usize;
            let lengths: Vec<u64> = it.lengths[..ndim].iter().map(|&n| n as u64).collect();
            let total: u64 = lengths.iter().product();
            (0..total)
                .map(|flat| {
                    let (mut rem, mut se, mut de) = (flat, it.src_base as u64, it.dst_base as u64);
                    for d in (0..ndim).rev() {
                        let i = rem % lengths[d];
                        rem /= lengths[d];
                        se += i * it.src_strides[d] as u64;
                        de += i * it.dst_strides[d] as u64;
                    }
                    (se, de)
                })
                .collect()
        }
    }

    impl Case {
        fn layout(&self, tensor: i64) -> Layout {
            let ndim = self.shape.len();
            let mut sstr = vec![1u64; ndim];
            for d in (0..ndim.saturating_sub(1)).rev() {
                sstr[d] = sstr[d + 1] * self.shape[d + 1];
            }
            let src_base: u64 = self.offsets.iter().zip(&sstr).map(|(o, s)| o * s).sum();
            let lengths: Vec<u64> = self.perm.iter().map(|&d| self.lengths[d]).collect();
            let mut ds = vec![0u64; ndim];
            let mut acc = 1u64;
            for &d in self.dst_order.iter().rev() {
                ds[d] = acc;
                acc *= lengths[d] + self.pad[d];
            }
            let dst_base = 3u64;
            let mut item = Item {
                file: 0,
                tensor,
                src_base: src_base as i64,
                dest: 0,
                dst_base: dst_base as i64,
                ndim: ndim as i64,
                ..Item::default()
            };
            for d in 0..ndim {
                item.lengths[d] = lengths[d] as i64;
                item.src_strides[d] = sstr[self.perm[d]] as i64;
                item.dst_strides[d] = ds[d] as i64;
            }
            Layout {
                item,
                dst_len: (dst_base + acc + 2) as usize,
            }
        }
    }

    fn check(c: &Case) {
        let (sd, dd) = PAIRS[c.pair];
        let numel: u64 = c.shape.iter().product();
        let ssize = sd.byte_size().unwrap();
        let dsize = dd.byte_size().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let pre = random_bytes(24, c.seed ^ 7);
        let data = random_bytes(numel as usize * ssize, c.seed);
        let h = write_file(
            dir.path(),
            "t.safetensors",
            &[
                ("pre", Dtype::U8, vec![24], pre),
                ("t", sd, c.shape.clone(), data.clone()),
            ],
        );
        let layout = c.layout(h.index("t").unwrap() as i64);
        let mut out = vec![0xeeu8; layout.dst_len * dsize];
        let opts = ExecOptions {
            threads: Some(c.threads),
            backend: c.backend,
            pread_gap: c.gap,
        };
        let dest = [DestBuf::from_mut_slice(&mut out, dd)];
        execute(&[h], &dest, &[layout.item], &opts).unwrap();
        // Naive element-by-element reference.
        let mut want = vec![0xeeu8; layout.dst_len * dsize];
        for (se, de) in layout.elements() {
            let (se, de) = (se as usize * ssize, de as usize * dsize);
            cast_dense(sd, dd, &data[se..se + ssize], &mut want[de..de + dsize]);
        }
        assert_eq!(out, want);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
        #[test]
        fn region_copy_matches_naive(c in case()) {
            check(&c);
        }
    }

    /// The write direction: a strided memory box written into a (permuted) box of a file tensor changes
    /// exactly the box's file bytes, each to its memory element (naive reference), and leaves every other
    /// byte of the file as it was.
    fn check_write(c: &Case) {
        let dt = PAIRS[c.pair].0;
        let numel: u64 = c.shape.iter().product();
        let size = dt.byte_size().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let before = random_bytes(numel as usize * size, c.seed);
        let h = write_file(
            dir.path(),
            "w.safetensors",
            &[
                ("pre", Dtype::U8, vec![24], vec![7; 24]),
                ("t", dt, c.shape.clone(), before.clone()),
            ],
        );
        let original = std::fs::read(&h.path).unwrap();
        let layout = c.layout(h.index("t").unwrap() as i64);
        let mut mem = random_bytes(layout.dst_len * size, c.seed ^ 99);
        let opts = ExecOptions {
            threads: Some(c.threads),
            ..ExecOptions::default()
        };
        let want_mem = mem.clone();
        let bufs = [DestBuf::from_mut_slice(&mut mem, dt)];
        let stats = execute_write(std::slice::from_ref(&h), &bufs, &[layout.item], &opts).unwrap();
        let elements = layout.elements();
        assert_eq!(stats.bytes_copied, elements.len() as u64 * size as u64);
        let mut want = original.clone();
        let data = (h.data_start + h.tensors[h.index("t").unwrap()].begin) as usize;
        for (se, de) in elements {
            let (se, de) = (data + se as usize * size, de as usize * size);
            want[se..se + size].copy_from_slice(&want_mem[de..de + size]);
        }
        assert_eq!(std::fs::read(&h.path).unwrap(), want);
        assert_eq!(mem, want_mem, "the memory being saved is only read");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        #[test]
        fn region_write_matches_naive(c in case()) {
            check_write(&c);
        }
    }

    /// The write direction refuses a cast and a file shorter than its header, and writes nothing then.
    #[test]
    fn write_refuses_casts_and_short_files() {
        let dir = tempfile::tempdir().unwrap();
        let h = write_file(
            dir.path(),
            "w.safetensors",
            &[("t", Dtype::BF16, vec![4], vec![0; 8])],
        );
        let original = std::fs::read(&h.path).unwrap();
        let item = flat_item(4);
        let mut mem = vec![1u8; 16];
        let bufs = [DestBuf::from_mut_slice(&mut mem, Dtype::F32)];
        let err = execute_write(
            std::slice::from_ref(&h),
            &bufs,
            &[item],
            &ExecOptions::default(),
        );
        assert!(
            matches!(&err, Err(LoadError::Request { reason, .. }) if reason.contains("does not cast")),
            "{err:?}"
        );
        assert_eq!(std::fs::read(&h.path).unwrap(), original);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&h.path)
            .unwrap();
        f.set_len(h.file_len - 1).unwrap();
        let mut mem = vec![1u8; 8];
        let bufs = [DestBuf::from_mut_slice(&mut mem, Dtype::BF16)];
        let err = execute_write(
            std::slice::from_ref(&h),
            &bufs,
            &[item],
            &ExecOptions::default(),
        );
        assert!(matches!(err, Err(LoadError::Truncated { .. })), "{err:?}");
    }

    /// The write direction writes only into the file its header was read from: a path replaced by another
    /// file since, or by a FIFO (whose open for writing would block until a reader came), is refused before
    /// a byte is written; a file merely written since (new times, same inode) is written again.
    #[test]
    fn write_refuses_a_replaced_file_or_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let h = write_file(
            dir.path(),
            "w.safetensors",
            &[("t", Dtype::BF16, vec![4], vec![0; 8])],
        );
        let item = flat_item(4);
        let mut mem = vec![7u8; 8];
        let bufs = [DestBuf::from_mut_slice(&mut mem, Dtype::BF16)];
        let write = || {
            execute_write(
                std::slice::from_ref(&h),
                &bufs,
                &[item],
                &ExecOptions::default(),
            )
        };
        write().unwrap();
        write().unwrap(); // the first write changed mtime and ctime: still the same file
        assert_eq!(
            std::fs::read(&h.path).unwrap()[h.file_len as usize - 8..],
            [7u8; 8]
        );
        // Another file renamed over the path (as a second save of the same name would).
        let other = dir.path().join("other");
        std::fs::write(&other, vec![1u8; h.file_len as usize + 64]).unwrap();
        std::fs::rename(&other, &h.path).unwrap();
        let err = write();
        assert!(matches!(err, Err(LoadError::Changed { .. })), "{err:?}");
        assert_eq!(
            std::fs::read(&h.path).unwrap(),
            vec![1u8; h.file_len as usize + 64]
        );
        // A FIFO without a reader: refused, not waited on.
        std::fs::remove_file(&h.path).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&h.path).status();
        assert!(made.is_ok_and(|s| s.success()));
        let err = write();
        assert!(err.is_err(), "{err:?}");
    }

    /// Column slices (repeated runs) of row-major tensors whose rows are far apart (expanded for a map
    /// and for pread), long enough for direct preads, split into groups of rows, and two items reading
    /// interleaved columns of one tensor: every backend, gap and thread count copies the right bytes,
    /// counts 1-d runs and copied bytes exactly, and pread reads the interleaved span only once.
    #[test]
    fn repeated_runs_match_naive_across_backends() {
        let dir = tempfile::tempdir().unwrap();
        let shapes: [(&str, u64, u64); 3] =
            [("far", 16, 200_000), ("v", 1024, 2048), ("d", 4, 150_000)];
        let tensors: Vec<(&str, Dtype, Vec<u64>, Vec<u8>)> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(n, r, c))| {
                (
                    n,
                    Dtype::U8,
                    vec![r, c],
                    random_bytes((r * c) as usize, i as u64 + 3),
                )
            })
            .collect();
        let h = write_file(dir.path(), "rep.safetensors", &tensors);
        // (tensor, first column, columns): rows are all rows of the tensor.
        let boxes: [(usize, u64, u64); 5] = [
            (0, 1000, 2000),
            (1, 100, 512),
            (2, 10, 100_000),
            (1, 0, 96),
            (1, 1024, 96),
        ];
        let want: Vec<Vec<u8>> = boxes
            .iter()
            .map(|&(t, c0, n)| {
                let (cols, data) = (tensors[t].2[1], &tensors[t].3);
                data.chunks(cols as usize)
                    .flat_map(|row| row[c0 as usize..(c0 + n) as usize].to_vec())
                    .collect()
            })
            .collect();
        let items: Vec<Item> = boxes
            .iter()
            .enumerate()
            .map(|(k, &(t, c0, n))| {
                let mut item = Item {
                    tensor: h.index(tensors[t].0).unwrap() as i64,
                    src_base: c0 as i64,
                    dest: k as i64,
                    ndim: 2,
                    ..Item::default()
                };
                let (rows, cols) = (tensors[t].2[0] as i64, tensors[t].2[1] as i64);
                item.lengths[..2].copy_from_slice(&[rows, n as i64]);
                item.src_strides[..2].copy_from_slice(&[cols, 1]);
                item.dst_strides[..2].copy_from_slice(&[n as i64, 1]);
                item
            })
            .collect();
        let rows: usize = boxes.iter().map(|b| tensors[b.0].2[0] as usize).sum();
        let nbytes: u64 = want.iter().map(|w| w.len() as u64).sum();
        for backend in [Backend::Mmap, Backend::Pread, Backend::Auto] {
            for gap in [0, 4096, DEFAULT_PREAD_GAP] {
                for threads in [1, 3] {
                    let mut outs: Vec<Vec<u8>> = want.iter().map(|w| vec![0u8; w.len()]).collect();
                    let dests: Vec<DestBuf<'_>> = outs
                        .iter_mut()
                        .map(|o| DestBuf::from_mut_slice(o, Dtype::U8))
                        .collect();
                    let opts = ExecOptions {
                        threads: Some(threads),
                        backend,
                        pread_gap: gap,
                    };
                    let stats = execute(std::slice::from_ref(&h), &dests, &items, &opts).unwrap();
                    let tag = format!("{backend:?} gap {gap} threads {threads}: {stats:?}");
                    assert_eq!(outs, want, "{tag}");
                    assert_eq!((stats.runs, stats.bytes_copied), (rows, nbytes), "{tag}");
                    match stats.backend {
                        "mmap" => assert_eq!(stats.bytes_read_from_files, nbytes, "{tag}"),
                        // The interleaved items' span of v (2 MiB) is read once, not once per item.
                        _ => assert!(stats.bytes_read_from_files < nbytes + (3 << 20), "{tag}"),
                    }
                }
            }
        }
    }

    #[test]
    fn large_runs_split_over_threads_and_backends_agree() {
        let dir = tempfile::tempdir().unwrap();
        let data = random_bytes(3 << 20, 5);
        let h = write_file(
            dir.path(),
            "big.safetensors",
            &[("w", Dtype::BF16, vec![1536, 1024], data)],
        );
        let mut results = Vec::new();
        for backend in [Backend::Mmap, Backend::Pread] {
            for (lengths, base) in [([768i64, 1024], 768 * 1024), ([1536, 256], 512)] {
                let mut out = vec![0u8; (lengths[0] * lengths[1] * 4) as usize];
                let mut item = Item {
                    ndim: 2,
                    src_base: base,
                    ..Item::default()
                };
                item.lengths[..2].copy_from_slice(&lengths);
                item.src_strides[..2].copy_from_slice(&[1024, 1]);
                item.dst_strides[..2].copy_from_slice(&[lengths[1], 1]);
                let opts = ExecOptions {
                    threads: Some(2),
                    backend,
                    ..ExecOptions::default()
                };
                let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
                let stats = execute(std::slice::from_ref(&h), &dest, &[item], &opts).unwrap();
                let want = if backend == Backend::Pread { 4 } else { 2 };
                assert_eq!(stats.threads, want.min(stats.spans), "{stats:?}");
                assert_eq!(stats.backend, backend.name());
                results.push(out);
            }
        }
        assert_eq!(results[0], results[2]);
        assert_eq!(results[1], results[3]);
    }

    #[test]
    fn mapped_tasks_do_not_stretch_over_unread_data() {
        // Runs 128 KiB apart, within one 8 MiB task chunk: joining them would make a task whose populated
        // span covers the unread bytes between them. Adjacent runs still join.
        let dir = tempfile::tempdir().unwrap();
        let h = write_file(
            dir.path(),
            "gap.safetensors",
            &[("w", Dtype::U8, vec![1 << 20], random_bytes(1 << 20, 1))],
        );
        let file = File::open(&h.path).unwrap();
        let map = Arc::new(Mapping::new(&file, h.file_len, &h.path).unwrap());
        let sources = vec![Some(Source {
            map: Some(map),
            file: Mutex::new(None),
            pending: AtomicUsize::new(0),
        })];
        let run = |src_off: u64| Run {
            item: 0,
            file: 0,
            src_off,
            src_stride: 1,
            count: 4096,
            dst_addr: 0,
            dst_stride: 1,
            reps: 1,
            rep_src_stride: 0,
            rep_dst_stride: 0,
            src_dtype: Dtype::U8,
            dst_dtype: Dtype::U8,
            src_nibble: 0,
        };
        let pieces = [
            run(0),
            run(4096),
            run(4096 + (128 << 10)),
            run(8192 + (128 << 10)),
        ];
        let tasks = make_tasks(&pieces, &sources, 8 << 20, DEFAULT_PREAD_GAP);
        let spans: Vec<_> = tasks.iter().map(|t| (t.first, t.last)).collect();
        assert_eq!(spans, [(0, 2), (2, 4)]);
        // The same holds between the repetitions of one run: far apart, they are expanded into runs of
        // their own (and give the same tasks); nearby, they stay one piece and one task.
        let repeated = |stride: u64| Run {
            reps: 4,
            rep_src_stride: stride,
            rep_dst_stride: 4096,
            ..run(0)
        };
        let far = make_pieces(vec![repeated(4096 + (128 << 10))], &[true], 8 << 20, 0);
        assert_eq!(far.len(), 4);
        assert!(far.iter().all(|p| p.reps == 1));
        let tasks = make_tasks(&far, &sources, 8 << 20, DEFAULT_PREAD_GAP);
        assert_eq!(tasks.len(), 4);
        let near = make_pieces(vec![repeated(8192)], &[true], 8 << 20, 0);
        assert_eq!(near, [repeated(8192)]);
        assert_eq!(
            make_tasks(&near, &sources, 8 << 20, DEFAULT_PREAD_GAP).len(),
            1
        );
        // For pread the limit is the pread gap.
        assert_eq!(
            make_pieces(vec![repeated(8192)], &[false], 8 << 20, 4095).len(),
            4
        );
        assert_eq!(
            make_pieces(vec![repeated(8192)], &[false], 8 << 20, 4096).len(),
            1
        );
    }

    #[test]
    fn probe_ranges_sample_needed_bytes_evenly() {
        let run = |file: usize, src_off: u64, count: u64, reps: u64, stride: u64| Run {
            item: 0,
            file,
            src_off,
            src_stride: 1,
            count,
            dst_addr: 0,
            dst_stride: 1,
            reps,
            rep_src_stride: stride,
            rep_dst_stride: 0,
            src_dtype: Dtype::U8,
            dst_dtype: Dtype::U8,
            src_nibble: 0,
        };
        // File 0: 10^4 repetitions of 100 bytes 1000 apart, then one plain run of as many bytes; file 1:
        // one 10-byte run.
        let runs = [
            run(0, 1000, 100, 10_000, 1000),
            run(0, 20_000_000, 1_000_000, 1, 0),
            run(1, 5, 10, 1, 0),
        ];
        let probes = probe_ranges(&runs, 3);
        assert!(probes[2].is_empty());
        assert_eq!(probes[1], (5..15).map(|a| (a, a + 1)).collect::<Vec<_>>());
        let p = &probes[0];
        assert!(
            (PROBE_RANGES - 10..=PROBE_RANGES).contains(&(p.len() as u64)),
            "{}",
            p.len()
        );
        assert!(p.iter().all(|&(a, b)| b == a + 1));
        let (repeated, plain): (Vec<u64>, Vec<u64>) =
            p.iter().map(|r| r.0).partition(|&a| a < 20_000_000);
        // Only bytes the repetitions read, none between them; both runs get half the probes.
        assert!(repeated
            .iter()
            .all(|a| a >= &1000 && (a - 1000) % 1000 < 100));
        assert!(plain.iter().all(|a| (20_000_000..21_000_000).contains(a)));
        assert!(
            repeated.len().abs_diff(plain.len()) <= 2,
            "{} {}",
            repeated.len(),
            plain.len()
        );
        // Evenly spread over the repetitions.
        let last_rep = (repeated.last().unwrap() - 1000) / 1000;
        assert!(last_rep >= 9_990, "{last_rep}");
    }

    #[test]
    fn truncated_changed_and_panics_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let h = write_file(
            dir.path(),
            "t.safetensors",
            &[("w", Dtype::U8, vec![4096], random_bytes(4096, 1))],
        );
        let item = flat_item(4096);
        let mut out = vec![0u8; 4096];
        for backend in [Backend::Mmap, Backend::Pread, Backend::Auto] {
            let opts = ExecOptions {
                backend,
                ..ExecOptions::default()
            };
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
            assert!(execute(std::slice::from_ref(&h), &dest, &[item], &opts).is_ok());
        }
        let bad = write_file(
            dir.path(),
            "inject-panic.safetensors",
            &[("w", Dtype::U8, vec![4096], vec![0; 4096])],
        );
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
        let r = execute(
            &[bad],
            &dest,
            &[item],
            &ExecOptions {
                threads: Some(2),
                ..ExecOptions::default()
            },
        );
        match r {
            Err(LoadError::WorkerPanicked { message }) => assert!(message.contains("injected")),
            other => panic!("{other:?}"),
        }
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&h.path)
            .unwrap();
        f.set_len(1000).unwrap();
        for backend in [Backend::Mmap, Backend::Pread, Backend::Auto] {
            let opts = ExecOptions {
                backend,
                ..ExecOptions::default()
            };
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
            match execute(std::slice::from_ref(&h), &dest, &[item], &opts) {
                Err(LoadError::Truncated {
                    expected,
                    actual: 1000,
                    ..
                }) => assert_eq!(expected, h.file_len),
                other => panic!("{other:?}"),
            }
        }
        f.set_len(h.file_len).unwrap();
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
        std::thread::sleep(std::time::Duration::from_millis(20));
        f.set_len(h.file_len + 1).unwrap();
        assert!(matches!(
            execute(
                std::slice::from_ref(&h),
                &dest,
                &[item],
                &ExecOptions::default()
            ),
            Err(LoadError::Changed { .. })
        ));
    }

    /// Dequantized reads: a transposed, offset box of a [5, 7] e4m3 tensor with fp32 scales over [2, 4]
    /// blocks (ragged last row and column blocks) equals the scalar formula rounded once to bf16, on both
    /// backends and with several threads; bad scales are refused before anything is written.
    #[test]
    fn scaled_items_equal_the_formula() {
        use crate::dtype::{bf16_to_f32, e4m3fn_to_f32, f32_to_bf16};
        let dir = tempfile::tempdir().unwrap();
        let q: Vec<u8> = random_bytes(35, 9).iter().map(|b| b & 0x77).collect(); // no NaN codes
        let scales: Vec<f32> = (0..6).map(|i| 0.25 + i as f32 * 1.5).collect();
        let sbytes: Vec<u8> = scales.iter().flat_map(|x| x.to_le_bytes()).collect();
        let h = write_file(
            dir.path(),
            "q.safetensors",
            &[
                ("w", Dtype::F8_E4M3, vec![5, 7], q.clone()),
                ("w_scale_inv", Dtype::F32, vec![3, 2], sbytes),
            ],
        );
        let scale = |shape: [i64; 2], block: [i64; 2]| {
            let mut s = Scale {
                file: 0,
                tensor: h.index("w_scale_inv").unwrap() as i64,
                ndim: 2,
                ..Scale::default()
            };
            s.shape[..2].copy_from_slice(&shape);
            s.block[..2].copy_from_slice(&block);
            s
        };
        // rows 1..5, cols 2..7 of w, written transposed: out[c][r] (a [5, 4] destination)
        let mut item = Item {
            file: 0,
            tensor: h.index("w").unwrap() as i64,
            src_base: 7 + 2,
            ndim: 2,
            scale: 1,
            ..Item::default()
        };
        item.lengths[..2].copy_from_slice(&[5, 4]);
        item.src_strides[..2].copy_from_slice(&[1, 7]);
        item.dst_strides[..2].copy_from_slice(&[4, 1]);
        let mut want = vec![0u16; 20];
        for c in 0..5 {
            for r in 0..4 {
                let (row, col) = (r + 1, c + 2);
                let x = e4m3fn_to_f32(q[row * 7 + col]) * scales[(row / 2) * 2 + col / 4];
                want[c * 4 + r] = f32_to_bf16(x);
            }
        }
        for (backend, threads) in [(Backend::Mmap, 1), (Backend::Pread, 3)] {
            let opts = ExecOptions {
                threads: Some(threads),
                backend,
                ..ExecOptions::default()
            };
            let mut out = vec![0u8; 40];
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
            let sc = [scale([5, 7], [2, 4])];
            execute_scaled(std::slice::from_ref(&h), &dest, &[item], &sc, &opts).unwrap();
            let got: Vec<u16> = out
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            assert_eq!(got, want, "{backend:?}");
            assert!(got.iter().any(|&g| bf16_to_f32(g) != 0.0));
        }
        // rows 1..5 as they are stored: dense runs (the table-decode path), ragged last column block
        let mut dense = item;
        dense.lengths[..2].copy_from_slice(&[4, 7]);
        dense.src_strides[..2].copy_from_slice(&[7, 1]);
        dense.dst_strides[..2].copy_from_slice(&[7, 1]);
        dense.src_base = 7;
        let mut out = vec![0u8; 56];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
        let sc = [scale([5, 7], [2, 4])];
        execute_scaled(
            std::slice::from_ref(&h),
            &dest,
            &[dense],
            &sc,
            &ExecOptions::default(),
        )
        .unwrap();
        for (k, b) in out.chunks_exact(2).enumerate() {
            let (row, col) = (k / 7 + 1, k % 7);
            let x = e4m3fn_to_f32(q[row * 7 + col]) * scales[(row / 2) * 2 + col / 4];
            assert_eq!(
                u16::from_le_bytes([b[0], b[1]]),
                f32_to_bf16(x),
                "element {k}"
            );
        }
        let opts = ExecOptions::default();
        for bad in [
            scale([5, 7], [4, 4]),
            scale([7, 5], [2, 4]),
            scale([5, 7], [0, 4]),
        ] {
            let mut out = vec![0u8; 40];
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
            let r = execute_scaled(std::slice::from_ref(&h), &dest, &[item], &[bad], &opts);
            assert!(
                matches!(r, Err(LoadError::Request { .. })),
                "{bad:?}: {r:?}"
            );
            assert!(out.iter().all(|&b| b == 0));
        }
        let mut out = vec![0u8; 20];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F8_E5M2)];
        let r = execute_scaled(
            std::slice::from_ref(&h),
            &dest,
            &[item],
            &[scale([5, 7], [2, 4])],
            &opts,
        );
        assert!(matches!(r, Err(LoadError::Request { .. })), "{r:?}");
    }

    /// An MXFP4 box: a stored `[E, Y, G, 16]` U8 tensor (two e2m1 codes a byte, low nibble first) with e8m0
    /// scales `[E, Y, G]` is the logical `[E, Y, G * 32]` tensor of 4-bit elements; a box of it (any start,
    /// odd or even, any permutation of its dims into the destination, as transformers' transposed
    /// `[E, G * 32, Y]`) equals the formula `e2m1(code) * 2^(e - 127)` element by element, written here with
    /// plain arithmetic (a table of the 16 codes from sign, exponent and mantissa bits, `powi`).
    fn check_mxfp4(
        (e, y, g): (u64, u64, u64),
        lo: [u64; 3],
        len: [u64; 3],
        perm: [usize; 3],
        to_f32: bool,
        threads: usize,
        seed: u64,
    ) {
        use crate::dtype::f32_to_bf16;
        let dir = tempfile::tempdir().unwrap();
        let x = g * 32;
        let blocks = random_bytes((e * y * g * 16) as usize, seed);
        let exps: Vec<u8> = random_bytes((e * y * g) as usize, seed ^ 5)
            .iter()
            .map(|b| 120 + b % 16)
            .collect();
        let h = write_file(
            dir.path(),
            "m.safetensors",
            &[
                ("pad", Dtype::U8, vec![3], vec![1, 2, 3]),
                ("w_blocks", Dtype::U8, vec![e, y, g, 16], blocks.clone()),
                ("w_scales", Dtype::U8, vec![e, y, g], exps.clone()),
            ],
        );
        let shape = [e, y, x];
        let strides = [y * x, x, 1];
        let lens: Vec<u64> = (0..3)
            .map(|d| len[d].min(shape[d] - lo[d]).max(1))
            .collect();
        // destination: the box with its dims in `perm` order, row-major
        let dshape: Vec<u64> = perm.iter().map(|&d| lens[d]).collect();
        let mut dstride = [0u64; 3];
        let mut acc = 1;
        for k in (0..3).rev() {
            dstride[perm[k]] = acc;
            acc *= dshape[k];
        }
        let mut item = Item {
            file: 0,
            tensor: h.index("w_blocks").unwrap() as i64,
            src_base: (0..3).map(|d| lo[d] * strides[d]).sum::<u64>() as i64,
            ndim: 3,
            scale: 1,
            ..Item::default()
        };
        for d in 0..3 {
            item.lengths[d] = lens[d] as i64;
            item.src_strides[d] = strides[d] as i64;
            item.dst_strides[d] = dstride[d] as i64;
        }
        let mut sc = Scale {
            file: 0,
            tensor: h.index("w_scales").unwrap() as i64,
            ndim: 3,
            ..Scale::default()
        };
        sc.shape[..3].copy_from_slice(&[e as i64, y as i64, x as i64]);
        sc.block[..3].copy_from_slice(&[1, 1, 32]);
        // the reference, from the bits of each code
        let e2m1 = |c: u8| -> f32 {
            let (sign, exp, man) = (c >> 3, (c >> 1) & 3, c & 1);
            let mag = match exp {
                0 => 0.5 * f32::from(man),
                _ => (1.0 + 0.5 * f32::from(man)) * 2f32.powi(i32::from(exp) - 1),
            };
            if sign == 1 {
                -mag
            } else {
                mag
            }
        };
        let (dt, size) = if to_f32 {
            (Dtype::F32, 4)
        } else {
            (Dtype::BF16, 2)
        };
        let total: u64 = lens.iter().product();
        let mut want = vec![0u8; total as usize * size];
        for i in 0..lens[0] {
            for j in 0..lens[1] {
                for k in 0..lens[2] {
                    let (a, b, c) = (lo[0] + i, lo[1] + j, lo[2] + k);
                    let flat = (a * y + b) * x + c;
                    let byte = blocks[(flat / 2) as usize];
                    let code = if flat % 2 == 0 { byte & 15 } else { byte >> 4 };
                    let s = exps[((a * y + b) * g + c / 32) as usize];
                    let v = e2m1(code) * 2f32.powi(i32::from(s) - 127);
                    let at = (i * dstride[0] + j * dstride[1] + k * dstride[2]) as usize * size;
                    match to_f32 {
                        true => want[at..at + 4].copy_from_slice(&v.to_le_bytes()),
                        false => want[at..at + 2].copy_from_slice(&f32_to_bf16(v).to_le_bytes()),
                    }
                }
            }
        }
        for backend in [Backend::Mmap, Backend::Pread] {
            let opts = ExecOptions {
                threads: Some(threads),
                backend,
                ..ExecOptions::default()
            };
            let mut out = vec![0xaau8; want.len()];
            let dest = [DestBuf::from_mut_slice(&mut out, dt)];
            let stats =
                execute_scaled(std::slice::from_ref(&h), &dest, &[item], &[sc], &opts).unwrap();
            assert_eq!(out, want, "{backend:?} box {lo:?}+{lens:?} perm {perm:?}");
            assert_eq!(stats.bytes_copied, want.len() as u64);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        #[test]
        fn mxfp4_boxes_equal_the_formula(
            (e, y, g) in (1u64..4, 1u64..6, 1u64..3),
            lo in prop::array::uniform3(0u64..64),
            len in prop::array::uniform3(1u64..70),
            perm in Just([0usize, 1, 2]).prop_shuffle(),
            to_f32 in any::<bool>(),
            threads in 1usize..4,
            seed in any::<u64>(),
        ) {
            let shape = [e, y, g * 32];
            let lo = [lo[0] % shape[0], lo[1] % shape[1], lo[2] % shape[2]];
            let perm = [perm[0], perm[1], perm[2]];
            check_mxfp4((e, y, g), lo, len, perm, to_f32, threads, seed);
        }
    }

    /// The transformers layout of gpt-oss experts (`[E, G * 32, Y]`, the logical tensor transposed) from
    /// odd and even starts of the 32-element groups, over one or several tiles of the row-stepping kernel,
    /// and bad MXFP4 scales refused before any write.
    #[test]
    fn mxfp4_transposed_and_refused() {
        check_mxfp4((2, 5, 2), [1, 0, 15], [1, 5, 34], [0, 2, 1], false, 2, 7);
        check_mxfp4((2, 5, 2), [0, 1, 0], [2, 4, 64], [0, 2, 1], true, 1, 8);
        // runs longer than a tile of the row-stepping kernel (several tiles, a ragged last one)
        check_mxfp4((1, 300, 1), [0, 3, 5], [1, 297, 20], [0, 2, 1], false, 1, 9);
        check_mxfp4((2, 260, 2), [1, 0, 30], [1, 260, 5], [0, 2, 1], true, 2, 10);
        let dir = tempfile::tempdir().unwrap();
        let h = write_file(
            dir.path(),
            "m.safetensors",
            &[
                ("w_blocks", Dtype::U8, vec![2, 3, 1, 16], vec![0x21; 96]),
                ("w_scales", Dtype::U8, vec![2, 3, 1], vec![127; 6]),
            ],
        );
        let mut item = Item {
            tensor: h.index("w_blocks").unwrap() as i64,
            scale: 1,
            ..flat_item(192)
        };
        let scale = |shape: [i64; 3], block: [i64; 3]| {
            let mut s = Scale {
                tensor: h.index("w_scales").unwrap() as i64,
                ndim: 3,
                ..Scale::default()
            };
            s.shape[..3].copy_from_slice(&shape);
            s.block[..3].copy_from_slice(&block);
            s
        };
        let opts = ExecOptions::default();
        let mut out = vec![0u8; 192 * 4];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        execute_scaled(
            std::slice::from_ref(&h),
            &dest,
            &[item],
            &[scale([2, 3, 32], [1, 1, 32])],
            &opts,
        )
        .unwrap();
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert!(
            got.chunks_exact(2).all(|p| p == [0.5, 1.0]),
            "low nibble first"
        );
        // the scale of 4-bit elements must describe twice the bytes, in rows of the stored last dim
        for bad in [scale([2, 3, 16], [1, 1, 16]), scale([2, 6, 16], [1, 1, 32])] {
            let mut out = vec![0u8; 192 * 4];
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
            let r = execute_scaled(std::slice::from_ref(&h), &dest, &[item], &[bad], &opts);
            assert!(
                matches!(r, Err(LoadError::Request { .. })),
                "{bad:?}: {r:?}"
            );
            assert!(out.iter().all(|&b| b == 0));
        }
        // a box past the 192 4-bit elements is refused
        item.lengths[0] = 193;
        let mut out = vec![0u8; 193 * 4];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        let r = execute_scaled(
            std::slice::from_ref(&h),
            &dest,
            &[item],
            &[scale([2, 3, 32], [1, 1, 32])],
            &opts,
        );
        assert!(matches!(r, Err(LoadError::Request { .. })), "{r:?}");
    }

    /// Several boxes of one [r, c] e4m3 tensor (random starts and lengths, some transposed into their
    /// destination) under one scale of a random block shape: reading only the touched grid rows gives the
    /// same bytes as reading the scale whole, and never more scale bytes.
    fn check_touched_scales(
        (r, c): (u64, u64),
        (br, bc): (u64, u64),
        boxes: &[([u64; 2], [u64; 2], bool)],
        threads: usize,
        seed: u64,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let q: Vec<u8> = random_bytes((r * c) as usize, seed)
            .iter()
            .map(|b| b & 0x77)
            .collect();
        let (gr, gc) = (r.div_ceil(br), c.div_ceil(bc));
        let sbytes: Vec<u8> = (0..gr * gc)
            .flat_map(|i| (0.5 + i as f32 * 0.75).to_le_bytes())
            .collect();
        let h = write_file(
            dir.path(),
            "t.safetensors",
            &[
                ("w", Dtype::F8_E4M3, vec![r, c], q),
                ("w_scale_inv", Dtype::F32, vec![gr, gc], sbytes),
            ],
        );
        let mut sc = Scale {
            tensor: h.index("w_scale_inv").unwrap() as i64,
            ndim: 2,
            ..Scale::default()
        };
        sc.shape[..2].copy_from_slice(&[r as i64, c as i64]);
        sc.block[..2].copy_from_slice(&[br as i64, bc as i64]);
        let mut items = Vec::new();
        let mut at = 0i64;
        for &(lo, len, transposed) in boxes {
            let lo = [lo[0] % r, lo[1] % c];
            let len = [len[0].min(r - lo[0]).max(1), len[1].min(c - lo[1]).max(1)];
            let mut item = Item {
                tensor: h.index("w").unwrap() as i64,
                src_base: (lo[0] * c + lo[1]) as i64,
                dst_base: at,
                ndim: 2,
                scale: 1,
                ..Item::default()
            };
            item.lengths[..2].copy_from_slice(&[len[0] as i64, len[1] as i64]);
            item.src_strides[..2].copy_from_slice(&[c as i64, 1]);
            let dst = match transposed {
                true => [1, len[0] as i64],
                false => [len[1] as i64, 1],
            };
            item.dst_strides[..2].copy_from_slice(&dst);
            at += (len[0] * len[1]) as i64;
            items.push(item);
        }
        let run = |whole: bool| {
            let opts = ExecOptions {
                threads: Some(threads),
                ..ExecOptions::default()
            };
            let mut out = vec![0u8; at as usize * 2];
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
            let sc = [sc];
            let stats =
                execute_scaled_reading(std::slice::from_ref(&h), &dest, &items, &sc, &opts, whole)
                    .unwrap();
            (out, stats.bytes_read_from_files - stats.bytes_copied / 2)
        };
        let ((part, part_bytes), (whole, whole_bytes)) = (run(false), run(true));
        assert_eq!(
            part, whole,
            "boxes {boxes:?} over [{r}, {c}] blocks [{br}, {bc}]"
        );
        assert!(part.iter().any(|&b| b != 0));
        assert!(part_bytes <= whole_bytes, "{part_bytes} > {whole_bytes}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
        #[test]
        fn touched_scale_rows_equal_the_whole_scale(
            (r, c) in (1u64..40, 1u64..40),
            (br, bc) in (1u64..12, 1u64..12),
            boxes in proptest::collection::vec(
                (prop::array::uniform2(0u64..40), prop::array::uniform2(1u64..40), any::<bool>()),
                1..4,
            ),
            threads in 1usize..3,
            seed in any::<u64>(),
        ) {
            check_touched_scales((r, c), (br, bc), &boxes, threads, seed);
        }
    }

    /// An expert-parallel rank's share: experts 3..4 of 8 of an MXFP4 `[8, Y, G, 16]` tensor (and a dim-0
    /// eighth of an FP8 [64, 24] tensor with [4, 8] blocks) read 1/8 of their scale bytes, not the whole.
    #[test]
    fn a_dim0_eighth_reads_an_eighth_of_the_scales() {
        let dir = tempfile::tempdir().unwrap();
        let (e, y, g) = (8u64, 6u64, 2u64);
        let exps: Vec<u8> = (0..e * y * g).map(|i| 120 + (i % 9) as u8).collect();
        let q: Vec<u8> = random_bytes(64 * 24, 3).iter().map(|b| b & 0x77).collect();
        let fscales: Vec<u8> = (0..16 * 3)
            .flat_map(|i| (1.0 + i as f32).to_le_bytes())
            .collect();
        let h = write_file(
            dir.path(),
            "ep.safetensors",
            &[
                (
                    "w_blocks",
                    Dtype::U8,
                    vec![e, y, g, 16],
                    random_bytes((e * y * g * 16) as usize, 4),
                ),
                ("w_scales", Dtype::U8, vec![e, y, g], exps),
                ("f", Dtype::F8_E4M3, vec![64, 24], q),
                ("f_scale_inv", Dtype::F32, vec![16, 3], fscales),
            ],
        );
        let x = g * 32;
        let mut mx = Item {
            tensor: h.index("w_blocks").unwrap() as i64,
            src_base: (3 * y * x) as i64,
            ndim: 1,
            scale: 1,
            ..Item::default()
        };
        mx.lengths[0] = (y * x) as i64;
        mx.src_strides[0] = 1;
        mx.dst_strides[0] = 1;
        let mut mxs = Scale {
            tensor: h.index("w_scales").unwrap() as i64,
            ndim: 3,
            ..Scale::default()
        };
        mxs.shape[..3].copy_from_slice(&[e as i64, y as i64, x as i64]);
        mxs.block[..3].copy_from_slice(&[1, 1, 32]);
        let mut fp = Item {
            tensor: h.index("f").unwrap() as i64,
            src_base: 5 * 8 * 24,
            dest: 1,
            ndim: 2,
            scale: 2,
            ..Item::default()
        };
        fp.lengths[..2].copy_from_slice(&[8, 24]);
        fp.src_strides[..2].copy_from_slice(&[24, 1]);
        fp.dst_strides[..2].copy_from_slice(&[24, 1]);
        let mut fps = Scale {
            tensor: h.index("f_scale_inv").unwrap() as i64,
            ndim: 2,
            ..Scale::default()
        };
        fps.shape[..2].copy_from_slice(&[64, 24]);
        fps.block[..2].copy_from_slice(&[4, 8]);
        for (item, whole_scale, data) in [(mx, e * y * g, y * x / 2), (fp, 16 * 3 * 4, 8 * 24)] {
            let mut a = vec![0u8; 4 * (y * x) as usize];
            let mut b = vec![0u8; 4 * 8 * 24];
            for backend in [Backend::Mmap, Backend::Pread] {
                let opts = ExecOptions {
                    backend,
                    ..ExecOptions::default()
                };
                let dest = [
                    DestBuf::from_mut_slice(&mut a, Dtype::F32),
                    DestBuf::from_mut_slice(&mut b, Dtype::F32),
                ];
                let read = |whole: bool| {
                    execute_scaled_reading(
                        std::slice::from_ref(&h),
                        &dest,
                        &[item],
                        &[mxs, fps],
                        &opts,
                        whole,
                    )
                    .unwrap()
                    .bytes_read_from_files
                };
                // the weight bytes are the same either way (the mmap backend counts the even and odd
                // nibble runs of a 4-bit box separately): the difference is the scale bytes not read
                let (part, whole) = (read(false), read(true));
                assert!(
                    part >= data + whole_scale / 8,
                    "{part} {item:?} {backend:?}"
                );
                assert_eq!(
                    whole - part,
                    whole_scale - whole_scale / 8,
                    "{item:?} {backend:?}"
                );
            }
            assert!(a.iter().chain(&b).any(|&v| v != 0));
        }
    }
}
