package replica

import (
	"os"
	"sync"

	walfs "github.com/hashicorp/raft-wal/fs"
	waltypes "github.com/hashicorp/raft-wal/types"

	"github.com/mqkv/mqkv/internal/journal"
)

// walFS is the file system a group's own raft-wal log runs on: raft-wal's,
// with segments that are written over zeros. raft-wal reserves a segment's
// space with fallocate, which leaves it unwritten: every fsync after an
// append that reaches new blocks must then also commit, through the file
// system's journal, that those blocks now hold data. On the development
// machine's ext4 (BenchmarkWALAppend) a 5 KB entry (a batch of about 16
// SETs) appended and synced took 295 µs and 126–140 µs of CPU over
// fallocated space, 197 µs and 75–78 µs over zeros; a 320-byte one
// 195–204 and 172–176 µs. So a segment's file is filled with zeros a
// little ahead of its writer (zeroAhead), and synced with fdatasync: the
// file's size does not change, so there is no metadata to write. What
// raft-wal reads back is the same either way: zeros past the last frame.
type walFS struct {
	waltypes.VFS
}

func newWALFS() walFS { return walFS{walfs.New()} }

func (v walFS) Create(dir, name string, size uint64) (waltypes.WritableFile, error) {
	wf, err := v.VFS.Create(dir, name, size)
	if err != nil {
		return nil, err
	}
	return newZeroAhead(wf, int64(size)), nil
}

func (v walFS) OpenWriter(dir, name string) (waltypes.WritableFile, error) {
	wf, err := v.VFS.OpenWriter(dir, name)
	if err != nil {
		return nil, err
	}
	var size int64
	if f := osFile(wf); f != nil {
		if st, err := f.Stat(); err == nil {
			size = st.Size()
		}
	}
	return newZeroAhead(wf, size), nil
}

// zeroAheadBytes is how far past the furthest write a segment is filled
// with zeros: the zeros become durable with the next sync, so one sync in
// this many bytes of log pays for the blocks the others then find written.
// They are written in pieces the size of raft-wal's recent writes
// (journal.WriteZeros says why).
const zeroAheadBytes = 1 << 20

// zeroAhead is a segment file open for writing (see walFS). raft-wal
// appends: it writes each frame after the previous one. Zeros only ever go
// past the furthest byte written, and never past the file's size, so they
// overwrite nothing raft-wal wrote and never grow the file.
//
// The zeros are written by a goroutine of their own (fill), not by the
// append that finds them running short: raft's leader appends, syncs,
// then hands the entries on, one after another, and writing zeros (the
// kernel allocating and clearing the page cache for them) took 15 % of a
// pipelined node's CPU there, time every client waited for. Written
// beside the append, they cost the wait nothing while the leader sits in
// its fdatasync. An append that would reach the zeros being written waits
// for them (it would otherwise race them for the same bytes). This relies
// on raft-wal appending one write at a time (under its writeMu): zeros
// start past the furthest write that has returned.
type zeroAhead struct {
	waltypes.WritableFile
	f    *os.File // for fdatasync; nil if the file is not an *os.File
	size int64    // the file's size: zeros stop there

	mu       sync.Mutex
	hi       int64         // the furthest byte written
	zeroed   int64         // zeros written up to here (from hi)
	largest  int64         // raft-wal's largest write since the last zeros
	filling  chan struct{} // closed when the running fill ends; nil if none runs
	fillFrom int64         // where the running fill starts
	failed   bool          // a fill failed: no more zeros in this file
	synced   bool          // raft-wal's own first Sync ran (it also syncs the directory)
}

func newZeroAhead(wf waltypes.WritableFile, size int64) *zeroAhead {
	return &zeroAhead{WritableFile: wf, f: osFile(wf), size: size}
}

// osFile returns the *os.File under one of raft-wal's files.
func osFile(wf waltypes.WritableFile) *os.File {
	switch f := wf.(type) {
	case *walfs.File:
		return &f.File
	case *os.File:
		return f
	}
	return nil
}

func (z *zeroAhead) WriteAt(p []byte, off int64) (int, error) {
	z.mu.Lock()
	for z.filling != nil && off+int64(len(p)) > z.fillFrom {
		done := z.filling
		z.mu.Unlock()
		<-done
		z.mu.Lock()
	}
	z.mu.Unlock()
	n, err := z.WritableFile.WriteAt(p, off)
	z.mu.Lock()
	defer z.mu.Unlock()
	z.hi = max(z.hi, off+int64(n))
	if err != nil {
		return n, err
	}
	z.largest = max(z.largest, int64(n))
	if z.filling == nil && !z.failed && z.hi+zeroAheadBytes/2 > z.zeroed {
		// Refill to a full chunk ahead once half of it is used.
		from := max(z.zeroed, z.hi)
		to := min(z.hi+zeroAheadBytes, z.size)
		if to > from {
			z.filling, z.fillFrom = make(chan struct{}), from
			go z.fill(from, to, journal.ZeroPiece(z.largest), z.filling)
		} else {
			z.zeroed = max(to, z.hi)
		}
		z.largest = 0
	}
	return n, nil
}

// fill writes zeros over [from, to) and then closes done. The zeros only
// make syncs cheaper (raft-wal's file is fallocated: it reads zeros past
// its frames anyway), so a failure does not fail an append: it ends the
// zeros in this file, and raft-wal's own writes meet whatever caused it
// (EIO, or ENOSPC where fallocate fell back to a sparse file).
func (z *zeroAhead) fill(from, to, piece int64, done chan struct{}) {
	err := journal.WriteZeros(z.WritableFile, from, to, piece)
	z.mu.Lock()
	if err != nil {
		z.failed = true
	} else {
		z.zeroed = to
	}
	z.filling = nil
	z.mu.Unlock()
	close(done)
}

// wait returns once no fill runs.
func (z *zeroAhead) wait() {
	z.mu.Lock()
	done := z.filling
	z.mu.Unlock()
	if done != nil {
		<-done
	}
}

// Close closes the file once the zeros being written are.
func (z *zeroAhead) Close() error {
	z.wait()
	return z.WritableFile.Close()
}

// Sync makes what was written durable. The first call is raft-wal's own
// (an fsync, and of the directory for a new file); later ones fdatasync.
func (z *zeroAhead) Sync() error {
	z.mu.Lock()
	first := !z.synced
	z.mu.Unlock()
	if first || z.f == nil {
		err := z.WritableFile.Sync()
		if err == nil {
			z.mu.Lock()
			z.synced = true
			z.mu.Unlock()
		}
		return err
	}
	return journal.Datasync(z.f)
}
