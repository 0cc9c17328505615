package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
)

// Replies made on the asking client's reader are written straight to it
// when it is its response topic's only subscriber (broker/replies.go).
// These check that they still follow the topic index as mochi's routing
// would: other subscribers, a removed subscription, the subscription's
// QoS and identifier.

// TestReplyFollowsTheResponseTopicsSubscribers: a second subscriber to a
// client's response topic gets its replies too, and no longer once it
// unsubscribes; a client that unsubscribed from its own response topic
// gets none.
func TestReplyFollowsTheResponseTopicsSubscribers(t *testing.T) {
	s := startServer(t, inMemory())
	a := dialRaw(t, s, "asker", rawOpts{cleanStart: true})
	b := dialRaw(t, s, "listener", rawOpts{cleanStart: true, noSubscribe: true})
	expectPayload(t, a.call("SET", "k", "v"), "+OK\r\n")
	expectPayload(t, a.call("GET", "k"), "$1\r\nv\r\n") // the asker alone

	b.subscribe(a.respTopc, 1)
	expectPayload(t, a.call("GET", "k"), "$1\r\nv\r\n")
	b.expectMessage(a.respTopc, "$1\r\nv\r\n")
	expectPayload(t, a.call("SET", "k", "v"), "+OK\r\n") // made once committed
	b.expectMessage(a.respTopc, "+OK\r\n")

	b.unsubscribe(a.respTopc)
	expectPayload(t, a.call("GET", "k"), "$1\r\nv\r\n")
	b.expectNone(300*time.Millisecond, "unsubscribed listener")

	a.unsubscribe(a.respTopc)
	reply := a.send(req{args: []string{"GET", "k"}, ts: now()})
	select {
	case p := <-reply:
		t.Fatalf("a reply reached a client not subscribed to it: %q", p.Payload)
	case <-time.After(300 * time.Millisecond):
	}
}

// TestReplyHonoursTheSubscription: a reply goes at the subscription's QoS
// (0 here) and carries its subscription identifier (MQTT-3.3.4-3).
func TestReplyHonoursTheSubscription(t *testing.T) {
	s := startServer(t, inMemory())
	a := dialRaw(t, s, "asker", rawOpts{cleanStart: true, noSubscribe: true})
	a.subscribeWith(paho.SubscribeOptions{Topic: a.respTopc, QoS: 0}, 7)
	p := a.call("PING")
	if string(p.Payload) != "+PONG\r\n" || p.QoS != 0 {
		t.Fatalf("reply %q at QoS %d to a QoS 0 subscription", p.Payload, p.QoS)
	}
	if p.Properties == nil || p.Properties.SubscriptionIdentifier == nil || *p.Properties.SubscriptionIdentifier != 7 {
		t.Fatalf("reply without the subscription identifier 7: %+v", p.Properties)
	}
}

func (rc *rawClient) unsubscribe(filter string) {
	rc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := rc.c.Unsubscribe(ctx, &paho.Unsubscribe{Topics: []string{filter}}); err != nil {
		rc.t.Fatalf("unsubscribe %s: %v", filter, err)
	}
}
