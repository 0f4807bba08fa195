package superfluid_test

import (
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"testing"

	"github.com/ugorji/go/codec"
	sf "superfluid"
	"superfluid/internal/livetest"
)

func faultRules() []sf.FaultRule {
	return []sf.FaultRule{
		{When: sf.OnToken(3), What: sf.InjectLaneFault(sf.SF_FAULT_INTERNAL)},
		{When: sf.OnTick(2).ForLane(7).InEpoch(1), What: sf.InjectStall(50, sf.PhaseDecode), Times: 2},
		{When: sf.OnOp("DESCRIBE", 2), What: sf.InjectFatal(sf.PhaseNow)},
		{When: sf.OnChance(0.25), What: sf.InjectSlow(5, 3)},
		{When: sf.OnToken(1).ForLane(9), What: sf.InjectNaN()},
		{When: sf.OnTick(4), What: sf.InjectCapacity(sf.PhasePrefill)},
	}
}

// mp is what any msgpack peer (Python's msgpack) reads or writes.
func mp(t *testing.T, v any) []byte {
	t.Helper()
	var b []byte
	if err := codec.NewEncoderBytes(&b, &codec.MsgpackHandle{WriteExt: true}).Encode(v); err != nil {
		t.Fatal(err)
	}
	return b
}

// Rules are the maps INSTALL_FAULTS reads; a listing, however its rules were
// spelled (a code's name, an op's number, stall_ms without during), decodes
// to the typed rules; a what that is none of them is named.
func TestFaultRulesEncodeAndAListingDecodes(t *testing.T) {
	rules := faultRules()
	for i, want := range []string{
		"map[what:map[fault:2] when:map[token:3]]",
		"map[times:2 what:map[during:decode stall_ms:50] when:map[epoch:1 lane:7 tick:2]]",
		"map[what:map[fatal:now] when:map[nth:2 op:DESCRIBE]]",
		"map[what:map[slow_ms:5 ticks:3] when:map[chance:0.25]]",
		"map[what:map[nan:true] when:map[lane:9 token:1]]",
		"map[what:map[capacity:prefill] when:map[tick:4]]",
	} {
		if got := fmt.Sprint(rules[i].Fields()); got != want { // fmt prints maps by sorted key
			t.Errorf("rule %d: %s, want %s", i, got, want)
		}
	}
	var listed []any
	for i, r := range rules {
		m := r.Fields()
		m["fired"] = i
		listed = append(listed, m)
	}
	listed = append(listed,
		map[string]any{"when": map[string]any{"op": sf.SF_OP_LIST_LANES}, "what": map[string]any{"stall_ms": 7},
			"times": 1, "fired": 0},
		map[string]any{"when": map[string]any{"tick": 1}, "what": map[string]any{"fault": "numeric"}, "times": 1,
			"fired": 1})
	l, err := sf.DecodeFaultListing(mp(t, map[string]any{"seed": 5, "rules": listed}))
	if err != nil {
		t.Fatal(err)
	}
	wantRules := append(faultRules(),
		sf.FaultRule{When: sf.OnOp("LIST_LANES", 1), What: sf.InjectStall(7, sf.PhaseNow), Times: 1},
		sf.FaultRule{When: sf.OnTick(1), What: sf.InjectLaneFault(sf.SF_FAULT_NUMERIC), Times: 1})
	if l.Seed != 5 || len(l.Rules) != len(wantRules) {
		t.Fatalf("%+v", l)
	}
	for i, r := range l.Rules {
		if !reflect.DeepEqual(r.FaultRule, wantRules[i]) || r.Fired != []uint64{0, 1, 2, 3, 4, 5, 0, 1}[i] {
			t.Errorf("rule %d: %+v, want %+v", i, r, wantRules[i])
		}
	}
	bad := mp(t, map[string]any{"seed": 5, "rules": []any{map[string]any{"when": map[string]any{"tick": 1},
		"what": map[string]any{}, "fired": 0}}})
	var be *sf.BoundsError
	if _, err := sf.DecodeFaultListing(bad); !errors.As(err, &be) || !strings.Contains(err.Error(), "rules[0].what") {
		t.Fatalf("a what of nothing: %v", err)
	}
	f := sf.LaneFault{LaneTag: 1, Code: sf.SF_FAULT_NUMERIC, Detail: sf.SF_FAULT_DETAIL_INJECTED | 3}
	if !f.Injected() || f.CodeName() != "NUMERIC" || (sf.LaneFault{Detail: 3}).Injected() || sf.FaultName(99) != "unknown" {
		t.Fatalf("%+v", f)
	}
}

