package admin

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

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
