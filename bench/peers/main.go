// Command peers measures mqkv side by side with the programs its users
// would otherwise run, on this machine, in alternating rounds: durable
// SET/GET against etcd put/get (one member, fsync on), MQTT QoS 1
// pub/sub round trips against mosquitto, and MQTT 3.1.1 messages across
// the nodes of three-node clusters against NATS (nats-server from the Go
// module proxy, MQTT and JetStream on). Each workload is a closed loop:
// every client has one request in flight. It reports throughput, latency
// percentiles and the server's CPU time per operation (from /proc).
//
// It lives in its own module so that the mqkv binary carries no etcd
// client. Run it through run.sh, which installs the peers if missing.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// A workload runs a closed loop against one server until ctx ends,
// recording each operation's latency.
type workload interface {
	name() string
	// prepare connects n clients (and loads keys); op is then called by
	// client i in a loop.
	prepare(ctx context.Context, n int) error
	op(ctx context.Context, i int, seq int) error
	close()
}

// server is a peer process on a private port with a fresh data dir.
type server struct {
	name string
	proc *process
	more []*process // a cluster's other nodes
	addr string     // a cluster's: its nodes' MQTT addresses, comma-separated
	// parts names proc and more, where their CPU is reported apart.
	parts []string
	// admin lists mqkv's admin endpoints, one per node, when profiling.
	admin []string
}

