package client

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/eclipse/paho.golang/packets"
	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/mqttwire"
)

// appendRequest appends a QoS 1 MQTT v5 PUBLISH of payload to topic, with
// packet id id and the properties of p that a request carries (payload
// format, message expiry, content type, response topic, correlation data,
// user properties), fixed header included.
//
// Why the client writes its requests itself rather than through paho:
// paho.golang v0.23.0 publishes at QoS 1 through its session state, which
// takes a context, a channel and a map entry per packet, copies the
// packet into its store, and reads each PUBACK into new structures; in a
// profile of bench/peers' load generator that was some two fifths of the
// client's CPU per request (docs/benchmarks.md).
func appendRequest(b []byte, id uint16, topic string, payload []byte, p *paho.PublishProperties) []byte {
	props := 0
	if p.PayloadFormat != nil {
		props += 2
	}
	if p.MessageExpiry != nil {
		props += 5
	}
	if p.ContentType != "" {
		props += 3 + len(p.ContentType)
	}
	if p.ResponseTopic != "" {
		props += 3 + len(p.ResponseTopic)
	}
	if len(p.CorrelationData) > 0 {
		props += 3 + len(p.CorrelationData)
	}
	for _, u := range p.User {
		props += 5 + len(u.Key) + len(u.Value)
	}
	remaining := 2 + len(topic) + 2 + mqttwire.VarintLen(props) + props + len(payload)
	b = append(b, 0x32) // PUBLISH, QoS 1
	b = mqttwire.AppendVarint(b, remaining)
	b = mqttwire.AppendString(b, topic)
	b = binary.BigEndian.AppendUint16(b, id)
	b = mqttwire.AppendVarint(b, props)
	if p.PayloadFormat != nil {
		b = append(b, mqttwire.PropPayloadFormat, *p.PayloadFormat)
	}
	if p.MessageExpiry != nil {
		b = binary.BigEndian.AppendUint32(append(b, mqttwire.PropMessageExpiry), *p.MessageExpiry)
	}
	if p.ContentType != "" {
		b = mqttwire.AppendString(append(b, mqttwire.PropContentType), p.ContentType)
	}
	if p.ResponseTopic != "" {
		b = mqttwire.AppendString(append(b, mqttwire.PropResponseTopic), p.ResponseTopic)
	}
	if len(p.CorrelationData) > 0 {
		b = mqttwire.AppendString(append(b, mqttwire.PropCorrelation), string(p.CorrelationData))
	}
	for _, u := range p.User {
		b = mqttwire.AppendString(mqttwire.AppendString(append(b, mqttwire.PropUser), u.Key), u.Value)
	}
	return append(b, payload...)
}

// requestFits reports whether MQTT can carry what appendRequest would
// append for these (lengths of 65,535 bytes at most, a packet of
// at most 256 MiB).
func requestFits(topic string, payload []byte, p *paho.PublishProperties) bool {
	if len(topic) > 0xFFFF || len(p.ContentType) > 0xFFFF || len(p.ResponseTopic) > 0xFFFF || len(p.CorrelationData) > 0xFFFF {
		return false
	}
	size := len(topic) + len(payload) + len(p.ContentType) + len(p.ResponseTopic) + len(p.CorrelationData) + 64
	for _, u := range p.User {
		if len(u.Key) > 0xFFFF || len(u.Value) > 0xFFFF {
			return false
		}
		size += 5 + len(u.Key) + len(u.Value)
	}
	return size < 256<<20-16
}

// errConnLost fails a request whose connection ended before its PUBACK
// or its reply came.
var errConnLost = errors.New("the connection ended before the request was answered")

// pubackError is the error of a PUBACK with a failure reason code, worded
// as paho words it.
func pubackError(reason byte) error {
	return fmt.Errorf("error publishing: %s", (&packets.Puback{ReasonCode: reason}).Reason())
}
