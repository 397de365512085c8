//! The packed records a batch arrives in from Python (`hp_fastload.source.files` packs them): little-endian
//! `int64` fields, one fixed-width record per item, per scale and per destination. This module is the one
//! definition of their layout (the `COL_*` offsets, exported to Python by `_core`) and decodes them into
//! [`Item`]s, [`Scale`]s and destination triples, each malformed record a [`LoadError::Request`] (never a
//! panic). It knows nothing of pyo3: `python.rs` only hands it the bytes.
//!
//! ```
//! use hp_fastload::records::{self, COL_NDIM, COL_TENSOR, ITEM_WIDTH};
//! let mut record = [0i64; ITEM_WIDTH];
//! (record[COL_TENSOR], record[COL_NDIM]) = (3, 0);
//! let bytes: Vec<u8> = record.iter().flat_map(|v| v.to_le_bytes()).collect();
//! let items = records::items(&bytes).unwrap();
//! assert_eq!(items[0].tensor, 3);
//! assert!(records::items(&bytes[..7]).is_err());
//! ```

use crate::dtype::Dtype;
use crate::error::LoadError;
use crate::exec::Scale;
use crate::types::{Item, MAX_NDIM};

/// Item field: index into the batch's files.
pub const COL_FILE: usize = 0;
/// Item field: index of the tensor in that file's header.
pub const COL_TENSOR: usize = 1;
/// Item field: element index in the tensor of the box's first element.
pub const COL_SRC_BASE: usize = 2;
/// Item field: index into the destinations.
pub const COL_DEST: usize = 3;
/// Item field: element index in the destination of the box's first element.
pub const COL_DST_BASE: usize = 4;
/// Item field: number of dimensions used.
pub const COL_NDIM: usize = 5;
/// Item fields: box extent per dimension, [`MAX_NDIM`] of them.
pub const COL_LENGTHS: usize = 6;
/// Item fields: source stride per dimension, [`MAX_NDIM`] of them.
pub const COL_SRC_STRIDES: usize = COL_LENGTHS + MAX_NDIM;
/// Item fields: destination stride per dimension, [`MAX_NDIM`] of them.
pub const COL_DST_STRIDES: usize = COL_SRC_STRIDES + MAX_NDIM;
/// Item field: the scale (0: none, `k`: scales entry `k - 1`).
pub const COL_SCALE: usize = COL_DST_STRIDES + MAX_NDIM;
/// `int64` fields per packed item.
pub const ITEM_WIDTH: usize = COL_SCALE + 1;
/// `int64` fields per packed scale: file, tensor, ndim, then the quantized tensor's shape and the block
/// shape, [`MAX_NDIM`] each.
pub const SCALE_WIDTH: usize = 3 + 2 * MAX_NDIM;
/// `int64` fields per packed destination: address, size in bytes, dtype code.
pub const DEST_WIDTH: usize = 3;

/// Every item column by the name Python knows it by.
pub const ITEM_COLUMNS: [(&str, usize); 10] = [
    ("COL_FILE", COL_FILE),
    ("COL_TENSOR", COL_TENSOR),
    ("COL_SRC_BASE", COL_SRC_BASE),
    ("COL_DEST", COL_DEST),
    ("COL_DST_BASE", COL_DST_BASE),
    ("COL_NDIM", COL_NDIM),
    ("COL_LENGTHS", COL_LENGTHS),
    ("COL_SRC_STRIDES", COL_SRC_STRIDES),
    ("COL_DST_STRIDES", COL_DST_STRIDES),
    ("COL_SCALE", COL_SCALE),
];

/// A caller's destination: `(address, size in bytes, dtype)`, checked for a null address and an address
/// range that overflows (that the memory is live is the caller's promise, not checked here).
pub type DestTriple = (usize, usize, Dtype);

fn int64s(bytes: &[u8]) -> impl Iterator<Item = i64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
}

/// The `int64` fields of `bytes` (named `what` in the error) in records of `width` fields.
fn fields(bytes: &[u8], width: usize, what: &str) -> Result<Vec<i64>, LoadError> {
    if !bytes.len().is_multiple_of(width * 8) {
        return Err(LoadError::request(match width {
            DEST_WIDTH => format!("{what} has {} bytes, not a multiple of 24", bytes.len()),
            _ => format!(
                "{what} has {} bytes, not a multiple of {} ({width} int64 each)",
                bytes.len(),
                width * 8
            ),
        }));
    }
    Ok(int64s(bytes).collect())
}

fn record_width(what: &str, got: usize, want: usize) -> LoadError {
    LoadError::request(format!("{what} record has {got} fields, not {want}"))
}

