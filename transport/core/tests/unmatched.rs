//! Responses that match no pending request are dropped and counted
//! ([`Connection::unmatched_responses`]): a duplicated answer, a late one
//! to a cancelled request, one to an id never sent.

use starwire_transport::conformance::{link_pairs, Pair};
use starwire_transport::testing::MemTransport;
use starwire_transport::wire::message::{AuthMsg, Hello, Role};
use starwire_transport::wire::{Flags, Header, Opcode, Status, HEADER_LEN};
use starwire_transport::{ConnConfig, Connection, Incoming, Payload, PeerInfo, Side, TaskRole};

const MAX_FRAME: usize = 4096;

/// A server that answers every request twice: the second answer is a
/// duplicate, which the client drops and counts.
#[test]
fn a_duplicated_response_is_counted_not_delivered() {
    let mut pair = Pair::new(link_pairs(1, || MemTransport::pair(MAX_FRAME, 64)));
    let ids: Vec<u64> = (0..3u8)
        .map(|k| {
            pair.a(0)
                .request(Opcode::Rpc, 0, Payload::from(vec![k; 8]), None)
                .expect("queue")
        })
        .collect();
    let mut answers = Vec::new();
    pair.drive(
        &mut |_, _, m| {
            if let Incoming::Response { id, status, .. } = m {
                answers.push((id, status));
            }
        },
        &mut |_, c: &mut Connection, m| {
            if let Incoming::Request {
                id, opcode, body, ..
            } = m
            {
                let body = Payload::from(body.to_vec());
                for _ in 0..2 {
                    c.respond(id, opcode, Status::Ok, body.clone())
                        .expect("respond");
                }
            }
        },
        &mut |p| p.a(0).unmatched_responses() == 3,
    );
    let want: Vec<(u64, Status)> = ids.iter().map(|&id| (id, Status::Ok)).collect();
    assert_eq!(answers, want, "each request answered once");
    assert_eq!(pair.a(0).pending_requests(), 0);
    assert_eq!(pair.a(0).unmatched_responses(), 3);
    // The server end sent no requests and got no responses.
    assert_eq!(pair.b(0).unmatched_responses(), 0);
    assert!(pair.a(0).is_established());
}

/// A late answer to a cancelled request matches nothing too.
#[test]
fn a_response_to_a_cancelled_request_is_counted() {
    let mut pair = Pair::new(link_pairs(1, || MemTransport::pair(MAX_FRAME, 64)));
    let id = pair
        .a(0)
        .request(Opcode::Rpc, 0, Payload::from(vec![1; 8]), None)
        .expect("queue");
    let mut delivered = 0;
    let mut cancelled = false;
    pair.drive(
        &mut |_, _, m| {
            if matches!(m, Incoming::Response { .. }) {
                delivered += 1;
            }
        },
        &mut |_, c: &mut Connection, m| {
            if let Incoming::Request {
                id, opcode, body, ..
            } = m
            {
                c.respond(id, opcode, Status::Ok, Payload::from(body.to_vec()))
                    .expect("respond");
            }
        },
        &mut |p| {
            if !cancelled && p.b(0).is_established() {
                // The request is out; forget it before its answer lands.
                cancelled = p.a(0).cancel(id);
            }
            p.a(0).unmatched_responses() == 1
        },
    );
    assert!(cancelled);
    assert_eq!(delivered, 0);
}

fn hello_frame() -> Vec<u8> {
    let h = Hello {
        protocol_version: starwire_transport::PROTOCOL_VERSION,
        flags: 0,
        role: Role::Ps,
        job_name: "ps",
        task_index: 0,
        incarnation: 9,
        initial_credits: 64,
        max_frame_len: MAX_FRAME as u32,
        shard_count: 1,
        nonce: [7; 16],
    };
    let mut f = vec![0u8; HEADER_LEN + h.encoded_len()];
    Header::new(Opcode::Hello, 0, h.encoded_len() as u32).emit(&mut f);
    h.emit(&mut f[HEADER_LEN..]);
    f
}

fn frame(h: Header, body: &[u8]) -> Vec<u8> {
    let mut f = h.to_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// Frame by frame: the same response frame twice, a chunked response
/// twice, and a response to an id never sent; each unmatched one is
/// counted once and the connection lives.
#[test]
fn duplicated_frames_fed_by_hand_are_counted() {
    let mut cfg = ConnConfig::new(PeerInfo {
        role: TaskRole::Worker,
        job: "worker".into(),
        task_index: 0,
        incarnation: 1,
        shards: 1,
    });
    cfg.side = Side::Dialer;
    let mut conn = Connection::new(cfg, MAX_FRAME);
    let mut scratch = Vec::new();
    let auth = AuthMsg {
        proof: [0; 32],
        config: "",
    }
    .to_vec()
    .expect("auth");
    for f in [
        hello_frame(),
        frame(Header::new(Opcode::Auth, 0, auth.len() as u32), &auth),
    ] {
        conn.handle_frame(&f, &mut scratch).expect("handshake");
    }
    let one = conn
        .request(Opcode::Rpc, 0, Payload::from(vec![1; 4]), None)
        .expect("queue");
    let two = conn
        .request(Opcode::Rpc, 0, Payload::from(vec![2; 4]), None)
        .expect("queue");

    let mut h = Header::new(Opcode::Rpc, one, 4);
    h.flags = Flags::RESPONSE;
    let f = frame(h, &[9; 4]);
    let got = conn.handle_frame(&f, &mut scratch).expect("lives");
    assert!(matches!(got, Some(Incoming::Response { id, .. }) if id == one));
    assert_eq!(conn.unmatched_responses(), 0);
    let got = conn.handle_frame(&f, &mut scratch).expect("lives");
    assert!(got.is_none(), "the duplicate was delivered");
    assert_eq!(conn.unmatched_responses(), 1);

    // A chunked response, twice.
    let mut first = Header::new(Opcode::Rpc, two, 1000);
    first.flags = Flags::RESPONSE.with(Flags::MORE);
    first.message_len = 2000;
    let mut last = first;
    last.flags = Flags::RESPONSE.with(Flags::CONTINUATION);
    let (f1, f2) = (frame(first, &[1; 1000]), frame(last, &[2; 1000]));
    for round in 0..2 {
        let got = conn.handle_frame(&f1, &mut scratch).expect("lives");
        assert!(got.is_none());
        let got = conn.handle_frame(&f2, &mut scratch).expect("lives");
        if round == 0 {
            assert!(matches!(got, Some(Incoming::Response { id, .. }) if id == two));
        } else {
            assert!(got.is_none(), "the chunked duplicate was delivered");
        }
    }
    assert_eq!(conn.unmatched_responses(), 2);

    // An id never sent.
    let mut h = Header::new(Opcode::Rpc, 0xdead, 0);
    h.flags = Flags::RESPONSE;
    assert!(conn
        .handle_frame(&frame(h, &[]), &mut scratch)
        .expect("lives")
        .is_none());
    assert_eq!(conn.unmatched_responses(), 3);
    assert!(conn.is_established());
}
