package replica

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
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
// wait for a voter it never had. Keys 0-3 are in the snapshot, 4-9 only
// in the log after it.
func TestDamagedSnapshotMetadataIsReported(t *testing.T) {
	for name, damage := range map[string]func(m map[string]any){
		"index": func(m map[string]any) { m["Index"] = m["Index"].(float64) + 3 },
		"membership": func(m map[string]any) {
			srv := m["Configuration"].(map[string]any)["Servers"].([]any)[0].(map[string]any)
			srv["ID"] = "n2"
		},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			g := open(t, dir, nil)
			key := func(i int) store.Command {
				return store.Command{Op: store.OpSet, Key: []byte(fmt.Sprint("key-", i)), Value: []byte("value")}
			}
			for i := 0; i < 4; i++ {
				write(t, g, key(i), hlc.Timestamp{})
			}
			if err := g.Snapshot(); err != nil {
				t.Fatal(err)
			}
			for i := 4; i < 10; i++ {
				write(t, g, key(i), hlc.Timestamp{})
			}
			g.Close()
			metas, _ := filepath.Glob(filepath.Join(dir, "snapshots", "*", "meta.json"))
			if len(metas) != 1 {
				t.Fatalf("snapshots: %v", metas)
			}
			data, err := os.ReadFile(metas[0])
			if err != nil {
				t.Fatal(err)
			}
			var m map[string]any
			if err := json.Unmarshal(data, &m); err != nil {
				t.Fatal(err)
			}
			damage(m)
			if data, err = json.Marshal(m); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(metas[0], data, 0o600); err != nil {
				t.Fatal(err)
			}
			g2, err := Open(Config{NodeID: "n1", Dir: dir})
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
			for i := 0; i < 10; i++ {
				if _, ok := g2.Get(key(i).Key); !ok {
					t.Errorf("acknowledged key-%d is gone, and the group started without a word", i)
				}
			}
		})
	}
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
