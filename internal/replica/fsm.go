package replica

import (
	"fmt"
	"io"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/store"
)

// fsm is the boundary between raft and the store: hashicorp/raft's three
// methods (apply, snapshot, restore), with the lock that lets reads run
// beside the apply goroutine.
type fsm struct {
	mu         sync.RWMutex
	st         *store.Store
	clock      *hlc.Clock
	onEvents   func(Batch)
	wakeExpiry func()
	batch      Batch // reused between batches; only the apply goroutine touches it
	timings    Timings

	expired  atomic.Int64
	restores atomic.Int64 // snapshots installed (a replica catching up, or a restart)
	// expiresFrom is the store's earliest deadline (unix ms; MaxInt64:
	// no key has one) as of the last apply or restore, set under mu: a
	// write proposed before then meets no key expired, and the proposer
	// need neither look nor take mu (see Group.propose).
	expiresFrom   atomic.Int64
	lastSnapshot  atomic.Int64 // unix ns
	snapshotBytes atomic.Int64

	// proposed holds the entries this replica proposed as leader and has
	// not applied yet, with their commands as the proposer built them
	// (see takeProposed). Under mu.
	proposed []proposedEntry

	// broken is the first log entry that could not be applied. After it
	// nothing more is: applying later entries without it would build a
	// state no other replica has. fail is told once.
	broken error
	fail   func(error)
}

var _ raft.BatchingFSM = (*fsm)(nil)

// proposedEntry is a log entry as its proposer built it: its bytes (the
// slice raft.Apply was given, which raft hands the leader's apply
// goroutine as the entry's Data) and what they decode to.
type proposedEntry struct {
	data   *byte
	limits store.Limits
	cmds   []store.Command
	ans    *answers // nil: the entry is answered once applied (complete)
}

// propose records an entry about to be given to raft.Apply; ans, if not
// nil, has its commands answered as they are applied (see answers).
func (f *fsm) propose(data []byte, limits store.Limits, cmds []store.Command, ans *answers) {
	f.mu.Lock()
	f.proposed = append(f.proposed, proposedEntry{unsafe.SliceData(data), store.EncodedLimits(limits), cmds, ans})
	f.mu.Unlock()
}

// answers hands a big entry's results to their requests while the rest
// of the entry is still being applied, rather than once all of it is.
//
// Why: a pipelined load's entry carries hundreds of writes, whose apply
// (a cache miss or two each in the store's index) and replies (a write
// to each client's socket) ran one after the other, and the clients sent
// nothing more until their replies came. Handed to another goroutine a
// chunk at a time, the first clients' replies go out while the last
// writes are applied. A command's result is final once applied (the
// apply goroutine applies committed entries only), so answering it then
// is what answering it after the whole entry was, sooner. 50 clients of
// 16 pipelined durable SETs at two Ps, six alternating rounds: median
// 362,450 SETs a second against 325,733, five of six ahead; at one P the
// answering waits for the apply to end, as before (docs/benchmarks.md,
// issue 32, ninth).
type answers struct {
	dones   []func(store.Result, error)
	results []store.Result // the entry's, filled by the apply
	// handed: dones[:handed] were handed to out. Under fsm.mu, so that
	// once the entry is forgotten (complete) it is settled: complete
	// answers the rest.
	handed  int
	stopped bool // out was full once: complete answers the rest
	out     chan<- answer
}

// answer is a chunk of an entry's applied commands to answer.
type answer struct {
	dones   []func(store.Result, error)
	results []store.Result
}

// answerEvery is how many applied commands make a chunk: each chunk
// handed costs a channel send and, when the answering goroutine has
// caught up, its wake-up.
const answerEvery = 32

// hand gives dones[handed:n] to the answering goroutine, unless its
// queue is full (then they wait for the entry, as others do).
func (a *answers) hand(n int) {
	if a.stopped || n <= a.handed {
		return
	}
	select {
	case a.out <- answer{a.dones[a.handed:n], a.results[a.handed:n]}:
		a.handed = n
	default:
		a.stopped = true
	}
}

// forget drops a proposed entry once its future is done, if the apply
// goroutine did not take it: the future failed (the entry may yet be
// applied, from this replica's log once another leader commits it, but
// its commands alias requests that are answered now, whose memory may be
// reused), or raft applied another copy of its bytes. Under mu, so that
// an apply that took the commands has copied what it keeps from them
// before the requests are answered.
//
// It returns how many of the entry's commands the apply handed to be
// answered (answers), settled now: complete answers the others.
func (f *fsm) forget(data []byte, ans *answers) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	handed := 0
	if ans != nil {
		handed = ans.handed
	}
	p := unsafe.SliceData(data)
	for i := range f.proposed {
		if f.proposed[i].data == p {
			f.proposed = slices.Delete(f.proposed, i, i+1)
			break
		}
	}
	return handed
}

// takeProposed returns the commands of l if this replica proposed it and
// has them still (f.mu held): decoding the bytes again cost the apply
// goroutine, which every entry waits for, a quarter of its time. The
// entries proposed before it are dropped: they are applied in log order,
// so they were not applied as proposed, and will not be.
func (f *fsm) takeProposed(l *raft.Log) (proposedEntry, bool) {
	if len(l.Data) == 0 {
		return proposedEntry{}, false
	}
	p := unsafe.SliceData(l.Data)
	for i := range f.proposed {
		if f.proposed[i].data == p {
			e := f.proposed[i]
			f.proposed = slices.Delete(f.proposed, 0, i+1)
			return e, true
		}
	}
	return proposedEntry{}, false
}

