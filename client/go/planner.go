package superfluid

import (
	"errors"
	"fmt"
	"time"
)

// The reference planner of client/planner.py, in Go: continuous batching
// over one worker. A tick: plan (retire finished and faulted lanes, commit
// host-sampled tokens, give prefilling lanes their next chunk under the
// prefill budget, admit waiting requests while the limits allow, grant
// decoding lanes their tokens); send it; on NeedsReplan shrink the plan and
// send again; absorb the events. When the worker dies the planner
// reconnects and re-admits each unfinished request with prompt + generated,
// decode_replay = generated, rng_counter_base = base + sampled (contract §9).
// A constrained request's grammar is registered when it is submitted and
// released when it is done (GrammarBook); a re-admission replays what it
// generated into a fresh matcher too (grammar_replay = generated). With a
// speculation strategy (PlannerOptions.Strategy, client/strategies.py) the
// planner installs it in NewPlanner (a strategy the worker refuses fails
// it), and again at the first admission after a restart; requests that
// speculate (all but NoSpeculate ones) are admitted with its slot and
// granted overshoot: drafted tokens the worker verified past the tick's
// grant, never past MaxNewTokens.

// HostSampler picks a token from a logits row; position is the draw's rng
// position (rng_base + tokens sampled so far), the key the engine uses too.
type HostSampler func(row []float32, position uint64) uint32

const (
	u16Max   = 1<<16 - 1
	evictAll = 1 << 62 // max_evict_bytes when the planner lets the cache go
)

// RequestOptions: the zero value is a greedy request that stops at EOS and
// is published to the prefix cache when it retires.
type RequestOptions struct {
	Sampling    uint32 // SF_SAMPLING_*
	Params      SamplingParams
	RngBase     uint64 // generated token k is drawn at rng position RngBase + k
	NoPublish   bool
	IgnoreEOS   bool
	HostSampler HostSampler // required for SF_SAMPLING_HOST
	Grammar     *Grammar    // the output follows it (not with SF_SAMPLING_HOST)
	NoSpeculate bool        // don't admit it with the planner's strategy
}

// Request is what the user asked, and what came back so far.
type Request struct {
	ID           int
	Prompt       []uint32
	MaxNewTokens int
	RequestOptions
	SubmittedAt time.Time
	Generated   []uint32
	TokenTimes  []time.Time
	Finish      string // "" (running), "eos", "grammar", "length", "max_tokens", "unservable", "fault"
	FinishedAt  time.Time
	Admissions  int  // > 1: re-admitted after a restart, a fault or a preemption
	Faults      int  // its lanes' faults in a row (no token between), not counting injected or OOM ones
	Speculate   bool // admitted with the planner's strategy (drafting never changes its tokens)

	seed   *Seed // a lease for its next admission
	noSeed bool  // its lease went stale: admit it without one this time
}

func (r *Request) Done() bool { return r.Finish != "" }

// lane is one admission of a request on the worker.
type lane struct {
	tag        uint64
	req        *Request
	prefillEnd int // prompt tokens prefill feeds; the generated tail is replayed by decode
	replayLeft int
	prefilled  int
	commit     *LaneCommit // HOST: the sampled token the next plan commits
	retiring   bool
}

// lanes keeps admission order (prefill runs in it) with lookup by tag.
type lanes struct {
	order []*lane
	byTag map[uint64]*lane
}

func (ls *lanes) add(l *lane)          { ls.order = append(ls.order, l); ls.byTag[l.tag] = l }
func (ls *lanes) get(tag uint64) *lane { return ls.byTag[tag] }
func (ls *lanes) clear()               { ls.order, ls.byTag = nil, map[uint64]*lane{} }
func (ls *lanes) len() int             { return len(ls.order) }
func (ls *lanes) pop(tag uint64) *lane {
	l := ls.byTag[tag]
	if l == nil {
		return nil
	}
	delete(ls.byTag, tag)
	for i, x := range ls.order {
		if x == l {
			ls.order = append(ls.order[:i:i], ls.order[i+1:]...)
			break
		}
	}
	return l
}

