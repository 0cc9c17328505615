package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// Backups. Each group is copied at its leader (a copy-on-write clone, so
// the copy costs memory only as writes go on) and read from there a page
// at a time, in key order; the node serving the backup merges the groups'
// pages into one snapshot as it writes it. So no node holds more of the
// backup than a page per group: before, each leader sent its whole group
// as one message (a 512 MiB message limit, and a stall of every other
// call on that link meanwhile), and the serving node held every group,
// twice, before it wrote a byte.

// copyIdle is how long a copy is held without a page being read or the
// backup saying it goes on (see keepCopies): a backup whose reader went
// away (or never learned the copy's id: its call was cancelled) does not
// pin its copies for ever. Atomic, for tests.
var copyIdle atomic.Int64

func init() { copyIdle.Store(int64(10 * time.Minute)) }

func idleLimit() time.Duration { return time.Duration(copyIdle.Load()) }

// Timeouts of a backup: to copy every group (each waits for its group's
// leader), and to read one page. Variables for tests.
var (
	copyTimeout = time.Minute
	pageTimeout = 30 * time.Second
)

// maxCopies bounds the copies a node holds at once (a backup holds one
// per group it leads).
const maxCopies = 256

// copyPageBytes bounds a page of a copy (keys and values; one entry at
// least). A variable for tests.
var copyPageBytes = maxPageBytes

// copies are the group copies this node holds for backups, by id. The
// backup chooses the id (at random: a node that restarted must not hand a
// backup that began before another backup's copy under the same id), so
// that it can end a copy whose taking it did not hear the answer to.
type copies struct {
	mu   sync.Mutex
	held map[uint64]*heldCopy
	// ended are ids ended before they were held: calls are served
	// concurrently, so the end of a backup that gave up can be served
	// before its begin. Kept for copyIdle.
	ended map[uint64]time.Time
}

type heldCopy struct {
	st    *store.Store
	used  time.Time
	idle  time.Duration // copyIdle when it was taken
	timer *time.Timer   // drops the copy once idle
}

// hold keeps st for paging under id.
func (c *copies) hold(id uint64, st *store.Store) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.held) >= maxCopies {
		return fmt.Errorf("cluster: %d backup copies held already; try again when a backup ends", maxCopies)
	}
	if c.held == nil {
		c.held = map[uint64]*heldCopy{}
	}
	if c.held[id] != nil {
		return fmt.Errorf("cluster: backup copy %d is held already", id)
	}
	if _, gone := c.ended[id]; gone {
		delete(c.ended, id)
		return fmt.Errorf("cluster: backup copy %d was ended already", id)
	}
	h := &heldCopy{st: st, used: time.Now(), idle: idleLimit()}
	h.timer = time.AfterFunc(h.idle, func() { c.expire(id) })
	c.held[id] = h
	return nil
}

// close drops every copy: the node stops.
func (c *copies) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, h := range c.held {
		h.timer.Stop()
		delete(c.held, id)
	}
}

// expire drops copy id if it was not read for copyIdle, or looks again
// when it could be.
func (c *copies) expire(id uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	h := c.held[id]
	if h == nil {
		return
	}
	if idle := time.Since(h.used); idle < h.idle {
		h.timer.Reset(h.idle - idle)
		return
	}
	delete(c.held, id)
}

// page returns the entries of copy id from from on, up to copyPageBytes,
// and whether they are the last.
func (c *copies) page(id uint64, from []byte) ([]store.Entry, bool, error) {
	h, err := c.touch(id)
	if err != nil {
		return nil, false, err
	}
	entries, last := pageOfCopy(h.st, from, nil)
	return entries, last, nil
}

// touch marks copy id used now.
func (c *copies) touch(id uint64) (*heldCopy, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	h := c.held[id]
	if h == nil {
		return nil, fmt.Errorf("cluster: backup copy %d is gone (not read for too long, or the node restarted)", id)
	}
	h.used = time.Now()
	return h, nil
}

