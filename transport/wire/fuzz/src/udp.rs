//! [`Udp`]: the DPDK backend's Ethernet parsers, IPv4/UDP
//! ([`starwire_datagram::udp`]) and ARP ([`starwire_datagram::arp`]), and
//! the hello line its connections exchange over TCP first
//! ([`starwire_datagram::hello`]: an input whose first byte is `s`), as a
//! driver target (`fuzz-udp`), with [`Packets`], mutations aimed at their
//! header fields.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use rand::rngs::SmallRng;
use rand::Rng;
use starwire_datagram::arp::{ArpOp, ArpRepr, ETHERTYPE_ARP};
use starwire_datagram::hello::{Hello, LineReader};
use starwire_datagram::udp::{
    checksum, classify, MacAddr, UdpEndpoint, UdpFrameError, UdpRepr, ETHERNET_HEADER_LEN,
    HEADERS_LEN,
};

use crate::driver::{Spec, Target};
use crate::mutate::{delete, flip_bit, insert_random, splice, truncate};
use crate::{Mutation, Mutator};

/// Offsets of the header fields a mutation aims at: EtherType, version
/// and header length, total length, flags and fragment offset, protocol,
/// UDP ports and length.
const FIELDS: [usize; 9] = [12, 14, 16, 17, 20, 23, 36, 38, 39];
const INTERESTING: [u8; 8] = [0, 0xff, 0x45, 0x46, 0x08, 0x11, 0x40, 0x20];

/// Mutations of one Ethernet/IPv4/UDP packet: bit flips, interesting bytes
/// in header fields, truncation, padding, insertion, deletion, splicing,
/// and a fix-up that recomputes the IPv4 header checksum so a mutated
/// header reaches the checks behind it.
#[derive(Debug)]
pub struct Packets;

impl Mutation for Packets {
    fn apply(rng: &mut SmallRng, max_len: usize, data: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        match rng.gen_range(0..8) {
            0 if !data.is_empty() => flip_bit(rng, data),
            1 => {
                let at = FIELDS[rng.gen_range(0..FIELDS.len())];
                if at < data.len() {
                    data[at] = INTERESTING[rng.gen_range(0..INTERESTING.len())];
                }
            }
            2 if !data.is_empty() => truncate(rng, data),
            3 => {
                let k = rng.gen_range(1..64);
                data.extend((0..k).map(|_| rng.gen::<u8>()));
            }
            4 => insert_random(rng, data, 8),
            5 if !data.is_empty() => delete(rng, data, 0, 8),
            6 if !corpus.is_empty() => splice(rng, data, corpus),
            _ => fix_ipv4_checksum(data),
        }
        data.truncate(max_len);
    }
}

/// Recompute the IPv4 header checksum of `data` where its header length
/// says the header fits.
fn fix_ipv4_checksum(data: &mut [u8]) {
    let ip = ETHERNET_HEADER_LEN;
    let Some(&vhl) = data.get(ip) else { return };
    let hl = usize::from(vhl & 0x0f) * 4;
    if hl < 20 || data.len() < ip + hl {
        return;
    }
    data[ip + 10] = 0;
    data[ip + 11] = 0;
    let sum = checksum::of(&data[ip..ip + hl]);
    data[ip + 10..ip + 12].copy_from_slice(&sum.to_be_bytes());
}

/// Well-formed packets of a few payload sizes, and one with IPv4 options.
pub fn corpus() -> Vec<Vec<u8>> {
    let ep = |last: u8, port| UdpEndpoint {
        mac: MacAddr([2, 0, 0, 0, 0, last]),
        ip: Ipv4Addr::new(10, 9, 0, last),
        port,
    };
    let mut out = Vec::new();
    for len in [0usize, 1, 5, 64, 1472] {
        let r = UdpRepr {
            src: ep(1, 40000),
            dst: ep(2, 9000),
            payload_len: len,
        };
        let mut b = vec![0; r.buffer_len()];
        for (i, x) in b[HEADERS_LEN..].iter_mut().enumerate() {
            *x = i as u8;
        }
        r.emit(&mut b);
        out.push(b);
    }
    // IPv4 options (header length 24): four option bytes after the header.
    let mut opt = out[2].clone();
    opt.splice(34..34, [1u8, 1, 1, 0]);
    opt[14] = 0x46;
    let total = u16::from_be_bytes([opt[16], opt[17]]) + 4;
    opt[16..18].copy_from_slice(&total.to_be_bytes());
    fix_ipv4_checksum(&mut opt);
    out.push(opt);
    // An ARP request, which a port answers.
    let arp = ArpRepr {
        op: ArpOp::Request,
        sender_mac: MacAddr([2, 0, 0, 0, 0, 2]),
        sender_ip: Ipv4Addr::new(10, 9, 0, 2),
        target_mac: MacAddr::default(),
        target_ip: Ipv4Addr::new(10, 9, 0, 1),
    };
    let mut b = vec![0; arp.buffer_len()];
    arp.emit(&mut b);
    out.push(b);
    // Hello lines, of three connection ids and of none.
    let mut h = Hello {
        endpoint: ep(7, 20001),
        ids: vec![0, 1, 1 << 20],
    };
    out.push(h.line().into_bytes());
    h.ids.clear();
    out.push(h.line().into_bytes());
    out
}

