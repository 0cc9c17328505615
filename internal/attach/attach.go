// Package attach serves the state store to an MQTT v5 broker that mqkv
// does not run (mosquitto, EMQX, HiveMQ, VerneMQ), as one of its clients:
// requests come through a shared subscription to the request topic, and
// replies and notifications leave as publishes, byte for byte as mqkv's
// own broker sends them.
package attach

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/eclipse/paho.golang/autopaho"
	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/sockio"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/store"
	"github.com/mqkv/mqkv/internal/topics"
)

// Config says which broker to attach to and how.
type Config struct {
	// Brokers are tried in turn: mqtt://, tls://, ws:// or wss:// (the
	// command turns tcp:// and mqtts:// into these).
	Brokers  []*url.URL
	ClientID string // the attached process's client id at the broker
	Username string
	Password []byte
	TLS      *tls.Config // for tls:// and wss://
	// Group is the shared subscription's group: attached processes of
	// one store share the requests among them.
	Group string
	// SessionExpiry keeps the process's session at the broker while it
	// reconnects (seconds): requests published meanwhile wait in it.
	SessionExpiry uint32
	// ReceiveMaximum bounds the requests the broker sends before their
	// acknowledgement: the process's flow control.
	ReceiveMaximum uint16
	KeepAlive      uint16 // seconds
	// Policy, if it returns one, applies to each requester as the
	// principal its __srcId names (see docs/attach.md, Security).
	Policy func() *policy.Policy
	Logger *slog.Logger
	// Cluster, if set, is the cluster this process is a member of, as
	// node NodeID, whose other members' attached processes take requests
	// too: a dead one's are taken up (see Rescue); a requester's
	// KEYNOTIFY requests are served by one process, reached through
	// Forwarder (see notify.go); and Close first unsubscribes from the
	// request topic and answers what the session still holds, so that the
	// broker hands the others every request from then on instead of
	// keeping a share in this process's session until it comes back.
	Cluster   Cluster
	NodeID    string
	Forwarder Forwarder
	// RequesterIdle is how long a requester without KEYNOTIFY
	// registrations is remembered after its last request (0:
	// DefaultRequesterIdle). In a cluster, the record naming the process
	// that serves a requester's registrations lives twice as long
	// unless renewed, and is renewed while it has some.
	RequesterIdle time.Duration
}

// Defaults of Config.
const (
	DefaultGroup          = "mqkv"
	DefaultSessionExpiry  = 300
	DefaultReceiveMaximum = 1024
	DefaultKeepAlive      = 30
	DefaultRequesterIdle  = 10 * time.Minute
)

// conn is the connection number of every attached requester's
// registrations: the service ends a registration when its connection
// ends, and an attached process never learns when a requester's does
// (docs/attach.md: registrations end with KEYNOTIFY STOP or the process).
const conn = 1 << 62

// Handler serves requests: the state store service.
type Handler interface {
	Handle(r *statestore.Request)
	// Observing reports whether a requester holds KEYNOTIFY
	// registrations (on conn).
	Observing(clientID string, conn uint64) bool
}

// Attach is a running attachment.
type Attach struct {
	cfg     Config
	log     *slog.Logger
	handler Handler
	cm      *autopaho.ConnectionManager
	cancel  context.CancelFunc

	requesters sync.Map // client id -> *requester
	recent     *recent
	workers    []chan *work
	seed       maphash.Seed
	out        chan outgoing // replies
	notes      chan outgoing // notifications
	wg         sync.WaitGroup

	replying   atomic.Int64 // replies queued or being published
	up         atomic.Bool
	subscribed atomic.Bool // the broker granted the request subscription on this connection
	closing    atomic.Bool
	// Figures, for status and metrics.
	Requests, Duplicates, Replies, Notifications, NotificationsDropped, Reconnects atomic.Int64
	// Rescues counts the dead members' sessions taken up, Rescued the
	// requests answered from them (see Rescue); Forwarded the KEYNOTIFY
	// requests handed to the process serving their requester's.
	Rescues, Rescued, Forwarded atomic.Int64
	inflight                    atomic.Int64
	// takeMu guards stopped: no request is taken once the workers end.
	takeMu      sync.RWMutex
	stopped     bool
	lastRequest atomic.Int64 // unix ns
}

