//! Destination buffers and the only code that writes through raw destination pointers.
//!
//! A [`DestBuf`] names caller memory: either a borrowed `&mut [u8]` (safe) or a raw address range
//! ([`DestBuf::from_raw_parts`], `unsafe`: the caller promises the memory stays valid and untouched for
//! the duration of [`crate::execute`]). Every write goes through a [`Run`] produced by
//! [`crate::runs::plan`], which checked that the run's bytes lie inside its destination buffer and that
//! no two runs write the same byte; that check is what makes the writes below sound, also when several
//! threads write disjoint runs of one buffer at once.
//!
//! MXFP4 runs are written by [`mxfp4`] (its scalar kernel and its vectorized tiles, one module); the 8-bit
//! float dequantization picks its kernel here (`dequantize_dense`: `crate::lookup`'s tables or the
//! arithmetic kernel of `crate::kernels` built for the widest vector width, by [`crate::simd::level`]).
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
    cast_dense, cast_scaled, cast_scaled_dense, cast_strided, ElemSink, ScaleMap,
};
#[cfg(target_arch = "x86_64")]
use crate::lookup;
#[cfg(target_arch = "x86_64")]
use crate::simd;
use crate::types::Run;

pub mod mxfp4;
#[cfg(test)]
mod tests;

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
    // SAFETY: runs::plan checked that the bytes of every repetition `rep < reps` lie inside one DestBuf
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
        // SAFETY: runs::plan checked that every element `i < count` of every repetition of this run lies
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
        mxfp4::write_nibble_run(run, src, map, begin);
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

/// Whether the 512-bit dequantizing and nibble kernels run: AVX-512 F and BW detected on this CPU and the level
/// not capped below them (`crate::simd`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512bw() -> bool {
    simd::level() >= simd::Level::Avx512
}

/// Whether the 256-bit kernels run: AVX2 detected on this CPU and the level not capped below it (`crate::simd`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2() -> bool {
    simd::level() >= simd::Level::Avx2
}

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
    // SAFETY: runs::plan_file_major checked that the `count` adjacent elements of every repetition lie
    // inside one DestBuf, valid for reads by its constructor's contract; with repetitions back to back
    // (`rep_dst_stride == dst_bytes`), repetitions `reps` are the one range `base..base + n * dst_bytes`.
    let bytes = unsafe { std::slice::from_raw_parts(base as *const u8, n * run.dst_bytes()) };
    Some(f(bytes))
}

/// The write direction's read of memory: appends the bytes of repetitions `reps` of a same-dtype,
/// byte-sized run to `out`, each repetition's elements in order (adjacent, as the file holds them). The
/// run's "destination" side is the memory being saved: `runs::plan_file_major` checked that every
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
            // SAFETY: runs::plan_file_major checked that the `count` adjacent elements of repetition
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
