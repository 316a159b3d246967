use super::*;
use http::HeaderValue;

fn canon(body: &str) -> Option<String> {
    canonical::json(body.as_bytes(), &[], 64).map(|v| String::from_utf8(v).unwrap())
}

fn canon_ignoring(body: &str, ignored: &[&str]) -> Option<String> {
    canonical::json(body.as_bytes(), ignored, 64).map(|v| String::from_utf8(v).unwrap())
}

fn json_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers
}

fn fp(uri: &str, headers: &HeaderMap, body: &[u8], spec: &FingerprintSpec) -> Fingerprint {
    fingerprint(&Method::POST, &uri.parse().unwrap(), headers, body, spec)
}

#[test]
fn numbers_with_the_same_decimal_value_share_one_canonical_form() {
    let table: &[(&str, &str)] = &[
        ("1", "1"),
        ("1.0", "1"),
        ("1e0", "1"),
        ("1E+0", "1"),
        ("10e-1", "1"),
        ("0.1e1", "1"),
        ("100e-2", "1"),
        ("1.000000000000000000000000000000", "1"),
        ("0", "0"),
        ("-0", "0"),
        ("0.000", "0"),
        ("-0.0e-5", "0"),
        ("0e999999999999999999999999", "0"),
        ("10", "1e1"),
        ("1500", "15e2"),
        ("15e2", "15e2"),
        ("1.5e3", "15e2"),
        ("0.25", "25e-2"),
        ("-1.50", "-15e-1"),
        ("-7", "-7"),
        ("12345", "12345"),
        ("9007199254740993", "9007199254740993"),
        ("9007199254740992", "9007199254740992"),
        ("0.0001230", "123e-6"),
        ("1e-7", "1e-7"),
        ("123.456e2", "123456e-1"),
        ("1e999999999999999999", "1e999999999999999999"),
        ("1e-000000000000000000000000005", "1e-5"),
        ("123456789012345678901234567890", "12345678901234567890123456789e1"),
    ];
    for (input, expected) in table {
        assert_eq!(canon(input).as_deref(), Some(*expected), "input {input}");
    }
}

