package broker

import (
	"slices"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// sequencer keeps the messages a session holds unacknowledged in the order
// they were published, so that a client coming back gets them in that
// order, as MQTT requires [MQTT-4.6.0-1].
//
// mochi resends a session's messages sorted by uint16(Created), Created
// being the Unix second the message arrived: messages of the same second
// come back in random order, and every 18 hours the low 16 bits wrap and
// the order flips. mqkv sets no maximum message expiry, so mochi uses
// Created for nothing else (expiry deadlines are computed before), and the
// sequencer makes it an order number in two steps:
//
//   - every message gets a broker-wide number as it is published (stamp),
//     which every copy routed to a session inherits, including the one
//     mochi stores again when the client's Receive Maximum is exhausted;
//     numbers start at the start time in nanoseconds, so they keep growing
//     across restarts and messages restored from disk sort first;
//   - just before mochi resends a session's messages (when the CONNACK of
//     a resumed session is written), they are renumbered 0..n-1 in that
//     order, so that the low 16 bits mochi sorts by are in order too.
type sequencer struct{ next atomic.Int64 }

func newSequencer() *sequencer {
	q := &sequencer{}
	q.next.Store(time.Now().UnixNano())
	return q
}

// stamp numbers a message being published.
func (q *sequencer) stamp(pk *packets.Packet) { pk.Created = q.next.Add(1) }

// renumber gives the session's messages the numbers 0..n-1 in the order
// they were published. It runs before the resend: the client has not
// been sent them on this connection, so none can be acknowledged
// meanwhile. (A message published into the session at this very moment
// may be resent before older ones: mochi also sends it directly, so its
// order against the resend is not defined anyway.)
func (q *sequencer) renumber(cl *mqtt.Client) {
	held := cl.State.Inflight.GetAll(false)
	slices.SortStableFunc(held, func(a, b packets.Packet) int {
		switch {
		case a.Created < b.Created:
			return -1
		case a.Created > b.Created:
			return 1
		}
		return 0
	})
	for i, m := range held {
		if _, ok := cl.State.Inflight.Get(m.PacketID); !ok {
			continue
		}
		m.Created = int64(i)
		cl.State.Inflight.Set(m)
	}
}
