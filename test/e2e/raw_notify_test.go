package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/statestore"
)

const notifySet = "*4\r\n$6\r\nNOTIFY\r\n$3\r\nSET\r\n$5\r\nVALUE\r\n"
const notifyDelete = "*2\r\n$6\r\nNOTIFY\r\n$6\r\nDELETE\r\n"

// expectNotifications expects the (key, payload) notifications in order;
// in a cluster only each key's in order: a change of one group can reach a
// node after a later change of another (a node on a group's follower sees
// it once the commit index arrives).
func expectNotifications(t *testing.T, c *rawClient, want [][2]string) {
	t.Helper()
	if !clusterMode() {
		for _, w := range want {
			expectNotification(t, c, w[0], w[1])
		}
		return
	}
	prefix := statestore.NotifyPrefix + "/" + hexUpper(c.id) + "/command/notify/"
	got, wantBy := map[string][]string{}, map[string][]string{}
	for _, w := range want {
		wantBy[hexUpper(w[0])] = append(wantBy[hexUpper(w[0])], w[1])
		p, ok := c.nextPublish(5 * time.Second)
		if !ok {
			t.Fatalf("%d notifications of %d", len(got), len(want))
		}
		k := strings.TrimPrefix(p.Topic, prefix)
		got[k] = append(got[k], string(p.Payload))
	}
	if fmt.Sprint(got) != fmt.Sprint(wantBy) {
		t.Fatalf("notifications by key %q, want %q", got, wantBy)
	}
}

// expectNotification waits for one notification and checks its form.
func expectNotification(t *testing.T, c *rawClient, key, payload string) *paho.Publish {
	t.Helper()
	p, ok := c.nextPublish(5 * time.Second)
	if !ok {
		t.Fatalf("no notification for %q", key)
	}
	wantTopic := statestore.NotifyPrefix + "/" + hexUpper(c.id) + "/command/notify/" + hexUpper(key)
	if p.Topic != wantTopic {
		t.Fatalf("topic %q, want %q", p.Topic, wantTopic)
	}
	if string(p.Payload) != payload {
		t.Fatalf("payload %q, want %q", p.Payload, payload)
	}
	if p.QoS != 1 {
		t.Fatalf("notification QoS %d", p.QoS)
	}
	ts, ok := userProp(p, "__ts")
	if _, err := hlc.Parse(ts); !ok || err != nil {
		t.Fatalf("notification __ts %q (present %v)", ts, ok)
	}
	if _, ok := userProp(p, "__protVer"); ok {
		t.Fatal("notification carries __protVer")
	}
	if ct := p.Properties.ContentType; ct != "" && ct != "application/octet-stream" {
		t.Fatalf("content type %q", ct)
	}
	if len(p.Properties.CorrelationData) != 0 {
		t.Fatal("notification carries correlation data")
	}
	return p
}

func expectNoPublish(t *testing.T, c *rawClient, d time.Duration) {
	t.Helper()
	if p, ok := c.nextPublish(d); ok {
		t.Fatalf("unexpected publish on %q: %q", p.Topic, p.Payload)
	}
}

func TestRawNotificationWithoutSubscription(t *testing.T) {
	s := startServer(t)
	obs := dialRaw(t, s, "observer-nosub", rawOpts{cleanStart: true})
	writer := dialRaw(t, s, "writer-nosub", rawOpts{cleanStart: true})
	key := "Some Key ü"
	expectPayload(t, obs.call("KEYNOTIFY", key), "+OK\r\n")
	set := writer.call("SET", key, "v1")
	n := expectNotification(t, obs, key, notifySet+"$2\r\nv1\r\n")
	setTS, _ := userProp(set, "__ts")
	if ts, _ := userProp(n, "__ts"); ts != setTS {
		t.Fatalf("SET notification __ts %q, SET reply __ts %q", ts, setTS)
	}
	writer.call("DEL", key)
	expectNotification(t, obs, key, notifyDelete)
	expectNoPublish(t, obs, 300*time.Millisecond)
	// The writer observes nothing.
	expectNoPublish(t, writer, 10*time.Millisecond)
}