// work is a request and the packet to acknowledge once it is answered.
type work struct {
	r   *statestore.Request
	pub *paho.Publish
	cl  *paho.Client
	// acked, if set, is called once the request is acknowledged (or
	// will not be): a rescue waits for it.
	acked func()
}

type outgoing struct {
	pub  *paho.Publish
	done func(error) // after the broker acknowledged it (or failed)
}

// ackEvery is how often paho sends the acknowledgements made meanwhile.
const ackEvery = time.Millisecond

const (
	workers   = 16   // requests of one requester go to one worker, in order
	outQueue  = 8192 // replies waiting to be published
	noteQueue = 8192 // notifications waiting; past it they are dropped
	// replySenders is how many replies may wait for their PUBACK at once
	// (each sender waits for its own): they go out in any order. The
	// broker's Receive Maximum bounds them too.
	replySenders = 64
)

// Start connects to the broker (in the background, again whenever the
// connection is lost) and serves requests with h.
func Start(cfg Config, h Handler) (*Attach, error) {
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("attach: no broker")
	}
	if cfg.ClientID == "" {
		return nil, errors.New("attach: no client id")
	}
	if cfg.Group == "" {
		cfg.Group = DefaultGroup
	}
	if cfg.ReceiveMaximum == 0 {
		cfg.ReceiveMaximum = DefaultReceiveMaximum
	}
	if cfg.KeepAlive == 0 {
		cfg.KeepAlive = DefaultKeepAlive
	}
	if cfg.RequesterIdle <= 0 {
		cfg.RequesterIdle = DefaultRequesterIdle
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	a := &Attach{cfg: cfg, log: cfg.Logger.With("broker", redacted(cfg.Brokers)), handler: h, recent: newRecent(),
		seed: maphash.MakeSeed(), out: make(chan outgoing, outQueue), notes: make(chan outgoing, noteQueue)}
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	for range workers {
		ch := make(chan *work, int(cfg.ReceiveMaximum))
		a.workers = append(a.workers, ch)
		a.wg.Add(1)
		go a.serve(ch)
	}
	filter := a.filter()
	pc := a.connection(cfg.ClientID, cfg.SessionExpiry)
	pc.ReconnectBackoff = autopaho.NewExponentialBackoff(100*time.Millisecond, 10*time.Second, 500*time.Millisecond, 2)
	pc.OnConnectionUp = func(cm *autopaho.ConnectionManager, ca *paho.Connack) {
		a.up.Store(true)
		a.subscribed.Store(false)
		a.log.Info("attached to the broker", "session_present", ca.SessionPresent)
		// Subscribed again on every connection: a broker that lost the
		// session (restarted without persistence) forgot it.
		go func() {
			sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
			defer scancel()
			sa, err := cm.Subscribe(sctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: 1}}})
			switch {
			case err != nil:
				a.log.Warn("cannot subscribe to the request topic", "filter", filter, "error", err)
			case len(sa.Reasons) != 1 || sa.Reasons[0] > 1:
				a.log.Error("the broker refused the subscription to the request topic: allow this client to subscribe to it",
					"filter", filter, "reason", reasonOf(sa))
			default:
				a.subscribed.Store(true)
			}
		}()
	}
	pc.OnConnectionDown = func() bool {
		a.up.Store(false)
		a.subscribed.Store(false)
		a.Reconnects.Add(1)
		a.log.Warn("connection to the broker lost; reconnecting")
		return true
	}
	pc.OnConnectError = func(err error) { a.log.Warn("cannot connect to the broker", "error", err) }
	pc.OnPublishReceived = []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
		a.receive(pr.Client, pr.Packet)
		return true, nil
	}}
	cm, err := autopaho.NewConnection(ctx, pc)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("attach: %w", err)
	}
	a.cm = cm // before the senders, which use it
	for range replySenders {
		a.wg.Add(1)
		go a.send(ctx, a.out)
	}
	// Notifications go out one at a time: in the order of the changes.
	a.wg.Add(1)
	go a.send(ctx, a.notes)
	go every(ctx, time.Second, a.recent.expire)
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		every(ctx, a.cfg.RequesterIdle/4, func(now time.Time) { a.sweepRequesters(ctx, now) })
	}()
	if cfg.Cluster != nil {
		a.wg.Add(1)
		go a.watch(ctx)
	}
	return a, nil
}

