//! Runs → pieces → tasks: splitting long runs so every thread gets work, expanding repetitions a task would
//! otherwise read through, sorting by (file, offset), grouping nearby pieces into tasks, and the byte ranges
//! the `auto` backend probes for residency. It reads nothing.

use crate::mmap::RESIDENCY_SAMPLES;
use crate::types::Run;

/// Mapped runs join a task across gaps up to this many bytes (see `make_tasks`).
const MMAP_JOIN_GAP: u64 = 64 * 1024;
/// Smallest same-dtype dense run that `pread` reads straight into the destination.
const DIRECT_MIN: u64 = 64 * 1024;

/// How a task fetches its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Mmap,
    PreadDirect,
    PreadBuffered,
}

/// Pieces `first..last` of one file, read as one span `start..end` of its bytes.
pub(super) struct Task {
    pub(super) file: usize,
    pub(super) mode: Mode,
    pub(super) first: usize,
    pub(super) last: usize,
    pub(super) start: u64,
    pub(super) end: u64,
}

/// Needed bytes per one-byte range handed to the `auto` residency probe
/// ([`crate::mmap::Mapping::resident_fraction`]), between [`MIN_PROBES`] and `RESIDENCY_SAMPLES` = 256 ranges
/// a file (the most pages the probe asks about): a file a call needs 3 MiB of gets 8 ranges, not 256. Each
/// range is a `mincore` call for a file the probe maps (one system call per sample: 256 for each of the 254
/// files of a Llama-3.1-405B rank was 65 thousand calls), and every range is built per call (4,096 a file
/// were built, 16 MB of vectors for such a rank: 7 ms of its 50 ms engine call, docs/perf-notes.md,
/// "Session 15").
const PROBE_BYTES: u64 = 1 << 20;

/// Fewest probe ranges a file gets (when it has that many needed bytes).
const MIN_PROBES: u64 = 8;

/// Per file, one-byte ranges at positions spread evenly over the source bytes the runs need (repetitions
/// expanded, the bytes between them left out), one per [`PROBE_BYTES`] of them within
/// `MIN_PROBES..=RESIDENCY_SAMPLES`, so that the probe samples what is read, not the span, in O(runs + ranges)
/// rather than O(repetitions).
pub(super) fn probe_ranges(runs: &[Run], nfiles: usize) -> Vec<Vec<(u64, u64)>> {
    let mut total = vec![0u64; nfiles];
    for r in runs {
        total[r.file] += r.needed_bytes();
    }
    let probes = |t: u64| (t / PROBE_BYTES).clamp(MIN_PROBES, RESIDENCY_SAMPLES);
    let step: Vec<u64> = total
        .iter()
        .map(|&t| t.div_ceil(probes(t)).max(1))
        .collect();
    let mut seen = vec![0u64; nfiles]; // needed bytes of the file's runs so far
    let mut next = vec![0u64; nfiles]; // needed-byte position of the file's next probe
    let mut out: Vec<Vec<(u64, u64)>> = total
        .iter()
        .map(|&t| Vec::with_capacity(probes(t).min(t) as usize))
        .collect();
    for r in runs {
        let f = r.file;
        let (extent, needed) = (r.run_extent(), r.needed_bytes());
        while next[f] < seen[f] + needed {
            let at = next[f] - seen[f];
            let pos = r.src_off + at / extent * r.rep_src_stride + at % extent;
            out[f].push((pos, pos + 1));
            next[f] += step[f];
        }
        seen[f] += needed;
    }
    out
}

/// Splits the runs into pieces of at most `chunk` source bytes (only when some run is longer) and sorts
/// them by (file, offset), keeping the planned order when it is already sorted (items that read forward,
/// planned in file order). Repeated runs stay repeated unless the bytes between repetitions are more than
/// their file's task would read through or populate (`pread_gap` for `pread`, [`MMAP_JOIN_GAP`] for a
/// map) or a repetition is large enough for a direct `pread`: those are expanded, which gives the tasks of
/// one run per repetition (and see [`pieces_and_tasks`]).
pub(super) fn make_pieces(runs: Vec<Run>, mapped: &[bool], chunk: u64, gap: u64) -> Vec<Run> {
    let expand = |r: &Run| {
        r.reps > 1 && {
            let extent = r.run_extent();
            let between = r.rep_src_stride.saturating_sub(extent);
            match mapped[r.file] {
                true => between > MMAP_JOIN_GAP,
                false => between > gap || (r.is_direct() && extent >= DIRECT_MIN),
            }
        }
    };
    let long = |r: &Run| (r.count > 1 || r.reps > 1) && r.src_extent() > chunk;
    let mut pieces = if runs.iter().any(|r| expand(r) || long(r)) {
        let mut pieces = Vec::with_capacity(runs.len() + runs.len() / 4);
        for r in &runs {
            if expand(r) {
                for k in 0..r.reps {
                    r.rep(k).split(chunk, &mut pieces);
                }
            } else {
                r.split(chunk, &mut pieces);
            }
        }
        pieces
    } else {
        runs
    };
    sort_pieces(&mut pieces);
    pieces
}

