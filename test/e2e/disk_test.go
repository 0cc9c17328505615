package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/mqkv/mqkv/internal/server"
)

// smallVolume mounts a tmpfs of size bytes on a fresh directory for the
// test, or skips the test where it cannot (not root, no mount(8)).
func smallVolume(t *testing.T, size int) string {
	t.Helper()
	dir := t.TempDir()
	out, err := exec.Command("mount", "-t", "tmpfs", "-o", fmt.Sprintf("size=%d", size), "tmpfs", dir).CombinedOutput()
	if err != nil {
		t.Skipf("cannot mount a small filesystem here (needs root): %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", "-l", dir).Run() })
	return dir
}

// fill writes a file until the volume has no space left.
func fill(t *testing.T, path string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 1<<20)
	for {
		if _, err := f.Write(chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			return
		}
	}
}

// TestFullDiskRefusesWritesUntilSpaceIsBack: when the data volume fills
// up, SETs get a clear -ERR while reads and deletes go on, the log says so
// once, and writes resume by themselves once space is freed: no restart,
// no acknowledged write lost.
func TestFullDiskRefusesWritesUntilSpaceIsBack(t *testing.T) {
	if clusterMode() {
		t.Skip("one node's volume")
	}
	vol := smallVolume(t, 320<<20)
	var log lockedBuffer
	dir := filepath.Join(vol, "data")
	s := startServerIn(t, dir, withLog(&log), withLimits(server.Limits{DiskReserve: 64 << 20}))
	c := dialRaw(t, s, "writer", rawOpts{cleanStart: true})
	for i := range 100 {
		expectPayload(t, c.call("SET", fmt.Sprintf("k%d", i), "v"), "+OK\r\n")
	}

	fill(t, filepath.Join(vol, "ballast"))
	eventually(t, "SETs refused on the full volume", func() bool {
		p := c.call("SET", "probe", "v")
		return strings.HasPrefix(string(p.Payload), "-ERR the data volume is nearly full")
	})
	for i := range 50 {
		p := c.call("SET", fmt.Sprintf("refused%d", i), "v")
		if !strings.Contains(string(p.Payload), "free space to resume writes") {
			t.Fatalf("SET on a full volume: %q", p.Payload)
		}
	}
	expectPayload(t, c.call("GET", "k1"), "$1\r\nv\r\n")
	expectPayload(t, c.call("DEL", "k2"), ":1\r\n")
	if n := log.count("nearly full"); n != 1 {
		t.Fatalf("%d log lines about the full volume, want 1:\n%s", n, log.b.String())
	}

	if err := os.Remove(filepath.Join(vol, "ballast")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "SETs accepted again", func() bool {
		return string(c.call("SET", "after", "v").Payload) == "+OK\r\n"
	})
	if log.count("writes resume") != 1 {
		t.Fatalf("no log line says writes resumed:\n%s", log.b.String())
	}

	// Nothing acknowledged was lost, and the log goes on after a restart.
	s.Close()
	s = startServerIn(t, dir)
	c = dialRaw(t, s, "reader", rawOpts{cleanStart: true})
	expectPayload(t, c.call("GET", "k99"), "$1\r\nv\r\n")
	expectPayload(t, c.call("GET", "after"), "$1\r\nv\r\n")
	expectPayload(t, c.call("GET", "k2"), "$-1\r\n")
	expectPayload(t, c.call("GET", "refused0"), "$-1\r\n")
}
