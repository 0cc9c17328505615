package broker

import (
	"bytes"
	"cmp"
	"context"
	"math/rand/v2"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/route"
)

// Routing: the broker delivers every message itself.
//
// mochi routes a message by walking its topic index, building maps of the
// subscribers, copying the message for each and handing the copy to the
// subscriber's write goroutine: a goroutine switch per delivery, and
// about a fifth of the broker's CPU in a pub/sub round trip. And it
// merges a client's overlapping subscriptions into one whose No Local
// keeps the client's own message from it if any of them has it. So every
// message published here, by a client or by the broker (replies,
// notifications, wills), is routed by route: mochi is told to ignore it
// (it still acknowledges it, and runs a QoS 2 exchange). A topic's
// subscribers are remembered until the topic index changes; each
// subscriber is written to directly when it can be, as mosquitto's one
// thread does: the message is encoded into its connection, which never
// waits on its socket for another client (see clientConn.Write). A
// subscriber that cannot be (offline, its connection backed up, or with
// messages queued in mochi, which a later message must not overtake,
// MQTT-4.6.0-6) gets it through mochi's queue, as mochi would have queued
// it (see enqueue). Replies to state store requests take a path of their
// own when their client alone subscribes to the response topic (see
// replies.go).

// routes remembers, per topic, its subscribers. Any change to the topic
// index bumps the generation and forgets everything.
type routes struct {
	gen   atomic.Uint64
	mu    sync.Mutex
	at    uint64            // the generation m was filled at
	m     map[string]fanout // topic → its subscribers
	bytes int               // of the topics in m
}

// fanout is a topic's subscribers: plain subscriptions, one target per
// client, and shared subscription groups (each message goes to one member
// of each group). own holds the clients whose merged subscription says No
// Local (mochi merges a client's matching subscriptions into one, No Local
// if any of them has it) while another of their matching subscriptions
// does not: their own messages still reach them (MQTT-3.8.3-3 keeps a
// message from a connection only on account of a No Local subscription).
type fanout struct {
	subs   []target
	shared []sharedGroup
	own    map[string]struct{}
	// roams says a subscriber's session is kept in the store (see
	// keepMessage): a QoS 1 message's acknowledgement waits for it.
	roams bool
}

// sharedGroup is the members of one shared subscription group
// ($share/name/filter) whose filter matches a topic.
type sharedGroup struct {
	filter  string
	members []target
}

// plain reports whether the topic has no shared subscriber: its
// subscribers are subs.
func (f *fanout) plain() bool { return len(f.shared) == 0 }

// skipsOwn reports whether a message the client itself published is kept
// from it under sub, its merged subscription to the topic.
func (f *fanout) skipsOwn(client string, sub packets.Subscription) bool {
	if !sub.NoLocal {
		return false
	}
	_, ok := f.own[client]
	return !ok
}

// target is one client's subscriptions matching a topic, merged. ids are
// their subscription identifiers, sorted, as every message to the client
// carries them (MQTT-3.3.4-3), none if no subscription has one: found
// once per topic, not per message.
type target struct {
	client string
	sub    packets.Subscription
	ids    []int
}

// newTarget is client's merged subscription sub as a target.
func newTarget(client string, sub packets.Subscription) target {
	t := target{client: client, sub: sub}
	for _, id := range sub.Identifiers {
		if id > 0 { // mochi keeps 0 for a subscription without one
			t.ids = append(t.ids, id)
		}
	}
	if len(t.ids) == 0 && sub.Identifier > 0 {
		t.ids = append(t.ids, sub.Identifier)
	}
	slices.Sort(t.ids)
	t.ids = slices.Clip(t.ids) // an append to a message's copy must not reach the others
	return t
}

// maxRoutes and maxRouteBytes bound the memory of routes: past either, it
// starts over. Bytes too: topics may be 64 KiB long, and a client
// publishing to endless long ones would otherwise pin gigabytes.
const (
	maxRoutes     = 1 << 16
	maxRouteBytes = 16 << 20
)

// changed records a change to the topic index (a subscription added or
// removed anywhere).
func (rr *routes) changed() { rr.gen.Add(1) }

