package e2e

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/resp"
)

// requestTemplates are valid requests the storm mutates.
var requestTemplates = [][]string{
	{"GET", "storm/a"},
	{"SET", "storm/a", "value"},
	{"SET", "storm/b", "v", "NX", "PX", "1000"},
	{"SET", "storm/c", "v", "NEX"},
	{"DEL", "storm/a"},
	{"VDEL", "storm/b", "v"},
	{"KEYNOTIFY", "storm/c"},
	{"KEYNOTIFY", "storm/c", "STOP"},
	{"PING"},
}

// hostilePayload returns a random or mutated request payload.
func hostilePayload(rng *rand.Rand) []byte {
	switch rng.IntN(6) {
	case 0: // random bytes
		b := make([]byte, rng.IntN(300))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	case 1: // huge or negative counts and lengths
		return []byte([]string{
			"*2147483647\r\n$3\r\nGET\r\n",
			"*-1\r\n",
			"*2\r\n$3\r\nGET\r\n$-7\r\nk\r\n",
			"*2\r\n$3\r\nGET\r\n$99999999999\r\nk\r\n",
			"*1\r\n$2147483647\r\n",
			"*99999999999999999999999\r\n",
			"",
			"*0\r\n",
		}[rng.IntN(8)])
	case 2: // truncated
		b := resp.AppendBulks(nil, toBytes(requestTemplates[rng.IntN(len(requestTemplates))])...)
		return b[:rng.IntN(len(b))]
	default: // a few bit flips, insertions or deletions in a valid request
		b := resp.AppendBulks(nil, toBytes(requestTemplates[rng.IntN(len(requestTemplates))])...)
		for n := 1 + rng.IntN(3); n > 0 && len(b) > 0; n-- {
			i := rng.IntN(len(b))
			switch rng.IntN(3) {
			case 0:
				b[i] ^= 1 << rng.IntN(8)
			case 1:
				b = append(b[:i], append([]byte{byte(rng.Uint32())}, b[i:]...)...)
			case 2:
				b = append(b[:i], b[i+1:]...)
			}
		}
		return b
	}
}

func toBytes(ss []string) [][]byte {
	out := make([][]byte, len(ss))
	for i, s := range ss {
		out[i] = []byte(s)
	}
	return out
}

// wellFormed reports whether a reply is one complete RESP value the SDKs
// can read: a simple string, error, integer or bulk string.
func wellFormed(p []byte) bool {
	if len(p) < 3 || !bytes.HasSuffix(p, []byte("\r\n")) {
		return false
	}
	switch p[0] {
	case '+', '-', ':':
		return bytes.Count(p, []byte("\r\n")) == 1
	case '$':
		if string(p) == "$-1\r\n" {
			return true
		}
		n, rest, ok := bytes.Cut(p[1:], []byte("\r\n"))
		var l int
		_, err := fmt.Sscanf(string(n), "%d", &l)
		return ok && err == nil && len(rest) == l+2
	}
	return false
}

