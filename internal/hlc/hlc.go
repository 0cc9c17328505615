// Package hlc implements the hybrid logical clock whose timestamps are the
// state store's key versions and fencing tokens, in the wire form the AIO
// clients read and write ("%015d:%05d:%s": unix ms, counter, node id).
package hlc

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

// MaxDrift is how far ahead of the local wall clock a timestamp may be before
// it is rejected; every AIO SDK uses the same minute.
const MaxDrift = 60 * time.Second

// MaxCounter keeps counters within what the .NET client parses (an int32),
// one below its maximum: a client's clock adds one to the counter of a
// version it merges, and .NET's refuses to pass int32's maximum. When a
// counter would pass it, the clock moves its wall part one millisecond
// forward instead, which keeps timestamps strictly increasing.
const MaxCounter = 1<<31 - 2

var (
	// ErrMalformed is returned for a string that is not a timestamp.
	ErrMalformed = errors.New("hlc: malformed timestamp")
	// ErrSkew is returned for a timestamp too far ahead of the local clock.
	ErrSkew = errors.New("hlc: timestamp too far in the future")
)

// Timestamp is one hybrid logical clock reading. The zero value means "none".
type Timestamp struct {
	Wall    int64  // milliseconds since the Unix epoch
	Counter uint64 // logical counter within the millisecond
	Node    string // id of the node that issued it; never contains ':'
}

// IsZero reports whether t is the zero value (no timestamp).
func (t Timestamp) IsZero() bool { return t.Wall == 0 && t.Counter == 0 && t.Node == "" }

// String renders t in the wire form shared by all AIO SDKs.
func (t Timestamp) String() string {
	// On the stack unless the node id is long: a reply carries its key's
	// version as a string, and this is then its only allocation.
	var buf [64]byte
	return string(t.Append(buf[:0]))
}

// Append appends the wire form of t to b.
func (t Timestamp) Append(b []byte) []byte {
	b = appendPadded(b, uint64(t.Wall), 15)
	b = append(b, ':')
	b = appendPadded(b, t.Counter, 5)
	b = append(b, ':')
	return append(b, t.Node...)
}

func appendPadded(b []byte, v uint64, width int) []byte {
	var tmp [20]byte
	d := strconv.AppendUint(tmp[:0], v, 10)
	for i := len(d); i < width; i++ {
		b = append(b, '0')
	}
	return append(b, d...)
}

// Compare orders timestamps by wall time, then counter, then node id
// (ordinal), the order every AIO SDK uses for fencing tokens.
func (t Timestamp) Compare(u Timestamp) int {
	switch {
	case t.Wall < u.Wall:
		return -1
	case t.Wall > u.Wall:
		return 1
	case t.Counter < u.Counter:
		return -1
	case t.Counter > u.Counter:
		return 1
	}
	return strings.Compare(t.Node, u.Node)
}

// Parse reads a timestamp in wire form. It accepts what any of the SDKs
// writes: exactly three ':'-separated parts, unsigned decimal wall time and
// counter (padding optional), and any node id. An empty string is malformed.
func Parse(s string) (Timestamp, error) {
	i := strings.IndexByte(s, ':')
	if i < 0 {
		return Timestamp{}, ErrMalformed
	}
	j := strings.IndexByte(s[i+1:], ':')
	if j < 0 {
		return Timestamp{}, ErrMalformed
	}
	j += i + 1
	node := s[j+1:]
	if strings.IndexByte(node, ':') >= 0 {
		return Timestamp{}, ErrMalformed
	}
	wall, ok := parseDigits(s[:i], 1<<62)
	if !ok {
		return Timestamp{}, ErrMalformed
	}
	counter, ok := parseDigits(s[i+1:j], 1<<63)
	if !ok {
		return Timestamp{}, ErrMalformed
	}
	return Timestamp{Wall: int64(wall), Counter: counter, Node: node}, nil
}

