package broker

import (
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"testing"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// TestTakeoverRenumberKeepsTheSessionRecords: a message routed to the old
// connection in a takeover, whose packet id the new connection already
// gave its own message, moves under a new id. After it, the session store
// holds each message once, under the id it goes by: the new connection's
// message is not replaced by the moved one, which a restart would resend
// twice while the other was lost.
func TestTakeoverRenumberKeepsTheSessionRecords(t *testing.T) {
	srv := mqtt.New(&mqtt.Options{InlineClient: true})
	defer srv.Close()
	s, err := openSessions(filepath.Join(t.TempDir(), "sessions.db"), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	b := &Broker{srv: srv, log: slog.New(slog.NewTextHandler(io.Discard, nil)), sessions: s}

	client := func() *mqtt.Client {
		cl := srv.NewClient(nil, "t", "sub", false) // no connection: writes are dropped
		cl.Properties.ProtocolVersion = 5
		cl.Properties.Props.SessionExpiryInterval = 3600
		return cl
	}
	prev, next := client(), client()
	message := func(id uint16, payload string) packets.Packet {
		return packets.Packet{
			FixedHeader: packets.FixedHeader{Type: packets.Publish, Qos: 1},
			TopicName:   "a/b", Payload: []byte(payload), PacketID: id,
			ProtocolVersion: 5,
		}
	}
	// next's own message took id 1; then one routed to prev got id 1
	// from prev's counter, and its record replaced next's.
	own, moved := message(1, "own"), message(1, "moved")
	next.State.Inflight.Set(own)
	s.OnQosPublish(next, own, 0, 0)
	prev.State.Inflight.Set(moved)
	s.OnQosPublish(prev, moved, 0, 0)

	b.move(next, prev, moved)

	s.flush()
	recs, err := s.StoredInflightMessages()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range recs {
		got = append(got, fmt.Sprintf("%s@%d", r.Payload, r.PacketID))
	}
	slices.Sort(got)
	if want := []string{"moved@2", "own@1"}; !slices.Equal(got, want) {
		t.Fatalf("session records after the move: %q, want %q", got, want)
	}

	// Once the client acknowledges its message under id 1, the record
	// goes, and a later rerecord of the free id leaves none behind.
	next.State.Inflight.Delete(1)
	s.OnQosComplete(next, own)
	s.rerecord(next, 1)
	s.flush()
	if recs, _ = s.StoredInflightMessages(); len(recs) != 1 || string(recs[0].Payload) != "moved" {
		t.Fatalf("after the acknowledgement: %d records, want the moved message's only", len(recs))
	}
}
