package superfluid

import "testing"

// As tests/rings/test_spin_budget.py: a queue's waits spin the whole budget
// while answers come quickly, none once they typically take far longer (a
// spinning waiter takes a core from whoever computes the answer), and quick
// answers bring the spin back within a few waits.
func TestSpinBudgetQuickAnswersSpinLongOnesDoNotAndItComesBack(t *testing.T) {
	s := &spinBudget{budgetNs: spinNs}
	if s.spinNs() != spinNs { // nothing known yet: spin
		t.Fatalf("fresh: %d", s.spinNs())
	}
	for i := 0; i < 20; i++ {
		s.waited(30_000) // an empty tick's round trip
	}
	if s.spinNs() != spinNs {
		t.Fatalf("after quick waits: %d (typical %d)", s.spinNs(), s.typicalNs)
	}
	for i := 0; i < 20; i++ {
		s.waited(20_000_000) // ticks of 20 ms
	}
	if s.spinNs() != 0 || s.typicalNs > longWaitBudgets*spinNs {
		t.Fatalf("after long waits: %d (typical %d)", s.spinNs(), s.typicalNs)
	}
	for i := 0; i < 8; i++ {
		s.waited(30_000) // an idle spell counts as long, not as forever
	}
	if s.spinNs() != spinNs {
		t.Fatalf("after quick waits again: %d (typical %d)", s.spinNs(), s.typicalNs)
	}
	s.waited(-5) // a clock that went back counts as no wait
	if s.typicalNs < 0 {
		t.Fatalf("typical %d", s.typicalNs)
	}
}
