package e2e

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/Azure/iot-operations-sdks/go/services/statestore"
	goredis "github.com/redis/go-redis/v9"

	"github.com/mqkv/mqkv/internal/server"
)

// respObserved connects a RESP 3 client to s, and an MQTT client (the AIO
// Go SDK) that observes a new key k with KEYNOTIFY, its notifications on
// notes; ctx bounds the test.
func respObserved(t *testing.T, s *testServer) (ctx context.Context, rc *goredis.Client, k string, notes <-chan statestore.Notify[string, string]) {
	t.Helper()
	_, k, notes, ctx = observeOn(t, s, 30*time.Second)
	return ctx, redisClient(t, s, 3, "", ""), k, notes
}

// withRESP turns the Redis protocol endpoint on.
func withRESP() serverOption { return func(c *server.Config) { c.RESPListen = "127.0.0.1:0" } }

// redisClient is a go-redis client of s's RESP endpoint (RESP3, as go-redis
// speaks by default, unless proto says 2).
func redisClient(t *testing.T, s *testServer, proto int, user, pass string) *goredis.Client {
	t.Helper()
	c := goredis.NewClient(&goredis.Options{Addr: s.RESPAddr(), Protocol: proto, Username: user, Password: pass,
		DialTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second, MaxRetries: -1, PoolSize: 4})
	t.Cleanup(func() { c.Close() })
	return c
}

