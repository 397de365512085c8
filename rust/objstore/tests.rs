//! The tests of `objstore`.

use super::*;

#[test]
fn urls_split_into_bucket_and_key() {
    assert_eq!(
        split_url("s3://b/p/model.safetensors").unwrap(),
        ("b".to_string(), "p/model.safetensors".to_string())
    );
    assert!(split_url("s3://b").is_err());
    assert!(split_url("s3:///k").is_err());
    assert!(split_url("/local/file").is_err());
}

#[test]
fn coalescing_joins_small_gaps_only_and_cuts_pieces() {
    // Touching and overlapping ranges join.
    assert_eq!(
        coalesce(&[(0, 10), (10, 20), (15, 30)], 1 << 20),
        vec![0..30]
    );
    // A 4 KiB gap between 4 KiB rows (a column half) is half the bytes: not joined.
    let rows: Vec<(u64, u64)> = (0..4).map(|i| (i * 8192, i * 8192 + 4096)).collect();
    assert_eq!(coalesce(&rows, 1 << 20).len(), 4);
    // A 100-byte gap between 1 MiB ranges is joined.
    let big = [(0, 1 << 20), ((1 << 20) + 100, 2 << 20)];
    assert_eq!(coalesce(&big, 8 << 20), vec![0..(2 << 20)]);
    // Cut into pieces at the multiples of the piece size (object offsets).
    assert_eq!(coalesce(&[(0, 25)], 10), vec![0..10, 10..20, 20..25]);
    assert_eq!(
        coalesce(&[(7, 31)], 10),
        vec![7..10, 10..20, 20..30, 30..31]
    );
    assert_eq!(coalesce(&[(12, 18)], 10), vec![12..18]);
    // Fetched never exceeds needed by more than 1/32.
    let many: Vec<(u64, u64)> = (0..1000).map(|i| (i * 1100, i * 1100 + 1000)).collect();
    let fetched: u64 = coalesce(&many, u64::MAX)
        .iter()
        .map(|r| r.end - r.start)
        .sum();
    assert!(fetched * 32 <= 1000 * 1000 * 33, "{fetched}");
}

#[test]
fn the_gap_budget_is_spent_over_the_whole_call_smallest_gaps_first() {
    // File 0: 1000 row halves of 512 B with 512 B gaps (a column shard); file 1: 64 MiB contiguous.
    let rows: Vec<(u64, u64)> = (0..1000).map(|i| (i * 1024, i * 1024 + 512)).collect();
    let big = vec![(0, 64 << 20)];
    let out = coalesce_all(&[rows.clone(), big.clone()], u64::MAX);
    assert_eq!(out[0], vec![0..(999 * 1024 + 512)]); // one request: its gaps fit the call's budget
    assert_eq!(out[1], vec![0..(64 << 20)]);
    // Alone, the rows pay for 31 of their 999 gaps (512 000 / 32 bytes): 969 requests.
    assert_eq!(coalesce_all(&[rows], u64::MAX)[0].len(), 1000 - 31);
    // Smallest gaps first: a 1 KiB gap is joined before a 64 KiB one when only one fits.
    let mixed = vec![(0, 40_000), (41_024, 80_000), (144_000, 180_000)];
    assert_eq!(
        coalesce_all(&[mixed], u64::MAX)[0],
        vec![0..80_000, 144_000..180_000]
    );
    // Fetched stays within 1/32 of needed over the call.
    let needed: u64 = 1000 * 512 + (64 << 20);
    let fetched: u64 = out.iter().flatten().map(|r| r.end - r.start).sum();
    assert!(fetched * 32 <= needed * 33, "{fetched}");
}

fn byte_run(src_off: u64, count: u64, reps: u64, rep_src_stride: u64, dst: &mut [u8]) -> Run {
    Run {
        item: 0,
        file: 0,
        src_off,
        src_stride: 1,
        count,
        dst_addr: dst.as_mut_ptr() as usize,
        dst_stride: 1,
        reps,
        rep_src_stride,
        rep_dst_stride: count as usize,
        src_dtype: crate::dtype::Dtype::U8,
        dst_dtype: crate::dtype::Dtype::U8,
        src_nibble: 0,
    }
}

#[test]
fn fetched_bytes_reach_their_destinations_and_the_staging_in_any_chunking() {
    let object: Vec<u8> = (0..100u8).collect();
    let (mut a, mut b, mut c) = (vec![0u8; 20], vec![0u8; 12], vec![0u8; 5]);
    // A: 10..30; B: 3 rows of 4 bytes at 50, 60, 70 (a column slice); C: 20..25, overlapping A (the same
    // source bytes into a second destination). Staged (the copy path's bytes): 35..45.
    let direct = vec![
        byte_run(10, 20, 1, 0, &mut a),
        byte_run(50, 4, 3, 10, &mut b),
        byte_run(20, 5, 1, 0, &mut c),
    ];
    let segments = segments_of(&direct, 1);
    assert_eq!(segments[0].len(), 5);
    let staged: Vec<Range<u64>> = std::iter::once(35..45).collect();
    let mut wanted: Vec<(u64, u64)> = segments[0].iter().map(|s| (s.start, s.end)).collect();
    wanted.push((35, 45));
    let wanted: Vec<(u64, u64)> = merged(&wanted).iter().map(|r| (r.start, r.end)).collect();
    let requests = coalesce_all(&[wanted], 16).pop().unwrap();
    assert!(
        requests.iter().all(|r| r.start / 16 == (r.end - 1) / 16),
        "{requests:?}"
    );
    for chunk in [1usize, 3, 7, 64] {
        a.fill(0);
        b.fill(0);
        c.fill(0);
        let mut staging = [0u8; 100];
        let routes = route(&requests, &staged, &segments[0]);
        for (r, (parts, segs)) in requests.iter().zip(routes) {
            let out = &mut staging[r.start as usize..r.end as usize];
            let mut sink = Sink {
                start: r.start,
                staging: out,
                staged: parts,
                direct: segs,
                segments: &segments[0],
                runs: &direct,
                cursor: (0, 0),
            };
            // A first attempt cut short, then the retry from the start.
            sink.put(
                r.start,
                &object[r.start as usize..(r.start as usize + 1).min(r.end as usize)],
            );
            sink.restart();
            let mut at = r.start as usize;
            while at < r.end as usize {
                let end = (at + chunk).min(r.end as usize);
                sink.put(at as u64, &object[at..end]);
                at = end;
            }
        }
        assert_eq!(a, object[10..30], "chunk {chunk}");
        assert_eq!(
            b,
            [&object[50..54], &object[60..64], &object[70..74]].concat()
        );
        assert_eq!(c, object[20..25]);
        assert_eq!(staging[35..45], object[35..45]);
        // Only the staged range went to the staging memory.
        assert!(staging[..35].iter().chain(&staging[45..]).all(|&x| x == 0));
    }
}
