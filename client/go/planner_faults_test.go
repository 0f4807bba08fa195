package superfluid

import (
	"testing"
	"time"
)

// A fault that would come back ends its request "fault" instead of being
// re-admitted forever: a NUMERIC one (the same row comes back) at once,
// others after MaxFaultReadmits in a row; OOM_TENTATIVE and injected faults
// are re-admitted however many (client/planner_absorb.py's rule).
func TestFaultsThatWouldComeBackEndTheRequest(t *testing.T) {
	p := &Planner{Opts: PlannerOptions{MaxFaultReadmits: 2}, retireNext: map[uint64]bool{},
		Grammars: &GrammarBook{handles: map[int]uint64{}}}
	p.lanes.clear()
	numeric, internal, injected := &Request{ID: 1}, &Request{ID: 2}, &Request{ID: 3}
	now := time.Unix(100, 0)
	tag := uint64(0)
	fault := func(r *Request, code uint32, detail uint64) {
		tag++
		p.lanes.add(&lane{tag: tag, req: r})
		p.waiting = nil
		if err := p.absorbFaults(&Events{Faults: []LaneFault{{LaneTag: tag, Code: code, Detail: detail}}}, now); err != nil {
			t.Fatal(err)
		}
		if !p.retireNext[tag] || p.lanes.get(tag) != nil {
			t.Fatalf("faulted lane %d not to be retired", tag)
		}
	}
	fault(numeric, SF_FAULT_NUMERIC, 0)
	if numeric.Finish != "fault" || !numeric.FinishedAt.Equal(now) || len(p.waiting) != 0 {
		t.Fatalf("a model's NUMERIC fault: finish %q, waiting %d", numeric.Finish, len(p.waiting))
	}
	for i := 1; i <= 3; i++ {
		fault(internal, SF_FAULT_INTERNAL, 0)
		if again := len(p.waiting) == 1 && p.waiting[0] == internal; again != (i <= 2) || internal.Done() == again {
			t.Fatalf("INTERNAL fault %d: re-admitted %v, finish %q", i, again, internal.Finish)
		}
	}
	resumed := &Request{ID: 4}
	for i := 0; i < 5; i++ { // a token between faults: not in a row; OOM_TENTATIVE never counts
		fault(resumed, SF_FAULT_INTERNAL, 0)
		fault(resumed, SF_FAULT_OOM_TENTATIVE, 0)
		resumed.Faults = 0 // (what absorbEmit does when the re-admitted lane emits a token)
		if resumed.Done() {
			t.Fatalf("fault %d after progress ended the request", i)
		}
	}
	for i := 0; i < 5; i++ { // the negative control: injected ones, NUMERIC included, never end it
		fault(injected, SF_FAULT_NUMERIC, SF_FAULT_DETAIL_INJECTED)
		if len(p.waiting) != 1 || injected.Done() || injected.Faults != 0 {
			t.Fatalf("injected fault %d ended the request (%q)", i, injected.Finish)
		}
	}
	if p.Stats.Faults != 19 {
		t.Fatalf("faults counted %d", p.Stats.Faults)
	}
}
