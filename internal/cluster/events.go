package cluster

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// Change events in a cluster. Every replica applies the same entries and so
// produces the same events per log entry; each keeps the recent ones in a
// ring, by log index. A node that follows (Follow: a server does at its
// start, for its mirror of retained messages and its change history, and
// so at its first KEYNOTIFY) follows every group: it starts from another
// replica's ring, from that ring's beginning, so that its change history
// reaches back as far as the group's rings do; it goes on from its own
// replica's ring when it has one that serves its position, else over the
// stream, and resumes by log index when it switches source (a leader
// change, a replica that moves, a broken stream), so its clients get every
// change once, in log order per group.
//
// A node on its own delivers its group's events through a queue (see
// eventQueue): in order, every one, off the apply goroutine.

// entryEvents are the events of one log entry. Wire format.
type entryEvents struct {
	Index  uint64
	Events []store.Event
}

// Ring bounds: the entries and bytes of events one replica keeps.
const (
	ringEntries = 4096
	ringBytes   = 8 << 20
)

// ring is a replica's recent events.
type ring struct {
	mu      sync.Mutex
	entries []entryEvents
	bytes   int
	floor   uint64 // every entry after floor that had events is here
	// floorVersion is at or above the version of every change up to
	// floor: the store's greatest when the ring began, then the greatest
	// it dropped.
	floorVersion hlc.Timestamp
	known        bool   // floor is meaningful (false after a snapshot install, until the next batch)
	last         uint64 // the last index applied
	wake         chan struct{}
}

func newRing() *ring { return &ring{wake: make(chan struct{})} }

func (r *ring) add(b replica.Batch) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if b.Reset {
		r.entries, r.bytes, r.known = nil, 0, false
		return
	}
	if !r.known {
		r.floor, r.floorVersion, r.known = b.First-1, b.Before, true
	}
	start := 0
	for _, m := range b.Marks {
		evs := make([]store.Event, m.End-start)
		copy(evs, b.Events[start:m.End])
		for _, e := range evs {
			r.bytes += len(e.Key) + len(e.Value)
		}
		r.entries = append(r.entries, entryEvents{Index: m.Index, Events: evs})
		start = m.End
	}
	for len(r.entries) > ringEntries || r.bytes > ringBytes && len(r.entries) > 1 {
		for _, e := range r.entries[0].Events {
			r.bytes -= len(e.Key) + len(e.Value)
			if e.Version.Compare(r.floorVersion) > 0 {
				r.floorVersion = e.Version
			}
		}
		r.floor = r.entries[0].Index
		r.entries = r.entries[1:]
	}
	r.last = b.Last
	close(r.wake)
	r.wake = make(chan struct{})
}

// start is where the ring begins: every entry after index that had
// events is here, and every change up to it has a version at most
// version; ok is false while that is not known (see known).
func (r *ring) start() (index uint64, version hlc.Timestamp, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.floor, r.floorVersion, r.known
}

// position is the last index applied.
func (r *ring) position() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// since returns the entries after index, the last index applied, and a
// channel closed at the next change; ok is false if the ring no longer
// (or not yet) holds everything after index. Then last is the earliest
// position it can serve (0: none).
func (r *ring) since(index uint64) (out []entryEvents, last uint64, wake <-chan struct{}, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.known {
		return nil, 0, r.wake, false
	}
	if index < r.floor {
		return nil, r.floor, r.wake, false
	}
	for i := len(r.entries) - 1; i >= 0 && r.entries[i].Index > index; i-- {
		out = r.entries[i:]
	}
	return append([]entryEvents(nil), out...), max(r.last, index), r.wake, true
}

// errEventsTruncated answers a follower whose position a ring no longer
// holds: it fell further behind than a ring keeps.
const errEventsTruncated = "events truncated"

// follower delivers the node's change events to its OnEvents.
type follower struct {
	n         *Node
	mu        sync.Mutex
	rings     map[int]*ring
	following map[int]chan struct{} // group → closed once it has a position
	gapped    map[int]bool          // group → changes were lost; OnEventsGap awaits the next
	// floors: group → a version at or above every change of the group
	// not delivered, once it has a position: every change above it is
	// (see HistoryFloor).
	floors map[int]hlc.Timestamp
	gaps   atomic.Int32 // len(gapped): deliver looks at gapped only if some
	stop   chan struct{}
	wg     sync.WaitGroup
	alone  *eventQueue // a node on its own's (see local)
}

