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
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
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
}

// cpu is what the server's processes used so far.
func (s *server) cpu() (time.Duration, error) {
	var sum time.Duration
	for _, p := range append([]*process{s.proc}, s.more...) {
		c, err := p.cpu()
		if err != nil {
			return 0, err
		}
		sum += c
	}
	return sum, nil
}

func (s *server) stop() { stopAll(append([]*process{s.proc}, s.more...)) }

func main() {
	rounds := flag.Int("rounds", 3, "rounds per workload; mqkv and the peer alternate")
	duration := flag.Duration("duration", 10*time.Second, "measured time per round")
	warmup := flag.Duration("warmup", 2*time.Second, "unmeasured time before each round")
	clients := flag.Int("clients", 64, "clients, each with one operation in flight")
	valueSize := flag.Int("value-size", 256, "value and payload size in bytes")
	keys := flag.Int("keys", 10000, "keyspace size for SET/GET")
	only := flag.String("only", "set,get,pubsub", "workloads to run: set, get, pubsub (one node each), across-qos0 and across-qos1 (three-node clusters of mqkv and NATS, MQTT 3.1.1 clients publishing on one node to subscribers on another), mc-set and mc-get (mqkv's memcached endpoint, durable, against memcached, in memory), http-put and http-get (mqkv's HTTP endpoint against etcd's HTTP/JSON gateway)")
	aliases := flag.Uint("topic-alias-max", 0, "Topic Alias Maximum the pub/sub clients give in CONNECT (mosquitto 2.0 sends no aliases whatever it is)")
	mqkvBin := flag.String("mqkv", "", "mqkv binary (default: built from the repository)")
	flag.StringVar(&mqkvAdmin, "mqkv-admin", "", "serve mqkv's admin endpoint (metrics, pprof) on this `address` while measuring")
	cpuProfile := flag.String("cpuprofile", "", "write the load generator's CPU profile to this `file` (what the clients cost)")
	pin := flag.Bool("pin", false, "run each server on CPU 1 and the load generator on CPU 0 (taskset): the server's capacity on one core, apart from the clients' cost")
	flag.Parse()
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
	var results []result
	for _, w := range strings.Split(*only, ",") {
		var pair [2]func(addr string) workload
		var peer func(dir string) (*server, error)
		switch w {
		case "set", "get":
			get := w == "get"
			pair[0] = func(addr string) workload { return &mqkvKV{addr: addr, get: get, keys: *keys, value: value} }
			pair[1] = func(addr string) workload { return &etcdKV{addr: addr, get: get, keys: *keys, value: value} }
			peer = startEtcd
		case "http-put", "http-get":
			get := w == "http-get"
			pair[0] = func(addr string) workload {
				return &httpKV{label: "mqkv", addr: addr, get: get, keys: *keys, value: value}
			}
			pair[1] = func(addr string) workload {
				return &httpKV{label: "etcd", addr: addr, etcd: true, get: get, keys: *keys, value: value}
			}
			peer = startEtcd
		case "mc-set", "mc-get":
			get := w == "mc-get"
			pair[0] = func(addr string) workload {
				return &memcacheKV{label: "mqkv", addr: addr, get: get, keys: *keys, value: value}
			}
			pair[1] = func(addr string) workload {
				return &memcacheKV{label: "memcached", addr: addr, get: get, keys: *keys, value: value}
			}
			peer = startMemcached
		case "pubsub":
			pair[0] = func(addr string) workload { return &pubsub{addr: addr, payload: value, aliases: uint16(*aliases)} }
			pair[1] = pair[0]
			peer = startMosquitto
		case "across-qos0", "across-qos1":
			qos := byte(w[len(w)-1] - '0')
			pair[0] = func(addr string) workload { return &across{addrs: strings.Split(addr, ","), qos: qos, pl: value} }
			pair[1] = pair[0]
			peer = func(dir string) (*server, error) {
				bin, err := buildNATS(work)
				if err != nil {
					return nil, err
				}
				return startNATSCluster(bin, dir)
			}
		default:
			log.Fatalf("unknown workload %q", w)
		}
		servers := [2]*server{}
		start := startMQKV
		if strings.HasPrefix(w, "across") {
			start = startMQKVCluster
		}
		if strings.HasPrefix(w, "mc-") {
			start = startMQKVMemcache
		}
		if strings.HasPrefix(w, "http-") {
			start = startMQKVHTTP
		}
		if servers[0], err = start(*mqkvBin, filepath.Join(work, w, "mqkv")); err != nil {
			log.Fatal(err)
		}
		if servers[1], err = peer(filepath.Join(work, w, "peer")); err != nil {
			servers[0].stop()
			log.Fatal(err)
		}
		var sums [2]result
		for r := 0; r < *rounds; r++ {
			for k, s := range servers {
				res, err := measure(pair[k](s.addr), s, *clients, *warmup, *duration)
				if err != nil {
					log.Fatalf("%s %s: %v", s.name, w, err)
				}
				res.workload = w
				fmt.Fprintf(os.Stderr, "round %d %-9s %-6s %8.0f ops/s  p50 %6.2f ms  p99 %6.2f ms  %5.1f µs CPU/op\n",
					r+1, s.name, w, res.opsPerSec(), ms(res.p(50)), ms(res.p(99)), res.cpuPerOp())
				sums[k].add(res)
			}
		}
		results = append(results, sums[0], sums[1])
		for _, s := range servers {
			s.stop()
		}
	}
	if *pin {
		fmt.Println("servers on CPU 1, load generator on CPU 0 (-pin)")
	}
	printTable(results, *clients, *valueSize, *rounds, *duration)
}

