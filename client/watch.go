package client

import (
	"context"
	"encoding/hex"
	"strings"
	"sync"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/resp"
)

// Event is a change to a watched key.
type Event struct {
	Key     []byte
	Deleted bool   // a DELETE (explicit or by expiry); otherwise a SET
	Value   []byte // the new value of a SET
	Version Version
	// Resync marks an event made up by the client after a reconnect: the
	// key changed (to this state) while notifications could not arrive.
	Resync bool
}

// Watch is a registration for changes to one key, or to every key matching
// a pattern.
type Watch struct {
	c       *Client
	key     string // a key or, for pattern watches, the pattern
	pattern bool
	events  chan Event

	mu     sync.Mutex
	queue  []Event
	signal chan struct{}
	done   chan struct{}
	once   sync.Once
}

// Events returns the channel of changes. It is closed by Stop or Close.
func (w *Watch) Events() <-chan Event { return w.events }

// keyWatch is the client's state for one watched key or pattern.
type keyWatch struct {
	watchers []*Watch
	last     Version // the last version seen, to resume from
	deleted  bool
	// holding is set while a reconnect registers the key afresh and reads
	// its state: live notifications wait in held meanwhile, so that the
	// Resync event (the state read) comes before them and a notification
	// that beat the read does not hide the gap (see resyncOnce).
	holding bool
	held    []Event
}

// take makes e the key's resume point (a resync always; a change if it is
// newer) and appends the key's watchers to ws.
func (kw *keyWatch) take(e Event, ws []*Watch) []*Watch {
	if e.Resync || e.Version.Compare(kw.last) > 0 {
		kw.last, kw.deleted = e.Version, e.Deleted
	}
	return append(ws, kw.watchers...)
}

// watchID keys c.watches: keys and patterns are separate registrations.
type watchID struct {
	key     string // a key or a pattern
	pattern bool
}

func (kw *keyWatch) closeAll() {
	for _, w := range kw.watchers {
		w.close()
	}
}

// Watch registers for changes to key (KEYNOTIFY). Events are queued for the
// caller without limit, so a slow reader loses nothing; Stop ends it. After
// a reconnect the registration is made again, resuming from the last change
// seen (KEYNOTIFY ... SINCE) so nothing is missed; a server that no longer
// has those changes gets a Resync event with the key's current state.
func (c *Client) Watch(ctx context.Context, key []byte) (*Watch, error) {
	return c.watch(ctx, key, false)
}

// WatchPattern registers for changes to every key matching pattern (a
// glob; the mqkv extension KEYNOTIFY ... PATTERN). It resumes after a
// reconnect like Watch; when it cannot, it reports nothing for the gap.
func (c *Client) WatchPattern(ctx context.Context, pattern []byte) (*Watch, error) {
	return c.watch(ctx, pattern, true)
}

func (c *Client) watch(ctx context.Context, key []byte, pattern bool) (*Watch, error) {
	w := &Watch{c: c, key: string(key), pattern: pattern, events: make(chan Event), signal: make(chan struct{}, 1), done: make(chan struct{})}
	id := watchID{w.key, pattern}
	c.regMu.Lock()
	defer c.regMu.Unlock()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, ErrClosed
	}
	go w.pump()
	kw := c.watches[id]
	first := kw == nil
	if first {
		kw = &keyWatch{}
		c.watches[id] = kw
	}
	kw.watchers = append(kw.watchers, w)
	c.mu.Unlock()
	if !first {
		return w, nil
	}
	if err := c.keyNotify(ctx, key, pattern, false, Version{}); err != nil {
		c.unwatch(w)
		return nil, err
	}
	if pattern {
		return w, nil
	}
	// Remember the state now, so a reconnect can tell whether the key
	// changed while notifications could not arrive.
	if v, err := c.Get(ctx, key); err == nil {
		c.mu.Lock()
		if kw.last.IsZero() && !kw.deleted {
			kw.last, kw.deleted = v.Version, !v.Found
		}
		c.mu.Unlock()
	}
	return w, nil
}

