package lease

import (
	"errors"
	"testing"
)

func TestLeaseStateMachine(t *testing.T) {
	const t0 = 1_000_000
	newID := func() string { return "made" }
	leased := Record{ID: "a", Duration: 30, Expires: t0 + 30_000}
	infinite := Record{ID: "a", Duration: -1}
	breaking := Record{ID: "a", Duration: 30, Expires: t0 + 30_000, BreakEnds: t0 + 10_000}
	for _, c := range []struct {
		name   string
		rec    Record
		exists bool
		now    int64
		op     Op
		want   Record
		status int // 0: applied
		code   string
	}{
		{"acquire a free key", Record{}, false, t0, Op{Action: "acquire", Duration: 30}, Record{ID: "made", Duration: 30, Expires: t0 + 30_000}, 0, ""},
		{"acquire with a proposed id", Record{}, false, t0, Op{Action: "acquire", Duration: -1, ProposedID: "p"}, Record{ID: "p", Duration: -1}, 0, ""},
		{"acquire too short", Record{}, false, t0, Op{Action: "acquire", Duration: 14}, Record{}, 400, "bad_request"},
		{"acquire too long", Record{}, false, t0, Op{Action: "acquire", Duration: 61}, Record{}, 400, "bad_request"},
		{"acquire a leased key", leased, true, t0 + 1000, Op{Action: "acquire", Duration: 15, ProposedID: "b"}, leased, 409, "lease_already_present"},
		{"acquire again with the same id renews", leased, true, t0 + 1000, Op{Action: "acquire", Duration: 15, ProposedID: "a"}, Record{ID: "a", Duration: 15, Expires: t0 + 16_000}, 0, ""},
		{"acquire after expiry", leased, true, t0 + 30_000, Op{Action: "acquire", Duration: 20, ProposedID: "b"}, Record{ID: "b", Duration: 20, Expires: t0 + 50_000}, 0, ""},
		{"acquire while breaking", breaking, true, t0 + 5000, Op{Action: "acquire", Duration: 20, ProposedID: "a"}, breaking, 409, "lease_already_present"},
		{"acquire once broken", breaking, true, t0 + 10_000, Op{Action: "acquire", Duration: 20, ProposedID: "b"}, Record{ID: "b", Duration: 20, Expires: t0 + 30_000}, 0, ""},
		{"renew", leased, true, t0 + 20_000, Op{Action: "renew", ID: "a"}, Record{ID: "a", Duration: 30, Expires: t0 + 50_000}, 0, ""},
		{"renew an expired lease no one took", leased, true, t0 + 40_000, Op{Action: "renew", ID: "a"}, Record{ID: "a", Duration: 30, Expires: t0 + 70_000}, 0, ""},
		{"renew with another id", leased, true, t0, Op{Action: "renew", ID: "b"}, leased, 409, "lease_id_mismatch"},
		{"renew without an id", leased, true, t0, Op{Action: "renew"}, leased, 400, "bad_request"},
		{"renew a breaking lease", breaking, true, t0 + 1000, Op{Action: "renew", ID: "a"}, breaking, 409, "lease_is_broken"},
		{"renew a key without lease", Record{}, false, t0, Op{Action: "renew", ID: "a"}, Record{}, 409, "lease_not_present"},
		{"change", leased, true, t0, Op{Action: "change", ID: "a", ProposedID: "b"}, Record{ID: "b", Duration: 30, Expires: t0 + 30_000}, 0, ""},
		{"change again (already changed)", Record{ID: "b", Duration: 30, Expires: t0 + 30_000}, true, t0, Op{Action: "change", ID: "a", ProposedID: "b"}, Record{ID: "b", Duration: 30, Expires: t0 + 30_000}, 0, ""},
		{"change with another id", leased, true, t0, Op{Action: "change", ID: "c", ProposedID: "b"}, leased, 409, "lease_id_mismatch"},
		{"release", leased, true, t0, Op{Action: "release", ID: "a"}, Record{Released: true}, 0, ""},
		{"release with another id", leased, true, t0, Op{Action: "release", ID: "b"}, leased, 409, "lease_id_mismatch"},
		{"break with a period", leased, true, t0, Op{Action: "break", BreakPeriod: 5}, Record{ID: "a", Duration: 30, Expires: t0 + 30_000, BreakEnds: t0 + 5000}, 0, ""},
		{"break past the lease's end ends with it", leased, true, t0 + 28_000, Op{Action: "break", BreakPeriod: 10}, Record{ID: "a", Duration: 30, Expires: t0 + 30_000, BreakEnds: t0 + 30_000}, 0, ""},
		{"break without a period waits for the end", leased, true, t0, Op{Action: "break", BreakPeriod: -1}, Record{ID: "a", Duration: 30, Expires: t0 + 30_000, BreakEnds: t0 + 30_000}, 0, ""},
		{"break an infinite lease at once", infinite, true, t0, Op{Action: "break", BreakPeriod: -1}, Record{ID: "a", Duration: -1, BreakEnds: t0}, 0, ""},
		{"break an infinite lease with a period", infinite, true, t0, Op{Action: "break", BreakPeriod: 60}, Record{ID: "a", Duration: -1, BreakEnds: t0 + 60_000}, 0, ""},
		{"break again only shortens", breaking, true, t0 + 1000, Op{Action: "break", BreakPeriod: 30}, breaking, 0, ""},
		{"break too long a period", leased, true, t0, Op{Action: "break", BreakPeriod: 61}, leased, 400, "bad_request"},
		{"break a key without lease", Record{Released: true}, true, t0, Op{Action: "break", BreakPeriod: 0}, Record{Released: true}, 409, "lease_not_present"},
		{"an unknown action", leased, true, t0, Op{Action: "steal"}, leased, 400, "bad_request"},
	} {
		got, err := Apply(c.rec, c.exists, c.now, c.op, newID)
		var le *Error
		switch {
		case c.status == 0 && err != nil:
			t.Errorf("%s: refused: %v", c.name, err)
		case c.status != 0 && (!errors.As(err, &le) || le.Status != c.status || le.Code != c.code):
			t.Errorf("%s: %v, want %d %s", c.name, err, c.status, c.code)
		case c.status == 0 && got != c.want:
			t.Errorf("%s: %+v, want %+v", c.name, got, c.want)
		}
	}
}

func TestLeaseStates(t *testing.T) {
	r := Record{ID: "a", Duration: 15, Expires: 15_000}
	for _, c := range []struct {
		rec    Record
		now    int64
		state  string
		active bool
	}{
		{Record{}, 0, "available", false},
		{Record{Released: true}, 0, "available", false},
		{r, 14_999, "leased", true},
		{r, 15_000, "expired", false},
		{Record{ID: "a", Duration: -1}, 1 << 50, "leased", true},
		{Record{ID: "a", Duration: -1, BreakEnds: 100}, 99, "breaking", true},
		{Record{ID: "a", Duration: -1, BreakEnds: 100}, 100, "broken", false},
	} {
		if s := c.rec.State(c.now); s != c.state || c.rec.Active(c.now) != c.active {
			t.Errorf("%+v at %d: %s (active %v), want %s (%v)", c.rec, c.now, s, c.rec.Active(c.now), c.state, c.active)
		}
	}
	if NewID() == NewID() || len(NewID()) != 36 {
		t.Fatalf("lease ids %q %q", NewID(), NewID())
	}
}
