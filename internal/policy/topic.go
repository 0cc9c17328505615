package policy

import "strings"

// MQTT topic matching for broker resources.

// topicMatches reports whether a topic name matches a topic filter, as an
// MQTT broker routes: '+' one level, '#' the rest (including the parent).
// Topics starting with '$' are not matched by a leading wildcard.
func topicMatches(filter, topic string) bool {
	if topic != "" && topic[0] == '$' && filter != "" && (filter[0] == '+' || filter[0] == '#') {
		return false
	}
	for {
		f, fRest, fMore := strings.Cut(filter, "/")
		if f == "#" {
			return true
		}
		t, tRest, tMore := strings.Cut(topic, "/")
		if f != "+" && f != t {
			return false
		}
		if !fMore || !tMore {
			// "a/#" also matches "a".
			return fMore == tMore || (fMore && fRest == "#")
		}
		filter, topic = fRest, tRest
	}
}

// filterCovers reports whether every topic the requested filter can match
// is matched by the granted filter, so a subscription to requested may be
// allowed by a grant for granted.
func filterCovers(granted, requested string) bool {
	if requested != "" && requested[0] == '$' && granted != "" && (granted[0] == '+' || granted[0] == '#') {
		return false
	}
	for {
		g, gRest, gMore := strings.Cut(granted, "/")
		if g == "#" {
			return true
		}
		r, rRest, rMore := strings.Cut(requested, "/")
		switch {
		case r == "#":
			return false // only '#' covers '#'
		case g == "+":
		case g != r:
			return false
		}
		if !gMore || !rMore {
			return gMore == rMore || (gMore && gRest == "#")
		}
		granted, requested = gRest, rRest
	}
}
