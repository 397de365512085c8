//! When a call's mapped pages are released: the page-table entries of finished mapped tasks are dropped in a
//! few large `madvise(MADV_DONTNEED)` calls, not one per task.
//!
//! Dropping them keeps a rank's resident set at its shards plus a bounded window of the checkpoint, however
//! much of it the rank reads through one map (the bound issue 23's rehearsals check). One `madvise` per 8 MiB
//! task did that at a price: each call flushes the TLB of every CPU the process runs on (an inter-processor
//! interrupt), and the page tables it tears down are ones the call's closing `munmap` would have torn down off
//! the critical path. Per task, that was a quarter of a one-shot column read and a tenth of a row read
//! (docs/perf-notes.md, session 12). Here the tasks' spans are released once the finished tasks of a prefix of
//! the (file, offset)-ordered task list hold [`Releases::window`] bytes: one call per file per window.

use std::sync::Mutex;

use super::tasks::{Mode, Task};

/// Most bytes of finished mapped tasks kept mapped before they are released. 64 MiB: three windows (192 MiB)
/// fit issue 23's bound of shard bytes + 1 GiB beside the ~0.85 GiB a rank's process holds before reading; at
/// 256 MiB a rank whose spans are much larger than its bytes (gpt-oss-120b's MXFP4 experts cut along their
/// inputs under EP x FSDP: 7.2 GB of 1,440-byte rows populated for 0.23 GB used) held up to 0.7 GiB of
/// them. Windows of 16 MiB already took most of the per-task cost away (docs/perf-notes.md, session 12).
pub(super) const RELEASE_WINDOW_MAX: u64 = 64 << 20;
/// Fewest bytes a release waits for.
pub(super) const RELEASE_WINDOW_MIN: u64 = 1 << 20;

/// A byte range of one file whose page-table entries are to be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Release {
    pub(super) file: usize,
    pub(super) start: u64,
    pub(super) end: u64,
}

/// The release bookkeeping of one call's tasks (only mapped tasks count; the others are finished at once).
pub(super) struct Releases {
    window: u64,
    state: Mutex<State>,
}

/// A task's state in [`State::done`].
const RUNNING: u8 = 0;
const FINISHED: u8 = 1;
/// Finished beyond a stalled prefix and released on its own (see [`Releases::finished`]).
const RELEASED_ALONE: u8 = 2;

struct State {
    /// Per task: [`RUNNING`] (or not started), [`FINISHED`], [`RELEASED_ALONE`].
    done: Vec<u8>,
    /// Mapped bytes of finished tasks after the prefix, not yet released.
    ahead: u64,
    /// Every task before this one is finished.
    prefix: usize,
    /// Tasks `from..prefix` are finished and not yet released.
    from: usize,
    /// Mapped bytes (task spans) of tasks `from..prefix`.
    pending: u64,
    /// The furthest end of the released tasks of the last file released (a file's spans overlap when runs
    /// interleave: what the cap left of a long span is released with the file's next window).
    reach: Option<(usize, u64)>,
}

impl Releases {
    /// For `tasks` (sorted by file, then start); those not read from a map count as finished from the start.
    /// The window is a sixteenth of the mapped spans, within [`RELEASE_WINDOW_MIN`]..=[`RELEASE_WINDOW_MAX`].
    pub(super) fn new(tasks: &[Task]) -> Releases {
        let spans: u64 = tasks.iter().filter(|t| mapped(t)).map(span).sum();
        let done = tasks
            .iter()
            .map(|t| if mapped(t) { RUNNING } else { FINISHED })
            .collect();
        Releases {
            window: (spans / 16).clamp(RELEASE_WINDOW_MIN, RELEASE_WINDOW_MAX),
            state: Mutex::new(State {
                done,
                ahead: 0,
                prefix: 0,
                from: 0,
                pending: 0,
                reach: None,
            }),
        }
    }

