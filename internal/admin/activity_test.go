package admin

import (
	"fmt"
	"hash/maphash"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/statestore"
)

func TestActivityRanksClientsAndKeys(t *testing.T) {
	a := newActivity()
	at := a.cur.since.Add(time.Second)
	a.now = func() time.Time { return at }
	for i := range 30 {
		a.observe(statestore.Reply{Command: "GET", ClientID: "busy", Key: []byte("hot"), Duration: time.Millisecond})
		if i%3 == 0 {
			a.observe(statestore.Reply{Command: "SET", ClientID: "calm", Key: []byte(fmt.Sprintf("k%d", i)), Duration: time.Millisecond})
		}
	}
	a.observe(statestore.Reply{Command: "SET", ClientID: "calm", Key: []byte("slow-key"), Duration: 80 * time.Millisecond})
	got := a.take() // no complete window yet: the current one
	if len(got.Clients) != 2 || got.Clients[0].Name != "busy" || got.Keys[0].Name != "hot" {
		t.Fatalf("ranking %+v", got)
	}
	if len(got.Slow) != 1 || got.Slow[0].Key != "slow-key" || got.Slow[0].MS < 80 {
		t.Fatalf("slow requests %+v", got.Slow)
	}
	// A complete window is what everyone sees, whoever looked before.
	a.cur.since = a.cur.since.Add(-activityWindow)
	a.rotate(at)
	a.observe(statestore.Reply{Command: "GET", ClientID: "late", Key: []byte("later")})
	w1, w2 := a.take(), a.take()
	if len(w1.Clients) != 2 || len(w2.Clients) != 2 || w1.Clients[0].Name != "busy" {
		t.Fatalf("the last complete window: %+v / %+v", w1, w2)
	}
}

func TestActivityIsBounded(t *testing.T) {
	a := newActivity()
	// All in one window: a window ending halfway would split the counts.
	at := a.cur.since.Add(time.Second)
	a.now = func() time.Time { return at }
	for i := range maxTracked + 500 {
		a.observe(statestore.Reply{ClientID: fmt.Sprint(i), Key: []byte(fmt.Sprint(i))})
	}
	others := func(t tally) int64 { return t.n[othersHash] }
	if len(a.cur.clients.n) > maxTracked+1 || others(a.cur.clients) != 500 || len(a.cur.keys.n) > maxTracked+1 || others(a.cur.keys) != 500 {
		t.Fatalf("%d clients tracked, %d under others; %d keys, %d under others",
			len(a.cur.clients.n), others(a.cur.clients), len(a.cur.keys.n), others(a.cur.keys))
	}
	for range 3 * maxSlow {
		a.observe(statestore.Reply{Duration: time.Second})
	}
	if len(a.slow) != maxSlow {
		t.Fatalf("%d slow requests kept", len(a.slow))
	}
}

// TestActivitySamplesFastRequests: past sampleRate requests a second the
// next second counts a sample, each request counted as many as it stands
// for, and still every slow request; once quiet, every request again.
func TestActivitySamplesFastRequests(t *testing.T) {
	a := newActivity()
	at := a.cur.since.Add(10 * time.Millisecond)
	a.now = func() time.Time { return at }
	fast := 20 * sampleRate // in a second: 20 times the rate counted
	send := func(n int) {
		for i := range n {
			a.observe(statestore.Reply{ClientID: "busy", Key: []byte(fmt.Sprint(i % 100)), Duration: time.Millisecond})
		}
	}
	send(fast)
	if a.counted != int64(fast) || a.every.Load() != 1 {
		t.Fatalf("first second: %d of %d requests counted, one in %d", a.counted, fast, a.every.Load())
	}
	at = at.Add(time.Second)
	a.observe(statestore.Reply{ClientID: "busy", Key: []byte("0")}) // a second on: tunes
	if e := a.every.Load(); e < 19 || e > 20 {
		t.Fatalf("one in %d counted after %d requests a second, want 20", e, fast)
	}
	a.latencies()
	send(fast)
	a.observe(statestore.Reply{ClientID: "slow", Key: []byte("k"), Duration: time.Second})
	if got := a.counted; got < int64(fast)*8/10 || got > int64(fast)*12/10 {
		t.Fatalf("sampled second estimates %d requests, sent %d", got, fast)
	}
	if n := len(a.latencies()); n < sampleRate/2 || n > 2*sampleRate {
		t.Fatalf("%d latencies kept of %d requests: want about %d", n, fast, sampleRate)
	}
	if len(a.slow) != 1 || a.slow[0].ClientID != "slow" {
		t.Fatalf("slow requests %+v: a slow one is kept whether counted or not", a.slow)
	}
	if c := a.cur.clients.n[maphash.String(tallySeed, "busy")]; c < int64(fast)*18/10 || c > int64(fast)*22/10 {
		t.Fatalf("the busy client counted %d times for %d requests", c, 2*fast)
	}
	at = at.Add(time.Second) // the next request tunes, counted or not
	a.observe(statestore.Reply{ClientID: "back"})
	at = at.Add(time.Second) // and after a quiet second
	a.observe(statestore.Reply{ClientID: "back"})
	if e := a.every.Load(); e != 1 {
		t.Fatalf("after a pause one in %d counted, want every one", e)
	}
}

// BenchmarkActivityObserve counts requests spread over 10,000 keys, as a
// load generator's random keys spread them: the map lookups miss the
// cache, and they are on every request's path.
func BenchmarkActivityObserve(b *testing.B) {
	a := newActivity()
	at := a.cur.since.Add(time.Second)
	a.now = func() time.Time { return at }
	keys := make([][]byte, 10_000)
	for i := range keys {
		keys[i] = []byte(fmt.Sprintf("key:%012d", i*7919%10_000))
	}
	clients := make([]string, 50)
	for i := range clients {
		clients[i] = fmt.Sprintf("resp-%d", 4611686018427387905+i)
	}
	b.ResetTimer()
	for i := range b.N {
		a.observe(statestore.Reply{Command: "GET", ClientID: clients[i%50], Key: keys[(i*7)%10_000], Duration: time.Millisecond})
	}
}
