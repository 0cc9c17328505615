// Package server assembles one mqkv node from its parts: the replica group
// (log and state machine), the state store service and the MQTT broker, on
// a data directory it owns.
package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mqkv/mqkv/internal/admin"
	"github.com/mqkv/mqkv/internal/attach"
	"github.com/mqkv/mqkv/internal/broker"
	"github.com/mqkv/mqkv/internal/cluster"
	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/httpkv"
	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/logthrottle"
	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/ownership"
	"github.com/mqkv/mqkv/internal/peer"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/redis"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/retained"
	"github.com/mqkv/mqkv/internal/roaming"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/store"
)

// Config is the whole configuration of a node, validated once by Start.
type Config struct {
	Listen string // plain MQTT listener address; empty for none

	TLSListen   string // MQTT over TLS listener address; empty for none
	TLSCert     string // server certificate file (PEM), for TLS and wss
	TLSKey      string // its private key (PEM)
	TLSClientCA string // CA file: verify client certificates (mTLS)
	// TLSClientCertOptional admits TLS clients without a certificate
	// (they then authenticate with a password or anonymously).
	TLSClientCertOptional bool

	WSListen string // MQTT over WebSocket listener address; empty for none
	WSTLS    bool   // serve the WebSocket listener over TLS (wss)

	DataDir  string // ignored when InMemory
	InMemory bool   // keep nothing on disk
	// Attach, if set, serves the store to another MQTT broker as its
	// client too (mqkv attach); the MQTT listeners may then be none.
	Attach *attach.Config

	PasswordFile       string // username:bcrypt lines (mqkv passwd)
	CertAttributesFile string // certificate subject → principal attributes
	// AllowAnonymous admits clients without credentials when passwords or
	// client certificates are configured; without either, anonymous
	// clients are always admitted.
	AllowAnonymous bool
	PolicyFile     string // authorization rules (YAML); empty: allow all

	// RESPListen is the address of the Redis protocol (RESP) endpoint;
	// empty turns it off.
	RESPListen string
	// MemcacheListen is the address of the memcached text protocol
	// endpoint; empty turns it off. The protocol has no authentication:
	// an address other than loopback needs MemcacheInsecure.
	MemcacheListen   string
	MemcacheInsecure bool
	// HTTPListen is the address of the HTTP key-value endpoint; empty
	// turns it off. HTTPTLS serves it over TLS with TLSCert and TLSKey.
	HTTPListen string
	HTTPTLS    bool
	// HTTPWatchBuffer is how many changes an HTTP watch holds for a slow
	// client (0: httpkv.DefaultWatchBuffer); no flag, for tests.
	HTTPWatchBuffer int

	// AdminListen is the address of the HTTP admin endpoint (health,
	// metrics, console, backups); empty turns it off.
	AdminListen string
	// AdminAllowedHosts are host names, besides IP addresses and
	// localhost, by which browsers may reach the admin endpoint.
	AdminAllowedHosts []string

	// Cluster, if ClusterListen is set, makes the node a member of a
	// cluster; without it the node is on its own, as single-node releases.
	Cluster ClusterConfig

	Limits Limits
	// History bounds the change history KEYNOTIFY ... SINCE replays from;
	// zero fields take statestore.DefaultHistory's.
	History statestore.HistoryLimits
	Logger  *slog.Logger
	// ServerKeepAlive, if not zero, is the keep-alive in seconds imposed
	// on MQTT 5 clients (Server Keep Alive in CONNACK).
	ServerKeepAlive uint16
	// ConnectTimeout is how long a new connection may take to send
	// CONNECT; zero means broker.DefaultConnectTimeout.
	ConnectTimeout time.Duration
}

// Version is mqkv's version, reported by status and the console.
var Version = "0.1.0-dev"

// Limits are the node's resource limits; zero fields take the defaults.
type Limits struct {
	MaxPacketSize    uint32 // bytes, advertised in CONNACK
	MaxKeyLength     int    // bytes
	MaxKeys          int    // keys in the store
	MaxBytes         int64  // key and value bytes in the store
	MaxRegistrations int    // KEYNOTIFY registrations per connection
	MaxConnections   int64
	MaxSessions      int           // sessions held, connected or not
	MaxOutbound      int32         // messages waiting to be written to one client
	MaxQueued        uint16        // unacknowledged QoS 1/2 messages one session holds
	MaxSessionExpiry time.Duration // how long a disconnected persistent session is kept
	MaxSubscriptions int           // topic filters one client holds
	// DiskReserve is the free space below which SETs are refused, so the
	// log never runs out of room; zero after defaults are applied cannot
	// be had: use a tiny value to all but disable it.
	DiskReserve uint64
}

