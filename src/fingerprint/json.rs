//! Canonical JSON: a single-pass parser that builds a flat tape of borrowed
//! nodes, and an emitter that writes the canonical form from the tape.
//!
//! Neither half recurses: the parser keeps an explicit stack of open
//! containers (bounded by `max_depth`, checked before a container is pushed),
//! and the emitter keeps an explicit stack of frames. No input can overflow
//! the call stack.
//!
//! The canonical form:
//! - no insignificant whitespace;
//! - object members sorted by the UTF-8 bytes of their *decoded* names;
//! - strings re-escaped one fixed way: `"` → `\"`, `\` → `\\`, the control
//!   characters U+0008, U+0009, U+000A, U+000C, U+000D → `\b \t \n \f \r`, the
//!   other control characters below U+0020 → `\u00xx` (lowercase hex); every
//!   other character (including `/`, U+007F and all non-ASCII) as raw UTF-8;
//! - numbers by exact decimal value, see [`Number format`](#number-format);
//! - `true`, `false`, `null` as themselves.
//!
//! # Number format
//!
//! A number is zero, or `sign × D × 10^E` with `D` a digit string without
//! leading or trailing zeros. Zero (including `-0`, `0.0`, `0e7`) is written
//! `0`. Otherwise the output is `[-]D` when `E = 0`, else `[-]DeE` with `E`
//! in plain decimal (`-` when negative, no `+`). So `1`, `1.0`, `1e0`,
//! `10e-1` → `1`; `1500` → `15e2`; `0.25` → `25e-2`; `-1.50` → `-15e-1`. The
//! result is always a valid JSON number, and two numbers have the same form
//! exactly when they have the same decimal value. The exponent is held in an
//! `i64`; an exponent whose magnitude needs more than 18 decimal digits (on a
//! nonzero number) makes the document non-canonicalisable.

use std::cmp::Ordering;

/// Largest input the tape can address (offsets are `u32`).
const MAX_INPUT: usize = (u32::MAX / 4) as usize;

/// The largest canonical exponent (18 digits); a number beyond it makes the body fall back to raw.
const MAX_EXPONENT: u128 = 999_999_999_999_999_999;

/// One node of the parse tape. Containers store the tape index one past
/// their last descendant, so siblings can be skipped in O(1).
#[derive(Clone, Copy, Debug)]
enum Node {
    /// Canonical scalar text, verbatim from the input (literals, integers
    /// that are already canonical).
    Raw { start: u32, end: u32 },
    /// Canonical scalar text in the arena (rewritten numbers).
    RawArena { start: u32, end: u32 },
    /// A string without escapes: the input bytes between the quotes.
    Str { start: u32, end: u32 },
    /// A string with escapes: its decoded bytes in the arena.
    StrArena { start: u32, end: u32 },
    /// The number zero.
    Zero,
    /// `[`; `end` is the tape index after the array's last descendant.
    Array { end: u32 },
    /// `{`; `end` is the tape index after the object's last descendant. The
    /// members follow as (key `Str`/`StrArena`, value subtree) pairs.
    Object { end: u32 },
}

/// A parsed document: the tape plus the arena its nodes may point into.
#[derive(Default)]
pub(crate) struct Scratch {
    tape: Vec<Node>,
    arena: Vec<u8>,
    parse_stack: Vec<(u32, bool)>,
    members: Vec<Member>,
    active: Vec<u32>,
    frames: Vec<Frame>,
    /// A reusable output buffer for callers (not touched by this module).
    pub(crate) output: Vec<u8>,
}

impl Scratch {
    /// Drops buffers that a very large body grew, so an idle thread does not
    /// keep them.
    pub(crate) fn trim(&mut self) {
        if self.tape.capacity() > 1 << 16 {
            self.tape = Vec::new();
        }
        if self.arena.capacity() > 1 << 20 {
            self.arena = Vec::new();
        }
        if self.members.capacity() > 1 << 14 {
            self.members = Vec::new();
        }
        if self.active.capacity() > 1 << 12 {
            self.active = Vec::new();
        }
        if self.frames.capacity() > 1 << 10 {
            self.frames = Vec::new();
        }
        if self.parse_stack.capacity() > 1 << 10 {
            self.parse_stack = Vec::new();
        }
        if self.output.capacity() > 1 << 20 {
            self.output = Vec::new();
        }
    }

