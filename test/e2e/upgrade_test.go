package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/iot-operations-sdks/go/protocol/hlc"
	"github.com/Azure/iot-operations-sdks/go/services/leasedlock"
	"github.com/Azure/iot-operations-sdks/go/services/statestore"

	"github.com/mqkv/mqkv/client"
	"github.com/mqkv/mqkv/internal/cluster"
	"github.com/mqkv/mqkv/internal/server"
)

// TestRollingUpgrade upgrades a three-node cluster of the previous
// release (see previousBinary) one node at a time to this tree's build,
// as an operator does (SIGTERM, the new binary started on the same data
// directory and addresses, the cluster settled before the next): two
// nodes, then one rolled back to the previous release and upgraded again
// while the cluster still runs at the previous release's protocol (the
// third node speaks only it), then the third, after which the cluster
// moves to this release's protocol. All under clients doing SET, SET NX,
// GET, DEL and VDEL through every node, a lock holder on two nodes and a
// watcher on the third. The history must be linearizable (porcupine): no
// acknowledged write lost, no stale read, across both releases.
func TestRollingUpgrade(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three processes of two releases")
	}
	skipInCluster(t, "starts its own cluster")
	t.Parallel()
	prev := previousBinary(t)
	c := startProcClusterOf(t, 3, 4, []string{prev, prev, prev})
	c.awaitSettled(0, 3)
	_, stop := load(c.mqtt)
	notified := watchAcrossUpgrade(t, c.mqtt)
	locked := lockAcrossUpgrade(t, c.mqtt)
	type window struct {
		node       int
		begin, end time.Time
	}
	var windows []window
	replace := func(i int, bin, what string) {
		time.Sleep(time.Second) // some load on each configuration
		t.Logf("n%d: %s", i+1, what)
		begin := time.Now()
		c.procs[i].Stop() // SIGTERM: it hands its leaderships over first
		c.bins[i] = bin
		c.start(i)
		c.awaitSettled((i+1)%3, 3)
		windows = append(windows, window{i, begin, time.Now()})
	}
	protocol := func(want int) {
		t.Helper()
		st, err := c.status(1)
		if err != nil {
			t.Fatal(err)
		}
		if st.Protocol != want {
			t.Fatalf("the cluster runs at protocol %d, want %d", st.Protocol, want)
		}
	}
	cur := mqkvBinary(t)
	replace(0, cur, "upgraded")
	replace(1, cur, "upgraded")
	protocol(1) // n3 speaks 1 only: the previous release
	replace(0, prev, "rolled back to the previous release")
	replace(0, cur, "upgraded again")
	protocol(1)
	replace(2, cur, "upgraded")
	// Every member speaks this release's protocol: the cluster moves to
	// it, and forwards writes and reads in their binary form.
	eventuallyWithin(t, 30*time.Second, "the cluster to run at this release's protocol", func() bool {
		st, err := c.status(1)
		return err == nil && st.Protocol == cluster.ProtocolMax
	})
	time.Sleep(time.Second)
	h := stop()
	notified()
	locked()
	h.mu.Lock()
	// The clients of the nodes not being replaced saw no failure: the
	// stopping node handed its leaderships over first (load puts worker
	// w on node w%3).
	for _, f := range h.failed {
		for _, w := range windows {
			if f.client%3 != w.node && !f.at.Before(w.begin) && !f.at.After(w.end) {
				h.mu.Unlock()
				t.Fatalf("worker %d (on n%d) got no answer at %v, while n%d was replaced", f.client, f.client%3+1, f.at.Sub(w.begin).Round(time.Millisecond), w.node+1)
			}
		}
	}
	ops, unknown := len(h.ops), 0
	for _, op := range h.ops {
		if op.Output.(kvOutput).unknown {
			unknown++
		}
	}
	h.mu.Unlock()
	if ops < 200 {
		t.Fatalf("only %d operations", ops)
	}
	checkLinearizable(t, h, fmt.Sprintf("across the upgrade and the rollback (%d with unknown outcome)", unknown))
}

