package broker

import (
	"strings"
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Will messages are sent by the broker, not by mochi: mochi publishes a
// will straight to subscribers, without the authorization a PUBLISH gets,
// and keeps delayed wills where nothing can judge them again. A will is a
// publish by its client, so it is checked like one twice: at CONNECT (a
// will the client may not publish refuses the connection with 0x87, as
// mosquitto does: the client learns at once, instead of finding out when it
// is gone that nobody heard its will) and when it is sent (the policy may
// have been reloaded meanwhile; then it is dropped and logged).

// will is a client's will message, kept from its CONNECT.
type will struct {
	principal policy.Principal
	pk        packets.Packet // the PUBLISH to send
	delay     time.Duration  // Will Delay Interval
}

// wills holds the delayed wills of clients that went away, by client id.
type wills struct {
	mu      sync.Mutex
	pending map[string]*time.Timer
}

// takeWill moves a connecting client's will from mochi's care into the
// connection record. It returns false when the client may not publish the
// will's topic.
func (b *Broker) takeWill(cl *mqtt.Client, pk packets.Packet, c *conn) bool {
	if !pk.Connect.WillFlag {
		return true
	}
	if !willAllowed(c.grant.Load(), pk.Connect.WillTopic) {
		b.log.Info("connection refused: will topic not allowed", "client", cl.ID, "topic", pk.Connect.WillTopic)
		return false
	}
	wp := pk.Connect.WillProperties
	props := packets.Properties{ // the will properties a PUBLISH carries (MQTT-3.1.3.2)
		PayloadFormat:         wp.PayloadFormat,
		PayloadFormatFlag:     wp.PayloadFormatFlag,
		MessageExpiryInterval: wp.MessageExpiryInterval,
		ContentType:           wp.ContentType,
		ResponseTopic:         wp.ResponseTopic,
		CorrelationData:       wp.CorrelationData,
		User:                  wp.User,
	}
	c.will.Store(&will{
		principal: c.principal,
		pk: packets.Packet{
			FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: pk.Connect.WillQos, Retain: pk.Connect.WillRetain},
			TopicName:   pk.Connect.WillTopic,
			Payload:     pk.Connect.WillPayload,
			Properties:  props,
			PacketID:    1, // required for QoS > 0; the inline client never sees acks
		},
		// mochi has already cut the delay to the session expiry
		// (MQTT-3.1.3-9: the will goes when the session ends, if earlier).
		delay: time.Duration(cl.Properties.Will.WillDelayInterval) * time.Second,
	})
	cl.Properties.Will = mqtt.Will{} // mochi never sends it
	return true
}

// willAllowed decides whether a will may be published to topic: as a
// PUBLISH would be, except that the state store's topics are closed to
// wills (a will on the request topic would bypass the store's per-key
// authorization; one under the notification prefix would forge a
// notification).
func willAllowed(g *policy.Grant, topic string) bool {
	if !mqtt.IsValidFilter(topic, true) || topic == statestore.RequestTopic || strings.HasPrefix(topic, statestore.NotifyPrefix) {
		return false
	}
	return g.CanPublish(topic)
}

// dueWill sends or schedules the will of a connection that ended without a
// normal DISCONNECT.
func (b *Broker) dueWill(cl *mqtt.Client, c *conn) {
	w := c.will.Swap(nil)
	if w == nil {
		return
	}
	delay := willDelay(cl, w)
	if delay == 0 {
		b.sendWill(cl.ID, w)
		return
	}
	if cur, ok := b.srv.Clients.Get(cl.ID); ok && cur != cl && !cur.Closed() {
		return // taken over: the new connection cancels the will (MQTT-3.1.3-9)
	}
	b.scheduleWill(cl, w, delay)
}

// scheduleWill sends cl's will after delay, unless cancelled (see
// cancelWill).
func (b *Broker) scheduleWill(cl *mqtt.Client, w *will, delay time.Duration) {
	b.wills.mu.Lock()
	defer b.wills.mu.Unlock()
	if t := b.wills.pending[cl.ID]; t != nil {
		t.Stop()
	}
	var t *time.Timer
	t = time.AfterFunc(delay, func() {
		b.wills.mu.Lock()
		mine := b.wills.pending[cl.ID] == t
		if mine {
			delete(b.wills.pending, cl.ID)
		}
		b.wills.mu.Unlock()
		if mine {
			b.sendWill(cl.ID, w)
			if cur, ok := b.srv.Clients.Get(cl.ID); ok && cur == cl {
				b.keepSession(cl, nil, time.Unix(cl.StopTime(), 0), false) // sent: the record keeps it no more
			}
		}
	})
	b.wills.pending[cl.ID] = t
}

// willDelay is how long after its connection ended a will is due.
func willDelay(cl *mqtt.Client, w *will) time.Duration {
	delay := w.delay
	if cl.Properties.ProtocolVersion == 5 {
		// The session may end sooner than the delay cut at CONNECT: a
		// DISCONNECT can shorten its expiry, to zero (MQTT-3.1.3-9:
		// the will goes when the session ends, if that is earlier).
		delay = min(delay, time.Duration(cl.Properties.Props.SessionExpiryInterval)*time.Second)
	}
	return delay
}

// cancelWill drops the delayed will of a client that came back in time
// (MQTT-3.1.3-9).
func (b *Broker) cancelWill(clientID string) {
	b.wills.mu.Lock()
	defer b.wills.mu.Unlock()
	if t := b.wills.pending[clientID]; t != nil {
		t.Stop()
		delete(b.wills.pending, clientID)
	}
}

// dropWills forgets every delayed will (the broker is stopping).
func (b *Broker) dropWills() {
	b.wills.mu.Lock()
	defer b.wills.mu.Unlock()
	for id, t := range b.wills.pending {
		t.Stop()
		delete(b.wills.pending, id)
	}
}

// sendWill publishes a will if its client may still publish there under
// the policy in force now.
func (b *Broker) sendWill(clientID string, w *will) {
	var g *policy.Grant
	if p := b.security.Load().Policy; p != nil {
		g = p.Grant(w.principal)
	}
	if !willAllowed(g, w.pk.TopicName) {
		b.Counters.WillsDropped.Add(1)
		b.log.Info("will dropped: topic no longer allowed", "client", clientID, "topic", w.pk.TopicName)
		return
	}
	if err := b.srv.InjectPacket(b.inline, w.pk); err != nil {
		b.log.Warn("will not published", "client", clientID, "topic", w.pk.TopicName, "error", err)
	}
}
