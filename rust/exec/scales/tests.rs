//! The tests of `scales`.

use super::mxfp4_tests::mxfp4_scale;
use super::*;
use crate::exec::read::execute_scaled_reading;
use crate::exec::testutil::*;
use crate::exec::{execute_scaled, Backend, ExecOptions};
use proptest::prelude::*;

/// Dequantized reads: a transposed, offset box of a [5, 7] e4m3 tensor with fp32 scales over [2, 4]
/// blocks (ragged last row and column blocks) equals the scalar formula rounded once to bf16, on both
/// backends and with several threads; bad scales are refused before anything is written.
#[test]
fn scaled_items_equal_the_formula() {
    use crate::kernels::{bf16_to_f32, e4m3fn_to_f32, f32_to_bf16};
    let dir = tempfile::tempdir().unwrap();
    let q: Vec<u8> = random_bytes(35, 9).iter().map(|b| b & 0x77).collect(); // no NaN codes
    let scales: Vec<f32> = (0..6).map(|i| 0.25 + i as f32 * 1.5).collect();
    let sbytes: Vec<u8> = scales.iter().flat_map(|x| x.to_le_bytes()).collect();
    let h = write_file(
        dir.path(),
        "q.safetensors",
        &[
            ("w", Dtype::F8_E4M3, vec![5, 7], q.clone()),
            ("w_scale_inv", Dtype::F32, vec![3, 2], sbytes),
        ],
    );
    let scale = |shape: [i64; 2], block: [i64; 2]| {
        let mut s = Scale {
            file: 0,
            tensor: h.index("w_scale_inv").unwrap() as i64,
            ndim: 2,
            ..Scale::default()
        };
        s.shape[..2].copy_from_slice(&shape);
        s.block[..2].copy_from_slice(&block);
        s
    };
    // rows 1..5, cols 2..7 of w, written transposed: out[c][r] (a [5, 4] destination)
    let mut item = Item {
        file: 0,
        tensor: h.index("w").unwrap() as i64,
        src_base: 7 + 2,
        ndim: 2,
        scale: 1,
        ..Item::default()
    };
    item.lengths[..2].copy_from_slice(&[5, 4]);
    item.src_strides[..2].copy_from_slice(&[1, 7]);
    item.dst_strides[..2].copy_from_slice(&[4, 1]);
    let mut want = vec![0u16; 20];
    for c in 0..5 {
        for r in 0..4 {
            let (row, col) = (r + 1, c + 2);
            let x = e4m3fn_to_f32(q[row * 7 + col]) * scales[(row / 2) * 2 + col / 4];
            want[c * 4 + r] = f32_to_bf16(x);
        }
    }
    for (backend, threads) in [(Backend::Mmap, 1), (Backend::Pread, 3)] {
        let opts = ExecOptions {
            threads: Some(threads),
            backend,
            ..ExecOptions::default()
        };
        let mut out = vec![0u8; 40];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
        let sc = [scale([5, 7], [2, 4])];
        execute_scaled(std::slice::from_ref(&h), &dest, &[item], &sc, &opts).unwrap();
        let got: Vec<u16> = out
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(got, want, "{backend:?}");
        assert!(got.iter().any(|&g| bf16_to_f32(g) != 0.0));
    }
    // rows 1..5 as they are stored: dense runs (the table-decode path), ragged last column block
    let mut dense = item;
    dense.lengths[..2].copy_from_slice(&[4, 7]);
    dense.src_strides[..2].copy_from_slice(&[7, 1]);
    dense.dst_strides[..2].copy_from_slice(&[7, 1]);
    dense.src_base = 7;
    let mut out = vec![0u8; 56];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
    let sc = [scale([5, 7], [2, 4])];
    execute_scaled(
        std::slice::from_ref(&h),
        &dest,
        &[dense],
        &sc,
        &ExecOptions::default(),
    )
    .unwrap();
    for (k, b) in out.chunks_exact(2).enumerate() {
        let (row, col) = (k / 7 + 1, k % 7);
        let x = e4m3fn_to_f32(q[row * 7 + col]) * scales[(row / 2) * 2 + col / 4];
        assert_eq!(
            u16::from_le_bytes([b[0], b[1]]),
            f32_to_bf16(x),
            "element {k}"
        );
    }
    let opts = ExecOptions::default();
    for bad in [
        scale([5, 7], [4, 4]),
        scale([7, 5], [2, 4]),
        scale([5, 7], [0, 4]),
    ] {
        let mut out = vec![0u8; 40];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
        let r = execute_scaled(std::slice::from_ref(&h), &dest, &[item], &[bad], &opts);
        assert!(
            matches!(r, Err(LoadError::Request { .. })),
            "{bad:?}: {r:?}"
        );
        assert!(out.iter().all(|&b| b == 0));
    }
    let mut out = vec![0u8; 20];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F8_E5M2)];
    let r = execute_scaled(
        std::slice::from_ref(&h),
        &dest,
        &[item],
        &[scale([5, 7], [2, 4])],
        &opts,
    );
    assert!(matches!(r, Err(LoadError::Request { .. })), "{r:?}");
}

