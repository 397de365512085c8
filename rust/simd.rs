//! The SIMD level the kernels run at: the widest this CPU supports, capped by `HP_FASTLOAD_SIMD`.
//!
//! The dequantizing kernels (`crate::dest` and its `mxfp4`, `crate::lookup`) come in builds for several
//! instruction sets.
//! Every dispatch asks [`level`] (never the CPU directly), so that one switch forces a lower level on any host
//! and every fallback can be checked bit for bit against the top level on the same machine:
//!
//! | level        | what it needs                 | what it enables                                         |
//! |--------------|-------------------------------|---------------------------------------------------------|
//! | `scalar`     | any CPU (any architecture)    | the portable kernels                                    |
//! | `avx2`       | x86-64 AVX2                   | 256-bit FP8 dequantization, MXFP4 tiles                  |
//! | `avx512`     | AVX-512 F and BW              | 512-bit FP8 dequantization, MXFP4 quad bands and lines  |
//! | `avx512vbmi` | AVX-512 F, BW and VBMI        | the FP8 per-block lookup tables (`vpermi2b`)            |
//!
//! `HP_FASTLOAD_SIMD=scalar|avx2|avx512|avx512vbmi` caps the level (a cap above what the CPU has is the CPU's
//! level: the switch only ever lowers it); unset, empty or `auto` is the CPU's level. The value is read once per
//! process. A value that names no level is reported by [`configured`] (the Python package raises `ValueError`
//! on import) and otherwise ignored. Plain data copies (SSE2 streaming stores, prefetches) are x86-64 baseline
//! and do not depend on the level.
//!
//! ```
//! use hp_fastload::simd::{self, Level};
//! assert!(simd::level() <= simd::detected());
//! assert_eq!(Level::parse("avx2"), Some(Level::Avx2));
//! assert!(Level::Scalar < Level::Avx512Vbmi);
//! ```

use std::sync::OnceLock;

/// The name of the environment variable that caps the level.
pub const ENV: &str = "HP_FASTLOAD_SIMD";

/// A SIMD level, ordered from the narrowest to the widest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// The portable kernels.
    Scalar,
    /// AVX2 (256-bit vectors).
    Avx2,
    /// AVX-512 F and BW (512-bit vectors, mask registers).
    Avx512,
    /// AVX-512 F, BW and VBMI (byte permutes across a whole register).
    Avx512Vbmi,
}

impl Level {
    /// Every level, narrowest first.
    pub const ALL: [Level; 4] = [Level::Scalar, Level::Avx2, Level::Avx512, Level::Avx512Vbmi];

    /// The level's name, as `HP_FASTLOAD_SIMD` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Vbmi => "avx512vbmi",
        }
    }

    /// The level a name spells (ASCII case ignored), or `None`.
    pub fn parse(name: &str) -> Option<Level> {
        Level::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(name.trim()))
    }
}

/// The widest level this CPU supports (detected once; `Scalar` on every architecture but x86-64).
pub fn detected() -> Level {
    static DETECTED: OnceLock<Level> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") {
                if has!("avx512vbmi") {
                    return Level::Avx512Vbmi;
                }
                return Level::Avx512;
            }
            if has!("avx2") {
                return Level::Avx2;
            }
        }
        Level::Scalar
    })
}

/// The cap `HP_FASTLOAD_SIMD` asks for: `Ok(None)` when unset, empty or `auto`, `Err(value)` when it names
/// no level.
pub fn configured() -> Result<Option<Level>, String> {
    static CONFIGURED: OnceLock<Result<Option<Level>, String>> = OnceLock::new();
    CONFIGURED
        .get_or_init(|| match std::env::var(ENV) {
            Err(_) => Ok(None),
            Ok(v) if v.trim().is_empty() || v.trim().eq_ignore_ascii_case("auto") => Ok(None),
            Ok(v) => Level::parse(&v).map(Some).ok_or(v),
        })
        .clone()
}

/// `(level in use, level this CPU supports, level `HP_FASTLOAD_SIMD` asks for or None)` by name; `Err` with
/// the message saying which values it takes when `HP_FASTLOAD_SIMD` names no level.
pub fn levels() -> Result<(&'static str, &'static str, Option<&'static str>), String> {
    match configured() {
        Ok(cap) => Ok((level().name(), detected().name(), cap.map(Level::name))),
        Err(value) => {
            let names: Vec<&str> = Level::ALL.iter().map(|l| l.name()).collect();
            Err(unknown_level(&value, &names))
        }
    }
}

