// Package replica runs one replica group: a hashicorp/raft instance whose
// log (raft-wal, fsynced) carries batches of store commands and whose state
// machine is a store.Store. A single node is a group with one voter.
//
// Writes go through Submit: one proposer goroutine stamps each command with
// a fresh HLC version and the wall clock, in log order, batches what is
// waiting into one log entry, and reports each result once the entry is
// durable and applied. Reads see the applied state.
package replica

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftwal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/metadb"
	walsegment "github.com/hashicorp/raft-wal/segment"
	waltypes "github.com/hashicorp/raft-wal/types"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/store"
)

// Config configures a group.
type Config struct {
	NodeID string // stable id of this node; the group's raft server id
	// Dir holds the log and snapshots. Empty means in memory: nothing
	// survives the process.
	Dir string
	// Log, if set, is the group's log and stable store (the node's shared
	// journal), and Dir holds only the snapshots.
	Log    LogStore
	Limits store.Limits
	// SnapshotThreshold is how many log entries trigger a snapshot;
	// zero picks a default.
	SnapshotThreshold uint64
	// OnEvents receives the change events of every applied batch, in log
	// order, on the apply goroutine. It must not block for long and must
	// not keep the Batch (its events may be kept).
	OnEvents func(Batch)
	// Clock issues the versions; the groups of one node share it. Nil: the
	// group makes its own from NodeID.
	Clock *hlc.Clock
	// Transport carries raft traffic to the other voters. Nil: the group
	// has one voter, this node, and needs none.
	Transport raft.Transport
	// Acks, with a Transport, says when the voters last accepted this
	// replica's AppendEntries as its leader's: with it, a leader serves
	// reads under a lease (see ReadReady). Nil: every read confirms the
	// leadership with a round of heartbeats.
	Acks Acks
	// Bootstrap, if set, is the configuration a group with no state on
	// disk starts with. Nil: with a Transport, wait to be added by the
	// group's leader (a replica that joins); without, one voter (this
	// node).
	Bootstrap *raft.Configuration
	// Timings, if set, receives durations for metrics.
	Timings Timings
	// Logger, if set, receives raft's own log at debug level (else its
	// errors go to stderr).
	Logger *slog.Logger
	// Disk, if set, refuses SETs while the data volume is nearly full.
	Disk *DiskGuard
}

// Acks is what a group's transport knows of the AppendEntries it sent:
// when (on LeaseClock) the last one that voter id accepted in term was
// sent, zero if none.
type Acks interface {
	AckedAt(id string, term uint64) time.Duration
}

// processStart anchors monotonic.
var processStart = time.Now()

// monotonic reads Go's monotonic clock as a duration.
func monotonic() time.Duration { return time.Since(processStart) }

// ReadLease is how long after it sent an AppendEntries that a quorum of
// voters accepted a leader serves reads without asking them again: half
// the heartbeat timeout. A follower that accepted one neither stands for
// election nor votes for another (hashicorp/raft refuses votes while it
// knows a leader) until a heartbeat timeout has passed since, so no
// other leader can commit anything before the lease ends, provided the
// members' clocks run at rates within half of each other's (the same
// assumption as raft's own leader lease and etcd's lease-based reads).
// A member that restarts forgets its leader and could vote at once: a
// node waits a ReadLease after it starts before it opens its groups (see
// cluster.Node), and a leader that hands its leadership over serves no
// lease reads for the rest of its term (see TransferLeadership).
const ReadLease = 500 * time.Millisecond

// Batch is what one batch of applied log entries changed: the events in
// log order, and for each entry that changed something its index and where
// its events end in Events. Replicas apply the same entries to the same
// state, so an entry's events are the same on every replica: a reader can
// follow a group's changes from any replica and resume by log index.
//
// First and Last are the indexes of the batch's first and last entries
// (every batch is reported, with or without events). A Batch with Reset
// set carries nothing else: the state was replaced by a snapshot, and the
// changes up to the next batch's First are not known here.
type Batch struct {
	Events      []store.Event
	Marks       []Mark
	First, Last uint64
	// Before is the greatest version applied before the batch: every
	// change up to First-1 has a version at most this.
	Before hlc.Timestamp
	Reset  bool
}

// Mark ends the events of one log entry within a Batch.
type Mark struct {
	Index uint64
	End   int // Events[previous End:End] are this entry's
}

// Timings are callbacks for metrics; any may be nil. They must be cheap.
type Timings struct {
	Commit   func(time.Duration)                // a log entry, from proposal to applied
	Sync     func(time.Duration)                // appending entries to the log, fsync included
	Snapshot func(bytes int64, d time.Duration) // writing a snapshot
	Entry    func(commands int)                 // a log entry proposed, with how many commands share it
}

// Proposal is a write waiting for the log. The proposer sets Cmd.Version
// (strictly above After and every earlier version) and Cmd.Now.
type Proposal struct {
	Cmd   store.Command
	After hlc.Timestamp // the request's timestamp; zero if none
	// Stamp asks for After to be the clock of the node the write comes
	// through, for a write whose request had none (a gateway's), read
	// only if the write leaves that node for its group's leader: a
	// replica of the node issues versions above it anyway, as it shares
	// the clock. The router reads it (cluster.Node); a Group ignores it.
	Stamp bool
	// Gathered says the write comes in a round its sender gathered
	// (statestore.Request.Gathered): an entry it starts is proposed
	// without holding for more writes (see holdFor).
	Gathered bool
	// Done is called exactly once, from one of the group's goroutines, with the
	// command's result once it is applied, or with an error if it never
	// will be. It must not block.
	Done func(store.Result, error)
}

// ErrClosed is reported for proposals made after Close.
var ErrClosed = errors.New("replica: group closed")

// ErrOutcomeUnknown is reported for a write whose log entry was proposed
// but whose fate this replica cannot know: leadership was lost before it
// committed. It may yet be applied (by the next leader) or not.
var ErrOutcomeUnknown = errors.New("replica: leadership lost while the write was in flight; it may or may not have been applied")

// NotLeaderError is reported for a write or read this replica cannot serve
// because it does not lead its group. Nothing was applied.
type NotLeaderError struct {
	Leader string // the node id of the leader, if known
}

func (e *NotLeaderError) Error() string {
	if e.Leader == "" {
		return "replica: not the leader, and no leader is known"
	}
	return "replica: not the leader; " + e.Leader + " leads"
}

// DamagedError reports a part of the data directory that cannot be read.
// The node stops (or does not start) rather than serve without writes it
// acknowledged; the message says how to recover.
type DamagedError struct {
	Path string // the file or directory, if known
	What string // what in it is damaged
	Err  error
}

func (e *DamagedError) Error() string {
	where := e.What
	if e.Path != "" {
		where = e.What + " in " + e.Path
	}
	return fmt.Sprintf("%s is damaged: %v. The node will not serve without writes it acknowledged. "+
		"To recover, restore the latest backup into a new data directory (mqkv restore --in FILE --data-dir DIR) and start on it; "+
		"in a cluster, have the others forget this node (mqkv cluster remove NODE-ID), then start it on an empty data directory with --join: it joins anew and catches up from its peers", where, e.Err)
}

func (e *DamagedError) Unwrap() error { return e.Err }

