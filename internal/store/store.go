// Package store is the state store's deterministic state machine: an ordered
// keyspace of versioned values with fencing tokens and an expiry index.
// Apply is a pure function of the command sequence; time and versions enter
// only inside commands, stamped by whoever proposes them. No I/O, no clock,
// no locks: callers serialise access (see internal/replica).
package store

import (
	"bytes"
	"hash/crc32"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/google/btree"

	"github.com/mqkv/mqkv/internal/hlc"
)

// Partitions is the fixed number of partitions keys hash into. Data placement
// in a cluster depends on it and on Partition: never change either.
const Partitions = 4096

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Partition returns the partition of a key: CRC-32C (Castagnoli) of the key
// bytes modulo Partitions.
func Partition(key []byte) uint16 {
	return uint16(crc32.Checksum(key, castagnoli) % Partitions)
}

// Entry is a stored key. A write replaces the entry, or changes it in
// place while no clone of its store shares it (see Store.gen): snapshots,
// copies and split stores never see later writes. The bytes of Key and
// Value are never modified: a caller may keep them, but must copy the
// Entry itself before the store's lock is let go.
type Entry struct {
	Key       []byte
	Value     []byte
	Version   hlc.Timestamp // set on every write that stores the key
	Fence     hlc.Timestamp // fencing token protecting the key; zero if none
	ExpiresAt int64         // unix ms deadline; 0 if the key does not expire
	gen       uint64        // the generation of the store that made it
}

// expired reports whether the entry is past its deadline at now (unix ms).
func (e *Entry) expired(now int64) bool { return e.ExpiresAt != 0 && e.ExpiresAt <= now }

func (e *Entry) size() int64 { return int64(len(e.Key) + len(e.Value)) }

// Op is the kind of a command.
type Op uint8

const (
	OpSet    Op = iota + 1 // store Value under Key (subject to Cond and fencing)
	OpDel                  // delete Key (subject to fencing)
	OpVDel                 // delete Key if its value equals Value (subject to fencing)
	OpExpire               // delete Key if its version is still Expected
	// OpAdd adds Delta to the signed 64-bit decimal integer Key holds, as
	// Redis's INCRBY: a key that does not exist counts as 0 and is
	// created. The number is written as Redis writes one ("-12", no sign
	// for a positive one, no leading zero), and only such a value is a
	// number (NotANumber otherwise); a sum beyond 64 bits is Overflow.
	OpAdd
	// OpIncr and OpDecr add Delta, read as an unsigned 64-bit number, to
	// the unsigned decimal number that follows Value in the key's value,
	// or take it away, as memcached's incr and decr do: the sum wraps
	// around at 2^64, the difference stops at 0, a key that does not
	// exist is Missing, and one whose value does not begin with Value is
	// NotApplied (Value is what a gateway keeps before the number: the
	// memcached endpoint's flags).
	OpIncr
	OpDecr
	// OpAppend adds Value to the end of the key's value, as Redis's APPEND
	// and memcached's append: a key that does not exist is created with
	// Value (Cond Always, Redis's) or is Missing (Cond IfExists,
	// memcached's).
	OpAppend
	// OpPrepend puts Value[Delta:] into the key's value after its first
	// Delta bytes, which must be Value[:Delta] (NotApplied otherwise), as
	// memcached's prepend does after the flags the endpoint keeps there;
	// with Cond NX, at its start, on condition that the value does not
	// begin with Value[:Delta] (no flags there). A key that does not
	// exist is Missing.
	OpPrepend
	// OpTouch gives the key a new time to live (TTL; 0: none) and keeps
	// its value, as memcached's touch and Redis's PEXPIRE and PERSIST; a
	// key that does not exist is Missing. It is a write of the value as
	// it is: a new version, a SET for observers, as when the endpoint did
	// it with a SET on condition.
	OpTouch
)

