//! A reference JSON parser with exact decimal numbers, and the canonical form the crate
//! documents, computed from the parsed value.
//!
//! The documented rules it follows: the text is UTF-8 and one JSON value (RFC 8259) with
//! optional whitespace around it; a string with a lone surrogate is invalid; a duplicate member
//! name (after decoding escapes) is invalid; more than `max_depth` nested arrays and objects is
//! invalid; a nonzero number whose (canonical) exponent needs more than 18 digits is invalid.
//! Canonical form: members sorted by the UTF-8 bytes of their names, no whitespace, strings
//! escaping only `"`, `\` and control characters (`\b \t \n \f \r`, else `\u00xx`), zero as
//! `0`, any other number as `[-]D` or `[-]DeE` (`D` without leading or trailing zeros).

use std::collections::BTreeMap;

/// A JSON value with exact numbers.
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number by exact value.
    Num(Num),
    /// A string, decoded.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object, by decoded member name.
    Obj(BTreeMap<String, Json>),
}

/// Zero, or `(-1)^negative × digits × 10^exp`, `digits` without leading or trailing zeros.
#[derive(Clone, Debug, PartialEq)]
pub enum Num {
    /// Any spelling of zero.
    Zero,
    /// Any other number.
    NonZero {
        /// The sign.
        negative: bool,
        /// The significant digits.
        digits: String,
        /// The decimal exponent.
        exp: i128,
    },
}

/// The largest exponent that needs at most 18 digits.
const MAX_EXPONENT: i128 = 999_999_999_999_999_999;

/// Parses `input` as the crate documents; `None` where the crate must fall back to raw bytes.
pub fn parse(input: &[u8], max_depth: usize) -> Option<Json> {
    let text = std::str::from_utf8(input).ok()?;
    let mut p = Parser { s: text.as_bytes(), i: 0, max_depth };
    p.ws();
    let v = p.value(0)?;
    p.ws();
    (p.i == p.s.len()).then_some(v)
}

