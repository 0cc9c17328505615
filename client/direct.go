package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"hash/fnv"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mqkv/mqkv/internal/resp"
)

// Direct requests (Config.Direct). Any member of an mqkv cluster serves
// every key: one that does not lead the key's group sends the request on
// to the member that does and the answer back, a hop on the node link
// that costs both members CPU and the client a round trip. A client that
// knows the groups' leaders sends each key's request to its leader
// itself, as Aerospike's and Redis Cluster's clients do, and two requests
// in three (three members) skip the hop.
//
// The client asks the member it is connected to for the routes (the
// ROUTES command: the partition count, and each group's leader's MQTT
// address), every routeEvery and whenever a direct connection fails, and
// keeps one more connection per leader, made in the background. A
// request goes direct only when its key's route is known and that
// connection is up; otherwise, and for everything that is not one key's
// (KEYNOTIFY, SCAN), it takes the first connection, as without Direct. A
// route gone stale (a leader changed since) costs only the hop again:
// the member forwards. A server that does not know ROUTES (the AIO
// broker) is never asked again.

// routeEvery is how often the routes are asked for again.
const routeEvery = 3 * time.Second

// routeTable is one ROUTES answer.
type routeTable struct {
	partitions uint32
	leaders    []string // by group: host:port, or "" if unknown
}

// addrOf returns the address of the leader of key's group, "" if unknown.
func (t *routeTable) addrOf(key []byte) string {
	if t == nil || len(t.leaders) < 2 || t.partitions == 0 {
		return ""
	}
	p := crc32.Checksum(key, castagnoli) % t.partitions
	return t.leaders[int(p)%len(t.leaders)]
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// director keeps the routes and the direct connections of a client.
type director struct {
	parent *Client
	table  atomic.Pointer[routeTable]
	nudge  chan struct{} // ask for the routes now
	// local is the address the first connection last dialled: its
	// groups' requests take that connection.
	local atomic.Pointer[string]

	mu      sync.Mutex
	conns   map[string]*Client   // leader address → direct connection (up or reconnecting)
	dialing map[string]bool      // being made
	failed  map[string]time.Time // last failed attempt, for a pause before the next
	absent  map[string]time.Time // a connection's address missing from the routes since
	closed  bool
}

func newDirector(parent *Client) *director {
	return &director{
		parent:  parent,
		nudge:   make(chan struct{}, 1),
		conns:   map[string]*Client{},
		dialing: map[string]bool{},
		failed:  map[string]time.Time{},
		absent:  map[string]time.Time{},
	}
}

// keyed reports whether args is a request on one key that may go direct.
func keyed(args [][]byte) bool {
	if len(args) < 2 {
		return false
	}
	for _, name := range keyedVerbs {
		if bytes.EqualFold(args[0], name) {
			return true
		}
	}
	return false
}

// keyedVerbs are the commands on one key that may go direct.
var keyedVerbs = [][]byte{[]byte("GET"), []byte("SET"), []byte("DEL"), []byte("VDEL"), []byte("PTTL"), []byte("INCRBY")}

// pick returns the direct connection for key, nil if the request should
// take the first connection.
func (d *director) pick(key []byte) *Client {
	addr := d.table.Load().addrOf(key)
	if addr == "" {
		return nil
	}
	if d.isLocal(addr) {
		return nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	c := d.conns[addr]
	if c == nil {
		d.dialLocked(addr)
		return nil
	}
	if !c.isReady() {
		d.wake() // its member may have stopped leading, or stopped
		return nil
	}
	return c
}

// isLocal reports whether addr is the one the first connection dialled:
// its groups' requests take that connection.
func (d *director) isLocal(addr string) bool {
	l := d.local.Load()
	return l != nil && *l == addr
}

// dialLocked starts a direct connection to addr, unless it has one, is
// making one, addr is the first connection's, or the last attempt failed
// less than a routeEvery ago.
func (d *director) dialLocked(addr string) {
	if d.conns[addr] != nil || d.dialing[addr] || d.isLocal(addr) || time.Since(d.failed[addr]) < routeEvery {
		return
	}
	d.dialing[addr] = true
	go func() {
		p := d.parent
		cfg := p.cfg
		cfg.URL = p.scheme + "://" + addr
		cfg.ClientID = directID(p.cfg.ClientID, addr)
		cfg.Direct = false
		ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout)
		c, err := dial(ctx, cfg, p)
		cancel()
		d.mu.Lock()
		defer d.mu.Unlock()
		delete(d.dialing, addr)
		if err != nil {
			p.log.Debug("direct connection failed", "server", addr, "error", err)
			d.failed[addr] = time.Now()
			return
		}
		if d.closed || d.conns[addr] != nil {
			go c.Close()
			return
		}
		delete(d.failed, addr)
		d.conns[addr] = c
	}()
}

// directID names the direct connection to addr: the client's id and a
// hash of the address, so that each is one session of its own and the
// same one on every reconnect.
func directID(id, addr string) string {
	h := fnv.New32a()
	h.Write([]byte(addr))
	return fmt.Sprintf("%s.d%08x", id, h.Sum32())
}

func (d *director) wake() {
	select {
	case d.nudge <- struct{}{}:
	default:
	}
}

// run asks for the routes until the client closes: at once, then every
// routeEvery or when nudged (at most once a second).
func (d *director) run() {
	p := d.parent
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-p.done:
			return
		case <-t.C:
		case <-d.nudge:
		}
		if err := d.refresh(); errors.Is(err, ErrUnknownCommand) {
			p.log.Info("the server does not tell routes (not mqkv, or an older one): every request takes the first connection")
			return
		} else if err != nil {
			p.log.Debug("asking for routes failed", "error", err)
		}
		select {
		case <-p.done:
			return
		case <-time.After(time.Second):
		}
		t.Reset(routeEvery - time.Second)
	}
}

