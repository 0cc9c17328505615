package redis

import (
	"bufio"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/statestore"
)

// answerer is a gateway.Service that answers every SET "+OK" and every
// DEL ":1" from one goroutine of its own, in the order asked, as the
// goroutine that completes the log's entries answers them. It stands in
// for the store here so that the connection's write path can be driven
// through sockets that refuse or cut its writes; the store's own answers
// are tested through a real node in test/e2e.
type answerer struct{ reqs chan *statestore.Request }

func newAnswerer(t *testing.T) *answerer {
	a := &answerer{reqs: make(chan *statestore.Request, 1024)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for r := range a.reqs {
			payload := "+OK\r\n"
			if r.Payload != nil {
				payload = ":1\r\n"
			}
			r.Origin.(statestore.Replier).Reply(r, []byte(payload), hlc.Timestamp{})
		}
	}()
	t.Cleanup(func() { close(a.reqs); <-done })
	return a
}

func (a *answerer) Do(r *statestore.Request, args [][]byte) {
	if strings.EqualFold(string(args[0]), "DEL") {
		r.Payload = []byte{} // marks a DEL for the answering goroutine
	}
	a.reqs <- r
}

func (a *answerer) Disconnected(string, uint64) {}

// cutConn is a server's end of a TCP connection whose TryWrite writes at
// most max bytes (a socket with that little room), or fails with fail.
type cutConn struct {
	net.Conn
	max   int
	fail  error
	tries atomic.Int64
	short atomic.Int64
}

func (c *cutConn) TryWrite(p []byte) (int, error) {
	c.tries.Add(1)
	if c.fail != nil {
		return 0, c.fail
	}
	if len(p) > c.max {
		c.short.Add(1)
		p = p[:c.max]
	}
	return c.Conn.Write(p)
}

// serveOne serves one connection through wrap, returning the client's
// end and a channel closed when Serve returned.
func serveOne(t *testing.T, wrap func(net.Conn) net.Conn) (net.Conn, <-chan struct{}) {
	t.Helper()
	return serveWith(t, newAnswerer(t), wrap)
}

// serveWith is serveOne with svc standing for the store.
func serveWith(t *testing.T, svc gateway.Service, wrap func(net.Conn) net.Conn) (net.Conn, <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	s := New(Config{Service: svc})
	served := make(chan struct{})
	go func() {
		defer close(served)
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		s.Serve(wrap(nc))
		nc.Close()
	}()
	cl, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close(); <-served })
	return cl, served
}

func encode(args ...string) string {
	var b strings.Builder
	b.WriteString("*" + strconv.Itoa(len(args)) + "\r\n")
	for _, a := range args {
		b.WriteString("$" + strconv.Itoa(len(a)) + "\r\n" + a + "\r\n")
	}
	return b.String()
}

// A write's reply that the socket takes only part of is written whole,
// in order, by the connection's writer: one at a time, and in pipelines
// mixed with replies the reader writes itself.
func TestWriteRepliesCutBySocketArriveWhole(t *testing.T) {
	var cut *cutConn
	cl, _ := serveOne(t, func(nc net.Conn) net.Conn { cut = &cutConn{Conn: nc, max: 2}; return cut })
	br := bufio.NewReader(cl)
	expect := func(want string) {
		t.Helper()
		got := make([]byte, len(want))
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(br, got); err != nil || string(got) != want {
			t.Fatalf("replies %q, %v; want %q", got, err, want)
		}
	}
	for i := range 50 {
		k := "k" + strconv.Itoa(i)
		if _, err := io.WriteString(cl, encode("SET", k, "v")); err != nil {
			t.Fatal(err)
		}
		expect("+OK\r\n")
		if _, err := io.WriteString(cl, encode("DEL", k)); err != nil {
			t.Fatal(err)
		}
		expect(":1\r\n")
	}
	var pipe, want strings.Builder
	for i := range 200 {
		k := "p" + strconv.Itoa(i%7) // writes to one key wait for the one before
		pipe.WriteString(encode("SET", k, "v"))
		want.WriteString("+OK\r\n")
		if i%10 == 0 {
			pipe.WriteString(encode("PING"))
			want.WriteString("+PONG\r\n")
			pipe.WriteString(encode("DEL", k))
			want.WriteString(":1\r\n")
		}
	}
	if _, err := io.WriteString(cl, pipe.String()); err != nil {
		t.Fatal(err)
	}
	expect(want.String())
	if cut.short.Load() == 0 {
		t.Fatalf("no reply was cut (%d direct writes): the writer's part went untested", cut.tries.Load())
	}
}

