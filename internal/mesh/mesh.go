// Package mesh carries MQTT between the nodes of a cluster: every node
// tells every other which topic filters its clients subscribe to (its
// interest), and a message published on a node crosses once to each node
// whose interest matches its topic; that node delivers it to its own
// subscribers and never forwards it again (one hop, as NATS routes do).
//
// Each node keeps one stream of the node link to each other member
// (KindMesh), opened by the sender: on it go, in order, the sender's
// interest (all of it when the stream opens, then each change) and its
// messages; back come acknowledgements, cumulative by sequence number,
// once the receiver has applied an interest change or delivered a message
// into its subscribers' sessions. A message that asks for an
// acknowledgement (QoS 1 and 2) is kept until it has one, and sent again
// on the next stream if the stream breaks; the receiver drops what it has
// seen (by the sender's process and sequence). A node's interest stays in
// the others' tables while it is a member, across a broken stream, and is
// replaced when its next stream opens; it goes with its membership.
//
// Concurrency: a Mesh is safe for use by many goroutines. Delivery (the
// Deliver handler) runs on the receiving stream's goroutine, one message
// at a time per sending node, in the order sent.
package mesh

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/route"
)

// Message is an MQTT application message as it crosses to another node.
// Wire format (msgpack by field name): fields may be added, never renamed.
type Message struct {
	Topic   string
	Payload []byte
	QoS     byte
	Retain  bool
	// Origin is the publishing client's id (No Local is by client id,
	// cluster-wide).
	Origin string
	// Expiry is what is left of the Message Expiry Interval when the
	// message left, in seconds; 0: none.
	Expiry        uint32
	PayloadFormat byte
	FormatSet     bool // PayloadFormat was given
	ContentType   string
	ResponseTopic string
	Correlation   []byte
	User          [][2]string // in order, repeated keys kept
}

// Delivery is a message a node is asked to deliver: to its ordinary
// subscribers (Plain), and to one member each of the shared subscription
// groups Groups (by full filter) that the sending node picked it for.
type Delivery struct {
	Msg    Message
	Plain  bool
	Groups []string
	// For, if set, names a member that died before it acknowledged the
	// message: it is for the sessions another node took up from it,
	// at or after Since (unix nanoseconds), only (see Config.GivenUp).
	For   string
	Since int64
	// Sent is when the message was first sent (unix nanoseconds), for
	// GivenUp; not sent.
	Sent int64 `codec:"-"`
}

// Config is what a Mesh needs.
type Config struct {
	Link *peer.Link
	Self string // this node's id
	// Members returns the other members, id → node link address.
	Members func() map[string]string
	// Alive, if set, reports whether a member answers: messages for one
	// that does not are given up (their senders told) after GiveUp.
	Alive func(id string) bool
	// Deliver delivers a message from node from to this node's
	// subscribers, into their sessions, and calls done once it has: at
	// once, or later (a session kept in the replicated store is written
	// first). The message is acknowledged to its sender after done, in
	// order with the messages before it.
	Deliver func(from string, d *Delivery, done func())
	// GivenUp, if set, is handed each QoS 1 or 2 message given up for a
	// member that does not answer, with its done (which it must call):
	// the sessions that member held may be going on elsewhere by then.
	GivenUp func(node string, d *Delivery, done func())
	// Handle answers a request of another node (see Request); nil
	// answers none.
	Handle func(from string, body []byte) []byte
	Logger *slog.Logger
}

// Timing of a Mesh, variables for tests.
var (
	// Propagate bounds how long a subscription waits for the other nodes
	// to know it (see Subscribed).
	Propagate = 2 * time.Second
	// GiveUp is how long messages for a member that does not answer are
	// kept before their senders are told they could not be delivered.
	GiveUp = 5 * time.Second
	// retryEvery is how often a broken stream is opened again.
	retryEvery = 200 * time.Millisecond
)

// maxQueued bounds what waits for one node (queued and unacknowledged);
// past it, the oldest messages are dropped (their senders told).
const maxQueued = 100_000

// Mesh is this node's end.
type Mesh struct {
	cfg   Config
	log   *slog.Logger
	epoch string // this process: a receiver tells a restarted sender apart

	mu       sync.Mutex
	local    map[string]struct{} // filters with subscribers here
	table    *route.Table        // the other nodes' interest
	senders  map[string]*sender  // by member id
	seen     map[string]seenFrom // receiving: what each sending process delivered
	wantGen  uint64
	wantMemo map[string]route.Want // lookups at table generation wantGen
	// gone are the members given up (not answering for GiveUp): their
	// interest is left out of Want until they answer again.
	gone    map[string]bool
	goneGen uint64 // changes with gone; part of wantGen

	Counters Counters
	stop     chan struct{}
	wg       sync.WaitGroup
}