    /// Bytes of finished tasks kept mapped before they are released.
    #[cfg(test)]
    pub(super) fn window(&self) -> u64 {
        self.window
    }

    /// Task `i` (a mapped one) is finished: the ranges to release now (empty until a window's worth of a
    /// finished prefix). Tasks finished beyond a prefix that stalls (one slow task while the other workers
    /// go on) are released one by one once they hold two windows, so the mapped bytes of finished tasks stay
    /// under three windows (192 MiB at most) whatever the order.
    pub(super) fn finished(&self, i: usize, tasks: &[Task]) -> Vec<Release> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.done[i] = FINISHED;
        while s.prefix < tasks.len() && s.done[s.prefix] != RUNNING {
            let t = &tasks[s.prefix];
            if mapped(t) {
                s.pending += span(t);
                if s.done[s.prefix] == FINISHED && s.prefix != i {
                    s.ahead -= span(t); // counted in `ahead` when it finished
                }
            }
            s.prefix += 1;
        }
        if i >= s.prefix {
            s.ahead += span(&tasks[i]);
        }
        let mut out = Vec::new();
        if s.pending >= self.window {
            out = take(&mut s, tasks);
        }
        if s.ahead >= 2 * self.window {
            out.extend(alone(&mut s, tasks));
        }
        out
    }

    /// Everything finished and not yet released (after the last task, for a map that outlives the call).
    pub(super) fn rest(&self, tasks: &[Task]) -> Vec<Release> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.pending == 0 {
            return Vec::new();
        }
        take(&mut s, tasks)
    }
}

fn span(t: &Task) -> u64 {
    t.end - t.start
}

/// Whether `t` reads from a map (only those have page-table entries to release).
fn mapped(t: &Task) -> bool {
    t.mode == Mode::Mmap
}

/// The finished tasks after the prefix, each its own range (they are released again, at no cost, with the
/// prefix's window later). A task whose span overlaps a running one's (interleaved runs) is left to that
/// window.
fn alone(s: &mut State, tasks: &[Task]) -> Vec<Release> {
    let mut out = Vec::new();
    for j in s.prefix..tasks.len() {
        let t = &tasks[j];
        if s.done[j] != FINISHED || !mapped(t) {
            continue;
        }
        s.done[j] = RELEASED_ALONE;
        let busy = tasks[s.prefix..]
            .iter()
            .zip(&s.done[s.prefix..])
            .take_while(|(u, _)| u.file < t.file || (u.file == t.file && u.start < t.end))
            .any(|(u, &state)| {
                state == RUNNING && mapped(u) && u.file == t.file && t.start < u.end
            });
        if !busy {
            out.push(Release {
                file: t.file,
                start: t.start,
                end: t.end,
            });
        }
    }
    s.ahead = 0;
    out
}

