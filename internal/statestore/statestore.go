// Package statestore is the state store protocol service: it reads RESP
// requests that arrive on the request topic, validates them, answers reads
// from the applied state, sends writes through the replica group, keeps the
// KEYNOTIFY registrations and turns change events into notifications. It
// knows nothing of the MQTT broker beyond the Transport interface.
package statestore

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/drain"
	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/store"
	"github.com/mqkv/mqkv/internal/topics"
)

// Topics of the protocol (spec section 1).
const (
	RequestTopic = topics.Request
	// NotifyPrefix starts every notification topic; clients may not use
	// topics under it as response topics.
	NotifyPrefix = topics.NotifyPrefix
)

// NotifyTopic returns the topic of a notification about key for clientID:
// upper-case hex of both, as the Rust client requires.
func NotifyTopic(clientID string, key []byte) string {
	return NotifyClientPrefix(clientID) + hexUpper(key)
}

// MaxTopicLength is MQTT's limit on a topic name, whose length is sent in
// two bytes: a notification about a key of more than about 32 KiB does not
// fit (spec section 1.3).
const MaxTopicLength = 65535

// notifyTopicFits reports whether NotifyTopic(clientID, key) fits in an
// MQTT topic, for a key of keyLen bytes.
func notifyTopicFits(clientID string, keyLen int) bool {
	return len(NotifyClientPrefix(clientID))+2*keyLen <= MaxTopicLength // the key in hex
}

// NotifyClientPrefix returns the notification topic of clientID up to (and
// including) the '/' before the key level.
func NotifyClientPrefix(clientID string) string {
	return NotifyPrefix + "/" + hexUpper([]byte(clientID)) + "/command/notify/"
}

// ErrQoS0 answers requests published at QoS 0: the protocol needs QoS 1.
const ErrQoS0 resp.Error = "requests must be published with QoS 1"

// errUnavailable answers requests that could not reach the log: no leader
// for the key's group within the request timeout (a group without quorum),
// or a node shutting down. Nothing was written.
const errUnavailable resp.Error = "the state store is unavailable; retry the request"

// unavailable is the answer to a request the router could not serve: err
// may give the reason a client is told (a node no longer a member of its
// cluster, say); else errUnavailable.
func unavailable(err error) resp.Error {
	var r interface{ Reason() string }
	if errors.As(err, &r) {
		return resp.Error("the state store is unavailable: " + r.Reason())
	}
	return errUnavailable
}

// errUnknownOutcome answers a write whose log entry was proposed but whose
// leader was deposed before it committed: it may or may not take effect,
// and saying "not applied" could be a lie.
const errUnknownOutcome resp.Error = "the outcome of the write is unknown (the key's leader changed while it was in flight); read the key to learn it"

// RequestTimeout bounds how long a request waits for the key's group: a
// group that has lost its quorum answers errUnavailable after it instead
// of hanging.
const RequestTimeout = 5 * time.Second

// Router is how the service reaches the keyspace: the replica group that
// owns a key, on this node or another. A single node routes every key to
// its one group; a cluster node forwards to the leader of the key's group.
//
// Threading: Submit, Get and Ascend are called from many goroutines at
// once (every MQTT connection reads its own requests). Submit may block
// only for back-pressure; it calls p.Done exactly once, later, from another
// goroutine, and Done must not block. Errors are replica.ErrOutcomeUnknown
// (maybe applied), or anything else (not applied). Get and Ascend block
// until answered or ctx ends; their answers are linearizable: they reflect
// every write acknowledged before they were called.
type Router interface {
	Submit(ctx context.Context, p replica.Proposal)
	// Get returns the live entry under key.
	Get(ctx context.Context, key []byte) (store.Entry, bool, error)
	// Ascend calls fn with live entries whose keys start with prefix, in
	// key order over the whole keyspace, from the first at or after from,
	// until fn returns false or limit entries were given; exhausted says
	// it ran out of entries. fn must not block.
	Ascend(ctx context.Context, from, prefix []byte, limit int, fn func(*store.Entry) bool) (exhausted bool, err error)
	// Clock is this node's hybrid logical clock.
	Clock() *hlc.Clock
}

// Rounds is a Router whose writes may come in rounds (Request.Gathered):
// their sender says when it begins to read one and when it has sent all
// of it, so that the round's last writes need not wait behind the entry
// its first ones went into (replica.Group.RoundBegun).
type Rounds interface {
	RoundBegun()
	RoundSent()
}

// RoundBegun tells the router, if it takes rounds (Rounds), that a round
// of gathered writes is being read.
func (s *Service) RoundBegun() {
	if r, ok := s.router.(Rounds); ok {
		r.RoundBegun()
	}
}

// RoundSent tells the router, if it takes rounds, that all of the round
// was sent.
func (s *Service) RoundSent() {
	if r, ok := s.router.(Rounds); ok {
		r.RoundSent()
	}
}

// ContentType is the content type of replies and notifications.
const ContentType = "application/octet-stream"

// ReasonTopicNameInvalid is the MQTT reason code (0x90) a client is
// disconnected with when it names a forbidden response topic.
const ReasonTopicNameInvalid byte = 0x90

// Request is one state store request as it came off MQTT.
type Request struct {
	ClientID string
	Conn     uint64 // identifies the connection; registrations end with it
	// Grant says which keys the client may read and write; nil allows all.
	Grant           *policy.Grant
	Payload         []byte
	ResponseTopic   string
	CorrelationData []byte
	QoS             byte
	MessageExpiry   uint32 // seconds; the reply expires with the request
	// Timestamp and FencingToken are the __ts and __ft user properties;
	// the Has flags tell an absent property from an empty one.
	Timestamp, FencingToken       string
	HasTimestamp, HasFencingToken bool
	// StampWrites stamps a write without Timestamp with the node's clock
	// (a gateway's: its clients send no __ts).
	StampWrites bool
	// Gathered says the caller sends its writes in rounds, each round
	// all that its clients sent meanwhile, and waits for a round to be
	// answered before the next (the RESP endpoint's loop): the log's
	// proposer need not hold for more writes to join.
	Gathered bool
	// ID, if set, names the request among every requester's for as long
	// as it may be delivered again (its message expiry, or KeepRequest):
	// a write carrying it is executed once, however many times and to
	// whichever process it is delivered, where the router remembers
	// requests (see store.Command.Request). Set by a transport whose
	// requests may come again without its knowing (attach mode).
	ID []byte
	// Origin is the transport's own handle on the connection the request
	// came from, for its Reply; the service does not look at it.
	Origin any

	start    time.Time // when Handle took it, for latency metrics
	command  string    // the verb, for metrics
	key      []byte    // the key it names, if any, for activity figures
	deadline deadline  // its time limit, once it reads or writes

	// The write it makes (see write): its op, whether it is a SET ... GET
	// (or an arithmetic write, which answers with the number too), the
	// length of the arithmetic write's PREFIX, and the Done its proposal
	// carries, made once for the request's life, not once a write: a
	// gateway's requests are reused.
	writeOp     store.Op
	writeGet    bool
	writePrefix int
	writeDone   func(store.Result, error)
}

