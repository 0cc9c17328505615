package cluster

import (
	"bytes"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/peer"
)

// logBuffer collects a node's log lines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Contains(l.b.String(), s)
}

func (l *logBuffer) logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }

// A join that cannot succeed says why within seconds, on both sides:
// through an address where nothing listens (each retry logged), with a
// wrong secret, and without a secret against a cluster that has one.
// Before, the joiner said nothing for 60 s and then, in all three cases,
// "no metadata leader answered", and the member logged "connection
// refused ... error=EOF".
func TestFailedJoinSaysWhy(t *testing.T) {
	t.Parallel()
	memberLog := &logBuffer{}
	link, err := peer.Listen(peer.Config{NodeID: "m1", Listen: "127.0.0.1:0", Secret: []byte("the-cluster-secret-0123"), Logger: memberLog.logger()})
	if err != nil {
		t.Fatal(err)
	}
	defer link.Close()
	m, err := Start(Config{NodeID: "m1", Dir: t.TempDir(), Link: link, Groups: 1, RF: 1, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()

	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	nobody := ln.Addr().String()
	ln.Close()

	for _, tc := range []struct {
		name     string
		cfg      peer.Config
		join     string
		joiner   string // in the joiner's error or log
		member   string // in the member's log
		stopWith bool   // the joiner retries: stopped by closing its link
	}{
		{"nothing listens", peer.Config{Secret: []byte("the-cluster-secret-0123")}, nobody, "nothing listens at " + nobody, "", true},
		{"wrong secret", peer.Config{Secret: []byte("another-secret-456789")}, link.Addr(), "wrong cluster secret", "has a wrong cluster secret", false},
		{"no secret", peer.Config{Insecure: true}, link.Addr(), "the cluster requires a secret", "has no cluster secret, and this cluster requires one", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			joinerLog := &logBuffer{}
			tc.cfg.NodeID, tc.cfg.Listen, tc.cfg.Logger = "j-"+strings.ReplaceAll(tc.name, " ", "-"), "127.0.0.1:0", joinerLog.logger()
			jl, err := peer.Listen(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer jl.Close()
			started := time.Now()
			done := make(chan error, 1)
			go func() {
				n, err := Start(Config{NodeID: tc.cfg.NodeID, Dir: t.TempDir(), Link: jl, Join: []string{tc.join}, Logger: joinerLog.logger()})
				if n != nil {
					n.Close()
				}
				done <- err
			}()
			if tc.stopWith {
				eventuallyT(t, 5*time.Second, "the joiner to log why it retries", func() bool { return joinerLog.has(tc.joiner) })
				if !joinerLog.has("level=INFO") {
					t.Fatal("the retries are not logged at info")
				}
				jl.Close()
			}
			select {
			case err := <-done:
				if err == nil || !tc.stopWith && !strings.Contains(err.Error(), tc.joiner) {
					t.Fatalf("join: %v, want an error saying %q", err, tc.joiner)
				}
				if !tc.stopWith && time.Since(started) > 5*time.Second {
					t.Fatalf("the refusal took %s", time.Since(started))
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the join still runs")
			}
			if tc.member != "" {
				eventuallyT(t, 5*time.Second, "the member to log why", func() bool { return memberLog.has(tc.member) })
			}
		})
	}
}
