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
// carries its raft metadata (index, term, membership) at the start of its
// data, where the data's checksum covers it.
//
// hashicorp's file store checks state.bin against the CRC kept in
// meta.json, but nothing checks meta.json itself: one flipped bit in its
// index makes raft skip log entries, or apply some twice, without a word;
// one in its membership gives the group members it never had. A snapshot
// whose meta.json disagrees with the copy does not open, as one whose
// data fails its checksum does (raft then tries an older one, or stops).
// Snapshots written before the copy existed open unchecked. meta.json's
// size, which a leader announces when it sends the snapshot, is checked
// against the file.
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

// metaMagic starts a snapshot's copy of its metadata. Neither payload
// written before it existed (a store's snapshot starts "MQKVSNAP", the
// metadata group's with its format byte 1) starts so.
const metaMagic = "mqkvSM\x00\x01"

// maxMetaCopy bounds the copy's length, so that a damaged length cannot
// make Open allocate without limit. A membership of hundreds fits.
const maxMetaCopy = 1 << 20

func (s *checkedSnapshots) Create(version raft.SnapshotVersion, index, term uint64, configuration raft.Configuration,
	configurationIndex uint64, trans raft.Transport) (raft.SnapshotSink, error) {
	sink, err := s.SnapshotStore.Create(version, index, term, configuration, configurationIndex, trans)
	if err != nil {
		return nil, err
	}
	if _, err := sink.Write(appendMetaCopy(nil, index, term, configurationIndex, configuration)); err != nil {
		sink.Cancel()
		return nil, err
	}
	return sink, nil
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
	head := make([]byte, len(metaMagic)+4)
	n, err := io.ReadFull(rc, head)
	if err != nil || string(head[:len(metaMagic)]) != metaMagic {
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
			rc.Close()
			return nil, nil, err
		}
		// Written before the copy existed: the data as it was.
		return m, readCloser{io.MultiReader(bytes.NewReader(head[:n]), rc), rc}, nil
	}
	size := binary.BigEndian.Uint32(head[len(metaMagic):])
	if size > maxMetaCopy {
		rc.Close()
		return nil, nil, fmt.Errorf("snapshot %s: its copy of the metadata claims %d bytes", id, size)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(rc, body); err != nil {
		rc.Close()
		return nil, nil, fmt.Errorf("snapshot %s: its copy of the metadata: %w", id, err)
	}
	want := appendMetaCopy(nil, m.Index, m.Term, m.ConfigurationIndex, m.Configuration)
	if !bytes.Equal(want[len(head):], body) {
		rc.Close()
		return nil, nil, fmt.Errorf("snapshot %s: meta.json (index %d, term %d, membership %v) does not match the copy kept in the snapshot's data: one of them is damaged",
			id, m.Index, m.Term, m.Configuration.Servers)
	}
	m.Size -= int64(len(head) + len(body)) // what raft sends a follower is the payload
	return m, rc, nil
}

// appendMetaCopy appends the copy of a snapshot's metadata: magic, length,
// then index, term, configuration index and the servers. The file store's
// checksum of the data covers it.
func appendMetaCopy(b []byte, index, term, configurationIndex uint64, conf raft.Configuration) []byte {
	b = append(b, metaMagic...)
	at := len(b)
	b = append(b, 0, 0, 0, 0)
	b = binary.BigEndian.AppendUint64(b, index)
	b = binary.BigEndian.AppendUint64(b, term)
	b = binary.BigEndian.AppendUint64(b, configurationIndex)
	b = binary.AppendUvarint(b, uint64(len(conf.Servers)))
	for _, srv := range conf.Servers {
		b = append(b, byte(srv.Suffrage))
		b = binary.AppendUvarint(b, uint64(len(srv.ID)))
		b = append(b, srv.ID...)
		b = binary.AppendUvarint(b, uint64(len(srv.Address)))
		b = append(b, srv.Address...)
	}
	binary.BigEndian.PutUint32(b[at:], uint32(len(b)-at-4))
	return b
}

type readCloser struct {
	io.Reader
	io.Closer
}
