package superfluid

import (
	"math"
	"sort"
	"time"
)

// absorb folds an accepted plan and its events into the planner's state.
func (p *Planner) absorb(d *draft, ev *Events) error {
	now := p.Clock()
	p.Stats.Ticks++
	for _, l := range d.admits {
		p.waiting = p.waiting[1:] // admits came off the front, in order
		r := l.req
		r.Admissions++
		r.seed, r.noSeed = nil, false // a lease is spent by the admit that names it
		p.Stats.SeededTokens += d.seeded[l.tag]
		p.Seeds.Admitted(tokensOf(r))
		p.lanes.add(l)
	}
	for _, t := range d.published {
		p.Seeds.Published(t)
	}
	p.Stats.Leases = p.Seeds.Leases
	for _, t := range d.retires {
		l := p.lanes.pop(t)
		delete(p.retireNext, t)
		if l != nil && l.req.Done() && l.req.Grammar != nil {
			if err := p.Grammars.Release(l.req.ID, p.Opts.TickTimeout); err != nil {
				return err
			}
		}
	}
	if len(d.retires) > 0 {
		p.admitCap = -1 // memory came back: admit as the limits allow again
	}
	for t, offer := range d.prefills {
		p.lanes.get(t).prefilled += offer // less what was shed, below
	}
	for t, grant := range d.decodes {
		l := p.lanes.get(t)
		if grant > l.replayLeft { // replay rounds come first
			grant = l.replayLeft
		}
		l.replayLeft -= grant
	}
	for _, t := range d.commits {
		p.lanes.get(t).commit = nil
	}
	p.absorbShed(ev)
	if err := p.absorbFaults(ev, now); err != nil {
		return err
	}
	for i := range ev.Emits {
		if err := p.absorbEmit(&ev.Emits[i], now); err != nil {
			return err
		}
	}
	return nil
}

// absorbShed: a shed PREFILL_CHUNK says where the executor really stopped.
func (p *Planner) absorbShed(ev *Events) {
	for _, e := range ev.ShedEntries {
		switch e.Kind {
		case SF_SHED_PREFILL_CHUNK:
			if l := p.lanes.get(e.LaneTag); l != nil {
				l.prefilled -= int(e.Tokens)
			}
			p.Stats.PrefillChunksShed++
			p.Stats.PrefillTokensShed += int(e.Tokens)
		case SF_SHED_CACHE_EVICTION:
			p.Stats.Evictions++
			p.Stats.BytesEvicted += e.Bytes
		}
	}
}

// absorbFaults: a faulted lane's sequence is gone: retire its tag and
// re-admit the request from where it was, as after a restart. Not a fault
// that would come back: a non-finite row (NUMERIC) is the same bits on a
// re-admission, so that request ends "fault" with what it has; so does one
// that faulted more than MaxFaultReadmits times in a row (no token in
// between). Not counted: OOM_TENTATIVE (memory comes back) and injected
// faults (the harness bounds them). client/planner_absorb.py's rule.
func (p *Planner) absorbFaults(ev *Events, now time.Time) error {
	var again, ended []*Request
	for _, f := range ev.Faults {
		p.Stats.Faults++
		p.retireNext[f.LaneTag] = true
		l := p.lanes.pop(f.LaneTag)
		if l == nil || l.req.Done() {
			continue
		}
		r := l.req
		if !f.Injected() && f.Code != SF_FAULT_OOM_TENTATIVE {
			r.Faults++
			if f.Code == SF_FAULT_NUMERIC || r.Faults > p.Opts.MaxFaultReadmits {
				r.Finish, r.FinishedAt = "fault", now
				ended = append(ended, r)
				continue
			}
		}
		again = append(again, r)
	}
	p.waiting = append(again, p.waiting...)
	for _, r := range ended {
		if err := p.Grammars.Release(r.ID, p.Opts.TickTimeout); err != nil {
			return err
		}
	}
	return nil
}

