//! The object-store client: one per process and configuration (a tokio runtime and its connection pools,
//! made again after `fork`), and the errors of its requests ([`LoadError::Object`], which are transient).

use super::*;

/// A client: a runtime and one store (with its connection pool) per bucket. One is kept per process and
/// configuration ([`Client::shared`]).
pub(super) struct Client {
    pub(super) rt: tokio::runtime::Runtime,
    pub(super) stores: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
    pub(super) settings: Settings,
}

/// The process's client: the process id and the `AWS_*` / `HP_FASTLOAD_S3_*` variables it was made with.
pub(super) type SharedClient = (u32, Vec<(String, String)>, Arc<Client>);
pub(super) static SHARED: Mutex<Option<SharedClient>> = Mutex::new(None);

pub(super) fn install_crypto() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // Another provider installed first (by another library in the process) is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl Client {
    /// The client of this process for the current environment, made on first use. Kept between calls (a
    /// new client per call cost ~30 ms of wall time and ~10 ms of CPU each, four times per load: the
    /// runtime, the TLS roots, new connections; docs/perf-notes.md, "Object storage"); made again when an
    /// `AWS_*` or `HP_FASTLOAD_S3_*` variable changed, or in a forked child (whose copy of the parent's runtime
    /// has no threads: it is leaked, never dropped or used).
    pub(super) fn shared() -> Result<Arc<Client>, LoadError> {
        let mut config: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("AWS_") || k.starts_with("HP_FASTLOAD_S3_"))
            .collect();
        config.sort_unstable();
        let pid = std::process::id();
        let mut slot = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((p, c, client)) = slot.as_ref() {
            if *p == pid && *c == config {
                return Ok(Arc::clone(client));
            }
        }
        if let Some((p, _, old)) = slot.take() {
            if p != pid {
                std::mem::forget(old);
            }
        }
        let client = Arc::new(Client::new()?);
        *slot = Some((pid, config, Arc::clone(&client)));
        Ok(client)
    }

    pub(super) fn new() -> Result<Client, LoadError> {
        install_crypto();
        let settings = Settings::from_env();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hp_fastload-s3")
            .enable_all()
            .build()
            .map_err(|e| LoadError::request(format!("cannot start the S3 client runtime: {e}")))?;
        Ok(Client {
            rt,
            stores: Mutex::new(HashMap::new()),
            settings,
        })
    }

    pub(super) fn store(&self, bucket: &str) -> Result<Arc<dyn ObjectStore>, LoadError> {
        let mut stores = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = stores.get(bucket) {
            return Ok(Arc::clone(s));
        }
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
        let endpoint = std::env::var("AWS_ENDPOINT_URL_S3")
            .or_else(|_| std::env::var("AWS_ENDPOINT_URL"))
            .ok();
        let mut options = ClientOptions::new()
            .with_timeout(self.settings.timeout)
            .with_connect_timeout(Duration::from_secs(10))
            .with_pool_max_idle_per_host(self.settings.concurrency);
        if let Some(endpoint) = endpoint {
            options = options.with_allow_http(endpoint.starts_with("http://"));
            builder = builder.with_endpoint(endpoint);
        }
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: 2,
            retry_timeout: Duration::from_secs(20),
        };
        let store: Arc<dyn ObjectStore> = Arc::new(
            builder
                .with_client_options(options)
                .with_retry(retry)
                .build()
                .map_err(|e| object_error(bucket, "", "cannot configure the S3 client", e))?,
        );
        stores.insert(bucket.to_string(), Arc::clone(&store));
        Ok(store)
    }
}

/// The HTTP status inside an object_store error, when the server answered. object_store keeps its request
/// error type private, so the status is read from the message of the error chain ("status code: 503 ...").
pub(super) fn status_of(err: &object_store::Error) -> Option<u16> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        let text = e.to_string();
        if let Some(at) = text.find("status code: ") {
            let digits: String = text[at + 13..].chars().take(3).collect();
            if let Ok(s) = digits.parse::<u16>() {
                return Some(s);
            }
        }
        source = e.source();
    }
    match err {
        object_store::Error::NotFound { .. } => Some(404),
        object_store::Error::PermissionDenied { .. } => Some(403),
        object_store::Error::Unauthenticated { .. } => Some(401),
        object_store::Error::Precondition { .. } => Some(412),
        _ => None,
    }
}

pub(super) fn object_error(
    bucket: &str,
    key: &str,
    what: &str,
    err: object_store::Error,
) -> LoadError {
    let status = status_of(&err);
    let why = match &err {
        object_store::Error::NotFound { .. } => "no such object".to_string(),
        object_store::Error::PermissionDenied { .. } => "access denied".to_string(),
        object_store::Error::Unauthenticated { .. } => {
            "the credentials were refused (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
                .to_string()
        }
        _ => what.to_string(),
    };
    LoadError::Object {
        bucket: bucket.to_string(),
        key: key.to_string(),
        status,
        reason: format!("{why}: {}", short_message(&err.to_string())),
    }
}

/// The client's message without the XML error body the server sent, its `<Code>` kept.
pub(super) fn short_message(text: &str) -> String {
    let Some(at) = text.find("<?xml") else {
        return text.chars().take(500).collect();
    };
    let code = text
        .split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map(|(code, _)| format!(" {code}"))
        .unwrap_or_default();
    let head = text[..at].trim_end().trim_end_matches(':');
    format!("{head}{code}")
}

/// Whether a failed request may succeed when repeated: no answer (reset, timeout, refused), a 5xx, a 429,
/// or a body cut short. Not found, denied, bad credentials and a changed object are final.
pub(super) fn transient(err: &LoadError) -> bool {
    match err {
        LoadError::Object { status, .. } => match status {
            None => true,
            Some(s) => *s >= 500 || *s == 429 || *s == 408,
        },
        _ => false,
    }
}
