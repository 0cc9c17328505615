// Package sockio reads and writes sockets that never block (Go's network
// sockets are all non-blocking) with raw system calls: calls the Go
// scheduler is not told about.
//
// Why: every system call made the ordinary way (syscall.Read, net.Conn's
// Read) passes through the runtime's entersyscall, and the first one
// after the process was idle wakes the runtime's monitor thread (sysmon)
// from its deep sleep with a futex; woken so, sysmon then polls every
// 20 µs for about a millisecond. A server that falls idle between its
// clients' round trips, as a broker does thousands of times a second,
// pays that cycle over and over: 9–12 % of mqkv's CPU under load
// (docs/decisions.md, "The runtime's monitor thread"). A read or write of
// a non-blocking socket returns in microseconds whatever the peer does,
// so the scheduler loses nothing by not being told: the goroutine keeps
// its P for those microseconds, as it does for any short computation.
// Blocking calls (fsync, file I/O, connect) must keep the ordinary path,
// so that sysmon can hand their P to other goroutines.
package sockio

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
)

// maxCall bounds the bytes one raw call copies, and so how long it keeps
// its P from the scheduler: 64 KiB is some microseconds of copying.
const maxCall = 64 << 10

// Conn is a TCP connection whose reads and writes are raw system calls
// on its non-blocking socket, waiting in Go's network poller (with the
// connection's deadlines) when the socket has nothing to read or no room
// to write. Everything else is the *net.TCPConn's, including ReadFrom and
// WriteTo (io.Copy's sendfile and splice), which make their calls the
// ordinary way.
type Conn struct {
	*net.TCPConn
	raw syscall.RawConn

	// The call in progress, for the closures below, which are made once
	// (a closure per call would be allocated per call); rmu and wmu keep
	// concurrent reads, and concurrent writes, apart, as net.Conn allows
	// them.
	rmu  sync.Mutex
	rp   []byte
	rn   int
	rerr error
	read func(fd uintptr) bool

	wmu   sync.Mutex
	wp    []byte
	wn    int
	werr  error
	wwait bool // a full socket is waited on (Write), or ends the call (TryWrite)
	write func(fd uintptr) bool
}

var _ net.Conn = (*Conn)(nil)

// Wrap returns c reading and writing with raw system calls, or c itself
// where its socket cannot be reached.
func Wrap(c net.Conn) net.Conn {
	tcp, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	raw, err := tcp.SyscallConn()
	if err != nil {
		return c
	}
	w := &Conn{TCPConn: tcp, raw: raw}
	w.read = w.readOnce
	w.write = w.writeSome
	return w
}

// Read reads into p what the socket has, waiting for it to have something.
func (c *Conn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rmu.Lock()
	c.rp, c.rn, c.rerr = p, 0, nil
	err := c.raw.Read(c.read)
	n := c.rn
	if err == nil {
		err = c.rerr
	}
	c.rp, c.rerr = nil, nil
	c.rmu.Unlock()
	if err != nil && err != io.EOF {
		err = c.opError("read", err)
	}
	return n, err
}

func (c *Conn) readOnce(fd uintptr) bool {
	for {
		n, err := Read(fd, c.rp)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			return false // wait in the poller
		case err != nil:
			c.rerr = os.NewSyscallError("read", err)
		case n == 0:
			c.rerr = io.EOF
		default:
			c.rn = n
		}
		return true
	}
}

// Write writes all of p, waiting for room in the socket as often as it
// must.
func (c *Conn) Write(p []byte) (int, error) {
	n, err := c.writeWith(true, p)
	if err != nil {
		err = c.opError("write", err)
	}
	return n, err
}

// TryWrite writes what of p the socket has room for now, without waiting:
// n may be short of len(p), with a nil error. Once the write deadline has
// passed the error is os.ErrDeadlineExceeded, with nothing written.
func (c *Conn) TryWrite(p []byte) (int, error) {
	n, err := c.writeWith(false, p)
	if err != nil {
		err = c.opError("write", err)
	}
	return n, err
}

func (c *Conn) writeWith(wait bool, p []byte) (int, error) {
	c.wmu.Lock()
	c.wp, c.wn, c.werr, c.wwait = p, 0, nil, wait
	err := c.raw.Write(c.write)
	n := c.wn
	if err == nil {
		err = c.werr
	}
	c.wp, c.werr = nil, nil
	c.wmu.Unlock()
	return n, err
}

// writeSome writes what the socket takes of wp; once it is full, the
// poller waits for room (wwait) or the call ends, short.
func (c *Conn) writeSome(fd uintptr) bool {
	for c.wn < len(c.wp) {
		n, err := Write(fd, c.wp[c.wn:])
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			return !c.wwait
		case err != nil:
			c.werr = os.NewSyscallError("write", err)
			return true
		}
		c.wn += n
	}
	return true
}

// opError is err as net.Conn's Read and Write give it: an *net.OpError
// naming the operation and the addresses. The raw connection's own
// errors (deadlines, a closed connection) come as one already, named
// "raw-read" or "raw-write".
func (c *Conn) opError(op string, err error) error {
	if oe, ok := err.(*net.OpError); ok {
		err = oe.Err
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

// Listener returns ln with every connection it accepts wrapped (see
// Wrap).
func Listener(ln net.Listener) net.Listener { return listener{ln} }

type listener struct{ net.Listener }

func (l listener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return Wrap(c), nil
}

// Dial connects to addr (host:port) over TCP, the connection wrapped (see
// Wrap), and with TLS over it when tc is not nil: its ServerName, when
// empty, is addr's host, as tls.Dialer has it.
func Dial(ctx context.Context, addr string, tc *tls.Config) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c = Wrap(c)
	if tc == nil {
		return c, nil
	}
	if tc.ServerName == "" {
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			host = addr
		}
		tc = tc.Clone()
		tc.ServerName = host
	}
	t := tls.Client(c, tc)
	if err := t.HandshakeContext(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return t, nil
}
