package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/mqkv/mqkv/internal/broker"
	"github.com/mqkv/mqkv/internal/cluster"
	"github.com/mqkv/mqkv/internal/procs"
	"github.com/mqkv/mqkv/internal/server"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/store"
)

func serveCmd() *cobra.Command {
	n := newNodeFlags()
	n.cfg.Listen = "127.0.0.1:1883"
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the MQTT broker and state store (the default command)",
		Long: `Runs the MQTT broker and state store. SIGHUP reloads the policy and
password files; SIGINT or SIGTERM stop the server.`,
		Example: `  mqkv serve                                   # 127.0.0.1:1883, data in ./mqkv-data
  mqkv serve --listen 0.0.0.0:1883 --data-dir /var/lib/mqkv
  mqkv serve --in-memory --admin-listen 127.0.0.1:8080`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error { return n.run("serve") },
	}
	n.listenerFlags(cmd.Flags())
	n.storeFlags(cmd.Flags())
	return cmd
}

// nodeFlags are a server process's settings: what serve and attach share.
type nodeFlags struct {
	cfg                                      server.Config
	maxPacket                                uint
	maxOutbound                              int
	logLevel, logFormat, cpuProfile, pidFile string
	sysmonAwake                              bool
}

func newNodeFlags() *nodeFlags {
	d := server.DefaultLimits
	return &nodeFlags{maxPacket: uint(d.MaxPacketSize), maxOutbound: int(d.MaxOutbound)}
}

// run starts the server and runs it until a signal stops it.
func (n *nodeFlags) run(name string) error {
	cfg, maxPacket, maxOutbound := n.cfg, n.maxPacket, n.maxOutbound
	if n.sysmonAwake {
		keepSysmonAwake()
	}
	if maxPacket > 1<<28 || maxOutbound <= 0 || maxOutbound > 1<<20 {
		return fmt.Errorf("%s: --max-packet-size at most %d, --max-outbound between 1 and %d", name, 1<<28, 1<<20)
	}
	if cc := cfg.Cluster; cc.Groups < 1 || cc.Groups > store.Partitions || cc.Replicas < 1 {
		return fmt.Errorf("%s: --groups between 1 and %d (one partition at least per group), --replicas 1 or more", name, store.Partitions)
	}
	cfg.Limits.MaxPacketSize, cfg.Limits.MaxOutbound = uint32(maxPacket), int32(maxOutbound)
	logger, err := newLogger(os.Stderr, n.logLevel, n.logFormat)
	if err != nil {
		return err
	}
	cfg.Logger = logger
	stopProfile, err := cpuProfileTo(n.cpuProfile)
	if err != nil {
		return err
	}
	defer stopProfile()
	// SIGHUP is caught before the pid file exists: one sent as soon
	// as it does must reload, not end the process (its default
	// action), which CI once caught. SIGINT and SIGTERM still end
	// a start that takes long.
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGHUP)
	srv, err := server.Start(cfg)
	if err != nil {
		return err
	}
	// A node on its own starts with every P (restoring is quicker
	// so), then runs as many as the load needs, unless GOMAXPROCS
	// says how many. Not a cluster member: three nodes sharing two
	// cores at one P each did 0.71x the durable SETs they do with
	// the runtime's default (mqkv bench --cluster 3, two pairs).
	// Likely cause, not proven: a node's journal fsync holds its
	// only P until the runtime's monitor takes it back, and the
	// replication traffic of the other groups waits behind it.
	if max := runtime.GOMAXPROCS(0); os.Getenv("GOMAXPROCS") == "" && max > 1 && cfg.Cluster.Listen == "" {
		ctx, stop := context.WithCancel(context.Background())
		defer stop()
		go procs.Run(ctx, procs.DefaultPolicy(max), procs.DefaultTick, func(n int, used float64, wait time.Duration) {
			if used < 0 {
				logger.Info("Go scheduler resized", "procs", n, "max", max, "asked_by", "a deep pipeline of writes")
				return
			}
			logger.Info("Go scheduler resized", "procs", n, "max", max, "cpu_cores_used", math.Round(used*100)/100, "ready_goroutines_wait", wait.Round(time.Microsecond))
		})
	}
	if n.pidFile != "" {
		// Written once serving, so that kill -HUP "$(cat FILE)"
		// reaches this server even when others run.
		if err := os.WriteFile(n.pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
			srv.Close()
			return fmt.Errorf("--pid-file: %w", err)
		}
		defer os.Remove(n.pidFile)
	}
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
wait:
	for {
		select {
		case <-srv.Failed():
			logger.Error("stopping: the node cannot go on", "error", srv.Err())
			srv.Close()
			return srv.Err()
		case s := <-sig:
			if s == syscall.SIGHUP {
				if err := srv.Reload(); err != nil {
					logger.Error("reload failed; the previous configuration stays in force", "error", err)
				}
				continue
			}
			logger.Info("shutting down", "signal", s.String())
			break wait
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), handOverTimeout)
	defer cancel()
	return srv.Stop(ctx)
}

