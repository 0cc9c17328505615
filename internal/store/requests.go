package store

import "github.com/google/btree"

// Remembered requests: a command may carry the id of the request it
// serves (Command.Request) and how long to remember it (Command.Keep).
// Applying a command whose request is remembered changes nothing and
// returns the first execution's result: a request delivered twice, to
// the same process or to another (an attached process's shared
// subscription, after the first died before acknowledging it), is
// executed once, on every replica alike, across restarts and leader
// changes. This is the client-session table of Ongaro's thesis (section
// 6.3), kept per request rather than per client: MQTT requesters do not
// number their requests, they tell them apart by correlation data.

// remembered is one request's record.
type remembered struct {
	id  string // the request's id (Command.Request)
	key []byte // the command's key: a split sends the record with it
	at  int64  // forgotten once a command's Now reaches it (unix ms)
	res Result
}

// lessDue orders records by when they are due, then by id.
func lessDue(a, b *remembered) bool {
	if a.at != b.at {
		return a.at < b.at
	}
	return a.id < b.id
}

// MaxRemembered bounds the requests one store remembers: past it, those
// due first are forgotten first. A requester retries within its
// request's message expiry (the SDKs' command timeout, 10 s by default),
// so at 6,500 remembered writes a second every retry still finds its
// record; the bound holds memory to some 20 MiB per store.
const MaxRemembered = 1 << 16

// forgetPerCommand bounds how many due records a command's apply forgets:
// at most one is added per command, so the table still shrinks, and no
// apply pays for a long pause's backlog at once.
const forgetPerCommand = 8

// requestTable holds a store's remembered requests: in a tree by when
// they are due, which clones copy-on-write with the store, and by id in
// a map for the lookup every write with a request makes (a walk down
// the tree was 3 % of an attached process's CPU under SET load). A clone
// has no map until it needs one.
type requestTable struct {
	byID  map[string]*remembered
	byDue *btree.BTreeG[*remembered]
}

func newRequestTable() requestTable {
	return requestTable{byID: map[string]*remembered{}, byDue: btree.NewG(degree, lessDue)}
}

func (t *requestTable) clone() requestTable { return requestTable{byDue: t.byDue.Clone()} }

func (t *requestTable) len() int { return t.byDue.Len() }

// index returns the map by id, made from the tree in a clone.
func (t *requestTable) index() map[string]*remembered {
	if t.byID == nil {
		t.byID = make(map[string]*remembered, t.byDue.Len())
		t.byDue.Ascend(func(r *remembered) bool {
			t.byID[r.id] = r
			return true
		})
	}
	return t.byID
}

// lookup returns the live record of id at now.
func (t *requestTable) lookup(id []byte, now int64) (*remembered, bool) {
	if t.byDue.Len() == 0 {
		return nil, false
	}
	r, ok := t.index()[string(id)]
	if !ok || r.at <= now {
		return nil, false
	}
	return r, true
}

// add records r, replacing a record of the same id, and keeps the table
// within MaxRemembered.
func (t *requestTable) add(r *remembered) {
	idx := t.index()
	if old, ok := idx[r.id]; ok {
		t.byDue.Delete(old)
	}
	idx[r.id] = r
	t.byDue.ReplaceOrInsert(r)
	for t.byDue.Len() > MaxRemembered {
		t.forgetFirst()
	}
}

// forget drops up to max records due at or before now.
func (t *requestTable) forget(now int64, max int) {
	for range max {
		r, ok := t.byDue.Min()
		if !ok || r.at > now {
			return
		}
		t.forgetFirst()
	}
}

func (t *requestTable) forgetFirst() {
	if r, ok := t.byDue.DeleteMin(); ok {
		delete(t.index(), r.id)
	}
}

// Remembered returns how many requests the store remembers.
func (s *Store) Remembered() int { return s.requests.len() }

// applyRemembering applies c, or answers it from its request's record.
func (s *Store) applyRemembering(c *Command, events []Event) (Result, []Event) {
	if r, ok := s.requests.lookup(c.Request, c.Now); ok {
		res := r.res
		res.Repeated = true
		return res, events
	}
	res, events := s.apply(c, events)
	// A replaced value (Previous) is the old entry's bytes, never
	// changed: the record shares them.
	s.requests.add(&remembered{id: string(c.Request), key: append([]byte(nil), c.Key...), at: c.Now + max(c.Keep, 1), res: res})
	return res, events
}

// rememberedOf calls fn for every record, in the order they are due,
// until it returns false: what a snapshot holds.
func (s *Store) rememberedOf(fn func(*remembered) bool) { s.requests.byDue.Ascend(fn) }
