// Package client is the Go client of mqkv's state store. It speaks only the
// public protocol (RESP requests on the state store request topic, replies
// on a response topic, notifications pushed into the session), so it also
// works against the Azure IoT Operations MQTT broker.
//
//	c, err := client.Dial(ctx, client.Config{URL: "mqtt://127.0.0.1:1883"})
//	res, err := c.Set(ctx, []byte("greeting"), []byte("hello"), client.WithTTL(time.Minute))
//	v, err := c.Get(ctx, []byte("greeting"))
//
// It reconnects by itself; KEYNOTIFY registrations are made again after a
// reconnect, and a watcher is told what changed while it was away.
package client

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/eclipse/paho.golang/autopaho"
	"github.com/eclipse/paho.golang/paho"
	"github.com/eclipse/paho.golang/paho/session/state"
	"github.com/eclipse/paho.golang/paho/store/memory"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/sockio"
	"github.com/mqkv/mqkv/internal/topics"
)

// Version is a key's version: a hybrid logical clock reading, ordered by
// Compare. Fencing tokens are versions too.
type Version = hlc.Timestamp

// ParseVersion reads a version in wire form ("%015d:%05d:%s").
func ParseVersion(s string) (Version, error) { return hlc.Parse(s) }

const (
	requestTopic = topics.Request
	notifyPrefix = topics.NotifyPrefix + "/"
)

// Config says where and how to connect.
type Config struct {
	// URL of the server: mqtt://host:port (default scheme), tls://,
	// ws://host:port/mqtt or wss://. A bare host:port means mqtt://.
	// Several, comma-separated and of one scheme, name members of one
	// cluster: each connection attempt tries them in order, so a client
	// whose member stops or dies goes on with another (its watches resume
	// there: every member keeps the change history).
	URL      string
	ClientID string // default: a random id
	Username string
	Password string
	TLS      *tls.Config // for tls:// and wss://
	// Timeout bounds each request whose context has no deadline; zero
	// means 10 s.
	Timeout time.Duration
	Logger  *slog.Logger
	// Direct sends each request on one key (GET, SET, DEL, VDEL, PTTL)
	// straight to the cluster member that leads the key's group, over a
	// connection of its own to that member, instead of through the
	// member of URL, which would forward it: a hop less, and less CPU on
	// the members. The client learns the leaders from the server (the
	// ROUTES command) every few seconds; until it knows, and whenever a
	// direct connection is down, requests take the first connection.
	// Watches always do. mqtt:// and tls:// URLs only; against a server
	// that does not know ROUTES, it changes nothing.
	Direct bool
}

// Client is a connection to a state store. It is safe for concurrent use.
type Client struct {
	cfg       Config
	scheme    string // of the URL
	cm        *autopaho.ConnectionManager
	clock     *hlc.Clock
	respTopic string
	// notifyFilter covers the client's notification topics.
	notifyFilter string
	log          *slog.Logger

	mu      sync.Mutex
	pending map[string]chan *paho.Publish // correlation data → reply
	ready   chan struct{}                 // closed when the current connection can take requests
	live    *packetConn                   // that connection, while ready is closed
	dialed  *packetConn                   // the connection made last
	gen     uint64                        // connections made so far; a stale setup must not open ready
	watches map[watchID]*keyWatch         // key or pattern → its watchers
	closed  bool
	done    chan struct{} // closed by Close: ends every wait
	setup   chan error    // a refused response-topic subscription, for Dial

	up atomic.Bool // a connection was made once
	// referred is the server a DISCONNECT named (Server Reference, as a
	// stopping cluster member names another): connection attempts go
	// there and to the configured server in turn, the first there, until
	// one connects (refTries counts them).
	referred atomic.Pointer[string]
	refTries atomic.Uint32

	// regMu orders registration changes (KEYNOTIFY and its STOP) so that
	// a watch starting while the key's last one stops is not undone.
	regMu sync.Mutex

	// direct keeps the routes and direct connections (Config.Direct);
	// nil without.
	direct *director
	// parent is the client a direct connection serves (nil for one made
	// by Dial): its clock is shared, and it has no watches.
	parent *Client
}

