package superfluid_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/ugorji/go/codec"
	sf "superfluid"
)

// The copies cgo compiles are abi/'s, byte for byte (python -m
// superfluid.abi.gen_go rewrites them).
func TestHeaderCopiesMatchABI(t *testing.T) {
	for _, f := range []string{"superfluid.h", "sf_ring.c"} {
		mine, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		theirs, err := os.ReadFile(filepath.Join("..", "..", "abi", f))
		if err != nil {
			t.Fatalf("%v (the package is tested inside its repository)", err)
		}
		if !bytes.Equal(mine, theirs) {
			t.Errorf("client/go/%s differs from abi/%s: run python -m superfluid.abi.gen_go", f, f)
		}
	}
}

func at[T any](b []byte, off int) T { return *(*T)(unsafe.Pointer(&b[off])) }

// A plan message is MsgHeader, TickPlan, then the arena at the next 8-byte
// boundary; every list a Span into it, an empty one {0, 0}.
func TestPlanEncoding(t *testing.T) {
	ref := sf.RingRef{RingId: sf.SF_RING_PROMPT, Offset: 3, Len: 5}
	p := sf.NewPlan(64)
	p.Admit(sf.LaneAdmit{LaneTag: 7, Prompt: ref, Sampling: sf.SF_SAMPLING_GPU_SAMPLE, RngCounterBase: 9,
		DecodeReplay: 2, SeedHandle: 11, DeterminismClass: sf.SF_CLASS_SEED_PATH_INVARIANT})
	p.Prefill(7, 0, 5).Decode(7, 12).Retire(3, true).AllowEvict(1<<20, 4096)
	msg := p.Encode(42, 99)
	h := at[sf.MsgHeader](msg, 0)
	rec := at[sf.TickPlan](msg, 24)
	arena := msg[24+int(unsafe.Sizeof(rec)):]
	if h.Kind != sf.SF_MSG_PLAN || h.RecordBytes != 104 || h.Session != 99 || int(h.ArenaBytes) != len(arena) {
		t.Fatalf("header %+v", h)
	}
	if rec.StructSize != 104 || rec.PlanSeq != 42 || rec.MaxDecodeLanes != 1 || rec.PrefillTokenBudget != 64 ||
		rec.EvictableCacheClasses != sf.SF_CACHE_RESIDENT_PREFIX_CLASS || rec.MaxEvictBytes != 1<<20 {
		t.Fatalf("record %+v", rec)
	}
	if rec.Commits != (sf.Span{}) || rec.Admits.Count != 1 || rec.Retires.Count != 1 {
		t.Fatalf("spans %+v", rec)
	}
	for _, s := range []sf.Span{rec.Admits, rec.Prefills, rec.Decodes, rec.Retires} {
		if s.Offset%sf.SF_ARENA_ALIGN != 0 {
			t.Fatalf("span %+v is not aligned", s)
		}
	}
	a := at[sf.LaneAdmit](arena, int(rec.Admits.Offset))
	if a.LaneTag != 7 || a.Prompt != ref || a.RngCounterBase != 9 || a.DecodeReplay != 2 || a.SeedHandle != 11 {
		t.Fatalf("admit %+v", a)
	}
	d := at[sf.LaneDecode](arena, int(rec.Decodes.Offset))
	r := at[sf.LaneRetire](arena, int(rec.Retires.Offset))
	if d.LaneTag != 7 || d.MaxNewTokens != 12 || r.LaneTag != 3 || r.PublishToCache != 1 {
		t.Fatalf("decode %+v retire %+v", d, r)
	}
}

// The names come from sf_ring.c, as in every language.
func TestStatusNames(t *testing.T) {
	for got, want := range map[string]string{
		sf.StatusName(sf.SF_STATUS_StaleSession): "StaleSession", sf.StatusName(sf.SF_STATUS_RejectBudget): "RejectBudget",
		sf.OpStatusName(sf.SF_OPST_UnknownHandle): "UnknownHandle", sf.WorkerStateName(sf.SF_WORKER_READY): "READY",
		sf.MsgKindName(sf.SF_MSG_EVENTS): "EVENTS", sf.OpName(sf.SF_OP_LEASE_SEED): "LEASE_SEED",
		sf.StatusName(999): "unknown", sf.ConnectName(sf.SF_CONNECT_ABI): "ABI",
	} {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
	e := &sf.RejectError{PlanSeq: 3, Status: sf.SF_STATUS_NeedsReplan, Message: "m"}
	if e.Name() != "NeedsReplan" || e.Error() != "plan 3 rejected: NeedsReplan: m" {
		t.Error(e)
	}
}

// A DESCRIBE payload as a worker packs it (Python's msgpack: str8, bin).
func describePayload(t *testing.T, parallel any) []byte {
	t.Helper()
	body := map[string]any{
		"abi_version": sf.SF_ABI_VERSION, "worker_epoch": 3, "fault_injection": false, "eos": []uint32{511},
		"specials": map[string]any{"</s>": 511},
		"runtime": map[string]any{"runtime_id": "fake", "vocab_size": 512, "max_seq_len": 256, "max_batch": 64,
			"max_seqs": 0, "page": 16, "prefill_step_tokens": 0, "truncate_partial": true, "copy_shares_cells": true,
			"takeover_preferred": false, "engine_sampling": false, "engine_draws": false, "verify_batches": true,
			"exact_only": false},
	}
	if parallel != nil {
		body["parallel"] = parallel
	}
	var b []byte
	if err := codec.NewEncoderBytes(&b, &codec.MsgpackHandle{WriteExt: true}).Encode(body); err != nil {
		t.Fatal(err)
	}
	return b
}

// parallel is decoded, {1, 1} when an older worker sends none (key by key).
func TestDescribeDecodesTheParallelLayout(t *testing.T) {
	for _, c := range []struct {
		parallel any
		want     sf.Parallel
	}{
		{map[string]any{"tp": 4, "nnodes": 2}, sf.Parallel{TP: 4, NNodes: 2}},
		{nil, sf.Parallel{TP: 1, NNodes: 1}},
		{map[string]any{"tp": 2}, sf.Parallel{TP: 2, NNodes: 1}},
	} {
		d, err := sf.DecodeDescribe(describePayload(t, c.parallel))
		if err != nil {
			t.Fatalf("%v: %v", c.parallel, err)
		}
		if d.Parallel != c.want || d.Runtime.VocabSize != 512 || len(d.Eos) != 1 || d.Eos[0] != 511 {
			t.Fatalf("%v: %+v", c.parallel, d)
		}
	}
}

// A layout below 1, or more machines than ranks, is refused.
func TestDescribeRefusesABadLayout(t *testing.T) {
	for _, bad := range []map[string]any{
		{"tp": 0, "nnodes": 1}, {"tp": 2, "nnodes": 0}, {"tp": 1, "nnodes": 2}, {"tp": -1, "nnodes": 1},
	} {
		d, err := sf.DecodeDescribe(describePayload(t, bad))
		var be *sf.BoundsError
		if err == nil || !errors.As(err, &be) || !strings.Contains(err.Error(), "DESCRIBE payload") {
			t.Fatalf("%v: %+v, %v", bad, d, err)
		}
	}
}
