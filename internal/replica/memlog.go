package replica

import (
	"errors"
	"sync/atomic"

	"github.com/hashicorp/raft"
)

// memLog is the log of a group kept in memory (--in-memory). raft keeps
// every entry until a snapshot compacts the log, and it checks for one only
// every two to four minutes (SnapshotInterval) and only past 4,096 entries:
// a node taking 18,000 SETs a second of 1 KiB values over 10,000 keys grew
// to 5.7 GB in 90 s while its store held 10 MiB. This log counts the bytes
// it holds and asks for a snapshot once they pass a limit that grows with
// the store, so that memory stays within about three times the store (the
// store, the snapshot's copy, the log) plus memLogBytes, and a snapshot is
// taken at most once per store's worth of writes.
//
// It also keeps copies of the entries it is given: on a leader raft hands
// the log a pointer into its apply future, which holds the entry's result
// (a SET's previous value) as long as the log holds the entry.
type memLog struct {
	*raft.InmemStore
	bytes atomic.Int64  // of the entries held
	limit atomic.Int64  // bytes past which full is signalled
	full  chan struct{} // a snapshot is due
}

// memLogBytes is the least a group's log may hold before it asks for a
// snapshot (a node in memory has eight groups).
const memLogBytes = 16 << 20

func newMemLog() *memLog {
	m := &memLog{InmemStore: raft.NewInmemStore(), full: make(chan struct{}, 1)}
	m.limit.Store(memLogBytes)
	return m
}

// entryBytes is what an entry costs the log: its payload and a little for
// the record.
func entryBytes(l *raft.Log) int64 { return int64(len(l.Data)+len(l.Extensions)) + 64 }

func (m *memLog) StoreLog(l *raft.Log) error { return m.StoreLogs([]*raft.Log{l}) }

func (m *memLog) StoreLogs(logs []*raft.Log) error {
	copies := make([]raft.Log, len(logs))
	ptrs := make([]*raft.Log, len(logs))
	var n int64
	for i, l := range logs {
		copies[i] = *l
		ptrs[i] = &copies[i]
		n += entryBytes(l)
	}
	if err := m.InmemStore.StoreLogs(ptrs); err != nil {
		return err
	}
	if m.bytes.Add(n) > m.limit.Load() {
		select {
		case m.full <- struct{}{}:
		default:
		}
	}
	return nil
}

func (m *memLog) DeleteRange(min, max uint64) error {
	var n int64
	var l raft.Log
	for i := min; i <= max && i >= min; i++ {
		if m.InmemStore.GetLog(i, &l) == nil {
			n += entryBytes(&l)
		}
	}
	if err := m.InmemStore.DeleteRange(min, max); err != nil {
		return err
	}
	m.bytes.Add(-n)
	return nil
}

// compactMemLog snapshots the group whenever its in-memory log holds more
// than the larger of memLogBytes and the store's bytes, then lets it grow
// by as much again from what the compaction left.
func (g *Group) compactMemLog(m *memLog) {
	defer g.wg.Done()
	for {
		select {
		case <-g.closing:
			return
		case <-m.full:
		}
		g.fsm.mu.RLock()
		storeBytes := g.fsm.st.Bytes()
		g.fsm.mu.RUnlock()
		grow := max(memLogBytes, storeBytes)
		if m.bytes.Load() <= grow {
			m.limit.Store(grow) // the store grew: so may the log
			continue
		}
		if g.cfg.Transport != nil {
			g.boundTrailing(m)
		}
		err := g.raft.Snapshot().Error()
		if err != nil && !errors.Is(err, raft.ErrNothingNewToSnapshot) && !errors.Is(err, raft.ErrRaftShutdown) && g.cfg.Logger != nil {
			g.cfg.Logger.Warn("in-memory log: snapshot failed", "error", err)
		}
		m.limit.Store(m.bytes.Load() + grow)
	}
}

// boundTrailing sets how many entries a snapshot leaves behind (for other
// members that catch up from the log) so that they hold about half of
// memLogBytes at the log's mean entry size: raft's count alone, 1,024
// entries of up to 4 MiB, let a group in memory keep 136 MiB for a store
// of 128 KiB (found by review).
func (g *Group) boundTrailing(m *memLog) {
	first, _ := m.FirstIndex()
	last, _ := m.LastIndex()
	if first == 0 || last < first {
		return
	}
	mean := m.bytes.Load() / int64(last-first+1)
	keep := uint64(min(max(memLogBytes/2/max(mean, 1), 16), 1024))
	rc := g.raft.ReloadableConfig()
	if rc.TrailingLogs != keep {
		rc.TrailingLogs = keep
		g.raft.ReloadConfig(rc)
	}
}
