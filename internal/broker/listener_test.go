package broker

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/mqttwire"
)

func connectBytes(name string, version byte) []byte {
	body := append([]byte{0, byte(len(name))}, name...)
	body = append(body, version, 0x02, 0, 60, 0, 0, 1, 'c')
	return append([]byte{0x10, byte(len(body))}, body...)
}

func TestFramerFindsOversizedPackets(t *testing.T) {
	stream := connectBytes("MQTT", 5)
	stream = append(stream, 0x30, 3, 0, 1, 'a')     // PUBLISH of 4 bytes: fits 10
	stream = append(stream, 0xC0, 0)                // PINGREQ
	stream = append(stream, 0x30, 0x80, 0x80, 0x40) // PUBLISH claiming 1 MiB
	for split := 1; split <= len(stream); split++ { // however the reads cut it
		var f framer
		found := 0
		for i := 0; i < len(stream); i += split {
			if f.feed(stream[i:min(i+split, len(stream))], 10) {
				found++
			}
		}
		if found != 1 || f.version != 5 || f.packets != 4 {
			t.Fatalf("reads of %d bytes: found %d, version %d, %d packets", split, found, f.version, f.packets)
		}
	}
	var f framer
	f.feed(connectBytes("MQIsdp", 3), 10)
	if f.version != 3 {
		t.Fatalf("MQTT 3.1 CONNECT: version %d", f.version)
	}
}

// FuzzFramer: any bytes, cut anywhere, frame the same as read whole, and
// never panic.
func FuzzFramer(f *testing.F) {
	f.Add(connectBytes("MQTT", 5), 3)
	f.Add(append(connectBytes("MQTT", 4), 0x30, 0xff, 0xff, 0xff, 0x7f), 1)
	f.Add([]byte{0x10, 0x80}, 2)
	f.Fuzz(func(t *testing.T, b []byte, split int) {
		if split <= 0 || split > 64 {
			split = 1
		}
		var whole, parts framer
		w := whole.feed(bytes.Clone(b), 100)
		p := false
		for i := 0; i < len(b); i += split {
			p = parts.feed(b[i:min(i+split, len(b))], 100) || p
		}
		if w != p || whole.packets != parts.packets || whole.version != parts.version || whole.skip != parts.skip {
			t.Fatalf("whole %+v (%v) vs parts %+v (%v)", whole, w, parts, p)
		}
	})
}

// TestStalledLargePacketEndsTheConnection: a client that sends the start
// of a large packet and stops is cut off after stallTime without a byte,
// keep-alive or not: mochi holds the packet's whole declared size for it.
// A packet that keeps coming is not.
func TestStalledLargePacketEndsTheConnection(t *testing.T) {
	defer func(d time.Duration) { stallTime = d }(stallTime)
	stallTime = time.Second
	server, client := tcpPair(t)
	c := &clientConn{Conn: server, r: server, max: 1 << 30}
	// A PUBLISH of 1 MiB remaining length, its first 10 bytes sent.
	head := append([]byte{0x30}, mqttwire.AppendVarint(nil, 1<<20)...)
	if _, err := client.Write(append(head, make([]byte, 10)...)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	got := 0
	for got < len(head)+10 {
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("reading what was sent: %v", err)
		}
		got += n
	}
	// More of it keeps coming, slower than stallTime in all but never
	// stalling that long: the connection stays.
	go func() {
		for i := 0; i < 4; i++ {
			time.Sleep(stallTime / 10)
			client.Write(make([]byte, 1000))
		}
	}()
	for got < len(head)+10+4000 {
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("a packet still coming was cut off: %v", err)
		}
		got += n
	}
	read := make(chan error, 1)
	go func() {
		_, err := c.Read(buf)
		read <- err
	}()
	select {
	case err := <-read:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a stalled packet: read %v, want the stall's deadline", err)
		}
	case <-time.After(10 * stallTime):
		server.Close()
		t.Fatal("a stalled packet holds its connection")
	}
}

// TestSlowReaderIsNotCutOff: a client that reads what it is sent, however
// slowly, keeps its connection whatever the size of what waits for it;
// the write deadline bounds the time without progress. One deadline for
// the whole of what was pending cut off a resumed session's backlog to a
// slow link.
func TestSlowReaderIsNotCutOff(t *testing.T) {
	defer func(d time.Duration) { writeTimeout = d }(writeTimeout)
	// A second: the reader's turns come every 40 ms, but a machine busy
	// with the rest of the suite (under -race) has delayed one by more
	// than the 300 ms this was (CI, 2026-11-30).
	writeTimeout = time.Second
	server, client := tcpPair(t)
	server.(*net.TCPConn).SetWriteBuffer(32 << 10)
	client.(*net.TCPConn).SetReadBuffer(32 << 10)
	c := &clientConn{Conn: server, r: server, max: 1 << 30}
	const total = 4 << 20 // at 32 KiB (one read) each 40 ms: about 5 s, 5 write timeouts
	payload := bytes.Repeat([]byte("slow"), total/4)
	if _, err := c.Write(payload); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 32<<10)
	got := 0
	for got < total {
		time.Sleep(40 * time.Millisecond)
		client.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := io.ReadAtLeast(client, buf, 1)
		if err != nil {
			t.Fatalf("after %d of %d bytes: %v (cut off)", got, total, err)
		}
		got += n
	}
	c.wmu.Lock()
	err := c.werr
	c.wmu.Unlock()
	if err != nil {
		t.Fatalf("the send failed: %v", err)
	}
}
