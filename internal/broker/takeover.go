package broker

import (
	"cmp"
	"context"
	"errors"
	"math"
	"slices"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"
	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/ownership"
	"github.com/mqkv/mqkv/internal/roaming"
)

// One client id, one session, cluster-wide.
//
// On a cluster member, a client's connection claims its client id in the
// store before its session is established (see package ownership): the
// claim replaces the record of the node that held the id, which is then
// asked (a mesh request) to end its connection with 0x8E (session taken
// over) and to hand the session over, subscriptions and unacknowledged
// messages, if the new connection resumes it. The session comes back as
// an offline session on this node, which mochi then takes over as if the
// client had been here before. A node that does not answer (down) hands
// nothing over: the session starts anew here.

// Owners is where client ids are claimed (package ownership).
type Owners interface {
	Claim(ctx context.Context, clientID, epoch string) (prev ownership.Record, mine ownership.Claim, err error)
	Release(ctx context.Context, clientID string, c ownership.Claim) error
	// Owner returns the record of clientID, if any.
	Owner(ctx context.Context, clientID string) (ownership.Claim, bool, error)
	// Take claims clientID from node from if from holds it now.
	Take(ctx context.Context, clientID, from, epoch string) (ownership.Claim, bool, error)
}

// claimTimeout bounds a connection's claim, the previous owner's answer
// and the reading of a dead owner's session, each.
const claimTimeout = 5 * time.Second

// claimFor bounds the retries of a claim whose record's group cannot take
// it now: a group that lost its leader with a node elects another within
// a few seconds, and a client whose node died reconnects at once (let in
// unclaimed, its session would be left where the dead node's is taken up).
const claimFor = 10 * time.Second

// claimID claims clientID under epoch, again while the store cannot take
// it (for claimFor).
func (b *Broker) claimID(clientID, epoch string) (ownership.Record, ownership.Claim, error) {
	deadline := time.Now().Add(claimFor)
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		ctx, cancel := context.WithTimeout(context.Background(), claimTimeout)
		prev, mine, err := b.owners.Claim(ctx, clientID, epoch)
		cancel()
		// A node that cannot serve the store itself (it waits for its
		// quorum at start, or is no longer a member) says why: no wait
		// helps then, and MQTT stays available.
		var why interface{ Reason() string }
		if err == nil || errors.As(err, &why) || time.Now().Add(wait).After(deadline) {
			return prev, mine, err
		}
		b.log.Debug("client id claim waits for the store", "client", clientID, "error", err)
		time.Sleep(wait)
	}
}

// takeoverRequest asks the node that held a client id to end its
// connection and, if Resume, to hand the session over. Wire format
// (msgpack by field name).
type takeoverRequest struct {
	ClientID string
	Epoch    string // the claim replaced: the connection to end holds it
	Resume   bool
	Username string
	// Alive, if set, asks instead whether that member answers the
	// node asked (see sweepDead).
	Alive string
}

// takeoverAnswer is the session handed over, if any.
type takeoverAnswer struct {
	Session *roaming.Session
	Refused string // the session is another user's
}

var wire = &codec.MsgpackHandle{}

func encodeWire(v any) []byte {
	var b []byte
	codec.NewEncoderBytes(&b, wire).MustEncode(v)
	return b
}

// claim claims a connecting client's id (on a cluster member) and, if
// another node held it, has that node end its connection and hand the
// session over. A claim that cannot be made (no quorum for the record's
// group: a member restarted alone, a partition) lets the client in
// unclaimed: MQTT stays available, and the id is unique on this node
// only until the client's next connection (said at warn).
//
// It reports false, the CONNACK written, when the session belongs to
// another user (as on one node: see authenticate).
func (b *Broker) claim(cl *mqtt.Client, pk packets.Packet, c *conn) bool {
	if b.owners == nil {
		return true
	}
	// Named before the claim is made: a node that takes the id over the
	// moment this claim commits finds this connection by it.
	epoch := ownership.NewEpoch()
	c.epoch.Store(&epoch)
	prev, mine, err := b.claimID(cl.ID, epoch)
	if err != nil {
		b.log.Warn("client id not claimed in the cluster: the client is let in, its id unique on this node only", "client", cl.ID, "error", err)
		return true
	}
	c.claim = mine
	b.claims.Store(cl.ID, mine) // for the session's expiry (see OnClientExpired)
	if prev.Node == "" || prev.Node == b.self {
		return true // none, or here: mochi takes it over
	}
	ctx, cancel := context.WithTimeout(context.Background(), claimTimeout)
	defer cancel()
	req := takeoverRequest{ClientID: cl.ID, Epoch: prev.Epoch, Resume: !pk.Connect.Clean, Username: string(cl.Properties.Username)}
	answered := make(chan []byte, 1)
	b.peers.Request(prev.Node, encodeWire(req), func(answer []byte, ok bool) {
		if !ok {
			answer = nil
		}
		answered <- answer
	})
	var raw []byte
	select {
	case raw = <-answered:
	case <-ctx.Done():
	}
	if raw == nil {
		upCtx, cancel := context.WithTimeout(context.Background(), claimTimeout)
		defer cancel()
		b.takeUp(upCtx, cl, pk, prev.Node)
		return true
	}
	var ans takeoverAnswer
	if codec.NewDecoderBytes(raw, wire).Decode(&ans) != nil {
		return true
	}
	if ans.Refused != "" {
		b.log.Info("connection refused: client id in use by another user", "client", cl.ID, "node", prev.Node)
		b.releaseClaim(cl.ID, mine)
		b.refuse(cl, packets.ErrNotAuthorized)
		return false
	}
	if _, here := b.srv.Clients.Get(cl.ID); !here && ans.Session != nil {
		b.importSession(cl.ID, ans.Session)
	} else if b.roam != nil && pk.Connect.Clean {
		go b.dropRecords(cl.ID) // what the other node kept of the session ended
	}
	return true
}

