package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// ErrNoLeader is reported when a key's group has no reachable leader before
// the request's deadline (a group without quorum). Nothing was applied.
var ErrNoLeader = errors.New("cluster: no leader for the key's group; retry when the cluster has a quorum again")

// waitStep is how long a request waits for an election before trying
// again: about one election timeout.
const waitStep = 100 * time.Millisecond

// Submit implements statestore.Router: the write goes to the leader of its
// key's group, here or on another node.
func (n *Node) Submit(ctx context.Context, p replica.Proposal) {
	if err := n.unready(); err != nil {
		p.Done(store.Result{}, err)
		return
	}
	g := n.groupOf(p.Cmd.Key)
	if r := n.local(g); r != nil && r.LeaderReady(ctx) == nil {
		done := p.Done
		if r.Replicated() {
			// Queued, the write may still be refused as not the
			// leader's: raft takes no entry while a leadership transfer
			// is under way (the placement moves leaders so). A group of
			// one never loses its leader, and its writes are spared the
			// closure.
			p.Done = n.toLeaderIfRefused(ctx, g, p, done)
		}
		switch err := r.TrySubmit(p); {
		case err == nil:
		case isNotLeader(err):
			n.forward(ctx, g, p.Cmd, n.after(p.After, p.Stamp), done)
		default:
			done(store.Result{}, err)
		}
		return
	}
	n.forward(ctx, g, p.Cmd, n.after(p.After, p.Stamp), p.Done)
}

// after is the timestamp a write leaving this node carries: its request's,
// or this node's clock for one that asks for it (replica.Proposal.Stamp),
// so that the leader's version is above everything this node has seen.
func (n *Node) after(after hlc.Timestamp, stamp bool) hlc.Timestamp {
	if stamp && after.IsZero() {
		return n.clock.Now()
	}
	return after
}

// Forwarded returns how many writes and key reads this node sent on to
// another member, the leader of their key's group: the hop a client that
// sends each request to its key's leader (see Routes) saves.
func (n *Node) Forwarded() (writes, reads int64) {
	return n.forwardedWrites.Load(), n.forwardedReads.Load()
}

// Writes forwarded to other nodes' leaders and not yet answered are
// bounded per group, in number and in bytes: Submit waits for room, as it
// waits for room in a local group's queue, so that a client pipelining
// writes through a node that does not lead their groups slows down instead
// of making the node hold them all (found by review: 6,000 writes of 64
// KiB, a goroutine and a value each). Per group, so that a leader that
// stalls (stopped, cut off) holds up only its own group's writes.
const (
	maxForwarded      = 64
	maxForwardedBytes = 16 << 20
)

// forwarding counts what is forwarded to one group.
type forwarding struct {
	mu     sync.Mutex
	writes int
	bytes  int
	wake   chan struct{} // closed, and forgotten, when room is made
}