fn sort_pieces(pieces: &mut [Run]) {
    let by_offset = |r: &Run| (r.file, r.src_off);
    if !pieces.is_sorted_by_key(by_offset) {
        pieces.sort_unstable_by_key(by_offset);
    }
}

/// [`make_pieces`] and [`make_tasks`] of them. A buffered `pread` task reads its whole span: when a task
/// holding a repeated piece overlaps another task of its file (two items reading interleaved columns of one
/// tensor, split into tasks), those bytes would be read twice, so the repeated pieces of `pread` files are
/// expanded, which reads them once, and the tasks made again. Overlapping pieces that land in one task (the
/// low and the high nibbles of the same MXFP4 bytes) are read once and stay whole.
pub(super) fn pieces_and_tasks(
    runs: Vec<Run>,
    mapped: &[bool],
    chunk: u64,
    gap: u64,
) -> (Vec<Run>, Vec<Task>) {
    let mut pieces = make_pieces(runs, mapped, chunk, gap);
    let mut tasks = make_tasks(&pieces, mapped, chunk, gap);
    if pread_tasks_overlap(&tasks, &pieces) {
        let mut flat = Vec::with_capacity(pieces.len());
        for p in &pieces {
            match p.reps > 1 && !mapped[p.file] {
                true => p.expand(&mut flat),
                false => flat.push(*p),
            }
        }
        pieces = flat;
        sort_pieces(&mut pieces);
        tasks = make_tasks(&pieces, mapped, chunk, gap);
    }
    (pieces, tasks)
}

/// Whether, among the tasks (in file and offset order), a buffered `pread` task overlaps another of its file
/// where either holds a repeated piece.
fn pread_tasks_overlap(tasks: &[Task], pieces: &[Run]) -> bool {
    let mut file = usize::MAX;
    let (mut end, mut repeated_end) = (0u64, 0u64);
    for t in tasks.iter().filter(|t| t.mode == Mode::PreadBuffered) {
        if t.file != file {
            (file, end, repeated_end) = (t.file, 0, 0);
        }
        let repeated = pieces[t.first..t.last].iter().any(|p| p.reps > 1);
        if t.start < repeated_end || (repeated && t.start < end) {
            return true;
        }
        end = end.max(t.end);
        if repeated {
            repeated_end = repeated_end.max(t.end);
        }
    }
    false
}

