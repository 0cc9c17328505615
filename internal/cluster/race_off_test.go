//go:build !race

package cluster

// raceDetector says the tests run with -race.
const raceDetector = false
