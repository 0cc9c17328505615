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
	for _, c := range []struct{ godebug, want string }{
		{"madvdontneed=1", "madvdontneed=1,schedtrace=2147483647"},
		{"schedtrace=0", "schedtrace=0"}, // the user's, left alone
	} {
		t.Setenv("GODEBUG", c.godebug)
		p, err := server.Spawn(mqkvBinary(t), "--in-memory")
		if err != nil {
			t.Fatal(err)
		}
		got := godebugOf(t, p)
		p.Kill()
		if len(got) != 1 || got[0] != c.want {
			t.Fatalf("GODEBUG=%s: the server runs with %q, want exactly [%s]", c.godebug, got, c.want)
		}
	}
}
