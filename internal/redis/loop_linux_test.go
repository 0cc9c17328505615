package redis

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/procs"
	"github.com/mqkv/mqkv/internal/statestore"
)

// serveLoop serves svc's RESP endpoint with a Loop on a loopback port,
// as a node on its own does, and returns a client connected to it.
func serveLoop(t *testing.T, svc gateway.Service) (*Server, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := New(Config{Service: svc})
	ep, err := s.ServeLoop(ln)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := net.Dial("tcp", ep.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cl.Close()
		done := make(chan struct{})
		go func() { ep.Close(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("the loop's Close did not return")
		}
	})
	return s, cl
}

func expectReplies(t *testing.T, br *bufio.Reader, cl net.Conn, want string) {
	t.Helper()
	got := make([]byte, len(want))
	cl.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(br, got); err != nil || string(got) != want {
		t.Fatalf("replies %q, %v; want %q", got, err, want)
	}
}

// A pipeline of writes, to one key twice (both in flight: see
// conn.inOrder), reads the loop runs itself, and commands it hands to a
// goroutine, is answered in command order, over and over.
func TestLoopAnswersAPipelineInOrder(t *testing.T) {
	_, cl := serveLoop(t, newAnswerer(t))
	br := bufio.NewReader(cl)
	pipe := encode("SET", "a", "1") + encode("SET", "a", "2") + encode("DEL", "a") + encode("PING") +
		encode("SET", "b", "1") + encode("ECHO", "x") + encode("CLIENT", "SETNAME", "n") + encode("SET", "a", "3")
	want := "+OK\r\n+OK\r\n:1\r\n+PONG\r\n+OK\r\n$1\r\nx\r\n+OK\r\n+OK\r\n"
	for range 20 {
		if _, err := io.WriteString(cl, pipe); err != nil {
			t.Fatal(err)
		}
		expectReplies(t, br, cl, want)
	}
}

// Many connections whose pipelines of reads are ready at once (the loop
// keeps their replies until it has read every one of them, see
// Loop.flush) each get all of theirs, in order, round after round; a
// write among the reads goes out after the replies kept before it.
func TestLoopConnectionsReadyTogether(t *testing.T) {
	_, first := serveLoop(t, newAnswerer(t))
	addr := first.RemoteAddr().String()
	const clients = 20
	conns := make([]net.Conn, clients)
	readers := make([]*bufio.Reader, clients)
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i], readers[i] = c, bufio.NewReader(c)
	}
	for round := range 30 {
		wants := make([]string, clients)
		for i, c := range conns {
			var pipe, want strings.Builder
			for j := range 16 {
				word := "c" + strconv.Itoa(i) + "r" + strconv.Itoa(round) + "n" + strconv.Itoa(j)
				pipe.WriteString(encode("ECHO", word))
				want.WriteString("$" + strconv.Itoa(len(word)) + "\r\n" + word + "\r\n")
				if j == 7 && i%2 == 0 {
					pipe.WriteString(encode("SET", "k"+strconv.Itoa(i), word))
					want.WriteString("+OK\r\n")
				}
			}
			pipe.WriteString(encode("PING"))
			want.WriteString("+PONG\r\n")
			if _, err := io.WriteString(c, pipe.String()); err != nil {
				t.Fatal(err)
			}
			wants[i] = want.String()
		}
		for i := range conns {
			expectReplies(t, readers[i], conns[i], wants[i])
		}
	}
}

// The loop's connections: see readBeforeAnEmptyCommand.
func TestLoopReadBeforeAnEmptyCommand(t *testing.T) {
	_, cl := serveLoop(t, newAnswerer(t))
	readBeforeAnEmptyCommand(t, cl)
}

