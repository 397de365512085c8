//! File access: read-only memory maps, page residency, and positioned reads.
//!
//! This is the only module that maps files (and so the only one with `unsafe` besides `dest`). The memory
//! map contract: the file must not be truncated or rewritten while it is mapped. [`crate::execute`] checks
//! the file size and identity with `fstat` before mapping or reusing a kept map ([`MapSlot`]; a shorter
//! file is reported as truncated instead of faulting with SIGBUS later); a file that shrinks *during* a
//! call is outside the contract (use the `pread` backend for files that may change).

#![allow(unsafe_code)]

use std::fs::{File, Metadata};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};

#[cfg(feature = "s3")]
use memmap2::MmapMut;
use memmap2::{Advice, Mmap, MmapOptions, UncheckedAdvice};

use crate::error::LoadError;

/// A read-only map of the first `len` bytes of a file.
/// A header's reusable map of its file: made on first mapped read, reused by later `execute` calls.
///
/// Re-mapping per call cost a quarter of a warm column read (the `munmap` of a populated map, measured with
/// py-spy in docs/perf-notes.md). Reuse is as safe as a fresh map: `execute` fstat-checks size and identity
/// (device, inode, mtime) before every use, and the map is only read. Cloning a header gives an empty slot.
#[derive(Default)]
pub struct MapSlot(Mutex<Option<Arc<Mapping>>>);

impl MapSlot {
    /// The cached map, or a new one made with `make` and kept.
    pub(crate) fn get_or_map(
        &self,
        make: impl FnOnce() -> Result<Mapping, LoadError>,
    ) -> Result<Arc<Mapping>, LoadError> {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(map) = slot.as_ref() {
            return Ok(Arc::clone(map));
        }
        let map = Arc::new(make()?);
        *slot = Some(Arc::clone(&map));
        Ok(map)
    }
}

/// Maps at least this large are unmapped on a short-lived thread by [`MapSlot::clear`].
pub(crate) const BACKGROUND_UNMAP_MIN: usize = 64 << 20;

impl MapSlot {
    /// Forgets the kept map (it is unmapped once no running read uses it).
    ///
    /// Unmapping a populated map tears down one page-table entry per resident page: ~20 ms for 2.6 GB, 7% of
    /// a rank's warm load (docs/perf-notes.md, "Unmapping off the critical path"). When this slot holds the
    /// last reference to a large map, the `munmap` runs on a short-lived thread, so the caller does not
    /// wait for it. A thread per call rather than one long-lived thread: a process forked after the
    /// first call would otherwise hand its maps to a thread it does not have. If the thread cannot be
    /// started, the map is dropped here.
    pub(crate) fn clear(&self) {
        let taken = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(map) = taken else { return };
        if Arc::strong_count(&map) > 1 || map.mapped_bytes() < BACKGROUND_UNMAP_MIN {
            return; // a running read unmaps it when it finishes, or it is cheap to unmap here
        }
        let _ = std::thread::Builder::new()
            .name("hp_fastload-unmap".into())
            .spawn(move || drop(map));
    }
}

impl Clone for MapSlot {
    fn clone(&self) -> Self {
        MapSlot::default()
    }
}

impl std::fmt::Debug for MapSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mapped = self.0.lock().map(|s| s.is_some()).unwrap_or(false);
        write!(f, "MapSlot(mapped: {mapped})")
    }
}

/// Most pages [`Mapping::resident_fraction`] asks `mincore` about.
pub(crate) const RESIDENCY_SAMPLES: u64 = 256;

/// A read-only map of a whole file.
pub struct Mapping {
    map: Mmap,
}

