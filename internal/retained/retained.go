// Package retained keeps MQTT retained messages in the replicated store,
// one key per topic under a prefix of the server's own (see
// store.ReservedPrefix), so that they are durable, cluster-wide and
// survive the loss of any one node; and it keeps each node's broker
// mirroring them: every node applies every change (from the groups'
// change events, and from the store at start), newest version first.
//
// A retained message is written through the log like a SET (an empty one
// deletes), its Message Expiry Interval as the key's TTL. The broker
// learns of it when the write commits on the node that took it, before
// the publisher's acknowledgement, and every node, that one included,
// from the change events: the mirror keeps the newest version of each
// topic, so that events and a start's read of the store may come in any
// order.
package retained

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/records"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/route"
	"github.com/mqkv/mqkv/internal/store"
)

// Prefix starts the key of every retained message; the topic follows.
const Prefix = store.ReservedPrefix + "retained/"

// Key is the store key of topic's retained message.
func Key(topic string) []byte { return append([]byte(Prefix), topic...) }

// format is the first byte of an encoded message: new formats take new
// numbers, old ones stay readable.
const format = 1

// Encode is the stored form of m.
func Encode(m *mesh.Message) []byte { return records.Encode(format, m) }

// Decode reads a stored message.
func Decode(b []byte) (*mesh.Message, error) {
	var m mesh.Message
	if err := records.Decode("retained", format, b, &m); err != nil {
		return nil, err
	}
	return &m, nil
}

// Router is how the store is reached (statestore.Router's methods).
type Router interface {
	Submit(ctx context.Context, p replica.Proposal)
	Ascend(ctx context.Context, from, prefix []byte, limit int, fn func(*store.Entry) bool) (exhausted bool, err error)
	Clock() *hlc.Clock
}

// Mirror is told each retained message (m nil: none any more) of topic,
// newest version last.
type Mirror func(topic string, m *mesh.Message)

// Store is one node's access to the retained messages.
type Store struct {
	router Router
	mirror Mirror

	mu       sync.Mutex
	versions map[string]hlc.Timestamp // topic → the newest version mirrored (deleted too)
	// Deleted topics are kept a while, for changes that arrive late (a
	// commit's and its change event come in either order), then go.
	deleted map[string]time.Time
	pruned  time.Time
}

// keepDeleted is how long the version of a deleted message is kept.
const keepDeleted = time.Minute

// New returns a Store writing through router and mirroring to mirror.
func New(router Router, mirror Mirror) *Store {
	return &Store{router: router, mirror: mirror, versions: map[string]hlc.Timestamp{}, deleted: map[string]time.Time{}}
}

// Put keeps m as topic's retained message (an empty payload removes it),
// with ttlMs to live (0: for ever). done gets the outcome once the write
// is committed (and mirrored here) or failed.
func (s *Store) Put(ctx context.Context, topic string, m *mesh.Message, ttlMs int64, done func(error)) {
	cmd := store.Command{Op: store.OpDel, Key: Key(topic)}
	if len(m.Payload) > 0 {
		cmd = store.Command{Op: store.OpSet, Key: Key(topic), Value: Encode(m), TTL: ttlMs}
	}
	s.router.Submit(ctx, replica.Proposal{Cmd: cmd, Done: func(res store.Result, err error) {
		switch {
		case err != nil:
		case res.Outcome == store.QuotaExceeded:
			err = errors.New("retained: the store's key or byte quota is exceeded")
		case cmd.Op == store.OpSet && res.Outcome == store.Applied:
			s.apply(topic, m, res.Version)
		case cmd.Op == store.OpDel && res.Outcome == store.Applied:
			// res.Version is the deleted message's: what the mirror
			// holds, or older (the change event brings the delete's
			// own, newer, version later).
			s.apply(topic, nil, res.Version)
		}
		done(err)
	}})
}

