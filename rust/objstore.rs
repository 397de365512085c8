//! Object storage (feature `s3`): safetensors files in S3-compatible stores, read with ranged GETs.
//!
//! An object `s3://bucket/key` is a file of the engine whose bytes come from the network instead of a map
//! or `pread`: [`open_headers`] fetches each object's 8-byte length and then its header (two ranged GETs,
//! objects in parallel) and parses it like a file's, remembering the object's ETag and size
//! ([`ObjectFile`]); [`execute`] validates a batch exactly as for files, then fetches the byte ranges its
//! items need (coalesced across gaps that add at most 1/32 of the bytes, cut at the multiples of
//! [`Settings::piece`] bytes, [`Settings::concurrency`] requests in flight). The bytes of plain copies (same
//! dtype, adjacent elements, no scale) go straight into their destinations as they arrive
//! ([`Settings::direct`]); the others (casts, dequantization, scale rows) into `Staging` memory at their
//! file offsets, copied once every request has succeeded with the executor's mapped path
//! (`crate::exec::execute_staged`). With `HP_FASTLOAD_S3_DIRECT=0` every byte is staged, and a failed fetch
//! leaves every destination untouched.
//!
//! Every request after the first names the ETag it expects (`If-Match`), so an object replaced during a
//! load is [`LoadError::Changed`], never a mix of two objects. Failures carry bucket, key and HTTP status
//! ([`LoadError::Object`]); transient ones (5xx, 429, connection resets, timeouts, bodies cut short) are
//! retried per piece with bounded exponential backoff, on top of the client's own retries, within a bounded
//! time. Credentials, region and endpoint come from the standard `AWS_*` variables (`AWS_ENDPOINT_URL`,
//! `AWS_ACCESS_KEY_ID`, ...; object_store's `AmazonS3Builder::from_env`); an `http://` endpoint is allowed
//! without `AWS_ALLOW_HTTP`. One client (a tokio runtime and its connection pools) is kept per process and
//! configuration, made again after `fork` (`Client::shared`). Process-wide counters ([`counters`]) say
//! what was fetched.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, RetryConfig,
};

use crate::dest::{write_direct, DestBuf};
use crate::error::LoadError;
use crate::exec::{execute_staged, ExecOptions, ExecStats, Interrupt, Scale, INTERRUPT_POLL};
use crate::header::Header;
use crate::mmap::{Mapping, Staging};
use crate::types::{Item, Run};

mod client;
mod fetch;
mod ranges;

use client::{object_error, transient, Client};
use fetch::{fetch_into, Sink};
pub use ranges::{coalesce, coalesce_all};
use ranges::{merged, route, segments_of, Segment};

/// One object's identity when its header was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectFile {
    /// `s3://bucket/key`.
    pub url: String,
    /// The bucket.
    pub bucket: String,
    /// The key.
    pub key: String,
    /// The ETag the server gave (None when it gave none: then nothing checks that the object is unchanged).
    pub e_tag: Option<String>,
    /// The object's size in bytes.
    pub size: u64,
}

/// Knobs read from the environment once per call (`HP_FASTLOAD_S3_*`), with defaults.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Requests in flight per call (`HP_FASTLOAD_S3_CONCURRENCY`, default 32).
    pub concurrency: usize,
    /// Largest ranged GET, bytes (`HP_FASTLOAD_S3_PIECE_MB`, default 8 MiB).
    pub piece: u64,
    /// Attempts per piece for transient failures (`HP_FASTLOAD_S3_ATTEMPTS`, default 4).
    pub attempts: u32,
    /// Seconds one request may take, connect included (`HP_FASTLOAD_S3_TIMEOUT`, default 60).
    pub timeout: Duration,
    /// Plain byte copies (same dtype, adjacent elements, no scale) are written straight from the fetched
    /// bytes into their destinations (`HP_FASTLOAD_S3_DIRECT`, default on; `0` stages every byte first, so a
    /// failed fetch leaves every destination untouched).
    pub direct: bool,
}

