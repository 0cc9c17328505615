// Package redis serves the state store to Redis clients (redis-cli,
// redis-benchmark, Redis client libraries) over RESP2 and RESP3: the
// commands that map onto the store (GET, SET with NX/XX/PX/EX/GET, DEL,
// EXISTS, MGET, PTTL/TTL, KEYS, SCAN) and the connection commands clients
// send (HELLO, AUTH, SELECT 0, CLIENT, PING, ECHO, INFO, QUIT), plus
// MQKV.* extensions for versions. Every command goes through the
// statestore service (package gateway), so it is authorized, limited,
// logged, notified and counted as an MQTT request is, and served for any
// key from any node of a cluster.
package redis

import (
	"bufio"
	"bytes"
	"errors"
	"hash/maphash"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Info is what INFO and DBSIZE report.
type Info struct {
	Version string // mqkv's
	NodeID  string
	Durable bool
	Started time.Time
	Keys    int   // in the whole store
	Bytes   int64 // key and value bytes in the whole store
	Partial bool  // some group's figures are missing
}

// Config configures a Server.
type Config struct {
	Service gateway.Service
	Guard   gateway.Guard // nil: gateway.Open
	// Info gives INFO's figures; nil reports none.
	Info func() Info
	// MaxBulk bounds one argument (a value) in bytes; 0 is 64 MiB, the
	// MQTT listener's default packet limit.
	MaxBulk int
	Logger  *slog.Logger
}

// Server is a RESP listener.
type Server struct {
	cfg Config
	log *slog.Logger

	// Counters, for INFO and metrics.
	Connected atomic.Int64
	Total     atomic.Int64
	Commands  atomic.Int64
}

// Endpoint is a listener the server serves (see ServeLoop).
type Endpoint interface {
	Addr() string
	Close() error
}

// New returns a server; Serve starts it.
func New(cfg Config) *Server {
	if cfg.Guard == nil {
		cfg.Guard = gateway.Open{}
	}
	if cfg.MaxBulk <= 0 {
		cfg.MaxBulk = 64 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Server{cfg: cfg, log: cfg.Logger}
}

// conn is one client connection. Its reader goroutine parses commands
// and runs them; the replies are written in the order of the commands,
// by the reader (see emit), by the goroutine that answered a write (see
// finish) or by the connection's writer goroutine (writeLoop). A pipeline's writes to distinct keys are in flight
// together (as Redis clients expect pipelining to pay), each answered when
// its log entry is applied; a command that reads, or writes a key a write
// in flight holds, waits for those before it, so every reply is what
// Redis running the commands one by one would give.
type conn struct {
	s     *Server
	nc    net.Conn
	rd    *reader
	wrote chan struct{} // closed when writeLoop returns
	c     *gateway.Client
	w     writer // the reader goroutine's replies
	name  string
	since time.Time
	quit  bool

	// A connection the loop serves (see Loop): the loop's writes in
	// flight (nil otherwise), its socket, what it sent not yet run (in,
	// within inBuf), paused while a goroutine runs its commands
	// (offload), stopped once it is ending. The loop's, or the
	// goroutine's while paused.
	round           *round
	fd              int
	in, inBuf       []byte
	nextLen         int // of the next whole command in in, once measured (moreIn); 0 if not
	paused, stopped bool
	inLoop          bool // the loop runs its command: its own replies must not wait for room

	cursor  cursors
	getArgs [2][]byte // GET's arguments to the service

	mu       sync.Mutex
	cond     *sync.Cond   // the reader waits here: a write answered, a reply written
	waiters  int          // goroutines waiting on cond
	wcond    *sync.Cond   // writeLoop waits here for replies to write
	slots    []*slot      // replies not yet written, in command order
	writing  keyCounts    // writes in flight by their key's hash (keyHash), unless inOrder
	free     []*writeSlot // write slots whose replies were taken, for the next writes
	inFlight int          // writes not yet answered
	pending  int          // replies queued and not yet written
	ended    bool
	// more: the reader has more of a pipeline buffered, so the writer
	// waits for it and writes the replies together (a write each cost
	// a GET -P 16 a sixth of its CPU).
	more bool

	// Replies written by the goroutine that answered a write (see
	// finish). busy: replies taken from slots are being written, by
	// writeLoop or by finish; while it is set, no one else takes any.
	// rest: what such a write left for writeLoop when the socket was
	// full, and restN its replies.
	tw     tryWriter // nil: writeLoop writes every slot
	busy   bool
	direct []byte
	rest   []byte
	restN  int

	// queued counts the slots pushed and not yet written: the writer
	// lowers it once its write returned. While it is 0 the reader writes
	// its own replies (see emit); only the reader raises it.
	queued atomic.Int64
	own    int  // replies in w.b the reader will write itself
	broken bool // the reader's own write failed
}

// slot is one command's reply (or, done at once, several: see emit),
// done once known.
type slot struct {
	b    []byte
	n    int // replies in b
	done bool
	// write is the write slot this is, kept for another write once its
	// reply is taken (see take); nil for a reply the reader queued.
	write *writeSlot
}

// writeSlot is the slot of a write in flight (see startWrite): its
// connection and key, how to write its reply, and the request and
// command sent to the service; one allocation with the slot, which a
// reply the reader queues (emit) does without.
type writeSlot struct {
	slot
	c     *conn
	key   uint64 // keyHash
	proto int
	plain bool     // the reply is the store's as it is (DEL's count, a counter's number), not SET's
	small [24]byte // room for a write's reply ("+OK", a null, ":1", a counter's number)
	req   statestore.Request
	args  [7][]byte // the command sent (SET's longest: setCommand)
}

// maxSlots bounds the replies a connection holds unwritten (pending): a
// client that pipelines faster than it reads waits.
const maxSlots = 1024

// maxFree bounds the write slots a connection keeps for reuse.
const maxFree = 64

// Serve serves one client connection until it ends, on the calling
// goroutine (the connection's reader).
func (s *Server) Serve(nc net.Conn) {
	c := s.newConn(nc, bufio.NewReaderSize(nc, readerSize))
	defer c.end()
	for !c.quit {
		args, err := c.rd.next()
		if err != nil {
			c.readFailed(err)
			return
		}
		c.run(args, c.rd.br.Buffered() > 0)
	}
}

// newConn starts serving nc: its writer goroutine runs until end. br is
// what its commands are read from.
func (s *Server) newConn(nc net.Conn, br *bufio.Reader) *conn {
	s.Connected.Add(1)
	s.Total.Add(1)
	c := &conn{s: s, nc: nc, c: gateway.NewClient(s.cfg.Service, s.cfg.Guard, "resp"), since: time.Now(),
		w: writer{proto: 2}, rd: &reader{br: br, maxBulk: s.cfg.MaxBulk}}
	c.cond = sync.NewCond(&c.mu)
	c.wcond = sync.NewCond(&c.mu)
	c.tw, _ = nc.(tryWriter)
	c.wrote = make(chan struct{})
	go c.writeLoop(c.wrote)
	return c
}

// end waits until every command's reply is written (writes in flight
// end within the service's request timeout) and the writer is done: the
// connection may close then.
func (c *conn) end() {
	c.writeOwn()
	c.mu.Lock()
	for c.inFlight > 0 {
		c.wait()
	}
	c.ended = true
	c.wcond.Signal()
	c.mu.Unlock()
	<-c.wrote
	c.s.Connected.Add(-1)
}

// readFailed ends the reading of commands on err: a protocol error is
// answered as Redis answers it.
func (c *conn) readFailed(err error) {
	var pe ProtocolError
	if errors.As(err, &pe) {
		c.w.err("ERR " + pe.Error())
		c.emit(false)
		c.s.log.Debug("resp: protocol error, connection closed", "remote", c.nc.RemoteAddr(), "error", err)
	} else if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		c.s.log.Debug("resp: connection ended", "remote", c.nc.RemoteAddr(), "error", err)
	}
}

// run runs one command read; more says further ones are read already.
func (c *conn) run(args [][]byte, more bool) {
	if len(args) == 0 {
		if !more {
			c.writeOwn() // what was kept for the commands after it
		}
		return
	}
	if key, ok := c.asyncWrite(args); ok {
		c.runWrite(key, args, more)
		return
	}
	c.runInTurn(args, more)
}

// runWrite runs a write that may be in flight with others (asyncWrite).
func (c *conn) runWrite(key uint64, args [][]byte, more bool) {
	c.s.Commands.Add(1)
	c.writeOwn() // the replies before it go first
	c.startWrite(key, args, more)
}

// runInTurn runs any other command, once the writes before it are
// answered.
func (c *conn) runInTurn(args [][]byte, more bool) {
	c.s.Commands.Add(1)
	c.settle()
	c.command(args)
	c.emit(more)
}

// settle waits until no write is in flight: what comes next may read
// what they write.
func (c *conn) settle() {
	c.mu.Lock()
	for c.inFlight > 0 {
		c.wait()
	}
	c.mu.Unlock()
}

// wait waits on cond (c.mu held), counted so that the goroutines that
// answer writes wake the reader only when it waits.
func (c *conn) wait() {
	c.waiters++
	c.cond.Wait()
	c.waiters--
}

// wake wakes the reader if it waits (c.mu held).
func (c *conn) wake() {
	if c.waiters > 0 {
		c.cond.Broadcast()
	}
}

// emit takes what the reader goroutine wrote into w as the next reply;
// more says further commands are buffered already.
//
// While none of the connection's replies wait to be written (no write in
// flight before it, nothing queued for the writer), the reader keeps the
// reply and writes it itself, with those of the rest of the pipeline it
// has read, in one write: as Redis answers from its event loop. Handing
// each pipeline's replies to the writer goroutine cost a lock taken per
// reply by both goroutines, on two cores, and a wakeup per write.
func (c *conn) emit(more bool) {
	if c.queued.Load() == 0 {
		c.own++
		// The loop writes what it kept once it has read every ready
		// connection (Loop.flush), unless there is too much of it.
		if len(c.w.b) >= maxMerged || c.own >= maxSlots || !more && !c.inLoop {
			c.writeOwn()
		}
		return
	}
	c.mu.Lock()
	if n := len(c.slots); n > 0 && c.pending < maxSlots && len(c.w.b) <= maxMergedReply {
		if last := c.slots[n-1]; last.done && len(last.b)+len(c.w.b) <= maxMerged {
			// Behind a reply not written yet: written with it, in the
			// same slot (a slot and a buffer per reply cost a pipelined
			// GET a twentieth of its CPU), and the writer's buffer kept.
			last.b = append(last.b, c.w.b...)
			last.n++
			c.pending++
			c.w.b = c.w.b[:0]
			c.more = more
			c.signalWriter()
			c.mu.Unlock()
			return
		}
	}
	c.mu.Unlock()
	c.push(&slot{b: c.w.take(), n: 1, done: true}, more)
}

// writeOwn writes the replies the reader kept (see emit), if any. Nothing
// else writes meanwhile: the writer has nothing queued, and only the
// reader queues.
func (c *conn) writeOwn() {
	if c.own == 0 {
		return
	}
	own := c.own
	c.own = 0
	if !c.broken {
		if c.inLoop {
			c.tryWriteOwn(own)
			return
		}
		if _, err := c.nc.Write(c.w.b); err != nil {
			c.broken = true // the reader's next read sees the connection end
			c.nc.Close()
		}
	}
	c.w.b = c.w.b[:0]
	if cap(c.w.b) > 1<<20 {
		c.w.b = nil
	}
}

// tryWriteOwn is writeOwn for the loop, which must not wait: what the
// socket has no room for goes to the writer goroutine, as finish hands
// it what it could not write; replies after it are queued behind it.
func (c *conn) tryWriteOwn(own int) {
	wrote, err := c.tw.TryWrite(c.w.b)
	if err != nil {
		c.broken = true
		c.nc.Close()
	} else if wrote < len(c.w.b) {
		rest := append([]byte(nil), c.w.b[wrote:]...)
		c.queued.Add(int64(own))
		c.mu.Lock()
		c.busy = true
		c.rest, c.restN = rest, own
		c.wcond.Signal()
		c.mu.Unlock()
	}
	c.w.b = c.w.b[:0]
	if cap(c.w.b) > 1<<20 {
		c.w.b = nil
	}
}

// Merging replies into one slot: small ones only (a large one keeps its
// own buffer, which goes with it), up to maxMerged bytes a slot.
const (
	maxMergedReply = 4 << 10
	maxMerged      = 16 << 10
)

// push queues a reply slot, waiting while too many are unwritten.
func (c *conn) push(sl *slot, more bool) {
	c.mu.Lock()
	for c.pending >= maxSlots && !c.ended {
		c.more = false // the writer must take some first
		c.wcond.Signal()
		c.wait()
	}
	c.slots = append(c.slots, sl)
	c.queued.Add(1)
	c.pending += sl.n
	c.more = more
	c.signalWriter()
	c.mu.Unlock()
}

// signalWriter wakes writeLoop if it has replies to write (c.mu held).
// Only then: a write's slot is pushed before its reply is known, and
// waking the writer for it, to find nothing done and wait again, cost a
// SET without pipelining a goroutine switch and its share of the
// scheduler.
func (c *conn) signalWriter() {
	if c.ready() {
		c.wcond.Signal()
	}
}

// asyncWrite says whether args is a write that may be in flight with
// others (a SET with no XX and no NX GET, a DEL of one key, a counter's
// INCR, DECR, INCRBY or DECRBY), and its key's hash.
func (c *conn) asyncWrite(args [][]byte) (uint64, bool) {
	if !c.c.Authenticated() || len(args) < 2 {
		return 0, false
	}
	switch name := string(args[0]); {
	case len(args) >= 3 && strings.EqualFold(name, "SET"):
		var nx, get bool
		for _, a := range args[3:] {
			switch {
			case strings.EqualFold(string(a), "XX"):
				return 0, false
			case strings.EqualFold(string(a), "NX"):
				nx = true
			case strings.EqualFold(string(a), "GET"):
				get = true
			}
		}
		return keyHash(args[1]), !(nx && get)
	case len(args) == 2 && strings.EqualFold(name, "DEL"), isCounter(args):
		return keyHash(args[1]), true
	}
	return 0, false
}

func isCounter(args [][]byte) bool { verb, _ := counter(args); return verb != nil }

// keyHash stands for a key in a connection's writes in flight: a hash,
// not the key, so that a write costs no copy of its key into a string.
// Two keys of one hash only wait for each other, as one key's writes do.
func keyHash(key []byte) uint64 { return maphash.Bytes(keySeed, key) }

var keySeed = maphash.MakeSeed()

// startWrite sends a write and queues the slot its reply fills, once no
// other write to its key is in flight. Why wait: in a cluster a write may
// be forwarded to its group's leader, and the next one to the same key,
// sent meanwhile, may take another way (the leader moved) and reach the
// log first. A connection inOrder needs not: on a node on its own each
// write goes into the one group's queue as it is sent, so two to one key
// are applied in the order sent, and their replies go out in that order
// anyway. Waiting there cost a pipelined load a straggler entry in about
// every other round (16 SETs of 50 clients among 10,000 keys: a key
// twice in one client's 16 once in about 80), an fdatasync and a
// round's wait of its own (docs/benchmarks.md, issue 32, seventh).
func (c *conn) startWrite(key uint64, args [][]byte, more bool) {
	c.mu.Lock()
	inOrder := c.inOrder()
	for !inOrder && c.writing.get(key) > 0 {
		c.wait()
	}
	if !inOrder {
		c.writing.add(key)
	}
	c.inFlight++
	if c.round != nil {
		c.round.writes.Add(1)
	}
	var sl *writeSlot
	if n := len(c.free); n > 0 {
		sl, c.free[n-1] = c.free[n-1], nil
		c.free = c.free[:n-1]
	} else {
		sl = new(writeSlot)
	}
	c.mu.Unlock()
	// Its request is made anew by SendIn, its command by setCommand.
	sl.slot = slot{n: 1, write: sl}
	// HELLO, which changes the protocol, waits for writes in flight.
	sl.c, sl.key, sl.proto = c, key, c.w.proto
	c.push(&sl.slot, more)
	// SET first: the one a pipelined load sends.
	sl.plain = !strings.EqualFold(string(args[0]), "SET")
	if sl.plain {
		cmd := append(sl.args[:0], verbDEL, args[1])
		if verb, delta := counter(args); verb != nil {
			cmd = append(cmd[:0], verb, args[1], delta)
		}
		c.c.SendIn(&sl.req, "", cmd, sl)
		return
	}
	cmd, errText := setCommand(sl.args[:0], args)
	if errText != "" {
		w := writer{proto: sl.proto}
		w.err(errText)
		sl.finish(w.b)
		return
	}
	c.c.SendIn(&sl.req, "", cmd, sl)
}

// Reply writes the store's answer into the slot of the write in flight
// (statestore.Replier).
func (sl *writeSlot) Reply(_ *statestore.Request, payload []byte, _ hlc.Timestamp) {
	if !sl.plain && bytes.Equal(payload, resp.OK) {
		// An applied SET, the answer a pipelined load waits for: the
		// same bytes in RESP2 and RESP3, without parsing the store's.
		sl.finish(append(sl.small[:0], resp.OK...))
		return
	}
	v := gateway.Parse(payload)
	w := writer{b: sl.small[:0], proto: sl.proto}
	if sl.plain {
		w.value(v) // DEL's count for one key (:1 deleted, :0 absent), a counter's number
	} else {
		setReply(&w, v)
	}
	sl.finish(w.b)
}

// finish makes b the slot's reply, and lets the key's next write go.
//
// When that leaves no write of the connection in flight, the goroutine
// that answered it (the one that completes the log's entries) writes the
// replies that are due itself, without waiting for room in the socket,
// as Redis writes its replies from its event loop: waking the
// connection's writer goroutine for each reply cost a durable SET a
// goroutine switch and its share of the scheduler, a tenth of its CPU
// (bench/respfloor's writer hand-off against its committer's). While
// writes are still in flight (a pipeline), what is done waits for the
// last of them, so that a pipeline's replies go out together, in one
// write from here. Waking the writer goroutine for the first reply done
// (as before) cost a write of 16 pipelined SETs a goroutine switch, and
// the switch's wait made the writer take the rest anyway: 4 % more CPU
// per SET, 4 % fewer SETs a second (docs/benchmarks.md, 2026-11-30).
// Replies the reader queued after a write still in flight go out when
// it is answered; the reader wakes the writer itself (signalWriter) for
// replies done ahead of what is in flight, or when it waits for room.
func (sl *writeSlot) finish(b []byte) {
	c := sl.c
	if c.round != nil {
		defer c.round.answered()
	}
	c.mu.Lock()
	sl.b, sl.done = b, true
	if !c.inOrder() {
		c.writing.remove(sl.key)
	}
	c.inFlight--
	c.wake()
	if !c.ready() {
		c.mu.Unlock() // whoever writes, or makes more false, writes it
		return
	}
	if c.tw == nil {
		c.wcond.Signal()
		c.mu.Unlock()
		return
	}
	if c.inFlight > 0 {
		c.mu.Unlock() // the last of them writes it
		return
	}
	buf, n := c.take(c.direct[:0])
	c.busy = true
	c.mu.Unlock()
	wrote, err := c.tw.TryWrite(buf)
	if err != nil {
		c.nc.Close() // the reader sees the connection end
	}
	c.mu.Lock()
	c.direct = buf
	if err == nil && wrote < len(buf) {
		// The socket is full: writeLoop waits for room, busy set until
		// it has written the rest.
		c.rest, c.restN = buf[wrote:], n
		c.wcond.Signal()
		c.mu.Unlock()
		return
	}
	c.busy = false
	c.queued.Add(int64(-n))
	if cap(c.direct) > 1<<20 {
		c.direct = nil
	}
	if c.ended || c.ready() {
		c.wcond.Signal() // the reader queued more meanwhile, or waits to end
	}
	c.mu.Unlock()
}

// inOrder says the connection's writes reach the log in the order it
// sent them, whatever their keys: a loop's (it has a round), which serves
// a node on its own, whose one group takes each write as it is sent (see
// startWrite).
func (c *conn) inOrder() bool { return c.round != nil }

// round counts the writes in flight of a loop's connections (see Loop):
// the loop reads its next round once they are answered.
type round struct {
	writes atomic.Int64
	done   chan struct{} // capacity 1: writes came down to 0
	timer  *time.Timer   // wait's, made once: it runs every round
}

func newRound() *round {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &round{done: make(chan struct{}, 1), timer: t}
}

func (r *round) answered() {
	if r.writes.Add(-1) == 0 {
		select {
		case r.done <- struct{}{}:
		default:
		}
	}
}

// wait waits until the writes are answered, or max at most. One
// goroutine (the loop) waits.
func (r *round) wait(max time.Duration) {
	if r.writes.Load() == 0 {
		return
	}
	r.timer.Reset(max)
	defer r.timer.Stop()
	for r.writes.Load() > 0 {
		select {
		case <-r.done:
		case <-r.timer.C:
			return
		}
	}
}

// tryWriter writes what a socket has room for without waiting
// (sockio.Conn).
type tryWriter interface {
	TryWrite(p []byte) (int, error)
}

// ready says whether a reply is done and due to be written (c.mu held).
func (c *conn) ready() bool {
	return !c.busy && len(c.slots) > 0 && c.slots[0].done && (!c.more || c.ended)
}

// take removes the done replies at the front of slots, appending them to
// buf, and returns it with the number of replies (c.mu held).
func (c *conn) take(buf []byte) ([]byte, int) {
	n, replies := 0, 0
	for n < len(c.slots) && c.slots[n].done {
		sl := c.slots[n]
		buf = append(buf, sl.b...)
		replies += sl.n
		// Answered and its reply copied out: the service touches a
		// request no more once it replied (statestore.Replier), so the
		// slot, request and all, can serve the next write. A write
		// allocated 600 bytes for it.
		if sl.write != nil && len(c.free) < maxFree {
			c.free = append(c.free, sl.write)
		}
		n++
	}
	c.pending -= replies
	c.slots = append(c.slots[:0], c.slots[n:]...)
	c.wake() // push may wait for room
	return buf, n
}

// writeLoop writes the replies that are done, in order, as many in one
// write as are ready, and what finish could not write, until the
// connection ends.
func (c *conn) writeLoop(wrote chan<- struct{}) {
	defer close(wrote)
	var buf []byte
	broken := false
	for {
		c.mu.Lock()
		var out []byte
		var n int
		for {
			if c.rest != nil {
				// finish's buffer: its own stays apart.
				out, n = c.rest, c.restN
				c.rest = nil
				break
			}
			if c.ready() {
				buf, n = c.take(buf[:0])
				out = buf
				c.busy = true
				break
			}
			if c.ended && !c.busy {
				c.mu.Unlock()
				return
			}
			c.wcond.Wait()
		}
		c.mu.Unlock()
		if !broken {
			if _, err := c.nc.Write(out); err != nil {
				broken = true // the reader sees the connection end
				c.nc.Close()
			}
		}
		c.mu.Lock()
		c.busy = false
		c.mu.Unlock()
		c.queued.Add(int64(-n)) // written: the reader may write its own
		if cap(buf) > 1<<20 {
			buf = nil
		}
	}
}