// Dial connects and returns once the client can send requests.
func Dial(ctx context.Context, cfg Config) (*Client, error) {
	return dial(ctx, cfg, nil)
}

// dial connects: a client, or one's direct connection (parent set).
func dial(ctx context.Context, cfg Config, parent *Client) (*Client, error) {
	if cfg.ClientID == "" {
		var b [8]byte
		rand.Read(b[:])
		cfg.ClientID = "mqkv-client-" + hex.EncodeToString(b[:])
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	urls, err := serverURLs(cfg.URL)
	if err != nil {
		return nil, err
	}
	u := urls[0]
	var clock *hlc.Clock
	if parent != nil {
		clock = parent.clock
	} else if clock, err = hlc.New(strings.ReplaceAll(cfg.ClientID, ":", "_"), nil); err != nil {
		return nil, err
	}
	c := &Client{
		cfg:    cfg,
		scheme: u.Scheme,
		parent: parent,
		clock:  clock,
		// The Go SDK's shape: upper-case hex of the client id.
		respTopic:    "clients/" + strings.ToUpper(hex.EncodeToString([]byte(cfg.ClientID))) + "/" + topics.Request + "/response",
		notifyFilter: notifyPrefix + strings.ToUpper(hex.EncodeToString([]byte(cfg.ClientID))) + "/command/notify/#",
		log:          cfg.Logger,
		pending:      map[string]chan *paho.Publish{},
		ready:        make(chan struct{}),
		watches:      map[watchID]*keyWatch{},
		done:         make(chan struct{}),
		setup:        make(chan error, 1),
	}
	ac := autopaho.ClientConfig{
		ServerUrls:                    urls,
		TlsCfg:                        cfg.TLS,
		KeepAlive:                     30,
		CleanStartOnInitialConnection: true,
		ConnectRetryDelay:             time.Second,
		ReconnectBackoff:              c.connectDelay,
		ConnectTimeout:                10 * time.Second,
		OnConnectionUp:                c.onConnectionUp,
		OnConnectionDown:              c.onConnectionDown,
		ClientConfig: paho.ClientConfig{
			ClientID:           cfg.ClientID,
			OnPublishReceived:  []func(paho.PublishReceived) (bool, error){c.onPublish},
			OnClientError:      func(err error) { c.log.Debug("mqtt client error", "error", err) },
			OnServerDisconnect: c.onServerDisconnect,
			Session:            state.New(unkept{}, memory.New()),
		},
	}
	switch u.Scheme {
	case "mqtt", "tcp", "tls", "ssl", "mqtts":
		ac.AttemptConnection = c.attemptConnection
		if cfg.Direct {
			c.direct = newDirector(c)
		}
	default:
		if cfg.Direct {
			return nil, fmt.Errorf("client: Direct takes mqtt:// and tls:// URLs, not %s://", u.Scheme)
		}
	}
	if cfg.Username != "" || cfg.Password != "" {
		ac.ConnectUsername, ac.ConnectPassword = cfg.Username, []byte(cfg.Password)
	}
	connErr := make(chan error, 1)
	ac.OnConnectError = func(err error) {
		select {
		case connErr <- err:
		default:
		}
	}
	// The connection manager lives until Close, not until ctx ends.
	cm, err := autopaho.NewConnection(context.Background(), ac)
	if err != nil {
		return nil, err
	}
	c.cm = cm
	select {
	case <-c.readyChan():
		if c.direct != nil {
			go c.direct.run()
		}
		return c, nil
	case err := <-connErr:
		c.Close()
		if inner := errors.Unwrap(err); inner != nil && strings.Contains(err.Error(), u.String()) {
			err = inner // autopaho's message repeats the URL
		}
		if (u.Scheme == "mqtt" || u.Scheme == "tcp") && speaksTLS(ctx, u.Host) {
			return nil, fmt.Errorf("connect %s: the server speaks TLS on this port: use tls://%s (with the CA that signed its certificate)", u, u.Host)
		}
		return nil, fmt.Errorf("connect %s: %w", u, err)
	case err := <-c.setup:
		c.Close()
		return nil, fmt.Errorf("connect %s: %w", u, err)
	case <-ctx.Done():
		c.Close()
		return nil, fmt.Errorf("connect %s: %w", u, ctx.Err())
	}
}

// onServerDisconnect keeps the server a DISCONNECT refers the client to
// (MQTT 5's Server Reference, with "server shutting down", "use another
// server" or "server moved"): a cluster member stopping for a restart
// names another that answers, and a client that goes there keeps its
// watches resumable (that member's change history reaches back; the
// restarted one's starts empty).
func (c *Client) onServerDisconnect(d *paho.Disconnect) {
	if d.Properties == nil || d.Properties.ServerReference == "" {
		return
	}
	switch d.ReasonCode {
	case 0x8B, 0x9C, 0x9D:
	default:
		return
	}
	ref, _, _ := strings.Cut(d.Properties.ServerReference, " ") // the first of a list
	if _, _, err := net.SplitHostPort(ref); err != nil {
		c.log.Debug("server reference not host:port: ignored", "reference", ref)
		return
	}
	c.refTries.Store(0)
	c.referred.Store(&ref)
}

// attemptConnection dials u's host or, in turn with it while no
// connection was made since, the server a DISCONNECT referred to (see
// onServerDisconnect). The referral is not given up after one failed
// attempt: a stopping member names another that may be busy for a moment
// (claiming the client's id waits for the store), and the configured
// server may be the one that stopped (a watch went without events for
// good: TestWatchMovesWithTheServerReference, once in CI).
func (c *Client) attemptConnection(ctx context.Context, cfg autopaho.ClientConfig, u *url.URL) (net.Conn, error) {
	host := u.Host
	if ref := c.referred.Load(); ref != nil && c.refTries.Add(1)%2 == 1 {
		c.log.Info("connecting to the server the last one referred to", "server", *ref, "configured", u.Host)
		host = *ref
	}
	if c.direct != nil {
		c.direct.local.Store(&host)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	var tc *tls.Config
	if u.Scheme != "mqtt" && u.Scheme != "tcp" {
		if tc = cfg.TlsCfg; tc == nil {
			tc = &tls.Config{}
		}
	}
	conn, err := sockio.Dial(ctx, host, tc)
	if err != nil {
		return nil, err
	}
	pc := newPacketConn(conn, c.takeReply)
	c.mu.Lock()
	c.dialed = pc
	c.mu.Unlock()
	return pc, nil
}

// serverURLs parses Config.URL: one URL, or several of one scheme.
func serverURLs(s string) ([]*url.URL, error) {
	var out []*url.URL
	for _, one := range strings.Split(s, ",") {
		u, err := serverURL(strings.TrimSpace(one))
		if err != nil {
			return nil, err
		}
		if len(out) > 0 && u.Scheme != out[0].Scheme {
			return nil, fmt.Errorf("server URLs %q: all of one scheme", s)
		}
		out = append(out, u)
	}
	return out, nil
}

func serverURL(s string) (*url.URL, error) {
	if s == "" {
		s = "127.0.0.1:1883"
	}
	if !strings.Contains(s, "://") {
		s = "mqtt://" + s
	}
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("server URL %q: %w", s, err)
	}
	switch u.Scheme {
	case "mqtt", "tcp", "tls", "ssl", "mqtts", "ws", "wss":
	default:
		return nil, fmt.Errorf("server URL %q: scheme must be mqtt, tls, ws or wss", s)
	}
	return u, nil
}

// ID returns the MQTT client id.
func (c *Client) ID() string { return c.cfg.ClientID }

func (c *Client) readyChan() chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ready
}

