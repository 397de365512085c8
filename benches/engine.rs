//! Criterion benchmarks of the engine: one rank-of-4's rows (Shard(0)) and columns (Shard(1)) of a 256 MiB
//! bf16 tensor, same dtype and bf16→f32, mmap vs pread, against a plain memcpy of the same number of bytes.
//! The file is generated once per run in a temporary directory and is warm in the page cache.
//!
//! The `dequant` group: a 4096x4096 F8_E4M3 tensor with fp32 128x128 block scales dequantized into bf16, whole
//! and as a rank-of-4's columns (the strided-source case), against the bf16 -> bf16 copy of the same output
//! bytes (one thread, mmap).
//!
//! The `mxfp4` group: gpt-oss MXFP4 experts (U8 e2m1 pairs, e8m0 scales) dequantized into their transposed bf16
//! layout, against the bf16 copy of the same output bytes; both timed in the calling thread's CPU seconds (`cpu_time`), which
//! a shared machine disturbs less than wall time.
//!
//! Run: `cargo bench --bench engine` (short by default; `-- --measurement-time 10` for steadier numbers).

use std::hint::black_box;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hp_fastload::{
    execute, execute_scaled, Backend, DestBuf, Dtype, ExecOptions, Header, Item, Scale,
};

const ROWS: u64 = 8192;
const COLS: u64 = 16384;
const RANKS: u64 = 4;

fn write_checkpoint(dir: &std::path::Path) -> Arc<Header> {
    let path = dir.join("bench.safetensors");
    let nbytes = ROWS * COLS * 2;
    let json = format!(
        r#"{{"w":{{"dtype":"BF16","shape":[{ROWS},{COLS}],"data_offsets":[0,{nbytes}]}}}}"#
    );
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(json.as_bytes()).unwrap();
    let row: Vec<u8> = (0..COLS * 2).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
    for _ in 0..ROWS {
        f.write_all(&row).unwrap();
    }
    f.flush().unwrap();
    drop(f);
    Arc::new(Header::read(&path).unwrap())
}

/// Rank 0's box: rows (Shard(0)) or columns (Shard(1)).
fn shard_item(columns: bool) -> (Item, u64) {
    let (rows, cols) = if columns {
        (ROWS, COLS / RANKS)
    } else {
        (ROWS / RANKS, COLS)
    };
    let mut item = Item {
        ndim: 2,
        ..Item::default()
    };
    item.lengths[..2].copy_from_slice(&[rows as i64, cols as i64]);
    item.src_strides[..2].copy_from_slice(&[COLS as i64, 1]);
    item.dst_strides[..2].copy_from_slice(&[cols as i64, 1]);
    (item, rows * cols)
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let header = write_checkpoint(dir.path());
    let files = [header];
    let mut group = c.benchmark_group("engine");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for columns in [false, true] {
        let (item, numel) = shard_item(columns);
        let layout = if columns { "cols" } else { "rows" };
        group.throughput(Throughput::Bytes(numel * 2));
        for dst in [Dtype::BF16, Dtype::F32] {
            let mut out = vec![0u8; (numel * dst.bits() / 8) as usize];
            for backend in [Backend::Mmap, Backend::Pread] {
                let name = format!(
                    "{layout}/bf16->{}/{}",
                    dst.name().to_lowercase(),
                    backend.name()
                );
                let opts = ExecOptions {
                    backend,
                    ..ExecOptions::default()
                };
                group.bench_function(name, |b| {
                    b.iter(|| {
                        let dest = [DestBuf::from_mut_slice(&mut out, dst)];
                        black_box(execute(&files, &dest, &[item], &opts).unwrap())
                    })
                });
            }
        }
        // Experiment "pread gap": read through gaps of up to 64 KiB instead of one pread per run.
        let mut out = vec![0u8; (numel * 2) as usize];
        let opts = ExecOptions {
            backend: Backend::Pread,
            pread_gap: 64 * 1024,
            ..ExecOptions::default()
        };
        group.bench_function(format!("{layout}/bf16->bf16/pread-gap64k"), |b| {
            b.iter(|| {
                let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
                black_box(execute(&files, &dest, &[item], &opts).unwrap())
            })
        });
    }
    let (_, numel) = shard_item(false);
    let src = vec![1u8; (numel * 2) as usize];
    let mut dst = vec![0u8; (numel * 2) as usize];
    group.throughput(Throughput::Bytes(numel * 2));
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        })
    });
    group.finish();
}

const QN: u64 = 4096;

