package hlc

import (
	"sync"
	"testing"
	"time"
)

func TestStringPadsLikeTheSDKs(t *testing.T) {
	ts := Timestamp{Wall: 1700000000123, Counter: 7, Node: "node-a"}
	if got, want := ts.String(), "001700000000123:00007:node-a"; got != want {
		t.Fatalf("String() = %q, want %q", got, want)
	}
	big := Timestamp{Wall: 1, Counter: 1234567, Node: ""}
	if got, want := big.String(), "000000000000001:1234567:"; got != want {
		t.Fatalf("String() = %q, want %q", got, want)
	}
}

func TestParse(t *testing.T) {
	cases := []struct {
		in   string
		want Timestamp
		ok   bool
	}{
		{"001700000000123:00007:node-a", Timestamp{1700000000123, 7, "node-a"}, true},
		{"1:2:", Timestamp{1, 2, ""}, true},
		{"000000000000000:00000:0194f0c3-7d1c-7000-8000-000000000000", Timestamp{0, 0, "0194f0c3-7d1c-7000-8000-000000000000"}, true},
		{"", Timestamp{}, false},
		{"1:2", Timestamp{}, false},
		{"1:2:3:4", Timestamp{}, false},
		{":2:n", Timestamp{}, false},
		{"1::n", Timestamp{}, false},
		{"-1:2:n", Timestamp{}, false},
		{"+1:2:n", Timestamp{}, false},
		{"1_0:2:n", Timestamp{}, false},
		{"1:-2:n", Timestamp{}, false},
		{"abc:2:n", Timestamp{}, false},
		{"99999999999999999999:0:n", Timestamp{}, false},
		{"1:99999999999999999999:n", Timestamp{}, false},
		{"1.5:2:n", Timestamp{}, false},
	}
	for _, c := range cases {
		got, err := Parse(c.in)
		if (err == nil) != c.ok {
			t.Errorf("Parse(%q) error = %v, want ok=%v", c.in, err, c.ok)
			continue
		}
		if c.ok && got != c.want {
			t.Errorf("Parse(%q) = %+v, want %+v", c.in, got, c.want)
		}
	}
}

func TestCompare(t *testing.T) {
	a := Timestamp{10, 0, "b"}
	order := []Timestamp{
		{9, 99, "z"},
		{10, 0, "a"},
		a,
		{10, 0, "c"},
		{10, 1, ""},
		{11, 0, ""},
	}
	for i := range order {
		for j := range order {
			want := 0
			if i < j {
				want = -1
			} else if i > j {
				want = 1
			}
			if got := order[i].Compare(order[j]); got != want {
				t.Errorf("%v.Compare(%v) = %d, want %d", order[i], order[j], got, want)
			}
		}
	}
}

type fakeWall struct {
	mu sync.Mutex
	t  time.Time
}

func (f *fakeWall) now() time.Time { f.mu.Lock(); defer f.mu.Unlock(); return f.t }
func (f *fakeWall) set(ms int64)   { f.mu.Lock(); f.t = time.UnixMilli(ms); f.mu.Unlock() }

func TestClockUpdateRule(t *testing.T) {
	w := &fakeWall{}
	w.set(1000)
	c, err := New("srv", w.now)
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		wall   int64
		remote Timestamp
		want   Timestamp
	}{
		{1000, Timestamp{}, Timestamp{1000, 0, "srv"}},                // wall ahead of everything
		{1000, Timestamp{}, Timestamp{1000, 1, "srv"}},                // same ms: count
		{1000, Timestamp{1000, 5, "cli"}, Timestamp{1000, 6, "srv"}},  // equal walls: max counter + 1
		{1000, Timestamp{2000, 3, "cli"}, Timestamp{2000, 4, "srv"}},  // remote ahead (within drift)
		{1500, Timestamp{1200, 99, "cli"}, Timestamp{2000, 5, "srv"}}, // last ahead of wall and remote
		{3000, Timestamp{2500, 9, "cli"}, Timestamp{3000, 0, "srv"}},  // wall moves on: counter resets
		{3000, Timestamp{3000, 0, "zzz"}, Timestamp{3000, 1, "srv"}},  // strictly above remote even with greater node
	}
	for i, s := range steps {
		w.set(s.wall)
		got := c.Update(s.remote)
		if got != s.want {
			t.Fatalf("step %d: Update(%v) = %v, want %v", i, s.remote, got, s.want)
		}
		if got.Compare(s.remote) <= 0 {
			t.Fatalf("step %d: %v not greater than remote %v", i, got, s.remote)
		}
	}
}

