package broker

import "testing"

// TestReplyRoutesForgetOnChange: a route is found once per generation of
// the topic index, found again after a change, and one found while the
// index changed is not kept.
func TestReplyRoutesForgetOnChange(t *testing.T) {
	var rr routes
	finds := 0
	find := func(client string) func() fanout {
		return func() fanout { finds++; return fanout{subs: []target{{client: client}}} }
	}
	if r := rr.lookup("t", find("a")); r.subs[0].client != "a" || finds != 1 {
		t.Fatalf("first lookup: %+v after %d finds", r, finds)
	}
	if r := rr.lookup("t", find("x")); r.subs[0].client != "a" || finds != 1 {
		t.Fatalf("same generation: %+v after %d finds, want the route kept", r, finds)
	}
	rr.changed()
	if r := rr.lookup("t", find("b")); r.subs[0].client != "b" || finds != 2 {
		t.Fatalf("after a change: %+v after %d finds, want it found again", r, finds)
	}
	// A change while finding: the answer is used once, not kept.
	r := rr.lookup("u", func() fanout { rr.changed(); return fanout{subs: []target{{client: "stale"}}} })
	if r.subs[0].client != "stale" {
		t.Fatalf("lookup returned %+v", r)
	}
	if r := rr.lookup("u", find("c")); r.subs[0].client != "c" {
		t.Fatalf("a route found during a change was kept: %+v", r)
	}
}