// takeoverFrom answers another node that took a client id over from this
// one (see claim): the connection that held the claim is ended with 0x8E,
// and its session handed over if asked and the user is the same.
func (b *Broker) takeoverFrom(node string, req takeoverRequest) []byte {
	cl, ok := b.srv.Clients.Get(req.ClientID)
	if ok && authConfigured(b.security.Load()) && string(cl.Properties.Username) != req.Username {
		// Refused, as on one node (see authenticate): its connection
		// and session stay.
		return encodeWire(takeoverAnswer{Refused: "another user's session"})
	}
	// The connection that made the claim: it may still be connecting
	// (not yet among mochi's clients); it is ended once it is (see
	// OnSessionEstablished).
	b.conns.Range(func(k, v any) bool {
		if cl, c := k.(*mqtt.Client), v.(*conn); cl.ID == req.ClientID && c.holds(req.Epoch) {
			c.revoked.Store(true)
		}
		return true
	})
	if !ok {
		return encodeWire(takeoverAnswer{})
	}
	if c := b.connOf(cl); c != nil && !c.holds(req.Epoch) {
		return encodeWire(takeoverAnswer{}) // a later connection of its own holds it
	}
	// The session is the other node's from now: its records too.
	if v, ok := b.claims.Load(req.ClientID); ok && v.(ownership.Claim).Epoch == req.Epoch {
		b.claims.Delete(req.ClientID)
	}
	b.unroam(req.ClientID)
	var ans takeoverAnswer
	if req.Resume && persistent(cl) && !expiredHere(cl, time.Now()) {
		ans.Session = exportSession(cl)
		if v, ok := b.taken.Load(req.ClientID); ok {
			ans.Session.TakenFrom, ans.Session.TakenAt = v.(taking).from, v.(taking).at
		}
	}
	b.cancelWill(req.ClientID) // the client is back (MQTT-3.1.3-9)
	b.taken.Delete(req.ClientID)
	b.log.Info("client id taken over by another node", "client", req.ClientID, "node", node)
	if !cl.Closed() {
		<-b.disconnect(cl, packets.ErrSessionTakenOver)
	}
	// The session is the other node's now: gone from here, and from the
	// session store.
	if cur, ok := b.srv.Clients.Get(req.ClientID); ok && cur == cl {
		b.srv.Clients.Delete(req.ClientID)
		b.srv.UnsubscribeClient(cl) // OnUnsubscribed: routes and interest changed
		cl.ClearInflights()
		if b.sessions != nil {
			b.sessions.forget(req.ClientID)
		}
	}
	return encodeWire(ans)
}

// expiredHere reports whether cl's session, its connection ended, has
// outlived its expiry though mochi has not yet removed it (it looks now
// and then): it is not handed over.
func expiredHere(cl *mqtt.Client, now time.Time) bool {
	expiry := cl.Properties.Props.SessionExpiryInterval
	return cl.Closed() && cl.Properties.ProtocolVersion == 5 && cl.StopTime() > 0 && cl.StopTime()+int64(expiry) <= now.Unix()
}

// exportSession is cl's session as it moves to another node.
func exportSession(cl *mqtt.Client) *roaming.Session {
	s := sessionOf(cl)
	held := cl.State.Inflight.GetAll(false)
	slices.SortFunc(held, func(a, b packets.Packet) int { return cmp.Compare(a.Created, b.Created) })
	for _, m := range held {
		switch {
		case m.FixedHeader.Type == packets.Pubrel: // a QoS 2 message past the client's PUBREC
			s.Messages = append(s.Messages, roaming.Message{ID: m.PacketID, Released: true})
		case m.FixedHeader.Type == packets.Publish && m.FixedHeader.Qos > 0:
			s.Messages = append(s.Messages, roaming.Message{Msg: *meshMessage(&m), Dup: true, ID: m.PacketID})
		}
		// The rest are the client's own QoS 2 messages (PUBREC sent): its
		// PUBREL to the next node is answered PUBCOMP 0x92, which ends
		// its exchange (they were delivered when they came).
	}
	return s
}