// garbageConnection does one hostile thing to the TCP port.
func garbageConnection(t *testing.T, addr string, rng *rand.Rand) {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Errorf("dial: %v", err)
		return
	}
	defer conn.Close()
	switch rng.IntN(7) {
	case 0: // random bytes
		b := make([]byte, 1+rng.IntN(2000))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		conn.Write(b)
	case 1: // a CONNECT cut short
		p := connectPacket("garbage")
		conn.Write(p[:rng.IntN(len(p))])
	case 2: // a CONNECT claiming to be enormous
		conn.Write([]byte{0x10, 0xff, 0xff, 0xff, 0x7f})
	case 3: // a malformed remaining length
		conn.Write([]byte{0x10, 0xff, 0xff, 0xff, 0xff, 0xff})
	case 4: // connected, then a PUBLISH to an invalid UTF-8 topic
		conn.Write(connectPacket(fmt.Sprintf("garbage-%d", rng.Uint32())))
		conn.Write(publishPacket("bad/\xff\xfe/topic", []byte("x")))
	case 5: // connected, then a packet type that does not exist
		conn.Write(connectPacket(fmt.Sprintf("garbage-%d", rng.Uint32())))
		conn.Write([]byte{0xf0, 0x00})
	case 6: // PUBLISH before CONNECT
		conn.Write(publishPacket("a/b", []byte("x")))
	}
	conn.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	readUntilClosed(conn)
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// TestStorm throws hostile input at one server: the server answers every
// request that has a response topic with a well-formed reply, keeps
// serving, changes nothing it should not, and gets its goroutines and heap
// back.
func TestStorm(t *testing.T) {
	if testing.Short() {
		t.Skip("storm")
	}
	s := startServer(t, inMemory())
	setup := dialRaw(t, s, "storm-setup", rawOpts{cleanStart: true})
	for i := 0; i < 20; i++ {
		expectPayload(t, setup.call("SET", fmt.Sprintf("sentinel/%d", i), fmt.Sprintf("value-%d", i)), "+OK\r\n")
	}
	setup.c.Disconnect(&paho.Disconnect{})
	time.Sleep(100 * time.Millisecond)
	settleSpare(t)
	goroutines, heap := runtime.NumGoroutine(), heapInUse()

	const requests, clients, garbage = 20000, 8, 200
	var wg sync.WaitGroup
	errs := make(chan error, clients+1)
	for w := 0; w < clients; w++ {
		c := dialRaw(t, s, fmt.Sprintf("storm-%d", w), rawOpts{cleanStart: true})
		wg.Add(1)
		go func(w int, c *rawClient) {
			defer wg.Done()
			defer c.c.Disconnect(&paho.Disconnect{})
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			const window = 32 // requests in flight per client
			var pending []chan []byte
			await := func(ch chan []byte) bool {
				select {
				case p := <-ch:
					if !wellFormed(p) {
						errs <- fmt.Errorf("malformed reply %q", p)
						return false
					}
				case <-time.After(10 * time.Second):
					errs <- fmt.Errorf("client %d: a request got no reply", w)
					return false
				}
				return true
			}
			for i := 0; i < requests/clients; i++ {
				reply, err := c.trySend(req{payload: hostilePayload(rng), ts: now()})
				if err != nil {
					errs <- err
					return
				}
				ch := make(chan []byte, 1)
				go func() {
					if p, ok := <-reply; ok {
						ch <- p.Payload
					}
				}()
				pending = append(pending, ch)
				if len(pending) == window {
					if !await(pending[0]) {
						return
					}
					pending = pending[1:]
				}
			}
			for _, ch := range pending {
				if !await(ch) {
					return
				}
			}
		}(w, c)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		rng := rand.New(rand.NewPCG(99, 7))
		for i := 0; i < garbage; i++ {
			garbageConnection(t, s.Addr(), rng)
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	// The server still works, for the official SDK too, and the sentinels
	// are untouched.
	check := dialRaw(t, s, "storm-check", rawOpts{cleanStart: true})
	for i := 0; i < 20; i++ {
		v := fmt.Sprintf("value-%d", i)
		expectPayload(t, check.call("GET", fmt.Sprintf("sentinel/%d", i)), fmt.Sprintf("$%d\r\n%s\r\n", len(v), v))
	}
	check.c.Disconnect(&paho.Disconnect{})
	t.Run("conformance after the storm", func(t *testing.T) {
		c := newSDKClient(t, s)
		ctx := ctxFor(t, 10*time.Second)
		key := uniqueKey(t)
		ch, done := c.store.Notify(key)
		defer done()
		if err := c.store.KeyNotify(ctx, key); err != nil {
			t.Fatal(err)
		}
		if res, err := c.store.Set(ctx, key, "after"); err != nil || !res.Value {
			t.Fatalf("Set: %+v %v", res, err)
		}
		if n := recv(t, ch, 5*time.Second); n.Value != "after" {
			t.Fatalf("notification %+v", n)
		}
		if get, err := c.store.Get(ctx, key); err != nil || get.Value != "after" {
			t.Fatalf("Get: %+v %v", get, err)
		}
		c.close()
	})

	// Goroutines and heap come back to where they were.
	deadline := time.Now().Add(15 * time.Second)
	slack := 5
	if clusterMode() {
		slack = 40 // raft's own goroutines come and go with connections between nodes
	}
	for runtime.NumGoroutine() > goroutines+slack {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("goroutines: %d before, %d after\n%s", goroutines, runtime.NumGoroutine(), buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(50 * time.Millisecond)
	}
	if after := heapInUse(); after > heap+32<<20 {
		t.Fatalf("heap grew from %d to %d bytes", heap, after)
	}
	t.Logf("goroutines %d → %d, heap %d KiB → %d KiB", goroutines, runtime.NumGoroutine(), heap>>10, heapInUse()>>10)
}
