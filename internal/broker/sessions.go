package broker

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"github.com/mochi-mqtt/server/v2/packets"
	"go.etcd.io/bbolt"

	"github.com/mqkv/mqkv/internal/journal"
)

// sessions persists MQTT session state in a bbolt file: client records,
// subscriptions and retained messages are written (and fsynced) when they
// change; QoS 1/2 messages in flight are written behind, every
// inflightFlushInterval, because most are acknowledged long before that and
// an fsync per message would cap the broker at a few thousand messages a
// second. (mochi's own bolt hook does exactly that.) A crash can therefore
// lose up to one interval of messages queued for offline clients, as with
// mosquitto's autosave.
type sessions struct {
	mqtt.HookBase
	db  *bbolt.DB
	log *slog.Logger

	// storeMu orders flush against forget: a flush that took a client's
	// messages must commit before forget looks for them, or they would
	// outlive the session in the file.
	storeMu sync.Mutex

	mu         sync.Mutex
	pendingPut map[inflightID]packets.Packet // messages not yet written
	pendingDel map[inflightID]struct{}       // records to delete
	inflight   map[inflightID]struct{}       // messages held, written or not

	stop chan struct{}
	done chan struct{}
}

const inflightFlushInterval = time.Second

var (
	bucketClients  = []byte("clients")
	bucketSubs     = []byte("subscriptions")
	bucketRetained = []byte("retained")
	bucketInflight = []byte("inflight")
	// bucketLeft holds, for a persistent session whose connection ended,
	// when it ended (unix milliseconds, big-endian): its expiry counts
	// from then, also across a restart (mochi's restore starts every
	// session's clock again). A session connected when the server
	// stopped has none; its clock starts at the restart.
	bucketLeft = []byte("left")
)

// checkSessionsFile refuses a session store emptied to 0 bytes (bbolt
// makes a new database of it, and every persistent session, subscription
// and retained message is gone without a word; found by review), and
// warns when the store of an earlier start is gone (someone removed it: a
// new one is made, as they likely meant).
func checkSessionsFile(path string, startedBefore bool, log *slog.Logger) error {
	fi, err := os.Stat(path)
	switch {
	case err == nil && fi.Size() == 0:
		return fmt.Errorf("the MQTT session store %s is empty (0 bytes): it is damaged, and its persistent sessions, subscriptions and retained messages are lost; move it aside to start without them", path)
	case errors.Is(err, os.ErrNotExist) && startedBefore:
		log.Warn("the MQTT session store of an earlier start is missing: starting with no persistent sessions, subscriptions or retained messages", "path", path)
	}
	return nil
}

// startedBefore reports whether dir holds what an earlier start left
// (more than a session store that was never finished).
func startedBefore(dir string) bool {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".tmp") {
			return true
		}
	}
	return false
}

// initSessionsFile makes a new, empty session store at path: under another
// name first, renamed once bbolt has written it, so that a crash or a full
// disk while it is made leaves no sessions.db of 0 bytes, which
// checkSessionsFile takes for damage (found by review).
func initSessionsFile(path string) error {
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		return nil
	}
	tmp := path + ".tmp"
	os.Remove(tmp) // left by a crash
	db, err := bbolt.Open(tmp, 0o600, &bbolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return fmt.Errorf("make session store %s: %w", path, err)
	}
	if err := db.Close(); err != nil {
		return fmt.Errorf("make session store %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("make session store %s: %w", path, err)
	}
	return journal.SyncDir(filepath.Dir(path))
}