// Renew empties r for another request, keeping what it made for its
// writes: a gateway reuses a request for its connection's next command.
func (r *Request) Renew() {
	done := r.writeDone
	*r = Request{}
	r.writeDone = done
}

// follower is a Router whose change events must be asked for: Follow
// returns once every change applied after it will reach Events; Following
// says whether they do already; Delivered waits until the changes applied
// so far have reached Events, where the node delivers its own (on its
// own: see cluster.Node.Delivered).
type follower interface {
	Follow(ctx context.Context) error
	Following() bool
	Delivered(ctx context.Context) error
	// HistoryFloor is, once following, a version above every change to
	// partition p that was not delivered (see cluster.Node.HistoryFloor).
	HistoryFloor(p int) (hlc.Timestamp, bool)
}

// Transport is what the service needs from the broker.
type Transport interface {
	// Reply publishes the response to r on its response topic, with its
	// correlation data and message expiry, user property __stat=200 and,
	// if version is not zero, __ts.
	Reply(r *Request, payload []byte, version hlc.Timestamp)
	// Deliver puts a notification into the session of clientID, exactly
	// once, whether or not the client subscribed to the topic.
	// conn is the connection that registered; a newer connection of the
	// same client must not get it. It reports whether the notification
	// was queued for the client: false if the connection is gone or its
	// session holds as many unacknowledged messages as it may (the
	// transport counts those drops).
	Deliver(clientID string, conn uint64, topic string, payload []byte, version hlc.Timestamp) bool
	// Disconnect ends a client's connection with an MQTT reason code.
	Disconnect(clientID string, conn uint64, reason byte)
}

// Counters are monotonically increasing event counts.
type Counters struct {
	Requests            atomic.Int64
	NoResponseTopic     atomic.Int64 // requests dropped for want of a response topic
	ForbiddenTopic      atomic.Int64 // clients disconnected for their response topic
	Errors              atomic.Int64 // -ERR replies
	NotificationsSent   atomic.Int64
	RegistrationsActive atomic.Int64
	Denied              atomic.Int64 // requests refused by the policy
	EventsLost          atomic.Int64 // losses of changes to this node: it fell behind a group (see EventsGap)
	// Repeats are writes answered with the result of their request's
	// earlier execution (Request.ID), not executed again.
	Repeats atomic.Int64
}

// Limits bound what one request or client may use. Zero means unlimited.
// The store's own limits (keys, bytes) are in store.Limits.
type Limits struct {
	MaxKeyLength            int // bytes
	MaxRegistrationsPerConn int // KEYNOTIFY registrations of one connection
	History                 HistoryLimits
}

// Service serves the protocol over a Router.
type Service struct {
	router    Router
	transport Transport
	log       *slog.Logger
	observers *registry
	limits    Limits
	tokens    tokens // SCAN's continuation tokens
	history   *history
	Counters  Counters

	// dispatch orders notifications: Events holds it while it records and
	// delivers a batch, KEYNOTIFY ... SINCE while it registers and
	// replays, so replayed and live notifications never interleave, miss
	// or repeat a change.
	dispatch  sync.Mutex
	observing []*observer // reused by Events under dispatch
	// historyOn is set once the history holds every change after its
	// start: at once where changes always flow, else at the first Follow.
	historyOn bool

	writes drain.Counter // submitted and not yet answered: see Drain

	// OnReply, if set, is told of every reply (see Reply): the command, its result
	// (ok, miss, not_applied or error) and how long the request took.
	OnReply func(Reply)
}

// New returns a service over router. Call SetTransport (if t is nil)
// before Handle. The router's change events must be passed to Events.
func New(router Router, t Transport, limits Limits, log *slog.Logger) *Service {
	if log == nil {
		log = slog.Default()
	}
	if limits.History == (HistoryLimits{}) {
		limits.History = DefaultHistory
	}
	s := &Service{router: router, transport: t, log: log, limits: limits, tokens: newTokens(), history: newHistory(limits.History)}
	s.observers = newRegistry(&s.Counters.RegistrationsActive)
	// Nothing before this moment is in the history. A cluster node sees
	// changes only once it follows the groups (at the first KEYNOTIFY):
	// until then every SINCE is answered "truncated", not with a replay
	// missing what it never saw.
	if f, ok := router.(follower); !ok || f.Following() {
		s.beginHistory()
	}
	return s
}

// Drain waits until every write submitted so far is answered (each ends
// by RequestTimeout), and, where the router delivers its changes through
// a queue (deliverer), their notifications went out; or ctx ends. A
// shutdown calls it once no request is handled any more, so that no
// client loses the reply to a write that was applied, nor an observer
// its notification.
func (s *Service) Drain(ctx context.Context) error {
	if err := s.writes.Wait(ctx); err != nil {
		return err
	}
	if d, ok := s.router.(deliverer); ok {
		return d.Delivered(ctx)
	}
	return nil
}

// deliverer is a Router that hands applied changes to Events through a
// queue (cluster.Node): Delivered waits until the changes applied so far
// went through.
type deliverer interface {
	Delivered(ctx context.Context) error
}

// SetTransport sets the transport; the broker is built after the service.
func (s *Service) SetTransport(t Transport) { s.transport = t }

// Handle serves one request. Reads are answered before it returns; writes
// are answered when their log entry has been applied.
func (s *Service) Handle(r *Request) {
	s.begin(r)
	if r.ResponseTopic == "" {
		s.Counters.NoResponseTopic.Add(1)
		s.log.Debug("state store request without response topic dropped", "client", r.ClientID)
		return
	}
	if ForbiddenResponseTopic(r.ResponseTopic) {
		s.Counters.ForbiddenTopic.Add(1)
		s.log.Info("client disconnected: forbidden response topic", "client", r.ClientID, "topic", r.ResponseTopic)
		s.transport.Disconnect(r.ClientID, r.Conn, ReasonTopicNameInvalid)
		return
	}
	if r.QoS == 0 {
		s.fail(r, ErrQoS0)
		return
	}
	args, err := resp.ParseRequest(r.Payload)
	if err != nil {
		s.fail(r, resp.ErrSyntax)
		return
	}
	s.serve(r, args)
}

