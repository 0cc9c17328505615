package redis

import (
	"bufio"
	"errors"
	"net"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/procs"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Loop serves the endpoint's connections in Redis's shape: one goroutine,
// locked to its thread, waits in epoll for every connection (each taken
// out of Go's network poller), reads each ready one (and those ready by
// the time it has) and runs what they sent. The round's writes go to the
// store together, and the next round is read once they are answered
// (roundWait at most), so that a round is what the clients sent while the
// last one was being made durable: the cycle Redis's one thread has, as
// it syncs its log itself.
//
// Why (docs/benchmarks.md, "The RESP endpoint in Redis's shape"): with a
// goroutine per connection each request woke its goroutine, which read
// twice, and the log's proposer held each entry open a while for more
// writers to come. 50 clients of durable SETs one at a time, alternating
// builds: 51,818 against 44,960 SETs a second and 61,145 against 55,971
// (four and three rounds), at 0.92–1.08x Redis's with appendfsync
// always; pipelined no better (242,996 and 256,208 against 239,868 and
// 273,907). A prototype without the cycle (reading whatever is ready as
// it comes) was slower than the goroutines.
//
// A command that may wait (anything but a write that can be in flight
// with others: a read, AUTH's password hash, a write forwarded to another
// node) runs on a goroutine of its own with the connection paused, which
// runs the rest of what the connection sent the same way, then hands it
// back. A connection that is no socket the loop can take over (TLS, a
// wrapper) is served by a goroutine of its own throughout.
type Loop struct {
	s     *Server
	ln    net.Listener
	ep    int
	wake  int // an eventfd: connections handed back, Close
	round *round
	due   []*conn // connections with replies the loop kept, to write (see flush)
	// rounds, if the service takes them, is told when a round is read
	// and when all of it was sent (see run).
	rounds statestore.Rounds

	mu      sync.Mutex
	conns   map[int]*conn // by descriptor, until it is closed
	resumed []*conn       // handed back by their goroutine
	closed  bool

	wg sync.WaitGroup
}

// roundWait bounds how long a round waits for its writes: one forwarded
// to another node's leader, or a slow disk, holds the others back no
// longer.
const roundWait = 10 * time.Millisecond

// ServeLoop serves ln's connections with a Loop. It is for a node on its
// own, whose service answers every read at once: the loop runs reads
// itself, and a cluster member's may be forwarded (one serves each
// connection with Serve instead).
func (s *Server) ServeLoop(ln net.Listener) (Endpoint, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(ep)
		return nil, err
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, wake, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}); err != nil {
		unix.Close(ep)
		unix.Close(wake)
		return nil, err
	}
	l := &Loop{s: s, ln: ln, ep: ep, wake: wake, round: newRound(), conns: map[int]*conn{}}
	l.rounds, _ = s.cfg.Service.(statestore.Rounds)
	l.wg.Add(2)
	go l.accept()
	go l.run()
	return l, nil
}

// Addr is the listener's address.
func (l *Loop) Addr() string { return l.ln.Addr().String() }

// Close stops listening, ends every connection (their replies written)
// and waits for all of it.
func (l *Loop) Close() error {
	l.mu.Lock()
	l.closed = true
	for fd := range l.conns {
		unix.Shutdown(fd, unix.SHUT_RDWR)
	}
	l.mu.Unlock()
	err := l.ln.Close()
	l.signal()
	l.wg.Wait()
	unix.Close(l.ep)
	unix.Close(l.wake)
	return err
}

func (l *Loop) signal() {
	var one = [8]byte{1}
	unix.Write(l.wake, one[:])
}

func (l *Loop) accept() {
	defer l.wg.Done()
	for {
		nc, err := gateway.Accept(l.ln)
		if err != nil {
			return
		}
		l.add(nc)
	}
}