// lookup returns topic's fanout, finding it with find when not known at
// this generation.
func (rr *routes) lookup(topic string, find func() fanout) fanout {
	gen := rr.gen.Load()
	rr.mu.Lock()
	if rr.m == nil || rr.at != gen || len(rr.m) >= maxRoutes || rr.bytes >= maxRouteBytes {
		rr.m, rr.at, rr.bytes = map[string]fanout{}, gen, 0
	}
	f, ok := rr.m[topic]
	rr.mu.Unlock()
	if ok {
		return f
	}
	f = find()
	rr.mu.Lock()
	if rr.at == gen {
		rr.m[topic] = f
		rr.bytes += len(topic)
	}
	rr.mu.Unlock()
	return f
}

// fanoutOf returns the topic's subscribers.
func (b *Broker) fanoutOf(topic string) fanout {
	return b.routes.lookup(topic, func() fanout {
		subs := b.srv.Topics.Subscribers(topic)
		f := fanout{subs: make([]target, 0, len(subs.Subscriptions))}
		for id, sub := range subs.Subscriptions {
			if sub.NoLocal && b.receivesOwn(id, topic) {
				if f.own == nil {
					f.own = map[string]struct{}{}
				}
				f.own[id] = struct{}{}
			}
			f.subs = append(f.subs, newTarget(id, sub))
			f.roams = f.roams || b.roams(id)
		}
		for filter, members := range subs.Shared {
			g := sharedGroup{filter: filter}
			for id, sub := range members {
				g.members = append(g.members, newTarget(id, sub))
				f.roams = f.roams || b.roams(id)
			}
			f.shared = append(f.shared, g)
		}
		return f
	})
}

// receivesOwn reports whether the client holds a subscription without No
// Local that matches topic. Asked only of a client whose merged
// subscription to the topic has No Local, once per topic until the topic
// index changes.
func (b *Broker) receivesOwn(client, topic string) bool {
	cl, ok := b.srv.Clients.Get(client)
	if !ok {
		return false
	}
	for filter, sub := range cl.State.Subscriptions.GetAll() {
		if !sub.NoLocal && !mqtt.IsSharedFilter(filter) && route.Match(filter, topic) {
			return true
		}
	}
	return false
}

// acceptPublish routes a client's message (see route) and tells mochi
// what is left for it to do, in what it returns: nothing for a QoS 0 or
// 1 message (a QoS 1 message is acknowledged here), the QoS 2 exchange.
// pk is the message as mochi has it in OnPublish: stamped, with its
// expiry set.
//
// A QoS 1 message that goes to other nodes is acknowledged once they have
// it (see pubacks), and so, in order, is every later one while it waits;
// otherwise at once, first, as mochi does.
func (b *Broker) acceptPublish(from *mqtt.Client, pk packets.Packet) packets.Packet {
	if pk.FixedHeader.Qos == 2 && b.waitsForOthers(pk) {
		// mochi writes the PUBREC once this returns: it waits here, on
		// the client's reader, for the other nodes, the retained write
		// and the sessions kept in the store, as a QoS 1 PUBACK does
		// (in order, as the reader takes the client's packets in turn).
		ready := make(chan struct{})
		a := &pendingAck{release: func() { close(ready) }}
		a.waiting.Store(1)
		b.route(from, pk, a)
		a.done()
		select {
		case <-ready:
		case <-time.After(qos2Wait):
			b.log.Warn("PUBREC sent before the other nodes took the message", "client", from.ID, "topic", pk.TopicName)
		}
		pk.Ignore = true
		return pk
	}
	if pk.FixedHeader.Qos != 1 {
		b.route(from, pk, nil)
		pk.Ignore = true // mochi runs a QoS 2 exchange, and routes nothing
		return pk
	}
	c := b.connOf(from)
	if c == nil || c.acks.idle() && !b.waitsForOthers(pk) {
		if !mochiQueued(from) {
			b.puback(from, pk.PacketID)
		} else {
			// Its PUBACK would overtake one mochi holds (MQTT-4.6.0-2):
			// mochi writes it, after this hook.
			b.route(from, pk, nil)
			pk.Ignore = true
			return pk
		}
		b.route(from, pk, nil)
	} else {
		a := c.acks.push(pk.PacketID, func() { b.releaseAcks(from, &c.acks) })
		b.route(from, pk, a)
		a.done() // the sends are all made
	}
	// Told the message is QoS 0 and to be ignored, mochi does nothing
	// more (ErrRejectPacket would also, but mochi logs each rejection at
	// debug level, a heap copy of the packet even when off).
	pk.FixedHeader.Qos, pk.Ignore = 0, true
	return pk
}

