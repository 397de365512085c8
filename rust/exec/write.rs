//! The write direction ([`execute_write`]): the same items, copied from memory into their tensors' bytes in
//! existing files with positioned writes on the workers.

use std::fs::File;
use std::sync::Arc;

use super::workers::run_workers;
use super::{ExecOptions, ExecStats};
use crate::dest::DestBuf;
use crate::error::LoadError;
use crate::header::{FileIdentity, Header};
use crate::threads::default_threads;
use crate::types::{Item, Run};

/// Bytes of one positioned write of [`execute_write`] at most (repetitions adjacent in the file are
/// gathered into one buffer up to this size).
const WRITE_CHUNK: u64 = 8 * 1024 * 1024;

/// The write direction over the same items: every item's box is copied from its buffer (the "destination"
/// of a read: the memory being saved) into its tensor's bytes in the file (the "source" of a read), with
/// positioned writes from `threads` scoped threads. The files must exist at their final size (at least the
/// header's `file_len`) with the header already written; they are opened for writing, never truncated or
/// created. Source and file dtypes must be equal (no cast on the way out). All items are validated first
/// ([`crate::runs::plan_file_major`]); on an I/O error some regions may have been written.
/// `stats.bytes_copied` counts bytes written; `bytes_read_from_files` stays 0.
pub fn execute_write(
    files: &[Arc<Header>],
    bufs: &[DestBuf<'_>],
    items: &[Item],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    use std::os::unix::fs::FileExt;

    let runs = crate::runs::plan_file_major(files, bufs, items)?;
    if let Some(r) = runs
        .iter()
        .find(|r| r.src_dtype != r.dst_dtype || r.src_dtype.is_sub_byte())
    {
        let h = &files[r.file];
        return Err(LoadError::Request {
            path: Some(h.path.clone()),
            tensor: None,
            reason: format!(
                "item {}: writing {} memory into a {} tensor (the write direction does not cast, nor \
                 write sub-byte types)",
                r.item, r.dst_dtype, r.src_dtype
            ),
        });
    }
    let threads = opts.threads.unwrap_or_else(default_threads).max(1);
    let mut stats = ExecStats {
        runs: runs.iter().map(|r| r.reps as usize).sum(),
        backend: "pwrite",
        threads: 1,
        ..ExecStats::default()
    };
    if runs.is_empty() {
        stats.backend = "none";
        return Ok(stats);
    }
    let mut outs: Vec<Option<File>> = Vec::with_capacity(files.len());
    for (f, h) in files.iter().enumerate() {
        if !runs.iter().any(|r| r.file == f) {
            outs.push(None);
            continue;
        }
        // A regular file, opened without blocking, and the file the header was read from: the writes land
        // at the header's offsets, so a path replaced by another file since (its inode differs) is refused
        // before any byte is written. Only the inode is compared: earlier writes changed the times.
        let (file, meta) = crate::mmap::open_regular_for_write(&h.path)?;
        if meta.len() < h.file_len {
            return Err(LoadError::Truncated {
                path: h.path.clone(),
                expected: h.file_len,
                actual: meta.len(),
            });
        }
        let now = FileIdentity::of(&meta);
        if h.identity
            .is_some_and(|id| (id.dev, id.ino) != (now.dev, now.ino))
        {
            return Err(LoadError::Changed {
                path: h.path.clone(),
            });
        }
        outs.push(Some(file));
    }
    let mut pieces = Vec::with_capacity(runs.len());
    for r in &runs {
        r.split(WRITE_CHUNK, &mut pieces);
    }
    pieces.sort_unstable_by_key(|r| (r.file, r.src_off));
    stats.bytes_copied = pieces.iter().map(|r| r.reps * r.dst_bytes() as u64).sum();
    stats.spans = pieces.len();
    stats.threads = threads.min(pieces.len());
    let write_piece = |p: &Run, buf: &mut Vec<u8>| -> Result<(), LoadError> {
        let file = outs[p.file].as_ref().expect("every file with runs is open");
        let path = &files[p.file].path;
        let put = |bytes: &[u8], at: u64| {
            file.write_all_at(bytes, at)
                .map_err(|e| LoadError::io(path, &e))
        };
        let size = p.dst_elem_size() as u64;
        if p.count == 1 || p.src_stride == size {
            // Adjacent in the file within a repetition; repetitions too when they follow each other.
            let adjacent = p.reps == 1 || p.rep_src_stride == p.count * size;
            let group = if adjacent { p.reps } else { 1 };
            let mut r = 0;
            while r < p.reps {
                let at = p.src_off + r * p.rep_src_stride;
                match crate::dest::with_contiguous_reps(p, r..r + group, |bytes| put(bytes, at)) {
                    Some(result) => result?,
                    None => {
                        buf.clear();
                        crate::dest::gather_reps(p, r..r + group, buf);
                        put(buf, at)?;
                    }
                }
                r += group;
            }
            return Ok(());
        }
        // A file-strided run (neither side of the box has a unit file stride): element by element.
        for r in 0..p.reps {
            buf.clear();
            crate::dest::gather_reps(p, r..r + 1, buf);
            for (i, elem) in buf.chunks_exact(size as usize).enumerate() {
                put(
                    elem,
                    p.src_off + r * p.rep_src_stride + i as u64 * p.src_stride,
                )?;
            }
        }
        Ok(())
    };
    run_workers(
        stats.threads,
        pieces.len(),
        opts.interrupt.as_ref(),
        |i, buf, _| write_piece(&pieces[i], buf),
    )?;
    Ok(stats)
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::exec::testutil::*;
    use proptest::prelude::*;

    /// The write direction: a strided memory box written into a (permuted) box of a file tensor changes
    /// exactly the box's file bytes, each to its memory element (naive reference), and leaves every other
    /// byte of the file as it was.
    fn check_write(c: &Case) {
        let dt = PAIRS[c.pair].0;
        let numel: u64 = c.shape.iter().product();
        let size = dt.byte_size().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let before = random_bytes(numel as usize * size, c.seed);
        let h = write_file(
            dir.path(),
            "w.safetensors",
            &[
                ("pre", Dtype::U8, vec![24], vec![7; 24]),
                ("t", dt, c.shape.clone(), before.clone()),
            ],
        );
        let original = std::fs::read(&h.path).unwrap();
        let layout = c.layout(h.index("t").unwrap() as i64);
        let mut mem = random_bytes(layout.dst_len * size, c.seed ^ 99);
        let opts = ExecOptions {
            threads: Some(c.threads),
            ..ExecOptions::default()
        };
        let want_mem = mem.clone();
        let bufs = [DestBuf::from_mut_slice(&mut mem, dt)];
        let stats = execute_write(std::slice::from_ref(&h), &bufs, &[layout.item], &opts).unwrap();
        let elements = layout.elements();
        assert_eq!(stats.bytes_copied, elements.len() as u64 * size as u64);
        let mut want = original.clone();
        let data = (h.data_start + h.tensors[h.index("t").unwrap()].begin) as usize;
        for (se, de) in elements {
            let (se, de) = (data + se as usize * size, de as usize * size);
            want[se..se + size].copy_from_slice(&want_mem[de..de + size]);
        }
        assert_eq!(std::fs::read(&h.path).unwrap(), want);
        assert_eq!(mem, want_mem, "the memory being saved is only read");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        #[test]
        fn region_write_matches_naive(c in case()) {
            check_write(&c);
        }
    }

    /// The write direction refuses a cast and a file shorter than its header, and writes nothing then.
    #[test]
    fn write_refuses_casts_and_short_files() {
        let dir = tempfile::tempdir().unwrap();
        let h = write_file(
            dir.path(),
            "w.safetensors",
            &[("t", Dtype::BF16, vec![4], vec![0; 8])],
        );
        let original = std::fs::read(&h.path).unwrap();
        let item = flat_item(4);
        let mut mem = vec![1u8; 16];
        let bufs = [DestBuf::from_mut_slice(&mut mem, Dtype::F32)];
        let err = execute_write(
            std::slice::from_ref(&h),
            &bufs,
            &[item],
            &ExecOptions::default(),
        );
        assert!(
            matches!(&err, Err(LoadError::Request { reason, .. }) if reason.contains("does not cast")),
            "{err:?}"
        );
        assert_eq!(std::fs::read(&h.path).unwrap(), original);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&h.path)
            .unwrap();
        f.set_len(h.file_len - 1).unwrap();
        let mut mem = vec![1u8; 8];
        let bufs = [DestBuf::from_mut_slice(&mut mem, Dtype::BF16)];
        let err = execute_write(
            std::slice::from_ref(&h),
            &bufs,
            &[item],
            &ExecOptions::default(),
        );
        assert!(matches!(err, Err(LoadError::Truncated { .. })), "{err:?}");
    }

    /// The write direction writes only into the file its header was read from: a path replaced by another
    /// file since, or by a FIFO (whose open for writing would block until a reader came), is refused before
    /// a byte is written; a file merely written since (new times, same inode) is written again.
    #[test]
    fn write_refuses_a_replaced_file_or_a_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let h = write_file(
            dir.path(),
            "w.safetensors",
            &[("t", Dtype::BF16, vec![4], vec![0; 8])],
        );
        let item = flat_item(4);
        let mut mem = vec![7u8; 8];
        let bufs = [DestBuf::from_mut_slice(&mut mem, Dtype::BF16)];
        let write = || {
            execute_write(
                std::slice::from_ref(&h),
                &bufs,
                &[item],
                &ExecOptions::default(),
            )
        };
        write().unwrap();
        write().unwrap(); // the first write changed mtime and ctime: still the same file
        assert_eq!(
            std::fs::read(&h.path).unwrap()[h.file_len as usize - 8..],
            [7u8; 8]
        );
        // Another file renamed over the path (as a second save of the same name would).
        let other = dir.path().join("other");
        std::fs::write(&other, vec![1u8; h.file_len as usize + 64]).unwrap();
        std::fs::rename(&other, &h.path).unwrap();
        let err = write();
        assert!(matches!(err, Err(LoadError::Changed { .. })), "{err:?}");
        assert_eq!(
            std::fs::read(&h.path).unwrap(),
            vec![1u8; h.file_len as usize + 64]
        );
        // A FIFO without a reader: refused, not waited on.
        std::fs::remove_file(&h.path).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&h.path).status();
        assert!(made.is_ok_and(|s| s.success()));
        let err = write();
        assert!(err.is_err(), "{err:?}");
    }
}