// refresh asks for the routes, makes connections to new leaders and
// closes those to addresses no longer in the table.
func (d *director) refresh() error {
	p := d.parent
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Timeout)
	defer cancel()
	r, err := p.request(ctx, [][]byte{[]byte("ROUTES")})
	if err != nil {
		return err
	}
	t, err := parseRoutes(r.Value)
	if err != nil {
		return err
	}
	d.table.Store(t)
	want := map[string]bool{}
	for _, a := range t.leaders {
		if a != "" {
			want[a] = true
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	// A connection no route names any more (its member leads nothing, or
	// left) is closed once no request can still wait on it.
	for addr, c := range d.conns {
		switch {
		case want[addr]:
			delete(d.absent, addr)
		case d.absent[addr].IsZero():
			d.absent[addr] = time.Now()
		case time.Since(d.absent[addr]) > 2*p.cfg.Timeout:
			delete(d.conns, addr)
			delete(d.absent, addr)
			go c.Close()
		}
	}
	for addr := range want {
		d.dialLocked(addr)
	}
	return nil
}

// parseRoutes reads a ROUTES answer.
func parseRoutes(v resp.Value) (*routeTable, error) {
	if v.Kind != resp.Array || len(v.Elems) < 2 || v.Elems[0].Kind != resp.Integer || v.Elems[0].Int <= 0 || v.Elems[0].Int > 1<<20 {
		return nil, unexpected("ROUTES", v)
	}
	t := &routeTable{partitions: uint32(v.Elems[0].Int)}
	for _, e := range v.Elems[1:] {
		if e.Kind != resp.BulkString {
			return nil, unexpected("ROUTES", v)
		}
		a := string(e.Str)
		if a != "" {
			if _, _, err := net.SplitHostPort(a); err != nil {
				return nil, fmt.Errorf("client: ROUTES names %q, not host:port", a)
			}
		}
		t.leaders = append(t.leaders, a)
	}
	return t, nil
}

// close ends the direct connections.
func (d *director) close() {
	d.mu.Lock()
	d.closed = true
	conns := d.conns
	d.conns = map[string]*Client{}
	d.mu.Unlock()
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Add(1)
		go func() { defer wg.Done(); c.Close() }()
	}
	wg.Wait()
}