impl Item {
    /// The item of one packed record (`ITEM_WIDTH` fields at the `COL_*` offsets); a record of another
    /// length is an error. The fields are taken as they are: [`crate::execute`] validates them.
    pub fn from_record(v: &[i64]) -> Result<Item, LoadError> {
        if v.len() != ITEM_WIDTH {
            return Err(record_width("an item", v.len(), ITEM_WIDTH));
        }
        let mut item = Item {
            file: v[COL_FILE],
            tensor: v[COL_TENSOR],
            src_base: v[COL_SRC_BASE],
            dest: v[COL_DEST],
            dst_base: v[COL_DST_BASE],
            ndim: v[COL_NDIM],
            scale: v[COL_SCALE],
            ..Item::default()
        };
        item.lengths
            .copy_from_slice(&v[COL_LENGTHS..COL_LENGTHS + MAX_NDIM]);
        item.src_strides
            .copy_from_slice(&v[COL_SRC_STRIDES..COL_SRC_STRIDES + MAX_NDIM]);
        item.dst_strides
            .copy_from_slice(&v[COL_DST_STRIDES..COL_DST_STRIDES + MAX_NDIM]);
        Ok(item)
    }
}

impl Scale {
    /// The scale of one packed record (`SCALE_WIDTH` fields); a record of another length is an error.
    pub fn from_record(v: &[i64]) -> Result<Scale, LoadError> {
        if v.len() != SCALE_WIDTH {
            return Err(record_width("a scale", v.len(), SCALE_WIDTH));
        }
        let mut scale = Scale {
            file: v[0],
            tensor: v[1],
            ndim: v[2],
            ..Scale::default()
        };
        scale.shape.copy_from_slice(&v[3..3 + MAX_NDIM]);
        scale
            .block
            .copy_from_slice(&v[3 + MAX_NDIM..3 + 2 * MAX_NDIM]);
        Ok(scale)
    }
}

/// The items packed in `bytes`.
pub fn items(bytes: &[u8]) -> Result<Vec<Item>, LoadError> {
    fields(bytes, ITEM_WIDTH, "items")?
        .chunks_exact(ITEM_WIDTH)
        .map(Item::from_record)
        .collect()
}

/// The scales packed in `bytes`.
pub fn scales(bytes: &[u8]) -> Result<Vec<Scale>, LoadError> {
    fields(bytes, SCALE_WIDTH, "scales")?
        .chunks_exact(SCALE_WIDTH)
        .map(Scale::from_record)
        .collect()
}

/// The destinations packed in `bytes`: a known dtype code, a non-negative address and size, no null address
/// for a non-empty buffer, no address range past the end of memory.
pub fn dests(bytes: &[u8]) -> Result<Vec<DestTriple>, LoadError> {
    let values = fields(bytes, DEST_WIDTH, "dests")?;
    let mut triples = Vec::with_capacity(values.len() / DEST_WIDTH);
    for (i, t) in values.chunks_exact(DEST_WIDTH).enumerate() {
        let dtype = Dtype::from_code(t[2]).ok_or_else(|| {
            LoadError::request(format!("destination {i}: unknown dtype code {}", t[2]))
        })?;
        let (Ok(addr), Ok(nbytes)) = (usize::try_from(t[0]), usize::try_from(t[1])) else {
            return Err(LoadError::request(format!(
                "destination {i}: address {} or size {} is negative",
                t[0], t[1]
            )));
        };
        if addr == 0 && nbytes > 0 {
            return Err(LoadError::request(format!("destination {i}: null address")));
        }
        if addr.checked_add(nbytes).is_none() {
            return Err(LoadError::request(format!(
                "destination {i}: address range overflows"
            )));
        }
        triples.push((addr, nbytes, dtype));
    }
    Ok(triples)
}

/// A batch as `_core.execute` receives it, decoded and checked: the direction, the destinations, items and
/// scales, the thread count.
#[derive(Debug)]
pub struct Batch {
    /// Whether the batch writes caller memory into the files (`direction="write"`) rather than reading.
    pub write: bool,
    /// The destinations ([`dests`]).
    pub dests: Vec<DestTriple>,
    /// The items ([`items`]).
    pub items: Vec<Item>,
    /// The scales ([`scales`]).
    pub scales: Vec<Scale>,
    /// The thread count ([`threads`]).
    pub threads: Option<usize>,
}

/// Decodes a batch, checked in this order (the first problem is the error): the direction (`read` or
/// `write`), no write to object storage (`from_objects`: some file came from an object), the destinations,
/// items and scales, the thread count, and no scale in a write (writes store bytes as they are).
pub fn batch(
    direction: &str,
    from_objects: bool,
    dests_bytes: &[u8],
    items_bytes: &[u8],
    scales_bytes: &[u8],
    thread_count: Option<i64>,
) -> Result<Batch, LoadError> {
    let write = match direction {
        "read" => false,
        "write" => true,
        _ => {
            return Err(LoadError::request(format!(
                "unknown direction '{direction}' (expected read or write)"
            )))
        }
    };
    if write && from_objects {
        return Err(LoadError::request(
            "the write direction writes local files; an object header cannot be written",
        ));
    }
    let batch = Batch {
        write,
        dests: dests(dests_bytes)?,
        items: items(items_bytes)?,
        scales: scales(scales_bytes)?,
        threads: threads(thread_count)?,
    };
    if write && (!batch.scales.is_empty() || batch.items.iter().any(|item| item.scale != 0)) {
        return Err(LoadError::request(
            "the write direction stores bytes as they are: items that dequantize (a scale) only read",
        ));
    }
    Ok(batch)
}

