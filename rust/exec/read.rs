//! The read direction: validates a batch, opens and checks each needed file, picks its backend (a memory
//! map or positioned reads), makes the tasks and runs them on the workers, copying (casting, dequantizing)
//! each run into its destination.

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::release::{Release, Releases};
use super::scales::{
    check_scale, item_scales, mappable_scale_files, read_scale_cells, scale_cells, LoadedScale,
    Scaled,
};
use super::staged::{needed_ranges, Stage};
use super::tasks::{pieces_and_tasks, probe_ranges, Mode, Task};
use super::workers::run_workers;
use super::{Backend, ExecOptions, ExecStats, Scale, AUTO_MMAP_RESIDENT, IO_THREAD_FACTOR};
use crate::dest::{with_dense_dst, DestBuf};
use crate::error::LoadError;
use crate::header::{FileIdentity, Header};
use crate::mmap::{open_regular, prefetch, read_cached_at, read_exact_at, Mapping};
use crate::runs::plan;
use crate::threads::{default_threads, MAX_DEFAULT_THREADS};
use crate::types::{Item, Run};

/// At most this many files of one call (and no more than its threads) stay open from the pre-read check until
/// their reads: the others are opened again when their first task runs. A rank reading from hundreds of shards
/// thus holds about `threads + workers` descriptors at most (64 kept files were 64 descriptors held through the
/// whole call, on every rank of a node; docs/perf-notes.md, "Full scale").
const KEEP_OPEN: usize = 8;

/// One needed file of a call: its map (mapped reads; a map needs no descriptor), or, for positioned reads,
/// a descriptor opened on first use and closed after the file's last task. A call over thousands of shards
/// thus holds about one descriptor per worker, not one per file (a soft `ulimit -n` of 1024 is common).
struct Source {
    map: Option<Arc<Mapping>>,
    file: Mutex<Option<Arc<File>>>,
    /// `pread` tasks of the file not yet finished (set once the tasks are made).
    pending: AtomicUsize,
    /// Read with `pread` for its holes (`mostly_holes`), not because its pages are not cached: no reason to
    /// wait on storage with more workers.
    holes: bool,
}

impl Source {
    /// The open file for a `pread` task, opened (and checked again) when it is not open.
    fn file(&self, h: &Header) -> Result<Arc<File>, LoadError> {
        let mut slot = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(file) = slot.as_ref() {
            return Ok(Arc::clone(file));
        }
        let file = Arc::new(open_checked(h)?);
        *slot = Some(Arc::clone(&file));
        Ok(file)
    }

    /// One `pread` task of the file is done; after the last one the descriptor is closed.
    fn finish(&self) {
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.file.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }
}

