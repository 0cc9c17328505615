package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Three-node key-value clusters to compare mqkv's with (cluster-set,
// cluster-get): etcd, and NATS JetStream KV with three replicas.

// startEtcdCluster runs three etcd members (fsync on every commit, as
// etcd always does) on fresh data dirs; the server's address lists their
// client URLs' host:port.
func startEtcdCluster(dir string) (*server, error) {
	type member struct{ name, client, peer string }
	var ms []member
	var initial []string
	for i := range 3 {
		c, err := freeAddr()
		if err != nil {
			return nil, err
		}
		p, err := freeAddr()
		if err != nil {
			return nil, err
		}
		m := member{fmt.Sprint("e", i+1), c, p}
		ms = append(ms, m)
		initial = append(initial, m.name+"=http://"+m.peer)
	}
	var procs []*process
	var addrs []string
	for _, m := range ms {
		d := filepath.Join(dir, m.name)
		p, err := spawn(d, "etcd", "--name", m.name, "--data-dir", filepath.Join(d, "data"),
			"--listen-client-urls", "http://"+m.client, "--advertise-client-urls", "http://"+m.client,
			"--listen-peer-urls", "http://"+m.peer, "--initial-advertise-peer-urls", "http://"+m.peer,
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", "bench", "--log-level", "warn")
		if err != nil {
			stopAll(procs)
			return nil, err
		}
		procs = append(procs, p)
		addrs = append(addrs, m.client)
	}
	s := &server{name: "etcd", proc: procs[0], more: procs[1:], addr: strings.Join(addrs, ",")}
	// Ready once a write through every member commits.
	c, err := clientv3.New(clientv3.Config{Endpoints: addrs, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		s.stop()
		return nil, err
	}
	defer c.Close()
	deadline := time.Now().Add(60 * time.Second)
	for _, a := range addrs {
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, err := c.Put(clientv3.WithRequireLeader(ctx), "bench-ready", a)
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				s.stop()
				return nil, fmt.Errorf("etcd cluster not ready after 60 s: %v", err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	return s, nil
}

// natsBucket is the JetStream KV bucket the NATS workloads use.
const natsBucket = "bench"

// startNATSKV runs three nats-server nodes with JetStream and creates a
// KV bucket of three replicas on file storage with direct gets off, so
// that the stream's leader answers every get (with direct gets on, any
// replica answers, possibly from behind). always sets JetStream's
// sync_interval to always: every acknowledged write fsynced, as mqkv's
// and etcd's; without it NATS syncs every two minutes and an
// acknowledged write can be lost with the machine.
func startNATSKV(bin, dir string, always bool) (*server, error) {
	sync := ""
	if always {
		sync = "always"
	}
	s, err := startNATS(bin, dir, false, sync)
	if err != nil {
		return nil, err
	}
	urls := strings.Split(s.addr, ",")
	nc, err := nats.Connect("nats://"+strings.Join(urls, ",nats://"), nats.Timeout(10*time.Second))
	if err != nil {
		s.stop()
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		s.stop()
		return nil, err
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		err = createBucket(js)
		if err == nil {
			return s, nil
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("nats KV bucket: %v", err)
		}
		time.Sleep(500 * time.Millisecond) // JetStream's meta leader not elected yet
	}
}

func createBucket(js jetstream.JetStream) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	kv, err := js.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: natsBucket, Replicas: 3, Storage: jetstream.FileStorage})
	if err != nil {
		return err
	}
	st, err := js.Stream(ctx, "KV_"+natsBucket)
	if err != nil {
		return err
	}
	cfg := st.CachedInfo().Config
	cfg.AllowDirect = false
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		return err
	}
	_, err = kv.Put(ctx, "bench-ready", []byte("1"))
	return err
}

// natsKV: put or get through nats.go's JetStream KV, the clients sharing
// conns connections (NATS clients multiplex requests on one).
type natsKV struct {
	urls  []string
	conns int
	get   bool
	keys  int
	value []byte
	ncs   []*nats.Conn
	kvs   []jetstream.KeyValue
}

func (w *natsKV) name() string { return "nats" }

func (w *natsKV) prepare(ctx context.Context, n int) error {
	for i := range min(n, w.conns) {
		// Connection i starts at node i: the connections spread.
		var urls []string
		for k := range w.urls {
			urls = append(urls, "nats://"+w.urls[(i+k)%len(w.urls)])
		}
		nc, err := nats.Connect(strings.Join(urls, ","), nats.DontRandomize(), nats.Timeout(10*time.Second))
		if err != nil {
			return err
		}
		w.ncs = append(w.ncs, nc)
		js, err := jetstream.New(nc)
		if err != nil {
			return err
		}
		kv, err := js.KeyValue(ctx, natsBucket)
		if err != nil {
			return err
		}
		w.kvs = append(w.kvs, kv)
	}
	if w.get {
		for k := range w.keys {
			if _, err := w.kvs[k%len(w.kvs)].Put(ctx, string(keyOf(0, k, w.keys)), w.value); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *natsKV) op(ctx context.Context, i, seq int) error {
	k := string(keyOf(i, seq, w.keys))
	kv := w.kvs[i%len(w.kvs)]
	if w.get {
		_, err := kv.Get(ctx, k)
		return err
	}
	_, err := kv.Put(ctx, k, w.value)
	return err
}

func (w *natsKV) close() {
	for _, nc := range w.ncs {
		nc.Close()
	}
}
