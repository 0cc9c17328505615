package broker

import (
	"strings"
	"sync/atomic"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/statestore"
)

// hook connects mochi's events to the broker: authentication and
// authorization, state store requests off the request topic, and the end
// of a connection.
type hook struct {
	mqtt.HookBase
	b *Broker
}

func (h *hook) ID() string { return "mqkv" }

// Provides is asked by mochi for every hook on every event (several per
// packet), so it is a switch, not a search.
func (h *hook) Provides(b byte) bool {
	switch b {
	case mqtt.OnConnect,
		mqtt.OnConnectAuthenticate,
		mqtt.OnSessionEstablished,
		mqtt.OnACLCheck,
		mqtt.OnPublish,
		mqtt.OnPublishDropped,
		mqtt.OnQosDropped,
		mqtt.OnDisconnect,
		mqtt.OnPacketEncode,
		mqtt.OnPacketRead,
		mqtt.OnClientExpired,
		mqtt.OnSubscribed,
		mqtt.OnUnsubscribed:
		return true
	}
	return false
}

// OnConnect authenticates; a refused client has had its CONNACK and the
// returned error ends the connection.
func (h *hook) OnConnect(cl *mqtt.Client, pk packets.Packet) error {
	if h.b.serverKeepAlive > 0 && cl.Properties.ProtocolVersion == 5 {
		// mochi sends it in CONNACK and times the connection by it
		// (MQTT-3.2.2-21: the client must use it instead of its own).
		cl.State.ServerKeepalive, cl.State.Keepalive = true, h.b.serverKeepAlive
	}
	// The server never sends topic aliases (a client's Topic Alias
	// Maximum allows them, MQTT-3.2.2-17, it does not ask for them).
	// mochi's choice of them was wrong twice: it stored messages with the
	// alias in place of the topic and resent them so on the next
	// connection, where the alias means nothing (MQTT-3.3.2-10), and a
	// message held for the Receive Maximum could carry the alias's only
	// definition while later ones that use it went ahead.
	cl.Properties.Props.TopicAliasMaximum = 0
	if cc, ok := cl.Net.Conn.(*clientConn); ok {
		cc.onSlow(func() { h.b.slowConsumer(cl) })
		h.b.countWindow(cl, cc)
	}
	return h.b.authenticate(cl, pk)
}

func (h *hook) OnConnectAuthenticate(cl *mqtt.Client, _ packets.Packet) bool {
	return h.b.connOf(cl) != nil
}

// OnSessionEstablished cancels a delayed will of the client and judges the subscriptions a resumed session brought
// along against the client's current grant.
func (h *hook) OnSessionEstablished(cl *mqtt.Client, _ packets.Packet) {
	h.b.routes.changed() // mochi re-adds a resumed session's subscriptions without a hook
	h.b.cancelWill(cl.ID)
	if cc, ok := cl.Net.Conn.(*clientConn); ok {
		h.b.countWindow(cl, cc) // again: mochi set its own count when it took the session over
	}
	if c := h.b.connOf(cl); c != nil {
		h.b.pruneSubscriptions(cl, c)
	}
}

func (h *hook) OnACLCheck(cl *mqtt.Client, topic string, write bool) bool {
	return h.b.allowed(cl, topic, write)
}

// OnPacketEncode keeps user properties on PUBLISH packets to clients that
// connected with Request Problem Information = 0. mochi drops them from
// every packet then, but MQTT 5 (3.1.2.11.7) only forbids them on packets
// other than PUBLISH, CONNACK and DISCONNECT; without them a reply loses
// __stat and __ts and no AIO client accepts it.
//
// It also renumbers a resumed session's messages before mochi resends
// them, right after the CONNACK (see sequencer).
//
// And it gives acknowledgements of the client's packets back the ids the
// client used (see idSpace).
func (h *hook) OnPacketEncode(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	if cl == nil {
		return pk
	}
	switch pk.FixedHeader.Type {
	case packets.Publish:
		pk.Mods.DisallowProblemInfo = false
	case packets.Connack:
		// mochi enforces its maximum packet size but does not tell
		// clients (MQTT 5, 3.2.2.3.6).
		pk.Properties.MaximumPacketSize = h.b.maxPacketSize
		// Nor the topic aliases it takes (absent means none, MQTT-3.2.2-17).
		pk.Properties.TopicAliasMaximum = TopicAliasMaximum
		if pk.SessionPresent {
			h.b.seq.renumber(cl)
		}
	default:
		pk = h.b.ids.write(cl, h.b.subLimits.write(cl, pk))
	}
	return pk
}

