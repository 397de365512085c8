//! Safetensors element types: the [`Dtype`] enum, its stable integer codes, header names and sizes, and
//! which pairs of types the engine can cast ([`Dtype::can_cast_to`]). The conversions themselves (scalar and
//! fused kernels) are in `crate::kernels`. This module owns no I/O and no raw pointers.
//!
//! ```
//! use hp_fastload::Dtype;
//! assert_eq!(Dtype::from_name("BF16"), Some(Dtype::BF16));
//! assert_eq!(Dtype::from_code(Dtype::BF16.code()), Some(Dtype::BF16));
//! assert!(Dtype::BF16.can_cast_to(Dtype::F32));
//! assert!(!Dtype::I32.can_cast_to(Dtype::F32));
//! ```

/// A safetensors element type (variants spelled as in safetensors headers).
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// Boolean, one byte.
    BOOL,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// Complex of two `f32`.
    C64,
    /// float8 e4m3 with finite values and one NaN per sign (torch `float8_e4m3fn`).
    F8_E4M3,
    /// float8 e5m2 (torch `float8_e5m2`).
    F8_E5M2,
    /// float8 e4m3, finite, unsigned zero (torch `float8_e4m3fnuz`).
    F8_E4M3FNUZ,
    /// float8 e5m2, finite, unsigned zero (torch `float8_e5m2fnuz`).
    F8_E5M2FNUZ,
    /// float8 e8m0 scale (torch `float8_e8m0fnu`).
    F8_E8M0,
    /// 4-bit float e2m1, two per byte.
    F4,
    /// 6-bit float e2m3.
    F6_E2M3,
    /// 6-bit float e3m2.
    F6_E3M2,
}

/// Every dtype, in code order.
pub const ALL_DTYPES: [Dtype; 22] = [
    Dtype::BOOL,
    Dtype::U8,
    Dtype::I8,
    Dtype::I16,
    Dtype::U16,
    Dtype::I32,
    Dtype::U32,
    Dtype::I64,
    Dtype::U64,
    Dtype::F16,
    Dtype::BF16,
    Dtype::F32,
    Dtype::F64,
    Dtype::C64,
    Dtype::F8_E4M3,
    Dtype::F8_E5M2,
    Dtype::F8_E4M3FNUZ,
    Dtype::F8_E5M2FNUZ,
    Dtype::F8_E8M0,
    Dtype::F4,
    Dtype::F6_E2M3,
    Dtype::F6_E3M2,
];

impl Dtype {
    /// The stable integer code used by the Python binding (the index in [`ALL_DTYPES`]).
    pub fn code(self) -> i64 {
        ALL_DTYPES
            .iter()
            .position(|&d| d == self)
            .expect("every dtype is listed") as i64
    }

    /// The dtype with integer code `code`.
    pub fn from_code(code: i64) -> Option<Dtype> {
        usize::try_from(code)
            .ok()
            .and_then(|c| ALL_DTYPES.get(c).copied())
    }

    /// The name used in safetensors headers (`"BF16"`, `"F8_E4M3"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::C64 => "C64",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
        }
    }

    /// The dtype with safetensors name `name`.
    pub fn from_name(name: &str) -> Option<Dtype> {
        ALL_DTYPES.iter().copied().find(|d| d.name() == name)
    }

    /// Size of one element in bits (4 and 6 for the sub-byte floats).
    pub fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E4M3
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ
            | Dtype::F8_E8M0 => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::I64 | Dtype::U64 | Dtype::F64 | Dtype::C64 => 64,
        }
    }

    /// Whether elements are smaller than a byte (and so packed several to a byte).
    pub fn is_sub_byte(self) -> bool {
        !self.bits().is_multiple_of(8)
    }

    /// Size of one element in bytes; `None` for sub-byte types.
    pub fn byte_size(self) -> Option<usize> {
        (!self.is_sub_byte()).then(|| (self.bits() / 8) as usize)
    }

    /// The names of the castable floats ([`Dtype::is_castable_float`]), in code order.
    pub fn castable_float_names() -> Vec<&'static str> {
        let floats = ALL_DTYPES.into_iter().filter(|d| d.is_castable_float());
        floats.map(Dtype::name).collect()
    }

    /// Whether the engine casts this dtype to and from the other castable floats.
    pub fn is_castable_float(self) -> bool {
        matches!(
            self,
            Dtype::F16
                | Dtype::BF16
                | Dtype::F32
                | Dtype::F64
                | Dtype::F8_E4M3
                | Dtype::F8_E5M2
                | Dtype::F8_E8M0
        )
    }

    /// Whether the engine can convert elements of `self` into `dst` while copying.
    pub fn can_cast_to(self, dst: Dtype) -> bool {
        self == dst || (self.is_castable_float() && dst.is_castable_float())
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for (i, d) in ALL_DTYPES.iter().enumerate() {
            assert_eq!(d.code() as usize, i);
            assert_eq!(Dtype::from_code(i as i64), Some(*d));
            assert_eq!(Dtype::from_name(d.name()), Some(*d));
        }
        assert_eq!(Dtype::from_code(-1), None);
        assert_eq!(Dtype::from_code(22), None);
        assert_eq!(Dtype::from_name("F8_E4M3FN"), None);
    }

    #[test]
    fn cast_table() {
        assert!(Dtype::F8_E4M3.can_cast_to(Dtype::F64));
        assert!(Dtype::F4.can_cast_to(Dtype::F4));
        assert!(!Dtype::F4.can_cast_to(Dtype::U8));
        assert!(!Dtype::F8_E4M3FNUZ.can_cast_to(Dtype::F32));
        assert!(!Dtype::C64.can_cast_to(Dtype::F32));
        assert!(!Dtype::BOOL.can_cast_to(Dtype::U8));
    }
}
