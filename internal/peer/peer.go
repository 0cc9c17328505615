// Package peer is the node link: the one TCP port a node listens on for
// all traffic from the other nodes. Each connection runs TLS 1.3 and is
// authenticated (a shared secret bound to the TLS session, or certificates
// of a cluster CA, or both), then carries a yamux session
// whose streams are opened with a small header naming what they are for:
// the raft traffic of one replica group (a raft.StreamLayer per group, so
// each group keeps hashicorp/raft's stock NetworkTransport), or a call to
// the node's Handler (forwarded requests, change streams).
//
// Concurrency: a Link is safe for use by many goroutines. Streams are
// net.Conns owned by whoever opened or accepted them; a stream that fails
// a write or times out is closed (yamux advisory GHSA-29qp-crvh-w22m: a
// timed-out write can leave the peer's read hanging).
package peer

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
	"github.com/hashicorp/yamux"

	"github.com/mqkv/mqkv/internal/sockio"
)

// Stream kinds, the first byte of every stream. Wire format: new kinds
// take new numbers.
const (
	KindRaft byte = 1 // followed by the group, uint32 big-endian
	KindCall byte = 2 // served by the Handler
	KindMesh byte = 4 // MQTT between nodes (package mesh), served by its HandleKind handler
)

// Config configures a Link.
type Config struct {
	NodeID string
	// Listen is the address to listen on; Advertise, if set, is the one
	// other nodes dial (default: the listener's).
	Listen, Advertise string
	// Secret authenticates nodes to each other (both must know it); TLS,
	// if set, is used instead or as well: the config must verify peers
	// (ClientAuth RequireAndVerifyClientCert, RootCAs for dialing).
	Secret []byte
	// Insecure, with neither Secret nor TLS, runs the link under a
	// secret everybody knows (on loopback, or --cluster-insecure): no
	// protection, but a node so configured is told apart from one with
	// a wrong secret.
	Insecure  bool
	TLSServer *tls.Config
	TLSClient *tls.Config
	// Handler serves KindCall streams; it owns the stream. It may also be
	// set later, with Handle.
	Handler func(from string, s net.Conn)
	Logger  *slog.Logger
}

// Link is this node's end of the node link.
type Link struct {
	cfg  Config
	ln   net.Listener
	addr string
	log  *slog.Logger

	mu       sync.Mutex
	sessions map[string]*yamux.Session // outgoing, by address
	inbound  map[*yamux.Session]struct{}
	layers   map[uint32]*StreamLayer
	closed   bool

	handler atomic.Pointer[func(from string, s net.Conn)]
	kinds   sync.Map // stream kind → func(from string, s net.Conn) (see HandleKind)
	calls   atomic.Pointer[func(from string, body []byte) []byte]
	muxes   map[string]*mux // call streams, by address

	// The TLS every connection runs: the configured one, or with only a
	// secret an ephemeral certificate of this process (see handshake).
	tlsServer, tlsClient *tls.Config

	// Connections not yet authenticated, with their remote host (see
	// maxHandshakes); Close closes them.
	handshaking map[net.Conn]string
	dialing     map[string]chan struct{} // closed when the dial to an address ends

	// isolated drops every connection and refuses new ones: the fault a
	// test uses to cut this node off the network.
	isolated atomic.Bool
	cut      map[string]bool // addresses this node does not dial (see Cut); under mu
	wg       sync.WaitGroup
}

// maxHandshakes bounds the connections a node authenticates at once, and
// maxHostHandshakes those from one host; handshakeTimeout is how long each
// may take. A connection past either bound is closed at once: nobody's
// handshake is cut short for it (a first version closed the oldest one,
// and strangers opening connections in a loop kept members out; found by
// review). Strangers on one host hold at most that host's places, for
// handshakeTimeout each; members elsewhere are not kept out, and a node
// dials each peer once at a time.
const (
	maxHandshakes     = 256
	maxHostHandshakes = 16
	handshakeTimeout  = 5 * time.Second
)

// ErrClosed is returned once the link is closed.
var ErrClosed = errors.New("peer: link closed")

