package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/mqkv/mqkv/internal/bench"
	"github.com/mqkv/mqkv/internal/cluster"
	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/procs"
	"github.com/mqkv/mqkv/internal/server"
)

func benchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure a server's throughput and latency",
		Args:  cobra.NoArgs,
	}
	fs := cmd.Flags()
	addr := fs.String("server", "", "MQTT `address` of the server to measure; empty starts a fresh one as a child process")
	inMemory := fs.Bool("in-memory", false, "start the child server in memory instead of on a temporary data directory")
	clients := fs.Int("clients", 64, "number of MQTT clients, each with one request in flight")
	op := fs.String("op", "set", "request `mix`: set, get, mixed (half each), lease (SET NEX PX renewals), echo, ping; or pubsub (QoS 1 messages, each client's publisher on one node and its subscriber on the next)")
	subExpiry := fs.Uint("session-expiry", 0, "with --op pubsub: the subscribers' Session Expiry Interval in `seconds` (above 0, a cluster keeps their sessions in the store); with --baseline clean, compared with 0")
	valueSize := fs.Int("value-size", 256, "value size in `bytes`")
	keys := fs.Int("keys", 10000, "size of the keyspace")
	duration := fs.Duration("duration", 10*time.Second, "measured time per round")
	warmup := fs.Duration("warmup", 2*time.Second, "unmeasured time before each round")
	baseline := fs.String("baseline", "", "also measure a baseline and report ratios: `echo` (an MQTT responder client answers through the same broker), ping (the server answers PING without touching the store), nopolicy (the same op on a second child server without --policy), or nopatterns (the same op without the --patterns registrations)")
	nodes := fs.Int("cluster", 0, "start this many child nodes as one cluster (RF 3) and spread the clients over them; reports server CPU per op summed over the nodes")
	policyFile := fs.String("policy", "", "start the child server with this authorization policy `file`")
	patterns := fs.Int("patterns", 0, "register this many pattern KEYNOTIFYs (matching no benchmark key) while measuring; with --baseline nopatterns, compare with none")
	responders := fs.Int("responders", 4, "echo responder connections (a shared subscription)")
	rounds := fs.Int("rounds", 1, "alternate baseline and op this many times; figures are totals over all rounds")
	addAfter := fs.Duration("add-node-after", 0, "with --cluster: start one more node this `long` into the measured time and report the rebalancing: how long until its replicas are in place, MB moved to it, and the throughput before and meanwhile")
	rate := fs.Float64("rate", 0, "pace the clients to about this many requests a `second` in all (0: as fast as replies come); compares CPU per op at the same load")
	cpuProfile := fs.String("cpu-profile", "", "write a CPU profile of the load generator (this process, not the server) to `file`")
	rollingAfter := fs.Duration("rolling-restart-after", 0, "with --cluster 3 or more: this `long` into the measured time, restart every node in turn (SIGTERM, start again, wait until the cluster has settled) while clients use all nodes, reconnecting to another node when theirs stops; reports the longest time no request completed and the latencies meanwhile")
	stopAfter := fs.Duration("stop-after", 0, "like --kill-after, with SIGTERM: the node hands its leaderships over and stops gracefully; reports the same figures")
	killAfter := fs.Duration("kill-after", 0, "with --cluster 3 or more: SIGKILL the last node this `long` into the measured time (clients use the other nodes) and report the failover: the longest time no request completed, and latencies in the 10 s after")
	cmd.Long = `Closed-loop load: each client sends a request exactly as the AIO SDKs frame
it, waits for the reply, and sends the next. Prints throughput and latency
percentiles.

Baselines, measured in the same run:
  echo  the same requests go to an MQTT responder client (shared
        subscription, --responders connections) that answers through
        the same broker without a store: the MQTT request/response floor
  ping  the server answers PING without touching the store: the floor of
        the state store's own request path (stricter)
  samenode  (--op pubsub) each client's publisher and subscriber on the
        same node: the baseline of messages across nodes
  clean  (--op pubsub --session-expiry N) the subscribers' sessions
        clean: what keeping them in the cluster's store costs`
	cmd.Example = `  mqkv bench --op set --baseline echo            # durable SET against the MQTT floor
  mqkv bench --op get --clients 64 --value-size 256 --baseline echo
  mqkv bench --op set --clients 1 --baseline echo  # single-client latency
  mqkv bench --cluster 3 --op pubsub --baseline samenode  # MQTT across nodes
  mqkv bench --server 127.0.0.1:1883 --op mixed  # an already running server`
	cmd.RunE = func(*cobra.Command, []string) error {
		switch bench.Op(*op) {
		case bench.OpEcho, bench.OpPing, bench.OpSet, bench.OpGet, bench.OpMixed, bench.OpLease, bench.OpPubSub:
		default:
			return fmt.Errorf("bench: unknown op %q", *op)
		}
		switch *baseline {
		case "", "echo", "ping":
		case "samenode", "clean":
			if bench.Op(*op) != bench.OpPubSub {
				return fmt.Errorf("bench: --baseline %s compares pub/sub runs: give --op pubsub", *baseline)
			}
			if *baseline == "clean" && *subExpiry == 0 {
				return fmt.Errorf("bench: --baseline clean compares with --session-expiry: give it")
			}
		case "nopatterns":
			if *patterns <= 0 {
				return fmt.Errorf("bench: --baseline nopatterns needs --patterns")
			}
		case "nopolicy":
			if *policyFile == "" || *addr != "" {
				return fmt.Errorf("bench: --baseline nopolicy compares two child servers: give --policy and no --server")
			}
		default:
			return fmt.Errorf("bench: unknown baseline %q (want echo, ping, nopolicy, nopatterns, samenode or clean)", *baseline)
		}
		if *clients < 1 || *rounds < 1 || *duration <= 0 || *keys < 1 || *responders < 1 {
			return fmt.Errorf("bench: --clients, --rounds, --duration, --keys and --responders must be positive")
		}
		if *rollingAfter > 0 && (*nodes < 3 || *rounds != 1 || *baseline != "" || *killAfter > 0 || *stopAfter > 0 || *rollingAfter >= *duration) {
			return fmt.Errorf("bench: --rolling-restart-after needs --cluster 3 or more, one round, no baseline, no other fault, and a time inside --duration")
		}
		graceful := *stopAfter > 0
		if graceful {
			if *killAfter > 0 {
				return fmt.Errorf("bench: --stop-after or --kill-after, not both")
			}
			*killAfter = *stopAfter
		}
		if *killAfter > 0 && (*nodes < 3 || *rounds != 1 || *baseline != "" || *killAfter >= *duration) {
			return fmt.Errorf("bench: --kill-after needs --cluster 3 or more, one round, no baseline, and a time inside --duration")
		}
		if *addAfter > 0 && (*nodes < 1 || *rounds != 1 || *baseline != "" || *killAfter > 0 || *addAfter >= *duration) {
			return fmt.Errorf("bench: --add-node-after needs --cluster, one round, no baseline, no --kill-after, and a time inside --duration")
		}
		if *valueSize < 0 || *patterns < 0 || *warmup < 0 {
			return fmt.Errorf("bench: --value-size, --patterns and --warmup must not be negative")
		}
		stopProfile, err := cpuProfileTo(*cpuProfile)
		if err != nil {
			return err
		}
		defer stopProfile()
		ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt)
		defer cancel()

		mode := "existing server"
		baseAddr := *addr
		var children []*server.Process // the servers whose CPU is counted
		var childArgs [][]string       // a cluster node's arguments, to restart it
		var baseChild *server.Process  // the baseline's own server (nopolicy)
		// storage gives a child server its flags: in memory, or a fresh
		// data directory, removed once the servers have stopped.
		var dirs []string
		defer func() {
			for _, d := range dirs {
				os.RemoveAll(d)
			}
		}()
		storage := func(prefix string) ([]string, error) {
			if *inMemory {
				return []string{"--in-memory"}, nil
			}
			dir, err := os.MkdirTemp("", prefix)
			if err != nil {
				return nil, err
			}
			dirs = append(dirs, dir)
			return []string{"--data-dir", dir}, nil
		}
		if *addr == "" {
			extra, err := storage("mqkv-bench-")
			if err != nil {
				return err
			}
			mode = "child server, in memory"
			if !*inMemory {
				mode = "child server, durable (fsync), data dir " + extra[1]
			}
			if *baseline == "nopolicy" {
				// The baseline server: the same, without the policy.
				args, err := storage("mqkv-bench-base-")
				if err != nil {
					return err
				}
				p, err := spawnSelf(args...)
				if err != nil {
					return err
				}
				defer p.Stop()
				baseAddr, baseChild = p.Addr(), p
			}
			if *policyFile != "" {
				extra = append(extra, "--policy", *policyFile)
				mode += ", policy " + *policyFile
			}
			if *nodes > 0 {
				procs, args, err := spawnCluster(*nodes, storage)
				if err != nil {
					for _, p := range procs {
						p.Stop()
					}
					return err
				}
				children, childArgs = procs, args
				defer func() { // the children then, restarted ones included
					for _, p := range children {
						p.Stop()
					}
				}()
				var addrs []string
				for _, p := range procs {
					addrs = append(addrs, p.Addr())
				}
				if *killAfter > 0 {
					addrs = addrs[:len(addrs)-1] // the victim serves no client
				}
				*addr = strings.Join(addrs, ",")
				mode = fmt.Sprintf("%d-node cluster of child servers, durable, RF 3", *nodes)
			} else {
				p, err := spawnSelf(extra...)
				if err != nil {
					return err
				}
				defer p.Stop()
				children = []*server.Process{p}
				*addr = p.Addr()
			}
			if baseAddr == "" {
				baseAddr = *addr
			}
		}
		cfg := bench.Config{
			Addr: *addr, Clients: *clients, Responders: *responders, Op: bench.Op(*op), ValueSize: *valueSize,
			Keys: *keys, Duration: *duration, Warmup: *warmup, Patterns: *patterns, Rate: *rate,
			SessionExpiry: uint32(*subExpiry),
		}
		var joined *server.Process
		if *addAfter > 0 {
			args, err := storage("mqkv-bench-node-")
			if err != nil {
				return err
			}
			id := fmt.Sprintf("b%d", len(children)+1)
			args = append(args, "--node-id", id, "--cluster-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--join", children[0].ClusterAddr())
			cfg.FaultAt = *addAfter
			cfg.Fault = func() {
				p, err := spawnSelf(args...)
				if err != nil {
					fmt.Fprintf(os.Stderr, "bench: starting %s: %v\n", id, err)
					return
				}
				joined = p
				for !settled(p.AdminAddr(), min(len(children)+1, cluster.DefaultRF)) {
					time.Sleep(100 * time.Millisecond)
				}
			}
			defer func() {
				if joined != nil {
					joined.Stop()
				}
			}()
		}
		var restarted time.Duration // how long the rolling restart took
		if *rollingAfter > 0 {
			cfg.Reconnect = true
			cfg.FaultAt = *rollingAfter
			cfg.Fault = func() {
				start := time.Now()
				for i := range children {
					children[i].Stop()
					p, err := spawnSelf(childArgs[i]...)
					if err != nil {
						fmt.Fprintf(os.Stderr, "bench: restarting b%d: %v\n", i+1, err)
						return
					}
					children[i] = p
					if !awaitSettled(p.AdminAddr(), cluster.DefaultRF, time.Minute) {
						fmt.Fprintf(os.Stderr, "bench: the cluster did not settle after b%d restarted\n", i+1)
						return
					}
				}
				restarted = time.Since(start)
			}
		}
		var victim string
		if *killAfter > 0 {
			p := children[len(children)-1]
			victim = fmt.Sprintf("b%d", len(children))
			cfg.Fault, cfg.FaultAt = p.Kill, *killAfter
			if graceful {
				cfg.Fault = func() { p.Signal(syscall.SIGTERM) }
			}
		}
		fmt.Printf("mqkv bench: %s at %s; %d clients, %d-byte values, %d keys, %d round(s) of %v (+%v warmup)\n",
			mode, *addr, cfg.Clients, cfg.ValueSize, cfg.Keys, *rounds, cfg.Duration, cfg.Warmup)
		if cfg.Op == bench.OpGet || cfg.Op == bench.OpMixed {
			for _, a := range uniq(*addr, baseAddr) {
				c := cfg
				c.Addr = a
				if err := bench.Prepare(ctx, c); err != nil {
					return fmt.Errorf("bench: preparing keys: %w", err)
				}
			}
		}
		baseServers := children
		if baseChild != nil {
			baseServers = []*server.Process{baseChild}
		}
		var base, main []bench.Result
		var flushes []time.Duration // a log flush on the data disk, probed after each round
		for r := 0; r < *rounds; r++ {
			if *baseline != "" {
				c := cfg
				switch *baseline {
				case "nopolicy":
					c.Addr = baseAddr
				case "nopatterns":
					c.Patterns = 0
				case "clean":
					c.SessionExpiry = 0
				default:
					c.Op = bench.Op(*baseline)
				}
				measured := meter(&c, baseServers)
				res, err := bench.Run(ctx, c)
				if err != nil {
					return fmt.Errorf("bench: %s: %w", c.Op, err)
				}
				measured(&res)
				base = append(base, res)
			}
			measured := meter(&cfg, children)
			res, err := bench.Run(ctx, cfg)
			if err != nil {
				return fmt.Errorf("bench: %s: %w", cfg.Op, err)
			}
			measured(&res)
			main = append(main, res)
			if len(dirs) > 0 && !*inMemory && (cfg.Op == bench.OpSet || cfg.Op == bench.OpMixed || cfg.Op == bench.OpLease) {
				// One client leaves the disk idle between its flushes
				// (for about a request's time); many keep it busy.
				var gap time.Duration
				if cfg.Clients == 1 {
					gap = res.Percentile(0.5)
				}
				lat, err := journal.ProbeSync(dirs[0], 200, *valueSize+64, gap)
				if err != nil {
					return fmt.Errorf("bench: probing the data disk: %w", err)
				}
				flushes = append(flushes, lat...)
			}
		}
		tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "op\tops\terrors\tops/s\tp50\tp99\tp99.9\t")
		rows := []bench.Result{bench.Merge(main)}
		names := []string{string(cfg.Op)}
		if len(base) > 0 {
			rows = append([]bench.Result{bench.Merge(base)}, rows...)
			names = append([]string{*baseline}, names...)
			switch *baseline {
			case "nopolicy":
				names = []string{string(cfg.Op) + " (no policy)", string(cfg.Op) + " (policy)"}
			case "nopatterns":
				names = []string{string(cfg.Op) + " (no patterns)", fmt.Sprintf("%s (%d patterns)", cfg.Op, cfg.Patterns)}
			case "samenode":
				names = []string{"pubsub same node", "pubsub across nodes"}
			case "clean":
				names = []string{"pubsub clean sessions", fmt.Sprintf("pubsub kept sessions (expiry %ds)", cfg.SessionExpiry)}
			}
		}
		for i, r := range rows {
			fmt.Fprintf(tw, "%s\t%d\t%d\t%.0f\t%s\t%s\t%s\t\n", names[i], r.Ops, r.Errors, r.Throughput(),
				ms(r.Percentile(0.50)), ms(r.Percentile(0.99)), ms(r.Percentile(0.999)))
		}
		tw.Flush()
		for i, r := range rows {
			if r.Errors > 0 {
				fmt.Fprintf(os.Stderr, "warning: %s: %d requests answered with an error, not counted as ops\n", names[i], r.Errors)
			}
		}
		// CPU per op of each row, the servers' and the load generator's:
		// on shared cores a ratio of throughputs is a ratio of both.
		var srv, own []string
		for i, r := range rows {
			if r.Ops == 0 {
				continue
			}
			if r.CPU > 0 {
				srv = append(srv, fmt.Sprintf("%.1f µs per %s", float64(r.CPU.Microseconds())/float64(r.Ops), names[i]))
			}
			own = append(own, fmt.Sprintf("%.1f µs per %s", float64(r.ClientCPU.Microseconds())/float64(r.Ops), names[i]))
		}
		if len(srv) > 0 {
			fmt.Printf("server CPU: %s, summed over %d server process(es), measured time only\n", strings.Join(srv, ", "), len(children))
		}
		if len(own) > 0 {
			who := "its MQTT clients"
			if *baseline == "echo" || cfg.Op == bench.OpEcho {
				who += " and echo responders"
			}
			fmt.Printf("load generator CPU (this process: %s): %s\n", who, strings.Join(own, ", "))
		}
		if m := rows[len(rows)-1]; victim != "" {
			how := "SIGKILLed"
			if graceful {
				how = "SIGTERMed (a graceful stop)"
			}
			fmt.Printf("failover: node %s %s %v into the round; no request completed for at most %s; in the %v after: %d requests, p99 %s, max %s, %d answered with an error\n",
				victim, how, *killAfter, ms(m.Stall), bench.FaultWindow, m.FaultOps, ms(m.FaultP99), ms(m.FaultMax), m.FaultErrors)
		}
		if m := rows[len(rows)-1]; *rollingAfter > 0 {
			fmt.Printf("rolling restart: %d nodes stopped (SIGTERM), started again and settled in turn from %v into the round, in %v; no request completed for at most %s (from %v into the round); while it ran (and at least %v): %d requests, p99 %s, max %s, %d answered with an error; before it: p99 %s; throughput while it ran %.0f/s against %.0f/s before (%.2fx) (the server CPU above misses the restarted processes)\n",
				len(children), *rollingAfter, restarted.Round(time.Millisecond), ms(m.Stall), m.StallFrom.Round(time.Millisecond), bench.FaultWindow, m.FaultOps, ms(m.FaultP99), ms(m.FaultMax), m.FaultErrors,
				ms(m.BeforeP99), m.During, m.Before, m.During/m.Before)
		}
		if m := rows[len(rows)-1]; joined != nil {
			// What moved is the state of the groups it now holds (by
			// snapshot or by log, whichever raft chose): the benchmark's
			// keys and values, spread evenly over the groups.
			held, groups := heldGroups(joined.AdminAddr(), fmt.Sprintf("b%d", len(children)+1))
			moved := 0.0
			if groups > 0 {
				moved = float64(*keys) * float64(*valueSize+len("bench/key/")+6) * float64(held) / float64(groups)
			}
			line := fmt.Sprintf("rebalancing: node b%d joined %v into the round", len(children)+1, *addAfter)
			if m.During > 0 {
				line += fmt.Sprintf("; its replicas were in place %s later; %.1f MB of keys and values moved to it (%d of %d groups), %.1f MB/s; foreground %.0f ops/s before, %.0f meanwhile (%.2fx)",
					ms(m.FaultTook), moved/1e6, held, groups, moved/1e6/m.FaultTook.Seconds(), m.Before, m.During, m.During/m.Before)
			} else {
				line += fmt.Sprintf("; its replicas were not in place by the end of the round (%s after): give a longer --duration", ms(m.FaultTook))
			}
			fmt.Println(line)
		}
		var flush time.Duration
		if len(flushes) > 0 {
			slices.Sort(flushes)
			flush = flushes[len(flushes)/2]
			paced := ", back to back"
			if cfg.Clients == 1 {
				paced = ", idle for a request's p50 between flushes, as under one client"
			}
			fmt.Printf("disk: one log flush (a %d-byte write into zero-filled space + fdatasync, in the data directory; probed after each round, without load%s) p50 %s, p99 %s\n",
				*valueSize+64, paced, strings.TrimSpace(ms(flush)), strings.TrimSpace(ms(flushes[len(flushes)*99/100])))
		}
		if len(base) > 0 {
			b, m := rows[0], rows[1]
			diff := m.Percentile(0.5) - b.Percentile(0.5)
			line := fmt.Sprintf("%s/%s throughput ratio: %.2f; p50 difference: %s", names[1], names[0], m.Throughput()/b.Throughput(),
				strings.TrimSpace(ms(diff)))
			if flush > 0 && cfg.Clients == 1 {
				line += fmt.Sprintf(" (%.2f flushes)", float64(diff)/float64(flush))
			}
			fmt.Println(line)
		}
		return nil
	}
	return cmd
}

