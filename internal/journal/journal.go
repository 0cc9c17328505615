// Package journal is one append-only, fsynced log shared by all the raft
// groups of a node: each group sees its own raft.LogStore and
// raft.StableStore, and the appends of all groups that arrive while one
// fsync runs share the next one (group commit across groups).
//
// Why: a node holds a replica of several groups, and with a log per group
// each group pays its own fsync: on a two-core machine a one-node cluster
// of 8 groups wrote about 0.7x as fast as a single node, because the
// volume takes only so many flushes a second and 8 logs divided them.
//
// Layout: numbered segment files in one directory, written in order; an
// in-memory index per group points at its live entries. Segments are
// removed oldest first, once no group has a live entry in them (removing
// only the oldest keeps every delete record a reader needs: what it deletes
// comes before it). A segment that stays pinned by a few entries of a quiet
// group has them copied forward. Raft's stable values are restated at the
// start of every segment so that old segments never hold the only copy.
package journal

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
)

// DefaultSegmentSize is when a segment is closed and the next one begun.
const DefaultSegmentSize = 64 << 20

// ErrClosed is returned once the journal is closed.
var ErrClosed = errors.New("journal: closed")

// Options tune a journal; the zero value is the default.
type Options struct {
	SegmentSize int64
	// OnFail is called once if a write or fsync fails: what the kernel
	// kept of the file after a failed fsync is not known, so the journal
	// takes no more writes and the node must stop. A volume without room
	// is not such a failure (see Room).
	OnFail func(error)
	// Room, if set, is asked before a batch holding log entries is
	// written, with their bytes: an error refuses the entries (their
	// callers get it; nothing else changes), while the batch's other
	// records (deletes, which free space, and raft's small stable
	// values) are written. A follower whose volume fills then refuses
	// appends, and its group goes on with its other replicas, until
	// space is freed (a full volume on a follower stopped the node;
	// found by trying it).
	Room func(n int64) error
	// Spare is how many bytes of zeros the journal keeps in a file of its
	// own (spareName), released when the volume has no room for a batch
	// that holds no entries: raft's term and vote must be written even on
	// a full volume (hashicorp/raft panics when it cannot save them; a
	// member on a full volume did so when it had to vote). 0 is
	// DefaultSpare; negative keeps none. Once released, entries are
	// refused until the file could be filled again.
	Spare int64
}

// DefaultSpare is the default Options.Spare: room for a segment to grow
// by its zeros written ahead twice, each of which holds tens of thousands
// of raft's stable values.
const DefaultSpare = 2 * ahead

// spareName is the file of Options.Spare.
const spareName = "spare"

// spareRetry is how often, at most, entries try to fill the spare again
// after it was released (each try writes it whole).
const spareRetry = 200 * time.Millisecond

// ErrNoSpace is wrapped by the error of a write the volume had no room
// for (ENOSPC, EDQUOT): the journal goes on, and the write may be tried
// again once space is freed.
var ErrNoSpace = errors.New("journal: no space left on the data volume")

// noRoom is err, a refusal for want of room, wrapping ErrNoSpace.
func noRoom(err error) error {
	if errors.Is(err, ErrNoSpace) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrNoSpace, err)
}

// noSpace reports whether err is the volume's being full.
func noSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) || errors.Is(err, ErrNoSpace)
}

// Journal is the shared log of one node.
type Journal struct {
	dir  string
	opts Options

	// mu guards the index (groups, segments); readers hold it shared while
	// they read a file, so a segment is not removed under them.
	mu     sync.RWMutex
	groups map[uint32]*group
	segs   []*segment // oldest first; the last is written

	qmu    sync.Mutex
	queue  []*op
	wake   chan struct{}
	err    error // sticky: set once a write failed or the journal closed
	done   chan struct{}
	closed bool

	buf     []byte        // the writer's batch
	syncs   atomic.Uint64 // batches made durable
	refused atomic.Uint64 // appends refused for want of room (see Options.Room)
	full    atomic.Bool   // the last batch with entries had no room for them

	spareGone  atomic.Bool // the spare was released (see Options.Spare)
	spareTried time.Time   // the writer's last attempt to fill it again

	seals seals // how finished segments end (see sealsFile); the writer's
}

// Stats are a journal's figures for metrics.
type Stats struct {
	Segments  int
	Bytes     int64  // records in all segments
	LiveBytes int64  // of them, entries some group still needs
	Syncs     uint64 // fdatasyncs since open
	Refused   uint64 // appends refused since open for want of room on the volume
	Full      bool   // the last appends were refused so
	// SpareReleased says the journal's spare (Options.Spare) was used to
	// write raft's term and vote on a full volume, and is not back yet.
	SpareReleased bool
}

// Stats reports the journal's figures.
func (j *Journal) Stats() Stats {
	j.mu.RLock()
	defer j.mu.RUnlock()
	st := Stats{Segments: len(j.segs), Syncs: j.syncs.Load(), Refused: j.refused.Load(), Full: j.full.Load(), SpareReleased: j.spareGone.Load()}
	for _, s := range j.segs {
		st.Bytes += s.size
		st.LiveBytes += s.liveBytes
	}
	return st
}