// listenerFlags are serve's: its MQTT listeners and their clients' limits,
// and the gateways.
func (n *nodeFlags) listenerFlags(fs *pflag.FlagSet) {
	d := server.DefaultLimits
	fs.StringVar(&n.cfg.Listen, "listen", "127.0.0.1:1883", "plain MQTT listener `address` (host:port; port 0 picks a free one; empty for none)")
	fs.StringVar(&n.cfg.TLSListen, "tls-listen", "", "MQTT over TLS listener `address` (needs --tls-cert and --tls-key)")
	fs.StringVar(&n.cfg.TLSCert, "tls-cert", "", "server certificate `file` (PEM)")
	fs.StringVar(&n.cfg.TLSKey, "tls-key", "", "server private key `file` (PEM)")
	fs.StringVar(&n.cfg.TLSClientCA, "tls-client-ca", "", "CA `file` (PEM): clients must present a certificate it signed (mTLS); the subject CN becomes the username")
	fs.BoolVar(&n.cfg.TLSClientCertOptional, "tls-client-cert-optional", false, "with --tls-client-ca: also admit TLS clients without a certificate (password or anonymous)")
	fs.StringVar(&n.cfg.WSListen, "ws-listen", "", "MQTT over WebSocket listener `address`")
	fs.BoolVar(&n.cfg.WSTLS, "ws-tls", false, "serve the WebSocket listener over TLS (wss), with --tls-cert and --tls-key")
	fs.StringVar(&n.cfg.PasswordFile, "password-file", "", "`file` of username:bcrypt-hash lines (write it with mqkv passwd)")
	fs.StringVar(&n.cfg.CertAttributesFile, "cert-attributes", "", "YAML `file` mapping certificate subjects to principal attributes")
	fs.BoolVar(&n.cfg.AllowAnonymous, "allow-anonymous", false, "admit clients without credentials even when passwords or client certificates are configured")
	fs.StringVar(&n.cfg.RESPListen, "resp-listen", "", "Redis protocol (RESP2/RESP3) endpoint `address` for redis-cli and Redis clients: the same store, password file and policy; off if empty")
	fs.StringVar(&n.cfg.MemcacheListen, "memcache-listen", "", "memcached text protocol endpoint `address` for memcached clients: the same store; no authentication, so a loopback address unless --memcache-insecure; off if empty")
	fs.BoolVar(&n.cfg.MemcacheInsecure, "memcache-insecure", false, "allow --memcache-listen on an address other than loopback (its clients are anonymous)")
	fs.StringVar(&n.cfg.HTTPListen, "http-listen", "", "HTTP key-value endpoint `address` (/v1/kv/{key} with ETags and conditional requests): the same store, password file (HTTP Basic) and policy; off if empty")
	fs.BoolVar(&n.cfg.HTTPTLS, "http-tls", false, "serve --http-listen over TLS (HTTPS) with --tls-cert and --tls-key")
	fs.DurationVar(&n.cfg.ConnectTimeout, "connect-timeout", broker.DefaultConnectTimeout, "time a new connection has to send CONNECT (TLS handshake included) before it is closed")
	fs.Uint16Var(&n.cfg.ServerKeepAlive, "server-keep-alive", 0, "keep-alive in `seconds` every MQTT 5 client must use (Server Keep Alive in CONNACK; silent for 1.5 times it ends the connection); 0: the client's own")
	fs.UintVar(&n.maxPacket, "max-packet-size", uint(d.MaxPacketSize), "largest MQTT packet in `bytes` (advertised in CONNACK)")
	fs.Int64Var(&n.cfg.Limits.MaxConnections, "max-connections", d.MaxConnections, "most connected clients")
	fs.IntVar(&n.cfg.Limits.MaxSessions, "max-sessions", d.MaxSessions, "most MQTT sessions held, connected or not (persistent ones outlive their connection); a new client id beyond it is refused (CONNACK 0x97)")
	fs.Uint16Var(&n.cfg.Limits.MaxQueued, "max-queued", d.MaxQueued, "most unacknowledged QoS 1/2 messages one session holds (queued while its client is offline); more are dropped")
	fs.IntVar(&n.cfg.Limits.MaxSubscriptions, "max-subscriptions", d.MaxSubscriptions, "most topic filters one client holds; more get SUBACK 0x97 (quota exceeded)")
	fs.DurationVar(&n.cfg.Limits.MaxSessionExpiry, "max-session-expiry", d.MaxSessionExpiry, "longest a disconnected persistent session is kept, whatever the client asks")
	fs.IntVar(&n.maxOutbound, "max-outbound", int(d.MaxOutbound), "most messages waiting to be written to one client; a client that lets them pile up is disconnected (0x97)")
	fs.StringVar(&n.cfg.Cluster.MQTTAdvertise, "mqtt-advertise", "", "the `address` (host:port) MQTT clients reach this node at, given to the clients of another member that stops (Server Reference in its DISCONNECT); default: --listen's, unless it is a wildcard address")
}

