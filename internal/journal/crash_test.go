package journal

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/hashicorp/raft"
)

// crashChild is the writer TestCrashKeepsAcknowledgedEntries kills: it
// appends to several groups at once, compacting as raft does, and prints
// each entry once StoreLogs has returned.
func crashChild(dir string) {
	j, err := Open(dir, Options{SegmentSize: 64 << 10})
	if err != nil {
		fmt.Println("open:", err)
		os.Exit(1)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := uint32(1); g <= 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := j.Group(g)
			for i := uint64(1); ; i++ {
				data := strings.Repeat(fmt.Sprintf("g%d-%d/", g, i), int(g)*3)
				if err := l.StoreLogs([]*raft.Log{{Index: i, Term: 1, Type: raft.LogCommand, Data: []byte(data)}}); err != nil {
					fmt.Println("store:", err)
					os.Exit(1)
				}
				if i%100 == 0 && g != 4 { // group 4 never compacts: it pins old segments
					l.DeleteRange(1, i-50)
				}
				mu.Lock()
				fmt.Printf("%d %d\n", g, i)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
}

func TestMain(m *testing.M) {
	if dir := os.Getenv("JOURNAL_CRASH_CHILD"); dir != "" {
		crashChild(dir)
		return
	}
	os.Exit(m.Run())
}

// A process killed with SIGKILL mid-write loses no entry whose StoreLogs
// returned, and the journal it leaves opens and reads back intact, across
// segment rotation, collection and copying forward.
func TestCrashKeepsAcknowledgedEntries(t *testing.T) {
	dir := t.TempDir()
	acked := map[uint32]uint64{}
	for round := 0; round < 3; round++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "JOURNAL_CRASH_CHILD="+dir)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(out)
		lines := 0
		for sc.Scan() && lines < 1500+round*500 {
			f := strings.Fields(sc.Text())
			if len(f) != 2 {
				t.Fatalf("child: %s", sc.Text())
			}
			g, _ := strconv.Atoi(f[0])
			i, _ := strconv.ParseUint(f[1], 10, 64)
			acked[uint32(g)] = max(acked[uint32(g)], i)
			lines++
		}
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
		if lines == 0 {
			t.Fatal("the child wrote nothing")
		}

		j, err := Open(dir, Options{SegmentSize: 64 << 10})
		if err != nil {
			t.Fatalf("round %d: open after kill: %v", round, err)
		}
		for g, want := range acked {
			l := j.Group(g)
			first, _ := l.FirstIndex()
			last, _ := l.LastIndex()
			if last < want {
				t.Fatalf("round %d: group %d ends at %d, but %d was acknowledged", round, g, last, want)
			}
			for i := first; i <= last; i++ {
				var e raft.Log
				if err := l.GetLog(i, &e); err != nil {
					t.Fatalf("round %d: group %d entry %d: %v", round, g, i, err)
				}
				if w := strings.Repeat(fmt.Sprintf("g%d-%d/", g, i), int(g)*3); string(e.Data) != w {
					t.Fatalf("round %d: group %d entry %d holds %q", round, g, i, e.Data)
				}
			}
			if g == 4 && first != 1 {
				t.Fatalf("group 4 never compacted but starts at %d", first)
			}
		}
		segs, _ := filepath.Glob(filepath.Join(dir, "*.seg"))
		t.Logf("round %d: %d entries acknowledged, %d segments", round, lines, len(segs))
		// The next child starts where this one ended: a fresh start per
		// group after what survived.
		for g := uint32(1); g <= 4; g++ {
			if err := j.Drop(g); err != nil {
				t.Fatal(err)
			}
		}
		j.Close()
		acked = map[uint32]uint64{}
	}
}
