package statestore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/store"
)

func TestParsePX(t *testing.T) {
	cases := []struct {
		in string
		ms int64
		ok bool
	}{
		{"1000", 1000, true},
		{"1", 1, true},
		{"1.5", 2, true},
		{"1.0", 1, true},
		{"0.1", 1, true},
		{"0.000", 0, false},
		{"0", 0, false},
		{"-1", 0, false},
		{"abc", 0, false},
		{"1e3", 0, false},
		{"", 0, false},
		{".5", 0, false},
		{"5.", 0, false},
		{"1.2.3", 0, false},
		{" 5", 0, false},
		{"+5", 0, false},
		{"99999999999999999999", 0, false},
	}
	for _, c := range cases {
		ms, ok := parsePX([]byte(c.in))
		if ok != c.ok || (ok && ms != c.ms) {
			t.Errorf("parsePX(%q) = %d, %v; want %d, %v", c.in, ms, ok, c.ms, c.ok)
		}
	}
}

func TestForbiddenResponseTopic(t *testing.T) {
	for topic, forbidden := range map[string]bool{
		RequestTopic:                           true,
		NotifyPrefix:                           true,
		NotifyPrefix + "/41/command/notify/42": true,
		"clients/a/b/+":                        true,
		"clients/a/#":                          true,
		"clients/4142/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response":        false,
		"clients/ab/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke":                   false,
		"clients/ab/services/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response": false,
	} {
		if got := ForbiddenResponseTopic(topic); got != forbidden {
			t.Errorf("ForbiddenResponseTopic(%q) = %v", topic, got)
		}
	}
}

func TestNotifyTopicIsUpperHex(t *testing.T) {
	got := NotifyTopic("client-id1", []byte("SOMEKEY\x00\xff"))
	want := "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/636C69656E742D696431/command/notify/534F4D454B455900FF"
	if got != want {
		t.Fatalf("NotifyTopic = %q, want %q", got, want)
	}
}

func TestEqualFold(t *testing.T) {
	for _, c := range []struct {
		arg, word string
		eq        bool
	}{{"SET", "SET", true}, {"set", "SET", true}, {"SeT", "SET", true}, {"SETX", "SET", false}, {"SE", "SET", false}, {"S\xc5T", "SET", false}} {
		if got := equalFold([]byte(c.arg), c.word); got != c.eq {
			t.Errorf("equalFold(%q, %q) = %v", c.arg, c.word, got)
		}
	}
}

func TestRegistry(t *testing.T) {
	var active atomic.Int64
	r := newRegistry(&active)
	add := func(id string, conn uint64, key string, max int) bool {
		return r.add(id, conn, nil, nil, []byte(key), nil, regFrom{}, max)
	}
	count := func(key string) int { return len(r.lookup([]byte(key), hlc.Timestamp{}, nil)) }
	add("a", 1, "k1", 0)
	add("a", 1, "k1", 0) // idempotent
	add("a", 1, "k2", 0)
	add("b", 7, "k1", 0)
	if n := count("k1"); n != 2 {
		t.Fatalf("k1 observers = %d", n)
	}
	if active.Load() != 3 {
		t.Fatalf("active = %d", active.Load())
	}
	if !r.remove("a", 1, []byte("k1"), false) || r.remove("a", 1, []byte("k1"), false) {
		t.Fatal("remove must report whether a registration existed")
	}
	if r.remove("b", 8, []byte("k1"), false) {
		t.Fatal("another connection of b removed b's registration")
	}
	// A new connection of a replaces the old one's registrations.
	add("a", 2, "k3", 0)
	if count("k2") != 0 {
		t.Fatal("registration of a's old connection survived its new connection")
	}
	// Disconnect of the old connection does not touch the new one.
	r.dropConn("a", 1)
	if count("k3") != 1 {
		t.Fatal("old connection's disconnect dropped the new connection's registration")
	}
	// The limit counts registrations per connection.
	if !add("a", 2, "k4", 2) || add("a", 2, "k5", 2) || !add("a", 2, "k4", 2) {
		t.Fatal("registration limit")
	}
	// And bytes: a connection registers at most maxRegistrationBytes of
	// keys and patterns; what it removes makes room again.
	big := strings.Repeat("x", maxRegistrationBytes/2)
	if !add("c", 3, "1"+big, 0) || add("c", 3, "22"+big, 0) {
		t.Fatal("registration byte budget")
	}
	if !r.remove("c", 3, []byte("1"+big), false) || !add("c", 3, "22"+big, 0) {
		t.Fatal("a removed registration's bytes are not freed")
	}
	r.dropConn("c", 3)
	r.dropConn("a", 2)
	r.dropConn("b", 7)
	if active.Load() != 0 || len(r.byKey) != 0 || len(r.byClient) != 0 {
		t.Fatalf("left behind: active %d, keys %d, clients %d", active.Load(), len(r.byKey), len(r.byClient))
	}
}

