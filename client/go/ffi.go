// Package superfluid is a planner's side of a superfluid worker, from Go:
// the records of abi/superfluid.h (records_gen.go, checked against the C
// layout at compile time by layout_gen.go), the sf_ring.c primitives every
// language links (the copies beside this file, made by
// `python -m superfluid.abi.gen_go`), a connection that follows the
// header's sessions protocol (Conn), a plan builder (Plan), typed ops, and
// the reference planner of client/planner.py (Planner).
package superfluid

/*
#cgo CFLAGS: -O2 -Wall
#include <stdlib.h>
#include "superfluid.h"
*/
import "C"

import (
	"strings"
	"unsafe"
)

// The header's names of its constants, from sf_ring.c as in every language:
// "RejectBudget", "UnknownHandle", "READY", "EVENTS", "LEASE_SEED"...;
// "unknown" for a value that is none of them.
func StatusName(v uint32) string      { return C.GoString(C.sf_status_name(C.uint32_t(v))) }
func OpStatusName(v uint32) string    { return C.GoString(C.sf_opst_name(C.uint32_t(v))) }
func WorkerStateName(v uint32) string { return C.GoString(C.sf_worker_state_name(C.uint32_t(v))) }
func MsgKindName(v uint32) string     { return C.GoString(C.sf_msg_kind_name(C.uint32_t(v))) }
func OpName(v uint32) string          { return C.GoString(C.sf_op_name(C.uint32_t(v))) }

// ConnectName names an sf_segment_check / sf_segment_open result (the header has no function for it).
func ConnectName(v int) string {
	switch v {
	case SF_CONNECT_OK:
		return "OK"
	case SF_CONNECT_SHORT:
		return "SHORT"
	case SF_CONNECT_MAGIC:
		return "MAGIC"
	case SF_CONNECT_ABI:
		return "ABI"
	case SF_CONNECT_SIZE:
		return "SIZE"
	case SF_CONNECT_OWNER:
		return "OWNER"
	case SF_CONNECT_NAME:
		return "NAME"
	case SF_CONNECT_MISSING:
		return "MISSING"
	case SF_CONNECT_FILE:
		return "FILE"
	}
	return "unknown"
}

// faultNames are the SF_FAULT_* codes' names (the header has no function for them).
var faultNames = map[uint32]string{
	SF_FAULT_OOM_TENTATIVE: "OOM_TENTATIVE", SF_FAULT_INTERNAL: "INTERNAL",
	SF_FAULT_GRAMMAR_OVERFLOW: "GRAMMAR_OVERFLOW", SF_FAULT_REF_SPAN_OOB: "REF_SPAN_OOB",
	SF_FAULT_INJECTED: "INJECTED", SF_FAULT_NUMERIC: "NUMERIC",
}

// FaultName names an SF_FAULT_* code ("unknown" for none of them).
func FaultName(code uint32) string {
	if n, ok := faultNames[code]; ok {
		return n
	}
	return "unknown"
}

// FaultCode is the code of a fault's name, any case ("numeric": SF_FAULT_NUMERIC).
func FaultCode(name string) (uint32, bool) {
	for code, n := range faultNames {
		if strings.EqualFold(n, name) {
			return code, true
		}
	}
	return 0, false
}

// views are the process-local QueueView/RingView of one mapping, in C
// memory: they hold C pointers into the segment and are passed to C often.
type views struct {
	plans, events, ops, stream *C.QueueView
	prompt, tokens, logits     *C.RingView
}

func newViews() *views {
	q := func() *C.QueueView { return (*C.QueueView)(C.calloc(1, C.sizeof_QueueView)) }
	r := func() *C.RingView { return (*C.RingView)(C.calloc(1, C.sizeof_RingView)) }
	return &views{q(), q(), q(), q(), r(), r(), r()}
}

func (v *views) free() {
	for _, p := range []unsafe.Pointer{unsafe.Pointer(v.plans), unsafe.Pointer(v.events), unsafe.Pointer(v.ops),
		unsafe.Pointer(v.stream), unsafe.Pointer(v.prompt), unsafe.Pointer(v.tokens), unsafe.Pointer(v.logits)} {
		C.free(p)
	}
}

// slot is slot i of a queue, as bytes of the mapping (valid until released).
func slot(q *C.QueueView, i int64) []byte {
	base := unsafe.Add(unsafe.Pointer(q.slots), uintptr(i)*uintptr(q.slot_bytes))
	return unsafe.Slice((*byte)(base), int(q.slot_bytes))
}

// ringStatus is sf_ring_read of ref into dst (4-byte elements).
func ringRead(v *C.RingView, ref RingRef, dst unsafe.Pointer, n int) uint32 {
	cref := (*C.RingRef)(unsafe.Pointer(&ref))
	return uint32(C.sf_ring_read(v, cref, dst, C.uint64_t(n)))
}

func ringWrite(v *C.RingView, src unsafe.Pointer, n int) (RingRef, uint32) {
	var ref RingRef
	st := C.sf_ring_write(v, src, C.uint64_t(n), (*C.RingRef)(unsafe.Pointer(&ref)))
	return ref, uint32(st)
}