// isReady reports whether the connection can take requests now.
func (c *Client) isReady() bool {
	select {
	case <-c.readyChan():
		return true
	default:
		return false
	}
}

// onConnectionUp subscribes to the response topic and registers every
// watched key again: registrations end with a connection. It must not
// block, so the work runs in a goroutine that opens the gate for requests
// when the subscription is in place. A failed subscription is retried
// while the connection lasts; a refused one (no permission) also fails
// Dial.
func (c *Client) onConnectionUp(cm *autopaho.ConnectionManager, ack *paho.Connack) {
	c.up.Store(true)
	c.referred.Store(nil) // followed, or given up for a server that answers
	c.mu.Lock()
	c.gen++
	gen := c.gen
	pc := c.dialed // autopaho connects once at a time: this CONNACK's
	c.mu.Unlock()
	var sendMax uint16
	if ack != nil && ack.Properties != nil && ack.Properties.ReceiveMaximum != nil {
		sendMax = *ack.Properties.ReceiveMaximum
	}
	pc.setSendMax(sendMax)
	go func() {
		for attempt := 0; ; attempt++ {
			ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
			// QoS 0: a reply then needs no PUBACK, a packet each way
			// less per request. It is as safe as QoS 1 here: the
			// session ends with the connection (no Session Expiry
			// Interval), so a reply in flight when it breaks is lost
			// either way, and TCP delivers the rest.
			sa, err := cm.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{
				{Topic: c.respTopic, QoS: 0, NoLocal: true},
			}})
			cancel()
			if err == nil {
				break
			}
			c.log.Warn("subscribe to the response topic failed", "error", err, "attempt", attempt+1)
			if sa != nil && len(sa.Reasons) > 0 {
				select {
				case c.setup <- fmt.Errorf("subscription to the response topic %s refused (reason 0x%02x)", c.respTopic, sa.Reasons[0]):
				default:
				}
			}
			if !c.pause(attempt) || !c.current(gen) {
				return
			}
		}
		// Its notification topics too: mqkv's broker delivers them without
		// a subscription (and once with one), another broker that mqkv is
		// attached to (mqkv attach) only with. Best effort: a broker may
		// refuse it, and replies still come. A direct connection has no
		// watches.
		if c.parent == nil {
			ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
			if _, err := cm.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: c.notifyFilter, QoS: 1}}}); err != nil {
				c.log.Debug("subscribe to the notification topics failed", "error", err)
			}
			cancel()
		}
		c.mu.Lock()
		if c.gen != gen {
			c.mu.Unlock()
			return // a newer connection does its own setup
		}
		select {
		case <-c.ready:
		default:
			close(c.ready)
			c.live = pc
		}
		// Patterns first: a key's resync may deliver to them.
		var patterns, keys []watchID
		for id := range c.watches {
			if id.pattern {
				patterns = append(patterns, id)
			} else {
				keys = append(keys, id)
			}
		}
		c.mu.Unlock()
		for _, id := range append(patterns, keys...) {
			c.resync(id, gen)
		}
	}()
}