/// The canonical form of `input`, or `None` (see [`parse`]).
pub fn canonical(input: &[u8], max_depth: usize) -> Option<Vec<u8>> {
    parse(input, max_depth).map(|v| {
        let mut out = String::new();
        write_canonical(&v, &mut out);
        out.into_bytes()
    })
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    max_depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, word: &[u8]) -> Option<()> {
        if self.s[self.i..].starts_with(word) {
            self.i += word.len();
            Some(())
        } else {
            None
        }
    }

    /// A value inside `depth` containers.
    fn value(&mut self, depth: usize) -> Option<Json> {
        match self.peek()? {
            b'n' => self.eat(b"null").map(|()| Json::Null),
            b't' => self.eat(b"true").map(|()| Json::Bool(true)),
            b'f' => self.eat(b"false").map(|()| Json::Bool(false)),
            b'"' => self.string().map(Json::Str),
            b'-' | b'0'..=b'9' => self.number().map(Json::Num),
            b'[' => {
                if depth >= self.max_depth {
                    return None;
                }
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Some(Json::Arr(items));
                }
                loop {
                    self.ws();
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    match self.peek()? {
                        b',' => self.i += 1,
                        b']' => {
                            self.i += 1;
                            return Some(Json::Arr(items));
                        }
                        _ => return None,
                    }
                }
            }
            b'{' => {
                if depth >= self.max_depth {
                    return None;
                }
                self.i += 1;
                let mut members = BTreeMap::new();
                self.ws();
                if self.peek() == Some(b'}') {
                    self.i += 1;
                    return Some(Json::Obj(members));
                }
                loop {
                    self.ws();
                    if self.peek()? != b'"' {
                        return None;
                    }
                    let name = self.string()?;
                    self.ws();
                    self.eat(b":")?;
                    self.ws();
                    let value = self.value(depth + 1)?;
                    if members.insert(name, value).is_some() {
                        return None; // a duplicate member name
                    }
                    self.ws();
                    match self.peek()? {
                        b',' => self.i += 1,
                        b'}' => {
                            self.i += 1;
                            return Some(Json::Obj(members));
                        }
                        _ => return None,
                    }
                }
            }
            _ => None,
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = std::str::from_utf8(self.s.get(self.i..self.i + 4)?).ok()?;
        if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        self.i += 4;
        u32::from_str_radix(digits, 16).ok()
    }

    fn string(&mut self) -> Option<String> {
        self.i += 1; // the opening quote
        let mut out = Vec::new();
        loop {
            let b = self.peek()?;
            self.i += 1;
            match b {
                b'"' => return String::from_utf8(out).ok(),
                b'\\' => {
                    let e = self.peek()?;
                    self.i += 1;
                    let c = match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let unit = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&unit) {
                                self.eat(b"\\u")?;
                                let low = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&low) {
                                    return None;
                                }
                                0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                            } else {
                                unit
                            };
                            char::from_u32(code)? // `None` for a lone low surrogate
                        }
                        _ => return None,
                    };
                    let mut buf = [0; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                0..0x20 => return None,
                _ => out.push(b),
            }
        }
    }

    fn digits(&mut self) -> &[u8] {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        &self.s[start..self.i]
    }

    fn number(&mut self) -> Option<Num> {
        let negative = self.peek() == Some(b'-');
        if negative {
            self.i += 1;
        }
        let int = self.digits().to_vec();
        if int.is_empty() || (int.len() > 1 && int[0] == b'0') {
            return None;
        }
        let mut frac = Vec::new();
        if self.peek() == Some(b'.') {
            self.i += 1;
            frac = self.digits().to_vec();
            if frac.is_empty() {
                return None;
            }
        }
        // The exponent as written: `None` when it is too long to matter (see below).
        let mut written_exp: Option<i128> = Some(0);
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            let exp_negative = match self.peek() {
                Some(b'-') => {
                    self.i += 1;
                    true
                }
                Some(b'+') => {
                    self.i += 1;
                    false
                }
                _ => false,
            };
            let digits = self.digits();
            if digits.is_empty() {
                return None;
            }
            let significant = std::str::from_utf8(digits).unwrap().trim_start_matches('0');
            // Inputs are far shorter than 10^30 bytes, so an exponent of 31 or more digits
            // stays beyond 18 digits whatever the spelling of the digits adds.
            written_exp = if significant.len() > 30 {
                None
            } else {
                let m: i128 = if significant.is_empty() { 0 } else { significant.parse().unwrap() };
                Some(if exp_negative { -m } else { m })
            };
        }
        // The value is 0.(int frac) × 10^(written + len(int)): take the significant digits.
        let all: Vec<u8> = int.iter().chain(frac.iter()).copied().collect();
        let Some(first) = all.iter().position(|&d| d != b'0') else {
            return Some(Num::Zero);
        };
        let last = all.iter().rposition(|&d| d != b'0').unwrap();
        let digits = String::from_utf8(all[first..=last].to_vec()).unwrap();
        // value = all × 10^(written - len(frac)); dropping `len(all) - 1 - last` trailing zeros
        // raises the exponent by as much.
        let trailing = (all.len() - 1 - last) as i128;
        let exp = written_exp? - frac.len() as i128 + trailing;
        if exp.abs() > MAX_EXPONENT {
            return None;
        }
        Some(Num::NonZero { negative, digits, exp })
    }
}

/// Writes the canonical form of `v`.
pub fn write_canonical(v: &Json, out: &mut String) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Num(Num::Zero) => out.push('0'),
        Json::Num(Num::NonZero { negative, digits, exp }) => {
            if *negative {
                out.push('-');
            }
            out.push_str(digits);
            if *exp != 0 {
                out.push_str(&format!("e{exp}"));
            }
        }
        Json::Str(s) => write_string(s, out),
        Json::Arr(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Json::Obj(members) => {
            // `BTreeMap<String, _>` iterates in UTF-8 byte order.
            out.push('{');
            for (k, (name, value)) in members.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                write_string(name, out);
                out.push(':');
                write_canonical(value, out);
            }
            out.push('}');
        }
    }
}