// TestClockUpdateAtWithAStaleReading: a reading taken before others
// issued timestamps (a batch's, shared by its commands) still gives one
// above all of them.
func TestClockUpdateAtWithAStaleReading(t *testing.T) {
	w := &fakeWall{}
	w.set(1000)
	c, err := New("srv", w.now)
	if err != nil {
		t.Fatal(err)
	}
	stale := c.WallMillis()
	w.set(1005)
	last := c.Now() // issued later, by another caller
	for range 3 {
		got := c.UpdateAt(Timestamp{}, stale)
		if got.Compare(last) <= 0 {
			t.Fatalf("UpdateAt with a stale reading gave %v, not above %v", got, last)
		}
		last = got
	}
	if got := c.UpdateAt(Timestamp{}, 1010); got != (Timestamp{1010, 0, "srv"}) {
		t.Fatalf("a reading ahead of the clock: %v", got)
	}
}

func TestClockRejectsSkew(t *testing.T) {
	w := &fakeWall{}
	w.set(1_000_000)
	c, _ := New("srv", w.now)
	if err := c.CheckSkew(Timestamp{Wall: 1_000_000 + MaxDrift.Milliseconds(), Node: "c"}); err != nil {
		t.Fatalf("exactly MaxDrift ahead must pass: %v", err)
	}
	if err := c.CheckSkew(Timestamp{Wall: 1_000_001 + MaxDrift.Milliseconds(), Node: "c"}); err != ErrSkew {
		t.Fatalf("beyond MaxDrift: err = %v, want ErrSkew", err)
	}
}

func TestClockCounterOverflowMovesWall(t *testing.T) {
	w := &fakeWall{}
	w.set(10)
	c, _ := New("srv", w.now)
	got := c.Update(Timestamp{Wall: 10, Counter: MaxCounter, Node: "c"})
	if want := (Timestamp{11, 0, "srv"}); got != want {
		t.Fatalf("got %v, want %v", got, want)
	}
	// The highest counter issued leaves a client room to add one and stay
	// within int32, which .NET's clock parses and refuses to pass.
	got = c.Update(Timestamp{Wall: 11, Counter: MaxCounter - 1, Node: "c"})
	if want := (Timestamp{11, MaxCounter, "srv"}); got != want || got.Counter+1 > 1<<31-1 {
		t.Fatalf("got %v, want %v, below int32's maximum", got, want)
	}
}

func TestObserveKeepsLaterTimestampsAbove(t *testing.T) {
	w := &fakeWall{}
	w.set(100)
	c, _ := New("srv", w.now)
	seen := Timestamp{Wall: 5000, Counter: 3, Node: "other"}
	c.Observe(seen)
	if got := c.Now(); got.Compare(seen) <= 0 {
		t.Fatalf("Now() = %v after observing %v", got, seen)
	}
	c.Observe(Timestamp{Wall: 1, Node: "old"}) // older: no effect
	if got := c.Now(); got != (Timestamp{5000, 5, "srv"}) {
		t.Fatalf("Now() = %v", got)
	}
}

func TestNewRejectsBadNode(t *testing.T) {
	for _, n := range []string{"", "a:b"} {
		if _, err := New(n, nil); err == nil {
			t.Errorf("New(%q) accepted", n)
		}
	}
}

func TestConcurrentNowIsStrictlyIncreasingPerCaller(t *testing.T) {
	c, _ := New("srv", nil)
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			prev := Timestamp{}
			for i := 0; i < 2000; i++ {
				ts := c.Now()
				if ts.Compare(prev) <= 0 {
					t.Errorf("%v not after %v", ts, prev)
					return
				}
				prev = ts
			}
		}()
	}
	wg.Wait()
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{"001700000000123:00007:node-a", "1:2:", "", "::", "1:2:3:4", "-1:0:x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ts, err := Parse(s)
		if err != nil {
			return
		}
		// A parsed timestamp renders to a canonical form that parses back
		// to the same value.
		back, err := Parse(ts.String())
		if err != nil || back != ts {
			t.Fatalf("round trip of %q: %v -> %q -> %v, %v", s, ts, ts.String(), back, err)
		}
	})
}
