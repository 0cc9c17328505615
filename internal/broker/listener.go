package broker

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"
	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/listeners"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/sockio"
)

// DefaultConnectTimeout is how long a new connection has to complete its
// TLS handshake and send CONNECT; after that mochi's keep-alive deadline
// applies. It keeps idle or half-open connections from piling up.
const DefaultConnectTimeout = 10 * time.Second

// maxConnectSize bounds the first packet (CONNECT), read before the client
// is authenticated: mochi allocates a packet's declared size before reading
// it, and an unauthenticated client must not make it allocate 64 MiB.
const maxConnectSize = 64 << 10

// writeTimeout bounds every write to a client, so a client that stops
// reading cannot hold a connection's write lock (and with it disconnects,
// policy reloads and shutdown) for long.
var writeTimeout = 10 * time.Second // a variable for tests

// listener serves MQTT connections from a net.Listener: plain TCP, TLS, or
// WebSocket (over either). mochi's own TCP listener cannot report the port
// it bound, shares one error variable between connections, and sets no
// deadline before CONNECT.
type listener struct {
	id        string
	ln        net.Listener
	tls       *tls.Config
	websocket bool
	log       *slog.Logger
	http      *http.Server
	// connectTimeout is the time a connection has to send CONNECT.
	connectTimeout time.Duration
	maxPacketSize  uint32
	maxQueued      int
	// ended is called with a connection's client once mochi is done
	// with it (see Broker.connEnded).
	ended func(*mqtt.Client)
	// closeClients disconnects the listener's clients. mochi's own closer
	// (Clients.GetByListener) takes the clients lock twice for reading and
	// deadlocks when a client's disconnect queues for the write lock in
	// between, which shutdown under traffic makes likely.
	closeClients func(listenerID string)

	mu     sync.Mutex
	closed bool
}

var _ listeners.Listener = (*listener)(nil)

func (l *listener) ID() string      { return l.id }
func (l *listener) Address() string { return l.ln.Addr().String() }
func (l *listener) Protocol() string {
	switch {
	case l.websocket && l.tls != nil:
		return "wss"
	case l.websocket:
		return "ws"
	case l.tls != nil:
		return "tls"
	}
	return "tcp"
}

func (l *listener) Init(log *slog.Logger) error { l.log = log; return nil }

func (l *listener) Serve(establish listeners.EstablishFn) {
	if l.websocket {
		l.serveWebSocket(establish)
		return
	}
	var backoff time.Duration
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors, or another passing failure: wait
			// and go on, as net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			l.log.Warn("accept failed; retrying", "listener", l.id, "error", err, "in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		go func() {
			_ = conn.SetReadDeadline(time.Now().Add(l.connectTimeout))
			if l.tls != nil {
				conn = tls.Server(conn, l.tls)
			}
			l.run(establish, conn)
		}()
	}
}

// run hands one connection to mochi until it ends, after checking the size
// of its first packet. Errors here are per client (bad packets, resets,
// EOF), not the server's: debug level only.
func (l *listener) run(establish listeners.EstablishFn, conn net.Conn) {
	c, err := newClientConn(conn, l.maxPacketSize, l.maxQueued)
	if err == nil {
		err = establish(l.id, c)
		if c.client != nil && l.ended != nil {
			l.ended(c.client)
		}
	}
	if err != nil {
		l.log.Debug("connection ended", "listener", l.id, "remote", conn.RemoteAddr().String(), "error", err)
	}
	conn.Close()
}

