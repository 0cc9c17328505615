// Package glob matches state store keys against glob patterns, the syntax
// of AIO's keyType Pattern and of SCAN and pattern KEYNOTIFY: '*' matches
// any run of bytes (including '/' and none), '?' exactly one byte, and
// "[...]" one byte from a set, with ranges ("a-z") and negation ("[!...]" or
// "[^...]"). A backslash makes the next byte literal. Keys are bytes, not
// runes: a pattern is matched byte by byte.
package glob

// Match reports whether key matches pattern. It runs in
// O(len(pattern)·len(key)) time at worst, without recursion, so hostile
// patterns cannot blow the stack or take exponential time.
func Match(pattern, key []byte) bool {
	p, k := 0, 0
	starP, starK := -1, 0
	for k < len(key) {
		if p < len(pattern) {
			switch c := pattern[p]; c {
			case '*':
				starP, starK = p, k
				p++
				continue
			case '?':
				p++
				k++
				continue
			case '[':
				if n, ok := matchClass(pattern[p:], key[k]); n > 0 {
					if ok {
						p += n
						k++
						continue
					}
				} else if key[k] == '[' { // unterminated: a literal '['
					p++
					k++
					continue
				}
			case '\\':
				if p+1 < len(pattern) && pattern[p+1] == key[k] {
					p += 2
					k++
					continue
				}
			default:
				if c == key[k] {
					p++
					k++
					continue
				}
			}
		}
		if starP < 0 {
			return false
		}
		// Backtrack: let the last '*' absorb one more byte.
		starK++
		p, k = starP+1, starK
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}

// Literal returns the part of pattern before its first special byte: every
// key the pattern matches starts with it.
func Literal(pattern []byte) []byte {
	for i, c := range pattern {
		switch c {
		case '*', '?', '[', '\\':
			return pattern[:i]
		}
	}
	return pattern
}

// matchClass matches one byte against the class at the start of pattern
// ("[...]"). It returns the class's length (0 if it is not terminated) and
// whether c is in it.
func matchClass(pattern []byte, c byte) (int, bool) {
	i := 1
	negate := false
	if i < len(pattern) && (pattern[i] == '!' || pattern[i] == '^') {
		negate = true
		i++
	}
	in := false
	first := true
	for i < len(pattern) {
		lo := pattern[i]
		if lo == ']' && !first {
			return i + 1, in != negate
		}
		first = false
		if lo == '\\' && i+1 < len(pattern) {
			i++
			lo = pattern[i]
		}
		hi := lo
		if i+2 < len(pattern) && pattern[i+1] == '-' && pattern[i+2] != ']' {
			hi = pattern[i+2]
			if hi == '\\' && i+3 < len(pattern) {
				i++
				hi = pattern[i+2]
			}
			i += 2
		}
		if lo <= c && c <= hi {
			in = true
		}
		i++
	}
	return 0, false
}

// Escape makes s match only itself inside a pattern: substituted values
// must never widen one (a client id of "*" must not match every key).
func Escape(s string) string {
	var b []byte
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '*', '?', '[', ']', '\\':
			if b == nil {
				b = append(make([]byte, 0, len(s)+4), s[:i]...)
			}
			b = append(b, '\\')
		}
		if b != nil {
			b = append(b, s[i])
		}
	}
	if b == nil {
		return s
	}
	return string(b)
}
