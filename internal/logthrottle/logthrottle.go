// Package logthrottle keeps one misbehaving client from flooding the log:
// a line repeated for the same client (same message, level and "client"
// attribute) is written once per window, and the next one written says how
// many were held back in between. Lines about no client pass as they are:
// the server's own lines differ in other attributes (a group, a node) that
// a key on the message alone would merge.
package logthrottle

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// maxKeys bounds the memory spent remembering lines: past it, lines older
// than the window are forgotten, and if that is not enough, all are.
const maxKeys = 4096

// New returns a handler that passes records to next, throttled per window.
// Debug records always pass: whoever enables them wants them all.
func New(next slog.Handler, window time.Duration) slog.Handler {
	return &handler{next: next, s: &state{window: window, seen: map[key]*entry{}, now: time.Now}}
}

type handler struct {
	next  slog.Handler
	s     *state
	attrs string // the "client" attribute given With, if any
}

type state struct {
	window time.Duration
	now    func() time.Time
	mu     sync.Mutex
	seen   map[key]*entry
}

type key struct {
	level  slog.Level
	msg    string
	client string
}

type entry struct {
	last       time.Time
	suppressed int
}

func (h *handler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

func (h *handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < slog.LevelInfo {
		return h.next.Handle(ctx, r)
	}
	k := key{level: r.Level, msg: r.Message, client: h.attrs}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "client" {
			k.client = a.Value.String()
			return false
		}
		return true
	})
	if k.client == "" {
		return h.next.Handle(ctx, r)
	}
	held, pass := h.s.admit(k)
	if !pass {
		return nil
	}
	if held > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int("repeated", held))
	}
	return h.next.Handle(ctx, r)
}

// admit reports whether a line passes, and how many like it were held back
// since the last one that did.
func (s *state) admit(k key) (held int, pass bool) {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.seen[k]
	if e != nil && now.Sub(e.last) < s.window {
		e.suppressed++
		return 0, false
	}
	if e != nil {
		held = e.suppressed
		e.last, e.suppressed = now, 0
		return held, true
	}
	if len(s.seen) >= maxKeys {
		for k, e := range s.seen {
			if now.Sub(e.last) >= s.window {
				delete(s.seen, k)
			}
		}
		if len(s.seen) >= maxKeys {
			clear(s.seen)
		}
	}
	s.seen[k] = &entry{last: now}
	return 0, true
}

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	for _, a := range as {
		if a.Key == "client" {
			c.attrs = a.Value.String()
		}
	}
	c.next = h.next.WithAttrs(as)
	return &c
}

func (h *handler) WithGroup(name string) slog.Handler {
	c := *h
	c.next = h.next.WithGroup(name)
	return &c
}
