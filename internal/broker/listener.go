package broker

import (
	"errors"
	"log/slog"
	"net"
	"sync"

	"github.com/mochi-mqtt/server/v2/listeners"
)

// listener serves MQTT connections from any net.Listener (TCP now; TLS and
// WebSocket wrap the same thing). mochi's own TCP listener cannot report
// the port it bound and shares one error variable between connections.
type listener struct {
	id       string
	ln       net.Listener
	log      *slog.Logger
	mu       sync.Mutex
	closed   bool
	protocol string
}

var _ listeners.Listener = (*listener)(nil)

func (l *listener) ID() string                  { return l.id }
func (l *listener) Address() string             { return l.ln.Addr().String() }
func (l *listener) Protocol() string            { return l.protocol }
func (l *listener) Init(log *slog.Logger) error { l.log = log; return nil }

func (l *listener) Serve(establish listeners.EstablishFn) {
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
			// Errors here are per client (bad packets, resets, EOF) and
			// are not the server's problem: debug level only.
			if err := establish(l.id, conn); err != nil {
				l.log.Debug("connection ended", "listener", l.id, "remote", conn.RemoteAddr().String(), "error", err)
			}
		}()
	}
}

func (l *listener) Close(closeClients listeners.CloseFn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.closed = true
	_ = l.ln.Close()
	closeClients(l.id)
}
