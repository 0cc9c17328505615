// Package httpkv serves the state store over HTTP: a key's value as a
// resource (/v1/kv/{key}) with its version as a strong ETag, optimistic
// concurrency by If-Match / If-None-Match / If-Unmodified-Since (412
// Precondition Failed) as Azure Blob storage gives it, conditional reads
// (304), TTLs, and listing by prefix or glob with paging. Requests go
// through the statestore service (package gateway), authenticated with
// HTTP Basic against the node's password file and authorized by its
// policy, as MQTT requests are.
package httpkv

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/resp"
)

// Config configures a Server.
type Config struct {
	Service gateway.Service
	Guard   gateway.Guard // nil: gateway.Open
	// MaxValue bounds a PUT's body; 0 is 64 MiB.
	MaxValue int64
	// Leases keeps the keys' leases; nil serves none.
	Leases Leases
	// WatchBuffer is how many changes a watch holds for a slow client;
	// 0 is DefaultWatchBuffer.
	WatchBuffer int
	Logger      *slog.Logger
}

// Server is the HTTP endpoint.
type Server struct {
	cfg  Config
	log  *slog.Logger
	http *http.Server
	ln   net.Listener

	// creds remembers Basic credentials checked lately: bcrypt costs tens
	// of milliseconds, and an HTTP client sends them with every request.
	credMu sync.Mutex
	creds  map[[32]byte]time.Time
}

// credTTL is how long checked credentials are taken without checking them
// again: a changed password file applies to HTTP clients within it.
const credTTL = 30 * time.Second

// New returns a server; Serve starts it.
func New(cfg Config) *Server {
	if cfg.WatchBuffer <= 0 {
		cfg.WatchBuffer = DefaultWatchBuffer
	}
	if cfg.Guard == nil {
		cfg.Guard = gateway.Open{}
	}
	if cfg.MaxValue <= 0 {
		cfg.MaxValue = 64 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Server{cfg: cfg, log: cfg.Logger, creds: map[[32]byte]time.Time{}}
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/kv/", s.kv)
	mux.HandleFunc("/v1/watch/", s.watch)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fail(w, http.StatusNotFound, "not_found", "no such endpoint: the store is at /v1/kv/{key}")
	})
	s.http = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelDebug)}
	return s
}

// Serve serves on ln (a TLS listener for HTTPS) in the background.
func (s *Server) Serve(ln net.Listener) {
	s.ln = ln
	go s.http.Serve(ln)
}

// Addr is the listener's address.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server; requests in progress end.
func (s *Server) Close() error { return s.http.Close() }

// errorBody is every error's JSON body: a stable code and a message.
type errorBody struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

func fail(w http.ResponseWriter, status int, code, msg string) {
	var b errorBody
	b.Error.Code, b.Error.Message = code, msg
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(b)
}

// storeFail answers a request the service refused.
func storeFail(w http.ResponseWriter, v resp.Value) {
	msg := string(v.Str)
	switch {
	case msg == string(resp.ErrNotAuthorized):
		fail(w, http.StatusForbidden, "forbidden", "the policy does not let this user do that to this key")
	case msg == string(resp.ErrQuotaExceeded):
		fail(w, http.StatusInsufficientStorage, "quota_exceeded", msg)
	case msg == string(resp.ErrMissingFencingToken):
		fail(w, http.StatusConflict, "fencing_token_required", msg+" (Mqkv-Fencing-Token)")
	case msg == string(resp.ErrFencingTokenLowerVersion):
		fail(w, http.StatusConflict, "fencing_token_stale", msg)
	case msg == string(resp.ErrKeyLengthZero), strings.HasPrefix(msg, "malformed"), strings.Contains(msg, "syntax"):
		fail(w, http.StatusBadRequest, "bad_request", msg)
	case strings.Contains(msg, "outcome"):
		fail(w, http.StatusServiceUnavailable, "outcome_unknown", msg)
	case strings.Contains(msg, "nearly full"):
		fail(w, http.StatusInsufficientStorage, "volume_full", msg)
	default:
		fail(w, http.StatusServiceUnavailable, "unavailable", msg)
	}
}

