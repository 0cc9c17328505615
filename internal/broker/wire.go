package broker

import (
	"encoding/binary"
	"strings"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/mqttwire"
)

// Packets the broker encodes itself, on its busiest path: the PUBLISH it
// writes directly (see deliverDirect) and the PUBACK of a client's QoS 1
// message (see publishDirect). mochi's encoder checks every one of the
// 27 MQTT 5 properties against a nested map for every packet, a tenth of
// the CPU of a pub/sub round trip. These write only what a PUBLISH can
// hold, in mochi's order and by its rules, so the bytes are the same
// (TestPublishEncodingMatchesMochi).

// appendPublish appends pk as a PUBLISH to a client of protocol version
// v whose maximum packet size is maxSize (0: none), as mochi v2.7.9's
// WritePacket would write it, without a topic alias; now (Unix seconds)
// is for the remaining message expiry. It reports false, having appended
// nothing, when the packet is larger than maxSize: such a message is not
// sent (MQTT-3.1.2-25).
func appendPublish(dst []byte, pk *packets.Packet, v byte, maxSize uint32, now int64) ([]byte, bool) {
	qos := pk.FixedHeader.Qos
	n := 2 + len(pk.TopicName) + len(pk.Payload)
	if qos > 0 {
		n += 2
	}
	var stack [128]byte
	props := stack[:0]
	if v == 5 {
		p := &pk.Properties
		if p.PayloadFormatFlag {
			props = append(props, mqttwire.PropPayloadFormat, p.PayloadFormat)
		}
		expiry := p.MessageExpiryInterval
		if pk.Expiry > 0 { // MQTT-3.3.2-6: what is left of it
			expiry = uint32(max(pk.Expiry-now, 1))
		}
		if expiry > 0 {
			props = binary.BigEndian.AppendUint32(append(props, mqttwire.PropMessageExpiry), expiry)
		}
		if p.ContentType != "" {
			props = mqttwire.AppendString(append(props, mqttwire.PropContentType), p.ContentType)
		}
		if p.ResponseTopic != "" && !strings.ContainsAny(p.ResponseTopic, "+#") {
			props = mqttwire.AppendString(append(props, mqttwire.PropResponseTopic), p.ResponseTopic)
		}
		if len(p.CorrelationData) > 0 {
			props = mqttwire.AppendString(append(props, mqttwire.PropCorrelation), string(p.CorrelationData))
		}
		for _, id := range p.SubscriptionIdentifier {
			if id > 0 {
				props = mqttwire.AppendVarint(append(props, mqttwire.PropSubscriptionID), id)
			}
		}
		user := 0
		for _, u := range p.User {
			user += 5 + len(u.Key) + len(u.Val)
		}
		// mochi leaves user properties out when they would not fit,
		// measured this way.
		if user > 0 && (maxSize == 0 || uint32(n+user+1) < maxSize) {
			for _, u := range p.User {
				props = mqttwire.AppendString(mqttwire.AppendString(append(props, mqttwire.PropUser), u.Key), u.Val)
			}
		}
		n += mqttwire.VarintLen(len(props)) + len(props)
	}
	if maxSize > 0 && uint32(1+mqttwire.VarintLen(n)+n) > maxSize {
		return dst, false
	}
	flags := qos << 1
	if pk.FixedHeader.Dup {
		flags |= 0x08
	}
	if pk.FixedHeader.Retain {
		flags |= 0x01
	}
	dst = mqttwire.AppendVarint(append(dst, packets.Publish<<4|flags), n)
	dst = mqttwire.AppendString(dst, pk.TopicName)
	if qos > 0 {
		dst = binary.BigEndian.AppendUint16(dst, pk.PacketID)
	}
	if v == 5 {
		dst = append(mqttwire.AppendVarint(dst, len(props)), props...)
	}
	return append(dst, pk.Payload...), true
}

// appendPuback appends a PUBACK with reason Success and no properties,
// the same in MQTT 3.1.1 and 5 (§3.4.2.1: the reason code may be left
// out).
func appendPuback(dst []byte, id uint16) []byte {
	return binary.BigEndian.AppendUint16(append(dst, packets.Puback<<4, 2), id)
}
