package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/client"
	"github.com/mqkv/mqkv/internal/server"
)

// hostsEnv names the hosts file a TestJoinByName child process runs
// with, bind-mounted over /etc/hosts in a mount namespace of its own.
const hostsEnv = "MQKV_TEST_HOSTS_FILE"

// TestJoinByName: members named by DNS names, as an orchestrator's
// stable names (a StatefulSet behind a headless Service) give them: a
// cluster joined through a name, every member advertising a name, and a
// member started again on another IP address under the same name is
// found there by the others, because a name is resolved again each time
// a connection is made. The names live in a hosts file of the test's own
// (bind-mounted over /etc/hosts in a mount namespace: root only), so the
// address behind a name can change.
func TestJoinByName(t *testing.T) {
	hosts := os.Getenv(hostsEnv)
	if hosts == "" {
		if testing.Short() {
			t.Skip("runs itself again in a mount namespace")
		}
		if os.Geteuid() != 0 {
			t.Skip("needs root: the names live in a hosts file bind-mounted over /etc/hosts in a mount namespace")
		}
		unshare, err := exec.LookPath("unshare")
		if err != nil {
			t.Skip("no unshare(1)")
		}
		probe := exec.Command(unshare, "--mount", "--propagation", "private", "mount", "--bind", "/etc/hosts", "/etc/hosts")
		if out, err := probe.CombinedOutput(); err != nil {
			t.Skipf("no mount namespace here: %v: %s", err, out)
		}
		t.Parallel()
		hosts = filepath.Join(t.TempDir(), "hosts")
		if err := os.WriteFile(hosts, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		// The child mounts the file over /etc/hosts in a namespace of
		// its own and runs this test alone.
		cmd := exec.Command(unshare, "--mount", "--propagation", "private", "sh", "-c",
			`mount --bind "$0" /etc/hosts && exec "$1" -test.run '^TestJoinByName$' -test.v -test.count=1`, hosts, os.Args[0])
		cmd.Env = append(os.Environ(), hostsEnv+"="+hosts)
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS: TestJoinByName") {
			t.Fatalf("in its mount namespace: %v\n%s", err, out)
		}
		return
	}

	// In the namespace: /etc/hosts is hosts.
	names := map[string]string{"n1": "127.0.0.2", "n2": "127.0.0.3", "n3": "127.0.0.4"}
	writeHosts := func() {
		var b strings.Builder
		b.WriteString("127.0.0.1 localhost\n")
		for n, ip := range names {
			fmt.Fprintf(&b, "%s %s.mqkv.test\n", ip, n)
		}
		if err := os.WriteFile(hosts, []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeHosts()
	port := func(ip string) string {
		ln, err := net.Listen("tcp", ip+":0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		_, p, _ := net.SplitHostPort(ln.Addr().String())
		return p
	}
	ports := map[string]string{}
	dirs := map[string]string{}
	start := func(n string, join []string) *server.Server {
		s, err := server.Start(server.Config{Listen: "127.0.0.1:0", DataDir: dirs[n], Logger: quietLogger(),
			Cluster: server.ClusterConfig{NodeID: n, Listen: names[n] + ":" + ports[n], Advertise: n + ".mqkv.test:" + ports[n], Join: join, Groups: 4}})
		if err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		return s
	}
	nodes := map[string]*server.Server{}
	for _, n := range []string{"n1", "n2", "n3"} {
		ports[n], dirs[n] = port(names[n]), t.TempDir()
		var join []string
		if n != "n1" {
			join = []string{"n1.mqkv.test:" + ports["n1"]} // by name
		}
		nodes[n] = start(n, join)
	}
	t.Cleanup(func() {
		for _, s := range nodes {
			s.Close()
		}
	})
	awaitSettled(t, nodes["n1"])
	for _, m := range nodes["n1"].Node().Status().Nodes {
		if !strings.HasSuffix(strings.Split(m.Addr, ":")[0], ".mqkv.test") {
			t.Fatalf("member %s is known by %q, want its name", m.ID, m.Addr)
		}
	}

	// n3 moves to another address under its name: stopped, the name
	// changed, started again on its data there.
	nodes["n3"].Close()
	delete(nodes, "n3")
	names["n3"] = "127.0.0.5"
	writeHosts()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dial := func(s *server.Server) *client.Client {
		c, err := client.Dial(ctx, client.Config{URL: "mqtt://" + s.Addr()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	c1 := dial(nodes["n1"])
	for i := range 20 { // while n3 is away: its groups take them without it
		if _, err := c1.Set(ctx, []byte(fmt.Sprintf("moved/%d", i)), []byte("v")); err != nil {
			t.Fatalf("moved/%d with n3 away: %v", i, err)
		}
	}
	nodes["n3"] = start("n3", nil)
	// Settled: every group has its three replicas and its preferred
	// leader, n3 included, which the leaders of its groups hand
	// leadership to only once they reached it (at its new address) and
	// it caught up.
	awaitSettled(t, nodes["n1"])
	c3 := dial(nodes["n3"])
	for i := range 20 {
		v, err := c3.Get(ctx, []byte(fmt.Sprintf("moved/%d", i)))
		if err != nil || string(v.Value) != "v" {
			t.Fatalf("moved/%d through the moved member: %q, %v", i, v.Value, err)
		}
	}
}

// TestSameJoinListOnEveryNode: every node given the same --join, its own
// address included, as a StatefulSet gives its pods one list of names:
// started in order, the first creates the cluster (no data, first in the
// list, no other answers) and the others join through it. The first node
// started again without its data while the others run does not create a
// second cluster: it asks to join, and is refused with what to do
// (remove the member whose data is lost, then start it again).
func TestSameJoinListOnEveryNode(t *testing.T) {
	skipInCluster(t, "starts its own cluster")
	t.Parallel()
	var link []string
	for range 3 {
		link = append(link, freePort(t))
	}
	dirs := []string{t.TempDir(), t.TempDir(), t.TempDir()}
	start := func(i int) (*server.Server, error) {
		return server.Start(server.Config{Listen: "127.0.0.1:0", DataDir: dirs[i], Logger: quietLogger(),
			Cluster: server.ClusterConfig{NodeID: fmt.Sprint("j", i+1), Listen: link[i], Join: link, Groups: 4}})
	}
	var nodes []*server.Server
	t.Cleanup(func() {
		for _, s := range nodes {
			s.Close()
		}
	})
	for i := range 3 {
		s, err := start(i)
		if err != nil {
			t.Fatalf("j%d: %v", i+1, err)
		}
		nodes = append(nodes, s)
	}
	awaitSettled(t, nodes[2])
	if n := len(nodes[2].Node().Status().Nodes); n != 3 {
		t.Fatalf("%d members, want 3", n)
	}

	// j1 loses its data while j2 and j3 run.
	nodes[0].Close()
	nodes = nodes[1:]
	if err := os.RemoveAll(dirs[0]); err != nil {
		t.Fatal(err)
	}
	s, err := start(0)
	if err == nil {
		nodes = append(nodes, s)
		t.Fatalf("j1 without its data started (members it sees: %d): a second cluster?", len(s.Node().Status().Nodes))
	}
	if !strings.Contains(err.Error(), "already a member") || !strings.Contains(err.Error(), "mqkv cluster remove j1") {
		t.Fatalf("j1 without its data refused, but not told what to do: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, client.Config{URL: "mqtt://" + nodes[0].Addr()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Set(ctx, []byte("still"), []byte("one cluster")); err != nil {
		t.Fatalf("the two members left: %v", err)
	}
}
