package replica

import (
	"fmt"
	"sync"

	"github.com/hashicorp/raft"
)

// logCache keeps a group's most recent log entries in memory, for the
// reads that follow an append (replication to followers, a follower's
// apply), in front of the node's journal. It is bounded by bytes as well
// as by count: hashicorp's LogCache holds a fixed number of entries
// whatever their size (512 entries of 1 MiB values was half a GiB per
// group, on every follower), and it holds the *raft.Log it was given,
// which on a leader lies inside raft's apply future, keeping the future's
// response (every applied command's result, a SET's previous value
// included) alive until the entry leaves. This cache keeps copies of the
// entries, and only entries of at most a sixteenth of its bytes.
type logCache struct {
	store    raft.LogStore
	maxBytes int

	mu    sync.Mutex
	ring  []raft.Log // by index modulo the count; Index 0: empty
	bytes int        // of the entries held
}

func newLogCache(store raft.LogStore, count, maxBytes int) *logCache {
	return &logCache{store: store, maxBytes: maxBytes, ring: make([]raft.Log, count)}
}

// IsMonotonic passes the store's on (see journal.Log.IsMonotonic).
func (c *logCache) IsMonotonic() bool {
	m, ok := c.store.(raft.MonotonicLogStore)
	return ok && m.IsMonotonic()
}

func (c *logCache) GetLog(idx uint64, log *raft.Log) error {
	c.mu.Lock()
	e := c.ring[idx%uint64(len(c.ring))]
	c.mu.Unlock()
	if e.Index == idx && idx != 0 {
		*log = e
		return nil
	}
	return c.store.GetLog(idx, log)
}

func (c *logCache) StoreLog(log *raft.Log) error { return c.StoreLogs([]*raft.Log{log}) }

func (c *logCache) StoreLogs(logs []*raft.Log) error {
	if err := c.store.StoreLogs(logs); err != nil {
		return fmt.Errorf("unable to store logs within log store, err: %q", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, l := range logs {
		slot := &c.ring[l.Index%uint64(len(c.ring))]
		c.bytes -= len(slot.Data) + len(slot.Extensions)
		*slot = raft.Log{}
		size := len(l.Data) + len(l.Extensions)
		if size > c.maxBytes/16 {
			continue // read back from the store
		}
		c.evictFor(size, l.Index)
		*slot = *l // a copy: the caller's Log (inside raft's future) is not kept
		c.bytes += size
	}
	return nil
}

// evictFor drops the oldest entries until size more bytes fit; index is
// the entry about to be stored.
func (c *logCache) evictFor(size int, index uint64) {
	n := uint64(len(c.ring))
	for i := uint64(1); c.bytes+size > c.maxBytes && i < n; i++ {
		// The slots after index's, oldest first.
		slot := &c.ring[(index+i)%n]
		if slot.Index != 0 {
			c.bytes -= len(slot.Data) + len(slot.Extensions)
			*slot = raft.Log{}
		}
	}
}

func (c *logCache) FirstIndex() (uint64, error) { return c.store.FirstIndex() }
func (c *logCache) LastIndex() (uint64, error)  { return c.store.LastIndex() }

func (c *logCache) DeleteRange(min, max uint64) error {
	c.mu.Lock()
	clear(c.ring)
	c.bytes = 0
	c.mu.Unlock()
	return c.store.DeleteRange(min, max)
}