impl Mapping {
    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> usize {
        self.map.len()
    }

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
        let len = (end - start) as usize;
        // Fault the span's page-table entries in one call (Linux >= 5.14): for cached pages this is several
        // times cheaper than taking one minor fault per page during the copy. Older kernels: read-ahead hint.
        #[cfg(target_os = "linux")]
        if self
            .map
            .advise_range(Advice::PopulateRead, start as usize, len)
            .is_ok()
        {
            return;
        }
        let _ = self.map.advise_range(Advice::WillNeed, start as usize, len);
    }

    /// Drops this process's page-table entries for the whole pages inside `start..end` once they were read:
    /// the pages stay in the page cache and no longer count in the resident set. Without it a rank's share of
    /// a big checkpoint read through a kept map stayed resident (on top of the shards it filled) until the map
    /// was dropped (docs/perf-notes.md, "Full scale"). Best effort; errors are ignored.
    pub(crate) fn done_with(&self, start: u64, end: u64) {
        // SAFETY: sysconf only reads its integer argument and returns a value.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = if page > 0 { page as u64 } else { 4096 };
        let (lo, hi) = (
            start.div_ceil(page) * page,
            (end.min(self.map.len() as u64)) / page * page,
        );
        if hi <= lo {
            return;
        }
        // SAFETY: the map is a read-only map of a file that stays unchanged while mapped (the module's
        // contract); MADV_DONTNEED on it only drops page-table entries, and the next access to those bytes
        // (another task, a later call) faults the same contents in again from the page cache or the file, so
        // no slice into the map ever sees different bytes. The range lies inside the map (clamped above).
        let _ = unsafe {
            self.map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                lo as usize,
                (hi - lo) as usize,
            )
        };
    }

    /// Fraction (0..=1) of sampled pages of `ranges` (byte ranges of the file) that are in the page cache;
    /// 0 when unknown. At most [`RESIDENCY_SAMPLES`] pages, spread evenly over the ranges, are asked with one
    /// one-page `mincore` each: asking for every page of a 512 MiB span cost as much as copying a rank's
    /// share of it (docs/perf-notes.md, "auto backend probe").
    pub(crate) fn resident_fraction(&self, ranges: &[(u64, u64)]) -> f64 {
        // SAFETY: sysconf only reads its integer argument and returns a value.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let page = if page > 0 { page as u64 } else { 4096 };
        let total: u64 = ranges.iter().map(|&(a, b)| b.saturating_sub(a)).sum();
        if total == 0 {
            return 0.0;
        }
        let step = (total / RESIDENCY_SAMPLES).max(1);
        let (mut asked, mut resident) = (0u32, 0u32);
        let mut offset_in_ranges = 0u64;
        let mut next_sample = 0u64;
        for &(a, b) in ranges {
            if b <= a || b > self.map.len() as u64 {
                continue;
            }
            while next_sample < offset_in_ranges + (b - a) {
                let at = (a + (next_sample - offset_in_ranges)) / page * page;
                let mut flag = 0u8;
                let addr = self.map.as_ptr().wrapping_add(at as usize) as *mut libc::c_void;
                // SAFETY: `at` is page-aligned and `at < b <= map.len()`, so the one page asked about lies
                // inside this live mapping; `flag` has room for the one byte mincore writes for one page.
                let rc = unsafe { libc::mincore(addr, 1, &mut flag) };
                if rc == 0 {
                    asked += 1;
                    resident += u32::from(flag & 1);
                }
                next_sample += step;
            }
            offset_in_ranges += b - a;
        }
        if asked == 0 {
            return 0.0;
        }
        f64::from(resident) / f64::from(asked)
    }
}

/// Writable anonymous memory the size of a file, filled at the offsets a call needs (object storage): only the
/// pages written are backed by memory; the others read as zeros and are never touched by the copy, which reads
/// only the filled ranges. [`Staging::into_mapping`] makes it the read-only [`Mapping`] the executor copies from.
#[cfg(feature = "s3")]
pub struct Staging {
    map: MmapMut,
}

#[cfg(feature = "s3")]
impl Staging {
    /// `len` bytes of zeroed, lazily backed memory (no swap reserved: a file larger than RAM stages fine as
    /// long as the bytes written fit).
    pub(crate) fn new(len: u64, what: &Path) -> Result<Staging, LoadError> {
        let len =
            usize::try_from(len).map_err(|_| LoadError::request("object too large to stage"))?;
        let map = MmapOptions::new()
            .len(len.max(1))
            .no_reserve_swap()
            .map_anon()
            .map_err(|e| LoadError::io(what, &e))?;
        // Best effort: transparent huge pages make the first touch of a large staged range ~500x fewer
        // page faults (THP in "madvise" mode only backs advised areas).
        let _ = map.advise(Advice::HugePage);
        Ok(Staging { map })
    }