/// [`execute_scaled`](super::execute_scaled); `whole_scales` reads every scale whole (the tests' reference
/// for the touched rows); `stage`, when given, provides the files' bytes from elsewhere (object storage,
/// [`Stage`]) once the batch is validated.
pub(super) fn execute_scaled_reading(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
    whole_scales: bool,
    stage: Option<Stage<'_>>,
) -> Result<ExecStats, LoadError> {
    let mut loaded: Vec<LoadedScale> = scales
        .iter()
        .enumerate()
        .map(|(k, s)| check_scale(k, s, files))
        .collect::<Result<_, _>>()?;
    let per_item = item_scales(files, dests, items, &mut loaded)?;
    let mut runs = plan(files, dests, items)?;
    let all_runs: usize = runs.iter().map(|r| r.reps as usize).sum();
    let threads = opts.threads.unwrap_or_else(default_threads).max(1);
    let mut staged = None;
    let mut direct_bytes = 0;
    if !runs.is_empty() {
        let cells = scale_cells(&loaded, items, &per_item, whole_scales);
        if let Some(stage) = stage {
            // Plain byte copies go straight from the fetched bytes into their destinations (when the
            // source allows it, `stage.direct`); the others are copied from the staged bytes below.
            let (direct, copied): (Vec<Run>, Vec<Run>) = runs.into_iter().partition(|r| {
                stage.direct
                    && r.is_direct()
                    && !r.src_dtype.is_sub_byte()
                    && per_item.get(r.item).copied().flatten().is_none()
            });
            direct_bytes = direct.iter().map(Run::needed_bytes).sum();
            staged = Some((stage.fetch)(
                &needed_ranges(&copied, &loaded, &cells, files),
                &direct,
            )?);
            runs = copied;
        }
        let interrupt = opts.interrupt.as_ref();
        // MXFP4 scale windows of whole rows are kept as slices of their file's map (unless `pread` was asked
        // for): a rank's whole experts' scales copied into fresh memory cost a page fault every 4 KiB
        let maps = match (&staged, opts.backend) {
            (Some(staged), _) => Some(staged.clone()),
            (None, Backend::Pread) => None,
            (None, _) => Some(
                mappable_scale_files(&loaded, &cells, files)
                    .into_iter()
                    .zip(files)
                    .map(|(wanted, h)| match wanted {
                        true => file_map(h, &open_checked_meta(h)?.0).map(Some),
                        false => Ok(None),
                    })
                    .collect::<Result<Vec<_>, LoadError>>()?,
            ),
        };
        read_scale_cells(
            &mut loaded,
            &cells,
            files,
            maps.as_deref(),
            threads,
            interrupt,
        )?;
    }
    let scale_bytes: u64 = loaded.iter().map(|s| s.bytes).sum();
    let mut stats = ExecStats {
        runs: all_runs,
        backend: if direct_bytes > 0 { "direct" } else { "none" },
        threads: 1,
        bytes_copied: direct_bytes,
        ..ExecStats::default()
    };
    if runs.is_empty() {
        return Ok(stats);
    }
    // Open, check and (maybe) map each file that is needed.
    let mut used = vec![false; files.len()];
    for r in &runs {
        used[r.file] = true;
    }
    let probes = match opts.backend {
        Backend::Auto => probe_ranges(&runs, files.len()),
        _ => vec![Vec::new(); files.len()],
    };
    let mut sources: Vec<Option<Source>> = Vec::with_capacity(files.len());
    let mut kept_open = 0;
    for (f, ((h, &used), ranges)) in files.iter().zip(&used).zip(&probes).enumerate() {
        let kept = staged.as_ref().and_then(|s| s[f].clone());
        sources.push(match used {
            true if kept.is_some() => Some(Source {
                map: kept,
                file: Mutex::new(None),
                pending: AtomicUsize::new(0),
                holes: false,
            }),
            true => {
                let keep = kept_open < KEEP_OPEN.min(threads);
                let mut source = open_source(h, opts.backend, ranges, keep)?;
                kept_open += usize::from(source.file.get_mut().is_ok_and(|f| f.is_some()));
                Some(source)
            }
            false => None,
        });
    }
    drop(probes);
    let uses_mmap = sources.iter().flatten().any(|s| s.map.is_some());
    let uses_pread = sources.iter().flatten().any(|s| s.map.is_none());
    stats.backend = match (uses_mmap, uses_pread) {
        (true, false) if direct_bytes > 0 => "direct+mmap",
        (true, true) => "mixed",
        (true, false) => "mmap",
        _ => "pread",
    };
    let mapped: Vec<bool> = sources
        .iter()
        .map(|s| s.as_ref().is_some_and(|s| s.map.is_some()))
        .collect();
    let total: u64 = runs.iter().map(Run::needed_bytes).sum();
    let chunk = (total / (threads as u64 * 8)).clamp(64 * 1024, 8 * 1024 * 1024);
    let (pieces, tasks) = pieces_and_tasks(runs, &mapped, chunk, opts.pread_gap);
    for t in tasks.iter().filter(|t| t.mode != Mode::Mmap) {
        if let Some(s) = &sources[t.file] {
            s.pending.fetch_add(1, Ordering::Relaxed);
        }
    }
    stats.spans = tasks.len();
    stats.bytes_copied += pieces
        .iter()
        .map(|r| r.reps * (r.count * r.dst_dtype.bits()).div_ceil(8))
        .sum::<u64>();
    // Reads that go to storage (pread: the pages are not cached) wait on the device, not on a core: twice
    // the threads keep more requests in flight. Plain 8 MiB preads went 0.84 -> 1.3 GB/s cold here; with the
    // engine's WILLNEED look-ahead it measured a tie on this disk (docs/perf-notes.md, "Cold reads"), kept
    // for devices with deeper queues.
    let waits_on_storage = sources
        .iter()
        .flatten()
        .any(|s| s.map.is_none() && !s.holes);
    let workers = match waits_on_storage {
        true => (threads * IO_THREAD_FACTOR).clamp(threads, MAX_DEFAULT_THREADS.max(threads)),
        false => threads,
    };
    stats.threads = workers.min(tasks.len());
    let scaled = Scaled {
        scales: &loaded,
        items: &per_item,
    };
    stats.bytes_read_from_files = scale_bytes
        + run_tasks(
            &tasks,
            &pieces,
            &sources,
            files,
            stats.threads,
            &scaled,
            opts,
        )?;
    Ok(stats)
}