// waitsForOthers reports whether a QoS 1 or 2 message's acknowledgement
// waits for more than this node's subscribers: other nodes that want it,
// its retained write, a subscriber's session kept in the store.
func (b *Broker) waitsForOthers(pk packets.Packet) bool {
	return b.wantsRemote(pk.TopicName) || pk.FixedHeader.Retain && b.retained != nil || b.roam != nil && b.fanoutOf(pk.TopicName).roams
}

// qos2Wait bounds a QoS 2 message's wait for the other nodes (mesh.GiveUp
// and a dead member's sessions taken up are well within it).
const qos2Wait = 30 * time.Second

// route delivers a message published on this node (by a client, from; by
// the broker itself, from is its inline client): a retained message is
// kept first (MQTT-3.3.1-5), the other nodes that want it are sent it
// (see sendRemote), and it is delivered to this node's subscribers. a, if
// not nil, is the message's acknowledgement: it waits for the store's
// write and the other nodes (see pubacks).
func (b *Broker) route(from *mqtt.Client, pk packets.Packet, a *pendingAck) {
	if pk.FixedHeader.Retain {
		b.retain(pk, a)
	}
	var keep map[string]bool // the shared groups this node serves; nil: all
	if b.peers != nil {
		keep = b.sendRemote(&pk, b.fanoutOf(pk.TopicName).shared, a)
	}
	b.deliverLocal(pk.Origin, pk, from, true, keep, a, nil)
}

// deliverLocal delivers pk to this node's subscribers: the ordinary ones
// if plain, and one member of each shared group (of those in groups, if
// not nil). origin is the publishing client's id (No Local); from, if not
// nil, the client whose reader or whose broker calls. a, if not nil, waits
// for the deliveries into sessions kept in the store (see keepMessage).
// only, if not nil, names sessions taken up from a member that died: the
// message goes to them alone (see GivenUp).
func (b *Broker) deliverLocal(origin string, pk packets.Packet, from *mqtt.Client, plain bool, groups map[string]bool, a *pendingAck, only *takenUp) {
	f := b.fanoutOf(pk.TopicName)
	out := packets.Packet{
		FixedHeader:     packets.FixedHeader{Type: packets.Publish, Qos: pk.FixedHeader.Qos, Retain: pk.FixedHeader.Retain},
		TopicName:       pk.TopicName,
		Payload:         pk.Payload,
		Properties:      pk.Properties,
		Origin:          pk.Origin,
		Created:         pk.Created,
		Expiry:          pk.Expiry,
		ProtocolVersion: pk.ProtocolVersion,
	}
	// Not passed on (MQTT-3.3.2-7); the rest is shared, read only, by
	// every copy.
	out.Properties.TopicAlias, out.Properties.TopicAliasFlag = 0, false
	out.Properties.SubscriptionIdentifier = nil
	reader := from != nil && !from.Net.Inline
	if f.plain() {
		if plain {
			for i := range f.subs {
				b.deliver(origin, from, &f.subs[i], out, reader, &f, a, only)
			}
		}
		return
	}
	// A client picked by a shared group that also subscribed to the topic
	// itself gets one copy, its subscriptions merged (as mochi did).
	picked := map[string]target{}
	for _, g := range f.shared {
		if groups != nil && !groups[g.filter] {
			continue // another node's to serve
		}
		t := b.pickMember(g)
		if p, ok := picked[t.client]; ok {
			t = newTarget(t.client, p.sub.Merge(t.sub))
		}
		picked[t.client] = t
	}
	if plain {
		for i := range f.subs {
			t := f.subs[i]
			if p, ok := picked[t.client]; ok {
				t = newTarget(t.client, t.sub.Merge(p.sub))
				delete(picked, t.client)
			}
			b.deliver(origin, from, &t, out, reader, &f, a, only)
		}
	}
	for _, t := range picked {
		b.deliver(origin, from, &t, out, reader, &f, a, only)
	}
}

