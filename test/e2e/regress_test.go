package e2e

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
)

// Attacks that held when the server was tried adversarially, kept as
// regression tests: each must go on holding.

// ackedWrites is a load of SETs to keys never written twice, so that the
// check after a fault is simple: every acknowledged key must be there.
type ackedWrites struct {
	mu    sync.Mutex
	acked []string
}

// run writes from one client until stop closes or the server goes away.
func (a *ackedWrites) run(c *rawClient, prefix string, stop <-chan struct{}) {
	for i := 0; ; i++ {
		select {
		case <-stop:
			return
		default:
		}
		key := fmt.Sprintf("%s/%d", prefix, i)
		// Not waiting for the PUBACK: after a kill, paho would wait out
		// its timeout for it.
		reply, err := c.trySend(req{args: []string{"SET", key, key}, ts: now(), disconnects: true})
		if err != nil {
			return
		}
		select {
		case p := <-reply:
			if string(p.Payload) == "+OK\r\n" {
				a.mu.Lock()
				a.acked = append(a.acked, key)
				a.mu.Unlock()
			}
		case <-stop:
			return
		case <-time.After(15 * time.Second):
			return
		}
	}
}

// load runs n writers against s until the returned function is called,
// which waits for them.
func (a *ackedWrites) load(t *testing.T, s interface{ Addr() string }, name string, n int) (stop func()) {
	t.Helper()
	done := make(chan struct{})
	var wg sync.WaitGroup
	for w := range n {
		c := dialRaw(t, s, fmt.Sprintf("%s-%d", name, w), rawOpts{cleanStart: true})
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.run(c, fmt.Sprintf("%s/%d", name, w), done)
		}()
	}
	return func() {
		close(done)
		wg.Wait()
	}
}

// check reads every acknowledged key back.
func (a *ackedWrites) check(t *testing.T, s interface{ Addr() string }) {
	t.Helper()
	c := dialRaw(t, s, "checker", rawOpts{cleanStart: true})
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.acked) == 0 {
		t.Fatal("no write was acknowledged")
	}
	for _, k := range a.acked {
		if got := string(c.call("GET", k).Payload); got != fmt.Sprintf("$%d\r\n%s\r\n", len(k), k) {
			t.Fatalf("acknowledged %s reads %q", k, got)
		}
	}
}

func (a *ackedWrites) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.acked)
}

// TestSIGSTOPUnderLoad: a server frozen for two seconds under load
// resumes where it was: nothing acknowledged is lost, and writes go on.
func TestSIGSTOPUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the binary")
	}
	p := startProcess(t, t.TempDir())
	var w ackedWrites
	stop := w.load(t, p, "frozen", 4)
	eventually(t, "writes under way", func() bool { return w.count() > 100 })
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // the fault is the time frozen
	before := w.count()
	p.Signal(syscall.SIGCONT)
	eventually(t, "writes after SIGCONT", func() bool { return w.count() > before+100 })
	stop()
	w.check(t, p)
}

// TestRestartLoopUnderLoad: five SIGKILLs and restarts under load;
// every acknowledged write is there at the end.
func TestRestartLoopUnderLoad(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("runs the binary")
	}
	dir := t.TempDir()
	var w ackedWrites
	var p *server.Process
	for round := range 5 {
		p = startProcess(t, dir)
		before := w.count()
		stop := w.load(t, p, fmt.Sprintf("round%d", round), 4)
		eventually(t, "writes under way", func() bool { return w.count() > before+50 })
		p.Kill()
		stop()
	}
	p = startProcess(t, dir)
	w.check(t, p)
}

