package broker

import (
	"maps"
	"strconv"
	"strings"
	"testing"
)

// TestTopicCountsFollowThePublisher: the console's per-topic counts are
// exact whether a publisher keeps to one topic (counted through its last
// topic) or changes topic, and past the bound new topics count together.
func TestTopicCountsFollowThePublisher(t *testing.T) {
	b := &Broker{}
	var p1, p2 topicCount
	for range 3 {
		b.topics.addFrom("a", &p1)
	}
	b.topics.addFrom("b", &p1)
	b.topics.addFrom("a", &p1)
	b.topics.addFrom("a", &p2)
	b.topics.addFrom("b", nil)
	want := map[string]int64{"a": 5, "b": 2}
	if got := b.TopicMessages(); !maps.Equal(got, want) {
		t.Fatalf("counts %v, want %v", got, want)
	}

	b.topics.n.Store(maxTopicsCounted) // the bound reached
	b.topics.addFrom("c", &p1)
	b.topics.addFrom("c", &p1)
	b.topics.addFrom("a", &p2) // known topics still count as themselves
	want = map[string]int64{"a": 6, "b": 2, OtherTopics: 2}
	if got := b.TopicMessages(); !maps.Equal(got, want) {
		t.Fatalf("counts past the bound %v, want %v", got, want)
	}
}

// TestLongTopicsAreNotKept: a client publishing to endless long topics
// cannot make the console's counts or the route cache hold them: a topic
// past maxTopicCounted bytes counts under OtherTopics, and the route cache
// starts over past maxRouteBytes of topics.
func TestLongTopicsAreNotKept(t *testing.T) {
	var counts topicCounts
	long := strings.Repeat("t", maxTopicCounted+1)
	counts.addFrom(long, nil)
	if _, kept := counts.m.Load(long); kept || counts.other.Load() != 1 {
		t.Fatalf("a %d-byte topic kept in the counts", len(long))
	}
	var rr routes
	topic := strings.Repeat("r", 64<<10)
	for i := 0; i < 2*maxRouteBytes/len(topic); i++ {
		rr.lookup(topic+strconv.Itoa(i), func() fanout { return fanout{} })
	}
	if rr.bytes > maxRouteBytes+len(topic)+8 {
		t.Fatalf("the route cache holds %d bytes of topics", rr.bytes)
	}
}
