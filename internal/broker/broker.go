// Package broker embeds the mochi-mqtt MQTT v5 broker: it owns the
// listeners (TCP, TLS, WebSocket), authenticates and authorizes clients,
// keeps persisted session state, hands state store requests to a Handler,
// and implements statestore.Transport to publish replies and to deliver
// notifications into client sessions.
package broker

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/drain"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/roaming"
	"github.com/mqkv/mqkv/internal/sockio"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Handler receives state store traffic.
type Handler interface {
	Handle(*statestore.Request)
	Disconnected(clientID string, conn uint64)
	// Revoke applies a connection's new grant to its KEYNOTIFY
	// registrations (after a policy change).
	Revoke(clientID string, conn uint64, g *policy.Grant)
	// Drain waits until the requests handed to Handle are answered, or
	// ctx ends; Close calls it once it hands none any more.
	Drain(ctx context.Context) error
}

// Listener is one network endpoint clients connect to.
type Listener struct {
	Name string // "tcp", "tls", "ws"...: shows in logs
	Addr string // host:port; port 0 picks a free one
	// TLS, if set, wraps connections in TLS (for WebSocket: wss).
	TLS       *tls.Config
	WebSocket bool
}

// Config configures the broker.
type Config struct {
	Listeners []Listener
	// DataDir holds the session store. Empty: sessions live in memory.
	DataDir string
	// MaxPacketSize is the largest MQTT packet accepted (and advertised
	// in CONNACK); zero means DefaultMaxPacketSize.
	MaxPacketSize uint32
	// MaxConnections caps connected clients; zero means unlimited.
	MaxConnections int64
	// MaxSessions caps the sessions held, connected or not; a client id
	// new beyond it is refused (0x97). Zero means unlimited.
	MaxSessions int
	// MaxOutbound is how many messages may wait to be written to one
	// client; a client that lets it fill is disconnected. Zero means
	// DefaultMaxOutbound.
	MaxOutbound int32
	// MaxQueued is how many QoS 1/2 messages a session may hold unacked
	// (queued while its client is offline); more are dropped. Zero means
	// DefaultMaxQueued.
	MaxQueued uint16
	// MaxSessionExpiry caps how long a disconnected persistent session is
	// kept; clients asking for longer are told the cap in CONNACK. Zero
	// means DefaultMaxSessionExpiry.
	MaxSessionExpiry time.Duration
	// MaxSubscriptions caps the topic filters one client holds; more get
	// SUBACK 0x97. Zero means DefaultMaxSubscriptions.
	MaxSubscriptions int
	// ServerKeepAlive, if not zero, is the keep-alive (in seconds) every
	// MQTT 5 client must use, whatever its CONNECT asked: sent as Server
	// Keep Alive in CONNACK and enforced (no packet for 1.5 times it ends
	// the connection).
	ServerKeepAlive uint16
	// ConnectTimeout is how long a new connection may take to send
	// CONNECT (TLS handshake included); zero means DefaultConnectTimeout.
	ConnectTimeout time.Duration
	Security       Security
	Logger         *slog.Logger
	// Peers, on a cluster member, carries messages to and from the other
	// nodes (package mesh); nil on a node on its own.
	Peers Peers
	// Retained keeps retained messages in the store (package retained),
	// which mirrors them back (MirrorRetained); nil keeps them in memory.
	Retained Retained
	// Owners, on a cluster member, records which node holds each client
	// id (see takeover.go); NodeID is this node's.
	Owners Owners
	// Roaming, on a cluster member, keeps the sessions that are to
	// outlive their node in the store (package roaming; see roaming.go).
	Roaming *roaming.Store
	NodeID  string
}

// Retained is where retained messages are kept (package retained).
type Retained interface {
	// Put keeps m as topic's retained message (an empty payload removes
	// it), ttlMs to live; done gets the outcome once committed.
	Put(ctx context.Context, topic string, m *mesh.Message, ttlMs int64, done func(error))
	// Sync brings the mirrored messages whose topics filter matches up
	// to date with the store (see retained.Store.Sync).
	Sync(ctx context.Context, filter string) error
}

