//! Mutations of an input: one to four of them stacked, each chosen at random.

use rand::rngs::StdRng;
use rand::Rng;

/// Integers that break length and offset fields.
const EDGES: &[u64] = &[
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    i64::MAX as u64,
    u64::MAX,
];

/// Numbers written into text inputs in place of a run of digits.
const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1e309",
    "99999999999999999999999999",
    "18446744073709551616",
    "-9223372036854775809",
    "NaN",
    "0.0000001",
    "4294967296",
    "9223372036854775808",
    "18446744073709551615",
];

/// A mutation of `input`; `pool` gives splicing partners and `dictionary` tokens to insert. At most `max_len` bytes.
pub(crate) fn mutate(
    rng: &mut StdRng,
    input: &[u8],
    pool: &[Vec<u8>],
    dictionary: &[Vec<u8>],
    max_len: usize,
) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        one(rng, &mut out, pool, dictionary);
    }
    out.truncate(max_len);
    out
}

fn one(rng: &mut StdRng, out: &mut Vec<u8>, pool: &[Vec<u8>], dictionary: &[Vec<u8>]) {
    match rng.random_range(0..10) {
        0 => flip_bit(rng, out),
        1 => set_byte(rng, out),
        2 => truncate(rng, out),
        3 => delete_range(rng, out),
        4 => insert_random(rng, out),
        5 => repeat_range(rng, out),
        6 => splice(rng, out, pool),
        7 => set_integer(rng, out),
        8 => insert_token(rng, out, dictionary),
        _ => replace_number(rng, out),
    }
}

fn flip_bit(rng: &mut StdRng, out: &mut [u8]) {
    if !out.is_empty() {
        let i = rng.random_range(0..out.len());
        out[i] ^= 1 << rng.random_range(0..8);
    }
}

fn set_byte(rng: &mut StdRng, out: &mut [u8]) {
    if !out.is_empty() {
        let i = rng.random_range(0..out.len());
        out[i] = match rng.random_range(0..4) {
            0 => 0,
            1 => 0xff,
            2 => 0x80,
            _ => rng.random(),
        };
    }
}

fn truncate(rng: &mut StdRng, out: &mut Vec<u8>) {
    let len = rng.random_range(0..=out.len());
    out.truncate(len);
}

/// A random range `[start, end)` of `out`, at most `max` long.
fn range(rng: &mut StdRng, len: usize, max: usize) -> (usize, usize) {
    let start = rng.random_range(0..=len);
    let end = (start + rng.random_range(0..=max)).min(len);
    (start, end)
}

fn delete_range(rng: &mut StdRng, out: &mut Vec<u8>) {
    let (start, end) = range(rng, out.len(), 64);
    out.drain(start..end);
}

fn insert_random(rng: &mut StdRng, out: &mut Vec<u8>) {
    let at = rng.random_range(0..=out.len());
    let n = rng.random_range(1..=16);
    let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
    out.splice(at..at, bytes);
}

fn repeat_range(rng: &mut StdRng, out: &mut Vec<u8>) {
    let (start, end) = range(rng, out.len(), 256);
    let piece = out[start..end].to_vec();
    let times = rng.random_range(1..=8);
    for _ in 0..times {
        out.splice(end..end, piece.iter().copied());
    }
}

fn splice(rng: &mut StdRng, out: &mut Vec<u8>, pool: &[Vec<u8>]) {
    if pool.is_empty() {
        return;
    }
    let other = &pool[rng.random_range(0..pool.len())];
    let cut = rng.random_range(0..=out.len());
    let from = rng.random_range(0..=other.len());
    out.truncate(cut);
    out.extend_from_slice(&other[from..]);
}

/// Overwrites 1, 2, 4 or 8 bytes (little or big endian) with an edge value, the length of the input, or a
/// neighbour of the value already there: where length and offset fields live, this is what breaks them.
fn set_integer(rng: &mut StdRng, out: &mut [u8]) {
    let width = [1usize, 2, 4, 8][rng.random_range(0..4)];
    if out.len() < width {
        return;
    }
    let at = rng.random_range(0..=out.len() - width);
    let mut current = [0u8; 8];
    current[..width].copy_from_slice(&out[at..at + width]);
    let current = u64::from_le_bytes(current);
    let value = match rng.random_range(0..4) {
        0 => EDGES[rng.random_range(0..EDGES.len())],
        1 => out.len() as u64,
        2 => current.wrapping_add(1),
        _ => current.wrapping_sub(1),
    };
    let bytes = if rng.random_bool(0.8) {
        value.to_le_bytes()
    } else {
        (value << (8 * (8 - width) as u32 % 64)).to_be_bytes()
    };
    out[at..at + width].copy_from_slice(&bytes[..width]);
}

fn insert_token(rng: &mut StdRng, out: &mut Vec<u8>, dictionary: &[Vec<u8>]) {
    if dictionary.is_empty() {
        return insert_random(rng, out);
    }
    let token = &dictionary[rng.random_range(0..dictionary.len())];
    let at = rng.random_range(0..=out.len());
    if rng.random_bool(0.5) {
        out.splice(at..at, token.iter().copied());
    } else {
        let end = (at + token.len()).min(out.len());
        out.splice(at..end, token.iter().copied());
    }
}

/// Replaces a run of ASCII digits with a number that overflows, is negative, or is not a number at all.
fn replace_number(rng: &mut StdRng, out: &mut Vec<u8>) {
    let digits: Vec<usize> = (0..out.len())
        .filter(|&i| out[i].is_ascii_digit())
        .collect();
    if digits.is_empty() {
        return set_integer(rng, out);
    }
    let start = digits[rng.random_range(0..digits.len())];
    let end = (start..out.len())
        .find(|&i| !out[i].is_ascii_digit())
        .unwrap_or(out.len());
    let number = NUMBERS[rng.random_range(0..NUMBERS.len())];
    out.splice(start..end, number.bytes());
}
