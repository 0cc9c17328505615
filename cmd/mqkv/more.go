package main

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/mqkv/mqkv/client"
	"github.com/mqkv/mqkv/internal/server"
)

// say tells a person at a terminal what happened ("OK", "(nil)"), on
// stderr, so that piped output and exit codes stay as scripts expect.
func say(c conn, format string, args ...any) {
	if !c.json && terminal(os.Stderr) && terminal(os.Stdout) {
		fmt.Fprintf(os.Stderr, format+"\n", args...)
	}
}

func keysCmd() *cobra.Command {
	var c conn
	var count, limit int
	cmd := &cobra.Command{
		Use:   "keys [GLOB]",
		Short: "List the keys matching a glob (all keys by default)",
		Long: `Lists the keys matching GLOB (*, ?, [a-c], \ escapes; default *) in key
order, one per line (or JSON lines with --json), reading the store a page at
a time with SCAN. A key present for the whole listing is listed exactly once
even while others change. Exit status: 0 some listed, 1 none, 2 error.`,
		Example: "  mqkv keys\n  mqkv keys 'sensors/*'\n  mqkv keys --json 'lock/*' | jq -r .key",
		Args:    cobra.MaximumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			pattern := "*"
			if len(args) == 1 {
				pattern = args[0]
			}
			return c.run(func(ctx context.Context, cl *client.Client) (bool, error) {
				n := 0
				err := cl.Scan(ctx, []byte(pattern), count, func(k []byte) bool {
					if c.json {
						printJSON(map[string]any{"key": string(k)})
					} else {
						fmt.Println(string(k))
					}
					n++
					return limit <= 0 || n < limit
				})
				if err == nil && n == 0 {
					say(c, "(no keys match %s)", pattern)
				}
				return n > 0, err
			})
		},
	}
	c.flags(cmd.Flags())
	cmd.Flags().IntVar(&count, "count", 0, "keys per SCAN page (0: the server's default)")
	cmd.Flags().IntVar(&limit, "limit", 0, "stop after this many keys (0: all)")
	return cmd
}

func ttlCmd() *cobra.Command {
	var c conn
	cmd := &cobra.Command{
		Use:   "ttl KEY",
		Short: "Print the time a key has left",
		Long: `Prints the time KEY has left before it expires (as a duration, or "no expiry";
with --json the milliseconds, null for none). Exit status: 0 found, 1 not
found, 2 error.`,
		Example: "  mqkv ttl session/42",
		Args:    cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			return c.run(func(ctx context.Context, cl *client.Client) (bool, error) {
				ttl, found, err := cl.TTL(ctx, []byte(args[0]))
				if err != nil {
					return false, err
				}
				switch {
				case c.json:
					out := map[string]any{"key": args[0], "found": found}
					if found {
						out["ttl_ms"] = nil
						if ttl > 0 {
							out["ttl_ms"] = ttl.Milliseconds()
						}
					}
					printJSON(out)
				case !found:
					say(c, "(nil)")
				case ttl == 0:
					fmt.Println("no expiry")
				default:
					fmt.Println(ttl.Round(time.Millisecond))
				}
				return found, nil
			})
		},
	}
	c.flags(cmd.Flags())
	return cmd
}

func versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print mqkv's version, commit and Go version",
		Args:  cobra.NoArgs,
		Run: func(*cobra.Command, []string) {
			fmt.Println(versionString())
		},
	}
}

// versionString is the version with the commit it was built from (when
// the build knows it) and the Go version.
func versionString() string {
	commit, modified := "unknown", ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				commit = s.Value
				if len(commit) > 12 {
					commit = commit[:12]
				}
			case "vcs.modified":
				if b, _ := strconv.ParseBool(s.Value); b {
					modified = "+modified"
				}
			}
		}
	}
	return fmt.Sprintf("mqkv %s (commit %s%s, %s, %s/%s)", server.Version, commit, modified, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
