package replica

import (
	"time"

	"golang.org/x/sys/unix"
)

// LeaseClock is the clock of read leases (see ReadLease): CLOCK_BOOTTIME,
// which runs on while the machine is suspended. Go's monotonic clock
// (CLOCK_MONOTONIC) stops then, so a leader whose machine slept past its
// lease would take the lease for still running when it woke, while its
// followers (whose clocks ran) had elected another. A process stopped
// with SIGSTOP is safe with either: both run on.
func LeaseClock() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return monotonic()
	}
	return time.Duration(ts.Nano())
}
