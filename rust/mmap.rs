//! File access: read-only memory maps, page residency, and positioned reads.
//!
//! This is the only module that maps files (and so the only one with `unsafe` besides `dest`). The memory
//! map contract: the file must not be truncated or rewritten while it is mapped. [`crate::execute`] checks
//! the file size with `fstat` right before mapping (a shorter file is reported as truncated instead of
//! faulting with SIGBUS later) and drops every map before it returns; a file that shrinks *during* a call
//! is outside the contract (use the `pread` backend for files that may change).

#![allow(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use memmap2::{Advice, Mmap, MmapOptions};

use crate::error::LoadError;

/// A read-only map of the first `len` bytes of a file.
pub(crate) struct Mapping {
    map: Mmap,
}

impl Mapping {
    /// Maps `len` bytes of `file`; the caller has checked that the file has at least `len` bytes.
    pub(crate) fn new(file: &File, len: u64, path: &Path) -> Result<Mapping, LoadError> {
        let len = usize::try_from(len).map_err(|_| LoadError::request("file too large to map"))?;
        // SAFETY: execute() checked with fstat that the file holds at least `len` bytes just before this
        // call; the module contract (no truncation while mapped) covers the rest, and the map is read-only.
        let map = unsafe { MmapOptions::new().len(len).map(file) }
            .map_err(|e| LoadError::io(path, &e))?;
        Ok(Mapping { map })
    }

    /// The mapped bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Hints that `start..end` will be read soon (best effort; errors are ignored).
    pub(crate) fn will_need(&self, start: u64, end: u64) {
        let _ = self
            .map
            .advise_range(Advice::WillNeed, start as usize, (end - start) as usize);
    }

    /// Fraction (0..=1) of the pages touched by `ranges` (byte ranges inside `start..end`) that are in the
    /// page cache; 0 when unknown. One `mincore` call covers `start..end`.
    pub(crate) fn resident_fraction(&self, start: u64, end: u64, ranges: &[(u64, u64)]) -> f64 {
        if end <= start || end as usize > self.map.len() {
            return 0.0;
        }
        // SAFETY: sysconf has no memory preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = if page > 0 { page as usize } else { 4096 };
        let first = start as usize / page * page;
        let len = end as usize - first;
        let mut vec = vec![0u8; len.div_ceil(page)];
        let addr = self.map.as_ptr().wrapping_add(first) as *mut libc::c_void;
        // SAFETY: `addr` is page aligned (maps start on a page boundary and `first` is a multiple of the
        // page size), `first..end` lies inside the map (checked above), and `vec` has one byte per page.
        let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
        if rc != 0 {
            return 0.0;
        }
        let (mut touched, mut resident) = (0usize, 0usize);
        for &(a, b) in ranges
            .iter()
            .filter(|r| r.0 >= start && r.1 <= end && r.0 < r.1)
        {
            let pages = &vec[(a as usize - first) / page..=(b as usize - 1 - first) / page];
            touched += pages.len();
            resident += pages.iter().filter(|&&v| v & 1 == 1).count();
        }
        if touched == 0 {
            return 0.0;
        }
        resident as f64 / touched as f64
    }
}

/// Asks the kernel to start reading `start..end` of `file` into the page cache (best effort).
pub(crate) fn prefetch(file: &File, start: u64, end: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(len)) = (
        libc::off_t::try_from(start),
        libc::off_t::try_from(end - start),
    ) else {
        return;
    };
    // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is owned by `file`.
    let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), off, len, libc::POSIX_FADV_WILLNEED) };
}

/// Fills `buf` from `file` at `offset`; a read that hits the end of the file is [`LoadError::Truncated`].
pub(crate) fn read_exact_at(
    file: &File,
    mut buf: &mut [u8],
    mut offset: u64,
    path: &Path,
) -> Result<(), LoadError> {
    let want_end = offset + buf.len() as u64;
    while !buf.is_empty() {
        match file.read_at(buf, offset) {
            Ok(0) => {
                let actual = file.metadata().map(|m| m.len()).unwrap_or(offset);
                return Err(LoadError::Truncated {
                    path: path.to_path_buf(),
                    expected: want_end,
                    actual,
                });
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(LoadError::io(path, &e)),
        }
    }
    Ok(())
}
