package e2e

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
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
			w.Write(packet(0x34, append(body, 'x')))                             // PUBLISH QoS 2
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
	t.Parallel()
	const keepAlive = 2 // seconds
	s := startServer(t, inMemory(), func(c *serverConfig) { c.ServerKeepAlive = keepAlive })
	type silent struct {
		r     *bufio.Reader
		start time.Time
	}
	var clients []silent
	for _, asked := range []uint16{0, 60} {
		conn, r, props := connectRawV5(t, s.Addr(), fmt.Sprintf("silent-%d", asked), asked, nil)
		v, ok := props[0x13]
		if !ok || binary.BigEndian.Uint16(v) != keepAlive {
			t.Fatalf("asked %d: CONNACK Server Keep Alive %v, want %d", asked, v, keepAlive)
		}
		conn.SetReadDeadline(time.Now().Add(15 * time.Second))
		clients = append(clients, silent{r, time.Now()})
	}
	// A client that pings once a second from the start stays connected
	// past 1.5 times the keep-alive.
	pinger, pr, _ := connectRawV5(t, s.Addr(), "pinger", 60, nil)
	pinged := make(chan error, 1)
	go func() {
		for range 5 {
			pinger.Write([]byte{0xC0, 0}) // PINGREQ
			pinger.SetReadDeadline(time.Now().Add(5 * time.Second))
			if p, err := readPacket(pr); err != nil || p.typ != 0xD0 {
				pinged <- fmt.Errorf("PINGRESP: %v %#x", err, p.typ)
				return
			}
			time.Sleep(time.Second)
		}
		pinged <- nil
	}()
	for i, c := range clients {
		if _, err := readPacket(c.r); err == nil {
			t.Fatal("a packet came to a silent client")
		} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("client %d: a silent client was not disconnected within 15 s", i)
		}
		// mochi allows keep-alive + keep-alive/2 in whole seconds.
		if d := time.Since(c.start); d < keepAlive*time.Second {
			t.Fatalf("client %d: disconnected after %v, before the keep-alive ran out", i, d)
		}
	}
	if err := <-pinged; err != nil {
		t.Fatal(err)
	}
}

// publishQoS1 publishes through a paho client and waits for the PUBACK.
func (rc *rawClient) publish(topic string, qos byte, retain bool, payload string) {
	rc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := rc.c.Publish(ctx, &paho.Publish{Topic: topic, QoS: qos, Retain: retain, Payload: []byte(payload)}); err != nil {
		rc.t.Fatalf("publish %s: %v", topic, err)
	}
}

func (rc *rawClient) subscribeWith(o paho.SubscribeOptions, id int) byte {
	rc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s := &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{o}}
	if id > 0 {
		s.Properties = &paho.SubscribeProperties{SubscriptionIdentifier: &id}
	}
	ack, err := rc.c.Subscribe(ctx, s)
	if ack == nil || len(ack.Reasons) != 1 {
		rc.t.Fatalf("subscribe %s: %v", o.Topic, err)
	}
	return ack.Reasons[0]
}

// expectNone fails if a message arrives within d.
func (rc *rawClient) expectNone(d time.Duration, what string) {
	rc.t.Helper()
	if p, ok := rc.nextPublish(d); ok {
		rc.t.Fatalf("%s: got a message on %s (%q)", what, p.Topic, p.Payload)
	}
}

func (rc *rawClient) expectMessage(topic, payload string) *paho.Publish {
	rc.t.Helper()
	p, ok := rc.nextPublish(5 * time.Second)
	if !ok || p.Topic != topic || string(p.Payload) != payload {
		rc.t.Fatalf("want %q on %s, got %+v", payload, topic, p)
	}
	return p
}

// MQTT-3.8.3-4: No Local on a shared subscription is a protocol error
// (mochi answers it in the SUBACK, 0xA2... or refuses the filter).
// MQTT 4.8.2: each message of a shared subscription goes to one member.
func TestMQTT_4_8_2_SharedSubscriptions(t *testing.T) {
	s := startServer(t, inMemory())
	a := dialRaw(t, s, "a", rawOpts{cleanStart: true, noSubscribe: true})
	b := dialRaw(t, s, "b", rawOpts{cleanStart: true, noSubscribe: true})
	for _, c := range []*rawClient{a, b} {
		if code := c.subscribeWith(paho.SubscribeOptions{Topic: "$share/g/jobs/#", QoS: 1}, 0); code != 1 {
			t.Fatalf("shared subscribe: %#x", code)
		}
	}
	pub := dialRaw(t, s, "pub", rawOpts{cleanStart: true, noSubscribe: true})
	const n = 20
	for i := range n {
		pub.publish("jobs/x", 1, false, fmt.Sprint(i))
	}
	seen := map[string]int{}
	for len(seen) < n {
		select {
		case p := <-a.inbox:
			seen[string(p.Payload)]++
		case p := <-b.inbox:
			seen[string(p.Payload)]++
		case <-time.After(5 * time.Second):
			t.Fatalf("%d of %d shared messages arrived", len(seen), n)
		}
	}
	for m, k := range seen {
		if k != 1 {
			t.Fatalf("message %s delivered %d times to the group", m, k)
		}
	}
	a.expectNone(100*time.Millisecond, "shared")
	b.expectNone(100*time.Millisecond, "shared")
	if code := a.subscribeWith(paho.SubscribeOptions{Topic: "$share/g/nl/#", QoS: 1, NoLocal: true}, 0); code < 0x80 {
		t.Fatalf("MQTT-3.8.3-4: No Local on a shared subscription granted (%#x)", code)
	}
}

