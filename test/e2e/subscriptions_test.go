package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
)

// subscribeMany subscribes to filters in packets of at most 500 and
// returns every reason code, in order.
func (rc *rawClient) subscribeMany(filters []string) []byte {
	rc.t.Helper()
	var codes []byte
	for len(filters) > 0 {
		n := min(len(filters), 500)
		opts := make([]paho.SubscribeOptions, n)
		for i, f := range filters[:n] {
			opts[i] = paho.SubscribeOptions{Topic: f, QoS: 1}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		ack, err := rc.c.Subscribe(ctx, &paho.Subscribe{Subscriptions: opts})
		cancel()
		if ack == nil || len(ack.Reasons) != n {
			rc.t.Fatalf("subscribe %d filters: %v %+v", n, err, ack)
		}
		codes = append(codes, ack.Reasons...)
		filters = filters[n:]
	}
	return codes
}

func numbered(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s/%d", prefix, i)
	}
	return out
}

// TestSubscriptionLimits: a client holds at most --max-subscriptions
// filters (SUBACK 0x97 for each one beyond, the others granted), filters
// too long or too deep get 0x8F, and nothing refused is subscribed or
// stored.
func TestSubscriptionLimits(t *testing.T) {
	s := startServer(t, withLimits(server.Limits{MaxSubscriptions: 10}))
	c := dialRaw(t, s, "many", rawOpts{cleanStart: true, sessionExpiry: 3600, noSubscribe: true})

	codes := c.subscribeMany(numbered("a", 12))
	for i, code := range codes {
		want := byte(1)
		if i >= 10 {
			want = 0x97
		}
		if code != want {
			t.Fatalf("filter %d: SUBACK reason %#x, want %#x (all: %x)", i, code, want, codes)
		}
	}
	// Subscribing again to a held filter replaces it: no quota needed.
	if code := c.subscribe("a/3", 0); code != 0 {
		t.Fatalf("re-subscribe a/3: %#x, want 0 (granted QoS 0)", code)
	}
	if code := c.subscribe("a/11", 1); code != 0x97 {
		t.Fatalf("11th filter: %#x, want 0x97", code)
	}
	c.unsubscribe("a/0")
	if code := c.subscribe("a/11", 1); code != 1 {
		t.Fatalf("after an unsubscribe: %#x, want 1", code)
	}

	// Refused filters were not subscribed: a message to one is not delivered.
	pub := dialRaw(t, s, "pub", rawOpts{cleanStart: true, noSubscribe: true})
	ctx := ctxFor(t, 5*time.Second)
	for _, topic := range []string{"a/10", "a/11"} {
		if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(topic)}); err != nil {
			t.Fatal(err)
		}
	}
	if p, ok := c.nextPublish(5 * time.Second); !ok || p.Topic != "a/11" {
		t.Fatalf("first message %+v, want the one on a/11", p)
	}
	if p, ok := c.nextPublish(200 * time.Millisecond); ok {
		t.Fatalf("a message on a refused filter arrived: %s", p.Topic)
	}

	other := dialRaw(t, s, "bounds", rawOpts{cleanStart: true, noSubscribe: true})
	long := strings.Repeat("x", 4097)
	deep := strings.Repeat("l/", 128) + "end" // 129 levels
	codes = other.subscribeMany([]string{"ok/#", long, deep, strings.Repeat("l/", 127) + "end"})
	if want := []byte{1, 0x8F, 0x8F, 1}; string(codes) != string(want) {
		t.Fatalf("SUBACK reasons %x, want %x", codes, want)
	}

	// What a session stores survives a restart with only the granted
	// filters.
	c.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the disconnect", func() bool { return s.Broker().ClientsConnected() == 2 })
	s.Close()
	s = startServerIn(t, s.dir, withLimits(server.Limits{MaxSubscriptions: 10}))
	back := dialRaw(t, s, "many", rawOpts{sessionExpiry: 3600, noSubscribe: true})
	if code := back.subscribe("a/new", 1); code != 0x97 {
		t.Fatalf("after restart the session holds fewer than 10 filters: %#x", code)
	}
}