func (p *Planner) absorbEmit(e *LaneEmit, now time.Time) error {
	l := p.lanes.get(e.LaneTag)
	if l == nil {
		return nil
	}
	r := l.req
	p.Stats.DraftProposed += int(e.Spec.Proposed)
	p.Stats.DraftAccepted += int(e.Spec.Accepted)
	var tokens []uint32
	var err error
	if r.Sampling == SF_SAMPLING_HOST {
		if e.LogitsNonce != 0 { // none while it replays
			var row []float32
			if row, err = p.Conn.LogitsRow(e); err == nil {
				tokens = []uint32{r.HostSampler(row, r.RngBase+uint64(len(r.Generated)))}
			}
		}
	} else {
		tokens, err = p.Conn.Tokens(e)
	}
	if err != nil {
		return err
	}
	r.Generated = append(r.Generated, tokens...)
	for range tokens {
		r.TokenTimes = append(r.TokenTimes, now)
	}
	if len(tokens) > 0 {
		r.Faults = 0 // progress: the faults before it are not in a row
	}
	if reason := p.finishReason(r, e, tokens); reason != "" {
		r.Finish, r.FinishedAt = reason, now
		l.retiring = true
	} else if r.Sampling == SF_SAMPLING_HOST && len(tokens) > 0 {
		c, err := CommitFor(e, tokens[0])
		if err != nil {
			return err
		}
		l.commit = &c
	}
	return nil
}

func (p *Planner) finishReason(r *Request, e *LaneEmit, tokens []uint32) string {
	if e.Finish == SF_FINISH_EOS || (!r.IgnoreEOS && len(tokens) > 0 && p.eos[tokens[len(tokens)-1]]) {
		return "eos"
	}
	if e.Finish == SF_FINISH_GRAMMAR {
		return "grammar" // the grammar is complete
	}
	if e.Finish == SF_FINISH_LENGTH {
		return "length"
	}
	if len(r.Generated) >= r.MaxNewTokens {
		return "max_tokens"
	}
	return ""
}

// recover: the worker is gone with every lane. Wait for its replacement and
// queue each unfinished request to be re-admitted from where it is.
// Finished lanes need no retire: the new worker never had them.
func (p *Planner) recover() error {
	if _, err := p.Conn.Reconnect(p.Opts.ReconnectTimeout); err != nil {
		return err // DaemonGone / gave up: nothing to recover to
	}
	p.Stats.Restarts++
	var again []*Request
	for _, l := range p.lanes.order {
		if !l.req.Done() {
			again = append(again, l.req)
		}
	}
	p.lanes.clear()
	p.retireNext = map[uint64]bool{}
	p.evict, p.admitCap = false, -1 // a fresh worker: empty cache, free memory
	p.Seeds.Forget()                // and no leases
	p.Grammars.Forget()             // nor grammars: each is registered again at its next admission
	p.Strategies.Forget()           // nor the strategy: installed again at the next admission
	for _, r := range p.requests {
		r.seed, r.noSeed = nil, false
	}
	p.waiting = append(again, p.waiting...)
	return nil
}

// Report: every request's tokens and finish, and the stats so far.
func (p *Planner) Report() *Report {
	rep := &Report{}
	var ttfts []time.Duration
	s := p.Stats
	s.Tokens = 0
	for _, r := range p.requests {
		res := RequestResult{ID: r.ID, Tokens: append([]uint32(nil), r.Generated...), Finish: r.Finish,
			TTFT: -1, Latency: -1, Admissions: r.Admissions}
		if len(r.TokenTimes) > 0 {
			res.TTFT = r.TokenTimes[0].Sub(r.SubmittedAt)
			ttfts = append(ttfts, res.TTFT)
		}
		if !r.FinishedAt.IsZero() {
			res.Latency = r.FinishedAt.Sub(r.SubmittedAt)
		}
		s.Tokens += len(r.Generated)
		rep.Results = append(rep.Results, res)
	}
	if s.Wall > 0 {
		s.TokensPerS = float64(s.Tokens) / s.Wall.Seconds()
	}
	s.TTFTp50, s.TTFTp99 = percentile(ttfts, 50), percentile(ttfts, 99)
	rep.Stats = s
	return rep
}

// percentile is the nearest-rank percentile (0 for none).
func percentile(xs []time.Duration, q float64) time.Duration {
	if len(xs) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), xs...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	k := int(math.Ceil(q/100*float64(len(s)))) - 1
	if k < 0 {
		k = 0
	}
	if k > len(s)-1 {
		k = len(s) - 1
	}
	return s[k]
}