func TestRegistryPatterns(t *testing.T) {
	var active atomic.Int64
	r := newRegistry(&active)
	pat := func(p string) *glob.Matcher {
		m, err := glob.Compile([]byte(p))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	r.add("a", 1, nil, nil, []byte("sensors/*"), pat("sensors/*"), regFrom{}, 0)
	r.add("a", 1, nil, nil, []byte("sensors/site-1/*"), pat("sensors/site-1/*"), regFrom{}, 0) // overlaps
	r.add("a", 1, nil, nil, []byte("sensors/site-1/temp"), nil, regFrom{}, 0)
	r.add("b", 2, nil, nil, []byte("*temp"), pat("*temp"), regFrom{}, 0)
	r.add("c", 3, nil, nil, []byte("other/*"), pat("other/*"), regFrom{}, 0)
	// A late registration from a connection older than the current one is
	// ignored.
	r.add("a", 0, nil, nil, []byte("late"), nil, regFrom{}, 0)
	if len(r.lookup([]byte("late"), hlc.Timestamp{}, nil)) != 0 || len(r.lookup([]byte("sensors/x"), hlc.Timestamp{}, nil)) != 1 {
		t.Fatal("an older connection's registration replaced the current one's")
	}
	got := r.lookup([]byte("sensors/site-1/temp"), hlc.Timestamp{}, nil)
	ids := map[string]int{}
	for _, o := range got {
		ids[o.clientID]++
	}
	if len(got) != 2 || ids["a"] != 1 || ids["b"] != 1 {
		t.Fatalf("observers of sensors/site-1/temp: %v (each client once)", ids)
	}
	if n := len(r.lookup([]byte("nothing"), hlc.Timestamp{}, nil)); n != 0 {
		t.Fatalf("%d observers of an unwatched key", n)
	}
	if !r.remove("a", 1, []byte("sensors/*"), true) || r.remove("a", 1, []byte("sensors/*"), false) {
		t.Fatal("pattern and key registrations are distinct")
	}
	r.dropConn("a", 1)
	r.dropConn("b", 2)
	r.dropConn("c", 3)
	if active.Load() != 0 || len(r.byPrefix) != 0 || len(r.lens) != 0 || len(r.byClient) != 0 {
		t.Fatalf("left behind: %d active, %d prefixes, %v lengths", active.Load(), len(r.byPrefix), r.lens)
	}
}

func TestScanTokens(t *testing.T) {
	tk, other := newTokens(), newTokens() // another server, or a restart
	for _, key := range []string{"", "a", "sensors/site-1/temp", "\x00\xff"} {
		for _, readable := range []bool{true, false} {
			tok := tk.encode([]byte(key), readable)
			got, ok := tk.decode(tok)
			if !ok || string(got) != key {
				t.Fatalf("token round trip of %q (readable %v): %q %v", key, readable, got, ok)
			}
			_, ok = other.decode(tok)
			if ok != readable {
				t.Errorf("another server accepts the token for %q (readable %v): %v", key, readable, ok)
			}
		}
	}
	if a, b := tk.encode([]byte("s/1"), false), tk.encode([]byte("secret/device-0000007"), false); len(a) != len(b) {
		t.Errorf("sealed tokens for keys of 3 and 21 bytes differ in length: %d, %d", len(a), len(b))
	}
	raw, _ := tokenEncoding.DecodeString(string(tk.encode([]byte("secret/device-7"), false)))
	if strings.Contains(string(raw), "secret") || strings.Contains(string(raw), "device") {
		t.Fatalf("a sealed token shows the key: %q", raw)
	}
	for _, bad := range []string{"", "=", "AQ", "AQAAAAAA", "!!!!", "AgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"} {
		if _, ok := tk.decode([]byte(bad)); ok {
			t.Errorf("accepted token %q", bad)
		}
	}
}

// A page that ends on a key the client may not read goes on from there,
// but the token does not name it.
func TestScanTokenHidesUnreadableKeys(t *testing.T) {
	pol, err := policy.Parse([]byte(`rules:
  - principals: {clientIds: ["reader"]}
    brokerResources: [{method: Connect}]
    stateStoreResources: [{method: Read, keys: ["public/*"]}]
`))
	if err != nil {
		t.Fatal(err)
	}
	grant := pol.Grant(policy.Principal{ClientID: "reader"})
	rt := &pagedRouter{keys: []string{"private/a", "private/b", "public/1", "secret/x", "secret/y"}, page: 2}
	tr := &replies{}
	s := New(rt, tr, Limits{}, nil)
	var got []string
	var token []byte
	for i := 0; i < 10; i++ {
		args := [][]byte{[]byte("SCAN"), []byte("*")}
		if token != nil {
			args = append(args, token)
		}
		s.Handle(&Request{ClientID: "reader", Grant: grant, ResponseTopic: "r", QoS: 1, Payload: resp.AppendBulks(nil, args...)})
		v, err := resp.ParseReply(tr.last)
		if err != nil || v.Kind != resp.Array || len(v.Elems) < 1 {
			t.Fatalf("reply %q", tr.last)
		}
		for _, k := range v.Elems[0].Elems {
			got = append(got, string(k.Str))
		}
		if len(v.Elems) == 1 {
			break
		}
		token = v.Elems[1].Str
		raw, _ := tokenEncoding.DecodeString(string(token))
		if strings.Contains(string(raw), "private") || strings.Contains(string(raw), "secret") {
			t.Fatalf("token %q names a key the client may not read: %q", token, raw)
		}
	}
	if strings.Join(got, ",") != "public/1" {
		t.Fatalf("scan: %q", got)
	}
}

// pagedRouter serves Ascend from keys, page at a time, as a cluster's
// router stops where a group's page ends.
type pagedRouter struct {
	keys []string
	page int
}

func (r *pagedRouter) Submit(context.Context, replica.Proposal) {}
func (r *pagedRouter) Get(context.Context, []byte) (store.Entry, bool, error) {
	return store.Entry{}, false, nil
}
func (r *pagedRouter) Clock() *hlc.Clock { c, _ := hlc.New("n1", nil); return c }
func (r *pagedRouter) Ascend(_ context.Context, from, prefix []byte, limit int, fn func(*store.Entry) bool) (bool, error) {
	n := 0
	for _, k := range r.keys {
		if k < string(from) || !strings.HasPrefix(k, string(prefix)) {
			continue
		}
		if n == r.page {
			return false, nil
		}
		n++
		if !fn(&store.Entry{Key: []byte(k)}) {
			return false, nil
		}
	}
	return true, nil
}

// replies keeps the last reply.
type replies struct{ last []byte }

func (t *replies) Reply(_ *Request, payload []byte, _ hlc.Timestamp)          { t.last = payload }
func (t *replies) Deliver(string, uint64, string, []byte, hlc.Timestamp) bool { return true }
func (t *replies) Disconnect(string, uint64, byte)                            {}

func FuzzDecodeToken(f *testing.F) {
	tk := newTokens()
	f.Add(tk.encode([]byte("sensors/site-1/temp"), true))
	f.Add(tk.encode([]byte("sensors/site-1/temp"), false))
	f.Add([]byte("garbage"))
	f.Fuzz(func(t *testing.T, tok []byte) {
		key, ok := tk.decode(tok)
		if !ok {
			return
		}
		// A valid plain token is exactly the one mqkv issues for its key;
		// a sealed one only mqkv can make.
		if plain := tk.encode(key, true); string(plain) != string(tok) && !isSealed(tok) {
			t.Fatalf("token %q accepted for %q but mqkv would write %q", tok, key, plain)
		}
	})
}

func isSealed(tok []byte) bool {
	raw, err := tokenEncoding.DecodeString(string(tok))
	return err == nil && len(raw) > 0 && raw[0] == tokenSealed
}

// BenchmarkRequestDeadline: what a locally served request pays for its
// time limit (a deadline read, no timer), against a context.WithTimeout.
func BenchmarkRequestDeadline(b *testing.B) {
	b.Run("deadline", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			ctx := newDeadline(RequestTimeout)
			ctx.Deadline()
			ctx.release()
		}
	})
	b.Run("WithTimeout", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			ctx, cancel := context.WithTimeout(context.Background(), RequestTimeout)
			ctx.Deadline()
			cancel()
		}
	})
}

