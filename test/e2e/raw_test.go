package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/statestore"
)

func TestRawRepliesAreByteExact(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-exact", rawOpts{cleanStart: true})
	k := uniqueKey(t)
	steps := []struct {
		args   []string
		want   string
		wantTS bool
	}{
		{[]string{"GET", k}, "$-1\r\n", false},
		{[]string{"SET", k, "hello"}, "+OK\r\n", true},
		{[]string{"GET", k}, "$5\r\nhello\r\n", true},
		{[]string{"SET", k, "x", "NX"}, ":-1\r\n", true},
		{[]string{"SET", k, "x", "NEX"}, ":-1\r\n", true},
		{[]string{"SET", k, "hello", "NEX"}, "+OK\r\n", true},
		{[]string{"VDEL", k, "nope"}, ":-1\r\n", false},
		{[]string{"VDEL", k, "hello"}, ":1\r\n", true},
		{[]string{"VDEL", k, "hello"}, ":0\r\n", false},
		{[]string{"SET", k, ""}, "+OK\r\n", true},
		{[]string{"GET", k}, "$0\r\n\r\n", true},
		{[]string{"DEL", k}, ":1\r\n", true},
		{[]string{"DEL", k}, ":0\r\n", false},
		{[]string{"KEYNOTIFY", k}, "+OK\r\n", false},
		{[]string{"KEYNOTIFY", k}, "+OK\r\n", false}, // idempotent
		{[]string{"KEYNOTIFY", k, "STOP"}, "+OK\r\n", false},
		{[]string{"KEYNOTIFY", k, "STOP"}, ":0\r\n", false},
	}
	for i, st := range steps {
		p := c.call(st.args...)
		expectPayload(t, p, st.want)
		ts, ok := userProp(p, "__ts")
		if ok != st.wantTS {
			t.Fatalf("step %d %q: __ts present = %v, want %v", i, st.args, ok, st.wantTS)
		}
		if ok {
			if _, err := hlc.Parse(ts); err != nil || len(strings.Split(ts, ":")[0]) != 15 || len(strings.Split(ts, ":")[1]) < 5 {
				t.Fatalf("step %d: __ts %q is not in %%015d:%%05d:%%s form", i, ts)
			}
		}
	}
}

func TestRawVersionsIncreaseAndExceedRequestTimestamp(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-versions", rawOpts{cleanStart: true})
	k := uniqueKey(t)
	// A client clock 30 s ahead (within the allowed skew).
	ahead := hlc.Timestamp{Wall: time.Now().Add(30 * time.Second).UnixMilli(), Counter: 3, Node: "fast-client"}
	var prev hlc.Timestamp
	for i := 0; i < 5; i++ {
		reqTS := ahead.String()
		p := c.do(req{args: []string{"SET", k, "v"}, ts: &reqTS})
		expectPayload(t, p, "+OK\r\n")
		tsStr, _ := userProp(p, "__ts")
		v, err := hlc.Parse(tsStr)
		if err != nil {
			t.Fatal(err)
		}
		if v.Compare(ahead) <= 0 || v.Compare(prev) <= 0 {
			t.Fatalf("version %v not above request %v and previous %v", v, ahead, prev)
		}
		get := c.call("GET", k)
		if got, _ := userProp(get, "__ts"); got != tsStr {
			t.Fatalf("GET version %q, SET returned %q", got, tsStr)
		}
		prev = v
	}
}

