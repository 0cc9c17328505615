package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
)

// stuckConn is a client connection whose reads block once stuck is set:
// the client stops reading its socket, as a hung application does.
type stuckConn struct {
	net.Conn
	stuck  atomic.Bool
	closed chan struct{}
	once   sync.Once
}

func newStuckConn(t testing.TB, addr string) *stuckConn {
	c := dialTCP(t, addr)
	c.(*net.TCPConn).SetReadBuffer(4096)
	return &stuckConn{Conn: c, closed: make(chan struct{})}
}

func (c *stuckConn) Read(p []byte) (int, error) {
	if c.stuck.Load() {
		<-c.closed
		return 0, net.ErrClosed
	}
	return c.Conn.Read(p)
}

func (c *stuckConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// liveHeap is the heap in use once the garbage is collected (the server
// runs in this process).
func liveHeap() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// TestStuckClientWithLargeRepliesIsCut: a client that pipelines GETs of a
// 1 MiB value and reads nothing is a slow consumer once about a packet's
// worth of bytes waits for it, whatever the number of packets: before,
// the cut needed --max-outbound packets as well, and 300 GETs (70 KiB
// sent) made the server hold some 640 MiB for it. What it pipelined
// meanwhile is not answered, and all of it is freed once it is gone.
func TestStuckClientWithLargeRepliesIsCut(t *testing.T) {
	s := startServer(t, withLimits(server.Limits{MaxPacketSize: 4 << 20}))
	setter := dialRaw(t, s, "setter", rawOpts{cleanStart: true})
	value := strings.Repeat("v", 1<<20)
	expectPayload(t, setter.call("SET", "big", value), "+OK\r\n")

	sc := newStuckConn(t, s.Addr())
	greedy := dialRaw(t, s, "greedy", rawOpts{cleanStart: true, conn: sc})
	sc.stuck.Store(true)
	base := liveHeap()
	const gets = 300
	for i := 0; i < gets; i++ {
		if _, err := greedy.trySend(req{args: []string{"GET", "big"}, disconnects: true}); err != nil {
			break // disconnected
		}
	}
	eventuallyWithin(t, 60*time.Second, "the greedy client cut", func() bool { return s.Broker().Counters.SlowConsumers.Load() == 1 })
	if grew := liveHeap() - base; grew > 64<<20 {
		t.Fatalf("one client that does not read holds %d MiB of replies (the cut is at 16 MiB)", grew>>20)
	}
	eventually(t, "the greedy client gone", func() bool { return s.Broker().ClientsConnected() == 1 })
	if grew := liveHeap() - base; grew > 16<<20 {
		t.Fatalf("%d MiB still held once the client is gone", grew>>20)
	}
}

// TestConnectionKeepsAnsweringAfterASlowWrite: once a write to a client
// had to wait on its socket (a large reply), the connection's write
// deadline stayed 10 s ahead; the sends tried on the raw socket, which
// that deadline governs too, then failed, and the client got no reply (nor
// PUBACK) ever again though its requests were still applied. In a cluster
// any reply slower than 50 ms started it (found by review: every writer
// lost its replies 10 s after a node joined).
func TestConnectionKeepsAnsweringAfterASlowWrite(t *testing.T) {
	s := startServer(t, inMemory())
	c := dialRaw(t, s, "slow-then-fast", rawOpts{cleanStart: true})
	big := strings.Repeat("x", 8<<20)
	expectPayload(t, c.call("SET", "big", big), "+OK\r\n")
	if p := c.call("GET", "big"); len(p.Payload) < len(big) { // more than the socket takes at once
		t.Fatalf("GET big: %d bytes", len(p.Payload))
	}
	start := time.Now()
	for i := 0; time.Since(start) < 12*time.Second; i++ {
		reply, err := c.trySend(req{args: []string{"SET", "small", fmt.Sprint(i)}, ts: now(), disconnects: true})
		if err != nil {
			t.Fatal(err)
		}
		select {
		case p := <-reply:
			expectPayload(t, p, "+OK\r\n")
		case <-time.After(5 * time.Second):
			d := dialRaw(t, s, "checker", rawOpts{cleanStart: true})
			t.Fatalf("request %d, %v after the large reply: no reply in 5 s (applied: another client reads %q)", i, time.Since(start).Round(100*time.Millisecond), d.call("GET", "small").Payload)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestFailedWritesCloseTheConnection: a subscriber (keep-alive off, as
// many devices) stops reading past the server's write timeout while
// messages pile up, then reads again. The failed send ends the
// connection, so the client learns and reconnects: before, the socket
// stayed open, counted as connected, and nothing reached it any more.
func TestFailedWritesCloseTheConnection(t *testing.T) {
	s := startServer(t, inMemory())
	conn := dialTCP(t, s.Addr())
	conn.(*net.TCPConn).SetReadBuffer(4096)
	body := append(mqttString("MQTT"), 5, 0x02, 0, 0, 0) // v5, clean start, keep-alive 0
	conn.Write(packet(0x10, append(body, mqttString("paused")...)))
	conn.Write(subscribePacket("feed/#"))
	br := bufio.NewReader(conn)
	readPacket := func() (byte, []byte, error) {
		typ, err := br.ReadByte()
		if err != nil {
			return 0, nil, err
		}
		n, shift := 0, 0
		for {
			c, err := br.ReadByte()
			if err != nil {
				return 0, nil, err
			}
			n |= int(c&0x7f) << shift
			shift += 7
			if c&0x80 == 0 {
				break
			}
		}
		b := make([]byte, n)
		_, err = io.ReadFull(br, b)
		return typ, b, err
	}
	for i := 0; i < 2; i++ { // CONNACK, SUBACK
		if _, _, err := readPacket(); err != nil {
			t.Fatal(err)
		}
	}
	// Enough to block the server's send, far below --max-outbound.
	pub := dialRaw(t, s, "publisher", rawOpts{cleanStart: true, noSubscribe: true})
	ctx := ctxFor(t, 60*time.Second)
	filler := make([]byte, 32<<10)
	for i := 0; i < 200; i++ {
		if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "feed/x", QoS: 0, Payload: filler}); err != nil {
			t.Fatal(err)
		}
	}
	eventuallyWithin(t, 20*time.Second, "the paused subscriber disconnected", func() bool { return s.Broker().ClientsConnected() == 1 })
	// It reads again: what is left ends, soon.
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		for {
			typ, b, err := readPacket()
			if err != nil {
				return
			}
			if typ>>4 == 3 && bytes.HasSuffix(b, []byte("later")) {
				t.Errorf("a message published after the connection failed reached it")
			}
		}
	}()
	pub.c.Publish(ctx, &paho.Publish{Topic: "feed/x", QoS: 0, Payload: []byte("later")})
	select {
	case <-ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the client still reads from a connection the server gave up")
	}
}