// client authenticates r (Basic) and returns the gateway client it acts
// as, or answers 401.
func (s *Server) client(w http.ResponseWriter, r *http.Request) *gateway.Client {
	c := gateway.NewClient(s.cfg.Service, s.cfg.Guard, "http")
	user, pass, ok := r.BasicAuth()
	if ok {
		if !s.checkCached(c, user, pass) {
			w.Header().Set("WWW-Authenticate", `Basic realm="mqkv"`)
			fail(w, http.StatusUnauthorized, "unauthorized", "wrong username or password")
			return nil
		}
	} else if !c.Authenticated() {
		w.Header().Set("WWW-Authenticate", `Basic realm="mqkv"`)
		fail(w, http.StatusUnauthorized, "unauthorized", "this server requires a username and password (HTTP Basic)")
		return nil
	}
	return c
}

func (s *Server) checkCached(c *gateway.Client, user, pass string) bool {
	h := sha256.Sum256([]byte(user + "\x00" + pass))
	s.credMu.Lock()
	at, ok := s.creds[h]
	s.credMu.Unlock()
	if ok && time.Since(at) < credTTL {
		c.AdmitAs(user)
		return true
	}
	if !c.Auth(user, []byte(pass)) {
		return false
	}
	s.credMu.Lock()
	if len(s.creds) > 10_000 { // forget them all rather than grow
		clear(s.creds)
	}
	s.creds[h] = time.Now()
	s.credMu.Unlock()
	return true
}

// unescapeKey reads a key from a path: percent-decoded (so a key may hold
// '/' as itself or as %2F, and any byte as %XX).
func unescapeKey(p string) ([]byte, error) {
	k, err := url.PathUnescape(p)
	return []byte(k), err
}

func (s *Server) kv(w http.ResponseWriter, r *http.Request) {
	c := s.client(w, r)
	if c == nil {
		return
	}
	escaped := strings.TrimPrefix(r.URL.EscapedPath(), "/v1/kv/")
	leaseOp := r.Method == http.MethodPost && strings.HasSuffix(escaped, "/lease")
	if leaseOp {
		escaped = strings.TrimSuffix(escaped, "/lease")
	}
	key, err := unescapeKey(escaped)
	if err != nil {
		fail(w, http.StatusBadRequest, "bad_request", "the key is not percent-encoded correctly")
		return
	}
	if leaseOp && len(key) > 0 {
		s.leaseOp(w, r, c, key)
		return
	}
	if len(key) == 0 {
		if r.Method != http.MethodGet {
			fail(w, http.StatusMethodNotAllowed, "method_not_allowed", "the key list is read with GET")
			return
		}
		s.list(w, r, c)
		return
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		s.get(w, r, c, key)
	case http.MethodPut:
		s.put(w, r, c, key)
	case http.MethodDelete:
		s.delete(w, r, c, key)
	default:
		w.Header().Set("Allow", "GET, HEAD, PUT, DELETE; POST .../lease")
		fail(w, http.StatusMethodNotAllowed, "method_not_allowed", r.Method+" is not served on a key")
	}
}

func etag(v hlc.Timestamp) string { return `"` + v.String() + `"` }

// versionTime is when a version was written, at HTTP's resolution.
func versionTime(v hlc.Timestamp) time.Time {
	return time.UnixMilli(v.Wall).UTC().Truncate(time.Second)
}

// matches says whether an If-Match / If-None-Match list names etag ("*"
// names any).
func matches(header, tag string) bool {
	for _, t := range strings.Split(header, ",") {
		t = strings.TrimSpace(t)
		if t == "*" || t == tag || strings.TrimPrefix(t, "W/") == tag {
			return true
		}
	}
	return false
}

// parseTime reads an HTTP date header; ok false if absent or unreadable
// (HTTP says to ignore an unreadable one).
func parseTime(h string) (time.Time, bool) {
	if h == "" {
		return time.Time{}, false
	}
	t, err := http.ParseTime(h)
	return t, err == nil
}

