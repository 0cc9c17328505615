// Package roaming keeps, in a cluster's replicated store, what an MQTT
// session needs to outlive the node that holds it: the session (its
// subscriptions, expiry and will) and its QoS 1 and 2 messages not yet
// acknowledged, under prefixes of the server's own (see
// store.ReservedPrefix). Another node reads them when the client comes
// back to it after its node died (the session goes on there, Session
// Present), and publishes the will of a client whose node died.
//
// Only the node that holds a client id (package ownership) writes its
// records. Writes are made behind the broker, in rounds (see Store): a
// round proposes every key changed since the last one at once, so that
// many messages share the log's appends and fsyncs, and a key's changes
// are applied in the order they were made. What waits for a write (a
// publisher's acknowledgement) is told when its round commits.
package roaming

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/records"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

const (
	// SessionPrefix starts the key of every session record; the client
	// id follows.
	SessionPrefix = store.ReservedPrefix + "session/"
	// MessagePrefix starts the key of every queued message; the client
	// id, a 0 byte (no client id holds one: MQTT strings may not) and the
	// message's packet id follow.
	MessagePrefix = store.ReservedPrefix + "queued/"
)

// SessionKey is the store key of clientID's session.
func SessionKey(clientID string) []byte { return append([]byte(SessionPrefix), clientID...) }

// messagesOf is the prefix of clientID's queued messages.
func messagesOf(clientID string) []byte {
	return append(append([]byte(MessagePrefix), clientID...), 0)
}

// MessageKey is the store key of clientID's message under packet id.
func MessageKey(clientID string, id uint16) []byte {
	return fmt.Appendf(messagesOf(clientID), "%05d", id)
}

// Session is a persistent session as it moves between nodes, or is kept
// for another node to take up. Wire format (msgpack by field name, after
// a format byte): fields may be added, never renamed.
type Session struct {
	Node, Epoch     string // the holder's claim (package ownership)
	ProtocolVersion byte
	Username        string
	Expiry          uint32 // Session Expiry Interval, seconds
	// Left is when the session's connection ended (unix milliseconds);
	// 0 while it is connected.
	Left          int64
	Subscriptions []Subscription
	Will          *Will
	// TakenFrom names the member that died holding the session, once
	// another node took it up (see mesh.Delivery.For).
	TakenFrom string
	TakenAt   int64 // when, unix nanoseconds
	// Messages are the QoS 1 and 2 messages to the client, not yet
	// acknowledged, oldest first: filled by Load, and by a node that
	// hands a session over; in the record, none (each is a key).
	Messages []Message
}

// Subscription is one of a session's subscriptions.
type Subscription struct {
	Filter         string
	QoS            byte
	NoLocal, RAP   bool
	RetainHandling byte
	Identifier     int
}

// Will is a client's will message.
type Will struct {
	Msg       mesh.Message
	Delay     uint32 // Will Delay Interval, seconds
	Principal policy.Principal
}

// Message is a QoS 1 or 2 message to a client.
type Message struct {
	Seq uint64 // the order it was queued in (unix nanoseconds at the node that queued it)
	At  int64  // when it was queued, unix milliseconds: its expiry counts from then
	Msg mesh.Message
	Dup bool
	ID  uint16 // its packet id (in a record, also its key's)
	// Released says the client answered it with PUBREC and was sent
	// PUBREL: what is left of its QoS 2 exchange is that PUBREL, sent
	// again under ID until the client's PUBCOMP (MQTT-4.4.0-1); Msg is
	// empty then. Only in a session handed over: a record keeps the
	// PUBLISH until PUBCOMP, and a PUBLISH sent again with DUP under its
	// id is answered with PUBREC again, not delivered twice.
	Released bool
}

// Live returns m as it is to be sent now, its expiry shortened by the time
// it was kept, or false if it expired meanwhile.
func (m Message) Live(now time.Time) (Message, bool) {
	if m.Msg.Expiry == 0 || m.At == 0 {
		return m, true
	}
	kept := (now.UnixMilli() - m.At) / 1000
	if kept >= int64(m.Msg.Expiry) {
		return m, false
	}
	m.Msg.Expiry -= uint32(max(kept, 0))
	return m, true
}

