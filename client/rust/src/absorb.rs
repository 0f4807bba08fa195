//! Folding an accepted plan and its events back into the planner: admitted
//! lanes, how far each prefill really got (shed chunks), emitted tokens and
//! finishes, host rows to sample, faulted lanes to re-admit or end.
use crate::abi::*;
use crate::events::{Error, Events};
use crate::planner::{Draft, Finish, Lane, Planner};

impl Planner {
    fn lane_mut(&mut self, tag: u64) -> Option<&mut Lane> {
        self.lanes.iter_mut().find(|l| l.tag == tag)
    }

    pub(crate) fn absorb(&mut self, d: Draft, ev: &Events) -> Result<(), Error> {
        self.stats.ticks += 1;
        for lane in d.admits {
            let front = self.waiting.pop_front();
            debug_assert_eq!(front, Some(lane.req)); // admits came off the front, in order
            let req = &mut self.requests[lane.req];
            req.admissions += 1;
            req.seed = None; // a lease is spent by the admit that names it
            req.no_seed = false;
            self.stats.seeded_tokens += *d.seeded.get(&lane.tag).unwrap_or(&0) as u64;
            let tokens = [req.spec.prompt.as_slice(), req.generated.as_slice()].concat();
            self.seeds.admitted(&tokens);
            self.lanes.push(lane);
        }
        for tokens in &d.published {
            self.seeds.published(tokens);
        }
        self.stats.leases = self.seeds.leases;
        for tag in &d.retires {
            if let Some(k) = self.lanes.iter().position(|l| l.tag == *tag) {
                let id = self.lanes.remove(k).req;
                let r = &self.requests[id];
                if r.finish.is_some() && r.spec.grammar.is_some() {
                    self.grammars.release(&mut self.conn, id, self.opts.tick_timeout)?;
                }
            }
            self.retire_next.remove(tag);
        }
        if !d.retires.is_empty() {
            self.admit_cap = None; // memory came back
        }
        for (tag, offer) in &d.prefills {
            self.lane_mut(*tag).unwrap().prefilled += offer; // less what was shed, below
        }
        for (tag, grant) in &d.decodes {
            let lane = self.lane_mut(*tag).unwrap();
            lane.replay_left -= (*grant).min(lane.replay_left); // replay rounds come first
        }
        for tag in &d.commits {
            self.lane_mut(*tag).unwrap().commit = None;
        }
        let offers = d.prefills.iter().copied().collect();
        self.absorb_shed(ev, &offers)?;
        self.absorb_faults(ev)?;
        for emit in &ev.emits {
            self.absorb_emit(emit)?;
        }
        Ok(())
    }

    /// A shed PREFILL_CHUNK says where the executor really stopped.
    fn absorb_shed(&mut self, ev: &Events, d_offers: &std::collections::HashMap<u64, usize>) -> Result<(), Error> {
        for e in &ev.shed.entries {
            if e.kind == SF_SHED_PREFILL_CHUNK {
                if let Some(lane) = self.lane_mut(e.lane_tag) {
                    // At most what this tick offered it: the worker's count is checked, not trusted.
                    let offered = *d_offers.get(&e.lane_tag).unwrap_or(&0);
                    if e.tokens as usize > offered {
                        return Err(Error::Bounds(format!("lane {}: {} prefill tokens shed of {offered} offered",
                                                         e.lane_tag, e.tokens)));
                    }
                    lane.prefilled -= e.tokens as usize;
                }
                self.stats.prefill_chunks_shed += 1;
                self.stats.prefill_tokens_shed += e.tokens;
            } else if e.kind == SF_SHED_CACHE_EVICTION {
                self.stats.evictions += 1;
                self.stats.bytes_evicted += e.bytes;
            }
        }
        Ok(())
    }

    /// A faulted lane's sequence is gone: retire its tag and re-admit the
    /// request from where it was, as after a restart. Not a fault that would
    /// come back: a non-finite row (NUMERIC) is the same bits on a
    /// re-admission, so that request ends Finish::Fault with what it has; so
    /// does one that faulted more than max_fault_readmits times in a row (no
    /// token in between). Not counted: OOM_TENTATIVE (memory comes back) and
    /// injected faults (the harness bounds them). client/planner_absorb.py's rule.
    fn absorb_faults(&mut self, ev: &Events) -> Result<(), Error> {
        let (mut again, mut ended) = (Vec::new(), Vec::new());
        for f in &ev.faults {
            self.stats.faults += 1;
            self.retire_next.insert(f.lane_tag);
            let Some(k) = self.lanes.iter().position(|l| l.tag == f.lane_tag) else { continue };
            let id = self.lanes.remove(k).req;
            let req = &mut self.requests[id];
            if req.finish.is_some() {
                continue;
            }
            if !f.injected() && f.code != SF_FAULT_OOM_TENTATIVE {
                req.faults += 1;
                if f.code == SF_FAULT_NUMERIC || req.faults > self.opts.max_fault_readmits {
                    req.finish = Some(Finish::Fault);
                    ended.push(id);
                    continue;
                }
            }
            again.push(id);
        }
        for r in again.into_iter().rev() {
            self.waiting.push_front(r);
        }
        for id in ended {
            self.grammars.release(&mut self.conn, id, self.opts.tick_timeout)?;
        }
        Ok(())
    }

    fn absorb_emit(&mut self, emit: &LaneEmit) -> Result<(), Error> {
        let Some(k) = self.lanes.iter().position(|l| l.tag == emit.lane_tag) else { return Ok(()) };
        let id = self.lanes[k].req;
        self.stats.draft_proposed += emit.spec.proposed as u64;
        self.stats.draft_accepted += emit.spec.accepted as u64;
        let host = self.requests[id].spec.sampling == SF_SAMPLING_HOST;
        let mut row = None;
        let tokens: Vec<u32> = if !host {
            self.conn.emit_tokens(emit)?
        } else if emit.logits_nonce != 0 {
            // The draw at rng position rng_base + tokens sampled so far.
            let mut r = self.conn.logits_row(emit)?;
            let req = &mut self.requests[id];
            let pos = req.spec.rng_base.wrapping_add(req.generated.len() as u64);
            let tok = (req.spec.host_sampler.as_mut().unwrap())(&r.row, pos);
            r.row = Vec::new(); // the commit needs only the lane and the nonce
            row = Some(r);
            vec![tok]
        } else {
            Vec::new() // a HOST lane replaying: no row
        };
        let eos = &self.eos;
        let req = &mut self.requests[id];
        req.generated.extend_from_slice(&tokens);
        if !tokens.is_empty() {
            req.faults = 0; // progress: the faults before it are not in a row
        }
        let last_eos = tokens.last().map_or(false, |t| eos.contains(t));
        let reason = if emit.finish == SF_FINISH_EOS || (req.spec.stop_at_eos && last_eos) {
            Some(Finish::Eos)
        } else if emit.finish == SF_FINISH_GRAMMAR {
            Some(Finish::Grammar) // the grammar is complete
        } else if emit.finish == SF_FINISH_LENGTH {
            Some(Finish::Length)
        } else if req.generated.len() >= req.spec.max_new_tokens {
            Some(Finish::MaxTokens)
        } else {
            None
        };
        let lane = &mut self.lanes[k];
        if reason.is_some() {
            req.finish = reason;
            lane.retiring = true;
        } else if let (Some(r), Some(&t)) = (row, tokens.first()) {
            lane.commit = Some((r, t));
        }
        Ok(())
    }
}