// DefaultLimits are what an unconfigured node uses.
var DefaultLimits = Limits{
	MaxPacketSize:    broker.DefaultMaxPacketSize,
	MaxKeyLength:     64 << 10,
	MaxKeys:          1_000_000,
	MaxBytes:         1 << 30,
	MaxRegistrations: 10_000,
	MaxConnections:   10_000,
	MaxSessions:      100_000,
	MaxOutbound:      broker.DefaultMaxOutbound,
	MaxQueued:        broker.DefaultMaxQueued,
	MaxSessionExpiry: broker.DefaultMaxSessionExpiry,
	MaxSubscriptions: broker.DefaultMaxSubscriptions,
	DiskReserve:      128 << 20,
}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	orDefault(&l.MaxPacketSize, d.MaxPacketSize)
	orDefault(&l.MaxKeyLength, d.MaxKeyLength)
	orDefault(&l.MaxKeys, d.MaxKeys)
	orDefault(&l.MaxBytes, d.MaxBytes)
	orDefault(&l.MaxRegistrations, d.MaxRegistrations)
	orDefault(&l.MaxConnections, d.MaxConnections)
	orDefault(&l.MaxSessions, d.MaxSessions)
	orDefault(&l.MaxOutbound, d.MaxOutbound)
	orDefault(&l.MaxQueued, d.MaxQueued)
	orDefault(&l.MaxSessionExpiry, d.MaxSessionExpiry)
	orDefault(&l.MaxSubscriptions, d.MaxSubscriptions)
	orDefault(&l.DiskReserve, d.DiskReserve)
	return l
}

// orDefault sets an unset (zero) *v to def.
func orDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// Server is a running node.
type Server struct {
	cfg     Config
	log     *slog.Logger
	node    *cluster.Node
	link    *peer.Link
	mesh    *mesh.Mesh // MQTT between the nodes; nil on a node on its own
	service *statestore.Service
	broker  *broker.Broker
	admin   *admin.Server
	resp    redis.Endpoint    // nil unless RESPListen
	mc      *gateway.Listener // nil unless MemcacheListen
	http    *httpkv.Server    // nil unless HTTPListen
	attach  *attach.Attach    // nil unless Attach
	lock    *os.File
	disk    *replica.DiskGuard
	NodeID  string

	closeOnce sync.Once
	closeErr  error
	stop      chan struct{} // closed by Close: background work ends
	bg        sync.WaitGroup
}

const logRepeatWindow = 10 * time.Second

