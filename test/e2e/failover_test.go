package e2e

import (
	"fmt"
	"strconv"
	"testing"
	"time"
)

// killableCluster starts three node processes for a test that kills one.
func killableCluster(t *testing.T) *procCluster {
	t.Helper()
	t.Parallel()
	if testing.Short() {
		t.Skip("starts processes")
	}
	skipInCluster(t, "starts its own nodes")
	c := startProcCluster(t, 3, 4)
	c.awaitSettled(0, 3)
	return c
}

// collect reads p's messages into got (payload → times received) until it
// holds want different ones, within the time given.
func collect(t *testing.T, p *peer, got map[string]int, want int, within time.Duration) {
	t.Helper()
	deadline := time.After(within)
	for len(got) < want {
		select {
		case m := <-p.msgs:
			got[string(m.payload)]++
		case <-deadline:
			t.Fatalf("%s: %d of %d messages after %v", p.id, len(got), want, within)
		}
	}
}

// Issue 31, sessions that survive their node: a subscriber with a
// persistent session on n1 gets QoS 1 messages published on n2; n1 is
// SIGKILLed mid-stream; the subscriber connects to n3, finds its session
// (Session Present) and gets every message published after its last
// acknowledgement, those published while it was away included: none is
// lost (duplicates, with DUP, as QoS 1 allows).
func TestPersistentSessionSurvivesItsNode(t *testing.T) {
	c := killableCluster(t)
	sub := dialPeer(t, c.mqtt[0], "survivor", peerOpts{clean: true, sessionExpiry: 600})
	sub.subscribe(subOpt{filter: "fo/#", qos: 1})
	pub := dialPeer(t, c.mqtt[1], "fo-pub", peerOpts{clean: true})

	got := map[string]int{}
	const total, killAt = 60, 20
	var killed time.Time
	for i := range total {
		if i == killAt {
			collect(t, sub, got, killAt, 10*time.Second) // received (and acknowledged) the first ones
			c.procs[0].Kill()
			killed = time.Now()
		}
		if !pub.tryPublish("fo/t", fmt.Sprint(i), uint16(i+1), false, 30*time.Second) {
			t.Fatalf("no PUBACK for message %d (its subscriber's node killed)", i)
		}
	}
	var present bool
	back := dialPeer(t, c.mqtt[2], "survivor", peerOpts{sessionExpiry: 600, sessionPresent: &present})
	if !present {
		t.Fatal("Session Present 0 on another node after the session's node died")
	}
	collect(t, back, got, total, 30*time.Second)
	dups := 0
	for _, n := range got {
		dups += n - 1
	}
	t.Logf("all %d messages after the kill of the subscriber's node (%d duplicates); publisher's stream took %v after the kill",
		total, dups, time.Since(killed).Round(time.Millisecond))
	// The session goes on there: a new message arrives (after the
	// duplicates still on their way).
	pub.tryPublish("fo/t", "after", 1000, false, 10*time.Second)
	for {
		select {
		case m := <-back.msgs:
			if string(m.payload) == "after" {
				return
			}
			if i, err := strconv.Atoi(string(m.payload)); err != nil || i >= total {
				t.Fatalf("unexpected %q", m.payload)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no message after the session moved")
		}
	}
}

// The publisher's node killed mid-stream: messages it acknowledged reached
// the subscriber's session on another node; the one in flight is sent
// again by the publisher, with DUP, to another node, once it reconnects.
// Nothing is lost; the subscriber may see that one twice.
func TestPublisherNodeKilledMidHop(t *testing.T) {
	c := killableCluster(t)
	sub := dialPeer(t, c.mqtt[2], "mid-sub", peerOpts{clean: true, sessionExpiry: 600})
	sub.subscribe(subOpt{filter: "mh/#", qos: 1})
	pub := dialPeer(t, c.mqtt[1], "mid-pub", peerOpts{clean: true, sessionExpiry: 600})
	const total, killAt = 40, 15
	for i := 0; i < total; i++ {
		if i == killAt {
			c.procs[1].Kill()
		}
		if pub.tryPublish("mh/t", fmt.Sprint(i), uint16(i+1), false, 5*time.Second) {
			continue
		}
		// Not acknowledged: its node is gone. Again, on another node,
		// with DUP, as a client resends an unacknowledged QoS 1 PUBLISH.
		pub = dialPeer(t, c.mqtt[0], "mid-pub", peerOpts{sessionExpiry: 600})
		if !pub.tryPublish("mh/t", fmt.Sprint(i), uint16(i+1), true, 30*time.Second) {
			t.Fatalf("message %d not acknowledged on another node", i)
		}
	}
	collect(t, sub, map[string]int{}, total, 30*time.Second)
}

// Wills across nodes: the wills of clients whose node was SIGKILLed are
// published by a surviving node, once each: at once for a session that
// ended with its connection, after its delay for one that outlives it.
func TestWillsOfClientsWhoseNodeDied(t *testing.T) {
	c := killableCluster(t)
	watcher := dialPeer(t, c.mqtt[1], "will-watcher", peerOpts{clean: true})
	watcher.subscribe(subOpt{filter: "wills/#", qos: 1})
	dialPeer(t, c.mqtt[0], "will-now", peerOpts{clean: true, willTopic: "wills/now", willPayload: "gone"})
	dialPeer(t, c.mqtt[0], "will-later", peerOpts{clean: true, sessionExpiry: 60, willTopic: "wills/later", willPayload: "gone too", willDelay: 3})
	watcher.expectNone(500*time.Millisecond, "a will while its client is connected")
	c.procs[0].Kill()
	killed := time.Now()
	now := watcher.expect("wills/now", "gone")
	later := watcher.expect("wills/later", "gone too")
	if d := later.receivedWhen.Sub(killed); d < 3*time.Second {
		t.Fatalf("the delayed will came %v after its node died, before its delay", d)
	}
	t.Logf("wills after the kill: %v and %v", now.receivedWhen.Sub(killed).Round(time.Millisecond), later.receivedWhen.Sub(killed).Round(time.Millisecond))
	watcher.expectNone(3*time.Second, "a will sent twice")
}

// A subscriber whose node died reconnects to another node at once, before
// the cluster takes the dead node for dead: its claim waits for the
// client id record's group to elect a leader again, finds the old node
// silent and takes the session up from the store (Session Present 1);
// every message reaches it, those the dead node had not acknowledged
// included.
func TestSubscriberBackAtOnceAfterItsNodeDied(t *testing.T) {
	c := killableCluster(t)
	sub := dialPeer(t, c.mqtt[0], "at-once", peerOpts{clean: true, sessionExpiry: 600})
	sub.subscribe(subOpt{filter: "ao/#", qos: 1})
	pub := dialPeer(t, c.mqtt[1], "ao-pub", peerOpts{clean: true})
	const total, killAt = 30, 10
	got := map[string]int{}
	for i := range killAt {
		pub.publish("ao/t", fmt.Sprint(i), pubOpt{qos: 1})
		got[string(sub.expect("ao/t", fmt.Sprint(i)).payload)]++
	}
	c.procs[0].Kill()
	killed := time.Now()
	var present bool
	back := dialPeer(t, c.mqtt[2], "at-once", peerOpts{sessionExpiry: 600, sessionPresent: &present})
	backAfter := time.Since(killed)
	if !present {
		t.Fatalf("Session Present 0 on reconnecting %v after the kill", time.Since(killed).Round(time.Millisecond))
	}
	for i := killAt; i < total; i++ {
		if !pub.tryPublish("ao/t", fmt.Sprint(i), uint16(i+1), false, 30*time.Second) {
			t.Fatalf("no PUBACK for message %d", i)
		}
	}
	collect(t, back, got, total, 30*time.Second)
	t.Logf("back %v after the kill; all %d messages %v after it", backAfter.Round(time.Millisecond), total, time.Since(killed).Round(time.Millisecond))
}
