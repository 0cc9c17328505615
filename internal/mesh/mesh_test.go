package mesh

import (
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/peer"
)

type node struct {
	id   string
	link *peer.Link
	m    *Mesh
	mu   sync.Mutex
	got  []string // "from:topic:payload"
	// hold keeps the deliveries' done functions instead of calling
	// them (a session written to the store first).
	hold  bool
	holds []func()
}

func (n *node) received() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Clone(n.got)
}

// cluster starts n meshes on real links over loopback, all members of
// one another.
func cluster(t *testing.T, n int) []*node {
	t.Helper()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	nodes := make([]*node, n)
	addrs := map[string]string{}
	var mu sync.Mutex
	for i := range nodes {
		id := fmt.Sprint("n", i+1)
		link, err := peer.Listen(peer.Config{NodeID: id, Listen: "127.0.0.1:0", Secret: []byte("test-secret-0123456789"), Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		nodes[i] = &node{id: id, link: link}
		addrs[id] = link.Addr()
	}
	for _, nd := range nodes {
		nd.m = New(Config{Link: nd.link, Self: nd.id, Logger: quiet,
			Members: func() map[string]string {
				mu.Lock()
				defer mu.Unlock()
				out := map[string]string{}
				for k, v := range addrs {
					out[k] = v
				}
				return out
			},
			Deliver: func(from string, d *Delivery, done func()) {
				nd.mu.Lock()
				nd.got = append(nd.got, fmt.Sprintf("%s:%s:%s", from, d.Msg.Topic, d.Msg.Payload))
				if nd.hold {
					nd.holds = append(nd.holds, done)
					done = nil
				}
				nd.mu.Unlock()
				if done != nil {
					done()
				}
			}})
	}
	t.Cleanup(func() {
		for _, nd := range nodes {
			nd.m.Close()
			nd.link.Close()
		}
	})
	return nodes
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// A subscription is known to every node when Subscribed returns; a
// message crosses to the nodes that want it, once, in order; an
// unsubscribe takes the node out.
func TestInterestAndMessages(t *testing.T) {
	ns := cluster(t, 3)
	eventually(t, "the streams", func() bool {
		for _, n := range ns {
			n.m.mu.Lock()
			c := len(n.m.senders)
			n.m.mu.Unlock()
			if c != 2 {
				return false
			}
		}
		return true
	})
	// Connected: Subscribed waits for the others.
	eventually(t, "connected senders", func() bool {
		for _, n := range ns {
			n.m.mu.Lock()
			for _, s := range n.m.senders {
				s.mu.Lock()
				ok := s.connected
				s.mu.Unlock()
				if !ok {
					n.m.mu.Unlock()
					return false
				}
			}
			n.m.mu.Unlock()
		}
		return true
	})
	ns[1].m.Subscribed("a/+", true)
	ns[2].m.Subscribed("$share/g/a/#", true)
	if w := ns[0].m.Want("a/b"); !slices.Equal(w.Plain, []string{"n2"}) || !slices.Equal(w.Shared["$share/g/a/#"], []string{"n3"}) {
		t.Fatalf("n1's view of a/b right after the subscriptions: %+v", w)
	}
	if w := ns[0].m.Want("b"); len(w.Plain) != 0 || len(w.Shared) != 0 {
		t.Fatalf("n1's view of b: %+v", w)
	}
	acked := make(chan int, 100)
	for i := range 50 {
		ns[0].m.Send("n2", &Delivery{Msg: Message{Topic: "a/b", Payload: []byte(fmt.Sprint(i)), QoS: 1}, Plain: true}, func() { acked <- i })
	}
	for i := range 50 {
		select {
		case got := <-acked:
			if got != i {
				t.Fatalf("ack %d, want %d", got, i)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("ack %d missing", i)
		}
	}
	got := ns[1].received()
	if len(got) != 50 || got[0] != "n1:a/b:0" || got[49] != "n1:a/b:49" {
		t.Fatalf("n2 received %v", got)
	}
	ns[1].m.Subscribed("a/+", false)
	eventually(t, "the unsubscribe to reach n1", func() bool { return len(ns[0].m.Want("a/b").Plain) == 0 })
}

// A delivery done later (its session written to the store first) is
// acknowledged only then, and in order: a later message done first waits
// for the one before it.
func TestDeliveryDoneLaterIsAcknowledgedInOrder(t *testing.T) {
	ns := cluster(t, 2)
	ns[1].mu.Lock()
	ns[1].hold = true
	ns[1].mu.Unlock()
	eventually(t, "n2's interest at n1", func() bool {
		ns[1].m.Subscribed("x", true)
		return len(ns[0].m.Want("x").Plain) == 1
	})
	acked := make(chan int, 10)
	for i := range 2 {
		ns[0].m.Send("n2", &Delivery{Msg: Message{Topic: "x", Payload: []byte(fmt.Sprint(i)), QoS: 1}, Plain: true}, func() { acked <- i })
	}
	var holds []func()
	eventually(t, "both delivered", func() bool {
		ns[1].mu.Lock()
		defer ns[1].mu.Unlock()
		holds = ns[1].holds
		return len(holds) == 2
	})
	holds[1]() // the second is done first
	select {
	case i := <-acked:
		t.Fatalf("message %d acknowledged while the first is not done", i)
	case <-time.After(300 * time.Millisecond):
	}
	holds[0]()
	for want := range 2 {
		select {
		case got := <-acked:
			if got != want {
				t.Fatalf("ack %d, want %d", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("ack %d missing once both are done", want)
		}
	}
}

// A stream that breaks: what waits unacknowledged is sent again on the
// next, and delivered once; the interest comes back whole.
func TestBrokenStreamResendsOnce(t *testing.T) {
	ns := cluster(t, 2)
	eventually(t, "n1's sender", func() bool {
		ns[0].m.mu.Lock()
		defer ns[0].m.mu.Unlock()
		s := ns[0].m.senders["n2"]
		if s == nil {
			return false
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.connected
	})
	ns[0].m.Subscribed("x/#", true)
	eventually(t, "n2 to know n1's interest", func() bool { return len(ns[1].m.Want("x/y").Plain) == 1 })
	// Cut: n1's messages wait.
	ns[0].link.Cut(ns[1].link.Addr(), true)
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		ns[0].m.Send("n2", &Delivery{Msg: Message{Topic: "t", Payload: []byte(fmt.Sprint(i)), QoS: 1}, Plain: true}, wg.Done)
	}
	time.Sleep(300 * time.Millisecond)
	ns[0].link.Cut(ns[1].link.Addr(), false)
	wg.Wait()
	got := ns[1].received()
	if len(got) != 20 {
		t.Fatalf("n2 received %d messages: %v", len(got), got)
	}
	for i, g := range got {
		if g != fmt.Sprintf("n1:t:%d", i) {
			t.Fatalf("message %d: %s", i, g)
		}
	}
	if w := ns[1].m.Want("x/y"); len(w.Plain) != 1 {
		t.Fatalf("n1's interest after the cut: %+v", w)
	}
}