func (s *Server) get(w http.ResponseWriter, r *http.Request, c *gateway.Client, key []byte) {
	v, ver := c.Call("", []byte("GET"), key)
	if v.Kind == resp.ErrorReply {
		storeFail(w, v)
		return
	}
	if v.Null {
		if im := r.Header.Get("If-Match"); im != "" {
			fail(w, http.StatusPreconditionFailed, "precondition_failed", "If-Match: the key does not exist")
			return
		}
		fail(w, http.StatusNotFound, "not_found", "no such key")
		return
	}
	tag := etag(ver)
	h := w.Header()
	h.Set("ETag", tag)
	h.Set("Last-Modified", versionTime(ver).Format(http.TimeFormat))
	h.Set("Mqkv-Version", ver.String())
	// RFC 9110 13.2.2: If-Match, then If-Unmodified-Since when there is
	// no If-Match, then If-None-Match, then If-Modified-Since when there
	// is no If-None-Match.
	if im := r.Header.Get("If-Match"); im != "" {
		if !matches(im, tag) {
			fail(w, http.StatusPreconditionFailed, "precondition_failed", "If-Match: the key holds version "+ver.String())
			return
		}
	} else if t, ok := parseTime(r.Header.Get("If-Unmodified-Since")); ok && versionTime(ver).After(t) {
		fail(w, http.StatusPreconditionFailed, "precondition_failed", "If-Unmodified-Since: the key was written since")
		return
	}
	if inm := r.Header.Get("If-None-Match"); inm != "" {
		if matches(inm, tag) {
			w.WriteHeader(http.StatusNotModified)
			return
		}
	} else if t, ok := parseTime(r.Header.Get("If-Modified-Since")); ok && !versionTime(ver).After(t) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Length", strconv.Itoa(len(v.Str)))
	w.WriteHeader(http.StatusOK)
	if r.Method != http.MethodHead {
		w.Write(v.Str)
	}
}

// ttlOf reads the TTL of a PUT: ?ttl= or the Mqkv-TTL header, a Go
// duration ("30s", "1h") or whole seconds.
func ttlOf(r *http.Request) (time.Duration, error) {
	t := r.URL.Query().Get("ttl")
	if t == "" {
		t = r.Header.Get("Mqkv-TTL")
	}
	if t == "" {
		return 0, nil
	}
	if n, err := strconv.ParseInt(t, 10, 64); err == nil {
		t = strconv.FormatInt(n, 10) + "s"
	}
	d, err := time.ParseDuration(t)
	if err != nil || d < time.Millisecond {
		return 0, errors.New("ttl must be a positive duration (30s, 5m, 1h) or whole seconds")
	}
	return d, nil
}

// condition turns a write's preconditions into the store's: "NX", or a
// version for VER; current reads the key when a precondition needs it.
// ok false: a precondition already failed (answered).
func condition(w http.ResponseWriter, r *http.Request, c *gateway.Client, key []byte) (cond []byte, ver hlc.Timestamp, ok bool) {
	im, inm := r.Header.Get("If-Match"), r.Header.Get("If-None-Match")
	ius, hasIUS := parseTime(r.Header.Get("If-Unmodified-Since"))
	switch {
	case inm == "*" && im == "":
		return []byte("NX"), ver, true
	case inm != "":
		fail(w, http.StatusBadRequest, "bad_request", `a write takes If-None-Match: * (create only) and no other list`)
		return nil, ver, false
	case im == "" && !hasIUS:
		return nil, ver, true
	}
	if im != "" && im != "*" && !strings.Contains(im, ",") {
		// One version: the write is conditional on it, no read needed.
		v, err := hlc.Parse(strings.Trim(strings.TrimPrefix(strings.TrimSpace(im), "W/"), `"`))
		if err != nil {
			fail(w, http.StatusPreconditionFailed, "precondition_failed", "If-Match: not a version this store issued")
			return nil, ver, false
		}
		return []byte("VER"), v, true
	}
	cur, cv := c.Call("", []byte("GET"), key)
	if cur.Kind == resp.ErrorReply {
		storeFail(w, cur)
		return nil, ver, false
	}
	if cur.Null {
		fail(w, http.StatusPreconditionFailed, "precondition_failed", "the key does not exist")
		return nil, ver, false
	}
	if im != "" && !matches(im, etag(cv)) {
		fail(w, http.StatusPreconditionFailed, "precondition_failed", "If-Match: the key holds version "+cv.String())
		return nil, ver, false
	}
	if im == "" && hasIUS && versionTime(cv).After(ius) {
		fail(w, http.StatusPreconditionFailed, "precondition_failed", "If-Unmodified-Since: the key was written since")
		return nil, ver, false
	}
	return []byte("VER"), cv, true
}

// preconditions checks a write against the key's lease and its
// conditional headers: the fencing token it carries, and the store's
// condition (see condition). ok false: answered.
func (s *Server) preconditions(w http.ResponseWriter, r *http.Request, c *gateway.Client, key []byte) (fence string, cond []byte, ver hlc.Timestamp, ok bool) {
	if fence, ok = s.leaseFence(w, r, key); !ok {
		return
	}
	cond, ver, ok = condition(w, r, c, key)
	return
}

