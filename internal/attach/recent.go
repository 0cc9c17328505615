package attach

import (
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/statestore"
)

// recent remembers the requests of the last while by requester and
// correlation data, with their replies, as the SDKs' command executors
// do: a request the broker delivers again (QoS 1, after a lost
// connection) is not executed again, and gets the first one's reply.
// Remembered in this process only: see the README on attach mode.
type recent struct {
	mu    sync.Mutex
	m     map[string]*answer
	order []expiring // answered entries in the order they expire
}

type answer struct {
	done    bool
	payload []byte
	version hlc.Timestamp
	waiting []*work // deliveries waiting for the reply, the first included
}

type expiring struct {
	key string
	at  time.Time
}

const (
	keepAnswers = time.Minute // for a request without a message expiry
	maxAnswers  = 100_000     // past it the oldest answers are forgotten
)

func newRecent() *recent { return &recent{m: map[string]*answer{}} }

// remembered reports whether r can be told apart from other requests:
// one with a reply to give, and correlation data (the SDKs send 16 bytes).
func remembered(r *statestore.Request) bool {
	return r.ResponseTopic != "" && r.QoS > 0 && len(r.CorrelationData) > 0
}

func keyOf(r *statestore.Request) string { return r.ClientID + "\x00" + string(r.CorrelationData) }

// join records w's request. first says it is new (to be executed); else,
// if it was answered already, the answer is returned to send again, and
// if not, w waits for it.
func (c *recent) join(r *statestore.Request, w *work) (first bool, done *answer) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := keyOf(r)
	e := c.m[k]
	switch {
	case e == nil:
		c.m[k] = &answer{waiting: []*work{w}}
		return true, nil
	case e.done:
		return false, e
	}
	e.waiting = append(e.waiting, w)
	return false, nil
}

// answer records r's reply and returns the deliveries waiting for it.
func (c *recent) answer(r *statestore.Request, payload []byte, version hlc.Timestamp) []*work {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := keyOf(r)
	e := c.m[k]
	if e == nil || e.done {
		return []*work{{r: r}} // forgotten meanwhile: this request's own
	}
	e.done, e.payload, e.version = true, payload, version
	waiting := e.waiting
	e.waiting = nil
	keep := keepAnswers
	if r.MessageExpiry > 0 {
		// The broker drops an expired request: no copy comes later.
		keep = time.Duration(r.MessageExpiry)*time.Second + time.Second
	}
	c.order = append(c.order, expiring{k, time.Now().Add(keep)})
	for len(c.order) > maxAnswers {
		c.forget()
	}
	return waiting
}

// expire forgets the answers whose time is up. The order is by time of
// answer, not of expiry: an answer whose time is shorter than one before
// it is forgotten with that one, later than due (a minute at most).
func (c *recent) expire(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.order) > 0 && !c.order[0].at.After(now) {
		c.forget()
	}
}

func (c *recent) forget() {
	delete(c.m, c.order[0].key)
	c.order[0] = expiring{}
	c.order = c.order[1:]
}
