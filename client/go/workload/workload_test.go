package workload_test

import (
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	sf "superfluid"
	"superfluid/internal/livetest"
	"superfluid/workload"
)

const T = 300 * time.Second

// The host samplers are client/workload.py's, bit for bit: rows with ties,
// negatives and infinities at positions near the edges of the u64 range.
func TestHostSamplersMatchPython(t *testing.T) {
	py := livetest.Python(t)
	var rows [][]uint32 // float32 bits, so nothing is lost on the way
	x := uint64(12345)
	for r := 0; r < 6; r++ {
		row := make([]uint32, 300+r*97)
		for i := range row {
			x = x*6364136223846793005 + 1442695040888963407
			v := float32(int64(x>>40)%2000-1000) / 256 // ties are common at this scale
			if r == 5 && i%50 == 7 {
				v = float32(math.Inf(-1))
			}
			row[i] = math.Float32bits(v)
		}
		rows = append(rows, row)
	}
	positions := []uint64{0, 1, 7, 1 << 32, 1<<40 + 3, math.MaxUint64}
	b, _ := json.Marshal(map[string]any{"rows": rows, "positions": positions})
	d := &livetest.Daemon{Python: py}
	out := d.PythonCode(t, `
import json
import numpy as np
from superfluid.client.workload import host_argmax, host_perturb
`+fmt.Sprintf("w = json.loads(%q)\n", string(b))+`
out = []
for bits in w["rows"]:
    row = np.array(bits, dtype=np.uint32).view(np.float32)
    out.append([[host_argmax(row, p), host_perturb(row, p)] for p in w["positions"]])
print(json.dumps(out))
`)
	var want [][][2]uint32
	if err := json.Unmarshal([]byte(out), &want); err != nil {
		t.Fatal(err, out)
	}
	differ := 0
	for r, bits := range rows {
		row := make([]float32, len(bits))
		for i, b := range bits {
			row[i] = math.Float32frombits(b)
		}
		for k, p := range positions {
			got := [2]uint32{workload.Argmax(row, p), workload.Perturb(row, p)}
			if got != want[r][k] {
				t.Errorf("row %d position %d: go %v, python %v", r, p, got, want[r][k])
			}
			if got[0] != got[1] {
				differ++
			}
		}
	}
	if differ == 0 { // negative control: perturb is not argmax
		t.Error("perturb never differs from argmax")
	}
}

// prefix is a shared system prompt of whole pages (leases need them).
func prefix(n int) []int {
	p := make([]int, n)
	for i := range p {
		p[i] = 1 + (i*37)%250
	}
	return p
}

func with(p []int, tail ...int) []int { return append(append([]int(nil), p...), tail...) }

// mixed is greedy, sampled, host-sampled (argmax, perturb) and seeded lanes:
// two lanes at a time, so later requests find the shared prefix published.
func mixed(rngShift int) map[string]any {
	p := prefix(40)
	sample := map[string]any{"temperature": 0.9, "top_k": 50, "top_p": 0.9}
	return map[string]any{
		"options": map[string]any{"max_lanes": 2, "decode_grant": 3, "prefill_token_budget": 64,
			"prefill_chunk": 24},
		"requests": []map[string]any{
			{"prompt": with(p, 7, 8), "max_new_tokens": 10},
			{"prompt": with(p, 9), "max_new_tokens": 10, "sampling": "sample", "params": sample,
				"rng_base": 5 + rngShift},
			{"prompt": []int{11, 12, 13}, "max_new_tokens": 6, "sampling": "host", "host_sampler": "argmax"},
			{"prompt": []int{11, 12, 13}, "max_new_tokens": 6, "sampling": "host", "host_sampler": "perturb"},
			{"prompt": with(p, 20, 21), "max_new_tokens": 10, "sampling": "sample",
				"params": map[string]any{"temperature": 1.0}, "rng_base": 1234 + rngShift, "stop_at_eos": false},
			{"prompt": with(p, 30), "max_new_tokens": 8, "stop_at_eos": false},
			{"prompt": with(p, 31), "max_new_tokens": 6, "sampling": "host", "host_sampler": "perturb",
				"rng_base": 99, "stop_at_eos": false},
		},
	}
}

