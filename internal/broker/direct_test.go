package broker

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/auth"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/sockio"
)

// TestWriteDoesNotWaitOnTheSocket: other clients' readers write to a
// connection (publishDirect), so a write never waits for a client that
// does not read; once its socket is full the connection says it is
// backed up, and what was written still arrives, whole and in order.
func TestWriteDoesNotWaitOnTheSocket(t *testing.T) {
	server, client := tcpPair(t)
	server = sockio.Wrap(server)
	c := &clientConn{Conn: server, r: server, max: 1 << 20, try: server.(*sockio.Conn)}
	defer c.Close()
	readerWaits(t, c)

	chunk := make([]byte, 64<<10)
	var sent bytes.Buffer
	done := make(chan error, 1)
	go func() {
		for i := 0; !c.backedUp(); i++ {
			if i == 4096 { // 256 MiB: no socket holds that
				done <- io.ErrShortWrite
				return
			}
			for j := range chunk {
				chunk[j] = byte(i + j/251)
			}
			sent.Write(chunk)
			if _, err := c.Write(chunk); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("writing until backed up: %v", err)
		}
	case <-time.After(writeTimeout / 2):
		t.Fatal("a write waited on a client that does not read")
	}

	got := make([]byte, sent.Len())
	if _, err := io.ReadFull(client, got); err != nil {
		t.Fatalf("reading what was written: %v", err)
	}
	if !bytes.Equal(got, sent.Bytes()) {
		t.Fatal("the bytes arrived changed or out of order")
	}
	for deadline := time.Now().Add(5 * time.Second); c.backedUp(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("still backed up after the client read everything")
		}
	}
}

// TestMochiQueuedSeesTheQueue: the fields of mochi's client queue are
// found, and a message mochi queued for a client counts until written.
// Without them no message would ever be written directly.
func TestMochiQueuedSeesTheQueue(t *testing.T) {
	if !outboundKnown {
		t.Fatal("mochi's client queue fields not found: direct delivery is off")
	}
	srv := mqtt.New(&mqtt.Options{InlineClient: true})
	if err := srv.AddHook(new(auth.AllowHook), nil); err != nil {
		t.Fatal(err)
	}
	server, peer := net.Pipe()
	defer server.Close()
	defer peer.Close()
	cl := srv.NewClient(server, "test", "sub", false)
	cl.Properties.ProtocolVersion = 5
	srv.Clients.Add(cl)
	sub := packets.Subscription{Filter: "a/b", Qos: 0}
	cl.State.Subscriptions.Add(sub.Filter, sub)
	srv.Topics.Subscribe(cl.ID, sub)
	if mochiQueued(cl) {
		t.Fatal("queued before anything was published")
	}
	if err := srv.Publish("a/b", []byte("x"), false, 0); err != nil {
		t.Fatal(err)
	}
	if !mochiQueued(cl) {
		t.Fatal("a message mochi queued (no write loop runs) is not seen")
	}
}

// TestSlowConsumerCap: behind a send that does not finish, a connection
// takes up to maxQueued packets and slowBytes; the packet past both is
// refused, the client is reported slow once, and nothing already taken is
// lost.
func TestSlowConsumerCap(t *testing.T) {
	server, _ := tcpPair(t) // the client never reads
	server = sockio.Wrap(server)
	c := &clientConn{Conn: server, r: server, max: 1 << 20, maxQueued: 4, try: server.(*sockio.Conn)}
	defer c.Close()
	slow := 0
	c.onSlow(func() { slow++ })
	readerWaits(t, c)
	chunk := make([]byte, 256<<10)
	for i := 0; !c.backedUp(); i++ {
		if i == 1024 {
			t.Fatal("never backed up")
		}
		if _, err := c.Write(chunk); err != nil {
			t.Fatalf("write %d, before the socket filled: %v", i, err)
		}
	}
	// Once the sender has taken what was pending and waits on the full
	// socket, 4 packets and 1 MiB may wait behind it.
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(time.Millisecond) {
		c.wmu.Lock()
		sending, pending := c.sending, len(c.pending)
		c.wmu.Unlock()
		if sending && pending == 0 {
			break
		}
		if !sending && pending == 0 {
			// The socket took it all (its buffers grew): fill it again.
			if _, err := c.Write(chunk); err != nil {
				t.Fatalf("refilling the socket: %v", err)
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the sender never took what was pending")
		}
	}
	for i := 0; i < 4; i++ {
		if _, err := c.Write(chunk); err != nil {
			t.Fatalf("queued write %d: %v", i, err)
		}
	}
	c.wmu.Lock()
	held := len(c.pending)
	c.wmu.Unlock()
	if _, err := c.Write(chunk); err != errSlowConsumer {
		t.Fatalf("fifth queued write: %v, want errSlowConsumer", err)
	}
	if _, err := c.Write(chunk); err != errSlowConsumer || slow != 1 {
		t.Fatalf("sixth: %v, reported slow %d times; want refused, reported once", err, slow)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if len(c.pending) != held {
		t.Fatalf("pending %d bytes after refusals, want the %d taken before", len(c.pending), held)
	}
}
