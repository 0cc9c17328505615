// Package admin is the node's HTTP admin endpoint: health and readiness,
// Prometheus metrics, pprof, a status summary, backups, and the web console
// with the JSON API behind it. It is off unless configured, and meant for
// 127.0.0.1 or a trusted network: it has no authentication of its own, only
// protection from the browsers of those who can reach it (see guard).
package admin

import (
	"context"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/mqkv/mqkv/internal/attach"
	"github.com/mqkv/mqkv/internal/broker"
	"github.com/mqkv/mqkv/internal/cluster"
	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/journal"
	"github.com/mqkv/mqkv/internal/mesh"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/store"
)

// Node is what the admin endpoint reports on.
type Node struct {
	NodeID  string
	Version string
	Started time.Time
	Data    Keyspace
	Service *statestore.Service
	Broker  *broker.Broker
	// Mesh carries MQTT between a cluster's nodes; nil on a node on its
	// own.
	Mesh *mesh.Mesh
	// Attached is the attachment to another broker (mqkv attach); nil
	// without one.
	Attached *attach.Attach
}

// Keyspace is the data behind the endpoint: the whole keyspace through the
// router (the key browser sees every key of a cluster), and this node's
// share of the figures.
type Keyspace interface {
	statestore.Router
	Stats() replica.Stats
	// GroupStats are the figures of each replica held here, by group.
	GroupStats() map[int]replica.Stats
	// JournalStats are the figures of the log a cluster node's groups
	// share; false without one.
	JournalStats() (journal.Stats, bool)
	// Backup writes a snapshot of the store to w, calling start first with
	// its greatest version and number of keys: at one point on a node on
	// its own, each group at its own point in a cluster.
	Backup(ctx context.Context, start func(maxVersion hlc.Timestamp, keys int), w io.Writer) error
	// Follow makes the node's changes reach Events (a cluster node
	// follows the groups only once something watches); it returns once
	// they do.
	Follow(ctx context.Context) error
	// Status, Leave and Remove are the cluster's (mqkv cluster).
	Clustered() bool
	// Ready reports whether a member serves: back in its cluster after a
	// restart, and still a member.
	Ready() bool
	// Totals are the whole store's keys and bytes (a cluster's, not only
	// what this node leads); Role says what the node is.
	Totals() cluster.Totals
	Role() string
	Status() cluster.Status
	Leave(ctx context.Context, id string) error
	// Remove refuses a member that answers unless force.
	Remove(ctx context.Context, id string, force bool) error
}

// Server serves the admin endpoint.
type Server struct {
	node    *Node
	metrics *Metrics
	feed    *feed
	log     *slog.Logger
	hosts   []string // names allowed in Host besides IPs and localhost
	http    *http.Server
	ln      net.Listener

	rates topicRates

	mu      sync.Mutex
	history []Sample // one per second, the last historyLen
	stop    chan struct{}
	done    chan struct{}
}

const historyLen = 300 // five minutes

// New prepares the endpoint. Its metrics are wired to the replica group and
// the service, and Events to the group's OnEvents, before Serve.
// allowedHosts are the host names (besides IP addresses and localhost) by
// which browsers may reach it.
func New(m *Metrics, allowedHosts []string, log *slog.Logger) *Server {
	return &Server{metrics: m, feed: newFeed(), log: log, hosts: allowedHosts, stop: make(chan struct{}), done: make(chan struct{})}
}

// Events feeds applied changes to the console's live view; it is a replica
// OnEvents consumer.
func (s *Server) Events(events []store.Event) { s.feed.Events(events) }

// Listen binds addr, before anything else starts: a port taken is then
// the start's first failure, not one after the node created or joined its
// cluster (a CI run's server exited so, its cluster made).
func (s *Server) Listen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("admin listener: %w", err)
	}
	s.ln = ln
	return nil
}

