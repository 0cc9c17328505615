package client

import (
	"encoding/binary"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/mqttwire"
)

// parseReply parses b, one whole MQTT v5 PUBLISH packet at QoS 0 (fixed
// header included), into what the client reads of a reply: its topic,
// correlation data, user properties and payload, copied out of b. ok is
// false for anything else, which paho is then left to read: another QoS,
// a topic alias (paho keeps the aliases), a property this does not know,
// or a malformed packet (paho reports it).
//
// Why the client parses its replies itself: paho.golang v0.23.0 reads
// each string and binary property through bytes.Buffer.ReadFrom, which
// allocates some 512 bytes beyond the property's size: about 11 KB of
// garbage per reply, most of a client's garbage collection.
func parseReply(b []byte) (p *paho.Publish, ok bool) {
	if len(b) < 2 || b[0] != 0x30 { // PUBLISH, QoS 0, no DUP, no RETAIN
		return nil, false
	}
	remaining, n := binary.Uvarint(b[1:])
	if n <= 0 || n > 4 || uint64(len(b)-1-n) != remaining {
		return nil, false
	}
	body := append([]byte(nil), b[1+n:]...) // b is the reader's buffer
	topic, body, ok := mqttString(body)
	if !ok {
		return nil, false
	}
	size, n := binary.Uvarint(body)
	if n <= 0 || n > 4 || size > uint64(len(body)-n) {
		return nil, false
	}
	props, payload := body[n:n+int(size)], body[n+int(size):]
	pp := &paho.PublishProperties{}
	for len(props) > 0 {
		id := props[0]
		props = props[1:]
		var s []byte
		switch id {
		case mqttwire.PropPayloadFormat:
			if len(props) < 1 {
				return nil, false
			}
			f := props[0]
			pp.PayloadFormat, props = &f, props[1:]
		case mqttwire.PropMessageExpiry:
			if len(props) < 4 {
				return nil, false
			}
			e := binary.BigEndian.Uint32(props)
			pp.MessageExpiry, props = &e, props[4:]
		case mqttwire.PropContentType:
			if s, props, ok = mqttString(props); !ok {
				return nil, false
			}
			pp.ContentType = string(s)
		case mqttwire.PropResponseTopic:
			if s, props, ok = mqttString(props); !ok {
				return nil, false
			}
			pp.ResponseTopic = string(s)
		case mqttwire.PropCorrelation:
			if pp.CorrelationData, props, ok = mqttString(props); !ok {
				return nil, false
			}
		case mqttwire.PropSubscriptionID:
			v, n := binary.Uvarint(props)
			if n <= 0 || n > 4 {
				return nil, false
			}
			sub := int(v)
			pp.SubscriptionIdentifier, props = &sub, props[n:]
		case mqttwire.PropUser:
			var k, v []byte
			if k, props, ok = mqttString(props); !ok {
				return nil, false
			}
			if v, props, ok = mqttString(props); !ok {
				return nil, false
			}
			pp.User = append(pp.User, paho.UserProperty{Key: string(k), Value: string(v)})
		default: // 0x23, a topic alias, among others
			return nil, false
		}
	}
	return &paho.Publish{Topic: string(topic), Payload: payload, Properties: pp}, true
}

// mqttString splits a two-byte length and that many bytes off b.
func mqttString(b []byte) (s, rest []byte, ok bool) {
	if len(b) < 2 {
		return nil, nil, false
	}
	n := int(binary.BigEndian.Uint16(b))
	if len(b) < 2+n {
		return nil, nil, false
	}
	return b[2 : 2+n : 2+n], b[2+n:], true
}
