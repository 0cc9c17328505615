package journal

import (
	"os"
	"syscall"
)

// Datasync flushes f's data and the metadata needed to read it back (its
// size): an append needs no more. A node on its own syncs its raft-wal
// segments with it too (see replica's walFS).
func Datasync(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		for {
			serr = syscall.Fdatasync(int(fd))
			if serr != syscall.EINTR {
				return
			}
		}
	}); err != nil {
		return err
	}
	return serr
}
