package e2e

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/bradfitz/gomemcache/memcache"

	"github.com/mqkv/mqkv/internal/server"
)

// withMemcache turns the memcached endpoint on.
func withMemcache() serverOption {
	return func(c *server.Config) { c.MemcacheListen = "127.0.0.1:0" }
}

func memcacheClient(t *testing.T, s *testServer) *memcache.Client {
	t.Helper()
	mc := memcache.New(s.MemcacheAddr())
	mc.Timeout = 10 * time.Second
	t.Cleanup(func() { mc.Close() })
	return mc
}

// A memcached client library's every call maps onto the store, and what it
// writes is read over MQTT and RESP and notified to MQTT observers.
func TestMemcacheWithGomemcache(t *testing.T) {
	s := startServer(t, inMemory(), withMemcache(), withRESP())
	mc := memcacheClient(t, s)
	k := strings.ReplaceAll(uniqueKey(t), "/", ":")
	if _, err := mc.Get(k); !errors.Is(err, memcache.ErrCacheMiss) {
		t.Fatalf("get of a missing key: %v", err)
	}
	if err := mc.Set(&memcache.Item{Key: k, Value: []byte("v1")}); err != nil {
		t.Fatal(err)
	}
	it, err := mc.Get(k)
	if err != nil || string(it.Value) != "v1" || it.Flags != 0 {
		t.Fatalf("get: %+v %v", it, err)
	}
	// add only creates; replace only replaces.
	if err := mc.Add(&memcache.Item{Key: k, Value: []byte("x")}); !errors.Is(err, memcache.ErrNotStored) {
		t.Fatalf("add of an existing key: %v", err)
	}
	if err := mc.Replace(&memcache.Item{Key: k + "-none", Value: []byte("x")}); !errors.Is(err, memcache.ErrNotStored) {
		t.Fatalf("replace of a missing key: %v", err)
	}
	if err := mc.Replace(&memcache.Item{Key: k, Value: []byte("v2"), Flags: 42}); err != nil {
		t.Fatal(err)
	}
	// Flags come back; the cas unique is the version: a cas with it
	// succeeds once, and fails after another write.
	it, err = mc.Get(k)
	if err != nil || string(it.Value) != "v2" || it.Flags != 42 {
		t.Fatalf("get after replace with flags: %+v %v", it, err)
	}
	it.Value = []byte("v3")
	if err := mc.CompareAndSwap(it); err != nil {
		t.Fatalf("cas with the current unique: %v", err)
	}
	it.Value = []byte("v4")
	if err := mc.CompareAndSwap(it); !errors.Is(err, memcache.ErrCASConflict) {
		t.Fatalf("cas with a stale unique: %v", err)
	}
	if err := mc.Append(&memcache.Item{Key: k, Value: []byte("+end")}); err != nil {
		t.Fatal(err)
	}
	if err := mc.Prepend(&memcache.Item{Key: k, Value: []byte("start+")}); err != nil {
		t.Fatal(err)
	}
	if it, err = mc.Get(k); err != nil || string(it.Value) != "start+v3+end" || it.Flags != 42 {
		t.Fatalf("after append and prepend: %+v %v", it, err)
	}
	// Multi-key get.
	mc.Set(&memcache.Item{Key: k + "-b", Value: []byte("b")})
	m, err := mc.GetMulti([]string{k, k + "-b", k + "-none"})
	if err != nil || len(m) != 2 || string(m[k+"-b"].Value) != "b" {
		t.Fatalf("get of several keys: %v %v", m, err)
	}
	// incr and decr: atomic, from and to decimal text.
	mc.Set(&memcache.Item{Key: k + "-n", Value: []byte("10")})
	if n, err := mc.Increment(k+"-n", 5); err != nil || n != 15 {
		t.Fatalf("incr: %d %v", n, err)
	}
	if n, err := mc.Decrement(k+"-n", 100); err != nil || n != 0 {
		t.Fatalf("decr below zero: %d %v", n, err)
	}
	if _, err := mc.Increment(k+"-none", 1); !errors.Is(err, memcache.ErrCacheMiss) {
		t.Fatalf("incr of a missing key: %v", err)
	}
	if _, err := mc.Increment(k, 1); err == nil || !strings.Contains(err.Error(), "non-numeric") {
		t.Fatalf("incr of text: %v", err)
	}
	// Expiry: relative seconds, and touch sets it anew.
	if err := mc.Set(&memcache.Item{Key: k + "-ttl", Value: []byte("x"), Expiration: 1}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a 1 s item to expire", func() bool {
		_, err := mc.Get(k + "-ttl")
		return errors.Is(err, memcache.ErrCacheMiss)
	})
	rc := redisClient(t, s, 3, "", "")
	ctx := ctxFor(t, 30*time.Second)
	if err := mc.Touch(k+"-b", 100); err != nil {
		t.Fatal(err)
	}
	if d, err := rc.TTL(ctx, k+"-b").Result(); err != nil || d < 98*time.Second || d > 100*time.Second {
		t.Fatalf("TTL after touch 100: %v %v", d, err)
	}
	// An absolute unix time (more than 30 days is one).
	if err := mc.Set(&memcache.Item{Key: k + "-abs", Value: []byte("x"), Expiration: int32(time.Now().Unix() + 200)}); err != nil {
		t.Fatal(err)
	}
	if d, err := rc.TTL(ctx, k+"-abs").Result(); err != nil || d < 190*time.Second || d > 201*time.Second {
		t.Fatalf("TTL of an absolute exptime: %v %v", d, err)
	}
	// Another protocol reads it; a flags-0 value is stored as it is.
	if v, err := rc.Get(ctx, k+"-b").Result(); err != nil || v != "b" {
		t.Fatalf("RESP GET of a memcached write: %q %v", v, err)
	}
	if err := mc.Delete(k + "-b"); err != nil {
		t.Fatal(err)
	}
	if err := mc.Delete(k + "-b"); !errors.Is(err, memcache.ErrCacheMiss) {
		t.Fatalf("delete of a missing key: %v", err)
	}
}