// MQTT-3.3.4-7: the server sends no more unacknowledged QoS 1 messages
// than the client's Receive Maximum; acknowledging one lets the next come.
func TestMQTT_3_3_4_7_ClientReceiveMaximum(t *testing.T) {
	s := startServer(t, inMemory())
	c := dialRaw(t, s, "slow", rawOpts{cleanStart: true, noSubscribe: true, manualAck: true, receiveMaximum: 2})
	c.subscribe("rm/#", 1)
	pub := dialRaw(t, s, "pub", rawOpts{cleanStart: true, noSubscribe: true})
	for i := range 5 {
		pub.publish("rm/t", 1, false, fmt.Sprint(i))
	}
	var held []*paho.Publish
	for range 2 {
		p, ok := c.nextPublish(5 * time.Second)
		if !ok {
			t.Fatal("the first two messages did not arrive")
		}
		held = append(held, p)
	}
	c.expectNone(300*time.Millisecond, "a third message beyond Receive Maximum 2")
	if err := c.c.Ack(held[0]); err != nil {
		t.Fatal(err)
	}
	if p, ok := c.nextPublish(5 * time.Second); !ok || string(p.Payload) != "2" {
		t.Fatalf("after one PUBACK: %+v, want message 2", p)
	}
}

// MQTT-3.1.2-24, -25: the server sends the client no packet larger than
// the Maximum Packet Size the client gave; such a message is dropped for
// that client as if sent, and the next one comes.
func TestMQTT_3_1_2_24and25_ClientMaximumPacketSize(t *testing.T) {
	s := startServer(t, inMemory())
	props := append([]byte{0x27}, 0, 0, 0, 200) // Maximum Packet Size 200
	conn, r, _ := connectRawV5(t, s.Addr(), "small", 60, props)
	conn.Write(subscribePacket("mps/#"))
	if p, err := readPacket(r); err != nil || p.typ != 0x90 {
		t.Fatalf("SUBACK: %v %#x", err, p.typ)
	}
	pub := dialRaw(t, s, "pub", rawOpts{cleanStart: true, noSubscribe: true})
	pub.publish("mps/big", 0, false, strings.Repeat("x", 1000))
	pub.publish("mps/small", 0, false, "fits")
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	p, err := readPacket(r)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.body)+5 > 200 || p.typ>>4 != 3 || !strings.Contains(string(p.body), "mps/small") {
		t.Fatalf("first packet: type %#x, %d bytes (%q); want the small message", p.typ, len(p.body), p.body)
	}
}

// §3.2.2.3.6: a packet larger than the server's Maximum Packet Size gets
// DISCONNECT 0x95 before the connection closes.
func TestMQTT_3_2_2_3_6_ServerMaximumPacketSize(t *testing.T) {
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxPacketSize: 4096}))
	conn, r, props := connectRawV5(t, s.Addr(), "big", 60, nil)
	if v := props[0x27]; len(v) != 4 || binary.BigEndian.Uint32(v) != 4096 {
		t.Fatalf("CONNACK Maximum Packet Size % x, want 4096", v)
	}
	body := append(mqttString("mps/t"), 0)
	conn.Write(packet(0x30, append(body, strings.Repeat("x", 5000)...)))
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	p, err := readPacket(r)
	if err != nil || p.typ != 0xE0 || len(p.body) < 1 || p.body[0] != 0x95 {
		t.Fatalf("after an oversized PUBLISH: %v, packet %#x % x; want DISCONNECT 0x95", err, p.typ, p.body)
	}
}

// MQTT-3.1.2-23 with MQTT-3.2.2-2: a session with an expiry interval is
// kept after the connection ends (CONNACK Session Present) and is gone
// once the interval has passed.
func TestMQTT_3_1_2_23_SessionExpiry(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory())
	c := dialRaw(t, s, "expiring", rawOpts{cleanStart: true, sessionExpiry: 1, noSubscribe: true})
	c.subscribe("exp/#", 1)
	c.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the disconnect", func() bool { return s.Broker().ClientsConnected() == 0 })
	conn := dialTCP(t, s.Addr())
	back, ack, err := connectRaw(t, "expiring", rawOpts{conn: conn, sessionExpiry: 1, noSubscribe: true})
	if err != nil || !ack.SessionPresent {
		t.Fatalf("reconnect within the interval: %v, session present %v", err, ack != nil && ack.SessionPresent)
	}
	back.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the disconnect", func() bool { return s.Broker().ClientsConnected() == 0 })
	eventuallyWithin(t, 10*time.Second, "the session's expiry", func() bool { return !s.Broker().HasSession("expiring") })
	conn = dialTCP(t, s.Addr())
	if _, ack, err := connectRaw(t, "expiring", rawOpts{conn: conn, sessionExpiry: 1, noSubscribe: true}); err != nil || ack.SessionPresent {
		t.Fatalf("reconnect after the interval: %v, session present %v", err, ack != nil && ack.SessionPresent)
	}
}
