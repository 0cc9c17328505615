package cluster

import (
	"bytes"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/replica"
)

// BenchmarkAppendEntries: AppendEntries of batches of SETs (eight entries
// of 300 bytes each) from a leader's group transports to a follower's,
// over a real link (TLS, yamux), the follower answering at once: raft's
// msgpack on the groups' streams against the binary form on the call
// streams. With one group, one at a time; with eight, each group's
// replication going on at once, as a node leading eight groups does (the
// binary form then carries several groups' in one message). cpu-ns/op is
// the CPU both nodes took per AppendEntries.
func BenchmarkAppendEntries(b *testing.B) {
	for _, groups := range []int{1, 8} {
		for _, binary := range []bool{false, true} {
			b.Run(fmt.Sprintf("groups=%d/binary=%v", groups, binary), func(b *testing.B) {
				benchmarkAppendEntries(b, groups, binary)
			})
		}
	}
}

func benchmarkAppendEntries(b *testing.B, groups int, binary bool) {
	links := make([]*peer.Link, 2)
	for i := range links {
		l, err := peer.Listen(peer.Config{NodeID: fmt.Sprint("n", i+1), Listen: "127.0.0.1:0", Secret: []byte("test-secret-0123456789"), Logger: quiet()})
		if err != nil {
			b.Fatal(err)
		}
		defer l.Close()
		links[i] = l
	}
	tr := func(l *peer.Link, g int) *groupTransport {
		u := newGroupTransport(uint32(g), raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
			Stream: l.StreamLayer(uint32(g)), MaxPool: 3, Timeout: appendTimeout, Logger: replica.RaftLogger("raft-net", quiet()),
		}))
		b.Cleanup(func() { u.Close() })
		return u
	}
	to := &appender{addr: links[1].Addr(), call: links[0].CallBytes}
	leaders, followers := make([]*groupTransport, groups), make([]*groupTransport, groups)
	for g := range groups {
		leaders[g], followers[g] = tr(links[0], g), tr(links[1], g)
		leaders[g].binary = func() bool { return binary }
		leaders[g].send = func(_ string, g uint32, req *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
			return to.append(g, req, resp)
		}
		go func() {
			for rpc := range followers[g].Consumer() {
				req := rpc.Command.(*raft.AppendEntriesRequest)
				rpc.Respond(&raft.AppendEntriesResponse{Term: req.Term, LastLog: req.PrevLogEntry + uint64(len(req.Entries)), Success: true}, nil)
			}
		}()
	}
	links[1].HandleCalls(func(_ string, body []byte) []byte {
		reqs, err := decodeAppends(body)
		if err != nil {
			return appendAppendReplies(nil, nil)
		}
		answers := make([]appendAnswer, len(reqs))
		var wg sync.WaitGroup
		for i, r := range reqs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				answers[i] = followers[r.g].serve(r.req)
			}()
		}
		wg.Wait()
		return appendAppendReplies(nil, answers)
	})
	request := func() *raft.AppendEntriesRequest {
		req := &raft.AppendEntriesRequest{
			RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("n1"), Addr: []byte(links[0].Addr())},
			Term:      3, Leader: []byte(links[0].Addr()), LeaderCommitIndex: 1,
		}
		for i := range 8 {
			req.Entries = append(req.Entries, &raft.Log{Index: uint64(i + 2), Term: 3, Type: raft.LogCommand, Data: bytes.Repeat([]byte{'v'}, 300), AppendedAt: time.Now()})
		}
		return req
	}
	var left atomic.Int64
	left.Store(int64(b.N))
	b.ResetTimer()
	start := cpuTime()
	var wg sync.WaitGroup
	for g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := request()
			for i := 0; left.Add(-1) >= 0; i++ {
				req.PrevLogEntry = uint64(i)
				var resp raft.AppendEntriesResponse
				if err := leaders[g].AppendEntries("n2", raft.ServerAddress(links[1].Addr()), req, &resp); err != nil || !resp.Success {
					b.Errorf("%v %+v", err, resp)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
	if binary {
		b.ReportMetric(float64(to.carried.Load())/float64(to.messages.Load()), "appends/msg")
	}
}

// cpuTime is the CPU time this process used so far, both ends of the
// link being in it.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