// TestDeadlineContext: the lazily timed deadline behaves as a context
// with that deadline, before and after something waits on Done.
func TestDeadlineContext(t *testing.T) {
	ctx := newDeadline(20 * time.Millisecond)
	defer ctx.release()
	if d, ok := ctx.Deadline(); !ok || time.Until(d) > 20*time.Millisecond {
		t.Fatalf("deadline %v %v", d, ok)
	}
	if ctx.Err() != nil {
		t.Fatal("expired at once")
	}
	derived, cancel := context.WithCancel(ctx) // waits on Done
	defer cancel()
	select {
	case <-derived.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done never closed")
	}
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) || !errors.Is(derived.Err(), context.DeadlineExceeded) {
		t.Fatalf("errors %v %v", ctx.Err(), derived.Err())
	}
	late := newDeadline(time.Millisecond)
	time.Sleep(2 * time.Millisecond)
	if !errors.Is(late.Err(), context.DeadlineExceeded) {
		t.Fatalf("past its deadline without a timer: %v", late.Err())
	}
}

// TestRequestDeadline: a request's deadline runs from its arrival when
// that was noted, else from the first time it is asked for, and stays
// where it was first set.
func TestRequestDeadline(t *testing.T) {
	arrived := time.Now().Add(-time.Second)
	noted := (&Request{start: arrived}).deadlineIn(10 * time.Second)
	if d, _ := noted.Deadline(); !d.Equal(arrived.Add(10 * time.Second)) {
		t.Fatalf("deadline %v, want the arrival's %v", d, arrived.Add(10*time.Second))
	}
	r := &Request{}
	lazy := r.deadlineIn(10 * time.Second)
	before := time.Now()
	first, _ := lazy.Deadline()
	if first.Before(before.Add(10*time.Second)) || first.After(time.Now().Add(10*time.Second)) {
		t.Fatalf("deadline %v: not 10 s from when it was first asked for", first)
	}
	time.Sleep(2 * time.Millisecond)
	if again, _ := lazy.Deadline(); !again.Equal(first) {
		t.Fatalf("deadline moved from %v to %v", first, again)
	}
	if lazy.Err() != nil {
		t.Fatal("expired at once")
	}
}

