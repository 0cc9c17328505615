package admin

import (
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/mqkv/mqkv/internal/replica"
	"github.com/mqkv/mqkv/internal/statestore"
)

// Metrics are the node's Prometheus metrics. Create them before the replica
// group (they receive its timings), then Bind them to the node.
type Metrics struct {
	reg       *prometheus.Registry
	requests  *prometheus.CounterVec
	latency   *prometheus.HistogramVec
	commit    prometheus.Histogram
	sync      prometheus.Histogram
	entry     prometheus.Histogram
	snapBytes prometheus.Gauge
	snapTime  prometheus.Histogram

	activity *activity

	// children caches the label children ObserveReply counts into
	// (replyLabels to replyChildren): the vectors' own lookup hashes the
	// label values at every request, and a read-locked map wrote the
	// lock's count, a cache line every core shares, at every request.
	children sync.Map
}

type replyLabels struct{ command, result string }

type replyChildren struct {
	requests prometheus.Counter
	latency  prometheus.Observer
}

var latencyBuckets = prometheus.ExponentialBuckets(50e-6, 2, 16) // 50 µs … 1.6 s

// NewMetrics creates the registry and the metrics fed by callbacks.
func NewMetrics() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mqkv_requests_total", Help: "State store requests by command and result (ok, miss, not_applied, error).",
		}, []string{"command", "result"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "mqkv_request_duration_seconds", Help: "Time from receiving a state store request to publishing its reply.", Buckets: latencyBuckets,
		}, []string{"command"}),
		commit: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mqkv_raft_commit_seconds", Help: "Time from proposing a log entry to having it applied.", Buckets: latencyBuckets,
		}),
		sync: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mqkv_log_append_seconds", Help: "Time to append entries to the log, fsync included.", Buckets: latencyBuckets,
		}),
		entry: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mqkv_log_entry_commands", Help: "State store commands per log entry: writes that arrive while an entry is synced share the next one, and its fsync.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 11), // 1 … 1024, the most an entry holds
		}),
		snapBytes: prometheus.NewGauge(prometheus.GaugeOpts{Name: "mqkv_snapshot_bytes", Help: "Size of the last snapshot."}),
		snapTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "mqkv_snapshot_duration_seconds", Help: "Time to write a snapshot.", Buckets: prometheus.ExponentialBuckets(1e-3, 4, 10),
		}),
		activity: newActivity(),
	}
	m.reg.MustRegister(m.requests, m.latency, m.commit, m.sync, m.entry, m.snapBytes, m.snapTime,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Timings returns the callbacks the replica group reports to.
func (m *Metrics) Timings() replica.Timings {
	return replica.Timings{
		Commit: func(d time.Duration) { m.commit.Observe(d.Seconds()) },
		Sync:   func(d time.Duration) { m.sync.Observe(d.Seconds()) },
		Entry:  func(n int) { m.entry.Observe(float64(n)) },
		Snapshot: func(n int64, d time.Duration) {
			m.snapBytes.Set(float64(n))
			m.snapTime.Observe(d.Seconds())
		},
	}
}

// ObserveReply is the state store service's OnReply.
func (m *Metrics) ObserveReply(r statestore.Reply) {
	c := m.childrenOf(replyLabels{r.Command, r.Result})
	c.requests.Inc()
	c.latency.Observe(r.Duration.Seconds())
	m.activity.observe(r)
}

// childrenOf returns the metrics of one command and result. The labels
// come from fixed sets (statestore's command names and results), so the
// cache stays small.
func (m *Metrics) childrenOf(l replyLabels) replyChildren {
	if c, ok := m.children.Load(l); ok {
		return c.(replyChildren)
	}
	c := replyChildren{m.requests.WithLabelValues(l.command, l.result), m.latency.WithLabelValues(l.command)}
	m.children.Store(l, c)
	return c
}

// p99 returns the 99th percentile of the recent request latencies (of
// those activity counted: all, or a sample of thousands a second) and
// forgets them, so each call covers what happened since the last one.
func (m *Metrics) p99() time.Duration {
	lat := m.activity.latencies()
	if len(lat) == 0 {
		return 0
	}
	slices.Sort(lat)
	return lat[(len(lat)*99)/100]
}

// bind registers the metrics read from the node's parts.
func (m *Metrics) bind(n *Node) {
	gauge := func(name, help string, f func() float64) {
		m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f))
	}
	counter := func(name, help string, f func() float64) {
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, f))
	}
	m.reg.MustRegister(groupMetrics{n.Data}, journalMetrics{n.Data})
	if f, ok := n.Data.(interface{ Forwarded() (int64, int64) }); ok {
		counter("mqkv_forwarded_writes_total", "State store writes this node sent on to the leader of their key's group on another node.", func() float64 { w, _ := f.Forwarded(); return float64(w) })
		counter("mqkv_forwarded_reads_total", "State store key reads this node sent on to the leader of their key's group on another node.", func() float64 { _, r := f.Forwarded(); return float64(r) })
	}
	counter("mqkv_mqtt_forwarded_total", "Messages sent to other nodes of the cluster, one per node that wants each.", func() float64 {
		return float64(n.Broker.Counters.Forwarded.Load())
	})
	counter("mqkv_mqtt_from_peers_total", "Messages other nodes of the cluster sent here.", func() float64 {
		return float64(n.Broker.Counters.FromPeers.Load())
	})
	counter("mqkv_mqtt_sessions_taken_up_total", "Persistent sessions of a node that died, taken up here.", func() float64 {
		return float64(n.Broker.Counters.SessionsTakenUp.Load())
	})
	counter("mqkv_mqtt_wills_taken_up_total", "Wills of clients whose node died, published here.", func() float64 {
		return float64(n.Broker.Counters.WillsTakenUp.Load())
	})
	if r := n.Broker.Roaming(); r != nil {
		counter("mqkv_mqtt_session_writes_total", "Records of persistent sessions (subscriptions, wills, queued messages) written to the replicated store.", func() float64 { return float64(r.Writes.Load()) })
		counter("mqkv_mqtt_session_write_rounds_total", "Rounds those records were written in (each proposes every record changed since the last).", func() float64 { return float64(r.Rounds.Load()) })
		counter("mqkv_mqtt_session_write_failures_total", "Records of persistent sessions the store did not take.", func() float64 { return float64(r.Failed.Load()) })
	}
	if n.Mesh != nil {
		mc := &n.Mesh.Counters
		counter("mqkv_mesh_resent_total", "Messages sent again to another node on a new stream (the last broke before they were acknowledged).", func() float64 { return float64(mc.Resent.Load()) })
		counter("mqkv_mesh_dropped_total", "Messages to other nodes given up: the node was gone, or too much waited for it.", func() float64 { return float64(mc.Dropped.Load()) })
		counter("mqkv_mesh_resyncs_total", "Streams from other nodes opened with their whole interest (a new or restored link).", func() float64 { return float64(mc.Resyncs.Load()) })
		counter("mqkv_mesh_hops_total", "QoS 1 and 2 messages acknowledged by the nodes they went to.", func() float64 { return float64(mc.Hops.Load()) })
		counter("mqkv_mesh_hop_seconds_total", "Time from sending to the other node's acknowledgement (delivery into its subscribers' sessions included), summed over mqkv_mesh_hops_total.", func() float64 {
			return float64(mc.HopMicros.Load()) / 1e6
		})
		gauge("mqkv_mesh_route_table_filters", "Topic filters the other nodes said they have subscribers for (node and filter pairs).", func() float64 { return float64(n.Mesh.TableSize()) })
	}
	gauge("mqkv_keys", "Keys in the groups this node leads (a node on its own: the store); summed over a cluster's members, the cluster's.", func() float64 { return float64(n.Data.Stats().Keys) })
	gauge("mqkv_bytes", "Key and value bytes in the groups this node leads (a node on its own: the store); summed over a cluster's members, the cluster's.", func() float64 { return float64(n.Data.Stats().Bytes) })
	gauge("mqkv_store_keys", "Keys in the whole store, a cluster's as this node sees it (its members' figures a second or two old): the same on every node.", func() float64 { return float64(n.Data.Totals().Keys) })
	gauge("mqkv_store_bytes", "Key and value bytes in the whole store, as mqkv_store_keys.", func() float64 { return float64(n.Data.Totals().Bytes) })
	counter("mqkv_expired_total", "Keys removed because their TTL ran out.", func() float64 { return float64(n.Data.Stats().Expired) })
	gauge("mqkv_raft_applied_index", "Last log index applied to the store.", func() float64 { return float64(n.Data.Stats().AppliedIndex) })
	counter("mqkv_notifications_sent_total", "KEYNOTIFY notifications published.", func() float64 {
		return float64(n.Service.Counters.NotificationsSent.Load())
	})
	counter("mqkv_mqtt_messages_direct_total", "Messages written to a subscriber by the publishing connection itself, not through the broker's per-client queue.", func() float64 {
		return float64(n.Broker.Counters.DeliveredDirect.Load())
	})
	counter("mqkv_notifications_dropped_total", "Notifications not sent: refused by a full client queue, or about a key too long for an MQTT topic.", func() float64 {
		return float64(n.Broker.Counters.NotificationsDropped.Load())
	})
	counter("mqkv_change_losses_total", "Times this cluster node fell so far behind a group that changes were lost to it: KEYNOTIFY registrations here missed notifications (HTTP watches are ended with \"truncated\"; see the log).", func() float64 {
		return float64(n.Service.Counters.EventsLost.Load())
	})
	gauge("mqkv_keynotify_registrations", "Active KEYNOTIFY registrations.", func() float64 {
		return float64(n.Service.Counters.RegistrationsActive.Load())
	})
	counter("mqkv_requests_without_response_topic_total", "Requests dropped for want of a response topic.", func() float64 {
		return float64(n.Service.Counters.NoResponseTopic.Load())
	})
	counter("mqkv_requests_repeated_total", "Writes delivered again (attach mode) and answered with their first execution's result, not executed twice.", func() float64 {
		return float64(n.Service.Counters.Repeats.Load())
	})
	counter("mqkv_requests_denied_total", "Requests refused by the authorization policy.", func() float64 {
		return float64(n.Service.Counters.Denied.Load())
	})
	gauge("mqkv_mqtt_clients_connected", "Connected MQTT clients.", func() float64 { return float64(n.Broker.Traffic().Clients) })
	counter("mqkv_mqtt_messages_received_total", "PUBLISH packets received.", func() float64 { return float64(n.Broker.Traffic().MessagesIn) })
	counter("mqkv_mqtt_messages_sent_total", "PUBLISH packets sent.", func() float64 { return float64(n.Broker.Traffic().MessagesOut) })
	counter("mqkv_mqtt_messages_dropped_total", "Messages dropped because a client's queue was full.", func() float64 {
		return float64(n.Broker.Traffic().Dropped)
	})
	counter("mqkv_mqtt_queue_full_total", "QoS 1/2 messages dropped because the session already held --max-queued.", func() float64 {
		return float64(n.Broker.Traffic().QueueFull)
	})
	counter("mqkv_mqtt_bytes_received_total", "Bytes received from MQTT clients.", func() float64 { return float64(n.Broker.Traffic().BytesIn) })
	counter("mqkv_mqtt_bytes_sent_total", "Bytes sent to MQTT clients.", func() float64 { return float64(n.Broker.Traffic().BytesOut) })
	counter("mqkv_mqtt_auth_failures_total", "CONNECTs refused by authentication or policy.", func() float64 {
		return float64(n.Broker.Counters.AuthFailures.Load())
	})
	counter("mqkv_mqtt_slow_consumers_total", "Clients disconnected for not reading their messages.", func() float64 {
		return float64(n.Broker.Counters.SlowConsumers.Load())
	})
}
