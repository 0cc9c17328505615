package e2e

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/Azure/iot-operations-sdks/go/protocol"
	"github.com/Azure/iot-operations-sdks/go/services/leasedlock"
	"github.com/google/uuid"
)

func newLease(c *sdkClient, name string, opt ...leasedlock.Option) *leasedlock.Lease[string, string] {
	return leasedlock.NewLease(c.store, name, opt...)
}

func TestSDKLeaseLifecycle(t *testing.T) {
	s := startServer(t)
	a, b := newSDKClient(t, s), newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	name := uniqueKey(t)
	la, lb := newLease(a, name), newLease(b, name)

	if holder, held, err := la.Holder(ctx); err != nil || held || holder != "" {
		t.Fatalf("Holder of a free lease: %q %v %v", holder, held, err)
	}
	if ok, err := la.Acquire(ctx, 10*time.Second); err != nil || !ok {
		t.Fatalf("a.Acquire: %v %v", ok, err)
	}
	first, _ := la.Token(ctx)
	if holder, held, err := lb.Holder(ctx); err != nil || !held || holder != a.store.ID() {
		t.Fatalf("Holder seen by b: %q %v %v", holder, held, err)
	}
	if ok, err := lb.Acquire(ctx, 10*time.Second); err != nil || ok {
		t.Fatalf("b.Acquire of a held lease: %v %v", ok, err)
	}
	// Renewal by the holder yields a strictly greater token.
	if ok, err := la.Acquire(ctx, 10*time.Second); err != nil || !ok {
		t.Fatalf("a renew: %v %v", ok, err)
	}
	second, _ := la.Token(ctx)
	if second.Compare(first) <= 0 {
		t.Fatalf("renewed token %v not greater than %v", second, first)
	}
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, held, _ := lb.Holder(ctx); held {
		t.Fatal("lease still held after Release")
	}
	if ok, err := lb.Acquire(ctx, 10*time.Second); err != nil || !ok {
		t.Fatalf("b.Acquire after release: %v %v", ok, err)
	}
	third, _ := lb.Token(ctx)
	if third.Compare(second) <= 0 {
		t.Fatalf("new holder's token %v not greater than %v", third, second)
	}
}

func TestSDKLeaseWithSessionIDs(t *testing.T) {
	s := startServer(t)
	c := newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	name := uniqueKey(t)
	l1 := newLease(c, name, leasedlock.WithSessionID("one"))
	l2 := newLease(c, name, leasedlock.WithSessionID("two"))
	if ok, _ := l1.Acquire(ctx, 10*time.Second); !ok {
		t.Fatal("session one could not acquire")
	}
	if ok, _ := l2.Acquire(ctx, 10*time.Second); ok {
		t.Fatal("session two acquired a lease held by session one of the same client")
	}
	if holder, _, _ := l2.Holder(ctx); holder != c.store.ID()+":one" {
		t.Fatalf("holder %q", holder)
	}
}

func TestSDKLeaseAutoRenew(t *testing.T) {
	s := startServer(t)
	a, b := newSDKClient(t, s), newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	name := uniqueKey(t)
	la := newLease(a, name)
	if ok, err := la.Acquire(ctx, 400*time.Millisecond, leasedlock.WithRenew(100*time.Millisecond)); err != nil || !ok {
		t.Fatalf("Acquire with renew: %v %v", ok, err)
	}
	defer la.Release(ctx)
	// Well past the lease term the renewals keep it held.
	time.Sleep(1200 * time.Millisecond)
	if holder, held, err := newLease(b, name).Holder(ctx); err != nil || !held || holder != a.store.ID() {
		t.Fatalf("after renewals: %q %v %v", holder, held, err)
	}
}

