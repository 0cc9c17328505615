// Package bench is the load generator behind `mqkv bench`: closed-loop MQTT
// v5 clients that send state store requests exactly as the AIO SDKs frame
// them, and report throughput and latency percentiles.
package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	mrand "math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Op is a request mix.
type Op string

const (
	// OpEcho sends the same requests to EchoTopic, where Responders MQTT
	// clients answer them without touching the store: the floor of an
	// MQTT request/response service through the same broker.
	OpEcho Op = "echo"
	// OpPing sends PING, answered inside the server without touching the
	// store: the floor of the state store's own request path.
	OpPing  Op = "ping"
	OpSet   Op = "set"   // SET key value
	OpGet   Op = "get"   // GET of an existing key
	OpMixed Op = "mixed" // half GET, half SET
	OpLease Op = "lease" // SET key holder NEX PX 10000: a lease renewal
	// OpPubSub publishes QoS 1 messages to a topic of the client's own,
	// which another connection of the client subscribes to: with several
	// nodes, on the next node (the message crosses the cluster); see
	// Config.SameNode.
	OpPubSub Op = "pubsub"
	// OpSameNode is OpPubSub with both connections on one node: the
	// baseline of the messages across nodes.
	OpSameNode Op = "samenode"
)

// EchoTopic is where the echo responders listen (a shared subscription).
const EchoTopic = "mqkv/bench/echo"

// Config describes one measurement.
type Config struct {
	Addr       string
	Clients    int
	Responders int // echo responder connections (OpEcho)
	Op         Op
	ValueSize  int
	Keys       int // size of the keyspace
	Duration   time.Duration
	Warmup     time.Duration
	// Patterns, if positive, registers that many pattern KEYNOTIFYs (none
	// matching the benchmark's keys) for the run, from more clients.
	Patterns int
	// Fault, if set, is called FaultAt into the measured time (a node is
	// killed, or one joins and Fault returns once replicas have moved);
	// the Result then describes the service around it.
	Fault   func()
	FaultAt time.Duration
	// Rate, if positive, paces the clients to about that many requests a
	// second in all (each still waits for its reply): CPU per operation
	// is then compared at the same load, below the machine's saturation.
	Rate float64
	// Window, if set, is called as the measured time begins (true) and
	// ends (false), to sample what the server used in it.
	Window func(begin bool)
	// Reconnect has a client whose request fails (its node stopped) dial
	// the next node of Addr and send the request again, its latency
	// counted from the first try; and the Result describes the latencies
	// over the whole Fault, not only its first FaultWindow.
	Reconnect bool
	// SessionExpiry, for OpPubSub and OpSameNode, is the subscribing
	// connections' Session Expiry Interval (seconds): above 0, their
	// sessions are kept in a cluster's store (each message written).
	SessionExpiry uint32
}

// Result is what one measurement found.
type Result struct {
	Op        Op
	Ops       int
	Errors    int
	Elapsed   time.Duration
	CPU       time.Duration   // server CPU during the round, if measured
	ClientCPU time.Duration   // the load generator's (this process's) CPU during the round
	latencies []time.Duration // sorted

	// With a Fault: the longest time in the measured round during which
	// no request completed, and the requests that completed in the
	// FaultWindow after the fault (errors included).
	Stall                 time.Duration
	StallFrom             time.Duration // when it began, from the round's start
	FaultOps, FaultErrors int
	FaultP99, FaultMax    time.Duration
	BeforeP99             time.Duration // of the requests completed before the fault
	// The throughput before the fault, and while Fault ran (zero if it
	// outlasted the round).
	Before, During float64
	FaultTook      time.Duration
}

// FaultWindow is how long after a fault requests are described apart.
const FaultWindow = 10 * time.Second

// Throughput returns operations per second.
func (r Result) Throughput() float64 { return float64(r.Ops) / r.Elapsed.Seconds() }