func TestRawNotificationOnceWithMatchingSubscriptions(t *testing.T) {
	s := startServer(t)
	obs := dialRaw(t, s, "observer-sub", rawOpts{cleanStart: true})
	prefix := statestore.NotifyPrefix + "/" + hexUpper(obs.id) + "/command/notify/"
	// The Rust client's filter, a broader one, and the exact filter mqkv
	// uses for its own broker-side subscription.
	for _, f := range []string{prefix + "+", "clients/statestore/#", prefix + "#"} {
		if code := obs.subscribe(f, 1); code != 1 {
			t.Fatalf("SUBACK for %s: %d", f, code)
		}
	}
	expectPayload(t, obs.call("KEYNOTIFY", "k"), "+OK\r\n")
	obs.call("SET", "k", "v")
	expectNotification(t, obs, "k", notifySet+"$1\r\nv\r\n")
	expectNoPublish(t, obs, 300*time.Millisecond)
	// STOP ends notifications even though the client's own
	// subscriptions still match the topic.
	expectPayload(t, obs.call("KEYNOTIFY", "k", "STOP"), "+OK\r\n")
	obs.call("SET", "k", "w")
	expectNoPublish(t, obs, 300*time.Millisecond)
}

func TestRawDotNetNotifySubscribeGrantedQoS1(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "dotnet-client", rawOpts{cleanStart: true})
	// The .NET SDK subscribes to the raw client id, no wildcard, and
	// throws unless QoS 1 is granted.
	if code := c.subscribe(statestore.NotifyPrefix+"/dotnet-client/command/notify", 1); code != 1 {
		t.Fatalf("SUBACK reason %d, want 1", code)
	}
	expectPayload(t, c.call("KEYNOTIFY", "k"), "+OK\r\n")
	c.call("SET", "k", "v")
	expectNotification(t, c, "k", notifySet+"$1\r\nv\r\n")
}

func TestRawClientsCannotForgeNotifications(t *testing.T) {
	s := startServer(t)
	victim := dialRaw(t, s, "victim", rawOpts{cleanStart: true})
	victim.subscribe(statestore.NotifyPrefix+"/"+hexUpper("victim")+"/command/notify/+", 1)
	attacker := dialRaw(t, s, "attacker", rawOpts{cleanStart: true})
	ctx := ctxFor(t, 5*time.Second)
	res, err := attacker.c.Publish(ctx, &paho.Publish{
		Topic: statestore.NotifyPrefix + "/" + hexUpper("victim") + "/command/notify/6B", QoS: 1, Payload: []byte(notifyDelete),
	})
	if err == nil && res.ReasonCode < 0x80 {
		t.Fatalf("forged notification accepted: %+v", res)
	}
	expectNoPublish(t, victim, 300*time.Millisecond)
}

func TestRawNoNotificationsAfterReconnect(t *testing.T) {
	s := startServer(t)
	opts := rawOpts{sessionExpiry: 3600, cleanStart: true}
	obs := dialRaw(t, s, "reconnecting", opts)
	writer := dialRaw(t, s, "writer-reconnect", rawOpts{cleanStart: true})
	expectPayload(t, obs.call("KEYNOTIFY", "k"), "+OK\r\n")
	writer.call("SET", "k", "1")
	expectNotification(t, obs, "k", notifySet+"$1\r\n1\r\n")
	// A round trip first, so that the notification's PUBACK (paho sends it
	// once the handler returns) reaches the server before the DISCONNECT:
	// a notification left unacknowledged comes again with the session
	// (MQTT-4.4.0-1), which CI once caught here. The round trip's own
	// reply may then come again the same way (CI caught that too): only
	// notifications count below.
	expectPayload(t, obs.call("PING"), "+PONG\r\n")
	obs.c.Disconnect(&paho.Disconnect{})

	// Same client id, persistent session resumed: the registration did
	// not survive the connection.
	opts.cleanStart = false
	again := dialRaw(t, s, "reconnecting", opts)
	writer.call("SET", "k", "2")
	notifyTopics := statestore.NotifyPrefix + "/" + hexUpper(again.id) + "/"
	for deadline := time.Now().Add(500 * time.Millisecond); ; {
		p, ok := again.nextPublish(time.Until(deadline))
		if !ok {
			break
		}
		if strings.HasPrefix(p.Topic, notifyTopics) {
			t.Fatalf("a notification after the reconnect: %q on %q", p.Payload, p.Topic)
		}
	}
	expectPayload(t, again.call("KEYNOTIFY", "k", "STOP"), ":0\r\n")
	// Registering again works.
	expectPayload(t, again.call("KEYNOTIFY", "k"), "+OK\r\n")
	writer.call("SET", "k", "3")
	expectNotification(t, again, "k", notifySet+"$1\r\n3\r\n")
}

