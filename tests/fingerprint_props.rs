//! Property tests for the request fingerprint's canonical JSON (CONTRACT §2).
//!
//! A JSON value is generated as a model, rendered as text in many equivalent
//! ways (member order, whitespace, string escapes, number spellings), and the
//! canonical form must not depend on the rendering; it must equal the
//! canonical form computed from the model, which fixes the format.

use std::collections::BTreeMap;

use http::{HeaderMap, HeaderValue, Method, Uri, header};
use proptest::prelude::*;
use tower_idempotency::fingerprint::{Fingerprint, FingerprintSpec, canonical, fingerprint};

/// A JSON value with numbers held as exact decimals.
#[derive(Clone, Debug)]
enum Json {
    Null,
    Bool(bool),
    Num(Num),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

/// Zero, or `(-1)^negative × digits × 10^exp` with `digits` free of leading
/// and trailing zeros.
#[derive(Clone, Debug, PartialEq)]
enum Num {
    Zero,
    NonZero { negative: bool, digits: String, exp: i64 },
}

/// A small deterministic generator for rendering choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // SplitMix64.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

// ---------------------------------------------------------------- generation

fn num() -> impl Strategy<Value = Num> {
    prop_oneof![
        1 => Just(Num::Zero),
        6 => (any::<bool>(), "[1-9]([0-9]{0,24}[1-9])?", -30i64..30).prop_map(
            |(negative, digits, exp)| Num::NonZero { negative, digits, exp }
        ),
        1 => (any::<bool>(), prop::sample::select(vec![
            "9007199254740993", "9007199254740992", "18446744073709551617",
            "12345678901234567890123456789", "1", "5", "9",
        ])).prop_map(|(negative, digits)| Num::NonZero {
            negative,
            digits: digits.to_owned(),
            exp: 0,
        }),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z_]{0,8}",
        any::<String>(),
        prop::collection::vec(
            prop::sample::select(vec![
                '"', '\\', '/', '\n', '\t', '\u{0}', '\u{1f}', '\u{7f}', 'é', '€', '😀', '\u{2028}', '\u{ffff}', 'a',
                ' ',
            ]),
            0..8
        )
        .prop_map(|chars| chars.into_iter().collect()),
    ]
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        num().prop_map(Json::Num),
        text().prop_map(Json::Str),
    ];
    leaf.prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Arr),
            prop::collection::btree_map(text(), inner, 0..6).prop_map(Json::Obj),
        ]
    })
}

// ------------------------------------------------------------------- model

fn model_number(n: &Num, out: &mut String) {
    match n {
        Num::Zero => out.push('0'),
        Num::NonZero { negative, digits, exp } => {
            if *negative {
                out.push('-');
            }
            out.push_str(digits);
            if *exp != 0 {
                out.push_str(&format!("e{exp}"));
            }
        }
    }
}

fn model_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The canonical form the crate documents, computed from the model.
fn model(v: &Json, out: &mut String) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Num(n) => model_number(n, out),
        Json::Str(s) => model_string(s, out),
        Json::Arr(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                model(item, out);
            }
            out.push(']');
        }
        Json::Obj(members) => {
            // BTreeMap<String> iterates in UTF-8 byte order.
            out.push('{');
            for (k, (name, value)) in members.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                model_string(name, out);
                out.push(':');
                model(value, out);
            }
            out.push('}');
        }
    }
}

fn model_of(v: &Json) -> String {
    let mut out = String::new();
    model(v, &mut out);
    out
}

// --------------------------------------------------------------- rendering

fn ws(rng: &mut Rng, out: &mut String) {
    for _ in 0..rng.below(3) {
        out.push([' ', '\n', '\t', '\r'][rng.below(4) as usize]);
    }
}

fn hex4(rng: &mut Rng, unit: u32, out: &mut String) {
    let s = format!("\\u{unit:04x}");
    if rng.coin() {
        out.push_str(&s.to_uppercase().replace("\\U", "\\u"));
    } else {
        out.push_str(&s);
    }
}