// ErrAuth is wrapped by the errors of a handshake that failed on the
// other node's credentials (a secret that differs, or none, or a
// certificate this node does not trust): retrying will not help until the
// configuration changes.
var ErrAuth = errors.New("peer: not authenticated")

// Listen starts the link.
func Listen(cfg Config) (*Link, error) {
	if len(cfg.Secret) == 0 && cfg.TLSServer == nil && cfg.Insecure {
		cfg.Secret = insecureSecret
	}
	if len(cfg.Secret) == 0 && cfg.TLSServer == nil {
		return nil, errors.New("peer: no secret and no TLS: the node link would admit anyone")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("cluster listener: %w", err)
	}
	l := &Link{cfg: cfg, ln: sockio.Listener(ln), addr: cfg.Advertise, log: cfg.Logger,
		sessions: map[string]*yamux.Session{}, inbound: map[*yamux.Session]struct{}{}, layers: map[uint32]*StreamLayer{}, muxes: map[string]*mux{},
		tlsServer: cfg.TLSServer, tlsClient: cfg.TLSClient, handshaking: map[net.Conn]string{}, dialing: map[string]chan struct{}{}}
	if l.tlsServer == nil {
		if l.tlsServer, l.tlsClient, err = ephemeralTLS(); err != nil {
			ln.Close()
			return nil, err
		}
	}
	if l.addr == "" {
		l.addr = ln.Addr().String()
	}
	if cfg.Handler != nil {
		l.Handle(cfg.Handler)
	}
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

// Addr is the address other nodes dial to reach this one.
func (l *Link) Addr() string { return l.addr }

func yamuxConfig() *yamux.Config {
	c := yamux.DefaultConfig()
	c.LogOutput = io.Discard
	c.EnableKeepAlive = true
	c.KeepAliveInterval = 5 * time.Second
	c.ConnectionWriteTimeout = 5 * time.Second
	c.StreamOpenTimeout = 5 * time.Second
	c.StreamCloseTimeout = 5 * time.Second
	c.AcceptBacklog = 1024
	c.MaxStreamWindowSize = 1 << 20 // snapshots move faster with a larger window
	return c
}

func (l *Link) acceptLoop() {
	defer l.wg.Done()
	for {
		c, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if l.isolated.Load() || !l.startHandshake(c) {
			c.Close()
			continue
		}
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.serveConn(c)
		}()
	}
}

// startHandshake counts c among the connections being authenticated, if
// the bounds leave room; false once the link is closed.
func (l *Link) startHandshake(c net.Conn) bool {
	host := remoteHost(c)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || len(l.handshaking) >= maxHandshakes {
		return false
	}
	n := 0
	for _, h := range l.handshaking {
		if h == host {
			n++
		}
	}
	if n >= maxHostHandshakes {
		return false
	}
	l.handshaking[c] = host
	return true
}

func remoteHost(c net.Conn) string {
	host, _, _ := net.SplitHostPort(c.RemoteAddr().String())
	return host
}

func (l *Link) endHandshake(c net.Conn) {
	l.mu.Lock()
	delete(l.handshaking, c)
	l.mu.Unlock()
}

// refused logs a connection the link would not take. The line carries the
// remote host as its "client", so that the server's log throttle writes
// one a window per host: whoever can reach the port does not decide how
// much the node logs.
func (l *Link) refused(c net.Conn, msg string, err error) {
	l.log.Warn(msg, "client", remoteHost(c), "remote", c.RemoteAddr(), "error", err)
}

// serveConn authenticates an incoming connection and serves its streams.
func (l *Link) serveConn(raw net.Conn) {
	raw.SetDeadline(time.Now().Add(handshakeTimeout))
	c := tls.Server(raw, l.tlsServer)
	err := c.Handshake()
	var from string
	if err == nil {
		from, err = l.answerHandshake(c)
	}
	l.endHandshake(raw)
	if err != nil {
		l.mu.Lock()
		closed := l.closed
		l.mu.Unlock()
		if closed {
			raw.Close()
			return
		}
		if errors.As(err, new(tls.RecordHeaderError)) {
			err = errors.New("not TLS: a node of a release before 2026-11-26 (its link was unencrypted; upgrade every node), or not an mqkv node")
		}
		l.refused(raw, "node link: a node was not let in", err)
		raw.Close()
		return
	}
	raw.SetDeadline(time.Time{})
	bc := newBatchConn(c)
	sess, err := yamux.Server(bc, yamuxConfig())
	if err != nil {
		bc.Close()
		return
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		sess.Close()
		return
	}
	l.inbound[sess] = struct{}{}
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		delete(l.inbound, sess)
		l.mu.Unlock()
		sess.Close()
	}()
	for {
		s, err := sess.AcceptStream()
		if err != nil {
			return
		}
		go l.dispatch(from, s)
	}
}

