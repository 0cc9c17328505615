package broker

import (
	"bytes"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

// decodePublish reads one PUBLISH frame as a client would.
func decodePublish(t *testing.T, frame []byte) packets.Packet {
	t.Helper()
	var fh packets.FixedHeader
	if err := fh.Decode(frame[0]); err != nil {
		t.Fatal(err)
	}
	n := 1
	for frame[n]&0x80 != 0 {
		n++
	}
	pk := packets.Packet{FixedHeader: fh, ProtocolVersion: 5}
	if err := pk.PublishDecode(frame[n+1:]); err != nil {
		t.Fatalf("decode % x: %v", frame, err)
	}
	return pk
}

func encodedPublish(t *testing.T, topic string, qos byte, id uint16, props packets.Properties, payload string) []byte {
	t.Helper()
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos}, TopicName: topic, PacketID: id, Properties: props, Payload: []byte(payload)}
	out, ok := appendPublish(nil, &pk, 5, 0, 0)
	if !ok {
		t.Fatal("not encoded")
	}
	return out
}

func TestOutboundAliases(t *testing.T) {
	props := packets.Properties{ContentType: "text/plain", User: []packets.UserProperty{{Key: "a", Val: "1"}, {Key: "a", Val: "2"}}, SubscriptionIdentifier: []int{3, 300}}
	a := outAliases{max: 2}
	var out []byte
	frames := [][]byte{
		encodedPublish(t, "sensors/one", 1, 7, props, "p1"),  // alias 1 set
		encodedPublish(t, "sensors/one", 0, 0, props, "p2"),  // alias 1 used
		encodedPublish(t, "abc", 1, 8, props, "short"),       // too short to alias
		encodedPublish(t, "sensors/two", 2, 9, props, "p3"),  // alias 2 set
		encodedPublish(t, "sensors/three", 1, 10, props, ""), // past the maximum: whole
		encodedPublish(t, "sensors/two", 1, 11, props, "p4"), // alias 2 used
	}
	for _, f := range frames {
		out = a.appendFrames(out, f)
	}
	want := []struct {
		topic   string
		alias   uint16
		id      uint16
		payload string
	}{{"sensors/one", 1, 7, "p1"}, {"", 1, 0, "p2"}, {"abc", 0, 8, "short"}, {"sensors/two", 2, 9, "p3"}, {"sensors/three", 0, 10, ""}, {"", 2, 11, "p4"}}
	for i, w := range want {
		frame, ok := nextFrame(out)
		if !ok {
			t.Fatalf("frame %d missing", i)
		}
		out = out[len(frame):]
		pk := decodePublish(t, frame)
		if pk.TopicName != w.topic || pk.Properties.TopicAlias != w.alias || pk.PacketID != w.id || string(pk.Payload) != w.payload {
			t.Fatalf("frame %d: topic %q alias %d id %d payload %q; want %+v", i, pk.TopicName, pk.Properties.TopicAlias, pk.PacketID, pk.Payload, w)
		}
		if pk.Properties.ContentType != "text/plain" || len(pk.Properties.User) != 2 || pk.Properties.User[1].Val != "2" || len(pk.Properties.SubscriptionIdentifier) != 2 {
			t.Fatalf("frame %d: properties changed: %+v", i, pk.Properties)
		}
	}
	if len(out) != 0 {
		t.Fatalf("%d bytes left", len(out))
	}
}

// Other packets pass as they are, and a topic's first use that would
// take a packet past the client's maximum size is sent whole.
func TestOutboundAliasesLeaveTheRest(t *testing.T) {
	a := outAliases{max: 5}
	puback := appendPuback(nil, 12)
	if got := a.appendFrames(nil, puback); !bytes.Equal(got, puback) {
		t.Fatalf("PUBACK changed: % x", got)
	}
	f := encodedPublish(t, "a/long/topic", 0, 0, packets.Properties{}, "x")
	a.maxSize = uint32(len(f)) // three more bytes would not fit
	if got := a.appendFrames(nil, f); !bytes.Equal(got, f) || len(a.topics) != 0 {
		t.Fatalf("over the maximum size: % x, %d aliases", got, len(a.topics))
	}
	a.maxSize = 0
	a.appendFrames(nil, f)
	a.appendFrames(nil, encodedPublish(t, "b/long/topic", 0, 0, packets.Properties{}, "x"))
	a.undo(1)
	if len(a.topics) != 1 || a.topics["a/long/topic"] != 1 {
		t.Fatalf("after undo: %v", a.topics)
	}
	if got := decodePublish(t, a.appendFrames(nil, encodedPublish(t, "b/long/topic", 0, 0, packets.Properties{}, "x"))); got.TopicName != "b/long/topic" || got.Properties.TopicAlias != 2 {
		t.Fatalf("alias given again: %+v", got)
	}
	// An aliased frame is not aliased again.
	twice := a.appendFrames(nil, a.appendFrames(nil, encodedPublish(t, "c/long/topic", 1, 3, packets.Properties{}, "x")))
	if got := decodePublish(t, twice); got.TopicName != "c/long/topic" || got.Properties.TopicAlias != 3 {
		t.Fatalf("aliased twice: %+v", got)
	}
}
