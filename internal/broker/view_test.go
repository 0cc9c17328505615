package broker

import (
	"maps"
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
