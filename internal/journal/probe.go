package journal

import (
	"os"
	"slices"
	"time"
)

// ProbeSync measures, on dir's disk, what one commit waits for: size
// bytes appended where the file is already filled with zeros (as the
// journal's segments are, see ahead) and made durable with the journal's
// flush, which then has no file size to write. It returns the n
// latencies, sorted, and removes its file. A benchmark reports it next to
// its request latencies, so that "a durable write costs one flush" can be
// checked on the machine at hand. (A single node's raft-wal log fsyncs
// fallocated segments instead; on the machines measured the two cost the
// same within a few percent.)
func ProbeSync(dir string, n, size int) ([]time.Duration, error) {
	f, err := os.CreateTemp(dir, "sync-probe-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	rec := make([]byte, size)
	if _, err := f.Write(make([]byte, n*size)); err != nil {
		return nil, err
	}
	if err := f.Sync(); err != nil {
		return nil, err
	}
	lat := make([]time.Duration, 0, n)
	for i := range n {
		start := time.Now()
		if _, err := f.WriteAt(rec, int64(i*size)); err != nil {
			return nil, err
		}
		if err := Datasync(f); err != nil {
			return nil, err
		}
		lat = append(lat, time.Since(start))
	}
	slices.Sort(lat)
	return lat, nil
}
