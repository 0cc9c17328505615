package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Azure/iot-operations-sdks/go/mqtt"
	sdkstate "github.com/Azure/iot-operations-sdks/go/services/statestore"
	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/admin"
	"github.com/mqkv/mqkv/internal/attach"
	"github.com/mqkv/mqkv/internal/server"
	"github.com/mqkv/mqkv/internal/statestore"
)

// ownBroker marks a test that starts its own mosquitto and attaches to it
// (so not in the cluster and attach passes) and runs beside the others.
func ownBroker(t *testing.T) {
	t.Helper()
	skipInCluster(t, "starts its own broker")
	if attachMode() {
		t.Skip("attaches by itself")
	}
	t.Parallel()
}

// address is a server known by its address only (a broker mqkv attaches to).
type address string

func (a address) Addr() string { return string(a) }

var tsPattern = regexp.MustCompile(`^\d{15}:\d{5}:.+$`)

// TestAttachRepliesAsTheBrokerDoes: one server serves its own MQTT
// clients and, attached, mosquitto's; a raw client of each sends the same
// requests (on keys of the same length) and must get the same replies:
// payload, QoS, content type, user properties (names, order, __stat; __ts
// a timestamp where the broker sends one), correlation data echoed, and
// the same notifications on the same topic (its client id aside).
func TestAttachRepliesAsTheBrokerDoes(t *testing.T) {
	ownBroker(t)
	m := startMosquitto(t)
	s := startServer(t, attachAlso(m.addr))
	awaitAttached(t, s.Server)
	own := dialRaw(t, s, "own-client", rawOpts{cleanStart: true})
	via := dialRaw(t, address(m.addr), "via-client", rawOpts{cleanStart: true})
	for _, rc := range []*rawClient{own, via} {
		if code := rc.subscribe(statestore.NotifyClientPrefix(rc.id)+"#", 1); code != 1 {
			t.Fatalf("%s: SUBACK %#x for its notification topics", rc.id, code)
		}
	}
	steps := [][]string{
		{"PING"},
		{"SET", "K", "v1"},
		{"GET", "K"},
		{"SET", "K", "v2", "NX"},
		{"SET", "K", "v2", "NEX"},
		{"PTTL", "K"},
		{"SET", "K", "v3", "PX", "60000"},
		{"KEYNOTIFY", "K"},
		{"SET", "K", "v4"},
		{"VDEL", "K", "nope"},
		{"DEL", "K"},
		{"GET", "K"},
		{"DEL", "K"},
		{"NOSUCH", "K"},
		{"SET", "K"},
	}
	key := map[*rawClient]string{own: "attach/own", via: "attach/via"} // the same length
	for _, step := range steps {
		var got [2]*paho.Publish
		for i, rc := range []*rawClient{own, via} {
			args := slices.Clone(step)
			if len(args) > 1 {
				args[1] = key[rc]
			}
			got[i] = rc.do(req{args: args, ts: now(), srcID: true})
		}
		samePublish(t, fmt.Sprint(step), got[0], got[1])
	}
	// The SET after KEYNOTIFY and the DEL notified each client.
	for _, want := range []string{"SET", "DELETE"} {
		var got [2]*paho.Publish
		for i, rc := range []*rawClient{own, via} {
			p, ok := rc.nextPublish(5 * time.Second)
			if !ok {
				t.Fatalf("%s: no %s notification", rc.id, want)
			}
			wantTopic := statestore.NotifyTopic(rc.id, []byte(key[rc]))
			if p.Topic != wantTopic {
				t.Fatalf("%s: notification on %q, want %q", rc.id, p.Topic, wantTopic)
			}
			got[i] = p
		}
		if !strings.Contains(string(got[0].Payload), want) {
			t.Fatalf("notification %q, want %s", got[0].Payload, want)
		}
		samePublish(t, "notification "+want, got[0], got[1])
	}
}

