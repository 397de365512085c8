//! The tests of `runs`.

use super::*;

fn header(tensors: &[(&str, Dtype, &[u64])]) -> Arc<Header> {
    let mut json = String::from("{");
    let mut off = 0;
    for (i, (name, dt, shape)) in tensors.iter().enumerate() {
        let n: u64 = shape.iter().product::<u64>() * dt.bits() / 8;
        if i > 0 {
            json.push(',');
        }
        json.push_str(&format!(
            r#""{name}":{{"dtype":"{dt}","shape":{shape:?},"data_offsets":[{off},{}]}}"#,
            off + n
        ));
        off += n;
    }
    json.push('}');
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json.as_bytes());
    b.resize(b.len() + off as usize, 0);
    Arc::new(Header::parse("t.safetensors".as_ref(), &b, b.len() as u64).unwrap())
}

fn item(tensor: i64, lengths: &[i64], ss: &[i64], ds: &[i64]) -> Item {
    let mut it = Item {
        tensor,
        ndim: lengths.len() as i64,
        ..Item::default()
    };
    it.lengths[..lengths.len()].copy_from_slice(lengths);
    it.src_strides[..ss.len()].copy_from_slice(ss);
    it.dst_strides[..ds.len()].copy_from_slice(ds);
    it
}

fn message(r: Result<Vec<Run>, LoadError>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn contiguous_box_is_one_run_and_transpose_keeps_runs_long() {
    let h = header(&[("w", Dtype::F32, &[4, 8])]);
    let mut out = vec![0u8; 4 * 8 * 4];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
    let runs = plan(
        std::slice::from_ref(&h),
        &dest,
        &[item(0, &[4, 8], &[8, 1], &[8, 1])],
    )
    .unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].count, 32);
    // Transposed destination: runs follow the destination's unit stride, the source is strided.
    // It is one run repeated along the source's unit stride.
    let runs = plan(&[h], &dest, &[item(0, &[4, 8], &[8, 1], &[1, 4])]).unwrap();
    assert_eq!(runs.len(), 1);
    let r = runs[0];
    assert_eq!((r.count, r.src_stride, r.dst_stride), (4, 32, 4), "{r:?}");
    assert_eq!((r.reps, r.rep_src_stride, r.rep_dst_stride), (8, 4, 16));
}

#[test]
fn column_slices_are_repeated_runs() {
    let h = header(&[
        ("w", Dtype::BF16, &[6, 10]),
        ("c", Dtype::BF16, &[3, 4, 10]),
    ]);
    let files = [h.clone()];
    let mut out = vec![0u8; 4096];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
    let base = dest[0].addr();
    // Columns 2..5 of every row of w into a contiguous [6, 3] f32 buffer: one run, one rep per row.
    let col = Item {
        src_base: 2,
        ..item(0, &[6, 3], &[10, 1], &[3, 1])
    };
    let runs = plan(&files, &dest, &[col]).unwrap();
    assert_eq!(runs.len(), 1);
    let r = runs[0];
    assert_eq!(r.src_off, h.data_start + 4);
    assert_eq!(
        (r.count, r.src_stride, r.dst_addr, r.dst_stride),
        (3, 2, base, 4)
    );
    assert_eq!((r.reps, r.rep_src_stride, r.rep_dst_stride), (6, 20, 12));
    assert_eq!(
        (r.run_extent(), r.src_extent(), r.needed_bytes()),
        (6, 106, 36)
    );
    assert_eq!(r.rep(5).src_off, r.src_off + 100);
    assert_eq!(r.rep(5).dst_addr, base + 60);
    // A 3-d box of c ([1..3, 0..3, 5..9]): one run per outer index, each repeated over the middle dim.
    let cube = Item {
        src_base: 40 + 5,
        ..item(1, &[2, 3, 4], &[40, 10, 1], &[12, 4, 1])
    };
    let runs = plan(&files, &dest, &[cube]).unwrap();
    assert_eq!(runs.len(), 2);
    for (i, r) in runs.iter().enumerate() {
        let tensor_start = h.data_start + h.tensors[1].begin;
        assert_eq!(r.src_off, tensor_start + (40 * (i as u64 + 1) + 5) * 2);
        assert_eq!(r.dst_addr, base + i * 48);
        assert_eq!(
            (r.count, r.reps, r.rep_src_stride, r.rep_dst_stride),
            (4, 3, 20, 16)
        );
    }
    // Overlaps between repetitions are found and name the items.
    let below = Item {
        dst_base: 15,
        ..col
    };
    let m = message(plan(&files, &dest, &[col, below]));
    assert!(
        m.contains("overlap") && m.contains("item 0") && m.contains("item 1"),
        "{m}"
    );
    let m = message(plan(&files, &dest, &[item(0, &[6, 3], &[10, 1], &[0, 1])]));
    assert!(m.contains("item 0") && m.contains("several times"), "{m}");
    let m = message(plan(&files, &dest, &[item(0, &[6, 3], &[10, 1], &[2, 1])]));
    assert!(m.contains("item 0") && m.contains("several times"), "{m}");
    // Sub-byte: every repetition must start on a byte boundary.
    let h4 = header(&[("f", Dtype::F4, &[4, 6]), ("g", Dtype::F4, &[4, 5])]);
    let mut packed = vec![0u8; 64];
    let dest4 = [DestBuf::from_mut_slice(&mut packed, Dtype::F4)];
    let ok = Item {
        src_base: 2,
        ..item(0, &[4, 2], &[6, 1], &[2, 1])
    };
    let runs = plan(std::slice::from_ref(&h4), &dest4, &[ok]).unwrap();
    assert_eq!(
        (runs.len(), runs[0].reps, runs[0].rep_src_stride),
        (1, 4, 3)
    );
    let odd_rows = item(1, &[4, 2], &[5, 1], &[2, 1]);
    let m = message(plan(std::slice::from_ref(&h4), &dest4, &[odd_rows]));
    assert!(
        m.contains("byte boundaries") && m.contains("from element 5 into element 2"),
        "{m}"
    );
}

