package statestore

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// TestHistoryKeepsTheNewestChanges drives one partition's ring through
// growth, many wraps and every kind of trimming, and checks each time
// against the changes a plain list would keep: the newest PerPartition,
// none older than MaxAge, and whatever SINCE replays in version order.
func TestHistoryKeepsTheNewestChanges(t *testing.T) {
	const per = 6
	h := newHistory(HistoryLimits{PerPartition: per, MaxAge: time.Minute, MaxBytes: 1 << 20})
	h.begin(everywhere(hlc.Timestamp{Wall: 1}))
	rng := rand.New(rand.NewPCG(1, 2))
	key := []byte("k")
	var kept []store.Event // what a list would keep, oldest first
	now := time.Unix(1000, 0)
	var times []time.Time
	for i := 1; i <= 500; i++ {
		if rng.IntN(20) == 0 {
			now = now.Add(2 * time.Minute) // everything kept so far ages out with the next add
		} else {
			now = now.Add(time.Second)
		}
		ev := store.Event{Kind: store.EventSet, Key: key, Value: []byte(fmt.Sprint(i)), Version: hlc.Timestamp{Wall: int64(i + 1), Node: "n"}}
		h.add([]store.Event{ev}, now)
		kept, times = append(kept, ev), append(times, now)
		for len(kept) > per || now.Sub(times[0]) > time.Minute {
			kept, times = kept[1:], times[1:]
		}
		got, ok := h.since(key, nil, hlc.Timestamp{Wall: 1})
		if len(kept) > 0 && kept[0].Version.Wall > 2 {
			// The oldest changes are forgotten: a SINCE from before them
			// is truncated, one from the last forgotten is not.
			if ok {
				t.Fatalf("add %d: SINCE before the forgotten changes replayed %d", i, len(got))
			}
			got, ok = h.since(key, nil, hlc.Timestamp{Wall: kept[0].Version.Wall - 1, Node: "n"})
		}
		if !ok || len(got) != len(kept) {
			t.Fatalf("add %d: replayed %d (ok %v), want %d", i, len(got), ok, len(kept))
		}
		for j := range got {
			if string(got[j].Value) != string(kept[j].Value) || got[j].Version != kept[j].Version {
				t.Fatalf("add %d: change %d is %s@%v, want %s@%v", i, j, got[j].Value, got[j].Version, kept[j].Value, kept[j].Version)
			}
		}
	}
	if n := h.head - h.tail; n > per+1 || len(h.recs) > 1024 {
		t.Fatalf("%d records held (a ring of %d) for %d changes kept", n, len(h.recs), per)
	}
}

// TestHistoryByteBudget: over MaxBytes, the oldest changes are
// forgotten, of whatever partition (the newest is kept), and the byte
// count follows.
func TestHistoryByteBudget(t *testing.T) {
	h := newHistory(HistoryLimits{PerPartition: 100, MaxBytes: 100})
	h.begin(everywhere(hlc.Timestamp{Wall: 1}))
	now := time.Unix(1000, 0)
	for i := 0; i < 50; i++ {
		k := []byte(fmt.Sprintf("key-%02d", i%5)) // 6 bytes
		h.add([]store.Event{{Kind: store.EventSet, Key: k, Value: make([]byte, 14), Version: hlc.Timestamp{Wall: int64(i + 2)}}}, now)
		if h.bytes > 100 {
			t.Fatalf("add %d: %d bytes kept, budget 100", i, h.bytes)
		}
	}
	var n int64
	for seq := h.tail; seq < h.head; seq++ {
		n += h.rec(seq).size()
	}
	if n != h.bytes || n != 100 {
		t.Fatalf("the changes hold %d bytes, the count says %d, want 100", n, h.bytes)
	}
	m, err := glob.Compile([]byte("key-*"))
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := h.since(nil, m, hlc.Timestamp{Wall: 46}); !ok || len(got) != 5 {
		t.Fatalf("the newest 5 changes: got %d (ok %v)", len(got), ok)
	}
	if _, ok := h.since(nil, m, hlc.Timestamp{Wall: 45}); ok {
		t.Fatal("replayed from before the changes forgotten")
	}
	// A change larger than the budget is kept alone.
	big := make([]byte, 500)
	h.add([]store.Event{{Kind: store.EventSet, Key: []byte("big"), Value: big, Version: hlc.Timestamp{Wall: 100}}}, now)
	if got, ok := h.since([]byte("big"), nil, hlc.Timestamp{Wall: 99}); !ok || len(got) != 1 || len(got[0].Value) != 500 || h.head-h.tail != 1 {
		t.Fatalf("a change over the budget: %d replayed (ok %v), %d records held", len(got), ok, h.head-h.tail)
	}
}