// TestUnanchoredPatternsAreBounded: patterns without a literal prefix are
// matched against every change on the apply goroutine, so a connection
// registers at most maxUnanchoredPerConn of them and a node at most
// maxUnanchored; patterns with a prefix are not counted, and what is
// removed (or dropped with its connection) makes room again.
func TestUnanchoredPatternsAreBounded(t *testing.T) {
	var active atomic.Int64
	r := newRegistry(&active)
	add := func(id string, conn uint64, pattern string) bool {
		m, err := glob.Compile([]byte(pattern))
		if err != nil {
			t.Fatal(err)
		}
		return r.add(id, conn, nil, nil, []byte(pattern), m, regFrom{}, 0)
	}
	for i := 0; i < maxUnanchoredPerConn; i++ {
		if !add("a", 1, fmt.Sprintf("*x%d*", i)) {
			t.Fatalf("unanchored pattern %d refused", i)
		}
	}
	if add("a", 1, "*one-more*") {
		t.Fatal("a connection registered more unanchored patterns than its bound")
	}
	if !add("a", 1, "tenant/*/alerts") {
		t.Fatal("a pattern with a prefix counted as unanchored")
	}
	if !r.remove("a", 1, []byte("*x0*"), true) || !add("a", 1, "*one-more*") {
		t.Fatal("a removed pattern made no room")
	}
	for c := 2; c <= maxUnanchored/maxUnanchoredPerConn; c++ {
		for i := 0; i < maxUnanchoredPerConn; i++ {
			add(fmt.Sprint("c", c), uint64(c), fmt.Sprintf("*y%d*", i))
		}
	}
	if add("z", 99, "*z*") {
		t.Fatal("the node registered more unanchored patterns than its bound")
	}
	r.dropConn("a", 1)
	if !add("z", 99, "*z*") {
		t.Fatal("a dropped connection's patterns made no room")
	}
}