/// A rank's Shard(1) of transformers' transposed gpt-oss experts (inputs 70..100 of 192, i.e. 32-element
/// groups 2..=3 of 6, of expert 1 of 2, every output row) keeps the window of its two scale columns of
/// the expert's rows decoded, not the whole rows (which held 1.8 GB of `f32` for one rank of gpt-oss-120b
/// under EP 8 x FSDP 32); it reads the whole rows (what the Python side counts), through a buffer of at
/// most a chunk, and dequantizes bit for bit as the whole scale does.
#[test]
fn a_column_slice_keeps_only_its_scale_columns() {
    let dir = tempfile::tempdir().unwrap();
    let (e, y, g) = (2u64, 40u64, 6u64);
    let x = g * 32;
    let exps: Vec<u8> = (0..e * y * g).map(|i| 118 + (i % 17) as u8).collect();
    let h = write_file(
        dir.path(),
        "gpt.safetensors",
        &[
            (
                "w_blocks",
                Dtype::U8,
                vec![e, y, g, 16],
                random_bytes((e * y * g * 16) as usize, 11),
            ),
            ("w_scales", Dtype::U8, vec![e, y, g], exps.clone()),
        ],
    );
    let (lo, cols) = (70u64, 30u64);
    // the model's [in, out] of expert 1: destination (i, j) = logical element (1, j, lo + i)
    let mut item = Item {
        tensor: h.index("w_blocks").unwrap() as i64,
        src_base: (y * x + lo) as i64,
        ndim: 2,
        scale: 1,
        ..Item::default()
    };
    item.lengths[..2].copy_from_slice(&[cols as i64, y as i64]);
    item.src_strides[..2].copy_from_slice(&[1, x as i64]);
    item.dst_strides[..2].copy_from_slice(&[y as i64, 1]);
    let sc = mxfp4_scale(&h, (e, y, x));
    let files = std::slice::from_ref(&h);
    let mut a = vec![0u8; (2 * cols * y) as usize];
    let dests = [DestBuf::from_mut_slice(&mut a, Dtype::BF16)];
    let mut loaded = vec![check_scale(0, &sc, files).unwrap()];
    let per_item = item_scales(files, &dests, &[item], &mut loaded).unwrap();
    let cells = scale_cells(&loaded, &[item], &per_item, false);
    let want = ScaleCells {
        span: (y * g, 2 * y * g),
        window: CellWindow {
            row0: y,
            col0: 2,
            width: 2,
            gcols: g,
        },
    };
    assert_eq!(cells, vec![Some(want)]);
    read_scale_cells(&mut loaded, &cells, files, None, 2, None).unwrap();
    let Kept::E8m0(kept) = &loaded[0].values else {
        panic!("MXFP4's e8m0 bytes are kept as bytes");
    };
    assert_eq!(kept.len() as u64, y * 2, "one row of 2 cells per output");
    assert_eq!(
        loaded[0].bytes,
        y * g,
        "the expert's whole scale rows are read"
    );
    for (r, pair) in kept.chunks_exact(2).enumerate() {
        for (c, &b) in pair.iter().enumerate() {
            let want = exps[((y + r as u64) * g + 2 + c as u64) as usize];
            assert_eq!(b, want, "row {r} col {c}");
        }
    }
    let map = loaded[0].map();
    assert_eq!(map.locate(y * x + lo).0, 0);
    assert_eq!(map.locate(y * x + x + lo + 31).0, 3, "row 1, column 3");
    assert_eq!(map.row_steps(y * x + lo, x), Some((0, 2)));
    // and the read equals the one through the whole scale, bit for bit
    let run = |whole: bool| {
        let mut out = vec![0u8; (2 * cols * y) as usize];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
        let opts = ExecOptions::default();
        execute_scaled_reading(files, &dest, &[item], &[sc], &opts, whole, None).unwrap();
        out
    };
    let (part, whole) = (run(false), run(true));
    assert_eq!(part, whole);
    assert!(part.iter().any(|&b| b != 0));
}