// connection is the configuration of a connection to the broker as
// clientID, with a session that expires sessionExpiry seconds after it:
// requests taken with manual acknowledgements, which go out in batches
// (a request's PUBACK goes with the next batch: its broker holds a slot
// of the Receive Maximum until then).
func (a *Attach) connection(clientID string, sessionExpiry uint32) autopaho.ClientConfig {
	rm := a.cfg.ReceiveMaximum
	pc := autopaho.ClientConfig{
		ServerUrls:                    a.cfg.Brokers,
		TlsCfg:                        a.cfg.TLS,
		KeepAlive:                     a.cfg.KeepAlive,
		CleanStartOnInitialConnection: false,
		SessionExpiryInterval:         sessionExpiry,
		ConnectUsername:               a.cfg.Username,
		ConnectPassword:               a.cfg.Password,
		ConnectTimeout:                10 * time.Second,
		ConnectPacketBuilder: func(c *paho.Connect, _ *url.URL) (*paho.Connect, error) {
			if c.Properties == nil {
				c.Properties = &paho.ConnectProperties{}
			}
			c.Properties.ReceiveMaximum = &rm
			return c, nil
		},
		ClientConfig: paho.ClientConfig{
			ClientID:                   clientID,
			EnableManualAcknowledgment: true,
			SendAcksInterval:           ackEvery,
		},
	}
	if plainOrTLS(a.cfg.Brokers) {
		pc.AttemptConnection = dialBuffered
	}
	return pc
}

// filter is the shared subscription requests come through.
func (a *Attach) filter() string { return "$share/" + a.cfg.Group + "/" + topics.Request }

// drainQuiet is how long Close waits, in a shared attachment, after the
// last request the session had for it.
const drainQuiet = 300 * time.Millisecond