func newFollower(n *Node) *follower {
	return &follower{n: n, rings: map[int]*ring{}, following: map[int]chan struct{}{}, gapped: map[int]bool{}, floors: map[int]hlc.Timestamp{}, stop: make(chan struct{})}
}

// local returns the OnEvents of this node's replica of g.
func (f *follower) local(g int) func(replica.Batch) {
	if f.n.link == nil { // on its own: through a queue to OnEvents
		if f.n.cfg.OnEvents == nil {
			return func(replica.Batch) {}
		}
		q := newEventQueue(eventQueueBytes)
		f.alone = q
		go q.run(f.n.cfg.OnEvents)
		return func(b replica.Batch) {
			if len(b.Events) > 0 {
				q.push(b.Events)
			}
		}
	}
	r := newRing()
	f.mu.Lock()
	f.rings[g] = r
	f.mu.Unlock()
	return r.add
}

func (f *follower) replicaClosed(g int) {
	f.mu.Lock()
	delete(f.rings, g)
	f.mu.Unlock()
}

func (f *follower) ringOf(g int) *ring {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.rings[g]
}

// Following reports whether every applied change already reaches
// OnEvents: on a node on its own always, in a cluster once Follow
// returned.
func (n *Node) Following() bool {
	if n.link == nil {
		return true
	}
	n.events.mu.Lock()
	defer n.events.mu.Unlock()
	return len(n.events.following) > 0
}

// HistoryFloor returns, once the node follows (see Follow), a version
// above every change to partition p that was not delivered to OnEvents:
// every change of p with a greater version was, since following began.
// A restarted member's replicas replay their logs from their last
// snapshots, so it reaches back before the restart.
func (n *Node) HistoryFloor(p int) (hlc.Timestamp, bool) {
	if n.link == nil {
		return hlc.Timestamp{}, false
	}
	g := p % n.groupCount()
	n.events.mu.Lock()
	defer n.events.mu.Unlock()
	v, ok := n.events.floors[g]
	return v, ok
}

// Follow makes the node follow every group's changes (once it has clients
// that watch) and returns when it does: every change applied after Follow
// returns is delivered. A node on its own always does.
func (n *Node) Follow(ctx context.Context) error {
	if n.link == nil {
		return nil
	}
	if err := n.unready(); err != nil {
		return err
	}
	f := n.events
	var waits []chan struct{}
	f.mu.Lock()
	for g := 0; g < n.groupCount(); g++ {
		ch := f.following[g]
		if ch == nil {
			ch = make(chan struct{})
			f.following[g] = ch
			f.wg.Add(1)
			go f.follow(g, ch)
		}
		waits = append(waits, ch)
	}
	f.mu.Unlock()
	for _, ch := range waits {
		select {
		case <-ch:
		case <-ctx.Done():
			return ErrNoLeader
		}
	}
	return nil
}

// follow delivers group g's events, from wherever they can be had.
// positioned is closed once it knows where it starts.
func (f *follower) follow(g int, positioned chan struct{}) {
	defer f.wg.Done()
	var cursor uint64 // the last index delivered; 0: start from now
	var behind int    // rounds in which members answered only that they no longer hold it
	once := sync.Once{}
	// mark sets the cursor. The first time it is caught up (a stream's
	// first batch may come in parts: see More), floor is the group's (see
	// floors), and Follow hears that g has a position: its callers then
	// register for notifications, which must not include the older
	// changes of the catch-up.
	// A catch-up cut off between its parts resumes from the cursor, in a
	// stream that carries no floor: from keeps the first one.
	var floor hlc.Timestamp
	mark := func(c uint64, from *hlc.Timestamp, caughtUp bool) {
		cursor = c
		if from != nil {
			floor = *from
		}
		if !caughtUp {
			return
		}
		once.Do(func() {
			f.mu.Lock()
			f.floors[g] = floor
			f.mu.Unlock()
			close(positioned)
		})
	}
	for tried := false; ; tried = true {
		select {
		case <-f.stop:
			return
		default:
		}
		// Starting out, from another member's ring first, from its
		// beginning (see FromStart): a member that has run longer holds
		// more of the group's changes than this node's replica, which
		// began at its last snapshot (a restarted member's) or at the
		// snapshot it was sent (a new one's); the node's change history
		// then reaches back as far as it can, and a client resuming here
		// gets every change. This node's replica takes over once it
		// serves the position (see stream).
		// A leader's own ring holds every change acknowledged (see serve).
		if r := f.ringOf(g); r != nil && (cursor != 0 || tried || f.leads(g)) && f.current(g) && f.fromRing(r, g, &cursor, mark) {
			continue
		}
		f.fromPeers(g, &cursor, mark, &behind)
		select {
		case <-f.stop:
			return
		case <-time.After(waitStep):
		}
	}
}

