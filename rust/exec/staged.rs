//! Staged sources: the hook through which another byte source (object storage, `crate::objstore`) feeds the
//! read direction. Once a batch is validated, [`needed_ranges`] lists per file the byte ranges its runs and
//! scale rows read; a [`Stage`] callback brings those bytes into memory at their file offsets, and the read
//! direction copies from that memory through its mapped path, exactly as from a mapped file.

use std::sync::Arc;

use super::scales::{scale_byte_range, LoadedScale};
use crate::error::LoadError;
use crate::header::Header;
use crate::mmap::Mapping;
use crate::types::Run;

/// Brings the bytes a call needs into memory: given, per file, the sorted absolute byte ranges the validated
/// items (and their scales) read (empty for a file the call does not read), returns per file a map holding
/// those bytes at their file offsets, or `None` to read that file from the file system as usual. Called once,
/// after validation and before any destination byte is written.
pub(crate) type Stage<'a> =
    &'a dyn Fn(&[Vec<(u64, u64)>]) -> Result<Vec<Option<Arc<Mapping>>>, LoadError>;

/// Per file, the absolute byte ranges that `runs` and the scale `cells` read, sorted (repetitions one range
/// each; a repeated run whose repetitions touch is one range).
pub(super) fn needed_ranges(
    runs: &[Run],
    scales: &[LoadedScale],
    cells: &[Option<(u64, u64)>],
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
            let (file, range) = scale_byte_range(sc, *c, files);
            out[file].push(range);
        }
    }
    for ranges in &mut out {
        ranges.sort_unstable();
    }
    out
}