// samePublish compares a reply (or notification) from mqkv's broker with
// the one that came through mosquitto.
func samePublish(t *testing.T, what string, own, via *paho.Publish) {
	t.Helper()
	if string(own.Payload) != string(via.Payload) || own.QoS != via.QoS {
		t.Fatalf("%s: own broker %q (QoS %d), through mosquitto %q (QoS %d)", what, own.Payload, own.QoS, via.Payload, via.QoS)
	}
	op, vp := own.Properties, via.Properties
	if (op == nil) != (vp == nil) {
		t.Fatalf("%s: properties %+v and %+v", what, op, vp)
	}
	if op == nil {
		return
	}
	if op.ContentType != vp.ContentType || (op.PayloadFormat == nil) != (vp.PayloadFormat == nil) || (op.MessageExpiry == nil) != (vp.MessageExpiry == nil) {
		t.Fatalf("%s: content type %q/%q, payload format %v/%v, expiry %v/%v", what, op.ContentType, vp.ContentType,
			op.PayloadFormat, vp.PayloadFormat, op.MessageExpiry, vp.MessageExpiry)
	}
	if len(op.CorrelationData) != len(vp.CorrelationData) {
		t.Fatalf("%s: correlation data %x and %x", what, op.CorrelationData, vp.CorrelationData)
	}
	names := func(p *paho.PublishProperties) (out []string) {
		for _, u := range p.User {
			v := u.Value
			if u.Key == "__ts" {
				if !tsPattern.MatchString(v) {
					t.Fatalf("%s: __ts %q is not a timestamp", what, v)
				}
				v = "<ts>"
			}
			out = append(out, u.Key+"="+v)
		}
		return out
	}
	if o, v := names(op), names(vp); !slices.Equal(o, v) {
		t.Fatalf("%s: user properties %v from mqkv's broker, %v through mosquitto", what, o, v)
	}
}

// TestAttachSurvivesBrokerRestart: mosquitto restarts (its sessions kept
// in its persistence file); the attached server reconnects and subscribes
// again, and an SDK client's next requests succeed and find the data.
func TestAttachSurvivesBrokerRestart(t *testing.T) {
	ownBroker(t)
	m := startMosquitto(t, "persistence true", "persistence_location "+t.TempDir()+"/")
	s := startServer(t, attachTo(m.addr))
	awaitAttached(t, s.Server)
	s.host, s.port = hostPort(t, m.addr)
	c := newSDKClient(t, s)
	ctx := ctxFor(t, 60*time.Second)
	key := uniqueKey(t)
	set, err := c.store.Set(ctx, key, "before")
	if err != nil {
		t.Fatal(err)
	}
	reconnects := s.Attached().Reconnects.Load()
	m.restart(t)
	eventually(t, "the server to attach again", func() bool {
		return s.Attached().Reconnects.Load() > reconnects && s.Attached().Serving()
	})
	var get *getResponse
	for {
		callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
		get, err = c.store.Get(callCtx, key)
		cancel()
		if err == nil || ctx.Err() != nil {
			break
		}
	}
	if err != nil || get.Value != "before" || get.Version.Compare(set.Version) != 0 {
		t.Fatalf("after the broker's restart: %+v %v", get, err)
	}
	if set2, err := c.store.Set(ctx, key, "after"); err != nil || set2.Version.Compare(set.Version) <= 0 {
		t.Fatalf("SET after the broker's restart: %+v %v", set2, err)
	}
}