type segment struct {
	seq       uint64
	f         *os.File
	size      int64 // where its records end
	filled    int64 // the file's length: zeros from size on, written ahead
	live      int   // live entries
	liveBytes int64 // their record bytes
}

type loc struct {
	seg *segment
	off int64
	n   int64
}

type group struct {
	first, last uint64 // 0, 0: empty
	locs        []loc  // locs[i-first]
	stable      map[string][]byte
}

func (g *group) empty() bool { return g.last == 0 }

// op is one caller's change, applied in queue order by the writer.
type op struct {
	g    uint32
	kind byte
	logs []*raft.Log // entry
	rel  []int64     // entry: each record's offset within recs
	recs []byte      // the encoded records
	min  uint64      // delete
	max  uint64
	key  []byte // stable
	val  []byte
	err  error
	done chan struct{}
}

// Open opens (creating if needed) the journal in dir, reading every
// segment: damage anywhere but in the unacknowledged tail is an error.
func Open(dir string, opts Options) (*Journal, error) {
	if opts.SegmentSize <= 0 {
		opts.SegmentSize = DefaultSegmentSize
	}
	if opts.Spare == 0 {
		opts.Spare = DefaultSpare
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	j := &Journal{dir: dir, opts: opts, groups: map[uint32]*group{}, wake: make(chan struct{}, 1), done: make(chan struct{})}
	if err := j.recover(); err != nil {
		j.closeFiles()
		return nil, err
	}
	if len(j.segs) == 0 {
		if err := j.rotate(); err != nil {
			j.closeFiles()
			return nil, err
		}
	} else if err := j.collect(); err != nil { // what a failed rotation left
		j.closeFiles()
		return nil, err
	}
	if err := j.fillSpare(); err != nil && !noSpace(err) {
		j.closeFiles()
		return nil, err
	}
	go j.writer()
	return j, nil
}

// DamagedError reports a segment that cannot be read.
type DamagedError struct {
	Path string
	Off  int64
	Err  error
}

func (e *DamagedError) Error() string {
	return fmt.Sprintf("journal: %s is damaged at byte %d: %v", e.Path, e.Off, e.Err)
}

func (e *DamagedError) Unwrap() error { return e.Err }

func segName(seq uint64) string { return fmt.Sprintf("%016x.seg", seq) }

// recover reads the segments in order and rebuilds the index.
func (j *Journal) recover() error {
	names, err := os.ReadDir(j.dir)
	if err != nil {
		return err
	}
	var seqs []uint64
	for _, e := range names {
		var seq uint64
		if n, _ := fmt.Sscanf(e.Name(), "%016x.seg", &seq); n == 1 && e.Name() == segName(seq) {
			seqs = append(seqs, seq)
		} else if strings.HasSuffix(e.Name(), ".seg") {
			return fmt.Errorf("journal: unexpected file %s in %s", e.Name(), j.dir)
		}
	}
	sort.Slice(seqs, func(a, b int) bool { return seqs[a] < seqs[b] })
	// Segments go oldest first only: the ones left are consecutive.
	for i := 1; i < len(seqs); i++ {
		if seqs[i] != seqs[i-1]+1 {
			return &DamagedError{Path: filepath.Join(j.dir, segName(seqs[i-1]+1)), Err: errors.New("segment missing")}
		}
	}
	if j.seals, err = readSeals(j.dir); err != nil {
		return err
	}
	idx := map[uint32]map[uint64]loc{}
	for i, seq := range seqs {
		last := i == len(seqs)-1
		if err := j.scan(seq, last, idx); err != nil {
			return err
		}
	}
	if err := j.checkSeals(); err != nil {
		return err
	}
	// A group's live entries are the contiguous run ending at its newest
	// one; anything older, left by a segment that could not be removed
	// yet, was compacted away before.
	for id, m := range idx {
		g := j.group(id)
		var top uint64
		for i := range m {
			top = max(top, i)
		}
		if top == 0 {
			continue
		}
		lo := top
		for lo > 1 {
			if _, ok := m[lo-1]; !ok {
				break
			}
			lo--
		}
		g.first, g.last = lo, top
		g.locs = make([]loc, top-lo+1)
		for i := lo; i <= top; i++ {
			l := m[i]
			g.locs[i-lo] = l
			l.seg.live++
			l.seg.liveBytes += l.n
		}
	}
	return nil
}

// scan reads one segment into idx; the newest is cut after its last
// commit record (a torn tail: that batch was never acknowledged).
func (j *Journal) scan(seq uint64, newest bool, idx map[uint32]map[uint64]loc) error {
	path := filepath.Join(j.dir, segName(seq))
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	s := &segment{seq: seq, f: f, size: int64(len(data)), filled: int64(len(data))}
	j.segs = append(j.segs, s)
	// The newest segment's start can be torn only while the one before it
	// is still there: older segments are collected only once its start
	// (header and restated stable values) is synced. Without it, a start
	// that does not read is damage, and the stable values it held (raft's
	// term and vote) would be lost with it.
	newest = newest && (seq == 1 || len(j.segs) >= 2 && j.segs[len(j.segs)-2].seq == seq-1)
	if got, err := checkHeader(data); err != nil || got != seq {
		// The header is written in one batch with the restatement of the
		// stable values (see rotate): a commit after the header that ends
		// that batch, not a later one, says nothing was written after it.
		if newest && (len(data) < headerSize || allZero(data[:headerSize])) && !laterBatch(data, int64(headerSize), seq) {
			// A crash while the next segment was begun: nothing in it was
			// acknowledged.
			return j.cut(s, 0)
		}
		if err == nil {
			err = fmt.Errorf("journal: header names segment %d", got)
		}
		return &DamagedError{Path: path, Err: err}
	}
	type pend struct {
		r   record
		loc loc
	}
	var batch []pend
	off := int64(headerSize)
	committed := off
	for off < int64(len(data)) {
		var r record
		n := int64(-1)
		if int64(len(data))-off >= recHeader {
			n = recordLen(data[off:])
		}
		if n < 0 || n > int64(len(data))-off || n-recHeader > maxRecord {
			err = errBadRecord
		} else {
			var kind byte
			var body []byte
			if kind, body, err = checkRecord(data[off : off+n]); err == nil {
				r, err = decode(kind, body)
			}
		}
		if err == nil && r.kind == kindCommit && (r.off != off || r.seg != seq) {
			err = errBadRecord
		}
		if err != nil {
			if off == committed && allZero(data[off:]) {
				if newest && committed == int64(headerSize) {
					return j.cut(s, 0) // begun, but its first batch is lost (see cutTail)
				}
				s.size = committed // the zeros written ahead of the records
				return nil
			}
			if newest && !laterBatch(data, off, seq) && !batchWritten(data, committed, seq) {
				return j.cutTail(s, committed)
			}
			return &DamagedError{Path: path, Off: off, Err: err}
		}
		if r.kind == kindCommit {
			for _, p := range batch {
				apply(idx, j, p.r, p.loc)
			}
			batch = batch[:0]
			committed = off + n
		} else {
			batch = append(batch, pend{r, loc{s, off, n}})
		}
		off += n
	}
	if committed != int64(len(data)) || newest && committed == int64(headerSize) {
		if newest {
			return j.cutTail(s, committed)
		}
		return &DamagedError{Path: path, Off: committed, Err: errors.New("records after the last commit")}
	}
	return nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// laterBatch reports whether a valid commit record of segment seq after
// off ends a batch that began after off: that batch was written only once
// the one holding off had been synced and acknowledged, so the bad record
// at off is damage, not a torn write. (A torn final batch may still show
// its own commit record, if the disk kept a later sector and lost an
// earlier one: that commit's batch begins at or before off.)
func laterBatch(data []byte, off int64, seq uint64) bool {
	return commitAfter(data, off, seq, func(batch int64) bool { return batch > off }) >= 0
}

// batchWritten reports whether the batch that begins at start in segment
// seq reached the disk whole, so that a bad record in it is damage (a bit
// flipped at rest), not a torn write: its own commit record is there, and
// SectorsWritten says no sector of it was lost.
func batchWritten(data []byte, start int64, seq uint64) bool {
	end := commitAfter(data, start, seq, func(batch int64) bool { return batch == start })
	return end >= 0 && SectorsWritten(data, start, end)
}

// SectorsWritten reports whether data[start:end], the last write to a file
// at offset 0, written over zeros, reached the disk whole: no 512-byte
// sector's share of it reads as zeros. A disk keeps or loses a sector
// whole, so a write cut short by a crash shows a sector's share of zeros
// (or a file that ends early); where none does, a bad checksum is damage
// at rest, not a torn write. (A write holding a sector's worth of zeros
// is taken as torn: the rule gives up certainty, never a torn write's cut.)
func SectorsWritten(data []byte, start, end int64) bool {
	const sector = 512
	for p := start; p < end; {
		q := min((p/sector+1)*sector, end)
		if allZero(data[p:q]) {
			return false
		}
		p = q
	}
	return true
}

// commitAfter returns the end of the first valid commit record of segment
// seq after off whose batch start satisfies batch, or -1.
func commitAfter(data []byte, off int64, seq uint64, batch func(int64) bool) int64 {
	for p := off + 1; p+commitSize <= int64(len(data)); p++ {
		if data[p+8] != kindCommit || recordLen(data[p:]) != commitSize {
			continue
		}
		kind, body, err := checkRecord(data[p : p+commitSize])
		if err != nil {
			continue
		}
		if r, err := decode(kind, body); err == nil && r.off == p && r.seg == seq && batch(r.batch) {
			return p + commitSize
		}
	}
	return -1
}

// cutTail cuts the newest segment's torn tail after committed. A segment
// whose first batch is torn goes whole: that batch restates the stable
// values (raft's term and vote) that older segments may then no longer
// hold once they are collected, and nothing after it was acknowledged.
func (j *Journal) cutTail(s *segment, committed int64) error {
	if committed == int64(headerSize) {
		committed = 0
	}
	return j.cut(s, committed)
}

// cut truncates the newest segment to size: a header-less one goes.
func (j *Journal) cut(s *segment, size int64) error {
	if size == 0 {
		s.f.Close()
		j.segs = j.segs[:len(j.segs)-1]
		if err := os.Remove(filepath.Join(j.dir, segName(s.seq))); err != nil {
			return err
		}
		return SyncDir(j.dir)
	}
	if err := s.f.Truncate(size); err != nil {
		return err
	}
	s.size, s.filled = size, size
	return s.f.Sync()
}

// apply records a verified change in idx (at open) and in the groups'
// stable values.
func apply(idx map[uint32]map[uint64]loc, j *Journal, r record, l loc) {
	m := idx[r.group]
	if m == nil {
		m = map[uint64]loc{}
		idx[r.group] = m
	}
	switch r.kind {
	case kindEntry:
		m[r.min] = l
	case kindDelete:
		for i := range m {
			if i >= r.min && i <= r.max {
				delete(m, i)
			}
		}
	case kindStable:
		g := j.group(r.group)
		g.stable[string(r.key)] = append([]byte(nil), r.val...)
	case kindDrop:
		delete(idx, r.group)
		delete(j.groups, r.group)
	}
}

// group returns the state of group id, creating it. Callers hold mu (or
// own the journal, at open).
func (j *Journal) group(id uint32) *group {
	g := j.groups[id]
	if g == nil {
		g = &group{stable: map[string][]byte{}}
		j.groups[id] = g
	}
	return g
}

// Has reports whether the journal holds anything of group id.
func (j *Journal) Has(id uint32) bool {
	j.mu.RLock()
	defer j.mu.RUnlock()
	g := j.groups[id]
	return g != nil && (!g.empty() || len(g.stable) > 0)
}

// Groups lists the groups the journal holds something of.
func (j *Journal) Groups() []uint32 {
	j.mu.RLock()
	defer j.mu.RUnlock()
	var ids []uint32
	for id, g := range j.groups {
		if !g.empty() || len(g.stable) > 0 {
			ids = append(ids, id)
		}
	}
	sort.Slice(ids, func(a, b int) bool { return ids[a] < ids[b] })
	return ids
}

// Drop forgets group id: its entries and stable values.
func (j *Journal) Drop(id uint32) error {
	return j.submit(&op{g: id, kind: kindDrop, recs: appendDrop(nil, id)})
}

// submit queues o for the writer and waits until it is durable.
func (j *Journal) submit(o *op) error {
	o.done = make(chan struct{})
	j.qmu.Lock()
	if j.err != nil {
		err := j.err
		j.qmu.Unlock()
		return err
	}
	j.queue = append(j.queue, o)
	j.qmu.Unlock()
	select {
	case j.wake <- struct{}{}:
	default:
	}
	<-o.done
	return o.err
}

// writer writes what is queued, one batch and one fsync at a time.
func (j *Journal) writer() {
	defer close(j.done)
	var ops []*op
	for {
		<-j.wake
		j.qmu.Lock()
		ops, j.queue = j.queue, ops[:0]
		err := j.err
		j.qmu.Unlock()
		if len(ops) == 0 {
			if err != nil {
				return // closed, nothing left
			}
			continue
		}
		if err == nil {
			err = j.write(ops)
			if noSpace(err) {
				err = j.writeWithoutEntries(ops, err)
			}
			if noSpace(err) {
				// Not even the batch's stable values and deletes found
				// room: nothing of it is durable, or visible. Its callers
				// get the error (its entries were counted as refused),
				// and later batches are tried.
				err = noRoom(err)
				for _, o := range ops {
					if o.kind != kindEntry {
						j.refused.Add(1)
					}
					if o.err == nil {
						o.err = err
					}
					close(o.done)
				}
				clear(ops)
				continue
			}
		}
		if err != nil {
			j.fail(err)
		}
		for _, o := range ops {
			if err != nil && o.err == nil {
				o.err = err
			}
			close(o.done)
		}
		clear(ops)
		// The batch is acknowledged first: a failure to begin the next
		// segment fails what comes after it, not what is durable. One
		// for want of room is tried again after the next batch.
		if err == nil && j.segs[len(j.segs)-1].size >= j.opts.SegmentSize {
			if err := j.rotate(); err != nil && !noSpace(err) {
				j.fail(err)
			}
		}
		select { // more may have come while this batch was written
		case j.wake <- struct{}{}:
		default:
		}
	}
}

// writeWithoutEntries writes the ops of a batch the volume had no room
// for (cause) except its entries, which are refused: raft's stable values
// and deletes must go on (see Options.Spare). If even they find no room,
// the spare is released for them.
func (j *Journal) writeWithoutEntries(ops []*op, cause error) error {
	j.full.Store(true)
	refused := noRoom(cause)
	var rest []*op
	for _, o := range ops {
		if o.kind == kindEntry {
			if o.err == nil || !errors.Is(o.err, ErrNoSpace) {
				j.refused.Add(1)
			}
			o.err = refused
			continue
		}
		o.err = nil
		rest = append(rest, o)
	}
	if len(rest) == 0 {
		return nil
	}
	err := j.write(rest)
	if noSpace(err) && j.releaseSpare() {
		err = j.write(rest)
	}
	return err
}

// fillSpare writes the spare file (Options.Spare) in full and syncs it; on
// an error none is left.
func (j *Journal) fillSpare() error {
	if j.opts.Spare < 0 {
		return nil
	}
	path := filepath.Join(j.dir, spareName)
	if fi, err := os.Stat(path); err == nil && fi.Size() >= j.opts.Spare {
		j.spareGone.Store(false)
		return nil
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("journal: spare: %w", err)
	}
	err = WriteZeros(f, 0, j.opts.Spare, maxZeroPiece)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
		j.spareGone.Store(true)
		return fmt.Errorf("journal: spare: %w", err)
	}
	j.spareGone.Store(false)
	return nil
}

// releaseSpare removes the spare file, which frees its room at once (the
// journal holds it open nowhere); it reports whether there was any.
func (j *Journal) releaseSpare() bool {
	path := filepath.Join(j.dir, spareName)
	fi, err := os.Stat(path)
	if err != nil || fi.Size() == 0 {
		return false
	}
	j.spareGone.Store(true)
	return os.Remove(path) == nil
}

// fail makes err sticky; the first failure is reported.
func (j *Journal) fail(err error) {
	j.qmu.Lock()
	first := j.err == nil
	if first {
		j.err = err
	}
	j.qmu.Unlock()
	if first && j.opts.OnFail != nil && !errors.Is(err, ErrClosed) {
		j.opts.OnFail(err)
	}
}

// proj is a group's log bounds as the ops of a batch leave them.
type proj struct{ first, last uint64 }

// write validates ops in order, writes the valid ones and a commit record
// in one write, fsyncs, and only then applies them to the index: nothing
// is visible before it is durable.
func (j *Journal) write(ops []*op) error {
	s := j.segs[len(j.segs)-1]
	base := s.size
	b := j.buf[:0]
	projs := map[uint32]*proj{}
	var room error
	var entries int64
	for _, o := range ops {
		if o.kind == kindEntry {
			entries += int64(len(o.recs))
		}
	}
	if entries > 0 && j.spareGone.Load() {
		// Entries wait for the spare to be back: what it held must be
		// there for raft's stable values the next time the volume fills.
		if time.Since(j.spareTried) >= spareRetry {
			j.spareTried = time.Now()
			if err := j.fillSpare(); err != nil && !noSpace(err) {
				return err
			}
		}
		if j.spareGone.Load() {
			room = errors.New("the journal's spare room is in use until the volume has room for it again")
			j.full.Store(true)
		}
	}
	if entries > 0 && room == nil && j.opts.Room != nil {
		room = j.opts.Room(entries)
		j.full.Store(room != nil)
	}
	j.mu.RLock()
	for _, o := range ops {
		if room != nil && o.kind == kindEntry {
			o.err = noRoom(room)
			j.refused.Add(1)
			continue
		}
		p := projs[o.g]
		if p == nil {
			p = &proj{}
			if g := j.groups[o.g]; g != nil {
				p.first, p.last = g.first, g.last
			}
			projs[o.g] = p
		}
		next := *p
		if o.err = next.check(o); o.err != nil {
			continue // the bounds stay as the ops before left them
		}
		*p = next
		for i := range o.rel {
			o.rel[i] += base + int64(len(b))
		}
		b = append(b, o.recs...)
	}
	j.mu.RUnlock()
	end, err := j.flush(s, b, base)
	if err != nil {
		return err
	}
	j.mu.Lock()
	s.size = end
	wrote := false
	for _, o := range ops {
		if o.err == nil {
			j.applyOp(s, o)
			wrote = wrote || o.kind == kindEntry
		}
	}
	j.mu.Unlock()
	if wrote {
		j.full.Store(false)
	}
	return nil
}

// flush ends the batch b, to be written at base in s, with its commit
// record, writes it and fsyncs it: once it returns, the batch is durable
// and s's records end at end.
func (j *Journal) flush(s *segment, b []byte, base int64) (end int64, err error) {
	b = appendCommit(b, base+int64(len(b)), s.seq, base)
	j.keep(b)
	if err := s.reserve(int64(len(b))); err != nil {
		return 0, err
	}
	if _, err := s.f.WriteAt(b, base); err != nil {
		return 0, fmt.Errorf("journal: write: %w", err)
	}
	if err := Datasync(s.f); err != nil {
		// Whatever it says: what the kernel kept after a failed fsync
		// is not known (see Options.OnFail).
		return 0, fmt.Errorf("journal: fsync: %v", err)
	}
	j.syncs.Add(1)
	return base + int64(len(b)), nil
}

// ahead is how far a segment's file is filled with zeros beyond its last
// record. An fdatasync after an append that grows the file must also commit
// the new length through the file system's journal; one after writing over
// zeros already there need not: on the development machine's ext4 a write
// and fdatasync took 111–131 µs instead of 192–197 µs, with 48–51 µs of
// system CPU instead of 62–67.
const ahead = 1 << 20

// reserve fills s with zeros far enough to take n more bytes of records,
// in pieces the size of n (WriteZeros says why). The zeros become durable
// with the next fdatasync.
func (s *segment) reserve(n int64) error {
	if s.size+n <= s.filled {
		return nil
	}
	to := s.filled + ahead
	for s.size+n > to {
		to += ahead
	}
	if err := WriteZeros(s.f, s.filled, to, ZeroPiece(n)); err != nil {
		return fmt.Errorf("journal: write: %w", err)
	}
	s.filled = to
	return nil
}

// keep keeps the writer's buffer for the next batch, unless a rare big
// one grew it.
func (j *Journal) keep(b []byte) {
	j.buf = b
	if cap(b) > 16<<20 {
		j.buf = nil
	}
}

// check validates o against the bounds before it and moves them past it.
func (p *proj) check(o *op) error {
	switch o.kind {
	case kindEntry:
		for _, l := range o.logs {
			if l.Index == 0 {
				return errors.New("journal: log index 0")
			}
			if p.last != 0 && l.Index != p.last+1 {
				return fmt.Errorf("journal: non-monotonic log entries: tried to append index %d after %d", l.Index, p.last)
			}
			if p.last == 0 {
				p.first = l.Index
			}
			p.last = l.Index
		}
	case kindDelete:
		switch {
		case o.max < p.first || o.min > p.last || p.last == 0:
		case o.min <= p.first:
			p.first = o.max + 1
		case o.max >= p.last:
			p.last = o.min - 1
		default:
			return errors.New("journal: only a prefix or a suffix of a log can be deleted")
		}
		if p.first > p.last {
			p.first, p.last = 0, 0
		}
	case kindDrop:
		p.first, p.last = 0, 0
	}
	return nil
}

// applyOp applies a durable op to the index. Callers hold mu.
func (j *Journal) applyOp(s *segment, o *op) {
	g := j.group(o.g)
	switch o.kind {
	case kindEntry:
		for i, l := range o.logs {
			if g.empty() {
				g.first = l.Index
			}
			g.last = l.Index
			n := int64(len(o.recs))
			if i+1 < len(o.rel) {
				n = o.rel[i+1] - o.rel[0]
			}
			n -= o.rel[i] - o.rel[0]
			g.locs = append(g.locs, loc{s, o.rel[i], n})
			s.live++
			s.liveBytes += n
		}
	case kindDelete:
		if g.empty() || o.max < g.first || o.min > g.last {
			return
		}
		lo, hi := max(o.min, g.first), min(o.max, g.last)
		for _, l := range g.locs[lo-g.first : hi-g.first+1] {
			l.seg.live--
			l.seg.liveBytes -= l.n
		}
		if lo == g.first {
			g.locs = append(g.locs[:0:0], g.locs[hi-g.first+1:]...)
			g.first = hi + 1
		} else {
			g.locs = g.locs[:lo-g.first]
			g.last = lo - 1
		}
		if g.first > g.last {
			g.first, g.last, g.locs = 0, 0, nil
		}
	case kindStable:
		g.stable[string(o.key)] = o.val
	case kindDrop:
		for _, l := range g.locs {
			l.seg.live--
			l.seg.liveBytes -= l.n
		}
		delete(j.groups, o.g)
	}
}

// rotate begins a new segment holding every group's stable values, then
// removes the segments no group needs and copies forward the entries of
// an old segment pinned by only a few.
func (j *Journal) rotate() error {
	var seq uint64 = 1
	if len(j.segs) > 0 {
		seq = j.segs[len(j.segs)-1].seq + 1
	}
	path := filepath.Join(j.dir, segName(seq))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	b := appendHeader(nil, seq)
	j.mu.RLock()
	ids := make([]uint32, 0, len(j.groups))
	for id := range j.groups {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(a, c int) bool { return ids[a] < ids[c] })
	for _, id := range ids {
		g := j.groups[id]
		keys := make([]string, 0, len(g.stable))
		for k := range g.stable {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			b = appendStable(b, id, []byte(k), g.stable[k])
		}
	}
	j.mu.RUnlock()
	b = appendCommit(b, int64(len(b)), seq, int64(headerSize))
	if _, err := f.Write(b); err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = SyncDir(j.dir)
	}
	if err != nil {
		f.Close()
		os.Remove(path)
		return fmt.Errorf("journal: begin segment: %w", err)
	}
	if n := len(j.segs); n > 0 {
		// The new segment is durable: the previous one is finished.
		j.seals[j.segs[n-1].seq] = j.segs[n-1].size
		if err := writeSeals(j.dir, j.seals); err != nil {
			// Not begun after all: the previous segment goes on (a
			// crash may leave this one, empty, which opens as such).
			delete(j.seals, j.segs[n-1].seq)
			f.Close()
			os.Remove(path)
			return err
		}
	}
	j.mu.Lock()
	if n := len(j.segs); n > 0 {
		// The zeros ahead of a finished segment's records are not
		// needed; if a crash undoes this, they are read as its end.
		prev := j.segs[n-1]
		if prev.f.Truncate(prev.size) == nil {
			prev.filled = prev.size
		}
	}
	j.segs = append(j.segs, &segment{seq: seq, f: f, size: int64(len(b)), filled: int64(len(b))})
	j.mu.Unlock()
	return j.collect()
}

