package e2e

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/paho"
	"github.com/gorilla/websocket"
	"golang.org/x/crypto/bcrypt"

	"github.com/mqkv/mqkv/client"
	"github.com/mqkv/mqkv/internal/server"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/testcerts"
)

// pki is a throwaway CA with a server certificate on disk.
type pki struct {
	ca                    *testcerts.CA
	dir                   string
	caFile                string
	serverCert, serverKey string
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	ca, err := testcerts.NewCA(pkix.Name{CommonName: "mqkv test root", Organization: []string{"Contoso"}})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	p := &pki{ca: ca, dir: dir, caFile: filepath.Join(dir, "ca.pem")}
	if err := os.WriteFile(p.caFile, ca.PEM, 0o600); err != nil {
		t.Fatal(err)
	}
	srv, err := ca.Server()
	if err != nil {
		t.Fatal(err)
	}
	if p.serverCert, p.serverKey, err = srv.WriteFiles(dir, "server"); err != nil {
		t.Fatal(err)
	}
	return p
}

// dialTLS opens a TLS connection that trusts the test CA, optionally with
// a client certificate for cn.
func (p *pki) dialTLS(t *testing.T, addr, cn string) (net.Conn, error) {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(p.ca.Cert)
	cfg := &tls.Config{RootCAs: pool, ServerName: "localhost"}
	if cn != "" {
		leaf, err := p.ca.Client(pkix.Name{CommonName: cn})
		if err != nil {
			t.Fatal(err)
		}
		c, err := leaf.TLS()
		if err != nil {
			t.Fatal(err)
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	conn, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		return nil, err
	}
	// TLS 1.3 reports a refused client certificate on the first read.
	return conn, conn.Handshake()
}

func withTLS(p *pki, clientCA bool) serverOption {
	return func(c *server.Config) {
		c.TLSListen, c.TLSCert, c.TLSKey = "127.0.0.1:0", p.serverCert, p.serverKey
		if clientCA {
			c.TLSClientCA = p.caFile
		}
	}
}

func TestTLSListener(t *testing.T) {
	p := newPKI(t)
	s := startServer(t, inMemory(), withTLS(p, false))
	conn, err := p.dialTLS(t, s.Addrs()["tls"], "")
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, s, "tls-client", rawOpts{cleanStart: true, conn: conn})
	expectPayload(t, c.call("SET", "k", "over-tls"), "+OK\r\n")
	// Plain MQTT on the TLS port gets nowhere.
	plain := dialTCP(t, s.Addrs()["tls"])
	defer plain.Close()
	if _, _, err := connectRaw(t, "plain-on-tls", rawOpts{conn: plain}); err == nil {
		t.Fatal("plain MQTT accepted on the TLS listener")
	}
}

func TestMutualTLS(t *testing.T) {
	p := newPKI(t)
	attrs := filepath.Join(p.dir, "attrs.yaml")
	os.WriteFile(attrs, []byte(`authorizationAttributes:
  fleet:
    subject: "CN = mqkv test root, O = Contoso"
    attributes:
      organization: contoso
`), 0o600)
	policyFile := filepath.Join(p.dir, "policy.yaml")
	os.WriteFile(policyFile, []byte(`rules:
  - principals:
      attributes:
        - organization: contoso
    brokerResources:
      - method: Connect
    stateStoreResources:
      - method: ReadWrite
        keys: ["devices/{principal.username}/*"]
`), 0o600)
	s := startServer(t, inMemory(), withTLS(p, true), func(c *server.Config) {
		c.CertAttributesFile, c.PolicyFile = attrs, policyFile
	})
	addr := s.Addrs()["tls"]

	conn, err := p.dialTLS(t, addr, "sensor-7")
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, s, "any-client-id", rawOpts{cleanStart: true, conn: conn})
	// The certificate CN is the username; the CA's subject gave the
	// attribute the policy admits on.
	expectPayload(t, c.call("SET", "devices/sensor-7/temp", "21"), "+OK\r\n")
	expectPayload(t, c.call("SET", "devices/sensor-8/temp", "21"), "-ERR not authorized\r\n")

	// No certificate: the handshake fails.
	if conn, err := p.dialTLS(t, addr, ""); err == nil {
		if _, _, err := connectRaw(t, "no-cert", rawOpts{conn: conn}); err == nil {
			t.Fatal("client without certificate admitted")
		}
	}
	// A certificate from another CA: refused too.
	other := newPKI(t)
	pool := x509.NewCertPool()
	pool.AddCert(p.ca.Cert)
	leaf, _ := other.ca.Client(pkix.Name{CommonName: "intruder"})
	cert, _ := leaf.TLS()
	bad, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pool, ServerName: "localhost", Certificates: []tls.Certificate{cert}})
	if err == nil {
		if err = bad.Handshake(); err == nil {
			_, _, err = connectRaw(t, "intruder", rawOpts{conn: bad})
		}
	}
	if err == nil {
		t.Fatal("certificate from an unknown CA admitted")
	}
}

