package broker

import (
	"maps"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Messages written straight to their subscribers.
//
// mochi routes a message by walking its topic index, building maps of the
// subscribers, copying the message for each and handing the copy to the
// subscriber's write goroutine: a goroutine switch per delivery, and
// about a fifth of the broker's CPU in a pub/sub round trip. When every
// subscriber of a topic is an ordinary subscription of a connected
// client, the publisher's reader writes the message to them itself, as
// mosquitto's one thread does: a topic's subscribers are remembered until
// the topic index changes, and the message is encoded into each
// subscriber's connection, which never waits on its socket for another
// client (see clientConn.Write). mochi routes everything else: shared and
// inline subscriptions, retained messages, QoS 2, offline sessions,
// clients that take topic aliases, and a subscriber whose connection is
// backed up or who has messages queued in mochi, which a later message
// must not overtake (MQTT-4.6.0-6). Replies to state store requests take
// the same way (see replies.go).

// routes remembers, per topic, its subscribers if all of them can be
// written to directly. Any change to the topic index bumps the
// generation and forgets everything.
type routes struct {
	gen atomic.Uint64
	mu  sync.Mutex
	at  uint64            // the generation m was filled at
	m   map[string]fanout // topic → its subscribers
}

// fanout is a topic's subscribers. direct is false when some are shared
// or inline subscriptions, which only mochi routes.
type fanout struct {
	direct bool
	subs   []target
}

// target is one client's subscriptions matching a topic, merged.
type target struct {
	client string
	sub    packets.Subscription
}

// maxRoutes bounds the memory of routes: past it, it starts over.
const maxRoutes = 1 << 16

// changed records a change to the topic index (a subscription added or
// removed anywhere).
func (rr *routes) changed() { rr.gen.Add(1) }

// lookup returns topic's fanout, finding it with find when not known at
// this generation.
func (rr *routes) lookup(topic string, find func() fanout) fanout {
	gen := rr.gen.Load()
	rr.mu.Lock()
	if rr.m == nil || rr.at != gen || len(rr.m) >= maxRoutes {
		rr.m, rr.at = map[string]fanout{}, gen
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
	}
	rr.mu.Unlock()
	return f
}

// fanoutOf returns the topic's subscribers.
func (b *Broker) fanoutOf(topic string) fanout {
	return b.routes.lookup(topic, func() fanout {
		subs := b.srv.Topics.Subscribers(topic)
		if len(subs.Shared) > 0 || len(subs.InlineSubscriptions) > 0 {
			return fanout{}
		}
		f := fanout{direct: true, subs: make([]target, 0, len(subs.Subscriptions))}
		for id, sub := range subs.Subscriptions {
			f.subs = append(f.subs, target{client: id, sub: sub})
		}
		return f
	})
}

// publishDirect writes a client's message to the topic's subscribers, as
// mochi's publishToSubscribers would, if every one of them can be written
// to directly; else it writes to none and reports false, and mochi routes
// the message. pk is the message as mochi has it after OnPublish: stamped,
// with its expiry set.
func (b *Broker) publishDirect(from *mqtt.Client, pk packets.Packet) bool {
	if pk.FixedHeader.Retain || pk.FixedHeader.Qos > 1 {
		return false
	}
	f := b.fanoutOf(pk.TopicName)
	if !f.direct {
		return false
	}
	var buf [8]*mqtt.Client
	to := buf[:0]
	if len(f.subs) > len(buf) {
		to = make([]*mqtt.Client, 0, len(f.subs))
	}
	for _, t := range f.subs {
		var cl *mqtt.Client
		if !t.sub.NoLocal || t.client != from.ID { // MQTT-3.8.3-3
			cl, _ = b.srv.Clients.Get(t.client)
		}
		if cl != nil && !b.allowed(cl, pk.TopicName, false) {
			cl = nil // not delivered, as by mochi
		}
		if cl != nil && !b.directTo(cl, cl == from, t.sub, min(pk.FixedHeader.Qos, t.sub.Qos)) {
			return false
		}
		to = append(to, cl)
	}
	out := packets.Packet{
		FixedHeader:     packets.FixedHeader{Type: packets.Publish, Qos: pk.FixedHeader.Qos},
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
	for i, cl := range to {
		if cl != nil {
			b.deliverDirect(cl, f.subs[i].sub, out)
		}
	}
	return true
}

// directTo reports whether a message at qos can be written to cl now,
// for its subscription sub. own is true when the writer is one of cl's
// own goroutines, which may wait on its socket.
func (b *Broker) directTo(cl *mqtt.Client, own bool, sub packets.Subscription, qos byte) bool {
	cc, ok := cl.Net.Conn.(*clientConn)
	if !ok || cl.Closed() || cl.Properties.Props.TopicAliasMaximum > 0 || mochiQueued(cl) {
		return false
	}
	if !own && (cc.raw == nil || cc.backedUp()) {
		return false
	}
	// The index may not be changed yet for a subscription just removed
	// (mochi ends a session's subscriptions after OnDisconnect).
	if _, ok := cl.State.Subscriptions.Get(sub.Filter); !ok {
		return false
	}
	if qos > 0 {
		// mochi holds a message back while the client's receive
		// maximum (0: none given, no limit) is used up; with one slot
		// left, leave it to mochi.
		n := cl.State.Inflight.Len()
		recv := int(cl.Properties.Props.ReceiveMaximum)
		if n+1 >= int(b.srv.Options.Capabilities.MaximumInflight) || recv > 0 && n+1 >= recv {
			return false
		}
	}
	return true
}

// deliverDirect writes msg to cl for its subscription sub, as mochi's
// publishToClient (v2.7.9) would queue it: directTo said it may.
func (b *Broker) deliverDirect(cl *mqtt.Client, sub packets.Subscription, out packets.Packet) {
	out.FixedHeader.Qos = min(out.FixedHeader.Qos, sub.Qos, b.srv.Options.Capabilities.MaximumQos)
	if len(sub.Identifiers) > 0 { // MQTT-3.3.4-3
		out.Properties.SubscriptionIdentifier = slices.Sorted(maps.Values(sub.Identifiers))
	}
	if out.FixedHeader.Qos > 0 {
		id, err := cl.NextPacketID()
		if err != nil {
			// Dropped, as by mochi.
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
			cl.State.Inflight.DecreaseSendQuota()
		}
	}
	if err := cl.WritePacket(out); err != nil {
		// Kept in the session if QoS 1, as by mochi.
		b.log.Debug("message not written", "client", cl.ID, "error", err)
	}
}

// mochi's queue of messages for a client, in fields it does not export
// (v2.7.9): the channel its write goroutine takes them from, and a count
// it raises after queueing one and lowers after writing it. Found once by
// name and type; if they are not there (another mochi), every client
// counts as having messages queued, and mochi routes everything.
var (
	outboundOffset, outboundQtyOffset uintptr
	outboundKnown                     = findOutbound()
)

func findOutbound() bool {
	t := reflect.TypeFor[mqtt.ClientState]()
	q, ok1 := t.FieldByName("outbound")
	n, ok2 := t.FieldByName("outboundQty")
	if !ok1 || !ok2 || q.Type != reflect.TypeFor[chan *packets.Packet]() || n.Type != reflect.TypeFor[int32]() {
		return false
	}
	outboundOffset, outboundQtyOffset = q.Offset, n.Offset
	return true
}

// mochiQueued reports whether mochi holds messages for cl it has not
// finished writing. Once it has none, a message written directly cannot
// overtake one mochi routed before: mochi writes through the same
// connection, in the client's WritePacket.
func mochiQueued(cl *mqtt.Client) bool {
	if !outboundKnown {
		return true
	}
	state := unsafe.Pointer(&cl.State)
	qty := atomic.LoadInt32((*int32)(unsafe.Add(state, outboundQtyOffset)))
	queue := *(*chan *packets.Packet)(unsafe.Add(state, outboundOffset))
	return qty != 0 || len(queue) != 0
}