// Stores reports whether the op writes a value (SET, the arithmetic and
// the value ops), which a full disk refuses; deletes it lets through.
func (o Op) Stores() bool { return o == OpSet || o.Arithmetic() || o.Changes() }

// Arithmetic reports whether the op is OpAdd, OpIncr or OpDecr.
func (o Op) Arithmetic() bool { return o == OpAdd || o == OpIncr || o == OpDecr }

// Changes reports whether the op is one of the value ops that change what
// a key holds in place: OpAppend, OpPrepend, OpTouch.
func (o Op) Changes() bool { return o == OpAppend || o == OpPrepend || o == OpTouch }

// keepsExpiry reports whether the op keeps the key's expiry, taking no
// TTL: a batch holds its Delta where it holds a SET's TTL.
func (o Op) keepsExpiry() bool { return o.Arithmetic() || o == OpAppend || o == OpPrepend }

// Cond is the condition of a SET.
type Cond uint8

const (
	Always Cond = iota // set unconditionally
	NX                 // only if the key does not exist
	NEX                // only if the key does not exist or holds the same value
	// IfVersion applies a SET or DEL only if the key's version is
	// Expected; a zero Expected means "only if the key does not exist"
	// (the mqkv extension VER, optimistic concurrency).
	IfVersion
	// IfExists applies a SET or OpAppend only if the key exists: Redis's
	// XX, memcached's replace and append.
	IfExists
)

// Command is one state change. The proposer fills in Version (a fresh HLC)
// and Now (its wall clock); every replica applies it to the same effect.
type Command struct {
	Op       Op
	Cond     Cond
	Key      []byte
	Value    []byte
	Version  hlc.Timestamp // the new key version (SET), the event version (deletes)
	Now      int64         // proposer's wall clock, unix ms: decides which keys have expired
	TTL      int64         // SET: milliseconds to live from Now; 0 for no expiry
	Fence    hlc.Timestamp // the request's fencing token; zero if it carried none
	Expected hlc.Timestamp // OpExpire: the version the key must still hold
	// Delta is what OpAdd, OpIncr and OpDecr add or take away (for OpIncr
	// and OpDecr, an unsigned number's bits), and how much of Value an
	// OpPrepend keeps first. These ops and OpAppend keep the key's expiry
	// and take no TTL: a batch holds Delta where it holds a SET's TTL.
	Delta int64
	// Request, if set, identifies the request the command serves; the
	// store remembers its result for Keep milliseconds from Now, and a
	// command of the same request meanwhile is answered with it, not
	// applied (see requests.go).
	Request []byte
	Keep    int64
}

// Outcome says what a command did.
type Outcome uint8

const (
	Applied       Outcome = iota // the change was made
	NotApplied                   // SET condition failed, or VDEL value differed
	Missing                      // DEL, VDEL or Expire found no (live) key
	FenceRequired                // the key is fenced and the command carried no token
	FenceLower                   // the command's token is lower than the key's
	QuotaExceeded                // storing the key would exceed a limit
	NotANumber                   // an arithmetic op found a value that is not its kind of number
	Overflow                     // OpAdd's sum does not fit in 64 bits
)

// Result is the outcome of one command.
type Result struct {
	Outcome Outcome
	// Version is the key's version after a SET (applied or not), and the
	// deleted entry's version after a delete. Zero when there is no key.
	Version hlc.Timestamp
	// Previous is the value an applied SET replaced; HadPrevious is false
	// when the key did not exist (for SET ... GET). After an applied
	// arithmetic op, Previous is the value it stored instead (HadPrevious
	// true): what its caller answers with.
	Previous    []byte
	HadPrevious bool
	// Repeated says the command's request had been executed already:
	// this is that execution's result, and nothing changed.
	Repeated bool
}

// EventKind is the kind of a change event.
type EventKind uint8

const (
	EventSet EventKind = iota + 1
	EventDelete
)

