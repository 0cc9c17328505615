package replica

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/hashicorp/raft"
)

// CheckedSnapshots wraps a raft snapshot store so that each snapshot also
// keeps a copy of its raft metadata (index, term, membership, size) in a
// file of its own, meta.check, beside meta.json.
//
// hashicorp's file store checks state.bin against the CRC kept in
// meta.json, but nothing checks meta.json itself: one flipped bit in its
// index makes raft skip log entries, or apply some twice, without a word;
// one in its membership gives the group members it never had; one in its
// size is what a leader announces to a follower it sends the snapshot to.
// A snapshot whose meta.json disagrees with the copy does not open, as one
// whose data fails its checksum does. Snapshots written before the copy
// existed open unchecked (but for their size, checked against the file);
// and a release before it ignores the file, so a node can go back one.
//
// It also keeps raft from a fallback that ends in a panic: when the newest
// snapshot does not open, raft restores an older one, then panics on the
// first log entry after it if the log was compacted past it (as it is in
// steady state). So List offers older snapshots only while the log still
// holds the entries after them, and a newest snapshot whose meta.json does
// not even parse (the file store skips it without a word) is an error.
//
// dir is the file store's directory, logs the group's log.
func CheckedSnapshots(dir string, s raft.SnapshotStore, logs raft.LogStore) raft.SnapshotStore {
	return &checkedSnapshots{SnapshotStore: s, dir: filepath.Join(dir, "snapshots"), logs: logs}
}

type checkedSnapshots struct {
	raft.SnapshotStore
	dir  string
	logs raft.LogStore

	mu      sync.Mutex
	refused error // why the last snapshot that did not open did not
}

func (s *checkedSnapshots) refuse(err error) {
	s.mu.Lock()
	s.refused = err
	s.mu.Unlock()
}

func (s *checkedSnapshots) List() ([]*raft.SnapshotMeta, error) {
	metas, err := s.SnapshotStore.List()
	if err != nil {
		return nil, err
	}
	if err := s.unreadable(metas); err != nil {
		s.refuse(err)
		return nil, err
	}
	// An older snapshot can stand in for the newest only if the log holds
	// every entry from it to past the newest: else the group would go
	// back in time, or raft panic on an entry that is not there.
	first, err := s.logs.FirstIndex()
	if err != nil {
		return nil, err
	}
	last, err := s.logs.LastIndex()
	if err != nil {
		return nil, err
	}
	if len(metas) == 0 || first == 0 || last < metas[0].Index {
		return metas[:min(len(metas), 1)], nil
	}
	for i := 1; i < len(metas); i++ {
		if first > metas[i].Index+1 { // newest first: the rest are older still
			return metas[:i], nil
		}
	}
	return metas, nil
}

// unreadable reports a snapshot directory newer than every snapshot the
// file store listed: its meta.json did not parse.
func (s *checkedSnapshots) unreadable(metas []*raft.SnapshotMeta) error {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		return nil // the file store made the directory; List said what it could
	}
	for _, e := range entries {
		var term, index, ms uint64
		if !e.IsDir() || strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		if _, err := fmt.Sscanf(e.Name(), "%d-%d-%d", &term, &index, &ms); err != nil {
			continue
		}
		if len(metas) == 0 || term > metas[0].Term || term == metas[0].Term && index > metas[0].Index {
			return fmt.Errorf("snapshot %s: its meta.json cannot be read, and it is the newest", e.Name())
		}
	}
	return nil
}

// SnapshotDamage returns err, from raft opening a group on snaps (a
// CheckedSnapshots under dir), as a DamagedError if snaps refused a
// snapshot meanwhile: raft's own error ("failed to load any existing
// snapshots", or none at all) does not say why.
func SnapshotDamage(snaps raft.SnapshotStore, dir, what string, err error) error {
	if why := snapshotRefusal(snaps); why != nil {
		return &DamagedError{Path: filepath.Join(dir, "snapshots"), What: what, Err: why}
	}
	return err
}

