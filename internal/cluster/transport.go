package cluster

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/replica"
)

// transport builds the raft transport of group g over the link.
func (n *Node) transport(g uint32) *groupTransport {
	u := newGroupTransport(g, raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream:  n.link.StreamLayer(g),
		MaxPool: 3,
		Timeout: appendTimeout,
		Logger:  replica.RaftLogger("raft-net", n.log),
	}))
	u.binary = func() bool { return n.Protocol() >= protocolBinaryAppends }
	u.send = n.appendTo
	u.forget = func() { n.transports.CompareAndDelete(g, u) }
	return u
}

// appendTimeout bounds an AppendEntries, as raft's network transport
// bounds each of its reads and writes.
const appendTimeout = 10 * time.Second

// appendTo sends group g's AppendEntries to the member at addr, with the
// other groups' that go there at the same time (see appender).
func (n *Node) appendTo(addr string, g uint32, req *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	a, ok := n.appenders.Load(addr)
	if !ok {
		a, _ = n.appenders.LoadOrStore(addr, &appender{addr: addr, call: n.link.CallBytes})
	}
	return a.(*appender).append(g, req, resp)
}

// serveAppends answers a binAppends from another node: it hands each
// request to its group's raft, all at once, and returns their answers.
func (n *Node) serveAppends(body []byte) []byte {
	reqs, err := decodeAppends(body)
	if err != nil {
		return appendAppendReplies(nil, nil) // none: the sender fails them all
	}
	replies := make([]appendAnswer, len(reqs))
	if len(reqs) == 1 {
		replies[0] = n.serveAppend(reqs[0])
	} else {
		var wg sync.WaitGroup
		for i, r := range reqs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				replies[i] = n.serveAppend(r)
			}()
		}
		wg.Wait()
	}
	return appendAppendReplies(make([]byte, 0, 16+32*len(replies)), replies)
}

func (n *Node) serveAppend(r groupAppend) appendAnswer {
	u, ok := n.transports.Load(r.g)
	if !ok {
		return appendAnswer{fault: fmt.Sprintf("cluster: no replica of group %d here", r.g)}
	}
	return u.(*groupTransport).serve(r.req)
}

// serving has binary AppendEntries for group g delivered to u, once u's
// raft runs: not before (a replica opened twice at once keeps the first).
func (n *Node) serving(g uint32, u *groupTransport) { n.transports.Store(g, u) }

// appender sends the AppendEntries of every group this node leads to one
// member. Those that come while appendsInFlight messages are on their way
// there wait, and go together in the next (up to appendBatch bytes), as a
// journal's writes wait for its fsync: under load each message carries
// many groups' entries, and a round trip (on two cores, some 50 µs of CPU
// between the two nodes, wakeups and system calls mostly) is paid once for
// them. A heartbeat goes at once, alone: one that waited behind a batch
// would wait on the follower's disk, and heartbeats keep the followers
// from standing for election and the leader's read lease alive.
type appender struct {
	addr string
	call func(ctx context.Context, addr string, body []byte) ([]byte, error)

	mu      sync.Mutex
	queue   []*pendingAppend // waiting for a message
	sending int              // messages on their way

	messages, carried atomic.Int64 // messages sent, AppendEntries in them
}

// appendsInFlight is how many messages an appender has on their way at
// once. One gathered more per message and cost less CPU in
// BenchmarkAppendEntries (4 AppendEntries a message against 2, about 25 µs
// each against 33), but a message is answered once every group in it has
// answered, and a group whose follower is slow to (busy, or catching up)
// would then hold every group's replication to that member up; with two,
// the others go on in the second.
const appendsInFlight = 2

// appendBatch bounds a message's size (one AppendEntries alone may be
// larger: raft bounds it by MaxAppendEntries).
const appendBatch = 1 << 20

// pendingAppend is one group's AppendEntries waiting for its answer.
type pendingAppend struct {
	groupAppend
	size int // appendSize's bound
	resp *raft.AppendEntriesResponse
	err  error
	// turn, for one that waits, brings a batch for it to send (it and
	// others waiting), or nil once it is answered.
	turn chan []*pendingAppend
}

func (a *appender) append(g uint32, req *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	p := &pendingAppend{groupAppend: groupAppend{g, req}, size: appendSize(req), resp: resp}
	if isHeartbeat(req) {
		a.send([]*pendingAppend{p})
		return p.err
	}
	a.mu.Lock()
	a.queue = append(a.queue, p)
	if a.sending >= appendsInFlight {
		p.turn = make(chan []*pendingAppend, 1)
		a.mu.Unlock()
		if batch := <-p.turn; batch != nil {
			a.drive(p, batch)
		}
		return p.err
	}
	a.sending++
	batch := a.takeLocked()
	a.mu.Unlock()
	a.drive(p, batch)
	return p.err
}

