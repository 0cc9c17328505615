// Package placement decides where replica groups live: for each group, the
// nodes that hold its replicas, in order of preference (the first is the
// preferred leader). It is a pure function of the node set, the number of
// groups and the replication factor, so every node computes the same table
// from the same membership, and adding or removing a node moves only the
// replicas it must (Aerospike's partition table; rendezvous hashing).
package placement

import (
	"cmp"
	"hash/fnv"
	"slices"
	"strconv"
)

// Table is the placement of every group: Table[g] lists the nodes holding
// group g's replicas, preferred leader first.
type Table [][]string

// Plan places groups replica groups on nodes, rf replicas each (all nodes
// if there are fewer). Nodes are ranked per group by rendezvous hashing of
// (group, node): a node's rank for one group does not depend on the other
// nodes, so a new node takes about rf/N of the replicas and the rest stay
// put. Leadership is spread as evenly as the ranking allows: among a
// group's replicas, the preferred leader is the one that leads the fewest
// groups so far (ties by rank), so with N nodes each leads about 1/N of
// the groups.
func Plan(nodes []string, groups, rf int) Table {
	if len(nodes) == 0 || groups <= 0 || rf <= 0 {
		return make(Table, max(groups, 0))
	}
	rf = min(rf, len(nodes))
	t := make(Table, groups)
	leads := map[string]int{}
	for g := range t {
		ranked := Rank(nodes, g)[:rf]
		best := 0
		for i, n := range ranked {
			if leads[n] < leads[ranked[best]] {
				best = i
			}
		}
		leads[ranked[best]]++
		replicas := make([]string, 0, rf)
		replicas = append(replicas, ranked[best])
		for i, n := range ranked {
			if i != best {
				replicas = append(replicas, n)
			}
		}
		t[g] = replicas
	}
	return t
}

// Rank orders nodes by their rendezvous weight for group g, highest first.
func Rank(nodes []string, g int) []string {
	type weighted struct {
		node string
		w    uint64
	}
	ws := make([]weighted, len(nodes))
	for i, n := range nodes {
		ws[i] = weighted{n, weight(n, g)}
	}
	slices.SortFunc(ws, func(a, b weighted) int {
		if c := cmp.Compare(b.w, a.w); c != 0 {
			return c
		}
		return cmp.Compare(a.node, b.node)
	})
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.node
	}
	return out
}

// weight is the rendezvous weight of node for group g: FNV-1a of both,
// then a 64-bit finalizer so that similar node names spread well. It is
// part of the data layout: changing it moves replicas.
func weight(node string, g int) uint64 {
	h := fnv.New64a()
	h.Write([]byte(node))
	h.Write([]byte{0})
	h.Write([]byte(strconv.Itoa(g)))
	x := h.Sum64()
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// Moves counts the replicas that differ between two tables (replicas to
// add; as many are removed where a node left).
func Moves(from, to Table) int {
	n := 0
	for g := range to {
		for _, node := range to[g] {
			if g >= len(from) || !slices.Contains(from[g], node) {
				n++
			}
		}
	}
	return n
}
