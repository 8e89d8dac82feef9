//! Unit tests of the codec: round trips, sizes and every decode error.

use super::*;

#[test]
fn pull_request_round_trip_and_sizes() {
    let mut buf = Vec::new();
    let mut w = PullRequestWriter::new(&mut buf);
    w.dense(1)
        .rows(2, &[5, 6, 7])
        .pooled(3, &[0, 2, 3], &[9, 8, 9]);
    let n = w.len();
    assert_eq!(
        n,
        pull_request_header_len() + pull_dense_len() + pull_rows_len(3) + pull_pooled_len(2, 3)
    );
    let req = PullRequest::parse(&buf, &Limits::default()).unwrap();
    let items: Vec<_> = req.items().collect();
    assert_eq!(items.len(), 3);
    assert_eq!(items[0], PullItem::Dense { var: 1 });
    match items[1] {
        PullItem::Rows { var, keys } => {
            assert_eq!(var, 2);
            assert_eq!(keys.to_vec(), vec![5, 6, 7]);
        }
        _ => panic!("not rows"),
    }
    match items[2] {
        PullItem::Pooled { var, offsets, keys } => {
            assert_eq!(var, 3);
            assert_eq!(offsets.to_vec(), vec![0, 2, 3]);
            assert_eq!(keys.slice(2, 3).to_vec(), vec![9]);
        }
        _ => panic!("not pooled"),
    }
}

#[test]
fn push_request_round_trip_and_sizes() {
    let mut buf = Vec::new();
    let mut w = PushRequestWriter::new(&mut buf, true);
    w.dense(1, &[1.0, 2.0])
        .rows(2, 2, &[4], &[0.5, 0.25])
        .pooled(3, 1, &[0, 1, 1], &[4], &[1.0, 2.0]);
    assert_eq!(
        w.len(),
        push_request_header_len()
            + push_dense_len(2)
            + push_rows_len(1, 2)
            + push_pooled_len(2, 1, 1)
    );
    let req = PushRequest::parse(&buf, &Limits::default()).unwrap();
    assert!(req.completes_step);
    assert_eq!(PushRequest::peek_completes_step(&buf), Ok(true));
    let mut partial = Vec::new();
    PushRequestWriter::new(&mut partial, false).dense(1, &[1.0]);
    assert_eq!(PushRequest::peek_completes_step(&partial), Ok(false));
    assert!(PushRequest::peek_completes_step(&buf[..3]).is_err());
    let items: Vec<_> = req.items().collect();
    assert_eq!(items.len(), 3);
    assert!(matches!(items[1], PushItem::Rows { dim: 2, .. }));
}

#[test]
fn decode_errors() {
    let l = Limits::default();
    let mut buf = Vec::new();
    PullRequestWriter::new(&mut buf).rows(2, &[5, 6]);
    // Truncated at every length.
    for cut in 0..buf.len() {
        assert!(matches!(
            PullRequest::parse(&buf[..cut], &l),
            Err(DecodeError::Truncated { .. })
        ));
    }
    let mut b = buf.clone();
    b[0] = 9;
    assert_eq!(
        PullRequest::parse(&b, &l).unwrap_err(),
        DecodeError::BadVersion(9)
    );
    let mut b = buf.clone();
    b[1] = KIND_PUSH_REQUEST;
    assert!(matches!(
        PullRequest::parse(&b, &l),
        Err(DecodeError::BadKind { .. })
    ));
    let mut b = buf.clone();
    b[8] = 7;
    assert_eq!(
        PullRequest::parse(&b, &l).unwrap_err(),
        DecodeError::BadTag(7)
    );
    let mut b = buf.clone();
    b[9] = 1;
    assert!(matches!(
        PullRequest::parse(&b, &l),
        Err(DecodeError::Reserved(_))
    ));
    let mut b = buf.clone();
    b.push(0);
    assert_eq!(
        PullRequest::parse(&b, &l).unwrap_err(),
        DecodeError::Trailing(1)
    );
    let small = Limits { max_keys: 1, ..l };
    assert!(matches!(
        PullRequest::parse(&buf, &small),
        Err(DecodeError::Oversized { what: "keys", .. })
    ));
    let mut b = buf.clone();
    b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        PullRequest::parse(&b, &l),
        Err(DecodeError::Oversized { what: "items", .. })
    ));
    // A huge element count overflows or is oversized, never allocates.
    let mut b = Vec::new();
    PushRequestWriter::new(&mut b, false).rows(1, u32::MAX, &[1], &[]);
    assert!(matches!(
        PushRequest::parse(&b, &l),
        Err(DecodeError::Oversized { .. })
    ));
    let huge = Limits {
        max_elems: u64::MAX,
        max_keys: u32::MAX,
        ..l
    };
    let mut b = Vec::new();
    PushRequestWriter::new(&mut b, false).rows(1, u32::MAX, &[1], &[]);
    b[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        PushRequest::parse(&b, &huge),
        Err(DecodeError::Truncated { .. } | DecodeError::LengthOverflow(_))
    ));
}

#[test]
fn length_overflow() {
    // Only reachable where usize is narrower than the product; checked directly.
    let mut r = Reader::new(&[]);
    assert_eq!(
        r.array(u64::MAX, 8, "keys").unwrap_err(),
        DecodeError::LengthOverflow("keys")
    );
    let l = Limits {
        max_elems: u64::MAX,
        ..Limits::default()
    };
    assert_eq!(
        elems(u32::MAX, u32::MAX, &l, "x"),
        Ok(u64::from(u32::MAX) * u64::from(u32::MAX))
    );
}