/// `q`: F8_E4M3 [QN, QN] (random codes, no NaN), `q_scale_inv`: F32 [QN/128, QN/128], `b`: BF16 [QN, QN].
fn write_quantized(dir: &std::path::Path) -> Arc<Header> {
    let path = dir.join("quant.safetensors");
    let (q, s, b) = (QN * QN, (QN / 128) * (QN / 128) * 4, QN * QN * 2);
    let g = QN / 128;
    let json = format!(
        r#"{{"q":{{"dtype":"F8_E4M3","shape":[{QN},{QN}],"data_offsets":[0,{q}]}},"q_scale_inv":{{"dtype":"F32","shape":[{g},{g}],"data_offsets":[{q},{}]}},"b":{{"dtype":"BF16","shape":[{QN},{QN}],"data_offsets":[{},{}]}}}}"#,
        q + s,
        q + s,
        q + s + b
    );
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(json.as_bytes()).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let codes: Vec<u8> = (0..q)
        .map(|_| match next() as u8 {
            c if c & 0x7f == 0x7f => 0,
            c => c,
        })
        .collect();
    f.write_all(&codes).unwrap();
    for i in 0..g * g {
        f.write_all(&(1e-3f32 * (1.0 + i as f32 / 64.0)).to_le_bytes())
            .unwrap();
    }
    let bf: Vec<u8> = (0..b).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
    f.write_all(&bf).unwrap();
    f.flush().unwrap();
    drop(f);
    Arc::new(Header::read(&path).unwrap())
}

fn bench_dequant(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let header = write_quantized(dir.path());
    let (tq, tb) = (header.index("q").unwrap(), header.index("b").unwrap());
    let scale = Scale {
        file: 0,
        tensor: header.index("q_scale_inv").unwrap() as i64,
        ndim: 2,
        shape: [QN as i64, QN as i64, 0, 0, 0, 0, 0, 0],
        block: [128, 128, 1, 1, 1, 1, 1, 1],
    };
    let files = [header];
    let opts = ExecOptions {
        backend: Backend::Mmap,
        threads: Some(1),
        ..ExecOptions::default()
    };
    let mut group = c.benchmark_group("dequant");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    for (layout, cols) in [("whole", QN), ("cols", QN / 4)] {
        let numel = QN * cols;
        group.throughput(Throughput::Bytes(numel * 2));
        let mut out = vec![0u8; (numel * 2) as usize];
        for (name, tensor, sc) in [("fp8->bf16", tq, 1), ("bf16->bf16", tb, 0)] {
            let mut item = Item {
                ndim: 2,
                tensor: tensor as i64,
                scale: sc,
                ..Item::default()
            };
            item.lengths[..2].copy_from_slice(&[QN as i64, cols as i64]);
            item.src_strides[..2].copy_from_slice(&[QN as i64, 1]);
            item.dst_strides[..2].copy_from_slice(&[cols as i64, 1]);
            group.bench_function(format!("{layout}/{name}"), |b| {
                b.iter(|| {
                    let dest = [DestBuf::from_mut_slice(&mut out, Dtype::BF16)];
                    let r = execute_scaled(&files, &dest, &[item], &[scale], &opts);
                    black_box(r.unwrap())
                })
            });
        }
    }
    group.finish();
}

/// MXFP4 experts: `[E, Y, X / 32, 16]` U8 blocks (random codes) with e8m0 scales `[E, Y, X / 32]`, the logical
/// `[E, Y, X]` 4-bit tensor.
const ME: u64 = 4;
const MY: u64 = 2048;
const MX: u64 = 2048;

/// `holes`: every byte zero, as a sparse checkpoint's holes read (scale byte 0: 2^-127, code 0: +0).
fn write_mxfp4(dir: &std::path::Path, holes: bool) -> Arc<Header> {
    let path = dir.join(if holes {
        "holes.safetensors"
    } else {
        "mxfp4.safetensors"
    });
    let (g, nb) = (MX / 32, ME * MY * MX / 2);
    let ns = ME * MY * g;
    let json = format!(
        r#"{{"w_blocks":{{"dtype":"U8","shape":[{ME},{MY},{g},16],"data_offsets":[0,{nb}]}},"w_scales":{{"dtype":"U8","shape":[{ME},{MY},{g}],"data_offsets":[{nb},{}]}}}}"#,
        nb + ns
    );
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
    f.write_all(json.as_bytes()).unwrap();
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let blocks: Vec<u8> = (0..nb)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8 * u8::from(!holes)
        })
        .collect();
    f.write_all(&blocks).unwrap();
    let scales: Vec<u8> = (0..ns)
        .map(|i| (120 + (i % 16) as u8) * u8::from(!holes))
        .collect();
    f.write_all(&scales).unwrap();
    f.flush().unwrap();
    drop(f);
    Arc::new(Header::read(&path).unwrap())
}

