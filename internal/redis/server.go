// Package redis serves the state store to Redis clients (redis-cli,
// redis-benchmark, Redis client libraries) over RESP2 and RESP3: the
// commands that map onto the store (GET, SET with NX/XX/PX/EX/GET, DEL,
// EXISTS, MGET, PTTL/TTL, KEYS, SCAN) and the connection commands clients
// send (HELLO, AUTH, SELECT 0, CLIENT, PING, ECHO, INFO, QUIT), plus
// MQKV.* extensions for versions. Every command goes through the
// statestore service (package gateway), so it is authorized, limited,
// logged, notified and counted as an MQTT request is, and served for any
// key from any node of a cluster.
package redis

import (
	"bufio"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/gateway"
)

// Info is what INFO and DBSIZE report.
type Info struct {
	Version string // mqkv's
	NodeID  string
	Durable bool
	Started time.Time
	Keys    int   // in the whole store
	Bytes   int64 // key and value bytes in the whole store
	Partial bool  // some group's figures are missing
}

// Config configures a Server.
type Config struct {
	Service gateway.Service
	Guard   gateway.Guard // nil: gateway.Open
	// Info gives INFO's figures; nil reports none.
	Info func() Info
	// MaxBulk bounds one argument (a value) in bytes; 0 is 64 MiB, the
	// MQTT listener's default packet limit.
	MaxBulk int
	Logger  *slog.Logger
}

// Server is a RESP listener.
type Server struct {
	cfg Config
	log *slog.Logger
	ln  net.Listener

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup

	// Counters, for INFO and metrics.
	Connected atomic.Int64
	Total     atomic.Int64
	Commands  atomic.Int64
}

// New returns a server; Serve starts it.
func New(cfg Config) *Server {
	if cfg.Guard == nil {
		cfg.Guard = gateway.Open{}
	}
	if cfg.MaxBulk <= 0 {
		cfg.MaxBulk = 64 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Server{cfg: cfg, log: cfg.Logger, conns: map[net.Conn]struct{}{}}
}

// Listen starts listening on addr and serving in the background.
func (s *Server) Listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	s.ln = ln
	s.wg.Add(1)
	go s.accept()
	return nil
}

// Addr is the listener's address.
func (s *Server) Addr() string { return s.ln.Addr().String() }

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

// Close stops listening and ends every connection.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	var err error
	if s.ln != nil {
		err = s.ln.Close()
	}
	s.wg.Wait()
	return err
}

// conn is one client connection.
type conn struct {
	s      *Server
	nc     net.Conn
	c      *gateway.Client
	w      *writer
	name   string
	since  time.Time
	quit   bool
	cursor cursors
}

func (s *Server) serve(nc net.Conn) {
	defer s.wg.Done()
	s.Connected.Add(1)
	s.Total.Add(1)
	defer func() {
		s.Connected.Add(-1)
		s.mu.Lock()
		delete(s.conns, nc)
		s.mu.Unlock()
		nc.Close()
	}()
	br := bufio.NewReaderSize(nc, 16<<10)
	rd := &reader{br: br, maxBulk: s.cfg.MaxBulk}
	c := &conn{s: s, nc: nc, c: gateway.NewClient(s.cfg.Service, s.cfg.Guard, "resp"), since: time.Now(),
		w: &writer{bw: bufio.NewWriterSize(nc, 16<<10), proto: 2}}
	for !c.quit {
		args, err := rd.next()
		if err != nil {
			var pe ProtocolError
			if errors.As(err, &pe) {
				c.w.err("ERR " + pe.Error())
				c.w.bw.Flush()
				s.log.Debug("resp: protocol error, connection closed", "remote", nc.RemoteAddr(), "error", err)
			} else if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				s.log.Debug("resp: connection ended", "remote", nc.RemoteAddr(), "error", err)
			}
			return
		}
		if len(args) == 0 {
			continue
		}
		s.Commands.Add(1)
		c.command(args)
		// Pipelined commands are answered in one write once the input
		// read so far is used up.
		if br.Buffered() == 0 || c.quit {
			if err := c.w.bw.Flush(); err != nil {
				return
			}
		}
	}
}
