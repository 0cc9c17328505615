package broker

import (
	"bytes"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"strings"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/auth"
	"github.com/mqkv/mqkv/internal/ownership"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Security is how the broker authenticates and authorizes clients.
type Security struct {
	Passwords      *auth.Passwords      // nil: no password authentication
	CertAttributes *auth.CertAttributes // attributes for certificate subjects
	// Certificates says that clients may be verified by certificate (a
	// client CA is configured).
	Certificates bool
	// AllowAnonymous admits clients that present neither a password nor a
	// verified certificate.
	AllowAnonymous bool
	// Policy authorizes; nil allows everything to everyone admitted.
	Policy *policy.Policy
}

// conn is what the broker knows of one connection.
type conn struct {
	id        uint64
	principal policy.Principal
	grant     atomic.Pointer[policy.Grant] // nil: no policy
	// The client's own state store topic prefixes, computed once: its
	// response topics start with one of responsePrefixes (raw and hex
	// id), its notification topics are notifyPrefixes (raw, hex) (see
	// ownTopic).
	responsePrefixes [2]string
	notifyPrefixes   [2]string
	slow             atomic.Bool            // being disconnected as a slow consumer
	since            time.Time              // when it connected
	will             atomic.Pointer[will]   // nil: none, or already sent
	replies          connReplies            // see Broker.Reply
	acks             pubacks                // QoS 1 acknowledgements waiting for other nodes (see acceptPublish)
	claim            ownership.Claim        // its client id's record in the cluster, if it claimed one (see takeover.go); its goroutine's
	epoch            atomic.Pointer[string] // claim's epoch, for other goroutines (see takeoverFrom)
	revoked          atomic.Bool            // another node took its client id over while it connected

	// from is the connection whose session this one is taking over,
	// and handover that takeover, until its leftovers are taken (see
	// Broker.takeLeftovers). Only the connection's own goroutine, which
	// establishes it, uses them.
	from     *mqtt.Client
	handover *handover
}

var errAuthFailed = errors.New("authentication failed")

// authenticate establishes the principal of a connecting client, answering
// CONNACK itself when it refuses (mochi's authentication hook can only say
// "bad username or password", and a policy refusal is "not authorized").
func (b *Broker) authenticate(cl *mqtt.Client, pk packets.Packet) error {
	sec := b.security.Load()
	p := policy.Principal{ClientID: cl.ID}
	verified := false
	if tc, ok := cl.Net.Conn.(interface{ ConnectionState() tls.ConnectionState }); ok {
		st := tc.ConnectionState()
		if len(st.VerifiedChains) > 0 {
			p.Username, p.Attributes = sec.CertAttributes.CertPrincipal(st.VerifiedChains[0])
			verified = true
		}
	}
	switch {
	case pk.Connect.PasswordFlag:
		if sec.Passwords == nil || !sec.Passwords.Check(string(pk.Connect.Username), pk.Connect.Password) {
			b.refuse(cl, packets.ErrBadUsernameOrPassword)
			return errAuthFailed
		}
		// The password's identity only: a certificate presented too
		// lends it no attributes.
		p.Username, p.Attributes = string(pk.Connect.Username), nil
	case verified:
	case sec.AllowAnonymous:
	default:
		b.refuse(cl, packets.ErrNotAuthorized)
		return errAuthFailed
	}
	if _, held := b.srv.Clients.Get(cl.ID); !held && b.maxSessions > 0 && b.srv.Clients.Len() >= b.maxSessions {
		// Offline sessions are kept for up to --max-session-expiry each:
		// without a bound, one client could make them under fresh ids
		// until memory ran out. A client resuming its own is let in.
		b.log.Warn("connection refused: --max-sessions sessions held", "client", cl.ID, "sessions", b.maxSessions)
		b.refuse(cl, packets.ErrQuotaExceeded)
		return errAuthFailed
	}
	hexID := strings.ToUpper(hex.EncodeToString([]byte(cl.ID)))
	if authConfigured(sec) {
		// A session belongs to who made it: another principal may not
		// take it over (and receive what is queued in it) by reusing the
		// client id.
		if old, ok := b.srv.Clients.Get(cl.ID); ok && string(old.Properties.Username) != p.Username {
			b.log.Info("connection refused: client id in use by another user", "client", cl.ID)
			b.refuse(cl, packets.ErrNotAuthorized)
			return errAuthFailed
		}
		// mochi keeps the CONNECT's username; make it the authenticated
		// one (a certificate's CN), which the session store records.
		cl.Properties.Username = []byte(p.Username)
	}
	c := &conn{
		id:               b.nextConn.Add(1),
		since:            time.Now(),
		principal:        p,
		responsePrefixes: [2]string{"clients/" + hexID, ""},
		notifyPrefixes:   [2]string{"", strings.TrimSuffix(statestore.NotifyClientPrefix(cl.ID), "/")},
	}
	if rawIDIsUnambiguous(cl.ID) {
		// The .NET and Rust SDKs use the raw client id in these topics.
		c.responsePrefixes[1] = "clients/" + cl.ID
		c.notifyPrefixes[0] = statestore.NotifyPrefix + "/" + cl.ID + "/command/notify"
	}
	if sec.Policy != nil {
		g := sec.Policy.Grant(p)
		if !g.CanConnect() {
			b.refuse(cl, packets.ErrNotAuthorized)
			return errAuthFailed
		}
		c.grant.Store(g)
	}
	if !b.takeWill(cl, pk, c) {
		b.refuse(cl, packets.ErrNotAuthorized)
		return errAuthFailed
	}
	b.conns.Store(cl, c)
	if now := b.security.Load(); now.Policy != sec.Policy {
		// The policy was reloaded while this client was being admitted
		// (a password check takes tens of milliseconds): SetPolicy may
		// have judged the connections before this one was among them.
		// Stored first and checked after, it is judged by one or the
		// other.
		var g *policy.Grant // none without a policy
		if now.Policy != nil {
			g = now.Policy.Grant(p)
		}
		c.grant.Store(g)
		if g != nil && !g.CanConnect() {
			b.conns.Delete(cl)
			b.refuse(cl, packets.ErrNotAuthorized)
			return errAuthFailed
		}
	}
	return nil
}

// authConfigured reports whether clients are told apart by credentials.
// With certificates and anonymous clients both admitted, an anonymous
// client is someone else than a certificate's subject, and may not take
// over its session.
func authConfigured(sec *Security) bool {
	return sec.Passwords != nil || sec.CertAttributes != nil || sec.Certificates || !sec.AllowAnonymous
}

func (b *Broker) refuse(cl *mqtt.Client, code packets.Code) {
	b.Counters.AuthFailures.Add(1)
	_ = b.srv.SendConnack(cl, code, false, nil)
}

// connOf returns what the broker knows of a connection.
func (b *Broker) connOf(cl *mqtt.Client) *conn {
	if v, ok := b.conns.Load(cl); ok {
		return v.(*conn)
	}
	return nil
}

// ownTopic reports whether topic is one of the client's own state store
// topics: the response topic shapes the three SDKs use and the
// notification topics (including the .NET SDK's raw-id subscription).
// Access to the state store is authorized per key, so a policy need not
// (and cannot be expected to) grant these. It runs for every message
// delivered, so it only compares precomputed strings.
func (c *conn) ownTopic(topic string) bool {
	if rest, ok := strings.CutPrefix(topic, c.notifyPrefixes[1]); ok && (rest == "/+" || rest == "/#") {
		return true // the Rust SDK's subscription covers only these topics
	}
	if strings.ContainsAny(topic, "+#") {
		return false
	}
	const invoke = "/" + statestore.RequestTopic
	// The raw-id form only as the .NET SDK subscribes it, with nothing
	// after it: nothing is ever published there.
	if c.notifyPrefixes[0] != "" && topic == c.notifyPrefixes[0] {
		return true
	}
	if rest, ok := strings.CutPrefix(topic, c.notifyPrefixes[1]); ok && (rest == "" || rest[0] == '/') {
		return true
	}
	for _, p := range c.responsePrefixes {
		if p == "" {
			continue
		}
		if rest, ok := strings.CutPrefix(topic, p); ok {
			switch rest {
			case invoke, invoke + "/response", "/services" + invoke + "/response":
				return true
			}
		}
	}
	return false
}

// rawIDIsUnambiguous reports whether a client id can stand raw in a topic
// without naming another client's topics: no topic separators or
// wildcards, and not a string of upper-case hex (which is how every other
// client's id appears in the Go SDK's shape).
func rawIDIsUnambiguous(id string) bool {
	if id == "" || strings.ContainsAny(id, "/+#") {
		return false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; !('0' <= c && c <= '9' || 'A' <= c && c <= 'F') {
			return true
		}
	}
	return len(id)%2 != 0
}

// allowed decides a publish (write) or a subscription/delivery (read).
func (b *Broker) allowed(cl *mqtt.Client, topic string, write bool) bool {
	if write && strings.HasPrefix(topic, statestore.NotifyPrefix) {
		return false // nobody forges notifications
	}
	if write && topic == statestore.RequestTopic {
		return true // authorized per key by the state store
	}
	c := b.connOf(cl)
	if c == nil {
		// Delivery to a session restored from disk whose client has not
		// reconnected yet: judged when it does.
		return !write
	}
	g := c.grant.Load()
	if g == nil {
		return true
	}
	if write {
		return g.CanPublish(topic)
	}
	if strings.HasPrefix(topic, statestore.NotifyPrefix) {
		// Another client's notifications carry the values of the keys it
		// observes, which this one may not be allowed to read: under a
		// policy no subscription grant (a dashboard's "#") gives them.
		return c.ownTopic(topic)
	}
	return c.ownTopic(topic) || g.CanSubscribe(topic)
}

// SetPolicy replaces the authorization policy (nil allows everything). Every
// connected client is judged again: one no longer allowed to connect is
// disconnected; subscriptions and KEYNOTIFY registrations it may no longer
// have are removed, the rest stay.
func (b *Broker) SetPolicy(p *policy.Policy) {
	b.updateSecurity(func(sec *Security) { sec.Policy = p })
	b.conns.Range(func(k, v any) bool {
		cl, c := k.(*mqtt.Client), v.(*conn)
		if p == nil {
			c.grant.Store(nil)
			b.handler.Revoke(cl.ID, c.id, nil)
			return true
		}
		g := p.Grant(c.principal)
		c.grant.Store(g)
		if !g.CanConnect() {
			b.log.Info("policy reload: client no longer allowed to connect", "client", cl.ID)
			b.kick(cl, packets.ErrNotAuthorized)
			return true
		}
		b.pruneSubscriptions(cl, c)
		b.handler.Revoke(cl.ID, c.id, g)
		return true
	})
}

// judgeResumed judges what a resumed session brought along against the
// client's grant, before mochi resends its messages (at its CONNACK): the
// policy may have changed while the client was away (a reload, or a
// restart with another file), and meanwhile its session took every
// message its old subscriptions matched. Subscriptions the grant no longer
// covers go, and so do messages it may no longer receive.
func (b *Broker) judgeResumed(cl *mqtt.Client, c *conn) {
	g := c.grant.Load()
	if g == nil {
		return
	}
	b.pruneSubscriptions(cl, c)
	for _, m := range cl.State.Inflight.GetAll(false) {
		if m.FixedHeader.Type != packets.Publish || b.allowed(cl, m.TopicName, false) {
			continue
		}
		if cl.State.Inflight.Delete(m.PacketID) {
			atomic.AddInt64(&b.srv.Info.Inflight, -1)
			atomic.AddInt64(&b.srv.Info.MessagesDropped, 1)
			if b.sessions != nil {
				b.sessions.OnQosComplete(cl, m)
			}
			b.log.Info("queued message dropped: the client may no longer receive it", "client", cl.ID, "topic", m.TopicName)
		}
	}
}

// pruneSubscriptions removes the client's subscriptions its grant no longer
// covers.
func (b *Broker) pruneSubscriptions(cl *mqtt.Client, c *conn) {
	g := c.grant.Load()
	if g == nil {
		return
	}
	for filter, sub := range cl.State.Subscriptions.GetAll() {
		if c.ownTopic(filter) || g.CanSubscribe(filter) {
			continue
		}
		b.log.Info("subscription removed: no longer allowed", "client", cl.ID, "filter", filter)
		if b.srv.Topics.Unsubscribe(filter, cl.ID) {
			atomic.AddInt64(&b.srv.Info.Subscriptions, -1)
		}
		b.routes.changed()
		cl.State.Subscriptions.Delete(filter)
		b.unsubscribed(cl.ID, filter)
		if b.sessions != nil {
			b.sessions.OnUnsubscribed(cl, packets.Packet{Filters: packets.Subscriptions{sub}})
		}
		b.Counters.SubscriptionsRevoked.Add(1)
	}
}

// slowConsumer disconnects a client whose outbound queue is full: it is
// not reading, and queuing more for it would grow memory without bound.
func (b *Broker) slowConsumer(cl *mqtt.Client) {
	c := b.connOf(cl)
	if cl.Net.Inline || cl.Closed() || c == nil || !c.slow.CompareAndSwap(false, true) {
		return
	}
	b.Counters.SlowConsumers.Add(1)
	b.log.Warn("client disconnected: not reading its messages", "client", cl.ID, "reason", "0x97 quota exceeded")
	b.kick(cl, packets.ErrQuotaExceeded)
}

// kick disconnects a client with a reason code without ever blocking the
// caller (see disconnect).
func (b *Broker) kick(cl *mqtt.Client, code packets.Code) { b.disconnect(cl, code) }

// disconnect ends a client's connection with a reason code, in the
// background (see endConnection); the channel is closed when that is done.
func (b *Broker) disconnect(cl *mqtt.Client, code packets.Code) <-chan struct{} {
	ended := make(chan struct{})
	ref := ""
	if code == packets.ErrServerShuttingDown {
		if r := b.reference.Load(); r != nil {
			ref = *r
		}
	}
	go func() {
		defer close(ended)
		endConnection(cl, code, ref)
	}()
	return ended
}

// protocolError finds what in a packet from the client ends its
// connection: a PUBLISH mochi would refuse (packet id, wildcards, topic
// alias 0 or above TopicAliasMaximum: MQTT-3.3.2-8, -9) or one beyond
// Receive Maximum.
func (b *Broker) protocolError(cl *mqtt.Client, pk *packets.Packet) packets.Code {
	if pk.FixedHeader.Type != packets.Publish || cl.Properties.ProtocolVersion < 5 {
		return packets.CodeSuccess
	}
	if code := pk.PublishValidate(TopicAliasMaximum); code != packets.CodeSuccess {
		return code
	}
	if b.overReceiveMaximum(cl, pk) {
		return packets.ErrReceiveMaximum
	}
	return packets.CodeSuccess
}

// overReceiveMaximum reports whether pk opens a QoS 2 flow beyond the
// Receive Maximum the server gave the client in CONNACK (QoS 1 messages
// are acknowledged as they are read and never add up). mochi detects this
// too, but its DISCONNECT 0x93 is lost behind buffered writes (see
// endConnection). Counting the open flows walks the session's inflight
// messages, so it is done only when there may be that many.
func (b *Broker) overReceiveMaximum(cl *mqtt.Client, pk *packets.Packet) bool {
	max := int(b.srv.Options.Capabilities.ReceiveMaximum)
	if pk.FixedHeader.Type != packets.Publish || pk.FixedHeader.Qos != 2 || cl.State.Inflight.Len() < max {
		return false
	}
	if held, ok := cl.State.Inflight.Get(pk.PacketID); ok && inbound(held) {
		return false // sent again: no new flow
	}
	open := 0
	for _, m := range cl.State.Inflight.GetAll(false) {
		if m.FixedHeader.Type == packets.Pubrec {
			open++
		}
	}
	return open >= max
}

// endConnection writes a DISCONNECT with the reason code to the client's
// connection (after what it holds pending, see clientConn), then closes
// it. mochi's DisconnectClient would queue the packet in its own write
// buffer and close the socket before flushing it: a client with messages
// on their way to it saw its connection cut with no reason (and lost the
// acknowledgements sent before). The write takes the lock mochi holds
// around every write, so it never lands inside another packet. Every write
// is bounded to endTimeout from here on (Hurry): a writer stuck on a
// socket nobody reads gives up the lock in time, or the connection is
// closed without a DISCONNECT. ref, if not empty, is a Server Reference
// (another server the client may use) for the DISCONNECT.
func endConnection(cl *mqtt.Client, code packets.Code, ref string) {
	defer cl.Stop(code)
	if cl.Properties.ProtocolVersion < 5 || cl.Net.Conn == nil {
		return // MQTT 3.1.1 has no DISCONNECT from the server
	}
	quiet := cl.Properties.Props.RequestProblemInfoFlag && cl.Properties.Props.RequestProblemInfo == 0
	pk := disconnectPacket(code, !quiet, cl.Properties.Props.MaximumPacketSize, ref)
	if h, ok := cl.Net.Conn.(interface{ Hurry() }); ok {
		h.Hurry()
	}
	for deadline := time.Now().Add(endTimeout); !cl.TryLock(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			return
		}
	}
	defer cl.Unlock()
	_, _ = cl.Net.Conn.Write(pk)
}

