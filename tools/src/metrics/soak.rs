//! What `starwire soak` publishes: each client reactor's message counts,
//! once per reactor turn.

use std::sync::Arc;

use starwire_telemetry::{Counter, Telemetry};

/// A client reactor's counts as they stand.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoakCounts {
    /// Requests sent.
    pub sent: u64,
    /// Answers received.
    pub answered: u64,
    /// Requests whose answer never came (a connection that failed).
    pub lost: u64,
    /// Answers received twice.
    pub duplicated: u64,
    /// Answers whose body did not check.
    pub corrupted: u64,
    /// Answers with a status other than `Ok`, but for those in `refused`
    /// (as the report's `rejected`).
    pub rejected: u64,
    /// With the server in the same process: its refusals of requests it
    /// found corrupted (`BadRequest`, no body), which it counts in its
    /// `corrupted`.
    pub refused: u64,
    /// Responses the connections dropped as matching no pending request
    /// (duplicates among them).
    pub unmatched_responses: u64,
    /// Answers out of order.
    pub out_of_order: u64,
}

/// One client reactor's cells of `starwire_soak_messages_total{outcome}`.
#[derive(Debug)]
pub struct SoakCells([Arc<Counter>; 9]);

impl SoakCells {
    /// Cells in `t`.
    pub fn new(t: &Telemetry) -> Self {
        let c = |outcome| {
            t.counter(
                "starwire_soak_messages",
                "Soak messages by outcome (sent, answered, lost, duplicated, corrupted, rejected, refused, unmatched, out_of_order)",
                &[("outcome", outcome)],
            )
        };
        Self([
            c("sent"),
            c("answered"),
            c("lost"),
            c("duplicated"),
            c("corrupted"),
            c("rejected"),
            c("refused"),
            c("unmatched"),
            c("out_of_order"),
        ])
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
        for (cell, v) in self.0.iter().zip(v) {
            cell.set(v);
        }
    }
}