    /// The staged bytes, writable.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The staged bytes as a read-only [`Mapping`].
    pub(crate) fn into_mapping(self, what: &Path) -> Result<Mapping, LoadError> {
        let map = self
            .map
            .make_read_only()
            .map_err(|e| LoadError::io(what, &e))?;
        Ok(Mapping { map })
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

/// Blocks the asynchronous signals (SIGINT, SIGTERM, ...; not the synchronous ones a fault raises: SIGBUS,
/// SIGSEGV, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS) in the calling thread, for an engine worker: the kernel
/// then delivers a process-directed signal to a thread that can run its handler at once (the call's
/// coordinating thread, asleep between polls), not to a worker inside an 8 MiB `pread`, whose handler would
/// run only when the read returned. Best effort: a failure leaves the mask as it was.
pub(crate) fn block_async_signals() {
    // SAFETY: `set` is a local sigset_t initialized by sigfillset before any other use; sigdelset and
    // pthread_sigmask only read and write it and the calling thread's own signal mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        for sync in [
            libc::SIGBUS,
            libc::SIGSEGV,
            libc::SIGFPE,
            libc::SIGILL,
            libc::SIGTRAP,
            libc::SIGABRT,
            libc::SIGSYS,
        ] {
            libc::sigdelset(&mut set, sync);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// What a file that is not a regular file is, for [`LoadError::NotRegular`] (`None` for a regular file).
fn non_regular_kind(meta: &Metadata) -> Option<&'static str> {
    let t = meta.file_type();
    match () {
        _ if t.is_file() => None,
        _ if t.is_fifo() => Some("a FIFO"),
        _ if t.is_socket() => Some("a socket"),
        _ if t.is_char_device() => Some("a character device"),
        _ if t.is_block_device() => Some("a block device"),
        _ => Some("not a regular file"),
    }
}

/// Opens `path` for reading if it is a regular file, without ever blocking: the path is `stat`ed first (a
/// FIFO, socket or device is [`LoadError::NotRegular`] and is not opened; a directory is an `EISDIR`
/// [`LoadError::Io`]), and the open itself uses `O_NONBLOCK`, so a regular file replaced by a FIFO between
/// the two is refused by the `fstat` that follows instead of blocking the open until a writer comes.
/// `O_NONBLOCK` changes nothing for reads of a regular file.
pub(crate) fn open_regular(path: &Path) -> Result<(File, Metadata), LoadError> {
    open_regular_as(path, false)
}

/// [`open_regular`] for writing (the write direction): the same checks, `O_WRONLY | O_NONBLOCK`, never
/// created or truncated. A FIFO with no reader fails the open (`ENXIO`) instead of blocking it.
pub(crate) fn open_regular_for_write(path: &Path) -> Result<(File, Metadata), LoadError> {
    open_regular_as(path, true)
}

fn open_regular_as(path: &Path, write: bool) -> Result<(File, Metadata), LoadError> {
    let check = |meta: &Metadata| -> Result<(), LoadError> {
        if meta.is_dir() {
            return Err(LoadError::Io {
                path: path.to_path_buf(),
                kind: std::io::ErrorKind::IsADirectory,
                errno: Some(libc::EISDIR),
                message: "is a directory".into(),
            });
        }
        match non_regular_kind(meta) {
            Some(kind) => Err(LoadError::NotRegular {
                path: path.to_path_buf(),
                kind,
            }),
            None => Ok(()),
        }
    };
    check(&std::fs::metadata(path).map_err(|e| LoadError::io(path, &e))?)?;
    let file = std::fs::OpenOptions::new()
        .read(!write)
        .write(write)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| LoadError::io(path, &e))?;
    let meta = file.metadata().map_err(|e| LoadError::io(path, &e))?;
    check(&meta)?;
    Ok((file, meta))
}

/// Reads the longest prefix of `buf` that the page cache holds at `offset` of `file`, without waiting for
/// storage (`preadv2(RWF_NOWAIT)`, Linux >= 4.14, glibc): the bytes read. 0 where nothing is cached, where
/// the call is unsupported, at the end of the file or on any error: the caller's blocking read then reads
/// the rest and reports what went wrong.
pub(crate) fn read_cached_at(file: &File, buf: &mut [u8], offset: u64) -> usize {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::fd::AsRawFd;
        let mut done = 0usize;
        while done < buf.len() {
            let Ok(at) = libc::off_t::try_from(offset + done as u64) else {
                break;
            };
            let rest = &mut buf[done..];
            let iov = libc::iovec {
                iov_base: rest.as_mut_ptr().cast(),
                iov_len: rest.len(),
            };
            // SAFETY: `iov` describes `rest`, writable for its whole length and not otherwise borrowed during
            // the call; the descriptor is owned by `file`, which outlives the call.
            let n = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, at, libc::RWF_NOWAIT) };
            if n <= 0 {
                break; // EAGAIN (not cached), EOF, EOPNOTSUPP, EINTR...: the blocking read takes over
            }
            done += n as usize;
        }
        done
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = (file, buf, offset);
        0
    }
}

