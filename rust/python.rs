//! The `hp_fastload._core` extension module: the only file that uses pyo3.
//!
//! It extracts arguments into plain Rust values while attached to the interpreter, then detaches (releases
//! the GIL) for header parsing, validation and reading, and maps [`LoadError`] onto the exception classes
//! of `hp_fastload.errors` (imported when an error is raised) and the builtin `OSError` family.
//!
//! Contract of `execute`: each destination triple `(address, nbytes, dtype code)` must describe memory that
//! stays valid and is not touched by anyone else until the call returns (the Python layer passes the
//! storages of live CPU tensors and keeps references to them).
//!
//! Signals: while `execute`'s workers run with the interpreter released, the calling thread attaches every
//! few milliseconds to run `PyErr_CheckSignals` ([`signal_interrupt`]); a handler that raises (SIGINT's
//! `KeyboardInterrupt`) stops the workers at their next task and `execute` raises that very exception once
//! they have stopped and the call's descriptors and maps are dropped.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{
    PyFileNotFoundError, PyKeyError, PyKeyboardInterrupt, PyOSError, PyPermissionError,
    PyRuntimeError,
};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{IntoPyDict, PyBytes, PyDict, PyList, PyString, PyTuple};

use crate::dtype::{Dtype, ALL_DTYPES};
use crate::error::LoadError;
use crate::exec::{Backend, ExecOptions, Interrupt};
use crate::header::{Header, WordHasher};
use crate::records;
use crate::types::MAX_NDIM;

fn raise(py: Python<'_>, class: &str, message: String) -> PyErr {
    let made = py
        .import("hp_fastload.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((message.clone(),)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(_) => PyRuntimeError::new_err(message),
    }
}

fn to_py(py: Python<'_>, err: LoadError) -> PyErr {
    let message = err.to_string();
    match err {
        LoadError::NotFound { path } => PyFileNotFoundError::new_err((
            libc::ENOENT,
            "no such file or directory",
            path.to_string_lossy().into_owned(),
        )),
        LoadError::PermissionDenied { path } => PyPermissionError::new_err((
            libc::EACCES,
            "permission denied",
            path.to_string_lossy().into_owned(),
        )),
        LoadError::Io {
            path,
            errno: Some(errno),
            message,
            ..
        } => PyOSError::new_err((errno, message, path.to_string_lossy().into_owned())),
        LoadError::Io { .. } => PyOSError::new_err(message),
        LoadError::Header { .. } | LoadError::NotRegular { .. } => {
            raise(py, "HeaderError", message)
        }
        LoadError::Request { .. } => raise(py, "PlanError", message),
        LoadError::Object {
            bucket,
            key,
            status,
            ..
        } => object_error(py, message, bucket, key, status),
        LoadError::Truncated { .. } | LoadError::Changed { .. } => raise(py, "ReadError", message),
        LoadError::WorkerPanicked { .. } => raise(py, "HpFastloadError", message),
        // Only when no handler's exception was kept (see `execute`).
        LoadError::Interrupted { .. } => PyKeyboardInterrupt::new_err(message),
    }
}

/// An [`Interrupt`] that runs the interpreter's pending signal handlers (`PyErr_CheckSignals`, attached for
/// the moment it takes; a no-op off the main thread) and says stop when one raised, keeping its exception in
/// `raised` for the caller to raise.
fn signal_interrupt(raised: Arc<Mutex<Option<PyErr>>>) -> Interrupt {
    Interrupt::new(move || {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(err) => {
                *raised.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
                true
            }
        })
    })
}

