package server

import (
	"path/filepath"
	"time"

	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/store"
	"net"
	"os"
	"strings"

	"github.com/mqkv/mqkv/internal/peer"
)

// ClusterConfig makes a node a cluster member.
type ClusterConfig struct {
	NodeID    string // this node's id; default: the data directory's, or a new one
	Listen    string // node link address; empty: the node is on its own
	Advertise string // the address other nodes dial, if not Listen's
	// MQTTAdvertise is the address MQTT clients reach this node at (a
	// stopping member's clients are told it in a Server Reference); if
	// empty, the MQTT listener's, unless that is a wildcard address.
	MQTTAdvertise string
	Join          []string // link addresses of members to join through; empty creates a cluster
	// Rejoin makes a node removed from its cluster a member again,
	// dropping its stale data (see cluster.Config.Rejoin).
	Rejoin   bool
	Replicas int // replicas per group of a new cluster (default 3)
	Groups   int // replica groups of a new cluster (default cluster.DefaultGroups)
	// DeadNodeTimeout, if set, removes a member silent for that long and
	// replaces its replicas (default off: mqkv cluster remove does it).
	DeadNodeTimeout time.Duration
	// QuorumReads has every read confirm the leadership with a round of
	// heartbeats, trusting no clock (see replica.ReadLease).
	QuorumReads bool

	SecretFile string // shared secret nodes authenticate each other with
	TLSCert    string // node certificate and key for the link (mTLS with TLSCA)
	TLSKey     string
	TLSCA      string
	// Insecure allows a link without secret or TLS on a non-loopback
	// address.
	Insecure bool
	// Protocols, if not zero, is the range of cluster protocols the node
	// claims to speak (tests: a member of an earlier release).
	Protocols [2]int
}

// startLink starts the node link, or returns nil for a node on its own.
func startLink(cfg Config, nodeID string) (*peer.Link, error) {
	cc := cfg.Cluster
	if cc.Listen == "" {
		if len(cc.Join) > 0 {
			return nil, errors.New("cluster: --join needs --cluster-listen")
		}
		return nil, nil
	}
	if strings.Contains(nodeID, ":") || nodeID == "" {
		return nil, fmt.Errorf("cluster: invalid node id %q", nodeID)
	}
	pc := peer.Config{NodeID: nodeID, Listen: cc.Listen, Advertise: cc.Advertise, Logger: cfg.Logger}
	if cc.SecretFile != "" {
		b, err := os.ReadFile(cc.SecretFile)
		if err != nil {
			return nil, fmt.Errorf("cluster secret: %w", err)
		}
		secret := []byte(strings.TrimSpace(string(b)))
		if len(secret) < 16 {
			return nil, fmt.Errorf("cluster secret %s: at least 16 characters, please (openssl rand -hex 32 > %s)", cc.SecretFile, cc.SecretFile)
		}
		pc.Secret = secret
	}
	if cc.TLSCert != "" || cc.TLSKey != "" || cc.TLSCA != "" {
		srv, cli, err := clusterTLS(cc)
		if err != nil {
			return nil, err
		}
		pc.TLSServer, pc.TLSClient = srv, cli
	}
	if pc.Secret == nil && pc.TLSServer == nil {
		host, _, err := net.SplitHostPort(cc.Listen)
		if err != nil {
			return nil, fmt.Errorf("cluster listen address %q: %w", cc.Listen, err)
		}
		ip := net.ParseIP(host)
		if !cc.Insecure && (ip == nil || !ip.IsLoopback()) {
			return nil, errors.New("cluster: the node link needs --cluster-secret-file or --cluster-tls-* (nodes must authenticate each other); on loopback, or with --cluster-insecure, it runs without")
		}
		cfg.Logger.Warn("the node link is not authenticated: any process that reaches it can join the cluster and read its data", "listen", cc.Listen)
		pc.Insecure = true // a well-known secret: no protection
	}
	return peer.Listen(pc)
}