func openSessions(path string, log *slog.Logger) (*sessions, error) {
	if err := initSessionsFile(path); err != nil {
		return nil, err
	}
	db, err := bbolt.Open(path, 0o600, &bbolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("open session store %s: %w", path, err)
	}
	err = db.Update(func(tx *bbolt.Tx) error {
		for _, b := range [][]byte{bucketClients, bucketSubs, bucketRetained, bucketInflight, bucketLeft} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("init session store: %w", err)
	}
	s := &sessions{
		db:         db,
		log:        log,
		pendingPut: map[inflightID]packets.Packet{},
		pendingDel: map[inflightID]struct{}{},
		inflight:   map[inflightID]struct{}{},
		stop:       make(chan struct{}),
		done:       make(chan struct{}),
	}
	go s.flushLoop()
	return s, nil
}

func (s *sessions) ID() string { return "mqkv-sessions" }

func (s *sessions) Provides(b byte) bool {
	switch b {
	case mqtt.OnSessionEstablished, mqtt.OnDisconnect, mqtt.OnSubscribed, mqtt.OnUnsubscribed,
		mqtt.OnRetainMessage, mqtt.OnWillSent, mqtt.OnQosPublish, mqtt.OnQosComplete,
		mqtt.OnQosDropped, mqtt.OnClientExpired, mqtt.OnRetainedExpired,
		mqtt.StoredClients, mqtt.StoredSubscriptions, mqtt.StoredInflightMessages, mqtt.StoredRetainedMessages:
		return true
	}
	return false
}

// persistent reports whether the client's session outlives its connection.
func persistent(cl *mqtt.Client) bool {
	if cl.Properties.ProtocolVersion == 5 {
		return cl.Properties.Props.SessionExpiryInterval > 0
	}
	return !cl.Properties.Clean
}

// write applies one client event's changes in one transaction (one fsync,
// shared with concurrent events by bbolt's Batch), whatever the number of
// records it touches: a disconnect that drops 20,000 subscriptions costs
// one write, not 20,000.
func (s *sessions) write(what string, fn func(tx *bbolt.Tx) error) {
	if err := s.db.Batch(fn); err != nil {
		s.log.Error("session store: "+what, "error", err)
	}
}

func (s *sessions) put(bucket []byte, key string, v storage.Serializable) {
	data, err := v.MarshalBinary()
	if err != nil {
		s.log.Error("session store: encode", "error", err)
		return
	}
	s.write("write", func(tx *bbolt.Tx) error { return tx.Bucket(bucket).Put([]byte(key), data) })
}

func (s *sessions) del(bucket []byte, key string) {
	s.write("delete", func(tx *bbolt.Tx) error { return tx.Bucket(bucket).Delete([]byte(key)) })
}

// deletePrefix removes every record of a bucket whose key starts with
// prefix, inside tx.
func deletePrefix(tx *bbolt.Tx, bucket []byte, prefix string) error {
	b := tx.Bucket(bucket)
	p := []byte(prefix)
	var keys [][]byte
	c := b.Cursor()
	for k, _ := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, _ = c.Next() {
		keys = append(keys, bytes.Clone(k))
	}
	for _, k := range keys {
		if err := b.Delete(k); err != nil {
			return err
		}
	}
	return nil
}

// holds reports whether the store has any record of the client: most
// clients have clean sessions and nothing stored, and a read costs no fsync.
func (s *sessions) holds(clientID string) bool {
	found := false
	p := []byte(clientID + "\x00")
	_ = s.db.View(func(tx *bbolt.Tx) error {
		if tx.Bucket(bucketClients).Get([]byte(clientID)) != nil {
			found = true
			return nil
		}
		for _, b := range [][]byte{bucketSubs, bucketInflight} {
			if k, _ := tx.Bucket(b).Cursor().Seek(p); k != nil && bytes.HasPrefix(k, p) {
				found = true
				return nil
			}
		}
		return nil
	})
	return found
}

// updateClient writes the client's record. left is when its connection
// ended, or zero while it is connected; keepLeft leaves that record as it is.
func (s *sessions) updateClient(cl *mqtt.Client, left time.Time, keepLeft bool) {
	if !persistent(cl) {
		return
	}
	p := cl.Properties.Props
	data, err := (&storage.Client{
		ID:              cl.ID,
		T:               storage.ClientKey,
		Remote:          cl.Net.Remote,
		Listener:        cl.Net.Listener,
		Username:        cl.Properties.Username,
		Clean:           cl.Properties.Clean,
		ProtocolVersion: cl.Properties.ProtocolVersion,
		Properties: storage.ClientProperties{
			SessionExpiryInterval:     p.SessionExpiryInterval,
			SessionExpiryIntervalFlag: p.SessionExpiryIntervalFlag,
			AuthenticationMethod:      p.AuthenticationMethod,
			AuthenticationData:        p.AuthenticationData,
			RequestProblemInfo:        p.RequestProblemInfo,
			RequestProblemInfoFlag:    p.RequestProblemInfoFlag,
			RequestResponseInfo:       p.RequestResponseInfo,
			ReceiveMaximum:            p.ReceiveMaximum,
			TopicAliasMaximum:         p.TopicAliasMaximum,
			User:                      p.User,
			MaximumPacketSize:         p.MaximumPacketSize,
		},
		Will: storage.ClientWill(cl.Properties.Will),
	}).MarshalBinary()
	if err != nil {
		s.log.Error("session store: encode", "error", err)
		return
	}
	s.write("write", func(tx *bbolt.Tx) error {
		if err := tx.Bucket(bucketClients).Put([]byte(cl.ID), data); err != nil {
			return err
		}
		switch {
		case keepLeft:
			return nil
		case left.IsZero():
			return tx.Bucket(bucketLeft).Delete([]byte(cl.ID))
		default:
			return tx.Bucket(bucketLeft).Put([]byte(cl.ID), binary.BigEndian.AppendUint64(nil, uint64(left.UnixMilli())))
		}
	})
}

func (s *sessions) OnSessionEstablished(cl *mqtt.Client, _ packets.Packet) {
	if !persistent(cl) {
		// A clean start discards whatever an earlier session left.
		s.forget(cl.ID)
		return
	}
	s.updateClient(cl, time.Time{}, false)
}

func (s *sessions) OnWillSent(cl *mqtt.Client, _ packets.Packet) {
	s.updateClient(cl, time.Time{}, true)
}

func (s *sessions) OnDisconnect(cl *mqtt.Client, _ error, expire bool) {
	switch {
	case cl.StopCause() == packets.ErrSessionTakenOver || cl.IsTakenOver():
		// The session goes on in the new connection, which may already
		// have recorded itself.
	case expire:
		s.forget(cl.ID)
	case errors.Is(cl.StopCause(), packets.ErrServerShuttingDown):
		// Connected when the server stopped (or restored at start):
		// its interval counts from the restart, as mochi restores it.
	case cl.Net.Conn != nil:
		// Not a session restored at start (mochi reports those as
		// disconnected too; their record is already right). Written
		// again: a DISCONNECT may have changed its expiry interval.
		s.updateClient(cl, time.Now(), false)
	}
}

func (s *sessions) OnClientExpired(cl *mqtt.Client) { s.forget(cl.ID) }

// forget removes every trace of a client's session, in one transaction,
// and writes nothing when there is nothing to remove.
func (s *sessions) forget(clientID string) {
	s.storeMu.Lock()
	defer s.storeMu.Unlock()
	s.dropPending(clientID)
	if !s.holds(clientID) {
		return
	}
	s.write("delete", func(tx *bbolt.Tx) error { return deleteSession(tx, clientID) })
}

// deleteSession removes every record of a client's session, inside tx.
func deleteSession(tx *bbolt.Tx, clientID string) error {
	for _, b := range [][]byte{bucketClients, bucketLeft} {
		if err := tx.Bucket(b).Delete([]byte(clientID)); err != nil {
			return err
		}
	}
	if err := deletePrefix(tx, bucketSubs, clientID+"\x00"); err != nil {
		return err
	}
	return deletePrefix(tx, bucketInflight, clientID+"\x00")
}

func subKey(clientID, filter string) string { return clientID + "\x00" + filter }

func (s *sessions) OnSubscribed(cl *mqtt.Client, pk packets.Packet, codes []byte) {
	if !persistent(cl) {
		return
	}
	keys, records := make([][]byte, 0, len(pk.Filters)), make([][]byte, 0, len(pk.Filters))
	for i, f := range pk.Filters {
		if i >= len(codes) || codes[i] >= 0x80 {
			continue
		}
		data, err := (&storage.Subscription{
			ID:                subKey(cl.ID, f.Filter),
			T:                 storage.SubscriptionKey,
			Client:            cl.ID,
			Filter:            f.Filter,
			Qos:               codes[i],
			Identifier:        f.Identifier,
			NoLocal:           f.NoLocal,
			RetainHandling:    f.RetainHandling,
			RetainAsPublished: f.RetainAsPublished,
		}).MarshalBinary()
		if err != nil {
			s.log.Error("session store: encode", "error", err)
			continue
		}
		keys, records = append(keys, []byte(subKey(cl.ID, f.Filter))), append(records, data)
	}
	if len(keys) == 0 {
		return
	}
	s.write("write", func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketSubs)
		for i := range keys {
			if err := b.Put(keys[i], records[i]); err != nil {
				return err
			}
		}
		return nil
	})
}

