//! The tests of `read`.

use super::*;
use crate::dtype::Dtype;
use crate::exec::testutil::*;
use crate::exec::{execute, DEFAULT_PREAD_GAP};
use crate::kernels::cast_dense;
use proptest::prelude::*;

fn check(c: &Case) {
    let (sd, dd) = PAIRS[c.pair];
    let numel: u64 = c.shape.iter().product();
    let ssize = sd.byte_size().unwrap();
    let dsize = dd.byte_size().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let pre = random_bytes(24, c.seed ^ 7);
    let data = random_bytes(numel as usize * ssize, c.seed);
    let h = write_file(
        dir.path(),
        "t.safetensors",
        &[
            ("pre", Dtype::U8, vec![24], pre),
            ("t", sd, c.shape.clone(), data.clone()),
        ],
    );
    let layout = c.layout(h.index("t").unwrap() as i64);
    let mut out = vec![0xeeu8; layout.dst_len * dsize];
    let opts = ExecOptions {
        threads: Some(c.threads),
        backend: c.backend,
        pread_gap: c.gap,
        ..ExecOptions::default()
    };
    let dest = [DestBuf::from_mut_slice(&mut out, dd)];
    execute(&[h], &dest, &[layout.item], &opts).unwrap();
    // Naive element-by-element reference.
    let mut want = vec![0xeeu8; layout.dst_len * dsize];
    for (se, de) in layout.elements() {
        let (se, de) = (se as usize * ssize, de as usize * dsize);
        cast_dense(sd, dd, &data[se..se + ssize], &mut want[de..de + dsize]);
    }
    assert_eq!(out, want);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn region_copy_matches_naive(c in case()) {
        check(&c);
    }
}

/// Column slices (repeated runs) of row-major tensors whose rows are far apart (expanded for a map
/// and for pread), long enough for direct preads, split into groups of rows, and two items reading
/// interleaved columns of one tensor: every backend, gap and thread count copies the right bytes,
/// counts 1-d runs and copied bytes exactly, and pread reads the interleaved span only once.
#[test]
fn repeated_runs_match_naive_across_backends() {
    let dir = tempfile::tempdir().unwrap();
    let shapes: [(&str, u64, u64); 3] =
        [("far", 16, 200_000), ("v", 1024, 2048), ("d", 4, 150_000)];
    let tensors: Vec<(&str, Dtype, Vec<u64>, Vec<u8>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, r, c))| {
            (
                n,
                Dtype::U8,
                vec![r, c],
                random_bytes((r * c) as usize, i as u64 + 3),
            )
        })
        .collect();
    let h = write_file(dir.path(), "rep.safetensors", &tensors);
    // (tensor, first column, columns): rows are all rows of the tensor.
    let boxes: [(usize, u64, u64); 5] = [
        (0, 1000, 2000),
        (1, 100, 512),
        (2, 10, 100_000),
        (1, 0, 96),
        (1, 1024, 96),
    ];
    let want: Vec<Vec<u8>> = boxes
        .iter()
        .map(|&(t, c0, n)| {
            let (cols, data) = (tensors[t].2[1], &tensors[t].3);
            data.chunks(cols as usize)
                .flat_map(|row| row[c0 as usize..(c0 + n) as usize].to_vec())
                .collect()
        })
        .collect();
    let items: Vec<Item> = boxes
        .iter()
        .enumerate()
        .map(|(k, &(t, c0, n))| {
            let mut item = Item {
                tensor: h.index(tensors[t].0).unwrap() as i64,
                src_base: c0 as i64,
                dest: k as i64,
                ndim: 2,
                ..Item::default()
            };
            let (rows, cols) = (tensors[t].2[0] as i64, tensors[t].2[1] as i64);
            item.lengths[..2].copy_from_slice(&[rows, n as i64]);
            item.src_strides[..2].copy_from_slice(&[cols, 1]);
            item.dst_strides[..2].copy_from_slice(&[n as i64, 1]);
            item
        })
        .collect();
    let rows: usize = boxes.iter().map(|b| tensors[b.0].2[0] as usize).sum();
    let nbytes: u64 = want.iter().map(|w| w.len() as u64).sum();
    for backend in [Backend::Mmap, Backend::Pread, Backend::Auto] {
        for gap in [0, 4096, DEFAULT_PREAD_GAP] {
            for threads in [1, 3] {
                let mut outs: Vec<Vec<u8>> = want.iter().map(|w| vec![0u8; w.len()]).collect();
                let dests: Vec<DestBuf<'_>> = outs
                    .iter_mut()
                    .map(|o| DestBuf::from_mut_slice(o, Dtype::U8))
                    .collect();
                let opts = ExecOptions {
                    threads: Some(threads),
                    backend,
                    pread_gap: gap,
                    ..ExecOptions::default()
                };
                let stats = execute(std::slice::from_ref(&h), &dests, &items, &opts).unwrap();
                let tag = format!("{backend:?} gap {gap} threads {threads}: {stats:?}");
                assert_eq!(outs, want, "{tag}");
                assert_eq!((stats.runs, stats.bytes_copied), (rows, nbytes), "{tag}");
                match stats.backend {
                    "mmap" => assert_eq!(stats.bytes_read_from_files, nbytes, "{tag}"),
                    // The interleaved items' span of v (2 MiB) is read once, not once per item.
                    _ => assert!(stats.bytes_read_from_files < nbytes + (3 << 20), "{tag}"),
                }
            }
        }
    }
}

