// Package ownership records, in a cluster's replicated store, which node
// holds each MQTT client id's session: one key per client id under a
// prefix of the server's own (see store.ReservedPrefix), changed only by
// compare-and-set on the key's version. A node that takes a client id
// over wins the set and tells the node it took it from (the record it
// replaced names it) to end its connection; a node's late cleanup can
// only remove a record it still holds, never the next owner's. So no two
// nodes hold one session, whatever the timing of two connections of one
// client id on two nodes.
package ownership

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/records"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// Prefix starts the key of every ownership record; the client id follows.
const Prefix = store.ReservedPrefix + "owner/"

// Key is the store key of clientID's record.
func Key(clientID string) []byte { return append([]byte(Prefix), clientID...) }

// Record is who holds a client id's session. Wire format (msgpack by
// field name, after a format byte).
type Record struct {
	Node  string
	Epoch string // the claim's: tells this claim from the same node's others
	// From and FromEpoch are the record this claim replaced: a claim
	// retried after its outcome was lost finds its own record, and in it
	// whom it took the id from.
	From, FromEpoch string
}

// Claim is a record this node wrote, as it must name it to remove it.
type Claim struct {
	Record
	Version hlc.Timestamp
}

// Router is how the store is reached (statestore.Router's methods).
type Router interface {
	Submit(ctx context.Context, p replica.Proposal)
	Get(ctx context.Context, key []byte) (store.Entry, bool, error)
}

const format = 1

func encode(r Record) []byte { return records.Encode(format, r) }

func decode(b []byte) (Record, error) {
	var r Record
	err := records.Decode("ownership", format, b, &r)
	return r, err
}

// Store reads and changes the records.
type Store struct {
	router Router
	self   string
}

// New returns the records of node self, through router.
func New(router Router, self string) *Store { return &Store{router: router, self: self} }

// maxRaces bounds the compare-and-set rounds a claim loses to others.
const maxRaces = 8

// NewEpoch returns an epoch for a claim: drawn before the claim, so that
// the connection making it can be named while the claim is under way.
func NewEpoch() string {
	var e [8]byte
	rand.Read(e[:])
	return hex.EncodeToString(e[:])
}

// Claim makes this node the holder of clientID's session, under epoch
// (see NewEpoch). It returns the record it replaced (zero if none), and
// its own claim.
func (s *Store) Claim(ctx context.Context, clientID, epoch string) (prev Record, mine Claim, err error) {
	for range maxRaces {
		cur, found, err := s.router.Get(ctx, Key(clientID))
		if err != nil {
			return Record{}, Claim{}, err
		}
		prev = Record{}
		if found {
			if prev, err = decode(cur.Value); err != nil {
				prev = Record{} // unreadable: taken over as if none
			}
		}
		if found && prev.Node == s.self && prev.Epoch == epoch {
			// This claim, made by an attempt whose outcome was lost.
			return Record{Node: prev.From, Epoch: prev.FromEpoch}, Claim{Record: prev, Version: cur.Version}, nil
		}
		mine.Record = Record{Node: s.self, Epoch: epoch, From: prev.Node, FromEpoch: prev.Epoch}
		res, err := records.Submit(ctx, s.router, store.Command{Op: store.OpSet, Key: Key(clientID), Value: encode(mine.Record), Cond: store.IfVersion, Expected: cur.Version})
		if err != nil {
			return Record{}, Claim{}, err
		}
		if res.Outcome == store.Applied {
			mine.Version = res.Version
			return prev, mine, nil
		}
		// Another claim came between the read and the set: again, from
		// the record it wrote.
	}
	return Record{}, Claim{}, fmt.Errorf("ownership: %d claims of client id %q lost to others in a row", maxRaces, clientID)
}

// Take makes this node the holder of clientID's session if from holds it
// now (a member that died): at most one node takes it, whatever others
// try at the same time.
func (s *Store) Take(ctx context.Context, clientID, from, epoch string) (Claim, bool, error) {
	cur, found, err := s.router.Get(ctx, Key(clientID))
	if err != nil || !found {
		return Claim{}, false, err
	}
	if r, err := decode(cur.Value); err != nil || r.Node != from {
		return Claim{}, false, nil
	}
	mine := Claim{Record: Record{Node: s.self, Epoch: epoch}}
	res, err := records.Submit(ctx, s.router, store.Command{Op: store.OpSet, Key: Key(clientID), Value: encode(mine.Record), Cond: store.IfVersion, Expected: cur.Version})
	if err != nil || res.Outcome != store.Applied {
		return Claim{}, false, err
	}
	mine.Version = res.Version
	return mine, true, nil
}

// Release removes this node's claim, if it is still the record (a later
// owner's is left alone).
func (s *Store) Release(ctx context.Context, clientID string, c Claim) error {
	if c.Version.IsZero() {
		return nil
	}
	_, err := records.Submit(ctx, s.router, store.Command{Op: store.OpDel, Key: Key(clientID), Cond: store.IfVersion, Expected: c.Version})
	return err
}

// Owner returns clientID's record, if there is one, as a claim (the
// holder may release it).
func (s *Store) Owner(ctx context.Context, clientID string) (Claim, bool, error) {
	cur, found, err := s.router.Get(ctx, Key(clientID))
	if err != nil || !found {
		return Claim{}, false, err
	}
	r, err := decode(cur.Value)
	return Claim{Record: r, Version: cur.Version}, err == nil, err
}
