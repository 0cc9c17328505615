// Package route decides where an MQTT message goes: which topic filters
// match a topic name, and, in a cluster, which nodes hold subscribers for
// it.
package route

import "strings"

// Match reports whether a topic name matches a topic filter, as an MQTT
// broker routes (§4.7): '+' one level, '#' the rest, the parent level
// included ("a/#" matches "a"). Topics starting with '$' are not matched
// by a leading wildcard (MQTT-4.7.2-1).
func Match(filter, topic string) bool { return covers(filter, topic, false) }

// Covers reports whether every topic the filter requested can match is
// matched by the filter granted, so that a subscription to requested may
// be allowed by a grant for granted.
func Covers(granted, requested string) bool { return covers(granted, requested, true) }

// covers walks filter and requested level by level. requested is a topic
// name or, with isFilter, a filter, whose '#' only a '#' covers (its '+'
// is covered by '+' as by any literal comparison of equal levels).
func covers(filter, requested string, isFilter bool) bool {
	if requested != "" && requested[0] == '$' && filter != "" && (filter[0] == '+' || filter[0] == '#') {
		return false
	}
	for {
		f, fRest, fMore := strings.Cut(filter, "/")
		if f == "#" {
			return true
		}
		r, rRest, rMore := strings.Cut(requested, "/")
		if isFilter && r == "#" {
			return false // only '#' covers '#'
		}
		if f != "+" && f != r {
			return false
		}
		if !fMore || !rMore {
			return fMore == rMore || (fMore && fRest == "#")
		}
		filter, requested = fRest, rRest
	}
}