// collect removes unneeded old segments, oldest first (the directory is
// synced after, so that no later segment's removal outlives an earlier
// one's). When more than two remain and the oldest is pinned, its live
// entries are copied into the newest segment first if they are under a
// quarter of it, or if the dead bytes held back behind it exceed them by a
// segment: a quiet group's few big entries must not keep the journal
// growing.
func (j *Journal) collect() error {
	removed := false
	defer func() {
		if removed {
			SyncDir(j.dir)
		}
	}()
	for {
		j.mu.Lock()
		if len(j.segs) < 2 {
			j.mu.Unlock()
			return nil
		}
		old := j.segs[0]
		if old.live == 0 {
			j.segs = j.segs[1:]
			j.mu.Unlock()
			old.f.Close()
			delete(j.seals, old.seq) // written with the next seal
			if err := os.Remove(filepath.Join(j.dir, segName(old.seq))); err != nil {
				return fmt.Errorf("journal: %w", err)
			}
			removed = true
			continue
		}
		var size, live int64
		for _, s := range j.segs {
			size += s.size
			live += s.liveBytes
		}
		j.mu.Unlock()
		few := old.liveBytes*4 <= old.size
		heldBack := size-live >= old.liveBytes+j.opts.SegmentSize
		if len(j.segs) <= 2 || !few && !heldBack {
			return nil
		}
		if err := j.copyForward(old); err != nil {
			return err
		}
	}
}