// The commands a Redis client sends map onto the store: what one protocol
// writes every other reads, and MQTT observers are notified.
func TestRESPWithAGoRedisClient(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	for _, proto := range []int{3, 2} {
		t.Run(fmt.Sprint("RESP", proto), func(t *testing.T) {
			ctx := ctxFor(t, 30*time.Second)
			rc := redisClient(t, s, proto, "", "")
			k := uniqueKey(t)
			if err := rc.Ping(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			if v, err := rc.Echo(ctx, "hi").Result(); err != nil || v != "hi" {
				t.Fatalf("ECHO: %q %v", v, err)
			}
			if _, err := rc.Get(ctx, k).Result(); !errors.Is(err, goredis.Nil) {
				t.Fatalf("GET of a missing key: %v, want redis.Nil", err)
			}
			if err := rc.Set(ctx, k, "v1", 0).Err(); err != nil {
				t.Fatal(err)
			}
			if v, err := rc.Get(ctx, k).Result(); err != nil || v != "v1" {
				t.Fatalf("GET: %q %v", v, err)
			}
			// NX on an existing key: not set (nil); XX: set.
			if ok, err := rc.SetNX(ctx, k, "v2", 0).Result(); err != nil || ok {
				t.Fatalf("SET NX on an existing key: %v %v", ok, err)
			}
			if ok, err := rc.SetXX(ctx, k, "v3", 0).Result(); err != nil || !ok {
				t.Fatalf("SET XX on an existing key: %v %v", ok, err)
			}
			if ok, err := rc.SetXX(ctx, k+"-none", "x", 0).Result(); err != nil || ok {
				t.Fatalf("SET XX on a missing key: %v %v", ok, err)
			}
			if n, _ := rc.Exists(ctx, k+"-none").Result(); n != 0 {
				t.Fatal("SET XX created a missing key")
			}
			// SET ... GET answers with the value replaced.
			if old, err := rc.SetArgs(ctx, k, "v4", goredis.SetArgs{Get: true}).Result(); err != nil || old != "v3" {
				t.Fatalf("SET GET: %q %v", old, err)
			}
			// Expiry: EX and PX, read back by TTL and PTTL.
			if err := rc.Set(ctx, k+"-ex", "x", 100*time.Second).Err(); err != nil {
				t.Fatal(err)
			}
			if d, err := rc.TTL(ctx, k+"-ex").Result(); err != nil || d < 98*time.Second || d > 100*time.Second {
				t.Fatalf("TTL: %v %v", d, err)
			}
			if d, err := rc.PTTL(ctx, k).Result(); err != nil || d != -1 {
				t.Fatalf("PTTL of a key without expiry: %v %v", d, err)
			}
			if d, err := rc.PTTL(ctx, k+"-none").Result(); err != nil || d != -2 {
				t.Fatalf("PTTL of a missing key: %v %v", d, err)
			}
			if err := rc.Set(ctx, k+"-px", "x", 300*time.Millisecond).Err(); err != nil {
				t.Fatal(err)
			}
			eventually(t, "a PX key to expire", func() bool { return errors.Is(rc.Get(ctx, k+"-px").Err(), goredis.Nil) })
			// MGET, EXISTS and DEL of several keys.
			rc.Set(ctx, k+"-b", "vb", 0)
			if vals, err := rc.MGet(ctx, k, k+"-none", k+"-b").Result(); err != nil || !slices.Equal(vals, []any{"v4", nil, "vb"}) {
				t.Fatalf("MGET: %v %v", vals, err)
			}
			if n, err := rc.Exists(ctx, k, k+"-none", k+"-b", k).Result(); err != nil || n != 3 {
				t.Fatalf("EXISTS: %d %v", n, err)
			}
			if n, err := rc.Del(ctx, k, k+"-none", k+"-b").Result(); err != nil || n != 2 {
				t.Fatalf("DEL: %d %v", n, err)
			}
			// Connection commands.
			if err := rc.Do(ctx, "SELECT", "0").Err(); err != nil {
				t.Fatal(err)
			}
			if err := rc.Do(ctx, "SELECT", "1").Err(); err == nil || !strings.Contains(err.Error(), "DB index is out of range") {
				t.Fatalf("SELECT 1: %v", err)
			}
			if err := rc.Do(ctx, "FLUSHALL").Err(); err == nil || !strings.HasPrefix(err.Error(), "ERR unknown command 'FLUSHALL'") {
				t.Fatalf("an unknown command: %v", err)
			}
			if err := rc.Do(ctx, "GET").Err(); err == nil || err.Error() != "ERR wrong number of arguments for 'get' command" {
				t.Fatalf("GET without a key: %v", err)
			}
			info, err := rc.Info(ctx).Result()
			if err != nil || !strings.Contains(info, "redis_version:") || !strings.Contains(info, "connected_clients:") || !strings.Contains(info, "# Keyspace") {
				t.Fatalf("INFO: %q %v", info, err)
			}
		})
	}
}

// A pipeline of many commands is answered in order, reads seeing the
// writes before them.
func TestRESPPipeline(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	ctx := ctxFor(t, 30*time.Second)
	rc := redisClient(t, s, 3, "", "")
	k := uniqueKey(t)
	pipe := rc.Pipeline()
	var gets []*goredis.StringCmd
	for i := range 100 {
		pipe.Set(ctx, k, fmt.Sprint(i), 0)
		gets = append(gets, pipe.Get(ctx, k))
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	for i, g := range gets {
		if v, err := g.Result(); err != nil || v != fmt.Sprint(i) {
			t.Fatalf("GET %d of the pipeline: %q %v", i, v, err)
		}
	}
	// Writes to distinct keys are in flight together; the reads after
	// them, and a DEL of one of them, still see them in order.
	pipe = rc.Pipeline()
	var sets []*goredis.StatusCmd
	for i := range 300 {
		sets = append(sets, pipe.Set(ctx, fmt.Sprint(k, "-", i), fmt.Sprint(i), 0))
	}
	del := pipe.Del(ctx, k+"-7")
	nx := pipe.SetNX(ctx, k+"-8", "again", 0)
	gets = gets[:0]
	for i := range 300 {
		gets = append(gets, pipe.Get(ctx, fmt.Sprint(k, "-", i)))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, goredis.Nil) {
		t.Fatal(err)
	}
	for i, c := range sets {
		if err := c.Err(); err != nil {
			t.Fatalf("SET %d: %v", i, err)
		}
	}
	if n, err := del.Result(); err != nil || n != 1 {
		t.Fatalf("DEL in the pipeline: %d %v", n, err)
	}
	if ok, err := nx.Result(); err != nil || ok {
		t.Fatalf("SET NX of a key set earlier in the pipeline: %v %v", ok, err)
	}
	for i, g := range gets {
		v, err := g.Result()
		if i == 7 {
			if !errors.Is(err, goredis.Nil) {
				t.Fatalf("GET of the key deleted in the pipeline: %q %v", v, err)
			}
			continue
		}
		if err != nil || v != fmt.Sprint(i) {
			t.Fatalf("GET %d after the pipeline's SETs: %q %v", i, v, err)
		}
	}
}

// Pipelined writes to one key, with no read between them, are in flight
// together (a node on its own takes them into its log in the order sent):
// they are applied in that order, as the value read after them and the
// notifications an MQTT observer gets show, and a SET NX among them sees
// the writes before it, as SET ... GET's previous values do.
func TestRESPPipelinedWritesToOneKey(t *testing.T) {
	ctx, rc, k, notes := respObserved(t, startServer(t, withRESP()))
	const n = 200
	for round := range 3 {
		pipe := rc.Pipeline()
		var sets []*goredis.StatusCmd
		var nx *goredis.BoolCmd
		for i := range n {
			sets = append(sets, pipe.Set(ctx, k, fmt.Sprint(round, ":", i), 0))
			if i == n/2 {
				nx = pipe.SetNX(ctx, k, "nx", 0)
			}
		}
		if _, err := pipe.Exec(ctx); err != nil {
			t.Fatal(err)
		}
		for i, c := range sets {
			if err := c.Err(); err != nil {
				t.Fatalf("round %d, SET %d: %v", round, i, err)
			}
		}
		if ok, err := nx.Result(); err != nil || ok {
			t.Fatalf("round %d: SET NX after SETs of the key in the same pipeline: %v %v", round, ok, err)
		}
		if v, err := rc.Get(ctx, k).Result(); err != nil || v != fmt.Sprint(round, ":", n-1) {
			t.Fatalf("round %d: GET after the pipeline: %q %v, want the last value", round, v, err)
		}
		// The SDK may hand notifications over out of order (it receives
		// them concurrently): their versions give the order applied.
		got := make([]statestore.Notify[string, string], n)
		for i := range got {
			got[i] = recv(t, notes, 10*time.Second)
		}
		slices.SortFunc(got, func(a, b statestore.Notify[string, string]) int { return a.Version.Compare(b.Version) })
		for i, nt := range got {
			if want := fmt.Sprint(round, ":", i); nt.Operation != "SET" || nt.Value != want {
				t.Fatalf("round %d, notification %d in version order: %s %q, want SET %q", round, i, nt.Operation, nt.Value, want)
			}
		}
	}
	// SET ... GET answers with the value each write replaced, a DEL
	// among them included: each saw exactly the writes sent before it.
	pipe := rc.Pipeline()
	var olds []*goredis.Cmd
	for i := range 50 {
		if i == 25 {
			pipe.Del(ctx, k)
		}
		olds = append(olds, pipe.Do(ctx, "SET", k, fmt.Sprint("g", i), "GET"))
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, goredis.Nil) {
		t.Fatal(err)
	}
	for i, c := range olds {
		v, err := c.Text()
		switch want := fmt.Sprint("g", i-1); {
		case i == 0:
			want = fmt.Sprint(2, ":", n-1)
			fallthrough
		case i != 25:
			if err != nil || v != want {
				t.Fatalf("SET %d ... GET: %q %v, want %q", i, v, err, want)
			}
		default:
			if !errors.Is(err, goredis.Nil) {
				t.Fatalf("SET ... GET after a DEL in the pipeline: %q %v, want nil", v, err)
			}
		}
	}
}

// KEYS and SCAN list what the store holds, SCAN a page at a time with
// numeric cursors as every client expects.
func TestRESPKeysAndScan(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	ctx := ctxFor(t, 60*time.Second)
	rc := redisClient(t, s, 2, "", "")
	prefix := uniqueKey(t) + ":"
	var want []string
	for i := range 250 {
		k := fmt.Sprintf("%s%03d", prefix, i)
		want = append(want, k)
		if err := rc.Set(ctx, k, "x", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	rc.Set(ctx, uniqueKey(t)+"-other", "x", 0)
	keys, err := rc.Keys(ctx, prefix+"*").Result()
	slices.Sort(keys)
	if err != nil || !slices.Equal(keys, want) {
		t.Fatalf("KEYS: %d keys, %v", len(keys), err)
	}
	var got []string
	iter := rc.Scan(ctx, 0, prefix+"*", 40).Iterator()
	for iter.Next(ctx) {
		got = append(got, iter.Val())
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Fatalf("SCAN: %d keys, want %d", len(got), len(want))
	}
	if err := rc.Do(ctx, "SCAN", "99999").Err(); err == nil || !strings.Contains(err.Error(), "invalid cursor") {
		t.Fatalf("SCAN of a cursor never given: %v", err)
	}
}

// A write through RESP is read through MQTT (the AIO Go SDK) and notified
// to an MQTT KEYNOTIFY observer; one through MQTT is read through RESP.
func TestRESPAndMQTTShareTheStore(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	ctx, rc, k, notes := respObserved(t, s)
	obs := newSDKClient(t, s)
	if err := rc.Set(ctx, k, "from-redis", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if n := recv(t, notes, 10*time.Second); n.Operation != "SET" || n.Value != "from-redis" {
		t.Fatalf("notification %+v", n)
	}
	if r, err := obs.store.Get(ctx, k); err != nil || r.Value != "from-redis" {
		t.Fatalf("MQTT GET of a RESP write: %+v %v", r, err)
	}
	if _, err := obs.store.Set(ctx, k, "from-mqtt"); err != nil {
		t.Fatal(err)
	}
	if v, err := rc.Get(ctx, k).Result(); err != nil || v != "from-mqtt" {
		t.Fatalf("RESP GET of an MQTT write: %q %v", v, err)
	}
	// Versions: MQKV.GETV gives the version the SDK sees.
	r, _ := obs.store.Get(ctx, k)
	got, err := rc.Do(ctx, "MQKV.GETV", k).StringSlice()
	if err != nil || len(got) != 2 || got[0] != "from-mqtt" || got[1] != r.Version.String() {
		t.Fatalf("MQKV.GETV: %v %v (SDK version %v)", got, err, r.Version)
	}
	// MQKV.SETV with VER: applied with the current version, refused with
	// an old one.
	newVer, err := rc.Do(ctx, "MQKV.SETV", k, "v2", "VER", got[1]).Text()
	if err != nil || newVer == "" || newVer == got[1] {
		t.Fatalf("MQKV.SETV with the current version: %q %v", newVer, err)
	}
	if err := rc.Do(ctx, "MQKV.SETV", k, "v3", "VER", got[1]).Err(); !errors.Is(err, goredis.Nil) {
		t.Fatalf("MQKV.SETV with an old version: %v, want nil", err)
	}
	if n, err := rc.Do(ctx, "MQKV.DELV", k, "VER", got[1]).Int(); err != nil || n != -1 {
		t.Fatalf("MQKV.DELV with an old version: %d %v", n, err)
	}
	if n, err := rc.Do(ctx, "MQKV.DELV", k, "VER", newVer).Int(); err != nil || n != 1 {
		t.Fatalf("MQKV.DELV with the current version: %d %v", n, err)
	}
}

// With a password file, commands wait for AUTH; the policy decides per key
// as for MQTT, with the username as principal.
func TestRESPAuthenticationAndPolicy(t *testing.T) {
	pw, pol := aliceKeysOnly(t)
	s := startServer(t, inMemory(), withRESP(), func(c *server.Config) { c.PasswordFile, c.PolicyFile = pw, pol })
	ctx := ctxFor(t, 30*time.Second)
	anon := redisClient(t, s, 2, "", "")
	if err := anon.Get(ctx, "alice/x").Err(); err == nil || !strings.HasPrefix(err.Error(), "NOAUTH") {
		t.Fatalf("a command before AUTH: %v", err)
	}
	bad := redisClient(t, s, 3, "alice", "wrong")
	if err := bad.Ping(ctx).Err(); err == nil || !strings.HasPrefix(err.Error(), "WRONGPASS") {
		t.Fatalf("a wrong password: %v", err)
	}
	alice := redisClient(t, s, 3, "alice", "alice-secret")
	if err := alice.Set(ctx, "alice/x", "1", 0).Err(); err != nil {
		t.Fatalf("alice's own key: %v", err)
	}
	if err := alice.Set(ctx, "bob/x", "1", 0).Err(); err == nil || !strings.HasPrefix(err.Error(), "NOPERM") {
		t.Fatalf("another's key: %v", err)
	}
	if err := alice.Get(ctx, "bob/x").Err(); err == nil || !strings.HasPrefix(err.Error(), "NOPERM") {
		t.Fatalf("reading another's key: %v", err)
	}
	// RESP2 clients authenticate with AUTH.
	a2 := redisClient(t, s, 2, "alice", "alice-secret")
	if v, err := a2.Get(ctx, "alice/x").Result(); err != nil || v != "1" {
		t.Fatalf("GET after AUTH over RESP2: %q %v", v, err)
	}
}

// Bad input gets Redis's protocol error and the connection is closed;
// nothing is written.
func TestRESPProtocolErrors(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	for _, in := range []string{
		"*1\r\n$-5\r\n",
		"*abc\r\n",
		"*2\r\n$3\r\nSET\r\n:1\r\n",
		"*1\r\n$3\r\nSETxx",
		"*99999999\r\n",
		"SET \"unbalanced\r\n",
	} {
		c := dialRESP(t, s)
		c.Write([]byte(in))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "-ERR Protocol error") {
			t.Fatalf("%q: %q %v", in, line, err)
		}
		c.Close()
	}
	// Inline commands, as typed into telnet.
	c := dialRESP(t, s)
	k := uniqueKey(t)
	fmt.Fprintf(c, "SET %s \"two words\"\r\nGET %s\r\n", k, k)
	br := bufio.NewReader(c)
	for _, want := range []string{"+OK\r\n", "$9\r\n", "two words\r\n"} {
		if line, err := br.ReadString('\n'); err != nil || line != want {
			t.Fatalf("inline: %q %v, want %q", line, err, want)
		}
	}
}

// The replies a pipeline's commands got before a QUIT are written before
// the connection closes, and nothing after the QUIT is run.
func TestRESPQuitInAPipeline(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	c := dialRESP(t, s)
	k := uniqueKey(t)
	fmt.Fprintf(c, "PING\r\nGET %s\r\nQUIT\r\nSET %s after\r\n", k, k)
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "+PONG\r\n$-1\r\n+OK\r\n" {
		t.Fatalf("pipeline with QUIT answered %q %v", got, err)
	}
	rc := redisClient(t, s, 2, "", "")
	if v, err := rc.Get(ctxFor(t, 10*time.Second), k).Result(); !errors.Is(err, goredis.Nil) {
		t.Fatalf("the SET after QUIT ran: %q %v", v, err)
	}
}

// dialRESP connects to s's RESP endpoint without a client library, for
// the bytes themselves; the connection closes with the test.
func dialRESP(t *testing.T, s *testServer) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", s.RESPAddr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// requireTool finds a program the tests use, skipping without it unless
// CI said it must be there.
func requireTool(t *testing.T, name, env string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv(env) != "" {
			t.Fatalf("%s is required (%s) and not found: %v", name, env, err)
		}
		t.Skipf("%s not installed", name)
	}
	return p
}

// redis-cli and redis-benchmark (Debian's redis-tools) work against the
// endpoint.
func TestRESPWithRedisTools(t *testing.T) {
	cli := requireTool(t, "redis-cli", "MQKV_REQUIRE_REDIS")
	bench := requireTool(t, "redis-benchmark", "MQKV_REQUIRE_REDIS")
	s := startServer(t, inMemory(), withRESP())
	host, port, _ := net.SplitHostPort(s.RESPAddr())
	run := func(name string, args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, name, append([]string{"-h", host, "-p", port}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
		return string(out)
	}
	k := uniqueKey(t)
	if out := run(cli, "SET", k, "hello"); strings.TrimSpace(out) != "OK" {
		t.Fatalf("redis-cli SET: %q", out)
	}
	if out := run(cli, "GET", k); strings.TrimSpace(out) != "hello" {
		t.Fatalf("redis-cli GET: %q", out)
	}
	if out := run(cli, "-3", "GET", k+"-none"); strings.TrimSpace(out) != "(nil)" && strings.TrimSpace(out) != "" {
		t.Fatalf("redis-cli -3 GET of a missing key: %q", out)
	}
	if out := run(cli, "--scan", "--pattern", k+"*"); strings.TrimSpace(out) != k {
		t.Fatalf("redis-cli --scan: %q", out)
	}
	out := run(bench, "-t", "set,get", "-n", "2000", "-c", "8", "-d", "64", "-q")
	for _, op := range []string{"SET: ", "GET: "} {
		if !strings.Contains(out, op) || !strings.Contains(out, "requests per second") {
			t.Fatalf("redis-benchmark: no %s figure in %q", op, out)
		}
	}
	if n := run(cli, "DBSIZE"); strings.TrimSpace(n) == "0" {
		t.Fatalf("DBSIZE after redis-benchmark: %q", n)
	}
}