// awaitQuiet waits until no request is pending and none came (last, unix
// ns, set now if never) for quiet, or ctx ends: the requests a session
// held come right after its subscription ends or it is taken up.
func awaitQuiet(ctx context.Context, last, pending *atomic.Int64, quiet time.Duration) error {
	last.CompareAndSwap(0, time.Now().UnixNano())
	for pending.Load() > 0 || time.Since(time.Unix(0, last.Load())) < quiet {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}

// plainOrTLS reports whether every broker is reached over TCP or TLS
// (not WebSocket), which dialBuffered serves.
func plainOrTLS(us []*url.URL) bool {
	for _, u := range us {
		if u.Scheme != "mqtt" && u.Scheme != "tls" {
			return false
		}
	}
	return true
}

// dialBuffered connects to u as autopaho would, with reads and writes
// buffered: paho reads a packet's header and body with a syscall each,
// and an attached process reads a packet per request (12 % of its CPU
// under load went to read syscalls).
func dialBuffered(ctx context.Context, cfg autopaho.ClientConfig, u *url.URL) (net.Conn, error) {
	var tc *tls.Config
	if u.Scheme == "tls" {
		if tc = cfg.TlsCfg; tc == nil {
			tc = &tls.Config{}
		}
	}
	c, err := sockio.Dial(ctx, u.Host, tc)
	if err != nil {
		return nil, err
	}
	return &bufferedConn{Conn: c, r: bufio.NewReaderSize(c, 64<<10), w: bufio.NewWriterSize(c, 64<<10)}, nil
}

// bufferedConn reads through a buffer, and writes a packet at a time.
// paho writes every packet under the connection's lock when it has one
// (packets.ControlPacket.WriteTo: Lock, a Write per part, Unlock), which
// its senders need: without it two publishes' parts interleave (found by
// TestAttachedClusterFailover: "malformed payload"). So the parts gather
// in the buffer and go out in one write at Unlock.
type bufferedConn struct {
	net.Conn
	r  *bufio.Reader
	mu sync.Mutex
	w  *bufio.Writer // written under mu only
}

func (b *bufferedConn) Read(p []byte) (int, error)  { return b.r.Read(p) }
func (b *bufferedConn) Write(p []byte) (int, error) { return b.w.Write(p) }
func (b *bufferedConn) Lock()                       { b.mu.Lock() }
func (b *bufferedConn) Unlock() {
	b.w.Flush() // an error shows in the next write and the reads: the connection is gone
	b.mu.Unlock()
}

// redacted lists the brokers without passwords, for the log.
func redacted(us []*url.URL) string {
	var s string
	for i, u := range us {
		if i > 0 {
			s += ","
		}
		s += u.Redacted()
	}
	return s
}

func reasonOf(sa *paho.Suback) byte {
	if len(sa.Reasons) == 0 {
		return 0x80
	}
	return sa.Reasons[0]
}

// Connected reports whether the connection to the broker is up.
func (a *Attach) Connected() bool { return a.up.Load() }

// Serving reports whether the connection is up and the broker granted
// the subscription to the request topic.
func (a *Attach) Serving() bool { return a.up.Load() && a.subscribed.Load() }

// InFlight is how many requests were received and not yet answered.
func (a *Attach) InFlight() int64 { return a.inflight.Load() }

// Broker names the brokers, for status.
func (a *Attach) Broker() string { return redacted(a.cfg.Brokers) }

// Status is an attachment's state and figures (mqkv status).
type Status struct {
	Broker    string `json:"broker"`
	ClientID  string `json:"client_id"`
	Connected bool   `json:"connected"`
	Serving   bool   `json:"serving"` // connected and subscribed to the request topic
	// InFlight is its lag: requests received and not yet answered.
	InFlight             int64 `json:"in_flight"`
	Requests             int64 `json:"requests_total"`
	Duplicates           int64 `json:"duplicates_total"` // deliveries of a request already received, answered once
	Notifications        int64 `json:"notifications_total"`
	NotificationsDropped int64 `json:"notifications_dropped_total"`
	Reconnects           int64 `json:"reconnects_total"`
	Rescues              int64 `json:"rescues_total"` // dead members' sessions taken up
	Rescued              int64 `json:"rescued_total"` // requests answered from them
	// Forwarded are KEYNOTIFY requests handed to the process serving
	// their requester's registrations.
	Forwarded int64 `json:"forwarded_total"`
}

// Status returns the attachment's state and figures.
func (a *Attach) Status() Status {
	return Status{Broker: a.Broker(), ClientID: a.cfg.ClientID, Connected: a.Connected(), Serving: a.Serving(),
		InFlight: a.InFlight(), Requests: a.Requests.Load(), Duplicates: a.Duplicates.Load(),
		Notifications: a.Notifications.Load(), NotificationsDropped: a.NotificationsDropped.Load(), Reconnects: a.Reconnects.Load(),
		Rescues: a.Rescues.Load(), Rescued: a.Rescued.Load(), Forwarded: a.Forwarded.Load()}
}

// AwaitConnection waits until the connection is up, or ctx ends.
func (a *Attach) AwaitConnection(ctx context.Context) error { return a.cm.AwaitConnection(ctx) }

// Close stops taking requests, lets those in progress be answered (5 s
// at most), disconnects and stops. Requests it did not take stay in the
// session at the broker (for SessionExpiry), for this client id's next
// connection.
func (a *Attach) Close() error {
	if a.cfg.Cluster != nil && a.Serving() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := a.cm.Unsubscribe(ctx, &paho.Unsubscribe{Topics: []string{a.filter()}})
		cancel()
		if err == nil {
			// What the broker sent before the unsubscribe still comes:
			// answered until the session is quiet.
			dctx, dcancel := context.WithTimeout(context.Background(), 5*time.Second)
			awaitQuiet(dctx, &a.lastRequest, &a.inflight, drainQuiet)
			dcancel()
		}
	}
	a.closing.Store(true)
	deadline := time.Now().Add(5 * time.Second)
	for (a.inflight.Load() > 0 || a.replying.Load() > 0) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	// Their acknowledgements go out in paho's next batch of acks: a
	// request left unacknowledged would come again to this client id's
	// next connection, and run again (found by TestSDKSurvivesServerRestart
	// through mosquitto: the value's version changed across a restart).
	time.Sleep(10 * ackEvery)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := a.cm.Disconnect(ctx)
	a.cancel()
	<-a.cm.Done()
	a.takeMu.Lock()
	a.stopped = true
	a.takeMu.Unlock()
	for _, ch := range a.workers {
		close(ch)
	}
	a.wg.Wait()
	return err
}

