package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	mqtt3 "github.com/eclipse/paho.mqtt.golang"

	"github.com/mqkv/mqkv/internal/cluster"
)

// Three-node clusters of mqkv and of NATS (MQTT enabled), compared with
// MQTT 3.1.1 clients (NATS speaks no MQTT 5) publishing on one node to
// subscribers on another.

// natsVersion is the nats-server release compared, from the Go module
// proxy.
const natsVersion = "v2.15.2"

// buildNATS installs nats-server into dir.
func buildNATS(dir string) (string, error) {
	cmd := exec.Command("go", "install", "github.com/nats-io/nats-server/v2@"+natsVersion)
	cmd.Env = append(os.Environ(), "GOBIN="+dir)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go install nats-server: %v\n%s", err, b)
	}
	return filepath.Join(dir, "nats-server"), nil
}

// startMQKVCluster runs three durable mqkv nodes as one cluster; addr
// lists their MQTT addresses.
func startMQKVCluster(bin, dir string) (*server, error) { return startMQKVClusterOf(0)(bin, dir) }

// startMQKVClusterOf is startMQKVCluster with groups raft groups (mqkv's
// default if 0).
func startMQKVClusterOf(groups int) func(bin, dir string) (*server, error) {
	return func(bin, dir string) (*server, error) { return startMQKVClusterWith(bin, dir, groups) }
}

