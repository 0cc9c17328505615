package broker

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/route"
)

// Peers is the rest of a cluster, as the broker sees it: the other nodes'
// interest and the link its messages cross (package mesh). Nil on a node
// on its own.
type Peers interface {
	// Subscribed says filter has subscribers here now (on) or no longer;
	// on, it returns once the other nodes know (bounded).
	Subscribed(filter string, on bool)
	// Want is the other nodes' interest in a topic.
	Want(topic string) route.Want
	// Send hands a message to a node; done, if not nil, is called once
	// the node has delivered it into its subscribers' sessions, or it was
	// given up. It never blocks.
	Send(node string, d *mesh.Delivery, done func())
	// Request asks a node (its broker's Answer) and hands reply the
	// answer, or ok false if none came. It never blocks.
	Request(node string, body []byte, reply func(answer []byte, ok bool))
	// Alive reports whether a node answers.
	Alive(node string) bool
	// Nodes returns the other members' ids.
	Nodes() []string
}

// Answer answers another node's request (see Peers.Request): the takeover
// of a client id (see takeover.go), or whether a member answers here (see
// sweepDead).
func (b *Broker) Answer(from string, body []byte) []byte {
	var req takeoverRequest
	if codec.NewDecoderBytes(body, wire).Decode(&req) != nil {
		return nil
	}
	if req.Alive != "" {
		return encodeWire(aliveAnswer{Alive: b.peers.Alive(req.Alive)})
	}
	return b.takeoverFrom(from, req)
}

// aliveAnswer says whether a member answers the node asked.
type aliveAnswer struct{ Alive bool }

// interest counts, per topic filter, the clients subscribed to it here,
// and tells the other nodes when a filter gains its first or loses its
// last (see Peers.Subscribed). The state store's own subscriptions to a
// client's notification topics are not counted: notifications are made
// on the node the client is connected to.
type interest struct {
	mu      sync.Mutex
	clients map[string]map[string]struct{} // filter → client ids
}

// subscribed records that clientID holds filter, and tells the other
// nodes if it is the filter's first subscriber; it returns once they know.
func (b *Broker) subscribed(clientID, filter string) {
	if b.peers == nil {
		return
	}
	in := &b.interest
	in.mu.Lock()
	if in.clients == nil {
		in.clients = map[string]map[string]struct{}{}
	}
	set := in.clients[filter]
	if set == nil {
		set = map[string]struct{}{}
		in.clients[filter] = set
	}
	_, had := set[clientID]
	set[clientID] = struct{}{}
	first := len(set) == 1 && !had
	in.mu.Unlock()
	if first {
		b.peers.Subscribed(filter, true)
	}
}

// unsubscribed records that clientID no longer holds filter.
func (b *Broker) unsubscribed(clientID, filter string) {
	if b.peers == nil {
		return
	}
	in := &b.interest
	in.mu.Lock()
	set := in.clients[filter]
	_, had := set[clientID]
	delete(set, clientID)
	last := had && len(set) == 0
	if last {
		delete(in.clients, filter)
	}
	in.mu.Unlock()
	if last {
		b.peers.Subscribed(filter, false)
	}
}

// seedInterest counts the subscriptions of the sessions mochi restored
// at start (restored without a hook).
func (b *Broker) seedInterest() {
	for _, cl := range b.srv.Clients.GetAll() {
		for filter := range cl.State.Subscriptions.GetAll() {
			b.subscribed(cl.ID, filter)
		}
	}
}

// wantsRemote reports whether another node has subscribers for topic.
func (b *Broker) wantsRemote(topic string) bool {
	if b.peers == nil {
		return false
	}
	w := b.peers.Want(topic)
	return len(w.Plain) > 0 || len(w.Shared) > 0
}