// TestHistoryKeepsQuietPartitions: a key written over and over with
// large values, each change forgetting its partition's oldest, does not
// push a quiet partition's change out of the byte budget: its dead
// records are compacted away first, however few they are.
func TestHistoryKeepsQuietPartitions(t *testing.T) {
	h := newHistory(HistoryLimits{PerPartition: 4, MaxBytes: 1 << 20})
	h.begin(everywhere(hlc.Timestamp{Wall: 1}))
	cold, hot := []byte("cold"), []byte("hot")
	if store.Partition(cold) == store.Partition(hot) {
		t.Fatal("pick keys of two partitions")
	}
	now := time.Unix(1000, 0)
	h.add([]store.Event{{Kind: store.EventSet, Key: cold, Value: []byte("v"), Version: hlc.Timestamp{Wall: 2}}}, now)
	big := make([]byte, 16<<10)
	for i := range 500 { // 8 MB through a 1 MiB budget; 64 KiB of it live
		h.add([]store.Event{{Kind: store.EventSet, Key: hot, Value: big, Version: hlc.Timestamp{Wall: int64(3 + i)}}}, now)
		if h.bytes+h.deadBytes > 1<<20 {
			t.Fatalf("change %d: %d bytes held, budget 1 MiB", i, h.bytes+h.deadBytes)
		}
	}
	if got, ok := h.since(cold, nil, hlc.Timestamp{Wall: 1}); !ok || len(got) != 1 {
		t.Fatalf("the quiet partition's change: %d replayed (ok %v)", len(got), ok)
	}
	if got, ok := h.since(hot, nil, hlc.Timestamp{Wall: 498}); !ok || len(got) != 4 {
		t.Fatalf("the hot key's last four: %d replayed (ok %v)", len(got), ok)
	}
}

