package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	goredis "github.com/redis/go-redis/v9"
)

// concurrently runs clients goroutines of each calls of op (client,
// call) and fails on the first error.
func concurrently(t *testing.T, clients, each int, op func(client, call int) error) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				if err := op(c, i); err != nil {
					errs <- fmt.Errorf("client %d, call %d: %w", c, i, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// tokens checks that v is made of the tokens client c's call i wrote
// (token(c, i)), each once, and nothing else.
func tokens(t *testing.T, v []byte, clients, each int, token func(c, i int) string) {
	t.Helper()
	want := 0
	for c := range clients {
		for i := range each {
			tok := token(c, i)
			if n := bytes.Count(v, []byte(tok)); n != 1 {
				t.Fatalf("%q is in the value %d times", tok, n)
			}
			want += len(tok)
		}
	}
	if len(v) != want {
		t.Fatalf("the value is %d bytes, want %d", len(v), want)
	}
}

// memcached's replace, append, prepend and touch are applied by the log:
// 50 clients changing one key all succeed (read and written back on
// condition, they failed "the key changed too often", as incr did), the
// key keeps its flags, and an MQTT client reads what they made.
func TestMemcacheChangesUnderContention(t *testing.T) {
	s := startServer(t, inMemory(), withMemcache(), withRESP())
	mc := memcacheClient(t, s)
	mc.MaxIdleConns = 50
	k := strings.ReplaceAll(uniqueKey(t), "/", ":")
	token := func(c, i int) string { return fmt.Sprintf("<%d.%d>", c, i) }

	for _, op := range []string{"append", "prepend"} {
		key := k + "-" + op
		if err := mc.Set(&memcache.Item{Key: key, Value: nil, Flags: 7}); err != nil {
			t.Fatal(err)
		}
		concurrently(t, 50, 20, func(c, i int) error {
			it := &memcache.Item{Key: key, Value: []byte(token(c, i))}
			if op == "append" {
				return mc.Append(it)
			}
			return mc.Prepend(it)
		})
		it, err := mc.Get(key)
		if err != nil || it.Flags != 7 {
			t.Fatalf("%s: %+v %v", op, it, err)
		}
		tokens(t, it.Value, 50, 20, token)
		// Each client's own calls in the order made.
		for c := range 50 {
			first, last := bytes.Index(it.Value, []byte(token(c, 0))), bytes.Index(it.Value, []byte(token(c, 19)))
			if (first < last) != (op == "append") {
				t.Fatalf("%s: client %d's first call at %d, its last at %d", op, c, first, last)
			}
		}
		obs := newSDKClient(t, s)
		// The flags are kept ahead of the data.
		if r, err := obs.store.Get(ctxFor(t, 10*time.Second), key); err != nil || len(r.Value) <= len(it.Value) || !strings.HasSuffix(r.Value, string(it.Value)) {
			t.Fatalf("MQTT GET after %s: %d bytes, %v", op, len(r.Value), err)
		}
	}

	// Prepend to a value without flags puts the data first; with flags,
	// after them.
	if err := mc.Set(&memcache.Item{Key: k + "-plain", Value: []byte("b")}); err != nil {
		t.Fatal(err)
	}
	if err := mc.Prepend(&memcache.Item{Key: k + "-plain", Value: []byte("a")}); err != nil {
		t.Fatal(err)
	}
	if it, err := mc.Get(k + "-plain"); err != nil || string(it.Value) != "ab" || it.Flags != 0 {
		t.Fatalf("prepend without flags: %+v %v", it, err)
	}

	// An empty value appended to, and prepended to, is stored (its length
	// 0 is no missing key).
	if err := mc.Set(&memcache.Item{Key: k + "-empty", Value: nil}); err != nil {
		t.Fatal(err)
	}
	for _, op := range []func(*memcache.Item) error{mc.Append, mc.Prepend} {
		if err := op(&memcache.Item{Key: k + "-empty", Value: nil}); err != nil {
			t.Fatalf("an empty change of an empty value: %v", err)
		}
	}
	// A value that begins as the flags' header does but is none (written
	// over RESP): prepend still puts its data first.
	rc := redisClient(t, s, 3, "", "")
	ctx := ctxFor(t, 10*time.Second)
	if err := rc.Set(ctx, k+"-magic", "\x00mqkv-mc\x01ab", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := mc.Prepend(&memcache.Item{Key: k + "-magic", Value: []byte("Z")}); err != nil {
		t.Fatalf("prepend to a value like a header: %v", err)
	}
	if v, err := rc.Get(ctx, k+"-magic").Result(); err != nil || v != "Z\x00mqkv-mc\x01ab" {
		t.Fatalf("after prepend: %q %v", v, err)
	}

	key := k + "-replace"
	if err := mc.Replace(&memcache.Item{Key: key, Value: []byte("x")}); !errors.Is(err, memcache.ErrNotStored) {
		t.Fatalf("replace of a missing key: %v", err)
	}
	for _, op := range []string{"append", "prepend"} {
		it := &memcache.Item{Key: key, Value: []byte("x")}
		if err := map[string]func(*memcache.Item) error{"append": mc.Append, "prepend": mc.Prepend}[op](it); !errors.Is(err, memcache.ErrNotStored) {
			t.Fatalf("%s to a missing key: %v", op, err)
		}
	}
	if err := mc.Touch(key, 60); !errors.Is(err, memcache.ErrCacheMiss) {
		t.Fatalf("touch of a missing key: %v", err)
	}
	if _, err := mc.Get(key); !errors.Is(err, memcache.ErrCacheMiss) {
		t.Fatalf("a refused change made the key: %v", err)
	}
	if err := mc.Set(&memcache.Item{Key: key, Value: []byte("0")}); err != nil {
		t.Fatal(err)
	}
	concurrently(t, 50, 20, func(c, i int) error {
		if i%2 == 1 {
			return mc.Touch(key, 600)
		}
		return mc.Replace(&memcache.Item{Key: key, Value: []byte(token(c, i)), Flags: uint32(c)})
	})
	it, err := mc.Get(key)
	if err != nil || !strings.HasPrefix(string(it.Value), "<") || !strings.HasPrefix(string(it.Value), fmt.Sprintf("<%d.", it.Flags)) {
		t.Fatalf("after replaces: %+v %v", it, err)
	}
	// The last call of each client was a touch of 600 s: the key
	// expires, in at most that.
	if d, err := rc.PTTL(ctx, key).Result(); err != nil || d <= 0 || d > 600*time.Second {
		t.Fatalf("PTTL after touches: %v %v", d, err)
	}
	if err := mc.Touch(key, 0); err != nil {
		t.Fatal(err)
	}
	if d, err := rc.PTTL(ctx, key).Result(); err != nil || d != -1 {
		t.Fatalf("PTTL after touch 0 (no expiry): %v %v", d, err)
	}
}

// Redis's APPEND and SET ... XX are applied by the log: concurrent APPENDs
// all take effect, each answered with the length it left; SET XX sets only
// a key that exists; an MQTT observer hears each change.
func TestRESPValueOps(t *testing.T) {
	s := startServer(t, inMemory(), withRESP())
	ctx, rc, k, notes := respObserved(t, s)
	if n, err := rc.Append(ctx, k, "ab").Result(); err != nil || n != 2 {
		t.Fatalf("APPEND to a missing key: %d %v", n, err)
	}
	if n := recv(t, notes, 10*time.Second); n.Operation != "SET" || n.Value != "ab" {
		t.Fatalf("notification %+v", n)
	}
	if n, err := rc.Append(ctx, k, "c").Result(); err != nil || n != 3 {
		t.Fatalf("APPEND: %d %v", n, err)
	}
	if n := recv(t, notes, 10*time.Second); n.Value != "abc" {
		t.Fatalf("notification %+v", n)
	}
	if err := rc.Do(ctx, "APPEND", k).Err(); err == nil || err.Error() != "ERR wrong number of arguments for 'append' command" {
		t.Fatalf("APPEND without a value: %v", err)
	}
	if err := rc.Set(ctx, k+"-ttl", "x", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := rc.Append(ctx, k+"-ttl", "y").Result(); err != nil || n != 2 {
		t.Fatalf("APPEND to a key with a TTL: %d %v", n, err)
	}
	if d, err := rc.PTTL(ctx, k+"-ttl").Result(); err != nil || d <= 0 || d > time.Minute {
		t.Fatalf("PTTL after APPEND (kept, as Redis keeps it): %v %v", d, err)
	}

	// SET XX, with GET: the old value, or nil and nothing set.
	if v, err := rc.SetArgs(ctx, k+"-none", "v", goredis.SetArgs{Mode: "XX", Get: true}).Result(); !errors.Is(err, goredis.Nil) || v != "" {
		t.Fatalf("SET XX GET of a missing key: %q %v", v, err)
	}
	if n, _ := rc.Exists(ctx, k+"-none").Result(); n != 0 {
		t.Fatal("SET XX GET made a key")
	}
	if v, err := rc.SetArgs(ctx, k, "new", goredis.SetArgs{Mode: "XX", Get: true}).Result(); err != nil || v != "abc" {
		t.Fatalf("SET XX GET: %q %v", v, err)
	}
	if n := recv(t, notes, 10*time.Second); n.Value != "new" {
		t.Fatalf("notification %+v", n)
	}

	// Fifty clients appending to one key, each on a connection of its
	// own: every APPEND takes effect once, each answered with a length of
	// its own.
	pool := goredis.NewClient(&goredis.Options{Addr: s.RESPAddr(), PoolSize: 50, MaxRetries: -1, ReadTimeout: 10 * time.Second})
	defer pool.Close()
	token := func(c, i int) string { return fmt.Sprintf("<%02d.%02d>", c, i) } // 7 bytes each
	var mu sync.Mutex
	lengths := map[int64]bool{}
	concurrently(t, 50, 20, func(c, i int) error {
		n, err := pool.Append(ctx, k+"-hot", token(c, i)).Result()
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if n%7 != 0 || lengths[n] {
			return fmt.Errorf("length %d seen twice, or not a sum of appends", n)
		}
		lengths[n] = true
		return nil
	})
	v, err := rc.Get(ctx, k+"-hot").Bytes()
	if err != nil {
		t.Fatal(err)
	}
	tokens(t, v, 50, 20, token)
	// And replacing one key that exists: every SET XX applied.
	concurrently(t, 50, 10, func(c, i int) error {
		if ok, err := pool.SetXX(ctx, k+"-hot", token(c, i), 0).Result(); err != nil || !ok {
			return fmt.Errorf("SET XX: %v %v", ok, err)
		}
		return nil
	})
}
