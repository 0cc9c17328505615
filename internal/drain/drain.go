// Package drain counts work in progress, so that a shutdown can wait for
// what was started to end before it tears down what that work needs.
package drain

import (
	"context"
	"sync"
	"sync/atomic"
)

// Counter counts work in progress. Its zero value is ready. Start and Done
// cost an atomic add each, so they can sit on a request's path; only Wait
// takes a lock or a channel.
//
// Unlike a sync.WaitGroup, work may start while Wait waits (it is waited
// for too), so a caller need not first stop every source of new work: it
// refuses new work after its own check, and counts before that check (see
// the broker's shutdown).
type Counter struct {
	n       atomic.Int64
	waiting atomic.Bool
	once    sync.Once
	zero    chan struct{} // a token each time n reaches 0 while waiting
}

// Start counts one piece of work in.
func (c *Counter) Start() { c.n.Add(1) }

// Done counts one piece of work out.
func (c *Counter) Done() {
	// Wait stores waiting before it loads n, and Done adds before it
	// loads waiting: whichever comes second sees the other, so a Wait
	// that saw work left is always woken when it ends.
	if c.n.Add(-1) == 0 && c.waiting.Load() {
		select {
		case c.zero <- struct{}{}:
		default: // a token is already there
		}
	}
}

// Wait waits until no work is in progress, or ctx ends. Only one Wait may
// run at a time.
func (c *Counter) Wait(ctx context.Context) error {
	c.once.Do(func() { c.zero = make(chan struct{}, 1) })
	c.waiting.Store(true)
	for c.n.Load() > 0 {
		select {
		case <-c.zero:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// InProgress is how much work was started and has not ended.
func (c *Counter) InProgress() int64 { return c.n.Load() }
