package statestore

import (
	"fmt"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

func ev(key string, wall int64) store.Event {
	return store.Event{Kind: store.EventSet, Key: []byte(key), Value: []byte("v"), Version: hlc.Timestamp{Wall: wall, Node: "n1"}}
}

func keysOf(cs []change) string {
	s := ""
	for _, c := range cs {
		s += fmt.Sprintf("%s@%d ", c.Key, c.Version.Wall)
	}
	return s
}

// In a cluster, one group's change can arrive after a newer one of
// another: a watcher resuming after the last change it saw is replayed
// what arrived after it, the late one included.
func TestHistoryReplaysInArrivalOrder(t *testing.T) {
	h := newHistory(DefaultHistory)
	h.start(hlc.Timestamp{Wall: 1, Node: "n1"})
	m, err := glob.Compile([]byte("k*"))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	h.add([]store.Event{ev("ka", 10)}, now) // group A
	h.add([]store.Event{ev("kb", 30)}, now) // group B: the watcher saw this last
	h.add([]store.Event{ev("kc", 20)}, now) // group C, late
	h.add([]store.Event{ev("kb", 40)}, now)

	got, ok := h.after(m, hlc.Timestamp{Wall: 30, Node: "n1"})
	if want := "kc@20 kb@40 "; !ok || keysOf(got) != want {
		t.Fatalf("after kb@30: %q %v, want %q", keysOf(got), ok, want)
	}
	// A version that names no change says nothing about arrival order
	// once changes arrived out of order: the client must reread.
	if _, ok := h.after(m, hlc.Timestamp{Wall: 25, Node: "n1"}); ok {
		t.Fatal("a version naming no change was replayed in a disordered history")
	}
	// A key's changes always arrive in order: per key, a version suffices.
	if got, ok := h.since([]byte("kb"), nil, hlc.Timestamp{Wall: 25, Node: "n1"}); !ok || keysOf(got) != "kb@30 kb@40 " {
		t.Fatalf("since kb@25: %q %v", keysOf(got), ok)
	}
}

// On a node on its own changes arrive in version order: any version works.
func TestHistoryInOrderTakesAnyVersion(t *testing.T) {
	h := newHistory(DefaultHistory)
	h.start(hlc.Timestamp{Wall: 1, Node: "n1"})
	m, _ := glob.Compile([]byte("k*"))
	for i := int64(1); i <= 5; i++ {
		h.add([]store.Event{ev(fmt.Sprintf("k%d", i), 10*i)}, time.Now())
	}
	if got, ok := h.after(m, hlc.Timestamp{Wall: 25, Node: "n1"}); !ok || keysOf(got) != "k3@30 k4@40 k5@50 " {
		t.Fatalf("after 25: %q %v", keysOf(got), ok)
	}
	if got, ok := h.after(m, hlc.Timestamp{Wall: 30, Node: "n1"}); !ok || keysOf(got) != "k4@40 k5@50 " {
		t.Fatalf("after 30: %q %v", keysOf(got), ok)
	}
}

// A change forgotten after the resume point makes the replay incomplete.
func TestHistoryAfterForgotten(t *testing.T) {
	h := newHistory(HistoryLimits{PerPartition: 1})
	h.start(hlc.Timestamp{Wall: 1, Node: "n1"})
	m, _ := glob.Compile([]byte("k*"))
	h.add([]store.Event{ev("ka", 10)}, time.Now())
	h.add([]store.Event{ev("kb", 20), ev("kb", 30)}, time.Now()) // kb@20 forgotten
	if _, ok := h.after(m, hlc.Timestamp{Wall: 10, Node: "n1"}); ok {
		t.Fatal("replayed although kb@20 was forgotten")
	}
}