/// Opens the file of `h` (a regular file, without blocking) and checks it against the header: at least as
/// long ([`LoadError::Truncated`]) and the same identity ([`LoadError::Changed`]).
fn open_checked(h: &Header) -> Result<File, LoadError> {
    open_checked_meta(h).map(|(file, _)| file)
}

/// A map of the whole of `h`'s file (`file`, opened and checked by [`open_checked_meta`]): the header's kept
/// map when it has an identity to check that against, else a fresh one (headers parsed from memory).
fn file_map(h: &Header, file: &File) -> Result<Arc<Mapping>, LoadError> {
    let make = || Mapping::new(file, h.file_len, &h.path);
    match h.identity {
        Some(_) => h.map.get_or_map(make),
        None => make().map(Arc::new),
    }
}

/// [`open_checked`], with the metadata it checked the file against.
fn open_checked_meta(h: &Header) -> Result<(File, std::fs::Metadata), LoadError> {
    let (file, meta) = open_regular(&h.path)?;
    if meta.len() < h.file_len {
        return Err(LoadError::Truncated {
            path: h.path.clone(),
            expected: h.file_len,
            actual: meta.len(),
        });
    }
    if h.identity.is_some_and(|id| id != FileIdentity::of(&meta)) {
        return Err(LoadError::Changed {
            path: h.path.clone(),
        });
    }
    Ok((file, meta))
}

/// Checks the file of `h` and maps it when `backend` may copy from a map. The descriptor is kept for
/// positioned reads only when `keep_open`, else closed (a map does not need it; [`Source::file`] reopens).
fn open_source(
    h: &Header,
    backend: Backend,
    ranges: &[(u64, u64)],
    keep_open: bool,
) -> Result<Source, LoadError> {
    let (file, meta) = open_checked_meta(h)?;
    let mapping = || file_map(h, &file);
    let holes = backend == Backend::Auto && mostly_holes(&meta);
    let map = match backend {
        Backend::Pread => None,
        Backend::Mmap => Some(mapping()?),
        Backend::Auto if holes => None,
        Backend::Auto => {
            let map = mapping()?;
            (map.resident_fraction(ranges) >= AUTO_MMAP_RESIDENT).then_some(map)
        }
    };
    let file = (map.is_none() && keep_open).then(|| Arc::new(file));
    Ok(Source {
        map,
        file: Mutex::new(file),
        pending: AtomicUsize::new(0),
        holes,
    })
}

/// A file whose allocated blocks cover less than half its length (a sparse rehearsal checkpoint: real header,
/// holes for data). Its hole pages sit in the page cache as single-page folios, which a map populates and tears
/// down one page-table entry at a time: `pread` read such a cached rank 2-3x faster than a map
/// (docs/perf-notes.md, "Session 13: sparse files"), while a dense file's larger folios favour the map.
fn mostly_holes(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    meta.blocks().saturating_mul(512) < meta.len() / 2
}

fn run_tasks(
    tasks: &[Task],
    pieces: &[Run],
    sources: &[Option<Source>],
    files: &[Arc<Header>],
    threads: usize,
    scaled: &Scaled<'_>,
    opts: &ExecOptions,
) -> Result<u64, LoadError> {
    let bytes_read = AtomicU64::new(0);
    let releases = Releases::new(tasks);
    // pread tasks ask the kernel to read ahead (`POSIX_FADV_WILLNEED`) once the call has met bytes that are not
    // cached: until then each pread task first takes what the page cache holds without waiting
    // (`read_cached_at`), and a warm call issues no hint at all (a hint walks the page cache over its range
    // again: 8% of a warm rank's reads, docs/perf-notes.md). The first task that waits turns the hints on: the
    // next `lookahead` tasks are hinted then (on a worker, so that a coordinating thread already watches for
    // interrupts: a hint can take milliseconds per task), then one more per task taken.
    let lookahead = 2 * threads;
    let hinting = AtomicBool::new(false); // on once a pread task waited for storage
    let prefetch_task = |i: usize| {
        if let Some(t) = tasks.get(i).filter(|t| t.mode != Mode::Mmap) {
            // An open that fails here fails again in the task, which reports it. A file whose tasks are all
            // done (its task ran before this hint) is not opened again.
            let source = sources[t.file].as_ref();
            if let Some(Ok(file)) = source
                .filter(|s| s.pending.load(Ordering::Acquire) > 0)
                .map(|s| s.file(&files[t.file]))
            {
                prefetch(&file, t.start, t.end);
            }
        }
    };
    run_workers(
        threads,
        tasks.len(),
        opts.interrupt.as_ref(),
        |i, buf, stop| {
            let task = &tasks[i];
            let hint = |range: std::ops::RangeInclusive<usize>| {
                for ahead in range.take_while(|_| !stop.load(Ordering::Relaxed)) {
                    prefetch_task(ahead);
                }
            };
            if hinting.load(Ordering::Relaxed) {
                hint(i + lookahead..=i + lookahead);
            }
            let on_miss = || {
                // the first task of the call that waits for storage: hint the tasks it runs ahead of
                if !hinting.swap(true, Ordering::Relaxed) {
                    hint(i + 1..=i + lookahead);
                }
            };
            let cached_first = !hinting.load(Ordering::Relaxed);
            let result = run_task(
                task,
                pieces,
                sources,
                files,
                buf,
                scaled,
                cached_first,
                &on_miss,
            );
            if task.mode != Mode::Mmap {
                if let Some(source) = &sources[task.file] {
                    source.finish();
                }
            } else if result.is_ok() {
                release(sources, &releases.finished(i, tasks));
            }
            bytes_read.fetch_add(result?, Ordering::Relaxed);
            Ok(())
        },
    )?;
    // A map this call made is unmapped when it returns (off the critical path for large ones); a kept one
    // (a header's map, `keep_maps`, `load`'s batches) must not keep the last window resident.
    release(sources, &releases.rest(tasks));
    Ok(bytes_read.into_inner())
}

