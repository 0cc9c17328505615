package e2e

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
)

func withLimits(l server.Limits) serverOption {
	return func(c *server.Config) { c.Limits = l }
}

func TestQuotaKeysAndBytes(t *testing.T) {
	skipInCluster(t, "each group enforces its share of --max-keys and --max-bytes")
	s := startServer(t, withLimits(server.Limits{MaxKeys: 3, MaxBytes: 40}))
	c := dialRaw(t, s, "quota", rawOpts{cleanStart: true})
	for _, k := range []string{"k1", "k2", "k3"} {
		expectPayload(t, c.call("SET", k, "0123456789"), "+OK\r\n") // 12 bytes each
	}
	expectPayload(t, c.call("SET", "k4", "x"), "-ERR the quota has been exceeded\r\n")
	expectPayload(t, c.call("SET", "k1", "abcdefghij"), "+OK\r\n")                                    // same size: fits
	expectPayload(t, c.call("SET", "k1", "abcdefghijklmnop"), "-ERR the quota has been exceeded\r\n") // 36+6 > 40
	// Quota errors change nothing.
	expectPayload(t, c.call("GET", "k1"), "$10\r\nabcdefghij\r\n")
	expectPayload(t, c.call("GET", "k4"), "$-1\r\n")
	// Deleting makes room.
	expectPayload(t, c.call("DEL", "k2"), ":1\r\n")
	expectPayload(t, c.call("SET", "k4", "x"), "+OK\r\n")
	// Limits survive a restart with the same flags.
	s.Close()
	s2 := startServerIn(t, s.dir, withLimits(server.Limits{MaxKeys: 3, MaxBytes: 40}))
	c2 := dialRaw(t, s2, "quota", rawOpts{cleanStart: true})
	expectPayload(t, c2.call("SET", "k5", "x"), "-ERR the quota has been exceeded\r\n")
}

func TestQuotaKeyLengthAndRegistrations(t *testing.T) {
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxKeyLength: 8, MaxRegistrations: 2}))
	c := dialRaw(t, s, "limits", rawOpts{cleanStart: true})
	expectPayload(t, c.call("SET", "12345678", "v"), "+OK\r\n")
	expectPayload(t, c.call("SET", "123456789", "v"), "-ERR the quota has been exceeded\r\n")
	expectPayload(t, c.call("GET", "123456789"), "-ERR the quota has been exceeded\r\n")
	expectPayload(t, c.call("KEYNOTIFY", "a"), "+OK\r\n")
	expectPayload(t, c.call("KEYNOTIFY", "b"), "+OK\r\n")
	expectPayload(t, c.call("KEYNOTIFY", "a"), "+OK\r\n") // already registered: no new slot
	expectPayload(t, c.call("KEYNOTIFY", "c"), "-ERR the quota has been exceeded\r\n")
	expectPayload(t, c.call("KEYNOTIFY", "a", "STOP"), "+OK\r\n")
	expectPayload(t, c.call("KEYNOTIFY", "c"), "+OK\r\n")
}

func TestMaxConnections(t *testing.T) {
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxConnections: 2}))
	dialRaw(t, s, "one", rawOpts{cleanStart: true, noSubscribe: true})
	dialRaw(t, s, "two", rawOpts{cleanStart: true, noSubscribe: true})
	conn := dialTCP(t, s.Addr())
	if _, ack, _ := connectRaw(t, "three", rawOpts{conn: conn}); ack == nil || ack.ReasonCode != 0x89 {
		t.Fatalf("third connection: CONNACK %+v, want 0x89 (server busy)", ack)
	}
}