#[test]
fn integers_beyond_f64_precision_stay_distinct() {
    assert_ne!(canon("9007199254740993"), canon("9007199254740992"));
    assert_ne!(canon(r#"{"amount":9007199254740993}"#), canon(r#"{"amount":9007199254740992}"#));
    assert_ne!(canon("0.1"), canon("0.10000000000000001"));
}

#[test]
fn huge_exponents_are_rejected_not_panicked_on() {
    assert_eq!(canon("1e9999999999999999999"), None);
    assert_eq!(canon("-5.5e-99999999999999999999999999"), None);
    assert_eq!(canon(r#"{"x":1e1000000000000000000000}"#), None);
}

#[test]
fn malformed_numbers_are_not_json() {
    for bad in ["01", "-", "1.", ".5", "1e", "1e+", "+1", "--1", "1.e5", "0x10", "NaN", "Infinity", "-01"] {
        assert_eq!(canon(bad), None, "input {bad}");
    }
}

#[test]
fn string_escapes_are_normalised() {
    assert_eq!(canon(r#""\u0041\/\u00e9""#).as_deref(), Some(r#""A/é""#));
    assert_eq!(canon(r#""A/é""#).as_deref(), Some(r#""A/é""#));
    assert_eq!(
        canon(r#""\"\\\b\f\n\r\t\u0001\u001F\u007f""#).as_deref(),
        Some("\"\\\"\\\\\\b\\f\\n\\r\\t\\u0001\\u001f\u{7f}\"")
    );
    assert_eq!(canon(r#""\u0000""#).as_deref(), Some(r#""\u0000""#));
    assert_eq!(canon(r#""\u2028""#).as_deref(), Some("\"\u{2028}\""));
}

#[test]
fn surrogate_pairs_decode_and_lone_surrogates_are_rejected() {
    assert_eq!(canon(r#""\ud83d\ude00""#).as_deref(), Some("\"😀\""));
    assert_eq!(canon(r#""\uD83D\uDE00""#), canon("\"😀\""));
    assert_eq!(canon(r#""\ud800""#), None);
    assert_eq!(canon(r#""\udc00""#), None);
    assert_eq!(canon(r#""\ud800\u0041""#), None);
    assert_eq!(canon(r#""\ud800x""#), None);
    assert_eq!(canon(r#""\ude00\ud83d""#), None);
}

#[test]
fn invalid_strings_are_not_json() {
    assert_eq!(canon("\"a\nb\""), None, "raw control character");
    assert_eq!(canon(r#""\x""#), None, "unknown escape");
    assert_eq!(canon(r#""\u12""#), None, "short unicode escape");
    assert_eq!(canon(r#""\u12g4""#), None, "bad hex");
    assert_eq!(canon(r#""abc"#), None, "unterminated");
    assert_eq!(canonical::json(b"\"\xff\"", &[], 64), None, "invalid UTF-8");
    assert_eq!(canonical::json(b"\"\xed\xa0\x80\"", &[], 64), None, "UTF-8 surrogate");
    assert_eq!(canonical::json(b"\xef\xbb\xbf{}", &[], 64), None, "BOM");
}

#[test]
fn members_are_sorted_by_decoded_name_bytes_and_whitespace_dropped() {
    assert_eq!(
        canon(" { \"b\" : [ 1 , 2 ] ,\n\t\"a\" : { \"d\" : null , \"c\" : true } , \"\" : false } ").as_deref(),
        Some(r#"{"":false,"a":{"c":true,"d":null},"b":[1,2]}"#)
    );
    // "\u0062" decodes to "b", which sorts after "a" even though '\' < 'a'.
    assert_eq!(canon(r#"{"\u0062":1,"a":2}"#).as_deref(), Some(r#"{"a":2,"b":1}"#));
    // UTF-8 byte order: U+00E9 (c3 a9) sorts before U+FF21 (ef bc a1) and after "z".
    assert_eq!(
        canon("{\"\u{ff21}\":1,\"\u{e9}\":2,\"z\":3}").as_deref(),
        Some("{\"z\":3,\"\u{e9}\":2,\"\u{ff21}\":1}")
    );
}

#[test]
fn duplicate_member_names_are_rejected_even_when_escaped_differently() {
    assert_eq!(canon(r#"{"a":1,"a":1}"#), None);
    assert_eq!(canon(r#"{"a":1,"\u0061":2}"#), None);
    assert_eq!(canon(r#"{"x":[{"k":1,"j":2,"k":3}]}"#), None);
    assert!(canon(r#"{"a":{"a":1},"b":{"a":1}}"#).is_some());
}

#[test]
fn depth_is_bounded_without_recursion() {
    let nested = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    assert!(canon(&nested(64)).is_some());
    assert_eq!(canon(&nested(65)), None);
    assert_eq!(canon(&"[".repeat(100_000)), None);
    assert_eq!(canon(&nested(100_000)), None);
    assert_eq!(canonical::json(b"[]", &[], 0), None);
    assert_eq!(canonical::json(b"7", &[], 0).as_deref(), Some(&b"7"[..]));
    // A very deep bound still does not recurse.
    let deep = nested(200_000);
    assert_eq!(canonical::json(deep.as_bytes(), &[], usize::MAX).map(|v| v.len()), Some(400_000));
    let deep_objects = format!("{}1{}", r#"{"a":"#.repeat(50_000), "}".repeat(50_000));
    assert!(canonical::json(deep_objects.as_bytes(), &["/a/a/b"], usize::MAX).is_some());
}

#[test]
fn trailing_garbage_and_incomplete_documents_are_rejected() {
    for bad in [
        "{} x",
        "{}{}",
        "1 2",
        "[1,]",
        "{\"a\":1,}",
        "[1",
        "{\"a\"}",
        "{\"a\" 1}",
        "{1:2}",
        "",
        "   ",
        "tru",
        "nul",
        "[,1]",
        "{,}",
        "]",
        "\"a\" \"b\"",
    ] {
        assert_eq!(canon(bad), None, "input {bad:?}");
    }
}

#[test]
fn top_level_scalars_are_json() {
    assert_eq!(canon(" true ").as_deref(), Some("true"));
    assert_eq!(canon("null").as_deref(), Some("null"));
    assert_eq!(canon("\"x\"").as_deref(), Some("\"x\""));
    assert_eq!(canon("-2.50").as_deref(), Some("-25e-1"));
}

#[test]
fn ignored_pointers_remove_members_where_the_path_exists() {
    let body = r#"{"amount":1,"client_request_time":"now","meta":{"trace_id":"t","x":1},"items":[{"n":1,"note":"a"},{"n":2,"note":"b"}]}"#;
    assert_eq!(
        canon_ignoring(body, &["/client_request_time", "/meta/trace_id", "/items/1/note"]).as_deref(),
        Some(r#"{"amount":1,"items":[{"n":1,"note":"a"},{"n":2}],"meta":{"x":1}}"#)
    );
    assert_eq!(
        canon_ignoring(body, &["/items/0", "/meta"]).as_deref(),
        Some(r#"{"amount":1,"client_request_time":"now","items":[{"n":2,"note":"b"}]}"#)
    );
    // Missing paths, wrong container kinds, non-index tokens on arrays.
    assert_eq!(
        canon_ignoring(body, &["/nope", "/amount/x", "/items/01", "/items/-", "/items/x", "/meta/0"]),
        canon(body)
    );
    // Escaped tokens.
    assert_eq!(
        canon_ignoring(r#"{"a/b":1,"m~n":2,"":3,"k":4}"#, &["/a~1b", "/m~0n", "/"]).as_deref(),
        Some(r#"{"k":4}"#)
    );
    // Names match after escape decoding.
    assert_eq!(canon_ignoring(r#"{"\u0074s":1,"k":4}"#, &["/ts"]).as_deref(), Some(r#"{"k":4}"#));
    // Invalid pointers match nothing in `canonical::json`.
    assert_eq!(canon_ignoring(r#"{"a":1}"#, &["a", "", "/~2"]), canon(r#"{"a":1}"#));
}

#[test]
fn ignoring_a_member_does_not_hide_a_duplicate() {
    assert_eq!(canon_ignoring(r#"{"t":1,"t":2}"#, &["/t"]), None);
}

#[test]
#[should_panic(expected = "JSON Pointer")]
fn spec_rejects_a_pointer_without_a_leading_slash() {
    let _ = FingerprintSpec::new().ignore_json_member("client_request_time");
}

#[test]
fn form_pairs_are_ordered_by_name_keeping_value_order() {
    assert_eq!(canonical::form(b"b=2&a=1&b=1&a=0"), b"a=1&a=0&b=2&b=1");
    assert_eq!(canonical::form(b"q=a+b%20c&&%61=%zz&empty&x=%FF"), b"a=%25zz&empty=&q=a+b+c&x=%FF");
    assert_ne!(canonical::form(b"x=%FF"), canonical::form(b"x=%FE"));
    assert_eq!(canonical::form(b""), b"");
}

#[test]
fn query_pairs_are_sorted_by_name_and_value() {
    let headers = HeaderMap::new();
    let spec = FingerprintSpec::new();
    let a = fp("/o?b=2&a=1&a=0", &headers, b"", &spec);
    let b = fp("/o?a=0&b=2&a=1", &headers, b"", &spec);
    let c = fp("/o?a=%30&b=2&a=1", &headers, b"", &spec);
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_ne!(a, fp("/o?a=0&b=3&a=1", &headers, b"", &spec));
    assert_ne!(a, fp("/o", &headers, b"", &spec));
    // Framing: "a=1b" is not "a1=b".
    assert_ne!(fp("/o?a=1b", &headers, b"", &spec), fp("/o?a1=b", &headers, b"", &spec));
}

#[test]
fn method_and_path_are_part_of_the_fingerprint() {
    let headers = HeaderMap::new();
    let spec = FingerprintSpec::new();
    let uri: Uri = "/orders".parse().unwrap();
    let post = fingerprint(&Method::POST, &uri, &headers, b"x", &spec);
    let patch = fingerprint(&Method::PATCH, &uri, &headers, b"x", &spec);
    assert_ne!(post, patch);
    assert_ne!(post, fp("/orders/", &headers, b"x", &spec));
}

#[test]
fn declared_headers_change_the_fingerprint_and_others_do_not() {
    let spec = FingerprintSpec::new().include_header(HeaderName::from_static("api-version"));
    let mut v1 = json_headers();
    v1.insert("api-version", HeaderValue::from_static("1"));
    let mut v2 = json_headers();
    v2.insert("api-version", HeaderValue::from_static("2"));
    let body = br#"{"a":1}"#;
    assert_ne!(fp("/o", &v1, body, &spec), fp("/o", &v2, body, &spec));
    assert_ne!(fp("/o", &v1, body, &spec), fp("/o", &json_headers(), body, &spec));

    let mut both = v1.clone();
    both.append("api-version", HeaderValue::from_static("2"));
    assert_ne!(fp("/o", &v1, body, &spec), fp("/o", &both, body, &spec));

    let mut traced = v1.clone();
    traced.insert("x-trace", HeaderValue::from_static("abc"));
    assert_eq!(fp("/o", &v1, body, &spec), fp("/o", &traced, body, &spec));

    // Without the declaration the header is not part of the request's meaning.
    let plain = FingerprintSpec::new();
    assert_eq!(fp("/o", &v1, body, &plain), fp("/o", &v2, body, &plain));
}

#[test]
fn content_type_selects_the_body_kind_and_is_itself_fingerprinted() {
    let spec = FingerprintSpec::new();
    let with = |ct: &'static str| {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        h
    };
    let a = br#"{"a":1,"b":2}"#;
    let b = br#"{ "b": 2.0, "a": 1 }"#;
    for ct in
        ["application/json", "Application/JSON; charset=utf-8", "application/problem+json", "application/vnd.api+JSON"]
    {
        assert_eq!(fp("/o", &with(ct), a, &spec), fp("/o", &with(ct), b, &spec), "{ct}");
    }
    for ct in ["text/plain", "application/jsonx", "application/json-patch"] {
        assert_ne!(fp("/o", &with(ct), a, &spec), fp("/o", &with(ct), b, &spec), "{ct}");
    }
    assert_ne!(fp("/o", &HeaderMap::new(), a, &spec), fp("/o", &HeaderMap::new(), b, &spec));
    // Same body, different content type: different fingerprint.
    assert_ne!(fp("/o", &with("application/json"), a, &spec), fp("/o", &with("application/vnd.api+json"), a, &spec));
    // The essence is case-insensitive and parameters are trimmed.
    assert_eq!(
        fp("/o", &with("Application/Json ;  charset=utf-8 "), a, &spec),
        fp("/o", &with("application/json;charset=utf-8"), b, &spec)
    );
    let form = with("application/x-www-form-urlencoded");
    assert_eq!(fp("/o", &form, b"b=2&a=1", &spec), fp("/o", &form, b"a=1&b=2", &spec));
    assert_ne!(fp("/o", &form, b"a=1&a=2", &spec), fp("/o", &form, b"a=2&a=1", &spec));
}

#[test]
fn invalid_json_falls_back_to_raw_bytes() {
    let spec = FingerprintSpec::new();
    let headers = json_headers();
    let mut raw_headers = HeaderMap::new();
    raw_headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    for body in [&br#"{"a":1,"a":2}"#[..], b"{\"a\":", b"[[[1]]] x", b"\xff"] {
        // Deterministic, and distinct from a near-identical raw body.
        assert_eq!(fp("/o", &headers, body, &spec), fp("/o", &raw_headers, body, &spec));
        let mut other = body.to_vec();
        other.push(b' ');
        assert_ne!(fp("/o", &headers, body, &spec), fp("/o", &headers, &other, &spec));
    }
    // A body too deep for the route's bound is hashed raw, so whitespace counts.
    let shallow = FingerprintSpec::new().max_json_depth(1);
    assert_ne!(fp("/o", &headers, b"[[1]]", &shallow), fp("/o", &headers, b"[ [1]]", &shallow));
    assert_eq!(fp("/o", &headers, b"[[1]]", &spec), fp("/o", &headers, b"[ [1]]", &spec));
}

#[test]
fn raw_fallback_never_collides_with_a_canonical_body() {
    // The canonical form of `{"a":1,"b":2}` is itself; tagged J vs R.
    let spec = FingerprintSpec::new();
    let json = fp("/o", &json_headers(), br#"{"a":1,"b":2}"#, &spec);
    let raw = fp("/o", &HeaderMap::new(), br#"{"a":1,"b":2}"#, &spec);
    assert_ne!(json, raw);
}

#[test]
fn ignored_members_from_the_spec_leave_the_fingerprint_unchanged() {
    let spec = FingerprintSpec::new().ignore_json_member("/client_request_time").ignore_json_member("/meta/trace_id");
    let headers = json_headers();
    let a = fp("/o", &headers, br#"{"amount":5,"client_request_time":1,"meta":{"trace_id":"a","k":1}}"#, &spec);
    let b = fp("/o", &headers, br#"{"meta":{"k":1,"trace_id":"b"},"amount":5,"client_request_time":2}"#, &spec);
    let c = fp("/o", &headers, br#"{"amount":5,"meta":{"k":1}}"#, &spec);
    let d = fp("/o", &headers, br#"{"amount":6,"meta":{"k":1}}"#, &spec);
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_ne!(a, d);
}

#[test]
fn empty_body_is_raw_whatever_the_content_type() {
    let spec = FingerprintSpec::new();
    let mut form = HeaderMap::new();
    form.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/x-www-form-urlencoded"));
    // Deterministic; and an empty JSON body is not the JSON string "".
    assert_eq!(fp("/o", &form, b"", &spec), fp("/o", &form, b"", &spec));
    assert_ne!(fp("/o", &json_headers(), b"", &spec), fp("/o", &json_headers(), b"\"\"", &spec));
}

#[test]
fn fingerprint_accessors_and_debug_show_version_and_hex() {
    let spec = FingerprintSpec::new();
    let f = fp("/o", &HeaderMap::new(), b"x", &spec);
    assert_eq!(f.version(), FINGERPRINT_VERSION);
    assert_eq!(Fingerprint::from_parts(f.version(), *f.digest()), f);
    assert_ne!(Fingerprint::from_parts(1, *f.digest()), f);
    let hex = f.to_hex();
    assert_eq!(hex.len(), 64);
    assert!(hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    let debug = format!("{f:?}");
    assert!(debug.contains(&hex) && debug.contains("version: 2"), "{debug}");
    assert_eq!(Fingerprint::from_parts(1, [0xab; 32]).to_hex(), "ab".repeat(32));
}

/// The hash input of the pinned request below, with `prefix` and the media type `content_type`.
fn pinned_input(prefix: &[u8], content_type: &[u8]) -> [u8; 32] {
    let mut expected = Vec::new();
    expected.extend_from_slice(prefix);
    let field = |out: &mut Vec<u8>, bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        out.extend_from_slice(bytes);
    };
    field(&mut expected, b"POST");
    field(&mut expected, b"/orders");
    expected.extend_from_slice(&2u64.to_be_bytes());
    for s in [&b"a"[..], b"1", b"b", b"2"] {
        field(&mut expected, s);
    }
    expected.extend_from_slice(&1u64.to_be_bytes());
    field(&mut expected, content_type);
    expected.extend_from_slice(&1u64.to_be_bytes());
    field(&mut expected, b"api-version");
    expected.extend_from_slice(&1u64.to_be_bytes());
    field(&mut expected, b"1");
    expected.push(b'J');
    field(&mut expected, br#"{"a":"x","b":1}"#);
    Sha256::digest(&expected).into()
}

#[test]
fn fingerprint_is_stable_across_releases() {
    // Pinned: changing any of this changes stored records' meaning, which
    // needs a new FINGERPRINT_VERSION.
    let spec = FingerprintSpec::new().include_header(HeaderName::from_static("api-version"));
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("Application/JSON; Charset=\"UTF-8\""));
    headers.insert("api-version", HeaderValue::from_static("1"));
    let body = br#"{"b":1.0,"a":"x"}"#;
    let uri = "/orders?b=2&a=1".parse().unwrap();

    let v2 = fp("/orders?b=2&a=1", &headers, body, &spec);
    let expected = pinned_input(b"tower-idempotency/fingerprint/v2\0", b"application/json");
    assert_eq!(v2, Fingerprint::from_parts(2, expected));

    let v1 = fingerprint_with_version(1, &Method::POST, &uri, &headers, body, &spec).unwrap();
    let expected = pinned_input(b"tower-idempotency/fingerprint/v1\0", b"application/json;Charset=\"UTF-8\"");
    assert_eq!(v1, Fingerprint::from_parts(1, expected));
    assert_eq!(fingerprint_with_version(2, &Method::POST, &uri, &headers, body, &spec), Some(v2));
    for unknown in [0, 3, 255] {
        assert_eq!(fingerprint_with_version(unknown, &Method::POST, &uri, &headers, body, &spec), None);
    }
}

/// The version-2 media type of `value`.
fn media_type(value: &str) -> String {
    let mut out = Vec::new();
    content_type_v2(value.as_bytes(), &mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn media_types_are_normalised_in_version_2() {
    let table: &[(&str, &str)] = &[
        ("application/json", "application/json"),
        ("application/json; charset=utf-8", "application/json"),
        ("Application/JSON ; CHARSET = \"UTF-8\" ", "application/json"),
        ("application/vnd.api+json;charset=UTF-8", "application/vnd.api+json"),
        ("application/json; charset=latin1", "application/json;charset=latin1"),
        ("application/json;;", "application/json"),
        ("text/plain; format=flowed; charset=UTF-8", "text/plain;charset=utf-8;format=flowed"),
        ("text/plain; charset=utf-8", "text/plain;charset=utf-8"),
        ("multipart/form-data; boundary=AbC", "multipart/form-data;boundary=AbC"),
        ("multipart/form-data; boundary=\"a;b\"", "multipart/form-data;boundary=\"a;b\""),
        ("text/x; a=\"q\\\"x\"", "text/x;a=\"q\\\"x\""),
        ("text/x; a=\"\"", "text/x;a=\"\""),
        ("text/x; a", "text/x;a"),
        ("text/x; b=1; a=2; a=1", "text/x;a=1;a=2;b=1"),
        ("", ""),
    ];
    for (value, expected) in table {
        assert_eq!(media_type(value), *expected, "{value:?}");
    }
    // Different parameters stay different.
    for (a, b) in [
        ("text/x; a", "text/x; a=\"\""),
        ("text/x; a=\"b;c=d\"", "text/x; a=b; c=d"),
        ("multipart/form-data; boundary=a", "multipart/form-data; boundary=A"),
        ("application/json; charset=utf-16", "application/json"),
    ] {
        assert_ne!(media_type(a), media_type(b), "{a:?} vs {b:?}");
    }
}

#[test]
fn a_json_charset_of_utf_8_is_the_same_request_in_version_2_only() {
    let spec = FingerprintSpec::new();
    let with = |ct: &'static str| {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        h
    };
    let body = br#"{"a":1}"#;
    let uri: Uri = "/o".parse().unwrap();
    let v1 = |ct| fingerprint_with_version(1, &Method::POST, &uri, &with(ct), body, &spec).unwrap();
    for (a, b) in [
        ("application/json", "application/json; charset=utf-8"),
        ("application/json; charset=utf-8", "application/json; charset=UTF-8"),
        ("text/plain; charset=utf-8", "text/plain; charset=UTF-8"),
    ] {
        assert_eq!(fp("/o", &with(a), body, &spec), fp("/o", &with(b), body, &spec), "{a} vs {b}");
        assert_ne!(v1(a), v1(b), "{a} vs {b} in version 1");
    }
}