// writePasswords writes a password file of users and passwords (pairs),
// hashed at bcrypt's least cost: at the default cost (mqkv passwd's) a
// check takes 1.5 s under the race detector on an idle core, and a
// CONNECT's over 5 s in CI (TestPasswordAuthentication: no CONNACK).
func writePasswords(t *testing.T, users ...string) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "passwd")
	var b strings.Builder
	for i := 0; i+1 < len(users); i += 2 {
		h, err := bcrypt.GenerateFromPassword([]byte(users[i+1]), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "%s:%s\n", users[i], h)
	}
	if err := os.WriteFile(file, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return file
}

// TestCertificateSessionIsItsSubjects: with client certificates and
// anonymous clients both admitted (--tls-client-ca, optional
// certificates, --allow-anonymous, no password file), a session made by a
// certificate's subject cannot be taken over by an anonymous client that
// reuses its client id (it would get the messages queued there). Before,
// only passwords and certificate attributes counted as authentication.
func TestCertificateSessionIsItsSubjects(t *testing.T) {
	p := newPKI(t)
	s := startServer(t, inMemory(), withTLS(p, true), func(c *server.Config) {
		c.TLSClientCertOptional, c.AllowAnonymous = true, true
	})
	conn, err := p.dialTLS(t, s.Addrs()["tls"], "sensor-17")
	if err != nil {
		t.Fatal(err)
	}
	dev := dialRaw(t, s, "sensor-17", rawOpts{cleanStart: true, sessionExpiry: 300, noSubscribe: true, conn: conn})
	if code := dev.subscribe("commands/sensor-17", 1); code != 1 {
		t.Fatalf("SUBACK 0x%02x", code)
	}
	dev.c.Disconnect(&paho.Disconnect{})
	eventually(t, "the device offline", func() bool { return s.Broker().ClientsConnected() == 0 })
	thief, ack, _ := connectRaw(t, "sensor-17", rawOpts{sessionExpiry: 300, noSubscribe: true, conn: dialTCP(t, s.Addr())})
	if thief != nil || ack == nil || ack.ReasonCode != 0x87 {
		t.Fatalf("an anonymous client resuming a certificate subject's session: CONNACK %+v, want 0x87", ack)
	}
	// The subject itself resumes it.
	conn, err = p.dialTLS(t, s.Addrs()["tls"], "sensor-17")
	if err != nil {
		t.Fatal(err)
	}
	if back, ack, _ := connectRaw(t, "sensor-17", rawOpts{sessionExpiry: 300, noSubscribe: true, conn: conn}); back == nil || !ack.SessionPresent {
		t.Fatalf("the subject resuming its session: CONNACK %+v", ack)
	}
}

func TestPasswordAuthentication(t *testing.T) {
	file := writePasswords(t, "alice", "wonderland")
	s := startServer(t, inMemory(), func(c *server.Config) { c.PasswordFile = file })
	dial := func() net.Conn { return dialTCP(t, s.Addr()) }
	c, _, err := connectRaw(t, "alice-1", rawOpts{cleanStart: true, conn: dial(), username: "alice", password: "wonderland"})
	if err != nil {
		t.Fatal(err)
	}
	expectPayload(t, c.call("PING"), "+PONG\r\n")
	if _, ack, _ := connectRaw(t, "alice-2", rawOpts{conn: dial(), username: "alice", password: "queen"}); ack == nil || ack.ReasonCode != 0x86 {
		t.Fatalf("wrong password: CONNACK %+v, want 0x86", ack)
	}
	if _, ack, _ := connectRaw(t, "bob", rawOpts{conn: dial(), username: "bob", password: "wonderland"}); ack == nil || ack.ReasonCode != 0x86 {
		t.Fatalf("unknown user: CONNACK %+v, want 0x86", ack)
	}
	if _, ack, _ := connectRaw(t, "anon", rawOpts{conn: dial()}); ack == nil || ack.ReasonCode != 0x87 {
		t.Fatalf("anonymous: CONNACK %+v, want 0x87", ack)
	}
	if got := s.Broker().Counters.AuthFailures.Load(); got != 3 {
		t.Fatalf("auth failures counted %d, want 3", got)
	}

	open := startServer(t, inMemory(), func(c *server.Config) { c.PasswordFile, c.AllowAnonymous = file, true })
	conn := dialTCP(t, open.Addr())
	if _, _, err := connectRaw(t, "anon", rawOpts{conn: conn, cleanStart: true}); err != nil {
		t.Fatalf("anonymous with --allow-anonymous: %v", err)
	}
}

func TestWebSocketListener(t *testing.T) {
	s := startServer(t, inMemory(), func(c *server.Config) { c.WSListen = "127.0.0.1:0" })
	ws, _, err := (&websocket.Dialer{Subprotocols: []string{"mqtt"}}).Dial("ws://"+s.Addrs()["ws"]+"/mqtt", nil)
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, s, "ws-client", rawOpts{cleanStart: true, conn: &wsNetConn{Conn: ws}})
	expectPayload(t, c.call("SET", "k", "over-websocket"), "+OK\r\n")
	expectPayload(t, c.call("GET", "k"), "$14\r\nover-websocket\r\n")
}