// copyForward rewrites the live entries of segment old at the end of the
// newest segment. Only the writer calls it, so no op changes the index
// meanwhile.
func (j *Journal) copyForward(old *segment) error {
	type move struct {
		g   *group
		i   int
		loc loc
	}
	var moves []move
	j.mu.RLock()
	for _, g := range j.groups {
		for i, l := range g.locs {
			if l.seg == old {
				moves = append(moves, move{g, i, l})
			}
		}
	}
	j.mu.RUnlock()
	s := j.segs[len(j.segs)-1]
	base := s.size
	b := j.buf[:0]
	newLocs := make([]loc, len(moves))
	for k, m := range moves {
		start := len(b)
		b = append(b, make([]byte, m.loc.n)...)
		if _, err := old.f.ReadAt(b[start:], m.loc.off); err != nil {
			return &DamagedError{Path: filepath.Join(j.dir, segName(old.seq)), Off: m.loc.off, Err: err}
		}
		if _, _, err := checkRecord(b[start:]); err != nil {
			return &DamagedError{Path: filepath.Join(j.dir, segName(old.seq)), Off: m.loc.off, Err: err}
		}
		newLocs[k] = loc{s, base + int64(start), m.loc.n}
	}
	end, err := j.flush(s, b, base)
	if err != nil {
		return err
	}
	j.mu.Lock()
	s.size = end
	for k, m := range moves {
		m.g.locs[m.i] = newLocs[k]
		old.live--
		old.liveBytes -= m.loc.n
		s.live++
		s.liveBytes += m.loc.n
	}
	j.mu.Unlock()
	return nil
}

