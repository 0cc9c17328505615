package mesh

import (
	"reflect"
	"testing"
)

func sampleFrames() []frame {
	return []frame{
		{Kind: kindAck, Seq: 1 << 40},
		{Kind: kindMessage, Seq: 7, Delivery: &Delivery{Msg: Message{Topic: "a/b", Payload: []byte("x")}, Plain: true}},
		{Kind: kindMessage, Seq: 300, Delivery: &Delivery{
			Msg: Message{Topic: "t", Payload: []byte{0, 1, 2}, QoS: 2, Retain: true, Origin: "c1", Expiry: 1<<32 - 1,
				PayloadFormat: 1, FormatSet: true, ContentType: "text/plain", ResponseTopic: "r/t", Correlation: []byte{9},
				User: [][2]string{{"k", "1"}, {"k", "2"}, {"", ""}}},
			Groups: []string{"$share/g/t", "$share/h/#"}, For: "n1", Since: 1_700_000_000_000_000_000}},
	}
}

// Every field of the binary forms comes back as it went.
func TestBinaryFramesRoundTrip(t *testing.T) {
	for _, f := range sampleFrames() {
		b, ok := appendFrame(nil, &f)
		if !ok {
			t.Fatalf("%+v has no binary form", f)
		}
		var got frame
		if err := decodeFrame(b, &got); err != nil {
			t.Fatalf("decode %+v: %v", f, err)
		}
		if !reflect.DeepEqual(got, f) {
			t.Fatalf("got %+v %+v, want %+v %+v", got, got.Delivery, f, f.Delivery)
		}
		// Cut short anywhere: refused, never read past the end.
		for i := range b {
			if decodeFrame(b[:i], &got) == nil {
				t.Fatalf("%d of %d bytes of %+v accepted", i, len(b), f)
			}
		}
	}
	// The other frames stay msgpack, and still decode.
	if _, ok := appendFrame(nil, &frame{Kind: kindInterest, Filter: "a/#", On: true}); ok {
		t.Fatal("an interest frame took a binary form")
	}
}

// FuzzDecodeFrame: whatever a stream brings, decoding returns a frame or
// an error, and a binary message it accepts encodes back to what it read.
func FuzzDecodeFrame(f *testing.F) {
	for _, fr := range sampleFrames() {
		b, _ := appendFrame(nil, &fr)
		f.Add(b)
	}
	f.Add([]byte{binMessage, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x81, 0xa4, 'K', 'i', 'n', 'd', 0x04})
	f.Fuzz(func(t *testing.T, b []byte) {
		var fr frame
		if decodeFrame(b, &fr) != nil || len(b) == 0 || b[0] != binMessage {
			return
		}
		again, _ := appendFrame(nil, &fr)
		var back frame
		if err := decodeFrame(again, &back); err != nil || !reflect.DeepEqual(back, fr) {
			t.Fatalf("re-encoded %+v does not decode the same: %v", fr, err)
		}
	})
}
