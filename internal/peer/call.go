package peer

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
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
	var b []byte
	if err := codec.NewEncoderBytes(&b, mh).Encode(v); err != nil {
		return err
	}
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(b)))
	c.w.Write(n[:])
	c.w.Write(b)
	if err := c.w.Flush(); err != nil {
		c.Close()
		return err
	}
	return nil
}

// Receive reads one message into v.
func (c *Conn) Receive(v any) error {
	var n [4]byte
	if _, err := io.ReadFull(c.r, n[:]); err != nil {
		return err
	}
	size := binary.BigEndian.Uint32(n[:])
	if size > MaxFrame {
		c.Close()
		return fmt.Errorf("peer: message of %d bytes", size)
	}
	b := make([]byte, size)
	if _, err := io.ReadFull(c.r, b); err != nil {
		return err
	}
	return codec.NewDecoderBytes(b, mh).Decode(v)
}

// NotSentError is returned by Call when the request never left this node
// (no connection or stream could be opened): the caller may retry it
// elsewhere without risk of it being served twice.
type NotSentError struct{ Err error }

func (e *NotSentError) Error() string { return "peer: not sent: " + e.Err.Error() }
func (e *NotSentError) Unwrap() error { return e.Err }

// Call sends req to the node at addr and reads its reply into resp, within
// ctx.
func (l *Link) Call(ctx context.Context, addr string, req, resp any) error {
	s, err := l.Open(ctx, addr, KindCall, nil)
	if err != nil {
		return &NotSentError{err}
	}
	defer s.Close()
	if d, ok := ctx.Deadline(); ok {
		s.SetDeadline(d)
	} else {
		s.SetDeadline(time.Now().Add(time.Minute))
	}
	c := NewConn(s)
	if err := c.Send(req); err != nil {
		return err
	}
	return c.Receive(resp)
}
