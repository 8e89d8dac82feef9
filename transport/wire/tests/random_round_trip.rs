//! Seeded randomized round trips: random tensors, lists and chunked
//! messages encode, decode to the same values, and re-encode identically.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use starwire_wire::{
    decode_any, tensors, ChunkAssembler, ChunkPlan, DType, Flags, Frame, Header, Limits, Opcode,
    TensorList, TensorRecord, TensorRef,
};

const DTYPES: [DType; 5] = [DType::F32, DType::F16, DType::BF16, DType::I64, DType::U8];

struct Owned {
    key: u64,
    dtype: DType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

impl Owned {
    fn random(rng: &mut SmallRng) -> Self {
        let dtype = DTYPES[rng.gen_range(0..DTYPES.len())];
        let rank = rng.gen_range(0..=4);
        let dims: Vec<u64> = (0..rank).map(|_| rng.gen_range(0..5)).collect();
        let n: u64 = dims.iter().product();
        let data = (0..n as usize * dtype.size()).map(|_| rng.gen()).collect();
        Self {
            key: rng.gen(),
            dtype,
            dims,
            data,
        }
    }
    fn as_ref(&self) -> TensorRef<'_> {
        TensorRef::new(self.key, self.dtype, &self.dims, &self.data).unwrap()
    }
}

#[test]
fn random_lists_round_trip() {
    let mut rng = SmallRng::seed_from_u64(0xfeed);
    for _ in 0..500 {
        let owned: Vec<Owned> = (0..rng.gen_range(0..6))
            .map(|_| Owned::random(&mut rng))
            .collect();
        let refs: Vec<TensorRef<'_>> = owned.iter().map(Owned::as_ref).collect();
        let len = tensors::encoded_len(&refs);
        assert_eq!(len % 8, 0);
        let mut body = vec![0u8; len];
        assert_eq!(tensors::emit(&refs, &mut body), len);
        let list = TensorList::parse(&body).unwrap();
        assert_eq!(list.len(), owned.len());
        for (v, o) in list.iter().zip(&owned) {
            assert_eq!(v.key(), o.key);
            assert_eq!(v.dtype(), o.dtype);
            assert_eq!(v.dims().iter().collect::<Vec<_>>(), o.dims);
            assert_eq!(v.data(), &o.data[..]);
            assert_eq!(v.num_elements() as usize * o.dtype.size(), o.data.len());
            if o.dtype == DType::I64 {
                let want: Vec<i64> = o
                    .data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                assert_eq!(v.i64s().unwrap().collect::<Vec<_>>(), want);
            }
            if o.dtype == DType::F32 {
                let want: Vec<u32> = o
                    .data
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let got: Vec<u32> = v.f32s().unwrap().map(f32::to_bits).collect();
                assert_eq!(got, want);
            }
        }
        // views re-encode byte-identically
        let views: Vec<_> = list.iter().collect();
        let mut again = vec![0u8; tensors::encoded_len(&views)];
        tensors::emit(&views, &mut again);
        assert_eq!(again, body);
        // and through the trait, each record's rank is its dims'.
        for (v, o) in views.iter().zip(&owned) {
            assert_eq!(TensorRecord::rank(v), o.dims.len());
        }
    }
}

#[test]
fn random_chunked_messages_round_trip() {
    let mut rng = SmallRng::seed_from_u64(7);
    for _ in 0..200 {
        let owned: Vec<Owned> = (0..rng.gen_range(1..5))
            .map(|_| Owned::random(&mut rng))
            .collect();
        let refs: Vec<TensorRef<'_>> = owned.iter().map(Owned::as_ref).collect();
        let mut body = vec![0u8; tensors::encoded_len(&refs)];
        tensors::emit(&refs, &mut body);
        let max_body = rng.gen_range(1..200);
        let mut t = Header::new(Opcode::Tensors, rng.gen(), 0);
        t.flags = Flags::ONEWAY;
        let mut stream = Vec::new();
        let mut asm = ChunkAssembler::new();
        let mut rebuilt = Vec::new();
        for (h, r) in ChunkPlan::new(t, body.len() as u32, max_body) {
            let f = Frame::new(h, &body[r]).unwrap();
            let at = stream.len();
            stream.resize(at + f.frame_len(), 0);
            f.emit(&mut stream[at..]);
            let (p, _) = Frame::parse(&stream[at..], &Limits::new(max_body, 1 << 20)).unwrap();
            asm.accept(&p.header).unwrap();
            rebuilt.extend_from_slice(p.body);
        }
        assert!(!asm.in_progress());
        assert_eq!(rebuilt, body);
        let s = decode_any(&stream, &Limits::new(max_body, 1 << 20)).unwrap();
        assert_eq!(s.messages, 1);
        assert_eq!(s.bodies_ok, 1, "max_body {max_body}");
    }
}