// snapshotRefusal says why s last refused a snapshot, if it is a
// CheckedSnapshots and did.
func snapshotRefusal(s raft.SnapshotStore) error {
	c, ok := s.(*checkedSnapshots)
	if !ok {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.refused
}

// checkFile holds a snapshot's copy of its metadata, in its directory.
const checkFile = "meta.check"

func (s *checkedSnapshots) Create(version raft.SnapshotVersion, index, term uint64, configuration raft.Configuration,
	configurationIndex uint64, trans raft.Transport) (raft.SnapshotSink, error) {
	sink, err := s.SnapshotStore.Create(version, index, term, configuration, configurationIndex, trans)
	if err != nil {
		return nil, err
	}
	return &checkedSink{SnapshotSink: sink, dir: filepath.Join(s.dir, sink.ID()+".tmp"),
		write: func(size int64) []byte {
			return appendMetaCopy(nil, index, term, configurationIndex, configuration, size)
		}}, nil
}

// checkedSink writes the copy into the snapshot's directory while it is
// still the file store's temporary one (dir): the store's Close moves it
// into place with meta.json and state.bin, or none of them.
type checkedSink struct {
	raft.SnapshotSink
	dir    string
	write  func(size int64) []byte
	size   int64
	closed bool // raft closes a sink the FSM's Persist closed already
}

func (c *checkedSink) Write(p []byte) (int, error) {
	n, err := c.SnapshotSink.Write(p)
	c.size += int64(n)
	return n, err
}

func (c *checkedSink) Close() error {
	if c.closed {
		return nil
	}
	c.closed = true
	f, err := os.OpenFile(filepath.Join(c.dir, checkFile), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err == nil {
		_, err = f.Write(c.write(c.size))
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		c.SnapshotSink.Cancel()
		return fmt.Errorf("snapshot %s: %w", c.ID(), err)
	}
	return c.SnapshotSink.Close()
}

func (s *checkedSnapshots) Open(id string) (*raft.SnapshotMeta, io.ReadCloser, error) {
	m, rc, err := s.open(id)
	if err != nil {
		s.refuse(err)
	}
	return m, rc, err
}

func (s *checkedSnapshots) open(id string) (*raft.SnapshotMeta, io.ReadCloser, error) {
	m, rc, err := s.SnapshotStore.Open(id)
	if err != nil {
		return nil, nil, fmt.Errorf("snapshot %s: %w", id, err)
	}
	if fi, err := os.Stat(filepath.Join(s.dir, id, "state.bin")); err == nil && fi.Size() != m.Size {
		rc.Close()
		return nil, nil, fmt.Errorf("snapshot %s: meta.json gives its size as %d bytes, the file holds %d: one of them is damaged", id, m.Size, fi.Size())
	}
	kept, err := os.ReadFile(filepath.Join(s.dir, id, checkFile))
	switch {
	case errors.Is(err, os.ErrNotExist):
		return m, rc, nil // written before the copy existed
	case err != nil:
		rc.Close()
		return nil, nil, fmt.Errorf("snapshot %s: %w", id, err)
	case !bytes.Equal(kept, appendMetaCopy(nil, m.Index, m.Term, m.ConfigurationIndex, m.Configuration, m.Size)):
		rc.Close()
		return nil, nil, fmt.Errorf("snapshot %s: meta.json (index %d, term %d, membership %v, %d bytes) does not match its copy in %s: one of them is damaged",
			id, m.Index, m.Term, m.Configuration.Servers, m.Size, checkFile)
	}
	return m, rc, nil
}

// appendMetaCopy appends the copy of a snapshot's metadata: a format
// byte, index, term, configuration index, size and the servers.
func appendMetaCopy(b []byte, index, term, configurationIndex uint64, conf raft.Configuration, size int64) []byte {
	b = append(b, 1)
	b = binary.BigEndian.AppendUint64(b, index)
	b = binary.BigEndian.AppendUint64(b, term)
	b = binary.BigEndian.AppendUint64(b, configurationIndex)
	b = binary.BigEndian.AppendUint64(b, uint64(size))
	b = binary.AppendUvarint(b, uint64(len(conf.Servers)))
	for _, srv := range conf.Servers {
		b = append(b, byte(srv.Suffrage))
		b = binary.AppendUvarint(b, uint64(len(srv.ID)))
		b = append(b, srv.ID...)
		b = binary.AppendUvarint(b, uint64(len(srv.Address)))
		b = append(b, srv.Address...)
	}
	return b
}
