package meta

import (
	"io"
	"sync"

	"github.com/hashicorp/raft"

	"github.com/mqkv/mqkv/internal/records"
)

// Encoding of ops in the metadata log and of snapshots: a format byte,
// then msgpack. New formats take new numbers; old ones stay readable.
const format = 1

// EncodeOp is the log entry of op.
func EncodeOp(op Op) []byte { return encode(op) }

func encode(v any) []byte { return records.Encode(format, v) }

func decode(b []byte, v any) error { return records.Decode("meta", format, b, v) }

// FSM is the metadata group's raft state machine.
type FSM struct {
	mu sync.RWMutex
	st State
	// onChange is told of every new state, on raft's apply goroutine.
	onChange func(*State)
}

var _ raft.FSM = (*FSM)(nil)

// NewFSM returns an empty state machine; onChange (may be nil) receives a
// copy of the state after every change.
func NewFSM(onChange func(*State)) *FSM { return &FSM{onChange: onChange} }

// Apply applies one logged op; the result is its error, or nil.
func (f *FSM) Apply(l *raft.Log) any {
	if l.Type != raft.LogCommand {
		return nil
	}
	var op Op
	if err := decode(l.Data, &op); err != nil {
		return err
	}
	f.mu.Lock()
	err := f.st.Apply(op)
	c := f.st.Clone()
	f.mu.Unlock()
	if err == nil && f.onChange != nil {
		f.onChange(c)
	}
	return err
}

// State returns a copy of the current state.
func (f *FSM) State() *State {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.Clone()
}

func (f *FSM) Snapshot() (raft.FSMSnapshot, error) { return snapshot{f.State()}, nil }

func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, 64<<20))
	if err != nil {
		return err
	}
	var st State
	if err := decode(b, &st); err != nil {
		return err
	}
	f.mu.Lock()
	f.st = st
	c := f.st.Clone()
	f.mu.Unlock()
	if f.onChange != nil {
		f.onChange(c)
	}
	return nil
}

type snapshot struct{ st *State }

func (s snapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write(encode(s.st)); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}

func (snapshot) Release() {}