// OnPacketRead keeps the client's packet ids apart from the server's (see
// idSpace) and bounds what a SUBSCRIBE may add (see subscriptionLimits).
func (h *hook) OnPacketRead(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	h.b.ids.read(cl, &pk)
	if code := h.b.protocolError(cl, &pk); code != packets.CodeSuccess {
		// mochi would find most of these too, but its DISCONNECT can be
		// lost (see endConnection).
		endConnection(cl, code)
		return pk, code
	}
	switch t := pk.FixedHeader.Type; {
	case t == packets.Puback, t == packets.Pubcomp, t == packets.Pubrec && pk.ReasonCode >= 0x80:
		if cc, ok := cl.Net.Conn.(*clientConn); ok {
			h.b.acked(cl, cc, pk.PacketID)
		}
	}
	h.b.subLimits.read(cl, &pk)
	return pk, nil
}

// OnPublish hands requests to the state store. They are not routed to
// subscribers: the broker acknowledges QoS 1 itself, or, while mochi holds
// packets for the client, has mochi do it (CodeSuccessIgnore; returning
// ErrRejectPacket would not, mochi issue #465). Every other message is
// numbered for in-order resends (see sequencer), and written to its
// subscribers here if it can be (see publishDirect).
func (h *hook) OnPublish(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.TopicName != statestore.RequestTopic || cl.Net.Inline {
		cc, _ := cl.Net.Conn.(*clientConn)
		if cc != nil {
			h.b.topics.addFrom(pk.TopicName, &cc.lastTopic)
		} else if !cl.Net.Inline {
			h.b.topics.addFrom(pk.TopicName, nil)
		}
		if cc != nil && pk.FixedHeader.Qos > 0 {
			cc.AwaitNoReply()
		}
		h.b.seq.stamp(&pk)
		if !cl.Net.Inline && h.b.publishDirect(cl, pk) {
			// Delivered, and acknowledged if QoS 1: mochi is to do
			// nothing more. As QoS 0 to be ignored, it does just that;
			// ErrRejectPacket would too, but mochi logs each rejection
			// at debug level, a heap copy of the packet even when off.
			pk.FixedHeader.Qos, pk.Ignore = 0, true
		}
		return pk, nil
	}
	// Counted before the check, so that a shutdown that begins after it
	// waits for this request (see Broker.drain).
	h.b.handling.Start()
	defer h.b.handling.Done()
	if h.b.draining.Load() {
		// Shutting down: neither handled nor acknowledged. The client
		// sends it again once it reconnects.
		pk.FixedHeader.Qos, pk.Ignore = 0, true
		return pk, nil
	}
	c := h.b.connOf(cl)
	if c == nil {
		return pk, packets.CodeSuccessIgnore
	}
	if !h.b.responseAllowed(c, pk.Properties.ResponseTopic) {
		h.b.log.Info("client disconnected: response topic not allowed", "client", cl.ID, "topic", pk.Properties.ResponseTopic)
		h.b.kick(cl, packets.ErrNotAuthorized)
		return pk, packets.CodeSuccessIgnore
	}
	if pk.FixedHeader.Qos == 2 {
		if cl.State.Inflight.Set(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID}) {
			// mochi records a QoS 2 request's PUBREC under its id only
			// after this hook, in the one map it keeps for both
			// directions: a reply made meanwhile (a GET's, here) could
			// take the same id and lose its record to the PUBREC.
			// Recorded now, the id is taken until mochi's record
			// replaces this one. (A QoS 1 request leaves no record: see
			// below.)
			atomic.AddInt64(&h.b.srv.Info.Inflight, 1)
		}
	}
	if pk.FixedHeader.Qos > 0 {
		// The reply comes back on this connection (the SDKs subscribe
		// to their own response topics): the PUBACK goes with it.
		if cc, ok := cl.Net.Conn.(*clientConn); ok && pk.Properties.ResponseTopic != "" && h.b.repliesTo(cl, pk.Properties.ResponseTopic) {
			cc.ExpectReply()
		}
	}
	req := &statestore.Request{
		ClientID:        cl.ID,
		Conn:            c.id,
		Origin:          c,
		Grant:           c.grant.Load(),
		Payload:         pk.Payload,
		ResponseTopic:   pk.Properties.ResponseTopic,
		CorrelationData: pk.Properties.CorrelationData,
		QoS:             pk.FixedHeader.Qos,
		MessageExpiry:   pk.Properties.MessageExpiryInterval,
	}
	for _, u := range pk.Properties.User {
		switch u.Key {
		case "__ts":
			req.Timestamp, req.HasTimestamp = u.Val, true
		case "__ft":
			req.FencingToken, req.HasFencingToken = u.Val, true
		}
	}
	h.b.handle(cl, c, req)
	if pk.FixedHeader.Qos == 1 {
		// Acknowledged here; mochi, told the request was QoS 0 and to be
		// ignored, does nothing more. mochi would record the PUBACK in
		// its inflight map for the time it takes to write it, in the
		// one map it keeps for both directions, where it would replace
		// a reply made meanwhile under the same id (the ids of the two
		// directions are apart in MQTT 5: the client's PUBACK for that
		// reply may follow this one). Keeping a request's id out of
		// the replies' way would cost a record per request: 45 % of
		// the bytes allocated under GET load.
		// Encoded by the broker (see wire.go) and written directly once
		// mochi holds nothing for the client, which may include an
		// earlier PUBACK (MQTT-4.6.0-2); else through mochi, behind what
		// it holds, its id renamed back in OnPacketEncode like mochi's
		// own.
		if !mochiQueued(cl) {
			h.b.puback(cl, pk.PacketID)
		} else if err := cl.WritePacket(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: pk.PacketID}); err != nil {
			h.b.log.Debug("write failed", "client", cl.ID, "error", err)
		}
		pk.FixedHeader.Qos, pk.Ignore = 0, true // ignored: neither routed nor retained
		return pk, nil
	}
	return pk, packets.CodeSuccessIgnore
}