// checkProposed, where a test sets it, is given every proposed entry the
// apply goroutine takes, to compare its commands with what its bytes
// decode to (proposed_test.go): the two must never differ, or the leader would
// apply what its followers and its own restart do not.
var checkProposed func(limits store.Limits, cmds []store.Command, data []byte)

func (f *fsm) Apply(l *raft.Log) interface{} {
	return f.ApplyBatch([]*raft.Log{l})[0]
}

// ApplyBatch applies committed entries in order. Each command entry yields
// a []store.Result (one per command) or an error if it cannot be decoded.
func (f *fsm) ApplyBatch(logs []*raft.Log) []interface{} {
	out := make([]interface{}, len(logs))
	events, marks := f.batch.Events[:0], f.batch.Marks[:0]
	expiring := false
	f.mu.Lock()
	before := f.st.MaxVersion()
	for i, l := range logs {
		if l.Type != raft.LogCommand {
			continue
		}
		if f.broken != nil {
			out[i] = f.broken
			continue
		}
		e, ok := f.takeProposed(l)
		limits, cmds, ans := e.limits, e.cmds, e.ans
		var err error
		switch {
		case ok && checkProposed != nil:
			checkProposed(limits, cmds, l.Data)
		case !ok:
			limits, cmds, err = store.DecodeBatch(l.Data)
		}
		if err != nil {
			f.broken = &DamagedError{What: fmt.Sprintf("raft log entry %d", l.Index), Err: err}
			out[i] = f.broken
			f.fail(f.broken)
			continue
		}
		// The limits the leader enforced when it wrote the entry: quota
		// decisions replay identically on every node and every restart.
		f.st.SetLimits(limits)
		start := len(events)
		var results []store.Result
		if ans != nil {
			results = ans.results
		} else {
			results = make([]store.Result, len(cmds))
		}
		for j := range cmds {
			c := &cmds[j]
			results[j], events = f.st.Apply(c, events)
			if c.Op == store.OpExpire && results[j].Outcome == store.Applied {
				f.expired.Add(1)
			}
			if (c.Op == store.OpSet || c.Op == store.OpTouch) && c.TTL > 0 {
				expiring = true // a new deadline, maybe the soonest
			}
			if ans != nil && j+1-ans.handed >= answerEvery {
				ans.hand(j + 1)
			}
		}
		if ans != nil {
			ans.hand(len(cmds))
		}
		if len(events) > start {
			marks = append(marks, Mark{Index: l.Index, End: len(events)})
		}
		out[i] = results
	}
	maxVersion := f.st.MaxVersion()
	f.noteExpiry()
	f.mu.Unlock()
	// A new leader must issue versions above every applied one.
	f.clock.Observe(maxVersion)
	if f.onEvents != nil && len(logs) > 0 {
		f.onEvents(Batch{Events: events, Marks: marks, First: logs[0].Index, Last: logs[len(logs)-1].Index, Before: before})
	}
	clear(events) // drop references to values
	f.batch = Batch{Events: events[:0], Marks: marks[:0]}
	if expiring {
		f.wakeExpiry()
	}
	return out
}

// noteExpiry sets expiresFrom from the store (f.mu held).
func (f *fsm) noteExpiry() {
	at, ok := f.st.NextExpiry()
	if !ok {
		at = math.MaxInt64
	}
	f.expiresFrom.Store(at)
}

// mayHaveExpired says whether a key may be past its deadline at now
// (unix ms) and not removed yet, as of the last apply: if not, a write
// needs no Expire before it (see Group.propose).
func (f *fsm) mayHaveExpired(now int64) bool { return f.expiresFrom.Load() <= now }

func (f *fsm) Snapshot() (raft.FSMSnapshot, error) {
	// Clone marks the tree copy-on-write: a write, however brief.
	f.mu.Lock()
	defer f.mu.Unlock()
	return &snapshot{st: f.st.Clone(), fsm: f}, nil
}

func (f *fsm) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	next := store.New(store.Limits{})
	if err := next.ReadSnapshot(rc); err != nil {
		return err
	}
	f.mu.Lock()
	f.st = next
	f.noteExpiry()
	f.mu.Unlock()
	f.restores.Add(1)
	if f.onEvents != nil {
		f.onEvents(Batch{Reset: true})
	}
	f.clock.Observe(next.MaxVersion())
	f.wakeExpiry()
	return nil
}

// snapshot is a copy-on-write clone, written out while writes go on.
type snapshot struct {
	st  *store.Store
	fsm *fsm
}

func (s *snapshot) Persist(sink raft.SnapshotSink) error {
	start := time.Now()
	cw := &countingWriter{w: sink}
	if err := s.st.WriteSnapshot(cw); err != nil {
		sink.Cancel()
		return err
	}
	if err := sink.Close(); err != nil {
		return err
	}
	s.fsm.lastSnapshot.Store(time.Now().UnixNano())
	s.fsm.snapshotBytes.Store(cw.n)
	if s.fsm.timings.Snapshot != nil {
		s.fsm.timings.Snapshot(cw.n, time.Since(start))
	}
	return nil
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func (s *snapshot) Release() {}
