package replica

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// A damaged meta.json (hashicorp's file snapshot store does not checksum
// it) must be reported, not believed: an index too high made raft skip
// the log entries after the snapshot, a membership changed made the group
// wait for a voter it never had, a size changed is what a leader announces
// to a follower it sends the snapshot to. And a refused newest snapshot
// must not make raft fall back to the older one: the log no longer holds
// the entries after it (two snapshots 1,190 entries apart, 1,024 kept),
// and raft panicked on the first one missing. Keys 1,200 and on are only
// in the log.
func TestDamagedSnapshotMetadataIsReported(t *testing.T) {
	edit := func(change func(m map[string]any)) func([]byte) []byte {
		return func(data []byte) []byte {
			var m map[string]any
			if err := json.Unmarshal(data, &m); err != nil {
				t.Fatal(err)
			}
			change(m)
			out, err := json.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			return out
		}
	}
	for name, damage := range map[string]func([]byte) []byte{
		"index": edit(func(m map[string]any) { m["Index"] = m["Index"].(float64) + 3 }),
		"membership": edit(func(m map[string]any) {
			srv := m["Configuration"].(map[string]any)["Servers"].([]any)[0].(map[string]any)
			srv["ID"] = "n2"
		}),
		"size":       edit(func(m map[string]any) { m["Size"] = m["Size"].(float64) + 1<<20 }),
		"unparsable": func(data []byte) []byte { data[0] ^= 1; return data },
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			g := open(t, dir, nil)
			key := func(i int) store.Command {
				return store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint("key-", i)), Value: []byte("value")}
			}
			for i := 0; i < 1210; i++ {
				write(t, g, key(i), hlc.Timestamp{})
				if i == 9 || i == 1199 {
					if err := g.Snapshot(); err != nil {
						t.Fatal(err)
					}
				}
			}
			g.Close()
			metas, _ := filepath.Glob(filepath.Join(dir, "snapshots", "*", "meta.json"))
			if len(metas) != 2 {
				t.Fatalf("snapshots: %v", metas)
			}
			slices.SortFunc(metas, func(a, b string) int { return snapshotIndex(t, a) - snapshotIndex(t, b) })
			newest := metas[1]
			data, err := os.ReadFile(newest)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(newest, damage(data), 0o600); err != nil {
				t.Fatal(err)
			}
			var g2 *Group
			func() {
				defer func() {
					if r := recover(); r != nil {
						t.Fatalf("the open panicked: %v", r)
					}
				}()
				g2, err = Open(Config{NodeID: "n1", Dir: dir})
			}()
			if err == nil {
				defer g2.Close()
				err = g2.AwaitLeader(5 * time.Second)
			}
			if damaged := new(DamagedError); errors.As(err, &damaged) {
				if !strings.Contains(err.Error(), "meta.json") {
					t.Errorf("the error does not say what is damaged: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("not reported as damage: %v", err)
			}
			for i := 0; i < 1210; i++ {
				if _, ok := g2.Get(key(i).Key); !ok {
					t.Fatalf("acknowledged key-%d is gone, and the group started without a word", i)
				}
			}
		})
	}
}

// snapshotIndex reads the index of a snapshot from its directory's name
// (term-index-time), which the damage leaves alone.
func snapshotIndex(t *testing.T, meta string) int {
	var term, index, ms int
	if _, err := fmt.Sscanf(filepath.Base(filepath.Dir(meta)), "%d-%d-%d", &term, &index, &ms); err != nil {
		t.Fatal(err)
	}
	return index
}

// A snapshot written before snapshots carried a copy of their metadata
// still opens.
func TestSnapshotWithoutMetadataCopyOpens(t *testing.T) {
	dir := t.TempDir()
	st := store.New(store.Limits{})
	st.Apply(&store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("v"), Version: hlc.Timestamp{Wall: 1, Node: "n1"}}, nil)
	fss, err := raft.NewFileSnapshotStoreWithLogger(dir, retainSnapshots, raftLogger())
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("n1")
	sink, err := fss.Create(raft.SnapshotVersionMax, 1, 1, raft.Configuration{Servers: []raft.Server{{ID: "n1", Address: "n1"}}}, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.WriteSnapshot(sink); err != nil {
		t.Fatal(err)
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	g := open(t, dir, nil)
	defer g.Close()
	if e, ok := g.Get([]byte("k")); !ok || string(e.Value) != "v" {
		t.Fatalf("the key from the old snapshot: %+v %v", e, ok)
	}
}

// A snapshot with its copy of the metadata is still what a release
// before the copy reads: the file store's own, and the store's format.
func TestCheckedSnapshotReadsWithoutTheCheck(t *testing.T) {
	dir := t.TempDir()
	g := open(t, dir, nil)
	write(t, g, store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("v")}, hlc.Timestamp{})
	if err := g.Snapshot(); err != nil {
		t.Fatal(err)
	}
	g.Close()
	fss, err := raft.NewFileSnapshotStoreWithLogger(dir, retainSnapshots, raftLogger())
	if err != nil {
		t.Fatal(err)
	}
	metas, err := fss.List()
	if err != nil || len(metas) != 1 {
		t.Fatalf("snapshots: %v %v", metas, err)
	}
	_, rc, err := fss.Open(metas[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	st := store.New(store.Limits{})
	if err := st.ReadSnapshot(rc); err != nil {
		t.Fatal(err)
	}
	if e, ok := st.Get([]byte("k"), 0); !ok || string(e.Value) != "v" {
		t.Fatalf("k: %v %v", e, ok)
	}
}