// TestHistoryRing: the one ring of records and its chunks against a
// plain list of every change in the order added, forgotten as the
// history's rules say (a partition over its count forgets its oldest;
// from the oldest of all on, what is forgotten, aged, or over the byte
// budget is dropped), through random adds to a few partitions under
// each limit in turn, with changes larger than a chunk among them: what
// each key's SINCE replays, the floors, the byte count and the chunks
// held are the list's.
func TestHistoryRing(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	keys := make([][]byte, 24)
	for i := range keys {
		keys[i] = []byte(fmt.Sprint("k", i))
	}
	type change struct {
		ev   store.Event
		at   time.Time
		part uint16
		dead bool
	}
	all, err := glob.Compile([]byte("k*"))
	if err != nil {
		t.Fatal(err)
	}
	for _, limits := range []HistoryLimits{
		{PerPartition: 5, MaxBytes: 1 << 30},
		{PerPartition: 1000, MaxBytes: 200 << 10},
		{PerPartition: 3, MaxBytes: 12 << 10},
		{PerPartition: 1000, MaxBytes: 1 << 30, MaxAge: 30 * time.Second},
	} {
		h := newHistory(limits)
		h.compactMin = 8
		h.begin(everywhere(hlc.Timestamp{Wall: 1}))
		var list []change
		compactions := 0
		floor := map[uint16]int64{}
		now := time.Unix(1000, 0)
		for i := int64(2); i < 1000; i++ {
			now = now.Add(time.Duration(rng.IntN(1000)) * time.Millisecond)
			if rng.IntN(300) == 0 {
				now = now.Add(time.Minute) // with MaxAge, all is forgotten
			}
			k := keys[rng.IntN(len(keys))]
			size := rng.IntN(300)
			if rng.IntN(100) == 0 {
				size = chunkSize + rng.IntN(1000)
			}
			ev := store.Event{Kind: store.EventSet, Key: k, Value: bytes.Repeat([]byte{byte(i)}, size), Version: hlc.Timestamp{Wall: i, Node: "n"}}
			if rng.IntN(10) == 0 {
				ev.Kind, ev.Value = store.EventDelete, nil
			}
			head := h.head
			h.add([]store.Event{ev}, now)
			compacted := h.head <= head // renumbered from 0

			part := store.Partition(k)
			list = append(list, change{ev: ev, at: now, part: part})
			live := 0
			for j := range list {
				if list[j].part == part && !list[j].dead {
					live++
				}
			}
			if live > limits.PerPartition {
				for j := range list {
					if list[j].part == part && !list[j].dead {
						list[j].dead = true
						floor[part] = max(floor[part], list[j].ev.Version.Wall)
						break
					}
				}
			}
			var held, heldAll int64 // the live changes' bytes, and all the list's
			live = 0
			for _, c := range list {
				size := int64(len(c.ev.Key) + len(c.ev.Value))
				heldAll += size
				if !c.dead {
					held += size
					live++
				}
			}
			for len(list) > 0 {
				c := list[0]
				size := int64(len(c.ev.Key) + len(c.ev.Value))
				if !c.dead {
					if !(limits.MaxAge > 0 && now.Sub(c.at) > limits.MaxAge) && !(heldAll > limits.MaxBytes && live > 1) {
						break
					}
					floor[c.part] = max(floor[c.part], c.ev.Version.Wall)
					held -= size
					live--
				}
				heldAll -= size
				list = list[1:]
			}
			// More dead than live (in records or bytes): only the live stay.
			if dead := len(list) - live; dead > h.compactMin && dead > live || heldAll-held > held+chunkSize {
				var kept []change
				for _, c := range list {
					if !c.dead {
						kept = append(kept, c)
					}
				}
				list, heldAll = kept, held
				if !compacted {
					t.Fatalf("limits %+v step %d: not compacted with %d dead and %d live", limits, i, dead, live)
				}
				compactions++
			} else if compacted {
				t.Fatalf("limits %+v step %d: compacted with %d dead and %d live", limits, i, dead, live)
			}

			if h.bytes != held || h.live != live || h.bytes+h.deadBytes != heldAll || int(h.head-h.tail) != len(list) {
				t.Fatalf("limits %+v step %d: %d records of %d bytes held, %d of %d live; want %d of %d, %d of %d", limits, i, h.head-h.tail, h.bytes+h.deadBytes, h.live, h.bytes, len(list), heldAll, live, held)
			}
			for _, k := range keys {
				p := store.Partition(k)
				from := hlc.Timestamp{Wall: max(floor[p], 1), Node: "n"} // begin's floor is 1
				got, ok := h.since(k, nil, from)
				var want []store.Event
				for _, c := range list {
					if !c.dead && string(c.ev.Key) == string(k) {
						want = append(want, c.ev)
					}
				}
				if !ok || len(got) != len(want) {
					t.Fatalf("limits %+v step %d: %s since %d: %d replayed (ok %v), want %d", limits, i, k, floor[p], len(got), ok, len(want))
				}
				for j := range got {
					if got[j].Version != want[j].Version || !bytes.Equal(got[j].Value, want[j].Value) || got[j].Kind != want[j].Kind {
						t.Fatalf("limits %+v step %d: %s change %d is %v, want %v", limits, i, k, j, got[j].Version, want[j].Version)
					}
				}
				if _, ok := h.since(k, nil, hlc.Timestamp{Wall: floor[p] - 1, Node: "n"}); floor[p] > 1 && ok {
					t.Fatalf("limits %+v step %d: %s replayed from below its floor %d", limits, i, k, floor[p])
				}
			}
			// A pattern's SINCE, from the highest floor: every change kept
			// after it, of every partition, in version order.
			var top int64 = 1
			for _, f := range floor {
				top = max(top, f)
			}
			got, ok := h.since(nil, all, hlc.Timestamp{Wall: top, Node: "n"})
			var want []int64
			for _, c := range list {
				if !c.dead && c.ev.Version.Wall > top {
					want = append(want, c.ev.Version.Wall)
				}
			}
			if !ok || len(got) != len(want) {
				t.Fatalf("limits %+v step %d: pattern since %d: %d replayed (ok %v), want %d", limits, i, top, len(got), ok, len(want))
			}
			for j := range got {
				if got[j].Version.Wall != want[j] {
					t.Fatalf("limits %+v step %d: pattern change %d is %v, want %d", limits, i, j, got[j].Version, want[j])
				}
			}
			// The chunks held run from the oldest record's to the newest's.
			if h.tail == h.head && len(h.chunks) > 0 {
				t.Fatalf("limits %+v step %d: %d chunks held for no record", limits, i, len(h.chunks))
			}
			if h.tail < h.head && (h.chunk0 != h.rec(h.tail).chunk || h.chunkSeq() != h.rec(h.head-1).chunk+1) {
				t.Fatalf("limits %+v step %d: chunks %d..%d held for records in %d..%d", limits, i, h.chunk0, h.chunkSeq(), h.rec(h.tail).chunk, h.rec(h.head-1).chunk)
			}
		}
		if limits.PerPartition == 5 && compactions == 0 {
			t.Fatalf("limits %+v: never compacted", limits)
		}
	}
}

