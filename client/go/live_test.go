package superfluid_test

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	sf "superfluid"
	"superfluid/internal/livetest"
)

const T = 60 * time.Second

func bytesOf[V any](v *V) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v)) }

// lane runs one greedy lane of n tokens in its own plans; its tokens.
func lane(t *testing.T, c *sf.Conn, prompt []uint32, n uint16) []uint32 {
	t.Helper()
	tag := c.NewLaneTag()
	r, err := c.WritePrompt(prompt)
	if err != nil {
		t.Fatal(err)
	}
	p := sf.NewPlan(64).AdmitGreedy(tag, r).Prefill(tag, 0, uint32(len(prompt))).Decode(tag, n)
	p.Admits[0].Params.Flags = sf.SF_PARAM_IGNORE_EOS
	ev, err := c.Tick(p, T)
	if err != nil || ev.Err() != nil {
		t.Fatalf("tick: %v %v", err, ev.Err())
	}
	if len(ev.AdmitResults) != 1 || ev.AdmitResults[0].LaneTag != tag || len(ev.Emits) != 1 ||
		ev.Emits[0].LaneTag != tag {
		t.Fatalf("events of another lane: %+v", ev)
	}
	toks, err := c.Tokens(&ev.Emits[0])
	if err != nil {
		t.Fatal(err)
	}
	if ev, err = c.Tick(sf.NewPlan(0).Retire(tag, false), T); err != nil || ev.Err() != nil {
		t.Fatalf("retire: %v %v", err, ev.Err())
	}
	return toks
}