// TopicAliasMaximum is the highest topic alias a client may use (advertised
// in CONNACK): each costs the connection one remembered topic.
const TopicAliasMaximum = 64

// Defaults for Config.
const (
	DefaultMaxPacketSize    = 64 << 20 // the AIO broker's default profile
	DefaultMaxOutbound      = 1024
	DefaultMaxQueued        = 1000
	DefaultMaxSessionExpiry = 7 * 24 * time.Hour
)

// Counters are monotonically increasing event counts.
type Counters struct {
	AuthFailures         atomic.Int64 // CONNECTs refused
	SlowConsumers        atomic.Int64 // clients disconnected for not reading
	SubscriptionsRevoked atomic.Int64 // subscriptions removed by a policy change
	NotificationsDropped atomic.Int64 // notifications a full client queue refused
	WillsDropped         atomic.Int64 // wills no longer allowed when due
	DeliveredDirect      atomic.Int64 // messages written to a subscriber by the writer itself, not through mochi's queue (see deliver)
	Forwarded            atomic.Int64 // messages sent to other nodes (one per node)
	RetainFailed         atomic.Int64 // retained messages the store did not take
	FromPeers            atomic.Int64 // messages other nodes sent here
	RoamFailed           atomic.Int64 // queued messages of persistent sessions the store did not take
	WillsTakenUp         atomic.Int64 // wills of clients whose node died, published here
	SessionsTakenUp      atomic.Int64 // persistent sessions of a node that died, taken up here
}

// Traffic is the broker's message counts since start.
type Traffic struct {
	Clients                               int64 // connected now
	MessagesIn, MessagesOut, Dropped      int64 // PUBLISH packets
	BytesIn, BytesOut, Retained, Inflight int64
	QueueFull                             int64 // QoS 1/2 messages dropped: the session held MaxQueued
}

// Traffic returns current figures.
func (b *Broker) Traffic() Traffic {
	i := b.srv.Info
	return Traffic{
		Clients:     atomic.LoadInt64(&i.ClientsConnected),
		MessagesIn:  atomic.LoadInt64(&i.MessagesReceived),
		MessagesOut: atomic.LoadInt64(&i.MessagesSent),
		Dropped:     atomic.LoadInt64(&i.MessagesDropped),
		BytesIn:     atomic.LoadInt64(&i.BytesReceived),
		BytesOut:    atomic.LoadInt64(&i.BytesSent),
		Retained:    atomic.LoadInt64(&i.Retained),
		Inflight:    atomic.LoadInt64(&i.Inflight),
		QueueFull:   atomic.LoadInt64(&i.InflightDropped),
	}
}

// Broker is a running MQTT broker.
type Broker struct {
	srv       *mqtt.Server
	inline    *mqtt.Client // publishes replies and notifications
	handler   Handler
	log       *slog.Logger
	sessions  *sessions
	listeners []*listener
	security  atomic.Pointer[Security]
	Counters  Counters

	maxPacketSize   uint32
	serverKeepAlive uint16
	maxSessions     int

	conns sync.Map // *mqtt.Client → *conn
	// handovers: a connection whose session another is taking over →
	// its *handover, from mochi's OnSessionEstablish to
	// OnSessionEstablished (see hook.OnQosDropped).
	handovers    sync.Map
	establishing establishing
	nextConn     atomic.Uint64

	mu         sync.Mutex
	notifySubs map[string]*mqtt.Client // client id → connection holding our notify subscription

	peers    Peers
	retained Retained
	owners   Owners
	claims   sync.Map // client id → its ownership.Claim, while its session is here
	// reference is the Server Reference given to the clients told the
	// server is shutting down (see SetServerReference).
	reference atomic.Pointer[string]
	roam      *roaming.Store
	roamed    roamed
	taken     sync.Map // client id → the member that died holding its session, taken up here (see GivenUp)
	// retainedIndex orders the changes to mochi's index of retained
	// messages (mirror) against mochi's reading of it for a new
	// subscription: mochi (v2.7.9) reads a topic's retained path without
	// the lock under which it writes it (a data race the race detector
	// found when a message mirrored from another node met a SUBSCRIBE).
	// Held for reading from OnSubscribed to OnPacketProcessed, by the
	// clients in readingRetained.
	retainedIndex   sync.RWMutex
	readingRetained sync.Map // *mqtt.Client → struct{}
	self            string   // this node's id
	interest        interest
	seq             *sequencer
	routes          routes
	ids             idSpace
	subLimits       subscriptionLimits
	topics          topicCounts
	wills           wills
	stop            chan struct{}
	closeOnce       sync.Once

	// Shutting down (see drain): requests are no longer handled, and
	// those in progress are counted until answered.
	draining atomic.Bool
	handling drain.Counter // requests in the handler's Handle
	writers  drain.Counter // reply writers (see writeReplies)
}

