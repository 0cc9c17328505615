// Package gateway is what the state store's other protocols (RESP today;
// memcached and HTTP to come) share: who a client is, whether it may in,
// what it may do, and one call into the statestore service per command,
// so that every protocol goes through the same checks, authorization,
// limits, log, notifications and metrics as MQTT.
package gateway

import (
	"errors"
	"io"
	"sync/atomic"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/policy"
	"github.com/mqkv/mqkv/internal/resp"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/store"
)

// Guard admits gateway clients with the node's password file and policy,
// read at each use so that a reload (SIGHUP) applies at once.
type Guard interface {
	// Required says a client must authenticate before its first command.
	Required() bool
	// Check reports whether password is user's in the password file.
	Check(user string, password []byte) bool
	// Policy is the authorization policy in force; nil allows everything.
	Policy() *policy.Policy
}

// Open is a Guard that admits everyone and authorizes everything, as a
// node without a password file or policy does.
type Open struct{}

func (Open) Required() bool            { return false }
func (Open) Check(string, []byte) bool { return false }
func (Open) Policy() *policy.Policy    { return nil }

// Service is the part of the statestore service a gateway calls.
type Service interface {
	Do(r *statestore.Request, args [][]byte)
	// Disconnected ends a client's KEYNOTIFY registrations.
	Disconnected(clientID string, conn uint64)
}

// connIDs numbers gateway connections apart from the broker's (which count
// up from 1), so that nothing keyed by (client id, connection) mixes them.
var connIDs atomic.Uint64

func init() { connIDs.Store(1 << 62) }

// ErrNotAuthenticated answers a command before a required AUTH.
var ErrNotAuthenticated = errors.New("authentication required")

// errNotAuthorized answers a client the policy in force does not let in.
var errNotAuthorized = errors.New(string(resp.ErrNotAuthorized))

// Client is one gateway connection: its identity and its calls. Its
// methods are used by one goroutine at a time (the connection's).
type Client struct {
	svc   Service
	guard Guard
	// ID is the client id the policy sees (${client_id}): the protocol's
	// name and the connection's number, as "resp-4611686018427387905".
	ID   string
	conn uint64
	user string
	// authed: the client authenticated, or needs not.
	authed bool
	// Gathered marks the client's requests statestore.Request.Gathered:
	// its writes are sent in rounds (the RESP endpoint's loop).
	Gathered bool

	pol   *policy.Policy // the policy grant was computed from
	grant *policy.Grant

	calls chan answer // AppendCall's, made at its first use
	dst   []byte      // what AppendCall appends to, while it waits
	// call is AppendCall's request, one at a time: the service touches a
	// request no more once it answered (statestore.Replier), and a
	// request made new for each call was a tenth of a pipelined GET's CPU
	// (336 bytes with pointers, allocated and scanned).
	call statestore.Request
}

// NewClient starts a connection's client; protocol names it ("resp").
func NewClient(svc Service, guard Guard, protocol string) *Client {
	conn := connIDs.Add(1)
	c := &Client{svc: svc, guard: guard, conn: conn}
	c.ID = protocol + "-" + uitoa(conn)
	c.authed = !guard.Required()
	return c
}

func uitoa(v uint64) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			return string(b[i:])
		}
	}
}

// Conn is the connection's number.
func (c *Client) Conn() uint64 { return c.conn }

// User is the name the client authenticated as ("" if anonymous).
func (c *Client) User() string { return c.user }

// Authenticated says the client may send commands.
func (c *Client) Authenticated() bool { return c.authed }

// Auth checks user's password; on success the client acts as user from
// then on. An empty user is "default", as Redis has it: the password
// file's user of that name.
func (c *Client) Auth(user string, password []byte) bool {
	if user == "" {
		user = "default"
	}
	if !c.guard.Check(user, password) {
		return false
	}
	c.user, c.authed, c.pol, c.grant = user, true, nil, nil
	if g := c.Grant(); !g.CanConnect() {
		c.user, c.authed = "", !c.guard.Required()
		return false
	}
	return true
}

// AdmitAs lets the client in as user, whose credentials the caller has
// checked lately (an HTTP endpoint remembers them: bcrypt is slow).
func (c *Client) AdmitAs(user string) { c.user, c.authed, c.pol, c.grant = user, true, nil, nil }

