package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/mqkv/mqkv/client"
)

// conn holds the connection flags every client command shares; each has
// an MQKV_* environment variable as its default.
type conn struct {
	server, clientID, username, password string
	tlsCA, tlsCert, tlsKey               string
	timeout                              time.Duration
	json                                 bool
}

func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}

func (c *conn) flags(fs *pflag.FlagSet) {
	fs.StringVarP(&c.server, "server", "s", env("MQKV_SERVER", "mqtt://127.0.0.1:1883"), "server `URL`: mqtt://, tls://, ws:// or wss://; several members of a cluster, comma-separated, to go on with another when one goes (env MQKV_SERVER)")
	c.identityFlags(fs, "MQTT client `id`; random if empty (env MQKV_CLIENT_ID)")
	timeout := 10 * time.Second
	if d, err := time.ParseDuration(env("MQKV_TIMEOUT", "")); err == nil {
		timeout = d
	}
	fs.DurationVar(&c.timeout, "timeout", timeout, "time allowed for connecting and for each request (env MQKV_TIMEOUT)")
	fs.BoolVar(&c.json, "json", false, "print JSON instead of raw values")
}

// identityFlags are how a client identifies itself to the server (or,
// for mqkv attach, to the broker), and how it checks the server's:
// --client-id (described by idUsage), --username, --password and the
// TLS files.
func (c *conn) identityFlags(fs *pflag.FlagSet, idUsage string) {
	fs.StringVar(&c.clientID, "client-id", env("MQKV_CLIENT_ID", ""), idUsage)
	fs.StringVarP(&c.username, "username", "u", env("MQKV_USERNAME", ""), "username (env MQKV_USERNAME)")
	fs.StringVarP(&c.password, "password", "p", env("MQKV_PASSWORD", ""), "password (env MQKV_PASSWORD, which ps does not show)")
	fs.StringVar(&c.tlsCA, "tls-ca", env("MQKV_TLS_CA", ""), "CA `file` to verify the server with (env MQKV_TLS_CA)")
	fs.StringVar(&c.tlsCert, "tls-cert", env("MQKV_TLS_CERT", ""), "client certificate `file` (env MQKV_TLS_CERT)")
	fs.StringVar(&c.tlsKey, "tls-key", env("MQKV_TLS_KEY", ""), "client key `file` (env MQKV_TLS_KEY)")
}

func (c *conn) dial(ctx context.Context) (*client.Client, error) {
	cfg := client.Config{URL: c.server, ClientID: c.clientID, Username: c.username, Password: c.password, Timeout: c.timeout}
	tc, err := c.tlsConfig()
	if err != nil {
		return nil, err
	}
	cfg.TLS = tc
	dctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	return client.Dial(dctx, cfg)
}