// TestRefusedFiltersTakeNoQuota: a filter the policy refuses (SUBACK
// 0x87) does not count toward --max-subscriptions, also within the same
// SUBSCRIBE as granted ones.
func TestRefusedFiltersTakeNoQuota(t *testing.T) {
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(pol, []byte(`rules:
  - principals: {clientIds: ["*"]}
    brokerResources:
      - {method: Connect}
      - {method: Subscribe, topics: ["ok/#"]}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxSubscriptions: 3}), func(c *server.Config) { c.PolicyFile = pol })
	c := dialRaw(t, s, "quota", rawOpts{cleanStart: true, noSubscribe: true})
	codes := c.subscribeMany([]string{"no/1", "ok/1", "no/2", "ok/2", "no/3", "ok/3", "ok/4"})
	if want := []byte{0x87, 1, 0x87, 1, 0x87, 1, 0x97}; string(codes) != string(want) {
		t.Fatalf("SUBACK reasons %x, want %x", codes, want)
	}
}

// TestManySubscriptionsEndQuickly: a client with 20,000 subscriptions
// leaves in well under a second's work, whether its session ends with it
// or expires; and the server shuts down promptly while such a client is
// connected. Each subscription used to cost the session store an fsync at
// disconnect (about 11 ms: 220 s for 20,000).
func TestManySubscriptionsEndQuickly(t *testing.T) {
	if testing.Short() {
		t.Skip("subscribes 60,000 filters")
	}
	const n = 20_000
	s := startServer(t, withLimits(server.Limits{MaxSubscriptions: n}))
	for _, tc := range []struct {
		name   string
		expiry uint32
	}{{"clean", 0}, {"persistent-ended-at-disconnect", 3600}} {
		c := dialRaw(t, s, tc.name, rawOpts{cleanStart: true, sessionExpiry: tc.expiry, noSubscribe: true})
		for i, code := range c.subscribeMany(numbered(tc.name, n)) {
			if code != 1 {
				t.Fatalf("filter %d refused: %#x", i, code)
			}
		}
		start := time.Now()
		zero := uint32(0)
		c.c.Disconnect(&paho.Disconnect{Properties: &paho.DisconnectProperties{SessionExpiryInterval: &zero}})
		eventuallyWithin(t, 10*time.Second, "the client's departure", func() bool { return s.Broker().ClientsConnected() == 0 })
		t.Logf("%s: %d subscriptions torn down in %v", tc.name, n, time.Since(start))
	}

	c := dialRaw(t, s, "held", rawOpts{cleanStart: true, sessionExpiry: 3600, noSubscribe: true})
	c.subscribeMany(numbered("held", n))
	closed := make(chan error, 1)
	start := time.Now()
	go func() { closed <- s.Close() }()
	select {
	case <-closed:
		t.Logf("shutdown with %d subscriptions held: %v", n, time.Since(start))
	case <-time.After(10 * time.Second):
		t.Fatal("the server did not shut down within 10 s")
	}
}

// lockedBuffer collects a server's log lines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *lockedBuffer) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), s)
}

func withLog(w io.Writer) serverOption {
	return func(c *server.Config) { c.Logger = slog.New(slog.NewTextHandler(w, nil)) }
}

// TestUnacknowledgedNotificationsAreDrops: a client that registers a
// pattern and acknowledges nothing fills its session; the notifications
// refused then are counted as dropped, not as sent, and logged once, not
// once each.
func TestUnacknowledgedNotificationsAreDrops(t *testing.T) {
	var log lockedBuffer
	s := startServer(t, inMemory(), withLog(&log), withLimits(server.Limits{MaxQueued: 5}))
	mute := dialRaw(t, s, "mute", rawOpts{cleanStart: true, manualAck: true})
	expectPayload(t, mute.call("KEYNOTIFY", "*", "PATTERN"), "+OK\r\n") // its reply holds one of the 5 places
	w := dialRaw(t, s, "writer", rawOpts{cleanStart: true})
	const writes = 200
	for i := range writes {
		expectPayload(t, w.call("SET", fmt.Sprintf("k%d", i), "v"), "+OK\r\n")
	}
	var sent, dropped int64
	eventually(t, "every change notified or dropped", func() bool {
		sent, dropped = s.Service().Counters.NotificationsSent.Load(), s.Broker().Counters.NotificationsDropped.Load()
		return sent+dropped >= writes
	})
	if sent != 4 || dropped != writes-4 {
		t.Fatalf("notifications sent %d, dropped %d; want 4 sent (the session's other places) and %d dropped", sent, dropped, writes-4)
	}
	if n := log.count("notification dropped"); n != 1 {
		t.Fatalf("%d log lines for %d drops, want 1", n, dropped)
	}
}
