package broker

import (
	"bytes"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/eclipse/paho.golang/packets"
	mqtt "github.com/mochi-mqtt/server/v2"
)

// TestAbortedTakeoverStrandsNoMessage: while a publisher keeps
// publishing to a persistent session, connections resuming it go away
// before their session is established. The messages routed to the old
// connection after mochi's copy (the "leftovers") still reach the
// client: before connEnded, nothing sent them (takeLeftovers ran only in
// OnSessionEstablished, and forwardIfTakenOver skipped a client in
// b.handovers), 7 to 200 of a burst.
func TestAbortedTakeoverStrandsNoMessage(t *testing.T) {
	b := startTestBroker(t, "")
	props := offlineSession(t, b, nil)

	pub := dialR(t, b.Addr(), packets.Connect{ClientID: "pub", CleanStart: true})
	payload := bytes.Repeat([]byte("x"), 100)
	// Fill the session so that mochi's ClearInflights takes a while.
	for i := range 200 {
		pub.send(&packets.Publish{PacketID: uint16(i + 1), QoS: 1, Topic: "t/x", Payload: payload})
		pub.next()
	}
	var published atomic.Int64
	done := make(chan struct{})
	go func() { // acks drained
		defer close(done)
		for {
			pub.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := packets.ReadPacket(pub.conn); err != nil {
				return
			}
		}
	}()
	next := 0
	stranded := 0
	seen := map[string]bool{}
	for attempt := 0; attempt < 40 && stranded == 0; attempt++ {
		before, _ := b.srv.Clients.Get("s")
		burst := make(chan struct{})
		go func(from int) {
			defer close(burst)
			for i := from; i < from+300; i++ {
				p := &packets.Publish{PacketID: uint16(i%60000 + 1), QoS: 1, Topic: "t/x", Payload: []byte(fmt.Sprint(i))}
				if _, err := p.WriteTo(pub.conn); err != nil {
					return
				}
				published.Add(1)
			}
		}(next)
		next += 300
		time.Sleep(500 * time.Microsecond)
		resumeAndReset(t, b, props)
		eventuallyR(t, "the aborted connection handled", func() bool {
			cur, _ := b.srv.Clients.Get("s")
			return cur != before && cur.Closed() && b.ClientsConnected() <= 1
		})
		<-burst
		// Drain the session a little with a good connection so it never
		// reaches --max-queued.
		{
			g := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false,
				Properties: props})
			g.send(&packets.Pingreq{})
			for pong := false; !pong; {
				switch p := g.next().Content.(type) {
				case *packets.Publish:
					seen[string(p.Payload)] = true
					g.send(&packets.Puback{PacketID: p.PacketID})
				case *packets.Pingresp:
					pong = true
				}
			}
			g.conn.Close()
			for b.ClientsConnected() > 1 {
				time.Sleep(time.Millisecond)
			}
		}
		b.handovers.Range(func(k, v any) bool {
			prev := k.(*mqtt.Client)
			cur, _ := b.srv.Clients.Get("s")
			if prev != cur {
				stranded += prev.State.Inflight.Len()
			}
			return true
		})
	}
	time.Sleep(200 * time.Millisecond)
	n := int(published.Load())
	g := dialR(t, b.Addr(), packets.Connect{ClientID: "s", CleanStart: false,
		Properties: props})
	for {
		g.conn.SetReadDeadline(time.Now().Add(time.Second))
		cp, err := packets.ReadPacket(g.conn)
		if err != nil {
			break
		}
		if p, ok := cp.Content.(*packets.Publish); ok {
			seen[string(p.Payload)] = true
			g.send(&packets.Puback{PacketID: p.PacketID})
		}
	}
	var missing []int
	for i := 0; i < n; i++ {
		if !seen[fmt.Sprint(i)] {
			missing = append(missing, i)
		}
	}
	if len(missing) > 0 && atomic.LoadInt64(&b.srv.Info.InflightDropped) == 0 {
		t.Errorf("%d of %d published messages never reached the session's client: %v", len(missing), n, missing)
	}
	t.Logf("published %d, dropped for a full session %d, handovers entries %d", published.Load(), atomic.LoadInt64(&b.srv.Info.InflightDropped), countMap(&b.handovers))
	if stranded > 0 {
		t.Errorf("%d messages stranded on connections whose session was taken over (never sent again)", stranded)
	}
}
