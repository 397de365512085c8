//! The MXFP4 tile kernel (x86-64): [`nibble_tiles_avx2`], and its AVX-512 passes that stream whole
//! destination lines.

#![allow(unsafe_code)]

use super::decode::*;
use super::*;
use crate::dest::prefetch_lines;

/// Tile heights ahead of the one decoded whose source lines [`nibble_tiles_avx2`] prefetches.
pub(super) const NIBBLE_AHEAD: usize = 2;

/// Elements (source rows) of one staged piece of a band in [`nibble_tiles_avx2`] at most: a band's 64 columns
/// of up to 2048 bf16 elements (256 KiB, L2-resident) are decoded into a buffer and then written out row by
/// row, so that a band's destination rows, adjacent in memory, are streamed back to back.
pub(super) const NIBBLE_STAGE: usize = 2048;

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
#[target_feature(enable = "avx2")]
pub(super) unsafe fn nibble_tiles_avx2(
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
                    // destination row (`y0 + 32 <= count`), which runs::plan gave to this run alone.
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
#[target_feature(enable = "avx512f,avx512bw")]
#[inline(never)]
pub(super) fn quad_columns_avx512<const WIDE: bool>(
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
#[target_feature(enable = "avx512f,avx512bw")]
#[inline(never)]
pub(super) unsafe fn quad_lines_avx512<const WIDE: bool>(
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
pub(super) type QuadLines = unsafe fn(&[u8], usize, bool, [&[i16]; NIBBLE_BAND], *mut u8, usize);

/// The nibbles of rows `0..16` of a band (64 bytes each, `stride` apart), transposed four 16 x 16 tiles
/// at once: vector `k` holds column `k` of tile `t` in its 128-bit lane `t`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn quad_codes(
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
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn quad_steps(
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
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn quad_column<const WIDE: bool>(
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
