//! Destination buffers and the only code that writes through raw destination pointers.
//!
//! A [`DestBuf`] names caller memory: either a borrowed `&mut [u8]` (safe) or a raw address range
//! ([`DestBuf::from_raw_parts`], `unsafe`: the caller promises the memory stays valid and untouched for
//! the duration of [`crate::execute`]). Every write goes through a [`Run`] produced by
//! [`crate::plan::plan`], which checked that the run's bytes lie inside its destination buffer and that
//! no two runs write the same byte; that check is what makes the writes below sound, also when several
//! threads write disjoint runs of one buffer at once.
//!
//! ```
//! use hp_fastload::{DestBuf, Dtype};
//! let mut out = vec![0u8; 8];
//! let dest = DestBuf::from_mut_slice(&mut out, Dtype::F32);
//! assert_eq!(dest.nbytes(), 8);
//! ```

#![allow(unsafe_code)]

use std::marker::PhantomData;

use crate::dtype::Dtype;
use crate::kernels::{
    cast_dense, cast_scaled, cast_scaled_dense, cast_scaled_nibbles, cast_strided,
    nibble_rows_dense, ElemSink, ScaleMap,
};
#[cfg(target_arch = "x86_64")]
use crate::kernels::{mxfp4_exponent_step, ScaleValues, Scales, E2M1_BF16_BITS};
#[cfg(target_arch = "x86_64")]
use crate::lookup;
#[cfg(target_arch = "x86_64")]
use crate::simd;
use crate::types::Run;

/// Caller memory that a batch of reads writes into, interpreted as elements of `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct DestBuf<'a> {
    addr: usize,
    nbytes: usize,
    dtype: Dtype,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> DestBuf<'a> {
    /// A destination over a mutable byte slice; the borrow lasts as long as the `DestBuf`.
    pub fn from_mut_slice(buf: &'a mut [u8], dtype: Dtype) -> Self {
        DestBuf {
            addr: buf.as_mut_ptr() as usize,
            nbytes: buf.len(),
            dtype,
            _memory: PhantomData,
        }
    }

    /// A destination over raw memory.
    ///
    /// # Safety
    /// `addr..addr + nbytes` must be one allocation that is valid for writes, and nothing else may read or
    /// write it while any [`crate::execute`] call that is given this `DestBuf` runs.
    pub unsafe fn from_raw_parts(addr: usize, nbytes: usize, dtype: Dtype) -> DestBuf<'static> {
        DestBuf {
            addr,
            nbytes,
            dtype,
            _memory: PhantomData,
        }
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// Element type the buffer is written in.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
}

/// Builds the destinations the Python binding received as (address, size, dtype) triples.
#[cfg(feature = "python")]
pub(crate) fn from_python(triples: &[(usize, usize, Dtype)]) -> Vec<DestBuf<'static>> {
    triples
        .iter()
        // SAFETY: the contract of `_core.execute` (documented in python.rs and _core.pyi): each triple is
        // the storage of a live CPU tensor that the caller keeps alive and does not touch during the call.
        .map(|&(addr, nbytes, dtype)| unsafe { DestBuf::from_raw_parts(addr, nbytes, dtype) })
        .collect()
}

/// Calls `f` with the destination bytes of repetition `rep` of a run whose elements are adjacent
/// (`dst_bytes()` from `dst_addr + rep * rep_dst_stride`); the slice does not outlive the call.
#[inline(always)]
fn with_dense_rep<R>(run: &Run, rep: u64, f: impl FnOnce(&mut [u8]) -> R) -> R {
    assert!(
        run.dst_is_dense() && rep < run.reps,
        "dense destination expected"
    );
    let addr = run.dst_addr + rep as usize * run.rep_dst_stride;
    // SAFETY: plan::plan checked that the bytes of every repetition `rep < reps` lie inside one DestBuf
    // (valid for writes by its constructor's contract) and that no other run, nor another repetition of
    // this one, covers any of them.
    let out = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, run.dst_bytes()) };
    f(out)
}

/// Calls `f` with the destination bytes of the first repetition of a run whose elements are adjacent
/// (`dst_bytes()` from `dst_addr`); the slice does not outlive the call.
pub(crate) fn with_dense_dst<R>(run: &Run, f: impl FnOnce(&mut [u8]) -> R) -> R {
    with_dense_rep(run, 0, f)
}

/// Writes `bytes` at byte `at` of repetition `rep` of a direct run ([`Run::is_direct`]: same dtype, elements
/// adjacent on both sides): the bytes the source holds at `src_off + rep * rep_src_stride + at`. Object
/// storage writes fetched bytes this way as they arrive (`crate::objstore`).
#[cfg(feature = "s3")]
pub(crate) fn write_direct(run: &Run, rep: u64, at: usize, bytes: &[u8]) {
    assert!(
        run.is_direct() && !run.src_dtype.is_sub_byte(),
        "write_direct needs a plain byte-copy run"
    );
    with_dense_rep(run, rep, |out| {
        out[at..at + bytes.len()].copy_from_slice(bytes)
    });
}

struct SliceSink<'s> {
    out: &'s mut [u8],
    size: usize,
}

impl ElemSink for SliceSink<'_> {
    #[inline(always)]
    fn put(&mut self, i: usize, bytes: &[u8]) {
        self.out[i * self.size..(i + 1) * self.size].copy_from_slice(bytes);
    }
}

struct StridedSink {
    addr: usize,
    stride: usize,
}

impl ElemSink for StridedSink {
    #[inline(always)]
    fn put(&mut self, i: usize, bytes: &[u8]) {
        let at = (self.addr + i * self.stride) as *mut u8;
        // SAFETY: plan::plan checked that every element `i < count` of every repetition of this run lies
        // inside its DestBuf and is written by no other run or repetition; `addr` is the start of one
        // repetition (`write_run` builds it from `rep < reps`); `bytes.len()` is the destination element
        // size.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len()) };
    }
}

/// Same-dtype dense runs of at least this many bytes are copied with streaming stores ([`stream_copy`]):
/// +40% on a warm full load and +20-30% on Shard(0) rows here; 1 KiB column runs gain nothing (their cost is
/// the page-strided source), so they keep the cached copy (docs/perf-notes.md, "streaming stores").
const STREAM_MIN: usize = 4096;

