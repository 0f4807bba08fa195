package workload

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"superfluid"
)

// Request is one request of a workload, as Planner.Submit takes it.
type Request struct {
	Prompt       []uint32
	MaxNewTokens int
	Opts         superfluid.RequestOptions
}

// Workload is a loaded workload: planner options, requests, the kill point.
type Workload struct {
	Options   superfluid.PlannerOptions
	Requests  []Request
	KillAfter int // SIGKILL the worker once the requests hold this many tokens; -1: never
}

var optionNames = []string{"prefill_token_budget", "prefill_chunk", "decode_grant", "max_lanes", "use_leases",
	"strategy"}
var strategyNames = []string{"max_draft", "ngram_min", "ngram_max"}
var paramNames = []string{"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
	"freq_penalty"}
var samplings = map[string]uint32{"greedy": superfluid.SF_SAMPLING_GPU_GREEDY,
	"sample": superfluid.SF_SAMPLING_GPU_SAMPLE, "host": superfluid.SF_SAMPLING_HOST}

// Load parses a workload (client/workload.py's format); a bad one is an
// error naming the field, as the Python loader words it.
func Load(data []byte) (*Workload, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var top any
	if err := dec.Decode(&top); err != nil {
		return nil, err
	}
	w, ok := top.(map[string]any)
	if !ok {
		return nil, errors.New("a workload is a JSON object")
	}
	out := &Workload{KillAfter: -1}
	o := &out.Options
	o.PrefillTokenBudget, o.DecodeGrant = 512, 4
	opts, _ := w["options"].(map[string]any)
	for _, k := range sortedKeys(opts) {
		v := opts[k]
		var err error
		switch k {
		case "prefill_token_budget":
			o.PrefillTokenBudget, err = intOf(v, "options."+k)
		case "decode_grant":
			o.DecodeGrant, err = intOf(v, "options."+k)
		case "prefill_chunk", "max_lanes":
			n := 0
			if v != nil {
				n, err = intOf(v, "options."+k)
				if err == nil && n < 1 && k == "max_lanes" {
					n = 0 // Python's `max_lanes or max_batch`
				}
			}
			if k == "prefill_chunk" {
				if v != nil && n < 1 && err == nil {
					err = errors.New("prefill_token_budget, prefill_chunk and decode_grant are at least 1")
				}
				o.PrefillChunk = n
			} else {
				o.MaxLanes = n
			}
		case "use_leases":
			o.NoLeases = !truthy(v)
		case "strategy":
			if v != nil {
				o.Strategy, err = loadStrategy(v)
			}
		default:
			err = fmt.Errorf("options.%s: not an option (%s)", k, strings.Join(optionNames, ", "))
		}
		if err != nil {
			return nil, err
		}
	}
	if o.PrefillTokenBudget < 1 || o.DecodeGrant < 1 {
		return nil, errors.New("prefill_token_budget, prefill_chunk and decode_grant are at least 1")
	}
	raw, ok := w["requests"]
	if !ok {
		return nil, errors.New("workload.requests is missing")
	}
	reqs, ok := raw.([]any)
	if !ok {
		return nil, errors.New("workload.requests: a list of requests")
	}
	for n, x := range reqs {
		r, err := loadRequest(x, fmt.Sprintf("requests[%d]", n))
		if err != nil {
			return nil, err
		}
		out.Requests = append(out.Requests, r)
	}
	if v, ok := w["kill_worker_after_tokens"]; ok && v != nil {
		k, err := intOf(v, "kill_worker_after_tokens")
		if err != nil {
			return nil, err
		}
		out.KillAfter = k
	}
	return out, nil
}