// TestAttachBehindMosquittoACLs: mosquitto with passwords and the ACL
// file of deploy/mosquitto (plus alice's lines, as its comment says): alice's SDK client works through it, notifications
// included, and bob can read neither her replies nor her notifications.
func TestAttachBehindMosquittoACLs(t *testing.T) {
	ownBroker(t)
	dir := t.TempDir()
	passwd := filepath.Join(dir, "passwd")
	for i, user := range []string{"mqkv", "alice", "bob"} {
		args := []string{"-b", passwd, user, user + "-secret"}
		if i == 0 {
			args = append([]string{"-c"}, args...)
		}
		if out, err := exec.Command("mosquitto_passwd", args...).CombinedOutput(); err != nil {
			t.Fatalf("mosquitto_passwd: %v %s", err, out)
		}
	}
	acl, err := os.ReadFile("../../deploy/mosquitto/mqkv.acl")
	if err != nil {
		t.Fatal(err)
	}
	// alice's lines, as the file's comment shows them.
	acl = append(acl, "\nuser alice\ntopic read clients/"+hexUpper("alice")+"/#\ntopic read "+statestore.NotifyClientPrefix("alice")+"#\n"...)
	aclFile := filepath.Join(dir, "acl")
	if err := os.WriteFile(aclFile, acl, 0o600); err != nil {
		t.Fatal(err)
	}
	m := startMosquitto(t, "allow_anonymous false", "password_file "+passwd, "acl_file "+aclFile)
	s := startServer(t, func(c *serverConfig) {
		attachTo(m.addr)(c)
		c.Attach.Username, c.Attach.Password = "mqkv", []byte("mqkv-secret")
	})
	awaitAttached(t, s.Server)
	s.host, s.port = hostPort(t, m.addr)

	alice := newSDKClientOpts(t, s, "alice", &mqtt.SessionClientOptions{
		Username: mqtt.ConstantUsername("alice"), Password: mqtt.ConstantPassword([]byte("alice-secret"))})
	subscribeToNotifications(t, ctxFor(t, 5*time.Second), alice.mqtt, "alice")
	bob := dialRaw(t, address(m.addr), "bob", rawOpts{cleanStart: true, noSubscribe: true, username: "bob", password: "bob-secret"})
	// mosquitto grants any subscription and checks read access as it
	// delivers: bob subscribes to alice's topics and to everything, and
	// must get nothing of hers.
	for _, filter := range []string{"clients/alice/#", "clients/" + hexUpper("alice") + "/#", statestore.NotifyClientPrefix("alice") + "#", "#"} {
		bob.subscribe(filter, 1)
	}

	ctx := ctxFor(t, 20*time.Second)
	key := uniqueKey(t)
	ch, done := alice.store.Notify(key)
	defer done()
	if err := alice.store.KeyNotify(ctx, key); err != nil {
		t.Fatal(err)
	}
	if _, err := alice.store.Set(ctx, key, "secret"); err != nil {
		t.Fatal(err)
	}
	if got, err := alice.store.Get(ctx, key); err != nil || got.Value != "secret" {
		t.Fatalf("alice's GET: %+v %v", got, err)
	}
	if n := recv(t, ch, 5*time.Second); n.Value != "secret" {
		t.Fatalf("alice's notification: %+v", n)
	}
	if p, ok := bob.nextPublish(300 * time.Millisecond); ok {
		t.Fatalf("bob got %s %q", p.Topic, p.Payload)
	}
}

// TestAttachRequestDeliveredTwiceRunsOnce: a request that reaches the
// attached server twice (the same requester and correlation data, as a
// broker's redelivery) is executed once, and both copies get the first
// one's reply.
func TestAttachRequestDeliveredTwiceRunsOnce(t *testing.T) {
	ownBroker(t)
	m := startMosquitto(t)
	s := startServer(t, attachTo(m.addr))
	awaitAttached(t, s.Server)
	rc := dialRaw(t, address(m.addr), "twice", rawOpts{cleanStart: true})
	corr := []byte("0123456789abcdef")
	r := req{args: []string{"SET", "twice/k", "first", "NX"}, ts: now(), srcID: true, corr: corr}
	expectPayload(t, rc.do(r), "+OK\r\n")
	// Executed again, SET NX would not apply: the same reply says it
	// was not.
	r.args[2] = "second"
	expectPayload(t, rc.do(r), "+OK\r\n")
	expectPayload(t, rc.do(req{args: []string{"GET", "twice/k"}, ts: now(), srcID: true}), "$5\r\nfirst\r\n")
	if d := s.Attached().Status().Duplicates; d != 1 {
		t.Fatalf("%d duplicates counted, want 1", d)
	}
	// Another requester with the same correlation data is another request.
	other := dialRaw(t, address(m.addr), "other", rawOpts{cleanStart: true})
	expectPayload(t, other.do(req{args: []string{"SET", "twice/k", "third", "NX"}, ts: now(), srcID: true, corr: corr}), ":-1\r\n") // not applied
}

