//! The token ring of the dynamic-delay cyclic update: the token word every rank holds,
//! its passing, and naming the rank that stalls it.

use super::{word, RemoteMemory, HOLDERS_AT, TOKEN_AT};
use crate::error::{invalid, Error, Result};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl RemoteMemory {
    /// Whether the token is here now (never blocks).
    pub fn has_token(&self) -> bool {
        word(self.win.local(), TOKEN_AT).load(Ordering::Acquire) > self.taken
    }

    /// Takes the token that has arrived (see [`RemoteMemory::has_token`]), checking through
    /// rank 0's holder count that nobody else holds it.
    pub fn take_token(&mut self) -> Result<()> {
        if !self.has_token() {
            return Err(invalid("take_token: the token is not here"));
        }
        self.taken += 1;
        let others = self.win.fetch_add(0, HOLDERS_AT, 1)?;
        if others != 0 {
            return Err(Error::Protocol(format!("rank {}: token duplicated: {others} other holder(s) at the same time", self.rank)));
        }
        Ok(())
    }

    /// Passes the token to the next rank of the ring.
    pub fn pass_token(&self) -> Result<()> {
        self.win.fetch_add(0, HOLDERS_AT, u64::MAX)?;
        self.win.fetch_add((self.rank + 1) % self.world, TOKEN_AT, 1)?;
        Ok(())
    }

    /// Whether the token is here (the dynamic-delay schedule, which never waits for it);
    /// fails when it has not moved anywhere in the ring for the deadline (its holder died,
    /// stopped, or did not take its turn for that long), naming the holder. Counts the
    /// passes at most every 1/8 deadline.
    pub fn poll_token(&mut self) -> Result<bool> {
        if self.has_token() {
            return Ok(true);
        }
        let now = Instant::now();
        if now.duration_since(self.token_counted) < (self.timeout / 8).max(Duration::from_millis(10)) {
            return Ok(false);
        }
        self.token_counted = now;
        let passes = (0..self.world).try_fold(0u64, |sum, r| self.read_word(r, TOKEN_AT).map(|c| sum.wrapping_add(c)));
        let passes = self.noted(passes)?;
        if passes != self.token_moves.0 {
            self.token_moves = (passes, now);
        } else if now.duration_since(self.token_moves.1) > self.timeout {
            return self.noted(Err(self.diagnose_token(now.duration_since(self.token_moves.1))));
        }
        Ok(false)
    }

    /// Waits until the token arrives (fixed cyclic schedule). On the deadline, names the
    /// rank that holds it — the last in ring order to have received it — and whether that
    /// process is gone; a peer on this host that dies meanwhile is noticed within 20 ms
    /// (one behind a network, when a one-sided operation to it fails).
    pub fn wait_token(&self) -> Result<()> {
        let start = Instant::now();
        while !self.has_token() {
            if start.elapsed() > self.timeout {
                return self.noted(Err(self.diagnose_token(start.elapsed())));
            }
            let alive = (0..self.world).try_for_each(|p| self.win.alive(p, "token ring: waiting for the token"));
            self.noted(alive)?;
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Who holds the token that never came. Token counts rise along the ring, so the holder
    /// follows the highest-numbered rank with the largest count; ranks that cannot be read
    /// any more (dead, or exited after failing themselves) are skipped, so that a late
    /// survivor still names the rank that died holding the token, not one that exited
    /// because of it.
    fn diagnose_token(&self, waited: Duration) -> Error {
        let counts: Vec<Option<u64>> = (0..self.world).map(|r| self.read_word(r, TOKEN_AT).ok()).collect();
        let max = counts.iter().flatten().copied().max().unwrap_or(0);
        let last_max = (0..self.world).rev().find(|&r| counts[r] == Some(max)).unwrap_or(0);
        let next = (last_max + 1) % self.world;
        let what = "token ring: waiting for the token";
        if counts[next].is_none() {
            // It may have exited after failing itself: then `noted` adds its reason.
            Error::PeerLost { rank: self.rank, peer: next, op: what.into(), cause: "it received the token last and cannot be reached".into() }
        } else {
            self.gone(last_max, &format!("{what}, last received by rank {last_max}"), waited)
        }
    }

    /// Rank 0's count of current token holders (0 or 1 when all is well).
    pub fn holders(&self) -> Result<u64> {
        self.read_word(0, HOLDERS_AT)
    }
}
