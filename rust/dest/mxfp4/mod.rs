//! MXFP4 in one place: 4-bit e2m1 codes, two a byte, each times an e8m0 power-of-two scale per block of 32
//! (gpt-oss's expert weights), dequantized into a wider float as a run of the destination writer is written.
//!
//! - here: the e2m1 tables, the exponent steps of the scales, the scalar kernel (generic over the
//!   destination float, the reference of the others: `cast_scaled_nibbles`, `nibble_rows_dense`) and the
//!   run writer that picks a kernel (`write_nibble_run`);
//! - `decode.rs` (x86-64): the vector pieces of the tile kernel: scale steps by tile (`RunSteps`), the
//!   e2m1 lookup, the narrow and wide decodes, byte transposes;
//! - `tiles.rs` (x86-64): the tile kernel (AVX2, and AVX-512 for whole cache lines), chosen by
//!   [`crate::simd::level`];
//! - `tests.rs`: each vector path equals the scalar kernel and the formula, bit for bit.
//!
//! The scale bytes' values (`mxfp4_scale_to_f32`, `mxfp4_scaled`) stay with the other scalar conversions
//! in [`crate::kernels`], which every batch's scale decoding uses.

use crate::dtype::Dtype;
use crate::kernels::{
    mxfp4_scale_to_f32, mxfp4_scaled, scaled_with_dst, ElemSink, FloatCodec, ScaleMap, ScaleValues,
    Scales, CBF16, CF16, CF32, CF64,
};
use crate::types::Run;

#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512bw};
use super::{with_dense_rep, SliceSink, StridedSink};

#[cfg(target_arch = "x86_64")]
mod decode;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod tiles;

#[cfg(target_arch = "x86_64")]
use tiles::nibble_tiles_avx2;

/// The value of each 4-bit e2m1 code (OCP MX spec: sign, 2 exponent bits, 1 mantissa bit), exact in `f32`.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The bfloat16 bits of each e2m1 value ([`E2M1_VALUES`], all exact in bf16): the lookup table of the
/// vectorized MXFP4 kernel (`crate::dest`).
#[cfg(any(test, target_arch = "x86_64"))]
pub(crate) const E2M1_BF16_BITS: [u16; 16] = [
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80, 0xbfc0,
    0xc000, 0xc040, 0xc080, 0xc0c0,
];

/// The exponent step `(e - 127) << 7` of an MXFP4 scale as the e8m0 byte `e` gives it ([`mxfp4_scale_to_f32`]):
/// `2^(e - 127)` for `e` 1..=254, byte 0's `2^-127` (an `f32` subnormal) and byte 255's `2^128` (an infinite
/// `f32`, `e` = 255); `None` for any other `f32` (not a power of two, negative, NaN, or a power of two no e8m0
/// byte gives), which only the Rust API can pass. The step multiplies a non-zero e2m1 value by its scale: for
/// bytes 2..=252 ([`NARROW_STEPS`]) every product (`±0.5..=±6`, exponents -1..=2, one mantissa bit) is a
/// normal, finite bf16 (biased exponent `e - 1..=e + 2` within 1..=254), so the exact product, which
/// `f32_to_bf16` of the `f32` product is, is the value's bits with the step added to the exponent field; for
/// the other bytes some products are subnormal (bytes 0 and 1) or overflow to infinity (253..=255), which
/// the vectorized kernel's wide decode handles (`mxfp4_wide_bits`, its scalar model in the tests). Zero codes
/// stay zero (the caller masks them).
#[cfg(any(test, target_arch = "x86_64"))]
#[inline(always)]
pub(crate) fn mxfp4_exponent_step(scale: f32) -> Option<i16> {
    let bits = scale.to_bits();
    let e = bits >> 23; // the sign bit lands at bit 8: a negative scale is out of range
    match bits {
        0x0040_0000 => Some(-127 << 7), // byte 0: 2^-127
        0x7f80_0000 => Some(128 << 7),  // byte 255: 2^128
        _ if bits & 0x007f_ffff == 0 && (1..=254).contains(&e) => Some((e as i16 - 127) << 7),
        _ => None,
    }
}

/// The steps ([`mxfp4_exponent_step`]) of scale bytes 2..=252, whose products are the step added to the
/// value's bits.
#[cfg(any(test, target_arch = "x86_64"))]
pub(crate) const NARROW_STEPS: std::ops::RangeInclusive<i16> = (-125 << 7)..=(125 << 7);

/// The bf16 bits of a non-zero e2m1 value of bf16 bits `bits` times the scale of exponent step `step`
/// ([`mxfp4_exponent_step`]), for every step an e8m0 byte gives: exactly what the scalar kernel computes
/// (`f32_to_bf16(mxfp4_scaled(e2m1, scale))`). The scalar model of the vectorized kernel's wide decode
/// (`crate::dest`, lane by lane the same operations): on the magnitude, the step added with signed
/// saturation (`E' << 7 | f << 6`, `E'` the product's biased exponent, `f` its mantissa bit); `E' >= 255`
/// is infinity (`min` with `0x7f80`); `E' <= 0` (0 or -1: the smallest value times `2^-127`) is the subnormal
/// `(2 + f) << (5 + E')`; then the sign.
#[cfg(test)]
pub(crate) fn mxfp4_wide_bits(bits: u16, step: i16) -> u16 {
    let (sign, mag) = (bits & 0x8000, (bits & 0x7fff) as i16);
    let e = mag.saturating_add(step);
    let normal = e.min(0x7f80);
    let t = ((e & 0x40) >> 1) | 0x40;
    let sub = if e < 0 { t >> 1 } else { t };
    (if e < 0x80 { sub } else { normal }) as u16 | sign
}

