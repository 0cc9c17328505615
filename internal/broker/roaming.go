package broker

import (
	"context"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/ownership"
	"github.com/mqkv/mqkv/internal/roaming"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Sessions that outlive their node.
//
// On a cluster member, the node that holds a client id (see takeover.go)
// keeps in the replicated store (package roaming) what another node needs
// to go on with the session: for a session that outlives its connection
// (Session Expiry Interval above 0), its subscriptions (written before the
// SUBACK) and every QoS 1 and 2 message to the client until the client
// acknowledges it (written before the publisher's acknowledgement, which
// waits for it as it waits for other nodes: see pubacks); for any client
// with a will, the will. A client whose node died connects to another
// node: the claim of its id finds the old node silent, and the session is
// taken up from the store there (Session Present, the messages sent again
// with DUP). The will of a client whose node died is published by the
// surviving node with the lowest id, after its delay, once (a
// compare-and-set of the record decides), and a session of a dead node
// that expires is removed there.
//
// A session that ends with its connection (expiry 0) and has no will
// costs nothing: nothing is written.

// roamed is what this node keeps in the store for its sessions.
type roamed struct {
	mu      sync.Mutex
	held    map[inflightID]struct{} // messages recorded, until acknowledged
	records map[string]struct{}     // client ids with a session record
}

// holdsID reports whether this node holds clientID's claim: only then
// does it write the client's records.
func (b *Broker) holdsID(clientID string) bool {
	_, ok := b.claims.Load(clientID)
	return ok
}

// keepSession records cl's session for the other nodes: its connection
// ended at left (zero: connected), w its will still due (nil: none). If
// wait, it returns once the record is written (or failed, said at
// debug). A session that ends with its connection and has no will is
// not kept; its record, if it had one, goes.
func (b *Broker) keepSession(cl *mqtt.Client, w *will, left time.Time, wait bool) {
	if b.roam == nil || !b.holdsID(cl.ID) {
		return
	}
	if !persistent(cl) && w == nil {
		b.roamed.mu.Lock()
		_, had := b.roamed.records[cl.ID]
		delete(b.roamed.records, cl.ID)
		b.roamed.mu.Unlock()
		if had {
			b.roam.DeleteSession(cl.ID, nil)
		}
		return
	}
	s := sessionOf(cl)
	if v, ok := b.claims.Load(cl.ID); ok {
		c := v.(ownership.Claim)
		s.Node, s.Epoch = c.Node, c.Epoch
	}
	if !left.IsZero() {
		s.Left = left.UnixMilli()
	}
	if w != nil {
		s.Will = &roaming.Will{Msg: *meshMessage(&w.pk), Delay: uint32(w.delay / time.Second), Principal: w.principal}
	}
	b.roamed.mu.Lock()
	if b.roamed.records == nil {
		b.roamed.records = map[string]struct{}{}
	}
	b.roamed.records[cl.ID] = struct{}{}
	b.roamed.mu.Unlock()
	if !wait {
		b.roam.PutSession(cl.ID, s, nil)
		return
	}
	done := make(chan error, 1)
	b.roam.PutSession(cl.ID, s, func(err error) { done <- err })
	select {
	case err := <-done:
		if err != nil {
			b.log.Warn("session not kept in the cluster: it may not survive its node", "client", cl.ID, "error", err)
		}
	case <-time.After(claimTimeout):
		b.log.Warn("session not kept in the cluster in time: it may not survive its node", "client", cl.ID)
	}
}

// keepMessage records a QoS 1 or 2 message to cl, a persistent session's
// client, under its packet id; a (if not nil) waits until it is written.
func (b *Broker) keepMessage(cl *mqtt.Client, pk packets.Packet, a *pendingAck) {
	if b.roam == nil || pk.FixedHeader.Qos == 0 || !persistent(cl) || !b.holdsID(cl.ID) || b.storeTraffic(pk) {
		return
	}
	b.roamed.mu.Lock()
	if b.roamed.held == nil {
		b.roamed.held = map[inflightID]struct{}{}
	}
	b.roamed.held[inflightID{cl.ID, pk.PacketID}] = struct{}{}
	b.roamed.mu.Unlock()
	release := a.hold()
	m := &roaming.Message{Seq: b.roam.NextSeq(), At: time.Now().UnixMilli(), Msg: *meshMessage(&pk), ID: pk.PacketID}
	b.roam.PutMessage(cl.ID, pk.PacketID, m, func(err error) {
		if err != nil {
			b.Counters.RoamFailed.Add(1)
			b.log.Debug("queued message not kept in the cluster", "client", cl.ID, "error", err)
		}
		release()
	})
}

// storeTraffic reports whether pk is a state store reply or notification:
// not kept, as they belong to a connection (a client whose node died asks
// again; its notifications are registered anew on its next connection).
func (b *Broker) storeTraffic(pk packets.Packet) bool {
	return pk.Origin == b.inline.ID && (strings.HasPrefix(pk.TopicName, statestore.NotifyPrefix) || strings.Contains(pk.TopicName, statestore.RequestTopic))
}

// roams reports whether the client's session is kept in the store.
func (b *Broker) roams(clientID string) bool {
	if b.roam == nil || !b.holdsID(clientID) {
		return false
	}
	cl, ok := b.srv.Clients.Get(clientID)
	return ok && persistent(cl)
}

// claimRestored takes back the claims of the sessions restored from the
// session store at start, if this node still holds them; a session
// another node took up meanwhile is dropped here.
func (b *Broker) claimRestored() {
	for id, cl := range b.srv.Clients.GetAll() {
		if cl.Net.Inline {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), claimTimeout)
		c, found, err := b.owners.Owner(ctx, id)
		cancel()
		switch {
		case err != nil:
			b.log.Debug("claim of a restored session not read", "client", id, "error", err)
		case found && c.Node == b.self:
			b.claims.Store(id, c)
		case found:
			b.log.Info("session restored from the session store dropped: another node took it up", "client", id, "node", c.Node)
			b.srv.Clients.Delete(id)
			b.srv.UnsubscribeClient(cl)
			cl.ClearInflights()
			if b.sessions != nil {
				b.sessions.forget(id)
			}
		}
	}
}

