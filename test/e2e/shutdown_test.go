package e2e

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
)

// TestShutdownAnswersTheWritesItStarted: a graceful shutdown answers each
// write it started before it disconnects the writer, and starts none it
// cannot answer. Clients with persistent sessions write SET NX to keys of
// their own, one at a time, while the server shuts down. After the
// restart, each client's write that had no answer either was not applied
// (so sending it again applies it once) or has its answer waiting in the
// session. A write applied as its client was disconnected, its answer
// lost, would make the client's resent SET NX come back -1, "not applied",
// for a key only it writes.
func TestShutdownAnswersTheWritesItStarted(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := startServerIn(t, dir)
	const clients = 16
	type outcome struct {
		answered   []string // keys answered before the shutdown
		unanswered string   // the key in flight when the connection ended, if its answer did not come
	}
	outcomes := make([]outcome, clients)
	var answered atomic.Int64
	var wg sync.WaitGroup
	for i := range clients {
		rc := dialRaw(t, s, fmt.Sprintf("drain-%d", i), rawOpts{sessionExpiry: 3600, cleanStart: true})
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := &outcomes[i]
			for n := 0; ; n++ {
				key := fmt.Sprintf("drain-%d-%d", i, n)
				reply, err := rc.trySend(req{args: []string{"SET", key, "v", "NX"}, ts: now(), corr: []byte(key)})
				if err == nil {
					select {
					case p := <-reply:
						if string(p.Payload) != "+OK\r\n" {
							t.Errorf("SET %s NX answered %q", key, p.Payload)
							return
						}
						o.answered = append(o.answered, key)
						answered.Add(1)
						continue
					case <-rc.c.Done():
					}
				}
				// The connection ended. paho has routed every packet
				// it read once Done is closed: an answer the server
				// wrote before its DISCONNECT is in the channel.
				<-rc.c.Done()
				select {
				case p := <-reply:
					if string(p.Payload) == "+OK\r\n" {
						o.answered = append(o.answered, key)
						return
					}
				default:
				}
				o.unanswered = key
				return
			}
		}()
	}
	eventually(t, "writes under way", func() bool { return answered.Load() >= 30*clients })
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	s = startServerIn(t, dir)
	check := dialRaw(t, s, "drain-check", rawOpts{cleanStart: true})
	inFlight := 0
	for i, o := range outcomes {
		for _, key := range o.answered {
			expectPayload(t, check.call("GET", key), "$1\r\nv\r\n") // acknowledged: durable
		}
		// The session resends what it kept (answers the client had
		// not acknowledged yet, too) before it answers anything the
		// client sends now: the PING's answer comes after it.
		rc := dialRaw(t, s, fmt.Sprintf("drain-%d", i), rawOpts{sessionExpiry: 3600, noSubscribe: true})
		expectPayload(t, rc.call("PING"), "+PONG\r\n")
		kept := false // the answer to the write in flight
		for len(rc.inbox) > 0 {
			p := <-rc.inbox
			if p.Properties != nil && string(p.Properties.CorrelationData) == o.unanswered {
				kept = true
			}
		}
		if o.unanswered == "" {
			continue
		}
		inFlight++
		p := check.call("GET", o.unanswered)
		switch applied := string(p.Payload) != "$-1\r\n"; {
		case applied && !kept:
			t.Errorf("%s was applied (GET: %q) but its client got no answer, then or from its session after the restart", o.unanswered, p.Payload)
		case !applied && kept:
			t.Errorf("%s was not applied but its client got an answer after the restart", o.unanswered)
		}
	}
	t.Logf("%d writes answered before the shutdown, %d in flight as it began", answered.Load(), inFlight)
}
