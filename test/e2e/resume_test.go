package e2e

import (
	"fmt"
	"testing"

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
