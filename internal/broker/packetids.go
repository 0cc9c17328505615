package broker

import (
	"sync"
	"sync/atomic"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// MQTT 5 keeps the packet identifiers of the two directions apart
// (§2.2.1): a client numbers its PUBLISH (QoS > 0), SUBSCRIBE and
// UNSUBSCRIBE as it likes, whatever ids the server's own PUBLISHes to it
// carry. mochi v2.7.9 keeps both in one inflight map per client, so a
// client id that equals one of the server's unacknowledged messages gets
// SUBACK 0x91 "packet identifier in use", or its QoS 1 PUBLISH deletes the
// server's message from the map (it is never resent), or its QoS 2 flow
// overwrites it. A client resuming a session with messages queued for it
// and subscribing at once (mosquitto_sub -c does) hits this at its first
// packet.
//
// idSpace repairs that without patching mochi: an id a client uses that
// collides with one of the server's is renamed, as the packet is read, to
// one mochi does not use, and renamed back in the acknowledgement mochi
// writes (PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK: the packet types that
// answer the client's numbering; the server's own PUBLISH and PUBREL are
// never touched). Acknowledgements are written on the reading goroutine
// before the next packet is read, except a QoS 2 flow's, which stays open
// until PUBREL: only those renames outlive one packet. They belong to the
// session (by client id), because a resumed session resends its PUBRECs.
type idSpace struct {
	sessions sync.Map     // client id → *renames in force; most clients have none
	count    atomic.Int64 // entries in sessions: none, the common case, costs no lookup
}

type renames struct {
	mu       sync.Mutex
	toClient map[uint16]uint16 // mochi's id → the client's
	toMochi  map[uint16]uint16 // the client's id → mochi's (QoS 2 flows)
	next     uint16            // where the search for a free id starts
}

// read renames the id of a packet from the client if it collides. It
// takes the packet by pointer: mochi's packets are large and this runs on
// every packet read.
func (s *idSpace) read(cl *mqtt.Client, pk *packets.Packet) {
	id := pk.PacketID
	switch pk.FixedHeader.Type {
	case packets.Publish:
		if pk.FixedHeader.Qos == 0 {
			return
		}
	case packets.Subscribe, packets.Unsubscribe:
	case packets.Pubrel: // the client's QoS 2 flow goes on
		if s.count.Load() == 0 {
			return
		}
		if r := s.of(cl.ID); r != nil {
			r.mu.Lock()
			if m, ok := r.toMochi[id]; ok {
				pk.PacketID = m
			}
			r.mu.Unlock()
		}
		return
	default:
		return // acknowledgements of the server's own messages
	}
	held, busy := cl.State.Inflight.Get(id)
	if !busy && s.count.Load() == 0 {
		return // the common case: nothing to rename, no lookup
	}
	r := s.of(cl.ID)
	if r == nil && (!busy || inbound(held)) {
		return // nothing to rename
	}
	if r == nil {
		v, loaded := s.sessions.LoadOrStore(cl.ID, &renames{toClient: map[uint16]uint16{}, toMochi: map[uint16]uint16{}, next: 0xFFFF})
		if !loaded {
			s.count.Add(1)
		}
		r = v.(*renames)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	qos2 := pk.FixedHeader.Type == packets.Publish && pk.FixedHeader.Qos == 2
	if m, ok := r.toMochi[id]; ok && qos2 {
		pk.PacketID = m // a QoS 2 PUBLISH sent again
		return
	}
	if _, renamed := r.toClient[id]; !renamed && (!busy || inbound(held)) {
		// Free, or held by the client's own QoS 2 flow: mochi answers
		// a reuse as MQTT says.
		return
	}
	m := r.free(cl)
	r.toClient[m] = id
	if qos2 {
		r.toMochi[id] = m
	}
	pk.PacketID = m
	return
}

// inbound reports whether an inflight entry belongs to a flow the client
// started (mochi's PUBREC or PUBCOMP to it), not to a server PUBLISH.
func inbound(held packets.Packet) bool {
	return held.FixedHeader.Type == packets.Pubrec || held.FixedHeader.Type == packets.Pubcomp
}

func (s *idSpace) of(clientID string) *renames {
	if v, ok := s.sessions.Load(clientID); ok {
		return v.(*renames)
	}
	return nil
}

// free returns an id mochi holds nothing under and no rename uses,
// searching down from the top of the range, far from where mochi numbers
// its own messages (upwards from 1).
func (r *renames) free(cl *mqtt.Client) uint16 {
	m := r.next
	for range 0xFFFF { // never all taken: inflight is bounded far below
		if m == 0 {
			m = 0xFFFF
		}
		_, busy := cl.State.Inflight.Get(m)
		if _, used := r.toClient[m]; !busy && !used {
			break
		}
		m--
	}
	r.next = m - 1
	return m
}

// write renames the id of an acknowledgement mochi writes back to what
// the client used.
func (s *idSpace) write(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	switch pk.FixedHeader.Type {
	case packets.Puback, packets.Pubcomp, packets.Suback, packets.Unsuback:
		pk.PacketID = s.ackID(cl, pk.PacketID)
	case packets.Pubrec:
		pk.PacketID = s.clientID(cl, pk.PacketID, false)
	}
	return pk
}

// ackID is the id the client used for the packet mochi knows as id, which
// is being acknowledged for the last time.
func (s *idSpace) ackID(cl *mqtt.Client, id uint16) uint16 { return s.clientID(cl, id, true) }

// clientID is the id the client used for the packet mochi knows as id;
// with end, the rename ends (the flow is over).
func (s *idSpace) clientID(cl *mqtt.Client, id uint16, end bool) uint16 {
	if s.count.Load() == 0 {
		return id
	}
	r := s.of(cl.ID)
	if r == nil {
		return id
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	theirs, ok := r.toClient[id]
	if !ok {
		return id
	}
	if end {
		delete(r.toClient, id)
		delete(r.toMochi, theirs)
	}
	return theirs
}

// forget drops the renames of a session that ended.
func (s *idSpace) forget(clientID string) {
	if _, ok := s.sessions.LoadAndDelete(clientID); ok {
		s.count.Add(-1)
	}
}