/// Copies `src` into `dst` (same length) with non-temporal stores: the destination of a load is not read
/// again soon, and streaming stores skip reading each destination cache line before overwriting it. The
/// caller calls [`stream_fence`] after its last piece: a fence per piece drained the write-combining buffers
/// each time, a fifth of a column read of 1-3 KiB rows (docs/perf-notes.md, session 12).
pub(crate) fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_copy needs equal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let n = dst.len();
        let head = ((16 - (dst.as_ptr() as usize & 15)) & 15).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (n - head) / 64 * 64;
        // SAFETY: `head..head + body` lies inside both slices (checked lengths above); the destination
        // pointer at `head` is 16-byte aligned as `_mm_stream_si128` requires; loads are unaligned. SSE2 is
        // part of the x86_64 baseline.
        unsafe {
            let s = src.as_ptr().add(head);
            let d = dst.as_mut_ptr().add(head);
            let mut i = 0;
            while i < body {
                let sp = s.add(i) as *const __m128i;
                let dp = d.add(i) as *mut __m128i;
                let (a, b) = (_mm_loadu_si128(sp), _mm_loadu_si128(sp.add(1)));
                let (c, e) = (_mm_loadu_si128(sp.add(2)), _mm_loadu_si128(sp.add(3)));
                _mm_stream_si128(dp, a);
                _mm_stream_si128(dp.add(1), b);
                _mm_stream_si128(dp.add(2), c);
                _mm_stream_si128(dp.add(3), e);
                i += 64;
            }
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Orders the streaming stores made so far ([`stream_copy`]) before what follows: the bytes are visible to
/// whoever observes this thread's completion.
#[inline(always)]
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_sfence` has no operands and only orders this thread's stores; SSE is x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Repetitions this far ahead of the one being copied have their source lines prefetched by [`gather_rows`].
const GATHER_AHEAD: u64 = 6;

/// Copies the repetitions of a short same-dtype run whose source and destination bytes are each adjacent: a
/// column slice (`Shard(1)` of a row-major tensor) is one such run with a repetition per row, a few KiB
/// taken from every source row. Each row starts on a new page, which the hardware prefetchers do not cross,
/// so the source lines of the row [`GATHER_AHEAD`] rows ahead are prefetched while this one is copied; rows
/// whose destinations are back to back are written with streaming stores (the destination is not read again
/// soon; [`stream_copy`]).
fn gather_rows(run: &Run, src: &[u8]) {
    let extent = run.run_extent() as usize;
    let step = run.rep_src_stride as usize;
    let reps = run.reps;
    let stream = run.rep_dst_stride == extent && extent >= 256;
    for r in 0..reps {
        if r + GATHER_AHEAD < reps {
            let ahead = &src[(r + GATHER_AHEAD) as usize * step..][..extent];
            prefetch_lines(ahead);
        }
        let from = &src[r as usize * step..][..extent];
        with_dense_rep(run, r, |out| match stream {
            true => stream_copy(out, from),
            false => out.copy_from_slice(from),
        });
    }
    if stream {
        stream_fence();
    }
}

/// Asks the CPU to bring every cache line of `bytes` into the cache (a hint: no fault, no effect on values).
#[inline(always)]
fn prefetch_lines(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut at = 0;
        while at < bytes.len() {
            // SAFETY: `at < bytes.len()`, so the address lies inside the borrowed slice; a prefetch reads
            // nothing architecturally and cannot fault. SSE is part of the x86_64 baseline.
            unsafe { _mm_prefetch(bytes.as_ptr().add(at) as *const i8, _MM_HINT_T0) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Writes every repetition of a run from `src`, which starts at the run's first source byte and spans
/// at least [`Run::src_extent`] bytes.
pub(crate) fn write_run(run: &Run, src: &[u8]) {
    let (sd, dd) = (run.src_dtype, run.dst_dtype);
    let count = run.count as usize;
    let extent = run.run_extent() as usize;
    let src_step = run.rep_src_stride as usize;
    let src_stride = run.src_stride as usize;
    let rep_src = |r: u64| &src[r as usize * src_step..][..extent];
    match (run.dst_is_dense(), run.src_is_dense()) {
        (true, true) if sd == dd && run.reps > 1 && extent < STREAM_MIN => gather_rows(run, src),
        (true, true) if sd == dd && extent >= STREAM_MIN => {
            for r in 0..run.reps {
                with_dense_rep(run, r, |out| stream_copy(out, rep_src(r)));
            }
            stream_fence();
        }
        (true, true) => {
            for r in 0..run.reps {
                with_dense_rep(run, r, |out| cast_dense(sd, dd, rep_src(r), out));
            }
        }
        (true, false) => {
            let size = run.dst_elem_size();
            for r in 0..run.reps {
                with_dense_rep(run, r, |out| {
                    let mut sink = SliceSink { out, size };
                    cast_strided(sd, dd, rep_src(r), src_stride, count, &mut sink);
                });
            }
        }
        (false, _) => {
            for r in 0..run.reps {
                let mut sink = StridedSink {
                    addr: run.dst_addr + r as usize * run.rep_dst_stride,
                    stride: run.dst_stride,
                };
                cast_strided(sd, dd, rep_src(r), src_stride, count, &mut sink);
            }
        }
    }
}

/// Defines [`cast_scaled_dense`] compiled for a set of x86-64 vector features: the same scalar semantics and
/// no fused multiply-add, so every build's values are bit for bit those of the SSE2 build.
#[cfg(target_arch = "x86_64")]
macro_rules! scaled_dense_for {
    ($(#[$doc:meta])* $name:ident, $features:literal) => {
        $(#[$doc])*
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, ".")]
        #[target_feature(enable = $features)]
        unsafe fn $name(
            pair: (Dtype, Dtype),
            src: &[u8],
            dst: &mut [u8],
            map: &ScaleMap<'_>,
            flat0: u64,
        ) {
            cast_scaled_dense(pair, src, dst, map, flat0);
        }
    };
}

#[cfg(target_arch = "x86_64")]
scaled_dense_for!(
    /// [`cast_scaled_dense`] for AVX2 (8 lanes and byte-to-dword loads in the vectorized block loop).
    cast_scaled_dense_avx2,
    "avx2"
);

#[cfg(target_arch = "x86_64")]
scaled_dense_for!(
    /// [`cast_scaled_dense`] for AVX-512 (16 lanes).
    cast_scaled_dense_avx512,
    "avx512f,avx512bw"
);

/// [`cast_scaled_dense`] through the fastest code this CPU runs: the per-block lookup where the span reuses
/// its tables (`crate::lookup`), else the arithmetic kernel at the widest vector width.
fn dequantize_dense(
    pair: (Dtype, Dtype),
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    #[cfg(target_arch = "x86_64")]
    if lookup::worthwhile(pair, src.len(), map) && lookup::supported() {
        // SAFETY: `lookup::supported` holds only at a level the CPU was detected to support (`simd::level`).
        unsafe { lookup::dequantize_dense(pair, src, dst, map, flat0) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx512bw() {
        // SAFETY: `avx512bw` holds only where AVX-512 F and BW were detected on this CPU (`simd::level`).
        unsafe { cast_scaled_dense_avx512(pair, src, dst, map, flat0) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: `avx2` holds only where AVX2 was detected on this CPU (`simd::level`).
        unsafe { cast_scaled_dense_avx2(pair, src, dst, map, flat0) };
        return;
    }
    cast_scaled_dense(pair, src, dst, map, flat0);
}

/// Writes every repetition of a run of a dequantized item from `src` (as [`write_run`]): each element is
/// multiplied by its scale from `map` before the cast. `begin` is the absolute file offset of the quantized
/// tensor's first byte, which turns the run's source offsets into the tensor's flat element indices.
pub(crate) fn write_run_scaled(run: &Run, src: &[u8], map: &ScaleMap<'_>, begin: u64) {
    let (sd, dd) = (run.src_dtype, run.dst_dtype);
    let count = run.count as usize;
    let extent = run.run_extent() as usize;
    if run.src_nibble != 0 {
        write_nibble_run(run, src, map, begin);
        return;
    }
    let size = run
        .src_dtype
        .byte_size()
        .expect("dequantized sources are byte-sized") as u64;
    let src_stride = run.src_stride as usize;
    let step = match count {
        1 => 0,
        _ => run.src_stride / size,
    };
    let stride_bytes = if count == 1 {
        size as usize
    } else {
        src_stride
    };
    for r in 0..run.reps {
        let off = r * run.rep_src_stride;
        let flat0 = (run.src_off + off - begin) / size;
        let rep = &src[off as usize..][..extent];
        match run.dst_is_dense() {
            // Streaming stores through an L1 staging buffer (as `write_run` does for plain copies) measured
            // slower here: docs/perf-notes.md, "Session 6: dequantization kernel".
            true if step == 1 => with_dense_rep(run, r, |out| {
                dequantize_dense((sd, dd), rep, out, map, flat0)
            }),
            true => with_dense_rep(run, r, |out| {
                let mut sink = SliceSink {
                    out,
                    size: run.dst_elem_size(),
                };
                cast_scaled(
                    (sd, dd),
                    rep,
                    stride_bytes,
                    count,
                    map,
                    (flat0, step),
                    &mut sink,
                );
            }),
            false => {
                let mut sink = StridedSink {
                    addr: run.dst_addr + r as usize * run.rep_dst_stride,
                    stride: run.dst_stride,
                };
                cast_scaled(
                    (sd, dd),
                    rep,
                    stride_bytes,
                    count,
                    map,
                    (flat0, step),
                    &mut sink,
                );
            }
        }
    }
}

/// Elements of one repetition per tile of [`write_nibble_run`]'s row-stepping case (a tile's source lines,
/// one per element, stay in L1 across the repetitions).
const NIBBLE_TILE: usize = 128;

/// [`write_run_scaled`] for a run of MXFP4 nibbles (`run.src_nibble`: 1 the low, 2 the high nibble of each
/// source byte); flat indices count 4-bit elements, two a byte.
fn write_nibble_run(run: &Run, src: &[u8], map: &ScaleMap<'_>, begin: u64) {
    let (count, extent) = (run.count as usize, run.run_extent() as usize);
    let high = run.src_nibble == 2;
    let (stride, step) = match count {
        1 => (1, 0),
        _ => (run.src_stride as usize, 2 * run.src_stride),
    };
    let flat_of = |r: u64| 2 * (run.src_off + r * run.rep_src_stride - begin) + u64::from(high);
    if run.dst_is_dense() && count > 1 {
        if let Some((_, cell_step)) = map.row_steps(flat_of(0), step) {
            // Tiles of NIBBLE_TILE elements of every repetition in turn: neighbouring repetitions (the next
            // columns) read the same source lines, which then stay in L1.
            let cells: Vec<usize> = (0..run.reps).map(|r| map.locate(flat_of(r)).0).collect();
            #[cfg(target_arch = "x86_64")]
            if run.dst_dtype == Dtype::BF16 && run.rep_src_stride == 1 && avx2() {
                let quad = avx512bw();
                // SAFETY: `avx2` and `avx512bw` hold only where the CPU was detected to have AVX2, and AVX-512 F
                // and BW (`simd::level`).
                unsafe { nibble_tiles_avx2(run, src, map.values, &cells, cell_step, quad) };
                return;
            }
            let size = run.dst_elem_size();
            let pair = (high, run.dst_dtype);
            for t0 in (0..count).step_by(NIBBLE_TILE) {
                let t1 = count.min(t0 + NIBBLE_TILE);
                for (r, &cell0) in cells.iter().enumerate() {
                    let off = r * run.rep_src_stride as usize + t0 * stride;
                    let cells = (cell0 + t0 * cell_step, cell_step);
                    with_dense_rep(run, r as u64, |out| {
                        let out = &mut out[t0 * size..t1 * size];
                        nibble_rows_dense(pair, &src[off..], stride, map.values, cells, out)
                    });
                }
            }
            return;
        }
    }
    for r in 0..run.reps {
        let off = r * run.rep_src_stride;
        let flat0 = flat_of(r);
        let rep = &src[off as usize..][..extent];
        let rows = match run.dst_is_dense() {
            true => map.row_steps(flat0, step),
            false => None,
        };
        if let Some(cells) = rows {
            with_dense_rep(run, r, |out| {
                let pair = (high, run.dst_dtype);
                nibble_rows_dense(pair, rep, stride, map.values, cells, out)
            });
        } else if run.dst_is_dense() {
            with_dense_rep(run, r, |out| {
                let mut sink = SliceSink {
                    out,
                    size: run.dst_elem_size(),
                };
                let at = (flat0, step);
                cast_scaled_nibbles(
                    (high, run.dst_dtype),
                    rep,
                    stride,
                    count,
                    map,
                    at,
                    &mut sink,
                );
            });
        } else {
            let mut sink = StridedSink {
                addr: run.dst_addr + r as usize * run.rep_dst_stride,
                stride: run.dst_stride,
            };
            let at = (flat0, step);
            cast_scaled_nibbles(
                (high, run.dst_dtype),
                rep,
                stride,
                count,
                map,
                at,
                &mut sink,
            );
        }
    }
}

/// Byte columns (repetitions) and source rows (elements) of one tile of [`nibble_tiles_avx2`].
#[cfg(target_arch = "x86_64")]
const NIBBLE_SIMD_TILE: usize = 16;

/// Tiles side by side in one band of [`nibble_tiles_avx2`] (64 byte columns: a whole cache line of each
/// source row).
#[cfg(target_arch = "x86_64")]
const NIBBLE_BAND: usize = 4;

/// How [`nibble_tiles_avx2`] decodes a tile (16 elements of a scale column): every scale a narrow step
/// ([`crate::kernels::NARROW_STEPS`]: the step added to the value's bits), some other e8m0 step (the wide decode,
/// `kernels::mxfp4_wide_bits`), or some scale with no step (an arbitrary `f32`: the scalar kernel).
/// The classes are bits, so that a tile's is its rows' or'ed ([`SCALAR`] wins over [`WIDE`]).
#[cfg(target_arch = "x86_64")]
const NARROW: u8 = 0;
#[cfg(target_arch = "x86_64")]
const WIDE: u8 = 1;
#[cfg(target_arch = "x86_64")]
const SCALAR: u8 = 2;

/// The scales of a run of [`nibble_tiles_avx2`] as exponent steps ([`mxfp4_exponent_step`]), transposed so
/// that a tile reads its 16 steps as two vectors: the run's byte columns share a few scale columns
/// (`slot[r]` for column `r`: the 32 elements of a block are 16 byte columns), and `steps[slot * pitch +
/// i]` is element `i`'s step in that scale column; `class[slot * blocks + i / 16]` is how that tile height
/// decodes ([`NARROW`], [`WIDE`] or [`SCALAR`]). The pitch is the count padded to a multiple of 16 plus
/// 16, so that slots are never a multiple of 4 KiB apart (a count of 2048 made every slot's steps of one
/// element fall into the same L1 set, and their writes cost a third of the kernel).
#[cfg(target_arch = "x86_64")]
struct RunSteps {
    pitch: usize,
    blocks: usize,
    slot: Vec<usize>,
    steps: Vec<i16>,
    class: Vec<u8>,
}

#[cfg(target_arch = "x86_64")]
impl RunSteps {
    /// The steps of `count` elements of byte columns whose first scale cells are `cells`, the cells of
    /// consecutive elements `step` apart. Consecutive columns with the same first cell share a slot; the
    /// scales are read row by row (element `i`'s cells of every slot, adjacent in the grid when the slots
    /// are consecutive blocks), each once.
    fn new(cells: &[usize], step: usize, count: usize, values: ScaleValues<'_>) -> Self {
        match values {
            ScaleValues::F32(v) => {
                Self::with(cells, step, count, |_, _| 0, |i| step_class(v.scale(i)))
            }
            ScaleValues::E8m0(b) => Self::with(
                cells,
                step,
                count,
                // SAFETY: `RunSteps` is built only inside `nibble_tiles_avx2`, which runs where AVX2 was
                // detected.
                |steps, bases| unsafe { steps.e8m0_groups_avx2(bases, b, step, count) },
                |i| E8M0_STEPS[usize::from(b[i])],
            ),
        }
    }

    /// [`RunSteps::new`] over one kind of scale values: `groups(steps, bases)` fills the steps of every
    /// row of whole tile heights of the slots it can and returns how many leading slots it filled;
    /// `step_of(cell)` is a cell's step and class, for every other step.
    #[inline(always)]
    fn with(
        cells: &[usize],
        step: usize,
        count: usize,
        groups: impl FnOnce(&mut Self, &[usize]) -> usize,
        step_of: impl Fn(usize) -> (i16, u8),
    ) -> Self {
        const T: usize = NIBBLE_SIMD_TILE;
        let mut slot = Vec::with_capacity(cells.len());
        let mut bases: Vec<usize> = Vec::new();
        for &c in cells {
            if bases.last() != Some(&c) {
                bases.push(c);
            }
            slot.push(bases.len() - 1);
        }
        let blocks = count.div_ceil(T);
        let pitch = blocks * T + T;
        let mut me = RunSteps {
            pitch,
            blocks,
            slot,
            steps: vec![0i16; bases.len() * pitch],
            class: vec![NARROW; bases.len() * blocks],
        };
        let filled = groups(&mut me, &bases);
        // Tile height by tile height, each slot's 16 steps written side by side without a branch (the 16
        // source lines of the scales stay in L1 across the slots); the slots `groups` filled only past
        // their whole tile heights.
        for b in 0..blocks {
            let rows = b * T..count.min(b * T + T);
            let first = if rows.len() == T { filled } else { 0 };
            for (s, &base) in bases.iter().enumerate().skip(first) {
                let out = &mut me.steps[s * pitch + rows.start..s * pitch + rows.end];
                let mut how = NARROW;
                for (o, i) in out.iter_mut().zip(rows.clone()) {
                    let (st, c) = step_of(base + i * step);
                    *o = st;
                    how |= c;
                }
                me.class[s * blocks + b] = how;
            }
        }
        me
    }

    /// The steps of e8m0 scale bytes `b` for slots in groups of up to 16 whose cells are consecutive (a
    /// run over transposed experts: its slots are neighbouring blocks of one scale row; gpt-oss's 90 a
    /// row are five groups and one of 10), a 16 x 16 byte matrix (rows of a tile height, 16 bytes of
    /// each row from the group's first cell, one load) at a time: transposed into each slot's 16 bytes,
    /// widened to `(b - 127) << 7` ([`E8M0_STEPS`]), a tile [`WIDE`] where some byte is outside
    /// `2..=252`; a short group's other bytes are read (zeros past the end of `b`) and dropped. Returns
    /// how many leading slots it filled (their whole tile heights); the first group that is not
    /// consecutive ends it.
    #[target_feature(enable = "avx2")]
    fn e8m0_groups_avx2(&mut self, bases: &[usize], b: &[u8], step: usize, count: usize) -> usize {
        use std::arch::x86_64::*;
        const T: usize = NIBBLE_SIMD_TILE;
        let full = count / T;
        let mut filled = 0;
        while filled < bases.len() && full > 0 {
            let n = (bases.len() - filled).min(T);
            let base = bases[filled];
            let consecutive = (0..n).all(|k| bases[filled + k] == base + k);
            if !consecutive {
                break;
            }
            for blk in 0..full {
                // (a loop, not `array::from_fn`: vectors returned through a function without the target
                // feature go through memory, a tenth of the rank's time)
                let mut rows = [_mm_setzero_si128(); T];
                for (y, row) in rows.iter_mut().enumerate() {
                    let at = &b[base + (blk * T + y) * step..];
                    let mut last = [0u8; T]; // a short group's last row may end `b`
                    let at = match at.len() >= T {
                        true => &at[..T],
                        false => {
                            last[..at.len()].copy_from_slice(at);
                            &last[..]
                        }
                    };
                    // SAFETY: `at` holds the 16 bytes read (unaligned, as `loadu` allows).
                    *row = unsafe { _mm_loadu_si128(at.as_ptr().cast()) };
                }
                for (k, col) in transpose_16x16(rows).into_iter().enumerate().take(n) {
                    let s = filled + k;
                    let wide = _mm256_slli_epi16::<7>(_mm256_sub_epi16(
                        _mm256_cvtepu8_epi16(col),
                        _mm256_set1_epi16(127),
                    ));
                    let out = &mut self.steps[s * self.pitch + blk * T..][..T];
                    // SAFETY: `out` holds the 16 `i16` (32 bytes) stored, unaligned.
                    unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), wide) };
                    // byte - 2 >= 251 (unsigned): a byte outside 2..=252
                    let x = _mm_sub_epi8(col, _mm_set1_epi8(2));
                    let outside = _mm_cmpeq_epi8(_mm_max_epu8(x, _mm_set1_epi8(-5)), x);
                    self.class[s * self.blocks + blk] = match _mm_movemask_epi8(outside) {
                        0 => NARROW,
                        _ => WIDE,
                    };
                }
            }
            filled += n;
        }
        filled
    }

    /// How the four tiles of a band from byte column `r0` decode at the tile height from element `y`
    /// ([`NARROW`] or [`WIDE`]) when each lies within one scale column and none needs the scalar kernel,
    /// else None.
    #[inline(always)]
    fn band(&self, r0: usize, y: usize) -> Option<u8> {
        const T: usize = NIBBLE_SIMD_TILE;
        let mut how = NARROW;
        for t in 0..NIBBLE_BAND {
            let s = self.slot[r0 + t * T];
            how = how.max(self.class(s, y));
            if self.slot[r0 + t * T + T - 1] != s || how >= SCALAR {
                return None;
            }
        }
        Some(how)
    }

    /// How slot `slot` decodes the tile height from element `y` ([`NARROW`], [`WIDE`] or [`SCALAR`]).
    fn class(&self, slot: usize, y: usize) -> u8 {
        match self.class[slot * self.blocks + y / NIBBLE_SIMD_TILE] {
            c if c & SCALAR != 0 => SCALAR,
            c => c,
        }
    }
}

