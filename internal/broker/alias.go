package broker

import (
	"encoding/binary"

	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/mqttwire"
)

// Topic aliases on the messages a client receives (MQTT 5 §3.3.2.3.4).
//
// A client that gives a Topic Alias Maximum in CONNECT may be sent an
// alias in place of a topic it was sent before on the same connection.
// They are chosen here, where the packets go into the connection's send
// buffer in the order they leave (see clientConn.writeLocked), and not
// where messages are routed: a message held for the client's Receive
// Maximum, or queued by mochi, would otherwise leave after a later one
// that uses the alias it sets. Nothing stored keeps an alias: a message
// resent on the next connection names its topic, as aliases end with
// their connection (MQTT-3.3.2-10). mochi is told the client takes none
// (see hook.OnConnect).
//
// An alias is given to each new topic until the client's maximum is
// reached, then kept: a topic past it is always sent whole. Replacing
// aliases, as some brokers do, pays only for a client whose topics cycle
// slower than their number, and costs every other a longer packet.

// outAliases is a connection's outbound topic aliases; under its wmu.
type outAliases struct {
	max     uint16            // the client's Topic Alias Maximum; 0: none
	maxSize uint32            // the client's Maximum Packet Size; 0: none
	topics  map[string]uint16 // topic → alias
	order   []string          // alias-1 → topic
}

// undo forgets the aliases given after the first n: the packets that
// set them were not sent.
func (a *outAliases) undo(n int) {
	for len(a.order) > n {
		last := len(a.order) - 1
		delete(a.topics, a.order[last])
		a.order = a.order[:last]
	}
}

// minAliasedTopic is the shortest topic given an alias: an alias costs
// three bytes where it is set, and saves len(topic)-3 where it is used.
const minAliasedTopic = 4

// appendFrames appends p, whole MQTT packets, to dst, with aliases in
// the PUBLISH packets it may alias.
func (a *outAliases) appendFrames(dst, p []byte) []byte {
	for len(p) > 0 {
		frame, ok := nextFrame(p)
		if !ok {
			return append(dst, p...) // not whole packets: passed on as they are
		}
		p = p[len(frame):]
		if frame[0]>>4 != packets.Publish {
			dst = append(dst, frame...)
			continue
		}
		dst = a.appendPublish(dst, frame)
	}
	return dst
}

// appendPublish appends the MQTT 5 PUBLISH frame to dst, aliased if it
// can be: its topic replaced by the topic's alias, or given one.
func (a *outAliases) appendPublish(dst, frame []byte) []byte {
	hdr := 1
	for hdr < len(frame) && frame[hdr]&0x80 != 0 {
		hdr++
	}
	hdr++ // past the remaining length
	if hdr+2 > len(frame) {
		return append(dst, frame...)
	}
	topicLen := int(binary.BigEndian.Uint16(frame[hdr:]))
	topicEnd := hdr + 2 + topicLen
	idEnd := topicEnd
	if frame[0]>>1&3 > 0 {
		idEnd += 2
	}
	if topicLen < minAliasedTopic || idEnd >= len(frame) {
		return append(dst, frame...)
	}
	propsLen, n := binary.Uvarint(frame[idEnd:])
	if n <= 0 || idEnd+n+int(propsLen) > len(frame) || !aliasable(frame[idEnd+n:idEnd+n+int(propsLen)]) {
		return append(dst, frame...)
	}
	topic := frame[hdr+2 : topicEnd]
	alias, known := a.topics[string(topic)] // no allocation for the lookup
	if !known && len(a.topics) >= int(a.max) {
		return append(dst, frame...)
	}
	sentTopic := topic
	if known {
		sentTopic = nil
	}
	newProps := int(propsLen) + 3
	rest := frame[idEnd+n:] // the properties, then the payload
	remaining := 2 + len(sentTopic) + (idEnd - topicEnd) + mqttwire.VarintLen(newProps) + len(rest) + 3
	if a.maxSize > 0 && uint32(1+mqttwire.VarintLen(remaining)+remaining) > a.maxSize {
		return append(dst, frame...) // only a topic's first use grows a packet
	}
	if !known {
		alias = uint16(len(a.topics) + 1)
		if a.topics == nil {
			a.topics = map[string]uint16{}
		}
		a.topics[string(topic)] = alias
		a.order = append(a.order, string(topic))
	}
	dst = mqttwire.AppendVarint(append(dst, frame[0]), remaining)
	dst = append(binary.BigEndian.AppendUint16(dst, uint16(len(sentTopic))), sentTopic...)
	dst = append(dst, frame[topicEnd:idEnd]...) // the packet id, if any
	dst = mqttwire.AppendVarint(dst, newProps)
	dst = binary.BigEndian.AppendUint16(append(dst, mqttwire.PropTopicAlias), alias)
	return append(dst, rest...)
}

// aliasable reports whether the encoded PUBLISH properties may be given a
// Topic Alias: they hold none already (the broker's own encoders never
// write one; the check keeps a frame from being aliased twice whatever
// wrote it), and they read as PUBLISH properties.
func aliasable(props []byte) bool {
	for len(props) > 0 {
		id := props[0]
		props = props[1:]
		size := -1
		switch id {
		case mqttwire.PropPayloadFormat:
			size = 1
		case mqttwire.PropMessageExpiry:
			size = 4
		case mqttwire.PropContentType, mqttwire.PropResponseTopic, mqttwire.PropCorrelation:
			if len(props) >= 2 {
				size = 2 + int(binary.BigEndian.Uint16(props))
			}
		case mqttwire.PropSubscriptionID:
			_, size = binary.Uvarint(props)
		case mqttwire.PropUser:
			if len(props) >= 2 {
				k := 2 + int(binary.BigEndian.Uint16(props))
				if len(props) >= k+2 {
					size = k + 2 + int(binary.BigEndian.Uint16(props[k:]))
				}
			}
		}
		if size <= 0 || size > len(props) {
			return false // an alias already, or not read
		}
		props = props[size:]
	}
	return true
}
