package broker

import (
	"sync"
	"time"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Replies to state store requests.
//
// Published through mochi (InjectPacket), a reply walks the topic index
// for its response topic, a deep topic, building maps of subscribers, and
// is handed to mochi's write goroutine for the client: about a fifth of
// the server's CPU for a GET. Yet nearly always the response topic has one
// subscriber, the client that asked. So when the topic's sole subscriber
// is known to be the asking client, the reply is written to it directly:
// by the client's own reader if made while it handles the request (GET,
// PING, errors: most replies), else (writes, once committed) by a writer
// goroutine of the connection's own, started for each burst of replies,
// because the goroutine that commits serves every client: encoding and
// writing their replies is spread over the connections instead. Any other
// case goes through mochi, as does a reply the connection's writer has
// too many queued before. The writing itself is direct.go's.

// repliesTo reports whether the replies on topic go to cl alone.
func (b *Broker) repliesTo(cl *mqtt.Client, topic string) bool {
	f := b.fanoutOf(topic)
	return f.plain() && len(f.subs) == 1 && f.subs[0].client == cl.ID
}

// connReplies routes the replies to one connection's requests (see
// Broker.Reply).
type connReplies struct {
	mu       sync.Mutex
	cl       *mqtt.Client        // the connection's client, once it made a request
	handling *statestore.Request // the request its reader is handling
	held     []heldReply         // replies to it made meanwhile, for the reader to write
	queue    []heldReply         // other replies, for the writer
	writing  bool                // a writer runs
	ended    bool                // the connection ended
}

type heldReply struct {
	r       *statestore.Request
	payload []byte
	version hlc.Timestamp
}

// replyQueue bounds the replies waiting for a connection's writer; past it
// they go through mochi.
const replyQueue = 256

// handle runs the state store's handling of a request on the client's
// reader, then writes the replies made meanwhile.
func (b *Broker) handle(cl *mqtt.Client, c *conn, req *statestore.Request) {
	c.replies.mu.Lock()
	c.replies.cl, c.replies.handling = cl, req
	c.replies.mu.Unlock()
	b.handler.Handle(req)
	c.replies.mu.Lock()
	c.replies.handling = nil
	held := c.replies.held
	c.replies.held = nil
	c.replies.mu.Unlock()
	for _, h := range held {
		b.deliverReply(cl, h, true)
	}
}

// Reply implements statestore.Transport.
func (b *Broker) Reply(r *statestore.Request, payload []byte, version hlc.Timestamp) {
	h := heldReply{r, payload, version}
	if c, ok := r.Origin.(*conn); ok {
		cr := &c.replies
		cr.mu.Lock()
		switch {
		case cr.handling == r:
			// Made by Handle itself (GET, PING, errors), or the reply
			// of a write committed before Handle returned. Other
			// requests' replies do not wait for this one: a GET may wait
			// on another node's leader.
			cr.held = append(cr.held, h)
			cr.mu.Unlock()
			return
		case cr.cl != nil && !cr.ended && len(cr.queue) < replyQueue:
			cr.queue = append(cr.queue, h)
			if !cr.writing {
				// A writer for this burst of replies: none stays behind
				// for connections that are idle.
				cr.writing = true
				b.writers.Start()
				go b.writeReplies(cr)
			}
			cr.mu.Unlock()
			return
		}
		cr.mu.Unlock()
	}
	b.inject(r.ResponseTopic, payload, replyProperties(r, version))
}

// writeReplies writes a connection's queued replies, in order, until
// none is left. Once the connection has ended they go through mochi,
// into the session if it persists.
func (b *Broker) writeReplies(cr *connReplies) {
	defer b.writers.Done()
	var spare []heldReply // the last batch's slice, emptied: the queue's next
	for {
		cr.mu.Lock()
		batch, cl := cr.queue, cr.cl
		if len(batch) == 0 {
			if batch == nil {
				cr.queue = spare // kept for the next burst
			}
			cr.writing = false
			cr.mu.Unlock()
			return
		}
		cr.queue = spare
		cr.mu.Unlock()
		for _, h := range batch {
			b.deliverReply(cl, h, false)
		}
		clear(batch) // no reply kept alive by the slice
		spare = batch[:0]
	}
}

// endReplies says the connection ended: later replies go through mochi.
func (c *conn) endReplies() {
	c.replies.mu.Lock()
	c.replies.ended = true
	c.replies.mu.Unlock()
}

// deliverReply writes a reply to cl directly if it can, else publishes
// it; reader says the writer is cl's reader (see Broker.write).
func (b *Broker) deliverReply(cl *mqtt.Client, h heldReply, reader bool) {
	if !b.replyDirect(cl, h.r, h.payload, h.version, reader) {
		b.inject(h.r.ResponseTopic, h.payload, replyProperties(h.r, h.version))
	}
}

var statOK = packets.UserProperty{Key: "__stat", Val: "200"}

// replyProperties are a reply's: the request's correlation data and
// message expiry, __stat=200 and the version, if any, as __ts.
func replyProperties(r *statestore.Request, version hlc.Timestamp) packets.Properties {
	user := make([]packets.UserProperty, 1, 2)
	user[0] = statOK
	if !version.IsZero() {
		user = append(user, packets.UserProperty{Key: "__ts", Val: version.String()})
	}
	return packets.Properties{
		CorrelationData:       r.CorrelationData,
		MessageExpiryInterval: r.MessageExpiry,
		User:                  user,
		ContentType:           statestore.ContentType,
	}
}

// replyDirect writes the reply to cl, which asked for it, if cl is the
// response topic's only subscriber and can be written to directly (see
// directTo). It reports whether it took the reply.
func (b *Broker) replyDirect(cl *mqtt.Client, r *statestore.Request, payload []byte, version hlc.Timestamp, reader bool) bool {
	f := b.fanoutOf(r.ResponseTopic)
	caps := b.srv.Options.Capabilities
	if !f.plain() || len(f.subs) != 1 || f.subs[0].client != cl.ID {
		return false
	}
	t := f.subs[0]
	if !b.directTo(cl, true, t.sub, min(t.sub.Qos, 1, caps.MaximumQos)) || !b.allowed(cl, r.ResponseTopic, false) {
		return false
	}
	out := packets.Packet{
		FixedHeader:     packets.FixedHeader{Type: packets.Publish, Qos: 1},
		TopicName:       r.ResponseTopic,
		Payload:         payload,
		Properties:      replyProperties(r, version),
		Origin:          b.inline.ID,
		ProtocolVersion: b.inline.Properties.ProtocolVersion, // mochi expires only v5 records
	}
	if expiry := nonZeroMin(caps.MaximumMessageExpiryInterval, int64(r.MessageExpiry)); expiry > 0 {
		out.Expiry = time.Now().Unix() + expiry
	}
	b.seq.stamp(&out)
	b.deliverDirect(cl, t, out, reader, nil)
	return true
}

// nonZeroMin is the smaller of a and b where zero means no limit.
func nonZeroMin(a, b int64) int64 {
	if a == 0 || b != 0 && b < a {
		return b
	}
	return a
}