/// The `mxfp4` group: the experts dequantized into transformers' transposed bf16 layout `[E, X, Y]` (one
/// thread, mmap), whole and as an expert-parallel rank of 2 (half the experts) or a TP rank of 2 (half of X),
/// against the bf16 -> bf16 copy of the same output bytes; 90 of the X inputs of each expert (`cols90`: 45
/// bytes of each row, a rank's slice of gpt-oss-120b's experts under EP 8 x FSDP 32, whose last 13 columns
/// are a ragged edge of the tiles); and whole from a file of zeros (`holes`: what a sparse checkpoint of
/// `benches/scale.py` reads, scale byte 0 everywhere).
fn bench_mxfp4(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let header = write_mxfp4(dir.path(), false);
    let holes = write_mxfp4(dir.path(), true);
    let plain = write_quantized(dir.path());
    let mut scale = Scale {
        file: 0,
        tensor: header.index("w_scales").unwrap() as i64,
        ndim: 3,
        ..Scale::default()
    };
    scale.shape[..3].copy_from_slice(&[ME as i64, MY as i64, MX as i64]);
    scale.block[..3].copy_from_slice(&[1, 1, 32]);
    let opts = ExecOptions {
        backend: Backend::Mmap,
        threads: Some(1),
        ..ExecOptions::default()
    };
    let mut group = c.benchmark_group("mxfp4");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let layouts = [
        ("whole", ME, MX, &header),
        ("ep2", ME / 2, MX, &header),
        ("tp2", ME, MX / 2, &header),
        ("cols90", ME, 90, &header),
        ("holes", ME, MX, &holes),
    ];
    for (layout, experts, xs, header) in layouts {
        let numel = experts * xs * MY;
        group.throughput(Throughput::Bytes(numel * 2));
        // 64-byte aligned, as torch allocates a shard (a large `Vec` starts 16 bytes into its pages)
        let mut backing = vec![0u8; (numel * 2) as usize + 64];
        let at = backing.as_ptr().align_offset(64);
        let out = &mut backing[at..][..(numel * 2) as usize];
        let mut item = Item {
            ndim: 3,
            tensor: header.index("w_blocks").unwrap() as i64,
            scale: 1,
            ..Item::default()
        };
        item.lengths[..3].copy_from_slice(&[experts as i64, xs as i64, MY as i64]);
        item.src_strides[..3].copy_from_slice(&[(MY * MX) as i64, 1, MX as i64]);
        item.dst_strides[..3].copy_from_slice(&[(xs * MY) as i64, MY as i64, 1]);
        let files = [Arc::clone(header)];
        group.bench_function(format!("{layout}/mxfp4->bf16"), |b| {
            b.iter_custom(|iters| {
                cpu_time(iters, || {
                    let dest = [DestBuf::from_mut_slice(out, Dtype::BF16)];
                    black_box(execute_scaled(&files, &dest, &[item], &[scale], &opts).unwrap());
                })
            })
        });
        let mut copy = Item {
            ndim: 1,
            tensor: plain.index("b").unwrap() as i64,
            ..Item::default()
        };
        copy.lengths[0] = numel as i64;
        copy.src_strides[0] = 1;
        copy.dst_strides[0] = 1;
        let files = [Arc::clone(&plain)];
        group.bench_function(format!("{layout}/bf16->bf16"), |b| {
            b.iter_custom(|iters| {
                cpu_time(iters, || {
                    let dest = [DestBuf::from_mut_slice(out, Dtype::BF16)];
                    black_box(execute(&files, &dest, &[copy], &opts).unwrap());
                })
            })
        });
    }
    group.finish();
}

/// The CPU time of `iters` calls of `f` on this thread (one engine thread works on the caller's thread), from
/// `/proc/thread-self/schedstat` (nanoseconds): on a shared machine the time other processes hold the core is
/// not counted, as wall time would. Wall time where that file is absent.
fn cpu_time(iters: u64, mut f: impl FnMut()) -> Duration {
    let now = || {
        std::fs::read_to_string("/proc/thread-self/schedstat")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
    };
    let (t0, w0) = (now(), std::time::Instant::now());
    for _ in 0..iters {
        f();
    }
    match (t0, now()) {
        (Some(a), Some(b)) => Duration::from_nanos(b - a),
        _ => w0.elapsed(),
    }
}

criterion_group!(benches, bench, bench_dequant, bench_mxfp4);
criterion_main!(benches);