/// The parsed headers behind `headers`, shared, for work done with the interpreter released.
fn shared(headers: &[PyRef<'_, SafetensorsHeader>]) -> Vec<Arc<Header>> {
    headers.iter().map(|h| Arc::clone(&h.inner)).collect()
}

/// A parsed, validated safetensors header.
#[pyclass(frozen, module = "hp_fastload._core")]
struct SafetensorsHeader {
    inner: Arc<Header>,
    /// The object it was fetched from (object storage); None for a file.
    object: Option<Object>,
}

// ---- Object storage (feature `s3`, rust/objstore.rs) ----
#[cfg(feature = "s3")]
type Object = crate::objstore::ObjectFile;
/// No object storage in this build: no header has an object.
#[cfg(not(feature = "s3"))]
#[derive(Clone)]
struct Object;

/// `ObjectStoreError(message)` with its `bucket`, `key` and `status` attributes set.
fn object_error(
    py: Python<'_>,
    message: String,
    bucket: String,
    key: String,
    status: Option<u16>,
) -> PyErr {
    let err = raise(py, "ObjectStoreError", message);
    let value = err.value(py);
    let _ = value.setattr("bucket", bucket);
    let _ = value.setattr("key", key);
    let _ = value.setattr("status", status);
    err
}

/// The whole object at `url`, None when it does not exist (see `_core.pyi`).
#[cfg(feature = "s3")]
#[pyfunction]
fn read_object<'py>(py: Python<'py>, url: String) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let got = py
        .detach(|| crate::objstore::read_object(&url))
        .map_err(|e| to_py(py, e))?;
    Ok(got.map(|b| PyBytes::new(py, &b)))
}

/// The keys one level under `s3://bucket/prefix/`, sorted (see `_core.pyi`).
#[cfg(feature = "s3")]
#[pyfunction]
fn list_objects(py: Python<'_>, url: String) -> PyResult<Vec<String>> {
    py.detach(|| crate::objstore::list_keys(&url))
        .map_err(|e| to_py(py, e))
}

/// `(ETag or None, size)` of the object at `url` now (a HEAD; see `_core.pyi`).
#[cfg(feature = "s3")]
#[pyfunction]
fn object_identity(py: Python<'_>, url: String) -> PyResult<(Option<String>, u64)> {
    let f = py
        .detach(|| crate::objstore::identity(&url))
        .map_err(|e| to_py(py, e))?;
    Ok((f.e_tag, f.size))
}

/// Process-wide object-storage counters (see `_core.pyi`); `reset` sets them to zero after reading.
#[cfg(feature = "s3")]
#[pyfunction]
#[pyo3(signature = (reset=false))]
fn object_counters(reset: bool) -> (u64, u64, u64) {
    crate::objstore::counters_then(reset)
}

#[cfg(feature = "s3")]
fn add_object_functions(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_object, m)?)?;
    m.add_function(wrap_pyfunction!(list_objects, m)?)?;
    m.add_function(wrap_pyfunction!(object_identity, m)?)?;
    m.add_function(wrap_pyfunction!(object_counters, m)?)?;
    m.add("HAS_OBJECT_STORE", true)
}

#[cfg(not(feature = "s3"))]
fn add_object_functions(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("HAS_OBJECT_STORE", false)
}

/// Runs a read batch, through object storage when some header came from an object.
#[cfg(feature = "s3")]
use crate::objstore::execute_any as execute_read;