// acquire waits until there is room for a write of size bytes, or ctx
// ends. A write goes while fewer than maxForwardedBytes are out, whatever
// its own size: a value larger than the budget is not starved by a
// stream of small ones (it waits only until the bytes drop below it).
func (f *forwarding) acquire(ctx context.Context, size int) error {
	for {
		f.mu.Lock()
		if f.writes < maxForwarded && f.bytes < maxForwardedBytes {
			f.writes++
			f.bytes += size
			f.mu.Unlock()
			return nil
		}
		if f.wake == nil {
			f.wake = make(chan struct{})
		}
		wake := f.wake
		f.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (f *forwarding) release(size int) {
	f.mu.Lock()
	f.writes--
	f.bytes -= size
	wake := f.wake
	f.wake = nil
	f.mu.Unlock()
	if wake != nil {
		close(wake)
	}
}

// forwardingTo returns group g's count.
func (n *Node) forwardingTo(g int) *forwarding {
	if f, ok := n.forwarded.Load(g); ok {
		return f.(*forwarding)
	}
	f, _ := n.forwarded.LoadOrStore(g, &forwarding{})
	return f.(*forwarding)
}

// forward sends a write to its group's leader on another goroutine, once
// there is room (see maxForwarded).
func (n *Node) forward(ctx context.Context, g int, cmd store.Command, after hlc.Timestamp, done func(store.Result, error)) {
	n.forwardedWrites.Add(1)
	size := len(cmd.Key) + len(cmd.Value)
	f := n.forwardingTo(g)
	if err := f.acquire(ctx, size); err != nil {
		done(store.Result{}, ErrNoLeader)
		return
	}
	go n.submitRemote(ctx, g, cmd, after, false, func(res store.Result, err error) {
		f.release(size)
		done(res, err)
	})
}

// toLeaderIfRefused wraps the Done of a write given to a local replica: a
// write refused as not the leader's never entered the log, so it goes on
// to the group's leader, wherever that is now.
func (n *Node) toLeaderIfRefused(ctx context.Context, g int, p replica.Proposal, done func(store.Result, error)) func(store.Result, error) {
	cmd, after, stamp := p.Cmd, p.After, p.Stamp
	return func(res store.Result, err error) {
		if isNotLeader(err) {
			go n.forward(ctx, g, cmd, n.after(after, stamp), done) // not on raft's goroutine: it may wait
			return
		}
		done(res, err)
	}
}

func isNotLeader(err error) bool {
	if err == nil {
		return false // before the target, which escapes: none allocated
	}
	var nl *replica.NotLeaderError
	return errors.As(err, &nl)
}

// submitRemote sends a write to its group's leader and waits for the
// outcome, following leader hints until ctx ends. A leader this node
// cannot reach is reached through another member (see via), unless the
// write came relayed already.
func (n *Node) submitRemote(ctx context.Context, g int, cmd store.Command, after hlc.Timestamp, relayed bool, done func(store.Result, error)) {
	var unreachable map[string]bool
	for {
		leader := n.leaderOf(g)
		if leader == n.cfg.NodeID {
			if r := n.local(g); r != nil {
				if err := r.LeaderReady(ctx); err == nil {
					ch := make(chan struct{})
					var res store.Result
					var err error
					r.Submit(replica.Proposal{Cmd: cmd, After: after, Done: func(rs store.Result, e error) { res, err = rs, e; close(ch) }})
					<-ch
					if !isNotLeader(err) {
						done(res, err)
						return
					}
				}
			}
		} else if leader != "" {
			var resp callResp
			req := callReq{Op: opSubmit, Group: g, Cmd: cmd, After: after}
			to := n.via(leader, unreachable, relayed, &req)
			err := n.call(ctx, to, req, &resp)
			switch {
			case err == nil && resp.Kind == errNone:
				done(resp.Result, nil)
				return
			case err == nil && resp.Kind == errUnknown:
				done(store.Result{}, replica.ErrOutcomeUnknown)
				return
			case err == nil && resp.Kind == errNotLeader:
				n.hint(g, resp.Leader)
			case err == nil && resp.Kind == errDiskFull && resp.DiskFull != nil:
				done(store.Result{}, resp.DiskFull) // the statestore answers it as it is
				return
			case err == nil:
				done(store.Result{}, errors.New(resp.Err))
				return
			case !errors.Is(err, errNotSent):
				// The request may have reached the leader: its fate is
				// unknown, and retrying could apply it twice.
				done(store.Result{}, replica.ErrOutcomeUnknown)
				return
			default:
				if unreachable == nil {
					unreachable = map[string]bool{}
				}
				unreachable[to] = true
				if to == leader && relayed {
					n.hint(g, "") // unreachable: look elsewhere
				}
			}
		}
		select {
		case <-ctx.Done():
			done(store.Result{}, ErrNoLeader)
			return
		case <-time.After(waitStep):
		}
	}
}

// Get implements statestore.Router: a linearizable read at the leader of
// the key's group.
func (n *Node) Get(ctx context.Context, key []byte) (store.Entry, bool, error) {
	if err := n.unready(); err != nil {
		return store.Entry{}, false, err
	}
	g := n.groupOf(key)
	if r := n.local(g); r != nil && r.ReadReady(ctx) == nil {
		e, ok := r.Get(key)
		return e, ok, nil
	}
	n.forwardedReads.Add(1)
	var resp callResp
	err := n.onLeader(ctx, g, callReq{Op: opGet, Group: g, Key: key}, &resp, func(r *replica.Group) {
		resp.Entry, resp.Found = r.Get(key)
	})
	return resp.Entry, resp.Found, err
}

// onLeader runs a read on the leader of g: locally (local) if this node
// leads, else as a call; it retries on leader changes until ctx ends.
func (n *Node) onLeader(ctx context.Context, g int, req callReq, resp *callResp, local func(*replica.Group)) error {
	var unreachable map[string]bool
	relayed := req.Relay || req.Op != opGet && req.Op != opAscend // only reads are relayed
	for {
		leader := n.leaderOf(g)
		if leader == n.cfg.NodeID {
			if r := n.local(g); r != nil && r.ReadReady(ctx) == nil {
				local(r)
				return nil
			}
		} else if leader != "" {
			req := req
			to := n.via(leader, unreachable, relayed, &req)
			err := n.call(ctx, to, req, resp)
			switch {
			case err == nil && resp.Kind == errNone:
				return nil
			case err == nil && resp.Kind == errNotLeader:
				n.hint(g, resp.Leader)
			case err == nil:
				return errors.New(resp.Err)
			default:
				if unreachable == nil {
					unreachable = map[string]bool{}
				}
				unreachable[to] = true
				if to == leader && relayed {
					n.hint(g, "")
				}
			}
		}
		select {
		case <-ctx.Done():
			return ErrNoLeader
		case <-time.After(waitStep):
		}
	}
}

// Ascend implements statestore.Router: every group is read at its leader,
// and the pages are merged in key order. Each group gives at most limit
// entries; the merge is exact up to the smallest last key of the groups
// that had more, and stops there.
func (n *Node) Ascend(ctx context.Context, from, prefix []byte, limit int, fn func(*store.Entry) bool) (bool, error) {
	if err := n.unready(); err != nil {
		return false, err
	}
	count := n.groupCount()
	if count == 1 {
		if r := n.local(0); r != nil && r.ReadReady(ctx) == nil {
			return r.Ascend(from, prefix, limit, fn), nil
		}
	}
	type page struct {
		entries   []store.Entry
		exhausted bool
		err       error
	}
	pages := make([]page, count)
	done := make(chan struct{}, count)
	for g := 0; g < count; g++ {
		go func() {
			defer func() { done <- struct{}{} }()
			var resp callResp
			err := n.onLeader(ctx, g, callReq{Op: opAscend, Group: g, From: from, Prefix: prefix, Limit: limit}, &resp, func(r *replica.Group) {
				resp.Entries, resp.Exhausted = pageOf(r, from, prefix, limit)
			})
			pages[g] = page{resp.Entries, resp.Exhausted, err}
		}()
	}
	for range count {
		<-done
	}
	var bound []byte // entries after it may be missing from a page
	for _, p := range pages {
		if p.err != nil {
			return false, p.err
		}
		if !p.exhausted && len(p.entries) > 0 {
			last := p.entries[len(p.entries)-1].Key
			if bound == nil || bytes.Compare(last, bound) < 0 {
				bound = last
			}
		}
	}
	exhausted := bound == nil
	next := make([]int, count)
	for {
		best := -1
		for g, p := range pages {
			if next[g] < len(p.entries) && (best < 0 || bytes.Compare(p.entries[next[g]].Key, pages[best].entries[next[best]].Key) < 0) {
				best = g
			}
		}
		if best < 0 {
			return exhausted, nil
		}
		e := &pages[best].entries[next[best]]
		if bound != nil && bytes.Compare(e.Key, bound) > 0 {
			return false, nil
		}
		next[best]++
		if !fn(e) {
			return false, nil
		}
	}
}

// via returns whom a request for leader is sent to: the leader itself,
// unless this node cannot reach it (it found it unreachable, or does not
// hear it: see health) while another member answers, through which req,
// marked as relayed, is sent on. A partial partition (the link between
// this node and the leader cut, the others up) stalled each request for
// the whole request timeout (found by trying it). A relayed request is not
// relayed again.
func (n *Node) via(leader string, unreachable map[string]bool, relayed bool, req *callReq) string {
	if relayed || !unreachable[leader] && n.alive(leader) {
		return leader
	}
	st := n.state.Load()
	if st == nil {
		return leader
	}
	for _, m := range st.Nodes {
		if m.ID != n.cfg.NodeID && m.ID != leader && !unreachable[m.ID] && n.alive(m.ID) {
			req.Relay = true
			return m.ID
		}
	}
	return leader
}

// leaderOf returns the node id of g's leader as this node knows it: from
// its own replica, else the last hint, else the preferred leader of the
// placement.
func (n *Node) leaderOf(g int) string {
	if r := n.local(g); r != nil {
		if id, _ := r.Leader(); id != "" {
			return id
		}
	}
	// A hint naming this node is stale: its own replica would know (a
	// node that led the group may since have handed its replica over).
	if v, ok := n.hints.Load(g); ok && *v.(*string) != "" && *v.(*string) != n.cfg.NodeID {
		return *v.(*string)
	}
	if st := n.state.Load(); st != nil {
		if t := st.Placement(); g < len(t) && len(t[g]) > 0 {
			// Rotate through the replicas so that an unreachable one
			// is not asked forever.
			return t[g][int(time.Now().UnixNano()/int64(waitStep))%len(t[g])]
		}
	}
	return ""
}

// hint records who leads g ("" forgets).
func (n *Node) hint(g int, leader string) { n.hints.Store(g, &leader) }

// errNotSent marks a call that never left this node: safe to retry.
var errNotSent = errors.New("cluster: not sent")

// call sends a request to a member.
func (n *Node) call(ctx context.Context, id string, req callReq, resp *callResp) error {
	addr := n.addrOf(id)
	if addr == "" {
		return fmt.Errorf("%w: unknown member %s", errNotSent, id)
	}
	*resp = callResp{}
	var err error
	if binaryCall(&req) && n.Protocol() >= protocolBinaryCalls {
		var reply []byte
		if reply, err = n.link.CallBytes(ctx, addr, appendCall(nil, &req)); err == nil {
			err = decodeReply(reply, resp)
		}
	} else {
		err = n.link.Call(ctx, addr, req, resp)
	}
	var ne *peer.NotSentError
	if errors.As(err, &ne) {
		return fmt.Errorf("%w: %v", errNotSent, err)
	}
	return err
}

// RoundBegun tells this node's groups that a round of gathered writes
// (replica.Proposal.Gathered) is being read, RoundSent that all of it
// was sent (statestore.Rounds; replica.Group.RoundBegun). A round's
// writes may go to any group, so every group is told.
func (n *Node) RoundBegun() { n.eachLocal((*replica.Group).RoundBegun) }

// RoundSent: see RoundBegun.
func (n *Node) RoundSent() { n.eachLocal((*replica.Group).RoundSent) }

// eachLocal runs fn on each of this node's replicas (see local).
func (n *Node) eachLocal(fn func(*replica.Group)) {
	if m := n.view.Load(); m != nil {
		for _, g := range *m {
			fn(g)
		}
	}
}