// receive takes a request off the connection (paho's goroutine): a
// repeat of a request answered lately gets the same reply, one still
// being served gets it too once it comes, and a new one goes to its
// requester's worker.
func (a *Attach) receive(cl *paho.Client, p *paho.Publish) { a.receiveWith(cl, p, nil) }

// receiveWith is receive, with acked called once the request is
// acknowledged.
func (a *Attach) receiveWith(cl *paho.Client, p *paho.Publish, acked func()) {
	a.Requests.Add(1)
	a.lastRequest.Store(time.Now().UnixNano())
	r := &statestore.Request{
		Payload: p.Payload,
		QoS:     p.QoS,
	}
	if pp := p.Properties; pp != nil {
		r.ResponseTopic, r.CorrelationData = pp.ResponseTopic, pp.CorrelationData
		if pp.MessageExpiry != nil {
			r.MessageExpiry = *pp.MessageExpiry
		}
		for _, u := range pp.User {
			switch u.Key {
			case "__srcId":
				r.ClientID = u.Value
			case "__ts":
				r.Timestamp, r.HasTimestamp = u.Value, true
			case "__ft":
				r.FencingToken, r.HasFencingToken = u.Value, true
			}
		}
	}
	w := &work{r: r, pub: p, cl: cl, acked: acked}
	if a.closing.Load() {
		if acked != nil {
			acked()
		}
		return // not acknowledged: the broker sends it again (see Close)
	}
	if statestore.ForbiddenResponseTopic(r.ResponseTopic) {
		// mqkv's broker disconnects such a client; here it is only
		// dropped (and acknowledged, so that it does not come back).
		a.log.Info("request dropped: forbidden response topic", "client", r.ClientID, "topic", r.ResponseTopic)
		a.ack(w)
		return
	}
	if a.cfg.Cluster != nil && a.cfg.Forwarder != nil && isKeyNotify(r.Payload) {
		go a.routeKeyNotify(w) // it reads the store: not on paho's goroutine
		return
	}
	a.take(w)
}

// take serves w here.
func (a *Attach) take(w *work) {
	a.takeMu.RLock()
	defer a.takeMu.RUnlock()
	if a.stopped {
		// A KEYNOTIFY routed, or one forwarded, as Close ended the
		// workers: not acknowledged.
		if w.acked != nil {
			w.acked()
		}
		return
	}
	r := w.r
	if !remembered(r) {
		// Answered (or dropped) by the service as its broker would; no
		// reply to remember, nothing to tell a repeat by: acknowledged
		// now (one without a response topic once handled, in serve).
		a.dispatch(w)
		if r.ResponseTopic != "" {
			a.ack(w)
		}
		return
	}
	switch first, e := a.recent.join(r, w); {
	case first:
		// Remembered by the store too, with its result: a copy that
		// comes to another process (or to this one after a restart) is
		// not executed again.
		r.ID = []byte(keyOf(r))
		a.dispatch(w)
	case e != nil:
		a.Duplicates.Add(1)
		a.publishReply(w, e.payload, e.version) // answered already
	default:
		a.Duplicates.Add(1) // answered with the first delivery's reply
	}
}

