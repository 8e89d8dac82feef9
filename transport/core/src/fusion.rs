//! Send/Recv fusion: the tensors one step sends to one destination travel
//! as one message.
//!
//! DeepRec's `tensor_fuse` batches the many small tensors a training step
//! sends to a parameter server (one per feature column) into a single
//! request, because per-message costs (a syscall, a doorbell, a header, a
//! response) dominate at those sizes. [`FusionBatcher`] keeps one batch per
//! destination; [`FusionBatcher::finish_step`] turns each batch into
//! `Tensors` message bodies (a [`starwire_wire::tensors`] list), splitting a
//! batch that would exceed [`FusionConfig::max_fused_bytes`], and hands them
//! out in the order the tensors were added, so per-connection order is kept.
//! With fusion off every tensor becomes its own message, on the same path.
//!
//! Small tensors are copied into the fused body (one contiguous segment);
//! tensors of [`FusionConfig::copy_below`] bytes or more are referenced as
//! their own `Bytes` segment, which a vectored-write backend sends without a
//! copy.

use bytes::{Bytes, BytesMut};
use starwire_wire::tensor::{DType, TensorRef, ZERO_PAD};
use starwire_wire::tensors::LIST_HEAD_LEN;
use starwire_wire::FrameError;

use crate::connection::Payload;

/// Fusion settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusionConfig {
    /// Fuse (DeepRec's `tensor_fuse`); when false, one message per tensor.
    pub enabled: bool,
    /// Start a new message when a fused body would grow past this.
    pub max_fused_bytes: usize,
    /// Tensors at least this long are sent as their own segment, uncopied.
    pub copy_below: usize,
}

impl Default for FusionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_fused_bytes: 4 << 20,
            copy_below: 4096,
        }
    }
}

/// An owned tensor waiting to be sent.
///
/// Only [`OutTensor::new`] makes one, so every tensor handed to
/// [`FusionBatcher::add`] has data matching its type and dimensions (the
/// encoder relies on it). A struct literal does not compile:
///
/// ```compile_fail,E0451
/// use starwire_transport::fusion::OutTensor;
/// use starwire_wire::tensor::DType;
/// let t = OutTensor {
///     key: 1,
///     dtype: DType::F32,
///     dims: vec![4],
///     data: Default::default(),
/// };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutTensor {
    /// Rendezvous key (which tensor this is, agreed by both ends).
    key: u64,
    /// Element type.
    dtype: DType,
    /// Dimensions.
    dims: Vec<u64>,
    /// Little-endian element bytes.
    data: Bytes,
}

impl OutTensor {
    /// A checked tensor.
    pub fn new(key: u64, dtype: DType, dims: Vec<u64>, data: Bytes) -> Result<Self, FrameError> {
        TensorRef::new(key, dtype, &dims, &data)?;
        Ok(Self {
            key,
            dtype,
            dims,
            data,
        })
    }

    /// Rendezvous key (which tensor this is, agreed by both ends).
    pub fn key(&self) -> u64 {
        self.key
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Dimensions.
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// Little-endian element bytes.
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    fn as_ref(&self) -> TensorRef<'_> {
        TensorRef {
            key: self.key,
            dtype: self.dtype,
            dims: &self.dims,
            data: &self.data,
        }
    }

    fn encoded_len(&self) -> usize {
        self.as_ref().encoded_len()
    }
}

/// Builds one `Tensors` body out of copied and referenced segments.
#[derive(Debug)]
struct BodyBuilder {
    /// Finished segments (copied runs and referenced large tensors).
    body: Payload,
    /// The run of copied bytes being written; reused across steps, so a
    /// steady-state step allocates nothing here.
    inline: BytesMut,
    count: u32,
}

