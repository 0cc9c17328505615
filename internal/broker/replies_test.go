package broker

import "testing"

// TestReplyRoutesForgetOnChange: a route is found once per generation of
// the topic index, found again after a change, and one found while the
// index changed is not kept.
func TestReplyRoutesForgetOnChange(t *testing.T) {
	var rr replyRoutes
	finds := 0
	find := func(client string) func() route {
		return func() route { finds++; return route{client: client} }
	}
	if r := rr.lookup("t", find("a")); r.client != "a" || finds != 1 {
		t.Fatalf("first lookup: %+v after %d finds", r, finds)
	}
	if r := rr.lookup("t", find("x")); r.client != "a" || finds != 1 {
		t.Fatalf("same generation: %+v after %d finds, want the route kept", r, finds)
	}
	rr.changed()
	if r := rr.lookup("t", find("b")); r.client != "b" || finds != 2 {
		t.Fatalf("after a change: %+v after %d finds, want it found again", r, finds)
	}
	// A change while finding: the answer is used once, not kept.
	r := rr.lookup("u", func() route { rr.changed(); return route{client: "stale"} })
	if r.client != "stale" {
		t.Fatalf("lookup returned %+v", r)
	}
	if r := rr.lookup("u", find("c")); r.client != "c" {
		t.Fatalf("a route found during a change was kept: %+v", r)
	}
}
