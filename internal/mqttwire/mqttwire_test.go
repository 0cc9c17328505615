package mqttwire

import (
	"encoding/binary"
	"testing"
)

// A variable byte integer is as long as VarintLen says, and reads back
// (MQTT's encoding is the little-endian base 128 that binary.Uvarint
// reads) at each length's bounds.
func TestVarint(t *testing.T) {
	for _, x := range []int{0, 1, 127, 128, 16383, 16384, 2097151, 2097152, 268435455} {
		b := AppendVarint([]byte{0xEE}, x)
		v, n := binary.Uvarint(b[1:])
		if b[0] != 0xEE || n != len(b)-1 || n != VarintLen(x) || v != uint64(x) {
			t.Fatalf("%d: % x reads as %d in %d bytes, VarintLen %d", x, b, v, n, VarintLen(x))
		}
	}
}

func TestAppendString(t *testing.T) {
	if b := AppendString([]byte{1}, "ab"); string(b) != "\x01\x00\x02ab" {
		t.Fatalf("% x", b)
	}
}
