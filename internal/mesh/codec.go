package mesh

import (
	"encoding/binary"
	"errors"

	"github.com/mqkv/mqkv/internal/peer"
)

// The two frames a stream carries most, a message and an acknowledgement,
// have a binary form of their own: encoded and decoded by reflection on
// field names (msgpack), they cost a node about a seventh of its CPU in
// messages across nodes. The other frames stay msgpack. A msgpack frame
// is a map, whose first byte is 0x80–0x8f, 0xde or 0xdf: a first byte of
// binMessage or binAck tells the binary forms apart.
//
// binMessage: Seq (uvarint), flags (bit 0 Plain, 1 Retain, 2 FormatSet,
// 3–4 QoS), PayloadFormat (byte), Expiry (uvarint), Topic, Origin,
// ContentType, ResponseTopic (strings), Correlation, Payload (bytes), the
// user properties (a count, then key and value strings), Groups (a count,
// then strings), For (string), Since (uvarint of its int64 bits). A string
// or bytes is a uvarint length and the bytes. Fields are added at the end
// only.
//
// binAck: Seq (uvarint).
const (
	binMessage = 0x01
	binAck     = 0x02
)

// appendFrame appends f's binary form to b, and reports false if f has
// none (it is sent as msgpack).
func appendFrame(b []byte, f *frame) ([]byte, bool) {
	switch {
	case f.Kind == kindAck:
		return binary.AppendUvarint(append(b, binAck), f.Seq), true
	case f.Kind == kindMessage && f.Delivery != nil:
	default:
		return b, false
	}
	d := f.Delivery
	m := &d.Msg
	b = binary.AppendUvarint(append(b, binMessage), f.Seq)
	flags := m.QoS & 3 << 3
	if d.Plain {
		flags |= 1
	}
	if m.Retain {
		flags |= 2
	}
	if m.FormatSet {
		flags |= 4
	}
	b = append(b, flags, m.PayloadFormat)
	b = binary.AppendUvarint(b, uint64(m.Expiry))
	for _, s := range [...]string{m.Topic, m.Origin, m.ContentType, m.ResponseTopic} {
		b = appendString(b, s)
	}
	b = appendBytes(b, m.Correlation)
	b = appendBytes(b, m.Payload)
	b = binary.AppendUvarint(b, uint64(len(m.User)))
	for _, u := range m.User {
		b = appendString(appendString(b, u[0]), u[1])
	}
	b = binary.AppendUvarint(b, uint64(len(d.Groups)))
	for _, g := range d.Groups {
		b = appendString(b, g)
	}
	b = appendString(b, d.For)
	return binary.AppendUvarint(b, uint64(d.Since)), true
}

func appendString(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

func appendBytes(b, v []byte) []byte {
	return append(binary.AppendUvarint(b, uint64(len(v))), v...)
}

var errBadFrame = errors.New("mesh: malformed frame")

// receive reads the next frame of c into f.
func receive(c *peer.Conn, f *frame) error {
	b, err := c.ReceiveFrame()
	if err != nil {
		return err
	}
	return decodeFrame(b, f)
}

// decodeFrame reads a frame in either form into f. The byte slices of a
// binary message share b's memory.
func decodeFrame(b []byte, f *frame) error {
	if len(b) == 0 {
		return errBadFrame
	}
	switch b[0] {
	case binAck:
		seq, n := binary.Uvarint(b[1:])
		if n <= 0 || 1+n != len(b) {
			return errBadFrame
		}
		*f = frame{Kind: kindAck, Seq: seq}
		return nil
	case binMessage:
		return decodeMessage(b[1:], f)
	}
	return peer.Decode(b, f)
}

// reader reads a binary message's fields, remembering the first fault.
type reader struct {
	b   []byte
	bad bool
}

func (r *reader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.bad, r.b = true, nil
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) byte() byte {
	if len(r.b) == 0 {
		r.bad = true
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *reader) bytes() []byte {
	n := r.uvarint()
	if n > uint64(len(r.b)) {
		r.bad, r.b = true, nil
		return nil
	}
	if n == 0 {
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) string() string { return string(r.bytes()) }

// count reads a number of items, each at least min bytes long: a count
// the rest of the frame cannot hold is a fault (no allocation on its
// word).
func (r *reader) count(min int) int {
	n := r.uvarint()
	if n > uint64(len(r.b)/min) {
		r.bad, r.b = true, nil
		return 0
	}
	return int(n)
}

func decodeMessage(b []byte, f *frame) error {
	r := reader{b: b}
	d := &Delivery{}
	m := &d.Msg
	seq := r.uvarint()
	flags := r.byte()
	d.Plain, m.Retain, m.FormatSet, m.QoS = flags&1 != 0, flags&2 != 0, flags&4 != 0, flags>>3&3
	m.PayloadFormat = r.byte()
	expiry := r.uvarint()
	if expiry > 1<<32-1 {
		return errBadFrame
	}
	m.Expiry = uint32(expiry)
	m.Topic, m.Origin, m.ContentType, m.ResponseTopic = r.string(), r.string(), r.string(), r.string()
	m.Correlation, m.Payload = r.bytes(), r.bytes()
	if n := r.count(2); n > 0 {
		m.User = make([][2]string, n)
		for i := range m.User {
			m.User[i] = [2]string{r.string(), r.string()}
		}
	}
	if n := r.count(1); n > 0 {
		d.Groups = make([]string, n)
		for i := range d.Groups {
			d.Groups[i] = r.string()
		}
	}
	d.For = r.string()
	d.Since = int64(r.uvarint())
	if r.bad || flags>>5 != 0 {
		return errBadFrame
	}
	*f = frame{Kind: kindMessage, Seq: seq, Delivery: d}
	return nil
}