// tlsConfig builds the TLS settings the flags ask for; nil for none.
func (c *conn) tlsConfig() (*tls.Config, error) {
	if c.tlsCA == "" && c.tlsCert == "" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.tlsCA != "" {
		pem, err := os.ReadFile(c.tlsCA)
		if err != nil {
			return nil, err
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s holds no PEM certificate", c.tlsCA)
		}
	}
	if c.tlsCert != "" {
		cert, err := tls.LoadX509KeyPair(c.tlsCert, c.tlsKey)
		if err != nil {
			return nil, err
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// run connects, calls fn, and turns its outcome into the exit code:
// 0 found/applied, 1 not found/not applied, 2 error.
func (c *conn) run(fn func(ctx context.Context, cl *client.Client) (bool, error)) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cl, err := c.dial(ctx)
	if err != nil {
		return err
	}
	defer cl.Close()
	ok, err := fn(ctx, cl)
	if err != nil {
		return err
	}
	if !ok {
		return exitCode(1)
	}
	return nil
}

// jsonValue renders a value for --json: text if it is UTF-8, else base64.
func jsonValue(m map[string]any, v []byte) {
	if utf8.Valid(v) {
		m["value"] = string(v)
	} else {
		m["value_base64"] = v
	}
}

func printJSON(v any) {
	enc := json.NewEncoder(os.Stdout)
	enc.Encode(v)
}

func kvCmds() []*cobra.Command {
	return []*cobra.Command{getCmd(), setCmd(), delCmd(), vdelCmd(), watchCmd(), lockCmd(), keysCmd(), ttlCmd()}
}

func getCmd() *cobra.Command {
	var c conn
	cmd := &cobra.Command{
		Use:   "get KEY",
		Short: "Print a key's value",
		Long:  "Prints the value of KEY as it is stored (no newline added), or with --json its value, version and TTL. Exit status: 0 found, 1 not found, 2 error.",
		Example: `  mqkv get config/site
  mqkv get --json config/site
  MQKV_SERVER=tls://broker:8883 MQKV_TLS_CA=ca.pem mqkv get config/site`,
		Args: cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			return c.run(func(ctx context.Context, cl *client.Client) (bool, error) {
				v, err := cl.Get(ctx, []byte(args[0]))
				if err != nil {
					return false, err
				}
				if !c.json {
					os.Stdout.Write(v.Value)
					if !v.Found {
						say(c, "(nil)")
					} else if terminal(os.Stdout) && (len(v.Value) == 0 || v.Value[len(v.Value)-1] != '\n') {
						fmt.Println() // the prompt starts on its own line
					}
					return v.Found, nil
				}
				out := map[string]any{"key": args[0], "found": v.Found}
				if v.Found {
					jsonValue(out, v.Value)
					out["version"] = v.Version.String()
					if ttl, found, err := cl.TTL(ctx, []byte(args[0])); err == nil && found && ttl > 0 {
						out["ttl_ms"] = ttl.Milliseconds()
					} else if err == nil && found {
						out["ttl_ms"] = nil
					}
				}
				printJSON(out)
				return v.Found, nil
			})
		},
	}
	c.flags(cmd.Flags())
	return cmd
}

func setCmd() *cobra.Command {
	var c conn
	var nx, nex bool
	var px int64
	var ttl time.Duration
	var fence, file string
	var cmd *cobra.Command
	cmd = &cobra.Command{
		Use:   "set KEY [VALUE]",
		Short: "Store a value",
		Long: `Stores VALUE under KEY. The value comes from the argument, from --file, or
from standard input when neither is given (or VALUE is "-"). Exit status: 0
applied, 1 not applied (--nx or --nex condition), 2 error.`,
		Example: `  mqkv set greeting hello
  mqkv set --ttl 30s session/42 active         # expires in 30 s (or --px 30000)
  mqkv set --nx config/site "$(hostname)"       # only if absent
  mqkv set --file firmware.bin firmware/latest
  echo -n 21.5 | mqkv set sensors/temp
  mqkv set --fencing-token "$MQKV_FENCING_TOKEN" guarded/key value`,
		Args: cobra.RangeArgs(1, 2),
		RunE: func(_ *cobra.Command, args []string) error {
			value, err := content("set", file, args)
			if err != nil {
				return err
			}
			if nx && nex {
				return errors.New("set: --nx and --nex exclude each other")
			}
			var opts []client.Option
			switch {
			case nx:
				opts = append(opts, client.If(client.NotExists))
			case nex:
				opts = append(opts, client.If(client.NotExistsOrSame))
			}
			expiry, err := expiryOf(cmd, px, ttl)
			if err != nil {
				return err
			}
			if expiry > 0 {
				opts = append(opts, client.WithTTL(expiry))
			}
			fo, err := fenceOpt(fence)
			if err != nil {
				return fmt.Errorf("set: %w", err)
			}
			opts = append(opts, fo...)
			return c.run(func(ctx context.Context, cl *client.Client) (bool, error) {
				res, err := cl.Set(ctx, []byte(args[0]), value, opts...)
				if err != nil {
					return false, err
				}
				if c.json {
					printJSON(map[string]any{"key": args[0], "applied": res.Applied, "version": res.Version.String()})
				} else if res.Applied {
					say(c, "OK")
				} else {
					say(c, "(not applied: the --nx or --nex condition did not hold)")
				}
				return res.Applied, nil
			})
		},
	}
	c.flags(cmd.Flags())
	cmd.Flags().BoolVar(&nx, "nx", false, "only if the key does not exist")
	cmd.Flags().BoolVar(&nex, "nex", false, "only if the key does not exist or holds the same value")
	cmd.Flags().Int64Var(&px, "px", 0, "expire after this many milliseconds")
	cmd.Flags().DurationVar(&ttl, "ttl", 0, "expire after this `duration` (30s, 5m, 1h; whole milliseconds)")
	cmd.Flags().StringVar(&fence, "fencing-token", "", "fencing token (a version) protecting the write")
	cmd.Flags().StringVarP(&file, "file", "f", "", "read the value from this file")
	return cmd
}

// content is what set stores and pub publishes: args[1], or the file, or
// standard input when neither is given (or args[1] is "-").
func content(cmd, file string, args []string) ([]byte, error) {
	switch {
	case file != "":
		if len(args) == 2 {
			return nil, fmt.Errorf("%s: give the value or --file, not both", cmd)
		}
		return os.ReadFile(file)
	case len(args) == 2 && args[1] != "-":
		return []byte(args[1]), nil
	default:
		return io.ReadAll(os.Stdin)
	}
}

// expiryOf reads --px or --ttl: given, it must be positive (the server
// refuses PX <= 0 too; dropping it would store a key that never expires).
func expiryOf(cmd *cobra.Command, px int64, ttl time.Duration) (time.Duration, error) {
	f := cmd.Flags()
	switch {
	case f.Changed("px") && f.Changed("ttl"):
		return 0, errors.New("set: give --px or --ttl, not both")
	case f.Changed("px"):
		if px <= 0 {
			return 0, fmt.Errorf("set: --px %d: the expiry must be a positive number of milliseconds", px)
		}
		return time.Duration(px) * time.Millisecond, nil
	case f.Changed("ttl"):
		if ttl < time.Millisecond {
			return 0, fmt.Errorf("set: --ttl %v: the expiry must be at least 1ms", ttl)
		}
		return ttl.Truncate(time.Millisecond), nil
	}
	return 0, nil
}

func delCmd() *cobra.Command {
	return deleteCmd(&cobra.Command{
		Use:     "del KEY",
		Short:   "Delete a key",
		Long:    "Deletes KEY. Exit status: 0 deleted, 1 not found, 2 error.",
		Example: "  mqkv del session/42\n  mqkv del --fencing-token \"$MQKV_FENCING_TOKEN\" guarded/key",
		Args:    cobra.ExactArgs(1),
	}, func(ctx context.Context, cl *client.Client, args []string, opts []client.Option) (client.DelResult, error) {
		return cl.Del(ctx, []byte(args[0]), opts...)
	})
}

func vdelCmd() *cobra.Command {
	return deleteCmd(&cobra.Command{
		Use:     "vdel KEY VALUE",
		Short:   "Delete a key if it holds a value",
		Long:    "Deletes KEY only if it holds VALUE. Exit status: 0 deleted, 1 not found or another value, 2 error.",
		Example: "  mqkv vdel lock/printer my-hostname",
		Args:    cobra.ExactArgs(2),
	}, func(ctx context.Context, cl *client.Client, args []string, opts []client.Option) (client.DelResult, error) {
		return cl.VDel(ctx, []byte(args[0]), []byte(args[1]), opts...)
	})
}

// deleteCmd completes del and vdel: connection and fencing flags, output
// and exit status.
func deleteCmd(cmd *cobra.Command, del func(context.Context, *client.Client, []string, []client.Option) (client.DelResult, error)) *cobra.Command {
	var c conn
	var fence string
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		opts, err := fenceOpt(fence)
		if err != nil {
			return err
		}
		return c.run(func(ctx context.Context, cl *client.Client) (bool, error) {
			res, err := del(ctx, cl, args, opts)
			return printDel(c, args[0], res, err)
		})
	}
	c.flags(cmd.Flags())
	cmd.Flags().StringVar(&fence, "fencing-token", "", "fencing token (a version) protecting the delete")
	return cmd
}