// watchAcrossUpgrade has a client on the last node watch a key that a
// client on the second node sets to 1, 2, 3, ... while the nodes are
// replaced; the returned func stops the writer and checks that every
// acknowledged value was notified, in order, without a resync event: the
// watcher's client registers again after each reconnect with KEYNOTIFY
// ... SINCE its last version, and its restarted node replays what it
// missed from its change history, which began with another member's
// recent changes (a resync event would say the server could not:
// notifications lost, covered by the key's current value).
func watchAcrossUpgrade(t *testing.T, addrs []string) func() {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	dial := func(addr string) *client.Client {
		dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
		defer dcancel()
		cl, err := client.Dial(dctx, client.Config{URL: "mqtt://" + addr})
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	watcher, writer := dial(addrs[2]), dial(addrs[1])
	key := []byte("upgrade/watched")
	w, err := watcher.Watch(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		got     []notified
		resyncs int
	)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for ev := range w.Events() {
			mu.Lock()
			if ev.Resync {
				resyncs++
			}
			got = append(got, notified{string(ev.Value), ev.Resync})
			mu.Unlock()
		}
	}()
	var acked []int
	written := make(chan struct{})
	go func() {
		defer close(written)
		for i := 1; ctx.Err() == nil; i++ {
			sctx, scancel := context.WithTimeout(ctx, 3*time.Second)
			_, err := writer.Set(sctx, key, []byte(strconv.Itoa(i)))
			scancel()
			if err == nil {
				acked = append(acked, i)
			} else {
				time.Sleep(50 * time.Millisecond)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	return func() {
		t.Helper()
		cancel()
		<-written
		writer.Close()
		last := strconv.Itoa(acked[len(acked)-1])
		eventuallyWithin(t, 20*time.Second, "the last acknowledged SET's notification", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return slices.Contains(got, notified{last, false}) || slices.Contains(got, notified{last, true})
		})
		watcher.Close()
		<-watched
		// Every acknowledged value was notified, in order, and none had
		// to be covered by a resync (the client's event after a reconnect
		// whose KEYNOTIFY ... SINCE the server could not replay).
		seen := map[string]bool{}
		prevN := 0
		for i, ev := range got {
			n, _ := strconv.Atoi(ev.value)
			if n < prevN {
				t.Fatalf("notification %d: value %d after %d: out of order", i, n, prevN)
			}
			if ev.resync {
				t.Fatalf("notification %d: a resync to value %d after %d: changes not replayed (%d acknowledged, %d notifications)", i, n, prevN, len(acked), len(got))
			}
			prevN = n
			seen[ev.value] = true
		}
		for _, a := range acked {
			if !seen[strconv.Itoa(a)] {
				t.Fatalf("SET %d acknowledged and never notified (%d acknowledged, %d notifications, %d resyncs)", a, len(acked), len(got), resyncs)
			}
		}
		t.Logf("%d acknowledged SETs, notified in order across the upgrade (%d notifications, %d resyncs)", len(acked), len(got), resyncs)
	}
}

// notified is a value a watcher was told of.
type notified struct {
	value  string
	resync bool
}

// previousBinary is the previous release's mqkv: MQKV_PREVIOUS_BINARY, or
// built from the commit .ci/previous-release names, out of the
// repository's history. Without either the test is skipped, unless
// MQKV_REQUIRE_UPGRADE is set (.ci/run sets it).
func previousBinary(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("MQKV_PREVIOUS_BINARY"); p != "" {
		return p
	}
	skip := t.Skipf
	if os.Getenv("MQKV_REQUIRE_UPGRADE") != "" {
		skip = t.Fatalf
	}
	b, err := os.ReadFile("../../.ci/previous-release")
	if err != nil {
		skip("no previous release named: %v", err)
	}
	commit := strings.TrimSpace(string(b))
	dir := t.TempDir()
	archive := exec.Command("git", "archive", "--format=tar", commit)
	archive.Dir = "../.."
	tarball, err := archive.Output()
	if err != nil {
		skip("the previous release (%s) is not in this clone's history: %v", commit, err)
	}
	untar := exec.Command("tar", "-x", "-C", dir)
	untar.Stdin = bytes.NewReader(tarball)
	if out, err := untar.CombinedOutput(); err != nil {
		t.Fatalf("unpacking %s: %v\n%s", commit, err, out)
	}
	bin := filepath.Join(dir, "mqkv-previous")
	build := exec.Command("go", "build", "-o", bin, "./cmd/mqkv")
	build.Dir = dir
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the previous release (%s): %v\n%s", commit, err, out)
	}
	return bin
}

// TestNewerDataFormatRefused: a data directory marked with a newer data
// format than this release reads is refused at start with a message that
// names both, and nothing in it is touched; a new one is marked with this
// release's.
func TestNewerDataFormatRefused(t *testing.T) {
	t.Parallel()
	fresh := t.TempDir()
	s := startServerIn(t, fresh)
	s.Close()
	if b, err := os.ReadFile(filepath.Join(fresh, "FORMAT")); err != nil || strings.TrimSpace(string(b)) != fmt.Sprintf("mqkv data format %d", server.DataFormat) {
		t.Fatalf("a new data directory's marker: %q, %v", b, err)
	}

	dir := t.TempDir()
	newer := fmt.Sprintf("mqkv data format %d\n", server.DataFormat+1)
	if err := os.WriteFile(filepath.Join(dir, "FORMAT"), []byte(newer), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := server.Start(server.Config{Listen: "127.0.0.1:0", DataDir: dir, Logger: quietLogger()})
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("data format %d", server.DataFormat+1)) || !strings.Contains(err.Error(), fmt.Sprintf("data format %d at most", server.DataFormat)) {
		t.Fatalf("a newer data format: %v", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 2 { // FORMAT and the lock file
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Fatalf("the refused data directory was written to: %v", names)
	}
}

// lockAcrossUpgrade has two clients, on the second and third nodes,
// take turns holding a leased lock (the AIO SDK's, with its fencing
// token) while the nodes are replaced. A holder writes its name to a key
// with its token, checks that the key still holds it, and releases: the
// returned func stops them and fails the test if a holder, within its
// lease, found another's name (the lock held twice), or if fencing
// tokens of successive holders did not increase.
func lockAcrossUpgrade(t *testing.T, addrs []string) func() {
	t.Helper()
	const term = 3 * time.Second
	name, protected := "upgrade/lock", "upgrade/protected"
	stop := make(chan struct{})
	var (
		mu         sync.Mutex
		violations []string
		tokens     []hlc.HybridLogicalClock
		holds      int
	)
	var wg sync.WaitGroup
	for i, addr := range addrs[1:3] {
		ts := &testServer{}
		ts.host, ts.port = hostPort(t, addr)
		c := newSDKClientID(t, ts, fmt.Sprintf("locker-%d", i+2))
		lease := leasedlock.NewLease(c.store, name)
		me := c.store.ID()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), term)
				began := time.Now()
				ok, err := lease.Acquire(ctx, term)
				if err != nil || !ok {
					cancel()
					time.Sleep(20 * time.Millisecond)
					continue
				}
				token, err := lease.Token(ctx)
				if err == nil {
					_, err = c.store.Set(ctx, protected, me, statestore.WithFencingToken(token))
				}
				var held string
				if err == nil {
					var got *getResponse
					if got, err = c.store.Get(ctx, protected); err == nil {
						held = got.Value
					}
				}
				within := time.Since(began) < term-500*time.Millisecond
				// Recorded before the release, while the lock is held, so
				// that the tokens are in the order of the holds (recorded
				// after it, a holder delayed between its release and the
				// record came after the next holder's: CI, under load).
				mu.Lock()
				if err == nil && within {
					holds++
					tokens = append(tokens, token)
					if held != me {
						violations = append(violations, fmt.Sprintf("%s held the lock (token %v) and found %q", me, token, held))
					}
				}
				mu.Unlock()
				lease.Release(ctx)
				cancel()
			}
		}()
	}
	return func() {
		close(stop)
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		if len(violations) > 0 {
			t.Fatalf("the lock was held twice: %v", violations)
		}
		if holds < 10 {
			t.Fatalf("the lock was held only %d times across the upgrade", holds)
		}
		// Each holder's token is newer than the one before (recorded in
		// the order of the holds, which do not overlap).
		for i := 1; i < len(tokens); i++ {
			if tokens[i].Compare(tokens[i-1]) <= 0 {
				t.Fatalf("fencing token %v after %v: not increasing", tokens[i], tokens[i-1])
			}
		}
		t.Logf("the lock held %d times across the upgrade, never twice at once", holds)
	}
}