func (s *Server) put(w http.ResponseWriter, r *http.Request, c *gateway.Client, key []byte) {
	ttl, err := ttlOf(r)
	if err != nil {
		fail(w, http.StatusBadRequest, "bad_request", err.Error())
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxValue))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			fail(w, http.StatusRequestEntityTooLarge, "payload_too_large", fmt.Sprintf("a value is at most %d bytes", s.cfg.MaxValue))
			return
		}
		fail(w, http.StatusBadRequest, "bad_request", "reading the body: "+err.Error())
		return
	}
	fence, cond, ver, ok := s.preconditions(w, r, c, key)
	if !ok {
		return
	}
	cmd := [][]byte{[]byte("SET"), key, body}
	if cond != nil {
		cmd = append(cmd, cond)
		if string(cond) == "VER" {
			cmd = append(cmd, ver.Append(nil))
		}
	}
	if ttl > 0 {
		cmd = append(cmd, []byte("PX"), strconv.AppendInt(nil, ttl.Milliseconds(), 10))
	}
	v, nv := c.Call(fence, cmd...)
	switch {
	case v.Kind == resp.ErrorReply:
		storeFail(w, v)
	case v.Kind == resp.Integer && v.Int == -1:
		fail(w, http.StatusPreconditionFailed, "precondition_failed", "the key's version is not the one the request names (or it exists, for If-None-Match: *)")
	default:
		w.Header().Set("ETag", etag(nv))
		w.Header().Set("Mqkv-Version", nv.String())
		if string(cond) == "NX" {
			w.WriteHeader(http.StatusCreated)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

func (s *Server) delete(w http.ResponseWriter, r *http.Request, c *gateway.Client, key []byte) {
	if r.Header.Get("If-None-Match") != "" {
		fail(w, http.StatusBadRequest, "bad_request", "a DELETE takes If-Match or If-Unmodified-Since")
		return
	}
	fence, cond, ver, ok := s.preconditions(w, r, c, key)
	if !ok {
		return
	}
	cmd := [][]byte{[]byte("DEL"), key}
	if cond != nil {
		cmd = append(cmd, []byte("VER"), ver.Append(nil))
	}
	v, _ := c.Call(fence, cmd...)
	switch {
	case v.Kind == resp.ErrorReply:
		storeFail(w, v)
	case v.Int == -1:
		fail(w, http.StatusPreconditionFailed, "precondition_failed", "the key's version is not the one the request names")
	case v.Int == 0:
		fail(w, http.StatusNotFound, "not_found", "no such key")
	default:
		if s.cfg.Leases != nil {
			// The key's fence went with it; so does its lease (a lease
			// on a deleted blob ends with it).
			if err := s.cfg.Leases.Drop(r.Context(), key); err != nil {
				s.log.Warn("http: the lease record of a deleted key stays", "error", err)
			}
		}
		w.WriteHeader(http.StatusNoContent)
	}
}

// listReply is GET /v1/kv/'s body.
type listReply struct {
	Keys     []string `json:"keys"`
	Continue string   `json:"continue,omitempty"`
}

// list serves GET /v1/kv/?prefix=p or ?match=glob, with limit (default
// 100, at most 10,000) and continue (the token of the page before).
func (s *Server) list(w http.ResponseWriter, r *http.Request, c *gateway.Client) {
	q := r.URL.Query()
	pattern := q.Get("match")
	if p := q.Get("prefix"); p != "" {
		if pattern != "" {
			fail(w, http.StatusBadRequest, "bad_request", "give prefix or match, not both")
			return
		}
		pattern = glob.Escape(p) + "*"
	}
	if pattern == "" {
		pattern = "*"
	}
	cmd := [][]byte{[]byte("SCAN"), []byte(pattern)}
	if tok := q.Get("continue"); tok != "" {
		cmd = append(cmd, []byte(tok))
	}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 1 {
			fail(w, http.StatusBadRequest, "bad_request", "limit must be a positive integer")
			return
		}
		cmd = append(cmd, []byte("COUNT"), []byte(strconv.Itoa(n)))
	}
	v, _ := c.Call("", cmd...)
	if v.Kind == resp.ErrorReply {
		if strings.Contains(string(v.Str), "continuation token") {
			fail(w, http.StatusBadRequest, "bad_continue", string(v.Str))
			return
		}
		storeFail(w, v)
		return
	}
	out := listReply{Keys: []string{}}
	if len(v.Elems) > 0 {
		for _, k := range v.Elems[0].Elems {
			out.Keys = append(out.Keys, string(k.Str))
		}
	}
	if len(v.Elems) == 2 {
		out.Continue = string(v.Elems[1].Str)
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(out)
}