/// Several boxes of one [r, c] e4m3 tensor (random starts and lengths, some transposed into their
/// destination) under one scale of a random block shape: reading only the touched grid rows gives the
/// same bytes as reading the scale whole, and never more scale bytes.
fn check_touched_scales(
    (r, c): (u64, u64),
    (br, bc): (u64, u64),
    boxes: &[([u64; 2], [u64; 2], bool)],
    threads: usize,
    seed: u64,
) {
    let dir = tempfile::tempdir().unwrap();
    // Never zero (e4m3 0x00): every dequantized element is nonzero, so an output of zeros is a miss.
    let q: Vec<u8> = random_bytes((r * c) as usize, seed)
        .iter()
        .map(|b| (b & 0x77).max(1))
        .collect();
    let (gr, gc) = (r.div_ceil(br), c.div_ceil(bc));
    let sbytes: Vec<u8> = (0..gr * gc)
        .flat_map(|i| (0.5 + i as f32 * 0.75).to_le_bytes())
        .collect();
    let h = write_file(
        dir.path(),
        "t.safetensors",
        &[
            ("w", Dtype::F8_E4M3, vec![r, c], q),
            ("w_scale_inv", Dtype::F32, vec![gr, gc], sbytes),
        ],
    );
    let mut sc = Scale {
        tensor: h.index("w_scale_inv").unwrap() as i64,
        ndim: 2,
        ..Scale::default()
    };
    sc.shape[..2].copy_from_slice(&[r as i64, c as i64]);
    sc.block[..2].copy_from_slice(&[br as i64, bc as i64]);
    let mut items = Vec::new();
    let mut at = 0i64;
    for &(lo, len, transposed) in boxes {
        let lo = [lo[0] % r, lo[1] % c];
        let len = [len[0].min(r - lo[0]).max(1), len[1].min(c - lo[1]).max(1)];
        let mut item = Item {
            tensor: h.index("w").unwrap() as i64,
            src_base: (lo[0] * c + lo[1]) as i64,
            dst_base: at,
            ndim: 2,
            scale: 1,
            ..Item::default()
        };
        item.lengths[..2].copy_from_slice(&[len[0] as i64, len[1] as i64]);
        item.src_strides[..2].copy_from_slice(&[c as i64, 1]);
        let dst = match transposed {
            true => [1, len[0] as i64],
            false => [len[1] as i64, 1],
        };
        item.dst_strides[..2].copy_from_slice(&dst);
        at += (len[0] * len[1]) as i64;
        items.push(item);
    }
    let run = |whole: bool| {
        let opts = ExecOptions {
            threads: Some(threads),
            ..ExecOptions::default()
        };
        let mut out = vec![0u8; at as usize * 2];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
        let sc = [sc];
        let stats = execute_scaled_reading(
            std::slice::from_ref(&h),
            &dest,
            &items,
            &sc,
            &opts,
            whole,
            None,
        )
        .unwrap();
        (out, stats.bytes_read_from_files - stats.bytes_copied / 2)
    };
    let ((part, part_bytes), (whole, whole_bytes)) = (run(false), run(true));
    assert_eq!(
        part, whole,
        "boxes {boxes:?} over [{r}, {c}] blocks [{br}, {bc}]"
    );
    assert!(
        part.chunks(2).all(|e| e != [0, 0]),
        "an element was not written"
    );
    assert!(part_bytes <= whole_bytes, "{part_bytes} > {whole_bytes}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn touched_scale_rows_equal_the_whole_scale(
        (r, c) in (1u64..40, 1u64..40),
        (br, bc) in (1u64..12, 1u64..12),
        boxes in proptest::collection::vec(
            (prop::array::uniform2(0u64..40), prop::array::uniform2(1u64..40), any::<bool>()),
            1..4,
        ),
        threads in 1usize..3,
        seed in any::<u64>(),
    ) {
        check_touched_scales((r, c), (br, bc), &boxes, threads, seed);
    }
}