impl Settings {
    /// The settings of the current environment.
    pub fn from_env() -> Settings {
        let get = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&v| v > 0)
                .unwrap_or(default)
        };
        Settings {
            concurrency: get("HP_FASTLOAD_S3_CONCURRENCY", 32) as usize,
            piece: get("HP_FASTLOAD_S3_PIECE_MB", 8) << 20,
            attempts: get("HP_FASTLOAD_S3_ATTEMPTS", 4) as u32,
            timeout: Duration::from_secs(get("HP_FASTLOAD_S3_TIMEOUT", 60)),
            direct: std::env::var("HP_FASTLOAD_S3_DIRECT").map_or(true, |v| v.trim() != "0"),
        }
    }
}

/// Ranges closer than this are fetched as one request when the call's gap budget allows ([`coalesce_all`]).
pub const COALESCE_GAP: u64 = 1 << 20;
/// A call fetches at most `1 + 1/COALESCE_SLACK` times the bytes its ranges need ([`coalesce_all`]).
pub const COALESCE_SLACK: u64 = 32;

static FETCHED: AtomicU64 = AtomicU64::new(0);
static REQUESTS: AtomicU64 = AtomicU64::new(0);
static RETRIES: AtomicU64 = AtomicU64::new(0);

/// Process-wide totals since start (or the last [`reset_counters`]): bytes fetched, GET requests that
/// succeeded, and retries after transient failures.
pub fn counters() -> (u64, u64, u64) {
    (
        FETCHED.load(Ordering::Relaxed),
        REQUESTS.load(Ordering::Relaxed),
        RETRIES.load(Ordering::Relaxed),
    )
}

/// The [`counters`], then (`reset`) set to zero.
pub fn counters_then(reset: bool) -> (u64, u64, u64) {
    let c = counters();
    if reset {
        reset_counters();
    }
    c
}

/// Sets the [`counters`] to zero.
pub fn reset_counters() {
    for c in [&FETCHED, &REQUESTS, &RETRIES] {
        c.store(0, Ordering::Relaxed);
    }
}

/// `(bucket, key)` of `s3://bucket/key` (also `s3a://`); a request error for anything else.
pub fn split_url(url: &str) -> Result<(String, String), LoadError> {
    let rest = url
        .strip_prefix("s3://")
        .or_else(|| url.strip_prefix("s3a://"))
        .ok_or_else(|| LoadError::request(format!("'{url}' is not an s3:// URL")))?;
    match rest.split_once('/') {
        Some((bucket, key)) if !bucket.is_empty() && !key.is_empty() => {
            Ok((bucket.to_string(), key.to_string()))
        }
        _ => Err(LoadError::request(format!(
            "'{url}' does not name an object (expected s3://bucket/key)"
        ))),
    }
}

fn object_path(f: &ObjectFile) -> PathBuf {
    PathBuf::from(&f.url)
}

/// The first `n <= 8` bytes and the object's identity (one ranged GET, retried like any piece).
async fn fetch_head(
    store: &dyn ObjectStore,
    bucket: &str,
    key: &str,
    url: &str,
    settings: &Settings,
) -> Result<(Vec<u8>, ObjectFile), LoadError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let got = store
            .get_opts(
                &Key::from(key),
                GetOptions {
                    range: Some(GetRange::Bounded(0..8)),
                    ..GetOptions::default()
                },
            )
            .await;
        let result = match got {
            Ok(got) => {
                let meta = got.meta.clone();
                match got.bytes().await {
                    Ok(bytes) => Ok((bytes.to_vec(), meta)),
                    Err(e) => Err(object_error(
                        bucket,
                        key,
                        "GET of the length prefix failed",
                        e,
                    )),
                }
            }
            // An empty object has no byte 0: a 416 for the range.
            Err(e) => Err(object_error(
                bucket,
                key,
                "GET of the length prefix failed",
                e,
            )),
        };
        match result {
            Ok((bytes, meta)) => {
                FETCHED.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                REQUESTS.fetch_add(1, Ordering::Relaxed);
                let f = ObjectFile {
                    url: url.to_string(),
                    bucket: bucket.to_string(),
                    key: key.to_string(),
                    e_tag: meta.e_tag,
                    size: meta.size,
                };
                return Ok((bytes, f));
            }
            Err(e) if transient(&e) && attempt < settings.attempts => {
                RETRIES.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100 << (attempt - 1).min(4))).await;
            }
            Err(e) => return Err(e),
        }
    }
}

