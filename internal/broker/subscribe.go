package broker

import (
	"fmt"
	"strings"
	"sync"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"
)

// Subscription bounds. A client holding unbounded filters costs the broker
// unbounded memory (400,000 filters on one connection took 1 GB), and a
// filter's length and depth cost every match against it.
const (
	DefaultMaxSubscriptions = 5000 // filters one client (session) holds
	DefaultMaxFilterLength  = 4096 // bytes in one topic filter
	DefaultMaxFilterLevels  = 128  // levels ('/'-separated) in one filter
)

// subscriptionLimits refuses, per filter, what a SUBSCRIBE asks beyond the
// bounds: SUBACK 0x97 (quota exceeded) past the client's subscription
// count, 0x8F (topic filter invalid) for a filter too long or too deep;
// the rest of the packet is served as usual.
//
// mochi computes SUBACK reason codes itself and knows none of these codes
// but "invalid filter", so a refused filter is handed to mochi as a filter
// it finds invalid (it subscribes nothing, stores nothing, and answers
// 0x8F), and the SUBACK is given the real code as it is written. The
// SUBACK is written on the reading goroutine before the next packet is
// read, so at most one override per client is pending.
type subscriptionLimits struct {
	max, maxLength, maxLevels int
	// allowed says whether the client may subscribe to a filter: one the
	// policy refuses (mochi answers it 0x87) takes no place in the count.
	allowed func(cl *mqtt.Client, filter string) bool

	mu      sync.Mutex
	pending map[*mqtt.Client]override
}

type override struct {
	packetID uint16
	codes    map[int]byte // filter index → reason code
	reason   string
}

// refused stands in for a filter the broker will not take: mochi finds it
// invalid ('#' not last).
const refused = "#/"

// read applies the bounds to a SUBSCRIBE from the client, in place.
func (l *subscriptionLimits) read(cl *mqtt.Client, pk *packets.Packet) {
	if pk.FixedHeader.Type != packets.Subscribe {
		return
	}
	held := cl.State.Subscriptions.Len()
	var o override
	filters := pk.Filters
	for i, f := range pk.Filters {
		code, reason := byte(0), ""
		switch {
		case len(f.Filter) > l.maxLength:
			code, reason = packets.ErrTopicFilterInvalid.Code, fmt.Sprintf("topic filter longer than %d bytes", l.maxLength)
		case strings.Count(f.Filter, "/")+1 > l.maxLevels:
			code, reason = packets.ErrTopicFilterInvalid.Code, fmt.Sprintf("topic filter deeper than %d levels", l.maxLevels)
		default:
			if _, again := cl.State.Subscriptions.Get(f.Filter); again {
				continue // replacing a subscription adds none
			}
			if l.allowed != nil && !l.allowed(cl, f.Filter) {
				continue // refused by mochi: subscribes nothing
			}
			if held >= l.max {
				code, reason = packets.ErrQuotaExceeded.Code, fmt.Sprintf("more than %d subscriptions", l.max)
			} else {
				held++
				continue
			}
		}
		if o.codes == nil {
			o = override{packetID: pk.PacketID, codes: map[int]byte{}, reason: reason}
			filters = append(packets.Subscriptions(nil), pk.Filters...) // the decoded packet is not ours to change
		}
		o.codes[i] = code
		filters[i].Filter = refused
	}
	if o.codes == nil {
		return
	}
	pk.Filters = filters
	l.mu.Lock()
	l.pending[cl] = o
	l.mu.Unlock()
}

// write gives the SUBACK of a refused filter its reason code.
func (l *subscriptionLimits) write(cl *mqtt.Client, pk packets.Packet) packets.Packet {
	if pk.FixedHeader.Type != packets.Suback {
		return pk
	}
	l.mu.Lock()
	o, ok := l.pending[cl]
	if ok && o.packetID == pk.PacketID {
		delete(l.pending, cl)
	}
	l.mu.Unlock()
	if !ok || o.packetID != pk.PacketID {
		return pk
	}
	codes := append([]byte(nil), pk.ReasonCodes...)
	for i, c := range o.codes {
		if i < len(codes) {
			codes[i] = c
			if cl.Properties.ProtocolVersion < 5 {
				codes[i] = packets.ErrUnspecifiedError.Code // MQTT 3.1.1 knows only 0x80
			}
		}
	}
	pk.ReasonCodes = codes
	if pk.Properties.ReasonString == "" && cl.Properties.ProtocolVersion == 5 {
		pk.Properties.ReasonString = o.reason
	}
	return pk
}

// forget drops what a closed connection left pending.
func (l *subscriptionLimits) forget(cl *mqtt.Client) {
	l.mu.Lock()
	delete(l.pending, cl)
	l.mu.Unlock()
}
