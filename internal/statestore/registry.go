package statestore

import (
	"slices"
	"sync"
	"sync/atomic"

	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/policy"
)

// observer is one connection's KEYNOTIFY registrations: exact keys and
// glob patterns. They belong to the connection that made them: they end
// when it disconnects, and a new connection of the same client starts from
// none.
type observer struct {
	clientID    string
	conn        uint64
	topicPrefix string        // NotifyClientPrefix(clientID), computed once
	grant       *policy.Grant // what the connection may read; nil: everything
	sink        Notifier      // a gateway client's; nil: the transport delivers
	// Registrations, with the version after which each has delivered
	// every change it matches (live from registration, or replayed from
	// its SINCE): a later SINCE replay skips what they delivered.
	keys     map[string]regFrom
	patterns map[string]patternFrom
	bytes    int // of the keys and patterns registered (see maxRegistrationBytes)
	// unanchored counts the patterns without a literal prefix (see
	// maxUnanchored).
	unanchored int
}

// Every change is matched against every pattern without a literal prefix
// ("*x*"), on the goroutine that applies the log: 20,000 of them, none
// matching, took durable SETs from 30,000 a second to 1,200 (found by
// review). They are bounded per connection and per node; patterns with a
// prefix are looked up by it and cost only where they may match.
const (
	maxUnanchoredPerConn = 100
	maxUnanchored        = 1000
)

// maxRegistrationBytes bounds the bytes of keys and patterns one
// connection registers: with --max-keynotify registrations of up to
// --max-key-length bytes each, one connection could hold gigabytes.
const maxRegistrationBytes = 4 << 20

type patternFrom struct {
	m *glob.Matcher
	regFrom
}

// regFrom is where a registration starts: from, the version after which
// it has delivered every change it matches; since says from is the
// version a KEYNOTIFY ... SINCE named, the last the client saw. A change
// at or below it that reaches this node only after the registration (its
// group's changes come here later than the write's reply went to the
// client, from another member) is then not notified live: the client has
// it (found by TestSinceBeforeTheFirstWatch in a cluster: the SET whose
// reply gave the SINCE version was notified after the registration).
// After a plain registration, every change that comes is notified.
type regFrom struct {
	from  hlc.Timestamp
	since bool
}

// live reports whether a change at v that comes after the registration
// is notified by it.
func (f regFrom) live(v hlc.Timestamp) bool { return !f.since || f.from.Compare(v) < 0 }

func (o *observer) count() int { return len(o.keys) + len(o.patterns) }

// patternReg is one pattern registration, indexed by the pattern's literal
// prefix; matching runs in time linear in the key.
type patternReg struct {
	pattern string
	m       *glob.Matcher
	o       *observer
}

// registry maps keys and patterns to the connections observing them. Looking
// up the observers of a changed key costs one map lookup for the exact key
// and one per distinct literal-prefix length of the registered patterns:
// it does not grow with the number of stored keys, nor with the number of
// patterns whose prefixes do not match.
type registry struct {
	mu         sync.RWMutex
	byKey      map[string][]*observer
	byClient   map[string]*observer
	byPrefix   map[string][]patternReg // literal prefix → patterns
	prefixLens map[int]int             // prefix length → patterns with it
	lens       []int                   // the keys of prefixLens, sorted
	active     *atomic.Int64
}

func newRegistry(active *atomic.Int64) *registry {
	return &registry{
		byKey:      map[string][]*observer{},
		byClient:   map[string]*observer{},
		byPrefix:   map[string][]patternReg{},
		prefixLens: map[int]int{},
		active:     active,
	}
}

// observerFor returns the observer of clientID on conn, creating it (and
// dropping an older connection's).
func (r *registry) observerFor(clientID string, conn uint64, grant *policy.Grant, sink Notifier) *observer {
	o := r.byClient[clientID]
	if o != nil && o.conn != conn {
		// Registrations of an earlier connection that has not yet been
		// reported closed end now.
		r.dropLocked(o)
		o = nil
	}
	if o == nil {
		o = &observer{clientID: clientID, conn: conn, topicPrefix: NotifyClientPrefix(clientID), keys: map[string]regFrom{}, patterns: map[string]patternFrom{}}
		r.byClient[clientID] = o
	}
	o.grant, o.sink = grant, sink
	return o
}

// add registers for key (or, with a compiled pattern m, every key matching
// it); repeating it is harmless. It refuses a new registration beyond max
// per connection (0: no limit). A registration from a connection older
// than the client's current one is ignored: that connection is on its way
// out.
func (r *registry) add(clientID string, conn uint64, grant *policy.Grant, sink Notifier, key []byte, m *glob.Matcher, from regFrom, max int) bool {
	pattern := m != nil
	r.mu.Lock()
	defer r.mu.Unlock()
	if o := r.byClient[clientID]; o != nil && conn < o.conn {
		return true
	}
	o := r.observerFor(clientID, conn, grant, sink)
	k := string(key)
	_, haveKey := o.keys[k]
	_, havePattern := o.patterns[k]
	if !pattern && haveKey || pattern && havePattern {
		return true
	}
	if max > 0 && o.count() >= max || o.bytes+len(k) > maxRegistrationBytes {
		return false
	}
	if pattern && len(m.Prefix()) == 0 && (o.unanchored >= maxUnanchoredPerConn || r.prefixLens[0] >= maxUnanchored) {
		return false
	}
	o.bytes += len(k)
	if pattern {
		o.patterns[k] = patternFrom{m, from}
		r.linkPattern(o, k, m)
	} else {
		o.keys[k] = from
		r.byKey[k] = append(r.byKey[k], o)
	}
	r.active.Add(1)
	return true
}