// Serve serves n in the background, on the address Listen bound (or on
// addr, bound now).
func (s *Server) Serve(addr string, n *Node) error {
	s.node = n
	s.metrics.bind(n)
	if s.ln == nil {
		if err := s.Listen(addr); err != nil {
			return err
		}
	}
	ln := s.ln
	s.http = &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go s.http.Serve(ln)
	go s.sample()
	return nil
}

// Addr returns the address the endpoint listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the endpoint.
func (s *Server) Close() error {
	if s.http == nil {
		if s.ln != nil {
			return s.ln.Close() // bound, never served: a start that failed
		}
		return nil
	}
	close(s.stop)
	<-s.done
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return s.http.Shutdown(ctx)
}

//go:embed console/index.html
var consolePage []byte

// Handler returns the endpoint's routes.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", s.readyz)
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, s.Status()) })
	mux.HandleFunc("GET /v1/keys", s.keys)
	mux.HandleFunc("POST /v1/keys/delete", s.deleteKey)
	mux.HandleFunc("POST /v1/keys/set", s.setKey)
	mux.HandleFunc("GET /v1/events", s.events)
	mux.HandleFunc("GET /v1/backup", s.backup)
	mux.HandleFunc("GET /v1/cluster", s.clusterStatus)
	mux.HandleFunc("GET /v1/mqtt", s.mqtt)
	mux.HandleFunc("GET /v1/activity", s.activity)
	mux.HandleFunc("POST /v1/cluster/leave", s.clusterChange(func(k Keyspace, ctx context.Context, r *http.Request) error {
		return k.Leave(ctx, r.URL.Query().Get("node"))
	}))
	mux.HandleFunc("POST /v1/cluster/remove", s.clusterChange(func(k Keyspace, ctx context.Context, r *http.Request) error {
		return k.Remove(ctx, r.URL.Query().Get("node"), r.URL.Query().Get("force") == "1")
	}))
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'; script-src 'self' 'unsafe-inline'")
		w.Write(consolePage)
	})
	return newGuard(mux, s.hosts)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

func httpError(w http.ResponseWriter, code int, format string, args ...any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]string{"error": fmt.Sprintf(format, args...)})
}

func (s *Server) readyz(w http.ResponseWriter, _ *http.Request) {
	st := s.node.Data.Stats()
	if s.node.Data.Clustered() {
		// A member serves every key (forwarding to the leaders) once it
		// has joined or is back in its cluster, and while it is a member.
		st.Leader = s.node.Data.Ready()
	}
	if !st.Leader || st.AppliedIndex < st.LastIndex && st.LastIndex-st.AppliedIndex > 1<<20 {
		httpError(w, http.StatusServiceUnavailable, "not ready: leader=%v applied=%d last=%d", st.Leader, st.AppliedIndex, st.LastIndex)
		return
	}
	w.Write([]byte("ready\n"))
}

// Sample is one second of the overview chart.
type Sample struct {
	Time    int64   `json:"t"` // unix seconds
	Keys    int     `json:"keys"`
	Clients int64   `json:"clients"`
	RPS     float64 `json:"rps"`
	P99Ms   float64 `json:"p99_ms"`
}

