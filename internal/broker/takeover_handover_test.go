package broker

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
)

// TestAbortedTakeoverLeavesNoHandover: a connection that resumes a
// session with messages queued and goes away before mochi has established
// it (its CONNACK or resend write fails) never reaches
// OnSessionEstablished, nor OnDisconnect. Its b.handovers entry (old
// client → its takeover) is removed all the same (connEnded); before,
// every such connection kept two clients alive for good.
func TestAbortedTakeoverLeavesNoHandover(t *testing.T) {
	b := startTestBroker(t, "")
	props := offlineSession(t, b, nil)

	pub := dialR(t, b.Addr(), packets.Connect{ClientID: "pub", CleanStart: true})
	payload := bytes.Repeat([]byte("x"), 200)
	for i := range 500 {
		pub.send(&packets.Publish{PacketID: uint16(i + 1), QoS: 1, Topic: "t/x", Payload: payload})
		if _, ok := pub.next().Content.(*packets.Puback); !ok {
			t.Fatal("no PUBACK")
		}
	}

	pub.conn.Close()
	eventuallyR(t, "pub gone", func() bool { return b.ClientsConnected() == 0 })
	const attempts = 10
	for range attempts {
		resumeAndReset(t, b, props)
		for b.ClientsConnected() != 0 {
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The last one's connection may still be ending on a loaded machine:
	// an entry that is never removed shows as one still there after 5 s.
	for deadline := time.Now().Add(5 * time.Second); countMap(&b.handovers) != 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if n := countMap(&b.handovers); n != 0 {
		var desc []string
		b.handovers.Range(func(k, v any) bool { desc = append(desc, fmt.Sprintf("%p→%p", k, v.(*handover).next)); return true })
		t.Errorf("%d handovers entries left after %d aborted takeovers (none in progress): %v", n, attempts, desc)
	}

	// A good connection afterwards still gets the session's messages.
	w := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false,
		Properties: props})
	w.send(&packets.Pingreq{})
	for {
		if _, ok := w.next().Content.(*packets.Pingresp); ok {
			break
		}
	}
	if n := countMap(&b.handovers); n != 0 {
		t.Errorf("%d handovers entries still left after a successful takeover", n)
	}
}
