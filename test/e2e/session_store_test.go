package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mqkv/mqkv/internal/server"
)

// TestEmptiedSessionStoreIsRefused: a session store emptied to 0 bytes
// (its persistent sessions, subscriptions and retained messages gone) is
// refused with a clear error, not taken for a new one: bbolt made a new
// database of it and the server started without a word (found by review).
func TestEmptiedSessionStoreIsRefused(t *testing.T) {
	dir := t.TempDir()
	cfg := server.Config{Listen: "127.0.0.1:0", DataDir: dir, Logger: quietLogger()}
	s, err := server.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if err := os.Truncate(filepath.Join(dir, "mqtt", "sessions.db"), 0); err != nil {
		t.Fatal(err)
	}
	s, err = server.Start(cfg)
	if err == nil {
		s.Close()
		t.Fatal("the server started on an emptied session store")
	}
	if !strings.Contains(err.Error(), "sessions.db") || !strings.Contains(err.Error(), "empty") {
		t.Fatalf("the error does not say what is wrong: %v", err)
	}
}
