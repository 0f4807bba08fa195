package superfluid

import "fmt"

// The LIST_FAULTS payload, decoded to typed rules (faults.go).

// DecodeFaultListing decodes a LIST_FAULTS payload. The worker lists each
// rule's when and what as they were installed (by any client, or by `serve
// --fault-schedule`): codes and ops may be names or numbers. What does not
// decode is a *BoundsError naming it.
func DecodeFaultListing(payload []byte) (*FaultListing, error) {
	var body struct {
		Seed  uint64 `codec:"seed"`
		Rules []struct {
			When  map[string]any `codec:"when"`
			What  map[string]any `codec:"what"`
			Times *uint64        `codec:"times"`
			Fired uint64         `codec:"fired"`
		} `codec:"rules"`
	}
	if err := unpack(payload, &body); err != nil {
		return nil, &BoundsError{fmt.Sprintf("LIST_FAULTS payload: %v", err)}
	}
	out := &FaultListing{Seed: body.Seed, Rules: make([]ListedFaultRule, len(body.Rules))}
	for i, r := range body.Rules {
		at := fmt.Sprintf("rules[%d]", i)
		when, err := whenOf(r.When, at+".when")
		if err != nil {
			return nil, err
		}
		what, err := whatOf(r.What, at+".what")
		if err != nil {
			return nil, err
		}
		rule := FaultRule{When: when, What: what}
		if r.Times != nil {
			if rule.Times, err = u32(*r.Times, at+".times"); err != nil {
				return nil, err
			}
		}
		out.Rules[i] = ListedFaultRule{rule, r.Fired}
	}
	return out, nil
}

func listingError(at string, v any, what string) error {
	return &BoundsError{fmt.Sprintf("LIST_FAULTS payload: %s: %v is not %s", at, v, what)}
}

// uintOf is a msgpack integer >= 0, however the decoder typed it.
func uintOf(v any, at string) (uint64, error) {
	switch n := v.(type) {
	case uint64:
		return n, nil
	case int64:
		if n >= 0 {
			return uint64(n), nil
		}
	case uint32:
		return uint64(n), nil
	case int:
		if n >= 0 {
			return uint64(n), nil
		}
	}
	return 0, listingError(at, v, "an unsigned integer")
}

func u32(n uint64, at string) (uint32, error) {
	if n > 1<<32-1 {
		return 0, listingError(at, n, "a u32")
	}
	return uint32(n), nil
}

func whenOf(m map[string]any, at string) (FaultWhen, error) {
	var w FaultWhen
	var err error
	opt := func(key string) (*uint64, error) {
		v, ok := m[key]
		if !ok {
			return nil, nil
		}
		n, err := uintOf(v, at+"."+key)
		return &n, err
	}
	if v, ok := m["tick"]; ok {
		w.Trigger = TriggerTick
		w.N, err = uintOf(v, at+".tick")
	} else if v, ok := m["token"]; ok {
		w.Trigger = TriggerToken
		w.N, err = uintOf(v, at+".token")
	} else if v, ok := m["op"]; ok {
		w.Trigger, w.N = TriggerOp, 1
		if s, isName := v.(string); isName {
			w.Op = s
		} else {
			var code uint64
			code, err = uintOf(v, at+".op")
			w.Op = OpName(uint32(code))
		}
		if nth, ok := m["nth"]; ok && err == nil {
			w.N, err = uintOf(nth, at+".nth")
		}
	} else if v, ok := m["chance"]; ok {
		w.Trigger = TriggerChance
		switch p := v.(type) {
		case float64:
			w.P = p
		case float32:
			w.P = float64(p)
		default:
			var n uint64
			n, err = uintOf(v, at+".chance") // 1
			w.P = float64(n)
		}
	} else {
		return w, listingError(at, m, "a when (tick, token, op or chance)")
	}
	if err == nil {
		w.Lane, err = opt("lane")
	}
	if err == nil {
		w.Epoch, err = opt("epoch")
	}
	return w, err
}

func whatOf(m map[string]any, at string) (FaultWhat, error) {
	var w FaultWhat
	phase := func(key string, dflt Phase) (Phase, error) {
		v, ok := m[key]
		if !ok {
			return dflt, nil // op and token rules may leave during out
		}
		if s, _ := v.(string); s == string(PhaseNow) || s == string(PhasePrefill) || s == string(PhaseDecode) {
			return Phase(s), nil
		}
		return "", listingError(at+"."+key, v, "a phase")
	}
	ms := func(key string) (uint32, error) {
		n, err := uintOf(m[key], at+"."+key)
		if err != nil {
			return 0, err
		}
		return u32(n, at+"."+key)
	}
	var err error
	if v, ok := m["fault"]; ok {
		w.Kind = InjectionLaneFault
		if s, isName := v.(string); isName {
			if w.Code, ok = FaultCode(s); !ok {
				return w, listingError(at+".fault", v, "a fault code")
			}
		} else if n, e := uintOf(v, at+".fault"); e != nil {
			return w, e
		} else {
			w.Code, err = u32(n, at+".fault")
		}
	} else if _, ok := m["fatal"]; ok {
		w.Kind = InjectionFatal
		w.Phase, err = phase("fatal", "")
	} else if _, ok := m["capacity"]; ok {
		w.Kind = InjectionCapacity
		w.Phase, err = phase("capacity", "")
	} else if _, ok := m["stall_ms"]; ok {
		w.Kind = InjectionStall
		if w.Ms, err = ms("stall_ms"); err == nil {
			w.Phase, err = phase("during", PhaseNow)
		}
	} else if _, ok := m["slow_ms"]; ok {
		w.Kind = InjectionSlow
		if w.Ms, err = ms("slow_ms"); err == nil {
			w.Ticks, err = ms("ticks")
		}
	} else if _, ok := m["nan"]; ok {
		w.Kind = InjectionNaN
	} else {
		return w, listingError(at, m, "a what (fault, fatal, capacity, stall_ms, slow_ms or nan)")
	}
	return w, err
}