// Start opens (or creates) the data directory and starts serving.
func Start(cfg Config) (*Server, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	// A client that misbehaves in a loop gets one line per reason every
	// logRepeatWindow, with a count of the others.
	cfg.Logger = slog.New(logthrottle.New(cfg.Logger.Handler(), logRepeatWindow))
	cfg.Limits = cfg.Limits.withDefaults()
	listeners, err := listenersOf(cfg)
	if err != nil {
		return nil, err
	}
	sec, err := securityOf(cfg)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, log: cfg.Logger, stop: make(chan struct{})}
	// The other listeners, bound first too: a port taken fails the start
	// before the node creates or joins anything.
	gateways, err := bindGateways(cfg)
	if err != nil {
		return nil, err
	}
	// A failed start releases what it got, newest first.
	started := false
	defer func() {
		if started {
			return
		}
		if gateways != nil {
			gateways.close()
		}
		close(s.stop)
		s.bg.Wait()
		s.release()
	}()
	var raftDir, mqttDir string
	if cfg.InMemory {
		s.NodeID = newNodeID()
		cfg.Logger.Warn("running in memory: nothing is written to disk and every key is lost when the process ends")
	} else {
		if cfg.DataDir == "" {
			return nil, errors.New("server: no data directory (use in-memory mode to run without one)")
		}
		if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
			return nil, fmt.Errorf("data directory: %w", err)
		}
		var lock *os.File
		lock, err = lockDir(cfg.DataDir)
		if err != nil {
			return nil, err
		}
		s.lock = lock
		if err := checkFormat(cfg.DataDir); err != nil {
			return nil, err
		}
		if s.NodeID, err = loadNodeID(cfg.DataDir, cfg.Cluster.NodeID); err != nil {
			return nil, err
		}
		raftDir = filepath.Join(cfg.DataDir, "raft")
		if cfg.Cluster.Listen != "" {
			raftDir = filepath.Join(cfg.DataDir, "cluster")
		}
		mqttDir = filepath.Join(cfg.DataDir, "mqtt")
		s.disk = replica.NewDiskGuard(cfg.DataDir, cfg.Limits.DiskReserve, cfg.Logger)
	}
	if cfg.InMemory && cfg.Cluster.NodeID != "" {
		s.NodeID = cfg.Cluster.NodeID
	}

	hist, d := cfg.History, statestore.DefaultHistory // see below
	orDefault(&hist.PerPartition, d.PerPartition)
	orDefault(&hist.MaxAge, d.MaxAge)
	orDefault(&hist.MaxBytes, d.MaxBytes)
	// The service is built after the node (it routes through it), and the
	// node may apply entries (expiries found at start) before: until then
	// their events are nobody's.
	var service atomic.Pointer[statestore.Service]
	// Changes to MQTT retained messages go to the retained store's
	// mirror, the rest to the state store (and the console).
	var retainedStore atomic.Pointer[retained.Store]
	onEvents := func(ev []store.Event) {
		if r := retainedStore.Load(); r != nil {
			if ev = r.Events(ev); len(ev) == 0 {
				return
			}
		}
		if svc := service.Load(); svc != nil {
			svc.Events(ev)
		}
	}
	onEventsGap := func(resume hlc.Timestamp) {
		if svc := service.Load(); svc != nil {
			svc.EventsGap(resume)
		}
	}
	var timings replica.Timings
	var metrics *admin.Metrics
	if cfg.AdminListen != "" {
		metrics = admin.NewMetrics()
		s.admin = admin.New(metrics, cfg.AdminAllowedHosts, cfg.Logger)
		if err := s.admin.Listen(cfg.AdminListen); err != nil {
			return nil, err
		}
		timings = metrics.Timings()
		toService := onEvents
		onEvents = func(ev []store.Event) {
			toService(ev)
			s.admin.Events(ev)
		}
	}
	var toBroker atomic.Pointer[broker.Broker] // made last, told of earlier
	var toAttach atomic.Pointer[attach.Attach] // made after the mesh
	var toMesh atomic.Pointer[mesh.Mesh]
	startTime := time.Now()
	if s.link, err = startLink(cfg, s.NodeID); err != nil {
		return nil, err
	}
	seed, legacy, err := legacyData(cfg, s.NodeID)
	if err != nil {
		return nil, err
	}
	var join []string
	if s.link != nil {
		join = joinTargets(cfg, s.link.Addr(), raftDir)
	}
	s.node, err = cluster.Start(cluster.Config{
		Seed:     seed,
		NodeID:   s.NodeID,
		Dir:      raftDir,
		Link:     s.link,
		Join:     join,
		Release:  Version,
		Rejoin:   cfg.Cluster.Rejoin,
		Groups:   cfg.Cluster.Groups,
		RF:       cfg.Cluster.Replicas,
		Limits:   store.Limits{MaxKeys: cfg.Limits.MaxKeys, MaxBytes: cfg.Limits.MaxBytes},
		OnEvents: onEvents,
		Timings:  timings,
		Logger:   cfg.Logger,
		Disk:     s.disk,

		OnEventsGap:     onEventsGap,
		DeadNodeTimeout: cfg.Cluster.DeadNodeTimeout,
		QuorumReads:     cfg.Cluster.QuorumReads,
		Protocols:       cfg.Cluster.Protocols,
		MQTT: func() cluster.MQTTFigures {
			var f cluster.MQTTFigures
			if b := toBroker.Load(); b != nil {
				f.Clients, f.Sessions, f.Subscriptions = b.Figures()
			}
			if m := toMesh.Load(); m != nil {
				f.RouteFilters = m.TableSize()
			}
			if b := toBroker.Load(); b != nil {
				f.Addr = mqttAdvertised(cfg, b.Addr())
			}
			return f
		},
	})
	if err != nil {
		return nil, err
	}
	if legacy != "" {
		// The single node's log stays, renamed, until the operator removes it.
		if err := os.Rename(legacy, legacy+".before-cluster"); err != nil {
			cfg.Logger.Warn("could not set the single-node data aside", "dir", legacy, "error", err)
		}
		cfg.Logger.Info("a single node's data is now the cluster's", "keys", seed.Len(), "kept_until_removed", legacy+".before-cluster")
	}
	s.service = statestore.New(s.node, nil, statestore.Limits{
		MaxKeyLength:            cfg.Limits.MaxKeyLength,
		MaxRegistrationsPerConn: cfg.Limits.MaxRegistrations,
		History:                 hist,
	}, cfg.Logger)
	if metrics != nil {
		s.service.OnReply = metrics.ObserveReply
	}
	service.Store(s.service)

	// On a cluster member, MQTT crosses to the other nodes (package
	// mesh); the broker it delivers to is made next, and so is the one
	// retained messages are mirrored into.
	var peers broker.Peers
	var owners broker.Owners
	var roam *roaming.Store
	ret := retained.New(s.node, func(topic string, m *mesh.Message) {
		if b := toBroker.Load(); b != nil {
			b.MirrorRetained(topic, m)
		}
	})
	retainedStore.Store(ret)
	if s.link != nil {
		s.mesh = mesh.New(mesh.Config{Link: s.link, Self: s.NodeID, Members: s.node.Members, Alive: s.node.Alive, Logger: cfg.Logger,
			Deliver: func(from string, d *mesh.Delivery, done func()) {
				if b := toBroker.Load(); b != nil {
					b.FromPeer(from, d, done)
				} else {
					done()
				}
			},
			GivenUp: func(node string, d *mesh.Delivery, done func()) {
				if b := toBroker.Load(); b != nil {
					b.GivenUp(node, d, done)
				} else {
					done()
				}
			},
			Handle: func(from string, body []byte) []byte {
				if attach.IsForwarded(body) {
					if a := toAttach.Load(); a != nil {
						return a.Answer(body)
					}
					return nil
				}
				if b := toBroker.Load(); b != nil {
					return b.Answer(from, body)
				}
				return nil
			}})
		peers = s.mesh
		toMesh.Store(s.mesh)
		owners = ownership.New(s.node, s.NodeID)
		roam = roaming.New(s.node)
	}
	b, err := broker.New(broker.Config{
		Listeners:        listeners,
		DataDir:          mqttDir,
		MaxPacketSize:    cfg.Limits.MaxPacketSize,
		MaxConnections:   cfg.Limits.MaxConnections,
		MaxSessions:      cfg.Limits.MaxSessions,
		MaxOutbound:      cfg.Limits.MaxOutbound,
		MaxQueued:        cfg.Limits.MaxQueued,
		MaxSessionExpiry: cfg.Limits.MaxSessionExpiry,
		MaxSubscriptions: cfg.Limits.MaxSubscriptions,
		ServerKeepAlive:  cfg.ServerKeepAlive,
		ConnectTimeout:   cfg.ConnectTimeout,
		Security:         sec,
		Logger:           cfg.Logger,
		Peers:            peers,
		Retained:         ret,
		Owners:           owners,
		Roaming:          roam,
		NodeID:           s.NodeID,
	}, s.service)
	if err != nil {
		return nil, err
	}
	s.broker = b
	toBroker.Store(b)
	s.service.SetTransport(b)
	// Retained messages are mirrored before clients come, when the node
	// serves already (a member restarted without its quorum does later).
	loaded := false
	if s.node.Ready() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if s.node.Follow(ctx) == nil {
			s.service.Following()
			_, err := ret.Load(ctx)
			loaded = err == nil
		}
		cancel()
	}
	if err := b.Serve(); err != nil {
		return nil, err
	}
	s.loadRetained(ret, b, loaded)
	s.serveGateways(gateways, startTime)
	gateways = nil // the server's to close now
	if cfg.Attach != nil {
		ac := *cfg.Attach
		ac.Logger = cfg.Logger
		ac.Policy = func() *policy.Policy { return b.Security().Policy }
		if s.node.Clustered() {
			ac.Cluster, ac.NodeID, ac.Forwarder = s.node, s.NodeID, s.mesh
		}
		if ac.ClientID == "" {
			ac.ClientID = s.NodeID // a random one is mqkv-<hex> already
			if !strings.HasPrefix(ac.ClientID, "mqkv-") {
				ac.ClientID = "mqkv-" + ac.ClientID
			}
		}
		if s.attach, err = attach.Start(ac, s.service); err != nil {
			return nil, err
		}
		toAttach.Store(s.attach)
	}
	if s.admin != nil {
		err := s.admin.Serve(cfg.AdminListen, &admin.Node{
			NodeID: s.NodeID, Version: Version, Started: startTime,
			Data: s.node, Service: s.service, Broker: b, Mesh: s.mesh, Attached: s.attach,
		})
		if err != nil {
			return nil, err
		}
	}
	mode := "durable"
	if cfg.InMemory {
		mode = "in-memory"
	}
	attrs := []any{"node", s.NodeID, "mode", mode, "data_dir", cfg.DataDir}
	for name, addr := range b.Addrs() {
		attrs = append(attrs, name, addr)
	}
	if s.admin != nil {
		attrs = append(attrs, "admin", s.admin.Addr())
	}
	if s.resp != nil {
		attrs = append(attrs, "resp", s.resp.Addr())
	}
	if s.mc != nil {
		attrs = append(attrs, "memcache", s.mc.Addr())
	}
	if s.http != nil {
		attrs = append(attrs, "http", s.http.Addr())
	}
	if s.link != nil {
		attrs = append(attrs, "cluster", s.link.Addr())
	}
	if s.attach != nil {
		attrs = append(attrs, "attached_to", s.attach.Broker())
	}
	cfg.Logger.Info("mqkv serving", attrs...)
	started = true
	return s, nil
}