// AdmitAnonymous lets the client in without credentials, for a protocol
// that has none (memcached's text protocol): the policy's rules for an
// anonymous principal decide what it may do.
func (c *Client) AdmitAnonymous() { c.user, c.authed, c.pol, c.grant = "", true, nil, nil }

// Grant is what the client may do under the policy in force now.
func (c *Client) Grant() *policy.Grant {
	p := c.guard.Policy()
	if p == nil {
		return nil
	}
	if p != c.pol {
		c.pol, c.grant = p, p.Grant(policy.Principal{ClientID: c.ID, Username: c.user})
	}
	return c.grant
}

// Call runs one state store command (as the MQTT protocol has it) and
// returns its reply and the version it carries (__ts). fence, if not
// empty, is the fencing token (__ft). The service stamps writes with the
// node's clock, as the SDKs stamp theirs (StampWrites).
func (c *Client) Call(fence string, args ...[]byte) (resp.Value, hlc.Timestamp) {
	p, version := c.AppendCall(nil, fence, args...)
	return Parse(p), version
}

// AppendCall is Call with the reply appended to dst as the service
// encodes it (RESP3), for an endpoint that can send it on as it is: a
// bulk string is the same in RESP2 and RESP3, and a GET's value is then
// copied once, into dst, not encoded, parsed and encoded again.
func (c *Client) AppendCall(dst []byte, fence string, args ...[]byte) ([]byte, hlc.Timestamp) {
	if c.calls == nil {
		c.calls = make(chan answer, 1)
	}
	r := &c.call
	if refused := c.fill(r, appender{c}); refused != nil {
		return resp.AppendError(dst, refused.Error()), hlc.Timestamp{}
	}
	r.FencingToken, r.HasFencingToken = fence, fence != ""
	c.dst = dst
	c.svc.Do(r, args)
	a := <-c.calls // one call at a time: the channel serves them all
	c.dst = nil
	return a.payload, a.version
}

// SetIfUnchanged reads key and SETs it to what next makes of the value
// read (the new value, then SET's options such as PX), on condition that
// the key still holds the version read (VER); again if another write came
// between. found is false when the key does not exist (nothing is
// written). v is the SET's reply, or the error that ended it.
func (c *Client) SetIfUnchanged(fence string, key []byte, next func(cur []byte) (value []byte, opts [][]byte)) (v resp.Value, found bool) {
	for range 16 {
		cur, ver := c.Call("", []byte("GET"), key)
		if cur.Kind == resp.ErrorReply {
			return cur, true
		}
		if cur.Null {
			return cur, false
		}
		value, opts := next(cur.Str)
		cmd := append([][]byte{[]byte("SET"), key, value, []byte("VER"), ver.Append(nil)}, opts...)
		if v, _ = c.Call(fence, cmd...); !(v.Kind == resp.Integer && v.Int == -1) {
			return v, true
		}
	}
	return resp.Value{Kind: resp.ErrorReply, Str: []byte("the key changed too often to be written; try again")}, true
}

// Go starts a command as Call does and returns at once (a read may have
// been answered already); done gets the reply, from another goroutine for
// a write, and must not block. args must stay unchanged until then.
func (c *Client) Go(fence string, args [][]byte, done func(resp.Value, hlc.Timestamp)) {
	c.Send(fence, args, replier(done))
}

// Send is Go with the reply handed to to as the service encodes it (see
// Parse); a refusal comes as an error reply. A caller with a Replier of
// its own saves the closure Go's done would be.
func (c *Client) Send(fence string, args [][]byte, to statestore.Replier) {
	c.SendIn(new(statestore.Request), fence, args, to)
}

// SendIn is Send with the request made in r, which the caller keeps
// until the reply (a RESP write's reply slot holds it: one allocation
// fewer per write).
func (c *Client) SendIn(r *statestore.Request, fence string, args [][]byte, to statestore.Replier) {
	if refused := c.fill(r, to); refused != nil {
		to.Reply(nil, resp.AppendError(nil, refused.Error()), hlc.Timestamp{})
		return
	}
	r.FencingToken, r.HasFencingToken = fence, fence != ""
	c.svc.Do(r, args)
}