fn render_string(s: &str, rng: &mut Rng, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\t' => Some("\\t"),
            '\n' => Some("\\n"),
            '\u{c}' => Some("\\f"),
            '\r' => Some("\\r"),
            _ => None,
        };
        let must_escape = c == '"' || c == '\\' || u32::from(c) < 0x20;
        match rng.below(3) {
            0 if !must_escape => out.push(c),
            1 if short.is_some() => out.push_str(short.unwrap_or_default()),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    hex4(rng, u32::from(*unit), out);
                }
            }
        }
    }
    out.push('"');
}

fn render_exponent(exp: i64, rng: &mut Rng, out: &mut String) {
    if exp == 0 && rng.coin() {
        return;
    }
    out.push(if rng.coin() { 'e' } else { 'E' });
    if exp < 0 {
        out.push('-');
    } else if rng.coin() {
        out.push('+');
    }
    for _ in 0..rng.below(3) {
        out.push('0');
    }
    out.push_str(&exp.unsigned_abs().to_string());
}

fn render_number(n: &Num, rng: &mut Rng, out: &mut String) {
    let (negative, digits, exp) = match n {
        Num::Zero => {
            if rng.coin() {
                out.push('-');
            }
            out.push('0');
            if rng.coin() {
                out.push('.');
                out.push_str(&"0".repeat(1 + rng.below(3) as usize));
            }
            let exp = rng.below(11) as i64 - 5;
            render_exponent(exp, rng, out);
            return;
        }
        Num::NonZero { negative, digits, exp } => (*negative, digits.clone(), *exp),
    };
    if negative {
        out.push('-');
    }
    let zeros = rng.below(3) as usize;
    let mut mantissa = digits + &"0".repeat(zeros);
    let mut exp = exp - zeros as i64;
    if (1..6).contains(&exp) && rng.coin() {
        mantissa.push_str(&"0".repeat(exp as usize));
        exp = 0;
    }
    let len = mantissa.len() as i64;
    match rng.below(3) {
        0 => {
            out.push_str(&mantissa);
            render_exponent(exp, rng, out);
        }
        1 if len > 1 => {
            let p = 1 + rng.below(len as u64 - 1) as usize;
            out.push_str(&mantissa[..p]);
            out.push('.');
            out.push_str(&mantissa[p..]);
            render_exponent(exp + (len - p as i64), rng, out);
        }
        _ => {
            let y = rng.below(3) as usize;
            out.push_str("0.");
            out.push_str(&"0".repeat(y));
            out.push_str(&mantissa);
            render_exponent(exp + len + y as i64, rng, out);
        }
    }
}

/// One of the many texts of `v`.
fn render(v: &Json, rng: &mut Rng, out: &mut String) {
    ws(rng, out);
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Num(n) => render_number(n, rng, out),
        Json::Str(s) => render_string(s, rng, out),
        Json::Arr(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                render(item, rng, out);
            }
            ws(rng, out);
            out.push(']');
        }
        Json::Obj(members) => {
            let mut order: Vec<(&String, &Json)> = members.iter().collect();
            for k in (1..order.len()).rev() {
                order.swap(k, rng.below(k as u64 + 1) as usize);
            }
            out.push('{');
            for (k, (name, value)) in order.into_iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                ws(rng, out);
                render_string(name, rng, out);
                ws(rng, out);
                out.push(':');
                render(value, rng, out);
            }
            ws(rng, out);
            out.push('}');
        }
    }
    ws(rng, out);
}

fn render_with(v: &Json, seed: u64) -> String {
    let mut out = String::new();
    render(v, &mut Rng(seed), &mut out);
    out
}

/// Changes one leaf of `v`, chosen by `pick`, to a different value.
fn mutate(v: &mut Json, pick: &mut Rng) {
    match v {
        Json::Null => *v = Json::Bool(false),
        Json::Bool(b) => *b = !*b,
        Json::Num(Num::Zero) => *v = Json::Num(Num::NonZero { negative: false, digits: "1".into(), exp: -40 }),
        Json::Num(Num::NonZero { digits, .. }) => digits.push('1'),
        Json::Str(s) => s.push('x'),
        Json::Arr(items) if items.is_empty() => items.push(Json::Null),
        Json::Arr(items) => {
            let k = pick.below(items.len() as u64) as usize;
            mutate(&mut items[k], pick);
        }
        Json::Obj(members) if members.is_empty() => {
            members.insert(String::new(), Json::Null);
        }
        Json::Obj(members) => {
            let k = pick.below(members.len() as u64) as usize;
            if let Some(value) = members.values_mut().nth(k) {
                mutate(value, pick);
            }
        }
    }
}