// The policy of TestPolicy: every rule kind.
const testPolicy = `
apiVersion: connectivity.iotoperations.azure.com/v1
kind: BrokerAuthorization
metadata:
  name: test
spec:
  authorizationPolicies:
    cache: Enabled
    rules:
      - principals:
          usernames: ["writer", "reader"]
          clientIds: ["device-*"]
        brokerResources:
          - method: Connect
          - method: Publish
            topics: ["telemetry/{principal.clientId}/#"]
          - method: Subscribe
            topics: ["commands/{principal.clientId}", "broadcast/#"]
        stateStoreResources:
          - method: ReadWrite
            keyType: Pattern
            keys: ["clients/{principal.clientId}/*"]
      - principals:
          usernames: ["writer"]
        stateStoreResources:
          - method: ReadWrite
            keyType: String
            keys: ["config/site*"]
          - method: ReadWrite
            keyType: Binary
            keys: ["` + "AAH/" + `"]
      - principals:
          usernames: ["reader"]
        stateStoreResources:
          - method: Read
            keys: ["config/*", "shared"]
      - principals:
          usernames: ["scribe"]
        brokerResources:
          - method: Connect
          - method: Subscribe
            topics: ["#"]
        stateStoreResources:
          - method: Write
            keys: ["config/*"]
`

// policyServer starts a server with testPolicy and the users writer/w,
// reader/r, scribe/s and nobody/n; connect returns the client (nil if
// refused) and the CONNACK.
func policyServer(t *testing.T) (s *testServer, connect func(id, user, pass string) (*rawClient, *paho.Connack)) {
	pw := writePasswords(t, "writer", "w", "reader", "r", "scribe", "s", "nobody", "n")
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	os.WriteFile(pol, []byte(testPolicy), 0o600)
	s = startServer(t, inMemory(), func(c *server.Config) { c.PasswordFile, c.PolicyFile = pw, pol })
	return s, func(id, user, pass string) (*rawClient, *paho.Connack) {
		conn := dialTCP(t, s.Addr())
		c, ack, _ := connectRaw(t, id, rawOpts{cleanStart: true, conn: conn, username: user, password: pass})
		return c, ack
	}
}

func TestPolicy(t *testing.T) {
	s, connect := policyServer(t)
	w, _ := connect("device-1", "writer", "w")
	r, _ := connect("device-2", "reader", "r")
	if w == nil || r == nil {
		t.Fatal("writer or reader refused")
	}
	if _, ack := connect("lamp", "nobody", "n"); ack == nil || ack.ReasonCode != 0x87 {
		t.Fatalf("a principal without Connect: CONNACK %+v, want 0x87", ack)
	}

	// Per-client sandbox.
	expectPayload(t, w.call("SET", "clients/device-1/state", "on"), "+OK\r\n")
	expectPayload(t, w.call("SET", "clients/device-2/state", "on"), "-ERR not authorized\r\n")
	expectPayload(t, r.call("GET", "clients/device-1/state"), "-ERR not authorized\r\n")
	// String keys are exact: the '*' is a character, not a wildcard.
	expectPayload(t, w.call("SET", "config/site*", "v"), "+OK\r\n")
	expectPayload(t, w.call("SET", "config/site1", "v"), "-ERR not authorized\r\n")
	// Binary keys are given in base64.
	bin, _ := base64.StdEncoding.DecodeString("AAH/")
	expectPayload(t, w.call("SET", string(bin), "v"), "+OK\r\n")
	// Read-only: GET and KEYNOTIFY yes, SET, DEL, VDEL no.
	expectPayload(t, r.call("GET", "config/site*"), "$1\r\nv\r\n")
	expectPayload(t, r.call("KEYNOTIFY", "shared"), "+OK\r\n")
	for _, args := range [][]string{{"SET", "config/site*", "x"}, {"DEL", "config/site*"}, {"VDEL", "config/site*", "v"}, {"SET", "shared", "x"}} {
		expectPayload(t, r.call(args...), "-ERR not authorized\r\n")
	}
	// Write-only: SET yes, but not SET ... GET, which answers with the
	// value it replaces (a read).
	sc, _ := connect("scribe-1", "scribe", "s")
	expectPayload(t, sc.call("SET", "config/scribe", "v"), "+OK\r\n")
	expectPayload(t, sc.call("GET", "config/site*"), "-ERR not authorized\r\n")
	expectPayload(t, sc.call("SET", "config/site*", "x", "GET"), "-ERR not authorized\r\n")
	expectPayload(t, w.call("GET", "config/site*"), "$1\r\nv\r\n") // nothing changed
	// Granted "#", the scribe still gets no other client's notifications:
	// they carry values of keys it may not read.
	if code := sc.subscribe("#", 1); code != 1 {
		t.Fatalf("SUBACK for # 0x%02x", code)
	}
	expectPayload(t, r.call("KEYNOTIFY", "config/site*"), "+OK\r\n")
	expectPayload(t, w.call("SET", "config/site*", "w"), "+OK\r\n")
	expectNotification(t, r, "config/site*", notifySet+"$1\r\nw\r\n")
	for {
		p, ok := sc.nextPublish(300 * time.Millisecond)
		if !ok {
			break
		}
		if strings.HasPrefix(p.Topic, statestore.NotifyPrefix) {
			t.Fatalf("the scribe got another client's notification on %s", p.Topic)
		}
	}
	if s.Service().Counters.Denied.Load() < 9 {
		t.Fatalf("denied counter %d", s.Service().Counters.Denied.Load())
	}

	// Broker resources: publish and subscribe denial codes.
	ctx := ctxFor(t, 5*time.Second)
	if res, err := w.c.Publish(ctx, &paho.Publish{Topic: "telemetry/device-1/temp", QoS: 1, Payload: []byte("1")}); err != nil || res.ReasonCode != 0 {
		t.Fatalf("allowed publish: %+v %v", res, err)
	}
	if res, _ := w.c.Publish(ctx, &paho.Publish{Topic: "telemetry/device-2/temp", QoS: 1, Payload: []byte("1")}); res == nil || res.ReasonCode != 0x87 {
		t.Fatalf("denied publish: PUBACK %+v, want 0x87", res)
	}
	// A PUBLISH by topic alias is authorized for the aliased topic
	// (before, for the empty topic name: refused whatever the alias).
	for _, tc := range []struct {
		alias uint16
		topic string
		code  byte
	}{{1, "telemetry/device-1/temp", 0}, {2, "telemetry/device-2/temp", 0x87}} {
		for _, topic := range []string{tc.topic, ""} {
			res, _ := w.c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte("1"), Properties: &paho.PublishProperties{TopicAlias: &tc.alias}})
			if res == nil || res.ReasonCode != tc.code {
				t.Fatalf("publish to %q by alias %d (topic %q sent): PUBACK %+v, want 0x%02x", tc.topic, tc.alias, topic, res, tc.code)
			}
		}
	}
	if code := w.subscribe("commands/device-1", 1); code != 1 {
		t.Fatalf("allowed subscribe: %d", code)
	}
	if code := w.subscribe("commands/device-2", 1); code != 0x87 {
		t.Fatalf("denied subscribe: SUBACK 0x%02x, want 0x87", code)
	}
	if code := w.subscribe("#", 1); code != 0x87 {
		t.Fatalf("wildcard beyond the grant: SUBACK 0x%02x, want 0x87", code)
	}
	// A client's own notification topics need no grant (the .NET SDK's
	// raw-id form, the Rust SDK's hex form); another client's are denied.
	own := statestore.NotifyPrefix + "/device-1/command/notify"
	if code := w.subscribe(own, 1); code != 1 {
		t.Fatalf(".NET-style notify subscription: SUBACK 0x%02x, want QoS 1", code)
	}
	if code := w.subscribe(statestore.NotifyPrefix+"/"+hexUpper("device-1")+"/command/notify/+", 1); code != 1 {
		t.Fatalf("Rust-style notify subscription: SUBACK 0x%02x, want QoS 1", code)
	}
	if code := w.subscribe(statestore.NotifyPrefix+"/"+hexUpper("device-2")+"/command/notify/+", 1); code != 0x87 {
		t.Fatalf("another client's notifications: SUBACK 0x%02x, want 0x87", code)
	}
}