// TestAttachedClusterFailover: three attached processes of one cluster
// share the requests of SDK clients connected to mosquitto; one is
// SIGKILLed under load. Every request is answered: those the killed
// process had taken, and those mosquitto goes on handing its session,
// by the member that takes the session up (attach.Rescue); writes whose
// group leader died may be answered "outcome unknown". None is executed
// twice: every write is a SET NX of a fresh key, which a second
// execution would answer "not set".
func TestAttachedClusterFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three processes")
	}
	ownBroker(t)
	m := startMosquitto(t)
	c := startProcClusterWith(t, &procCluster{t: t, groups: 4, attachTo: m.addr}, 3)
	c.awaitSettled(0, 3)
	attached := func(i int) *attach.Status {
		var st admin.Status
		if getJSON("http://"+c.admin[i]+"/v1/status", &st) != nil {
			return nil
		}
		return st.Attached
	}
	for i := range 3 {
		eventually(t, fmt.Sprintf("n%d to take requests from mosquitto", i+1), func() bool {
			st := attached(i)
			return st != nil && st.Serving
		})
	}
	ts := &testServer{}
	ts.host, ts.port = hostPort(t, m.addr)
	const clients = 8
	type outcome struct {
		at, sent time.Time
		err      error
		set      bool
		key      string
	}
	var (
		mu       sync.Mutex
		outcomes []outcome
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range clients {
		cl := newSDKClient(t, ts)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("failover/%d/%d", w, i)
				// The request's message expiry is its timeout: long
				// enough to wait in the dead process's session until it
				// is rescued.
				sent := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				res, err := cl.store.Set(ctx, key, "v", sdkstate.WithCondition(sdkstate.NotExists), sdkstate.WithTimeout(30*time.Second))
				cancel()
				mu.Lock()
				outcomes = append(outcomes, outcome{at: time.Now(), sent: sent, err: err, set: err == nil && res.Value, key: key})
				mu.Unlock()
			}
		}()
	}
	time.Sleep(2 * time.Second)
	killed := time.Now()
	c.procs[1].Kill()
	time.Sleep(8 * time.Second)
	close(stop)
	wg.Wait()
	var before, after, unknown int
	var slowest time.Duration
	for _, o := range outcomes {
		if o.at.Before(killed) {
			before++
		} else {
			after++
		}
		slowest = max(slowest, o.at.Sub(o.sent))
		switch {
		case o.err == nil && o.set:
		case o.err == nil:
			t.Fatalf("%s: SET NX of a fresh key answered \"not set\": executed twice", o.key)
		case strings.Contains(o.err.Error(), "outcome of the write is unknown") && o.at.Sub(killed) < 5*time.Second:
			unknown++ // answered: its group's leader was the killed node
		default:
			t.Fatalf("%s at the kill%+v: %v", o.key, o.at.Sub(killed).Round(time.Millisecond), o.err)
		}
	}
	var rescued int64
	for _, i := range []int{0, 2} {
		if st := attached(i); st != nil {
			rescued += st.Rescued
		}
	}
	t.Logf("%d SETs answered before the kill, %d after (%d of them: outcome unknown, the leader died); %d rescued from the killed process's session; the slowest answered in %v",
		before, after, unknown, rescued, slowest.Round(time.Millisecond))
	if before < clients || after < clients {
		t.Fatalf("too little load: %d before the kill, %d after", before, after)
	}
	if rescued == 0 {
		t.Fatal("no request rescued from the killed process's session: mosquitto hands it a share of the requests until it is")
	}
	reader := newSDKClient(t, ts)
	for _, o := range outcomes {
		if !o.set {
			continue
		}
		got, err := reader.store.Get(ctxFor(t, 10*time.Second), o.key)
		if err != nil {
			t.Fatal(err)
		}
		if got.Value != "v" {
			t.Fatalf("%s, set, holds %q", o.key, got.Value)
		}
	}
}