/// The ranges of mapped tasks `from..prefix`, one per file: from the first task's start to the furthest end,
/// but not past the start of the first unfinished task of the same file (a running task's pages stay
/// mapped; spans of one file may overlap when runs interleave).
fn take(s: &mut State, tasks: &[Task]) -> Vec<Release> {
    let mut out: Vec<Release> = Vec::new();
    for t in tasks[s.from..s.prefix].iter().filter(|t| mapped(t)) {
        match out.last_mut() {
            Some(r) if r.file == t.file => r.end = r.end.max(t.end),
            _ => out.push(Release {
                file: t.file,
                start: t.start,
                end: t.end,
            }),
        }
    }
    if let (Some(first), Some((file, end))) = (out.first_mut(), s.reach) {
        if first.file == file {
            first.end = first.end.max(end);
        }
    }
    if let Some(last) = out.last_mut() {
        s.reach = Some((last.file, last.end));
        if let Some(next) = tasks.get(s.prefix).filter(|n| n.file == last.file) {
            last.end = last.end.min(next.start);
        }
    }
    out.retain(|r| r.end > r.start);
    s.from = s.prefix;
    s.pending = 0;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(file: usize, start: u64, end: u64, mode: Mode) -> Task {
        Task {
            file,
            mode,
            first: 0,
            last: 0,
            start,
            end,
        }
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn releases_whole_windows_of_a_finished_prefix_one_range_per_file() {
        // 64 tasks of 8 MiB over two files: a window of 32 MiB (512 MiB / 16).
        let tasks: Vec<Task> = (0..64)
            .map(|i| {
                task(
                    i / 32,
                    (i % 32) as u64 * 8 * MIB,
                    ((i % 32) as u64 + 1) * 8 * MIB,
                    Mode::Mmap,
                )
            })
            .collect();
        let r = Releases::new(&tasks);
        assert_eq!(r.window(), 32 * MIB);
        // Task 1 finishes before task 0: nothing is a prefix yet.
        assert!(r.finished(1, &tasks).is_empty());
        assert!(r.finished(0, &tasks).is_empty()); // 16 MiB finished
        assert!(r.finished(2, &tasks).is_empty()); // 24 MiB
        let got = r.finished(3, &tasks); // 32 MiB: one range, up to where task 4 (running) starts
        assert_eq!(
            got,
            vec![Release {
                file: 0,
                start: 0,
                end: 32 * MIB
            }]
        );
        let mut all = got;
        for i in 4..64 {
            all.extend(r.finished(i, &tasks));
        }
        all.extend(r.rest(&tasks));
        // Every byte of both files released exactly once, in 16 calls rather than 64.
        assert_eq!(all.len(), 16);
        for file in 0..2 {
            let mut ranges: Vec<(u64, u64)> = all
                .iter()
                .filter(|x| x.file == file)
                .map(|x| (x.start, x.end))
                .collect();
            ranges.sort_unstable();
            let mut at = 0;
            for (a, b) in ranges {
                assert_eq!(a, at);
                at = b;
            }
            assert_eq!(at, 256 * MIB);
        }
        assert!(r.rest(&tasks).is_empty());
    }

    #[test]
    fn never_releases_past_a_running_task_of_the_same_file() {
        // A long repeated run's task (0..100 MiB) then a task inside its span: when the first is finished and
        // the second still runs, the release stops where the second starts. Window: 116 MiB / 16.
        let tasks = vec![
            task(0, 0, 100 * MIB, Mode::Mmap),
            task(0, 40 * MIB, 48 * MIB, Mode::Mmap),
            task(0, 100 * MIB, 108 * MIB, Mode::Mmap),
        ];
        let r = Releases::new(&tasks);
        assert_eq!(r.window(), 116 * MIB / 16);
        assert_eq!(
            r.finished(0, &tasks),
            vec![Release {
                file: 0,
                start: 0,
                end: 40 * MIB
            }]
        );
        assert!(r.finished(2, &tasks).is_empty()); // beyond the running task 1: under two windows
                                                   // The inner task finished: released from its start to the furthest end of the finished tasks.
        assert_eq!(
            r.finished(1, &tasks),
            vec![Release {
                file: 0,
                start: 40 * MIB,
                end: 108 * MIB
            }]
        );
    }

    #[test]
    fn tasks_finished_beyond_a_stalled_task_are_released_alone_after_two_windows() {
        // 40 tasks of 8 MiB: window 20 MiB (320 MiB / 16). Task 0 stalls; tasks 1..=5 finish (40 MiB = 2
        // windows): released one by one, and the prefix's later window still covers them.
        let tasks: Vec<Task> = (0..40)
            .map(|i| task(0, i * 8 * MIB, (i + 1) * 8 * MIB, Mode::Mmap))
            .collect();
        let r = Releases::new(&tasks);
        assert_eq!(r.window(), 20 * MIB);
        for i in 1..5 {
            assert!(r.finished(i, &tasks).is_empty(), "task {i}");
        }
        let alone = r.finished(5, &tasks);
        assert_eq!(alone.len(), 5);
        for i in 6..10 {
            assert!(r.finished(i, &tasks).is_empty(), "task {i}");
        }
        assert_eq!(r.finished(10, &tasks).len(), 5); // tasks 6..=10: the next two windows
        assert!(alone
            .iter()
            .all(|x| x.end - x.start == 8 * MIB && x.start >= 8 * MIB));
        // The stalled task finishes: the prefix 0..=10 is one window, released up to task 11's start.
        assert_eq!(
            r.finished(0, &tasks),
            vec![Release {
                file: 0,
                start: 0,
                end: 88 * MIB
            }]
        );
    }

    #[test]
    fn positioned_read_tasks_are_never_released_nor_waited_for() {
        // Mapped spans 16 MiB: a window of the 1 MiB floor, so each mapped task is released as it finishes.
        let tasks = vec![
            task(0, 0, 8 * MIB, Mode::PreadBuffered),
            task(1, 0, 8 * MIB, Mode::Mmap),
            task(1, 8 * MIB, 16 * MIB, Mode::Mmap),
        ];
        let r = Releases::new(&tasks);
        assert_eq!(r.window(), RELEASE_WINDOW_MIN);
        let one = |start, end| {
            vec![Release {
                file: 1,
                start,
                end,
            }]
        };
        assert_eq!(r.finished(1, &tasks), one(0, 8 * MIB));
        assert_eq!(r.finished(2, &tasks), one(8 * MIB, 16 * MIB));
        assert!(r.rest(&tasks).is_empty());
    }

    proptest::proptest! {
        /// Whatever order the tasks finish in, every byte of every mapped task is released by the end (by a
        /// window, alone, or by `rest`), and no release covers a byte of a task still running.
        #[test]
        fn every_mapped_byte_is_released_once_its_task_is_done(
            sizes in proptest::collection::vec((0usize..3, 1u64..40, proptest::bool::ANY), 1..60),
            seed in 0u64..1000,
        ) {
            let mut tasks = Vec::new();
            let mut at = [0u64; 3];
            let mut files: Vec<usize> = sizes.iter().map(|s| s.0).collect();
            files.sort_unstable();
            // Within a file, starts rise but spans may overlap (interleaved runs): each task starts somewhere in
            // the previous one's span or right after it.
            for (n, (&file, &(_, mib, mapped))) in files.iter().zip(&sizes).enumerate() {
                let mode = if mapped { Mode::Mmap } else { Mode::PreadBuffered };
                let start = at[file];
                tasks.push(task(file, start, start + mib * MIB, mode));
                at[file] = start + ((mib * MIB) >> (n % 3));
            }
            let r = Releases::new(&tasks);
            let mut order: Vec<usize> = (0..tasks.len()).filter(|&i| tasks[i].mode == Mode::Mmap).collect();
            let mut x = seed;
            for i in (1..order.len()).rev() {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (x >> 33) as usize % (i + 1));
            }
            let mut done = vec![false; tasks.len()];
            let mut released: Vec<Release> = Vec::new();
            for &i in &order {
                done[i] = true;
                for rel in r.finished(i, &tasks) {
                    for (j, t) in tasks.iter().enumerate() {
                        let overlaps = t.file == rel.file && t.start < rel.end && rel.start < t.end;
                        proptest::prop_assert!(done[j] || !overlaps || t.mode != Mode::Mmap, "{rel:?} over running {j}");
                    }
                    released.push(rel);
                }
            }
            released.extend(r.rest(&tasks));
            for t in tasks.iter().filter(|t| t.mode == Mode::Mmap) {
                let mut covered = t.start;
                let mut ranges: Vec<&Release> = released.iter().filter(|x| x.file == t.file).collect();
                ranges.sort_by_key(|x| x.start);
                for x in ranges {
                    if x.start <= covered && x.end > covered {
                        covered = x.end;
                    }
                }
                proptest::prop_assert!(covered >= t.end, "task {:?}..{:?} of file {} released to {covered}", t.start, t.end, t.file);
            }
        }
    }
}
