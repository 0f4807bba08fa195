//! The reference planner's use of seed leases (contract §6, §7), as
//! client/seeding.py: remember the whole pages this planner had the worker
//! publish; an admission whose first page is among them asks LEASE_SEED
//! first, and prefill skips the tokens the lease covers. Leases die with
//! their worker: after a restart the book starts over.
use crate::abi::SF_CLASS_SEED_PATH_INVARIANT;
use crate::connection::Connection;
use crate::events::Error;
use crate::ops::Seed;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::time::Duration;

/// Long enough to outlive a few NeedsReplan rounds before its admit.
pub const LEASE_TTL_TICKS: u32 = 16;
/// An exact_only worker checkpoints prompts this long on its own.
pub const CHECKPOINT_MIN_TOKENS: usize = 128;
const MAX_REMEMBERED: usize = 1 << 18;

pub struct SeedBook {
    page: usize,
    exact_only: bool,
    chains: HashSet<u64>, // hash chain of every whole-page prefix published
    pub leases: u64,
    pub misses: u64,
}

impl SeedBook {
    pub fn new(page: u32, exact_only: bool) -> Self {
        SeedBook { page: page.max(1) as usize, exact_only, chains: HashSet::new(), leases: 0, misses: 0 }
    }

    fn walk(&self, tokens: &[u32]) -> Vec<u64> {
        let mut h = 0u64;
        tokens.chunks_exact(self.page).map(|p| {
            let mut s = DefaultHasher::new();
            (h, p).hash(&mut s);
            h = s.finish();
            h
        }).collect()
    }

    /// The worker keeps these tokens (whole pages of them) in its cache.
    pub fn published(&mut self, tokens: &[u32]) {
        if self.chains.len() > MAX_REMEMBERED {
            self.chains.clear();
        }
        let w = self.walk(tokens);
        self.chains.extend(w);
    }

    /// An exact_only worker checkpoints a long prompt one token short.
    pub fn admitted(&mut self, prompt: &[u32]) {
        if self.exact_only && prompt.len() >= CHECKPOINT_MIN_TOKENS {
            self.published(prompt);
        }
    }

    fn may_share(&self, tokens: &[u32]) -> bool {
        tokens.len() >= self.page && self.chains.contains(&self.walk(&tokens[..self.page])[0])
    }

    /// A lease on the longest cached prefix of `tokens` (an admission's
    /// prompt, whose last `replay` tokens decode_replay feeds), or None.
    pub fn lease(&mut self, c: &mut Connection, tokens: &[u32], replay: usize, timeout: Duration)
                 -> Result<Option<Seed>, Error> {
        // exact_only: decode feeds the last token prefill reaches and the replayed
        // ones, which a seed's state holds as prefill fed them: lease short of them.
        let asked = if self.exact_only { &tokens[..tokens.len().saturating_sub(replay + 1)] } else { tokens };
        if asked.is_empty() || !self.may_share(asked) {
            return Ok(None);
        }
        let got = match c.lease_seed(asked, LEASE_TTL_TICKS, SF_CLASS_SEED_PATH_INVARIANT, timeout) {
            // A lease on more than was asked is the worker's error: do without it.
            Ok(Some(s)) if s.value as usize <= asked.len() => Some(s),
            Ok(_) | Err(Error::Op { .. }) => None, // no match, no room, or refused: prefill it all
            Err(e) => return Err(e),
        };
        match got {
            Some(_) => self.leases += 1,
            None => self.misses += 1,
        }
        Ok(got)
    }

    /// The worker restarted: its cache and leases are gone.
    pub fn forget(&mut self) {
        self.chains.clear();
    }
}
