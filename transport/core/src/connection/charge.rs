//! What a [`Connection`] charges to its [`MemoryBudget`]: the bytes of
//! each queued message and of the chunked message being reassembled, given
//! back once sent, delivered or dropped.

use crate::budget::MemoryBudget;

use super::Connection;

impl Connection {
    /// Charge `n` bytes to the budget, if there is one.
    pub(super) fn charge(&mut self, n: usize) -> bool {
        charge(&self.cfg.budget, &mut self.charged, n)
    }

    /// Give back `n` bytes charged before.
    pub(super) fn release(&mut self, n: usize) {
        if let (true, Some(b)) = (n > 0, &self.cfg.budget) {
            b.release(n);
            self.charged -= n;
        }
    }

    /// Empty the send queue, releasing what it held.
    pub(super) fn drop_queue(&mut self) {
        let n: usize = self.queue.drain(..).map(|o| o.charged).sum();
        self.release(n);
    }
}

impl Drop for Connection {
    /// Whatever the connection still holds goes back to the budget.
    fn drop(&mut self) {
        if let Some(b) = &self.cfg.budget {
            b.release(self.charged);
        }
    }
}

/// Charge `n` bytes to `budget`, if there is one, counting them in
/// `charged`.
pub(super) fn charge(budget: &Option<MemoryBudget>, charged: &mut usize, n: usize) -> bool {
    if n == 0 {
        return true;
    }
    match budget {
        Some(b) if !b.try_charge(n) => false,
        Some(_) => {
            *charged += n;
            true
        }
        None => true,
    }
}
