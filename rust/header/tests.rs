//! The header module's tests: the parser's rejections, name tables, facts, the weight map, natural order.

use super::*;
use proptest::prelude::*;

fn file(json: &str, data_len: usize) -> Vec<u8> {
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json.as_bytes());
    b.resize(b.len() + data_len, 0xab);
    b
}

fn parse(bytes: &[u8]) -> Result<Header, LoadError> {
    Header::parse(Path::new("t.safetensors"), bytes, bytes.len() as u64)
}

fn reject(bytes: &[u8], needle: &str) {
    match parse(bytes) {
        Err(LoadError::Header { reason, .. }) => {
            assert!(
                reason.contains(needle),
                "reason {reason:?} lacks {needle:?}"
            )
        }
        other => panic!("expected a header error containing {needle:?}, got {other:?}"),
    }
}

const OK: &str = r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[4,16]},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}"#;

#[test]
fn accepts_valid_and_sorts_by_offset() {
    let h = parse(&file(OK, 16)).unwrap();
    assert_eq!(
        h.tensors
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    assert_eq!(h.metadata, Some(vec![("format".into(), "pt".into())]));
    assert_eq!(h.index("b"), Some(1));
    assert_eq!(h.index("c"), None);
    assert_eq!(h.tensors[0].numel(), 1);
    assert_eq!(h.data_start, 8 + OK.len() as u64);
}

#[test]
fn accepts_trailing_spaces_and_empty() {
    let padded = format!("{OK}      ");
    assert!(parse(&file(&padded, 16)).is_ok());
    assert!(parse(&file("{}", 0)).unwrap().tensors.is_empty());
    let sub = r#"{"f":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
    assert!(parse(&file(sub, 2)).is_ok());
}

#[test]
fn rejects_bad_lengths() {
    reject(&[1, 2, 3], "fewer than the 8-byte");
    let mut b = file(OK, 16);
    b[..8].copy_from_slice(&(MAX_HEADER_LEN + 1).to_le_bytes());
    reject(&b, "exceeds the limit");
    let len = b.len() as u64;
    b[..8].copy_from_slice(&len.to_le_bytes());
    reject(&b, "past the end of the file");
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    reject(&b, "exceeds the limit");
}

#[test]
fn rejects_bad_json() {
    let mut b = file(r#"{"a":1}"#, 0);
    b[10] = 0xff;
    reject(&b, "not valid UTF-8");
    reject(&file("[1, 2]", 0), "expected an object");
    reject(&file(r#"{"a":"#, 0), "not valid JSON");
    reject(&file(r#"{} x"#, 0), "unexpected text");
    reject(&file("{}\0\0", 0), "unexpected text");
}

#[test]
fn rejects_bad_metadata() {
    reject(&file(r#"{"__metadata__":{"a":1}}"#, 0), "expected a string");
    reject(
        &file(r#"{"__metadata__":[1]}"#, 0),
        "expected an object of strings",
    );
}

#[test]
fn rejects_bad_tensors() {
    reject(
        &file(
            r#"{"a":{"dtype":"F8","shape":[1],"data_offsets":[0,1]}}"#,
            1,
        ),
        "unknown dtype 'F8'",
    );
    reject(
        &file(
            r#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}"#,
            1,
        ),
        "non-negative",
    );
    reject(
        &file(
            r#"{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}"#,
            1,
        ),
        "non-negative",
    );
    reject(
        &file(r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}}"#, 1),
        "expected 2",
    );
    reject(
        &file(r#"{"a":{"dtype":"U8","shape":[1]}}"#, 1),
        "no 'data_offsets'",
    );
    reject(&file(r#"{"a":[1]}"#, 1), "expected an object");
    reject(
        &file(
            r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,0]}}"#,
            1,
        ),
        "end before",
    );
    reject(
        &file(
            r#"{"a":{"dtype":"I16","shape":[2],"data_offsets":[0,3]}}"#,
            3,
        ),
        "need 4",
    );
    reject(
        &file(
            r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#,
            0,
        ),
        "overflows the element count",
    );
    reject(
        &file(
            r#"{"a":{"dtype":"F64","shape":[4294967296,1073741824],"data_offsets":[0,0]}}"#,
            0,
        ),
        "overflows the byte size",
    );
}

#[test]
fn rejects_bad_layouts() {
    let overlap = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
    reject(&file(overlap, 4), "overlaps");
    let hole = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#;
    reject(&file(hole, 5), "hole");
    let short = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    reject(&file(short, 3), "cover 2 bytes but the data section has 3");
    reject(&file(short, 1), "cover 2 bytes but the data section has 1");
}

#[test]
fn rejects_duplicate_keys_at_any_level() {
    let dup = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    reject(&file(dup, 1), "duplicate key 'a'");
    let escaped = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"\u0061":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    reject(&file(escaped, 1), "duplicate key 'a'");
    let inner = r#"{"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}}"#;
    reject(&file(inner, 1), "duplicate key 'dtype'");
    reject(
        &file(r#"{"__metadata__":{"k":"1","k":"2"}}"#, 0),
        "duplicate key 'k'",
    );
}

#[test]
fn facts_of_gives_equal_ids_exactly_for_equal_dtype_and_shape() {
    let a = parse(&file(
        r#"{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},
            "y":{"dtype":"F32","shape":[3,2],"data_offsets":[24,48]},
            "z":{"dtype":"I32","shape":[2,3],"data_offsets":[48,72]},
            "v":{"dtype":"F32","shape":[6],"data_offsets":[72,96]}}"#,
        96,
    ))
    .unwrap();
    let b = parse(&file(
        r#"{"p":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},
            "q":{"dtype":"F32","shape":[2,3,1],"data_offsets":[24,48]}}"#,
        48,
    ))
    .unwrap();
    let ids = facts_of(&[&a, &b], &["x", "p", "y", "z", "v", "q", "x"]).unwrap();
    let (x, p, y, z, v, q) = (ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]);
    assert_eq!(x, p, "same dtype and shape in two files");
    assert_eq!(ids[6], x, "asked again");
    for (other, what) in [
        (y, "shape"),
        (z, "dtype"),
        (v, "rank and shape"),
        (q, "rank"),
    ] {
        assert_ne!(x, other, "a different {what}");
    }
    assert_ne!(y, v);
    assert_ne!(q, v);
    // Process-wide: asked later, from the other header first, the ids are the same.
    assert_eq!(
        facts_of(&[&b, &a], &["q", "z", "p"]).unwrap(),
        vec![q, z, p]
    );
    assert_eq!(facts_of(&[&a, &b], &["x", "nope", "p"]), Err(1));
    assert_eq!(facts_of(&[], &["x"]), Err(0));
    assert_eq!(facts_of(&[], &[]), Ok(vec![]));
}

#[test]
fn facts_of_finds_names_alternating_between_many_headers() {
    // Header h holds "t{h}_{j}" with shape [h + 1, j + 1]: every name's facts tell where it was found.
    let headers: Vec<Header> = (0..9)
        .map(|h: usize| {
            let mut at = 0;
            let entries: Vec<String> = (0..3)
                .map(|j: usize| {
                    let n = (h + 1) * (j + 1) * 4;
                    at += n;
                    format!(
                        r#""t{h}_{j}":{{"dtype":"F32","shape":[{},{}],"data_offsets":[{},{}]}}"#,
                        h + 1,
                        j + 1,
                        at - n,
                        at
                    )
                })
                .collect();
            let json = format!("{{{}}}", entries.join(","));
            parse(&file(&json, at)).unwrap()
        })
        .collect();
    let refs: Vec<&Header> = headers.iter().collect();
    // More distinct headers than the recent ones probed first, visited backwards and back and forth.
    let order = [
        (7, 0),
        (2, 1),
        (7, 1),
        (2, 2),
        (8, 0),
        (0, 2),
        (5, 1),
        (1, 0),
        (8, 2),
        (7, 2),
        (3, 0),
    ];
    let names: Vec<String> = order.iter().map(|(h, j)| format!("t{h}_{j}")).collect();
    let strs: Vec<&str> = names.iter().map(String::as_str).collect();
    let ids = facts_of(&refs, &strs).unwrap();
    for (&(h, j), &id) in order.iter().zip(&ids) {
        let alone = facts_of(&[refs[h]], &[format!("t{h}_{j}").as_str()]).unwrap();
        assert_eq!(alone, vec![id], "t{h}_{j}");
    }
    let shape_ids: std::collections::HashSet<u32> = ids.iter().copied().collect();
    assert_eq!(
        shape_ids.len(),
        order.len(),
        "every (h, j) has its own shape"
    );
    let mut missing = strs.clone();
    missing.insert(5, "t9_0");
    assert_eq!(facts_of(&refs, &missing), Err(5));
}

#[test]
fn positions_not_of_keeps_the_unlisted_dtypes_in_file_order() {
    let h = parse(&file(
        r#"{"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},
            "b":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[4,8]},
            "c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},
            "d":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[12,16]}}"#,
        16,
    ))
    .unwrap();
    assert_eq!(positions_not_of(&h, &["BF16", "F32"]), vec![1, 3]);
    assert_eq!(positions_not_of(&h, &["F8_E4M3"]), vec![0, 2]);
    assert_eq!(positions_not_of(&h, &[]), vec![0, 1, 2, 3]);
    assert!(positions_not_of(&h, &["BF16", "F32", "F8_E4M3"]).is_empty());
}

#[test]
fn name_table_finds_every_name_and_the_first_repeat() {
    // Many names sharing prefixes and a tiny table's collisions: every name at its position, others absent.
    let names: Vec<String> = (0..5000)
        .map(|i| format!("model.layers.{}.w{}", i % 61, i))
        .collect();
    let table = NameTable::build(&names, |n| n).unwrap();
    for (i, n) in names.iter().enumerate() {
        assert_eq!(table.get(&names, |n| n, n), Some(i));
    }
    for absent in [
        "",
        "model.layers.0.w",
        "model.layers.0.w5000",
        "model.layers.0.w0 ",
    ] {
        assert_eq!(table.get(&names, |n| n, absent), None);
    }
    assert_eq!(NameTable::default().get(&names, |n| n, "a"), None);
    let repeated = ["a", "b", "c", "b", "a"];
    assert_eq!(NameTable::build(&repeated, |n| n).err(), Some(3));
    assert!(NameTable::build(&[] as &[&str], |n| n).is_ok());
}

#[test]
fn read_maps_io_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    assert!(matches!(
        Header::read(&missing),
        Err(LoadError::NotFound { .. })
    ));
    assert!(matches!(
        Header::read(dir.path()),
        Err(LoadError::Io { .. })
    ));
    let p = dir.path().join("ok.safetensors");
    std::fs::write(&p, file(OK, 16)).unwrap();
    let h = Header::read(&p).unwrap();
    assert!(h.identity.is_some());
    assert_eq!(h.file_len, 8 + OK.len() as u64 + 16);
}

#[test]
fn weight_map_parses_the_usual_layout_only() {
    let w = WeightMap::parse(
        br#"{"metadata":{"n":[1,{"x":null}]},"weight_map":{"a":"s2","b":"s1","c\u0041":"s2"}}"#,
    )
    .unwrap();
    assert_eq!(w.files, ["s1", "s2"]);
    assert_eq!(
        w.pairs,
        [("a".into(), 1), ("b".into(), 0), ("cA".into(), 1)]
    );
    for bad in [
        &br#"{"weight_map":{}}"#[..],
        br#"{"weight_map":{"a":1}}"#,
        br#"{"weight_map":["a"]}"#,
        br#"{"metadata":{}}"#,
        br#"[1]"#,
        br#"{"weight_map":{"a":"s"}"#,
        br#"{"weight_map":{"a":"s"}} x"#,
        b"{\"weight_map\":{\"\xff\":\"s\"}}",
    ] {
        assert!(
            WeightMap::parse(bad).is_none(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn weight_map_agrees_only_with_exactly_its_tensors() {
    let h = |json: &str, n| parse(&file(json, n)).unwrap();
    let s1 = h(
        r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
        2,
    );
    let s2 = h(
        r#"{"c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
        1,
    );
    let agrees = |json: &str| {
        WeightMap::parse(json.as_bytes())
            .unwrap()
            .agrees(&[&s1, &s2])
    };
    assert!(agrees(r#"{"weight_map":{"c":"s2","a":"s1","b":"s1"}}"#));
    assert!(
        !agrees(r#"{"weight_map":{"c":"s2","a":"s1"}}"#),
        "a missing tensor"
    );
    assert!(
        !agrees(r#"{"weight_map":{"c":"s2","a":"s1","b":"s2"}}"#),
        "a wrong file"
    );
    assert!(
        !agrees(r#"{"weight_map":{"c":"s2","a":"s1","a":"s1"}}"#),
        "a name twice, one missing"
    );
    assert!(
        !agrees(r#"{"weight_map":{"c":"s2","a":"s1","b":"s1","d":"s1"}}"#),
        "an extra name"
    );
    assert!(
        !agrees(r#"{"weight_map":{"a":"s1","b":"s1"}}"#),
        "a file fewer"
    );
}

/// The test oracle of [`natural_order`]: `hp_fastload.natural.natural_sort_key` written out in Rust (digit
/// parts zero-padded after `\x02`, an empty part `\x02~`, a text part's trailing number after `\x03`, parts
/// joined by `\x01`), or `None` for a name with non-ASCII characters.
fn natural_sort_key(name: &str) -> Option<String> {
    if !name.is_ascii() {
        return None;
    }
    let pad = |out: &mut String, digits: &str| {
        let digits = digits.trim_start_matches('0');
        out.extend(std::iter::repeat_n(
            '0',
            24usize.saturating_sub(digits.len()),
        ));
        out.push_str(digits);
    };
    let mut out = String::with_capacity(name.len() + 32);
    for (i, part) in name.split('.').enumerate() {
        if i > 0 {
            out.push('\x01');
        }
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            out.push('\x02');
            pad(&mut out, part);
        } else if part.is_empty() {
            out.push_str("\x02~");
        } else {
            let stem = part.trim_end_matches(|c: char| c.is_ascii_digit());
            out.push_str(stem);
            if stem.len() < part.len() {
                out.push('\x03');
                pad(&mut out, &part[stem.len()..]);
            }
        }
    }
    Some(out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = parse(&bytes);
    }

    /// The compact keys sort exactly like the padded ones (ties by name), and refuse only what they must.
    #[test]
    fn natural_order_sorts_like_the_padded_keys(
        names in proptest::collection::vec(
            proptest::collection::vec(
                prop_oneof![
                    Just("."), Just("a"), Just("x"), Just("_"), Just("0"), Just("00"), Just("1"),
                    Just("9"), Just("10"), Just("007"), Just("99999999999999"), Just("\u{1}"), Just("é"),
                ],
                0..12,
            ).prop_map(|parts| parts.concat()),
            0..60,
        )
    ) {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let (order, other) = natural_order(&refs);
        let mut all: Vec<usize> = order.iter().chain(&other).copied().collect();
        all.sort_unstable();
        prop_assert_eq!(all, (0..names.len()).collect::<Vec<_>>());
        for &i in &other {
            let n = refs[i];
            let long = n.split(|c: char| !c.is_ascii_digit()).any(|d| d.trim_start_matches('0').len() > 24);
            prop_assert!(!n.bytes().all(|b| (0x20..0x7f).contains(&b)) || long, "refused {:?}", n);
        }
        let mut expected: Vec<usize> = order.clone();
        expected.sort_by_key(|&i| (natural_sort_key(refs[i]).unwrap(), refs[i]));
        prop_assert_eq!(order, expected);
    }

    /// Several headers' orders merged equal the order of all their names sorted at once (ties by name,
    /// also for one name in two headers, where only the positions differ).
    #[test]
    fn natural_order_of_headers_merges_like_one_sort(
        names in proptest::collection::vec(
            proptest::collection::vec(
                prop_oneof![Just("."), Just("a"), Just("0"), Just("00"), Just("10"), Just("2"), Just("é")],
                0..8,
            ).prop_map(|parts| parts.concat()),
            0..80,
        ),
        shards in 1usize..5,
    ) {
        let mut split: Vec<Vec<&str>> = vec![Vec::new(); shards];
        for (i, n) in names.iter().enumerate() {
            if !split[i % shards].contains(&n.as_str()) {
                split[i % shards].push(n);
            }
        }
        let headers: Vec<Header> = split.iter().map(|part| {
            let fields: Vec<String> = part.iter().enumerate().map(|(i, n)| format!(
                r#"{}:{{"dtype":"U8","shape":[1],"data_offsets":[{i},{}]}}"#,
                serde_json::to_string(n).unwrap(), i + 1,
            )).collect();
            parse(&file(&format!("{{{}}}", fields.join(",")), part.len())).unwrap()
        }).collect();
        let every: Vec<&str> = headers.iter().flat_map(|h| h.tensors.iter().map(|t| t.name.as_str())).collect();
        let refs: Vec<&Header> = headers.iter().collect();
        let (order, other) = natural_order_of(&refs);
        let (alone, alone_other) = natural_order(&every);
        prop_assert_eq!(&other, &alone_other);
        let named = |o: &[usize]| o.iter().map(|&i| every[i]).collect::<Vec<_>>();
        prop_assert_eq!(named(&order), named(&alone));
        let mut all: Vec<usize> = order.iter().chain(&alone_other).copied().collect();
        all.sort_unstable();
        prop_assert_eq!(all, (0..every.len()).collect::<Vec<_>>());
    }

    #[test]
    fn mutated_headers_never_panic(pos in 0usize..200, byte in any::<u8>(), cut in 0usize..200) {
        let mut b = file(OK, 16);
        let p = pos % b.len();
        b[p] = byte;
        b.truncate(b.len() - cut.min(b.len()));
        let _ = parse(&b);
        let _ = Header::parse(Path::new("t"), &b, (b.len() as u64).saturating_add(cut as u64));
    }
}