// PlannerOptions: zero values take the Python planner's defaults.
type PlannerOptions struct {
	PrefillTokenBudget int // prompt tokens per tick over all lanes (512)
	PrefillChunk       int // tokens offered to one lane per tick; 0 = what the budget has left
	DecodeGrant        int // tokens a GPU-sampled lane may decode per tick (4; HOST: 1)
	MaxLanes           int // lanes live at once; 0 = the runtime's max_batch
	MaxAdmitsPerTick   int // 0 = as the limits allow
	TickTimeout        time.Duration
	ReconnectTimeout   time.Duration
	NoLeases           bool // don't lease cached prefixes for admissions
	// MaxFaultReadmits: how many times in a row (no token between) a faulted
	// request is re-admitted; its next fault ends it "fault" (0: 8, as the
	// other zero values take the defaults; negative: none). A NUMERIC fault
	// ends it at once (the same row would come back); injected and
	// OOM_TENTATIVE faults never count.
	MaxFaultReadmits int
	// Strategy: a speculation strategy installed on the worker and named by
	// every request's admission unless it opts out (NoSpeculate); nil: none.
	Strategy *Strategy
}

type PlannerStats struct {
	Ticks, Replans, Tokens               int
	Wall                                 time.Duration
	TokensPerS                           float64
	TTFTp50, TTFTp99                     time.Duration // 0 when no request has a token
	PrefillChunksShed, PrefillTokensShed int
	Evictions                            int
	BytesEvicted                         uint64
	Faults, Preemptions, Restarts        int
	SeededTokens                         int // prompt tokens admissions took from seed leases
	Leases                               int // LEASE_SEED asked and granted
	DraftProposed                        int // draft tokens the worker verified (LaneEmit.Spec)
	DraftAccepted                        int // of them, the tokens taken
}

type RequestResult struct {
	ID         int
	Tokens     []uint32
	Finish     string
	TTFT       time.Duration // submit to first token (-1: none)
	Latency    time.Duration // submit to finish (-1: not finished)
	Admissions int
}

type Report struct {
	Results []RequestResult // in submission order
	Stats   PlannerStats
}

type Planner struct {
	Conn       *Conn
	Opts       PlannerOptions
	Stats      PlannerStats
	Seeds      *SeedBook
	Grammars   *GrammarBook
	Strategies *StrategyBook
	Clock      func() time.Time

	eos        map[uint32]bool
	maxLanes   int
	requests   []*Request
	waiting    []*Request
	lanes      lanes
	retireNext map[uint64]bool // faulted, preempted or orphaned tags: retire, don't publish
	evict      bool            // set by the first NeedsReplan: the prefix cache may be evicted from then on
	admitCap   int             // admits per tick while memory is short (-1: none)
}

// NewPlanner describes the worker and plans for it.
func NewPlanner(c *Conn, o PlannerOptions) (*Planner, error) {
	if o.PrefillTokenBudget < 0 || o.DecodeGrant < 0 || o.PrefillChunk < 0 {
		return nil, errors.New("prefill_token_budget, prefill_chunk and decode_grant are at least 1")
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.PrefillTokenBudget, 512)
	def(&o.DecodeGrant, 4)
	def(&o.MaxFaultReadmits, 8)
	if o.MaxFaultReadmits < 0 {
		o.MaxFaultReadmits = 0
	}
	if o.DecodeGrant > u16Max {
		o.DecodeGrant = u16Max
	}
	if o.TickTimeout == 0 {
		o.TickTimeout = 30 * time.Second
	}
	if o.ReconnectTimeout == 0 {
		o.ReconnectTimeout = 60 * time.Second
	}
	d, err := c.Describe(o.TickTimeout)
	if err != nil {
		return nil, err
	}
	p := &Planner{Conn: c, Opts: o, Clock: time.Now, eos: map[uint32]bool{}, retireNext: map[uint64]bool{},
		admitCap: -1}
	for _, t := range d.Eos {
		p.eos[t] = true
	}
	p.maxLanes = int(d.Runtime.MaxBatch)
	if o.MaxLanes > 0 && o.MaxLanes < p.maxLanes {
		p.maxLanes = o.MaxLanes
	}
	p.Seeds = NewSeedBook(c, int(d.Runtime.Page), d.Runtime.ExactOnly)
	p.Grammars = NewGrammarBook(c)
	p.Strategies = NewStrategyBook(c, o.Strategy)
	if _, err := p.Strategies.Slot(o.TickTimeout); err != nil {
		return nil, err // a strategy the worker refuses fails here, not mid-run
	}
	p.lanes.clear()
	return p, nil
}

