package admin

import (
	"cmp"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/statestore"
)

// activity gathers what kumotop and redis-cli --stat show: requests per
// client and per key over the last complete window of activityWindow, and
// the recent slow requests. Windows are fixed, so that several viewers see
// the same figures. Counting costs a map update under a lock per request;
// past maxTracked distinct clients or keys in one window the rest count
// together under "(others)", so the maps stay bounded.
type activity struct {
	mu        sync.Mutex
	cur, last window
	slow      []SlowRequest    // the last maxSlow, oldest first
	now       func() time.Time // time.Now; a test holds it still so that no window ends mid-test
}

type window struct {
	since, until time.Time
	clients      map[string]*int64
	keys         map[string]*int64
}

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
	return &activity{cur: newWindow(time.Now().Truncate(activityWindow)), now: time.Now}
}

func newWindow(at time.Time) window {
	return window{since: at, clients: map[string]*int64{}, keys: map[string]*int64{}}
}

// rotate starts a new window when the current one is over. Windows are
// aligned on activityWindow: the last complete one is the one before the
// current, empty if nothing was counted in it.
func (a *activity) rotate(now time.Time) {
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

func (a *activity) observe(r statestore.Reply) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	a.rotate(now)
	count(a.cur.clients, r.ClientID)
	if r.Key != nil {
		if n, ok := a.cur.keys[string(r.Key)]; ok { // looked up without copying the key
			*n++
		} else {
			count(a.cur.keys, string(r.Key))
		}
	}
	if r.Duration >= slowRequest {
		if len(a.slow) == maxSlow {
			a.slow = append(a.slow[:0], a.slow[1:]...)
		}
		a.slow = append(a.slow, SlowRequest{At: now, ClientID: r.ClientID, Command: r.Command, Key: string(r.Key), MS: float64(r.Duration.Microseconds()) / 1000})
	}
}

// count adds one to name's count, or to othersName's past maxTracked
// names. Counts are pointers so that a known name's is raised without a
// map assignment, which would copy a key made from bytes.
func count(m map[string]*int64, name string) {
	n, ok := m[name]
	if !ok {
		if len(m) >= maxTracked {
			name = othersName
		}
		if n, ok = m[name]; !ok {
			n = new(int64)
			m[name] = n
		}
	}
	*n++
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

func top(m map[string]*int64, secs float64) []Rate {
	out := make([]Rate, 0, len(m))
	for name, n := range m {
		out = append(out, Rate{Name: name, PerSecond: float64(*n) / secs})
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
