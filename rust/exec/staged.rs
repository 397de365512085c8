//! Staged sources: the hook through which another byte source (object storage, `crate::objstore`) feeds the
//! read direction. Once a batch is validated, the plain byte-copy runs may go to the source to be written
//! straight into their destinations ([`Stage::direct`]); for the others [`needed_ranges`] lists per file the
//! byte ranges they and the scale rows read; a [`Stage`] callback brings those bytes into memory at their
//! file offsets, and the read direction copies from that memory through its mapped path, exactly as from a
//! mapped file.

use std::sync::Arc;

use super::scales::{scale_byte_range, LoadedScale, ScaleCells};
use crate::error::LoadError;
use crate::header::Header;
use crate::mmap::Mapping;
use crate::types::Run;

/// Brings the bytes a call needs into memory: given, per file, the sorted absolute byte ranges the validated
/// items (and their scales) read through the copy path (empty for a file the call does not read that way),
/// and the `direct` runs (plain byte copies: same dtype, adjacent elements, no scale; empty unless
/// [`Stage::direct`]), writes the direct runs' bytes straight into their destinations
/// ([`crate::dest::write_direct`]) and returns per file a map holding the other bytes at their file
/// offsets, or `None` to read that file from the file system as usual. Called once, after validation and
/// before the executor writes any destination byte.
pub(crate) type Fetch<'a> =
    &'a dyn Fn(&[Vec<(u64, u64)>], &[Run]) -> Result<Vec<Option<Arc<Mapping>>>, LoadError>;

/// Another byte source for the read direction: its [`Fetch`], and whether plain byte copies go straight
/// into the destinations (`direct`: a failed fetch may then leave some destinations written) or through
/// the staged bytes (nothing written before every byte is fetched).
#[derive(Clone, Copy)]
pub(crate) struct Stage<'a> {
    pub(crate) fetch: Fetch<'a>,
    pub(crate) direct: bool,
}

/// Per file, the absolute byte ranges that `runs` and the scale `cells` read, sorted (repetitions one range
/// each; a repeated run whose repetitions touch is one range).
pub(super) fn needed_ranges(
    runs: &[Run],
    scales: &[LoadedScale],
    cells: &[Option<ScaleCells>],
    files: &[Arc<Header>],
) -> Vec<Vec<(u64, u64)>> {
    let mut out: Vec<Vec<(u64, u64)>> = vec![Vec::new(); files.len()];
    for r in runs {
        let extent = r.run_extent();
        if r.reps == 1 || r.rep_src_stride <= extent {
            out[r.file].push((r.src_off, r.src_end()));
        } else {
            let ranges = &mut out[r.file];
            for k in 0..r.reps {
                let at = r.src_off + k * r.rep_src_stride;
                ranges.push((at, at + extent));
            }
        }
    }
    for (sc, c) in scales.iter().zip(cells) {
        if let Some(c) = c {
            let (file, range) = scale_byte_range(sc, c.span, files);
            out[file].push(range);
        }
    }
    for ranges in &mut out {
        ranges.sort_unstable();
    }
    out
}