// One fake daemon, the connection layer against it in order: the session
// protocol, ops, rings, other sessions' replies, faults, a worker kill, and
// last a header of another ABI version.
func TestConnectionAgainstALiveDaemon(t *testing.T) {
	d := livetest.Serve(t, "--fake", "--fault-injection", "--restart-backoff", "0.05")
	prompt := []uint32{5, 6, 7, 8, 9}
	var mine []uint32

	t.Run("session_ops_and_tokens_match_python", func(t *testing.T) {
		c := d.Connect(t)
		defer c.Close()
		if c.Session == 0 || c.Epoch == 0 {
			t.Fatalf("session %d epoch %d", c.Session, c.Epoch)
		}
		desc, err := c.Describe(T)
		if err != nil {
			t.Fatal(err)
		}
		if desc.AbiVersion != sf.SF_ABI_VERSION || desc.Runtime.RuntimeID != "fake" || desc.WorkerEpoch != c.Epoch ||
			desc.Runtime.VocabSize == 0 || !desc.FaultInjection || len(desc.Eos) == 0 ||
			desc.Parallel != (sf.Parallel{TP: 1, NNodes: 1}) {
			t.Fatalf("describe: %+v", desc)
		}
		done, err := c.Op("NO_SUCH_OP", nil, T)
		if err != nil || done.Status != sf.SF_OPST_UnknownOp || done.StatusName() != "UnknownOp" {
			t.Fatalf("unknown op: %+v %v", done, err)
		}
		var oe *sf.OpError
		if err := done.Err("NO_SUCH_OP"); !errors.As(err, &oe) || oe.Name() != "UnknownOp" || oe.Message == "" {
			t.Fatalf("op error: %v", err)
		}
		if _, err := c.LeaseSeed([]uint32{1, 2, 3}, 4, sf.SF_CLASS_SEED_PATH_INVARIANT, T); !errors.As(err, &oe) ||
			oe.Name() != "NoMatch" {
			t.Fatalf("lease of nothing cached: %v", err)
		}
		if err := c.ReleaseSeed(12345, T); !errors.As(err, &oe) || oe.Name() != "UnknownHandle" {
			t.Fatalf("release of no lease: %v", err)
		}
		mine = lane(t, c, prompt, 12)
		if len(mine) != 12 {
			t.Fatalf("%d tokens", len(mine))
		}
		// A second planner is refused while this one holds the worker.
		if _, err := sf.Connect(d.Name, 0, time.Second); !errors.Is(err, sf.ErrTaken) {
			t.Fatalf("second connect: %v", err)
		}
	})

	t.Run("python_client_gets_the_same_tokens", func(t *testing.T) {
		out := d.PythonCode(t, fmt.Sprintf(`
from superfluid.client import Client, PlanBuilder, sampling_params
with Client.connect(%q, 0, timeout=60) as c:
    r = c.write_prompt(%s)
    b = PlanBuilder(0, prefill_token_budget=64).admit(7, r, params=sampling_params(ignore_eos=True))
    ev = c.tick(b.prefill(7, 0, 5).decode(7, 12))
    print(' '.join(map(str, c.tokens(ev.emits[0]))))
    c.tick(PlanBuilder(0).retire(7))
`, d.Name, strings.ReplaceAll(fmt.Sprint(prompt), " ", ", ")))
		var theirs []uint32
		for _, f := range strings.Fields(out) {
			var v uint32
			fmt.Sscan(f, &v)
			theirs = append(theirs, v)
		}
		if !reflect.DeepEqual(mine, theirs) {
			t.Fatalf("go %v, python %v", mine, theirs)
		}
	})

	t.Run("an_earlier_sessions_replies_are_dropped", func(t *testing.T) {
		// The worker held still while A queues a plan and B begins: A's plan
		// is answered (StaleSession, in A's session) after B connected.
		first := d.Connect(t)
		pid := first.WorkerPID()
		first.Close()
		syscall.Kill(pid, syscall.SIGSTOP)
		defer syscall.Kill(pid, syscall.SIGCONT)
		a := d.Connect(t)
		tagA := a.NewLaneTag()
		r, _ := a.WritePrompt([]uint32{40, 41, 42})
		if _, err := a.Submit(sf.NewPlan(64).AdmitGreedy(tagA, r).Prefill(tagA, 0, 3).Decode(tagA, 4), T); err != nil {
			t.Fatal(err)
		}
		a.Close() // its plan (plan_seq 1) and its events are left behind
		b := d.Connect(t)
		defer b.Close()
		if b.Session <= a.Session {
			t.Fatalf("session %d after %d", b.Session, a.Session)
		}
		syscall.Kill(pid, syscall.SIGCONT)
		if got := lane(t, b, prompt, 12); !reflect.DeepEqual(got, mine) { // also plan_seq 1
			t.Fatalf("session B got %v, want %v", got, mine)
		}
		if b.OtherSessions != 1 {
			t.Fatalf("%d replies of other sessions dropped, want A's one", b.OtherSessions)
		}
		lanes, err := b.ListLanes(T)
		if err != nil {
			t.Fatal(err)
		}
		var left []uint64
		for _, l := range lanes {
			if l.Session == a.Session {
				left = append(left, l.Tag)
			}
		}
		// A's plan ran (in A's session) or was answered StaleSession: then nothing is left.
		if n, err := b.RetireLanes(left, false, false, T); err != nil || n != len(left) {
			t.Fatalf("retire %v: %d %v", left, n, err)
		}
		if lanes, _ = b.ListLanes(T); len(lanes) != 0 {
			t.Fatalf("lanes left: %+v", lanes)
		}
	})

	t.Run("a_fault_is_readmitted_and_a_kill_recovered", func(t *testing.T) {
		c := d.Connect(t)
		defer c.Close()
		run := func(fault, kill bool) ([][]uint32, *sf.PlannerStats) {
			p, err := sf.NewPlanner(c, sf.PlannerOptions{DecodeGrant: 3})
			if err != nil {
				t.Fatal(err)
			}
			for _, q := range [][]uint32{{21, 22, 23}, {31, 32, 33, 34}} {
				p.Submit(q, 15, sf.RequestOptions{Sampling: sf.SF_SAMPLING_GPU_SAMPLE, IgnoreEOS: true,
					Params: sf.SamplingParams{Temperature: 0.8}, RngBase: 77})
			}
			for steps := 0; p.Busy(); steps++ {
				if err := p.Step(T); err != nil {
					t.Fatal(err)
				}
				if steps == 2 && fault {
					if err := c.InjectFault(p.LaneTags()[0], sf.SF_FAULT_INJECTED, T); err != nil {
						t.Fatal(err)
					}
				}
				if steps == 2 && kill {
					syscall.Kill(c.WorkerPID(), syscall.SIGKILL)
				}
			}
			rep := p.Report()
			return [][]uint32{rep.Results[0].Tokens, rep.Results[1].Tokens}, &rep.Stats
		}
		plain, s0 := run(false, false)
		faulted, s1 := run(true, false)
		killed, s2 := run(false, true)
		if s0.Faults != 0 || s1.Faults != 1 || s2.Restarts != 1 || s0.Restarts != 0 { // negative controls
			t.Fatalf("faults %d/%d restarts %d/%d", s0.Faults, s1.Faults, s0.Restarts, s2.Restarts)
		}
		if !reflect.DeepEqual(plain, faulted) || !reflect.DeepEqual(plain, killed) {
			t.Fatalf("plain %v\nfaulted %v\nkilled %v", plain, faulted, killed)
		}
	})

	t.Run("a_worker_kill_is_worker_gone_then_reconnect", func(t *testing.T) {
		c := d.Connect(t)
		defer c.Close()
		old := c.Epoch
		syscall.Kill(c.WorkerPID(), syscall.SIGKILL)
		_, err := c.Tick(sf.NewPlan(0), T)
		var g *sf.WorkerGoneError
		if !errors.Is(err, sf.ErrWorkerGone) || !errors.As(err, &g) || g.OldEpoch != old {
			t.Fatalf("tick on a dead worker: %v", err)
		}
		if e, err := c.Reconnect(T); err != nil || e <= old || c.Epoch != e {
			t.Fatalf("reconnect: %d %v", e, err)
		}
		if got := lane(t, c, prompt, 12); !reflect.DeepEqual(got, mine) {
			t.Fatalf("after a restart %v, want %v", got, mine)
		}
	})

	t.Run("a_corrupted_queue_is_reset_and_reported", func(t *testing.T) {
		c := d.Connect(t)
		defer c.Close()
		f, err := os.OpenFile(sf.SegmentPath(d.Name, 0), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var h sf.SegmentHeader
		f.ReadAt(bytesOf(&h), 0)
		off := int64(h.Layout.PlanQueue)
		var head, tail uint64
		word := func(at int64) uint64 {
			var v uint64
			f.ReadAt(bytesOf(&v), at)
			return v
		}
		tail = word(off + 64)
		head = tail + 10_000 // a head no producer could have made
		f.WriteAt(bytesOf(&head), off)
		for deadline := time.Now().Add(10 * time.Second); word(off)-word(off+64) > 64; {
			if time.Now().After(deadline) {
				t.Fatal("the worker did not reset the plan queue")
			}
			time.Sleep(10 * time.Millisecond)
		}
		if ev, err := c.Tick(sf.NewPlan(0), T); err != nil || ev.Err() != nil {
			t.Fatalf("tick after the reset: %v %v", err, ev.Err())
		}
		if len(c.QueueResets) == 0 || c.QueueResets[0].Queue != sf.SF_QUEUE_PLAN || c.QueueResets[0].Head != head {
			t.Fatalf("resets: %+v", c.QueueResets)
		}
	})

	t.Run("a_header_of_another_abi_version_is_refused", func(t *testing.T) {
		path := sf.SegmentPath(d.Name, 0)
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		f.WriteAt([]byte{1, 0, 0, 0}, 8)                       // abi_version 1 in place
		defer f.WriteAt([]byte{sf.SF_ABI_VERSION, 0, 0, 0}, 8) // for the daemon's clean stop
		_, err = sf.Connect(d.Name, 0, time.Second)
		var se *sf.SegmentError
		if !errors.As(err, &se) || se.Code != sf.SF_CONNECT_ABI || !strings.Contains(err.Error(), "SF_CONNECT_ABI") {
			t.Fatalf("expected a refusal, got %v", err)
		}
	})
}
