package admin

import (
	"fmt"
	"testing"

	"github.com/mqkv/mqkv/internal/store"
)

func events(from, n int) []store.Event {
	evs := make([]store.Event, n)
	for i := range evs {
		evs[i] = store.Event{Kind: store.EventSet, Key: []byte(fmt.Sprint("k", from+i)), Value: []byte("v")}
	}
	return evs
}

// TestFeedKeepsTheLastChanges: a viewer that arrives gets the last
// feedRecent changes, oldest first, however the batches before were cut;
// one that watches gets every change after.
func TestFeedKeepsTheLastChanges(t *testing.T) {
	f := newFeed()
	next := 0
	for _, n := range []int{1, 7, feedRecent - 1, 3, feedRecent + 9, 2, 33, 1} {
		f.Events(events(next, n))
		next += n
		if len(f.recent) > 2*feedRecent {
			t.Fatalf("kept %d events", len(f.recent))
		}
	}
	ch, recent, ok := f.subscribe()
	if !ok {
		t.Fatal("refused")
	}
	if len(recent) != feedRecent {
		t.Fatalf("%d recent changes", len(recent))
	}
	for i, c := range recent {
		if want := fmt.Sprint("k", next-feedRecent+i); c.Key != want || c.Op != "SET" {
			t.Fatalf("recent[%d] = %+v, want key %s", i, c, want)
		}
	}
	f.Events([]store.Event{{Kind: store.EventDelete, Key: []byte{0xff}}})
	if c := <-ch; c.Op != "DELETE" || c.KeyHex != "ff" {
		t.Fatalf("live change %+v", c)
	}
	f.unsubscribe(ch)

	// A large value is kept only as far as it is shown.
	big := make([]byte, 1<<20)
	f.Events([]store.Event{{Kind: store.EventSet, Key: []byte("big"), Value: big}})
	if kept := f.recent[len(f.recent)-1].Value; len(kept) != valuePreview || &kept[0] == &big[0] {
		t.Fatalf("kept %d bytes of a 1 MiB value, shared: %v", len(kept), &kept[0] == &big[0])
	}
}
