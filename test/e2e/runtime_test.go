package e2e

import (
	"fmt"
	"os"
	"strings"
	"testing"

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

// TestServeKeepsSysmonAwake: `mqkv serve` runs with a schedtrace period
// in GODEBUG, which keeps the runtime's monitor thread out of its deep
// sleep (the cost it saves is in docs/benchmarks.md), keeping the user's
// other settings; a user's own schedtrace, 0 included, is left alone.
func TestServeKeepsSysmonAwake(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	t.Setenv("GODEBUG", "madvdontneed=1")
	p, err := server.Spawn(mqkvBinary(t), "--in-memory")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	if got := godebugOf(t, p); len(got) != 1 || got[0] != "madvdontneed=1,schedtrace=2147483647" {
		t.Fatalf("GODEBUG %q, want exactly [madvdontneed=1,schedtrace=2147483647]", got)
	}

	t.Setenv("GODEBUG", "schedtrace=0")
	p2, err := server.Spawn(mqkvBinary(t), "--in-memory")
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Kill()
	if got := godebugOf(t, p2); len(got) != 1 || got[0] != "schedtrace=0" {
		t.Fatalf("GODEBUG %q, want the user's [schedtrace=0]", got)
	}
}
