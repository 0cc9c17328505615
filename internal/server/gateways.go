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

// serveRESP starts the Redis protocol endpoint.
func (s *Server) serveRESP(addr string, started time.Time) error {
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
	ln, err := gateway.Listen(addr, srv.Serve)
	if err != nil {
		return fmt.Errorf("resp: %w", err)
	}
	s.resp = ln
	return nil
}

// RESPAddr is the Redis protocol endpoint's address, or "".
func (s *Server) RESPAddr() string {
	if s.resp == nil {
		return ""
	}
	return s.resp.Addr()
}

// serveMemcache starts the memcached text protocol endpoint. Its clients
// cannot authenticate, so only a loopback address is taken unless insecure
// says the operator knows.
func (s *Server) serveMemcache(addr string, insecure bool, started time.Time) error {
	if !insecure && !loopback(addr) {
		return fmt.Errorf("memcache: %s is not a loopback address, and memcached's protocol has no authentication: anyone who reaches it acts as an anonymous client (the policy's rules for one apply); give --memcache-insecure to serve it there anyway", addr)
	}
	srv := memcache.New(memcache.Config{
		Service: s.service,
		Guard:   guard{s.broker},
		Logger:  s.log,
		Info: func() memcache.Info {
			t := s.node.Totals()
			return memcache.Info{Version: Version, Started: started, Keys: t.Keys, Bytes: t.Bytes}
		},
	})
	ln, err := gateway.Listen(addr, srv.Serve)
	if err != nil {
		return fmt.Errorf("memcache: %w", err)
	}
	s.mc = ln
	return nil
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

// serveHTTP starts the HTTP key-value endpoint, over TLS with the node's
// certificate if tlsOn.
func (s *Server) serveHTTP(addr string, tlsOn bool) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("http: %w", err)
	}
	if tlsOn {
		cert, err := tls.LoadX509KeyPair(s.cfg.TLSCert, s.cfg.TLSKey)
		if err != nil {
			ln.Close()
			return fmt.Errorf("http: --http-tls needs --tls-cert and --tls-key: %w", err)
		}
		ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})
	}
	srv := httpkv.New(httpkv.Config{Service: s.service, Guard: guard{s.broker}, MaxValue: int64(s.cfg.Limits.MaxPacketSize),
		Leases: lease.New(s.node), WatchBuffer: s.cfg.HTTPWatchBuffer, Logger: s.log})
	srv.Serve(ln)
	s.http = srv
	return nil
}

// HTTPAddr is the HTTP endpoint's address, or "".
func (s *Server) HTTPAddr() string {
	if s.http == nil {
		return ""
	}
	return s.http.Addr()
}
