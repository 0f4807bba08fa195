package workload_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	sf "superfluid"
	"superfluid/internal/livetest"
	"superfluid/workload"
)

// Speculative decoding by prompt lookup (contract §7 INSTALL_STRATEGY, §4
// overshoot) through the Go planner on a live daemon of the tiny model: the
// Python planner's tokens for the same workload with the strategy, which
// are the tokens without one; drafts really taken (the negative control:
// none without the strategy); the same tokens through a worker kill -9 (the
// strategy is installed again on the new worker); and a bad strategy
// refused by NewPlanner with the worker's message.

// specWorkload is tests/client/test_workload.py's SPEC_WORKLOAD: greedy
// lanes whose prompts repeat, a sampled one, and one that does not
// speculate, every length fixed (stop_at_eos false).
func specWorkload(strategy map[string]any) map[string]any {
	var reqs []map[string]any
	for i := 0; i < 3; i++ {
		reqs = append(reqs, map[string]any{"prompt": []int{40 + i, 41 + i, 42 + i, 40 + i, 41 + i},
			"max_new_tokens": 40, "stop_at_eos": false})
	}
	reqs = append(reqs,
		map[string]any{"prompt": []int{9, 8, 7, 9, 8}, "max_new_tokens": 30, "sampling": "sample", "rng_base": 5,
			"params": map[string]any{"temperature": 0.7, "top_k": 8}, "stop_at_eos": false},
		map[string]any{"prompt": []int{3, 4, 5}, "max_new_tokens": 12, "speculate": false, "stop_at_eos": false})
	opts := map[string]any{"decode_grant": 3}
	if strategy != nil {
		opts["strategy"] = strategy
	}
	return map[string]any{"options": opts, "requests": reqs}
}

func TestSpeculationTokensMatchPythonPlannerAndPlainOnes(t *testing.T) {
	d := tinyDaemon(t)
	st := map[string]any{"max_draft": 6, "ngram_min": 1, "ngram_max": 3}
	plain := goRun(t, d, specWorkload(nil), false)
	want := d.PythonPlan(t, specWorkload(st))
	got := goRun(t, d, specWorkload(st), false)
	if !reflect.DeepEqual(tokens(got), tokens(want)) || !reflect.DeepEqual(finishes(got), finishes(want)) {
		t.Fatalf("go %s\npython %s", got.JSON(), want.JSON())
	}
	if !reflect.DeepEqual(tokens(got), tokens(plain)) || !reflect.DeepEqual(finishes(got), finishes(plain)) {
		t.Fatalf("with %s\nwithout %s", got.JSON(), plain.JSON())
	}
	for i, n := range []int{40, 40, 40, 30, 12} { // overshoot never past max_new_tokens
		if len(got.Results[i].Tokens) != n {
			t.Errorf("request %d: %d tokens, want %d", i+1, len(got.Results[i].Tokens), n)
		}
	}
	if plain.Stats.DraftProposed != 0 || got.Stats.DraftAccepted == 0 ||
		got.Stats.DraftProposed < got.Stats.DraftAccepted || want.Stats.DraftAccepted == 0 {
		t.Fatalf("drafts: plain %+v, go %+v, python %+v", plain.Stats, got.Stats, want.Stats)
	}

	t.Run("kill_worker_after_tokens", func(t *testing.T) {
		killed := killedRun(t, d, specWorkload(st), 50)
		if !reflect.DeepEqual(tokens(killed), tokens(want)) {
			t.Fatalf("after a kill: go %s\npython %s", killed.JSON(), want.JSON())
		}
	})
}

func TestABadStrategyFailsNewPlannerWithTheWorkersMessage(t *testing.T) {
	d := livetest.Serve(t, "--fake")
	newPlanner := func(s *sf.Strategy) (*sf.Planner, *sf.Conn, error) {
		c := d.Connect(t)
		p, err := sf.NewPlanner(c, sf.PlannerOptions{DecodeGrant: 2, Strategy: s})
		return p, c, err
	}
	medusa := sf.DefaultStrategy()
	medusa.Kind = "medusa"
	for field, s := range map[string]*sf.Strategy{"max_draft": sf.PromptLookup(0, 1, 4),
		"ngram_max": sf.PromptLookup(4, 3, 2), "kind": &medusa} {
		_, c, err := newPlanner(s)
		var oe *sf.OpError
		if !errors.As(err, &oe) || oe.Op != "INSTALL_STRATEGY" || oe.Name() != "BadRequest" ||
			!strings.Contains(oe.Message, field) {
			t.Errorf("%+v: %v", s, err)
		}
		c.Close()
	}
	// A good one installs when the planner is made; a request may opt out.
	p, c, err := newPlanner(sf.PromptLookup(8, 1, 4))
	if err != nil || p.Strategies.Installs != 1 || !p.Strategies.Installed {
		t.Fatalf("%v %+v", err, p.Strategies)
	}
	a, _ := p.Submit([]uint32{5, 6, 7, 5, 6}, 9, sf.RequestOptions{IgnoreEOS: true})
	b, _ := p.Submit([]uint32{5, 6, 7}, 5, sf.RequestOptions{NoSpeculate: true})
	if rs := p.Requests(); !rs[a-1].Speculate || rs[b-1].Speculate {
		t.Fatalf("speculate: %v %v", rs[a-1].Speculate, rs[b-1].Speculate)
	}
	rep, err := p.RunUntilDone(time.Minute)
	if err != nil || len(rep.Results[0].Tokens) != 9 || p.Strategies.Installs != 1 {
		t.Fatalf("%v %+v (installs %d)", err, rep, p.Strategies.Installs)
	}
	c.Close()
	// Without a strategy nothing speculates, whatever the request says.
	q, _, err := newPlanner(nil)
	if err != nil {
		t.Fatal(err)
	}
	id, _ := q.Submit([]uint32{5, 6, 7}, 4, sf.RequestOptions{})
	if q.Requests()[id-1].Speculate || q.Strategies.Installed {
		t.Fatal("a planner without a strategy speculates")
	}
	_ = workload.Argmax
}
