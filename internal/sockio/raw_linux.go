//go:build !race

package sockio

import (
	"syscall"
	"unsafe"
)

// Read is read(2) on fd, a non-blocking socket, as a raw system call:
// the error is syscall.EAGAIN when there is nothing to read.
func Read(fd uintptr, p []byte) (int, error) { return rawCall(syscall.SYS_READ, fd, p) }

// Write is write(2) on fd, a non-blocking socket, as a raw system call:
// it writes what the socket has room for (at most maxCall bytes), and
// the error is syscall.EAGAIN when it has none.
func Write(fd uintptr, p []byte) (int, error) { return rawCall(syscall.SYS_WRITE, fd, p) }

// rawCall is read(2) or write(2) (trap) of at most maxCall bytes of p.
func rawCall(trap, fd uintptr, p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	p = p[:min(len(p), maxCall)]
	n, _, e := syscall.RawSyscall(trap, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}