/// Connection ids the hello reader is sized for: the bound of its line.
const HELLO_IDS: usize = 3;

/// A hello line, as the DPDK bootstrap reads one: fed to a
/// [`LineReader`] in pieces, it must give the text before the first
/// newline when that is UTF-8 and within [`Hello::max_line`], and refuse
/// it otherwise, quoting at most 64 of its bytes (each invalid one three
/// bytes once replaced); what `Hello::parse` accepts
/// must write back to a line that parses the same and fits the bound of
/// its ids.
fn check_hello(input: &[u8]) -> Result<&'static str, String> {
    let max = Hello::max_line(HELLO_IDS);
    let end = input.iter().position(|&b| b == b'\n');
    let text = &input[..end.unwrap_or(input.len())];
    let mut r = LineReader::new(max);
    let mut got = Ok(None);
    for piece in input.chunks(7) {
        got = r.feed(piece);
        if !matches!(got, Ok(None)) {
            break;
        }
    }
    let line = match (got, end) {
        (Ok(Some(line)), Some(_)) if line.as_bytes() == text && text.len() <= max => line,
        (Ok(None), None) if text.len() <= max => return Ok("HelloPartial"),
        (Err(e), _) if e.line.len() <= 64 * 3 => {
            let long = text.len() > max;
            let utf8 = std::str::from_utf8(text).is_ok();
            return match (long, utf8, e.why.as_str()) {
                (true, _, w) if w.starts_with("longer than") => Ok("HelloTooLong"),
                (false, false, "not UTF-8") if end.is_some() => Ok("HelloNotUtf8"),
                _ => Err(format!("the reader refused {text:?}: {e}")),
            };
        }
        (other, _) => return Err(format!("the reader gave {other:?} for {input:?}")),
    };
    match Hello::parse(&line) {
        Ok(h) => {
            let again = h.line();
            if again.len() > Hello::max_line(h.ids.len()) {
                return Err(format!("{again:?} is past the bound of its ids"));
            }
            match Hello::parse(&again) {
                Ok(h2) if h2 == h => Ok("hello"),
                other => Err(format!(
                    "{line:?} written back as {again:?} parses as {other:?}"
                )),
            }
        }
        Err(_) => Ok("HelloRefused"),
    }
}

/// An ARP frame: the parser must not panic, and what it accepts must
/// emit back to itself (padding aside).
fn check_arp(input: &[u8]) -> Result<&'static str, String> {
    match ArpRepr::parse(input) {
        Ok(repr) => {
            let mut again = vec![0; repr.buffer_len()];
            repr.emit(&mut again);
            match ArpRepr::parse(&again) {
                Ok(r2) if r2 == repr => Ok("arp"),
                other => Err(format!("re-emitted ARP frame parses as {other:?}")),
            }
        }
        Err(_) => Ok("ArpRefused"),
    }
}

/// A short name for a parse error's kind.
fn kind(e: &UdpFrameError) -> &'static str {
    match e {
        UdpFrameError::Truncated(_) => "Truncated",
        UdpFrameError::NotIpv4(_) => "NotIpv4",
        UdpFrameError::IpVersion(_) => "IpVersion",
        UdpFrameError::Ipv4Length => "Ipv4Length",
        UdpFrameError::Ipv4Checksum => "Ipv4Checksum",
        UdpFrameError::Fragment => "Fragment",
        UdpFrameError::NotUdp(_) => "NotUdp",
        UdpFrameError::UdpLength => "UdpLength",
        _ => "other",
    }
}

