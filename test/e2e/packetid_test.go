package e2e

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
)

// wire is a hand-driven MQTT v5 connection: the test decides every packet
// id and when (or whether) to acknowledge.
type wire struct {
	t    *testing.T
	conn net.Conn
}

func (w *wire) send(p interface {
	WriteTo(io.Writer) (int64, error)
}) {
	w.t.Helper()
	if _, err := p.WriteTo(w.conn); err != nil {
		w.t.Fatal(err)
	}
}

func (w *wire) next() *packets.ControlPacket {
	w.t.Helper()
	w.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	p, err := packets.ReadPacket(w.conn)
	if err != nil {
		w.t.Fatalf("read: %v", err)
	}
	return p
}

// dialWire connects a hand-driven client with the given CONNECT (MQTT 5,
// keep-alive 30 s) and returns it with its CONNACK, which must accept it.
func dialWire(t *testing.T, s interface{ Addr() string }, c packets.Connect) (*wire, *packets.Connack) {
	t.Helper()
	w := &wire{t: t, conn: dialTCP(t, s.Addr())}
	c.ProtocolName, c.ProtocolVersion, c.KeepAlive = "MQTT", 5, 30
	w.send(&c)
	ack, ok := w.next().Content.(*packets.Connack)
	if !ok || ack.ReasonCode != 0 {
		t.Fatalf("CONNACK: %+v", ack)
	}
	return w, ack
}

// subscribe subscribes to filter at QoS 1 under id, which must be granted.
func (w *wire) subscribe(id uint16, filter string) {
	w.t.Helper()
	w.send(&packets.Subscribe{PacketID: id, Subscriptions: []packets.SubOptions{{Topic: filter, QoS: 1}}})
	if ack, ok := w.next().Content.(*packets.Suback); !ok || ack.PacketID != id || len(ack.Reasons) != 1 || ack.Reasons[0] != 1 {
		w.t.Fatalf("SUBACK for %s: %+v, want id %d granted QoS 1", filter, ack, id)
	}
}

// TestClientPacketIDsAreTheirOwn (MQTT-2.2.1-2, 2.2.1-3): a client resumes
// a session with QoS 1 messages queued for it, and before acknowledging
// them uses the same packet ids for its own SUBSCRIBE, UNSUBSCRIBE, QoS 1
// and QoS 2 PUBLISH, as mosquitto_sub -c does. Each is answered under the
// client's id as if the server's messages were not there, and the server's
// messages are still delivered, acknowledged and not lost.
func TestClientPacketIDsAreTheirOwn(t *testing.T) {
	s := startServer(t, inMemory())
	sub := dialRaw(t, s, "resumer", rawOpts{cleanStart: true, sessionExpiry: 300, noSubscribe: true})
	sub.subscribe("a/#", 1)
	sub.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the subscriber's disconnect", func() bool { return s.Broker().ClientsConnected() == 0 })
	pub := dialRaw(t, s, "producer", rawOpts{cleanStart: true, noSubscribe: true})
	ctx := ctxFor(t, 10*time.Second)
	for _, topic := range []string{"a/1", "a/2", "a/3", "a/4"} {
		if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(topic)}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "4 messages queued", func() bool { return s.Broker().Traffic().Inflight == 4 })

	expiry := uint32(300)
	resume := packets.Connect{ClientID: "resumer", Properties: &packets.Properties{SessionExpiryInterval: &expiry}}
	w, ack := dialWire(t, s, resume)
	if !ack.SessionPresent {
		t.Fatalf("CONNACK: %+v, want the session present", ack)
	}
	queued := map[uint16]string{}
	for len(queued) < 4 {
		p, ok := w.next().Content.(*packets.Publish)
		if !ok {
			t.Fatalf("want the queued PUBLISHes first")
		}
		queued[p.PacketID] = p.Topic
	}
	for id := uint16(1); id <= 4; id++ {
		if queued[id] == "" {
			t.Fatalf("queued messages carry ids %v, want 1..4", queued)
		}
	}

	// The client's own packets, under the ids of the unacknowledged ones.
	w.subscribe(1, "b/#")
	w.subscribe(2, "c/#")
	w.send(&packets.Unsubscribe{PacketID: 2, Topics: []string{"c/#"}})
	if ack, ok := w.next().Content.(*packets.Unsuback); !ok || ack.PacketID != 2 || ack.Reasons[0] != 0 {
		t.Fatalf("UNSUBACK: %+v, want id 2 success", ack)
	}
	// QoS 1 PUBLISH id 3 to b/x: acknowledged as 3, and delivered back
	// through the new b/# subscription (the server numbers it itself).
	w.send(&packets.Publish{PacketID: 3, QoS: 1, Topic: "b/x", Payload: []byte("mine")})
	var echoed *packets.Publish
	acked := false
	for echoed == nil || !acked { // in either order
		switch c := w.next().Content.(type) {
		case *packets.Puback:
			if c.PacketID != 3 || c.ReasonCode != 0 {
				t.Fatalf("PUBACK %+v, want id 3 success", c)
			}
			acked = true
		case *packets.Publish:
			echoed = c
		default:
			t.Fatalf("unexpected %T", c)
		}
	}
	if echoed.Topic != "b/x" || queued[echoed.PacketID] != "" {
		t.Fatalf("own message came back as %s id %d, colliding with a queued one", echoed.Topic, echoed.PacketID)
	}
	// QoS 2 PUBLISH id 4: PUBREC 4, PUBREL 4, PUBCOMP 4.
	w.send(&packets.Publish{PacketID: 4, QoS: 2, Topic: "elsewhere", Payload: []byte("q2")})
	if rec, ok := w.next().Content.(*packets.Pubrec); !ok || rec.PacketID != 4 || rec.ReasonCode >= 0x80 {
		t.Fatalf("PUBREC %+v, want id 4", rec)
	}
	w.send(&packets.Pubrel{PacketID: 4})
	if comp, ok := w.next().Content.(*packets.Pubcomp); !ok || comp.PacketID != 4 || comp.ReasonCode != 0 {
		t.Fatalf("PUBCOMP %+v, want id 4 success", comp)
	}

	// The server's messages are acknowledged, all but the one whose id the
	// client's QoS 1 PUBLISH reused: after a reconnect exactly that one is
	// sent again (it was not dropped from the session when the client's
	// PUBLISH 3 was acknowledged), and the new subscription is there.
	for id := range queued {
		if id != 3 {
			w.send(&packets.Puback{PacketID: id})
		}
	}
	w.send(&packets.Puback{PacketID: echoed.PacketID})
	w.conn.Close()
	eventually(t, "the resumer's disconnect", func() bool { return s.Broker().ClientsConnected() == 1 })
	if w, ack = dialWire(t, s, resume); !ack.SessionPresent {
		t.Fatalf("second CONNACK: %+v", ack)
	}
	if p, ok := w.next().Content.(*packets.Publish); !ok || p.Topic != queued[3] {
		t.Fatalf("resent after reconnect: %+v, want %s", p, queued[3])
	} else {
		w.send(&packets.Puback{PacketID: p.PacketID})
	}
	if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "b/later", QoS: 1, Payload: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if p, ok := w.next().Content.(*packets.Publish); !ok || p.Topic != "b/later" {
		t.Fatalf("after the reconnect: %+v, want b/later", p)
	}
}
