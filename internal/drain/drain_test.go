package drain

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestWaitReturnsAtOnceWhenIdle(t *testing.T) {
	var c Counter
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // Wait must not need the context when nothing runs
	if err := c.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestWaitWaitsForWorkStartedBeforeAndDuring(t *testing.T) {
	var c Counter
	c.Start()
	release := make(chan struct{})
	startedDuring := make(chan struct{})
	go func() {
		<-release
		c.Start() // while Wait waits: counted too
		close(startedDuring)
		c.Done() // the first piece ends; the second still runs
		time.AfterFunc(10*time.Millisecond, c.Done)
	}()
	waited := make(chan error, 1)
	go func() { waited <- c.Wait(context.Background()) }()
	select {
	case err := <-waited:
		t.Fatalf("Wait returned (%v) with work in progress", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(release)
	<-startedDuring
	if err := <-waited; err != nil {
		t.Fatal(err)
	}
	if n := c.InProgress(); n != 0 {
		t.Fatalf("Wait returned with %d in progress", n)
	}
}

func TestWaitGivesUpWithItsContext(t *testing.T) {
	var c Counter
	c.Start()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	if err := c.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait = %v, want the deadline", err)
	}
}

// TestWaitSeesEveryEnd races many short pieces of work against Wait: it
// must never return while one runs, nor miss the last end (it would hang).
func TestWaitSeesEveryEnd(t *testing.T) {
	for round := 0; round < 200; round++ {
		var c Counter
		var running sync.WaitGroup
		for i := 0; i < 8; i++ {
			c.Start()
			running.Add(1)
			go func() {
				defer running.Done()
				c.Done()
			}()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := c.Wait(ctx); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		cancel()
		if n := c.InProgress(); n != 0 {
			t.Fatalf("round %d: Wait returned with %d in progress", round, n)
		}
		running.Wait()
	}
}
