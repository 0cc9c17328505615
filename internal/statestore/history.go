package statestore

import (
	"bytes"
	"slices"
	"time"

	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// HistoryLimits bound the change history KEYNOTIFY ... SINCE replays from.
type HistoryLimits struct {
	PerPartition int           // changes kept per partition
	MaxAge       time.Duration // changes older than this are dropped
	MaxBytes     int64         // key and value bytes kept in all
}

// DefaultHistory is what an unconfigured node keeps.
var DefaultHistory = HistoryLimits{PerPartition: 64, MaxAge: 10 * time.Minute, MaxBytes: 64 << 20}

// rec is one remembered change, with when it was applied, as a
// partition's log keeps it: without a pointer. Its key and value are in
// the log's data, its version's node in the history's table of node ids
// (since makes events of them again). Why: kept as events (two slices and a
// string each, and the old values they held alive), the history's
// quarter-million changes were most of the pointers the garbage
// collector followed at every cycle, and cost a pipelined SET a fifth of
// its CPU in marking.
type rec struct {
	off     int    // the key's offset in data; the value follows it
	keyLen  uint32 // then the value's
	valLen  uint32
	wall    int64
	counter uint64
	at      int64  // unix ns
	node    uint32 // in history.nodes
	kind    store.EventKind
}

func (r *rec) size() int64 { return int64(r.keyLen) + int64(r.valLen) }

// partitionLog is the history of one partition: a ring of n records from
// head, oldest first, whose keys and values lie in data from start on, in
// the same order. floor is the greatest version it has forgotten: it can
// replay everything after floor.
//
// A ring, because a partition at its limit forgets one change for each it
// adds: a slice sliding through its backing array was copied into a new
// one every few writes, about 230 bytes allocated per SET. data is
// compacted once its forgotten front is as large as what it holds.
type partitionLog struct {
	recs    []rec
	head, n int
	data    []byte
	start   int
	floor   hlc.Timestamp
	trimmed bool // floor was raised by a change forgotten
}

// at returns the i-th oldest record.
func (p *partitionLog) at(i int) *rec { return &p.recs[(p.head+i)%len(p.recs)] }

// push adds the newest record for ev, copying its key and value, and
// growing the ring when full.
func (p *partitionLog) push(ev *store.Event, node uint32, at int64) *rec {
	if p.n == len(p.recs) {
		grown := make([]rec, max(4, 2*len(p.recs)))
		for i := 0; i < p.n; i++ {
			grown[i] = *p.at(i)
		}
		p.recs, p.head = grown, 0
	}
	if size := len(ev.Key) + len(ev.Value); len(p.data)+size > cap(p.data) {
		p.reserve(size)
	}
	r := p.at(p.n)
	*r = rec{off: len(p.data), keyLen: uint32(len(ev.Key)), valLen: uint32(len(ev.Value)),
		wall: ev.Version.Wall, counter: ev.Version.Counter, at: at, node: node, kind: ev.Kind}
	p.data = append(append(p.data, ev.Key...), ev.Value...)
	p.n++
	return r
}

// drop forgets the oldest record; once none is left, the ring and data go
// too.
func (p *partitionLog) drop() {
	p.start += int(p.at(0).size())
	p.head = (p.head + 1) % len(p.recs)
	p.n--
	switch {
	case p.n == 0:
		p.recs, p.head, p.data, p.start = nil, 0, nil, 0
	case p.start >= 4096 && 2*p.start >= len(p.data):
		p.compact(p.data[:0])
	}
}

// reserve makes room in data for size more bytes: by moving what it holds
// to the front, when that frees half of it, or else into a new buffer of
// twice that (1 KiB at least). Appending grew the buffer a quarter at a
// time: a new server's history copied each partition's bytes into some
// fifteen ever larger buffers, 1.1 KB allocated for each SET of 256 bytes
// in its first minutes, the largest allocation of a pipelined SET.
func (p *partitionLog) reserve(size int) {
	need := len(p.data) - p.start + size
	if 2*need <= cap(p.data) {
		p.compact(p.data[:0])
		return
	}
	p.compact(make([]byte, 0, max(2*need, minData)))
}

// minData is the least a partition's data is given.
const minData = 1024

// compact moves the bytes of the records held to the front of to, which
// may be data itself.
func (p *partitionLog) compact(to []byte) {
	p.data = append(to, p.data[p.start:]...)
	for i := 0; i < p.n; i++ {
		p.at(i).off -= p.start
	}
	p.start = 0
}

// key and value return a record's bytes in data (valid until the next
// push or drop).
func (p *partitionLog) key(r *rec) []byte { return p.data[r.off : r.off+int(r.keyLen)] }
func (p *partitionLog) value(r *rec) []byte {
	v := r.off + int(r.keyLen)
	return p.data[v : v+int(r.valLen)]
}

// maxReplay bounds the changes one KEYNOTIFY ... SINCE replays (while
// notifications are held back); asking for more is answered "truncated".
const maxReplay = 10_000

// history keeps the recent changes of every partition, bounded by count,
// age and bytes, so a client that reconnects can ask for what it missed.
// It is not persisted: after a restart it starts empty, with every floor at
// the node's clock, and a SINCE from before then is answered "truncated".
// Until begin is called, every SINCE is truncated. The service's dispatch
// lock guards it: changes are added, and replays read, under that lock.
type history struct {
	limits HistoryLimits
	parts  [store.Partitions]partitionLog
	nodes  []string          // the node ids of the versions kept, by rec.node
	nodeOf map[string]uint32 // and their places in nodes
	last   uint32            // the place of the last id asked for (see node)
	bytes  int64
	sweep  int           // next partition to check for old changes
	latest hlc.Timestamp // the greatest version added (or start's)
	gaps   int           // losses of changes not yet bounded (see gap)
}

func newHistory(limits HistoryLimits) *history {
	h := &history{limits: limits, nodeOf: map[string]uint32{}}
	for i := range h.parts {
		h.parts[i].floor = hlc.Timestamp{Wall: 1 << 62} // nothing known yet
	}
	return h
}

// begin declares that every change to partition p after version from(p)
// is in the history from now on, keeping what it already holds. A
// partition that already forgot changes (trim) keeps its higher floor.
func (h *history) begin(from func(p int) hlc.Timestamp) {
	for i := range h.parts {
		p := &h.parts[i]
		f := from(i)
		if f.Compare(h.latest) > 0 {
			h.latest = f
		}
		if !p.trimmed || f.Compare(p.floor) > 0 {
			p.floor = f
		}
	}
}

// gap records that changes were lost to this node (in a cluster, a node
// that fell too far behind a group it follows). With the zero version the
// loss is not bounded yet: every SINCE is truncated. With resume, every
// change lost is below it: a SINCE from below it stays truncated. The
// loss is charged to every partition, as the history does not know which
// partitions the group holds.
func (h *history) gap(resume hlc.Timestamp) {
	if resume.IsZero() {
		h.gaps++
		return
	}
	h.gaps = max(h.gaps-1, 0)
	for i := range h.parts {
		if resume.Compare(h.parts[i].floor) > 0 {
			h.parts[i].floor = resume
		}
	}
}

// add remembers applied events, copying their keys and values.
func (h *history) add(events []store.Event, now time.Time) {
	for i := range events {
		if v := events[i].Version; v.Compare(h.latest) > 0 {
			h.latest = v
		}
	}
	if h.limits.PerPartition <= 0 {
		return
	}
	at := now.UnixNano()
	for i := range events {
		e := &events[i]
		p := &h.parts[store.Partition(e.Key)]
		h.bytes += p.push(e, h.node(e.Version.Node), at).size()
		h.trim(p, at, true)
	}
	// Partitions that are not written to still age out their changes.
	for n := 0; n < 4; n++ {
		h.sweep = (h.sweep + 1) % store.Partitions
		h.trim(&h.parts[h.sweep], at, false)
	}
}

// node returns the place of a node id in h.nodes, adding it the first
// time: versions are issued by the cluster's nodes, a handful of ids.
func (h *history) node(id string) uint32 {
	// Nearly every change comes from the node that leads its group:
	// compared with the last id first, most skip the map's hashing.
	if int(h.last) < len(h.nodes) && h.nodes[h.last] == id {
		return h.last
	}
	n, ok := h.nodeOf[id]
	if !ok {
		n = uint32(len(h.nodes))
		h.nodes = append(h.nodes, id)
		h.nodeOf[id] = n
	}
	h.last = n
	return n
}

// version returns a record's version.
func (h *history) version(r *rec) hlc.Timestamp {
	return hlc.Timestamp{Wall: r.wall, Counter: r.counter, Node: h.nodes[r.node]}
}

// trim forgets p's oldest changes while it is over its limits (and, when
// written to, while the whole history is over its byte budget); now is in
// unix ns.
func (h *history) trim(p *partitionLog, now int64, written bool) {
	for p.n > 0 {
		old := p.at(0)
		over := p.n > h.limits.PerPartition ||
			(h.limits.MaxAge > 0 && now-old.at > int64(h.limits.MaxAge)) ||
			(written && h.limits.MaxBytes > 0 && h.bytes > h.limits.MaxBytes && p.n > 1)
		if !over {
			break
		}
		if v := h.version(old); !p.trimmed || v.Compare(p.floor) > 0 {
			p.floor, p.trimmed = v, true
		}
		h.bytes -= old.size()
		p.drop()
	}
}

// since returns the changes after version v to key (or, with a pattern
// m, to keys matching it), in version order. ok is false when the history
// no longer reaches back to v, is disabled, or holds more than maxReplay
// such changes.
func (h *history) since(key []byte, m *glob.Matcher, v hlc.Timestamp) ([]store.Event, bool) {
	if h.limits.PerPartition <= 0 || h.gaps > 0 {
		return nil, false // nothing is kept, or changes were lost
	}
	var out []store.Event
	collect := func(p *partitionLog) bool {
		if p.floor.Compare(v) > 0 {
			return false
		}
		for i := 0; i < p.n; i++ {
			r := p.at(i)
			ver := h.version(r)
			if ver.Compare(v) <= 0 {
				continue
			}
			if k := p.key(r); m != nil && m.Match(k) || m == nil && string(k) == string(key) {
				if len(out) == maxReplay {
					return false
				}
				ev := store.Event{Kind: r.kind, Key: bytes.Clone(k), Version: ver}
				if r.kind == store.EventSet {
					ev.Value = bytes.Clone(p.value(r))
				}
				out = append(out, ev)
			}
		}
		return true
	}
	if m == nil {
		if !collect(&h.parts[store.Partition(key)]) {
			return nil, false
		}
		return out, true
	}
	for i := range h.parts {
		if !collect(&h.parts[i]) {
			return nil, false
		}
	}
	slices.SortFunc(out, func(a, b store.Event) int { return a.Version.Compare(b.Version) })
	return out, true
}