// storeFlags are the store's, the cluster's and the process's.
func (n *nodeFlags) storeFlags(fs *pflag.FlagSet) {
	d := server.DefaultLimits
	fs.StringVar(&n.cfg.DataDir, "data-dir", "./mqkv-data", "`directory` for the log, snapshots and MQTT sessions")
	fs.BoolVar(&n.cfg.InMemory, "in-memory", false, "keep everything in memory: nothing survives the process")
	fs.BoolVar(&n.sysmonAwake, "sysmon-awake", false, "start again with schedtrace in GODEBUG, which keeps the Go runtime's monitor thread out of its deep sleep (a few percent less CPU per durable SET under load, whose fsyncs wake it; socket reads and writes do not); the runtime then prints a SCHED line on stderr at start on hosts up over 24.8 days, and every 24.8 days (docs/configuration.md)")
	fs.StringSliceVar(&n.cfg.AdminAllowedHosts, "admin-allowed-hosts", nil, "host `names` (comma-separated) by which browsers may reach the admin endpoint; IP addresses and localhost always may (DNS-rebinding protection)")
	fs.StringVar(&n.cfg.AdminListen, "admin-listen", "", "HTTP admin endpoint `address` (health, metrics, pprof, web console, backups); off if empty; no authentication, keep it on 127.0.0.1 or a trusted network")
	fs.StringVar(&n.pidFile, "pid-file", "", "write the server's process id to this `file` once it serves (removed at exit): kill -HUP \"$(cat FILE)\" reloads")
	fs.StringVar(&n.cfg.PolicyFile, "policy", "", "authorization policy `file` (YAML, AIO BrokerAuthorization rules); reloaded on SIGHUP")
	fs.IntVar(&n.cfg.Limits.MaxKeyLength, "max-key-length", d.MaxKeyLength, "longest state store key in `bytes`")
	fs.IntVar(&n.cfg.Limits.MaxKeys, "max-keys", d.MaxKeys, "most keys the store holds")
	fs.Int64Var(&n.cfg.Limits.MaxBytes, "max-bytes", d.MaxBytes, "most key and value `bytes` the store holds")
	fs.IntVar(&n.cfg.Limits.MaxRegistrations, "max-keynotify", d.MaxRegistrations, "most KEYNOTIFY registrations per connection")
	fs.Uint64Var(&n.cfg.Limits.DiskReserve, "disk-reserve", d.DiskReserve, "free `bytes` kept on the data volume: below it SETs are refused (reads and deletes go on) until space is freed")
	h := statestore.DefaultHistory
	fs.IntVar(&n.cfg.History.PerPartition, "history-per-partition", h.PerPartition, "changes kept per partition (of 4096) for KEYNOTIFY ... SINCE")
	fs.DurationVar(&n.cfg.History.MaxAge, "history-age", h.MaxAge, "how long changes are kept for KEYNOTIFY ... SINCE")
	fs.Int64Var(&n.cfg.History.MaxBytes, "history-bytes", h.MaxBytes, "key and value `bytes` the change history keeps in all")
	cc := &n.cfg.Cluster
	fs.StringVar(&cc.NodeID, "node-id", "", "this node's `id` (letters, digits, - and _; no ':'); default: the one in the data directory, or a new random one")
	fs.StringVar(&cc.Listen, "cluster-listen", "", "node link `address` (host:port): makes this node a cluster member; one port carries all node-to-node traffic")
	fs.StringVar(&cc.Advertise, "cluster-advertise", "", "the node link `address` other nodes dial, if not --cluster-listen's")
	fs.StringSliceVar(&cc.Join, "join", nil, "node link `addresses` (comma-separated) of members to join through; without it a new node creates a cluster")
	fs.BoolVar(&cc.Rejoin, "rejoin", false, "make a node that was removed from its cluster (or left it) a member again: its stale replicas and metadata are dropped once a member confirms the removal, and it joins through --join without data")
	fs.IntVar(&cc.Replicas, "replicas", cluster.DefaultRF, "replicas per group in a new cluster (fewer while there are fewer nodes)")
	fs.IntVar(&cc.Groups, "groups", cluster.DefaultGroups, "replica groups the 4,096 partitions are spread over, in a new cluster (fixed for its life)")
	fs.StringVar(&cc.SecretFile, "cluster-secret-file", "", "`file` holding the secret nodes authenticate each other with (at least 16 characters)")
	fs.StringVar(&cc.TLSCert, "cluster-tls-cert", "", "node certificate `file` for the node link (mutual TLS with --cluster-tls-ca)")
	fs.StringVar(&cc.TLSKey, "cluster-tls-key", "", "its private key `file`")
	fs.StringVar(&cc.TLSCA, "cluster-tls-ca", "", "cluster CA `file`: node certificates must chain to it")
	fs.BoolVar(&cc.QuorumReads, "quorum-reads", false, "every read of a group's leader confirms its leadership with a round of heartbeats, trusting no clock; by default a leader that a quorum accepted less than 500 ms ago serves reads at once (a lease: docs/cluster.md)")
	fs.DurationVar(&cc.DeadNodeTimeout, "dead-node-timeout", 0, "remove a member that has not answered for this `duration` and rebuild its replicas on the others (0: never; mqkv cluster remove does it by hand)")
	fs.BoolVar(&cc.Insecure, "cluster-insecure", false, "allow an unauthenticated node link on a non-loopback address (anyone who reaches it can join and read)")
	fs.StringVar(&n.logLevel, "log-level", "info", "log `level`: debug, info, warn, error")
	fs.StringVar(&n.logFormat, "log-format", "text", "log `format`: text or json")
	fs.StringVar(&n.cpuProfile, "cpu-profile", "", "write a CPU profile of the whole run to `file` (for performance work)")
}

// handOverTimeout bounds how long a stopping cluster member tries to hand
// its leaderships over before it stops anyway.
const handOverTimeout = 5 * time.Second

func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch strings.ToLower(format) {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("log format %q: want text or json", format)
}

// cpuProfileTo starts a CPU profile of this process into path, if not
// empty; the returned func ends it.
func cpuProfileTo(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