async fn open_one(
    store: Arc<dyn ObjectStore>,
    bucket: String,
    key: String,
    url: String,
    settings: &Settings,
) -> Result<(Header, ObjectFile), LoadError> {
    let path = PathBuf::from(&url);
    let (prefix, f) = fetch_head(store.as_ref(), &bucket, &key, &url, settings).await?;
    if prefix.len() < 8 || f.size < 8 {
        return Err(LoadError::header(
            &path,
            format!(
                "object has {} bytes, fewer than the 8-byte length prefix",
                f.size
            ),
        ));
    }
    let n = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
    if n > f.size - 8 {
        return Err(LoadError::header(
            &path,
            format!(
                "header length {n} exceeds the object's {} bytes after the length prefix",
                f.size - 8
            ),
        ));
    }
    if n > crate::header::MAX_HEADER_LEN {
        return Err(LoadError::header(
            &path,
            format!(
                "header length {n} is over the limit of {} bytes",
                crate::header::MAX_HEADER_LEN
            ),
        ));
    }
    let mut buf = vec![0u8; 8 + n as usize];
    buf[..8].copy_from_slice(&prefix[..8]);
    fetch_into(
        store.as_ref(),
        &f,
        8..8 + n,
        &mut Sink::buffer(8, &mut buf[8..]),
        settings,
    )
    .await?;
    let header = Header::parse(&path, &buf, f.size)?;
    Ok((header, f))
}

/// Fetches and parses the header of each `s3://bucket/key` (all at once); the first error in `urls` order.
pub fn open_headers(urls: &[String]) -> Result<Vec<(Header, ObjectFile)>, LoadError> {
    let client = Client::shared()?;
    let mut jobs = Vec::with_capacity(urls.len());
    for url in urls {
        let (bucket, key) = split_url(url)?;
        jobs.push((client.store(&bucket)?, bucket, key, url.clone()));
    }
    let settings = client.settings.clone();
    let concurrency = settings.concurrency;
    client.rt.block_on(async {
        let opened: Vec<Result<(Header, ObjectFile), LoadError>> = futures::stream::iter(
            jobs.into_iter()
                .map(|(store, bucket, key, url)| open_one(store, bucket, key, url, &settings)),
        )
        .buffered(concurrency)
        .collect()
        .await;
        opened.into_iter().collect()
    })
}

/// The whole object at `url` (an index or `config.json`), or None when there is no such object.
pub fn read_object(url: &str) -> Result<Option<Vec<u8>>, LoadError> {
    let (bucket, key) = split_url(url)?;
    let client = Client::shared()?;
    let store = client.store(&bucket)?;
    let attempts = client.settings.attempts;
    client.rt.block_on(async {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let got = match store.get(&Key::from(key.as_str())).await {
                Ok(got) => got.bytes().await,
                Err(e) => Err(e),
            };
            match got {
                Ok(bytes) => {
                    FETCHED.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                    REQUESTS.fetch_add(1, Ordering::Relaxed);
                    return Ok(Some(bytes.to_vec()));
                }
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => {
                    let e = object_error(&bucket, &key, "GET failed", e);
                    if !(transient(&e) && attempt < attempts) {
                        return Err(e);
                    }
                    RETRIES.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(100 << (attempt - 1).min(4))).await;
                }
            }
        }
    })
}

/// The keys under `prefix/` (one level: no deeper keys), sorted: a checkpoint "directory" without an index.
pub fn list_keys(bucket_url: &str) -> Result<Vec<String>, LoadError> {
    let (bucket, prefix) = split_url(bucket_url)?;
    let client = Client::shared()?;
    let store = client.store(&bucket)?;
    client.rt.block_on(async {
        let listed = store
            .list_with_delimiter(Some(&Key::from(prefix.as_str())))
            .await
            .map_err(|e| object_error(&bucket, &prefix, "LIST failed", e))?;
        let mut keys: Vec<String> = listed
            .objects
            .into_iter()
            .map(|m| m.location.to_string())
            .collect();
        keys.sort();
        Ok(keys)
    })
}