// A write through memcached reaches an MQTT KEYNOTIFY observer and an
// MQTT reader.
func TestMemcacheWriteNotifiesMQTT(t *testing.T) {
	s := startServer(t, inMemory(), withMemcache())
	mc := memcacheClient(t, s)
	obs := newSDKClient(t, s)
	ctx := ctxFor(t, 30*time.Second)
	k := strings.ReplaceAll(uniqueKey(t), "/", ":")
	notes, done := obs.store.Notify(k)
	defer done()
	if err := obs.store.KeyNotify(ctx, k); err != nil {
		t.Fatal(err)
	}
	if err := mc.Set(&memcache.Item{Key: k, Value: []byte("from-memcache")}); err != nil {
		t.Fatal(err)
	}
	if n := recv(t, notes, 10*time.Second); n.Operation != "SET" || n.Value != "from-memcache" {
		t.Fatalf("notification %+v", n)
	}
	if r, err := obs.store.Get(ctx, k); err != nil || r.Value != "from-memcache" {
		t.Fatalf("MQTT GET: %+v %v", r, err)
	}
}

// The text protocol's errors, noreply, stats and version, byte for byte
// where clients parse them.
func TestMemcacheTextProtocol(t *testing.T) {
	s := startServer(t, inMemory(), withMemcache())
	c, err := net.Dial("tcp", s.MemcacheAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(c)
	k := strings.ReplaceAll(uniqueKey(t), "/", ":")
	expect := func(send string, want ...string) {
		t.Helper()
		if send != "" {
			fmt.Fprint(c, send)
		}
		for _, w := range want {
			line, err := br.ReadString('\n')
			if err != nil || (line != w && !(strings.HasSuffix(w, "*") && strings.HasPrefix(line, strings.TrimSuffix(w, "*")))) {
				t.Fatalf("after %q: %q %v, want %q", send, line, err, w)
			}
		}
	}
	expect("bogus\r\n", "ERROR\r\n")
	expect("set "+k+" 0 0 2 noreply\r\nhi\r\nget "+k+"\r\n", "VALUE "+k+" 0 2\r\n", "hi\r\n", "END\r\n")
	expect("set "+k+" 0 0 2\r\nhello\r\n", "CLIENT_ERROR bad data chunk\r\n")
	expect("set "+k+" x 0 2\r\n", "CLIENT_ERROR bad command line format\r\n")
	expect("set "+strings.Repeat("k", 251)+" 0 0 1\r\n", "CLIENT_ERROR bad command line format\r\n")
	expect("set "+k+" 0 0 2000000\r\n"+strings.Repeat("x", 2000000)+"\r\nget "+k+"\r\n",
		"SERVER_ERROR object too large for cache\r\n", "VALUE "+k+" 0 2\r\n", "hi\r\n", "END\r\n")
	expect("incr "+k+" 1\r\n", "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n")
	expect("incr "+k+" x\r\n", "CLIENT_ERROR invalid numeric delta argument\r\n")
	expect("delete "+k+" noreply\r\ndelete "+k+"\r\n", "NOT_FOUND\r\n")
	expect("version\r\n", "VERSION *")
	expect("flush_all\r\n", "CLIENT_ERROR flush_all is not supported*")
	fmt.Fprint(c, "stats\r\n")
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if line == "END\r\n" {
			break
		}
		if !strings.HasPrefix(line, "STAT ") {
			t.Fatalf("stats line %q", line)
		}
	}
	expect("quit\r\n")
	if _, err := br.ReadString('\n'); err == nil {
		t.Fatal("the connection stayed open after quit")
	}
}

// The endpoint refuses an address other than loopback without
// --memcache-insecure: its clients cannot authenticate.
func TestMemcacheRefusesAPublicAddressUnlessInsecure(t *testing.T) {
	_, err := server.Start(server.Config{Listen: "127.0.0.1:0", InMemory: true, Logger: quietLogger(), MemcacheListen: "0.0.0.0:0"})
	if err == nil || !strings.Contains(err.Error(), "--memcache-insecure") {
		t.Fatalf("a public memcached address: %v", err)
	}
}