// takeLocked takes the next message's worth of the queue.
func (a *appender) takeLocked() []*pendingAppend {
	n, size := 0, 0
	for n < len(a.queue) && (n == 0 || size+a.queue[n].size <= appendBatch) {
		size += a.queue[n].size
		n++
	}
	batch := slices.Clone(a.queue[:n])
	a.queue = slices.Delete(a.queue, 0, n)
	return batch
}

// drive sends batch (self's among them), answers those waiting in it, and
// has the first of those still waiting send the next batch, if any.
func (a *appender) drive(self *pendingAppend, batch []*pendingAppend) {
	a.send(batch)
	a.mu.Lock()
	var next []*pendingAppend
	if len(a.queue) > 0 {
		next = a.takeLocked() // every one waits (has a turn)
	} else {
		a.sending--
	}
	a.mu.Unlock()
	for _, q := range batch {
		if q != self {
			q.turn <- nil
		}
	}
	if next != nil {
		next[0].turn <- next
	}
}

// send sends batch in one message and gives each its answer.
func (a *appender) send(batch []*pendingAppend) {
	a.messages.Add(1)
	a.carried.Add(int64(len(batch)))
	reqs := make([]groupAppend, len(batch))
	size := 16
	for i, p := range batch {
		reqs[i] = p.groupAppend
		size += p.size
	}
	ctx, cancel := context.WithTimeout(context.Background(), appendTimeout)
	defer cancel()
	body, err := a.call(ctx, a.addr, appendAppends(make([]byte, 0, size), reqs))
	var replies []appendAnswer
	if err == nil {
		if replies, err = decodeAppendReplies(body); err == nil && len(replies) != len(batch) {
			err = fmt.Errorf("cluster: %d answers to %d AppendEntries", len(replies), len(batch))
		}
	}
	for i, p := range batch {
		switch {
		case err != nil:
			p.err = err
		case replies[i].fault != "":
			p.err = errors.New(replies[i].fault)
		default:
			*p.resp = *replies[i].resp
		}
	}
}

