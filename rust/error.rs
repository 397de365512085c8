//! The crate's error type: every failure of header parsing, request validation and reading.
//!
//! Each variant carries the context a user needs to act on it (the file, the tensor, the numbers). The Python
//! binding maps variants onto Python exception classes; nothing here knows about Python.
//!
//! ```
//! use hp_fastload::LoadError;
//! let err = LoadError::Truncated { path: "a.safetensors".into(), expected: 100, actual: 10 };
//! assert!(err.to_string().contains("expected 100 bytes"));
//! ```

use std::io;
use std::path::{Path, PathBuf};

/// Everything that can go wrong between opening a safetensors file and the last byte written.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// An I/O error other than "not found" or "permission denied".
    #[error("{}: {message}", path.display())]
    Io {
        /// The file being opened or read.
        path: PathBuf,
        /// The kind of the underlying `std::io::Error`.
        kind: io::ErrorKind,
        /// The OS error number when there is one.
        errno: Option<i32>,
        /// The underlying error's message.
        message: String,
    },
    /// The file does not exist.
    #[error("{}: no such file or directory", path.display())]
    NotFound {
        /// The missing path.
        path: PathBuf,
    },
    /// The file exists but may not be opened for reading.
    #[error("{}: permission denied", path.display())]
    PermissionDenied {
        /// The unreadable path.
        path: PathBuf,
    },
    /// The file is not a valid safetensors file.
    #[error("{}: invalid safetensors header: {reason}", path.display())]
    Header {
        /// The file whose header was rejected.
        path: PathBuf,
        /// What rule the header broke, with the offending values.
        reason: String,
    },
    /// A read request is malformed: out of range, impossible cast, overlapping destinations.
    #[error("{}", request_message(path.as_deref(), tensor.as_deref(), reason))]
    Request {
        /// The file the request refers to, when known.
        path: Option<PathBuf>,
        /// The tensor the request refers to, when known.
        tensor: Option<String>,
        /// What is wrong, with the numbers.
        reason: String,
    },
    /// A request to object storage failed (`crate::objstore`): the object, the HTTP status when the server
    /// answered, and what went wrong. Transient failures are retried before this is raised.
    #[error("s3://{bucket}/{key}: {reason}{}", status.map(|s| format!(" (HTTP {s})")).unwrap_or_default())]
    Object {
        /// The bucket.
        bucket: String,
        /// The object's key.
        key: String,
        /// The HTTP status of the failed response, when there was one.
        status: Option<u16>,
        /// What failed, with the client's message.
        reason: String,
    },
    /// The file is shorter than its header says (for example it shrank after it was opened).
    #[error("{}: file is truncated: expected {expected} bytes but found {actual}", path.display())]
    Truncated {
        /// The file that is too short.
        path: PathBuf,
        /// The size the header (or the read) needs.
        expected: u64,
        /// The size actually found.
        actual: u64,
    },
    /// The path is not a regular file (a FIFO, socket or device): it is refused before it is opened for
    /// reading, since reading it could block forever or never end.
    #[error(
        "{}: is {kind}, not a regular file; safetensors files must be regular files",
        path.display()
    )]
    NotRegular {
        /// The refused path.
        path: PathBuf,
        /// What it is instead ("a FIFO", "a socket", ...).
        kind: &'static str,
    },
    /// The file was replaced or rewritten after its header was parsed.
    #[error(
        "{}: file changed since its header was read (inode, modification or status-change time differs)",
        path.display()
    )]
    Changed {
        /// The file that changed.
        path: PathBuf,
    },
    /// The call was stopped by its [`crate::exec::Interrupt`] (in Python: a signal such as SIGINT arrived):
    /// the workers stopped at their next task boundary. The destinations (writing: the files) may be
    /// partially written.
    #[error(
        "interrupted after {done} of {tasks} tasks; the destinations may be partially written"
    )]
    Interrupted {
        /// Tasks finished before the workers stopped.
        done: usize,
        /// Tasks of the call.
        tasks: usize,
    },
    /// A read worker panicked; the destinations may be partially written.
    #[error("a read worker panicked: {message}")]
    WorkerPanicked {
        /// The panic payload when it was a string.
        message: String,
    },
}