// clientConn is a client's connection as mochi sees it: the first packet's
// header, already read to check its size, is read again first; the
// packets read are framed as they pass, so that a packet larger than the
// server's maximum gets DISCONNECT 0x95 (§3.2.2.3.6) before mochi, which
// finds it from the header, closes the connection without a word; and
// writes are coalesced (see Write).
type clientConn struct {
	net.Conn
	head []byte // the first packet's header, read to check its size: read again first
	r    io.Reader

	max       uint32 // the server's maximum packet size
	maxQueued int    // packets that may wait behind a send that does not finish; 0: no limit
	maxBytes  int    // bytes that may wait beyond the session's backlog (see writeLocked); 0: no limit
	// Bytes put in pending and taken from it since the connection began,
	// and how many had been put there when the session was established:
	// those are the session's backlog, resent at once on a resume, which
	// the byte cut leaves alone (they are held by the session anyway).
	written, flushed, backlogEnd int64
	established                  bool
	frames                       framer
	lastTopic                    topicCount // the topic the client last published to, for the console's counts

	try *sockio.Conn // for writes that must not wait (see Write); nil over TLS and websockets

	wmu     sync.Mutex
	pending []byte      // written by mochi, not yet sent
	spare   []byte      // the buffer the last send wrote from, for pending's next turn
	werr    error       // a send failed: every later write fails
	waiting bool        // the reader is blocked for input
	sending bool        // a sender writes to the socket, without the lock (see drainLocked)
	queued  int         // packets written since the sender took pending
	slow    func()      // called once when more than maxQueued wait (see Write)
	sent    sync.Cond   // on wmu: signalled when the sender is done
	timer   *time.Timer // sends what is pending if the reader takes long
	armed   bool        // the timer runs
	timerAt time.Time   // when it fires
	closed  bool

	// Until when (Unix nanoseconds) an acknowledgement may wait for the
	// reply to a state store request read just before it (see ExpectReply).
	replyDue atomic.Int64

	writeBy time.Time // the write deadline set on the connection (see sendChunks)

	// The connection's client, once mochi made it (see hook.OnConnect);
	// its goroutine's alone.
	client *mqtt.Client

	// The message the acknowledgement being read is for; the reader's
	// alone. And, once its session is being taken over, the takeover
	// (see hook.OnQosComplete).
	acking   message
	handedTo atomic.Pointer[handover]

	// The keep-alive read deadline, moved by mochi on every packet read,
	// is set on the connection lazily (see SetDeadline); Unix nanoseconds,
	// 0 for none.
	readWant  atomic.Int64 // the deadline mochi asked for last
	readArmed atomic.Int64 // the one set on the connection
	stalling  bool         // the deadline set is a stall's (see Read); the reader's

	win     window     // the client's Receive Maximum; under wmu
	aliases outAliases // topic aliases the client takes; under wmu

	// Until the CONNACK is written (see holdUntilConnack), under wmu.
	beforeConnack bool
	early         []byte // what was written before it

	hurry    atomic.Bool // being ended: writes get endTimeout
	tooLarge atomic.Bool // an MQTT 5 client sent a packet over the maximum
}

// Coalescing bounds: what waits is sent once this much is pending, and
// at the latest coalesceHold after the first of it was written, or when
// a state store reply is due, replyHold after the request (see
// ExpectReply).
// maxWaiting is how many bytes may wait for a client that does not read,
// whatever their number of packets: the largest packet and 1 MiB more, and
// 16 MiB at least.
func maxWaiting(maxPacketSize uint32) int { return max(16<<20, int(maxPacketSize)+1<<20) }

const (
	coalesceBytes = 32 << 10
	slowBytes     = 1 << 20 // with maxQueued: a client pipelining small requests may fall this far behind
	coalesceHold  = 200 * time.Microsecond
	replyHold     = 50 * time.Millisecond
)

var errConnectTooLarge = errors.New("first packet larger than 64 KiB")

func newClientConn(conn net.Conn, maxPacketSize uint32, maxQueued int) (*clientConn, error) {
	// The fixed header: a type byte, then a remaining length of 1 to 4
	// bytes, 7 bits each.
	var hdr [5]byte
	if _, err := io.ReadFull(conn, hdr[:1]); err != nil {
		return nil, err
	}
	n, size := 1, 0
	for shift := 0; ; shift += 7 {
		if n == len(hdr) {
			return nil, errors.New("malformed remaining length")
		}
		if _, err := io.ReadFull(conn, hdr[n:n+1]); err != nil {
			return nil, err
		}
		size |= int(hdr[n]&0x7f) << shift
		n++
		if hdr[n-1]&0x80 == 0 {
			break
		}
	}
	if size > maxConnectSize {
		return nil, errConnectTooLarge
	}
	c := &clientConn{Conn: conn, head: bytes.Clone(hdr[:n]), r: conn, max: maxPacketSize, maxQueued: maxQueued, maxBytes: maxWaiting(maxPacketSize), beforeConnack: true}
	c.try, _ = conn.(*sockio.Conn)
	return c, nil
}