/// Fetches, all files' requests in flight together, `needed[f]` of each object file `f` into staging
/// memory (returned as one map per file that has any) and the bytes of the `direct` runs straight into
/// their destinations.
fn stage(
    objects: &[Option<ObjectFile>],
    needed: &[Vec<(u64, u64)>],
    direct: &[Run],
    interrupt: Option<&Interrupt>,
) -> Result<Vec<Option<Arc<Mapping>>>, LoadError> {
    let client = Client::shared()?;
    let settings = client.settings.clone();
    let staged: Vec<Vec<Range<u64>>> = needed.iter().map(|r| merged(r)).collect();
    let segments = segments_of(direct, objects.len());
    // What each object's requests cover: its staged ranges and its direct segments.
    let wanted: Vec<Vec<(u64, u64)>> = objects
        .iter()
        .enumerate()
        .map(|(f, obj)| match obj {
            None => Vec::new(),
            Some(_) => {
                let mut all: Vec<(u64, u64)> = staged[f].iter().map(|r| (r.start, r.end)).collect();
                all.extend(segments[f].iter().map(|s| (s.start, s.end)));
                merged(&all).into_iter().map(|r| (r.start, r.end)).collect()
            }
        })
        .collect();
    let requests = coalesce_all(&wanted, settings.piece);
    let mut stagings: Vec<Option<Staging>> = Vec::with_capacity(objects.len());
    let mut stores: Vec<Option<Arc<dyn ObjectStore>>> = Vec::with_capacity(objects.len());
    for (f, obj) in objects.iter().enumerate() {
        match obj {
            Some(f_obj) if !requests[f].is_empty() => {
                if let Some(last) = requests[f].last() {
                    if last.end > f_obj.size {
                        return Err(LoadError::Truncated {
                            path: object_path(f_obj),
                            expected: last.end,
                            actual: f_obj.size,
                        });
                    }
                }
                stagings.push(match staged[f].is_empty() {
                    true => None,
                    false => Some(Staging::new(f_obj.size, &object_path(f_obj))?),
                });
                stores.push(Some(client.store(&f_obj.bucket)?));
            }
            _ => {
                stagings.push(None);
                stores.push(None);
            }
        }
    }
    // Carve each staging buffer into the disjoint slices its sorted requests fill; route each request's
    // bytes to its staged parts and its direct segments.
    let mut jobs = Vec::new();
    for (f, staging) in stagings.iter_mut().enumerate() {
        let (Some(obj), Some(store)) = (objects[f].as_ref(), stores[f].as_ref()) else {
            continue;
        };
        let routes = route(&requests[f], &staged[f], &segments[f]);
        let mut rest: &mut [u8] = match staging {
            Some(s) => s.bytes_mut(),
            None => &mut [],
        };
        let mut base = 0u64;
        for (r, (staged, segs)) in requests[f].iter().zip(routes) {
            let piece: &mut [u8] = if staged.is_empty() {
                &mut []
            } else {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut((r.start - base) as usize);
                let (piece, tail) = tail.split_at_mut((r.end - r.start) as usize);
                rest = tail;
                base = r.end;
                piece
            };
            let sink = Sink {
                start: r.start,
                staging: piece,
                staged,
                direct: segs,
                segments: &segments[f],
                runs: direct,
                cursor: (0, 0),
            };
            jobs.push((store.as_ref(), obj, r.clone(), sink));
        }
    }
    let concurrency = settings.concurrency;
    let requests = jobs.len();
    let done = AtomicUsize::new(0);
    let (settings, counted) = (&settings, &done);
    client.rt.block_on(async {
        let fetches = futures::stream::iter(jobs.into_iter().map(
            |(store, obj, range, mut sink)| async move {
                fetch_into(store, obj, range, &mut sink, settings).await?;
                counted.fetch_add(1, Ordering::Relaxed);
                Ok::<(), LoadError>(())
            },
        ))
        .buffer_unordered(concurrency)
        .try_collect::<()>();
        // The interrupt is asked every INTERRUPT_POLL while requests are in flight; a yes drops them (their
        // connections close). Nothing has been written into any destination by the copy path yet; direct
        // runs may have been written in part.
        let stop = async {
            loop {
                tokio::time::sleep(INTERRUPT_POLL).await;
                if interrupt.is_some_and(Interrupt::check) {
                    return;
                }
            }
        };
        futures::pin_mut!(fetches, stop);
        match futures::future::select(fetches, stop).await {
            futures::future::Either::Left((fetched, _)) => fetched,
            futures::future::Either::Right(((), _)) => Err(LoadError::Interrupted {
                done: done.load(Ordering::Relaxed),
                tasks: requests,
            }),
        }
    })?;
    stagings
        .into_iter()
        .zip(objects)
        .map(|(s, obj)| match (s, obj) {
            (Some(s), Some(f)) => s.into_mapping(&object_path(f)).map(|m| Some(Arc::new(m))),
            _ => Ok(None),
        })
        .collect()
}

