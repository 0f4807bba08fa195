// Package workload runs the workload JSON of client/workload.py (`superfluid
// plan`) through the Go planner and prints the same results JSON, so the
// Python, Rust and Go planners can be compared token for token.
package workload

import "math"

// PerturbScale is client/workload.py's PERTURB_SCALE.
const PerturbScale = float32(2.0)

// Argmax is the first index of the largest value (a NaN counts as the
// largest, as numpy's argmax has it).
func Argmax(row []float32, position uint64) uint32 {
	best := 0
	for i, v := range row {
		if v != v {
			return uint32(i)
		}
		if v > row[best] {
			best = i
		}
	}
	return uint32(best)
}

func splitmix64(x uint64) uint64 {
	z := x + 0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// Perturb is the argmax of row[i] + PerturbScale * u(position, i) in
// float32, u = the top 24 bits of splitmix64(position<<32 + i) over 2^24.
func Perturb(row []float32, position uint64) uint32 {
	best, bestV := 0, float32(math.Inf(-1))
	for i, v := range row {
		u := float32(splitmix64(position<<32+uint64(i))>>40) / (1 << 24) // exact: a 24-bit integer over 2^24
		// The conversions keep each step one float32 rounding (no fused multiply-add).
		s := float32(v + float32(PerturbScale*u))
		if s != s {
			return uint32(i)
		}
		if i == 0 || s > bestV {
			best, bestV = i, s
		}
	}
	return uint32(best)
}

// Samplers are the workload's host samplers by name.
var Samplers = map[string]func([]float32, uint64) uint32{"argmax": Argmax, "perturb": Perturb}
