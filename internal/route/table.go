package route

import (
	"slices"
	"strings"
)

// Table is the interest of the other nodes of a cluster: for each node,
// the topic filters its clients subscribe to (shared subscriptions by
// group), as the node last said. It answers which nodes want a topic.
// Pure and not safe for concurrent use: its owner locks.
//
// Filters are kept in a tree of their levels, so that a lookup costs the
// topic's levels, not the number of filters; each filter's end holds the
// nodes that want it.
type Table struct {
	root  *level
	nodes map[string]map[string]struct{} // node → its filters, as given
	gen   uint64
}

type level struct {
	next   map[string]*level         // by the next level's word ('+' and '#' too)
	plain  map[string]int            // node → its filters that end here (one, unless a node gives a filter twice)
	shared map[string]map[string]int // group → node → its subscriptions of that group ending here
}

// Want is what the nodes want of one topic: Plain are the nodes with
// ordinary subscribers, Shared the nodes with members of each shared
// subscription group ($share/name/filter: each message goes to one
// member in all) whose filter matches, by the group's full filter.
type Want struct {
	Plain  []string
	Shared map[string][]string
}

// NewTable returns an empty table.
func NewTable() *Table { return &Table{root: &level{}, nodes: map[string]map[string]struct{}{}} }

// Gen changes whenever the table does: a cache of lookups is good while
// it stays the same.
func (t *Table) Gen() uint64 { return t.gen }

// Set makes node's interest exactly filters (a node's full resync).
func (t *Table) Set(node string, filters []string) {
	want := map[string]struct{}{}
	for _, f := range filters {
		want[f] = struct{}{}
	}
	for f := range t.nodes[node] {
		if _, ok := want[f]; !ok {
			t.Remove(node, f)
		}
	}
	for f := range want {
		t.Add(node, f)
	}
}

// Add records that node has subscribers for filter.
func (t *Table) Add(node, filter string) {
	have := t.nodes[node]
	if have == nil {
		have = map[string]struct{}{}
		t.nodes[node] = have
	}
	if _, ok := have[filter]; ok {
		return
	}
	have[filter] = struct{}{}
	t.gen++
	group, f, shared := splitShared(filter)
	l := t.root
	for _, w := range strings.Split(f, "/") {
		if l.next == nil {
			l.next = map[string]*level{}
		}
		n := l.next[w]
		if n == nil {
			n = &level{}
			l.next[w] = n
		}
		l = n
	}
	if !shared {
		if l.plain == nil {
			l.plain = map[string]int{}
		}
		l.plain[node]++
		return
	}
	if l.shared == nil {
		l.shared = map[string]map[string]int{}
	}
	if l.shared[group] == nil {
		l.shared[group] = map[string]int{}
	}
	l.shared[group][node]++
}

// Remove records that node no longer has subscribers for filter.
func (t *Table) Remove(node, filter string) {
	have := t.nodes[node]
	if _, ok := have[filter]; !ok {
		return
	}
	delete(have, filter)
	if len(have) == 0 {
		delete(t.nodes, node)
	}
	t.gen++
	group, f, shared := splitShared(filter)
	words := strings.Split(f, "/")
	path := []*level{t.root}
	l := t.root
	for _, w := range words {
		l = l.next[w]
		if l == nil {
			return
		}
		path = append(path, l)
	}
	if !shared {
		if l.plain[node]--; l.plain[node] <= 0 {
			delete(l.plain, node)
		}
	} else if g := l.shared[group]; g != nil {
		if g[node]--; g[node] <= 0 {
			delete(g, node)
		}
		if len(g) == 0 {
			delete(l.shared, group)
		}
	}
	// Empty levels go, from the end up.
	for i := len(path) - 1; i > 0; i-- {
		n := path[i]
		if len(n.next) > 0 || len(n.plain) > 0 || len(n.shared) > 0 {
			break
		}
		delete(path[i-1].next, words[i-1])
	}
}

// Drop forgets node's interest (a node gone).
func (t *Table) Drop(node string) {
	for f := range t.nodes[node] {
		t.Remove(node, f)
	}
}

// Filters returns node's filters, sorted.
func (t *Table) Filters(node string) []string {
	out := make([]string, 0, len(t.nodes[node]))
	for f := range t.nodes[node] {
		out = append(out, f)
	}
	slices.Sort(out)
	return out
}

// Size is the number of (node, filter) pairs.
func (t *Table) Size() int {
	n := 0
	for _, fs := range t.nodes {
		n += len(fs)
	}
	return n
}

// Match returns the nodes that want topic, each once, sorted.
func (t *Table) Match(topic string) Want {
	var w Want
	plain := map[string]struct{}{}
	var shared map[string]map[string]struct{}
	var walk func(l *level, words []string, first bool)
	collect := func(l *level) {
		for n := range l.plain {
			plain[n] = struct{}{}
		}
		for g, nodes := range l.shared {
			if shared == nil {
				shared = map[string]map[string]struct{}{}
			}
			if shared[g] == nil {
				shared[g] = map[string]struct{}{}
			}
			for n := range nodes {
				shared[g][n] = struct{}{}
			}
		}
	}
	walk = func(l *level, words []string, first bool) {
		// '#' matches the rest, the parent level included; neither it
		// nor '+' matches a first level starting with '$' (MQTT-4.7.2-1).
		dollar := first && len(words) > 0 && strings.HasPrefix(words[0], "$")
		if h := l.next["#"]; h != nil && !dollar {
			collect(h)
		}
		if len(words) == 0 {
			collect(l)
			return
		}
		if n := l.next[words[0]]; n != nil {
			walk(n, words[1:], false)
		}
		if p := l.next["+"]; p != nil && !dollar {
			walk(p, words[1:], false)
		}
	}
	walk(t.root, strings.Split(topic, "/"), true)
	for n := range plain {
		w.Plain = append(w.Plain, n)
	}
	slices.Sort(w.Plain)
	for g, nodes := range shared {
		if w.Shared == nil {
			w.Shared = map[string][]string{}
		}
		for n := range nodes {
			w.Shared[g] = append(w.Shared[g], n)
		}
		slices.Sort(w.Shared[g])
	}
	return w
}

// splitShared splits "$share/name/filter" into its group (the whole
// filter, which names it) and filter; shared is false for an ordinary
// filter, returned as it is.
func splitShared(filter string) (group, f string, shared bool) {
	rest, ok := strings.CutPrefix(filter, "$share/")
	if !ok {
		return "", filter, false
	}
	_, f, ok = strings.Cut(rest, "/")
	if !ok {
		return "", filter, false
	}
	return filter, f, true
}