impl BodyBuilder {
    fn new() -> Self {
        Self {
            body: Payload::empty(),
            inline: BytesMut::new(),
            count: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Encoded length of the body so far, list head included.
    fn len(&self) -> usize {
        LIST_HEAD_LEN + self.body.len() + self.inline.len()
    }

    fn push(&mut self, t: &OutTensor, copy_below: usize, hint: usize) {
        let r = t.as_ref();
        if self.inline.capacity() - self.inline.len() < r.header_len() + 8 {
            self.inline.reserve(hint.max(r.header_len() + 8));
        }
        let head_at = self.inline.len();
        self.inline.resize(head_at + r.header_len(), 0);
        r.emit_header(&mut self.inline[head_at..]);
        if t.data.len() < copy_below {
            self.inline.extend_from_slice(&t.data);
        } else {
            let run = self.inline.split().freeze();
            self.body.push(run);
            self.body.push(t.data.clone());
        }
        self.inline.extend_from_slice(&ZERO_PAD[..r.padding_len()]);
        self.count += 1;
    }

    /// Finish the body and reset for the next one, keeping the buffer.
    fn take(&mut self) -> (Payload, u32) {
        // The list head is its own small segment, written once the count is
        // known, so no segment is copied to patch it.
        let mut head = [0u8; LIST_HEAD_LEN];
        head[0..4].copy_from_slice(&self.count.to_le_bytes());
        let mut body = Payload::from_bytes(Bytes::copy_from_slice(&head));
        body.append(std::mem::take(&mut self.body));
        body.push(self.inline.split().freeze());
        let n = self.count;
        self.count = 0;
        (body, n)
    }
}

#[derive(Debug)]
struct Destination {
    open: BodyBuilder,
    /// Bodies closed during this step (split above the threshold, or one
    /// per tensor with fusion off), in order. Non-empty only while `open`
    /// is, since every `add` lands in `open`.
    closed: Vec<(Payload, u32)>,
    /// The largest body seen so far (capped at the split threshold): how
    /// much to reserve when the copy buffer runs out.
    hint: usize,
}

/// Per-destination batches of one step. See the module documentation.
///
/// Tensors are encoded as they are added, into a buffer reused from step
/// to step; nothing is cloned but the `Bytes` handle of a large tensor.
#[derive(Debug)]
pub struct FusionBatcher {
    cfg: FusionConfig,
    dests: Vec<Destination>,
}

impl FusionBatcher {
    /// A batcher for `destinations` peers.
    pub fn new(cfg: FusionConfig, destinations: usize) -> Self {
        Self {
            cfg,
            dests: (0..destinations)
                .map(|_| Destination {
                    open: BodyBuilder::new(),
                    closed: Vec::new(),
                    hint: 4096,
                })
                .collect(),
        }
    }

    /// The settings.
    pub fn config(&self) -> FusionConfig {
        self.cfg
    }

    /// Queue `t` for destination `dest` in this step.
    ///
    /// # Panics
    /// If `dest` is not below the number of destinations.
    pub fn add(&mut self, dest: usize, t: &OutTensor) {
        let cfg = self.cfg;
        let d = &mut self.dests[dest];
        let grow = t.encoded_len();
        if !d.open.is_empty() && (!cfg.enabled || d.open.len() + grow > cfg.max_fused_bytes) {
            let body = d.open.take();
            d.closed.push(body);
        }
        d.open.push(t, cfg.copy_below, d.hint);
    }

    /// Tensors waiting for destination `dest`.
    pub fn pending(&self, dest: usize) -> usize {
        let d = &self.dests[dest];
        let closed: usize = d.closed.iter().map(|(_, n)| *n as usize).sum();
        closed + d.open.count as usize
    }

    /// End the step: emit the message bodies for every destination, in the
    /// order the tensors were added, as `(destination, body, tensor count)`.
    pub fn finish_step(&mut self, emit: &mut dyn FnMut(usize, Payload, u32)) {
        for (i, d) in self.dests.iter_mut().enumerate() {
            if d.open.is_empty() {
                continue;
            }
            for (body, n) in d.closed.drain(..) {
                emit(i, body, n);
            }
            let (body, n) = d.open.take();
            d.hint = d.hint.max(body.len().min(self.cfg.max_fused_bytes));
            emit(i, body, n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use starwire_wire::tensors::TensorList;

    fn flat(body: &Payload) -> Vec<u8> {
        body.segments()
            .iter()
            .flat_map(|s| s.iter().copied())
            .collect()
    }

    fn tensor(key: u64, n: usize) -> OutTensor {
        let data: Vec<u8> = (0..n * 4).map(|i| (i as u64 * 7 + key) as u8).collect();
        OutTensor::new(key, DType::F32, vec![n as u64], Bytes::from(data)).expect("valid")
    }

    #[test]
    fn fuses_one_step_into_one_message_per_destination() {
        let mut f = FusionBatcher::new(FusionConfig::default(), 2);
        for k in 0..100 {
            f.add((k % 2) as usize, &tensor(k, 16));
        }
        assert_eq!((f.pending(0), f.pending(1)), (50, 50));
        let mut out = Vec::new();
        f.finish_step(&mut |d, b, n| out.push((d, b, n)));
        assert_eq!(out.len(), 2);
        for (d, body, n) in &out {
            assert_eq!(*n, 50);
            let bytes = flat(body);
            let list = TensorList::parse(&bytes).expect("decodes");
            let keys: Vec<u64> = list.iter().map(|t| t.key()).collect();
            let want: Vec<u64> = (0..100).filter(|k| (k % 2) as usize == *d).collect();
            assert_eq!(keys, want, "order kept");
            for t in list.iter() {
                assert_eq!(t.data(), &tensor(t.key(), 16).data[..]);
            }
        }
        assert_eq!(f.pending(0), 0);
    }

    #[test]
    fn unfused_is_one_message_per_tensor() {
        let cfg = FusionConfig {
            enabled: false,
            ..FusionConfig::default()
        };
        let mut f = FusionBatcher::new(cfg, 1);
        for k in 0..10 {
            f.add(0, &tensor(k, 3));
        }
        let mut keys = Vec::new();
        f.finish_step(&mut |_, b, n| {
            assert_eq!(n, 1);
            let bytes = flat(&b);
            let list = TensorList::parse(&bytes).expect("decodes");
            keys.extend(list.iter().map(|t| t.key()));
        });
        assert_eq!(keys, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn splits_above_threshold_and_keeps_large_tensors_uncopied() {
        let cfg = FusionConfig {
            enabled: true,
            max_fused_bytes: 10_000,
            copy_below: 1024,
        };
        let mut f = FusionBatcher::new(cfg, 1);
        let big = tensor(1, 2000); // 8000 bytes, referenced
        let big_ptr = big.data.as_ptr();
        f.add(0, &tensor(0, 10));
        f.add(0, &big);
        f.add(0, &tensor(2, 1000)); // would exceed 10 000: next message
        f.add(0, &tensor(3, 10));
        assert_eq!(f.pending(0), 4, "closed and open tensors both count");
        let mut msgs = Vec::new();
        f.finish_step(&mut |_, b, n| msgs.push((b, n)));
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].1, 2);
        assert_eq!(msgs[1].1, 2);
        assert!(
            msgs[0].0.segments().iter().any(|s| s.as_ptr() == big_ptr),
            "large tensor was copied"
        );
        let mut keys = Vec::new();
        for (b, _) in &msgs {
            assert!(b.len() <= 10_000);
            let bytes = flat(b);
            keys.extend(
                TensorList::parse(&bytes)
                    .expect("decodes")
                    .iter()
                    .map(|t| t.key()),
            );
        }
        assert_eq!(keys, vec![0, 1, 2, 3]);
    }

    #[test]
    fn steps_reuse_the_buffer_without_disturbing_earlier_bodies() {
        let mut f = FusionBatcher::new(FusionConfig::default(), 1);
        let mut kept = Vec::new();
        for step in 0..5u64 {
            for k in 0..50 {
                f.add(0, &tensor(step * 100 + k, 8));
            }
            f.finish_step(&mut |_, b, n| {
                assert_eq!(n, 50);
                kept.push((step, b));
            });
        }
        for (step, body) in &kept {
            let bytes = flat(body);
            let list = TensorList::parse(&bytes).expect("decodes");
            let keys: Vec<u64> = list.iter().map(|t| t.key()).collect();
            assert_eq!(keys, (0..50).map(|k| step * 100 + k).collect::<Vec<_>>());
            for t in list.iter() {
                assert_eq!(t.data(), &tensor(t.key(), 8).data[..]);
            }
        }
    }
}