// dispatch reads a stream's header and hands it to its owner.
func (l *Link) dispatch(from string, s *yamux.Stream) {
	s.SetReadDeadline(time.Now().Add(5 * time.Second))
	var kind [1]byte
	if _, err := io.ReadFull(s, kind[:]); err != nil {
		s.Close()
		return
	}
	switch kind[0] {
	case KindRaft:
		var g [4]byte
		if _, err := io.ReadFull(s, g[:]); err != nil {
			s.Close()
			return
		}
		s.SetReadDeadline(time.Time{})
		l.mu.Lock()
		layer := l.layers[binary.BigEndian.Uint32(g[:])]
		l.mu.Unlock()
		if layer == nil {
			s.Close() // no replica of that group here (yet)
			return
		}
		select {
		case layer.accept <- s:
		case <-layer.done:
			s.Close()
		case <-time.After(5 * time.Second):
			s.Close()
		}
	case KindMux:
		s.SetReadDeadline(time.Time{})
		l.serveMux(from, s)
	case KindCall:
		s.SetReadDeadline(time.Time{})
		h := l.handler.Load()
		if h == nil {
			s.Close()
			return
		}
		(*h)(from, s)
	default:
		h, ok := l.kinds.Load(kind[0])
		if !ok {
			s.Close()
			return
		}
		s.SetReadDeadline(time.Time{})
		h.(func(string, net.Conn))(from, s)
	}
}

// HandleKind sets the handler of streams of a kind of their own (KindMesh):
// it owns the stream.
func (l *Link) HandleKind(kind byte, h func(from string, s net.Conn)) { l.kinds.Store(kind, h) }

// Handle sets the handler of KindCall streams.
func (l *Link) Handle(h func(from string, s net.Conn)) { l.handler.Store(&h) }

// Open opens a stream of the given kind to the node at addr; header
// follows the kind byte.
func (l *Link) Open(ctx context.Context, addr string, kind byte, header []byte) (net.Conn, error) {
	if l.isolated.Load() {
		return nil, errors.New("peer: isolated")
	}
	l.mu.Lock()
	cut := l.cut[addr]
	l.mu.Unlock()
	if cut {
		return nil, fmt.Errorf("peer: the link to %s is cut", addr)
	}
	sess, err := l.session(ctx, addr)
	if err != nil {
		return nil, err
	}
	s, err := sess.OpenStream()
	if err != nil {
		l.dropSession(addr, sess)
		return nil, fmt.Errorf("peer: open stream to %s: %w", addr, err)
	}
	if d, ok := ctx.Deadline(); ok {
		s.SetWriteDeadline(d)
	}
	if _, err := s.Write(append([]byte{kind}, header...)); err != nil {
		s.Close()
		return nil, err
	}
	s.SetWriteDeadline(time.Time{})
	return s, nil
}

// session returns the outgoing session to addr, dialing it if needed: one
// dial at a time per address, the other callers waiting for its session
// (a burst of calls to a peer would otherwise open a connection each, and
// the peer takes only so many handshakes at once).
func (l *Link) session(ctx context.Context, addr string) (*yamux.Session, error) {
	for {
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			return nil, ErrClosed
		}
		if s := l.sessions[addr]; s != nil && !s.IsClosed() {
			l.mu.Unlock()
			return s, nil
		}
		wait, busy := l.dialing[addr]
		if !busy {
			done := make(chan struct{})
			l.dialing[addr] = done
			l.mu.Unlock()
			s, err := l.dial(ctx, addr)
			l.mu.Lock()
			delete(l.dialing, addr)
			l.mu.Unlock()
			close(done)
			return s, err
		}
		l.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return nil, fmt.Errorf("peer: dial %s: %w", addr, ctx.Err())
		}
	}
}