/// Most characters of a tensor name that an error message quotes; a longer name is cut (see [`Quoted`]).
pub const NAME_SHOWN: usize = 200;

/// A tensor name in an error message: quoted, control and format characters escaped, and cut to its first
/// [`NAME_SHOWN`] characters with its length when longer (a checkpoint may hold a 50 MB name; the message
/// should not).
///
/// ```
/// use hp_fastload::error::Quoted;
/// assert_eq!(Quoted("w").to_string(), "'w'");
/// assert_eq!(Quoted("a\u{1b}[2J\u{202e}b\0").to_string(), r"'a\u{1b}[2J\u{202e}b\0'");
/// let long = "k".repeat(1000);
/// assert!(Quoted(&long).to_string().ends_with("...' (1000 characters)"));
/// ```
pub struct Quoted<'a>(pub &'a str);

impl std::fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (shown, cut) = match self.0.char_indices().nth(NAME_SHOWN) {
            None => (self.0, false),
            Some((at, _)) => (&self.0[..at], true),
        };
        f.write_str("'")?;
        for c in shown.chars() {
            // Control and format characters (terminal escapes, NUL, bidi overrides) are escaped; printable
            // ones, quotes and backslashes included, are written as they are.
            if c.is_ascii_graphic() || c == ' ' || (!c.is_ascii() && c.escape_debug().len() == 1) {
                write!(f, "{c}")?;
            } else {
                write!(f, "{}", c.escape_debug())?;
            }
        }
        match cut {
            false => f.write_str("'"),
            true => write!(f, "...' ({} characters)", self.0.chars().count()),
        }
    }
}

fn request_message(path: Option<&Path>, tensor: Option<&str>, reason: &str) -> String {
    match (path, tensor) {
        (Some(p), Some(t)) => format!("{}: tensor {}: {reason}", p.display(), Quoted(t)),
        (Some(p), None) => format!("{}: {reason}", p.display()),
        (None, Some(t)) => format!("tensor {}: {reason}", Quoted(t)),
        (None, None) => reason.to_string(),
    }
}

impl LoadError {
    /// Wraps an I/O error with the path it happened on, picking the specific variant for
    /// "not found" and "permission denied".
    pub fn io(path: &Path, err: &io::Error) -> Self {
        let path = path.to_path_buf();
        match err.kind() {
            io::ErrorKind::NotFound => LoadError::NotFound { path },
            io::ErrorKind::PermissionDenied => LoadError::PermissionDenied { path },
            kind => LoadError::Io {
                path,
                kind,
                errno: err.raw_os_error(),
                message: lower_first(&err.to_string()),
            },
        }
    }

    /// A request error without file or tensor context.
    pub fn request(reason: impl Into<String>) -> Self {
        LoadError::Request {
            path: None,
            tensor: None,
            reason: reason.into(),
        }
    }

    /// A header error for `path`.
    pub fn header(path: &Path, reason: impl Into<String>) -> Self {
        LoadError::Header {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

fn lower_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_map_to_specific_variants() {
        let p = Path::new("/x/y.safetensors");
        let nf = io::Error::from(io::ErrorKind::NotFound);
        assert!(matches!(LoadError::io(p, &nf), LoadError::NotFound { .. }));
        let pd = io::Error::from_raw_os_error(libc::EACCES);
        let e = LoadError::io(p, &pd);
        assert!(matches!(e, LoadError::PermissionDenied { .. }));
        assert_eq!(e.to_string(), "/x/y.safetensors: permission denied");
        let other = io::Error::from_raw_os_error(libc::EISDIR);
        match LoadError::io(p, &other) {
            LoadError::Io { errno, message, .. } => {
                assert_eq!(errno, Some(libc::EISDIR));
                assert!(message.starts_with("is a directory"), "{message}");
            }
            e => panic!("unexpected {e:?}"),
        }
    }

    #[test]
    fn request_messages_name_context() {
        let e = LoadError::Request {
            path: Some("f.safetensors".into()),
            tensor: Some("w".into()),
            reason: "dim 1: offset 3 + length 4 exceeds size 5".into(),
        };
        assert_eq!(
            e.to_string(),
            "f.safetensors: tensor 'w': dim 1: offset 3 + length 4 exceeds size 5"
        );
        assert_eq!(LoadError::request("bad").to_string(), "bad");
    }
}
