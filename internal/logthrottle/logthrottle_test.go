package logthrottle

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestRepeatedLinesAreCounted(t *testing.T) {
	var buf bytes.Buffer
	h := New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}), time.Second).(*handler)
	clock := time.Unix(1000, 0)
	h.s.now = func() time.Time { return clock }
	log := slog.New(h)

	for range 5000 {
		log.Warn("client store quota reached", "client", "flooder")
	}
	log.Warn("client store quota reached", "client", "other")   // another client: its own line
	log.Info("client store quota reached", "client", "flooder") // another level: its own line
	for range 3 {
		log.Debug("debug lines all pass", "client", "flooder")
	}
	clock = clock.Add(time.Second)
	log.Warn("client store quota reached", "client", "flooder")

	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 7 {
		t.Fatalf("%d lines, want 7:\n%s", len(lines), buf.String())
	}
	if !strings.Contains(lines[6], "client=flooder repeated=4999") {
		t.Fatalf("last line %q does not count the 4,999 held back", lines[6])
	}
	if strings.Contains(lines[0], "repeated") {
		t.Fatalf("first line %q", lines[0])
	}
}

func TestClientGivenWith(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(New(slog.NewTextHandler(&buf, nil), time.Hour))
	a, b := log.With("client", "a"), log.With("client", "b")
	for range 10 {
		a.Warn("x")
		b.Warn("x")
	}
	if n := strings.Count(buf.String(), "\n"); n != 2 {
		t.Fatalf("%d lines, want one per client:\n%s", n, buf.String())
	}
}

func TestMemoryIsBounded(t *testing.T) {
	h := New(slog.NewTextHandler(&bytes.Buffer{}, nil), time.Hour).(*handler)
	log := slog.New(h)
	for i := range 3 * maxKeys {
		log.Warn("x", "client", i)
	}
	if n := len(h.s.seen); n > maxKeys {
		t.Fatalf("%d lines remembered, bound %d", n, maxKeys)
	}
}
