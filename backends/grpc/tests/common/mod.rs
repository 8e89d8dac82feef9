//! Handlers shared by the gRPC tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use starwire_grpc::{Handler, HandlerError};
use starwire_wire::Opcode;

pub const RPC: u8 = Opcode::Rpc as u8;
pub const DENSE_PUSH: u8 = Opcode::DensePush as u8;

/// Echoes `Rpc`, numbers `DensePush` calls in arrival order, refuses an
/// `Rpc` payload of "bad", and serves a small embedding table.
#[derive(Debug, Default)]
pub struct TestHandler {
    pub seq: AtomicU64,
    pub rows: Mutex<HashMap<u64, Vec<f32>>>,
    pub dense: Mutex<Vec<f32>>,
}

pub const DIM: usize = 4;

impl Handler for TestHandler {
    fn handle(&self, opcode: u8, payload: &[u8]) -> Result<Vec<u8>, HandlerError> {
        match opcode {
            RPC if payload == b"bad" => Err(HandlerError::BadRequest("payload is bad".into())),
            RPC => Ok(payload.to_vec()),
            DENSE_PUSH => Ok(self
                .seq
                .fetch_add(1, Ordering::SeqCst)
                .to_le_bytes()
                .to_vec()),
            other => Err(HandlerError::UnknownOpcode(other)),
        }
    }

    fn sparse_pull(&self, var: u64, keys: &[u64]) -> Result<Vec<f32>, HandlerError> {
        if var == 99 {
            // A broken handler: rows of unequal width.
            return Ok(vec![1.0; keys.len() * DIM + 1]);
        }
        let rows = self.rows.lock().unwrap();
        let mut out = Vec::with_capacity(keys.len() * DIM);
        for k in keys {
            match rows.get(k) {
                Some(r) => out.extend_from_slice(r),
                None => out.extend_from_slice(&[0.0; DIM]),
            }
        }
        Ok(out)
    }

    fn sparse_push(
        &self,
        _var: u64,
        keys: &[u64],
        dim: usize,
        grads: &[f32],
    ) -> Result<(), HandlerError> {
        if dim != DIM {
            return Err(HandlerError::BadRequest(format!("width {dim}, want {DIM}")));
        }
        let mut rows = self.rows.lock().unwrap();
        for (k, g) in keys.iter().zip(grads.chunks_exact(DIM)) {
            let r = rows.entry(*k).or_insert_with(|| vec![0.0; DIM]);
            for (w, d) in r.iter_mut().zip(g) {
                *w -= d;
            }
        }
        Ok(())
    }

    fn dense_pull(&self, var: u64) -> Result<Vec<f32>, HandlerError> {
        if var != 0 {
            return Err(HandlerError::NotFound(format!("variable {var}")));
        }
        Ok(self.dense.lock().unwrap().clone())
    }

    fn dense_push(&self, var: u64, grads: &[f32]) -> Result<(), HandlerError> {
        if var != 0 {
            return Err(HandlerError::NotFound(format!("variable {var}")));
        }
        *self.dense.lock().unwrap() = grads.to_vec();
        Ok(())
    }
}
