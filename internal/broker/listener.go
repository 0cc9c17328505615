package broker

import (
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/gorilla/websocket"
	"github.com/mochi-mqtt/server/v2/listeners"
)

// connectTimeout is how long a new connection has to complete its TLS
// handshake and send CONNECT; after that mochi's keep-alive deadline
// applies. It keeps idle or half-open connections from piling up.
const connectTimeout = 10 * time.Second

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
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		go func() {
			_ = conn.SetReadDeadline(time.Now().Add(connectTimeout))
			if l.tls != nil {
				conn = tls.Server(conn, l.tls)
			}
			l.run(establish, conn)
		}()
	}
}

// run hands one connection to mochi until it ends. Errors here are per
// client (bad packets, resets, EOF), not the server's: debug level only.
func (l *listener) run(establish listeners.EstablishFn, conn net.Conn) {
	if err := establish(l.id, conn); err != nil {
		l.log.Debug("connection ended", "listener", l.id, "remote", conn.RemoteAddr().String(), "error", err)
	}
}

var upgrader = websocket.Upgrader{
	Subprotocols: []string{"mqtt"},
	// MQTT over WebSocket clients are not browsers acting for a site;
	// authentication happens in MQTT, not by origin.
	CheckOrigin: func(*http.Request) bool { return true },
}

func (l *listener) serveWebSocket(establish listeners.EstablishFn) {
	l.http = &http.Server{
		ReadHeaderTimeout: connectTimeout,
		ErrorLog:          nil,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ws, err := upgrader.Upgrade(w, r, nil)
			if err != nil {
				return // Upgrade answered with an HTTP error
			}
			c := &wsConn{Conn: ws, tls: r.TLS}
			_ = c.SetReadDeadline(time.Now().Add(connectTimeout))
			l.run(establish, c)
		}),
	}
	ln := l.ln
	if l.tls != nil {
		ln = tls.NewListener(ln, l.tls)
	}
	_ = l.http.Serve(ln)
}

func (l *listener) Close(closeClients listeners.CloseFn) {
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
	closeClients(l.id)
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
