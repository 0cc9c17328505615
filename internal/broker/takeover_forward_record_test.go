package broker

import (
	"sort"
	"testing"
	"time"

	mpackets "github.com/mochi-mqtt/server/v2/packets"

	"github.com/eclipse/paho.golang/packets"
)

// TestForwardedMessageKeepsTheRecords: a publisher that found the old
// connection just before the new one was registered queues its message
// there after the hand-over; mochi then calls the OnQosPublish hooks in
// the order they were added: mqkv's hook first (forwardIfTakenOver →
// move, which gives the message a new id), then the session store's,
// which recorded the message under its old id, the key of the new
// connection's own message there: after a restart that message was gone
// and the forwarded one came twice. The store now leaves a message the
// old connection no longer holds to move, which records it.
//
// The interleaving is made by hand: the publisher's part of mochi's
// publishToClient (NextPacketID, Inflight.Set, the OnQosPublish hooks in
// order) is run on the old connection once the takeover is done.
func TestForwardedMessageKeepsTheRecords(t *testing.T) {
	dir := t.TempDir()
	b := startTestBroker(t, dir)
	expiry := uint32(300)
	c1 := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: true,
		Properties: &packets.Properties{SessionExpiryInterval: &expiry}})
	c1.subscribe(1, "t/x")
	pub := dialR(t, b.Addr(), packets.Connect{ClientID: "pub", CleanStart: true})
	publish := func(id uint16, payload string) {
		pub.send(&packets.Publish{PacketID: id, QoS: 1, Topic: "t/x", Payload: []byte(payload)})
		if _, ok := pub.next().Content.(*packets.Puback); !ok {
			t.Fatal("no PUBACK")
		}
	}
	publish(1, "P") // id 1 on c1, never acknowledged
	if p, ok := c1.next().Content.(*packets.Publish); !ok || string(p.Payload) != "P" {
		t.Fatalf("c1 got %+v", p)
	}
	prev, _ := b.srv.Clients.Get("s")

	c2 := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false,
		Properties: &packets.Properties{SessionExpiryInterval: &expiry}})
	c2.send(&packets.Pingreq{})
	for pong := false; !pong; {
		if _, pong = c2.next().Content.(*packets.Pingresp); pong {
			break
		}
	}
	next, _ := b.srv.Clients.Get("s")
	if next == prev || !prev.IsTakenOver() {
		t.Fatal("no takeover")
	}
	publish(2, "B") // on c2: id 2 (1 is the resumed P)
	if p, ok := c2.next().Content.(*packets.Publish); !ok || string(p.Payload) != "B" || p.PacketID != 2 {
		t.Fatalf("c2 got %+v", p)
	}

	// The late publisher's message, as mochi's publishToClient queues it
	// on prev (whose own counter gives id 2 too).
	id, err := prev.NextPacketID()
	if err != nil {
		t.Fatal(err)
	}
	out := mpackets.Packet{FixedHeader: mpackets.FixedHeader{Type: mpackets.Publish, Qos: 1}, TopicName: "t/x",
		Payload: []byte("A"), PacketID: uint16(id), ProtocolVersion: 5, Origin: "pub"}
	b.seq.stamp(&out)
	t.Logf("late message A gets id %d on the old connection", id)
	if prev.State.Inflight.Set(out) {
		(&hook{b: b}).OnQosPublish(prev, out, out.Created, 0) // mqkv's hook, added first
		b.sessions.OnQosPublish(prev, out, out.Created, 0)    // the session store's
	}
	var live []string
	for _, m := range next.State.Inflight.GetAll(false) {
		live = append(live, string(m.Payload))
	}
	sort.Strings(live)
	t.Logf("in memory, the session holds %v", live)

	c2.conn.Close()
	pub.conn.Close()
	eventuallyR(t, "offline", func() bool { return b.ClientsConnected() == 0 })
	closeOnce(b)

	b = startTestBroker(t, dir)
	c3 := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false,
		Properties: &packets.Properties{SessionExpiryInterval: &expiry}})
	var got []string
	for {
		c3.conn.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		cp, err := packets.ReadPacket(c3.conn)
		if err != nil {
			break
		}
		if p, ok := cp.Content.(*packets.Publish); ok {
			got = append(got, string(p.Payload))
		}
	}
	sort.Strings(got)
	if len(got) != 3 || got[0] != "A" || got[1] != "B" || got[2] != "P" {
		t.Errorf("after a restart the session resends %v, want [A B P]", got)
	}
}