    fn clear(&mut self) {
        self.tape.clear();
        self.arena.clear();
        self.parse_stack.clear();
        self.members.clear();
        self.active.clear();
        self.frames.clear();
    }
}

/// One reference token of a JSON Pointer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Token {
    /// The unescaped member name.
    name: Box<str>,
    /// The array index this token denotes, if it is one (RFC 6901 `array-index`).
    index: Option<u32>,
}

/// A parsed JSON Pointer (RFC 6901) with at least one reference token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Pointer {
    tokens: Box<[Token]>,
}

impl Pointer {
    /// Parses a JSON Pointer. `None` for the empty pointer (the whole
    /// document, which cannot be left out) and for text that is not a JSON
    /// Pointer (does not start with `/`, or has a `~` not followed by `0`/`1`).
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let rest = text.strip_prefix('/')?;
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut name = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                if c == '~' {
                    match chars.next() {
                        Some('0') => name.push('~'),
                        Some('1') => name.push('/'),
                        _ => return None,
                    }
                } else {
                    name.push(c);
                }
            }
            let index = array_index(&name);
            tokens.push(Token { name: name.into_boxed_str(), index });
        }
        Some(Self { tokens: tokens.into_boxed_slice() })
    }
}

/// RFC 6901 `array-index`: `0` or a digit string without a leading zero.
fn array_index(name: &str) -> Option<u32> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    if bytes.len() > 1 && bytes[0] == b'0' {
        return None;
    }
    name.parse().ok()
}