// TestHistoryGap: changes lost before they reached the history (a
// cluster node that fell behind a group's event rings) make every SINCE
// truncated until the loss is bounded, and a SINCE from below the first
// version after it truncated for good; one from there on replays.
func TestHistoryGap(t *testing.T) {
	h := newHistory(HistoryLimits{PerPartition: 10, MaxBytes: 1 << 20})
	h.begin(everywhere(hlc.Timestamp{Wall: 1}))
	at := func(wall int64) hlc.Timestamp { return hlc.Timestamp{Wall: wall, Node: "n"} }
	set := func(key string, wall int64) {
		h.add([]store.Event{{Kind: store.EventSet, Key: []byte(key), Value: []byte("v"), Version: at(wall)}}, time.Now())
	}
	set("a", 2)
	if _, ok := h.since([]byte("a"), nil, at(1)); !ok {
		t.Fatal("no replay before any loss")
	}
	h.gap(hlc.Timestamp{}) // lost: changes of unknown versions
	set("b", 3)
	for _, k := range []string{"a", "b"} {
		if _, ok := h.since([]byte(k), nil, at(3)); ok {
			t.Fatalf("%s replayed while the loss is not bounded", k)
		}
	}
	h.gap(at(5)) // every change lost is below 5, the next one delivered
	set("c", 5)
	if _, ok := h.since([]byte("a"), nil, at(4)); ok {
		t.Fatal("a SINCE from below the first version after the loss replayed")
	}
	got, ok := h.since([]byte("c"), nil, at(5))
	if !ok || len(got) != 0 {
		t.Fatalf("SINCE the first version after the loss: %v %v", got, ok)
	}
	set("c", 6)
	if got, ok := h.since([]byte("c"), nil, at(5)); !ok || len(got) != 1 || got[0].Version != at(6) {
		t.Fatalf("SINCE 5 after a change at 6: %v %v", got, ok)
	}
}

