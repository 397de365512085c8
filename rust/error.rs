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
    /// The file was replaced or rewritten after its header was parsed.
    #[error(
        "{}: file changed since its header was read (inode or modification time differs)",
        path.display()
    )]
    Changed {
        /// The file that changed.
        path: PathBuf,
    },
    /// A read worker panicked; the destinations may be partially written.
    #[error("a read worker panicked: {message}")]
    WorkerPanicked {
        /// The panic payload when it was a string.
        message: String,
    },
}

fn request_message(path: Option<&Path>, tensor: Option<&str>, reason: &str) -> String {
    match (path, tensor) {
        (Some(p), Some(t)) => format!("{}: tensor '{t}': {reason}", p.display()),
        (Some(p), None) => format!("{}: {reason}", p.display()),
        (None, Some(t)) => format!("tensor '{t}': {reason}"),
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
