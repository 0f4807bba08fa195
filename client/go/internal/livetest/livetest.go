// Package livetest starts `superfluid serve` for the Go tests: the
// interpreter is $SUPERFLUID_PYTHON (the pytest wrapper sets it); without it
// a live test skips and says why. Each daemon gets its own
// SUPERFLUID_SHM_DIR, so test daemons never collide.
package livetest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"superfluid"
	"superfluid/workload"
)

var serial int64

// Python is the interpreter, or the test skips.
func Python(t testing.TB) string {
	py := os.Getenv("SUPERFLUID_PYTHON")
	if py == "" {
		t.Skip("SUPERFLUID_PYTHON is not set: no daemon to test against (run through pytest: " +
			"tests/client/test_go.py, or SUPERFLUID_PYTHON=.venv/bin/python go test ./...)")
	}
	return py
}

// Daemon is a running `superfluid serve`.
type Daemon struct {
	Name, ShmDir, Python string
	cmd                  *exec.Cmd
	done                 chan struct{} // closed when the daemon exited
	log                  logBuffer
}

// logBuffer is the daemon's output, written by exec's copier as tests read it.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Serve starts a daemon with args (e.g. "--fake"); stopped at the test's end.
func Serve(t testing.TB, args ...string) *Daemon {
	d, err := start(Python(t), args)
	if err != nil {
		t.Fatal(err)
	}
	d.Use(t)
	t.Cleanup(func() { d.Stop(t) })
	return d
}

// Shared is one daemon for many tests of a package, started by the first
// that asks (Get) and stopped by the package's TestMain (Close): a tiny-model
// daemon takes seconds to come up. Tests that share it run one after another
// (go test's default inside a package) and must not depend on what an
// earlier one left behind (they clear the prefix cache, as they do anyway).
type Shared struct {
	Args func(t testing.TB) []string // the daemon's arguments (asked once)
	once sync.Once
	d    *Daemon
	err  error
}

// Get the shared daemon, its SUPERFLUID_SHM_DIR set for the test.
func (s *Shared) Get(t testing.TB) *Daemon {
	py := Python(t)
	s.once.Do(func() { s.d, s.err = start(py, s.Args(t)) })
	if s.err != nil {
		t.Fatal(s.err)
	}
	if s.d.exited() {
		t.Fatalf("the shared daemon %s has exited; log:\n%s", s.d.Name, s.d.log.String())
	}
	s.d.Use(t)
	return s.d
}

// Close stops the shared daemon if one was started (from TestMain).
func (s *Shared) Close() error {
	if s.d == nil {
		return nil
	}
	return s.d.stop()
}

func start(py string, args []string) (*Daemon, error) {
	root := "/dev/shm"
	if st, err := os.Stat(root); err != nil || !st.IsDir() {
		root = ""
	}
	dir, err := os.MkdirTemp(root, "sf-go-")
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, err
	}
	d := &Daemon{Name: fmt.Sprintf("go%d-%d", os.Getpid(), atomic.AddInt64(&serial, 1)), ShmDir: dir, Python: py}
	d.cmd = exec.Command(py, append([]string{"-P", "-m", "superfluid", "serve", "--name", d.Name, "--log-level",
		"WARNING"}, args...)...)
	d.cmd.Env = append(os.Environ(), "SUPERFLUID_SHM_DIR="+dir)
	d.cmd.Stdout, d.cmd.Stderr = &d.log, &d.log
	if err := d.cmd.Start(); err != nil {
		return nil, err
	}
	d.done = make(chan struct{})
	go func() { _ = d.cmd.Wait(); close(d.done) }()
	return d, nil
}

// Use sets the daemon's SUPERFLUID_SHM_DIR for the test: Connect and every
// child it starts (python planners) read it.
func (d *Daemon) Use(t testing.TB) {
	t.Setenv("SUPERFLUID_SHM_DIR", d.ShmDir)
}

// Stop: SIGTERM (the daemon drains and removes its segments), then the dir.
func (d *Daemon) Stop(t testing.TB) {
	if err := d.stop(); err != nil {
		t.Error(err)
	}
}

func (d *Daemon) stop() error {
	if d.cmd == nil {
		return nil
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	var err error
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
		err = fmt.Errorf("daemon %s did not stop on SIGTERM; log:\n%s", d.Name, d.log.String())
	}
	d.cmd = nil
	left, _ := os.ReadDir(d.ShmDir)
	os.RemoveAll(d.ShmDir)
	if err == nil && len(left) > 0 {
		err = fmt.Errorf("segments left behind in %s: %v", d.ShmDir, left)
	}
	return err
}

// Connect to worker 0, waiting for the daemon to make it (a cold start loads torch).
func (d *Daemon) Connect(t testing.TB) *superfluid.Conn {
	deadline := time.Now().Add(120 * time.Second)
	for {
		c, err := superfluid.Connect(d.Name, 0, 120*time.Second)
		if err == nil {
			t.Cleanup(func() { c.Close() })
			return c
		}
		var se *superfluid.SegmentError
		if !errors.As(err, &se) || time.Now().After(deadline) || d.exited() {
			t.Fatalf("connect to %s: %v; daemon log:\n%s", d.Name, err, d.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (d *Daemon) exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// Log is what the daemon wrote so far.
func (d *Daemon) Log() string { return d.log.String() }

// PythonPlan runs `python -m superfluid plan` (the reference Planner) on
// the workload against this daemon; its results.
func (d *Daemon) PythonPlan(t testing.TB, w any) *workload.Output {
	out := d.run(t, append([]string{"-m", "superfluid", "plan", "--name", d.Name}, WorkloadFile(t, w))...)
	return ParseOutput(t, out)
}

// PythonCode runs a Python snippet; its stdout.
func (d *Daemon) PythonCode(t testing.TB, code string) string {
	return d.run(t, "-c", code)
}

func (d *Daemon) run(t testing.TB, args ...string) string {
	var stdout, stderr bytes.Buffer
	// -P: the working directory never shadows an installed package (docs/development.md).
	cmd := exec.Command(d.Python, append([]string{"-P"}, args...)...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", d.Python, strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String()
}

// WorkloadFile writes w as JSON in a temp file; its path.
func WorkloadFile(t testing.TB, w any) string {
	b, err := json.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "workload.json")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func ParseOutput(t testing.TB, s string) *workload.Output {
	var o workload.Output
	if err := json.Unmarshal([]byte(s), &o); err != nil {
		t.Fatalf("results JSON: %v\n%s", err, s)
	}
	return &o
}

// TinyModelDir is the embedded tiny checkpoint (written once, then cached).
func TinyModelDir(t testing.TB) string {
	py := Python(t)
	out, err := exec.Command(py, "-P", "-c",
		"from superfluid.engine.tiny import default_model_dir; print(default_model_dir())").Output()
	if err != nil {
		t.Fatalf("default_model_dir: %v", err)
	}
	return strings.TrimSpace(string(out))
}
