package peer

import (
	"net"
	"sync"
	"time"
)

// batchConn gathers the writes of a yamux session into one TLS record and
// one write(2) for as many frames as are waiting, instead of two of each
// per frame. Why: yamux writes every frame's 12-byte header and its body
// with two calls on its connection, and each call on a TLS connection is
// a record of its own, sealed and written on its own. Across nodes a
// message took four to six of them (its frame, the acknowledgement, the
// window updates); a profile of a node forwarding MQTT messages put a
// quarter of its CPU in those writes.
//
// Writes are copied into a buffer and written by one goroutine: whatever
// came while it wrote goes out in its next write, as the journal's group
// commit does with fsyncs. A write waits only while maxPending bytes are
// already waiting (a peer that stops reading holds its writers up as
// before). A write error is kept and returned by the writes after it,
// and closes the connection, which ends the session's reads.
type batchConn struct {
	net.Conn

	mu      sync.Mutex
	room    *sync.Cond // signalled when the flusher took the buffer
	buf     []byte     // waiting to be written
	spare   []byte     // the flusher's last buffer, reused
	err     error      // sticky
	closing bool
	wake    chan struct{}
	done    chan struct{}
}

// maxPending is how much a batchConn takes before its writers wait.
const maxPending = 1 << 20

// closeFlush bounds how long a closing batchConn tries to write what is
// still waiting (a peer that stopped reading must not hold a close up).
const closeFlush = time.Second

func newBatchConn(c net.Conn) *batchConn {
	b := &batchConn{Conn: c, wake: make(chan struct{}, 1), done: make(chan struct{})}
	b.room = sync.NewCond(&b.mu)
	go b.flusher()
	return b
}

// yamux's frame header: version, type, flags (2), stream (4), length (4).
const (
	yamuxHeader   = 12
	yamuxTypeData = 0
)

// bodyFollows reports whether p is a yamux data frame's header whose body
// yamux writes next: the flusher is not woken for it alone, so the two go
// out together (the body's write follows at once from the same goroutine).
func bodyFollows(p []byte) bool {
	return len(p) == yamuxHeader && p[0] == 0 && p[1] == yamuxTypeData && (p[8]|p[9]|p[10]|p[11]) != 0
}

func (b *batchConn) Write(p []byte) (int, error) {
	b.mu.Lock()
	for len(b.buf) >= maxPending && b.err == nil && !b.closing {
		b.room.Wait()
	}
	if b.err != nil || b.closing {
		err := b.err
		b.mu.Unlock()
		if err == nil {
			err = net.ErrClosed
		}
		return 0, err
	}
	b.buf = append(b.buf, p...)
	b.mu.Unlock()
	if !bodyFollows(p) {
		select {
		case b.wake <- struct{}{}:
		default:
		}
	}
	return len(p), nil
}

func (b *batchConn) flusher() {
	defer close(b.done)
	for range b.wake {
		b.mu.Lock()
		out := b.buf
		b.buf = b.spare[:0]
		closing := b.closing
		b.mu.Unlock()
		var err error
		if len(out) > 0 {
			_, err = b.Conn.Write(out)
		}
		b.mu.Lock()
		// The buffer just written is the next one writers fill; one
		// grown past maxPending is dropped. Never keep the spare given
		// out above: writers fill it now (the race detector caught a
		// buffer written while it was being sent).
		b.spare = nil
		if cap(out) <= maxPending {
			b.spare = out[:0]
		}
		if err != nil && b.err == nil {
			b.err = err
		}
		b.room.Broadcast()
		b.mu.Unlock()
		if err != nil || closing {
			b.Conn.Close()
			return
		}
	}
}

// Close writes what is waiting (within closeFlush) and closes the
// connection; it does not wait for either.
func (b *batchConn) Close() error {
	b.mu.Lock()
	if b.closing {
		b.mu.Unlock()
		return nil
	}
	b.closing = true
	b.room.Broadcast()
	b.mu.Unlock()
	// The flusher may be inside a write to a peer that stopped reading:
	// the deadline ends it, and the flusher closes the connection.
	b.Conn.SetWriteDeadline(time.Now().Add(closeFlush))
	select {
	case b.wake <- struct{}{}:
	default:
	}
	return nil
}
