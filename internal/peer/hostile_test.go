package peer

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/mqkv/mqkv/internal/logthrottle"
)

// relayFrame copies one handshake frame (uint32 length + body) from src to
// dst; false when src ends first.
func relayFrame(dst io.Writer, src io.Reader) bool {
	var n [4]byte
	if _, err := io.ReadFull(src, n[:]); err != nil {
		return false
	}
	b := make([]byte, binary.BigEndian.Uint32(n[:])&0xffff)
	if _, err := io.ReadFull(src, b); err != nil {
		return false
	}
	dst.Write(n[:])
	dst.Write(b)
	return true
}

// TestRelayedHandshakeIsRefused: an outsider without the secret that gets
// a member to dial it (listening on a down member's address, say) and
// relays that member's handshake to another member cannot finish it, let
// alone keep the connection: the proofs are bound to each TLS session, and
// the outsider's two sessions differ. Before, it relayed the six frames,
// dropped the member and was served as it (found by review).
func TestRelayedHandshakeIsRefused(t *testing.T) {
	a, b := listen(t, "a", "s3cret-s3cret-s3cret"), listen(t, "b", "s3cret-s3cret-s3cret")
	var served atomic.Int32
	b.HandleCalls(func(from string, body []byte) []byte {
		served.Add(1)
		out, _ := Encode(echoResp{Text: "secret data of b", From: from})
		return out
	})
	evil, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer evil.Close()
	dialed := make(chan error, 1)
	go func() {
		var resp echoResp
		dialed <- a.Call(ctx(t), evil.Addr().String(), echoReq{"x"}, &resp)
	}()
	raw, err := evil.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	// The outsider ends TLS on both sides, with certificates of its own
	// (nobody checks them: the secret authenticates), and relays the
	// handshake's frames between a and b.
	srv, cli, err := ephemeralTLS()
	if err != nil {
		t.Fatal(err)
	}
	fromA := tls.Server(raw, srv)
	rawB, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer rawB.Close()
	toB := tls.Client(rawB, cli)
	if err := fromA.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := toB.Handshake(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ { // a → b: magic, challenge, id
		relayFrame(toB, fromA)
	}
	for i := 0; i < 3; i++ { // b → a: challenge, id, proof
		relayFrame(fromA, toB)
	}
	relayFrame(toB, fromA) // a → b: its proof, if a sends one
	raw.Close()
	if err := <-dialed; err == nil || !strings.Contains(err.Error(), "secret") {
		t.Fatalf("a accepted the relayed proof of b: %v", err)
	}
	sess, err := yamux.Client(toB, yamuxConfig())
	if err == nil {
		defer sess.Close()
		if s, err := sess.OpenStream(); err == nil {
			s.Write([]byte{KindMux})
			c := NewConn(s)
			body, _ := Encode(echoReq{"hello from an outsider"})
			c.SetDeadline(time.Now().Add(2 * time.Second))
			c.writeFrame(append(binary.BigEndian.AppendUint64(nil, 1), body...))
			c.frame()
		}
	}
	if served.Load() > 0 {
		t.Fatal("an outsider without the secret was served by b")
	}
}

// TestSecretLinkIsEncrypted: with a secret only, what crosses the link
// (here a call's payload) is not readable on the path; it was plaintext.
func TestSecretLinkIsEncrypted(t *testing.T) {
	a, b := listen(t, "a", "s3cret-s3cret-s3cret"), listen(t, "b", "s3cret-s3cret-s3cret")
	tap, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer tap.Close()
	var mu sync.Mutex
	var seen bytes.Buffer
	go func() {
		c, err := tap.Accept()
		if err != nil {
			return
		}
		u, err := net.Dial("tcp", b.Addr())
		if err != nil {
			return
		}
		cp := func(dst, src net.Conn) {
			buf := make([]byte, 4096)
			for {
				n, err := src.Read(buf)
				mu.Lock()
				seen.Write(buf[:n])
				mu.Unlock()
				dst.Write(buf[:n])
				if err != nil {
					dst.Close()
					return
				}
			}
		}
		go cp(u, c)
		cp(c, u)
	}()
	var resp echoResp
	if err := a.Call(ctx(t), tap.Addr().String(), echoReq{"the-private-value-42"}, &resp); err != nil || resp.Text != "THE-PRIVATE-VALUE-42" {
		t.Fatalf("%v %+v", err, resp)
	}
	mu.Lock()
	defer mu.Unlock()
	if seen.Len() == 0 || bytes.Contains(bytes.ToLower(seen.Bytes()), []byte("the-private-value-42")) {
		t.Fatalf("the call's payload crossed the link in cleartext (%d bytes seen)", seen.Len())
	}
}

// TestHandshakesAreBounded: strangers that open connections and say
// nothing hold at most one host's places in the handshake (1,500 silent
// connections held 1,496 goroutines before), and while they keep opening
// and dropping them, a member on another host still gets in every time (a
// first bound closed the oldest handshake for each new connection, and
// churning strangers kept members out; both found by review).
func TestHandshakesAreBounded(t *testing.T) {
	b := listen(t, "b", "s3cret-s3cret-s3cret")
	stranger := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	before := runtime.NumGoroutine()
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := 0; i < 1500; i++ {
		c, err := stranger.Dial("tcp", b.Addr())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	time.Sleep(200 * time.Millisecond) // let the accept loop take them all
	if grew := runtime.NumGoroutine() - before; grew > maxHostHandshakes+16 {
		t.Fatalf("1,500 silent connections hold %d goroutines", grew)
	}
	var stop atomic.Bool
	var wg sync.WaitGroup
	defer func() { stop.Store(true); wg.Wait() }()
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []net.Conn
			for !stop.Load() {
				if c, err := stranger.Dial("tcp", b.Addr()); err == nil {
					if mine = append(mine, c); len(mine) > 200 {
						mine[0].Close()
						mine = mine[1:]
					}
				}
			}
			for _, c := range mine {
				c.Close()
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	for i := 0; i < 5; i++ {
		a := listen(t, "a", "s3cret-s3cret-s3cret")
		var resp echoResp
		if err := a.Call(ctx(t), b.Addr(), echoReq{"in"}, &resp); err != nil || resp.Text != "IN" {
			t.Fatalf("attempt %d: a member was kept out by strangers' connections: %v", i+1, err)
		}
		a.Close()
	}
}

// countHandler counts the records that reach it.
type countHandler struct{ n *atomic.Int64 }

func (h countHandler) Enabled(context.Context, slog.Level) bool  { return true }
func (h countHandler) Handle(context.Context, slog.Record) error { h.n.Add(1); return nil }
func (h countHandler) WithAttrs([]slog.Attr) slog.Handler        { return h }
func (h countHandler) WithGroup(string) slog.Handler             { return h }

// TestRefusedConnectionsLogOncePerHost: 500 garbage connections from one
// host write one line a window through the server's log throttle (each
// wrote a WARN line before), and a node of the earlier release, whose
// link was unencrypted, is told apart in that line.
func TestRefusedConnectionsLogOncePerHost(t *testing.T) {
	var lines atomic.Int64
	var last atomic.Value
	h := logthrottle.New(recordingHandler{countHandler{&lines}, &last}, time.Minute)
	l, err := Listen(Config{NodeID: "b", Listen: "127.0.0.1:0", Secret: []byte("s3cret-s3cret-s3cret"), Logger: slog.New(h)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	old, err := net.Dial("tcp", l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	w := new(bytes.Buffer)
	for _, f := range []string{"MQKV-LINK-1", "0123456789abcdef0123456789abcdef", "n9"} {
		binary.Write(w, binary.BigEndian, uint32(len(f)))
		w.WriteString(f)
	}
	old.Write(w.Bytes())
	io.Copy(io.Discard, old) // until refused
	old.Close()
	if msg, _ := last.Load().(string); !strings.Contains(msg, "release") {
		t.Fatalf("the refusal of an earlier release's node says %q", msg)
	}
	for i := 0; i < 500; i++ {
		c, err := net.Dial("tcp", l.Addr())
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
		io.Copy(io.Discard, c)
		c.Close()
	}
	if got := lines.Load(); got > 2 {
		t.Fatalf("501 refused connections from one host wrote %d lines", got)
	}
}

// recordingHandler keeps the last record's error attribute.
type recordingHandler struct {
	countHandler
	last *atomic.Value
}

func (h recordingHandler) Handle(ctx context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "error" {
			h.last.Store(a.Value.String())
		}
		return true
	})
	return h.countHandler.Handle(ctx, r)
}

func (h recordingHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h recordingHandler) WithGroup(string) slog.Handler      { return h }

// TestCloseDoesNotWaitForStrangers: a connection that never finishes its
// handshake no longer holds the node's shutdown for the handshake's
// deadline (9.9 s before).
func TestCloseDoesNotWaitForStrangers(t *testing.T) {
	l, err := Listen(Config{NodeID: "b", Listen: "127.0.0.1:0", Secret: []byte("s3cret-s3cret-s3cret"), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte{0x16}) // wait until the link is reading from it
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		l.mu.Lock()
		n := len(l.handshaking)
		l.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the connection never reached the handshake")
		}
	}
	start := time.Now()
	l.Close()
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Close took %v: it waited for a stranger's handshake", d)
	}
}

// TestGarbageAfterHandshake: an authenticated peer's garbage (unknown
// stream kinds, short headers, a raft stream for no group, bytes outside
// yamux) leaves the node serving.
func TestGarbageAfterHandshake(t *testing.T) {
	a, b := listen(t, "a", "s3cret-s3cret-s3cret"), listen(t, "b", "s3cret-s3cret-s3cret")
	for _, kind := range []byte{0, 9, KindRaft, KindMux, KindCall} {
		s, err := a.Open(ctx(t), b.Addr(), kind, []byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1, 0})
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
	}
	raw, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	tc := tls.Client(raw, a.tlsClient)
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := a.handshake(tc); err != nil {
		t.Fatal(err)
	}
	tc.Write(bytes.Repeat([]byte{0xde, 0xad, 0xbe, 0xef}, 1000))
	raw.Close()
	var resp echoResp
	if err := a.Call(ctx(t), b.Addr(), echoReq{"still"}, &resp); err != nil || resp.Text != "STILL" {
		t.Fatalf("b stopped serving: %v %+v", err, resp)
	}
}

// TestIsolateRacingDial: a dial in its handshake when Isolate(true) runs
// does not leave the isolated link a live session to its peer (it did, so
// a partition test could keep talking; found by review).
func TestIsolateRacingDial(t *testing.T) {
	b := listen(t, "b", "s3cret-s3cret-s3cret")
	for i := 0; i < 100; i++ {
		a := listen(t, "a", "s3cret-s3cret-s3cret")
		done := make(chan struct{})
		go func() {
			defer close(done)
			c, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			a.session(c, b.Addr())
		}()
		time.Sleep(time.Duration(i*20) * time.Microsecond)
		a.Isolate(true)
		<-done
		a.mu.Lock()
		s := a.sessions[b.Addr()]
		a.mu.Unlock()
		if s != nil && !s.IsClosed() {
			t.Fatalf("after %d tries: an isolated link holds a live session to its peer", i+1)
		}
		a.Close()
	}
}
