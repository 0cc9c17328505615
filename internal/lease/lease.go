// Package lease holds leases on keys as Azure Blob storage has them on
// blobs (acquire, renew, change, release, break; 15–60 s or infinite):
// the state machine, pure and deterministic over the time it is given,
// and its records in the replicated store, one per leased key under a
// reserved prefix, changed by compare-and-set on their versions.
//
// A lease protects its key through the store's fencing: the version of
// the lease record is the fencing token every write to the key carries
// while the record exists (package httpkv sees to it), and acquiring a
// lease writes the key again with the new record's version as its fence,
// so that a write prepared under an older state of the lease is refused
// by the store itself (FenceLower), not only by a check before it.
package lease

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/records"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// Prefix starts the lease records' keys.
const Prefix = store.ReservedPrefix + "lease/"

// Key is the lease record's key for key.
func Key(key []byte) []byte { return append([]byte(Prefix), key...) }

const format = 1

// Record is a key's lease. A record outlives its lease (released,
// expired or broken): its version is the key's fencing token from then
// on, until the key is deleted.
type Record struct {
	ID        string `codec:"id"`
	Duration  int64  `codec:"dur"` // seconds; -1 infinite
	Expires   int64  `codec:"exp"` // ms since the epoch; 0 with an infinite lease
	BreakEnds int64  `codec:"brk"` // ms; not 0 once broken or breaking
	Released  bool   `codec:"rel"` // released, or never held
}

// State names a lease's state at a moment, as Azure's x-ms-lease-state.
func (r Record) State(now int64) string {
	switch {
	case r.Released || r.ID == "":
		return "available"
	case r.BreakEnds != 0 && now < r.BreakEnds:
		return "breaking"
	case r.BreakEnds != 0:
		return "broken"
	case r.Duration >= 0 && now >= r.Expires:
		return "expired"
	}
	return "leased"
}

// Active says whether the lease holds its key at now (leased or
// breaking): writes need its id.
func (r Record) Active(now int64) bool {
	s := r.State(now)
	return s == "leased" || s == "breaking"
}

// Op is one lease request.
type Op struct {
	Action      string // acquire, renew, change, release, break
	ID          string // the lease id the client holds (renew, change, release; acquire: optional, the proposed one)
	ProposedID  string // change: the new id; acquire: the id to take (else one is made)
	Duration    int64  // acquire: seconds, 15–60, or -1
	BreakPeriod int64  // break: seconds, 0–60; -1 when not given
}

// Error is a refused lease request, with the HTTP status and the stable
// code a client is told.
type Error struct {
	Status int
	Code   string
	Msg    string
}

func (e *Error) Error() string { return e.Msg }

func refuse(status int, code, msg string) *Error { return &Error{status, code, msg} }

// maxID bounds a lease id's length.
const maxID = 128

// Apply applies op to the lease rec (exists: a record is stored) at now
// (ms): the next record, or why not. newID makes an id for an acquire
// without one.
func Apply(rec Record, exists bool, now int64, op Op, newID func() string) (Record, error) {
	if len(op.ID) > maxID || len(op.ProposedID) > maxID {
		return rec, refuse(400, "bad_request", fmt.Sprintf("a lease id is at most %d bytes", maxID))
	}
	state := rec.State(now)
	switch op.Action {
	case "acquire":
		if op.Duration != -1 && (op.Duration < 15 || op.Duration > 60) {
			return rec, refuse(400, "bad_request", "a lease lasts 15 to 60 seconds, or -1 for ever")
		}
		id := op.ProposedID
		if id == "" {
			id = op.ID
		}
		if (state == "leased" && id != rec.ID) || state == "breaking" {
			return rec, refuse(409, "lease_already_present", "the key is leased by another lease id")
		}
		if id == "" {
			id = newID()
		}
		return Record{ID: id, Duration: op.Duration, Expires: expiry(now, op.Duration)}, nil
	case "renew", "change", "release":
		if op.ID == "" {
			return rec, refuse(400, "bad_request", op.Action+" needs the lease id (Mqkv-Lease-Id)")
		}
		if !exists || state == "available" {
			return rec, refuse(409, "lease_not_present", "the key has no lease")
		}
		if op.ID != rec.ID && !(op.Action == "change" && op.ProposedID == rec.ID) {
			return rec, refuse(409, "lease_id_mismatch", "the lease id is not the key's lease's")
		}
		switch op.Action {
		case "renew":
			if state == "breaking" || state == "broken" {
				return rec, refuse(409, "lease_is_broken", "a broken lease cannot be renewed: acquire it again")
			}
			rec.Expires = expiry(now, rec.Duration)
		case "change":
			if state != "leased" && state != "breaking" {
				return rec, refuse(409, "lease_not_present", "the lease has ended")
			}
			if op.ProposedID == "" {
				return rec, refuse(400, "bad_request", "change needs the proposed lease id (Mqkv-Proposed-Lease-Id)")
			}
			rec.ID = op.ProposedID
		case "release":
			rec = Record{Released: true}
		}
		return rec, nil
	case "break":
		if !exists || state == "available" || state == "expired" || state == "broken" {
			return rec, refuse(409, "lease_not_present", "the key has no lease to break")
		}
		if op.BreakPeriod > 60 {
			return rec, refuse(400, "bad_request", "a break period is 0 to 60 seconds")
		}
		end := now // an infinite lease without a period breaks at once
		switch {
		case op.BreakPeriod >= 0 && rec.Duration >= 0:
			end = min(now+op.BreakPeriod*1000, rec.Expires)
		case op.BreakPeriod >= 0:
			end = now + op.BreakPeriod*1000
		case rec.Duration >= 0:
			end = rec.Expires
		}
		if state == "breaking" {
			end = min(end, rec.BreakEnds) // a second break only shortens it
		}
		rec.BreakEnds = max(end, 1)
		return rec, nil
	}
	return rec, refuse(400, "bad_request", "action is acquire, renew, change, release or break")
}