// Replier answers the requests of a gateway (RESP, memcached, HTTP): a
// Request whose Origin is a Replier is answered through it, not through
// the transport. Reply is called once per request, from the goroutine that
// called Do for a read and from the log's for a write; it must not block.
// The service touches the request no more once it called Reply (or
// ReplyBulk): the origin may use it for its next request.
type Replier interface {
	Reply(r *Request, payload []byte, version hlc.Timestamp)
}

// BulkReplier is a Replier that takes a value as it is, not encoded: a
// gateway writes it into its own reply buffer, with one copy and no
// allocation (a GET's reply is most of what a pipelined GET costs). The
// value must not be kept past the call without a copy.
type BulkReplier interface {
	Replier
	ReplyBulk(r *Request, value []byte, version hlc.Timestamp)
}

// Notifier receives the notifications of a gateway client's KEYNOTIFY
// registrations (an HTTP watch): a Request whose Origin is a Notifier
// registers them to it instead of the transport. Notify runs on the
// goroutine that applies the log and must not block; false drops the
// notification. ev's bytes must not be kept past the call without a copy.
type Notifier interface {
	Notify(ev store.Event) bool
}

// GapNotifier is a Notifier that can be told that changes were lost to
// this node (see EventsGap): its registrations missed some, and it says
// so to its client (an HTTP watch ends with "truncated", as etcd cancels
// a watch behind its compaction). MQTT's KEYNOTIFY has no such message.
type GapNotifier interface {
	Notifier
	Gap()
}

func sinkOf(r *Request) Notifier {
	n, _ := r.Origin.(Notifier)
	return n
}

// Do serves one request of a gateway: args is the command as the MQTT
// protocol has it (GET key, SET key value NX PX 10, ...), r says who asks
// (ClientID, Conn, Grant, the __ts and __ft it stands for) and has a
// Replier as its Origin. Everything else is as for MQTT: the same checks,
// authorization, limits, log, notifications and metrics.
func (s *Service) Do(r *Request, args [][]byte) {
	s.begin(r)
	if len(args) == 0 {
		s.fail(r, resp.ErrSyntax)
		return
	}
	s.serve(r, args)
}

// begin counts a request and, for its metrics, notes when it came.
func (s *Service) begin(r *Request) {
	s.Counters.Requests.Add(1)
	if s.OnReply != nil {
		r.start = time.Now()
	}
}

// serve serves a parsed request.
func (s *Service) serve(r *Request, args [][]byte) {
	r.command = commandName(args[0])
	if len(args) > 1 && r.command != "SCAN" {
		r.key = args[1]
	}
	switch r.command {
	case "GET":
		s.get(r, args)
	case "SET":
		s.set(r, args)
	case "DEL":
		s.del(r, args, store.OpDel)
	case "VDEL":
		s.del(r, args, store.OpVDel)
	case "KEYNOTIFY":
		s.keyNotify(r, args)
	case "PING":
		s.ping(r, args)
	case "PTTL":
		s.pttl(r, args)
	case "SCAN":
		s.scan(r, args)
	case "ROUTES":
		s.routes(r, args)
	case "INCRBY", "DECRBY":
		s.add(r, args)
	case "APPEND", "PREPEND":
		s.join(r, args)
	case "PEXPIRE", "PERSIST":
		s.touch(r, args)
	default:
		s.fail(r, resp.ErrUnknownCommand)
	}
}

// ForbiddenResponseTopic applies the public doc's rule (the request topic,
// or anything under the notification prefix) and MQTT's: no wildcards.
func ForbiddenResponseTopic(t string) bool {
	return t == RequestTopic || strings.HasPrefix(t, NotifyPrefix) || strings.ContainsAny(t, "+#")
}

// Disconnected ends the registrations of a connection.
func (s *Service) Disconnected(clientID string, conn uint64) {
	s.observers.dropConn(clientID, conn)
}

// Observing reports whether a connection holds KEYNOTIFY registrations.
func (s *Service) Observing(clientID string, conn uint64) bool {
	return s.observers.holds(clientID, conn)
}

// Revoke applies a connection's new grant to its registrations: exact keys
// it may no longer read end, and patterns deliver only what it may read.
func (s *Service) Revoke(clientID string, conn uint64, g *policy.Grant) {
	s.observers.revoke(clientID, conn, g)
}

// reply answers r, through its origin if that is a Replier, else through
// the transport. It observes r first: once answered, a gateway's origin
// may use the request for its next one (see Replier).
func (s *Service) reply(r *Request, payload []byte, version hlc.Timestamp) {
	if s.OnReply != nil {
		res := resultOf(payload)
		if r.command == "PTTL" && res == "not_applied" {
			res = "ok" // -1: a key without expiry
		}
		if r.writeOp == store.OpAdd && payload[0] == ':' {
			res = "ok" // the number, whatever it is
		}
		if (r.writeOp == store.OpAppend || r.writeOp == store.OpPrepend) && string(payload) == ":0\r\n" {
			res = "ok" // a length of 0
		}
		s.observe(r, res)
	}
	if rp, ok := r.Origin.(Replier); ok {
		rp.Reply(r, payload, version)
	} else {
		s.transport.Reply(r, payload, version)
	}
}

// replyBulk answers r with a value (a bulk string): given as it is to an
// origin that takes it so, encoded otherwise.
func (s *Service) replyBulk(r *Request, value []byte, version hlc.Timestamp) {
	br, ok := r.Origin.(BulkReplier)
	if !ok {
		s.reply(r, resp.AppendBulk(nil, value), version)
		return
	}
	if s.OnReply != nil {
		s.observe(r, "ok")
	}
	br.ReplyBulk(r, value, version)
}

// observe reports an answered request to OnReply.
func (s *Service) observe(r *Request, result string) {
	cmd := r.command
	if cmd == "" {
		cmd = "INVALID"
	}
	d := time.Since(r.start) // the monotonic clock alone: cheaper than time.Now
	s.OnReply(Reply{Command: cmd, Result: result, At: r.start.Add(d), Duration: d, ClientID: r.ClientID, Key: r.key})
}

// Reply describes one answered request, for metrics and activity figures.
// Key aliases the request: copy it to keep it.
type Reply struct {
	Command, Result string
	At              time.Time // when answered
	Duration        time.Duration
	ClientID        string
	Key             []byte
}

