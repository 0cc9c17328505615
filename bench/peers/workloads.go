package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/bradfitz/gomemcache/memcache"
	"github.com/eclipse/paho.golang/paho"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/mqkv/mqkv/client"
)

func keyOf(i, seq, keys int) []byte { return []byte("k" + strconv.Itoa((i*7919+seq)%keys)) }

// mqkvKV: SET or GET through mqkv's Go client (the request framing of the
// AIO SDKs), one connection per client, client i on node i of a cluster;
// with direct, each client also connects to the members that lead its
// keys' groups and sends each request there (client.Config.Direct).
type mqkvKV struct {
	addrs  []string
	get    bool
	direct bool
	conns  int // MQTT connections the clients share (one each if 0), as etcdKV's and natsKV's
	keys   int
	value  []byte
	cs     []*client.Client
}

func (w *mqkvKV) name() string { return "mqkv" }

func (w *mqkvKV) prepare(ctx context.Context, n int) error {
	conns := n
	if w.conns > 0 {
		conns = min(n, w.conns)
	}
	for i := range conns {
		c, err := client.Dial(ctx, client.Config{URL: "mqtt://" + w.addrs[i%len(w.addrs)], Direct: w.direct})
		if err != nil {
			return err
		}
		w.cs = append(w.cs, c)
	}
	if w.get { // every key holds a value
		for k := range w.keys {
			if _, err := w.cs[k%len(w.cs)].Set(ctx, keyOf(0, k, w.keys), w.value); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *mqkvKV) op(ctx context.Context, i, seq int) error {
	k := keyOf(i, seq, w.keys)
	if w.get {
		v, err := w.cs[i%len(w.cs)].Get(ctx, k)
		if err == nil && !v.Found {
			err = fmt.Errorf("GET %s: not found", k)
		}
		return err
	}
	_, err := w.cs[i%len(w.cs)].Set(ctx, k, w.value)
	return err
}

func (w *mqkvKV) close() {
	for _, c := range w.cs {
		c.Close()
	}
}

// etcdKV: put or get through clientv3, the clients sharing conns
// clientv3 clients (a gRPC connection each, which multiplexes requests),
// linearizable gets (etcd's default, as mqkv's). A clientv3 client given
// a cluster's endpoints balances its requests over them.
type etcdKV struct {
	endpoints []string
	conns     int
	get       bool
	keys      int
	value     []byte
	cs        []*clientv3.Client
}

func (w *etcdKV) name() string { return "etcd" }

func (w *etcdKV) prepare(ctx context.Context, n int) error {
	for range min(n, w.conns) {
		c, err := clientv3.New(clientv3.Config{Endpoints: w.endpoints, DialTimeout: 10 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			return err
		}
		w.cs = append(w.cs, c)
	}
	if w.get {
		for k := range w.keys {
			if _, err := w.cs[k%len(w.cs)].Put(ctx, string(keyOf(0, k, w.keys)), string(w.value)); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *etcdKV) op(ctx context.Context, i, seq int) error {
	k := string(keyOf(i, seq, w.keys))
	c := w.cs[i%len(w.cs)]
	if w.get {
		r, err := c.Get(ctx, k)
		if err == nil && len(r.Kvs) == 0 {
			err = fmt.Errorf("get %s: not found", k)
		}
		return err
	}
	_, err := c.Put(ctx, k, string(w.value))
	return err
}

func (w *etcdKV) close() {
	for _, c := range w.cs {
		c.Close()
	}
}

// pubsub: each client subscribes to its own topic, publishes QoS 1 to it
// and waits for the message to come back: a round trip through the broker.
type pubsub struct {
	addr    string
	payload []byte
	aliases uint16 // Topic Alias Maximum the clients give in CONNECT
	cs      []*paho.Client
	inbox   []chan struct{}
}

func (w *pubsub) name() string { return "pubsub" }

func (w *pubsub) prepare(ctx context.Context, n int) error {
	for i := range n {
		conn, err := net.Dial("tcp", w.addr)
		if err != nil {
			return err
		}
		in := make(chan struct{}, 1)
		c := paho.NewClient(paho.ClientConfig{
			Conn: conn,
			OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(paho.PublishReceived) (bool, error) {
				in <- struct{}{}
				return true, nil
			}},
		})
		id := fmt.Sprintf("bench-%d-%d", time.Now().UnixNano(), i)
		cp := &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 30}
		if w.aliases > 0 {
			cp.Properties = &paho.ConnectProperties{TopicAliasMaximum: &w.aliases}
		}
		if _, err := c.Connect(ctx, cp); err != nil {
			return err
		}
		if _, err := c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: topicOf(i), QoS: 1}}}); err != nil {
			return err
		}
		w.cs, w.inbox = append(w.cs, c), append(w.inbox, in)
	}
	return nil
}