// parseDigits parses a non-empty run of ASCII digits no greater than limit.
// strconv would also accept signs and underscores, which no SDK writes.
func parseDigits(s string, limit uint64) (uint64, bool) {
	if s == "" || len(s) > 20 {
		return 0, false
	}
	var v uint64
	for k := 0; k < len(s); k++ {
		c := s[k]
		if c < '0' || c > '9' {
			return 0, false
		}
		d := uint64(c - '0')
		if v > (limit-d)/10 {
			return 0, false
		}
		v = v*10 + d
	}
	return v, true
}

// Clock issues strictly increasing timestamps for one node. It is safe for
// concurrent use. The zero value is not usable; use New.
type Clock struct {
	mu   sync.Mutex
	last Timestamp
	node string
	now  func() time.Time
}

// New returns a clock for the node id (which must not contain ':'). now is
// the wall clock; nil means time.Now.
func New(node string, now func() time.Time) (*Clock, error) {
	if node == "" || strings.IndexByte(node, ':') >= 0 {
		return nil, fmt.Errorf("hlc: invalid node id %q: must be non-empty and contain no ':'", node)
	}
	if now == nil {
		now = time.Now
	}
	return &Clock{node: node, now: now}, nil
}

// Node returns the node id stamped into every timestamp the clock issues.
func (c *Clock) Node() string { return c.node }

// WallMillis returns the wall clock in Unix milliseconds.
func (c *Clock) WallMillis() int64 { return c.now().UnixMilli() }

// CheckSkew reports ErrSkew if t is more than MaxDrift ahead of the wall clock.
func (c *Clock) CheckSkew(t Timestamp) error {
	if t.Wall > c.WallMillis()+MaxDrift.Milliseconds() {
		return ErrSkew
	}
	return nil
}

// Now issues a new timestamp, greater than every one issued or observed.
func (c *Clock) Now() Timestamp {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tick(Timestamp{}, c.WallMillis())
}

// Update issues a new timestamp strictly greater than remote and than every
// timestamp issued or observed before (the HLC receive rule). Callers check
// remote with CheckSkew first: Update trusts it.
func (c *Clock) Update(remote Timestamp) Timestamp {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tick(remote, c.WallMillis())
}

// UpdateAt is Update with wall (Unix ms) for the wall clock's reading: a
// caller issuing several timestamps at once reads the clock once (a
// reading costs about a tenth of a microsecond on a virtual machine).
// A stale reading only moves the counter on.
func (c *Clock) UpdateAt(remote Timestamp, wall int64) Timestamp {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tick(remote, wall)
}

// Observe merges t into the clock without issuing a timestamp, so later
// timestamps are greater than t. Replicas call it for every applied version,
// so that whichever node leads next continues above them.
func (c *Clock) Observe(t Timestamp) {
	c.mu.Lock()
	defer c.mu.Unlock()
	// Only wall and counter matter: every later tick moves past them, so a
	// greater node id at the same reading needs no special case.
	if t.Wall > c.last.Wall || (t.Wall == c.last.Wall && t.Counter > c.last.Counter) {
		c.last = Timestamp{Wall: t.Wall, Counter: t.Counter, Node: c.node}
	}
}

func (c *Clock) tick(remote Timestamp, wall int64) Timestamp {
	last := c.last
	switch {
	case wall > last.Wall && wall > remote.Wall:
		c.last = Timestamp{Wall: wall, Node: c.node}
	case last.Wall == remote.Wall:
		c.last.Counter = max(last.Counter, remote.Counter)
		c.bump()
	case last.Wall > remote.Wall:
		c.bump()
	default:
		c.last = Timestamp{Wall: remote.Wall, Counter: remote.Counter, Node: c.node}
		c.bump()
	}
	return c.last
}

func (c *Clock) bump() {
	if c.last.Counter >= MaxCounter {
		c.last.Wall++
		c.last.Counter = 0
		return
	}
	c.last.Counter++
}