// Read sends what is pending before it waits for input: the
// acknowledgements and messages caused by the packets just read leave in
// one system call.
func (c *clientConn) Read(p []byte) (int, error) {
	c.wmu.Lock()
	if len(c.pending) > 0 && !c.sending && !c.awaitReply() {
		// Never waiting on the socket: a client that writes its
		// acknowledgements from the loop that reads (most do) would wait
		// on this reader in turn. One that falls far behind is a slow
		// consumer (see Write).
		c.sendNowLocked()
	}
	c.waiting = true
	c.wmu.Unlock()

	var n int
	var err error
	if len(c.head) > 0 {
		n = copy(p, c.head)
		c.head = c.head[n:]
	} else {
		c.watchStall()
		n, err = c.r.Read(p)
		for n == 0 && errors.Is(err, os.ErrDeadlineExceeded) && !c.stalling && c.rearm() {
			n, err = c.r.Read(p)
		}
	}

	c.wmu.Lock()
	c.waiting = false
	c.wmu.Unlock()
	if c.frames.feed(p[:n], c.max) && c.frames.version == 5 {
		// mochi finds the header when it reaches it and closes the
		// connection; Close then sends the DISCONNECT, after whatever
		// answers the packets before it.
		c.tooLarge.Store(true)
	}
	return n, err
}

// A large packet in progress must make progress: mochi allocates a
// packet's whole declared size before reading it, so a client that sends
// the header of a maximum-size packet and stops holds that much memory for
// as long as its connection lasts, for ever with keep-alive off.
var (
	stallSize = 64 << 10         // a packet with more than this still to come ...
	stallTime = 30 * time.Second // ... ends the connection after this without a byte
)

// watchStall sets the read deadline of a large packet in progress (see
// stallSize), unless mochi's keep-alive deadline comes first, and puts
// mochi's back once the packet is read. The reader's alone.
func (c *clientConn) watchStall() {
	if c.frames.skip <= stallSize && !c.stalling {
		return // every read but a large packet's: first, at the least cost
	}
	if _, ws := c.Conn.(*wsConn); ws {
		return // a websocket connection cannot read on after a timeout
	}
	if c.frames.skip > stallSize {
		at := time.Now().Add(stallTime).UnixNano()
		if want := c.readWant.Load(); want == 0 || want > at {
			c.stalling = true
			c.readArmed.Store(at)
			c.Conn.SetReadDeadline(time.Unix(0, at))
		}
		return
	}
	c.stalling = false
	c.armWant()
}

// SetDeadline is mochi's keep-alive timer: it moves the deadline 1.5
// keep-alives ahead on every packet read (MQTT-3.1.2-22), and setting it
// on the connection each time (a runtime timer change, both directions)
// is a cost per packet. A later deadline is only noted; when the one set
// expires, Read sets the one noted and reads on (rearm). An earlier one,
// or none, is set at once. Write deadlines are sendLocked's, not mochi's.
// A websocket connection cannot read on after a timeout: it gets every
// deadline as it comes.
func (c *clientConn) SetDeadline(t time.Time) error {
	if _, ws := c.Conn.(*wsConn); ws {
		return c.Conn.SetDeadline(t)
	}
	want := int64(0)
	if !t.IsZero() {
		want = t.UnixNano()
	}
	c.readWant.Store(want)
	if armed := c.readArmed.Load(); armed != 0 && want >= armed {
		return nil // noted; see rearm
	}
	c.readArmed.Store(want)
	return c.Conn.SetReadDeadline(t)
}

// rearm sets the read deadline mochi asked for last, after the one set
// expired, and reports whether that one is later, so the read goes on.
func (c *clientConn) rearm() bool {
	if want := c.readWant.Load(); want != 0 && want <= time.Now().UnixNano() {
		return false // the keep-alive really expired
	}
	return c.armWant()
}