// OnUnsubscribed drops the filters from a persistent session. A clean
// session stored none; when a session ends, forget has removed them all
// already (mochi reports every filter of a closing session here).
func (s *sessions) OnUnsubscribed(cl *mqtt.Client, pk packets.Packet) {
	if !persistent(cl) || len(pk.Filters) == 0 {
		return
	}
	s.write("delete", func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketSubs)
		for _, f := range pk.Filters {
			if err := b.Delete([]byte(subKey(cl.ID, f.Filter))); err != nil {
				return err
			}
		}
		return nil
	})
}

func (s *sessions) OnRetainMessage(cl *mqtt.Client, pk packets.Packet, r int64) {
	if r == -1 {
		s.OnRetainedExpired(pk.TopicName)
		return
	}
	s.put(bucketRetained, pk.TopicName, messageRecord(storage.RetainedKey+"_"+pk.TopicName, storage.RetainedKey, cl.ID, pk))
}

func (s *sessions) OnRetainedExpired(topic string) { s.del(bucketRetained, topic) }

func messageRecord(id, kind, client string, pk packets.Packet) *storage.Message {
	p := pk.Properties
	return &storage.Message{
		ID:          id,
		T:           kind,
		Client:      client,
		Origin:      pk.Origin,
		FixedHeader: pk.FixedHeader,
		TopicName:   pk.TopicName,
		Payload:     pk.Payload,
		Created:     pk.Created,
		PacketID:    pk.PacketID,
		Properties: storage.MessageProperties{
			PayloadFormat:          p.PayloadFormat,
			PayloadFormatFlag:      p.PayloadFormatFlag,
			MessageExpiryInterval:  p.MessageExpiryInterval,
			ContentType:            p.ContentType,
			ResponseTopic:          p.ResponseTopic,
			CorrelationData:        p.CorrelationData,
			SubscriptionIdentifier: p.SubscriptionIdentifier,
			User:                   p.User,
		},
	}
}