/// [`step_class`] of each e8m0 scale byte's value ([`crate::kernels::mxfp4_scale_to_f32`]), looked up: the
/// steps of a run's scale bytes were computed through their `f32` values, a tenth of the tile kernel's time
/// on whole gpt-oss experts (docs/perf-notes.md, "Session 16").
#[cfg(target_arch = "x86_64")]
static E8M0_STEPS: [(i16, u8); 256] = e8m0_steps();

#[cfg(target_arch = "x86_64")]
const fn e8m0_steps() -> [(i16, u8); 256] {
    let mut table = [(0i16, NARROW); 256];
    let mut b = 0;
    while b < 256 {
        // byte 255 is 2^128: its step too is `(b - 127) << 7`
        let class = if b >= 2 && b <= 252 { NARROW } else { WIDE };
        table[b] = ((b as i16 - 127) << 7, class);
        b += 1;
    }
    table
}

/// The exponent step of an MXFP4 scale ([`mxfp4_exponent_step`], 0 where there is none) and how a tile with
/// it decodes; the narrow scales of real checkpoints are told apart first, with one test.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn step_class(scale: f32) -> (i16, u8) {
    let bits = scale.to_bits();
    let e = bits >> 23; // a negative scale's sign bit lands at bit 8: not narrow
    if bits & 0x007f_ffff == 0 && e.wrapping_sub(2) <= 250 {
        let step = (e as i16 - 127) << 7;
        debug_assert!(crate::kernels::NARROW_STEPS.contains(&step));
        return (step, NARROW);
    }
    match mxfp4_exponent_step(scale) {
        Some(st) => (st, WIDE),
        None => (0, SCALAR),
    }
}

/// Defines the wide decode of [`nibble_tiles_avx2`] for one vector width: the bf16 bits of `bits` (16-bit
/// lanes: e2m1 values, `zeros` all-ones where the code is ±0) times the scales of exponent steps `steps`
/// ([`mxfp4_exponent_step`], any e8m0 byte), lane by lane the operations of the scalar model
/// `kernels::mxfp4_wide_bits`: the step added to the magnitude with signed saturation, `min` with
/// infinity's bits for an overflow, the subnormal `(2 + f) << (5 + E')` where the exponent `E'` came out 0
/// or -1, the sign put back; zero codes stay ±0.
#[cfg(target_arch = "x86_64")]
macro_rules! wide_decode {
    ($(#[$doc:meta])* $name:ident, $vec:ident, $set1:ident, $and:ident, $andnot:ident, $or:ident, $adds:ident,
     $min:ident, $srli:ident, $cmpgt:ident, $blendv:ident) => {
        $(#[$doc])*
        #[target_feature(enable = "avx2")]
        #[inline]
        fn $name(
            bits: std::arch::x86_64::$vec,
            steps: std::arch::x86_64::$vec,
            zeros: std::arch::x86_64::$vec,
        ) -> std::arch::x86_64::$vec {
            use std::arch::x86_64::*;
            let sign = $and(bits, $set1(i16::MIN));
            let e = $adds($andnot($set1(i16::MIN), bits), steps);
            let normal = $min(e, $set1(0x7f80));
            let t = $or($srli::<1>($and(e, $set1(0x40))), $set1(0x40));
            let sub = $blendv(t, $srli::<1>(t), $cmpgt($set1(0), e));
            let mag = $blendv(normal, sub, $cmpgt($set1(0x80), e));
            $or($andnot(zeros, mag), sign)
        }
    };
}

#[cfg(target_arch = "x86_64")]
wide_decode!(
    /// The wide decode of 8 lanes (`wide_decode`).
    wide_lanes,
    __m128i,
    _mm_set1_epi16,
    _mm_and_si128,
    _mm_andnot_si128,
    _mm_or_si128,
    _mm_adds_epi16,
    _mm_min_epi16,
    _mm_srli_epi16,
    _mm_cmpgt_epi16,
    _mm_blendv_epi8
);

#[cfg(target_arch = "x86_64")]
wide_decode!(
    /// The wide decode of 16 lanes (`wide_decode`).
    wide_lanes_256,
    __m256i,
    _mm256_set1_epi16,
    _mm256_and_si256,
    _mm256_andnot_si256,
    _mm256_or_si256,
    _mm256_adds_epi16,
    _mm256_min_epi16,
    _mm256_srli_epi16,
    _mm256_cmpgt_epi16,
    _mm256_blendv_epi8
);

/// The wide decode (`wide_decode`) of 32 lanes with AVX-512: the same operations, the lane selections by mask
/// registers; `nonzero` marks the lanes whose code is not ±0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn wide_lanes_512(
    bits: std::arch::x86_64::__m512i,
    steps: std::arch::x86_64::__m512i,
    nonzero: std::arch::x86_64::__mmask32,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let sign = _mm512_and_si512(bits, _mm512_set1_epi16(i16::MIN));
    let e = _mm512_adds_epi16(
        _mm512_andnot_si512(_mm512_set1_epi16(i16::MIN), bits),
        steps,
    );
    let normal = _mm512_min_epi16(e, _mm512_set1_epi16(0x7f80));
    let t = _mm512_or_si512(
        _mm512_srli_epi16::<1>(_mm512_and_si512(e, _mm512_set1_epi16(0x40))),
        _mm512_set1_epi16(0x40),
    );
    let negative = _mm512_cmpgt_epi16_mask(_mm512_setzero_si512(), e);
    let sub = _mm512_mask_blend_epi16(negative, t, _mm512_srli_epi16::<1>(t));
    let small = _mm512_cmpgt_epi16_mask(_mm512_set1_epi16(0x80), e);
    let mag = _mm512_mask_blend_epi16(small, normal, sub);
    _mm512_or_si512(_mm512_maskz_mov_epi16(nonzero, mag), sign)
}

/// Whether the 512-bit dequantizing and nibble kernels run: AVX-512 F and BW detected on this CPU and the level
/// not capped below them (`crate::simd`).
#[cfg(target_arch = "x86_64")]
fn avx512bw() -> bool {
    simd::level() >= simd::Level::Avx512
}

/// Whether the 256-bit kernels run: AVX2 detected on this CPU and the level not capped below it (`crate::simd`).
#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    simd::level() >= simd::Level::Avx2
}

