package e2e

import (
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
)

// A persistent session ends Session Expiry Interval seconds after its
// connection closed (MQTT 3.1.2.11.2), whatever the server does meanwhile.

// TestSessionExpiryCountsWhileServerIsDown: a session that expired while
// the server was down is not brought back by the restart (mochi's restore
// started every session's clock again, so a server restarted more often
// than a session's interval kept it for ever).
func TestSessionExpiryCountsWhileServerIsDown(t *testing.T) {
	t.Parallel()
	skipInCluster(t, "restarts its own server")
	dir := t.TempDir()
	s := startServerIn(t, dir)
	for _, id := range []string{"short", "long"} {
		c := dialRaw(t, s, id, rawOpts{cleanStart: true, sessionExpiry: map[string]uint32{"short": 2, "long": 600}[id], noSubscribe: true})
		c.subscribe(id+"/#", 1)
		c.c.Disconnect(&paho.Disconnect{})
	}
	eventually(t, "both clients gone", func() bool { return s.Broker().ClientsConnected() == 0 })
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // the short session expires meanwhile
	s = startServerIn(t, dir)
	for id, want := range map[string]bool{"short": false, "long": true} {
		present := resumes(t, s, id)
		if present != want {
			t.Errorf("%s: session present %v after a restart 3 s after its client left, want %v", id, present, want)
		}
	}
}

// TestDisconnectSessionExpirySurvivesRestart: an interval set in the
// DISCONNECT (allowed, 3.14.2.2.2) is the one a restart keeps, not the
// CONNECT's.
func TestDisconnectSessionExpirySurvivesRestart(t *testing.T) {
	t.Parallel()
	skipInCluster(t, "restarts its own server")
	dir := t.TempDir()
	s := startServerIn(t, dir)
	cut := dialRaw(t, s, "cut", rawOpts{cleanStart: true, sessionExpiry: 3600, noSubscribe: true})
	cut.subscribe("cut/#", 1)
	two := uint32(2)
	cut.c.Disconnect(&paho.Disconnect{Properties: &paho.DisconnectProperties{SessionExpiryInterval: &two}})
	eventually(t, "the client gone", func() bool { return s.Broker().ClientsConnected() == 0 })
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = startServerIn(t, dir)
	// With the CONNECT's 3600 s it would stay; with the DISCONNECT's 2 s
	// mochi's sweep (every second) ends it soon.
	eventuallyWithin(t, 15*time.Second, "the session to expire", func() bool { return !s.Broker().HasSession("cut") })
	present := resumes(t, s, "cut")
	if present {
		t.Fatal("session whose DISCONNECT set its expiry to 2 s present after a restart: the CONNECT's 3600 s came back")
	}
}

// TestDisconnectSessionExpiryIsCapped: --max-session-expiry bounds an
// interval raised in the DISCONNECT as it bounds the CONNECT's.
func TestDisconnectSessionExpiryIsCapped(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory(), withLimits(server.Limits{MaxSessionExpiry: 2 * time.Second}))
	c := dialRaw(t, s, "raiser", rawOpts{cleanStart: true, sessionExpiry: 1, noSubscribe: true})
	c.subscribe("raise/#", 1)
	long := uint32(1 << 30)
	c.c.Disconnect(&paho.Disconnect{Properties: &paho.DisconnectProperties{SessionExpiryInterval: &long}})
	eventually(t, "the client gone", func() bool { return s.Broker().ClientsConnected() == 0 })
	eventuallyWithin(t, 15*time.Second, "the session to expire", func() bool { return !s.Broker().HasSession("raiser") })
	present := resumes(t, s, "raiser")
	if present {
		t.Fatal("session present after a DISCONNECT raised its expiry past the 2 s --max-session-expiry")
	}
}

// TestMessageExpiryDecremented: MQTT-3.3.2-6, a message sent on carries
// its Message Expiry Interval minus the time it waited in the server: one
// queued in an offline session (QoS 1 and 2) and a retained one.
func TestMessageExpiryDecremented(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory())
	c := dialRaw(t, s, "late", rawOpts{cleanStart: true, sessionExpiry: 300, noSubscribe: true})
	c.subscribe("exp/#", 1)
	c.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the subscriber gone", func() bool { return s.Broker().ClientsConnected() == 0 })
	pub := dialRaw(t, s, "pub", rawOpts{cleanStart: true, noSubscribe: true})
	expiry := uint32(60)
	for _, m := range []struct {
		topic  string
		qos    byte
		retain bool
	}{{"exp/queued1", 1, false}, {"exp/queued2", 2, false}, {"exp/retained", 1, true}} {
		if _, err := pub.c.Publish(ctxFor(t, 5*time.Second), &paho.Publish{Topic: m.topic, QoS: m.qos, Retain: m.retain, Payload: []byte("x"),
			Properties: &paho.PublishProperties{MessageExpiry: &expiry}}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(3 * time.Second) // the messages wait
	check := func(what string, p *paho.Publish, ok bool) {
		t.Helper()
		if !ok {
			t.Fatalf("%s: nothing received", what)
		}
		if p.Properties == nil || p.Properties.MessageExpiry == nil {
			t.Errorf("%s (%s): no Message Expiry Interval", what, p.Topic)
			return
		}
		if got := *p.Properties.MessageExpiry; got > expiry-2 {
			t.Errorf("%s (%s): Message Expiry Interval %d after waiting 3 s in the server, want at most %d", what, p.Topic, got, expiry-2)
		}
	}
	rc, ack, err := connectRaw(t, "late", rawOpts{conn: dialTCP(t, s.Addr()), sessionExpiry: 300, noSubscribe: true})
	if err != nil || !ack.SessionPresent {
		t.Fatalf("resume: %v %+v", err, ack)
	}
	for i := 0; i < 3; i++ {
		p, ok := rc.nextPublish(3 * time.Second)
		check("queued in the offline session", p, ok)
	}
	fresh := dialRaw(t, s, "fresh", rawOpts{cleanStart: true, noSubscribe: true})
	fresh.subscribe("exp/retained", 1)
	p, ok := fresh.nextPublish(3 * time.Second)
	check("retained", p, ok)
}

// TestSessionConnectedAtShutdownCountsFromRestart: a session whose
// connection was open when the server stopped counts its interval from the
// restart (a rolling restart longer than a client's interval does not lose
// its session). A graceful shutdown disconnects every client first, and
// that disconnect was recorded as the session's end (found by review).
func TestSessionConnectedAtShutdownCountsFromRestart(t *testing.T) {
	t.Parallel()
	skipInCluster(t, "restarts its own server")
	dir := t.TempDir()
	s := startServerIn(t, dir)
	c := dialRaw(t, s, "online", rawOpts{cleanStart: true, sessionExpiry: 4, noSubscribe: true})
	c.subscribe("online/#", 1)
	if err := s.Close(); err != nil { // the client still connected
		t.Fatal(err)
	}
	time.Sleep(5 * time.Second) // longer than its interval; resumed within it after the restart
	s = startServerIn(t, dir)
	present := resumes(t, s, "online")
	if !present {
		t.Fatal("the session of a client connected when the server stopped expired while it was down; documented: its interval counts from the restart")
	}
}

// resumes reconnects id without a clean start and reports whether its
// session was still there.
func resumes(t *testing.T, s *testServer, id string) bool {
	t.Helper()
	_, ack, err := connectRaw(t, id, rawOpts{conn: dialTCP(t, s.Addr()), sessionExpiry: 60, noSubscribe: true})
	if err != nil {
		t.Fatal(err)
	}
	return ack.SessionPresent
}
