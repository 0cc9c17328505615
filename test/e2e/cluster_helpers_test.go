package e2e

import (
	"fmt"
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
// two nodes the first time; with broker (attach mode), the first of them
// is attached to it too, so that the test's clients are served by two
// attached processes of the cluster.
func joinCluster(t testing.TB, cfg *server.Config, broker string) {
	t.Helper()
	key := helperKey{t, cfg.DataDir}
	helpersMu.Lock()
	others := helpers[key]
	helpersMu.Unlock()
	if others == nil { // (started without the lock: a test's servers start one at a time)
		if broker != "" {
			others = pairFor(t, newPair(broker))
			awaitAttached(t, others[0])
		} else {
			others = takePair(t)
		}
		helpersMu.Lock()
		helpers[key] = others
		helpersMu.Unlock()
		t.Cleanup(func() {
			helpersMu.Lock()
			delete(helpers, key)
			helpersMu.Unlock()
		})
	}
	cfg.Cluster.Listen = "127.0.0.1:0"
	cfg.Cluster.Join = []string{others[0].ClusterAddr(), others[1].ClusterAddr()}
	if cfg.InMemory {
		cfg.Cluster.NodeID = "n2"
	}
}

// A new cluster's first node takes about three seconds to start (its
// metadata group, then its replica groups, each wait out an election
// timeout before electing themselves), so the helper pair of the next
// test starts while the current one runs.
var (
	spareOnce sync.Once
	spare     chan helperPair
)

type helperPair struct {
	nodes []*server.Server
	dirs  []string
	err   error
}

// takePair returns the two other nodes of a new cluster, closed (and
// their directories removed) when the test ends.
func takePair(t testing.TB) []*server.Server {
	t.Helper()
	spareOnce.Do(func() {
		spare = make(chan helperPair, 1)
		go startPair()
	})
	p := <-spare
	go startPair()
	return pairFor(t, p)
}

// pairFor hands p to t, closed (its directories removed) when t ends.
func pairFor(t testing.TB, p helperPair) []*server.Server {
	t.Helper()
	t.Cleanup(func() {
		for _, s := range p.nodes {
			s.Close()
		}
		for _, d := range p.dirs {
			os.RemoveAll(d)
		}
	})
	if p.err != nil {
		t.Fatal(p.err)
	}
	return p.nodes
}

// settleSpare waits until the next test's helper pair has started and
// settled, so that a test counting goroutines does not count it starting.
func settleSpare(t testing.TB) {
	t.Helper()
	if !clusterMode() || spare == nil {
		return
	}
	p := <-spare
	spare <- p
	if p.err == nil {
		eventuallyWithin(t, 60*time.Second, "the next helper pair to settle", func() bool {
			return p.nodes[0].Node().Status().Settled(2, true)
		})
	}
}

func startPair() { spare <- newPair("") }

// newPair starts the two other nodes of a new cluster; with broker, the
// first is attached to it (mqkv attach) as well as serving MQTT.
func newPair(broker string) (p helperPair) {
	for i, id := range []string{"h1", "h3"} {
		dir, err := os.MkdirTemp("", "mqkv-e2e-helper-")
		if err != nil {
			p.err = err
			return p
		}
		p.dirs = append(p.dirs, dir)
		var join []string
		if i > 0 {
			join = []string{p.nodes[0].ClusterAddr()}
		}
		cfg := server.Config{
			Listen: "127.0.0.1:0", DataDir: dir, Logger: quietLogger(),
			Cluster: server.ClusterConfig{NodeID: id, Listen: "127.0.0.1:0", Join: join, Groups: 4, Replicas: 3},
		}
		if broker != "" && i == 0 {
			attachAlso(broker)(&cfg)
		}
		s, err := server.Start(cfg)
		if err != nil {
			p.err = fmt.Errorf("helper %s: %w", id, err)
			return p
		}
		p.nodes = append(p.nodes, s)
	}
	return p
}

// awaitSettled waits until every group has its three replicas and its
// preferred leader.
func awaitSettled(t testing.TB, s *server.Server) {
	t.Helper()
	eventuallyWithin(t, 60*time.Second, "the cluster to settle", func() bool {
		return s.Node().Status().Settled(3, true)
	})
}
