package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/client"
	"github.com/mqkv/mqkv/internal/auth"
	"github.com/mqkv/mqkv/internal/hlc"
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
	return h.send(method, h.base+url.PathEscape(key), body, headers...)
}

// send sends a request to u.
func (h *httpKV) send(method, u, body string, headers ...string) (int, http.Header, string) {
	h.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, u, rd)
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
	if st, _, body := h.send("PUT", h.base+url.PathEscape(k)+"?ttl=300ms", "short"); st != 204 {
		t.Fatalf("PUT ?ttl=300ms: %d %s", st, body)
	}
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
	pw, pol := aliceKeysOnly(t)
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

// sseEvent is one server-sent event.
type sseEvent struct{ id, event, data string }

// sseStream opens a watch and returns its events as they come.
func sseStream(t *testing.T, u string, headers ...string) <-chan sseEvent {
	t.Helper()
	req, _ := http.NewRequest("GET", u, nil)
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	resp, err := http.DefaultClient.Do(req.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("watch %s: %s %s", u, resp.Status, b)
	}
	ch := make(chan sseEvent, 100)
	go func() {
		defer resp.Body.Close()
		defer close(ch)
		sc := bufio.NewScanner(resp.Body)
		var ev sseEvent
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				if ev.event != "" {
					ch <- ev
				}
				ev = sseEvent{}
			case strings.HasPrefix(line, "id: "):
				ev.id = line[4:]
			case strings.HasPrefix(line, "event: "):
				ev.event = line[7:]
			case strings.HasPrefix(line, "data: "):
				ev.data = line[6:]
			}
		}
	}()
	return ch
}

func nextEvent(t *testing.T, ch <-chan sseEvent) sseEvent {
	t.Helper()
	select {
	case ev, ok := <-ch:
		if !ok {
			t.Fatal("the stream ended")
		}
		return ev
	case <-time.After(10 * time.Second):
		t.Fatal("no event within 10 s")
	}
	return sseEvent{}
}

// A watch streams every change of a key (or of keys matching a glob),
// whichever protocol made it, and resumes after its last event id.
func TestHTTPWatch(t *testing.T) {
	s := startServer(t, inMemory(), withHTTP())
	h := newHTTPKV(t, s)
	k := uniqueKey(t)
	base := "http://" + s.HTTPAddr() + "/v1/watch/"
	events := sseStream(t, base+url.PathEscape(k))
	pattern := sseStream(t, base+"?match="+url.QueryEscape(k+"*"))
	h.do("PUT", k, "one")
	sdk := newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	if _, err := sdk.store.Set(ctx, k, "two"); err != nil {
		t.Fatal(err)
	}
	h.do("PUT", k+"-other", "\xff\xfe") // the pattern's only
	h.do("DELETE", k, "")
	var got []sseEvent
	for range 3 {
		got = append(got, nextEvent(t, events))
	}
	if got[0].event != "set" || !strings.Contains(got[0].data, `"value":"one"`) ||
		got[1].event != "set" || !strings.Contains(got[1].data, `"value":"two"`) || got[2].event != "delete" {
		t.Fatalf("events %+v", got)
	}
	for i, ev := range got {
		if ev.id == "" || i > 0 && ev.id <= got[i-1].id {
			t.Fatalf("event ids not increasing versions: %+v", got)
		}
	}
	var pat []sseEvent
	for range 4 {
		pat = append(pat, nextEvent(t, pattern))
	}
	// The key's three changes in order, and the other key's, not UTF-8,
	// somewhere among them: in a cluster the two keys may be in different
	// groups, whose changes come in order per group only (a CI run's
	// cluster pass got the other key's before the SDK's SET, written
	// first).
	var own []sseEvent
	other := 0
	for _, e := range pat {
		switch {
		case strings.Contains(e.data, `"value_base64":"//4="`):
			other++
		case strings.Contains(e.data, `"key":"`+k+`"`):
			own = append(own, e)
		}
	}
	if other != 1 || len(own) != 3 || own[0].id != got[0].id || own[1].id != got[1].id || own[2].id != got[2].id {
		t.Fatalf("pattern events %+v", pat)
	}
	// Resume after the first event: the two after it are replayed.
	again := sseStream(t, base+url.PathEscape(k), "Last-Event-ID", got[0].id)
	if e := nextEvent(t, again); e.id != got[1].id || e.event != "set" {
		t.Fatalf("first resumed event %+v, want %+v", e, got[1])
	}
	if e := nextEvent(t, again); e.id != got[2].id || e.event != "delete" {
		t.Fatalf("second resumed event %+v, want %+v", e, got[2])
	}
	// From before the history's start: "truncated", then live. (A
	// cluster member whose replicas were in place when it started holds
	// its groups' changes from their logs' start, a new cluster's from
	// its first: then the key's whole history is replayed instead.)
	old := sseStream(t, base+url.PathEscape(k)+"?since="+url.QueryEscape("000000000000001:00000:x"))
	if e := nextEvent(t, old); clusterMode() && e.id == got[0].id {
		if e1, e2 := nextEvent(t, old), nextEvent(t, old); e1.id != got[1].id || e2.id != got[2].id {
			t.Fatalf("replayed from the start: %+v, then %+v %+v", e, e1, e2)
		}
	} else if e.event != "truncated" {
		t.Fatalf("resuming from before the history: %+v", e)
	}
	h.do("PUT", k, "three")
	if e := nextEvent(t, old); e.event != "set" || !strings.Contains(e.data, `"three"`) {
		t.Fatalf("live after truncated: %+v", e)
	}
}

