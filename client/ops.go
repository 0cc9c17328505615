package client

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/resp"
)

// ServerError is an error the state store answered with ("-ERR <text>").
// Compare with the constants below.
type ServerError = resp.Error

// The state store's errors, as every AIO SDK knows them.
const (
	ErrTimestampSkew            = resp.ErrTimestampSkew
	ErrMissingFencingToken      = resp.ErrMissingFencingToken
	ErrFencingTokenSkew         = resp.ErrFencingTokenSkew
	ErrFencingTokenLowerVersion = resp.ErrFencingTokenLowerVersion
	ErrQuotaExceeded            = resp.ErrQuotaExceeded
	ErrSyntax                   = resp.ErrSyntax
	ErrNotAuthorized            = resp.ErrNotAuthorized
	ErrUnknownCommand           = resp.ErrUnknownCommand
	ErrWrongNumberOfArguments   = resp.ErrWrongNumberOfArguments
	ErrTimestampMissing         = resp.ErrTimestampMissing
	ErrTimestampMalformed       = resp.ErrTimestampMalformed
	ErrKeyLengthZero            = resp.ErrKeyLengthZero
	// mqkv's INCRBY (Add): the key holds no integer, or the sum does not
	// fit in 64 bits.
	ErrNotInteger = resp.ErrNotInteger
	ErrOverflow   = resp.ErrOverflow
)

// Condition restricts when a SET applies.
type Condition string

const (
	Always          Condition = ""
	NotExists       Condition = "NX"  // only if the key does not exist
	NotExistsOrSame Condition = "NEX" // only if absent or holding the same value (lease renewal)
)

// Option modifies a write.
type Option func(*options)

type options struct {
	cond    Condition
	ttl     time.Duration
	fence   Version
	version *Version // VER: apply only if the key holds this version (zero: absent)
}

// If sets the condition of a SET.
func If(c Condition) Option { return func(o *options) { o.cond = c } }

// WithTTL makes the key expire after d (rounded up to a millisecond).
func WithTTL(d time.Duration) Option { return func(o *options) { o.ttl = d } }

// IfVersion applies a SET or DEL only if the key's version is still v (its
// zero value: only if the key does not exist) — optimistic concurrency, the
// mqkv extension VER. A mismatch is "not applied" and reports the current
// version.
func IfVersion(v Version) Option { return func(o *options) { o.version = &v } }

// WithFencingToken sends a fencing token: the write applies only if it is
// not lower than the token protecting the key, and then protects it.
func WithFencingToken(t Version) Option { return func(o *options) { o.fence = t } }

func apply(opts []Option) options {
	var o options
	for _, f := range opts {
		f(&o)
	}
	return o
}

func (o options) props() []paho.UserProperty {
	if o.fence.IsZero() {
		return nil
	}
	return []paho.UserProperty{{Key: "__ft", Value: o.fence.String()}}
}

// SetResult says whether a SET applied, and the key's version: the new one,
// or the current one when the condition failed.
type SetResult struct {
	Applied bool
	Version Version
}

// Set stores value under key.
func (c *Client) Set(ctx context.Context, key, value []byte, opts ...Option) (SetResult, error) {
	res, _, err := c.set(ctx, key, value, false, opts)
	return res, err
}

// Swap is Set that also returns the value it replaced (found false when the
// key did not exist), atomically: the mqkv extension SET ... GET.
func (c *Client) Swap(ctx context.Context, key, value []byte, opts ...Option) (res SetResult, previous Value, err error) {
	return c.set(ctx, key, value, true, opts)
}

func (c *Client) set(ctx context.Context, key, value []byte, get bool, opts []Option) (SetResult, Value, error) {
	o := apply(opts)
	args := [][]byte{[]byte("SET"), key, value}
	if o.cond != Always {
		args = append(args, []byte(o.cond))
	}
	args = o.appendVersion(args)
	if o.ttl < 0 {
		return SetResult{}, Value{}, fmt.Errorf("client: negative TTL %v", o.ttl)
	}
	if o.ttl > 0 {
		ms := (o.ttl + time.Millisecond - 1) / time.Millisecond
		args = append(args, []byte("PX"), []byte(strconv.FormatInt(int64(ms), 10)))
	}
	if get {
		args = append(args, []byte("GET"))
	}
	r, err := c.request(ctx, args, o.props()...)
	if err != nil {
		return SetResult{}, Value{}, err
	}
	switch {
	case r.Kind == resp.SimpleString && string(r.Str) == "OK" && !get:
		return SetResult{Applied: true, Version: r.version}, Value{}, nil
	case r.Kind == resp.BulkString && get:
		return SetResult{Applied: true, Version: r.version}, Value{Found: !r.Null, Value: r.Str}, nil
	case r.Kind == resp.Integer && r.Int == -1:
		return SetResult{Version: r.version}, Value{}, nil
	}
	return SetResult{}, Value{}, unexpected("SET", r.Value)
}

func (o options) appendVersion(args [][]byte) [][]byte {
	if o.version == nil {
		return args
	}
	v := []byte("0")
	if !o.version.IsZero() {
		v = []byte(o.version.String())
	}
	return append(args, []byte("VER"), v)
}

