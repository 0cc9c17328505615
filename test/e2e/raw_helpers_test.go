package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/statestore"
)

// rawClient speaks MQTT v5 through paho with nothing of the AIO SDKs in
// between, to check the bytes the .NET and Rust clients depend on.
type rawClient struct {
	t        testing.TB
	id       string
	c        *paho.Client
	respTopc string
	inbox    chan *paho.Publish // every PUBLISH that is not a reply
	mu       sync.Mutex
	waiting  map[string]chan *paho.Publish // correlation data → reply
	disc     chan *paho.Disconnect
}

type rawOpts struct {
	sessionExpiry uint32
	cleanStart    bool
	noSubscribe   bool
	username      string
	password      string // sent when not empty
	// receiveMaximum, if set, is sent in CONNECT.
	receiveMaximum uint16
	// will and willProps, if set, are the CONNECT's will.
	will      *paho.WillMessage
	willProps *paho.WillProperties
	// manualAck: the client acknowledges no QoS 1/2 message it receives.
	manualAck bool
	// conn, if set, is the connection to use (TLS, WebSocket...) instead
	// of plain TCP to the server's first listener.
	conn net.Conn
}

// dialTCP opens a TCP connection to addr, closed when the test ends.
func dialTCP(t testing.TB, addr string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func dialRaw(t testing.TB, s interface{ Addr() string }, id string, o rawOpts) *rawClient {
	t.Helper()
	if o.conn == nil {
		conn := dialTCP(t, s.Addr())
		o.conn = conn
	}
	rc, ack, err := connectRaw(t, id, o)
	if err != nil || ack.ReasonCode != 0 {
		t.Fatalf("connect %s: %v %+v", id, err, ack)
	}
	return rc
}

// connectRaw connects over o.conn and returns the CONNACK whatever it says.
func connectRaw(t testing.TB, id string, o rawOpts) (*rawClient, *paho.Connack, error) {
	t.Helper()
	conn := o.conn
	rc := &rawClient{
		t:        t,
		id:       id,
		respTopc: "clients/" + id + "/services/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke/response",
		inbox:    make(chan *paho.Publish, 1000),
		waiting:  map[string]chan *paho.Publish{},
		disc:     make(chan *paho.Disconnect, 1),
	}
	rc.c = paho.NewClient(paho.ClientConfig{
		ClientID: id,
		Conn:     conn,
		OnPublishReceived: []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
			p := pr.Packet
			if p.Topic == rc.respTopc && p.Properties != nil {
				rc.mu.Lock()
				ch := rc.waiting[string(p.Properties.CorrelationData)]
				rc.mu.Unlock()
				if ch != nil {
					ch <- p
					return true, nil
				}
			}
			rc.inbox <- p
			return true, nil
		}},
		OnServerDisconnect: func(d *paho.Disconnect) {
			select {
			case rc.disc <- d:
			default:
			}
		},
		OnClientError:              func(error) {},
		EnableManualAcknowledgment: o.manualAck,
	})
	expiry := o.sessionExpiry
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// paho sends its first PINGREQ as soon as CONNACK arrives, from its
	// own goroutine, and writes a packet as several Write calls where the
	// connection is not a TCP socket (TLS, WebSocket): a SUBSCRIBE sent at
	// once can interleave with it and reach the server garbled ("malformed
	// packet"). Without a keep-alive paho never pings; tests are short.
	keepAlive := uint16(30)
	if _, tcp := conn.(*net.TCPConn); !tcp {
		keepAlive = 0
	}
	cp := &paho.Connect{
		ClientID:   id,
		CleanStart: o.cleanStart,
		KeepAlive:  keepAlive,
		Properties: &paho.ConnectProperties{SessionExpiryInterval: &expiry},
	}
	if o.receiveMaximum != 0 {
		cp.Properties.ReceiveMaximum = &o.receiveMaximum
	}
	cp.WillMessage, cp.WillProperties = o.will, o.willProps
	if o.username != "" {
		cp.UsernameFlag, cp.Username = true, o.username
	}
	if o.password != "" {
		cp.PasswordFlag, cp.Password = true, []byte(o.password)
	}
	ack, err := rc.c.Connect(ctx, cp)
	if err != nil || ack.ReasonCode != 0 {
		conn.Close()
		return nil, ack, err
	}
	if !o.noSubscribe {
		rc.subscribe(rc.respTopc, 1)
	}
	t.Cleanup(func() { rc.c.Disconnect(&paho.Disconnect{}) })
	return rc, ack, nil
}

func (rc *rawClient) subscribe(filter string, qos byte) byte {
	rc.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ack, err := rc.c.Subscribe(ctx, &paho.Subscribe{Subscriptions: []paho.SubscribeOptions{{Topic: filter, QoS: qos}}})
	if ack == nil || len(ack.Reasons) == 0 {
		rc.t.Fatalf("subscribe %s: %v", filter, err)
	}
	return ack.Reasons[0] // paho also reports a refusal as an error
}