#[test]
fn large_runs_split_over_threads_and_backends_agree() {
    let dir = tempfile::tempdir().unwrap();
    let data = random_bytes(3 << 20, 5);
    let h = write_file(
        dir.path(),
        "big.safetensors",
        &[("w", Dtype::BF16, vec![1536, 1024], data)],
    );
    let mut results = Vec::new();
    for backend in [Backend::Mmap, Backend::Pread] {
        for (lengths, base) in [([768i64, 1024], 768 * 1024), ([1536, 256], 512)] {
            let mut out = vec![0u8; (lengths[0] * lengths[1] * 4) as usize];
            let mut item = Item {
                ndim: 2,
                src_base: base,
                ..Item::default()
            };
            item.lengths[..2].copy_from_slice(&lengths);
            item.src_strides[..2].copy_from_slice(&[1024, 1]);
            item.dst_strides[..2].copy_from_slice(&[lengths[1], 1]);
            let opts = ExecOptions {
                threads: Some(2),
                backend,
                ..ExecOptions::default()
            };
            let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
            let stats = execute(std::slice::from_ref(&h), &dest, &[item], &opts).unwrap();
            let want = if backend == Backend::Pread { 4 } else { 2 };
            assert_eq!(stats.threads, want.min(stats.spans), "{stats:?}");
            assert_eq!(stats.backend, backend.name());
            results.push(out);
        }
    }
    assert_eq!(results[0], results[2]);
    assert_eq!(results[1], results[3]);
}

