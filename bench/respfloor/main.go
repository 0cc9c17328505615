//go:build linux

// Command respfloor is the floor under mqkv's RESP endpoint on this
// machine: a Go server of the same shape (a goroutine per connection,
// reading through a bufio.Reader, one write per batch of replies, the
// socket read and written with internal/sockio's raw calls) that
// parses each RESP command and answers +OK without doing anything: no
// store, no log, no disk. bench/resp.sh runs it beside mqkv and Redis, so
// that what a SET costs above the network and Go's scheduler shows.
//
// With -log FILE it is the durable floor: the least a Go server must do
// for a SET that survives a crash, and nothing more. Every command is
// appended to FILE as it was read; one committer goroutine writes what
// all connections gathered since its last round and fdatasyncs it (group
// commit, as Redis's appendfsync always does once per event loop), then
// answers. -handoff says how the answers go out: "committer" writes each
// connection's replies from the committer goroutine itself, as Redis's
// one thread does; "writer" wakes a writer goroutine per connection to
// write them, as mqkv's RESP endpoint does; "loop" is Redis's shape in
// Go, one goroutine and one epoll loop for every connection (serveLoop).
// No store, no raft, no versions: what mqkv spends above this floor is its
// own.
//
// With -raft DIR it is the raft floor: the committer's rounds go through
// a hashicorp/raft group of one over mqkv's raft-wal log in DIR (see
// openRaft) instead of a file of its own, and are answered once applied,
// as mqkv's are. What hashicorp/raft and the log cost on this machine;
// what mqkv spends above it is its store, its service and its gateway.
//
//	respfloor [-log FILE [-handoff committer|writer|loop] | -raft DIR] ADDRESS
//
// It is built on Linux only (epoll, fdatasync), where the benchmarks run;
// elsewhere `go build ./...` passes it by.
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/sockio"
)

func main() {
	logPath := flag.String("log", "", "append every command to this file, fdatasynced before it is answered")
	handoff := flag.String("handoff", "committer", "with -log, who writes the replies: committer, writer or loop (one epoll loop does everything)")
	raftDir := flag.String("raft", "", "commit every round of commands through a hashicorp/raft group of one with its log in this directory")
	flag.Parse()
	if flag.NArg() != 1 || (*handoff != "committer" && *handoff != "writer" && *handoff != "loop") || (*raftDir != "" && *logPath != "") || (*raftDir != "" && *handoff == "writer") {
		fmt.Fprintln(os.Stderr, "usage: respfloor [-log FILE [-handoff committer|writer|loop] | -raft DIR [-handoff committer|loop]] ADDRESS")
		os.Exit(2)
	}
	var lg *commitLog
	switch {
	case *logPath != "":
		f, err := os.OpenFile(*logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND|os.O_TRUNC, 0o600)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		lg = &commitLog{f: f, writer: *handoff == "writer"}
	case *raftDir != "":
		r, err := openRaft(*raftDir)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		lg = &commitLog{raft: r}
	}
	if *handoff == "loop" {
		if lg == nil {
			fmt.Fprintln(os.Stderr, "-handoff loop needs -log or -raft")
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, serveLoop(flag.Arg(0), lg))
		os.Exit(1)
	}
	tcp, err := net.Listen("tcp", flag.Arg(0))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if lg != nil {
		lg.cond = sync.NewCond(&lg.mu)
		go lg.commit()
	}
	ln := sockio.Listener(tcp)
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if lg != nil {
			go serveDurable(c, lg)
		} else {
			go serve(c)
		}
	}
}

// serve answers every command of c with +OK (PING's and SET's reply; the
// load generator asks CONFIG GET first and takes an error-free answer).
func serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 16<<10)
	var out []byte
	for {
		if _, err := skipCommand(br, nil); err != nil {
			return
		}
		out = append(out, "+OK\r\n"...)
		if br.Buffered() == 0 {
			if _, err := c.Write(out); err != nil {
				return
			}
			out = out[:0]
		}
	}
}

// commitLog is the durable floor's log: commands gathered from every
// connection, written and synced by one goroutine.
type commitLog struct {
	f      *os.File
	raft   *raft.Raft // instead of f: the raft floor
	writer bool       // replies written by each connection's writer goroutine

	mu      sync.Mutex
	cond    *sync.Cond // the committer waits here for commands
	buf     []byte     // commands gathered since the last round
	waiting []*dconn   // connections with commands in buf (once each)
}

// dconn is a connection of the durable floor.
type dconn struct {
	c      net.Conn
	lg     *commitLog
	mu     sync.Mutex
	cond   *sync.Cond
	owed   int  // replies to write once the commands are synced (lg.mu)
	in     bool // in lg.waiting (lg.mu)
	due    int  // replies synced and not yet written (mu; writer hand-off)
	closed bool // the reader ended (mu)
	out    []byte
}