// fromRing delivers from this node's own replica while it can; it reports
// false when the ring cannot serve the cursor (a replica that started from
// a snapshot, or fell behind a stream). Without a position yet (no other
// member answered), it starts from the ring's beginning.
func (f *follower) fromRing(r *ring, g int, cursor *uint64, mark func(uint64, *hlc.Timestamp, bool)) bool {
	served := false
	for {
		since := *cursor
		var from *hlc.Timestamp
		if since == 0 {
			start, v, known := r.start()
			if !known {
				return served
			}
			since, from = start, &v
		}
		entries, last, wake, ok := r.since(since)
		if !ok {
			return served
		}
		served = true
		f.deliver(g, entries)
		mark(last, from, true)
		select {
		case <-wake:
		case <-f.stop:
			return true
		case <-time.After(ringCheck):
			if f.ringOf(g) != r || !f.current(g) {
				return true // the replica is gone or stale: go on elsewhere
			}
		}
	}
}

// ringCheck is how often a follower on its own replica's ring, with no
// change coming, checks that the replica is still current. A replica
// removed from its group stays open a few seconds (until its removal is
// confirmed), and one cut off applies nothing: on either, a follower that
// stayed on its ring delayed notifications by seconds (found by review:
// 2–11 s), or lost them once the group wrote more than the other rings
// keep meanwhile.
const ringCheck = 250 * time.Millisecond

// current reports whether this node's replica of g keeps up with the group:
// it leads (whatever the placement says: a group waiting to move is still
// led from here, and this node's clients hear of its changes from here;
// found by review), or the group is still placed here and the replica is
// in its configuration and hears a leader.
func (f *follower) current(g int) bool {
	n := f.n
	r := n.local(g)
	if r == nil {
		return false
	}
	if _, leads := r.Leader(); leads {
		return true
	}
	st := n.state.Load()
	if st == nil {
		return false
	}
	t := st.Placement()
	return g < len(t) && slices.Contains(t[g], n.cfg.NodeID) && r.Current(2*time.Second)
}

// leads reports whether this node's replica of g leads the group.
func (f *follower) leads(g int) bool {
	if r := f.n.local(g); r != nil {
		_, leads := r.Leader()
		return leads
	}
	return false
}

