//! Round trips of `Hello`, every `BodyError` variant, and the opcode
//! dispatch of `Body::parse`.

use starwire_wire::message::{
    parse_empty, AuthMsg, AUTH_FIXED_LEN, HELLO_FIXED_LEN, MAX_CONFIG_LEN, MAX_JOB_NAME_LEN,
    PROOF_LEN,
};
use starwire_wire::ps::{
    self, write_push_response, Control, ControlError, PullRequestWriter, PullResponseWriter,
    PushRequestWriter,
};
use starwire_wire::{
    Body, BodyError, DType, Flags, FrameError, Header, Hello, Opcode, Role, Status, TensorRecord,
    TensorRef, TensorView,
};

fn i64s(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn encode(len: usize, emit: impl FnOnce(&mut [u8]) -> usize) -> Vec<u8> {
    let mut b = vec![0xee; len];
    assert_eq!(emit(&mut b), len);
    b
}

fn inside(outer: &[u8], inner: &[u8]) -> bool {
    let r = outer.as_ptr_range();
    r.start <= inner.as_ptr() && inner.as_ptr_range().end <= r.end
}

fn hello() -> Hello<'static> {
    Hello {
        protocol_version: 1,
        flags: 0x8001,
        role: Role::Ps,
        job_name: "ps",
        task_index: 4,
        incarnation: u64::MAX - 1,
        initial_credits: 128,
        max_frame_len: 1 << 20,
        shard_count: 4,
        nonce: *b"0123456789abcdef",
    }
}

#[test]
fn auth_round_trip_and_errors() {
    let a = AuthMsg {
        proof: [7; PROOF_LEN],
        config: "model=wdl\nlr=0.3\n",
    };
    let b = a.to_vec().unwrap();
    assert_eq!(b.len(), AUTH_FIXED_LEN + a.config.len());
    assert_eq!(AuthMsg::parse(&b), Ok(a));
    assert!(inside(&b, AuthMsg::parse(&b).unwrap().config.as_bytes()));
    // Truncated, too long, not UTF-8, trailing bytes.
    assert!(matches!(
        AuthMsg::parse(&b[..AUTH_FIXED_LEN - 1]),
        Err(BodyError::Layout(FrameError::Truncated { .. }))
    ));
    assert!(matches!(
        AuthMsg::parse(&b[..b.len() - 1]),
        Err(BodyError::Layout(FrameError::Truncated { .. }))
    ));
    let mut long = b.clone();
    long[PROOF_LEN..AUTH_FIXED_LEN].copy_from_slice(&5000u16.to_le_bytes());
    assert_eq!(AuthMsg::parse(&long), Err(BodyError::ConfigTooLong(5000)));
    let mut bad = b.clone();
    bad[AUTH_FIXED_LEN] = 0xff;
    assert_eq!(AuthMsg::parse(&bad), Err(BodyError::BadUtf8("config")));
    let mut extra = b.clone();
    extra.push(0);
    assert_eq!(
        AuthMsg::parse(&extra),
        Err(BodyError::TrailingBytes { extra: 1 })
    );
    let text = "x".repeat(MAX_CONFIG_LEN + 1);
    let too_long = AuthMsg {
        proof: [0; PROOF_LEN],
        config: &text,
    };
    assert_eq!(
        too_long.to_vec(),
        Err(BodyError::ConfigTooLong(MAX_CONFIG_LEN + 1))
    );
}

#[test]
fn hello_round_trip() {
    let h = hello();
    let b = encode(h.encoded_len(), |o| h.emit(o));
    assert_eq!(b.len(), HELLO_FIXED_LEN + 2);
    let p = Hello::parse(&b).unwrap();
    assert_eq!(p, h);
    assert!(inside(&b, p.job_name.as_bytes()));
    let long = "x".repeat(MAX_JOB_NAME_LEN);
    let h = Hello {
        job_name: &long,
        role: Role::Worker,
        ..hello()
    };
    let b = encode(h.encoded_len(), |o| h.emit(o));
    assert_eq!(Hello::parse(&b).unwrap(), h);
}