const format = 1

func encode(v any) []byte { return records.Encode(format, v) }

func decode(b []byte, v any) error { return records.Decode("roaming", format, b, v) }

// Router is how the store is reached (statestore.Router's methods).
type Router interface {
	Submit(ctx context.Context, p replica.Proposal)
	Get(ctx context.Context, key []byte) (store.Entry, bool, error)
	Ascend(ctx context.Context, from, prefix []byte, limit int, fn func(*store.Entry) bool) (exhausted bool, err error)
}

// Store reads a cluster's session records and writes one node's,
// behind it, in rounds.
type Store struct {
	router Router

	mu      sync.Mutex
	pending map[string]change // key → its latest change, not yet proposed
	waiting []func(error)     // told when the round taking pending commits
	running bool              // a round is under way
	seq     uint64            // the last Message.Seq given

	// Writes, Failed and Rounds count the records written, those that
	// failed, and the rounds.
	Writes, Failed, Rounds atomic.Int64
}

type change struct {
	value []byte // nil: delete
}

// New returns a Store through router.
func New(router Router) *Store {
	return &Store{router: router, pending: map[string]change{}}
}

// roundTimeout bounds one round's writes.
const roundTimeout = 10 * time.Second

// PutSession records s as clientID's session; done (if not nil) is told
// once it is committed, or failed.
func (w *Store) PutSession(clientID string, s *Session, done func(error)) {
	w.queue(SessionKey(clientID), encode(s), done)
}

// DeleteSession removes clientID's session and its queued messages (those
// it knows of: ids).
func (w *Store) DeleteSession(clientID string, ids []uint16) {
	w.queue(SessionKey(clientID), nil, nil)
	for _, id := range ids {
		w.queue(MessageKey(clientID, id), nil, nil)
	}
}

// NextSeq numbers a message queued now.
func (w *Store) NextSeq() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seq = max(w.seq+1, uint64(time.Now().UnixNano()))
	return w.seq
}

// PutMessage records m as clientID's message under packet id id.
func (w *Store) PutMessage(clientID string, id uint16, m *Message, done func(error)) {
	w.queue(MessageKey(clientID, id), encode(m), done)
}

// Drop forgets the changes to clientID's records not yet proposed: the
// session went to another node, which writes them now.
func (w *Store) Drop(clientID string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.pending, string(SessionKey(clientID)))
	p := string(messagesOf(clientID))
	for k := range w.pending {
		if strings.HasPrefix(k, p) {
			delete(w.pending, k)
		}
	}
}

// DeleteMessage removes clientID's message under packet id id
// (acknowledged).
func (w *Store) DeleteMessage(clientID string, id uint16) {
	w.queue(MessageKey(clientID, id), nil, nil)
}

func (w *Store) queue(key []byte, value []byte, done func(error)) {
	w.mu.Lock()
	w.pending[string(key)] = change{value: value}
	if done != nil {
		w.waiting = append(w.waiting, done)
	}
	start := !w.running
	w.running = true
	w.mu.Unlock()
	if start {
		go w.rounds()
	}
}

// rounds writes what is pending, a round at a time, until nothing is.
func (w *Store) rounds() {
	for {
		w.mu.Lock()
		if len(w.pending) == 0 {
			w.running = false
			w.mu.Unlock()
			return
		}
		batch, waiting := w.pending, w.waiting
		w.pending, w.waiting = make(map[string]change, len(batch)), nil
		w.mu.Unlock()
		err := w.round(batch)
		for _, done := range waiting {
			done(err)
		}
	}
}