// fromPeers follows g from another replica's ring over the link, until the
// stream breaks or this node's own replica can take over. behind counts
// the rounds in a row in which no member could serve the cursor.
func (f *follower) fromPeers(g int, cursor *uint64, mark func(uint64, *hlc.Timestamp, bool), behind *int) {
	n := f.n
	var candidates []string
	if l := n.leaderOf(g); l != "" && l != n.cfg.NodeID {
		candidates = append(candidates, l)
	}
	if st := n.state.Load(); st != nil {
		if t := st.Placement(); g < len(t) {
			for _, id := range t[g] {
				if id != n.cfg.NodeID {
					candidates = append(candidates, id)
				}
			}
		}
	}
	var resume uint64 // the earliest position a member that no longer holds the cursor can serve
	truncated := 0
	var sentOn []string // members that sent this node to the leader (see serve)
	for i := 0; i < len(candidates); i++ {
		id := candidates[i]
		got, from, leader := f.stream(g, id, cursor, mark, false)
		if got {
			*behind = 0
			return
		}
		if leader != "" {
			sentOn = append(sentOn, id)
			n.hint(g, leader)
			// The leader next, unless it was asked already.
			if j := slices.Index(candidates, leader); j > i+1 {
				candidates = slices.Insert(slices.Delete(candidates, j, j+1), i+1, leader)
			} else if j < 0 {
				candidates = slices.Insert(candidates, i+1, leader)
			}
			continue
		}
		if from > 0 {
			truncated++
			if resume == 0 || from < resume {
				resume = from
			}
		}
	}
	// The leader they named did not serve this node: start from one of
	// theirs after all (what this node's callers are told may then
	// include a few changes from before, rather than nothing at all).
	for _, id := range sentOn {
		if got, _, _ := f.stream(g, id, cursor, mark, true); got {
			*behind = 0
			return
		}
	}
	if resume <= *cursor {
		*behind = 0
		return
	}
	// No member that answered holds the changes after the cursor any
	// more. Once every member said so (or, if some do not answer, after a
	// few rounds), this node lost them: it goes on from the earliest
	// position one can serve, rather than asking for them for ever, and
	// says so (see gap).
	if *behind++; truncated < len(candidates) && *behind < behindRounds {
		return
	}
	*behind = 0
	f.n.log.Warn("change events lost: this node fell behind the group's event rings; notifications between are not delivered here", "group", g, "from", *cursor, "to", resume)
	f.gap(g)
	mark(resume, nil, true) // (positioned before: a cursor to lose)
}

// behindRounds is how many rounds a follower that some members do not
// answer waits for them before it takes its changes for lost.
const behindRounds = 5

// gap notes that group g's changes after the cursor were lost to this
// node. OnEventsGap hears of it now, and again with the version of the
// first change delivered after it.
func (f *follower) gap(g int) {
	f.mu.Lock()
	already := f.gapped[g]
	if !already {
		f.gapped[g] = true
		f.gaps.Add(1)
	}
	f.mu.Unlock()
	if !already && f.n.cfg.OnEventsGap != nil {
		f.n.cfg.OnEventsGap(hlc.Timestamp{})
	}
}

