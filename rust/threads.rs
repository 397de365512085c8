//! Thread counts: the default number of worker threads, shared by the executor and the key templater (a
//! leaf, so that neither reaches into the other for it).

/// Most threads used by default.
pub const MAX_DEFAULT_THREADS: usize = 16;

/// The default thread count: available parallelism capped at [`MAX_DEFAULT_THREADS`].
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_DEFAULT_THREADS)
}
