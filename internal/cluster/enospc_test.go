package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

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
	// Elections while n3 is full: it must save each new term and its vote
	// (hashicorp/raft panics when it cannot; the member stopped so when a
	// group changed leaders under load).
	terms := func() (sum uint64) {
		for _, r := range h.nodes[2].Groups() {
			sum += r.Raft().CurrentTerm()
		}
		return sum + h.nodes[2].meta.CurrentTerm()
	}
	// The zeros n3's segment wrote ahead of its records would hold the
	// terms of many elections: a stable value of a group no replica uses
	// takes them first, as months of elections would.
	slack := h.nodes[2].journal.Group(1 << 30)
	for size, i := 64<<10, 0; size >= 16; i++ {
		err := slack.Set([]byte(fmt.Sprint("slack", i)), make([]byte, size))
		if st, _ := h.nodes[2].JournalStats(); st.SpareReleased {
			break
		}
		if err != nil {
			size /= 2
		}
	}
	before := terms()
	for i := range 2 {
		for _, r := range h.nodes[i].Groups() {
			if r.Raft().State() == raft.Leader {
				r.TransferLeadership("", "").Error()
			}
		}
		if h.nodes[i].meta.State() == raft.Leader {
			h.nodes[i].meta.LeadershipTransfer().Error()
		}
	}
	eventuallyT(t, 30*time.Second, "n3 to take the new terms of its groups", func() bool { return terms() > before })
	for n := 0; n < 20; {
		key := fmt.Sprint("k", len(acked))
		if res, err := set(t, h.nodes[0], key, value); err == nil && res.Outcome == store.Applied {
			acked = append(acked, key)
			n++
		} else if time.Now().After(deadline.Add(30 * time.Second)) {
			t.Fatalf("writes are refused after the elections: %v %v", res.Outcome, err)
		}
	}
	if st, _ := h.nodes[2].JournalStats(); !st.Full {
		t.Fatalf("n3's volume has room again, the elections were not held on a full volume: %+v", st)
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
