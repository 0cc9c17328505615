package e2e

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
)

// Plain MQTT v5 behaviour that AIO applications (and the SDKs' own
// protocol tests) rely on: mqkv is a general-purpose broker too.

func TestMQTTUserPropertiesAndMetadataPassThrough(t *testing.T) {
	s := startServer(t, inMemory())
	sub := dialRaw(t, s, "sub-meta", rawOpts{cleanStart: true, noSubscribe: true})
	pub := dialRaw(t, s, "pub-meta", rawOpts{cleanStart: true, noSubscribe: true})
	sub.subscribe("app/meta", 1)
	expiry := uint32(120)
	pfi := byte(1)
	ctx := ctxFor(t, 5*time.Second)
	props := &paho.PublishProperties{
		CorrelationData: []byte{1, 2, 3},
		ContentType:     "application/json",
		ResponseTopic:   "app/reply",
		PayloadFormat:   &pfi,
		MessageExpiry:   &expiry,
		User:            paho.UserProperties{{Key: "$high_priority", Value: ""}, {Key: "__srcId", Value: "x"}, {Key: "custom", Value: "ü"}},
	}
	if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "app/meta", QoS: 1, Payload: []byte(`{}`), Properties: props}); err != nil {
		t.Fatal(err)
	}
	p, ok := sub.nextPublish(5 * time.Second)
	if !ok {
		t.Fatal("no message")
	}
	got := p.Properties
	if string(got.CorrelationData) != "\x01\x02\x03" || got.ContentType != "application/json" || got.ResponseTopic != "app/reply" ||
		got.PayloadFormat == nil || *got.PayloadFormat != 1 || got.MessageExpiry == nil || *got.MessageExpiry == 0 || *got.MessageExpiry > 120 {
		t.Fatalf("properties changed in transit: %+v", got)
	}
	if len(got.User) != 3 || got.User[0] != props.User[0] || got.User[1] != props.User[1] || got.User[2] != props.User[2] {
		t.Fatalf("user properties %+v", got.User)
	}
}

func TestMQTTQoS0AndQoS1(t *testing.T) {
	s := startServer(t, inMemory())
	sub := dialRaw(t, s, "sub-qos", rawOpts{cleanStart: true, noSubscribe: true})
	pub := dialRaw(t, s, "pub-qos", rawOpts{cleanStart: true, noSubscribe: true})
	sub.subscribe("qos/#", 1)
	ctx := ctxFor(t, 5*time.Second)
	for _, q := range []byte{0, 1} {
		if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "qos/x", QoS: q, Payload: []byte{q}}); err != nil {
			t.Fatal(err)
		}
		p, ok := sub.nextPublish(5 * time.Second)
		if !ok || p.QoS != q || p.Payload[0] != q {
			t.Fatalf("QoS %d: %+v", q, p)
		}
	}
}

func TestMQTTSharedSubscription(t *testing.T) {
	s := startServer(t, inMemory())
	a := dialRaw(t, s, "share-a", rawOpts{cleanStart: true, noSubscribe: true})
	b := dialRaw(t, s, "share-b", rawOpts{cleanStart: true, noSubscribe: true})
	pub := dialRaw(t, s, "share-pub", rawOpts{cleanStart: true, noSubscribe: true})
	a.subscribe("$share/g/jobs", 1)
	b.subscribe("$share/g/jobs", 1)
	ctx := ctxFor(t, 5*time.Second)
	const n = 20
	for i := 0; i < n; i++ {
		pub.c.Publish(ctx, &paho.Publish{Topic: "jobs", QoS: 1, Payload: []byte{byte(i)}})
	}
	got := 0
	for got < n {
		select {
		case <-a.inbox:
			got++
		case <-b.inbox:
			got++
		case <-time.After(5 * time.Second):
			t.Fatalf("received %d of %d shared messages", got, n)
		}
	}
	expectNoPublish(t, a, 200*time.Millisecond) // each message went to one member only
	expectNoPublish(t, b, 10*time.Millisecond)
}