fn unknown_level(value: &str, names: &[&str]) -> String {
    format!(
        "{ENV}={value:?} names no SIMD level: use one of {} (or unset it, or 'auto', for the CPU's own)",
        names.join(", ")
    )
}

/// The level the kernels run at: [`detected`], capped by `HP_FASTLOAD_SIMD` (never above [`detected`], so a
/// dispatch that checks `level() >= L` may run code built for `L`).
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    let process = *LEVEL.get_or_init(|| match configured() {
        Ok(Some(cap)) => cap.min(detected()),
        _ => detected(),
    });
    #[cfg(test)]
    let process = process.min(TEST_CAP.with(|c| c.get()));
    process
}

#[cfg(test)]
thread_local! {
    static TEST_CAP: std::cell::Cell<Level> = const { std::cell::Cell::new(Level::Avx512Vbmi) };
}

/// Runs `f` on this thread with the level capped at `cap` (tests: every level on one host, in one process).
#[cfg(test)]
pub(crate) fn with_cap<R>(cap: Level, f: impl FnOnce() -> R) -> R {
    let before = TEST_CAP.with(|c| c.replace(cap));
    let out = f();
    TEST_CAP.with(|c| c.set(before));
    out
}

/// Every level up to [`level`]: the ones a test on this host can run and compare.
#[cfg(test)]
pub(crate) fn levels_here() -> impl Iterator<Item = Level> {
    let top = level();
    Level::ALL.into_iter().filter(move |l| *l <= top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order() {
        for l in Level::ALL {
            assert_eq!(Level::parse(l.name()), Some(l));
            assert_eq!(Level::parse(&l.name().to_uppercase()), Some(l));
        }
        assert_eq!(Level::parse("avx3"), None);
        assert!(Level::ALL.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn an_unknown_level_names_the_variable_and_the_levels() {
        let m = unknown_level("avx3", &["scalar", "avx2"]);
        assert_eq!(
            m,
            "HP_FASTLOAD_SIMD=\"avx3\" names no SIMD level: use one of scalar, avx2 (or unset it, or 'auto', \
             for the CPU's own)"
        );
        // in this process the variable is unset or valid (the SIMD lanes set a valid one)
        let (now, cpu, _) = levels().unwrap();
        assert!(Level::parse(now) <= Level::parse(cpu));
    }

    /// The detection agrees with what the kernel says of this CPU (`/proc/cpuinfo`'s flags), so that a
    /// broken detection cannot make the SIMD tests run the scalar code only and pass.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn detection_agrees_with_proc_cpuinfo() {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let flags: std::collections::HashSet<&str> = info
            .lines()
            .find(|l| l.starts_with("flags"))
            .expect("a flags line")
            .split_whitespace()
            .collect();
        let want = match (
            flags.contains("avx512f") && flags.contains("avx512bw"),
            flags.contains("avx2"),
        ) {
            (true, _) if flags.contains("avx512vbmi") => Level::Avx512Vbmi,
            (true, _) => Level::Avx512,
            (false, true) => Level::Avx2,
            _ => Level::Scalar,
        };
        assert_eq!(detected(), want);
    }

    /// `HP_FASTLOAD_SIMD`, where a lane sets it, names a level and caps [`level`] (a typo in a lane fails here,
    /// instead of running the top level under the lane's name).
    #[test]
    fn the_configured_cap_is_in_effect() {
        match configured() {
            Ok(Some(cap)) => assert_eq!(level(), cap.min(detected())),
            Ok(None) => assert_eq!(level(), detected()),
            Err(v) => panic!("{ENV}={v:?} names no level (scalar, avx2, avx512, avx512vbmi)"),
        }
    }

    #[test]
    fn a_test_cap_lowers_the_level_on_this_thread_only() {
        let top = level();
        with_cap(Level::Scalar, || {
            assert_eq!(level(), Level::Scalar);
            std::thread::scope(|s| assert_eq!(s.spawn(level).join().unwrap(), top));
        });
        assert_eq!(level(), top);
    }
}
