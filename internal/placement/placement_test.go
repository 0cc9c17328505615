package placement

import (
	"fmt"
	"slices"
	"testing"
)

func nodes(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("n%d", i+1)
	}
	return out
}

func TestPlanShape(t *testing.T) {
	for _, tc := range []struct{ nodes, groups, rf, want int }{
		{1, 16, 3, 1}, {2, 16, 3, 2}, {3, 16, 3, 3}, {6, 64, 3, 3}, {5, 8, 5, 5},
	} {
		tab := Plan(nodes(tc.nodes), tc.groups, tc.rf)
		if len(tab) != tc.groups {
			t.Fatalf("%+v: %d groups", tc, len(tab))
		}
		for g, r := range tab {
			if len(r) != tc.want {
				t.Fatalf("%+v: group %d has %d replicas", tc, g, len(r))
			}
			seen := map[string]bool{}
			for _, n := range r {
				if seen[n] {
					t.Fatalf("%+v: group %d has %s twice", tc, g, n)
				}
				seen[n] = true
			}
		}
	}
}

func TestPlanIsDeterministic(t *testing.T) {
	a := Plan([]string{"a", "b", "c", "d"}, 32, 3)
	b := Plan([]string{"d", "c", "b", "a"}, 32, 3)
	for g := range a {
		if !slices.Equal(a[g], b[g]) {
			t.Fatalf("group %d: %v vs %v: the order of the node list matters", g, a[g], b[g])
		}
	}
}

// TestPlanBalancesLeadersAndReplicas: with N nodes, each node leads about
// groups/N groups and holds about rf*groups/N replicas.
func TestPlanBalancesLeadersAndReplicas(t *testing.T) {
	for _, n := range []int{3, 4, 6, 9} {
		const groups, rf = 64, 3
		tab := Plan(nodes(n), groups, rf)
		leads, holds := map[string]int{}, map[string]int{}
		for _, r := range tab {
			leads[r[0]]++
			for _, x := range r {
				holds[x]++
			}
		}
		for _, node := range nodes(n) {
			wantLead := float64(groups) / float64(n)
			if l := float64(leads[node]); l < wantLead-1 || l > wantLead+1 {
				t.Fatalf("%d nodes: %s leads %v groups, want about %.1f (%v)", n, node, l, wantLead, leads)
			}
			wantHold := float64(groups*rf) / float64(n)
			if h := float64(holds[node]); h < wantHold*0.6 || h > wantHold*1.4 {
				t.Fatalf("%d nodes: %s holds %v replicas, want about %.1f (%v)", n, node, h, wantHold, holds)
			}
		}
	}
}

// TestAddingANodeMovesItsShare: a new node takes about rf/N of the
// replicas; everything else stays where it was (kumofs' attach).
func TestAddingANodeMovesItsShare(t *testing.T) {
	const groups, rf = 256, 3
	before := Plan(nodes(5), groups, rf)
	after := Plan(nodes(6), groups, rf)
	moved := Moves(before, after)
	for g := range after {
		for _, n := range after[g] {
			if n != "n6" && !slices.Contains(before[g], n) {
				t.Fatalf("group %d: %s gained a replica although only n6 joined", g, n)
			}
		}
	}
	want := groups * rf / 6
	if moved < want*6/10 || moved > want*14/10 {
		t.Fatalf("%d replicas moved, want about %d", moved, want)
	}
}

func TestRemovingANodeMovesOnlyItsReplicas(t *testing.T) {
	const groups, rf = 128, 3
	before := Plan(nodes(6), groups, rf)
	after := Plan(slices.DeleteFunc(nodes(6), func(s string) bool { return s == "n3" }), groups, rf)
	for g := range after {
		kept := 0
		for _, n := range before[g] {
			if slices.Contains(after[g], n) {
				kept++
			}
		}
		if slices.Contains(before[g], "n3") && kept != rf-1 || !slices.Contains(before[g], "n3") && kept != rf {
			t.Fatalf("group %d: %v → %v", g, before[g], after[g])
		}
	}
}