/// The low (`E2M1_BF16_BYTES[0]`) and high bytes of [`E2M1_BF16_BITS`], built at compile time (built per
/// call, with `array::map`, they were 7% of the tile kernel's time in criterion's `mxfp4/whole`).
#[cfg(target_arch = "x86_64")]
static E2M1_BF16_BYTES: [[u8; 16]; 2] = {
    let mut t = [[0u8; 16]; 2];
    let mut i = 0;
    while i < 16 {
        t[0][i] = E2M1_BF16_BITS[i] as u8;
        t[1][i] = (E2M1_BF16_BITS[i] >> 8) as u8;
        i += 1;
    }
    t
};

/// The e2m1 code -> bf16 bits lookup of the nibble kernels, as two 16-byte vectors: each code's low bytes and
/// its high bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn e2m1_tables() -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
    use std::arch::x86_64::_mm_loadu_si128;
    let [lo_tab, hi_tab] = &E2M1_BF16_BYTES;
    // SAFETY: each array holds the 16 bytes read.
    unsafe {
        (
            _mm_loadu_si128(lo_tab.as_ptr().cast()),
            _mm_loadu_si128(hi_tab.as_ptr().cast()),
        )
    }
}

/// [`nibble_tiles_avx2`]'s column loop for a pair of tiles with the wide decode (`wide_decode`), out of line
/// so that the narrow loop of real checkpoints keeps its registers (inline, it measured 4% slower): `cols`
/// the 16 transposed code vectors (the left tile in the low lanes), `steps` the rows 0..8 and 8..16 of both
/// tiles' steps; column `k` of the pair goes to `stage[k * pitch + at..]`, 32 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
fn wide_pair_columns(
    cols: &[std::arch::x86_64::__m256i; NIBBLE_SIMD_TILE],
    (s0, s1): (std::arch::x86_64::__m256i, std::arch::x86_64::__m256i),
    stage: &mut [u8],
    pitch: usize,
    at: usize,
) {
    use std::arch::x86_64::*;
    const T: usize = NIBBLE_SIMD_TILE;
    let (tlo, thi) = e2m1_tables();
    let (tlo2, thi2) = (
        _mm256_broadcastsi128_si256(tlo),
        _mm256_broadcastsi128_si256(thi),
    );
    for (k, &codes) in cols.iter().enumerate() {
        let lo = _mm256_shuffle_epi8(tlo2, codes);
        let hi = _mm256_shuffle_epi8(thi2, codes);
        let zeros = _mm256_cmpeq_epi8(
            _mm256_and_si256(codes, _mm256_set1_epi8(0x07)),
            _mm256_setzero_si256(),
        );
        let v0 = wide_lanes_256(
            _mm256_unpacklo_epi8(lo, hi),
            s0,
            _mm256_unpacklo_epi8(zeros, zeros),
        );
        let v1 = wide_lanes_256(
            _mm256_unpackhi_epi8(lo, hi),
            s1,
            _mm256_unpackhi_epi8(zeros, zeros),
        );
        // column k (the low lanes) and column 16 + k (the high lanes)
        let left = _mm256_permute2x128_si256::<0x20>(v0, v1);
        let right = _mm256_permute2x128_si256::<0x31>(v0, v1);
        let (a, b) = stage[k * pitch..].split_at_mut(T * pitch);
        let (oa, ob) = (&mut a[at..][..2 * T], &mut b[at..][..2 * T]);
        // SAFETY: `oa` and `ob` hold the 32 bytes each store writes, unaligned.
        unsafe {
            _mm256_storeu_si256(oa.as_mut_ptr().cast(), left);
            _mm256_storeu_si256(ob.as_mut_ptr().cast(), right);
        }
    }
}

/// The wide decode of one tile column in [`nibble_tiles_avx2`]'s single-tile path (out of line, as
/// [`wide_pair_columns`]): `lo` and `hi` the bytes of the codes' bf16 bits, `zeros` the zero codes, `steps`
/// rows 0..8 and 8..16; the bf16 bits of rows 0..8 and 8..16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
fn wide_column(
    lo: std::arch::x86_64::__m128i,
    hi: std::arch::x86_64::__m128i,
    zeros: std::arch::x86_64::__m128i,
    (s0, s1): (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i),
) -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
    use std::arch::x86_64::*;
    (
        wide_lanes(
            _mm_unpacklo_epi8(lo, hi),
            s0,
            _mm_unpacklo_epi8(zeros, zeros),
        ),
        wide_lanes(
            _mm_unpackhi_epi8(lo, hi),
            s1,
            _mm_unpackhi_epi8(zeros, zeros),
        ),
    )
}

/// Tile heights ahead of the one decoded whose source lines [`nibble_tiles_avx2`] prefetches.
#[cfg(target_arch = "x86_64")]
const NIBBLE_AHEAD: usize = 2;

/// Elements (source rows) of one staged piece of a band in [`nibble_tiles_avx2`] at most: a band's 64 columns
/// of up to 2048 bf16 elements (256 KiB, L2-resident) are decoded into a buffer and then written out row by
/// row, so that a band's destination rows, adjacent in memory, are streamed back to back.
#[cfg(target_arch = "x86_64")]
const NIBBLE_STAGE: usize = 2048;