func goRun(t *testing.T, d *livetest.Daemon, w map[string]any, clear bool) *workload.Output {
	t.Helper()
	b, _ := json.Marshal(w)
	wl, err := workload.Load(b)
	if err != nil {
		t.Fatal(err)
	}
	c := d.Connect(t)
	defer c.Close()
	if clear {
		if _, err := c.CacheClear(T); err != nil {
			t.Fatal(err)
		}
	}
	out, err := workload.Run(c, wl, T)
	if err != nil {
		t.Fatalf("go planner: %v; daemon log:\n%s", err, d.Log())
	}
	return out
}

// killedRun runs w with the worker killed after `after` tokens, and checks
// the kill restarted the worker and cut a lane short (a re-admission).
func killedRun(t *testing.T, d *livetest.Daemon, w map[string]any, after int) *workload.Output {
	t.Helper()
	w["kill_worker_after_tokens"] = after
	killed := goRun(t, d, w, false)
	if !killed.Stats.Killed || killed.Stats.Restarts < 1 {
		t.Fatalf("the kill did not restart the worker: %+v", killed.Stats)
	}
	for _, r := range killed.Results {
		if r.Admissions > 1 {
			return killed
		}
	}
	t.Fatalf("the kill cut no lane short: %s", killed.JSON())
	return nil
}

// clearCache empties the prefix cache, so two runs see the same worker.
func clearCache(t *testing.T, d *livetest.Daemon) {
	c := d.Connect(t)
	defer c.Close()
	if _, err := c.CacheClear(T); err != nil {
		t.Fatal(err)
	}
}

func tokens(o *workload.Output) [][]uint32 {
	var out [][]uint32
	for _, r := range o.Results {
		out = append(out, r.Tokens)
	}
	return out
}

// compareWithPython: the Go planner's tokens equal the Python planner's on
// the same daemon, bitwise; with leases used; through a worker kill; and
// not vacuously (other rng positions give other tokens).
func compareWithPython(t *testing.T, d *livetest.Daemon) {
	clearCache(t, d)
	want := d.PythonPlan(t, mixed(0))
	got := goRun(t, d, mixed(0), true)
	if !reflect.DeepEqual(got.Results, want.Results) {
		t.Fatalf("go %s\npython %s", got.JSON(), (&workload.Output{Results: want.Results}).JSON())
	}
	// The same plans on the same (cleared) worker: the same ticks and leases too.
	if got.Stats != want.Stats {
		t.Errorf("stats: go %+v, python %+v", got.Stats, want.Stats)
	}
	if got.Stats.Leases == 0 || got.Stats.SeededTokens == 0 {
		t.Errorf("no seed lease was used: %+v", got.Stats)
	}
	r := want.Results
	if reflect.DeepEqual(r[2].Tokens, r[3].Tokens) {
		t.Errorf("perturb gave argmax's tokens: %v", r[2].Tokens)
	}

	t.Run("kill_worker_after_tokens", func(t *testing.T) {
		got := killedRun(t, d, mixed(0), 13)
		if !reflect.DeepEqual(tokens(got), tokens(want)) {
			t.Fatalf("after a kill: go %v\npython %v", tokens(got), tokens(want))
		}
	})

	t.Run("negative_control_other_rng_positions", func(t *testing.T) {
		got := goRun(t, d, mixed(1), false)
		g, w := tokens(got), tokens(want)
		for _, i := range []int{1, 4} { // the sampled requests moved their rng_base
			if reflect.DeepEqual(g[i], w[i]) {
				t.Errorf("request %d: the same tokens at other rng positions: %v", i+1, g[i])
			}
		}
		for _, i := range []int{0, 2, 3, 5, 6} {
			if !reflect.DeepEqual(g[i], w[i]) {
				t.Errorf("request %d changed with another request's rng_base: %v vs %v", i+1, g[i], w[i])
			}
		}
	})
}

