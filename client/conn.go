package client

import (
	"bufio"
	"encoding/binary"
	"net"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/paho"
)

// packetConn is the connection the client's MQTT packets travel on.
// paho reads a packet straight off its connection, a system call for the
// first byte, one for each byte of the length and one or more for the
// rest, and writes one as up to four buffers, which only a plain TCP
// connection gathers into one system call (a TLS connection makes each a
// record of its own); with many requests in flight that was one write
// per PUBLISH and per PUBACK. BenchmarkClientGet found the client
// spending more CPU per request than the server.
//
// Reads here come out of a buffer. A packet's writes, which paho makes
// between Lock and Unlock (it looks for a sync.Locker), are gathered, and
// a goroutine of the connection sends what has gathered in one write, as
// NATS's client does: packets that other goroutines add while a write is
// under way go together in the next. The lock also keeps two goroutines'
// packets from interleaving on a TLS connection, which paho asks of a
// connection it is given.
type packetConn struct {
	net.Conn
	r *bufio.Reader

	// replies takes a QoS 0 PUBLISH the connection parsed itself (see
	// parseReply), or refuses it (false) and paho reads it. left is how
	// much of the packet paho is reading remains (-1: everything, once
	// the packets could not be followed).
	replies func(*paho.Publish) bool
	left    int

	mu      sync.Mutex
	cond    sync.Cond // signalled when pending was taken or the connection failed
	packet  bool      // between Lock and Unlock: writes are gathered
	pending []byte    // packets not yet handed to the writer
	spare   []byte    // the writer's last buffer, for reuse
	kicked  bool      // the writer has been told of pending
	writing bool      // the writer is sending what it took
	kick    chan struct{}
	err     error // the first write's error or Close: nothing more is sent
}

// maxPending is how much waits for the writer before a packet's writer
// waits too (a server that reads slowly slows its client).
const maxPending = 256 << 10

func newPacketConn(c net.Conn, replies func(*paho.Publish) bool) *packetConn {
	p := &packetConn{Conn: c, r: bufio.NewReaderSize(c, 16<<10), kick: make(chan struct{}, 1), replies: replies}
	p.cond.L = &p.mu
	go p.writer()
	return p
}

// Read gives paho the packets the connection did not take itself.
func (c *packetConn) Read(p []byte) (int, error) {
	for c.left == 0 {
		c.left = c.takeReplies()
	}
	if c.left > 0 && len(p) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	if c.left > 0 {
		c.left -= n
	}
	return n, err
}

// takeReplies takes the replies at the head of the input, and returns the
// size of the next packet, which paho reads (-1 if its size is unknown:
// the input ended or is not MQTT, which paho then says).
func (c *packetConn) takeReplies() int {
	for {
		// The fixed header: a byte, then the remaining length in one
		// to four bytes (a PINGRESP is two bytes in all: peeking more
		// would wait for a packet that may not come).
		head, err := c.r.Peek(2)
		for err == nil && head[len(head)-1]&0x80 != 0 && len(head) < 5 {
			head, err = c.r.Peek(len(head) + 1)
		}
		if err != nil {
			return -1
		}
		remaining, n := binary.Uvarint(head[1:])
		if n <= 0 {
			return -1
		}
		size := 1 + n + int(remaining)
		if head[0] != 0x30 || size > c.r.Size() {
			return size
		}
		b, err := c.r.Peek(size)
		if err != nil {
			return -1
		}
		p, ok := parseReply(b)
		if !ok || !c.replies(p) {
			return size
		}
		c.r.Discard(size)
	}
}

// Lock begins a packet.
func (c *packetConn) Lock() {
	c.mu.Lock()
	for len(c.pending) >= maxPending && c.err == nil {
		c.cond.Wait()
	}
	c.packet = true
}

// Unlock hands the packet to the writer.
func (c *packetConn) Unlock() {
	c.packet = false
	if len(c.pending) > 0 && !c.kicked && c.err == nil {
		c.kicked = true
		c.kick <- struct{}{}
	}
	c.mu.Unlock()
}

// Write gathers a packet's bytes. A failed connection's error comes
// back on the next packet (paho also learns of it from its read).
func (c *packetConn) Write(p []byte) (int, error) {
	if !c.packet { // paho writes every packet under the lock
		c.Lock()
		defer c.Unlock()
	}
	if c.err != nil {
		return 0, c.err
	}
	c.pending = append(c.pending, p...)
	return len(p), nil
}

// writer sends what has gathered, until the connection fails or closes.
func (c *packetConn) writer() {
	for range c.kick {
		c.mu.Lock()
		buf := c.pending
		c.pending, c.spare = c.spare[:0], nil
		c.kicked, c.writing = false, true
		c.cond.Broadcast()
		c.mu.Unlock()
		_, err := c.Conn.Write(buf)
		c.mu.Lock()
		c.writing = false
		c.cond.Broadcast()
		if err != nil && c.err == nil {
			c.err = err
		}
		if cap(buf) <= maxPending {
			c.spare = buf
		}
		failed := c.err != nil
		c.mu.Unlock()
		if failed {
			c.Conn.Close() // paho's read fails, and it reconnects
			return
		}
	}
}

// Close sends what has gathered (paho closes right after writing a
// DISCONNECT, which must not be lost: the server would publish the
// client's will), for at most a second, and ends the writer.
func (c *packetConn) Close() error {
	c.Conn.SetWriteDeadline(time.Now().Add(time.Second))
	c.mu.Lock()
	for (len(c.pending) > 0 || c.writing) && c.err == nil {
		c.cond.Wait()
	}
	if c.err == nil {
		c.err = net.ErrClosed
		c.cond.Broadcast()
		close(c.kick)
	}
	c.mu.Unlock()
	return c.Conn.Close()
}