// inflightID names a message a session holds unacknowledged.
type inflightID struct {
	client string
	packet uint16
}

// key is the message's record key: formatted only when written, not on
// every publish and acknowledgement.
func (id inflightID) key() string { return fmt.Sprintf("%s\x00%05d", id.client, id.packet) }

// OnQosPublish records an outbound message awaiting acknowledgement. Only
// PUBLISH packets to persistent sessions matter: acks of inbound QoS 1
// messages are transient, and clean sessions end with their connection.
// The session's own copy is recorded: it carries the sequence number the
// broker's sequencer gave it.
func (s *sessions) OnQosPublish(cl *mqtt.Client, pk packets.Packet, _ int64, _ int) {
	if pk.FixedHeader.Type != packets.Publish || !persistent(cl) {
		return
	}
	held, ok := cl.State.Inflight.Get(pk.PacketID)
	switch {
	case ok:
		pk = held
	case cl.IsTakenOver():
		// Moved to the connection that took the session over, which
		// recorded it under its own id (see Broker.move): recorded
		// here, under this id, it could replace another message's
		// record.
		return
	}
	k := inflightID{cl.ID, pk.PacketID}
	s.mu.Lock()
	delete(s.pendingDel, k)
	s.pendingPut[k] = pk
	s.inflight[k] = struct{}{}
	s.mu.Unlock()
}

