package superfluid

import (
	"fmt"
	"unsafe"
)

// Events is what a tick answered, copied out of its event-queue slot.
type Events struct {
	PlanSeq      uint64
	Status       uint32 // SF_STATUS_*: OK, or why the plan changed nothing
	TickStatus   uint32 // SF_TICK_*
	Message      string // why rejected, naming the field
	AdmitResults []AdmitResult
	Emits        []LaneEmit
	Faults       []LaneFault
	Shed         ShedReport
	ShedEntries  []ShedEntry
	Completions  []Completion
	Logprobs     []LaneLogprob
	Timings      TickTimings
	Mem          TickMemCounters
	WorkerEpoch  uint64
}

func (e *Events) StatusName() string { return StatusName(e.Status) }

// Err is a *RejectError unless the plan was applied.
func (e *Events) Err() error {
	if e.Status == SF_STATUS_OK {
		return nil
	}
	return &RejectError{PlanSeq: e.PlanSeq, Status: e.Status, Message: e.Message}
}

// Completion is an op's answer (contract §7); Payload is msgpack ({error} on failure).
type Completion struct {
	OpID    uint64
	Status  uint32 // SF_OPST_*
	Op      uint32 // SF_OP_*
	Handle  uint64
	Value   uint64
	Payload []byte
}

func (c *Completion) StatusName() string { return OpStatusName(c.Status) }
func (c *Completion) OpName() string     { return OpName(c.Op) }

// Err is an *OpError unless the op succeeded.
func (c *Completion) Err(name string) error {
	if c.Status == SF_OPST_OK {
		return nil
	}
	var body struct {
		Error string `codec:"error"`
	}
	_ = unpack(c.Payload, &body)
	return &OpError{Op: name, Status: c.Status, Message: body.Error}
}

// Decode unpacks the msgpack payload into v.
func (c *Completion) Decode(v any) error { return unpack(c.Payload, v) }

// A message that is not what a worker writes (someone scribbled on it).
type badMessage struct{ msg string }

func (e *badMessage) Error() string { return "a message that does not decode: " + e.msg }

func bad(f string, a ...any) error { return &badMessage{fmt.Sprintf(f, a...)} }

func readAt[T any](buf []byte, at uint64) (T, error) {
	var v T
	n := uint64(unsafe.Sizeof(v))
	if at > uint64(len(buf)) || n > uint64(len(buf))-at {
		return v, bad("%d bytes at %d overrun %d", n, at, len(buf))
	}
	copy(bytesOf(&v), buf[at:at+n])
	return v, nil
}

// list reads a Span of records; never trusts the other side's numbers.
func list[T any](arena []byte, s Span) ([]T, error) {
	if s.Count == 0 {
		return nil, nil
	}
	var zero T
	size := uint64(unsafe.Sizeof(zero))
	if s.Offset%SF_ARENA_ALIGN != 0 {
		return nil, bad("span offset %d is not aligned", s.Offset)
	}
	end := uint64(s.Offset) + uint64(s.Count)*size
	if end > uint64(len(arena)) {
		return nil, bad("span {%d, %d} overruns an arena of %d bytes", s.Offset, s.Count, len(arena))
	}
	out := make([]T, s.Count)
	for i := range out {
		copy(bytesOf(&out[i]), arena[uint64(s.Offset)+uint64(i)*size:])
	}
	return out, nil
}

func byteSpan(arena []byte, s Span) ([]byte, error) {
	if s.Count == 0 {
		return nil, nil
	}
	end := uint64(s.Offset) + uint64(s.Count)
	if end > uint64(len(arena)) {
		return nil, bad("byte span {%d, %d} overruns an arena of %d bytes", s.Offset, s.Count, len(arena))
	}
	return append([]byte(nil), arena[s.Offset:end]...), nil
}

// record is the slot's record of type R (record_bytes must be its size
// exactly: a size this build does not know is refused) and its arena.
func record[R any](slot []byte, h MsgHeader) (R, []byte, error) {
	var r R
	size := uint64(unsafe.Sizeof(r))
	if uint64(h.RecordBytes) != size {
		return r, nil, bad("a record of %d bytes, this build's is %d", h.RecordBytes, size)
	}
	hs := uint64(unsafe.Sizeof(h))
	r, err := readAt[R](slot, hs)
	if err != nil {
		return r, nil, err
	}
	at := hs + uint64(align(int(size)))
	if at > uint64(len(slot)) || h.ArenaBytes > uint64(len(slot))-at {
		return r, nil, bad("an arena of %d bytes overruns the slot", h.ArenaBytes)
	}
	return r, slot[at : at+h.ArenaBytes], nil
}

func completions(arena []byte, s Span) ([]Completion, error) {
	raw, err := list[OpCompletion](arena, s)
	if err != nil {
		return nil, err
	}
	out := make([]Completion, len(raw))
	for i, c := range raw {
		p, err := byteSpan(arena, c.Payload)
		if err != nil {
			return nil, err
		}
		out[i] = Completion{OpID: c.OpId, Status: c.Status, Op: c.Op, Handle: c.Handle, Value: c.Value, Payload: p}
	}
	return out, nil
}

func decodeEvents(slot []byte, h MsgHeader) (*Events, error) {
	e, arena, err := record[TickEvents](slot, h)
	if err != nil {
		return nil, err
	}
	ev := &Events{PlanSeq: e.PlanSeq, Status: e.Status, TickStatus: e.TickStatus, Shed: e.Shed, Timings: e.Timings,
		Mem: e.Mem, WorkerEpoch: e.WorkerEpoch}
	msg, err := byteSpan(arena, e.Message)
	ev.Message = string(msg)
	for _, step := range []func() error{
		func() (err error) { ev.AdmitResults, err = list[AdmitResult](arena, e.AdmitResults); return },
		func() (err error) { ev.Emits, err = list[LaneEmit](arena, e.Emits); return },
		func() (err error) { ev.Faults, err = list[LaneFault](arena, e.Faults); return },
		func() (err error) { ev.ShedEntries, err = list[ShedEntry](arena, e.Shed.Entries); return },
		func() (err error) { ev.Completions, err = completions(arena, e.OpCompletions); return },
		func() (err error) { ev.Logprobs, err = list[LaneLogprob](arena, e.Logprobs); return },
	} {
		if err == nil {
			err = step()
		}
	}
	return ev, err
}

// opEvents is an SF_MSG_OP_EVENTS message: completions of ops run between ticks.
type opEvents struct {
	epoch       uint64
	completions []Completion
}

func decodeOpEvents(slot []byte, h MsgHeader) (*opEvents, error) {
	o, arena, err := record[OpEvents](slot, h)
	if err != nil {
		return nil, err
	}
	cs, err := completions(arena, o.OpCompletions)
	return &opEvents{o.WorkerEpoch, cs}, err
}