fn write_string(s: &str, out: &mut String) {
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

/// Choices for [`render`], drawn from fuzz input bytes (zero once they run out).
pub struct Choices<'a>(pub &'a [u8]);

impl Choices<'_> {
    fn next(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
}

/// Writes `v` as JSON text in another spelling of the same value: whitespace, member order,
/// string escapes and number spellings are chosen by `choices`.
pub fn render(v: &Json, choices: &mut Choices<'_>, out: &mut String) {
    ws(choices, out);
    match v {
        Json::Null | Json::Bool(_) => write_canonical(v, out),
        Json::Num(n) => render_number(n, choices, out),
        Json::Str(s) => render_string(s, choices, out),
        Json::Arr(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                render(item, choices, out);
            }
            ws(choices, out);
            out.push(']');
        }
        Json::Obj(members) => {
            let mut members: Vec<_> = members.iter().collect();
            if !members.is_empty() {
                let turn = usize::from(choices.next()) % members.len();
                members.rotate_left(turn);
                if choices.next() & 1 == 1 {
                    members.reverse();
                }
            }
            out.push('{');
            for (k, (name, value)) in members.into_iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                ws(choices, out);
                render_string(name, choices, out);
                ws(choices, out);
                out.push(':');
                render(value, choices, out);
            }
            ws(choices, out);
            out.push('}');
        }
    }
    ws(choices, out);
}

fn ws(choices: &mut Choices<'_>, out: &mut String) {
    let c = choices.next();
    for k in 0..(c & 3) {
        out.push([' ', '\n', '\t', '\r'][usize::from((c >> (2 + 2 * k)) & 3)]);
    }
}

fn render_string(s: &str, choices: &mut Choices<'_>, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let how = choices.next() % 4;
        match c {
            '"' | '\\' if how != 0 => {
                out.push('\\');
                out.push(c);
            }
            '/' if how == 1 => out.push_str("\\/"),
            c if how == 2 || u32::from(c) < 0x20 || c == '"' || c == '\\' => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    if choices.next() & 1 == 1 {
                        out.push_str(&format!("\\u{unit:04X}"));
                    } else {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn render_number(n: &Num, choices: &mut Choices<'_>, out: &mut String) {
    let (negative, digits, exp) = match n {
        Num::Zero => {
            let negative = choices.next() & 1 == 1;
            let form = ["0", "0.0", "0e0", "0.000E+7", "0e-99999999999999999999999"][usize::from(choices.next() % 5)];
            if negative {
                out.push('-');
            }
            out.push_str(form);
            return;
        }
        Num::NonZero { negative, digits, exp } => (*negative, digits.as_str(), *exp),
    };
    if negative {
        out.push('-');
    }
    // Pad with up to 3 trailing zeros, then put the decimal point `shift` digits from the end.
    let pad = usize::from(choices.next() % 4);
    let mantissa = format!("{digits}{}", "0".repeat(pad));
    let shift = usize::from(choices.next()) % (mantissa.len() + 3);
    let written = exp - pad as i128 + shift as i128;
    if shift == 0 {
        out.push_str(&mantissa);
    } else if shift < mantissa.len() {
        let (int, frac) = mantissa.split_at(mantissa.len() - shift);
        out.push_str(int);
        out.push('.');
        out.push_str(frac);
    } else {
        out.push_str("0.");
        out.push_str(&"0".repeat(shift - mantissa.len()));
        out.push_str(&mantissa);
    }
    let lead = usize::from(choices.next() % 3);
    if written != 0 || choices.next() & 1 == 1 {
        out.push(if choices.next() & 1 == 1 { 'E' } else { 'e' });
        if written < 0 {
            out.push('-');
        } else if choices.next() & 1 == 1 {
            out.push('+');
        }
        out.push_str(&"0".repeat(lead));
        out.push_str(&written.unsigned_abs().to_string());
    }
}
