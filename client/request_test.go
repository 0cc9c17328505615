package client

import (
	"bytes"
	"context"
	"errors"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
)

// FuzzAppendRequest: whatever appendRequest writes, paho reads back as
// the same QoS 1 PUBLISH, packet id, properties and payload.
func FuzzAppendRequest(f *testing.F) {
	f.Add("statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke", []byte("*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"), uint16(0x8000),
		"clients/c/response", []byte{1, 2, 3}, "application/octet-stream", uint32(10), "__ts", "1700000000000:0:n1", true)
	f.Add("t", []byte{}, uint16(0xFFFF), "", []byte(nil), "", uint32(0), "", "", false)
	f.Add("a/b", bytes.Repeat([]byte("v"), 300), uint16(1), "r", []byte{}, "x", uint32(1<<31), "k", strings.Repeat("w", 200), true)
	f.Fuzz(func(t *testing.T, topic string, payload []byte, id uint16, respTopic string, corr []byte, contentType string, expiry uint32, key, value string, withExpiry bool) {
		pp := &paho.PublishProperties{CorrelationData: corr, ResponseTopic: respTopic, ContentType: contentType}
		if withExpiry {
			pp.MessageExpiry = &expiry
		}
		if key != "" || value != "" {
			pp.User = paho.UserProperties{{Key: key, Value: value}, {Key: "__srcId", Value: "c"}}
		}
		if !requestFits(topic, payload, pp) {
			return
		}
		b := appendRequest([]byte{0xEE}, id, topic, payload, pp)
		if b[0] != 0xEE {
			t.Fatal("appendRequest overwrote what was before it")
		}
		cp, err := packets.ReadPacket(bytes.NewReader(b[1:]))
		if err != nil {
			t.Fatalf("paho refuses % x: %v", b[1:], err)
		}
		pub, ok := cp.Content.(*packets.Publish)
		if !ok {
			t.Fatalf("paho reads a %T", cp.Content)
		}
		got := paho.PublishFromPacketPublish(pub)
		if got.QoS != 1 || got.PacketID != id || got.Topic != topic || !bytes.Equal(got.Payload, payload) ||
			!bytes.Equal(got.Properties.CorrelationData, corr) || got.Properties.ResponseTopic != respTopic ||
			got.Properties.ContentType != contentType || !reflect.DeepEqual(got.Properties.MessageExpiry, pp.MessageExpiry) ||
			len(got.Properties.User)+len(pp.User) > 0 && !reflect.DeepEqual(got.Properties.User, pp.User) {
			t.Fatalf("paho reads %+v %+v, want id %d, topic %q, %+v", got, got.Properties, id, topic, pp)
		}
		var again bytes.Buffer
		if _, err := cp.WriteTo(&again); err != nil || again.Len() != len(b)-1 {
			t.Fatalf("paho writes it back in %d bytes (%v), appendRequest wrote %d", again.Len(), err, len(b)-1)
		}
	})
}

