package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/server"
)

// newestSegment returns the path of the newest raft-wal segment file.
func newestSegment(t *testing.T, dataDir string) string {
	t.Helper()
	segs, _ := filepath.Glob(filepath.Join(dataDir, "raft", "wal", "*.wal"))
	if len(segs) == 0 {
		t.Fatal("no log segment")
	}
	sort.Strings(segs)
	return segs[len(segs)-1]
}

// TestCorruptLogEntryRefusesToStart: 64 bytes flipped inside an
// acknowledged log entry, in the middle of the newest segment (which the
// log store checks only at its tail), must stop the start with an error
// naming the entry and the way out, never start with the write missing.
func TestCorruptLogEntryRefusesToStart(t *testing.T) {
	skipInCluster(t, "the test damages the single-node log layout")
	dir := t.TempDir()
	s := startServerIn(t, dir)
	c := dialRaw(t, s, "writer", rawOpts{cleanStart: true})
	const n = 200
	for i := 0; i < n; i++ {
		expectPayload(t, c.call("SET", fmt.Sprintf("key-%03d", i), fmt.Sprintf("value-%03d-%s", i, strings.Repeat("x", 200))), "+OK\r\n")
	}
	s.Close()

	seg := newestSegment(t, dir)
	data, err := os.ReadFile(seg)
	if err != nil {
		t.Fatal(err)
	}
	at := bytes.Index(data, []byte("value-150-"))
	if at < 0 {
		t.Fatal("value not found in the segment")
	}
	for i := at + 20; i < at+84; i++ {
		data[i] ^= 0xFF
	}
	if err := os.WriteFile(seg, data, 0o600); err != nil {
		t.Fatal(err)
	}

	_, err = server.Start(serverConfig{Listen: "127.0.0.1:0", DataDir: dir, Logger: quietLogger()})
	var damaged *replica.DamagedError
	if !errors.As(err, &damaged) {
		t.Fatalf("start on a damaged log: %v, want a DamagedError", err)
	}
	for _, want := range []string{"raft log entry", "checksum", "mqkv restore", "mqkv cluster remove"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("error %q does not mention %q", err, want)
		}
	}

	// The binary says the same and exits non-zero.
	if testing.Short() {
		return
	}
	out, err := exec.Command(mqkvBinary(t), "serve", "--listen", "127.0.0.1:0", "--data-dir", dir).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "raft log entry") || strings.Contains(string(out), "panic") {
		t.Fatalf("mqkv serve on a damaged log: %v\n%s", err, out)
	}
}

// TestDamagedFrameHeaderRefusesToStart: the log store takes a frame header
// it cannot read for the end of a torn write and drops what follows. A
// damaged header in the middle of the newest segment, with acknowledged
// batches after it, must stop the start, not drop them.
func TestDamagedFrameHeaderRefusesToStart(t *testing.T) {
	skipInCluster(t, "the test damages the single-node log layout")
	dir := t.TempDir()
	s := startServerIn(t, dir)
	c := dialRaw(t, s, "writer", rawOpts{cleanStart: true})
	for i := 0; i < 200; i++ {
		expectPayload(t, c.call("SET", fmt.Sprintf("key-%03d", i), fmt.Sprintf("value-%03d", i)), "+OK\r\n")
	}
	s.Close()

	seg := newestSegment(t, dir)
	data, err := os.ReadFile(seg)
	if err != nil {
		t.Fatal(err)
	}
	at := bytes.Index(data, []byte("value-150"))
	if at < 0 {
		t.Fatal("value not found in the segment")
	}
	// The entry frame holding it: walk the frames (32-byte file header,
	// 8-byte frame headers, payloads padded to 8).
	off := 32
	for {
		n := int(data[off+4]) | int(data[off+5])<<8 | int(data[off+6])<<16 | int(data[off+7])<<24
		if data[off] == 3 {
			n = 0 // a commit frame: the field is a checksum
		}
		next := off + 8 + n + (8-n%8)%8
		if at < next {
			break
		}
		off = next
	}
	if data[off] != 1 {
		t.Fatalf("frame at %d has type %d, want an entry", off, data[off])
	}
	data[off] = 0x7F // a type no reader knows
	if err := os.WriteFile(seg, data, 0o600); err != nil {
		t.Fatal(err)
	}

	_, err = server.Start(serverConfig{Listen: "127.0.0.1:0", DataDir: dir, Logger: quietLogger()})
	var damaged *replica.DamagedError
	if !errors.As(err, &damaged) || !strings.Contains(err.Error(), "would be lost") {
		t.Fatalf("start on a log with a damaged frame header: %v, want a DamagedError", err)
	}
	// The segment was not touched: restoring it lets the node start.
	data[off] = 1
	os.WriteFile(seg, data, 0o600)
	s = startServerIn(t, dir)
	expectPayload(t, dialRaw(t, s, "reader", rawOpts{cleanStart: true}).call("GET", "key-199"), "$9\r\nvalue-199\r\n")
}