#[test]
fn bad_offsets() {
    let l = Limits::default();
    for offs in [[1u32, 1, 2], [0, 2, 1], [0, 1, 1]] {
        let mut b = Vec::new();
        PullRequestWriter::new(&mut b).pooled(1, &offs, &[1, 2]);
        assert!(
            matches!(PullRequest::parse(&b, &l), Err(DecodeError::BadOffsets(_))),
            "{offs:?}"
        );
    }
}

#[test]
fn push_response_round_trip() {
    let mut b = Vec::new();
    write_push_response(&mut b, 77);
    assert_eq!(b.len(), PUSH_RESPONSE_LEN);
    assert_eq!(parse_push_response(&b), Ok(77));
    b[2] = 1;
    assert!(parse_push_response(&b).is_err());
}

#[test]
fn pull_response_round_trip() {
    let mut b = Vec::new();
    let mut w = PullResponseWriter::new(&mut b, 9);
    put_f32s(w.dense(1, 2), &[1.0, 2.0]);
    put_f32s(w.rows(2, 2, 1), &[3.0, 4.0]);
    let out = w.pooled(3, 1, 2);
    put_f32s(out, &[5.0]);
    put_f32s(out, &[6.0]);
    let resp = PullResponse::parse(&b, &Limits::default()).unwrap();
    assert_eq!(resp.global_step, 9);
    let items: Vec<_> = resp.items().collect();
    assert_eq!(items.len(), 3);
    match items[0] {
        PullReply::Dense { var, data } => assert_eq!((var, data.to_vec()), (1, vec![1.0, 2.0])),
        _ => panic!("not dense"),
    }
    match items[1] {
        PullReply::Rows { var, dim, data } => {
            assert_eq!((var, dim, data.to_vec()), (2, 2, vec![3.0, 4.0]));
        }
        _ => panic!("not rows"),
    }
    match items[2] {
        PullReply::Pooled { var, dim, data } => {
            assert_eq!((var, dim, data.to_vec()), (3, 1, vec![5.0, 6.0]));
        }
        _ => panic!("not pooled"),
    }
    // A reply whose floats were not all written is truncated.
    let mut b = Vec::new();
    let mut w = PullResponseWriter::new(&mut b, 0);
    put_f32s(w.rows(2, 2, 2), &[3.0, 4.0]);
    assert!(matches!(
        PullResponse::parse(&b, &Limits::default()),
        Err(DecodeError::Truncated { .. })
    ));
}

#[test]
fn f32s_decode_into_a_slice_or_onto_a_vector() {
    let mut bytes = Vec::new();
    put_f32s(&mut bytes, &[1.5, -2.0, 3.25]);
    let v = F32s::new(&bytes).unwrap();
    let mut out = vec![9.0];
    v.extend_into(&mut out);
    assert_eq!(out, [9.0, 1.5, -2.0, 3.25]);
    // The same floats a byte off 4-alignment (decoded, not copied in
    // place) append alike.
    let mut shifted = vec![0u8; bytes.len() + 1];
    shifted[1..].copy_from_slice(&bytes);
    let off = F32s::new(&shifted[1..]).unwrap();
    assert!(off.try_as_slice().is_none());
    off.extend_into(&mut out);
    assert_eq!(out, [9.0, 1.5, -2.0, 3.25, 1.5, -2.0, 3.25]);
    let mut short = [0.0; 2];
    v.copy_to(&mut short);
    assert_eq!(short, [1.5, -2.0]);
    v.add_to(&mut short);
    assert_eq!(short, [3.0, -4.0]);
}

#[test]
fn f32s_all_finite_agrees_with_is_finite_on_every_edge() {
    let edges = [
        0.0,
        -0.0,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x8000_0001),
        1.0,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffff_ffff),
        f32::from_bits(0x7fc0_0000),
    ];
    for &x in &edges {
        // Alone, and among finite values at every position of a vector's
        // lanes and of the loop's tail.
        for len in 1..12 {
            for at in 0..len {
                let mut v = vec![0.5f32; len];
                v[at] = x;
                let mut bytes = Vec::new();
                put_f32s(&mut bytes, &v);
                assert_eq!(
                    F32s::new(&bytes).unwrap().all_finite(),
                    x.is_finite(),
                    "{:#010x} at {at} of {len}",
                    x.to_bits()
                );
            }
        }
    }
    assert!(F32s::new(&[]).unwrap().all_finite());
}

/// A pooled push of a few bags over many keys: the shard sums a row of
/// `dim` floats per key, so `n_keys × dim` is held to `max_elems` as a
/// rows push's gradients are, though the request carries only keys (it
/// used to pass with `batch × dim` checked alone).
#[test]
fn a_pooled_push_s_keys_rows_are_bounded() {
    let l = Limits {
        max_elems: 64,
        ..Limits::default()
    };
    let push = |keys: &[u64]| {
        let mut b = Vec::new();
        let offs = [0, keys.len() as u32];
        PushRequestWriter::new(&mut b, false).pooled(1, 8, &offs, keys, &[0.5; 8]);
        b
    };
    let eight: Vec<u64> = (0..8).collect();
    assert!(PushRequest::parse(&push(&eight), &l).is_ok());
    let nine: Vec<u64> = (0..9).collect();
    assert!(matches!(
        PushRequest::parse(&push(&nine), &l),
        Err(DecodeError::Oversized { .. })
    ));
}
