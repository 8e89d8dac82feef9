//! The handshake of a [`Connection`]: the peer's `Hello`, then each
//! side's `Auth` (the cluster token proved both ways, the training flags
//! compared). See [`crate::auth`] and docs/SECURITY.md.

use starwire_wire::message::{AuthMsg, Hello, Role, HELLO_FLAG_AUTH, PROOF_LEN};
use starwire_wire::{Header, Opcode, HEADER_LEN};

use super::{
    ConnError, Connection, Event, Payload, PeerHello, PeerInfo, TaskRole, PROTOCOL_VERSION,
};
use crate::auth::{self, Nonce, Side};

impl Connection {
    pub(super) fn handle_hello(&mut self, body: &[u8]) -> Result<(), ConnError> {
        if self.peer.is_some() || self.peer_hello.is_some() {
            return Err(self.fatal(ConnError::Protocol("second handshake")));
        }
        let hello = match Hello::parse(body) {
            Ok(h) => h,
            Err(e) => return Err(self.fatal(ConnError::Handshake(e.to_string()))),
        };
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(self.fatal(ConnError::Handshake(format!(
                "peer speaks protocol version {}, this build speaks {}",
                hello.protocol_version, PROTOCOL_VERSION
            ))));
        }
        if (hello.max_frame_len as usize) < HEADER_LEN + 64 {
            return Err(self.fatal(ConnError::Handshake(format!(
                "peer's maximum frame of {} bytes is too small",
                hello.max_frame_len
            ))));
        }
        if let Some(n) = self.cfg.workers {
            if hello.role == Role::Worker && hello.task_index >= n {
                return Err(self.fatal(ConnError::Handshake(format!(
                    "the peer says it is worker {}, but the cluster has {n} workers \
                     (task indices 0 to {})",
                    hello.task_index,
                    n.saturating_sub(1)
                ))));
            }
        }
        let peer_auth = hello.flags & HELLO_FLAG_AUTH != 0;
        match (self.cfg.token.is_some(), peer_auth) {
            (true, false) => {
                return Err(self.fatal(ConnError::Unauthenticated("the peer has no cluster token")))
            }
            (false, true) => {
                return Err(self.fatal(ConnError::Handshake(
                    "the peer requires a cluster token and this end has none \
                     (set STARWIRE_CLUSTER_TOKEN or --token-file)"
                        .into(),
                )))
            }
            _ => {}
        }
        // Control frames are never chunked: this end's `Auth` (its flags
        // included) must fit the peer's frame, or the peer would refuse it
        // as a chunked control frame.
        let auth_len = AuthMsg {
            proof: [0; PROOF_LEN],
            config: &self.cfg.flags,
        }
        .encoded_len();
        if HEADER_LEN + auth_len > hello.max_frame_len as usize {
            return Err(self.fatal(ConnError::Handshake(format!(
                "peer's maximum frame of {} bytes cannot carry this end's handshake \
                 ({} bytes with its training flags)",
                hello.max_frame_len,
                HEADER_LEN + auth_len
            ))));
        }
        self.max_frame_len = self.max_frame_len.min(hello.max_frame_len as usize);
        self.send_credit = self.send_credit.saturating_add(hello.initial_credits);
        self.peer_hello = Some(PeerHello {
            info: PeerInfo {
                role: match hello.role {
                    Role::Ps => TaskRole::Ps,
                    Role::Worker => TaskRole::Worker,
                },
                job: hello.job_name.to_owned(),
                task_index: hello.task_index,
                incarnation: hello.incarnation,
                shards: hello.shard_count,
            },
            nonce: hello.nonce,
        });
        // An acceptor with a token proves it only to a peer that proved it
        // first (see `crate::auth`).
        if self.cfg.side == Side::Dialer || self.cfg.token.is_none() {
            self.queue_auth(&hello.nonce);
        }
        Ok(())
    }

    /// The peer's proof and flags: check them and complete the handshake.
    pub(super) fn handle_auth(&mut self, body: &[u8]) -> Result<(), ConnError> {
        if self.peer.is_some() {
            return Err(self.fatal(ConnError::Protocol("second handshake")));
        }
        let Some(hello) = self.peer_hello.take() else {
            return Err(self.fatal(ConnError::Protocol("handshake proof before the hello")));
        };
        let msg = match AuthMsg::parse(body) {
            Ok(m) => m,
            Err(e) => return Err(self.fatal(ConnError::Handshake(e.to_string()))),
        };
        if let Some(t) = &self.cfg.token {
            let ok = t.verify(
                self.cfg.side.peer(),
                &hello.nonce,
                &self.nonce,
                msg.config,
                &msg.proof,
            );
            if !ok {
                return Err(self.fatal(ConnError::Unauthenticated(
                    "its proof does not match this end's cluster token",
                )));
            }
        }
        if !self.cfg.flags.is_empty() && !msg.config.is_empty() {
            let differ = auth::flags_differ(&self.cfg.flags, msg.config);
            if !differ.is_empty() {
                let e = ConnError::FlagsDiffer(differ.join(", "));
                if self.sent_auth {
                    return Err(self.fatal(e));
                }
                // An acceptor that held its proof back: the peer proved
                // the token, so it gets ours and our flags, to name the
                // ones that differ too, then a goodbye.
                self.queue_auth(&hello.nonce);
                self.close();
                self.error = Some(e);
                return Ok(());
            }
        }
        if !self.sent_auth {
            self.queue_auth(&hello.nonce);
        }
        self.complete(hello.info)
    }

    /// Queue this end's `Auth` for the peer's `Hello`, whose nonce is
    /// `peer_nonce`.
    fn queue_auth(&mut self, peer_nonce: &Nonce) {
        let proof = match &self.cfg.token {
            Some(t) => t.proof(self.cfg.side, &self.nonce, peer_nonce, &self.cfg.flags),
            None => [0u8; PROOF_LEN],
        };
        let msg = AuthMsg {
            proof,
            config: &self.cfg.flags,
        };
        // Flags too long to send are sent as none (nothing to compare);
        // the configurations that fill them stay far below the bound.
        let body = msg.to_vec().unwrap_or_else(|e| {
            tracing::warn!("training flags not compared: {e}");
            AuthMsg { proof, config: "" }.to_vec().unwrap_or_default()
        });
        self.push_control(Header::new(Opcode::Auth, 0, 0), Payload::from(body));
        self.sent_auth = true;
    }

    /// The handshake completed with `peer`.
    fn complete(&mut self, peer: PeerInfo) -> Result<(), ConnError> {
        if let Some(previous) = self.cfg.known_peer_incarnation {
            if previous != peer.incarnation {
                self.events.push_back(Event::PeerRestarted {
                    previous,
                    peer: peer.clone(),
                });
            }
        }
        self.events.push_back(Event::Connected(peer.clone()));
        self.peer = Some(peer);
        Ok(())
    }
}