/// Bytes that end a fast string scan: `"`, `\` and control characters.
static STRING_STOP: [bool; 256] = {
    let mut table = [false; 256];
    let mut i = 0;
    while i < 0x20 {
        table[i] = true;
        i += 1;
    }
    table[b'"' as usize] = true;
    table[b'\\' as usize] = true;
    table
};

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Index of the first byte at or after `i` that is `"`, `\` or a control
/// character, or `input.len()`.
#[inline(always)]
fn scan_string(input: &[u8], mut i: usize) -> usize {
    while let Some(chunk) = input.get(i..i + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let v = u64::from_le_bytes(word);
        let quote = v ^ (ONES * u64::from(b'"'));
        let backslash = v ^ (ONES * u64::from(b'\\'));
        // The lowest flagged byte of each term is exact (borrows only move up).
        let mask = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | (v.wrapping_sub(ONES * 0x20) & !v);
        let mask = mask & HIGHS;
        if mask != 0 {
            return i + (mask.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < input.len() && !STRING_STOP[usize::from(input[i])] {
        i += 1;
    }
    i
}

fn u32_of(n: usize) -> Option<u32> {
    u32::try_from(n).ok()
}

/// Parses `input` into `s.tape`/`s.arena`. `false` if `input` is not a
/// single valid JSON value, or nests deeper than `max_depth` containers.
fn parse(input: &[u8], max_depth: usize, s: &mut Scratch) -> bool {
    parse_inner(input, max_depth, s).is_some()
}

#[inline(always)]
fn skip_ws(input: &[u8], mut pos: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = input.get(pos) {
        pos += 1;
    }
    pos
}

// Offsets into `input` and tape indexes are below `MAX_INPUT`, so the
// `as u32` casts in the parser cannot truncate.
fn parse_inner(input: &[u8], max_depth: usize, s: &mut Scratch) -> Option<()> {
    if input.len() > MAX_INPUT {
        return None;
    }
    // JSON text is UTF-8; validating once up front lets the string scanner
    // copy non-ASCII bytes without looking at them.
    std::str::from_utf8(input).ok()?;
    let Scratch { tape, arena, parse_stack: stack, .. } = s;
    tape.reserve(input.len() / 8 + 4);
    let mut pos = 0;
    'value: loop {
        pos = skip_ws(input, pos);
        let b = *input.get(pos)?;
        match b {
            b'"' => pos = string(input, pos + 1, tape, arena)?,
            b'{' | b'[' => {
                if stack.len() >= max_depth {
                    return None;
                }
                let is_object = b == b'{';
                let index = tape.len() as u32;
                tape.push(if is_object { Node::Object { end: 0 } } else { Node::Array { end: 0 } });
                stack.push((index, is_object));
                pos = skip_ws(input, pos + 1);
                let close = if is_object { b'}' } else { b']' };
                if input.get(pos) != Some(&close) {
                    if is_object {
                        pos = key(input, pos, tape, arena)?;
                    }
                    continue 'value;
                }
                pos += 1;
                close_container(tape, index, is_object);
                stack.pop();
            }
            b'-' | b'0'..=b'9' => pos = number(input, pos, tape, arena)?,
            b't' => pos = literal(input, pos, b"true", tape)?,
            b'f' => pos = literal(input, pos, b"false", tape)?,
            b'n' => pos = literal(input, pos, b"null", tape)?,
            _ => return None,
        }
        // After a complete value: separators and closers.
        loop {
            pos = skip_ws(input, pos);
            let Some(&(index, is_object)) = stack.last() else {
                return (pos == input.len()).then_some(());
            };
            match *input.get(pos)? {
                b',' => {
                    pos += 1;
                    if is_object {
                        pos = key(input, skip_ws(input, pos), tape, arena)?;
                    }
                    continue 'value;
                }
                b'}' if is_object => {}
                b']' if !is_object => {}
                _ => return None,
            }
            pos += 1;
            close_container(tape, index, is_object);
            stack.pop();
        }
    }
}

#[inline(always)]
fn close_container(tape: &mut [Node], index: u32, is_object: bool) {
    let end = tape.len() as u32;
    tape[index as usize] = if is_object { Node::Object { end } } else { Node::Array { end } };
}

/// An object member's name and the `:` after it, at `pos`.
#[inline(always)]
fn key(input: &[u8], pos: usize, tape: &mut Vec<Node>, arena: &mut Vec<u8>) -> Option<usize> {
    if input.get(pos) != Some(&b'"') {
        return None;
    }
    let pos = skip_ws(input, string(input, pos + 1, tape, arena)?);
    if input.get(pos) != Some(&b':') {
        return None;
    }
    Some(pos + 1)
}

fn literal(input: &[u8], pos: usize, word: &'static [u8], tape: &mut Vec<Node>) -> Option<usize> {
    let end = pos + word.len();
    if input.get(pos..end) != Some(word) {
        return None;
    }
    tape.push(Node::Raw { start: pos as u32, end: end as u32 });
    Some(end)
}

/// A string whose body starts at `start` (just after the opening quote).
/// Returns the position after the closing quote.
#[inline(always)]
fn string(input: &[u8], start: usize, tape: &mut Vec<Node>, arena: &mut Vec<u8>) -> Option<usize> {
    let i = scan_string(input, start);
    match input.get(i)? {
        b'"' => {
            tape.push(Node::Str { start: start as u32, end: i as u32 });
            Some(i + 1)
        }
        b'\\' => string_escaped(input, start, i, tape, arena),
        _ => None,
    }
}

/// The slow path of [`string`]: decode escapes into the arena. `i` is the
/// position of the first backslash.
#[inline(never)]
fn string_escaped(
    input: &[u8],
    start: usize,
    mut i: usize,
    tape: &mut Vec<Node>,
    arena: &mut Vec<u8>,
) -> Option<usize> {
    let arena_start = arena.len();
    arena.extend_from_slice(&input[start..i]);
    loop {
        match *input.get(i)? {
            b'"' => break,
            b'\\' => {
                let escape = *input.get(i + 1)?;
                i += 2;
                match escape {
                    b'"' => arena.push(b'"'),
                    b'\\' => arena.push(b'\\'),
                    b'/' => arena.push(b'/'),
                    b'b' => arena.push(0x08),
                    b'f' => arena.push(0x0c),
                    b'n' => arena.push(b'\n'),
                    b'r' => arena.push(b'\r'),
                    b't' => arena.push(b'\t'),
                    b'u' => {
                        let unit = hex4(input, i)?;
                        i += 4;
                        let code = match unit {
                            0xD800..=0xDBFF => {
                                if input.get(i..i + 2) != Some(b"\\u") {
                                    return None;
                                }
                                let low = hex4(input, i + 2)?;
                                if !(0xDC00..=0xDFFF).contains(&low) {
                                    return None;
                                }
                                i += 6;
                                0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                            }
                            0xDC00..=0xDFFF => return None,
                            _ => unit,
                        };
                        let c = char::from_u32(code)?;
                        let mut buf = [0u8; 4];
                        arena.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                    }
                    _ => return None,
                }
            }
            _ => return None, // a control character
        }
        let run = i;
        i = scan_string(input, i);
        arena.extend_from_slice(&input[run..i]);
    }
    tape.push(Node::StrArena { start: u32_of(arena_start)?, end: u32_of(arena.len())? });
    Some(i + 1)
}

/// Where the integer part of a number that starts at `i` ends: a lone `0`, or a non-zero digit
/// and any digits after it. `None` if no digit is there.
#[inline(always)]
fn integer_end(input: &[u8], mut i: usize) -> Option<usize> {
    match input.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            i += 1;
            while let Some(b'0'..=b'9') = input.get(i) {
                i += 1;
            }
        }
        _ => return None,
    }
    Some(i)
}

/// A number starting at `start` (`-` or a digit). Plain integers that are
/// already canonical are recorded in place; the rest go to [`number_slow`].
#[inline(always)]
fn number(input: &[u8], start: usize, tape: &mut Vec<Node>, arena: &mut Vec<u8>) -> Option<usize> {
    let mut i = start;
    if input[i] == b'-' {
        i += 1;
    }
    let int_start = i;
    i = integer_end(input, i)?;
    match input.get(i) {
        Some(b'.') => return decimal(input, start, int_start, i, tape, arena),
        Some(b'e' | b'E') => return number_slow(input, start, tape, arena),
        _ => {}
    }
    if input[i - 1] != b'0' {
        tape.push(Node::Raw { start: start as u32, end: i as u32 });
    } else if i - int_start == 1 {
        tape.push(Node::Zero);
    } else {
        return number_slow(input, start, tape, arena);
    }
    Some(i)
}

/// A number with a fraction; `dot` is the position of its `.`. Without an
/// exponent and with a nonzero last digit its canonical form is the
/// significant digits then `e-<fraction length>`; the rest go to
/// [`number_slow`].
#[inline(always)]
fn decimal(
    input: &[u8],
    start: usize,
    int_start: usize,
    dot: usize,
    tape: &mut Vec<Node>,
    arena: &mut Vec<u8>,
) -> Option<usize> {
    let frac_start = dot + 1;
    let mut i = frac_start;
    while let Some(b'0'..=b'9') = input.get(i) {
        i += 1;
    }
    if i == frac_start || input[i - 1] == b'0' || matches!(input.get(i), Some(b'e' | b'E')) {
        return number_slow(input, start, tape, arena);
    }
    let arena_start = arena.len();
    if input[int_start] == b'0' {
        // `-0.00xy`: the significant digits are the fraction's from its
        // first nonzero digit (there is one: the last).
        if start < int_start {
            arena.push(b'-');
        }
        let frac = &input[frac_start..i];
        let first = frac.iter().position(|&d| d != b'0').unwrap_or(0);
        arena.extend_from_slice(&frac[first..]);
    } else {
        arena.extend_from_slice(&input[start..dot]);
        arena.extend_from_slice(&input[frac_start..i]);
    }
    arena.extend_from_slice(b"e-");
    push_i64(arena, i64::try_from(i - frac_start).ok()?);
    tape.push(Node::RawArena { start: u32_of(arena_start)?, end: u32_of(arena.len())? });
    Some(i)
}

/// Any number: validates it and writes its canonical form into the arena.
#[inline(never)]
fn number_slow(input: &[u8], start: usize, tape: &mut Vec<Node>, arena: &mut Vec<u8>) -> Option<usize> {
    let mut i = start;
    let negative = input[i] == b'-';
    if negative {
        i += 1;
    }
    let int_start = i;
    i = integer_end(input, i)?;
    let int = &input[int_start..i];
    let mut frac: &[u8] = &[];
    if input.get(i) == Some(&b'.') {
        i += 1;
        let frac_start = i;
        while let Some(b'0'..=b'9') = input.get(i) {
            i += 1;
        }
        if i == frac_start {
            return None;
        }
        frac = &input[frac_start..i];
    }
    let mut exponent = None;
    if let Some(b'e' | b'E') = input.get(i) {
        i += 1;
        let exp_negative = match input.get(i) {
            Some(b'-') => {
                i += 1;
                true
            }
            Some(b'+') => {
                i += 1;
                false
            }
            _ => false,
        };
        let digits_start = i;
        while let Some(b'0'..=b'9') = input.get(i) {
            i += 1;
        }
        if i == digits_start {
            return None;
        }
        exponent = Some((exp_negative, &input[digits_start..i]));
    }
    let node = canonical_number(negative, int, frac, exponent, arena)?;
    tape.push(node);
    Some(i)
}

/// Writes the canonical form of `±int.frac e±exp` into the arena.
fn canonical_number(
    negative: bool,
    int: &[u8],
    frac: &[u8],
    exponent: Option<(bool, &[u8])>,
    arena: &mut Vec<u8>,
) -> Option<Node> {
    // By the grammar `int` has no leading zero unless it is exactly `0`.
    let int = if int == b"0" { &int[..0] } else { int };
    let frac_end = frac.iter().rposition(|&d| d != b'0').map_or(0, |k| k + 1);
    let (int_digits, frac_digits, trailing) = if frac_end == 0 {
        let int_end = int.iter().rposition(|&d| d != b'0').map_or(0, |k| k + 1);
        (&int[..int_end], &frac[..0], frac.len() + int.len() - int_end)
    } else {
        (int, &frac[..frac_end], frac.len() - frac_end)
    };
    let frac_digits = if int_digits.is_empty() {
        let first = frac_digits.iter().position(|&d| d != b'0');
        &frac_digits[first.unwrap_or(frac_digits.len())..]
    } else {
        frac_digits
    };
    if int_digits.is_empty() && frac_digits.is_empty() {
        return Some(Node::Zero);
    }
    // The limit applies to the canonical exponent, so that every spelling of a number is on the
    // same side of it. The input is shorter than `MAX_INPUT` bytes, so the digits' spelling
    // moves the exponent by less than 10^10: a written exponent of more than 30 digits is
    // beyond the limit whatever the spelling.
    let exp = match exponent {
        None => 0i128,
        Some((exp_negative, digits)) => {
            let significant = digits.iter().position(|&d| d != b'0').map_or(&[][..], |k| &digits[k..]);
            if significant.len() > 30 {
                return None;
            }
            let magnitude = significant.iter().fold(0i128, |acc, &d| acc * 10 + i128::from(d - b'0'));
            if exp_negative { -magnitude } else { magnitude }
        }
    };
    let exp = exp - i128::try_from(frac.len()).ok()? + i128::try_from(trailing).ok()?;
    if exp.unsigned_abs() > MAX_EXPONENT {
        return None;
    }
    let exp = i64::try_from(exp).ok()?;

    let arena_start = arena.len();
    if negative {
        arena.push(b'-');
    }
    arena.extend_from_slice(int_digits);
    arena.extend_from_slice(frac_digits);
    if exp != 0 {
        arena.push(b'e');
        push_i64(arena, exp);
    }
    Some(Node::RawArena { start: u32_of(arena_start)?, end: u32_of(arena.len())? })
}

fn hex4(input: &[u8], i: usize) -> Option<u32> {
    let digits = input.get(i..i + 4)?;
    digits.iter().try_fold(0u32, |acc, &d| {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            _ => return None,
        };
        Some(acc << 4 | u32::from(v))
    })
}

fn push_i64(out: &mut Vec<u8>, v: i64) {
    if v < 0 {
        out.push(b'-');
    }
    let mut magnitude = v.unsigned_abs();
    let mut buf = [0u8; 20];
    let mut k = buf.len();
    loop {
        k -= 1;
        // `magnitude % 10` is below 10.
        buf[k] = b'0' + (magnitude % 10) as u8;
        magnitude /= 10;
        if magnitude == 0 {
            break;
        }
    }
    out.extend_from_slice(&buf[k..]);
}

/// An object member while emitting: the first 8 bytes of its decoded name
/// (big-endian, zero-padded, so integer order agrees with byte order where
/// they differ) and the tape index of its name.
#[derive(Clone, Copy, Debug)]
struct Member {
    prefix: u64,
    key: u32,
}

/// One open container while emitting.
#[derive(Clone, Copy, Debug)]
struct Frame {
    is_object: bool,
    first: bool,
    /// Objects: the next position in `members`; arrays: the next tape index.
    pos: u32,
    /// Objects: the end of this object's segment of `members`; arrays: the
    /// tape index after the array's last descendant.
    end: u32,
    /// The start of this object's segment of `members`.
    members_start: u32,
    /// The index of the next array element.
    index: u32,
    /// This container's segment of `active`: the pointers whose first
    /// `depth` tokens match the path to this container.
    active_start: u32,
    depth: u32,
}

#[inline(always)]
fn node_bytes<'a>(input: &'a [u8], arena: &'a [u8], node: Node) -> &'a [u8] {
    match node {
        Node::Raw { start, end } | Node::Str { start, end } => &input[start as usize..end as usize],
        Node::RawArena { start, end } | Node::StrArena { start, end } => &arena[start as usize..end as usize],
        Node::Zero => b"0",
        Node::Array { .. } | Node::Object { .. } => &[],
    }
}

#[inline(always)]
fn next_sibling(tape: &[Node], index: usize) -> usize {
    match tape[index] {
        Node::Array { end } | Node::Object { end } => end as usize,
        _ => index + 1,
    }
}

/// The first 8 bytes of a member name, big-endian, zero-padded.
#[inline(always)]
fn prefix(input: &[u8], arena: &[u8], node: Node) -> u64 {
    let (buf, start, end) = match node {
        Node::Str { start, end } => (input, start as usize, end as usize),
        Node::StrArena { start, end } => (arena, start as usize, end as usize),
        _ => return 0,
    };
    let len = end - start;
    // Usually 8 bytes can be read at the start (past the end of a short name
    // are its closing quote and what follows); mask off the excess.
    if let Some(word) = buf.get(start..start + 8).and_then(|w| <[u8; 8]>::try_from(w).ok()) {
        let word = u64::from_be_bytes(word);
        return if len >= 8 { word } else { word & !(u64::MAX >> (len * 8)) };
    }
    buf[start..end].iter().take(8).enumerate().fold(0, |acc, (k, &b)| acc | u64::from(b) << (56 - 8 * k))
}

/// Sorts an object's members by name. `false` on a duplicate name.
fn sort_members(segment: &mut [Member], input: &[u8], arena: &[u8], tape: &[Node]) -> bool {
    let cmp = |a: &Member, b: &Member| {
        a.prefix.cmp(&b.prefix).then_with(|| {
            node_bytes(input, arena, tape[a.key as usize]).cmp(node_bytes(input, arena, tape[b.key as usize]))
        })
    };
    for k in 1..segment.len() {
        match cmp(&segment[k - 1], &segment[k]) {
            Ordering::Less => {}
            Ordering::Equal => return false,
            Ordering::Greater => {
                segment.sort_unstable_by(cmp);
                return segment.windows(2).all(|w| cmp(&w[0], &w[1]) == Ordering::Less);
            }
        }
    }
    true
}

/// Writes a decoded string with the canonical escaping.
fn push_escaped(out: &mut Vec<u8>, s: &[u8]) {
    out.push(b'"');
    let mut run = 0;
    for (k, &b) in s.iter().enumerate() {
        if !STRING_STOP[usize::from(b)] {
            continue;
        }
        out.extend_from_slice(&s[run..k]);
        run = k + 1;
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0x08 => out.extend_from_slice(b"\\b"),
            0x09 => out.extend_from_slice(b"\\t"),
            0x0a => out.extend_from_slice(b"\\n"),
            0x0c => out.extend_from_slice(b"\\f"),
            0x0d => out.extend_from_slice(b"\\r"),
            _ => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
            }
        }
    }
    out.extend_from_slice(&s[run..]);
    out.push(b'"');
}

/// Writes a string node: in place when it had no escapes (its bytes are
/// then already canonical), else re-escaped from its decoded bytes.
///
/// A string without escapes is copied with its quotes straight from the
/// input, and for a member name (`colon`) with the `:` when it follows
/// directly.
#[inline(always)]
fn push_string(out: &mut Vec<u8>, input: &[u8], arena: &[u8], node: Node, colon: bool) {
    if let Node::Str { start, end } = node {
        // The quotes are at `start - 1` and `end`.
        let (start, end) = (start as usize - 1, end as usize + 1);
        if colon && input.get(end) == Some(&b':') {
            out.extend_from_slice(&input[start..end + 1]);
            return;
        }
        out.extend_from_slice(&input[start..end]);
    } else {
        push_escaped(out, node_bytes(input, arena, node));
    }
    if colon {
        out.push(b':');
    }
}

/// Emits the canonical form of the parsed document in `s` into `out`.
/// `false` if an object has two members with the same (decoded) name.
///
/// Tape indexes, member positions and pointer-stack positions are all below
/// the tape length, which fits in `u32`, so the `as u32` casts cannot
/// truncate.
fn emit(input: &[u8], pointers: &[Pointer], s: &mut Scratch, out: &mut Vec<u8>) -> bool {
    let Scratch { tape, arena, members, active, frames, .. } = s;
    let tape = &tape[..];
    let arena = &arena[..];
    active.extend((0..pointers.len()).map(|k| k as u32));

    // The value to open next, the start of its segment of `active`, and its
    // pointer depth.
    let (mut next, mut next_active, mut next_depth) = (0usize, 0usize, 0u32);
    loop {
        match tape[next] {
            Node::Object { end } => {
                let members_start = members.len();
                let mut k = next + 1;
                while k < end as usize {
                    members.push(Member { prefix: prefix(input, arena, tape[k]), key: k as u32 });
                    k = next_sibling(tape, k + 1);
                }
                if !sort_members(&mut members[members_start..], input, arena, tape) {
                    return false;
                }
                out.push(b'{');
                frames.push(Frame {
                    is_object: true,
                    first: true,
                    pos: members_start as u32,
                    end: members.len() as u32,
                    members_start: members_start as u32,
                    index: 0,
                    active_start: next_active as u32,
                    depth: next_depth,
                });
            }
            Node::Array { end } => {
                out.push(b'[');
                frames.push(Frame {
                    is_object: false,
                    first: true,
                    pos: next as u32 + 1,
                    end,
                    members_start: members.len() as u32,
                    index: 0,
                    active_start: next_active as u32,
                    depth: next_depth,
                });
            }
            node @ (Node::Str { .. } | Node::StrArena { .. }) => {
                push_string(out, input, arena, node, false);
                active.truncate(next_active);
            }
            node @ (Node::Raw { .. } | Node::RawArena { .. } | Node::Zero) => {
                out.extend_from_slice(node_bytes(input, arena, node));
                active.truncate(next_active);
            }
        }

        // Find the next value to open, closing finished containers.
        loop {
            let Some(frame) = frames.last_mut() else {
                return true;
            };
            if frame.pos >= frame.end {
                out.push(if frame.is_object { b'}' } else { b']' });
                members.truncate(frame.members_start as usize);
                active.truncate(frame.active_start as usize);
                frames.pop();
                continue;
            }
            let (value, key) = if frame.is_object {
                let key = members[frame.pos as usize].key as usize;
                frame.pos += 1;
                (key + 1, Some(tape[key]))
            } else {
                let element = frame.pos as usize;
                frame.pos = next_sibling(tape, element) as u32;
                frame.index += 1;
                (element, None)
            };
            let child_active = active.len();
            if child_active > frame.active_start as usize {
                let depth = frame.depth as usize;
                let element_index = frame.index.wrapping_sub(1);
                let name = key.map(|k| node_bytes(input, arena, k));
                let mut skip = false;
                for a in frame.active_start as usize..child_active {
                    let pointer = &pointers[active[a] as usize];
                    let token = &pointer.tokens[depth];
                    let matches = match name {
                        Some(name) => token.name.as_bytes() == name,
                        None => token.index == Some(element_index),
                    };
                    if matches {
                        if depth + 1 == pointer.tokens.len() {
                            skip = true;
                            break;
                        }
                        active.push(active[a]);
                    }
                }
                if skip {
                    active.truncate(child_active);
                    continue;
                }
            }
            if frame.first {
                frame.first = false;
            } else {
                out.push(b',');
            }
            if let Some(key) = key {
                // A member written as `"name":value` with an unescaped name
                // and a value that is canonical as written: one copy.
                if let Node::Str { start, end } = key {
                    let (name_start, after_colon) = (start as usize - 1, end as usize + 2);
                    let span_end = match tape[value] {
                        Node::Str { start, end } if start as usize == after_colon + 1 => Some(end as usize + 1),
                        Node::Raw { start, end } if start as usize == after_colon => Some(end as usize),
                        _ => None,
                    };
                    if let Some(span_end) = span_end {
                        out.extend_from_slice(&input[name_start..span_end]);
                        active.truncate(child_active);
                        continue;
                    }
                }
                push_string(out, input, arena, key, true);
            }
            next = value;
            next_active = child_active;
            next_depth = frame.depth + 1;
            break;
        }
    }
}

/// Appends the canonical form of `input` to `out`; see [`super::canonical::json`].
/// On `false`, `out` is left as it was.
pub(crate) fn canonicalize_into(
    input: &[u8],
    pointers: &[Pointer],
    max_depth: usize,
    s: &mut Scratch,
    out: &mut Vec<u8>,
) -> bool {
    s.clear();
    let mark = out.len();
    let ok = parse(input, max_depth, s) && {
        out.reserve(input.len());
        emit(input, pointers, s, out)
    };
    if !ok {
        out.truncate(mark);
    }
    ok
}