func startMQKVClusterWith(bin, dir string, groups int) (*server, error) {
	var procs []*process
	var addrs, links, admin []string
	for i := range 3 {
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		link, err := freePort()
		if err != nil {
			return nil, err
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		linkAddr := fmt.Sprintf("127.0.0.1:%d", link)
		args := []string{"serve", "--listen", addr, "--data-dir", filepath.Join(dir, fmt.Sprint("n", i+1)),
			"--node-id", fmt.Sprint("n", i+1), "--cluster-listen", linkAddr}
		if groups > 0 {
			args = append(args, "--groups", fmt.Sprint(groups))
		}
		a, err := freeAddr() // for profiles, and to see the cluster settle
		if err != nil {
			return nil, err
		}
		args = append(args, "--admin-listen", a)
		admin = append(admin, a)
		if i > 0 {
			args = append(args, "--join", links[0])
		}
		p, err := spawn(filepath.Join(dir, fmt.Sprint("n", i+1)), bin, args...)
		if err != nil {
			stopAll(procs)
			return nil, err
		}
		procs = append(procs, p)
		if err := awaitListening(p, addr); err != nil {
			stopAll(procs)
			return nil, err
		}
		addrs, links = append(addrs, addr), append(links, linkAddr)
	}
	s := &server{name: "mqkv", proc: procs[0], more: procs[1:], addr: strings.Join(addrs, ","), admin: admin}
	if err := awaitSettled(admin[0]); err != nil {
		s.stop()
		return nil, err
	}
	if !profiling {
		s.admin = nil
	}
	return s, awaitCrossing(s)
}

// awaitSettled waits until the node at admin sees every group with three
// replicas led by its preferred leader: measured before, a cluster still
// adding the replicas of the nodes that joined, and moving leaders,
// costs what a settled one does not.
func awaitSettled(admin string) error {
	deadline := time.Now().Add(90 * time.Second)
	for {
		var st cluster.Status
		resp, err := http.Get("http://" + admin + "/v1/cluster")
		if err == nil {
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
		}
		if err == nil && st.Settled(3, true) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("mqkv cluster not settled after 90 s (%v)", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// startNATSCluster runs three nats-server nodes as one cluster with
// JetStream (which NATS's MQTT needs) and an MQTT listener each; the
// server's address lists their MQTT listeners.
func startNATSCluster(bin, dir string) (*server, error) {
	s, err := startNATS(bin, dir, true, "")
	if err != nil {
		return nil, err
	}
	return s, awaitCrossing(s)
}

// startNATS runs three nats-server nodes as one cluster with JetStream,
// an MQTT listener each if mqtt (the server's addresses are then those,
// else the client listeners'), and JetStream's sync_interval set to sync
// unless empty.
func startNATS(bin, dir string, mqtt bool, sync string) (*server, error) {
	type node struct{ client, route, mqtt int }
	nodes := make([]node, 3)
	for i := range nodes {
		for _, p := range []*int{&nodes[i].client, &nodes[i].route, &nodes[i].mqtt} {
			port, err := freePort()
			if err != nil {
				return nil, err
			}
			*p = port
		}
	}
	var routes []string
	for _, n := range nodes {
		routes = append(routes, fmt.Sprintf("nats-route://127.0.0.1:%d", n.route))
	}
	var procs []*process
	var addrs []string
	for i, n := range nodes {
		d := filepath.Join(dir, fmt.Sprint("n", i+1))
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
		js := fmt.Sprintf("store_dir: %q", filepath.Join(d, "js"))
		if sync != "" {
			js += ", sync_interval: " + sync
		}
		conf := fmt.Sprintf("server_name: n%d\nlisten: 127.0.0.1:%d\njetstream { %s }\ncluster { name: bench, listen: 127.0.0.1:%d, routes: [%s] }\n",
			i+1, n.client, js, n.route, strings.Join(routes, ", "))
		addr := fmt.Sprintf("127.0.0.1:%d", n.client)
		if mqtt {
			conf += fmt.Sprintf("mqtt { listen: 127.0.0.1:%d }\n", n.mqtt)
			addr = fmt.Sprintf("127.0.0.1:%d", n.mqtt)
		}
		path := filepath.Join(d, "nats.conf")
		if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
			return nil, err
		}
		p, err := spawn(d, bin, "-c", path)
		if err != nil {
			stopAll(procs)
			return nil, err
		}
		procs = append(procs, p)
		addrs = append(addrs, addr)
	}
	for i, p := range procs {
		if err := awaitListening(p, addrs[i]); err != nil {
			stopAll(procs)
			return nil, err
		}
	}
	return &server{name: "nats", proc: procs[0], more: procs[1:], addr: strings.Join(addrs, ",")}, nil
}

func stopAll(ps []*process) {
	for _, p := range ps {
		p.stop()
	}
}

// awaitCrossing waits until a QoS 1 message published on each node
// reaches a subscriber on the next: the cluster routes (NATS's MQTT also
// waits for its JetStream cluster).
func awaitCrossing(s *server) error {
	addrs := strings.Split(s.addr, ",")
	deadline := time.Now().Add(90 * time.Second)
	for i := range addrs {
		for {
			err := crossOnce(addrs[i], addrs[(i+1)%len(addrs)])
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				stopAll(append([]*process{s.proc}, s.more...))
				return fmt.Errorf("%s cluster: no message from %s to %s: %v", s.name, addrs[i], addrs[(i+1)%len(addrs)], err)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	return nil
}

func crossOnce(from, to string) error {
	got := make(chan struct{}, 1)
	topic := fmt.Sprintf("bench/probe/%d", time.Now().UnixNano())
	sub, err := connect3(to, fmt.Sprint("probe-sub-", time.Now().UnixNano()))
	if err != nil {
		return err
	}
	defer sub.Disconnect(0)
	if t := sub.Subscribe(topic, 1, func(mqtt3.Client, mqtt3.Message) {
		select {
		case got <- struct{}{}:
		default:
		}
	}); !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		return fmt.Errorf("subscribe: %v", t.Error())
	}
	pub, err := connect3(from, fmt.Sprint("probe-pub-", time.Now().UnixNano()))
	if err != nil {
		return err
	}
	defer pub.Disconnect(0)
	if t := pub.Publish(topic, 1, false, "probe"); !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		return fmt.Errorf("publish: %v", t.Error())
	}
	select {
	case <-got:
		return nil
	case <-time.After(2 * time.Second):
		return errors.New("not received")
	}
}

// connect3 connects an MQTT 3.1.1 client with a clean session.
func connect3(addr, id string) (mqtt3.Client, error) {
	o := mqtt3.NewClientOptions().AddBroker("tcp://" + addr).SetClientID(id).SetCleanSession(true).
		SetProtocolVersion(4).SetAutoReconnect(false).SetKeepAlive(60 * time.Second).SetOrderMatters(false)
	c := mqtt3.NewClient(o)
	if t := c.Connect(); !t.WaitTimeout(10*time.Second) || t.Error() != nil {
		return nil, fmt.Errorf("connect %s: %v", addr, t.Error())
	}
	return c, nil
}

// across: MQTT 3.1.1 clients, each with its publisher on node i and its
// subscriber on node i+1, publishing at qos to a topic of its own and
// waiting for the message on the other node: a round trip across the
// cluster.
type across struct {
	addrs []string
	qos   byte
	pl    []byte
	pubs  []mqtt3.Client
	subs  []mqtt3.Client
	inbox []chan struct{}
}

func (w *across) name() string { return fmt.Sprintf("across-qos%d", w.qos) }

func (w *across) prepare(_ context.Context, n int) error {
	run := time.Now().UnixNano()
	for i := range n {
		in := make(chan struct{}, 1)
		sub, err := connect3(w.addrs[(i+1)%len(w.addrs)], fmt.Sprintf("x-sub-%d-%d", run, i))
		if err != nil {
			return err
		}
		w.subs = append(w.subs, sub)
		if t := sub.Subscribe(topicOf(i), w.qos, func(mqtt3.Client, mqtt3.Message) { in <- struct{}{} }); !t.WaitTimeout(10*time.Second) || t.Error() != nil {
			return fmt.Errorf("subscribe: %v", t.Error())
		}
		pub, err := connect3(w.addrs[i%len(w.addrs)], fmt.Sprintf("x-pub-%d-%d", run, i))
		if err != nil {
			return err
		}
		w.pubs, w.inbox = append(w.pubs, pub), append(w.inbox, in)
	}
	return nil
}

func (w *across) op(ctx context.Context, i, _ int) error {
	if t := w.pubs[i].Publish(topicOf(i), w.qos, false, w.pl); !t.WaitTimeout(10*time.Second) || t.Error() != nil {
		return fmt.Errorf("publish: %v", t.Error())
	}
	select {
	case <-w.inbox[i]:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(10 * time.Second):
		return errors.New("message did not arrive on the other node within 10 s")
	}
}

func (w *across) close() {
	for _, c := range append(w.pubs, w.subs...) {
		c.Disconnect(0)
	}
}