func TestRawErrors(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-errors", rawOpts{cleanStart: true})
	k := uniqueKey(t)
	future := hlc.Timestamp{Wall: time.Now().AddDate(10, 0, 0).UnixMilli(), Node: "c"}.String()
	cases := []struct {
		name string
		r    req
		want string
	}{
		{"unknown command", req{args: []string{"FLUSHALL"}, ts: now()}, "-ERR unknown command\r\n"},
		{"GET arity", req{args: []string{"GET"}, ts: now()}, "-ERR wrong number of arguments\r\n"},
		{"GET arity 3", req{args: []string{"GET", k, "x"}, ts: now()}, "-ERR wrong number of arguments\r\n"},
		{"SET arity", req{args: []string{"SET", k}, ts: now()}, "-ERR wrong number of arguments\r\n"},
		{"DEL arity", req{args: []string{"DEL"}, ts: now()}, "-ERR wrong number of arguments\r\n"},
		{"VDEL arity", req{args: []string{"VDEL", k}, ts: now()}, "-ERR wrong number of arguments\r\n"},
		{"KEYNOTIFY arity", req{args: []string{"KEYNOTIFY"}, ts: now()}, "-ERR wrong number of arguments\r\n"},
		{"KEYNOTIFY bad option", req{args: []string{"KEYNOTIFY", k, "GO"}, ts: now()}, "-ERR syntax error\r\n"},
		{"SET unknown option", req{args: []string{"SET", k, "v", "EX"}, ts: now()}, "-ERR syntax error\r\n"},
		{"SET NX and NEX", req{args: []string{"SET", k, "v", "NX", "NEX"}, ts: now()}, "-ERR syntax error\r\n"},
		{"SET PX without value", req{args: []string{"SET", k, "v", "PX"}, ts: now()}, "-ERR syntax error\r\n"},
		{"SET PX twice", req{args: []string{"SET", k, "v", "PX", "10", "PX", "10"}, ts: now()}, "-ERR syntax error\r\n"},
		{"not RESP", req{payload: []byte("GET k"), ts: now()}, "-ERR syntax error\r\n"},
		{"huge count", req{payload: []byte("*2147483647\r\n$3\r\nGET\r\n"), ts: now()}, "-ERR syntax error\r\n"},
		{"negative length", req{payload: []byte("*2\r\n$3\r\nGET\r\n$-5\r\nk\r\n"), ts: now()}, "-ERR syntax error\r\n"},
		{"empty key GET", req{args: []string{"GET", ""}, ts: now()}, "-ERR the key length is zero\r\n"},
		{"empty key SET", req{args: []string{"SET", "", "v"}, ts: now()}, "-ERR the key length is zero\r\n"},
		{"empty key DEL", req{args: []string{"DEL", ""}, ts: now()}, "-ERR the key length is zero\r\n"},
		{"empty key KEYNOTIFY", req{args: []string{"KEYNOTIFY", ""}, ts: now()}, "-ERR the key length is zero\r\n"},
		{"missing timestamp", req{args: []string{"SET", k, "v"}}, "-ERR missing timestamp\r\n"},
		{"missing timestamp DEL", req{args: []string{"DEL", k}}, "-ERR missing timestamp\r\n"},
		{"malformed timestamp", req{args: []string{"SET", k, "v"}, ts: ptr("yesterday")}, "-ERR malformed timestamp\r\n"},
		{"malformed timestamp parts", req{args: []string{"SET", k, "v"}, ts: ptr("1:2")}, "-ERR malformed timestamp\r\n"},
		{"malformed timestamp empty", req{args: []string{"SET", k, "v"}, ts: ptr("")}, "-ERR malformed timestamp\r\n"},
		{"malformed timestamp GET", req{args: []string{"GET", k}, ts: ptr("x:y:z")}, "-ERR malformed timestamp\r\n"},
		{"timestamp ten years ahead", req{args: []string{"SET", k, "v"}, ts: &future}, "-ERR the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized\r\n"},
		{"fencing token ten years ahead", req{args: []string{"SET", k, "v"}, ts: now(), ft: &future}, "-ERR the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized\r\n"},
		{"malformed fencing token", req{args: []string{"SET", k, "v"}, ts: now(), ft: ptr("not-a-token")}, "-ERR malformed timestamp\r\n"},
		{"QoS 0", req{args: []string{"GET", k}, ts: now(), qos0: true}, "-ERR requests must be published with QoS 1\r\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			expectPayload(t, c.do(tc.r), tc.want)
		})
	}
	// None of that wrote anything.
	expectPayload(t, c.call("GET", k), "$-1\r\n")
}

