package admin

import (
	"cmp"
	"hash/maphash"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/statestore"
)

// activity gathers what kumotop and redis-cli --stat show: requests per
// client and per key over the last complete window of activityWindow, the
// recent slow requests, and the latencies of the last requests (for the
// p99 that status and the console show). Windows are fixed, so that
// several viewers see the same figures. Past maxTracked distinct clients
// or keys in one window the rest count together under "(others)", so the
// maps stay bounded.
//
// Counting is sampled once requests come fast: one request in `every` is
// counted, and stands for `every` requests (a slow one is always listed).
// every follows the rate of the last second so that about sampleRate
// requests a second are counted: all of them at a few thousand a second,
// one in a hundred at 400,000. Why: a lock and two map updates per
// request, shared by every connection, cost a pipelined GET through the
// RESP endpoint a sixth of its CPU (the lock's cache line moving between
// cores, the maps missing the cache); the busy clients, hot keys and the
// p99 the figures are for show as well in a sample of thousands a second.
type activity struct {
	every atomic.Uint32 // read on every request, written by tune
	// next: when the window ends or every is due to be set again (unix
	// ns), whichever is first: a request after it takes the lock, counted
	// or not.
	next atomic.Int64

	mu        sync.Mutex
	cur, last window
	slow      []SlowRequest    // the last maxSlow, oldest first
	recent    []time.Duration  // latencies of counted requests, a ring
	oldest    int              // recent's oldest, once full
	tuned     time.Time        // when every was last set
	counted   int64            // requests counted since, each as many as it stands for
	now       func() time.Time // time.Now; a test holds it still so that no window ends mid-test
}

// sampleRate is how many requests a second activity counts, at least.
const sampleRate = 4096

type window struct {
	since, until time.Time
	clients      tally
	keys         tally
}

// tally counts requests by name. Names are looked up by a 64-bit hash
// (maphash, seeded per process) instead of by their bytes: a key map of
// thousands of strings missed the cache at each compare, and cost a
// GET pipelined through the RESP endpoint an eighth of its CPU. Two
// names of one hash (about one chance in 10^11 with maxTracked names)
// would share a count; these are statistics.
type tally struct {
	n     map[uint64]int64
	names map[uint64]string // written once per name, read by take
}

var tallySeed = maphash.MakeSeed()

func newTally() tally { return tally{n: map[uint64]int64{}, names: map[uint64]string{}} }

// add counts n requests of the name of hash h; name makes the name, the
// first time only. Past maxTracked names, a new one counts as othersName.
// One map operation when the name is known (the common case).
func (t *tally) add(h uint64, n int64, name func() string) {
	before := len(t.n)
	t.n[h] += n
	if len(t.n) == before {
		return
	}
	if before >= maxTracked {
		delete(t.n, h)
		t.n[othersHash] += n
		t.names[othersHash] = othersName
		return
	}
	t.names[h] = name()
}

// othersHash is othersName's place in a tally.
var othersHash = maphash.String(tallySeed, othersName)

const activityWindow = 5 * time.Second

const (
	maxTracked  = 10_000
	maxSlow     = 20
	slowRequest = 50 * time.Millisecond
	othersName  = "(others)"
	topShown    = 10
)

// SlowRequest is a request that took longer than slowRequest.
type SlowRequest struct {
	At       time.Time `json:"at"`
	ClientID string    `json:"client"`
	Command  string    `json:"command"`
	Key      string    `json:"key,omitempty"`
	MS       float64   `json:"ms"`
}

// Rate is a client's or key's requests per second over the window.
type Rate struct {
	Name      string  `json:"name"`
	PerSecond float64 `json:"per_second"`
}

// Activity is what GET /v1/activity returns.
type Activity struct {
	WindowSeconds float64       `json:"window_seconds"`
	Clients       []Rate        `json:"clients"` // busiest first
	Keys          []Rate        `json:"keys"`    // hottest first
	Slow          []SlowRequest `json:"slow"`    // newest first
}