func TestMQTTWillMessage(t *testing.T) {
	s := startServer(t, inMemory())
	watcher := dialRaw(t, s, "will-watcher", rawOpts{cleanStart: true, noSubscribe: true})
	watcher.subscribe("status/dying", 1)
	conn := dialTCP(t, s.Addr())
	c := paho.NewClient(paho.ClientConfig{ClientID: "dying", Conn: conn, OnClientError: func(error) {}})
	ctx := ctxFor(t, 5*time.Second)
	if _, err := c.Connect(ctx, &paho.Connect{ClientID: "dying", CleanStart: true, KeepAlive: 30,
		WillMessage: &paho.WillMessage{Topic: "status/dying", QoS: 1, Payload: []byte("gone")}}); err != nil {
		t.Fatal(err)
	}
	conn.Close() // no DISCONNECT: the will is published
	p, ok := watcher.nextPublish(5 * time.Second)
	if !ok || string(p.Payload) != "gone" {
		t.Fatalf("will: %+v", p)
	}
}

func TestMQTTMessageExpiry(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory())
	pub := dialRaw(t, s, "expiry-pub", rawOpts{cleanStart: true, noSubscribe: true})
	expiry := uint32(1)
	ctx := ctxFor(t, 10*time.Second)
	pub.c.Publish(ctx, &paho.Publish{Topic: "expiring", QoS: 1, Retain: true, Payload: []byte("short"), Properties: &paho.PublishProperties{MessageExpiry: &expiry}})
	pub.c.Publish(ctx, &paho.Publish{Topic: "lasting", QoS: 1, Retain: true, Payload: []byte("long")})
	time.Sleep(2100 * time.Millisecond)
	sub := dialRaw(t, s, "expiry-sub", rawOpts{cleanStart: true, noSubscribe: true})
	sub.subscribe("expiring", 1)
	sub.subscribe("lasting", 1)
	p, ok := sub.nextPublish(5 * time.Second)
	if !ok || string(p.Payload) != "long" {
		t.Fatalf("retained: %+v", p)
	}
	expectNoPublish(t, sub, 300*time.Millisecond)
}

// TestMQTTSessionsSurviveRestart: a persistent session's subscriptions and
// the retained messages are on disk.
func TestMQTTSessionsSurviveRestart(t *testing.T) {
	dir := t.TempDir()
	s := startServerIn(t, dir)
	c := dialRaw(t, s, "persistent", rawOpts{sessionExpiry: 3600, cleanStart: true, noSubscribe: true})
	c.subscribe("persist/#", 1)
	pub := dialRaw(t, s, "publisher", rawOpts{cleanStart: true, noSubscribe: true})
	ctx := ctxFor(t, 10*time.Second)
	if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "config/site", QoS: 1, Retain: true, Payload: []byte("retained-value")}); err != nil {
		t.Fatal(err)
	}
	c.c.Disconnect(&paho.Disconnect{})
	pub.c.Disconnect(&paho.Disconnect{})
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s = startServerIn(t, dir)
	// A fresh budget: in cluster mode the restart itself (three nodes
	// settling) can take most of the first one.
	ctx = ctxFor(t, 10*time.Second)
	conn := dialTCP(t, s.Addr())
	inbox := make(chan *paho.Publish, 10)
	pc := paho.NewClient(paho.ClientConfig{ClientID: "persistent", Conn: conn, OnClientError: func(error) {},
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			inbox <- pr.Packet
			return true, nil
		}}})
	expiry := uint32(3600)
	ack, err := pc.Connect(ctx, &paho.Connect{ClientID: "persistent", CleanStart: false, KeepAlive: 30,
		Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry}})
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Disconnect(&paho.Disconnect{})
	if !ack.SessionPresent {
		t.Fatal("session not present after restart")
	}
	pub = dialRaw(t, s, "publisher", rawOpts{cleanStart: true, noSubscribe: true})
	pub.c.Publish(ctx, &paho.Publish{Topic: "persist/x", QoS: 1, Payload: []byte("after-restart")})
	select {
	case p := <-inbox:
		if string(p.Payload) != "after-restart" {
			t.Fatalf("got %q", p.Payload)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("restored subscription did not deliver")
	}
	fresh := dialRaw(t, s, "fresh", rawOpts{cleanStart: true, noSubscribe: true})
	fresh.subscribe("config/site", 1)
	if p, ok := fresh.nextPublish(5 * time.Second); !ok || string(p.Payload) != "retained-value" {
		t.Fatalf("retained message after restart: %+v", p)
	}
}