// dial connects to addr, authenticates, and records the session.
func (l *Link) dial(ctx context.Context, addr string) (*yamux.Session, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("peer: nothing listens at %s (connection refused): %w", addr, err)
		}
		return nil, fmt.Errorf("peer: dial %s: %w", addr, err)
	}
	c = sockio.Wrap(c)
	// A peer that accepts and says nothing holds the dial, and every
	// caller waiting on it, no longer than a handshake may take.
	dl := time.Now().Add(handshakeTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	c.SetDeadline(dl)
	tc := tls.Client(c, l.tlsClient)
	if err := tc.Handshake(); err != nil {
		c.Close()
		var unknown x509.UnknownAuthorityError
		var verify *tls.CertificateVerificationError
		if errors.As(err, &unknown) || errors.As(err, &verify) {
			return nil, fmt.Errorf("peer: %s's certificate is not signed by the cluster CA (--cluster-tls-ca), or it runs without one (a secret only): %w (%w)", addr, ErrAuth, err)
		}
		if errors.As(err, new(tls.AlertError)) {
			return nil, fmt.Errorf("peer: %s refused this node's TLS (its certificate, or none: does the cluster use --cluster-tls-cert?): %w (%w)", addr, ErrAuth, err)
		}
		return nil, fmt.Errorf("peer: TLS to %s: %w", addr, err)
	}
	if err := l.handshake(tc); err != nil {
		c.Close()
		return nil, fmt.Errorf("peer: %s: %w", addr, err)
	}
	c.SetDeadline(time.Time{})
	bc := newBatchConn(tc)
	sess, err := yamux.Client(bc, yamuxConfig())
	if err != nil {
		bc.Close()
		return nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		sess.Close()
		return nil, ErrClosed
	}
	if l.isolated.Load() { // isolated while this dial ran
		sess.Close()
		return nil, errors.New("peer: isolated")
	}
	if old := l.sessions[addr]; old != nil && !old.IsClosed() {
		sess.Close() // another dial won
		return old, nil
	}
	l.sessions[addr] = sess
	return sess, nil
}

func (l *Link) dropSession(addr string, s *yamux.Session) {
	l.mu.Lock()
	if l.sessions[addr] == s {
		delete(l.sessions, addr)
	}
	l.mu.Unlock()
	s.Close()
}

// The handshake proves that both ends know the secret without sending it,
// and binds the proof to the TLS session it runs in: each side sends a
// random challenge and answers the other's with HMAC-SHA256(secret, role |
// its challenge | the other's | node id | the session's exported keying
// material). A proof made for one TLS session is worth nothing in another,
// so whoever relays a member's handshake to another member (listening on a
// down member's address, say) cannot finish it, and everything after it
// is encrypted. With a secret only, the TLS certificates are ephemeral and
// not checked: the secret authenticates. With TLS and no secret, the
// certificates did the proving and the handshake only exchanges node ids.
const handshakeMagic = "MQKV-LINK-2"

// binding is the TLS session's keying material the proofs are bound to.
func binding(c *tls.Conn) ([]byte, error) {
	cs := c.ConnectionState()
	return cs.ExportKeyingMaterial("mqkv node link handshake", nil, 32)
}

// What a dialing node sends in place of its proof when the other node's
// did not match: words for the other's log.
const (
	saysNoSecret    = "no cluster secret here"
	saysOtherSecret = "another cluster secret here"
)

// insecureSecret is the secret of a link configured without one (see
// Config.Insecure).
var insecureSecret = []byte("mqkv-insecure-link")

// none reports whether the link runs without a secret of its own.
func (l *Link) none() bool { return len(l.cfg.Secret) == 0 || hmac.Equal(l.cfg.Secret, insecureSecret) }

func (l *Link) mac(role string, a, b []byte, id string, session []byte) []byte {
	return macWith(l.cfg.Secret, role, a, b, id, session)
}

func macWith(secret []byte, role string, a, b []byte, id string, session []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(role))
	m.Write(a)
	m.Write(b)
	m.Write([]byte(id))
	m.Write(session)
	return m.Sum(nil)
}