// ----------------------------------------------------------------- helpers

fn canon(body: &[u8]) -> Option<String> {
    canonical::json(body, &[], 64).map(|v| String::from_utf8(v).expect("canonical JSON is UTF-8"))
}

fn json_fp(body: &[u8]) -> Fingerprint {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    fingerprint(&Method::POST, &Uri::from_static("/orders"), &headers, body, &FingerprintSpec::new())
}

fn escape_pointer_token(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

// ------------------------------------------------------------------ properties

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn canonical_form_is_independent_of_member_order_whitespace_escapes_and_number_spelling(
        v in json(), seed_a in any::<u64>(), seed_b in any::<u64>(),
    ) {
        let a = render_with(&v, seed_a);
        let b = render_with(&v, seed_b);
        let expected = model_of(&v);
        prop_assert_eq!(canon(a.as_bytes()), Some(expected.clone()), "text {}", a);
        prop_assert_eq!(canon(b.as_bytes()), Some(expected), "text {}", b);
        prop_assert_eq!(json_fp(a.as_bytes()), json_fp(b.as_bytes()));
    }

    #[test]
    fn canonical_form_is_valid_json_and_a_fixed_point(v in json(), seed in any::<u64>()) {
        let text = render_with(&v, seed);
        let once = canon(text.as_bytes()).expect("valid JSON");
        prop_assert!(serde_json::from_str::<serde_json::Value>(&once).is_ok(), "{}", once);
        prop_assert_eq!(canon(once.as_bytes()), Some(once.clone()));
    }

    #[test]
    fn numbers_canonicalise_by_exact_decimal_value(n in num(), seed in any::<u64>()) {
        let mut text = String::new();
        render_number(&n, &mut Rng(seed), &mut text);
        let mut expected = String::new();
        model_number(&n, &mut expected);
        prop_assert_eq!(canon(text.as_bytes()), Some(expected), "text {}", text);
    }

    #[test]
    fn a_body_differing_in_any_member_value_has_a_different_fingerprint(
        v in json(), pick in any::<u64>(), seed_a in any::<u64>(), seed_b in any::<u64>(),
    ) {
        let mut w = v.clone();
        mutate(&mut w, &mut Rng(pick));
        prop_assert_ne!(model_of(&v), model_of(&w));
        let a = render_with(&v, seed_a);
        let b = render_with(&w, seed_b);
        prop_assert_ne!(json_fp(a.as_bytes()), json_fp(b.as_bytes()), "{} vs {}", a, b);
    }

    #[test]
    fn ignoring_a_present_member_equals_the_body_without_it(
        members in prop::collection::btree_map(text(), json(), 1..6),
        pick in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let name = members.keys().nth(pick.index(members.len())).cloned().unwrap_or_default();
        let mut without = members.clone();
        without.remove(&name);
        let text = render_with(&Json::Obj(members), seed);
        let pointer = format!("/{}", escape_pointer_token(&name));
        let got = canonical::json(text.as_bytes(), &[pointer.as_str()], 64)
            .map(|v| String::from_utf8(v).unwrap());
        prop_assert_eq!(got, Some(model_of(&Json::Obj(without))));
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = canonical::json(&body, &["/a", "/0/b"], 64);
        let _ = canonical::form(&body);
        let _ = json_fp(&body);
        let mut form = HeaderMap::new();
        form.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
        let _ = fingerprint(&Method::POST, &Uri::from_static("/"), &form, &body, &FingerprintSpec::new());
    }

    #[test]
    fn corrupted_json_never_panics_and_is_deterministic(
        v in json(), seed in any::<u64>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let mut body = render_with(&v, seed).into_bytes();
        for (at, byte) in edits {
            if body.is_empty() {
                break;
            }
            let k = at.index(body.len());
            body[k] = byte;
        }
        let first = canonical::json(&body, &["/a"], 8);
        prop_assert_eq!(&first, &canonical::json(&body, &["/a"], 8));
        if let Some(out) = first {
            // Whatever was accepted re-canonicalises to itself.
            prop_assert_eq!(canonical::json(&out, &[], 64), Some(out));
        }
        prop_assert_eq!(json_fp(&body), json_fp(&body));
    }

    #[test]
    fn json_prefixes_never_panic(v in json(), seed in any::<u64>(), cut in any::<prop::sample::Index>()) {
        let text = render_with(&v, seed);
        let body = &text.as_bytes()[..cut.index(text.len() + 1)];
        let _ = canonical::json(body, &[], 64);
        let _ = json_fp(body);
    }
}