// add takes nc out of Go's network poller, into the loop's.
func (l *Loop) add(nc net.Conn) {
	sc, ok := nc.(syscall.Conn)
	if !ok { // TLS: a goroutine of its own
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			nc.Close()
			return
		}
		l.wg.Add(1)
		l.mu.Unlock()
		go func() {
			defer l.wg.Done()
			l.s.Serve(nc)
			nc.Close()
		}()
		return
	}
	fd := -1
	if raw, err := sc.SyscallConn(); err == nil {
		raw.Control(func(f uintptr) { fd, _ = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0) })
	}
	local, remote := nc.LocalAddr(), nc.RemoteAddr()
	nc.Close() // the duplicate keeps the socket open
	if fd < 0 {
		return
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return
	}
	c := l.s.newConn(&rawConn{fd: fd, local: local, remote: remote}, bufio.NewReaderSize(nil, readerSize))
	c.round, c.fd = l.round, fd
	c.c.Gathered = true
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		l.finish(c)
		return
	}
	l.conns[fd] = c
	l.mu.Unlock()
	if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
		l.mu.Lock()
		delete(l.conns, fd)
		l.mu.Unlock()
		l.finish(c)
	}
}

// run is the loop.
func (l *Loop) run() {
	defer l.wg.Done()
	runtime.LockOSThread()
	events := make([]unix.EpollEvent, 256)
	buf := make([]byte, 64<<10)
	for {
		l.round.wait(roundWait)
		n, err := unix.EpollWait(l.ep, events, -1)
		if err != nil && err != unix.EINTR {
			l.s.log.Error("resp: the connections' loop failed", "error", err)
			n = 0
			l.mu.Lock()
			l.closed = true
			l.mu.Unlock()
		}
		if l.rounds != nil {
			l.rounds.RoundBegun()
		}
		l.readReady(events[:max(n, 0)], buf)
		if testHookRead != nil {
			testHookRead(l, false)
		}
		// Clients that sent while the others were read join the round,
		// rather than start the next one on their own. Why: a round's
		// replies go out as its writes are applied, and redis-benchmark's
		// one thread answers the last of them with its next pipeline
		// after the loop has looked: half the rounds of 50 clients of 16
		// pipelined SETs carried 464-592 of the 800 in flight, the rest
		// a round (an entry, a sync) later; looking again, most carry
		// all 800 (at two Ps, five alternating rounds: median 413,394
		// SETs a second against 392,619, four of five ahead;
		// docs/benchmarks.md, issue 32, ninth).
		for range maxRepoll {
			if l.round.writes.Load() == 0 {
				break // no round to join: reads are answered as they come
			}
			m, err := unix.EpollWait(l.ep, events, 0)
			if m <= 0 || err != nil {
				break
			}
			l.readReady(events[:m], buf)
		}
		if l.round.writes.Load() >= askWrites {
			askMore()
		}
		if testHookRead != nil {
			testHookRead(l, true)
		}
		l.mu.Lock()
		resumed, closed := l.resumed, l.closed
		l.resumed = nil
		l.mu.Unlock()
		for _, c := range resumed {
			c.paused = false
			if c.quit {
				l.stop(c)
				continue
			}
			if err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, c.fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(c.fd)}); err != nil {
				l.stop(c)
				continue
			}
			l.serve(c)
		}
		// The round's writes are all sent: those behind an entry in
		// flight go into the next at once (replica.Group.RoundBegun).
		if l.rounds != nil {
			l.rounds.RoundSent()
		}
		l.flush()
		if closed {
			l.mu.Lock()
			var open []*conn
			for _, c := range l.conns {
				if !c.paused {
					open = append(open, c)
				}
			}
			l.mu.Unlock()
			for _, c := range open {
				l.stop(c)
			}
			return
		}
	}
}

// readReady reads the connections epoll reported ready.
func (l *Loop) readReady(events []unix.EpollEvent, buf []byte) {
	for _, ev := range events {
		fd := int(ev.Fd)
		if fd == l.wake {
			var b [8]byte
			unix.Read(l.wake, b[:])
			continue
		}
		l.mu.Lock()
		c := l.conns[fd]
		l.mu.Unlock()
		if c == nil || c.paused {
			continue
		}
		l.read(c, buf)
	}
}

// testHookRead, where a test sets it, is called by the loop once it has
// read what epoll reported (again false), and once it has looked again
// and asked for Ps or not (again true).
var testHookRead func(l *Loop, again bool)

// askMore is procs.Ask; a test counts the calls.
var askMore = procs.Ask

// askWrites is how many writes in one round ask the scheduler's policy
// for more Ps at once (procs.Ask): a deep pipeline's (50 clients of 16
// SETs carry 800), not many clients' one at a time (50 clients, 50),
// which run better at one P.
const askWrites = 256

// maxRepoll bounds how many times a round looks again for connections
// that became ready while the loop read the others (see run).
const maxRepoll = 4

