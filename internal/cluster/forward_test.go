package cluster

import (
	"context"
	"testing"
	"time"
)

// TestForwardingIsBounded: writes forwarded to a group and not yet
// answered are held to maxForwarded in number, and go while fewer than
// maxForwardedBytes are out (one larger than that too, then nothing
// more); a write waits for room, and a wait ends with its context.
func TestForwardingIsBounded(t *testing.T) {
	t.Parallel()
	var f forwarding
	bg := context.Background()
	for i := 0; i < maxForwarded; i++ {
		if err := f.acquire(bg, 1); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(bg, 50*time.Millisecond)
	defer cancel()
	if err := f.acquire(ctx, 1); err == nil {
		t.Fatal("a write past maxForwarded did not wait")
	}
	got := make(chan error, 1)
	go func() { got <- f.acquire(bg, 1) }()
	select {
	case err := <-got:
		t.Fatalf("acquired with no room: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	f.release(1)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	for i := 0; i < maxForwarded; i++ {
		f.release(1)
	}
	if f.writes != 0 || f.bytes != 0 {
		t.Fatalf("left %d writes, %d bytes", f.writes, f.bytes)
	}
	if err := f.acquire(bg, 2*maxForwardedBytes); err != nil { // larger than the budget: goes
		t.Fatal(err)
	}
	ctx2, cancel2 := context.WithTimeout(bg, 50*time.Millisecond)
	defer cancel2()
	if err := f.acquire(ctx2, 1); err == nil {
		t.Fatal("a write past maxForwardedBytes did not wait")
	}
}
