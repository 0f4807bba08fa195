package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"superfluid/internal/livetest"
)

const section = "### Write a planner in Go"

// The README's Go block is this directory's main.go, and it runs.
func TestReadmeExampleIsThisProgramAndRuns(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", "..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(readme)
	i := strings.Index(text, "\n"+section+"\n")
	if i < 0 {
		t.Fatalf("README.md has no %q section", section)
	}
	text = text[i:]
	start := strings.Index(text, "\n```go\n")
	if start < 0 {
		t.Fatal("no ```go block in the section")
	}
	block := text[start+len("\n```go\n"):]
	block = block[:strings.Index(block, "\n```\n")+1]
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	if block != string(src) {
		t.Fatalf("the README's block is not client/go/examples/readme/main.go:\n%s", block)
	}

	d := livetest.Serve(t, "--fake")
	d.Connect(t).Close() // the daemon is up
	bin := filepath.Join(t.TempDir(), "readme")
	if out, err := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", bin, ".").
		CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	out, err := exec.Command(bin, d.Name).CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "fake vocab ") || !strings.HasPrefix(lines[1], "1 ") ||
		!strings.HasPrefix(lines[2], "2 max_tokens [") {
		t.Fatalf("output:\n%s", out)
	}
}