/// Groups the sorted pieces into tasks (`mapped`: per file, whether it is read from a map).
pub(super) fn make_tasks(pieces: &[Run], mapped: &[bool], chunk: u64, gap: u64) -> Vec<Task> {
    let mut tasks: Vec<Task> = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let mapped = mapped[p.file];
        let (start, end) = (p.src_off, p.src_end());
        let mode = match () {
            _ if mapped => Mode::Mmap,
            _ if p.reps == 1 && p.is_direct() && end - start >= DIRECT_MIN => Mode::PreadDirect,
            _ => Mode::PreadBuffered,
        };
        if let Some(t) = tasks.last_mut() {
            let joins = t.file == p.file
                && t.mode == mode
                && match mode {
                    // Group mapped copies into tasks of about `chunk` bytes of nearby runs: a task's
                    // whole span is populated, so it must not stretch over other ranks' data.
                    Mode::Mmap => {
                        start <= t.end + MMAP_JOIN_GAP && end.max(t.end) - t.start <= chunk
                    }
                    Mode::PreadDirect => false,
                    Mode::PreadBuffered => {
                        start <= t.end + gap && end.max(t.end) - t.start <= chunk
                    }
                };
            if joins {
                t.last = i + 1;
                t.start = t.start.min(start);
                t.end = t.end.max(end);
                continue;
            }
        }
        tasks.push(Task {
            file: p.file,
            mode,
            first: i,
            last: i + 1,
            start,
            end,
        });
    }
    tasks
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::exec::DEFAULT_PREAD_GAP;

    #[test]
    fn mapped_tasks_do_not_stretch_over_unread_data() {
        // Runs 128 KiB apart, within one 8 MiB task chunk: joining them would make a task whose populated
        // span covers the unread bytes between them. Adjacent runs still join.
        // One file, read from its map.
        let mapped = [true];
        let run = |src_off: u64| Run {
            item: 0,
            file: 0,
            src_off,
            src_stride: 1,
            count: 4096,
            dst_addr: 0,
            dst_stride: 1,
            reps: 1,
            rep_src_stride: 0,
            rep_dst_stride: 0,
            src_dtype: Dtype::U8,
            dst_dtype: Dtype::U8,
            src_nibble: 0,
        };
        let pieces = [
            run(0),
            run(4096),
            run(4096 + (128 << 10)),
            run(8192 + (128 << 10)),
        ];
        let tasks = make_tasks(&pieces, &mapped, 8 << 20, DEFAULT_PREAD_GAP);
        let spans: Vec<_> = tasks.iter().map(|t| (t.first, t.last)).collect();
        assert_eq!(spans, [(0, 2), (2, 4)]);
        // The same holds between the repetitions of one run: far apart, they are expanded into runs of
        // their own (and give the same tasks); nearby, they stay one piece and one task.
        let repeated = |stride: u64| Run {
            reps: 4,
            rep_src_stride: stride,
            rep_dst_stride: 4096,
            ..run(0)
        };
        let far = make_pieces(vec![repeated(4096 + (128 << 10))], &[true], 8 << 20, 0);
        assert_eq!(far.len(), 4);
        assert!(far.iter().all(|p| p.reps == 1));
        let tasks = make_tasks(&far, &mapped, 8 << 20, DEFAULT_PREAD_GAP);
        assert_eq!(tasks.len(), 4);
        let near = make_pieces(vec![repeated(8192)], &[true], 8 << 20, 0);
        assert_eq!(near, [repeated(8192)]);
        assert_eq!(
            make_tasks(&near, &mapped, 8 << 20, DEFAULT_PREAD_GAP).len(),
            1
        );
        // For pread the limit is the pread gap.
        assert_eq!(
            make_pieces(vec![repeated(8192)], &[false], 8 << 20, 4095).len(),
            4
        );
        assert_eq!(
            make_pieces(vec![repeated(8192)], &[false], 8 << 20, 4096).len(),
            1
        );
    }

    #[test]
    fn probe_ranges_sample_needed_bytes_evenly() {
        let run = |file: usize, src_off: u64, count: u64, reps: u64, stride: u64| Run {
            item: 0,
            file,
            src_off,
            src_stride: 1,
            count,
            dst_addr: 0,
            dst_stride: 1,
            reps,
            rep_src_stride: stride,
            rep_dst_stride: 0,
            src_dtype: Dtype::U8,
            dst_dtype: Dtype::U8,
            src_nibble: 0,
        };
        // File 0: 10^4 repetitions of 100 bytes 1000 apart, then one plain run of as many bytes; file 1:
        // one 10-byte run.
        let runs = [
            run(0, 1000, 100, 10_000, 1000),
            run(0, 20_000_000, 1_000_000, 1, 0),
            run(1, 5, 10, 1, 0),
        ];
        let probes = probe_ranges(&runs, 3);
        assert!(probes[2].is_empty());
        // 10 needed bytes: MIN_PROBES ranges, at most one per 2 bytes.
        assert_eq!(
            probes[1],
            (5..15).step_by(2).map(|a| (a, a + 1)).collect::<Vec<_>>()
        );
        // 2 MB needed: 2 ranges by size, MIN_PROBES at least.
        assert_eq!(probe_ranges(&runs[..2], 1)[0].len() as u64, MIN_PROBES);
        // 256 MB needed in repetitions and as much in one run: RESIDENCY_SAMPLES ranges.
        let runs = [
            run(0, 1000, 100, 2_560_000, 1000),
            run(0, 3_000_000_000, 256_000_000, 1, 0),
            run(1, 5, 10, 1, 0),
        ];
        let probes = probe_ranges(&runs, 3);
        let p = &probes[0];
        assert!(
            (RESIDENCY_SAMPLES - 2..=RESIDENCY_SAMPLES).contains(&(p.len() as u64)),
            "{}",
            p.len()
        );
        assert!(p.iter().all(|&(a, b)| b == a + 1));
        let (repeated, plain): (Vec<u64>, Vec<u64>) =
            p.iter().map(|r| r.0).partition(|&a| a < 3_000_000_000);
        // Only bytes the repetitions read, none between them; both runs get half the probes.
        assert!(repeated
            .iter()
            .all(|a| a >= &1000 && (a - 1000) % 1000 < 100));
        assert!(plain
            .iter()
            .all(|a| (3_000_000_000..3_256_000_000).contains(a)));
        assert!(
            repeated.len().abs_diff(plain.len()) <= 2,
            "{} {}",
            repeated.len(),
            plain.len()
        );
        // Evenly spread over the repetitions.
        let last_rep = (repeated.last().unwrap() - 1000) / 1000;
        assert!(last_rep >= 2_540_000, "{last_rep}");
    }

    fn nibble_run(nibble: u8, rows: u64, cols: u64, stride: u64) -> Run {
        Run {
            item: 0,
            file: 0,
            src_off: 4096,
            src_stride: stride,
            count: rows,
            dst_addr: 0,
            dst_stride: 2,
            reps: cols,
            rep_src_stride: 1,
            rep_dst_stride: 2 * rows as usize,
            src_dtype: Dtype::U8,
            dst_dtype: Dtype::BF16,
            src_nibble: nibble,
        }
    }

    /// gpt-oss's transposed expert slice under `pread`: the low- and the high-nibble runs read the same bytes
    /// (every column of each row), so their spans overlap; in one task they are read once and stay whole,
    /// as the tile kernel needs (they were expanded into one run per column, onto the scalar kernel).
    #[test]
    fn overlapping_nibble_runs_in_one_task_stay_whole() {
        let runs = vec![nibble_run(1, 5760, 45, 1440), nibble_run(2, 5760, 45, 1440)];
        let (pieces, tasks) = pieces_and_tasks(runs.clone(), &[false], 8 << 20, DEFAULT_PREAD_GAP);
        assert_eq!(pieces, runs);
        assert_eq!(tasks.len(), 1);
        assert_eq!(tasks[0].mode, Mode::PreadBuffered);
        assert_eq!((tasks[0].start, tasks[0].end), (4096, runs[0].src_end()));
    }

    /// A transposed run longer than the task chunk is cut into bands of rows that each keep every column
    /// (it was cut into one run per column); the bands tile the rows and fit the chunk.
    #[test]
    fn a_long_interleaved_run_splits_into_bands_of_rows() {
        let run = nibble_run(2, 5760, 45, 1440);
        let chunk = 1 << 20;
        for mapped in [false, true] {
            let (pieces, _) = pieces_and_tasks(vec![run], &[mapped], chunk, DEFAULT_PREAD_GAP);
            assert!(pieces.len() > 1);
            let mut row = 0;
            for p in &pieces {
                assert_eq!((p.reps, p.rep_src_stride, p.src_stride), (45, 1, 1440));
                assert_eq!(p.src_off, run.src_off + row * 1440);
                assert_eq!(p.dst_addr, run.dst_addr + row as usize * 2);
                assert!(p.src_extent() <= chunk);
                row += p.count;
            }
            assert_eq!(row, 5760);
        }
    }

    /// Repeated `pread` pieces whose spans overlap another task's are still expanded (read once, not twice).
    #[test]
    fn repeated_pread_pieces_overlapping_another_task_are_expanded() {
        let plain = Run {
            src_off: 4096 + 50,
            src_stride: 1,
            count: 100,
            reps: 1,
            rep_src_stride: 0,
            rep_dst_stride: 0,
            src_nibble: 0,
            dst_dtype: Dtype::U8,
            dst_stride: 1,
            ..nibble_run(0, 1, 1, 1)
        };
        let repeated = Run {
            count: 10,
            src_stride: 1,
            reps: 4,
            rep_src_stride: 30,
            rep_dst_stride: 10,
            ..plain
        };
        let repeated = Run {
            src_off: 4096,
            ..repeated
        };
        // the repeated run spans 4096..4196, the plain one 4146..4246: 150 bytes together, over a 120-byte chunk
        let (pieces, tasks) =
            pieces_and_tasks(vec![repeated, plain], &[false], 120, DEFAULT_PREAD_GAP);
        assert!(pieces.iter().all(|p| p.reps == 1), "{pieces:?}");
        assert_eq!(pieces.len(), 5);
        assert!(tasks.len() >= 2);
    }
}
