//! The element conversions the engine fuses into a copy: scalar conversions between bit patterns, the cast
//! kernels (strided and dense), and the 8-bit float dequantizing kernels with their block scales (`ScaleMap`,
//! scale decoding). MXFP4's kernels, scalar and vectorized, are in [`crate::dest::mxfp4`], on the codecs here.
//!
//! Casts between floating types reproduce torch's CPU conversions bit for bit on every non-NaN value: a
//! conversion to a 16-bit or 8-bit float goes through `f32` first (c10's types convert from `float`, so an
//! `f64` source is rounded twice, as in torch), rounding to nearest-even, and the float8 conversions follow
//! c10's `fp8e4m3fn_from_fp32_value` (saturating, as in the torch 2.15 headers), `fp8e5m2_from_fp32_value` and `fp8e8m0fnu_from_fp32_value`. NaN
//! inputs give a NaN (torch's own NaN bit patterns differ between its scalar and vector code paths).
//! Every other pair of types is copied only to itself ([`Dtype::can_cast_to`]). This module owns no I/O
//! and no raw pointers: kernels read and write byte slices (`crate::dest` turns runs into them).

use crate::dtype::Dtype;
use crate::types::MAX_NDIM;

mod convert;
mod scalemap;
#[cfg(test)]
mod tests;

pub use convert::*;
pub(crate) use scalemap::{CellWindow, ScaleMap, ScaleValues, Scales};

// ---------------------------------------------------------------------------------------------------------
// Fused copy kernels.

/// Where a kernel puts converted elements: `put(i, bytes)` stores the `i`-th element of a run.
pub(crate) trait ElemSink {
    fn put(&mut self, i: usize, bytes: &[u8]);
}

/// A floating type the kernels can convert from and to.
pub(crate) trait FloatCodec {
    const SIZE: usize;
    fn to_f32(b: &[u8]) -> f32;
    fn to_f64(b: &[u8]) -> f64 {
        f64::from(Self::to_f32(b))
    }
    fn store_f32(x: f32, out: &mut [u8]);
    /// One element times its scale (in `f32`, before the rounding into the destination).
    #[inline(always)]
    fn scaled(x: f32, scale: f32) -> f32 {
        x * scale
    }
    /// Converts one element of `S` into `out`; torch's semantics go through `f32` except into `f64`.
    fn convert_from<S: FloatCodec>(src: &[u8], out: &mut [u8]) {
        Self::store_f32(S::to_f32(src), out);
    }
}