/// The row-stepping case of [`write_nibble_run`] into bf16 when the repetitions are adjacent byte columns
/// (transformers' transposed gpt-oss layout: repetition `r` is byte column `r` of the packed rows, element
/// `i` its byte in the next source row), in tiles of 16 byte columns x 16 rows: the 16 rows' bytes are
/// loaded as vectors and their nibble kept, the tile is transposed in registers (each byte column becomes
/// one vector of 16 rows), a table lookup (`pshufb`) turns each code into the bf16 bits of its e2m1 value,
/// and the scale is applied by adding `(e - 127) << 7` to the exponent field of every non-zero value
/// ([`mxfp4_exponent_step`]: the exact product, as the scalar kernel rounds it, when every scale of the
/// tile is a power of two `2^(e - 127)` with `2 <= e <= 252`; computed once per run, [`RunSteps`]); a tile
/// with any other e8m0 scale (bytes 0 and 1, whose small products are subnormal, as a sparse checkpoint's
/// holes read; 253..=255, whose large products overflow; byte 255 is 2^128) takes the wide decode
/// (`wide_decode`: a few more operations per vector, the same loads, transposes and stores).
/// Two tiles go through one 256-bit pass (a tile per 128-bit lane) when each lies in one scale column.
/// Bands of 4 tiles side by side (a cache line of each source row) walk down the rows; each
/// [`NIBBLE_STAGE`] rows of a band are decoded into a buffer first and then written to the band's 64
/// destination rows one after the other, with streaming stores where 16-byte aligned (written straight from
/// the tiles with plain stores, the 64 rows' lines were each read from memory before being overwritten).
/// Where the destination rows start on lines (a torch shard's rows of a multiple of 32 elements) and AVX-512
/// is there, a band instead takes two tile heights a pass and streams each column's 64 bytes straight into
/// its row as one whole line ([`quad_lines_avx512`]): no stage, and the writes to memory spread between the
/// decodes. A ragged edge of fewer than 16 columns is a padded tile (its padding decoded, not written) except
/// in the last tile heights, whose padding would read past `src`. Columns with a scale that is no e8m0 value
/// (an arbitrary `f32`, only through the Rust API), the rows of the ragged edges that do not fill a tile and
/// the edge's last tile heights go through the scalar [`nibble_rows_dense`], which stays the reference
/// (`nibble_tiles_equal_the_scalar_kernel`).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn nibble_tiles_avx2(
    run: &Run,
    src: &[u8],
    values: ScaleValues<'_>,
    cells: &[usize],
    cell_step: usize,
    quad: bool,
) {
    use std::arch::x86_64::*;
    const T: usize = NIBBLE_SIMD_TILE;
    const BAND: usize = T * NIBBLE_BAND;
    let high = run.src_nibble == 2;
    let (count, reps, stride) = (
        run.count as usize,
        run.reps as usize,
        run.src_stride as usize,
    );
    let pair = (high, Dtype::BF16);
    let scalar = |r: usize, y0: usize, y1: usize| {
        with_dense_rep(run, r as u64, |out| {
            let at = (cells[r] + y0 * cell_step, cell_step);
            let from = &src[r + y0 * stride..];
            nibble_rows_dense(pair, from, stride, values, at, &mut out[2 * y0..2 * y1])
        })
    };
    let (rfull, yfull) = (reps / T * T, count / T * T);
    // A ragged edge of columns (a rank's slice of the experts' inputs is 45 bytes of each row under EP 8 x
    // FSDP 32: 13 left over past two tiles) goes through the tiles as a padded last tile: its padding columns
    // read the next bytes of the same rows (other columns, or the next row's first), inside `src` for every
    // row but those of the last tile heights (`src` ends at the run's last byte), are decoded into the stage
    // and never written out. Rows `ypad..` of those columns, and every row when no tile height fits, take the
    // scalar kernel.
    let rpad = reps.div_ceil(T) * T;
    let ypad = match src.len().checked_sub(rpad) {
        Some(room) if stride > 0 => (room / stride + 1).min(yfull) / T * T,
        _ => 0,
    };
    let rvec = if rpad > rfull && ypad > 0 {
        rpad
    } else {
        rfull
    };
    let padded: Vec<usize>;
    let cells_vec = match rvec > reps {
        true => {
            // the padding columns take the last column's scales (decoded, never written)
            padded = (0..rvec).map(|r| cells[r.min(reps - 1)]).collect();
            &padded[..]
        }
        false => &cells[..rvec],
    };
    let steps = RunSteps::new(cells_vec, cell_step, count, values);
    let (tlo, thi) = e2m1_tables();
    let (low4, mag, zero) = (
        _mm_set1_epi8(0x0f),
        _mm_set1_epi8(0x07),
        _mm_setzero_si128(),
    );
    let (tlo2, thi2) = (
        _mm256_broadcastsi128_si256(tlo),
        _mm256_broadcastsi128_si256(thi),
    );
    let (low4_2, mag2, zero2) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(0x07),
        _mm256_setzero_si256(),
    );
    let stage_rows = yfull.clamp(T, NIBBLE_STAGE);
    // bytes of one column's staged rows, plus a line: columns a multiple of 4 KiB apart would share an L1 set
    let pitch = 2 * stage_rows + 64;
    let mut stage = vec![0u8; BAND * pitch];
    let mut streamed = false;
    for b0 in (0..rvec).step_by(BAND) {
        // tiles over columns b0..b1, of which b0..v1 are the run's; rows 0..ylim
        let b1 = rvec.min(b0 + BAND);
        let v1 = b1.min(reps);
        let ylim = if b1 > reps { ypad } else { yfull };
        // A whole band of the run's columns whose destination rows start on lines takes two tile heights at
        // a time straight into the rows (`quad_lines_avx512`), where its tiles allow.
        let lined = quad
            && v1 - b0 == BAND
            && run.dst_is_dense()
            && run.dst_addr.is_multiple_of(64)
            && run.rep_dst_stride.is_multiple_of(64);
        let mut y0 = 0;
        while y0 < ylim {
            if lined && y0 + 2 * T <= ylim {
                if let (Some(upper), Some(lower)) = (steps.band(b0, y0), steps.band(b0, y0 + T)) {
                    let how = upper.max(lower);
                    for y in y0 + 2 * NIBBLE_AHEAD * T..count.min(y0 + (2 * NIBBLE_AHEAD + 2) * T) {
                        prefetch_lines(&src[y * stride + b0..][..1]);
                        prefetch_lines(&src[y * stride + v1 - 1..][..1]);
                    }
                    let at = |t: usize| {
                        &steps.steps[steps.slot[b0 + t * T] * steps.pitch + y0..][..2 * T]
                    };
                    let st = [at(0), at(1), at(2), at(3)];
                    let rows = &src[y0 * stride + b0..];
                    let dst = (run.dst_addr + b0 * run.rep_dst_stride + 2 * y0) as *mut u8;
                    let pass: QuadLines = match how {
                        WIDE => quad_lines_avx512::<true>,
                        _ => quad_lines_avx512::<false>,
                    };
                    // SAFETY: `lined` holds only where AVX-512 F and BW were detected (`quad`) and the
                    // destination is dense with its first row and row pitch multiples of 64 bytes, and `y0`
                    // is a multiple of 32 (only whole pairs of tile heights advance it before this point):
                    // each column's 64 bytes from element `y0` are one aligned line inside the run's
                    // destination row (`y0 + 32 <= count`), which plan::plan gave to this run alone.
                    unsafe { pass(rows, stride, high, st, dst, run.rep_dst_stride) };
                    streamed = true;
                    y0 += 2 * T;
                    continue;
                }
            }
            let y1 = ylim.min(y0 + if lined { 2 * T } else { stage_rows });
            let mut bad = 0u64; // columns of the band with a scale for the scalar kernel in y0..y1
            for yy in (y0..y1).step_by(T) {
                if yy + (NIBBLE_AHEAD + 1) * T <= count {
                    for y in yy + NIBBLE_AHEAD * T..yy + (NIBBLE_AHEAD + 1) * T {
                        // the band's first and last byte of the row: its bytes span two lines
                        // unless the row happens to start a line
                        prefetch_lines(&src[y * stride + b0..][..1]);
                        prefetch_lines(&src[y * stride + v1 - 1..][..1]);
                    }
                }
                let mut r0 = b0;
                while r0 < b1 {
                    // A whole band of tiles, each within one scale column and none for the scalar kernel:
                    // one 512-bit pass.
                    let quad_here = match quad && r0 + BAND <= b1 {
                        true => steps.band(r0, yy),
                        false => None,
                    };
                    if let Some(how) = quad_here {
                        let st: [&[i16]; NIBBLE_BAND] = std::array::from_fn(|t| {
                            &steps.steps[steps.slot[r0 + t * T] * steps.pitch + yy..][..T]
                        });
                        let rows = &src[yy * stride + r0..];
                        let stage = &mut stage[(r0 - b0) * pitch..];
                        let at = 2 * (yy - y0);
                        // SAFETY: `quad` is set only where AVX-512 F and BW were detected on this CPU.
                        unsafe {
                            match how {
                                WIDE => quad_columns_avx512::<true>(
                                    rows, stride, high, st, stage, pitch, at,
                                ),
                                _ => quad_columns_avx512::<false>(
                                    rows, stride, high, st, stage, pitch, at,
                                ),
                            }
                        };
                        r0 += BAND;
                        continue;
                    }
                    // Two tiles side by side (32 byte columns), each within one scale column whose steps
                    // hold for these rows: one 256-bit pass, a tile in each 128-bit lane.
                    let pair = r0 + 2 * T <= b1 && {
                        let (sa, sb) = (steps.slot[r0], steps.slot[r0 + T]);
                        steps.slot[r0 + T - 1] == sa
                            && steps.slot[r0 + 2 * T - 1] == sb
                            && steps.class(sa, yy).max(steps.class(sb, yy)) < SCALAR
                    };
                    if pair {
                        let mut rows = [zero2; T];
                        for (y, row) in rows.iter_mut().enumerate() {
                            let bytes = &src[(yy + y) * stride + r0..][..2 * T];
                            // SAFETY: `bytes` holds the 32 bytes read (unaligned, as `loadu` allows).
                            let v = unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) };
                            *row = match high {
                                true => _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4_2),
                                false => _mm256_and_si256(v, low4_2),
                            };
                        }
                        let cols = transpose_16x16_lanes(rows);
                        let (sa, sb) = (steps.slot[r0], steps.slot[r0 + T]);
                        let wide = steps.class(sa, yy).max(steps.class(sb, yy)) == WIDE;
                        let sta = &steps.steps[sa * steps.pitch + yy..][..T];
                        let stb = &steps.steps[sb * steps.pitch + yy..][..T];
                        // SAFETY: `sta` and `stb` hold the 16 `i16` (32 bytes) each load reads, unaligned.
                        let (sa, sb) = unsafe {
                            (
                                _mm256_loadu_si256(sta.as_ptr().cast()),
                                _mm256_loadu_si256(stb.as_ptr().cast()),
                            )
                        };
                        // rows 0..8 and 8..16 of the left tile's steps | of the right tile's
                        let s0 = _mm256_permute2x128_si256::<0x20>(sa, sb);
                        let s1 = _mm256_permute2x128_si256::<0x31>(sa, sb);
                        if wide {
                            let at = 2 * (yy - y0);
                            wide_pair_columns(
                                &cols,
                                (s0, s1),
                                &mut stage[(r0 - b0) * pitch..],
                                pitch,
                                at,
                            );
                            r0 += 2 * T;
                            continue;
                        }
                        for (k, &codes) in cols.iter().enumerate() {
                            let lo = _mm256_shuffle_epi8(tlo2, codes);
                            let hi = _mm256_shuffle_epi8(thi2, codes);
                            let zeros = _mm256_cmpeq_epi8(_mm256_and_si256(codes, mag2), zero2);
                            let v0 = _mm256_add_epi16(
                                _mm256_unpacklo_epi8(lo, hi),
                                _mm256_andnot_si256(_mm256_unpacklo_epi8(zeros, zeros), s0),
                            );
                            let v1 = _mm256_add_epi16(
                                _mm256_unpackhi_epi8(lo, hi),
                                _mm256_andnot_si256(_mm256_unpackhi_epi8(zeros, zeros), s1),
                            );
                            // column r0 + k (the low lanes) and column r0 + 16 + k (the high lanes)
                            let left = _mm256_permute2x128_si256::<0x20>(v0, v1);
                            let right = _mm256_permute2x128_si256::<0x31>(v0, v1);
                            let at = 2 * (yy - y0);
                            let (a, b) = stage[(r0 - b0 + k) * pitch..].split_at_mut(T * pitch);
                            let (oa, ob) = (&mut a[at..][..2 * T], &mut b[at..][..2 * T]);
                            // SAFETY: `oa` and `ob` hold the 32 bytes each store writes, unaligned.
                            unsafe {
                                _mm256_storeu_si256(oa.as_mut_ptr().cast(), left);
                                _mm256_storeu_si256(ob.as_mut_ptr().cast(), right);
                            }
                        }
                        r0 += 2 * T;
                        continue;
                    }
                    let mut rows = [zero; T];
                    for (y, row) in rows.iter_mut().enumerate() {
                        let bytes = &src[(yy + y) * stride + r0..][..T];
                        // SAFETY: `bytes` holds the 16 bytes read (unaligned, as `loadu` allows).
                        let v = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
                        *row = match high {
                            true => _mm_and_si128(_mm_srli_epi16::<4>(v), low4),
                            false => _mm_and_si128(v, low4),
                        };
                    }
                    let cols = transpose_16x16(rows);
                    for (k, &codes) in cols.iter().enumerate() {
                        let slot = steps.slot[r0 + k];
                        let how = steps.class(slot, yy);
                        if how == SCALAR {
                            bad |= 1 << (r0 - b0 + k);
                            continue;
                        }
                        let st = &steps.steps[slot * steps.pitch + yy..][..T];
                        let o = &mut stage[(r0 - b0 + k) * pitch + 2 * (yy - y0)..][..2 * T];
                        // SAFETY: `st` holds 16 `i16` (two 16-byte loads), `o` the 32 bytes stored; all
                        // unaligned.
                        unsafe {
                            let s0 = _mm_loadu_si128(st.as_ptr().cast());
                            let s1 = _mm_loadu_si128(st[8..].as_ptr().cast());
                            let lo = _mm_shuffle_epi8(tlo, codes);
                            let hi = _mm_shuffle_epi8(thi, codes);
                            let zeros = _mm_cmpeq_epi8(_mm_and_si128(codes, mag), zero);
                            let (v0, v1) = match how == WIDE {
                                false => (
                                    _mm_add_epi16(
                                        _mm_unpacklo_epi8(lo, hi),
                                        _mm_andnot_si128(_mm_unpacklo_epi8(zeros, zeros), s0),
                                    ),
                                    _mm_add_epi16(
                                        _mm_unpackhi_epi8(lo, hi),
                                        _mm_andnot_si128(_mm_unpackhi_epi8(zeros, zeros), s1),
                                    ),
                                ),
                                true => wide_column(lo, hi, zeros, (s0, s1)),
                            };
                            _mm_storeu_si128(o.as_mut_ptr().cast(), v0);
                            _mm_storeu_si128(o[16..].as_mut_ptr().cast(), v1);
                        }
                    }
                    r0 += T;
                }
            }
            for (k, staged) in stage.chunks_exact(pitch).take(v1 - b0).enumerate() {
                let r = b0 + k;
                if bad >> k & 1 == 1 {
                    scalar(r, y0, y1);
                    continue;
                }
                let from = &staged[..2 * (y1 - y0)];
                with_dense_rep(run, r as u64, |out| {
                    let o = &mut out[2 * y0..2 * y1];
                    let p = o.as_mut_ptr();
                    if !(p as usize).is_multiple_of(16) {
                        o.copy_from_slice(from);
                        return;
                    }
                    streamed = true;
                    for i in (0..from.len()).step_by(16) {
                        // SAFETY: `o` and `from` hold the 16 bytes at `i` (their lengths are equal
                        // multiples of 32); `p + i` is 16-byte aligned as `_mm_stream_si128` requires.
                        // The `_mm_sfence` below orders the streaming stores before the return.
                        unsafe {
                            let v = _mm_loadu_si128(from.as_ptr().add(i).cast());
                            _mm_stream_si128(p.add(i).cast(), v);
                        }
                    }
                });
            }
            y0 = y1;
        }
        if y0 < count {
            for r in b0..v1 {
                scalar(r, y0, count);
            }
        }
    }
    for r in rvec.min(reps)..reps {
        scalar(r, 0, count);
    }
    if streamed {
        _mm_sfence();
    }
}

