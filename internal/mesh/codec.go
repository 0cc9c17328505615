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
		b = peer.AppendString(b, s)
	}
	b = peer.AppendBytes(b, m.Correlation)
	b = peer.AppendBytes(b, m.Payload)
	b = binary.AppendUvarint(b, uint64(len(m.User)))
	for _, u := range m.User {
		b = peer.AppendString(peer.AppendString(b, u[0]), u[1])
	}
	b = binary.AppendUvarint(b, uint64(len(d.Groups)))
	for _, g := range d.Groups {
		b = peer.AppendString(b, g)
	}
	b = peer.AppendString(b, d.For)
	return binary.AppendUvarint(b, uint64(d.Since)), true
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

func decodeMessage(b []byte, f *frame) error {
	r := peer.NewReader(b)
	d := &Delivery{}
	m := &d.Msg
	seq := r.Uvarint()
	flags := r.Byte()
	d.Plain, m.Retain, m.FormatSet, m.QoS = flags&1 != 0, flags&2 != 0, flags&4 != 0, flags>>3&3
	m.PayloadFormat = r.Byte()
	expiry := r.Uvarint()
	if expiry > 1<<32-1 {
		return errBadFrame
	}
	m.Expiry = uint32(expiry)
	m.Topic, m.Origin, m.ContentType, m.ResponseTopic = r.String(), r.String(), r.String(), r.String()
	m.Correlation, m.Payload = r.Bytes(), r.Bytes()
	if n := r.Count(2); n > 0 {
		m.User = make([][2]string, n)
		for i := range m.User {
			m.User[i] = [2]string{r.String(), r.String()}
		}
	}
	if n := r.Count(1); n > 0 {
		d.Groups = make([]string, n)
		for i := range d.Groups {
			d.Groups[i] = r.String()
		}
	}
	d.For = r.String()
	d.Since = int64(r.Uvarint())
	if r.Bad() || flags>>5 != 0 {
		return errBadFrame
	}
	*f = frame{Kind: kindMessage, Seq: seq, Delivery: d}
	return nil
}
