//! Hand-made hostile inputs replayed through `decode_any` and the parsers:
//! each must fail cleanly (no panic, no large allocation).

use starwire_wire::{
    decode_any, tensors, DType, Flags, Frame, FrameError, Header, Limits, Opcode, TensorList,
    TensorRef, TensorView, HEADER_LEN,
};

fn frame(op: Opcode, flags: Flags, body: &[u8]) -> Vec<u8> {
    let mut h = Header::new(op, 1, body.len() as u32);
    h.flags = flags;
    let f = Frame { header: h, body };
    let mut out = vec![0; f.frame_len()];
    f.emit(&mut out);
    out
}

/// A tensor record head with arbitrary fields and `tail` after it.
fn record(dtype: u8, rank: u8, byte_len: u64, dims: &[u64], tail: &[u8]) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(&0u64.to_le_bytes());
    r.push(dtype);
    r.push(rank);
    r.extend_from_slice(&[0; 6]);
    r.extend_from_slice(&byte_len.to_le_bytes());
    for d in dims {
        r.extend_from_slice(&d.to_le_bytes());
    }
    r.extend_from_slice(tail);
    r
}

fn list_body(count: u32, records: &[u8]) -> Vec<u8> {
    let mut b = count.to_le_bytes().to_vec();
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(records);
    b
}

fn body_error(bytes: &[u8]) -> usize {
    decode_any(bytes, &Limits::default()).unwrap().body_errors
}

#[test]
fn huge_count_small_body() {
    let body = list_body(u32::MAX, &[0; 64]);
    assert_eq!(
        TensorList::parse(&body),
        Err(FrameError::BadLength(
            "tensor count exceeds what the body can hold"
        ))
    );
    assert_eq!(body_error(&frame(Opcode::Tensors, Flags::NONE, &body)), 1);
    // count exactly one more than fits
    let body = list_body(3, &[0; 64]);
    assert!(TensorList::parse(&body).is_err());
}

#[test]
fn length_overflow() {
    // byte_len u64::MAX with a consistent-looking shape is still rejected
    let r = record(DType::U8 as u8, 1, u64::MAX, &[u64::MAX], &[]);
    assert!(matches!(
        TensorView::parse(&r),
        Err(FrameError::Truncated { .. })
    ));
    // byte_len that disagrees with the dims
    let r = record(DType::F32 as u8, 1, 8, &[3], &[0; 16]);
    assert!(matches!(
        TensorView::parse(&r),
        Err(FrameError::BadLength(_))
    ));
    // element count × size overflows
    let r = record(DType::I64 as u8, 1, 0, &[1 << 61], &[]);
    assert_eq!(
        TensorView::parse(&r),
        Err(FrameError::BadLength("tensor byte length overflows u64"))
    );
    let body = list_body(1, &r);
    assert_eq!(body_error(&frame(Opcode::Tensors, Flags::NONE, &body)), 1);
    // header: body_len u32::MAX is Oversized before anything is buffered
    let mut h = Header::new(Opcode::Rpc, 1, 0);
    h.body_len = u32::MAX;
    h.message_len = u32::MAX;
    let b = h.to_bytes();
    assert!(matches!(
        starwire_wire::peek_frame_len(&b, &Limits::default()),
        Err(FrameError::Oversized { .. })
    ));
    assert!(matches!(
        decode_any(&b, &Limits::new(u32::MAX, u32::MAX)),
        Err(FrameError::Truncated { .. })
    ));
}

#[test]
fn rank_255() {
    let r = record(DType::F32 as u8, 255, 4, &[], &[0; 64]);
    assert_eq!(
        TensorView::parse(&r),
        Err(FrameError::Malformed("tensor rank above 8"))
    );
    let body = list_body(1, &r);
    let bytes = frame(Opcode::Tensors, Flags::NONE, &body);
    let s = decode_any(&bytes, &Limits::default()).unwrap();
    assert_eq!(s.body_errors, 1);
    assert_eq!(
        TensorList::parse(&body).unwrap_err(),
        FrameError::Malformed("tensor rank above 8")
    );
}

/// PS bodies whose counts claim more than the body holds: rejected before
/// anything is sized by them.
#[test]
fn ps_counts_beyond_the_body() {
    // A pull request of u32::MAX items, then one rows item of u32::MAX keys.
    let mut b = vec![1, 1, 0, 0];
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    b.extend_from_slice(&[2, 0, 0, 0, 9, 0, 0, 0]);
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(body_error(&frame(Opcode::SparsePull, Flags::NONE, &b)), 1);
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert_eq!(body_error(&frame(Opcode::SparsePull, Flags::NONE, &b)), 1);
    // A pull response claiming u32::MAX rows of width u32::MAX.
    let mut b = vec![1, 2, 0, 0, 1, 0, 0, 0];
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&[2, 0, 0, 0, 9, 0, 0, 0]);
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        body_error(&frame(Opcode::SparsePull, Flags::RESPONSE, &b)),
        1
    );
}

#[test]
fn dims_product_overflow() {
    let r = record(DType::U8 as u8, 3, 0, &[1 << 32, 1 << 32, 2], &[]);
    assert_eq!(
        TensorView::parse(&r),
        Err(FrameError::BadLength("tensor element count overflows u64"))
    );
    // a zero dim does not hide an overflow among the others
    let r = record(DType::U8 as u8, 3, 0, &[0, u64::MAX, u64::MAX], &[]);
    assert!(matches!(
        TensorView::parse(&r),
        Err(FrameError::BadLength(_))
    ));
    let body = list_body(1, &r);
    assert_eq!(body_error(&frame(Opcode::Tensors, Flags::NONE, &body)), 1);
}

#[test]
fn chunk_abuse() {
    // a continuation out of nowhere
    let mut h = Header::new(Opcode::DensePush, 1, 8);
    h.flags = Flags::CONTINUATION;
    h.message_len = 16;
    let mut b = h.to_bytes().to_vec();
    b.extend_from_slice(&[0; 8]);
    assert!(matches!(
        decode_any(&b, &Limits::default()),
        Err(FrameError::BadLength(_))
    ));
    // a first chunk claiming a 1 GiB message, then nothing: no 1 GiB buffer
    let mut h = Header::new(Opcode::DensePush, 1, 8);
    h.flags = Flags::MORE;
    h.message_len = 1 << 30;
    let mut b = h.to_bytes().to_vec();
    b.extend_from_slice(&[0; 8]);
    assert!(matches!(
        decode_any(&b, &Limits::default()),
        Err(FrameError::Truncated { .. })
    ));
}

#[test]
fn empty_and_garbage() {
    assert_eq!(decode_any(&[], &Limits::default()).unwrap().frames, 0);
    assert!(decode_any(&[0xff; 5], &Limits::default()).is_err());
    assert!(matches!(
        decode_any(&[0; HEADER_LEN], &Limits::default()),
        Err(FrameError::BadMagic(_))
    ));
}

#[test]
fn valid_stream_decodes() {
    let data = [1.0f32, 2.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect::<Vec<_>>();
    let t = [TensorRef::new(5, DType::F32, &[2], &data).unwrap()];
    let mut body = vec![0; tensors::encoded_len(&t)];
    tensors::emit(&t, &mut body);
    let mut bytes = frame(Opcode::Tensors, Flags::NONE, &body);
    bytes.extend(frame(Opcode::Ping, Flags::NONE, &[]));
    let s = decode_any(&bytes, &Limits::default()).unwrap();
    assert_eq!(s.frames, 2);
    assert_eq!(s.bodies_ok, 2);
    assert_eq!(s.elements, 2);
}