// A command that arrives a byte at a time, and a value larger than a
// read, are run once whole.
func TestLoopCommandsAcrossReads(t *testing.T) {
	_, cl := serveLoop(t, newAnswerer(t))
	br := bufio.NewReader(cl)
	cmd := encode("SET", "k", "v") + "PING\r\n"
	for i := range len(cmd) {
		if _, err := io.WriteString(cl, cmd[i:i+1]); err != nil {
			t.Fatal(err)
		}
	}
	expectReplies(t, br, cl, "+OK\r\n+PONG\r\n")
	big := strings.Repeat("v", 3<<20)
	if _, err := io.WriteString(cl, encode("SET", "big", big)+encode("PING")); err != nil {
		t.Fatal(err)
	}
	expectReplies(t, br, cl, "+OK\r\n+PONG\r\n")
}

// Input that is not RESP is answered as Redis answers it, after the
// commands before it, and the connection is closed.
func TestLoopProtocolErrorEndsTheConnection(t *testing.T) {
	_, cl := serveLoop(t, newAnswerer(t))
	br := bufio.NewReader(cl)
	if _, err := io.WriteString(cl, encode("SET", "k", "v")+"*1\r\n$x\r\n"); err != nil {
		t.Fatal(err)
	}
	expectReplies(t, br, cl, "+OK\r\n-ERR Protocol error: invalid bulk length\r\n")
	cl.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := br.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("read %d bytes, %v after the error: want the connection closed", n, err)
	}
}