/// [`crate::execute_scaled`] where `objects[f]` is the object of `files[f]` (None: a local file, read as
/// usual). Validation first, then every needed range of every object is fetched, then copied: on error no
/// destination byte has been written. `bytes_read_from_files` counts the bytes fetched from the store plus
/// those read from local files.
pub fn execute(
    files: &[Arc<Header>],
    objects: &[Option<ObjectFile>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    let fetched = AtomicU64::new(0);
    let fetch = |needed: &[Vec<(u64, u64)>], direct: &[Run]| {
        let before = FETCHED.load(Ordering::Relaxed);
        let staged = stage(objects, needed, direct, opts.interrupt.as_ref());
        fetched.store(FETCHED.load(Ordering::Relaxed) - before, Ordering::Relaxed);
        staged
    };
    // Straight into the destinations unless turned off, or when the call also reads local files (their
    // runs are not the store's to fetch).
    let direct = Settings::from_env().direct && objects.iter().all(Option::is_some);
    let mut stats = execute_staged(files, dests, items, scales, opts, &fetch, direct)?;
    // The copy "read" the staged bytes from memory; what counts is what came over the network (plus, in a
    // call that mixes local files and objects, the copy's count, which then includes both).
    let fetched = fetched.load(Ordering::Relaxed);
    stats.bytes_read_from_files = match objects.iter().all(Option::is_some) {
        true => fetched,
        false => stats.bytes_read_from_files + fetched,
    };
    Ok(stats)
}

/// [`execute`] when some of `files` came from an object (`objects[i]` is `Some`), else the executor's read of
/// local files ([`crate::exec::execute_scaled`]).
pub fn execute_any(
    files: &[Arc<Header>],
    objects: &[Option<ObjectFile>],
    dests: &[DestBuf<'_>],
    items: &[Item],
    scales: &[Scale],
    opts: &ExecOptions,
) -> Result<ExecStats, LoadError> {
    match objects.iter().any(Option::is_some) {
        true => execute(files, objects, dests, items, scales, opts),
        false => crate::exec::execute_scaled(files, dests, items, scales, opts),
    }
}

/// The object identity of `url` now (a HEAD): for callers that cache headers keyed on ETag and size.
pub fn identity(url: &str) -> Result<ObjectFile, LoadError> {
    let (bucket, key) = split_url(url)?;
    let client = Client::shared()?;
    let store = client.store(&bucket)?;
    client.rt.block_on(async {
        let meta = store
            .head(&Key::from(key.as_str()))
            .await
            .map_err(|e| object_error(&bucket, &key, "HEAD failed", e))?;
        Ok(ObjectFile {
            url: url.to_string(),
            bucket: bucket.clone(),
            key: key.clone(),
            e_tag: meta.e_tag,
            size: meta.size,
        })
    })
}

#[cfg(test)]
mod tests;