const (
	maxBatch      = 1024    // commands per log entry
	maxBatchBytes = 4 << 20 // payload bytes per log entry, unless one command is bigger
	// pipelineDepth is how many log entries may be proposed and not yet
	// applied. Group commit works by making writers wait for the sync:
	// what arrives meanwhile goes into the next entry, and an entry's
	// cost (raft's hand-offs, the fsync's CPU) is shared by its commands.
	// A second entry in flight lets the disk sync one while the previous
	// one is applied, but splits what arrives into more, smaller entries,
	// and on a busy two-core machine their CPU mattered more than the
	// overlap. Durable SET on a node on its own, one against two
	// (alternating builds, docs/benchmarks.md, 2026-11-25 late night):
	// +16 % at 4 clients, +5-10 % at 8 to 64 with 5-8 % less CPU per
	// SET, but 6 % slower with exactly two writers (each had an entry to
	// itself). A group on the node's journal has the other groups'
	// entries to keep the journal busy besides (a one-node cluster of 8
	// groups: 0.79x a node on its own's durable SET with two, 0.88x with
	// one). The rest of a round of gathered writes may take one more
	// slot (see takeSlot).
	pipelineDepth = 1
)

// commitTimeout is raft's: how long its replication loop lets a follower
// go without an AppendEntries. That is how a follower learns the commit
// index after the last write of a burst, and so when it applies that
// write; the group now tells it sooner itself (see nudgeFollowers), so
// this is only the fallback. At 5 ms, as before, it was an idle
// three-node cluster's CPU: 649 ms a second in all, AppendEntries with
// nothing in them; 108 ms with this and the nudge. A var so that a test
// can show nothing waits for it.
var commitTimeout = 250 * time.Millisecond

// commitNudge is how long a group with followers waits, after its last
// entry in flight is applied, before it tells the followers the commit
// index (see nudgeFollowers); a write that comes meanwhile tells them
// with its own entry. Shorter, and writes a few milliseconds apart (one
// client's, spread over a node's groups) each cost a barrier entry and
// its syncs: at 2 ms a lone client's cluster writes were 10-15 % slower.
// A follower applies the last write about 10.6 ms after it began (p50;
// 8.4 ms with the old 5 ms CommitTimeout).
const commitNudge = 10 * time.Millisecond

// Group is one replica group.
type Group struct {
	cfg   Config
	clock *hlc.Clock
	fsm   *fsm
	raft  *raft.Raft
	wal   io.Closer // nil in memory
	// memLog is the log in memory (nil on disk): compactMemLog bounds it.
	memLog *memLog

	in    chan Proposal
	slots chan struct{} // one token per log entry in flight
	// extra is the slot a round's rest may take beside slots (see
	// takeSlot), roundSent says a round was sent since the proposer
	// looked, reading that one is being read (RoundBegun).
	extra     chan struct{}
	roundSent chan struct{}
	reading   atomic.Bool
	inflight  chan pending
	// spare holds entries' command slices, done with (see propose): room
	// for one of each entry in flight, the extra slot's too. With room
	// for one, a round's two entries gave back one and dropped the other,
	// and the proposer made a new one for each round's rest (a thousand
	// commands, 200 KB zeroed): a tenth of a pipelined SET's allocation.
	spare spares[store.Command]
	// spareData holds entries' bytes that nothing reads any more (see
	// complete), for the proposer to encode the next entries into; nil
	// (keeping nothing) where the log store keeps the bytes raft hands it
	// (the journal's cache, the in-memory log).
	spareData spares[byte]
	answers   chan answer   // big entries' commands applied, to answer (see answers)
	answered  chan struct{} // closed when answer returns
	expiryCh  chan struct{} // wakes the expiry loop when an earlier deadline appears

	// submitMu orders Submit against Close: once closed is set under the
	// write lock, nothing more enters g.in, so draining it fails every
	// proposal that did.
	submitMu  sync.RWMutex
	closed    bool
	closeOnce sync.Once
	closing   chan struct{}
	wg        sync.WaitGroup

	// The group stops for good when an entry cannot be applied: it takes
	// no more writes, Failed is closed, and the node must stop.
	*Fault

	// Telling followers the commit index after a burst (nudgeFollowers).
	entries   atomic.Uint64 // log entries proposed
	nudgeMu   sync.Mutex
	nudge     *time.Timer
	nudgeFrom uint64 // entries when the timer was set

	readyTerm atomic.Uint64 // the term in which this leader applied all before it
	// noLease is the term in which this leader began handing its
	// leadership over: its followers may vote for another at once.
	noLease atomic.Uint64
	// leaseReads and verifiedReads count the reads ReadReady allowed
	// under the lease and after a round of heartbeats.
	leaseReads, verifiedReads atomic.Int64
	commitAvg                 atomic.Int64 // nanoseconds from proposal to applied, a moving average over entries (see holdFor)
	leaderChanges             atomic.Int64 // leaders observed since start
}

type pending struct {
	future raft.ApplyFuture
	data   []byte          // the entry's bytes (fsm.propose)
	cmds   []store.Command // its commands
	dones  []func(store.Result, error)
	ans    *answers // nil: answered here once applied
	start  time.Time
	extra  bool // it holds the extra slot, not one of slots (takeSlot)
}

// Open starts the group, creating its state on first use. It returns
// once raft runs; AwaitLeader waits until the group can serve.
func Open(cfg Config) (*Group, error) {
	clock := cfg.Clock
	if clock == nil {
		var err error
		if clock, err = hlc.New(cfg.NodeID, nil); err != nil {
			return nil, err
		}
	}
	g := &Group{
		cfg:       cfg,
		clock:     clock,
		in:        make(chan Proposal, maxBatch),
		slots:     make(chan struct{}, pipelineDepth),
		extra:     make(chan struct{}, 1),
		roundSent: make(chan struct{}, 1),
		inflight:  make(chan pending, pipelineDepth+1),
		spare:     make(spares[store.Command], pipelineDepth+1),
		answers:   make(chan answer, 2*maxBatch/answerEvery),
		answered:  make(chan struct{}),
		expiryCh:  make(chan struct{}, 1),
		closing:   make(chan struct{}),
		Fault:     NewFault(),
	}
	g.fsm = &fsm{st: store.New(cfg.Limits), clock: clock, onEvents: cfg.OnEvents, wakeExpiry: g.wakeExpiry, timings: cfg.Timings, fail: g.Fail}
	g.fsm.noteExpiry()

	rc := raftConfig(cfg)
	logs, stable, snaps, err := g.openStores(cfg, rc)
	if err != nil {
		return nil, err
	}
	if cfg.Timings.Sync != nil {
		logs = timedLogs{logs, cfg.Timings.Sync}
	}
	trans := cfg.Transport
	boot := cfg.Bootstrap
	if trans == nil {
		var addr raft.ServerAddress
		addr, trans = raft.NewInmemTransport(raft.ServerAddress(cfg.NodeID))
		boot = &raft.Configuration{Servers: []raft.Server{{ID: rc.LocalID, Address: addr}}}
	}
	exists, err := raft.HasExistingState(logs, stable, snaps)
	if err != nil {
		g.closeWAL()
		return nil, SnapshotDamage(snaps, cfg.Dir, "a snapshot of the group", fmt.Errorf("replica: %w", err))
	}
	if !exists && boot != nil {
		if err := raft.BootstrapCluster(rc, logs, stable, snaps, trans, *boot); err != nil {
			g.closeWAL()
			return nil, fmt.Errorf("replica: bootstrap: %w", err)
		}
	}
	r, err := raft.NewRaft(rc, g.fsm, logs, stable, snaps, trans)
	if err != nil {
		g.closeWAL()
		return nil, SnapshotDamage(snaps, cfg.Dir, "a snapshot of the group", fmt.Errorf("replica: start raft: %w", err))
	}
	g.raft = r
	obs := make(chan raft.Observation, 16)
	r.RegisterObserver(raft.NewObserver(obs, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	}))
	go g.watchLeader(obs)
	g.wg.Add(3)
	go g.propose()
	go g.complete()
	go g.answer()
	go g.expireLoop()
	if g.memLog != nil {
		g.wg.Add(1)
		go g.compactMemLog(g.memLog)
	} else {
		g.wg.Add(1)
		go g.snapshotIfLong(rc.SnapshotThreshold)
	}
	return g, nil
}

