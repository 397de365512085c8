//! Criterion benchmarks of the engine: one rank-of-4's rows (Shard(0)) and columns (Shard(1)) of a 256 MiB
//! bf16 tensor, same dtype and bf16→f32, mmap vs pread, against a plain memcpy of the same number of bytes.
//! The file is generated once per run in a temporary directory and is warm in the page cache.
//!
//! Run: `cargo bench --bench engine` (short by default; `-- --measurement-time 10` for steadier numbers).

use std::hint::black_box;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hp_fastload::{execute, Backend, DestBuf, Dtype, ExecOptions, Header, Item};

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

criterion_group!(benches, bench);
criterion_main!(benches);
