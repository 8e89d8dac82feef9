//! [`Mutator`]: stacked mutations of one input format, and [`Frames`],
//! the mutations of a stream of length-prefixed frames. The byte-level
//! operations here serve every format's [`Mutation`].

use std::marker::PhantomData;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_wire::MAGIC;

const INTERESTING_U8: [u8; 8] = [0, 0xff, 0x7f, 0x80, 1, 8, 9, 0x20];

/// The mutations of one input format, applied one at a time by a
/// [`Mutator`].
pub trait Mutation {
    /// Apply one mutation to `data`. `corpus` supplies splice partners;
    /// `max_len` is the length [`Mutator::mutate`] cuts `data` back to.
    fn apply(rng: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]);
}

/// Stacked mutations of format `M`, driven by a seeded [`SmallRng`].
#[derive(Debug)]
pub struct Mutator<M> {
    rng: SmallRng,
    /// Inputs are kept at most this long.
    pub max_len: usize,
    mutation: PhantomData<M>,
}

impl<M: Mutation> Mutator<M> {
    /// A mutator with a fixed seed.
    pub fn new(seed: u64, max_len: usize) -> Self {
        Self {
            rng: SmallRng::seed_from_u64(seed),
            max_len,
            mutation: PhantomData,
        }
    }

    /// The random source, for the driver's own choices.
    pub fn rng(&mut self) -> &mut SmallRng {
        &mut self.rng
    }

    /// Apply one to four mutations to `data`; `corpus` supplies splice
    /// partners.
    pub fn mutate(&mut self, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        let n = self.rng.gen_range(1..=4);
        for _ in 0..n {
            M::apply(&mut self.rng, self.max_len, data, corpus);
        }
        data.truncate(self.max_len);
    }
}

/// Flip one bit of non-empty `data`.
pub(crate) fn flip_bit(rng: &mut SmallRng, data: &mut [u8]) {
    let i = rng.gen_range(0..data.len());
    data[i] ^= 1 << rng.gen_range(0..8);
}

/// Cut non-empty `data` short.
pub(crate) fn truncate(rng: &mut SmallRng, data: &mut Vec<u8>) {
    let keep = rng.gen_range(0..data.len());
    data.truncate(keep);
}

/// Cut `data` and append the tail of another entry of non-empty `corpus`.
pub(crate) fn splice(rng: &mut SmallRng, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    let other = &corpus[rng.gen_range(0..corpus.len())];
    let a = rng.gen_range(0..=data.len());
    let b = rng.gen_range(0..=other.len());
    data.truncate(a);
    data.extend_from_slice(&other[b..]);
}

/// Copy up to `most` bytes of `data[from..]` to a place in `data[from..]`,
/// unless that makes it longer than `max_len`; `data` is longer than
/// `from`.
pub(crate) fn duplicate(
    rng: &mut SmallRng,
    data: &mut Vec<u8>,
    from: usize,
    most: usize,
    max_len: usize,
) {
    let len = data.len();
    let a = rng.gen_range(from..len);
    let b = rng.gen_range(a..=len.min(a + most));
    let at = rng.gen_range(from..=len);
    let piece = data[a..b].to_vec();
    if len + piece.len() <= max_len {
        data.splice(at..at, piece);
    }
}

/// Remove up to `most` bytes of `data[from..]`; `data` is longer than
/// `from`.
pub(crate) fn delete(rng: &mut SmallRng, data: &mut Vec<u8>, from: usize, most: usize) {
    let len = data.len();
    let a = rng.gen_range(from..len);
    let b = rng.gen_range(a..=len.min(a + most));
    data.drain(a..b);
}

/// Insert 1 to `most` random bytes anywhere in `data`.
pub(crate) fn insert_random(rng: &mut SmallRng, data: &mut Vec<u8>, most: usize) {
    let at = rng.gen_range(0..=data.len());
    let k = rng.gen_range(1..=most);
    let bytes: Vec<u8> = (0..k).map(|_| rng.gen()).collect();
    data.splice(at..at, bytes);
}

