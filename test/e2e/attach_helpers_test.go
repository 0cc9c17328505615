package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/Azure/iot-operations-sdks/go/mqtt"

	"github.com/mqkv/mqkv/internal/attach"
	"github.com/mqkv/mqkv/internal/server"
	"github.com/mqkv/mqkv/internal/statestore"
)

// attachMode runs the tests that reach the store through testServer's
// host and port (the SDK's) through mosquitto, with the server attached
// to it (mqkv attach) instead of serving MQTT itself.
func attachMode() bool { return os.Getenv("MQKV_E2E_ATTACH") != "" }

// mosquittoBinary finds Debian's mosquitto: a failure where .ci/run
// installs it, a skip elsewhere.
func mosquittoBinary(t testing.TB) string {
	t.Helper()
	for _, p := range []string{"mosquitto", "/usr/sbin/mosquitto"} {
		if b, err := exec.LookPath(p); err == nil {
			return b
		}
	}
	if os.Getenv("MQKV_REQUIRE_MOSQUITTO") != "" || attachMode() {
		t.Fatal("mosquitto not found (Debian mosquitto; .ci/run installs it)")
	}
	t.Skip("mosquitto not found")
	return ""
}

// mosquittoBroker is a mosquitto 2 process on a free loopback port.
type mosquittoBroker struct {
	cmd  *exec.Cmd
	addr string
	conf string
}

// startMosquitto runs mosquitto with anonymous clients allowed and extra
// configuration lines, until the test ends.
func startMosquitto(t testing.TB, extra ...string) *mosquittoBroker {
	t.Helper()
	mosquittoBinary(t) // skip or fail early
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	_, port, _ := net.SplitHostPort(addr)
	dir := t.TempDir()
	conf := filepath.Join(dir, "mosquitto.conf")
	text := fmt.Sprintf("listener %s 127.0.0.1\nallow_anonymous true\nmax_queued_messages 100000\nmax_inflight_messages 0\nset_tcp_nodelay true\n", port)
	persistence := "persistence false\n"
	for _, e := range extra {
		text += e + "\n"
		if strings.HasPrefix(e, "persistence ") {
			persistence = ""
		}
	}
	text += persistence
	if os.Geteuid() == 0 {
		text += "user root\n" // else it runs as user mosquitto, which cannot write its persistence file here
	}
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	m := &mosquittoBroker{addr: addr, conf: conf}
	m.start(t)
	t.Cleanup(m.stop)
	return m
}

func (m *mosquittoBroker) start(t testing.TB) {
	t.Helper()
	m.cmd = exec.Command(mosquittoBinary(t), "-c", m.conf)
	if err := m.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", m.addr)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("mosquitto not listening on %s: %v", m.addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// restart stops mosquitto as its service manager does (SIGTERM: it
// writes its persistence file, if it keeps one) and starts it again.
func (m *mosquittoBroker) restart(t testing.TB) {
	t.Helper()
	m.cmd.Process.Signal(syscall.SIGTERM)
	m.cmd.Wait()
	m.start(t)
}

func (m *mosquittoBroker) stop() {
	if m.cmd != nil && m.cmd.Process != nil {
		m.cmd.Process.Kill()
		m.cmd.Wait()
		m.cmd = nil
	}
}

// brokers holds each data directory's broker: a server started again on
// its directory (a restart) attaches to the broker its clients still use.
var brokers sync.Map // data dir -> *mosquittoBroker

func brokerFor(t testing.TB, dir string) *mosquittoBroker {
	t.Helper()
	if b, ok := brokers.Load(dir); ok {
		return b.(*mosquittoBroker)
	}
	b := startMosquitto(t)
	brokers.Store(dir, b)
	t.Cleanup(func() { brokers.Delete(dir) })
	return b
}

// subscribeToNotifications subscribes an SDK client to its notification
// topics, as a Go application behind a broker other than mqkv's must:
// the Go SDK never subscribes to them (every release to v0.4.1; see the
// protocol spec, 1.4), and only mqkv's broker delivers them without a
// subscription.
func subscribeToNotifications(t testing.TB, ctx context.Context, mc *mqtt.SessionClient, id string) {
	t.Helper()
	ack, err := mc.Subscribe(ctx, statestore.NotifyClientPrefix(id)+"#", mqtt.WithQoS(1))
	if err != nil || ack.ReasonCode > 1 {
		t.Fatalf("subscribing to the notification topics: %v %+v", err, ack)
	}
}

// attachTo has cfg's server attach to the broker at addr, as mqkv attach
// does: with no MQTT listener of its own.
func attachTo(addr string) serverOption {
	return func(c *server.Config) {
		c.Listen = ""
		c.Attach = &attach.Config{Brokers: []*url.URL{{Scheme: "mqtt", Host: addr}}, SessionExpiry: 60}
	}
}

// attachAlso has cfg's server attach to the broker at addr and keep its
// own listener.
func attachAlso(addr string) serverOption {
	return func(c *server.Config) {
		listen := c.Listen
		attachTo(addr)(c)
		c.Listen = listen
	}
}

// awaitAttached waits until s takes requests from its broker.
func awaitAttached(t testing.TB, s *server.Server) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !s.Attached().Serving() {
		if time.Now().After(deadline) {
			t.Fatal("the server did not attach to its broker within 20 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// hostPort splits a host:port address.
func hostPort(t testing.TB, addr string) (string, uint16) {
	t.Helper()
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := strconv.Atoi(port)
	return host, uint16(p)
}

// getJSON decodes the JSON at url into v.
func getJSON(url string, v any) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}
