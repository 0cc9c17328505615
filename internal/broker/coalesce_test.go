package broker

import (
	"bytes"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// countingConn counts the writes (system calls) that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int32
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// tcpPair is a loopback TCP connection: the server's end and the
// client's, both closed when the test ends.
func tcpPair(t *testing.T) (server, client net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	if server, err = ln.Accept(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	return server, client
}

// coalescePair is a clientConn on the server end of a loopback TCP
// connection, and the client's end.
func coalescePair(t *testing.T) (*clientConn, *countingConn, net.Conn) {
	t.Helper()
	server, client := tcpPair(t)
	counted := &countingConn{Conn: server}
	c := &clientConn{Conn: counted, r: server, max: 1 << 20}
	t.Cleanup(func() { c.Close() })
	return c, counted, client
}

// request has the reader of c take in a packet from the client, as mochi's
// does before it handles it.
func request(t *testing.T, c *clientConn, client net.Conn) {
	t.Helper()
	if _, err := client.Write(publishBytes); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, len(publishBytes))); err != nil {
		t.Fatal(err)
	}
}

// readerWaits starts a read on c, as mochi's reader does after handling a
// packet, and returns once it is blocked for input.
func readerWaits(t *testing.T, c *clientConn) {
	t.Helper()
	go c.Read(make([]byte, 64))
	for deadline := time.Now().Add(5 * time.Second); ; {
		c.wmu.Lock()
		w := c.waiting
		c.wmu.Unlock()
		if w {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the reader never waited")
		}
		time.Sleep(time.Millisecond)
	}
}

var (
	pubackBytes  = []byte{0x40, 2, 0, 1}
	publishBytes = []byte{0x30, 5, 0, 1, 'r', 'o', 'k'}
)

// TestAcknowledgementWaitsForReply: the PUBACK of a state store request
// leaves with its reply, in one write, however long the reply takes to
// come (within replyHold); without a reply due it leaves as soon as the
// reader is done.
func TestAcknowledgementWaitsForReply(t *testing.T) {
	c, counted, client := coalescePair(t)
	request(t, c, client)
	c.ExpectReply()
	c.Write(pubackBytes) // mochi acknowledges the request it is handling
	readerWaits(t, c)
	time.Sleep(10 * time.Millisecond) // a commit's time: nothing may leave
	if n := counted.writes.Load(); n != 0 {
		t.Fatalf("%d writes before the reply", n)
	}
	c.Write(publishBytes) // the reply, from the write loop
	want := append(bytes.Clone(pubackBytes), publishBytes...)
	got := make([]byte, len(want))
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(client, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("client read % x (%v), want % x", got, err, want)
	}
	if n := counted.writes.Load(); n != 1 {
		t.Fatalf("%d writes for PUBACK and reply, want 1", n)
	}
}

// TestOtherAcknowledgementsDoNotWaitForAReply: a QoS 1 message read after
// a request, before its reply, is acknowledged when the reader is done,
// with the request's acknowledgement before it, not once the reply comes.
func TestOtherAcknowledgementsDoNotWaitForAReply(t *testing.T) {
	c, counted, client := coalescePair(t)
	request(t, c, client)
	c.ExpectReply()
	c.Write(pubackBytes) // the request's
	request(t, c, client)
	c.AwaitNoReply() // the next packet is an ordinary message
	other := []byte{0x40, 2, 0, 2}
	c.Write(other)
	readerWaits(t, c)
	// Once the reader waits, both acknowledgements are sent or handed to
	// the sender goroutine (this connection is no raw socket), not held
	// for the reply or a timer. The goroutine may write after the reader
	// waits: the writes are counted once the bytes have arrived.
	c.wmu.Lock()
	handed := c.sending || len(c.pending) == 0
	c.wmu.Unlock()
	if !handed {
		t.Fatal("the acknowledgements are held once the reader is done")
	}
	want := append(bytes.Clone(pubackBytes), other...)
	got := make([]byte, len(want))
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(client, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("client read % x (%v), want % x", got, err, want)
	}
	if n := counted.writes.Load(); n != 1 {
		t.Fatalf("%d writes for both acknowledgements, want 1", n)
	}
}

// TestAcknowledgementWithoutReplyDue: an ordinary PUBLISH's PUBACK is sent
// when the reader is done, and one whose reply never comes is sent after
// replyHold, not held further.
func TestAcknowledgementWithoutReplyDue(t *testing.T) {
	c, counted, client := coalescePair(t)
	request(t, c, client)
	c.Write(pubackBytes)
	if n := counted.writes.Load(); n != 0 {
		t.Fatalf("%d writes while the reader is busy", n)
	}
	readerWaits(t, c)
	got := make([]byte, len(pubackBytes))
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(client, got); err != nil {
		t.Fatal(err)
	}
	if n := counted.writes.Load(); n != 1 {
		t.Fatalf("%d writes once the reader is done, want 1", n)
	}

	c2, _, client2 := coalescePair(t)
	request(t, c2, client2)
	c2.ExpectReply()
	start := time.Now()
	c2.Write(pubackBytes)
	readerWaits(t, c2)
	client2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(client2, got); err != nil || !bytes.Equal(got, pubackBytes) {
		t.Fatalf("PUBACK without its reply: % x, %v", got, err)
	}
	if waited := time.Since(start); waited < replyHold {
		t.Fatalf("PUBACK sent after %v, before the reply's hold (%v) ended", waited, replyHold)
	}
}

func TestHasPublish(t *testing.T) {
	long := append([]byte{0x32, 0x83, 0x01}, make([]byte, 131)...) // QoS 1 PUBLISH, 131 bytes
	for _, c := range []struct {
		name string
		p    []byte
		want bool
	}{
		{"PUBACK", pubackBytes, false},
		{"PUBLISH", publishBytes, true},
		{"PUBACK then PUBLISH", append(bytes.Clone(pubackBytes), publishBytes...), true},
		{"PUBACK then a long PUBLISH", append(bytes.Clone(pubackBytes), long...), true},
		{"two PUBACKs", append(bytes.Clone(pubackBytes), pubackBytes...), false},
		{"PUBACK cut short", pubackBytes[:3], false},
		{"a length of five bytes", []byte{0x40, 0x80, 0x80, 0x80, 0x80, 0x01}, false},
		{"nothing", nil, false},
	} {
		if got := hasPublish(c.p); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}