// sendRemote hands the message to the other nodes that want it, picking
// for each shared group whose members are on several nodes one node
// (this one included, here, if picked); a QoS 1 or 2 message's
// acknowledgement a (if not nil) waits for each. It returns the shared
// groups this node serves (nil: all of its own).
func (b *Broker) sendRemote(pk *packets.Packet, local []sharedGroup, a *pendingAck) (keep map[string]bool) {
	w := b.peers.Want(pk.TopicName)
	if len(w.Plain) == 0 && len(w.Shared) == 0 {
		return nil
	}
	if len(w.Shared) == 0 && len(local) == 0 {
		// Plain subscribers only, the common case: one delivery, read
		// only, for every node.
		d := &mesh.Delivery{Msg: *meshMessage(pk), Plain: true}
		if pk.FixedHeader.Qos > 0 {
			d.Sent = time.Now().UnixNano()
		}
		for _, node := range w.Plain {
			var done func()
			if pk.FixedHeader.Qos > 0 {
				done = a.hold()
			}
			b.peers.Send(node, d, done)
		}
		b.Counters.Forwarded.Add(int64(len(w.Plain)))
		return nil
	}
	keep = map[string]bool{}
	for _, g := range local {
		keep[g.filter] = true
	}
	deliveries := map[string]*mesh.Delivery{}
	var msg *mesh.Message
	to := func(node string) *mesh.Delivery {
		d := deliveries[node]
		if d == nil {
			if msg == nil {
				msg = meshMessage(pk)
			}
			d = &mesh.Delivery{Msg: *msg}
			deliveries[node] = d
		}
		return d
	}
	for _, node := range w.Plain {
		to(node).Plain = true
	}
	// Each message of a shared group goes to one member in all: the
	// node is picked among those with members, alike, so that members
	// on every node get work.
	for group, all := range w.Shared {
		// Not to a node that does not answer: its members get nothing
		// (their share moves to the others).
		nodes := make([]string, 0, len(all))
		for _, node := range all {
			if b.peers.Alive(node) {
				nodes = append(nodes, node)
			}
		}
		if len(nodes) == 0 {
			continue
		}
		n := len(nodes)
		if keep[group] {
			n++
		}
		if i := rand.IntN(n); i < len(nodes) {
			delete(keep, group)
			d := to(nodes[i])
			d.Groups = append(d.Groups, group)
		}
	}
	var now int64
	if pk.FixedHeader.Qos > 0 {
		now = time.Now().UnixNano()
	}
	for node, d := range deliveries {
		var done func()
		if pk.FixedHeader.Qos > 0 {
			done = a.hold()
			d.Sent = now
		}
		b.peers.Send(node, d, done)
	}
	b.Counters.Forwarded.Add(int64(len(deliveries)))
	return keep
}

// meshMessage is pk as it crosses to another node: its expiry as what
// is left of it now.
func meshMessage(pk *packets.Packet) *mesh.Message {
	p := &pk.Properties
	m := &mesh.Message{
		Topic: pk.TopicName, Payload: pk.Payload, QoS: pk.FixedHeader.Qos, Retain: pk.FixedHeader.Retain,
		Origin: pk.Origin, PayloadFormat: p.PayloadFormat, FormatSet: p.PayloadFormatFlag,
		ContentType: p.ContentType, ResponseTopic: p.ResponseTopic, Correlation: p.CorrelationData,
	}
	if pk.Expiry > 0 {
		m.Expiry = uint32(max(pk.Expiry-time.Now().Unix(), 1))
	}
	for _, u := range p.User {
		m.User = append(m.User, [2]string{u.Key, u.Val})
	}
	return m
}

// FromPeer delivers a message another node sent to this node's
// subscribers: its ordinary ones if d.Plain, and one member of each shared
// group of d.Groups. It is never sent on, nor kept as retained (the node
// it was published on keeps it).
func (b *Broker) FromPeer(from string, d *mesh.Delivery, done func()) {
	m := &d.Msg
	pk := packetOf(m)
	b.seq.stamp(&pk)
	b.Counters.FromPeers.Add(1)
	groups := noGroups // read only
	if len(d.Groups) > 0 {
		groups = make(map[string]bool, len(d.Groups))
		for _, g := range d.Groups {
			groups[g] = true
		}
	}
	var only *takenUp
	if d.For != "" {
		only = &takenUp{d.For, d.Since}
	}
	if m.QoS == 0 {
		b.deliverLocal(m.Origin, pk, nil, d.Plain, groups, nil, only)
		done()
		return
	}
	a := &pendingAck{release: done}
	a.waiting.Store(1)
	b.deliverLocal(m.Origin, pk, nil, d.Plain, groups, a, only)
	a.done() // the deliveries are all made
}

// noGroups is no shared group: a delivery for none of this node's.
var noGroups = map[string]bool{}

// GivenUp delivers again a QoS 1 or 2 message that node died before it
// acknowledged, to the sessions another node took up from it after the
// message was sent (see roaming.go; those taken up before got it as
// anyone did): here, and on the other nodes that want its topic now.
// done is called once they have it.
func (b *Broker) GivenUp(node string, d *mesh.Delivery, done func()) {
	if !d.Plain || d.For != "" || b.roam == nil {
		done()
		return
	}
	a := &pendingAck{release: done}
	a.waiting.Store(1)
	pk := packetOf(&d.Msg)
	b.seq.stamp(&pk)
	b.deliverLocal(d.Msg.Origin, pk, nil, true, map[string]bool{}, a, &takenUp{node, d.Sent})
	for _, n := range b.peers.Want(d.Msg.Topic).Plain {
		if n != node && b.peers.Alive(n) {
			b.peers.Send(n, &mesh.Delivery{Msg: d.Msg, Plain: true, For: node, Since: d.Sent}, a.hold())
		}
	}
	a.done()
}

