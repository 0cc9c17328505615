package broker

import (
	"bytes"
	"time"

	"github.com/mochi-mqtt/server/v2/packets"
)

// window is a client's Receive Maximum (MQTT-3.3.4-9), kept where the
// packets leave: at most max QoS 1 and 2 PUBLISHes unacknowledged on the
// connection, the rest held in the order written and sent one for each
// PUBACK, PUBCOMP or failed PUBREC (MQTT-4.9.0-1).
//
// mochi v2.7.9 counts the same with a send quota that every publisher
// reads and changes apart from the message it then sends or holds, and
// that a PUBACK raises before the oldest held message takes the slot:
// publishers at once sent past the window, a message routed in that
// instant overtook those held (MQTT-4.6.0-6), and the count drifted until
// mochi sent held messages out of order by itself. Here the count and
// the queue change under the connection's write lock, with the packets:
// what leaves is in the order it was written. mochi's quota is set to
// none, so it holds nothing.
//
// Held messages stay in the session as mochi recorded them; lost with
// the connection, they are resent at the next one, as every unacknowledged
// message is. One that expires while held is not sent.
type window struct {
	max  int                 // the client's Receive Maximum; 0: no window
	out  map[uint16]struct{} // ids sent and not yet acknowledged
	held []heldPublish       // oldest first
	// record returns the session's record of the message sent under id
	// (mochi's inflight map), if it is still there.
	record func(id uint16) (packets.Packet, bool)
}

type heldPublish struct {
	id      uint16
	created int64     // the record's, so that a later message under the same id is not taken for it
	since   time.Time // held since
	frame   []byte
}

// admit returns what of p, whole MQTT packets, may be sent now: all but
// the QoS 1 and 2 PUBLISHes beyond the window, which it holds. p itself
// when nothing is held.
func (w *window) admit(p []byte, now time.Time) []byte {
	if w.max == 0 {
		return p
	}
	var keep []byte // nil while all of p goes
	for off := 0; off < len(p); {
		frame, ok := nextFrame(p[off:])
		if !ok { // not whole packets: passed on as it is
			if keep != nil {
				keep = append(keep, p[off:]...)
			}
			break
		}
		id, qos := publishID(frame)
		switch {
		case qos == 0:
			if keep != nil {
				keep = append(keep, frame...)
			}
		case len(w.held) == 0 && len(w.out) < w.max:
			w.out[id] = struct{}{}
			if keep != nil {
				keep = append(keep, frame...)
			}
		default:
			if keep == nil {
				keep = append(make([]byte, 0, len(p)), p[:off]...)
			}
			rec, _ := w.record(id)
			w.held = append(w.held, heldPublish{id: id, created: rec.Created, since: now, frame: bytes.Clone(frame)})
		}
		off += len(frame)
	}
	if keep == nil {
		return p
	}
	return keep
}

// acked frees the slot of the message sent under id, if it holds one, and
// returns the held messages that may now be sent (nil if none).
func (w *window) acked(id uint16, now time.Time) []byte {
	if _, ok := w.out[id]; !ok {
		return nil
	}
	delete(w.out, id)
	var frames []byte
	for len(w.held) > 0 && len(w.out) < w.max {
		h := w.held[0]
		w.held[0] = heldPublish{}
		w.held = w.held[1:]
		rec, ok := w.record(h.id)
		if !ok || rec.Created != h.created || rec.FixedHeader.Type != packets.Publish {
			continue // no longer in the session: expired, or the session ended
		}
		if rec.Expiry > 0 && rec.Expiry < now.Unix() {
			continue // expired (MQTT-3.3.2-5); mochi's sweep drops the record
		}
		frame := h.frame
		if rec.Expiry > 0 && now.Sub(h.since) >= time.Second {
			frame = withExpiry(frame, rec.Expiry, now)
		}
		w.out[h.id] = struct{}{}
		frames = append(frames, frame...)
	}
	if len(w.held) == 0 {
		w.held = nil // the array's front is not kept
	}
	return frames
}

// withExpiry returns the PUBLISH in frame with its Message Expiry Interval
// set to what is left at now (MQTT-3.3.2-6): it waited while held. frame
// unchanged if it cannot be decoded (it was encoded here).
func withExpiry(frame []byte, expiry int64, now time.Time) []byte {
	var fh packets.FixedHeader
	n := 1
	for frame[n]&0x80 != 0 {
		n++
	}
	if fh.Decode(frame[0]) != nil {
		return frame
	}
	pk := packets.Packet{FixedHeader: fh, ProtocolVersion: 5}
	if err := pk.PublishDecode(frame[n+1:]); err != nil {
		return frame
	}
	pk.Expiry = expiry
	out, ok := appendPublish(nil, &pk, 5, 0, now.Unix())
	if !ok {
		return frame
	}
	return out
}

// nextFrame returns the first whole MQTT packet of p.
func nextFrame(p []byte) ([]byte, bool) {
	size, n := 0, 1
	for shift := 0; ; shift += 7 {
		if n >= len(p) || n > 4 {
			return nil, false
		}
		size |= int(p[n]&0x7f) << shift
		n++
		if p[n-1]&0x80 == 0 {
			break
		}
	}
	if size > len(p)-n {
		return nil, false
	}
	return p[:n+size], true
}

// publishID returns the packet id and QoS of frame if it is a QoS 1 or 2
// PUBLISH; qos 0 otherwise.
func publishID(frame []byte) (id uint16, qos byte) {
	if frame[0]>>4 != packets.Publish {
		return 0, 0
	}
	qos = frame[0] >> 1 & 3
	if qos == 0 {
		return 0, 0
	}
	n := 1
	for frame[n]&0x80 != 0 {
		n++
	}
	n++ // past the remaining length
	if n+2 > len(frame) {
		return 0, 0
	}
	at := n + 2 + (int(frame[n])<<8 | int(frame[n+1]))
	if at+2 > len(frame) {
		return 0, 0
	}
	return uint16(frame[at])<<8 | uint16(frame[at+1]), qos
}