/// An expert-parallel rank's share: experts 3..4 of 8 of an MXFP4 `[8, Y, G, 16]` tensor (and a dim-0
/// eighth of an FP8 [64, 24] tensor with [4, 8] blocks) read 1/8 of their scale bytes, not the whole.
#[test]
fn a_dim0_eighth_reads_an_eighth_of_the_scales() {
    let dir = tempfile::tempdir().unwrap();
    let (e, y, g) = (8u64, 6u64, 2u64);
    let exps: Vec<u8> = (0..e * y * g).map(|i| 120 + (i % 9) as u8).collect();
    let q: Vec<u8> = random_bytes(64 * 24, 3).iter().map(|b| b & 0x77).collect();
    let fscales: Vec<u8> = (0..16 * 3)
        .flat_map(|i| (1.0 + i as f32).to_le_bytes())
        .collect();
    let h = write_file(
        dir.path(),
        "ep.safetensors",
        &[
            (
                "w_blocks",
                Dtype::U8,
                vec![e, y, g, 16],
                random_bytes((e * y * g * 16) as usize, 4),
            ),
            ("w_scales", Dtype::U8, vec![e, y, g], exps),
            ("f", Dtype::F8_E4M3, vec![64, 24], q),
            ("f_scale_inv", Dtype::F32, vec![16, 3], fscales),
        ],
    );
    let x = g * 32;
    let mut mx = Item {
        tensor: h.index("w_blocks").unwrap() as i64,
        src_base: (3 * y * x) as i64,
        ndim: 1,
        scale: 1,
        ..Item::default()
    };
    mx.lengths[0] = (y * x) as i64;
    mx.src_strides[0] = 1;
    mx.dst_strides[0] = 1;
    let mut mxs = Scale {
        tensor: h.index("w_scales").unwrap() as i64,
        ndim: 3,
        ..Scale::default()
    };
    mxs.shape[..3].copy_from_slice(&[e as i64, y as i64, x as i64]);
    mxs.block[..3].copy_from_slice(&[1, 1, 32]);
    let mut fp = Item {
        tensor: h.index("f").unwrap() as i64,
        src_base: 5 * 8 * 24,
        dest: 1,
        ndim: 2,
        scale: 2,
        ..Item::default()
    };
    fp.lengths[..2].copy_from_slice(&[8, 24]);
    fp.src_strides[..2].copy_from_slice(&[24, 1]);
    fp.dst_strides[..2].copy_from_slice(&[24, 1]);
    let mut fps = Scale {
        tensor: h.index("f_scale_inv").unwrap() as i64,
        ndim: 2,
        ..Scale::default()
    };
    fps.shape[..2].copy_from_slice(&[64, 24]);
    fps.block[..2].copy_from_slice(&[4, 8]);
    for (item, whole_scale, data) in [(mx, e * y * g, y * x / 2), (fp, 16 * 3 * 4, 8 * 24)] {
        let mut a = vec![0u8; 4 * (y * x) as usize];
        let mut b = vec![0u8; 4 * 8 * 24];
        for backend in [Backend::Mmap, Backend::Pread] {
            let opts = ExecOptions {
                backend,
                ..ExecOptions::default()
            };
            let dest = [
                DestBuf::from_mut_slice(&mut a, Dtype::F32),
                DestBuf::from_mut_slice(&mut b, Dtype::F32),
            ];
            let read = |whole: bool| {
                execute_scaled_reading(
                    std::slice::from_ref(&h),
                    &dest,
                    &[item],
                    &[mxs, fps],
                    &opts,
                    whole,
                    None,
                )
                .unwrap()
                .bytes_read_from_files
            };
            // the weight bytes are the same either way (the mmap backend counts the even and odd
            // nibble runs of a 4-bit box separately): the difference is the scale bytes not read
            let (part, whole) = (read(false), read(true));
            assert!(
                part >= data + whole_scale / 8,
                "{part} {item:?} {backend:?}"
            );
            assert_eq!(
                whole - part,
                whole_scale - whole_scale / 8,
                "{item:?} {backend:?}"
            );
        }
        assert!(a.iter().chain(&b).any(|&v| v != 0));
    }
}
