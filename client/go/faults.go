package superfluid

import "time"

// Fault schedules (contract §7 INSTALL_FAULTS / LIST_FAULTS / CLEAR_FAULTS;
// docs/faults.md), for a daemon started with --fault-injection: typed rules,
// encoded to exactly the maps the worker reads, and its listing decoded back.
// The worker checks every rule (a bad one is an *OpError, BadRequest, its
// message naming the field: "rules[0].when.token"); these types only give
// the maps their shape. Start from the constructors: OnToken(3).ForLane(7),
// InjectLaneFault(SF_FAULT_INTERNAL).

// Phase is the step an injection waits for: the next prefill or decode
// step, or PhaseNow, the trigger itself (a token rule's token, an op rule's op).
type Phase string

const (
	PhaseNow     Phase = "now"
	PhasePrefill Phase = "prefill"
	PhaseDecode  Phase = "decode"
)

// Trigger is what a rule counts to fire.
type Trigger int

const (
	TriggerTick   Trigger = iota + 1 // the worker's N-th accepted tick, counted from its start (N >= 1)
	TriggerToken                     // a lane about to take its N-th token generated in this worker (N >= 1)
	TriggerOp                        // the N-th op named Op since the install
	TriggerChance                    // each accepted tick, with probability P in (0, 1], drawn from the seed
)

// FaultWhen is a rule's when: its trigger, limited to a lane (not op rules)
// and to a worker epoch when Lane and Epoch are set.
type FaultWhen struct {
	Trigger Trigger
	N       uint64  // tick N, token K, op rule's nth
	Op      string  // op rules: the SF_OP_* name ("DESCRIBE"; any case)
	P       float64 // chance rules
	Lane    *uint64
	Epoch   *uint64
}

func OnTick(n uint64) FaultWhen            { return FaultWhen{Trigger: TriggerTick, N: n} }
func OnToken(k uint64) FaultWhen           { return FaultWhen{Trigger: TriggerToken, N: k} }
func OnOp(op string, nth uint64) FaultWhen { return FaultWhen{Trigger: TriggerOp, Op: op, N: nth} }
func OnChance(p float64) FaultWhen         { return FaultWhen{Trigger: TriggerChance, P: p} }

// ForLane: the rule is this lane's only.
func (w FaultWhen) ForLane(tag uint64) FaultWhen { w.Lane = &tag; return w }

// InEpoch: the rule fires only in the worker of this epoch.
func (w FaultWhen) InEpoch(epoch uint64) FaultWhen { w.Epoch = &epoch; return w }

// Injection is what a rule does (docs/faults.md says what each is reported as).
type Injection int

const (
	InjectionLaneFault Injection = iota + 1 // the lane faults with Code (tick, chance rules: Lane, else all decoded)
	InjectionFatal                          // the runtime fails at its next step of Phase: the worker exits 70
	InjectionCapacity                       // the next step of Phase fails for lack of memory: OOM_TENTATIVE
	InjectionStall                          // the next step of Phase first sleeps Ms (op rules: the op; PhaseNow)
	InjectionSlow                           // every step of the next Ticks ticks takes Ms longer
	InjectionNaN                            // the lane's next logits row is NaN: it faults SF_FAULT_NUMERIC
)

// FaultWhat is a rule's what.
type FaultWhat struct {
	Kind  Injection
	Code  uint32 // lane faults: SF_FAULT_*
	Phase Phase  // fatal, capacity; a stall's during
	Ms    uint32 // stall, slow
	Ticks uint32 // slow
}

func InjectLaneFault(code uint32) FaultWhat { return FaultWhat{Kind: InjectionLaneFault, Code: code} }
func InjectFatal(p Phase) FaultWhat         { return FaultWhat{Kind: InjectionFatal, Phase: p} }
func InjectCapacity(p Phase) FaultWhat      { return FaultWhat{Kind: InjectionCapacity, Phase: p} }
func InjectNaN() FaultWhat                  { return FaultWhat{Kind: InjectionNaN} }
func InjectStall(ms uint32, during Phase) FaultWhat {
	return FaultWhat{Kind: InjectionStall, Ms: ms, Phase: during}
}
func InjectSlow(ms, ticks uint32) FaultWhat {
	return FaultWhat{Kind: InjectionSlow, Ms: ms, Ticks: ticks}
}