// ------------------------------------------------------------- fixed cases

#[test]
fn one_and_its_equivalent_spellings_agree_as_values_and_in_fingerprints() {
    let spellings = ["1", "1.0", "1e0", "10e-1", "0.1e1", "100e-2", "1E+0", "1.00"];
    for s in spellings {
        assert_eq!(canon(s.as_bytes()).as_deref(), Some("1"), "{s}");
        let body = format!(r#"{{"amount":{s}}}"#);
        assert_eq!(json_fp(body.as_bytes()), json_fp(br#"{"amount":1}"#), "{s}");
    }
}

#[test]
fn integers_two_to_the_53_plus_one_and_two_to_the_53_differ() {
    assert_ne!(canon(b"9007199254740993"), canon(b"9007199254740992"));
    assert_ne!(canon(br#"{"amount":9007199254740993}"#), canon(br#"{"amount":9007199254740992}"#));
    assert_ne!(
        json_fp(br#"{"amount":9007199254740993,"currency":"EUR"}"#),
        json_fp(br#"{"currency":"EUR","amount":9007199254740992}"#)
    );
    assert_ne!(json_fp(b"9007199254740993"), json_fp(b"9007199254740992"));
}

#[test]
fn a_hundred_thousand_open_brackets_return_none_without_overflowing_the_stack() {
    let open = "[".repeat(100_000);
    assert_eq!(canonical::json(open.as_bytes(), &[], 64), None);
    let closed = format!("{open}{}", "]".repeat(100_000));
    assert_eq!(canonical::json(closed.as_bytes(), &[], 64), None);
    let objects = r#"{"a":"#.repeat(100_000);
    assert_eq!(canonical::json(objects.as_bytes(), &[], 64), None);
    // The fingerprint falls back to the raw bytes instead of failing.
    assert_ne!(json_fp(open.as_bytes()), json_fp(closed.as_bytes()));
}

#[test]
fn huge_exponents_neither_panic_nor_allocate_unboundedly() {
    assert_eq!(canon(b"1e999999999999").as_deref(), Some("1e999999999999"));
    assert_eq!(canon(b"-1e-999999999999").as_deref(), Some("-1e-999999999999"));
    assert_eq!(canon(b"1e99999999999999999999999999999999"), None);
    assert_eq!(canon(b"0e99999999999999999999999999999999").as_deref(), Some("0"));
    let _ = json_fp(b"1e99999999999999999999999999999999");
}

/// Found by the `json_fingerprint` fuzz target: the 18-digit limit applies to the canonical
/// exponent, so every spelling of one number is on the same side of it (before the fix,
/// `0.10E+1000000000000000000` fell back to raw bytes while `1e999999999999999999`, the same
/// number, was canonicalised: the same value fingerprinted two ways).
#[test]
fn the_exponent_limit_applies_to_the_number_not_to_its_spelling() {
    let largest = Some("1e999999999999999999".to_owned());
    for text in [
        "1e999999999999999999",
        "0.10E+1000000000000000000",
        "10e999999999999999998",
        "1000e0999999999999999996",
        "0.001e1000000000000000002",
    ] {
        assert_eq!(canon(text.as_bytes()), largest, "{text}");
        assert_eq!(json_fp(text.as_bytes()), json_fp(b"1e999999999999999999"), "{text}");
    }
    let smallest = Some("-1e-999999999999999999".to_owned());
    for text in ["-1e-999999999999999999", "-100e-1000000000000000001", "-0.0001e-0999999999999999995"] {
        assert_eq!(canon(text.as_bytes()), smallest, "{text}");
    }
    for text in [
        "1e1000000000000000000",
        "10e999999999999999999",
        "0.1e1000000000000000001",
        "-1e-1000000000000000000",
        "0.01e-999999999999999999",
        "1e99999999999999999999999999999999999999999",
    ] {
        assert_eq!(canon(text.as_bytes()), None, "{text}: an exponent beyond 18 digits falls back to raw");
    }
}