// handshake is the dialing side.
func (l *Link) handshake(c *tls.Conn) error {
	session, err := binding(c)
	if err != nil {
		return err
	}
	// Reads are unbuffered: the yamux session starts right after the
	// handshake, and a buffered reader would swallow its first bytes.
	w, r := bufio.NewWriter(c), c
	mine := make([]byte, 32)
	rand.Read(mine)
	writeFrame(w, []byte(handshakeMagic))
	writeFrame(w, mine)
	writeFrame(w, []byte(l.cfg.NodeID))
	if err := w.Flush(); err != nil {
		return err
	}
	theirs, err := readFrame(r, 64)
	if err != nil {
		return err
	}
	theirID, err := readFrame(r, 256)
	if err != nil {
		return err
	}
	proof, err := readFrame(r, 64)
	if err != nil {
		return fmt.Errorf("refused by the peer (wrong cluster secret?): %w", err)
	}
	if !hmac.Equal(proof, l.mac("server", mine, theirs, string(theirID), session)) {
		// The other node is told why, in words and not a proof (a
		// proof made for a node not yet authenticated would let it try
		// secrets offline), so that it can log it.
		if l.none() {
			writeFrame(w, []byte(saysNoSecret))
			w.Flush()
			return fmt.Errorf("the cluster requires a secret (--cluster-secret-file), and this node has none: %w", ErrAuth)
		}
		writeFrame(w, []byte(saysOtherSecret))
		w.Flush()
		return fmt.Errorf("wrong cluster secret: node %s proved another one (compare --cluster-secret-file): %w", theirID, ErrAuth)
	}
	writeFrame(w, l.mac("client", theirs, mine, l.cfg.NodeID, session))
	return w.Flush()
}

// answerHandshake is the accepting side; it returns the peer's node id.
func (l *Link) answerHandshake(c *tls.Conn) (string, error) {
	session, err := binding(c)
	if err != nil {
		return "", err
	}
	w, r := bufio.NewWriter(c), c // unbuffered reads: see handshake
	magic, err := readFrame(r, 64)
	if err != nil || string(magic) != handshakeMagic {
		return "", errors.New("not an mqkv node of this release")
	}
	theirs, err := readFrame(r, 64)
	if err != nil {
		return "", err
	}
	id, err := readFrame(r, 256)
	if err != nil {
		return "", err
	}
	mine := make([]byte, 32)
	rand.Read(mine)
	writeFrame(w, mine)
	writeFrame(w, []byte(l.cfg.NodeID))
	writeFrame(w, l.mac("server", theirs, mine, l.cfg.NodeID, session))
	if err := w.Flush(); err != nil {
		return "", err
	}
	proof, err := readFrame(r, 64)
	if err != nil {
		// It hung up once it checked this node's proof: it found it
		// wrong (a release before these words; the member
		// logged "connection refused ... error=EOF", which said nothing).
		return "", fmt.Errorf("node %q hung up after this node's proof: its cluster secret differs from this one's, or it has none (%v)", id, err)
	}
	switch {
	case string(proof) == saysNoSecret:
		return "", fmt.Errorf("node %q has no cluster secret, and this cluster requires one (--cluster-secret-file)", id)
	case string(proof) == saysOtherSecret:
		return "", fmt.Errorf("node %q has a wrong cluster secret (this node's proof did not match it)", id)
	case !hmac.Equal(proof, l.mac("client", mine, theirs, string(id), session)):
		return "", fmt.Errorf("node %q has a wrong cluster secret", id)
	}
	return string(id), nil
}

// ephemeralTLS returns the TLS configurations of a link with a secret
// only: a certificate made for this process, which nobody checks (the
// handshake's secret, bound to the session, authenticates both ends).
func ephemeralTLS() (server, client *tls.Config, err error) {
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: now.Add(-time.Hour), NotAfter: now.AddDate(100, 0, 0)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, pub, key)
	if err != nil {
		return nil, nil, err
	}
	server = &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	client = &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}
	return server, client, nil
}

