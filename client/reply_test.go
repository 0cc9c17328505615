package client

import (
	"bytes"
	"net"
	"reflect"
	"testing"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"
)

// encode is p as paho writes it.
func encode(t testing.TB, p *packets.Publish) []byte {
	t.Helper()
	var b bytes.Buffer
	if _, err := p.WriteTo(&b); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func replyPacket(topic string, corr []byte, payload string) *packets.Publish {
	expiry := uint32(10)
	return &packets.Publish{Topic: topic, Payload: []byte(payload), Properties: &packets.Properties{
		CorrelationData: corr, ContentType: "application/octet-stream", MessageExpiry: &expiry,
		User: []packets.User{{Key: "__ts", Value: "1700000000000:0:n1"}, {Key: "__stat", Value: "200"}},
	}}
}

// The connection takes the replies it can parse and gives paho every
// other packet whole, in order: a PINGRESP on its own (two bytes: the
// connection must not wait for more), a QoS 1 PUBLISH, a reply with a
// topic alias, a packet larger than the connection's buffer.
func TestPacketConnTakesRepliesAndPassesTheRest(t *testing.T) {
	const topic = "clients/AB/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response"
	alias := uint16(3)
	withAlias := replyPacket(topic, []byte{9}, "+OK\r\n")
	withAlias.Properties.TopicAlias = &alias
	big := replyPacket(topic, []byte{8}, string(bytes.Repeat([]byte("x"), 20<<10)))
	qos1 := replyPacket(topic, []byte{7}, "$1\r\nx\r\n")
	qos1.QoS, qos1.PacketID = 1, 5
	packetsIn := []struct {
		b     []byte
		taken bool
	}{
		{encode(t, replyPacket(topic, []byte{1, 2}, "$3\r\nabc\r\n")), true},
		{[]byte{0xD0, 0x00}, false}, // PINGRESP
		{encode(t, qos1), false},
		{encode(t, replyPacket(topic, []byte{3}, ":1\r\n")), true},
		{encode(t, withAlias), false},
		{encode(t, big), false},
		{encode(t, replyPacket("other/topic", []byte{4}, "+OK\r\n")), false},
		{encode(t, replyPacket(topic, []byte{5}, "+OK\r\n")), true},
	}
	server, client := net.Pipe()
	defer server.Close()
	var taken []*paho.Publish
	pc := newPacketConn(client, func(p *paho.Publish) bool {
		if p.Topic != topic {
			return false
		}
		taken = append(taken, p)
		return true
	})
	defer pc.Close()
	go func() {
		for _, p := range packetsIn {
			server.Write(p.b) // one at a time: the PINGRESP arrives alone
		}
	}()
	for i, p := range packetsIn {
		if p.taken {
			continue
		}
		cp, err := packets.ReadPacket(pc)
		if err != nil {
			t.Fatalf("packet %d: paho read: %v", i, err)
		}
		var b bytes.Buffer
		cp.WriteTo(&b)
		if !bytes.Equal(b.Bytes(), p.b) {
			t.Fatalf("packet %d: paho read % x..., want % x...", i, b.Bytes()[:min(16, b.Len())], p.b[:min(16, len(p.b))])
		}
	}
	if len(taken) != 2 { // the last reply is taken when paho reads next
		t.Fatalf("took %d replies before the last, want 2", len(taken))
	}
	want := []string{"$3\r\nabc\r\n", ":1\r\n"}
	for i, p := range taken {
		if string(p.Payload) != want[i] || p.Properties == nil || p.Properties.ContentType != "application/octet-stream" ||
			*p.Properties.MessageExpiry != 10 || len(p.Properties.User) != 2 || p.Properties.User[0].Value != "1700000000000:0:n1" {
			t.Fatalf("reply %d: %+v %+v", i, p, p.Properties)
		}
	}
	if !bytes.Equal(taken[0].Properties.CorrelationData, []byte{1, 2}) {
		t.Fatalf("correlation %x", taken[0].Properties.CorrelationData)
	}
}

// FuzzParseReply: whatever parseReply takes, paho reads the same way.
func FuzzParseReply(f *testing.F) {
	f.Add(encode(f, replyPacket("t/r", []byte{1}, "+OK\r\n")))
	f.Add(encode(f, &packets.Publish{Topic: "a", Payload: nil, Properties: &packets.Properties{}}))
	f.Add([]byte{0x30, 0x05, 0x00, 0x01, 'a', 0x00, 'x'})
	f.Add([]byte{0x30, 0x80})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, ok := parseReply(b)
		if !ok {
			return
		}
		cp, err := packets.ReadPacket(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("parseReply took % x, paho refuses it: %v", b, err)
		}
		pub, isPub := cp.Content.(*packets.Publish)
		if !isPub {
			t.Fatalf("parseReply took % x, paho reads a %T", b, cp.Content)
		}
		want := paho.PublishFromPacketPublish(pub)
		if want.Topic != p.Topic || !bytes.Equal(want.Payload, p.Payload) || want.QoS != 0 ||
			!bytes.Equal(want.Properties.CorrelationData, p.Properties.CorrelationData) ||
			want.Properties.ContentType != p.Properties.ContentType ||
			want.Properties.ResponseTopic != p.Properties.ResponseTopic ||
			!reflect.DeepEqual(want.Properties.MessageExpiry, p.Properties.MessageExpiry) ||
			!reflect.DeepEqual(want.Properties.PayloadFormat, p.Properties.PayloadFormat) ||
			!reflect.DeepEqual([]paho.UserProperty(want.Properties.User), []paho.UserProperty(p.Properties.User)) && len(want.Properties.User)+len(p.Properties.User) > 0 {
			t.Fatalf("% x: parseReply %+v %+v, paho %+v %+v", b, p, p.Properties, want, want.Properties)
		}
	})
}