// Submit queues a request; its id (from 1). A grammar is compiled by the
// worker now: one it refuses is an *OpError with the worker's message
// (REGISTER_GRAMMAR: BadRequest), and nothing is queued.
func (p *Planner) Submit(prompt []uint32, maxNewTokens int, o RequestOptions) (int, error) {
	if len(prompt) == 0 || maxNewTokens < 1 {
		return 0, errors.New("a request needs a prompt and max_new_tokens >= 1")
	}
	if o.Sampling == SF_SAMPLING_HOST && o.HostSampler == nil {
		return 0, errors.New("a HOST request needs a HostSampler(row, position) -> token")
	}
	if o.Sampling > SF_SAMPLING_HOST {
		return 0, fmt.Errorf("sampling %d: not an SF_SAMPLING_*", o.Sampling)
	}
	if o.Grammar != nil {
		if _, err := o.Grammar.Fields(); err != nil {
			return 0, err
		}
		if o.Sampling == SF_SAMPLING_HOST {
			return 0, errors.New("a grammar constrains the engine's sampling: not with HOST")
		}
		g := *o.Grammar // the request's own copy
		g.Choices = append([]string(nil), g.Choices...)
		o.Grammar = &g
	}
	if o.IgnoreEOS {
		o.Params.Flags |= SF_PARAM_IGNORE_EOS
	}
	r := &Request{ID: len(p.requests) + 1, Prompt: append([]uint32(nil), prompt...), MaxNewTokens: maxNewTokens,
		RequestOptions: o, SubmittedAt: p.Clock(), Speculate: !o.NoSpeculate && p.Strategies.Strategy != nil}
	if o.Grammar != nil {
		if _, err := p.Grammars.Handle(r.ID, o.Grammar, p.Opts.TickTimeout); err != nil {
			return 0, err
		}
	}
	p.requests = append(p.requests, r)
	p.waiting = append(p.waiting, r)
	return r.ID, nil
}

// Requests are every request submitted, by id - 1.
func (p *Planner) Requests() []*Request { return p.requests }

// LaneTags are the tags of the lanes live now, in admission order.
func (p *Planner) LaneTags() []uint64 {
	out := make([]uint64, 0, p.lanes.len())
	for _, l := range p.lanes.order {
		out = append(out, l.tag)
	}
	return out
}

func (p *Planner) takeOrphans() {
	for _, t := range p.Conn.TakeOrphans() {
		p.retireNext[t] = true
	}
}

// Busy: waiting requests, lanes, or tags to retire.
func (p *Planner) Busy() bool {
	p.takeOrphans()
	return len(p.waiting) > 0 || p.lanes.len() > 0 || len(p.retireNext) > 0
}

// RunUntilDone ticks until every request is finished and every lane retired.
func (p *Planner) RunUntilDone(timeout time.Duration) (*Report, error) {
	start := p.Clock()
	deadline := start.Add(timeout)
	for p.Busy() {
		left := deadline.Sub(p.Clock())
		if left <= 0 {
			return nil, &TimeoutError{fmt.Sprintf("requests still running after %v", timeout)}
		}
		if left > p.Opts.TickTimeout {
			left = p.Opts.TickTimeout
		}
		if err := p.Step(left); err != nil {
			return nil, err
		}
	}
	p.Stats.Wall += p.Clock().Sub(start)
	return p.Report(), nil
}

// Step is one tick or, when the worker is gone, one recovery.
func (p *Planner) Step(timeout time.Duration) error {
	p.takeOrphans() // lanes a pre-restart plan admitted
	d, ev, err := p.send(timeout)
	if errors.Is(err, ErrWorkerGone) {
		return p.recover()
	}
	if err != nil {
		return err
	}
	return p.absorb(d, ev)
}