// Counters are the mesh's figures for metrics.
type Counters struct {
	Sent, Received   atomic.Int64 // messages to and from other nodes
	Resent           atomic.Int64 // messages sent again on a new stream
	Dropped          atomic.Int64 // messages given up (a node gone, or too much waiting)
	Resyncs          atomic.Int64 // streams opened with a full interest
	InterestReceived atomic.Int64 // interest changes heard
	// Hops and HopMicros count the QoS 1 and 2 messages acknowledged by
	// the nodes they went to, and the time that took in all: the hop's
	// latency, delivery into the subscribers' sessions included.
	Hops, HopMicros atomic.Int64
}

type seenFrom struct {
	epoch string
	last  uint64
	open  *arrivals
}

func noop() {}

// arrivals are the messages of one sending process delivered but not yet
// done (see Config.Deliver), across its streams: a resent message seen
// already is acknowledged only once its first delivery is done.
type arrivals struct {
	mu   sync.Mutex
	seqs []uint64      // not done, in order
	kick chan struct{} // the current stream's: something is done
}

func (a *arrivals) start(seq uint64) {
	a.mu.Lock()
	a.seqs = append(a.seqs, seq)
	a.mu.Unlock()
}

// finish says the delivery of seq is done; late says it was done after
// Deliver returned, when the reader may be waiting for the next frame
// and the acknowledgement is the writer's to send.
func (a *arrivals) finish(seq uint64, late bool) {
	a.mu.Lock()
	if i, ok := slices.BinarySearch(a.seqs, seq); ok {
		a.seqs = slices.Delete(a.seqs, i, i+1)
	}
	kick := a.kick
	a.mu.Unlock()
	if !late {
		return // the reader acknowledges it with its burst
	}
	select {
	case kick <- struct{}{}:
	default:
	}
}

// ackable is what may be acknowledged of what was seen up to last.
func (a *arrivals) ackable(last uint64) uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.seqs) > 0 {
		return min(last, a.seqs[0]-1)
	}
	return last
}

// New starts a mesh on the link.
func New(cfg Config) *Mesh {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	var b [8]byte
	rand.Read(b[:])
	m := &Mesh{cfg: cfg, log: cfg.Logger, epoch: hex.EncodeToString(b[:]), local: map[string]struct{}{},
		table: route.NewTable(), senders: map[string]*sender{}, seen: map[string]seenFrom{}, stop: make(chan struct{})}
	cfg.Link.HandleKind(peer.KindMesh, m.serve)
	m.wg.Add(1)
	go m.watchMembers()
	return m
}

// Close stops the mesh: its streams end.
func (m *Mesh) Close() {
	select {
	case <-m.stop:
		return
	default:
	}
	close(m.stop)
	m.mu.Lock()
	for _, s := range m.senders {
		s.close()
	}
	m.mu.Unlock()
	m.wg.Wait()
}

// Subscribed records that filter has subscribers on this node now (on) or
// no longer. Once on, it returns when every other member that is
// connected knows, or after Propagate: a SUBACK sent after it means the
// subscription is routable from every node that can reach this one.
func (m *Mesh) Subscribed(filter string, on bool) {
	m.mu.Lock()
	if _, had := m.local[filter]; had == on {
		m.mu.Unlock()
		return
	}
	if on {
		m.local[filter] = struct{}{}
	} else {
		delete(m.local, filter)
	}
	var wg sync.WaitGroup
	for _, s := range m.senders {
		done := func() {}
		if on {
			wg.Add(1)
			done = wg.Done
		}
		s.push(item{f: frame{Kind: kindInterest, Filter: filter, On: on}, done: done, ack: true})
	}
	m.mu.Unlock()
	if !on {
		return
	}
	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(Propagate):
		m.log.Debug("a subscription is not known to every node yet", "filter", filter)
	case <-m.stop:
	}
}

