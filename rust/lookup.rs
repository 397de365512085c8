//! 8-bit float block dequantization by table lookup (x86-64 with AVX-512 VBMI).
//!
//! One scale covers a whole block (128 x 128 elements in DeepSeek-V3's and Kimi-K2's checkpoints), so every
//! element of a block is one of 256 values. [`scaled_code_values`] computes them once per block with the
//! arithmetic kernel's own code, and each element is then looked up, 64 per step, with byte permutes
//! (`vpermi2b`) over the table's low bytes and its high bytes. A table costs about what 256 elements cost
//! through the arithmetic kernel, so a call takes the lookup only where its span reuses each table enough
//! ([`worthwhile`]). Tables live per thread across calls (a column slice is one call per row, and the rows
//! of a block reuse its tables), one slot per cell of a grid row (direct-mapped), each tagged with what it
//! was built from (the scale's bits and the pair of types), so a slot is used only for exactly that.
//!
//! The lookup gives each element exactly the bits the arithmetic kernel gives it, for every code and every
//! scale (infinite, zero and negative scales included): the table is that kernel's output. One freedom is
//! left, as between the arithmetic kernel's own builds: a NaN code times a NaN scale is a NaN whose payload
//! is either operand's (which one the product keeps depends on the order the compiler gave the operands).

#![allow(unsafe_code)]

use std::cell::RefCell;

use crate::dtype::Dtype;
use crate::kernels::{scaled_code_values, BlockSegments, ScaleMap};

/// Table slots per thread (direct-mapped by window cell): a grid row of up to this many cells keeps all of
/// its tables while the rows of its block are walked (DeepSeek-V3's widest quantized rows, 18,432
/// elements, are 144 cells).
const SLOTS: usize = 256;

/// Elements each table must serve, by [`worthwhile`]'s estimate, for the lookup to be taken: building a
/// table is about 256 elements of the arithmetic kernel, a looked-up element several times cheaper.
const MIN_REUSE: u64 = 512;

/// The 256 destination values of one scale, as their low bytes and their high bytes (code order).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Table {
    lo: [u8; 256],
    hi: [u8; 256],
}

/// A thread's tables: slot `cell % SLOTS` holds the table whose [`tag`] is `tags[slot]` (0: none).
struct Tables {
    tags: Vec<u64>,
    slots: Vec<Table>,
}

/// What a table is built from, as one nonzero word: the scale's bits and the pair of types.
fn tag((sd, dd): (Dtype, Dtype), scale: f32) -> u64 {
    let pair = u64::from(sd == Dtype::F8_E5M2) << 1 | u64::from(dd == Dtype::F16);
    1 << 63 | pair << 32 | u64::from(scale.to_bits())
}

thread_local! {
    static TABLES: RefCell<Tables> = RefCell::new(Tables {
        tags: vec![0; SLOTS],
        slots: vec![Table { lo: [0; 256], hi: [0; 256] }; SLOTS],
    });
}

/// Whether the lookup runs at this process's SIMD level (`crate::simd`: AVX-512 F, BW and VBMI, detected on
/// this CPU and not capped by `HP_FASTLOAD_SIMD`).
pub(crate) fn supported() -> bool {
    crate::simd::level() >= crate::simd::Level::Avx512Vbmi
}

/// Whether the lookup pays for `n` dense elements of `sd` scaled into `dd` over `map`: an 8-bit float into a
/// 2-byte float, and each table serving at least [`MIN_REUSE`] elements by the estimate "the span's part of
/// a block's width times the block's rows that the tensor has" (the rows of a block are read in order by one
/// thread, in this call or the next ones; a per-tensor scale: the whole span).
pub(crate) fn worthwhile((sd, dd): (Dtype, Dtype), n: usize, map: &ScaleMap<'_>) -> bool {
    if !matches!(sd, Dtype::F8_E4M3 | Dtype::F8_E5M2) || !matches!(dd, Dtype::BF16 | Dtype::F16) {
        return false;
    }
    let n = n as u64;
    let reuse = match map.ndim {
        0 => n,
        1 => map.block[0].min(n),
        d => {
            let width = map.block[d - 1].min(map.shape[d - 1]).min(n);
            width * map.block[d - 2].min(map.shape[d - 2])
        }
    };
    reuse >= MIN_REUSE
}

/// The dense dequantization of `cast_scaled_dense` (flat elements `flat0..flat0 + src.len()` of an 8-bit
/// float tensor into adjacent 2-byte elements of `dst`) by table lookup, bit for bit the same.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VBMI ([`supported`]).
///
/// # Panics
/// If `pair` is not one [`worthwhile`] accepts, or `dst` is not twice as long as `src`.
pub(crate) unsafe fn dequantize_dense(
    pair: (Dtype, Dtype),
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    assert_eq!(dst.len(), 2 * src.len(), "2-byte destination elements");
    TABLES.with_borrow_mut(|tables| {
        // SAFETY: the caller guarantees the CPU features.
        unsafe { lookup_span(tables, pair, src, dst, map, flat0) }
    });
}

