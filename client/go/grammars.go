package superfluid

import (
	"errors"
	"fmt"
	"time"
)

// The reference planner's grammars (client/grammars.py; contract §3 step 4,
// §7). A handle is borrowed by one lane at a time, so each constrained
// request's grammar is registered for that request alone, when it is
// submitted (a bad grammar fails Submit with the worker's message), and
// released once the request is done. A handle dies with its worker: after
// a restart the book forgets them and the next admission registers again.
// A re-admitted request replays its generated tokens into the fresh matcher
// (grammar_replay = generated), so it goes on exactly where it was.

// Grammar is what a request's output must follow: Kind json_schema, regex,
// lark or gbnf with its Text, or Kind "choice": exactly one of Choices.
type Grammar struct {
	Kind    string
	Text    string   // every kind but choice
	Choices []string // choice
}

func JSONSchema(schema string) *Grammar { return &Grammar{Kind: "json_schema", Text: schema} }
func Regex(pattern string) *Grammar     { return &Grammar{Kind: "regex", Text: pattern} }
func Choice(choices ...string) *Grammar {
	return &Grammar{Kind: "choice", Choices: append([]string{}, choices...)}
}

// Fields are REGISTER_GRAMMAR's; an error for a malformed spec (as
// client/grammars.py's fields).
func (g *Grammar) Fields() (map[string]any, error) {
	if g.Kind == "choice" {
		if g.Text != "" {
			return nil, errors.New("a choice grammar is a list of strings")
		}
		choices := g.Choices
		if choices == nil {
			choices = []string{}
		}
		return map[string]any{"kind": g.Kind, "choices": choices}, nil
	}
	if g.Choices != nil {
		return nil, fmt.Errorf("a %s grammar is a string", g.Kind)
	}
	return map[string]any{"kind": g.Kind, "text": g.Text}, nil
}

// GrammarBook holds each constrained request's handle on the current worker.
type GrammarBook struct {
	conn       *Conn
	handles    map[int]uint64 // request id -> handle
	Registered int            // REGISTER_GRAMMAR answered OK
}

func NewGrammarBook(c *Conn) *GrammarBook {
	return &GrammarBook{conn: c, handles: map[int]uint64{}}
}

// Handle is request id's handle, registering g if this worker has none for it.
func (b *GrammarBook) Handle(id int, g *Grammar, timeout time.Duration) (uint64, error) {
	if h, ok := b.handles[id]; ok {
		return h, nil
	}
	h, err := b.conn.RegisterGrammar(g, timeout)
	if err != nil {
		return 0, err
	}
	b.handles[id] = h
	b.Registered++
	return h, nil
}

// Release: request id is done, its grammar can go. A handle the worker no
// longer knows (UnknownHandle), or one gone with its worker, is gone anyway.
func (b *GrammarBook) Release(id int, timeout time.Duration) error {
	h, ok := b.handles[id]
	if !ok {
		return nil
	}
	delete(b.handles, id)
	err := b.conn.ReleaseGrammar(h, timeout)
	var oe *OpError
	if errors.As(err, &oe) || errors.Is(err, ErrWorkerGone) {
		return nil
	}
	return err
}

// Forget: the worker restarted, its grammars are gone.
func (b *GrammarBook) Forget() { b.handles = map[int]uint64{} }

// Held is how many handles the book holds now.
func (b *GrammarBook) Held() int { return len(b.handles) }
