package broker

import (
	"encoding/binary"
	"strings"

	"github.com/mochi-mqtt/server/v2/packets"
)

// Packets the broker encodes itself, on its busiest path: the PUBLISH it
// writes directly (see deliverDirect) and the PUBACK of a client's QoS 1
// message (see publishDirect). mochi's encoder checks every one of the
// 27 MQTT 5 properties against a nested map for every packet, a tenth of
// the CPU of a pub/sub round trip. These write only what a PUBLISH can
// hold, in mochi's order and by its rules, so the bytes are the same
// (TestPublishEncodingMatchesMochi).

// MQTT 5 property identifiers a PUBLISH to a client may carry (§3.3.2.3).
const (
	propPayloadFormat  = 0x01
	propMessageExpiry  = 0x02
	propContentType    = 0x03
	propResponseTopic  = 0x08
	propCorrelation    = 0x09
	propSubscriptionID = 0x0B
	propUser           = 0x26
)

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
			props = append(props, propPayloadFormat, p.PayloadFormat)
		}
		expiry := p.MessageExpiryInterval
		if pk.Expiry > 0 { // MQTT-3.3.2-6: what is left of it
			expiry = uint32(max(pk.Expiry-now, 1))
		}
		if expiry > 0 {
			props = binary.BigEndian.AppendUint32(append(props, propMessageExpiry), expiry)
		}
		if p.ContentType != "" {
			props = appendString(append(props, propContentType), p.ContentType)
		}
		if p.ResponseTopic != "" && !strings.ContainsAny(p.ResponseTopic, "+#") {
			props = appendString(append(props, propResponseTopic), p.ResponseTopic)
		}
		if len(p.CorrelationData) > 0 {
			props = appendString(append(props, propCorrelation), string(p.CorrelationData))
		}
		for _, id := range p.SubscriptionIdentifier {
			if id > 0 {
				props = appendVarint(append(props, propSubscriptionID), id)
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
				props = appendString(appendString(append(props, propUser), u.Key), u.Val)
			}
		}
		n += varintLen(len(props)) + len(props)
	}
	if maxSize > 0 && uint32(1+varintLen(n)+n) > maxSize {
		return dst, false
	}
	flags := qos << 1
	if pk.FixedHeader.Dup {
		flags |= 0x08
	}
	if pk.FixedHeader.Retain {
		flags |= 0x01
	}
	dst = appendVarint(append(dst, packets.Publish<<4|flags), n)
	dst = appendString(dst, pk.TopicName)
	if qos > 0 {
		dst = binary.BigEndian.AppendUint16(dst, pk.PacketID)
	}
	if v == 5 {
		dst = append(appendVarint(dst, len(props)), props...)
	}
	return append(dst, pk.Payload...), true
}

// appendPuback appends a PUBACK with reason Success and no properties,
// the same in MQTT 3.1.1 and 5 (§3.4.2.1: the reason code may be left
// out).
func appendPuback(dst []byte, id uint16) []byte {
	return binary.BigEndian.AppendUint16(append(dst, packets.Puback<<4, 2), id)
}

// appendString appends s with its two-byte length (§1.5.4); the
// broker's strings come from decoded packets, so fit.
func appendString(dst []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint16(dst, uint16(len(s))), s...)
}

// appendVarint appends x as a variable byte integer (§1.5.5).
func appendVarint(dst []byte, x int) []byte {
	for {
		b := byte(x & 0x7f)
		x >>= 7
		if x == 0 {
			return append(dst, b)
		}
		dst = append(dst, b|0x80)
	}
}

func varintLen(x int) int {
	n := 1
	for ; x >= 0x80; x >>= 7 {
		n++
	}
	return n
}
