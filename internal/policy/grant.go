package policy

import (
	"bytes"
	"strings"

	"github.com/mqkv/mqkv/internal/glob"
	"github.com/mqkv/mqkv/internal/route"
)

// Grant is what one principal may do under a policy, with every variable
// already substituted. A nil *Grant allows everything: it is what a
// connection gets when no policy is configured.
type Grant struct {
	connect   bool
	publish   []string
	subscribe []string
	read      []keyMatcher
	write     []keyMatcher
}

type keyMatcher struct {
	glob bool
	key  []byte
}

func (m keyMatcher) matches(key []byte) bool {
	if m.glob {
		return glob.Match(m.key, key)
	}
	return bytes.Equal(m.key, key)
}

// Grant compiles what p may do. Call it once per connection (and again
// when the policy changes), not per request.
func (pol *Policy) Grant(p Principal) *Grant {
	g := &Grant{}
	for i := range pol.rules {
		r := &pol.rules[i]
		if !r.applies(&p) {
			continue
		}
		g.connect = g.connect || r.connect
		for _, f := range r.publish {
			if s, ok := substitute(f, &p, topicValue); ok {
				g.publish = append(g.publish, s)
			}
		}
		for _, f := range r.subscribe {
			if s, ok := substitute(f, &p, topicValue); ok {
				g.subscribe = append(g.subscribe, s)
			}
		}
		for _, sr := range r.state {
			for _, k := range sr.keys {
				m := keyMatcher{key: k}
				if sr.kind == keyPattern {
					s, ok := substitute(string(k), &p, globValue)
					if !ok {
						continue
					}
					m = keyMatcher{glob: true, key: []byte(s)}
				}
				if sr.method&Read != 0 {
					g.read = append(g.read, m)
				}
				if sr.method&Write != 0 {
					g.write = append(g.write, m)
				}
			}
		}
	}
	return g
}

// CanConnect reports whether the principal may connect.
func (g *Grant) CanConnect() bool { return g == nil || g.connect }

// CanPublish reports whether the principal may publish to topic.
func (g *Grant) CanPublish(topic string) bool {
	if g == nil {
		return true
	}
	for _, f := range g.publish {
		if route.Match(f, topic) {
			return true
		}
	}
	return false
}

// CanSubscribe reports whether the principal may subscribe to filter. A
// shared subscription ("$share/group/filter") is judged by its filter.
func (g *Grant) CanSubscribe(filter string) bool {
	if g == nil {
		return true
	}
	filter = unshare(filter)
	for _, f := range g.subscribe {
		if route.Covers(f, filter) {
			return true
		}
	}
	return false
}

// CanAccess reports whether the principal may use key with method (Read
// for GET and KEYNOTIFY, Write for SET, DEL, VDEL).
func (g *Grant) CanAccess(key []byte, method Method) bool {
	if g == nil {
		return true
	}
	list := g.read
	if method == Write {
		list = g.write
	}
	for _, m := range list {
		if m.matches(key) {
			return true
		}
	}
	return false
}

// unshare strips "$share/<group>/" from a shared subscription filter.
func unshare(filter string) string {
	if rest, ok := strings.CutPrefix(filter, "$share/"); ok {
		if _, f, ok := strings.Cut(rest, "/"); ok {
			return f
		}
	}
	return filter
}