// request is a Request of the client's, answered through origin; or the
// error that answers it at once (not authenticated, or not let in by the
// policy in force).
func (c *Client) request(origin any) (*statestore.Request, error) {
	r := new(statestore.Request)
	if err := c.fill(r, origin); err != nil {
		return nil, err
	}
	return r, nil
}

// fill makes r a request of the client's (see request).
func (c *Client) fill(r *statestore.Request, origin any) error {
	if !c.authed {
		return ErrNotAuthenticated
	}
	g := c.Grant()
	if !g.CanConnect() {
		return errNotAuthorized
	}
	r.Renew()
	r.ClientID, r.Conn, r.Grant, r.QoS, r.Origin, r.StampWrites, r.Gathered = c.ID, c.conn, g, 1, origin, true, c.Gathered
	return nil
}

// refusal answers a request that request() refused.
func refusal(err error) resp.Value {
	return resp.Value{Kind: resp.ErrorReply, Str: []byte(err.Error())}
}

// Watch registers a KEYNOTIFY (args: KEYNOTIFY key [PATTERN] [SINCE v])
// whose notifications go to notify (on the goroutine that applies the log:
// it must not block, nor keep the event's bytes; false drops one), and
// returns its reply. gap, if not nil, hears (on that goroutine too) that
// changes were lost to this node, so that notifications were missed (see
// statestore.GapNotifier). Close ends the registrations.
func (c *Client) Watch(args [][]byte, notify func(store.Event) bool, gap func()) resp.Value {
	ch := make(chan resp.Value, 1)
	r, refused := c.request(watcher{replier(func(v resp.Value, _ hlc.Timestamp) { ch <- v }), notify, gap})
	if refused != nil {
		return refusal(refused)
	}
	c.svc.Do(r, args)
	return <-ch
}

// Close ends what the client registered.
func (c *Client) Close() { c.svc.Disconnected(c.ID, c.conn) }

// watcher is a watch's Origin: the service replies to it and notifies it.
type watcher struct {
	replier
	notify func(store.Event) bool
	gap    func()
}

func (w watcher) Notify(ev store.Event) bool { return w.notify(ev) }

func (w watcher) Gap() {
	if w.gap != nil {
		w.gap()
	}
}

type answer struct {
	payload []byte
	version hlc.Timestamp
}

// replier hands a request's reply, parsed, to the function that waits for
// it.
type replier func(resp.Value, hlc.Timestamp)

// Reply implements statestore.Replier.
func (f replier) Reply(_ *statestore.Request, payload []byte, version hlc.Timestamp) {
	f(Parse(payload), version)
}

// appender answers AppendCall: it appends the reply to the client's dst.
type appender struct{ c *Client }

// Reply implements statestore.Replier.
func (a appender) Reply(_ *statestore.Request, payload []byte, version hlc.Timestamp) {
	a.c.calls <- answer{append(a.c.dst, payload...), version}
}

// ReplyBulk implements statestore.BulkReplier.
func (a appender) ReplyBulk(_ *statestore.Request, value []byte, version hlc.Timestamp) {
	a.c.calls <- answer{resp.AppendBulk(a.c.dst, value), version}
}

// Parse reads a reply of the service's.
func Parse(payload []byte) resp.Value {
	v, err := resp.ParseReply(payload) // an error's text comes without its "ERR "
	if err != nil {                    // the service's own replies always parse
		v = resp.Value{Kind: resp.ErrorReply, Str: []byte("internal error: " + err.Error())}
	}
	return v
}

// ReadValue reads an n-byte value a client announced. The buffer grows as
// bytes come, so a client that announces a large value and sends nothing
// holds no more memory than it sent.
func ReadValue(r io.Reader, n int) ([]byte, error) {
	b := make([]byte, 0, min(n, 64<<10))
	for len(b) < n {
		chunk := min(n-len(b), 1<<20)
		if cap(b)-len(b) < chunk {
			b = append(b[:cap(b)], make([]byte, chunk)...)[:len(b)]
		}
		got, err := io.ReadFull(r, b[len(b):len(b)+chunk])
		b = b[:len(b)+got]
		if err != nil {
			return nil, NoEOF(err)
		}
	}
	return b, nil
}

// NoEOF turns the end of input inside a command into an unexpected one.
func NoEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}
