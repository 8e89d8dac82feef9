//! Round trips of every message repr, every `BodyError` variant, and the
//! opcode dispatch of `Body::parse`.

use starwire_wire::message::{parse_empty, HELLO_FIXED_LEN, MAX_JOB_NAME_LEN};
use starwire_wire::{
    Body, BodyError, DType, DensePullRequest, DensePullResponse, DensePushRequest, Flags,
    FrameError, Header, Hello, Opcode, Role, Rpc, SparsePullRequest, SparsePullResponse,
    SparsePushRequest, Status, TensorRecord, TensorRef, TensorView,
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
    }
}

#[test]
fn sparse_pull_round_trip() {
    let ids = i64s(&[1, 5, 9]);
    let req = SparsePullRequest {
        variable_id: 42,
        ids: TensorRef::new(0, DType::I64, &[3], &ids).unwrap(),
    };
    req.check().unwrap();
    let b = encode(req.encoded_len(), |o| req.emit(o));
    let p = SparsePullRequest::parse(&b).unwrap();
    assert_eq!(p.variable_id, 42);
    assert_eq!(p.ids.i64s().unwrap().collect::<Vec<_>>(), vec![1, 5, 9]);
    assert!(inside(&b, p.ids.data()));
    // forwarding the view re-encodes identically
    assert_eq!(encode(p.encoded_len(), |o| p.emit(o)), b);

    let rows = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let resp = SparsePullResponse {
        rows: TensorRef::new(0, DType::F32, &[3, 2], &rows).unwrap(),
    };
    resp.check().unwrap();
    let b = encode(resp.encoded_len(), |o| resp.emit(o));
    let p = SparsePullResponse::parse(&b).unwrap();
    assert_eq!(p.rows.dims().iter().collect::<Vec<_>>(), vec![3, 2]);
    assert_eq!(p.rows.f32s().unwrap().sum::<f32>(), 21.0);
    assert!(inside(&b, p.rows.data()));
}

#[test]
fn sparse_push_round_trip() {
    let ids = i64s(&[7, 8]);
    let g = f32s(&[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]);
    let req = SparsePushRequest {
        variable_id: 3,
        ids: TensorRef::new(0, DType::I64, &[2], &ids).unwrap(),
        grads: TensorRef::new(0, DType::F32, &[2, 3], &g).unwrap(),
    };
    req.check().unwrap();
    let b = encode(req.encoded_len(), |o| req.emit(o));
    let p = SparsePushRequest::parse(&b).unwrap();
    assert_eq!(p.variable_id, 3);
    assert_eq!(p.ids.num_elements(), 2);
    assert_eq!(p.grads.dim(1), Some(3));
    assert_eq!(p.grads.data(), &g[..]);
    assert!(inside(&b, p.grads.data()));
    assert_eq!(encode(p.encoded_len(), |o| p.emit(o)), b);
    parse_empty(&[]).unwrap();
}

#[test]
fn dense_round_trip() {
    let req = DensePullRequest { variable_id: 9 };
    let b = encode(req.encoded_len(), |o| req.emit(o));
    assert_eq!(DensePullRequest::parse(&b).unwrap(), req);

    let v = f32s(&[1.5; 4]);
    let t = TensorRef::new(77, DType::F32, &[2, 2], &v).unwrap();
    let resp = DensePullResponse { tensor: t };
    let b = encode(resp.encoded_len(), |o| resp.emit(o));
    let p = DensePullResponse::parse(&b).unwrap();
    assert_eq!(p.tensor.key(), 77);
    assert!(inside(&b, p.tensor.data()));

    let push = DensePushRequest {
        variable_id: 9,
        tensor: t,
    };
    let b = encode(push.encoded_len(), |o| push.emit(o));
    let p = DensePushRequest::parse(&b).unwrap();
    assert_eq!(p.variable_id, 9);
    assert_eq!(
        p.tensor.widened_f32s().unwrap().collect::<Vec<_>>(),
        vec![1.5; 4]
    );
}