/// A read whose interrupt says stop from the start (asked after the first poll interval) returns
/// `Interrupted` before its last task; the same read without it then copies every byte.
#[test]
fn an_interrupted_read_stops_and_the_next_one_reads() {
    use std::sync::atomic::AtomicBool;
    let dir = tempfile::tempdir().unwrap();
    let (rows, cols) = (16384u64, 8192u64); // 256 MiB of bf16, a sparse file (the test data is zeros)
    let path = dir.path().join("sparse.safetensors");
    let json = format!(
        r#"{{"w":{{"dtype":"BF16","shape":[{rows},{cols}],"data_offsets":[0,{}]}}}}"#,
        rows * cols * 2
    );
    let mut head = (json.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(json.as_bytes());
    std::fs::write(&path, &head).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(head.len() as u64 + rows * cols * 2).unwrap();
    let h = Arc::new(Header::read(&path).unwrap());
    let mut item = Item {
        ndim: 2,
        ..Item::default()
    };
    item.lengths[..2].copy_from_slice(&[rows as i64, cols as i64]);
    item.src_strides[..2].copy_from_slice(&[cols as i64, 1]);
    item.dst_strides[..2].copy_from_slice(&[cols as i64, 1]);
    let mut out = vec![1u8; (rows * cols * 2) as usize];
    for backend in [Backend::Mmap, Backend::Pread] {
        out.fill(1);
        let opts = ExecOptions {
            threads: Some(1),
            backend,
            interrupt: Some(crate::exec::Interrupt::flag(Arc::new(AtomicBool::new(
                true,
            )))),
            ..ExecOptions::default()
        };
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
        match execute(std::slice::from_ref(&h), &dest, &[item], &opts) {
            Err(LoadError::Interrupted { done, tasks }) => assert!(done < tasks, "{backend:?}"),
            other => panic!("{backend:?}: {other:?}"),
        }
        assert!(out.contains(&1), "{backend:?}: some bytes were not read");
        let opts = ExecOptions {
            backend,
            ..ExecOptions::default()
        };
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
        execute(std::slice::from_ref(&h), &dest, &[item], &opts).unwrap();
        assert!(out.iter().all(|&b| b == 0), "{backend:?}");
    }
}

/// `auto` on a cached file: a long contiguous box and a column slice (the gather kernel) of one tensor in
/// one call land exactly with 1 and 2 threads, and a file truncated before the call is a typed error.
#[test]
fn auto_reads_rows_and_columns_of_a_cached_file_in_one_call() {
    let dir = tempfile::tempdir().unwrap();
    let (rows, cols) = (1024u64, 4096u64);
    let data = random_bytes((rows * cols) as usize, 11);
    let h = write_file(
        dir.path(),
        "mix.safetensors",
        &[("w", Dtype::U8, vec![rows, cols], data.clone())],
    );
    let t = h.index("w").unwrap() as i64;
    let box_item = |r0: u64, nr: u64, c0: u64, nc: u64, dest: i64| {
        let mut item = Item {
            tensor: t,
            src_base: (r0 * cols + c0) as i64,
            dest,
            ndim: 2,
            ..Item::default()
        };
        item.lengths[..2].copy_from_slice(&[nr as i64, nc as i64]);
        item.src_strides[..2].copy_from_slice(&[cols as i64, 1]);
        item.dst_strides[..2].copy_from_slice(&[nc as i64, 1]);
        item
    };
    // Rows 0..512 whole (2 MiB contiguous), and columns 1024..1536 of rows 512..1024.
    let items = [
        box_item(0, 512, 0, cols, 0),
        box_item(512, 512, 1024, 512, 1),
    ];
    let want_rows = data[..(512 * cols) as usize].to_vec();
    let want_cols: Vec<u8> = data[(512 * cols) as usize..]
        .chunks(cols as usize)
        .flat_map(|row| row[1024..1536].to_vec())
        .collect();
    for threads in [1, 2] {
        let (mut a, mut b) = (vec![0u8; want_rows.len()], vec![0u8; want_cols.len()]);
        let dests = [
            DestBuf::from_mut_slice(&mut a, Dtype::U8),
            DestBuf::from_mut_slice(&mut b, Dtype::U8),
        ];
        let opts = ExecOptions {
            threads: Some(threads),
            ..ExecOptions::default()
        };
        let stats = execute(std::slice::from_ref(&h), &dests, &items, &opts).unwrap();
        assert_eq!(stats.backend, "mmap", "{stats:?}");
        assert_eq!((a == want_rows, b == want_cols), (true, true), "{stats:?}");
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&h.path)
        .unwrap();
    f.set_len(h.file_len / 2).unwrap();
    let (mut a, mut b) = (vec![0u8; want_rows.len()], vec![0u8; want_cols.len()]);
    let dests = [
        DestBuf::from_mut_slice(&mut a, Dtype::U8),
        DestBuf::from_mut_slice(&mut b, Dtype::U8),
    ];
    let r = execute(
        std::slice::from_ref(&h),
        &dests,
        &items,
        &ExecOptions::default(),
    );
    assert!(matches!(r, Err(LoadError::Truncated { .. })), "{r:?}");
}

/// `auto` reads a file that is mostly holes with `pread` (its cached hole pages are single-page folios), the
/// same bytes exactly; a dense file of the same layout is mapped.
#[test]
fn auto_reads_a_sparse_file_with_pread() {
    let dir = tempfile::tempdir().unwrap();
    let n = 1u64 << 20;
    let h = write_file(
        dir.path(),
        "sparse.safetensors",
        &[("w", Dtype::U8, vec![n], random_bytes(n as usize, 3))],
    );
    // Punch the data out again: the same header, a hole where the bytes were (zeros when read).
    let h = punch_tail(&h, n);
    let _ = std::fs::read(&h.path).unwrap(); // cached, as a rehearsal's second run finds it
    let item = flat_item(n as i64);
    let mut out = vec![1u8; n as usize];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
    let one = ExecOptions {
        threads: Some(1),
        ..ExecOptions::default()
    };
    let stats = execute(std::slice::from_ref(&h), &dest, &[item], &one).unwrap();
    // cached holes: no storage to wait on, so no extra I/O workers (nor their descriptors)
    assert_eq!((stats.backend, stats.threads), ("pread", 1), "{stats:?}");
    assert!(out.iter().all(|&b| b == 0));
    let dense = write_file(
        dir.path(),
        "dense.safetensors",
        &[("w", Dtype::U8, vec![n], random_bytes(n as usize, 3))],
    );
    let _ = std::fs::read(&dense.path).unwrap(); // cached: auto maps it
    let item = flat_item(n as i64);
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
    let stats = execute(
        std::slice::from_ref(&dense),
        &dest,
        &[item],
        &ExecOptions::default(),
    )
    .unwrap();
    assert_eq!(stats.backend, "mmap", "{stats:?}");
    assert_eq!(out, random_bytes(n as usize, 3));
}

#[test]
fn truncated_changed_and_panics_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let h = write_file(
        dir.path(),
        "t.safetensors",
        &[("w", Dtype::U8, vec![4096], random_bytes(4096, 1))],
    );
    let item = flat_item(4096);
    let mut out = vec![0u8; 4096];
    for backend in [Backend::Mmap, Backend::Pread, Backend::Auto] {
        let opts = ExecOptions {
            backend,
            ..ExecOptions::default()
        };
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
        assert!(execute(std::slice::from_ref(&h), &dest, &[item], &opts).is_ok());
    }
    let bad = write_file(
        dir.path(),
        "inject-panic.safetensors",
        &[("w", Dtype::U8, vec![4096], vec![0; 4096])],
    );
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
    let r = execute(
        &[bad],
        &dest,
        &[item],
        &ExecOptions {
            threads: Some(2),
            ..ExecOptions::default()
        },
    );
    match r {
        Err(LoadError::WorkerPanicked { message }) => assert!(message.contains("injected")),
        other => panic!("{other:?}"),
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&h.path)
        .unwrap();
    f.set_len(1000).unwrap();
    for backend in [Backend::Mmap, Backend::Pread, Backend::Auto] {
        let opts = ExecOptions {
            backend,
            ..ExecOptions::default()
        };
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
        match execute(std::slice::from_ref(&h), &dest, &[item], &opts) {
            Err(LoadError::Truncated {
                expected,
                actual: 1000,
                ..
            }) => assert_eq!(expected, h.file_len),
            other => panic!("{other:?}"),
        }
    }
    f.set_len(h.file_len).unwrap();
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
    std::thread::sleep(std::time::Duration::from_millis(20));
    f.set_len(h.file_len + 1).unwrap();
    assert!(matches!(
        execute(
            std::slice::from_ref(&h),
            &dest,
            &[item],
            &ExecOptions::default()
        ),
        Err(LoadError::Changed { .. })
    ));
}