func ms(d time.Duration) string { return fmt.Sprintf("%.3fms", float64(d)/float64(time.Millisecond)) }

// meter has a round of c record the CPU used in its measured time, by
// servers and by this process (the load generator); the returned func
// puts both in the round's result.
func meter(c *bench.Config, servers []*server.Process) func(*bench.Result) {
	var srv, own time.Duration
	c.Window = func(begin bool) {
		s, o := cpuOf(servers), procs.CPU()
		if begin {
			srv, own = -s, -o
		} else {
			srv, own = srv+s, own+o
		}
	}
	return func(r *bench.Result) { r.CPU, r.ClientCPU = srv, own }
}

// cpuOf sums the CPU time of processes.
func cpuOf(ps []*server.Process) time.Duration {
	var total time.Duration
	for _, p := range ps {
		if d, err := p.CPU(); err == nil {
			total += d
		}
	}
	return total
}

// spawnCluster starts n child nodes as one cluster and waits until every
// group has its replicas.
func spawnCluster(n int, storage func(string) ([]string, error)) ([]*server.Process, [][]string, error) {
	var procs []*server.Process
	var argsOf [][]string
	var first string
	for i := 0; i < n; i++ {
		args, err := storage("mqkv-bench-node-")
		if err != nil {
			return procs, argsOf, err
		}
		// Fixed ports, so that a node restarted with the same arguments
		// (--rolling-restart-after) is where its clients and peers look.
		var ports [3]string
		for j := range ports {
			if ports[j], err = freeAddr(); err != nil {
				return procs, argsOf, err
			}
		}
		args = append(args, "--node-id", fmt.Sprintf("b%d", i+1), "--listen", ports[0], "--cluster-listen", ports[1], "--admin-listen", ports[2])
		if i > 0 {
			args = append(args, "--join", first)
		}
		p, err := spawnSelf(args...)
		if err != nil {
			return procs, argsOf, err
		}
		procs = append(procs, p)
		argsOf = append(argsOf, args)
		if i == 0 {
			first = p.ClusterAddr()
		}
	}
	if !awaitSettled(procs[0].AdminAddr(), min(n, cluster.DefaultRF), 2*time.Minute) {
		return procs, argsOf, errors.New("bench: the cluster did not settle within two minutes")
	}
	return procs, argsOf, nil
}