// TestMaxSessions: sessions outlive their connections (for up to
// --max-session-expiry), so their number is bounded apart from
// connections: a client id new beyond --max-sessions is refused with
// 0x97, while a client resuming its own session is let in.
func TestMaxSessions(t *testing.T) {
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxSessions: 4}))
	var kept []string
	for i := 0; ; i++ {
		id := fmt.Sprint("session-", i)
		c, ack, _ := connectRaw(t, id, rawOpts{cleanStart: true, sessionExpiry: 300, noSubscribe: true, conn: dialTCP(t, s.Addr())})
		if c == nil {
			if ack == nil || ack.ReasonCode != 0x97 {
				t.Fatalf("session %d: CONNACK %+v, want 0x97 (quota exceeded)", i, ack)
			}
			break
		}
		if i == 4 {
			t.Fatal("a fifth session admitted")
		}
		kept = append(kept, id)
		c.c.Disconnect(&paho.Disconnect{})
	}
	if len(kept) != 4 {
		t.Fatalf("%d sessions admitted, want 4", len(kept))
	}
	eventually(t, "all offline", func() bool { return s.Broker().ClientsConnected() == 0 })
	if c, ack, _ := connectRaw(t, kept[0], rawOpts{sessionExpiry: 300, noSubscribe: true, conn: dialTCP(t, s.Addr())}); c == nil || !ack.SessionPresent {
		t.Fatalf("resuming %s: CONNACK %+v", kept[0], ack)
	}
}

func TestMaxPacketSize(t *testing.T) {
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxPacketSize: 4096}))
	conn := dialTCP(t, s.Addr())
	c, ack, err := connectRaw(t, "big", rawOpts{cleanStart: true, conn: conn})
	if err != nil {
		t.Fatal(err)
	}
	if ack.Properties == nil || ack.Properties.MaximumPacketSize == nil || *ack.Properties.MaximumPacketSize != 4096 {
		t.Fatalf("CONNACK maximum packet size %+v", ack.Properties)
	}
	// paho refuses to send what the server said it would not take; bypass
	// it with raw bytes: a PUBLISH that claims 1 MiB.
	raw := dialTCP(t, s.Addr())
	defer raw.Close()
	raw.Write(connectPacket("big-raw"))
	raw.Write([]byte{0x30, 0x80, 0x80, 0x40}) // PUBLISH, remaining length 1 MiB
	raw.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := readUntilClosed(raw); err != nil {
		t.Fatalf("oversized packet: connection not closed: %v", err)
	}
	expectPayload(t, c.call("PING"), "+PONG\r\n") // the server serves on
}

// TestOversizedConnectIsRefused: before a client has authenticated, the
// server reads at most 64 KiB from it, whatever --max-packet-size says.
func TestOversizedConnectIsRefused(t *testing.T) {
	s := startServer(t, inMemory())
	raw := dialTCP(t, s.Addr())
	defer raw.Close()
	// A well-formed CONNECT of 70 KB: username and password flags set.
	body := append(mqttString("MQTT"), 5, 0xc2, 0, 60, 0)
	body = append(body, mqttString("big-connect")...)
	body = append(body, mqttString(strings.Repeat("u", 10000))...)
	body = append(body, mqttString(strings.Repeat("p", 60000))...)
	go raw.Write(packet(0x10, body))
	raw.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := readUntilClosed(raw)
	if err != nil {
		t.Fatalf("oversized CONNECT: connection not closed: %v", err)
	}
	if n != 0 {
		t.Fatalf("oversized CONNECT: %d bytes answered, want none", n)
	}
	c := dialRaw(t, s, "after", rawOpts{cleanStart: true})
	expectPayload(t, c.call("PING"), "+PONG\r\n")
}

// TestSlowConsumerIsDisconnected: a client that stops reading is cut off
// (0x97) instead of making the server queue without bound.
func TestSlowConsumerIsDisconnected(t *testing.T) {
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxOutbound: 32}))
	slow := dialTCP(t, s.Addr())
	defer slow.Close()
	slow.Write(connectPacket("slow-reader"))
	slow.Write(subscribePacket("flood/#"))
	// Never read from slow again.
	pub := dialRaw(t, s, "flooder", rawOpts{cleanStart: true, noSubscribe: true})
	payload := make([]byte, 64<<10)
	ctx := ctxFor(t, 30*time.Second)
	for i := 0; s.Broker().Counters.SlowConsumers.Load() == 0; i++ {
		if i > 20000 {
			t.Fatal("slow consumer never disconnected")
		}
		if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "flood/x", QoS: 0, Payload: payload}); err != nil {
			t.Fatal(err)
		}
	}
	// The slow client's connection is closed by the server.
	slow.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := readUntilClosed(slow); err != nil {
		t.Fatalf("slow client still connected: %v", err)
	}
	other := dialRaw(t, s, "bystander", rawOpts{cleanStart: true})
	expectPayload(t, other.call("PING"), "+PONG\r\n")
}