#[test]
fn rejects_bad_requests() {
    let h = header(&[
        ("w", Dtype::F32, &[4, 8]),
        ("i", Dtype::I32, &[2]),
        ("f", Dtype::F4, &[8]),
    ]);
    let files = [h];
    let mut out = vec![0u8; 128];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
    let m = message(plan(&files, &dest, &[item(0, &[5, 8], &[8, 1], &[8, 1])]));
    assert!(
        m.contains("tensor 'w'") && m.contains("reaches element 39") && m.contains("32 elements"),
        "{m}"
    );
    let m = message(plan(&files, &dest, &[item(1, &[2], &[1], &[1])]));
    assert!(m.contains("cannot convert I32 to F32"), "{m}");
    let m = message(plan(
        &files,
        &dest,
        &[
            item(0, &[4, 8], &[8, 1], &[8, 1]),
            item(0, &[1], &[1], &[1]),
        ],
    ));
    assert!(
        m.contains("overlap") && m.contains("item 0") && m.contains("item 1"),
        "{m}"
    );
    let m = message(plan(&files, &dest, &[item(0, &[2], &[1], &[0])]));
    assert!(m.contains("several times"), "{m}");
    let m = message(plan(&files, &dest, &[item(0, &[-1], &[1], &[1])]));
    assert!(m.contains("non-negative"), "{m}");
    let m = message(plan(
        &files,
        &dest,
        &[Item {
            file: 1,
            ..item(0, &[1], &[1], &[1])
        }],
    ));
    assert!(m.contains("file index 1 is out of range"), "{m}");
    let m = message(plan(&files, &dest, &[item(3, &[1], &[1], &[1])]));
    assert!(m.contains("tensor index 3"), "{m}");
    let m = message(plan(
        &files,
        &dest,
        &[Item {
            dst_base: 30,
            ..item(0, &[4], &[1], &[1])
        }],
    ));
    assert!(
        m.contains("has 128 bytes but the box writes up to byte 136"),
        "{m}"
    );
    let mut packed = vec![0u8; 4];
    let dest4 = [DestBuf::from_mut_slice(&mut packed, Dtype::F4)];
    assert!(plan(&files, &dest4, &[item(2, &[8], &[1], &[1])]).is_ok());
    let m = message(plan(&files, &dest4, &[item(2, &[3], &[1], &[1])]));
    assert!(m.contains("byte boundaries"), "{m}");
}

#[test]
fn interleaved_strided_destinations_are_not_overlaps() {
    let h = header(&[("w", Dtype::U8, &[8])]);
    let mut out = vec![0u8; 32];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
    let even = item(0, &[8], &[1], &[2]);
    let odd = Item {
        dst_base: 1,
        ..even
    };
    assert!(plan(std::slice::from_ref(&h), &dest, &[even, odd]).is_ok());
    let clash = Item {
        dst_base: 2,
        ..even
    };
    assert!(message(plan(&[h], &dest, &[even, clash])).contains("overlap"));
}