// TestSinceRegistrationSkipsWhatTheClientHas: a change at or below a
// KEYNOTIFY ... SINCE version that reaches the node after the
// registration is not notified by it (the client saw it); above it, it
// is. A plain registration notifies whatever comes.
func TestSinceRegistrationSkipsWhatTheClientHas(t *testing.T) {
	r := newRegistry(new(atomic.Int64))
	v := func(wall int64) hlc.Timestamp { return hlc.Timestamp{Wall: wall, Node: "n"} }
	m, _ := glob.Compile([]byte("early/*"))
	r.add("since-key", 1, nil, nil, []byte("early/0"), nil, regFrom{from: v(10), since: true}, 0)
	r.add("since-pattern", 2, nil, nil, []byte("early/*"), m, regFrom{from: v(10), since: true}, 0)
	r.add("plain", 3, nil, nil, []byte("early/*"), m, regFrom{from: v(20)}, 0)
	names := func(key string, at int64) (out []string) {
		for _, o := range r.lookup([]byte(key), v(at), nil) {
			out = append(out, o.clientID)
		}
		slices.Sort(out)
		return out
	}
	if got := names("early/0", 10); !slices.Equal(got, []string{"plain"}) {
		t.Fatalf("the change at the SINCE version notified %v, want plain only", got)
	}
	if got := names("early/0", 9); !slices.Equal(got, []string{"plain"}) {
		t.Fatalf("a change below the SINCE version notified %v, want plain only", got)
	}
	if got := names("early/0", 11); !slices.Equal(got, []string{"plain", "since-key", "since-pattern"}) {
		t.Fatalf("a change above the SINCE version notified %v", got)
	}
}

// oneKeyRouter holds one key; a write to it is applied at once.
type oneKeyRouter struct{ pagedRouter }

func (r *oneKeyRouter) Get(context.Context, []byte) (store.Entry, bool, error) {
	return store.Entry{Key: []byte("k"), Value: []byte("v")}, true, nil
}
func (r *oneKeyRouter) Submit(_ context.Context, p replica.Proposal) {
	p.Done(store.Result{Outcome: store.Applied}, nil)
}

// reusingOrigin is a gateway's origin that takes a request back for its
// next one as soon as it is answered: it clears it.
type reusingOrigin struct{ answers int }

func (o *reusingOrigin) Reply(r *Request, _ []byte, _ hlc.Timestamp) { o.answers++; *r = Request{} }
func (o *reusingOrigin) ReplyBulk(r *Request, _ []byte, _ hlc.Timestamp) {
	o.answers++
	*r = Request{}
}

