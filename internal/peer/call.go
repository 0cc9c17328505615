package peer

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
)

// Messages on KindCall streams are frames: a uint32 big-endian length, then
// a msgpack body. A call is one request frame and one reply frame; a
// stream (change events) is one request frame and then reply frames until
// either side closes.

// MaxFrame bounds one message (a value is at most the MQTT packet size).
const MaxFrame = 512 << 20

var mh = &codec.MsgpackHandle{}

// Conn reads and writes framed messages on a stream.
type Conn struct {
	net.Conn
	r *bufio.Reader
	w *bufio.Writer
}

// NewConn wraps a stream.
func NewConn(c net.Conn) *Conn {
	return &Conn{Conn: c, r: bufio.NewReaderSize(c, 32<<10), w: bufio.NewWriterSize(c, 32<<10)}
}

// Send writes one message and flushes it; on failure the stream is closed.
func (c *Conn) Send(v any) error {
	b, err := Encode(v)
	if err != nil {
		return err
	}
	if err := c.writeFrame(b); err != nil {
		c.Close()
		return err
	}
	return nil
}

// Write writes one message without flushing it (see Flush); on failure
// the stream is closed.
func (c *Conn) Write(v any) error {
	b, err := Encode(v)
	if err != nil {
		return err
	}
	return c.WriteFrame(b)
}

// Flush sends what Write left; on failure the stream is closed.
func (c *Conn) Flush() error {
	if err := c.w.Flush(); err != nil {
		c.Close()
		return err
	}
	return nil
}

// Buffered reports how many bytes of the next messages are read already.
func (c *Conn) Buffered() int { return c.r.Buffered() }

// Receive reads one message into v.
func (c *Conn) Receive(v any) error {
	b, err := c.frame()
	if err != nil {
		return err
	}
	return Decode(b, v)
}

// NotSentError is returned by Call when the request never left this node
// (no connection or stream could be opened): the caller may retry it
// elsewhere without risk of it being served twice.
type NotSentError struct{ Err error }

func (e *NotSentError) Error() string { return "peer: not sent: " + e.Err.Error() }
func (e *NotSentError) Unwrap() error { return e.Err }

// Call sends req to the node at addr (its HandleCalls handler) and reads
// its reply into resp, within ctx. A NotSentError means the request never
// left; any other error leaves its fate unknown.
func (l *Link) Call(ctx context.Context, addr string, req, resp any) error {
	body, err := Encode(req)
	if err != nil {
		return &NotSentError{err}
	}
	reply, err := l.CallBytes(ctx, addr, body)
	if err != nil {
		return err
	}
	return Decode(reply, resp)
}

// CallBytes is Call for a request already encoded (in a binary form, say),
// returning the reply undecoded.
func (l *Link) CallBytes(ctx context.Context, addr string, body []byte) ([]byte, error) {
	m, err := l.muxTo(ctx, addr)
	if err != nil {
		return nil, &NotSentError{err}
	}
	return m.call(ctx, body)
}

// Calls share one stream per peer (KindMux): each request frame carries an
// id, replies come back with it in any order, so a forwarded request costs
// two frames on a stream already open instead of opening and closing a
// stream. A broken stream fails every call waiting on it.

// KindMux streams carry many calls.
const KindMux byte = 3

// Encode and Decode are the message encoding of the link (msgpack).
func Encode(v any) ([]byte, error) {
	var b []byte
	err := codec.NewEncoderBytes(&b, mh).Encode(v)
	return b, err
}

func Decode(b []byte, v any) error { return codec.NewDecoderBytes(b, mh).Decode(v) }

// HandleCalls sets the handler of calls: it gets a request body and
// returns the reply body. It runs on its own goroutine per call.
func (l *Link) HandleCalls(h func(from string, body []byte) []byte) { l.calls.Store(&h) }

// mux is the calling side of one peer's KindMux stream.
type mux struct {
	c       *Conn
	wmu     sync.Mutex
	mu      sync.Mutex
	pending map[uint64]chan []byte
	next    uint64
	dead    chan struct{}
}