// pickMember chooses the member of a shared subscription group a message
// goes to: one whose client is connected, else (all are away, their
// sessions kept) any; map order makes it random.
func (b *Broker) pickMember(g sharedGroup) target {
	start := rand.IntN(len(g.members))
	for i := range g.members {
		t := g.members[(start+i)%len(g.members)]
		if cl, ok := b.srv.Clients.Get(t.client); ok && !cl.Closed() {
			return t
		}
	}
	return g.members[start]
}

// deliver sends out to the client of t, its subscriptions matching the
// topic merged: directly if it can be written to now, else through
// mochi's queue. origin is the publishing client's id; reader says from
// is a client whose reader goroutine calls (see write).
func (b *Broker) deliver(origin string, from *mqtt.Client, t *target, out packets.Packet, reader bool, f *fanout, a *pendingAck, only *takenUp) {
	if t.client == origin && f.skipsOwn(t.client, t.sub) { // MQTT-3.8.3-3, by client id cluster-wide
		return
	}
	if only != nil && !only.has(b, t.client) {
		return
	}
	cl, ok := b.srv.Clients.Get(t.client)
	if !ok || !b.allowed(cl, out.TopicName, false) {
		return // not delivered, as by mochi
	}
	if cl.Properties.ProtocolVersion < 5 || !t.sub.RetainAsPublished {
		out.FixedHeader.Retain = false // MQTT-3.3.1-12 (3.1.1: always)
	}
	own := reader && cl == from
	if b.directTo(cl, own, t.sub, min(out.FixedHeader.Qos, t.sub.Qos)) {
		b.deliverDirect(cl, *t, out, own, a)
		return
	}
	b.enqueue(cl, *t, out, a)
}

// retain keeps pk as its topic's retained message (an empty one removes
// it): in the store (see Retained), a (if not nil) waiting until it is
// committed. A broker without a store keeps them in memory.
func (b *Broker) retain(pk packets.Packet, a *pendingAck) {
	if b.retained == nil {
		b.mirror(pk)
		return
	}
	done := a.hold()
	var ttl int64
	if pk.Expiry > 0 {
		ttl = max(pk.Expiry-time.Now().Unix(), 1) * 1000
	}
	ctx, cancel := context.WithTimeout(context.Background(), retainTimeout)
	b.retained.Put(ctx, pk.TopicName, meshMessage(&pk), ttl, func(err error) {
		cancel()
		if err != nil {
			b.Counters.RetainFailed.Add(1)
			b.log.Warn("retained message not kept", "topic", pk.TopicName, "error", err)
		}
		done()
	})
}

// retainTimeout bounds the wait for a retained message's write.
const retainTimeout = 5 * time.Second

// MirrorRetained sets the retained message of topic as this node's
// subscribers see it (m nil: none): the store tells every node (see
// package retained).
func (b *Broker) MirrorRetained(topic string, m *mesh.Message) {
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Publish, Retain: true}, TopicName: topic}
	if m != nil {
		pk = packetOf(m)
	}
	b.mirror(pk)
}

// mirror puts pk in mochi's index of retained messages (an empty payload
// removes the topic's), which mochi reads for a new subscription.
func (b *Broker) mirror(pk packets.Packet) {
	if b.srv.Options.Capabilities.RetainAvailable == 0 {
		return
	}
	b.retainedIndex.Lock() // see hook.OnSubscribed
	b.srv.Topics.RetainMessage(pk.Copy(false))
	b.retainedIndex.Unlock()
	atomic.StoreInt64(&b.srv.Info.Retained, int64(b.srv.Topics.Retained.Len()))
}

