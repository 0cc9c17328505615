package admin

import (
	"cmp"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/mqkv/mqkv/internal/broker"
)

// The MQTT side of the console: sessions, retained messages, and the
// busiest topics.

// TopicRate is one topic's message count and recent rate.
type TopicRate struct {
	Topic     string  `json:"topic"`
	Messages  int64   `json:"messages"`
	PerSecond float64 `json:"per_second"`
}

// MQTTView is what GET /v1/mqtt returns.
type MQTTView struct {
	Clients  []broker.ClientInfo   `json:"clients"`
	Retained []broker.RetainedInfo `json:"retained"`
	Topics   []TopicRate           `json:"topics"` // the busiest, at most maxTopicsShown
}

const maxTopicsShown = 50

// topicRates turns the broker's running counts into rates: the average
// since the previous look, however long ago that was (looks less than a
// second apart get the last rates again).
type topicRates struct {
	mu    sync.Mutex
	at    time.Time
	prev  map[string]int64
	rates map[string]float64
}

func (t *topicRates) update(counts map[string]int64) map[string]float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	if t.prev != nil && now.Sub(t.at) < time.Second {
		return t.rates
	}
	rates := map[string]float64{}
	if t.prev != nil {
		secs := now.Sub(t.at).Seconds()
		for topic, n := range counts {
			if d := n - t.prev[topic]; d > 0 {
				rates[topic] = float64(d) / secs
			}
		}
	}
	t.at, t.prev, t.rates = now, counts, rates
	return rates
}

func (s *Server) mqtt(w http.ResponseWriter, _ *http.Request) {
	b := s.node.Broker
	counts := b.TopicMessages()
	rates := s.rates.update(counts)
	view := MQTTView{Clients: b.Clients(), Retained: b.Retained(), Topics: []TopicRate{}}
	for topic, n := range counts {
		view.Topics = append(view.Topics, TopicRate{Topic: topic, Messages: n, PerSecond: rates[topic]})
	}
	slices.SortFunc(view.Topics, func(a, b TopicRate) int {
		if c := cmp.Compare(b.PerSecond, a.PerSecond); c != 0 {
			return c
		}
		return cmp.Compare(b.Messages, a.Messages)
	})
	view.Topics = view.Topics[:min(len(view.Topics), maxTopicsShown)]
	if view.Clients == nil {
		view.Clients = []broker.ClientInfo{}
	}
	if view.Retained == nil {
		view.Retained = []broker.RetainedInfo{}
	}
	writeJSON(w, view)
}