// read reads what c sent, once, and serves it.
func (l *Loop) read(c *conn, buf []byte) {
	// unix.Read, not sockio's raw call (which the rest of mqkv's sockets
	// use): in the loop, locked to its thread, the raw calls measured
	// slower, 50 clients of one SET at a time 57,034 against 59,760 a
	// second (median of six alternating rounds, 5 of 6 behind).
	n, err := unix.Read(c.fd, buf)
	if n <= 0 {
		if n == 0 || err != unix.EAGAIN && err != unix.EINTR {
			l.stop(c) // the client closed, or the connection broke
		}
		return
	}
	in := append(c.in, buf[:n]...)
	if unsafe.SliceData(in) != unsafe.SliceData(c.inBuf) {
		// A new array (c.in starts where inBuf does, see compact): kept
		// for the next reads. Left out, every read of a connection whose
		// commands all ended in it allocated its bytes anew.
		c.inBuf = in[:0]
	}
	c.in = in
	l.serve(c)
}

// serve runs the commands c sent whole: writes that may be in flight
// together, and reads answered at once, here; anything else on a
// goroutine (see offload).
func (l *Loop) serve(c *conn) {
	for !c.quit {
		args, ok, err := c.nextIn()
		if !ok {
			c.compact()
			if c.own > 0 { // replies kept for flush: the last command was a read
				l.due = append(l.due, c)
			}
			return
		}
		if err == nil && len(args) == 0 {
			continue
		}
		if err == nil {
			// Replies the loop writes itself (reads', and those before
			// a write) must not wait for room: see writeOwn.
			if key, async := c.asyncWrite(args); async && !c.full() {
				c.inLoop = true
				c.runWrite(key, args, c.moreIn())
				c.inLoop = false
				continue
			} else if !async && c.readsHere(args) {
				c.inLoop = true
				c.runInTurn(args, c.moreIn())
				c.inLoop = false
				continue
			}
		}
		// Anything else on a goroutine, which may wait: a write whose
		// connection holds as many unwritten replies as it may; a
		// protocol error's answer.
		c.compact() // the goroutine's from here on
		c.paused = true
		// Out of the poll while paused, not only its EPOLLIN: a socket
		// that hangs up or fails is reported whatever the events asked
		// for, and would wake the loop over and over meanwhile.
		unix.EpollCtl(l.ep, unix.EPOLL_CTL_DEL, c.fd, nil)
		l.wg.Add(1)
		go l.offload(c, args, err)
		return
	}
	l.stop(c)
}

// flush writes the replies the loop kept for each connection it read
// (see emit), once it has read all that were ready, as Redis writes its
// clients' replies before it waits for events again. Written as each
// connection's commands ran, every write woke the client (redis-benchmark's
// one thread, on the other core) for its replies alone, to find nothing
// else ready and sleep again: a wakeup per connection read, the kernel's
// time for a pipelined GET twice Redis's (docs/benchmarks.md, issue 32,
// eighth).
func (l *Loop) flush() {
	for i, c := range l.due {
		// Neither can have happened since serve put c here, in this
		// turn of the loop; a stopped connection's descriptor may be
		// closed and reused, so it is checked all the same.
		if !c.stopped && !c.paused {
			c.inLoop = true
			c.writeOwn()
			c.inLoop = false
		}
		l.due[i] = nil
	}
	l.due = l.due[:0]
}

// offload runs a command that may wait (or answers a protocol error),
// and the rest of what c sent, as a connection's own reader goroutine
// would, then hands c back.
func (l *Loop) offload(c *conn, args [][]byte, err error) {
	defer l.wg.Done()
	for ok := true; ok && !c.quit; args, ok, err = c.nextIn() {
		if err != nil {
			c.readFailed(err)
			c.quit = true
			break
		}
		c.run(args, c.moreIn())
	}
	c.writeOwn()
	c.compact()
	l.mu.Lock()
	if l.closed {
		// The loop may be gone: end c here.
		c.stopped = true
		l.mu.Unlock()
		l.finish(c)
		return
	}
	l.resumed = append(l.resumed, c)
	l.mu.Unlock()
	l.signal()
}

// stop ends c: out of the loop's poll at once, closed once its replies
// are written.
func (l *Loop) stop(c *conn) {
	if c.stopped {
		return
	}
	c.stopped, c.paused = true, true
	unix.EpollCtl(l.ep, unix.EPOLL_CTL_DEL, c.fd, nil)
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		l.finish(c)
	}()
}