/// Runs a read batch (no object storage in this build: every file is local).
#[cfg(not(feature = "s3"))]
fn execute_read(
    files: &[Arc<Header>],
    _: &[Option<Object>],
    dests: &[crate::dest::DestBuf<'_>],
    items: &[crate::types::Item],
    scales: &[crate::exec::Scale],
    opts: &ExecOptions,
) -> Result<crate::exec::ExecStats, LoadError> {
    crate::exec::execute_scaled(files, dests, items, scales, opts)
}
// ---- end of object storage ----

#[pymethods]
impl SafetensorsHeader {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let header = py
            .detach(|| Header::read(&path))
            .map_err(|e| to_py(py, e))?;
        Ok(SafetensorsHeader {
            inner: Arc::new(header),
            object: None,
        })
    }

    #[cfg(feature = "s3")]
    /// Fetches and parses the headers of objects `s3://bucket/key` (all at once; see `_core.pyi`).
    #[staticmethod]
    fn open_objects(py: Python<'_>, urls: Vec<String>) -> PyResult<Vec<SafetensorsHeader>> {
        let opened = py
            .detach(|| crate::objstore::open_headers(&urls))
            .map_err(|e| to_py(py, e))?;
        Ok(opened
            .into_iter()
            .map(|(header, object)| SafetensorsHeader {
                inner: Arc::new(header),
                object: Some(object),
            })
            .collect())
    }

    #[cfg(feature = "s3")]
    /// `(ETag or None, size)` of the object the header came from; None for a file.
    #[getter]
    fn object_identity(&self) -> Option<(Option<String>, u64)> {
        self.object.as_ref().map(|o| (o.e_tag.clone(), o.size))
    }

    #[getter]
    fn path(&self) -> String {
        self.inner.path.to_string_lossy().into_owned()
    }

    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.file_len
    }

    #[getter]
    fn data_start(&self) -> u64 {
        self.inner.data_start
    }

    #[getter]
    fn digest(&self) -> u64 {
        self.inner.digest
    }

    /// Whether the file still has this header (identity, size and header bytes; see `_core.pyi`).
    fn still_current(&self, py: Python<'_>) -> bool {
        py.detach(|| self.inner.still_current())
    }

    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let meta = self.inner.metadata.as_deref();
        meta.map(|m| m.iter().map(|(k, v)| (k, v)).into_py_dict(py))
            .transpose()
    }

    fn __len__(&self) -> usize {
        self.inner.tensors.len()
    }

    /// `{name: HeaderEntry}` in file order, built here in one pass: the same dict built in Python from a
    /// list of tuples was a third of indexing a 90k-tensor checkpoint.
    fn entry_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        // One string object per dtype (a header has a handful), shared by every entry.
        let mut names: Vec<(Dtype, Bound<'py, PyString>)> = Vec::new();
        // One shape tuple per distinct shape (a MoE header repeats a few dozen shapes across 10^4 tensors):
        // tuples are immutable, and sharing them halves the objects built.
        let mut shapes: HashMap<&[u64], Py<PyTuple>, BuildHasherDefault<WordHasher>> =
            HashMap::default();
        for (i, t) in self.inner.tensors.iter().enumerate() {
            let dtype = match names.iter().find(|(d, _)| *d == t.dtype) {
                Some((_, s)) => s.clone(),
                None => {
                    let s = PyString::intern(py, t.dtype.name());
                    names.push((t.dtype, s.clone()));
                    s
                }
            };
            let entry = HeaderEntry {
                position: i,
                dtype: dtype.unbind(),
                shape: match shapes.get(t.shape.as_slice()) {
                    Some(shape) => shape.clone_ref(py),
                    None => {
                        let shape = PyTuple::new(py, &t.shape)?.unbind();
                        shapes.insert(&t.shape, shape.clone_ref(py));
                        shape
                    }
                },
                begin: t.begin,
                end: t.end,
            };
            dict.set_item(PyString::new(py, &t.name), Bound::new(py, entry)?)?;
        }
        Ok(dict)
    }

    /// The natural order of every tensor of `headers` (several shards): positions into their names taken in
    /// order (each header's in file order), sorted, plus the positions of names whose order is Python's to
    /// decide (see [`crate::header::natural_order`]); merged from the order each header computed when it
    /// was parsed ([`crate::header::natural_order_of`]). Positions rather than names, so the caller orders
    /// the very string objects it already holds.
    #[staticmethod]
    fn natural_order(
        py: Python<'_>,
        headers: Vec<PyRef<'_, SafetensorsHeader>>,
    ) -> (Vec<usize>, Vec<usize>) {
        let inners = shared(&headers);
        py.detach(move || {
            let refs: Vec<&Header> = inners.iter().map(|h| h.as_ref()).collect();
            crate::header::natural_order_of(&refs)
        })
    }

    /// Drops the map of the file kept between reads (see `release_map` in `_core.pyi`).
    fn release_map(&self, py: Python<'_>) {
        py.detach(|| self.inner.release_map());
    }

    fn __repr__(&self) -> String {
        let (path, n) = (&self.inner.path, self.inner.tensors.len());
        format!("SafetensorsHeader({path:?}, tensors={n})")
    }

    /// The facts id (dtype and shape, process-wide; see [`crate::header::facts_of`]) of every name, each
    /// from the one of `headers` that has it; `KeyError(name)` for the first name none has.
    #[staticmethod]
    fn facts<'py>(
        py: Python<'py>,
        headers: Vec<PyRef<'_, SafetensorsHeader>>,
        names: Vec<PyBackedStr>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let refs: Vec<&Header> = headers.iter().map(|h| h.inner.as_ref()).collect();
        let strs: Vec<&str> = names.iter().map(|n| &**n).collect();
        match crate::header::facts_of(&refs, &strs) {
            Ok(ids) => PyTuple::new(py, ids),
            Err(at) => Err(PyKeyError::new_err(strs[at].to_owned())),
        }
    }

    /// The tensor names in file order (new string objects; the caller keeps the list).
    fn names<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let tensors = &self.inner.tensors;
        PyList::new(py, tensors.iter().map(|t| PyString::new(py, &t.name)))
    }

    /// The [`HeaderEntry`] of the tensor called `name`, built now (nothing is kept), or None when the header
    /// has no such tensor (or `name` is not a string).
    fn get(&self, py: Python<'_>, name: &Bound<'_, PyAny>) -> PyResult<Option<HeaderEntry>> {
        let Ok(name) = name.cast::<PyString>() else {
            return Ok(None);
        };
        let Some(position) = self.inner.index(name.to_str()?) else {
            return Ok(None);
        };
        let t = &self.inner.tensors[position];
        Ok(Some(HeaderEntry {
            position,
            dtype: PyString::intern(py, t.dtype.name()).unbind(),
            shape: PyTuple::new(py, &t.shape)?.unbind(),
            begin: t.begin,
            end: t.end,
        }))
    }

    fn __contains__(&self, name: &Bound<'_, PyAny>) -> PyResult<bool> {
        match name.cast::<PyString>() {
            Ok(name) => Ok(self.inner.index(name.to_str()?).is_some()),
            Err(_) => Ok(false),
        }
    }

    /// Positions (file order) of the tensors whose safetensors dtype name is not one of `dtype_names`.
    fn positions_not_of(&self, dtype_names: Vec<PyBackedStr>) -> Vec<usize> {
        let names: Vec<&str> = dtype_names.iter().map(|n| &**n).collect();
        crate::header::positions_not_of(&self.inner, &names)
    }
}

