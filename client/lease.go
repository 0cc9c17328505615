package client

import (
	"context"
	"errors"
	"fmt"
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
	sent  time.Time // when the request of the last acquisition was sent
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

// ErrLeaseExpired is reported by KeepAlive when no renewal succeeded
// within the lease's term: it may have expired and been taken by another.
var ErrLeaseExpired = errors.New("client: lease not renewed within its term")

// MinTTL is the shortest lease term: the protocol counts in milliseconds.
const MinTTL = time.Millisecond

func checkTTL(ttl time.Duration) error {
	if ttl < MinTTL {
		return fmt.Errorf("client: lease term %v is below the minimum of %v", ttl, MinTTL)
	}
	return nil
}

// TryAcquire takes or renews the lease for ttl if it is free or already
// ours, without waiting. It reports whether it did.
func (l *Lease) TryAcquire(ctx context.Context, ttl time.Duration) (bool, error) {
	if err := checkTTL(ttl); err != nil {
		return false, err
	}
	sent := time.Now()
	res, err := l.c.Set(ctx, l.name, l.holder, If(NotExistsOrSame), WithTTL(ttl))
	if err != nil || !res.Applied {
		return false, err
	}
	l.mu.Lock()
	l.token, l.sent = res.Version, sent
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
// again whenever it is deleted or expires, and at least once per ttl in
// case a notification was lost.
func (l *Lease) Acquire(ctx context.Context, ttl time.Duration) error {
	if err := checkTTL(ttl); err != nil {
		return err
	}
	w, err := l.c.Watch(ctx, l.name)
	if err != nil {
		return err
	}
	// Stopped in the background: the lease's term is running, and a slow
	// connection must not eat into it before renewal starts.
	defer func() { go w.Stop(context.Background()) }()
	retry := time.NewTicker(ttl)
	defer retry.Stop()
	for {
		ok, err := l.TryAcquire(ctx, ttl)
		if err != nil || ok {
			return err
		}
		// Wait for the holder to go; a SET by another holder just means
		// waiting on.
		for waiting := true; waiting; {
			select {
			case e, open := <-w.Events():
				if !open {
					return ErrClosed
				}
				waiting = !e.Deleted
			case <-retry.C:
				waiting = false
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
}

// KeepAlive renews the lease every interval until ctx ends or the lease is
// lost: the returned channel then receives the reason (ctx.Err() on a
// normal end) and is closed. A renewal that fails for want of a connection
// is retried, but only until the term of the last successful one ends
// (ErrLeaseExpired): past that point another holder may have it. A
// renewal refused because another holder has the lease is ErrNotHeld.
func (l *Lease) KeepAlive(ctx context.Context, ttl, interval time.Duration) <-chan error {
	out := make(chan error, 1)
	if err := checkTTL(ttl); err != nil {
		out <- err
		close(out)
		return out
	}
	if interval <= 0 || interval >= ttl {
		out <- fmt.Errorf("client: renewal interval %v must be above zero and below the term %v", interval, ttl)
		close(out)
		return out
	}
	go func() {
		defer close(out)
		// The server set the lease after the acquiring request was sent:
		// it lasts at least until then+ttl, clocks running at one rate.
		l.mu.Lock()
		since := l.sent
		l.mu.Unlock()
		if since.IsZero() {
			since = time.Now() // never acquired: the first renewal takes it
		}
		expires := since.Add(ttl)
		next := time.NewTimer(interval)
		defer next.Stop()
		for {
			select {
			case <-ctx.Done():
				out <- ctx.Err()
				return
			case <-next.C:
			}
			sent := time.Now()
			rctx, cancel := context.WithDeadline(ctx, expires)
			ok, err := l.TryAcquire(rctx, ttl)
			cancel()
			switch {
			case ctx.Err() != nil:
				out <- ctx.Err()
				return
			case err == nil && !ok:
				out <- ErrNotHeld
				return
			case err == nil:
				expires = sent.Add(ttl)
				next.Reset(interval)
			case errors.Is(err, ErrClosed):
				out <- err
				return
			case !time.Now().Before(expires):
				out <- fmt.Errorf("%w: %v", ErrLeaseExpired, err)
				return
			default:
				// Not connected or no reply: try again soon, within the term.
				next.Reset(min(interval, time.Until(expires)/4+time.Millisecond))
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
	if ttl < 3*MinTTL {
		return nil, fmt.Errorf("client: election term %v is below the minimum of %v (renewals come every third)", ttl, 3*MinTTL)
	}
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

// Err says why the leadership ended once Lost is closed: ErrNotHeld,
// ErrLeaseExpired, or context.Canceled after Resign. It is nil before.
func (ld *Leadership) Err() error {
	select {
	case <-ld.lost:
		return ld.err
	default:
		return nil
	}
}

// Token is the fencing token of the current term.
func (ld *Leadership) Token() Version { return ld.Lease.Token() }

// Resign stops renewing and releases the lease.
func (ld *Leadership) Resign(ctx context.Context) error {
	ld.cancel()
	<-ld.lost
	return ld.Lease.Release(ctx)
}