#[test]
#[should_panic(expected = "job name")]
fn hello_emit_rejects_long_name() {
    let long = "x".repeat(MAX_JOB_NAME_LEN + 1);
    let h = Hello {
        job_name: &long,
        ..hello()
    };
    let mut out = vec![0; h.encoded_len()];
    h.emit(&mut out);
}

/// Every `BodyError` variant, and the status it maps to.
#[test]
fn every_body_error() {
    assert_eq!(parse_empty(&[]), Ok(()));
    assert_eq!(
        parse_empty(&[1, 2]),
        Err(BodyError::TrailingBytes { extra: 2 })
    );

    // Hello: BadUtf8, JobNameTooLong, UnknownRole, Reserved, truncated name
    let h = hello();
    let hb = encode(h.encoded_len(), |o| h.emit(o));
    let mut b = hb.clone();
    b[HELLO_FIXED_LEN] = 0xff;
    let e = Hello::parse(&b).unwrap_err();
    assert_eq!(e, BodyError::BadUtf8("job_name"));
    assert_eq!(e.status(), Status::BadRequest);
    let mut b = hb.clone();
    b[6..8].copy_from_slice(&65u16.to_le_bytes());
    assert_eq!(Hello::parse(&b), Err(BodyError::JobNameTooLong(65)));
    let mut b = hb.clone();
    b[6..8].copy_from_slice(&3u16.to_le_bytes());
    assert!(matches!(
        Hello::parse(&b),
        Err(BodyError::Layout(FrameError::Truncated { .. }))
    ));
    let mut b = hb.clone();
    b[4] = 2;
    assert_eq!(Hello::parse(&b), Err(BodyError::UnknownRole(2)));
    let mut b = hb.clone();
    b[5] = 1;
    assert_eq!(Hello::parse(&b), Err(BodyError::Reserved("reserved")));
    assert!(matches!(
        Hello::parse(&hb[..10]),
        Err(BodyError::Layout(FrameError::Truncated { .. }))
    ));
    let mut b = hb.clone();
    b.push(0);
    assert_eq!(Hello::parse(&b), Err(BodyError::TrailingBytes { extra: 1 }));

    // PS bodies: their decode error, answered BadRequest; control
    // messages: UnknownMethod, as a shard answers them.
    let h = header(Opcode::SparsePull, Flags::NONE, Status::Ok);
    let e = Body::parse(&h, &[1, 1, 0]).unwrap_err();
    assert!(matches!(
        e,
        BodyError::Ps(ps::DecodeError::Truncated { .. })
    ));
    assert_eq!(e.status(), Status::BadRequest);
    let h = header(Opcode::Rpc, Flags::NONE, Status::Ok);
    let e = Body::parse(&h, &[9]).unwrap_err();
    assert_eq!(e, BodyError::Control(ControlError::UnknownMethod(9)));
    assert_eq!(e.status(), Status::UnknownMethod);

    // Display works for every variant
    for e in [
        BodyError::Layout(FrameError::BadLength("x")),
        BodyError::Ps(ps::DecodeError::BadTag(9)),
        BodyError::Control(ControlError::Empty),
        BodyError::TrailingBytes { extra: 1 },
        BodyError::Reserved("r"),
        BodyError::BadUtf8("f"),
        BodyError::JobNameTooLong(99),
        BodyError::UnknownRole(7),
    ] {
        assert!(!e.to_string().is_empty());
    }
}

fn header(op: Opcode, flags: Flags, status: Status) -> Header {
    let mut h = Header::new(op, 1, 0);
    h.flags = flags;
    h.status = status;
    h
}