func loadRequest(x any, where string) (Request, error) {
	r, ok := x.(map[string]any)
	if !ok {
		return Request{}, fmt.Errorf("%s: a JSON object", where)
	}
	var req Request
	name := "greedy"
	if v, ok := r["sampling"]; ok {
		name, _ = v.(string)
	}
	s, ok := samplings[name]
	if !ok {
		return req, fmt.Errorf("%s.sampling = %s: one of greedy, sample, host", where, repr(r["sampling"]))
	}
	req.Opts.Sampling = s
	params, _ := r["params"].(map[string]any)
	for _, k := range sortedKeys(params) {
		if !contains(paramNames, k) {
			return req, fmt.Errorf("%s.params.%s: not a sampling parameter", where, k)
		}
	}
	p := &req.Opts.Params
	for k, dst := range map[string]*float32{"temperature": &p.Temperature, "top_p": &p.TopP, "min_p": &p.MinP,
		"repeat_penalty": &p.RepeatPenalty, "presence_penalty": &p.PresencePenalty, "freq_penalty": &p.FreqPenalty} {
		if v, ok := params[k]; ok {
			f, err := floatOf(v, where+".params."+k)
			if err != nil {
				return req, err
			}
			*dst = float32(f)
		}
	}
	if v, ok := params["top_k"]; ok {
		k, err := intOf(v, where+".params.top_k")
		if err != nil {
			return req, err
		}
		p.TopK = uint32(k)
	}
	if s == superfluid.SF_SAMPLING_HOST {
		name := "argmax"
		if v, ok := r["host_sampler"]; ok {
			name, _ = v.(string)
		}
		f, ok := Samplers[name]
		if !ok {
			return req, fmt.Errorf("%s.host_sampler = %s: one of argmax, perturb", where, repr(r["host_sampler"]))
		}
		req.Opts.HostSampler = f
	}
	if g, ok := r["grammar"]; ok && g != nil {
		gr, err := loadGrammar(g, where)
		if err != nil {
			return req, err
		}
		if s == superfluid.SF_SAMPLING_HOST {
			return req, fmt.Errorf("%s.grammar: not with host sampling", where)
		}
		req.Opts.Grammar = gr
	}
	prompt, ok := r["prompt"]
	if !ok {
		return req, fmt.Errorf("%s.prompt is missing", where)
	}
	list, _ := prompt.([]any)
	for i, t := range list {
		n, err := intOf(t, fmt.Sprintf("%s.prompt[%d]", where, i))
		if err != nil {
			return req, err
		}
		req.Prompt = append(req.Prompt, uint32(n))
	}
	m, ok := r["max_new_tokens"]
	if !ok {
		return req, fmt.Errorf("%s.max_new_tokens is missing", where)
	}
	var err error
	if req.MaxNewTokens, err = intOf(m, where+".max_new_tokens"); err != nil {
		return req, err
	}
	if len(req.Prompt) == 0 || req.MaxNewTokens < 1 {
		return req, errors.New("a request needs a prompt and max_new_tokens >= 1")
	}
	if v, ok := r["rng_base"]; ok {
		n, ok := new(big.Int).SetString(fmt.Sprint(v), 10)
		if !ok {
			return req, fmt.Errorf("%s.rng_base: an integer", where)
		}
		req.Opts.RngBase = n.And(n, new(big.Int).SetUint64(math.MaxUint64)).Uint64() // & (2^64 - 1), as Python
	}
	if v, ok := r["publish"]; ok {
		req.Opts.NoPublish = !truthy(v)
	}
	if v, ok := r["stop_at_eos"]; ok {
		req.Opts.IgnoreEOS = !truthy(v)
	}
	if v, ok := r["speculate"]; ok {
		req.Opts.NoSpeculate = !truthy(v)
	}
	return req, nil
}

