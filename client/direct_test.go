package client

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/store"
)

// The client must put a key in the group the servers do, or every
// direct request takes the hop it was meant to save.
func TestRoutesFollowTheServersPartitions(t *testing.T) {
	tab := &routeTable{partitions: store.Partitions, leaders: []string{"a:1", "b:2", "c:3", "d:4", "e:5"}}
	for i := range 2000 {
		k := []byte(fmt.Sprintf("key/%d", i))
		if got, want := tab.addrOf(k), tab.leaders[int(store.Partition(k))%len(tab.leaders)]; got != want {
			t.Fatalf("key %s: route %s, the servers' group's leader is %s", k, got, want)
		}
	}
	if a := (&routeTable{partitions: store.Partitions, leaders: []string{"a:1"}}).addrOf([]byte("k")); a != "" {
		t.Fatalf("one group routes to %q: its requests should take the first connection", a)
	}
}

func TestParseRoutes(t *testing.T) {
	good := resp.AppendArrayHeader(nil, 3)
	good = resp.AppendInt(good, 4096)
	good = resp.AppendBulk(good, []byte("127.0.0.1:1883"))
	good = resp.AppendBulk(good, nil)
	v, err := resp.ParseReply(good)
	if err != nil {
		t.Fatal(err)
	}
	tab, err := parseRoutes(v)
	if err != nil || tab.partitions != 4096 || len(tab.leaders) != 2 || tab.leaders[0] != "127.0.0.1:1883" || tab.leaders[1] != "" {
		t.Fatalf("parseRoutes = %+v, %v", tab, err)
	}
	for _, bad := range []string{
		"+OK\r\n",
		"*1\r\n:4096\r\n",                    // no group
		"*2\r\n:0\r\n$0\r\n\r\n",             // no partitions
		"*2\r\n:-5\r\n$0\r\n\r\n",            // negative
		"*2\r\n$4\r\n4096\r\n$0\r\n\r\n",     // not an integer
		"*2\r\n:4096\r\n:7\r\n",              // not an address
		"*2\r\n:4096\r\n$9\r\nno-a-port\r\n", // not host:port
	} {
		v, err := resp.ParseReply([]byte(bad))
		if err != nil {
			t.Fatalf("%q: %v", bad, err)
		}
		if tab, err := parseRoutes(v); err == nil {
			t.Fatalf("parseRoutes(%q) = %+v, want an error", bad, tab)
		}
	}
}

// A node on its own answers ROUTES with one group and no address: a
// client with Direct sends everything through its one connection.
func TestDirectOnANodeOnItsOwn(t *testing.T) {
	s := memoryServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := Dial(ctx, Config{URL: "mqtt://" + s.Addr(), Direct: true})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r, err := c.request(ctx, [][]byte{[]byte("ROUTES")})
	if err != nil {
		t.Fatal(err)
	}
	tab, err := parseRoutes(r.Value)
	if err != nil || tab.partitions != store.Partitions || len(tab.leaders) != 1 {
		t.Fatalf("ROUTES on a node on its own = %+v, %v", tab, err)
	}
	if _, err := c.Set(ctx, []byte("k"), []byte("v")); err != nil {
		t.Fatal(err)
	}
	if v, err := c.Get(ctx, []byte("k")); err != nil || string(v.Value) != "v" {
		t.Fatalf("GET = %q, %v", v.Value, err)
	}
	c.direct.mu.Lock()
	n := len(c.direct.conns) + len(c.direct.dialing)
	c.direct.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d direct connections to a node on its own", n)
	}
	if _, err := Dial(ctx, Config{URL: "ws://" + s.Addr() + "/mqtt", Direct: true}); err == nil {
		t.Fatal("Direct over a websocket URL: no error")
	}
}