// Value is a GET result. Found is false for a missing key.
type Value struct {
	Found   bool
	Value   []byte
	Version Version
}

// Get reads key.
func (c *Client) Get(ctx context.Context, key []byte) (Value, error) {
	r, err := c.request(ctx, [][]byte{[]byte("GET"), key})
	if err != nil {
		return Value{}, err
	}
	if r.Kind != resp.BulkString {
		return Value{}, unexpected("GET", r.Value)
	}
	if r.Null {
		return Value{}, nil
	}
	return Value{Found: true, Value: r.Str, Version: r.version}, nil
}

// DelResult is a DEL or VDEL result: Deleted is 1 when the key was deleted,
// 0 when it did not exist, -1 when VDEL found a different value. Version is
// the deleted entry's.
type DelResult struct {
	Deleted int
	Version Version
}

// Del deletes key. WithFencingToken and IfVersion apply (with IfVersion, a
// mismatch is Deleted -1 with the key's current version).
func (c *Client) Del(ctx context.Context, key []byte, opts ...Option) (DelResult, error) {
	o := apply(opts)
	return c.del(ctx, o.appendVersion([][]byte{[]byte("DEL"), key}), o)
}

// VDel deletes key if it holds value. Only WithFencingToken applies.
func (c *Client) VDel(ctx context.Context, key, value []byte, opts ...Option) (DelResult, error) {
	return c.del(ctx, [][]byte{[]byte("VDEL"), key, value}, apply(opts))
}

func (c *Client) del(ctx context.Context, args [][]byte, o options) (DelResult, error) {
	r, err := c.request(ctx, args, o.props()...)
	if err != nil {
		return DelResult{}, err
	}
	if r.Kind != resp.Integer {
		return DelResult{}, unexpected(string(args[0]), r.Value)
	}
	return DelResult{Deleted: int(r.Int), Version: r.version}, nil
}

// TTL returns how long key has left to live: found is false for a missing
// key, and a zero ttl with found means it does not expire (the mqkv
// extension PTTL).
func (c *Client) TTL(ctx context.Context, key []byte) (ttl time.Duration, found bool, err error) {
	r, err := c.request(ctx, [][]byte{[]byte("PTTL"), key})
	if err != nil {
		return 0, false, err
	}
	if r.Kind != resp.Integer {
		return 0, false, unexpected("PTTL", r.Value)
	}
	switch {
	case r.Int == -2:
		return 0, false, nil
	case r.Int < 0:
		return 0, true, nil
	}
	return time.Duration(r.Int) * time.Millisecond, true, nil
}

// Scan returns the keys matching pattern (a glob), a page at a time, in
// key order, as the mqkv extension SCAN serves them: fn is called for each
// key until it returns false. A key present for the whole scan is seen
// exactly once even while other keys change. count bounds a page (0: the
// server's default).
func (c *Client) Scan(ctx context.Context, pattern []byte, count int, fn func(key []byte) bool) error {
	var token []byte
	for {
		args := [][]byte{[]byte("SCAN"), pattern}
		if token != nil {
			args = append(args, token)
		}
		if count > 0 {
			args = append(args, []byte("COUNT"), []byte(strconv.Itoa(count)))
		}
		r, err := c.request(ctx, args)
		if err != nil {
			return err
		}
		if r.Kind != resp.Array || len(r.Elems) < 1 || len(r.Elems) > 2 || r.Elems[0].Kind != resp.Array {
			return unexpected("SCAN", r.Value)
		}
		for _, k := range r.Elems[0].Elems {
			if !fn(k.Str) {
				return nil
			}
		}
		if len(r.Elems) == 1 {
			return nil
		}
		token = r.Elems[1].Str
	}
}

// Add adds delta (negative: takes it away) to the signed 64-bit integer
// key holds, a key that does not exist counting as 0, and returns the new
// number and the key's new version: the mqkv extension INCRBY, which the
// log applies to whatever the key holds then, so that concurrent Adds
// never conflict and each counts once. The key keeps its expiry. A key
// that holds something else than an integer in decimal is ErrNotInteger,
// a sum beyond 64 bits ErrOverflow. WithFencingToken applies.
func (c *Client) Add(ctx context.Context, key []byte, delta int64, opts ...Option) (int64, Version, error) {
	o := apply(opts)
	r, err := c.request(ctx, [][]byte{[]byte("INCRBY"), key, strconv.AppendInt(nil, delta, 10)}, o.props()...)
	if err != nil {
		return 0, Version{}, err
	}
	if r.Kind != resp.Integer {
		return 0, Version{}, unexpected("INCRBY", r.Value)
	}
	return r.Int, r.version, nil
}

// Ping asks the server to answer (an mqkv extension).
func (c *Client) Ping(ctx context.Context) error {
	r, err := c.request(ctx, [][]byte{[]byte("PING")})
	if err == nil && (r.Kind != resp.SimpleString || string(r.Str) != "PONG") {
		err = unexpected("PING", r.Value)
	}
	return err
}