// leaderlessAfter is how long a replicated group may be without a leader
// before its replicas say so: an election after a transfer or a crash
// takes about one election timeout.
const leaderlessAfter = 2 * time.Second

// watchLeader counts the group's changes of leader and, for a group with
// other replicas, says at info when it has had no leader for
// leaderlessAfter and when it has one again (a group without a leader
// answers none of its keys' writes: the operator reading the log of any
// of its replicas sees it).
func (g *Group) watchLeader(obs chan raft.Observation) {
	var since time.Time // without a leader since; zero: it has one
	said := false
	check := time.NewTicker(leaderlessAfter / 4)
	defer check.Stop()
	for {
		select {
		case o := <-obs:
			g.leaderChanges.Add(1)
			lo, _ := o.Data.(raft.LeaderObservation)
			switch {
			case lo.LeaderID == "" && since.IsZero():
				since = time.Now()
			case lo.LeaderID != "" && !since.IsZero():
				if said && g.cfg.Logger != nil {
					g.cfg.Logger.Info("the group has a leader again", "leader", string(lo.LeaderID), "after", time.Since(since).Round(10*time.Millisecond))
				}
				since, said = time.Time{}, false
			}
		case <-check.C:
			if !said && !since.IsZero() && time.Since(since) >= leaderlessAfter && g.cfg.Transport != nil && g.cfg.Logger != nil {
				said = true
				g.cfg.Logger.Info("the group has no leader: its keys' requests wait for an election, which needs a majority of its replicas", "since", since.Format(time.RFC3339Nano))
			}
		case <-g.closing:
			return
		}
	}
}

// raftConfig tunes raft for a group of one (nobody else can start an
// election, so short timeouts only shorten startup) or of several (long
// enough that a loaded two-core machine does not depose healthy leaders,
// short enough that a dead one is replaced within a few seconds).
func raftConfig(cfg Config) *raft.Config {
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.NodeID)
	if cfg.Transport == nil {
		rc.HeartbeatTimeout = 50 * time.Millisecond
		rc.ElectionTimeout = 50 * time.Millisecond
		rc.LeaderLeaseTimeout = 50 * time.Millisecond
	} else {
		rc.HeartbeatTimeout = 1000 * time.Millisecond
		rc.ElectionTimeout = 1000 * time.Millisecond
		rc.LeaderLeaseTimeout = 500 * time.Millisecond
	}
	rc.CommitTimeout = commitTimeout
	rc.BatchApplyCh = true
	rc.MaxAppendEntries = 256
	rc.NoLegacyTelemetry = true
	rc.SnapshotThreshold = cfg.SnapshotThreshold
	if rc.SnapshotThreshold == 0 {
		rc.SnapshotThreshold = 4096
	}
	rc.TrailingLogs = 1024
	if cfg.Dir == "" && cfg.Transport == nil {
		// A group of one in memory: no member catches up from its log, so
		// a snapshot may take all of it (memLog).
		rc.TrailingLogs = 0
	}
	rc.Logger = raftLogger()
	if cfg.Logger != nil {
		rc.Logger = RaftLogger("raft", cfg.Logger)
	}
	return rc
}

// LogStore is a group's log and raft's stable store in one.
type LogStore interface {
	raft.LogStore
	raft.StableStore
}

// A group on the shared journal keeps its recent entries in memory (see
// logCache): replication and apply read them back right after the
// append. At most this many, and this many bytes.
const (
	logCacheEntries = 512
	logCacheBytes   = 8 << 20
)

// openStores opens the log, stable and snapshot stores: on disk under
// cfg.Dir, or the node's journal with snapshots under cfg.Dir (the log
// verified entry by entry either way), or in memory.
func (g *Group) openStores(cfg Config, rc *raft.Config) (raft.LogStore, raft.StableStore, raft.SnapshotStore, error) {
	if cfg.Dir == "" {
		mem := newMemLog()
		g.memLog = mem
		return mem, mem, raft.NewInmemSnapshotStore(), nil
	}
	var logs raft.LogStore
	var stable raft.StableStore
	where := filepath.Join(cfg.Dir, "wal")
	if cfg.Log != nil {
		if err := verifyLog(cfg.Log, "the node's journal"); err != nil {
			return nil, nil, nil, err
		}
		logs, stable, where = newLogCache(cfg.Log, logCacheEntries, logCacheBytes), cfg.Log, "the node's journal"
	} else {
		w, err := openWAL(where, true)
		if err != nil {
			return nil, nil, nil, err
		}
		g.wal = w
		g.spareData = make(spares[byte], pipelineDepth+1)
		logs, stable = &wedgeCheck{WAL: w, fail: g.Fail, dir: where}, w
	}
	fss, err := raft.NewFileSnapshotStoreWithLogger(cfg.Dir, retainSnapshots, rc.Logger)
	if err != nil {
		g.closeWAL()
		return nil, nil, nil, fmt.Errorf("replica: open snapshots: %w", err)
	}
	// A log compacted behind a snapshot needs that snapshot (raft itself
	// panics without it).
	checked := CheckedSnapshots(cfg.Dir, fss, logs)
	if first, err := logs.FirstIndex(); err == nil && first > 1 {
		snaps, err := checked.List() // a newest one that does not read is named as such
		switch {
		case err != nil:
		case len(snaps) == 0:
			err = fmt.Errorf("the log in %s starts at entry %d and no snapshot holds the entries before it", where, first)
		case first > snaps[0].Index+1:
			// The newest snapshot is gone and the log was compacted past
			// the one left (raft panicked on the missing entries).
			err = fmt.Errorf("the log in %s starts at entry %d and the newest snapshot holds entries up to %d only", where, first, snaps[0].Index)
		}
		if err != nil {
			g.closeWAL()
			return nil, nil, nil, &DamagedError{Path: filepath.Join(cfg.Dir, "snapshots"), What: "the snapshot the log continues", Err: err}
		}
	}
	return logs, stable, checked, nil
}

// checkWALMeta refuses a log whose segments are there but whose metadata
// database (which says which segments make the log, and holds raft's term
// and vote) is missing or empty: raft-wal would make a new one, and start
// on an empty log after the last snapshot (or, empty, crash; found by
// review).
func checkWALMeta(walDir string) error {
	entries, err := os.ReadDir(walDir)
	if err != nil {
		return nil // openWAL made it; raft-wal says what is wrong
	}
	segments := false
	for _, e := range entries {
		segments = segments || strings.HasSuffix(e.Name(), ".wal")
	}
	if !segments {
		return nil
	}
	meta := filepath.Join(walDir, metadb.FileName)
	fi, err := os.Stat(meta)
	switch {
	case errors.Is(err, os.ErrNotExist):
		err = fmt.Errorf("%s is missing, and the log's segments are there", metadb.FileName)
	case err == nil && fi.Size() == 0:
		err = fmt.Errorf("%s is empty, and the log's segments are there", metadb.FileName)
	}
	if err != nil {
		return &DamagedError{Path: walDir, What: "the raft log", Err: err}
	}
	return nil
}

// openWAL opens a group's own log in walDir, creating it, and verifies it
// entry by entry (batches: its entries are batches of store commands).
func openWAL(walDir string, batches bool) (*raftwal.WAL, error) {
	if err := os.MkdirAll(walDir, 0o700); err != nil {
		return nil, fmt.Errorf("replica: %w", err)
	}
	if err := checkTail(walDir); err != nil {
		return nil, err
	}
	if err := checkWALMeta(walDir); err != nil {
		return nil, err
	}
	w, err := raftwal.Open(walDir, raftwal.WithSegmentFiler(walsegment.NewFiler(walDir, newWALFS())))
	if err != nil {
		return nil, &DamagedError{Path: walDir, What: "the raft log", Err: err}
	}
	if batches {
		if err := verifyLog(w, walDir); err != nil {
			w.Close()
			return nil, err
		}
	}
	return w, nil
}

