package superfluid

import "unsafe"

// Plan is one tick's plan. Lists keep the order they are added in (prefills
// run in that order). PlanSeq 0 lets the connection number it;
// MaxDecodeLanes 0 means "the decodes added".
type Plan struct {
	PlanSeq               uint64
	Flags                 uint32 // SF_PLAN_*
	MaxDecodeLanes        uint32
	PrefillTokenBudget    uint32
	EvictableCacheClasses uint32 // SF_CACHE_*
	MaxEvictBytes         uint64
	ProtectedQuotaBytes   uint64
	Admits                []LaneAdmit
	Prefills              []LanePrefill
	Decodes               []LaneDecode
	Commits               []LaneCommit
	Retires               []LaneRetire
}

// NewPlan is an empty plan with a prefill budget.
func NewPlan(prefillTokenBudget uint32) *Plan { return &Plan{PrefillTokenBudget: prefillTokenBudget} }

// Admit adds a lane admission: any LaneAdmit field (sampling, params,
// rng_counter_base, decode_replay, seed_handle, determinism_class, ...).
func (p *Plan) Admit(a LaneAdmit) *Plan {
	p.Admits = append(p.Admits, a)
	return p
}

// AdmitGreedy adds a greedy lane with default parameters.
func (p *Plan) AdmitGreedy(tag uint64, prompt RingRef) *Plan {
	return p.Admit(LaneAdmit{LaneTag: tag, Prompt: prompt, Sampling: SF_SAMPLING_GPU_GREEDY})
}

func (p *Plan) Prefill(tag uint64, tokenOffset, tokenCount uint32) *Plan {
	p.Prefills = append(p.Prefills, LanePrefill{LaneTag: tag, TokenOffset: tokenOffset, TokenCount: tokenCount})
	return p
}

func (p *Plan) Decode(tag uint64, maxNewTokens uint16) *Plan {
	p.Decodes = append(p.Decodes, LaneDecode{LaneTag: tag, MaxNewTokens: maxNewTokens})
	return p
}

// DecodeOvershoot grants rounds plus what a verified draft may run past them.
func (p *Plan) DecodeOvershoot(tag uint64, maxNewTokens, overshoot uint16) *Plan {
	p.Decodes = append(p.Decodes, LaneDecode{LaneTag: tag, MaxNewTokens: maxNewTokens, Overshoot: overshoot})
	return p
}

func (p *Plan) Commit(c LaneCommit) *Plan {
	p.Commits = append(p.Commits, c)
	return p
}

func (p *Plan) Retire(tag uint64, publish bool) *Plan {
	r := LaneRetire{LaneTag: tag}
	if publish {
		r.PublishToCache = 1
	}
	p.Retires = append(p.Retires, r)
	return p
}

// AllowEvict lets the memory check evict the resident prefix cache, at most
// maxBytes, never below protectedBytes of it.
func (p *Plan) AllowEvict(maxBytes, protectedBytes uint64) *Plan {
	p.EvictableCacheClasses |= SF_CACHE_RESIDENT_PREFIX_CLASS
	p.MaxEvictBytes, p.ProtectedQuotaBytes = maxBytes, protectedBytes
	return p
}

// Encode is the plan as a plan-queue message: MsgHeader, the TickPlan, then
// the arena at the next SF_ARENA_ALIGN boundary, every list a Span into it.
func (p *Plan) Encode(planSeq, session uint64) []byte {
	var arena []byte
	admits := put(&arena, p.Admits)
	prefills := put(&arena, p.Prefills)
	decodes := put(&arena, p.Decodes)
	commits := put(&arena, p.Commits)
	retires := put(&arena, p.Retires)
	mdl := p.MaxDecodeLanes
	if mdl == 0 {
		mdl = uint32(len(p.Decodes))
	}
	rec := TickPlan{
		StructSize: uint64(unsafe.Sizeof(TickPlan{})), PlanSeq: planSeq, Flags: p.Flags, MaxDecodeLanes: mdl,
		PrefillTokenBudget: p.PrefillTokenBudget, EvictableCacheClasses: p.EvictableCacheClasses,
		MaxEvictBytes: p.MaxEvictBytes, ProtectedQuotaBytes: p.ProtectedQuotaBytes,
		Admits: admits, Prefills: prefills, Decodes: decodes, Commits: commits, Retires: retires,
	}
	return message(SF_MSG_PLAN, &rec, arena, session)
}

// message lays out MsgHeader, record, arena (contract §1, the header's wire rules).
func message[R any](kind uint32, rec *R, arena []byte, session uint64) []byte {
	size := int(unsafe.Sizeof(*rec))
	h := MsgHeader{Kind: kind, RecordBytes: uint32(size), ArenaBytes: uint64(len(arena)), Session: session}
	hs := int(unsafe.Sizeof(h))
	at := hs + align(size)
	out := make([]byte, at+len(arena))
	copy(out, bytesOf(&h))
	copy(out[hs:], bytesOf(rec))
	copy(out[at:], arena)
	return out
}

func align(n int) int { return (n + SF_ARENA_ALIGN - 1) / SF_ARENA_ALIGN * SF_ARENA_ALIGN }

// bytesOf views a record as its bytes (records have explicit padding, and Go
// zeroes it: no byte is undefined).
func bytesOf[T any](v *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v))
}

func put[T any](arena *[]byte, items []T) Span {
	if len(items) == 0 {
		return Span{}
	}
	off := len(*arena)
	for i := range items {
		*arena = append(*arena, bytesOf(&items[i])...)
	}
	for len(*arena)%SF_ARENA_ALIGN != 0 {
		*arena = append(*arena, 0)
	}
	return Span{Offset: uint32(off), Count: uint32(len(items))}
}