// forgetMessage removes the record of the client's message id, once
// acknowledged (or dropped).
func (b *Broker) forgetMessage(clientID string, id uint16) {
	if b.roam == nil {
		return
	}
	k := inflightID{clientID, id}
	b.roamed.mu.Lock()
	_, ok := b.roamed.held[k]
	delete(b.roamed.held, k)
	b.roamed.mu.Unlock()
	if ok {
		b.roam.DeleteMessage(clientID, id)
	}
}

// unroam forgets what this node was writing for a client id another node
// holds now.
func (b *Broker) unroam(clientID string) {
	if b.roam == nil {
		return
	}
	b.roam.Drop(clientID)
	b.roamed.mu.Lock()
	for k := range b.roamed.held {
		if k.client == clientID {
			delete(b.roamed.held, k)
		}
	}
	delete(b.roamed.records, clientID)
	b.roamed.mu.Unlock()
}

// endRecords removes a session's records: it expired, or was ended.
func (b *Broker) endRecords(cl *mqtt.Client) {
	if b.roam == nil || !b.holdsID(cl.ID) {
		return
	}
	var ids []uint16
	b.roamed.mu.Lock()
	for k := range b.roamed.held {
		if k.client == cl.ID {
			ids = append(ids, k.packet)
			delete(b.roamed.held, k)
		}
	}
	_, had := b.roamed.records[cl.ID]
	delete(b.roamed.records, cl.ID)
	b.roamed.mu.Unlock()
	if had || len(ids) > 0 {
		b.roam.DeleteSession(cl.ID, ids)
	}
}

// dropRecords removes what another node kept of a client id's session
// that a clean start ended.
func (b *Broker) dropRecords(clientID string) {
	ctx, cancel := context.WithTimeout(context.Background(), claimTimeout)
	defer cancel()
	ids, err := b.roam.MessageIDs(ctx, clientID)
	if err != nil {
		b.log.Debug("session records not read", "client", clientID, "error", err)
	}
	b.roam.DeleteSession(clientID, ids)
}

