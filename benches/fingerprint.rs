//! Canonical JSON and full request fingerprints against `serde_json` +
//! `serde_json_canonicalizer` (parse into a `Value`, then RFC 8785), on
//! realistic order bodies of about 1 KiB, 16 KiB and 256 KiB.
//!
//! Run with `cargo bench --bench fingerprint`.

#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Method, Uri, header};
use tower_idempotency::fingerprint::{FingerprintSpec, canonical, fingerprint};

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

const NAMES: &[&str] =
    &["Ada Lovelace", "Grace Hopper", "José Álvarez", "Søren Kierkegaard", "山田 太郎", "Zoë \"Z\" O'Brien"];
const CITIES: &[&str] = &["Berlin", "München", "Tōkyō", "São Paulo", "New York", "Zürich"];
const PRODUCTS: &[&str] = &[
    "USB-C cable, 2 m",
    "Mechanical keyboard (ISO/DE)",
    "27\" monitor",
    "Noise-cancelling headphones",
    "Café beans — 1 kg",
    "Standing desk\\frame",
];
const CURRENCIES: &[&str] = &["EUR", "USD", "JPY", "GBP"];

fn order(rng: &mut Rng, id: u64, out: &mut String) {
    use std::fmt::Write as _;
    let items = 1 + rng.below(4);
    let _ = write!(
        out,
        r#"{{"id":"ord_{id:08}","customer":{{"id":"cus_{:06}","name":"{}","email":"user{}@example.com","address":{{"city":"{}","postal_code":"{:05}","lines":["Hauptstraße {}","c/o Accounts"]}}}},"currency":"{}","status":"pending","created_at":"2024-06-{:02}T12:{:02}:{:02}Z","items":["#,
        rng.below(1_000_000),
        rng.pick(NAMES).replace('"', "\\\""),
        rng.below(10_000),
        rng.pick(CITIES),
        rng.below(100_000),
        1 + rng.below(200),
        rng.pick(CURRENCIES),
        1 + rng.below(28),
        rng.below(60),
        rng.below(60),
    );
    for k in 0..items {
        if k > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            r#"{{"sku":"SKU-{:05}","title":"{}","quantity":{},"unit_price":{}.{:02},"discount":0.{:02},"tags":["{}","{}"],"weight_kg":{}.{}e0}}"#,
            rng.below(100_000),
            rng.pick(PRODUCTS).replace('\\', "\\\\").replace('"', "\\\""),
            1 + rng.below(5),
            rng.below(500),
            rng.below(100),
            rng.below(50),
            rng.pick(&["gift", "express", "fragile", "b2b"]),
            rng.pick(&["sale", "new", "bundle", "refurb"]),
            rng.below(20),
            rng.below(1000),
        );
    }
    let _ = write!(
        out,
        r#"],"amount":{},"tax_rate":0.19,"paid":{},"coupon":null,"metadata":{{"source":"web","client_request_time":{},"trace_id":"{:016x}"}}}}"#,
        rng.below(10_000_000),
        if rng.below(2) == 0 { "true" } else { "false" },
        1_700_000_000_000u64 + rng.below(1_000_000_000),
        rng.next(),
    );
}

/// An orders page of at most `target` bytes: whole orders while they fit
/// (at least one), then small audit entries to fill up.
fn body(target: usize) -> Vec<u8> {
    use std::fmt::Write as _;
    const TAIL: &str = r#"],"has_more":false}"#;
    let mut rng = Rng(target as u64);
    let mut out = String::from(r#"{"page":1,"orders":["#);
    let mut next = String::new();
    for id in 0.. {
        next.clear();
        if id > 0 {
            next.push(',');
        }
        order(&mut rng, id, &mut next);
        if id > 0 && out.len() + next.len() + TAIL.len() + 11 > target {
            break;
        }
        out.push_str(&next);
    }
    out.push_str(r#"],"audit":["#);
    for k in 0.. {
        next.clear();
        if k > 0 {
            next.push(',');
        }
        let _ = write!(
            next,
            r#"{{"at":{},"by":"usr_{:04}","action":"{}"}}"#,
            1_700_000_000_000u64 + rng.below(1_000_000_000),
            rng.below(10_000),
            rng.pick(&["viewed", "edited", "approved", "exported"]),
        );
        if out.len() + next.len() + TAIL.len() > target {
            break;
        }
        out.push_str(&next);
    }
    out.push_str(TAIL);
    out.into_bytes()
}

fn peer(body: &[u8]) -> Vec<u8> {
    let value: serde_json::Value = serde_json::from_slice(body).expect("valid JSON");
    serde_json_canonicalizer::to_vec(&value).expect("canonicalizable")
}

fn bench(c: &mut Criterion) {
    let spec = FingerprintSpec::new();
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let uri = Uri::from_static("/orders?expand=items");

    for (label, size) in [("1KiB", 1 << 10), ("16KiB", 16 << 10), ("256KiB", 256 << 10)] {
        let body = body(size);
        assert!(canonical::json(&body, &[], 64).is_some());
        assert!(!peer(&body).is_empty());

        let mut group = c.benchmark_group(format!("fingerprint/{label}"));
        group
            .throughput(Throughput::Bytes(body.len() as u64))
            .sample_size(30)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        group.bench_function(BenchmarkId::new("canonical_json", body.len()), |b| {
            b.iter(|| canonical::json(black_box(&body), &[], 64))
        });
        group.bench_function(BenchmarkId::new("fingerprint_sha256", body.len()), |b| {
            b.iter(|| fingerprint(&Method::POST, &uri, &headers, black_box(&body), black_box(&spec)))
        });
        group.bench_function(BenchmarkId::new("serde_json_canonicalizer", body.len()), |b| {
            b.iter(|| peer(black_box(&body)))
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