// takenUp selects the sessions taken up from a member that died, at or
// after since (unix nanoseconds).
type takenUp struct {
	node  string
	since int64
}

// has reports whether the client's session is one of them.
func (o *takenUp) has(b *Broker, clientID string) bool {
	v, ok := b.taken.Load(clientID)
	if !ok {
		return false
	}
	t := v.(taking)
	return t.from == o.node && t.at >= o.since
}

// taking is where a session taken up here came from, and when.
type taking struct {
	from string
	at   int64 // unix nanoseconds
}

// packetOf is the PUBLISH of a message from another node (or the store):
// its expiry counts from now.
func packetOf(m *mesh.Message) packets.Packet {
	pk := packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: m.QoS, Retain: m.Retain},
		TopicName:   m.Topic,
		Payload:     m.Payload,
		Origin:      m.Origin,
		Properties: packets.Properties{
			PayloadFormat: m.PayloadFormat, PayloadFormatFlag: m.FormatSet,
			ContentType: m.ContentType, ResponseTopic: m.ResponseTopic, CorrelationData: m.Correlation,
			MessageExpiryInterval: m.Expiry,
		},
		ProtocolVersion: 5,
	}
	for _, u := range m.User {
		pk.Properties.User = append(pk.Properties.User, packets.UserProperty{Key: u[0], Val: u[1]})
	}
	if m.Expiry > 0 {
		pk.Expiry = time.Now().Unix() + int64(m.Expiry) // the time in transit counted
	}
	pk.Created = time.Now().Unix()
	return pk
}

// pubacks orders the acknowledgements of a client's QoS 1 messages that
// wait for other nodes (see Broker.acceptPublish): each is written once
// the nodes it went to have it, and after those of the messages before it
// (MQTT-4.6.0-2).
type pubacks struct {
	mu sync.Mutex
	q  []*pendingAck
}

type pendingAck struct {
	id      uint16
	waiting atomic.Int32 // sends not yet done, plus one until they are all made
	release func()       // writes what is ready (see Broker.releaseAcks)
}

// hold says one more send is made for the message; the function it
// returns is to be called once it is done. On a nil acknowledgement (a
// message nobody waits for) it does nothing.
func (a *pendingAck) hold() func() {
	if a == nil {
		return func() {}
	}
	a.waiting.Add(1)
	return a.done
}

// done ends one wait; the last writes what is ready.
func (a *pendingAck) done() {
	if a.waiting.Add(-1) == 0 {
		a.release()
	}
}

// idle reports whether no acknowledgement waits.
func (p *pubacks) idle() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.q) == 0
}

// push adds the acknowledgement of the client's message id, to be
// written once ready says how many sends it waits for and they are done.
func (p *pubacks) push(id uint16, release func()) *pendingAck {
	a := &pendingAck{id: id, release: release}
	a.waiting.Store(1)
	p.mu.Lock()
	p.q = append(p.q, a)
	p.mu.Unlock()
	return a
}

// release writes, in order, the acknowledgements at the front that wait
// for nothing more.
func (b *Broker) releaseAcks(cl *mqtt.Client, p *pubacks) {
	p.mu.Lock()
	defer p.mu.Unlock() // held while writing: they leave in order
	n := 0
	for n < len(p.q) && p.q[n].waiting.Load() == 0 {
		a := p.q[n]
		n++
		if !mochiQueued(cl) {
			b.pubackFrom(cl, a.id, false)
		} else if err := cl.WritePacket(packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Puback}, PacketID: a.id}); err != nil {
			b.log.Debug("write failed", "client", cl.ID, "error", err)
		}
	}
	p.q = p.q[n:]
	if len(p.q) == 0 {
		p.q = nil
	}
}

// MoveLegacyRetained moves into the store the retained messages a release
// before it kept in the session store, and takes them out of there: once,
// at the first start of this release (the session store then holds none).
func (b *Broker) MoveLegacyRetained(ctx context.Context) error {
	if b.retained == nil || b.sessions == nil {
		return nil
	}
	legacy, err := b.sessions.StoredRetainedMessages()
	if err != nil {
		return err
	}
	for _, rec := range legacy {
		pk := rec.ToPacket()
		var ttl int64
		if pk.Properties.MessageExpiryInterval > 0 {
			ttl = max(pk.Created+int64(pk.Properties.MessageExpiryInterval)-time.Now().Unix(), 1) * 1000
		}
		done := make(chan error, 1)
		b.retained.Put(ctx, pk.TopicName, meshMessage(&pk), ttl, func(err error) { done <- err })
		if err := <-done; err != nil {
			return err
		}
		b.sessions.del(bucketRetained, pk.TopicName)
	}
	if len(legacy) > 0 {
		b.log.Info("retained messages moved from the session store into the replicated store", "messages", len(legacy))
	}
	return nil
}