// Want returns the other nodes' interest in topic.
func (m *Mesh) Want(topic string) route.Want {
	m.mu.Lock()
	defer m.mu.Unlock()
	if g := m.table.Gen() + m.goneGen; g != m.wantGen || m.wantMemo == nil || len(m.wantMemo) > 1<<16 {
		m.wantGen, m.wantMemo = g, map[string]route.Want{}
	}
	w, ok := m.wantMemo[topic]
	if !ok {
		w = m.table.Match(topic)
		if len(m.gone) > 0 {
			w = withoutGone(w, m.gone)
		}
		m.wantMemo[topic] = w
	}
	return w
}

// withoutGone is w without the members in gone.
func withoutGone(w route.Want, gone map[string]bool) route.Want {
	keep := func(nodes []string) []string {
		return slices.DeleteFunc(slices.Clone(nodes), func(n string) bool { return gone[n] })
	}
	out := route.Want{Plain: keep(w.Plain)}
	for g, nodes := range w.Shared {
		if k := keep(nodes); len(k) > 0 {
			if out.Shared == nil {
				out.Shared = map[string][]string{}
			}
			out.Shared[g] = k
		}
	}
	return out
}

// setGone records whether a member is given up.
func (m *Mesh) setGone(id string, gone bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.gone[id] == gone {
		return
	}
	if m.gone == nil {
		m.gone = map[string]bool{}
	}
	if gone {
		m.gone[id] = true
	} else {
		delete(m.gone, id)
	}
	m.goneGen += 1 << 40 // apart from the table's generations
}

// Alive reports whether node answers (see Config.Alive).
func (m *Mesh) Alive(node string) bool { return m.cfg.Alive == nil || m.cfg.Alive(node) }

// Nodes returns the other members' ids.
func (m *Mesh) Nodes() []string {
	var ids []string
	for id := range m.cfg.Members() {
		if id != m.cfg.Self {
			ids = append(ids, id)
		}
	}
	return ids
}

// TableSize is the number of (node, filter) pairs of the other nodes'
// interest.
func (m *Mesh) TableSize() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.table.Size()
}

// Send queues d for node. done, if not nil, is called once node has
// delivered it, or it was given up (node gone, or too far behind): the
// message's QoS 1 or 2 exchange with its publisher may go on then. It
// never blocks.
func (m *Mesh) Send(node string, d *Delivery, done func()) {
	m.mu.Lock()
	s := m.senders[node]
	m.mu.Unlock()
	if s == nil {
		m.Counters.Dropped.Add(1)
		if done != nil {
			done()
		}
		return
	}
	m.Counters.Sent.Add(1)
	if done == nil {
		done = func() {}
	}
	s.push(item{f: frame{Kind: kindMessage, Delivery: d}, done: done, ack: d.Msg.QoS > 0, sent: time.Now()})
}

// Request sends body to node, whose Handle answers it: reply gets the
// answer, or ok false if the node cannot be reached or the stream broke
// before it answered (it may have handled it). It never blocks.
func (m *Mesh) Request(node string, body []byte, reply func(answer []byte, ok bool)) {
	m.mu.Lock()
	s := m.senders[node]
	m.mu.Unlock()
	if s == nil {
		reply(nil, false)
		return
	}
	s.push(item{f: frame{Kind: kindRequest, Body: body}, done: func() {}, reply: reply})
}

// watchMembers keeps a sender per member, and forgets the interest of
// nodes no longer members.
func (m *Mesh) watchMembers() {
	defer m.wg.Done()
	t := time.NewTicker(retryEvery)
	defer t.Stop()
	for {
		members := m.cfg.Members()
		m.mu.Lock()
		for id, addr := range members {
			if id == m.cfg.Self {
				continue
			}
			if s := m.senders[id]; s == nil || s.addr != addr {
				if s != nil {
					s.close()
				}
				s = newSender(m, id, addr)
				m.senders[id] = s
				m.wg.Add(1)
				go s.run()
			}
		}
		for id, s := range m.senders {
			if _, ok := members[id]; !ok {
				s.close()
				delete(m.senders, id)
				m.table.Drop(id)
				delete(m.seen, id)
			}
		}
		m.mu.Unlock()
		select {
		case <-m.stop:
			return
		case <-t.C:
		}
	}
}

// Frames on a KindMesh stream. Wire format (msgpack by field name).
const (
	kindHello     = 1 // Node, Epoch: the stream's sender; then kindInterests
	kindInterest  = 2 // Filter, On
	kindMessage   = 3 // Delivery
	kindAck       = 4 // Seq: everything up to it is done (receiver to sender)
	kindInterests = 5 // Filters: all of the sender's interest
	kindRequest   = 6 // Body: for the receiver's Handle
	kindReply     = 7 // Seq, Body: Handle's answer to the request Seq (receiver to sender)
)

