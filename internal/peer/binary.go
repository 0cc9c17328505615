package peer

import "encoding/binary"

// The link's binary forms. Messages a node sends often have a binary form
// of their own beside msgpack (mesh's deliveries, cluster's forwarded
// calls): reflection on field names cost a node a seventh of its CPU or
// more. A msgpack message is a map, whose first byte is 0x80–0x8f, 0xde
// or 0xdf; a binary form starts with a byte below 0x80 naming it. A
// string or byte slice is a uvarint length and the bytes.

// AppendString appends s in the binary form.
func AppendString(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

// AppendBytes appends v in the binary form.
func AppendBytes(b, v []byte) []byte {
	return append(binary.AppendUvarint(b, uint64(len(v))), v...)
}

// Reader reads a binary form's fields in order, remembering the first
// fault: after one, every read returns a zero value and Bad reports true,
// so a decoder checks once at the end. Byte slices share the input's
// memory.
type Reader struct {
	b   []byte
	bad bool
}

// NewReader reads b.
func NewReader(b []byte) *Reader { return &Reader{b: b} }

// Bad reports whether a read failed.
func (r *Reader) Bad() bool { return r.bad }

// Len is how many bytes are left.
func (r *Reader) Len() int { return len(r.b) }

func (r *Reader) fail() { r.bad, r.b = true, nil }

// Fail marks the input bad: a value read is not one the form allows.
func (r *Reader) Fail() { r.fail() }

// Uvarint reads an unsigned varint.
func (r *Reader) Uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

// Varint reads a signed varint.
func (r *Reader) Varint() int64 {
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

// Byte reads one byte.
func (r *Reader) Byte() byte {
	if len(r.b) == 0 {
		r.fail()
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

// Bytes reads a byte slice (nil when empty).
func (r *Reader) Bytes() []byte {
	n := r.Uvarint()
	if n > uint64(len(r.b)) {
		r.fail()
		return nil
	}
	if n == 0 {
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}

// String reads a string.
func (r *Reader) String() string { return string(r.Bytes()) }

// Count reads a number of items, each at least min bytes long: a count
// the rest of the input cannot hold is a fault (no allocation on its
// word).
func (r *Reader) Count(min int) int {
	n := r.Uvarint()
	if n > uint64(len(r.b)/min) {
		r.fail()
		return 0
	}
	return int(n)
}