// loadStrategy reads options.strategy as client/workload.py does: an object
// of some of max_draft, ngram_min, ngram_max (the rest DefaultStrategy's),
// each Python's int() of it.
func loadStrategy(v any) (*superfluid.Strategy, error) {
	m, ok := v.(map[string]any)
	bad := fmt.Errorf("options.strategy: an object of %s", strings.Join(strategyNames, ", "))
	if !ok {
		return nil, bad
	}
	for k := range m {
		if !contains(strategyNames, k) {
			return nil, bad
		}
	}
	s := superfluid.DefaultStrategy()
	for k, dst := range map[string]*int{"max_draft": &s.MaxDraft, "ngram_min": &s.NgramMin, "ngram_max": &s.NgramMax} {
		if x, ok := m[k]; ok {
			if str, isStr := x.(string); isStr { // int("8"), not int("8.5")
				if _, err := strconv.Atoi(strings.TrimSpace(str)); err != nil {
					return nil, fmt.Errorf("options.strategy.%s: an integer", k)
				}
				x = json.Number(strings.TrimSpace(str))
			}
			n, err := intOf(x, "options.strategy."+k)
			if err != nil {
				return nil, err
			}
			*dst = n
		}
	}
	return &s, nil
}

// loadGrammar reads a request's "grammar" as client/workload.py does (and
// checks it as client/grammars.py does), a bad one naming its field.
func loadGrammar(v any, where string) (*superfluid.Grammar, error) {
	g, ok := v.(map[string]any)
	if _, has := g["kind"]; !ok || !has {
		return nil, fmt.Errorf("%s.grammar: an object with kind and text (or choices)", where)
	}
	kind, ok := g["kind"].(string)
	if !ok {
		return nil, fmt.Errorf("%s.grammar.kind: a string", where)
	}
	field := "text"
	if kind == "choice" {
		field = "choices"
	}
	x, ok := g[field]
	if !ok {
		return nil, fmt.Errorf("%s.grammar.%s is missing", where, field)
	}
	if kind != "choice" {
		text, ok := x.(string)
		if !ok {
			return nil, fmt.Errorf("%s.grammar.text: a %s grammar is a string", where, kind)
		}
		return &superfluid.Grammar{Kind: kind, Text: text}, nil
	}
	list, ok := x.([]any)
	choices := make([]string, 0, len(list))
	for _, c := range list {
		s, isStr := c.(string)
		ok = ok && isStr
		choices = append(choices, s)
	}
	if !ok {
		return nil, fmt.Errorf("%s.grammar.choices: a choice grammar is a list of strings", where)
	}
	return &superfluid.Grammar{Kind: kind, Choices: choices}, nil
}

// Output is the results JSON of `superfluid plan`.
type Output struct {
	Results []Result `json:"results"`
	Stats   Stats    `json:"stats"`
}

type Result struct {
	ID         int      `json:"id"`
	Tokens     []uint32 `json:"tokens"`
	Finish     *string  `json:"finish"`
	Admissions int      `json:"admissions"`
}

type Stats struct {
	Ticks         int  `json:"ticks"`
	Restarts      int  `json:"restarts"`
	SeededTokens  int  `json:"seeded_tokens"`
	Leases        int  `json:"leases"`
	Tokens        int  `json:"tokens"`
	Killed        bool `json:"killed"`
	DraftProposed int  `json:"draft_proposed"`
	DraftAccepted int  `json:"draft_accepted"`
}

// Run runs the workload on a connected worker (client/workload.py's run).
func Run(c *superfluid.Conn, w *Workload, timeout time.Duration) (*Output, error) {
	out, _, err := RunReport(c, w, timeout)
	return out, err
}

