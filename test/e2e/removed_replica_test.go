package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/server"
)

// removedReplicaWindow starts three nodes of one group, adds a fourth, and
// returns, as soon as it happens, a node (x) whose replica the group's
// configuration no longer holds but that still has it open, and the leader.
func removedReplicaWindow(t *testing.T) (x, leader *server.Server) {
	nodes := startNodes(t, "rs", 3, func(c *server.Config) { c.Cluster.Groups = 1 })
	nodes = append(nodes, startNode(t, "rs4", []string{nodes[0].ClusterAddr()}, func(c *server.Config) { c.Cluster.Groups = 1 }))
	eventuallyWithin(t, 60*time.Second, "a replica removed from the group's configuration but still open", func() bool {
		leader = nil
		for _, s := range nodes {
			for _, r := range s.Node().Groups() {
				if _, leads := r.Leader(); leads {
					leader = s
				}
			}
		}
		if leader == nil {
			return false
		}
		var ids []string
		for _, r := range leader.Node().Groups() {
			for _, srv := range r.Raft().GetConfiguration().Configuration().Servers {
				ids = append(ids, string(srv.ID))
			}
		}
		for _, s := range nodes[:3] {
			if len(s.Node().Groups()) > 0 && !slices.Contains(ids, s.NodeID) {
				x = s
				return true
			}
		}
		return false
	})
	t.Logf("replica of %s removed from the configuration, still open; leader %s", x.NodeID, leader.NodeID)
	return x, leader
}

// TestNotifyOnNodeWithRemovedReplica: a fourth node joins a three-node
// cluster of one group, so the group's replica moves off one of the first
// three (X). While the group's configuration no longer holds X but X still
// has its replica open, a client on X registers KEYNOTIFY and another SETs
// the key: X's client must get the notification promptly, as on any other
// node; and again after 12 MiB were written to other keys (more than a
// replica's event ring keeps). X followed the group from its removed
// replica's ring until the replica was closed: the notification came 2-11 s
// late, or, when the rings moved past it meanwhile, never (found by
// review).
func TestNotifyOnNodeWithRemovedReplica(t *testing.T) {
	t.Parallel()
	x, leader := removedReplicaWindow(t)
	obs := dialRaw(t, x, "rs-obs", rawOpts{cleanStart: true})
	expectPayload(t, obs.call("KEYNOTIFY", "rs/k"), "+OK\r\n")
	wr := dialRaw(t, leader, "rs-wr", rawOpts{cleanStart: true})
	start := time.Now()
	expectPayload(t, wr.call("SET", "rs/k", "v1"), "+OK\r\n")
	if _, ok := obs.nextPublish(30 * time.Second); !ok {
		t.Fatalf("the SET of rs/k, made after the client's KEYNOTIFY on %s was answered +OK, never reached it (waited 30 s)", x.NodeID)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("the notification reached the client on %s %v after the SET: its node followed the group from its removed replica's ring", x.NodeID, d.Round(time.Millisecond))
	}
	big := strings.Repeat("x", 512<<10)
	for i := 0; i < 24; i++ {
		// 12 MiB of writes on a loaded machine may see an election (CI
		// did: "the outcome of the write is unknown"); a SET is sent
		// again then, as a client would: these keys only fill the log.
		p := wr.call("SET", fmt.Sprintf("rs/big%d", i), big)
		for try := 0; try < 3 && strings.Contains(string(p.Payload), "outcome of the write is unknown"); try++ {
			p = wr.call("SET", fmt.Sprintf("rs/big%d", i), big)
		}
		expectPayload(t, p, "+OK\r\n")
	}
	expectPayload(t, wr.call("SET", "rs/k", "v2"), "+OK\r\n")
	if p, ok := obs.nextPublish(30 * time.Second); !ok || !strings.Contains(string(p.Payload), "v2") {
		t.Fatalf("the second SET of rs/k never reached the client on %s", x.NodeID)
	}
}
