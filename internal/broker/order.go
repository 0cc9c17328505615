package broker

import (
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// sequencer keeps the messages a session holds unacknowledged in the order
// they were first sent, so that a client coming back gets them in that
// order, as MQTT requires [MQTT-4.6.0-1].
//
// mochi resends a session's messages sorted by uint16(Created), Created
// being the Unix second the message arrived: messages of the same second
// come back in random order, and every 18 hours the low 16 bits wrap and
// the order flips. mqkv sets no maximum message expiry, so mochi uses
// Created for nothing else; the sequencer overwrites it with a per-session
// counter. When the counter would wrap, the session's messages are
// renumbered from zero: a session holds at most MaxQueued (< 65,536) of
// them, so the numbers always fit and sort as sent.
//
// Order is kept per publisher, which is what MQTT asks: one publisher's
// messages reach the subscriber's session one after another from its
// connection's goroutine.
type sequencer struct {
	mu   sync.Mutex
	next map[string]uint16 // client id → number of its next message
	// renumbered is told of each message whose number changed, so that
	// the session store keeps the new one.
	renumbered func(*mqtt.Client, packets.Packet)
}

func newSequencer() *sequencer { return &sequencer{next: map[string]uint16{}} }

// stamp numbers a message just added to cl's session.
func (q *sequencer) stamp(cl *mqtt.Client, pk packets.Packet) {
	if pk.FixedHeader.Type != packets.Publish || pk.FixedHeader.Dup {
		return // an ack, or a resend keeping its number
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	n, known := q.next[cl.ID]
	if !known || n == 0xffff {
		n = q.renumber(cl, pk.PacketID)
	}
	pk.Created = int64(n)
	// Set replaces the copy mochi stored, which still carries the second.
	cl.State.Inflight.Set(pk)
	q.next[cl.ID] = n + 1
}

// renumber gives the session's messages other than skip the numbers 0..n-1
// in their present order and returns n. A session restored from disk
// starts here too.
//
// A message acknowledged between the Get and the Set below would come back
// and be delivered once more at the next reconnect: a duplicate, which QoS
// 1 allows, in a window of nanoseconds once per 65,535 messages. mochi
// offers no compare-and-set to close it.
func (q *sequencer) renumber(cl *mqtt.Client, skip uint16) uint16 {
	var n uint16
	for _, m := range cl.State.Inflight.GetAll(false) {
		if m.PacketID == skip || m.FixedHeader.Type != packets.Publish {
			continue
		}
		if _, ok := cl.State.Inflight.Get(m.PacketID); !ok {
			continue
		}
		m.Created = int64(n)
		cl.State.Inflight.Set(m)
		if q.renumbered != nil {
			q.renumbered(cl, m)
		}
		n++
	}
	return n
}

// forget drops the counter of a session that has ended.
func (q *sequencer) forget(clientID string) {
	q.mu.Lock()
	delete(q.next, clientID)
	q.mu.Unlock()
}