// remove ends one registration and reports whether there was one.
func (r *registry) remove(clientID string, conn uint64, key []byte, pattern bool) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.byClient[clientID]
	if o == nil || o.conn != conn {
		return false
	}
	k := string(key)
	if pattern {
		if _, ok := o.patterns[k]; !ok {
			return false
		}
		delete(o.patterns, k)
		r.unlinkPattern(o, k)
	} else {
		if _, ok := o.keys[k]; !ok {
			return false
		}
		delete(o.keys, k)
		r.unlinkKey(k, o)
	}
	o.bytes -= len(k)
	r.active.Add(-1)
	if o.count() == 0 {
		delete(r.byClient, clientID)
	}
	return true
}

// holds reports whether clientID's connection conn has registrations.
func (r *registry) holds(clientID string, conn uint64) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	o := r.byClient[clientID]
	return o != nil && o.conn == conn && o.count() > 0
}

// delivered reports whether conn's registrations have already delivered
// the change of key at version v (one of them matches key and was in force,
// live or by replay, when v was applied).
func (r *registry) delivered(clientID string, conn uint64, key []byte, v hlc.Timestamp) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	o := r.byClient[clientID]
	if o == nil || o.conn != conn {
		return false
	}
	if f, ok := o.keys[string(key)]; ok && f.from.Compare(v) < 0 {
		return true
	}
	for _, p := range o.patterns {
		if p.from.Compare(v) < 0 && p.m.Match(key) {
			return true
		}
	}
	return false
}

// dropConn ends every registration made on conn.
func (r *registry) dropConn(clientID string, conn uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if o := r.byClient[clientID]; o != nil && o.conn == conn {
		r.dropLocked(o)
	}
}

// revoke applies a new grant to conn's registrations: exact keys it may no
// longer read end; patterns stay, and only deliver what the grant allows.
func (r *registry) revoke(clientID string, conn uint64, grant *policy.Grant) {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.byClient[clientID]
	if o == nil || o.conn != conn {
		return
	}
	o.grant = grant
	for k := range o.keys {
		if !grant.CanAccess([]byte(k), policy.Read) {
			delete(o.keys, k)
			r.unlinkKey(k, o)
			o.bytes -= len(k)
			r.active.Add(-1)
		}
	}
	if o.count() == 0 {
		delete(r.byClient, clientID)
	}
}

func (r *registry) dropLocked(o *observer) {
	for k := range o.keys {
		r.unlinkKey(k, o)
	}
	for p := range o.patterns {
		r.unlinkPattern(o, p)
	}
	r.active.Add(-int64(o.count()))
	delete(r.byClient, o.clientID)
}

// unlinkKey removes o from the observers of k, copying on write: a slice
// handed out by lookup is never modified.
func (r *registry) unlinkKey(k string, o *observer) {
	old := r.byKey[k]
	list := make([]*observer, 0, len(old))
	for _, x := range old {
		if x != o {
			list = append(list, x)
		}
	}
	if len(list) == 0 {
		delete(r.byKey, k)
	} else {
		r.byKey[k] = list
	}
}

func (r *registry) linkPattern(o *observer, pattern string, m *glob.Matcher) {
	prefix := m.Prefix()
	p := string(prefix)
	r.byPrefix[p] = append(slices.Clip(r.byPrefix[p]), patternReg{pattern: pattern, m: m, o: o})
	if r.prefixLens[len(prefix)] == 0 {
		r.lens = append(r.lens, len(prefix))
		slices.Sort(r.lens)
	}
	r.prefixLens[len(prefix)]++
	if len(prefix) == 0 {
		o.unanchored++
	}
}

func (r *registry) unlinkPattern(o *observer, pattern string) {
	prefix := glob.Literal([]byte(pattern))
	p := string(prefix)
	old := r.byPrefix[p]
	list := make([]patternReg, 0, len(old))
	for _, x := range old {
		if x.o != o || x.pattern != pattern {
			list = append(list, x)
		}
	}
	if len(list) == 0 {
		delete(r.byPrefix, p)
	} else {
		r.byPrefix[p] = list
	}
	if len(prefix) == 0 {
		o.unanchored--
	}
	if r.prefixLens[len(prefix)]--; r.prefixLens[len(prefix)] == 0 {
		delete(r.prefixLens, len(prefix))
		r.lens = slices.DeleteFunc(slices.Clone(r.lens), func(n int) bool { return n == len(prefix) })
	}
}

// lookup appends to out the observers of key, each once, whose grant lets
// them read it.
// sinks appends the gateway sinks of every observer to out.
func (r *registry) sinks(out []Notifier) []Notifier {
	r.mu.RLock()
	defer r.mu.RUnlock()
	for _, o := range r.byClient {
		if o.sink != nil {
			out = append(out, o.sink)
		}
	}
	return out
}

func (r *registry) lookup(key []byte, v hlc.Timestamp, out []*observer) []*observer {
	r.mu.RLock()
	defer r.mu.RUnlock()
	for _, o := range r.byKey[string(key)] {
		if o.keys[string(key)].live(v) && o.grant.CanAccess(key, policy.Read) {
			out = append(out, o)
		}
	}
	for _, n := range r.lens {
		if n > len(key) {
			break
		}
		for _, pr := range r.byPrefix[string(key[:n])] {
			if !pr.m.Match(key) || slices.Contains(out, pr.o) || !pr.o.patterns[pr.pattern].live(v) || !pr.o.grant.CanAccess(key, policy.Read) {
				continue
			}
			out = append(out, pr.o)
		}
	}
	return out
}
