//! Scalar conversions between bit patterns (bf16, f16, the float8 formats, e8m0 and MXFP4's scale bytes to and
//! from `f32`), torch's rounding bit for bit: the element codecs of every kernel, re-exported by
//! [`crate::kernels`].

/// bfloat16 bits to `f32` (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// `f32` to bfloat16 bits, round to nearest-even; NaN becomes a quiet NaN of the same sign.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let bias = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(bias) >> 16) as u16
}

/// IEEE half bits to `f32` (exact); NaN payloads are kept and quietened.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    match exp {
        0 => {
            let v = man as f32 * f32::from_bits(0x3380_0000); // 2^-24
            f32::from_bits(v.to_bits() | sign)
        }
        0x1f if man == 0 => f32::from_bits(sign | 0x7f80_0000),
        0x1f => f32::from_bits(sign | 0x7fc0_0000 | (man << 13)),
        _ => f32::from_bits(sign | ((exp + 112) << 23) | (man << 13)),
    }
}

/// `f32` to IEEE half bits, round to nearest-even, overflow to infinity; NaN stays NaN.
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let abs = b & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return sign | 0x7e00 | ((abs >> 13) & 0x3ff) as u16;
    }
    if abs == 0x7f80_0000 {
        return sign | 0x7c00;
    }
    let half_exp = (abs >> 23) as i32 - 127 + 15;
    if half_exp >= 31 {
        return sign | 0x7c00;
    }
    if half_exp <= 0 {
        if half_exp < -10 {
            return sign;
        }
        let m = (abs & 0x7f_ffff) | 0x80_0000;
        let shift = (14 - half_exp) as u32;
        let q = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let halfway = 1 << (shift - 1);
        let up = rem > halfway || (rem == halfway && q & 1 == 1);
        return sign | (q + u32::from(up)) as u16;
    }
    let m = abs & 0x7f_ffff;
    let mut h = ((half_exp as u32) << 10) | (m >> 13);
    let rem = m & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && h & 1 == 1) {
        h += 1;
    }
    sign | h as u16
}

/// float8 e4m3fn bits to `f32` (exact).
pub fn e4m3fn_to_f32(v: u8) -> f32 {
    let sign = u32::from(v & 0x80) << 24;
    let exp = u32::from((v >> 3) & 0xf);
    let man = u32::from(v & 0x7);
    let magnitude = if exp == 0xf && man == 0x7 {
        return f32::from_bits(sign | 0x7fc0_0000);
    } else if exp == 0 {
        man as f32 * f32::from_bits(0x3b00_0000) // 2^-9
    } else {
        f32::from_bits(((exp + 120) << 23) | (man << 20))
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

/// `f32` to float8 e4m3fn bits as c10 does it (torch >= 2.10 headers): round to nearest-even; finite
/// overflow and infinities saturate to ±448, NaN stays NaN.
pub fn f32_to_e4m3fn(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7fff_ffff;
    let out = if abs >= 1087 << 20 {
        if abs > 0x7f80_0000 {
            0x7f
        } else {
            0x7e
        }
    } else if abs < 121 << 23 {
        // Below the smallest normal (2^-6): let the FPU round by adding a denormalizing constant.
        let denorm = f32::from_bits(141 << 23);
        let sum = (f32::from_bits(abs) + denorm).to_bits();
        sum.wrapping_sub(141 << 23) as u8
    } else {
        let odd = (abs >> 20) & 1;
        let r = abs
            .wrapping_add(((7u32).wrapping_sub(127) << 23).wrapping_add(0x7_ffff))
            .wrapping_add(odd);
        // Rounding up into the NaN pattern saturates to the largest finite value.
        match (r >> 20) as u8 {
            0x7f => 0x7e,
            v => v,
        }
    };
    out | sign
}

/// float8 e5m2 bits to `f32` (exact; through half precision, as c10 does).
pub fn e5m2_to_f32(v: u8) -> f32 {
    f16_to_f32(u16::from(v) << 8)
}

/// `f32` to float8 e5m2 bits as c10 does it: round to nearest-even, overflow to inf, NaN to NaN.
pub fn f32_to_e5m2(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7fff_ffff;
    let out = if abs >= 143 << 23 {
        if abs > 0x7f80_0000 {
            0x7f
        } else {
            0x7c
        }
    } else if abs < 113 << 23 {
        let denorm = f32::from_bits(134 << 23);
        let sum = (f32::from_bits(abs) + denorm).to_bits();
        sum.wrapping_sub(134 << 23) as u8
    } else {
        let odd = (abs >> 21) & 1;
        let r = abs
            .wrapping_add(((15u32).wrapping_sub(127) << 23).wrapping_add(0xf_ffff))
            .wrapping_add(odd);
        (r >> 21) as u8
    };
    out | sign
}

/// float8 e8m0 bits to `f32` (exact): 2^(v-127), 0xff is NaN.
pub fn e8m0_to_f32(v: u8) -> f32 {
    match v {
        0xff => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits(u32::from(v) << 23),
    }
}

/// An MXFP4 scale byte to `f32` as the exponent transformers' `convert_moe_packed_tensors` applies
/// (`ldexp(value, v - 127)`): 2^(v-127), and 0xff, whose 2^128 no `f32` holds, as infinity, which
/// `mxfp4_scaled` reads as 2^128 (not the NaN of the e8m0 dtype, [`e8m0_to_f32`]).
pub fn mxfp4_scale_to_f32(v: u8) -> f32 {
    match v {
        0xff => f32::INFINITY,
        _ => e8m0_to_f32(v),
    }
}

/// An e2m1 value times its MXFP4 scale, exactly as `ldexp` gives it before the one rounding into the
/// destination: an infinite scale is 2^128 ([`mxfp4_scale_to_f32`]), so ±0 stays ±0, ±0.5 becomes
/// ±2^127 and larger values overflow to infinity (`v * 2 * 2^127`: exact, as the doubled value is).
#[inline(always)]
pub(crate) fn mxfp4_scaled(v: f32, scale: f32) -> f32 {
    match scale == f32::INFINITY {
        true => v * 2.0 * f32::from_bits(254 << 23),
        false => v * scale,
    }
}

/// `f32` to float8 e8m0 bits as c10 does it: the sign is dropped, the exponent rounded to nearest-even on
/// the significand, inf and NaN become NaN.
pub fn f32_to_e8m0(x: f32) -> u8 {
    let bits = x.to_bits();
    let exp = (bits >> 23) & 0xff;
    if exp == 0xff {
        return 0xff;
    }
    let guard = bits & 0x40_0000 != 0;
    let round = bits & 0x20_0000 != 0;
    let sticky = bits & 0x1f_ffff != 0;
    let lsb = exp > 0;
    let up = guard && (round || sticky || lsb);
    (exp + u32::from(up)) as u8
}
