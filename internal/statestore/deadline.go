package statestore

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// deadline is a request's time limit as a context that starts a timer
// only once something waits on Done. Most requests are served where they
// arrive, where only the deadline is read (how long to wait for a
// leader); a timer for each, started and stopped, cost about 2 % of a
// GET's server CPU. Requests forwarded to another node wait on Done.
type deadline struct {
	at      time.Time
	once    sync.Once
	started atomic.Bool
	ctx     context.Context
	cancel  context.CancelFunc
}

func newDeadline(d time.Duration) *deadline { return &deadline{at: time.Now().Add(d)} }

// deadlineIn starts the request's deadline in the request itself: one
// allocation less per read and write. A request is handled once.
func (r *Request) deadlineIn(d time.Duration) *deadline {
	now := r.start // the request's arrival, if noted (begin): a clock read less
	if now.IsZero() {
		now = time.Now()
	}
	r.deadline = deadline{at: now.Add(d)}
	return &r.deadline
}

func (c *deadline) Deadline() (time.Time, bool) { return c.at, true }

func (c *deadline) Done() <-chan struct{} {
	c.once.Do(func() {
		c.ctx, c.cancel = context.WithDeadline(context.Background(), c.at)
		c.started.Store(true)
	})
	return c.ctx.Done()
}

func (c *deadline) Err() error {
	if c.started.Load() {
		return c.ctx.Err()
	}
	if !time.Now().Before(c.at) {
		return context.DeadlineExceeded
	}
	return nil
}

func (c *deadline) Value(any) any { return nil }

// release stops the timer, if one started.
func (c *deadline) release() {
	if c.started.Load() {
		c.cancel()
	}
}
