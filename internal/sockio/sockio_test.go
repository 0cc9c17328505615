package sockio

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"
)

// pair is a loopback TCP connection: the accepted end wrapped, and the
// dialled end as it is.
func pair(t *testing.T) (*Conn, *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	other, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	w, ok := Wrap(c).(*Conn)
	if !ok {
		t.Fatalf("Wrap(%T) did not wrap", c)
	}
	t.Cleanup(func() { w.Close() })
	return w, other.(*net.TCPConn)
}

// TestReadWaitsAndReadsWhatArrives: a read waits in the poller for bytes,
// returns those that came, and ends with io.EOF once the peer closes.
func TestReadWaitsAndReadsWhatArrives(t *testing.T) {
	c, other := pair(t)
	got := make(chan []byte, 1)
	go func() {
		p := make([]byte, 100)
		n, err := c.Read(p)
		if err != nil {
			t.Error(err)
		}
		got <- p[:n]
	}()
	if _, err := other.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if p := <-got; string(p) != "hello" {
		t.Fatalf("read %q, want hello", p)
	}
	other.Close()
	n, err := c.Read(make([]byte, 10))
	if n != 0 || err != io.EOF {
		t.Fatalf("after the peer closed: %d, %v; want 0, io.EOF", n, err)
	}
}

// TestReadDeadline: a read past its deadline fails as net.Conn's does,
// and the connection reads on once the deadline is moved.
func TestReadDeadline(t *testing.T) {
	c, other := pair(t)
	c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	n, err := c.Read(make([]byte, 10))
	var ne net.Error
	if n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read past its deadline: %d, %v; want a timeout", n, err)
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "read" {
		t.Fatalf("error %#v, want a *net.OpError for read", err)
	}
	c.SetReadDeadline(time.Time{})
	other.Write([]byte("x"))
	p := make([]byte, 10)
	if n, err := c.Read(p); n != 1 || err != nil || p[0] != 'x' {
		t.Fatalf("read after the deadline was cleared: %d, %v", n, err)
	}
}

// TestWriteWaitsForRoom: a write larger than the socket takes waits for
// the peer to read, and all of it arrives in order, as do the writes of
// other goroutines, each whole.
func TestWriteWaitsForRoom(t *testing.T) {
	c, other := pair(t)
	const writers, size = 4, 3 << 20 // each larger than the socket's buffers
	var want [writers][]byte
	for i := range want {
		want[i] = bytes.Repeat([]byte{byte('a' + i)}, size)
	}
	var wg sync.WaitGroup
	for i := range writers {
		wg.Go(func() {
			if n, err := c.Write(want[i]); n != size || err != nil {
				t.Errorf("write %d: %d, %v", i, n, err)
			}
		})
	}
	got, err := io.ReadAll(io.LimitReader(other, writers*size))
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if len(got) != writers*size {
		t.Fatalf("read %d bytes, want %d", len(got), writers*size)
	}
	seen := map[byte]bool{}
	for off := 0; off < len(got); off += size {
		b := got[off]
		if seen[b] || !bytes.Equal(got[off:off+size], bytes.Repeat([]byte{b}, size)) {
			t.Fatalf("writes interleaved at offset %d", off)
		}
		seen[b] = true
	}
}

// TestTryWriteNeverWaits: on a socket the peer does not read, TryWrite
// fills what room there is and then writes nothing, without an error;
// past the write deadline it fails at once.
func TestTryWriteNeverWaits(t *testing.T) {
	c, _ := pair(t)
	chunk := make([]byte, 1<<20)
	total, zero := 0, false
	for range 1000 {
		n, err := c.TryWrite(chunk)
		if err != nil {
			t.Fatal(err)
		}
		total += n
		if n == 0 {
			zero = true
			break
		}
	}
	if !zero || total == 0 {
		t.Fatalf("wrote %d bytes and never found the socket full", total)
	}
	c.SetWriteDeadline(time.Now().Add(-time.Second))
	if n, err := c.TryWrite(chunk); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("past the deadline: %d, %v", n, err)
	}
}

// TestResetAndClose: a reset by the peer reads as ECONNRESET, and a
// closed connection as net.ErrClosed, both as *net.OpError.
func TestResetAndClose(t *testing.T) {
	c, other := pair(t)
	other.SetLinger(0)
	other.Close()
	_, err := c.Read(make([]byte, 10))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read after a reset: %v, want ECONNRESET", err)
	}
	c.Close()
	if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after close: %v, want net.ErrClosed", err)
	}
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read after close: %v, want net.ErrClosed", err)
	}
}

// TestWrapLeavesOtherConnsAlone: only TCP connections are wrapped.
func TestWrapLeavesOtherConnsAlone(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if Wrap(a) != a {
		t.Fatal("Wrap changed a net.Pipe")
	}
}
