// Package memcache serves the state store to memcached clients over
// memcached's text protocol: get/gets, set/add/replace/append/prepend/cas
// (the cas unique stands for the key's version), delete, touch, incr/decr
// (read-modify-write made atomic by the key's version), version, stats and
// quit. Every command goes through the statestore service (package
// gateway), so it is authorized, limited, logged, notified and counted as
// an MQTT request is, and served for any key from any node of a cluster.
// The protocol has no authentication: its clients are anonymous.
package memcache

import (
	"bufio"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/gateway"
)

// Info is what stats reports of the store.
type Info struct {
	Version string
	Started time.Time
	Keys    int
	Bytes   int64
}

// Config configures a Server.
type Config struct {
	Service gateway.Service
	Guard   gateway.Guard // for the policy; nil: gateway.Open
	Info    func() Info
	// MaxValue bounds a value in bytes; 0 is 1 MiB, memcached's item
	// size limit.
	MaxValue int
	Logger   *slog.Logger
}

// Server is a memcached text protocol listener.
type Server struct {
	cfg Config
	log *slog.Logger

	stats counters
}

// counters are what stats reports of the endpoint.
type counters struct {
	connected, total                     atomic.Int64
	gets, sets, hits, misses, touches    atomic.Int64
	casHits, casMisses, casBad           atomic.Int64
	incrHits, incrMisses, decrHits       atomic.Int64
	decrMisses, deleteHits, deleteMisses atomic.Int64
}

// New returns a server; gateway.Listen(addr, s.Serve) serves it.
func New(cfg Config) *Server {
	if cfg.Guard == nil {
		cfg.Guard = gateway.Open{}
	}
	if cfg.MaxValue <= 0 {
		cfg.MaxValue = 1 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Server{cfg: cfg, log: cfg.Logger}
}

// conn is one client connection; commands are answered in order, the
// replies of a pipeline written together.
type conn struct {
	s  *Server
	c  *gateway.Client
	bw *bufio.Writer
}

// Serve serves one client connection until it ends.
func (s *Server) Serve(nc net.Conn) {
	s.stats.connected.Add(1)
	s.stats.total.Add(1)
	defer s.stats.connected.Add(-1)
	br := bufio.NewReaderSize(nc, 16<<10)
	c := &conn{s: s, c: gateway.NewClient(s.cfg.Service, s.cfg.Guard, "memcache"), bw: bufio.NewWriterSize(nc, 16<<10)}
	c.c.AdmitAnonymous()
	for {
		r, err := readRequest(br, s.cfg.MaxValue)
		var ce clientError
		switch {
		case err == nil:
			if r.name == "quit" {
				c.bw.Flush()
				return
			}
			c.run(r)
		case errors.Is(err, errUnknown):
			c.bw.WriteString("ERROR\r\n")
		case errors.Is(err, errTooLarge):
			c.bw.WriteString(errTooLarge.Error() + "\r\n")
		case errors.As(err, &ce):
			c.bw.WriteString(ce.Error() + "\r\n")
			if errors.Is(err, errLineTooLong) {
				c.bw.Flush()
				return
			}
		default:
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				s.log.Debug("memcache: connection ended", "remote", nc.RemoteAddr(), "error", err)
			}
			c.bw.Flush()
			return
		}
		if br.Buffered() == 0 {
			if err := c.bw.Flush(); err != nil {
				return
			}
		}
	}
}