/// Byte-level mutations aimed at a stream of length-prefixed frames: bit
/// flips, interesting bytes, length fields overwritten with boundary
/// values, truncation, splicing, duplication, and fix-ups that make a
/// mutated body reach its parser.
#[derive(Debug)]
pub struct Frames;

fn boundary(rng: &mut SmallRng, len: usize) -> u64 {
    const VALS: [u64; 18] = [
        0,
        1,
        7,
        8,
        9,
        24,
        31,
        32,
        33,
        64,
        0x7fff,
        0xffff,
        0x7fff_ffff,
        0x8000_0000,
        0xffff_fffe,
        0xffff_ffff,
        u64::MAX,
        1 << 62,
    ];
    match rng.gen_range(0..4) {
        0 => len as u64,
        1 => len.saturating_sub(32) as u64,
        2 => rng.gen_range(0..=len as u64 + 64),
        _ => VALS[rng.gen_range(0..VALS.len())],
    }
}

fn offset_for_field(rng: &mut SmallRng, data: &[u8], width: usize) -> Option<usize> {
    if data.len() < width {
        return None;
    }
    let max = data.len() - width;
    let magics: Vec<usize> = data
        .windows(4)
        .enumerate()
        .filter(|(_, w)| *w == MAGIC)
        .map(|(i, _)| i)
        .take(64)
        .collect();
    let off = match rng.gen_range(0..4) {
        // a header length field of some frame
        0 if !magics.is_empty() => {
            let m = magics[rng.gen_range(0..magics.len())];
            m + [20, 24, 28, 6][rng.gen_range(0..4)]
        }
        // an 8-aligned field of a body (tensor key/byte_len/dims, counts)
        1 if !magics.is_empty() => {
            let m = magics[rng.gen_range(0..magics.len())];
            m + 32 + 8 * rng.gen_range(0..12)
        }
        _ => rng.gen_range(0..=max),
    };
    (off <= max).then_some(off)
}

fn fix_lengths(rng: &mut SmallRng, data: &mut [u8]) {
    // Make the frame at a magic position claim exactly the bytes up to
    // the next magic (or the end), unchunked, so a mutated body reaches
    // its parser instead of failing framing.
    let magics: Vec<usize> = data
        .windows(4)
        .enumerate()
        .filter(|(_, w)| *w == MAGIC)
        .map(|(i, _)| i)
        .collect();
    if magics.is_empty() {
        return;
    }
    let k = rng.gen_range(0..magics.len());
    let start = magics[k];
    let end = magics.get(k + 1).copied().unwrap_or(data.len());
    if end < start + 32 {
        return;
    }
    let body = (end - start - 32) as u32;
    data[start + 20..start + 24].copy_from_slice(&body.to_le_bytes());
    data[start + 24..start + 28].copy_from_slice(&body.to_le_bytes());
    if rng.gen_bool(0.7) {
        data[start + 6] &= !0b1100;
    }
}

impl Mutation for Frames {
    fn apply(rng: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        let len = data.len();
        match rng.gen_range(0..11) {
            0 if len > 0 => flip_bit(rng, data),
            1 if len > 0 => {
                let i = rng.gen_range(0..len);
                data[i] = INTERESTING_U8[rng.gen_range(0..INTERESTING_U8.len())];
            }
            2 | 3 => {
                let width = [2usize, 4, 4, 8][rng.gen_range(0..4)];
                if let Some(off) = offset_for_field(rng, data, width) {
                    let v = boundary(rng, len).to_le_bytes();
                    data[off..off + width].copy_from_slice(&v[..width]);
                }
            }
            4 if len > 0 => truncate(rng, data),
            5 if !corpus.is_empty() => splice(rng, data, corpus),
            6 if len > 0 => duplicate(rng, data, 0, 256, max_len),
            7 if len > 0 => delete(rng, data, 0, 64),
            8 => insert_random(rng, data, 16),
            9 if len > 0 => {
                let i = rng.gen_range(0..len);
                let d: i8 = rng.gen_range(-16..=16);
                data[i] = data[i].wrapping_add_signed(d);
            }
            _ => fix_lengths(rng, data),
        }
    }
}
