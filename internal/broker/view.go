package broker

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ClientInfo is one session as the console shows it.
type ClientInfo struct {
	ID            string    `json:"id"`
	Username      string    `json:"username,omitempty"`
	Remote        string    `json:"remote,omitempty"`
	Listener      string    `json:"listener,omitempty"`
	Connected     bool      `json:"connected"`
	Subscriptions int       `json:"subscriptions"`
	Queued        int       `json:"queued"` // QoS 1/2 messages not yet acknowledged
	Since         time.Time `json:"since,omitzero"`
}

// Clients lists the sessions the broker holds: connected clients and
// persistent sessions waiting for theirs, by id.
func (b *Broker) Clients() []ClientInfo {
	var out []ClientInfo
	for id, cl := range b.srv.Clients.GetAll() {
		if cl.Net.Inline {
			continue
		}
		info := ClientInfo{
			ID:            id,
			Username:      string(cl.Properties.Username),
			Remote:        cl.Net.Remote,
			Listener:      cl.Net.Listener,
			Connected:     !cl.Closed(),
			Subscriptions: cl.State.Subscriptions.Len(),
			Queued:        cl.State.Inflight.Len(),
		}
		if c := b.connOf(cl); c != nil {
			info.Since = c.since
		}
		out = append(out, info)
	}
	slices.SortFunc(out, func(a, b ClientInfo) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// RetainedInfo is one retained message.
type RetainedInfo struct {
	Topic string `json:"topic"`
	Bytes int    `json:"bytes"`
}

// Retained lists the retained messages by topic.
func (b *Broker) Retained() []RetainedInfo {
	var out []RetainedInfo
	for _, pk := range b.srv.Topics.Retained.GetAll() {
		out = append(out, RetainedInfo{Topic: pk.TopicName, Bytes: len(pk.Payload)})
	}
	slices.SortFunc(out, func(a, b RetainedInfo) int { return strings.Compare(a.Topic, b.Topic) })
	return out
}

// topicCounts counts the messages published per topic, for the console's
// rates. Counting costs a map read and an atomic add per message; past
// maxTopicsCounted distinct topics, and for topics longer than
// maxTopicCounted bytes, messages count under "(other topics)", so a
// client publishing to endless (long) topics cannot grow it.
type topicCounts struct {
	m     sync.Map // topic → *atomic.Int64
	n     atomic.Int64
	other atomic.Int64
}

const (
	maxTopicsCounted = 10_000
	maxTopicCounted  = 256
)

// OtherTopics names the count of messages to topics beyond the bound.
const OtherTopics = "(other topics)"

// topicCount is a publisher's last topic and its count: most publish to
// the same topic again, whose count is then found without hashing it.
// Only the publisher's reader uses it.
type topicCount struct {
	topic string
	n     *atomic.Int64
}

// addFrom counts a message to topic; last, if not nil, is its
// publisher's last topic, and becomes this one.
func (t *topicCounts) addFrom(topic string, last *topicCount) {
	if last != nil && last.n != nil && last.topic == topic {
		last.n.Add(1)
		return
	}
	c := t.counter(topic)
	if c == nil {
		t.other.Add(1)
		return
	}
	c.Add(1)
	if last != nil {
		*last = topicCount{topic: topic, n: c}
	}
}

// counter returns topic's count, nil past the bound.
func (t *topicCounts) counter(topic string) *atomic.Int64 {
	if c, ok := t.m.Load(topic); ok {
		return c.(*atomic.Int64)
	}
	if t.n.Load() >= maxTopicsCounted || len(topic) > maxTopicCounted {
		return nil
	}
	c, loaded := t.m.LoadOrStore(topic, new(atomic.Int64))
	if !loaded {
		t.n.Add(1)
	}
	return c.(*atomic.Int64)
}

// TopicMessages returns the messages published to each topic since start.
func (b *Broker) TopicMessages() map[string]int64 {
	out := map[string]int64{}
	b.topics.m.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Int64).Load()
		return true
	})
	if n := b.topics.other.Load(); n > 0 {
		out[OtherTopics] = n
	}
	return out
}