// req is one request with the properties a client can set.
type req struct {
	args     []string
	payload  []byte // raw payload instead of args
	ts       *string
	ft       *string
	qos0     bool   // publish at QoS 0 instead of 1
	respTopc string // response topic instead of the client's own
	// disconnects: the server drops the connection instead of answering,
	// so the PUBACK may never come.
	disconnects     bool
	noResponseTopic bool
	corr            []byte // correlation data instead of random bytes
	srcID           bool   // send the client id as __srcId, as the SDKs do
}

// now returns a valid request timestamp from this process's clock.
func now() *string {
	s := fmt.Sprintf("%015d:%05d:%s", time.Now().UnixMilli(), 0, "raw-test")
	return &s
}

func ptr(s string) *string { return &s }

func encode(args ...string) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	return b.Bytes()
}

// send publishes a request and returns the channel its reply will come on.
func (rc *rawClient) send(r req) chan *paho.Publish {
	rc.t.Helper()
	reply, err := rc.trySend(r)
	if err != nil {
		rc.t.Fatalf("publish: %v", err)
	}
	return reply
}

// trySend is send for callers that expect the server to go away.
func (rc *rawClient) trySend(r req) (chan *paho.Publish, error) {
	corr := r.corr
	if corr == nil {
		corr = make([]byte, 16)
		rand.Read(corr)
	}
	reply := make(chan *paho.Publish, 1)
	rc.mu.Lock()
	rc.waiting[string(corr)] = reply
	rc.mu.Unlock()
	payload := r.payload
	if payload == nil {
		payload = encode(r.args...)
	}
	props := &paho.PublishProperties{
		CorrelationData: corr,
		ResponseTopic:   rc.respTopc,
		ContentType:     "application/octet-stream",
	}
	if r.respTopc != "" {
		props.ResponseTopic = r.respTopc
	}
	if r.noResponseTopic {
		props.ResponseTopic = ""
	}
	if r.ts != nil {
		props.User.Add("__ts", *r.ts)
	}
	if r.ft != nil {
		props.User.Add("__ft", *r.ft)
	}
	if r.srcID {
		props.User.Add("__srcId", rc.id)
	}
	qos := byte(1)
	if r.qos0 {
		qos = 0
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	pub := &paho.Publish{Topic: statestore.RequestTopic, QoS: qos, Payload: payload, Properties: props}
	if r.disconnects {
		go rc.c.Publish(ctx, pub)
		return reply, nil
	}
	_, err := rc.c.Publish(ctx, pub)
	return reply, err
}

// do sends a request and waits for its reply.
func (rc *rawClient) do(r req) *paho.Publish {
	rc.t.Helper()
	reply := rc.send(r)
	select {
	case p := <-reply:
		return p
	case <-time.After(5 * time.Second):
		rc.t.Fatalf("no reply to %q", r.args)
	}
	return nil
}

// call sends args with a fresh __ts and returns the reply.
func (rc *rawClient) call(args ...string) *paho.Publish {
	rc.t.Helper()
	return rc.do(req{args: args, ts: now()})
}

func userProp(p *paho.Publish, key string) (string, bool) {
	if p.Properties == nil {
		return "", false
	}
	for _, u := range p.Properties.User {
		if u.Key == key {
			return u.Value, true
		}
	}
	return "", false
}

// setKnown SETs key to value and fails unless that is applied exactly
// once. An election under load (a member's graceful stop hands its
// leaderships over) may leave the write's outcome unknown: the key is
// read then (a linearizable GET, through the new leader), and the SET
// sent again only if it was not applied; sent again after it was, a
// watcher would be told of the value twice.
func setKnown(t testing.TB, rc *rawClient, key, value string) {
	t.Helper()
	p := rc.call("SET", key, value)
	for try := 0; try < 3 && strings.Contains(string(p.Payload), "outcome of the write is unknown"); try++ {
		want := "$" + strconv.Itoa(len(value)) + "\r\n" + value + "\r\n"
		if g := rc.call("GET", key); string(g.Payload) == want {
			return
		}
		p = rc.call("SET", key, value)
	}
	expectPayload(t, p, "+OK\r\n")
}

// expectPayload checks a reply's exact bytes and the properties every
// reply must carry.
func expectPayload(t testing.TB, p *paho.Publish, want string) {
	t.Helper()
	if string(p.Payload) != want {
		t.Fatalf("payload %q, want %q", p.Payload, want)
	}
	if st, ok := userProp(p, "__stat"); !ok || st != "200" {
		t.Fatalf("__stat = %q (present %v), want 200", st, ok)
	}
	if _, ok := userProp(p, "__protVer"); ok {
		t.Fatal("reply carries __protVer")
	}
	if ct := p.Properties.ContentType; ct != "" && ct != "application/octet-stream" {
		t.Fatalf("content type %q", ct)
	}
	if p.QoS != 1 {
		t.Fatalf("reply QoS %d", p.QoS)
	}
}

func hexUpper(s string) string { return strings.ToUpper(fmt.Sprintf("%x", s)) }

// nextPublish waits for a non-reply PUBLISH.
func (rc *rawClient) nextPublish(d time.Duration) (*paho.Publish, bool) {
	select {
	case p := <-rc.inbox:
		return p, true
	case <-time.After(d):
		return nil, false
	}
}
