package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
)

// Messages a client publishes are written to the subscribers by the
// publisher's own connection when they can be, else routed by mochi's
// per-client queues (internal/broker/direct.go). These tests hold the
// MQTT guarantees across the two paths.

// TestMessagesKeepOrderAcrossTheTwoPaths (MQTT-4.6.0-2, 4.6.0-6): a
// subscriber that reads in bursts keeps
// sending messages from the direct path to mochi's queue (its socket is
// full) and back; the publisher, also subscribed, reads its own messages
// as they come. Every message reaches both once and in order, and the
// publisher's PUBACKs come in the order of its PUBLISHes.
func TestMessagesKeepOrderAcrossTheTwoPaths(t *testing.T) {
	s := startServer(t, inMemory())
	const n = 600
	sub, _ := dialWire(t, s, packets.Connect{ClientID: "slow-sub", CleanStart: true})
	if tc, ok := sub.conn.(*net.TCPConn); ok {
		// A small window: the server's socket fills whatever the
		// machine's speed (on a loaded one the publisher was once
		// slower than the subscriber, and mochi's path never taken).
		tc.SetReadBuffer(16 << 10)
	}
	sub.subscribe(1, "order/#")
	pub, _ := dialWire(t, s, packets.Connect{ClientID: "self-sub", CleanStart: true})
	pub.subscribe(1, "order/#")
	direct := s.Broker().Counters.DeliveredDirect.Load()
	payload := make([]byte, 32<<10) // 19 MB in all: more than the sockets hold

	// The subscriber: checks the order, acknowledges, and now and then
	// takes its time, so that its four slots fill.
	subDone := make(chan error, 1)
	// It reads nothing until half the messages are published: its socket
	// and the server's fill (9.6 MB against a 16 KB window) whatever the
	// machine's speed, so that mochi's path is taken (under CI's load the
	// publisher was once slower than the subscriber all along).
	gate := make(chan struct{})
	go func() {
		<-gate
		for want := uint32(0); want < n; want++ {
			sub.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			p, err := packets.ReadPacket(sub.conn)
			if err != nil {
				subDone <- fmt.Errorf("subscriber, waiting for %d: %v", want, err)
				return
			}
			m, ok := p.Content.(*packets.Publish)
			if !ok || binary.BigEndian.Uint32(m.Payload) != want {
				subDone <- fmt.Errorf("subscriber: got %s, want message %d", describe(p), want)
				return
			}
			if want%10 == 0 {
				time.Sleep(40 * time.Millisecond) // the socket fills meanwhile
			}
			if _, err := (&packets.Puback{PacketID: m.PacketID}).WriteTo(sub.conn); err != nil {
				subDone <- err
				return
			}
		}
		subDone <- nil
	}()

	// The publisher reads its PUBACKs and its own messages on one
	// connection while another goroutine writes.
	pubDone := make(chan error, 1)
	go func() {
		acks, own := uint16(1), uint32(0)
		for acks <= n || own < n {
			pub.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			p, err := packets.ReadPacket(pub.conn)
			if err != nil {
				pubDone <- fmt.Errorf("publisher, after %d acks and %d own messages: %v", acks-1, own, err)
				return
			}
			switch m := p.Content.(type) {
			case *packets.Puback:
				if m.PacketID != acks {
					pubDone <- fmt.Errorf("PUBACK %d, want %d: out of order", m.PacketID, acks)
					return
				}
				acks++
			case *packets.Publish:
				if binary.BigEndian.Uint32(m.Payload) != own {
					pubDone <- fmt.Errorf("publisher's own: got %s, want message %d", describe(p), own)
					return
				}
				own++
				if _, err := (&packets.Puback{PacketID: m.PacketID}).WriteTo(pub.conn); err != nil {
					pubDone <- err
					return
				}
			default:
				pubDone <- fmt.Errorf("publisher: unexpected %v", p)
				return
			}
		}
		pubDone <- nil
	}()
	for i := uint32(0); i < n; i++ {
		if i == n/2 {
			close(gate)
		}
		binary.BigEndian.PutUint32(payload, i)
		m := &packets.Publish{QoS: 1, PacketID: uint16(i + 1), Topic: "order/x", Payload: payload}
		if _, err := m.WriteTo(pub.conn); err != nil {
			t.Fatal(err)
		}
	}
	for _, done := range []chan error{subDone, pubDone} {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	switch d := s.Broker().Counters.DeliveredDirect.Load() - direct; {
	case d == 0:
		t.Fatal("no message was written directly: the test saw only mochi's path")
	case d == 2*n:
		t.Fatal("every message was written directly: the test never saw mochi's path")
	}
}

// TestSharedSubscriptionsAreWrittenDirectly: a topic with a shared
// subscription and a plain one: each message reaches the group's member
// and the plain subscriber, both written to directly (mochi routed every
// topic with a shared subscription before the broker routed everything);
// once the group is gone, the plain subscriber alone.
func TestSharedSubscriptionsAreWrittenDirectly(t *testing.T) {
	s := startServer(t, inMemory())
	member, _ := dialWire(t, s, packets.Connect{ClientID: "member", CleanStart: true})
	member.subscribe(1, "$share/g/sh/t")
	plain, _ := dialWire(t, s, packets.Connect{ClientID: "plain", CleanStart: true})
	plain.subscribe(1, "sh/t")
	pub, _ := dialWire(t, s, packets.Connect{ClientID: "pub", CleanStart: true})
	direct := s.Broker().Counters.DeliveredDirect.Load()

	pub.send(&packets.Publish{QoS: 1, PacketID: 1, Topic: "sh/t", Payload: []byte("one")})
	if _, ok := pub.next().Content.(*packets.Puback); !ok {
		t.Fatal("no PUBACK")
	}
	for _, w := range []*wire{member, plain} {
		m, ok := w.next().Content.(*packets.Publish)
		if !ok || string(m.Payload) != "one" {
			t.Fatalf("got %v, want the message", m)
		}
		w.send(&packets.Puback{PacketID: m.PacketID})
	}
	if got := s.Broker().Counters.DeliveredDirect.Load(); got != direct+2 {
		t.Fatalf("%d messages written directly, want 2", got-direct)
	}

	member.send(&packets.Unsubscribe{PacketID: 2, Topics: []string{"$share/g/sh/t"}})
	if _, ok := member.next().Content.(*packets.Unsuback); !ok {
		t.Fatal("no UNSUBACK")
	}
	pub.send(&packets.Publish{QoS: 1, PacketID: 2, Topic: "sh/t", Payload: []byte("two")})
	if m, ok := plain.next().Content.(*packets.Publish); !ok || string(m.Payload) != "two" {
		t.Fatalf("got %v, want the second message", m)
	}
	member.conn.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if p, err := packets.ReadPacket(member.conn); err == nil {
		t.Fatalf("the group's former member got %v", p)
	}
}

// TestSlowSubscriberDoesNotStallThePublisher: a subscriber that stops
// reading fills its socket; the publisher, whose connection writes to
// that socket directly while it can, still gets every PUBACK at once,
// and another subscriber every message.
func TestSlowSubscriberDoesNotStallThePublisher(t *testing.T) {
	s := startServer(t, inMemory())
	stuck, _ := dialWire(t, s, packets.Connect{ClientID: "stuck", CleanStart: true})
	stuck.subscribe(1, "big/#") // and never reads again
	reader, _ := dialWire(t, s, packets.Connect{ClientID: "reader", CleanStart: true})
	reader.subscribe(1, "big/#")
	pub, _ := dialWire(t, s, packets.Connect{ClientID: "big-pub", CleanStart: true})

	const n = 300 // 19 MB: more than any socket buffer holds
	payload := make([]byte, 64<<10)
	got := make(chan error, 1)
	go func() {
		for i := 0; i < n; i++ {
			reader.conn.SetReadDeadline(time.Now().Add(writeStall))
			p, err := packets.ReadPacket(reader.conn)
			if err != nil {
				got <- fmt.Errorf("reader, message %d: %v", i, err)
				return
			}
			m, ok := p.Content.(*packets.Publish)
			if !ok || binary.BigEndian.Uint32(m.Payload) != uint32(i) {
				got <- fmt.Errorf("reader: message %d out of order or missing", i)
				return
			}
			(&packets.Puback{PacketID: m.PacketID}).WriteTo(reader.conn)
		}
		got <- nil
	}()
	for i := 0; i < n; i++ {
		binary.BigEndian.PutUint32(payload, uint32(i))
		pub.send(&packets.Publish{QoS: 1, PacketID: uint16(i + 1), Topic: "big/x", Payload: payload})
		pub.conn.SetReadDeadline(time.Now().Add(writeStall))
		p, err := packets.ReadPacket(pub.conn)
		if err != nil {
			pprof.Lookup("goroutine").WriteTo(os.Stderr, 1)
			t.Fatalf("PUBACK %d: %v (the publisher waits on the stuck subscriber)", i+1, err)
		}
		if a, ok := p.Content.(*packets.Puback); !ok || a.PacketID != uint16(i+1) {
			t.Fatalf("got %v, want PUBACK %d", p, i+1)
		}
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}

// writeStall is well under the server's write timeout (10 s), which a
// publisher waiting on a stuck subscriber's socket would wait out.
const writeStall = 4 * time.Second

// describe names a packet the order tests got: a numbered message by its
// number.
func describe(p *packets.ControlPacket) string {
	if m, ok := p.Content.(*packets.Publish); ok && len(m.Payload) >= 4 {
		return fmt.Sprintf("message %d (id %d, dup %v)", binary.BigEndian.Uint32(m.Payload), m.PacketID, m.Duplicate)
	}
	return p.String()
}

// limitedSubscriber connects a hand-driven client with Receive Maximum
// recv, subscribed to filter at QoS 1.
func limitedSubscriber(t *testing.T, s interface{ Addr() string }, id string, recv uint16, filter string) *wire {
	t.Helper()
	w, _ := dialWire(t, s, packets.Connect{ClientID: id, CleanStart: true, Properties: &packets.Properties{ReceiveMaximum: &recv}})
	w.subscribe(1, filter)
	return w
}

// TestReceiveMaximumSlotsComeBack (MQTT-3.3.4-7, -9): messages held back
// while a client's Receive Maximum is used up are sent as its PUBACKs give
// slots back, and each PUBACK of a held message gives its slot back too.
// mochi v2.7.9 forgot a held message once sent, so its PUBACK freed
// nothing, and after Receive Maximum of them the client got no more.
func TestReceiveMaximumSlotsComeBack(t *testing.T) {
	s := startServer(t, inMemory())
	sub := limitedSubscriber(t, s, "recv-max-2", 2, "held/#")
	pub, _ := dialWire(t, s, packets.Connect{ClientID: "held-pub", CleanStart: true})
	const n = 40
	for i := 0; i < n; i++ { // all at once: most are held
		pub.send(&packets.Publish{QoS: 1, PacketID: uint16(i + 1), Topic: "held/x", Payload: []byte{byte(i)}})
	}
	got := map[byte]bool{}
	for len(got) < n {
		m, ok := sub.next().Content.(*packets.Publish)
		if !ok {
			t.Fatalf("after %d messages: got %T, want a PUBLISH", len(got), m)
		}
		if got[m.Payload[0]] {
			t.Fatalf("message %d twice", m.Payload[0])
		}
		got[m.Payload[0]] = true
		sub.send(&packets.Puback{PacketID: m.PacketID})
	}
	if s.Broker().Traffic().Inflight != 0 {
		// Every message was acknowledged: none may be left in flight.
		eventually(t, "no message left in flight", func() bool { return s.Broker().Traffic().Inflight == 0 })
	}
}

// TestHeldMessagesKeepTheirOrder (MQTT-4.6.0-6, MQTT-3.3.4-9): publishers
// send bursts at once to a subscriber whose Receive Maximum is 2, so most
// messages wait in its session for a slot. The slot each PUBACK frees goes
// to the oldest message held: none routed meanwhile overtakes one held
// before it, each publisher's messages arrive in the order sent, and the
// subscriber never has more than 2 unacknowledged.
func TestHeldMessagesKeepTheirOrder(t *testing.T) {
	s := startServer(t, inMemory())
	sub := limitedSubscriber(t, s, "recv-max-order", 2, "order/#")
	const pubs, n = 4, 250
	expiry := uint32(600)
	for p := range pubs {
		w, _ := dialWire(t, s, packets.Connect{ClientID: fmt.Sprint("order-pub-", p), CleanStart: true})
		go func() {
			for i := range n {
				// Written one by one, as acknowledged: the publishers'
				// messages interleave at the server, each routed while
				// others are held. (Errors end the goroutine: the test
				// fails on what the subscriber misses.)
				pk := &packets.Publish{QoS: 1, PacketID: uint16(i + 1), Topic: fmt.Sprint("order/", p),
					Payload: []byte{byte(i >> 8), byte(i)}, Properties: &packets.Properties{MessageExpiry: &expiry}}
				if _, err := pk.WriteTo(w.conn); err != nil {
					return
				}
				if ack, err := packets.ReadPacket(w.conn); err != nil || ack.Type != packets.PUBACK {
					return
				}
			}
		}()
	}
	next := map[string]int{}
	unacked := map[uint16]bool{}
	for got := 0; got < pubs*n; got++ {
		m, ok := sub.next().Content.(*packets.Publish)
		if !ok {
			t.Fatalf("after %d messages: got %T, want a PUBLISH", got, m)
		}
		if seq := int(m.Payload[0])<<8 | int(m.Payload[1]); seq != next[m.Topic] {
			t.Fatalf("message %d of %s arrived when %d was due", seq, m.Topic, next[m.Topic])
		}
		next[m.Topic]++
		if m.Properties == nil || m.Properties.MessageExpiry == nil || *m.Properties.MessageExpiry == 0 || *m.Properties.MessageExpiry > expiry {
			t.Fatalf("message %d of %s: expiry interval %v, want (0, %d]", got, m.Topic, m.Properties.MessageExpiry, expiry)
		}
		unacked[m.PacketID] = true
		if len(unacked) > 2 {
			t.Fatalf("%d messages unacknowledged, over the Receive Maximum of 2", len(unacked))
		}
		// Acknowledged in batches of two, after both arrived: each PUBACK
		// frees a slot while messages are held.
		if len(unacked) == 2 || got == pubs*n-1 {
			for id := range unacked {
				sub.send(&packets.Puback{PacketID: id})
				delete(unacked, id)
			}
		}
	}
}

// TestHeldMessageExpires (MQTT-3.3.2-5, MQTT-3.3.2-6): a message held for
// the subscriber's Receive Maximum past its expiry interval is not
// delivered; one still valid is sent with what is left of its interval.
func TestHeldMessageExpires(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory())
	sub := limitedSubscriber(t, s, "recv-max-expiry", 1, "expiring/#")
	pub, _ := dialWire(t, s, packets.Connect{ClientID: "expiring-pub", CleanStart: true})
	short, long := uint32(1), uint32(600)
	for i, e := range []*uint32{nil, &short, &long} {
		pub.send(&packets.Publish{QoS: 1, PacketID: uint16(i + 1), Topic: "expiring/x", Payload: []byte{byte(i)},
			Properties: &packets.Properties{MessageExpiry: e}})
		if _, ok := pub.next().Content.(*packets.Puback); !ok {
			t.Fatal("want a PUBACK")
		}
	}
	first, ok := sub.next().Content.(*packets.Publish)
	if !ok || first.Payload[0] != 0 {
		t.Fatalf("first message %+v", first)
	}
	// The other two are held for the one slot. Expiry counts whole
	// seconds: after 2 s the short one has expired whenever it was made.
	time.Sleep(2100 * time.Millisecond)
	sub.send(&packets.Puback{PacketID: first.PacketID})
	m, ok := sub.next().Content.(*packets.Publish)
	if !ok || m.Payload[0] != 2 {
		t.Fatalf("after the expired one: %+v, want message 2", m)
	}
	if got := m.Properties.MessageExpiry; got == nil || *got >= long || *got < long-10 {
		t.Fatalf("expiry interval %v, want what is left of %d", got, long)
	}
	sub.send(&packets.Puback{PacketID: m.PacketID})
	eventually(t, "nothing left in flight", func() bool { return s.Broker().Traffic().Inflight == 0 })
}
