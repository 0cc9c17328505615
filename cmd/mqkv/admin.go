package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/term"

	"github.com/mqkv/mqkv/internal/admin"
	"github.com/mqkv/mqkv/internal/cluster"
	"github.com/mqkv/mqkv/internal/server"
	"github.com/mqkv/mqkv/internal/store"
)

// adminURL is the --admin flag of the commands that use a server's admin
// endpoint.
func adminURL(fs *pflag.FlagSet) *string {
	return fs.String("admin", env("MQKV_ADMIN", "http://127.0.0.1:8080"), "`URL` of the server's admin endpoint (mqkv serve --admin-listen; env MQKV_ADMIN)")
}

func baseURL(u string) string {
	if !strings.Contains(u, "://") {
		u = "http://" + u
	}
	return strings.TrimRight(u, "/")
}

// adminHTTP bounds connecting and waiting for the answer to start; a
// backup's body may then take as long as the store is large.
var adminHTTP = &http.Client{Transport: &http.Transport{
	Proxy:                 http.ProxyFromEnvironment,
	DialContext:           (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
	TLSHandshakeTimeout:   10 * time.Second,
	ResponseHeaderTimeout: 30 * time.Second,
}}

// adminGet fetches path from the admin endpoint at base; any answer but
// 200 is an error. The caller closes the body.
func adminGet(ctx context.Context, base, path string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", baseURL(base)+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set(admin.RequestHeader, "1") // a backup needs it (see admin's guard)
	resp, err := adminHTTP.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		return nil, fmt.Errorf("no admin endpoint answers at %s (%v): start the server with --admin-listen ADDRESS and point --admin (or MQKV_ADMIN) at that address", baseURL(base), innermost(err))
	}
	if resp.StatusCode != http.StatusOK {
		defer resp.Body.Close()
		var body struct{ Error string }
		if json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&body) == nil && body.Error != "" {
			return nil, fmt.Errorf("%s: %s", path, body.Error)
		}
		return nil, fmt.Errorf("%s: %s (is %s an mqkv admin endpoint?)", path, resp.Status, baseURL(base))
	}
	return resp, nil
}

// innermost is the error at the end of err's chain: "connection refused"
// says more than the URL and the dial that wrap it.
func innermost(err error) error {
	for {
		next := errors.Unwrap(err)
		if next == nil {
			return err
		}
		err = next
	}
}

// adminJSON GETs path from the admin endpoint and decodes its JSON.
func adminJSON[T any](ctx context.Context, base, path string) (T, error) {
	var v T
	resp, err := adminGet(ctx, base, path)
	if err != nil {
		return v, err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		return v, fmt.Errorf("%s: %w", path, err)
	}
	return v, nil
}

func fetchStatus(ctx context.Context, base string) (admin.Status, error) {
	return adminJSON[admin.Status](ctx, base, "/v1/status")
}

func printStatus(w io.Writer, st admin.Status) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	snap := "none since start"
	if st.LastSnapshot != nil {
		snap = fmt.Sprintf("%s ago, %s", time.Since(*st.LastSnapshot).Round(time.Second), size(st.SnapshotBytes))
	}
	role := "leader"
	if !st.Leader {
		role = "not leader"
	}
	keys := fmt.Sprintf("%d (%s)", st.Keys, size(st.Bytes))
	if st.Role != "single node" && st.Role != "" {
		keys += fmt.Sprintf(" in the cluster; %d (%s) in the groups this node leads", st.NodeKeys, size(st.NodeBytes))
		if st.KeysPartial {
			keys += "; some groups have no leader this node hears"
		}
		role = st.Role
	}
	rows := [][2]string{
		{"version", st.Version},
		{"node", st.NodeID + " (" + st.Role + ")"},
		{"uptime", (time.Duration(st.UptimeSeconds) * time.Second).String()},
		{"keys", keys},
		{"clients", fmt.Sprint(st.Clients)},
		{"requests/s", fmt.Sprintf("%.0f (p99 %.2f ms)", st.RPS, st.P99Ms)},
		{"requests", fmt.Sprint(st.Requests)},
		{"keynotify", fmt.Sprint(st.Registrations)},
		{"raft", fmt.Sprintf("index %d applied %d, %s", st.LastIndex, st.AppliedIndex, role)},
		{"snapshot", snap},
		{"expired", fmt.Sprint(st.Expired)},
		{"mqtt in/out", fmt.Sprintf("%d / %d messages", st.MessagesIn, st.MessagesOut)},
	}
	if a := st.Attached; a != nil {
		state := "serving"
		switch {
		case !a.Connected:
			state = "disconnected, reconnecting"
		case !a.Serving:
			state = "connected, not subscribed to the request topic"
		}
		rows = append(rows, [2]string{"attached to", fmt.Sprintf("%s as %s: %s, %d requests in flight, %d reconnects, %d duplicates answered once, %d rescued from dead members, %d notifications dropped",
			a.Broker, a.ClientID, state, a.InFlight, a.Reconnects, a.Duplicates, a.Rescued, a.NotificationsDropped)})
	}
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\n", r[0], r[1])
	}
	tw.Flush()
}