func fenceOpt(s string) ([]client.Option, error) {
	if s == "" {
		return nil, nil
	}
	ft, err := client.ParseVersion(s)
	if err != nil {
		return nil, fmt.Errorf("--fencing-token %q: %w", s, err)
	}
	return []client.Option{client.WithFencingToken(ft)}, nil
}

func printDel(c conn, key string, res client.DelResult, err error) (bool, error) {
	if err != nil {
		return false, err
	}
	if c.json {
		out := map[string]any{"key": key, "deleted": res.Deleted}
		if !res.Version.IsZero() {
			out["version"] = res.Version.String()
		}
		printJSON(out)
	} else if res.Deleted == 1 {
		say(c, "OK (deleted)")
	} else {
		say(c, "(nil: nothing deleted)")
	}
	return res.Deleted == 1, nil
}

func watchCmd() *cobra.Command {
	var c conn
	var patterns bool
	cmd := &cobra.Command{
		Use:   "watch KEY...",
		Short: "Print every change to keys until interrupted",
		Long: `Registers for changes to each KEY and prints one line per change, with its
version, until interrupted: "SET key version value" or "DELETE key version"
(or JSON lines with --json). It survives server restarts: after reconnecting
it registers again and reports what changed meanwhile (marked resync).
With --pattern each argument is a glob (sensors/*) and every matching key
is watched, also keys created later.`,
		Example: "  mqkv watch config/site lock/printer\n  mqkv watch --pattern 'sensors/*'\n  mqkv watch --json sensors/temp | jq .",
		Args:    cobra.MinimumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			return c.run(func(ctx context.Context, cl *client.Client) (bool, error) {
				events := make(chan client.Event)
				for _, k := range args {
					watch := cl.Watch
					if patterns {
						watch = cl.WatchPattern
					}
					w, err := watch(ctx, []byte(k))
					if err != nil {
						return false, err
					}
					go func() {
						for e := range w.Events() {
							events <- e
						}
					}()
				}
				for {
					select {
					case <-ctx.Done():
						return true, nil
					case e := <-events:
						printEvent(c.json, e)
					}
				}
			})
		},
	}
	c.flags(cmd.Flags())
	cmd.Flags().BoolVar(&patterns, "pattern", false, "each argument is a glob: watch every key matching it")
	return cmd
}

