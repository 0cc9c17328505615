package replica

import (
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// DiskGuard keeps a full data volume from wedging the log. The log
// preallocates each segment, so appends inside one never run out of space;
// but a new segment, a snapshot or the term raft must persist to vote can
// fail, and raft-wal stays broken after a failed segment rotation until it
// is reopened. So the guard refuses new writes (deletes still pass: they
// are small and how users make room) while the volume has less than a
// reserve free, before the log itself fails; reads go on; writes resume by
// themselves once space is back. Like etcd's NOSPACE alarm, without an
// alarm to disarm.
//
// One guard watches one directory's volume for all groups of a node. It
// polls statfs often enough to notice a fast writer filling the volume
// before the reserve is gone: a writer at fillRate could not use up the
// space above the reserve before the next look. Far from full that is
// once a second; polling every 20 ms regardless was most of an idle
// node's wakeups (50 of about 70 a second).
type DiskGuard struct {
	dir     string
	reserve atomic.Uint64
	log     *slog.Logger

	free atomic.Uint64
	low  atomic.Bool
	full atomic.Bool // log entries refused (see Room)

	stop     chan struct{}
	stopOnce sync.Once
}

// The free space is read every diskPoll near the reserve or below it,
// every diskPollIdle far above it, in between as fillRate says.
const (
	diskPoll     = 20 * time.Millisecond
	diskPollIdle = time.Second
	fillRate     = 4 << 30 // bytes a second: faster than the fastest disks write
)

// nextPoll is how long until the free space must be read again.
func nextPoll(free, reserve uint64) time.Duration {
	if free <= reserve {
		return diskPoll
	}
	wait := time.Duration(float64(free-reserve) / fillRate * float64(time.Second))
	return min(max(wait, diskPoll), diskPollIdle)
}

// NewDiskGuard watches dir's volume, refusing writes while fewer than
// reserve bytes are free. A reserve of zero watches nothing.
func NewDiskGuard(dir string, reserve uint64, log *slog.Logger) *DiskGuard {
	d := &DiskGuard{dir: dir, log: log, stop: make(chan struct{})}
	d.reserve.Store(reserve)
	if reserve == 0 {
		return d
	}
	d.poll()
	go func() {
		t := time.NewTimer(nextPoll(d.free.Load(), reserve))
		defer t.Stop()
		for {
			select {
			case <-t.C:
				d.poll()
				t.Reset(nextPoll(d.free.Load(), d.reserve.Load()))
			case <-d.stop:
				return
			}
		}
	}()
	return d
}

func (d *DiskGuard) poll() {
	var st syscall.Statfs_t
	if err := syscall.Statfs(d.dir, &st); err != nil {
		return // keep the last reading: a failing statfs is no evidence
	}
	free := st.Bavail * uint64(st.Bsize)
	d.free.Store(free)
	low := free < d.reserve.Load()
	if d.low.Load() == low { // only poll writes it
		return
	}
	// Logged before the change takes effect: whoever sees writes refused,
	// or accepted again, finds the line that says why.
	if low {
		d.log.Error("the data volume is nearly full: writes are refused (reads and deletes go on) until space is freed",
			"dir", d.dir, "free", sizeOf(free), "reserve", sizeOf(d.reserve.Load()))
	} else {
		d.log.Info("space is back on the data volume: writes resume", "dir", d.dir, "free", sizeOf(free))
	}
	d.low.Store(low)
}

// Room is asked before replicated log entries of n bytes are written: it
// returns a *DiskFullError once they would leave less than half the
// reserve free. Below the reserve a leader refuses new writes (Check);
// the half below that is for what leaders already took, deletes and
// expiries, and the log's own upkeep. A node that stops taking entries
// says so once, and again once it takes them again.
func (d *DiskGuard) Room(n int64) error {
	if d == nil || d.reserve.Load() == 0 {
		return nil
	}
	free, reserve := d.free.Load(), d.reserve.Load()
	full := free < reserve/2+uint64(max(n, 0))
	if d.full.Swap(full) != full {
		if full {
			d.log.Error("the data volume is full: this node's replicas take no more log entries until space is freed; their groups go on with their other replicas",
				"dir", d.dir, "free", sizeOf(free), "reserve", sizeOf(reserve))
		} else {
			d.log.Info("space is back on the data volume: this node's replicas take log entries again and catch up", "dir", d.dir, "free", sizeOf(free))
		}
	}
	if full {
		return &DiskFullError{Dir: d.dir, Free: free, Reserve: reserve}
	}
	return nil
}

// Full reports whether the node refused log entries for want of room at
// the last ask (see Room), or is below its reserve.
func (d *DiskGuard) Full() bool { return d != nil && (d.full.Load() || d.low.Load()) }

// SetReserve changes the reserve (tests set it above the free space to
// fill a volume).
func (d *DiskGuard) SetReserve(r uint64) {
	d.reserve.Store(r)
	d.poll()
}

// Check returns a *DiskFullError while the volume is below the reserve.
func (d *DiskGuard) Check() error {
	if d == nil || !d.low.Load() {
		return nil
	}
	return &DiskFullError{Dir: d.dir, Free: d.free.Load(), Reserve: d.reserve.Load()}
}

// Close stops the watching.
func (d *DiskGuard) Close() {
	if d != nil {
		d.stopOnce.Do(func() { close(d.stop) })
	}
}

// DiskFullError refuses a write while the data volume is below its
// reserve.
type DiskFullError struct {
	Dir           string
	Free, Reserve uint64
}

func (e *DiskFullError) Error() string {
	return fmt.Sprintf("the data volume is nearly full (%s free, %s kept in reserve): free space to resume writes",
		sizeOf(e.Free), sizeOf(e.Reserve))
}

func sizeOf(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	default:
		return fmt.Sprintf("%d KiB", n>>10)
	}
}