var commandNames = []string{"GET", "SET", "DEL", "VDEL", "KEYNOTIFY", "PING", "PTTL", "SCAN", "ROUTES", "INCRBY", "DECRBY", "APPEND", "PREPEND", "PEXPIRE", "PERSIST"}

// commandName names a verb, for dispatch and metrics, from a fixed set so
// that labels stay bounded.
func commandName(verb []byte) string {
	for _, n := range commandNames {
		if equalFold(verb, n) {
			return n
		}
	}
	return "UNKNOWN"
}

// resultOf classifies a reply for metrics.
func resultOf(payload []byte) string {
	switch {
	case payload[0] == '-':
		return "error"
	case string(payload) == "$-1\r\n" || string(payload) == ":0\r\n" || string(payload) == ":-2\r\n":
		return "miss"
	case string(payload) == ":-1\r\n":
		return "not_applied"
	}
	return "ok"
}

func (s *Service) fail(r *Request, e resp.Error) {
	s.Counters.Errors.Add(1)
	s.reply(r, resp.AppendError(nil, string(e)), hlc.Timestamp{})
}

// checkKey applies the checks every keyed command starts with, in the
// protocol's order: an empty key, __ts (required for writes, validated
// whenever present), authorization, then the key length limit.
func (s *Service) checkKey(r *Request, key []byte, method policy.Method) (hlc.Timestamp, resp.Error) {
	if len(key) == 0 {
		return hlc.Timestamp{}, resp.ErrKeyLengthZero
	}
	if store.Reserved(key) {
		// The server's own (MQTT retained messages, ...): no client's.
		s.Counters.Denied.Add(1)
		return hlc.Timestamp{}, resp.ErrNotAuthorized
	}
	var ts hlc.Timestamp
	switch {
	case !r.HasTimestamp && method == policy.Write && r.StampWrites:
		// Stamped by the router if the write leaves this node
		// (replica.Proposal.Stamp): reading the clock for every write
		// cost a pipelined SET 3 % of its CPU.
	case !r.HasTimestamp && method == policy.Write:
		return hlc.Timestamp{}, resp.ErrTimestampMissing
	default:
		var e resp.Error
		if ts, e = s.parseHLC(r.Timestamp, r.HasTimestamp, resp.ErrTimestampSkew); e != "" {
			return ts, e
		}
	}
	if !r.Grant.CanAccess(key, method) {
		s.Counters.Denied.Add(1)
		return ts, resp.ErrNotAuthorized
	}
	if s.limits.MaxKeyLength > 0 && len(key) > s.limits.MaxKeyLength {
		return ts, resp.ErrQuotaExceeded
	}
	return ts, ""
}

// fencingToken checks __ft when present.
func (s *Service) fencingToken(r *Request) (hlc.Timestamp, resp.Error) {
	return s.parseHLC(r.FencingToken, r.HasFencingToken, resp.ErrFencingTokenSkew)
}

// parseHLC reads a timestamp property; absent is the zero timestamp, too
// far ahead of the server clock is skewErr.
func (s *Service) parseHLC(v string, present bool, skewErr resp.Error) (hlc.Timestamp, resp.Error) {
	if !present {
		return hlc.Timestamp{}, ""
	}
	ts, err := hlc.Parse(v)
	if err != nil {
		return hlc.Timestamp{}, resp.ErrTimestampMalformed
	}
	if s.router.Clock().CheckSkew(ts) != nil {
		return hlc.Timestamp{}, skewErr
	}
	return ts, ""
}

func (s *Service) get(r *Request, args [][]byte) {
	e, found, ok := s.readKey(r, args)
	switch {
	case !ok:
	case !found:
		s.reply(r, resp.Nil, hlc.Timestamp{})
	default:
		s.replyBulk(r, e.Value, e.Version)
	}
}

// readKey starts the commands that read one key (GET, PTTL): one argument,
// checked for Read. ok is false when it has already answered with an error.
func (s *Service) readKey(r *Request, args [][]byte) (e store.Entry, found, ok bool) {
	if len(args) != 2 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return e, false, false
	}
	if _, err := s.checkKey(r, args[1], policy.Read); err != "" {
		s.fail(r, err)
		return e, false, false
	}
	ctx := r.deadlineIn(RequestTimeout)
	defer ctx.release()
	e, found, err := s.router.Get(ctx, args[1])
	if err != nil {
		s.log.Debug("state store read failed", "client", r.ClientID, "error", err)
		s.fail(r, unavailable(err))
		return e, false, false
	}
	return e, found, true
}

// MaxTTL, in milliseconds, keeps deadlines far from overflow (about 292
// thousand years): the store adds it to the time of the write.
const MaxTTL = math.MaxInt64 / 1024

// parsePX reads a PX argument: a positive number of milliseconds. A
// fraction (the .NET client sends "1.5") rounds up to a whole millisecond.
func parsePX(b []byte) (int64, bool) {
	s := string(b)
	whole, frac, hasFrac := strings.Cut(s, ".")
	if whole == "" || (hasFrac && frac == "") {
		return 0, false
	}
	for _, part := range []string{whole, frac} {
		for i := 0; i < len(part); i++ {
			if part[i] < '0' || part[i] > '9' {
				return 0, false
			}
		}
	}
	ms, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || ms > MaxTTL {
		return 0, false
	}
	if strings.Trim(frac, "0") != "" {
		ms++
	}
	return ms, ms > 0
}

func (s *Service) set(r *Request, args [][]byte) {
	if len(args) < 3 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	cmd := store.Command{Op: store.OpSet, Key: args[1], Value: args[2]}
	havePX, get := false, false
	for i := 3; i < len(args); i++ {
		opt := args[i]
		switch {
		case equalFold(opt, "NX") && cmd.Cond == store.Always:
			cmd.Cond = store.NX
		case equalFold(opt, "NEX") && cmd.Cond == store.Always:
			cmd.Cond = store.NEX
		case equalFold(opt, "XX") && cmd.Cond == store.Always:
			cmd.Cond = store.IfExists
		case equalFold(opt, "VER") && cmd.Cond == store.Always && i+1 < len(args):
			v, e := s.parseVer(args[i+1])
			if e != "" {
				s.fail(r, e)
				return
			}
			cmd.Cond, cmd.Expected = store.IfVersion, v
			i++
		case equalFold(opt, "PX") && !havePX && i+1 < len(args):
			ttl, ok := parsePX(args[i+1])
			if !ok {
				s.fail(r, resp.ErrSyntax)
				return
			}
			cmd.TTL, havePX = ttl, true
			i++
		case equalFold(opt, "GET") && !get:
			get = true
		default:
			s.fail(r, resp.ErrSyntax)
			return
		}
	}
	if cmd.Cond == store.IfExists && !s.valueOps() {
		s.fail(r, resp.ErrValueOpsProtocol)
		return
	}
	s.write(r, cmd, get)
}

