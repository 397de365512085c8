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
/// again soon, and streaming stores skip reading each destination cache line before overwriting it.
pub(crate) fn stream_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "stream_copy needs equal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = dst.len();
        let head = ((16 - (dst.as_ptr() as usize & 15)) & 15).min(n);
        dst[..head].copy_from_slice(&src[..head]);
        let body = (n - head) / 64 * 64;
        // SAFETY: `head..head + body` lies inside both slices (checked lengths above); the destination
        // pointer at `head` is 16-byte aligned as `_mm_stream_si128` requires; loads are unaligned. SSE2 is
        // part of the x86_64 baseline. `_mm_sfence` orders the streaming stores before the return, so the
        // bytes are visible to whoever observes this thread's completion.
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
            _mm_sfence();
        }
        dst[head + body..].copy_from_slice(&src[head + body..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
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

/// [`cast_scaled_dense`] compiled for AVX2 (8 lanes and byte-to-dword loads in the vectorized block loop; the
/// same scalar semantics, no fused multiply-add, so the values are bit for bit those of the SSE2 build).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn cast_scaled_dense_avx2(
    pair: (Dtype, Dtype),
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    cast_scaled_dense(pair, src, dst, map, flat0);
}

/// [`cast_scaled_dense`] through the widest vector code this CPU runs.
fn dequantize_dense(
    pair: (Dtype, Dtype),
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 support was just detected on this CPU.
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

    proptest! {
        /// The dense dequantizing kernel (the SSE2 build and the dispatched AVX2 one) equals the generic
        /// per-element kernel (into dense and strided destinations) and the formula, bit for bit: random
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
            let map = ScaleMap { values: &values, ndim: 2, shape, block, grid_strides };
            let a = ((span.0 * numel as f64) as u64).min(numel - 1);
            let b = a + 1 + ((span.1 * (numel - a - 1) as f64) as u64);
            let src = &q[a as usize..b as usize];
            let n = src.len();
            let size = dd.byte_size().unwrap();
            let mut sse2 = vec![0u8; n * size];
            cast_scaled_dense((sd, dd), src, &mut sse2, &map, a);
            let mut fast = vec![0u8; n * size];
            dequantize_dense((sd, dd), src, &mut fast, &map, a);
            let mut strided = VecSink { out: vec![0u8; (n * dst_stride + 1) * size], size, stride: dst_stride, offset: 1 };
            cast_scaled((sd, dd), src, 1, n, &map, (a, 1), &mut strided);
            for i in 0..n {
                let flat = a + i as u64;
                let (r, c) = (flat / cols, flat % cols);
                let scale = values[((r / brow) * gcols + c / bcol) as usize];
                let want = formula(sd, dd, src[i], scale);
                let generic = &strided.out[(1 + i * dst_stride) * size..][..size];
                for (name, got) in [("sse2", &sse2[i * size..][..size]), ("dispatched", &fast[i * size..][..size]), ("generic", generic)] {
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
            let map = ScaleMap { values: &values, ndim: 2, shape, block, grid_strides };
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

        /// Streaming copies equal plain copies for every length and both alignments, and write nothing
        /// outside the destination slice.
        #[test]
        fn stream_copy_equals_copy(len in 0usize..9000, src_off in 0usize..64, dst_off in 0usize..64, seed: u8) {
            let src: Vec<u8> = (0..len + src_off).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let mut out = vec![0xa5u8; len + dst_off + 64];
            stream_copy(&mut out[dst_off..dst_off + len], &src[src_off..]);
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