func printEvent(asJSON bool, e client.Event) {
	op := "SET"
	if e.Deleted {
		op = "DELETE"
	}
	if asJSON {
		out := map[string]any{"op": op, "key": string(e.Key), "version": e.Version.String()}
		if !e.Deleted {
			jsonValue(out, e.Value)
		}
		if e.Resync {
			out["resync"] = true
		}
		printJSON(out)
		return
	}
	line := fmt.Sprintf("%s %s %s", op, strconv.Quote(string(e.Key)), e.Version)
	if !e.Deleted {
		line += " " + strconv.Quote(string(e.Value))
	}
	if e.Resync {
		line += " (resync)"
	}
	fmt.Println(line)
}

func lockCmd() *cobra.Command {
	var c conn
	var ttl, grace time.Duration
	var holder string
	cmd := &cobra.Command{
		Use:   "lock NAME -- COMMAND [ARG...]",
		Short: "Run a command while holding a lease",
		Long: `Waits until the lease NAME is free, takes it, and runs COMMAND while renewing
it (every third of --ttl). The command finds the lease's fencing token in
MQKV_FENCING_TOKEN, to pass with its writes (mqkv set --fencing-token ...).

SIGTERM and SIGHUP sent to mqkv are passed on to the command (SIGINT from a
terminal reaches it directly, as it shares the terminal), and the lease is
kept until the command ends. If the lease is lost (renewals fail for a whole
term, or another holder has it), the command gets SIGTERM, then SIGKILL after
--grace, and mqkv exits 2 saying so. The lease is released only once renewal
has stopped. Exit status: the command's (128+N if a signal N ended it).`,
		Example: `  mqkv lock nightly-job -- ./backup.sh
  mqkv lock --ttl 30s config-writer -- sh -c 'mqkv set --fencing-token "$MQKV_FENCING_TOKEN" config/site v2'`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 1 {
				return errors.New("lock: want NAME -- COMMAND")
			}
			if ttl < 3*client.MinTTL {
				return fmt.Errorf("lock: --ttl %v is below the minimum of %v", ttl, 3*client.MinTTL)
			}
			name, command := args[0], args[1:]
			// Registered before connecting, so that none is missed; the
			// context c.run cancels on SIGINT and SIGTERM ends only the
			// wait for the lease. SIGINT is not passed on: from a terminal
			// the command gets it itself, and twice would mean "abort".
			sigs := make(chan os.Signal, 4)
			signal.Notify(sigs, os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
			defer signal.Stop(sigs)
			var exit error
			err := c.run(func(ctx context.Context, cl *client.Client) (bool, error) {
				lease := cl.Lease(name, holder)
				err := lease.Acquire(ctx, ttl)
				if err == nil && ctx.Err() != nil {
					lease.Release(context.Background()) // interrupted as it was taken
				}
				if ctx.Err() != nil {
					return false, fmt.Errorf("lock: interrupted while waiting for %q", name)
				}
				if err != nil {
					return false, err
				}
				// Signals of the wait are not the command's.
				for len(sigs) > 0 {
					<-sigs
				}
				var lostErr error
				exit, lostErr = runLocked(lease, ttl, grace, sigs, command, name)
				if lostErr != nil {
					return false, lostErr
				}
				return true, nil
			})
			if err != nil {
				return err
			}
			var ee *exec.ExitError
			if errors.As(exit, &ee) {
				if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					return exitCode(128 + int(ws.Signal()))
				}
				return exitCode(ee.ExitCode())
			}
			return exit
		},
	}
	c.flags(cmd.Flags())
	cmd.Flags().DurationVar(&ttl, "ttl", 10*time.Second, "lease term; renewed every third of it")
	cmd.Flags().DurationVar(&grace, "grace", 10*time.Second, "time the command has to stop after SIGTERM when the lease is lost")
	cmd.Flags().StringVar(&holder, "holder", "", "holder name written in the lease (default: the client id)")
	return cmd
}

