package superfluid

/*
#include "superfluid.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"
)

// Op runs op name (contract §7: "DESCRIBE", "LEASE_SEED", ...) with fields (a
// msgpack map's other keys) and waits for its completion, whether it comes
// between ticks (OpEvents) or inside a tick's events. A failed op is a
// completion with its status: see Completion.Err.
func (c *Conn) Op(name string, fields map[string]any, timeout time.Duration) (*Completion, error) {
	deadline := time.Now().Add(timeout)
	if err := c.CheckWorker(); err != nil {
		return nil, err
	}
	id := c.nextOp
	c.nextOp++
	m := make(map[string]any, len(fields)+2)
	for k, v := range fields {
		m[k] = v
	}
	m["op"], m["op_id"] = name, id
	body, err := pack(m)
	if err != nil {
		return nil, &BoundsError{fmt.Sprintf("op %s: %v", name, err)}
	}
	h := MsgHeader{Kind: SF_MSG_OP, ArenaBytes: uint64(len(body)), Session: c.Session}
	hs := int(unsafe.Sizeof(h))
	if hs+len(body) > int(c.v.ops.slot_bytes) {
		return nil, &BoundsError{fmt.Sprintf("op %s: %d bytes do not fit an op slot", name, hs+len(body))}
	}
	i, err := c.waitSlot(c.v.ops, timeout, true, "op queue room")
	if err != nil {
		return nil, err
	}
	s := slot(c.v.ops, i)
	copy(s, bytesOf(&h))
	copy(s[hs:], body)
	C.sf_queue_publish(c.v.ops)
	for {
		if done, ok := c.completions[id]; ok {
			delete(c.completions, id)
			return done, nil
		}
		if time.Now().After(deadline) {
			return nil, &TimeoutError{fmt.Sprintf("op %s (op_id %d)", name, id)}
		}
		if err := c.pump(deadline); err != nil {
			return nil, err
		}
	}
}

// opOK runs an op and decodes its payload into out (nil: none); a failed
// op is an *OpError.
func (c *Conn) opOK(name string, fields map[string]any, out any, timeout time.Duration) (*Completion, error) {
	done, err := c.Op(name, fields, timeout)
	if err != nil {
		return nil, err
	}
	if err := done.Err(name); err != nil {
		return done, err
	}
	if out != nil {
		if err := done.Decode(out); err != nil {
			return done, &BoundsError{fmt.Sprintf("%s payload: %v", name, err)}
		}
	}
	return done, nil
}

// Describe is what op DESCRIBE says of the worker.
type Describe struct {
	AbiVersion     uint32         `codec:"abi_version"`
	WorkerEpoch    uint64         `codec:"worker_epoch"`
	Runtime        RuntimeInfo    `codec:"runtime"`
	Eos            []uint32       `codec:"eos"`
	Specials       map[string]any `codec:"specials"`
	FaultInjection bool           `codec:"fault_injection"`
	Parallel       Parallel       `codec:"parallel"`
}

// Parallel is DESCRIBE's parallel: TP rank processes (the tensor-parallel
// degree) run the worker's model on NNodes machines. The planner sees one
// worker at every degree. An older worker sends none: {1, 1}.
type Parallel struct {
	TP     uint32 `codec:"tp"`
	NNodes uint32 `codec:"nnodes"`
}

// DecodeDescribe decodes a DESCRIBE payload: parallel defaults to {1, 1}
// key by key; a value below 1, or more nodes than ranks, is a *BoundsError.
func DecodeDescribe(payload []byte) (*Describe, error) {
	d := Describe{Parallel: Parallel{TP: 1, NNodes: 1}} // the decoder leaves absent keys as they are
	if err := unpack(payload, &d); err != nil {
		return nil, &BoundsError{fmt.Sprintf("DESCRIBE payload: %v", err)}
	}
	if p := d.Parallel; p.TP < 1 || p.NNodes < 1 || p.NNodes > p.TP {
		return nil, &BoundsError{fmt.Sprintf("DESCRIBE payload: parallel.tp %d and parallel.nnodes %d "+
			"(each >= 1, nnodes <= tp)", p.TP, p.NNodes)}
	}
	return &d, nil
}

type RuntimeInfo struct {
	RuntimeID         string `codec:"runtime_id"`
	VocabSize         uint32 `codec:"vocab_size"`
	MaxSeqLen         uint64 `codec:"max_seq_len"`
	MaxBatch          uint32 `codec:"max_batch"`
	MaxSeqs           uint32 `codec:"max_seqs"`
	Page              uint32 `codec:"page"`
	TruncatePartial   bool   `codec:"truncate_partial"`
	CopySharesCells   bool   `codec:"copy_shares_cells"`
	TakeoverPreferred bool   `codec:"takeover_preferred"`
	PrefillStepTokens uint32 `codec:"prefill_step_tokens"`
	EngineSampling    bool   `codec:"engine_sampling"`
	EngineDraws       bool   `codec:"engine_draws"`
	VerifyBatches     bool   `codec:"verify_batches"`
	ExactOnly         bool   `codec:"exact_only"`
}

// Describe: op DESCRIBE, kept until the worker changes.
func (c *Conn) Describe(timeout time.Duration) (*Describe, error) {
	if c.desc == nil {
		done, err := c.opOK("DESCRIBE", nil, nil, timeout)
		if err != nil {
			return nil, err
		}
		d, err := DecodeDescribe(done.Payload)
		if err != nil {
			return nil, err
		}
		c.desc = d
	}
	return c.desc, nil
}

// Seed is a seed lease: Handle for LaneAdmit.SeedHandle, Value prompt
// tokens it covers (prefill starts there).
type Seed struct{ Handle, Value uint64 }

// LeaseSeed: op LEASE_SEED on the longest cached prefix of tokens. NoMatch
// and Capacity are *OpError.
func (c *Conn) LeaseSeed(tokens []uint32, ttlTicks, class uint32, timeout time.Duration) (Seed, error) {
	done, err := c.opOK("LEASE_SEED", map[string]any{"tokens": tokens, "ttl_ticks": ttlTicks,
		"determinism_class": class}, nil, timeout)
	if err != nil {
		return Seed{}, err
	}
	return Seed{done.Handle, done.Value}, nil
}

func (c *Conn) ReleaseSeed(handle uint64, timeout time.Duration) error {
	_, err := c.opOK("RELEASE_SEED", map[string]any{"handle": handle}, nil, timeout)
	return err
}

// RegisterGrammar: op REGISTER_GRAMMAR; the handle for LaneAdmit.GrammarHandle.
// A grammar the worker refuses is an *OpError with its message (BadRequest:
// the grammar library's; Unsupported: a runtime without a tokenizer).
func (c *Conn) RegisterGrammar(g *Grammar, timeout time.Duration) (uint64, error) {
	f, err := g.Fields()
	if err != nil {
		return 0, err
	}
	done, err := c.opOK("REGISTER_GRAMMAR", f, nil, timeout)
	if err != nil {
		return 0, err
	}
	return done.Handle, nil
}

// ReleaseGrammar: op RELEASE_GRAMMAR (UnknownHandle: no such grammar).
func (c *Conn) ReleaseGrammar(handle uint64, timeout time.Duration) error {
	_, err := c.opOK("RELEASE_GRAMMAR", map[string]any{"handle": handle}, nil, timeout)
	return err
}

// InstallStrategy: op INSTALL_STRATEGY, filling s.Slot (replacing what it
// held); the new cert_id. A strategy the worker refuses is an *OpError with
// its message (BadRequest: a field out of range, named; Unsupported: a
// runtime that cannot verify drafts).
func (c *Conn) InstallStrategy(s *Strategy, timeout time.Duration) (uint64, error) {
	done, err := c.opOK("INSTALL_STRATEGY", s.Fields(), nil, timeout)
	if err != nil {
		return 0, err
	}
	return done.Value, nil
}

// LaneInfo is a row of LIST_LANES.
type LaneInfo struct {
	Tag       uint64 `codec:"tag"`
	Prompt    uint64 `codec:"prompt"`
	Generated uint64 `codec:"generated"`
	State     string `codec:"state"`
	Session   uint64 `codec:"session"`
}

// ListLanes: op LIST_LANES, every page: the live and faulted lanes, with
// the session that admitted each.
func (c *Conn) ListLanes(timeout time.Duration) ([]LaneInfo, error) {
	var out []LaneInfo
	after := uint64(0)
	for {
		var page struct {
			Lanes []LaneInfo `codec:"lanes"`
			More  bool       `codec:"more"`
		}
		if _, err := c.opOK("LIST_LANES", map[string]any{"after": after, "limit": 1024}, &page, timeout); err != nil {
			return nil, err
		}
		out = append(out, page.Lanes...)
		if !page.More || len(page.Lanes) == 0 {
			return out, nil
		}
		after = page.Lanes[len(page.Lanes)-1].Tag
	}
}

// RetireLanes: op RETIRE_LANES of tags (nil with all: every lane); how many ended.
func (c *Conn) RetireLanes(tags []uint64, all, publish bool, timeout time.Duration) (int, error) {
	f := map[string]any{"publish": publish}
	if all {
		f["all"] = true
	} else {
		if tags == nil {
			tags = []uint64{}
		}
		f["tags"] = tags
	}
	done, err := c.opOK("RETIRE_LANES", f, nil, timeout)
	if err != nil {
		return 0, err
	}
	return int(done.Value), nil
}

// InjectFault: op INJECT_FAULT (a daemon with --fault-injection) on a lane.
func (c *Conn) InjectFault(tag uint64, code uint32, timeout time.Duration) error {
	_, err := c.opOK("INJECT_FAULT", map[string]any{"lane_tag": tag, "code": code}, nil, timeout)
	return err
}

// CacheClear: op CACHE_CLEAR; the bytes freed.
func (c *Conn) CacheClear(timeout time.Duration) (uint64, error) {
	done, err := c.opOK("CACHE_CLEAR", nil, nil, timeout)
	if err != nil {
		return 0, err
	}
	return done.Value, nil
}
