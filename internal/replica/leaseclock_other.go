//go:build !linux

package replica

import "time"

// LeaseClock is the clock of read leases (see ReadLease): Go's monotonic
// clock here (Linux's runs on while the machine is suspended).
func LeaseClock() time.Duration { return monotonic() }