// takeUp goes on, here, with the session a dead node held for a
// connecting client (see claim): read from the store, unless the client
// starts clean or it expired.
func (b *Broker) takeUp(ctx context.Context, cl *mqtt.Client, pk packets.Packet, node string) {
	if b.roam == nil {
		return
	}
	s, v, err := b.roam.Load(ctx, cl.ID)
	switch {
	case err != nil:
		b.log.Warn("the node that held the client id did not answer, and its session could not be read: the session starts anew", "client", cl.ID, "node", node, "error", err)
		return
	case s == nil:
		b.log.Info("the node that held the client id did not answer: the session starts anew", "client", cl.ID, "node", node)
		return
	}
	_, here := b.srv.Clients.Get(cl.ID)
	if pk.Connect.Clean || here || expired(s, time.Now()) {
		if _, err := b.roam.Replace(ctx, cl.ID, v, nil); err != nil {
			b.log.Debug("session records not removed", "client", cl.ID, "error", err)
		}
		return
	}
	s.TakenFrom = node
	b.importSession(cl.ID, s)
	b.log.Info("session taken up from the cluster: its node did not answer", "client", cl.ID, "node", node, "subscriptions", len(s.Subscriptions), "messages", len(s.Messages))
}

// expired reports whether a session whose connection ended has outlived
// its expiry.
func expired(s *roaming.Session, now time.Time) bool {
	return s.Left > 0 && s.Expiry != math.MaxUint32 && now.UnixMilli() >= s.Left+int64(s.Expiry)*1000
}

// Timing of the sweep for dead nodes' sessions, variables for tests.
var (
	sweepEvery = time.Second
	// deadAfter is how long a member must be taken for dead (it has not
	// answered for a few seconds: see cluster's health) before its
	// sessions are taken up: before the messages that were on their way
	// to it are given up (mesh.GiveUp) and delivered again to the
	// sessions taken up (see GivenUp).
	deadAfter = time.Second
	// sweepAll is how often the sessions of nodes that are no longer
	// members are looked for.
	sweepAll = 30 * time.Second
)

// sweepDead publishes the wills of clients whose node died and removes
// their sessions once expired: on the live member with the lowest id,
// every sweepEvery while a member does not answer.
func (b *Broker) sweepDead() {
	t := time.NewTicker(sweepEvery)
	defer t.Stop()
	since := map[string]time.Time{} // members not answering, since when
	var lastFull time.Time
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
		}
		now := time.Now()
		nodes := b.peers.Nodes()
		live := map[string]bool{b.self: true}
		for id := range since {
			if !slices.Contains(nodes, id) {
				delete(since, id)
			}
		}
		for _, id := range nodes {
			if b.peers.Alive(id) {
				delete(since, id)
				live[id] = true
			} else if _, ok := since[id]; !ok {
				since[id] = now
			}
		}
		if slices.Min(slices.Collect(maps.Keys(live))) != b.self {
			continue
		}
		// Due: the members dead for deadAfter, and now and then (a
		// node removed while its sessions were kept leaves them to
		// nobody) every node that is not a member.
		due := false
		for id, t := range since {
			if now.Sub(t) >= deadAfter && b.answersElsewhere(id, live) {
				since[id] = now // cut off from here only: not dead
				continue
			}
			due = due || now.Sub(t) >= deadAfter
		}
		if !due && now.Sub(lastFull) < sweepAll {
			continue
		}
		lastFull = now
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		var work []func()
		err := b.roam.Sessions(ctx, func(clientID string, s *roaming.Session, v hlc.Timestamp) {
			if live[s.Node] {
				return
			}
			at, member := since[s.Node]
			switch {
			case !member && slices.Contains(nodes, s.Node):
				return // not yet taken for dead
			case !member:
				at = now // not a member: gone
			case now.Sub(at) < deadAfter:
				return
			}
			work = append(work, func() { b.sweepSession(ctx, clientID, s, v, at) })
		})
		for _, f := range work {
			f()
		}
		cancel()
		if err != nil {
			b.log.Debug("sessions of dead nodes not read", "error", err)
		}
	}
}

// willPacket is the PUBLISH of a will kept in a session record.
func willPacket(w *roaming.Will) packets.Packet {
	pk := packetOf(&w.Msg)
	pk.PacketID = 1 // required for QoS > 0; the inline client never sees acks
	return pk
}