// New creates a broker with its listeners bound. Call Serve to start it.
func New(cfg Config, h Handler) (*Broker, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.MaxPacketSize == 0 {
		cfg.MaxPacketSize = DefaultMaxPacketSize
	}
	if cfg.MaxOutbound == 0 {
		cfg.MaxOutbound = DefaultMaxOutbound
	}
	if cfg.MaxQueued == 0 {
		cfg.MaxQueued = DefaultMaxQueued
	}
	if cfg.MaxSessionExpiry == 0 {
		cfg.MaxSessionExpiry = DefaultMaxSessionExpiry
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = DefaultConnectTimeout
	}
	if cfg.MaxSubscriptions == 0 {
		cfg.MaxSubscriptions = DefaultMaxSubscriptions
	}
	// No listener is for a server attached to another broker (mqkv
	// attach): the broker then only serves the cluster's other nodes.
	caps := mqtt.NewDefaultServerCapabilities()
	// Without this mochi echoes user properties on PUBACK and sets reason
	// 0x01 on QoS 1 acks (mochi issue #474).
	caps.Compatibilities.NoInheritedPropertiesOnAck = true
	caps.MaximumPacketSize = cfg.MaxPacketSize
	caps.TopicAliasMaximum = TopicAliasMaximum
	caps.MaximumClientWritesPending = cfg.MaxOutbound
	if cfg.MaxConnections > 0 {
		caps.MaximumClients = cfg.MaxConnections
	}
	// mochi would give every message without an expiry one of a day;
	// messages pass through as published.
	caps.MaximumMessageExpiryInterval = 0
	// Offline sessions are bounded in number of messages and in time.
	caps.MaximumInflight = cfg.MaxQueued
	caps.MaximumSessionExpiryInterval = uint32(min(cfg.MaxSessionExpiry/time.Second, 1<<32-1))
	srv := mqtt.New(&mqtt.Options{
		Capabilities: caps,
		// mochi reports every hook and listener at info; keep its voice
		// to warnings unless debugging.
		Logger:                   slog.New(minLevel{cfg.Logger.Handler(), slog.LevelWarn}).With("component", "mqtt"),
		SysTopicResendInterval:   10,
		ClientNetWriteBufferSize: 32 << 10,
		ClientNetReadBufferSize:  32 << 10,
	})
	b := &Broker{srv: srv, handler: h, log: cfg.Logger, peers: cfg.Peers, retained: cfg.Retained, owners: cfg.Owners, roam: cfg.Roaming, self: cfg.NodeID, notifySubs: map[string]*mqtt.Client{}, wills: wills{pending: map[string]*time.Timer{}}, maxPacketSize: cfg.MaxPacketSize, serverKeepAlive: cfg.ServerKeepAlive, maxSessions: cfg.MaxSessions, seq: newSequencer(), stop: make(chan struct{})}
	b.subLimits = subscriptionLimits{max: cfg.MaxSubscriptions, maxLength: DefaultMaxFilterLength, maxLevels: DefaultMaxFilterLevels, pending: map[*mqtt.Client]override{},
		allowed: func(cl *mqtt.Client, filter string) bool { return b.allowed(cl, filter, false) }}
	sec := cfg.Security
	b.security.Store(&sec)
	b.inline = srv.NewClient(nil, mqtt.LocalListener, "mqkv-statestore", true)
	b.inline.Properties.ProtocolVersion = 5

	if err := srv.AddHook(&hook{b: b}, nil); err != nil {
		return nil, err
	}
	if cfg.DataDir != "" {
		existed := startedBefore(cfg.DataDir)
		if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
			return nil, err
		}
		path := filepath.Join(cfg.DataDir, "sessions.db")
		if err := checkSessionsFile(path, existed, cfg.Logger); err != nil {
			return nil, err
		}
		s, err := openSessions(path, cfg.Logger)
		if err != nil {
			return nil, err
		}
		b.sessions = s
		if err := srv.AddHook(s, nil); err != nil {
			s.Stop()
			return nil, err
		}
	}
	for _, lc := range cfg.Listeners {
		ln, err := net.Listen("tcp", lc.Addr)
		if err != nil {
			b.closeListeners()
			b.closeSessions()
			return nil, fmt.Errorf("%s listener: %w", lc.Name, err)
		}
		l := &listener{id: lc.Name, ln: sockio.Listener(ln), tls: lc.TLS, websocket: lc.WebSocket, closeClients: b.closeListenerClients, ended: b.connEnded, connectTimeout: cfg.ConnectTimeout, maxPacketSize: cfg.MaxPacketSize, maxQueued: int(cfg.MaxOutbound)}
		b.listeners = append(b.listeners, l)
		if err := srv.AddListener(l); err != nil {
			b.closeListeners()
			b.closeSessions()
			return nil, err
		}
	}
	return b, nil
}