func TestFakeRuntimeTokensMatchPythonPlanner(t *testing.T) {
	d := livetest.Serve(t, "--fake", "--restart-backoff", "0.05")
	compareWithPython(t, d)
}

func TestTinyModelTokensMatchPythonPlanner(t *testing.T) {
	d := tinyDaemon(t)
	compareWithPython(t, d)
}

// The tensor-parallel degree changes no bit: a `--tp 2` worker (two rank
// processes) gives the Go planner the tokens the shared `--tp 1` one gives.
// compareWithPython shows the sampled tokens move with rng_base, so equal
// non-empty tokens are not an accident of the draws.
func TestTP2WorkerGivesTheTokensOfTP1(t *testing.T) {
	describe := func(d *livetest.Daemon) sf.Parallel {
		c := d.Connect(t)
		defer c.Close()
		desc, err := c.Describe(T)
		if err != nil {
			t.Fatal(err)
		}
		return desc.Parallel
	}
	two := livetest.Serve(t, "--model", livetest.TinyModelDir(t), "--max-batch", "8", "--threads", "1",
		"--tp", "2", "--tp-timeout", "60")
	p2 := describe(two)
	got := goRun(t, two, mixed(0), false)
	two.Stop(t) // its ranks leave the cores to the second run
	one := tinyDaemon(t)
	p1 := describe(one)
	want := goRun(t, one, mixed(0), true)
	if p2 != (sf.Parallel{TP: 2, NNodes: 1}) || p1 != (sf.Parallel{TP: 1, NNodes: 1}) {
		t.Fatalf("describe: --tp 2 says %+v, --tp 1 says %+v", p2, p1)
	}
	for i, r := range want.Results {
		if len(r.Tokens) == 0 {
			t.Fatalf("request %d got no token: %s", i+1, want.JSON())
		}
	}
	if !reflect.DeepEqual(got.Results, want.Results) {
		t.Fatalf("--tp 2 %s\n--tp 1 %s", got.JSON(), want.JSON())
	}
}

// A worker too small for the requests at once: NeedsReplan, fewer admits,
// a preemption; the same results as the Python planner's, admissions too.
func TestMemoryPressureMatchesPythonPlanner(t *testing.T) {
	d := livetest.Serve(t, "--fake", "--kv-cells", "64", "--page", "4")
	var reqs []map[string]any
	for i := 0; i < 6; i++ {
		reqs = append(reqs, map[string]any{"prompt": with([]int{10 + i}, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21),
			"max_new_tokens": 12, "stop_at_eos": false, "sampling": "sample",
			"params": map[string]any{"temperature": 0.7}, "rng_base": i})
	}
	w := map[string]any{"requests": reqs}
	want := d.PythonPlan(t, w)
	b, _ := json.Marshal(w)
	wl, err := workload.Load(b)
	if err != nil {
		t.Fatal(err)
	}
	c := d.Connect(t)
	got, rep, err := workload.RunReport(c, wl, T)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Stats.Replans == 0 || rep.Stats.Preemptions == 0 { // negative control: memory was short
		t.Fatalf("no NeedsReplan, no preemption: %+v", rep.Stats)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("go %s\npython %s", got.JSON(), want.JSON())
	}
}

