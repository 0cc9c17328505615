// Package e2e drives real mqkv servers over real sockets: the official AIO
// Go SDK for conformance, raw MQTT (paho) for the bytes the other SDKs
// depend on, and the mqkv binary itself for crash durability.
package e2e

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/Azure/iot-operations-sdks/go/mqtt"
	"github.com/Azure/iot-operations-sdks/go/protocol"
	"github.com/Azure/iot-operations-sdks/go/services/statestore"

	"github.com/mqkv/mqkv/internal/server"
)

// testServer is an mqkv node running in this process on an ephemeral port.
type testServer struct {
	*server.Server
	dir  string
	host string
	port uint16
}

type serverConfig = server.Config

type serverOption func(*server.Config)

func inMemory() serverOption { return func(c *server.Config) { c.InMemory = true } }

// startServer starts a durable server on a fresh data directory.
func startServer(t testing.TB, opts ...serverOption) *testServer {
	t.Helper()
	return startServerIn(t, t.TempDir(), opts...)
}

func startServerIn(t testing.TB, dir string, opts ...serverOption) *testServer {
	t.Helper()
	cfg := server.Config{
		Listen:  "127.0.0.1:0",
		DataDir: dir,
		Logger:  quietLogger(),
	}
	for _, o := range opts {
		o(&cfg)
	}
	var broker *mosquittoBroker
	if attachMode() {
		broker = brokerFor(t, dir)
		attachTo(broker.addr)(&cfg)
	}
	if clusterMode() {
		var addr string
		if broker != nil {
			addr = broker.addr
		}
		joinCluster(t, &cfg, addr)
	}
	s, err := server.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if clusterMode() {
		awaitSettled(t, s)
	}
	ts := &testServer{Server: s, dir: dir}
	if s.Addr() != "" {
		ts.host, ts.port = hostPort(t, s.Addr())
	}
	if broker != nil {
		awaitAttached(t, s)
		ts.host, ts.port = hostPort(t, broker.addr) // the SDK clients go through mosquitto
	}
	t.Cleanup(func() { s.Close() })
	return ts
}

// quietLogger is the servers' logger: silent, or with MQKV_DEBUG_LOG set,
// on stderr (to see what a failing test's servers said).
func quietLogger() *slog.Logger {
	if os.Getenv("MQKV_DEBUG_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

var (
	appOnce sync.Once
	app     *protocol.Application
)

// sdkApp is the protocol application (it owns the client-side HLC) shared
// by the SDK clients of a test binary, as in an application process.
func sdkApp(t testing.TB) *protocol.Application {
	appOnce.Do(func() {
		var err error
		if app, err = protocol.NewApplication(); err != nil {
			t.Fatal(err)
		}
	})
	return app
}

type getResponse = statestore.Response[string]

// sdkClient is an official AIO Go SDK state store client with its own MQTT
// session.
type sdkClient struct {
	mqtt  *mqtt.SessionClient
	store *statestore.Client[string, string]
}

func newSDKClient(t testing.TB, s *testServer) *sdkClient {
	t.Helper()
	return newSDKClientID(t, s, mqtt.RandomClientID())
}

// newSDKClientAs is an SDK client that connects with a username and
// password.
func newSDKClientAs(t testing.TB, s *testServer, user, pass string) *sdkClient {
	t.Helper()
	return newSDKClientOpts(t, s, mqtt.RandomClientID(), &mqtt.SessionClientOptions{
		Username: mqtt.ConstantUsername(user), Password: mqtt.ConstantPassword([]byte(pass))})
}

func newSDKClientID(t testing.TB, s *testServer, id string) *sdkClient {
	t.Helper()
	return newSDKClientOpts(t, s, id)
}

func newSDKClientOpts(t testing.TB, s *testServer, id string, opts ...mqtt.SessionClientOption) *sdkClient {
	t.Helper()
	mc, err := mqtt.NewSessionClient(id, mqtt.TCPConnection(s.host, s.port), opts...)
	if err != nil {
		t.Fatal(err)
	}
	ss, err := statestore.New[string, string](sdkApp(t), mc)
	if err != nil {
		t.Fatal(err)
	}
	if err := mc.Start(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ss.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if attachMode() {
		subscribeToNotifications(t, ctx, mc, id)
	}
	c := &sdkClient{mqtt: mc, store: ss}
	t.Cleanup(c.close)
	return c
}

// close stops the MQTT session first: the SDK unsubscribes on Close and
// would wait forever for a server that a test already stopped.
func (c *sdkClient) close() {
	_ = c.mqtt.Stop()
	c.store.Close()
}

// ctx returns a context that ends with the test or after d.
func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

var keySeq struct {
	sync.Mutex
	n int
}

// uniqueKey returns a key no other test in this binary uses.
func uniqueKey(t testing.TB) string {
	keySeq.Lock()
	defer keySeq.Unlock()
	keySeq.n++
	return fmt.Sprintf("%s/%d", t.Name(), keySeq.n)
}

// eventually polls cond until it holds, for state no event reports.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	eventuallyWithin(t, 10*time.Second, what, cond)
}

// eventuallyWithin is eventually with a deadline of its own.
func eventuallyWithin(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
