package journal

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
)

// FuzzOpen opens a journal whose one segment holds arbitrary bytes after
// its header: it must open (cutting what is not committed) or report
// damage, never panic, and every entry it then claims must read back.
func FuzzOpen(f *testing.F) {
	var b []byte
	b = appendEntry(b, 1, &raft.Log{Index: 1, Term: 1, Type: raft.LogCommand, Data: []byte("hello")})
	b = appendStable(b, 1, []byte("CurrentTerm"), []byte{1, 0, 0, 0, 0, 0, 0, 0})
	f.Add(appendCommit(b, int64(headerSize+len(b)), 1, int64(headerSize)))
	b = appendEntry(b, 2, &raft.Log{Index: 9, Term: 2, Type: raft.LogCommand, Extensions: []byte("x"), Data: []byte("y")})
	b = appendDelete(b, 1, 1, 1)
	b = appendDrop(b, 7)
	f.Add(appendCommit(b, int64(headerSize+len(b)), 1, int64(headerSize)))
	f.Add(b)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, body []byte) {
		dir := t.TempDir()
		data := append(appendHeader(nil, 1), body...)
		if err := os.WriteFile(filepath.Join(dir, segName(1)), data, 0o600); err != nil {
			t.Fatal(err)
		}
		j, err := Open(dir, Options{})
		if err != nil {
			return
		}
		defer j.Close()
		for _, id := range j.Groups() {
			l := j.Group(id)
			first, _ := l.FirstIndex()
			last, _ := l.LastIndex()
			for i := first; i <= last && last > 0; i++ {
				var e raft.Log
				if err := l.GetLog(i, &e); err != nil || e.Index != i {
					t.Fatalf("group %d entry %d of %d..%d: %v", id, i, first, last, err)
				}
			}
		}
		// It takes writes after whatever it opened.
		if err := j.Group(99).StoreLogs([]*raft.Log{{Index: 1, Data: []byte("z")}}); err != nil {
			t.Fatal(err)
		}
	})
}
