package e2e

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"testing"
	"time"
)

// Server-side MUST statements of MQTT 5 that mochi leaves to its embedder,
// checked byte by byte with hand-made packets.

// rawPacket is one control packet read off the wire.
type rawPacket struct {
	typ  byte // the first byte: type and flags
	body []byte
}

// readPacket reads one MQTT control packet.
func readPacket(r *bufio.Reader) (rawPacket, error) {
	typ, err := r.ReadByte()
	if err != nil {
		return rawPacket{}, err
	}
	n, err := binary.ReadUvarint(r)
	if err != nil {
		return rawPacket{}, err
	}
	body := make([]byte, n)
	_, err = io.ReadFull(r, body)
	return rawPacket{typ: typ, body: body}, err
}

// properties decodes the property list at the start of b (after the
// variable header's fixed fields) into id → raw value, for the properties
// the tests look at: one-byte, two-byte, four-byte and string ones.
func properties(t testing.TB, b []byte) map[byte][]byte {
	t.Helper()
	n, k := binary.Uvarint(b)
	if k <= 0 || int(n) > len(b)-k {
		t.Fatalf("bad property length in % x", b)
	}
	b = b[k : k+int(n)]
	out := map[byte][]byte{}
	for len(b) > 0 {
		id := b[0]
		b = b[1:]
		var size int
		switch id {
		case 0x01, 0x17, 0x19, 0x24, 0x25, 0x28, 0x29, 0x2A: // byte
			size = 1
		case 0x13, 0x21, 0x22, 0x23: // two-byte integer
			size = 2
		case 0x02, 0x11, 0x18, 0x27: // four-byte integer
			size = 4
		case 0x03, 0x08, 0x09, 0x12, 0x15, 0x16, 0x1A, 0x1C, 0x1F: // string or binary
			size = 2 + int(binary.BigEndian.Uint16(b))
		case 0x26: // user property: two strings
			l1 := int(binary.BigEndian.Uint16(b))
			size = 2 + l1 + 2 + int(binary.BigEndian.Uint16(b[2+l1:]))
		case 0x0B: // subscription identifier: varint
			_, size = binary.Uvarint(b)
		default:
			t.Fatalf("property %#x not known to the test", id)
		}
		out[id] = b[:size]
		b = b[size:]
	}
	return out
}

// connectRawV5 opens a connection, sends CONNECT (with keepAlive and the
// given CONNECT properties, already encoded) and returns the CONNACK's
// properties.
func connectRawV5(t testing.TB, addr, id string, keepAlive uint16, props []byte) (net.Conn, *bufio.Reader, map[byte][]byte) {
	t.Helper()
	conn := dialTCP(t, addr)
	body := append(mqttString("MQTT"), 5, 0x02, byte(keepAlive>>8), byte(keepAlive))
	body = append(append(body, varint(len(props))...), props...)
	body = append(body, mqttString(id)...)
	if _, err := conn.Write(packet(0x10, body)); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(conn)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	ack, err := readPacket(r)
	if err != nil || ack.typ != 0x20 || len(ack.body) < 3 || ack.body[1] != 0 {
		t.Fatalf("CONNACK: %v % x", err, ack.body)
	}
	return conn, r, properties(t, ack.body[2:])
}

// TestReceiveMaximumExceeded (§3.3.4, §4.9): a client that sends more
// QoS 2 PUBLISHes awaiting PUBREL than the Receive Maximum the server gave
// it in CONNACK is disconnected with reason 0x93, not just cut off.
func TestReceiveMaximumExceeded(t *testing.T) {
	s := startServer(t, inMemory())
	conn, r, props := connectRawV5(t, s.Addr(), "greedy", 60, nil)
	rm := 65535
	if v, ok := props[0x21]; ok {
		rm = int(binary.BigEndian.Uint16(v))
	}
	if rm > 5000 {
		t.Fatalf("Receive Maximum %d: the test sends one more than that", rm)
	}
	// Subscribed to what it publishes, the client also has messages on
	// their way to it when the DISCONNECT is due.
	conn.Write(subscribePacket("flow/control"))
	if p, err := readPacket(r); err != nil || p.typ != 0x90 {
		t.Fatalf("SUBACK: %v %#x", err, p.typ)
	}
	go func() {
		w := bufio.NewWriter(conn)
		for id := 1; id <= rm+1; id++ {
			body := append(mqttString("flow/control"), byte(id>>8), byte(id), 0) // packet id, no properties
			w.Write(packet(0x34, append(body, 'x')))                        // PUBLISH QoS 2
		}
		w.Flush()
	}()
	pubrecs := 0
	for {
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		p, err := readPacket(r)
		if err != nil {
			t.Fatalf("after %d PUBRECs the connection ended without a DISCONNECT: %v", pubrecs, err)
		}
		switch p.typ >> 4 {
		case 5: // PUBREC
			pubrecs++
		case 3: // its own messages coming back
		case 14: // DISCONNECT
			if len(p.body) < 1 || p.body[0] != 0x93 {
				t.Fatalf("DISCONNECT % x, want reason 0x93", p.body)
			}
			if pubrecs > rm {
				t.Fatalf("%d PUBRECs before the DISCONNECT, more than the %d allowed", pubrecs, rm)
			}
			return
		default:
			t.Fatalf("unexpected packet %#x", p.typ)
		}
	}
}


// TestServerKeepAlive (MQTT-3.1.2-21, §3.2.2.3.14): with
// --server-keep-alive the CONNACK carries Server Keep Alive, whatever the
// client asked (even no keep-alive at all), and a client silent for 1.5
// times it is disconnected; one that pings in time stays.
func TestServerKeepAlive(t *testing.T) {
	s := startServer(t, inMemory(), func(c *serverConfig) { c.ServerKeepAlive = 1 })
	for _, asked := range []uint16{0, 60} {
		conn, r, props := connectRawV5(t, s.Addr(), fmt.Sprintf("silent-%d", asked), asked, nil)
		v, ok := props[0x13]
		if !ok || binary.BigEndian.Uint16(v) != 1 {
			t.Fatalf("asked %d: CONNACK Server Keep Alive %v, want 1", asked, v)
		}
		start := time.Now()
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := readPacket(r); err == nil {
			t.Fatal("a packet came to a silent client")
		} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("asked %d: a silent client was not disconnected within 10 s", asked)
		}
		if d := time.Since(start); d < time.Second {
			t.Fatalf("asked %d: disconnected after %v, before the keep-alive ran out", asked, d)
		}
	}
	// A client that pings every half second stays connected past 1.5 s.
	conn, r, _ := connectRawV5(t, s.Addr(), "pinger", 60, nil)
	for range 5 {
		time.Sleep(500 * time.Millisecond)
		conn.Write([]byte{0xC0, 0}) // PINGREQ
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		if p, err := readPacket(r); err != nil || p.typ != 0xD0 {
			t.Fatalf("PINGRESP: %v %#x", err, p.typ)
		}
	}
}