func (b *Broker) closeListeners() {
	for _, l := range b.listeners {
		l.ln.Close()
	}
}

func (b *Broker) closeSessions() {
	if b.sessions != nil {
		b.sessions.Stop()
	}
}

// Addr returns the address of the first listener.
func (b *Broker) Addr() string {
	if len(b.listeners) == 0 {
		return ""
	}
	return b.listeners[0].Address()
}

// Addrs returns the address of every listener by name.
func (b *Broker) Addrs() map[string]string {
	out := map[string]string{}
	for _, l := range b.listeners {
		out[l.id] = l.Address()
	}
	return out
}

// Serve loads persisted sessions and starts accepting connections.
func (b *Broker) Serve() error {
	if err := b.srv.Serve(); err != nil {
		return err
	}
	b.seedInterest()
	go b.sweep()
	if b.roam != nil && b.peers != nil {
		go b.claimRestored()
		go b.sweepDead()
	}
	return nil
}

// Close answers the requests in progress, then disconnects every client
// and stops the broker. Session state is flushed and closed.
func (b *Broker) Close() error {
	b.drain()
	b.closeOnce.Do(func() { close(b.stop) })
	err := b.srv.Close()
	b.dropWills()
	return err
}

// drainTimeout bounds a shutdown's wait for the requests in progress. A
// write is answered by statestore.RequestTimeout at the latest, even when
// its group has lost its quorum.
const drainTimeout = statestore.RequestTimeout + time.Second

// drain ends request handling for a shutdown: requests that arrive from
// now on are neither handled nor acknowledged (a client sends them again
// once it reconnects, here after a restart or to another node), and those
// already handled are answered before their clients are disconnected, so
// that no client misses the reply to a write that was applied (and, as a
// persistent session resending it, finds its own SET NX refused).
func (b *Broker) drain() {
	b.draining.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	// In order: a request that passed its check (see hook.OnPublish) is
	// handled, so its write is submitted; then every write is answered,
	// so its reply is queued; then every queued reply is written.
	err := b.handling.Wait(ctx)
	if err == nil {
		err = b.handler.Drain(ctx)
	}
	if err == nil {
		err = b.writers.Wait(ctx)
	}
	if err != nil {
		b.log.Warn("shutdown: requests still in progress are left unanswered", "waited", drainTimeout,
			"handling", b.handling.InProgress(), "writers", b.writers.InProgress())
	}
}