// leaseOp posts a lease action for key.
func (h *httpKV) leaseOp(key, action string, headers ...string) (int, http.Header, string) {
	h.t.Helper()
	return h.send("POST", h.base+url.PathEscape(key)+"/lease?action="+action, "", headers...)
}

// Leases as Azure Blob has them: while one is active, writes need its id
// (412 otherwise) and reads stay shared; the key is fenced with the lease
// record's version, so MQTT writers need a fencing token too.
func TestHTTPLeases(t *testing.T) {
	s := startServer(t, inMemory(), withHTTP())
	h := newHTTPKV(t, s)
	k := uniqueKey(t)
	if st, _, body := h.leaseOp(k, "acquire", "Mqkv-Lease-Duration", "15"); st != 404 || errorCode(t, body) != "not_found" {
		t.Fatalf("acquire on a missing key: %d %s", st, body)
	}
	h.do("PUT", k, "v0")
	st, hd, body := h.leaseOp(k, "acquire", "Mqkv-Lease-Duration", "15")
	l1 := hd.Get("Mqkv-Lease-Id")
	if st != 201 || len(l1) != 36 || hd.Get("Mqkv-Fencing-Token") == "" || hd.Get("Mqkv-Lease-State") != "leased" {
		t.Fatalf("acquire: %d %v %s", st, hd, body)
	}
	if st, _, body := h.leaseOp(k, "acquire", "Mqkv-Lease-Duration", "15", "Mqkv-Proposed-Lease-Id", "other"); st != 409 || errorCode(t, body) != "lease_already_present" {
		t.Fatalf("acquire of a leased key: %d %s", st, body)
	}
	if st, _, body := h.leaseOp(k, "acquire", "Mqkv-Lease-Duration", "10"); st != 400 {
		t.Fatalf("acquire for 10 s: %d %s", st, body)
	}
	if st, _, body := h.do("PUT", k, "x"); st != 412 || errorCode(t, body) != "lease_id_missing" {
		t.Fatalf("a write without the lease id: %d %s", st, body)
	}
	if st, _, body := h.do("PUT", k, "x", "Mqkv-Lease-Id", "wrong"); st != 412 || errorCode(t, body) != "lease_id_mismatch" {
		t.Fatalf("a write with another lease id: %d %s", st, body)
	}
	if st, _, body := h.do("DELETE", k, ""); st != 412 {
		t.Fatalf("a delete without the lease id: %d %s", st, body)
	}
	if st, _, _ := h.do("PUT", k, "v1", "Mqkv-Lease-Id", l1); st != 204 {
		t.Fatalf("a write with the lease id: %d", st)
	}
	if st, _, body := h.do("GET", k, ""); st != 200 || body != "v1" {
		t.Fatalf("a read during the lease: %d %q", st, body)
	}
	// The key is fenced: an MQTT write without a fencing token is refused.
	sdk := newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	if _, err := sdk.store.Set(ctx, k, "from-mqtt"); err == nil || !strings.Contains(err.Error(), "fencing token") {
		t.Fatalf("an MQTT write to a leased key without a fencing token: %v", err)
	}
	// Renew, change.
	if st, _, _ := h.leaseOp(k, "renew", "Mqkv-Lease-Id", l1); st != 200 {
		t.Fatalf("renew: %d", st)
	}
	if st, _, body := h.leaseOp(k, "renew", "Mqkv-Lease-Id", "wrong"); st != 409 || errorCode(t, body) != "lease_id_mismatch" {
		t.Fatalf("renew with another id: %d %s", st, body)
	}
	if st, hd, _ := h.leaseOp(k, "change", "Mqkv-Lease-Id", l1, "Mqkv-Proposed-Lease-Id", "l2"); st != 200 || hd.Get("Mqkv-Lease-Id") != "l2" {
		t.Fatalf("change: %d %v", st, hd)
	}
	if st, _, _ := h.do("PUT", k, "x", "Mqkv-Lease-Id", l1); st != 412 {
		t.Fatalf("a write with the old id after change: %d", st)
	}
	// Break with a period: still held (by its id) until it ends, not
	// renewable, then anyone writes.
	st, hd, _ = h.leaseOp(k, "break", "Mqkv-Lease-Break-Period", "1")
	if st != 202 || hd.Get("Mqkv-Lease-Time") != "1" || hd.Get("Mqkv-Lease-State") != "breaking" {
		t.Fatalf("break: %d %v", st, hd)
	}
	if st, _, body := h.leaseOp(k, "renew", "Mqkv-Lease-Id", "l2"); st != 409 || errorCode(t, body) != "lease_is_broken" {
		t.Fatalf("renew while breaking: %d %s", st, body)
	}
	if st, _, _ := h.do("PUT", k, "x"); st != 412 {
		t.Fatalf("a write without the id while breaking: %d", st)
	}
	eventually(t, "the break period to end", func() bool { st, _, _ := h.do("PUT", k, "v2"); return st == 204 })
	if st, _, body := h.do("PUT", k, "v3", "Mqkv-Lease-Id", "l2"); st != 412 || errorCode(t, body) != "lease_not_present" {
		t.Fatalf("a write naming a broken lease: %d %s", st, body)
	}
	// An infinite lease, released.
	st, hd, _ = h.leaseOp(k, "acquire", "Mqkv-Lease-Duration", "-1", "Mqkv-Proposed-Lease-Id", "forever")
	if st != 201 || hd.Get("Mqkv-Lease-Id") != "forever" {
		t.Fatalf("an infinite lease: %d %v", st, hd)
	}
	if st, _, _ := h.do("PUT", k, "x"); st != 412 {
		t.Fatalf("a write without the infinite lease's id: %d", st)
	}
	if st, _, _ := h.leaseOp(k, "release", "Mqkv-Lease-Id", "forever"); st != 200 {
		t.Fatalf("release: %d", st)
	}
	if st, _, _ := h.do("PUT", k, "v4"); st != 204 {
		t.Fatalf("a write after release: %d", st)
	}
	// Deleting a leased key needs the id, and ends the lease with it.
	h.leaseOp(k, "acquire", "Mqkv-Lease-Duration", "60", "Mqkv-Proposed-Lease-Id", "del")
	if st, _, _ := h.do("DELETE", k, "", "Mqkv-Lease-Id", "del"); st != 204 {
		t.Fatalf("delete with the lease id: %d", st)
	}
	if st, _, _ := h.do("PUT", k, "new"); st != 204 {
		t.Fatalf("a write to the key made again: %d", st)
	}
	if _, err := sdk.store.Set(ctx, k, "from-mqtt"); err != nil {
		t.Fatalf("an MQTT write to the key made again: %v", err)
	}
}