// clusterTLS builds the link's mutual TLS from a node certificate and the
// cluster CA.
func clusterTLS(cc ClusterConfig) (*tls.Config, *tls.Config, error) {
	if cc.TLSCert == "" || cc.TLSKey == "" || cc.TLSCA == "" {
		return nil, nil, errors.New("cluster: --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together")
	}
	cert, err := tls.LoadX509KeyPair(cc.TLSCert, cc.TLSKey)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster TLS certificate: %w", err)
	}
	pem, err := os.ReadFile(cc.TLSCA)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("cluster CA %s: no certificate in it", cc.TLSCA)
	}
	srv := &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}
	// Nodes dial each other by address: the certificate must chain to the
	// cluster CA; its names are not checked against the address.
	cli := &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS12, InsecureSkipVerify: true,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			if len(raw) == 0 {
				return errors.New("no certificate")
			}
			leaf, err := x509.ParseCertificate(raw[0])
			if err != nil {
				return err
			}
			inter := x509.NewCertPool()
			for _, r := range raw[1:] {
				if c, err := x509.ParseCertificate(r); err == nil {
					inter.AddCert(c)
				}
			}
			_, err = leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
			return err
		}}
	return srv, cli, nil
}

// legacyData returns the store of a single node's data directory that is
// becoming the first node of a cluster (and the directory it is in), or
// nil. A single node's data cannot join an existing cluster: its keys would
// have to be merged with the cluster's.
func legacyData(cfg Config, nodeID string) (*store.Store, string, error) {
	if cfg.Cluster.Listen == "" || cfg.InMemory {
		return nil, "", nil
	}
	legacy := filepath.Join(cfg.DataDir, "raft")
	if _, err := os.Stat(legacy); err != nil {
		return nil, "", nil // nothing from a single node
	}
	if len(cfg.Cluster.Join) > 0 {
		return nil, "", fmt.Errorf("%s holds a single node's data: start this node without --join to make it the first node of a new cluster that keeps the data, or join with an empty data directory", cfg.DataDir)
	}
	// A conversion that did not finish (the single node's log is set
	// aside only when it did) left a cluster that never served: redo it.
	if err := os.RemoveAll(filepath.Join(cfg.DataDir, "cluster")); err != nil {
		return nil, "", err
	}
	g, err := replica.Open(replica.Config{NodeID: nodeID, Dir: legacy})
	if err != nil {
		return nil, "", err
	}
	defer g.Close()
	if err := g.AwaitLeader(30 * time.Second); err != nil {
		return nil, "", err
	}
	return g.Copy(), legacy, nil
}

// joinTargets is --join as the node uses it: its own address left out,
// and none at all (the node creates the cluster) for a node without
// cluster data whose own address comes first in the list while no other
// listed address answers. So every node can be given the same --join,
// as an orchestrator's stable names give it (a StatefulSet's mqkv-0,
// mqkv-1, ...): started in order, the first creates the cluster and the
// others join through it. A first node that lost its data while the
// others run finds them answering and asks to join, which they refuse
// with what to do (remove the member first), rather than creating a
// second cluster.
func joinTargets(cfg Config, self, dataDir string) []string {
	join := cfg.Cluster.Join
	if len(join) == 0 {
		return nil
	}
	mine := func(a string) bool { return a == self || a == cfg.Cluster.Listen }
	var others []string
	for _, a := range join {
		if !mine(a) {
			others = append(others, a)
		}
	}
	if !mine(join[0]) || hasClusterData(cfg, dataDir) {
		return others
	}
	for _, a := range others {
		if c, err := net.DialTimeout("tcp", a, time.Second); err == nil {
			c.Close()
			cfg.Logger.Info("first in --join, and another listed member answers: joining through it", "answered", a)
			return others
		}
	}
	cfg.Logger.Info("first in --join, no data, and no other listed member answers: creating the cluster", "join", join)
	return nil
}

// hasClusterData reports whether the node's cluster directory holds
// anything (a node that was a member starts from it, whatever --join says).
func hasClusterData(cfg Config, dir string) bool {
	if cfg.InMemory {
		return false
	}
	entries, err := os.ReadDir(dir)
	return err == nil && len(entries) > 0
}