// join serves APPEND key value [XX] and PREPEND key value [PREFIX p |
// UNLESS p], mqkv's extensions (docs/extensions.md): APPEND adds value to
// the end of what the key holds (creating it, as Redis's APPEND, unless
// XX); PREPEND puts value at its start, or after p, which the value must
// begin with (memcached's prepend, after the flags its endpoint keeps
// there), or at its start on condition that it does not begin with p (no
// flags there). The log applies them (store.OpAppend, OpPrepend), so that
// concurrent ones all take effect, one after the other. The answer is the
// length of the value after (so the value is read as well as written), a
// null when the key does not exist (APPEND XX, PREPEND), -1 when the
// condition on p does not hold.
func (s *Service) join(r *Request, args [][]byte) {
	if len(args) < 3 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	cmd := store.Command{Op: store.OpAppend, Key: args[1], Value: args[2]}
	switch opts := args[3:]; {
	case len(opts) == 0:
	case r.command == "APPEND" && len(opts) == 1 && equalFold(opts[0], "XX"):
		cmd.Cond = store.IfExists
	case r.command == "PREPEND" && len(opts) == 2 && (equalFold(opts[0], "PREFIX") || equalFold(opts[0], "UNLESS")):
		// The prefix and the value in one: the store keeps the first
		// Delta bytes where they are and puts the rest after them, or
		// (UNLESS, Cond NX) puts the rest first if the value does not
		// begin with them.
		cmd.Value = append(append(make([]byte, 0, len(opts[1])+len(args[2])), opts[1]...), args[2]...)
		cmd.Delta = int64(len(opts[1]))
		if equalFold(opts[0], "UNLESS") {
			cmd.Cond = store.NX
		}
	default:
		s.fail(r, resp.ErrSyntax)
		return
	}
	if r.command == "PREPEND" {
		cmd.Op = store.OpPrepend
	}
	if !s.valueOps() {
		s.fail(r, resp.ErrValueOpsProtocol)
		return
	}
	s.write(r, cmd, true) // its answer is the length: a read too
}