// The connection sends the client's requests with packet ids of its own,
// gives each its PUBACK (a refusal's reason code, a success with or
// without one), passes paho every other packet whole, holds a request
// back while the server's Receive Maximum are in flight, and tells the
// ones still waiting when the connection ends.
func TestPacketConnPublishesAndTakesPUBACKs(t *testing.T) {
	server, client := net.Pipe()
	defer server.Close()
	pc := newPacketConn(client, func(*paho.Publish) bool { return false })
	pc.setSendMax(2)
	ctx := context.Background()

	type ack struct {
		reason byte
		err    error
	}
	acks := make(chan ack, 8)
	send := func(payload string) error {
		return pc.publish(ctx, func(b []byte, id uint16) []byte {
			return appendRequest(b, id, "req", []byte(payload), &paho.PublishProperties{ResponseTopic: "resp"})
		}, func(reason byte, err error) { acks <- ack{reason, err} })
	}
	read := func() *packets.Publish {
		t.Helper()
		cp, err := packets.ReadPacket(server)
		if err != nil {
			t.Fatal(err)
		}
		p, ok := cp.Content.(*packets.Publish)
		if !ok || p.QoS != 1 || p.PacketID < firstOwnID {
			t.Fatalf("server read %T %+v", cp.Content, cp.Content)
		}
		return p
	}
	for _, s := range []string{"one", "two"} {
		if err := send(s); err != nil {
			t.Fatal(err)
		}
	}
	p1, p2 := read(), read()
	if p1.PacketID == p2.PacketID || string(p1.Payload) != "one" || string(p2.Payload) != "two" {
		t.Fatalf("ids %d and %d, payloads %q %q", p1.PacketID, p2.PacketID, p1.Payload, p2.Payload)
	}

	// A third waits for a slot: its context ends first.
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	err := pc.publish(short, func(b []byte, id uint16) []byte { return b }, func(byte, error) { t.Error("acked a request never sent") })
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("third request with two in flight: %v, want it held back", err)
	}

	unknown := []byte{0x40, 0x02, 0x00, 0x07} // a PUBACK of an id paho sent
	go func() {
		server.Write([]byte{0x40, 0x03, byte(p1.PacketID >> 8), byte(p1.PacketID), 0x87}) // refused
		server.Write(unknown)
		server.Write([]byte{0xD0, 0x00})                                            // PINGRESP
		server.Write([]byte{0x40, 0x02, byte(p2.PacketID >> 8), byte(p2.PacketID)}) // success, reason left out
	}()
	cp, err := packets.ReadPacket(pc)
	if err != nil {
		t.Fatal(err)
	}
	if pa, ok := cp.Content.(*packets.Puback); !ok || pa.PacketID != 7 {
		t.Fatalf("paho read %T %+v, want the PUBACK of id 7", cp.Content, cp.Content)
	}
	if cp, err = packets.ReadPacket(pc); err != nil || cp.Type != packets.PINGRESP {
		t.Fatalf("paho read %+v (%v), want the PINGRESP", cp, err)
	}
	if a := <-acks; a.reason != 0x87 || a.err != nil {
		t.Fatalf("first PUBACK: %+v", a)
	}
	go packets.ReadPacket(pc) // reads past the last PUBACK, which the connection takes
	if a := <-acks; a.reason != 0 || a.err != nil {
		t.Fatalf("second PUBACK: %+v", a)
	}

	// Both slots are free again; a request in flight when the
	// connection ends is told so, and nothing more is sent.
	if err := send("three"); err != nil {
		t.Fatal(err)
	}
	read()
	server.Close()
	if a := <-acks; !errors.Is(a.err, errConnLost) {
		t.Fatalf("request in flight as the connection ended: %+v", a)
	}
	if err := send("four"); err == nil {
		t.Fatal("a request went on a connection that ended")
	}
}

// The client's requests go out as its own QoS 1 PUBLISHes and come back
// answered; paho's session takes none of them (it numbers from 1 what it
// sends itself).
func TestRequestsBypassPahosSession(t *testing.T) {
	s := memoryServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := Dial(ctx, Config{URL: "mqtt://" + s.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range 50 {
		if _, err := c.Set(ctx, []byte("k"), []byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	got, err := c.Get(ctx, []byte("k"))
	if err != nil || !bytes.Equal(got.Value, []byte{49}) {
		t.Fatalf("GET after 50 SETs: %+v, %v", got, err)
	}
	c.mu.Lock()
	pc := c.live
	c.mu.Unlock()
	// The last PUBACK may come just after its reply.
	deadline := time.Now().Add(10 * time.Second)
	for {
		pc.ackMu.Lock()
		inFlight, next := len(pc.acks), pc.nextID
		pc.ackMu.Unlock()
		if inFlight == 0 && next == firstOwnID+51 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d PUBACKs awaited after every reply, next id %#x: want 0 and %#x", inFlight, next, firstOwnID+51)
		}
		time.Sleep(time.Millisecond)
	}
}