// FaultRule is a rule of a schedule. Times: how often it fires; 0 sends
// none (the worker's default: once; a chance rule, every draw). In a
// listing, 0 is unlimited.
type FaultRule struct {
	When  FaultWhen
	What  FaultWhat
	Times uint32
}

// Fields are the rule's map, as INSTALL_FAULTS reads it (a zero Trigger or
// Kind sends an empty when or what: the worker refuses it, naming it).
func (r FaultRule) Fields() map[string]any {
	when := map[string]any{}
	switch w := r.When; w.Trigger {
	case TriggerTick:
		when["tick"] = w.N
	case TriggerToken:
		when["token"] = w.N
	case TriggerOp:
		when["op"], when["nth"] = w.Op, w.N
	case TriggerChance:
		when["chance"] = w.P
	}
	if r.When.Lane != nil {
		when["lane"] = *r.When.Lane
	}
	if r.When.Epoch != nil {
		when["epoch"] = *r.When.Epoch
	}
	what := map[string]any{}
	switch w := r.What; w.Kind {
	case InjectionLaneFault:
		what["fault"] = w.Code
	case InjectionFatal:
		what["fatal"] = string(w.Phase)
	case InjectionCapacity:
		what["capacity"] = string(w.Phase)
	case InjectionStall:
		what["stall_ms"], what["during"] = w.Ms, string(w.Phase)
	case InjectionSlow:
		what["slow_ms"], what["ticks"] = w.Ms, w.Ticks
	case InjectionNaN:
		what["nan"] = true
	}
	m := map[string]any{"when": when, "what": what}
	if r.Times > 0 {
		m["times"] = r.Times
	}
	return m
}

// FaultListing is LIST_FAULTS: the schedule's seed and its rules, each
// with how often it fired.
type FaultListing struct {
	Seed  uint64
	Rules []ListedFaultRule
}

type ListedFaultRule struct {
	FaultRule
	Fired uint64
}

// Injected: a fault schedule or INJECT_FAULT caused it (SF_FAULT_DETAIL_INJECTED).
func (f LaneFault) Injected() bool { return f.Detail&SF_FAULT_DETAIL_INJECTED != 0 }

// CodeName is the code's SF_FAULT_* name ("INTERNAL", "NUMERIC", ...).
func (f LaneFault) CodeName() string { return FaultName(f.Code) }

// InstallFaults: op INSTALL_FAULTS, rules replacing the worker's schedule
// (chance rules draw from seed); the rules installed. A rule the worker
// refuses is an *OpError (BadRequest, the message naming its field) and
// leaves the schedule as it was; Refused: no --fault-injection.
func (c *Conn) InstallFaults(rules []FaultRule, seed uint64, timeout time.Duration) (int, error) {
	fields := make([]map[string]any, len(rules))
	for i, r := range rules {
		fields[i] = r.Fields()
	}
	done, err := c.opOK("INSTALL_FAULTS", map[string]any{"rules": fields, "seed": seed}, nil, timeout)
	if err != nil {
		return 0, err
	}
	return int(done.Value), nil
}

// ListFaults: op LIST_FAULTS, the installed schedule and each rule's fired count.
func (c *Conn) ListFaults(timeout time.Duration) (*FaultListing, error) {
	done, err := c.opOK("LIST_FAULTS", nil, nil, timeout)
	if err != nil {
		return nil, err
	}
	return DecodeFaultListing(done.Payload)
}

// ClearFaults: op CLEAR_FAULTS, dropping every rule and whatever they armed; the rules dropped.
func (c *Conn) ClearFaults(timeout time.Duration) (int, error) {
	done, err := c.opOK("CLEAR_FAULTS", nil, nil, timeout)
	if err != nil {
		return 0, err
	}
	return int(done.Value), nil
}