// armWant sets on the connection the read deadline mochi asked for last.
func (c *clientConn) armWant() bool {
	want := c.readWant.Load()
	c.readArmed.Store(want)
	var t time.Time
	if want != 0 {
		t = time.Unix(0, want)
	}
	return c.Conn.SetReadDeadline(t) == nil
}

// Write coalesces packets: mochi writes each packet with its own system
// call (a PUBACK, then the PUBLISH it routed; a reply, then the next),
// about a fifth of the broker's CPU under load. A packet written while
// the client's reader is busy with the input that caused it waits until
// the reader is done (see Read), and never longer than coalesceHold; one
// written while the reader waits for input, the common case when idle, is
// sent at once. An acknowledgement written while a state store reply is
// due waits for the reply (see ExpectReply).
//
// Write never waits on the client's socket: other clients' readers
// write to this connection (see Broker.deliverDirect), and one client that does not
// read must not stall them. What the socket does not take at once is sent
// by a goroutine of its own; a client more than maxQueued packets and
// slowBytes behind it is a slow consumer.
func (c *clientConn) Write(p []byte) (int, error) { return c.write(p, false) }

// write is Write; reader says the writer is the client's reader, handling
// a packet: it sends what is pending when it next reads, so a timer is
// not needed (setting one costs 4 % of a GET's CPU).
func (c *clientConn) write(p []byte, reader bool) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.werr != nil {
		return 0, c.werr
	}
	sent := p
	if c.beforeConnack {
		if sent = c.holdUntilConnack(p); sent == nil {
			return len(p), nil
		}
	}
	if c.win.max > 0 {
		sent = c.win.admit(sent, time.Now())
	}
	if len(sent) > 0 {
		if _, err := c.writeLocked(sent, reader); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// holdUntilConnack keeps what is written to the client before its
// CONNACK, which must be the first packet it gets (MQTT-3.2.0-1): mochi
// (v2.7.9) registers the connection of a resumed session, so that the
// session's messages are routed to it, before it writes the CONNACK. It
// returns nil until the CONNACK comes, then the CONNACK, what was held
// and the rest of p. Nothing written before a CONNACK that never comes is
// sent: such a connection is closed.
func (c *clientConn) holdUntilConnack(p []byte) []byte {
	for rest := p; len(rest) > 0; {
		frame, ok := nextFrame(rest)
		if !ok {
			break
		}
		if frame[0]>>4 == packets.Connack {
			c.beforeConnack = false
			out := make([]byte, 0, len(p)+len(c.early))
			out = append(out, frame...)
			out = append(out, c.early...)
			out = append(out, p[:len(p)-len(rest)]...)
			out = append(out, rest[len(frame):]...)
			c.early = nil
			return out
		}
		rest = rest[len(frame):]
	}
	c.early = append(c.early, p...)
	return nil
}

// SetAliases has the PUBLISH packets to the client use up to max topic
// aliases (see outAliases); maxSize is the client's Maximum Packet Size.
func (c *clientConn) SetAliases(max uint16, maxSize uint32) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.aliases = outAliases{max: max, maxSize: maxSize}
}

// SetWindow starts counting the client's Receive Maximum (see window);
// record finds a message's record in the session.
func (c *clientConn) SetWindow(max int, record func(id uint16) (packets.Packet, bool)) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.win = window{max: max, out: map[uint16]struct{}{}, record: record}
}

// Windowed reports whether SetWindow was called.
func (c *clientConn) Windowed() bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.win.max > 0
}

// Acked says the client's reader has read the PUBACK, PUBCOMP or failed
// PUBREC of the message sent under id: its slot in the window goes to the
// oldest message held, if any, which leaves once the reader is done. It
// reports whether the connection counts a window.
func (c *clientConn) Acked(id uint16) bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.win.max == 0 {
		return false
	}
	if p := c.win.acked(id, time.Now()); len(p) > 0 && c.werr == nil {
		c.writeLocked(p, true) // an error ends the connection; the messages stay in the session
	}
	return true
}

// Tracked is how many messages the window counts: sent and not yet
// acknowledged, or held.
func (c *clientConn) Tracked() int {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return len(c.win.out) + len(c.win.held)
}

