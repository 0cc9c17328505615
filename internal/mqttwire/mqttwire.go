// Package mqttwire holds MQTT's wire primitives (§1.5 of MQTT 5): strings
// and binary data with a two-byte length, and variable byte integers,
// for the packets mqkv encodes itself rather than through a library (the
// broker's PUBLISH and PUBACK, the Go client's requests).
package mqttwire

import "encoding/binary"

// MQTT 5 property identifiers a PUBLISH may carry (§3.3.2.3).
const (
	PropPayloadFormat  = 0x01
	PropMessageExpiry  = 0x02
	PropContentType    = 0x03
	PropResponseTopic  = 0x08
	PropCorrelation    = 0x09
	PropSubscriptionID = 0x0B
	PropTopicAlias     = 0x23
	PropUser           = 0x26
)

// AppendString appends s with its two-byte length (§1.5.4, and §1.5.6
// for binary data); callers keep s within 65,535 bytes.
func AppendString(dst []byte, s string) []byte {
	return append(binary.BigEndian.AppendUint16(dst, uint16(len(s))), s...)
}

// AppendVarint appends x as a variable byte integer (§1.5.5).
func AppendVarint(dst []byte, x int) []byte {
	for {
		b := byte(x & 0x7f)
		x >>= 7
		if x == 0 {
			return append(dst, b)
		}
		dst = append(dst, b|0x80)
	}
}

// VarintLen is how many bytes AppendVarint writes for x.
func VarintLen(x int) int {
	n := 1
	for ; x >= 0x80; x >>= 7 {
		n++
	}
	return n
}