// Event is a change to a key, for observers.
type Event struct {
	Kind    EventKind
	Key     []byte
	Value   []byte        // EventSet only
	Version hlc.Timestamp // the new version (SET) or the command's version (DELETE)
}

// Limits bound what the store holds. Zero means unlimited.
type Limits struct {
	MaxKeys  int
	MaxBytes int64 // sum of key and value lengths
}

type expiryItem struct {
	at  int64
	key []byte
}

func lessEntry(a, b *Entry) bool { return bytes.Compare(a.Key, b.Key) < 0 }

func lessExpiry(a, b expiryItem) bool {
	if a.at != b.at {
		return a.at < b.at
	}
	return bytes.Compare(a.key, b.key) < 0
}

const degree = 32

// Store is the keyspace of one replica group. The zero value is not usable;
// use New.
type Store struct {
	keys *btree.BTreeG[*Entry]
	// The same entries by key, for point lookups: a walk down the tree
	// (about 14 key comparisons, most of them cache misses, at 10,000
	// keys) was 4 % of a GET's CPU. nil in a clone, which the tree serves.
	index      map[string]*Entry
	expiry     *btree.BTreeG[expiryItem]
	limits     Limits
	bytes      int64
	serverKeys int // of them, under ReservedPrefix
	maxVersion hlc.Timestamp
	// gen is this store's generation, unique among stores, new after
	// every Clone, Split and Merge: an entry of the current generation is
	// seen by this store alone, so a write may change it in place instead
	// of replacing it in the tree (a walk down the tree, 1.8 µs of a
	// durable SET's 26 at 10,000 keys).
	gen uint64
	// requests are the requests remembered (see requests.go).
	requests requestTable
}

// generations hands out Store.gen.
var generations atomic.Uint64

// New returns an empty store.
func New(limits Limits) *Store {
	return &Store{
		keys:     btree.NewG(degree, lessEntry),
		index:    map[string]*Entry{},
		expiry:   btree.NewG(degree, lessExpiry),
		limits:   limits,
		gen:      generations.Add(1),
		requests: newRequestTable(),
	}
}

// SetLimits changes the limits; entries already stored stay.
func (s *Store) SetLimits(l Limits) { s.limits = l }

// Len returns the number of stored keys, expired or not.
func (s *Store) Len() int { return s.keys.Len() }

// ServerKeys returns how many of the stored keys are the server's own
// (under ReservedPrefix: retained messages, MQTT sessions): users are
// shown Len - ServerKeys as their keys.
func (s *Store) ServerKeys() int { return s.serverKeys }

// Bytes returns the total length of stored keys and values.
func (s *Store) Bytes() int64 { return s.bytes }

// MaxVersion returns the greatest version any applied command carried, so a
// clock can be restored above it after a restart.
func (s *Store) MaxVersion() hlc.Timestamp { return s.maxVersion }

// Clone returns a copy-on-write snapshot: cheap now, and unaffected by later
// changes to s. The clone and s may be used from different goroutines.
func (s *Store) Clone() *Store {
	c := *s
	c.keys = s.keys.Clone()
	c.index = nil // copying it would make Clone cost O(keys)
	c.expiry = s.expiry.Clone()
	c.requests = s.requests.clone()
	c.gen = generations.Add(1)
	s.gen = generations.Add(1) // the entries are shared now
	return &c
}

func (s *Store) lookup(key []byte) *Entry {
	if s.index != nil {
		return s.index[string(key)] // no allocation: the conversion is for the lookup only
	}
	// The search item escapes (the tree compares through a function
	// value): a pooled one spares a GET its only allocation here.
	probe := probes.Get().(*Entry)
	probe.Key = key
	e, ok := s.keys.Get(probe)
	probe.Key = nil
	probes.Put(probe)
	if !ok {
		return nil
	}
	return e
}

var probes = sync.Pool{New: func() any { return new(Entry) }}

// sameBytes reports whether a and b are the same bytes in memory, not
// only equal.
func sameBytes(a, b []byte) bool {
	return len(a) == len(b) && unsafe.SliceData(a) == unsafe.SliceData(b)
}

