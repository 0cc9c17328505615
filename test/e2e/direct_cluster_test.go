package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/mqkv/mqkv/client"
	"github.com/mqkv/mqkv/internal/server"
)

// forwarded sums, over the nodes, the writes and key reads they sent on
// to another member's leader.
func forwarded(nodes []*server.Server) (writes, reads int64) {
	for _, n := range nodes {
		w, r := n.Node().Forwarded()
		writes += w
		reads += r
	}
	return writes, reads
}

// TestDirectSkipsTheHop: a client with Direct sends each key's requests
// to its group's leader, so no member forwards them, where a client
// without it, on one member of three, has about two in three forwarded;
// what either writes, the other reads. When a member it has a direct
// connection to is closed, its requests go on (through the first
// connection, then to the new leaders).
func TestDirectSkipsTheHop(t *testing.T) {
	skipInCluster(t, "starts its own cluster")
	t.Parallel()
	nodes := startNodes(t, "dh", 3, nil)
	ctx := ctxFor(t, 90*time.Second)
	dial := func(direct bool) *client.Client {
		c, err := client.Dial(ctx, client.Config{URL: "mqtt://" + nodes[0].Addr(), Direct: direct, Timeout: 3 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	plain, direct := dial(false), dial(true)
	const n = 90
	key := func(round, i int) []byte { return []byte(fmt.Sprintf("direct/%d/%d", round, i)) }
	// round sets n keys through c and reads them back through other,
	// and returns the writes and reads forwarded meanwhile.
	round := func(c, other *client.Client, r int) (int64, int64) {
		w0, r0 := forwarded(nodes)
		for i := range n {
			if _, err := c.Set(ctx, key(r, i), []byte(fmt.Sprint(r, i))); err != nil {
				t.Fatalf("SET %s: %v", key(r, i), err)
			}
		}
		for i := range n {
			if v, err := c.Get(ctx, key(r, i)); err != nil || string(v.Value) != fmt.Sprint(r, i) {
				t.Fatalf("GET %s = %q, %v", key(r, i), v.Value, err)
			}
		}
		w1, r1 := forwarded(nodes)
		for i := range n {
			if v, err := other.Get(ctx, key(r, i)); err != nil || string(v.Value) != fmt.Sprint(r, i) {
				t.Fatalf("GET %s through the other client = %q, %v", key(r, i), v.Value, err)
			}
		}
		return w1 - w0, r1 - r0
	}

	fw, fr := round(plain, direct, 0)
	t.Logf("without Direct: %d of %d writes and %d of %d reads forwarded", fw, n, fr, n)
	if fw < n/3 || fr < n/3 {
		t.Fatalf("without Direct, %d writes and %d reads of %d forwarded: expected about two in three (the test sees nothing)", fw, fr, n)
	}
	// The routes come a moment after Dial, the direct connections after
	// them: until then requests take the first connection.
	eventuallyWithin(t, 20*time.Second, "requests to go direct", func() bool {
		w0, r0 := forwarded(nodes)
		for i := range 12 {
			if _, err := direct.Get(ctx, key(0, i)); err != nil {
				t.Fatal(err)
			}
		}
		w1, r1 := forwarded(nodes)
		return w1 == w0 && r1 == r0
	})
	fw, fr = round(direct, plain, 1)
	t.Logf("with Direct: %d of %d writes and %d of %d reads forwarded", fw, n, fr, n)
	if fw > n/20 || fr > n/20 {
		t.Fatalf("with Direct, %d writes and %d reads of %d were forwarded", fw, fr, n)
	}

	// A member the client holds a direct connection to is closed: its
	// groups elect other leaders, and the client's requests get through
	// (some may fail while there is no leader).
	nodes[1].Close()
	deadline := time.Now().Add(30 * time.Second)
	for ok, i := 0, 0; ok < 2*n; i++ {
		if time.Now().After(deadline) {
			t.Fatalf("after a member was closed, %d SETs in a row succeeded within 30 s, want %d", ok, 2*n)
		}
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := direct.Set(sctx, key(2, i%n), []byte("after"))
		cancel()
		if err != nil {
			ok = 0
			continue
		}
		ok++
	}
	survivors := []*server.Server{nodes[0], nodes[2]}
	w0, _ := forwarded(survivors)
	eventuallyWithin(t, 20*time.Second, "requests to go direct to the new leaders", func() bool {
		for i := range 12 {
			if _, err := direct.Set(ctx, key(3, i), []byte("x")); err != nil {
				t.Fatal(err)
			}
		}
		w1, _ := forwarded(survivors)
		defer func() { w0 = w1 }()
		return w1 == w0
	})
}
