//! The batch executor: validated runs → sorted, coalesced tasks → scoped worker threads.
//!
//! [`execute`] validates the whole batch ([`crate::runs::plan`]) before any thread starts, opens and
//! `fstat`s each file it needs (a file shorter than its header says is [`LoadError::Truncated`]; a
//! replaced or rewritten one is [`LoadError::Changed`]), picks a backend per file, splits large runs so
//! every thread gets work (a repeated run into groups of repetitions; `make_pieces` says when repetitions
//! become runs of their own), sorts them by (file, offset), groups them into tasks and runs the tasks on
//! `threads` scoped threads that take the next task from an atomic counter (no global pool, so nothing to
//! re-create after `fork`). A worker panic becomes [`LoadError::WorkerPanicked`].
//!
//! Interruption: with [`ExecOptions::interrupt`] set, the calling thread does not read; it coordinates,
//! asking the [`Interrupt`] every [`INTERRUPT_POLL`] whether to stop (the Python binding checks for a pending
//! signal there). When it says stop, every worker stops at its next task boundary, the call's descriptors and
//! fresh maps are dropped as it returns, and the call returns [`LoadError::Interrupted`]. The workers never
//! look at anything but one atomic flag.
//!
//! Backends: `mmap` copies from a read-only map of the file (the header's kept map when its file passes the
//! identity check, else a new one it then keeps); `pread` reads each task's byte span
//! into a per-thread buffer (reading through gaps of up to [`ExecOptions::pread_gap`] bytes) and then
//! scatters it, or, for a large same-dtype dense run, reads straight into the destination. `auto` uses
//! `mmap` for a file when at least [`AUTO_MMAP_RESIDENT`] of the pages it needs are in the page cache,
//! else `pread` (measured in docs/perf-notes.md).
//!
//! Layout: this module holds the entry points and their options; `read` runs the read direction (sources,
//! backends, the tasks on workers), `tasks` cuts runs into pieces and tasks, `scales` validates and reads
//! dequantization scales, `staged` is the hook of another byte source (object storage: the byte ranges a
//! batch needs, fetched before any copy), `write` runs the write direction ([`execute_write`]), `workers`
//! runs numbered tasks on scoped threads.

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::dest::DestBuf;
use crate::error::LoadError;
use crate::header::Header;
use crate::types::Item;

mod read;
mod release;
mod scales;
mod staged;
mod tasks;
#[cfg(test)]
mod testutil;
mod workers;
mod write;

pub use crate::threads::{default_threads, MAX_DEFAULT_THREADS};
pub use scales::Scale;
#[cfg(feature = "s3")]
pub(crate) use staged::{Fetch, Stage};
pub use write::execute_write;

/// Fraction of needed pages that must be cached for `auto` to pick `mmap`.
pub const AUTO_MMAP_RESIDENT: f64 = 0.9;
/// Worker threads per requested thread when some file is read with `pread` (waiting on storage).
pub const IO_THREAD_FACTOR: usize = 2;
/// Default [`ExecOptions::pread_gap`]: 64 KiB. A cold Shard(1) slice is read through its gaps anyway by the
/// kernel's read-ahead (the storage reads are the same either way, docs/perf-notes.md "pread gap"), and one
/// `pread` per span costs far fewer syscalls than one per ~1 KiB run. Every benchmark in docs/ ran with it.
pub const DEFAULT_PREAD_GAP: u64 = 64 * 1024;

/// How file bytes are fetched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// Per file: `Mmap` when the needed pages are cached, else `Pread`.
    #[default]
    Auto,
    /// Copy from a read-only memory map.
    Mmap,
    /// Positioned reads into a buffer or straight into the destination.
    Pread,
}

impl Backend {
    /// The backend's name (`"auto"`, `"mmap"`, `"pread"`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Mmap => "mmap",
            Backend::Pread => "pread",
        }
    }
}

impl FromStr for Backend {
    type Err = LoadError;
    fn from_str(s: &str) -> Result<Self, LoadError> {
        match s {
            "auto" => Ok(Backend::Auto),
            "mmap" => Ok(Backend::Mmap),
            "pread" => Ok(Backend::Pread),
            _ => Err(LoadError::request(format!(
                "unknown backend '{s}' (expected auto, mmap or pread)"
            ))),
        }
    }
}