// apply mirrors one change of topic at version v, unless a newer one is
// mirrored already: a SET (m) older than or as old as what is mirrored is
// dropped; a delete (m nil) removes what is mirrored unless it is newer
// than v. The version of a delete is kept, so that an older SET read
// from the store at start does not come back.
func (s *Store) apply(topic string, m *mesh.Message, v hlc.Timestamp) {
	if v.IsZero() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	cur, ok := s.versions[topic]
	if ok && (m != nil && v.Compare(cur) <= 0 || m == nil && v.Compare(cur) < 0) {
		return
	}
	s.versions[topic] = v
	if m == nil {
		s.deleted[topic] = time.Now()
	} else {
		delete(s.deleted, topic)
	}
	if now := time.Now(); now.Sub(s.pruned) > keepDeleted {
		s.pruned = now
		for t, at := range s.deleted {
			if now.Sub(at) > keepDeleted {
				delete(s.deleted, t)
				delete(s.versions, t)
			}
		}
	}
	s.mirror(topic, m)
}

// Events takes the changes to retained messages out of a batch of change
// events and mirrors them; it returns the rest, in order: events itself
// when none is a retained message's, else a new slice (events is not
// changed: others may hold it).
func (s *Store) Events(events []store.Event) []store.Event {
	i := 0
	for i < len(events) && !store.Reserved(events[i].Key) {
		i++
	}
	if i == len(events) {
		return events
	}
	rest := append(make([]store.Event, 0, len(events)-1), events[:i]...)
	for _, ev := range events[i:] {
		if !store.Reserved(ev.Key) {
			rest = append(rest, ev)
			continue
		}
		topic, ok := topicOf(ev.Key)
		if !ok {
			continue // the server's, not a retained message's
		}
		if ev.Kind == store.EventSet {
			m, err := Decode(ev.Value)
			if err != nil {
				continue
			}
			s.apply(topic, m, ev.Version)
		} else {
			s.apply(topic, nil, ev.Version)
		}
	}
	return rest
}

// Load mirrors every retained message the store holds.
func (s *Store) Load(ctx context.Context) (int, error) {
	n := 0
	err := s.scan(ctx, "", func(topic string, m *mesh.Message, v hlc.Timestamp) {
		s.apply(topic, m, v)
		n++
	})
	return n, err
}

// Sync brings the mirror of the retained messages whose topics filter
// matches up to date with the store, as read now at the groups' leaders:
// in a cluster, a change commits before every node has mirrored it, and a
// subscriber that comes right after its publisher's acknowledgement, to
// another node, must still get it. A mirrored message the store no longer
// holds (and did not get after the read began) goes.
func (s *Store) Sync(ctx context.Context, filter string) error {
	began := s.router.Clock().Now()
	seen := map[string]bool{}
	literal := filter
	if i := strings.IndexAny(filter, "+#"); i >= 0 {
		literal = filter[:i]
	}
	err := s.scan(ctx, literal, func(topic string, m *mesh.Message, v hlc.Timestamp) {
		if route.Match(filter, topic) {
			seen[topic] = true
			s.apply(topic, m, v)
		}
	})
	if err != nil {
		return err
	}
	s.mu.Lock()
	var gone []string
	for topic, v := range s.versions {
		if _, deleted := s.deleted[topic]; !deleted && !seen[topic] && v.Compare(began) < 0 && route.Match(filter, topic) {
			gone = append(gone, topic)
		}
	}
	s.mu.Unlock()
	for _, topic := range gone {
		s.apply(topic, nil, began) // not in the store at the read: deleted, or expired
	}
	return nil
}

// scan reads the stored messages whose topics start with prefix.
func (s *Store) scan(ctx context.Context, prefix string, fn func(topic string, m *mesh.Message, v hlc.Timestamp)) error {
	return records.Scan(ctx, s.router, Key(prefix), func(e *store.Entry) {
		topic, _ := topicOf(e.Key)
		if m, err := Decode(e.Value); err == nil {
			fn(topic, m, e.Version)
		}
	})
}

func topicOf(key []byte) (string, bool) {
	if len(key) < len(Prefix) || string(key[:len(Prefix)]) != Prefix {
		return "", false
	}
	return string(key[len(Prefix):]), true
}
