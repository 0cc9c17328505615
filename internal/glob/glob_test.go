package glob

import (
	"strings"
	"testing"
)

func TestGlob(t *testing.T) {
	cases := []struct {
		pattern, key string
		want         bool
	}{
		{"*", "", true},
		{"*", "anything/at/all", true},
		{"a*", "a", true},
		{"a*", "abc/def", true},
		{"a*", "ba", false},
		{"*c", "abc", true},
		{"a*c", "ac", true},
		{"a*c", "abcbc", true},
		{"a*c", "abcb", false},
		{"?", "x", true},
		{"?", "", false},
		{"a?c", "abc", true},
		{"a?c", "ac", false},
		{"[abc]", "b", true},
		{"[abc]", "d", false},
		{"[a-c]x", "bx", true},
		{"[!a-c]x", "bx", false},
		{"[^a-c]x", "dx", true},
		{"[]]", "]", true},
		{"[", "[", true},
		{"a[", "a[", true},
		{`\*`, "*", true},
		{`\*`, "x", false},
		{`a\?`, "a?", true},
		{"clients/dev1/*", "clients/dev1/temp", true},
		{"clients/dev1/*", "clients/dev10/temp", false},
		{"*a*a*a*a*a*a*a*b", strings.Repeat("a", 200), false},
	}
	for _, c := range cases {
		if got := Match([]byte(c.pattern), []byte(c.key)); got != c.want {
			t.Errorf("Match(%q, %q) = %v, want %v", c.pattern, c.key, got, c.want)
		}
	}
}

func TestEscapedValuesMatchOnlyThemselves(t *testing.T) {
	for _, v := range []string{"*", "?", "[a-z]", `\`, "a*b", "x]"} {
		e := Escape(v)
		if !Match([]byte(e), []byte(v)) {
			t.Errorf("escaped %q does not match itself", v)
		}
		if v != "x" && Match([]byte(e), []byte("x")) {
			t.Errorf("escaped %q matches %q", v, "x")
		}
	}
}

func TestLiteral(t *testing.T) {
	for pattern, want := range map[string]string{"abc": "abc", "ab*": "ab", "*": "", "a?c": "a", "a[b]": "a", `a\*`: "a", "": ""} {
		if got := string(Literal([]byte(pattern))); got != want {
			t.Errorf("Literal(%q) = %q, want %q", pattern, got, want)
		}
	}
}