func TestLoadRefusesABadWorkload(t *testing.T) {
	for src, msg := range map[string]string{
		`[]`:                                    "a workload is a JSON object",
		`{}`:                                    "workload.requests is missing",
		`{"options": {"x": 1}, "requests": []}`: "options.x: not an option",
		`{"requests": [{"prompt": [1]}]}`:       "requests[0].max_new_tokens is missing",
		`{"requests": [{"prompt": [1], "max_new_tokens": 2, "sampling": "beam"}]}`:                                            "requests[0].sampling = 'beam'",
		`{"requests": [{"prompt": [1], "max_new_tokens": 2, "params": {"tmp": 1}}]}`:                                          "requests[0].params.tmp",
		`{"requests": [{"prompt": [1], "max_new_tokens": 2, "sampling": "host", "host_sampler": "x"}]}`:                       "host_sampler",
		`{"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": {"text": "a"}}]}`:                                      "requests[0].grammar: an object with kind",
		`{"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": "a"}]}`:                                                "requests[0].grammar: an object with kind",
		`{"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": {"kind": "choice"}}]}`:                                 "requests[0].grammar.choices is missing",
		`{"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": {"kind": "choice", "choices": [1]}}]}`:                 "requests[0].grammar.choices: a choice grammar",
		`{"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": {"kind": "regex"}}]}`:                                  "requests[0].grammar.text is missing",
		`{"requests": [{"prompt": [1], "max_new_tokens": 3, "grammar": {"kind": "regex", "text": ["a"]}}]}`:                   "requests[0].grammar.text: a regex grammar is a string",
		`{"requests": [{"prompt": [1], "max_new_tokens": 3, "sampling": "host", "grammar": {"kind": "regex", "text": "a"}}]}`: "requests[0].grammar: not with host sampling",
		`{"options": {"strategy": {"depth": 3}}, "requests": []}`:                                                             "options.strategy: an object of max_draft, ngram_min, ngram_max",
		`{"options": {"strategy": 3}, "requests": []}`:                                                                        "options.strategy: an object of",
		`{"options": {"strategy": {"max_draft": "eight"}}, "requests": []}`:                                                   "options.strategy.max_draft",
	} {
		if _, err := workload.Load([]byte(src)); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%s: %v, want %q", src, err, msg)
		}
	}
	w, err := workload.Load([]byte(`{"requests": [{"prompt": [1, 2], "max_new_tokens": 3, "rng_base": -1,
		"stop_at_eos": false, "publish": 0}], "options": {"use_leases": false, "prefill_chunk": null}}`))
	if err != nil || w.Requests[0].Opts.RngBase != math.MaxUint64 || !w.Requests[0].Opts.IgnoreEOS ||
		!w.Requests[0].Opts.NoPublish || !w.Options.NoLeases || w.KillAfter != -1 {
		t.Fatalf("%+v %v", w, err)
	}
	w, err = workload.Load([]byte(`{"requests": [{"prompt": [1], "max_new_tokens": 3, "sampling": "sample",
		"grammar": {"kind": "json_schema", "text": "{}"}}, {"prompt": [1], "max_new_tokens": 3,
		"grammar": {"kind": "choice", "choices": ["a", "b"]}}, {"prompt": [1], "max_new_tokens": 3, "grammar": null}]}`))
	if err != nil || !reflect.DeepEqual(w.Requests[0].Opts.Grammar, sf.JSONSchema("{}")) ||
		!reflect.DeepEqual(w.Requests[1].Opts.Grammar, sf.Choice("a", "b")) || w.Requests[2].Opts.Grammar != nil {
		t.Fatalf("grammars: %+v %v", w, err)
	}
	w, err = workload.Load([]byte(`{"options": {"strategy": {"max_draft": "6", "ngram_max": 3.7}}, "requests": [
		{"prompt": [1], "max_new_tokens": 3}, {"prompt": [1], "max_new_tokens": 3, "speculate": false}]}`))
	if err != nil || !reflect.DeepEqual(w.Options.Strategy, sf.PromptLookup(6, 1, 3)) ||
		w.Requests[0].Opts.NoSpeculate || !w.Requests[1].Opts.NoSpeculate {
		t.Fatalf("strategy: %+v %v", w, err)
	}
	for src, want := range map[string]*sf.Strategy{`{}`: nil, `{"strategy": null}`: nil,
		`{"strategy": {}}`: sf.PromptLookup(8, 1, 4)} {
		w, err := workload.Load([]byte(`{"options": ` + src + `, "requests": []}`))
		if err != nil || !reflect.DeepEqual(w.Options.Strategy, want) {
			t.Errorf("%s: %+v %v", src, w.Options.Strategy, err)
		}
	}
	_ = sf.SF_SAMPLING_HOST
}