func (a *Attach) dispatch(w *work) {
	a.inflight.Add(1)
	q := a.requester(w.r.ClientID)
	q.last.Store(a.lastRequest.Load()) // receive's clock read: the sweep's idle is minutes
	w.r.Conn, w.r.Origin, w.r.Grant = conn, q, q.grantNow()
	a.workers[maphash.String(a.seed, w.r.ClientID)%workers] <- w
}

// serve handles one worker's requests in order. A read is answered
// before Handle returns; a write later, through the requester's Reply.
func (a *Attach) serve(ch chan *work) {
	defer a.wg.Done()
	for w := range ch {
		if w.r.ResponseTopic == "" {
			// The service drops it; nothing will answer: acknowledged
			// now, as a broker would.
			a.handler.Handle(w.r)
			a.inflight.Add(-1)
			a.ack(w)
			continue
		}
		a.handler.Handle(w.r)
	}
}

func (a *Attach) ack(w *work) {
	if w.acked != nil {
		defer w.acked()
	}
	if w.pub == nil || w.pub.QoS == 0 {
		return
	}
	if err := w.cl.Ack(w.pub); err != nil {
		// The connection it came on is gone: the broker sends it again
		// on the next, and the reply remembered answers it.
		a.log.Debug("request not acknowledged", "error", err)
	}
}

// requester is one requesting client, named by its __srcId: the origin
// of its requests, which replies and notifications go back through.
type requester struct {
	a     *Attach
	id    string
	grant atomic.Pointer[grantOf]
	last  atomic.Int64 // unix ns of its last request
}

// grantOf is a requester's grant under one policy (reloaded on SIGHUP).
type grantOf struct {
	pol   *policy.Policy
	grant *policy.Grant
}

// Requesters counts the requesters remembered (see sweepRequesters).
func (a *Attach) Requesters() int {
	n := 0
	a.requesters.Range(func(any, any) bool { n++; return true })
	return n
}

func (a *Attach) requester(id string) *requester {
	if q, ok := a.requesters.Load(id); ok {
		return q.(*requester)
	}
	actual, _ := a.requesters.LoadOrStore(id, &requester{a: a, id: id})
	return actual.(*requester)
}

// grantNow is what the requester may do under the policy in force: nil
// (everything) without one.
func (q *requester) grantNow() *policy.Grant {
	if q.a.cfg.Policy == nil {
		return nil
	}
	pol := q.a.cfg.Policy()
	if pol == nil {
		return nil
	}
	if g := q.grant.Load(); g != nil && g.pol == pol {
		return g.grant
	}
	g := &grantOf{pol, pol.Grant(policy.Principal{ClientID: q.id})}
	q.grant.Store(g)
	return g.grant
}

// Reply implements statestore.Replier: the reply goes to every delivery
// of the request waiting on it, and each is acknowledged once the
// broker has the reply.
func (q *requester) Reply(r *statestore.Request, payload []byte, version hlc.Timestamp) {
	a := q.a
	a.inflight.Add(-1)
	a.Replies.Add(1)
	waiting := []*work{{r: r}}
	if remembered(r) {
		waiting = a.recent.answer(r, payload, version)
	}
	for _, w := range waiting {
		a.publishReply(w, payload, version)
	}
}

// publishReply sends a reply to w's request, then acknowledges the
// request (if w has a packet): a request is acknowledged only once its
// reply is with the broker.
func (a *Attach) publishReply(w *work, payload []byte, version hlc.Timestamp) {
	r := w.r
	if r.ResponseTopic == "" {
		return
	}
	user := paho.UserProperties{{Key: "__stat", Value: "200"}}
	if !version.IsZero() {
		user = append(user, paho.UserProperty{Key: "__ts", Value: version.String()})
	}
	pub := &paho.Publish{
		QoS:     1,
		Topic:   r.ResponseTopic,
		Payload: payload,
		Properties: &paho.PublishProperties{
			CorrelationData: r.CorrelationData,
			ContentType:     statestore.ContentType,
			User:            user,
		},
	}
	if r.MessageExpiry > 0 {
		e := r.MessageExpiry
		pub.Properties.MessageExpiry = &e
	}
	a.replying.Add(1)
	o := outgoing{pub: pub, done: func(err error) {
		switch {
		case err == nil && w.pub != nil:
			a.ack(w)
		case w.acked != nil:
			w.acked() // not acknowledged: it comes again
		}
		a.replying.Add(-1)
	}}
	select {
	case a.out <- o:
	default:
		a.replying.Add(-1)
		if w.acked != nil {
			w.acked()
		}
		// Never full in practice: the broker's Receive Maximum bounds
		// the requests unanswered, and so the replies. The request stays
		// unacknowledged, and comes again on the next connection.
		a.log.Warn("reply dropped: the queue to the broker is full")
	}
}