// round proposes every change of batch at once and waits for them all.
func (w *Store) round(batch map[string]change) error {
	ctx, cancel := context.WithTimeout(context.Background(), roundTimeout)
	defer cancel()
	errs := make(chan error, len(batch))
	for key, c := range batch {
		cmd := store.Command{Op: store.OpDel, Key: []byte(key)}
		if c.value != nil {
			cmd = store.Command{Op: store.OpSet, Key: []byte(key), Value: c.value}
		}
		w.router.Submit(ctx, replica.Proposal{Cmd: cmd, Done: func(res store.Result, err error) {
			if err == nil && res.Outcome == store.QuotaExceeded {
				err = errors.New("roaming: the store's key or byte quota is exceeded")
			}
			errs <- err
		}})
	}
	var first error
	for range batch {
		if err := <-errs; err != nil {
			first = cmp.Or(first, err)
			w.Failed.Add(1)
		}
	}
	w.Writes.Add(int64(len(batch)))
	w.Rounds.Add(1)
	return first
}

// Load reads clientID's session and its queued messages, oldest first;
// nil if it has none.
func (w *Store) Load(ctx context.Context, clientID string) (*Session, hlc.Timestamp, error) {
	r := w.router
	e, found, err := r.Get(ctx, SessionKey(clientID))
	if err != nil || !found {
		return nil, hlc.Timestamp{}, err
	}
	var s Session
	if err := decode(e.Value, &s); err != nil {
		return nil, hlc.Timestamp{}, fmt.Errorf("roaming: session of %q: %w", clientID, err)
	}
	err = records.Scan(ctx, r, messagesOf(clientID), func(e *store.Entry) {
		var m Message
		id, perr := strconv.ParseUint(string(e.Key[len(messagesOf(clientID)):]), 10, 16)
		if perr != nil || decode(e.Value, &m) != nil {
			return // unreadable: skipped
		}
		m.ID = uint16(id)
		s.Messages = append(s.Messages, m)
	})
	slices.SortFunc(s.Messages, func(a, b Message) int { return cmp.Compare(a.Seq, b.Seq) })
	return &s, e.Version, err
}

// MessageIDs returns the packet ids of clientID's queued messages.
func (w *Store) MessageIDs(ctx context.Context, clientID string) ([]uint16, error) {
	r := w.router
	var ids []uint16
	p := messagesOf(clientID)
	err := records.Scan(ctx, r, p, func(e *store.Entry) {
		if id, err := strconv.ParseUint(string(e.Key[len(p):]), 10, 16); err == nil {
			ids = append(ids, uint16(id))
		}
	})
	return ids, err
}

// Sessions calls fn with every session record and its version.
func (w *Store) Sessions(ctx context.Context, fn func(clientID string, s *Session, v hlc.Timestamp)) error {
	return records.Scan(ctx, w.router, []byte(SessionPrefix), func(e *store.Entry) {
		var s Session
		if decode(e.Value, &s) == nil {
			fn(string(e.Key[len(SessionPrefix):]), &s, e.Version)
		}
	})
}

// Replace sets clientID's session to s (nil: deletes it and its queued
// messages) if its record is still at version v: the way a node that
// does not hold the session (it takes up a dead node's) changes it,
// once, whatever other nodes do at the same time. It reports whether it
// did.
func (w *Store) Replace(ctx context.Context, clientID string, v hlc.Timestamp, s *Session) (bool, error) {
	r := w.router
	cmd := store.Command{Op: store.OpDel, Key: SessionKey(clientID), Cond: store.IfVersion, Expected: v}
	if s != nil {
		cmd = store.Command{Op: store.OpSet, Key: SessionKey(clientID), Value: encode(s), Cond: store.IfVersion, Expected: v}
	}
	res, err := records.Submit(ctx, r, cmd)
	if err != nil || res.Outcome != store.Applied {
		return false, err
	}
	if s == nil {
		ids, err := w.MessageIDs(ctx, clientID)
		if err != nil {
			return true, err
		}
		for _, id := range ids {
			if _, err := records.Submit(ctx, r, store.Command{Op: store.OpDel, Key: MessageKey(clientID, id)}); err != nil {
				return true, err
			}
		}
	}
	return true, nil
}