// Close stops the writer (failing what is still queued) and closes the
// files.
func (j *Journal) Close() error {
	j.qmu.Lock()
	if j.closed {
		j.qmu.Unlock()
		return nil
	}
	j.closed = true
	if j.err == nil {
		j.err = ErrClosed
	}
	j.qmu.Unlock()
	select {
	case j.wake <- struct{}{}:
	default:
	}
	<-j.done
	// Anything queued after the writer's last look fails now.
	j.qmu.Lock()
	for _, o := range j.queue {
		o.err = ErrClosed
		close(o.done)
	}
	j.queue = nil
	j.qmu.Unlock()
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.closeFiles()
}

func (j *Journal) closeFiles() error {
	var err error
	for _, s := range j.segs {
		err = errors.Join(err, s.f.Close())
	}
	j.segs = nil
	return err
}

// Log is one group's view: a raft.LogStore and raft.StableStore.
type Log struct {
	j  *Journal
	id uint32
}

var (
	_ raft.LogStore          = (*Log)(nil)
	_ raft.StableStore       = (*Log)(nil)
	_ raft.MonotonicLogStore = (*Log)(nil)
)

// IsMonotonic implements raft.MonotonicLogStore: a group's entries follow
// one another without gaps, so once a snapshot is installed raft must
// remove all of the group's entries. Otherwise it keeps its trailing ones,
// and the leader's next entry, right after the snapshot, cannot follow
// them: the follower never takes an entry again, and the leader sends the
// snapshot over and over.
func (l *Log) IsMonotonic() bool { return true }

