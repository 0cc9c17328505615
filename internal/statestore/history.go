package statestore

import (
	"cmp"
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

// change is one remembered event, with when it was applied and its place
// in the order changes reached this node.
type change struct {
	store.Event
	at  time.Time
	seq uint64
}

func (c *change) size() int64 { return int64(len(c.Key) + len(c.Value)) }

// partitionLog is the history of one partition, oldest first. floor is the
// greatest version it has forgotten: it can replay everything after floor;
// floorSeq is the same in arrival order.
type partitionLog struct {
	changes  []change
	floor    hlc.Timestamp
	floorSeq uint64
}

// maxReplay bounds the changes one KEYNOTIFY ... SINCE replays (while
// notifications are held back); asking for more is answered "truncated".
const maxReplay = 10_000

// history keeps the recent changes of every partition, bounded by count,
// age and bytes, so a client that reconnects can ask for what it missed.
// It is not persisted: after a restart it starts empty, with every floor at
// the node's clock, and a SINCE from before then is answered "truncated".
// Until start is called, every SINCE is truncated. The service's dispatch
// lock guards it: changes are added, and replays read, under that lock.
//
// On a node on its own changes arrive in version order. In a cluster each
// group's changes do (a key's too), but the groups' streams interleave: a
// change of one group may arrive after a newer one of another. A watcher
// that saw a prefix of the arrival order and resumes a PATTERN with SINCE
// the version it saw last is then replayed what arrived after that change
// (see after), not what is newer than that version, which could skip a
// change that arrived late.
type history struct {
	limits HistoryLimits
	parts  [store.Partitions]partitionLog
	bytes  int64
	sweep  int           // next partition to check for old changes
	latest hlc.Timestamp // the greatest version added (or start's)
	seq    uint64        // changes added since the node started
	// disordered is set once a change arrived after a newer one: a
	// version then no longer says which changes came before it.
	disordered bool
}

func newHistory(limits HistoryLimits) *history {
	h := &history{limits: limits}
	for i := range h.parts {
		h.parts[i].floor = hlc.Timestamp{Wall: 1 << 62} // nothing known yet
	}
	return h
}

// start declares that every change after version from will be added.
func (h *history) start(from hlc.Timestamp) {
	h.latest = from
	for i := range h.parts {
		h.parts[i].floor = from
		h.parts[i].floorSeq = h.seq
		h.parts[i].changes = nil
	}
	h.bytes = 0
}

// add remembers applied events. Keys and values are not copied: the store
// never modifies them.
func (h *history) add(events []store.Event, now time.Time) {
	first := h.seq + 1
	for i := range events {
		h.seq++
		switch v := events[i].Version; v.Compare(h.latest) {
		case 1:
			h.latest = v
		case -1:
			h.disordered = true
		}
	}
	if h.limits.PerPartition <= 0 {
		return
	}
	for i := range events {
		e := &events[i]
		c := change{Event: *e, at: now, seq: first + uint64(i)}
		p := &h.parts[store.Partition(e.Key)]
		p.changes = append(p.changes, c)
		h.bytes += c.size()
		h.trim(p, now, true)
	}
	// Partitions that are not written to still age out their changes.
	for n := 0; n < 4; n++ {
		h.sweep = (h.sweep + 1) % store.Partitions
		h.trim(&h.parts[h.sweep], now, false)
	}
}

// trim forgets p's oldest changes while it is over its limits (and, when
// written to, while the whole history is over its byte budget).
func (h *history) trim(p *partitionLog, now time.Time, written bool) {
	for len(p.changes) > 0 {
		old := &p.changes[0]
		over := len(p.changes) > h.limits.PerPartition ||
			(h.limits.MaxAge > 0 && now.Sub(old.at) > h.limits.MaxAge) ||
			(written && h.limits.MaxBytes > 0 && h.bytes > h.limits.MaxBytes && len(p.changes) > 1)
		if !over {
			break
		}
		if old.Version.Compare(p.floor) > 0 {
			p.floor = old.Version
		}
		p.floorSeq = max(p.floorSeq, old.seq)
		h.bytes -= old.size()
		p.changes[0] = change{}
		p.changes = p.changes[1:]
	}
	if len(p.changes) == 0 {
		p.changes = nil // let the backing array go
	}
}

// since returns the changes after version v to key (or, with a pattern
// m, to keys matching it), in version order. ok is false when the history
// no longer reaches back to v, is disabled, or holds more than maxReplay
// such changes.
func (h *history) since(key []byte, m *glob.Matcher, v hlc.Timestamp) ([]change, bool) {
	if h.limits.PerPartition <= 0 {
		return nil, false // nothing is kept
	}
	var out []change
	collect := func(p *partitionLog) bool {
		if p.floor.Compare(v) > 0 {
			return false
		}
		for _, c := range p.changes {
			if c.Version.Compare(v) <= 0 {
				continue
			}
			if m != nil && m.Match(c.Key) || m == nil && string(c.Key) == string(key) {
				if len(out) == maxReplay {
					return false
				}
				out = append(out, c)
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
	slices.SortFunc(out, func(a, b change) int { return a.Version.Compare(b.Version) })
	return out, true
}

// after returns the changes to keys matching m that arrived after the
// change whose version is v, in arrival order. ok is false when no such
// change is remembered, when some change after it was forgotten, or when
// there are more than maxReplay. While every change has arrived in version
// order this is since: a v that names no change is answered that way.
func (h *history) after(m *glob.Matcher, v hlc.Timestamp) ([]change, bool) {
	if h.limits.PerPartition <= 0 {
		return nil, false
	}
	var at uint64
	for i := range h.parts {
		for _, c := range h.parts[i].changes {
			if c.Version == v {
				at = max(at, c.seq)
			}
		}
	}
	if at == 0 {
		if h.disordered {
			return nil, false
		}
		return h.since(nil, m, v)
	}
	var out []change
	for i := range h.parts {
		p := &h.parts[i]
		if p.floorSeq > at {
			return nil, false
		}
		for _, c := range p.changes {
			if c.seq > at && m.Match(c.Key) {
				if len(out) == maxReplay {
					return nil, false
				}
				out = append(out, c)
			}
		}
	}
	slices.SortFunc(out, func(a, b change) int { return cmp.Compare(a.seq, b.seq) })
	return out, true
}