// Status is the one-screen summary of `mqkv status` and the console.
type Status struct {
	Version       string    `json:"version"`
	NodeID        string    `json:"node_id"`
	Started       time.Time `json:"started"`
	UptimeSeconds float64   `json:"uptime_seconds"`
	// Keys and Bytes are the whole store's: a cluster's, summed over its
	// groups' leaders (KeysPartial if some group's are missing); NodeKeys
	// and NodeBytes those of the groups this node leads.
	Keys          int        `json:"keys"`
	Bytes         int64      `json:"bytes"`
	KeysPartial   bool       `json:"keys_partial,omitempty"`
	NodeKeys      int        `json:"node_keys"`
	NodeBytes     int64      `json:"node_bytes"`
	Role          string     `json:"role"` // single node; member, leads groups 0, 3; starting; not a member
	Clients       int64      `json:"clients"`
	Registrations int64      `json:"keynotify_registrations"`
	Requests      int64      `json:"requests_total"`
	RPS           float64    `json:"requests_per_second"`
	P99Ms         float64    `json:"p99_ms"`
	AppliedIndex  uint64     `json:"raft_applied_index"`
	LastIndex     uint64     `json:"raft_last_index"`
	Leader        bool       `json:"raft_leader"`
	LastSnapshot  *time.Time `json:"last_snapshot,omitempty"`
	SnapshotBytes int64      `json:"snapshot_bytes"`
	Expired       int64      `json:"expired_total"`
	MessagesIn    int64      `json:"mqtt_messages_in"`
	MessagesOut   int64      `json:"mqtt_messages_out"`
	History       []Sample   `json:"history"`
	// Attached says how the attachment to another broker fares (mqkv
	// attach).
	Attached *attach.Status `json:"attached,omitempty"`
}

// Status returns the current summary.
func (s *Server) Status() Status {
	n := s.node
	gs := n.Data.Stats()
	tot := n.Data.Totals()
	tr := n.Broker.Traffic()
	st := Status{
		Version: n.Version, NodeID: n.NodeID, Started: n.Started, UptimeSeconds: time.Since(n.Started).Seconds(),
		Keys: tot.Keys, Bytes: tot.Bytes, KeysPartial: tot.Partial, NodeKeys: gs.Keys, NodeBytes: gs.Bytes, Role: n.Data.Role(),
		Clients:       tr.Clients,
		Registrations: n.Service.Counters.RegistrationsActive.Load(),
		Requests:      n.Service.Counters.Requests.Load(),
		AppliedIndex:  gs.AppliedIndex, LastIndex: gs.LastIndex, Leader: gs.Leader,
		SnapshotBytes: gs.SnapshotBytes, Expired: gs.Expired,
		MessagesIn: tr.MessagesIn, MessagesOut: tr.MessagesOut,
	}
	if !gs.LastSnapshot.IsZero() {
		st.LastSnapshot = &gs.LastSnapshot
	}
	if n.Attached != nil {
		a := n.Attached.Status()
		st.Attached = &a
	}
	s.mu.Lock()
	st.History = append([]Sample(nil), s.history...)
	s.mu.Unlock()
	if len(st.History) > 0 {
		last := st.History[len(st.History)-1]
		st.RPS, st.P99Ms = last.RPS, last.P99Ms
	}
	return st
}

// sample records one Sample a second.
func (s *Server) sample() {
	defer close(s.done)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	last := time.Now()
	var lastReq int64
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			req := s.node.Service.Counters.Requests.Load()
			smp := Sample{
				Time:    now.Unix(),
				Keys:    s.node.Data.Totals().Keys,
				Clients: s.node.Broker.Traffic().Clients,
				P99Ms:   float64(s.metrics.p99()) / float64(time.Millisecond),
			}
			s.mu.Lock()
			smp.RPS = float64(req-lastReq) / now.Sub(last).Seconds()
			lastReq, last = req, now
			s.history = append(s.history, smp)
			if len(s.history) > historyLen {
				s.history = s.history[len(s.history)-historyLen:]
			}
			s.mu.Unlock()
		}
	}
}

// KeyInfo is one key in the key browser.
type KeyInfo struct {
	Key      string `json:"key"`
	KeyHex   string `json:"key_hex"`
	Value    string `json:"value"`
	ValueHex string `json:"value_hex"`
	Binary   bool   `json:"binary,omitempty"`
	Size     int    `json:"size"`
	Version  string `json:"version"`
	TTLMs    *int64 `json:"ttl_ms"`
	Fence    string `json:"fencing_token,omitempty"`
}

const maxScanned = 100_000 // keys examined per page, so a rare match cannot hold the read lock long

