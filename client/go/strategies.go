package superfluid

import "time"

// The reference planner's speculation strategy (client/strategies.py; contract
// §7 INSTALL_STRATEGY, §4 overshoot). A strategy lives in a slot of the
// worker; admits that name the slot may draft (the worker decides which
// lanes do: not HOST, grammar, logit-bias or logprob lanes). Drafting never
// changes a lane's tokens, so the planner treats a drafting lane as any
// other, but grants it overshoot: verified tokens past the tick's grant, up
// to what the request has left. The slot dies with its worker: after a
// restart the book forgets it and installs it again at the next admission.

// Strategy is prompt lookup: draft up to MaxDraft tokens that followed the
// latest earlier occurrence of the lane's last n tokens (NgramMax down to
// NgramMin). The fields are sent as they are (a zero is refused by the
// worker): start from DefaultStrategy or PromptLookup.
type Strategy struct {
	MaxDraft, NgramMin, NgramMax int
	Kind                         string // "prompt_lookup"
	Slot                         int    // 1..8
}

// DefaultStrategy is client/strategies.py's Strategy(): max_draft 8, n-grams 1..4, slot 1.
func DefaultStrategy() Strategy {
	return Strategy{MaxDraft: 8, NgramMin: 1, NgramMax: 4, Kind: "prompt_lookup", Slot: 1}
}

// PromptLookup is DefaultStrategy with these bounds.
func PromptLookup(maxDraft, ngramMin, ngramMax int) *Strategy {
	s := DefaultStrategy()
	s.MaxDraft, s.NgramMin, s.NgramMax = maxDraft, ngramMin, ngramMax
	return &s
}

// Fields are INSTALL_STRATEGY's.
func (s *Strategy) Fields() map[string]any {
	return map[string]any{"slot": s.Slot, "kind": s.Kind, "max_draft": s.MaxDraft, "ngram_min": s.NgramMin,
		"ngram_max": s.NgramMax}
}

// StrategyBook is the planner's strategy and its cert_id on the current worker.
type StrategyBook struct {
	conn      *Conn
	Strategy  *Strategy // nil: none
	CertID    uint64    // INSTALL_STRATEGY's cert_id on this worker (with Installed)
	Installed bool      // on the current worker
	Installs  int       // INSTALL_STRATEGY answered OK
}

func NewStrategyBook(c *Conn, s *Strategy) *StrategyBook {
	if s != nil {
		cp := *s // the book's own copy
		s = &cp
	}
	return &StrategyBook{conn: c, Strategy: s}
}

// Slot is the slot an admission names (0: none), installing the strategy on
// this worker first. A strategy the worker refuses is an *OpError
// (INSTALL_STRATEGY) with the worker's message.
func (b *StrategyBook) Slot(timeout time.Duration) (uint32, error) {
	if b.Strategy == nil {
		return 0, nil
	}
	if !b.Installed {
		id, err := b.conn.InstallStrategy(b.Strategy, timeout)
		if err != nil {
			return 0, err
		}
		b.CertID, b.Installed = id, true
		b.Installs++
	}
	return uint32(b.Strategy.Slot), nil
}

// Forget: the worker restarted, its strategy slots are gone.
func (b *StrategyBook) Forget() { b.CertID, b.Installed = 0, false }
