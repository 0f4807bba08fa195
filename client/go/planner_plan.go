package superfluid

import (
	"sort"
	"time"
)

// draft is a plan and what it means to the planner; applied only once
// accepted (a refused plan changed nothing, on either side).
type draft struct {
	plan      *Plan
	admits    []*lane
	prefills  map[uint64]int // tag -> tokens offered
	reached   map[uint64]int // tag -> prefilled after, by the budget
	decodes   map[uint64]int // tag -> tokens granted
	commits   []uint64
	retires   []uint64
	published [][]uint32     // tokens of publishing retires
	seeded    map[uint64]int // tag -> tokens its lease covers
}

// send plans, sends, and shrinks the plan while the worker says NeedsReplan.
func (p *Planner) send(timeout time.Duration) (*draft, *Events, error) {
	maxAdmits := p.admitCap
	if m := p.Opts.MaxAdmitsPerTick; m > 0 && (maxAdmits < 0 || m < maxAdmits) {
		maxAdmits = m
	}
	publish := true
	for {
		d, err := p.plan(maxAdmits, p.evict, publish)
		if err != nil {
			return nil, nil, err
		}
		ev, err := p.Conn.Tick(d.plan, timeout)
		if err != nil {
			return nil, nil, err
		}
		if ev.Status == SF_STATUS_OK {
			return d, ev, nil
		}
		if ev.Status == SF_STATUS_RejectStaleSeed && len(d.seeded) > 0 {
			// A lease ran out (or the worker let it go): admit those afresh.
			for _, l := range d.admits {
				l.req.seed, l.req.noSeed = nil, true
			}
			continue
		}
		if ev.Status != SF_STATUS_NeedsReplan {
			return nil, nil, ev.Err()
		}
		p.Stats.Replans++
		// Nothing happened. Let the prefix cache make room first, then admit
		// fewer, then keep nothing a retiring lane would publish, then give up
		// a running lane's memory. The first two stick until a lane retires.
		switch {
		case !p.evict:
			p.evict = true
		case len(d.admits) == 1 && p.lanes.len() == 0:
			r := p.waiting[0] // alone on an idle worker, it still does not fit
			p.waiting = p.waiting[1:]
			if err := p.refuse(r); err != nil {
				return nil, nil, err
			}
		case len(d.admits) > 0:
			p.admitCap = len(d.admits) / 2
			maxAdmits = p.admitCap
		case publish && p.publishing():
			publish = false // a published lane keeps its cells until a later tick evicts them
		default:
			preempted, err := p.preemptNewest()
			if err != nil {
				return nil, nil, err
			}
			if !preempted {
				return nil, nil, ev.Err()
			}
			maxAdmits = 0 // not the preempted request again in this tick
		}
	}
}

func (p *Planner) publishing() bool {
	for _, l := range p.lanes.order {
		if l.retiring && !l.req.NoPublish {
			return true
		}
	}
	return false
}

func (p *Planner) plan(maxAdmits int, evict, publish bool) (*draft, error) {
	pl := NewPlan(uint32(p.Opts.PrefillTokenBudget)) // the connection stamps plan_seq
	if evict {
		pl.AllowEvict(evictAll, 0)
	}
	d := &draft{plan: pl, prefills: map[uint64]int{}, reached: map[uint64]int{}, decodes: map[uint64]int{},
		seeded: map[uint64]int{}}
	p.planRetires(d, publish)
	for _, l := range p.lanes.order { // HOST: the token picked from last tick's row
		if l.commit != nil && !l.retiring {
			pl.Commit(*l.commit)
			d.commits = append(d.commits, l.tag)
		}
	}
	// Lanes in flight prefill first: they hold memory already.
	budget := p.Opts.PrefillTokenBudget
	for _, l := range p.lanes.order {
		budget = p.planPrefill(d, l, budget)
	}
	if err := p.planAdmits(d, maxAdmits, budget); err != nil {
		return nil, err
	}
	p.planDecodes(d)
	return d, nil
}

func (p *Planner) planRetires(d *draft, publish bool) {
	for _, l := range p.lanes.order {
		if l.retiring {
			keep := publish && !l.req.NoPublish
			d.plan.Retire(l.tag, keep)
			d.retires = append(d.retires, l.tag)
			if keep {
				d.published = append(d.published, tokensOf(l.req))
			}
		}
	}
	tags := make([]uint64, 0, len(p.retireNext))
	for t := range p.retireNext {
		tags = append(tags, t)
	}
	sort.Slice(tags, func(i, j int) bool { return tags[i] < tags[j] })
	for _, t := range tags {
		d.plan.Retire(t, false)
		d.retires = append(d.retires, t)
	}
}

func tokensOf(r *Request) []uint32 {
	return append(append(make([]uint32, 0, len(r.Prompt)+len(r.Generated)), r.Prompt...), r.Generated...)
}

// planPrefill offers the lane its next prompt chunk; the budget left.
func (p *Planner) planPrefill(d *draft, l *lane, budget int) int {
	left := l.prefillEnd - l.prefilled
	if left == 0 || l.retiring {
		return budget
	}
	offer := budget
	if p.Opts.PrefillChunk > 0 {
		offer = p.Opts.PrefillChunk
	}
	if left < offer {
		offer = left
	}
	if offer == 0 {
		return budget
	}
	d.plan.Prefill(l.tag, uint32(l.prefilled), uint32(offer))
	d.prefills[l.tag] = offer
	take := offer // the executor takes tokens in plan order up to the budget
	if budget < take {
		take = budget
	}
	d.reached[l.tag] = l.prefilled + take
	return budget - take
}

