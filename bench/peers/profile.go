package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/pprof/profile"
)

// startProfiles fetches a CPU profile of d from every admin endpoint at
// once (the nodes of a cluster, measured together) into dir/nodeK.pprof;
// the function returned waits for them and prints where the CPU went.
func startProfiles(admins []string, d time.Duration, dir string) func() error {
	if len(admins) == 0 {
		return func() error { return nil }
	}
	errs := make([]error, len(admins))
	paths := make([]string, len(admins))
	var wg sync.WaitGroup
	for k, a := range admins {
		paths[k] = filepath.Join(dir, fmt.Sprintf("node%d.pprof", k+1))
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[k] = fetchProfile(a, d, paths[k])
		}()
	}
	return func() error {
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				return err
			}
		}
		return printSplit(os.Stdout, paths)
	}
}

func fetchProfile(admin string, d time.Duration, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	resp, err := http.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", admin, int(d.Seconds())))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("profile from %s: %s", admin, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// A share is a part of the server's work, known by the functions on a
// sample's stack. A sample belongs to the first share in this list any
// of its frames matches, so the more particular come first: the write
// syscall of a TLS record sent for raft's replication is the node link's,
// a garbage collector's assist inside apply is the collector's.
var shares = []struct {
	name string
	re   *regexp.Regexp
}{
	{"garbage collection", regexp.MustCompile(`^runtime\.(gcBgMarkWorker|gcAssistAlloc|bgsweep|bgscavenge|gcStart|markroot)`)},
	{"goroutine hand-offs, scheduler, idle", regexp.MustCompile(`^runtime\.(mcall|park_m|schedule|findRunnable|wakep|ready|goready|notewakeup|notesleep|futexwakeup|futexsleep|stopm|startm|sysmon|netpoll|runqgrab|stealWork|goschedImpl|gopark|entersyscallblock|exitsyscall|handoffp|retake)$`)},
	{"node link: TLS, yamux, msgpack", regexp.MustCompile(`^(crypto/|github\.com/hashicorp/yamux|github\.com/hashicorp/go-msgpack|github\.com/mqkv/mqkv/internal/peer\.)`)},
	{"journal (log writes, fsync)", regexp.MustCompile(`^(github\.com/mqkv/mqkv/internal/journal\.|github\.com/hashicorp/raft-wal)`)},
	{"apply (state machine)", regexp.MustCompile(`^github\.com/mqkv/mqkv/internal/(replica\.\(\*fsm\)|store\.)`)},
	{"replication (raft AppendEntries, both ends)", regexp.MustCompile(`^github\.com/hashicorp/raft\.\(\*Raft\)\.(replicate|replicateTo|pipelineSend|pipelineDecode|heartbeat|appendEntries|processRPC|processHeartbeat|setupAppendEntries)`)},
	{"raft, other (leader loop, commit, FSM hand-off)", regexp.MustCompile(`^github\.com/hashicorp/raft\.`)},
	{"forwarding (client's node to the leader)", regexp.MustCompile(`^github\.com/mqkv/mqkv/internal/cluster\.\(\*Node\)\.(forward|submitRemote|call|serveCall|answer|relay|submitHere|onLeader|Get)`)},
	{"MQTT and the state store service", regexp.MustCompile(`^(github\.com/mochi-mqtt|github\.com/mqkv/mqkv/internal/(broker|statestore|resp|route|policy|auth)\.)`)},
	{"syscalls elsewhere", regexp.MustCompile(`^(syscall\.|internal/poll\.|runtime/internal/syscall|internal/runtime/syscall)`)},
}

// printSplit prints, for the profiles together, each share's part of the
// CPU sampled.
func printSplit(out io.Writer, paths []string) error {
	sums := map[string]int64{}
	var total int64
	for _, path := range paths {
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		p, err := profile.Parse(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %v", path, err)
		}
		vi := len(p.SampleType) - 1 // cpu nanoseconds
		for _, s := range p.Sample {
			v := s.Value[vi]
			total += v
			sums[shareOf(s)] += v
		}
	}
	type row struct {
		name string
		v    int64
	}
	var rows []row
	for n, v := range sums {
		rows = append(rows, row{n, v})
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].v > rows[j].v })
	fmt.Fprintf(out, "\nwhere the CPU went, %d profiles together (%s), %.1f s sampled:\n", len(paths), strings.Join(paths, " "), float64(total)/1e9)
	for _, r := range rows {
		fmt.Fprintf(out, "  %5.1f %%  %s\n", 100*float64(r.v)/float64(max(total, 1)), r.name)
	}
	return nil
}

func shareOf(s *profile.Sample) string {
	for _, sh := range shares {
		for _, loc := range s.Location {
			for _, l := range loc.Line {
				if l.Function != nil && sh.re.MatchString(l.Function.Name) {
					return sh.name
				}
			}
		}
	}
	return "other"
}