// Percentile returns the latency below which a fraction q of requests
// completed.
func (r Result) Percentile(q float64) time.Duration {
	if len(r.latencies) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(r.latencies)))) - 1
	return r.latencies[max(0, min(i, len(r.latencies)-1))]
}

// client is one MQTT connection sending one request at a time.
type client struct {
	id        string
	c         *paho.Client
	respTopic string
	replies   chan *paho.Publish
	corr      uint64
	sub       *paho.Client // OpPubSub: the subscribing connection, to pubTopic
	pubTopic  string
	// lost is done once either connection broke or the server ended it:
	// paho keeps a QoS 1 PUBLISH of a lost connection waiting for its
	// PUBACK until PacketTimeout (10 s), which a client that reconnects
	// (Config.Reconnect) must not count as the server's pause.
	lost     context.Context
	loseConn context.CancelFunc
}

// openConn opens an MQTT v5 connection with a clean session as id,
// subscribed to filter, handing every message received to onPublish.
func openConn(ctx context.Context, addr, id, filter string, onPublish func(*paho.Client, *paho.Publish)) (*paho.Client, error) {
	return openSession(ctx, addr, id, filter, 0, onPublish, nil)
}

// openSession is openConn with a Session Expiry Interval (seconds), and
// onLost, if not nil, called when the connection breaks or the server
// ends it.
func openSession(ctx context.Context, addr, id, filter string, expiry uint32, onPublish func(*paho.Client, *paho.Publish), onLost func()) (*paho.Client, error) {
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	var c *paho.Client
	c = paho.NewClient(paho.ClientConfig{
		ClientID: id,
		Conn:     conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			onPublish(c, pr.Packet)
			return true, nil
		}},
		OnClientError: func(error) {
			if onLost != nil {
				onLost()
			}
		},
		OnServerDisconnect: func(*paho.Disconnect) {
			if onLost != nil {
				onLost()
			}
		},
	})
	cp := &paho.Connect{ClientID: id, CleanStart: true, KeepAlive: 60}
	if expiry > 0 {
		cp.Properties = &paho.ConnectProperties{SessionExpiryInterval: &expiry}
	}
	if _, err := c.Connect(ctx, cp); err != nil {
		conn.Close()
		return nil, fmt.Errorf("connect: %w", err)
	}
	if _, err := c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: 1}}}); err != nil {
		c.Disconnect(&paho.Disconnect{})
		return nil, fmt.Errorf("subscribe: %w", err)
	}
	return c, nil
}

func dial(ctx context.Context, addr, id string) (*client, error) {
	cl := &client{
		id: id,
		// The Rust SDK's response topic shape: a policy need not grant it.
		respTopic: "clients/" + id + "/services/" + statestore.RequestTopic + "/response",
		replies:   make(chan *paho.Publish, 16),
	}
	cl.lost, cl.loseConn = context.WithCancel(context.Background())
	c, err := openSession(ctx, addr, id, cl.respTopic, 0, func(_ *paho.Client, p *paho.Publish) { cl.replies <- p }, cl.loseConn)
	if err != nil {
		return nil, err
	}
	cl.c = c
	return cl, nil
}

var (
	errTimeout = errors.New("no reply within 10s")
	errLost    = errors.New("connection lost before the reply")
)

// call sends one request framed as the SDKs frame it and waits for the
// reply with the same correlation data.
func (cl *client) call(ctx context.Context, payload []byte) ([]byte, error) {
	return cl.callTopic(ctx, statestore.RequestTopic, payload)
}