// keyString is e's key as a map key, sharing its bytes, which are never
// modified and hold nothing else (see set): the index keeps no value
// alive.
func keyString(e *Entry) string { return unsafe.String(unsafe.SliceData(e.Key), len(e.Key)) }

// Expired returns the version of key's entry if the entry is still stored
// but past its deadline at now: it awaits its Expire command.
func (s *Store) Expired(key []byte, now int64) (hlc.Timestamp, bool) {
	if at, ok := s.NextExpiry(); !ok || at > now {
		// Nothing is past its deadline: asked before every write, this
		// spares the key's search in the common case.
		return hlc.Timestamp{}, false
	}
	e := s.lookup(key)
	if e == nil || !e.expired(now) {
		return hlc.Timestamp{}, false
	}
	return e.Version, true
}

// Get returns the live entry for key at now (unix ms). An entry past its
// deadline is absent even before its Expire command is applied.
func (s *Store) Get(key []byte, now int64) (*Entry, bool) {
	return s.GetBy(key, func() int64 { return now })
}

// GetBy is Get with the time read from now only for a key that expires:
// most do not, and a clock read here costs a GET about a twentieth of its
// server CPU.
func (s *Store) GetBy(key []byte, now func() int64) (*Entry, bool) {
	e := s.lookup(key)
	if e == nil || e.ExpiresAt != 0 && e.expired(now()) {
		return nil, false
	}
	return e, true
}

// Ascend calls fn for each live entry with key >= from, in key order, until
// fn returns false.
func (s *Store) Ascend(from []byte, now int64, fn func(*Entry) bool) {
	s.keys.AscendGreaterOrEqual(&Entry{Key: from}, func(e *Entry) bool {
		if e.expired(now) {
			return true
		}
		return fn(e)
	})
}

// Entries calls fn for each stored entry with key >= from, expired or
// not, in key order, until fn returns false: what a snapshot holds.
func (s *Store) Entries(from []byte, fn func(*Entry) bool) {
	s.keys.AscendGreaterOrEqual(&Entry{Key: from}, fn)
}

// NextExpiry returns the earliest deadline in the store.
func (s *Store) NextExpiry() (int64, bool) {
	it, ok := s.expiry.Min()
	return it.at, ok
}

// Due calls fn, in deadline order, for up to max entries whose deadline is
// at or before now: the candidates for Expire commands.
func (s *Store) Due(now int64, max int, fn func(key []byte, version hlc.Timestamp)) {
	n := 0
	s.expiry.Ascend(func(it expiryItem) bool {
		if it.at > now || n >= max {
			return false
		}
		if e := s.lookup(it.key); e != nil {
			fn(e.Key, e.Version)
			n++
		}
		return true
	})
}

// Apply applies one command, appending the change events it causes to
// events. It is deterministic: the same commands in the same order leave
// every store in the same state with the same results.
func (s *Store) Apply(c *Command, events []Event) (Result, []Event) {
	if c.Version.Compare(s.maxVersion) > 0 {
		s.maxVersion = c.Version
	}
	s.requests.forget(c.Now, forgetPerCommand)
	if len(c.Request) > 0 {
		return s.applyRemembering(c, events)
	}
	return s.apply(c, events)
}