// TestAttachOverTLS: the attached server reaches mosquitto over TLS
// (tls://, verifying the broker's certificate against --tls-ca), and a
// client of mosquitto's is answered.
func TestAttachOverTLS(t *testing.T) {
	ownBroker(t)
	p := newPKI(t)
	// The options after the listener line make it a TLS listener; the
	// client uses a second, plain one. (A raw paho client over TLS to
	// mosquitto once got no SUBACK within 5 s in CI; what is tested here
	// is the attached server's TLS.)
	plain := freePort(t)
	_, plainPort, _ := net.SplitHostPort(plain)
	m := startMosquitto(t, "cafile "+p.caFile, "certfile "+p.serverCert, "keyfile "+p.serverKey,
		"listener "+plainPort+" 127.0.0.1")
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(p.ca.PEM)
	s := startServer(t, func(c *serverConfig) {
		attachTo(m.addr)(c)
		c.Attach.Brokers[0].Scheme = "tls"
		c.Attach.TLS = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	})
	awaitAttached(t, s.Server)
	rc := dialRaw(t, address(plain), "tls-client", rawOpts{cleanStart: true})
	expectPayload(t, rc.do(req{args: []string{"SET", "tls/k", "v"}, ts: now(), srcID: true}), "+OK\r\n")
	expectPayload(t, rc.do(req{args: []string{"GET", "tls/k"}, ts: now(), srcID: true}), "$1\r\nv\r\n")
}

// TestAttachRequestRunsOnceAcrossRestart: a write the attached server
// answered is remembered by the store, not only by the process: after a
// restart on the same data directory (as after a crash between its
// execution and its acknowledgement, when the broker delivers it again to
// the restarted process), the same request gets the first execution's
// reply and changes nothing.
func TestAttachRequestRunsOnceAcrossRestart(t *testing.T) {
	ownBroker(t)
	m := startMosquitto(t)
	dir := t.TempDir()
	s := startServerIn(t, dir, attachTo(m.addr))
	awaitAttached(t, s.Server)
	rc := dialRaw(t, address(m.addr), "restarted", rawOpts{cleanStart: true})
	corr := []byte("fedcba9876543210")
	r := req{args: []string{"SET", "restart/k", "first", "NX"}, ts: now(), srcID: true, corr: corr}
	first := rc.do(r)
	expectPayload(t, first, "+OK\r\n")
	firstTS, _ := userProp(first, "__ts")
	s.Close()

	s = startServerIn(t, dir, attachTo(m.addr))
	awaitAttached(t, s.Server)
	r.args[2] = "second" // executed again, SET NX would not apply
	again := rc.do(r)
	expectPayload(t, again, "+OK\r\n")
	if ts, _ := userProp(again, "__ts"); ts != firstTS {
		t.Fatalf("the repeat answered version %s, the first execution %s", ts, firstTS)
	}
	get := rc.do(req{args: []string{"GET", "restart/k"}, ts: now(), srcID: true})
	expectPayload(t, get, "$5\r\nfirst\r\n")
	if ts, _ := userProp(get, "__ts"); ts != firstTS {
		t.Fatalf("the key's version is %s, the first execution's %s", ts, firstTS)
	}
	if n := s.Service().Counters.Repeats.Load(); n != 1 {
		t.Fatalf("%d repeats counted, want 1", n)
	}
}

// attachedCluster starts a cluster of in-process nodes named prefix1...,
// one per share group, each attached to m in its group (and serving MQTT
// itself) or, for "", not attached; it waits until the cluster is at rest
// and the attached nodes take requests.
func attachedCluster(t *testing.T, m *mosquittoBroker, prefix string, groups ...string) []*server.Server {
	t.Helper()
	return attachedClusterWith(t, m, prefix, nil, groups...)
}

// attachedClusterWith is attachedCluster with opt applied to each
// attached node's configuration.
func attachedClusterWith(t *testing.T, m *mosquittoBroker, prefix string, opt func(*server.Config), groups ...string) []*server.Server {
	t.Helper()
	var nodes []*server.Server
	for i, group := range groups {
		var join []string
		if i > 0 {
			join = []string{nodes[0].ClusterAddr()}
		}
		nodes = append(nodes, startNode(t, fmt.Sprintf("%s%d", prefix, i+1), join, func(c *server.Config) {
			if group != "" {
				attachAlso(m.addr)(c)
				c.Attach.Group = group
				if opt != nil {
					opt(c)
				}
			}
		}))
	}
	awaitSettled(t, nodes[0])
	for i, group := range groups {
		if group != "" {
			awaitAttached(t, nodes[i])
		}
	}
	return nodes
}

