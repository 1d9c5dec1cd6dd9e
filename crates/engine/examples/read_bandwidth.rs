//! The machine's memory read bandwidth, the ceiling of single-stream decode: a step reads
//! every weight once, so tokens/s can be at most bandwidth ÷ weight bytes.
//!
//! `cargo run --release -p pdmesh-engine --example read_bandwidth -- [MIB] [THREADS] [--json]`
//!
//! Every thread sums its share of a buffer much larger than the last-level cache (default
//! 2 GiB), 5 passes after one untimed pass, and the best pass is reported.

use std::time::Instant;

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    args.retain(|a| a != "--json");
    let number = |s: &String, what: &str| -> usize {
        match s.parse() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("{what} must be a whole number above 0, not {s:?}");
                std::process::exit(2)
            }
        }
    };
    let mib = args.first().map_or(2048, |s| number(s, "MIB"));
    let threads = args.get(1).map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |s| number(s, "THREADS"),
    );
    let words = mib * (1 << 20) / 8;
    // Distinct values so no page is shared copy-on-write zero memory.
    let buf: Vec<u64> = (0..words as u64).collect();
    let chunk = words.div_ceil(threads);
    let pass = || {
        let t0 = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let parts: Vec<_> = buf
                .chunks(chunk)
                .map(|part| {
                    s.spawn(move || {
                        // Eight independent sums the compiler keeps in vector registers.
                        let mut acc = [0u64; 8];
                        for c in part.chunks_exact(8) {
                            for (a, v) in acc.iter_mut().zip(c) {
                                *a = a.wrapping_add(*v);
                            }
                        }
                        acc.iter().fold(0u64, |x, y| x.wrapping_add(*y))
                    })
                })
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().unwrap())
                .fold(0, u64::wrapping_add)
        });
        (t0.elapsed().as_secs_f64(), std::hint::black_box(total))
    };
    pass();
    let best = (0..5).map(|_| pass().0).fold(f64::INFINITY, f64::min);
    let gbs = (words * 8) as f64 / best / 1e9;
    if json {
        println!("{{\"read_gb_per_s\": {gbs:.3}, \"threads\": {threads}, \"mib\": {mib}}}");
    } else {
        println!(
            "read bandwidth: {gbs:.2} GB/s ({threads} threads, best of 5 passes over {mib} MiB)"
        );
    }
}