// keys lists keys matching ?match (a glob; default *), after ?after (hex),
// at most ?limit (default 100). next is the cursor of the following page.
func (s *Server) keys(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	pattern := []byte(q.Get("match"))
	if len(pattern) == 0 {
		pattern = []byte("*")
	}
	limit, _ := strconv.Atoi(q.Get("limit"))
	if limit <= 0 || limit > 1000 {
		limit = 100
	}
	after, err := hex.DecodeString(q.Get("after"))
	if err != nil {
		httpError(w, http.StatusBadRequest, "after: not hex")
		return
	}
	from := glob.Literal(pattern)
	if len(after) > 0 {
		from = append(after, 0) // the first key after it
	}
	var out struct {
		Keys []KeyInfo `json:"keys"`
		Next string    `json:"next,omitempty"`
	}
	out.Keys = []KeyInfo{}
	scanned := 0
	prefix := glob.Literal(pattern)
	now := s.node.Data.Clock().WallMillis()
	var prev []byte
	ctx, cancel := context.WithTimeout(r.Context(), statestore.RequestTimeout)
	defer cancel()
	exhausted, err := s.node.Data.Ascend(ctx, from, prefix, maxScanned+1, func(e *store.Entry) bool {
		scanned++
		if len(out.Keys) == limit || scanned > maxScanned {
			// Resume after the last key examined before this one.
			out.Next = hex.EncodeToString(prev)
			return false
		}
		prev = e.Key
		if !glob.Match(pattern, e.Key) || store.Reserved(e.Key) {
			return true // (the server's own, as MQTT retained messages: shown under MQTT)
		}
		k := KeyInfo{Key: printable(e.Key), KeyHex: hex.EncodeToString(e.Key), Size: len(e.Value), Version: e.Version.String()}
		k.Value, k.ValueHex, k.Binary = valueForms(e.Value)
		if e.ExpiresAt != 0 {
			ttl := max(0, e.ExpiresAt-now)
			k.TTLMs = &ttl
		}
		if !e.Fence.IsZero() {
			k.Fence = e.Fence.String()
		}
		out.Keys = append(out.Keys, k)
		return true
	})
	if err != nil {
		httpError(w, http.StatusServiceUnavailable, "%v", err)
		return
	}
	if !exhausted && out.Next == "" && prev != nil {
		out.Next = hex.EncodeToString(prev) // the keyspace was read only so far
	}
	writeJSON(w, out)
}

// deleteKey deletes ?key (hex) through the log, as an operator: with the
// key's own fencing token, so a fenced key can be removed too.
func (s *Server) deleteKey(w http.ResponseWriter, r *http.Request) {
	key, err := hex.DecodeString(r.URL.Query().Get("key"))
	if err != nil || len(key) == 0 {
		httpError(w, http.StatusBadRequest, "key: want the key in hex")
		return
	}
	if store.Reserved(key) {
		httpError(w, http.StatusForbidden, "the server's own key (an MQTT retained message): publish to change it")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), statestore.RequestTimeout)
	defer cancel()
	e, ok, err := s.node.Data.Get(ctx, key)
	if err != nil {
		httpError(w, http.StatusServiceUnavailable, "%v", err)
		return
	}
	if !ok {
		httpError(w, http.StatusNotFound, "no such key")
		return
	}
	done := make(chan error, 1)
	var res store.Result
	s.node.Data.Submit(ctx, replica.Proposal{
		Cmd: store.Command{Op: store.OpDel, Key: key, Fence: e.Fence},
		Done: func(r store.Result, err error) {
			res = r
			done <- err
		},
	})
	if err := <-done; err != nil {
		httpError(w, http.StatusServiceUnavailable, "%v", err)
		return
	}
	writeJSON(w, map[string]any{"deleted": res.Outcome == store.Applied})
}