func TestRawExpiryNotificationIsPrompt(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "expiry-watch", rawOpts{cleanStart: true})
	expectPayload(t, c.call("KEYNOTIFY", "ttl"), "+OK\r\n")
	const px = 300 * time.Millisecond
	sent := time.Now()
	reply := c.call("SET", "ttl", "v", "PX", "300")
	replied := time.Now()
	expectPayload(t, reply, "+OK\r\n")
	expectNotification(t, c, "ttl", notifySet+"$1\r\nv\r\n")
	expectNotification(t, c, "ttl", notifyDelete)
	got := time.Now()
	// The deadline lies between sent+PX and replied+PX.
	if got.Before(sent.Add(px)) {
		t.Fatalf("DELETE %v after sending, before the %v TTL", got.Sub(sent), px)
	}
	bound := 100 * time.Millisecond
	if clusterMode() {
		bound = 500 * time.Millisecond // a quorum of fsyncs on one disk, then the event stream
	}
	if late := got.Sub(replied.Add(px)); late > bound {
		t.Fatalf("DELETE arrived %v after the deadline", late)
	}
}

// TestRawNotificationsFitInATopic: a notification's topic holds the key in
// hex, and MQTT caps a topic at 65535 bytes, so a key of more than about
// 32 KiB cannot be observed (spec section 1.3). KEYNOTIFY refuses it; a
// pattern that matches it delivers nothing for it. Before, the PUBLISH
// went out with its topic length truncated, and the observer's connection
// died on it (and, in a persistent session, on every resend).
func TestRawNotificationsFitInATopic(t *testing.T) {
	s := startServer(t)
	obs := dialRaw(t, s, "observer-long", rawOpts{cleanStart: true})
	w := dialRaw(t, s, "writer-long", rawOpts{cleanStart: true})
	long, fits := strings.Repeat("k", 40000), strings.Repeat("k", 30000)
	expectPayload(t, obs.call("KEYNOTIFY", long), "-ERR the quota has been exceeded\r\n")
	expectPayload(t, obs.call("KEYNOTIFY", fits), "+OK\r\n")
	expectPayload(t, w.call("SET", fits, "v"), "+OK\r\n")
	expectNotification(t, obs, fits, notifySet+"$1\r\nv\r\n")

	expectPayload(t, obs.call("KEYNOTIFY", "k*", "PATTERN"), "+OK\r\n")
	expectPayload(t, w.call("SET", long, "v"), "+OK\r\n")
	expectPayload(t, w.call("SET", "kk", "v"), "+OK\r\n")
	// The next notification is kk's, on a connection that still works.
	expectNotification(t, obs, "kk", notifySet+"$1\r\nv\r\n")
	expectPayload(t, obs.call("GET", "kk"), "$1\r\nv\r\n")
	if !clusterMode() {
		if n := s.Broker().Counters.NotificationsDropped.Load(); n != 1 {
			t.Fatalf("%d notifications counted as dropped, want the long key's", n)
		}
	}
}

// TestRawNotificationsSurviveUnsubscribingTheirFilter: the broker's own
// subscription to a client's notification topics has the filter the
// client may subscribe to itself, and the topic index holds one
// subscription per client and filter. A client that subscribed to it and
// unsubscribed again still gets its notifications (spec section 0, item
// 10); before, it removed the broker's subscription with its own.
func TestRawNotificationsSurviveUnsubscribingTheirFilter(t *testing.T) {
	s := startServer(t)
	obs := dialRaw(t, s, "observer-unsub", rawOpts{cleanStart: true})
	w := dialRaw(t, s, "writer-unsub", rawOpts{cleanStart: true})
	expectPayload(t, obs.call("KEYNOTIFY", "k"), "+OK\r\n")
	expectPayload(t, w.call("SET", "k", "a"), "+OK\r\n")
	expectNotification(t, obs, "k", notifySet+"$1\r\na\r\n")
	filter := statestore.NotifyClientPrefix(obs.id) + "#"
	if code := obs.subscribe(filter, 1); code != 1 {
		t.Fatalf("SUBACK %d", code)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := obs.c.Unsubscribe(ctx, &paho.Unsubscribe{Topics: []string{filter}}); err != nil {
		t.Fatal(err)
	}
	expectPayload(t, w.call("SET", "k", "b"), "+OK\r\n")
	expectNotification(t, obs, "k", notifySet+"$1\r\nb\r\n")
}