/// Check one input: the parser must not panic; a packet it accepts must
/// pass the receive filter with the same destination port, its payload
/// must be as long as it says, and emitting what it parsed around that
/// payload must parse back to the same. Returns the outcome's kind.
pub fn check(input: &[u8]) -> Result<&'static str, String> {
    if input.first() == Some(&b's') {
        return check_hello(input);
    }
    let filtered = classify(input);
    match UdpRepr::parse(input) {
        Ok((repr, payload)) => {
            if filtered != Some(repr.dst.port) {
                return Err(format!(
                    "parse accepted a packet to port {} that the filter reads as {filtered:?}",
                    repr.dst.port
                ));
            }
            if payload.len() != repr.payload_len {
                return Err(format!(
                    "payload of {} bytes, repr says {}",
                    payload.len(),
                    repr.payload_len
                ));
            }
            let mut again = vec![0; repr.buffer_len()];
            again[HEADERS_LEN..].copy_from_slice(payload);
            repr.emit(&mut again);
            match UdpRepr::parse(&again) {
                Ok((r2, p2)) if r2 == repr && p2 == payload => Ok("ok"),
                other => Err(format!("re-emitted packet parses as {other:?}")),
            }
        }
        Err(UdpFrameError::NotIpv4(ETHERTYPE_ARP)) => check_arp(input),
        Err(e) => Ok(kind(&e)),
    }
}

/// [`check`] as a driver target; an input joins the corpus when its
/// outcome kind and length class are new.
#[derive(Debug, Default)]
pub struct Udp {
    outcomes: BTreeMap<&'static str, u64>,
}

impl Target for Udp {
    const SPEC: Spec = Spec {
        name: "fuzz-udp",
        seed: 0x5357_5544,
        out: concat!(env!("CARGO_MANIFEST_DIR"), "/corpus-out/udp"),
        max_len: 2048,
        max_len_flag: false,
        corpus_flags: false,
        max_corpus: 4096,
        failure_prefix: "udp",
    };
    type Mutation = Packets;
    type Case = ();
    type Key = (&'static str, usize);

    fn seeds(&self) -> Vec<Vec<u8>> {
        corpus()
    }

    fn prepare(&mut self, m: &mut Mutator<Packets>, input: &mut Vec<u8>, corpus: &[Vec<u8>]) {
        m.mutate(input, corpus);
    }

    fn run(&mut self, _: &(), input: &[u8]) -> Result<(&'static str, usize), String> {
        let k = check(input)?;
        *self.outcomes.entry(k).or_default() += 1;
        Ok((k, input.len().min(80) / 4))
    }

    fn progress(&self) -> String {
        format!("{:?}", self.outcomes)
    }

    fn summary(&self) -> Vec<String> {
        vec![format!("outcomes: {:?}", self.outcomes)]
    }

    fn check(&mut self, input: &[u8]) -> Result<(), String> {
        self.run(&(), input).map(drop)
    }

    fn replay(&mut self, input: &[u8]) -> bool {
        let r = check(input);
        println!("{:?} -> {r:?}", UdpRepr::parse(input));
        r.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_parse_and_round_trip() {
        let n = corpus().len();
        for (i, s) in corpus().iter().enumerate() {
            let want = match n - i {
                1 | 2 => "hello",
                3 => "arp",
                _ => "ok",
            };
            assert_eq!(check(s), Ok(want), "seed {i}");
        }
    }

    #[test]
    fn short_run_finds_no_failure_and_reaches_every_check() {
        let seeds = corpus();
        let mut m = Mutator::<Packets>::new(11, 2048);
        let mut seen = BTreeMap::new();
        for i in 0..50_000 {
            let mut d = seeds[i % seeds.len()].clone();
            m.mutate(&mut d, &seeds);
            let k = check(&d).unwrap_or_else(|e| panic!("{e}: {d:?}"));
            *seen.entry(k).or_insert(0) += 1;
        }
        for k in [
            "ok",
            "Truncated",
            "NotIpv4",
            "IpVersion",
            "Ipv4Length",
            "Ipv4Checksum",
            "Fragment",
            "NotUdp",
            "UdpLength",
            "arp",
            "ArpRefused",
            "hello",
            "HelloRefused",
            "HelloPartial",
            "HelloTooLong",
            "HelloNotUtf8",
        ] {
            assert!(seen.contains_key(k), "{k} never reached: {seen:?}");
        }
    }
}
