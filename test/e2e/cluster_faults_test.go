package e2e

import (
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Issue 33, as an operator meets it with the binary: `mqkv cluster
// remove` of a node that runs is refused; after the whole cluster
// stopped, a member restarted alone serves MQTT at once and answers state
// store requests "unavailable", saying why, until a second member is up
// (it refused connections, without a word, until then).
func TestClusterMemberRestartedAloneAnswersUnavailable(t *testing.T) {
	t.Parallel()
	c := startProcCluster(t, 3, 4)
	c.awaitSettled(0, 3)
	out, err := exec.Command(mqkvBinary(t), "cluster", "remove", "n3", "--admin", "http://"+c.admin[0]).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "mqkv cluster leave") {
		t.Fatalf("remove of a running node: %v %s, want it refused, naming leave", err, out)
	}
	for _, p := range c.procs {
		p.Kill()
	}
	c.start(1) // alone: Spawn returns once it serves
	rc := dialRaw(t, addrOnly(c.mqtt[1]), "alone", rawOpts{cleanStart: true})
	reply := rc.call("SET", "k", "v")
	if !strings.HasPrefix(string(reply.Payload), "-ERR the state store is unavailable: this node (n2) is starting") {
		t.Fatalf("a SET to a member without its quorum: %q", reply.Payload)
	}
	resp, err := http.Get("http://" + c.admin[1] + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/readyz of a member without its quorum: %d", resp.StatusCode)
	}
	c.start(2)
	eventuallyWithin(t, 60*time.Second, "the SET to succeed once a second member is up", func() bool {
		return string(rc.call("SET", "k", "v").Payload) == "+OK\r\n"
	})
}