// overBytes reports whether more than maxBytes wait beyond the session's
// backlog (see written).
func (c *clientConn) overBytes() bool {
	return c.maxBytes > 0 && c.established && c.written-max(c.flushed, c.backlogEnd) > int64(c.maxBytes)
}

// Established says the session's backlog has been written (mochi resends
// it before OnSessionEstablished).
func (c *clientConn) Established() {
	c.wmu.Lock()
	c.established, c.backlogEnd = true, c.written
	c.wmu.Unlock()
}

// writeLocked is write past the window.
func (c *clientConn) writeLocked(p []byte, reader bool) (int, error) {
	before, aliased := len(c.pending), len(c.aliases.order)
	if c.aliases.max > 0 && hasPublish(p) {
		c.pending = c.aliases.appendFrames(c.pending, p)
	} else {
		c.pending = append(c.pending, p...)
	}
	c.written += int64(len(c.pending) - before)
	if c.replyDue.Load() != 0 && hasPublish(p) {
		// Most likely the awaited reply: what is pending waits no more
		// for one.
		c.replyDue.Store(0)
	}
	switch {
	case c.sending:
		// The sender takes it with what it sends next. Nothing waits
		// here: mochi writes under the client's lock, which whoever
		// publishes to the client takes too (NextPacketID). A client
		// that falls maxQueued packets and slowBytes behind, or
		// maxBytes behind whatever the packets (a few replies with
		// large values), is a slow consumer.
		c.queued++
		if c.maxQueued > 0 && c.queued > c.maxQueued && len(c.pending) >= slowBytes || c.overBytes() {
			c.written -= int64(len(c.pending) - before)
			c.pending = c.pending[:before]
			c.aliases.undo(aliased)
			if c.slow != nil {
				c.slow()
				c.slow = nil
			}
			return 0, errSlowConsumer
		}
	case c.waiting || c.closed || len(c.pending) >= coalesceBytes:
		c.sendNowLocked()
	case !c.awaitReply() && !c.armed && !reader:
		c.sendBy(time.Now().Add(coalesceHold))
	}
	if c.werr != nil {
		return 0, c.werr
	}
	return len(p), nil
}

// sendNowLocked sends what the socket takes of pending without waiting,
// and hands what the socket did not take to a sender goroutine. Without a
// raw socket (TLS, websockets), which cannot be tried without waiting,
// the sender goroutine sends it all.
func (c *clientConn) sendNowLocked() {
	if c.try == nil {
		c.sendAsideLocked()
		return
	}
	n, err := c.try.TryWrite(c.pending)
	// The raw socket checks the write deadline drainLocked last set: once
	// it passed (the connection fine since), the send goes aside, and
	// drainLocked sets a new one. A connection that fails it there ends.
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		c.failLocked(err)
		return
	}
	c.pending = c.pending[:copy(c.pending, c.pending[n:])]
	c.flushed += int64(n)
	c.stopTimer()
	if len(c.pending) > 0 {
		c.sendAsideLocked()
	}
}

// sendAsideLocked has a goroutine of its own send what is pending.
func (c *clientConn) sendAsideLocked() {
	c.stopTimer()
	c.sending = true // taken before the lock is let go
	go func() {
		c.wmu.Lock()
		c.drainLocked()
		c.wmu.Unlock()
	}()
}

// waitSent waits, the lock held, until the sender signals.
func (c *clientConn) waitSent() {
	if c.sent.L == nil {
		c.sent.L = &c.wmu
	}
	c.sent.Wait()
}

// onSlow sets what to call when the client is found a slow consumer.
func (c *clientConn) onSlow(f func()) {
	c.wmu.Lock()
	c.slow = f
	c.wmu.Unlock()
}

// errSlowConsumer refuses a packet to a client too far behind.
var errSlowConsumer = errors.New("client not reading: too many packets waiting")

// backedUp reports whether what is written to the connection waits on its
// socket: the client reads slower than it is sent to.
func (c *clientConn) backedUp() bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.sending || c.werr != nil || c.closed
}

