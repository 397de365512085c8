//! Test helpers shared by the executor's tests: files written from tensors, pseudo-random bytes, and the
//! random box cases (with their naive element layout) that the read and write directions check.

use std::fs::File;
use std::io::Write;
use std::sync::Arc;

use proptest::prelude::*;

use super::Backend;
use crate::dtype::Dtype;
use crate::header::Header;
use crate::types::Item;

/// A one-dimensional item: `len` contiguous elements of tensor 0 of file 0 into the start of dest 0.
pub(super) fn flat_item(len: i64) -> Item {
    let mut item = Item {
        ndim: 1,
        ..Item::default()
    };
    (item.lengths[0], item.src_strides[0], item.dst_strides[0]) = (len, 1, 1);
    item
}

pub(super) fn write_file(
    dir: &std::path::Path,
    name: &str,
    tensors: &[(&str, Dtype, Vec<u64>, Vec<u8>)],
) -> Arc<Header> {
    let mut json = String::from("{");
    let mut off = 0;
    for (i, (n, dt, shape, data)) in tensors.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        json.push_str(&format!(
            r#""{n}":{{"dtype":"{dt}","shape":{shape:?},"data_offsets":[{off},{}]}}"#,
            off + data.len()
        ));
        off += data.len();
    }
    json.push('}');
    let path = dir.join(name);
    let mut f = File::create(&path).unwrap();
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(json.as_bytes()).unwrap();
    for t in tensors {
        f.write_all(&t.3).unwrap();
    }
    drop(f);
    Arc::new(Header::read(&path).unwrap())
}

/// The last `n` bytes of `h`'s file turned into a hole (zeros when read), as a sparse rehearsal checkpoint
/// holds its data; the header read again (the file's identity changed).
pub(super) fn punch_tail(h: &Header, n: u64) -> Arc<Header> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&h.path)
        .unwrap();
    f.set_len(h.file_len - n).unwrap();
    f.set_len(h.file_len).unwrap();
    drop(f);
    Arc::new(Header::read(&h.path).unwrap())
}

pub(super) fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

pub(super) const PAIRS: &[(Dtype, Dtype)] = &[
    (Dtype::U8, Dtype::U8),
    (Dtype::I16, Dtype::I16),
    (Dtype::I32, Dtype::I32),
    (Dtype::F64, Dtype::F64),
    (Dtype::BF16, Dtype::BF16),
    (Dtype::BF16, Dtype::F32),
    (Dtype::F32, Dtype::BF16),
    (Dtype::F16, Dtype::F64),
    (Dtype::F64, Dtype::F8_E4M3),
    (Dtype::F8_E5M2, Dtype::F16),
    (Dtype::F8_E8M0, Dtype::BF16),
];

#[derive(Debug, Clone)]
pub(super) struct Case {
    pub(super) shape: Vec<u64>,
    pub(super) offsets: Vec<u64>,
    pub(super) lengths: Vec<u64>,
    pub(super) perm: Vec<usize>,
    pub(super) dst_order: Vec<usize>,
    pub(super) pad: Vec<u64>,
    pub(super) pair: usize,
    pub(super) backend: Backend,
    pub(super) threads: usize,
    pub(super) gap: u64,
    pub(super) seed: u64,
}

pub(super) fn case() -> impl Strategy<Value = Case> {
    (0usize..=4)
        .prop_flat_map(|ndim| {
            (
                proptest::collection::vec(1u64..7, ndim),
                proptest::collection::vec((0u64..7, 0u64..8), ndim),
                Just((0..ndim).collect::<Vec<_>>()).prop_shuffle(),
                Just((0..ndim).collect::<Vec<_>>()).prop_shuffle(),
                proptest::collection::vec(0u64..3, ndim),
                0..PAIRS.len(),
                prop_oneof![
                    Just(Backend::Mmap),
                    Just(Backend::Pread),
                    Just(Backend::Auto)
                ],
                1usize..4,
                prop_oneof![Just(0u64), Just(64 * 1024)],
                any::<u64>(),
            )
        })
        .prop_map(
            |(shape, boxes, perm, dst_order, pad, pair, backend, threads, gap, seed)| {
                let offsets: Vec<u64> = boxes.iter().zip(&shape).map(|(b, s)| b.0 % s).collect();
                let lengths = boxes
                    .iter()
                    .zip(&shape)
                    .zip(&offsets)
                    .map(|((b, s), o)| b.1 % (s - o + 1))
                    .collect();
                Case {
                    shape,
                    offsets,
                    lengths,
                    perm,
                    dst_order,
                    pad,
                    pair,
                    backend,
                    threads,
                    gap,
                    seed,
                }
            },
        )
}

/// A case's box as an engine item: the source row-major, its dims taken in `perm` order; the other side's
/// dims laid out in `dst_order` (innermost last) with padding, from element 3 of a buffer of `dst_len`.
pub(super) struct Layout {
    pub(super) item: Item,
    pub(super) dst_len: usize,
}

impl Layout {
    /// `(source element, destination element)` of every element of the box, in row-major box order.
    pub(super) fn elements(&self) -> Vec<(u64, u64)> {
        let it = &self.item;
        let ndim = it.ndim as usize;
        let lengths: Vec<u64> = it.lengths[..ndim].iter().map(|&n| n as u64).collect();
        let total: u64 = lengths.iter().product();
        (0..total)
            .map(|flat| {
                let (mut rem, mut se, mut de) = (flat, it.src_base as u64, it.dst_base as u64);
                for d in (0..ndim).rev() {
                    let i = rem % lengths[d];
                    rem /= lengths[d];
                    se += i * it.src_strides[d] as u64;
                    de += i * it.dst_strides[d] as u64;
                }
                (se, de)
            })
            .collect()
    }
}

impl Case {
    pub(super) fn layout(&self, tensor: i64) -> Layout {
        let ndim = self.shape.len();
        let mut sstr = vec![1u64; ndim];
        for d in (0..ndim.saturating_sub(1)).rev() {
            sstr[d] = sstr[d + 1] * self.shape[d + 1];
        }
        let src_base: u64 = self.offsets.iter().zip(&sstr).map(|(o, s)| o * s).sum();
        let lengths: Vec<u64> = self.perm.iter().map(|&d| self.lengths[d]).collect();
        let mut ds = vec![0u64; ndim];
        let mut acc = 1u64;
        for &d in self.dst_order.iter().rev() {
            ds[d] = acc;
            acc *= lengths[d] + self.pad[d];
        }
        let dst_base = 3u64;
        let mut item = Item {
            file: 0,
            tensor,
            src_base: src_base as i64,
            dest: 0,
            dst_base: dst_base as i64,
            ndim: ndim as i64,
            ..Item::default()
        };
        for d in 0..ndim {
            item.lengths[d] = lengths[d] as i64;
            item.src_strides[d] = sstr[self.perm[d]] as i64;
            item.dst_strides[d] = ds[d] as i64;
        }
        Layout {
            item,
            dst_len: (dst_base + acc + 2) as usize,
        }
    }
}
