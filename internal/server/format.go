package server

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/mqkv/mqkv/internal/journal"
)

// DataFormat is the newest layout of a data directory this release reads
// and writes. A release that changes what it writes there so that older
// releases would misread it raises it; older releases, finding a larger
// number, refuse to start instead of misreading (those from before the
// marker existed cannot check it: see docs/operations.md).
const DataFormat = 1

// formatFile holds the data directory's format: "mqkv data format N".
const formatFile = "FORMAT"

// checkFormat refuses a data directory written in a newer format than
// this release reads, and marks one without a marker (new, or written by
// a release from before the marker) with DataFormat.
func checkFormat(dir string) error {
	path := filepath.Join(dir, formatFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return journal.WriteFileSync(dir, formatFile, []byte(fmt.Sprintf("mqkv data format %d\n", DataFormat)), 0o600)
	}
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(string(b)), "mqkv data format "))
	if err != nil || n < 1 {
		return fmt.Errorf("%s: not a data format marker (%q)", path, strings.TrimSpace(string(b)))
	}
	if n > DataFormat {
		return fmt.Errorf("%s was written by a newer mqkv (data format %d); this release (%s) reads data format %d at most: start the newer release on it, or restore a backup with this one", dir, n, Version, DataFormat)
	}
	return nil
}
