package superfluid

import (
	"encoding/binary"
	"errors"
	"hash/fnv"
	"time"
)

// The reference planner's use of seed leases (client/seeding.py): remember
// which whole pages the worker was made to publish; an admission whose
// first page is among them asks LEASE_SEED first. Leases die with their
// worker: after a restart the book starts from scratch.
const (
	LeaseTTLTicks       = 16 // survives a few NeedsReplan rounds before its admit
	CheckpointMinTokens = 128
	maxRememberedChains = 1 << 18
	seedPathInvariant   = SF_CLASS_SEED_PATH_INVARIANT
)

type SeedBook struct {
	conn      *Conn
	page      int
	exactOnly bool
	chains    map[uint64]struct{} // hash chain of every whole-page prefix published
	Leases    int                 // LEASE_SEED answered OK
	Misses    int                 // NoMatch, or no room
}

func NewSeedBook(c *Conn, page int, exactOnly bool) *SeedBook {
	if page < 1 {
		page = 1
	}
	return &SeedBook{conn: c, page: page, exactOnly: exactOnly, chains: map[uint64]struct{}{}}
}

// walk calls f with the chain hash of each whole page of tokens, in order,
// until f says stop.
func (b *SeedBook) walk(tokens []uint32, f func(uint64) bool) {
	var h uint64
	buf := make([]byte, 8+4*b.page)
	for k := 0; (k+1)*b.page <= len(tokens); k++ {
		binary.LittleEndian.PutUint64(buf, h)
		for i, t := range tokens[k*b.page : (k+1)*b.page] {
			binary.LittleEndian.PutUint32(buf[8+4*i:], t)
		}
		s := fnv.New64a()
		s.Write(buf)
		h = s.Sum64()
		if !f(h) {
			return
		}
	}
}

// Published: the worker keeps these tokens (whole pages of them) in its cache.
func (b *SeedBook) Published(tokens []uint32) {
	if len(b.chains) > maxRememberedChains {
		b.chains = map[uint64]struct{}{}
	}
	b.walk(tokens, func(h uint64) bool { b.chains[h] = struct{}{}; return true })
}

// Admitted: an exact_only worker checkpoints a long prompt one token short.
func (b *SeedBook) Admitted(prompt []uint32) {
	if b.exactOnly && len(prompt) >= CheckpointMinTokens {
		b.Published(prompt)
	}
}

func (b *SeedBook) MayShare(tokens []uint32) bool {
	found := false
	b.walk(tokens, func(h uint64) bool { _, found = b.chains[h]; return false })
	return found
}

// Lease is a lease on the longest cached prefix of tokens (an admission's
// prompt, whose last replay tokens decode_replay feeds), or nil.
func (b *SeedBook) Lease(tokens []uint32, replay int, timeout time.Duration) (*Seed, error) {
	asked := tokens
	if b.exactOnly {
		// Decode feeds the last token prefill reaches and the replayed ones, which
		// a seed's state holds as prefill fed them: lease short of them.
		asked = asked[:max0(len(asked)-replay-1)]
	}
	if len(asked) == 0 || !b.MayShare(asked) {
		return nil, nil
	}
	s, err := b.conn.LeaseSeed(asked, LeaseTTLTicks, seedPathInvariant, timeout)
	var oe *OpError
	if errors.As(err, &oe) {
		b.Misses++
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if s.Value > uint64(len(asked)) { // a lease on more than was asked is the worker's error: do without it
		b.Misses++
		return nil, nil
	}
	b.Leases++
	return &s, nil
}

// Forget: the worker restarted, its cache and leases are gone.
func (b *SeedBook) Forget() { b.chains = map[uint64]struct{}{} }

func max0(n int) int {
	if n < 0 {
		return 0
	}
	return n
}