// stream follows g from member id; it reports whether it got anywhere,
// if the member no longer holds the cursor, from where it could go on, and
// if the member sent this node to the group's leader instead, who that is.
// any asks the member to serve a start all the same (see serve).
func (f *follower) stream(g int, id string, cursor *uint64, mark func(uint64, *hlc.Timestamp, bool), any bool) (got bool, resume uint64, leader string) {
	n := f.n
	addr := n.addrOf(id)
	if addr == "" {
		return false, 0, ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	s, err := n.link.Open(ctx, addr, peer.KindCall, nil)
	cancel()
	if err != nil {
		return false, 0, ""
	}
	c := peer.NewConn(s)
	defer c.Close()
	done := make(chan struct{})
	defer close(done)
	go func() { // unblock the read when the node stops
		select {
		case <-f.stop:
			// Closing a yamux stream only half-closes it: the read
			// waits on, so end it by its deadline.
			c.SetReadDeadline(time.Now())
			c.Close()
		case <-done:
		}
	}()
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	// Starting out, from the beginning of the member's ring: the
	// node's change history then reaches back as far as it can.
	if c.Send(callReq{Op: opEvents, Group: g, Since: *cursor, FromStart: *cursor == 0, AnyReplica: any}) != nil {
		return false, 0, ""
	}
	starting := *cursor == 0
	// When this node's replica may take over: at once after a starting
	// catch-up (a new cluster's every member starts so, and a stream per
	// group and member for 10 s more was load enough to make elections
	// in CI), else after 10 s, so that a replica that lags is not
	// switched to and from.
	switchAt := time.Now().Add(10 * time.Second)
	if starting {
		switchAt = time.Now()
	}
	for {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		var resp callResp
		if err := c.Receive(&resp); err != nil {
			return got, 0, ""
		}
		switch {
		case resp.Kind == errNone:
		case resp.Kind == errOther && resp.Err == errEventsTruncated:
			return got, resp.Last, ""
		case resp.Kind == errNotLeader && !got && resp.Leader != id && resp.Leader != n.cfg.NodeID:
			return false, 0, resp.Leader
		default:
			return got, 0, ""
		}
		select {
		case <-f.stop:
			return got, 0, ""
		default:
		}
		got = true
		f.deliver(g, resp.Events)
		if !resp.MaxVersion.IsZero() {
			n.clock.Observe(resp.MaxVersion) // before the position is marked (see serve)
		}
		var from *hlc.Timestamp
		if starting { // the first frame
			floor := resp.Floor
			if !resp.HasFloor { // from now (a release before Floor)
				floor = resp.MaxVersion
			}
			from, starting = &floor, false
		}
		mark(resp.Last, from, !resp.More)
		if r := f.ringOf(g); r != nil && !resp.More && time.Now().After(switchAt) && f.current(g) {
			if _, _, _, ok := r.since(*cursor); ok {
				return true, 0, "" // this node's replica has caught up: use it
			}
			switchAt = time.Now().Add(10 * time.Second)
		}
	}
}

func (f *follower) deliver(g int, entries []entryEvents) {
	for _, e := range entries {
		if len(e.Events) == 0 {
			continue
		}
		if f.gaps.Load() > 0 && f.endGap(g) && f.n.cfg.OnEventsGap != nil {
			// Every change lost has a lower version: versions grow
			// along a group's log.
			f.n.cfg.OnEventsGap(e.Events[0].Version)
		}
		if f.n.cfg.OnEvents != nil {
			f.n.cfg.OnEvents(e.Events)
		}
	}
}

// endGap reports whether g's changes were lost (see gap), and forgets it.
func (f *follower) endGap(g int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.gapped[g] {
		return false
	}
	delete(f.gapped, g)
	f.gaps.Add(-1)
	return true
}

// serve streams this node's ring of g to a follower on another node.
func (f *follower) serve(c *peer.Conn, req callReq) {
	g, since, fromStart := req.Group, req.Since, req.FromStart
	r := f.ringOf(g)
	if r == nil {
		c.Send(callResp{Kind: errNotLeader})
		return
	}
	// A follower that starts out takes its position where this stream
	// begins: changes acknowledged before it asked must all be in the
	// catch-up, or its callers' registrations, made once it has caught
	// up, would hear of them as new. Only the leader's ring is sure to
	// hold them (a write is acknowledged once the leader applied it, and
	// a new leader once it applied its predecessors' writes): another
	// replica sends the follower to the leader it hears, unless the
	// follower could not reach it. (A CI run caught a follower's ring two
	// writes behind.)
	if since == 0 && !req.AnyReplica {
		if rep := f.n.local(g); rep != nil {
			switch leader, leads := rep.Leader(); {
			case leads:
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				rep.LeaderReady(ctx) // if not, the follower's next position covers the rest
				cancel()
			case leader != "" && leader != f.n.cfg.NodeID:
				c.Send(callResp{Kind: errNotLeader, Leader: leader})
				return
			}
		}
	}
	// A follower that starts out (from now, or from the ring's start)
	// also learns the greatest version applied before (read after the
	// position, so it covers it), for its clock, and its floor (see
	// floors): it has no replica of g whose applies would have shown
	// them, and its history must begin above every change it did not get,
	// or a SINCE from between would be answered without them.
	starting, fromFloor := since == 0, false
	first := starting // the first frame of a stream that starts out
	var top, floor hlc.Timestamp
	if starting {
		since = r.position()
		if start, v, known := r.start(); fromStart && known {
			since, floor, fromFloor = start, v, true
		}
	}
	for {
		entries, last, wake, ok := r.since(since)
		if !ok {
			c.Send(callResp{Kind: errOther, Err: errEventsTruncated, Last: last})
			return
		}
		if starting {
			if rep := f.n.local(g); rep != nil {
				top = rep.MaxVersion()
			}
			if !fromFloor {
				floor = top // from now: every change not carried is at most it
			}
			starting = false
		}
		// In parts of a bounded size: a ring holds up to ringBytes, and
		// one message of it all could take longer than the write deadline
		// to encode and send under load, and then again on every retry
		// (a candidate for the silence a watch met in a CI run; not
		// shown). The follower takes a position only with the last part
		// (More): registrations made then must not get the older changes.
		for {
			part, upTo := entries, last
			if n := partEnd(entries); n < len(entries) {
				part, upTo = entries[:n], entries[n-1].Index
			}
			c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			more := len(part) < len(entries)
			if err := c.Send(callResp{Events: part, Last: upTo, MaxVersion: top, Floor: floor, HasFloor: first, More: more}); err != nil {
				return
			}
			top, floor, first = hlc.Timestamp{}, hlc.Timestamp{}, false
			if entries = entries[len(part):]; len(entries) == 0 {
				break
			}
		}
		since = last
		select {
		case <-wake:
		case <-f.stop:
			return
		case <-time.After(2 * time.Second): // a heartbeat frame tells a dead follower
		}
		if f.ringOf(g) != r {
			c.Send(callResp{Kind: errOther, Err: "replica moved"})
			return
		}
	}
}

// streamPart bounds the events' bytes in one message of a stream.
const streamPart = 256 << 10

// partEnd returns how many of entries go in one message: at least one,
// and no more than streamPart bytes of keys and values after the first.
func partEnd(entries []entryEvents) int {
	size := 0
	for i, e := range entries {
		for _, ev := range e.Events {
			size += len(ev.Key) + len(ev.Value)
		}
		if size > streamPart && i > 0 {
			return i
		}
	}
	return len(entries)
}

func (f *follower) close() {
	close(f.stop)
	f.wg.Wait()
}

// Delivered waits until the change events of every entry applied so far
// have reached OnEvents, or ctx ends: a node on its own's, which it
// delivers through its queue (see eventQueue). A graceful stop waits for
// it once every write is answered and before the broker closes, so that
// no observer misses the notification of a write acknowledged before the
// stop, as none did when they went out on the apply goroutine. A cluster
// node's clients hear of changes from its followers, which are not
// waited for.
func (n *Node) Delivered(ctx context.Context) error {
	if q := n.events.alone; q != nil {
		return q.flush(ctx)
	}
	return nil
}

// closeAlone delivers what a node on its own's queue still holds and
// ends it, once its group applies nothing more.
func (f *follower) closeAlone() {
	if f.alone != nil {
		f.alone.close()
	}
}

// eventQueue carries a node on its own's change events from its group's
// apply goroutine to OnEvents, which runs on the queue's goroutine, in
// order. Bounded in bytes: an apply that finds it full waits for room, so
// a slow OnEvents slows the writes down, as it did when it ran on the
// apply goroutine, rather than losing changes or holding ever more.
//
// Why a queue: OnEvents (the change history of KEYNOTIFY ... SINCE,
// notifications, the retained messages' mirror) was half of the apply
// goroutine's work, and the group's next log entry waits for that
// goroutine: durable SETs, 16 pipelined from each of 50 clients, +16-22 %
// with the queue at two Ps (docs/benchmarks.md, 2026-11-30). A cluster
// node's events already leave the apply goroutine at once (see ring), so
// a client may be told of a change it made just before registering, as
// there.
type eventQueue struct {
	mu      sync.Mutex
	ready   sync.Cond // batches came, or the queue closed
	room    sync.Cond // batches were delivered
	batches []queuedEvents
	// free are slices of batches delivered, cleared, for push to copy
	// the next batches into (at most maxFree). Why: a pipelined load's
	// batch is hundreds of events, a new slice of them each entry was a
	// twentieth of everything a durable SET allocated.
	free   [][]store.Event
	bytes  int // of the batches held and the ones being delivered
	limit  int
	closed bool
	done   chan struct{}
	// pushed and delivered count batches, for flush.
	pushed, delivered uint64
}

// queuedEvents is a batch in the queue, with its size (eventsSize).
type queuedEvents struct {
	evs  []store.Event
	size int
}

// eventQueueBytes bounds the queue, as ringBytes bounds a ring.
const eventQueueBytes = 8 << 20

// maxFree bounds eventQueue.free, and maxFreeCap the slices it keeps:
// a batch of many more (a restore's) is not held on to.
const (
	maxFree    = 4
	maxFreeCap = 4096
)

func newEventQueue(limit int) *eventQueue {
	q := &eventQueue{limit: limit, done: make(chan struct{})}
	q.ready.L, q.room.L = &q.mu, &q.mu
	return q
}

// eventsSize is what a batch of events holds alive: its keys and values,
// and the events themselves.
func eventsSize(evs []store.Event) int {
	n := 0
	for i := range evs {
		n += len(evs[i].Key) + len(evs[i].Value) + int(unsafe.Sizeof(evs[i]))
	}
	return n
}

// push queues a copy of evs (the apply goroutine reuses its slice),
// waiting while the queue is full; one batch larger than the bound goes
// into an empty queue.
func (q *eventQueue) push(evs []store.Event) {
	size := eventsSize(evs)
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.bytes > 0 && q.bytes+size > q.limit && !q.closed {
		q.room.Wait()
	}
	if q.closed {
		return // nothing applies after close (see closeAlone)
	}
	q.batches = append(q.batches, queuedEvents{append(q.takeFree(len(evs)), evs...), size})
	q.bytes += size
	q.pushed++
	q.ready.Signal()
}

// flush waits until every batch pushed before it was called is
// delivered, or ctx ends.
func (q *eventQueue) flush(ctx context.Context) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	stop := context.AfterFunc(ctx, func() {
		q.mu.Lock()
		q.room.Broadcast()
		q.mu.Unlock()
	})
	defer stop()
	for target := q.pushed; q.delivered < target && !q.closed; {
		if err := ctx.Err(); err != nil {
			return err
		}
		q.room.Wait()
	}
	return nil
}