// TestAttachedProcessesExecuteOnce: two attached processes of a
// three-node cluster, in two share groups, so that mosquitto hands every
// request to both, as a broker that hands an unacknowledged request to
// another member would: each write is executed once. Both processes answer with the
// same reply (a conditional write executed twice would answer
// differently), the key holds that reply's version, and an observer is
// notified once. Then one process stops gracefully, leaving no request in
// its session.
func TestAttachedProcessesExecuteOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster")
	}
	ownBroker(t)
	m := startMosquitto(t)
	nodes := attachedCluster(t, m, "x", "first", "second", "") // the third is not attached
	for _, n := range nodes[:2] {
		eventually(t, "the cluster to run at the protocol that remembers requests", n.Node().RemembersRequests)
	}
	// The observer registers with the first node's own broker: through
	// mosquitto both processes would register it, and notify it twice.
	obs := dialRaw(t, asTestServer(nodes[0]), "observer", rawOpts{cleanStart: true})
	expectPayload(t, obs.call("KEYNOTIFY", "once/k"), "+OK\r\n")
	replies := dialRaw(t, address(m.addr), "replies", rawOpts{cleanStart: true})
	if code := replies.subscribe("once/replies", 1); code != 1 {
		t.Fatalf("SUBACK %#x", code)
	}
	requester := dialRaw(t, address(m.addr), "requester", rawOpts{cleanStart: true})
	var first string // the last write's reply
	both := func(args ...string) string {
		t.Helper()
		requester.send(req{args: args, ts: now(), srcID: true, respTopc: "once/replies"})
		var ts [2]string
		for i := range ts {
			p, ok := replies.nextPublish(10 * time.Second)
			if !ok {
				t.Fatalf("%q: %d replies, want 2 (one from each process)", args, i)
			}
			if i == 1 && string(p.Payload) != first {
				t.Fatalf("%q answered %q and %q: executed twice", args, first, p.Payload)
			}
			first = string(p.Payload)
			ts[i], _ = userProp(p, "__ts")
		}
		if ts[0] != ts[1] {
			t.Fatalf("%q answered with versions %s and %s", args, ts[0], ts[1])
		}
		return ts[0]
	}
	setTS := both("SET", "once/k", "v", "NX")
	if first != "+OK\r\n" {
		t.Fatalf("SET NX answered %q", first)
	}
	get := obs.call("GET", "once/k")
	if ts, _ := userProp(get, "__ts"); ts != setTS {
		t.Fatalf("the key's version %s, the SET's %s", ts, setTS)
	}
	expectNotification(t, obs, "once/k", notifySet+"$1\r\nv\r\n")
	both("DEL", "once/k")
	if first != ":1\r\n" {
		t.Fatalf("DEL answered %q", first)
	}
	expectNotification(t, obs, "once/k", notifyDelete)
	expectNoPublish(t, obs, time.Second)
	var repeats int64
	for _, n := range nodes {
		repeats += n.Service().Counters.Repeats.Load()
	}
	if repeats != 2 {
		t.Fatalf("%d repeats counted, want 2 (the second copy of each write)", repeats)
	}

	// The second process stops: it leaves the request topic first, so
	// that the broker keeps no copy of a request for it. The first takes
	// up its session once it stops answering, and finds nothing in it.
	nodes[1].Close()
	for i := range 10 {
		requester.send(req{args: []string{"SET", fmt.Sprint("once/after/", i), "v"}, ts: now(), srcID: true, respTopc: "once/replies"})
		if _, ok := replies.nextPublish(10 * time.Second); !ok {
			t.Fatalf("no reply to a write after the second process stopped")
		}
	}
	eventually(t, "the first process to take up the stopped one's session", func() bool { return nodes[0].Attached().Rescues.Load() > 0 })
	if n := nodes[0].Attached().Rescued.Load(); n != 0 {
		t.Fatalf("%d requests were left in the session of a process stopped gracefully", n)
	}
}