func (cl *client) callTopic(ctx context.Context, topic string, payload []byte) ([]byte, error) {
	cl.corr++
	corr := make([]byte, 16)
	binary.BigEndian.PutUint64(corr[8:], cl.corr)
	ts := fmt.Sprintf("%015d:%05d:%s", time.Now().UnixMilli(), 0, cl.id)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(cl.lost, cancel)()
	_, err := cl.c.Publish(ctx, &paho.Publish{
		Topic:   topic,
		QoS:     1,
		Payload: payload,
		Properties: &paho.PublishProperties{
			CorrelationData: corr,
			ResponseTopic:   cl.respTopic,
			ContentType:     "application/octet-stream",
			User:            paho.UserProperties{{Key: "__ts", Value: ts}, {Key: "__srcId", Value: cl.id}},
		},
	})
	if err != nil {
		return nil, err
	}
	timer := time.NewTimer(10 * time.Second)
	defer timer.Stop()
	for {
		select {
		case p := <-cl.replies:
			if p.Properties != nil && string(p.Properties.CorrelationData) == string(corr) {
				return p.Payload, nil
			}
		case <-timer.C:
			return nil, errTimeout
		case <-ctx.Done():
			if cl.lost.Err() != nil {
				return nil, errLost
			}
			return nil, ctx.Err()
		}
	}
}

func (cl *client) close() {
	defer cl.loseConn()
	cl.c.Disconnect(&paho.Disconnect{})
	if cl.sub != nil {
		// Ends the session, kept or not (MQTT 5: expiry 0 at DISCONNECT).
		var zero uint32
		cl.sub.Disconnect(&paho.Disconnect{Properties: &paho.DisconnectProperties{SessionExpiryInterval: &zero}})
	}
}

// dialPubSub connects a client of OpPubSub: its publishing connection to
// pubAddr, its subscribing one to subAddr.
func dialPubSub(ctx context.Context, pubAddr, subAddr, id string, expiry uint32) (*client, error) {
	cl, err := dial(ctx, pubAddr, id)
	if err != nil {
		return nil, err
	}
	cl.pubTopic = "bench/pubsub/" + id
	cl.sub, err = openSession(ctx, subAddr, id+"-sub", cl.pubTopic, expiry, func(_ *paho.Client, p *paho.Publish) { cl.replies <- p }, cl.loseConn)
	if err != nil {
		cl.close()
		return nil, err
	}
	return cl, nil
}

func key(i int) []byte { return []byte("bench/key/" + strconv.Itoa(i)) }