// TestIdleConnectionsAreClosed: 3,000 connections that never send
// CONNECT are closed after the connect timeout, and the server serves
// others meanwhile.
func TestIdleConnectionsAreClosed(t *testing.T) {
	t.Parallel()
	const n = 3000
	s := startServer(t, inMemory(), func(c *serverConfig) { c.ConnectTimeout = time.Second })
	conns := make([]net.Conn, 0, n)
	for range n {
		conns = append(conns, dialTCP(t, s.Addr()))
	}
	c := dialRaw(t, s, "busy", rawOpts{cleanStart: true})
	expectPayload(t, c.call("SET", "k", "v"), "+OK\r\n")
	deadline := time.Now().Add(20 * time.Second)
	for i, conn := range conns {
		conn.SetReadDeadline(deadline)
		if _, err := conn.Read(make([]byte, 1)); err == nil {
			t.Fatalf("connection %d got data without sending CONNECT", i)
		} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("connection %d still open 20 s after the 1 s connect timeout", i)
		}
	}
	expectPayload(t, c.call("GET", "k"), "$1\r\nv\r\n")
}

// TestManyUserProperties: a PUBLISH with 1,000 user properties reaches a
// subscriber with all of them, and a state store request carrying them is
// answered.
func TestManyUserProperties(t *testing.T) {
	s := startServer(t, inMemory())
	sub := dialRaw(t, s, "sub", rawOpts{cleanStart: true})
	if code := sub.subscribe("props/#", 1); code != 1 {
		t.Fatalf("subscribe: %#x", code)
	}
	pub := dialRaw(t, s, "pub", rawOpts{cleanStart: true})
	props := &paho.PublishProperties{}
	for i := range 1000 {
		props.User.Add(fmt.Sprintf("k%d", i), strings.Repeat("v", i%50))
	}
	ctx := ctxFor(t, 10*time.Second)
	if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "props/x", QoS: 1, Payload: []byte("p"), Properties: props}); err != nil {
		t.Fatal(err)
	}
	got, ok := sub.nextPublish(10 * time.Second)
	if !ok || got.Properties == nil || len(got.Properties.User) != 1000 || got.Properties.User.Get("k999") != strings.Repeat("v", 999%50) {
		t.Fatalf("message with 1,000 user properties arrived as %+v", got)
	}
	r := req{args: []string{"SET", "props", "v"}, ts: now()}
	reply := pub.send(r)
	select {
	case p := <-reply:
		expectPayload(t, p, "+OK\r\n")
	case <-time.After(10 * time.Second):
		t.Fatal("no reply")
	}
}

// TestDeepTopic: a message on a 10,000-level topic reaches a '#'
// subscriber; the server goes on.
func TestDeepTopic(t *testing.T) {
	s := startServer(t, inMemory())
	sub := dialRaw(t, s, "sub", rawOpts{cleanStart: true})
	if code := sub.subscribe("deep/#", 1); code != 1 {
		t.Fatalf("subscribe: %#x", code)
	}
	pub := dialRaw(t, s, "pub", rawOpts{cleanStart: true})
	topic := "deep" + strings.Repeat("/l", 9999)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte("p")}); err != nil {
		t.Fatal(err)
	}
	if got, ok := sub.nextPublish(10 * time.Second); !ok || got.Topic != topic {
		t.Fatal("the 10,000-level message did not arrive")
	}
	expectPayload(t, pub.call("SET", "k", "v"), "+OK\r\n")
}

// TestTenThousandRegistrations: a client holds the default 10,000
// KEYNOTIFY registrations (one more is refused) and each one works.
func TestTenThousandRegistrations(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory())
	c := dialRaw(t, s, "watcher", rawOpts{cleanStart: true})
	const n = 10_000
	replies := make([]chan *paho.Publish, n)
	for i := range n {
		replies[i] = c.send(req{args: []string{"KEYNOTIFY", fmt.Sprintf("key%d", i)}, ts: now()})
	}
	for i, ch := range replies {
		select {
		case p := <-ch:
			expectPayload(t, p, "+OK\r\n")
		case <-time.After(30 * time.Second):
			t.Fatalf("no reply to registration %d", i)
		}
	}
	expectPayload(t, c.call("KEYNOTIFY", "one-too-many"), "-ERR the quota has been exceeded\r\n")
	w := dialRaw(t, s, "writer", rawOpts{cleanStart: true})
	expectPayload(t, w.call("SET", "key9999", "v"), "+OK\r\n")
	got, ok := c.nextPublish(10 * time.Second)
	if !ok || !strings.HasSuffix(got.Topic, hexUpper("key9999")) {
		t.Fatalf("notification %+v", got)
	}
}
