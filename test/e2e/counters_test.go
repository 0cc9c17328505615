package e2e

import (
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	goredis "github.com/redis/go-redis/v9"

	"github.com/mqkv/mqkv/internal/server"
)

// counted runs clients goroutines of each increments of one counter
// (incr, which returns the count it left) and checks that every one
// succeeded and saw a count of its own, 1 to clients*each: no increment
// lost, none failed, none applied twice.
func counted(t *testing.T, clients, each int, incr func() (uint64, error)) {
	t.Helper()
	seen := make([]bool, clients*each+1)
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				n, err := incr()
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				if n == 0 || n >= uint64(len(seen)) || seen[n] {
					mu.Unlock()
					errs <- errors.New("a count seen twice, or out of range: " + strconv.FormatUint(n, 10))
					return
				}
				seen[n] = true
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// memcached's incr and decr are applied by the log: 50 clients
// incrementing one key all succeed, each with a count of its own (read and
// written back on condition, most of them failed with "the key changed too
// often"), and the key keeps its flags.
func TestMemcacheIncrementsUnderContention(t *testing.T) {
	s := startServer(t, inMemory(), withMemcache())
	mc := memcacheClient(t, s)
	mc.MaxIdleConns = 50
	k := strings.ReplaceAll(uniqueKey(t), "/", ":")
	if err := mc.Set(&memcache.Item{Key: k, Value: []byte("0"), Flags: 9}); err != nil {
		t.Fatal(err)
	}
	counted(t, 50, 40, func() (uint64, error) { return mc.Increment(k, 1) })
	it, err := mc.Get(k)
	if err != nil || string(it.Value) != "2000" || it.Flags != 9 {
		t.Fatalf("after 2,000 increments: %+v %v", it, err)
	}
	if n, err := mc.Decrement(k, 1999); err != nil || n != 1 {
		t.Fatalf("decr: %d %v", n, err)
	}
	if n, err := mc.Decrement(k, 5); err != nil || n != 0 {
		t.Fatalf("decr below 0: %d %v, want 0", n, err)
	}
}

// INCR, DECR, INCRBY and DECRBY answer as Redis does, byte for byte in
// their errors; concurrent INCRs all count; an MQTT observer hears each
// and reads the number.
func TestRESPCounters(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	ctx, rc, k, notes := respObserved(t, s)
	obs := newSDKClient(t, s)
	if n, err := rc.Incr(ctx, k).Result(); err != nil || n != 1 {
		t.Fatalf("INCR of a missing key: %d %v", n, err)
	}
	if n := recv(t, notes, 10*time.Second); n.Operation != "SET" || n.Value != "1" {
		t.Fatalf("notification %+v", n)
	}
	if r, err := obs.store.Get(ctx, k); err != nil || r.Value != "1" {
		t.Fatalf("MQTT GET of the counter: %+v %v", r, err)
	}
	for _, c := range []struct {
		cmd  []any
		want int64
	}{{[]any{"INCRBY", k, "10"}, 11}, {[]any{"DECR", k}, 10}, {[]any{"DECRBY", k, "25"}, -15}, {[]any{"incrby", k, "-5"}, -20}} {
		if n, err := rc.Do(ctx, c.cmd...).Int64(); err != nil || n != c.want {
			t.Fatalf("%v: %d %v, want %d", c.cmd, n, err, c.want)
		}
	}
	rc.Set(ctx, k+"-text", "abc", 0)
	rc.Set(ctx, k+"-max", "9223372036854775807", 0)
	if err := rc.Set(ctx, k+"-ttl", "5", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cmd []any
		err string
	}{
		{[]any{"INCR", k + "-text"}, "ERR value is not an integer or out of range"},
		{[]any{"INCRBY", k, "1.5"}, "ERR value is not an integer or out of range"},
		{[]any{"INCRBY", k, "007"}, "ERR value is not an integer or out of range"},
		{[]any{"INCR", k + "-max"}, "ERR increment or decrement would overflow"},
		{[]any{"DECRBY", k, "-9223372036854775808"}, "ERR decrement would overflow"},
		{[]any{"INCR"}, "ERR wrong number of arguments for 'incr' command"},
		{[]any{"INCRBY", k}, "ERR wrong number of arguments for 'incrby' command"},
	} {
		if err := rc.Do(ctx, c.cmd...).Err(); err == nil || err.Error() != c.err {
			t.Fatalf("%v: %v, want %q", c.cmd, err, c.err)
		}
	}
	if v, _ := rc.Get(ctx, k).Result(); v != "-20" {
		t.Fatalf("refused increments changed the counter: %q", v)
	}
	// The key's expiry stays, as Redis keeps it.
	if n, err := rc.Incr(ctx, k+"-ttl").Result(); err != nil || n != 6 {
		t.Fatalf("INCR of a key with a TTL: %d %v", n, err)
	}
	if d, err := rc.PTTL(ctx, k+"-ttl").Result(); err != nil || d <= 0 || d > time.Minute {
		t.Fatalf("PTTL after INCR: %v %v", d, err)
	}
	// A pipeline of them (in flight together, as SETs are) is answered in
	// order, each with the count it left.
	pipe := rc.Pipeline()
	var cmds []*goredis.IntCmd
	for i := range 100 {
		if i%2 == 0 {
			cmds = append(cmds, pipe.Incr(ctx, k+"-pipe"))
		} else {
			cmds = append(cmds, pipe.IncrBy(ctx, k+"-pipe", 2))
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	for i, c := range cmds {
		if want := int64(i/2*3 + 1 + i%2*2); c.Val() != want {
			t.Fatalf("pipelined counter %d: %d, want %d", i, c.Val(), want)
		}
	}
	// Fifty clients at once, each on a connection of its own.
	pool := goredis.NewClient(&goredis.Options{Addr: s.RESPAddr(), PoolSize: 50, MaxRetries: -1, ReadTimeout: 10 * time.Second})
	defer pool.Close()
	counted(t, 50, 40, func() (uint64, error) {
		n, err := pool.Incr(ctx, k+"-hot").Result()
		return uint64(n), err
	})
	if v, err := rc.Get(ctx, k+"-hot").Result(); err != nil || v != "2000" {
		t.Fatalf("after 2,000 INCRs: %q %v", v, err)
	}
}

// In a cluster that a member of an earlier release keeps at protocol 4,
// the counters and the value ops (protocol 6) are refused over RESP (a
// member could not read them), Redis's SET XX and memcached's incr,
// append, prepend, replace and touch go as before, reading and writing
// on condition.
func TestCountersWaitForTheirProtocol(t *testing.T) {
	skipInCluster(t, "starts its own cluster")
	t.Parallel()
	gateways := func(c *server.Config) { c.RESPListen, c.MemcacheListen = "127.0.0.1:0", "127.0.0.1:0" }
	// The cluster starts at its creator's protocol, and stays there while
	// the creator speaks no higher.
	old := startNode(t, "cp1", nil, func(c *server.Config) { c.Cluster.Protocols = [2]int{1, 4} })
	first := startNode(t, "cp2", []string{old.ClusterAddr()}, gateways)
	startNode(t, "cp3", []string{old.ClusterAddr()}, nil)
	awaitSettled(t, first)
	if p := first.Node().Status().Protocol; p != 4 || first.Node().Arithmetic() {
		t.Fatalf("protocol %d, counters %v", p, first.Node().Arithmetic())
	}
	ctx := ctxFor(t, 30*time.Second)
	rc := goredis.NewClient(&goredis.Options{Addr: first.RESPAddr(), MaxRetries: -1})
	defer rc.Close()
	if err := rc.Incr(ctx, "cp/n").Err(); err == nil || !strings.Contains(err.Error(), "cluster protocol 5") {
		t.Fatalf("INCR at protocol 4: %v", err)
	}
	mc := memcache.New(first.MemcacheAddr())
	mc.Timeout = 10 * time.Second
	if err := mc.Set(&memcache.Item{Key: "cp:n", Value: []byte("41"), Flags: 3}); err != nil {
		t.Fatal(err)
	}
	if n, err := mc.Increment("cp:n", 1); err != nil || n != 42 {
		t.Fatalf("incr at protocol 4: %d %v", n, err)
	}
	if it, err := mc.Get("cp:n"); err != nil || string(it.Value) != "42" || it.Flags != 3 {
		t.Fatalf("after incr at protocol 4: %+v %v", it, err)
	}
	if first.Node().ValueOps() {
		t.Fatal("value ops at protocol 4")
	}
	if err := rc.Append(ctx, "cp/a", "x").Err(); err == nil || !strings.Contains(err.Error(), "cluster protocol 6") {
		t.Fatalf("APPEND at protocol 4: %v", err)
	}
	if ok, err := rc.SetXX(ctx, "cp/s", "v", 0).Result(); err != nil || ok {
		t.Fatalf("SET XX of a missing key at protocol 4: %v %v", ok, err)
	}
	rc.Set(ctx, "cp/s", "v", 0)
	if ok, err := rc.SetXX(ctx, "cp/s", "w", 0).Result(); err != nil || !ok {
		t.Fatalf("SET XX at protocol 4: %v %v", ok, err)
	}
	if err := mc.Append(&memcache.Item{Key: "cp:n", Value: []byte("3")}); err != nil {
		t.Fatal(err)
	}
	if err := mc.Prepend(&memcache.Item{Key: "cp:n", Value: []byte("1")}); err != nil {
		t.Fatal(err)
	}
	if err := mc.Replace(&memcache.Item{Key: "cp:x", Value: []byte("1")}); !errors.Is(err, memcache.ErrNotStored) {
		t.Fatalf("replace of a missing key at protocol 4: %v", err)
	}
	if err := mc.Touch("cp:n", 60); err != nil {
		t.Fatal(err)
	}
	if it, err := mc.Get("cp:n"); err != nil || string(it.Value) != "1423" || it.Flags != 3 {
		t.Fatalf("after append and prepend at protocol 4: %+v %v", it, err)
	}
}
