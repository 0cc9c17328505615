package broker

import (
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
)

// establishing serializes the connections of one client id from the
// moment mochi begins to establish their session (OnSessionEstablish) to
// the moment it is established (OnSessionEstablished) or the connection
// ends. mochi (v2.7.9, inheritClientSession) takes a session over without
// a lock: two connections of one client id at the same moment both took
// over the same old connection, each copying its messages, and the
// broker's record of the takeover (handovers) named only one of them
// (a data race, 1 in 10 runs of TestAbortedTakeoverLeavesNoHandover).
// In turn, the second takes the session over from the first.
type establishing struct {
	mu   sync.Mutex
	held map[string]*establishment // client id → the connection establishing it
}

type establishment struct {
	cl   *mqtt.Client
	done chan struct{}
}

// establishWait bounds the wait for another connection's establishment:
// it writes only to its own connection, which never blocks (see
// clientConn.Write), so this is only a backstop.
const establishWait = 10 * time.Second

// acquire waits until no other connection of cl's client id is being
// established, and makes cl the one.
func (e *establishing) acquire(cl *mqtt.Client) {
	deadline := time.After(establishWait)
	for {
		e.mu.Lock()
		if e.held == nil {
			e.held = map[string]*establishment{}
		}
		cur := e.held[cl.ID]
		if cur == nil || cur.cl == cl {
			if cur == nil {
				e.held[cl.ID] = &establishment{cl: cl, done: make(chan struct{})}
			}
			e.mu.Unlock()
			return
		}
		e.mu.Unlock()
		select {
		case <-cur.done:
		case <-deadline:
			return // goes ahead, as mochi would
		}
	}
}

// release ends cl's establishment, if it holds one.
func (e *establishing) release(cl *mqtt.Client) {
	e.mu.Lock()
	cur := e.held[cl.ID]
	if cur != nil && cur.cl == cl {
		delete(e.held, cl.ID)
		close(cur.done)
	}
	e.mu.Unlock()
}