// OnSubscribed and OnUnsubscribed (also called by mochi's
// UnsubscribeClient, when a session ends or starts clean): the topic
// index changed (see routes).
func (h *hook) OnSubscribed(*mqtt.Client, packets.Packet, []byte) { h.b.routes.changed() }

func (h *hook) OnUnsubscribed(*mqtt.Client, packets.Packet) { h.b.routes.changed() }

func (h *hook) OnPublishDropped(cl *mqtt.Client, pk packets.Packet) {
	if strings.HasPrefix(pk.TopicName, statestore.NotifyPrefix) {
		h.b.Counters.NotificationsDropped.Add(1)
	}
	h.b.slowConsumer(cl)
}

// OnQosDropped counts back the messages a resumed session took with it.
// mochi (v2.7.9, inheritClientSession) moves the old connection's
// messages in flight to the new one, then clears them from the old one as
// if dropped, lowering its count of messages in flight by as many; each
// later goes once more when acknowledged, and the count, published as
// $SYS/broker/messages/inflight, went below zero. A taken-over client's
// messages are not dropped; those of a session that starts clean are
// cleared before the client is marked taken over, and stay uncounted.
func (h *hook) OnQosDropped(cl *mqtt.Client, _ packets.Packet) {
	if cl.IsTakenOver() {
		atomic.AddInt64(&h.b.srv.Info.Inflight, 1)
	}
}

// OnClientExpired ends an expired session's subscriptions: mochi forgets
// the client but leaves them in the topic index, where a later client
// reusing the id would inherit them.
func (h *hook) OnClientExpired(cl *mqtt.Client) {
	h.b.srv.UnsubscribeClient(cl) // OnUnsubscribed: routes changed
	h.b.ids.forget(cl.ID)
}

// OnDisconnect sends the client's will unless it ended with a normal
// DISCONNECT (mochi reports that as no error).
func (h *hook) OnDisconnect(cl *mqtt.Client, err error, expire bool) {
	if expire && !cl.IsTakenOver() {
		h.b.ids.forget(cl.ID)
	}
	h.b.subLimits.forget(cl)
	if c := h.b.connOf(cl); c != nil {
		if err != nil {
			h.b.dueWill(cl, c)
		}
		h.b.forget(cl, c)
	} else {
		h.b.dropNotifySubscription(cl)
	}
}
