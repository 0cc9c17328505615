package client_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/mqkv/mqkv/client"
	"github.com/mqkv/mqkv/internal/server"
	"github.com/mqkv/mqkv/internal/statestore"
)

func start(t *testing.T, dir, addr string) *server.Server {
	t.Helper()
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	s, err := server.Start(server.Config{Listen: addr, DataDir: dir, InMemory: dir == "", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func dial(t *testing.T, addr string) *client.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, client.Config{URL: "mqtt://" + addr})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestCRUD(t *testing.T) {
	s := start(t, t.TempDir(), "")
	c := dial(t, s.Addr())
	ctx := ctx(t)
	k := []byte("k")
	set, err := c.Set(ctx, k, []byte("v1"))
	if err != nil || !set.Applied || set.Version.IsZero() {
		t.Fatalf("Set: %+v %v", set, err)
	}
	got, err := c.Get(ctx, k)
	if err != nil || !got.Found || string(got.Value) != "v1" || got.Version != set.Version {
		t.Fatalf("Get: %+v %v", got, err)
	}
	if res, _ := c.Set(ctx, k, []byte("v2"), client.If(client.NotExists)); res.Applied || res.Version != set.Version {
		t.Fatalf("NX on existing key: %+v", res)
	}
	if res, _ := c.Set(ctx, k, []byte("v1"), client.If(client.NotExistsOrSame)); !res.Applied || res.Version.Compare(set.Version) <= 0 {
		t.Fatalf("NEX renewal: %+v", res)
	}
	if res, _ := c.VDel(ctx, k, []byte("other")); res.Deleted != -1 {
		t.Fatalf("VDel mismatch: %+v", res)
	}
	if res, _ := c.Del(ctx, k); res.Deleted != 1 {
		t.Fatalf("Del: %+v", res)
	}
	if got, _ := c.Get(ctx, k); got.Found {
		t.Fatal("found after Del")
	}
	if _, err := c.Set(ctx, nil, []byte("v")); err != client.ErrKeyLengthZero {
		t.Fatalf("empty key: %v", err)
	}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestTTLAndFencing(t *testing.T) {
	s := start(t, "", "")
	c := dial(t, s.Addr())
	ctx := ctx(t)
	w, err := c.Watch(ctx, []byte("ttl"))
	if err != nil {
		t.Fatal(err)
	}
	c.Set(ctx, []byte("ttl"), []byte("v"), client.WithTTL(200*time.Millisecond))
	if e := <-w.Events(); e.Deleted || string(e.Value) != "v" {
		t.Fatalf("first event %+v", e)
	}
	if e := <-w.Events(); !e.Deleted {
		t.Fatalf("expiry event %+v", e)
	}
	lease := c.Lease("guard", "")
	if ok, err := lease.TryAcquire(ctx, time.Minute); !ok || err != nil {
		t.Fatal(ok, err)
	}
	tok := lease.Token()
	if _, err := c.Set(ctx, []byte("guarded"), []byte("v"), client.WithFencingToken(tok)); err != nil {
		t.Fatal(err)
	}
	low, _ := client.ParseVersion("000000000000001:00000:x")
	if _, err := c.Set(ctx, []byte("guarded"), []byte("w"), client.WithFencingToken(low)); err != client.ErrFencingTokenLowerVersion {
		t.Fatalf("lower token: %v", err)
	}
	if _, err := c.Del(ctx, []byte("guarded")); err != client.ErrMissingFencingToken {
		t.Fatalf("no token: %v", err)
	}
}

func TestWatchSurvivesServerRestart(t *testing.T) {
	dir := t.TempDir()
	s := start(t, dir, "")
	addr := s.Addr()
	watcher := dial(t, addr)
	ctx := ctx(t)
	w, err := watcher.Watch(ctx, []byte("config"))
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	s = start(t, dir, addr)
	writer := dial(t, addr)
	// The watcher reconnects and registers again by itself; keep writing
	// until a notification arrives.
	deadline := time.After(15 * time.Second)
	for i := 0; ; i++ {
		writer.Set(ctx, []byte("config"), []byte("after-restart"))
		select {
		case e := <-w.Events():
			if string(e.Value) != "after-restart" {
				t.Fatalf("event %+v", e)
			}
			return
		case <-time.After(200 * time.Millisecond):
		case <-deadline:
			t.Fatal("no notification after the server restarted")
		}
	}
}

func TestResyncAfterReconnect(t *testing.T) {
	dir := t.TempDir()
	s := start(t, dir, "")
	addr := s.Addr()
	watcher := dial(t, addr)
	ctx := ctx(t)
	w, err := watcher.Watch(ctx, []byte("state"))
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	// Change the key while the watcher cannot hear: through a second
	// server run on the same data, before the watcher reconnects.
	s = start(t, dir, addr)
	writer := dial(t, addr)
	writer.Set(ctx, []byte("state"), []byte("changed-while-away"))
	select {
	case e := <-w.Events():
		if string(e.Value) != "changed-while-away" {
			t.Fatalf("event %+v", e)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the change made during the outage was never reported")
	}
}

func TestLeaseLockAndLeader(t *testing.T) {
	s := start(t, "", "")
	a, b := dial(t, s.Addr()), dial(t, s.Addr())
	ctx := ctx(t)
	la, lb := a.Lease("lock", ""), b.Lease("lock", "")
	if ok, _ := la.TryAcquire(ctx, 500*time.Millisecond); !ok {
		t.Fatal("a could not take the free lease")
	}
	if ok, _ := lb.TryAcquire(ctx, time.Second); ok {
		t.Fatal("b took a held lease")
	}
	if h, held, _ := lb.Holder(ctx); !held || h != a.ID() {
		t.Fatalf("holder %q %v", h, held)
	}
	// b waits for a's lease to expire.
	if err := lb.Acquire(ctx, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if lb.Token().Compare(la.Token()) <= 0 {
		t.Fatal("b's token not above a's")
	}
	if err := lb.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// Leader election: b leads, a waits, takes over when b resigns.
	lead, err := b.Campaign(ctx, "leader", "b", 600*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(900 * time.Millisecond) // past one term: renewals keep it
	if h, _, _ := a.Lease("leader", "").Holder(ctx); h != "b" {
		t.Fatalf("leader %q", h)
	}
	got := make(chan *client.Leadership)
	go func() {
		ld, err := a.Campaign(ctx, "leader", "a", time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- ld
	}()
	if err := lead.Resign(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-lead.Lost():
	default:
		t.Fatal("Lost not closed after Resign")
	}
	ld := <-got
	if ld == nil || ld.Token().Compare(lead.Token()) <= 0 {
		t.Fatal("a did not take over with a greater token")
	}
	ld.Resign(ctx)
}

func TestExtensions(t *testing.T) {
	s := start(t, "", "")
	c := dial(t, s.Addr())
	ctx := ctx(t)
	for _, k := range []string{"fleet/a/temp", "fleet/b/temp", "fleet/b/hum", "other"} {
		c.Set(ctx, []byte(k), []byte("1"))
	}
	var keys []string
	err := c.Scan(ctx, []byte("fleet/*/temp"), 1, func(k []byte) bool { keys = append(keys, string(k)); return true })
	if err != nil || len(keys) != 2 || keys[0] != "fleet/a/temp" || keys[1] != "fleet/b/temp" {
		t.Fatalf("Scan: %q %v", keys, err)
	}
	w, err := c.WatchPattern(ctx, []byte("fleet/*"))
	if err != nil {
		t.Fatal(err)
	}
	cur, _ := c.Get(ctx, []byte("fleet/a/temp"))
	res, prev, err := c.Swap(ctx, []byte("fleet/a/temp"), []byte("2"), client.IfVersion(cur.Version))
	if err != nil || !res.Applied || !prev.Found || string(prev.Value) != "1" {
		t.Fatalf("Swap with the current version: %+v %+v %v", res, prev, err)
	}
	if res, _ := c.Set(ctx, []byte("fleet/a/temp"), []byte("3"), client.IfVersion(cur.Version)); res.Applied {
		t.Fatal("Set with a stale version applied")
	}
	if res, _ := c.Set(ctx, []byte("fleet/new"), []byte("x"), client.IfVersion(client.Version{})); !res.Applied {
		t.Fatal("IfVersion(zero) on a new key")
	}
	if d, _ := c.Del(ctx, []byte("fleet/new"), client.IfVersion(cur.Version)); d.Deleted != -1 {
		t.Fatalf("Del with a stale version: %+v", d)
	}
	for _, want := range []string{"fleet/a/temp=2", "fleet/new=x"} {
		select {
		case e := <-w.Events():
			if got := string(e.Key) + "=" + string(e.Value); got != want {
				t.Fatalf("pattern event %s, want %s", got, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no pattern event for %s", want)
		}
	}
	if err := w.Stop(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestAdd: a counter over MQTT, concurrent Adds each counted once, the
// errors named.
func TestAdd(t *testing.T) {
	s := start(t, "", "")
	c := dial(t, s.Addr())
	ctx := ctx(t)
	n, v, err := c.Add(ctx, []byte("hits"), 5)
	if err != nil || n != 5 || v.IsZero() {
		t.Fatalf("Add to a missing key: %d %v %v", n, v, err)
	}
	if n, _, err := c.Add(ctx, []byte("hits"), -7); err != nil || n != -2 {
		t.Fatalf("Add of a negative delta: %d %v", n, err)
	}
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 {
				if _, _, err := c.Add(ctx, []byte("hits"), 1); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	if got, _ := c.Get(ctx, []byte("hits")); string(got.Value) != "98" {
		t.Fatalf("after 100 concurrent Adds: %q", got.Value)
	}
	c.Set(ctx, []byte("name"), []byte("x"))
	if _, _, err := c.Add(ctx, []byte("name"), 1); !errors.Is(err, client.ErrNotInteger) {
		t.Fatalf("Add to text: %v", err)
	}
	c.Set(ctx, []byte("max"), []byte("9223372036854775807"))
	if _, _, err := c.Add(ctx, []byte("max"), 1); !errors.Is(err, client.ErrOverflow) {
		t.Fatalf("Add past the top: %v", err)
	}
}

// TestCloseEndsPendingRequests: a request waiting for a connection that
// will not come back ends with ErrClosed when the client is closed.
func TestCloseEndsPendingRequests(t *testing.T) {
	s := start(t, "", "")
	c := dial(t, s.Addr())
	s.Close()
	errs := make(chan error, 1)
	go func() {
		_, err := c.Get(context.Background(), []byte("k"))
		errs <- err
	}()
	c.Close()
	select {
	case err := <-errs:
		if !errors.Is(err, client.ErrClosed) {
			t.Fatalf("pending Get: %v, want ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("pending Get still waiting after Close")
	}
	if _, err := c.Watch(context.Background(), []byte("k")); !errors.Is(err, client.ErrClosed) {
		t.Fatalf("Watch after Close: %v", err)
	}
}

// TestKeepAliveReportsExpiry: when the server is gone, KeepAlive says the
// lease is lost once its term has run out, not before and not never.
func TestKeepAliveReportsExpiry(t *testing.T) {
	s := start(t, "", "")
	c := dial(t, s.Addr())
	ctx := ctx(t)
	l := c.Lease("ka", "")
	const ttl = 400 * time.Millisecond
	if ok, err := l.TryAcquire(ctx, ttl); !ok || err != nil {
		t.Fatal(ok, err)
	}
	lost := l.KeepAlive(ctx, ttl, ttl/4)
	s.Close()
	gone := time.Now()
	select {
	case err := <-lost:
		if !errors.Is(err, client.ErrLeaseExpired) {
			t.Fatalf("KeepAlive: %v, want ErrLeaseExpired", err)
		}
		// Renewals up to the close kept the lease; it is reported lost
		// no earlier than a term after the last could have succeeded.
		if time.Since(gone) < ttl-ttl/4 {
			t.Fatalf("reported lost after %v, before the term ran out", time.Since(gone))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("KeepAlive never reported the lease lost")
	}
}

// TestLeadershipReportsWhyItEnded: a leadership taken away reports
// ErrNotHeld, a resignation context.Canceled.
func TestLeadershipReportsWhyItEnded(t *testing.T) {
	s := start(t, "", "")
	a, b := dial(t, s.Addr()), dial(t, s.Addr())
	ctx := ctx(t)
	ld, err := a.Campaign(ctx, "term", "a", 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if ld.Err() != nil {
		t.Fatalf("Err while leading: %v", ld.Err())
	}
	// An operator hands the lease to b.
	if _, err := b.Set(ctx, []byte("term"), []byte("b")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ld.Lost():
		if !errors.Is(ld.Err(), client.ErrNotHeld) {
			t.Fatalf("Err %v, want ErrNotHeld", ld.Err())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("leadership not lost")
	}
	b.Del(ctx, []byte("term"))
	ld, err = a.Campaign(ctx, "term", "a", 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	ld.Resign(ctx)
	if !errors.Is(ld.Err(), context.Canceled) {
		t.Fatalf("Err after Resign: %v", ld.Err())
	}
}

func TestBadTermsAreRefused(t *testing.T) {
	s := start(t, "", "")
	c := dial(t, s.Addr())
	ctx := ctx(t)
	if _, err := c.Lease("x", "").TryAcquire(ctx, 0); err == nil {
		t.Error("TryAcquire with a zero term accepted")
	}
	if _, err := c.Campaign(ctx, "x", "me", time.Millisecond); err == nil {
		t.Error("Campaign with a 1 ms term accepted")
	}
	if err := <-c.Lease("x", "").KeepAlive(ctx, time.Second, 2*time.Second); err == nil {
		t.Error("KeepAlive renewing less often than the term accepted")
	}
	if _, err := c.Set(ctx, []byte("x"), []byte("v"), client.WithTTL(-time.Second)); err == nil {
		t.Error("negative TTL accepted")
	}
	if v, _ := c.Get(ctx, []byte("x")); v.Found {
		t.Error("a refused SET wrote")
	}
}

// TestWatchReportsEveryGap cuts a watcher's connection again and again
// under a writer that never pauses, on a server that keeps no history
// (every KEYNOTIFY ... SINCE is answered "history truncated", as after a
// restart): every acknowledged value must reach the watcher, or come
// before a Resync event. The watcher's requests reach the server 20 ms
// late, so changes are applied between its new registration and its read
// of the key's state: their notifications, newer than the gap, used to
// hide it (no Resync event, changes lost).
func TestWatchReportsEveryGap(t *testing.T) {
	s, err := server.Start(server.Config{Listen: "127.0.0.1:0", InMemory: true,
		History: statestore.HistoryLimits{PerPartition: -1}, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	p := newSlowProxy(t, s.Addr(), 20*time.Millisecond)
	watcher, writer := dial(t, p.addr), dial(t, s.Addr())
	ctx := ctx(t)
	key := []byte("counter")
	w, err := watcher.Watch(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var acked []int
	var werr error
	wctx, stop := context.WithCancel(ctx)
	written := make(chan struct{})
	go func() {
		defer close(written)
		for i := 1; wctx.Err() == nil; i++ {
			if _, err := writer.Set(wctx, key, []byte(strconv.Itoa(i))); err != nil {
				if wctx.Err() == nil {
					werr = err
				}
				return
			}
			acked = append(acked, i)
			// Paced: a watcher behind the slow proxy acknowledges its
			// notifications late, and unpaced (over 1,000 SETs a second)
			// the server's queue for it filled and dropped some, as it
			// does for a client that reads too slowly (CI, under load).
			time.Sleep(5 * time.Millisecond)
		}
	}()
	t.Cleanup(func() { stop(); <-written }) // before the clients close
	last, seen, lastResync, prev, resyncs := 0, map[int]bool{}, 0, 0, 0
	// next waits for the watcher's next event.
	next := func() {
		t.Helper()
		select {
		case e := <-w.Events():
			n, _ := strconv.Atoi(string(e.Value))
			if n < prev {
				t.Fatalf("value %d after %d: out of order", n, prev)
			}
			prev, seen[n] = n, true
			if e.Resync {
				lastResync, resyncs = n, resyncs+1
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("no event after value %d", prev)
		}
	}
	for cut := 0; cut < 3; cut++ {
		for target := prev + 20; prev < target; {
			next()
		}
		p.cut()
	}
	for target := prev + 20; prev < target; {
		next()
	}
	stop()
	<-written
	if werr != nil {
		t.Fatal(werr)
	}
	// Wait until the last acknowledged value is reached: seen, or passed
	// by a resync (which may report a later value whose SET was cut off
	// by stop before its reply, so the last acknowledged one itself is
	// never an event of its own).
	for last = acked[len(acked)-1]; prev < last; {
		next()
	}
	for _, a := range acked {
		if !seen[a] && a > lastResync {
			t.Fatalf("value %d acknowledged, never notified, and no resync after it (%d acknowledged, %d resyncs)", a, len(acked), resyncs)
		}
	}
	if resyncs < 3 {
		t.Fatalf("%d resync events for 3 gaps", resyncs)
	}
}

// slowProxy forwards TCP connections to a server, each client's bytes
// delayed by a fixed time; cut closes every connection it carries.
type slowProxy struct {
	addr  string
	mu    sync.Mutex
	conns []net.Conn
}

func newSlowProxy(t *testing.T, target string, delay time.Duration) *slowProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	p := &slowProxy{addr: l.Addr().String()}
	t.Cleanup(p.cut)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			go io.Copy(c, u)
			// Latency, not a rate limit: each chunk leaves delay after it
			// came, however many follow it (a sleep per read let through
			// one PUBACK per 20 ms under load, and the server's queue for
			// the watcher filled).
			type chunk struct {
				b   []byte
				due time.Time
			}
			chunks := make(chan chunk, 4096)
			go func() {
				defer close(chunks)
				for {
					buf := make([]byte, 64<<10)
					n, err := c.Read(buf)
					if err != nil {
						return
					}
					chunks <- chunk{buf[:n], time.Now().Add(delay)}
				}
			}()
			go func() {
				defer u.Close()
				for ch := range chunks {
					time.Sleep(time.Until(ch.due))
					if _, err := u.Write(ch.b); err != nil {
						c.Close()
						return
					}
				}
			}()
		}
	}()
	return p
}

func (p *slowProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// TestServerReferenceIsFollowed: a server that closes the connection with
// DISCONNECT 0x8B and a Server Reference (a stopping cluster member names
// another) sends the client there; if the referred server does not
// answer later, the configured one is tried again.
func TestServerReferenceIsFollowed(t *testing.T) {
	a, b := start(t, "", ""), start(t, "", "")
	c := dial(t, a.Addr())
	ctx := ctx(t)
	if _, err := c.Set(ctx, []byte("where"), []byte("a")); err != nil {
		t.Fatal(err)
	}
	addr := a.Addr()
	a.Broker().SetServerReference(b.Addr())
	a.Close()
	// The next request is answered by b: its store, not a's.
	answeredByB(t, ctx, c, b)
	// b goes without a referral: the client goes back to its configured
	// address, where a server runs again.
	b.Close()
	a2 := start(t, "", addr)
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := c.Get(ctx, []byte("where")); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("no answer from the configured address again: %v", err)
		}
	}
	if n := a2.Broker().Traffic().Clients; n != 1 {
		t.Fatalf("%d clients on the configured server", n)
	}
}

// TestServerReferenceOutlivesAFailedAttempt: a referred server that does
// not answer the first attempt is tried again (in turn with the
// configured one) until a connection is made. Before, the referral was
// used once: a client referred by a stopping member to a member that was
// busy for a moment went back to the stopped one's address for good.
func TestServerReferenceOutlivesAFailedAttempt(t *testing.T) {
	a := start(t, "", "")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	later := l.Addr().String() // nothing listens there until b starts
	l.Close()
	c := dial(t, a.Addr())
	ctx := ctx(t)
	if _, err := c.Set(ctx, []byte("where"), []byte("a")); err != nil {
		t.Fatal(err)
	}
	a.Broker().SetServerReference(later)
	a.Close()
	// Attempts to the referred server and to a's address both fail a
	// while; then the referred one comes up.
	time.Sleep(1500 * time.Millisecond)
	answeredByB(t, ctx, c, start(t, "", later))
}

// answeredByB waits until c, referred to b, reads "where" there (b's
// store, where it is not set) within 15 s, and checks that c is b's one
// client.
func answeredByB(t *testing.T, ctx context.Context, c *client.Client, b *server.Server) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		v, err := c.Get(ctx, []byte("where"))
		if err == nil {
			if v.Found {
				t.Fatalf("read %q: not the referred server's store", v.Value)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no answer from the server referred to: %v", err)
		}
	}
	if n := b.Broker().Traffic().Clients; n != 1 {
		t.Fatalf("%d clients on the referred server", n)
	}
}