// --http-tls serves the endpoint over TLS with the node's certificate.
func TestHTTPOverTLS(t *testing.T) {
	p := newPKI(t)
	s := startServer(t, inMemory(), withHTTP(), func(c *server.Config) {
		c.HTTPTLS, c.TLSCert, c.TLSKey = true, p.serverCert, p.serverKey
	})
	pool := x509.NewCertPool()
	pool.AddCert(p.ca.Cert)
	cl := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "localhost"}}}
	k := url.PathEscape(uniqueKey(t))
	req, _ := http.NewRequest("PUT", "https://"+s.HTTPAddr()+"/v1/kv/"+k, strings.NewReader("secret"))
	resp, err := cl.Do(req)
	if err != nil || resp.StatusCode != 204 {
		t.Fatalf("PUT over TLS: %v %v", resp, err)
	}
	resp.Body.Close()
	resp, err = cl.Get("https://" + s.HTTPAddr() + "/v1/kv/" + k)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != "secret" {
		t.Fatalf("GET over TLS: %d %q", resp.StatusCode, b)
	}
	if resp, err := http.Get("http://" + s.HTTPAddr() + "/v1/kv/" + k); err == nil && resp.StatusCode == 200 {
		t.Fatal("plain HTTP answered on the TLS endpoint")
	}
}