// runLocked runs command while lease is renewed: exit is how the command
// ended; lost is set when the lease was lost under it.
func runLocked(lease *client.Lease, ttl, grace time.Duration, sigs <-chan os.Signal, command []string, name string) (exit, lost error) {
	// Renewal outlives a signal: the command keeps the lease while it
	// shuts down.
	kctx, stopRenewal := context.WithCancel(context.Background())
	renewal := lease.KeepAlive(kctx, ttl, ttl/3)
	defer func() {
		// Release only once no renewal can follow it.
		stopRenewal()
		for range renewal {
		}
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := lease.Release(rctx); err != nil {
			fmt.Fprintf(os.Stderr, "mqkv: lock: releasing %q: %v\n", name, err)
		}
	}()
	run := exec.Command(command[0], command[1:]...)
	run.Stdin, run.Stdout, run.Stderr = os.Stdin, os.Stdout, os.Stderr
	run.Env = append(os.Environ(), "MQKV_FENCING_TOKEN="+lease.Token().String(), "MQKV_LOCK_NAME="+name)
	if err := run.Start(); err != nil {
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- run.Wait() }()
	var kill <-chan time.Time
	watch := renewal
	for {
		select {
		case exit = <-done:
			return exit, lost
		case sig := <-sigs:
			if sig != os.Interrupt {
				_ = run.Process.Signal(sig)
			}
		case err, ok := <-watch:
			if !ok {
				watch = nil // ended: wait for the command alone
				continue
			}
			lost = fmt.Errorf("lock: lease %q lost, command stopped: %w", name, err)
			fmt.Fprintf(os.Stderr, "mqkv: lock: lease %q lost (%v): stopping the command\n", name, err)
			_ = run.Process.Signal(syscall.SIGTERM)
			kill = time.After(grace)
		case <-kill:
			_ = run.Process.Kill()
		}
	}
}
