package workload_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"reflect"
	"regexp"
	"testing"
	"time"

	sf "superfluid"
	"superfluid/internal/livetest"
	"superfluid/workload"
)

// Grammar-constrained requests (contract §3 step 4, §7) through the Go planner
// on a live daemon of the tiny model: the Python planner's tokens and
// finishes, outputs that parse, the same tokens through a worker kill -9
// (each re-admission replays what it generated into a fresh matcher), and a
// bad grammar refused at Submit with the worker's message.

const grammarRegex = "[a-z]{3,8}-[0-9]{2,4}"

var grammarChoices = []string{"alpha", "beta", "gamma delta"}

const grammarSchema = `{"type": "object", "additionalProperties": false, "required": ["ok", "n"],
 "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999}}}`

// grammarWorkload: sampled JSON-schema requests, a regex, a choice, and one unconstrained.
func grammarWorkload() map[string]any {
	var reqs []map[string]any
	for i := 0; i < 6; i++ {
		reqs = append(reqs, map[string]any{"prompt": []int{123, 34, 5 + i}, "max_new_tokens": 48,
			"sampling": "sample", "params": map[string]any{"temperature": 1.0}, "rng_base": 50 + i,
			"grammar": map[string]any{"kind": "json_schema", "text": grammarSchema}})
	}
	reqs = append(reqs,
		map[string]any{"prompt": []int{1, 2, 3}, "max_new_tokens": 24, "sampling": "sample", "rng_base": 7,
			"params":  map[string]any{"temperature": 1.0, "top_k": 50},
			"grammar": map[string]any{"kind": "regex", "text": grammarRegex}},
		map[string]any{"prompt": []int{7, 8, 9}, "max_new_tokens": 16, "sampling": "sample", "rng_base": 3,
			"params":  map[string]any{"temperature": 1.0},
			"grammar": map[string]any{"kind": "choice", "choices": grammarChoices}},
		map[string]any{"prompt": []int{40, 41, 42, 43}, "max_new_tokens": 12, "stop_at_eos": false})
	return map[string]any{"options": map[string]any{"decode_grant": 2}, "requests": reqs}
}

// text: the tiny model's tokenizer is byte-level, ids below 256 are the bytes.
func text(t *testing.T, tokens []uint32) string {
	t.Helper()
	b := make([]byte, len(tokens))
	for i, tok := range tokens {
		if tok >= 256 {
			t.Fatalf("not all bytes: %v", tokens)
		}
		b[i] = byte(tok)
	}
	return string(b)
}

func finishes(o *workload.Output) []string {
	var out []string
	for _, r := range o.Results {
		f := "<running>"
		if r.Finish != nil {
			f = *r.Finish
		}
		out = append(out, f)
	}
	return out
}

// tiny: the package's tests of the tiny model share one daemon (TestMain stops it).
var tiny = &livetest.Shared{Args: func(t testing.TB) []string {
	return []string{"--model", livetest.TinyModelDir(t), "--max-batch", "8", "--threads", "1",
		"--restart-backoff", "0.05"}
}}

func tinyDaemon(t *testing.T) *livetest.Daemon { return tiny.Get(t) }

func TestMain(m *testing.M) {
	code := m.Run()
	if err := tiny.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	os.Exit(code)
}

