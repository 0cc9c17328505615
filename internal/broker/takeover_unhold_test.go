package broker

import (
	"fmt"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
)

// TestHeldMessageKeepsItsExpiry: a message mochi held back for the
// client's Receive Maximum during a session takeover (its record's Expiry
// -1) leaves with at most the Message Expiry Interval it was published
// with (MQTT-3.3.2-6). unhold computed its expiry from Created, which is
// the sequencer's order number (nanoseconds since the epoch, or 0..n-1
// after a renumber), not a Unix second: it left with an interval of
// billions of seconds, or was taken for expired.
func TestHeldMessageKeepsItsExpiry(t *testing.T) {
	b := startTestBroker(t, "")
	rm := uint16(2)
	props := offlineSession(t, b, &packets.Properties{ReceiveMaximum: &rm})

	pub := dialR(t, b.Addr(), packets.Connect{ClientID: "pub", CleanStart: true})
	life := uint32(3600)
	for i := range 300 {
		pub.send(&packets.Publish{PacketID: uint16(i + 1), QoS: 1, Topic: "t/x", Payload: []byte("old"),
			Properties: &packets.Properties{MessageExpiry: &life}})
		pub.next()
	}
	go func() {
		for {
			pub.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := packets.ReadPacket(pub.conn); err != nil {
				return
			}
		}
	}()
	bad, n := 0, 0
	for round := 0; round < 20 && bad == 0; round++ {
		go func() {
			for i := 0; i < 800; i++ {
				p := &packets.Publish{PacketID: uint16(i%60000 + 1), QoS: 1, Topic: "t/x", Payload: []byte(fmt.Sprint(round, "/", i)),
					Properties: &packets.Properties{MessageExpiry: &life}}
				if _, err := p.WriteTo(pub.conn); err != nil {
					return
				}
			}
		}()
		time.Sleep(time.Millisecond)
		c := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false, Properties: props})
		for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); {
			c.conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
			cp, err := packets.ReadPacket(c.conn)
			if err != nil {
				break
			}
			p, ok := cp.Content.(*packets.Publish)
			if !ok {
				continue
			}
			n++
			if p.Properties == nil || p.Properties.MessageExpiry == nil || *p.Properties.MessageExpiry > life {
				bad++
				if bad <= 3 {
					var e any = nil
					if p.Properties != nil && p.Properties.MessageExpiry != nil {
						e = *p.Properties.MessageExpiry
					}
					t.Logf("round %d: message %q id %d: Message Expiry Interval %v (published with %d)", round, p.Payload, p.PacketID, e, life)
				}
			}
			c.send(&packets.Puback{PacketID: p.PacketID})
		}
		c.conn.Close()
		eventuallyR(t, "offline", func() bool { return b.ClientsConnected() <= 1 })
	}
	if bad > 0 {
		t.Errorf("%d of %d messages left with a Message Expiry Interval above the %d s they were published with", bad, n, life)
	}
}
