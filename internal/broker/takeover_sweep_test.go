package broker

import (
	"sync/atomic"
	"testing"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	mpackets "github.com/mochi-mqtt/server/v2/packets"

	"github.com/eclipse/paho.golang/packets"
)

// sweepDuringHandover runs, once, what mochi's event loop runs every second
// (Server.clearExpiredInflights, server.go:1734-1742: ClearExpiredInflights,
// then OnQosDropped again with an empty packet per id) at the moment the
// session's messages are being cleared from the old connection, as if the
// sweep's tick fell in that instant, with the clock at `at`.
type sweepDuringHandover struct {
	mqtt.HookBase
	h    *hook
	at   int64
	done atomic.Bool
}

func (s *sweepDuringHandover) ID() string { return "test-sweep" }
func (s *sweepDuringHandover) Provides(b byte) bool {
	return b == mqtt.OnQosDropped
}
func (s *sweepDuringHandover) OnQosDropped(cl *mqtt.Client, _ mpackets.Packet) {
	if !cl.IsTakenOver() || s.done.Load() {
		return
	}
	expiring := false
	for _, m := range cl.State.Inflight.GetAll(false) {
		expiring = expiring || m.Expiry > 0 && m.Expiry < s.at
	}
	if !expiring || !s.done.CompareAndSwap(false, true) {
		return // not yet the sweep's moment: the expiring message was cleared first
	}
	for _, id := range cl.ClearExpiredInflights(s.at, 0) { // calls the hooks' OnQosDropped(cl, tk) itself
		s.h.OnQosDropped(cl, mpackets.Packet{PacketID: id}) // the loop's second call (the session store has none in memory)
	}
}

// TestExpirySweepDuringHandover: mochi's expiry sweep reports each
// expired message a second time as OnQosDropped(client, Packet{PacketID:
// id}). During a hand-over, hook.OnQosDropped took that empty packet for
// a message not copied and set it into the new connection's session;
// mochi's resend then failed on it (no valid packet type), and the
// connection ended right after its CONNACK, on every later resume too.
// Now an empty packet is ignored.
func TestExpirySweepDuringHandover(t *testing.T) {
	b := startTestBroker(t, "")
	props := offlineSession(t, b, nil)

	pub := dialR(t, b.Addr(), packets.Connect{ClientID: "pub", CleanStart: true})
	life := uint32(30)
	for i := range 10 {
		pub.send(&packets.Publish{PacketID: uint16(2 + i), QoS: 1, Topic: "t/x", Payload: []byte("kept")})
		pub.next()
	}

	pub.send(&packets.Publish{PacketID: 1, QoS: 1, Topic: "t/x", Payload: []byte("short-lived"),
		Properties: &packets.Properties{MessageExpiry: &life}})
	pub.next()
	sw := &sweepDuringHandover{h: &hook{b: b}, at: time.Now().Unix() + int64(life) + 1}
	if err := b.srv.AddHook(sw, nil); err != nil {
		t.Fatal(err)
	}
	for attempt := range 3 {
		c := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false,
			Properties: props})
		var got []string
		c.conn.SetReadDeadline(time.Now().Add(time.Second))
		c.send(&packets.Pingreq{})
		ended := false
		for {
			c.conn.SetReadDeadline(time.Now().Add(time.Second))
			cp, err := packets.ReadPacket(c.conn)
			if err != nil {
				ended = err.Error() == "EOF"
				break
			}
			if p, ok := cp.Content.(*packets.Publish); ok {
				got = append(got, string(p.Payload))
				c.send(&packets.Puback{PacketID: p.PacketID})
			}
			if _, ok := cp.Content.(*packets.Pingresp); ok {
				break
			}
		}
		t.Logf("resume %d: received %v, connection ended by the server: %v", attempt, got, ended)
		if ended {
			t.Errorf("resume %d: the server closed the connection after CONNACK", attempt)
		}
		c.conn.Close()
		eventuallyR(t, "offline", func() bool { return b.ClientsConnected() <= 1 })
	}
	if cur, ok := b.srv.Clients.Get("s"); ok {
		for _, m := range cur.State.Inflight.GetAll(false) {
			if m.FixedHeader.Type != mpackets.Publish {
				t.Errorf("the session holds a record of packet type %d under id %d", m.FixedHeader.Type, m.PacketID)
			}
		}
	}
}
