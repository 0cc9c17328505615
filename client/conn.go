package client

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
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

	// The requests the client publishes itself (appendRequest), each
	// waiting for its PUBACK. Their packet ids are from the upper half:
	// paho, which sends only SUBSCRIBE and UNSUBSCRIBE now, numbers its
	// own from 1 upwards. slots holds one token per request in flight,
	// at most the server's Receive Maximum (made by setSendMax, once the
	// CONNACK came); dead is closed, with lost set, once the connection
	// ended, and every request still waiting was told.
	ackMu  sync.Mutex
	acks   map[uint16]func(reason byte, err error)
	nextID uint16
	slots  chan struct{}
	dead   chan struct{}
	lost   error

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
	p := &packetConn{Conn: c, r: bufio.NewReaderSize(c, 16<<10), kick: make(chan struct{}, 1), replies: replies,
		acks: map[uint16]func(byte, error){}, nextID: firstOwnID, dead: make(chan struct{})}
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
	if err != nil {
		c.fail(errConnLost)
	}
	return n, err
}

// firstOwnID is the first packet id of the client's own requests.
const firstOwnID = 0x8000

// setSendMax sets how many requests may wait for their PUBACKs at once:
// the server's Receive Maximum (0: none given, 65,535), at most as many
// as there are ids of the client's own.
func (c *packetConn) setSendMax(max uint16) {
	n := int(max)
	if n == 0 || n > 0x10000-firstOwnID {
		n = 0x10000 - firstOwnID
	}
	c.ackMu.Lock()
	c.slots = make(chan struct{}, n)
	c.ackMu.Unlock()
}

// publish writes a request's PUBLISH, which encode appends with the
// packet id given, once fewer than the server's Receive Maximum are in
// flight; acked is called once, from the connection's reader, with the
// PUBACK's reason code, or with an error if the connection ends first.
// An error returned means nothing was sent.
func (c *packetConn) publish(ctx context.Context, encode func(b []byte, id uint16) []byte, acked func(reason byte, err error)) error {
	c.ackMu.Lock()
	slots := c.slots
	c.ackMu.Unlock()
	if slots == nil {
		return errors.New("no CONNACK yet") // requests wait for the connection to be up
	}
	select {
	case slots <- struct{}{}:
	case <-c.dead:
		return c.lost
	case <-ctx.Done():
		return ctx.Err()
	}
	c.ackMu.Lock()
	if c.lost != nil {
		c.ackMu.Unlock()
		return c.lost
	}
	id := c.nextID
	for c.acks[id] != nil { // a free one: fewer are in flight than ids
		id = max(id+1, firstOwnID)
	}
	c.nextID = max(id+1, firstOwnID)
	c.acks[id] = acked
	c.ackMu.Unlock()

	c.Lock()
	err := c.err
	if err == nil {
		c.pending = encode(c.pending, id)
	}
	c.Unlock()
	if err != nil {
		c.fail(err) // acked hears of it
	}
	return nil
}

// acked hands a PUBACK to the request waiting for it; false if none is.
func (c *packetConn) acked(id uint16, reason byte) bool {
	c.ackMu.Lock()
	f := c.acks[id]
	if f != nil {
		delete(c.acks, id)
		<-c.slots
	}
	c.ackMu.Unlock()
	if f == nil {
		return false
	}
	f(reason, nil)
	return true
}

// fail tells every request still waiting for its PUBACK that the
// connection ended, and refuses new ones.
func (c *packetConn) fail(err error) {
	c.ackMu.Lock()
	if c.lost != nil {
		c.ackMu.Unlock()
		return
	}
	c.lost = err
	close(c.dead)
	waiting := c.acks
	c.acks = map[uint16]func(byte, error){}
	c.ackMu.Unlock()
	for _, f := range waiting {
		f(0, err)
	}
}

// takeReplies takes the replies, and the PUBACKs of the client's own
// requests, at the head of the input, and returns the size of the next
// packet, which paho reads (-1 if its size is unknown:
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
		puback := head[0] == 0x40 && remaining >= 2
		if !puback && head[0] != 0x30 || size > c.r.Size() {
			return size
		}
		b, err := c.r.Peek(size)
		if err != nil {
			return -1
		}
		var taken bool
		if puback {
			reason := byte(0) // success, when the packet ends after the id
			if remaining > 2 {
				reason = b[1+n+2]
			}
			taken = c.acked(binary.BigEndian.Uint16(b[1+n:]), reason)
		} else {
			p, ok := parseReply(b)
			taken = ok && c.replies(p)
		}
		if !taken {
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
	c.fail(errConnLost)
	return c.Conn.Close()
}