// TestExpiryInsideAWriteIsReplayed: a write over a value that expired
// inside the log reports the expiry's DELETE (store's expiredAt) at a
// version no other change has. A PATTERN watcher that saw the write just
// before it (the clock's previous version) and resumes with SINCE that
// version gets the DELETE. Before, the DELETE had that very version, and
// the replay, of versions after it, skipped it.
func TestExpiryInsideAWriteIsReplayed(t *testing.T) {
	s := store.New(store.Limits{})
	h := newHistory(HistoryLimits{PerPartition: 64, MaxBytes: 1 << 20})
	h.begin(everywhere(hlc.Timestamp{Wall: 1}))
	v := func(c uint64) hlc.Timestamp { return hlc.Timestamp{Wall: 1000, Counter: c, Node: "n1"} }
	apply := func(c store.Command) []store.Event {
		_, evs := s.Apply(&c, nil)
		h.add(evs, time.Now())
		return evs
	}
	// SET k PX 1 and, pipelined, SET j and SET k: the second SET k is
	// proposed (Now) after k's deadline, before k's Expire.
	apply(store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("a"), TTL: 1, Version: v(0), Now: 500})
	sj := apply(store.Command{Op: store.OpSet, Key: []byte("j"), Value: []byte("x"), Version: v(1), Now: 500})
	evs := apply(store.Command{Op: store.OpSet, Key: []byte("k"), Value: []byte("b"), Version: v(2), Now: 502})
	if len(evs) != 2 || evs[0].Kind != store.EventDelete {
		t.Fatalf("events %+v", evs)
	}
	if evs[0].Version == sj[0].Version {
		t.Errorf("DELETE of k has the version of the SET of j: %v (versions not unique)", evs[0].Version)
	}
	// The watcher of pattern * saw SET j (its last notification) and resumes.
	m, _ := glob.Compile([]byte("*"))
	got, ok := h.since(nil, m, sj[0].Version)
	if !ok {
		t.Fatal("truncated")
	}
	sawDelete := false
	for _, c := range got {
		if c.Kind == store.EventDelete && string(c.Key) == "k" {
			sawDelete = true
		}
	}
	if !sawDelete {
		t.Errorf("SINCE %v replays %d changes, without the DELETE of k", sj[0].Version, len(got))
	}
}

// everywhere is a floor for begin: v for every partition.
func everywhere(v hlc.Timestamp) func(int) hlc.Timestamp {
	return func(int) hlc.Timestamp { return v }
}

// TestHistoryBeginsWhereEachPartitionCan: changes added before begin
// (a cluster member's log replayed as it starts following) are kept, a
// partition's floor is its own, and a partition that already forgot
// changes keeps the floor above them, whatever begin says.
func TestHistoryBeginsWhereEachPartitionCan(t *testing.T) {
	h := newHistory(HistoryLimits{PerPartition: 4, MaxAge: time.Minute, MaxBytes: 1 << 20})
	full, quiet := []byte("full"), []byte("quiet")
	if store.Partition(full) == store.Partition(quiet) {
		t.Fatal("pick keys of two partitions")
	}
	v := func(i int) hlc.Timestamp { return hlc.Timestamp{Wall: int64(100 + i), Node: "n"} }
	now := time.Unix(1000, 0)
	for i := 1; i <= 6; i++ { // two forgotten
		h.add([]store.Event{{Kind: store.EventSet, Key: full, Value: []byte("x"), Version: v(i)}}, now)
	}
	h.add([]store.Event{{Kind: store.EventSet, Key: quiet, Value: []byte("y"), Version: v(7)}}, now)
	if _, ok := h.since(quiet, nil, v(0)); ok {
		t.Fatal("a replay before begin")
	}
	h.begin(func(p int) hlc.Timestamp {
		if p == int(store.Partition(quiet)) {
			return hlc.Timestamp{Wall: v(7).Wall} // just below its one change
		}
		return v(0)
	})
	if _, ok := h.since(full, nil, v(1)); ok {
		t.Fatal("replayed from before the changes the partition forgot")
	}
	if got, ok := h.since(full, nil, v(2)); !ok || len(got) != 4 || got[0].Version != v(3) {
		t.Fatalf("from its floor: %v %v", got, ok)
	}
	if got, ok := h.since(quiet, nil, hlc.Timestamp{Wall: v(7).Wall}); !ok || len(got) != 1 {
		t.Fatalf("the quiet partition from its own floor: %v %v", got, ok)
	}
	if _, ok := h.since(quiet, nil, v(0)); ok {
		t.Fatal("the quiet partition replayed from below its floor")
	}
}