// muxTo returns the call stream to addr, opening it if needed.
func (l *Link) muxTo(ctx context.Context, addr string) (*mux, error) {
	l.mu.Lock()
	m := l.muxes[addr]
	l.mu.Unlock()
	if m != nil {
		select {
		case <-m.dead:
		default:
			return m, nil
		}
	}
	s, err := l.Open(ctx, addr, KindMux, nil)
	if err != nil {
		return nil, err
	}
	m = &mux{c: NewConn(s), pending: map[uint64]chan []byte{}, dead: make(chan struct{})}
	l.mu.Lock()
	if old := l.muxes[addr]; old != nil && old != m {
		select {
		case <-old.dead:
		default: // another caller opened one meanwhile
			l.mu.Unlock()
			s.Close()
			return old, nil
		}
	}
	l.muxes[addr] = m
	l.mu.Unlock()
	go m.read()
	return m, nil
}

func (m *mux) read() {
	defer func() {
		m.c.Close()
		m.mu.Lock()
		close(m.dead)
		m.pending = nil
		m.mu.Unlock()
	}()
	for {
		b, err := m.c.frame()
		if err != nil || len(b) < 8 {
			return
		}
		id := binary.BigEndian.Uint64(b)
		m.mu.Lock()
		ch := m.pending[id]
		delete(m.pending, id)
		m.mu.Unlock()
		if ch != nil {
			ch <- b[8:]
		}
	}
}

// call sends one request and waits for its reply.
func (m *mux) call(ctx context.Context, body []byte) ([]byte, error) {
	ch := make(chan []byte, 1)
	m.mu.Lock()
	if m.pending == nil {
		m.mu.Unlock()
		return nil, &NotSentError{errors.New("call stream closed")}
	}
	m.next++
	id := m.next
	m.pending[id] = ch
	m.mu.Unlock()
	frame := binary.BigEndian.AppendUint64(make([]byte, 0, 8+len(body)), id)
	frame = append(frame, body...)
	m.wmu.Lock()
	m.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	err := m.c.writeFrame(frame)
	m.wmu.Unlock()
	if err != nil {
		m.c.Close() // the reader ends and fails the others
		return nil, err
	}
	select {
	case b := <-ch:
		return b, nil
	case <-m.dead:
		return nil, errors.New("peer: call stream broke before the reply")
	case <-ctx.Done():
		m.mu.Lock()
		if m.pending != nil {
			delete(m.pending, id)
		}
		m.mu.Unlock()
		return nil, ctx.Err()
	}
}

// serveMux answers the calls of one KindMux stream.
func (l *Link) serveMux(from string, s net.Conn) {
	c := NewConn(s)
	defer c.Close()
	var wmu sync.Mutex
	for {
		b, err := c.frame()
		if err != nil || len(b) < 8 {
			return
		}
		h := l.calls.Load()
		if h == nil {
			return
		}
		go func() {
			reply := (*h)(from, b[8:])
			frame := append(b[:8:8], reply...)
			wmu.Lock()
			defer wmu.Unlock()
			c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			if c.writeFrame(frame) != nil {
				c.Close()
			}
		}()
	}
}

// frame reads one raw frame.
func (c *Conn) frame() ([]byte, error) {
	var n [4]byte
	if _, err := io.ReadFull(c.r, n[:]); err != nil {
		return nil, err
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > MaxFrame {
		c.Close()
		return nil, fmt.Errorf("peer: message of %d bytes", size)
	}
	b := make([]byte, size)
	_, err := io.ReadFull(c.r, b)
	return b, err
}

// ReceiveFrame reads one message as it came, for a caller that decodes
// it itself. The slice is its own.
func (c *Conn) ReceiveFrame() ([]byte, error) { return c.frame() }

// WriteFrame writes one message already encoded, without flushing it
// (see Flush); on failure the stream is closed.
func (c *Conn) WriteFrame(b []byte) error {
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(b)))
	c.w.Write(n[:])
	if _, err := c.w.Write(b); err != nil {
		c.Close()
		return err
	}
	return nil
}

// writeFrame writes one raw frame and flushes it.
func (c *Conn) writeFrame(b []byte) error {
	if err := c.WriteFrame(b); err != nil {
		return err
	}
	return c.w.Flush()
}