// touch serves PEXPIRE key ms and PERSIST key, mqkv's extensions: the key
// keeps its value and gets ms to live from now (PEXPIRE; ms at least 1),
// or none (PERSIST), as one write of the log (store.OpTouch: a new
// version, a SET for observers). The answer is 1, or 0 when the key does
// not exist; PERSIST answers 1 for a key that had no expiry too.
func (s *Service) touch(r *Request, args [][]byte) {
	want := 2
	if r.command == "PEXPIRE" {
		want = 3
	}
	if len(args) != want {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	cmd := store.Command{Op: store.OpTouch, Key: args[1]}
	if want == 3 {
		ttl, ok := parsePX(args[2])
		if !ok {
			s.fail(r, resp.ErrSyntax)
			return
		}
		cmd.TTL = ttl
	}
	if !s.valueOps() {
		s.fail(r, resp.ErrValueOpsProtocol)
		return
	}
	s.write(r, cmd, false)
}

// valueOps reports whether writes may be value ops or SETs on condition
// that the key exists: on a node on its own, or in a cluster once every
// member applies them.
func (s *Service) valueOps() bool {
	m, ok := s.router.(interface{ ValueOps() bool })
	return ok && m.ValueOps()
}

// add serves INCRBY key delta [UNSIGNED [PREFIX p]] and DECRBY (the same,
// taking delta away), mqkv's extensions (docs/extensions.md): Redis's
// INCRBY and DECRBY on a signed 64-bit number, or with UNSIGNED
// memcached's incr and decr, on the number that follows p in the value.
// The log applies them (store.OpAdd, OpIncr, OpDecr), so that concurrent
// ones all succeed, each on the number the one before it left: a gateway
// that read the number and wrote it back on condition (VER) failed most
// of 50 clients' increments of one key (issue 32).
func (s *Service) add(r *Request, args [][]byte) {
	if len(args) < 3 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	cmd := store.Command{Op: store.OpAdd, Key: args[1]}
	unsigned, prefixed := false, false
	for i := 3; i < len(args); i++ {
		switch {
		case equalFold(args[i], "UNSIGNED") && !unsigned:
			unsigned = true
		case equalFold(args[i], "PREFIX") && unsigned && !prefixed && i+1 < len(args):
			cmd.Value, prefixed = args[i+1], true
			i++
		default:
			s.fail(r, resp.ErrSyntax)
			return
		}
	}
	down := r.command == "DECRBY"
	if unsigned {
		d, err := strconv.ParseUint(string(args[2]), 10, 64)
		if err != nil {
			s.fail(r, resp.ErrNotInteger)
			return
		}
		cmd.Op, cmd.Delta = store.OpIncr, int64(d)
		if down {
			cmd.Op = store.OpDecr
		}
	} else {
		d, ok := store.ParseInteger(args[2])
		if !ok {
			s.fail(r, resp.ErrNotInteger)
			return
		}
		if down {
			if d == math.MinInt64 {
				s.fail(r, errDecrementOverflow) // Redis's words for it
				return
			}
			d = -d
		}
		cmd.Delta = d
	}
	if !s.arithmetic() {
		s.fail(r, resp.ErrArithmeticProtocol)
		return
	}
	r.writePrefix = len(cmd.Value)
	s.write(r, cmd, true) // its answer is the number: a read too
}

const errDecrementOverflow resp.Error = "decrement would overflow"

// arithmetic reports whether writes may be arithmetic ops: on a node on
// its own, or in a cluster once every member applies them.
func (s *Service) arithmetic() bool {
	m, ok := s.router.(interface{ Arithmetic() bool })
	return ok && m.Arithmetic()
}

// parseVer reads the argument of VER: a version, or 0 for "absent".
func (s *Service) parseVer(b []byte) (hlc.Timestamp, resp.Error) {
	if string(b) == "0" {
		return hlc.Timestamp{}, ""
	}
	v, err := hlc.Parse(string(b))
	if err != nil {
		return v, resp.ErrTimestampMalformed
	}
	return v, ""
}

func (s *Service) del(r *Request, args [][]byte, op store.Op) {
	want := 2
	if op == store.OpVDel {
		want = 3
	}
	// DEL k VER v: only if the key still holds version v.
	if op == store.OpDel && len(args) == 4 {
		if !equalFold(args[2], "VER") {
			s.fail(r, resp.ErrSyntax)
			return
		}
		v, e := s.parseVer(args[3])
		if e != "" {
			s.fail(r, e)
			return
		}
		s.write(r, store.Command{Op: op, Key: args[1], Cond: store.IfVersion, Expected: v}, false)
		return
	}
	if len(args) != want {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	cmd := store.Command{Op: op, Key: args[1]}
	if op == store.OpVDel {
		cmd.Value = args[2]
	}
	s.write(r, cmd, false)
}

// write validates what needs the clock and sends the command to the log;
// fencing, conditions and quota are decided when it is applied. With get, an
// applied SET answers with the value it replaced (SET ... GET).
func (s *Service) write(r *Request, cmd store.Command, get bool) {
	ts, e := s.checkKey(r, cmd.Key, policy.Write)
	if e == "" && get && !r.Grant.CanAccess(cmd.Key, policy.Read) {
		// SET ... GET answers with the value it replaced: a read.
		s.Counters.Denied.Add(1)
		e = resp.ErrNotAuthorized
	}
	if e != "" {
		s.fail(r, e)
		return
	}
	if cmd.Fence, e = s.fencingToken(r); e != "" {
		s.fail(r, e)
		return
	}
	if len(r.ID) > 0 && s.remembers() {
		cmd.Request, cmd.Keep = r.ID, keepRequest(r)
	}
	r.writeOp, r.writeGet = cmd.Op, get
	if r.writeDone == nil {
		r.writeDone = func(res store.Result, err error) { s.wrote(r, res, err) }
	}
	ctx := r.deadlineIn(RequestTimeout)
	s.writes.Start()
	stamp := r.StampWrites && !r.HasTimestamp
	s.router.Submit(ctx, replica.Proposal{Cmd: cmd, After: ts, Stamp: stamp, Gathered: r.Gathered, Done: r.writeDone})
}

// wrote answers r's write (see write) once it is applied or has failed.
func (s *Service) wrote(r *Request, res store.Result, err error) {
	r.deadline.release()
	defer s.writes.Done() // once answered
	switch {
	case err == nil:
		// First: the cases below would allocate (errors.As's target)
		// for every write.
		s.answerWrite(r, r.writeOp, res, r.writeGet)
	case errors.Is(err, replica.ErrOutcomeUnknown):
		s.log.Warn("state store write outcome unknown", "client", r.ClientID, "error", err)
		s.fail(r, errUnknownOutcome)
	case errors.As(err, new(*replica.DiskFullError)):
		s.fail(r, resp.Error(err.Error())) // the guard logs the condition once
	default:
		s.log.Warn("state store write failed", "client", r.ClientID, "error", err)
		s.fail(r, unavailable(err))
	}
}

// KeepRequest is how long a write's request is remembered (Request.ID)
// when it has no message expiry: then the broker may deliver it again for
// as long as the requester's session lasts, and this is the bound.
const KeepRequest = time.Minute

// keepRequest is how long r is remembered, in milliseconds: past its
// message expiry the broker drops it, so no copy comes later (a second
// more for the clocks).
func keepRequest(r *Request) int64 {
	if r.MessageExpiry > 0 {
		return int64(r.MessageExpiry)*1000 + 1000
	}
	return KeepRequest.Milliseconds()
}

// remembers reports whether the router executes a request with an ID once
// (a cluster does once every member can: cluster.Node.RemembersRequests).
func (s *Service) remembers() bool {
	m, ok := s.router.(interface{ RemembersRequests() bool })
	return ok && m.RemembersRequests()
}

func (s *Service) answerWrite(r *Request, op store.Op, res store.Result, get bool) {
	if res.Repeated {
		s.Counters.Repeats.Add(1)
	}
	switch res.Outcome {
	case store.FenceRequired:
		s.fail(r, resp.ErrMissingFencingToken)
	case store.FenceLower:
		s.fail(r, resp.ErrFencingTokenLowerVersion)
	case store.QuotaExceeded:
		s.fail(r, resp.ErrQuotaExceeded)
	case store.NotANumber:
		s.fail(r, resp.ErrNotInteger)
	case store.Overflow:
		s.fail(r, resp.ErrOverflow)
	case store.Applied:
		switch {
		case op.Arithmetic():
			s.answerNumber(r, op, res)
		case op == store.OpAppend || op == store.OpPrepend:
			if !res.HadPrevious { // a remembered result of another kind
				s.fail(r, errRequestReused)
				return
			}
			s.reply(r, resp.AppendInt(nil, int64(len(res.Previous))), res.Version)
		case op == store.OpTouch:
			s.reply(r, resp.One, res.Version)
		case op == store.OpSet && get && res.HadPrevious:
			s.replyBulk(r, res.Previous, res.Version)
		case op == store.OpSet && get:
			s.reply(r, resp.Nil, res.Version)
		case op == store.OpSet:
			s.reply(r, resp.OK, res.Version)
		default:
			s.reply(r, resp.One, res.Version)
		}
	case store.NotApplied:
		// SET: the key's current version (.NET throws without a __ts);
		// DEL VER: the version the key holds instead; VDEL: none.
		if op == store.OpVDel {
			res.Version = hlc.Timestamp{}
		}
		s.reply(r, resp.MinusOne, res.Version)
	case store.Missing:
		if op == store.OpIncr || op == store.OpDecr || op == store.OpAppend || op == store.OpPrepend {
			s.reply(r, resp.Nil, hlc.Timestamp{}) // no number, no length: memcached's NOT_FOUND, NOT_STORED
			return
		}
		s.reply(r, resp.Zero, hlc.Timestamp{})
	}
}

// answerNumber answers an applied arithmetic write with the number it
// stored. A result remembered for the request's id (attach mode: client
// id and correlation data) may be another request's, a SET's, if a
// client used the id twice: that is refused rather than answered as a
// number it is not.
func (s *Service) answerNumber(r *Request, op store.Op, res store.Result) {
	if !res.HadPrevious || len(res.Previous) < r.writePrefix {
		s.fail(r, errRequestReused)
		return
	}
	n := res.Previous[r.writePrefix:]
	if op == store.OpAdd {
		if _, ok := store.ParseInteger(n); !ok {
			s.fail(r, errRequestReused)
			return
		}
		s.reply(r, append(append([]byte{':'}, n...), '\r', '\n'), res.Version)
		return
	}
	if _, err := strconv.ParseUint(string(n), 10, 64); err != nil {
		s.fail(r, errRequestReused)
		return
	}
	s.replyBulk(r, n, res.Version)
}

// errRequestReused answers a request whose id an earlier request of
// another kind used.
const errRequestReused resp.Error = "this request's id (client id and correlation data) was used by an earlier request of another kind"

// keyNotify serves KEYNOTIFY key [PATTERN] [STOP | SINCE version]:
// register for (or stop) notifications about a key, or with PATTERN about
// every key matching a glob; with SINCE, first replay the changes after
// version that the history still holds.
func (s *Service) keyNotify(r *Request, args [][]byte) {
	if len(args) < 2 || len(args) > 5 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	var pattern, stop, since bool
	var from hlc.Timestamp
	for i := 2; i < len(args); i++ {
		switch a := args[i]; {
		case equalFold(a, "PATTERN") && !pattern:
			pattern = true
		case equalFold(a, "STOP") && !stop && !since:
			stop = true
		case equalFold(a, "SINCE") && !stop && !since && i+1 < len(args):
			v, err := hlc.Parse(string(args[i+1]))
			if err != nil {
				s.fail(r, resp.ErrTimestampMalformed)
				return
			}
			since, from = true, v
			i++
		default:
			s.fail(r, resp.ErrSyntax)
			return
		}
	}
	key := args[1]
	if len(key) == 0 {
		s.fail(r, resp.ErrKeyLengthZero)
		return
	}
	var matcher *glob.Matcher
	if pattern {
		// A pattern is authorized per key, as notifications are
		// delivered: only keys the client may read reach it.
		var e resp.Error
		if matcher, e = s.compilePattern(r, key); e != "" {
			s.fail(r, e)
			return
		}
	} else if _, e := s.checkKey(r, key, policy.Read); e != "" {
		s.fail(r, e)
		return
	} else if !stop && !notifyTopicFits(r.ClientID, len(key)) {
		// Its notifications could not be sent: refused now rather than
		// dropped later. (A pattern's keys are only known as they change:
		// the transport drops what does not fit.)
		s.fail(r, resp.ErrQuotaExceeded)
		return
	}
	if f, ok := s.router.(follower); ok && !stop {
		// A cluster node follows the groups' changes only once somebody
		// watches; every change after this returns is delivered. A node on
		// its own delivers them through a queue: once it has delivered
		// every change applied so far, a registration is not told, as new,
		// of a write answered before it was asked for (an observer that
		// registered after an HTTP PUT's reply was notified of that PUT
		// when the queue ran late, in TestHTTPAuthPolicyAndMQTT under CI's
		// load).
		ctx, cancel := context.WithTimeout(context.Background(), RequestTimeout)
		err := f.Follow(ctx)
		if err == nil {
			err = f.Delivered(ctx)
		}
		cancel()
		if err != nil {
			s.fail(r, unavailable(err))
			return
		}
	}
	if stop {
		if s.observers.remove(r.ClientID, r.Conn, key, pattern) {
			s.reply(r, resp.OK, hlc.Timestamp{})
		} else {
			s.reply(r, resp.Zero, hlc.Timestamp{})
		}
		return
	}
	// Register (and replay) while no batch of changes is being delivered:
	// a replay ends exactly where live notifications begin, and a plain
	// registration delivers everything after the history's latest change.
	s.dispatch.Lock()
	if !stop {
		s.beginHistory()
	}
	sink := sinkOf(r)
	if !since {
		ok := s.observers.add(r.ClientID, r.Conn, r.Grant, sink, key, matcher, regFrom{from: s.history.latest}, s.limits.MaxRegistrationsPerConn)
		s.dispatch.Unlock()
		if !ok {
			s.fail(r, resp.ErrQuotaExceeded)
			return
		}
		s.reply(r, resp.OK, hlc.Timestamp{})
		return
	}
	changes, ok := s.history.since(key, matcher, from)
	if !ok {
		s.dispatch.Unlock()
		s.fail(r, ErrHistoryTruncated)
		return
	}
	// What this connection's other registrations already delivered is
	// not replayed again: one notification per change.
	changes = slices.DeleteFunc(changes, func(c store.Event) bool {
		return s.observers.delivered(r.ClientID, r.Conn, c.Key, c.Version)
	})
	if !s.observers.add(r.ClientID, r.Conn, r.Grant, sink, key, matcher, regFrom{from: from, since: true}, s.limits.MaxRegistrationsPerConn) {
		s.dispatch.Unlock()
		s.fail(r, resp.ErrQuotaExceeded)
		return
	}
	prefix := NotifyClientPrefix(r.ClientID)
	for i := range changes {
		c := &changes[i]
		if pattern && !r.Grant.CanAccess(c.Key, policy.Read) {
			continue
		}
		s.notify(sink, r.ClientID, r.Conn, prefix, c, new(encoded))
	}
	s.dispatch.Unlock()
	s.reply(r, resp.OK, hlc.Timestamp{})
}

// Following tells the service that its router now follows every change
// (a cluster node's Follow returned): its history of changes begins now,
// rather than at the first KEYNOTIFY, so that a client that comes from
// another node (a restarted one's referral) can resume from it.
func (s *Service) Following() {
	s.dispatch.Lock()
	defer s.dispatch.Unlock()
	s.beginHistory()
}

// beginHistory starts the history once following began: it holds every
// change after each partition's floor, and keeps what reached it. A
// cluster node knows the floors (from where it began following each
// group: a restarted member's log replay reaches back before its
// restart); else what was applied before following began is at or below
// the node's clock. Under dispatch.
func (s *Service) beginHistory() {
	if s.historyOn {
		return
	}
	s.historyOn = true
	now := s.router.Clock().Now()
	f, ok := s.router.(follower)
	s.history.begin(func(p int) hlc.Timestamp {
		if ok {
			if v, known := f.HistoryFloor(p); known {
				return v
			}
		}
		return now
	})
}

// ErrHistoryTruncated answers KEYNOTIFY ... SINCE when the change history no
// longer reaches back to the version asked for (or holds more changes since
// then than one replay delivers): the client rereads instead.
const ErrHistoryTruncated resp.Error = "history truncated"

// ErrPatternTooComplex answers a SCAN or KEYNOTIFY ... PATTERN whose glob
// has more than glob.MaxElements elements after its literal prefix.
const ErrPatternTooComplex resp.Error = "pattern too complex"

// compilePattern checks a client's glob (SCAN, KEYNOTIFY ... PATTERN) like
// a key (__ts, the key length limit) and compiles it; compiled patterns
// match in time linear in the key, whoever wrote them.
func (s *Service) compilePattern(r *Request, pattern []byte) (*glob.Matcher, resp.Error) {
	if _, e := s.parseHLC(r.Timestamp, r.HasTimestamp, resp.ErrTimestampSkew); e != "" {
		return nil, e
	}
	if s.limits.MaxKeyLength > 0 && len(pattern) > s.limits.MaxKeyLength {
		return nil, resp.ErrQuotaExceeded
	}
	m, err := glob.Compile(pattern)
	if err != nil {
		return nil, ErrPatternTooComplex
	}
	return m, ""
}

// ping answers PING (an mqkv extension, as in Redis) without touching the
// store: a health check, and the floor `mqkv bench --baseline echo`
// measures the store against, since it takes the same path through the
// broker and this service as every other request.
func (s *Service) ping(r *Request, args [][]byte) {
	if len(args) != 1 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	s.reply(r, resp.Pong, hlc.Timestamp{})
}

// Routed is what a Router that spreads keys over cluster members also
// implements (cluster.Node): for each group, the MQTT address of the
// member leading it, "" where unknown. A key belongs to group
// store.Partition(key) % len(Routes()).
type Routed interface {
	Routes() []string
}

// routes answers ROUTES (an mqkv extension): an array whose first element
// is the number of partitions keys hash into (store.Partitions, of
// CRC-32C), followed by one bulk string per group, the MQTT host:port of
// its leader or empty. A client sends a key's requests to the leader of
// group crc32c(key) % partitions % groups, and saves the hop the member
// it is connected to would make (client.Config.Direct). A node on its own,
// or a router that does not spread keys, answers one group: its own.
func (s *Service) routes(r *Request, args [][]byte) {
	if len(args) != 1 {
		s.fail(r, resp.ErrWrongNumberOfArguments)
		return
	}
	addrs := []string{""}
	if rt, ok := s.router.(Routed); ok {
		addrs = rt.Routes()
	}
	b := resp.AppendArrayHeader(nil, 1+len(addrs))
	b = resp.AppendInt(b, store.Partitions)
	for _, a := range addrs {
		b = resp.AppendBulk(b, []byte(a))
	}
	s.reply(r, b, hlc.Timestamp{})
}

// pttl answers PTTL key (an mqkv extension, as in Redis): the key's
// remaining time to live in milliseconds, -1 if it does not expire, -2 if
// it does not exist.
func (s *Service) pttl(r *Request, args [][]byte) {
	e, found, ok := s.readKey(r, args)
	switch {
	case !ok:
	case !found:
		s.reply(r, resp.AppendInt(nil, -2), hlc.Timestamp{})
	case e.ExpiresAt == 0:
		s.reply(r, resp.AppendInt(nil, -1), e.Version)
	default:
		s.reply(r, resp.AppendInt(nil, max(0, e.ExpiresAt-s.router.Clock().WallMillis())), e.Version)
	}
}

// Events turns applied changes into notifications and remembers them for
// KEYNOTIFY ... SINCE, in log order per group, soon after they are
// applied (see cluster.Config.OnEvents).
func (s *Service) Events(events []store.Event) {
	s.dispatch.Lock()
	defer s.dispatch.Unlock()
	s.history.add(events, time.Now())
	for i := range events {
		ev := &events[i]
		s.observing = s.observers.lookup(ev.Key, ev.Version, s.observing[:0])
		if len(s.observing) == 0 {
			continue
		}
		var enc encoded
		for _, o := range s.observing {
			s.notify(o.sink, o.clientID, o.conn, o.topicPrefix, ev, &enc)
		}
	}
	clear(s.observing[:cap(s.observing)]) // hold no observer past the batch
}

// encoded is a change's notification payload and its key in hex, made
// once for all the observers of the change that get it over MQTT.
type encoded struct {
	payload []byte
	keyHex  string
}

// notify delivers ev to one registration: to its gateway's sink, or over
// MQTT to the client's notify topic for the key.
func (s *Service) notify(sink Notifier, clientID string, conn uint64, topicPrefix string, ev *store.Event, enc *encoded) {
	var sent bool
	if sink != nil {
		sent = sink.Notify(*ev)
	} else {
		if enc.payload == nil {
			enc.payload, enc.keyHex = NotifyPayload(ev.Kind, ev.Value), hexUpper(ev.Key)
		}
		sent = s.transport.Deliver(clientID, conn, topicPrefix+enc.keyHex, enc.payload, ev.Version)
	}
	if sent {
		s.Counters.NotificationsSent.Add(1)
	}
}

// EventsGap hears that changes were lost to this node before they reached
// Events (see cluster.Config.OnEventsGap): KEYNOTIFY ... SINCE answers
// "history truncated" where they could be missing.
//
// Live registrations missed them too: gateway watches are told (see
// GapNotifier), and the loss is counted (EventsLost) and logged by the
// cluster; an MQTT client's registrations go on without a word, as the
// protocol has none.
func (s *Service) EventsGap(resume hlc.Timestamp) {
	s.dispatch.Lock()
	defer s.dispatch.Unlock()
	s.history.gap(resume)
	if !resume.IsZero() {
		return // the end of a loss already told
	}
	s.Counters.EventsLost.Add(1)
	for _, sink := range s.observers.sinks(nil) {
		if g, ok := sink.(GapNotifier); ok {
			g.Gap()
		}
	}
}

// NotifyPayload is the payload of a KEYNOTIFY notification of a change.
func NotifyPayload(kind store.EventKind, value []byte) []byte {
	if kind == store.EventSet {
		return resp.AppendNotifySet(nil, value)
	}
	return resp.AppendNotifyDelete(nil)
}

// hexUpper is upper-case hex, in one allocation: it runs for every
// notification.
func hexUpper(b []byte) string {
	const digits = "0123456789ABCDEF"
	var sb strings.Builder
	sb.Grow(2 * len(b))
	for _, c := range b {
		sb.WriteByte(digits[c>>4])
		sb.WriteByte(digits[c&0x0f])
	}
	return sb.String()
}

// equalFold compares an argument with an upper-case ASCII word, ignoring
// case as Redis does, without allocating.
func equalFold(arg []byte, word string) bool {
	if len(arg) != len(word) {
		return false
	}
	for i := 0; i < len(arg); i++ {
		c := arg[i]
		if 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		}
		if c != word[i] {
			return false
		}
	}
	return true
}