/// [`nibble_tiles_avx2`]'s four tiles side by side (a band's 64 byte columns, a tile in each 128-bit lane of
/// 512-bit vectors), all narrow (`WIDE` false) or some wide (`WIDE`: the wide decode, [`wide_lanes_512`]):
/// rows `0..16` of `rows` (the source from the tiles' first byte of their first row, rows `stride` apart)
/// transposed and decoded as the pair path does, with the zero codes' steps masked out by mask registers;
/// column `k` of tile `t` goes to `stage[(t * 16 + k) * pitch + at..]`, 32 bytes. `steps[t]` are tile `t`'s
/// 16 steps. Half the transposes and about two thirds of the decode operations of two pair passes
/// (docs/perf-notes.md, "Session 16").
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline(never)]
fn quad_columns_avx512<const WIDE: bool>(
    rows: &[u8],
    stride: usize,
    high: bool,
    steps: [&[i16]; NIBBLE_BAND],
    stage: &mut [u8],
    pitch: usize,
    at: usize,
) {
    use std::arch::x86_64::*;
    const T: usize = NIBBLE_SIMD_TILE;
    let cols = quad_codes(rows, stride, high);
    let (s0, s1) = quad_steps(steps);
    for (k, &c) in cols.iter().enumerate() {
        let (x, y) = quad_column::<WIDE>(c, s0, s1);
        let halves = [
            _mm512_castsi512_si256(x),
            _mm512_extracti64x4_epi64::<1>(x),
            _mm512_castsi512_si256(y),
            _mm512_extracti64x4_epi64::<1>(y),
        ];
        for (t, h) in halves.into_iter().enumerate() {
            let o = &mut stage[(t * T + k) * pitch + at..][..2 * T];
            // SAFETY: `o` holds the 32 bytes stored, unaligned.
            unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), h) };
        }
    }
}

/// [`quad_columns_avx512`] over two tile heights (rows `0..32` of `rows`), written straight to the
/// destination: column `k` of tile `t` is the 64 bytes (a whole line) at `dst + (t * 16 + k) * dst_stride`,
/// stored by one streaming store, so that the writes to memory go out between the decodes instead of in
/// bursts after them (a staged band's write-out ran at the memory's streaming rate while nothing else ran:
/// a quarter of the kernel, docs/perf-notes.md, "Session 17"). `steps[t]` are tile `t`'s 32 steps.
///
/// # Safety
/// AVX-512 F and BW must be available; for every column `c < 64`, `dst + c * dst_stride` must be 64-byte
/// aligned and valid for 64 bytes of writes, which nothing else reads or writes meanwhile; the caller fences
/// the streaming stores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline(never)]
unsafe fn quad_lines_avx512<const WIDE: bool>(
    rows: &[u8],
    stride: usize,
    high: bool,
    steps: [&[i16]; NIBBLE_BAND],
    dst: *mut u8,
    dst_stride: usize,
) {
    use std::arch::x86_64::*;
    const T: usize = NIBBLE_SIMD_TILE;
    let upper = &rows[T * stride..];
    let (a, b) = (
        quad_codes(rows, stride, high),
        quad_codes(upper, stride, high),
    );
    let (sa0, sa1) = quad_steps(steps);
    let (sb0, sb1) = quad_steps(steps.map(|s| &s[T..]));
    for k in 0..T {
        let (xa, ya) = quad_column::<WIDE>(a[k], sa0, sa1);
        let (xb, yb) = quad_column::<WIDE>(b[k], sb0, sb1);
        // tile t's 16 rows of each height: the low (t even) or high 256 bits of xa / ya, then of xb / yb
        let lines = [
            _mm512_shuffle_i64x2::<0x44>(xa, xb),
            _mm512_shuffle_i64x2::<0xee>(xa, xb),
            _mm512_shuffle_i64x2::<0x44>(ya, yb),
            _mm512_shuffle_i64x2::<0xee>(ya, yb),
        ];
        for (t, line) in lines.into_iter().enumerate() {
            // SAFETY: by the contract above, the line of column `t * 16 + k` is aligned and writable.
            unsafe { _mm512_stream_si512(dst.add((t * T + k) * dst_stride).cast(), line) };
        }
    }
}

/// [`quad_lines_avx512`] of one decode (narrow or wide), as the band loop picks it.
#[cfg(target_arch = "x86_64")]
type QuadLines = unsafe fn(&[u8], usize, bool, [&[i16]; NIBBLE_BAND], *mut u8, usize);

/// The nibbles of rows `0..16` of a band (64 bytes each, `stride` apart), transposed four 16 x 16 tiles
/// at once: vector `k` holds column `k` of tile `t` in its 128-bit lane `t`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn quad_codes(
    rows: &[u8],
    stride: usize,
    high: bool,
) -> [std::arch::x86_64::__m512i; NIBBLE_SIMD_TILE] {
    use std::arch::x86_64::*;
    const T: usize = NIBBLE_SIMD_TILE;
    let low4 = _mm512_set1_epi8(0x0f);
    let mut codes = [_mm512_setzero_si512(); T];
    for (y, row) in codes.iter_mut().enumerate() {
        let bytes = &rows[y * stride..][..NIBBLE_BAND * T];
        // SAFETY: `bytes` holds the 64 bytes read (unaligned, as `loadu` allows).
        let v = unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) };
        *row = match high {
            true => _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4),
            false => _mm512_and_si512(v, low4),
        };
    }
    transpose_16x16_quads(codes)
}

/// The four tiles' 16 steps each (`steps[t]`) as two vectors: rows 0..8 of each tile, one tile a lane,
/// and rows 8..16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn quad_steps(
    steps: [&[i16]; NIBBLE_BAND],
) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    const T: usize = NIBBLE_SIMD_TILE;
    // SAFETY: each `steps[t]` holds the 16 `i16` (32 bytes) its load reads, unaligned.
    let st = steps.map(|s| unsafe { _mm256_loadu_si256(s[..T].as_ptr().cast()) });
    let ab = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(st[0]), st[1]);
    let cd = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(st[2]), st[3]);
    (
        _mm512_shuffle_i64x2::<0x88>(ab, cd),
        _mm512_shuffle_i64x2::<0xdd>(ab, cd),
    )
}

/// Column `k` of the four tiles decoded (`c`: [`quad_codes`]' vector `k`; `s0`, `s1`: [`quad_steps`]): tiles
/// 0 and 1's 16 bf16 values (32 bytes each, the low 256 bits tile 0's) and tiles 2 and 3's.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn quad_column<const WIDE: bool>(
    c: std::arch::x86_64::__m512i,
    s0: std::arch::x86_64::__m512i,
    s1: std::arch::x86_64::__m512i,
) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    let (tlo, thi) = e2m1_tables();
    let (tlo, thi) = (_mm512_broadcast_i32x4(tlo), _mm512_broadcast_i32x4(thi));
    let mag = _mm512_set1_epi16(0x0707);
    // 64-bit units of (v0, v1): tiles 0 and 1 | tiles 2 and 3, each tile's rows 0..8 then 8..16
    let first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    let second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    let lo = _mm512_shuffle_epi8(tlo, c);
    let hi = _mm512_shuffle_epi8(thi, c);
    // the non-zero codes of rows 0..8 and 8..16 of each lane, as 16-bit lanes
    let m0 = _mm512_test_epi16_mask(_mm512_unpacklo_epi8(c, c), mag);
    let m1 = _mm512_test_epi16_mask(_mm512_unpackhi_epi8(c, c), mag);
    let w0 = _mm512_unpacklo_epi8(lo, hi);
    let w1 = _mm512_unpackhi_epi8(lo, hi);
    let (v0, v1) = match WIDE {
        true => (wide_lanes_512(w0, s0, m0), wide_lanes_512(w1, s1, m1)),
        false => (
            _mm512_mask_add_epi16(w0, m0, w0, s0),
            _mm512_mask_add_epi16(w1, m1, w1, s1),
        ),
    };
    (
        _mm512_permutex2var_epi64(v0, first, v1),
        _mm512_permutex2var_epi64(v0, second, v1),
    )
}

/// One round of a byte transpose: the low and high unpacks of each listed pair of vectors.
#[cfg(target_arch = "x86_64")]
macro_rules! unpack_round {
    ($v:ident, $lo:path, $hi:path, [$(($x:literal, $y:literal)),*]) => {
        [$($lo($v[$x], $v[$y]), $hi($v[$x], $v[$y])),*]
    };
}

/// Defines a 16 x 16 byte transpose of 16 row vectors from the unpack intrinsics of one vector width: byte `c`
/// of row `r` (in each 128-bit lane: the unpacks work lane by lane) becomes byte `r` of column `c`, in four
/// rounds that interleave 8-, 16-, 32- and 64-bit units of vector pairs (written out so that the vectors stay in
/// registers).
#[cfg(target_arch = "x86_64")]
macro_rules! byte_transpose {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $vec:ty, $lo8:path, $hi8:path, $lo16:path, $hi16:path,
     $lo32:path, $hi32:path, $lo64:path, $hi64:path) => {
        $(#[$doc])*
        #[target_feature(enable = $feat)]
        #[inline]
        fn $name(r: [$vec; 16]) -> [$vec; 16] {
            // a[2p + h]: rows 2p, 2p + 1, columns 8h..8h + 8 (byte pairs).
            let a = unpack_round!(r, $lo8, $hi8, [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]);
            // b[4q + 2h + k]: rows 4q..4q + 4, columns 8h + 4k..8h + 4k + 4.
            let b = unpack_round!(a, $lo16, $hi16, [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]);
            // c[8s + 2j + k]: rows 8s..8s + 8, columns 4j + 2k, 4j + 2k + 1.
            let c = unpack_round!(b, $lo32, $hi32, [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]);
            // column 2m + k, all 16 rows.
            unpack_round!(c, $lo64, $hi64, [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)])
        }
    };
}

#[cfg(target_arch = "x86_64")]
byte_transpose!(
    /// Transposes a 16 x 16 byte matrix held as 16 row vectors (see `byte_transpose`).
    transpose_16x16,
    "avx2",
    std::arch::x86_64::__m128i,
    std::arch::x86_64::_mm_unpacklo_epi8,
    std::arch::x86_64::_mm_unpackhi_epi8,
    std::arch::x86_64::_mm_unpacklo_epi16,
    std::arch::x86_64::_mm_unpackhi_epi16,
    std::arch::x86_64::_mm_unpacklo_epi32,
    std::arch::x86_64::_mm_unpackhi_epi32,
    std::arch::x86_64::_mm_unpacklo_epi64,
    std::arch::x86_64::_mm_unpackhi_epi64
);

#[cfg(target_arch = "x86_64")]
byte_transpose!(
    /// [`transpose_16x16`] of two matrices at once, one in each 128-bit lane of 16 row vectors.
    transpose_16x16_lanes,
    "avx2",
    std::arch::x86_64::__m256i,
    std::arch::x86_64::_mm256_unpacklo_epi8,
    std::arch::x86_64::_mm256_unpackhi_epi8,
    std::arch::x86_64::_mm256_unpacklo_epi16,
    std::arch::x86_64::_mm256_unpackhi_epi16,
    std::arch::x86_64::_mm256_unpacklo_epi32,
    std::arch::x86_64::_mm256_unpackhi_epi32,
    std::arch::x86_64::_mm256_unpacklo_epi64,
    std::arch::x86_64::_mm256_unpackhi_epi64
);

#[cfg(target_arch = "x86_64")]
byte_transpose!(
    /// [`transpose_16x16`] of four matrices at once, one in each 128-bit lane of 16 row vectors.
    transpose_16x16_quads,
    "avx512f,avx512bw",
    std::arch::x86_64::__m512i,
    std::arch::x86_64::_mm512_unpacklo_epi8,
    std::arch::x86_64::_mm512_unpackhi_epi8,
    std::arch::x86_64::_mm512_unpacklo_epi16,
    std::arch::x86_64::_mm512_unpackhi_epi16,
    std::arch::x86_64::_mm512_unpacklo_epi32,
    std::arch::x86_64::_mm512_unpackhi_epi32,
    std::arch::x86_64::_mm512_unpacklo_epi64,
    std::arch::x86_64::_mm512_unpackhi_epi64
);