// RunReport is Run with the planner's whole report (replans, preemptions, ...).
func RunReport(c *superfluid.Conn, w *Workload, timeout time.Duration) (*Output, *superfluid.Report, error) {
	o := w.Options
	o.ReconnectTimeout = timeout
	p, err := superfluid.NewPlanner(c, o)
	if err != nil {
		return nil, nil, err
	}
	for _, r := range w.Requests {
		if _, err := p.Submit(r.Prompt, r.MaxNewTokens, r.Opts); err != nil {
			return nil, nil, err
		}
	}
	killed := false
	deadline := time.Now().Add(timeout)
	for p.Busy() {
		if time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("the workload is still running after %v", timeout)
		}
		if err := p.Step(p.Opts.TickTimeout); err != nil {
			return nil, nil, err
		}
		// pid 0 while the daemon starts a worker: kill(0) would hit our own group.
		if w.KillAfter >= 0 && !killed && c.WorkerPID() > 0 && generated(p) >= w.KillAfter {
			if err := syscall.Kill(c.WorkerPID(), syscall.SIGKILL); err != nil {
				return nil, nil, fmt.Errorf("kill the worker: %w", err)
			}
			killed = true
		}
	}
	rep := p.Report()
	out := &Output{Stats: Stats{Ticks: rep.Stats.Ticks, Restarts: rep.Stats.Restarts,
		SeededTokens: rep.Stats.SeededTokens, Leases: rep.Stats.Leases, Tokens: rep.Stats.Tokens, Killed: killed,
		DraftProposed: rep.Stats.DraftProposed, DraftAccepted: rep.Stats.DraftAccepted}}
	for _, r := range rep.Results {
		res := Result{ID: r.ID, Tokens: r.Tokens, Admissions: r.Admissions}
		if res.Tokens == nil {
			res.Tokens = []uint32{}
		}
		if r.Finish != "" {
			f := r.Finish
			res.Finish = &f
		}
		out.Results = append(out.Results, res)
	}
	return out, rep, nil
}

func generated(p *superfluid.Planner) int {
	n := 0
	for _, r := range p.Requests() {
		n += len(r.Generated)
	}
	return n
}

// JSON is the output as Python's json.dumps writes it (", " and ": ").
func (o *Output) JSON() string {
	var b strings.Builder
	b.WriteString(`{"results": [`)
	for i, r := range o.Results {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, `{"id": %d, "tokens": [`, r.ID)
		for j, t := range r.Tokens {
			if j > 0 {
				b.WriteString(", ")
			}
			fmt.Fprint(&b, t)
		}
		finish := "null"
		if r.Finish != nil {
			finish = `"` + *r.Finish + `"`
		}
		fmt.Fprintf(&b, `], "finish": %s, "admissions": %d}`, finish, r.Admissions)
	}
	s := o.Stats
	fmt.Fprintf(&b, `], "stats": {"ticks": %d, "restarts": %d, "seeded_tokens": %d, "leases": %d, "tokens": %d, `+
		`"killed": %t, "draft_proposed": %d, "draft_accepted": %d}}`, s.Ticks, s.Restarts, s.SeededTokens, s.Leases,
		s.Tokens, s.Killed, s.DraftProposed, s.DraftAccepted)
	return b.String()
}

// ------------------------------------------------------------- JSON values

func intOf(v any, where string) (int, error) {
	n, ok := v.(json.Number)
	if !ok {
		if b, isBool := v.(bool); isBool { // Python's int(True)
			if b {
				return 1, nil
			}
			return 0, nil
		}
		return 0, fmt.Errorf("%s: a number", where)
	}
	if i, err := n.Int64(); err == nil {
		return int(i), nil
	}
	f, err := n.Float64()
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, fmt.Errorf("%s: a number", where)
	}
	return int(f), nil // Python's int() truncates
}

func floatOf(v any, where string) (float64, error) {
	n, ok := v.(json.Number)
	if !ok {
		return 0, fmt.Errorf("%s: a number", where)
	}
	return n.Float64()
}

// truthy is Python's bool() of a JSON value.
func truthy(v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case json.Number:
		f, _ := x.Float64()
		return f != 0
	case string:
		return x != ""
	case []any:
		return len(x) > 0
	case map[string]any:
		return len(x) > 0
	}
	return true
}

func repr(v any) string {
	if s, ok := v.(string); ok {
		return "'" + s + "'"
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func sortedKeys(m map[string]any) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}