// enqueue sends out to cl through mochi's queue for it, as mochi's
// publishToClient (v2.7.9) would: the session keeps a QoS 1 or 2 copy
// (for a client away, only there), and the client's write goroutine
// writes it after what it holds already.
func (b *Broker) enqueue(cl *mqtt.Client, t target, out packets.Packet, a *pendingAck) {
	out.FixedHeader.Qos = min(out.FixedHeader.Qos, t.sub.Qos, b.srv.Options.Capabilities.MaximumQos)
	out.Properties.SubscriptionIdentifier = t.ids // shared, read only (MQTT-3.3.4-3)
	if out.FixedHeader.Qos > 0 {
		if cl.State.Inflight.Len() >= int(b.srv.Options.Capabilities.MaximumInflight) {
			atomic.AddInt64(&b.srv.Info.InflightDropped, 1)
			b.log.Warn("message dropped: the client's session holds --max-queued unacknowledged messages", "client", cl.ID)
			return
		}
		id, err := cl.NextPacketID()
		if err != nil {
			atomic.AddInt64(&b.srv.Info.InflightDropped, 1)
			b.log.Warn("packet ids exhausted", "client", cl.ID, "error", err)
			return
		}
		out.PacketID = uint16(id)
		if cl.State.Inflight.Set(out) {
			atomic.AddInt64(&b.srv.Info.Inflight, 1)
			if b.sessions != nil {
				b.sessions.OnQosPublish(cl, out, out.Created, 0)
			}
			b.keepMessage(cl, out, a)
			if cl.IsTakenOver() {
				b.forwardIfTakenOver(cl, out) // see hook.OnQosPublish
				return
			}
		}
	}
	if cl.Net.Conn == nil || cl.Closed() {
		return // away: the session keeps it
	}
	if !mochiEnqueue(cl, &out) {
		atomic.AddInt64(&b.srv.Info.MessagesDropped, 1)
		b.slowConsumer(cl)
		if out.FixedHeader.Qos > 0 {
			cl.State.Inflight.Delete(out.PacketID) // as mochi: rolled back
		}
	}
}

// directTo reports whether a message at qos can be written to cl now,
// for its subscription sub. own says the writer is cl's own reader or
// reply writer: for those a backed-up connection is no reason to leave
// the message to mochi, behind whose queue it would wait the same.
func (b *Broker) directTo(cl *mqtt.Client, own bool, sub packets.Subscription, qos byte) bool {
	cc, ok := cl.Net.Conn.(*clientConn)
	if !ok || cl.Closed() {
		return false
	}
	if !own && cc.backedUp() || mochiQueued(cl) {
		return false
	}
	// The index may not be changed yet for a subscription just removed
	// (mochi ends a session's subscriptions after OnDisconnect).
	if _, ok := cl.State.Subscriptions.Get(sub.Filter); !ok {
		return false
	}
	if qos > 0 && cl.State.Inflight.Len()+1 >= int(b.srv.Options.Capabilities.MaximumInflight) {
		return false // mochi drops it (the client's Receive Maximum is its connection's: see window)
	}
	return true
}

// deliverDirect writes msg to cl for its subscriptions t, as mochi's
// publishToClient and WritePacket (v2.7.9) would: directTo said it may.
// reader says the writer is cl's reader, handling a packet (see write).
func (b *Broker) deliverDirect(cl *mqtt.Client, t target, out packets.Packet, reader bool, a *pendingAck) {
	out.FixedHeader.Qos = min(out.FixedHeader.Qos, t.sub.Qos, b.srv.Options.Capabilities.MaximumQos)
	out.Properties.SubscriptionIdentifier = t.ids // shared, read only (MQTT-3.3.4-3)
	if out.FixedHeader.Qos > 0 {
		id, err := cl.NextPacketID()
		if err != nil {
			// Dropped, as by mochi.
			atomic.AddInt64(&b.srv.Info.InflightDropped, 1)
			b.log.Warn("packet ids exhausted", "client", cl.ID, "error", err)
			return
		}
		out.PacketID = uint16(id)
	}
	var now int64
	if out.Expiry > 0 {
		now = time.Now().Unix()
	}
	var buf [512]byte
	frame, ok := appendPublish(buf[:0], &out, cl.Properties.ProtocolVersion, cl.Properties.Props.MaximumPacketSize, now)
	if !ok {
		// Larger than the client takes: not sent (MQTT-3.1.2-25), nor
		// kept for a resend that could never be sent either.
		atomic.AddInt64(&b.srv.Info.MessagesDropped, 1)
		b.log.Debug("message larger than the client's maximum packet size dropped", "client", cl.ID, "topic", out.TopicName)
		return
	}
	if out.FixedHeader.Qos > 0 && cl.State.Inflight.Set(out) {
		atomic.AddInt64(&b.srv.Info.Inflight, 1)
		if b.sessions != nil {
			b.sessions.OnQosPublish(cl, out, out.Created, 0)
		}
		b.keepMessage(cl, out, a)
		cl.State.Inflight.DecreaseSendQuota()
		if cl.IsTakenOver() {
			b.forwardIfTakenOver(cl, out) // see hook.OnQosPublish
			return
		}
	}
	b.write(cl, frame, 1, reader)
	b.Counters.DeliveredDirect.Add(1)
}

