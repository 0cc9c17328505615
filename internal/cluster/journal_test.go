package cluster

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/hashicorp/raft"
	raftwal "github.com/hashicorp/raft-wal"

	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/store"
)

// A node whose data directory was written by a release that kept a log
// per group (groups/N/wal, meta/wal) starts with everything in it, moved
// into the node's journal.
func TestLogsOfEarlierReleaseMoveIntoJournal(t *testing.T) {
	t.Parallel()
	h := newHarness(t, 1, 4)
	for i := 0; i < 50; i++ {
		if res, err := set(t, h.nodes[0], fmt.Sprintf("k%d", i), "v"); err != nil || res.Outcome != store.Applied {
			t.Fatal(res, err)
		}
	}
	h.stop(0)
	dir := h.dirs[0]
	toOldLayout(t, dir)

	h.start(0)
	h.awaitReplicas(1)
	for i := 0; i < 50; i++ {
		k := fmt.Sprintf("k%d", i)
		if e, ok, err := h.nodes[0].Get(ctx(t), []byte(k)); err != nil || !ok || string(e.Value) != "v" {
			t.Fatalf("%s after the move: %+v %v %v", k, e, ok, err)
		}
	}
	if res, err := set(t, h.nodes[0], "after", "v"); err != nil || res.Outcome != store.Applied {
		t.Fatal(res, err)
	}
	old, _ := filepath.Glob(filepath.Join(dir, "*", "*", "wal"))
	meta, _ := filepath.Glob(filepath.Join(dir, "meta", "wal"))
	if len(old)+len(meta) > 0 {
		t.Fatalf("old logs left: %v %v", old, meta)
	}
}

// toOldLayout writes every group's log from the node's journal into a
// raft-wal log of its own, as the earlier release kept them, and removes
// the journal.
func toOldLayout(t *testing.T, dir string) {
	t.Helper()
	jdir := filepath.Join(dir, "journal")
	j, err := journal.Open(jdir, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range j.Groups() {
		gdir := filepath.Join(dir, "meta")
		if id != metaGroup {
			gdir = filepath.Join(dir, "groups", strconv.Itoa(int(id)))
		}
		if err := os.MkdirAll(filepath.Join(gdir, "wal"), 0o700); err != nil {
			t.Fatal(err)
		}
		w, err := raftwal.Open(filepath.Join(gdir, "wal"))
		if err != nil {
			t.Fatal(err)
		}
		src := j.Group(id)
		for _, k := range []string{"CurrentTerm", "LastVoteTerm", "LastVoteCand"} {
			if v, _ := src.Get([]byte(k)); len(v) > 0 {
				if err := w.Set([]byte(k), v); err != nil {
					t.Fatal(err)
				}
			}
		}
		first, _ := src.FirstIndex()
		last, _ := src.LastIndex()
		for i := first; i <= last && last > 0; i++ {
			l := new(raft.Log)
			if err := src.GetLog(i, l); err != nil {
				t.Fatal(err)
			}
			if err := w.StoreLog(l); err != nil {
				t.Fatal(err)
			}
		}
		w.Close()
	}
	j.Close()
	if err := os.RemoveAll(jdir); err != nil {
		t.Fatal(err)
	}
}

// A crash in the middle of moving a group's old log into the journal
// leaves part of it there; the next start moves it again, whole, and only
// then lets the old log go.
func TestInterruptedMoveIsRedone(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	gdir := filepath.Join(dir, "meta")
	wdir := filepath.Join(gdir, "wal")
	os.MkdirAll(wdir, 0o700)
	w, err := raftwal.Open(wdir)
	if err != nil {
		t.Fatal(err)
	}
	w.SetUint64([]byte("CurrentTerm"), 5)
	for i := uint64(1); i <= 10; i++ {
		w.StoreLog(&raft.Log{Index: i, Term: 5, Type: raft.LogNoop})
	}
	w.Close()

	j, err := journal.Open(filepath.Join(dir, "journal"), journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	// copyLog's first durable step, then the process died.
	if err := j.Group(metaGroup).SetUint64([]byte("CurrentTerm"), 5); err != nil {
		t.Fatal(err)
	}
	n := &Node{journal: j, log: slog.Default()}
	l, err := n.groupLog(metaGroup, gdir)
	if err != nil {
		t.Fatal(err)
	}
	if last, _ := l.LastIndex(); last != 10 {
		t.Fatalf("after restart: last index %d, want 10", last)
	}
	if v, _ := l.GetUint64([]byte("CurrentTerm")); v != 5 {
		t.Fatalf("CurrentTerm %d", v)
	}
	if _, err := os.Stat(wdir); !os.IsNotExist(err) {
		t.Fatalf("the old log is still there: %v", err)
	}
}
