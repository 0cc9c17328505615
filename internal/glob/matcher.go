package glob

import (
	"bytes"
	"errors"
)

// MaxElements is how many pattern elements (bytes, '?', classes, '*' runs)
// may follow a compiled pattern's literal prefix.
const MaxElements = 63

// ErrTooComplex is returned by Compile for a pattern with more than
// MaxElements elements after its literal prefix.
var ErrTooComplex = errors.New("glob: pattern too complex")

// Matcher is a compiled pattern. Match runs in time linear in the key
// whatever the pattern: the pattern's positions are simulated in parallel,
// one bit each, so hostile patterns from clients (SCAN, KEYNOTIFY ...
// PATTERN) cannot make matching slow. It matches exactly what Match does.
type Matcher struct {
	prefix []byte
	accept [256]uint64 // for each byte, the positions whose element accepts it
	star   uint64      // positions holding '*'
	final  uint64      // the state reached when every element has matched
}

// Compile compiles pattern.
func Compile(pattern []byte) (*Matcher, error) {
	// The prefix is copied: pattern is often a slice of a request, which
	// a registration would otherwise keep whole.
	m := &Matcher{prefix: bytes.Clone(Literal(pattern))}
	n := 0 // elements so far
	add := func() (uint64, error) {
		if n == MaxElements {
			return 0, ErrTooComplex
		}
		bit := uint64(1) << n
		n++
		return bit, nil
	}
	for p := len(m.prefix); p < len(pattern); {
		c := pattern[p]
		switch {
		case c == '*':
			for p < len(pattern) && pattern[p] == '*' {
				p++ // a run of stars is one star
			}
			bit, err := add()
			if err != nil {
				return nil, err
			}
			m.star |= bit
			continue
		case c == '?':
			bit, err := add()
			if err != nil {
				return nil, err
			}
			for b := range m.accept {
				m.accept[b] |= bit
			}
			p++
			continue
		case c == '[':
			if size, _ := matchClass(pattern[p:], 0); size > 0 {
				bit, err := add()
				if err != nil {
					return nil, err
				}
				for b := range m.accept {
					if _, in := matchClass(pattern[p:], byte(b)); in {
						m.accept[b] |= bit
					}
				}
				p += size
				continue
			}
			// Unterminated: a literal '['.
		case c == '\\':
			bit, err := add()
			if err != nil {
				return nil, err
			}
			if p+1 < len(pattern) {
				m.accept[pattern[p+1]] |= bit
			} // a trailing backslash accepts nothing
			p += 2
			continue
		}
		bit, err := add()
		if err != nil {
			return nil, err
		}
		m.accept[c] |= bit
		p++
	}
	m.final = uint64(1) << n
	return m, nil
}

// Prefix returns the literal prefix every matching key starts with.
func (m *Matcher) Prefix() []byte { return m.prefix }

// Match reports whether key matches the pattern.
func (m *Matcher) Match(key []byte) bool {
	if len(key) < len(m.prefix) || string(key[:len(m.prefix)]) != string(m.prefix) {
		return false
	}
	d := m.closure(1)
	for _, c := range key[len(m.prefix):] {
		d = (d&^m.star&m.accept[c])<<1 | d&m.star
		if d == 0 {
			return false
		}
		d = m.closure(d)
	}
	return d&m.final != 0
}

// closure adds the states reachable without consuming a byte: past a star
// (which may match nothing). Runs of stars are one star, so one step does.
func (m *Matcher) closure(d uint64) uint64 { return d | (d&m.star)<<1 }
