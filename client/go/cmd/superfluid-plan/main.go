// Command superfluid-plan runs a workload (JSON, client/workload.py's
// format) through the Go reference planner against a live daemon and prints
// the results JSON `superfluid plan` prints:
//
//	superfluid-plan [--name NAME] [--worker I] [--timeout S] WORKLOAD.json|-
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"superfluid"
	"superfluid/workload"
)

func main() { os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr)) }

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("superfluid-plan", flag.ContinueOnError)
	fs.SetOutput(stderr)
	name := fs.String("name", "superfluid", "the daemon's --name")
	worker := fs.Int("worker", 0, "the worker's index")
	timeout := fs.Float64("timeout", 300, "seconds for the whole workload")
	// Flags may come before or after the workload, as argparse takes them.
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return 2
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(pos) != 1 {
		fmt.Fprintln(stderr, "usage: superfluid-plan [--name NAME] [--worker I] [--timeout S] WORKLOAD.json|-")
		return 2
	}
	var data []byte
	var err error
	if pos[0] == "-" {
		data, err = io.ReadAll(stdin)
	} else {
		data, err = os.ReadFile(pos[0])
	}
	var w *workload.Workload
	if err == nil {
		w, err = workload.Load(data)
	}
	if err != nil {
		fmt.Fprintf(stderr, "superfluid-plan: %s: %v\n", pos[0], err)
		return 2
	}
	t := time.Duration(*timeout * float64(time.Second))
	c, err := superfluid.Connect(*name, *worker, t)
	if err != nil {
		fmt.Fprintf(stderr, "superfluid-plan: %v\n", err)
		return 1
	}
	defer c.Close()
	out, err := workload.Run(c, w, t)
	if err != nil {
		fmt.Fprintf(stderr, "superfluid-plan: %v\n", err)
		return 1
	}
	fmt.Fprintln(stdout, out.JSON())
	return 0
}