// loadRetained has the broker mirror the store's retained messages, in
// the background once the node serves (a member restarted without its
// quorum waits): the node follows every group's changes first, so that
// no change is missed between the read and them. Retained messages a
// release before the store kept in the session store are moved into it.
func (s *Server) loadRetained(ret *retained.Store, b *broker.Broker, loaded bool) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		for attempt := 0; ; attempt++ {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := s.node.Follow(ctx)
			var n int
			if err == nil {
				s.service.Following()
				err = b.MoveLegacyRetained(ctx)
			}
			if err == nil && !loaded {
				n, err = ret.Load(ctx)
			}
			cancel()
			if err == nil {
				s.log.Debug("retained messages mirrored", "messages", n)
				return
			}
			if attempt%30 == 29 {
				s.log.Warn("retained messages not read yet: new subscribers miss them until they are", "error", err)
			}
			select {
			case <-s.stop:
				return
			case <-time.After(time.Second):
			}
		}
	}()
}

// Addr returns the address of the first MQTT listener.
func (s *Server) Addr() string { return s.broker.Addr() }

// Addrs returns the address of each listener by name (tcp, tls, ws).
func (s *Server) Addrs() map[string]string { return s.broker.Addrs() }

// AdminAddr returns the admin endpoint's address, or "" if it is off.
func (s *Server) AdminAddr() string {
	if s.admin == nil {
		return ""
	}
	return s.admin.Addr()
}