#[test]
fn item_level_proof_covers_common_layouts() {
    let mut out = vec![0u8; 4 * 8 * 4];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
    // Two row blocks side by side, a transposed block, a column slice into a padded buffer.
    let top = item(0, &[2, 8], &[8, 1], &[8, 1]);
    let bottom = Item {
        src_base: 16,
        dst_base: 16,
        ..top
    };
    assert!(items_disjoint(&[top, bottom], &dest));
    assert!(items_disjoint(&[item(0, &[4, 8], &[8, 1], &[1, 4])], &dest));
    assert!(items_disjoint(&[item(0, &[4, 2], &[8, 1], &[3, 1])], &dest));
    // Not proven (the run check decides): interleaved items, a zero stride, overlapping blocks.
    let even = item(0, &[16], &[1], &[2]);
    assert!(!items_disjoint(
        &[
            even,
            Item {
                dst_base: 1,
                ..even
            }
        ],
        &dest
    ));
    assert!(!items_disjoint(&[item(0, &[2], &[1], &[0])], &dest));
    assert!(!items_disjoint(
        &[
            top,
            Item {
                dst_base: 15,
                ..top
            }
        ],
        &dest
    ));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]
    /// Soundness: whenever the item-level proof says "disjoint", the exhaustive run check agrees.
    #[test]
    fn item_level_proof_is_sound(
        boxes in proptest::collection::vec(
            (proptest::collection::vec((1i64..4, 0i64..7), 1..=3), 0i64..20), 1..=3),
    ) {
        let h = header(&[("w", Dtype::U8, &[64])]);
        let mut out = vec![0u8; 256];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::U8)];
        let items: Vec<Item> = boxes
            .iter()
            .map(|(dims, base)| {
                let lengths: Vec<i64> = dims.iter().map(|d| d.0).collect();
                let ds: Vec<i64> = dims.iter().map(|d| d.1).collect();
                Item { dst_base: *base, ..item(0, &lengths, &vec![0; lengths.len()], &ds) }
            })
            .collect();
        let runs = plan(std::slice::from_ref(&h), &dest, &items);
        if items_disjoint(&items, &dest) {
            proptest::prop_assert!(runs.is_ok(), "{:?}", runs);
            let runs = runs.unwrap();
            proptest::prop_assert!(check_disjoint(&runs, &items, &dest).is_ok());
        }
    }
}

#[test]
fn split_keeps_elements() {
    let h = header(&[("w", Dtype::BF16, &[100])]);
    let mut out = vec![0u8; 400];
    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
    let runs = plan(&[h], &dest, &[item(0, &[50], &[2], &[1])]).unwrap();
    let mut pieces = Vec::new();
    runs[0].split(10, &mut pieces);
    assert_eq!(pieces.iter().map(|p| p.count).sum::<u64>(), 50);
    assert!(pieces.iter().all(|p| p.src_extent() <= 10));
    for w in pieces.windows(2) {
        assert_eq!(w[1].src_off, w[0].src_off + w[0].count * 4);
        assert_eq!(w[1].dst_addr, w[0].dst_addr + w[0].count as usize * 4);
    }
}

/// Every (source, destination) element pair of a run, repetitions expanded, in order.
fn elements(r: &Run) -> Vec<(u64, usize)> {
    let (ss, ds) = (r.src_stride.max(1), r.dst_stride.max(1));
    (0..r.reps)
        .flat_map(|k| {
            let p = r.rep(k);
            (0..p.count).map(move |i| (p.src_off + i * ss, p.dst_addr + i as usize * ds))
        })
        .collect()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 400, ..Default::default() })]
    /// Splitting a repeated run keeps every element exactly once, in order, and every piece within
    /// the limit unless it is a single element.
    #[test]
    fn split_of_repeated_runs_keeps_elements(
        rows in 1i64..9,
        cols in 1i64..9,
        row_len in 9i64..20,
        col_step in 1i64..3,
        max_extent in 1u64..200,
    ) {
        let h = header(&[("w", Dtype::BF16, &[8, 40])]);
        let mut out = vec![0u8; 8 * 20 * 4];
        let dest = [DestBuf::from_mut_slice(&mut out, Dtype::F32)];
        let it = item(0, &[rows, cols], &[40, col_step], &[row_len, 1]);
        let runs = plan(&[h], &dest, &[it]).unwrap();
        proptest::prop_assert_eq!(runs.len(), 1);
        let run = runs[0];
        proptest::prop_assert_eq!(run.reps, if cols > 1 { rows as u64 } else { 1 });
        let mut pieces = Vec::new();
        run.split(max_extent, &mut pieces);
        let want = elements(&run);
        let got: Vec<(u64, usize)> = pieces.iter().flat_map(elements).collect();
        proptest::prop_assert_eq!(got, want);
        for p in &pieces {
            proptest::prop_assert!(p.reps >= 1 && p.count >= 1);
            proptest::prop_assert!(
                p.src_extent() <= max_extent || (p.reps == 1 && p.count == 1),
                "{:?} over {}", p, max_extent
            );
            proptest::prop_assert_eq!(p.needed_bytes(), p.reps * p.run_extent());
        }
        // Splitting repetitions apart keeps the bytes needed; splitting one apart drops its stride gaps.
        let needed: u64 = pieces.iter().map(Run::needed_bytes).sum();
        if pieces.iter().all(|p| p.count == run.count) {
            proptest::prop_assert_eq!(needed, run.needed_bytes());
        } else {
            proptest::prop_assert!(needed <= run.needed_bytes());
        }
    }
}