// Notify implements statestore.Notifier: a notification of the
// requester's KEYNOTIFY, published to its notify topic at QoS 1. It runs
// on the goroutine that applies the log: queued, and dropped (counted)
// when the queue is full.
func (q *requester) Notify(ev store.Event) bool {
	a := q.a
	topic := statestore.NotifyTopic(q.id, ev.Key)
	if len(topic) > statestore.MaxTopicLength {
		a.NotificationsDropped.Add(1)
		return false
	}
	pub := &paho.Publish{
		QoS:     1,
		Topic:   topic,
		Payload: statestore.NotifyPayload(ev.Kind, ev.Value),
		Properties: &paho.PublishProperties{ContentType: statestore.ContentType,
			User: paho.UserProperties{{Key: "__ts", Value: ev.Version.String()}}},
	}
	select {
	case a.notes <- outgoing{pub: pub}:
		a.Notifications.Add(1)
		return true
	default:
		a.NotificationsDropped.Add(1)
		return false
	}
}

// send publishes what comes on ch, waiting for the broker's PUBACK; a
// publish made while the connection is down waits for the next one.
func (a *Attach) send(ctx context.Context, ch chan outgoing) {
	defer a.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case o := <-ch:
			var err error
			for {
				if err = a.cm.AwaitConnection(ctx); err != nil {
					break
				}
				pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				_, err = a.cm.Publish(pctx, o.pub)
				cancel()
				if err == nil || ctx.Err() != nil || !retryable(err) {
					break
				}
			}
			if err != nil && ctx.Err() == nil {
				a.log.Warn("publish to the broker failed", "topic", o.pub.Topic, "error", err)
			}
			if o.done != nil {
				o.done(err)
			}
		}
	}
}

// retryable reports whether a publish failed for want of a connection:
// it is sent again once one is up. A publish the session stored before
// the connection failed goes again with the session (paho resends it);
// one the broker refused does not.
func retryable(err error) bool { return errors.Is(err, autopaho.ConnectionDownError) }

// sweepRequesters forgets the requesters that hold no registrations and
// sent no request for RequesterIdle, and in a cluster renews the records
// naming this process for those that hold some: every requester id ever
// seen was remembered before, in the process and in the store, so a
// broker's clients coming and going with new ids grew both without bound.
func (a *Attach) sweepRequesters(ctx context.Context, now time.Time) {
	renew := a.cfg.Cluster != nil
	a.requesters.Range(func(k, v any) bool {
		q := v.(*requester)
		switch {
		case a.handler.Observing(q.id, conn):
			if renew {
				if err := a.renewNotifyRecord(ctx, q); err != nil {
					// The store does not answer: the rest wait for the
					// next sweep (a record is renewed at half its life,
					// four sweeps before it ends).
					if ctx.Err() == nil {
						a.log.Warn("cannot renew the records naming this process for its requesters' registrations", "error", err)
					}
					renew = false
				}
			}
		case now.UnixNano()-q.last.Load() > int64(a.cfg.RequesterIdle):
			// A request that looked it up meanwhile keeps its own; the
			// next makes a new one.
			a.requesters.CompareAndDelete(k, q)
		}
		return ctx.Err() == nil
	})
}

// every calls f with the time every d, until ctx ends.
func every(ctx context.Context, d time.Duration, f func(now time.Time)) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			f(now)
		}
	}
}
