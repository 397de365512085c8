//! The destination writer's tests: the dequantizing dispatch against the generic kernel and the formula,
//! streaming copies, strided gathers (the MXFP4 kernels' are in `mxfp4/tests.rs`).

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
pub(super) fn scale_value() -> impl Strategy<Value = f32> {
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