/// The low (`HIGH = false`) or high nibble of a byte as an e2m1 value: a source of the dequantizing
/// kernels only (never a destination).
struct CE2M1<const HIGH: bool>;

impl<const HIGH: bool> FloatCodec for CE2M1<HIGH> {
    const SIZE: usize = 1;
    #[inline(always)]
    fn to_f32(b: &[u8]) -> f32 {
        let code = if HIGH { b[0] >> 4 } else { b[0] & 0x0f };
        E2M1_VALUES[usize::from(code)]
    }
    #[inline(always)]
    fn scaled(x: f32, scale: f32) -> f32 {
        mxfp4_scaled(x, scale)
    }
    fn store_f32(_: f32, _: &mut [u8]) {
        unreachable!("e2m1 is never a destination")
    }
}

/// [`crate::kernels::cast_scaled`] for MXFP4: element `i` is the low (`high = false`) or high nibble of byte
/// `i * src_stride` of `src`, decoded as e2m1 and multiplied by its scale; `at = (flat0, step)` in 4-bit
/// elements of the quantized tensor.
pub(crate) fn cast_scaled_nibbles<W: ElemSink>(
    (high, dd): (bool, Dtype),
    src: &[u8],
    src_stride: usize,
    count: usize,
    map: &ScaleMap<'_>,
    at: (u64, u64),
    sink: &mut W,
) {
    match high {
        false => scaled_with_dst::<CE2M1<false>, W>(dd, src, src_stride, count, map, at, sink),
        true => scaled_with_dst::<CE2M1<true>, W>(dd, src, src_stride, count, map, at, sink),
    }
}

/// MXFP4 e8m0 bytes as [`Scales`].
#[derive(Clone, Copy)]
pub(crate) struct E8m0Scales<'a>(pub &'a [u8]);

impl Scales for E8m0Scales<'_> {
    #[inline(always)]
    fn scale(self, i: usize) -> f32 {
        mxfp4_scale_to_f32(self.0[i])
    }
}

/// MXFP4 nibbles whose scales step by whole grid rows (see [`ScaleMap::row_steps`]): element `i` is the
/// low or high nibble of `src[i * src_stride]` times `values[cell0 + i * cell_step]`, into `dst` (dense).
#[inline(always)]
fn nibble_rows<const HIGH: bool, D: FloatCodec, V: Scales>(
    src: &[u8],
    src_stride: usize,
    values: V,
    (cell0, cell_step): (usize, usize),
    dst: &mut [u8],
) {
    for (i, o) in dst.chunks_exact_mut(D::SIZE).enumerate() {
        let v = CE2M1::<HIGH>::to_f32(&src[i * src_stride..]);
        D::store_f32(mxfp4_scaled(v, values.scale(cell0 + i * cell_step)), o);
    }
}

/// The dense-destination case of [`cast_scaled_nibbles`] when [`ScaleMap::row_steps`] holds (transformers'
/// transposed gpt-oss layout: each element of a run is the next row): no grid arithmetic per element.
pub(crate) fn nibble_rows_dense(
    (high, dd): (bool, Dtype),
    src: &[u8],
    src_stride: usize,
    values: ScaleValues<'_>,
    cells: (usize, usize),
    dst: &mut [u8],
) {
    macro_rules! go {
        ($d:ty) => {
            match (high, values) {
                (false, ScaleValues::F32(v)) => {
                    nibble_rows::<false, $d, _>(src, src_stride, v, cells, dst)
                }
                (true, ScaleValues::F32(v)) => {
                    nibble_rows::<true, $d, _>(src, src_stride, v, cells, dst)
                }
                (false, ScaleValues::E8m0(b)) => {
                    nibble_rows::<false, $d, _>(src, src_stride, E8m0Scales(b), cells, dst)
                }
                (true, ScaleValues::E8m0(b)) => {
                    nibble_rows::<true, $d, _>(src, src_stride, E8m0Scales(b), cells, dst)
                }
            }
        };
    }
    match dd {
        Dtype::BF16 => go!(CBF16),
        Dtype::F16 => go!(CF16),
        Dtype::F32 => go!(CF32),
        Dtype::F64 => go!(CF64),
        _ => unreachable!("dequantized items are validated before any copy"),
    }
}

/// Elements of one repetition per tile of [`write_nibble_run`]'s row-stepping case (a tile's source lines,
/// one per element, stay in L1 across the repetitions).
const NIBBLE_TILE: usize = 128;

/// [`super::write_run_scaled`] for a run of MXFP4 nibbles (`run.src_nibble`: 1 the low, 2 the high nibble of each
/// source byte); flat indices count 4-bit elements, two a byte.
pub(super) fn write_nibble_run(run: &Run, src: &[u8], map: &ScaleMap<'_>, begin: u64) {
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