// OpenWAL opens (or makes) a raft log in walDir as a group on its own
// keeps it: raft-wal over segment files filled with zeros ahead of the
// writer (walFS). For bench/respfloor's raft floor, which measures what
// hashicorp/raft and this log cost without mqkv's store.
func OpenWAL(walDir string) (*raftwal.WAL, error) { return openWAL(walDir, false) }

// raftStableKeys are the keys hashicorp/raft keeps in its stable store.
var raftStableKeys = []string{"CurrentTerm", "LastVoteTerm", "LastVoteCand"}

// ImportWAL copies the log and stable values of a group's own log in
// walDir (as releases before the shared journal kept it) into dst, which
// must be empty, then renames walDir to walDir+ImportedSuffix (durably)
// and removes it. A walDir still there after a crash means the copy may
// be partial: empty dst and import again. batches says the entries are
// batches of store commands, checked on the way.
func ImportWAL(walDir string, dst LogStore, batches bool) error {
	w, err := openWAL(walDir, batches)
	if err != nil {
		return err
	}
	err = copyLog(w, dst)
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("replica: import %s: %w", walDir, err)
	}
	if err := os.Rename(walDir, walDir+ImportedSuffix); err != nil {
		return err
	}
	if err := journal.SyncDir(filepath.Dir(walDir)); err != nil {
		return err
	}
	return os.RemoveAll(walDir + ImportedSuffix)
}

// ImportedSuffix marks a log ImportWAL has copied in full.
const ImportedSuffix = ".imported"

func copyLog(src, dst LogStore) error {
	for _, k := range raftStableKeys {
		v, err := src.Get([]byte(k))
		if err != nil {
			return err
		}
		if len(v) > 0 {
			if err := dst.Set([]byte(k), v); err != nil {
				return err
			}
		}
	}
	first, err := src.FirstIndex()
	if err != nil {
		return err
	}
	last, err := src.LastIndex()
	if err != nil || first == 0 {
		return err
	}
	const chunk = 256
	for i := first; i <= last; i += chunk {
		var batch []*raft.Log
		for k := i; k < i+chunk && k <= last; k++ {
			l := new(raft.Log)
			if err := src.GetLog(k, l); err != nil {
				return err
			}
			batch = append(batch, l)
		}
		if err := dst.StoreLogs(batch); err != nil {
			return err
		}
	}
	return nil
}

// wedgeCheck stops the node when the log can take no more entries until it
// is reopened: raft-wal seals a full segment, then creates the next one; if
// that fails (the volume filled up despite the DiskGuard's reserve), every
// later append fails with "segment is sealed", and raft, stepping down and
// back up, would log that about a dozen times a second forever. A restart
// reopens the log and starts a new segment once there is room.
type wedgeCheck struct {
	*raftwal.WAL
	fail func(error)
	dir  string
}

func (w *wedgeCheck) StoreLogs(logs []*raft.Log) error {
	err := w.WAL.StoreLogs(logs)
	if errors.Is(err, waltypes.ErrSealed) {
		w.fail(fmt.Errorf("the raft log in %s could not start a new segment file (is the data volume full?): restart mqkv once space is freed; nothing acknowledged is lost", w.dir))
	}
	return err
}

func (w *wedgeCheck) StoreLog(l *raft.Log) error { return w.StoreLogs([]*raft.Log{l}) }