// measure runs w against s: warmup, then duration measured.
func measure(w workload, s *server, clients int, warmup, duration time.Duration) (result, error) {
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
	measuring.Store(true)
	t0 := time.Now()
	time.Sleep(duration)
	measuring.Store(false)
	elapsed := time.Since(t0)
	cpu1, _ := s.cpu()
	cancel()
	wg.Wait()
	if err, ok := firstErr.Load().(error); ok {
		return result{}, err
	}
	res := result{server: s.name, elapsed: elapsed, cpu: cpu1 - cpu0}
	for _, l := range lat {
		res.lat = append(res.lat, l...)
	}
	return res, nil
}

type result struct {
	workload, server string
	elapsed, cpu     time.Duration
	lat              []time.Duration
}

func (r *result) add(o result) {
	r.workload, r.server = o.workload, o.server
	r.elapsed += o.elapsed
	r.cpu += o.cpu
	r.lat = append(r.lat, o.lat...)
}

func (r result) opsPerSec() float64 { return float64(len(r.lat)) / r.elapsed.Seconds() }

func (r result) cpuPerOp() float64 {
	if len(r.lat) == 0 {
		return 0
	}
	return float64(r.cpu.Microseconds()) / float64(len(r.lat))
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

func printTable(rs []result, clients, size, rounds int, d time.Duration) {
	fmt.Printf("%d clients, %d-byte values, %d rounds of %v each, alternating; totals over all rounds\n\n", clients, size, rounds, d)
	fmt.Println("| workload | server | ops/s | p50 ms | p99 ms | server CPU µs/op | mqkv / peer ops/s | mqkv / peer CPU/op |")
	fmt.Println("|---|---|---:|---:|---:|---:|---:|---:|")
	for i := 0; i+1 < len(rs); i += 2 {
		m, p := rs[i], rs[i+1]
		for _, r := range []result{m, p} {
			ratio, cpuRatio := "", ""
			if r.server != "mqkv" {
				ratio = fmt.Sprintf("%.2fx", m.opsPerSec()/p.opsPerSec())
				cpuRatio = fmt.Sprintf("%.2fx", m.cpuPerOp()/p.cpuPerOp())
			}
			fmt.Printf("| %s | %s | %.0f | %.2f | %.2f | %.1f | %s | %s |\n", r.workload, r.server, r.opsPerSec(), ms(r.p(50)), ms(r.p(99)), r.cpuPerOp(), ratio, cpuRatio)
		}
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
