//! hp_fastload's engine: strided, parallel, casting reads of safetensors tensors into caller memory.
//!
//! The crate parses safetensors headers strictly ([`Header`]), validates batches of read requests
//! ([`Item`]s: a strided box of a tensor into a strided box of a [`DestBuf`]), turns them into runs sorted by
//! file offset, and copies them with scoped worker threads from a read-only memory map or with `pread`,
//! converting floating types on the way ([`execute`]). It knows nothing of Python: the `python` feature adds
//! the `hp_fastload._core` extension module in `python.rs`.
//!
//! Memory-map contract: a mapped file must not be truncated or rewritten while [`execute`] runs. Files are
//! checked with `fstat` before each call (a file shorter than its header says gives
//! [`LoadError::Truncated`], never SIGBUS; one replaced since its header was read gives
//! [`LoadError::Changed`]). A [`Header`] keeps the map of its file between calls (re-mapping per call cost a
//! quarter of a warm column read) until [`Header::release_map`]; each reuse passes the same checks as a
//! fresh map. The Python layer releases the maps when a load or a `read_many` returns.
//!
//! Modules, from the bottom layer up (each uses only modules above it in this list;
//! `tools/rust_module_deps.py` checks that there is no cycle and that no file passes 600 lines, tests
//! included: a module's tests may sit beside it in `<module>/tests.rs`):
//!
//! - [`error`]: [`LoadError`], the one error type. [`dtype`]: [`Dtype`], codes, names, sizes, cast table.
//!   [`threads`]: the default thread count. [`simd`]: the SIMD level the kernels run at (CPU,
//!   `HP_FASTLOAD_SIMD`).
//! - `mmap`: maps, page residency, positioned reads (`unsafe`, fenced). [`types`]: plain data: [`Item`] (a
//!   read request), [`types::Run`] (a planned strided copy), [`MAX_NDIM`].
//! - [`header`]: strict safetensors headers ([`Header`]); beside the parser in `header/`: its JSON, name
//!   tables and facts, [`header::WeightMap`], natural order. [`kernels`]: scalar conversions
//!   (`kernels/convert.rs`), cast kernels, 8-bit float dequantizing kernels and their scale maps
//!   (`kernels/scalemap.rs`). `overlap`: the exact destination-overlap check on runs.
//! - [`keys`]: key templates. `lookup` (x86-64 only): 8-bit float block dequantization by per-block tables
//!   (AVX-512 VBMI; `unsafe`, fenced).
//! - [`dest`]: destination buffers ([`DestBuf`]) and the only writes through raw destination pointers
//!   (`unsafe`, fenced); [`dest::mxfp4`]: every MXFP4 kernel (the scalar reference, the AVX2 / AVX-512 tiles).
//! - [`runs`]: validates items and turns them into runs.
//! - [`exec`]: the executor ([`execute`], [`execute_scaled`], [`exec::execute_write`]): `exec/read.rs`,
//!   `tasks.rs`, `scales.rs`, `write.rs`, `workers.rs`, `release.rs`, `staged.rs`.
//! - [`records`]: the packed item, scale and destination records Python hands over, decoded and checked
//!   ([`Item::from_record`], [`records::batch`]). `objstore` (feature `s3`): s3:// objects read with ranged
//!   GETs (`objstore/client.rs`, `fetch.rs`, `ranges.rs`).
//! - `python` (feature `python`): the pyo3 extension module, the only user of pyo3: argument conversion,
//!   the interpreter released around the work, errors mapped to `hp_fastload.errors`.
//!
//! ```
//! use std::sync::Arc;
//! use hp_fastload::{execute, DestBuf, Dtype, ExecOptions, Header, Item};
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("m.safetensors");
//! let json = br#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
//! let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
//! bytes.extend_from_slice(json);
//! for v in [1.0f32, 2.0, 3.0, 4.0] {
//!     bytes.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
//! }
//! std::fs::write(&path, &bytes).unwrap();
//! let header = Arc::new(Header::read(&path).unwrap());
//! // Column 1 of the [2, 2] tensor, as f32.
//! let mut out = [0u8; 8];
//! let mut item = Item { ndim: 1, src_base: 1, ..Item::default() };
//! (item.lengths[0], item.src_strides[0], item.dst_strides[0]) = (2, 2, 1);
//! let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
//! execute(&[header], &dest, &[item], &ExecOptions::default()).unwrap();
//! assert_eq!(f32::from_le_bytes(out[4..].try_into().unwrap()), 4.0);
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod dest;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod header;
pub mod kernels;
pub mod keys;
#[cfg(target_arch = "x86_64")]
mod lookup;
mod mmap;
#[cfg(feature = "s3")]
pub mod objstore;
mod overlap;
#[cfg(feature = "python")]
mod python;
pub mod records;
pub mod runs;
pub mod simd;
pub mod threads;
pub mod types;

pub use dest::DestBuf;
pub use dtype::Dtype;
pub use error::LoadError;
pub use exec::{execute, execute_scaled, Backend, ExecOptions, ExecStats, Scale};
pub use header::{Header, TensorInfo};
pub use types::{Item, MAX_NDIM};