/// Drops the page-table entries of `ranges` (the pages stay in the page cache; see [`Releases`]).
fn release(sources: &[Option<Source>], ranges: &[Release]) {
    for r in ranges {
        if let Some(map) = sources[r.file].as_ref().and_then(|s| s.map.as_ref()) {
            map.done_with(r.start, r.end);
        }
    }
}

/// Reads `buf` at `offset`: first what the page cache holds without waiting (`cached_first`), calling
/// `on_miss` before waiting for the rest; then blocking reads ([`read_exact_at`]).
fn read_task_bytes(
    file: &File,
    buf: &mut [u8],
    offset: u64,
    (path, file_len): (&std::path::Path, u64),
    cached_first: bool,
    on_miss: &dyn Fn(),
) -> Result<(), LoadError> {
    let done = if cached_first {
        read_cached_at(file, buf, offset)
    } else {
        0
    };
    if done == buf.len() {
        return Ok(());
    }
    if cached_first {
        on_miss();
    }
    read_exact_at(file, &mut buf[done..], offset + done as u64, path, file_len)
}

#[allow(clippy::too_many_arguments)]
fn run_task(
    task: &Task,
    pieces: &[Run],
    sources: &[Option<Source>],
    files: &[Arc<Header>],
    buf: &mut Vec<u8>,
    scaled: &Scaled<'_>,
    cached_first: bool,
    on_miss: &dyn Fn(),
) -> Result<u64, LoadError> {
    #[cfg(test)]
    if files[task.file].path.ends_with("inject-panic.safetensors") {
        panic!("injected worker panic");
    }
    let source = sources[task.file]
        .as_ref()
        .expect("every file with runs is open");
    let path = &files[task.file].path;
    let runs = &pieces[task.first..task.last];
    match task.mode {
        Mode::Mmap => {
            let map = source.map.as_ref().expect("mapped task has a map");
            let extent: u64 = runs.iter().map(Run::needed_bytes).sum();
            // One populate call beats a fault per touched page on a fresh map, even when the runs touch only
            // a quarter of the span's pages (docs/perf-notes.md, "dense populate only").
            map.will_need(task.start, task.end);
            let bytes = map.bytes();
            for r in runs {
                scaled.write(r, &bytes[r.src_off as usize..r.src_end() as usize]);
            }
            Ok(extent)
        }
        Mode::PreadDirect => {
            let r = &runs[0];
            debug_assert_eq!(r.reps, 1);
            let (file, len) = (source.file(&files[task.file])?, files[task.file].file_len);
            with_dense_dst(r, |out| {
                read_task_bytes(&file, out, r.src_off, (path, len), cached_first, on_miss)
            })?;
            Ok(r.src_extent())
        }
        Mode::PreadBuffered => {
            let len = (task.end - task.start) as usize;
            if buf.len() < len {
                buf.resize(len, 0);
            }
            let file = source.file(&files[task.file])?;
            let file_len = files[task.file].file_len;
            read_task_bytes(
                &file,
                &mut buf[..len],
                task.start,
                (path, file_len),
                cached_first,
                on_miss,
            )?;
            for r in runs {
                let at = (r.src_off - task.start) as usize;
                scaled.write(r, &buf[at..at + r.src_extent() as usize]);
            }
            Ok(len as u64)
        }
    }
}

#[cfg(test)]
mod tests;
