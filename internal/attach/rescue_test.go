package attach

import (
	"slices"
	"testing"
)

// TestRescuesDue: the live attached member with the lowest id rescues
// every dead member that was attached; no other member does, and no
// member rescues one that never named itself.
func TestRescuesDue(t *testing.T) {
	members := map[string]string{"n1": "", "n2": "", "n3": "", "n4": ""}
	recs := map[string]record{"n1": {ClientID: "mqkv-n1"}, "n2": {ClientID: "mqkv-n2"}, "n3": {ClientID: "mqkv-n3"}}
	aliveBut := func(dead ...string) func(string) bool {
		return func(id string) bool { return !slices.Contains(dead, id) }
	}
	for _, c := range []struct {
		self string
		dead []string
		want []string
	}{
		{"n1", []string{"n2"}, []string{"n2"}},
		{"n3", []string{"n2"}, nil},            // n1 rescues
		{"n2", []string{"n1"}, []string{"n1"}}, // n1 is dead: n2 is the lowest live one
		{"n3", []string{"n1", "n2"}, []string{"n1", "n2"}},
		{"n4", []string{"n1", "n2", "n3"}, nil}, // n4 is not attached: it rescues nobody
		{"n1", []string{"n4"}, nil},             // n4 was never attached
	} {
		got := rescuesDue(c.self, members, aliveBut(c.dead...), recs, c.dead)
		if !slices.Equal(got, c.want) {
			t.Errorf("%s with %v dead: rescues %v, want %v", c.self, c.dead, got, c.want)
		}
	}
}