/// Fills `buf` from `file` at `offset`; a read that hits the end of the file is [`LoadError::Truncated`],
/// which reports `file_len` (the size the header says the file has) and the size the file has now.
pub(crate) fn read_exact_at(
    file: &File,
    mut buf: &mut [u8],
    mut offset: u64,
    path: &Path,
    file_len: u64,
) -> Result<(), LoadError> {
    while !buf.is_empty() {
        match file.read_at(buf, offset) {
            Ok(0) => {
                let actual = file.metadata().map(|m| m.len()).unwrap_or(offset);
                return Err(LoadError::Truncated {
                    path: path.to_path_buf(),
                    expected: file_len,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Weak;
    use std::time::{Duration, Instant};

    fn sparse_file(len: u64) -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse.bin");
        let file = File::create(&path).unwrap();
        file.set_len(len).unwrap();
        (dir, File::open(&path).unwrap())
    }

    fn gone_within(weak: &Weak<Mapping>, limit: Duration) -> bool {
        let start = Instant::now();
        while weak.upgrade().is_some() {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    #[test]
    fn read_cached_at_reads_a_cached_prefix_and_never_past_the_end() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let data: Vec<u8> = (0..3 * 4096u32 + 100)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let mut f = File::create(&path).unwrap();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
        let file = File::open(&path).unwrap();
        // just written: cached, read whole without waiting (where RWF_NOWAIT exists)
        let mut buf = vec![0u8; 8192];
        let n = read_cached_at(&file, &mut buf, 1000);
        assert!(n == 0 || n == buf.len(), "{n}");
        assert_eq!(&buf[..n], &data[1000..1000 + n]);
        // past the end: only what the file has, then 0
        let mut tail = vec![0u8; 4096];
        let n = read_cached_at(&file, &mut tail, data.len() as u64 - 50);
        assert!(n <= 50);
        assert_eq!(&tail[..n], &data[data.len() - 50..data.len() - 50 + n]);
        assert_eq!(read_cached_at(&file, &mut tail, data.len() as u64 + 10), 0);
        // evicted (clean pages): whatever prefix comes back is the file's; the blocking read finishes it
        use std::os::fd::AsRawFd;
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is owned by `file`.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut all = vec![0u8; data.len()];
        let n = read_cached_at(&file, &mut all, 0);
        assert_eq!(&all[..n], &data[..n]);
        read_exact_at(&file, &mut all[n..], n as u64, &path, data.len() as u64).unwrap();
        assert_eq!(all, data);
    }

    #[test]
    fn clear_unmaps_a_large_map_in_the_background_and_keeps_one_in_use() {
        let len = BACKGROUND_UNMAP_MIN as u64 + 4096;
        let (dir, file) = sparse_file(len);
        let slot = MapSlot::default();
        let path = dir.path().join("sparse.bin");
        let in_use = slot.get_or_map(|| Mapping::new(&file, len, &path)).unwrap();
        let weak = Arc::downgrade(&in_use);
        slot.clear();
        // A running read still holds it: nothing is unmapped under it.
        assert!(weak.upgrade().is_some());
        drop(in_use);
        assert!(weak.upgrade().is_none(), "the last user unmaps it");

        let kept = slot.get_or_map(|| Mapping::new(&file, len, &path)).unwrap();
        let weak = Arc::downgrade(&kept);
        drop(kept);
        slot.clear();
        assert!(
            slot.0.lock().unwrap().is_none(),
            "the slot is empty at once"
        );
        assert!(
            gone_within(&weak, Duration::from_secs(10)),
            "the background thread unmapped it"
        );
    }

    #[test]
    fn pread_past_the_end_reports_the_file_size_not_the_chunk_end() {
        let (dir, file) = sparse_file(100);
        let path = dir.path().join("sparse.bin");
        let mut buf = vec![0u8; 50];
        // A chunk 80..130 of a file whose header says 4096 bytes, found with 100.
        match read_exact_at(&file, &mut buf, 80, &path, 4096) {
            Err(LoadError::Truncated {
                expected: 4096,
                actual: 100,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn non_regular_files_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.safetensors");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path it is given and nothing else.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // With no writer, a blocking open would never return; the test would hang, not fail.
        match open_regular(&fifo) {
            Err(e @ LoadError::NotRegular { kind: "a FIFO", .. }) => {
                assert!(e.to_string().contains("not a regular file"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            open_regular(dir.path()),
            Err(LoadError::Io {
                errno: Some(libc::EISDIR),
                ..
            })
        ));
        let (regular_dir, _) = sparse_file(8);
        let (_, meta) = open_regular(&regular_dir.path().join("sparse.bin")).unwrap();
        assert_eq!(meta.len(), 8);
    }

    #[test]
    fn clear_unmaps_a_small_map_at_once() {
        let (dir, file) = sparse_file(8192);
        let slot = MapSlot::default();
        let path = dir.path().join("sparse.bin");
        let weak = Arc::downgrade(
            &slot
                .get_or_map(|| Mapping::new(&file, 8192, &path))
                .unwrap(),
        );
        slot.clear();
        assert!(weak.upgrade().is_none());
    }
}