// pageOfCopy appends to page the entries of st from from on, up to
// copyPageBytes (one at least), and says whether they are the last.
func pageOfCopy(st *store.Store, from []byte, page []store.Entry) ([]store.Entry, bool) {
	size, last := 0, true
	st.Entries(from, func(e *store.Entry) bool {
		if len(page) > 0 && size >= copyPageBytes {
			last = false
			return false
		}
		page = append(page, *e)
		size += len(e.Key) + len(e.Value)
		return true
	})
	return page, last
}

func (c *copies) drop(id uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if h := c.held[id]; h != nil {
		h.timer.Stop()
		delete(c.held, id)
		return
	}
	if c.ended == nil {
		c.ended = map[uint64]time.Time{}
	}
	now := time.Now()
	for old, at := range c.ended {
		if now.Sub(at) > idleLimit() {
			delete(c.ended, old)
		}
	}
	if len(c.ended) < 4*maxCopies {
		c.ended[id] = now
	}
}

// Backup writes a snapshot of the whole store to w, calling start first
// with its greatest version and number of keys (for headers). A node on
// its own copies its one group at one point. In a cluster every group is
// copied at its leader, each at its own point (after everything
// acknowledged before the copy of that group began): a write acknowledged
// before the backup started is in it; of writes that overlap the backup,
// some groups' may be in and others' not, as for SCAN.
func (n *Node) Backup(ctx context.Context, start func(maxVersion hlc.Timestamp, keys int), w io.Writer) error {
	if n.link == nil {
		st := n.local(0).Copy()
		start(st.MaxVersion(), st.Len()-st.ServerKeys())
		return st.WriteSnapshot(w)
	}
	copyCtx, cancel := context.WithTimeout(ctx, copyTimeout)
	parts, err := n.copyGroups(copyCtx)
	cancel()
	defer func() {
		var wg sync.WaitGroup
		for _, p := range parts {
			if p != nil {
				wg.Add(1)
				go func() { defer wg.Done(); p.end(n) }()
			}
		}
		wg.Wait()
	}()
	if err != nil {
		return err
	}
	var maxVersion hlc.Timestamp
	keys, serverKeys := 0, 0
	for _, p := range parts {
		if p.maxVersion.Compare(maxVersion) > 0 {
			maxVersion = p.maxVersion
		}
		keys += p.keys
		serverKeys += p.serverKeys
	}
	start(maxVersion, keys-serverKeys)
	stopKeeping := n.keepCopies(parts)
	defer stopKeeping()
	sw, err := store.NewSnapshotWriter(w, maxVersion, keys)
	if err != nil {
		return err
	}
	// Keys hash to groups: the groups' keys never meet, and the next
	// entry is the least of the groups' next ones.
	for {
		var least *part
		for _, p := range parts {
			if err := p.fill(ctx, n); err != nil {
				return err
			}
			if len(p.page) > 0 && (least == nil || bytes.Compare(p.page[0].Key, least.page[0].Key) < 0) {
				least = p
			}
		}
		if least == nil {
			return sw.Close()
		}
		if err := sw.Add(&least.page[0]); err != nil {
			return err
		}
		least.page = least.page[1:]
	}
}

// part is one group's copy, as the backup reads it.
type part struct {
	g          int
	maxVersion hlc.Timestamp
	keys       int
	serverKeys int          // of keys, the server's own (store.ServerKeys)
	local      *store.Store // a copy taken here, or nil
	holder     string       // else the node holding it, and its id there
	id         uint64
	page       []store.Entry // read, not yet written
	next       []byte        // where the next page begins; nil before the first
	last       bool          // no page after this one
}