// TestAnsweredRequestIsNotTouchedAgain: the service is done with a
// gateway's request once it answered it (statestore.Replier), so a
// gateway may use the same request for its next command: the metrics of
// a GET, a SET and a GET of nothing (answered as a bulk value, a write's
// result, and a reply) still name their command and key.
func TestAnsweredRequestIsNotTouchedAgain(t *testing.T) {
	s := New(&oneKeyRouter{}, &replies{}, Limits{}, nil)
	var seen []string
	s.OnReply = func(rep Reply) { seen = append(seen, rep.Command+" "+string(rep.Key)+" "+rep.Result) }
	o := &reusingOrigin{}
	r := new(Request)
	for _, args := range [][]string{{"GET", "k"}, {"SET", "k", "v"}, {"GET"}} {
		*r = Request{ClientID: "c", QoS: 1, Origin: o, StampWrites: true}
		var b [][]byte
		for _, a := range args {
			b = append(b, []byte(a))
		}
		s.Do(r, b)
	}
	want := []string{"GET k ok", "SET k ok", "GET  error"}
	if o.answers != 3 || !slices.Equal(seen, want) {
		t.Fatalf("%d answers, observed %q; want 3, %q", o.answers, seen, want)
	}
}

// storeRouter applies each write to a store at once.
type storeRouter struct {
	pagedRouter
	st         *store.Store
	clock      *hlc.Clock
	submitted  int
	noArith    bool // a cluster some member keeps below the arithmetic ops' protocol
	arithAsked bool
	noValueOps bool          // ... below the value ops' protocol
	remembered *store.Result // if set, every write's result, as a remembered request's
}

func newStoreRouter() *storeRouter {
	c, _ := hlc.New("n1", nil)
	return &storeRouter{st: store.New(store.Limits{}), clock: c}
}

func (r *storeRouter) Clock() *hlc.Clock { return r.clock }
func (r *storeRouter) Submit(_ context.Context, p replica.Proposal) {
	r.submitted++
	if r.remembered != nil {
		p.Done(*r.remembered, nil)
		return
	}
	p.Cmd.Version, p.Cmd.Now = r.clock.Now(), time.Now().UnixMilli()
	res, _ := r.st.Apply(&p.Cmd, nil)
	p.Done(res, nil)
}
func (r *storeRouter) Arithmetic() bool { r.arithAsked = true; return !r.noArith }
func (r *storeRouter) ValueOps() bool   { return !r.noValueOps }

// writeOnly is the grant of client c that may write every key and read
// none.
func writeOnly(t *testing.T) *policy.Grant {
	t.Helper()
	pol, err := policy.Parse([]byte(`rules:
  - principals: {clientIds: ["c"]}
    brokerResources: [{method: Connect}]
    stateStoreResources: [{method: Write, keys: ["*"]}]
`))
	if err != nil {
		t.Fatal(err)
	}
	return pol.Grant(policy.Principal{ClientID: "c"})
}

// service starts a service on r and returns how a test asks it: args
// from client c, with grant (nil: everything), answered with the reply's
// bytes.
func (r *storeRouter) service() func(grant *policy.Grant, args ...string) string {
	rp := &replies{}
	s := New(r, rp, Limits{}, nil)
	return func(grant *policy.Grant, args ...string) string {
		var b [][]byte
		for _, a := range args {
			b = append(b, []byte(a))
		}
		s.Do(&Request{ClientID: "c", QoS: 1, Origin: rp, StampWrites: true, Grant: grant}, b)
		return string(rp.last)
	}
}