/// The write direction's zero-copy case: calls `f` with the memory of repetitions `reps` of a same-dtype,
/// byte-sized run when it is one contiguous byte range (elements adjacent, repetitions back to back), else
/// returns `None` without calling it.
pub(crate) fn with_contiguous_reps<R>(
    run: &Run,
    reps: std::ops::Range<u64>,
    f: impl FnOnce(&[u8]) -> R,
) -> Option<R> {
    let size = run.dst_elem_size();
    assert!(
        run.src_dtype == run.dst_dtype && size > 0 && reps.end <= run.reps && reps.start < reps.end,
        "with_contiguous_reps needs a same-dtype byte-sized run and repetitions"
    );
    let n = (reps.end - reps.start) as usize;
    if !run.dst_is_dense() || (n > 1 && run.rep_dst_stride != run.dst_bytes()) {
        return None;
    }
    let base = run.dst_addr + reps.start as usize * run.rep_dst_stride;
    // SAFETY: plan::plan_file_major checked that the `count` adjacent elements of every repetition lie
    // inside one DestBuf, valid for reads by its constructor's contract; with repetitions back to back
    // (`rep_dst_stride == dst_bytes`), repetitions `reps` are the one range `base..base + n * dst_bytes`.
    let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, n * run.dst_bytes()) };
    Some(f(bytes))
}