// readUntilClosed drains conn until the peer closes it (nil) or the read
// deadline passes (an error).
func readUntilClosed(conn net.Conn) (int, error) {
	buf := make([]byte, 64<<10)
	total := 0
	for {
		n, err := conn.Read(buf)
		total += n
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				return total, err
			}
			return total, nil
		}
	}
}

// Hand-made MQTT v5 packets, for clients that misbehave on purpose.

func mqttString(s string) []byte { return append([]byte{byte(len(s) >> 8), byte(len(s))}, s...) }

func varint(n int) []byte {
	var b []byte
	for {
		c := byte(n % 128)
		n /= 128
		if n > 0 {
			c |= 0x80
		}
		b = append(b, c)
		if n == 0 {
			return b
		}
	}
}

func packet(typ byte, body []byte) []byte {
	return append(append([]byte{typ}, varint(len(body))...), body...)
}

func connectPacket(id string) []byte {
	body := append(mqttString("MQTT"), 5, 0x02, 0, 60, 0) // v5, clean start, keep-alive 60, no properties
	return packet(0x10, append(body, mqttString(id)...))
}

func subscribePacket(filter string) []byte {
	body := []byte{0, 1, 0} // packet id 1, no properties
	body = append(append(body, mqttString(filter)...), 0)
	return packet(0x82, body)
}

func publishPacket(topic string, payload []byte) []byte {
	body := append(mqttString(topic), 0) // QoS 0: no packet id; no properties
	return packet(0x30, append(body, payload...))
}

// TestOfflineSessionBounds: a persistent session is kept no longer than
// --max-session-expiry (the client is told in CONNACK) and holds at most
// --max-queued messages while its client is away.
func TestOfflineSessionBounds(t *testing.T) {
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxQueued: 5, MaxSessionExpiry: time.Minute}))
	conn := dialTCP(t, s.Addr())
	sub, ack, err := connectRaw(t, "away", rawOpts{conn: conn, cleanStart: true, sessionExpiry: 1 << 30, noSubscribe: true})
	if err != nil || ack.ReasonCode != 0 {
		t.Fatalf("connect: %v %+v", err, ack)
	}
	if ack.Properties == nil || ack.Properties.SessionExpiryInterval == nil || *ack.Properties.SessionExpiryInterval != 60 {
		t.Fatalf("CONNACK session expiry %+v, want the 60 s cap", ack.Properties)
	}
	sub.subscribe("queued/#", 1)
	sub.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the subscriber's disconnect", func() bool { return s.Broker().ClientsConnected() == 0 })

	pub := dialRaw(t, s, "producer", rawOpts{cleanStart: true, noSubscribe: true})
	ctx := ctxFor(t, 10*time.Second)
	for i := 0; i < 20; i++ {
		if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "queued/x", QoS: 1, Payload: []byte{byte(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	// mochi acknowledges a QoS 1 PUBLISH before routing it: wait for the
	// last one to be refused.
	eventually(t, "15 messages refused for the full session", func() bool { return s.Broker().Traffic().QueueFull == 15 })
	back := dialRaw(t, s, "away", rawOpts{sessionExpiry: 60, noSubscribe: true})
	for i := 0; i < 5; i++ {
		select {
		case p := <-back.inbox:
			if int(p.Payload[0]) != i {
				t.Fatalf("queued message %d arrived as #%d", p.Payload[0], i)
			}
		case <-ctx.Done():
			t.Fatalf("%d of the 5 queued messages arrived", i)
		}
	}
	select {
	case p := <-back.inbox:
		t.Fatalf("extra message %d", p.Payload[0])
	case <-time.After(time.Second):
	}
}
