//go:build linux

package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/replica"
)

// openRaft starts the raft floor's log: a hashicorp/raft group of one
// over raft-wal in dir, configured as mqkv's group on its own is
// (batched apply channel, 256 entries an append, the same log files),
// applying to an FSM that does nothing. A round of commands that went
// through it is as durable as mqkv's SET: in the log, fdatasynced,
// committed, applied. What mqkv spends above it is its store, its
// service and its gateway.
func openRaft(dir string) (*raft.Raft, error) {
	wal, err := replica.OpenWAL(filepath.Join(dir, "wal"))
	if err != nil {
		return nil, err
	}
	logger := hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Error, Output: os.Stderr})
	snaps, err := raft.NewFileSnapshotStoreWithLogger(dir, 2, logger)
	if err != nil {
		return nil, err
	}
	rc := raft.DefaultConfig()
	rc.LocalID = "floor"
	rc.HeartbeatTimeout = 50 * time.Millisecond
	rc.ElectionTimeout = 50 * time.Millisecond
	rc.LeaderLeaseTimeout = 50 * time.Millisecond
	rc.CommitTimeout = 250 * time.Millisecond
	rc.BatchApplyCh = true
	rc.MaxAppendEntries = 256
	rc.NoLegacyTelemetry = true
	rc.SnapshotThreshold = 4096
	rc.TrailingLogs = 1024
	rc.Logger = logger
	addr, trans := raft.NewInmemTransport("floor")
	if exists, err := raft.HasExistingState(wal, wal, snaps); err != nil {
		return nil, err
	} else if !exists {
		if err := raft.BootstrapCluster(rc, wal, wal, snaps, trans, raft.Configuration{Servers: []raft.Server{{ID: rc.LocalID, Address: addr}}}); err != nil {
			return nil, err
		}
	}
	r, err := raft.NewRaft(rc, nothing{}, wal, wal, snaps, trans)
	if err != nil {
		return nil, err
	}
	for r.State() != raft.Leader {
		select {
		case <-r.LeaderCh():
		case <-time.After(5 * time.Second):
			return nil, fmt.Errorf("the raft floor's group of one elected no leader")
		}
	}
	return r, nil
}

// nothing is the raft floor's FSM: it applies nothing and keeps nothing.
type nothing struct{}

func (nothing) Apply(*raft.Log) any                  { return nil }
func (nothing) ApplyBatch(logs []*raft.Log) []any    { return make([]any, len(logs)) }
func (nothing) Snapshot() (raft.FSMSnapshot, error)  { return nothing{}, nil }
func (nothing) Restore(rc io.ReadCloser) error       { return rc.Close() }
func (nothing) Persist(sink raft.SnapshotSink) error { return sink.Close() }
func (nothing) Release()                             {}