func TestGrammarTokensMatchPythonPlanner(t *testing.T) {
	d := tinyDaemon(t)
	w := grammarWorkload()
	want := d.PythonPlan(t, w)
	got := goRun(t, d, w, false)
	if !reflect.DeepEqual(tokens(got), tokens(want)) || !reflect.DeepEqual(finishes(got), finishes(want)) {
		t.Fatalf("go %s\npython %s", got.JSON(), want.JSON())
	}
	f := finishes(got)
	seen := map[string]bool{}
	for i, r := range got.Results[:6] {
		var v struct {
			Ok *bool `json:"ok"`
			N  *int  `json:"n"`
		}
		dec := json.NewDecoder(bytes.NewReader([]byte(text(t, r.Tokens))))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&v); err != nil || v.Ok == nil || v.N == nil || *v.N < 0 || *v.N > 999 ||
			f[i] != "grammar" {
			t.Errorf("request %d (%s): %q: %v", i+1, f[i], text(t, r.Tokens), err)
		}
		seen[text(t, r.Tokens)] = true
	}
	if len(seen) < 2 {
		t.Errorf("sampled lanes all alike: %v", seen)
	}
	if s := text(t, got.Results[6].Tokens); f[6] != "grammar" || !regexp.MustCompile("^"+grammarRegex+"$").MatchString(s) {
		t.Errorf("regex request (%s): %q", f[6], s)
	}
	if s := text(t, got.Results[7].Tokens); f[7] != "grammar" || !contains(grammarChoices, s) {
		t.Errorf("choice request (%s): %q", f[7], s)
	}
	if len(got.Results[8].Tokens) != 12 || f[8] != "max_tokens" {
		t.Errorf("the unconstrained request: %v (%s)", got.Results[8].Tokens, f[8])
	}

	t.Run("kill_worker_after_tokens", func(t *testing.T) {
		killed := killedRun(t, d, grammarWorkload(), 20)
		if !reflect.DeepEqual(tokens(killed), tokens(want)) || !reflect.DeepEqual(finishes(killed), finishes(want)) {
			t.Fatalf("after a kill: go %s\npython %s", killed.JSON(), want.JSON())
		}
	})
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

func constrained(g *sf.Grammar) sf.RequestOptions {
	return sf.RequestOptions{Sampling: sf.SF_SAMPLING_GPU_SAMPLE, Params: sf.SamplingParams{Temperature: 1},
		RngBase: 3, Grammar: g}
}

func TestABadGrammarFailsSubmitWithTheWorkersMessage(t *testing.T) {
	d := tinyDaemon(t)
	c := d.Connect(t)
	p, err := sf.NewPlanner(c, sf.PlannerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range []*sf.Grammar{sf.JSONSchema("{"), sf.Regex("(ab"), {Kind: "yaml", Text: "a: 1"}} {
		_, err := p.Submit([]uint32{7, 8, 9}, 16, constrained(g))
		var oe *sf.OpError
		if !errors.As(err, &oe) || oe.Op != "REGISTER_GRAMMAR" || oe.Name() != "BadRequest" || oe.Message == "" {
			t.Errorf("%+v: %v", g, err)
		}
	}
	if len(p.Requests()) != 0 || p.Grammars.Registered != 0 {
		t.Fatalf("refused grammars were queued: %d requests, %d registered", len(p.Requests()), p.Grammars.Registered)
	}
	// Not with HOST, and a choice is a list: refused before the worker is asked.
	host := constrained(sf.Choice("a"))
	host.Sampling, host.HostSampler = sf.SF_SAMPLING_HOST, workload.Argmax
	if _, err := p.Submit([]uint32{1}, 2, host); err == nil {
		t.Error("a HOST request with a grammar was queued")
	}
	if _, err := p.Submit([]uint32{1}, 2, constrained(&sf.Grammar{Kind: "choice", Text: "a"})); err == nil {
		t.Error("a choice grammar of a string was queued")
	}
	// The planner goes on: a good grammar runs to its end, and its handle is released.
	id, err := p.Submit([]uint32{7, 8, 9}, 16, constrained(sf.Choice("yes", "no")))
	if err != nil || id != 1 || p.Grammars.Held() != 1 {
		t.Fatalf("submit: %d %v (%d held)", id, err, p.Grammars.Held())
	}
	rep, err := p.RunUntilDone(2 * time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if r := rep.Results[0]; r.Finish != "grammar" || !contains([]string{"yes", "no"}, text(t, r.Tokens)) {
		t.Fatalf("%+v", r)
	}
	if p.Grammars.Registered != 1 || p.Grammars.Held() != 0 {
		t.Fatalf("registered %d, held %d after the run", p.Grammars.Registered, p.Grammars.Held())
	}

	// A runtime without a tokenizer (the fake) has no grammars at all.
	f := livetest.Serve(t, "--fake")
	pf, err := sf.NewPlanner(f.Connect(t), sf.PlannerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var oe *sf.OpError
	if _, err := pf.Submit([]uint32{7, 8, 9}, 4, constrained(sf.Regex("[ab]+"))); !errors.As(err, &oe) ||
		oe.Name() != "Unsupported" || oe.Message == "" {
		t.Fatalf("the fake runtime: %v", err)
	}
}