// Group returns group id's view of the journal.
func (j *Journal) Group(id uint32) *Log { return &Log{j: j, id: id} }

func (l *Log) bounds() (uint64, uint64) {
	l.j.mu.RLock()
	defer l.j.mu.RUnlock()
	if g := l.j.groups[l.id]; g != nil {
		return g.first, g.last
	}
	return 0, 0
}

// FirstIndex implements raft.LogStore.
func (l *Log) FirstIndex() (uint64, error) { f, _ := l.bounds(); return f, nil }

// LastIndex implements raft.LogStore.
func (l *Log) LastIndex() (uint64, error) { _, t := l.bounds(); return t, nil }

// GetLog implements raft.LogStore, reading the entry back from its
// segment and checking it again.
func (l *Log) GetLog(index uint64, out *raft.Log) error {
	l.j.mu.RLock()
	g := l.j.groups[l.id]
	if g == nil || g.empty() || index < g.first || index > g.last {
		l.j.mu.RUnlock()
		return raft.ErrLogNotFound
	}
	at := g.locs[index-g.first]
	buf := make([]byte, at.n)
	_, err := at.seg.f.ReadAt(buf, at.off)
	seq := at.seg.seq
	l.j.mu.RUnlock()
	if err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	kind, body, err := checkRecord(buf)
	var r record
	if err == nil {
		r, err = decode(kind, body)
	}
	if err == nil && (r.kind != kindEntry || r.group != l.id || r.min != index) {
		err = errBadRecord
	}
	if err != nil {
		return &DamagedError{Path: filepath.Join(l.j.dir, segName(seq)), Off: at.off, Err: err}
	}
	*out = r.log
	return nil
}

