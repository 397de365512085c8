//! The MXFP4 kernels' tests: the exponent steps against the scalar product, the tile kernel's step classes,
//! and the vectorized tiles against the scalar kernel and the formula at every SIMD level this host runs.

use proptest::prelude::*;

use super::*;
use crate::dest::tests::scale_value;
use crate::dest::write_run_scaled;
use crate::kernels::{f32_to_bf16, mxfp4_scale_to_f32, mxfp4_scaled, ScaleMap, ScaleValues};
#[cfg(target_arch = "x86_64")]
use decode::{step_class, E8M0_STEPS, NARROW, SCALAR, WIDE};

/// The bf16 table is the e2m1 values rounded by the scalar conversion; every MXFP4 scale byte has an
/// exponent step, and for every byte and code the wide decode (the vectorized kernel's, lane by lane) gives
/// exactly what the scalar kernel computes (`f32_to_bf16(mxfp4_scaled(e2m1, scale))`: subnormal products
/// of bytes 0 and 1, byte 255's 2^128 with ±0.5 finite and larger codes infinite), as does adding the step
/// for the narrow bytes 2..=252; a scale that is not a power of two an e8m0 byte gives has no step.
#[test]
fn e2m1_exponent_steps_equal_the_scalar_product() {
    assert_eq!(E2M1_BF16_BITS, E2M1_VALUES.map(f32_to_bf16));
    for s in 0..=255u8 {
        let scale = mxfp4_scale_to_f32(s);
        let step = mxfp4_exponent_step(scale).unwrap_or_else(|| panic!("scale byte {s}"));
        assert_eq!(
            NARROW_STEPS.contains(&step),
            (2..=252).contains(&s),
            "scale byte {s}"
        );
        for (c, &bits) in E2M1_BF16_BITS.iter().enumerate() {
            let want = f32_to_bf16(mxfp4_scaled(E2M1_VALUES[c], scale));
            if c & 7 == 0 {
                assert_eq!(bits, want, "zero code {c} scale byte {s}");
                continue;
            }
            assert_eq!(mxfp4_wide_bits(bits, step), want, "code {c} scale byte {s}");
            if NARROW_STEPS.contains(&step) {
                assert_eq!(
                    bits.wrapping_add(step as u16),
                    want,
                    "code {c} scale byte {s}"
                );
            }
        }
    }
    for bad in [
        3.0f32,
        -1.0,
        -0.0,
        0.0,
        0.75,
        -f32::INFINITY,
        f32::NAN,
        f32::from_bits(1),
        f32::from_bits(0x0020_0000), // 2^-128: a power of two, but no e8m0 byte's
    ] {
        assert_eq!(mxfp4_exponent_step(bad), None, "{bad}");
    }
}

/// The tile kernel's step and class of every MXFP4 scale byte (and of scales with no step) are
/// `mxfp4_exponent_step`'s, narrow exactly for `NARROW_STEPS`.
#[cfg(target_arch = "x86_64")]
#[test]
fn step_classes_follow_the_exponent_steps() {
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
}
