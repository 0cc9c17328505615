package peer

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"
)

// countingConn records each write it is given.
type countingConn struct {
	net.Conn
	writes chan []byte
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes <- append([]byte(nil), p...)
	return c.Conn.Write(p)
}

// A yamux data header is held until its body comes, and the two go out in
// one write; everything arrives in order; a close writes what waits.
func TestBatchConnWritesHeaderAndBodyTogether(t *testing.T) {
	a, z := net.Pipe()
	cc := &countingConn{Conn: a, writes: make(chan []byte, 100)}
	b := newBatchConn(cc)
	got := make(chan []byte, 1)
	go func() {
		all, _ := io.ReadAll(z)
		got <- all
	}()
	hdr := []byte{0, yamuxTypeData, 0, 0, 0, 0, 0, 1, 0, 0, 0, 5}
	b.Write(hdr)
	select {
	case w := <-cc.writes:
		t.Fatalf("a data header went out alone: %x", w)
	case <-time.After(50 * time.Millisecond):
	}
	b.Write([]byte("hello"))
	if w := <-cc.writes; !bytes.Equal(w, append(hdr, "hello"...)) {
		t.Fatalf("first write %x, want the header and its body", w)
	}
	// A window update (type 1) has no body: it is not held.
	upd := []byte{0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0}
	b.Write(upd)
	if w := <-cc.writes; !bytes.Equal(w, upd) {
		t.Fatalf("window update written as %x", w)
	}
	b.Write([]byte("tail"))
	b.Close()
	all := <-got
	want := append(append(append(hdr, "hello"...), upd...), "tail"...)
	if !bytes.Equal(all, want) {
		t.Fatalf("the peer read %x, want %x", all, want)
	}
	if _, err := b.Write([]byte("late")); err == nil {
		t.Fatal("a write after Close succeeded")
	}
}

// A peer that stops reading holds writers up once maxPending waits, and a
// close still returns at once and ends the connection.
func TestBatchConnBoundsWhatWaits(t *testing.T) {
	a, z := net.Pipe() // unbuffered: nothing is read from z
	defer z.Close()
	b := newBatchConn(a)
	wrote := make(chan int, 1)
	go func() {
		n := 0
		chunk := make([]byte, 64<<10)
		for {
			if _, err := b.Write(chunk); err != nil {
				wrote <- n
				return
			}
			n += len(chunk)
		}
	}()
	time.Sleep(200 * time.Millisecond)
	select {
	case n := <-wrote:
		t.Fatalf("writes ended early after %d bytes", n)
	default:
	}
	start := time.Now()
	b.Close()
	select {
	case n := <-wrote:
		if n > 2*maxPending+64<<10 { // one buffer being written, one waiting
			t.Fatalf("%d bytes taken while the peer read nothing (bound twice %d)", n, maxPending)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a writer stayed blocked after Close")
	}
	select {
	case <-b.done:
	case <-time.After(closeFlush + 5*time.Second):
		t.Fatal("the flusher did not end")
	}
	if d := time.Since(start); d > closeFlush+4*time.Second {
		t.Fatalf("close took %v", d)
	}
}

// Writes of every size, some past maxPending (so the flusher's buffer
// grows beyond what it keeps), arrive whole and in order: a grown buffer
// once stayed the spare while writers filled it, and was sent while being
// written (caught by the race detector under CI's load).
func TestBatchConnKeepsOrderAcrossLargeWrites(t *testing.T) {
	a, z := net.Pipe()
	b := newBatchConn(a)
	var want bytes.Buffer
	sizes := []int{10, 3 << 20, 100, 5, 2 << 20, 64 << 10, 1, 1 << 20, 77}
	for round := range 4 {
		for i, n := range sizes {
			want.Write(bytes.Repeat([]byte{byte('a' + (round+i)%26)}, n))
		}
	}
	got := make(chan []byte, 1)
	go func() {
		all, _ := io.ReadAll(z)
		got <- all
	}()
	go func() {
		for round := range 4 {
			for i, n := range sizes {
				b.Write(bytes.Repeat([]byte{byte('a' + (round+i)%26)}, n))
			}
		}
		b.Close()
	}()
	if all := <-got; !bytes.Equal(all, want.Bytes()) {
		t.Fatalf("read %d bytes, want %d, or in another order", len(all), want.Len())
	}
}