/// One tensor of a header: its position (an item's tensor field), safetensors dtype name, shape and byte
/// range relative to the data section. Built by `SafetensorsHeader.entry_dict` and `.get`; read-only.
#[pyclass(frozen, get_all, module = "hp_fastload._core")]
struct HeaderEntry {
    position: usize,
    dtype: Py<PyString>,
    shape: Py<PyTuple>,
    begin: u64,
    end: u64,
}

#[pymethods]
impl HeaderEntry {
    /// `end - begin`.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.end - self.begin
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let (d, s) = (self.dtype.bind(py).to_str()?, self.shape.bind(py).repr()?);
        let (p, b, e) = (self.position, self.begin, self.end);
        Ok(format!(
            "HeaderEntry(position={p}, dtype={d}, shape={s}, begin={b}, end={e})"
        ))
    }
}

/// The `weight_map` of a `model.safetensors.index.json` (see [`crate::header::WeightMap`]).
#[pyclass(frozen, module = "hp_fastload._core")]
struct WeightMap {
    inner: crate::header::WeightMap,
}

#[pymethods]
impl WeightMap {
    /// The map of an index's bytes, or None when it is not the usual layout (the caller reports why).
    #[staticmethod]
    fn parse(py: Python<'_>, text: &[u8]) -> Option<WeightMap> {
        py.detach(|| crate::header::WeightMap::parse(text))
            .map(|inner| WeightMap { inner })
    }