// run delivers the queued batches, oldest first, until the queue closes
// and is empty.
func (q *eventQueue) run(deliver func([]store.Event)) {
	defer close(q.done)
	var taken []queuedEvents
	for {
		q.mu.Lock()
		for len(q.batches) == 0 && !q.closed {
			q.ready.Wait()
		}
		if len(q.batches) == 0 {
			q.mu.Unlock()
			return
		}
		taken, q.batches = q.batches, taken[:0]
		q.mu.Unlock()
		size := 0
		for _, b := range taken {
			deliver(b.evs)
			size += b.size
			clear(b.evs) // hold no key or value past the batch
		}
		q.mu.Lock()
		for i, b := range taken {
			q.giveFree(b.evs)
			taken[i] = queuedEvents{}
		}
		q.bytes -= size
		q.delivered += uint64(len(taken))
		q.room.Broadcast()
		q.mu.Unlock()
	}
}

// takeFree returns the smallest empty slice of free with room for n
// events, if one has it (q.mu held): a single write's batch does not take
// the slice a pipeline's needs.
func (q *eventQueue) takeFree(n int) []store.Event {
	best := q.smallestFree(n)
	if best < 0 {
		return nil
	}
	evs, last := q.free[best], len(q.free)-1
	q.free[best], q.free[last] = q.free[last], nil
	q.free = q.free[:last]
	return evs
}

// giveFree keeps evs, delivered and cleared, for takeFree: in place of
// the smallest kept when free is full, so that a mix of small batches
// (single writes) and large ones (a pipeline's) keeps room for the large
// (q.mu held).
func (q *eventQueue) giveFree(evs []store.Event) {
	if cap(evs) == 0 || cap(evs) > maxFreeCap {
		return
	}
	if len(q.free) < maxFree {
		q.free = append(q.free, evs[:0])
		return
	}
	if small := q.smallestFree(0); cap(q.free[small]) < cap(evs) {
		q.free[small] = evs[:0]
	}
}

// smallestFree returns the place in free of the smallest slice with room
// for n events, or -1 if none has it (q.mu held).
func (q *eventQueue) smallestFree(n int) int {
	best := -1
	for i, evs := range q.free {
		if cap(evs) >= n && (best < 0 || cap(evs) < cap(q.free[best])) {
			best = i
		}
	}
	return best
}

// close ends the queue once what it holds is delivered.
func (q *eventQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.ready.Signal()
	q.room.Broadcast()
	q.mu.Unlock()
	<-q.done
}
