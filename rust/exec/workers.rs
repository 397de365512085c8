//! Scoped worker threads: numbered tasks taken from an atomic counter (no pool outlives a call, so nothing
//! to re-create after `fork`), the first error kept, a worker panic turned into
//! [`LoadError::WorkerPanicked`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::LoadError;

/// Runs `work(i, buffer)` for every task `i` in `0..tasks` on `threads` scoped workers (the calling thread is
/// one of them; no pool outlives the call), each taking the next task until they run out or one fails, with a
/// scratch buffer of its own. Returns a worker's panic (as [`LoadError::WorkerPanicked`]) before the first
/// task error; after a failure the workers take no new task.
pub(super) fn run_workers(
    threads: usize,
    tasks: usize,
    work: impl Fn(usize, &mut Vec<u8>) -> Result<(), LoadError> + Sync,
) -> Result<(), LoadError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<LoadError>> = Mutex::new(None);
    let worker = || {
        let mut buf: Vec<u8> = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= tasks {
                break;
            }
            if let Err(e) = work(i, &mut buf) {
                failed.store(true, Ordering::Relaxed);
                first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert(e);
            }
        }
    };
    let guarded =
        || catch_unwind(AssertUnwindSafe(worker)).map_err(|payload| panic_error(payload.as_ref()));
    let mut panicked = None;
    std::thread::scope(|scope| {
        let helpers: Vec<_> = (1..threads)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .spawn_scoped(scope, guarded)
                    .ok()
            })
            .collect();
        if let Err(e) = guarded() {
            panicked.get_or_insert(e);
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