// A client that sends far more than it reads gets every reply, in order,
// once it reads: the loop does not wait for room in its socket (replies
// that do not fit go to the connection's writer), and reads no more from
// it while its replies are unwritten.
func TestLoopClientThatReadsLate(t *testing.T) {
	_, cl := serveLoop(t, newAnswerer(t))
	cl.(*net.TCPConn).SetReadBuffer(4096)
	const n = 50_000
	var pipe bytes.Buffer
	for i := range n {
		if i%2 == 0 {
			pipe.WriteString(encode("PING"))
		} else {
			pipe.WriteString(encode("SET", "k"+strconv.Itoa(i), "v"))
		}
	}
	sent := make(chan error, 1)
	go func() {
		_, err := cl.Write(pipe.Bytes())
		sent <- err
	}()
	br := bufio.NewReaderSize(cl, 4096)
	cl.SetReadDeadline(time.Now().Add(30 * time.Second))
	for i := range n {
		line, err := br.ReadString('\n')
		want := "+PONG\r\n"
		if i%2 == 1 {
			want = "+OK\r\n"
		}
		if err != nil || line != want {
			t.Fatalf("reply %d: %q, %v; want %q", i, line, err, want)
		}
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
}

// Close ends every connection, after their replies, and returns.
func TestLoopCloseEndsConnections(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := New(Config{Service: newAnswerer(t)})
	ep, err := s.ServeLoop(ln)
	if err != nil {
		t.Fatal(err)
	}
	var clients []net.Conn
	for range 8 {
		cl, err := net.Dial("tcp", ep.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		if _, err := io.WriteString(cl, encode("SET", "k", "v")); err != nil {
			t.Fatal(err)
		}
		expectReplies(t, bufio.NewReader(cl), cl, "+OK\r\n")
		clients = append(clients, cl)
	}
	if err := ep.Close(); err != nil {
		t.Fatal(err)
	}
	for i, cl := range clients {
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		if n, err := cl.Read(make([]byte, 1)); err == nil {
			t.Fatalf("client %d read %d bytes after Close", i, n)
		}
	}
	if c := s.Connected.Load(); c != 0 {
		t.Fatalf("%d connections counted after Close", c)
	}
}

// FuzzCommandLen: what commandLen measures, fed to the reader, reads as
// the same commands and the same error as the reader reading the bytes
// as a stream, whether the bytes come at once or in two parts.
func FuzzCommandLen(f *testing.F) {
	for _, s := range []string{
		encode("SET", "k", "v"), "PING\r\n", "*0\r\n", "*-1\r\n", "*1\r\n$x\r\n", "*2\r\n$3\r\nGET\r\n+k\r\n",
		"*1\r\n$3\r\nabcXY", "SET \"a b\" 'c'\r\n", "*99999999999999999999\r\n", encode("PING") + encode("ECHO", "x"),
		encode("SET", "k", strings.Repeat("v", maxCarved+1)), "*1\r\n$0\r\n\r\n", "*1\n$1\nx\r\n", "*2\r\n$1\r\nx\r\n",
		"*1\r\n$-1\r\n", "*1\r\n$1\r\nxy\r\n",
	} {
		f.Add([]byte(s), 3)
	}
	f.Fuzz(func(t *testing.T, b []byte, cut int) {
		stream := func() (cmds []string, last error) {
			rd := &reader{br: bufio.NewReaderSize(bytes.NewReader(b), readerSize), maxBulk: 1 << 20}
			for {
				args, err := rd.next()
				if err != nil {
					return cmds, err
				}
				cmds = append(cmds, fmt.Sprintf("%q", args))
			}
		}
		wantCmds, wantErr := stream()
		var pe ProtocolError
		wantProto := errors.As(wantErr, &pe)
		// The loop: all of b, or b in two parts.
		if cut < 0 {
			cut = -cut
		}
		cut %= len(b) + 1
		rd := &reader{br: bufio.NewReaderSize(nil, readerSize), maxBulk: 1 << 20}
		var in []byte
		var got []string
		for part, chunk := range [][]byte{b[:cut], b[cut:]} {
			in = append(in, chunk...)
			for {
				n := commandLen(in, 1<<20)
				if n == 0 {
					break
				}
				args, err := rd.command(in[:n])
				in = in[n:]
				if err != nil {
					if !errors.As(err, &pe) || !wantProto || err.Error() != wantErr.Error() {
						t.Fatalf("part %d: error %v, want %v (stream)", part, err, wantErr)
					}
					if !equal(got, wantCmds) {
						t.Fatalf("commands %q before the error, want %q", got, wantCmds)
					}
					return
				}
				got = append(got, fmt.Sprintf("%q", args))
			}
		}
		if wantProto {
			t.Fatalf("no error with %q left, want %v", in, wantErr)
		}
		if !equal(got, wantCmds) {
			t.Fatalf("commands %q, want %q", got, wantCmds)
		}
	})
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// A client that sends while the loop reads the others joins their round:
// the loop looks again before it waits for the round's writes (see run).
// Here the second client's SET is sent, and reported by epoll, only once
// the loop has read the first's.
func TestLoopRoundTakesLateClients(t *testing.T) {
	late := make(chan net.Conn, 1)
	round := make(chan int64, 1)
	sent := false
	testHookRead = func(l *Loop, again bool) {
		if l.round.writes.Load() == 0 {
			return // a round of reads: not the one this test makes
		}
		if again {
			select {
			case round <- l.round.writes.Load():
			default:
			}
			return
		}
		if sent {
			return
		}
		sent = true
		b := <-late
		if _, err := io.WriteString(b, encode("SET", "b", "1")); err != nil {
			return
		}
		// Until epoll reports b's bytes (level-triggered: the loop's
		// next look sees them too).
		evs := make([]unix.EpollEvent, 8)
		for end := time.Now().Add(10 * time.Second); time.Now().Before(end); {
			n, _ := unix.EpollWait(l.ep, evs, 100)
			for _, ev := range evs[:max(n, 0)] {
				if int(ev.Fd) != l.wake {
					return
				}
			}
		}
	}
	t.Cleanup(func() { testHookRead = nil }) // after the loop is closed
	h := newHolder()
	_, a := serveLoop(t, h)
	t.Cleanup(h.answerRest)
	b, err := net.Dial("tcp", a.RemoteAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	// b is the loop's before the round begins.
	io.WriteString(b, encode("PING"))
	bb := bufio.NewReader(b)
	expectReplies(t, bb, b, "+PONG\r\n")
	late <- b
	io.WriteString(a, encode("SET", "a", "1"))
	select {
	case n := <-round:
		if n != 2 {
			t.Fatalf("the round had %d writes in flight, want 2 (the late client's SET joins it)", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no round of writes")
	}
	for _, r := range h.take(t, 2) {
		h.answer(r)
	}
	expectReplies(t, bufio.NewReader(a), a, "+OK\r\n")
	expectReplies(t, bb, b, "+OK\r\n")
}

// A round of a deep pipeline's writes asks the scheduler's policy for
// every P (procs.Ask); a round of 50 does not.
func TestLoopDeepPipelineAsksForCores(t *testing.T) {
	var asks atomic.Int64
	askMore = func() { asks.Add(1) }
	// The writes in flight each time the loop has asked or not: answered
	// before it looks, a round's writes would ask for nothing.
	inFlight := make(chan int64, 64)
	testHookRead = func(l *Loop, again bool) {
		if n := l.round.writes.Load(); again && n > 0 {
			inFlight <- n
		}
	}
	t.Cleanup(func() { askMore, testHookRead = procs.Ask, nil }) // after the loop is closed
	h := &holder{reqs: make(chan *statestore.Request, 1024), taken: map[*statestore.Request]bool{}}
	_, cl := serveLoop(t, h)
	t.Cleanup(h.answerRest)
	br := bufio.NewReader(cl)
	for _, c := range []struct {
		writes int
		asks   bool
	}{{50, false}, {askWrites + 44, true}, {50, false}} {
		before := asks.Load()
		var pipe strings.Builder
		for i := range c.writes {
			pipe.WriteString(encode("SET", "k"+strconv.Itoa(i), "v"))
		}
		if _, err := io.WriteString(cl, pipe.String()); err != nil {
			t.Fatal(err)
		}
		reqs := h.take(t, c.writes)
		for n := int64(0); n < int64(c.writes); {
			select {
			case n = <-inFlight:
			case <-time.After(10 * time.Second):
				t.Fatalf("the loop never had the %d writes in flight", c.writes)
			}
		}
		for _, r := range reqs {
			h.answer(r)
		}
		expectReplies(t, br, cl, strings.Repeat("+OK\r\n", c.writes))
		// A PING is answered in a later turn of the loop than the one
		// that read the writes, and asked or not.
		io.WriteString(cl, encode("PING"))
		expectReplies(t, br, cl, "+PONG\r\n")
		if asked := asks.Load() > before; asked != c.asks {
			t.Fatalf("a round of %d writes: asked %v, want %v", c.writes, asked, c.asks)
		}
	}
}

// roundsHolder is a holder that takes rounds (statestore.Rounds): it
// logs, in order, each round begun ("b"), write sent ("w") and round sent
// ("s").
type roundsHolder struct {
	*holder
	log chan string
}

func (h roundsHolder) Do(r *statestore.Request, args [][]byte) { h.log <- "w"; h.holder.Do(r, args) }
func (h roundsHolder) RoundBegun()                             { h.log <- "b" }
func (h roundsHolder) RoundSent()                              { h.log <- "s" }

// The loop tells a service that takes rounds when it reads one and once
// all of it was sent: each write between the two (the rest of a round
// may then go to the log at once; replica.Group.RoundBegun).
func TestLoopTellsRounds(t *testing.T) {
	h := roundsHolder{newHolder(), make(chan string, 4096)}
	_, cl := serveLoop(t, h)
	t.Cleanup(h.answerRest)
	br := bufio.NewReader(cl)
	const n = 40
	for range 3 {
		var pipe strings.Builder
		for i := range n {
			pipe.WriteString(encode("SET", "k"+strconv.Itoa(i), "v"))
		}
		if _, err := io.WriteString(cl, pipe.String()); err != nil {
			t.Fatal(err)
		}
		// Until the round's last write is followed by its end.
		var seq []string
		for writes, open := 0, false; writes < n || open; {
			var e string
			select {
			case e = <-h.log:
			case <-time.After(10 * time.Second):
				t.Fatalf("rounds told %v", seq)
			}
			seq = append(seq, e)
			switch {
			case e == "b" && !open:
				open = true
			case e == "s" && open:
				open = false
			case e == "w" && open:
				writes++
			default:
				t.Fatalf("rounds told %v: %q out of place", seq, e)
			}
		}
		for _, r := range h.take(t, n) {
			h.answer(r)
		}
		expectReplies(t, br, cl, strings.Repeat("+OK\r\n", n))
	}
}
