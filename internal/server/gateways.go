package server

import (
	"crypto/tls"
	"fmt"
	"net"
	"time"

	"github.com/mqkv/mqkv/internal/broker"
	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/httpkv"
	"github.com/mqkv/mqkv/internal/lease"
	"github.com/mqkv/mqkv/internal/memcache"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/redis"
	"github.com/mqkv/mqkv/internal/sockio"
)

// guard admits gateway clients (package gateway) with the broker's
// security settings as they are now: the same password file and policy
// as MQTT, reloads included.
type guard struct{ b *broker.Broker }

func (g guard) Required() bool {
	sec := g.b.Security()
	return (sec.Passwords != nil || sec.Certificates) && !sec.AllowAnonymous
}

func (g guard) HasPasswords() bool { return g.b.Security().Passwords != nil }

func (g guard) Check(user string, password []byte) bool {
	p := g.b.Security().Passwords
	return p != nil && p.Check(user, password)
}

func (g guard) Policy() *policy.Policy { return g.b.Security().Policy }

// boundGateways are the gateways' listeners, bound when the server starts,
// before anything else (a port taken fails the start before the node does
// anything); nil where not asked for.
type boundGateways struct {
	resp, mc, http net.Listener
}

// bindGateways binds the gateways cfg asks for.
func bindGateways(cfg Config) (*boundGateways, error) {
	b := &boundGateways{}
	bind := func(to *net.Listener, name, addr string) error {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			b.close()
			return fmt.Errorf("%s: %w", name, err)
		}
		*to = sockio.Listener(ln)
		return nil
	}
	if cfg.RESPListen != "" {
		if err := bind(&b.resp, "resp", cfg.RESPListen); err != nil {
			return nil, err
		}
	}
	if cfg.MemcacheListen != "" {
		if !cfg.MemcacheInsecure && !loopback(cfg.MemcacheListen) {
			b.close()
			return nil, fmt.Errorf("memcache: %s is not a loopback address, and memcached's protocol has no authentication: anyone who reaches it acts as an anonymous client (the policy's rules for one apply); give --memcache-insecure to serve it there anyway", cfg.MemcacheListen)
		}
		if err := bind(&b.mc, "memcache", cfg.MemcacheListen); err != nil {
			return nil, err
		}
	}
	if cfg.HTTPListen != "" {
		if err := bind(&b.http, "http", cfg.HTTPListen); err != nil {
			return nil, err
		}
		if cfg.HTTPTLS {
			cert, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
			if err != nil {
				b.close()
				return nil, fmt.Errorf("http: --http-tls needs --tls-cert and --tls-key: %w", err)
			}
			b.http = tls.NewListener(b.http, &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})
		}
	}
	return b, nil
}

// close closes every listener bound (a start that failed).
func (b *boundGateways) close() {
	for _, ln := range []net.Listener{b.resp, b.mc, b.http} {
		if ln != nil {
			ln.Close()
		}
	}
}

// serveGateways starts the gateways bound.
func (s *Server) serveGateways(b *boundGateways, started time.Time) {
	if b.resp != nil {
		s.serveRESP(b.resp, started)
	}
	if b.mc != nil {
		s.serveMemcache(b.mc, started)
	}
	if b.http != nil {
		s.serveHTTP(b.http)
	}
}

// serveRESP starts the Redis protocol endpoint.
func (s *Server) serveRESP(ln net.Listener, started time.Time) {
	srv := redis.New(redis.Config{
		Service: s.service,
		Guard:   guard{s.broker},
		MaxBulk: int(s.cfg.Limits.MaxPacketSize),
		Logger:  s.log,
		Info: func() redis.Info {
			t := s.node.Totals()
			return redis.Info{Version: Version, NodeID: s.NodeID, Durable: !s.cfg.InMemory, Started: started,
				Keys: t.Keys, Bytes: t.Bytes, Partial: t.Partial}
		},
	})
	// A cluster member serves each connection on a goroutine of its own:
	// its reads may be forwarded, and in the loop every read would go to
	// a goroutine of its own (a one-node cluster's GET, one at a time:
	// 46,154-48,309 a second against 66,007-74,442; docs/benchmarks.md).
	if s.cfg.Cluster.Listen != "" {
		s.resp = gateway.Serve(ln, srv.Serve)
		return
	}
	ep, err := srv.ServeLoop(ln)
	if err != nil {
		s.log.Warn("resp: serving each connection on a goroutine of its own", "error", err)
		ep = gateway.Serve(ln, srv.Serve)
	}
	s.resp = ep
}

// RESPAddr is the Redis protocol endpoint's address, or "".
func (s *Server) RESPAddr() string {
	if s.resp == nil {
		return ""
	}
	return s.resp.Addr()
}

// serveMemcache starts the memcached text protocol endpoint. Its clients
// cannot authenticate, so only a loopback address is bound unless the
// operator said --memcache-insecure (see bindGateways).
func (s *Server) serveMemcache(ln net.Listener, started time.Time) {
	srv := memcache.New(memcache.Config{
		Service: s.service,
		Guard:   guard{s.broker},
		Logger:  s.log,
		Info: func() memcache.Info {
			t := s.node.Totals()
			return memcache.Info{Version: Version, Started: started, Keys: t.Keys, Bytes: t.Bytes}
		},
	})
	s.mc = gateway.Serve(ln, srv.Serve)
}

// loopback says whether a listen address stays on this machine.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// MemcacheAddr is the memcached endpoint's address, or "".
func (s *Server) MemcacheAddr() string {
	if s.mc == nil {
		return ""
	}
	return s.mc.Addr()
}

// serveHTTP starts the HTTP key-value endpoint (over TLS with the node's
// certificate if --http-tls: see bindGateways).
func (s *Server) serveHTTP(ln net.Listener) {
	srv := httpkv.New(httpkv.Config{Service: s.service, Guard: guard{s.broker}, MaxValue: int64(s.cfg.Limits.MaxPacketSize),
		Leases: lease.New(s.node), WatchBuffer: s.cfg.HTTPWatchBuffer, Logger: s.log})
	srv.Serve(ln)
	s.http = srv
}

// HTTPAddr is the HTTP endpoint's address, or "".
func (s *Server) HTTPAddr() string {
	if s.http == nil {
		return ""
	}
	return s.http.Addr()
}
