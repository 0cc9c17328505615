//go:build !linux || race

package sockio

import "syscall"

// Read is read(2) on fd the ordinary way. Raw system calls are kept to
// Linux, where they are measured, and left out of race-detector builds:
// the syscall package tells the detector that a write to a socket
// happens before the read of it (its ioSync), and a raw call would not,
// so tests whose goroutines meet only through a socket would report
// races that are not there.
func Read(fd uintptr, p []byte) (int, error) { return syscall.Read(int(fd), p[:min(len(p), maxCall)]) }

// Write is write(2) on fd the ordinary way (see Read).
func Write(fd uintptr, p []byte) (int, error) {
	return syscall.Write(int(fd), p[:min(len(p), maxCall)])
}