func (s *Store) apply(c *Command, events []Event) (Result, []Event) {
	stored := s.lookup(c.Key)
	cur := stored
	if cur != nil && cur.expired(c.Now) {
		// The key is logically gone; its Expire command may still be on
		// the way and will find a different version, or nothing.
		cur = nil
	}
	switch c.Op {
	case OpSet:
		return s.set(c, stored, cur, events)
	case OpAdd, OpIncr, OpDecr:
		return s.add(c, stored, cur, events)
	case OpAppend, OpPrepend, OpTouch:
		return s.change(c, stored, cur, events)
	case OpDel, OpVDel:
		if cur == nil {
			if c.Cond == IfVersion && !c.Expected.IsZero() {
				return Result{Outcome: NotApplied}, events
			}
			return Result{Outcome: Missing}, events
		}
		if o, ok := checkFence(cur, c.Fence); !ok {
			return Result{Outcome: o}, events
		}
		if c.Op == OpVDel && !bytes.Equal(cur.Value, c.Value) ||
			c.Cond == IfVersion && cur.Version != c.Expected {
			return Result{Outcome: NotApplied, Version: cur.Version}, events
		}
		s.remove(cur)
		return Result{Outcome: Applied, Version: cur.Version},
			append(events, Event{Kind: EventDelete, Key: cur.Key, Version: c.Version})
	case OpExpire:
		// Looks at the stored entry whatever its deadline: the point is
		// to remove exactly the version that expired.
		if stored == nil || stored.Version != c.Expected {
			return Result{Outcome: Missing}, events
		}
		s.remove(stored)
		return Result{Outcome: Applied, Version: stored.Version},
			append(events, Event{Kind: EventDelete, Key: stored.Key, Version: c.Version})
	}
	return Result{Outcome: NotApplied}, events
}

// set applies a SET; stored is the entry under the key (maybe expired), cur
// the live one (nil if absent or expired).
func (s *Store) set(c *Command, stored, cur *Entry, events []Event) (Result, []Event) {
	fence := c.Fence
	if cur != nil {
		if o, ok := checkFence(cur, c.Fence); !ok {
			return Result{Outcome: o}, events
		}
		if fence.IsZero() {
			fence = cur.Fence
		}
		switch c.Cond {
		case NX:
			return Result{Outcome: NotApplied, Version: cur.Version}, events
		case NEX:
			if !bytes.Equal(cur.Value, c.Value) {
				return Result{Outcome: NotApplied, Version: cur.Version}, events
			}
		case IfVersion:
			if cur.Version != c.Expected {
				return Result{Outcome: NotApplied, Version: cur.Version}, events
			}
		}
	} else if c.Cond == IfVersion && !c.Expected.IsZero() || c.Cond == IfExists {
		return Result{Outcome: NotApplied}, events // expected a key; there is none
	}
	size := int64(len(c.Key) + len(c.Value))
	if !s.fits(stored, size) {
		res := Result{Outcome: QuotaExceeded}
		if cur != nil {
			res.Version = cur.Version
		}
		return res, events
	}
	res := Result{Outcome: Applied, Version: c.Version}
	if cur != nil {
		res.Previous, res.HadPrevious = cur.Value, true
	} else if stored != nil {
		// The write replaces a value that expired before its Expire was
		// applied. The proposer adds that Expire ahead of a write when it
		// sees the expired key, but not when the value was set by an
		// entry not yet applied, or earlier in the same one. Observers
		// get its DELETE all the same (spec section 5.1), here.
		events = append(events, Event{Kind: EventDelete, Key: stored.Key, Version: expiredAt(stored.Version, c.Version)})
	}
	// The value is copied out of the command, so that the store never
	// aliases a log buffer. The key's bytes are the stored entry's, if
	// there is one (no entry's key is ever changed), or a copy: apart
	// from the value, so that an overwrite neither copies the key again
	// nor moves the index's key to a new buffer (a second search of the
	// map for each SET, the old value otherwise kept alive by it), and
	// so that the keys the index compares lie in small allocations,
	// close together, not each beside a value a cache miss away.
	key := c.Key
	if stored != nil {
		key = stored.Key
	} else {
		key = append(make([]byte, 0, len(key)), key...)
	}
	value := append(make([]byte, 0, len(c.Value)), c.Value...)
	next := Entry{
		Key:     key,
		Value:   value,
		Version: c.Version,
		Fence:   fence,
		gen:     s.gen,
	}
	if c.TTL > 0 {
		next.ExpiresAt = c.Now + c.TTL
	}
	var e *Entry
	if stored != nil && stored.gen == s.gen {
		// No clone shares it: changed in place, the tree left as it is
		// (the key, and so its place, is the same).
		// The index holds stored already, under the same key bytes.
		prev := *stored
		*stored = next
		e = stored
		s.account(&prev, e)
	} else {
		e = new(Entry)
		*e = next
		s.replace(stored, e)
	}
	return res, append(events, Event{Kind: EventSet, Key: e.Key, Value: e.Value, Version: e.Version})
}

