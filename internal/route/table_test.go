package route

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// The table answers as matching every node's every filter would, through
// adds, removes, resyncs and drops of random filters.
func TestTableMatchesEveryFilter(t *testing.T) {
	words := []string{"a", "b", "c", "$sys", "+", "#", ""}
	filter := func(r *rand.Rand) string {
		n := 1 + r.IntN(4)
		f := ""
		for i := 0; i < n; i++ {
			w := words[r.IntN(len(words))]
			if w == "#" && i != n-1 {
				w = "a"
			}
			if i > 0 {
				f += "/"
			}
			f += w
		}
		if r.IntN(5) == 0 {
			f = "$share/g" + fmt.Sprint(r.IntN(2)) + "/" + f
		}
		return f
	}
	topic := func(r *rand.Rand) string {
		n := 1 + r.IntN(4)
		tp := ""
		for i := 0; i < n; i++ {
			w := words[r.IntN(len(words)-2)] // no wildcards
			if i > 0 {
				tp += "/"
			}
			tp += w
		}
		return tp
	}
	r := rand.New(rand.NewPCG(1, 2))
	tab := NewTable()
	model := map[string]map[string]bool{} // node → filters
	nodes := []string{"n1", "n2", "n3"}
	for step := 0; step < 20000; step++ {
		n := nodes[r.IntN(len(nodes))]
		switch op := r.IntN(10); {
		case op < 5:
			f := filter(r)
			tab.Add(n, f)
			if model[n] == nil {
				model[n] = map[string]bool{}
			}
			model[n][f] = true
		case op < 8:
			for f := range model[n] {
				tab.Remove(n, f)
				delete(model[n], f)
				break
			}
		case op < 9:
			var fs []string
			model[n] = map[string]bool{}
			for range r.IntN(5) {
				f := filter(r)
				fs = append(fs, f)
				model[n][f] = true
			}
			tab.Set(n, fs)
		default:
			tab.Drop(n)
			delete(model, n)
		}
		tp := topic(r)
		got := tab.Match(tp)
		var want Want
		for _, node := range nodes {
			for f := range model[node] {
				group, plain, shared := splitShared(f)
				if !Match(plain, tp) {
					continue
				}
				if shared {
					if want.Shared == nil {
						want.Shared = map[string][]string{}
					}
					if !slices.Contains(want.Shared[group], node) {
						want.Shared[group] = append(want.Shared[group], node)
					}
				} else if !slices.Contains(want.Plain, node) {
					want.Plain = append(want.Plain, node)
				}
			}
		}
		slices.Sort(want.Plain)
		for g := range want.Shared {
			slices.Sort(want.Shared[g])
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("step %d, topic %q: got %v, want %v (model %v)", step, tp, got, want, model)
		}
	}
	for _, n := range nodes {
		tab.Drop(n)
	}
	if len(tab.root.next) != 0 || tab.Size() != 0 {
		t.Fatalf("empty table keeps %d levels, %d filters", len(tab.root.next), tab.Size())
	}
}