// Broker returns the MQTT broker (for its counters).
func (s *Server) Broker() *broker.Broker { return s.broker }

// Node returns the node runtime (cluster status, its replicas).
func (s *Server) Node() *cluster.Node { return s.node }

// Mesh returns the MQTT mesh of a cluster member (nil on a node on its
// own).
func (s *Server) Mesh() *mesh.Mesh { return s.mesh }

// Link returns the node link of a cluster member (nil on a node on its
// own): tests cut it (peer.Link.Cut).
func (s *Server) Link() *peer.Link { return s.link }

// Isolate cuts the node off the other nodes (true) or reconnects it: the
// network partition of fault tests. A node on its own ignores it.
func (s *Server) Isolate(on bool) {
	if s.link != nil {
		s.link.Isolate(on)
	}
}

// ClusterAddr returns the node link address, or "" for a node on its own.
func (s *Server) ClusterAddr() string {
	if s.link == nil {
		return ""
	}
	return s.link.Addr()
}

// Attached returns the attachment to another broker; nil unless
// Config.Attach.
func (s *Server) Attached() *attach.Attach { return s.attach }

// Service returns the state store service (for its counters).
func (s *Server) Service() *statestore.Service { return s.service }

// Failed is closed when the node cannot go on (its log could not be
// applied); Err says why. The process should stop.
func (s *Server) Failed() <-chan struct{} { return s.node.Failed() }

// Err returns why the node failed, or nil.
func (s *Server) Err() error { return s.node.Err() }

// Stop stops the node gracefully: a cluster member first hands the
// leadership of the groups it leads (and of the metadata group) to the
// other members, within ctx, so that writes to them pause for a transfer
// rather than for a dead leader to be noticed; then it closes as Close
// does (requests in progress answered, clients told 0x8B). A node that
// cannot hand over (no other member up) stops anyway once ctx ends, and
// says why.
func (s *Server) Stop(ctx context.Context) error {
	if s.link != nil {
		start := time.Now()
		if left, err := s.node.HandOver(ctx); err != nil {
			s.log.Warn("stopping without handing over every leadership", "still_led", len(left), "error", err)
		} else {
			s.log.Info("leadership handed over before stopping", "took", time.Since(start).Round(time.Millisecond))
		}
		if s.broker != nil {
			// Where its MQTT 5 clients may go: another member that
			// answers (a Server Reference with their DISCONNECT 0x8B).
			rctx, cancel := context.WithTimeout(ctx, time.Second)
			s.broker.SetServerReference(s.node.OtherMQTT(rctx))
			cancel()
		}
	}
	return s.Close()
}

