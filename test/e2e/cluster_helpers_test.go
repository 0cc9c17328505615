package e2e

import (
	"os"
	"sync"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/server"
)

// With MQKV_E2E_CLUSTER=1 every test's server is the second node of a
// three-node cluster (in this process, on loopback, 4 groups, RF 3): the
// same tests then run through a node that leads only some groups and
// forwards the rest. .ci/run runs the suite both ways.
func clusterMode() bool { return os.Getenv("MQKV_E2E_CLUSTER") != "" }

// skipInCluster skips a test of something a cluster does not offer (yet).
func skipInCluster(t testing.TB, why string) {
	t.Helper()
	if clusterMode() {
		t.Skip("not in a cluster: " + why)
	}
}

// helperKey names a cluster: a test's server on one data directory (a
// restart on the same directory rejoins the same cluster).
type helperKey struct {
	t   testing.TB
	dir string
}

var (
	helpersMu sync.Mutex
	helpers   = map[helperKey][]*server.Server{}
)

// joinCluster makes cfg the second node of its cluster, starting the other
// two nodes the first time.
func joinCluster(t testing.TB, cfg *server.Config) {
	t.Helper()
	helpersMu.Lock()
	defer helpersMu.Unlock()
	key := helperKey{t, cfg.DataDir}
	others := helpers[key]
	if others == nil {
		first := startHelper(t, "h1", nil)
		third := startHelper(t, "h3", []string{first.ClusterAddr()})
		others = []*server.Server{first, third}
		helpers[key] = others
		t.Cleanup(func() {
			helpersMu.Lock()
			delete(helpers, key)
			helpersMu.Unlock()
			for _, s := range others {
				s.Close()
			}
		})
	}
	cfg.Cluster.Listen = "127.0.0.1:0"
	cfg.Cluster.Join = []string{others[0].ClusterAddr(), others[1].ClusterAddr()}
	if cfg.InMemory {
		cfg.Cluster.NodeID = "n2"
	}
}

func startHelper(t testing.TB, id string, join []string) *server.Server {
	t.Helper()
	s, err := server.Start(server.Config{
		Listen: "127.0.0.1:0", DataDir: t.TempDir(), Logger: quietLogger(),
		Cluster: server.ClusterConfig{NodeID: id, Listen: "127.0.0.1:0", Join: join, Groups: 4, Replicas: 3},
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// awaitSettled waits until every group has its three replicas and its
// preferred leader.
func awaitSettled(t testing.TB, s *server.Server) {
	t.Helper()
	eventuallyWithin(t, 60*time.Second, "the cluster to settle", func() bool {
		return s.Node().Status().Settled(3, true)
	})
}
