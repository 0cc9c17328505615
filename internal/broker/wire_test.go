package broker

import (
	"bytes"
	"testing"

	"github.com/mochi-mqtt/server/v2/packets"
)

// mochiPublish is what mochi v2.7.9's WritePacket writes for pk to a
// client of version v and maximum packet size maxSize, at now, or nil if
// it refuses the packet as too large.
func mochiPublish(t testing.TB, pk packets.Packet, v byte, maxSize uint32, now int64) []byte {
	if pk.Expiry > 0 {
		pk.Properties.MessageExpiryInterval = uint32(max(pk.Expiry-now, 1))
	}
	pk.ProtocolVersion = v
	pk.Mods = packets.Mods{MaxSize: maxSize, AllowResponseInfo: true}
	var buf bytes.Buffer
	if err := pk.PublishEncode(&buf); err != nil {
		t.Fatalf("mochi: %v", err)
	}
	if maxSize > 0 && uint32(buf.Len()) > maxSize {
		return nil
	}
	return buf.Bytes()
}

func checkPublish(t testing.TB, pk packets.Packet, v byte, maxSize uint32, now int64) {
	t.Helper()
	want := mochiPublish(t, pk, v, maxSize, now)
	got, ok := appendPublish([]byte{0xEE}, &pk, v, maxSize, now)
	switch {
	case want == nil && ok:
		t.Fatalf("v%d max %d: encoded %x; mochi refuses it as too large", v, maxSize, got[1:])
	case want != nil && !ok:
		t.Fatalf("v%d max %d: refused; mochi writes %x", v, maxSize, want)
	case got[0] != 0xEE:
		t.Fatal("what was in the buffer was overwritten")
	case ok && !bytes.Equal(got[1:], want):
		t.Fatalf("v%d max %d:\n got %x\nwant %x", v, maxSize, got[1:], want)
	}
}

// TestPublishEncodingMatchesMochi: the broker's PUBLISH is byte for byte
// mochi's, property by property, in both protocol versions, near the
// client's maximum packet size.
func TestPublishEncodingMatchesMochi(t *testing.T) {
	full := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1, Retain: true, Dup: true},
		TopicName:   "a/b/c",
		PacketID:    513,
		Payload:     bytes.Repeat([]byte("x"), 300),
		Expiry:      1000,
		Properties: packets.Properties{
			PayloadFormat: 1, PayloadFormatFlag: true,
			ContentType:            "application/json",
			ResponseTopic:          "reply/to",
			CorrelationData:        []byte{1, 2, 3},
			SubscriptionIdentifier: []int{1, 0, 200, 268435455},
			User:                   []packets.UserProperty{{Key: "k", Val: "v"}, {Key: "__ts", Val: "1:2:n"}},
			// Not in a PUBLISH to a client: mochi leaves them out.
			SessionExpiryInterval: 5, SessionExpiryIntervalFlag: true,
			ReasonString: "no",
		},
	}
	cases := map[string]packets.Packet{
		"all":         full,
		"qos0":        func() packets.Packet { p := full; p.FixedHeader.Qos, p.PacketID = 0, 0; return p }(),
		"bare":        {FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "t"},
		"interval":    {FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "t", Properties: packets.Properties{MessageExpiryInterval: 60}},
		"expired":     {FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "t", Expiry: 10},
		"wildcard rt": {FixedHeader: packets.FixedHeader{Type: packets.Publish}, TopicName: "t", Properties: packets.Properties{ResponseTopic: "a/+"}},
		"long":        {FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1}, PacketID: 1, TopicName: "t", Payload: make([]byte, 20000)},
	}
	for name, pk := range cases {
		t.Run(name, func(t *testing.T) {
			for _, v := range []byte{3, 4, 5} {
				for _, maxSize := range []uint32{0, 1, 20, 330, 360, 374, 375, 376, 380, 400, 20010, 1 << 20} {
					checkPublish(t, pk, v, maxSize, 400)
				}
			}
		})
	}
	if got := appendPuback(nil, 0x0102); !bytes.Equal(got, []byte{0x40, 2, 1, 2}) {
		t.Fatalf("PUBACK %x", got)
	}
}

// FuzzPublishEncoding compares the broker's PUBLISH with mochi's over
// arbitrary messages.
func FuzzPublishEncoding(f *testing.F) {
	f.Add("a/b", []byte("payload"), byte(1), uint16(7), byte(5), uint32(0), "text/plain", "r/t", []byte{9}, "k", "v", 3, uint32(30), int64(0), true)
	f.Add("t", []byte{}, byte(0), uint16(0), byte(4), uint32(10), "", "", []byte{}, "", "", 0, uint32(0), int64(5), false)
	f.Fuzz(func(t *testing.T, topic string, payload []byte, qos byte, id uint16, v byte, maxSize uint32,
		ct, rt string, corr []byte, uk, uv string, subID int, interval uint32, expiry int64, format bool) {
		if len(topic) > 0xFFFF || len(ct) > 0xFFFF || len(rt) > 0xFFFF || len(corr) > 0xFFFF || len(uk) > 0xFFFF || len(uv) > 0xFFFF {
			t.Skip("not from a decoded packet")
		}
		qos %= 2
		if qos == 1 && id == 0 {
			id = 1
		}
		pk := packets.Packet{
			FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: qos},
			TopicName:   topic, PacketID: id, Payload: payload, Expiry: expiry,
			Properties: packets.Properties{
				ContentType: ct, ResponseTopic: rt, CorrelationData: corr,
				MessageExpiryInterval: interval, PayloadFormatFlag: format, PayloadFormat: 1,
				SubscriptionIdentifier: []int{subID & 0x0FFFFFFF},
			},
		}
		if uk != "" || uv != "" {
			pk.Properties.User = []packets.UserProperty{{Key: uk, Val: uv}}
		}
		checkPublish(t, pk, v%6, maxSize, 1000)
	})
}
