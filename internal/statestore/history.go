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

// rec is one remembered change, with when it was applied, as the
// history keeps it: without a pointer. Its key and value are in one of
// the history's chunks, its version's node in the table of node ids
// (since makes events of them again). Why: kept as events (two slices and
// a string each, and the old values they held alive), the history's
// quarter-million changes were most of the pointers the garbage
// collector followed at every cycle, and cost a pipelined SET a fifth of
// its CPU in marking.
type rec struct {
	chunk   uint64 // the chunk holding its key, then its value
	off     uint32 // the key's offset in it
	keyLen  uint32
	valLen  uint32
	node    uint32 // in history.nodes
	wall    int64
	counter uint64
	at      int64  // unix ns
	next    uint64 // the sequence number of its partition's next change
	part    uint16
	kind    store.EventKind
	dead    bool // forgotten (its partition kept too many), not yet dropped
}

func (r *rec) size() int64 { return int64(r.keyLen) + int64(r.valLen) }

// partitionLog is what the history knows of one partition: its changes
// kept, n of them linked from oldest (by sequence number, through
// rec.next), and floor, the greatest version it has forgotten: it can
// replay everything after floor.
type partitionLog struct {
	oldest, newest uint64
	n              int
	floor          hlc.Timestamp
	trimmed        bool // floor was raised by a change forgotten
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
//
// The changes are kept in the order they are applied, all partitions'
// in one ring of records (numbered by sequence, from tail to head) with
// their keys and values in chunks of bytes filled one after the other.
// Past MaxAge or over MaxBytes, the oldest of all are forgotten first. A
// partition over PerPartition forgets its own oldest change at once: the
// record is marked dead, and dropped when the tail reaches it or when the
// ring is compacted (see trim). Why one ring and not a ring and a buffer
// per partition (as before): a change landed in one of 4,096 places,
// each cold in the cache, and over the byte budget a partition's buffer
// was compacted, its bytes copied again; a durable SET pipelined 16 deep
// spent a tenth of its CPU there (docs/benchmarks.md, "One ring for the
// history"). Appended at one end, the records and bytes are where the
// last change left the cache.
type history struct {
	limits HistoryLimits
	parts  [store.Partitions]partitionLog
	nodes  []string          // the node ids of the versions kept, by rec.node
	nodeOf map[string]uint32 // and their places in nodes
	last   uint32            // the place of the last id asked for (see node)

	recs       []rec  // ring of records, a power of two long
	tail, head uint64 // sequence numbers: the oldest record held, the next
	chunks     [][]byte
	chunk0     uint64   // the sequence number of chunks[0]
	spare      [][]byte // standard chunks dropped, for reuse
	live       int      // records kept (not dead)
	bytes      int64    // their keys' and values' bytes
	dead       int      // records forgotten and still held
	deadBytes  int64    // theirs
	compactMin int      // dead records held before compact is considered

	touched uint64   // see touch
	partOf  []uint16 // touch's, reused

	latest hlc.Timestamp // the greatest version added (or start's)
	gaps   int           // losses of changes not yet bounded (see gap)
}

// chunkSize is a standard chunk's; a change larger than one gets its own.
// maxSpare bounds the standard chunks kept for reuse: those the tail
// frees are taken again at the head, and a compaction's take the place of
// the ones it frees.
const (
	chunkSize = 64 << 10
	maxSpare  = 16
)

func newHistory(limits HistoryLimits) *history {
	h := &history{limits: limits, nodeOf: map[string]uint32{}, compactMin: 4096}
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
	parts := h.touch(events)
	for i := range events {
		h.push(&events[i], parts[i], at)
	}
	h.trim(at)
}

// touch reads, for each change of a batch, the records its push will
// read first: its partition's newest (which it links to) and, once the
// partition holds its due, its oldest (which it forgets). Why: those lie
// anywhere in the ring, the oldest a whole round of every partition's
// changes ago (megabytes: out of the caches), and push met them one at a
// time, each a stall; read here, one after the other with nothing
// waiting on them, the processor fetches several at once. A change that
// follows another of its partition's in the batch still waits for its
// own. The sum goes to h.touched only so that the reads are kept. It
// returns the changes' partitions, for push.
func (h *history) touch(events []store.Event) []uint16 {
	h.partOf = h.partOf[:0]
	for i := range events {
		h.partOf = append(h.partOf, store.Partition(events[i].Key))
	}
	// A loop of its own, a few instructions a change, so that many of
	// its reads are under way at once.
	var sum uint64
	for _, part := range h.partOf {
		p := &h.parts[part]
		if p.n == 0 {
			continue
		}
		sum += h.rec(p.newest).next
		if p.n >= h.limits.PerPartition {
			sum += uint64(h.rec(p.oldest).wall)
		}
	}
	h.touched = sum
	return h.partOf
}

// push adds the newest record, for ev (of partition part), copying its
// key and value, and forgets its partition's oldest change if that makes
// one too many.
func (h *history) push(ev *store.Event, part uint16, at int64) {
	if h.head-h.tail == uint64(len(h.recs)) {
		h.resize(2 * len(h.recs))
	}
	size := len(ev.Key) + len(ev.Value)
	chunk, off, b := h.room(size)
	copy(b[copy(b, ev.Key):], ev.Value)
	seq := h.head
	h.head++
	*h.rec(seq) = rec{chunk: chunk, off: off, keyLen: uint32(len(ev.Key)), valLen: uint32(len(ev.Value)),
		node: h.node(ev.Version.Node), wall: ev.Version.Wall, counter: ev.Version.Counter, at: at, part: part, kind: ev.Kind}
	h.live++
	h.bytes += int64(size)
	p := &h.parts[part]
	h.link(p, seq)
	if p.n > h.limits.PerPartition {
		r := h.rec(p.oldest)
		h.forget(p, r)
		r.dead = true
		h.dead++
		h.deadBytes += r.size()
	}
}

// link makes seq p's newest change.
func (h *history) link(p *partitionLog, seq uint64) {
	if p.n == 0 {
		p.oldest = seq
	} else {
		h.rec(p.newest).next = seq
	}
	p.newest = seq
	p.n++
}

// rec returns the record of sequence number seq (tail <= seq < head).
func (h *history) rec(seq uint64) *rec { return &h.recs[seq&uint64(len(h.recs)-1)] }

// forget takes p's oldest change, r, out of what it can replay.
func (h *history) forget(p *partitionLog, r *rec) {
	if v := h.version(r); !p.trimmed || v.Compare(p.floor) > 0 {
		p.floor, p.trimmed = v, true
	}
	p.oldest = r.next
	p.n--
	h.live--
	h.bytes -= r.size()
}

// resize moves the records held into a ring of n (a power of two, at
// least 1024, and at least what is held).
func (h *history) resize(n int) {
	ring := make([]rec, max(1024, n))
	for seq := h.tail; seq < h.head; seq++ {
		ring[seq&uint64(len(ring)-1)] = *h.rec(seq)
	}
	h.recs = ring
}

// room returns the chunk that size more bytes go into, their offset in
// it, and them: the last chunk's free end, or a new chunk.
func (h *history) room(size int) (uint64, uint32, []byte) {
	n := len(h.chunks)
	if n == 0 || len(h.chunks[n-1])+size > cap(h.chunks[n-1]) {
		var b []byte
		switch k := len(h.spare); {
		case size > chunkSize:
			b = make([]byte, 0, size)
		case k > 0:
			b, h.spare[k-1] = h.spare[k-1][:0], nil
			h.spare = h.spare[:k-1]
		default:
			b = make([]byte, 0, chunkSize)
		}
		h.chunks = append(h.chunks, b)
		n++
	}
	last := h.chunks[n-1]
	h.chunks[n-1] = last[:len(last)+size]
	return h.chunk0 + uint64(n-1), uint32(len(last)), last[len(last) : len(last)+size]
}

// recycle keeps a standard chunk that holds nothing any more for reuse,
// up to maxSpare of them.
func (h *history) recycle(b []byte) {
	if cap(b) == chunkSize && len(h.spare) < maxSpare {
		h.spare = append(h.spare, b)
	}
}

// chunkSeq is the sequence number of the next chunk (chunk0 counts on
// as chunks are dropped).
func (h *history) chunkSeq() uint64 { return h.chunk0 + uint64(len(h.chunks)) }

// dropChunks drops the chunks before chunk seq: they hold nothing held.
func (h *history) dropChunks(seq uint64) {
	for len(h.chunks) > 0 && h.chunk0 < seq {
		h.recycle(h.chunks[0])
		h.chunks[0] = nil
		h.chunks = h.chunks[1:]
		h.chunk0++
	}
}

// trim drops the oldest records while they are dead, past MaxAge, or
// while what is held, dead records too, is over MaxBytes (the newest is
// kept, whatever its size); now is in unix ns. When more of what is held
// is dead than live, the live records are moved together (compact): a
// partition written much more than the others forgets a change for each
// it adds, in the middle of the ring, and those would otherwise push the
// other partitions' changes out of the budget.
func (h *history) trim(now int64) {
	for h.tail < h.head {
		r := h.rec(h.tail)
		if r.dead {
			h.dead--
			h.deadBytes -= r.size()
		} else if (h.limits.MaxAge > 0 && now-r.at > int64(h.limits.MaxAge)) ||
			(h.limits.MaxBytes > 0 && h.bytes+h.deadBytes > h.limits.MaxBytes && h.live > 1) {
			h.forget(&h.parts[r.part], r)
		} else {
			break
		}
		h.tail++
	}
	if h.tail == h.head {
		h.dropChunks(h.chunkSeq())
		if len(h.recs) > 1024 {
			h.recs = nil // nothing held: the ring goes too
		}
		return
	}
	h.dropChunks(h.rec(h.tail).chunk)
	// By count, past compactMin: small records, whose bytes the budget
	// hardly sees, cost ring slots. By bytes, at once: a few large dead
	// records would otherwise fill the budget and push live ones out.
	if h.dead > h.compactMin && h.dead > h.live || h.deadBytes > h.bytes+chunkSize {
		h.compact()
	}
}

// compact moves the live records, in order, into a new ring and new
// chunks, and links each partition's anew. Each dead record is copied
// past at most once before it is dropped: compacting when the dead
// outnumber (or outweigh) the live costs no more than the dead did.
func (h *history) compact() {
	old, oldChunks, oldChunk0, tail, head := h.recs, h.chunks, h.chunk0, h.tail, h.head
	h.recs, h.chunks, h.chunk0 = nil, nil, h.chunkSeq()
	n := 1024
	for n < h.live {
		n *= 2
	}
	h.tail, h.head = 0, 0
	h.resize(n)
	var seen [store.Partitions]bool
	for seq := tail; seq < head; seq++ {
		r := old[seq&uint64(len(old)-1)]
		if r.dead {
			continue
		}
		src := oldChunks[r.chunk-oldChunk0][r.off : r.off+r.keyLen+r.valLen]
		var b []byte
		r.chunk, r.off, b = h.room(len(src))
		copy(b, src)
		at := h.head
		h.head++
		*h.rec(at) = r
		p := &h.parts[r.part]
		if !seen[r.part] {
			seen[r.part], p.n = true, 0
		}
		h.link(p, at)
	}
	h.dead, h.deadBytes = 0, 0
	for _, b := range oldChunks {
		h.recycle(b)
	}
}

// key and value return a record's bytes (valid until it is dropped).
func (h *history) key(r *rec) []byte {
	b := h.chunks[r.chunk-h.chunk0]
	return b[r.off : r.off+r.keyLen]
}

func (h *history) value(r *rec) []byte {
	b := h.chunks[r.chunk-h.chunk0]
	v := r.off + r.keyLen
	return b[v : v+r.valLen]
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

// since returns the changes after version v to key (or, with a pattern
// m, to keys matching it), in version order. ok is false when the history
// no longer reaches back to v, is disabled, or holds more than maxReplay
// such changes.
func (h *history) since(key []byte, m *glob.Matcher, v hlc.Timestamp) ([]store.Event, bool) {
	if h.limits.PerPartition <= 0 || h.gaps > 0 {
		return nil, false // nothing is kept, or changes were lost
	}
	var out []store.Event
	take := func(r *rec) bool {
		ver := h.version(r)
		if ver.Compare(v) <= 0 {
			return true
		}
		if k := h.key(r); m != nil && m.Match(k) || m == nil && string(k) == string(key) {
			if len(out) == maxReplay {
				return false
			}
			ev := store.Event{Kind: r.kind, Key: bytes.Clone(k), Version: ver}
			if r.kind == store.EventSet {
				ev.Value = bytes.Clone(h.value(r))
			}
			out = append(out, ev)
		}
		return true
	}
	if m == nil {
		// One partition's changes, in the order applied, which is its
		// group's, and so its versions'.
		p := &h.parts[store.Partition(key)]
		if p.floor.Compare(v) > 0 {
			return nil, false
		}
		seq := p.oldest
		for range p.n {
			r := h.rec(seq)
			if !take(r) {
				return nil, false
			}
			seq = r.next
		}
		return out, true
	}
	for i := range h.parts {
		if h.parts[i].floor.Compare(v) > 0 {
			return nil, false
		}
	}
	for seq := h.tail; seq < h.head; seq++ {
		if r := h.rec(seq); !r.dead && !take(r) {
			return nil, false
		}
	}
	slices.SortFunc(out, func(a, b store.Event) int { return a.Version.Compare(b.Version) })
	return out, true
}