// TestValueOps: APPEND, PREPEND, PEXPIRE, PERSIST and SET ... XX, their
// answers, their syntax, the read APPEND's and PREPEND's answer is, and
// the cluster protocol they wait for.
func TestValueOps(t *testing.T) {
	rt := newStoreRouter()
	do := rt.service()
	holds := func(key string) (*store.Entry, bool) { return rt.st.Get([]byte(key), time.Now().UnixMilli()) }
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"APPEND", "a", "xy", "XX"}, "$-1\r\n"},
		{[]string{"APPEND", "a", "xy"}, ":2\r\n"},
		{[]string{"append", "a", "z", "xx"}, ":3\r\n"},
		{[]string{"APPEND", "a"}, "-ERR wrong number of arguments\r\n"},
		{[]string{"APPEND", "a", "z", "NX"}, "-ERR syntax error\r\n"},
		{[]string{"APPEND", "a", "z", "PREFIX", "p"}, "-ERR syntax error\r\n"},
		{[]string{"PREPEND", "p", "a"}, "$-1\r\n"},
		{[]string{"SET", "p", "hdr:b"}, "+OK\r\n"},
		{[]string{"PREPEND", "p", "a", "PREFIX", "hdr:"}, ":6\r\n"},
		{[]string{"PREPEND", "p", "a", "PREFIX", "xyz:"}, ":-1\r\n"},
		{[]string{"PREPEND", "p", "a", "UNLESS", "hdr:"}, ":-1\r\n"},
		{[]string{"SET", "q", "b"}, "+OK\r\n"},
		{[]string{"PREPEND", "q", "a", "unless", "hdr:"}, ":2\r\n"},
		{[]string{"PREPEND", "q", "0"}, ":3\r\n"},
		{[]string{"PREPEND", "p", "a", "XX"}, "-ERR syntax error\r\n"},
		{[]string{"SET", "x", "1", "XX"}, ":-1\r\n"},
		{[]string{"SET", "a", "1", "XX", "NX"}, "-ERR syntax error\r\n"},
		{[]string{"SET", "a", "v", "XX", "PX", "60000"}, "+OK\r\n"},
		{[]string{"PEXPIRE", "x", "100"}, ":0\r\n"},
		{[]string{"PEXPIRE", "p", "0"}, "-ERR syntax error\r\n"},
		{[]string{"PEXPIRE", "p"}, "-ERR wrong number of arguments\r\n"},
		{[]string{"PEXPIRE", "p", "90000"}, ":1\r\n"},
		{[]string{"PERSIST", "a"}, ":1\r\n"},
		{[]string{"PERSIST", "x"}, ":0\r\n"},
	} {
		if got := do(nil, c.args...); got != c.want {
			t.Fatalf("%q: %q, want %q", c.args, got, c.want)
		}
	}
	if e, ok := holds("p"); !ok || string(e.Value) != "hdr:ab" || e.ExpiresAt == 0 {
		t.Fatalf("p holds %+v", e)
	}
	if e, ok := holds("q"); !ok || string(e.Value) != "0ab" {
		t.Fatalf("q holds %+v", e)
	}
	if e, ok := holds("a"); !ok || string(e.Value) != "v" || e.ExpiresAt != 0 {
		t.Fatalf("a holds %+v", e)
	}
	if _, ok := holds("x"); ok {
		t.Fatal("SET XX made a key")
	}

	// APPEND's answer is the length: a client that may write the key but
	// not read it is refused; PEXPIRE is a write only.
	g := writeOnly(t)
	before := rt.submitted
	if got := do(g, "APPEND", "a", "w"); got != "-ERR not authorized\r\n" || rt.submitted != before {
		t.Fatalf("APPEND without read access: %q, %d writes", got, rt.submitted-before)
	}
	if got := do(g, "PEXPIRE", "a", "5000"); got != ":1\r\n" {
		t.Fatalf("PEXPIRE with write access: %q", got)
	}

	// A result remembered for the request's id that is another kind's (a
	// SET's, attach mode): refused, not answered as a length.
	rt.remembered = &store.Result{Outcome: store.Applied, Repeated: true}
	for _, args := range [][]string{{"APPEND", "a", "w"}, {"PREPEND", "a", "w"}} {
		if got := do(nil, args...); !strings.Contains(got, "used by an earlier request of another kind") {
			t.Fatalf("%q answered with a remembered SET's result: %q", args, got)
		}
	}
	rt.remembered = nil

	// In a cluster a member of an earlier release keeps below protocol 6:
	// refused, nothing written.
	rt.noValueOps = true
	before = rt.submitted
	for _, args := range [][]string{{"APPEND", "a", "w"}, {"PREPEND", "a", "w"}, {"PEXPIRE", "a", "5"}, {"PERSIST", "a"}, {"SET", "a", "w", "XX"}} {
		if got := do(nil, args...); !strings.Contains(got, "cluster protocol 6") || rt.submitted != before {
			t.Fatalf("%q below the protocol: %q, %d writes", args, got, rt.submitted-before)
		}
	}
	if got := do(nil, "SET", "a", "w"); got != "+OK\r\n" {
		t.Fatalf("SET below the protocol: %q", got)
	}
}

