package broker

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	mqtt "github.com/mochi-mqtt/server/v2"
	mpackets "github.com/mochi-mqtt/server/v2/packets"
)

// ageMessages makes the messages of the connection being taken over past
// their expiry, as they are in the up-to-one-second window between their
// deadline and mochi's next expiry sweep (server.go:392, every second).
type ageMessages struct {
	mqtt.HookBase
	b *Broker
}

func (a *ageMessages) ID() string           { return "test-age" }
func (a *ageMessages) Provides(x byte) bool { return x == mqtt.OnSessionEstablish }
func (a *ageMessages) OnSessionEstablish(cl *mqtt.Client, _ mpackets.Packet) {
	prev, ok := a.b.srv.Clients.Get(cl.ID)
	if !ok || prev == cl {
		return
	}
	for _, m := range prev.State.Inflight.GetAll(false) {
		m.Expiry = time.Now().Unix() - 2
		prev.State.Inflight.Set(m)
	}
}

// TestExpiredCopyIsCounted: a session resumed while one of its messages
// is past its expiry but not yet swept. mochi copies it to the new
// connection and clears it from the old one (count -1): the copy is
// counted back, so when it is acknowledged (or swept) the count of
// messages in flight ends where the session's messages are.
func TestExpiredCopyIsCounted(t *testing.T) {
	b := startTestBroker(t, "")
	props := offlineSession(t, b, nil)

	pub := dialR(t, b.Addr(), packets.Connect{ClientID: "pub", CleanStart: true})
	life := uint32(60)
	pub.send(&packets.Publish{PacketID: 1, QoS: 1, Topic: "t/x", Payload: []byte("m"),
		Properties: &packets.Properties{MessageExpiry: &life}})
	pub.next()
	pub.conn.Close()
	eventuallyR(t, "pub offline", func() bool { return b.ClientsConnected() == 0 })
	if n := atomic.LoadInt64(&b.srv.Info.Inflight); n != 1 {
		t.Fatalf("in flight before the resume: %d", n)
	}
	if err := b.srv.AddHook(&ageMessages{b: b}, nil); err != nil {
		t.Fatal(err)
	}
	c := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false, Properties: props})
	c.send(&packets.Pingreq{})
	for pong := false; !pong; {
		switch p := c.next().Content.(type) {
		case *packets.Publish:
			c.send(&packets.Puback{PacketID: p.PacketID})
		case *packets.Pingresp:
			pong = true
		}
	}
	time.Sleep(1500 * time.Millisecond) // the sweep, if the ack did not take it
	cur, _ := b.srv.Clients.Get("s")
	if n, held := atomic.LoadInt64(&b.srv.Info.Inflight), cur.State.Inflight.Len(); n != int64(held) {
		t.Errorf("in-flight count %d, the session holds %d", n, held)
	}
}

// ackDuringClear plays the old connection's reader: at the takeover's
// ClearInflights it has just deleted message X (processPuback: Delete, count
// -1, server.go:1166-1168) after mochi's copy, and is about to call the
// OnQosComplete hooks, which it only reaches after the new connection's
// CONNACK was encoded (settle + renumber).
type ackDuringClear struct {
	mqtt.HookBase
	b    *Broker
	done atomic.Bool
	x    mpackets.Packet
}

func (a *ackDuringClear) ID() string           { return "test-ack" }
func (a *ackDuringClear) Provides(x byte) bool { return x == mqtt.OnQosDropped }
func (a *ackDuringClear) OnQosDropped(cl *mqtt.Client, pk mpackets.Packet) {
	if !cl.IsTakenOver() || !a.done.CompareAndSwap(false, true) {
		return
	}
	for _, m := range cl.State.Inflight.GetAll(false) {
		if m.PacketID == pk.PacketID {
			continue
		}
		cc := cl.Net.Conn.(*clientConn)
		cc.acking = messageOf(m) // OnPacketRead
		if cl.State.Inflight.Delete(m.PacketID) {
			atomic.AddInt64(&a.b.srv.Info.Inflight, -1)
			a.x = m
		}
		return
	}
}

// TestAckReportedAfterTheConnackIsCounted: the old connection's reader
// deletes a copied message it read an acknowledgement for, and reports the
// completion (OnQosComplete) only after the new connection's CONNACK
// renumbered the copies. The copy is still counted back: before, it was
// compared by the order number it had lost, and the count ended at -1.
func TestAckReportedAfterTheConnackIsCounted(t *testing.T) {
	b := startTestBroker(t, "")
	expiry := uint32(300)
	c1 := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: true,
		Properties: &packets.Properties{SessionExpiryInterval: &expiry}})
	c1.subscribe(1, "t/x")
	pub := dialR(t, b.Addr(), packets.Connect{ClientID: "pub", CleanStart: true})
	for i, p := range []string{"X", "Y"} {
		pub.send(&packets.Publish{PacketID: uint16(i + 1), QoS: 1, Topic: "t/x", Payload: []byte(p)})
		pub.next()
		c1.next() // received on c1, never acknowledged
	}
	prev, _ := b.srv.Clients.Get("s")
	a := &ackDuringClear{b: b}
	if err := b.srv.AddHook(a, nil); err != nil {
		t.Fatal(err)
	}
	c2 := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false,
		Properties: &packets.Properties{SessionExpiryInterval: &expiry}})
	if a.x.PacketID == 0 {
		t.Fatal("no message acknowledged during the hand-over")
	}
	// The old reader's OnQosComplete hooks, after the CONNACK.
	(&hook{b: b}).OnQosComplete(prev, mpackets.Packet{FixedHeader: mpackets.FixedHeader{Type: mpackets.Puback}, PacketID: a.x.PacketID})
	c2.send(&packets.Pingreq{})
	for pong := false; !pong; {
		switch p := c2.next().Content.(type) {
		case *packets.Publish:
			c2.send(&packets.Puback{PacketID: p.PacketID})
		case *packets.Pingresp:
			pong = true
		}
	}
	time.Sleep(100 * time.Millisecond)
	cur, _ := b.srv.Clients.Get("s")
	if n, held := atomic.LoadInt64(&b.srv.Info.Inflight), cur.State.Inflight.Len(); n != int64(held) {
		t.Errorf("in-flight count %d, the session holds %d", n, held)
	}
}
