package broker

import (
	"bytes"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// publishFrame encodes a QoS qos PUBLISH under id with payload p.
func publishFrame(t *testing.T, id uint16, qos byte, p byte, expiry int64, now time.Time) []byte {
	t.Helper()
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos}, TopicName: "w/x", PacketID: id, Payload: []byte{p}, Expiry: expiry}
	if qos == 0 {
		pk.PacketID = 0
	}
	f, ok := appendPublish(nil, &pk, 5, 0, now.Unix())
	if !ok {
		t.Fatal("not encoded")
	}
	return f
}

// payloads returns the payload byte of each PUBLISH in p, in order.
func payloads(t *testing.T, p []byte) []byte {
	t.Helper()
	var out []byte
	for len(p) > 0 {
		f, ok := nextFrame(p)
		if !ok {
			t.Fatalf("not whole packets: % x", p)
		}
		if f[0]>>4 == packets.Publish {
			out = append(out, f[len(f)-1])
		}
		p = p[len(f):]
	}
	return out
}

// testWindow is a window of max whose session records are records.
func testWindow(max int, records map[uint16]packets.Packet) window {
	return window{max: max, out: map[uint16]struct{}{}, record: func(id uint16) (packets.Packet, bool) {
		r, ok := records[id]
		return r, ok
	}}
}

// TestWindowHoldsInOrder: past the window, QoS 1 and 2 PUBLISHes wait in
// the order written while everything else passes; each acknowledgement
// of a message sent lets the oldest one held go, and one for an id not
// sent frees nothing.
func TestWindowHoldsInOrder(t *testing.T) {
	now := time.Now()
	records := map[uint16]packets.Packet{}
	w := testWindow(2, records)
	var all []byte
	for i := range 5 {
		id := uint16(i + 1)
		records[id] = packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, PacketID: id, Created: now.Unix()}
		all = append(all, publishFrame(t, id, 1, byte(i), 0, now)...)
	}
	all = append(all, pubackBytes...) // an acknowledgement of the client's, behind them
	all = append(all, publishFrame(t, 0, 0, 9, 0, now)...)
	sent := w.admit(all, now)
	if got := payloads(t, sent); !bytes.Equal(got, []byte{0, 1, 9}) {
		t.Fatalf("sent %v, want messages 0, 1 and the QoS 0 one", got)
	}
	if !bytes.Contains(sent, pubackBytes) || len(w.held) != 3 {
		t.Fatalf("held %d, PUBACK passed: %v", len(w.held), bytes.Contains(sent, pubackBytes))
	}
	if more := w.acked(7, now); more != nil || len(w.held) != 3 {
		t.Fatal("an id never sent freed a slot")
	}
	if got := payloads(t, w.acked(2, now)); !bytes.Equal(got, []byte{2}) {
		t.Fatalf("after an acknowledgement: %v, want message 2", got)
	}
	// A later write waits behind those held, though a slot is free
	// after the next acknowledgement.
	records[6] = packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, PacketID: 6, Created: now.Unix()}
	if got := w.admit(publishFrame(t, 6, 1, 5, 0, now), now); len(got) != 0 {
		t.Fatalf("overtook the held ones: % x", got)
	}
	// Message 3's record is gone (expired and dropped by mochi): skipped.
	delete(records, 4)
	if got := payloads(t, w.acked(1, now)); !bytes.Equal(got, []byte{4}) {
		t.Fatalf("got %v, want message 4 (3 is no longer in the session)", got)
	}
	if got := payloads(t, w.acked(3, now)); !bytes.Equal(got, []byte{5}) {
		t.Fatalf("got %v, want message 5", got)
	}
	if len(w.held) != 0 || len(w.out) != 2 {
		t.Fatalf("held %d, out %d", len(w.held), len(w.out))
	}
}

// TestWindowExpiry: a message held past its expiry is not sent; one held
// a while is sent with what is left of its interval (MQTT-3.3.2-6).
func TestWindowExpiry(t *testing.T) {
	start := time.Now()
	records := map[uint16]packets.Packet{}
	w := testWindow(1, records)
	for i, expiry := range []int64{0, start.Unix() + 2, start.Unix() + 600} {
		id := uint16(i + 1)
		records[id] = packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish}, PacketID: id, Created: start.Unix(), Expiry: expiry}
		w.admit(publishFrame(t, id, 1, byte(i), expiry, start), start)
	}
	later := start.Add(5 * time.Second)
	out := w.acked(1, later)
	if got := payloads(t, out); !bytes.Equal(got, []byte{2}) {
		t.Fatalf("got %v, want message 2 (1 expired)", got)
	}
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, ProtocolVersion: 5}
	f, _ := nextFrame(out)
	if err := pk.PublishDecode(f[2:]); err != nil {
		t.Fatal(err)
	}
	if got, want := pk.Properties.MessageExpiryInterval, uint32(595); got != want {
		t.Fatalf("expiry interval %d, want %d", got, want)
	}
}

// FuzzWindowAdmit: whatever bytes are written, the window neither panics
// nor loses or makes up a byte: what it sends and what it holds add up to
// what was written, and it holds only QoS 1 and 2 PUBLISHes.
func FuzzWindowAdmit(f *testing.F) {
	now := time.Now()
	var seed []byte
	for i := range 3 {
		pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, TopicName: "t", PacketID: uint16(i + 1), Payload: []byte{byte(i)}}
		frame, _ := appendPublish(nil, &pk, 5, 0, now.Unix())
		seed = append(seed, frame...)
	}
	f.Add(seed, uint8(1))
	f.Add(append(bytes.Clone(pubackBytes), seed[:len(seed)-1]...), uint8(2))
	f.Add([]byte{0x32, 0x80}, uint8(1))
	f.Fuzz(func(t *testing.T, p []byte, max uint8) {
		w := window{max: int(max%4) + 1, out: map[uint16]struct{}{}, record: func(uint16) (packets.Packet, bool) { return packets.Packet{}, false }}
		w.out[0xffff] = struct{}{} // one slot taken: something is held sooner
		sent := w.admit(p, now)
		n := len(sent)
		for _, h := range w.held {
			if _, qos := publishID(h.frame); qos == 0 {
				t.Fatalf("held % x", h.frame)
			}
			n += len(h.frame)
		}
		if n != len(p) {
			t.Fatalf("%d bytes in, %d sent or held", len(p), n)
		}
	})
}