/// [`dequantize_dense`]'s walk over the block segments, with `tables` for this call.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn lookup_span(
    tables: &mut Tables,
    pair: (Dtype, Dtype),
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    for (cell, a, b) in BlockSegments::new(map, flat0, src.len()) {
        let (slot, scale) = (cell % SLOTS, map.values.get(cell));
        let want = tag(pair, scale);
        if tables.tags[slot] != want {
            // SAFETY: the features this function is compiled for.
            unsafe { build(&mut tables.slots[slot], pair, scale) };
            tables.tags[slot] = want;
        }
        // SAFETY: the features this function is compiled for.
        unsafe { lookup(&tables.slots[slot], &src[a..b], &mut dst[2 * a..2 * b]) };
    }
}

/// Fills `table` with the destination values of the 256 codes times `scale`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn build(table: &mut Table, (sd, dd): (Dtype, Dtype), scale: f32) {
    let mut words = [0u8; 512];
    let known = scaled_code_values(sd, dd, scale, &mut words);
    assert!(known, "a pair the lookup does not take: {sd:?} -> {dd:?}");
    for (c, w) in words.chunks_exact(2).enumerate() {
        table.lo[c] = w[0];
        table.hi[c] = w[1];
    }
}

/// `dst[2i..2i + 2] = table[src[i]]` (low byte, high byte) for every element of `src`.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn lookup(table: &Table, src: &[u8], dst: &mut [u8]) {
    use std::arch::x86_64::*;
    debug_assert_eq!(dst.len(), 2 * src.len());
    let quarter = |bytes: &[u8; 256], q: usize| {
        // SAFETY: `q < 4`, so the 64 bytes lie inside the 256.
        unsafe { _mm512_loadu_si512(bytes.as_ptr().add(64 * q).cast()) }
    };
    let lo = [0, 1, 2, 3].map(|q| quarter(&table.lo, q));
    let hi = [0, 1, 2, 3].map(|q| quarter(&table.hi, q));
    // `unpack{lo,hi}_epi8` interleave within 128-bit lanes; these put the elements back in order.
    let first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    let second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    // 64 codes -> their 64 values, elements 0..32 and 32..64.
    let expand = |x: __m512i| {
        let upper = _mm512_movepi8_mask(x); // codes 128..256: the second half of each table
        let l = _mm512_mask_blend_epi8(
            upper,
            _mm512_permutex2var_epi8(lo[0], x, lo[1]),
            _mm512_permutex2var_epi8(lo[2], x, lo[3]),
        );
        let h = _mm512_mask_blend_epi8(
            upper,
            _mm512_permutex2var_epi8(hi[0], x, hi[1]),
            _mm512_permutex2var_epi8(hi[2], x, hi[3]),
        );
        let (u0, u1) = (_mm512_unpacklo_epi8(l, h), _mm512_unpackhi_epi8(l, h));
        (
            _mm512_permutex2var_epi64(u0, first, u1),
            _mm512_permutex2var_epi64(u0, second, u1),
        )
    };
    let mut codes = src.chunks_exact(64);
    let mut outs = dst.chunks_exact_mut(128);
    for (s, d) in (&mut codes).zip(&mut outs) {
        // SAFETY: `s` holds 64 bytes and `d` 128.
        unsafe {
            let (a, b) = expand(_mm512_loadu_si512(s.as_ptr().cast()));
            _mm512_storeu_si512(d.as_mut_ptr().cast(), a);
            _mm512_storeu_si512(d.as_mut_ptr().add(64).cast(), b);
        }
    }
    let rest = codes.remainder();
    let r = rest.len();
    if r == 0 {
        return;
    }
    let d = outs.into_remainder();
    // SAFETY: the masks enable the `r` bytes of `rest` and the `2r` bytes of `d` only (masked-off lanes
    // are not accessed); `d.add(64)` is used only when `d` is longer than 64 bytes.
    unsafe {
        let (a, b) = expand(_mm512_maskz_loadu_epi8(
            (1u64 << r) - 1,
            rest.as_ptr().cast(),
        ));
        let words = |k: usize| if k >= 32 { u32::MAX } else { (1u32 << k) - 1 };
        _mm512_mask_storeu_epi16(d.as_mut_ptr().cast(), words(r), a);
        if r > 32 {
            _mm512_mask_storeu_epi16(d.as_mut_ptr().add(64).cast(), words(r - 32), b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cast_scaled_dense;
    use crate::types::MAX_NDIM;
    use proptest::prelude::*;

    /// Scales a block may hold: ordinary, tiny (subnormal results), huge (overflow), signed zeros,
    /// negatives, infinities and NaNs.
    fn any_scale() -> impl Strategy<Value = f32> {
        prop_oneof![
            (1e-6f32..1e-2),
            (-4.0f32..4.0),
            Just(0.0f32),
            Just(-0.0f32),
            Just(1e-38f32),
            Just(3e38f32),
            Just(f32::INFINITY),
            Just(f32::NEG_INFINITY),
            Just(f32::NAN),
            Just(f32::from_bits(0xffc0_0001)),
        ]
    }

    fn grid(
        shape: [u64; 2],
        block: [u64; 2],
    ) -> ([u64; MAX_NDIM], [u64; MAX_NDIM], [u64; MAX_NDIM]) {
        let (mut s, mut b, mut g) = ([1; MAX_NDIM], [1; MAX_NDIM], [0; MAX_NDIM]);
        s[..2].copy_from_slice(&shape);
        b[..2].copy_from_slice(&block);
        g[0] = shape[1].div_ceil(block[1]);
        g[1] = 1;
        (s, b, g)
    }

    /// Whether this host runs the lookup at the level in effect. Where it does not (a CPU without AVX-512
    /// VBMI, or `HP_FASTLOAD_SIMD` below `avx512vbmi`), the lookup is not built into any load, so there is
    /// nothing to compare; `simd`'s tests check that the level is the CPU's (as `/proc/cpuinfo` says) capped by
    /// the switch, so a host that has VBMI always runs this test in the top lane.
    fn lookup_runs_here() -> bool {
        supported()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// The lookup equals the arithmetic kernel bit for bit, over every code, any scales, any span of a
        /// 2-D tensor (partial rows and blocks, remainders of every length), both sources, both targets.
        #[test]
        fn lookup_equals_the_arithmetic_kernel(
            rows in 1u64..40, cols in 1u64..300, br in 1u64..20, bc in 1u64..140,
            start in 0.0f64..1.0, len in 0.0f64..1.0,
            scales in prop::collection::vec(any_scale(), 1..64),
            seed in any::<u64>(), e5m2 in any::<bool>(), f16 in any::<bool>(),
        ) {
            if !lookup_runs_here() {
                return Ok(());
            }
            let numel = rows * cols;
            let flat0 = ((numel as f64) * start) as u64;
            let n = (((numel - flat0) as f64) * len).ceil() as usize;
            let (shape, block, strides) = grid([rows, cols], [br, bc]);
            let cells = (rows.div_ceil(br) * cols.div_ceil(bc)) as usize;
            let values: Vec<f32> = (0..cells).map(|i| scales[i % scales.len()]).collect();
            let map = ScaleMap::whole(&values, 2, shape, block, strides);
            let mut state = seed | 1;
            let src: Vec<u8> = (0..n).map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                if i < 256 { i as u8 } else { state as u8 }
            }).collect();
            let pair = (
                if e5m2 { Dtype::F8_E5M2 } else { Dtype::F8_E4M3 },
                if f16 { Dtype::F16 } else { Dtype::BF16 },
            );
            let mut want = vec![0xa5u8; 2 * n];
            cast_scaled_dense(pair, &src, &mut want, &map, flat0);
            let mut got = vec![0x5au8; 2 * n];
            // SAFETY: `supported()` was checked.
            unsafe { dequantize_dense(pair, &src, &mut got, &map, flat0) };
            let inf = if f16 { 0x7c00 } else { 0x7f80 };
            let nan = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]) & 0x7fff > inf;
            for (i, (g, w)) in got.chunks_exact(2).zip(want.chunks_exact(2)).enumerate() {
                // A NaN code times a NaN scale may keep either NaN's payload (module docs).
                let either_nan = nan(w) && nan(g) && src[i] & 0x7f >= if e5m2 { 0x7d } else { 0x7f };
                prop_assert!(g == w || either_nan, "element {}: code {:#x}, got {:?}, want {:?}", i, src[i], g, w);
            }
        }
    }

    /// A dense span of a DeepSeek-V3-like weight (128 x 128 blocks, rows of 7,168) takes the lookup, also a
    /// column slice's row; a span of a few elements, a grid with one row per block, a tensor of one row, or a
    /// 4-byte destination keep the arithmetic kernel.
    #[test]
    fn worthwhile_takes_spans_that_reuse_their_tables() {
        let (shape, block, strides) = grid([1024, 7168], [128, 128]);
        let values = vec![1.0f32; 8 * 56];
        let map = ScaleMap::whole(&values, 2, shape, block, strides);
        let fp8 = (Dtype::F8_E4M3, Dtype::BF16);
        assert!(worthwhile(fp8, 28 * 7168, &map));
        assert!(worthwhile(fp8, 128, &map));
        assert!(!worthwhile(fp8, 3, &map));
        assert!(!worthwhile((Dtype::F8_E4M3, Dtype::F32), 28 * 7168, &map));
        // one row: a block's 128 rows are not there to reuse its table
        let (shape, block, strides) = grid([1, 7168], [128, 128]);
        let one_row = ScaleMap::whole(&values, 2, shape, block, strides);
        assert!(!worthwhile(fp8, 7168, &one_row));
        let (shape, block, strides) = grid([1024, 7168], [1, 128]);
        let map = ScaleMap::whole(&values, 2, shape, block, strides);
        assert!(!worthwhile(fp8, 28 * 7168, &map));
    }
}