/// How often the coordinating thread of a call with an [`Interrupt`] asks it whether to stop. A call shorter
/// than this never asks.
pub const INTERRUPT_POLL: Duration = Duration::from_millis(5);

/// Whether a running call should stop: asked by the call's coordinating thread (the thread that called
/// [`execute`]) every [`INTERRUPT_POLL`] while the workers run, never by a worker. Once it returns true the
/// call stops and returns [`LoadError::Interrupted`] even if every task finished meanwhile (the Python
/// binding has taken the signal's exception by then and must raise it).
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use hp_fastload::exec::Interrupt;
/// let flag = Arc::new(AtomicBool::new(false));
/// let stop = Interrupt::flag(Arc::clone(&flag));
/// assert!(!stop.check());
/// flag.store(true, Ordering::Relaxed);
/// assert!(stop.check());
/// ```
#[derive(Clone)]
pub struct Interrupt(Arc<dyn Fn() -> bool + Send + Sync>);

impl Interrupt {
    /// An interrupt that asks `check`.
    pub fn new(check: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Interrupt(Arc::new(check))
    }

    /// An interrupt that stops the call once `flag` is set (by another thread).
    pub fn flag(flag: Arc<AtomicBool>) -> Self {
        Interrupt::new(move || flag.load(Ordering::Relaxed))
    }

    /// Asks whether to stop.
    pub fn check(&self) -> bool {
        (self.0)()
    }
}

impl std::fmt::Debug for Interrupt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interrupt(..)")
    }
}

/// Knobs of one [`execute`] call.
#[derive(Clone, Debug)]
pub struct ExecOptions {
    /// Worker threads; `None` = available parallelism capped at [`MAX_DEFAULT_THREADS`]. When some file is
    /// read with `pread` (not cached), [`IO_THREAD_FACTOR`] times as many run (they wait on storage).
    pub threads: Option<usize>,
    /// Backend choice.
    pub backend: Backend,
    /// `pread` reads through gaps up to this many bytes between runs instead of issuing another read.
    pub pread_gap: u64,
    /// Asked every [`INTERRUPT_POLL`] by the calling thread (which then reads nothing itself) whether to
    /// stop; `None`: never stopped, the calling thread is one of the workers.
    pub interrupt: Option<Interrupt>,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            threads: None,
            backend: Backend::Auto,
            pread_gap: DEFAULT_PREAD_GAP,
            interrupt: None,
        }
    }
}

/// What an [`execute`] call did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Bytes written into destinations.
    pub bytes_copied: u64,
    /// Bytes taken from files (including gaps read through by `pread`).
    pub bytes_read_from_files: u64,
    /// 1-d runs after validation (each repetition of a repeated run counted; before splitting for
    /// parallelism).
    pub runs: usize,
    /// Tasks (coalesced spans) handed to the workers.
    pub spans: usize,
    /// `"mmap"`, `"pread"`, `"mixed"` or `"none"` (nothing to read).
    pub backend: &'static str,
    /// Threads used.
    pub threads: usize,
}

/// Reads every item into its destination. All items are validated first; on error nothing has been
/// written, except for I/O errors and truncation found while reading, after which the destinations may
/// be partially written.
pub fn execute(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    execute_scaled(files, dests, items, &[], opts)
}

/// Like [`execute`], with dequantization: an item whose [`Item::scale`] is `k > 0` multiplies each element
/// by its block's scale from `scales[k - 1]` (in `f32`) before the one rounding into the destination.
/// Scales and items are validated, then each scale's grid rows that the items touch are read (once per
/// call, `read_scale_cells`; counted in `bytes_read_from_files`), before any destination byte is written.
pub fn execute_scaled(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    read::execute_scaled_reading(files, dests, items, scales, opts, false, None)
}

/// [`execute_scaled`] over files whose bytes `stage` provides (object storage, `crate::objstore`; see
/// [`Stage`]): called once after validation, before the executor writes any destination byte; with
/// `direct`, the plain byte-copy runs are handed to it to be written straight into their destinations.
#[cfg(feature = "s3")]
pub(crate) fn execute_staged(
    files: &[Arc<Header>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
    fetch: Fetch<'_>,
    direct: bool,
) -> Result<ExecStats, LoadError> {
    let stage = Stage { fetch, direct };
    read::execute_scaled_reading(files, dests, items, scales, opts, false, Some(stage))
}
