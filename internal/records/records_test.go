package records

import "testing"

// A record keeps its format byte, and one of another format is refused.
func TestEncodeKeepsTheFormat(t *testing.T) {
	b := Encode(7, map[string]int{"a": 1})
	if b[0] != 7 {
		t.Fatalf("% x", b)
	}
	var m map[string]int
	if err := Decode("x", 7, b, &m); err != nil || m["a"] != 1 {
		t.Fatal(m, err)
	}
	if err := Decode("x", 8, b, &m); err == nil {
		t.Fatal("a record of another format was read")
	}
}
