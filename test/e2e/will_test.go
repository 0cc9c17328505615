package e2e

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
	"github.com/mqkv/mqkv/internal/statestore"
)

const willPolicy = `rules:
  - principals: {usernames: ["bob", "carol"]}
    brokerResources:
      - {method: Connect}
      - {method: Publish, topics: ["{principal.username}/#"]}
  - principals: {usernames: ["alice"]}
    brokerResources:
      - {method: Connect}
      - {method: Subscribe, topics: ["#"]}
`

// willServer starts a durable server under willPolicy; connect dials a
// client with a will and returns its connection twice (nil if refused:
// the first result tells, the second is closed to drop the client without
// DISCONNECT) and the CONNACK.
func willServer(t *testing.T, dir string) (*testServer, func(user, id string, will *paho.WillMessage, delay uint32) (net.Conn, net.Conn, *paho.Connack)) {
	t.Helper()
	pw := writePasswords(t, "alice", "a", "bob", "b", "carol", "c")
	pol := filepath.Join(dir, "policy.yaml")
	if _, err := os.Stat(pol); err != nil {
		os.WriteFile(pol, []byte(willPolicy), 0o600)
	}
	s := startServerIn(t, filepath.Join(dir, "data"), func(c *server.Config) { c.PasswordFile, c.PolicyFile = pw, pol })
	return s, func(user, id string, will *paho.WillMessage, delay uint32) (net.Conn, net.Conn, *paho.Connack) {
		conn := dialTCP(t, s.Addr())
		o := rawOpts{cleanStart: true, conn: conn, username: user, password: user[:1], noSubscribe: true, will: will, sessionExpiry: 60}
		if delay > 0 {
			o.willProps = &paho.WillProperties{WillDelayInterval: &delay}
		}
		c, ack, _ := connectRaw(t, id, o)
		if c == nil {
			return nil, nil, ack
		}
		return conn, conn, ack
	}
}