// mqttAdvertised is where this node's MQTT clients connect, as other
// nodes tell theirs: --mqtt-advertise, else listening (the first MQTT
// listener's address) unless it is a wildcard one; "" if neither.
func mqttAdvertised(cfg Config, listening string) string {
	if cfg.Cluster.MQTTAdvertise != "" {
		return cfg.Cluster.MQTTAdvertise
	}
	host, _, err := net.SplitHostPort(listening)
	if ip := net.ParseIP(host); err != nil || ip == nil || ip.IsUnspecified() {
		return ""
	}
	return listening
}

// Close stops accepting clients, then stops the log, then releases the data
// directory.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		close(s.stop)
		s.bg.Wait()
		s.closeErr = s.release()
	})
	return s.closeErr
}

// release stops what the server started, clients' endpoints first, then
// the log, and lets the data directory go: what Close does, and what a
// failed Start does with what it got. It reports the broker's or the
// node's error.
func (s *Server) release() error {
	if s.attach != nil {
		s.attach.Close() // its requests answered first, while the node runs
	}
	if s.admin != nil {
		s.admin.Close()
	}
	if s.resp != nil {
		s.resp.Close()
	}
	if s.mc != nil {
		s.mc.Close()
	}
	if s.http != nil {
		s.http.Close()
	}
	var err error
	if s.broker != nil {
		err = s.broker.Close()
	}
	if s.mesh != nil {
		s.mesh.Close()
	}
	if s.node != nil {
		if e := s.node.Close(); err == nil {
			err = e
		}
	}
	if s.link != nil {
		s.link.Close()
	}
	s.disk.Close()
	s.unlock()
	return err
}

func (s *Server) unlock() {
	if s.lock != nil {
		s.lock.Close() // closing releases the flock
		s.lock = nil
	}
}

// lockDir takes an exclusive lock on the data directory so two processes
// never share it.
func lockDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, "LOCK"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("data directory: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("data directory %s is in use by another mqkv process", dir)
	}
	return f, nil
}

// loadNodeID reads the node id kept in the data directory, creating it on
// first start. It is part of every version the node issues, so it must
// never change.
func loadNodeID(dir, want string) (string, error) {
	path := filepath.Join(dir, "node-id")
	b, err := os.ReadFile(path)
	if err == nil {
		id := strings.TrimSpace(string(b))
		if id == "" || strings.Contains(id, ":") {
			return "", fmt.Errorf("%s: invalid node id %q", path, id)
		}
		if want != "" && want != id {
			return "", fmt.Errorf("%s says this data directory is node %q, not %q: a node keeps its id for life (use another data directory for another node)", path, id, want)
		}
		return id, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	id := newNodeID()
	if want != "" {
		id = want
	}
	if err := journal.WriteFileSync(dir, filepath.Base(path), []byte(id+"\n"), 0o600); err != nil {
		return "", err
	}
	return id, nil
}

func newNodeID() string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return "mqkv-" + hex.EncodeToString(b[:])
}

// Restore builds the data directory dataDir from a backup read from r: a
// new node id, and a log whose only state is the backup. dataDir must not
// exist or be empty.
func Restore(dataDir string, r io.Reader) (maxVersion string, keys int, err error) {
	entries, err := os.ReadDir(dataDir)
	existed := err == nil
	if existed && len(entries) > 0 {
		return "", 0, fmt.Errorf("restore: %s is not empty", dataDir)
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return "", 0, err
	}
	// On failure, leave things as found: an empty directory the user
	// made stays, one made here goes.
	undo := func() {
		if !existed {
			os.RemoveAll(dataDir)
			return
		}
		entries, _ := os.ReadDir(dataDir)
		for _, e := range entries {
			os.RemoveAll(filepath.Join(dataDir, e.Name()))
		}
	}
	id, err := loadNodeID(dataDir, "")
	if err != nil {
		undo()
		return "", 0, err
	}
	v, n, err := replica.Restore(filepath.Join(dataDir, "raft"), id, r)
	if err != nil {
		undo()
		return "", 0, err
	}
	return v.String(), n, nil
}
