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

type dueRequest struct {
	at int64
	id string
}

func lessRequest(a, b *remembered) bool { return a.id < b.id }

func lessDue(a, b dueRequest) bool {
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

// requestTable holds a store's remembered requests, by id and by when
// they are due; both trees clone copy-on-write with the store.
type requestTable struct {
	byID  *btree.BTreeG[*remembered]
	byDue *btree.BTreeG[dueRequest]
}

func newRequestTable() requestTable {
	return requestTable{byID: btree.NewG(degree, lessRequest), byDue: btree.NewG(degree, lessDue)}
}

func (t requestTable) clone() requestTable {
	return requestTable{byID: t.byID.Clone(), byDue: t.byDue.Clone()}
}

func (t requestTable) len() int { return t.byID.Len() }

// lookup returns the live record of id at now.
func (t requestTable) lookup(id []byte, now int64) (*remembered, bool) {
	if t.byID.Len() == 0 {
		return nil, false
	}
	r, ok := t.byID.Get(&remembered{id: string(id)})
	if !ok || r.at <= now {
		return nil, false
	}
	return r, true
}

// add records r, replacing a record of the same id, and keeps the table
// within MaxRemembered.
func (t requestTable) add(r *remembered) {
	if old, ok := t.byID.ReplaceOrInsert(r); ok {
		t.byDue.Delete(dueRequest{old.at, old.id})
	}
	t.byDue.ReplaceOrInsert(dueRequest{r.at, r.id})
	for t.byID.Len() > MaxRemembered {
		t.forgetFirst()
	}
}

// forget drops up to max records due at or before now.
func (t requestTable) forget(now int64, max int) {
	for range max {
		d, ok := t.byDue.Min()
		if !ok || d.at > now {
			return
		}
		t.forgetFirst()
	}
}

func (t requestTable) forgetFirst() {
	d, ok := t.byDue.DeleteMin()
	if ok {
		t.byID.Delete(&remembered{id: d.id})
	}
}

// Remembered returns how many requests the store remembers.
func (s *Store) Remembered() int { return s.requests.len() }

// applyRemembering applies c, or answers it from its request's record.
func (s *Store) applyRemembering(c *Command, events []Event) (Result, []Event) {
	if r, ok := s.requests.lookup(c.Request, c.Now); ok {
		if c.Version.Compare(s.maxVersion) > 0 {
			s.maxVersion = c.Version
		}
		res := r.res
		res.Repeated = true
		return res, events
	}
	res, events := s.apply(c, events)
	rec := &remembered{id: string(c.Request), key: append([]byte(nil), c.Key...), at: c.Now + max(c.Keep, 1), res: res}
	if res.HadPrevious {
		// The replaced value's bytes are the old entry's, never changed:
		// shared, not copied.
		rec.res.Previous = res.Previous
	}
	s.requests.add(rec)
	return res, events
}

// rememberedOf calls fn for every record, in id order, until it returns
// false: what a snapshot holds.
func (s *Store) rememberedOf(fn func(*remembered) bool) { s.requests.byID.Ascend(fn) }