// sweep forgets connections that ended without mochi reporting it (a
// client that vanished between CONNECT and CONNACK never reaches
// OnDisconnect): their registrations end and, for clean sessions, the
// client record goes.
func (b *Broker) sweep() {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
		}
		b.conns.Range(func(k, v any) bool {
			cl := k.(*mqtt.Client)
			if !cl.Closed() || time.Since(time.Unix(cl.StopTime(), 0)) < 10*time.Second {
				return true
			}
			b.forget(cl, v.(*conn))
			if !persistent(cl) {
				if cur, ok := b.srv.Clients.Get(cl.ID); ok && cur == cl {
					b.srv.Clients.Delete(cl.ID)
					b.srv.UnsubscribeClient(cl) // OnUnsubscribed: routes changed
				}
			}
			return true
		})
	}
}

// SetServerReference names another server ("host:port") that the MQTT 5
// clients disconnected when the broker closes are told to use (a Server
// Reference with DISCONNECT 0x8B), or none ("").
func (b *Broker) SetServerReference(ref string) { b.reference.Store(&ref) }

// closeListenerClients disconnects every client connected through the
// listener, telling them the server is shutting down. They are
// disconnected all at once, so clients that stopped reading cost shutdown
// one second in all, not each.
func (b *Broker) closeListenerClients(listenerID string) {
	var ended []<-chan struct{}
	for _, cl := range b.srv.Clients.GetAll() {
		if cl.Net.Listener == listenerID && !cl.Closed() {
			ended = append(ended, b.disconnect(cl, packets.ErrServerShuttingDown))
		}
	}
	for _, e := range ended {
		<-e
	}
}

// forget ends what the broker holds for a connection that is over.
func (b *Broker) forget(cl *mqtt.Client, c *conn) {
	c.endReplies()
	if b.conns.CompareAndDelete(cl, c) {
		b.handler.Disconnected(cl.ID, c.id)
	}
	b.dropNotifySubscription(cl)
}

// Roaming returns where the sessions that outlive their node are kept
// (nil on a node on its own).
func (b *Broker) Roaming() *roaming.Store { return b.roam }

// HasSession reports whether the broker holds a session (connected or
// not) for the client id.
func (b *Broker) HasSession(clientID string) bool {
	_, ok := b.srv.Clients.Get(clientID)
	return ok
}

// Figures are the broker's clients connected now, the sessions it holds
// (connected or not) and their subscriptions.
func (b *Broker) Figures() (clients int64, sessions int, subscriptions int64) {
	return atomic.LoadInt64(&b.srv.Info.ClientsConnected), b.srv.Clients.Len(), atomic.LoadInt64(&b.srv.Info.Subscriptions)
}

// ClientsConnected returns the number of connected clients.
func (b *Broker) ClientsConnected() int64 { return atomic.LoadInt64(&b.srv.Info.ClientsConnected) }

// inject publishes a message from the broker itself, at QoS 1.
func (b *Broker) inject(topic string, payload []byte, props packets.Properties) {
	props.ContentType = statestore.ContentType
	err := b.srv.InjectPacket(b.inline, packets.Packet{
		FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1},
		TopicName:   topic,
		Payload:     payload,
		Properties:  props,
		PacketID:    1, // required for QoS 1; the inline client never sees acks
	})
	if err != nil {
		b.log.Warn("publish failed", "topic", topic, "error", err)
	}
}

