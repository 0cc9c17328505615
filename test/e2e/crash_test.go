package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/server"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// mqkvBinary builds the mqkv command once per test binary.
func mqkvBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "mqkv-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "mqkv")
		cmd := exec.Command("go", "build", "-o", binPath, "../../cmd/mqkv")
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// startProcess runs `mqkv serve` on dir as a child process.
func startProcess(t *testing.T, dir string) *server.Process {
	t.Helper()
	p, err := server.Spawn(mqkvBinary(t), "--data-dir", dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

// keyState is what a writer knows of one of its keys.
type keyState struct {
	acked     bool   // a write was acknowledged
	deleted   bool   // ...and the last acknowledged write was a DEL
	value     string // last acknowledged value
	version   string // its version
	fenced    bool
	expiresIn time.Duration // PX of the last acknowledged SET, 0 for none
	ackedAt   time.Time
	pending   *string // a write sent but not acknowledged when the server died ("" + pendingDel for a DEL)
	pendDel   bool
	pendPX    time.Duration // PX of the write in flight
}

// TestCrashDurability writes from several clients, SIGKILLs the server
// mid-load, restarts it on the same directory and checks every
// acknowledged write.
func TestCrashDurability(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds and kills the binary")
	}
	dir := t.TempDir()
	p := startProcess(t, dir)

	const writers = 4
	const keysPerWriter = 25
	token := hlc.Timestamp{Wall: time.Now().UnixMilli(), Node: "crash-test"}.String()
	states := make([]map[string]*keyState, writers)
	var maxVersion hlc.Timestamp
	var mu sync.Mutex
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		states[w] = map[string]*keyState{}
		c := dialRaw(t, p, fmt.Sprintf("crash-writer-%d", w), rawOpts{cleanStart: true})
		wg.Add(1)
		go func(w int, c *rawClient) {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("w%d/k%d", w, i%keysPerWriter)
				st := states[w][key]
				if st == nil {
					st = &keyState{}
					states[w][key] = st
				}
				val := fmt.Sprintf("w%d-i%d", w, i)
				r := req{ts: now()}
				var px time.Duration
				del := false
				switch {
				case i%keysPerWriter == 0: // fenced keys
					r.args = []string{"SET", key, val}
					r.ft = &token
				case i%keysPerWriter == 1 && i%3 == 0: // expires soon
					px = 3 * time.Second
					r.args = []string{"SET", key, val, "PX", "3000"}
				case i%keysPerWriter == 2: // expires much later
					px = time.Hour
					r.args = []string{"SET", key, val, "PX", "3600000"}
				case i%7 == 3:
					del = true
					r.args = []string{"DEL", key}
				default:
					r.args = []string{"SET", key, val}
				}
				if st.fenced && r.ft == nil {
					r.ft = &token
				}
				st.pending, st.pendDel, st.pendPX = &val, del, px
				reply, err := c.trySend(r)
				if err != nil {
					return // the server died with this write in flight
				}
				var payload string
				var ts string
				select {
				case pub := <-reply:
					payload = string(pub.Payload)
					ts, _ = userProp(pub, "__ts")
				case <-stop:
					return // the server died with this write in flight
				case <-time.After(10 * time.Second):
					return
				}
				st.pending = nil
				switch {
				case del && (payload == ":1\r\n" || payload == ":0\r\n"):
					st.acked, st.deleted, st.value = true, true, ""
				case !del && payload == "+OK\r\n":
					st.acked, st.deleted, st.value, st.version = true, false, val, ts
					st.fenced = st.fenced || r.ft != nil
					st.expiresIn, st.ackedAt = px, time.Now()
					if v, err := hlc.Parse(ts); err == nil {
						mu.Lock()
						if v.Compare(maxVersion) > 0 {
							maxVersion = v
						}
						mu.Unlock()
					}
				default:
					t.Errorf("%q answered %q", r.args, payload)
					return
				}
			}
		}(w, c)
	}
	time.Sleep(1500 * time.Millisecond)
	p.Kill() // SIGKILL, mid-load
	killedAt := time.Now()
	close(stop)
	wg.Wait()
	if t.Failed() {
		return
	}

	p2 := startProcess(t, dir)
	c := dialRaw(t, p2, "crash-checker", rawOpts{cleanStart: true})
	checked, inflight := 0, 0
	for w := range states {
		for key, st := range states[w] {
			if !st.acked && st.pending == nil {
				continue
			}
			got := c.call("GET", key)
			gotTS, _ := userProp(got, "__ts")
			ackedPayload := "$-1\r\n"
			if st.acked && !st.deleted {
				ackedPayload = fmt.Sprintf("$%d\r\n%s\r\n", len(st.value), st.value)
			}
			expired := st.expiresIn > 0 && st.expiresIn < time.Minute
			switch {
			case string(got.Payload) == ackedPayload && (st.deleted || !st.acked || gotTS == st.version):
				// The acknowledged state, with its version.
			case expired && string(got.Payload) == "$-1\r\n":
				// A short TTL may have run out while the server was down.
			case st.pending != nil:
				// The write in flight at the kill may or may not have
				// made it, but only whole.
				inflight++
				want := "$-1\r\n"
				if !st.pendDel {
					want = fmt.Sprintf("$%d\r\n%s\r\n", len(*st.pending), *st.pending)
				}
				// A SET with a short TTL that made it may have run
				// out while the server was down (a CI run's restart
				// took 5.5 s: its PX 3000 SET in flight was gone).
				gone := st.pendPX > 0 && st.pendPX < time.Minute && string(got.Payload) == "$-1\r\n"
				if string(got.Payload) != want && !gone {
					t.Errorf("%s: got %q; acknowledged %q, in flight %q", key, got.Payload, ackedPayload, want)
				}
			default:
				t.Errorf("%s: got %q (version %q), acknowledged %q (version %q)", key, got.Payload, gotTS, ackedPayload, st.version)
			}
			if st.acked && !st.deleted && st.fenced && st.pending == nil {
				// The fencing token survived: a write without it is refused.
				r := c.do(req{args: []string{"SET", key, "intruder"}, ts: now()})
				if string(r.Payload) != "-ERR a fencing token is required for this request\r\n" {
					t.Errorf("%s: fencing token lost: SET without token got %q", key, r.Payload)
				}
			}
			checked++
		}
	}
	if checked < writers*keysPerWriter/2 {
		t.Fatalf("only %d keys checked", checked)
	}
	// Short TTLs survived as deadlines: those keys disappear in time.
	for w := range states {
		for key, st := range states[w] {
			if !st.acked || st.deleted || st.pending != nil || st.expiresIn != 3*time.Second {
				continue
			}
			deadline := st.ackedAt.Add(st.expiresIn)
			for string(c.call("GET", key).Payload) != "$-1\r\n" {
				if time.Now().After(deadline.Add(2 * time.Second)) {
					t.Errorf("%s: PX 3000 key still present %v after its deadline", key, time.Since(deadline))
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	// Versions keep increasing across the restart.
	r := c.call("SET", "after-restart", "v")
	v, _ := hlc.Parse(func() string { s, _ := userProp(r, "__ts"); return s }())
	if v.Compare(maxVersion) <= 0 {
		t.Fatalf("version after restart %v not above %v", v, maxVersion)
	}
	t.Logf("checked %d keys (%d with a write in flight at the kill); restart took %v", checked, inflight, time.Since(killedAt).Round(time.Millisecond))
}

var sigHUP = syscall.SIGHUP