/// A thread count as Python passes it: None for the default, else at least 1.
pub fn threads(threads: Option<i64>) -> Result<Option<usize>, LoadError> {
    match threads {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(n as usize)),
        Some(n) => Err(LoadError::request(format!(
            "threads must be at least 1, got {n}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(values: &[i64]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn an_item_record_round_trips_every_field() {
        let record: Vec<i64> = (0..ITEM_WIDTH as i64).map(|v| 100 + v).collect();
        let items = items(&pack(&record)).unwrap();
        assert_eq!(items.len(), 1);
        let item = items[0];
        assert_eq!(
            (
                item.file,
                item.tensor,
                item.src_base,
                item.dest,
                item.dst_base,
                item.ndim
            ),
            (100, 101, 102, 103, 104, 105)
        );
        assert_eq!(item.lengths[0], 100 + COL_LENGTHS as i64);
        assert_eq!(
            item.src_strides[MAX_NDIM - 1],
            100 + COL_DST_STRIDES as i64 - 1
        );
        assert_eq!(item.dst_strides[0], 100 + COL_DST_STRIDES as i64);
        assert_eq!(item.scale, 100 + COL_SCALE as i64);
        assert_eq!(ITEM_COLUMNS.len() + 3 * (MAX_NDIM - 1), ITEM_WIDTH);
    }

    #[test]
    fn a_scale_record_round_trips_every_field() {
        let record: Vec<i64> = (0..SCALE_WIDTH as i64).collect();
        let scale = scales(&pack(&record)).unwrap()[0];
        assert_eq!((scale.file, scale.tensor, scale.ndim), (0, 1, 2));
        assert_eq!(scale.shape[0], 3);
        assert_eq!(scale.block[MAX_NDIM - 1], SCALE_WIDTH as i64 - 1);
        assert!(scales(&[]).unwrap().is_empty());
    }

    #[test]
    fn bad_records_are_request_errors() {
        let is_request = |e: LoadError| matches!(e, LoadError::Request { .. });
        let one = pack(&[0; ITEM_WIDTH]);
        let e = items(&one[..one.len() - 8]).unwrap_err();
        assert!(e.to_string().contains("not a multiple of"), "{e}");
        assert!(is_request(e));
        assert!(is_request(scales(&[0u8; 12]).unwrap_err()));
        assert!(is_request(Item::from_record(&[0; 3]).unwrap_err()));
        assert!(is_request(Scale::from_record(&[0; 30]).unwrap_err()));
        assert!(is_request(dests(&[0u8; 23]).unwrap_err()));
        let bf16 = Dtype::BF16.code();
        for (triple, says) in [
            ([8, 8, 999], "unknown dtype code 999"),
            ([-8, 8, bf16], "is negative"),
            ([8, -1, bf16], "is negative"),
            ([0, 8, bf16], "null address"),
        ] {
            let e = dests(&pack(&triple)).unwrap_err();
            assert!(e.to_string().contains(says), "{e} (want {says})");
        }
        assert!(threads(Some(0))
            .unwrap_err()
            .to_string()
            .contains("at least 1"));
        assert_eq!(threads(Some(3)).unwrap(), Some(3));
        assert_eq!(threads(None).unwrap(), None);
    }

    #[test]
    fn a_batch_is_checked_in_order() {
        let says = |r: Result<Batch, LoadError>| r.unwrap_err().to_string();
        let item = pack(&[0; ITEM_WIDTH]);
        let mut scaled = [0; ITEM_WIDTH];
        scaled[COL_SCALE] = 1;
        let scaled = pack(&scaled);
        assert!(says(batch("sideways", false, &[], &item, &[], None)).contains("unknown direction"));
        // the direction's checks come before any record is decoded
        assert!(says(batch("write", true, &[1], &item, &[], None)).contains("an object header"));
        assert!(says(batch("read", false, &[1], &item, &[], None)).contains("dests has 1 bytes"));
        assert!(says(batch("read", false, &[], &item, &[], Some(0))).contains("at least 1"));
        assert!(says(batch("write", false, &[], &scaled, &[], None)).contains("dequantize"));
        let scale = pack(&[0; SCALE_WIDTH]);
        assert!(says(batch("write", false, &[], &item, &scale, None)).contains("dequantize"));
        let read = batch("read", true, &[], &scaled, &scale, Some(2)).unwrap();
        assert!(!read.write);
        assert_eq!(
            (read.items.len(), read.scales.len(), read.threads),
            (1, 1, Some(2))
        );
        assert!(batch("write", false, &[], &item, &[], None).unwrap().write);
    }

    #[test]
    fn good_dests_decode() {
        let f32 = Dtype::F32.code();
        let got = dests(&pack(&[4096, 16, f32, 0, 0, f32])).unwrap();
        assert_eq!(got, vec![(4096, 16, Dtype::F32), (0, 0, Dtype::F32)]);
    }
}