// Deliver implements statestore.Transport. The message goes through the
// topic index, where the client holds a broker-side subscription to its own
// notification topics: mochi merges all of one client's matching
// subscriptions into one delivery, so a client that also subscribed itself
// (as the Rust SDK does) still gets each notification once.
func (b *Broker) Deliver(clientID string, connID uint64, topic string, payload []byte, version hlc.Timestamp) bool {
	cl, ok := b.srv.Clients.Get(clientID)
	if !ok || cl.Closed() {
		return false
	}
	if c := b.connOf(cl); c == nil || c.id != connID {
		return false // that connection is gone; its registrations end with it
	}
	if len(topic) > statestore.MaxTopicLength {
		// A key of more than about 32 KiB matched a pattern: mochi would
		// write the topic's length in two bytes, truncated, and the
		// client would read garbage and drop the connection (and, for a
		// persistent session, again on every resend).
		b.Counters.NotificationsDropped.Add(1)
		b.log.Warn("notification dropped: the key is too long for an MQTT topic", "client", clientID, "topic_bytes", len(topic))
		return false
	}
	if cl.State.Inflight.Len() >= int(b.srv.Options.Capabilities.MaximumInflight) {
		// The client acknowledges nothing and its session is full: mochi
		// would refuse the message too, but count it as a queue-full
		// message and log a line per notification.
		b.Counters.NotificationsDropped.Add(1)
		b.log.Warn("notification dropped: the client's session holds --max-queued unacknowledged messages", "client", clientID)
		return false
	}
	b.ensureNotifySubscription(cl)
	b.inject(topic, payload, packets.Properties{User: []packets.UserProperty{{Key: "__ts", Val: version.String()}}})
	return true
}

func notifyFilter(clientID string) string { return statestore.NotifyClientPrefix(clientID) + "#" }

func (b *Broker) ensureNotifySubscription(cl *mqtt.Client) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.notifySubs[cl.ID] == cl {
		return
	}
	filter := notifyFilter(cl.ID)
	if _, own := cl.State.Subscriptions.Get(filter); !own {
		// Not in cl.State.Subscriptions and not through the hooks: the
		// session store never persists it and session takeover never
		// copies it.
		b.srv.Topics.Subscribe(cl.ID, packets.Subscription{Filter: filter, Qos: 1})
		b.routes.changed()
	}
	b.notifySubs[cl.ID] = cl
}

// notifyUnsubscribed notes that cl unsubscribed filters. The broker's
// subscription to cl's notification topics has the filter a client may
// subscribe to itself, and the topic index keeps one subscription per
// client and filter: a client that subscribed to it and unsubscribed again
// removed the broker's too. The next notification subscribes again.
func (b *Broker) notifyUnsubscribed(cl *mqtt.Client, filters packets.Subscriptions) {
	if cl == nil || len(filters) == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.notifySubs[cl.ID] != cl {
		return
	}
	own := notifyFilter(cl.ID)
	for _, f := range filters {
		if f.Filter == own {
			delete(b.notifySubs, cl.ID)
			return
		}
	}
}

// dropNotifySubscription removes the broker-side subscription of a
// connection that ended, unless a newer connection of the client owns it.
func (b *Broker) dropNotifySubscription(cl *mqtt.Client) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.notifySubs[cl.ID] != cl {
		return
	}
	delete(b.notifySubs, cl.ID)
	filter := notifyFilter(cl.ID)
	if _, own := cl.State.Subscriptions.Get(filter); !own {
		b.srv.Topics.Unsubscribe(filter, cl.ID)
		b.routes.changed()
	}
}

// Disconnect implements statestore.Transport.
func (b *Broker) Disconnect(clientID string, connID uint64, reason byte) {
	cl, ok := b.srv.Clients.Get(clientID)
	if !ok {
		return
	}
	if c := b.connOf(cl); c == nil || c.id != connID {
		return
	}
	b.kick(cl, packets.Code{Code: reason, Reason: "state store: forbidden response topic"})
}

// minLevel drops records below min unless the wrapped handler is at debug.
type minLevel struct {
	slog.Handler
	min slog.Level
}

func (m minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	if m.Handler.Enabled(ctx, slog.LevelDebug) {
		return true
	}
	return l >= m.min && m.Handler.Enabled(ctx, l)
}

func (m minLevel) WithAttrs(a []slog.Attr) slog.Handler {
	return minLevel{m.Handler.WithAttrs(a), m.min}
}
func (m minLevel) WithGroup(n string) slog.Handler { return minLevel{m.Handler.WithGroup(n), m.min} }
