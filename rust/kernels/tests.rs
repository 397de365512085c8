//! The tests of `kernels`.

use super::*;

#[test]
fn half_round_trips_every_pattern() {
    for h in 0..=u16::MAX {
        let x = f16_to_f32(h);
        if x.is_nan() {
            assert!(f16_to_f32(f32_to_f16(x)).is_nan());
        } else {
            assert_eq!(f32_to_f16(x), h, "{h:#x}");
        }
        let y = bf16_to_f32(h);
        if !y.is_nan() {
            assert_eq!(f32_to_bf16(y), h);
        }
    }
}

#[test]
fn f16_rounding_matches_f64_reference() {
    // The reference: round the exact value to the nearest representable half (ties to even) by search.
    let halves: Vec<f64> = (0..0x7c00u16).map(|h| f64::from(f16_to_f32(h))).collect();
    let mut state = 0x1234_5678_u64;
    for _ in 0..200_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let bits = (state as u32) & 0x7fff_ffff;
        let x = f32::from_bits(bits);
        if !x.is_finite() {
            continue;
        }
        let got = f32_to_f16(x);
        let v = f64::from(x);
        let want = match halves.binary_search_by(|h| h.partial_cmp(&v).unwrap()) {
            Ok(i) => i as u16,
            Err(i) if i == halves.len() => {
                let max = halves[i - 1];
                let next = 65536.0;
                if v - max < next - v || (v - max == next - v && (i - 1) % 2 == 0) {
                    (i - 1) as u16
                } else {
                    0x7c00
                }
            }
            Err(i) => {
                let (lo, hi) = (halves[i - 1], halves[i]);
                if v - lo < hi - v || (v - lo == hi - v && (i - 1) % 2 == 0) {
                    (i - 1) as u16
                } else {
                    i as u16
                }
            }
        };
        assert_eq!(got, want, "{x:e} ({bits:#x})");
    }
}

#[test]
fn fp8_known_values() {
    assert_eq!(f32_to_e4m3fn(448.0), 0x7e);
    assert_eq!(f32_to_e4m3fn(464.0), 0x7e);
    assert_eq!(f32_to_e4m3fn(470.0), 0x7e);
    assert_eq!(f32_to_e4m3fn(480.0), 0x7e);
    assert_eq!(f32_to_e4m3fn(-1e9), 0xfe);
    assert_eq!(f32_to_e4m3fn(-1.0), 0xb8);
    assert_eq!(f32_to_e4m3fn(f32::INFINITY), 0x7e);
    assert_eq!(f32_to_e4m3fn(f32::NAN), 0x7f);
    assert_eq!(f32_to_e4m3fn(2f32.powi(-9)), 0x01);
    assert_eq!(e4m3fn_to_f32(0x7e), 448.0);
    assert!(e4m3fn_to_f32(0xff).is_nan());
    assert_eq!(e4m3fn_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(f32_to_e5m2(57344.0), 0x7b);
    assert_eq!(f32_to_e5m2(f32::INFINITY), 0x7c);
    assert_eq!(f32_to_e5m2(f32::NEG_INFINITY), 0xfc);
    assert_eq!(f32_to_e5m2(f32::NAN), 0x7f);
    assert_eq!(f32_to_e5m2(1e6), 0x7c);
    assert_eq!(e5m2_to_f32(0x7b), 57344.0);
    for v in 0..=255u8 {
        let x = e4m3fn_to_f32(v);
        if !x.is_nan() {
            assert_eq!(f32_to_e4m3fn(x), v, "{v:#x}");
        }
        let y = e5m2_to_f32(v);
        if !y.is_nan() {
            assert_eq!(f32_to_e5m2(y), v, "{v:#x}");
        }
        let z = e8m0_to_f32(v);
        if !z.is_nan() {
            assert_eq!(f32_to_e8m0(z), v, "{v:#x}");
        }
    }
    assert_eq!(f32_to_e8m0(1.5), 128);
    assert_eq!(f32_to_e8m0(2.5), 128);
    assert_eq!(f32_to_e8m0(0.75), 127);
    assert_eq!(f32_to_e8m0(-2.0), 128);
    assert_eq!(f32_to_e8m0(f32::NAN), 255);
}

#[test]
fn branch_free_fp8_decoders_equal_the_reference_on_every_code() {
    for v in 0..=255u8 {
        assert_eq!(
            e4m3_value(v).to_bits(),
            e4m3fn_to_f32(v).to_bits(),
            "e4m3 {v:#x}"
        );
        assert_eq!(
            e5m2_value(v).to_bits(),
            e5m2_to_f32(v).to_bits(),
            "e5m2 {v:#x}"
        );
    }
}

#[test]
fn f64_goes_through_f32_like_torch() {
    // 1 + 2^-11 + 2^-40 rounds to 1 + 2^-11 in f32, which then ties to 1.0 in f16.
    let x = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
    let mut out = [0u8; 2];
    cast_dense(Dtype::F64, Dtype::F16, &x.to_le_bytes(), &mut out);
    assert_eq!(u16::from_le_bytes(out), 0x3c00);
}