// connectDelay is the wait before connection attempt number attempt
// (autopaho asks before every attempt, the first one included): none
// before the very first, which a CLI call and every Dial wait for; after
// a connection was lost, the backoff, so that two clients taking the same
// id from each other do not spin.
func (c *Client) connectDelay(attempt int) time.Duration {
	if attempt == 0 && !c.up.Load() {
		return 0
	}
	return backoff(attempt)
}

// backoff is the wait before retry number attempt+1 (reconnects,
// subscriptions, re-registrations): growing, at most 5 s.
func backoff(attempt int) time.Duration {
	return min(time.Duration(attempt+1)*250*time.Millisecond, 5*time.Second)
}

// pause waits backoff(attempt); false if the client was closed meanwhile.
func (c *Client) pause(attempt int) bool {
	select {
	case <-time.After(backoff(attempt)):
		return true
	case <-c.done:
		return false
	}
}

// current reports whether connection gen is still the client's latest.
func (c *Client) current(gen uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen == gen && !c.closed
}

func (c *Client) onConnectionDown() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	select {
	case <-c.ready:
		c.ready, c.live = make(chan struct{}), nil
	default:
	}
	return !c.closed
}

func (c *Client) onPublish(pr paho.PublishReceived) (bool, error) {
	p := pr.Packet
	if c.takeReply(p) {
		return true, nil
	}
	if strings.HasPrefix(p.Topic, notifyPrefix) {
		c.onNotification(p)
	}
	return true, nil
}

