package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/store"
)

// TestRealENOSPCOnAMember: the same as TestFullVolumeOnAMemberDoesNotStopIt
// with a volume that really fills (a small tmpfs) and no reserve: the
// journal's writes fail with ENOSPC, and the member stays up and catches
// up once a file is removed. Needs root (mount); skipped without.
func TestRealENOSPCOnAMember(t *testing.T) {
	t.Parallel()
	vol := filepath.Join(t.TempDir(), "vol")
	os.MkdirAll(vol, 0o700)
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", vol).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a small volume here: %v %s", err, out)
	}
	h := &harness{t: t, groups: 2}
	t.Cleanup(func() {
		for i := range h.nodes {
			h.stop(i)
		}
		exec.Command("umount", vol).Run()
	})
	filler := filepath.Join(vol, "filler")
	if err := os.WriteFile(filler, make([]byte, 12<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := h.tryStart(i, func(c *Config) {
			if i == 2 {
				c.Dir = filepath.Join(vol, "n3")
			}
		}); err != nil {
			t.Fatal(err)
		}
	}
	h.awaitReplicas(3)
	value := strings.Repeat("x", 4<<10)
	var acked []string
	for len(acked) < 20000 {
		key := fmt.Sprint("k", len(acked))
		res, err := set(t, h.nodes[0], key, value)
		if err == nil && res.Outcome == store.Applied {
			acked = append(acked, key)
		}
		if st, _ := h.nodes[2].JournalStats(); st.Full {
			break
		}
	}
	if st, _ := h.nodes[2].JournalStats(); !st.Full {
		t.Fatalf("n3's volume never filled: %+v", st)
	}
	// The cluster goes on: writes are acknowledged (once n3 leads none).
	deadline := time.Now().Add(30 * time.Second)
	for n := 0; n < 100; {
		key := fmt.Sprint("k", len(acked))
		res, err := set(t, h.nodes[0], key, value)
		if err == nil && res.Outcome == store.Applied {
			acked = append(acked, key)
			n++
		} else if time.Now().After(deadline) {
			t.Fatalf("writes are refused with n3's volume full: %v %v", res.Outcome, err)
		}
	}
	select {
	case <-h.nodes[2].Failed():
		t.Fatalf("n3 stopped: %v", h.nodes[2].Err())
	default:
	}
	os.Remove(filler)
	eventuallyT(t, 60*time.Second, "n3 to catch up", func() bool {
		for _, key := range acked {
			r := h.nodes[2].local(h.nodes[2].groupOf([]byte(key)))
			if r == nil {
				return false
			}
			if _, ok := r.Get([]byte(key)); !ok {
				return false
			}
		}
		return true
	})
}