// add appends one command for c to the next round.
func (lg *commitLog) add(c *dconn, cmd []byte) {
	lg.mu.Lock()
	lg.buf = append(lg.buf, cmd...)
	c.owed++
	if !c.in {
		c.in = true
		lg.waiting = append(lg.waiting, c)
	}
	if len(lg.waiting) == 1 && c.owed == 1 {
		lg.cond.Signal()
	}
	lg.mu.Unlock()
}

// commit writes and syncs each round, then answers its commands.
func (lg *commitLog) commit() {
	var buf []byte
	var conns []*dconn
	var owed []int
	var out []byte
	for {
		lg.mu.Lock()
		for len(lg.waiting) == 0 {
			lg.cond.Wait()
		}
		buf, lg.buf = lg.buf, buf[:0]
		conns, lg.waiting = lg.waiting, conns[:0]
		owed = owed[:0]
		for _, c := range conns {
			owed = append(owed, c.owed)
			c.owed, c.in = 0, false
		}
		lg.mu.Unlock()
		if err := lg.append(buf); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		for i, c := range conns {
			if lg.writer {
				c.mu.Lock()
				c.due += owed[i]
				c.cond.Signal()
				c.mu.Unlock()
				continue
			}
			out = out[:0]
			for range owed[i] {
				out = append(out, "+OK\r\n"...)
			}
			c.c.Write(out) // an error ends the connection's reader
		}
	}
}

// append makes buf durable: in the log file, fdatasynced (as Redis's
// appendfsync always), or committed and applied through raft. raft keeps
// no hold on buf once its future is done.
func (lg *commitLog) append(buf []byte) error {
	if lg.raft != nil {
		return lg.raft.Apply(buf, 0).Error()
	}
	if _, err := lg.f.Write(buf); err != nil {
		return err
	}
	return syscall.Fdatasync(int(lg.f.Fd()))
}

// serveDurable reads c's commands into the log; the committer (or, with
// the writer hand-off, writeLoop) answers them.
func serveDurable(nc net.Conn, lg *commitLog) {
	c := &dconn{c: nc, lg: lg}
	c.cond = sync.NewCond(&c.mu)
	if lg.writer {
		go c.writeLoop()
		defer func() {
			c.mu.Lock()
			c.closed = true
			c.cond.Signal()
			c.mu.Unlock()
		}()
	}
	defer nc.Close()
	br := bufio.NewReaderSize(nc, 16<<10)
	cmd := make([]byte, 0, 512)
	for {
		var err error
		if cmd, err = skipCommand(br, cmd[:0]); err != nil {
			return
		}
		lg.add(c, cmd)
	}
}

// writeLoop writes the replies the committer made due.
func (c *dconn) writeLoop() {
	for {
		c.mu.Lock()
		for c.due == 0 && !c.closed {
			c.cond.Wait()
		}
		if c.due == 0 {
			c.mu.Unlock()
			return
		}
		n := c.due
		c.due = 0
		c.mu.Unlock()
		c.out = c.out[:0]
		for range n {
			c.out = append(c.out, "+OK\r\n"...)
		}
		if _, err := c.c.Write(c.out); err != nil {
			return
		}
	}
}

// skipCommand reads one RESP array of bulk strings, appending its bytes
// to keep when keep is not nil.
func skipCommand(br *bufio.Reader, keep []byte) ([]byte, error) {
	n, line, err := header(br, '*')
	if err != nil {
		return keep, err
	}
	if keep != nil {
		keep = append(keep, line...)
	}
	for range n {
		size, line, err := header(br, '$')
		if err != nil {
			return keep, err
		}
		if keep != nil {
			keep = append(keep, line...)
			at := len(keep)
			keep = append(keep, make([]byte, size+2)...)
			if _, err := io.ReadFull(br, keep[at:]); err != nil {
				return keep, err
			}
			continue
		}
		if _, err := br.Discard(size + 2); err != nil {
			return keep, err
		}
	}
	return keep, nil
}

func header(br *bufio.Reader, kind byte) (int, []byte, error) {
	line, err := br.ReadSlice('\n')
	if err != nil {
		return 0, nil, err
	}
	n, err := headerNumber(line, kind)
	return n, line, err
}

// headerNumber is the number of a header line "<kind><number>\r\n".
func headerNumber(line []byte, kind byte) (int, error) {
	if len(line) < 4 || line[0] != kind {
		return 0, errors.New("not a RESP command")
	}
	n, err := strconv.Atoi(string(line[1 : len(line)-2]))
	if err != nil || n < 0 || n > 64<<20 {
		return 0, errors.New("bad length")
	}
	return n, nil
}