// TestPolicyProtectsOtherClients: with a policy, a client can neither have
// replies published where it may not publish itself (another client's
// command topic) nor take over another user's session by reusing its
// client id.
func TestPolicyProtectsOtherClients(t *testing.T) {
	_, dial := policyServer(t)
	victim, _ := dial("device-1", "writer", "w")
	attacker, _ := dial("device-2", "reader", "r")
	if victim == nil || attacker == nil {
		t.Fatal("clients refused")
	}
	if code := victim.subscribe("commands/device-1", 1); code != 1 {
		t.Fatalf("victim subscribe: 0x%02x", code)
	}

	// Replies aimed at the victim's command topic: the attacker is cut off
	// and the victim receives nothing.
	attacker.send(req{args: []string{"GET", "config/site*"}, ts: now(), respTopc: "commands/device-1", disconnects: true})
	select {
	case d := <-attacker.disc:
		if d.ReasonCode != 0x87 {
			t.Fatalf("DISCONNECT reason 0x%02x, want 0x87", d.ReasonCode)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("attacker not disconnected")
	}
	expectPayload(t, victim.call("PING"), "+PONG\r\n")
	expectNoPublish(t, victim, 200*time.Millisecond)

	// Another user may not take over device-1's session; the same user may.
	if _, ack := dial("device-1", "reader", "r"); ack == nil || ack.ReasonCode != 0x87 {
		t.Fatalf("takeover by another user: CONNACK %+v, want 0x87", ack)
	}
	expectPayload(t, victim.call("PING"), "+PONG\r\n")
	if again, ack := dial("device-1", "writer", "w"); again == nil {
		t.Fatalf("reconnect by the same user: CONNACK %+v", ack)
	}
}

func TestPolicyAllowsTheSDKs(t *testing.T) {
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	os.WriteFile(pol, []byte(`rules:
  - principals: {clientIds: ["*"]}
    brokerResources: [{method: Connect}]
    stateStoreResources:
      - {method: ReadWrite, keys: ["{principal.clientId}/*"]}
`), 0o600)
	s := startServer(t, inMemory(), func(c *server.Config) { c.PolicyFile = pol })
	c := newSDKClientID(t, s, "sdk-under-policy")
	ctx := ctxFor(t, 10*time.Second)
	// The SDK's response topic and its notifications need no grant: the
	// state store authorizes by key.
	ch, done := c.store.Notify("sdk-under-policy/k")
	defer done()
	if err := c.store.KeyNotify(ctx, "sdk-under-policy/k"); err != nil {
		t.Fatal(err)
	}
	if res, err := c.store.Set(ctx, "sdk-under-policy/k", "v"); err != nil || !res.Value {
		t.Fatalf("Set: %+v %v", res, err)
	}
	if n := recv(t, ch, 5*time.Second); n.Value != "v" {
		t.Fatalf("notification %+v", n)
	}
	if _, err := c.store.Set(ctx, "other/k", "v"); err == nil || !strings.Contains(err.Error(), "not authorized") {
		t.Fatalf("Set outside the grant: %v", err)
	}
}

// TestPolicyReloadDuringConnect: a policy reload while a client is being
// admitted (its password check takes tens of milliseconds) applies to it.
// Before, its grant came from the policy it started with, and the reload
// judged the connections before it was among them: it kept the old grant
// for its whole connection.
func TestPolicyReloadDuringConnect(t *testing.T) {
	pw := writePasswords(t, "bob", "b")
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	write := func(keys string) {
		if err := os.WriteFile(pol, []byte(`rules:
  - principals: {usernames: ["bob"]}
    brokerResources: [{method: Connect}]
    stateStoreResources: [{method: ReadWrite, keys: [`+keys+`]}]
`), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(`"*"`)
	s := startServer(t, inMemory(), func(c *server.Config) { c.PasswordFile, c.PolicyFile = pw, pol })
	connected := make(chan *rawClient, 1)
	go func() {
		c, _, _ := connectRaw(t, "bob-1", rawOpts{cleanStart: true, conn: dialTCP(t, s.Addr()), username: "bob", password: "b"})
		connected <- c
	}()
	time.Sleep(15 * time.Millisecond) // into the password check
	write(`"bob/*"`)
	if err := s.Reload(); err != nil {
		t.Fatal(err)
	}
	c := <-connected
	if c == nil {
		t.Fatal("bob refused")
	}
	expectPayload(t, c.call("SET", "admin/config", "x"), "-ERR not authorized\r\n")
	expectPayload(t, c.call("SET", "bob/k", "x"), "+OK\r\n")
}

// TestPolicyReloadJudgesOfflineSessions: a session whose client is away
// keeps taking the messages its subscriptions match. When the client
// resumes, what the policy no longer allows it (changed by a reload while
// it was away) is neither resent nor kept. Before, mochi resent the queued
// messages before the subscriptions were judged, and nothing judged the
// messages.
func TestPolicyReloadJudgesOfflineSessions(t *testing.T) {
	pw := writePasswords(t, "bob", "b", "pub", "p")
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	write := func(bobTopics string) {
		if err := os.WriteFile(pol, []byte(`rules:
  - principals: {usernames: ["bob"]}
    brokerResources: [{method: Connect}, {method: Subscribe, topics: [`+bobTopics+`]}]
  - principals: {usernames: ["pub"]}
    brokerResources: [{method: Connect}, {method: Publish, topics: ["#"]}]
`), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(`"secret/#", "public/#"`)
	s := startServer(t, inMemory(), func(c *server.Config) { c.PasswordFile, c.PolicyFile = pw, pol })
	dial := func(id, user, pass string, clean bool) *rawClient {
		c, ack, _ := connectRaw(t, id, rawOpts{cleanStart: clean, sessionExpiry: 300, noSubscribe: true, conn: dialTCP(t, s.Addr()), username: user, password: pass})
		if c == nil {
			t.Fatalf("%s refused: %+v", user, ack)
		}
		return c
	}
	bob := dial("bob-1", "bob", "b", true)
	for _, f := range []string{"secret/#", "public/#"} {
		if code := bob.subscribe(f, 1); code != 1 {
			t.Fatalf("SUBACK for %s: 0x%02x", f, code)
		}
	}
	bob.c.Disconnect(&paho.Disconnect{})
	eventually(t, "bob offline", func() bool { return s.Broker().ClientsConnected() == 0 })
	write(`"public/#"`)
	if err := s.Reload(); err != nil {
		t.Fatal(err)
	}
	pub := dial("pub-1", "pub", "p", true)
	ctx := ctxFor(t, 5*time.Second)
	for _, topic := range []string{"secret/plans", "public/news"} {
		if _, err := pub.c.Publish(ctx, &paho.Publish{Topic: topic, QoS: 1, Payload: []byte(topic)}); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "both queued", func() bool { return s.Broker().Traffic().Inflight == 2 })
	bob = dial("bob-1", "bob", "b", false)
	if p, ok := bob.nextPublish(5 * time.Second); !ok || p.Topic != "public/news" {
		t.Fatalf("after resuming: %v %v, want public/news", p, ok)
	}
	expectNoPublish(t, bob, 300*time.Millisecond)
}

func TestPolicyReload(t *testing.T) {
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	write := func(doc string) {
		if err := os.WriteFile(pol, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(`rules:
  - principals: {clientIds: ["c1"]}
    brokerResources:
      - {method: Connect}
      - {method: Subscribe, topics: ["news/#", "alerts"]}
      - {method: Publish, topics: ["news/#", "alerts"]}
    stateStoreResources:
      - {method: ReadWrite, keys: ["a/*"]}
`)
	s := startServer(t, inMemory(), func(c *server.Config) { c.PolicyFile = pol })
	c := dialRaw(t, s, "c1", rawOpts{cleanStart: true})
	c.subscribe("news/#", 1)
	c.subscribe("alerts", 1)
	expectPayload(t, c.call("KEYNOTIFY", "a/1"), "+OK\r\n")
	expectPayload(t, c.call("SET", "b/1", "x"), "-ERR not authorized\r\n")

	write(`rules:
  - principals: {clientIds: ["c1"]}
    brokerResources:
      - {method: Connect}
      - {method: Subscribe, topics: ["alerts"]}
      - {method: Publish, topics: ["news/#", "alerts"]}
    stateStoreResources:
      - {method: ReadWrite, keys: ["b/*"]}
`)
	if err := s.Reload(); err != nil {
		t.Fatal(err)
	}
	// Still connected; the news subscription and the a/1 registration
	// are gone, the alerts subscription stays; b/* is now writable.
	expectPayload(t, c.call("SET", "b/1", "x"), "+OK\r\n")
	expectPayload(t, c.call("SET", "a/1", "x"), "-ERR not authorized\r\n")
	ctx := ctxFor(t, 5*time.Second)
	c.c.Publish(ctx, &paho.Publish{Topic: "news/today", QoS: 1, Payload: []byte("n")})
	c.c.Publish(ctx, &paho.Publish{Topic: "alerts", QoS: 1, Payload: []byte("a")})
	p, ok := c.nextPublish(5 * time.Second)
	if !ok || p.Topic != "alerts" {
		t.Fatalf("after reload got %+v", p)
	}
	expectNoPublish(t, c, 300*time.Millisecond)
	if s.Broker().Counters.SubscriptionsRevoked.Load() != 1 {
		t.Fatalf("revoked %d subscriptions", s.Broker().Counters.SubscriptionsRevoked.Load())
	}
	if s.Service().Counters.RegistrationsActive.Load() != 0 {
		t.Fatal("a/1 registration survived the reload")
	}
	// A broken policy file leaves the running one in force.
	write("rules: [{")
	if err := s.Reload(); err == nil {
		t.Fatal("broken policy accepted")
	}
	expectPayload(t, c.call("SET", "b/2", "x"), "+OK\r\n")
}

// TestPolicyReloadOnSIGHUP drives the binary: SIGHUP reloads the policy.
func TestPolicyReloadOnSIGHUP(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	rule := func(keys string) []byte {
		return []byte("rules:\n  - principals: {clientIds: [\"*\"]}\n    brokerResources: [{method: Connect}]\n    stateStoreResources: [{method: ReadWrite, keys: [\"" + keys + "\"]}]\n")
	}
	os.WriteFile(pol, rule("x/*"), 0o600)
	pidFile := filepath.Join(t.TempDir(), "mqkv.pid")
	p, err := server.Spawn(mqkvBinary(t), "--in-memory", "--policy", pol, "--pid-file", pidFile)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	c := dialRaw(t, p, "sighup", rawOpts{cleanStart: true})
	expectPayload(t, c.call("SET", "y/1", "v"), "-ERR not authorized\r\n")
	os.WriteFile(pol, rule("y/*"), 0o600)
	// kill -HUP "$(cat mqkv.pid)", as docs/security.md says.
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatalf("--pid-file: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("--pid-file holds %q", b)
	}
	if err := syscall.Kill(pid, syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the policy reload on SIGHUP", func() bool { return string(c.call("SET", "y/1", "v").Payload) == "+OK\r\n" })
	expectPayload(t, c.call("SET", "x/1", "v"), "-ERR not authorized\r\n")
	p.Stop()
	if _, err := os.Stat(pidFile); !os.IsNotExist(err) {
		t.Fatalf("the pid file outlived the server: %v", err)
	}
}

func TestStartRefusesBadSecurityFiles(t *testing.T) {
	p := newPKI(t)
	garbage := filepath.Join(p.dir, "garbage.pem")
	os.WriteFile(garbage, []byte("not a certificate"), 0o600)
	cases := map[string]func(*server.Config){
		"missing cert": func(c *server.Config) {
			c.TLSListen, c.TLSCert, c.TLSKey = "127.0.0.1:0", filepath.Join(p.dir, "nope.crt"), p.serverKey
		},
		"garbage cert":      func(c *server.Config) { c.TLSListen, c.TLSCert, c.TLSKey = "127.0.0.1:0", garbage, p.serverKey },
		"key of no cert":    func(c *server.Config) { c.TLSListen, c.TLSCert, c.TLSKey = "127.0.0.1:0", p.serverCert, garbage },
		"garbage client CA": func(c *server.Config) { withTLS(p, false)(c); c.TLSClientCA = garbage },
		"missing client CA": func(c *server.Config) { withTLS(p, false)(c); c.TLSClientCA = filepath.Join(p.dir, "nope") },
		"missing passwords": func(c *server.Config) { c.PasswordFile = filepath.Join(p.dir, "nope") },
		"garbage passwords": func(c *server.Config) { c.PasswordFile = garbage },
		"broken policy":     func(c *server.Config) { c.PolicyFile = garbage },
		"cert without TLS":  func(c *server.Config) { c.TLSCert = p.serverCert },
	}
	for name, opt := range cases {
		cfg := server.Config{Listen: "127.0.0.1:0", InMemory: true, Logger: quietLogger()}
		opt(&cfg)
		if s, err := server.Start(cfg); err == nil {
			s.Close()
			t.Errorf("%s: server started", name)
		} else if !strings.Contains(err.Error(), "tls") && !strings.Contains(err.Error(), "password") && !strings.Contains(err.Error(), "policy") && !strings.Contains(err.Error(), "listener") {
			t.Errorf("%s: unclear error %q", name, err)
		}
	}
}

// wsNetConn adapts a client WebSocket to net.Conn for paho.
type wsNetConn struct {
	*websocket.Conn
	buf []byte
	wmu sync.Mutex // paho writes from several goroutines
}

func (c *wsNetConn) Read(p []byte) (int, error) {
	for len(c.buf) == 0 {
		_, b, err := c.ReadMessage()
		if err != nil {
			return 0, err
		}
		c.buf = b
	}
	n := copy(p, c.buf)
	c.buf = c.buf[n:]
	return n, nil
}

func (c *wsNetConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return len(p), c.WriteMessage(websocket.BinaryMessage, p)
}

func (c *wsNetConn) SetDeadline(t time.Time) error {
	c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

func TestSecureWebSocket(t *testing.T) {
	p := newPKI(t)
	s := startServer(t, inMemory(), withTLS(p, false), func(c *server.Config) { c.WSListen, c.WSTLS = "127.0.0.1:0", true })
	pool := x509.NewCertPool()
	pool.AddCert(p.ca.Cert)
	d := websocket.Dialer{Subprotocols: []string{"mqtt"}, TLSClientConfig: &tls.Config{RootCAs: pool, ServerName: "localhost"}}
	ws, _, err := d.Dial("wss://"+s.Addrs()["wss"]+"/mqtt", nil)
	if err != nil {
		t.Fatal(err)
	}
	c := dialRaw(t, s, "wss-client", rawOpts{cleanStart: true, conn: &wsNetConn{Conn: ws}})
	expectPayload(t, c.call("PING"), "+PONG\r\n")
}

// A configured policy file that is missing stops the start, and a reload
// that finds it missing keeps the running policy: a typo or an editor's
// rename must not turn authorization off.
func TestMissingPolicyFile(t *testing.T) {
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	cfg := server.Config{Listen: "127.0.0.1:0", InMemory: true, Logger: quietLogger(), PolicyFile: pol}
	if s, err := server.Start(cfg); err == nil {
		s.Close()
		t.Fatal("started with a missing policy file")
	}
	os.WriteFile(pol, []byte("rules: [{principals: {clientIds: [c]}, brokerResources: [{method: Connect}], stateStoreResources: [{method: Read, keys: ['*']}]}]"), 0o600)
	s := startServer(t, inMemory(), func(c *server.Config) { c.PolicyFile = pol })
	c := dialRaw(t, s, "c", rawOpts{cleanStart: true})
	expectPayload(t, c.call("SET", "k", "v"), "-ERR not authorized\r\n")
	os.Remove(pol)
	if err := s.Reload(); err == nil {
		t.Fatal("reload with the policy file gone succeeded")
	}
	expectPayload(t, c.call("SET", "k", "v"), "-ERR not authorized\r\n")
}

// TestPasswdCommand writes a password file with the binary, as an operator
// would, and logs in with it.
func TestPasswdCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	file := filepath.Join(t.TempDir(), "passwd")
	run := func(stdin string, args ...string) {
		t.Helper()
		cmd := exec.Command(mqkvBinary(t), append([]string{"passwd"}, args...)...)
		cmd.Stdin = strings.NewReader(stdin)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("mqkv passwd %v: %v\n%s", args, err, out)
		}
	}
	run("first\n", file, "alice")
	run("second\n", file, "alice") // change
	run("b\n", file, "bob")
	run("", "--delete", file, "bob")
	// At a terminal (script(1) gives it one) the password is asked twice;
	// two different answers change nothing.
	if script, err := exec.LookPath("script"); err == nil {
		tty := func(answers string) error {
			cmd := exec.Command(script, "-qec", mqkvBinary(t)+" passwd "+file+" carol", "/dev/null")
			cmd.Stdin = strings.NewReader(answers)
			out, err := cmd.CombinedOutput()
			if !strings.Contains(string(out), "Again:") {
				t.Fatalf("passwd at a terminal did not ask twice:\n%s", out)
			}
			return err
		}
		if err := tty("c4rol-pw\nsomething-else\n"); err == nil {
			t.Fatal("passwd accepted two different passwords")
		}
		if b, _ := os.ReadFile(file); strings.Contains(string(b), "carol:") {
			t.Fatal("two different passwords changed the file")
		}
		if err := tty("c4rol-pw\nc4rol-pw\n"); err != nil {
			t.Fatalf("passwd at a terminal: %v", err)
		}
	}
	s := startServer(t, inMemory(), func(c *server.Config) { c.PasswordFile = file })
	conn := dialTCP(t, s.Addr())
	if _, _, err := connectRaw(t, "alice", rawOpts{cleanStart: true, conn: conn, username: "alice", password: "second"}); err != nil {
		t.Fatalf("alice with her new password: %v", err)
	}
	conn = dialTCP(t, s.Addr())
	if _, ack, _ := connectRaw(t, "bob", rawOpts{conn: conn, username: "bob", password: "b"}); ack == nil || ack.ReasonCode != 0x86 {
		t.Fatalf("deleted bob: %+v", ack)
	}
	if b, _ := os.ReadFile(file); strings.Contains(string(b), "carol:") {
		conn = dialTCP(t, s.Addr())
		if _, _, err := connectRaw(t, "carol", rawOpts{cleanStart: true, conn: conn, username: "carol", password: "c4rol-pw"}); err != nil {
			t.Fatalf("carol, whose password was typed at a terminal: %v", err)
		}
	}
}

// TestOfflineSessionGetsNoOthersNotifications: an offline session
// subscribed to "#" under a policy takes every message its subscription
// matches, other clients' notifications included (judged when the client
// returns). On resume they are dropped, as they would be refused online.
func TestOfflineSessionGetsNoOthersNotifications(t *testing.T) {
	pw := writePasswords(t, "dash", "d", "w", "w")
	pol := filepath.Join(t.TempDir(), "policy.yaml")
	os.WriteFile(pol, []byte(`rules:
  - principals: {usernames: ["dash"]}
    brokerResources: [{method: Connect}, {method: Subscribe, topics: ["#"]}]
  - principals: {usernames: ["w"]}
    brokerResources: [{method: Connect}]
    stateStoreResources: [{method: ReadWrite, keys: ["*"]}]
`), 0o600)
	s := startServer(t, inMemory(), func(c *server.Config) { c.PasswordFile, c.PolicyFile = pw, pol })
	dial := func(id, user, pass string, clean bool, sub bool) *rawClient {
		c, ack, _ := connectRaw(t, id, rawOpts{cleanStart: clean, sessionExpiry: 300, noSubscribe: !sub, conn: dialTCP(t, s.Addr()), username: user, password: pass})
		if c == nil {
			t.Fatalf("%s refused: %+v", user, ack)
		}
		return c
	}
	dash := dial("dash-1", "dash", "d", true, false)
	if code := dash.subscribe("#", 1); code != 1 {
		t.Fatalf("SUBACK 0x%02x", code)
	}
	dash.c.Disconnect(&paho.Disconnect{})
	eventually(t, "dash offline", func() bool { return s.Broker().ClientsConnected() == 0 })
	w := dial("w-1", "w", "w", true, true)
	expectPayload(t, w.call("KEYNOTIFY", "secret"), "+OK\r\n")
	expectPayload(t, w.call("SET", "secret", "s3cr3t"), "+OK\r\n")
	eventually(t, "the notification queued", func() bool { return s.Broker().Traffic().Inflight >= 1 })
	dash = dial("dash-1", "dash", "d", false, false)
	for {
		p, ok := dash.nextPublish(time.Second)
		if !ok {
			break
		}
		if strings.HasPrefix(p.Topic, statestore.NotifyPrefix) {
			t.Fatalf("dash got another client's notification on resume: %s %q", p.Topic, p.Payload)
		}
	}
}

// TestGoClientOverTLS: the Go client over tls://, many requests at once on
// one connection while a watch is notified: paho writes a packet as up to
// four buffers, which a TLS connection would send as records of their own
// and could interleave between goroutines; the client gathers each
// packet whole (client/conn.go).
func TestGoClientOverTLS(t *testing.T) {
	p := newPKI(t)
	s := startServer(t, inMemory(), withTLS(p, false))
	pool := x509.NewCertPool()
	pool.AddCert(p.ca.Cert)
	ctx := ctxFor(t, 60*time.Second)
	c, err := client.Dial(ctx, client.Config{URL: "tls://" + s.Addrs()["tls"], TLS: &tls.Config{RootCAs: pool, ServerName: "localhost"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	w, err := c.Watch(ctx, []byte("tls/watched"))
	if err != nil {
		t.Fatal(err)
	}
	const workers, each = 16, 40
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				k := []byte(fmt.Sprintf("tls/%d/%d", g, i))
				v := bytes.Repeat([]byte{byte('a' + g)}, 100+i*37) // sizes vary
				if _, err := c.Set(ctx, k, v); err != nil {
					errs <- err
					return
				}
				if got, err := c.Get(ctx, k); err != nil || !bytes.Equal(got.Value, v) {
					errs <- fmt.Errorf("GET %s: %d bytes, %v", k, len(got.Value), err)
					return
				}
				if g == 0 {
					if _, err := c.Set(ctx, []byte("tls/watched"), []byte(fmt.Sprint(i))); err != nil {
						errs <- err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for i := range each {
		select {
		case e := <-w.Events():
			if string(e.Value) != fmt.Sprint(i) {
				t.Fatalf("notification %d: %q", i, e.Value)
			}
		case <-ctx.Done():
			t.Fatalf("notification %d did not come", i)
		}
	}
}
