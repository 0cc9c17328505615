package e2e

import (
	"bytes"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"

	"github.com/mqkv/mqkv/internal/statestore"
)

// TestRequestAcknowledgedWithItsReply: the PUBACK of a QoS 1 state store
// request waits for the reply (which comes after the command is committed)
// and both reach the client in the same read, not in two (one system call
// less on each end per request). The order of the two is not fixed.
func TestRequestAcknowledgedWithItsReply(t *testing.T) {
	s := startServer(t) // durable: the reply waits for a log flush
	w, _ := dialWire(t, s, packets.Connect{ClientID: "acker", CleanStart: true})
	const response = "clients/acker/response"
	w.subscribe(1, response)
	together := 0
	for i := range 20 {
		id := uint16(10 + i)
		w.send(&packets.Publish{PacketID: id, QoS: 1, Topic: statestore.RequestTopic, Payload: encode("SET", "k", "v"),
			Properties: &packets.Properties{ResponseTopic: response, CorrelationData: []byte{byte(i)},
				User: []packets.User{{Key: "__ts", Value: *now()}}}})
		buf := make([]byte, 4096)
		w.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := w.conn.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		r := bytes.NewReader(buf[:n])
		acked, replied := false, false
		for r.Len() > 0 {
			p, err := packets.ReadPacket(r)
			if err != nil {
				t.Fatalf("request %d: %v in % x", i, err, buf[:n])
			}
			switch c := p.Content.(type) {
			case *packets.Puback:
				acked = c.PacketID == id
			case *packets.Publish:
				replied = c.Topic == response && string(c.Payload) == "+OK\r\n"
				if c.QoS == 1 {
					w.send(&packets.Puback{PacketID: c.PacketID})
				}
			}
		}
		if acked && replied {
			together++
			continue
		}
		// The other came later: read it before the next request.
		for !acked || !replied {
			switch c := w.next().Content.(type) {
			case *packets.Puback:
				acked = c.PacketID == id
			case *packets.Publish:
				replied = true
				if c.QoS == 1 {
					w.send(&packets.Puback{PacketID: c.PacketID})
				}
			}
		}
	}
	// A reader delayed past coalesceHold (the race detector, a busy
	// machine) may split a pair; without the wait every pair is split.
	if together < 15 {
		t.Fatalf("%d of 20 requests had PUBACK and reply in one read", together)
	}
}