// Prepare writes every key of the keyspace, so GETs hit.
func Prepare(ctx context.Context, cfg Config) error {
	clients, err := connect(ctx, cfg.Addr, "prep", min(cfg.Clients, 16))
	if err != nil {
		return err
	}
	defer closeAll(clients)
	value := make([]byte, cfg.ValueSize)
	rand.Read(value)
	var next atomic.Int64
	errs := make(chan error, len(clients))
	var wg sync.WaitGroup
	for _, cl := range clients {
		wg.Add(1)
		go func(cl *client) {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= cfg.Keys {
					return
				}
				r, err := cl.call(ctx, resp.AppendBulks(nil, []byte("SET"), key(i), value))
				if err == nil && !bytes.Equal(r, resp.OK) {
					err = fmt.Errorf("SET answered %q", r)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}(cl)
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func connect(ctx context.Context, addr, prefix string, n int) ([]*client, error) {
	var run [4]byte
	rand.Read(run[:])
	out := make([]*client, 0, n)
	addrs := strings.Split(addr, ",") // several nodes: clients spread round-robin
	for i := 0; i < n; i++ {
		cl, err := dial(ctx, addrs[i%len(addrs)], fmt.Sprintf("bench-%s-%x-%d", prefix, run, i))
		if err != nil {
			closeAll(out)
			return nil, err
		}
		out = append(out, cl)
	}
	return out, nil
}

// connectPubSub connects the clients of OpPubSub and OpSameNode, spread
// over the nodes of cfg.Addr: client i publishes on node i and, for
// OpPubSub, subscribes on node i+1.
func connectPubSub(ctx context.Context, cfg Config) ([]*client, error) {
	var run [4]byte
	rand.Read(run[:])
	addrs := strings.Split(cfg.Addr, ",")
	out := make([]*client, 0, cfg.Clients)
	for i := range cfg.Clients {
		pub, sub := addrs[i%len(addrs)], addrs[i%len(addrs)]
		if cfg.Op == OpPubSub {
			sub = addrs[(i+1)%len(addrs)]
		}
		cl, err := dialPubSub(ctx, pub, sub, fmt.Sprintf("bench-%s-%x-%d", cfg.Op, run, i), cfg.SessionExpiry)
		if err != nil {
			closeAll(out)
			return nil, err
		}
		out = append(out, cl)
	}
	return out, nil
}

func closeAll(cs []*client) {
	for _, c := range cs {
		c.close()
	}
}

// Run measures one op mix. Each client sends a request, waits for its
// reply, and sends the next (a closed loop), for Warmup and then Duration;
// only the Duration part counts.
func Run(ctx context.Context, cfg Config) (Result, error) {
	var clients []*client
	var err error
	if cfg.Op == OpPubSub || cfg.Op == OpSameNode {
		clients, err = connectPubSub(ctx, cfg)
	} else {
		clients, err = connect(ctx, cfg.Addr, string(cfg.Op), cfg.Clients)
	}
	if err != nil {
		return Result{}, err
	}
	defer closeAll(clients)
	if cfg.Op == OpEcho {
		stopEcho, err := startResponders(ctx, cfg.Addr, max(cfg.Responders, 1))
		if err != nil {
			return Result{}, err
		}
		defer stopEcho()
	}
	if cfg.Patterns > 0 {
		watchers, err := registerPatterns(ctx, cfg.Addr, cfg.Patterns)
		if err != nil {
			return Result{}, err
		}
		defer closeAll(watchers) // their registrations end with them
	}
	value := make([]byte, cfg.ValueSize)
	rand.Read(value)
	message := bytes.Repeat([]byte("m"), cfg.ValueSize) // OpPubSub's: never read as an error reply

	addrs := strings.Split(cfg.Addr, ",") // where a client reconnects (Reconnect)
	var measuring atomic.Bool
	stop := make(chan struct{})
	type tally struct {
		lat    []time.Duration
		dones  []done // with a Fault: every request completed
		errors int
		err    error
	}
	tallies := make([]tally, len(clients))
	var wg sync.WaitGroup
	for n, cl := range clients {
		wg.Add(1)
		go func(n int, cl *client) {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(n), 42))
			holder := []byte(cl.id)
			var every time.Duration
			next := time.Now()
			if cfg.Rate > 0 {
				every = time.Duration(float64(time.Second) * float64(len(clients)) / cfg.Rate)
				next = next.Add(time.Duration(rng.Int64N(int64(every) + 1))) // spread the clients' slots
			}
			for {
				if wait := time.Until(next); every > 0 && wait > 0 {
					select {
					case <-stop:
						return
					case <-time.After(wait):
					}
				} else {
					select {
					case <-stop:
						return
					default:
					}
				}
				next = next.Add(every)
				k := key(rng.IntN(max(cfg.Keys, 1)))
				var payload []byte
				op := cfg.Op
				if op == OpMixed {
					op = OpGet
					if rng.IntN(2) == 0 {
						op = OpSet
					}
				}
				topic := statestore.RequestTopic
				if op == OpEcho {
					topic = EchoTopic // the same SET, answered by a responder
				}
				switch op {
				case OpPubSub, OpSameNode:
					topic, payload = cl.pubTopic, message
				case OpPing:
					payload = resp.AppendBulks(nil, []byte("PING"))
				case OpSet, OpEcho:
					payload = resp.AppendBulks(nil, []byte("SET"), k, value)
				case OpGet:
					payload = resp.AppendBulks(nil, []byte("GET"), k)
				case OpLease:
					payload = resp.AppendBulks(nil, []byte("SET"), []byte("bench/lease/"+cl.id), holder, []byte("NEX"), []byte("PX"), []byte("10000"))
				}
				start := time.Now()
				r, err := cl.callTopic(ctx, topic, payload)
				for err != nil && cfg.Reconnect && ctx.Err() == nil && !stopped(stop) {
					var again *client
					if again, err = redial(ctx, addrs, n, cl.id); err == nil {
						cl.c.Disconnect(&paho.Disconnect{})
						cl.loseConn()
						cl, clients[n] = again, again
						r, err = cl.callTopic(ctx, topic, payload)
					}
				}
				d := time.Since(start)
				if err != nil {
					if stopped(stop) {
						return // the round ended while it reconnected
					}
					tallies[n].err = err
					return
				}
				if !measuring.Load() {
					continue
				}
				refused := len(r) > 0 && r[0] == '-'
				if cfg.Fault != nil {
					tallies[n].dones = append(tallies[n].dones, done{end: start.Add(d), lat: d, failed: refused})
				}
				if refused {
					tallies[n].errors++ // refused work is not throughput
					continue
				}
				tallies[n].lat = append(tallies[n].lat, d)
			}
		}(n, cl)
	}
	select {
	case <-time.After(cfg.Warmup):
	case <-ctx.Done():
	}
	if cfg.Window != nil {
		cfg.Window(true)
	}
	measuring.Store(true)
	start := time.Now()
	var faultAt, faultEnd time.Time
	faulted := make(chan struct{})
	if cfg.Fault != nil {
		go func() {
			defer close(faulted)
			select {
			case <-time.After(cfg.FaultAt):
				faultAt = time.Now()
				cfg.Fault()
				faultEnd = time.Now()
			case <-stop:
			}
		}()
	}
	select {
	case <-time.After(cfg.Duration):
	case <-ctx.Done():
	}
	measuring.Store(false)
	elapsed := time.Since(start)
	if cfg.Window != nil {
		cfg.Window(false)
	}
	close(stop)
	wg.Wait()
	res := Result{Op: cfg.Op, Elapsed: elapsed}
	var dones []done
	for _, t := range tallies {
		if t.err != nil {
			return res, t.err
		}
		res.latencies = append(res.latencies, t.lat...)
		res.Errors += t.errors
		dones = append(dones, t.dones...)
	}
	res.Ops = len(res.latencies)
	slices.Sort(res.latencies)
	if cfg.Fault != nil {
		<-faulted // a Fault still running past the round is waited for
		res.describeFault(dones, start, start.Add(elapsed), faultAt, faultEnd, cfg.Reconnect)
	}
	return res, nil
}

// stopped says whether the round is over.
func stopped(stop <-chan struct{}) bool {
	select {
	case <-stop:
		return true
	default:
		return false
	}
}

// redial connects client n again with its id, to the first node of addrs
// after its own that answers, trying for up to a minute.
func redial(ctx context.Context, addrs []string, n int, id string) (*client, error) {
	var err error
	for try := 1; try < 600; try++ {
		var cl *client
		dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		cl, err = dial(dctx, addrs[(n+try)%len(addrs)], id)
		cancel()
		if err == nil {
			return cl, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil, err
}

// done is one completed request of a round with a fault.
type done struct {
	end    time.Time
	lat    time.Duration
	failed bool // answered with an error
}

// describeFault finds the longest time without a completed request and
// the latencies in the FaultWindow after the fault.
func (r *Result) describeFault(ds []done, from, to, fault, faultEnd time.Time, whole bool) {
	slices.SortFunc(ds, func(a, b done) int { return a.end.Compare(b.end) })
	windowEnd := fault.Add(FaultWindow)
	if whole && faultEnd.After(windowEnd) {
		windowEnd = faultEnd
	}
	last := from
	var window, steady []time.Duration
	before, during := 0, 0
	for _, d := range ds {
		if !d.failed {
			if gap := d.end.Sub(last); gap > r.Stall {
				r.Stall, r.StallFrom = gap, last.Sub(from)
			}
			last = d.end
			switch {
			case d.end.Before(fault):
				before++
				steady = append(steady, d.lat)
			case !d.end.After(faultEnd):
				during++
			}
		}
		if fault.IsZero() || d.end.Before(fault) || d.end.After(windowEnd) {
			continue
		}
		r.FaultOps++
		if d.failed {
			r.FaultErrors++
		} else {
			window = append(window, d.lat)
		}
	}
	if gap := to.Sub(last); gap > r.Stall {
		r.Stall, r.StallFrom = gap, last.Sub(from)
	}
	if !fault.IsZero() {
		r.Before = float64(before) / fault.Sub(from).Seconds()
		r.FaultTook = faultEnd.Sub(fault)
		if faultEnd.Before(to) && r.FaultTook > 0 {
			r.During = float64(during) / r.FaultTook.Seconds()
		}
	}
	slices.Sort(window)
	if len(window) > 0 {
		r.FaultP99 = window[max(0, int(math.Ceil(0.99*float64(len(window))))-1)]
		r.FaultMax = window[len(window)-1]
	}
	slices.Sort(steady)
	if len(steady) > 0 {
		r.BeforeP99 = steady[max(0, int(math.Ceil(0.99*float64(len(steady))))-1)]
	}
}

// Merge combines the results of several rounds of the same op. What a
// round says about a fault is kept from the round that had one.
func Merge(rs []Result) Result {
	var out Result
	for _, r := range rs {
		lat := out.latencies
		if r.FaultOps > 0 || r.Stall > 0 {
			out = r
		}
		out.Op = r.Op
		out.latencies = append(lat, r.latencies...)
	}
	out.Ops, out.Errors, out.Elapsed, out.CPU, out.ClientCPU = 0, 0, 0, 0, 0
	for _, r := range rs {
		out.Ops += r.Ops
		out.Errors += r.Errors
		out.Elapsed += r.Elapsed
		out.CPU += r.CPU
		out.ClientCPU += r.ClientCPU
	}
	slices.Sort(out.latencies)
	return out
}

// startResponders connects n echo responders that share EchoTopic and
// answer every request with +OK, correlation data and __stat, as a
// command executor would.
func startResponders(ctx context.Context, addr string, n int) (func(), error) {
	var run [4]byte
	rand.Read(run[:])
	var conns []*paho.Client
	stop := func() {
		for _, c := range conns {
			c.Disconnect(&paho.Disconnect{})
		}
	}
	for i := 0; i < n; i++ {
		c, err := openConn(ctx, addr, fmt.Sprintf("bench-echo-%x-%d", run, i), "$share/mqkv-bench/"+EchoTopic, func(c *paho.Client, req *paho.Publish) {
			if req.Properties == nil || req.Properties.ResponseTopic == "" {
				return
			}
			// Published from a goroutine, as executors do: paho's
			// receive loop must not wait for its own PUBACK.
			go c.Publish(ctx, &paho.Publish{
				Topic:   req.Properties.ResponseTopic,
				QoS:     1,
				Payload: resp.OK,
				Properties: &paho.PublishProperties{
					CorrelationData: req.Properties.CorrelationData,
					ContentType:     "application/octet-stream",
					User:            paho.UserProperties{{Key: "__stat", Value: "200"}},
				},
			})
		})
		if err != nil {
			stop()
			return nil, err
		}
		conns = append(conns, c)
	}
	return stop, nil
}

// registerPatterns registers n pattern KEYNOTIFYs shaped like a fleet's
// ("tenant-00042/*/alerts"): each has a literal prefix, none matches a
// benchmark key. They are spread over a few connections (the server caps
// registrations per connection).
func registerPatterns(ctx context.Context, addr string, n int) ([]*client, error) {
	const perConn = 5000
	cls, err := connect(ctx, addr, "patterns", (n+perConn-1)/perConn)
	if err != nil {
		return nil, err
	}
	for i := 0; i < n; i++ {
		pattern := []byte(fmt.Sprintf("tenant-%05d/*/alerts", i))
		r, err := cls[i/perConn].call(ctx, resp.AppendBulks(nil, []byte("KEYNOTIFY"), pattern, []byte("PATTERN")))
		if err == nil && !bytes.Equal(r, resp.OK) {
			err = fmt.Errorf("KEYNOTIFY PATTERN answered %q", r)
		}
		if err != nil {
			closeAll(cls)
			return nil, err
		}
	}
	return cls, nil
}
