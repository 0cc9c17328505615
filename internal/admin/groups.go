package admin

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// journalMetrics exports the figures of the log a cluster node's groups
// share: how big it is, how much of it is still needed, how often it syncs.
type journalMetrics struct{ data Keyspace }

var (
	journalSegments = prometheus.NewDesc("mqkv_journal_segments", "Segment files of the node's journal (a cluster node).", nil, nil)
	journalBytes    = prometheus.NewDesc("mqkv_journal_bytes", "Bytes of records in the node's journal.", nil, nil)
	journalLive     = prometheus.NewDesc("mqkv_journal_live_bytes", "Bytes of the journal's entries some group still needs (the rest goes as segments are collected).", nil, nil)
	journalSyncs    = prometheus.NewDesc("mqkv_journal_syncs_total", "fdatasyncs of the node's journal since start: each makes one batch of appends, from any groups, durable.", nil, nil)
	journalRefused  = prometheus.NewDesc("mqkv_journal_refused_appends_total", "Appends of log entries the node's journal refused since start for want of room on the data volume (the groups went on with their other replicas).", nil, nil)
	journalFull     = prometheus.NewDesc("mqkv_journal_volume_full", "1 while the node's journal refuses log entries for want of room on the data volume.", nil, nil)
)

func (m journalMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{journalSegments, journalBytes, journalLive, journalSyncs, journalRefused, journalFull} {
		ch <- d
	}
}

func (m journalMetrics) Collect(ch chan<- prometheus.Metric) {
	st, ok := m.data.JournalStats()
	if !ok {
		return
	}
	ch <- prometheus.MustNewConstMetric(journalSegments, prometheus.GaugeValue, float64(st.Segments))
	ch <- prometheus.MustNewConstMetric(journalBytes, prometheus.GaugeValue, float64(st.Bytes))
	ch <- prometheus.MustNewConstMetric(journalLive, prometheus.GaugeValue, float64(st.LiveBytes))
	ch <- prometheus.MustNewConstMetric(journalSyncs, prometheus.CounterValue, float64(st.Syncs))
	ch <- prometheus.MustNewConstMetric(journalRefused, prometheus.CounterValue, float64(st.Refused))
	full := 0.0
	if st.Full {
		full = 1
	}
	ch <- prometheus.MustNewConstMetric(journalFull, prometheus.GaugeValue, full)
}

// groupMetrics exports the figures of each replica the node holds, labelled
// by group: in a cluster, where leaders change and replicas move.
type groupMetrics struct{ data Keyspace }

var (
	groupLeader = prometheus.NewDesc("mqkv_group_leader", "1 if this node leads the replica group.", []string{"group"}, nil)
	groupLag    = prometheus.NewDesc("mqkv_group_apply_lag", "Log entries committed but not yet applied by this replica.", []string{"group"}, nil)
	groupIndex  = prometheus.NewDesc("mqkv_group_applied_index", "Last log index this replica applied.", []string{"group"}, nil)
	groupElect  = prometheus.NewDesc("mqkv_group_leader_changes_total", "Leaders this replica has seen since start.", []string{"group"}, nil)
	groupInst   = prometheus.NewDesc("mqkv_group_snapshot_installs_total", "Snapshots this replica installed since start (catching up, or moving here).", []string{"group"}, nil)
	groupMoves  = prometheus.NewDesc("mqkv_group_migrations", "Replicas of the group being caught up as non-voters (on its leader: moves in progress).", []string{"group"}, nil)
	groupVoters = prometheus.NewDesc("mqkv_group_voters", "Voters of the group, as this replica knows.", []string{"group"}, nil)
)

func (g groupMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{groupLeader, groupLag, groupIndex, groupElect, groupInst, groupMoves, groupVoters} {
		ch <- d
	}
}

func (g groupMetrics) Collect(ch chan<- prometheus.Metric) {
	for id, s := range g.data.GroupStats() {
		l := strconv.Itoa(id)
		leader := 0.0
		if s.Leader {
			leader = 1
		}
		lag := 0.0
		if s.CommitIndex > s.AppliedIndex {
			lag = float64(s.CommitIndex - s.AppliedIndex)
		}
		ch <- prometheus.MustNewConstMetric(groupLeader, prometheus.GaugeValue, leader, l)
		ch <- prometheus.MustNewConstMetric(groupLag, prometheus.GaugeValue, lag, l)
		ch <- prometheus.MustNewConstMetric(groupIndex, prometheus.GaugeValue, float64(s.AppliedIndex), l)
		ch <- prometheus.MustNewConstMetric(groupElect, prometheus.CounterValue, float64(s.LeaderChanges), l)
		ch <- prometheus.MustNewConstMetric(groupInst, prometheus.CounterValue, float64(s.Restores), l)
		ch <- prometheus.MustNewConstMetric(groupMoves, prometheus.GaugeValue, float64(s.Nonvoters), l)
		ch <- prometheus.MustNewConstMetric(groupVoters, prometheus.GaugeValue, float64(s.Voters), l)
	}
}
