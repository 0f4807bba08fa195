package main

import (
	"fmt"
	"os"
	"time"

	"superfluid"
)

func main() {
	c, err := superfluid.Connect(os.Args[1], 0, 30*time.Second) // the daemon's --name, worker 0
	check(err)
	defer c.Close()
	desc, err := c.Describe(30 * time.Second)
	check(err)
	fmt.Println(desc.Runtime.RuntimeID, "vocab", desc.Runtime.VocabSize, "eos", desc.Eos)
	p, err := superfluid.NewPlanner(c, superfluid.PlannerOptions{DecodeGrant: 8})
	check(err)
	p.Submit([]uint32{72, 105, 33}, 16, superfluid.RequestOptions{}) // greedy, stops at EOS
	p.Submit([]uint32{5, 6, 7, 8}, 16, superfluid.RequestOptions{Sampling: superfluid.SF_SAMPLING_GPU_SAMPLE,
		Params: superfluid.SamplingParams{Temperature: 0.8, TopK: 40}, RngBase: 42})
	rep, err := p.RunUntilDone(time.Minute)
	check(err)
	for _, r := range rep.Results {
		fmt.Println(r.ID, r.Finish, r.Tokens)
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