func TestRawPX(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-px", rawOpts{cleanStart: true})
	for _, tc := range []struct {
		px   string
		want string
	}{
		{"1000", "+OK\r\n"},
		{"1.5", "+OK\r\n"},
		{"0", "-ERR syntax error\r\n"},
		{"-1", "-ERR syntax error\r\n"},
		{"abc", "-ERR syntax error\r\n"},
		{"1e3", "-ERR syntax error\r\n"},
		{"", "-ERR syntax error\r\n"},
		{"99999999999999999999999", "-ERR syntax error\r\n"},
	} {
		k := uniqueKey(t)
		expectPayload(t, c.call("SET", k, "v", "PX", tc.px), tc.want)
	}
	// Options in any order after the value.
	k := uniqueKey(t)
	expectPayload(t, c.call("SET", k, "v", "PX", "60000", "NX"), "+OK\r\n")
	expectPayload(t, c.call("SET", k, "w", "NX", "PX", "60000"), ":-1\r\n")
	expectPayload(t, c.call("SET", k, "v", "NEX", "PX", "60000"), "+OK\r\n")
	// A short PX really expires.
	k = uniqueKey(t)
	expectPayload(t, c.call("SET", k, "v", "PX", "1.5"), "+OK\r\n")
	eventuallyWithin(t, 3*time.Second, "the PX 1.5 key's expiry", func() bool { return string(c.call("GET", k).Payload) == "$-1\r\n" })
}

func TestRawLargeKeyAndValue(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-large", rawOpts{cleanStart: true})
	key := strings.Repeat("k", 6500)
	val := strings.Repeat("v", 65000)
	expectPayload(t, c.call("SET", key, val), "+OK\r\n")
	expectPayload(t, c.call("GET", key), "$65000\r\n"+val+"\r\n")
}

func TestRawBinaryKeysAndValues(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-binary", rawOpts{cleanStart: true})
	key := "\x00\r\n\xff key"
	val := "\r\n$3\r\n\x00"
	expectPayload(t, c.call("SET", key, val), "+OK\r\n")
	expectPayload(t, c.call("GET", key), "$7\r\n"+val+"\r\n")
}

func TestRawFencing(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-fence", rawOpts{cleanStart: true})
	k := uniqueKey(t)
	low := hlc.Timestamp{Wall: 1, Node: "x"}.String()
	epoch := "000000000000000:00000:d1d7e6a2-1111-4d5e-9a8b-000000000000" // .NET's epoch-0 token
	high := hlc.Timestamp{Wall: time.Now().UnixMilli(), Node: "x"}.String()
	expectPayload(t, c.do(req{args: []string{"SET", k, "v"}, ts: now(), ft: &high}), "+OK\r\n")
	for _, args := range [][]string{{"SET", k, "w"}, {"DEL", k}, {"VDEL", k, "v"}} {
		expectPayload(t, c.do(req{args: args, ts: now()}), "-ERR a fencing token is required for this request\r\n")
		expectPayload(t, c.do(req{args: args, ts: now(), ft: &low}), "-ERR the request fencing token is a lower version than the fencing token protecting the resource\r\n")
		expectPayload(t, c.do(req{args: args, ts: now(), ft: &epoch}), "-ERR the request fencing token is a lower version than the fencing token protecting the resource\r\n")
	}
	expectPayload(t, c.call("GET", k), "$1\r\nv\r\n") // GET needs no token
	expectPayload(t, c.do(req{args: []string{"VDEL", k, "v"}, ts: now(), ft: &high}), ":1\r\n")
}

func TestRawRequestWithoutResponseTopicIsDropped(t *testing.T) {
	s := startServer(t)
	c := dialRaw(t, s, "raw-noresp", rawOpts{cleanStart: true})
	before := s.Service().Counters.NoResponseTopic.Load()
	c.send(req{args: []string{"SET", "k", "v"}, ts: now(), noResponseTopic: true})
	// Requests are handled in order per connection: once this GET is
	// answered, the SET before it has been seen (and dropped).
	expectPayload(t, c.call("GET", "k"), "$-1\r\n")
	if got := s.Service().Counters.NoResponseTopic.Load(); got != before+1 {
		t.Fatalf("dropped-request counter %d, want %d", got, before+1)
	}
}

func TestRawForbiddenResponseTopicDisconnects(t *testing.T) {
	for _, topic := range []string{statestore.RequestTopic, statestore.NotifyPrefix + "/x", "a/+/b"} {
		s := startServer(t, inMemory())
		c := dialRaw(t, s, "raw-forbidden", rawOpts{cleanStart: true})
		c.send(req{args: []string{"GET", "k"}, ts: now(), respTopc: topic, disconnects: true})
		select {
		case d := <-c.disc:
			if d.ReasonCode != 0x90 {
				t.Fatalf("%s: DISCONNECT reason 0x%02x, want 0x90", topic, d.ReasonCode)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: not disconnected", topic)
		}
	}
}
