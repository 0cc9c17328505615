package cluster

import (
	"fmt"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
)

// A member whose data volume fills up stays up: its replicas take no more
// log entries (and it leads no group), the cluster goes on acknowledging
// writes with the other replicas, and once space is freed the member
// catches up by itself, every acknowledged write in its replicas. Before,
// replication filled its journal to ENOSPC and the process exited.
// (The volume is "filled" by raising the member's reserve above its free
// space; a real ENOSPC takes the same path, see journal.ErrNoSpace.)
func TestFullVolumeOnAMemberDoesNotStopIt(t *testing.T) {
	t.Parallel()
	h := &harness{t: t, groups: 4}
	guards := make([]*replica.DiskGuard, 3)
	for i := range 3 {
		if err := h.tryStart(i, func(c *Config) {
			guards[i] = replica.NewDiskGuard(c.Dir, 1, quiet())
			c.Disk = guards[i]
		}); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for i := range h.nodes {
			h.stop(i)
			guards[i].Close()
		}
	})
	h.awaitReplicas(3)

	guards[2].SetReserve(1 << 62) // n3's volume is full
	var acked []string
	write := func(n int) {
		for i := 0; i < n; i++ {
			key := fmt.Sprint("full-", len(acked))
			res, err := set(t, h.nodes[0], key, "v")
			if err != nil || res.Outcome != store.Applied {
				t.Fatalf("write %s with n3's volume full: %v %v", key, res.Outcome, err)
			}
			acked = append(acked, key)
		}
	}
	// Its groups' leadership moves to replicas that take entries (until
	// it does, n3 refuses writes to them as the volume's guard does).
	eventuallyT(t, 20*time.Second, "n3 to lead no group", func() bool {
		for _, r := range h.nodes[2].Groups() {
			if id, _ := r.Leader(); id == "n3" {
				return false
			}
		}
		return true
	})
	write(400)
	if st, _ := h.nodes[2].JournalStats(); st.Refused == 0 || !st.Full {
		t.Fatalf("n3's journal: %+v, want appends refused", st)
	}
	select {
	case <-h.nodes[2].Failed():
		t.Fatalf("n3 stopped: %v", h.nodes[2].Err())
	default:
	}
	if st := h.nodes[0].Status(); !volumeFull(st, "n3") {
		t.Fatalf("the status does not say n3's volume is full: %+v", st.Nodes)
	}

	guards[2].SetReserve(1) // space is freed
	eventuallyT(t, 30*time.Second, "n3 to catch up", func() bool {
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
	if st, _ := h.nodes[2].JournalStats(); st.Full {
		t.Fatalf("n3's journal still refuses: %+v", st)
	}
}

func volumeFull(st Status, id string) bool {
	for _, n := range st.Nodes {
		if n.ID == id {
			return n.VolumeFull
		}
	}
	return false
}
