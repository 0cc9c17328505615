package route

import "testing"

func TestMatch(t *testing.T) {
	cases := []struct {
		filter, topic string
		want          bool
	}{
		{"a/b", "a/b", true},
		{"a/b", "a/c", false},
		{"a/+", "a/b", true},
		{"a/+", "a/b/c", false},
		{"a/#", "a", true},
		{"a/#", "a/b/c", true},
		{"#", "a/b", true},
		{"#", "$SYS/x", false},
		{"+/b", "$x/b", false},
		{"+/+", "/b", true},
		{"a/+/c", "a//c", true},
	}
	for _, c := range cases {
		if got := Match(c.filter, c.topic); got != c.want {
			t.Errorf("Match(%q, %q) = %v", c.filter, c.topic, got)
		}
	}
}

func TestCovers(t *testing.T) {
	cases := []struct {
		granted, requested string
		want               bool
	}{
		{"a/#", "a/b/+", true},
		{"a/#", "a/#", true},
		{"a/+", "a/b", true},
		{"a/+", "a/+", true},
		{"a/+", "a/#", false},
		{"a/b", "a/+", false},
		{"a/+/c", "a/x/c", true},
		{"#", "anything/#", true},
		{"a/b", "a/b/c", false},
		{"a/b/#", "a/b", true},
	}
	for _, c := range cases {
		if got := Covers(c.granted, c.requested); got != c.want {
			t.Errorf("Covers(%q, %q) = %v", c.granted, c.requested, got)
		}
	}
}
