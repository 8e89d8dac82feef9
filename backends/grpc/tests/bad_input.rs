//! Bad input to the gRPC baseline: malformed protobuf on the raw method
//! path, an oversized message, unknown opcodes, inconsistent pull/push
//! messages and handler refusals all come back as typed errors, and the
//! server keeps serving.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};
use common::{TestHandler, RPC};
use prost::Message;
use starwire_grpc::proto::CallRequest;
use starwire_grpc::{GrpcClient, GrpcConfig, GrpcError, GrpcServer, CALL_PATH};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::{Code, Status};

/// Sends and receives message bytes as they are: lets a test put any bytes
/// on a method path.
#[derive(Debug, Default)]
struct RawCodec;
#[derive(Debug)]
struct RawEnc;
#[derive(Debug)]
struct RawDec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawEnc;
    type Decoder = RawDec;
    fn encoder(&mut self) -> RawEnc {
        RawEnc
    }
    fn decoder(&mut self) -> RawDec {
        RawDec
    }
}

impl Encoder for RawEnc {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDec {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n)))
    }
}

fn start(cfg: &GrpcConfig) -> GrpcServer {
    GrpcServer::start_with(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        Arc::new(TestHandler::default()),
        cfg,
    )
    .unwrap()
}

/// One call with `body` as the message bytes on the `Call` path.
fn raw_call(addr: SocketAddr, body: Bytes) -> Result<Bytes, Status> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut g = tonic::client::Grpc::new(ch);
        g.ready().await.unwrap();
        g.unary(
            tonic::Request::new(body),
            PathAndQuery::from_static(CALL_PATH),
            RawCodec,
        )
        .await
        .map(tonic::Response::into_inner)
    })
}

fn still_serves(c: &GrpcClient) {
    let p = Bytes::from_static(b"still here");
    assert_eq!(c.call(RPC, p.clone()).unwrap(), p);
}

#[test]
fn raw_path_accepts_a_wellformed_message() {
    // The raw path itself works: a correctly encoded CallRequest echoes.
    let s = start(&GrpcConfig::default());
    let req = CallRequest {
        opcode: u32::from(RPC),
        payload: Bytes::from_static(b"abc"),
    };
    let reply = raw_call(s.local_addr(), req.encode_to_vec().into()).unwrap();
    let reply = starwire_grpc::proto::CallReply::decode(reply).unwrap();
    assert_eq!(&reply.payload[..], b"abc");
    s.shutdown();
}

#[test]
fn malformed_protobuf_is_refused_and_server_keeps_serving() {
    let s = start(&GrpcConfig::default());
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    let cases: [&[u8]; 4] = [
        // Field 2 (bytes) claiming 268 MB, with nothing after it.
        &[0x12, 0xff, 0xff, 0xff, 0x7f],
        // A varint that never ends.
        &[
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        ],
        // Wire type 7 does not exist.
        &[0x0f, 0x00],
        // Field 1 (varint) given as a length-delimited field, truncated.
        &[0x0a, 0x05, 0x01],
    ];
    for body in cases {
        let e = raw_call(s.local_addr(), Bytes::from_static(body)).unwrap_err();
        assert_eq!(e.code(), Code::Internal, "{body:?}: {e}");
        still_serves(&c);
    }
    s.shutdown();
}

#[test]
fn opcode_over_a_byte_is_invalid_argument() {
    let s = start(&GrpcConfig::default());
    let req = CallRequest {
        opcode: 0x1_10,
        payload: Bytes::new(),
    };
    let e = raw_call(s.local_addr(), req.encode_to_vec().into()).unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    s.shutdown();
}

#[test]
fn oversized_message_is_refused_and_server_keeps_serving() {
    let s = start(&GrpcConfig {
        max_message_len: 1 << 20,
        ..GrpcConfig::default()
    });
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    let e = c.call(RPC, Bytes::from(vec![7u8; 2 << 20])).unwrap_err();
    assert!(
        matches!(e.code(), Some(Code::OutOfRange | Code::ResourceExhausted)),
        "{e}"
    );
    still_serves(&c);
    // And the client refuses to send past its own limit.
    let small = GrpcClient::connect_with(
        s.local_addr(),
        &GrpcConfig {
            max_message_len: 1024,
            ..GrpcConfig::default()
        },
    )
    .unwrap();
    let e = small.call(RPC, Bytes::from(vec![1u8; 4096])).unwrap_err();
    assert!(matches!(e, GrpcError::TooLarge { max: 1024, .. }), "{e}");
    still_serves(&small);
    s.shutdown();
}

#[test]
fn unknown_and_control_opcodes_are_unimplemented() {
    let s = start(&GrpcConfig::default());
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    // 0xEE is no opcode; 0x01 (Hello) belongs to the connection core; 0x11
    // (Tensors) is known but this handler refuses it.
    for op in [0xEEu8, 0x01, 0x11] {
        let e = c.call(op, Bytes::new()).unwrap_err();
        assert_eq!(e.code(), Some(Code::Unimplemented), "{op:#x}: {e}");
        still_serves(&c);
    }
    s.shutdown();
}

#[test]
fn handler_refusals_become_statuses() {
    let s = start(&GrpcConfig::default());
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    let e = c.call(RPC, Bytes::from_static(b"bad")).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    let e = c.dense_pull(5).unwrap_err();
    assert_eq!(e.code(), Some(Code::NotFound), "{e}");
    assert_eq!(e.wire_status(), None);
    still_serves(&c);
    s.shutdown();
}

/// A handler's own message-layer status reaches the client as itself, with
/// the nearest gRPC code.
#[test]
fn a_wire_status_reaches_the_client() {
    use starwire_grpc::{Handler, HandlerError};
    use starwire_wire::Status as W;
    #[derive(Debug)]
    struct Refuses;
    impl Handler for Refuses {
        fn handle(&self, _: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError> {
            let status = match payload {
                b"overloaded" => W::Overloaded,
                b"nonfinite" => W::NonFinite,
                _ => W::Other(77),
            };
            Err(HandlerError::Wire {
                status,
                message: "refused".into(),
            })
        }
    }
    let s = GrpcServer::start(
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        Arc::new(Refuses),
    )
    .unwrap();
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    for (p, wire, code) in [
        (&b"overloaded"[..], W::Overloaded, Code::ResourceExhausted),
        (b"nonfinite", W::NonFinite, Code::InvalidArgument),
        (b"other", W::Other(77), Code::Internal),
    ] {
        let e = c.call(RPC, Bytes::from_static(p)).unwrap_err();
        assert_eq!(e.wire_status(), Some(wire), "{e}");
        assert_eq!(e.code(), Some(code), "{e}");
    }
    s.shutdown();
}

#[test]
fn inconsistent_pull_push_messages_are_refused() {
    let s = start(&GrpcConfig::default());
    let c = GrpcClient::connect(s.local_addr()).unwrap();
    // 5 gradient values for 2 keys of width 4.
    let e = c.sparse_push(1, vec![1, 2], 4, vec![0.0; 5]).unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    // Width overflowing keys * dim.
    let e = c
        .sparse_push(1, vec![1, 2, 3], u32::MAX as usize, vec![])
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    // A handler answering rows of unequal width: Internal, not a panic.
    let e = c.sparse_pull(99, vec![1, 2]).unwrap_err();
    assert_eq!(e.code(), Some(Code::Internal), "{e}");
    still_serves(&c);
    s.shutdown();
}
