//! The vector pieces of the MXFP4 tile kernel (x86-64; `tiles.rs` runs them): a run's scales as exponent
//! steps by tile ([`RunSteps`]), the e2m1 code lookup, the wide decode for the extreme scales, and the 16 x 16
//! byte transposes.

#![allow(unsafe_code)]

use super::*;

/// Byte columns (repetitions) and source rows (elements) of one tile of [`nibble_tiles_avx2`].
pub(super) const NIBBLE_SIMD_TILE: usize = 16;

/// Tiles side by side in one band of [`nibble_tiles_avx2`] (64 byte columns: a whole cache line of each
/// source row).
pub(super) const NIBBLE_BAND: usize = 4;

/// How [`nibble_tiles_avx2`] decodes a tile (16 elements of a scale column): every scale a narrow step
/// ([`super::NARROW_STEPS`]: the step added to the value's bits), some other e8m0 step (the wide decode,
/// `kernels::mxfp4_wide_bits`), or some scale with no step (an arbitrary `f32`: the scalar kernel).
/// The classes are bits, so that a tile's is its rows' or'ed ([`SCALAR`] wins over [`WIDE`]).
pub(super) const NARROW: u8 = 0;
pub(super) const WIDE: u8 = 1;
pub(super) const SCALAR: u8 = 2;

/// The scales of a run of [`nibble_tiles_avx2`] as exponent steps ([`mxfp4_exponent_step`]), transposed so
/// that a tile reads its 16 steps as two vectors: the run's byte columns share a few scale columns
/// (`slot[r]` for column `r`: the 32 elements of a block are 16 byte columns), and `steps[slot * pitch +
/// i]` is element `i`'s step in that scale column; `class[slot * blocks + i / 16]` is how that tile height
/// decodes ([`NARROW`], [`WIDE`] or [`SCALAR`]). The pitch is the count padded to a multiple of 16 plus
/// 16, so that slots are never a multiple of 4 KiB apart (a count of 2048 made every slot's steps of one
/// element fall into the same L1 set, and their writes cost a third of the kernel).
pub(super) struct RunSteps {
    pub(super) pitch: usize,
    pub(super) blocks: usize,
    pub(super) slot: Vec<usize>,
    pub(super) steps: Vec<i16>,
    pub(super) class: Vec<u8>,
}

impl RunSteps {
    /// The steps of `count` elements of byte columns whose first scale cells are `cells`, the cells of
    /// consecutive elements `step` apart. Consecutive columns with the same first cell share a slot; the
    /// scales are read row by row (element `i`'s cells of every slot, adjacent in the grid when the slots
    /// are consecutive blocks), each once.
    pub(super) fn new(cells: &[usize], step: usize, count: usize, values: ScaleValues<'_>) -> Self {
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
    pub(super) fn with(
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
    pub(super) fn e8m0_groups_avx2(
        &mut self,
        bases: &[usize],
        b: &[u8],
        step: usize,
        count: usize,
    ) -> usize {
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
    pub(super) fn band(&self, r0: usize, y: usize) -> Option<u8> {
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
    pub(super) fn class(&self, slot: usize, y: usize) -> u8 {
        match self.class[slot * self.blocks + y / NIBBLE_SIMD_TILE] {
            c if c & SCALAR != 0 => SCALAR,
            c => c,
        }
    }
}

/// [`step_class`] of each e8m0 scale byte's value ([`crate::kernels::mxfp4_scale_to_f32`]), looked up: the
/// steps of a run's scale bytes were computed through their `f32` values, a tenth of the tile kernel's time
/// on whole gpt-oss experts (docs/perf-notes.md, "Session 16").
pub(super) static E8M0_STEPS: [(i16, u8); 256] = e8m0_steps();

pub(super) const fn e8m0_steps() -> [(i16, u8); 256] {
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
#[inline(always)]
pub(super) fn step_class(scale: f32) -> (i16, u8) {
    let bits = scale.to_bits();
    let e = bits >> 23; // a negative scale's sign bit lands at bit 8: not narrow
    if bits & 0x007f_ffff == 0 && e.wrapping_sub(2) <= 250 {
        let step = (e as i16 - 127) << 7;
        debug_assert!(super::NARROW_STEPS.contains(&step));
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
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn wide_lanes_512(
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

/// The low (`E2M1_BF16_BYTES[0]`) and high bytes of [`E2M1_BF16_BITS`], built at compile time (built per
/// call, with `array::map`, they were 7% of the tile kernel's time in criterion's `mxfp4/whole`).
pub(super) static E2M1_BF16_BYTES: [[u8; 16]; 2] = {
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
#[target_feature(enable = "avx2")]
pub(super) fn e2m1_tables() -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
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
#[target_feature(enable = "avx2")]
#[inline(never)]
pub(super) fn wide_pair_columns(
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
#[target_feature(enable = "avx2")]
#[inline(never)]
pub(super) fn wide_column(
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

/// One round of a byte transpose: the low and high unpacks of each listed pair of vectors.
macro_rules! unpack_round {
    ($v:ident, $lo:path, $hi:path, [$(($x:literal, $y:literal)),*]) => {
        [$($lo($v[$x], $v[$y]), $hi($v[$x], $v[$y])),*]
    };
}

/// Defines a 16 x 16 byte transpose of 16 row vectors from the unpack intrinsics of one vector width: byte `c`
/// of row `r` (in each 128-bit lane: the unpacks work lane by lane) becomes byte `r` of column `c`, in four
/// rounds that interleave 8-, 16-, 32- and 64-bit units of vector pairs (written out so that the vectors stay in
/// registers).
macro_rules! byte_transpose {
    ($(#[$doc:meta])* $name:ident, $feat:literal, $vec:ty, $lo8:path, $hi8:path, $lo16:path, $hi16:path,
     $lo32:path, $hi32:path, $lo64:path, $hi64:path) => {
        $(#[$doc])*
        #[target_feature(enable = $feat)]
        #[inline]
        pub(super) fn $name(r: [$vec; 16]) -> [$vec; 16] {
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