// TestIncrByAndDecrBy: the arithmetic extensions, their answers, their
// syntax, the read their answer is, and the cluster protocol they wait for.
func TestIncrByAndDecrBy(t *testing.T) {
	rt := newStoreRouter()
	do := rt.service()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"INCRBY", "k", "5"}, ":5\r\n"},
		{[]string{"DECRBY", "k", "7"}, ":-2\r\n"},
		{[]string{"decrby", "k", "-2"}, ":0\r\n"},
		{[]string{"INCRBY", "k", "x"}, "-ERR value is not an integer or out of range\r\n"},
		{[]string{"DECRBY", "k", "-9223372036854775808"}, "-ERR decrement would overflow\r\n"},
		{[]string{"INCRBY", "k"}, "-ERR wrong number of arguments\r\n"},
		{[]string{"INCRBY", "k", "1", "PREFIX", "p"}, "-ERR syntax error\r\n"},
		{[]string{"INCRBY", "k", "1", "UNSIGNED", "UNSIGNED"}, "-ERR syntax error\r\n"},
		{[]string{"INCRBY", "u", "1", "UNSIGNED"}, "$-1\r\n"},
		{[]string{"SET", "u", "hdr7"}, "+OK\r\n"},
		{[]string{"INCRBY", "u", "3", "UNSIGNED", "PREFIX", "hdr"}, "$2\r\n10\r\n"},
		{[]string{"DECRBY", "u", "20", "unsigned", "prefix", "hdr"}, "$1\r\n0\r\n"},
		{[]string{"INCRBY", "u", "18446744073709551615", "UNSIGNED", "PREFIX", "hdr"}, "$20\r\n18446744073709551615\r\n"},
		{[]string{"INCRBY", "u", "1", "UNSIGNED", "PREFIX", "xyz"}, ":-1\r\n"},
		{[]string{"INCRBY", "u", "-1", "UNSIGNED", "PREFIX", "hdr"}, "-ERR value is not an integer or out of range\r\n"},
	} {
		if got := do(nil, c.args...); got != c.want {
			t.Fatalf("%q: %q, want %q", c.args, got, c.want)
		}
	}
	if e, ok := rt.st.Get([]byte("u"), time.Now().UnixMilli()); !ok || string(e.Value) != "hdr18446744073709551615" {
		t.Fatalf("u holds %+v", e)
	}

	// The answer is the number: a client that may write the key but not
	// read it is refused.
	before := rt.submitted
	if got := do(writeOnly(t), "INCRBY", "k", "1"); got != "-ERR not authorized\r\n" || rt.submitted != before {
		t.Fatalf("INCRBY without read access: %q, %d writes", got, rt.submitted-before)
	}

	// A result remembered for the request's id that is not a number (a
	// client used the id of a SET again, attach mode): refused, not
	// answered as one, however short.
	rt.remembered = &store.Result{Outcome: store.Applied, Repeated: true}
	for _, args := range [][]string{{"INCRBY", "k", "1"}, {"INCRBY", "u", "1", "UNSIGNED", "PREFIX", "a-long-prefix"}} {
		if got := do(nil, args...); !strings.Contains(got, "used by an earlier request of another kind") {
			t.Fatalf("%q answered with a remembered SET's result: %q", args, got)
		}
	}
	rt.remembered = nil
	before = rt.submitted

	// In a cluster a member of an earlier release keeps below protocol 5:
	// refused, nothing written.
	rt.noArith, rt.arithAsked = true, false
	if got := do(nil, "INCRBY", "k", "1"); !strings.Contains(got, "cluster protocol 5") || rt.submitted != before || !rt.arithAsked {
		t.Fatalf("INCRBY below the protocol: %q, %d writes", got, rt.submitted-before)
	}
}