// copyGroups copies every group at its leader, in parallel.
func (n *Node) copyGroups(ctx context.Context) ([]*part, error) {
	count := n.groupCount()
	parts := make([]*part, count)
	errs := make([]error, count)
	var wg sync.WaitGroup
	for g := range count {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := &part{g: g, id: rand.Uint64() | 1}
			var resp callResp
			err := n.onLeader(ctx, g, callReq{Op: opCopyBegin, Group: g, Copy: p.id}, &resp, func(r *replica.Group) { p.local = r.Copy() })
			if err != nil {
				// A node may have taken the copy without this one
				// hearing so: let every member drop it.
				go n.endEverywhere(p.id)
			}
			if err != nil && ctx.Err() != nil {
				err = ctx.Err()
			}
			switch {
			case err != nil && err.Error() == unknownCall:
				// A node of an older release: it sends its whole group.
				err = n.onLeader(ctx, g, callReq{Op: opCopy, Group: g}, &resp, func(r *replica.Group) { p.local = r.Copy() })
				if err == nil && p.local == nil {
					p.local = store.New(store.Limits{})
					err = p.local.ReadSnapshot(bytes.NewReader(resp.Snapshot))
				}
			case err == nil && p.local == nil:
				p.holder, p.keys, p.serverKeys, p.maxVersion = resp.Holder, resp.Keys, resp.ServerKeys, resp.MaxVersion
			}
			if err != nil {
				errs[g] = fmt.Errorf("group %d: %w", g, err)
				return
			}
			if p.local != nil {
				p.keys, p.serverKeys, p.maxVersion = p.local.Len(), p.local.ServerKeys(), p.local.MaxVersion()
			}
			parts[g] = p
		}()
	}
	wg.Wait()
	return parts, errors.Join(errs...)
}

// fill reads p's next page once the one before is written.
func (p *part) fill(ctx context.Context, n *Node) error {
	if len(p.page) > 0 || p.last {
		return nil
	}
	from := p.next
	if p.local != nil {
		p.page, p.last = pageOfCopy(p.local, from, p.page[:0])
	} else {
		var resp callResp
		ctx, cancel := context.WithTimeout(ctx, pageTimeout)
		err := n.call(ctx, p.holder, callReq{Op: opCopyPage, Copy: p.id, From: from}, &resp)
		cancel()
		if err != nil {
			return fmt.Errorf("group %d: %w", p.g, err)
		}
		if resp.Kind != errNone {
			return fmt.Errorf("group %d: %s", p.g, resp.Err)
		}
		p.page, p.last = resp.Entries, resp.Exhausted
	}
	if len(p.page) > 0 {
		// The next page begins just after this one's last key.
		p.next = append(append(p.next[:0], p.page[len(p.page)-1].Key...), 0)
	}
	return nil
}

// keepCopies tells the holders of parts, every quarter of copyIdle, that
// the backup goes on, until the returned func is called: a group's next
// page is asked for only once about a page of every group has been
// written to the client, which on a slow link can take longer than
// copyIdle. (A holder of a release before opCopyKeep answers "unknown
// call": its copies then live on pages alone.)
func (n *Node) keepCopies(parts []*part) (stop func()) {
	done, exited := make(chan struct{}), make(chan struct{})
	every := idleLimit() / 4
	go func() {
		defer close(exited)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			for _, p := range parts {
				if p.holder != "" {
					ctx, cancel := context.WithTimeout(context.Background(), every)
					var resp callResp
					n.call(ctx, p.holder, callReq{Op: opCopyKeep, Copy: p.id}, &resp)
					cancel()
				}
			}
		}
	}()
	return func() { close(done); <-exited }
}

// end lets the holder drop p's copy.
func (p *part) end(n *Node) {
	if p.holder != "" {
		n.endCopy(p.holder, p.id)
	}
}

// endCopy asks node id to drop copy (if it holds it).
func (n *Node) endCopy(id string, copy uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var resp callResp
	n.call(ctx, id, callReq{Op: opCopyEnd, Copy: copy}, &resp)
}

// endEverywhere asks every member to drop copy.
func (n *Node) endEverywhere(copy uint64) {
	st := n.state.Load()
	if st == nil {
		return
	}
	for _, m := range st.Nodes {
		if m.ID == n.cfg.NodeID {
			n.copies.drop(copy)
		} else {
			n.endCopy(m.ID, copy)
		}
	}
}
