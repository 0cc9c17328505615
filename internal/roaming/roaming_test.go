package roaming_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/roaming"
	"github.com/mqkv/mqkv/internal/server"
)

// newStore is a Store on the real store of a node on its own, in memory.
func newStore(t *testing.T) *roaming.Store {
	t.Helper()
	s, err := server.Start(server.Config{Listen: "127.0.0.1:0", InMemory: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return roaming.New(s.Node())
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

// wait writes nothing itself: it returns once what was queued before it
// is written (a session record queued last, waited for).
func wait(t *testing.T, st *roaming.Store, client string, s *roaming.Session) {
	t.Helper()
	done := make(chan error, 1)
	st.PutSession(client, s, func(err error) { done <- err })
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// Changes to one key apply in the order they were made, across rounds;
// Load gives the session with its messages oldest first, with their ids.
func TestChangesApplyInOrder(t *testing.T) {
	st := newStore(t)
	msg := func(payload string) *roaming.Message {
		return &roaming.Message{Seq: st.NextSeq(), Msg: mesh.Message{Topic: "t", Payload: []byte(payload), QoS: 1}}
	}
	// Message 3 is written, deleted (acknowledged) and its id used again.
	st.PutMessage("c", 3, msg("first"), nil)
	st.PutMessage("c", 7, msg("second"), nil)
	st.DeleteMessage("c", 3)
	wait(t, st, "c", &roaming.Session{Node: "n1", Expiry: 60})
	st.PutMessage("c", 3, msg("third"), nil)
	wait(t, st, "c", &roaming.Session{Node: "n1", Expiry: 60, Subscriptions: []roaming.Subscription{{Filter: "t", QoS: 1}}})

	s, v, err := st.Load(ctx(t), "c")
	if err != nil || s == nil || v.IsZero() {
		t.Fatal(s, v, err)
	}
	var got []string
	for _, m := range s.Messages {
		got = append(got, string(m.Msg.Payload)+"@"+string(rune('0'+m.ID)))
	}
	if len(got) != 2 || got[0] != "second@7" || got[1] != "third@3" {
		t.Fatalf("messages %v, want second@7 then third@3", got)
	}
	if len(s.Subscriptions) != 1 || s.Subscriptions[0].Filter != "t" {
		t.Fatalf("subscriptions %+v", s.Subscriptions)
	}
	if st.Writes.Load() == 0 || st.Rounds.Load() == 0 {
		t.Fatal("writes not counted")
	}
}

// Replace changes a record only at the version read, and its removal
// takes the session's messages along.
func TestReplaceIsCompareAndSet(t *testing.T) {
	st := newStore(t)
	st.PutMessage("d", 1, &roaming.Message{Seq: 1, Msg: mesh.Message{Topic: "t", QoS: 1}}, nil)
	wait(t, st, "d", &roaming.Session{Node: "n1", Expiry: 60})
	_, v, err := st.Load(ctx(t), "d")
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := st.Replace(ctx(t), "d", hlc.Timestamp{}, nil); ok || err != nil {
		t.Fatalf("replaced at a version never read: %v %v", ok, err)
	}
	if ok, err := st.Replace(ctx(t), "d", v, &roaming.Session{Node: "n2", Expiry: 60}); !ok || err != nil {
		t.Fatalf("replace at the version read: %v %v", ok, err)
	}
	if ok, _ := st.Replace(ctx(t), "d", v, nil); ok {
		t.Fatal("replaced twice at one version")
	}
	var nodes []string
	if err := st.Sessions(ctx(t), func(id string, s *roaming.Session, _ hlc.Timestamp) { nodes = append(nodes, id+"@"+s.Node) }); err != nil || len(nodes) != 1 || nodes[0] != "d@n2" {
		t.Fatalf("sessions %v %v", nodes, err)
	}
	_, v, _ = st.Load(ctx(t), "d")
	if ok, err := st.Replace(ctx(t), "d", v, nil); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if s, _, err := st.Load(ctx(t), "d"); s != nil || err != nil {
		t.Fatalf("session still there: %+v %v", s, err)
	}
	if ids, err := st.MessageIDs(ctx(t), "d"); len(ids) != 0 || err != nil {
		t.Fatalf("messages left: %v %v", ids, err)
	}
}

// A message's expiry counts the time it was kept.
func TestLiveShortensExpiry(t *testing.T) {
	now := time.Now()
	m := roaming.Message{At: now.Add(-3 * time.Second).UnixMilli(), Msg: mesh.Message{Expiry: 10}}
	if got, ok := m.Live(now); !ok || got.Msg.Expiry != 7 {
		t.Fatalf("%+v %v", got.Msg, ok)
	}
	m.Msg.Expiry = 2
	if _, ok := m.Live(now); ok {
		t.Fatal("an expired message is live")
	}
}