// A write's reply the socket refuses closes the connection: the client
// sees it end, and Serve returns.
func TestWriteReplyRefusedEndsConnection(t *testing.T) {
	cl, served := serveOne(t, func(nc net.Conn) net.Conn {
		return &cutConn{Conn: nc, fail: errors.New("connection reset")}
	})
	if _, err := io.WriteString(cl, encode("SET", "k", "v")); err != nil {
		t.Fatal(err)
	}
	cl.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := cl.Read(make([]byte, 16)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read %d bytes, %v: want the connection ended", n, err)
	}
	select {
	case <-served:
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return")
	}
}

// holder is a gateway.Service that keeps the writes it is asked for until
// the test answers them, in whatever order.
type holder struct {
	reqs  chan *statestore.Request
	taken map[*statestore.Request]bool // true once answered
}

func newHolder() *holder {
	return &holder{reqs: make(chan *statestore.Request, 64), taken: map[*statestore.Request]bool{}}
}

// answerRest answers what is left (a cleanup, registered after the
// server's own, so that it runs before it).
func (h *holder) answerRest() {
	for r, answered := range h.taken {
		if !answered {
			h.answer(r)
		}
	}
	for {
		select {
		case r := <-h.reqs:
			h.answer(r)
		default:
			return
		}
	}
}

func (h *holder) Do(r *statestore.Request, args [][]byte) { h.reqs <- r }
func (h *holder) Disconnected(string, uint64)             {}

// take waits for n writes.
func (h *holder) take(t *testing.T, n int) []*statestore.Request {
	t.Helper()
	var out []*statestore.Request
	for len(out) < n {
		select {
		case r := <-h.reqs:
			h.taken[r] = false
			out = append(out, r)
		case <-time.After(10 * time.Second):
			t.Fatalf("%d writes sent to the store, want %d", len(out), n)
		}
	}
	return out
}

// answer answers a SET.
func (h *holder) answer(r *statestore.Request) {
	h.taken[r] = true
	r.Origin.(statestore.Replier).Reply(r, []byte("+OK\r\n"), hlc.Timestamp{})
}

// A pipeline's writes to distinct keys, all but the last answered, in
// reverse order: no reply goes out before the last is answered, then all
// go out together, in command order, in one write from the goroutine that
// answered the last; a command after them in the pipeline is answered
// after them.
func TestPipelinedWriteRepliesGoOutTogether(t *testing.T) {
	h := newHolder()
	var cut *cutConn
	cl, _ := serveWith(t, h, func(nc net.Conn) net.Conn { cut = &cutConn{Conn: nc, max: 1 << 20}; return cut })
	t.Cleanup(h.answerRest) // a failed test's writes: the connection ends only once they are answered
	br := bufio.NewReader(cl)
	for round := range 3 {
		var pipe, want strings.Builder
		for i := range 16 {
			pipe.WriteString(encode("SET", "k"+strconv.Itoa(i), "v"))
			want.WriteString("+OK\r\n")
		}
		if round == 2 {
			pipe.WriteString(encode("PING"))
			want.WriteString("+PONG\r\n")
		}
		if _, err := io.WriteString(cl, pipe.String()); err != nil {
			t.Fatal(err)
		}
		reqs := h.take(t, 16)
		tries := cut.tries.Load()
		last := len(reqs) - 1
		for i := last - 1; i >= 0; i-- {
			h.answer(reqs[i])
		}
		cl.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		if n, err := br.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("round %d: read %d bytes before the last write was answered (%v)", round, n, err)
		}
		h.answer(reqs[last])
		got := make([]byte, want.Len())
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(br, got); err != nil || string(got) != want.String() {
			t.Fatalf("round %d: replies %q, %v; want %q", round, got, err, want.String())
		}
		if round < 2 {
			if n := cut.tries.Load() - tries; n != 1 {
				t.Fatalf("round %d: the answering goroutine wrote %d times for one pipeline, want 1", round, n)
			}
		}
	}
}

// readBeforeAnEmptyCommand sends a read followed by an empty command
// ("*0", which Redis skips) in one write: the read's reply must go out,
// though no command came after it. It stayed unwritten (kept for the
// replies of the commands after it) until the client sent more.
func readBeforeAnEmptyCommand(t *testing.T, cl net.Conn) {
	t.Helper()
	br := bufio.NewReader(cl)
	for range 3 {
		if _, err := io.WriteString(cl, encode("ECHO", "x")+"*0\r\n"); err != nil {
			t.Fatal(err)
		}
		want := "$1\r\nx\r\n"
		got := make([]byte, len(want))
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(br, got); err != nil || string(got) != want {
			t.Fatalf("reply %q, %v; want %q", got, err, want)
		}
	}
}

// A connection served by its own goroutine: see readBeforeAnEmptyCommand.
func TestReadBeforeAnEmptyCommand(t *testing.T) {
	cl, _ := serveOne(t, func(c net.Conn) net.Conn { return c })
	readBeforeAnEmptyCommand(t, cl)
}