type frame struct {
	Kind     uint8
	Seq      uint64
	Node     string
	Epoch    string
	Filter   string
	On       bool
	Filters  []string
	Delivery *Delivery
	Body     []byte
}

// serve receives a stream from another node: its interest and messages.
func (m *Mesh) serve(from string, s net.Conn) {
	c := peer.NewConn(s)
	defer c.Close()
	var hello frame
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if err := c.Receive(&hello); err != nil || hello.Kind != kindHello || hello.Node != from {
		return // a node speaks for itself only (from is the link's, authenticated)
	}
	c.SetReadDeadline(time.Time{})
	node := from
	if _, member := m.cfg.Members()[node]; !member {
		return // a node that left, or one not yet known: it tries again
	}
	m.mu.Lock()
	st := m.seen[node]
	if st.epoch != hello.Epoch {
		st = seenFrom{epoch: hello.Epoch, open: &arrivals{}} // a new process: nothing seen
		m.seen[node] = st
	}
	kick := make(chan struct{}, 1)
	open := st.open
	open.mu.Lock()
	open.kick = kick
	open.mu.Unlock()
	m.mu.Unlock()
	// Acknowledgements are written by the reader, after a burst, and by
	// a writer of its own for deliveries done later.
	var sendMu sync.Mutex
	var acked uint64
	var last atomic.Uint64
	last.Store(st.last)
	ack := func() error {
		sendMu.Lock()
		defer sendMu.Unlock()
		if n := open.ackable(last.Load()); n > acked {
			acked = n
			b, _ := appendFrame(nil, &frame{Kind: kindAck, Seq: n})
			if err := c.WriteFrame(b); err != nil {
				return err
			}
			return c.Flush()
		}
		return nil
	}
	stopped := make(chan struct{})
	defer close(stopped)
	go func() {
		for {
			select {
			case <-stopped:
				return
			case <-kick:
				if ack() != nil {
					return
				}
			}
		}
	}()
	owed := false // a frame its sender keeps until acknowledged came since the last ack
	for {
		var f frame
		if err := receive(c, &f); err != nil {
			return
		}
		done := f.Seq <= st.last // sent again: seen already
		// QoS 0 messages are not kept by their sender: acknowledging
		// them would cost a write each burst for nothing.
		owed = owed || f.Kind == kindInterest || f.Kind == kindMessage && f.Delivery != nil && f.Delivery.Msg.QoS > 0
		switch {
		case done:
		case f.Kind == kindInterests:
			m.mu.Lock()
			m.table.Set(node, f.Filters)
			m.mu.Unlock()
			m.Counters.Resyncs.Add(1)
		case f.Kind == kindInterest:
			m.mu.Lock()
			if f.On {
				m.table.Add(node, f.Filter)
			} else {
				m.table.Remove(node, f.Filter)
			}
			m.mu.Unlock()
			m.Counters.InterestReceived.Add(1)
		case f.Kind == kindMessage && f.Delivery != nil && f.Delivery.Msg.QoS == 0:
			m.Counters.Received.Add(1)
			m.cfg.Deliver(node, f.Delivery, noop)
		case f.Kind == kindMessage && f.Delivery != nil:
			m.Counters.Received.Add(1)
			seq := f.Seq
			open.start(seq)
			var returned atomic.Bool
			m.cfg.Deliver(node, f.Delivery, func() { open.finish(seq, returned.Load()) })
			returned.Store(true)
		case f.Kind == kindRequest:
			var answer []byte
			if m.cfg.Handle != nil {
				answer = m.cfg.Handle(node, f.Body)
			}
			sendMu.Lock()
			err := c.Send(frame{Kind: kindReply, Seq: f.Seq, Body: answer})
			sendMu.Unlock()
			if err != nil {
				return
			}
		}
		if f.Seq > st.last {
			st.last = f.Seq
			last.Store(f.Seq)
			m.mu.Lock()
			m.seen[node] = st
			m.mu.Unlock()
		}
		// Acknowledged once what arrived is done: one ack a burst.
		if c.Buffered() == 0 && owed {
			owed = false
			if err := ack(); err != nil {
				return
			}
		}
	}
}