// TestAttachedProcessesShareRegistrations: with two attached processes
// of a cluster in one share group, each request goes to either; a
// client's KEYNOTIFY registrations are all served by one of them, so
// that every KeyNotifyStop succeeds and ends its notifications, and a
// change is notified once (the official Go SDK, through mosquitto).
func TestAttachedProcessesShareRegistrations(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster")
	}
	ownBroker(t)
	m := startMosquitto(t)
	nodes := attachedCluster(t, m, "r", attach.DefaultGroup, attach.DefaultGroup, "")
	ts := &testServer{}
	ts.host, ts.port = hostPort(t, m.addr)
	c := newSDKClient(t, ts)
	subscribeToNotifications(t, context.Background(), c.mqtt, c.mqtt.ID())
	ctx := ctxFor(t, 60*time.Second)
	for i := range 10 {
		key := fmt.Sprintf("shared-reg/%d", i)
		ch, done := c.store.Notify(key)
		if err := c.store.KeyNotify(ctx, key); err != nil {
			t.Fatal(err)
		}
		if i%3 == 1 {
			// mosquitto hands a shared subscription's messages to its
			// members in turn: shift the turns, so that a stop reaches
			// the other process than its registration.
			c.store.Get(ctx, key)
		}
		if _, err := c.store.Set(ctx, key, "v"); err != nil {
			t.Fatal(err)
		}
		if n := recv(t, ch, 5*time.Second); n.Operation != "SET" || n.Value != "v" {
			t.Fatalf("%s: notification %+v", key, n)
		}
		if err := c.store.KeyNotifyStop(ctx, key); err != nil {
			t.Fatalf("%s: KeyNotifyStop: %v", key, err)
		}
		c.store.Set(ctx, key, "after")
		expectNone(t, ch, 200*time.Millisecond)
		done()
	}
	var forwarded int64
	for _, n := range nodes[:2] {
		forwarded += n.Attached().Forwarded.Load()
	}
	t.Logf("%d of 20 KEYNOTIFY requests handed to the process serving the client's (requests %d and %d)", forwarded, nodes[0].Attached().Requests.Load(), nodes[1].Attached().Requests.Load())
	if forwarded == 0 {
		t.Fatal("no KEYNOTIFY reached the other process: the test shows nothing")
	}
}

// TestAttachedRequesterRecordsEnd: the record naming the process that
// serves a requester's registrations lives while the requester holds
// registrations, renewed past its lifetime, and ends once they end; the
// processes forget a requester that holds none and went idle. Before,
// both were kept for every requester id ever seen.
func TestAttachedRequesterRecordsEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a cluster")
	}
	ownBroker(t)
	m := startMosquitto(t)
	const idle = 500 * time.Millisecond // records live 1 s unless renewed
	nodes := attachedClusterWith(t, m, "q", func(c *server.Config) { c.Attach.RequesterIdle = idle },
		attach.DefaultGroup, attach.DefaultGroup, "") // the third is not attached
	ts := &testServer{}
	ts.host, ts.port = hostPort(t, m.addr)
	c := newSDKClient(t, ts)
	subscribeToNotifications(t, context.Background(), c.mqtt, c.mqtt.ID())
	ctx := ctxFor(t, 60*time.Second)
	ch, done := c.store.Notify("records-end/k")
	defer done()
	if err := c.store.KeyNotify(ctx, "records-end/k"); err != nil {
		t.Fatal(err)
	}
	key := []byte("\x00mqkv/attach-notify/" + c.mqtt.ID())
	record := func() (string, bool) {
		t.Helper()
		e, found, err := nodes[0].Node().Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return string(e.Value), found
	}
	first, found := record()
	if !found {
		t.Fatal("no record names the process serving the registration")
	}
	// Three lifetimes later it is still there, naming the same process,
	// and the registration still notifies.
	time.Sleep(3 * 2 * idle)
	if now, found := record(); !found || now != first {
		t.Fatalf("after three lifetimes, with a registration held: record %q (found %v), first %q", now, found, first)
	}
	if _, err := c.store.Set(ctx, "records-end/k", "v"); err != nil {
		t.Fatal(err)
	}
	if n := recv(t, ch, 5*time.Second); n.Operation != "SET" || n.Value != "v" {
		t.Fatalf("notification %+v", n)
	}
	if err := c.store.KeyNotifyStop(ctx, "records-end/k"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the record to end with the registrations", func() bool { _, found := record(); return !found })
	eventually(t, "both processes to forget the idle requester", func() bool {
		return nodes[0].Attached().Requesters() == 0 && nodes[1].Attached().Requesters() == 0
	})
}
