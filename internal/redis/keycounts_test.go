package redis

import (
	"math/rand/v2"
	"testing"
)

// TestKeyCountsAgainstAMap runs random adds and removes, on few keys
// (long probe runs, keys whose homes collide) and on many (growth),
// against a map, and checks every key's count after each step.
func TestKeyCountsAgainstAMap(t *testing.T) {
	for _, keys := range []int{3, 40, 5000} {
		rng := rand.New(rand.NewPCG(1, uint64(keys)))
		var kc keyCounts
		want := map[uint64]int32{}
		// Keys with the same low bits probe into each other's runs.
		key := func() uint64 { return uint64(rng.IntN(keys)) << 20 * uint64(1+rng.IntN(2)) }
		for step := range 50_000 {
			k := key()
			if rng.IntN(2) == 0 || want[k] == 0 && rng.IntN(4) > 0 {
				kc.add(k)
				want[k]++
			} else {
				kc.remove(k)
				if want[k] > 0 {
					want[k]--
				}
			}
			if got := kc.get(k); got != want[k] {
				t.Fatalf("%d keys, step %d: key %#x counted %d, want %d", keys, step, k, got, want[k])
			}
			if step%997 == 0 {
				n := 0
				for k, w := range want {
					if got := kc.get(k); got != w {
						t.Fatalf("%d keys, step %d: key %#x counted %d, want %d", keys, step, k, got, w)
					}
					if w > 0 {
						n++
					}
				}
				if kc.n != n {
					t.Fatalf("%d keys, step %d: %d keys counted, want %d", keys, step, kc.n, n)
				}
			}
		}
	}
}