// item is one frame for a node, with what to call once it is done.
type item struct {
	f     frame
	sent  time.Time // when it was queued: for the hop's latency
	done  func()
	ack   bool                         // kept until acknowledged, and sent again on a new stream
	reply func(answer []byte, ok bool) // a request's: not sent again, told of a broken stream
}

// sender keeps the stream to one member and what goes on it.
type sender struct {
	m        *Mesh
	id, addr string

	mu        sync.Mutex
	queue     []item // not sent yet
	pending   []item // sent, waiting for an ack; in sequence order
	seq       uint64
	replies   map[uint64]func([]byte, bool) // requests sent, by sequence
	connected bool
	downSince time.Time // when it was last found not answering
	wake      chan struct{}
	stop      chan struct{}
	closeOnce sync.Once
}

func newSender(m *Mesh, id, addr string) *sender {
	return &sender{m: m, id: id, addr: addr, wake: make(chan struct{}, 1), stop: make(chan struct{})}
}

func (s *sender) close() { s.closeOnce.Do(func() { close(s.stop) }) }

// push queues it; interest changes made while the stream is down are
// left out (the next stream begins with all of it).
func (s *sender) push(it item) {
	s.mu.Lock()
	if it.f.Kind == kindInterest && !s.connected {
		s.mu.Unlock()
		it.done()
		return
	}
	if len(s.queue)+len(s.pending) >= maxQueued {
		dropped := s.queue[0]
		s.queue = s.queue[1:]
		s.mu.Unlock()
		s.m.Counters.Dropped.Add(1)
		dropped.done()
		s.mu.Lock()
	}
	s.queue = append(s.queue, it)
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// run opens the stream, sends, and opens it again when it breaks.
func (s *sender) run() {
	defer s.m.wg.Done()
	defer s.fail()
	for {
		c, err := s.open()
		if err == nil {
			s.m.setGone(s.id, false) // it answers: its interest counts again
			s.send(c)
			c.Close()
		} else {
			s.failQueuedRequests()
		}
		s.mu.Lock()
		s.connected = false
		s.mu.Unlock()
		s.giveUpIfDown()
		select {
		case <-s.stop:
			return
		case <-s.m.stop:
			return
		case <-time.After(retryEvery):
		}
	}
}

// giveUpIfDown tells the senders of what waits for a member that has not
// answered for GiveUp that it is not coming: their publishers' QoS
// exchanges go on. What was queued is dropped.
func (s *sender) giveUpIfDown() {
	if s.m.cfg.Alive == nil || s.m.cfg.Alive(s.id) {
		s.mu.Lock()
		s.downSince = time.Time{}
		s.mu.Unlock()
		s.m.setGone(s.id, false)
		return
	}
	s.mu.Lock()
	if s.downSince.IsZero() {
		s.downSince = time.Now()
	}
	over := time.Since(s.downSince) >= GiveUp
	s.mu.Unlock()
	if over {
		s.m.setGone(s.id, true)
		s.fail()
	}
}

// fail gives up what waits.
func (s *sender) fail() {
	s.mu.Lock()
	items := append(s.pending, s.queue...)
	s.pending, s.queue = nil, nil
	s.mu.Unlock()
	for _, it := range items {
		if it.f.Kind == kindMessage {
			s.m.Counters.Dropped.Add(1)
			if it.ack && s.m.cfg.GivenUp != nil && it.f.Delivery != nil {
				s.m.cfg.GivenUp(s.id, it.f.Delivery, it.done)
				continue
			}
		}
		if it.reply != nil {
			it.reply(nil, false)
		}
		it.done()
	}
	s.failReplies()
}

// open opens a stream to the member and begins it: hello, all of this
// node's interest, then what waits unacknowledged from before.
func (s *sender) open() (*peer.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	raw, err := s.m.cfg.Link.Open(ctx, s.addr, peer.KindMesh, nil)
	if err != nil {
		return nil, err
	}
	c := peer.NewConn(raw)
	s.m.mu.Lock()
	filters := make([]string, 0, len(s.m.local))
	for f := range s.m.local {
		filters = append(filters, f)
	}
	s.mu.Lock()
	s.connected = true
	// Interest changes queued before are in the snapshot.
	kept := s.queue[:0]
	var superseded []item
	for _, it := range s.queue {
		if it.f.Kind == kindInterest {
			superseded = append(superseded, it)
			continue
		}
		kept = append(kept, it)
	}
	s.queue = kept
	s.seq++
	snap := frame{Kind: kindInterests, Seq: s.seq, Filters: filters}
	resend := append([]item(nil), s.pending...)
	s.mu.Unlock()
	s.m.mu.Unlock()
	for _, it := range superseded {
		it.done()
	}
	// What was sent before, under its numbers, then the interest under
	// a new one: the receiver drops what it has seen by number.
	c.Write(frame{Kind: kindHello, Node: s.m.cfg.Self, Epoch: s.m.epoch})
	for _, it := range resend {
		s.m.Counters.Resent.Add(1)
		c.Write(it.f)
	}
	c.Write(snap)
	if err := c.Flush(); err != nil {
		return nil, err
	}
	return c, nil
}

// send writes what is queued until the stream breaks or the sender
// stops, reading acknowledgements on the side.
func (s *sender) send(c *peer.Conn) {
	var buf []byte // a binary frame's encoding, reused
	broken := make(chan struct{})
	go func() {
		defer close(broken)
		for {
			var f frame
			if err := receive(c, &f); err != nil {
				return
			}
			switch f.Kind {
			case kindAck:
				s.acked(f.Seq)
			case kindReply:
				s.mu.Lock()
				r := s.replies[f.Seq]
				delete(s.replies, f.Seq)
				s.mu.Unlock()
				if r != nil {
					r(f.Body, true)
				}
			}
		}
	}()
	for {
		s.mu.Lock()
		batch := s.queue
		s.queue = nil
		for i := range batch {
			s.seq++
			batch[i].f.Seq = s.seq
			if batch[i].ack {
				s.pending = append(s.pending, batch[i])
			}
			if batch[i].reply != nil {
				if s.replies == nil {
					s.replies = map[uint64]func([]byte, bool){}
				}
				s.replies[s.seq] = batch[i].reply
			}
		}
		s.mu.Unlock()
		for _, it := range batch {
			var err error
			if b, ok := appendFrame(buf[:0], &it.f); ok {
				buf = b
				err = c.WriteFrame(b)
			} else {
				err = c.Write(it.f)
			}
			if err != nil {
				s.requeueUnacked(batch)
				return
			}
		}
		if len(batch) > 0 {
			if err := c.Flush(); err != nil {
				s.requeueUnacked(batch)
				return
			}
			for _, it := range batch {
				if !it.ack {
					it.done() // QoS 0: sent is all it gets
				}
			}
		}
		select {
		case <-s.wake:
		case <-broken:
			s.failReplies()
			return
		case <-s.stop:
			s.failReplies()
			return
		case <-s.m.stop:
			s.failReplies()
			return
		}
	}
}

// failReplies tells the requests sent on a stream that broke that no
// answer is coming.
func (s *sender) failReplies() {
	s.mu.Lock()
	rs := s.replies
	s.replies = nil
	s.mu.Unlock()
	for _, r := range rs {
		r(nil, false)
	}
}

// failQueuedRequests answers the requests waiting to be sent "no answer":
// the node cannot be reached now, and whoever asks goes on without it (a
// claim of a client id whose node died takes its session up from the
// store) rather than wait for GiveUp.
func (s *sender) failQueuedRequests() {
	s.mu.Lock()
	var failed []item
	kept := s.queue[:0]
	for _, it := range s.queue {
		if it.reply != nil {
			failed = append(failed, it)
		} else {
			kept = append(kept, it)
		}
	}
	s.queue = kept
	s.mu.Unlock()
	for _, it := range failed {
		it.reply(nil, false)
		it.done()
	}
}

// requeueUnacked gives up the QoS 0 messages of a batch that did not
// leave (the rest waits in pending, sent again on the next stream), and
// its requests.
func (s *sender) requeueUnacked(batch []item) {
	s.failReplies()
	for _, it := range batch {
		if !it.ack {
			s.m.Counters.Dropped.Add(1)
			it.done()
		}
	}
}

// acked completes what was sent up to seq.
func (s *sender) acked(seq uint64) {
	s.mu.Lock()
	n := 0
	for n < len(s.pending) && s.pending[n].f.Seq <= seq {
		n++
	}
	done := append([]item(nil), s.pending[:n]...)
	s.pending = s.pending[n:]
	s.mu.Unlock()
	now := time.Now()
	for _, it := range done {
		if it.f.Kind == kindMessage {
			s.m.Counters.Hops.Add(1)
			s.m.Counters.HopMicros.Add(now.Sub(it.sent).Microseconds())
		}
		it.done()
	}
}