// TestWillIsAuthorizedLikeAPublish: a will is a publish by its client. One
// to a topic the client may not publish refuses the CONNECT with 0x87
// (plain, QoS 1, retained, delayed, or aimed at another client's
// notifications); an allowed one is delivered; one no longer allowed when
// due (policy reloaded meanwhile) is dropped, immediate or delayed.
func TestWillIsAuthorizedLikeAPublish(t *testing.T) {
	dir := t.TempDir()
	s, connect := willServer(t, dir)
	alice := dialRaw(t, s, "alice-dev", rawOpts{cleanStart: true, username: "alice", password: "a", noSubscribe: true})
	alice.subscribe("#", 1)

	aliceNotify := statestore.NotifyClientPrefix("alice-dev") + "command/notify/" + hexUpper("k")
	for _, tc := range []struct {
		name  string
		will  paho.WillMessage
		delay uint32
	}{
		{"qos0", paho.WillMessage{Topic: "alice/will", Payload: []byte("x")}, 0},
		{"qos1", paho.WillMessage{Topic: "alice/will", QoS: 1, Payload: []byte("x")}, 0},
		{"retained", paho.WillMessage{Topic: "alice/will", QoS: 1, Retain: true, Payload: []byte("x")}, 0},
		{"delayed", paho.WillMessage{Topic: "alice/will", QoS: 1, Payload: []byte("x")}, 1},
		{"forged notification", paho.WillMessage{Topic: aliceNotify, QoS: 1, Payload: []byte("*2\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n")}, 0},
		{"request topic", paho.WillMessage{Topic: statestore.RequestTopic, QoS: 1, Payload: []byte("*1\r\n$4\r\nPING\r\n")}, 0},
	} {
		will := tc.will
		if c, _, ack := connect("bob", "bob-dev", &will, tc.delay); c != nil || ack == nil || ack.ReasonCode != 0x87 {
			t.Fatalf("%s: will on %s: CONNACK %+v, want 0x87", tc.name, will.Topic, ack)
		}
	}
	// The notification prefix stays closed to wills even where the policy
	// would allow everything.
	if c, _, ack := connect("alice", "alice-w", &paho.WillMessage{Topic: aliceNotify, QoS: 1, Payload: []byte("x")}, 0); c != nil || ack == nil || ack.ReasonCode != 0x87 {
		t.Fatalf("will under the notification prefix: CONNACK %+v, want 0x87", ack)
	}

	// Allowed: delivered when the connection drops without DISCONNECT.
	_, conn, ack := connect("bob", "bob-dev", &paho.WillMessage{Topic: "bob/status", QoS: 1, Payload: []byte("bob gone")}, 0)
	if ack == nil || ack.ReasonCode != 0 {
		t.Fatalf("allowed will refused: %+v", ack)
	}
	conn.Close()
	if p, ok := alice.nextPublish(5 * time.Second); !ok || p.Topic != "bob/status" || string(p.Payload) != "bob gone" {
		t.Fatalf("allowed will: %+v", p)
	}

	// Allowed at CONNECT, forbidden by a reload before it is due: dropped,
	// immediate or delayed. carol's delayed will, due after both of bob's,
	// shows they were not sent.
	_, bobNow, _ := connect("bob", "bob-1", &paho.WillMessage{Topic: "bob/status", QoS: 1, Payload: []byte("stale")}, 0)
	_, bobLater, _ := connect("bob", "bob-2", &paho.WillMessage{Topic: "bob/later", QoS: 1, Payload: []byte("stale")}, 1)
	_, carol, _ := connect("carol", "carol-1", &paho.WillMessage{Topic: "carol/status", QoS: 1, Payload: []byte("carol gone")}, 1)
	if bobNow == nil || bobLater == nil || carol == nil {
		t.Fatal("allowed wills refused")
	}
	if err := os.WriteFile(filepath.Join(dir, "policy.yaml"), []byte(`rules:
  - principals: {usernames: ["carol"]}
    brokerResources:
      - {method: Connect}
      - {method: Publish, topics: ["carol/#"]}
  - principals: {usernames: ["alice", "bob"]}
    brokerResources:
      - {method: Connect}
      - {method: Subscribe, topics: ["#"]}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Reload(); err != nil {
		t.Fatal(err)
	}
	bobNow.Close()
	bobLater.Close()
	carol.Close()
	if p, ok := alice.nextPublish(5 * time.Second); !ok || p.Topic != "carol/status" {
		t.Fatalf("after the reload: got %+v, want only carol's will", p)
	}
	// bob's delayed will is due when carol's is, on a timer of its own:
	// its drop can be counted just after carol's will arrives (CI).
	eventually(t, "both of bob's wills dropped", func() bool { return s.Broker().Counters.WillsDropped.Load() >= 2 })
	if n := s.Broker().Counters.WillsDropped.Load(); n != 2 {
		t.Fatalf("wills dropped: %d, want 2", n)
	}
	expectNoPublish(t, alice, 300*time.Millisecond) // and none of them sent

	// Nothing forbidden was retained.
	late := dialRaw(t, s, "alice-2", rawOpts{cleanStart: true, username: "alice", password: "a", noSubscribe: true})
	late.subscribe("#", 1)
	expectNoPublish(t, late, 300*time.Millisecond)
}

// TestDelayedWillCancelledByReconnect: a client that comes back within its
// Will Delay Interval has no will sent (MQTT-3.1.3-9); one that does not
// has it sent after the delay, with its user properties (paho sends no
// other will property).
func TestDelayedWillCancelledByReconnect(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory())
	watcher := dialRaw(t, s, "watcher", rawOpts{cleanStart: true, noSubscribe: true})
	watcher.subscribe("status/#", 1)
	delay := uint32(1)
	dial := func(id, topic string) net.Conn {
		conn := dialTCP(t, s.Addr())
		connectRaw(t, id, rawOpts{conn: conn, sessionExpiry: 60, noSubscribe: true,
			will:      &paho.WillMessage{Topic: topic, QoS: 1, Payload: []byte(id)},
			willProps: &paho.WillProperties{WillDelayInterval: &delay, User: paho.UserProperties{{Key: "why", Value: "gone"}}}})
		return conn
	}
	dial("returning", "status/returning").Close()
	dial("gone", "status/gone").Close()
	dial("returning", "status/returning") // back within the delay
	p, ok := watcher.nextPublish(5 * time.Second)
	if !ok || p.Topic != "status/gone" || p.Properties == nil || p.Properties.User.Get("why") != "gone" {
		t.Fatalf("delayed will: %+v", p)
	}
	expectNoPublish(t, watcher, 1500*time.Millisecond)
}

// TestWillSentWhenSessionEndsBeforeDelay: MQTT-3.1.3-9, a will goes when
// its delay elapses or its session ends, whichever is first. A client that
// disconnects with 0x04 (with will) and sets its Session Expiry Interval
// to 0 in the DISCONNECT ends its session at once, so its will, delayed
// 30 s, is due at once.
func TestWillSentWhenSessionEndsBeforeDelay(t *testing.T) {
	s := startServer(t, inMemory())
	watcher := dialRaw(t, s, "watcher", rawOpts{cleanStart: true, noSubscribe: true})
	watcher.subscribe("status/#", 1)
	delay := uint32(30)
	dev := dialRaw(t, s, "dev", rawOpts{cleanStart: true, sessionExpiry: 300, noSubscribe: true,
		will:      &paho.WillMessage{Topic: "status/dev", QoS: 1, Payload: []byte("gone")},
		willProps: &paho.WillProperties{WillDelayInterval: &delay}})
	zero := uint32(0)
	dev.c.Disconnect(&paho.Disconnect{ReasonCode: 0x04, Properties: &paho.DisconnectProperties{SessionExpiryInterval: &zero}})
	if p, ok := watcher.nextPublish(3 * time.Second); !ok || p.Topic != "status/dev" {
		t.Fatalf("session ended by DISCONNECT (expiry 0, reason 0x04), its will delayed 30 s: got %+v, want the will at once", p)
	}
}
