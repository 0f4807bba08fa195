package superfluid

import (
	"reflect"
	"testing"
)

// After a restart, the answer to a plan sent to the old worker (a stale
// plan_seq) is nobody's reply, but the lanes it admitted on the new worker
// are orphans to retire; a dead epoch's answers are dropped.
func TestStalePlansAdmitOrphansAndDeadEpochsAreDropped(t *testing.T) {
	c := &Conn{Epoch: 2, completions: map[uint64]*Completion{}, inflight: map[uint64]bool{7: true},
		stale: map[uint64]bool{5: true}, orphans: map[uint64]bool{}}
	c.fileMsg(&Events{PlanSeq: 5, WorkerEpoch: 2, AdmitResults: []AdmitResult{{LaneTag: 77}, {LaneTag: 78}}})
	c.fileMsg(&Events{PlanSeq: 6, WorkerEpoch: 1, Completions: []Completion{{OpID: 1}}}) // the dead worker's
	c.fileMsg(&opEvents{epoch: 2, completions: []Completion{{OpID: 2}}})
	c.fileMsg(&Events{PlanSeq: 7, WorkerEpoch: 2})
	if len(c.ready) != 1 || c.ready[0].PlanSeq != 7 || c.inflight[7] || c.stale[5] {
		t.Fatalf("ready %v inflight %v stale %v", c.ready, c.inflight, c.stale)
	}
	if _, ok := c.completions[1]; ok || c.completions[2] == nil {
		t.Fatalf("completions %v", c.completions)
	}
	got := c.TakeOrphans()
	if len(got) != 2 || !reflect.DeepEqual(map[uint64]bool{got[0]: true, got[1]: true},
		map[uint64]bool{77: true, 78: true}) || len(c.TakeOrphans()) != 0 {
		t.Fatalf("orphans %v", got)
	}
}

// A planner retires the orphans the connection hands it, unpublished.
func TestPlannerRetiresOrphans(t *testing.T) {
	c := &Conn{orphans: map[uint64]bool{9: true, 4: true}}
	p := &Planner{Conn: c, retireNext: map[uint64]bool{}, admitCap: -1}
	p.lanes.clear()
	if !p.Busy() {
		t.Fatal("orphans to retire are work")
	}
	d := &draft{plan: NewPlan(1)}
	p.planRetires(d, true)
	want := []LaneRetire{{LaneTag: 4}, {LaneTag: 9}}
	if !reflect.DeepEqual(d.plan.Retires, want) {
		t.Fatalf("retires %+v", d.plan.Retires)
	}
}