// groupTransport is a group's raft transport: raft's network transport
// over the group's streams on the link, changed in four ways.
//
// Its AppendEntries go in a binary form on the link's call streams once
// the cluster runs at protocolBinaryAppends (see appendcodec.go); raft's
// other messages stay on the group's streams, in msgpack.
//
// Replication is not pipelined. hashicorp/raft v1.7.3's pipeline
// deadlocks when a follower answers an AppendEntries with Success=false (a
// log mismatch after a leader change, for one): the decoder stops, the
// sender parks on a channel nobody reads, the follower gets no entry again
// while heartbeats keep it from calling an election, and the leader's
// Shutdown waits forever (seen in CI; also grafana/pyroscope#5518, which
// disables it for the same reason). Raft falls back to one AppendEntries
// at a time per follower, each carrying every entry not yet sent (up to
// MaxAppendEntries).
//
// It fences raft's heartbeat fast path. Raft runs a heartbeat on the
// transport's goroutine, not its own: Shutdown neither stops nor waits for
// one, and a heartbeat that passed raft's shutdown check can still save a
// new term or read the log after the node has closed its journal; raft
// then panics ("failed to save current term: journal: closed", in CI).
// Close waits for the heartbeats in flight and turns later ones away, so
// no raft code runs on a group once it is closed.
//
// And it notes when each follower accepted an AppendEntries (heartbeats
// included) and in which term, for the leader's read lease (see
// replica.ReadLease).
type groupTransport struct {
	*raft.NetworkTransport
	group uint32

	// binary reports whether AppendEntries go in their binary form; send
	// sends one to the member at an address; forget unregisters the
	// transport from its node (nil: none of these, as in tests).
	binary func() bool
	send   func(addr string, g uint32, req *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error
	forget func()

	// consumer carries raft the requests of both ways in: the network
	// transport's and the binary AppendEntries.
	consumer chan raft.RPC
	done     chan struct{} // closed by Close
	served   atomic.Uint64 // binary AppendEntries answered

	mu        sync.Mutex
	shut      bool
	inFlight  sync.WaitGroup
	heartbeat func(raft.RPC) // raft's heartbeat handler, nil if none

	acksMu sync.Mutex
	acks   map[string]ack // follower id → its last accepted AppendEntries
	// handedOver is the greatest term acknowledged when this leader sent
	// a TimeoutNow (a leadership transfer): no lease in it or before.
	handedOver uint64
}

func newGroupTransport(g uint32, nt *raft.NetworkTransport) *groupTransport {
	u := &groupTransport{NetworkTransport: nt, group: g, consumer: make(chan raft.RPC), done: make(chan struct{}), acks: map[string]ack{}}
	go func() {
		in := nt.Consumer()
		for {
			select {
			case rpc := <-in:
				select {
				case u.consumer <- rpc:
				case <-u.done:
					return
				}
			case <-u.done:
				return
			}
		}
	}()
	return u
}

// Consumer implements raft.Transport.
func (u *groupTransport) Consumer() <-chan raft.RPC { return u.consumer }

// acks is what a group's reads take their lease from: nil with
// QuorumReads.
func (n *Node) acks(tr *groupTransport) replica.Acks {
	if n.cfg.QuorumReads {
		return nil
	}
	return tr
}

// ack is when (on replica.LeaseClock) an AppendEntries of term that a
// follower accepted was sent.
type ack struct {
	term uint64
	sent time.Duration
}

func (u *groupTransport) AppendEntries(id raft.ServerID, target raft.ServerAddress, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	sent := replica.LeaseClock()
	var err error
	if u.binary != nil && u.binary() {
		err = u.send(string(target), u.group, args, resp)
	} else {
		err = u.NetworkTransport.AppendEntries(id, target, args, resp)
	}
	if err == nil && resp.Success && resp.Term == args.Term {
		u.acksMu.Lock()
		if args.Term <= u.handedOver {
			u.acksMu.Unlock()
			return err
		}
		if a, ok := u.acks[string(id)]; !ok || args.Term > a.term || args.Term == a.term && sent > a.sent {
			u.acks[string(id)] = ack{args.Term, sent}
		}
		u.acksMu.Unlock()
	}
	return err
}

// serve hands a binary AppendEntries to raft (its heartbeat handler, as
// raft's network transport does, for a heartbeat) and returns its answer.
func (u *groupTransport) serve(req *raft.AppendEntriesRequest) appendAnswer {
	shut := appendAnswer{fault: raft.ErrTransportShutdown.Error()}
	u.mu.Lock()
	if u.shut {
		u.mu.Unlock()
		return shut
	}
	u.inFlight.Add(1)
	heartbeat := u.heartbeat
	u.mu.Unlock()
	defer u.inFlight.Done()
	u.served.Add(1)
	respCh := make(chan raft.RPCResponse, 1)
	rpc := raft.RPC{Command: req, RespChan: respCh}
	if heartbeat != nil && isHeartbeat(req) {
		heartbeat(rpc)
	} else {
		select {
		case u.consumer <- rpc:
		case <-u.done:
			return shut
		}
	}
	select {
	case r := <-respCh:
		var a appendAnswer
		if r.Error != nil {
			a.fault = r.Error.Error()
		}
		a.resp, _ = r.Response.(*raft.AppendEntriesResponse)
		return a
	case <-u.done:
		return shut
	}
}

// isHeartbeat tells a heartbeat as raft's network transport does.
func isHeartbeat(req *raft.AppendEntriesRequest) bool {
	leader := req.Addr
	if len(leader) == 0 {
		leader = req.Leader
	}
	return req.Term != 0 && leader != nil && req.PrevLogEntry == 0 && req.PrevLogTerm == 0 &&
		len(req.Entries) == 0 && req.LeaderCommitIndex == 0
}

// TimeoutNow, a leadership transfer's last step, makes its target stand
// at once, with the other voters' votes though they know this leader:
// the lease ends here, whoever asked for the transfer (replica's
// TransferLeadership ends it too, earlier).
func (u *groupTransport) TimeoutNow(id raft.ServerID, target raft.ServerAddress, args *raft.TimeoutNowRequest, resp *raft.TimeoutNowResponse) error {
	u.acksMu.Lock()
	for _, a := range u.acks {
		u.handedOver = max(u.handedOver, a.term)
	}
	clear(u.acks)
	u.acksMu.Unlock()
	return u.NetworkTransport.TimeoutNow(id, target, args, resp)
}

// AckedAt implements replica.Acks.
func (u *groupTransport) AckedAt(id string, term uint64) time.Duration {
	u.acksMu.Lock()
	defer u.acksMu.Unlock()
	if a := u.acks[id]; a.term == term {
		return a.sent
	}
	return 0
}

func (*groupTransport) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

func (u *groupTransport) SetHeartbeatHandler(cb func(raft.RPC)) {
	u.mu.Lock()
	u.heartbeat = cb
	u.mu.Unlock()
	if cb == nil {
		u.NetworkTransport.SetHeartbeatHandler(nil)
		return
	}
	u.NetworkTransport.SetHeartbeatHandler(func(rpc raft.RPC) {
		u.mu.Lock()
		if u.shut {
			u.mu.Unlock()
			rpc.Respond(nil, raft.ErrTransportShutdown)
			return
		}
		u.inFlight.Add(1)
		u.mu.Unlock()
		defer u.inFlight.Done()
		cb(rpc)
	})
}

func (u *groupTransport) Close() error {
	u.mu.Lock()
	if !u.shut {
		u.shut = true
		close(u.done)
		if u.forget != nil {
			u.forget()
		}
	}
	u.mu.Unlock()
	u.inFlight.Wait()
	return u.NetworkTransport.Close()
}