// awaitSettled waits until the node at admin sees a settled cluster.
func awaitSettled(admin string, rf int, within time.Duration) bool {
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if settled(admin, rf) {
			return true
		}
	}
	return false
}

// freeAddr is a loopback address with a port free now.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// settled reports whether every group has rf replicas and its preferred
// leader, as the node at admin sees it.
func settled(admin string, rf int) bool {
	resp, err := http.Get("http://" + admin + "/v1/cluster")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var st cluster.Status
	return json.NewDecoder(resp.Body).Decode(&st) == nil && st.Settled(rf, true)
}

// spawnSelf starts this binary as a child server.
func spawnSelf(extra ...string) (*server.Process, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return server.Spawn(exe, extra...)
}

// heldGroups counts the groups whose replicas include id, and all groups,
// as the node at admin sees them.
func heldGroups(admin, id string) (held, groups int) {
	resp, err := http.Get("http://" + admin + "/v1/cluster")
	if err != nil {
		return 0, 0
	}
	defer resp.Body.Close()
	var st cluster.Status
	if json.NewDecoder(resp.Body).Decode(&st) != nil {
		return 0, 0
	}
	for _, g := range st.Groups {
		if slices.Contains(g.Replicas, id) {
			held++
		}
	}
	return held, len(st.Groups)
}

func uniq(a, b string) []string {
	if a == b {
		return []string{a}
	}
	return []string{a, b}
}