    fn files(&self) -> Vec<String> {
        self.inner.files.clone()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Whether the map lists exactly the tensors of `headers`, which are the files `files()` in order.
    fn agrees(&self, py: Python<'_>, headers: Vec<PyRef<'_, SafetensorsHeader>>) -> bool {
        let inners = shared(&headers);
        py.detach(|| {
            let refs: Vec<&Header> = inners.iter().map(|h| h.as_ref()).collect();
            self.inner.agrees(&refs)
        })
    }
}

/// Reads a batch of strided boxes into caller memory, or (`direction="write"`) writes them from caller
/// memory into the files; see `_core.pyi`.
#[pyfunction]
#[pyo3(signature = (headers, dests, items, threads=None, backend="auto", scales=None, direction="read"))]
#[allow(clippy::too_many_arguments)]
fn execute<'py>(
    py: Python<'py>,
    headers: Vec<PyRef<'py, SafetensorsHeader>>,
    dests: &[u8],
    items: &[u8],
    threads: Option<i64>,
    backend: &str,
    scales: Option<&[u8]>,
    direction: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let files = shared(&headers);
    let objects: Vec<Option<Object>> = headers.iter().map(|h| h.object.clone()).collect();
    let from_objects = objects.iter().any(Option::is_some);
    let scales = scales.unwrap_or_default();
    let batch = records::batch(direction, from_objects, dests, items, scales, threads)
        .map_err(|e| to_py(py, e))?;
    let backend: Backend = backend.parse().map_err(|e| to_py(py, e))?;
    let raised = Arc::new(Mutex::new(None));
    let opts = ExecOptions {
        threads: batch.threads,
        backend,
        interrupt: Some(signal_interrupt(Arc::clone(&raised))),
        ..ExecOptions::default()
    };
    let stats = py
        .detach(move || {
            let (dests, items) = (crate::dest::from_python(&batch.dests), &batch.items);
            match batch.write {
                false => execute_read(&files, &objects, &dests, items, &batch.scales, &opts),
                true => crate::exec::execute_write(&files, &dests, items, &opts),
            }
        })
        .map_err(|e| {
            let handler = raised.lock().unwrap_or_else(|p| p.into_inner()).take();
            match (e, handler) {
                (LoadError::Interrupted { .. }, Some(err)) => err,
                (e, _) => to_py(py, e),
            }
        })?;
    let out = PyDict::new(py);
    out.set_item("bytes_copied", stats.bytes_copied)?;
    out.set_item("bytes_read_from_files", stats.bytes_read_from_files)?;
    out.set_item("runs", stats.runs)?;
    out.set_item("spans", stats.spans)?;
    out.set_item("backend", stats.backend)?;
    out.set_item("threads", stats.threads)?;
    Ok(out)
}

/// The items of `names`, each a `str` (`TypeError` for the first that is not).
fn str_list<'py>(names: &Bound<'py, PyList>) -> PyResult<Vec<Bound<'py, PyString>>> {
    let cast = |n: Bound<'py, PyAny>| n.cast_into::<PyString>().map_err(PyErr::from);
    names.iter().map(cast).collect()
}