func newActivity() *activity {
	a := &activity{cur: newWindow(time.Now().Truncate(activityWindow)), now: time.Now, recent: make([]time.Duration, 0, 4096)}
	a.every.Store(1)
	a.tuned = a.cur.since
	a.next.Store(a.cur.since.Add(time.Second).UnixNano())
	return a
}

func newWindow(at time.Time) window {
	return window{since: at, clients: newTally(), keys: newTally()}
}

// rotate starts a new window when the current one is over. Windows are
// aligned on activityWindow: the last complete one is the one before the
// current, empty if nothing was counted in it.
func (a *activity) rotate(now time.Time) {
	if d := now.Sub(a.cur.since); d >= 0 && d < activityWindow {
		return // within the current window (the common case: no division)
	}
	start := now.Truncate(activityWindow)
	if !a.cur.since.Before(start) {
		return
	}
	prev := start.Add(-activityWindow)
	if a.cur.since.Equal(prev) {
		a.last = a.cur
	} else {
		a.last = newWindow(prev)
	}
	a.last.until = start
	a.cur = newWindow(start)
}

// tune sets every from the rate counted since it was last set, once a
// second: within a second of a change of load, sampling follows it.
func (a *activity) tune(now time.Time) {
	if d := now.Sub(a.tuned); d >= time.Second {
		rate := int64(float64(a.counted) / d.Seconds())
		a.every.Store(uint32(max(1, min(rate/sampleRate, 1<<16))))
		a.tuned, a.counted = now, 0
	}
	a.next.Store(min(a.tuned.Add(time.Second).UnixNano(), a.cur.since.Add(activityWindow).UnixNano()))
}

func (a *activity) observe(r statestore.Reply) {
	now := r.At
	if now.IsZero() {
		now = a.now()
	}
	every := a.every.Load()
	counted := every <= 1 || rand.Uint32N(every) == 0
	slow := r.Duration >= slowRequest
	if !counted && !slow && now.UnixNano() < a.next.Load() {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.rotate(now)
	if counted {
		w := int64(every)
		a.counted += w
		a.cur.clients.add(maphash.String(tallySeed, r.ClientID), w, func() string { return r.ClientID })
		if r.Key != nil {
			a.cur.keys.add(maphash.Bytes(tallySeed, r.Key), w, func() string { return string(r.Key) })
		}
		if len(a.recent) < cap(a.recent) {
			a.recent = append(a.recent, r.Duration)
		} else {
			a.recent[a.oldest] = r.Duration
			a.oldest = (a.oldest + 1) % len(a.recent)
		}
	}
	if slow {
		if len(a.slow) == maxSlow {
			a.slow = append(a.slow[:0], a.slow[1:]...)
		}
		a.slow = append(a.slow, SlowRequest{At: now, ClientID: r.ClientID, Command: r.Command, Key: string(r.Key), MS: float64(r.Duration.Microseconds()) / 1000})
	}
	a.tune(now)
}

// latencies returns the latencies counted since the last call and forgets
// them.
func (a *activity) latencies() []time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	lat := slices.Clone(a.recent)
	a.recent, a.oldest = a.recent[:0], 0
	return lat
}

// take returns the figures of the last complete window (the current one
// if none is complete yet).
func (a *activity) take() Activity {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	a.rotate(now)
	w := a.last
	if w.since.IsZero() { // none complete yet: the current one so far
		w = a.cur
		w.until = now
	}
	secs := max(w.until.Sub(w.since).Seconds(), 1e-3)
	slow := slices.Clone(a.slow)
	slices.Reverse(slow)
	return Activity{WindowSeconds: secs, Clients: top(w.clients, secs), Keys: top(w.keys, secs), Slow: slow}
}

func top(t tally, secs float64) []Rate {
	out := make([]Rate, 0, len(t.n))
	for h, n := range t.n {
		out = append(out, Rate{Name: t.names[h], PerSecond: float64(n) / secs})
	}
	slices.SortFunc(out, func(a, b Rate) int {
		if c := cmp.Compare(b.PerSecond, a.PerSecond); c != 0 {
			return c
		}
		return cmp.Compare(a.Name, b.Name)
	})
	return out[:min(len(out), topShown)]
}

func (s *Server) activity(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, s.metrics.activity.take())
}