// disconnectPacket encodes an MQTT 5 DISCONNECT with a reason code, its
// reason string if asked, and a Server Reference if ref is not empty,
// each if it fits the client's maximum packet size (0: none given).
func disconnectPacket(code packets.Code, reason bool, max uint32, ref string) []byte {
	pk := packets.Packet{FixedHeader: packets.FixedHeader{Type: packets.Disconnect}, ReasonCode: code.Code, ProtocolVersion: 5}
	if reason && code.Code >= packets.ErrUnspecifiedError.Code {
		pk.Properties.ReasonString = code.Reason
	}
	pk.Properties.ServerReference = ref
	var buf bytes.Buffer
	_ = pk.DisconnectEncode(&buf)
	if max > 0 && uint32(buf.Len()) > max {
		switch {
		case pk.Properties.ReasonString != "":
			return disconnectPacket(code, false, max, ref)
		case ref != "":
			return disconnectPacket(code, false, max, "")
		}
	}
	return buf.Bytes()
}

// responseAllowed decides whether a client may have state store replies
// published to topic: the broker publishes them with its own rights, so
// the client must be allowed to publish there itself (or it is one of its
// own response topics), and never to a $ topic.
func (b *Broker) responseAllowed(c *conn, topic string) bool {
	if topic == "" {
		return true // dropped by the service, and counted
	}
	if topic[0] == '$' {
		return false
	}
	g := c.grant.Load()
	return g == nil || c.ownTopic(topic) || g.CanPublish(topic)
}

// SetPasswords replaces the password file used for new connections.
func (b *Broker) SetPasswords(p *auth.Passwords) {
	b.updateSecurity(func(sec *Security) { sec.Passwords = p })
}

// updateSecurity replaces the security settings with a changed copy:
// connections being admitted keep the settings they loaded.
func (b *Broker) updateSecurity(change func(*Security)) {
	sec := *b.security.Load()
	change(&sec)
	b.security.Store(&sec)
}

// Security returns the security settings in force (read only): gateways
// to the state store admit their clients with them.
func (b *Broker) Security() *Security { return b.security.Load() }