// planAdmits: waiting requests, oldest (or interrupted) first, while a lane
// slot and prefill budget are free.
func (p *Planner) planAdmits(d *draft, maxAdmits, budget int) error {
	for _, r := range p.waiting {
		if p.lanes.len()+len(d.admits) >= p.maxLanes || budget == 0 {
			break
		}
		if maxAdmits >= 0 && len(d.admits) >= maxAdmits {
			break
		}
		l, err := p.admit(d, r)
		if err != nil {
			return err
		}
		budget = p.planPrefill(d, l, budget)
	}
	return nil
}

// admit admits r from where it is: prompt + generated so far, the generated
// tail replayed by decode, draws resuming past the tokens already sampled.
func (p *Planner) admit(d *draft, r *Request) (*lane, error) {
	tag := p.Conn.NewLaneTag()
	sampled := len(r.Generated) // every generated token was drawn at base + index
	tokens := tokensOf(r)
	if !p.Opts.NoLeases && r.seed == nil && !r.noSeed {
		s, err := p.Seeds.Lease(tokens, sampled, p.Opts.TickTimeout)
		if err != nil {
			return nil, err
		}
		r.seed = s
	}
	value := 0
	a := LaneAdmit{LaneTag: tag, Sampling: r.Sampling, Params: r.Params, RngCounterBase: r.RngBase + uint64(sampled),
		DecodeReplay: uint32(sampled), DeterminismClass: seedPathInvariant}
	if r.Grammar != nil {
		// The grammar's fresh matcher replays what was generated (contract §9, as the draws resume).
		h, err := p.Grammars.Handle(r.ID, r.Grammar, p.Opts.TickTimeout)
		if err != nil {
			return nil, err
		}
		a.GrammarHandle, a.GrammarReplay = h, uint32(sampled)
	}
	if r.Speculate {
		slot, err := p.Strategies.Slot(p.Opts.TickTimeout)
		if err != nil {
			return nil, err
		}
		a.StrategySlot = slot
	}
	if r.seed != nil {
		value = int(r.seed.Value)
		a.SeedHandle = r.seed.Handle
	}
	ref, err := p.Conn.WritePrompt(tokens)
	if err != nil {
		return nil, err
	}
	a.Prompt = ref
	d.plan.Admit(a)
	// A seed covers value tokens: prefill starts there, and so does the replay.
	end := len(r.Prompt)
	if value > end {
		end = value
	}
	l := &lane{tag: tag, req: r, prefillEnd: end, replayLeft: len(tokens) - end, prefilled: value}
	if r.seed != nil {
		d.seeded[tag] = value
	}
	d.admits = append(d.admits, l)
	return l, nil
}

// planDecodes: lanes whose prefill is complete by the end of this tick
// decode: GPU lanes up to DecodeGrant new tokens (never past max_new_tokens)
// plus their replay; HOST lanes one token (replayed or new). A lane with the
// strategy may run past the grant on verified drafts (overshoot) up to what
// its request has left.
func (p *Planner) planDecodes(d *draft) {
	for _, l := range append(append([]*lane(nil), p.lanes.order...), d.admits...) {
		reached, ok := d.reached[l.tag]
		if !ok {
			reached = l.prefilled
		}
		if l.retiring || reached != l.prefillEnd {
			continue
		}
		grant, over := 1, 0 // HOST: the executor's rule, the planner picks each token
		if l.req.Sampling != SF_SAMPLING_HOST {
			// A re-admitted lane catches up in one tick: its replay, then the usual grant.
			left := l.req.MaxNewTokens - len(l.req.Generated)
			n := p.Opts.DecodeGrant
			if left < n {
				n = left
			}
			grant = l.replayLeft + n
			if grant > u16Max {
				grant = u16Max
			}
			if l.req.Speculate { // room for every round's draft to be taken whole
				over = left - n
				if m := p.Opts.DecodeGrant * p.Strategies.Strategy.MaxDraft; m < over {
					over = m
				}
				if over > u16Max {
					over = u16Max
				}
			}
		}
		d.plan.DecodeOvershoot(l.tag, uint16(grant), uint16(over))
		d.decodes[l.tag] = grant
	}
}

// refuse: a request the worker's memory cannot hold even alone ends with what it has.
func (p *Planner) refuse(r *Request) error {
	r.Finish, r.FinishedAt = "unservable", p.Clock()
	return p.Grammars.Release(r.ID, p.Opts.TickTimeout)
}

// preemptNewest gives up the newest running lane's memory: retire it and
// queue its request again. False: no lane to give up.
func (p *Planner) preemptNewest() (bool, error) {
	var running []*lane
	for _, l := range p.lanes.order {
		if !l.retiring {
			running = append(running, l)
		}
	}
	if len(running) == 0 {
		return false, nil
	}
	l := running[len(running)-1]
	p.lanes.pop(l.tag)
	p.retireNext[l.tag] = true
	if len(running) == 1 {
		if err := p.refuse(l.req); err != nil {
			return true, err
		}
	} else {
		p.waiting = append(p.waiting, l.req)
		p.Stats.Preemptions++
	}
	return true, nil
}
