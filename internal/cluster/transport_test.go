package cluster

import (
	"io"
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
	u := &unpipelined{NetworkTransport: newTCP()}
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