/// The write direction's read of memory: appends the bytes of repetitions `reps` of a same-dtype,
/// byte-sized run to `out`, each repetition's elements in order (adjacent, as the file holds them). The
/// run's "destination" side is the memory being saved: `plan::plan_file_major` checked that every
/// element of every repetition lies inside its `DestBuf`.
pub(crate) fn gather_reps(run: &Run, reps: std::ops::Range<u64>, out: &mut Vec<u8>) {
    let size = run.dst_elem_size();
    assert!(
        run.src_dtype == run.dst_dtype && size > 0 && reps.end <= run.reps,
        "gather_reps needs a same-dtype byte-sized run"
    );
    for r in reps {
        let base = run.dst_addr + r as usize * run.rep_dst_stride;
        if run.dst_is_dense() {
            // SAFETY: plan::plan_file_major checked that the `count` adjacent elements of repetition
            // `r < reps` lie inside one DestBuf, valid for reads by its constructor's contract (memory the
            // caller keeps alive and does not write during the call); reading it from several threads is
            // sound.
            let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, run.dst_bytes()) };
            out.extend_from_slice(bytes);
            continue;
        }
        for i in 0..run.count as usize {
            let at = (base + i * run.dst_stride) as *const u8;
            // SAFETY: as above, for element `i < count` of repetition `r` at its checked strided address.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(at, size) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use crate::kernels::{
        bf16_to_f32, e4m3fn_to_f32, e5m2_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16,
        mxfp4_scale_to_f32, ScaleValues, E2M1_VALUES,
    };

    /// A sink writing element `i` at element `offset + i * stride` of a buffer of `size`-byte elements.
    struct VecSink {
        out: Vec<u8>,
        size: usize,
        stride: usize,
        offset: usize,
    }

    impl ElemSink for VecSink {
        fn put(&mut self, i: usize, bytes: &[u8]) {
            let at = (self.offset + i * self.stride) * self.size;
            self.out[at..at + self.size].copy_from_slice(bytes);
        }
    }

    /// Scales that exercise every class: ordinary, NaN, infinities, zero, subnormal, huge, any bits.
    fn scale_value() -> impl Strategy<Value = f32> {
        prop_oneof![
            4 => 1e-6f32..1e3f32,
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NEG_INFINITY),
            1 => Just(0.0f32),
            1 => (1u32..0x80_0000).prop_map(f32::from_bits),
            1 => (0x7e00_0000u32..0x7f80_0000).prop_map(f32::from_bits),
            2 => any::<u32>().prop_map(f32::from_bits),
        ]
    }

    /// The textbook formula for one element, from the reference scalar conversions: the bits of
    /// `dd(f32(q) * scale)` (`f64` from the `f32` product, as torch does).
    fn formula(sd: Dtype, dd: Dtype, q: u8, scale: f32) -> Vec<u8> {
        let x = match sd {
            Dtype::F8_E4M3 => e4m3fn_to_f32(q),
            _ => e5m2_to_f32(q),
        } * scale;
        match dd {
            Dtype::BF16 => f32_to_bf16(x).to_le_bytes().to_vec(),
            Dtype::F16 => f32_to_f16(x).to_le_bytes().to_vec(),
            Dtype::F32 => x.to_le_bytes().to_vec(),
            _ => f64::from(x).to_le_bytes().to_vec(),
        }
    }

    /// Whether element bytes of `dd` hold a NaN.
    fn is_nan(dd: Dtype, b: &[u8]) -> bool {
        match dd {
            Dtype::BF16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])).is_nan(),
            Dtype::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])).is_nan(),
            Dtype::F32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
            _ => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
        }
    }

    /// The tile kernel's step and class of every MXFP4 scale byte (and of scales with no step) are
    /// `mxfp4_exponent_step`'s, narrow exactly for `NARROW_STEPS`.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn step_classes_follow_the_exponent_steps() {
        use crate::kernels::{mxfp4_exponent_step, NARROW_STEPS};
        let bytes = (0..=255u8).map(mxfp4_scale_to_f32);
        let others = [
            3.0f32,
            -1.0,
            -0.0,
            0.0,
            f32::NAN,
            -f32::INFINITY,
            f32::from_bits(1),
            0.5,
        ];
        for v in bytes.chain(others) {
            let want = match mxfp4_exponent_step(v) {
                Some(st) if NARROW_STEPS.contains(&st) => (st, NARROW),
                Some(st) => (st, WIDE),
                None => (0, SCALAR),
            };
            assert_eq!(step_class(v), want, "{v:e} ({:#x})", v.to_bits());
        }
        // the table of the e8m0 bytes is the same function
        for b in 0..=255u8 {
            let v = mxfp4_scale_to_f32(b);
            assert_eq!(E8M0_STEPS[usize::from(b)], step_class(v), "byte {b}");
        }
    }

    proptest! {
        /// The dense dequantizing kernel (the SSE2 build, and the dispatch at every SIMD level this host runs)
        /// equals the generic per-element kernel (into dense and strided destinations) and the formula, bit
        /// for bit: random
        /// codes (NaN, subnormal, every code), scales of every class, ragged blocks, runs that start and
        /// end anywhere and cross rows, every source and target dtype. The one allowed difference: when
        /// both the code and its scale are NaN, which NaN the multiply returns is not specified.
        #[test]
        fn dense_dequantize_equals_generic_and_formula(
            rows in 1u64..24,
            cols in 1u64..300,
            brow in 1u64..8,
            bcol in 1u64..160,
            seed in any::<u64>(),
            scales_seed in proptest::collection::vec(scale_value(), 1..64),
            span in (0.0f64..1.0, 0.0f64..1.0),
            sd in prop_oneof![Just(Dtype::F8_E4M3), Just(Dtype::F8_E5M2)],
            dd in prop_oneof![Just(Dtype::BF16), Just(Dtype::F16), Just(Dtype::F32), Just(Dtype::F64)],
            dst_stride in 1usize..4,
        ) {
            let numel = rows * cols;
            let (grows, gcols) = (rows.div_ceil(brow), cols.div_ceil(bcol));
            let values: Vec<f32> = (0..grows * gcols)
                .map(|i| scales_seed[i as usize % scales_seed.len()])
                .collect();
            let mut state = seed | 1;
            let q: Vec<u8> = (0..numel)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 24) as u8
                })
                .collect();
            let mut shape = [1u64; crate::types::MAX_NDIM];
            let mut block = [1u64; crate::types::MAX_NDIM];
            let mut grid_strides = [0u64; crate::types::MAX_NDIM];
            shape[..2].copy_from_slice(&[rows, cols]);
            block[..2].copy_from_slice(&[brow, bcol]);
            grid_strides[..2].copy_from_slice(&[gcols, 1]);
            let map = ScaleMap::whole(&values, 2, shape, block, grid_strides);
            let a = ((span.0 * numel as f64) as u64).min(numel - 1);
            let b = a + 1 + ((span.1 * (numel - a - 1) as f64) as u64);
            let src = &q[a as usize..b as usize];
            let n = src.len();
            let size = dd.byte_size().unwrap();
            let mut sse2 = vec![0u8; n * size];
            cast_scaled_dense((sd, dd), src, &mut sse2, &map, a);
            // the dispatched kernel at every SIMD level this host runs (as `HP_FASTLOAD_SIMD` would force it)
            let levels: Vec<(crate::simd::Level, Vec<u8>)> = crate::simd::levels_here()
                .map(|level| {
                    let mut fast = vec![0u8; n * size];
                    crate::simd::with_cap(level, || dequantize_dense((sd, dd), src, &mut fast, &map, a));
                    (level, fast)
                })
                .collect();
            let mut strided = VecSink { out: vec![0u8; (n * dst_stride + 1) * size], size, stride: dst_stride, offset: 1 };
            cast_scaled((sd, dd), src, 1, n, &map, (a, 1), &mut strided);
            for i in 0..n {
                let flat = a + i as u64;
                let (r, c) = (flat / cols, flat % cols);
                let scale = values[((r / brow) * gcols + c / bcol) as usize];
                let want = formula(sd, dd, src[i], scale);
                let generic = &strided.out[(1 + i * dst_stride) * size..][..size];
                let dispatched = levels.iter().map(|(level, fast)| (level.name(), &fast[i * size..][..size]));
                for (name, got) in [("sse2", &sse2[i * size..][..size]), ("generic", generic)].into_iter().chain(dispatched) {
                    let both_nan = scale.is_nan() && (match sd { Dtype::F8_E4M3 => e4m3fn_to_f32(src[i]), _ => e5m2_to_f32(src[i]) }).is_nan();
                    if both_nan {
                        prop_assert!(is_nan(dd, got), "{} at {}: not NaN", name, flat);
                    } else {
                        prop_assert_eq!(got, &want[..], "{} at flat {} (q {:#x}, scale {:e} = {:#x})", name, flat, src[i], scale, scale.to_bits());
                    }
                }
            }
        }

        /// A strided source (a column of the tensor, step = cols) through the generic kernel equals the
        /// formula (the layout the dense kernel does not take).
        #[test]
        fn strided_source_dequantize_equals_formula(
            rows in 1u64..40,
            cols in 1u64..20,
            brow in 1u64..16,
            col in 0u64..20,
            codes in proptest::collection::vec(any::<u8>(), 800),
            scales_seed in proptest::collection::vec(scale_value(), 1..16),
        ) {
            let col = col % cols;
            let (grows, gcols) = (rows.div_ceil(brow), 1);
            let values: Vec<f32> = (0..grows).map(|i| scales_seed[i as usize % scales_seed.len()]).collect();
            let mut shape = [1u64; crate::types::MAX_NDIM];
            let mut block = [1u64; crate::types::MAX_NDIM];
            let mut grid_strides = [0u64; crate::types::MAX_NDIM];
            shape[..2].copy_from_slice(&[rows, cols]);
            block[..2].copy_from_slice(&[brow, cols]);
            grid_strides[..2].copy_from_slice(&[gcols, 1]);
            let map = ScaleMap::whole(&values, 2, shape, block, grid_strides);
            let q = &codes[..(rows * cols) as usize];
            let mut sink = VecSink { out: vec![0u8; rows as usize * 2], size: 2, stride: 1, offset: 0 };
            cast_scaled((Dtype::F8_E4M3, Dtype::BF16), &q[col as usize..], cols as usize, rows as usize, &map, (col, cols), &mut sink);
            for r in 0..rows as usize {
                let scale = values[r / brow as usize];
                let qv = q[r * cols as usize + col as usize];
                let got = &sink.out[r * 2..r * 2 + 2];
                if scale.is_nan() && e4m3fn_to_f32(qv).is_nan() {
                    prop_assert!(is_nan(Dtype::BF16, got));
                } else {
                    prop_assert_eq!(got, &formula(Dtype::F8_E4M3, Dtype::BF16, qv, scale)[..], "row {}", r);
                }
            }
        }

        /// MXFP4 nibble runs in transformers' transposed layout (repetition `r` = byte column `r`, element
        /// `i` = the next source row), through `write_run_scaled` as the engine calls it (the vectorized
        /// tiles on an AVX2 CPU, else the scalar kernel) and through the tile kernel directly, equal the
        /// scalar kernel `nibble_rows_dense` run per repetition (the reference) and the formula (`e2m1 *
        /// 2^(b - 127)` exact for an e8m0 byte `b`, 2^128 for 0xff as transformers' `ldexp` gives it, else
        /// `e2m1 * scale`, rounded once to bf16), bit for bit, and write nothing outside the run's rows: both nibbles,
        /// runs starting at any row and byte column (ragged tiles on both edges), padded destination rows,
        /// e8m0 scales of every byte (tiles with one of the extremes 0, 1 and 253..=255 take the wide
        /// decode; `odd` 3: all of a run's scales are byte 0, as a sparse checkpoint's holes read) and
        /// arbitrary `f32` scales (the scalar kernel).
        #[test]
        fn nibble_tiles_equal_the_scalar_kernel(
            rows in 1usize..300,
            groups in prop_oneof![3 => 1usize..9, 1 => 16usize..20],
            row0 in 0usize..8,
            col0 in prop_oneof![2 => 0usize..40, 1 => Just(0usize), 1 => Just(16usize)],
            count in 1usize..300,
            reps in prop_oneof![2 => 1usize..80, 2 => 60usize..140, 1 => 250usize..320],
            high: bool,
            pad in 0usize..5,
            lined: bool,
            seed: u64,
            odd in prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)],
            wild in proptest::collection::vec(scale_value(), 1..8),
        ) {
            let width = groups * 16; // bytes a row: `groups` blocks of 32 nibbles
            let rows = rows.max(row0 + 1);
            let (row0, count) = (row0, count.min(rows - row0));
            let col0 = col0 % width;
            let reps = reps.min(width - col0);
            let mut state = seed | 1;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let begin = 3usize; // the tensor's first byte inside `file`
            let file: Vec<u8> = (0..begin + rows * width).map(|_| next() as u8).collect();
            // per-cell scales: e8m0 bytes (mostly ordinary, `odd` 1 adds the extremes, 2 arbitrary f32s)
            // (the e8m0 byte of each cell, `None` for an f32 scale)
            let bytes: Vec<Option<u8>> = (0..rows * groups)
                .map(|_| {
                    let r = next();
                    match (odd, r % 8) {
                        (1, 0) => Some([0u8, 1, 2, 252, 253, 254, 255][(r >> 8) as usize % 7]),
                        (3, _) => Some(0),
                        (2, 0 | 1) => None,
                        _ => Some(110 + (r >> 8) as u8 % 30),
                    }
                })
                .collect();
            let values: Vec<f32> = bytes
                .iter()
                .enumerate()
                .map(|(k, b)| b.map_or(wild[k % wild.len()], mxfp4_scale_to_f32))
                .collect();
            let mut shape = [1u64; crate::types::MAX_NDIM];
            let mut block = [1u64; crate::types::MAX_NDIM];
            let mut grid_strides = [0u64; crate::types::MAX_NDIM];
            shape[..2].copy_from_slice(&[rows as u64, 2 * width as u64]);
            block[..2].copy_from_slice(&[1, 32]);
            grid_strides[..2].copy_from_slice(&[groups as u64, 1]);
            let map = ScaleMap::whole(&values, 2, shape, block, grid_strides);
            // `lined`: destination rows starting on lines (a 64-byte aligned buffer, rows a multiple of 64
            // bytes), as torch allocates shards: whole bands go straight into the rows
            let dst_row = match lined {
                true => (2 * (count + pad)).next_multiple_of(64),
                false => 2 * (count + pad),
            };
            let mut backing = vec![0x5au8; dst_row * reps + 128];
            let at = backing.as_ptr().align_offset(64) + usize::from(!lined) * 16;
            let out = &mut backing[at..][..dst_row * reps + 64];
            let mut want = out.to_vec();
            let src_off = begin + row0 * width + col0;
            let run = Run {
                item: 0,
                file: 0,
                src_off: src_off as u64,
                src_stride: width as u64,
                count: count as u64,
                dst_addr: out.as_mut_ptr() as usize,
                dst_stride: 2,
                reps: reps as u64,
                rep_src_stride: 1,
                rep_dst_stride: dst_row,
                src_dtype: Dtype::F4,
                dst_dtype: Dtype::BF16,
                src_nibble: 1 + u8::from(high),
            };
            let cell_step = groups;
            for r in 0..reps {
                let col = col0 + r;
                let cell0 = row0 * groups + (2 * col + usize::from(high)) / 32;
                let from = &file[src_off + r..];
                let row = &mut want[r * dst_row..][..2 * count];
                let f32s = ScaleValues::F32(&values);
                nibble_rows_dense((high, Dtype::BF16), from, width, f32s, (cell0, cell_step), row);
                for i in 0..count {
                    let byte = file[src_off + r + i * width];
                    let code = if high { byte >> 4 } else { byte & 15 };
                    // an e8m0 byte's value is exact in f64 (2^(b - 127): 2^128 for 0xff, as ldexp gives
                    // it), rounded once into f32 (overflow to infinity; exact otherwise) and then bf16
                    let e2m1 = E2M1_VALUES[usize::from(code)];
                    // (an infinite f32 scale is 2^128 too: MXFP4 scales are exponents)
                    let scale = values[cell0 + i * cell_step];
                    let v = match bytes[cell0 + i * cell_step] {
                        Some(b) => (f64::from(e2m1) * 2f64.powi(i32::from(b) - 127)) as f32,
                        None if scale == f32::INFINITY => (f64::from(e2m1) * 2f64.powi(128)) as f32,
                        None => e2m1 * scale,
                    };
                    prop_assert_eq!(&row[2 * i..2 * i + 2], &f32_to_bf16(v).to_le_bytes()[..], "formula r {} i {}", r, i);
                }
            }
            // the run's bytes exactly, as the engine hands them (`src_end`): a padded tile must not read past
            let src = &file[src_off..src_off + (count - 1) * width + reps];
            // every SIMD level this host runs (the dispatch at each, as `HP_FASTLOAD_SIMD` would force it)
            let kept: Option<Vec<u8>> = bytes.iter().copied().collect();
            for level in crate::simd::levels_here() {
                out.fill(0x5a);
                crate::simd::with_cap(level, || write_run_scaled(&run, src, &map, begin as u64));
                prop_assert_eq!(&out[..], &want[..], "write_run_scaled at {}", level.name());
                // the same scales kept as their e8m0 bytes, as the engine keeps MXFP4's (when every cell is one)
                if let Some(kept) = &kept {
                    out.fill(0x5a);
                    let e8m0 = ScaleMap { values: ScaleValues::E8m0(kept), ..map };
                    crate::simd::with_cap(level, || write_run_scaled(&run, src, &e8m0, begin as u64));
                    prop_assert_eq!(&out[..], &want[..], "write_run_scaled at {}, e8m0 bytes", level.name());
                }
            }
            #[cfg(target_arch = "x86_64")]
            if avx2() {
                let cells: Vec<usize> = (0..reps)
                    .map(|r| row0 * groups + (2 * (col0 + r) + usize::from(high)) / 32)
                    .collect();
                let f32s = ScaleValues::F32(&values);
                let avx512 = avx512bw();
                for (values, what) in [(Some(f32s), "f32"), (kept.as_deref().map(ScaleValues::E8m0), "e8m0 bytes")] {
                    let Some(values) = values else { continue };
                    for quad in [false, avx512] {
                        out.fill(0x5a);
                        // SAFETY: `avx2` holds only where AVX2 was detected on this CPU, `avx512bw` (`quad`)
                        // only where AVX-512 F and BW were.
                        unsafe { nibble_tiles_avx2(&run, src, values, &cells, cell_step, quad) };
                        prop_assert_eq!(&out[..], &want[..], "nibble_tiles_avx2, {}, quad {}", what, quad);
                    }
                }
            }
        }

        /// Streaming copies equal plain copies for every length and both alignments, and write nothing
        /// outside the destination slice.
        #[test]
        fn stream_copy_equals_copy(len in 0usize..9000, src_off in 0usize..64, dst_off in 0usize..64, seed: u8) {
            let src: Vec<u8> = (0..len + src_off).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let mut out = vec![0xa5u8; len + dst_off + 64];
            stream_copy(&mut out[dst_off..dst_off + len], &src[src_off..]);
            stream_fence();
            prop_assert_eq!(&out[dst_off..dst_off + len], &src[src_off..]);
            prop_assert!(out[..dst_off].iter().chain(&out[dst_off + len..]).all(|&b| b == 0xa5));
        }

        /// The strided-gather kernel (a column slice: `reps` rows of `count` elements, `row` elements apart
        /// in the source, into back-to-back or spaced destination rows at any alignment) writes exactly what
        /// a naive per-row copy writes, through `write_run` as the engine calls it, and nothing else.
        #[test]
        fn gather_rows_equals_naive_copy(
            size in prop_oneof![Just(1usize), Just(2), Just(4)],
            count in 1usize..1100,
            extra in 0usize..300,
            reps in 2usize..40,
            pad in prop_oneof![Just(0usize), 1usize..40],
            src_off in 0usize..64,
            dst_off in 0usize..64,
            seed: u8,
        ) {
            let dtype = match size { 1 => Dtype::U8, 2 => Dtype::BF16, _ => Dtype::F32 };
            let extent = count * size;
            let row = extent + extra * size;
            let src: Vec<u8> = (0..src_off + row * reps).map(|i| (i as u8).wrapping_mul(29) ^ seed).collect();
            let dst_row = extent + pad * size;
            let mut out = vec![0x5au8; dst_off + dst_row * reps + 64];
            let mut want = out.clone();
            for r in 0..reps {
                let at = dst_off + r * dst_row;
                want[at..at + extent].copy_from_slice(&src[src_off + r * row..][..extent]);
            }
            let run = Run {
                item: 0,
                file: 0,
                src_off: src_off as u64,
                src_stride: size as u64,
                count: count as u64,
                dst_addr: out.as_mut_ptr() as usize + dst_off,
                dst_stride: size,
                reps: reps as u64,
                rep_src_stride: row as u64,
                rep_dst_stride: dst_row,
                src_dtype: dtype,
                dst_dtype: dtype,
                src_nibble: 0,
            };
            write_run(&run, &src[src_off..]);
            prop_assert_eq!(out, want);
        }
    }
}