// Stop ends the watch; the last watch of a key sends KEYNOTIFY STOP.
func (w *Watch) Stop(ctx context.Context) error {
	c := w.c
	c.regMu.Lock()
	defer c.regMu.Unlock()
	if c.unwatch(w) {
		return c.keyNotify(ctx, []byte(w.key), w.pattern, true, Version{})
	}
	return nil
}

// unwatch removes w and reports whether it was its key's last watch.
func (c *Client) unwatch(w *Watch) (last bool) {
	id := watchID{w.key, w.pattern}
	c.mu.Lock()
	if kw := c.watches[id]; kw != nil {
		for i, x := range kw.watchers {
			if x == w {
				kw.watchers = append(kw.watchers[:i], kw.watchers[i+1:]...)
				break
			}
		}
		if len(kw.watchers) == 0 {
			delete(c.watches, id)
			last = true
		}
	}
	c.mu.Unlock()
	w.close()
	return last
}

func (w *Watch) close() { w.once.Do(func() { close(w.done) }) }

func (w *Watch) push(e Event) {
	w.mu.Lock()
	w.queue = append(w.queue, e)
	w.mu.Unlock()
	select {
	case w.signal <- struct{}{}:
	default:
	}
}

// pump moves queued events to the channel, so the MQTT receive path never
// waits for a slow reader.
func (w *Watch) pump() {
	defer close(w.events)
	for {
		w.mu.Lock()
		var next *Event
		if len(w.queue) > 0 {
			next = &w.queue[0]
		}
		w.mu.Unlock()
		if next == nil {
			select {
			case <-w.signal:
				continue
			case <-w.done:
				return
			}
		}
		select {
		case w.events <- *next:
			w.mu.Lock()
			w.queue = w.queue[1:]
			w.mu.Unlock()
		case <-w.done:
			return
		}
	}
}

func (c *Client) keyNotify(ctx context.Context, key []byte, pattern, stop bool, since Version) error {
	args := [][]byte{[]byte("KEYNOTIFY"), key}
	if pattern {
		args = append(args, []byte("PATTERN"))
	}
	if stop {
		args = append(args, []byte("STOP"))
	}
	if !since.IsZero() {
		args = append(args, []byte("SINCE"), []byte(since.String()))
	}
	r, err := c.request(ctx, args)
	if err != nil {
		return err
	}
	if (r.Kind == resp.SimpleString && string(r.Str) == "OK") || (stop && r.Kind == resp.Integer && r.Int == 0) {
		return nil
	}
	return unexpected("KEYNOTIFY", r.Value)
}

// onNotification dispatches a pushed notification to the key's watchers.
func (c *Client) onNotification(p *paho.Publish) {
	i := strings.LastIndexByte(p.Topic, '/')
	key, err := hex.DecodeString(p.Topic[i+1:])
	if err != nil {
		return
	}
	v, err := resp.ParseReply(p.Payload)
	if err != nil || v.Kind != resp.Array || len(v.Elems) < 2 || string(v.Elems[0].Str) != "NOTIFY" {
		return
	}
	e := Event{Key: key}
	if ts := userProperty(p, "__ts"); ts != "" {
		e.Version, _ = hlc.Parse(ts)
	}
	switch {
	case string(v.Elems[1].Str) == "DELETE" && len(v.Elems) == 2:
		e.Deleted = true
	case string(v.Elems[1].Str) == "SET" && len(v.Elems) == 4:
		e.Value = v.Elems[3].Str
	default:
		return
	}
	c.deliver(string(key), e)
}

// deliver hands e to the watchers of its key and of every pattern
// matching it. A watch's resume point only moves forward: a change older
// than one already seen (a replay overlapping live notifications) does not
// take it back.
func (c *Client) deliver(key string, e Event) {
	c.mu.Lock()
	var ws []*Watch
	if kw := c.watches[watchID{key, false}]; kw != nil {
		if kw.holding {
			kw.held = append(kw.held, e)
		} else {
			ws = kw.take(e, ws)
		}
	}
	if !e.Resync { // a key's resync is its own; patterns resume by themselves
		for id, kw := range c.watches {
			if id.pattern && glob.Match([]byte(id.key), e.Key) {
				if e.Version.Compare(kw.last) > 0 {
					kw.last = e.Version
				}
				ws = append(ws, kw.watchers...)
			}
		}
	}
	c.mu.Unlock()
	for _, w := range ws {
		w.push(e)
	}
}