// writeFrame writes a length-prefixed frame (errors surface at Flush).
func writeFrame(w *bufio.Writer, b []byte) {
	var n [4]byte
	binary.BigEndian.PutUint32(n[:], uint32(len(b)))
	w.Write(n[:])
	w.Write(b)
}

// readFrame reads a frame of at most max bytes.
func readFrame(r io.Reader, max int) ([]byte, error) {
	var n [4]byte
	if _, err := io.ReadFull(r, n[:]); err != nil {
		return nil, err
	}
	size := binary.BigEndian.Uint32(n[:])
	if int64(size) > int64(max) {
		return nil, fmt.Errorf("peer: frame of %d bytes, at most %d", size, max)
	}
	b := make([]byte, size)
	_, err := io.ReadFull(r, b)
	return b, err
}

// Isolate cuts this node off the network (true) or reconnects it: every
// session is closed and, while isolated, no stream is opened or accepted.
// It is the network partition of fault tests.
func (l *Link) Isolate(on bool) {
	l.isolated.Store(on)
	if !on {
		return
	}
	l.mu.Lock()
	var all []*yamux.Session
	for a, s := range l.sessions {
		all = append(all, s)
		delete(l.sessions, a)
	}
	for s := range l.inbound {
		all = append(all, s)
	}
	l.mu.Unlock()
	for _, s := range all {
		s.Close()
	}
}

// Cut stops (on) or allows again this node's connections to the node at
// addr: its session is closed, and no stream is opened to it. Cut on both
// nodes, it is a partial partition: the link between them is down, the
// others are up (a fault for tests).
func (l *Link) Cut(addr string, on bool) {
	l.mu.Lock()
	if l.cut == nil {
		l.cut = map[string]bool{}
	}
	l.cut[addr] = on
	if !on {
		l.mu.Unlock()
		return
	}
	s := l.sessions[addr]
	delete(l.sessions, addr)
	m := l.muxes[addr]
	delete(l.muxes, addr)
	l.mu.Unlock()
	if s != nil {
		s.Close()
	}
	if m != nil {
		m.c.Close()
	}
}

// Close stops the link and closes every session.
func (l *Link) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	var all []*yamux.Session
	for _, s := range l.sessions {
		all = append(all, s)
	}
	for s := range l.inbound {
		all = append(all, s)
	}
	for c := range l.handshaking {
		c.Close() // a stranger's silence does not hold the shutdown
	}
	l.mu.Unlock()
	err := l.ln.Close()
	for _, s := range all {
		s.Close()
	}
	l.wg.Wait()
	return err
}

// StreamLayer returns the raft stream layer of group g: raft connections
// of that group, to and from the same group on other nodes.
func (l *Link) StreamLayer(g uint32) *StreamLayer {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s := l.layers[g]; s != nil {
		return s
	}
	s := &StreamLayer{link: l, group: g, accept: make(chan net.Conn), done: make(chan struct{})}
	l.layers[g] = s
	return s
}

// StreamLayer carries one replica group's raft traffic over the link.
type StreamLayer struct {
	link      *Link
	group     uint32
	accept    chan net.Conn
	done      chan struct{}
	closeOnce sync.Once
}

var _ raft.StreamLayer = (*StreamLayer)(nil)

// Accept waits for a raft connection from another replica of the group.
func (s *StreamLayer) Accept() (net.Conn, error) {
	select {
	case c := <-s.accept:
		return c, nil
	case <-s.done:
		return nil, ErrClosed
	}
}

// Close stops accepting for the group (raft calls it at shutdown).
func (s *StreamLayer) Close() error {
	s.closeOnce.Do(func() {
		close(s.done)
		s.link.mu.Lock()
		if s.link.layers[s.group] == s {
			delete(s.link.layers, s.group)
		}
		s.link.mu.Unlock()
	})
	return nil
}

// Addr is this node's link address (raft's address for this server).
func (s *StreamLayer) Addr() net.Addr { return addr(s.link.addr) }

// Dial opens a raft connection to the group's replica at address.
func (s *StreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var g [4]byte
	binary.BigEndian.PutUint32(g[:], s.group)
	return s.link.Open(ctx, string(address), KindRaft, g[:])
}

type addr string

func (a addr) Network() string { return "tcp" }
func (a addr) String() string  { return string(a) }
