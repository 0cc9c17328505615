package client

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/mqkv/mqkv/internal/server"
)

// BenchmarkClientGet is a GET through the client against an in-memory
// node in the same process, 64 requests in flight: with -cpuprofile, what
// the client's side of a request costs (the load generator of bench/peers
// spends more per request than etcd's and NATS's clients).
func BenchmarkClientGet(b *testing.B) {
	s := memoryServer(b)
	ctx := context.Background()
	var cs []*Client
	for range 8 {
		c, err := Dial(ctx, Config{URL: "mqtt://" + s.Addr()})
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		cs = append(cs, c)
	}
	for i := range 100 {
		cs[0].Set(ctx, []byte("k"+strconv.Itoa(i)), make([]byte, 256))
	}
	b.SetParallelism(8) // 16 goroutines a core
	b.ReportAllocs()
	var next atomic.Int64
	b.RunParallel(func(pb *testing.PB) {
		c := cs[int(next.Add(1))%len(cs)]
		i := 0
		for pb.Next() {
			if _, err := c.Get(ctx, []byte("k"+strconv.Itoa(i%100))); err != nil {
				b.Error(err)
				return
			}
			i++
		}
	})
}

// memoryServer is a node in memory in this process, closed when the test
// ends.
func memoryServer(tb testing.TB) *server.Server {
	tb.Helper()
	s, err := server.Start(server.Config{Listen: "127.0.0.1:0", InMemory: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { s.Close() })
	return s
}
