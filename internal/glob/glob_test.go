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

func TestMatcherAgreesWithMatch(t *testing.T) {
	patterns := []string{"*", "", "a", "a*", "*a", "a*b*c", "?", "??*", "[abc]", "[!a-c]x", `\*`, `a\`, "[", "a[", "[]]", "**a**", "b/[12]*", "x*y?z"}
	keys := []string{"", "a", "b", "abc", "aXbYc", "ba", "*", "[", "]", "x", "bx", "dx", "b/1", "b/10", "xyyqz", "xyz"}
	for _, p := range patterns {
		m, err := Compile([]byte(p))
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			if got, want := m.Match([]byte(k)), Match([]byte(p), []byte(k)); got != want {
				t.Errorf("Compile(%q).Match(%q) = %v, Match = %v", p, k, got, want)
			}
		}
	}
	if _, err := Compile([]byte(strings.Repeat("a*", 40))); err != ErrTooComplex {
		t.Fatalf("64 elements: %v", err)
	}
	if _, err := Compile([]byte("prefix/" + strings.Repeat("x", 200) + "*")); err != nil {
		t.Fatalf("a long literal prefix is not complexity: %v", err)
	}
}

// A pattern that makes backtracking slow is linear for the Matcher.
func TestMatcherIsLinear(t *testing.T) {
	m, err := Compile([]byte(strings.Repeat("*a", 30) + "b"))
	if err != nil {
		t.Fatal(err)
	}
	key := []byte(strings.Repeat("a", 1<<20))
	if m.Match(key) {
		t.Fatal("matched")
	}
}

func FuzzMatcher(f *testing.F) {
	f.Add("a*b?[c-e]", "aXXbYd")
	f.Add(`\[*]`, "[x]")
	f.Add("[!", "[!")
	f.Fuzz(func(t *testing.T, pattern, key string) {
		m, err := Compile([]byte(pattern))
		if err != nil {
			return
		}
		if got, want := m.Match([]byte(key)), Match([]byte(pattern), []byte(key)); got != want {
			t.Fatalf("Compile(%q).Match(%q) = %v, Match = %v", pattern, key, got, want)
		}
	})
}
