package client

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Lease is a named lease in the state store, held by one holder at a time
// until it expires or is released; the AIO SDKs' Lease, on the same wire
// sequence (SET name holder NEX PX, VDEL name holder). Each acquisition or
// renewal yields a fencing token, strictly greater than any before.
type Lease struct {
	c      *Client
	name   []byte
	holder []byte

	mu    sync.Mutex
	token Version
}

// Lease returns the lease called name, to be held as holder (empty means
// the client id).
func (c *Client) Lease(name, holder string) *Lease {
	if holder == "" {
		holder = c.ID()
	}
	return &Lease{c: c, name: []byte(name), holder: []byte(holder)}
}

// ErrNotHeld is returned when an operation needs the lease and it is held
// by someone else.
var ErrNotHeld = errors.New("client: lease held by another holder")

// TryAcquire takes or renews the lease for ttl if it is free or already
// ours, without waiting. It reports whether it did.
func (l *Lease) TryAcquire(ctx context.Context, ttl time.Duration) (bool, error) {
	res, err := l.c.Set(ctx, l.name, l.holder, If(NotExistsOrSame), WithTTL(ttl))
	if err != nil || !res.Applied {
		return false, err
	}
	l.mu.Lock()
	l.token = res.Version
	l.mu.Unlock()
	return true, nil
}

// Token returns the fencing token of the last successful acquisition; pass
// it with WithFencingToken to writes made under the lease.
func (l *Lease) Token() Version {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.token
}

// Acquire waits until the lease is ours: it watches the lease key and tries
// again whenever it is deleted or expires.
func (l *Lease) Acquire(ctx context.Context, ttl time.Duration) error {
	w, err := l.c.Watch(ctx, l.name)
	if err != nil {
		return err
	}
	defer w.Stop(context.Background())
	for {
		ok, err := l.TryAcquire(ctx, ttl)
		if err != nil || ok {
			return err
		}
		// Wait for the holder to go; a SET by another holder just means
		// trying again later.
		for waiting := true; waiting; {
			select {
			case e, open := <-w.Events():
				if !open {
					return ErrClosed
				}
				waiting = !e.Deleted
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
}

// KeepAlive renews the lease every interval until ctx ends or a renewal
// fails (the lease was lost): the returned channel then receives the
// reason (ctx.Err() on a normal end) and is closed.
func (l *Lease) KeepAlive(ctx context.Context, ttl, interval time.Duration) <-chan error {
	out := make(chan error, 1)
	go func() {
		defer close(out)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				out <- ctx.Err()
				return
			case <-t.C:
			}
			ok, err := l.TryAcquire(ctx, ttl)
			if err == nil && !ok {
				err = ErrNotHeld
			}
			if err != nil {
				if ctx.Err() != nil {
					err = ctx.Err()
				}
				out <- err
				return
			}
		}
	}()
	return out
}

// Release gives the lease up if this holder has it.
func (l *Lease) Release(ctx context.Context) error {
	_, err := l.c.VDel(ctx, l.name, l.holder)
	return err
}

// Holder returns who holds the lease, if anyone.
func (l *Lease) Holder(ctx context.Context) (string, bool, error) {
	v, err := l.c.Get(ctx, l.name)
	return string(v.Value), v.Found, err
}

// Leadership is a won election: the lease is renewed in the background
// until Resign, or until a renewal fails and Lost is closed.
type Leadership struct {
	Lease  *Lease
	cancel context.CancelFunc
	lost   chan struct{}
	err    error
}

// Campaign waits until candidate leads the election called name, then
// keeps the leadership (renewing at a third of ttl).
func (c *Client) Campaign(ctx context.Context, name, candidate string, ttl time.Duration) (*Leadership, error) {
	l := c.Lease(name, candidate)
	if err := l.Acquire(ctx, ttl); err != nil {
		return nil, err
	}
	kctx, cancel := context.WithCancel(context.Background())
	ld := &Leadership{Lease: l, cancel: cancel, lost: make(chan struct{})}
	errs := l.KeepAlive(kctx, ttl, ttl/3)
	go func() {
		ld.err = <-errs
		close(ld.lost)
	}()
	return ld, nil
}

// Lost is closed when the leadership ends (by Resign or a failed renewal).
func (ld *Leadership) Lost() <-chan struct{} { return ld.lost }

// Token is the fencing token of the current term.
func (ld *Leadership) Token() Version { return ld.Lease.Token() }

// Resign stops renewing and releases the lease.
func (ld *Leadership) Resign(ctx context.Context) error {
	ld.cancel()
	<-ld.lost
	return ld.Lease.Release(ctx)
}