// add applies an arithmetic op: the new number is stored as a SET of it
// would be (fencing, limits, events), the key's expiry kept, and is the
// result's Previous.
func (s *Store) add(c *Command, stored, cur *Entry, events []Event) (Result, []Event) {
	var number []byte
	switch {
	case cur != nil:
		// The fence first, as for a SET: a client it keeps out learns
		// nothing of the value.
		if o, ok := checkFence(cur, c.Fence); !ok {
			return Result{Outcome: o}, events
		}
		if !bytes.HasPrefix(cur.Value, c.Value) {
			return Result{Outcome: NotApplied, Version: cur.Version}, events
		}
		number = cur.Value[len(c.Value):]
	case c.Op != OpAdd:
		return Result{Outcome: Missing}, events
	}
	sum, o := arithmetic(c.Op, c.Delta, number, cur != nil)
	if o != Applied {
		res := Result{Outcome: o}
		if cur != nil {
			res.Version = cur.Version
		}
		return res, events
	}
	value := append(append(make([]byte, 0, len(c.Value)+len(sum)), c.Value...), sum...)
	return s.rewrite(c, value, keptTTL(cur, c.Now), stored, cur, events)
}

// rewrite applies what an op that changes a key in place made of it (an
// arithmetic or a value op): a SET of value under c's key, with c's
// version, fence and time, to live ttl ms (0: no expiry). Previous is the
// value stored (HadPrevious true), which the op's answer is made from.
func (s *Store) rewrite(c *Command, value []byte, ttl int64, stored, cur *Entry, events []Event) (Result, []Event) {
	set := *c
	set.Op, set.Cond, set.Delta, set.Value, set.TTL = OpSet, Always, 0, value, ttl
	res, events := s.set(&set, stored, cur, events)
	if res.Outcome == Applied {
		res.Previous, res.HadPrevious = events[len(events)-1].Value, true
	}
	return res, events
}

// keptTTL is the time cur has left to live at now, which an op that keeps
// a key's expiry gives the value it stores (0: cur does not expire, or
// there is no cur).
func keptTTL(cur *Entry, now int64) int64 {
	if cur == nil || cur.ExpiresAt == 0 {
		return 0
	}
	return cur.ExpiresAt - now // > 0: cur is live at now
}

// change applies OpAppend, OpPrepend and OpTouch: a SET of the value
// they make, with the key's expiry (OpTouch: its own TTL). As for add,
// Previous is the value stored (HadPrevious true), for the length
// APPEND and PREPEND answer with; OpTouch's answer needs none, and a
// result carries no value it does not need (a forwarded write's comes
// back over the node link, a remembered one is kept).
func (s *Store) change(c *Command, stored, cur *Entry, events []Event) (Result, []Event) {
	if cur == nil && (c.Op != OpAppend || c.Cond == IfExists) {
		return Result{Outcome: Missing}, events
	}
	if cur != nil {
		// The fence first, as for a SET.
		if o, ok := checkFence(cur, c.Fence); !ok {
			return Result{Outcome: o}, events
		}
	}
	switch {
	case c.Op == OpTouch:
		res, events := s.rewrite(c, cur.Value, c.TTL, stored, cur, events)
		res.Previous, res.HadPrevious = nil, false
		return res, events
	case cur == nil: // OpAppend to no key: the key made
		return s.rewrite(c, c.Value, 0, stored, cur, events)
	case c.Op == OpAppend:
		value := append(append(make([]byte, 0, len(cur.Value)+len(c.Value)), cur.Value...), c.Value...)
		return s.rewrite(c, value, keptTTL(cur, c.Now), stored, cur, events)
	}
	// OpPrepend
	lead := c.Value[:min(max(c.Delta, 0), int64(len(c.Value)))]
	unless := c.Cond == NX
	if bytes.HasPrefix(cur.Value, lead) == unless {
		return Result{Outcome: NotApplied, Version: cur.Version}, events
	}
	value := make([]byte, 0, len(cur.Value)+len(c.Value)-len(lead))
	if unless {
		value = append(append(value, c.Value[len(lead):]...), cur.Value...)
	} else {
		value = append(append(value, c.Value...), cur.Value[len(lead):]...)
	}
	return s.rewrite(c, value, keptTTL(cur, c.Now), stored, cur, events)
}

