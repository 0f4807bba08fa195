//! The reference planner's speculation strategy (contract §7 INSTALL_STRATEGY,
//! §4 overshoot), as client/strategies.py: a strategy lives in a slot of the
//! worker; admits that name the slot may draft (the worker decides which
//! lanes do: not HOST, grammar, logit-bias or logprob lanes). Drafting never
//! changes a lane's tokens, so the planner treats a drafting lane as any
//! other, but grants it `overshoot`: verified tokens past the tick's grant,
//! up to what the request has left. The slot dies with its worker: after a
//! restart the book forgets it and installs it again at the next admission.
use crate::connection::Connection;
use crate::events::Error;
use serde::Serialize;
use std::time::Duration;

/// Prompt lookup: draft up to `max_draft` tokens that followed the latest
/// earlier occurrence of the lane's last n tokens (ngram_max down to ngram_min).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Strategy {
    pub slot: u32,
    pub kind: String,
    pub max_draft: u32,
    pub ngram_min: u32,
    pub ngram_max: u32,
}

impl Default for Strategy {
    fn default() -> Self {
        Strategy { slot: 1, kind: "prompt_lookup".into(), max_draft: 8, ngram_min: 1, ngram_max: 4 }
    }
}

impl Strategy {
    /// Prompt lookup in slot 1 with these bounds.
    pub fn prompt_lookup(max_draft: u32, ngram_min: u32, ngram_max: u32) -> Strategy {
        Strategy { max_draft, ngram_min, ngram_max, ..Strategy::default() }
    }
}

/// The planner's strategy and its cert_id on the current worker.
#[derive(Debug, Default)]
pub struct StrategyBook {
    pub strategy: Option<Strategy>,
    /// INSTALL_STRATEGY's cert_id on this worker; None: not installed there.
    pub cert_id: Option<u64>,
    /// INSTALL_STRATEGY answered OK.
    pub installs: u64,
}

impl StrategyBook {
    pub fn new(strategy: Option<Strategy>) -> StrategyBook {
        StrategyBook { strategy, cert_id: None, installs: 0 }
    }

    /// The slot an admission names (0: none), installing the strategy on
    /// this worker first. A strategy the worker refuses is `Error::Op`
    /// (INSTALL_STRATEGY) with the worker's message.
    pub fn slot(&mut self, c: &mut Connection, timeout: Duration) -> Result<u32, Error> {
        let Some(s) = &self.strategy else { return Ok(0) };
        if self.cert_id.is_none() {
            self.cert_id = Some(c.install_strategy(s, timeout)?);
            self.installs += 1;
        }
        Ok(s.slot)
    }

    /// The worker restarted: its strategy slots are gone.
    pub fn forget(&mut self) {
        self.cert_id = None;
    }
}
