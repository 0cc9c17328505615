// Package testaddr hands out loopback addresses for tests whose servers
// stop and come back at the same address: nothing here is for production.
package testaddr

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// Free returns a loopback address nobody listens on now, so that a
// stopped or killed server can come back at the same address. It never
// returns one it returned before in this process: a port closed at once
// is free again for the next call, and a node once got the same port for
// its MQTT listener and its node link (TestClusterLinearizableUnderFaults:
// "address already in use").
//
// The ports are below the kernel's ephemeral range, from a place of this
// process's own. A port from that range (the kernel's choice for a listen
// on port 0) can be taken by some connection's local end while its server
// is down, and the server cannot come back: "admin listener: bind:
// address already in use" in the e2e tests, and "cluster listener: bind:
// address already in use" in internal/cluster's, both in CI with other
// packages' tests running beside them.
func Free() (string, error) {
	portsOnce.Do(func() {
		lo := 32768
		if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
			if f := strings.Fields(string(b)); len(f) == 2 {
				if v, err := strconv.Atoi(f[0]); err == nil {
					lo = v
				}
			}
		}
		portsLow, portsHigh = 10000, lo
		if portsHigh-portsLow < 1000 { // no room below it: take the kernel's choice
			portsHigh = 0
		}
		nextPort.Store(int64(os.Getpid()*7919) % int64(max(portsHigh-portsLow, 1)))
	})
	for range 1000 {
		addr := "127.0.0.1:0"
		if portsHigh > 0 {
			addr = fmt.Sprintf("127.0.0.1:%d", portsLow+int(nextPort.Add(1)%int64(portsHigh-portsLow)))
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			continue
		}
		addr = ln.Addr().String()
		ln.Close()
		if _, issued := issuedPorts.LoadOrStore(addr, true); !issued {
			return addr, nil
		}
	}
	return "", errors.New("testaddr: no loopback port not handed out before")
}

// issuedPorts holds the addresses Free returned; it hands out ports from
// [portsLow, portsHigh), from nextPort on.
var (
	issuedPorts         sync.Map
	portsOnce           sync.Once
	portsLow, portsHigh int
	nextPort            atomic.Int64
)