// hasPublish reports whether p, whole MQTT packets (mochi writes one, or
// several it buffered), holds a PUBLISH.
func hasPublish(p []byte) bool {
	for len(p) > 0 {
		if p[0]>>4 == packets.Publish {
			return true
		}
		frame, ok := nextFrame(p)
		if !ok {
			return false
		}
		p = p[len(frame):]
	}
	return false
}

// ExpectReply says that the packet being read is a state store request
// whose reply comes back on this connection: the acknowledgement mochi
// writes for it waits for the reply (at most replyHold), and the two
// leave in one system call instead of two, on both ends. Like TCP's
// delayed acknowledgement, it costs nothing when the reply comes; if it
// does not, the PUBACK leaves replyHold late.
func (c *clientConn) ExpectReply() {
	c.replyDue.Store(time.Now().Add(replyHold).UnixNano())
}

// AwaitNoReply says that the packet being read is a QoS 1 or 2 message
// that is not a request: its acknowledgement may not wait for a reply,
// and, acknowledgements going in order (MQTT-4.6.0-2), neither may one
// held before it. A client that mixes requests with other messages gets
// each acknowledgement when its packet is handled, not up to replyHold
// later.
func (c *clientConn) AwaitNoReply() {
	if c.replyDue.Load() != 0 {
		c.replyDue.Store(0)
	}
}

// awaitReply reports whether a state store reply is due; if so, what is
// pending waits for it, and the timer's bound moves from coalesceHold to
// the reply's.
func (c *clientConn) awaitReply() bool {
	due := c.replyDue.Load()
	if due == 0 || time.Now().UnixNano() >= due {
		return false
	}
	c.armed = false
	c.sendBy(time.Unix(0, due))
	return true
}

// sendBy makes sure the timer sends what is pending by at.
func (c *clientConn) sendBy(at time.Time) {
	if c.armed && !at.Before(c.timerAt) {
		return
	}
	c.armed, c.timerAt = true, at
	if c.timer == nil {
		c.timer = time.AfterFunc(time.Until(at), c.send)
	} else {
		c.timer.Reset(time.Until(at))
	}
}

func (c *clientConn) send() {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.armed = false
	if !c.sending { // else the sender takes it
		c.drainLocked()
	}
}

// sendLocked sends what is pending, waiting for it: after a send in
// progress, if any.
func (c *clientConn) sendLocked() error {
	for c.sending {
		c.waitSent()
	}
	c.drainLocked()
	return c.werr
}

// drainLocked makes the caller the connection's sender: it writes what is
// pending until nothing is, with a deadline (see sendChunks). The lock is
// let go during the system calls, so writers add to pending meanwhile,
// for the next round.
func (c *clientConn) drainLocked() {
	c.sending = true
	for len(c.pending) > 0 && c.werr == nil {
		c.stopTimer()
		buf := c.pending
		c.pending, c.queued = c.spare[:0], 0
		c.flushed += int64(len(buf))
		c.wmu.Unlock()
		err := c.sendChunks(buf)
		c.wmu.Lock()
		c.spare = nil
		if cap(buf) <= 4*coalesceBytes { // a burst's buffer is not kept
			c.spare = buf[:0]
		}
		if err != nil {
			c.failLocked(err)
		}
	}
	c.sending = false
	c.sent.Broadcast()
}

// sendChunk is the most one system call of the sender writes: the write
// deadline is moved between them, so that it bounds the time without
// progress, not the time a large backlog takes a slow link. A client is
// cut off once it reads less than a chunk in writeTimeout/2 (13 KB/s).
const sendChunk = 64 << 10