// arithmetic is op's number after it, in decimal, from number (the digits
// a key holds; exists false for a key that does not exist, which OpAdd
// counts as 0).
func arithmetic(op Op, delta int64, number []byte, exists bool) ([]byte, Outcome) {
	if op == OpAdd {
		var n int64
		if exists {
			v, ok := ParseInteger(number)
			if !ok {
				return nil, NotANumber
			}
			n = v
		}
		if delta > 0 && n > math.MaxInt64-delta || delta < 0 && n < math.MinInt64-delta {
			return nil, Overflow
		}
		return strconv.AppendInt(nil, n+delta, 10), Applied
	}
	n, err := strconv.ParseUint(string(number), 10, 64)
	if err != nil {
		return nil, NotANumber
	}
	d := uint64(delta)
	if op == OpIncr {
		n += d // wraps, as memcached's does
	} else {
		n -= min(n, d)
	}
	return strconv.AppendUint(nil, n, 10), Applied
}

// ParseInteger parses b as a signed 64-bit integer written as Redis writes
// and reads one: an optional minus sign, then digits without a leading
// zero ("0" itself aside); no plus sign, no spaces, no "-0".
func ParseInteger(b []byte) (int64, bool) {
	digits := b
	if len(digits) > 0 && digits[0] == '-' {
		digits = digits[1:]
	}
	if len(digits) == 0 || len(digits) > 19 || digits[0] == '0' && (len(digits) > 1 || len(b) > 1) {
		return 0, false
	}
	for _, c := range digits {
		if c < '0' || c > '9' {
			return 0, false
		}
	}
	n, err := strconv.ParseInt(string(b), 10, 64)
	return n, err == nil
}

// expiredAt is the version of the DELETE of a value of version old that a
// write of version v replaces after it expired: ordered after old and
// before v, as an Expire proposed before the write would be, and unique.
// It is the version just before v with the issuing node's id extended by
// '!': no node id has one (they are letters, digits, '-' and '_'), so no
// other change has this version, not the write proposed just before v
// (which a SINCE from it would then skip). If old sorts after that (a
// version of another node, in the same counter), old extended the same
// way; '!' sorts below every character of a node id, so that stays below
// v even when v's node id begins with old's.
func expiredAt(old, v hlc.Timestamp) hlc.Timestamp {
	at := v
	if at.Counter > 0 {
		at.Counter--
	} else {
		at.Wall--
		at.Counter = hlc.MaxCounter
	}
	if at.Compare(old) <= 0 {
		at = old
	}
	at.Node += "!"
	return at
}

// checkFence applies the fencing rule of the spec (section 4.4) to a write
// of a live entry.
func checkFence(cur *Entry, token hlc.Timestamp) (Outcome, bool) {
	if cur.Fence.IsZero() {
		return Applied, true
	}
	if token.IsZero() {
		return FenceRequired, false
	}
	if token.Compare(cur.Fence) < 0 {
		return FenceLower, false
	}
	return Applied, true
}

