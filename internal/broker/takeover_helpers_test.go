package broker

import (
	"context"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"

	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/statestore"
)

type nopHandler struct{}

func (nopHandler) Handle(*statestore.Request)           {}
func (nopHandler) Disconnected(string, uint64)          {}
func (nopHandler) Revoke(string, uint64, *policy.Grant) {}
func (nopHandler) Drain(context.Context) error          { return nil }

func startTestBroker(t *testing.T, dataDir string) *Broker {
	t.Helper()
	b, err := New(Config{
		Listeners: []Listener{{Name: "tcp", Addr: "127.0.0.1:0"}},
		DataDir:   dataDir,
		Security:  Security{AllowAnonymous: true},
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	}, nopHandler{})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Serve(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeOnce(b) })
	return b
}

type rwire struct {
	t    *testing.T
	conn net.Conn
}

func (w *rwire) send(p interface {
	WriteTo(io.Writer) (int64, error)
}) {
	w.t.Helper()
	if _, err := p.WriteTo(w.conn); err != nil {
		w.t.Fatal(err)
	}
}

func (w *rwire) next() *packets.ControlPacket {
	w.t.Helper()
	w.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	p, err := packets.ReadPacket(w.conn)
	if err != nil {
		w.t.Fatalf("read: %v", err)
	}
	return p
}

func dialR(t *testing.T, addr string, c packets.Connect) *rwire {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	w := &rwire{t: t, conn: conn}
	c.ProtocolName, c.ProtocolVersion, c.KeepAlive = "MQTT", 5, 30
	w.send(&c)
	for {
		switch p := w.next().Content.(type) {
		case *packets.Connack:
			if p.ReasonCode != 0 {
				t.Fatalf("CONNACK %+v", p)
			}
			return w
		case *packets.Publish:
			continue
		default:
			t.Fatalf("before CONNACK: %T", p)
		}
	}
}

func (w *rwire) subscribe(id uint16, filter string) {
	w.t.Helper()
	w.send(&packets.Subscribe{PacketID: id, Subscriptions: []packets.SubOptions{{Topic: filter, QoS: 1}}})
	if ack, ok := w.next().Content.(*packets.Suback); !ok || ack.PacketID != id {
		w.t.Fatalf("SUBACK %+v", ack)
	}
}

// offlineSession leaves a persistent session "s" subscribed to t/x at QoS
// 1, its client gone, and returns the Session Expiry Interval it has;
// props, if set, are its CONNECT's (with that interval).
func offlineSession(t *testing.T, b *Broker, props *packets.Properties) *packets.Properties {
	t.Helper()
	if props == nil {
		props = &packets.Properties{}
	}
	expiry := uint32(300)
	props.SessionExpiryInterval = &expiry
	w := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: true, Properties: props})
	w.subscribe(1, "t/x")
	w.conn.Close()
	eventuallyR(t, "offline", func() bool { return b.ClientsConnected() == 0 })
	return props
}

// resumeAndReset sends a CONNECT that resumes session "s" and resets the
// connection at once (RST): mochi's CONNACK or resend to it fails, after
// it took the session over.
func resumeAndReset(t *testing.T, b *Broker, props *packets.Properties) {
	t.Helper()
	conn, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	c := packets.Connect{ClientID: "s", ProtocolName: "MQTT", ProtocolVersion: 5, KeepAlive: 30, Properties: props}
	if _, err := c.WriteTo(conn); err != nil {
		t.Fatal(err)
	}
	conn.(*net.TCPConn).SetLinger(0)
	conn.Close()
}

func eventuallyR(t *testing.T, what string, f func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !f(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %s", what)
		}
	}
}

func countMap(m interface{ Range(func(k, v any) bool) }) int {
	n := 0
	m.Range(func(any, any) bool { n++; return true })
	return n
}

var closed sync.Map

func closeOnce(b *Broker) {
	if _, done := closed.LoadOrStore(b, true); !done {
		b.Close()
	}
}