fn le2(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

pub(crate) struct CF16;
pub(crate) struct CBF16;
pub(crate) struct CF32;
pub(crate) struct CF64;
struct CE4M3;
struct CE5M2;
struct CE8M0;

impl FloatCodec for CF16 {
    const SIZE: usize = 2;
    fn to_f32(b: &[u8]) -> f32 {
        f16_to_f32(le2(b))
    }
    fn store_f32(x: f32, out: &mut [u8]) {
        out[..2].copy_from_slice(&f32_to_f16(x).to_le_bytes());
    }
}
impl FloatCodec for CBF16 {
    const SIZE: usize = 2;
    fn to_f32(b: &[u8]) -> f32 {
        bf16_to_f32(le2(b))
    }
    fn store_f32(x: f32, out: &mut [u8]) {
        out[..2].copy_from_slice(&f32_to_bf16(x).to_le_bytes());
    }
}
impl FloatCodec for CF32 {
    const SIZE: usize = 4;
    fn to_f32(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    fn store_f32(x: f32, out: &mut [u8]) {
        out[..4].copy_from_slice(&x.to_le_bytes());
    }
}
impl FloatCodec for CF64 {
    const SIZE: usize = 8;
    fn to_f32(b: &[u8]) -> f32 {
        Self::to_f64(b) as f32
    }
    fn to_f64(b: &[u8]) -> f64 {
        f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    }
    fn store_f32(x: f32, out: &mut [u8]) {
        out[..8].copy_from_slice(&f64::from(x).to_le_bytes());
    }
    fn convert_from<S: FloatCodec>(src: &[u8], out: &mut [u8]) {
        out[..8].copy_from_slice(&S::to_f64(src).to_le_bytes());
    }
}
impl FloatCodec for CE4M3 {
    const SIZE: usize = 1;
    fn to_f32(b: &[u8]) -> f32 {
        e4m3fn_to_f32(b[0])
    }
    fn store_f32(x: f32, out: &mut [u8]) {
        out[0] = f32_to_e4m3fn(x);
    }
}
impl FloatCodec for CE5M2 {
    const SIZE: usize = 1;
    fn to_f32(b: &[u8]) -> f32 {
        e5m2_to_f32(b[0])
    }
    fn store_f32(x: f32, out: &mut [u8]) {
        out[0] = f32_to_e5m2(x);
    }
}
impl FloatCodec for CE8M0 {
    const SIZE: usize = 1;
    fn to_f32(b: &[u8]) -> f32 {
        e8m0_to_f32(b[0])
    }
    fn store_f32(x: f32, out: &mut [u8]) {
        out[0] = f32_to_e8m0(x);
    }
}

#[inline(always)]
fn float_kernel<S: FloatCodec, D: FloatCodec, W: ElemSink>(
    src: &[u8],
    src_stride: usize,
    count: usize,
    sink: &mut W,
) {
    let mut buf = [0u8; 8];
    for i in 0..count {
        let at = i * src_stride;
        D::convert_from::<S>(&src[at..at + S::SIZE], &mut buf);
        sink.put(i, &buf[..D::SIZE]);
    }
}

/// Contiguous cast into a byte slice: the hot path (e.g. bf16 to f32), written so it vectorizes.
#[inline(always)]
fn float_kernel_dense<S: FloatCodec, D: FloatCodec>(src: &[u8], dst: &mut [u8]) {
    for (s, d) in src.chunks_exact(S::SIZE).zip(dst.chunks_exact_mut(D::SIZE)) {
        D::convert_from::<S>(s, d);
    }
}

fn with_dst<S: FloatCodec, W: ElemSink>(dd: Dtype, src: &[u8], ss: usize, n: usize, w: &mut W) {
    match dd {
        Dtype::F16 => float_kernel::<S, CF16, W>(src, ss, n, w),
        Dtype::BF16 => float_kernel::<S, CBF16, W>(src, ss, n, w),
        Dtype::F32 => float_kernel::<S, CF32, W>(src, ss, n, w),
        Dtype::F64 => float_kernel::<S, CF64, W>(src, ss, n, w),
        Dtype::F8_E4M3 => float_kernel::<S, CE4M3, W>(src, ss, n, w),
        Dtype::F8_E5M2 => float_kernel::<S, CE5M2, W>(src, ss, n, w),
        Dtype::F8_E8M0 => float_kernel::<S, CE8M0, W>(src, ss, n, w),
        _ => unreachable!("cast pairs are validated before any copy"),
    }
}

fn dense_with_dst<S: FloatCodec>(dd: Dtype, src: &[u8], dst: &mut [u8]) {
    match dd {
        Dtype::F16 => float_kernel_dense::<S, CF16>(src, dst),
        Dtype::BF16 => float_kernel_dense::<S, CBF16>(src, dst),
        Dtype::F32 => float_kernel_dense::<S, CF32>(src, dst),
        Dtype::F64 => float_kernel_dense::<S, CF64>(src, dst),
        Dtype::F8_E4M3 => float_kernel_dense::<S, CE4M3>(src, dst),
        Dtype::F8_E5M2 => float_kernel_dense::<S, CE5M2>(src, dst),
        Dtype::F8_E8M0 => float_kernel_dense::<S, CE8M0>(src, dst),
        _ => unreachable!("cast pairs are validated before any copy"),
    }
}

#[inline(always)]
fn scaled_kernel<S: FloatCodec, D: FloatCodec, W: ElemSink>(
    src: &[u8],
    src_stride: usize,
    count: usize,
    map: &ScaleMap<'_>,
    (flat0, step): (u64, u64),
    sink: &mut W,
) {
    let mut buf = [0u8; 8];
    let (mut scale, mut until, mut flat) = (0f32, 0u64, flat0);
    for i in 0..count {
        if flat >= until {
            (scale, until) = map.at(flat);
        }
        let at = i * src_stride;
        D::store_f32(
            S::scaled(S::to_f32(&src[at..at + S::SIZE]), scale),
            &mut buf,
        );
        sink.put(i, &buf[..D::SIZE]);
        flat += step;
    }
}

pub(crate) fn scaled_with_dst<S: FloatCodec, W: ElemSink>(
    dd: Dtype,
    src: &[u8],
    ss: usize,
    n: usize,
    map: &ScaleMap<'_>,
    at: (u64, u64),
    w: &mut W,
) {
    match dd {
        Dtype::F16 => scaled_kernel::<S, CF16, W>(src, ss, n, map, at, w),
        Dtype::BF16 => scaled_kernel::<S, CBF16, W>(src, ss, n, map, at, w),
        Dtype::F32 => scaled_kernel::<S, CF32, W>(src, ss, n, map, at, w),
        Dtype::F64 => scaled_kernel::<S, CF64, W>(src, ss, n, map, at, w),
        _ => unreachable!("dequantized items are validated before any copy"),
    }
}

/// Whether the engine dequantizes `sd` elements into `dd`: an 8-bit float, or `U8` bytes holding MXFP4
/// e2m1 pairs, into a wider float.
pub(crate) fn can_dequantize(sd: Dtype, dd: Dtype) -> bool {
    matches!(sd, Dtype::F8_E4M3 | Dtype::F8_E5M2 | Dtype::U8)
        && matches!(dd, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64)
}

/// Like [`cast_strided`], each element multiplied (in `f32`) by its scale before the one rounding into
/// `dd`: element `i` is flat element `flat0 + i * step` of the quantized tensor (`at = (flat0, step)`).
pub(crate) fn cast_scaled<W: ElemSink>(
    (sd, dd): (Dtype, Dtype),
    src: &[u8],
    src_stride: usize,
    count: usize,
    map: &ScaleMap<'_>,
    at: (u64, u64),
    sink: &mut W,
) {
    match sd {
        Dtype::F8_E4M3 => scaled_with_dst::<CE4M3, W>(dd, src, src_stride, count, map, at, sink),
        Dtype::F8_E5M2 => scaled_with_dst::<CE5M2, W>(dd, src, src_stride, count, map, at, sink),
        _ => unreachable!("dequantized items are validated before any copy"),
    }
}

/// float8 e4m3fn bits to `f32` without a table or a branch (equal to [`e4m3fn_to_f32`] on every code), so
/// that a loop over it vectorizes: a normal code's exponent and mantissa move into place and the exponent is
/// rebiased by 120; a subnormal code (exponent 0) is built as `2^-6 * (1 + m/8)` and `2^-6` subtracted
/// (exact); the NaN codes give the quiet NaN.
#[inline(always)]
fn e4m3_value(v: u8) -> f32 {
    let v = u32::from(v);
    let mag = v & 0x7f;
    let normal = f32::from_bits((mag << 20) + (120 << 23));
    let sub = f32::from_bits((mag << 20) + (121 << 23)) - f32::from_bits(121 << 23);
    let x = if mag < 0x08 { sub } else { normal };
    let bits = if mag == 0x7f {
        0x7fc0_0000
    } else {
        x.to_bits()
    };
    f32::from_bits(bits | ((v & 0x80) << 24))
}

/// float8 e5m2 bits to `f32` without a table or a branch (equal to [`e5m2_to_f32`] on every code): as
/// [`e4m3_value`] with a rebias of 112, subnormals from `2^-14`, and exponent 31 for infinities and NaNs.
#[inline(always)]
fn e5m2_value(v: u8) -> f32 {
    let v = u32::from(v);
    let mag = v & 0x7f;
    let normal = f32::from_bits((mag << 21) + (112 << 23));
    let sub = f32::from_bits((mag << 21) + (113 << 23)) - f32::from_bits(113 << 23);
    let x = if mag < 0x04 { sub } else { normal };
    let quiet = if mag & 3 == 0 { 0 } else { 0x40_0000 };
    let special = 0x7f80_0000 | ((mag & 3) << 21) | quiet;
    let bits = if mag >= 0x7c { special } else { x.to_bits() };
    f32::from_bits(bits | ((v & 0x80) << 24))
}

/// An 8-bit float source of the dense dequantizing kernel, decoded without a table.
trait Fp8Value {
    fn value(v: u8) -> f32;
}

struct QE4M3;
struct QE5M2;

impl Fp8Value for QE4M3 {
    #[inline(always)]
    fn value(v: u8) -> f32 {
        e4m3_value(v)
    }
}
impl Fp8Value for QE5M2 {
    #[inline(always)]
    fn value(v: u8) -> f32 {
        e5m2_value(v)
    }
}

/// Elements of one scale block converted per step of the block kernel (a fixed count LLVM unrolls and
/// vectorizes; the rest of a segment takes the same code one element at a time).
const BLOCK_LANES: usize = 16;

/// One block segment: `dst[i] = D(decode(src[i]) * scale)` for adjacent source and destination elements.
#[inline(always)]
fn scaled_segment<Q: Fp8Value, D: FloatCodec>(scale: f32, src: &[u8], dst: &mut [u8]) {
    let mut s_it = src.chunks_exact(BLOCK_LANES);
    let mut d_it = dst.chunks_exact_mut(BLOCK_LANES * D::SIZE);
    for (s, d) in (&mut s_it).zip(&mut d_it) {
        for (q, o) in s.iter().zip(d.chunks_exact_mut(D::SIZE)) {
            D::store_f32(Q::value(*q) * scale, o);
        }
    }
    let rest = d_it.into_remainder().chunks_exact_mut(D::SIZE);
    for (q, o) in s_it.remainder().iter().zip(rest) {
        D::store_f32(Q::value(*q) * scale, o);
    }
}

/// Every byte in order: the 256 codes of an 8-bit float.
#[cfg(target_arch = "x86_64")]
const ALL_CODES: [u8; 256] = {
    let mut codes = [0u8; 256];
    let mut c = 0;
    while c < 256 {
        codes[c] = c as u8;
        c += 1;
    }
    codes
};

/// What the dense kernel makes of each of the 256 codes of the 8-bit float `sd` times `scale` in the 2-byte
/// float `dd`: code `c`'s bits at `out[2c..2c + 2]` (little-endian), computed by [`scaled_segment`] itself,
/// so that looking an element up gives it bit for bit (a block with one scale holds only these 256 values).
/// `false`, and `out` untouched, for any pair but e4m3 / e5m2 into bf16 / f16. Inlined into its callers, so
/// that they compile it for their vector width.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn scaled_code_values(sd: Dtype, dd: Dtype, scale: f32, out: &mut [u8; 512]) -> bool {
    match (sd, dd) {
        (Dtype::F8_E4M3, Dtype::BF16) => scaled_segment::<QE4M3, CBF16>(scale, &ALL_CODES, out),
        (Dtype::F8_E4M3, Dtype::F16) => scaled_segment::<QE4M3, CF16>(scale, &ALL_CODES, out),
        (Dtype::F8_E5M2, Dtype::BF16) => scaled_segment::<QE5M2, CBF16>(scale, &ALL_CODES, out),
        (Dtype::F8_E5M2, Dtype::F16) => scaled_segment::<QE5M2, CF16>(scale, &ALL_CODES, out),
        _ => return false,
    }
    true
}

/// The block segments of the flat elements `flat0..flat0 + n` of a scaled tensor: `(cell, a, b)`, elements
/// `a..b` (counted from `flat0`) sharing the scale of window cell `cell`; one grid lookup per row of the last
/// dim, the next cell for each further segment of that row. (An iterator rather than a walk taking a
/// closure: a closure is compiled without the vector features of the kernel that calls it.)
pub(crate) struct BlockSegments<'m, 'a> {
    map: &'m ScaleMap<'a>,
    block: u64,
    n: usize,
    i: usize,
    flat: u64,
    /// The current segment's cell, its end and its row's end (flat indices); `until == flat` at a row start.
    cell: usize,
    until: u64,
    row_end: u64,
}

impl<'m, 'a> BlockSegments<'m, 'a> {
    #[inline(always)]
    pub(crate) fn new(map: &'m ScaleMap<'a>, flat0: u64, n: usize) -> Self {
        let block = match map.ndim {
            0 => u64::MAX,
            d => map.block[d - 1],
        };
        BlockSegments {
            map,
            block,
            n,
            i: 0,
            flat: flat0,
            cell: 0,
            until: flat0,
            row_end: flat0,
        }
    }
}

impl Iterator for BlockSegments<'_, '_> {
    type Item = (usize, usize, usize);

    #[inline(always)]
    fn next(&mut self) -> Option<(usize, usize, usize)> {
        if self.i == self.n {
            return None;
        }
        if self.flat >= self.row_end {
            (self.cell, self.until, self.row_end) = self.map.locate(self.flat);
        } else {
            self.cell += 1;
            self.until = self.until.saturating_add(self.block).min(self.row_end);
        }
        let left = self.n - self.i;
        let seg = usize::try_from(self.until - self.flat).map_or(left, |s| s.min(left));
        let a = self.i;
        self.i += seg;
        self.flat += seg as u64;
        Some((self.cell, a, self.i))
    }
}

/// The dense kernel: each block segment of `src` ([`BlockSegments`]) through [`scaled_segment`].
#[inline(always)]
fn dense_scaled<Q: Fp8Value, D: FloatCodec>(
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    for (cell, a, b) in BlockSegments::new(map, flat0, src.len()) {
        let out = &mut dst[a * D::SIZE..b * D::SIZE];
        scaled_segment::<Q, D>(map.values.get(cell), &src[a..b], out);
    }
}

/// The dense case of [`cast_scaled`] (adjacent source and destination elements, flat indices
/// `flat0..flat0 + src.len()`): one scale lookup per block segment, then a branch-free decode, multiply and
/// rounding per element (the same values as [`cast_scaled`], bit for bit). Inlined into its callers, so that
/// `dest` can also compile it for AVX2.
#[inline(always)]
pub(crate) fn cast_scaled_dense(
    (sd, dd): (Dtype, Dtype),
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    match sd {
        Dtype::F8_E4M3 => dense_with_dst_scaled::<QE4M3>(dd, src, dst, map, flat0),
        Dtype::F8_E5M2 => dense_with_dst_scaled::<QE5M2>(dd, src, dst, map, flat0),
        _ => unreachable!("dequantized items are validated before any copy"),
    }
}

#[inline(always)]
fn dense_with_dst_scaled<Q: Fp8Value>(
    dd: Dtype,
    src: &[u8],
    dst: &mut [u8],
    map: &ScaleMap<'_>,
    flat0: u64,
) {
    match dd {
        Dtype::BF16 => dense_scaled::<Q, CBF16>(src, dst, map, flat0),
        Dtype::F16 => dense_scaled::<Q, CF16>(src, dst, map, flat0),
        Dtype::F32 => dense_scaled::<Q, CF32>(src, dst, map, flat0),
        Dtype::F64 => dense_scaled::<Q, CF64>(src, dst, map, flat0),
        _ => unreachable!("dequantized items are validated before any copy"),
    }
}

/// Decodes scale elements stored as `dtype` (`U8` holds e8m0 exponents, as MXFP8 checkpoints ship them)
/// into `out` (one value per element of `bytes`); `false` for a dtype that is not a scale dtype. `mxfp4`:
/// the scales of MXFP4 nibbles, whose e8m0 byte 0xff is 2^128 ([`mxfp4_scale_to_f32`]), not NaN.
pub(crate) fn decode_scales_into(dtype: Dtype, bytes: &[u8], out: &mut [f32], mxfp4: bool) -> bool {
    fn fill(out: &mut [f32], values: impl Iterator<Item = f32>) {
        out.iter_mut().zip(values).for_each(|(o, v)| *o = v);
    }
    match dtype {
        Dtype::F32 => fill(out, bytes.chunks_exact(4).map(CF32::to_f32)),
        Dtype::BF16 => fill(out, bytes.chunks_exact(2).map(CBF16::to_f32)),
        Dtype::F16 => fill(out, bytes.chunks_exact(2).map(CF16::to_f32)),
        Dtype::F8_E8M0 | Dtype::U8 if mxfp4 => {
            fill(out, bytes.iter().map(|&b| mxfp4_scale_to_f32(b)))
        }
        Dtype::F8_E8M0 | Dtype::U8 => fill(out, bytes.iter().map(|&b| e8m0_to_f32(b))),
        _ => return false,
    }
    true
}

/// Whether `dtype` is a scale dtype [`decode_scales_into`] decodes.
pub(crate) fn is_scale_dtype(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::F32 | Dtype::BF16 | Dtype::F16 | Dtype::F8_E8M0 | Dtype::U8
    )
}

