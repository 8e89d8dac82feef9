//! What `starwire soak` publishes: each client reactor's message counts,
//! and with both sides in one process each server reactor's share of the
//! report's (what it found wrong with the requests), once per reactor
//! turn and once more at the end; each series adds up to the report's
//! field of the same name.

use std::sync::Arc;

use starwire_telemetry::{Counter, Telemetry};

/// A reactor's counts as they stand: a client reactor's own, or what a
/// server reactor beside its client adds to them in the report (its
/// `sent`, `answered`, `lost`, `rejected` and `refused` are 0).
#[derive(Debug, Clone, Copy, Default)]
pub struct SoakCounts {
    /// Requests sent.
    pub sent: u64,
    /// Answers received.
    pub answered: u64,
    /// Requests whose answer never came (a connection that failed, or the
    /// drain ran out).
    pub lost: u64,
    /// Answers received twice; a server's: requests.
    pub duplicated: u64,
    /// Answers whose body did not check; a server's: requests.
    pub corrupted: u64,
    /// Answers with a status other than `Ok`, but for those in `refused`
    /// (as the report's `rejected`).
    pub rejected: u64,
    /// With the server in the same process: its refusals of requests it
    /// found corrupted (`BadRequest`, no body), which it counts in its
    /// `corrupted`.
    pub refused: u64,
    /// Responses the connections dropped as matching no pending request
    /// (duplicates among them; a server's: any response it got).
    pub unmatched_responses: u64,
    /// Answers out of order; a server's: requests.
    pub out_of_order: u64,
    /// Connections that failed (as the report's `connections_failed`).
    pub connections_failed: u64,
}

/// One reactor's cells of `starwire_soak_messages_total{outcome}`, and
/// of `starwire_soak_connections_failed_total`.
#[derive(Debug)]
pub struct SoakCells {
    messages: [Arc<Counter>; 9],
    connections_failed: Arc<Counter>,
}

impl SoakCells {
    /// Cells in `t`.
    pub fn new(t: &Telemetry) -> Self {
        let c = |outcome| {
            t.counter(
                "starwire_soak_messages",
                "Soak messages by outcome (sent, answered, lost, duplicated, corrupted, rejected, refused, unmatched, out_of_order), as the report counts them: the client's, plus what a server in the same process found",
                &[("outcome", outcome)],
            )
        };
        let messages = [
            c("sent"),
            c("answered"),
            c("lost"),
            c("duplicated"),
            c("corrupted"),
            c("rejected"),
            c("refused"),
            c("unmatched"),
            c("out_of_order"),
        ];
        let connections_failed = t.counter(
            "starwire_soak_connections_failed",
            "Soak connections that failed, as the report's connections_failed: closed with an error before the soak ended (the client's, plus a server's in the same process)",
            &[],
        );
        Self {
            messages,
            connections_failed,
        }
    }

    /// Publish the reactor's counts (plain stores).
    pub fn publish(&self, c: SoakCounts) {
        let v = [
            c.sent,
            c.answered,
            c.lost,
            c.duplicated,
            c.corrupted,
            c.rejected,
            c.refused,
            c.unmatched_responses,
            c.out_of_order,
        ];
        for (cell, v) in self.messages.iter().zip(v) {
            cell.set(v);
        }
        self.connections_failed.set(c.connections_failed);
    }
}