// setRequest is the console editor's write: a new key (Create: only if
// absent) or a change to the version it showed (Version: only if the key
// still holds it).
type setRequest struct {
	KeyHex   string  `json:"key_hex"`
	Value    *string `json:"value"`     // text...
	ValueHex *string `json:"value_hex"` // ...or bytes in hex
	TTLms    int64   `json:"ttl_ms"`    // 0: no expiry
	Create   bool    `json:"create"`    // only if absent (NX)
	NEX      bool    `json:"nex"`       // only if absent or holding the same value
	Version  string  `json:"version"`
	// KeepValue changes an existing key's expiry only (with Version):
	// the console shows a long value in part and must not write that
	// part back.
	KeepValue bool `json:"keep_value"`
}

// maxSetBody bounds a write from the console (values up to 16 MiB in hex).
const maxSetBody = 32 << 20

// setKey creates or changes a key for the console. A key under a fencing
// token is written with its own token: the operator has the authority a
// lease holder has (as for deletes).
func (s *Server) setKey(w http.ResponseWriter, r *http.Request) {
	var req setRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxSetBody)).Decode(&req); err != nil {
		httpError(w, http.StatusBadRequest, "body: %v", err)
		return
	}
	key, err := hex.DecodeString(req.KeyHex)
	if err != nil || len(key) == 0 {
		httpError(w, http.StatusBadRequest, "key_hex: want the key in hex")
		return
	}
	if store.Reserved(key) {
		httpError(w, http.StatusForbidden, "the server's own key (an MQTT retained message): publish to change it")
		return
	}
	var value []byte
	switch {
	case req.KeepValue:
		if req.Value != nil || req.ValueHex != nil || req.Version == "" || req.Create || req.NEX {
			httpError(w, http.StatusBadRequest, "keep_value: with version, and without value, value_hex, create or nex")
			return
		}
	case req.Value != nil && req.ValueHex == nil:
		value = []byte(*req.Value)
	case req.ValueHex != nil && req.Value == nil:
		if value, err = hex.DecodeString(*req.ValueHex); err != nil {
			httpError(w, http.StatusBadRequest, "value_hex: %v", err)
			return
		}
	default:
		httpError(w, http.StatusBadRequest, "give value or value_hex")
		return
	}
	if req.TTLms < 0 || req.TTLms > statestore.MaxTTL {
		// Past MaxTTL the deadline overflows into the past: the write
		// would be applied and the key gone at once.
		httpError(w, http.StatusBadRequest, "ttl_ms: a positive number of milliseconds (at most %d), or 0 for no expiry", statestore.MaxTTL)
		return
	}
	cmd := store.Command{Op: store.OpSet, Key: key, Value: value, TTL: req.TTLms}
	switch {
	case req.Create:
		cmd.Cond = store.IfVersion // a zero Expected: only if absent
	case req.NEX:
		cmd.Cond = store.NEX
	case req.Version != "":
		v, err := hlc.Parse(req.Version)
		if err != nil {
			httpError(w, http.StatusBadRequest, "version: %v", err)
			return
		}
		cmd.Cond, cmd.Expected = store.IfVersion, v
	}
	ctx, cancel := context.WithTimeout(r.Context(), statestore.RequestTimeout)
	defer cancel()
	e, exists, err := s.node.Data.Get(ctx, key)
	if err != nil {
		httpError(w, http.StatusServiceUnavailable, "%v", err)
		return
	}
	if exists {
		cmd.Fence = e.Fence
	}
	if req.KeepValue {
		// The version condition makes it the value of the version
		// shown, or nothing is written.
		cmd.Value = e.Value
	}
	done := make(chan error, 1)
	var res store.Result
	s.node.Data.Submit(ctx, replica.Proposal{Cmd: cmd, Done: func(r store.Result, err error) { res = r; done <- err }})
	if err := <-done; err != nil {
		httpError(w, http.StatusServiceUnavailable, "%v", err)
		return
	}
	switch res.Outcome {
	case store.Applied:
		writeJSON(w, map[string]any{"applied": true, "version": res.Version.String()})
	case store.NotApplied:
		switch {
		case req.Create:
			httpError(w, http.StatusConflict, "the key exists (version %s): reload to edit it", res.Version)
		case req.NEX:
			httpError(w, http.StatusConflict, "the key holds another value (version %s)", res.Version)
		default:
			httpError(w, http.StatusConflict, "the key changed since it was shown (now version %s; it was %s): reload to see it", orNone(res.Version), req.Version)
		}
	case store.QuotaExceeded:
		httpError(w, http.StatusInsufficientStorage, "the quota has been exceeded (--max-keys, --max-bytes)")
	default:
		httpError(w, http.StatusConflict, "not written (outcome %d)", res.Outcome)
	}
}