/// Converts `count` elements of `sd` read from `src` (element `i` at byte `i * src_stride`) into `dd`,
/// handing each converted element to `sink`. Same-dtype pairs are plain copies.
pub(crate) fn cast_strided<W: ElemSink>(
    sd: Dtype,
    dd: Dtype,
    src: &[u8],
    src_stride: usize,
    count: usize,
    sink: &mut W,
) {
    if sd == dd {
        let size = sd.byte_size().expect("sub-byte runs are contiguous copies");
        for i in 0..count {
            let at = i * src_stride;
            sink.put(i, &src[at..at + size]);
        }
        return;
    }
    match sd {
        Dtype::F16 => with_dst::<CF16, W>(dd, src, src_stride, count, sink),
        Dtype::BF16 => with_dst::<CBF16, W>(dd, src, src_stride, count, sink),
        Dtype::F32 => with_dst::<CF32, W>(dd, src, src_stride, count, sink),
        Dtype::F64 => with_dst::<CF64, W>(dd, src, src_stride, count, sink),
        Dtype::F8_E4M3 => with_dst::<CE4M3, W>(dd, src, src_stride, count, sink),
        Dtype::F8_E5M2 => with_dst::<CE5M2, W>(dd, src, src_stride, count, sink),
        Dtype::F8_E8M0 => with_dst::<CE8M0, W>(dd, src, src_stride, count, sink),
        _ => unreachable!("cast pairs are validated before any copy"),
    }
}

/// Converts the dense elements of `src` into the dense destination `dst` (same element count).
pub(crate) fn cast_dense(sd: Dtype, dd: Dtype, src: &[u8], dst: &mut [u8]) {
    if sd == dd {
        dst.copy_from_slice(src);
        return;
    }
    match sd {
        Dtype::F16 => dense_with_dst::<CF16>(dd, src, dst),
        Dtype::BF16 => dense_with_dst::<CBF16>(dd, src, dst),
        Dtype::F32 => dense_with_dst::<CF32>(dd, src, dst),
        Dtype::F64 => dense_with_dst::<CF64>(dd, src, dst),
        Dtype::F8_E4M3 => dense_with_dst::<CE4M3>(dd, src, dst),
        Dtype::F8_E5M2 => dense_with_dst::<CE5M2>(dd, src, dst),
        Dtype::F8_E8M0 => dense_with_dst::<CE8M0>(dd, src, dst),
        _ => unreachable!("cast pairs are validated before any copy"),
    }
}