// puback acknowledges the client's QoS 1 PUBLISH that mochi knows as id,
// from the client's reader, under the id the client used (see idSpace).
func (b *Broker) puback(cl *mqtt.Client, id uint16) { b.pubackFrom(cl, id, true) }

// pubackFrom is puback; reader says the writer is cl's reader.
func (b *Broker) pubackFrom(cl *mqtt.Client, id uint16, reader bool) {
	var ack [4]byte
	b.write(cl, appendPuback(ack[:0], b.ids.ackID(cl, id)), 0, reader)
}

// write writes packets the broker encoded itself (messages counts the
// PUBLISHes among them) to cl's connection, counting them as mochi's
// WritePacket does. reader says the writer is cl's reader, handling a
// packet: it sends what it wrote when it next reads, so the packets need
// no timer (see clientConn.Write). A failed write ends the connection;
// QoS 1 messages stay in the session, as with mochi.
func (b *Broker) write(cl *mqtt.Client, frame []byte, messages int64, reader bool) {
	var err error
	if cc, ok := cl.Net.Conn.(*clientConn); ok {
		_, err = cc.write(frame, reader) // a concrete call: frame stays on the caller's stack
	} else {
		// A copy: frame, passed to an interface, would otherwise be
		// moved to the heap on every call, this one's path or not.
		_, err = cl.Net.Conn.Write(bytes.Clone(frame))
	}
	if err != nil {
		b.log.Debug("write failed", "client", cl.ID, "error", err)
		return
	}
	atomic.AddInt64(&b.srv.Info.BytesSent, int64(len(frame)))
	atomic.AddInt64(&b.srv.Info.PacketsSent, 1)
	atomic.AddInt64(&b.srv.Info.MessagesSent, messages)
}

// countWindow has the client's connection count its Receive Maximum (see
// window) and mochi count nothing, so that mochi holds no message back:
// on connect, and again once a session is taken over (mochi counts anew
// then). Messages mochi held before are written now, into the window.
//
// A window as large as the session's maximum of messages in flight
// (--max-queued; mochi lowers a larger Receive Maximum to it, and routes
// nothing past it) is never full: such a client, the AIO SDKs' (65,535),
// gets none, and its packets no counting.
func (b *Broker) countWindow(cl *mqtt.Client, cc *clientConn) {
	recv := int(cl.Properties.Props.ReceiveMaximum)
	if cl.Properties.ProtocolVersion != 5 || recv == 0 {
		return // no window: mochi holds nothing either
	}
	if recv < int(b.srv.Options.Capabilities.MaximumInflight) && !cc.Windowed() {
		cc.SetWindow(recv, func(id uint16) (packets.Packet, bool) { return cl.State.Inflight.Get(id) })
	}
	cl.State.Inflight.ResetSendQuota(0)
	b.unhold(cl)
}