// resync registers a watched key or pattern again after a reconnect (of
// connection gen). It asks for the changes since the last one seen; if the
// server no longer has them (or is not mqkv), it registers afresh and, for
// a key, reports its current state as a Resync event when it changed
// meanwhile. A failure is retried while the connection lasts: a watch
// must not go silent.
func (c *Client) resync(id watchID, gen uint64) {
	for attempt := 0; c.current(gen); attempt++ {
		if c.resyncOnce(id, gen) || !c.pause(attempt) {
			return
		}
	}
}

// resyncOnce is one attempt of resync; it reports whether it is done.
func (c *Client) resyncOnce(id watchID, gen uint64) bool {
	c.regMu.Lock()
	defer c.regMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.Timeout)
	defer cancel()
	c.mu.Lock()
	kw := c.watches[id]
	var since Version
	var deleted bool
	if kw != nil {
		since, deleted = kw.last, kw.deleted
	}
	c.mu.Unlock()
	if kw == nil {
		return true // stopped meanwhile
	}
	key, pattern := id.key, id.pattern
	if !since.IsZero() && c.keyNotify(ctx, []byte(key), pattern, false, since) == nil {
		return true // the server replays what was missed
	}
	if pattern {
		if err := c.keyNotify(ctx, []byte(key), pattern, false, Version{}); err != nil {
			c.log.Warn("watch: registering again after reconnect failed; retrying", "key", key, "error", err)
			return false
		}
		return true
	}
	// Registered afresh, the key's notifications start from now: what
	// changed since the last one seen is told by one Resync event with the
	// state read after registering. Live notifications are held until
	// then, or one newer than the read would hide the gap (found by the
	// rolling upgrade test: a change lost without a resync).
	c.mu.Lock()
	kw.holding = true
	c.mu.Unlock()
	if err := c.keyNotify(ctx, []byte(key), pattern, false, Version{}); err != nil {
		c.unhold(kw, key, false, Value{}, since, deleted)
		c.log.Warn("watch: registering again after reconnect failed; retrying", "key", key, "error", err)
		return false
	}
	// The state must be read: without it the gap would go untold. A
	// failed read is tried again while the connection lasts; the next
	// connection's resync starts again from the same point.
	for attempt := 0; ; attempt++ {
		v, err := c.getWithin(c.cfg.Timeout, key)
		if err == nil {
			c.unhold(kw, key, true, v, since, deleted)
			return true
		}
		if !c.current(gen) || !c.pause(attempt) {
			c.unhold(kw, key, false, Value{}, since, deleted)
			return true
		}
	}
}

func (c *Client) getWithin(d time.Duration, key string) (Value, error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return c.Get(ctx, []byte(key))
}

// unhold ends a resync's hold on kw. With the key's state read (v), a
// Resync event comes first if it changed since the last change seen
// (since, deleted), then the held notifications newer than it. Without
// it, the held notifications are dropped and the resume point stays
// where it was, so the next resync covers them.
func (c *Client) unhold(kw *keyWatch, key string, read bool, v Value, since Version, deleted bool) {
	c.mu.Lock()
	defer c.mu.Unlock() // pushed under the lock: nothing overtakes them
	held := kw.held
	kw.holding, kw.held = false, nil
	if !read {
		return
	}
	after := since
	if (v.Found && v.Version.Compare(since) > 0) || (!v.Found && !deleted) {
		e := Event{Key: []byte(key), Resync: true, Deleted: !v.Found, Value: v.Value, Version: v.Version}
		for _, w := range kw.take(e, nil) {
			w.push(e)
		}
		after = v.Version
	}
	for _, e := range held {
		if e.Version.Compare(after) > 0 {
			for _, w := range kw.take(e, nil) {
				w.push(e)
			}
		}
	}
}
