package broker

import (
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/mochi-mqtt/server/v2/hooks/storage"
	"go.etcd.io/bbolt"
)

// TestExpiredSessionsAreDroppedAtStart: the sessions that expired while
// the server was down are not restored, and every record of theirs goes,
// in one transaction (found by review: one bbolt Batch each, from the one
// goroutine that loads the store, each waiting MaxBatchDelay and an
// fsync, held the start 4.6 s for 400 sessions).
func TestExpiredSessionsAreDroppedAtStart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sessions.db")
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	s, err := openSessions(path, log)
	if err != nil {
		t.Fatal(err)
	}
	const n = 400
	left := binary.BigEndian.AppendUint64(nil, uint64(time.Now().Add(-time.Hour).UnixMilli()))
	err = s.db.Update(func(tx *bbolt.Tx) error {
		for i := 0; i < n; i++ {
			id := fmt.Sprintf("device-%d", i)
			data, err := (&storage.Client{ID: id, T: storage.ClientKey, ProtocolVersion: 5,
				Properties: storage.ClientProperties{SessionExpiryInterval: 60, SessionExpiryIntervalFlag: true}}).MarshalBinary()
			if err != nil {
				return err
			}
			if err := tx.Bucket(bucketClients).Put([]byte(id), data); err != nil {
				return err
			}
			if err := tx.Bucket(bucketLeft).Put([]byte(id), left); err != nil {
				return err
			}
			if err := tx.Bucket(bucketSubs).Put([]byte(subKey(id, "a/b")), []byte("x")); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	s.Stop()

	s, err = openSessions(path, log)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	start := time.Now()
	clients, err := s.StoredClients()
	t.Logf("%d expired sessions dropped in %v", n, time.Since(start).Round(time.Millisecond))
	if err != nil || len(clients) != 0 {
		t.Fatalf("StoredClients: %d clients, %v; want none", len(clients), err)
	}
	_ = s.db.View(func(tx *bbolt.Tx) error {
		for _, b := range [][]byte{bucketClients, bucketLeft, bucketSubs} {
			if k, _ := tx.Bucket(b).Cursor().First(); k != nil {
				t.Errorf("bucket %s still holds %q", b, k)
			}
		}
		return nil
	})
}
