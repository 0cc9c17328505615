package cluster

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// A heartbeat runs on the transport's connection goroutine, out of raft's
// reach: Close must wait for one in flight, and none may start after it,
// or raft writes a term to a journal the node has closed.
func TestTransportCloseWaitsForHeartbeats(t *testing.T) {
	newTCP := func() *raft.NetworkTransport {
		tr, err := raft.NewTCPTransport("127.0.0.1:0", nil, 2, 5*time.Second, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		return tr
	}
	u := newGroupTransport(0, newTCP())
	sender := newTCP()
	defer sender.Close()

	entered := make(chan struct{}, 4)
	release := make(chan struct{})
	u.SetHeartbeatHandler(func(rpc raft.RPC) {
		entered <- struct{}{}
		<-release
		rpc.Respond(&raft.AppendEntriesResponse{Success: true}, nil)
	})
	heartbeat := func() error {
		req := &raft.AppendEntriesRequest{
			RPCHeader: raft.RPCHeader{Addr: []byte(sender.LocalAddr())},
			Term:      3,
		}
		return sender.AppendEntries("n1", u.LocalAddr(), req, &raft.AppendEntriesResponse{})
	}
	sent := make(chan error, 1)
	go func() { sent <- heartbeat() }()
	<-entered

	closed := make(chan struct{})
	go func() { u.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while a heartbeat was being handled")
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	<-closed
	if err := <-sent; err != nil {
		t.Fatalf("heartbeat in flight at Close: %v", err)
	}
	// A later heartbeat never reaches raft (the listener is closed too, so
	// it may not even connect).
	_ = heartbeat()
	select {
	case <-entered:
		t.Fatal("a heartbeat reached raft after Close")
	default:
	}
}

// TestAppenderBatches: the AppendEntries of groups replicating at once go
// in shared messages, never more than appendsInFlight on their way, each
// group getting its own answer; a failed message fails each of its
// AppendEntries; and a heartbeat goes at once, not behind a message that
// waits on the follower.
func TestAppenderBatches(t *testing.T) {
	var mu sync.Mutex
	inFlight, most, biggest := 0, 0, 0
	hold := make(chan struct{})
	fail := false
	a := &appender{addr: "n2", call: func(ctx context.Context, _ string, body []byte) ([]byte, error) {
		reqs, err := decodeAppends(body)
		if err != nil {
			return nil, err
		}
		if len(reqs) == 1 && isHeartbeat(reqs[0].req) {
			return appendAppendReplies(nil, []appendAnswer{{resp: &raft.AppendEntriesResponse{Term: reqs[0].req.Term, Success: true}}}), nil
		}
		mu.Lock()
		inFlight++
		most, biggest = max(most, inFlight), max(biggest, len(reqs))
		failing := fail
		mu.Unlock()
		<-hold
		time.Sleep(200 * time.Microsecond)
		mu.Lock()
		inFlight--
		mu.Unlock()
		if failing {
			return nil, errors.New("link down")
		}
		answers := make([]appendAnswer, len(reqs))
		for i, r := range reqs {
			answers[i].resp = &raft.AppendEntriesResponse{Term: r.req.Term, LastLog: uint64(r.g)*1000 + r.req.PrevLogEntry, Success: true}
		}
		return appendAppendReplies(nil, answers), nil
	}}
	// A heartbeat while messages wait on the follower.
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var resp raft.AppendEntriesResponse
		a.append(9, &raft.AppendEntriesRequest{Term: 1, PrevLogEntry: 5, LeaderCommitIndex: 4}, &resp)
	}()
	eventuallyT(t, 5*time.Second, "a message on its way", func() bool { mu.Lock(); defer mu.Unlock(); return inFlight == 1 })
	var hb raft.AppendEntriesResponse
	if err := a.append(9, &raft.AppendEntriesRequest{Term: 1, RPCHeader: raft.RPCHeader{Addr: []byte("n1")}}, &hb); err != nil || !hb.Success {
		t.Fatalf("a heartbeat behind a message: %v %+v", err, hb)
	}
	close(hold) // from here on the follower answers after a while (its disk)
	wg.Wait()
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				var resp raft.AppendEntriesResponse
				req := &raft.AppendEntriesRequest{Term: 2, PrevLogEntry: uint64(i + 1), LeaderCommitIndex: uint64(i)}
				if err := a.append(uint32(g), req, &resp); err != nil || resp.LastLog != uint64(g)*1000+uint64(i+1) {
					t.Errorf("group %d, append %d: %v, answered %+v", g, i, err, resp)
					return
				}
			}
		}()
	}
	wg.Wait()
	mu.Lock()
	if most > appendsInFlight || biggest < 2 {
		t.Errorf("at most %d messages on their way (limit %d), the largest of %d AppendEntries", most, appendsInFlight, biggest)
	}
	fail = true
	mu.Unlock()
	errs := make(chan error, 4)
	for g := range 4 {
		go func() {
			var resp raft.AppendEntriesResponse
			errs <- a.append(uint32(g), &raft.AppendEntriesRequest{Term: 2, PrevLogEntry: 1}, &resp)
		}()
	}
	for range 4 {
		if err := <-errs; err == nil || !strings.Contains(err.Error(), "link down") {
			t.Fatalf("an AppendEntries of a message that failed: %v", err)
		}
	}
}
