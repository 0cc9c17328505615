package statestore

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// deadline is a request's time limit as a context that starts a timer
// only once something waits on Done, and reads the clock only once
// something asks when it ends. Most requests are served where they
// arrive, where neither happens: a read asks the replica to be ready,
// which needs the deadline only when it must wait. A timer for each,
// started and stopped, cost about 2 % of a GET's server CPU, and a clock
// read about 4 %. The limit runs from the request's arrival when that was
// noted (metrics), else from the first time it is asked for: when the
// request first has to wait (for its replica to be ready, for a leader
// elsewhere, for a write the leader refused to go on to the next).
type deadline struct {
	d       time.Duration
	at      time.Time
	atOnce  sync.Once
	once    sync.Once
	started atomic.Bool
	ctx     context.Context
	cancel  context.CancelFunc
}

// newDeadline is a deadline d from now.
func newDeadline(d time.Duration) *deadline {
	c := &deadline{d: d}
	c.from(time.Now())
	return c
}

// deadlineIn starts the request's deadline in the request itself: one
// allocation less per read and write. A request is handled once.
func (r *Request) deadlineIn(d time.Duration) *deadline {
	r.deadline = deadline{d: d}
	if !r.start.IsZero() {
		r.deadline.from(r.start) // the request's arrival, noted already
	}
	return &r.deadline
}

// from sets the deadline to run from t, before anything asks for it.
func (c *deadline) from(t time.Time) {
	c.atOnce.Do(func() { c.at = t.Add(c.d) })
}

// when is the deadline, read off the clock the first time.
func (c *deadline) when() time.Time {
	c.atOnce.Do(func() { c.at = time.Now().Add(c.d) })
	return c.at
}

func (c *deadline) Deadline() (time.Time, bool) { return c.when(), true }

func (c *deadline) Done() <-chan struct{} {
	c.once.Do(func() {
		c.ctx, c.cancel = context.WithDeadline(context.Background(), c.when())
		c.started.Store(true)
	})
	return c.ctx.Done()
}

func (c *deadline) Err() error {
	if c.started.Load() {
		return c.ctx.Err()
	}
	if !time.Now().Before(c.when()) {
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
