package superfluid

import (
	"fmt"
	"unsafe"
)

// WritePrompt puts prompt tokens in the prompt ring; the reference an admit
// takes. Good until the ring wraps over it (write it just before the plan).
func (c *Conn) WritePrompt(tokens []uint32) (RingRef, error) {
	var p unsafe.Pointer
	if len(tokens) > 0 {
		p = unsafe.Pointer(&tokens[0])
	}
	ref, st := ringWrite(c.v.prompt, p, len(tokens))
	if st != SF_STATUS_OK {
		return ref, &BoundsError{fmt.Sprintf("%d tokens do not fit the prompt ring", len(tokens))}
	}
	return ref, nil
}

// ReadTokens copies the tokens a reference of the token ring points at.
func (c *Conn) ReadTokens(ref RingRef) ([]uint32, error) {
	// The worker wrote ref: check it before allocating for it.
	if ref.Len > uint64(c.v.tokens.capacity) {
		return nil, &BoundsError{fmt.Sprintf("a token reference of %d elements", ref.Len)}
	}
	out := make([]uint32, ref.Len)
	if ref.Len == 0 {
		return out, nil
	}
	if st := ringRead(c.v.tokens, ref, unsafe.Pointer(&out[0]), len(out)); st != SF_STATUS_OK {
		return nil, &BoundsError{fmt.Sprintf("token reference: %s", StatusName(st))}
	}
	return out, nil
}

// Tokens are an emit's tokens (read them before the ring wraps).
func (c *Conn) Tokens(e *LaneEmit) ([]uint32, error) {
	if e.NTokens == 0 {
		return nil, nil
	}
	if uint64(e.NTokens) != e.TokenRef.Len {
		return nil, &BoundsError{fmt.Sprintf("lane %d: n_tokens %d but a reference of %d", e.LaneTag, e.NTokens,
			e.TokenRef.Len)}
	}
	return c.ReadTokens(e.TokenRef)
}

// LogitsRow is a HOST lane's row (vocab_size float32).
func (c *Conn) LogitsRow(e *LaneEmit) ([]float32, error) {
	ref := e.LogitsRow
	if ref.Len > uint64(c.v.logits.capacity) {
		return nil, &BoundsError{fmt.Sprintf("a logits row of %d floats", ref.Len)}
	}
	out := make([]float32, ref.Len)
	if ref.Len == 0 {
		return out, nil
	}
	if st := ringRead(c.v.logits, ref, unsafe.Pointer(&out[0]), len(out)); st != SF_STATUS_OK {
		return nil, &BoundsError{fmt.Sprintf("logits reference: %s", StatusName(st))}
	}
	return out, nil
}

// CommitFor is the commit of a host-sampled token for the row e carried,
// for the next plan.
func CommitFor(e *LaneEmit, token uint32) (LaneCommit, error) {
	if e.LogitsNonce == 0 {
		return LaneCommit{}, &BoundsError{fmt.Sprintf("lane %d: this emit carries no logits row", e.LaneTag)}
	}
	return LaneCommit{LaneTag: e.LaneTag, TokenId: token, LogitsNonce: e.LogitsNonce}, nil
}