// aliceKeysOnly writes a password file with alice (password
// "alice-secret") and a policy letting her connect, publish, subscribe and
// read and write the keys alice/*, and nobody anything else.
func aliceKeysOnly(t *testing.T) (passwords, policy string) {
	t.Helper()
	dir := t.TempDir()
	passwords = filepath.Join(dir, "passwords")
	if err := auth.SetPassword(passwords, "alice", []byte("alice-secret")); err != nil {
		t.Fatal(err)
	}
	policy = filepath.Join(dir, "policy.yaml")
	os.WriteFile(policy, []byte(`apiVersion: mqttbroker.iotoperations.azure.com/v1
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
	return passwords, policy
}

// TestHTTPWatchOverflow: a watch whose client reads slower than changes
// come holds Config.WatchBuffer of them (64 here, 4096 by default); past
// that its stream gives the changes it kept, in order, then "overflow",
// and ends; resumed after its last event, the client is told "truncated"
// when the history no longer reaches back.
//
// Not in .ci/run's cluster pass: there, under CI's load, the watch's node
// once stopped getting the changes after 31 (its change stream fell
// behind, and a live registration is not told of such a gap): see issue
// 34's note.
func TestHTTPWatchOverflow(t *testing.T) {
	t.Parallel()
	s := startServer(t, inMemory(), withHTTP(), func(c *serverConfig) { c.HTTPWatchBuffer = 64 })
	k := uniqueKey(t)
	// A client that reads nothing yet, its receive buffer bounded (else
	// it grows to 32 MiB). Not below two segments of loopback's 64 KiB:
	// a smaller window, with delayed acknowledgements, carries some
	// 100 KB a second once the client reads.
	tr := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetReadBuffer(256 << 10)
		}
		return c, err
	}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get("http://" + s.HTTPAddr() + "/v1/watch/" + url.PathEscape(k))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("watch: %v %v", resp, err)
	}
	defer resp.Body.Close()
	// More changes than the watch and the sockets hold (the server's send
	// buffer grows to 4 MiB): 2,000 of 16 KiB, some 40 MiB of events.
	value := strings.Repeat("v", 16<<10)
	ctx := ctxFor(t, 60*time.Second)
	c, err := client.Dial(ctx, client.Config{URL: "mqtt://" + s.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const changes = 2000
	began := time.Now()
	for range changes {
		if _, err := c.Set(ctx, []byte(k), []byte(value)); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d SETs in %v", changes, time.Since(began))
	// Now read it all: changes, then "overflow", then the end; a stream
	// silent for 10 s never overflowed (it would hang here otherwise).
	lines := make(chan string, 1024)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 64<<10)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var ids []string
	ended := ""
read:
	for {
		select {
		case line, ok := <-lines:
			if !ok {
				break read
			}
			switch {
			case strings.HasPrefix(line, "id: "):
				ids = append(ids, line[4:])
			case strings.HasPrefix(line, "event: ") && line != "event: set":
				ended = line[7:]
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("the stream went silent after %d changes, without an overflow event", len(ids))
		}
	}
	t.Logf("read %d changes and %q in %v", len(ids), ended, time.Since(began))
	if ended != "overflow" {
		t.Fatalf("the stream ended with %q after %d changes, want an overflow event", ended, len(ids))
	}
	if len(ids) < 64 || len(ids) >= changes {
		t.Fatalf("%d changes before the overflow, want at least the 64 the watch holds and fewer than the %d made", len(ids), changes)
	}
	if !slices.IsSorted(ids) {
		t.Fatal("the changes before the overflow are not in version order")
	}
	// Resumed after its last event: the history (64 changes a partition
	// by default) no longer reaches back, and the client is told so.
	again := sseStream(t, "http://"+s.HTTPAddr()+"/v1/watch/"+url.PathEscape(k), "Last-Event-ID", ids[len(ids)-1])
	if e := nextEvent(t, again); e.event != "truncated" {
		t.Fatalf("resumed after an overflow: %+v, want truncated", e)
	}
}

// TestHTTPWatchEndsOnLostChanges: when changes are lost to the server (a
// cluster member that fell behind a group's event rings: the node calls
// the service's EventsGap, as TestFollowerGoesOnAfterFallingBehindTheRings
// shows), a live watch would miss them without a word; it writes what
// came before, then "truncated", and ends, and a resume is answered
// "truncated" until the loss is bounded.
func TestHTTPWatchEndsOnLostChanges(t *testing.T) {
	t.Parallel()
	skipInCluster(t, "tells the service of a loss by hand")
	s := startServer(t, inMemory(), withHTTP())
	h := newHTTPKV(t, s)
	k := uniqueKey(t)
	base := "http://" + s.HTTPAddr() + "/v1/watch/"
	events := sseStream(t, base+url.PathEscape(k))
	pattern := sseStream(t, base+"?match="+url.QueryEscape(k+"*"))
	h.do("PUT", k, "before")
	first := nextEvent(t, events)
	if first.event != "set" || nextEvent(t, pattern).event != "set" {
		t.Fatalf("first event %+v", first)
	}
	s.Service().EventsGap(hlc.Timestamp{})
	h.do("PUT", k, "after") // not sent: the watch ended with the loss
	for name, ch := range map[string]<-chan sseEvent{"key": events, "pattern": pattern} {
		if e := nextEvent(t, ch); e.event != "truncated" {
			t.Fatalf("%s watch: %+v after the loss, want truncated", name, e)
		}
		select {
		case e, ok := <-ch:
			if ok {
				t.Fatalf("%s watch went on after truncated: %+v", name, e)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s watch did not end after truncated", name)
		}
	}
	if got := s.Service().Counters.EventsLost.Load(); got != 1 {
		t.Fatalf("EventsLost %d, want 1", got)
	}
	again := sseStream(t, base+url.PathEscape(k), "Last-Event-ID", first.id)
	if e := nextEvent(t, again); e.event != "truncated" {
		t.Fatalf("resumed across the loss: %+v, want truncated", e)
	}
}