// sessionOf is cl's session, without its messages.
func sessionOf(cl *mqtt.Client) *roaming.Session {
	s := &roaming.Session{ProtocolVersion: cl.Properties.ProtocolVersion, Username: string(cl.Properties.Username),
		Expiry: cl.Properties.Props.SessionExpiryInterval}
	if cl.Properties.ProtocolVersion < 5 {
		s.Expiry = math.MaxUint32 // an MQTT 3 session that is kept never expires
	}
	for _, sub := range cl.State.Subscriptions.GetAll() {
		s.Subscriptions = append(s.Subscriptions, roaming.Subscription{Filter: sub.Filter, QoS: sub.Qos, NoLocal: sub.NoLocal,
			RAP: sub.RetainAsPublished, RetainHandling: sub.RetainHandling, Identifier: sub.Identifier})
	}
	slices.SortFunc(s.Subscriptions, func(a, b roaming.Subscription) int { return cmp.Compare(a.Filter, b.Filter) })
	return s
}

// importSession makes a session handed over by another node an offline
// session here, which mochi then takes over for the connecting client, as
// mochi's own loadClients restores one from storage; the session store
// records it.
func (b *Broker) importSession(clientID string, s *roaming.Session) {
	cl := b.srv.NewClient(nil, "mesh", clientID, false)
	cl.Properties.ProtocolVersion = s.ProtocolVersion
	cl.Properties.Username = []byte(s.Username)
	cl.Properties.Props = packets.Properties{SessionExpiryInterval: s.Expiry, SessionExpiryIntervalFlag: true}
	if s.ProtocolVersion < 5 {
		cl.Properties.Props.SessionExpiryInterval = 0
	}
	cl.Stop(packets.ErrSessionTakenOver)
	b.srv.Clients.Add(cl)
	filters := packets.Subscriptions{}
	for _, sub := range s.Subscriptions {
		ps := packets.Subscription{Filter: sub.Filter, Qos: sub.QoS, NoLocal: sub.NoLocal, RetainAsPublished: sub.RAP,
			RetainHandling: sub.RetainHandling, Identifier: sub.Identifier}
		if b.srv.Topics.Subscribe(clientID, ps) {
			cl.State.Subscriptions.Add(sub.Filter, ps)
		}
		filters = append(filters, ps)
		b.subscribed(clientID, sub.Filter)
	}
	if s.TakenFrom != "" {
		b.taken.Store(clientID, taking{s.TakenFrom, cmp.Or(s.TakenAt, time.Now().UnixNano())})
	}
	b.routes.changed()
	now := time.Now()
	for _, m := range s.Messages {
		if m.Released {
			// Its PUBREL, sent again on resumption under its id; the
			// record of its PUBLISH stays until PUBCOMP (OnQosComplete).
			pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Pubrel, Qos: 1}, PacketID: m.ID,
				ProtocolVersion: s.ProtocolVersion, Created: now.Unix()}
			cl.State.Inflight.Set(pk)
			continue
		}
		if b.roam != nil {
			b.roam.DeleteMessage(clientID, m.ID) // made anew below, unless it expired
		}
		m, live := m.Live(now)
		if !live {
			continue
		}
		pk := packetOf(&m.Msg)
		pk.FixedHeader.Dup = m.Dup
		b.seq.stamp(&pk)
		// Under its id (MQTT-4.4.0-1): a QoS 2 message the client has
		// seen under another would be delivered twice.
		pk.PacketID = m.ID
		if _, used := cl.State.Inflight.Get(m.ID); used || m.ID == 0 {
			id, err := cl.NextPacketID()
			if err != nil {
				break
			}
			pk.PacketID = uint16(id)
		}
		if cl.State.Inflight.Set(pk) {
			if b.sessions != nil {
				b.sessions.OnQosPublish(cl, pk, pk.Created, 0)
			}
			b.keepMessage(cl, pk, nil)
		}
	}
	if b.sessions != nil {
		b.sessions.updateClient(cl, time.Now(), false)
		if len(filters) > 0 {
			codes := make([]byte, len(filters))
			b.sessions.OnSubscribed(cl, packets.Packet{Filters: filters}, codes)
		}
	}
	b.log.Info("session handed over from another node", "client", clientID, "subscriptions", len(s.Subscriptions), "messages", len(s.Messages))
}

// releaseClaim removes a connection's record of its client id, in the
// background, if it is still the record (a session that ended with its
// connection, or expired).
func (b *Broker) releaseClaim(clientID string, c ownership.Claim) {
	if b.owners == nil || c.Version.IsZero() {
		return
	}
	b.claims.CompareAndDelete(clientID, c)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), claimTimeout)
		defer cancel()
		if err := b.owners.Release(ctx, clientID, c); err != nil {
			b.log.Debug("client id record not removed", "client", clientID, "error", err)
		}
	}()
}

// releaseExpired releases the record of a session that expired here.
func (b *Broker) releaseExpired(clientID string) {
	if v, ok := b.claims.Load(clientID); ok {
		b.releaseClaim(clientID, v.(ownership.Claim))
	}
}

// holds reports whether the connection made the claim of epoch.
func (c *conn) holds(epoch string) bool {
	e := c.epoch.Load()
	return e != nil && *e == epoch
}
