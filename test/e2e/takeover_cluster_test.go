package e2e

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"
)

// One client id, one session, cluster-wide: a client whose persistent
// session on one node holds unacknowledged messages connects to another
// node. The first connection gets DISCONNECT 0x8E (session taken over),
// the second finds its session (Session Present), gets the messages again
// and goes on receiving on its subscription there; the first node holds
// the session no more.
func TestTakeoverAcrossNodes(t *testing.T) {
	t.Parallel()
	nodes := sharedCluster(t)
	first := dialPeer(t, nodes[0].Addr(), "roamer", peerOpts{clean: true, sessionExpiry: 300, manualAck: true})
	first.subscribe(subOpt{filter: "roam/#", qos: 1})
	pub := dialPeer(t, nodes[2].Addr(), "roam-pub", peerOpts{clean: true})
	for i := range 5 {
		pub.publish("roam/t", fmt.Sprint(i), pubOpt{qos: 1})
	}
	for i := range 5 {
		first.expect("roam/t", fmt.Sprint(i)) // not acknowledged
	}
	var present bool
	second := dialPeer(t, nodes[1].Addr(), "roamer", peerOpts{sessionExpiry: 300, sessionPresent: &present})
	first.expectDisconnect(0x8E)
	if !present {
		t.Fatal("the session did not come along: Session Present 0")
	}
	for i := range 5 {
		if m := second.expect("roam/t", fmt.Sprint(i)); !m.dup {
			t.Fatalf("message %d resent without DUP", i)
		}
	}
	pub.publish("roam/t", "after", pubOpt{qos: 1})
	second.expect("roam/t", "after")
	if nodes[0].Broker().HasSession("roamer") {
		t.Fatal("the first node still holds the session")
	}
	first.expectNone(0, "a message to the connection taken over")
}

// Two connections of one client id on two nodes at the same moment, many
// times: exactly one stays, the other is told 0x8E (or, taken over before
// its CONNACK, closed).
func TestSimultaneousTakeoversLeaveOne(t *testing.T) {
	t.Parallel()
	nodes := sharedCluster(t)
	for round := range 15 {
		id := fmt.Sprint("twin-", round)
		var wg sync.WaitGroup
		peers := make([]*peer, 2)
		for i := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				peers[i] = dialPeerMaybe(t, nodes[i].Addr(), id)
			}()
		}
		wg.Wait()
		// Whoever is alive after a moment answers a PINGREQ; the other's
		// connection is closed.
		time.Sleep(300 * time.Millisecond)
		alive := 0
		for _, p := range peers {
			if p != nil && p.pings() {
				alive++
			}
		}
		if alive != 1 {
			t.Fatalf("round %d: %d connections of %s alive, want 1", round, alive, id)
		}
	}
}

// dialPeerMaybe connects as dialPeer does, but returns nil when the
// connection is refused or closed before its CONNACK.
func dialPeerMaybe(t *testing.T, addr, id string) *peer {
	conn := dialTCP(t, addr)
	body := append(mqttString("MQTT"), 5, 0x02, 0, 60, 0)
	body = append(body, mqttString(id)...)
	if _, err := conn.Write(packet(0x10, body)); err != nil {
		return nil
	}
	r := bufio.NewReader(conn)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	ack, err := readPacket(r)
	if err != nil || ack.typ != 0x20 || len(ack.body) < 2 || ack.body[1] != 0 {
		return nil
	}
	conn.SetReadDeadline(time.Time{})
	p := &peer{t: t, id: id, conn: conn, msgs: make(chan inMsg, 100), acks: make(chan rawPacket, 100),
		disc: make(chan rawPacket, 1), closed: make(chan struct{}), aliases: map[uint16]string{}}
	go p.read(r)
	return p
}

// pings reports whether the connection answers a PINGREQ.
func (p *peer) pings() bool {
	p.write([]byte{0xC0, 0})
	select {
	case a := <-p.acks:
		return a.typ>>4 == 13
	case <-p.disc:
		return false
	case <-p.closed:
		return false
	case <-time.After(5 * time.Second):
		return false
	}
}

// TestTakeoverKeepsQoS2Flows: a QoS 2 exchange open when a session moves
// to another node goes on there under its packet id (MQTT-4.4.0-1): a
// message the client has not acknowledged is sent again with DUP under
// its id, and one it answered with PUBREC gets its PUBREL again, under
// its id. Before, the session came with its messages renumbered and
// without the released one: the client, still waiting for that PUBREL,
// took the next message under the same id for the old one's duplicate
// and dropped it (exactly once broken), and a renumbered message was
// delivered twice.
func TestTakeoverKeepsQoS2Flows(t *testing.T) {
	t.Parallel()
	nodes := sharedCluster(t)
	first := dialPeer(t, nodes[0].Addr(), "q2roamer", peerOpts{clean: true, sessionExpiry: 300, manualAck: true})
	first.subscribe(subOpt{filter: "q2roam/#", qos: 2})
	pub := dialPeer(t, nodes[2].Addr(), "q2roam-pub", peerOpts{clean: true})
	pub.publish("q2roam/t", "released", pubOpt{qos: 2})
	pub.publish("q2roam/t", "open", pubOpt{qos: 2})
	released := first.expect("q2roam/t", "released")
	open := first.expect("q2roam/t", "open")
	first.write(packet(0x50, binary.BigEndian.AppendUint16(nil, released.packetID))) // PUBREC
	if rel := first.nextAck(6); binary.BigEndian.Uint16(rel.body) != released.packetID {
		t.Fatalf("PUBREL for id %d, want %d", binary.BigEndian.Uint16(rel.body), released.packetID)
	}
	// No PUBCOMP: the flow is open when the session moves.
	var present bool
	second := dialPeer(t, nodes[1].Addr(), "q2roamer", peerOpts{sessionExpiry: 300, sessionPresent: &present, manualAck: true})
	first.expectDisconnect(0x8E)
	if !present {
		t.Fatal("the session did not come along: Session Present 0")
	}
	rel := second.nextAck(6)
	if id := binary.BigEndian.Uint16(rel.body); id != released.packetID {
		t.Fatalf("PUBREL on the new node for id %d, want %d (the released message's)", id, released.packetID)
	}
	again := second.expect("q2roam/t", "open")
	if !again.dup || again.packetID != open.packetID {
		t.Fatalf("the open message sent again with DUP %v under id %d, want DUP under %d", again.dup, again.packetID, open.packetID)
	}
	second.write(packet(0x70, binary.BigEndian.AppendUint16(nil, released.packetID))) // PUBCOMP
	second.write(packet(0x50, binary.BigEndian.AppendUint16(nil, open.packetID)))     // PUBREC
	if rel := second.nextAck(6); binary.BigEndian.Uint16(rel.body) != open.packetID {
		t.Fatalf("PUBREL for id %d, want %d", binary.BigEndian.Uint16(rel.body), open.packetID)
	}
	second.write(packet(0x70, binary.BigEndian.AppendUint16(nil, open.packetID)))
	// The exchange is over: the next messages arrive once each.
	pub.publish("q2roam/t", "after", pubOpt{qos: 2})
	m := second.expect("q2roam/t", "after")
	second.write(packet(0x50, binary.BigEndian.AppendUint16(nil, m.packetID)))
	second.nextAck(6)
	second.write(packet(0x70, binary.BigEndian.AppendUint16(nil, m.packetID)))
	second.expectNone(300*time.Millisecond, "a message twice")
}