// acked frees the window slot of the message the client acknowledged.
// A message mochi held back in the instant before it was told to count
// nothing (see countWindow) is written now, into the window.
func (b *Broker) acked(cl *mqtt.Client, cc *clientConn, id uint16) {
	// The acknowledged message's record is still there: mochi deletes it
	// after this hook.
	if cc.Acked(id) && cl.State.Inflight.Len() > cc.Tracked()+1 {
		b.unhold(cl)
	}
}

// unhold writes the messages mochi held back for the client's Receive
// Maximum (its records' Expiry -1), oldest first, with an expiry from now:
// mochi's own, set when it routed them, is lost, and Created is an order
// number (see sequencer), not a time. They were held an instant (see
// countWindow).
func (b *Broker) unhold(cl *mqtt.Client) {
	held := cl.State.Inflight.GetAll(true)
	if len(held) == 0 || cl.Closed() {
		return
	}
	slices.SortFunc(held, func(a, b packets.Packet) int { return cmp.Compare(a.Created, b.Created) })
	for _, m := range held {
		m.Expiry = 0
		if e := nonZeroMin(b.srv.Options.Capabilities.MaximumMessageExpiryInterval, int64(m.Properties.MessageExpiryInterval)); e > 0 {
			m.Expiry = time.Now().Unix() + e
		}
		cl.State.Inflight.Set(m)
		if err := cl.WritePacket(m); err != nil {
			b.log.Debug("held message not written", "client", cl.ID, "error", err)
			return
		}
	}
}

// mochi's queue of messages for a client, in fields it does not export
// (v2.7.9): the channel its write goroutine takes them from, a count it
// raises after queueing one and lowers after writing it, and the buffer
// where WritePacket leaves packets while the queue is busy, which the
// write that empties the queue sends. Found once by name and type; if
// they are not there (another mochi), every client counts as having
// messages queued, and mochi routes everything.
var (
	outboundOffset, outboundQtyOffset, outbufOffset uintptr
	outboundKnown                                   = findOutbound()
)

func findOutbound() bool {
	st, nt := reflect.TypeFor[mqtt.ClientState](), reflect.TypeFor[mqtt.ClientConnection]()
	q, ok1 := st.FieldByName("outbound")
	n, ok2 := st.FieldByName("outboundQty")
	o, ok3 := nt.FieldByName("outbuf")
	if !ok1 || !ok2 || !ok3 || q.Type != reflect.TypeFor[chan *packets.Packet]() ||
		n.Type != reflect.TypeFor[int32]() || o.Type != reflect.TypeFor[*bytes.Buffer]() {
		return false
	}
	outboundOffset, outboundQtyOffset, outbufOffset = q.Offset, n.Offset, o.Offset
	return true
}

// mochiEnqueue hands pk to cl's write goroutine, as mochi's publishToClient
// does (the queue and its count are mochi's; see outboundOffset). It
// reports false when the queue is full, or unknown (another mochi).
func mochiEnqueue(cl *mqtt.Client, pk *packets.Packet) bool {
	if !outboundKnown {
		return false
	}
	state := unsafe.Pointer(&cl.State)
	queue := *(*chan *packets.Packet)(unsafe.Add(state, outboundOffset))
	select {
	case queue <- pk:
		atomic.AddInt32((*int32)(unsafe.Add(state, outboundQtyOffset)), 1)
		return true
	default:
		return false
	}
}

// mochiQueued reports whether mochi holds packets for cl it has not
// finished writing. Once it has none, a packet written directly cannot
// overtake one mochi took before: a message it routed to cl, or an
// acknowledgement it wrote.
func mochiQueued(cl *mqtt.Client) bool {
	if !outboundKnown {
		return true
	}
	state := unsafe.Pointer(&cl.State)
	qty := atomic.LoadInt32((*int32)(unsafe.Add(state, outboundQtyOffset)))
	queue := *(*chan *packets.Packet)(unsafe.Add(state, outboundOffset))
	if qty != 0 || len(queue) != 0 {
		return true
	}
	cl.RLock() // WritePacket changes the buffer under the client's lock
	buf := *(**bytes.Buffer)(unsafe.Add(unsafe.Pointer(&cl.Net), outbufOffset))
	held := buf != nil && buf.Len() > 0
	cl.RUnlock()
	return held
}