// sendChunks writes buf, the sender's, without the lock: in chunks, each
// with a deadline of about writeTimeout (a second once the connection is
// being ended: see Hurry). A client that reads, however slowly, is never
// cut off; one that stops reading is, within writeTimeout. (Before, one
// deadline covered the whole of what was pending: a resumed session's
// 28 MB backlog to a client reading 3 MB/s on a loaded machine was cut
// after 10 s.)
func (c *clientConn) sendChunks(buf []byte) error {
	_, ws := c.Conn.(*wsConn) // it sets its own, under its lock
	for len(buf) > 0 {
		if !ws {
			// Moved only once half of it is used: a write that stalls
			// gets between writeTimeout/2 and writeTimeout, and a busy
			// connection does not change a timer on every send. (The
			// sender alone touches writeBy.)
			now := time.Now()
			switch {
			case c.hurry.Load():
				_ = c.Conn.SetWriteDeadline(now.Add(endTimeout))
			case c.writeBy.Sub(now) < writeTimeout/2:
				c.writeBy = now.Add(writeTimeout)
				_ = c.Conn.SetWriteDeadline(c.writeBy)
				if c.hurry.Load() { // Hurry's deadline was set just before: it holds
					_ = c.Conn.SetWriteDeadline(now.Add(endTimeout))
				}
			}
		}
		chunk := buf[:min(len(buf), sendChunk)]
		if _, err := c.Conn.Write(chunk); err != nil {
			return err
		}
		buf = buf[len(chunk):]
	}
	return nil
}

// failLocked ends a connection a send failed on (a write that timed out,
// a reset): every later write fails, what waits is dropped, and the
// socket is closed, so that the client's reader ends and its session goes
// the way of any lost connection (its will, its messages kept). Left
// open, it counted as connected while nothing reached it, holding what
// was queued for it.
func (c *clientConn) failLocked(err error) {
	c.werr = err
	c.pending, c.spare = nil, nil
	conn := c.Conn
	if tc, ok := conn.(*tls.Conn); ok {
		conn = tc.NetConn() // no close_notify: it would wait on the same full socket
	}
	if tcp, ok := conn.(interface{ SetLinger(int) error }); ok {
		// Reset, not closed in order: what the socket still holds
		// would trickle out to a client with a closed window, which
		// then waits for the end of it before it learns.
		_ = tcp.SetLinger(0)
		_ = conn.Close()
		return
	}
	go conn.Close() // a websocket's close may write: never under the lock
}

// stopTimer disarms the timer: nothing waits once pending is sent, and
// left armed it would cut short what the next packets wait for (see
// sendBy).
func (c *clientConn) stopTimer() {
	if c.armed {
		c.armed = false
		c.timer.Stop()
	}
}

// endTimeout bounds the last writes to a connection being ended: a client
// that reads nothing must not hold up a kick or a shutdown.
const endTimeout = time.Second

// Hurry bounds every write from now on, one in progress included, to
// endTimeout: the connection is being ended.
func (c *clientConn) Hurry() {
	c.hurry.Store(true)
	if _, ws := c.Conn.(*wsConn); !ws {
		_ = c.Conn.SetWriteDeadline(time.Now().Add(endTimeout))
	}
}

// Close sends what is pending (often a DISCONNECT; DISCONNECT 0x95 after
// an oversized packet) before closing, within endTimeout.
func (c *clientConn) Close() error {
	c.Hurry() // a send in progress gives up in time
	c.wmu.Lock()
	c.closed = true
	if c.timer != nil {
		c.timer.Stop()
	}
	if c.tooLarge.Swap(false) && c.werr == nil {
		c.pending = append(c.pending, disconnectPacket(packets.ErrPacketTooLarge, true, 0, "")...)
	}
	c.sendLocked()
	c.wmu.Unlock()
	return c.Conn.Close()
}

// framer follows MQTT framing over the bytes a client sends: a type byte,
// a remaining length (1 to 4 bytes of 7 bits), then that many bytes, which
// it skips. It also picks the protocol version out of the first packet
// (CONNECT: protocol name, then the version byte).
type framer struct {
	inHeader bool // reading the remaining length
	length   int
	shift    uint
	skip     int    // body bytes still to pass
	packets  int    // packets whose header was read
	first    []byte // the first bytes of the first packet's body
	version  byte
	read     bool // the version was read (or cannot be)
	tooLarge bool
}