// Against a live `serve --fake --fault-injection`: a schedule installed and
// listed back typed, with fired counts; injected lane faults seen in a raw
// plan (code and the injected bit); the planner finishing a request through
// one with the tokens of a clean run; a bad rule refused naming its field;
// ClearFaults' count.
func TestFaultSchedulesAgainstALiveDaemon(t *testing.T) {
	d := livetest.Serve(t, "--fake", "--fault-injection")
	c := d.Connect(t)
	defer c.Close()
	rules := []sf.FaultRule{
		{When: sf.OnToken(3).ForLane(7), What: sf.InjectLaneFault(sf.SF_FAULT_INTERNAL)},
		{When: sf.OnToken(2).ForLane(8), What: sf.InjectNaN()},
		{When: sf.OnTick(1), What: sf.InjectSlow(1, 1)},
		{When: sf.OnChance(0.5).InEpoch(99), What: sf.InjectStall(1, sf.PhaseDecode)}, // never: epoch 99
	}
	if n, err := c.InstallFaults(rules, 7, T); err != nil || n != 4 {
		t.Fatalf("install: %d %v", n, err)
	}
	fired := func() []uint64 {
		l, err := c.ListFaults(T)
		if err != nil {
			t.Fatal(err)
		}
		out := []uint64{}
		for _, r := range l.Rules {
			out = append(out, r.Fired)
		}
		return out
	}
	l, err := c.ListFaults(T)
	if err != nil || l.Seed != 7 || len(l.Rules) != 4 {
		t.Fatalf("list: %+v %v", l, err)
	}
	for i, r := range l.Rules {
		want := rules[i]
		if i < 3 {
			want.Times = 1 // the default, listed; a chance rule's is unlimited (0)
		}
		if !reflect.DeepEqual(r.FaultRule, want) || r.Fired != 0 {
			t.Fatalf("listed rule %d: %+v, want %+v", i, r, want)
		}
	}

	// Two lanes in one plan (the worker's first tick): 7 faults INTERNAL at
	// its 3rd token, 8 NUMERIC at its 2nd (a NaN row); both marked injected.
	p := sf.NewPlan(64)
	for tag, prompt := range map[uint64][]uint32{7: {5, 6, 7, 8, 9}, 8: {9, 8, 7, 6, 5}} {
		r, err := c.WritePrompt(prompt)
		if err != nil {
			t.Fatal(err)
		}
		p.AdmitGreedy(tag, r).Prefill(tag, 0, uint32(len(prompt))).Decode(tag, 8)
	}
	for i := range p.Admits {
		p.Admits[i].Params.Flags = sf.SF_PARAM_IGNORE_EOS
	}
	ev, err := c.Tick(p, T)
	if err != nil || ev.Err() != nil {
		t.Fatalf("tick: %v %v", err, ev.Err())
	}
	var faults []string
	for _, f := range ev.Faults {
		faults = append(faults, fmt.Sprintf("%d %s %v", f.LaneTag, f.CodeName(), f.Injected()))
	}
	sort.Strings(faults)
	if fmt.Sprint(faults) != "[7 INTERNAL true 8 NUMERIC true]" {
		t.Fatalf("faults %v", faults)
	}
	if ev, err = c.Tick(sf.NewPlan(0).Retire(7, false).Retire(8, false), T); err != nil || ev.Err() != nil {
		t.Fatalf("retire: %v %v", err, ev.Err())
	}
	if got := fired(); !reflect.DeepEqual(got, []uint64{1, 1, 1, 0}) {
		t.Fatalf("fired %v", got)
	}

	// A bad rule: BadRequest naming its field; the schedule stays.
	_, err = c.InstallFaults([]sf.FaultRule{{When: sf.OnToken(0), What: sf.InjectNaN()}}, 0, T)
	var oe *sf.OpError
	if !errors.As(err, &oe) || oe.Status != sf.SF_OPST_BadRequest || !strings.Contains(oe.Message, "rules[0].when.token") {
		t.Fatalf("a token 0 rule: %v", err)
	}
	if got := fired(); len(got) != 4 {
		t.Fatalf("the schedule changed: %v", got)
	}
	if n, err := c.ClearFaults(T); err != nil || n != 4 || len(fired()) != 0 {
		t.Fatalf("clear: %d %v", n, err)
	}

	// The planner through an injected fault: the lane is re-admitted and the
	// request ends with the tokens of a run without it.
	pl, err := sf.NewPlanner(c, sf.PlannerOptions{DecodeGrant: 2})
	if err != nil {
		t.Fatal(err)
	}
	run := func() sf.RequestResult {
		if _, err := pl.Submit([]uint32{11, 12, 13, 14}, 12, sf.RequestOptions{IgnoreEOS: true}); err != nil {
			t.Fatal(err)
		}
		rep, err := pl.RunUntilDone(T)
		if err != nil {
			t.Fatal(err)
		}
		return rep.Results[len(rep.Results)-1]
	}
	clean := run()
	if len(clean.Tokens) != 12 || clean.Finish != "max_tokens" || clean.Admissions != 1 || pl.Stats.Faults != 0 {
		t.Fatalf("clean run: %+v, %d faults", clean, pl.Stats.Faults)
	}
	rule := sf.FaultRule{When: sf.OnToken(5), What: sf.InjectLaneFault(sf.SF_FAULT_INJECTED)}
	if n, err := c.InstallFaults([]sf.FaultRule{rule}, 0, T); err != nil || n != 1 {
		t.Fatalf("install: %d %v", n, err)
	}
	faulted := run()
	if pl.Stats.Faults != 1 || faulted.Admissions != 2 { // negative control: the rule did fire
		t.Fatalf("faulted run: %+v, %d faults", faulted, pl.Stats.Faults)
	}
	if !reflect.DeepEqual(faulted.Tokens, clean.Tokens) || faulted.Finish != clean.Finish {
		t.Fatalf("faulted %v %s, clean %v %s", faulted.Tokens, faulted.Finish, clean.Tokens, clean.Finish)
	}
	if got := fired(); !reflect.DeepEqual(got, []uint64{1}) {
		t.Fatalf("fired %v", got)
	}
	if n, err := c.ClearFaults(T); err != nil || n != 1 {
		t.Fatalf("clear: %d %v", n, err)
	}
}