func TestSDKLockWaitsForExpiryOfAnotherHolder(t *testing.T) {
	s := startServer(t)
	a, b := newSDKClient(t, s), newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	name := uniqueKey(t)
	la := leasedlock.NewLock(a.store, name)
	lb := leasedlock.NewLock(b.store, name)
	if ok, err := la.Acquire(ctx, time.Second); err != nil || !ok {
		t.Fatalf("a: %v %v", ok, err)
	}
	aToken, _ := la.Token(ctx)
	start := time.Now()
	// a never releases: b gets the lock only through the expiry DELETE.
	if err := lb.Lock(ctx, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	waited := time.Since(start)
	bToken, _ := lb.Token(ctx)
	if bToken.Compare(aToken) <= 0 {
		t.Fatalf("b's token %v not greater than a's %v", bToken, aToken)
	}
	if waited < 500*time.Millisecond {
		t.Fatalf("b locked after %v, before a's lease could expire", waited)
	}
	if holder, _, _ := lb.Holder(ctx); holder != b.store.ID() {
		t.Fatalf("holder %q", holder)
	}
	lb.Unlock(ctx)
}

func TestSDKEdit(t *testing.T) {
	s := startServer(t)
	c := newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	key := uniqueKey(t)
	lock := leasedlock.NewLock(c.store, uniqueKey(t))
	if _, err := c.store.Set(ctx, key, "initial"); err != nil {
		t.Fatal(err)
	}
	err := lock.Edit(ctx, key, 5*time.Second, func(_ context.Context, val string, exists bool) (string, bool, error) {
		if val != "initial" || !exists {
			return "", false, errors.New("edit saw " + val)
		}
		return "updated", true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if get, _ := c.store.Get(ctx, key); get.Value != "updated" {
		t.Fatalf("value %q", get.Value)
	}
	// The edit wrote under the lock's fencing token: a write without
	// one is now refused.
	if _, err := c.store.Set(ctx, key, "unfenced"); err == nil {
		t.Fatal("write without fencing token accepted on a fenced key")
	}
	// Edit that deletes.
	err = lock.Edit(ctx, key, 5*time.Second, func(context.Context, string, bool) (string, bool, error) { return "", false, nil })
	if err != nil {
		t.Fatal(err)
	}
	if get, _ := c.store.Get(ctx, key); !get.Version.IsZero() {
		t.Fatal("key still present after deleting edit")
	}
}

func TestSDKEditWaitsForAnotherHolder(t *testing.T) {
	s := startServer(t)
	a, b := newSDKClient(t, s), newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	key, name := uniqueKey(t), uniqueKey(t)
	if ok, _ := leasedlock.NewLock(a.store, name).Acquire(ctx, time.Second); !ok {
		t.Fatal("a could not take the lock")
	}
	err := leasedlock.NewLock(b.store, name).Edit(ctx, key, time.Second, func(_ context.Context, v string, ex bool) (string, bool, error) {
		return "by-b", true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if get, _ := a.store.Get(ctx, key); get.Value != "by-b" {
		t.Fatalf("value %q", get.Value)
	}
}

func TestSDKEditGivesUpWhileLockIsHeld(t *testing.T) {
	s := startServer(t)
	a, b := newSDKClient(t, s), newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	key, name := uniqueKey(t), uniqueKey(t)
	if ok, _ := leasedlock.NewLock(a.store, name).Acquire(ctx, 10*time.Second); !ok {
		t.Fatal("a could not take the lock")
	}
	a.store.Set(ctx, key, "initial")
	err := leasedlock.NewLock(b.store, name).Edit(ctx, key, time.Second,
		func(context.Context, string, bool) (string, bool, error) { return "by-b", true, nil },
		leasedlock.WithTimeout(time.Second))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want deadline exceeded", err)
	}
	if get, _ := a.store.Get(ctx, key); get.Value != "initial" {
		t.Fatalf("value %q changed without the lock", get.Value)
	}
}

// TestSDKCallFromCommandHandler makes a state store call from inside a
// command handler, on the MQTT connection the command arrived on, while
// that command is still unacknowledged.
func TestSDKCallFromCommandHandler(t *testing.T) {
	s := startServer(t)
	exec := newSDKClient(t, s)
	caller := newSDKClient(t, s)
	ctx := ctxFor(t, 20*time.Second)
	topic := "mqkv-test/" + uuid.NewString()
	enc := protocol.JSON[string]{}

	invoker, err := protocol.NewCommandInvoker(sdkApp(t), caller.mqtt, enc, enc, topic)
	if err != nil {
		t.Fatal(err)
	}
	defer invoker.Close()
	executor, err := protocol.NewCommandExecutor(sdkApp(t), exec.mqtt, enc, enc, topic,
		func(ctx context.Context, req *protocol.CommandRequest[string]) (*protocol.CommandResponse[string], error) {
			val := "written-by-handler-" + req.Payload
			res, err := exec.store.Set(ctx, req.Payload, val)
			if err != nil {
				return nil, err
			}
			if !res.Value {
				return nil, errors.New("set not applied")
			}
			return protocol.Respond(val)
		},
		protocol.WithConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	defer executor.Close()
	if err := executor.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := invoker.Start(ctx); err != nil {
		t.Fatal(err)
	}
	key := uniqueKey(t)
	res, err := invoker.Invoke(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if get, _ := caller.store.Get(ctx, key); get.Value != res.Payload {
		t.Fatalf("stored %q, handler answered %q", get.Value, res.Payload)
	}
}
