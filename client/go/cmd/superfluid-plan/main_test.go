package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"superfluid/internal/livetest"
)

// The command prints exactly what `superfluid plan` prints for the same
// workload on the same (cleared) worker: same JSON, byte for byte.
func TestCommandPrintsWhatSuperfluidPlanPrints(t *testing.T) {
	d := livetest.Serve(t, "--fake")
	bin := filepath.Join(t.TempDir(), "superfluid-plan")
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	w := map[string]any{
		"options": map[string]any{"decode_grant": 2, "prefill_chunk": 3, "prefill_token_budget": 5},
		"requests": []map[string]any{
			{"prompt": []int{5, 6, 7, 8, 9, 10, 11}, "max_new_tokens": 9},
			{"prompt": []int{5, 6, 7}, "max_new_tokens": 7, "sampling": "sample",
				"params": map[string]any{"temperature": 0.7, "min_p": 0.05}, "rng_base": 3},
			{"prompt": []int{9, 9}, "max_new_tokens": 5, "sampling": "host", "host_sampler": "perturb"},
		},
	}
	path := livetest.WorkloadFile(t, w)
	clear := func() {
		c := d.Connect(t)
		if _, err := c.CacheClear(time.Minute); err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	clear()
	want := d.PythonCode(t, "import sys; from superfluid.cli import main; sys.exit(main(['plan', '--name', '"+
		d.Name+"', '"+path+"']))")
	clear()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(bin, path, "--name", d.Name, "--timeout", "120") // flags after the workload too
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%v: %s", err, stderr.String())
	}
	if stdout.String() != want {
		t.Fatalf("go:     %s\npython: %s", stdout.String(), want)
	}
	if o := livetest.ParseOutput(t, want); o.Stats.Tokens != 21 || len(o.Results) != 3 {
		t.Fatalf("not the run asked for: %s", want)
	}

	// A bad workload is exit status 2 and the field's name, before any connect.
	bad := filepath.Join(t.TempDir(), "bad.json")
	os.WriteFile(bad, []byte(`{"requests": [{"prompt": [1], "max_new_tokens": 2, "sampling": "beam"}]}`), 0o600)
	stderr.Reset()
	cmd = exec.Command(bin, "--name", "nobody", bad)
	cmd.Stderr = &stderr
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 ||
		!strings.Contains(stderr.String(), "requests[0].sampling = 'beam'") {
		t.Fatalf("bad workload: %v %q", err, stderr.String())
	}
}