// fits reports whether replacing stored (nil for a new key) by an entry of
// size bytes stays within the limits. Shrinking writes always fit.
func (s *Store) fits(stored *Entry, size int64) bool {
	var oldSize int64
	if stored != nil {
		oldSize = stored.size()
	} else if s.limits.MaxKeys > 0 && s.keys.Len() >= s.limits.MaxKeys {
		return false
	}
	grow := size - oldSize
	return s.limits.MaxBytes <= 0 || grow <= 0 || s.bytes+grow <= s.limits.MaxBytes
}

// replace stores e in place of old (nil if the key is new) with one tree
// search, keeping the byte count and expiry index in step.
func (s *Store) replace(old, e *Entry) {
	s.keys.ReplaceOrInsert(e)
	if s.index != nil {
		s.index[keyString(e)] = e
	}
	s.account(old, e)
}

// account brings the byte count and expiry index from old (nil if the
// key is new) to e, which the tree holds now.
func (s *Store) account(old, e *Entry) {
	s.bytes += e.size()
	if old == nil && Reserved(e.Key) {
		s.serverKeys++
	}
	if old != nil {
		s.bytes -= old.size()
		if old.ExpiresAt != 0 && old.ExpiresAt != e.ExpiresAt {
			s.expiry.Delete(expiryItem{at: old.ExpiresAt, key: old.Key})
		}
	}
	if e.ExpiresAt != 0 && (old == nil || old.ExpiresAt != e.ExpiresAt || !sameBytes(old.Key, e.Key)) {
		// Not when an overwrite keeps the deadline: the item holds the
		// key's bytes, which the overwrite kept too (see set).
		s.expiry.ReplaceOrInsert(expiryItem{at: e.ExpiresAt, key: e.Key})
	}
}

// Split divides the store into n stores by part(key), which must be in
// [0, n). Each keeps the whole store's maximum version, so versions issued
// on any part stay above every version the store held. Entries are shared:
// none of the stores changes them in place.
func (s *Store) Split(n int, part func(key []byte) int) []*Store {
	s.gen = generations.Add(1)
	out := make([]*Store, n)
	for i := range out {
		out[i] = New(s.limits)
		out[i].maxVersion = s.maxVersion
	}
	s.keys.Ascend(func(e *Entry) bool {
		out[part(e.Key)].replace(nil, e)
		return true
	})
	s.rememberedOf(func(r *remembered) bool {
		out[part(r.key)].requests.add(r)
		return true
	})
	return out
}

// Merge joins stores holding different keys (a cluster's groups) into
// one, with the highest of their maximum versions. Entries are shared, as
// in Split.
func Merge(parts []*Store) *Store {
	out := New(Limits{})
	for _, p := range parts {
		p.gen = generations.Add(1)
		if p.maxVersion.Compare(out.maxVersion) > 0 {
			out.maxVersion = p.maxVersion
		}
		p.keys.Ascend(func(e *Entry) bool {
			out.replace(out.lookup(e.Key), e)
			return true
		})
		p.rememberedOf(func(r *remembered) bool {
			out.requests.add(r)
			return true
		})
	}
	return out
}

func (s *Store) remove(e *Entry) {
	s.keys.Delete(e)
	delete(s.index, keyString(e))
	s.bytes -= e.size()
	if Reserved(e.Key) {
		s.serverKeys--
	}
	if e.ExpiresAt != 0 {
		s.expiry.Delete(expiryItem{at: e.ExpiresAt, key: e.Key})
	}
}

// ReservedPrefix starts the keys the server keeps for itself in the
// store (MQTT retained messages, ...): the state store protocol cannot
// reach them (see Reserved), and its clients are not told of their
// changes.
const ReservedPrefix = "\x00mqkv/"

// Reserved reports whether key is one the server keeps for itself.
func Reserved(key []byte) bool {
	return len(key) >= len(ReservedPrefix) && string(key[:len(ReservedPrefix)]) == ReservedPrefix
}