// StoreLog implements raft.LogStore.
func (l *Log) StoreLog(e *raft.Log) error { return l.StoreLogs([]*raft.Log{e}) }

// StoreLogs implements raft.LogStore: the entries are durable when it
// returns.
func (l *Log) StoreLogs(logs []*raft.Log) error {
	if len(logs) == 0 {
		return nil
	}
	o := &op{g: l.id, kind: kindEntry, logs: logs, rel: make([]int64, len(logs))}
	size := 0
	for _, e := range logs {
		size += recHeader + 33 + len(e.Extensions) + len(e.Data)
	}
	o.recs = make([]byte, 0, size)
	for i, e := range logs {
		o.rel[i] = int64(len(o.recs))
		o.recs = appendEntry(o.recs, l.id, e)
	}
	return l.j.submit(o)
}

// DeleteRange implements raft.LogStore: min..max (inclusive) must be a
// prefix or a suffix of the log.
func (l *Log) DeleteRange(min, max uint64) error {
	if min > max {
		return nil
	}
	return l.j.submit(&op{g: l.id, kind: kindDelete, min: min, max: max, recs: appendDelete(nil, l.id, min, max)})
}

// Set implements raft.StableStore.
func (l *Log) Set(key, val []byte) error {
	if len(key) > 0xffff {
		return errors.New("journal: stable key too long")
	}
	k, v := append([]byte(nil), key...), append([]byte(nil), val...)
	return l.j.submit(&op{g: l.id, kind: kindStable, key: k, val: v, recs: appendStable(nil, l.id, k, v)})
}

// Get implements raft.StableStore; a missing key is empty, as raft-wal
// has it.
func (l *Log) Get(key []byte) ([]byte, error) {
	l.j.mu.RLock()
	defer l.j.mu.RUnlock()
	if g := l.j.groups[l.id]; g != nil {
		return append([]byte(nil), g.stable[string(key)]...), nil
	}
	return nil, nil
}

// SetUint64 implements raft.StableStore.
func (l *Log) SetUint64(key []byte, val uint64) error {
	var b [8]byte
	for i := range b {
		b[i] = byte(val >> (8 * i))
	}
	return l.Set(key, b[:])
}

// GetUint64 implements raft.StableStore; a missing key is 0.
func (l *Log) GetUint64(key []byte) (uint64, error) {
	b, err := l.Get(key)
	if err != nil || len(b) == 0 {
		return 0, err
	}
	if len(b) != 8 {
		return 0, fmt.Errorf("journal: stable value %q is not a uint64", key)
	}
	var v uint64
	for i := range b {
		v |= uint64(b[i]) << (8 * i)
	}
	return v, nil
}