// cpu is what each of the server's processes used so far.
func (s *server) cpu() ([]time.Duration, error) {
	var out []time.Duration
	for _, p := range append([]*process{s.proc}, s.more...) {
		c, err := p.cpu()
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

func (s *server) stop() { stopAll(append([]*process{s.proc}, s.more...)) }

func main() {
	rounds := flag.Int("rounds", 3, "rounds per workload; mqkv and the peer alternate")
	duration := flag.Duration("duration", 10*time.Second, "measured time per round")
	warmup := flag.Duration("warmup", 2*time.Second, "unmeasured time before each round")
	clients := flag.Int("clients", 64, "clients, each with one operation in flight")
	valueSize := flag.Int("value-size", 256, "value and payload size in bytes")
	keys := flag.Int("keys", 10000, "keyspace size for SET/GET")
	only := flag.String("only", "set,get,pubsub", "workloads to run: set, get, pubsub (one node each), cluster-set and cluster-get (three-node clusters of mqkv, etcd and NATS JetStream KV, R3), attach-set and attach-get (mqkv attached to mosquitto, against mqkv's own broker and mosquitto's own pub/sub round trip), across-qos0 and across-qos1 (three-node clusters of mqkv and NATS, MQTT 3.1.1 clients publishing on one node to subscribers on another), mc-set and mc-get (mqkv's memcached endpoint, durable, against memcached, in memory), http-put and http-get (mqkv's HTTP endpoint against etcd's HTTP/JSON gateway)")
	aliases := flag.Uint("topic-alias-max", 0, "Topic Alias Maximum the pub/sub clients give in CONNECT (mosquitto 2.0 sends no aliases whatever it is)")
	mqkvBin := flag.String("mqkv", "", "mqkv binary (default: built from the repository)")
	baseline := flag.String("baseline", "", "another mqkv `binary` (an earlier build) run beside mqkv as one more contestant")
	mqkvGroups := flag.String("mqkv-groups", "0", "raft groups of mqkv's three-node clusters, a `list` swept (0: mqkv's default), each with every -mqkv-conns")
	mqkvOnly := flag.Bool("mqkv-only", false, "run mqkv's rows only (with -baseline: one build against another)")
	flag.StringVar(&mqkvAdmin, "mqkv-admin", "", "serve mqkv's admin endpoint (metrics, pprof) on this `address` while measuring")
	etcdConns := flag.String("etcd-conns", "1,8,64", "etcd: gRPC connections the clients share, a `list` swept (one row each)")
	natsConns := flag.String("nats-conns", "1,8,64", "NATS: connections the clients share, a `list` swept (one row each)")
	mqkvConns := flag.String("mqkv-conns", "0", "mqkv (set, get, cluster-set, cluster-get): MQTT connections the clients share, a `list` swept (one row each; 0: one each, the first row the one others are compared with)")
	profileDir := flag.String("profile", "", "write CPU profiles of every mqkv node over its first measured round into this `dir`, and print where the CPU went")
	cpuProfile := flag.String("cpuprofile", "", "write the load generator's CPU profile to this `file` (what the clients cost)")
	pin := flag.Bool("pin", false, "run each server on CPU 1 and the load generator on CPU 0 (taskset): the server's capacity on one core, apart from the clients' cost")
	flag.Parse()
	profiling = *profileDir != ""
	if *pin {
		if err := pinSelf("0"); err != nil {
			log.Fatal(err)
		}
		serverCPU = "1"
	}
	log.SetFlags(0)
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}

	work, err := os.MkdirTemp("", "mqkv-peers-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(work)
	if *mqkvBin == "" {
		*mqkvBin = filepath.Join(work, "mqkv")
		if err := buildMQKV(*mqkvBin); err != nil {
			log.Fatal(err)
		}
	}
	value := []byte(strings.Repeat("v", *valueSize))
	etcdSweep, err := counts(*etcdConns, 1)
	if err != nil {
		log.Fatalf("-etcd-conns: %v", err)
	}
	natsSweep, err := counts(*natsConns, 1)
	if err != nil {
		log.Fatalf("-nats-conns: %v", err)
	}
	mqkvSweep, err := counts(*mqkvConns, 0)
	if err != nil {
		log.Fatalf("-mqkv-conns: %v", err)
	}
	groupSweep, err := counts(*mqkvGroups, 0)
	if err != nil {
		log.Fatalf("-mqkv-groups: %v", err)
	}
	var natsBin string
	nats := func() string {
		if natsBin == "" {
			if natsBin, err = buildNATS(work); err != nil {
				log.Fatal(err)
			}
		}
		return natsBin
	}
	for _, w := range strings.Split(*only, ",") {
		// The first contestant is mqkv; every other row is compared with it.
		var cs []contestant
		mqkvAs := func(label string, start func(bin, dir string) (*server, error), load func(addr string) workload) {
			cs = append(cs, contestant{"mqkv" + label, func(dir string) (*server, error) { return start(*mqkvBin, dir) }, load})
			if *baseline != "" {
				cs = append(cs, contestant{"mqkv baseline" + label, func(dir string) (*server, error) { return start(*baseline, dir) }, load})
			}
		}
		mqkv := func(start func(bin, dir string) (*server, error), load func(addr string) workload) {
			mqkvAs("", start, load)
		}
		switch w {
		case "set", "get", "cluster-set", "cluster-get":
			get := strings.HasSuffix(w, "get")
			cluster := strings.HasPrefix(w, "cluster-")
			start, startEtcdN := startMQKV, startEtcd
			if cluster {
				start, startEtcdN = startMQKVCluster, startEtcdCluster
			}
			// In a cluster, mqkv's Go client sends each request to its
			// key's leader (client.Config.Direct); the AIO SDKs send
			// every request to the member they are connected to, which
			// forwards two in three: that is the second row.
			groups := []int{0}
			if cluster {
				groups = groupSweep
			}
			for gi, gs := range groups {
				start := start
				if cluster {
					start = startMQKVClusterOf(gs)
				}
				for k, n := range mqkvSweep {
					label := ""
					if n > 0 {
						label = fmt.Sprintf(" %d conn", n)
					}
					if gs > 0 {
						label += fmt.Sprintf(", %d groups", gs)
					}
					load := func(addr string) workload {
						return &mqkvKV{addrs: strings.Split(addr, ","), get: get, keys: *keys, value: value, direct: cluster, conns: n}
					}
					if gi == 0 && k == 0 {
						mqkvAs(label, start, load) // the row every other is compared with
						continue
					}
					cs = append(cs, contestant{"mqkv" + label, func(dir string) (*server, error) { return start(*mqkvBin, dir) }, load})
				}
			}
			if cluster {
				cs = append(cs, contestant{"mqkv, every request through the client's member", func(dir string) (*server, error) { return start(*mqkvBin, dir) }, func(addr string) workload {
					return &mqkvKV{addrs: strings.Split(addr, ","), get: get, keys: *keys, value: value}
				}})
			}
			for _, n := range etcdSweep {
				cs = append(cs, contestant{fmt.Sprintf("etcd %d conn", n), startEtcdN, func(addr string) workload {
					return &etcdKV{endpoints: strings.Split(addr, ","), conns: n, get: get, keys: *keys, value: value}
				}})
			}
			if !cluster {
				break
			}
			durability := []bool{true}
			if !get {
				durability = append(durability, false) // for reference
			}
			for _, always := range durability {
				label := "nats R3 sync always"
				if !always {
					label = "nats R3 default sync (not durable)"
				}
				for k, n := range natsSweep {
					if !always && k > 0 {
						break // the reference runs once
					}
					cs = append(cs, contestant{fmt.Sprintf("%s %d conn", label, n),
						func(dir string) (*server, error) { return startNATSKV(nats(), dir, always) },
						func(addr string) workload {
							return &natsKV{urls: strings.Split(addr, ","), conns: n, get: get, keys: *keys, value: value}
						}})
				}
			}
		case "http-put", "http-get":
			get := w == "http-get"
			mqkv(startMQKVHTTP, func(addr string) workload {
				return &httpKV{label: "mqkv", addr: addr, get: get, keys: *keys, value: value}
			})
			cs = append(cs, contestant{"etcd", startEtcd, func(addr string) workload {
				return &httpKV{label: "etcd", addr: addr, etcd: true, get: get, keys: *keys, value: value}
			}})
		case "mc-set", "mc-get":
			get := w == "mc-get"
			mqkv(startMQKVMemcache, func(addr string) workload {
				return &memcacheKV{label: "mqkv", addr: addr, get: get, keys: *keys, value: value}
			})
			cs = append(cs, contestant{"memcached", startMemcached, func(addr string) workload {
				return &memcacheKV{label: "memcached", addr: addr, get: get, keys: *keys, value: value}
			}})
		case "attach-set", "attach-get":
			get := w == "attach-get"
			load := func(addr string) workload {
				return &mqkvKV{addrs: strings.Split(addr, ","), get: get, keys: *keys, value: value}
			}
			if *baseline != "" {
				cs = append(cs, contestant{"mqkv baseline attached to mosquitto", func(dir string) (*server, error) { return startMQKVAttached(*baseline, dir) }, load})
			}
			cs = append(cs, contestant{"mqkv attached to mosquitto", func(dir string) (*server, error) { return startMQKVAttached(*mqkvBin, dir) }, load},
				contestant{"mqkv's own broker", func(dir string) (*server, error) { return startMQKV(*mqkvBin, dir) }, load},
				contestant{"mosquitto QoS 1 round trip", func(dir string) (*server, error) {
					return startMosquittoWith(dir, "set_tcp_nodelay true", "max_inflight_messages 1000")
				}, func(addr string) workload { return &pubsub{addr: addr, payload: value} }})
		case "pubsub":
			load := func(addr string) workload { return &pubsub{addr: addr, payload: value, aliases: uint16(*aliases)} }
			mqkv(startMQKV, load)
			cs = append(cs, contestant{"mosquitto", startMosquitto, load})
		case "across-qos0", "across-qos1":
			qos := byte(w[len(w)-1] - '0')
			load := func(addr string) workload { return &across{addrs: strings.Split(addr, ","), qos: qos, pl: value} }
			mqkv(startMQKVCluster, load)
			cs = append(cs, contestant{"nats", func(dir string) (*server, error) { return startNATSCluster(nats(), dir) }, load})
		default:
			log.Fatalf("unknown workload %q", w)
		}
		if *mqkvOnly {
			cs = slices.DeleteFunc(cs, func(c contestant) bool { return !strings.HasPrefix(c.label, "mqkv") })
		}
		sums := make([]result, len(cs))
		for r := 0; r < *rounds; r++ {
			for k, c := range cs {
				// Every contestant starts fresh each round: a peer's
				// state from an earlier round (compaction, a grown log)
				// would weigh on the next.
				s, err := c.start(filepath.Join(work, w, fmt.Sprint(r), fmt.Sprint(k)))
				if err != nil {
					log.Fatalf("%s %s: %v", c.label, w, err)
				}
				var prof []string
				if k == 0 && r == 0 && *profileDir != "" {
					prof = s.admin
				}
				res, err := measure(c.load(s.addr), s, *clients, *warmup, *duration, prof, filepath.Join(*profileDir, w))
				s.stop()
				if err != nil {
					log.Fatalf("%s %s: %v", c.label, w, err)
				}
				res.workload, res.server = w, c.label
				fmt.Fprintf(os.Stderr, "round %d %-9s %-24s %8.0f ops/s  p50 %6.2f ms  p99 %6.2f ms  %5.1f µs CPU/op  client %5.1f µs/op\n",
					r+1, w, c.label, res.opsPerSec(), ms(res.p(50)), ms(res.p(99)), res.cpuPerOp(), res.clientCPUPerOp())
				sums[k].add(res)
			}
		}
		printTable(os.Stdout, sums)
	}
	if *pin {
		fmt.Println("servers on CPU 1, load generator on CPU 0 (-pin)")
	}
	fmt.Printf("\n%d clients, %d-byte values, %d rounds of %v each, contestants taking turns; totals over all rounds\n", *clients, *valueSize, *rounds, *duration)
	if *pin {
		fmt.Println("servers on CPU 1, load generator on CPU 0 (-pin)")
	}
}

// measure runs w against s: warmup, then duration measured.
func measure(w workload, s *server, clients int, warmup, duration time.Duration, profile []string, profDir string) (result, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := w.prepare(ctx, clients); err != nil {
		return result{}, err
	}
	defer w.close()
	var measuring atomic.Bool
	lat := make([][]time.Duration, clients)
	var firstErr atomic.Value
	var wg sync.WaitGroup
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seq := 0; ctx.Err() == nil; seq++ {
				start := time.Now()
				if err := w.op(ctx, i, seq); err != nil {
					if ctx.Err() == nil {
						firstErr.CompareAndSwap(nil, err)
						cancel()
					}
					return
				}
				if measuring.Load() {
					lat[i] = append(lat[i], time.Since(start))
				}
			}
		}()
	}
	time.Sleep(warmup)
	cpu0, err := s.cpu()
	if err != nil {
		return result{}, err
	}
	self0 := selfCPU()
	measuring.Store(true)
	t0 := time.Now()
	profiled := startProfiles(profile, duration, profDir)
	time.Sleep(duration)
	measuring.Store(false)
	elapsed := time.Since(t0)
	cpu1, _ := s.cpu()
	self1 := selfCPU()
	profErr := profiled()
	cancel()
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		return result{}, err
	}
	if profErr != nil {
		return result{}, profErr
	}
	res := result{server: s.name, elapsed: elapsed, client: self1 - self0, parts: s.parts}
	for i := range cpu0 {
		d := cpu1[i] - cpu0[i]
		res.cpu += d
		res.partCPU = append(res.partCPU, d)
	}
	for _, l := range lat {
		res.lat = append(res.lat, l...)
	}
	return res, nil
}

