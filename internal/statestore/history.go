package statestore

import (
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

// change is one remembered event, with when it was applied.
type change struct {
	store.Event
	at time.Time
}

func (c *change) size() int64 { return int64(len(c.Key) + len(c.Value)) }

// partitionLog is the history of one partition: a ring of n changes from
// head, oldest first. floor is the greatest version it has forgotten: it
// can replay everything after floor.
//
// A ring, because a partition at its limit forgets one change for each it
// adds: a slice sliding through its backing array was copied into a new
// one every few writes, about 230 bytes allocated per SET.
type partitionLog struct {
	ring    []change
	head, n int
	floor   hlc.Timestamp
	trimmed bool // floor was raised by a change forgotten
}

// at returns the i-th oldest change.
func (p *partitionLog) at(i int) *change { return &p.ring[(p.head+i)%len(p.ring)] }

// push adds c as the newest change, growing the ring when full.
func (p *partitionLog) push(c change) {
	if p.n == len(p.ring) {
		grown := make([]change, max(4, 2*len(p.ring)))
		for i := 0; i < p.n; i++ {
			grown[i] = *p.at(i)
		}
		p.ring, p.head = grown, 0
	}
	*p.at(p.n) = c
	p.n++
}

// drop forgets the oldest change; once none is left, the ring goes too.
func (p *partitionLog) drop() {
	*p.at(0) = change{} // its key and value may go
	p.head = (p.head + 1) % len(p.ring)
	p.n--
	if p.n == 0 {
		p.ring, p.head = nil, 0
	}
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
	bytes  int64
	sweep  int           // next partition to check for old changes
	latest hlc.Timestamp // the greatest version added (or start's)
	gaps   int           // losses of changes not yet bounded (see gap)
}

func newHistory(limits HistoryLimits) *history {
	h := &history{limits: limits}
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

// add remembers applied events. Keys and values are not copied: the store
// never modifies them.
func (h *history) add(events []store.Event, now time.Time) {
	for i := range events {
		if v := events[i].Version; v.Compare(h.latest) > 0 {
			h.latest = v
		}
	}
	if h.limits.PerPartition <= 0 {
		return
	}
	for i := range events {
		e := &events[i]
		c := change{Event: *e, at: now}
		p := &h.parts[store.Partition(e.Key)]
		p.push(c)
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
	for p.n > 0 {
		old := p.at(0)
		over := p.n > h.limits.PerPartition ||
			(h.limits.MaxAge > 0 && now.Sub(old.at) > h.limits.MaxAge) ||
			(written && h.limits.MaxBytes > 0 && h.bytes > h.limits.MaxBytes && p.n > 1)
		if !over {
			break
		}
		if !p.trimmed || old.Version.Compare(p.floor) > 0 {
			p.floor, p.trimmed = old.Version, true
		}
		h.bytes -= old.size()
		p.drop()
	}
}

// since returns the changes after version v to key (or, with a pattern
// m, to keys matching it), in version order. ok is false when the history
// no longer reaches back to v, is disabled, or holds more than maxReplay
// such changes.
func (h *history) since(key []byte, m *glob.Matcher, v hlc.Timestamp) ([]change, bool) {
	if h.limits.PerPartition <= 0 || h.gaps > 0 {
		return nil, false // nothing is kept, or changes were lost
	}
	var out []change
	collect := func(p *partitionLog) bool {
		if p.floor.Compare(v) > 0 {
			return false
		}
		for i := 0; i < p.n; i++ {
			c := p.at(i)
			if c.Version.Compare(v) <= 0 {
				continue
			}
			if m != nil && m.Match(c.Key) || m == nil && string(c.Key) == string(key) {
				if len(out) == maxReplay {
					return false
				}
				out = append(out, *c)
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
