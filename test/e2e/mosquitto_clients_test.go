package e2e

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

// Debian's mosquitto_sub and mosquitto_pub, the tools an operator reaches
// for first, against different nodes of a cluster: a subscriber on one
// node gets what is published on another, with MQTT 5 and 3.1.1, QoS 0,
// 1 and 2, and a retained message published before it subscribed.
func TestMosquittoClientsAcrossNodes(t *testing.T) {
	t.Parallel()
	sub, err := exec.LookPath("mosquitto_sub")
	if err != nil {
		if os.Getenv("MQKV_REQUIRE_MOSQUITTO") != "" {
			t.Fatal("mosquitto_sub not found (Debian mosquitto-clients; .ci/run installs it)")
		}
		t.Skip("mosquitto_sub not found")
	}
	pub, _ := exec.LookPath("mosquitto_pub")
	nodes := sharedCluster(t)
	hostPort := func(i int) []string {
		host, port, _ := net.SplitHostPort(nodes[i].Addr())
		return []string{"-h", host, "-p", port}
	}
	for _, version := range []string{"mqttv5", "mqttv311"} {
		t.Run(version, func(t *testing.T) {
			topic := "mosq/" + version
			retained := exec.Command(pub, append(hostPort(2), "-V", version, "-t", topic+"/kept", "-m", "kept", "-q", "1", "-r")...)
			if out, err := retained.CombinedOutput(); err != nil {
				t.Fatalf("mosquitto_pub -r: %v %s", err, out)
			}
			const count = 7 // the retained one and two per QoS
			cmd := exec.Command(sub, append(hostPort(1), "-V", version, "-t", topic+"/#", "-q", "2", "-v", "-d", "-C", fmt.Sprint(count), "-W", "30", "-i", "mosq-sub-"+version)...)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
			lines := make(chan string, 100)
			go func() {
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					lines <- sc.Text()
				}
				close(lines)
			}()
			var got []string
			subscribed := false
			deadline := time.After(30 * time.Second)
			for !subscribed {
				select {
				case l := <-lines:
					subscribed = strings.Contains(l, "received SUBACK")
				case <-deadline:
					t.Fatal("mosquitto_sub got no SUBACK")
				}
			}
			// Each QoS's two messages from one publisher (-l: a message a
			// line, on one connection): MQTT orders a client's messages
			// on a topic, not those of clients one after another (two
			// mosquitto_pub processes' QoS 0 messages, forwarded to the
			// subscriber's node, once arrived the other way round).
			for qos := range 3 {
				p := exec.Command(pub, append(hostPort(0), "-V", version, "-t", fmt.Sprintf("%s/q%d", topic, qos), "-l", "-q", fmt.Sprint(qos))...)
				p.Stdin = strings.NewReader(fmt.Sprintf("m%d0\nm%d1\n", qos, qos))
				if o, err := p.CombinedOutput(); err != nil {
					t.Fatalf("mosquitto_pub: %v %s", err, o)
				}
			}
			for l := range lines {
				if strings.HasPrefix(l, topic+"/") {
					got = append(got, l)
				}
			}
			if err := cmd.Wait(); err != nil {
				t.Fatalf("mosquitto_sub: %v (got %q)", err, got)
			}
			// In order on each topic; the topics' messages may interleave.
			slices.SortStableFunc(got, func(a, b string) int {
				return strings.Compare(strings.Fields(a)[0], strings.Fields(b)[0])
			})
			want := []string{topic + "/kept kept", topic + "/q0 m00", topic + "/q0 m01", topic + "/q1 m10", topic + "/q1 m11", topic + "/q2 m20", topic + "/q2 m21"}
			if strings.Join(got, "\n") != strings.Join(want, "\n") {
				t.Fatalf("mosquitto_sub on another node printed\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
		})
	}
}
