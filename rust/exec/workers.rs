//! Scoped worker threads: numbered tasks taken from an atomic counter (no pool outlives a call, so nothing
//! to re-create after `fork`), the first error kept, a worker panic turned into
//! [`LoadError::WorkerPanicked`], and, with an [`Interrupt`], the calling thread coordinating: it asks the
//! interrupt every [`INTERRUPT_POLL`] and, when told to stop, raises the one flag the workers check before
//! each task ([`LoadError::Interrupted`]). Helper threads block asynchronous signals, so that a SIGINT is
//! delivered to the calling thread rather than held until a worker's long read returns.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::{Interrupt, INTERRUPT_POLL};
use crate::error::LoadError;

/// Runs `work(i, buffer, stop)` for every task `i` in `0..tasks` on `threads` scoped workers, each taking the
/// next task until they run out or one fails, with a scratch buffer of its own; `stop` is set once the call
/// stops (a task error or an interrupt): optional work inside a task (read-ahead hints) looks at it. Without `interrupt` the calling
/// thread is one of the workers; with one it only coordinates (asking `interrupt` every [`INTERRUPT_POLL`],
/// woken early when the last worker exits). Returns [`LoadError::Interrupted`] once the interrupt said stop,
/// else a worker's panic (as [`LoadError::WorkerPanicked`]) before the first task error; after a failure or
/// an interrupt the workers take no new task.
pub(super) fn run_workers(
    threads: usize,
    tasks: usize,
    interrupt: Option<&Interrupt>,
    work: impl Fn(usize, &mut Vec<u8>, &AtomicBool) -> Result<(), LoadError> + Sync,
) -> Result<(), LoadError> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_error: Mutex<Option<LoadError>> = Mutex::new(None);
    let worker = || {
        let mut buf: Vec<u8> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= tasks {
                break;
            }
            match work(i, &mut buf, &stop) {
                Ok(()) => {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    first_error
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                }
            }
        }
    };
    let guarded =
        || catch_unwind(AssertUnwindSafe(worker)).map_err(|payload| panic_error(payload.as_ref()));
    // A coordinator only when there is more than one task to stop between.
    let interrupt = interrupt.filter(|_| tasks > 1);
    let coordinator = std::thread::current();
    let running = AtomicUsize::new(0);
    let mut panicked = None;
    let mut interrupted = false;
    std::thread::scope(|scope| {
        let helpers_wanted = match interrupt {
            Some(_) => threads.max(1),
            None => threads.saturating_sub(1),
        };
        running.store(helpers_wanted, Ordering::SeqCst);
        let helper = || {
            crate::mmap::block_async_signals(); // signals go to the calling thread (see the function)
            let outcome = guarded();
            running.fetch_sub(1, Ordering::SeqCst);
            coordinator.unpark();
            outcome
        };
        let mut helpers = Vec::with_capacity(helpers_wanted);
        for _ in 0..helpers_wanted {
            match std::thread::Builder::new().spawn_scoped(scope, helper) {
                Ok(h) => helpers.push(h),
                Err(_) => {
                    running.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        match interrupt {
            Some(check) if !helpers.is_empty() => {
                let mut asked = Instant::now();
                while running.load(Ordering::SeqCst) > 0 {
                    std::thread::park_timeout(INTERRUPT_POLL);
                    if asked.elapsed() >= INTERRUPT_POLL && running.load(Ordering::SeqCst) > 0 {
                        asked = Instant::now();
                        if check.check() {
                            interrupted = true;
                            stop.store(true, Ordering::Relaxed);
                            break;
                        }
                    }
                }
            }
            // No coordinator, or no helper could be started: the calling thread works.
            _ => {
                if let Err(e) = guarded() {
                    panicked.get_or_insert(e);
                }
            }
        }
        for h in helpers {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    panicked.get_or_insert(e);
                }
                Err(payload) => {
                    panicked.get_or_insert(panic_error(payload.as_ref()));
                }
            }
        }
    });
    if interrupted {
        return Err(LoadError::Interrupted {
            done: done.into_inner(),
            tasks,
        });
    }
    match panicked {
        Some(e) => Err(e),
        None => first_error
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .map_or(Ok(()), Err),
    }
}

fn panic_error(payload: &(dyn std::any::Any + Send)) -> LoadError {
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into());
    LoadError::WorkerPanicked { message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn slow_tasks(
        threads: usize,
        tasks: usize,
        interrupt: Option<&Interrupt>,
        ran: &AtomicUsize,
    ) -> Result<(), LoadError> {
        run_workers(threads, tasks, interrupt, |_, _, _| {
            std::thread::sleep(Duration::from_millis(1));
            ran.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }

    /// An interrupt that says stop 30 ms into a 1000-task call (about 0.5 s on two workers) stops it within
    /// a few polls: the call returns `Interrupted` counting the tasks that ran, and no task starts after it
    /// returned.
    #[test]
    fn an_interrupt_stops_the_workers_at_their_next_task() {
        let flag = Arc::new(AtomicBool::new(false));
        let interrupt = Interrupt::flag(Arc::clone(&flag));
        let ran = AtomicUsize::new(0);
        let start = Instant::now();
        let result = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                flag.store(true, Ordering::Relaxed);
            });
            slow_tasks(2, 1000, Some(&interrupt), &ran)
        });
        let took = start.elapsed();
        let ran = ran.into_inner();
        match result {
            Err(LoadError::Interrupted { done, tasks }) => {
                assert_eq!((done, tasks), (ran, 1000));
                assert!(done < 200, "{done} tasks ran");
            }
            other => panic!("{other:?}"),
        }
        assert!(took < Duration::from_millis(200), "{took:?}");
    }

    /// Without a stop the coordinated call runs every task once (one worker, several, more workers than
    /// tasks); an interrupt that says stop only after the last task finished is never asked.
    #[test]
    fn an_unfired_interrupt_changes_nothing() {
        let asked = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&asked);
        let interrupt = Interrupt::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
            false
        });
        for (threads, tasks) in [(1, 20), (3, 50), (8, 2), (2, 1), (2, 0)] {
            let ran = AtomicUsize::new(0);
            slow_tasks(threads, tasks, Some(&interrupt), &ran).unwrap();
            assert_eq!(ran.into_inner(), tasks, "{threads} threads");
        }
        assert!(asked.load(Ordering::Relaxed) > 0, "a 20 ms call polls");
        let before = asked.load(Ordering::Relaxed);
        let quick = AtomicUsize::new(0);
        run_workers(2, 4, Some(&interrupt), |_, _, _| {
            quick.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
        assert_eq!(quick.into_inner(), 4);
        assert_eq!(
            asked.load(Ordering::Relaxed),
            before,
            "a call under 5 ms never asks"
        );
    }

    /// A task error still stops the other workers and is returned when no interrupt fired.
    #[test]
    fn errors_win_over_an_unfired_interrupt() {
        let interrupt = Interrupt::new(|| false);
        let r = run_workers(2, 100, Some(&interrupt), |i, _, _| match i {
            7 => Err(LoadError::request("task 7")),
            _ => Ok(()),
        });
        assert!(matches!(r, Err(LoadError::Request { reason, .. }) if reason == "task 7"));
    }
}