// benchHistory returns a new history with the default limits, 10,000
// keys and a 256-byte value, for the benchmarks.
func benchHistory() (*history, [][]byte, []byte) {
	keys := make([][]byte, 10000)
	for i := range keys {
		keys[i] = fmt.Appendf(nil, "key:%012d", i)
	}
	return newHistory(DefaultHistory), keys, bytes.Repeat([]byte("v"), 256)
}

// BenchmarkHistoryAdd: SETs of 256 bytes to 10,000 keys taken in turn by
// a new server's history with the default limits (the first 650,000 are
// what bench/resp.sh's rounds put through one).
func BenchmarkHistoryAdd(b *testing.B) {
	h, keys, value := benchHistory()
	ev := []store.Event{{Kind: store.EventSet, Value: value}}
	now := time.Now()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		ev[0].Key = keys[i%len(keys)]
		ev[0].Version = hlc.Timestamp{Wall: int64(i + 1), Node: "n1"}
		h.add(ev, now)
	}
}

// TestHistoryNodes: versions issued by several nodes, in turns and runs,
// are replayed with the node that issued each.
func TestHistoryNodes(t *testing.T) {
	h := newHistory(DefaultHistory)
	h.begin(everywhere(hlc.Timestamp{Wall: 1}))
	key := []byte("k")
	nodes := []string{"n1", "n1", "n2", "n1", "n3", "n3", "n2", "n1"}
	for i, n := range nodes {
		h.add([]store.Event{{Kind: store.EventSet, Key: key, Value: []byte("v"), Version: hlc.Timestamp{Wall: int64(10 + i), Node: n}}}, time.Unix(1000, 0))
	}
	got, ok := h.since(key, nil, hlc.Timestamp{Wall: 1})
	if !ok || len(got) != len(nodes) {
		t.Fatalf("replayed %d (ok %v), want %d", len(got), ok, len(nodes))
	}
	for i, ev := range got {
		if ev.Version.Node != nodes[i] || ev.Version.Wall != int64(10+i) {
			t.Fatalf("change %d has version %v, want wall %d from %s", i, ev.Version, 10+i, nodes[i])
		}
	}
	if len(h.nodes) != 3 {
		t.Fatalf("%d node ids kept for 3 nodes", len(h.nodes))
	}
}

// BenchmarkHistoryAddRound: what a pipelined load's log entries bring,
// 512 SETs of 256 bytes at a time to keys taken at random among 10,000
// (redis-benchmark -P 16 -c 50 -r 10000), with the default limits.
// Reported per change.
func BenchmarkHistoryAddRound(b *testing.B) {
	h, keys, value := benchHistory()
	rng := rand.New(rand.NewPCG(1, 2))
	evs := make([]store.Event, 512)
	now := time.Now()
	wall := int64(0)
	b.ReportAllocs()
	for b.Loop() {
		for i := range evs {
			wall++
			evs[i] = store.Event{Kind: store.EventSet, Key: keys[rng.IntN(len(keys))], Value: value, Version: hlc.Timestamp{Wall: wall, Node: "n1"}}
		}
		h.add(evs, now)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/change")
}