// feed frames b and reports whether it announces, for the first time, a
// packet larger than max (counted as mochi does: remaining length + 1).
func (f *framer) feed(b []byte, max uint32) bool {
	found := false
	for i := 0; i < len(b); {
		if f.skip > 0 {
			k := min(f.skip, len(b)-i)
			if f.packets == 1 && !f.read {
				f.first = append(f.first, b[i:i+min(k, 16-len(f.first))]...)
				f.readVersion()
			}
			f.skip -= k
			i += k
			continue
		}
		if !f.inHeader {
			f.inHeader, f.length, f.shift = true, 0, 0
			i++
			continue
		}
		c := b[i]
		i++
		f.length |= int(c&0x7f) << f.shift
		f.shift += 7
		if c&0x80 != 0 && f.shift < 28 {
			continue
		}
		f.inHeader = false
		f.packets++
		f.skip = f.length
		if f.packets > 1 && max > 0 && uint32(f.length+1) > max && !f.tooLarge {
			f.tooLarge, found = true, true
		}
	}
	return found
}

func (f *framer) readVersion() {
	if len(f.first) < 2 {
		return
	}
	at := 2 + (int(f.first[0])<<8 | int(f.first[1]))
	switch {
	case at >= 16: // no protocol name is that long
		f.read, f.first = true, nil
	case len(f.first) > at:
		f.version, f.read, f.first = f.first[at], true, nil
	}
}

// ConnectionState reports the TLS state underneath, for client
// certificate authentication.
func (c *clientConn) ConnectionState() tls.ConnectionState {
	if t, ok := c.Conn.(interface{ ConnectionState() tls.ConnectionState }); ok {
		return t.ConnectionState()
	}
	return tls.ConnectionState{}
}

var upgrader = websocket.Upgrader{
	Subprotocols: []string{"mqtt"},
	// MQTT over WebSocket clients are not browsers acting for a site;
	// authentication happens in MQTT, not by origin.
	CheckOrigin: func(*http.Request) bool { return true },
}

func (l *listener) serveWebSocket(establish listeners.EstablishFn) {
	l.http = &http.Server{
		ReadHeaderTimeout: l.connectTimeout,
		IdleTimeout:       l.connectTimeout,
		ErrorLog:          nil,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ws, err := upgrader.Upgrade(w, r, nil)
			if err != nil {
				return // Upgrade answered with an HTTP error
			}
			c := &wsConn{Conn: ws, tls: r.TLS}
			_ = c.SetReadDeadline(time.Now().Add(l.connectTimeout))
			l.run(establish, c)
		}),
	}
	ln := l.ln
	if l.tls != nil {
		ln = tls.NewListener(ln, l.tls)
	}
	_ = l.http.Serve(ln)
}

func (l *listener) Close(listeners.CloseFn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.closed = true
	if l.http != nil {
		_ = l.http.Close()
	}
	_ = l.ln.Close()
	l.closeClients(l.id)
}

// wsConn presents a WebSocket as the byte stream MQTT expects: inbound
// binary messages are read back to back, every write is one message.
type wsConn struct {
	*websocket.Conn
	tls *tls.ConnectionState
	r   io.Reader
	wmu sync.Mutex
}

var _ net.Conn = (*wsConn)(nil)

func (c *wsConn) Read(p []byte) (int, error) {
	for {
		if c.r == nil {
			typ, r, err := c.NextReader()
			if err != nil {
				return 0, err
			}
			if typ != websocket.BinaryMessage {
				return 0, errors.New("websocket: MQTT needs binary messages")
			}
			c.r = r
		}
		n, err := c.r.Read(p)
		if err == io.EOF {
			c.r = nil
			if n > 0 {
				return n, nil
			}
			continue
		}
		return n, err
	}
}

func (c *wsConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_ = c.Conn.SetWriteDeadline(time.Now().Add(writeTimeout))
	if err := c.WriteMessage(websocket.BinaryMessage, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// SetDeadline sets only the read deadline: mochi calls it from the read
// loop for keep-alive while the write loop may be writing, and gorilla's
// write deadline is not safe to change during a write.
func (c *wsConn) SetDeadline(t time.Time) error { return c.SetReadDeadline(t) }

func (c *wsConn) SetWriteDeadline(t time.Time) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.Conn.SetWriteDeadline(t)
}

// ConnectionState reports the TLS state of a wss connection, for client
// certificate authentication.
func (c *wsConn) ConnectionState() tls.ConnectionState {
	if c.tls == nil {
		return tls.ConnectionState{}
	}
	return *c.tls
}
