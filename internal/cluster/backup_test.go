package cluster

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// A cluster backup reads each group's copy a page at a time, from the
// node that holds it, and merges them in key order: it holds every key as
// it was when its group was copied, none written after, and the holders
// let their copies go at the end.
func TestBackupPagesThroughEveryGroup(t *testing.T) {
	defer func(b int) { copyPageBytes = b }(copyPageBytes)
	copyPageBytes = 8 << 10 // about eight entries a page
	h := newHarness(t, 3, 4)
	value := func(i int) string { return fmt.Sprintf("v%d-", i) + strings.Repeat("x", 1000) }
	const keys = 300
	for i := range keys {
		if _, err := set(t, h.nodes[i%3], fmt.Sprint("k-", i), value(i)); err != nil {
			t.Fatal(err)
		}
	}
	var buf bytes.Buffer
	var announced int
	err := h.nodes[0].Backup(context.Background(), func(_ hlc.Timestamp, n int) {
		announced = n
		// Every group is copied by now: what follows is not in it.
		set(t, h.nodes[1], "k-0", "overwritten")
		set(t, h.nodes[2], "late", "v")
	}, &buf)
	if err != nil {
		t.Fatal(err)
	}
	st := store.New(store.Limits{})
	if err := st.ReadSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	if st.Len() != keys || announced != keys {
		t.Fatalf("the backup holds %d keys, announced %d; want %d", st.Len(), announced, keys)
	}
	for i := range keys {
		e, ok := st.Get([]byte(fmt.Sprint("k-", i)), 0)
		if !ok || string(e.Value) != value(i) {
			t.Fatalf("k-%d in the backup: %v %+v", i, ok, e)
		}
	}
	remote := 0
	for i, n := range h.nodes {
		n.copies.mu.Lock()
		held := len(n.copies.held)
		remote += int(n.copies.next)
		n.copies.mu.Unlock()
		if held != 0 {
			t.Errorf("n%d still holds %d copies", i+1, held)
		}
	}
	if remote == 0 {
		t.Error("every group was copied on the node serving the backup: no page crossed the link")
	}
}