// takeReply hands a reply to the request waiting for it, if p is one:
// a PUBLISH on the response topic (false for any other).
func (c *Client) takeReply(p *paho.Publish) bool {
	if p.Topic != c.respTopic {
		return false
	}
	if p.Properties == nil {
		return true
	}
	c.mu.Lock()
	ch := c.pending[string(p.Properties.CorrelationData)]
	delete(c.pending, string(p.Properties.CorrelationData))
	c.mu.Unlock()
	if ch != nil {
		ch <- p
	}
	return true
}

// Close disconnects. Requests in progress end with ErrClosed, watches'
// channels are closed.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.done)
	for _, w := range c.watches {
		w.closeAll()
	}
	c.watches = map[watchID]*keyWatch{}
	c.mu.Unlock()
	if c.direct != nil {
		c.direct.close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return c.cm.Disconnect(ctx)
}

// unkept is the session's store of the packets paho sends (SUBSCRIBE
// and UNSUBSCRIBE: requests go out through appendRequest), which keeps
// none. paho keeps each for a resend on a session that outlives its
// connection; this client's sessions end with theirs (no Session Expiry
// Interval), so nothing kept would ever be resent.
type unkept struct{}

func (unkept) Put(uint16, byte, io.WriterTo) error { return nil }
func (unkept) Get(uint16) (io.ReadCloser, error)   { return nil, errNotKept }
func (unkept) Delete(uint16) error                 { return nil }
func (unkept) Quarantine(uint16) error             { return nil }
func (unkept) List() ([]uint16, error)             { return nil, nil }
func (unkept) Reset() error                        { return nil }

var errNotKept = errors.New("client: packets are not kept")

// ErrClosed is returned for requests on a closed client.
var ErrClosed = errors.New("client: closed")

// reply is a parsed response with its version.
type reply struct {
	resp.Value
	version Version
}

// errNotSent is a direct connection's answer to a request it did not
// send, being down: the first connection takes it.
var errNotSent = errors.New("client: direct connection down")