/// The templates of `names` (see [`crate::keys`]): `(templates, ids, numbers, width)` with `ids` the
/// little-endian `u32` template index of each name and `numbers` its `width` numbers as little-endian `i64`
/// (-1 padded); None when a name contains the marker.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn key_templates<'py>(
    py: Python<'py>,
    names: &Bound<'py, PyList>,
) -> PyResult<Option<(Vec<String>, Bound<'py, PyBytes>, Bound<'py, PyBytes>, usize)>> {
    let owned = str_list(names)?;
    let strs: Vec<&str> = owned.iter().map(|s| s.to_str()).collect::<PyResult<_>>()?;
    let Some(t) = py.detach(|| crate::keys::key_templates(&strs)) else {
        return Ok(None);
    };
    let ids: Vec<u8> = t.ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    let numbers: Vec<u8> = t.numbers.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok(Some((
        t.templates,
        PyBytes::new(py, &ids),
        PyBytes::new(py, &numbers),
        t.width,
    )))
}

/// Names as the caller's own string objects.
type Names<'py> = Vec<Bound<'py, PyString>>;
/// `(hits, paired, values, scales)` of [`crate::keys::companion_scan`], as the names' own string objects
/// (`values` / `scales`: each paired stem and its suffixed name; empty unless `paired`).
#[pyfunction]
#[pyo3(signature = (names, suffixes, marker=None))]
fn companion_scan<'py>(
    names: &Bound<'py, PyList>,
    suffixes: Vec<PyBackedStr>,
    marker: Option<&str>,
) -> PyResult<(Names<'py>, bool, Names<'py>, Names<'py>)> {
    let owned = str_list(names)?;
    let strs: Vec<&str> = owned.iter().map(|s| s.to_str()).collect::<PyResult<_>>()?;
    let ends: Vec<&str> = suffixes.iter().map(|s| &**s).collect();
    let py = names.py();
    let scan = py.detach(|| crate::keys::companion_scan(&strs, &ends, marker));
    let at = |i: usize| owned[i].clone();
    let (values, scales) = scan.pairs.iter().map(|&(v, s)| (at(v), at(s))).unzip();
    let hits = scan.hits.into_iter().map(at).collect();
    Ok((hits, scan.paired, values, scales))
}

/// `(level in use, level this CPU supports, level HP_FASTLOAD_SIMD asks for or None)` by name (see
/// [`crate::simd`]); `ValueError` when `HP_FASTLOAD_SIMD` names no level.
#[pyfunction]
fn simd_levels() -> PyResult<(&'static str, &'static str, Option<&'static str>)> {
    crate::simd::levels().map_err(pyo3::exceptions::PyValueError::new_err)
}

/// The `hp_fastload._core` module.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SafetensorsHeader>()?;
    m.add_class::<HeaderEntry>()?;
    m.add_class::<WeightMap>()?;
    m.add_function(wrap_pyfunction!(execute, m)?)?;
    m.add_function(wrap_pyfunction!(key_templates, m)?)?;
    m.add_function(wrap_pyfunction!(companion_scan, m)?)?;
    m.add_function(wrap_pyfunction!(simd_levels, m)?)?;
    add_object_functions(m)?;
    m.add("MAX_NDIM", MAX_NDIM)?;
    m.add("ITEM_WIDTH", records::ITEM_WIDTH)?;
    for (name, col) in records::ITEM_COLUMNS {
        m.add(name, col)?;
    }
    m.add("SCALE_WIDTH", records::SCALE_WIDTH)?;
    m.add(
        "CAST_FLOATS",
        PyTuple::new(m.py(), Dtype::castable_float_names())?,
    )?;
    let codes = PyDict::new(m.py());
    for d in ALL_DTYPES {
        codes.set_item(d.name(), d.code())?;
    }
    m.add("DTYPE_CODES", codes)?;
    m.add("DEFAULT_THREADS", crate::threads::default_threads())?;
    let levels: Vec<&str> = crate::simd::Level::ALL.iter().map(|l| l.name()).collect();
    m.add("SIMD_LEVELS", PyTuple::new(m.py(), levels)?)?;
    Ok(())
}
