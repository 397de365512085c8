//! The MXFP4 tests of `scales`: boxes of e2m1 pairs with e8m0 scales against the formula, transformers'
//! transposed layout, sparse files, bad scales refused.

use super::*;
use crate::exec::testutil::*;
use crate::exec::{execute_scaled, Backend, ExecOptions};
use proptest::prelude::*;

/// The e8m0 scale record of `h`'s `w_scales` for the logical `[e, y, x]` MXFP4 tensor (one cell per 32
/// elements of the last dim).
pub(super) fn mxfp4_scale(h: &Header, (e, y, x): (u64, u64, u64)) -> Scale {
    let mut sc = Scale {
        file: 0,
        tensor: h.index("w_scales").unwrap() as i64,
        ndim: 3,
        ..Scale::default()
    };
    sc.shape[..3].copy_from_slice(&[e as i64, y as i64, x as i64]);
    sc.block[..3].copy_from_slice(&[1, 1, 32]);
    sc
}

/// An MXFP4 box: a stored `[E, Y, G, 16]` U8 tensor (two e2m1 codes a byte, low nibble first) with e8m0
/// scales `[E, Y, G]` is the logical `[E, Y, G * 32]` tensor of 4-bit elements; a box of it (any start,
/// odd or even, any permutation of its dims into the destination, as transformers' transposed
/// `[E, G * 32, Y]`) equals the formula `e2m1(code) * 2^(e - 127)` element by element, written here with
/// plain arithmetic (a table of the 16 codes from sign, exponent and mantissa bits, `powi`).
fn check_mxfp4(
    (e, y, g): (u64, u64, u64),
    lo: [u64; 3],
    len: [u64; 3],
    perm: [usize; 3],
    to_f32: bool,
    threads: usize,
    seed: u64,
) {
    use crate::kernels::f32_to_bf16;
    let dir = tempfile::tempdir().unwrap();
    let x = g * 32;
    let blocks = random_bytes((e * y * g * 16) as usize, seed);
    let exps: Vec<u8> = random_bytes((e * y * g) as usize, seed ^ 5)
        .iter()
        .map(|b| 120 + b % 16)
        .collect();
    let h = write_file(
        dir.path(),
        "m.safetensors",
        &[
            ("pad", Dtype::U8, vec![3], vec![1, 2, 3]),
            ("w_blocks", Dtype::U8, vec![e, y, g, 16], blocks.clone()),
            ("w_scales", Dtype::U8, vec![e, y, g], exps.clone()),
        ],
    );
    let shape = [e, y, x];
    let strides = [y * x, x, 1];
    let lens: Vec<u64> = (0..3)
        .map(|d| len[d].min(shape[d] - lo[d]).max(1))
        .collect();
    // destination: the box with its dims in `perm` order, row-major
    let dshape: Vec<u64> = perm.iter().map(|&d| lens[d]).collect();
    let mut dstride = [0u64; 3];
    let mut acc = 1;
    for k in (0..3).rev() {
        dstride[perm[k]] = acc;
        acc *= dshape[k];
    }
    let mut item = Item {
        file: 0,
        tensor: h.index("w_blocks").unwrap() as i64,
        src_base: (0..3).map(|d| lo[d] * strides[d]).sum::<u64>() as i64,
        ndim: 3,
        scale: 1,
        ..Item::default()
    };
    for d in 0..3 {
        item.lengths[d] = lens[d] as i64;
        item.src_strides[d] = strides[d] as i64;
        item.dst_strides[d] = dstride[d] as i64;
    }
    let sc = mxfp4_scale(&h, (e, y, x));
    // the reference, from the bits of each code
    let e2m1 = |c: u8| -> f32 {
        let (sign, exp, man) = (c >> 3, (c >> 1) & 3, c & 1);
        let mag = match exp {
            0 => 0.5 * f32::from(man),
            _ => (1.0 + 0.5 * f32::from(man)) * 2f32.powi(i32::from(exp) - 1),
        };
        if sign == 1 {
            -mag
        } else {
            mag
        }
    };
    let (dt, size) = if to_f32 {
        (Dtype::F32, 4)
    } else {
        (Dtype::BF16, 2)
    };
    let total: u64 = lens.iter().product();
    let mut want = vec![0u8; total as usize * size];
    for i in 0..lens[0] {
        for j in 0..lens[1] {
            for k in 0..lens[2] {
                let (a, b, c) = (lo[0] + i, lo[1] + j, lo[2] + k);
                let flat = (a * y + b) * x + c;
                let byte = blocks[(flat / 2) as usize];
                let code = if flat % 2 == 0 { byte & 15 } else { byte >> 4 };
                let s = exps[((a * y + b) * g + c / 32) as usize];
                let v = e2m1(code) * 2f32.powi(i32::from(s) - 127);
                let at = (i * dstride[0] + j * dstride[1] + k * dstride[2]) as usize * size;
                match to_f32 {
                    true => want[at..at + 4].copy_from_slice(&v.to_le_bytes()),
                    false => want[at..at + 2].copy_from_slice(&f32_to_bf16(v).to_le_bytes()),
                }
            }
        }
    }
    for backend in [Backend::Mmap, Backend::Pread] {
        let opts = ExecOptions {
            threads: Some(threads),
            backend,
            ..ExecOptions::default()
        };
        let mut out = vec![0xaau8; want.len()];
        let dest = [DestBuf::from_mut_slice(&mut out, dt)];
        let stats = execute_scaled(std::slice::from_ref(&h), &dest, &[item], &[sc], &opts).unwrap();
        assert_eq!(out, want, "{backend:?} box {lo:?}+{lens:?} perm {perm:?}");
        assert_eq!(stats.bytes_copied, want.len() as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn mxfp4_boxes_equal_the_formula(
        (e, y, g) in (1u64..4, 1u64..6, 1u64..3),
        lo in prop::array::uniform3(0u64..64),
        len in prop::array::uniform3(1u64..70),
        perm in Just([0usize, 1, 2]).prop_shuffle(),
        to_f32 in any::<bool>(),
        threads in 1usize..4,
        seed in any::<u64>(),
    ) {
        let shape = [e, y, g * 32];
        let lo = [lo[0] % shape[0], lo[1] % shape[1], lo[2] % shape[2]];
        let perm = [perm[0], perm[1], perm[2]];
        check_mxfp4((e, y, g), lo, len, perm, to_f32, threads, seed);
    }
}

/// A sparse rehearsal file (header, then holes) of MXFP4 experts, warm, goes to `pread` under `auto` as
/// any mostly-holes file does (its hole pages are single-page folios, costly to map): the transposed runs
/// stay whole there (`tasks::pieces_and_tasks`); the values are those of the holes (zero codes).
#[test]
fn auto_reads_a_sparse_mxfp4_file_with_pread() {
    let dir = tempfile::tempdir().unwrap();
    let (e, y, g) = (1u64, 512u64, 8u64);
    let nblocks = e * y * g * 16;
    let h = write_file(
        dir.path(),
        "m.safetensors",
        &[
            (
                "w_scales",
                Dtype::U8,
                vec![e, y, g],
                vec![127; (e * y * g) as usize],
            ),
            (
                "w_blocks",
                Dtype::U8,
                vec![e, y, g, 16],
                random_bytes(nblocks as usize, 4),
            ),
        ],
    );
    let h = punch_tail(&h, nblocks); // the blocks punched out: a hole, zeros when read
    let x = g * 32;
    let mut item = Item {
        file: 0,
        tensor: h.index("w_blocks").unwrap() as i64,
        ndim: 3,
        scale: 1,
        ..Item::default()
    };
    // transformers' transposed layout [E, X, Y]: repeated runs, one per row of the logical tensor
    for (d, (len, (src, dst))) in [(e, (y * x, x * y)), (y, (x, 1)), (x, (1, y))]
        .into_iter()
        .enumerate()
    {
        item.lengths[d] = len as i64;
        item.src_strides[d] = src as i64;
        item.dst_strides[d] = dst as i64;
    }
    let sc = mxfp4_scale(&h, (e, y, x));
    // Warm, as a rehearsal's timed runs are: a hole's first read puts zero pages in the page cache, and a
    // cold file goes to `pread` whatever it holds (the residency probe).
    std::fs::read(&h.path).unwrap();
    let mut out = vec![0xaau8; (e * y * x * 2) as usize];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
    let stats = execute_scaled(
        std::slice::from_ref(&h),
        &dest,
        &[item],
        &[sc],
        &ExecOptions::default(),
    )
    .unwrap();
    assert_eq!(stats.backend, "pread", "{stats:?}");
    assert!(out.iter().all(|&b| b == 0));
}

/// The transformers layout of gpt-oss experts (`[E, G * 32, Y]`, the logical tensor transposed) from
/// odd and even starts of the 32-element groups, over one or several tiles of the row-stepping kernel,
/// and bad MXFP4 scales refused before any write.
#[test]
fn mxfp4_transposed_and_refused() {
    check_mxfp4((2, 5, 2), [1, 0, 15], [1, 5, 34], [0, 2, 1], false, 2, 7);
    check_mxfp4((2, 5, 2), [0, 1, 0], [2, 4, 64], [0, 2, 1], true, 1, 8);
    // runs longer than a tile of the row-stepping kernel (several tiles, a ragged last one)
    check_mxfp4((1, 300, 1), [0, 3, 5], [1, 297, 20], [0, 2, 1], false, 1, 9);
    check_mxfp4((2, 260, 2), [1, 0, 30], [1, 260, 5], [0, 2, 1], true, 2, 10);
    // a transposed run longer than the smallest task chunk (64 KiB): bands of rows, every column each
    check_mxfp4(
        (1, 6000, 1),
        [0, 0, 3],
        [1, 6000, 21],
        [0, 2, 1],
        false,
        2,
        11,
    );
    let dir = tempfile::tempdir().unwrap();
    let h = write_file(
        dir.path(),
        "m.safetensors",
        &[
            ("w_blocks", Dtype::U8, vec![2, 3, 1, 16], vec![0x21; 96]),
            ("w_scales", Dtype::U8, vec![2, 3, 1], vec![127; 6]),
        ],
    );
    let mut item = Item {
        tensor: h.index("w_blocks").unwrap() as i64,
        scale: 1,
        ..flat_item(192)
    };
    let scale = |shape: [i64; 3], block: [i64; 3]| {
        let mut s = Scale {
            tensor: h.index("w_scales").unwrap() as i64,
            ndim: 3,
            ..Scale::default()
        };
        s.shape[..3].copy_from_slice(&shape);
        s.block[..3].copy_from_slice(&block);
        s
    };
    let opts = ExecOptions::default();
    let mut out = vec![0u8; 192 * 4];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
    execute_scaled(
        std::slice::from_ref(&h),
        &dest,
        &[item],
        &[scale([2, 3, 32], [1, 1, 32])],
        &opts,
    )
    .unwrap();
    let got: Vec<f32> = out
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(
        got.chunks_exact(2).all(|p| p == [0.5, 1.0]),
        "low nibble first"
    );
    // the scale of 4-bit elements must describe twice the bytes, in rows of the stored last dim
    for bad in [scale([2, 3, 16], [1, 1, 16]), scale([2, 6, 16], [1, 1, 32])] {
        let mut out = vec![0u8; 192 * 4];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        let r = execute_scaled(std::slice::from_ref(&h), &dest, &[item], &[bad], &opts);
        assert!(
            matches!(r, Err(LoadError::Request { .. })),
            "{bad:?}: {r:?}"
        );
        assert!(out.iter().all(|&b| b == 0));
    }
    // a box past the 192 4-bit elements is refused
    item.lengths[0] = 193;
    let mut out = vec![0u8; 193 * 4];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
    let r = execute_scaled(
        std::slice::from_ref(&h),
        &dest,
        &[item],
        &[scale([2, 3, 32], [1, 1, 32])],
        &opts,
    );
    assert!(matches!(r, Err(LoadError::Request { .. })), "{r:?}");
}
