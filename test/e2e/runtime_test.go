package e2e

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/server"
)

// godebugOf returns the GODEBUG the process runs with.
func godebugOf(t *testing.T, p *server.Process) []string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", p.Pid()))
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, kv := range strings.Split(string(b), "\x00") {
		if v, ok := strings.CutPrefix(kv, "GODEBUG="); ok {
			found = append(found, v)
		}
	}
	return found
}

// TestServeKeepsSysmonAwake: `mqkv serve --sysmon-awake` runs with a
// schedtrace period in GODEBUG, which keeps the runtime's monitor thread
// out of its deep sleep (the cost it saves is in docs/benchmarks.md),
// keeping the user's other settings; a user's own schedtrace, 0
// included, is left alone. Without the flag the environment is the
// user's, untouched: the period makes the runtime print SCHED lines a log
// pipeline cannot parse.
func TestServeKeepsSysmonAwake(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	for _, c := range []struct {
		flag          bool
		godebug, want string
	}{
		{false, "madvdontneed=1", "madvdontneed=1"},
		{true, "madvdontneed=1", "madvdontneed=1,schedtrace=2147483647"},
		{true, "schedtrace=0", "schedtrace=0"}, // the user's, left alone
	} {
		t.Setenv("GODEBUG", c.godebug)
		args := []string{"--in-memory"}
		if c.flag {
			args = append(args, "--sysmon-awake")
		}
		p, err := server.Spawn(mqkvBinary(t), args...)
		if err != nil {
			t.Fatal(err)
		}
		got := godebugOf(t, p)
		p.Kill()
		if len(got) != 1 || got[0] != c.want {
			t.Fatalf("%v with GODEBUG=%s: the server runs with %q, want exactly [%s]", args, c.godebug, got, c.want)
		}
	}
}

// TestServeSizesSchedulerToLoad: a node on its own runs one P while idle
// (internal/procs says why); a GOMAXPROCS of the user's, or being a
// cluster member, leaves the runtime's count alone.
func TestServeSizesSchedulerToLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	defaultProcs := runtime.GOMAXPROCS(0) // the runtime's own count here, as in the children
	if defaultProcs < 2 {
		t.Skip("one CPU: nothing to size")
	}
	procsOf := func(p *server.Process) float64 {
		return metric(t, "http://"+p.AdminAddr(), "go_sched_gomaxprocs_threads", nil)
	}
	spawn := func(args ...string) *server.Process {
		p, err := server.Spawn(mqkvBinary(t), append([]string{"--admin-listen", "127.0.0.1:0"}, args...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Kill)
		return p
	}
	alone := spawn("--in-memory")
	eventuallyWithin(t, 10*time.Second, "one P on an idle node", func() bool { return procsOf(alone) == 1 })

	t.Setenv("GOMAXPROCS", "2")
	pinned := spawn("--in-memory")
	os.Unsetenv("GOMAXPROCS")
	member := spawn("--data-dir", t.TempDir(), "--cluster-listen", "127.0.0.1:0")
	// Nothing to wait for: the controller would have set one P at once.
	// Two of its ticks leave it time to show.
	time.Sleep(2 * time.Second)
	if got := procsOf(pinned); got != 2 {
		t.Errorf("with GOMAXPROCS=2: %v Ps", got)
	}
	if got := procsOf(member); got != float64(defaultProcs) {
		t.Errorf("a cluster member: %v Ps, want the runtime's %d", got, defaultProcs)
	}
}
