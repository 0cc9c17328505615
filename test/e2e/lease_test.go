package e2e

import (
	"github.com/Azure/iot-operations-sdks/go/services/leasedlock"
)

func newLease(c *sdkClient, name string) *leasedlock.Lease[string, string] {
	return leasedlock.NewLease(c.store, name)
}
