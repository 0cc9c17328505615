package peer

import (
	"context"
	"fmt"
	"github.com/hashicorp/raft"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"
)

type echoReq struct{ Text string }
type echoResp struct {
	Text string
	From string
}

func listen(t *testing.T, id string, secret string) *Link {
	t.Helper()
	var l *Link
	l, err := Listen(Config{NodeID: id, Listen: "127.0.0.1:0", Secret: []byte(secret),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	l.HandleCalls(func(from string, body []byte) []byte {
		var req echoReq
		Decode(body, &req)
		out, _ := Encode(echoResp{Text: strings.ToUpper(req.Text), From: from})
		return out
	})
	t.Cleanup(func() { l.Close() })
	return l
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestCallAuthenticatesBothEnds(t *testing.T) {
	a, b := listen(t, "a", "s3cret"), listen(t, "b", "s3cret")
	var resp echoResp
	if err := a.Call(ctx(t), b.Addr(), echoReq{"hi"}, &resp); err != nil {
		t.Fatal(err)
	}
	if resp.Text != "HI" || resp.From != "a" {
		t.Fatalf("%+v", resp)
	}
	// A node with another secret is refused, in both directions.
	x := listen(t, "x", "other")
	if err := x.Call(ctx(t), b.Addr(), echoReq{"hi"}, &resp); err == nil {
		t.Fatal("a node with the wrong secret was served")
	}
	if err := b.Call(ctx(t), x.Addr(), echoReq{"hi"}, &resp); err == nil {
		t.Fatal("a node answered a peer with the wrong secret")
	}
	// Something that is not a node gets nothing: raw bytes are refused.
	c, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("\x00\x00\x00\x0bMQKV-LINK-1\x00\x00\x00\x20" + strings.Repeat("x", 32) + "\x00\x00\x00\x01z\x00\x00\x00\x20" + strings.Repeat("y", 32)))
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 4096)
	n, _ := io.ReadAtLeast(c, buf, 1)
	for {
		m, err := c.Read(buf[n:])
		n += m
		if err != nil {
			break
		}
	}
	if strings.Contains(string(buf[:n]), "HI") {
		t.Fatal("an unauthenticated connection was served")
	}
}

func TestIsolateCutsTheLink(t *testing.T) {
	a, b := listen(t, "a", "k"), listen(t, "b", "k")
	var resp echoResp
	if err := a.Call(ctx(t), b.Addr(), echoReq{"1"}, &resp); err != nil {
		t.Fatal(err)
	}
	b.Isolate(true)
	if err := a.Call(ctx(t), b.Addr(), echoReq{"2"}, &resp); err == nil {
		t.Fatal("call through an isolated node")
	}
	b.Isolate(false)
	// The caller may first use a session it has not yet seen die (that
	// call fails); a fresh one is opened for the next.
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := a.Call(ctx(t), b.Addr(), echoReq{"3"}, &resp)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after healing: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestRaftStreamsByGroup(t *testing.T) {
	a, b := listen(t, "a", "k"), listen(t, "b", "k")
	l1, l2 := b.StreamLayer(1), b.StreamLayer(2)
	defer l1.Close()
	defer l2.Close()
	for _, g := range []uint32{2, 1} {
		c, err := a.StreamLayer(g).Dial(ServerAddress(b.Addr()), time.Second)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte{byte(g)})
		layer := l1
		if g == 2 {
			layer = l2
		}
		s, err := layer.Accept()
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 1)
		io.ReadFull(s, got)
		if got[0] != byte(g) {
			t.Fatalf("group %d's stream carried %d", g, got[0])
		}
		c.Close()
		s.Close()
	}
}

// ServerAddress is raft's address type, for the test's Dial.
type ServerAddress = raft.ServerAddress

// TestConcurrentCallsShareOneStream: many calls in flight at once on one
// peer's call stream each get their own reply.
func TestConcurrentCallsShareOneStream(t *testing.T) {
	a, b := listen(t, "a", "k"), listen(t, "b", "k")
	errs := make(chan error, 200)
	for i := 0; i < 200; i++ {
		go func() {
			var resp echoResp
			want := fmt.Sprintf("M%d", i)
			err := a.Call(ctx(t), b.Addr(), echoReq{strings.ToLower(want)}, &resp)
			if err == nil && resp.Text != want {
				err = fmt.Errorf("got %q, want %q", resp.Text, want)
			}
			errs <- err
		}()
	}
	for i := 0; i < 200; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.muxes) != 1 {
		t.Fatalf("%d call streams to one peer", len(a.muxes))
	}
}
