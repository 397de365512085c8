//! One ranged GET into its [`Sink`]: the bytes of a request, as they arrive, into staging memory or straight
//! into the destinations of direct runs, with the retries of transient failures.

use super::*;

/// Where the bytes of one request go, as they arrive: the parts inside `staged` (absolute, sorted,
/// disjoint, within the request) into `staging` (the request's own slice of its object's staging memory,
/// from the request's first byte; empty when nothing of the request is staged), and the parts inside the
/// `direct` segments (indices into `segments`, sorted by start) straight into their destinations.
pub(super) struct Sink<'a> {
    pub(super) start: u64,
    pub(super) staging: &'a mut [u8],
    pub(super) staged: Vec<Range<u64>>,
    pub(super) direct: Vec<usize>,
    pub(super) segments: &'a [Segment],
    pub(super) runs: &'a [Run],
    /// First staged range / direct segment that may still meet the bytes to come (bodies arrive in order).
    pub(super) cursor: (usize, usize),
}

impl<'a> Sink<'a> {
    /// A sink that keeps every byte of the request from object offset `start` in `out` (its length).
    pub(super) fn buffer(start: u64, out: &'a mut [u8]) -> Sink<'a> {
        Sink {
            start,
            staged: std::iter::once(start..start + out.len() as u64).collect(),
            staging: out,
            direct: Vec::new(),
            segments: &[],
            runs: &[],
            cursor: (0, 0),
        }
    }

    /// The request's body starts again (a retry).
    pub(super) fn restart(&mut self) {
        self.cursor = (0, 0);
    }

    /// Places `bytes`, the object's bytes from offset `at` (after every earlier byte of the request).
    pub(super) fn put(&mut self, at: u64, bytes: &[u8]) {
        let end = at + bytes.len() as u64;
        let part = |lo: u64, hi: u64| &bytes[(lo - at) as usize..(hi - at) as usize];
        while self.staged.get(self.cursor.0).is_some_and(|r| r.end <= at) {
            self.cursor.0 += 1;
        }
        for r in self.staged[self.cursor.0..]
            .iter()
            .take_while(|r| r.start < end)
        {
            let (lo, hi) = (r.start.max(at), r.end.min(end));
            if lo < hi {
                self.staging[(lo - self.start) as usize..(hi - self.start) as usize]
                    .copy_from_slice(part(lo, hi));
            }
        }
        // Segments are sorted by start; every segment before the cursor ended at or before an earlier
        // `at` (overlapping segments, one source range read into two destinations, are each written).
        while self
            .direct
            .get(self.cursor.1)
            .is_some_and(|&k| self.segments[k].end <= at)
        {
            self.cursor.1 += 1;
        }
        for &k in &self.direct[self.cursor.1..] {
            let s = self.segments[k];
            if s.start >= end {
                break;
            }
            let (lo, hi) = (s.start.max(at), s.end.min(end));
            if lo < hi {
                write_direct(
                    &self.runs[s.run],
                    s.rep,
                    (lo - s.start) as usize,
                    part(lo, hi),
                );
            }
        }
    }
}

/// Fetches `range` of an object into `sink`, retrying transient failures.
pub(super) async fn fetch_into(
    store: &dyn ObjectStore,
    f: &ObjectFile,
    range: Range<u64>,
    sink: &mut Sink<'_>,
    settings: &Settings,
) -> Result<(), LoadError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        sink.restart();
        match fetch_once(store, f, range.clone(), sink).await {
            Ok(()) => return Ok(()),
            Err(e) if transient(&e) && attempt < settings.attempts => {
                RETRIES.fetch_add(1, Ordering::Relaxed);
                let wait =
                    Duration::from_millis(100 << (attempt - 1).min(4)).min(Duration::from_secs(2));
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e),
        }
    }
}

pub(super) async fn fetch_once(
    store: &dyn ObjectStore,
    f: &ObjectFile,
    range: Range<u64>,
    sink: &mut Sink<'_>,
) -> Result<(), LoadError> {
    let failed = |e| object_error(&f.bucket, &f.key, "ranged GET failed", e);
    let len = range.end - range.start;
    let options = GetOptions {
        range: Some(GetRange::Bounded(range.clone())),
        if_match: f.e_tag.clone(),
        ..GetOptions::default()
    };
    let got = store
        .get_opts(&Key::from(f.key.as_str()), options)
        .await
        .map_err(|e| match e {
            object_store::Error::Precondition { .. } => LoadError::Changed {
                path: object_path(f),
            },
            e => failed(e),
        })?;
    if got.meta.size != f.size || (f.e_tag.is_some() && got.meta.e_tag != f.e_tag) {
        return Err(LoadError::Changed {
            path: object_path(f),
        });
    }
    let mut stream = got.into_stream();
    let mut at = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(failed)?;
        let end = at + chunk.len() as u64;
        if end > len {
            return Err(LoadError::Object {
                bucket: f.bucket.clone(),
                key: f.key.clone(),
                status: None,
                reason: format!("range {range:?}: the server sent more than {len} bytes"),
            });
        }
        sink.put(range.start + at, &chunk);
        at = end;
    }
    FETCHED.fetch_add(at, Ordering::Relaxed);
    if at != len {
        return Err(LoadError::Object {
            bucket: f.bucket.clone(),
            key: f.key.clone(),
            status: None,
            reason: format!("range {range:?}: the body ended after {at} of {len} bytes"),
        });
    }
    REQUESTS.fetch_add(1, Ordering::Relaxed);
    Ok(())
}