// rerecord makes the session's record under packet id what cl holds in
// flight under it now, or removes it if cl holds nothing there. The
// lookup is made under s.mu: an acknowledgement that removes the message
// from cl after it reports to OnQosComplete, which waits for s.mu, so the
// record never outlives the message.
func (s *sessions) rerecord(cl *mqtt.Client, id uint16) {
	if !persistent(cl) {
		return
	}
	k := inflightID{cl.ID, id}
	s.mu.Lock()
	defer s.mu.Unlock()
	if pk, ok := cl.State.Inflight.Get(id); ok {
		delete(s.pendingDel, k)
		s.pendingPut[k] = pk
		s.inflight[k] = struct{}{}
		return
	}
	delete(s.inflight, k)
	delete(s.pendingPut, k)
	s.pendingDel[k] = struct{}{}
}

func (s *sessions) OnQosComplete(cl *mqtt.Client, pk packets.Packet) {
	k := inflightID{cl.ID, pk.PacketID}
	s.mu.Lock()
	if _, ok := s.inflight[k]; ok {
		delete(s.inflight, k)
		if _, unwritten := s.pendingPut[k]; unwritten {
			delete(s.pendingPut, k)
		} else {
			s.pendingDel[k] = struct{}{}
		}
	}
	s.mu.Unlock()
}

// OnQosDropped forgets a message given up on, but not one a resumed
// session took with it (see hook.OnQosDropped): its record, under the
// same client id and packet id, stays.
func (s *sessions) OnQosDropped(cl *mqtt.Client, pk packets.Packet) {
	if !cl.IsTakenOver() {
		s.OnQosComplete(cl, pk)
	}
}

// dropPending forgets the client's messages not yet written or deleted.
func (s *sessions) dropPending(clientID string) {
	s.mu.Lock()
	for k := range s.inflight {
		if k.client == clientID {
			delete(s.inflight, k)
			delete(s.pendingPut, k)
			delete(s.pendingDel, k)
		}
	}
	s.mu.Unlock()
}

func (s *sessions) flushLoop() {
	defer close(s.done)
	t := time.NewTicker(inflightFlushInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			s.flush()
		case <-s.stop:
			s.flush()
			return
		}
	}
}

// flush writes the inflight changes gathered since the last flush in one
// transaction.
func (s *sessions) flush() {
	s.storeMu.Lock()
	defer s.storeMu.Unlock()
	s.mu.Lock()
	puts, dels := s.pendingPut, s.pendingDel
	if len(puts) == 0 && len(dels) == 0 {
		s.mu.Unlock()
		return
	}
	s.pendingPut, s.pendingDel = map[inflightID]packets.Packet{}, map[inflightID]struct{}{}
	s.mu.Unlock()
	err := s.db.Update(func(tx *bbolt.Tx) error {
		b := tx.Bucket(bucketInflight)
		for k := range dels {
			if err := b.Delete([]byte(k.key())); err != nil {
				return err
			}
		}
		for k, pk := range puts {
			key := k.key()
			data, err := messageRecord(key, storage.InflightKey, k.client, pk).MarshalBinary()
			if err != nil {
				return err
			}
			if err := b.Put([]byte(key), data); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		s.log.Error("session store: flush inflight", "error", err)
	}
}

// StoredClients returns the persistent sessions to restore: those that
// expired while the server was down are deleted instead, and the others
// get what is left of their expiry interval, which mochi counts from now.
func (s *sessions) StoredClients() ([]storage.Client, error) {
	clients, err := load[storage.Client](s, bucketClients)
	if err != nil {
		return nil, err
	}
	left := map[string]time.Time{}
	_ = s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucketLeft).ForEach(func(k, v []byte) error {
			if len(v) == 8 {
				left[string(k)] = time.UnixMilli(int64(binary.BigEndian.Uint64(v)))
			}
			return nil
		})
	})
	now := time.Now()
	out := clients[:0]
	var expired []string
	for _, c := range clients {
		remaining, gone := remainingExpiry(c, left[c.ID], now)
		if gone {
			expired = append(expired, c.ID)
			continue
		}
		c.Properties.SessionExpiryInterval = remaining
		out = append(out, c)
	}
	if len(expired) > 0 {
		s.log.Info("sessions expired while the server was down", "sessions", len(expired))
		s.forgetAll(expired)
	}
	return out, nil
}