type result struct {
	workload, server string
	elapsed, cpu     time.Duration
	client           time.Duration // the load generator's CPU
	lat              []time.Duration
	// partCPU is each server process's share of cpu, named by parts
	// (set when they differ: a broker and an attached mqkv).
	partCPU []time.Duration
	parts   []string
}

// contestant is one server configuration a workload runs against: how to
// start it and the load for it.
type contestant struct {
	label string
	start func(dir string) (*server, error)
	load  func(addr string) workload
}

// counts parses a comma-separated list of positive numbers.
func counts(list string, least int) ([]int, error) {
	var ns []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < least {
			return nil, fmt.Errorf("%q is not a number of %d or more", f, least)
		}
		ns = append(ns, n)
	}
	return ns, nil
}

// selfCPU is the CPU time this process (the load generator) used so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func (r *result) add(o result) {
	r.workload, r.server = o.workload, o.server
	r.elapsed += o.elapsed
	r.cpu += o.cpu
	r.client += o.client
	r.parts = o.parts
	if len(r.partCPU) < len(o.partCPU) {
		r.partCPU = make([]time.Duration, len(o.partCPU))
	}
	for i, d := range o.partCPU {
		r.partCPU[i] += d
	}
	r.lat = append(r.lat, o.lat...)
}

func (r result) opsPerSec() float64 { return float64(len(r.lat)) / r.elapsed.Seconds() }