// answersElsewhere reports whether a member this node cannot reach
// answers another live member: a link cut, not a death, whose sessions
// stay where they are.
func (b *Broker) answersElsewhere(id string, live map[string]bool) bool {
	answers := make(chan bool, len(live))
	asked := 0
	for n := range live {
		if n == b.self {
			continue
		}
		asked++
		b.peers.Request(n, encodeWire(takeoverRequest{Alive: id}), func(raw []byte, ok bool) {
			var a aliveAnswer
			answers <- ok && codec.NewDecoderBytes(raw, wire).Decode(&a) == nil && a.Alive
		})
	}
	timeout := time.After(claimTimeout)
	for range asked {
		select {
		case yes := <-answers:
			if yes {
				return true
			}
		case <-timeout:
			return false
		}
	}
	return false
}

// sweepSession does what is due for a session whose node died at (as
// far as this node knows). A session that outlives its connection is
// taken up here, as an offline session (if its node still holds its
// client id: the client may have come back elsewhere): messages go on
// being queued for it, its will is sent after its delay unless the
// client comes back first, and it expires here. Of one that does not,
// the will is sent, once, and the record removed.
func (b *Broker) sweepSession(ctx context.Context, clientID string, s *roaming.Session, v hlc.Timestamp, at time.Time) {
	left := s.Left
	if left == 0 {
		left = at.UnixMilli() // it was connected: its connection ended with its node
	}
	if s.Expiry == 0 {
		// The will is the connection's that held the client id when its
		// node died: a record an earlier connection left is dropped.
		owner, found, err := b.owners.Owner(ctx, clientID)
		if err != nil {
			return
		}
		current := found && owner.Node == s.Node && owner.Epoch == s.Epoch
		if ok, err := b.roam.Replace(ctx, clientID, v, nil); !ok || err != nil || !current {
			return // another node did, or the client came back
		}
		b.owners.Release(ctx, clientID, owner) // the dead node's claim, unless the client came back since
		if w := s.Will; w != nil {
			pk := willPacket(w)
			b.log.Info("will of a client whose node died published", "client", clientID, "node", s.Node, "topic", pk.TopicName)
			b.Counters.WillsTakenUp.Add(1)
			b.sendWill(clientID, &will{principal: w.Principal, pk: pk})
		}
		return
	}
	claim, ok, err := b.owners.Take(ctx, clientID, s.Node, ownership.NewEpoch())
	if err != nil || !ok {
		return
	}
	if _, here := b.srv.Clients.Get(clientID); here {
		return // came back here meanwhile
	}
	full, _, err := b.roam.Load(ctx, clientID)
	if err != nil || full == nil {
		b.log.Warn("session of a dead node not taken up: unreadable", "client", clientID, "node", s.Node, "error", err)
		return
	}
	full.Left = left
	if expired(full, time.Now()) {
		b.claims.Store(clientID, claim)
		b.roam.Replace(ctx, clientID, v, nil)
		b.releaseClaim(clientID, claim)
		b.log.Info("session of a dead node expired", "client", clientID, "node", s.Node)
		return
	}
	b.claims.Store(clientID, claim)
	full.TakenFrom = s.Node
	b.importSession(clientID, full)
	cl, _ := b.srv.Clients.Get(clientID)
	if cl == nil {
		return
	}
	var due *will
	if w := full.Will; w != nil {
		pk := willPacket(w)
		due = &will{principal: w.Principal, pk: pk, delay: time.Duration(w.Delay) * time.Second}
		wait := time.Until(time.UnixMilli(left).Add(min(due.delay, time.Duration(full.Expiry)*time.Second)))
		b.scheduleWill(cl, due, max(wait, 0))
	}
	b.keepSession(cl, due, time.UnixMilli(left), false)
	b.Counters.SessionsTakenUp.Add(1)
	b.log.Info("session of a dead node taken up", "client", clientID, "node", s.Node, "subscriptions", len(full.Subscriptions), "messages", len(full.Messages))
}

// takenFrom returns the member that died holding the client's session,
// if this node took it up ("" if not).
func (b *Broker) takenFrom(clientID string) string {
	if v, ok := b.taken.Load(clientID); ok {
		return v.(taking).from
	}
	return ""
}