func topicOf(i int) string { return "bench/" + strconv.Itoa(i) }

func (w *pubsub) op(ctx context.Context, i, _ int) error {
	if _, err := w.cs[i].Publish(ctx, &paho.Publish{Topic: topicOf(i), QoS: 1, Payload: w.payload}); err != nil {
		return err
	}
	select {
	case <-w.inbox[i]:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(10 * time.Second):
		return errors.New("message did not come back within 10 s")
	}
}

func (w *pubsub) close() {
	for _, c := range w.cs {
		c.Disconnect(&paho.Disconnect{})
	}
}

// memcacheKV: set or get through a memcached client library (gomemcache,
// one connection per client), against mqkv's memcached endpoint or
// memcached itself.
type memcacheKV struct {
	label string
	addr  string
	get   bool
	keys  int
	value []byte
	cs    []*memcache.Client
}

func (w *memcacheKV) name() string { return w.label }

func (w *memcacheKV) prepare(_ context.Context, n int) error {
	for range n {
		c := memcache.New(w.addr)
		c.MaxIdleConns = 1
		c.Timeout = 10 * time.Second
		w.cs = append(w.cs, c)
	}
	if w.get {
		for k := range w.keys {
			if err := w.cs[k%n].Set(&memcache.Item{Key: string(keyOf(0, k, w.keys)), Value: w.value}); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *memcacheKV) op(_ context.Context, i, seq int) error {
	k := string(keyOf(i, seq, w.keys))
	if w.get {
		_, err := w.cs[i].Get(k)
		return err
	}
	return w.cs[i].Set(&memcache.Item{Key: k, Value: w.value})
}

func (w *memcacheKV) close() {
	for _, c := range w.cs {
		c.Close()
	}
}

// httpKV: PUT or GET over HTTP/1.1, one keep-alive connection per client:
// mqkv's /v1/kv/{key} (the value as the body), or etcd's HTTP/JSON
// gateway (/v3/kv/put and /v3/kv/range, keys and values in base64).
type httpKV struct {
	label string
	addr  string
	etcd  bool
	get   bool
	keys  int
	value []byte
	cs    []*http.Client
}

func (w *httpKV) name() string { return w.label }

func (w *httpKV) prepare(ctx context.Context, n int) error {
	for range n {
		w.cs = append(w.cs, &http.Client{Timeout: 10 * time.Second,
			Transport: &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1}})
	}
	if w.get {
		for k := range w.keys {
			if err := w.put(ctx, w.cs[k%n], keyOf(0, k, w.keys)); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *httpKV) put(ctx context.Context, c *http.Client, key []byte) error {
	var req *http.Request
	if w.etcd {
		body, _ := json.Marshal(map[string]string{"key": base64.StdEncoding.EncodeToString(key), "value": base64.StdEncoding.EncodeToString(w.value)})
		req, _ = http.NewRequestWithContext(ctx, "POST", "http://"+w.addr+"/v3/kv/put", bytes.NewReader(body))
	} else {
		req, _ = http.NewRequestWithContext(ctx, "PUT", "http://"+w.addr+"/v1/kv/"+string(key), bytes.NewReader(w.value))
	}
	return w.send(c, req, 204)
}

func (w *httpKV) send(c *http.Client, req *http.Request, want int) error {
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	if w.etcd {
		want = 200
	}
	if resp.StatusCode != want {
		return fmt.Errorf("%s %s: %s", req.Method, req.URL, resp.Status)
	}
	return nil
}

func (w *httpKV) op(ctx context.Context, i, seq int) error {
	k := keyOf(i, seq, w.keys)
	if !w.get {
		return w.put(ctx, w.cs[i], k)
	}
	var req *http.Request
	if w.etcd {
		body, _ := json.Marshal(map[string]string{"key": base64.StdEncoding.EncodeToString(k)})
		req, _ = http.NewRequestWithContext(ctx, "POST", "http://"+w.addr+"/v3/kv/range", bytes.NewReader(body))
	} else {
		req, _ = http.NewRequestWithContext(ctx, "GET", "http://"+w.addr+"/v1/kv/"+string(k), nil)
	}
	return w.send(w.cs[i], req, 200)
}

func (w *httpKV) close() {
	for _, c := range w.cs {
		c.CloseIdleConnections()
	}
}