// finish waits for c's replies and closes it: out of conns first, as
// the next connection accepted may get its descriptor's number.
func (l *Loop) finish(c *conn) {
	c.end()
	l.mu.Lock()
	if l.conns[c.fd] == c {
		delete(l.conns, c.fd)
	}
	l.mu.Unlock()
	unix.Close(c.fd)
}

// nextIn parses the next whole command c sent, if there is one (ok).
func (c *conn) nextIn() (args [][]byte, ok bool, err error) {
	n := c.nextLen // measured by moreIn, if it ran since
	if n == 0 {
		n = commandLen(c.in, c.s.cfg.MaxBulk)
	}
	c.nextLen = 0
	if n == 0 {
		return nil, false, nil
	}
	args, err = c.rd.command(c.in[:n])
	c.in = c.in[n:]
	return args, true, err
}

// moreIn says whether c sent another whole command after the one run;
// nextIn takes the length it measured.
func (c *conn) moreIn() bool {
	c.nextLen = commandLen(c.in, c.s.cfg.MaxBulk)
	return c.nextLen > 0
}

// readsHere says whether the loop runs args itself: a read answered at
// once (see ServeLoop), after no write in flight (which it would wait
// for).
func (c *conn) readsHere(args [][]byte) bool {
	cmd, ok := lookup(args[0])
	if !ok || !cmd.local {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.inFlight == 0 && !c.busy && c.rest == nil && c.queued.Load() == 0
}

// full says whether c holds as many unwritten replies as it may: a
// write would wait for room, which the loop does not. (A write to a key
// with a write in flight needs not wait on a loop's connection: see
// conn.inOrder.)
func (c *conn) full() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pending >= maxSlots
}

// compact moves what is left of c's input to the start of its buffer,
// so that the buffer serves the next reads; a large value's is not kept.
// The commands run hold copies of their arguments (see reader).
func (c *conn) compact() {
	if len(c.in) == 0 {
		if cap(c.inBuf) > 1<<20 {
			c.inBuf = nil
		}
		c.in = c.inBuf[:0]
		return
	}
	if unsafe.SliceData(c.in) != unsafe.SliceData(c.inBuf) {
		c.in = append(c.inBuf[:0], c.in...)
	}
	c.inBuf = c.in[:0]
}

// rawConn is a connection of the loop's, written by its writer goroutine
// and by the goroutines that answer its writes; the loop reads it.
type rawConn struct {
	fd            int
	local, remote net.Addr
}

func (r *rawConn) Read([]byte) (int, error) { return 0, errors.New("resp: read by the loop") }

// Write writes all of p, waiting for room when the socket is full.
func (r *rawConn) Write(p []byte) (int, error) {
	done := 0
	for done < len(p) {
		n, err := unix.Write(r.fd, p[done:])
		if n > 0 {
			done += n
		}
		switch {
		case err == unix.EAGAIN:
			fds := []unix.PollFd{{Fd: int32(r.fd), Events: unix.POLLOUT}}
			if _, err := unix.Poll(fds, -1); err != nil && err != unix.EINTR {
				return done, err
			}
			if fds[0].Revents&(unix.POLLERR|unix.POLLHUP) != 0 {
				return done, net.ErrClosed
			}
		case err == unix.EINTR:
		case err != nil:
			return done, err
		}
	}
	return done, nil
}

// TryWrite writes what the socket has room for (see tryWriter).
func (r *rawConn) TryWrite(p []byte) (int, error) {
	for {
		n, err := unix.Write(r.fd, p)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return 0, nil
		case err != nil:
			return 0, err
		}
		return n, nil
	}
}

// Close shuts the socket down: the loop sees it end, and closes it once
// its replies are written.
func (r *rawConn) Close() error                     { return unix.Shutdown(r.fd, unix.SHUT_RDWR) }
func (r *rawConn) LocalAddr() net.Addr              { return r.local }
func (r *rawConn) RemoteAddr() net.Addr             { return r.remote }
func (r *rawConn) SetDeadline(time.Time) error      { return nil }
func (r *rawConn) SetReadDeadline(time.Time) error  { return nil }
func (r *rawConn) SetWriteDeadline(time.Time) error { return nil }