#[test]
fn body_dispatch() {
    let none = Flags::NONE;
    let resp = Flags::RESPONSE;
    let ok = Status::Ok;

    let mut b = Vec::new();
    PullRequestWriter::new(&mut b).rows(1, &[4, 5]).dense(2);
    match Body::parse(&header(Opcode::SparsePull, none, ok), &b) {
        Ok(Body::PullRequest(r)) => assert_eq!(r.len(), 2),
        other => panic!("{other:?}"),
    }
    // A request's bytes are no response (another kind byte).
    assert!(matches!(
        Body::parse(&header(Opcode::SparsePull, resp, ok), &b),
        Err(BodyError::Ps(ps::DecodeError::BadKind { .. }))
    ));
    let mut w = PullResponseWriter::new(&mut b, 7);
    ps::put_f32s(w.rows(1, 2, 1), &[1.0, 2.0]);
    match Body::parse(&header(Opcode::SparsePull, resp, ok), &b) {
        Ok(Body::PullResponse(r)) => assert_eq!((r.len(), r.global_step), (1, 7)),
        other => panic!("{other:?}"),
    }
    PushRequestWriter::new(&mut b, true).rows(1, 2, &[4], &[0.5, 0.25]);
    match Body::parse(&header(Opcode::SparsePush, none, ok), &b) {
        Ok(Body::PushRequest(r)) => assert!(r.completes_step && r.len() == 1),
        other => panic!("{other:?}"),
    }
    write_push_response(&mut b, 3);
    assert!(matches!(
        Body::parse(&header(Opcode::SparsePush, resp, ok), &b),
        Ok(Body::PushResponse(3))
    ));
    let c = Control::WaitStep(12).encode();
    assert!(matches!(
        Body::parse(&header(Opcode::Rpc, none, ok), &c),
        Ok(Body::Control(Control::WaitStep(12)))
    ));
    // A control reply's layout depends on the method asked.
    assert!(matches!(
        Body::parse(&header(Opcode::Rpc, resp, ok), &12u64.to_le_bytes()),
        Ok(Body::Opaque(b)) if b.len() == 8
    ));
    for op in [Opcode::DensePull, Opcode::DensePush] {
        for flags in [none, resp] {
            assert!(matches!(
                Body::parse(&header(op, flags, ok), &[1, 2, 3]),
                Ok(Body::Opaque([1, 2, 3]))
            ));
        }
    }
    let ids = i64s(&[4]);
    let ids_t = TensorRef::new(0, DType::I64, &[1], &ids).unwrap();
    let rows = f32s(&[1.0, 2.0]);
    let rows_t = TensorRef::new(0, DType::F32, &[1, 2], &rows).unwrap();
    let list = [ids_t, rows_t];
    let b = encode(starwire_wire::tensors::encoded_len(&list), |o| {
        starwire_wire::tensors::emit(&list, o)
    });
    match Body::parse(&header(Opcode::Tensors, Flags::ONEWAY, ok), &b) {
        Ok(Body::Tensors(l)) => assert_eq!(l.len(), 2),
        other => panic!("{other:?}"),
    }
    let h = hello();
    let b = encode(h.encoded_len(), |o| h.emit(o));
    match Body::parse(&header(Opcode::Hello, none, ok), &b) {
        Ok(Body::Hello(p)) => assert_eq!(p, h),
        other => panic!("{other:?}"),
    }
    for op in [
        Opcode::Credit,
        Opcode::Cancel,
        Opcode::Goodbye,
        Opcode::Ping,
    ] {
        assert!(matches!(
            Body::parse(&header(op, none, ok), &[]),
            Ok(Body::Empty)
        ));
        assert_eq!(
            Body::parse(&header(op, none, ok), &[0]).unwrap_err(),
            BodyError::TrailingBytes { extra: 1 }
        );
    }
    // error responses carry a UTF-8 diagnostic
    assert!(matches!(
        Body::parse(
            &header(Opcode::SparsePull, resp, Status::WrongShape),
            b"bad ids"
        ),
        Ok(Body::Error("bad ids"))
    ));
    assert_eq!(
        Body::parse(&header(Opcode::Rpc, resp, Status::UnknownMethod), &[0xff]).unwrap_err(),
        BodyError::BadUtf8("diagnostic")
    );
}

#[test]
fn generic_over_tensor_record() {
    fn rank_of<T: TensorRecord>(t: &T) -> usize {
        t.rank()
    }
    let ids = i64s(&[1]);
    let r = TensorRef::new(0, DType::I64, &[1], &ids).unwrap();
    let b = encode(TensorRecord::encoded_len(&r), |o| TensorRecord::emit(&r, o));
    let v = TensorView::parse_exact(&b).unwrap();
    assert_eq!(rank_of(&r), rank_of(&v));
    assert_eq!(TensorRecord::dtype(&v), DType::I64);
    assert_eq!(TensorRecord::dim(&v, 0), Some(1));
}