func (r result) cpuPerOp() float64 {
	if len(r.lat) == 0 {
		return 0
	}
	return float64(r.cpu.Microseconds()) / float64(len(r.lat))
}

func (r result) clientCPUPerOp() float64 {
	if len(r.lat) == 0 {
		return 0
	}
	return float64(r.client.Microseconds()) / float64(len(r.lat))
}

func (r result) p(q float64) time.Duration {
	if len(r.lat) == 0 {
		return 0
	}
	s := slices.Clone(r.lat)
	slices.Sort(s)
	return s[min(len(s)-1, int(float64(len(s))*q/100))]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// printTable prints one workload's results, the first row mqkv's and
// every other row compared with it.
func printTable(out io.Writer, rs []result) {
	fmt.Fprintln(out, "\n| workload | server | ops/s | p50 ms | p99 ms | server CPU µs/op | load generator CPU µs/op | mqkv / this ops/s | mqkv / this CPU/op |")
	fmt.Fprintln(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|")
	m := rs[0]
	for k, r := range rs {
		ratio, cpuRatio := "", ""
		if k > 0 {
			ratio = fmt.Sprintf("%.2fx", m.opsPerSec()/r.opsPerSec())
			cpuRatio = fmt.Sprintf("%.2fx", m.cpuPerOp()/r.cpuPerOp())
		}
		fmt.Fprintf(out, "| %s | %s | %.0f | %.2f | %.2f | %.1f | %.1f | %s | %s |\n", r.workload, r.server, r.opsPerSec(), ms(r.p(50)), ms(r.p(99)), r.cpuPerOp(), r.clientCPUPerOp(), ratio, cpuRatio)
	}
	for _, r := range rs {
		if len(r.parts) == 0 || len(r.lat) == 0 {
			continue
		}
		fmt.Fprintf(out, "\n%s, server CPU per op by process:", r.server)
		for i, name := range r.parts {
			fmt.Fprintf(out, " %s %.1f µs", name, float64(r.partCPU[i].Microseconds())/float64(len(r.lat)))
		}
		fmt.Fprintln(out)
		fmt.Fprintln(out)
	}
}

// pinSelf runs the rest of the program on cpus: it execs itself again
// under taskset, so that every thread, the Go runtime's included, and
// GOMAXPROCS follow. The variable marks the second run.
func pinSelf(cpus string) error {
	if os.Getenv("MQKV_PEERS_PINNED") != "" {
		return nil
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	taskset, err := exec.LookPath("taskset")
	if err != nil {
		return err
	}
	os.Setenv("MQKV_PEERS_PINNED", "1")
	return syscall.Exec(taskset, append([]string{"taskset", "-c", cpus, exe}, os.Args[1:]...), os.Environ())
}