#[test]
fn rpc_and_hello_round_trip() {
    let rpc = Rpc {
        method: 0xabcd,
        payload: b"hello world",
    };
    let b = encode(rpc.encoded_len(), |o| rpc.emit(o));
    let p = Rpc::parse(&b).unwrap();
    assert_eq!(p, rpc);
    assert!(inside(&b, p.payload));

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
    let ids = i64s(&[1, 2]);
    let ids_t = TensorRef::new(0, DType::I64, &[2], &ids).unwrap();
    let g = f32s(&[0.0; 6]);
    let grads = TensorRef::new(0, DType::F32, &[2, 3], &g).unwrap();
    let pull = SparsePullRequest {
        variable_id: 1,
        ids: ids_t,
    };
    let good = encode(pull.encoded_len(), |o| pull.emit(o));

    // Layout (wrapping a FrameError)
    let e = SparsePullRequest::parse(&good[..20]).unwrap_err();
    assert!(matches!(e, BodyError::Layout(FrameError::Truncated { .. })));
    assert_eq!(e.status(), Status::BadRequest);
    let e = SparsePullRequest::parse(&good[..3]).unwrap_err();
    assert!(matches!(e, BodyError::Layout(FrameError::Truncated { .. })));

    // TrailingBytes
    let mut t = good.clone();
    t.extend_from_slice(&[0; 8]);
    let e = SparsePullRequest::parse(&t).unwrap_err();
    assert_eq!(e, BodyError::TrailingBytes { extra: 8 });
    assert_eq!(e.status(), Status::BadRequest);
    assert_eq!(
        parse_empty(&[1]),
        Err(BodyError::TrailingBytes { extra: 1 })
    );

    // Reserved
    let mut r = good.clone();
    r[5] = 1;
    let e = SparsePullRequest::parse(&r).unwrap_err();
    assert_eq!(e, BodyError::Reserved("reserved"));
    assert_eq!(e.status(), Status::BadRequest);

    // WrongDType: ids not I64
    let f = f32s(&[1.0, 2.0]);
    let bad = SparsePullRequest {
        variable_id: 1,
        ids: TensorRef::new(0, DType::F32, &[2], &f).unwrap(),
    };
    assert!(matches!(bad.check(), Err(BodyError::WrongDType { .. })));
    let b = encode(bad.encoded_len(), |o| bad.emit(o));
    let e = SparsePullRequest::parse(&b).unwrap_err();
    assert!(matches!(
        e,
        BodyError::WrongDType {
            what: "ids",
            found: DType::F32,
            ..
        }
    ));
    assert_eq!(e.status(), Status::WrongShape);
    // WrongDType: integer grads
    let gi = i64s(&[0; 6]);
    let bad = SparsePushRequest {
        variable_id: 1,
        ids: ids_t,
        grads: TensorRef::new(0, DType::I64, &[2, 3], &gi).unwrap(),
    };
    let b = encode(bad.encoded_len(), |o| bad.emit(o));
    let e = SparsePushRequest::parse(&b).unwrap_err();
    assert!(matches!(e, BodyError::WrongDType { what: "grads", .. }));

    // WrongRank: ids rank 2, rows rank 1, grads rank 1
    let bad = SparsePullRequest {
        variable_id: 1,
        ids: TensorRef::new(0, DType::I64, &[1, 2], &ids).unwrap(),
    };
    let b = encode(bad.encoded_len(), |o| bad.emit(o));
    let e = SparsePullRequest::parse(&b).unwrap_err();
    assert_eq!(
        e,
        BodyError::WrongRank {
            what: "ids",
            expected: 1,
            found: 2
        }
    );
    assert_eq!(e.status(), Status::WrongShape);
    let rows = SparsePullResponse {
        rows: TensorRef::new(0, DType::F32, &[6], &g).unwrap(),
    };
    assert!(rows.check().is_err());
    let b = encode(rows.encoded_len(), |o| rows.emit(o));
    assert!(matches!(
        SparsePullResponse::parse(&b),
        Err(BodyError::WrongRank { what: "rows", .. })
    ));
    let bad = SparsePushRequest {
        variable_id: 1,
        ids: ids_t,
        grads: TensorRef::new(0, DType::F32, &[6], &g).unwrap(),
    };
    let b = encode(bad.encoded_len(), |o| bad.emit(o));
    assert!(matches!(
        SparsePushRequest::parse(&b),
        Err(BodyError::WrongRank { what: "grads", .. })
    ));

    // RowMismatch
    let bad = SparsePushRequest {
        variable_id: 1,
        ids: ids_t,
        grads: TensorRef::new(0, DType::F32, &[3, 2], &g).unwrap(),
    };
    assert_eq!(bad.check(), Err(BodyError::RowMismatch { ids: 2, rows: 3 }));
    let b = encode(bad.encoded_len(), |o| bad.emit(o));
    let e = SparsePushRequest::parse(&b).unwrap_err();
    assert_eq!(e, BodyError::RowMismatch { ids: 2, rows: 3 });
    assert_eq!(e.status(), Status::WrongShape);
    let ok = SparsePushRequest {
        variable_id: 1,
        ids: ids_t,
        grads,
    };
    ok.check().unwrap();

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

    // Display works for every variant
    for e in [
        BodyError::Layout(FrameError::BadLength("x")),
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
    let ids = i64s(&[4]);
    let ids_t = TensorRef::new(0, DType::I64, &[1], &ids).unwrap();
    let rows = f32s(&[1.0, 2.0]);
    let rows_t = TensorRef::new(0, DType::F32, &[1, 2], &rows).unwrap();
    let none = Flags::NONE;
    let resp = Flags::RESPONSE;
    let ok = Status::Ok;

    let pull = SparsePullRequest {
        variable_id: 1,
        ids: ids_t,
    };
    let b = encode(pull.encoded_len(), |o| pull.emit(o));
    assert!(matches!(
        Body::parse(&header(Opcode::SparsePull, none, ok), &b),
        Ok(Body::SparsePullRequest(_))
    ));
    // the same bytes as a response do not parse as rows (ids is rank 1 after an 8-byte prefix)
    assert!(Body::parse(&header(Opcode::SparsePull, resp, ok), &b).is_err());
    let r = SparsePullResponse { rows: rows_t };
    let b = encode(r.encoded_len(), |o| r.emit(o));
    assert!(matches!(
        Body::parse(&header(Opcode::SparsePull, resp, ok), &b),
        Ok(Body::SparsePullResponse(_))
    ));
    let push = SparsePushRequest {
        variable_id: 1,
        ids: ids_t,
        grads: rows_t,
    };
    let b = encode(push.encoded_len(), |o| push.emit(o));
    assert!(matches!(
        Body::parse(&header(Opcode::SparsePush, none, ok), &b),
        Ok(Body::SparsePushRequest(_))
    ));
    assert_eq!(
        Body::parse(&header(Opcode::SparsePush, resp, ok), &[]),
        Ok(Body::Empty)
    );
    assert_eq!(
        Body::parse(&header(Opcode::DensePush, resp, ok), &[1]),
        Err(BodyError::TrailingBytes { extra: 1 })
    );
    let d = DensePullRequest { variable_id: 2 };
    let b = encode(8, |o| d.emit(o));
    assert_eq!(
        Body::parse(&header(Opcode::DensePull, none, ok), &b),
        Ok(Body::DensePullRequest(d))
    );
    let dr = DensePullResponse { tensor: rows_t };
    let b = encode(dr.encoded_len(), |o| dr.emit(o));
    assert!(matches!(
        Body::parse(&header(Opcode::DensePull, resp, ok), &b),
        Ok(Body::DensePullResponse(_))
    ));
    let dp = DensePushRequest {
        variable_id: 2,
        tensor: rows_t,
    };
    let b = encode(dp.encoded_len(), |o| dp.emit(o));
    assert!(matches!(
        Body::parse(&header(Opcode::DensePush, none, ok), &b),
        Ok(Body::DensePushRequest(_))
    ));
    let list = [ids_t, rows_t];
    let b = encode(starwire_wire::tensors::encoded_len(&list), |o| {
        starwire_wire::tensors::emit(&list, o)
    });
    match Body::parse(&header(Opcode::Tensors, Flags::ONEWAY, ok), &b) {
        Ok(Body::Tensors(l)) => assert_eq!(l.len(), 2),
        other => panic!("{other:?}"),
    }
    let rpc = Rpc {
        method: 1,
        payload: &[],
    };
    let b = encode(8, |o| rpc.emit(o));
    assert_eq!(
        Body::parse(&header(Opcode::Rpc, none, ok), &b),
        Ok(Body::Rpc(rpc))
    );
    let h = hello();
    let b = encode(h.encoded_len(), |o| h.emit(o));
    assert_eq!(
        Body::parse(&header(Opcode::Hello, none, ok), &b),
        Ok(Body::Hello(h))
    );
    for op in [
        Opcode::Credit,
        Opcode::Cancel,
        Opcode::Goodbye,
        Opcode::Ping,
    ] {
        assert_eq!(Body::parse(&header(op, none, ok), &[]), Ok(Body::Empty));
    }
    // error responses carry a UTF-8 diagnostic
    assert_eq!(
        Body::parse(
            &header(Opcode::SparsePull, resp, Status::WrongShape),
            b"bad ids"
        ),
        Ok(Body::Error("bad ids"))
    );
    assert_eq!(
        Body::parse(&header(Opcode::Rpc, resp, Status::UnknownMethod), &[0xff]),
        Err(BodyError::BadUtf8("diagnostic"))
    );
    // a body that does not match its opcode is a semantic error
    let e = Body::parse(&header(Opcode::SparsePush, none, ok), &[0; 4]).unwrap_err();
    assert_eq!(e.status(), Status::BadRequest);
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