func expiry(now, duration int64) int64 {
	if duration < 0 {
		return 0
	}
	return now + duration*1000
}

// NewID is a random lease id in the GUID form Azure uses.
func NewID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// Router is the store the records live in.
type Router interface {
	records.Submitter
	Get(ctx context.Context, key []byte) (store.Entry, bool, error)
	Clock() *hlc.Clock
}

// Store keeps the lease records.
type Store struct{ router Router }

// New returns the lease records of router's store.
func New(router Router) *Store { return &Store{router: router} }

// Get reads key's lease record and its version.
func (s *Store) Get(ctx context.Context, key []byte) (Record, hlc.Timestamp, bool, error) {
	e, found, err := s.router.Get(ctx, Key(key))
	if err != nil || !found {
		return Record{}, hlc.Timestamp{}, false, err
	}
	var r Record
	if err := records.Decode("lease", format, e.Value, &r); err != nil {
		return Record{}, hlc.Timestamp{}, false, err
	}
	return r, e.Version, true, nil
}

// Now is the time leases are judged by: this node's clock, in ms.
func (s *Store) Now() int64 { return s.router.Clock().WallMillis() }

// Do applies op to key's lease, again if another request changed it
// meanwhile; it returns the record written and its version.
func (s *Store) Do(ctx context.Context, key []byte, op Op) (Record, hlc.Timestamp, error) {
	for range 16 {
		cur, ver, exists, err := s.Get(ctx, key)
		if err != nil {
			return cur, ver, err
		}
		next, err := Apply(cur, exists, s.Now(), op, NewID)
		if err != nil {
			return cur, ver, err
		}
		res, err := records.Submit(ctx, s.router, store.Command{Op: store.OpSet, Key: Key(key), Value: records.Encode(format, next),
			Cond: store.IfVersion, Expected: ver})
		if err != nil {
			if errors.Is(err, replica.ErrOutcomeUnknown) {
				continue // read it again: it tells
			}
			return cur, ver, err
		}
		if res.Outcome == store.Applied {
			return next, res.Version, nil
		}
	}
	return Record{}, hlc.Timestamp{}, refuse(503, "unavailable", "the lease changed too often; try again")
}

// Drop removes key's lease record (the key was deleted: its fence went
// with it).
func (s *Store) Drop(ctx context.Context, key []byte) error {
	_, err := records.Submit(ctx, s.router, store.Command{Op: store.OpDel, Key: Key(key)})
	return err
}

// Remaining is a record's remaining time at now (-1: infinite), for the
// lease's time header.
func (r Record) Remaining(now int64) time.Duration {
	switch {
	case r.BreakEnds != 0:
		return time.Duration(max(r.BreakEnds-now, 0)) * time.Millisecond
	case r.Duration < 0:
		return -1
	}
	return time.Duration(max(r.Expires-now, 0)) * time.Millisecond
}
