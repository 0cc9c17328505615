package policy

import "strings"

// MQTT topic matching for broker resources.

// topicMatches reports whether a topic name matches a topic filter, as an
// MQTT broker routes: '+' one level, '#' the rest (including the parent).
// Topics starting with '$' are not matched by a leading wildcard.
func topicMatches(filter, topic string) bool { return covers(filter, topic, false) }

// filterCovers reports whether every topic the requested filter can match
// is matched by the granted filter, so a subscription to requested may be
// allowed by a grant for granted.
func filterCovers(granted, requested string) bool { return covers(granted, requested, true) }

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
			// "a/#" also matches "a".
			return fMore == rMore || (fMore && fRest == "#")
		}
		filter, requested = fRest, rRest
	}
}