// AwaitLeader waits until this replica leads its group and has applied
// everything committed before, so reads see every write acknowledged
// before a restart. For a group of one, that is the end of its start.
func (g *Group) AwaitLeader(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for g.raft.State() != raft.Leader {
		if time.Now().After(deadline) {
			return errors.New("replica: no leadership")
		}
		select {
		case <-g.Failed():
			return g.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	return g.LeaderReady(ctx)
}

// verifyLog checks every entry of the log before raft replays it: the log
// store verifies only its newest batch, and an entry damaged further back
// would otherwise be found only when applied, after the node has started
// serving.
func verifyLog(logs raft.LogStore, path string) error {
	first, err := logs.FirstIndex()
	if err != nil {
		return &DamagedError{Path: path, What: "the raft log", Err: err}
	}
	last, err := logs.LastIndex()
	if err != nil {
		return &DamagedError{Path: path, What: "the raft log", Err: err}
	}
	if first == 0 {
		return nil // empty
	}
	var l raft.Log
	for i := first; i <= last; i++ {
		if err := logs.GetLog(i, &l); err != nil {
			return &DamagedError{Path: path, What: fmt.Sprintf("raft log entry %d", i), Err: err}
		}
		if l.Type != raft.LogCommand {
			// raft skips what is not a command. The batch checksum covers
			// an entry's data, not its type: a command whose type was
			// damaged would be skipped, its writes lost without a word.
			if len(l.Data) > 0 && store.VerifyBatch(l.Data) == nil {
				return &DamagedError{Path: path, What: fmt.Sprintf("raft log entry %d", i), Err: fmt.Errorf("a batch of writes in an entry of type %v", l.Type)}
			}
			continue
		}
		if err := store.VerifyBatch(l.Data); err != nil {
			return &DamagedError{Path: path, What: fmt.Sprintf("raft log entry %d", i), Err: err}
		}
	}
	return nil
}

// Fault is a failure that happens once and for good: the first Fail
// records why and closes Failed. Its zero value is not usable: NewFault.
type Fault struct {
	once   sync.Once
	failed chan struct{}
	err    error
}

// NewFault returns a Fault that has not happened.
func NewFault() *Fault { return &Fault{failed: make(chan struct{})} }

// Fail records err, the first time.
func (f *Fault) Fail(err error) {
	f.once.Do(func() {
		f.err = err
		close(f.failed)
	})
}

// Failed is closed once Fail was called.
func (f *Fault) Failed() <-chan struct{} { return f.failed }

// Err returns what Fail recorded, or nil.
func (f *Fault) Err() error {
	select {
	case <-f.failed:
		return f.err
	default:
		return nil
	}
}

// Clock returns the group's hybrid logical clock.
func (g *Group) Clock() *hlc.Clock { return g.clock }

// Closing is closed once Close is called.
func (g *Group) Closing() <-chan struct{} { return g.closing }

// Submit queues a write. It blocks only while the queue is full, which
// slows the caller down when the log cannot keep up. A replica that does
// not lead fails it at once with a *NotLeaderError.
func (g *Group) Submit(p Proposal) {
	if err := g.TrySubmit(p); err != nil {
		p.Done(store.Result{}, err)
	}
}

// TrySubmit is Submit, except that a write refused at once (ErrClosed, a
// *NotLeaderError, a full disk) is returned rather than given to p.Done,
// so that a caller can send it elsewhere without wrapping Done: a
// closure per write.
func (g *Group) TrySubmit(p Proposal) error {
	g.submitMu.RLock()
	defer g.submitMu.RUnlock()
	if g.closed {
		return ErrClosed
	}
	if g.raft.State() != raft.Leader {
		return g.notLeader()
	}
	if p.Cmd.Op.Stores() {
		if err := g.cfg.Disk.Check(); err != nil {
			return err
		}
	}
	g.in <- p
	return nil
}

func (g *Group) notLeader() error {
	_, id := g.raft.LeaderWithID()
	return &NotLeaderError{Leader: string(id)}
}

// Leader returns the node id of the group's leader as this replica knows
// it ("" if none), and whether that is this replica.
func (g *Group) Leader() (string, bool) {
	_, id := g.raft.LeaderWithID()
	return string(id), g.raft.State() == raft.Leader
}

// VerifyLeader confirms that this replica still leads its group: a quorum
// answered after the call began, so no other leader has committed anything
// this replica has not applied... once it has applied its commit index. A
// read served after VerifyLeader and Barrier-free apply wait is
// linearizable. raft batches concurrent calls into one round of
// heartbeats.
func (g *Group) VerifyLeader() error {
	if err := g.raft.VerifyLeader().Error(); err != nil {
		return g.notLeader()
	}
	return nil
}

// LeaderReady returns nil once this replica leads its group and has
// applied every entry committed before its term: only then are its reads
// current and the versions it stamps above every committed one (the clock
// observes versions as entries apply). Right after an election that takes
// one round of the log (a barrier), waited for until ctx's deadline (5 s
// without one); after that it costs two atomic loads, and ctx is not
// asked for its deadline (a request's reads the clock when asked).
func (g *Group) LeaderReady(ctx context.Context) error {
	if g.raft.State() != raft.Leader {
		return g.notLeader()
	}
	term := g.raft.CurrentTerm()
	if g.readyTerm.Load() == term {
		return nil // most calls end here
	}
	wait := 5 * time.Second
	if d, ok := ctx.Deadline(); ok {
		wait = time.Until(d)
	}
	if err := g.raft.Barrier(wait).Error(); err != nil {
		if errors.Is(err, raft.ErrEnqueueTimeout) {
			return fmt.Errorf("replica: %w", err)
		}
		return g.notLeader()
	}
	if g.raft.CurrentTerm() == term {
		g.readyTerm.Store(term)
	}
	return g.Err()
}

// ReadReady returns nil when a read of this replica's state is
// linearizable: it leads, has applied everything before its term, and (with
// other voters) a quorum still follows it, so no newer leader can have
// committed a write it has not applied. A lone voter cannot be deposed and
// skips the quorum round.
func (g *Group) ReadReady(ctx context.Context) error {
	if err := g.LeaderReady(ctx); err != nil {
		return err
	}
	if g.cfg.Transport == nil {
		return nil // a group of one by construction
	}
	if term := g.raft.CurrentTerm(); g.leaseHeld(term) && g.raft.State() == raft.Leader {
		g.leaseReads.Add(1)
		return nil
	}
	g.verifiedReads.Add(1)
	return g.VerifyLeader()
}

// leaseHeld reports whether this replica, leader in term, holds the read
// lease (see ReadLease): a quorum of the voters, itself among them,
// accepted an AppendEntries of term sent less than a ReadLease ago, and
// it has not begun to hand its leadership over. A group whose only voter
// is this replica holds it always.
func (g *Group) leaseHeld(term uint64) bool {
	if g.noLease.Load() == term {
		return false
	}
	self := raft.ServerID(g.cfg.NodeID)
	now := LeaseClock()
	voters, acked, member := 0, 0, false
	for _, s := range g.raft.GetConfiguration().Configuration().Servers {
		if s.Suffrage != raft.Voter {
			continue
		}
		voters++
		switch {
		case s.ID == self:
			member = true
			acked++
		case g.cfg.Acks != nil:
			if t := g.cfg.Acks.AckedAt(string(s.ID), term); t != 0 && now-t < ReadLease {
				acked++
			}
		}
	}
	return member && acked > voters/2
}

// TransferLeadership hands the leadership to voter id at addr, or to the
// most caught-up voter if id is empty. The follower it goes to stands
// for election at once, and the others vote for it though they know a
// leader: from now until the term ends, reads here confirm the
// leadership with a round of heartbeats (see ReadLease). Every handover
// of a group's leadership must come through here.
func (g *Group) TransferLeadership(id, addr string) raft.Future {
	g.noLease.Store(g.raft.CurrentTerm())
	if id == "" {
		return g.raft.LeadershipTransfer()
	}
	return g.raft.LeadershipTransferToServer(raft.ServerID(id), raft.ServerAddress(addr))
}

// Reads returns how many reads ReadReady allowed under the lease and how
// many after a round of heartbeats.
func (g *Group) Reads() (lease, verified int64) {
	return g.leaseReads.Load(), g.verifiedReads.Load()
}

// Current reports whether this replica keeps up with its group: it leads,
// or it is in the group's latest configuration and heard from a leader
// within silence. A replica removed from its group, or cut off from it,
// applies nothing more, though it may stay open for a while.
func (g *Group) Current(silence time.Duration) bool {
	if g.raft.State() == raft.Leader {
		return true
	}
	if time.Since(g.raft.LastContact()) > silence {
		return false
	}
	self := raft.ServerID(g.cfg.NodeID)
	for _, s := range g.raft.GetConfiguration().Configuration().Servers {
		if s.ID == self {
			return true
		}
	}
	return false
}

// Replicated reports whether the group may have replicas on other nodes,
// so that its leadership can move: false for a single node's group, made
// without a transport.
func (g *Group) Replicated() bool { return g.cfg.Transport != nil }

// Voters counts the voters of the group's latest configuration.
func (g *Group) Voters() int {
	n := 0
	for _, s := range g.raft.GetConfiguration().Configuration().Servers {
		if s.Suffrage == raft.Voter {
			n++
		}
	}
	return n
}

// Raft returns the group's raft instance, for membership changes. A
// leadership transfer goes through TransferLeadership.
func (g *Group) Raft() *raft.Raft { return g.raft }

// Get returns a copy of the live entry under key.
func (g *Group) Get(key []byte) (store.Entry, bool) {
	g.fsm.mu.RLock()
	defer g.fsm.mu.RUnlock()
	e, ok := g.fsm.st.GetBy(key, g.clock.WallMillis)
	if !ok {
		return store.Entry{}, false
	}
	return *e, true
}

// Ascend calls fn with the live entries whose keys start with prefix,
// from the first at or after from, in key order, until fn returns false or
// limit entries were given; it reports whether it ran out of entries
// (rather than stopping for fn or limit). fn may keep an entry's Key and
// Value, whose bytes never change, but not the entry (see store.Entry).
// It holds the store's read lock: fn must not block.
func (g *Group) Ascend(from, prefix []byte, limit int, fn func(*store.Entry) bool) (exhausted bool) {
	exhausted = true
	if bytes.Compare(from, prefix) < 0 {
		from = prefix // the keys before it would end the walk at once
	}
	g.view(func(s *store.Store, now int64) {
		n := 0
		s.Ascend(from, now, func(e *store.Entry) bool {
			if len(e.Key) < len(prefix) || string(e.Key[:len(prefix)]) != string(prefix) {
				return false // past every key with the prefix
			}
			if n == limit || !fn(e) {
				exhausted = false
				return false
			}
			n++
			return true
		})
	})
	return exhausted
}

// view calls fn with the store under a read lock. fn must not keep the
// store or block.
func (g *Group) view(fn func(s *store.Store, now int64)) {
	now := g.clock.WallMillis()
	g.fsm.mu.RLock()
	defer g.fsm.mu.RUnlock()
	fn(g.fsm.st, now)
}

// MaxVersion is the greatest version the group's applied state holds.
func (g *Group) MaxVersion() (v hlc.Timestamp) {
	g.view(func(s *store.Store, _ int64) { v = s.MaxVersion() })
	return v
}

// Stats reports the size of the group's state and log position.
type Stats struct {
	Keys          int
	Bytes         int64
	AppliedIndex  uint64
	LastIndex     uint64
	Expired       int64 // keys removed by expiry since start
	CommitIndex   uint64
	LeaderChanges int64 // leaders observed since start
	Restores      int64 // snapshots installed since start
	Voters        int
	Nonvoters     int       // replicas being caught up (a migration), as this replica knows
	LastSnapshot  time.Time // zero if none since start
	SnapshotBytes int64     // size of the last snapshot
	Leader        bool
}

// Stats returns current figures.
func (g *Group) Stats() Stats {
	g.fsm.mu.RLock()
	s := Stats{Keys: g.fsm.st.Len() - g.fsm.st.ServerKeys(), Bytes: g.fsm.st.Bytes()}
	g.fsm.mu.RUnlock()
	s.AppliedIndex = g.raft.AppliedIndex()
	s.LastIndex = g.raft.LastIndex()
	s.Expired = g.fsm.expired.Load()
	s.CommitIndex = g.raft.CommitIndex()
	s.LeaderChanges = g.leaderChanges.Load()
	s.Restores = g.fsm.restores.Load()
	for _, srv := range g.raft.GetConfiguration().Configuration().Servers {
		if srv.Suffrage == raft.Voter {
			s.Voters++
		} else {
			s.Nonvoters++
		}
	}
	if t := g.fsm.lastSnapshot.Load(); t != 0 {
		s.LastSnapshot = time.Unix(0, t)
	}
	s.SnapshotBytes = g.fsm.snapshotBytes.Load()
	s.Leader = g.raft.State() == raft.Leader
	return s
}

// Copy returns a copy-on-write copy of the store as it is now: cheap, and
// unaffected by later writes, so a backup can be written from it while
// writes go on. Every write with a version up to its MaxVersion is in it,
// none after (versions follow log order).
func (g *Group) Copy() *store.Store {
	// Clone marks the tree copy-on-write: a write, however brief.
	g.fsm.mu.Lock()
	defer g.fsm.mu.Unlock()
	return g.fsm.st.Clone()
}

// timedLogs times log appends (the fsync is in them).
type timedLogs struct {
	raft.LogStore
	observe func(time.Duration)
}

func (t timedLogs) StoreLog(l *raft.Log) error { return t.StoreLogs([]*raft.Log{l}) }

// IsMonotonic passes the log's on (see journal.Log.IsMonotonic): raft
// looks for it on the store it is given.
func (t timedLogs) IsMonotonic() bool {
	m, ok := t.LogStore.(raft.MonotonicLogStore)
	return ok && m.IsMonotonic()
}

func (t timedLogs) StoreLogs(logs []*raft.Log) error {
	start := time.Now()
	err := t.LogStore.StoreLogs(logs)
	t.observe(time.Since(start))
	return err
}

// snapshotIfLong takes a snapshot soon after the group opens (within three
// seconds) if its log already holds threshold entries past the last one.
// raft considers a snapshot only every two to four minutes of a process's
// life, so a node restarted more often than that (a crash loop) never
// compacted its log, and each start replayed more of it: 1.2 GB after 12
// kills 3 s apart (found by review).
func (g *Group) snapshotIfLong(threshold uint64) {
	defer g.wg.Done()
	// Let the replay and the first election settle; the groups of a node
	// spread over two seconds, not all snapshotting at once.
	select {
	case <-g.closing:
		return
	case <-time.After(time.Second + rand.N(2*time.Second)):
	}
	last, err := strconv.ParseUint(g.raft.Stats()["last_snapshot_index"], 10, 64)
	if err != nil || g.raft.LastIndex() < last+threshold {
		return
	}
	if err := g.raft.Snapshot().Error(); err != nil && !errors.Is(err, raft.ErrNothingNewToSnapshot) && !errors.Is(err, raft.ErrRaftShutdown) && g.cfg.Logger != nil {
		g.cfg.Logger.Warn("snapshot after start failed", "error", err)
	}
}

// Snapshot takes a snapshot now and compacts the log behind it.
func (g *Group) Snapshot() error {
	return g.raft.Snapshot().Error()
}

// Close stops the group. Pending proposals fail with ErrClosed unless they
// were already in the log.
func (g *Group) Close() error {
	var err error
	g.closeOnce.Do(func() {
		g.submitMu.Lock()
		g.closed = true
		g.submitMu.Unlock()
		close(g.closing)
		g.wg.Wait()
		g.nudgeMu.Lock()
		if g.nudge != nil {
			g.nudge.Stop()
		}
		g.nudgeMu.Unlock()
		f := g.raft.Shutdown()
		// Raft closes its transport only after its goroutines end; one of
		// them may wait for an answer from a peer that will not come
		// until the request's deadline. Closed first, the RPCs in flight
		// end now.
		if c, ok := g.cfg.Transport.(raft.WithClose); ok {
			c.Close()
		}
		err = f.Error()
		// No apply hands out more; what it handed is answered.
		close(g.answers)
		<-g.answered
		if werr := g.closeWAL(); err == nil {
			err = werr
		}
	})
	return err
}

func (g *Group) closeWAL() error {
	if g.wal == nil {
		return nil
	}
	return g.wal.Close()
}

// propose turns queued proposals into log entries. It waits for a free
// pipeline slot before gathering a batch, so everything that arrives while
// earlier entries are being synced goes into one entry.
func (g *Group) propose() {
	defer g.wg.Done()
	defer close(g.inflight)
	var (
		cmds  []store.Command
		dones []func(store.Result, error)
		prev  int // commands in the last entry
		// overhead is the last entry's bytes per command beyond its keys
		// and values, to size the next one's buffer (see below).
		overhead = 64
	)
	for {
		var first Proposal
		select {
		case first = <-g.in:
		case <-g.closing:
			g.drain()
			return
		}
		extra := g.takeSlot(first) // released by complete
		// The apply goroutine takes the commands as they are
		// (fsm.takeProposed): a slice of an entry that is done, or a new one.
		cmds = g.spare.take(cap(cmds))
		// Sized for the last entry's count: appended one by one, a
		// pipeline's entry of hundreds grew it ten times over.
		dones = make([]func(store.Result, error), 0, max(prev, 1))
		size := 0
		now := g.clock.WallMillis() // one reading for the entry's commands
		// look says whether a write may meet a key past its deadline whose
		// Expire is not applied yet (fsm.mayHaveExpired): only then does
		// add search the store, with g.fsm.mu read-locked (once for the
		// whole gathering, not once a write: two atomic operations on a
		// word the other core wrote, for each of a pipeline's hundreds).
		// Why not always: with a round's rest proposed while the entry
		// before it is applied (takeSlot), the gathering would wait for
		// that apply, which holds mu throughout, and sync nothing
		// meanwhile. A key set by an entry not applied yet is not seen
		// either way; the store removes it when the write is applied
		// (store.Store.set).
		look := g.fsm.mayHaveExpired(now)
		add := func(p Proposal) {
			if p.Cmd.Op != store.OpExpire && look {
				// A write to a key that has expired but whose Expire is
				// not applied yet: expire it first, in the same entry, so
				// observers get the DELETE (with its own version) before
				// the write.
				v, expired := g.fsm.st.Expired(p.Cmd.Key, now)
				if expired {
					cmds = append(cmds, store.Command{Op: store.OpExpire, Key: p.Cmd.Key, Expected: v, Now: now, Version: g.clock.Now()})
					dones = append(dones, nil)
				}
			}
			p.Cmd.Now = now
			p.Cmd.Version = g.clock.UpdateAt(p.After, now)
			cmds = append(cmds, p.Cmd)
			dones = append(dones, p.Done)
			size += len(p.Cmd.Key) + len(p.Cmd.Value)
		}
		g.lookAt(look, func() { add(first) })
		if d := holdFor(prev, len(g.in)+1, time.Duration(g.commitAvg.Load())); d > 0 && !first.Gathered {
			time.Sleep(d)
			now = g.clock.WallMillis()
			look = g.fsm.mayHaveExpired(now)
		}
		g.lookAt(look, func() {
			for len(cmds) < maxBatch && size < maxBatchBytes {
				select {
				case p := <-g.in:
					add(p)
				default:
					return
				}
			}
		})
		prev = len(cmds)
		if g.cfg.Timings.Entry != nil {
			g.cfg.Timings.Entry(len(cmds))
		}
		// Encoded straight into the slice raft keeps until applied, sized
		// from the last entry's encoding: encoding into a buffer of the
		// proposer's and copying it out copied a pipeline's entry (a few
		// hundred KB) once more. The slice is an applied entry's where
		// nothing reads that any more (spareData), else a new one.
		data := store.AppendBatch(g.spareData.take(size+len(cmds)*overhead+batchHeader), g.cfg.Limits, cmds)
		overhead = (len(data)-size)/len(cmds) + 1
		var ans *answers
		if len(cmds) >= answerFrom {
			ans = &answers{dones: dones, results: make([]store.Result, len(cmds)), out: g.answers}
		}
		g.fsm.propose(data, g.cfg.Limits, cmds, ans)
		start := time.Now()
		f := g.raft.Apply(data, 0)
		g.entries.Add(1)
		g.inflight <- pending{future: f, data: data, cmds: cmds, dones: dones, ans: ans, start: start, extra: extra}
	}
}

// maxSpareData is the most bytes an entry's slice may hold to be used
// again: a pipeline's entries are a few hundred KB, and an entry of one
// big value is not kept alive, held for the next, by spareData.
const maxSpareData = 1 << 20

// spares keeps slices done with for the next to use; a nil one keeps
// none.
type spares[T any] chan []T

// take returns an empty slice with room for n: a kept one if it has the
// room, else a new one.
func (s spares[T]) take(n int) []T {
	select {
	case b := <-s:
		if cap(b) >= n {
			return b[:0]
		}
	default:
	}
	return make([]T, 0, n)
}

// give keeps b for the next take, if there is room.
func (s spares[T]) give(b []T) {
	select {
	case s <- b:
	default:
	}
}

// lookAt runs fn, with g.fsm.mu read-locked if look (see propose).
func (g *Group) lookAt(look bool, fn func()) {
	if look {
		g.fsm.mu.RLock()
		defer g.fsm.mu.RUnlock()
	}
	fn()
}

// takeSlot waits for a pipeline slot for the entry that first begins,
// and says whether it took the extra one: only the rest of a round of
// gathered writes (Proposal.Gathered) takes it, once their sender has
// sent all of the round (RoundSent) and reads no other (RoundBegun), so
// that they go into an entry while the one before is synced or applied.
//
// Why: a round of a deep pipeline (the RESP loop's: 50 clients of 16
// SETs, 800 writes) takes long to read, and the proposer, woken by its
// first write, cuts an entry of what was sent so far. With one entry in
// flight (pipelineDepth), the rest of the round waited for that entry to
// be applied once the round was read, then for a sync and an apply of
// its own: 0.5 of a 2.6 ms round (a traced run). Any entry in flight
// beside another (pipelineDepth 2) split what arrives into more, smaller
// entries, which cost more CPU than the overlap gained; a round's rest is
// one more entry a round at most. 50 clients of 16 pipelined durable
// SETs, ten alternating rounds on fresh servers: median 0.94x Redis's
// against 0.88x, at 2.90 µs of CPU a SET against 2.95 (docs/benchmarks.md,
// issue 32, eleventh).
func (g *Group) takeSlot(first Proposal) (extra bool) {
	select {
	case g.slots <- struct{}{}:
		return false
	default:
	}
	for {
		select {
		case g.slots <- struct{}{}:
			return false
		case <-g.roundSent:
			if !first.Gathered || g.reading.Load() {
				continue // not a round's, or a round is still being read
			}
			select {
			case g.extra <- struct{}{}:
				return true
			default: // a round's rest is in flight already
			}
		}
	}
}

// RoundBegun says that the sender of gathered writes (Proposal.Gathered)
// reads a round of them; RoundSent, that it has sent all of it. A round's
// writes queued behind an entry in flight then go into an entry at once
// (see takeSlot). There is one such sender, the node's RESP loop.
func (g *Group) RoundBegun() { g.reading.Store(true) }

// RoundSent: see RoundBegun.
func (g *Group) RoundSent() {
	g.reading.Store(false)
	select {
	case g.roundSent <- struct{}{}:
	default:
	}
}

// holdFor is how long the proposer waits, its pipeline free, before it
// gathers the queued writes into an entry: prev is how many the last
// entry carried, queued how many wait now, commit how long an entry
// takes from proposal to applied.
//
// Why: under many writers, group commit alternates. Once a big entry is
// applied, its replies go out, and the first writer to send again finds
// the pipeline free and gets an entry and a sync to itself, while the
// others queue behind it. With 64 clients of durable SET, 54 % of the
// log entries carried one command (10,811 entries for 147,137 SETs),
// each paying a sync's CPU (some 48 µs of kernel time) and raft's
// hand-offs. When the last entry had many writers and few have come
// back, waiting a while lets the rest join. Half an entry's commit time
// at most: the writers behind a lone entry would have waited all of it.
// A writer on its own (or a few) never waits: prev stays under
// holdWriters. Measured (docs/benchmarks.md, 2026-11-26): at 64 clients
// the one-command entries fell from 5,804 to 529-596 in 7 s and the mean
// entry grew from 13.6 to 22 commands; durable SET +11-20 % at 16 clients
// with 8-13 % less CPU per SET, +3-17 % at 8 and 32, -1 to +11 % at 64
// (up to 8 % less CPU), unchanged at 1 and 4 clients and in a three-node
// cluster. Waiting on a timer matters: a hold woken by each arriving
// write (tried first) spent what it saved.
//
// No hold either once holdEnough writes wait: an entry of that many
// shares its sync well enough, and its writers' clients wait for the
// hold with nothing gained. Pipelining clients queue hundreds of writes
// while an entry commits, fewer than half of the last entry's (whose
// replies have not gone out yet). 50 clients of 16 pipelined durable
// SETs: at two Ps 171-175k SETs/s against 148-164k; at the Ps of the
// time, entries of 444 commands against 579, one every 3.2 ms against
// 4.3 (docs/benchmarks.md, 2026-11-30).
func holdFor(prev, queued int, commit time.Duration) time.Duration {
	if prev < holdWriters || 2*queued >= prev || queued >= holdEnough {
		return 0
	}
	return min(commit/2, maxHold)
}

// batchHeader is room for an entry's bytes around its commands (format,
// limits, count, checksum).
const batchHeader = 32

const (
	holdWriters = 8
	holdEnough  = 64
	maxHold     = 2 * time.Millisecond // a slow disk's writers gather anyway
)

// armNudge has nudgeFollowers run commitNudge from now, unless the
// group proposes another entry meanwhile. Only a group with a transport
// has followers to tell.
func (g *Group) armNudge() {
	if g.cfg.Transport == nil {
		return
	}
	g.nudgeMu.Lock()
	defer g.nudgeMu.Unlock()
	g.nudgeFrom = g.entries.Load()
	if g.nudge == nil {
		g.nudge = time.AfterFunc(commitNudge, g.nudgeFollowers)
	} else {
		g.nudge.Reset(commitNudge)
	}
}

// nudgeFollowers tells the followers the commit index once the leader's
// entries stopped coming: a follower learns it from the next
// AppendEntries, and applies (and reports events for) the last writes of
// a burst only then. hashicorp/raft sends one every CommitTimeout, idle
// or not; an empty barrier entry sends one now, once per burst. The
// barrier's own commit reaches the followers later: it changes nothing.
func (g *Group) nudgeFollowers() {
	g.nudgeMu.Lock()
	from := g.nudgeFrom
	g.nudgeMu.Unlock()
	if g.entries.Load() != from || g.raft.State() != raft.Leader || g.Voters() <= 1 {
		return // a newer entry carries the commit index, or nobody follows
	}
	select {
	case <-g.closing:
		return
	default:
	}
	g.raft.Barrier(0) // not waited for: it only needs to be sent
}

// drain fails proposals still queued at close.
func (g *Group) drain() {
	for {
		select {
		case p := <-g.in:
			p.Done(store.Result{}, ErrClosed)
		default:
			return
		}
	}
}

// complete reports results in log order as entries are applied.
func (g *Group) complete() {
	defer g.wg.Done()
	for p := range g.inflight {
		err := p.future.Error()
		took := time.Since(p.start)
		if g.cfg.Timings.Commit != nil {
			g.cfg.Timings.Commit(took)
		}
		avg := g.commitAvg.Load() // written here only
		g.commitAvg.Store(avg + (int64(took)-avg)/8)
		switch {
		case err == nil:
		case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrEnqueueTimeout), errors.Is(err, raft.ErrLeadershipTransferInProgress):
			err = g.notLeader() // never entered the log
		default:
			err = ErrOutcomeUnknown // raft.ErrLeadershipLost, shutdown...
		}
		// Taken when applied; not, if the future failed or the log store
		// handed raft another copy of the bytes. Forgotten, the commands
		// are the proposer's again.
		handed := g.fsm.forget(p.data, p.ans)
		g.spare.give(p.cmds)
		// Applied, the entry's bytes are read by nobody where the log
		// store copied them (raft-wal encodes each entry anew; raft
		// replicates and re-applies what the store gives back): the
		// apply took them from raft's future, answered now. Where the
		// store keeps them (spareData nil), they are the log's. Why: a
		// pipelined SET's entry bytes were a quarter of all it allocated
		// (1.19 GB for 1,000,000 SETs, 0.90 GB with them reused), which
		// the collector pays for in cycles (docs/benchmarks.md, issue
		// 32, fourteenth).
		if err == nil && cap(p.data) <= maxSpareData {
			g.spareData.give(p.data)
		}
		var results []store.Result
		if err == nil {
			switch r := p.future.Response().(type) {
			case []store.Result:
				results = r
			case error:
				err = r
			}
		}
		if err == nil && len(results) != len(p.dones) {
			err = fmt.Errorf("replica: %d results for %d commands", len(results), len(p.dones))
		}
		if p.extra {
			<-g.extra
		} else {
			<-g.slots
		}
		if len(g.inflight) == 0 {
			g.armNudge()
		}
		if err == nil {
			results = results[handed:]
		}
		answerEach(p.dones[handed:], results, err)
	}
}

// answerEach gives each done its command's result, or err if not nil
// (results may then be nil).
func answerEach(dones []func(store.Result, error), results []store.Result, err error) {
	for i, done := range dones {
		switch {
		case done == nil: // a command the proposer added itself
		case err != nil:
			done(store.Result{}, err)
		default:
			done(results[i], nil)
		}
	}
}

// answerFrom is the fewest commands an entry has for them to be answered
// as they are applied (see answers): a smaller entry's apply is over
// before a chunk's hand-off would have paid.
const answerFrom = 2 * answerEvery

// answer answers the chunks of big entries the apply hands it (see
// answers), until the group is closed.
func (g *Group) answer() {
	defer close(g.answered)
	for a := range g.answers {
		answerEach(a.dones, a.results, nil)
	}
}

func (g *Group) wakeExpiry() {
	select {
	case g.expiryCh <- struct{}{}:
	default:
	}
}

// expireLoop proposes an Expire for every key whose deadline has passed, so
// that expiry is replicated and observers get DELETE notifications.
func (g *Group) expireLoop() {
	defer g.wg.Done()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	type due struct {
		key     []byte
		version hlc.Timestamp
	}
	var batch []due
	for {
		now := g.clock.WallMillis()
		batch = batch[:0]
		var next int64
		var haveNext bool
		leader := g.raft.State() == raft.Leader
		g.view(func(s *store.Store, _ int64) {
			if leader { // followers apply the leader's Expire commands
				s.Due(now, maxBatch, func(key []byte, v hlc.Timestamp) {
					batch = append(batch, due{key, v})
				})
			}
			next, haveNext = s.NextExpiry()
		})
		// Wait for this round's Expires to apply, so the next scan does
		// not find (and propose) the same keys again.
		var wg sync.WaitGroup
		var failed atomic.Bool
		wg.Add(len(batch))
		for _, d := range batch {
			g.Submit(Proposal{
				Cmd: store.Command{Op: store.OpExpire, Key: d.key, Expected: d.version},
				Done: func(_ store.Result, err error) {
					if err != nil {
						failed.Store(true)
					}
					wg.Done()
				},
			})
		}
		wg.Wait()
		select {
		case <-g.closing:
			return
		default:
		}
		wait := time.Hour
		if haveNext {
			wait = time.Duration(next-g.clock.WallMillis()) * time.Millisecond
			if len(batch) == maxBatch || wait < 0 {
				wait = 0
			}
			if !leader || failed.Load() {
				// Nothing this node can do about overdue keys right now:
				// look again shortly instead of spinning.
				wait = max(wait, 100*time.Millisecond)
			}
		}
		if len(batch) > 0 && wait == 0 {
			continue
		}
		timer.Reset(wait)
		select {
		case <-timer.C:
		case <-g.expiryCh:
		case <-g.closing:
			return
		}
	}
}

// Restore makes dir (which must not hold a group yet) the state of a new
// single-voter group whose store is the snapshot read from r (a backup), and
// returns the greatest version and the number of keys in it. The snapshot
// is verified (format and checksum) before anything is written.
func Restore(dir, nodeID string, r io.Reader) (hlc.Timestamp, int, error) {
	st := store.New(store.Limits{})
	if err := st.ReadSnapshot(r); err != nil {
		return hlc.Timestamp{}, 0, fmt.Errorf("restore: not a valid backup: %w", err)
	}
	if err := Seed(dir, nodeID, nodeID, st); err != nil {
		return hlc.Timestamp{}, 0, fmt.Errorf("restore: %w", err)
	}
	return st.MaxVersion(), st.Len(), nil
}

// Seed makes dir (which must not hold a group yet) the state of a new
// group whose only voter is nodeID at addr and whose store is st: the
// group starts from it as from a snapshot.
func Seed(dir, nodeID, addr string, st *store.Store) error {
	if entries, err := os.ReadDir(dir); err == nil && len(entries) > 0 {
		return fmt.Errorf("%s is not empty", dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	fss, err := raft.NewFileSnapshotStoreWithLogger(dir, retainSnapshots, raftLogger())
	if err != nil {
		return err
	}
	snaps := CheckedSnapshots(dir, fss, raft.NewInmemStore()) // only written to here
	_, trans := raft.NewInmemTransport(raft.ServerAddress(addr))
	conf := raft.Configuration{Servers: []raft.Server{{ID: raft.ServerID(nodeID), Address: raft.ServerAddress(addr)}}}
	sink, err := snaps.Create(raft.SnapshotVersionMax, 1, 1, conf, 1, trans)
	if err != nil {
		return err
	}
	if err := st.WriteSnapshot(sink); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}

// retainSnapshots is how many snapshots are kept on disk.
const retainSnapshots = 2

// RaftLogger returns a raft logger that writes into log at debug level:
// in a cluster raft reports every unreachable peer and every election as
// an error, which is routine there (the cluster's own log says what
// matters, once).
func RaftLogger(name string, log *slog.Logger) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{Name: name, Level: hclog.Info, Output: slogWriter{log}, DisableTime: true})
}

type slogWriter struct{ log *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	w.log.Debug(strings.TrimSpace(string(p)), "component", "raft")
	return len(p), nil
}

// raftLogger is raft's logger. A lone voter "times out" and elects itself
// at every start: raft's warnings are routine here, so only its errors are
// shown.
func raftLogger() hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Error, Output: os.Stderr})
}
