package e2e

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
)

// TestResumedSessionKeepsItsQueueAcrossRestart: messages queued for an
// offline session, resent when it resumes and not yet acknowledged, are
// still in the session after the server restarts. (mochi moves them to
// the resuming connection and then drops them from the old one, which
// the session store must not take for their end.)
func TestResumedSessionKeepsItsQueueAcrossRestart(t *testing.T) {
	dir := t.TempDir()
	s := startServerIn(t, dir)
	expiry := uint32(3600)
	connect := func(clean bool) *wire {
		w, _ := dialWire(t, s, packets.Connect{ClientID: "keeper", CleanStart: clean,
			Properties: &packets.Properties{SessionExpiryInterval: &expiry}})
		return w
	}
	drop := func(w *wire) {
		w.conn.Close()
		eventually(t, "the drop noticed", func() bool { return s.Broker().ClientsConnected() == 0 })
	}
	w := connect(true)
	w.subscribe(1, "kept/#")
	drop(w)

	pub, _ := dialWire(t, s, packets.Connect{ClientID: "pub", CleanStart: true})
	const n = 3
	for i := range n {
		pub.send(&packets.Publish{PacketID: uint16(i + 1), QoS: 1, Topic: "kept/x", Payload: []byte(fmt.Sprint(i))})
		if ack, ok := pub.next().Content.(*packets.Puback); !ok || ack.PacketID != uint16(i+1) {
			t.Fatalf("publish %d: %+v", i, ack)
		}
	}
	pub.conn.Close()

	expect := func(when string) {
		t.Helper()
		for i := range n {
			p, ok := w.next().Content.(*packets.Publish)
			if !ok || string(p.Payload) != fmt.Sprint(i) {
				t.Fatalf("%s: message %d is %+v", when, i, p)
			}
		}
	}
	w = connect(false)
	expect("resumed")
	drop(w) // none acknowledged
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = startServerIn(t, dir)
	w = connect(false)
	expect("after the restart")
}

// TestSessionTakeoverLosesNoMessage: QoS 1 messages published to a
// persistent session while new connections keep taking it over all reach
// the client, and none before its CONNACK (MQTT-3.2.0-1). mochi (v2.7.9)
// copies the old connection's messages to the new one, re-adds the
// session's subscriptions (here 2,001, which widens that window), clears
// the old connection's messages, and only then routes the client id's
// messages to the new one: a message that reached the old connection
// after the copy was lost. And it registers the new connection before it
// writes the CONNACK, so the session's messages could go first.
func TestSessionTakeoverLosesNoMessage(t *testing.T) {
	s := startServer(t, inMemory())
	expiry := uint32(300)
	// connect resumes (or starts) the session and returns what the
	// server sent before its CONNACK.
	connect := func(clean bool) (*wire, []*packets.Publish) {
		w := &wire{t: t, conn: dialTCP(t, s.Addr())}
		w.send(&packets.Connect{ClientID: "taken", CleanStart: clean, ProtocolName: "MQTT", ProtocolVersion: 5, KeepAlive: 30,
			Properties: &packets.Properties{SessionExpiryInterval: &expiry}})
		var early []*packets.Publish
		for {
			switch p := w.next().Content.(type) {
			case *packets.Publish:
				early = append(early, p)
			case *packets.Connack:
				if p.ReasonCode != 0 {
					t.Fatalf("CONNACK %+v", p)
				}
				return w, early
			default:
				t.Fatalf("before CONNACK: %T", p)
			}
		}
	}
	w, _ := connect(true)
	w.subscribe(1, "taken/x")
	for i := range 4 {
		var subs []packets.SubOptions
		for j := range 500 {
			subs = append(subs, packets.SubOptions{Topic: fmt.Sprintf("filler/%d/%d/#", i, j), QoS: 1})
		}
		w.send(&packets.Subscribe{PacketID: uint16(2 + i), Subscriptions: subs})
		if _, ok := w.next().Content.(*packets.Suback); !ok {
			t.Fatal("no SUBACK")
		}
	}
	w.conn.Close()

	// The publisher sends the next message once the last is acknowledged,
	// and keeps at most 200 ahead of what the client has received: the
	// session never holds enough to reach --max-queued.
	pub, _ := dialWire(t, s, packets.Connect{ClientID: "taken-pub", CleanStart: true})
	var published atomic.Int64
	ahead := make(chan struct{}, 200)
	stop := make(chan struct{})
	pubDone := make(chan error, 1)
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				pubDone <- nil
				return
			case ahead <- struct{}{}:
			}
			id := uint16(i%60000 + 1)
			if _, err := (&packets.Publish{PacketID: id, QoS: 1, Topic: "taken/x", Payload: []byte(fmt.Sprint(i))}).WriteTo(pub.conn); err != nil {
				pubDone <- err
				return
			}
			pub.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			p, err := packets.ReadPacket(pub.conn)
			if err != nil {
				pubDone <- err
				return
			}
			if ack, ok := p.Content.(*packets.Puback); !ok || ack.PacketID != id || ack.ReasonCode != 0 {
				pubDone <- fmt.Errorf("publish %d answered %+v", i, p.Content)
				return
			}
			published.Add(1)
		}
	}()

	seen := map[string]bool{}
	take := func(w *wire, p *packets.Publish) {
		if !seen[string(p.Payload)] {
			seen[string(p.Payload)] = true
			<-ahead
		}
		w.send(&packets.Puback{PacketID: p.PacketID})
	}
	// readUntil acknowledges what comes until done says so.
	readUntil := func(w *wire, done func() bool) {
		for !done() {
			w.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			p, err := packets.ReadPacket(w.conn)
			if err != nil {
				// The publisher waits once 200 are not received.
				t.Fatalf("messages stopped coming (%v): %d received of %d published", err, len(seen), published.Load())
			}
			if m, ok := p.Content.(*packets.Publish); ok {
				take(w, m)
			}
		}
	}
	for range 20 {
		w, early := connect(false)
		if len(early) > 0 {
			t.Errorf("%d PUBLISH packets before the CONNACK", len(early))
		}
		for _, p := range early {
			take(w, p)
		}
		// mochi reads packets once it has established the session: the
		// PINGRESP says the hand-over is over before this connection
		// ends. (A connection that ends during its own hand-over is
		// another case, not this test's.)
		w.send(&packets.Pingreq{})
		for pong := false; !pong; {
			switch p := w.next().Content.(type) {
			case *packets.Publish:
				take(w, p)
			case *packets.Pingresp:
				pong = true
			}
		}
		got := len(seen)
		readUntil(w, func() bool { return len(seen) >= got+20 })
		w.conn.Close()
	}
	close(stop)
	if err := <-pubDone; err != nil {
		t.Fatal(err)
	}
	n := int(published.Load())
	w, early := connect(false)
	for _, p := range early {
		take(w, p)
	}
	missing := func() (m []int) {
		for i := range n {
			if !seen[fmt.Sprint(i)] {
				m = append(m, i)
			}
		}
		return m
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(missing()) > 0 && time.Now().Before(deadline) {
		w.conn.SetReadDeadline(deadline)
		p, err := packets.ReadPacket(w.conn)
		if err != nil {
			break
		}
		if m, ok := p.Content.(*packets.Publish); ok {
			take(w, m)
		}
	}
	if m := missing(); len(m) > 0 {
		t.Fatalf("%d of %d messages never delivered, the first %v (dropped for --max-queued: %d)", len(m), n, m[:min(len(m), 10)], s.Broker().Traffic().QueueFull)
	}
}
