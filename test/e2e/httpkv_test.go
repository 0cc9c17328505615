package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/auth"
	"github.com/mqkv/mqkv/internal/server"
)

// withHTTP turns the HTTP endpoint on.
func withHTTP() serverOption { return func(c *server.Config) { c.HTTPListen = "127.0.0.1:0" } }

type httpKV struct {
	t          *testing.T
	base       string
	user, pass string
}

func newHTTPKV(t *testing.T, s *testServer) *httpKV {
	return &httpKV{t: t, base: "http://" + s.HTTPAddr() + "/v1/kv/"}
}

// do sends a request for key (path-escaped) with headers, and returns the
// status, headers and body.
func (h *httpKV) do(method, key, body string, headers ...string) (int, http.Header, string) {
	h.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, h.base+url.PathEscape(key), rd)
	if err != nil {
		h.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	if h.user != "" {
		req.SetBasicAuth(h.user, h.pass)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		h.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// errorCode reads the JSON error body's code.
func errorCode(t *testing.T, body string) string {
	t.Helper()
	var e struct {
		Error struct{ Code, Message string }
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Code == "" {
		t.Fatalf("not a JSON error body: %q (%v)", body, err)
	}
	return e.Error.Code
}

// Values as resources with their versions as ETags, and every
// precondition HTTP and Azure Blob give.
func TestHTTPConditionalRequests(t *testing.T) {
	s := startServer(t, inMemory(), withHTTP())
	h := newHTTPKV(t, s)
	k := uniqueKey(t) // holds '/', sent as %2F
	if st, _, body := h.do("GET", k, ""); st != 404 || errorCode(t, body) != "not_found" {
		t.Fatalf("GET of a missing key: %d %s", st, body)
	}
	// If-None-Match: * creates only.
	st, hd, _ := h.do("PUT", k, "v1", "If-None-Match", "*")
	if st != 201 || hd.Get("ETag") == "" {
		t.Fatalf("create: %d %v", st, hd)
	}
	tag1 := hd.Get("ETag")
	if st, _, body := h.do("PUT", k, "again", "If-None-Match", "*"); st != 412 || errorCode(t, body) != "precondition_failed" {
		t.Fatalf("create of an existing key: %d %s", st, body)
	}
	st, hd, body := h.do("GET", k, "")
	if st != 200 || body != "v1" || hd.Get("ETag") != tag1 || hd.Get("Last-Modified") == "" {
		t.Fatalf("GET: %d %q %v", st, body, hd)
	}
	if st, hd, body := h.do("HEAD", k, ""); st != 200 || body != "" || hd.Get("Content-Length") != "2" {
		t.Fatalf("HEAD: %d %q %v", st, body, hd)
	}
	// Conditional reads.
	if st, _, _ := h.do("GET", k, "", "If-None-Match", tag1); st != 304 {
		t.Fatalf("GET If-None-Match the current ETag: %d", st)
	}
	if st, _, _ := h.do("GET", k, "", "If-Match", `"000000000000001:00000:x"`); st != 412 {
		t.Fatalf("GET If-Match another ETag: %d", st)
	}
	future := time.Now().Add(time.Hour).UTC().Format(http.TimeFormat)
	past := time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat)
	if st, _, _ := h.do("GET", k, "", "If-Modified-Since", future); st != 304 {
		t.Fatalf("GET If-Modified-Since later: %d", st)
	}
	if st, _, _ := h.do("GET", k, "", "If-Modified-Since", past); st != 200 {
		t.Fatalf("GET If-Modified-Since earlier: %d", st)
	}
	if st, _, _ := h.do("GET", k, "", "If-Unmodified-Since", past); st != 412 {
		t.Fatalf("GET If-Unmodified-Since earlier: %d", st)
	}
	// If-Match: the write applies with the current ETag, not a stale one.
	st, hd, _ = h.do("PUT", k, "v2", "If-Match", tag1)
	if st != 204 || hd.Get("ETag") == tag1 {
		t.Fatalf("PUT If-Match the current ETag: %d %v", st, hd)
	}
	tag2 := hd.Get("ETag")
	if st, _, body := h.do("PUT", k, "v3", "If-Match", tag1); st != 412 || errorCode(t, body) != "precondition_failed" {
		t.Fatalf("PUT If-Match a stale ETag: %d %s", st, body)
	}
	if st, _, _ := h.do("PUT", k, "v3", "If-Match", "*"); st != 204 {
		t.Fatalf("PUT If-Match * on an existing key: %d", st)
	}
	if st, _, _ := h.do("PUT", k+"-none", "x", "If-Match", "*"); st != 412 {
		t.Fatalf("PUT If-Match * on a missing key: %d", st)
	}
	if st, _, _ := h.do("PUT", k, "v4", "If-Unmodified-Since", past); st != 412 {
		t.Fatalf("PUT If-Unmodified-Since earlier: %d", st)
	}
	if st, _, _ := h.do("PUT", k, "v4", "If-Unmodified-Since", future); st != 204 {
		t.Fatalf("PUT If-Unmodified-Since later: %d", st)
	}
	// DELETE with a stale ETag fails, with the current one succeeds.
	if st, _, _ := h.do("DELETE", k, "", "If-Match", tag2); st != 412 {
		t.Fatalf("DELETE If-Match a stale ETag: %d", st)
	}
	_, hd, _ = h.do("HEAD", k, "")
	if st, _, _ := h.do("DELETE", k, "", "If-Match", hd.Get("ETag")); st != 204 {
		t.Fatalf("DELETE If-Match the current ETag: %d", st)
	}
	if st, _, _ := h.do("DELETE", k, ""); st != 404 {
		t.Fatalf("DELETE of a missing key: %d", st)
	}
	// TTL by query or header.
	req, _ := http.NewRequest("PUT", h.base+url.PathEscape(k)+"?ttl=300ms", strings.NewReader("short"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 204 {
		t.Fatalf("PUT ?ttl=300ms: %v %v", resp, err)
	}
	resp.Body.Close()
	eventually(t, "a 300 ms key to expire", func() bool { st, _, _ := h.do("GET", k, ""); return st == 404 })
	if st, _, body := h.do("PUT", k, "x", "Mqkv-TTL", "soon"); st != 400 || errorCode(t, body) != "bad_request" {
		t.Fatalf("PUT with a bad TTL: %d %s", st, body)
	}
	if st, _, body := h.do("POST", k, "x"); st != 405 || errorCode(t, body) != "method_not_allowed" {
		t.Fatalf("POST on a key: %d %s", st, body)
	}
}

// Listing by prefix or glob, a page at a time.
func TestHTTPList(t *testing.T) {
	s := startServer(t, inMemory(), withHTTP())
	h := newHTTPKV(t, s)
	prefix := uniqueKey(t) + "/"
	var want []string
	for i := range 25 {
		k := fmt.Sprintf("%s%02d", prefix, i)
		want = append(want, k)
		if st, _, _ := h.do("PUT", k, "x"); st != 204 {
			t.Fatalf("PUT %s: %d", k, st)
		}
	}
	var got []string
	next := ""
	for pages := 0; ; pages++ {
		u := "http://" + s.HTTPAddr() + "/v1/kv/?limit=10&prefix=" + url.QueryEscape(prefix)
		if next != "" {
			u += "&continue=" + url.QueryEscape(next)
		}
		resp, err := http.Get(u)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("list: %v %v", resp, err)
		}
		var page struct {
			Keys     []string
			Continue string
		}
		json.NewDecoder(resp.Body).Decode(&page)
		resp.Body.Close()
		got = append(got, page.Keys...)
		if page.Continue == "" {
			break
		}
		next = page.Continue
		if pages > 10 {
			t.Fatal("listing never ends")
		}
	}
	if !slices.Equal(got, want) {
		t.Fatalf("listed %v, want %v", got, want)
	}
	resp, err := http.Get("http://" + s.HTTPAddr() + "/v1/kv/?continue=bogus")
	if err != nil || resp.StatusCode != 400 {
		t.Fatalf("a bogus continue: %v %v", resp, err)
	}
	resp.Body.Close()
}

// HTTP Basic against the password file; the policy per key; a write
// through HTTP reaches MQTT readers and observers.
func TestHTTPAuthPolicyAndMQTT(t *testing.T) {
	dir := t.TempDir()
	pw := filepath.Join(dir, "passwords")
	auth.SetPassword(pw, "alice", []byte("alice-secret"))
	pol := filepath.Join(dir, "policy.yaml")
	os.WriteFile(pol, []byte(`apiVersion: mqttbroker.iotoperations.azure.com/v1
kind: BrokerAuthorization
spec:
  authorizationPolicies:
    rules:
      - principals:
          usernames: ["alice"]
        brokerResources:
          - method: Connect
          - method: Publish
            topics: ["#"]
          - method: Subscribe
            topics: ["#"]
        stateStoreResources:
          - method: ReadWrite
            keyType: Pattern
            keys: ["alice/*"]
`), 0o600)
	s := startServer(t, inMemory(), withHTTP(), func(c *server.Config) { c.PasswordFile, c.PolicyFile = pw, pol })
	h := newHTTPKV(t, s)
	st, hd, body := h.do("GET", "alice/x", "")
	if st != 401 || hd.Get("WWW-Authenticate") == "" || errorCode(t, body) != "unauthorized" {
		t.Fatalf("without credentials: %d %v %s", st, hd, body)
	}
	h.user, h.pass = "alice", "wrong"
	if st, _, _ := h.do("GET", "alice/x", ""); st != 401 {
		t.Fatalf("a wrong password: %d", st)
	}
	h.pass = "alice-secret"
	if st, _, _ := h.do("PUT", "alice/x", "from-http"); st != 204 {
		t.Fatalf("alice's own key: %d", st)
	}
	if st, _, body := h.do("PUT", "bob/x", "no"); st != 403 || errorCode(t, body) != "forbidden" {
		t.Fatalf("another's key: %d %s", st, body)
	}
	// The MQTT side, as alice.
	mc := newSDKClientAs(t, s, "alice", "alice-secret")
	ctx := ctxFor(t, 30*time.Second)
	notes, done := mc.store.Notify("alice/x")
	defer done()
	if err := mc.store.KeyNotify(ctx, "alice/x"); err != nil {
		t.Fatal(err)
	}
	if r, err := mc.store.Get(ctx, "alice/x"); err != nil || r.Value != "from-http" {
		t.Fatalf("MQTT GET of an HTTP write: %+v %v", r, err)
	}
	if st, _, _ := h.do("PUT", "alice/x", "again"); st != 204 {
		t.Fatalf("PUT: %d", st)
	}
	if n := recv(t, notes, 10*time.Second); n.Value != "again" {
		t.Fatalf("notification %+v", n)
	}
	// The ETag is the version the SDK sees.
	r, _ := mc.store.Get(ctx, "alice/x")
	if _, hd, _ := h.do("HEAD", "alice/x", ""); hd.Get("ETag") != `"`+r.Version.String()+`"` {
		t.Fatalf("ETag %s, SDK version %v", hd.Get("ETag"), r.Version)
	}
}