func size(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func statusCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "status",
		Short:   "Show a one-screen summary of a running server",
		Long:    "Shows version, uptime, node id, keys, bytes, clients, requests/s, p99 latency, Raft index and the last snapshot, from the server's admin endpoint.",
		Example: "  mqkv status\n  mqkv status --admin http://10.0.0.5:8080\n  mqkv status --json",
		Args:    cobra.NoArgs,
	}
	url := adminURL(cmd.Flags())
	asJSON := cmd.Flags().Bool("json", false, "print the status as JSON")
	cmd.RunE = func(*cobra.Command, []string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		st, err := fetchStatus(ctx, *url)
		if err != nil {
			return err
		}
		if *asJSON {
			printJSON(st)
			return nil
		}
		printStatus(os.Stdout, st)
		return nil
	}
	return cmd
}

func topCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "top",
		Short:   "Show the status of a running server, refreshed every second",
		Example: "  mqkv top --admin http://127.0.0.1:8080",
		Args:    cobra.NoArgs,
	}
	url := adminURL(cmd.Flags())
	cmd.RunE = func(*cobra.Command, []string) error {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			st, err := fetchStatus(rctx, *url)
			var cl *cluster.Status
			var act *admin.Activity
			if err == nil {
				cl = fetchCluster(rctx, *url)
				act = fetchActivity(rctx, *url)
			}
			cancel()
			if terminal(os.Stdout) {
				fmt.Print("\x1b[H\x1b[2J") // home, clear screen
			} else {
				fmt.Println()
			}
			fmt.Printf("mqkv top — %s — %s\n\n", baseURL(*url), time.Now().Format(time.TimeOnly))
			if err != nil {
				fmt.Println("error:", err)
			} else {
				printStatus(os.Stdout, st)
				if act != nil {
					fmt.Println()
					printActivity(os.Stdout, *act)
				}
				if cl != nil {
					fmt.Println()
					printCluster(os.Stdout, *cl)
				}
			}
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
			}
		}
	}
	return cmd
}

func backupCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "backup --out FILE",
		Short: "Save a consistent snapshot of a running server",
		Long: `Saves a consistent snapshot of a running server's store to FILE, without
stopping writes: every write acknowledged before the snapshot point is in it,
none after. The file is versioned and checksummed; it is verified before it
is kept. Restore it with mqkv restore.`,
		Example: "  mqkv backup --out mqkv-$(date +%F).snap\n  mqkv backup --admin http://10.0.0.5:8080 --out site.snap",
		Args:    cobra.NoArgs,
	}
	url := adminURL(cmd.Flags())
	out := cmd.Flags().String("out", "", "`file` to write (required; - for standard output)")
	cmd.RunE = func(*cobra.Command, []string) error {
		if *out == "" {
			return errors.New("backup: --out is required")
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		resp, err := adminGet(ctx, *url, "/v1/backup")
		if err != nil {
			return fmt.Errorf("backup: %w", err)
		}
		defer resp.Body.Close()
		// The snapshot lands in a temporary file next to its destination
		// (or in the temporary directory for standard output), is verified,
		// and only then renamed into place (or copied out).
		dir := filepath.Dir(*out)
		if *out == "-" {
			dir = os.TempDir()
		}
		tmp, err := os.CreateTemp(dir, ".mqkv-backup-*")
		if err != nil {
			return err
		}
		defer os.Remove(tmp.Name())
		n, err := io.Copy(tmp, resp.Body)
		if err == nil {
			err = tmp.Sync()
		}
		if err != nil {
			tmp.Close()
			return fmt.Errorf("backup: %w", err)
		}
		// Verify before keeping it.
		if _, err := tmp.Seek(0, io.SeekStart); err != nil {
			return err
		}
		if err := store.New(store.Limits{}).ReadSnapshot(tmp); err != nil {
			tmp.Close()
			return fmt.Errorf("backup: the server sent an invalid snapshot: %w", err)
		}
		name := *out
		if *out == "-" {
			name = "standard output"
			if _, err := tmp.Seek(0, io.SeekStart); err != nil {
				return err
			}
			_, err = io.Copy(os.Stdout, tmp)
			tmp.Close()
			if err != nil {
				return fmt.Errorf("backup: %w", err)
			}
		} else {
			tmp.Close()
			if err := os.Rename(tmp.Name(), *out); err != nil {
				return err
			}
		}
		fmt.Fprintf(os.Stderr, "backup: %s, %s keys, %s, up to version %s\n", name, resp.Header.Get(admin.KeysHeader), size(n), resp.Header.Get(admin.MaxVersionHeader))
		return nil
	}
	return cmd
}

func restoreCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "restore --in FILE --data-dir DIR",
		Short: "Build a data directory from a backup",
		Long: `Builds the data directory DIR (which must not exist or be empty) from a
backup made with mqkv backup; then mqkv serve --data-dir DIR serves it. A
corrupt or truncated backup is refused and nothing is written.`,
		Example: "  mqkv restore --in site.snap --data-dir ./restored\n  mqkv serve --data-dir ./restored",
		Args:    cobra.NoArgs,
	}
	in := cmd.Flags().String("in", "", "backup `file` (required; - for standard input)")
	dir := cmd.Flags().String("data-dir", "", "data `directory` to create (required)")
	cmd.RunE = func(*cobra.Command, []string) error {
		if *in == "" || *dir == "" {
			return errors.New("restore: --in and --data-dir are required")
		}
		f := os.Stdin
		if *in != "-" {
			var err error
			if f, err = os.Open(*in); err != nil {
				return err
			}
			defer f.Close()
		}
		v, n, err := server.Restore(*dir, f)
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "restore: %s holds %d keys, up to version %s\n", *dir, n, v)
		return nil
	}
	return cmd
}

// fetchActivity returns the busiest clients and keys and the slow
// requests, or nil if the endpoint has none (an older server).
func fetchActivity(ctx context.Context, url string) *admin.Activity {
	return orNil(adminJSON[admin.Activity](ctx, url, "/v1/activity"))
}

func printActivity(w io.Writer, a admin.Activity) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "BUSIEST CLIENTS\tREQ/S\t\tHOTTEST KEYS\tREQ/S\n")
	for i := range max(len(a.Clients), len(a.Keys)) {
		var c, k [2]string
		if i < len(a.Clients) {
			c = [2]string{a.Clients[i].Name, fmt.Sprintf("%.1f", a.Clients[i].PerSecond)}
		}
		if i < len(a.Keys) {
			k = [2]string{strconv.Quote(a.Keys[i].Name), fmt.Sprintf("%.1f", a.Keys[i].PerSecond)}
		}
		fmt.Fprintf(tw, "%s\t%s\t\t%s\t%s\n", c[0], c[1], k[0], k[1])
	}
	tw.Flush()
	fmt.Fprintf(w, "(over the last %.0f s)\n", a.WindowSeconds)
	if len(a.Slow) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "SLOW REQUESTS\tCLIENT\tCOMMAND\tKEY\tMS")
		for _, r := range a.Slow {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.1f\n", r.At.Format(time.TimeOnly), r.ClientID, r.Command, strconv.Quote(r.Key), r.MS)
		}
		tw.Flush()
	}
}

// fetchCluster returns the cluster as the node sees it, or nil for a node
// on its own (or if it cannot be had: top shows what it can).
func fetchCluster(ctx context.Context, url string) *cluster.Status {
	return orNil(adminJSON[cluster.Status](ctx, url, "/v1/cluster"))
}

// orNil is v, or nil after an error: what top shows when a part is missing.
func orNil[T any](v T, err error) *T {
	if err != nil {
		return nil
	}
	return &v
}

// terminal reports whether f is a terminal, where screen control codes
// and remarks for people belong.
func terminal(f *os.File) bool { return term.IsTerminal(int(f.Fd())) }