// TestMQTTQueuedMessagesKeepOrder: messages queued for an offline session
// come back in the order they were published [MQTT-4.6.0-1], also after a
// restart, although they all arrived within the same second.
func TestMQTTQueuedMessagesKeepOrder(t *testing.T) {
	// A client's Receive Maximum makes mochi store messages past it on a
	// second path; both must keep the order.
	for _, recvMax := range []uint16{0, 5} {
		t.Run(fmt.Sprintf("receive-maximum-%d", recvMax), func(t *testing.T) {
			dir := t.TempDir()
			s := startServerIn(t, dir)
			opts := rawOpts{sessionExpiry: 3600, cleanStart: true, noSubscribe: true, receiveMaximum: recvMax}
			c := dialRaw(t, s, "orderly", opts)
			c.subscribe("ordered/#", 1)
			c.c.Disconnect(&paho.Disconnect{})
			eventually(t, "the subscriber's disconnect", func() bool { return s.Broker().ClientsConnected() == 0 })
			pub := dialRaw(t, s, "publisher", rawOpts{cleanStart: true, noSubscribe: true})
			ctx := ctxFor(t, 20*time.Second)
			const n = 200
			for i := 0; i < n; i++ {
				if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: "ordered/x", QoS: 1, Payload: []byte(strconv.Itoa(i))}); err != nil {
					t.Fatal(err)
				}
			}
			eventually(t, "all messages queued", func() bool { return s.Broker().Traffic().Inflight == n })
			pub.c.Disconnect(&paho.Disconnect{})
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}

			s = startServerIn(t, dir)
			opts.cleanStart = false
			back := dialRaw(t, s, "orderly", opts)
			for i := 0; i < n; i++ {
				select {
				case p := <-back.inbox:
					if string(p.Payload) != strconv.Itoa(i) {
						t.Fatalf("message %s arrived as #%d", p.Payload, i)
					}
				case <-ctx.Done():
					t.Fatalf("%d of %d queued messages arrived", i, n)
				}
			}
		})
	}
}

// TestMQTTExpiredSessionLeavesNoSubscriptions: once a session expires, a
// new client with the same id inherits none of its subscriptions.
func TestMQTTExpiredSessionLeavesNoSubscriptions(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory())
	ghost := dialRaw(t, s, "ghost", rawOpts{sessionExpiry: 1, cleanStart: true, noSubscribe: true})
	ghost.subscribe("leak/#", 1)
	ghost.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the session's expiry", func() bool { return !s.Broker().HasSession("ghost") })
	again := dialRaw(t, s, "ghost", rawOpts{cleanStart: true, noSubscribe: true})
	pub := dialRaw(t, s, "leak-publisher", rawOpts{cleanStart: true})
	if _, err := pub.c.Publish(ctxFor(t, 5*time.Second), &paho.Publish{Topic: "leak/x", QoS: 1, Payload: []byte("secret")}); err != nil {
		t.Fatal(err)
	}
	// A PING after the publish: its reply comes after any delivery.
	expectPayload(t, pub.call("PING"), "+PONG\r\n")
	expectNoPublish(t, again, 300*time.Millisecond)
}

// TestSDKSurvivesServerRestart: the Go SDK reconnects with its persistent
// session and finds its data.
func TestSDKSurvivesServerRestart(t *testing.T) {
	dir := t.TempDir()
	s := startServerIn(t, dir)
	addr := s.Addr()
	c := newSDKClient(t, s)
	ctx := ctxFor(t, 60*time.Second) // a restart in cluster mode waits for three nodes to settle
	key := uniqueKey(t)
	set, err := c.store.Set(ctx, key, "durable")
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	// Same address, so the SDK's connection provider finds it again.
	startServerIn(t, dir, func(cfg *serverConfig) { cfg.Listen = addr })
	callCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	var get *getResponse
	for {
		get, err = c.store.Get(callCtx, key)
		if err == nil || callCtx.Err() != nil {
			break
		}
	}
	if err != nil || get.Value != "durable" || get.Version.Compare(set.Version) != 0 {
		t.Fatalf("after restart: %+v %v", get, err)
	}
	set2, err := c.store.Set(ctx, key, "again")
	if err != nil || set2.Version.Compare(set.Version) <= 0 {
		t.Fatalf("version after restart %v, before %v (%v)", set2.Version, set.Version, err)
	}
}