// forgetAll removes every trace of the sessions of clientIDs in one
// transaction (forget is one each, and a start after a long outage may
// find thousands).
func (s *sessions) forgetAll(clientIDs []string) {
	s.storeMu.Lock()
	defer s.storeMu.Unlock()
	for _, id := range clientIDs {
		s.dropPending(id)
	}
	s.write("delete expired sessions", func(tx *bbolt.Tx) error {
		for _, id := range clientIDs {
			if err := deleteSession(tx, id); err != nil {
				return err
			}
		}
		return nil
	})
}

// remainingExpiry returns what is left at now of the expiry interval of a
// session whose connection ended at left (zero: unknown, the interval is
// whole), and whether nothing is left. Only MQTT 5 sessions say their
// interval; an MQTT 3 session is kept as before.
func remainingExpiry(c storage.Client, left, now time.Time) (uint32, bool) {
	interval := c.Properties.SessionExpiryInterval
	if left.IsZero() || c.ProtocolVersion != 5 || !c.Properties.SessionExpiryIntervalFlag {
		return interval, false
	}
	gone := now.Sub(left)
	if gone < 0 {
		gone = 0 // the clock went back: count from now
	}
	full := time.Duration(interval) * time.Second
	if gone >= full {
		return 0, true
	}
	return uint32((full - gone + time.Second - 1) / time.Second), false // rounded up: never shorter than asked
}

func (s *sessions) StoredSubscriptions() ([]storage.Subscription, error) {
	return load[storage.Subscription](s, bucketSubs)
}

func (s *sessions) StoredRetainedMessages() ([]storage.Message, error) {
	return load[storage.Message](s, bucketRetained)
}

func (s *sessions) StoredInflightMessages() ([]storage.Message, error) {
	msgs, err := load[storage.Message](s, bucketInflight)
	s.mu.Lock()
	for _, m := range msgs {
		s.inflight[inflightID{m.Client, m.PacketID}] = struct{}{}
	}
	s.mu.Unlock()
	return msgs, err
}

// load decodes every record of a bucket.
func load[T any, PT interface {
	*T
	UnmarshalBinary([]byte) error
}](s *sessions, bucket []byte) ([]T, error) {
	var out []T
	err := s.db.View(func(tx *bbolt.Tx) error {
		return tx.Bucket(bucket).ForEach(func(k, v []byte) error {
			var rec T
			if err := PT(&rec).UnmarshalBinary(v); err != nil {
				return fmt.Errorf("%w %q: %v", errCorruptSession, k, err)
			}
			out = append(out, rec)
			return nil
		})
	})
	return out, err
}

var errCorruptSession = errors.New("corrupt session record")

// Stop flushes what is pending and closes the file.
func (s *sessions) Stop() error {
	select {
	case <-s.stop:
		return nil
	default:
	}
	close(s.stop)
	<-s.done
	return s.db.Close()
}