func orNone(v hlc.Timestamp) string {
	if v.IsZero() {
		return "none: deleted"
	}
	return v.String()
}

// events streams changes as server-sent events.
func (s *Server) events(w http.ResponseWriter, r *http.Request) {
	flusher, ok := w.(http.Flusher)
	if !ok {
		httpError(w, http.StatusInternalServerError, "streaming unsupported")
		return
	}
	ch, recent, ok := s.feed.subscribe()
	if !ok {
		httpError(w, http.StatusServiceUnavailable, "too many live viewers (%d)", maxViewers)
		return
	}
	defer s.feed.unsubscribe(ch)
	ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
	err := s.node.Data.Follow(ctx)
	cancel()
	if err != nil {
		// Changes flow once the groups have leaders again.
		s.log.Warn("live view: the node does not follow every group yet", "error", err)
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	send := func(c Change) bool {
		b, _ := json.Marshal(c)
		_, err := fmt.Fprintf(w, "data: %s\n\n", b)
		return err == nil
	}
	for _, c := range recent {
		send(c)
	}
	flusher.Flush()
	keepalive := time.NewTicker(15 * time.Second)
	defer keepalive.Stop()
	for {
		select {
		case c := <-ch:
			if !send(c) {
				return
			}
			flusher.Flush()
		case <-keepalive.C:
			fmt.Fprint(w, ": keep-alive\n\n")
			flusher.Flush()
		case <-r.Context().Done():
			return
		case <-s.stop:
			return
		}
	}
}

// Headers of a backup: its greatest version and its number of keys.
const (
	MaxVersionHeader = "X-Mqkv-Max-Version"
	KeysHeader       = "X-Mqkv-Keys"
)

// backup streams a consistent snapshot of the store while writes go on.
func (s *Server) backup(w http.ResponseWriter, r *http.Request) {
	started := false
	err := s.node.Data.Backup(r.Context(), func(maxVersion hlc.Timestamp, keys int) {
		started = true
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Disposition", `attachment; filename="mqkv-backup.snap"`)
		w.Header().Set(MaxVersionHeader, maxVersion.String())
		w.Header().Set(KeysHeader, strconv.Itoa(keys))
	}, w)
	switch {
	case err != nil && !started:
		httpError(w, http.StatusServiceUnavailable, "%v", err)
	case err != nil:
		// The client sees the snapshot end early: its checksum fails.
		s.log.Warn("backup interrupted", "error", err)
	}
}

// clusterStatus reports the cluster as this node sees it.
func (s *Server) clusterStatus(w http.ResponseWriter, _ *http.Request) {
	if !s.node.Data.Clustered() {
		httpError(w, http.StatusNotFound, "this node is not a cluster member (start it with --cluster-listen)")
		return
	}
	writeJSON(w, s.node.Data.Status())
}

// clusterChange drains (leave) or forgets (remove) the member ?node; leave
// without ?node means this node.
func (s *Server) clusterChange(change func(Keyspace, context.Context, *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !s.node.Data.Clustered() {
			httpError(w, http.StatusNotFound, "this node is not a cluster member")
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
		defer cancel()
		if err := change(s.node.Data, ctx, r); err != nil {
			httpError(w, http.StatusConflict, "%v", err)
			return
		}
		writeJSON(w, map[string]bool{"ok": true})
	}
}