// request sends one command and waits for its reply. props are extra user
// properties (__ft).
func (c *Client) request(ctx context.Context, args [][]byte, props ...paho.UserProperty) (reply, error) {
	if c.direct != nil && keyed(args) {
		if d := c.direct.pick(args[1]); d != nil {
			if r, err := d.request(ctx, args, props...); !errors.Is(err, errNotSent) {
				return r, err
			}
		}
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.cfg.Timeout)
		defer cancel()
	}
	if c.parent != nil && !c.isReady() {
		return reply{}, errNotSent
	}
	var pc *packetConn // the connection the request goes on, once up
	for pc == nil {
		c.mu.Lock()
		ready, live := c.ready, c.live
		c.mu.Unlock()
		select {
		case <-ready:
			pc = live // nil if it went down since: wait for the next
		case <-c.done:
			return reply{}, ErrClosed
		case <-ctx.Done():
			return reply{}, fmt.Errorf("client: not connected: %w", ctx.Err())
		}
	}
	corr := make([]byte, 16)
	rand.Read(corr)
	ch := make(chan *paho.Publish, 1)
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return reply{}, ErrClosed
	}
	c.pending[string(corr)] = ch
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		delete(c.pending, string(corr))
		c.mu.Unlock()
	}()
	expiry := uint32(10)
	if d, ok := ctx.Deadline(); ok {
		expiry = uint32(max(1, int(time.Until(d).Seconds()+0.999)))
	}
	// __srcId names the client as the AIO SDKs do: an attached mqkv
	// (mqkv attach) knows the requester by it alone.
	user := paho.UserProperties{{Key: "__ts", Value: c.clock.Now().String()}, {Key: "__srcId", Value: c.cfg.ClientID}}
	user = append(user, props...)
	payload := resp.AppendBulks(nil, args...)
	pp := &paho.PublishProperties{
		CorrelationData: corr,
		ResponseTopic:   c.respTopic,
		ContentType:     "application/octet-stream",
		MessageExpiry:   &expiry,
		User:            user,
	}
	if !requestFits(requestTopic, payload, pp) {
		return reply{}, errors.New("client: publish: the request is too large for an MQTT packet")
	}
	// The reply comes before the PUBACK (the server acknowledges a
	// request once answered; another broker, with mqkv attached, at
	// once): a PUBACK matters only when it refuses the request.
	refused := make(chan error, 1)
	err := pc.publish(ctx, func(b []byte, id uint16) []byte {
		return appendRequest(b, id, requestTopic, payload, pp)
	}, func(reason byte, err error) {
		if err == nil && reason >= 0x80 {
			err = pubackError(reason)
		}
		if err != nil {
			refused <- err
		}
	})
	if err != nil {
		select {
		case <-c.done:
			return reply{}, ErrClosed
		default:
		}
		return reply{}, fmt.Errorf("client: publish: %w", err)
	}
	select {
	case p := <-ch:
		return c.parse(p)
	case err := <-refused:
		select {
		case p := <-ch: // answered before the connection ended
			return c.parse(p)
		case <-c.done:
			return reply{}, ErrClosed
		default:
		}
		return reply{}, fmt.Errorf("client: publish: %w", err)
	case <-c.done:
		return reply{}, ErrClosed
	case <-ctx.Done():
		return reply{}, fmt.Errorf("client: no reply: %w", ctx.Err())
	}
}

func (c *Client) parse(p *paho.Publish) (reply, error) {
	var r reply
	if ts := userProperty(p, "__ts"); ts != "" {
		v, err := hlc.Parse(ts)
		if err != nil {
			return r, fmt.Errorf("client: reply with malformed __ts %q", ts)
		}
		c.clock.Observe(v)
		r.version = v
	}
	if st := userProperty(p, "__stat"); st != "" && st != "200" {
		return r, fmt.Errorf("client: request failed with status %s: %s", st, userProperty(p, "__stMsg"))
	}
	v, err := resp.ParseReply(p.Payload)
	if err != nil {
		return r, fmt.Errorf("client: %w: %q", err, p.Payload)
	}
	r.Value = v
	return r, v.Err()
}

func userProperty(p *paho.Publish, key string) string {
	if p.Properties == nil {
		return ""
	}
	for _, u := range p.Properties.User {
		if u.Key == key {
			return u.Value
		}
	}
	return ""
}

func unexpected(cmd string, v resp.Value) error {
	return fmt.Errorf("client: unexpected %s reply %c%q", cmd, v.Kind, v.Str)
}

// speaksTLS reports whether addr answers a TLS handshake: what a plain
// MQTT connection to a TLS port gets is an end of file, which says nothing.
func speaksTLS(ctx context.Context, addr string) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	d := tls.Dialer{Config: &tls.Config{InsecureSkipVerify: true}} // only asking whether it is TLS
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err == nil {
		conn.Close()
		return true
	}
	var alert tls.AlertError
	return errors.As(err, &alert) // it answered in TLS, if only to refuse
}
